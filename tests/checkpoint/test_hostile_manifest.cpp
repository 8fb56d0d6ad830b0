// Crafted manifests against every reader of a checkpoint directory (issue 25, points 1, 4, 6):
// `strata checkpoint info` (text and --json), `verify`, `export`, `train --resume`, and a plain
// `train --checkpoint-dir` saving into such a directory.
//  - depth bomb: an unsealed {"format": [[[...]]]} nested 100,000 deep (crashed every reader);
//  - size bomb: an unsealed {"format": [0,0,...]} of 5 million values (parsed whole, then
//    quoted whole in the error message: megabytes on stderr);
//  - control characters: a sealed manifest whose param_dtype (or a tensor name) holds terminal
//    escape sequences (printed raw).
// Every reader exits 2 (or 0 where the manifest is valid) within its limits, prints a message of
// bounded size naming the limit, and sends no control character to the terminal.
// And `checkpoint verify` runs in bounded memory whatever block size the manifest claims: under
// `prlimit --as=1GiB`, a manifest claiming 2^30-element blocks is refused (exit 2), and one with
// the largest block the format writes verifies (exit 0).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "checkpoint/ckpt_test_util.hpp"
#include "checkpoint/format.hpp"
#include "strata/error.hpp"
#include "strata/partition.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct CliRun {
  int rc = -1;
  std::string out, err;
};
CliRun run(const std::string& args, const std::string& prefix = "") {
  TempDir tmp("strata-hostile-err");
  CliRun r;
  r.rc = run_command("{ " + prefix + strata_cli() + " " + args + " 2>" + tmp.str() + "/stderr; }",
                     &r.out);
  r.err = read_file(tmp.str() + "/stderr");
  return r;
}

std::string train_args(const std::string& dir) {
  return "train " + source_dir() +
         "/configs/default.yaml --set precision.params=fp32 --set precision.grads=fp32"
         " --set zero.stage=1 --set runtime.cpu_threads=1 --steps 2 --ranks 1 --hidden 8 "
         "--checkpoint-dir " +
         dir;
}

void expect_safe_output(const CliRun& r, const std::string& what) {
  EXPECT_LT(r.rc, 128) << what << ": killed by a signal\n" << r.err.substr(0, 400);
  EXPECT_LT(r.err.size(), 16384u) << what << ": stderr of " << r.err.size()
                                  << " bytes: " << r.err.substr(0, 400);
  EXPECT_LT(r.out.size(), 65536u) << what;
  for (const std::string* s : {&r.out, &r.err})
    for (char c : *s)
      if (c != '\n' && static_cast<unsigned char>(c) < 0x20) {
        ADD_FAILURE() << what << ": control character " << static_cast<int>(c)
                      << " in output: " << s->substr(0, 400);
        return;
      }
}

// Every reader on `dir`, each expected to exit `rc` with `want` on stderr.
void every_reader(const std::string& dir, int rc, const std::string& want) {
  TempDir out("strata-hostile-out");
  const std::vector<std::pair<std::string, std::string>> readers{
      {"info", "checkpoint info " + dir},
      {"info --json", "checkpoint info " + dir + " --json"},
      {"verify", "checkpoint verify " + dir},
      {"verify --json", "checkpoint verify " + dir + " --json"},
      {"export", "checkpoint export " + dir + " --out " + out.str() + "/m.safetensors"},
      {"train --resume", train_args(dir) + " --resume"},
  };
  for (const auto& [name, args] : readers) {
    const CliRun r = run(args);
    expect_safe_output(r, name);
    EXPECT_EQ(r.rc, rc) << name << ": " << r.err.substr(0, 400);
    EXPECT_NE(r.err.find(want), std::string::npos) << name << ": " << r.err.substr(0, 400);
    EXPECT_NE(r.err.find("manifest.json"), std::string::npos)
        << name << ": " << r.err.substr(0, 400);
  }
  EXPECT_FALSE(fs::exists(out.path() / "m.safetensors"));
}

