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
};

// Bytes of each kind in each tier (padded as the store holds them), and the pool.
struct StorageReport {
  std::uint64_t bytes[3][4] = {};  // [Tier][BufferKind]
  std::uint64_t pool = 0;          // pinned pool (host)
  std::uint64_t used[3] = {};      // TierStore usage per tier (pool included in cpu)
  std::uint64_t budget[3] = {};
};

}  // namespace strata::zero
