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

namespace {

constexpr std::uint64_t K = 1ULL << 10, M = 1ULL << 20, G = 1ULL << 30;

// first, 2 * first, 4 * first, ... up to last.
std::vector<std::uint64_t> doubling(std::uint64_t first, std::uint64_t last) {
  std::vector<std::uint64_t> v;
  for (std::uint64_t x = first; x <= last; x *= 2) v.push_back(x);
  return v;
}

}  // namespace

// Each knob is one row: its value in the modes tiny (tests: the least that exercises every
// path), quick, default and full.
Sizes mode_sizes(ProfileMode mode) {
  const auto pick = [mode]<typename T>(T tiny, T quick, T standard, T full) {
    switch (mode) {
      case ProfileMode::kTiny: return tiny;
      case ProfileMode::kQuick: return quick;
      case ProfileMode::kDefault: return standard;
      case ProfileMode::kFull: return full;
    }
    return standard;
  };
  using U64s = std::vector<std::uint64_t>;
  using U32s = std::vector<std::uint32_t>;
  Sizes s;
  s.block_sizes = pick(U64s{128 * K, 1 * M}, U64s{128 * K, 1 * M, 8 * M},
                       U64s{128 * K, 512 * K, 1 * M, 2 * M, 8 * M}, doubling(128 * K, 8 * M));
  s.queue_depths =
      pick(U32s{1, 8}, U32s{1, 32}, U32s{1, 8, 32, 128}, U32s{1, 2, 4, 8, 16, 32, 64, 128});
  s.rings = pick(U32s{1}, U32s{1}, U32s{1, 2}, U32s{1, 2, 4});
  s.both_engines = mode != ProfileMode::kTiny;
  s.io_region = pick(4 * M, 64 * M, 128 * M, 512 * M);
  s.io_point_s = pick(0.01, 0.05, 0.06, 0.15);
  s.io_passes = pick(1u, 2u, 2u, 3u);
  s.copy_sizes = pick(U64s{1 * M}, U64s{1 * M, 16 * M, 64 * M},
                      U64s{1 * M, 4 * M, 16 * M, 64 * M, 256 * M, 1 * G}, doubling(1 * M, 1 * G));
  s.adam_elements = pick(256 * K, 16 * M, 16 * M, 64 * M);  // quick: beyond the caches too
  s.gpu_adam_elements = pick(1 * M, 16 * M, 64 * M, 256 * M);
  s.triad_bytes = pick(24 * M, 96 * M, 192 * M, 1536 * M);
  s.collective_sizes = pick(U64s{256 * K}, U64s{1 * M, 16 * M}, U64s{1 * M, 16 * M},
                            U64s{1 * M, 16 * M, 64 * M, 256 * M});
  s.sample_elements = pick(256 * K, 4 * M, 8 * M, 32 * M);
  s.sample_sub_groups = pick(3u, 4u, 4u, 6u);
  s.sample_repeats = pick(1u, 3u, 5u, 5u);
  s.max_streams = pick(4u, 8u, 8u, 8u);
  s.stream_region = pick(4 * M, 32 * M, 64 * M, 128 * M);
  s.stream_s = pick(0.02, 0.1, 0.2, 0.5);
  s.engine_check_steps = pick(3, 3, 5, 7);
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
    if (is_tmpfs(base) && ::access("/var/tmp", W_OK) == 0 && !is_tmpfs("/var/tmp"))
      base = "/var/tmp";
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
  return enum_from_name<IoEngineKind>(name).value_or(IoEngineKind::kAuto);
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

// One run of run_profile(): the report being filled and what its steps share. The steps run in
// this order on every rank of a launch (phase() is a barrier): paths, 1. NVMe sweep, 2. device
// copies and GPU Adam, 3. CPU Adam and triad, 4. collectives, 5. sample step, 6. node sharing,
// 7. the model of the configured step, 8. engine check, 9. recommendations and the tuned config.
class ProfileRun {
 public:
  ProfileRun(const Config& config, const ProfileOptions& options)
      : config_(config), options_(options), comm_(options.comm) {}

  ProfileReport run() {
    start();
    choose_paths();
    sweep_nvme();
    measure_device();
    measure_cpu();
    measure_network();
    sample_step();
    share_node();
    model_step();
    check_engine();
    recommend_io_settings();
    tune_config();
    sync();
    r_.elapsed_s = total_.seconds();
    return std::move(r_);
  }

 private:
  void sync() {
    if (comm_) comm_->barrier();
  }

  // Ends the phase that ran (its seconds go to the report), waits for every rank, starts `name`.
  void phase(const std::string& name) {
    if (!phase_name_.empty()) r_.phase_seconds.emplace_back(phase_name_, phase_clock_.seconds());
    sync();
    phase_name_ = name;
    phase_clock_ = Stopwatch();
    if (progress_ && !name.empty()) progress_("== " + name);
  }

  void start() {
    r_.config_source = config_.source;
    r_.mode = options_.mode;
    r_.rank = comm_ ? comm_->rank() : 0;
    r_.world = comm_ ? comm_->size() : 1;
    sizes_ = mode_sizes(options_.mode);
    if (options_.sample_repeats) sizes_.sample_repeats = options_.sample_repeats;
    if (!(options_.target_overhead_s >= 0))
      fail(ErrorCode::kInvalidArgument, "profile: the target overhead must be >= 0 seconds");
    // Only rank 0 reports progress; every rank measures the same things at the same time.
    progress_ = r_.rank == 0 ? options_.progress : Progress{};
  }

  // NVMe paths: the configured ones (checked), or a temporary directory.
  void choose_paths() {
    check_nvme_paths(config_.tiers.nvme);
    paths_ = config_.tiers.nvme.paths;
    if (paths_.empty()) {
      temp_ = std::make_unique<TempDir>();
      paths_.push_back(temp_->path());
      const PathInfo info = describe_path(temp_->path());
      r_.notes.push_back(
          strcat("no NVMe path configured (tiers.nvme.paths is empty): measured in the "
                 "temporary directory ",
                 temp_->path(), " (", info.filesystem, " on ", info.device,
                 "), removed afterwards; its I/O settings are not written "
                 "to a tuned config"));
      if (config_.tiers.nvme.direct_io == DirectIoMode::kRequired && is_tmpfs(temp_->path()))
        fail(ErrorCode::kInvalidArgument,
             strcat("the temporary directory ", temp_->path(),
                    " is on tmpfs and tiers.nvme.direct_io is required: configure "
                    "tiers.nvme.paths"));
    }
    r_.environment = collect_environment(paths_, adam_path_name(adam_default_path()));
    if (temp_) r_.environment.paths.front().temporary = true;
    log_info("profile: ", profile_mode_name(options_.mode), " mode, load average ",
             r_.environment.load_average_1m,
             comm_ ? strcat(", rank ", r_.rank, " of ", r_.world) : "");
  }

  // 1. NVMe through the I/O engine (every rank of the launch at once).
  void sweep_nvme() {
    phase("setup");
    for (const auto& p : paths_) {
      phase("NVMe sweep: " + p);
      auto pts = sweep_io(config_, p, sizes_, progress_);
      r_.io.insert(r_.io.end(), pts.begin(), pts.end());
    }
  }

  // 2. Host <-> device copies and GPU Adam (CUDA only; the host-emulated device is no GPU).
  // This process's GPU on the node, by the rule the engine's storage uses (LOCAL_RANK, ...):
  // every rank of a launch measures its own GPU, and the NCCL communicator below sits on it.
  void measure_device() {
    ordinal_ = local_device_ordinal(r_.rank, static_cast<int>(config_.ranks_per_node()),
                                    static_cast<int>(query_cuda_devices().devices.size()));
    if (r_.environment.has_gpu && config_.runtime.device != DeviceKind::kHost) {
      try {
        gpu_ = make_device(DeviceKind::kCuda, ordinal_);
      } catch (const Error& e) {
        r_.copies_skipped = std::string("skipped: the GPU could not be used: ") + e.what();
      }
    } else if (!r_.environment.has_gpu) {
      r_.copies_skipped = "skipped: " + r_.environment.gpu;
    } else {
      r_.copies_skipped = "skipped: runtime.device is host";
    }
    phase("host <-> device copies, GPU Adam");
    if (gpu_) {
      r_.copies = measure_copies(*gpu_, sizes_, progress_);
      r_.gpu_adam = measure_gpu_adam(config_, *gpu_, sizes_.gpu_adam_elements);
    } else {
      r_.gpu_adam.skipped = r_.copies_skipped;
    }
    if (progress_ && !gpu_) progress_("host <-> device copies, GPU Adam: " + r_.copies_skipped);
  }

  // 3. CPU Adam and the memory-bandwidth reference.
  void measure_cpu() {
    phase("CPU Adam, memory bandwidth (triad)");
    r_.cpu_adam = measure_cpu_adam(config_, sizes_.adam_elements);
    r_.triad_threads = config_.runtime.cpu_threads
                           ? config_.runtime.cpu_threads
                           : std::max(1u, std::thread::hardware_concurrency());
    r_.triad_bytes_per_second = measure_triad(sizes_.triad_bytes, r_.triad_threads);
    if (progress_)
      progress_(strcat("CPU Adam (", r_.cpu_adam.device, "): ",
                       format_count(static_cast<std::uint64_t>(r_.cpu_adam.params_per_second)),
                       " params/s; triad ", format_rate(r_.triad_bytes_per_second)));
  }

  // 4. Collectives: the real communicator of a multi-process launch, or the configured
  //    world.network_bandwidth; never threads of this process.
  void measure_network() {
    phase("collectives");
    Bandwidths& bw = r_.bandwidths;
    if (config_.world.ranks < 2 && r_.world < 2) {
      r_.collectives_skipped = "skipped: 1 rank (world.ranks = 1), no collective in a step";
    } else if (comm_ && r_.world > 1) {
      measure_launch_collectives();
    } else if (config_.world.network_bandwidth > 0) {
      bw.network_source = strcat("configured: world.network_bandwidth = ",
                                 format_rate(static_cast<double>(config_.world.network_bandwidth)),
                                 " (not measured: not launched across processes)");
      r_.collectives_skipped = strcat(
          "not measured: not launched across processes (run under mpirun to "
          "measure the real communicator); the model uses ",
          bw.network_source);
    } else {
      r_.collectives_skipped =
          "not measured: not launched across processes (run under mpirun to measure the real "
          "communicator, or set world.network_bandwidth); the network leg is not counted";
    }
    if (progress_ && r_.collectives.empty()) progress_("collectives: " + r_.collectives_skipped);
  }

  // The launch's communicator (NCCL where it starts and a GPU is used, else the host one).
  void measure_launch_collectives() {
    std::unique_ptr<Communicator> nccl;
    const bool want_nccl = config_.runtime.communicator == CommBackend::kNccl ||
                           (config_.runtime.communicator == CommBackend::kAuto && gpu_);
    if (want_nccl && nccl_available() && gpu_) {
      try {
        NcclBootstrap boot;
        boot.host = comm_;
        nccl = make_nccl_communicator(boot, ordinal_, config_.runtime.collective_timeout_s);
      } catch (const Error& e) {
        r_.notes.push_back(
            strcat("NCCL could not start (", e.what(), "): measured ", comm_->backend_name()));
      }
    }
    r_.collectives =
        nccl ? measure_collectives(config_, *nccl, *comm_, gpu_.get(), sizes_, progress_)
             : measure_collectives(config_, *comm_, *comm_, nullptr, sizes_, progress_);
    r_.bandwidths.network_source = strcat("measured: ", nccl ? "nccl" : comm_->backend_name(),
                                          " over ", r_.world, " processes");
    if (static_cast<std::uint32_t>(r_.world) != config_.world.ranks)
      r_.notes.push_back(
          strcat("the launch has ", r_.world, " processes, the config ", config_.world.ranks,
                 " ranks: the model uses the bus bandwidth measured with ", r_.world));
  }

  // 5. The sample step through the real tiers (every rank at once under a launch).
  void sample_step() {
    phase("sample step (the engine's step, optimizer state on NVMe)");
    elements_ = std::min<std::uint64_t>(config_.zero.sub_group_size, sizes_.sample_elements);
    r_.sample = run_sample_step(config_, paths_, elements_, sizes_.sample_sub_groups,
                                sizes_.sample_repeats, progress_, [this] { sync(); });
  }

  // 6. How ranks share a node (docs/profile.md "Ranks on a node").
  void share_node() {
    NodeSharing& sh = r_.sharing;
    sh.ranks_per_node =
        std::min(config_.ranks_per_node(), std::max<std::uint32_t>(config_.world.ranks, 1));
    sh.local_processes = count_local_processes();
    sh.nvme_devices = std::min(distinct_devices(r_.environment.paths), sh.ranks_per_node);
    const std::uint32_t cores = std::max(1u, std::thread::hardware_concurrency());
    sh.cores_per_rank = static_cast<double>(cores) / sh.ranks_per_node;
    if (sh.ranks_per_node > sh.local_processes) {
      phase("node sharing: concurrent NVMe streams");
      if (sh.local_processes == 1) {
        share_nvme_measured();
      } else {
        // Every local process measured at once: scale the rest of the node's ranks in linearly.
        sh.nvme_read_factor = sh.nvme_write_factor =
            static_cast<double>(sh.local_processes) / sh.ranks_per_node;
        sh.notes.push_back(strcat("NVMe: ", sh.local_processes,
                                  " processes measured at once on this "
                                  "node; the config has ",
                                  sh.ranks_per_node, " ranks per node: rates scaled by x",
                                  fixed2(sh.nvme_read_factor)));
      }
    } else if (sh.ranks_per_node > 1) {
      sh.notes.push_back(strcat("NVMe and CPU: the ", sh.local_processes,
                                " ranks of this node ran the "
                                "measurements at the same time: the rates are already shared"));
    }
    share_cpu(cores);
  }

  // The processes of the launch on this node: given, or the ranks whose host name hashes like
  // this one's (1 without a launch).
  std::uint32_t count_local_processes() {
    if (comm_ && options_.local_processes) return options_.local_processes;
    if (!comm_) return 1;
    const double mine =
        static_cast<double>(std::hash<std::string>{}(r_.environment.hostname) % (1ULL << 52));
    std::uint32_t local = 0;
    std::uint32_t bits[2];
    std::memcpy(bits, &mine, sizeof mine);
    std::vector<std::uint32_t> all(2 * static_cast<std::size_t>(r_.world));
    comm_->all_gather(bits, all.data(), 2, DType::kFp32);
    for (int k = 0; k < r_.world; ++k) {
      double x;
      std::memcpy(&x, all.data() + 2 * k, sizeof x);
      local += x == mine;
    }
    return std::max<std::uint32_t>(local, 1);
  }

  // One process on a node configured with more ranks: concurrent streams measure the disk's
  // share per rank.
  void share_nvme_measured() {
    NodeSharing& sh = r_.sharing;
    sh.nvme_streams = std::min(sh.ranks_per_node, sizes_.max_streams);
    const StreamRates sr = measure_streams(config_, paths_.front(), sh.nvme_streams,
                                           sizes_.stream_region, sizes_.stream_s);
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
    sh.notes.push_back(
        strcat("NVMe: ", sh.ranks_per_node, " ranks per node share ", sh.nvme_devices,
               " device(s); ", sh.nvme_streams, " concurrent streams reached read ",
               format_rate(sr.aggregate_read), " / write ", format_rate(sr.aggregate_write),
               " against one stream's ", format_rate(sr.single_read), " / ",
               format_rate(sr.single_write), ": a rank gets x", fixed2(sh.nvme_read_factor),
               " (read), x", fixed2(sh.nvme_write_factor), " (write) of the sample's rates"));
    if (progress_) progress_(sh.notes.back());
  }

  // CPU: the node's cores and memory bandwidth are split over its ranks. The sample's Adam rate
  // was measured with runtime.cpu_threads threads (0 = all cores) while local_processes ranks
  // ran.
  void share_cpu(std::uint32_t cores) {
    NodeSharing& sh = r_.sharing;
    const double threads = config_.runtime.cpu_threads ? config_.runtime.cpu_threads : cores;
    const double demand = threads * sh.ranks_per_node;          // threads the node's ranks want
    const double measured_with = threads * sh.local_processes;  // threads that ran at once
    // A rank's share of the cores: min(1, cores / demand); the measurement had min(1, cores /
    // measured_with). (Adam is bound by memory bandwidth, which the cores share the same way.)
    const double c = static_cast<double>(cores);
    sh.cpu_factor =
        std::min(1.0, c / std::max(demand, 1.0)) / std::min(1.0, c / std::max(measured_with, 1.0));
    if (sh.cpu_factor < 1.0)
      sh.notes.push_back(strcat(
          "CPU: ", sh.ranks_per_node, " ranks x ", threads, " Adam threads on ", cores, " cores (",
          sh.local_processes, " measured at once): a rank's Adam rate x", fixed2(sh.cpu_factor),
          "; the contention model gives each rank ", fixed2(sh.cores_per_rank), " cores"));
  }

  // 7. The model for the configured step (per rank).
  void model_step() {
    Bandwidths& bw = r_.bandwidths;
    const NodeSharing& sh = r_.sharing;
    bw.nvme_read_bps = r_.sample.tier_read_bps * sh.nvme_read_factor;
    bw.nvme_write_bps = r_.sample.tier_write_bps * sh.nvme_write_factor;
    bw.nvme_duplex = false;
    bw.nvme_mixed_bps =
        r_.sample.tier_mixed_bps * std::min(sh.nvme_read_factor, sh.nvme_write_factor);
    bw.cpu_adam_params_per_s = r_.sample.adam_params_per_s * sh.cpu_factor;
    // State in host memory: Adam over arrays beyond the caches (the sample's pool buffers are
    // small and reused). The engine's rate, not a per-thread one: shared like the sample's.
    if (r_.cpu_adam.measured) {
      bw.cpu_adam_memory_params_per_s = r_.cpu_adam.params_per_second * sh.cpu_factor;
      bw.cpu_adam_out_of_place_factor = r_.cpu_adam.out_of_place_factor;
      const bool gpu = r_.environment.has_gpu && config_.runtime.device != DeviceKind::kHost;
      if (!gpu) bw.host_copy_bps = r_.cpu_adam.host_copy_bytes_per_second;  // no GPU memory
    }
    bw.cpu_s_per_nvme_byte = r_.sample.cpu_s_per_nvme_byte;
    bw.cpu_s_per_adam_element = r_.sample.cpu_s_per_adam_element;
    bw.cores = std::max(1.0, sh.cores_per_rank);
    if (r_.gpu_adam.measured) bw.gpu_adam_params_per_s = r_.gpu_adam.params_per_second;
    for (const auto& c : r_.copies) {  // pinned, largest size
      if (!c.pinned) continue;
      (c.direction == "host_to_device" ? bw.h2d_bps : bw.d2h_bps) = c.bytes_per_second;
    }
    if (!r_.collectives.empty()) {
      for (const auto& c : r_.collectives)  // the largest size wins (the list is in size order)
        (c.collective == "reduce_scatter" ? bw.reduce_scatter_busbw : bw.all_gather_busbw) =
            c.busbw_bytes_per_second;
    } else if (config_.world.network_bandwidth > 0) {
      bw.reduce_scatter_busbw = bw.all_gather_busbw =
          static_cast<double>(config_.world.network_bandwidth);
    }
    r_.plan = make_plan(config_, read_machine_memory());  // as strata plan on this machine
    r_.configured = predict_step(config_, r_.plan.configured, bw);
    if (!bw.network_source.empty() && r_.configured.network_s > 0)
      r_.configured.notes.push_back("network leg: " + bw.network_source);
  }

  // 8. The engine check: a real multi-rank Engine step against its prediction (launches only).
  void check_engine() {
    phase("engine check");
    if (comm_ && r_.world > 1) {
      // The sample step's state per rank, in its sub-groups: its legs are the prediction's inputs.
      r_.engine_check = run_engine_check(
          config_, paths_, *comm_, r_.bandwidths, r_.sample,
          elements_ * sizes_.sample_sub_groups * static_cast<std::uint64_t>(r_.world), elements_,
          sizes_.engine_check_steps, progress_);
      if (progress_)
        progress_(strcat("engine check: predicted ", r_.engine_check.predicted_s, " s, measured ",
                         r_.engine_check.measured_median_s, " s (median of ",
                         r_.engine_check.measured_s.size(), ")"));
    } else {
      r_.engine_check.skipped =
          "skipped: not launched across processes (run under mpirun with 2 or "
          "more processes to check a multi-rank engine step)";
    }
    phase("");
  }

  // 9. Recommendations: the I/O settings, and the placement for the rates they would give.
  void recommend_io_settings() {
    const NvmeTierConfig& nv = config_.tiers.nvme;
    configured_engine_ = io_engine_name(nv.engine);
    if (nv.engine == IoEngineKind::kAuto)
      for (const auto& p : r_.io)
        if (p.block_size == nv.block_size && p.queue_depth == nv.queue_depth &&
            p.rings == nv.io_threads) {
          configured_engine_ = p.engine;  // the engine the sweep measured at the configured point
          break;
        }
    r_.io_recommendations = recommend_io(r_.io, nv, configured_engine_);
    Bandwidths tuned_bw = r_.bandwidths;
    if (!r_.io_recommendations.empty() && nvme_configured()) {
      const auto& rec = r_.io_recommendations.front();
      // Scale the tier-store rates by what the recommended I/O settings gain over the configured
      // ones in the raw sweep.
      const IoPoint* cr = find_point(r_.io, rec.path, configured_engine_, "read", nv.block_size,
                                     nv.queue_depth, nv.io_threads);
      const IoPoint* cw = find_point(r_.io, rec.path, configured_engine_, "write", nv.block_size,
                                     nv.queue_depth, nv.io_threads);
      if (cr && cw && cr->bytes_per_second > 0 && cw->bytes_per_second > 0) {
        tuned_bw.nvme_read_bps *= std::max(1.0, rec.read_bps / cr->bytes_per_second);
        tuned_bw.nvme_write_bps *= std::max(1.0, rec.write_bps / cw->bytes_per_second);
      }
    }
    r_.placement =
        recommend_placement(config_, tuned_bw, options_.target_overhead_s, nvme_configured());
  }

  // The tuned config: the recommendations applied to the configured one (and checked to load).
  void tune_config() {
    r_.tuned = config_;
    if (!r_.io_recommendations.empty() && nvme_configured()) {
      const auto& rec = r_.io_recommendations.front();
      r_.tuned.tiers.nvme.engine = engine_kind(rec.engine);
      r_.tuned.tiers.nvme.block_size = rec.block_size;
      r_.tuned.tiers.nvme.queue_depth = rec.queue_depth;
      r_.tuned.tiers.nvme.io_threads = rec.rings;
      r_.tuned_notes.push_back(rec.configured_kept
                                   ? "I/O settings: the configured ones (within noise of the best)"
                                   : "I/O settings: the recommended ones");
    } else if (!nvme_configured()) {
      r_.tuned_notes.push_back(
          "I/O settings: not changed (no NVMe path configured; the measurements "
          "in the temporary directory describe its disk, not your NVMe)");
    }
    if (r_.placement.found && !(uses_nvme(r_.placement.choice.offload) && !nvme_configured())) {
      r_.tuned.zero.stage = r_.placement.choice.stage;
      r_.tuned.offload = r_.placement.choice.offload;
      r_.tuned_notes.push_back("placement: " + r_.placement.choice.description);
    } else if (r_.placement.found) {
      r_.tuned_notes.push_back("placement: not changed (the recommended " +
                               r_.placement.choice.description + " needs tiers.nvme.paths)");
    }
    try {
      r_.tuned = parse_config(to_yaml(r_.tuned), "<tuned>");
    } catch (const Error& e) {
      fail(ErrorCode::kInternal,
           std::string("profile: the tuned config does not load: ") + e.what());
    }
    r_.tuned.source = config_.source;
  }

  bool nvme_configured() const { return !config_.tiers.nvme.paths.empty(); }

  const Config& config_;
  const ProfileOptions& options_;
  Communicator* const comm_;
  Stopwatch total_;  // started first: elapsed_s counts the whole run
  ProfileReport r_;
  Sizes sizes_;
  Progress progress_;  // options_.progress on rank 0, none on the others
  Stopwatch phase_clock_;
  std::string phase_name_;          // the phase running ("" before the first)
  std::vector<std::string> paths_;  // the NVMe paths measured
  std::unique_ptr<TempDir> temp_;   // the directory measured when none is configured
  std::unique_ptr<Device> gpu_;     // the CUDA device, when one is used
  int ordinal_ = 0;                 // its ordinal on the node (local_device_ordinal)
  std::uint64_t elements_ = 0;      // the sample step's sub-group size
  std::string configured_engine_;   // the I/O engine the configured settings ran with
};

}  // namespace
}  // namespace profile

ProfileReport run_profile(const Config& config, const ProfileOptions& options) {
  return profile::ProfileRun(config, options).run();
}

}  // namespace strata
