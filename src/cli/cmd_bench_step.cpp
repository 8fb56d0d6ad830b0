// `strata bench step CONFIG [--params N] [--rounds N] [--json]`: the offloaded optimizer step of
// one rank, all optimizer state on NVMe (tiers.nvme.paths), CPU Adam, the pinned pool of
// tiers.host: t_read, t_update, t_write alone, the pipelined step, the unpipelined step, overlap
// efficiency = max(t_read, t_update, t_write) / t_step (target >= 0.85), and the peak RSS at 1x
// and 4x the model size (target ratio <= 1.10, not counting the gradients and parameters the
// caller holds). Each size runs in a child process so that each peak RSS is its own.
//
// Before anything is allocated it sizes the run to the machine: the default size
// (model.parameters / world.ranks, or 8x the pinned pool when model.parameters is not given) is
// reduced, with a note on stderr, until the host memory (half of MemAvailable) and the disk under
// every tiers.nvme.paths entry (90 % of the free space) hold the larger (4x) run; an explicit
// --params that does not fit is refused up front (exit 2) with the memory and disk it needs.
// Missing swap directories are created (SwapSpace); progress goes to stderr, one line per run.
// --backward T|auto [--tensors N] measures the speculative update instead
// (profile::run_overlap_bench): the serial step, the overlapped one, the exposed optimizer time
// after the last gradient and the rollback cost (clipping forced), behind a simulated backward;
// on a GPU its gradients are device memory handed in on a producer stream, and the hand-in time
// is shown against the device -> host bandwidth measured in the same run.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/command.hpp"
#include "profile/step_bench.hpp"
#include "strata/config.hpp"
#include "strata/error.hpp"
#include "strata/units.hpp"

namespace strata::profile {
// --json: every member of the overlap result under its own name.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(
    OverlapBenchResult, elements, backward_s, serial_step_s, serial_total_s, overlapped_step_s,
    overlapped_total_s, exposed_s, serial_hand_in_s, overlapped_hand_in_s, gradients, hand_in_bytes,
    serial_hand_in_bytes_per_second, overlapped_hand_in_bytes_per_second, d2h_copy_bytes,
    d2h_bytes_per_second, overlapped_equals_serial, serial_master_crc32c, serial_clip_step_s,
    serial_clip_total_s, rollback_step_s, rollback_total_s, auto_clip_step_s, auto_clip_total_s,
    auto_clip_rolled_back_steps, speculated_chunks, committed_chunks, rolled_back_chunks,
    update_cpu_elements, update_device_elements, rounds, exposed_ratio, total_ratio,
    serial_total_ratio, rollback_ratio, auto_clip_ratio, clip_serial_ratio, clip_overlapped_ratio,
    backward_s_rounds, serial_step_s_rounds, exposed_s_rounds, overlapped_total_s_rounds)
}  // namespace strata::profile

