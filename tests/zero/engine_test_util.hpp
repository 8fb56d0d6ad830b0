// Shared by the engine tests (in-process and MPI): a small model of uneven, tiny and empty
// tensors, rank-distinguishable gradients that every rank can recompute, one rank's training
// loop through the Engine, and the single-rank unsharded reference (CpuAdam on the rank-ordered
// sum of the ranks' gradients).
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <functional>
#include <random>

#include "../comm/comm_test_util.hpp"
#include "engine_basics.hpp"
#include "strata/adam.hpp"
#include "strata/engine.hpp"
#include "test_util.hpp"

namespace strata::testing {

// A ZeRO stage and a world size: the parameter of the engine tests run over both.
struct StageWorld {
  int stage;
  int world;
};
inline std::string stage_world_name(const ::testing::TestParamInfo<StageWorld>& info) {
  return "stage" + std::to_string(info.param.stage) + "_world" + std::to_string(info.param.world);
}

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
  // Whether `rank` uses tensor t at step s (its gradient is handed in); not: skip_gradient(t).
  // Empty: every rank uses every tensor.
  std::function<bool(int rank, int step, std::size_t t)> uses;
  // The skips come after the backward's hand-ins (as the Python side finds them, at step()), not
  // where the tensor's gradient would have come: on several ranks the buckets then complete in
  // another order than on a rank that used the tensor. Not at stage 3, where the gathers between
  // the hand-ins are collectives too.
  bool skip_late = false;
  std::function<void(Config&)> configure;  // more settings (placements)
};

// Whether some rank of `world` uses tensor t at step s.
inline bool used_anywhere(const EngineCase& c, int world, int s, std::size_t t) {
  if (!c.uses) return true;
  for (int r = 0; r < world; ++r)
    if (c.uses(r, s, t)) return true;
  return false;
}

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
  if (c.configure) c.configure(cfg);
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
    std::vector<TensorId> late;
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
      TensorId id = *it;
      if (c.uses && !c.uses(comm.rank(), s, id) && c.skip_late) {
        late.push_back(id);
        continue;
      }
      if (c.uses && !c.uses(comm.rank(), s, id)) {
        // Stage 3's gathers are collective: a tensor some rank uses is gathered on every rank
        // (its module ran everywhere, its output unused here), one no rank uses on none.
        if (used_anywhere(c, comm.size(), s, id)) {
          e.gather({&id, 1});
          e.release({&id, 1});
        }
        e.skip_gradient(id);
        continue;
      }
      e.gather({&id, 1});
      auto g = grad_of(seed, comm.rank(), s, id, c.sizes[id], c.grads);
      e.set_gradient(id, g.data());
      e.release({&id, 1});
    }
    for (auto id : late) e.skip_gradient(id);
    auto r = e.step();
    if (results) results->push_back(r);
  }
  for (auto id : ids) {  // each tensor's own step count: the steps some rank used it in
    std::int64_t want = 0;
    for (int s = 0; s < c.steps; ++s) want += used_anywhere(c, comm.size(), s, id) ? 1 : 0;
    EXPECT_EQ(e.optimizer_step(id), want) << "tensor " << id;
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
  const std::size_t pes = dtype_size(c.params);
  std::vector<std::int64_t> count(c.sizes.size(), 0);  // per tensor, as torch's state["step"]
  for (int s = 0; s < c.steps; ++s) {
    for (std::size_t t = 0; t < c.sizes.size(); ++t) {
      if (!used_anywhere(c, world, s, t)) continue;  // torch: grad None, no update at all
      std::vector<std::vector<unsigned char>> per_rank;
      for (int r = 0; r < world; ++r) {
        per_rank.push_back(grad_of(seed, r, s, t, c.sizes[t], c.grads));
        if (c.uses && !c.uses(r, s, t))  // DDP: an unused rank's gradient is zeros
          std::fill(per_rank.back().begin(), per_rank.back().end(), 0);
      }
      auto sum = reference_sum(per_rank, 0, c.sizes[t], c.grads);
      std::vector<unsigned char> copy(c.sizes[t] * pes);
      AdamTensors at{master[t].data(), m[t].data(), v[t].data(), sum.data(),
                     c.grads,          copy.data(), c.params,    c.sizes[t]};
      adam.step(hp, at,
                AdamStepOptions{++count[t], static_cast<float>(1.0 / scale), false,
                                static_cast<float>(world)});
    }
  }
  for (std::size_t t = 0; t < c.sizes.size(); ++t) {  // the model dtype's rounding of the master
    std::vector<unsigned char> copy(c.sizes[t] * pes);
    for (std::size_t i = 0; i < c.sizes[t]; ++i) {
      store_elem(copy.data(), i, c.params, master[t][i]);
      out[t][i] = load_elem(copy.data(), i, c.params);
    }
  }
  return out;
}

}  // namespace strata::testing
