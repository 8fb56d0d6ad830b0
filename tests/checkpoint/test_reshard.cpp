// Resharding loads (checkpoint/checkpoint.cpp): a checkpoint saved by N ranks at stage s loads into
// M ranks at stage s' (1 <= N, M <= 8, stages 0-3, every dtype): every element's parameters, FP32
// master and moments arrive bitwise, padding is zero, the scalars arrive, and each rank reads only
// the blocks that hold its elements (bytes counted).
#include <gtest/gtest.h>

#include <filesystem>

#include "../comm/comm_test_util.hpp"
#include "checkpoint/ckpt_test_util.hpp"
#include "checkpoint/fake_rank.hpp"
#include "checkpoint/format.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

// Uneven sizes: an empty tensor, one element, sizes around block and partition boundaries.
const std::vector<std::size_t> kSizes{5000, 17, 0, 12345, 1, 640, 3001};

struct ReshardCase {
  int n, s, m, s2;
  DType dtype;
  std::uint64_t block;
};

std::string case_name(const ::testing::TestParamInfo<ReshardCase>& i) {
  const auto& c = i.param;
  return strcat("N", c.n, "s", c.s, "_to_M", c.m, "s", c.s2, "_", dtype_name(c.dtype), "_block",
                c.block);
}

void PrintTo(const ReshardCase& c, std::ostream* os) {
  *os << c.n << " ranks stage " << c.s << " -> " << c.m << " ranks stage " << c.s2 << ", "
      << dtype_name(c.dtype) << ", block " << c.block;
}

class Reshard : public ::testing::TestWithParam<ReshardCase> {};

void save_fake(const std::string& dir, const std::vector<std::size_t>& sizes, int world, int stage,
               DType dtype, std::uint64_t seed, std::uint64_t block) {
  auto comms = make_inprocess_communicators(world, 30.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    FakeRank f = make_fake_rank(sizes, world, rank, stage, dtype, seed);
    checkpoint::SaveOptions o;
    o.block_elems = block;
    checkpoint::save_checkpoint(dir, f.state, comm, o);
  }));
}

TEST_P(Reshard, EveryElementArrivesBitwise) {
  const ReshardCase c = GetParam();
  TempDir dir("strata-reshard");
  const std::uint64_t seed = 77 + static_cast<std::uint64_t>(c.n * 10 + c.m);
  save_fake(dir.str(), kSizes, c.n, c.s, c.dtype, seed, c.block);
  const checkpoint::Manifest man = checkpoint::read_manifest(checkpoint::SafeDir::open(dir.str()));
  ASSERT_EQ(man.world, c.n);
  const std::uint64_t header =
      checkpoint::shard_layout(man.partition_size, c.dtype, man.block_elems).header_bytes;

  auto comms = make_inprocess_communicators(c.m, 30.0);
  std::vector<std::uint64_t> bytes(static_cast<std::size_t>(c.m)),
      elems(static_cast<std::size_t>(c.m));
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    FakeRank f = make_fake_rank(kSizes, c.m, rank, c.s2, c.dtype, 0);
    checkpoint::load_checkpoint(dir.str(), f.state, comm);
    EXPECT_EQ(check_fake_rank(f, kSizes, seed, case_name({c, 0})), 0u);
    FakeRank ref = make_fake_rank(kSizes, c.n, 0, c.s, c.dtype, seed);
    EXPECT_EQ(counters(f.state), counters(ref.state));
    bytes[static_cast<std::size_t>(rank)] = f.state.bytes_read;
    elems[static_cast<std::size_t>(rank)] = f.state.store->size();
  }));
  // Reads: both passes read the blocks holding the rank's elements (at most two partial blocks per
  // run of a tensor in a shard) and the headers of the shards it touches (rank 0: all headers).
  const std::uint64_t per_elem = dtype_size(c.dtype) + 12;
  const std::uint64_t runs = kSizes.size() + static_cast<std::uint64_t>(c.n);
  for (int r = 0; r < c.m; ++r) {
    // (+ the padding after a section, covered by its last block's checksum: < 4 KiB per section)
    const std::uint64_t bound =
        static_cast<std::uint64_t>(c.n) * (header + 2 * 4 * 4096) +
        2 * (elems[static_cast<std::size_t>(r)] + 2 * runs * man.block_elems) * per_elem;
    EXPECT_LE(bytes[static_cast<std::size_t>(r)], bound) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Checkpoint, Reshard,
    ::testing::Values(
        ReshardCase{4, 3, 3, 1, DType::kFp32, 64}, ReshardCase{1, 1, 8, 3, DType::kBf16, 1000},
        ReshardCase{8, 2, 1, 2, DType::kFp16, 64}, ReshardCase{2, 3, 5, 2, DType::kFp32, 333},
        ReshardCase{3, 1, 7, 3, DType::kFp16, 64}, ReshardCase{5, 2, 2, 1, DType::kBf16, 4096},
        ReshardCase{6, 3, 4, 3, DType::kFp32, 1}, ReshardCase{7, 1, 6, 2, DType::kFp32, 0},
        ReshardCase{2, 0, 3, 3, DType::kFp16, 64}, ReshardCase{3, 2, 2, 0, DType::kFp32, 64},
        ReshardCase{8, 3, 8, 1, DType::kBf16, 100}, ReshardCase{1, 0, 1, 3, DType::kFp32, 64}),
    case_name);

