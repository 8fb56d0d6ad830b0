// `strata checkpoint info|verify|export` on a checkpoint of `strata train` (issue 14.3, 14.5):
// info names world, stage, step, tensors and shards; verify exits 0 on an intact checkpoint and 1
// naming what is wrong (flipped bit, truncated or missing shard); a newer format or no checkpoint
// exits 2; export writes safetensors that a strict reader and torch (/usr/bin/python3) load.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "checkpoint/ckpt_test_util.hpp"
#include "checkpoint/format.hpp"
#include "checkpoint/safetensors_reader.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Exit code; stdout only into *out (stderr to *err when given).
int run(const std::string& args, std::string* out, std::string* err = nullptr) {
  TempDir tmp("strata-ckpt-cmd-err");
  const std::string errfile = tmp.str() + "/stderr";
  const int rc = run_command("{ " + strata_cli() + " " + args + " 2>" + errfile + "; }", out);
  if (err) *err = read_file(errfile);
  return rc;
}

// A checkpoint of `strata train`: 3 ranks, stage 3, 6 steps, hidden 24.
void train(const std::string& dir) {
  std::string out;
  ASSERT_EQ(
      run("train " + source_dir() +
              "/configs/default.yaml --set precision.params=fp32"
              " --set precision.grads=fp32 --set zero.stage=3 --set optimizer.lr=0.01"
              " --set runtime.cpu_threads=1 --steps 6 --ranks 3 --hidden 24 --checkpoint-dir " +
              dir,
          &out),
      0)
      << out;
}

const std::map<std::string, std::uint64_t> kTensors{
    {"w1", 24 * 16}, {"b1", 24}, {"w2", 4 * 24}, {"b2", 4}};

TEST(CheckpointCmd, InfoVerifyExport) {
  TempDir tmp("strata-ckpt-cmd");
  const std::string ckpt = tmp.str() + "/ckpt";
  train(ckpt);
  std::string out, err;
  ASSERT_EQ(run("checkpoint info " + ckpt + " --json", &out), 0) << out;
  const json info = json::parse(out);
  EXPECT_EQ(info["world"], 3);
  EXPECT_EQ(info["stage"], 3);
  EXPECT_EQ(info["steps"], 6);
  EXPECT_EQ(info["format_version"], 2);
  ASSERT_EQ(info["tensors"].size(), 4u);
  for (const auto& t : info["tensors"])
    EXPECT_EQ(t["numel"], kTensors.at(t["name"].get<std::string>()));
  ASSERT_EQ(info["shards"].size(), 3u);
  for (const auto& s : info["shards"])
    EXPECT_TRUE(s["present"].get<bool>() && s["size_matches"].get<bool>());
  ASSERT_EQ(run("checkpoint info " + ckpt, &out), 0);
  EXPECT_NE(out.find("saved by 3 rank(s) at ZeRO stage 3"), std::string::npos) << out;
  EXPECT_NE(out.find("shard-1-r2.bin"), std::string::npos) << out;
  ASSERT_EQ(run("checkpoint verify " + ckpt, &out), 0) << out;
  EXPECT_EQ(out.rfind("ok: ", 0), 0u) << out;
  ASSERT_EQ(run("checkpoint verify " + ckpt + " --json", &out), 0);
  EXPECT_TRUE(json::parse(out)["ok"].get<bool>());

  // Export in three dtypes; a strict reader accepts each.
  std::string files;
  for (const char* dt : {"fp32", "bf16", "fp16"}) {
    const std::string f = strcat(tmp.str(), "/model-", dt, ".safetensors");
    ASSERT_EQ(
        run(strcat("checkpoint export ", ckpt, " --out ", f, " --dtype ", dt, " --json"), &out), 0)
        << out;
    EXPECT_EQ(json::parse(out)["tensors"], 4);
    const SafeTensorsFile st = parse_safetensors(read_file(f));
    ASSERT_EQ(st.tensors.size(), 4u);
    for (const auto& [name, numel] : kTensors)
      EXPECT_EQ(st.tensors.at(name).shape, std::vector<std::uint64_t>{numel});
    files += " " + f;
  }
  EXPECT_EQ(run(strcat("checkpoint export ", ckpt, " --out ", tmp.str(), "/model-fp32.safetensors"),
                &out, &err),
            2);
  EXPECT_NE(err.find("--overwrite"), std::string::npos) << err;
  EXPECT_EQ(
      run(strcat("checkpoint export ", ckpt, " --out ", tmp.str(), "/x.safetensors --dtype fp8"),
          &out),
      2);
  // torch loads them (Debian's python3-torch 1.13: no safetensors module, frombuffer).
  std::string py;
  if (run_command("/usr/bin/python3 -c 'import torch' 2>&1", &py) == 0) {
    const std::string cmd = "/usr/bin/python3 " + source_dir() +
                            "/tests/checkpoint/torch_load_safetensors.py" + files + " '" +
                            json(kTensors).dump() + "'";
    EXPECT_EQ(run_command(cmd, &py), 0) << cmd << "\n" << py;
    EXPECT_NE(py.find("loaded 4 tensors from each file: ok"), std::string::npos) << py;
  } else {
    std::printf("torch not importable by /usr/bin/python3: torch check skipped\n");
  }
}