namespace cmd_bench_step {
namespace {

using namespace strata;
using nlohmann::json;

struct Options : strata::cli::ConfigArgs {
  std::string params;  // default: model.parameters / world.ranks
  int rounds = 5;
  bool no_scaling = false;
  bool json = false;
  std::string backward;  // --backward T|auto: the speculative update against the serial one
  std::size_t tensors = 32;
};

// MemAvailable from /proc/meminfo, in bytes (0 when unknown).
std::uint64_t mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

// Free bytes on the file system that holds `path` (or would hold it: its nearest existing
// ancestor); 0 when unknown.
std::uint64_t free_bytes_under(const std::string& path) {
  std::string p = path.empty() ? "." : path;
  for (;;) {
    struct statvfs v {};
    if (::statvfs(p.c_str(), &v) == 0) return std::uint64_t(v.f_bavail) * v.f_frsize;
    if (errno != ENOENT) return 0;
    const auto slash =
        p.find_last_of('/', p.size() > 1 && p.back() == '/' ? p.size() - 2 : std::string::npos);
    if (slash == std::string::npos)
      p = ".";
    else
      p = slash == 0 ? "/" : p.substr(0, slash);
  }
}

// What a run of `elements` needs: host memory (the caller-held gradients and parameters, the
// initial FP32 values, the pinned pool) and swap space per path (12 B of optimizer state per
// element, split over the paths).
struct Needs {
  std::uint64_t host = 0;
  std::uint64_t disk_per_path = 0;
};
Needs needs_for(const Config& c, std::uint64_t elements) {
  const std::uint64_t per_elem =
      4 + dtype_size(c.precision.accum_dtype()) + dtype_size(c.precision.params);
  const std::uint64_t pool = std::uint64_t{c.tiers.host.buffer_count} * c.tiers.host.buffer_size;
  const std::uint64_t paths = std::max<std::size_t>(1, c.tiers.nvme.paths.size());
  Needs n;
  n.host = elements * per_elem + pool;
  n.disk_per_path = (elements * 12 + paths - 1) / paths + c.tiers.nvme.block_size;
  return n;
}

// The elements to measure (see the top of this file). Throws Error(kInvalidArgument) for an
// explicit size that does not fit, Error(kBudget) when not even a small run fits.
std::uint64_t size_to_machine(const Config& c, const Options& o) {
  // The 4x run is the larger one; --backward keeps two engines alive, one with pending versions
  // of its state (within what the 4x run needs).
  const std::uint64_t factor = o.no_scaling && o.backward.empty() ? 1 : 4;
  const std::uint64_t mem = mem_available();
  const std::uint64_t host_limit = mem / 2;
  std::uint64_t disk_limit = ~std::uint64_t{0};
  std::string disk_path;
  for (const auto& p : c.tiers.nvme.paths) {
    const std::uint64_t f = free_bytes_under(p) / 10 * 9;
    if (f < disk_limit) {
      disk_limit = f;
      disk_path = p;
    }
  }
  auto fits = [&](std::uint64_t elements) {
    const Needs n = needs_for(c, elements * factor);
    return (mem == 0 || n.host <= host_limit) && n.disk_per_path <= disk_limit;
  };
  auto describe = [&](std::uint64_t elements) {
    const Needs n = needs_for(c, elements * factor);
    return strcat(format_count(elements), " params", factor > 1 ? " (and a 4x run)" : "", " need ",
                  format_bytes(n.host, true), " of host memory and ",
                  format_bytes(n.disk_per_path, true), " of disk under ", disk_path,
                  "; this machine has ", format_bytes(mem, true),
                  " available (half is used at most) and ", format_bytes(disk_limit / 9 * 10, true),
                  " free there");
  };
  if (!o.params.empty()) {
    const std::uint64_t n = parse_count(o.params);
    if (n == 0 || n > limits::kMaxParameters)
      fail(ErrorCode::kInvalidArgument,
           strcat("bench step: --params ", o.params, " must be in [1, ",
                  format_count(limits::kMaxParameters), "]"));
    if (!fits(n))
      fail(ErrorCode::kInvalidArgument,
           strcat("bench step: --params ", o.params, ": ", describe(n),
                  o.no_scaling ? "" : "; --no-scaling skips the 4x run",
                  "; choose a smaller --params"));
    return n;
  }
  const std::uint64_t pool = std::uint64_t{c.tiers.host.buffer_count} * c.tiers.host.buffer_size;
  const std::uint64_t wanted = c.model.parameters > 0
                                   ? c.model.parameters / std::max(1u, c.world.ranks)
                                   : std::max<std::uint64_t>(1, pool * 8 / 12);
  if (fits(wanted)) return wanted;
  // The largest size that fits, found by halving then bisecting.
  std::uint64_t lo = 0, hi = wanted;
  while (hi - lo > std::max<std::uint64_t>(1, wanted / 1000)) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  const std::uint64_t smallest =
      std::min<std::uint64_t>(wanted, std::max<std::uint64_t>(1, pool / 12 * 2));
  if (lo < smallest)
    fail(ErrorCode::kBudget,
         strcat("bench step: even ", format_count(smallest),
                " params (twice the pinned pool) do not fit: ", describe(smallest)));
  std::cerr << "strata: bench step: "
            << (c.model.parameters > 0 ? "model.parameters / world.ranks = " : "the default ")
            << format_count(wanted) << " params would not fit (" << describe(wanted)
            << "); measuring " << format_count(lo) << " params instead (--params to choose)\n";
  return lo;
}

json to_json(const profile::StepBenchResult& r) {
  return {
      {"elements", r.elements},
      {"state_bytes", r.state_bytes},
      {"pool_bytes", r.pool_bytes},
      {"buffers", r.buffers},
      {"buffer_size", r.buffer_size},
      {"chunks", r.chunks},
      {"io_engine", r.io_engine},
      {"threads", r.threads},
      {"update_on", r.update_on},
      {"t_read_s", r.t_read},
      {"t_update_s", r.t_update},
      {"t_write_s", r.t_write},
      {"t_step_s", r.t_step},
      {"t_engine_step_s", r.t_engine_step},
      {"t_step_serial_s", r.t_step_serial},
      {"t_update_in_step_s", r.t_update_in_step},
      {"t_wait_read_s", r.t_wait_read},
      {"t_wait_write_s", r.t_wait_write},
      {"overlap_efficiency", r.overlap_efficiency},
      {"overlap_efficiency_rounds", r.overlap_efficiency_rounds},
      {"t_io_s", r.t_io},
      {"device_efficiency", r.device_efficiency},
      {"read_bytes_per_second", r.t_read > 0 ? static_cast<double>(r.state_bytes) / r.t_read : 0.0},
      {"write_bytes_per_second",
       r.t_write > 0 ? static_cast<double>(r.state_bytes) / r.t_write : 0.0},
      {"step_params_per_second", r.t_step > 0 ? static_cast<double>(r.elements) / r.t_step : 0.0},
      {"peak_rss_bytes", r.peak_rss_bytes},
      {"caller_held_bytes", r.caller_held_bytes}};
}

// Runs the benchmark in a forked child (its own peak RSS); the result comes back as JSON.
json run_child(const profile::StepBenchOptions& bo) {
  int fds[2];
  if (::pipe(fds) != 0) throw IoError("pipe", "", 0, 0, errno, "bench step");
  std::cout.flush();
  pid_t pid = ::fork();
  if (pid < 0) throw IoError("fork", "", 0, 0, errno, "bench step");
  if (pid == 0) {
    ::close(fds[0]);
    // If this command is killed, the child is told to end too (and removes its swap files).
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() == 1) ::_exit(1);
    json out;
    try {
      out = to_json(profile::run_step_bench(bo));
    } catch (const Error& e) {
      out = {{"error", e.what()}, {"exit_code", e.exit_code()}};
    } catch (const std::exception& e) {
      out = {{"error", e.what()}, {"exit_code", 1}};
    }
    const std::string s = out.dump();
    std::size_t off = 0;
    while (off < s.size()) {
      ssize_t n = ::write(fds[1], s.data() + off, s.size() - off);
      if (n <= 0) break;
      off += static_cast<std::size_t>(n);
    }
    ::close(fds[1]);
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof(buf))) > 0) text.append(buf, static_cast<std::size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (text.empty())
    fail(ErrorCode::kInternal,
         strcat("bench step: the measuring child died (status ", status, ")"));
  json j = json::parse(text);
  if (j.contains("error")) {
    const int code = j.value("exit_code", 1);
    fail(code == 2 ? ErrorCode::kInvalidArgument : ErrorCode::kIo, j["error"].get<std::string>());
  }
  return j;
}