// A plain `train --checkpoint-dir` into a directory holding such a manifest (issue 48 point 9 E:
// it used to warn and replace it): the save is refused with exit code 2, naming the manifest and
// why (bounded, escaped), and the directory is left as it was — the manifest byte for byte, no
// file added.
void train_refuses_to_save_over(const std::string& dir) {
  const std::string before = read_file(dir + "/manifest.json");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  const CliRun r = run(train_args(dir));
  expect_safe_output(r, "train --checkpoint-dir");
  EXPECT_EQ(r.rc, 2) << r.err.substr(0, 400);
  EXPECT_NE(r.err.find(dir + "/manifest.json is not a checkpoint strata wrote"), std::string::npos)
      << r.err.substr(0, 400);
  EXPECT_NE(r.err.find("it is not replaced"), std::string::npos) << r.err.substr(0, 400);
  EXPECT_TRUE(read_file(dir + "/manifest.json") == before);
  std::vector<std::string> after;
  for (const auto& e : fs::directory_iterator(dir)) after.push_back(e.path().filename().string());
  std::sort(after.begin(), after.end());
  EXPECT_EQ(after, names);
}

TEST(HostileManifest, DepthBomb) {
  TempDir tmp("strata-hostile-depth");
  const int d = 100000;
  write_file(tmp.path() / "manifest.json",
             "{\"format\": " + std::string(d, '[') + std::string(d, ']') + "}");
  every_reader(tmp.str(), 2, "nested deeper than 16 levels");
  train_refuses_to_save_over(tmp.str());
}

TEST(HostileManifest, SizeBomb) {
  TempDir tmp("strata-hostile-size");
  std::string text = "{\"format\": [0";
  text.reserve(10'000'100);
  for (int i = 1; i < 5'000'000; ++i) text += ",0";
  text += "]}";
  write_file(tmp.path() / "manifest.json", text);
  every_reader(tmp.str(), 2, "more than 4194304 values");
  train_refuses_to_save_over(tmp.str());
}

// A checkpoint of `strata train` whose manifest is then edited and sealed again.
std::string trained(const TempDir& tmp) {
  const std::string dir = tmp.str() + "/ckpt";
  const CliRun r = run(train_args(dir));
  EXPECT_EQ(r.rc, 0) << r.err;
  return dir;
}

TEST(HostileManifest, ControlCharactersInAField) {
  TempDir tmp("strata-hostile-ctl");
  const std::string dir = trained(tmp);
  json j = json::parse(read_file(dir + "/manifest.json"));
  j["param_dtype"] =
      "fp32\x1b[2J\x1b]0;owned\x07\xc2\x9b"
      "31m";
  write_file(dir + "/manifest.json", seal(j));
  every_reader(dir, 2, "'fp32\\x1b[2J\\x1b]0;owned\\x07\\xc2\\x9b31m' is not fp16, bf16 or fp32");
  train_refuses_to_save_over(dir);
}

TEST(HostileManifest, ControlCharactersInATensorName) {
  TempDir tmp("strata-hostile-name");
  const std::string dir = trained(tmp);
  json j = json::parse(read_file(dir + "/manifest.json"));
  const std::string name = j["tensors"][0]["name"].get<std::string>();
  j["tensors"][0]["name"] = name + "\x1b[31m\r";
  write_file(dir + "/manifest.json", seal(j));
  CliRun r = run("checkpoint info " + dir);
  expect_safe_output(r, "info");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("  " + name + "\\x1b[31m\\x0d  "), std::string::npos) << r.out;
  r = run("checkpoint info " + dir + " --json");
  expect_safe_output(r, "info --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["tensors"][0]["name"], name + "\x1b[31m\r");  // JSON keeps the bytes
  r = run(train_args(dir) + " --resume");
  expect_safe_output(r, "train --resume");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("saved '" + name + "\\x1b[31m\\x0d'"), std::string::npos) << r.err;
}

