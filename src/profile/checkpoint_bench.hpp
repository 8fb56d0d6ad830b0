// Checkpoint saves measured (strata bench checkpoint): a one-rank Engine built from the config
// (precision.*, optimizer.*, runtime.*, tiers.*), the rank holding `elements` parameters with its
// optimizer state on NVMe or in pinned host memory, saving into `dir`:
//   - the time a blocking save blocks the caller, and the time an asynchronous save's call does
//     (the snapshot), medians over rounds, and their ratio;
//   - the background writer's throughput on an idle step loop (the shard's data bytes over the
//     writer thread's time) against a raw sequential write of the same bytes through the I/O
//     engine (the NVMe tier's options: O_DIRECT, 4 MiB requests all in its queue, one fdatasync:
//     the disk's sequential write bound), the two alternated round by round; with the state on
//     NVMe, also against the same writes with the writer's reads (12 B per parameter) beside them
//     (the disk's bound for what the writer moves: its reads and writes share the disk);
//   - the step time of steps taken while the writer is at work against idle steps, and how often
//     and how long the writer paused for the steps' own I/O (AsyncCheckpoint::set_step_running).
// Nothing here checks a figure: it measures and reports.
//
// Thread-safety: plain functions; each call builds and tears down its own engine. Failure: as
// Engine and checkpoints (IoError, Error(kInvalidArgument / kBudget / kChecksum)).
#pragma once

#include <cstdint>
#include <string>

#include "strata/config.hpp"

namespace strata::profile {

struct CheckpointBenchOptions {
  Config config;               // world.ranks taken as 1; offload.optimizer set from `state`
  Tier state = Tier::kNvme;    // kNvme (tiers.nvme.paths needed) or kCpu (pinned host memory)
  std::uint64_t elements = 0;  // parameters of the rank, >= 1
  int rounds = 3;              // measured rounds (medians), after one warm-up step
  int steps = 3;               // idle steps timed per round
  std::string dir;             // the checkpoint directory (created; saves replace its contents)
};

struct CheckpointBenchResult {
  // Every member is a field of `strata bench checkpoint --json` under its own name.
  std::string state;  // "nvme" | "cpu"
  std::uint64_t params = 0;
  std::uint64_t shard_bytes = 0;  // data bytes of the rank's shard: parameters + 3 FP32 arrays
  // Medians over rounds, seconds (rates in bytes/s).
  double blocking_save_s = 0;
  double async_blocked_s = 0;
  double blocked_ratio = 0;  // async_blocked_s / blocking_save_s
  double writer_s = 0;       // the writer thread on an idle loop (no steps)
  double writer_bytes_per_s = 0;
  double raw_write_s = 0;
  double raw_write_bytes_per_s = 0;
  double writer_vs_raw = 0;  // writer_bytes_per_s / raw_write_bytes_per_s
  // State on NVMe: the writer also reads state_read_bytes from the disk it writes to. raw_move_s:
  // the raw write with those reads beside it (state on cpu: raw_write_s); writer_vs_move:
  // raw_move_s / writer_s, the writer against the disk's bound for what it moves.
  std::uint64_t state_read_bytes = 0;
  double raw_move_s = 0;
  double writer_vs_move = 0;
  double idle_step_s = 0;
  double busy_step_s = 0;        // steps taken while a writer was at work (0 if none was)
  std::uint64_t busy_steps = 0;  // how many, over all rounds
  double busy_slowdown = 0;      // busy_step_s / idle_step_s
  // What the steps' share predicts for busy_slowdown, at worst: 1 + (the disk's time for what the
  // writer moves, raw_move_s, if the state is on NVMe + writer_cpu_s) / (a round's busy steps x
  // idle_step_s): the steps wait for every second the writer holds the disk or a CPU.
  double predicted_busy_slowdown = 0;
  double busy_vs_predicted = 0;  // busy_slowdown / predicted_busy_slowdown
  // The run's own noise: (slowest - fastest) / median of the idle steps. A busy_vs_predicted
  // above 1 by less than this is within what two idle steps differ by.
  double idle_step_spread = 0;
  double idle_step_cpu_s = 0;  // process CPU time of an idle step (median)
  double writer_cpu_s = 0;     // process CPU time of the writer on an idle loop (median)
  double writer_busy_s = 0;    // the writer's time while steps ran
  double writer_paused_s = 0;  // of it, paused for the steps' I/O (sum over rounds)
  std::uint64_t writer_pauses = 0;
};

CheckpointBenchResult run_checkpoint_bench(const CheckpointBenchOptions& options);

}  // namespace strata::profile
