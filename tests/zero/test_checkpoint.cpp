// Checkpoints: resume bitwise identical to an uninterrupted run (stages 1-3, 2 ranks, saved from
// resident state and restored into NVMe-offloaded state and back), verification (flipped byte in a
// shard, missing shard) changing nothing, and a helper process killed with
// SIGKILL during a save leaving a loadable checkpoint.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "../comm/comm_test_util.hpp"
#include "ckpt_model.hpp"
#include "engine_test_util.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

// > 0: also gradients (stage >= 2) and parameters (stage 3) on NVMe, this fraction of each.
double g_state_nvme = 0;

// Trains `first` steps, saves, trains `then` more; or (resume) loads and trains `then`.
std::vector<std::vector<std::vector<float>>> run(
    int world, int stage, double fraction, const std::string& swap, const std::string& ckpt,
    int first, int then, bool resume, std::vector<std::uint64_t>* steps_after_load = nullptr) {
  auto comms = make_inprocess_communicators(world, 30.0);
  std::vector<std::vector<std::vector<float>>> out(static_cast<std::size_t>(world));
  if (steps_after_load) steps_after_load->assign(static_cast<std::size_t>(world), 0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    Config cfg = ckpt_config(stage, fraction, swap);
    if (g_state_nvme > 0) {
      cfg.tiers.nvme.paths = {swap};
      cfg.tiers.nvme.engine = IoEngineKind::kThreads;
      cfg.tiers.host.buffer_size = 3 * 4096;  // several chunks per partition
      cfg.offload.gradients = {Tier::kNvme, g_state_nvme, false};
      cfg.offload.params = {Tier::kNvme, g_state_nvme, false};
    }
    Engine e(cfg, comm);
    ckpt_register(e, kCkptSizes);
    if (resume) {
      e.load_checkpoint(ckpt);
      if (steps_after_load) (*steps_after_load)[static_cast<std::size_t>(rank)] = e.stats().steps;
    } else {
      for (int s = 0; s < first; ++s) ckpt_step(e, kCkptSizes, rank, s);
      if (!ckpt.empty()) e.save_checkpoint(ckpt);
    }
    for (int s = first; s < first + then; ++s) ckpt_step(e, kCkptSizes, rank, s);
    out[static_cast<std::size_t>(rank)] = read_params(e, kCkptSizes);
  }));
  return out;
}

TEST(Checkpoint, ResumeIsBitwiseIdenticalAcrossTiers) {
  for (int stage : {1, 2, 3}) {
    TempDir swap("strata-ckpt-swap"), ckpt("strata-ckpt");
    // Uninterrupted, resident.
    auto want = run(2, stage, 0, swap.str(), "", 10, 12, false);
    // Saved from resident state at step 10 (an overflow-skipped step 3 before), resumed into a
    // half-NVMe store; and saved from NVMe, resumed resident.
    run(2, stage, 0, swap.str(), ckpt.str(), 10, 0, false);
    std::vector<std::uint64_t> steps;
    auto got = run(2, stage, 0.5, swap.str(), ckpt.str(), 10, 12, true, &steps);
    EXPECT_EQ(steps[0], 10u);
    for (int r = 0; r < 2; ++r)
      expect_bitwise_equal(got[r], want[r], strcat("stage ", stage, " nvme resume rank ", r));
    run(2, stage, 1.0, swap.str(), ckpt.str(), 10, 0, false);
    got = run(2, stage, 0, swap.str(), ckpt.str(), 10, 12, true);
    for (int r = 0; r < 2; ++r)
      expect_bitwise_equal(got[r], want[r], strcat("stage ", stage, " resident resume rank ", r));
    // The second save replaced the first: one shard per rank left, one manifest.
    std::size_t shards = 0;
    for (auto& e : std::filesystem::directory_iterator(ckpt.path()))
      shards += e.path().filename().string().rfind("shard-", 0) == 0;
    EXPECT_EQ(shards, 2u);
    EXPECT_TRUE(std::filesystem::exists(ckpt.path() / "manifest.json"));
    EXPECT_FALSE(std::filesystem::exists(ckpt.path() / "manifest.json.tmp"));
  }
}

