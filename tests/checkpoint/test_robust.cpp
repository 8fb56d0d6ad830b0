// Damaged, foreign and crafted checkpoints (issue 14.5, 15.2): a newer or unknown format, a
// missing shard, a truncated shard, flipped bits anywhere in the shards, and manifests edited and
// re-sealed field by field each fail on every rank with a strata error (code checked) naming the
// file and the field or section, with nothing changed — or load exactly what the files say.
#include <gtest/gtest.h>

#include <filesystem>
#include <mutex>
#include <random>

#include "../comm/comm_test_util.hpp"
#include "checkpoint/ckpt_test_util.hpp"
#include "checkpoint/fake_rank.hpp"
#include "checkpoint/format.hpp"
#include "checkpoint/tools.hpp"
#include "strata/build_info.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::vector<std::size_t> kRobustSizes{3000, 17, 0, 1234, 1, 640};
constexpr std::uint64_t kSaved = 41, kBefore = 7;  // seeds: the checkpoint's values, the ranks' own

void save_robust_fake(const std::string& dir, int world, int stage, std::uint64_t block = 256) {
  auto comms = make_inprocess_communicators(world, 30.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    FakeRank f = make_fake_rank(kRobustSizes, world, rank, stage, DType::kBf16, kSaved);
    checkpoint::SaveOptions o;
    o.block_elems = block;
    checkpoint::save_checkpoint(dir, f.state, comm, o);
  }));
}

struct LoadResult {
  bool loaded = false;       // every rank loaded
  std::vector<int> codes;    // per rank: -1 loaded, else the ErrorCode
  std::string message;       // rank 0's error
  std::string all_messages;  // every rank's
};

// Loads into `world` ranks at `stage`. Each rank checks its own state afterwards: the saved values
// if it loaded, its own untouched values if it failed (and that the failure came before pass 2).
LoadResult load_fake(const std::string& dir, int world, int stage) {
  LoadResult res;
  res.codes.assign(static_cast<std::size_t>(world), -2);
  auto comms = make_inprocess_communicators(world, 30.0);
  std::mutex mu;
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    FakeRank f = make_fake_rank(kRobustSizes, world, rank, stage, DType::kBf16, kBefore);
    int& code = res.codes[static_cast<std::size_t>(rank)];
    try {
      checkpoint::load_checkpoint(dir, f.state, comm);
      code = -1;
    } catch (const Error& e) {
      code = static_cast<int>(e.code());
      if (rank == 0) res.message = e.what();
      std::lock_guard<std::mutex> lock(mu);
      res.all_messages += strcat("rank ", rank, ": ", e.what(), "\n");
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << rank << ": not a strata error: " << e.what();
    }
    if (code == -1) {
      EXPECT_EQ(check_fake_rank(f, kRobustSizes, kSaved, "after a load"), 0u);
    } else {
      EXPECT_FALSE(f.state.restore_started)
          << "rank " << rank << " failed after it began restoring";
      EXPECT_EQ(check_fake_rank(f, kRobustSizes, kBefore, "after a failed load"), 0u);
      EXPECT_EQ(f.state.steps, kBefore % 1000 + 9) << "scalars changed by a failed load";
    }
  }));
  res.loaded = std::all_of(res.codes.begin(), res.codes.end(), [](int c) { return c == -1; });
  if (!res.loaded) {
    for (int c : res.codes) EXPECT_NE(c, -1) << "some ranks loaded, others failed";
  }
  return res;
}

void expect_refused(const LoadResult& r, ErrorCode code, const std::vector<std::string>& words,
                    const std::string& what) {
  ASSERT_FALSE(r.loaded) << what;
  for (int c : r.codes) EXPECT_EQ(c, static_cast<int>(code)) << what << ": " << r.message;
  for (const auto& w : words)
    EXPECT_NE(r.message.find(w), std::string::npos) << what << ": " << r.message;
}

// A checkpoint of 2 ranks at stage 2 in a fresh directory, and its manifest (path, text, JSON).
struct SavedManifest {
  TempDir dir{"strata-robust"};
  fs::path path = dir.path() / "manifest.json";
  std::string text;
  json parsed;
  SavedManifest() {
    save_robust_fake(dir.str(), 2, 2);
    text = read_file(path);
    parsed = json::parse(text);
  }
};

