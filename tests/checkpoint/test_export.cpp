// export_safetensors and verify_checkpoint (issue 14.3): a checkpoint of N ranks exports to one
// safetensors file that a strict reader of the format accepts, with the registered names, 1-D
// shapes and the FP32 master weights bitwise (or rounded to bf16/fp16); an existing output is kept
// unless overwrite; a damaged checkpoint exports nothing.
#include <gtest/gtest.h>

#include <filesystem>

#include "../comm/comm_test_util.hpp"
#include "checkpoint/ckpt_test_util.hpp"
#include "checkpoint/fake_rank.hpp"
#include "checkpoint/safetensors_reader.hpp"
#include "checkpoint/tools.hpp"
#include "comm/numeric.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

namespace fs = std::filesystem;
const std::vector<std::size_t> kExportSizes{70000, 17, 0, 12345, 1, 3000};
constexpr std::uint64_t kSeed = 23;

void save_export_fake(const std::string& dir, int world, int stage) {
  auto comms = make_inprocess_communicators(world, 30.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    FakeRank f = make_fake_rank(kExportSizes, world, rank, stage, DType::kFp16, kSeed);
    checkpoint::SaveOptions o;
    o.block_elems = 4096;
    checkpoint::save_checkpoint(dir, f.state, comm, o);
  }));
}

TEST(CheckpointExport, SafetensorsHoldTheMasterWeights) {
  TempDir dir("strata-export");
  const std::string ckpt = dir.str() + "/ckpt";
  save_export_fake(ckpt, 3, 3);
  const auto report = checkpoint::verify_checkpoint(ckpt);
  EXPECT_TRUE(report.problems.empty());
  EXPECT_EQ(report.manifest.world, 3);
  for (DType dt : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    const std::string out = strcat(dir.str(), "/model-", dtype_name(dt), ".safetensors");
    checkpoint::ExportOptions o;
    o.dtype = dt;
    const auto res = checkpoint::export_safetensors(ckpt, out, o);
    EXPECT_EQ(res.tensors, kExportSizes.size());
    EXPECT_EQ(res.bytes, fs::file_size(out));
    const SafeTensorsFile f = parse_safetensors(read_file(out));
    ASSERT_EQ(f.tensors.size(), kExportSizes.size());
    EXPECT_EQ(f.metadata.at("format"), "pt");
    EXPECT_EQ(f.metadata.at("saved_world"), "3");
    const std::size_t es = dtype_size(dt);
    for (std::size_t t = 0; t < kExportSizes.size(); ++t) {
      const std::string name = "layer" + std::to_string(t) + ".w";
      ASSERT_TRUE(f.tensors.count(name)) << name;
      const SafeTensor& st = f.tensors.at(name);
      EXPECT_EQ(st.dtype, dt == DType::kFp32 ? "F32" : dt == DType::kBf16 ? "BF16" : "F16");
      EXPECT_EQ(st.shape, std::vector<std::uint64_t>{kExportSizes[t]});
      std::string want(kExportSizes[t] * es, '\0');
      for (std::size_t e = 0; e < kExportSizes[t]; ++e)
        store_elem(want.data(), e, dt, std::bit_cast<float>(value_bits(kSeed, 1, t, e)));
      EXPECT_TRUE(st.bytes == want) << name << " " << dtype_name(dt);
    }
  }
  // An existing file is kept unless overwrite; nothing is left behind either way.
  const std::string out = dir.str() + "/model-fp32.safetensors";
  write_file(out, "mine");
  try {
    checkpoint::export_safetensors(ckpt, out, {});
    ADD_FAILURE() << "overwrote an existing file";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("--overwrite"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_file(out), "mine");
  checkpoint::ExportOptions ow;
  ow.overwrite = true;
  checkpoint::export_safetensors(ckpt, out, ow);
  EXPECT_EQ(parse_safetensors(read_file(out)).tensors.size(), kExportSizes.size());
  // A damaged checkpoint: the export fails naming the block and leaves no file.
  const auto shards = shard_files(ckpt);
  const auto man = checkpoint::read_manifest(checkpoint::SafeDir::open(ckpt));
  const std::size_t at =
      checkpoint::shard_layout(man.partition_size, man.param_dtype, man.block_elems)
          .offset[checkpoint::kMaster] +
      1000;  // in the master weights
  std::string s = read_file(shards[1]);
  s[at] = static_cast<char>(s[at] ^ 0x10);
  write_file(shards[1], s);
  const std::string bad = dir.str() + "/bad.safetensors";
  EXPECT_THROW(checkpoint::export_safetensors(ckpt, bad, {}), Error);
  EXPECT_FALSE(fs::exists(bad));
  std::size_t leftovers = 0;
  for (auto& e : fs::directory_iterator(dir.path()))
    leftovers += e.path().filename().string().find(".tmp-") != std::string::npos;
  EXPECT_EQ(leftovers, 0u);
  EXPECT_EQ(checkpoint::verify_checkpoint(ckpt).problems.size(), 1u);
}

}  // namespace
}  // namespace strata::testing
