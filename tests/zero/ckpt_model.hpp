// A small model trained through the Engine, shared by the checkpoint tests and the helper binary
// they kill mid-save: deterministic initial values and per-(rank, step) gradients, so any number
// of steps can be replayed in another process.
#pragma once

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine_basics.hpp"
#include "strata/engine.hpp"

namespace strata::testing {

// The tensor sizes the checkpoint tests of test_zero_offload train (uneven, one empty).
inline const std::vector<std::size_t> kCkptSizes{5000, 17, 0, 12345};
// The model of the SIGKILL-during-save test: the helper (ckpt_helper.cpp) trains it, the test
// reloads it.
inline const std::vector<std::size_t> kKillSizes{60000, 33, 90001};

inline Config ckpt_config(int stage, double nvme_fraction, const std::string& swap_dir) {
  Config cfg = base_engine_config(stage, 50000, 70000, 30.0);
  cfg.optimizer.lr = 1e-3;
  cfg.optimizer.weight_decay = 0.01;
  if (nvme_fraction > 0) {
    cfg.offload.optimizer.tier = Tier::kNvme;
    cfg.offload.optimizer.fraction = nvme_fraction;
    use_test_swap(cfg, swap_dir, 3, 256 << 10);
  }
  return cfg;
}

inline std::vector<TensorId> ckpt_register(Engine& e, const std::vector<std::size_t>& sizes) {
  std::vector<TensorId> ids;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::mt19937_64 rng(1234 + t);
    std::uniform_real_distribution<float> d(-1, 1);
    std::vector<float> init(sizes[t]);
    for (auto& x : init) x = d(rng);
    ids.push_back(e.add_parameter("t" + std::to_string(t), init));
  }
  e.finalize();
  return ids;
}

// Step `step` (0-based) of rank `rank`; step 3 overflows (skipped everywhere).
inline void ckpt_step(Engine& e, const std::vector<std::size_t>& sizes, int rank, int step) {
  for (std::size_t t = sizes.size(); t-- > 0;) {
    std::mt19937_64 rng(99 + 1000003ull * static_cast<std::uint64_t>(step) + 7919ull * t +
                        static_cast<std::uint64_t>(rank) * 31);
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> g(sizes[t]);
    for (auto& x : g) x = d(rng);
    if (step == 3 && t == 0 && !g.empty()) g[0] = std::numeric_limits<float>::infinity();
    e.set_gradient(static_cast<TensorId>(t), g.data());
  }
  e.step();
}

}  // namespace strata::testing
