// run_profile(): the order of the measurements, the mode sizes, the NVMe path checks (and the
// temporary directory used when no path is configured), and the assembly of the report.
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "profile/profile_internal.hpp"
#include "strata/adam.hpp"
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
      s.copy_sizes = {1 * M};
      s.adam_elements = 256 * K;
      s.gpu_adam_elements = 1 * M;
      s.triad_bytes = 24 * M;
      s.collective_sizes = {256 * K};
      s.sample_elements = 256 * K;
      s.sample_sub_groups = 3;
      s.sample_repeats = 1;
      break;
    case ProfileMode::kQuick:
      s.block_sizes = {128 * K, 1 * M, 8 * M};
      s.queue_depths = {1, 32};
      s.rings = {1};
      s.io_region = 64 * M;
      s.io_point_s = 0.08;
      s.copy_sizes = {1 * M, 16 * M, 64 * M};
      s.adam_elements = 4 * M;
      s.gpu_adam_elements = 16 * M;
      s.triad_bytes = 96 * M;
      s.collective_sizes = {1 * M, 16 * M};
      s.sample_elements = 4 * M;
      s.sample_sub_groups = 4;
      s.sample_repeats = 3;
      break;
    case ProfileMode::kDefault:
      s.block_sizes = {128 * K, 512 * K, 1 * M, 2 * M, 8 * M};
      s.queue_depths = {1, 8, 32, 128};
      s.rings = {1, 2};
      s.io_region = 128 * M;
      s.io_point_s = 0.1;
      s.copy_sizes = {1 * M, 4 * M, 16 * M, 64 * M, 256 * M, 1 * G};
      s.adam_elements = 16 * M;
      s.gpu_adam_elements = 64 * M;
      s.triad_bytes = 192 * M;
      s.collective_sizes = {1 * M, 16 * M};
      s.sample_elements = 8 * M;
      s.sample_sub_groups = 4;
      s.sample_repeats = 5;
      break;
    case ProfileMode::kFull:
      s.block_sizes = {128 * K, 256 * K, 512 * K, 1 * M, 2 * M, 4 * M, 8 * M};
      s.queue_depths = {1, 2, 4, 8, 16, 32, 64, 128};
      s.rings = {1, 2, 4};
      s.io_region = 512 * M;
      s.io_point_s = 0.25;
      s.copy_sizes = {1 * M, 2 * M, 4 * M, 8 * M, 16 * M, 32 * M, 64 * M, 128 * M, 256 * M, 512 * M, 1 * G};
      s.adam_elements = 64 * M;
      s.gpu_adam_elements = 256 * M;
      s.triad_bytes = 1536 * M;
      s.collective_sizes = {1 * M, 16 * M, 64 * M, 256 * M};
      s.sample_elements = 32 * M;
      s.sample_sub_groups = 6;
      s.sample_repeats = 5;
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