// With many ranks loading a one-rank checkpoint, each reads about its share, not the whole.
TEST(Checkpoint, EachRankReadsOnlyItsShare) {
  TempDir dir("strata-reshard");
  const std::vector<std::size_t> sizes{200000, 100000, 50001};
  save_fake(dir.str(), sizes, 1, 1, DType::kFp32, 5, 1024);
  std::uint64_t shard_bytes = 0;
  for (auto& e : std::filesystem::directory_iterator(dir.path()))
    if (e.path().filename().string().rfind("shard-", 0) == 0)
      shard_bytes += std::filesystem::file_size(e.path());
  const int m = 8;
  auto comms = make_inprocess_communicators(m, 30.0);
  std::vector<std::uint64_t> bytes(m);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    FakeRank f = make_fake_rank(sizes, m, rank, 3, DType::kFp32, 0);
    checkpoint::load_checkpoint(dir.str(), f.state, comm);
    EXPECT_EQ(check_fake_rank(f, sizes, 5, "1 -> 8"), 0u);
    bytes[static_cast<std::size_t>(rank)] = f.state.bytes_read;
  }));
  for (int r = 0; r < m; ++r) {
    // Two passes over 1/8 of the data, plus partial blocks and the header: well under 2/8 + 5%.
    EXPECT_LT(static_cast<double>(bytes[static_cast<std::size_t>(r)]),
              shard_bytes * (2.0 / m + 0.05))
        << "rank " << r;
    EXPECT_GT(static_cast<double>(bytes[static_cast<std::size_t>(r)]), shard_bytes * (1.0 / m))
        << "rank " << r;
  }
}

// A model of many small tensors (several to a checksummed block): the load reports what it read,
// each pass once over the shard: pass 1 reads the header and every block once (it read a block
// again for each tensor in it, 4-5x the checkpoint), pass 2 the blocks again into the store.
TEST(Checkpoint, LoadReportsEachPassOnceOverTheShard) {
  TempDir dir("strata-reshard");
  const std::vector<std::size_t> sizes(120, 1000);  // 120k elements, 1000 to a tensor
  save_fake(dir.str(), sizes, 1, 1, DType::kFp32, 11, 16384);
  const auto files = shard_files(dir.path());
  ASSERT_EQ(files.size(), 1u);
  const std::uint64_t shard = std::filesystem::file_size(files[0]);
  const checkpoint::Manifest man = checkpoint::read_manifest(checkpoint::SafeDir::open(dir.str()));
  const std::uint64_t header =
      checkpoint::shard_layout(man.partition_size, DType::kFp32, man.block_elems).header_bytes;
  auto comms = make_inprocess_communicators(1, 30.0);
  FakeRank f = make_fake_rank(sizes, 1, 0, 1, DType::kFp32, 0);
  checkpoint::load_checkpoint(dir.str(), f.state, *comms[0]);
  EXPECT_EQ(check_fake_rank(f, sizes, 11, "small tensors"), 0u);
  const auto& st = f.state;
  EXPECT_EQ(st.bytes_verified, shard) << "pass 1: the header and every block, once";
  EXPECT_EQ(st.bytes_restored, shard - header) << "pass 2: every block, once";
  EXPECT_EQ(st.bytes_read, st.bytes_verified + st.bytes_restored);
  EXPECT_LE(st.bytes_read, 2 * shard);
}

// A model with other tensors (names, sizes) or another parameter dtype is refused before anything
// changes, naming the field.
TEST(Checkpoint, OtherModelIsRefused) {
  TempDir dir("strata-reshard");
  save_fake(dir.str(), kSizes, 2, 2, DType::kFp16, 9, 64);
  auto try_load = [&](const std::vector<std::size_t>& sizes, DType dtype, const std::string& want) {
    auto comms = make_inprocess_communicators(2, 30.0);
    rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
      FakeRank f = make_fake_rank(sizes, 2, rank, 2, dtype, 3);
      try {
        checkpoint::load_checkpoint(dir.str(), f.state, comm);
        ADD_FAILURE() << "loaded into another model (" << want << ")";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      }
      EXPECT_FALSE(f.state.restore_started);
      EXPECT_EQ(check_fake_rank(f, sizes, 3, "after a refused load"), 0u);
    }));
  };
  std::vector<std::size_t> other = kSizes;
  other[3] += 1;
  try_load(other, DType::kFp16, "tensors[3]");
  other = kSizes;
  other.pop_back();
  try_load(other, DType::kFp16, "'tensors'");
  try_load(kSizes, DType::kBf16, "param_dtype");
}

}  // namespace
}  // namespace strata::testing