TEST(CheckpointRobust, NewerOrForeignFormatIsRefused) {
  const SavedManifest saved;
  const auto& [dir, mpath, good, j] = saved;
  EXPECT_EQ(j["format_version"], 2);
  EXPECT_FALSE(j["strata_version"].get<std::string>().empty());
  // A newer format, sealed as ours and not.
  json newer = j;
  newer["format_version"] = 3;
  newer["strata_version"] = "9.0.0";
  write_file(mpath, seal(newer));
  expect_refused(load_fake(dir.str(), 3, 1), ErrorCode::kInvalidArgument,
                 {"manifest.json", "format_version", "3", "9.0.0", "reads format 2"},
                 "newer, sealed");
  newer.erase("manifest_crc32c");
  write_file(mpath, newer.dump(1));
  expect_refused(load_fake(dir.str(), 3, 1), ErrorCode::kInvalidArgument,
                 {"manifest.json", "format version 3", "strata 9.0.0", "upgrade strata"},
                 "newer, other seal");
  // Not a strata checkpoint; the unsealed format 1 of earlier strata.
  json foreign = j;
  foreign["format"] = "deepspeed";
  write_file(mpath, seal(foreign));
  expect_refused(load_fake(dir.str(), 2, 2), ErrorCode::kInvalidArgument,
                 {"not", "strata-checkpoint"}, "foreign");
  write_file(mpath, R"({"format": "strata-checkpoint", "version": 1, "serial": 3, "world": 2})");
  expect_refused(load_fake(dir.str(), 2, 2), ErrorCode::kInvalidArgument,
                 {"format version 1", "older strata"}, "v1");
  write_file(mpath, "not json at all");
  expect_refused(load_fake(dir.str(), 2, 2), ErrorCode::kChecksum,
                 {"manifest.json", "truncated or damaged"}, "text");
  // The original loads.
  write_file(mpath, good);
  EXPECT_TRUE(load_fake(dir.str(), 2, 2).loaded);
}

TEST(CheckpointRobust, MissingOrTruncatedShardIsRefused) {
  TempDir dir("strata-robust");
  save_robust_fake(dir.str(), 3, 3);
  const auto shards = shard_files(dir.path());
  ASSERT_EQ(shards.size(), 3u);
  const std::string saved = read_file(shards[1]);
  // Missing: refused on every rank, also by ranks that do not need it (rank 0 checks every shard).
  fs::remove(shards[1]);
  expect_refused(load_fake(dir.str(), 2, 1), ErrorCode::kChecksum,
                 {shards[1].filename().string(), "missing", "incomplete"}, "missing shard");
  expect_refused(load_fake(dir.str(), 3, 3), ErrorCode::kChecksum, {"missing"},
                 "missing shard, same world");
  // Truncated by one byte, to half, to nothing; one byte too long.
  for (std::size_t n : {saved.size() - 1, saved.size() / 2, std::size_t{0}, saved.size() + 1}) {
    write_file(shards[1], n <= saved.size() ? saved.substr(0, n) : saved + "x");
    expect_refused(load_fake(dir.str(), 4, 2), ErrorCode::kChecksum,
                   {shards[1].filename().string(), "bytes, the manifest says"},
                   strcat("shard of ", n, " bytes"));
  }
  write_file(shards[1], saved);
  EXPECT_TRUE(load_fake(dir.str(), 4, 2).loaded);
  // A shard of another checkpoint under this name: its header does not match.
  TempDir other("strata-robust");
  save_robust_fake(other.str(), 3, 3, 128);
  const auto other_shards = shard_files(other.path());
  fs::copy_file(other_shards[1], shards[1], fs::copy_options::overwrite_existing);
  const auto r = load_fake(dir.str(), 2, 3);
  ASSERT_FALSE(r.loaded);
  for (int c : r.codes) EXPECT_EQ(c, static_cast<int>(ErrorCode::kChecksum)) << r.message;
}

