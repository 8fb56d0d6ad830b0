// `strata profile` end to end through the CLI binary (${STRATA_BINARY_DIR}/strata) with the hidden
// --tiny mode: valid JSON with every section, a tuned config that loads, GPU sections skipped
// without a GPU, the temporary NVMe directory removed, and bad paths rejected with exit code 2.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

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

CliRun profile(const std::string& args, const TempDir& dir) {
  CliRun r;
  const std::string err_file = dir.str() + "/stderr.txt";
  r.rc = strata::testing::run_command("(" + strata::testing::binary_dir() + "/strata profile " + args +
                                          " 2>" + err_file + ")",
                                      &r.out);
  std::ifstream in(err_file);
  r.err.assign(std::istreambuf_iterator<char>(in), {});
  return r;
}

std::string write_file(const TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = dir.str() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// 20M parameters on 2 ranks, stage 2, optimizer state on NVMe in `nvme` (or on cpu without).
std::string config_text(const std::string& nvme, const std::string& extra = "") {
  std::string s = "model: {parameters: 20M}\nworld: {ranks: 2, ranks_per_node: 2}\n"
                  "zero: {stage: 2, sub_group_size: 1M}\n";
  if (nvme.empty()) {
    s += "offload: {optimizer: {tier: cpu}}\n";
  } else {
    s += "offload: {optimizer: {tier: nvme}}\n";
    s += "tiers: {nvme: {paths: [" + nvme + "], block_size: 256KiB, queue_depth: 8" + extra + "}}\n";
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
  // Two ranks: reduce-scatter and all-gather, busbw = algbw / 2.
  ASSERT_EQ(j["collectives"]["points"].size(), 2u);
  for (const auto& c : j["collectives"]["points"])
    EXPECT_NEAR(c["busbw_bytes_per_second"].get<double>(),
                c["algbw_bytes_per_second"].get<double>() / 2, 1e-6 * c["algbw_bytes_per_second"].get<double>());
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

TEST(ProfileCli, TinyProfileOnAConfiguredPathGivesJsonAndATunedConfig) {
  TempDir dir("strata-profile-test");
  const std::string nvme = dir.str() + "/nvme";
  fs::create_directory(nvme);
  const std::string cfg = write_file(dir, "c.yaml", config_text(nvme));
  const std::string tuned = dir.str() + "/tuned.yaml";
  CliRun r = profile(cfg + " --tiny --json --write-config " + tuned, dir);
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  json j = json::parse(r.out);  // stdout holds exactly one JSON document
  expect_valid_report(j, strata::cuda_available());
  EXPECT_EQ(j["environment"]["paths"][0]["path"], nvme);
  EXPECT_FALSE(j["environment"]["paths"][0]["temporary"].get<bool>());
  // The tuned config loads and `strata plan` accepts it as is.
  const strata::Config t = strata::load_config(tuned);
  EXPECT_EQ(t.tiers.nvme.paths, std::vector<std::string>{nvme});
  EXPECT_EQ(t.tiers.nvme.block_size, j["recommendation"]["io"][0]["block_size"].get<std::uint64_t>());
  EXPECT_EQ(t.model.parameters, 20'000'000u);
  std::string out;
  EXPECT_EQ(strata::testing::run_command(strata::testing::binary_dir() + "/strata plan " + tuned, &out), 0)
      << out;
  // Nothing left behind in the NVMe directory.
  EXPECT_TRUE(fs::is_empty(nvme));
}

TEST(ProfileCli, NoPathUsesATemporaryDirectoryAndSaysSo) {
  TempDir dir("strata-profile-test");
  const std::string cfg = write_file(dir, "c.yaml", config_text(""));
  CliRun r = profile(cfg + " --tiny --json", dir);
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  json j = json::parse(r.out);
  expect_valid_report(j, strata::cuda_available());
  const auto& p = j["environment"]["paths"][0];
  EXPECT_TRUE(p["temporary"].get<bool>());
  const std::string tmp = p["path"];
  EXPECT_FALSE(fs::exists(tmp)) << tmp << " was not removed";
  ASSERT_FALSE(j["notes"].empty());
  EXPECT_NE(j["notes"][0].get<std::string>().find("temporary directory"), std::string::npos);
  // Without paths the tuned config cannot put anything on NVMe.
  for (const auto& o : j["recommendation"]["placement"]["considered"])
    EXPECT_NE(o["offload"]["optimizer"]["tier"], "nvme");
}

TEST(ProfileCli, HumanReportHasTheTablesAndSaysWhatWasSkipped) {
  TempDir dir("strata-profile-test");
  const std::string cfg = write_file(dir, "c.yaml", config_text(""));
  CliRun r = profile(cfg + " --tiny", dir);
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  for (const char* s : {"NVMe through the strata I/O engine", "CPU Adam", "triad", "Collectives",
                        "Sample step", "predicted", "pipelined", "Recommendation", "block_size"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  if (!strata::cuda_available()) {
    EXPECT_NE(r.out.find("Host <-> device copies: skipped: no GPU"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("GPU Adam: skipped: no GPU"), std::string::npos) << r.out;
  }
  EXPECT_NE(r.out.find("temporary directory"), std::string::npos);
  // Progress goes to a terminal only: none here.
  EXPECT_EQ(r.err.find("=="), std::string::npos) << r.err;
}

TEST(ProfileCli, MissingPathIsBadInput) {
  TempDir dir("strata-profile-test");
  const std::string missing = dir.str() + "/does-not-exist";
  CliRun r = profile(write_file(dir, "c.yaml", config_text(missing)) + " --tiny", dir);
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find(missing), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("does not exist"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST(ProfileCli, FileInsteadOfDirectoryIsBadInput) {
  TempDir dir("strata-profile-test");
  const std::string file = write_file(dir, "plain-file", "x");
  CliRun r = profile(write_file(dir, "c.yaml", config_text(file)) + " --tiny", dir);
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("is not a directory"), std::string::npos) << r.err;
}

TEST(ProfileCli, UnwritablePathIsBadInput) {
  TempDir dir("strata-profile-test");
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
  CliRun r = profile(write_file(dir, "c.yaml", config_text(target)) + " --tiny", dir);
  ::chmod((dir.str() + "/read-only").c_str(), 0700);
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("is not writable"), std::string::npos) << r.err;
}

TEST(ProfileCli, TmpfsWithDirectIoRequiredIsBadInput) {
  if (!fs::is_directory("/dev/shm") || !strata::is_tmpfs("/dev/shm"))
    GTEST_SKIP() << "/dev/shm is not tmpfs here";
  TempDir dir("strata-profile-test");
  CliRun r = profile(write_file(dir, "c.yaml", config_text("/dev/shm", ", direct_io: required")) + " --tiny",
                  dir);
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("tmpfs"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("direct_io"), std::string::npos) << r.err;
}

TEST(ProfileCli, BadOptionsAreBadInput) {
  TempDir dir("strata-profile-test");
  const std::string cfg = write_file(dir, "c.yaml", config_text(""));
  EXPECT_EQ(profile(cfg + " --quick --full", dir).rc, 2);
  EXPECT_EQ(profile(dir.str() + "/missing.yaml --tiny", dir).rc, 2);
  CliRun r = profile(cfg + " --tiny --write-config /nonexistent-dir/t.yaml", dir);
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("--write-config"), std::string::npos) << r.err;
}
