// `strata profile` end to end through the CLI binary (${STRATA_BINARY_DIR}/strata) with the hidden
// --tiny mode: valid JSON with every section, a tuned config that loads, GPU sections skipped
// without a GPU, the temporary NVMe directory removed, and bad paths rejected with exit code 2.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/page_lock.hpp"
#include "strata/config.hpp"
#include "strata/device_query.hpp"
#include "strata/io_file.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using strata::testing::TempDir;

namespace {

struct CliRun {
  int rc = -1;
  std::string out, err;
};

// 20M parameters on 2 ranks, stage 2, optimizer state on NVMe in `nvme` (or on cpu without).
std::string config_text(const std::string& nvme, const std::string& extra = "") {
  std::string s =
      "model: {parameters: 20M}\nworld: {ranks: 2, ranks_per_node: 2}\n"
      "zero: {stage: 2, sub_group_size: 1M}\n";
  if (nvme.empty()) {
    s += "offload: {optimizer: {tier: cpu}}\n";
  } else {
    s += "offload: {optimizer: {tier: nvme}}\n";
    s +=
        "tiers: {nvme: {paths: [" + nvme + "], block_size: 256KiB, queue_depth: 8" + extra + "}}\n";
  }
  return s;
}

void expect_valid_report(const json& j, bool has_gpu) {
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["mode"], "tiny");
  EXPECT_FALSE(j["environment"]["kernel"].get<std::string>().empty());
  EXPECT_GT(j["environment"]["cores"].get<int>(), 0);
  EXPECT_GT(j["environment"]["memory_bytes"].get<std::uint64_t>(), 0u);
  ASSERT_FALSE(j["environment"]["paths"].empty());
  EXPECT_FALSE(j["environment"]["paths"][0]["filesystem"].get<std::string>().empty());
  // NVMe sweep: every point moved bytes; reads and writes both there.
  const auto& pts = j["nvme"]["points"];
  ASSERT_GE(pts.size(), 4u);
  int reads = 0, writes = 0;
  for (const auto& p : pts) {
    EXPECT_GT(p["bytes"].get<std::uint64_t>(), 0u);
    EXPECT_GT(p["bytes_per_second"].get<double>(), 0.0);
    (p["op"] == "read" ? reads : writes)++;
  }
  EXPECT_EQ(reads, writes);
  if (has_gpu) {
    EXPECT_TRUE(j["host_device_copies"]["skipped"].is_null());
    EXPECT_FALSE(j["host_device_copies"]["points"].empty());
  } else {
    EXPECT_NE(j["host_device_copies"]["skipped"].get<std::string>().find("skipped: no GPU"),
              std::string::npos);
    EXPECT_TRUE(j["host_device_copies"]["points"].empty());
    EXPECT_FALSE(j["gpu_adam"]["measured"].get<bool>());
    EXPECT_NE(j["gpu_adam"]["skipped"].get<std::string>().find("no GPU"), std::string::npos);
  }
  EXPECT_TRUE(j["cpu_adam"]["measured"].get<bool>());
  EXPECT_GT(j["cpu_adam"]["params_per_second"].get<double>(), 0.0);
  EXPECT_GT(j["memory_bandwidth"]["bytes_per_second"].get<double>(), 0.0);
  // Two ranks in one process: the network is never measured between threads; without
  // world.network_bandwidth the leg is not counted, and the report says so.
  EXPECT_TRUE(j["collectives"]["points"].empty());
  EXPECT_NE(j["collectives"]["skipped"].get<std::string>().find("not launched across processes"),
            std::string::npos);
  EXPECT_TRUE(j["model"]["bandwidths"]["network_source"].is_null());
  // The two ranks of the node share its disk: concurrent streams were measured.
  EXPECT_EQ(j["node_sharing"]["ranks_per_node"], 2);
  EXPECT_EQ(j["node_sharing"]["nvme_streams"], 2);
  EXPECT_GT(j["node_sharing"]["nvme_aggregate_read_bytes_per_second"].get<double>(), 0.0);
  EXPECT_LE(j["node_sharing"]["nvme_read_factor"].get<double>(), 1.0);
  EXPECT_FALSE(j["engine_check"]["ran"].get<bool>());
  // The pinned pool really used, against the configured one, and why.
  EXPECT_FALSE(j["sample_step"]["pinned_pool"]["reason"].get<std::string>().empty());
  const auto& s = j["sample_step"];
  EXPECT_TRUE(s["ran"].get<bool>());
  EXPECT_GT(s["serial"]["measured_median_s"].get<double>(), 0.0);
  EXPECT_GT(s["serial"]["predicted_s"].get<double>(), 0.0);
  EXPECT_GT(s["pipelined"]["measured_median_s"].get<double>(), 0.0);
  EXPECT_GT(s["tier_read_bytes_per_second"].get<double>(), 0.0);
  const auto& m = j["model"]["configured"];
  EXPECT_GT(m["optimizer_step_serial_s"].get<double>(), 0.0);
  // (Pipelined is not always faster: a measured mixed read/write rate can be below both alone.)
  EXPECT_GT(m["optimizer_step_pipelined_s"].get<double>(), 0.0);
  // Pipelined >= Adam alone; the model sums per-sub-group shares, so allow rounding (a few ulps).
  EXPECT_GE(m["optimizer_step_pipelined_s"].get<double>(),
            m["adam_s"].get<double>() * (1.0 - 1e-9));
  EXPECT_EQ(m["sub_groups"].get<std::uint64_t>(), 10u);  // 10M elements per rank in 1M sub-groups
  ASSERT_FALSE(j["recommendation"]["io"].empty());
  EXPECT_TRUE(j["recommendation"]["placement"]["found"].get<bool>());
}

}  // namespace

