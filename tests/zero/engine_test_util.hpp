// Shared by the engine tests (in-process and MPI): a small model of uneven, tiny and empty
// tensors, rank-distinguishable gradients that every rank can recompute, one rank's training
// loop through the Engine, and the single-rank unsharded reference (CpuAdam on the rank-ordered
// sum of the ranks' gradients).
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <random>

#include "../comm/comm_test_util.hpp"
#include "engine_basics.hpp"
#include "strata/adam.hpp"
#include "strata/engine.hpp"
#include "test_util.hpp"

namespace strata::testing {

struct EngineCase {
  int stage = 2;
  DType params = DType::kFp32;
  DType grads = DType::kFp32;
  int steps = 3;
  std::vector<std::size_t> sizes{37, 0, 1, 130, 5, 64, 301, 2};
  std::uint64_t bucket = 100;    // zero.reduce_bucket_size (elements): several buckets
  std::uint64_t sub_group = 50;  // zero.sub_group_size: several sub-groups per partition
  double clip = 0.0;
  double timeout_s = 30.0;
  // Before each step's backward, a partial backward of other gradients (every tensor but the first)
  // that discard_gradients() drops: the result must not change.
  bool discard_first = false;
};

inline Config engine_config(const EngineCase& c) {
  Config cfg;
  cfg.zero.stage = c.stage;
  cfg.zero.reduce_bucket_size = c.bucket;
  cfg.zero.sub_group_size = c.sub_group;
  cfg.precision.params = c.params;
  cfg.precision.grads = c.grads;
  use_reference_adamw(cfg);
  cfg.optimizer.grad_clip = c.clip;
  cfg.runtime.cpu_threads = 1;
  cfg.runtime.collective_timeout_s = c.timeout_s;
  return cfg;
}

inline std::vector<float> initial_values(std::uint64_t seed, std::size_t tensor, std::size_t n) {
  std::mt19937_64 rng(seed ^ (0x9e3779b97f4a7c15ull * (tensor + 1)));
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

inline std::vector<unsigned char> grad_of(std::uint64_t seed, int rank, int step,
                                          std::size_t tensor, std::size_t n, DType dt) {
  return rank_data(seed, rank, step * 1000 + static_cast<int>(tensor), n, dt);
}

// One rank's loop; returns the final parameters (FP32 view of the model dtype) per tensor.
inline std::vector<std::vector<float>> train_rank(Communicator& comm, const EngineCase& c,
                                                  std::uint64_t seed,
                                                  std::vector<StepResult>* results = nullptr) {
  Engine e(engine_config(c), comm);
  std::vector<TensorId> ids;
  for (std::size_t t = 0; t < c.sizes.size(); ++t)
    ids.push_back(e.add_parameter("t" + std::to_string(t), initial_values(seed, t, c.sizes[t])));
  e.finalize();
  for (int s = 0; s < c.steps; ++s) {
    // forward: every tensor gathered (stage 3) and released in order
    for (auto id : ids) {
      e.gather({&id, 1});
      if (c.sizes[id] > 0) {
        EXPECT_NE(e.param(id), nullptr);
      }
      e.release({&id, 1});
    }
    if (c.discard_first) {
      for (auto it = ids.rbegin(); std::next(it) != ids.rend(); ++it) {
        auto g = grad_of(seed, comm.rank(), s + 500, *it, c.sizes[*it], c.grads);
        e.gather({&*it, 1});
        e.set_gradient(*it, g.data());
        e.release({&*it, 1});
      }
      e.discard_gradients();
    }
    // backward: reverse order, one tensor at a time
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
      TensorId id = *it;
      e.gather({&id, 1});
      auto g = grad_of(seed, comm.rank(), s, id, c.sizes[id], c.grads);
      e.set_gradient(id, g.data());
      e.release({&id, 1});
    }
    auto r = e.step();
    if (results) results->push_back(r);
  }
  std::vector<std::vector<float>> out;
  for (auto id : ids) {
    e.gather({&id, 1});
    std::vector<float> p(c.sizes[id]);
    e.read_param(id, p);
    out.push_back(std::move(p));
    e.release({&id, 1});
  }
  return out;
}

// The unsharded single-rank reference: per tensor, CpuAdam on the rank-ordered sum (rounded to the
// gradient dtype, as the collective does) divided by world (grad_divisor), then times
// grad_scale = 1 / loss_scale.
inline std::vector<std::vector<float>> reference_params(const EngineCase& c, int world,
                                                        std::uint64_t seed) {
  Config cfg = engine_config(c);
  const double scale = cfg.precision.loss_scaling() ? cfg.precision.loss_scale.initial : 1.0;
  CpuAdam adam(1);
  const AdamParams hp = AdamParams::from_config(cfg.optimizer);
  std::vector<std::vector<float>> master, m, v, out;
  for (std::size_t t = 0; t < c.sizes.size(); ++t) {
    master.push_back(initial_values(seed, t, c.sizes[t]));
    m.emplace_back(c.sizes[t], 0.0f);
    v.emplace_back(c.sizes[t], 0.0f);
    out.emplace_back(c.sizes[t], 0.0f);
  }
  const std::size_t pes = comm::elem_size(c.params);
  for (int s = 0; s < c.steps; ++s) {
    for (std::size_t t = 0; t < c.sizes.size(); ++t) {
      std::vector<std::vector<unsigned char>> per_rank;
      for (int r = 0; r < world; ++r)
        per_rank.push_back(grad_of(seed, r, s, t, c.sizes[t], c.grads));
      auto sum = reference_sum(per_rank, 0, c.sizes[t], c.grads);
      std::vector<unsigned char> copy(c.sizes[t] * pes);
      AdamTensors at{master[t].data(), m[t].data(), v[t].data(), sum.data(),
                     c.grads,          copy.data(), c.params,    c.sizes[t]};
      adam.step(hp, at,
                AdamStepOptions{s + 1, static_cast<float>(1.0 / scale), false,
                                static_cast<float>(world)});
      for (std::size_t i = 0; i < c.sizes[t]; ++i)
        out[t][i] = comm::load_elem(copy.data(), i, c.params);
    }
  }
  return out;
}

}  // namespace strata::testing
