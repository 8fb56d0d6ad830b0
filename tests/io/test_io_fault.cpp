// FaultInjectingIoEngine: every fault surfaces as its contract says, over both engines.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>

#include "strata/error.hpp"
#include "strata/io_fault.hpp"
#include "test_util.hpp"

namespace strata {
namespace {

using namespace std::chrono_literals;
using testing::TempDir;

constexpr std::uint64_t kLen = 256 << 10;

class FaultTest : public ::testing::TestWithParam<IoEngineKind> {
 protected:
  void SetUp() override {
    IoEngineOptions o;
    o.kind = GetParam();
    o.block_size = 64 << 10;
    o.queue_depth = 4;
    auto inner =
        GetParam() == IoEngineKind::kIoUring ? make_io_uring_engine(o) : make_thread_io_engine(o);
    engine_ = std::make_unique<FaultInjectingIoEngine>(std::move(inner));
    IoFileOptions fo;
    fo.create = true;
    file_ = std::make_shared<IoFile>(IoFile::open(dir_.str() + "/f", fo));
    id_ = engine_->register_file(file_);
    w_ = IoBuffer::allocate(kLen);
    r_ = IoBuffer::allocate(kLen);
    auto data = testing::random_bytes(kLen, testing::test_seed("fault"));
    std::memcpy(w_.data(), data.data(), kLen);
  }
  IoTicket write(std::uint64_t off = 0) {
    return engine_->submit({IoOp::kWrite, id_, w_.data(), kLen, off});
  }
  IoTicket read(std::uint64_t off = 0) {
    return engine_->submit({IoOp::kRead, id_, r_.data(), kLen, off});
  }

  TempDir dir_{"strata-io-fault"};
  std::unique_ptr<FaultInjectingIoEngine> engine_;
  std::shared_ptr<IoFile> file_;
  FileId id_ = 0;
  IoBuffer w_, r_;
};

std::string fault_kind_name(const ::testing::TestParamInfo<IoEngineKind>& info) {
  return info.param == IoEngineKind::kIoUring ? "io_uring" : "threads";
}

TEST_P(FaultTest, FailNthWithEioAndEnospc) {
  auto f1 = engine_->add_fault(IoFault::fail_nth(2, EIO));
  auto f2 = engine_->add_fault(IoFault::fail_nth(3, ENOSPC, IoOp::kWrite));
  EXPECT_TRUE(engine_->wait(write(0), 10s));  // request 1
  try {
    engine_->wait(write(kLen), 10s);  // request 2: EIO
    ADD_FAILURE() << "no EIO";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), EIO);
    EXPECT_EQ(e.offset(), kLen);
    EXPECT_EQ(e.length(), kLen);
    EXPECT_EQ(e.path(), file_->path());
    EXPECT_NE(std::string(e.what()).find("injected"), std::string::npos);
  }
  try {
    engine_->wait(write(2 * kLen), 10s);  // write 3: ENOSPC
    ADD_FAILURE() << "no ENOSPC";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), ENOSPC);
  }
  EXPECT_TRUE(engine_->wait(write(3 * kLen), 10s));  // faults used up
  EXPECT_EQ(engine_->fired(f1), 1u);
  EXPECT_EQ(engine_->fired(f2), 1u);
  // The failed writes wrote nothing: the file has a hole of zeros at kLen.
  EXPECT_TRUE(engine_->wait(read(kLen), 10s));
  std::vector<std::uint8_t> zeros(kLen, 0);
  EXPECT_EQ(0, std::memcmp(r_.data(), zeros.data(), kLen));
}

TEST_P(FaultTest, ShortResultFailsAfterPartialTransfer) {
  EXPECT_TRUE(engine_->wait(write(0), 10s));
  std::memset(r_.data(), 0xEE, kLen);
  engine_->add_fault(IoFault::short_nth(1, 100000, IoOp::kRead));
  try {
    engine_->wait(read(0), 10s);
    ADD_FAILURE() << "short read not reported";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), 0);
    EXPECT_NE(std::string(e.what()).find("short read"), std::string::npos) << e.what();
  }
  const std::uint64_t got = 100000 - 100000 % engine_->alignment(id_);
  EXPECT_EQ(0, std::memcmp(r_.data(), w_.data(), got));
  EXPECT_EQ(r_.bytes()[got], 0xEE);  // untouched past the short count
}