// Gradients and parameters on NVMe (stage 3): saved from there, resumed into there and into
// resident state, bitwise identical to the uninterrupted resident run.
TEST(Checkpoint, ResumeWithParamsAndGradientsOnNvme) {
  TempDir swap("strata-ckpt-swap"), ckpt("strata-ckpt");
  auto want = run(2, 3, 0, swap.str(), "", 10, 6, false);
  g_state_nvme = 0.6;
  run(2, 3, 0.5, swap.str(), ckpt.str(), 10, 0, false);
  auto got = run(2, 3, 1.0, swap.str(), ckpt.str(), 10, 6, true);
  g_state_nvme = 0;
  for (int r = 0; r < 2; ++r)
    expect_bitwise_equal(got[r], want[r], strcat("params nvme resume rank ", r));
  got = run(2, 3, 0, swap.str(), ckpt.str(), 10, 6, true);
  for (int r = 0; r < 2; ++r)
    expect_bitwise_equal(got[r], want[r], strcat("resident resume rank ", r));
}

// A model that registers the same tensors in another order (strata.torch registered them group
// by group, and in the model's order since) loads each tensor by its name: master, moments and
// its own step count, on 2 ranks at stage 2 (a tensor straddles the ranks' partitions). A tensor
// renamed is another model: refused, nothing loaded.
TEST(Checkpoint, TheSameTensorsInAnotherOrderLoadByName) {
  const std::vector<std::size_t> sizes{700, 33, 1500, 7};
  const std::vector<std::size_t> order{2, 0, 3, 1};  // the loading model's tensors, by saved index
  TempDir ckpt("strata-ckpt");
  const StateKind kinds[] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq};
  std::vector<std::vector<std::vector<float>>> want(sizes.size());  // [tensor][kind]
  std::vector<std::int64_t> want_steps(sizes.size());
  auto register_as = [&](Engine& e, const std::vector<std::size_t>& which, const char* prefix) {
    for (std::size_t t : which) e.add_parameter(strcat(prefix, t), initial_values(31, t, sizes[t]));
    e.finalize();
  };
  auto comms = make_inprocess_communicators(2, 30.0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    Engine e(ckpt_config(2, 0, ""), comm);
    register_as(e, {0, 1, 2, 3}, "t");
    for (int s = 0; s < 3; ++s) {
      for (std::size_t t = sizes.size(); t-- > 0;) {
        if (s == 1 && t == 1) {
          e.skip_gradient(t);  // tensor 1 misses a step: its own count differs
          continue;
        }
        const auto g = grad_of(77, rank, s, t, sizes[t], DType::kFp32);
        e.set_gradient_host(t, g.data());
      }
      e.step();
    }
    e.save_checkpoint(ckpt.str());
    for (TensorId t = 0; t < sizes.size() && rank == 0; ++t) {
      want_steps[t] = e.optimizer_step(t);
      for (StateKind k : kinds) {
        want[t].emplace_back(sizes[t]);
        e.read_state(t, k, want[t].back());
      }
    }
    if (rank != 0)
      for (TensorId t = 0; t < sizes.size(); ++t)
        for (StateKind k : kinds) {
          std::vector<float> v(sizes[t]);
          e.read_state(t, k, v);  // collective at stage 2: both ranks read
        }
  }));
  EXPECT_EQ(want_steps[1] + 1, want_steps[0]);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    Engine e(ckpt_config(2, 0, ""), comm);
    register_as(e, order, "t");
    e.load_checkpoint(ckpt.str());
    for (TensorId i = 0; i < order.size(); ++i) {
      const std::size_t t = order[i];
      EXPECT_EQ(e.optimizer_step(i), want_steps[t]) << "t" << t;
      for (int k = 0; k < 3; ++k) {
        std::vector<float> v(sizes[t]);
        e.read_state(i, kinds[k], v);
        if (rank == 0) expect_bitwise_equal({v}, {want[t][k]}, strcat("t", t, " kind ", k));
      }
    }
  }));
  rethrow_any(run_ranks(comms, [&](int, Communicator& comm) {
    Engine e(ckpt_config(2, 0, ""), comm);
    register_as(e, order, "u");
    expect_error(ErrorCode::kInvalidArgument, "this model registers 'u2'",
                 [&] { e.load_checkpoint(ckpt.str()); });
  }));
}