// A manifest strata wrote, then damaged (one byte changed: it fails its own checksum): a save into
// its directory is refused the same way (exit 2, the manifest named with its CRCs), not replaced.
TEST(HostileManifest, DamagedManifestIsNotReplaced) {
  TempDir tmp("strata-hostile-crc");
  const std::string dir = trained(tmp);
  std::string text = read_file(dir + "/manifest.json");
  const std::size_t at = text.find("\"serial\"");
  ASSERT_NE(at, std::string::npos);
  text[at + 1] = 'S';
  write_file(dir + "/manifest.json", text);
  train_refuses_to_save_over(dir);
  EXPECT_NE(run(train_args(dir)).err.find("manifest_crc32c"), std::string::npos);
}

// A world-1 fp32 checkpoint of one tensor of `count` elements in blocks of `block` elements,
// written by hand: the manifest (sealed) and a sparse shard (zeros) with a valid header whose
// block CRCs are those of zero blocks.
void zero_checkpoint(const std::string& dir, std::uint64_t count, std::uint64_t block) {
  checkpoint::Manifest m;
  m.strata_version = "test";
  m.serial = 1;
  m.world = 1;
  m.stage = 1;
  m.param_dtype = DType::kFp32;
  const Partition p({{"w", count}}, 1, 1);
  m.flat_size = m.partition_size = p.partition_size();
  m.block_elems = block;
  m.tensors.push_back({"w", count, 0});
  const checkpoint::ShardLayout l =
      checkpoint::shard_layout(m.partition_size, m.param_dtype, block);
  m.shards.push_back({0, checkpoint::shard_file_name(1, 0), l.total, 0, m.partition_size, 0});
  // CRC32C of a block of zeros (every block here is whole: no padding).
  ASSERT_EQ(m.partition_size % block, 0u);
  ASSERT_EQ(m.partition_size * 4 % 4096, 0u);
  std::vector<unsigned char> zeros(1 << 20, 0);
  std::uint32_t crc = 0;
  for (std::uint64_t done = 0; done < block * 4; done += zeros.size())
    crc = crc32c(zeros.data(), std::min<std::uint64_t>(zeros.size(), block * 4 - done), crc);
  std::vector<std::uint32_t> crcs[checkpoint::kSections];
  for (auto& c : crcs) c.assign(l.nblocks, crc);
  const std::vector<unsigned char> h = checkpoint::encode_shard_header(m, 0, l, crcs);
  m.shards[0].header_crc32c = crc32c(h.data(), h.size());
  const int fd = ::open((dir + "/" + m.shards[0].file).c_str(), O_CREAT | O_WRONLY | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(l.total)), 0);
  ASSERT_EQ(::pwrite(fd, h.data(), h.size(), 0), static_cast<ssize_t>(h.size()));
  ::close(fd);
  write_file(dir + "/manifest.json", checkpoint::serialize_manifest(m));
}

const std::string kLimit = "prlimit --as=1073741824 ";

TEST(HostileManifest, VerifyOfA2To30ElementBlockIsRefusedInBoundedMemory) {
  TempDir tmp("strata-hostile-block");
  zero_checkpoint(tmp.str(), 1ull << 30, 1ull << 30);  // a 16 GiB sparse shard
  for (const char* cmd : {"verify", "info"}) {
    const CliRun r = run(std::string("checkpoint ") + cmd + " " + tmp.str(), kLimit);
    expect_safe_output(r, cmd);
    EXPECT_EQ(r.rc, 2) << cmd << ": " << r.out << r.err;
    EXPECT_NE(r.err.find("field 'block_elems': 1073741824 is out of range [1, 4194304]"),
              std::string::npos)
        << r.err;
  }
}

TEST(HostileManifest, VerifyOfTheLargestBlockRunsInBoundedMemory) {
  TempDir tmp("strata-hostile-maxblock");
  zero_checkpoint(tmp.str(), 1ull << 26,
                  checkpoint::kMaxBlockElems);  // 16 blocks of 16 MiB per section
  const CliRun r = run("checkpoint verify " + tmp.str() + " --json", kLimit);
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  const json v = json::parse(r.out);
  EXPECT_TRUE(v["ok"].get<bool>());
  EXPECT_EQ(v["blocks_checked"], 4 * 16);
}

}  // namespace
}  // namespace strata::testing
