// run_profile(): the order of the measurements, the mode sizes, the NVMe path checks (and the
// temporary directory used when no path is configured), and the assembly of the report.
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>

#include "profile/profile_internal.hpp"
#include "strata/adam.hpp"
#include "strata/communicator.hpp"
#include "strata/device.hpp"
#include "strata/device_query.hpp"
#include "strata/error.hpp"
#include "strata/io_file.hpp"
#include "strata/log.hpp"
#include "strata/units.hpp"

namespace strata {
namespace profile {

Sizes mode_sizes(ProfileMode mode) {
  constexpr std::uint64_t K = 1ULL << 10, M = 1ULL << 20, G = 1ULL << 30;
  Sizes s;
  switch (mode) {
    case ProfileMode::kTiny:
      s.block_sizes = {128 * K, 1 * M};
      s.queue_depths = {1, 8};
      s.rings = {1};
      s.both_engines = false;
      s.io_region = 4 * M;
      s.io_point_s = 0.01;
      s.io_passes = 1;
      s.copy_sizes = {1 * M};
      s.adam_elements = 256 * K;
      s.gpu_adam_elements = 1 * M;
      s.triad_bytes = 24 * M;
      s.collective_sizes = {256 * K};
      s.sample_elements = 256 * K;
      s.sample_sub_groups = 3;
      s.sample_repeats = 1;
      s.max_streams = 4;
      s.stream_region = 4 * M;
      s.stream_s = 0.02;
      s.engine_check_steps = 3;
      break;
    case ProfileMode::kQuick:
      s.block_sizes = {128 * K, 1 * M, 8 * M};
      s.queue_depths = {1, 32};
      s.rings = {1};
      s.io_region = 64 * M;
      s.io_point_s = 0.05;
      s.io_passes = 2;
      s.copy_sizes = {1 * M, 16 * M, 64 * M};
      s.adam_elements = 4 * M;
      s.gpu_adam_elements = 16 * M;
      s.triad_bytes = 96 * M;
      s.collective_sizes = {1 * M, 16 * M};
      s.sample_elements = 4 * M;
      s.sample_sub_groups = 4;
      s.sample_repeats = 3;
      s.stream_region = 32 * M;
      s.stream_s = 0.1;
      s.engine_check_steps = 3;
      break;
    case ProfileMode::kDefault:
      s.block_sizes = {128 * K, 512 * K, 1 * M, 2 * M, 8 * M};
      s.queue_depths = {1, 8, 32, 128};
      s.rings = {1, 2};
      s.io_region = 128 * M;
      s.io_point_s = 0.06;
      s.io_passes = 2;
      s.copy_sizes = {1 * M, 4 * M, 16 * M, 64 * M, 256 * M, 1 * G};
      s.adam_elements = 16 * M;
      s.gpu_adam_elements = 64 * M;
      s.triad_bytes = 192 * M;
      s.collective_sizes = {1 * M, 16 * M};
      s.sample_elements = 8 * M;
      s.sample_sub_groups = 4;
      s.sample_repeats = 5;
      s.stream_region = 64 * M;
      s.stream_s = 0.2;
      s.engine_check_steps = 5;
      break;
    case ProfileMode::kFull:
      s.block_sizes = {128 * K, 256 * K, 512 * K, 1 * M, 2 * M, 4 * M, 8 * M};
      s.queue_depths = {1, 2, 4, 8, 16, 32, 64, 128};
      s.rings = {1, 2, 4};
      s.io_region = 512 * M;
      s.io_point_s = 0.15;
      s.io_passes = 3;
      s.copy_sizes = {1 * M, 2 * M, 4 * M, 8 * M, 16 * M, 32 * M, 64 * M, 128 * M, 256 * M, 512 * M, 1 * G};
      s.adam_elements = 64 * M;
      s.gpu_adam_elements = 256 * M;
      s.triad_bytes = 1536 * M;
      s.collective_sizes = {1 * M, 16 * M, 64 * M, 256 * M};
      s.sample_elements = 32 * M;
      s.sample_sub_groups = 6;
      s.sample_repeats = 5;
      s.stream_region = 128 * M;
      s.stream_s = 0.5;
      s.engine_check_steps = 7;
      break;
  }
  return s;
}

namespace {

// A temporary NVMe directory, removed with everything in it on every exit path.
class TempDir {
 public:
  TempDir() {
    std::error_code ec;
    std::string base = std::filesystem::temp_directory_path(ec).string();
    if (ec || base.empty()) base = "/tmp";
    // O_DIRECT is not real on tmpfs; prefer /var/tmp there.
    if (is_tmpfs(base) && ::access("/var/tmp", W_OK) == 0 && !is_tmpfs("/var/tmp")) base = "/var/tmp";
    std::string templ = base + "/strata-profile-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    if (!::mkdtemp(buf.data()))
      throw IoError("mkdtemp", templ, 0, 0, errno, "temporary directory for the NVMe measurements");
    path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
    if (ec) log_warn("profile: could not remove ", path_, ": ", ec.message());
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

IoEngineKind engine_kind(const std::string& name) {
  if (name == "io_uring") return IoEngineKind::kIoUring;
  if (name == "threads") return IoEngineKind::kThreads;
  return IoEngineKind::kAuto;
}

const IoPoint* find_point(const std::vector<IoPoint>& pts, const std::string& path,
                          const std::string& engine, const std::string& op, std::uint64_t bs,
                          std::uint32_t qd, std::uint32_t rings) {
  for (const auto& p : pts)
    if (p.path == path && p.engine == engine && p.op == op && p.block_size == bs &&
        p.queue_depth == qd && p.rings == rings)
      return &p;
  return nullptr;
}

}  // namespace
}  // namespace profile

std::vector<PathInfo> check_nvme_paths(const NvmeTierConfig& nvme) {
  std::vector<PathInfo> out;
  for (const auto& path : nvme.paths) {
    auto bad = [&](const std::string& why) {
      fail(ErrorCode::kInvalidArgument, strcat("tiers.nvme.paths: ", path, ": ", why));
    };
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) {
      const int e = errno;
      if (e == ENOENT) bad("does not exist (create the directory first)");
      bad(strcat("cannot be inspected: ", std::strerror(e)));
    }
    if (S_ISLNK(st.st_mode)) bad("is a symbolic link (give the real directory)");
    if (!S_ISDIR(st.st_mode)) bad("is not a directory");
    // A real write test: permissions, read-only mounts and ACLs all show up here.
    std::string probe = path + "/.strata-profile-probe-XXXXXX";
    std::vector<char> buf(probe.begin(), probe.end());
    buf.push_back('\0');
    const int fd = ::mkstemp(buf.data());
    if (fd < 0) bad(strcat("is not writable: ", std::strerror(errno)));
    ::close(fd);
    ::unlink(buf.data());
    if (nvme.direct_io == DirectIoMode::kRequired && is_tmpfs(path))
      bad("is on tmpfs, which has no O_DIRECT, but tiers.nvme.direct_io is required "
          "(use a directory on an NVMe file system, or direct_io: auto)");
    out.push_back(profile::describe_path(path));
  }
  return out;
}

namespace profile {
namespace {

// Distinct block devices under the paths (mount sources; unknown ones count as distinct).
std::uint32_t distinct_devices(const std::vector<PathInfo>& paths) {
  std::vector<std::string> seen;
  for (const auto& p : paths) {
    const std::string key = p.device.empty() ? p.path : p.device;
    if (std::find(seen.begin(), seen.end(), key) == seen.end()) seen.push_back(key);
  }
  return std::max<std::uint32_t>(1, static_cast<std::uint32_t>(seen.size()));
}

std::string fixed2(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

bool uses_nvme(const OffloadConfig& o) {
  return o.optimizer.tier == Tier::kNvme || o.gradients.tier == Tier::kNvme ||
         o.params.tier == Tier::kNvme;
}

}  // namespace
}  // namespace profile

ProfileReport run_profile(const Config& config, const ProfileOptions& options) {
  using namespace profile;
  Stopwatch total;
  ProfileReport r;
  r.config_source = config.source;
  r.mode = options.mode;
  Communicator* comm = options.comm;
  r.rank = comm ? comm->rank() : 0;
  r.world = comm ? comm->size() : 1;
  Sizes sizes = mode_sizes(options.mode);
  if (options.sample_repeats) sizes.sample_repeats = options.sample_repeats;
  if (!(options.target_overhead_s >= 0))
    fail(ErrorCode::kInvalidArgument, "profile: the target overhead must be >= 0 seconds");
  // Only rank 0 reports progress; every rank measures the same things at the same time.
  const Progress progress = r.rank == 0 ? options.progress : Progress{};
  auto sync = [&] {
    if (comm) comm->barrier();
  };
  Stopwatch phase_clock;
  std::string phase_name;
  auto phase = [&](const std::string& s) {
    if (!phase_name.empty()) r.phase_seconds.emplace_back(phase_name, phase_clock.seconds());
    sync();
    phase_name = s;
    phase_clock = Stopwatch();
    if (progress && !s.empty()) progress("== " + s);
  };

  // NVMe paths: the configured ones (checked), or a temporary directory.
  std::vector<PathInfo> checked = check_nvme_paths(config.tiers.nvme);
  std::unique_ptr<TempDir> temp;
  std::vector<std::string> paths = config.tiers.nvme.paths;
  if (paths.empty()) {
    temp = std::make_unique<TempDir>();
    paths.push_back(temp->path());
    const PathInfo info = describe_path(temp->path());
    r.notes.push_back(strcat("no NVMe path configured (tiers.nvme.paths is empty): measured in the "
                             "temporary directory ", temp->path(), " (", info.filesystem, " on ",
                             info.device, "), removed afterwards; its I/O settings are not written "
                             "to a tuned config"));
    if (config.tiers.nvme.direct_io == DirectIoMode::kRequired && is_tmpfs(temp->path()))
      fail(ErrorCode::kInvalidArgument,
           strcat("the temporary directory ", temp->path(),
                  " is on tmpfs and tiers.nvme.direct_io is required: configure tiers.nvme.paths"));
  }
  r.environment = collect_environment(paths, adam_path_name(adam_default_path()));
  if (temp) r.environment.paths.front().temporary = true;
  log_info("profile: ", profile_mode_name(options.mode), " mode, load average ",
           r.environment.load_average_1m, comm ? strcat(", rank ", r.rank, " of ", r.world) : "");

  // 1. NVMe through the I/O engine (every rank of the launch at once).
  phase("setup");
  for (const auto& p : paths) {
    phase("NVMe sweep: " + p);
    auto pts = sweep_io(config, p, sizes, progress);
    r.io.insert(r.io.end(), pts.begin(), pts.end());
  }

  // 2. Host <-> device copies and GPU Adam (CUDA only; the host-emulated device is no GPU).
  // This process's GPU on the node, by the rule the engine's storage uses (LOCAL_RANK, ...):
  // every rank of a launch measures its own GPU, and the NCCL communicator below sits on it.
  const int ordinal = local_device_ordinal(
      r.rank, static_cast<int>(config.ranks_per_node()),
      static_cast<int>(query_cuda_devices().devices.size()));
  std::unique_ptr<Device> gpu;
  if (r.environment.has_gpu && config.runtime.device != DeviceKind::kHost) {
    try {
      gpu = make_device(DeviceKind::kCuda, ordinal);
    } catch (const Error& e) {
      r.copies_skipped = std::string("skipped: the GPU could not be used: ") + e.what();
    }
  } else if (!r.environment.has_gpu) {
    r.copies_skipped = "skipped: " + r.environment.gpu;
  } else {
    r.copies_skipped = "skipped: runtime.device is host";
  }
  phase("host <-> device copies, GPU Adam");
  if (gpu) {
    r.copies = measure_copies(*gpu, sizes, progress);
    r.gpu_adam = measure_gpu_adam(config, *gpu, sizes.gpu_adam_elements);
  } else {
    r.gpu_adam.skipped = r.copies_skipped;
  }
  if (progress && !gpu) progress("host <-> device copies, GPU Adam: " + r.copies_skipped);

  // 3. CPU Adam and the memory-bandwidth reference.
  phase("CPU Adam, memory bandwidth (triad)");
  r.cpu_adam = measure_cpu_adam(config, sizes.adam_elements);
  r.triad_threads = config.runtime.cpu_threads ? config.runtime.cpu_threads
                                               : std::max(1u, std::thread::hardware_concurrency());
  r.triad_bytes_per_second = measure_triad(sizes.triad_bytes, r.triad_threads);
  if (progress)
    progress(strcat("CPU Adam (", r.cpu_adam.device, "): ", format_count(static_cast<std::uint64_t>(
                                                               r.cpu_adam.params_per_second)),
                    " params/s; triad ", format_rate(r.triad_bytes_per_second)));

  // 4. Collectives: the real communicator of a multi-process launch, or the configured
  //    world.network_bandwidth; never threads of this process.
  phase("collectives");
  Bandwidths& bw = r.bandwidths;
  if (config.world.ranks < 2 && r.world < 2) {
    r.collectives_skipped = "skipped: 1 rank (world.ranks = 1), no collective in a step";
  } else if (comm && r.world > 1) {
    std::unique_ptr<Communicator> nccl;
    const bool want_nccl = config.runtime.communicator == CommBackend::kNccl ||
                           (config.runtime.communicator == CommBackend::kAuto && gpu);
    if (want_nccl && nccl_available() && gpu) {
      try {
        NcclBootstrap boot;
        boot.host = comm;
        nccl = make_nccl_communicator(boot, ordinal, config.runtime.collective_timeout_s);
      } catch (const Error& e) {
        r.notes.push_back(strcat("NCCL could not start (", e.what(), "): measured ", comm->backend_name()));
      }
    }
    r.collectives = nccl ? measure_collectives(config, *nccl, *comm, gpu.get(), sizes, progress)
                         : measure_collectives(config, *comm, *comm, nullptr, sizes, progress);
    bw.network_source = strcat("measured: ", nccl ? "nccl" : comm->backend_name(), " over ", r.world,
                               " processes");
    if (static_cast<std::uint32_t>(r.world) != config.world.ranks)
      r.notes.push_back(strcat("the launch has ", r.world, " processes, the config ", config.world.ranks,
                               " ranks: the model uses the bus bandwidth measured with ", r.world));
  } else if (config.world.network_bandwidth > 0) {
    bw.network_source = strcat("configured: world.network_bandwidth = ",
                               format_rate(static_cast<double>(config.world.network_bandwidth)),
                               " (not measured: not launched across processes)");
    r.collectives_skipped = strcat("not measured: not launched across processes (run under mpirun to "
                                   "measure the real communicator); the model uses ",
                                   bw.network_source);
  } else {
    r.collectives_skipped =
        "not measured: not launched across processes (run under mpirun to measure the real "
        "communicator, or set world.network_bandwidth); the network leg is not counted";
  }
  if (progress && r.collectives.empty()) progress("collectives: " + r.collectives_skipped);

  // 5. The sample step through the real tiers (every rank at once under a launch).
  phase("sample step (the engine's step, optimizer state on NVMe)");
  const std::uint64_t elements = std::min<std::uint64_t>(config.zero.sub_group_size, sizes.sample_elements);
  r.sample = run_sample_step(config, paths, elements, sizes.sample_sub_groups, sizes.sample_repeats,
                             progress, sync);

  // 6. How ranks share a node (docs/performance.md "Ranks on a node").
  NodeSharing& sh = r.sharing;
  sh.ranks_per_node = std::min(config.ranks_per_node(), std::max<std::uint32_t>(config.world.ranks, 1));
  sh.local_processes = 1;
  if (comm && options.local_processes) {
    sh.local_processes = options.local_processes;
  } else if (comm) {  // ranks whose host name hashes like this one's
    const double mine = static_cast<double>(std::hash<std::string>{}(r.environment.hostname) % (1ULL << 52));
    std::uint32_t local = 0;
    std::uint32_t bits[2];
    std::memcpy(bits, &mine, sizeof mine);
    std::vector<std::uint32_t> all(2 * static_cast<std::size_t>(r.world));
    comm->all_gather(bits, all.data(), 2, DType::kFp32);
    for (int k = 0; k < r.world; ++k) {
      double x;
      std::memcpy(&x, all.data() + 2 * k, sizeof x);
      local += x == mine;
    }
    sh.local_processes = std::max<std::uint32_t>(local, 1);
  }
  sh.nvme_devices = std::min(distinct_devices(r.environment.paths), sh.ranks_per_node);
  const std::uint32_t cores = std::max(1u, std::thread::hardware_concurrency());
  sh.cores_per_rank = static_cast<double>(cores) / sh.ranks_per_node;
  if (sh.ranks_per_node > sh.local_processes) {
    phase("node sharing: concurrent NVMe streams");
    if (sh.local_processes == 1) {
      sh.nvme_streams = std::min(sh.ranks_per_node, sizes.max_streams);
      const StreamRates sr = measure_streams(config, paths.front(), sh.nvme_streams,
                                             sizes.stream_region, sizes.stream_s);
      sh.nvme_single_read_bps = sr.single_read;
      sh.nvme_single_write_bps = sr.single_write;
      sh.nvme_aggregate_read_bps = sr.aggregate_read;
      sh.nvme_aggregate_write_bps = sr.aggregate_write;
      // A rank's share: the aggregate of the streams (saturated beyond max_streams) times the
      // devices, split over the node's ranks, relative to what one stream reached alone.
      auto factor = [&](double agg, double single) {
        return single > 0 ? std::min(1.0, agg * sh.nvme_devices / (sh.ranks_per_node * single)) : 1.0;
      };
      sh.nvme_read_factor = factor(sr.aggregate_read, sr.single_read);
      sh.nvme_write_factor = factor(sr.aggregate_write, sr.single_write);
      sh.notes.push_back(strcat("NVMe: ", sh.ranks_per_node, " ranks per node share ", sh.nvme_devices,
                                " device(s); ", sh.nvme_streams, " concurrent streams reached read ",
                                format_rate(sr.aggregate_read), " / write ", format_rate(sr.aggregate_write),
                                " against one stream's ", format_rate(sr.single_read), " / ",
                                format_rate(sr.single_write), ": a rank gets x", fixed2(sh.nvme_read_factor),
                                " (read), x", fixed2(sh.nvme_write_factor), " (write) of the sample's rates"));
      if (progress) progress(sh.notes.back());
    } else {
      // Every local process measured at once: scale the rest of the node's ranks in linearly.
      sh.nvme_read_factor = sh.nvme_write_factor =
          static_cast<double>(sh.local_processes) / sh.ranks_per_node;
      sh.notes.push_back(strcat("NVMe: ", sh.local_processes, " processes measured at once on this "
                                "node; the config has ", sh.ranks_per_node,
                                " ranks per node: rates scaled by x", fixed2(sh.nvme_read_factor)));
    }
  } else if (sh.ranks_per_node > 1) {
    sh.notes.push_back(strcat("NVMe and CPU: the ", sh.local_processes, " ranks of this node ran the "
                              "measurements at the same time: the rates are already shared"));
  }
  // CPU: the node's cores and memory bandwidth are split over its ranks. The sample's Adam rate was
  // measured with runtime.cpu_threads threads (0 = all cores) while local_processes ranks ran.
  {
    const double threads = config.runtime.cpu_threads ? config.runtime.cpu_threads : cores;
    const double demand = threads * sh.ranks_per_node;         // threads the node's ranks want
    const double measured_with = threads * sh.local_processes;  // threads that ran at once
    // A rank's share of the cores: min(1, cores / demand); the measurement had min(1, cores /
    // measured_with). (Adam is bound by memory bandwidth, which the cores share the same way.)
    const double c = static_cast<double>(cores);
    sh.cpu_factor = std::min(1.0, c / std::max(demand, 1.0)) / std::min(1.0, c / std::max(measured_with, 1.0));
    if (sh.cpu_factor < 1.0)
      sh.notes.push_back(strcat("CPU: ", sh.ranks_per_node, " ranks x ", threads, " Adam threads on ", cores,
                                " cores (", sh.local_processes, " measured at once): a rank's Adam rate x",
                                fixed2(sh.cpu_factor), "; the contention model gives each rank ",
                                fixed2(sh.cores_per_rank), " cores"));
  }

  // 7. The model for the configured step (per rank).
  bw.nvme_read_bps = r.sample.tier_read_bps * sh.nvme_read_factor;
  bw.nvme_write_bps = r.sample.tier_write_bps * sh.nvme_write_factor;
  bw.nvme_duplex = false;
  bw.nvme_mixed_bps = r.sample.tier_mixed_bps * std::min(sh.nvme_read_factor, sh.nvme_write_factor);
  bw.cpu_adam_params_per_s = r.sample.adam_params_per_s * sh.cpu_factor;
  bw.cpu_s_per_nvme_byte = r.sample.cpu_s_per_nvme_byte;
  bw.cpu_s_per_adam_element = r.sample.cpu_s_per_adam_element;
  bw.cores = std::max(1.0, sh.cores_per_rank);
  if (r.gpu_adam.measured) bw.gpu_adam_params_per_s = r.gpu_adam.params_per_second;
  for (const auto& c : r.copies) {  // pinned, largest size
    if (!c.pinned) continue;
    (c.direction == "host_to_device" ? bw.h2d_bps : bw.d2h_bps) = c.bytes_per_second;
  }
  if (!r.collectives.empty()) {
    for (const auto& c : r.collectives)  // the largest size wins (the list is in size order)
      (c.collective == "reduce_scatter" ? bw.reduce_scatter_busbw : bw.all_gather_busbw) =
          c.busbw_bytes_per_second;
  } else if (config.world.network_bandwidth > 0) {
    bw.reduce_scatter_busbw = bw.all_gather_busbw = static_cast<double>(config.world.network_bandwidth);
  }
  r.plan = make_plan(config);
  r.configured = predict_step(config, r.plan.configured, bw);
  if (!bw.network_source.empty() && r.configured.network_s > 0)
    r.configured.notes.push_back("network leg: " + bw.network_source);

  // 8. The engine check: a real multi-rank Engine step against its prediction (launches only).
  phase("engine check");
  if (comm && r.world > 1) {
    // The sample step's state per rank, in its sub-groups: its legs are the prediction's inputs.
    r.engine_check = run_engine_check(config, paths, *comm, bw, r.sample,
                                      elements * sizes.sample_sub_groups * static_cast<std::uint64_t>(r.world),
                                      elements, sizes.engine_check_steps, progress);
    if (progress)
      progress(strcat("engine check: predicted ", r.engine_check.predicted_s, " s, measured ",
                      r.engine_check.measured_median_s, " s (median of ",
                      r.engine_check.measured_s.size(), ")"));
  } else {
    r.engine_check.skipped = "skipped: not launched across processes (run under mpirun with 2 or "
                             "more processes to check a multi-rank engine step)";
  }
  phase("");

  // 9. Recommendations and the tuned config.
  const NvmeTierConfig& nv = config.tiers.nvme;
  std::string configured_engine = io_engine_name(nv.engine);
  if (nv.engine == IoEngineKind::kAuto)
    for (const auto& p : r.io)
      if (p.block_size == nv.block_size && p.queue_depth == nv.queue_depth && p.rings == nv.io_threads) {
        configured_engine = p.engine;  // the engine the sweep measured at the configured point
        break;
      }
  r.io_recommendations = recommend_io(r.io, nv, configured_engine);
  Bandwidths tuned_bw = bw;
  const bool nvme_configured = !nv.paths.empty();
  if (!r.io_recommendations.empty() && nvme_configured) {
    const auto& rec = r.io_recommendations.front();
    // Scale the tier-store rates by what the recommended I/O settings gain over the configured
    // ones in the raw sweep.
    const IoPoint* cr = find_point(r.io, rec.path, configured_engine, "read", nv.block_size, nv.queue_depth, nv.io_threads);
    const IoPoint* cw = find_point(r.io, rec.path, configured_engine, "write", nv.block_size, nv.queue_depth, nv.io_threads);
    if (cr && cw && cr->bytes_per_second > 0 && cw->bytes_per_second > 0) {
      tuned_bw.nvme_read_bps *= std::max(1.0, rec.read_bps / cr->bytes_per_second);
      tuned_bw.nvme_write_bps *= std::max(1.0, rec.write_bps / cw->bytes_per_second);
    }
  }
  r.placement = recommend_placement(config, tuned_bw, options.target_overhead_s, nvme_configured);
  r.tuned = config;
  if (!r.io_recommendations.empty() && nvme_configured) {
    const auto& rec = r.io_recommendations.front();
    r.tuned.tiers.nvme.engine = engine_kind(rec.engine);
    r.tuned.tiers.nvme.block_size = rec.block_size;
    r.tuned.tiers.nvme.queue_depth = rec.queue_depth;
    r.tuned.tiers.nvme.io_threads = rec.rings;
    r.tuned_notes.push_back(rec.configured_kept ? "I/O settings: the configured ones (within noise of the best)"
                                                : "I/O settings: the recommended ones");
  } else if (!nvme_configured) {
    r.tuned_notes.push_back("I/O settings: not changed (no NVMe path configured; the measurements "
                            "in the temporary directory describe its disk, not your NVMe)");
  }
  if (r.placement.found && !(uses_nvme(r.placement.choice.offload) && !nvme_configured)) {
    r.tuned.zero.stage = r.placement.choice.stage;
    r.tuned.offload = r.placement.choice.offload;
    r.tuned_notes.push_back("placement: " + r.placement.choice.description);
  } else if (r.placement.found) {
    r.tuned_notes.push_back("placement: not changed (the recommended " + r.placement.choice.description +
                            " needs tiers.nvme.paths)");
  }
  try {
    r.tuned = parse_config(to_yaml(r.tuned), "<tuned>");
  } catch (const Error& e) {
    fail(ErrorCode::kInternal, std::string("profile: the tuned config does not load: ") + e.what());
  }
  r.tuned.source = config.source;
  (void)checked;
  sync();
  r.elapsed_s = total.seconds();
  return r;
}

}  // namespace strata
