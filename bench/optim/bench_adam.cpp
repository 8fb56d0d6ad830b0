// Google Benchmark cases for the CPU Adam kernel, 50 M parameters, 2 threads:
//   Adam step (fp32 grads) and the same-pattern stream bound, separately;
//   Adam step (bf16 grads + bf16 parameter copy) and its stream bound;
//   AdamVsStream: alternating rounds in one case, reporting the fraction of the bound (the
//   figure of merit: bandwidth on shared machines drifts, ratios measured together do not).
// items_per_second = parameters per second; bytes_per_second = memory traffic.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "profile/adam_bench.hpp"
#include "strata/adam.hpp"

namespace {

constexpr std::size_t kParams = 50'000'000;
constexpr unsigned kThreads = 2;

struct Arrays {
  std::vector<float> p, m, v, g32;
  std::vector<std::uint16_t> g16, copy;
  explicit Arrays(bool half) : p(kParams, 0.5f), m(kParams, 0.0f), v(kParams, 0.0f) {
    if (half) {
      g16.assign(kParams, 0x3C23);  // bf16 ~0.00995
      copy.assign(kParams, 0);
    } else {
      g32.assign(kParams, 0.01f);
    }
  }
  strata::AdamTensors tensors(bool half) {
    if (half)
      return {p.data(),
              m.data(),
              v.data(),
              g16.data(),
              strata::DType::kBf16,
              copy.data(),
              strata::DType::kBf16,
              kParams};
    return {p.data(),
            m.data(),
            v.data(),
            g32.data(),
            strata::DType::kFp32,
            nullptr,
            strata::DType::kBf16,
            kParams};
  }
};

void run_adam(benchmark::State& state, bool half) {
  Arrays a(half);
  strata::CpuAdam adam(kThreads);
  const strata::AdamParams hp{strata::OptimizerType::kAdamW, 1e-4, 0.9, 0.999, 1e-8, 0.01};
  std::int64_t step = 1;
  const strata::AdamTensors t = a.tensors(half);
  for (auto _ : state) adam.step(hp, t, {step++, 1.0f, false});
  state.SetItemsProcessed(state.iterations() * std::int64_t(kParams));
  state.SetBytesProcessed(state.iterations() * std::int64_t(kParams) * 28);
  state.SetLabel(strata::adam_path_name(adam.path()));
}

void run_stream(benchmark::State& state, bool half) {
  Arrays a(half);
  strata::CpuAdam adam(kThreads);
  const strata::AdamTensors t = a.tensors(half);
  for (auto _ : state) adam.stream_reference(t);
  state.SetItemsProcessed(state.iterations() * std::int64_t(kParams));
  state.SetBytesProcessed(state.iterations() * std::int64_t(kParams) * 28);
}

void BM_AdamStep_Fp32Grads(benchmark::State& s) { run_adam(s, false); }
void BM_StreamBound_Fp32Pattern(benchmark::State& s) { run_stream(s, false); }
void BM_AdamStep_Bf16GradsBf16Copy(benchmark::State& s) { run_adam(s, true); }
void BM_StreamBound_Bf16Pattern(benchmark::State& s) { run_stream(s, true); }

void BM_AdamVsStream(benchmark::State& state) {
  strata::profile::AdamBenchOptions o;
  o.params = kParams;
  o.threads = kThreads;
  const bool half = state.range(0) != 0;
  o.grads = half ? strata::DType::kBf16 : strata::DType::kFp32;
  o.param_copy = half;
  o.rounds = 5;
  double fraction = 0, adam_pps = 0, stream_pps = 0;
  for (auto _ : state) {
    const auto r = strata::profile::run_adam_bench(o);
    fraction = r.fraction_of_bound;
    adam_pps = r.adam_params_per_second;
    stream_pps = r.stream_params_per_second;
  }
  state.counters["fraction_of_bound"] = fraction;
  state.counters["adam_params_per_second"] = adam_pps;
  state.counters["stream_params_per_second"] = stream_pps;
  state.SetLabel(half ? "bf16 grads + bf16 copy" : "fp32 grads");
}

BENCHMARK(BM_AdamStep_Fp32Grads)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_StreamBound_Fp32Pattern)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AdamStep_Bf16GradsBf16Copy)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_StreamBound_Bf16Pattern)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AdamVsStream)
    ->Arg(0)
    ->Arg(1)
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
