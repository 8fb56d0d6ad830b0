// Config load + plan. Reference in the same run: BM_ReadFile (reading the same file's bytes),
// so the ratio parse/read says what the YAML parsing and validation cost on top of the I/O.
#include <benchmark/benchmark.h>

#include <fstream>
#include <sstream>

#include "strata/config.hpp"
#include "strata/plan.hpp"

namespace {

const std::string kConfig = std::string(STRATA_SOURCE_DIR) + "/configs/zero3-nvme-params.yaml";

void BM_ReadFile(benchmark::State& state) {
  for (auto _ : state) {
    std::ifstream in(kConfig);
    std::stringstream ss;
    ss << in.rdbuf();
    benchmark::DoNotOptimize(ss.str());
  }
}
BENCHMARK(BM_ReadFile);

void BM_LoadConfig(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(strata::load_config(kConfig));
}
BENCHMARK(BM_LoadConfig);

void BM_LoadConfigWithOverrides(benchmark::State& state) {
  const std::vector<std::string> sets = {"zero.stage=3", "tiers.gpu.budget=40GB",
                                         "offload.optimizer={tier: cpu, fraction: 0.5}"};
  for (auto _ : state) benchmark::DoNotOptimize(strata::load_config(kConfig, sets));
}
BENCHMARK(BM_LoadConfigWithOverrides);

void BM_MakePlan(benchmark::State& state) {
  const strata::Config c = strata::load_config(kConfig);
  for (auto _ : state) benchmark::DoNotOptimize(strata::make_plan(c));
}
BENCHMARK(BM_MakePlan);

void BM_LoadAndPlan(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(strata::make_plan(strata::load_config(kConfig)));
}
BENCHMARK(BM_LoadAndPlan);

void BM_ToYamlRoundTrip(benchmark::State& state) {
  const strata::Config c = strata::load_config(kConfig);
  for (auto _ : state) benchmark::DoNotOptimize(strata::parse_config(strata::to_yaml(c)));
}
BENCHMARK(BM_ToYamlRoundTrip);

}  // namespace

BENCHMARK_MAIN();