ProfileReport run_profile(const Config& config, const ProfileOptions& options) {
  using namespace profile;
  Stopwatch total;
  ProfileReport r;
  r.config_source = config.source;
  r.mode = options.mode;
  Sizes sizes = mode_sizes(options.mode);
  if (options.sample_repeats) sizes.sample_repeats = options.sample_repeats;
  if (!(options.target_overhead_s >= 0))
    fail(ErrorCode::kInvalidArgument, "profile: the target overhead must be >= 0 seconds");
  const Progress& progress = options.progress;
  Stopwatch phase_clock;
  std::string phase_name;
  auto phase = [&](const std::string& s) {
    if (!phase_name.empty()) r.phase_seconds.emplace_back(phase_name, phase_clock.seconds());
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
                             info.device, "), removed afterwards"));
    if (config.tiers.nvme.direct_io == DirectIoMode::kRequired && is_tmpfs(temp->path()))
      fail(ErrorCode::kInvalidArgument,
           strcat("the temporary directory ", temp->path(),
                  " is on tmpfs and tiers.nvme.direct_io is required: configure tiers.nvme.paths"));
  }
  r.environment = collect_environment(paths, adam_path_name(adam_default_path()));
  if (temp) r.environment.paths.front().temporary = true;
  log_info("profile: ", profile_mode_name(options.mode), " mode, load average ",
           r.environment.load_average_1m);

  // 1. NVMe through the I/O engine.
  phase("setup");
  for (const auto& p : paths) {
    phase("NVMe sweep: " + p);
    auto pts = sweep_io(config, p, sizes, progress);
    r.io.insert(r.io.end(), pts.begin(), pts.end());
  }

  // 2. Host <-> device copies and GPU Adam (CUDA only; the host-emulated device is no GPU).
  std::unique_ptr<Device> gpu;
  if (r.environment.has_gpu && config.runtime.device != DeviceKind::kHost) {
    try {
      gpu = make_device(DeviceKind::kCuda);
    } catch (const Error& e) {
      r.copies_skipped = std::string("skipped: the GPU could not be used: ") + e.what();
    }
  } else if (!r.environment.has_gpu) {
    r.copies_skipped = "skipped: no GPU (" + r.environment.gpu + ")";
  } else {
    r.copies_skipped = "skipped: runtime.device is host";
  }
  if (gpu) {
    phase("host <-> device copies: " + gpu->name());
    r.copies = measure_copies(*gpu, sizes, progress);
    phase("GPU Adam");
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

  // 4. Collectives.
  phase("collectives");
  r.collectives = measure_collectives(config, sizes, &r.collectives_skipped, progress);
  if (progress && !r.collectives_skipped.empty()) progress("collectives: " + r.collectives_skipped);

  // 5. The sample step through the real tiers.
  phase("sample step (TierStore on NVMe + CPU Adam)");
  const std::uint64_t elements = std::min<std::uint64_t>(config.zero.sub_group_size, sizes.sample_elements);
  r.sample = run_sample_step(config, paths, elements, sizes.sample_sub_groups, sizes.sample_repeats,
                             progress);

  phase("");

  // 6. The model for the configured step.
  Bandwidths& bw = r.bandwidths;
  bw.nvme_read_bps = r.sample.tier_read_bps;
  bw.nvme_write_bps = r.sample.tier_write_bps;
  bw.nvme_duplex = false;
  bw.nvme_mixed_bps = r.sample.tier_mixed_bps;
  bw.cpu_adam_params_per_s = r.sample.adam_params_per_s;
  bw.cpu_s_per_nvme_byte = r.sample.cpu_s_per_nvme_byte;
  bw.cpu_s_per_adam_element = r.sample.cpu_s_per_adam_element;
  bw.cores = std::max(1u, std::thread::hardware_concurrency());
  if (r.gpu_adam.measured) bw.gpu_adam_params_per_s = r.gpu_adam.params_per_second;
  for (const auto& c : r.copies) {  // pinned, largest size
    if (!c.pinned) continue;
    (c.direction == "host_to_device" ? bw.h2d_bps : bw.d2h_bps) = c.bytes_per_second;
  }
  for (const auto& c : r.collectives)
    (c.collective == "reduce_scatter" ? bw.reduce_scatter_busbw : bw.all_gather_busbw) =
        c.busbw_bytes_per_second;
  r.plan = make_plan(config);
  r.configured = predict_step(config, r.plan.configured, bw);

  // 7. Recommendations and the tuned config.
  r.io_recommendations = recommend_io(r.io);
  Bandwidths tuned_bw = bw;
  const NvmeTierConfig& nv = config.tiers.nvme;
  if (!r.io_recommendations.empty()) {
    const auto& rec = r.io_recommendations.front();
    // Scale the tier-store rates by what the recommended I/O settings gain over the configured
    // ones in the raw sweep.
    std::string eng = nv.engine == IoEngineKind::kAuto ? rec.engine : io_engine_name(nv.engine);
    const IoPoint* cr = find_point(r.io, rec.path, eng, "read", nv.block_size, nv.queue_depth, nv.io_threads);
    const IoPoint* cw = find_point(r.io, rec.path, eng, "write", nv.block_size, nv.queue_depth, nv.io_threads);
    if (cr && cw && cr->bytes_per_second > 0 && cw->bytes_per_second > 0) {
      tuned_bw.nvme_read_bps *= std::max(1.0, rec.read_bps / cr->bytes_per_second);
      tuned_bw.nvme_write_bps *= std::max(1.0, rec.write_bps / cw->bytes_per_second);
    }
  }
  r.placement = recommend_placement(config, tuned_bw, options.target_overhead_s, !nv.paths.empty());
  r.tuned = config;
  if (!r.io_recommendations.empty()) {
    const auto& rec = r.io_recommendations.front();
    r.tuned.tiers.nvme.engine = engine_kind(rec.engine);
    r.tuned.tiers.nvme.block_size = rec.block_size;
    r.tuned.tiers.nvme.queue_depth = rec.queue_depth;
    r.tuned.tiers.nvme.io_threads = rec.rings;
  }
  if (r.placement.found) {
    r.tuned.zero.stage = r.placement.choice.stage;
    r.tuned.offload = r.placement.choice.offload;
  }
  try {
    r.tuned = parse_config(to_yaml(r.tuned), "<tuned>");
  } catch (const Error& e) {
    fail(ErrorCode::kInternal, std::string("profile: the tuned config does not load: ") + e.what());
  }
  r.tuned.source = config.source;
  (void)checked;
  r.elapsed_s = total.seconds();
  return r;
}

}  // namespace strata