// The peak RSS that is not caller-held (what must not scale with the model).
double own_rss(const json& j) {
  return static_cast<double>(j["peak_rss_bytes"].get<std::uint64_t>()) -
         static_cast<double>(j["caller_held_bytes"].get<std::uint64_t>());
}

void print_json(const Options& o, const json& one, const json& four) {
  const double ratio = four.is_null() ? 0.0 : own_rss(four) / own_rss(one);
  const double pool = static_cast<double>(one["pool_bytes"].get<std::uint64_t>());
  json j;
  j["config"] = o.config;
  j["step"] = one;
  if (!four.is_null()) {
    j["step_4x"] = four;
    j["rss_ratio_4x_vs_1x"] = ratio;
  }
  j["state_over_pool"] = static_cast<double>(one["state_bytes"].get<std::uint64_t>()) / pool;
  j["serial_over_pipelined"] = one["t_step_serial_s"].get<double>() / one["t_step_s"].get<double>();
  std::cout << j.dump(2) << "\n";
}

void print_human(const json& one, const json& four) {
  const double ratio = four.is_null() ? 0.0 : own_rss(four) / own_rss(one);
  const double pool = static_cast<double>(one["pool_bytes"].get<std::uint64_t>());
  auto ms = [](const json& j, const char* k) { return j[k].get<double>() * 1e3; };
  std::cout << "Offloaded optimizer step: " << format_count(one["elements"].get<std::uint64_t>())
            << " params, " << format_bytes(one["state_bytes"].get<std::uint64_t>())
            << " of state on NVMe (" << one["io_engine"].get<std::string>() << "), pool "
            << one["buffers"].get<std::uint32_t>() << " x "
            << format_bytes(one["buffer_size"].get<std::uint64_t>(), true)
            << " (state = " << static_cast<double>(one["state_bytes"].get<std::uint64_t>()) / pool
            << "x pool), " << one["chunks"].get<std::size_t>() << " chunks, Adam on "
            << one["update_on"].get<std::string>() << " (" << one["threads"].get<unsigned>()
            << " CPU threads)\n";
  std::cout << "  t_read   " << ms(one, "t_read_s") << " ms  ("
            << format_rate(one["read_bytes_per_second"].get<double>()) << ")\n";
  std::cout << "  t_update " << ms(one, "t_update_s") << " ms\n";
  std::cout << "  t_write  " << ms(one, "t_write_s") << " ms  ("
            << format_rate(one["write_bytes_per_second"].get<double>()) << ")\n";
  std::cout << "  pipelined step " << ms(one, "t_step_s") << " ms  (update inside "
            << ms(one, "t_update_in_step_s") << " ms, waited for reads " << ms(one, "t_wait_read_s")
            << " ms, writes " << ms(one, "t_wait_write_s") << " ms)\n";
  std::cout << "  overlap efficiency max(t_read, t_update, t_write) / t_step = "
            << one["overlap_efficiency"].get<double>()
            << " (target >= 0.85); median of per-round ratios "
            << one["overlap_efficiency_rounds"].get<double>() << "\n";
  std::cout << "  read || write without update (device bound) " << ms(one, "t_io_s")
            << " ms; max(t_io, t_update) / t_step = " << one["device_efficiency"].get<double>()
            << "\n";
  std::cout << "  unpipelined step " << ms(one, "t_step_serial_s") << " ms ("
            << one["t_step_serial_s"].get<double>() / one["t_step_s"].get<double>()
            << "x the pipelined)\n";
  std::cout << "  peak RSS 1x " << format_bytes(one["peak_rss_bytes"].get<std::uint64_t>(), true)
            << " (caller-held " << format_bytes(one["caller_held_bytes"].get<std::uint64_t>(), true)
            << ")";
  if (!four.is_null())
    std::cout << ", 4x " << format_bytes(four["peak_rss_bytes"].get<std::uint64_t>(), true)
              << " (caller-held "
              << format_bytes(four["caller_held_bytes"].get<std::uint64_t>(), true)
              << "); ratio without caller-held " << ratio << " (target <= 1.10)";
  std::cout << "\n";
}

