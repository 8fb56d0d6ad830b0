// The engine against torch itself: N in-process ranks (N = 1..4, stages 0-3, FP32) train a few
// steps; torch.optim.AdamW (Debian's /usr/bin/python3, torch 1.13, single-tensor implementation)
// runs on the same initial values with each step's gradient = the ranks' gradients summed in rank
// order, divided by N (DDP's averaging). The engine's parameters must equal torch's bit for bit on
// every rank: gradients are averaged by dividing by N (AdamStepOptions::grad_divisor), not by
// multiplying by float(1/N), which differs for N = 3. Skipped when torch cannot be imported.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "engine_test_util.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

const char* kPython = "/usr/bin/python3";

bool torch_available() {
  std::string out;
  return run_command(std::string(kPython) + " -c 'import torch' 2>&1", &out) == 0;
}

void append(std::ofstream& f, const void* data, std::size_t bytes) {
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
}

TEST(EngineTorch, AveragedGradientsMatchTorchBitwise) {
  if (!torch_available()) GTEST_SKIP() << kPython << " cannot import torch";
  const std::uint64_t seed = test_seed("EngineTorch");
  TempDir dir("strata-engine-torch");
  EngineCase c;
  c.steps = 5;
  c.params = DType::kFp32;
  c.grads = DType::kFp32;
  std::size_t total = 0;
  for (auto n : c.sizes) total += n;
  const Config cfg = engine_config(c);
  std::ofstream list(dir.str() + "/cases.txt");
  for (int world = 1; world <= 4; ++world) {
    const std::string name = "engine_n" + std::to_string(world);
    std::ofstream init(dir.str() + "/" + name + ".init", std::ios::binary);
    for (std::size_t t = 0; t < c.sizes.size(); ++t) {
      auto v = initial_values(seed, t, c.sizes[t]);
      append(init, v.data(), v.size() * 4);
    }
    // For each step, each rank's gradient over all tensors (flat, registration order).
    std::ofstream grads(dir.str() + "/" + name + ".grads", std::ios::binary);
    for (int s = 0; s < c.steps; ++s)
      for (int r = 0; r < world; ++r)
        for (std::size_t t = 0; t < c.sizes.size(); ++t) {
          auto g = grad_of(seed, r, s, t, c.sizes[t], c.grads);
          append(grads, g.data(), g.size());
        }
    char line[512];
    std::snprintf(line, sizeof line, "%s adamw %.17g %.17g %.17g %.17g %.17g %zu %d fp32 1 0 %d\n",
                  name.c_str(), cfg.optimizer.lr, cfg.optimizer.beta1, cfg.optimizer.beta2,
                  cfg.optimizer.eps, cfg.optimizer.weight_decay, total, c.steps, world);
    list << line;
  }
  list.close();
  std::string out;
  const std::string cmd = std::string(kPython) + " " + source_dir() +
                          "/scripts/adam_torch_ref.py check " + dir.str() + " 2>&1";
  ASSERT_EQ(run_command(cmd, &out), 0) << cmd << "\n" << out;

  for (int world = 1; world <= 4; ++world) {
    const std::string name = "engine_n" + std::to_string(world);
    std::vector<float> ref(total);
    std::ifstream in(dir.str() + "/" + name + ".torch", std::ios::binary);
    in.read(reinterpret_cast<char*>(ref.data()), static_cast<std::streamsize>(total * 4));
    ASSERT_TRUE(in.good()) << name;
    std::vector<std::vector<float>> want;
    std::size_t off = 0;
    for (auto n : c.sizes) {
      want.emplace_back(ref.begin() + static_cast<std::ptrdiff_t>(off),
                        ref.begin() + static_cast<std::ptrdiff_t>(off + n));
      off += n;
    }
    for (int stage = 0; stage <= 3; ++stage) {
      c.stage = stage;
      auto comms = make_inprocess_communicators(world, 30.0);
      std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
      rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
        got[static_cast<std::size_t>(rank)] = train_rank(comm, c, seed);
      }));
      for (int r = 0; r < world; ++r)
        expect_bitwise_equal(
            got[static_cast<std::size_t>(r)], want,
            strata::strcat("N=", world, " stage ", stage, " rank ", r, " vs torch"));
    }
  }
}

// Loss scaling as torch AMP and DeepSpeed do it: fp16 gradients are scaled (dynamic, from
// precision.loss_scale.initial), bf16 and fp32 are not, unless precision.loss_scale.enabled says
// otherwise; the key takes auto, true or false and nothing else.
TEST(EngineTorch, Bf16GradientsAreNotLossScaledByDefault) {
  auto scale_of = [](const std::string& yaml) {
    const Config cfg = parse_config(yaml, "<test>");
    auto comms = make_inprocess_communicators(1, 30.0);
    Engine e(cfg, *comms[0]);
    std::vector<float> init(8, 0.5f);
    e.add_parameter("w", init);
    e.finalize();
    return e.loss_scale();
  };
  const std::string base = "model: {parameters: 8}\nzero: {stage: 0}\n";
  EXPECT_EQ(scale_of(base + "precision: {params: bf16, grads: bf16}\n"), 1.0);
  EXPECT_EQ(scale_of(base + "precision: {params: fp32, grads: fp32}\n"), 1.0);
  EXPECT_EQ(scale_of(base + "precision: {params: fp16, grads: fp16}\n"), 65536.0);
  EXPECT_EQ(scale_of(base + "precision: {params: bf16, grads: bf16, loss_scale: {enabled: true, "
                            "initial: 1024}}\n"),
            1024.0);
  EXPECT_EQ(
      scale_of(base + "precision: {params: fp16, grads: fp16, loss_scale: {enabled: false}}\n"),
      1.0);
  EXPECT_EQ(scale_of(base + "precision: {grads: fp16, loss_scale: {enabled: auto}}\n"), 65536.0);
  try {
    parse_config(base + "precision: {loss_scale: {enabled: sometimes}}\n", "<test>");
    ADD_FAILURE() << "enabled: sometimes was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_NE(std::string(e.what()).find("precision.loss_scale.enabled"), std::string::npos)
        << e.what();
  }
  // It survives to_yaml.
  const Config c = parse_config(base + "precision: {loss_scale: {enabled: false}}\n", "<test>");
  EXPECT_EQ(parse_config(to_yaml(c), "<round trip>").precision.loss_scale.enabled,
            LossScaling::kOff);
}

}  // namespace
}  // namespace strata::testing
