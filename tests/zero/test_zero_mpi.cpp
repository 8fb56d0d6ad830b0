// The engine over MPI, one process per rank (CTest runs this under mpirun with 2 and 4
// processes, and alone as a 1-rank world): stages 0-3 bitwise against the unsharded reference,
// and an agreed overflow skip. Skipped in a build without MPI.
#include <gtest/gtest.h>

#include "engine_test_util.hpp"
#include "strata/error.hpp"

namespace strata::testing {
namespace {

Communicator& world_comm() {
  static std::unique_ptr<Communicator> comm = make_mpi_communicator(60.0);
  return *comm;
}

std::uint64_t shared_seed() {
  const char* env = std::getenv("STRATA_TEST_SEED");
  return env ? std::strtoull(env, nullptr, 10) : 424242u;
}

TEST(ZeroMpi, StagesMatchReference) {
  if (!mpi_available()) GTEST_SKIP() << "built without MPI";
  Communicator& comm = world_comm();
  for (int stage = 0; stage <= 3; ++stage) {
    for (DType dt : {DType::kFp32, DType::kBf16}) {
      EngineCase c;
      c.stage = stage;
      c.params = dt;
      c.grads = dt;
      auto got = train_rank(comm, c, shared_seed());
      auto want = reference_params(c, comm.size(), shared_seed());
      expect_bitwise_equal(got, want, strcat("stage ", stage, " rank ", comm.rank()));
    }
  }
}

TEST(ZeroMpi, OverflowSkipAgreed) {
  if (!mpi_available()) GTEST_SKIP() << "built without MPI";
  Communicator& comm = world_comm();
  EngineCase c;
  c.stage = 2;
  c.grads = DType::kFp16;
  c.params = DType::kFp16;
  Engine e(engine_config(c), comm);
  std::vector<TensorId> ids;
  for (std::size_t t = 0; t < c.sizes.size(); ++t)
    ids.push_back(e.add_parameter("t", initial_values(9, t, c.sizes[t])));
  e.finalize();
  for (int s = 0; s < 2; ++s) {
    for (auto id : ids) {
      auto g = grad_of(9, comm.rank(), s, id, c.sizes[id], c.grads);
      // the last rank overflows at step 0
      if (s == 0 && comm.rank() == comm.size() - 1 && id == 3)
        store_elem(g.data(), 5, c.grads, NAN);
      e.set_gradient(id, g.data());
    }
    auto r = e.step();
    EXPECT_EQ(r.applied, s == 1) << "step " << s;
  }
  EXPECT_EQ(e.stats().skipped_steps, 1u);
  EXPECT_EQ(e.loss_scale(), 512.0);
}

}  // namespace
}  // namespace strata::testing
