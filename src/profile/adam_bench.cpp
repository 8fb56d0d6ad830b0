#include "profile/adam_bench.hpp"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <utility>

#include "core/numeric.hpp"
#include "profile/profile_internal.hpp"
#include "strata/error.hpp"

namespace strata::profile {

namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<void, FreeDeleter>;

Buffer alloc(std::size_t bytes, const char* what) {
  const std::size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
  if (!p)
    fail(ErrorCode::kOutOfMemory,
         strcat("bench adam: cannot allocate ", bytes, " bytes for ", what));
  return Buffer(p);
}

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Wall and process CPU seconds of fn().
template <class Fn>
std::pair<double, double> timed(Fn&& fn) {
  const double c0 = process_cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {wall, process_cpu_seconds() - c0};
}

// Initial values (touching every page): weights ~ N(0, 1)-ish, zero moments, small positive
// gradients (so that the stream kernel's v += g keeps v >= 0 and nothing becomes denormal).
void fill_initial(const AdamBenchOptions& o, std::size_t n, Buffer& p, Buffer& m, Buffer& v,
                  Buffer& g, Buffer& c) {
  const std::size_t csz = dtype_size(o.copy_dtype);
  std::vector<float> tmp(std::min<std::size_t>(n, 1 << 20));
  std::mt19937 rng(12345);
  std::uniform_real_distribution<float> wd(-1.0f, 1.0f), gd(1e-3f, 1e-2f);
  for (auto& x : tmp) x = wd(rng);
  float* pf = static_cast<float*>(p.get());
  for (std::size_t i = 0; i < n; i += tmp.size())
    std::copy_n(tmp.begin(), std::min(tmp.size(), n - i), pf + i);
  std::fill_n(static_cast<float*>(m.get()), n, 0.0f);
  std::fill_n(static_cast<float*>(v.get()), n, 0.0f);
  for (auto& x : tmp) x = gd(rng);
  for (std::size_t i = 0; i < n; i += tmp.size()) {
    const std::size_t len = std::min(tmp.size(), n - i);
    if (o.grads == DType::kFp32) {
      std::copy_n(tmp.begin(), len, static_cast<float*>(g.get()) + i);
    } else {
      auto* gh = static_cast<std::uint16_t*>(g.get()) + i;
      if (o.grads == DType::kBf16)
        convert_fp32_to_bf16(tmp.data(), gh, len);
      else
        convert_fp32_to_fp16(tmp.data(), gh, len);
    }
  }
  if (c) std::fill_n(static_cast<std::uint8_t*>(c.get()), n * csz, std::uint8_t(0));
}

// The ABBA rounds: Adam and the stream reference timed alternately first, so drift favours
// neither. Appends each round's seconds to r; returns the stream / Adam time ratios (wall, CPU).
template <class RunAdam, class RunStream>
std::pair<std::vector<double>, std::vector<double>> time_rounds(int rounds, RunAdam&& run_adam,
                                                                RunStream&& run_stream,
                                                                AdamBenchResult& r) {
  std::vector<double> fractions, cpu_fractions;
  for (int round = 0; round < rounds; ++round) {
    // Alternate the order inside each round too (ABBA) so drift does not favour either.
    std::pair<double, double> ta, tsr;
    if (round % 2 == 0) {
      ta = timed(run_adam);
      tsr = timed(run_stream);
    } else {
      tsr = timed(run_stream);
      ta = timed(run_adam);
    }
    r.adam_seconds.push_back(ta.first);
    r.stream_seconds.push_back(tsr.first);
    r.adam_cpu_seconds.push_back(ta.second);
    r.stream_cpu_seconds.push_back(tsr.second);
    fractions.push_back(tsr.first / ta.first);
    if (ta.second > 0) cpu_fractions.push_back(tsr.second / ta.second);
  }
  return {fractions, cpu_fractions};
}

}  // namespace

AdamBenchResult run_adam_bench(const AdamBenchOptions& o) {
  if (o.params == 0) fail(ErrorCode::kInvalidArgument, "bench adam: --params must be > 0");
  if (o.threads == 0) fail(ErrorCode::kInvalidArgument, "bench adam: --threads must be > 0");
  if (o.rounds < 1) fail(ErrorCode::kInvalidArgument, "bench adam: --rounds must be >= 1");
  const std::size_t n = o.params;
  const std::size_t gsz = dtype_size(o.grads), csz = dtype_size(o.copy_dtype);
  Buffer p = alloc(n * 4, "param"), m = alloc(n * 4, "exp_avg"), v = alloc(n * 4, "exp_avg_sq");
  Buffer g = alloc(n * gsz, "grad");
  Buffer c = o.param_copy ? alloc(n * csz, "param copy") : Buffer();

  CpuAdam adam(o.threads, o.path);
  fill_initial(o, n, p, m, v, g, c);

  AdamTensors t{static_cast<float*>(p.get()),
                static_cast<float*>(m.get()),
                static_cast<float*>(v.get()),
                g.get(),
                o.grads,
                c.get(),
                o.copy_dtype,
                n};
  // The stream reference writes the copy too, in its dtype (it used to skip an fp32 copy, and a
  // 16-bit copy of fp32 grads: the bound then moved 4 or 2 bytes per parameter fewer than Adam).
  const AdamTensors ts = t;
  const AdamParams hp{OptimizerType::kAdamW, 1e-4, 0.9, 0.999, 1e-8, 0.01};

  AdamBenchResult r;
  r.options = o;
  r.path = adam.path();
  r.bytes_per_param = 12.0 + 12.0 + double(gsz) + (o.param_copy ? double(csz) : 0.0) +
                      (o.check_finite ? double(gsz) : 0.0);
  std::int64_t step = 1;
  // Warm-up: one of each (first-touch effects, thread wake-up paths).
  adam.step(hp, t, {step++, 1.0f, o.check_finite});
  adam.stream_reference(ts);
  auto run_adam = [&] { adam.step(hp, t, {step++, 1.0f, o.check_finite}); };
  auto run_stream = [&] { adam.stream_reference(ts); };
  const auto [fractions, cpu_fractions] = time_rounds(o.rounds, run_adam, run_stream, r);
  if (!cpu_fractions.empty()) r.fraction_of_bound_cpu_time = median(cpu_fractions);
  // The stream reference moves the same bytes as one step without the finite pre-pass.
  const double stream_bytes = r.bytes_per_param - (o.check_finite ? double(gsz) : 0.0);
  r.adam_seconds_median = median(r.adam_seconds);
  r.stream_seconds_median = median(r.stream_seconds);
  r.adam_params_per_second = double(n) / r.adam_seconds_median;
  r.stream_params_per_second = double(n) / r.stream_seconds_median;
  r.adam_bytes_per_second = r.adam_params_per_second * r.bytes_per_param;
  r.stream_bytes_per_second = r.stream_params_per_second * stream_bytes;
  r.fraction_of_bound = median(fractions);
  r.fraction_min = *std::min_element(fractions.begin(), fractions.end());
  r.fraction_max = *std::max_element(fractions.begin(), fractions.end());
  return r;
}

}  // namespace strata::profile
