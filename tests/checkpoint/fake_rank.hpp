// Ranks without an engine for checkpoint-format tests: a Partition, a resident optimizer state
// store and a parameter span, filled with values that are a pure function of (tensor, element,
// array, seed), so that any rank of any world size knows what every element must hold. Padding is
// zero, as in the engine.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/optimizer_state.hpp"
#include "strata/partition.hpp"

namespace strata::testing {

inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Bits of array `a` (0 params, 1 master, 2 exp_avg, 3 exp_avg_sq) for element e of tensor t.
inline std::uint32_t value_bits(std::uint64_t seed, int a, std::size_t t, std::size_t e) {
  const std::uint64_t h =
      mix(seed * 1000003ull + static_cast<std::uint64_t>(a) * 7919ull + t * 104729ull + mix(e));
  if (a == 0) return static_cast<std::uint32_t>(h);  // any bit pattern
  // Finite floats (the moments' second array non-negative).
  float f = static_cast<float>(static_cast<std::int64_t>(h >> 11) % 2000001 - 1000000) / 1024.0f;
  if (a == 3) f = f < 0 ? -f : f;
  return std::bit_cast<std::uint32_t>(f);
}

// An optimizer state in plain host vectors (the engine keeps its state in the TierStore; these
// engine-less ranks only need the checkpoint seam's host views).
class HostStateStore final : public checkpoint::OptimizerStateStore {
 public:
  explicit HostStateStore(std::size_t n) : m_(n, 0.0f), a_(n, 0.0f), v_(n, 0.0f) {}
  std::size_t size() const override { return m_.size(); }
  checkpoint::StateView acquire(Range r) override {
    return {m_.data() + r.begin, a_.data() + r.begin, v_.data() + r.begin, r.count};
  }
  void release(Range, bool) override {}

 private:
  std::vector<float> m_, a_, v_;
};

struct FakeRank {
  std::unique_ptr<Partition> part;
  std::unique_ptr<checkpoint::OptimizerStateStore> store;
  std::vector<unsigned char> params;
  checkpoint::RankState state;
};

// Rank `rank` of `world` at `stage`, holding the values of `seed` (seed 0: zeros everywhere).
inline FakeRank make_fake_rank(const std::vector<std::size_t>& sizes, int world, int rank,
                               int stage, DType dtype, std::uint64_t seed) {
  FakeRank f;
  std::vector<TensorSpec> specs;
  for (std::size_t t = 0; t < sizes.size(); ++t)
    specs.push_back({"layer" + std::to_string(t) + ".w", sizes[t]});
  f.part = std::make_unique<Partition>(specs, world, 1000);
  const std::size_t begin = stage == 0 ? 0 : f.part->partition_begin(rank);
  const std::size_t count = stage == 0 ? f.part->flat_size() : f.part->partition_size();
  f.store = std::make_unique<HostStateStore>(count);
  const std::size_t pes = dtype_size(dtype);
  f.params.assign(count * pes, 0);
  if (seed != 0) {
    checkpoint::StateView v = f.store->acquire({0, count});
    float* arrays[3] = {v.master, v.exp_avg, v.exp_avg_sq};
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      const std::size_t off = f.part->offset(t);
      for (std::size_t e = 0; e < sizes[t]; ++e) {
        if (off + e < begin || off + e >= begin + count) continue;
        const std::size_t x = off + e - begin;
        const std::uint32_t pb = value_bits(seed, 0, t, e);
        std::memcpy(f.params.data() + x * pes, &pb, pes);
        for (int a = 0; a < 3; ++a)
          arrays[a][x] = std::bit_cast<float>(value_bits(seed, a + 1, t, e));
      }
    }
    f.store->release({0, count}, true);
  }
  checkpoint::RankState& s = f.state;
  s.rank = rank;
  s.world = world;
  s.stage = stage;
  s.param_dtype = dtype;
  s.flat_size = f.part->flat_size();
  s.partition_size = f.part->partition_size();
  s.partition = f.part.get();
  s.opt_begin = begin;
  s.params = {f.params.data(), f.params.size()};
  s.store = f.store.get();
  if (seed != 0) {
    s.adam_step = static_cast<std::int64_t>(seed % 1000) + 3;
    s.loss_scale = 1024.0 * static_cast<double>(seed % 7 + 1) / 3.0;
    s.good_steps = static_cast<std::uint32_t>(seed % 13);
    s.steps = seed % 1000 + 9;
    s.applied_steps = seed % 1000 + 5;
    s.skipped_steps = 4;
    s.config_yaml = "zero:\n  stage: " + std::to_string(stage) + "\n";
  }
  return f;
}

// The training counters a checkpoint carries beside the tensors, as one comparable tuple.
inline auto counters(const checkpoint::RankState& s) {
  return std::tie(s.adam_step, s.loss_scale, s.good_steps, s.steps, s.applied_steps,
                  s.skipped_steps);
}

// Checks that the rank holds the values of `seed` (bitwise) and zero padding; returns the number of
// mismatches (reporting the first few).
inline std::size_t check_fake_rank(FakeRank& f, const std::vector<std::size_t>& sizes,
                                   std::uint64_t seed, const std::string& what) {
  const checkpoint::RankState& s = f.state;
  const std::size_t count = s.store->size(), pes = dtype_size(s.param_dtype);
  std::vector<std::uint32_t> want[4];
  for (auto& w : want) w.assign(count, 0);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const std::size_t off = f.part->offset(t);
    for (std::size_t e = 0; e < sizes[t]; ++e) {
      if (off + e < s.opt_begin || off + e >= s.opt_begin + count) continue;
      for (int a = 0; a < 4; ++a) want[a][off + e - s.opt_begin] = value_bits(seed, a, t, e);
    }
  }
  std::size_t bad = 0;
  checkpoint::StateView v = f.store->acquire({0, count});
  const float* arrays[3] = {v.master, v.exp_avg, v.exp_avg_sq};
  for (std::size_t x = 0; x < count; ++x) {
    std::uint32_t got[4] = {0, 0, 0, 0};
    std::memcpy(&got[0], f.params.data() + x * pes, pes);
    std::uint32_t w0 = 0;
    std::memcpy(&w0, &want[0][x], pes);
    for (int a = 1; a < 4; ++a) got[a] = std::bit_cast<std::uint32_t>(arrays[a - 1][x]);
    for (int a = 0; a < 4; ++a) {
      const std::uint32_t w = a == 0 ? w0 : want[a][x];
      if (got[a] != w && bad++ < 5)
        ADD_FAILURE() << what << ": rank " << s.rank << " element " << s.opt_begin + x << " array "
                      << a << ": got " << got[a] << ", want " << w;
    }
  }
  f.store->release({0, count}, false);
  return bad;
}

}  // namespace strata::testing