TEST(Checkpoint, VerificationFailuresChangeNothing) {
  TempDir swap("strata-ckpt-swap"), ckpt("strata-ckpt");
  run(2, 2, 0.5, swap.str(), ckpt.str(), 4, 0, false);
  // (Another world size loads, resharding: tests/checkpoint.)
  // A flipped byte in rank 1's shard: both ranks refuse, nothing is restored.
  std::string shard1;
  for (auto& e : std::filesystem::directory_iterator(ckpt.path()))
    if (e.path().filename().string().find("-r1.bin") != std::string::npos)
      shard1 = e.path().string();
  ASSERT_FALSE(shard1.empty());
  {
    std::fstream f(shard1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(8192 + 333);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x04;
    f.seekp(8192 + 333);
    f.write(&c, 1);
  }
  auto comms = make_inprocess_communicators(2, 30.0);
  std::vector<int> codes(2, -1);
  auto errs = run_ranks(comms, [&](int rank, Communicator& comm) {
    Engine e(ckpt_config(2, 0.5, swap.str()), comm);
    ckpt_register(e, kCkptSizes);
    auto before = read_params(e, kCkptSizes);
    try {
      e.load_checkpoint(ckpt.str());
    } catch (const Error& err) {
      codes[static_cast<std::size_t>(rank)] = static_cast<int>(err.code());
    }
    expect_bitwise_equal(read_params(e, kCkptSizes), before, "after a failed load");
    EXPECT_EQ(e.stats().steps, 0u);
  });
  rethrow_any(errs);
  EXPECT_EQ(codes[0], static_cast<int>(ErrorCode::kChecksum));
  EXPECT_EQ(codes[1], static_cast<int>(ErrorCode::kChecksum));
  // A missing shard.
  std::filesystem::remove(shard1);
  EXPECT_THROW(run(2, 2, 0, swap.str(), ckpt.str(), 4, 0, true), Error);
}

// Issue 48, 9A: a load between a step's gradients and step() (a micro-batch handed in) is refused
// with Error(kInvalidArgument), nothing changed (it once made the next micro-batch fail, "filled
// twice", and left the engine failed); after discard_gradients() it loads, and the run then equals
// one that loaded between steps, bit for bit. Stages 1-3, one rank.
TEST(Checkpoint, ALoadBetweenAStepsGradientsIsRefusedUntilTheyAreDiscarded) {
  for (int stage : {1, 2, 3}) {
    TempDir swap("strata-ckpt-swap"), ckpt("strata-ckpt");
    run(1, stage, 0.5, swap.str(), ckpt.str(), 2, 0, false);
    const auto want = run(1, stage, 0.5, swap.str(), ckpt.str(), 2, 2, true);
    auto comms = make_inprocess_communicators(1, 30.0);
    Engine e(ckpt_config(stage, 0.5, swap.str()), *comms[0]);
    ckpt_register(e, kCkptSizes);
    ckpt_step(e, kCkptSizes, 0, 7);
    const std::vector<float> g(kCkptSizes.back(), 0.25f);
    e.set_gradient(kCkptSizes.size() - 1, g.data());  // a micro-batch begun
    const auto before = read_params(e, kCkptSizes);
    expect_error(ErrorCode::kInvalidArgument, "discard_gradients() first",
                 [&] { e.load_checkpoint(ckpt.str()); });
    expect_bitwise_equal(read_params(e, kCkptSizes), before, "after a refused load");
    e.discard_gradients();
    e.load_checkpoint(ckpt.str());
    for (int s = 2; s < 4; ++s) ckpt_step(e, kCkptSizes, 0, s);
    expect_bitwise_equal(read_params(e, kCkptSizes), want[0], strcat("stage ", stage));
  }
}

// The helper (ckpt_helper.cpp: saves serials 1..3, stopping before file operation `pause_at` of
// the third save), its stdout on a pipe.
Child start_helper(const std::string& ckpt, const std::string& swap, std::uint64_t pause_at) {
  return start_child({STRATA_CKPT_HELPER, ckpt, swap, "3", std::to_string(pause_at)}, true);
}

// Reads lines until one starts with `prefix` (or EOF / 60 s); that line in *line.
bool read_until(int fd, const std::string& prefix, std::string& log, std::string* line = nullptr) {
  return read_line_until(
      fd,
      [&](const std::string& l) {
        if (l.rfind(prefix, 0) != 0) return false;
        if (line) *line = l;
        return true;
      },
      &log);
}

// The helper killed at file operation `pause_at` of its third save (before that operation): the
// checkpoint loads, is step 2's while the save had not renamed its manifest into place and step
// 3's after, bitwise; and training goes on from it identically. Returns whether the kill came
// before the commit. `ops` > 0: the number of file operations a save makes (the second's).
bool kill_at_and_resume(std::uint64_t pause_at, std::uint64_t* ops) {
  const std::vector<std::size_t>& sizes = kKillSizes;
  TempDir swap("strata-ckpt-swap"), ckpt("strata-ckpt");
  auto [pid, fd] = start_helper(ckpt.str(), swap.str(), pause_at);
  std::string log, saved2, paused;
  const bool reached = read_until(fd, "saved 2 ops ", log, &saved2) &&
                       read_until(fd, pause_at <= *ops ? "paused " : "saved 3 ", log, &paused);
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ::close(fd);
  EXPECT_TRUE(reached) << "helper output:\n" << log;
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "helper output:\n" << log;
  if (!reached) return false;
  *ops = std::stoull(saved2.substr(std::string("saved 2 ops ").size()));
  const bool committed = paused.rfind("saved 3 ", 0) == 0 || paused.ends_with(" committed 1");
  // Load in this process.
  auto comms = make_inprocess_communicators(1, 30.0);
  Engine e(ckpt_config(1, 0.5, swap.str()), *comms[0]);
  ckpt_register(e, sizes);
  const std::string where = strcat("killed at '", paused, "'");
  EXPECT_NO_THROW(e.load_checkpoint(ckpt.str())) << where;
  const int steps = static_cast<int>(e.stats().steps);
  EXPECT_EQ(steps, committed ? 3 : 2) << where;
  auto got = read_params(e, sizes);
  Engine ref(ckpt_config(1, 0, swap.str()), *comms[0]);
  ckpt_register(ref, sizes);
  for (int s = 0; s < steps; ++s) ckpt_step(ref, sizes, 0, s);
  expect_bitwise_equal(got, read_params(ref, sizes), where);
  // And training continues identically.
  ckpt_step(e, sizes, 0, steps);
  ckpt_step(ref, sizes, 0, steps);
  expect_bitwise_equal(read_params(e, sizes), read_params(ref, sizes),
                       where + ", one step after the resume");
  return !committed;
}

// SIGKILL inside a save, at known points (no timing involved): before the save's first file
// operation, a quarter, half and three quarters of the way through its operations, before its last
// one, and after it completed. scripts/ckpt_kill_trials.sh kills at random times instead.
TEST(Checkpoint, SigkillDuringSaveLeavesPreviousCheckpointLoadable) {
  std::uint64_t ops = ~std::uint64_t{0};
  // The first run learns how many file operations a save makes (ops, from the second save) and
  // kills before the first operation of the third.
  EXPECT_TRUE(kill_at_and_resume(1, &ops)) << "killed before any file operation of the save";
  ASSERT_GT(ops, 3u);
  EXPECT_TRUE(kill_at_and_resume(ops / 4, &ops));
  EXPECT_TRUE(kill_at_and_resume(ops / 2, &ops)) << "the middle of a save came after its commit";
  kill_at_and_resume(3 * ops / 4, &ops);
  kill_at_and_resume(ops, &ops);
  EXPECT_FALSE(kill_at_and_resume(ops + 1, &ops)) << "the completed save is step 3's";
}

}  // namespace
}  // namespace strata::testing
