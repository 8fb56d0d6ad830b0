// The model record of a checkpoint (issue 24.5; checkpoint/format.hpp,
// strata/checkpoint_model.hpp): each tensor's model shape and aliases and the extra (untrained)
// tensors survive the manifest's round trip; a manifest without them (written before them) parses
// as before; a description that cannot be exported (a shape of another element count, a name twice,
// "__metadata__", an unknown dtype, data of the wrong size) is refused at the save; a sealed
// manifest whose record is inconsistent is refused naming the field.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>

#include "checkpoint/ckpt_test_util.hpp"
#include "checkpoint/format.hpp"
#include "core/crc32c.hpp"
#include "strata/error.hpp"
#include "strata/partition.hpp"

namespace strata::testing {
namespace {

using namespace strata::checkpoint;

// A one-rank manifest of tensors a (6 elements) and b (4), as a save lays it out.
Manifest base_manifest() {
  const Partition p({{"a", 6}, {"b", 4}}, 1, 1);
  Manifest m;
  m.strata_version = "test";
  m.serial = 1;
  m.flat_size = p.flat_size();
  m.partition_size = p.partition_size();
  for (std::size_t i = 0; i < p.num_tensors(); ++i)
    m.tensors.push_back({p.tensor(i).name, p.tensor(i).numel, p.offset(i)});
  const ShardLayout l = shard_layout(m.partition_size, m.param_dtype, m.block_elems);
  m.shards.push_back({0, shard_file_name(1, 0), l.total, 0, m.partition_size, 0});
  m.path = "test/manifest.json";
  return m;
}

const std::vector<unsigned char> kBuffer(16, 7);  // 2 x I64

CheckpointModel good_model() {
  CheckpointModel model;
  model.shapes = {{2, 3}, {4}};
  model.aliases = {{}, {"c"}};
  model.extra.push_back({"buf", "I64", {2}, {kBuffer.data(), kBuffer.size()}});
  model.extra.push_back({"flag", "BOOL", {}, {kBuffer.data(), 1}});
  return model;
}

TEST(CheckpointModelRecord, RoundTripsAndOldManifestsParse) {
  Manifest old = base_manifest();
  const Manifest o = parse_manifest(serialize_manifest(old), "old.json");
  EXPECT_FALSE(o.tensors[0].has_shape);
  EXPECT_TRUE(o.tensors[1].aliases.empty());
  EXPECT_TRUE(o.extra_file.empty());
  EXPECT_TRUE(o.extra.empty());

  Manifest m = base_manifest();
  set_model(m, good_model(), true);
  const Manifest r = parse_manifest(serialize_manifest(m), "new.json");
  ASSERT_EQ(r.tensors.size(), 2u);
  EXPECT_TRUE(r.tensors[0].has_shape);
  EXPECT_EQ(r.tensors[0].shape, (std::vector<std::uint64_t>{2, 3}));
  EXPECT_EQ(r.tensors[1].shape, (std::vector<std::uint64_t>{4}));
  EXPECT_EQ(r.tensors[1].aliases, (std::vector<std::string>{"c"}));
  EXPECT_EQ(r.extra_file, "extra-1.bin");
  EXPECT_EQ(r.extra_bytes, 17u);
  ASSERT_EQ(r.extra.size(), 2u);
  EXPECT_EQ(r.extra[0].name, "buf");
  EXPECT_EQ(r.extra[0].dtype, "I64");
  EXPECT_EQ(r.extra[0].offset, 0u);
  EXPECT_EQ(r.extra[0].bytes, 16u);
  EXPECT_EQ(r.extra[0].crc32c, crc32c(kBuffer.data(), 16));
  EXPECT_EQ(r.extra[1].shape, std::vector<std::uint64_t>{});  // a scalar
  EXPECT_EQ(r.extra[1].offset, 16u);
  EXPECT_EQ(r.extra[1].crc32c, crc32c(kBuffer.data(), 1));
  std::uint64_t serial = 0;
  EXPECT_TRUE(checkpoint_file_serial("extra-12.bin", &serial));
  EXPECT_EQ(serial, 12u);
  EXPECT_TRUE(checkpoint_file_serial("shard-3-r1.bin", &serial));
  EXPECT_EQ(serial, 3u);
  EXPECT_FALSE(checkpoint_file_serial("extra-012.bin", &serial));
  EXPECT_FALSE(checkpoint_file_serial("extra-1.bin.tmp", &serial));
}

void expect_refused_at_save(const std::function<void(CheckpointModel&)>& edit,
                            const std::string& words) {
  CheckpointModel model = good_model();
  edit(model);
  Manifest m = base_manifest();
  try {
    set_model(m, model, true);
    ADD_FAILURE() << "accepted; expected: " << words;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST(CheckpointModelRecord, SaveRefusesWhatCannotBeExported) {
  expect_refused_at_save([](CheckpointModel& m) { m.shapes[0] = {5}; },
                         "shape of 5 elements, the tensor has 6");
  expect_refused_at_save([](CheckpointModel& m) { m.shapes.pop_back(); }, "1 shapes");
  expect_refused_at_save([](CheckpointModel& m) { m.aliases[1] = {"a"}; }, "'a' appears twice");
  expect_refused_at_save([](CheckpointModel& m) { m.extra[0].name = "b"; }, "'b' appears twice");
  expect_refused_at_save([](CheckpointModel& m) { m.extra[0].name = "__metadata__"; },
                         "cannot be a safetensors tensor name");
  expect_refused_at_save([](CheckpointModel& m) { m.aliases[0] = {""}; },
                         "cannot be a safetensors tensor name");
  expect_refused_at_save([](CheckpointModel& m) { m.extra[0].dtype = "F8"; }, "dtype 'F8'");
  expect_refused_at_save([](CheckpointModel& m) { m.extra[0].data = m.extra[0].data.first(15); },
                         "15 bytes of data for 2 elements of I64");
  expect_refused_at_save(
      [](CheckpointModel& m) {
        m.extra[0].shape = {1ull << 40, 1ull << 40};
      },
      "more than");
}

void expect_refused_at_parse(const std::function<void(nlohmann::json&)>& edit,
                             const std::string& field) {
  Manifest m = base_manifest();
  set_model(m, good_model(), true);
  nlohmann::json j = manifest_fields(m);
  edit(j);
  try {
    parse_manifest(seal(j), "crafted.json");
    ADD_FAILURE() << "accepted; expected a complaint about " << field;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("field '" + field + "'"), std::string::npos) << e.what();
  }
}

TEST(CheckpointModelRecord, InconsistentRecordsAreRefused) {
  expect_refused_at_parse([](nlohmann::json& j) { j["tensors"][0]["shape"] = {5}; },
                          "tensors[0].shape");
  expect_refused_at_parse(
      [](nlohmann::json& j) {
        j["tensors"][0]["shape"] = {-2, -3};
      },
      "tensors[0].shape");
  expect_refused_at_parse([](nlohmann::json& j) { j["tensors"][1]["aliases"] = {7}; },
                          "tensors[1].aliases[0]");
  expect_refused_at_parse([](nlohmann::json& j) { j["extra"]["file"] = "extra-2.bin"; },
                          "extra.file");
  expect_refused_at_parse([](nlohmann::json& j) { j["extra"]["file"] = "../x"; }, "extra.file");
  expect_refused_at_parse([](nlohmann::json& j) { j["extra"]["bytes"] = 18; }, "extra.bytes");
  expect_refused_at_parse([](nlohmann::json& j) { j["extra"]["tensors"][0]["bytes"] = 8; },
                          "extra.tensors[0].bytes");
  expect_refused_at_parse([](nlohmann::json& j) { j["extra"]["tensors"][1]["offset"] = 0; },
                          "extra.tensors[1].offset");
  expect_refused_at_parse([](nlohmann::json& j) { j["extra"]["tensors"][0]["dtype"] = "X"; },
                          "extra.tensors[0].dtype");
  expect_refused_at_parse([](nlohmann::json& j) { j["extra"]["tensors"][0]["name"] = ""; },
                          "extra.tensors[0].name");
  expect_refused_at_parse(
      [](nlohmann::json& j) {
        j["extra"]["tensors"][0]["shape"] = {1ull << 40, 1ull << 40};
      },
      "extra.tensors[0].shape");
}

}  // namespace
}  // namespace strata::testing
