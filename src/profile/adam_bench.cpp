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

Buffer alloc(std::size_t bytes, const char* what, std::size_t align = 64) {
  const std::size_t rounded = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded == 0 ? align : rounded);
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

// Per-round ratios of two timings (wall, process CPU).
struct Ratios {
  std::vector<double> wall, cpu;
  void add(std::pair<double, double> num, std::pair<double, double> den) {
    wall.push_back(num.first / den.first);
    if (den.second > 0) cpu.push_back(num.second / den.second);
  }
};

// The rounds: Adam in place, Adam out of place and the stream reference, the order reversed every
// other round (ABC, CBA) so that drift favours none. Appends each round's seconds to r; returns
// the stream / Adam and out-of-place / in-place time ratios.
template <class RunAdam, class RunOut, class RunStream>
std::pair<Ratios, Ratios> time_rounds(int rounds, RunAdam&& run_adam, RunOut&& run_out,
                                      RunStream&& run_stream, AdamBenchResult& r) {
  Ratios fractions, out_ratios;
  for (int round = 0; round < rounds; ++round) {
    std::pair<double, double> ta, to, tsr;
    if (round % 2 == 0) {
      ta = timed(run_adam);
      to = timed(run_out);
      tsr = timed(run_stream);
    } else {
      tsr = timed(run_stream);
      to = timed(run_out);
      ta = timed(run_adam);
    }
    r.adam_seconds.push_back(ta.first);
    r.stream_seconds.push_back(tsr.first);
    r.out_of_place_seconds.push_back(to.first);
    r.adam_cpu_seconds.push_back(ta.second);
    r.stream_cpu_seconds.push_back(tsr.second);
    r.out_of_place_cpu_seconds.push_back(to.second);
    fractions.add(tsr, ta);
    out_ratios.add(to, ta);
  }
  return {fractions, out_ratios};
}

// The second set of state arrays the out-of-place step writes (page-aligned, as the store's
// pending versions are), touched once so that no round pays for the first faults.
struct OutArrays {
  Buffer p, m, v;
  float* next[3];  // where the next out-of-place step writes: these, or the first set
  explicit OutArrays(std::size_t n)
      : p(alloc(n * 4, "param (out of place)", 4096)),
        m(alloc(n * 4, "exp_avg (out of place)", 4096)),
        v(alloc(n * 4, "exp_avg_sq (out of place)", 4096)),
        next{static_cast<float*>(p.get()), static_cast<float*>(m.get()),
             static_cast<float*>(v.get())} {
    for (float* a : next) std::fill_n(a, n, 0.0f);
  }
};

// One step out of place from the committed arrays of `t` into out.next, then the commit's swap:
// the new arrays become t's (committed), the old ones the next destination.
void out_of_place_step(CpuAdam& adam, const AdamParams& hp, AdamTensors& t, OutArrays& out,
                       const AdamStepOptions& so) {
  AdamTensors o = t;
  o.param_out = out.next[0];
  o.exp_avg_out = out.next[1];
  o.exp_avg_sq_out = out.next[2];
  adam.step(hp, o, so);
  std::swap(t.param, out.next[0]);
  std::swap(t.exp_avg, out.next[1]);
  std::swap(t.exp_avg_sq, out.next[2]);
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
  OutArrays out(n);
  std::int64_t step = 1;
  auto run_adam = [&] { adam.step(hp, t, {step++, 1.0f, o.check_finite}); };
  auto run_out = [&] { out_of_place_step(adam, hp, t, out, {step++, 1.0f, o.check_finite}); };
  auto run_stream = [&] { adam.stream_reference(ts); };
  // Warm-up: one of each (first-touch effects, thread wake-up paths).
  run_adam();
  run_out();
  run_stream();
  const auto [fractions, out_ratios] = time_rounds(o.rounds, run_adam, run_out, run_stream, r);
  if (!fractions.cpu.empty()) r.fraction_of_bound_cpu_time = median(fractions.cpu);
  if (!out_ratios.cpu.empty()) r.out_of_place_ratio_cpu_time = median(out_ratios.cpu);
  // The stream reference moves the same bytes as one step without the finite pre-pass.
  const double stream_bytes = r.bytes_per_param - (o.check_finite ? double(gsz) : 0.0);
  r.adam_seconds_median = median(r.adam_seconds);
  r.stream_seconds_median = median(r.stream_seconds);
  r.adam_params_per_second = double(n) / r.adam_seconds_median;
  r.stream_params_per_second = double(n) / r.stream_seconds_median;
  r.adam_bytes_per_second = r.adam_params_per_second * r.bytes_per_param;
  r.stream_bytes_per_second = r.stream_params_per_second * stream_bytes;
  r.fraction_of_bound = median(fractions.wall);
  r.fraction_min = *std::min_element(fractions.wall.begin(), fractions.wall.end());
  r.fraction_max = *std::max_element(fractions.wall.begin(), fractions.wall.end());
  r.out_of_place_seconds_median = median(r.out_of_place_seconds);
  r.out_of_place_params_per_second = double(n) / r.out_of_place_seconds_median;
  r.out_of_place_bytes_per_second = r.out_of_place_params_per_second * r.bytes_per_param;
  r.out_of_place_ratio = median(out_ratios.wall);
  r.out_of_place_ratio_min = *std::min_element(out_ratios.wall.begin(), out_ratios.wall.end());
  r.out_of_place_ratio_max = *std::max_element(out_ratios.wall.begin(), out_ratios.wall.end());
  return r;
}

}  // namespace strata::profile