// A checkpoint in a directory another user can write (or owns) may be inspected (info, verify:
// reports only) but not exported (nor loaded: its contents could be swapped under the reader).
TEST(CheckpointCmd, InspectingADirectoryOthersCanWrite) {
  TempDir tmp("strata-ckpt-cmd");
  const std::string ckpt = tmp.str() + "/ckpt";
  train(ckpt);
  ASSERT_EQ(::chmod(ckpt.c_str(), 0777), 0);
  std::string out, err;
  ASSERT_EQ(run("checkpoint info " + ckpt + " --json", &out, &err), 0) << out << err;
  EXPECT_EQ(json::parse(out)["steps"], 6);
  EXPECT_EQ(run("checkpoint verify " + ckpt, &out, &err), 0) << out << err;
  EXPECT_EQ(run("checkpoint export " + ckpt + " --out " + tmp.str() + "/m.safetensors", &out, &err),
            2);
  EXPECT_NE(err.find("writable by every user"), std::string::npos) << err;
  if (can_switch_user()) {  // owned by nobody
    ASSERT_EQ(::chmod(ckpt.c_str(), 0700), 0);
    for (const auto& e : fs::recursive_directory_iterator(ckpt))
      ASSERT_EQ(::chown(e.path().c_str(), kNobodyUid, kNobodyGid), 0);
    ASSERT_EQ(::chown(ckpt.c_str(), kNobodyUid, kNobodyGid), 0);
    EXPECT_EQ(run("checkpoint info " + ckpt, &out, &err), 0) << out << err;
    EXPECT_EQ(run("checkpoint verify " + ckpt, &out, &err), 0) << out << err;
    EXPECT_EQ(
        run("checkpoint export " + ckpt + " --out " + tmp.str() + "/m.safetensors", &out, &err), 2);
    EXPECT_NE(err.find("owned by uid 65534"), std::string::npos) << err;
  }
  EXPECT_FALSE(fs::exists(tmp.str() + "/m.safetensors"));
}

TEST(CheckpointCmd, DamagedForeignAndMissingCheckpoints) {
  TempDir tmp("strata-ckpt-cmd");
  const std::string ckpt = tmp.str() + "/ckpt";
  train(ckpt);
  const auto shards = shard_files(ckpt);
  ASSERT_EQ(shards.size(), 3u);
  std::string out, err;
  // A flipped bit: verify exits 1 naming the shard and section; export fails (1).
  const std::string saved = read_file(shards[2]);
  const auto man = checkpoint::read_manifest(checkpoint::SafeDir::open(ckpt));
  const std::size_t at =
      checkpoint::shard_layout(man.partition_size, man.param_dtype, man.block_elems)
          .offset[checkpoint::kMaster] +
      9;  // in the master weights
  std::string bad = saved;
  bad[at] = static_cast<char>(bad[at] ^ 0x01);
  write_file(shards[2], bad);
  EXPECT_EQ(run("checkpoint verify " + ckpt, &out), 1) << out;
  EXPECT_NE(out.find("DAMAGED: checkpoint shard " + shards[2].string()), std::string::npos) << out;
  EXPECT_NE(out.find("CRC32C"), std::string::npos) << out;
  EXPECT_EQ(run("checkpoint export " + ckpt + " --out " + tmp.str() + "/m.safetensors", &out), 1);
  // Truncated; missing.
  write_file(shards[2], saved.substr(0, saved.size() - 7));
  EXPECT_EQ(run("checkpoint verify " + ckpt, &out), 1) << out;
  EXPECT_NE(out.find("truncated"), std::string::npos) << out;
  fs::remove(shards[2]);
  EXPECT_EQ(run("checkpoint verify " + ckpt + " --json", &out), 1) << out;
  EXPECT_NE(json::parse(out)["problems"][0].get<std::string>().find("missing"), std::string::npos)
      << out;
  EXPECT_EQ(run("checkpoint info " + ckpt, &out), 0);
  EXPECT_NE(out.find("MISSING"), std::string::npos) << out;
  write_file(shards[2], saved);
  EXPECT_EQ(run("checkpoint verify " + ckpt, &out), 0) << out;
  // A damaged manifest: exit 1; a newer format: exit 2 naming it; no checkpoint: exit 2.
  const std::string manifest = read_file(ckpt + "/manifest.json");
  write_file(ckpt + "/manifest.json", manifest.substr(0, manifest.size() / 2));
  EXPECT_EQ(run("checkpoint verify " + ckpt, &out, &err), 1);
  EXPECT_NE(err.find("truncated or damaged"), std::string::npos) << err;
  json newer = json::parse(manifest);
  newer["format_version"] = 7;
  write_file(ckpt + "/manifest.json", seal(newer));
  for (const char* sub : {"info", "verify"}) {
    EXPECT_EQ(run(strcat("checkpoint ", sub, " ", ckpt), &out, &err), 2) << sub;
    EXPECT_NE(err.find("format_version"), std::string::npos) << err;
    EXPECT_NE(err.find("upgrade strata"), std::string::npos) << err;
  }
  EXPECT_EQ(run("checkpoint info " + tmp.str(), &out, &err), 2);
  EXPECT_NE(err.find("no checkpoint in this directory"), std::string::npos) << err;
  EXPECT_EQ(run("checkpoint verify " + tmp.str() + "/nope", &out), 2);
  EXPECT_EQ(run("checkpoint", &out), 2);
  // Resuming from the newer format refuses before training.
  EXPECT_EQ(
      run("train " + source_dir() +
              "/configs/default.yaml --steps 8 --hidden 24 --checkpoint-dir " + ckpt + " --resume",
          &out, &err),
      2);
  EXPECT_EQ(out.find("step 7"), std::string::npos) << out;
}

}  // namespace
}  // namespace strata::testing
