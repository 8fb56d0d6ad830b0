#include "profile/adam_bench.hpp"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
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

// Per-round ratios of two passes' timings (wall, process CPU).
struct Ratios {
  std::vector<double> wall, cpu;
  Ratios(const std::vector<std::pair<double, double>>& num,
         const std::vector<std::pair<double, double>>& den) {
    for (std::size_t i = 0; i < num.size(); ++i) {
      wall.push_back(num[i].first / den[i].first);
      if (den[i].second > 0) cpu.push_back(num[i].second / den[i].second);
    }
  }
};

// The rounds: each pass once per round, the order reversed every other round (ABCD, DCBA) so
// that drift favours none. Returns each pass's (wall, CPU) seconds per round.
std::vector<std::vector<std::pair<double, double>>> time_rounds(
    int rounds, const std::vector<std::function<void()>>& passes) {
  std::vector<std::vector<std::pair<double, double>>> t(passes.size());
  for (int round = 0; round < rounds; ++round)
    for (std::size_t k = 0; k < passes.size(); ++k) {
      const std::size_t at = round % 2 == 0 ? k : passes.size() - 1 - k;
      t[at].push_back(timed(passes[at]));
    }
  return t;
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

// One pass out of place from the committed arrays of `t` into out.next (`run`: the Adam step or
// the stream reference), then the commit's swap: the new arrays become t's (committed), the old
// ones the next destination.
template <class Run>
void out_of_place(AdamTensors& t, OutArrays& out, Run&& run) {
  AdamTensors o = t;
  o.param_out = out.next[0];
  o.exp_avg_out = out.next[1];
  o.exp_avg_sq_out = out.next[2];
  run(o);
  std::swap(t.param, out.next[0]);
  std::swap(t.exp_avg, out.next[1]);
  std::swap(t.exp_avg_sq, out.next[2]);
}

void seconds_of(const std::vector<std::pair<double, double>>& t, std::vector<double>& wall,
                std::vector<double>& cpu) {
  for (const auto& [w, c] : t) {
    wall.push_back(w);
    cpu.push_back(c);
  }
}

double min_of(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

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
  const AdamParams hp{OptimizerType::kAdamW, 1e-4, 0.9, 0.999, 1e-8, 0.01};

  AdamBenchResult r;
  r.options = o;
  r.path = adam.path();
  r.bytes_per_param = 12.0 + 12.0 + double(gsz) + (o.param_copy ? double(csz) : 0.0) +
                      (o.check_finite ? double(gsz) : 0.0);
  OutArrays out(n);
  std::int64_t step = 1;
  // Every pass on the committed arrays of `t` (the stream's trivial arithmetic keeps them finite,
  // v >= 0). The stream reference writes the copy too, in its dtype (it used to skip an fp32 copy,
  // and a 16-bit copy of fp32 grads: the bound then moved 4 or 2 bytes per parameter fewer).
  const std::vector<std::function<void()>> passes = {
      [&] {
        adam.step(hp, t, {step++, 1.0f, o.check_finite});
      },
      [&] {
        out_of_place(t, out, [&](const AdamTensors& x) {
          adam.step(hp, x, {step++, 1.0f, o.check_finite});
        });
      },
      [&] { adam.stream_reference(t); },
      [&] { out_of_place(t, out, [&](const AdamTensors& x) { adam.stream_reference(x); }); }};
  for (const auto& pass : passes) pass();  // warm-up: first-touch effects, thread wake-up paths
  const auto times = time_rounds(o.rounds, passes);
  seconds_of(times[0], r.adam_seconds, r.adam_cpu_seconds);
  seconds_of(times[1], r.out_of_place_seconds, r.out_of_place_cpu_seconds);
  seconds_of(times[2], r.stream_seconds, r.stream_cpu_seconds);
  seconds_of(times[3], r.out_of_place_stream_seconds, r.out_of_place_stream_cpu_seconds);
  const Ratios fractions(times[2], times[0]), out_ratios(times[1], times[0]);
  const Ratios out_fractions(times[3], times[1]), pattern(times[3], times[2]);
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
  r.fraction_min = min_of(fractions.wall);
  r.fraction_max = max_of(fractions.wall);
  r.out_of_place_seconds_median = median(r.out_of_place_seconds);
  r.out_of_place_params_per_second = double(n) / r.out_of_place_seconds_median;
  r.out_of_place_bytes_per_second = r.out_of_place_params_per_second * r.bytes_per_param;
  r.out_of_place_ratio = median(out_ratios.wall);
  r.out_of_place_ratio_min = min_of(out_ratios.wall);
  r.out_of_place_ratio_max = max_of(out_ratios.wall);
  r.out_of_place_stream_seconds_median = median(r.out_of_place_stream_seconds);
  r.out_of_place_fraction_of_bound = median(out_fractions.wall);
  r.out_of_place_pattern_ratio = median(pattern.wall);
  r.out_of_place_pattern_ratio_min = min_of(pattern.wall);
  r.out_of_place_pattern_ratio_max = max_of(pattern.wall);
  return r;
}

}  // namespace strata::profile