// One measurement in a child, announced (sizes, memory) and timed on stderr.
json measured(const Config& cfg, const profile::StepBenchOptions& b, const char* what) {
  const Needs n = needs_for(cfg, b.elements);
  std::cerr << "strata: bench step: " << what << ": " << format_count(b.elements) << " params, "
            << format_bytes(b.elements * 12, true) << " of optimizer state on NVMe under "
            << cfg.tiers.nvme.paths.front() << (cfg.tiers.nvme.paths.size() > 1 ? " (striped)" : "")
            << ", about " << format_bytes(n.host, true) << " of host memory, " << b.rounds
            << " round(s)..." << std::endl;
  const auto t0 = std::chrono::steady_clock::now();
  json j = run_child(b);
  std::cerr << "strata: bench step: " << what << " done in "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s"
            << std::endl;
  return j;
}

// The hand-ins against the device -> host link, and the results' check (--backward).
void print_hand_ins(const profile::OverlapBenchResult& r) {
  auto ms = [](double s) { return s * 1e3; };
  const bool dev = r.gradients == "device";
  std::cout << "  hand-ins: " << format_bytes(r.hand_in_bytes) << " of gradients per round "
            << (dev ? "in device memory (set_gradient on the bench's producer stream)"
                    : "from host memory (set_gradient_host; the host-emulated device)")
            << ": serial " << ms(r.serial_hand_in_s) << " ms ("
            << format_rate(r.serial_hand_in_bytes_per_second) << "), overlapped "
            << ms(r.overlapped_hand_in_s) << " ms ("
            << format_rate(r.overlapped_hand_in_bytes_per_second) << ")";
  if (dev)
    std::cout << "; device -> host measured " << format_rate(r.d2h_bytes_per_second) << " ("
              << format_bytes(r.d2h_copy_bytes, true) << " copies to pinned memory)";
  char crc[16];
  std::snprintf(crc, sizeof(crc), "%08x", r.serial_master_crc32c);
  std::cout << "\n  results: the overlapped engine's master weights "
            << (r.overlapped_equals_serial ? "are bitwise" : "DIFFER from")
            << " the serial engine's (CRC32C " << crc << ")\n";
}

