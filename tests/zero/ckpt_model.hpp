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

inline Config ckpt_config(int stage, double nvme_fraction, const std::string& swap_dir) {
  Config cfg;
  cfg.zero.stage = stage;
  cfg.zero.reduce_bucket_size = 50000;
  cfg.zero.sub_group_size = 70000;
  cfg.precision.params = DType::kFp32;
  cfg.precision.grads = DType::kFp32;
  cfg.optimizer.lr = 1e-3;
  cfg.optimizer.weight_decay = 0.01;
  cfg.runtime.cpu_threads = 1;
  cfg.runtime.collective_timeout_s = 30.0;
  if (nvme_fraction > 0) {
    cfg.offload.optimizer.tier = Tier::kNvme;
    cfg.offload.optimizer.fraction = nvme_fraction;
    cfg.tiers.host.buffer_count = 3;
    cfg.tiers.host.buffer_size = 256 << 10;
    cfg.tiers.nvme.paths = {swap_dir};
    cfg.tiers.nvme.engine = IoEngineKind::kThreads;
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
