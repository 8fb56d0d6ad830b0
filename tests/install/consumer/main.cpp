// A program outside the strata tree, built against the installed package (find_package(strata)
// and, separately, `pkg-config --cflags --libs strata`): embeds the engine — two in-process ranks,
// stage 2, a few steps — and CpuAdam, and checks the results.
#include <cmath>
#include <cstdio>
#include <thread>
#include <vector>

#include "strata/adam.hpp"
#include "strata/build_info.hpp"
#include "strata/communicator.hpp"
#include "strata/config.hpp"
#include "strata/device_query.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "strata/units.hpp"

namespace {

int fail(const char* what) {
  std::fprintf(stderr, "consumer: %s\n", what);
  return 1;
}

}  // namespace

int main() {
  if (strata::parse_bytes("4GiB") != (4ULL << 30)) return fail("parse_bytes");
  try {
    strata::parse_bytes("4 GiBs");
    return fail("parse_bytes accepted '4 GiBs'");
  } catch (const strata::Error& e) {
    if (e.exit_code() != 2) return fail("exit code of a bad size");
  }

  // CpuAdam: one AdamW step moves every parameter against its gradient.
  {
    std::vector<float> p(1000, 1.0f), m(1000, 0.0f), v(1000, 0.0f), g(1000, 0.5f);
    strata::CpuAdam adam(2);
    strata::AdamTensors t{
        p.data(), m.data(), v.data(), g.data(), strata::DType::kFp32, nullptr, strata::DType::kBf16,
        p.size()};
    strata::AdamParams hp;
    if (!adam.step(hp, t, {}).applied) return fail("CpuAdam step not applied");
    for (float x : p)
      if (!(x < 1.0f)) return fail("CpuAdam did not move a parameter");
  }

  // The engine: two in-process ranks, stage 2, fp32, 3 steps; both ranks end with the same
  // parameters, all moved, all finite.
  strata::Config cfg = strata::parse_config(
      "model: {parameters: 1000}\nzero: {stage: 2, sub_group_size: 100, reduce_bucket_size: 200}\n"
      "precision: {params: fp32, grads: fp32}\noptimizer: {lr: 0.01}\nworld: {ranks: 2}\n",
      "<consumer>");
  auto comms = strata::make_inprocess_communicators(2, 30.0);
  std::vector<std::vector<float>> result(2);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        strata::Engine e(cfg, *comms[r]);
        std::vector<float> init(1000);
        for (std::size_t i = 0; i < init.size(); ++i) init[i] = 0.001f * static_cast<float>(i);
        auto a = e.add_parameter("a", std::span<const float>(init.data(), 600));
        auto b = e.add_parameter("b", std::span<const float>(init.data() + 600, 400));
        e.finalize();
        for (int s = 0; s < 3; ++s) {
          std::vector<float> ga(600, 0.1f * (r + 1)), gb(400, -0.2f);
          e.set_gradient(b, gb.data());
          e.set_gradient(a, ga.data());
          if (!e.step().applied) throw std::runtime_error("step skipped");
        }
        result[r].resize(1000);
        e.read_param(a, std::span<float>(result[r].data(), 600));
        e.read_param(b, std::span<float>(result[r].data() + 600, 400));
      } catch (const std::exception& ex) {
        errors[r] = ex.what();
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (!e.empty()) return fail(e.c_str());
  if (result[0] != result[1]) return fail("ranks disagree");
  for (std::size_t i = 0; i < 1000; ++i)
    if (!std::isfinite(result[0][i]) || result[0][i] == 0.001f * static_cast<float>(i))
      return fail("a parameter did not move");

  auto gpus = strata::query_cuda_devices();
  std::printf("consumer ok: strata %s, engine 2 ranks x 3 steps, %s\n", strata::build::kVersion,
              gpus.status.c_str());
  return 0;
}