// --backward: the serial step, the overlapped one, the exposed time and the rollback cost, in
// this process (one size; profile::run_overlap_bench).
int run_overlap(const Options& o, const Config& cfg) {
  profile::OverlapBenchOptions b;
  b.config = cfg;
  b.rounds = o.rounds;
  b.tensors = o.tensors;
  b.elements = size_to_machine(cfg, o);
  if (o.backward != "auto") {
    char* end = nullptr;
    b.backward_s = std::strtod(o.backward.c_str(), &end);
    if (o.backward.empty() || *end != '\0' || !(b.backward_s >= 0))
      fail(ErrorCode::kInvalidArgument,
           strcat("bench step: --backward '", o.backward, "': seconds >= 0, or auto"));
  }
  const profile::OverlapBenchResult r = profile::run_overlap_bench(b);
  json j = r;
  j["tensors"] = o.tensors;
  if (o.json) {
    std::cout << json{{"config", o.config}, {"overlap", j}}.dump(2) << "\n";
    return 0;
  }
  auto ms = [](double s) { return s * 1e3; };
  std::cout << "Speculative update: " << format_count(r.elements) << " params in " << o.tensors
            << " tensors, simulated backward " << ms(r.backward_s) << " ms (sleeping"
            << (o.backward == "auto"
                    ? "; auto: each round's T the serial step of the round before, median"
                    : "")
            << ")\n"
            << "  serial:      step after the last gradient " << ms(r.serial_step_s)
            << " ms, backward + step " << ms(r.serial_total_s) << " ms (hand-ins "
            << ms(r.serial_hand_in_s) << " ms)\n"
            << "  overlapped:  step after the last gradient " << ms(r.overlapped_step_s)
            << " ms (exposed " << ms(r.exposed_s) << " ms), backward + step "
            << ms(r.overlapped_total_s) << " ms (hand-ins " << ms(r.overlapped_hand_in_s)
            << " ms); " << r.committed_chunks << " of " << r.speculated_chunks
            << " chunks committed\n"
            << "  clip forced, serial: step " << ms(r.serial_clip_step_s) << " ms, backward + step "
            << ms(r.serial_clip_total_s) << " ms\n"
            << "  clip forced: step " << ms(r.rollback_step_s) << " ms, backward + step "
            << ms(r.rollback_total_s) << " ms (" << r.rolled_back_chunks << " chunks rolled back)\n"
            << "  clip forced, overlap auto: step " << ms(r.auto_clip_step_s)
            << " ms, backward + step " << ms(r.auto_clip_total_s) << " ms ("
            << r.auto_clip_rolled_back_steps << " of " << o.rounds + 1 << " steps rolled back)\n";
  print_hand_ins(r);
  std::cout << "  update placement (last overlapped step): CPU " << r.update_cpu_elements
            << " elements, device " << r.update_device_elements << " elements"
            << (r.update_device_elements || r.update_cpu_elements
                    ? "\n"
                    : " (no split: optimizer.update auto shares the update with a GPU only)\n");
  std::cout << "  ratios (median of " << r.rounds
            << " rounds, each against the serial round beside it): exposed / serial step "
            << r.exposed_ratio << "; backward + step / max(T, serial step) " << r.total_ratio
            << " (serial " << r.serial_total_ratio << "); clip forced / serial clip forced "
            << r.rollback_ratio << ", under auto " << r.auto_clip_ratio << "\n"
            << "  what clipping costs (round i against round i): serial step clipping / not "
            << r.clip_serial_ratio << " (target <= 1.10); backward + step, overlap auto clipping "
            << "/ overlap on not " << r.clip_overlapped_ratio << " (target <= 1.10)\n";
  return 0;
}

