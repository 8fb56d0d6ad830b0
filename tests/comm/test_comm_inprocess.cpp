// In-process communicator: every collective against the serial reference for world sizes 1-4,
// byte accounting, and the failure paths (dead rank, stalled rank, broken communicator).
#include <gtest/gtest.h>

#include "collective_checks.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

class InProcess : public ::testing::TestWithParam<int> {};

TEST_P(InProcess, CollectivesMatchSerialReference) {
  const int world = GetParam();
  const auto seed = test_seed("comm.inprocess");
  auto comms = make_inprocess_communicators(world, 20.0);
  rethrow_any(run_ranks(comms, [&](int, Communicator& c) { check_collectives(c, seed); }));
}

TEST_P(InProcess, BytesAccounting) {
  const int world = GetParam();
  auto comms = make_inprocess_communicators(world, 20.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& c) {
    std::vector<float> buf(1000, 1.0f), out(1000);
    c.all_reduce(buf.data(), out.data(), 1000, DType::kFp32);
    std::vector<std::size_t> counts(static_cast<std::size_t>(world), 10);
    counts[0] = 13;
    std::vector<std::uint16_t> h(200, 0x3c00), ho(200);
    c.reduce_scatter(h.data(), ho.data(), counts, DType::kFp16);
    c.all_gather(h.data(), ho.data(), counts, DType::kBf16);
    c.broadcast(buf.data(), 100, DType::kFp32, world - 1);
    auto s = c.stats();
    const std::uint64_t total = 13 + 10 * static_cast<std::uint64_t>(world - 1);
    const std::uint64_t mine = rank == 0 ? 13 : 10;
    // all-reduce: twice the equal-split reduce-scatter volume.
    std::uint64_t chunk = 1000 / world + (rank < 1000 % world ? 1 : 0);
    EXPECT_EQ(s.bytes_sent[0], 2 * (1000 - chunk) * 4);
    EXPECT_EQ(s.bytes_sent[1], (total - mine) * 2);
    EXPECT_EQ(s.bytes_sent[2], (total - mine) * 2);
    EXPECT_EQ(s.bytes_sent[3], rank == world - 1 ? 100u * 4 * (world - 1) : 0u);
    EXPECT_EQ(s.calls[0], 1u);
  }));
}

INSTANTIATE_TEST_SUITE_P(Worlds, InProcess, ::testing::Values(1, 2, 3, 4));

// A rank that dies (stops taking part) makes the others time out naming it.
TEST(InProcessFaults, DeadRankMakesPeersTimeOutNamingIt) {
  const double timeout = 0.3;
  auto comms = make_inprocess_communicators(4, timeout);
  comms[2] = make_faulty_communicator(std::move(comms[2]), {FaultSpec::Mode::kError, 2, 0});
  auto errors = run_ranks(comms, [&](int rank, Communicator& c) {
    std::vector<float> a(64, static_cast<float>(rank)), b(64);
    c.all_reduce(a.data(), b.data(), 64, DType::kFp32);  // #0 fine
    c.barrier();                                         // #1 fine
    c.all_reduce(a.data(), b.data(), 64, DType::kFp32);  // #2: rank 2 is gone
  });
  // (No elapsed-time check: a peer that waited for ever would hang the test, and one that timed
  // out says so in its message; how soon depends on the machine's load.)
  int timed_out = 0;
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(errors[static_cast<std::size_t>(r)]) << "rank " << r << " did not fail";
    try {
      std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
    } catch (const Error& e) {
      std::string msg = e.what();
      if (r == 2) {
        EXPECT_NE(msg.find("injected fault"), std::string::npos) << msg;
        continue;
      }
      // The first to time out names rank 2; the others report the broken group with that reason.
      EXPECT_TRUE(e.code() == ErrorCode::kTimeout || e.code() == ErrorCode::kComm) << msg;
      EXPECT_NE(msg.find("all_reduce"), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank(s) 2"), std::string::npos) << msg;
      EXPECT_NE(msg.find("timed out after"), std::string::npos) << msg;
      if (e.code() == ErrorCode::kTimeout) ++timed_out;
    }
  }
  EXPECT_GE(timed_out, 1) << "no peer timed out";
}

TEST(InProcessFaults, StalledRankMakesPeersTimeOutAndCommunicatorBreaks) {
  const double timeout = 0.2;
  auto comms = make_inprocess_communicators(3, timeout);
  comms[1] = make_faulty_communicator(std::move(comms[1]), {FaultSpec::Mode::kStall, 0, 0.6});
  auto errors = run_ranks(comms, [&](int rank, Communicator& c) {
    std::vector<std::uint16_t> a(10, 0x3c00), b(30);
    try {
      c.all_gather(a.data(), b.data(), 10, DType::kBf16);
      ADD_FAILURE() << "rank " << rank << ": all_gather succeeded without rank 1";
    } catch (const Error& e) {
      if (rank != 1) {
        EXPECT_NE(std::string(e.what()).find("all_gather"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("rank(s) 1"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("timed out after"), std::string::npos) << e.what();
      }
    }
    if (rank != 1) {  // the group is broken now: fail fast, no second wait (a wait would time
                      // out: Error(kTimeout), not the broken group's kComm)
      expect_error(ErrorCode::kComm, "communicator is broken", [&] { c.barrier(); });
    }
  });
  for (auto& e : errors) EXPECT_FALSE(e);
}

TEST(InProcessFaults, MismatchedCollectivesFail) {
  auto comms = make_inprocess_communicators(2, 5.0);
  auto errors = run_ranks(comms, [&](int rank, Communicator& c) {
    std::vector<float> a(8, 1.0f), b(16);
    if (rank == 0)
      c.all_reduce(a.data(), b.data(), 8, DType::kFp32);
    else
      c.all_gather(a.data(), b.data(), 8, DType::kFp32);
  });
  for (auto& e : errors) {
    ASSERT_TRUE(e);
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find("mismatched"), std::string::npos) << err.what();
    }
  }
}

TEST(InProcessFaults, BadArguments) {
  EXPECT_THROW(make_inprocess_communicators(0, 1.0), Error);
  EXPECT_THROW(make_inprocess_communicators(2, 0.0), Error);
  auto comms = make_inprocess_communicators(1, 1.0);
  std::vector<std::size_t> counts{1, 2};
  float x = 0;
  expect_error(ErrorCode::kInvalidArgument, "reduce_scatter: 2 counts for 1 ranks",
               [&] { comms[0]->reduce_scatter(&x, &x, counts, DType::kFp32); });
  expect_error(ErrorCode::kInvalidArgument, "all_gather: 2 counts for 1 ranks",
               [&] { comms[0]->all_gather(&x, &x, counts, DType::kFp32); });
  EXPECT_THROW(comms[0]->broadcast(&x, 1, DType::kFp32, 3), Error);
}

}  // namespace
}  // namespace strata::testing
