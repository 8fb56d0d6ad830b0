// `strata info [--json] [--dir DIR]`: what this build has (CUDA, NCCL, MPI, sanitizers) and what
// this machine offers it (GPUs or why none, io_uring, the memlock limit, huge pages, the CPU's
// Adam code path), as text or one JSON document — strata's `ds_report`.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "cli/command.hpp"
#include "core/page_lock.hpp"
#include "strata/adam.hpp"
#include "strata/build_info.hpp"
#include "strata/device_query.hpp"
#include "strata/io_engine.hpp"
#include "strata/units.hpp"

namespace cmd_version {
namespace {

struct Options {
  bool json = false;
  std::string dir;  // where to probe io_uring (a temporary file is written and removed)
};

// A number from a one-line file (sysfs / procfs); -1 when absent.
long long read_number(const std::string& path) {
  std::ifstream in(path);
  long long v = -1;
  if (!(in >> v)) return -1;
  return v;
}

std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

struct HugePages {
  long long page_2m_total = -1, page_2m_free = -1, page_1g_total = -1, page_1g_free = -1;
  std::string transparent;  // the selected mode of /sys/kernel/mm/transparent_hugepage/enabled
};

HugePages huge_pages() {
  HugePages h;
  const std::string base = "/sys/kernel/mm/hugepages/";
  h.page_2m_total = read_number(base + "hugepages-2048kB/nr_hugepages");
  h.page_2m_free = read_number(base + "hugepages-2048kB/free_hugepages");
  h.page_1g_total = read_number(base + "hugepages-1048576kB/nr_hugepages");
  h.page_1g_free = read_number(base + "hugepages-1048576kB/free_hugepages");
  const std::string thp = read_line("/sys/kernel/mm/transparent_hugepage/enabled");
  const auto a = thp.find('['), b = thp.find(']');
  h.transparent = a != std::string::npos && b != std::string::npos && b > a
                      ? thp.substr(a + 1, b - a - 1)
                      : std::string("unknown");
  return h;
}

std::string count_text(long long v) { return v < 0 ? std::string("n/a") : std::to_string(v); }

std::string memlock_text(const strata::PageLockLimit& l) {
  if (l.rlimit == ~0ULL) return "unlimited";
  const std::string limit = strata::format_bytes(l.rlimit, true);
  if (l.cap_ipc_lock)
    return limit +
           " (RLIMIT_MEMLOCK), not applied: this process holds CAP_IPC_LOCK and may "
           "page-lock past it";
  return limit +
         " (RLIMIT_MEMLOCK: the most pinned memory this process can page-lock; raise with "
         "ulimit -l)";
}

}  // namespace

namespace {
const bool kRegistered = strata::cli::register_command(
    {"info",
     "Show what this build supports and what this machine offers it: GPUs, io_uring, memlock, "
     "huge pages, the CPU's Adam path",
     [](CLI::App& cmd) {
       auto o = std::make_shared<Options>();
       cmd.add_flag("--json", o->json, "Print one JSON document");
       cmd.add_option("--dir", o->dir,
                      "Directory in which to probe io_uring (default: $TMPDIR or /tmp; a small "
                      "temporary file is written and removed)");
       return [o]() -> int {
         namespace b = strata::build;
         const auto gpus = strata::query_cuda_devices();
         // io_uring: a real ring and a write + read round trip.
         std::string dir = o->dir;
         if (dir.empty()) {
           const char* t = std::getenv("TMPDIR");
           dir = t && *t ? t : "/tmp";
         }
         strata::IoEngineOptions io;
         io.direct_io = strata::DirectIoMode::kOff;  // the ring, not the file system's O_DIRECT
         const strata::IoUringProbe uring = strata::probe_io_uring(io, dir);
         const strata::PageLockLimit lock = strata::page_lock_limit();
         const bool unlimited = lock.rlimit == ~0ULL;
         const std::uint64_t memlock = unlimited ? 0 : lock.rlimit;
         const HugePages hp = huge_pages();
         std::string adam_path, adam_error;
         try {
           adam_path = strata::adam_path_name(strata::adam_default_path());
         } catch (const std::exception& e) {  // a bad $STRATA_ADAM_PATH
           adam_error = e.what();
         }
         std::string supported;
         for (auto p :
              {strata::AdamPath::kAvx512, strata::AdamPath::kAvx2, strata::AdamPath::kScalar})
           if (strata::adam_path_supported(p))
             supported += std::string(supported.empty() ? "" : ", ") + strata::adam_path_name(p);

         if (o->json) {
           nlohmann::json j;
           j["version"] = b::kVersion;
           j["cuda"] = b::kWithCuda;
           j["nccl"] = b::kWithNccl;
           j["mpi"] = b::kWithMpi;
           j["cuda_architectures"] = b::kCudaArchitectures;
           j["build_type"] = b::kBuildType;
           j["sanitize"] = b::kSanitize;
           j["compiler"] = b::kCompiler;
           j["gpus"] = nlohmann::json::array();
           for (auto& g : gpus.devices)
             j["gpus"].push_back(
                 {{"index", g.index},
                  {"name", g.name},
                  {"total_memory_bytes", g.total_memory},
                  {"compute_capability", std::to_string(g.major) + "." + std::to_string(g.minor)}});
           j["gpu_status"] = gpus.status;
           j["io_uring"] = {
               {"available", uring.ok},
               {"probe_dir", dir},
               {"reason", uring.ok ? nlohmann::json(nullptr) : nlohmann::json(uring.reason)}};
           j["memlock_limit_bytes"] = unlimited ? nlohmann::json(nullptr) : nlohmann::json(memlock);
           j["memlock_unlimited"] = unlimited;
           j["memlock_cap_ipc_lock"] = lock.cap_ipc_lock;  // the limit does not apply
           j["huge_pages"] = {{"2MiB_total", hp.page_2m_total},
                              {"2MiB_free", hp.page_2m_free},
                              {"1GiB_total", hp.page_1g_total},
                              {"1GiB_free", hp.page_1g_free},
                              {"transparent", hp.transparent}};
           j["cpu_adam_path"] =
               adam_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(adam_path);
           if (!adam_error.empty()) j["cpu_adam_path_error"] = adam_error;
           j["cpu_adam_paths_supported"] = supported;
           j["cpus"] = std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
           std::cout << j.dump(2) << "\n";
           return 0;
         }
         std::cout << "strata " << b::kVersion << "\n"
                   << "  CUDA:       " << (b::kWithCuda ? "yes" : "no") << " (architectures "
                   << (b::kWithCuda ? b::kCudaArchitectures : "-") << ")\n"
                   << "  NCCL:       " << (b::kWithNccl ? "yes" : "no") << "\n"
                   << "  MPI:        " << (b::kWithMpi ? "yes" : "no") << "\n"
                   << "  build:      " << b::kBuildType << ", " << b::kCompiler
                   << (b::kSanitize[0] ? std::string(", sanitize=") + b::kSanitize : "") << "\n"
                   << "  GPUs:       " << gpus.status << "\n";
         for (auto& g : gpus.devices)
           std::cout << "    [" << g.index << "] " << g.name << ", " << g.total_memory / (1 << 20)
                     << " MiB, sm_" << g.major << g.minor << "\n";
         std::cout << "  io_uring:   " << (uring.ok ? "available" : "unavailable: " + uring.reason)
                   << " (probed in " << dir << ")\n"
                   << "  memlock:    " << memlock_text(lock) << "\n"
                   << "  huge pages: 2 MiB " << count_text(hp.page_2m_free) << " free of "
                   << count_text(hp.page_2m_total) << ", 1 GiB " << count_text(hp.page_1g_free)
                   << " free of " << count_text(hp.page_1g_total)
                   << "; transparent: " << hp.transparent << "\n"
                   << "  CPU Adam:   " << (adam_error.empty() ? adam_path : "error: " + adam_error)
                   << " (supported: " << supported << "; $STRATA_ADAM_PATH forces one)\n";
         return 0;
       };
     }});
}  // namespace
}  // namespace cmd_version