int run(const Options& o) {
  Config cfg = load_config(o.config, o.overrides);
  if (cfg.tiers.nvme.paths.empty())
    fail(ErrorCode::kInvalidArgument,
         "bench step: tiers.nvme.paths is empty: name a directory on NVMe");
  if (!o.backward.empty()) return run_overlap(o, cfg);
  profile::StepBenchOptions bo;
  bo.config = cfg;
  bo.rounds = o.rounds;
  if (o.rounds < 1) fail(ErrorCode::kInvalidArgument, "bench step: --rounds must be >= 1");
  bo.elements = size_to_machine(cfg, o);
  json one = measured(cfg, bo, o.no_scaling ? "run 1 of 1" : "run 1 of 2");
  json four;
  if (!o.no_scaling) {
    profile::StepBenchOptions b4 = bo;
    b4.elements *= 4;
    b4.rounds = 1;
    b4.serial = false;
    four = measured(cfg, b4, "run 2 of 2 (4x, for the peak RSS ratio)");
  }
  if (o.json)
    print_json(o, one, four);
  else
    print_human(one, four);
  return 0;
}

const bool kRegistered = strata::cli::register_command(
    {"bench step", "The offloaded optimizer step: read/update/write alone, pipelined, overlap, RSS",
     [](CLI::App& cmd) {
       auto o = std::make_shared<Options>();
       cmd.add_option("CONFIG", o->config, "YAML config (tiers.*, precision.*, optimizer.*)")
           ->required();
       cmd.add_option("--params", o->params,
                      "Optimizer elements of the rank (default model.parameters / world.ranks, "
                      "or 8x the pinned pool; reduced to what the machine holds)");
       cmd.add_option("--rounds", o->rounds, "Measured rounds (medians)")->capture_default_str();
       cmd.add_flag("--no-scaling", o->no_scaling, "Skip the 4x-size run (peak RSS ratio)");
       cmd.add_flag("--json", o->json, "Print one JSON document");
       cmd.add_option("--backward", o->backward,
                      "Instead: the speculative update (optimizer.overlap) against the serial "
                      "step behind a simulated backward of T seconds (or auto: the serial step's "
                      "time), with the rollback cost (clipping forced)");
       cmd.add_option("--tensors", o->tensors, "With --backward: gradients handed in one by one")
           ->capture_default_str();
       strata::cli::add_set_option(cmd, o->overrides);
       return [o]() -> int { return run(*o); };
     }});

}  // namespace
}  // namespace cmd_bench_step