// Flipped bits anywhere in the shards (header, data, padding: every byte is checksummed) fail the
// load on every rank (kChecksum, naming the shard and the header or section) with nothing changed,
// and `verify_checkpoint` reports each.
TEST(CheckpointRobust, FlippedBitsInShardsAreCaught) {
  TempDir dir("strata-robust");
  save_robust_fake(dir.str(), 2, 1, 200);
  const auto shards = shard_files(dir.path());
  ASSERT_EQ(shards.size(), 2u);
  std::mt19937_64 rng(test_seed("flipped bits in shards"));
  int caught = 0;
  const int trials = std::string(build::kSanitize).empty() ? 120 : 30;
  for (int trial = 0; trial < trials; ++trial) {
    const fs::path& p = shards[static_cast<std::size_t>(trial % 2)];
    std::string data = read_file(p);
    const std::size_t at = rng() % data.size();
    const int bit = static_cast<int>(rng() % 8);
    data[at] = static_cast<char>(data[at] ^ (1 << bit));
    write_file(p, data);
    const auto r = load_fake(dir.str(), 3, 3);
    const auto report = checkpoint::verify_checkpoint(dir.str());
    EXPECT_FALSE(report.problems.empty()) << "verify missed the flip at " << p << " byte " << at;
    EXPECT_FALSE(r.loaded) << "a flip at " << p << " byte " << at << " loaded";
    if (!r.loaded) {
      ++caught;
      for (int c : r.codes) EXPECT_EQ(c, static_cast<int>(ErrorCode::kChecksum)) << r.message;
      EXPECT_NE(r.all_messages.find(p.filename().string()), std::string::npos) << r.all_messages;
    }
    data[at] = static_cast<char>(data[at] ^ (1 << bit));
    write_file(p, data);
  }
  EXPECT_EQ(caught, trials);
  EXPECT_TRUE(checkpoint::verify_checkpoint(dir.str()).problems.empty());
}

// Every leaf of the manifest changed (a value of another type, out of range, off by one, removed)
// and the manifest re-sealed, as a crafted file would be: each variant fails cleanly
// (kInvalidArgument or kChecksum, naming the field or file) or loads exactly what it says.
TEST(CheckpointRobust, EveryManifestFieldIsValidated) {
  const SavedManifest saved;
  const auto& [dir, mpath, good, orig] = saved;
  std::vector<json::json_pointer> leaves;
  const json flat = orig.flatten();
  for (auto& [k, v] : flat.items())
    if (k != "/manifest_crc32c") leaves.emplace_back(k);
  const std::vector<std::function<json(const json&)>> mutations = {
      [](const json&) { return json(); },
      [](const json&) { return json("x"); },
      [](const json&) { return json(-1); },
      [](const json&) { return json(1e300); },
      [](const json&) { return json::array({1}); },
      [](const json& v) {
        return v.is_number_unsigned() ? json(v.get<std::uint64_t>() + 1) : json(true);
      },
      [](const json& v) {
        return v.is_number_unsigned() && v.get<std::uint64_t>() > 0
                   ? json(v.get<std::uint64_t>() - 1)
                   : json(0);
      },
      [](const json&) { return json(~0ull); },
  };
  int variants = 0, loaded = 0;
  const std::size_t every = std::string(build::kSanitize).empty() ? 1 : 3;  // (sanitizers: a third)
  for (std::size_t li = 0; li < leaves.size(); ++li) {
    const auto& leaf = leaves[li];
    for (std::size_t k = 0; k <= mutations.size(); ++k) {
      if ((li + k) % every != 0) continue;
      json j = orig;
      if (k == mutations.size()) {
        j[leaf.parent_pointer()].erase(leaf.back());
      } else {
        j[leaf] = mutations[k](orig[leaf]);
      }
      write_file(mpath, seal(j));
      const auto r = load_fake(dir.str(), 3, 1);
      ++variants;
      if (r.loaded) {
        ++loaded;
        continue;
      }
      const int code = r.codes[0];
      EXPECT_TRUE(code == static_cast<int>(ErrorCode::kInvalidArgument) ||
                  code == static_cast<int>(ErrorCode::kChecksum))
          << leaf.to_string() << ": " << r.message;
      EXPECT_NE(r.message.find("manifest"), std::string::npos) << r.message;
    }
  }
  write_file(mpath, good);
  EXPECT_TRUE(load_fake(dir.str(), 3, 1).loaded);
  // Only harmless edits load: the scalars (a loss scale, a step count) and free text.
  EXPECT_LT(loaded, variants / 4) << loaded << " of " << variants;
}

}  // namespace
}  // namespace strata::testing
