// `strata train --checkpoint-dir DIR --save-every N --resume` (issue 14.1): a run SIGKILLed at a
// random step (often inside a save) and resumed gives exactly the per-step losses, gradient norms
// and loss scales of a run that never stopped; resuming with another world size and stage works;
// world.ranks is honoured; step time and samples/s are reported; bad arguments exit 2.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <random>

#include "checkpoint/ckpt_test_util.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

using nlohmann::json;

// fp16 gradients with a loss scale that overflows, backs off and grows again every 3 steps: the
// scale, its good-step count and the skipped steps must all survive a restart.
std::vector<std::string> train_args(int ranks, int steps = 24) {
  return {"train",    source_dir() + "/configs/default.yaml",
          "--set",    "precision.params=bf16",
          "--set",    "precision.grads=fp16",
          "--set",    "precision.loss_scale.initial=4e6",
          "--set",    "precision.loss_scale.growth_interval=3",
          "--set",    "zero.stage=2",
          "--set",    "zero.reduce_bucket_size=300",
          "--set",    "zero.sub_group_size=500",
          "--set",    "optimizer.lr=0.01",
          "--set",    "runtime.cpu_threads=1",
          "--set",    "runtime.collective_timeout_s=60",
          "--steps",  std::to_string(steps),
          "--hidden", "24",
          "--batch",  "16",
          "--ranks",  std::to_string(ranks)};
}

