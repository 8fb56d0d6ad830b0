// MPI communicator: the same collective checks as the in-process test, one process per rank
// (CTest runs this binary under mpirun with 2 and 4 processes, and alone as a 1-rank world).
// Skipped in a build without MPI.
#include <gtest/gtest.h>

#include "collective_checks.hpp"
#include "strata/error.hpp"

namespace strata::testing {
namespace {

// One communicator for the whole process (MPI can be initialized once).
Communicator& world_comm() {
  static std::unique_ptr<Communicator> comm = make_mpi_communicator(60.0);
  return *comm;
}

TEST(Mpi, CollectivesMatchSerialReference) {
  if (!mpi_available()) GTEST_SKIP() << "built without MPI";
  // The seed must be the same on every rank: fixed, or $STRATA_TEST_SEED.
  const char* env = std::getenv("STRATA_TEST_SEED");
  const std::uint64_t seed = env ? std::strtoull(env, nullptr, 10) : 20261129u;
  check_collectives(world_comm(), seed);
}

TEST(Mpi, BytesAccounting) {
  if (!mpi_available()) GTEST_SKIP() << "built without MPI";
  Communicator& c = world_comm();
  auto before = c.stats();
  std::vector<float> a(64, 1.0f), b(64 * static_cast<std::size_t>(c.size()));
  c.all_gather(a.data(), b.data(), 64, DType::kFp32);
  auto after = c.stats();
  EXPECT_EQ(after.bytes_sent[2] - before.bytes_sent[2],
            64u * 4 * static_cast<unsigned>(c.size() - 1));
  for (std::size_t i = 0; i < b.size(); ++i) ASSERT_EQ(b[i], 1.0f);
}

}  // namespace
}  // namespace strata::testing
