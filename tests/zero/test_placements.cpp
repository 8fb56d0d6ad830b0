// Same numbers wherever the state lives: the Engine on the host-emulated device, for every
// placement of {optimizer, gradients, params} x {gpu, cpu, nvme} that a stage allows, stages 0-3,
// 1-4 in-process ranks, 22 steps of which two overflow (an inf, a NaN on the last rank: skipped
// everywhere), bitwise identical to the unsharded single-rank CpuAdam reference (the rank-ordered
// sum of the ranks' gradients, rounded to the gradient dtype as the collective does, grad_scale =
// 1 / (loss_scale * world), the dynamic loss scale backed off on each overflow). Plus: mixed
// fractions (part nvme, part gpu), 16-bit parameters and gradients with loss scaling, and several
// chunks per rank (a small pinned buffer) so the loop really streams. Every case is a named
// parameter (stage, placement, world, dtype).
#include <gtest/gtest.h>

#include "placement_util.hpp"

namespace strata::testing {
namespace {

class Placements : public ::testing::TestWithParam<Placement> {};

TEST_P(Placements, BitwiseIdenticalToTheUnshardedReference) {
  const Placement p = GetParam();
  TempDir dir("strata-placement");
  int want_skipped = 0;
  const auto want = reference(p, &want_skipped);
  ASSERT_EQ(want_skipped, 2);
  auto comms = make_inprocess_communicators(p.world, 30.0);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(p.world));
  std::vector<int> skipped(static_cast<std::size_t>(p.world), 0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    got[static_cast<std::size_t>(rank)] =
        train(comm, p, dir.str(), &skipped[static_cast<std::size_t>(rank)]);
  }));
  for (int r = 0; r < p.world; ++r) {
    EXPECT_EQ(skipped[static_cast<std::size_t>(r)], 2) << "rank " << r;
    const auto& g = got[static_cast<std::size_t>(r)];
    ASSERT_EQ(g.size(), want.size());
    for (std::size_t t = 0; t < g.size(); ++t)
      for (std::size_t i = 0; i < g[t].size(); ++i)
        ASSERT_EQ(std::bit_cast<std::uint32_t>(g[t][i]), std::bit_cast<std::uint32_t>(want[t][i]))
            << "rank " << r << " tensor " << t << " element " << i << ": " << g[t][i] << " vs "
            << want[t][i];
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, Placements, ::testing::ValuesIn(all_cases()), case_name);

}  // namespace
}  // namespace strata::testing