// args followed by more.
std::vector<std::string> plus(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

std::string shell(const std::vector<std::string>& args) {
  std::string s = strata_cli();
  for (const auto& a : args) s += " '" + a + "'";
  return s;
}

// Runs strata with --json; stdout must be one JSON document.
json run_json(std::vector<std::string> args) {
  args.push_back("--json");
  std::string out;
  const std::string cmd = "{ " + shell(args) + " 2>/dev/null; }";  // (run_command adds 2>&1)
  const int rc = run_command(cmd, &out);
  EXPECT_EQ(rc, 0) << cmd << "\n" << out;
  try {
    return json::parse(out);
  } catch (const std::exception& e) {
    ADD_FAILURE() << cmd << ": stdout is not one JSON document: " << e.what() << "\n" << out;
    return json::object();
  }
}

// Starts the test-only build of strata whose saves last long enough to be hit (slow_saves.cpp),
// its stdout on a pipe.
Child start(const std::vector<std::string>& args) {
  std::vector<std::string> argv{STRATA_SLOW_SAVES};
  argv.insert(argv.end(), args.begin(), args.end());
  return start_child(argv);
}

// Reads lines until one starts with `prefix` (or EOF / 60 s).
bool read_until(int fd, const std::string& prefix, std::string& log) {
  return read_line_until(
      fd, [&](const std::string& line) { return line.rfind(prefix, 0) == 0; }, &log);
}

void expect_same_step(const json& got, const json& want, const std::string& what) {
  ASSERT_EQ(got["step"], want["step"]) << what;
  for (const char* k : {"loss", "grad_norm", "loss_scale"})
    EXPECT_EQ(got[k].get<double>(), want[k].get<double>())
        << what << " step " << got["step"] << " " << k;
  EXPECT_EQ(got["applied"], want["applied"]) << what << " step " << got["step"];
  EXPECT_GT(got["seconds"].get<double>(), 0) << what;
  EXPECT_GT(got["samples_per_second"].get<double>(), 0) << what;
}

TEST(TrainResume, SigkillAtARandomStepThenResumeGivesTheUninterruptedLosses) {
  const json want = run_json(train_args(2));
  ASSERT_EQ(want["steps"].size(), 24u);
  ASSERT_GT(want["skipped_steps"].get<int>(), 0)
      << "the loss scale never overflowed: a weaker test";
  std::mt19937_64 rng(test_seed("train kill step"));
  for (int trial = 0; trial < 3; ++trial) {
    TempDir ckpt("strata-train-resume");
    auto args = train_args(2);
    args = plus(args, {"--checkpoint-dir", ckpt.str(), "--save-every", "3"});
    // Trial 0 saves blocking; the others asynchronously (the default): a save is committed by the
    // next one, so the last committed checkpoint may be one save further back, and the kill may
    // land while a background writer is at work.
    const bool blocking = trial == 0;
    if (blocking) args.push_back("--blocking-saves");
    const int kill_at = 2 + static_cast<int>(rng() % 19);  // after step 2..20 is printed
    auto [pid, fd] = start(args);
    std::string log;
    const bool seen = read_until(fd, "step " + std::to_string(kill_at) + " ", log);
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ::close(fd);
    ASSERT_TRUE(seen) << "output:\n" << log;
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "not killed mid-run:\n"
                                                                    << log;
    args.push_back("--resume");
    const json got = run_json(args);
    ASSERT_TRUE(got.contains("checkpoint")) << got.dump();
    const json& from = got["checkpoint"]["resumed_from_step"];
    const int first = from.is_null() ? 0 : from.get<int>();
    std::printf("trial %d: killed after step %d was printed, resumed after step %d\n", trial,
                kill_at, first);
    EXPECT_EQ(first % 3, 0);
    EXPECT_LE(first, kill_at);
    EXPECT_GE(first, kill_at - (blocking ? 3 : 6));
    ASSERT_EQ(got["steps"].size(), static_cast<std::size_t>(24 - first)) << got.dump();
    for (std::size_t i = 0; i < got["steps"].size(); ++i)
      expect_same_step(got["steps"][i], want["steps"][static_cast<std::size_t>(first) + i],
                       strcat("killed after step ", kill_at, ", resumed after step ", first));
    EXPECT_EQ(got["skipped_steps"], want["skipped_steps"]);
    // Each save says how long it blocked training; the last one (the run's end) waits.
    const json& saves = got["checkpoint"]["saves"];
    ASSERT_FALSE(saves.empty()) << got.dump();
    for (std::size_t i = 0; i < saves.size(); ++i) {
      EXPECT_GE(saves[i]["blocked_s"].get<double>(), 0.0);
      EXPECT_EQ(saves[i]["mode"], blocking || i + 1 == saves.size() ? "blocking" : "async");
    }
    EXPECT_GE(got["checkpoint"]["checkpoint_blocked_s"].get<double>(), 0.0);
    // Resuming a finished run trains nothing.
    const json again = run_json(args);
    EXPECT_EQ(again["steps"].size(), 0u);
    EXPECT_EQ(again["checkpoint"]["resumed_from_step"], 24);
  }
}

TEST(TrainResume, AnotherWorldSizeAndStageContinue) {
  TempDir ckpt("strata-train-resume");
  auto args = train_args(2, 9);
  args = plus(args, {"--checkpoint-dir", ckpt.str()});
  run_json(args);
  auto more = train_args(3);
  more = plus(more, {"--checkpoint-dir", ckpt.str(), "--resume", "--set", "zero.stage=3"});
  const json got = run_json(more);
  EXPECT_EQ(got["ranks"], 3);
  EXPECT_EQ(got["stage"], 3);
  EXPECT_EQ(got["checkpoint"]["resumed_from_step"], 9);
  ASSERT_EQ(got["steps"].size(), 15u);
  EXPECT_EQ(got["steps"][0]["step"], 10);
}

// args with the value after `flag` replaced.
std::vector<std::string> with(std::vector<std::string> args, const std::string& flag,
                              const std::string& value) {
  for (std::size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == flag) {
      args[i + 1] = value;
      return args;
    }
  args.push_back(flag);
  args.push_back(value);
  return args;
}

// --hidden, --batch and --seed are recorded in DIR/train.json after each save; --resume with other
// values exits 2 before training and names both; without the record (or with a stale one) it
// resumes with a warning.
TEST(TrainResume, OtherModelOrDataOptionsAreRefused) {
  TempDir ckpt("strata-train-options");
  auto args = train_args(2, 3);
  args = plus(args, {"--checkpoint-dir", ckpt.str()});
  run_json(args);
  const json rec = json::parse(read_file(ckpt.str() + "/train.json"));
  EXPECT_EQ(rec["hidden"], 24);
  EXPECT_EQ(rec["batch"], 16);
  EXPECT_EQ(rec["seed"], 1);
  EXPECT_EQ(rec["step"], 3);
  EXPECT_EQ(rec["checkpoint_serial"], 1);

  auto resume = with(args, "--steps", "5");
  resume.push_back("--resume");
  struct Bad {
    const char* flag;
    const char* value;
    const char* says;
  };
  for (const Bad& b :
       {Bad{"--batch", "8", "this run has --batch 8"}, Bad{"--seed", "7", "this run has --seed 7"},
        Bad{"--hidden", "20", "this run has --hidden 20"}}) {
    std::string out;
    EXPECT_EQ(run_command(shell(with(resume, b.flag, b.value)), &out), 2) << b.flag << "\n" << out;
    EXPECT_NE(out.find(b.says), std::string::npos) << out;
    EXPECT_NE(out.find("was trained with --hidden 24 --batch 16 --seed 1"), std::string::npos)
        << out;
    EXPECT_EQ(out.find("step 4 "), std::string::npos) << b.flag << ": trained before refusing\n"
                                                      << out;
  }
  // The same options continue, and the record follows the new save (a leftover temporary file of
  // a run killed while writing it is replaced).
  write_file(ckpt.str() + "/train.json.tmp", "left by a killed run");
  const json got = run_json(resume);
  EXPECT_EQ(got["checkpoint"]["resumed_from_step"], 3);
  ASSERT_EQ(got["steps"].size(), 2u);
  const json rec2 = json::parse(read_file(ckpt.str() + "/train.json"));
  EXPECT_EQ(rec2["step"], 5);
  EXPECT_EQ(rec2["checkpoint_serial"], 2);

  // A record of another save: warned about, not checked.
  write_file(ckpt.str() + "/train.json",
             "{\"hidden\": 24, \"batch\": 99, \"seed\": 1, \"checkpoint_serial\": 1}");
  std::string out;
  EXPECT_EQ(run_command(shell(with(resume, "--steps", "6")), &out), 0) << out;
  EXPECT_NE(out.find("belongs to another save (serial 1, the checkpoint's is 2)"),
            std::string::npos)
      << out;
  // No record: warned about, not checked.
  ASSERT_EQ(::unlink((ckpt.str() + "/train.json").c_str()), 0);
  EXPECT_EQ(run_command(shell(with(with(resume, "--steps", "7"), "--batch", "8")), &out), 0) << out;
  EXPECT_NE(out.find("train.json is missing"), std::string::npos) << out;
  // Not what strata train writes: refused, naming the file.
  write_file(ckpt.str() + "/train.json", "[1, 2]");
  EXPECT_EQ(run_command(shell(with(resume, "--steps", "8")), &out), 2) << out;
  EXPECT_NE(out.find("train.json is not what strata train writes"), std::string::npos) << out;
}

TEST(TrainCliArgs, WorldRanksTimingAndBadArguments) {
  auto args = train_args(2, 4);
  args.erase(args.end() - 2, args.end());  // no --ranks: world.ranks
  args = plus(args, {"--set", "world.ranks=3"});
  const json j = run_json(args);
  EXPECT_EQ(j["ranks"], 3);
  ASSERT_EQ(j["steps"].size(), 4u);
  EXPECT_GT(j["steps"][0]["seconds"].get<double>(), 0);
  EXPECT_GT(j["steps"][0]["samples_per_second"].get<double>(), 0);
  EXPECT_GT(j["samples_per_second"].get<double>(), 0);
  const std::string base = shell(args);
  for (const char* bad :
       {" --ranks 0", " --ranks -2", " --ranks 257", " --seed -1", " --save-every 3", " --resume",
        " --checkpoint-dir /proc/strata-nope", " --save-every 0 --checkpoint-dir /tmp/x"}) {
    std::string out;
    EXPECT_EQ(run_command(base + bad, &out), 2) << bad << "\n" << out;
    EXPECT_EQ(out.find("step 1 "), std::string::npos) << bad << ": trained before refusing\n"
                                                      << out;
  }
}

// Issue 48 point 9 (C): with several in-process ranks, a failure of rank 1 alone (its disk full in
// the background write of its shard) reached the user only as rank 0's "rank 1 failed (io; see
// that rank's error)", rank 1's own error printed nowhere. Every failing rank's own error is
// printed, once, prefixed with its rank; the exit code is the I/O failure's (1).
TEST(TrainCliArgs, EveryFailingRanksOwnErrorIsPrinted) {
  TempDir tmp("strata-rank1-full");
  const std::string ckpt = tmp.str() + "/ckpt";
  std::string cmd = STRATA_RANK1_DISK_FULL;
  for (const auto& a : plus(train_args(2, 6), {"--checkpoint-dir", ckpt, "--save-every", "2"}))
    cmd += " '" + a + "'";
  std::string out;
  const int rc = run_command("{ " + cmd + " >/dev/null 2>" + tmp.str() + "/stderr; }", &out);
  const std::string err = read_file(tmp.str() + "/stderr");
  EXPECT_EQ(rc, 1) << err;
  auto count = [&](const std::string& what) {
    std::size_t n = 0;
    for (std::size_t at = err.find(what); at != std::string::npos; at = err.find(what, at + 1)) ++n;
    return n;
  };
  // Rank 1's own error: the write of its shard, ENOSPC, naming the file; once.
  EXPECT_EQ(count("No space left on device"), 1u) << err;
  const std::size_t own = err.find("strata: error: rank 1: ");
  ASSERT_NE(own, std::string::npos) << err;
  const std::string line = err.substr(own, err.find('\n', own) - own);
  EXPECT_NE(line.find("-r1.bin"), std::string::npos) << line;
  EXPECT_NE(line.find("No space left on device"), std::string::npos) << line;
  // Rank 0's, which points at it; once.
  EXPECT_EQ(count("strata: error: rank 0: "), 1u) << err;
  EXPECT_EQ(count("strata: error: rank 1: "), 1u) << err;
}

}  // namespace
}  // namespace strata::testing
