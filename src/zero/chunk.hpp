// The engine's chunk grid over a rank's optimizer range and what each registered buffer holds
// (see engine_impl.hpp, "Storage").
#pragma once

#include <cstdint>

#include "strata/config.hpp"
#include "strata/partition.hpp"
#include "tier/tier_store.hpp"

namespace strata::zero {

// What a registered buffer holds (for the usage report against the plan).
enum class BufferKind { kParams, kGrads, kOptimizer, kRuntime };

struct Chunk {
  Range r;  // elements of the rank's optimizer range ([0, opt_count))
  Tier opt_tier = Tier::kGpu, grad_tier = Tier::kGpu, param_tier = Tier::kGpu;
  BufferId opt = 0, grad = 0, param = 0;  // grad: stage >= 2; param: stage 3
  // The master weights are the parameters (plan's master_in_params, state not on nvme): elements
  // [opt_begin + r.begin, + r.count) of the flat parameters, buffer `params` from byte master_at;
  // `opt` holds exp_avg | exp_avg_sq. Otherwise `opt` holds master | exp_avg | exp_avg_sq.
  bool master_in_params = false;
  BufferId params = 0;
  std::uint64_t master_at = 0;
};

// Where array `a` of a chunk's state (0 master, 1 exp_avg, 2 exp_avg_sq; FP32, r.count elements)
// lies: its buffer and the byte offset in it.
struct StatePlace {
  BufferId id = 0;
  std::uint64_t offset = 0;
};
inline StatePlace state_place(const Chunk& c, int a) {
  const std::uint64_t bytes = 4 * std::uint64_t{c.r.count};
  if (!c.master_in_params) return {c.opt, static_cast<std::uint64_t>(a) * bytes};
  if (a == 0) return {c.params, c.master_at};
  return {c.opt, static_cast<std::uint64_t>(a - 1) * bytes};
}

// Bytes of each kind in each tier (padded as the store holds them), and the pool.
struct StorageReport {
  std::uint64_t bytes[3][4] = {};  // [Tier][BufferKind]
  std::uint64_t pool = 0;          // pinned pool (host)
  std::uint64_t used[3] = {};      // TierStore usage per tier (pool included in cpu)
  std::uint64_t budget[3] = {};
};

}  // namespace strata::zero
