// `strata bench adam`: parameters per second of the CPU Adam kernel, measured alternately with a
// plain stream kernel of the same memory access pattern on the same threads (the bound), and the
// fraction of that bound reached (median over rounds of the per-round ratio); and in the same
// rounds the step out of place (as the speculative update writes a pending version, committed by
// a swap), with its ratio to the step in place.
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "cli/command.hpp"
#include "profile/adam_bench.hpp"
#include "strata/adam.hpp"
#include "strata/error.hpp"
#include "strata/units.hpp"

namespace cmd_bench_adam {
namespace {

struct Options {
  std::string params = "50M";
  unsigned threads = 0;
  std::string grads = "fp32";
  std::string copy = "auto";
  std::string path = "auto";
  int rounds = 7;
  bool check_finite = false;
  bool json = false;
  std::string device = "cpu";
};

strata::DType parse_dtype(const std::string& s, const char* opt) {
  if (s == "fp32") return strata::DType::kFp32;
  if (s == "fp16") return strata::DType::kFp16;
  if (s == "bf16") return strata::DType::kBf16;
  strata::fail(strata::ErrorCode::kInvalidArgument,
               std::string(opt) + " must be fp32, fp16 or bf16, not '" + s + "'");
}

strata::AdamPath parse_path(const std::string& s) {
  using strata::AdamPath;
  if (s == "auto") return AdamPath::kAuto;
  if (s == "avx512") return AdamPath::kAvx512;
  if (s == "avx2") return AdamPath::kAvx2;
  if (s == "scalar") return AdamPath::kScalar;
  strata::fail(strata::ErrorCode::kInvalidArgument,
               "--path must be auto, avx512, avx2 or scalar, not '" + s + "'");
}

const char* name(strata::DType d) {
  return d == strata::DType::kFp32 ? "fp32" : d == strata::DType::kBf16 ? "bf16" : "fp16";
}

// GPU: Adam step (fp32 grads) vs a device-to-device copy of the same traffic, alternately.
int run_cuda(const Options& o) {
  using namespace strata;
  const std::size_t n = parse_count(o.params);
  const profile::AdamCudaBenchResult r = profile::run_adam_cuda_bench(n, o.rounds);
  if (o.json) {
    nlohmann::json j;
    j["device"] = "cuda";
    j["params"] = n;
    j["grads"] = "fp32";
    j["rounds"] = o.rounds;
    j["bytes_per_param"] = 28;
    j["adam"] = {{"params_per_second", r.adam_params_per_second},
                 {"bytes_per_second", r.adam_bytes_per_second},
                 {"seconds", r.adam_seconds}};
    j["d2d_copy"] = {{"bytes_per_second", r.copy_bytes_per_second}, {"seconds", r.copy_seconds}};
    j["fraction_of_copy"] = r.fraction_of_copy;
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << "CUDA Adam step, " << format_count(n) << " params, grads fp32, 28 B/param\n"
            << "  adam:      " << r.adam_params_per_second / 1e9 << " Gparams/s ("
            << format_rate(r.adam_bytes_per_second) << ")\n"
            << "  D2D copy:  " << format_rate(r.copy_bytes_per_second) << " (read + write)\n"
            << "  fraction of copy bandwidth: " << r.fraction_of_copy << "\n";
  return 0;
}

void print_json(const strata::profile::AdamBenchOptions& bo,
                const strata::profile::AdamBenchResult& r) {
  using namespace strata;
  const char* copy = bo.param_copy ? name(bo.copy_dtype) : "none";
  nlohmann::json j;
  j["params"] = bo.params;
  j["threads"] = bo.threads;
  j["path"] = adam_path_name(r.path);
  j["grads"] = name(bo.grads);
  j["param_copy"] = copy;
  j["check_finite"] = bo.check_finite;
  j["rounds"] = bo.rounds;
  j["bytes_per_param"] = r.bytes_per_param;
  j["adam"] = {{"params_per_second", r.adam_params_per_second},
               {"bytes_per_second", r.adam_bytes_per_second},
               {"seconds_median", r.adam_seconds_median},
               {"seconds", r.adam_seconds}};
  j["stream_bound"] = {{"params_per_second", r.stream_params_per_second},
                       {"bytes_per_second", r.stream_bytes_per_second},
                       {"seconds_median", r.stream_seconds_median},
                       {"seconds", r.stream_seconds}};
  j["fraction_of_bound"] = r.fraction_of_bound;
  j["fraction_of_bound_min"] = r.fraction_min;
  j["fraction_of_bound_max"] = r.fraction_max;
  j["fraction_of_bound_cpu_time"] = r.fraction_of_bound_cpu_time;
  j["adam"]["cpu_seconds"] = r.adam_cpu_seconds;
  j["stream_bound"]["cpu_seconds"] = r.stream_cpu_seconds;
  j["out_of_place"] = {{"params_per_second", r.out_of_place_params_per_second},
                       {"bytes_per_second", r.out_of_place_bytes_per_second},
                       {"seconds_median", r.out_of_place_seconds_median},
                       {"seconds", r.out_of_place_seconds},
                       {"cpu_seconds", r.out_of_place_cpu_seconds},
                       {"ratio", r.out_of_place_ratio},
                       {"ratio_min", r.out_of_place_ratio_min},
                       {"ratio_max", r.out_of_place_ratio_max},
                       {"ratio_cpu_time", r.out_of_place_ratio_cpu_time},
                       {"fraction_of_bound", r.out_of_place_fraction_of_bound}};
  j["out_of_place_stream_bound"] = {{"seconds_median", r.out_of_place_stream_seconds_median},
                                    {"seconds", r.out_of_place_stream_seconds},
                                    {"cpu_seconds", r.out_of_place_stream_cpu_seconds},
                                    {"pattern_ratio", r.out_of_place_pattern_ratio},
                                    {"pattern_ratio_min", r.out_of_place_pattern_ratio_min},
                                    {"pattern_ratio_max", r.out_of_place_pattern_ratio_max}};
  j["out_of_place_ratio"] = r.out_of_place_ratio;
  std::cout << j.dump(2) << "\n";
}

void print_text(const strata::profile::AdamBenchOptions& bo,
                const strata::profile::AdamBenchResult& r) {
  using namespace strata;
  const char* copy = bo.param_copy ? name(bo.copy_dtype) : "none";
  std::cout << "Adam step, " << format_count(bo.params) << " params, " << bo.threads
            << " threads, path " << adam_path_name(r.path) << ", grads " << name(bo.grads)
            << ", param copy " << copy << (bo.check_finite ? ", with finite check" : "") << ", "
            << r.bytes_per_param << " B/param\n";
  std::cout << "  adam:          " << r.adam_params_per_second / 1e6 << " Mparams/s ("
            << format_rate(r.adam_bytes_per_second) << ", " << r.adam_seconds_median * 1e3
            << " ms/step, median of " << bo.rounds << ")\n";
  std::cout << "  stream bound:  " << r.stream_params_per_second / 1e6 << " Mparams/s ("
            << format_rate(r.stream_bytes_per_second) << ", same access pattern, same threads)\n";
  std::cout << "  fraction of bound: " << r.fraction_of_bound << " (rounds: " << r.fraction_min
            << " .. " << r.fraction_max << ")\n";
  std::cout << "  fraction of bound by process CPU time: " << r.fraction_of_bound_cpu_time << "\n";
  std::cout << "  out of place:  " << r.out_of_place_params_per_second / 1e6 << " Mparams/s ("
            << format_rate(r.out_of_place_bytes_per_second) << ", "
            << r.out_of_place_seconds_median * 1e3
            << " ms/step; new state into a second set of arrays, swapped in)\n";
  std::cout << "  out of place / in place: " << r.out_of_place_ratio
            << " (rounds: " << r.out_of_place_ratio_min << " .. " << r.out_of_place_ratio_max
            << "; by process CPU time " << r.out_of_place_ratio_cpu_time << "; target <= 1.10)\n";
  std::cout << "  out-of-place stream / in-place stream: " << r.out_of_place_pattern_ratio
            << " (rounds: " << r.out_of_place_pattern_ratio_min << " .. "
            << r.out_of_place_pattern_ratio_max
            << "; what writing a new version costs this machine's memory, the floor of the ratio "
               "above)\n";
  std::cout << "  out of place, fraction of its own bound: " << r.out_of_place_fraction_of_bound
            << "\n";
}

int run(const Options& o) {
  using namespace strata;
  if (o.device == "cuda") return run_cuda(o);
  if (o.device != "cpu")
    fail(ErrorCode::kInvalidArgument, "--device must be cpu or cuda, not '" + o.device + "'");
  profile::AdamBenchOptions bo;
  bo.params = parse_count(o.params);
  bo.threads = o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  bo.grads = parse_dtype(o.grads, "--grads");
  if (o.copy == "auto") {
    bo.param_copy = bo.grads != DType::kFp32;
    bo.copy_dtype = bo.grads;
  } else if (o.copy != "none") {
    bo.param_copy = true;
    bo.copy_dtype = parse_dtype(o.copy, "--copy");
  }
  bo.path = parse_path(o.path);
  bo.rounds = o.rounds;
  bo.check_finite = o.check_finite;
  const profile::AdamBenchResult r = profile::run_adam_bench(bo);
  if (o.json) {
    print_json(bo, r);
  } else {
    print_text(bo, r);
  }
  return 0;
}

const bool kRegistered = strata::cli::register_command(
    {"bench adam", "CPU Adam kernel throughput against the same-pattern memory bound",
     [](CLI::App& cmd) {
       auto o = std::make_shared<Options>();
       cmd.add_option("--params", o->params, "Parameters (e.g. 50M)")->capture_default_str();
       cmd.add_option("--threads", o->threads, "Threads (0 = all cores)")->capture_default_str();
       cmd.add_option("--grads", o->grads, "Gradient dtype: fp32, fp16, bf16")
           ->capture_default_str();
       cmd.add_option("--copy", o->copy,
                      "Updated-parameter copy: auto (= grads dtype for 16-bit grads), none, fp16, "
                      "bf16, fp32")
           ->capture_default_str();
       cmd.add_option("--path", o->path, "Kernel path: auto, avx512, avx2, scalar")
           ->capture_default_str();
       cmd.add_option("--rounds", o->rounds,
                      "Alternating rounds (Adam step in place, out of place, stream pass)")
           ->capture_default_str();
       cmd.add_flag("--check-finite", o->check_finite, "Include the inf/NaN pre-pass");
       cmd.add_option("--device", o->device, "cpu, or cuda (GPU kernel vs device-to-device copy)")
           ->capture_default_str();
       cmd.add_flag("--json", o->json, "Print one JSON document");
       return [o]() -> int { return run(*o); };
     }});

}  // namespace
}  // namespace cmd_bench_adam