TEST_P(FaultTest, DelayedCompletion) {
  engine_->add_fault(IoFault::delay_nth(1, 300ms));
  auto start = std::chrono::steady_clock::now();
  IoTicket t = write(0);
  EXPECT_FALSE(engine_->wait(t, 20ms));
  EXPECT_FALSE(engine_->poll(t));
  EXPECT_TRUE(engine_->wait(t, 10s));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 300ms);
}

TEST_P(FaultTest, CorruptReadFlipsOneBit) {
  EXPECT_TRUE(engine_->wait(write(0), 10s));
  engine_->add_fault(IoFault::corrupt_nth_read(1, 12345));
  EXPECT_TRUE(engine_->wait(read(0), 10s));
  int diff_bits = 0;
  for (std::uint64_t i = 0; i < kLen; ++i)
    diff_bits += __builtin_popcount(r_.bytes()[i] ^ w_.bytes()[i]);
  EXPECT_EQ(diff_bits, 1);
  EXPECT_NE(r_.bytes()[12345 / 8], w_.bytes()[12345 / 8]);
  // Random bit: still exactly one.
  engine_->add_fault(IoFault::corrupt_nth_read(1));  // counts from when it was added
  EXPECT_TRUE(engine_->wait(read(0), 10s));
  diff_bits = 0;
  for (std::uint64_t i = 0; i < kLen; ++i)
    diff_bits += __builtin_popcount(r_.bytes()[i] ^ w_.bytes()[i]);
  EXPECT_EQ(diff_bits, 1);
}

TEST_P(FaultTest, BatchReportsFirstFailingRequestAndWaitAll) {
  engine_->add_fault(IoFault::fail_nth(3, EIO));
  engine_->add_fault(IoFault::fail_nth(2, ENOSPC));
  std::vector<IoRequest> batch;
  for (int i = 0; i < 4; ++i)
    batch.push_back({IoOp::kWrite, id_, w_.bytes(), kLen / 4, i * kLen / 4});
  engine_->submit_batch(batch);
  try {
    engine_->wait_all(10s);
    ADD_FAILURE() << "no failure";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errnum(), ENOSPC);  // request index 1 fails first in batch order
    EXPECT_EQ(e.offset(), kLen / 4);
  }
}

TEST_P(FaultTest, ValidationStillApplies) {
  engine_->add_fault(IoFault::fail_nth(1));
  EXPECT_THROW(engine_->submit({IoOp::kWrite, id_, w_.bytes() + 1, kLen, 0}), Error);
}

// What the wrapper does not change is the inner engine's (IoEngineWrapper forwards it).
TEST_P(FaultTest, ForwardsTheRestToTheInnerEngine) {
  IoEngine& inner = engine_->inner();
  EXPECT_EQ(engine_->kind(), GetParam());
  EXPECT_EQ(std::string(engine_->name()), std::string("fault(") + inner.name() + ")");
  EXPECT_EQ(&engine_->options(), &inner.options());
  EXPECT_EQ(engine_->describe_file(id_), dir_.str() + "/f");
  EXPECT_EQ(engine_->alignment(id_), inner.alignment(id_));
  ASSERT_TRUE(engine_->wait(write(), 10s));
  EXPECT_EQ(engine_->stats().bytes_written, kLen);
  EXPECT_EQ(inner.stats().bytes_written, kLen);
  engine_->shutdown();
  testing::expect_error(ErrorCode::kCancelled, "", [&] { write(); });
}

TEST(FaultEngine, RefusesANullInnerEngine) {
  testing::expect_error(ErrorCode::kInvalidArgument, "null inner engine",
                        [] { FaultInjectingIoEngine e(nullptr); });
}

INSTANTIATE_TEST_SUITE_P(Engines, FaultTest,
                         ::testing::Values(IoEngineKind::kIoUring, IoEngineKind::kThreads),
                         fault_kind_name);

}  // namespace
}  // namespace strata