// Each test runs `strata profile` in a directory of its own, removed afterwards.
class ProfileCli : public ::testing::Test {
 protected:
  // Exit status, stdout and stderr of `strata profile ARGS`.
  CliRun profile(const std::string& args) const {
    CliRun r;
    const std::string err_file = dir.str() + "/stderr.txt";
    r.rc = strata::testing::run_command(
        "(" + strata::testing::binary_dir() + "/strata profile " + args + " 2>" + err_file + ")",
        &r.out);
    r.err = read_file(err_file);
    return r;
  }
  static std::string read_file(const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  // Writes `text` to NAME in the directory; returns its path.
  std::string write_file(const std::string& name, const std::string& text) const {
    const std::string path = dir.str() + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  // c.yaml: config_text() with the optimizer state on the host (no NVMe path).
  std::string host_config() const { return write_file("c.yaml", config_text("")); }

  TempDir dir{"strata-profile-test"};
};

TEST_F(ProfileCli, TinyProfileOnAConfiguredPathGivesJsonAndATunedConfig) {
  const std::string nvme = dir.str() + "/nvme";
  fs::create_directory(nvme);
  const std::string cfg = write_file("c.yaml", config_text(nvme));
  const std::string tuned = dir.str() + "/tuned.yaml";
  CliRun r = profile(cfg + " --tiny --json --write-config " + tuned);
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  json j = json::parse(r.out);  // stdout holds exactly one JSON document
  expect_valid_report(j, strata::cuda_available());
  EXPECT_EQ(j["environment"]["paths"][0]["path"], nvme);
  EXPECT_FALSE(j["environment"]["paths"][0]["temporary"].get<bool>());
  // The tuned config loads and `strata plan` accepts it as is.
  const strata::Config t = strata::load_config(tuned);
  EXPECT_EQ(t.tiers.nvme.paths, std::vector<std::string>{nvme});
  EXPECT_EQ(t.tiers.nvme.block_size,
            j["recommendation"]["io"][0]["block_size"].get<std::uint64_t>());
  EXPECT_EQ(t.model.parameters, 20'000'000u);
  std::string out;
  EXPECT_EQ(
      strata::testing::run_command(strata::testing::binary_dir() + "/strata plan " + tuned, &out),
      0)
      << out;
  // Nothing left behind in the NVMe directory.
  EXPECT_TRUE(fs::is_empty(nvme));
}

TEST_F(ProfileCli, NoPathUsesATemporaryDirectoryAndSaysSo) {
  const std::string cfg = host_config();
  CliRun r = profile(cfg + " --tiny --json --backward 0.25");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  json j = json::parse(r.out);
  expect_valid_report(j, strata::cuda_available());
  // --backward: the configured step behind a backward of 0.25 s (strata::predict_overlap).
  const json& ov = j["model"]["overlap"];
  const json& step = j["model"]["configured"];
  EXPECT_EQ(ov["backward_s"].get<double>(), 0.25);
  EXPECT_EQ(ov["chunks"], step["sub_groups"]);
  EXPECT_EQ(ov["optimizer_s"].get<double>(), step["optimizer_step_pipelined_s"].get<double>());
  // 20M parameters are one bucket of the default zero.reduce_bucket_size (500M): every gradient
  // is final at the last one, and the whole update is exposed; this rank's range (half of the
  // model) is handed in during the last half of the backward.
  const double w = ov["optimizer_s"].get<double>();
  EXPECT_EQ(ov["pieces"], 1);
  EXPECT_DOUBLE_EQ(ov["window_s"].get<double>(),
                   0.25 * step["optimizer_elements"].get<double>() / 20e6);
  // The state is in host memory: the speculative update runs out of place, at the measured
  // factor; then the stage-2 commit copies the rank's new parameters (10M bf16) at the measured
  // host copy rate (no GPU: the device's memory is host memory).
  const json& adam = j["cpu_adam"];
  const double f = adam["out_of_place_factor"].get<double>();
  EXPECT_GT(f, 0.0);
  const double mem = step["adam_memory_s"].get<double>();
  EXPECT_GT(mem, 0.0);
  EXPECT_DOUBLE_EQ(ov["speculative_s"].get<double>(), w + (f - 1) * mem);
  if (!strata::cuda_available()) {
    EXPECT_DOUBLE_EQ(ov["commit_s"].get<double>(),
                     10e6 * 2 / adam["host_copy_bytes_per_second"].get<double>());
  }
  EXPECT_DOUBLE_EQ(ov["exposed_s"].get<double>(),
                   ov["speculative_s"].get<double>() + ov["commit_s"].get<double>());
  EXPECT_DOUBLE_EQ(ov["serial_s"].get<double>(), 0.25 + w);
  EXPECT_EQ(ov["config_overlap"], "off");
  const auto& p = j["environment"]["paths"][0];
  EXPECT_TRUE(p["temporary"].get<bool>());
  const std::string tmp = p["path"];
  EXPECT_FALSE(fs::exists(tmp)) << tmp << " was not removed";
  ASSERT_FALSE(j["notes"].empty());
  EXPECT_NE(j["notes"][0].get<std::string>().find("temporary directory"), std::string::npos);
  // The placement is the plan's recommendation (the one recommender).
  EXPECT_EQ(j["recommendation"]["placement"]["choice"]["description"],
            "stage 0, no offload");  // 20M parameters fit any GPU
}

// A config that speculates (optimizer.overlap: on, stage 2) is profiled: the sample step (stage 1,
// on NVMe) and the engine check measure the serial step, which the model predicts; they used to
// refuse the config's overlap ("on is not supported here: zero.stage 0-1 ...").
TEST_F(ProfileCli, AConfigWithOverlapOnIsProfiled) {
  CliRun r = profile(host_config() + " --tiny --json --backward 0.25 --set optimizer.overlap=on");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  json j = json::parse(r.out);
  EXPECT_EQ(j["model"]["overlap"]["config_overlap"], "on");
  const json& sample = j["sample_step"];
  EXPECT_TRUE(sample["ran"].get<bool>());
  EXPECT_GT(sample["pipelined"]["measured_median_s"].get<double>(), 0.0);
}

TEST_F(ProfileCli, NoPathWritesNoTemporarySettingsIntoTheTunedConfig) {
  const std::string text =
      "# a comment that must survive\nmodel: {parameters: 20M}\n"
      "world: {ranks: 2, ranks_per_node: 2}\nzero: {stage: 1}\n"
      "tiers:\n  nvme:\n    block_size: 2MiB   # mine\n    queue_depth: 4\n";
  const std::string cfg = write_file("c.yaml", text);
  const std::string tuned = dir.str() + "/tuned.yaml";
  CliRun r = profile(cfg + " --tiny --write-config " + tuned);
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  const std::string t = read_file(tuned);
  EXPECT_NE(t.find("# a comment that must survive"), std::string::npos) << t;
  EXPECT_NE(t.find("block_size: 2MiB   # mine"), std::string::npos) << t;  // not the temp dir's
  EXPECT_NE(t.find("queue_depth: 4"), std::string::npos) << t;
  EXPECT_EQ(t.find("paths"), std::string::npos) << t;  // no temporary path written
  EXPECT_NE(t.find("no NVMe path configured"), std::string::npos) << t;
  const strata::Config c = strata::load_config(tuned);
  EXPECT_TRUE(c.tiers.nvme.paths.empty());
  EXPECT_EQ(c.tiers.nvme.block_size, 2u << 20);
  EXPECT_NE(r.out.find("not changed (no NVMe path configured"), std::string::npos) << r.out;
}

TEST_F(ProfileCli, WriteConfigKeepsCommentsAndUnits) {
  const std::string nvme = dir.str() + "/nvme";
  fs::create_directory(nvme);
  const std::string text =
      "# job\nmodel:\n  parameters: 20M   # twenty million\nworld: {ranks: 2}\n"
      "tiers:\n  host: {budget: 64GiB}   # per node\n  nvme:\n    paths: [" +
      nvme + "]\n    block_size: 256KiB\n";
  const std::string cfg = write_file("c.yaml", text);
  const std::string tuned = dir.str() + "/tuned.yaml";
  CliRun r = profile(cfg + " --tiny --write-config " + tuned);
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  const std::string t = read_file(tuned);
  for (const char* kept :
       {"# job", "parameters: 20M   # twenty million", "budget: 64GiB}   # per node"})
    EXPECT_NE(t.find(kept), std::string::npos) << kept << "\n" << t;
  EXPECT_EQ(t.find("68719476736"), std::string::npos) << t;  // no unit-less byte counts
  EXPECT_EQ(strata::load_config(tuned).tiers.host.budget, 64ULL << 30);
}

TEST_F(ProfileCli, WriteConfigThatCannotBeOpenedFailsBeforeMeasuring) {
  const std::string cfg = host_config();
  for (const std::string& bad :
       {dir.str(), std::string("/proc/strata-no-such-file"), dir.str() + "/missing-dir/t.yaml"}) {
    CliRun r = profile(cfg + " --tiny --write-config " + bad);
    EXPECT_EQ(r.rc, 2) << bad << ": " << r.err;
    EXPECT_NE(r.err.find("--write-config: "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("errno"), std::string::npos) << r.err;
    // Nothing was measured: every phase prints its "== " progress line before it starts.
    EXPECT_EQ(r.err.find("== "), std::string::npos) << "progress before the failure: " << r.err;
  }
  // An existing file is kept as it was when the run fails.
  const std::string existing = write_file("keep.yaml", "precious\n");
  CliRun r = profile(cfg + " --tiny --write-config " + existing + " --set zero.stage=9");
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(read_file(existing), "precious\n");
}

TEST_F(ProfileCli, BackwardThatIsNotASecondCountIsBadInput) {
  for (const char* t : {"-1", "nan", "inf"}) {
    CliRun r = profile(host_config() + " --tiny --backward " + t);
    EXPECT_EQ(r.rc, 2) << t << ": " << r.err;
    EXPECT_NE(r.err.find("--backward"), std::string::npos) << t << ": " << r.err;
    EXPECT_EQ(r.err.find("== NVMe sweep"), std::string::npos) << t << ": measured first";
  }
}

TEST_F(ProfileCli, ModelParametersAbsentIsBadInput) {
  // Until model.parameters is optional in the loader, the loader refuses the file; either way
  // the command exits 2 naming the key.
  CliRun r = profile(write_file("c.yaml", "world: {ranks: 2}\n") + " --tiny");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("model.parameters"), std::string::npos) << r.err;
}

TEST_F(ProfileCli, HumanReportHasTheTablesAndSaysWhatWasSkipped) {
  const std::string cfg = host_config();
  CliRun r = profile(cfg + " --tiny --backward 2");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  for (const char* s :
       {"NVMe through the strata I/O engine", "CPU Adam", "triad", "Collectives", "Sample step",
        "predicted", "pipelined", "Recommendation", "block_size", "With a backward of 2",
        "exposed after the last gradient", "optimizer.overlap: off"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  if (!strata::cuda_available()) {
    EXPECT_NE(r.out.find("Host <-> device copies: skipped: no GPU"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("GPU Adam: skipped: no GPU"), std::string::npos) << r.out;
  }
  EXPECT_NE(r.out.find("temporary directory"), std::string::npos);
  EXPECT_NE(r.out.find("pinned pool: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Ranks on a node"), std::string::npos) << r.out;
  // stderr is not a terminal here: progress comes as plain whole lines, no terminal controls.
  EXPECT_NE(r.err.find("strata profile: == NVMe sweep"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("strata profile: sample step"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find('\r'), std::string::npos);
  EXPECT_EQ(r.err.find("\033["), std::string::npos);
}

TEST_F(ProfileCli, MissingPathIsBadInput) {
  const std::string missing = dir.str() + "/does-not-exist";
  CliRun r = profile(write_file("c.yaml", config_text(missing)) + " --tiny");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find(missing), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("does not exist"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST_F(ProfileCli, FileInsteadOfDirectoryIsBadInput) {
  const std::string file = write_file("plain-file", "x");
  CliRun r = profile(write_file("c.yaml", config_text(file)) + " --tiny");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("is not a directory"), std::string::npos) << r.err;
}

TEST_F(ProfileCli, UnwritablePathIsBadInput) {
  std::string target = dir.str() + "/read-only";
  fs::create_directory(target);
  ::chmod(target.c_str(), 0500);
  // Can a file be created there? (access() says yes to root even where the kernel says no.)
  auto writable = [](const std::string& d) {
    std::string p = d + "/.probe-XXXXXX";
    const int fd = ::mkstemp(p.data());
    if (fd < 0) return false;
    ::close(fd);
    ::unlink(p.c_str());
    return true;
  };
  if (writable(target)) {
    // Root ignores permission bits; sysfs refuses new files to root too.
    target = "/sys";
    if (!fs::is_directory(target) || writable(target))
      GTEST_SKIP() << "no unwritable directory available to this user";
  }
  CliRun r = profile(write_file("c.yaml", config_text(target)) + " --tiny");
  ::chmod((dir.str() + "/read-only").c_str(), 0700);
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("is not writable"), std::string::npos) << r.err;
}

TEST_F(ProfileCli, TmpfsWithDirectIoRequiredIsBadInput) {
  if (!fs::is_directory("/dev/shm") || !strata::is_tmpfs("/dev/shm"))
    GTEST_SKIP() << "/dev/shm is not tmpfs here";
  CliRun r =
      profile(write_file("c.yaml", config_text("/dev/shm", ", direct_io: required")) + " --tiny");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("tmpfs"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("direct_io"), std::string::npos) << r.err;
}

TEST_F(ProfileCli, BadOptionsAreBadInput) {
  const std::string cfg = host_config();
  EXPECT_EQ(profile(cfg + " --quick --full").rc, 2);
  EXPECT_EQ(profile(dir.str() + "/missing.yaml --tiny").rc, 2);
  CliRun r = profile(cfg + " --tiny --write-config /nonexistent-dir/t.yaml");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("--write-config"), std::string::npos) << r.err;
}

// One process with world.network_bandwidth: the network leg is taken from the key (not measured
// between threads), counted in the prediction, and the report says where it came from.
TEST_F(ProfileCli, NetworkBandwidthKeyIsUsedWhenNotLaunchedAcrossProcesses) {
  const std::string cfg = host_config();
  CliRun r = profile(cfg + " --tiny --json --set world.network_bandwidth=10GB");
  ASSERT_EQ(r.rc, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_TRUE(j["collectives"]["points"].empty());
  const std::string src = j["model"]["bandwidths"]["network_source"];
  EXPECT_NE(src.find("configured: world.network_bandwidth"), std::string::npos) << src;
  EXPECT_EQ(j["model"]["bandwidths"]["reduce_scatter_busbw_bytes_per_second"].get<double>(), 10e9);
  // 20M fp16 parameters on 2 ranks at stage 2: 80 MB per rank, (n-1)/n of it at 10 GB/s.
  EXPECT_NEAR(j["model"]["configured"]["network_s"].get<double>(), 80e6 * 0.5 / 10e9, 1e-9);
}

// `strata info` (ds_report's counterpart): one JSON document with the GPU status ("no NVIDIA
// driver" when there is none, not the runtime's "driver version is insufficient"), io_uring
// availability (a real probe: the test hook makes it fail), the memlock limit, huge pages and the
// CPU's Adam path (which $STRATA_ADAM_PATH forces).
TEST(InfoCli, ReportsDriverIoUringMemlockHugePagesAndAdamPath) {
  const std::string bin = strata::testing::binary_dir() + "/strata info";
  std::string out;
  ASSERT_EQ(strata::testing::run_command("(" + bin + " --json 2>/dev/null)", &out), 0) << out;
  json j = json::parse(out);
  EXPECT_TRUE(j["io_uring"]["available"].is_boolean());
  EXPECT_TRUE(j["memlock_limit_bytes"].is_null() || j["memlock_limit_bytes"].is_number());
  // This process's own answer (core/page_lock): CAP_IPC_LOCK lifts the limit, and says so.
  const strata::PageLockLimit lock = strata::page_lock_limit();
  EXPECT_EQ(j["memlock_cap_ipc_lock"].get<bool>(), lock.cap_ipc_lock);
  EXPECT_TRUE(j["huge_pages"]["2MiB_total"].is_number());
  EXPECT_FALSE(j["huge_pages"]["transparent"].get<std::string>().empty());
  const std::string path = j["cpu_adam_path"];
  EXPECT_TRUE(path == "avx512" || path == "avx2" || path == "scalar") << path;
  const std::string gpu = j["gpu_status"];
  if (!fs::exists("/proc/driver/nvidia/version") && j["cuda"].get<bool>()) {
    EXPECT_NE(gpu.find("no NVIDIA driver"), std::string::npos) << gpu;
    EXPECT_EQ(gpu.find("insufficient"), std::string::npos) << gpu;
  }
  ASSERT_EQ(
      strata::testing::run_command(
          "(STRATA_ADAM_PATH=scalar STRATA_IO_URING_FAIL=1 " + bin + " --json 2>/dev/null)", &out),
      0)
      << out;
  j = json::parse(out);
  EXPECT_EQ(j["cpu_adam_path"], "scalar");
  EXPECT_FALSE(j["io_uring"]["available"].get<bool>());
  EXPECT_FALSE(j["io_uring"]["reason"].get<std::string>().empty());
  // The text form says the same.
  ASSERT_EQ(strata::testing::run_command("(" + bin + " 2>/dev/null)", &out), 0);
  for (const char* s : {"io_uring:", "memlock:", "huge pages:", "CPU Adam:", "GPUs:"})
    EXPECT_NE(out.find(s), std::string::npos) << s << "\n" << out;
  if (lock.cap_ipc_lock && lock.rlimit != ~0ULL) {
    EXPECT_NE(out.find("not applied: this process holds CAP_IPC_LOCK"), std::string::npos) << out;
  }
}
