// The offloaded optimizer step measured (strata bench step, and the profiler's sample step): all
// of a rank's optimizer state on NVMe, CPU Adam, the pinned pool of tiers.host; t_read, t_update,
// t_write alone, the pipelined step, the serial (unpipelined) step, overlap efficiency, and the
// peak resident set during the steps.
//
// Thread-safety: plain functions; each call builds and tears down its own store, swap files and
// I/O engine. Failure: as OffloadStateStore (IoError, Error(kInvalidArgument / kBudget)).
#pragma once

#include <cstdint>
#include <string>

#include "strata/config.hpp"

namespace strata::profile {

struct StepBenchOptions {
  // tiers.* (pool, NVMe paths and engine), precision.* (grads/params dtypes), optimizer.*,
  // zero.sub_group_size, runtime.cpu_threads; offload.* is ignored: everything goes to NVMe.
  Config config;
  std::uint64_t elements = 0;  // optimizer elements of the rank
  int rounds = 3;              // measured rounds (medians), after one warm-up step
  bool serial = true;          // also measure the unpipelined step
};

struct StepBenchResult {
  std::uint64_t elements = 0;
  std::uint64_t state_bytes = 0;  // on NVMe (padded chunks)
  std::uint64_t pool_bytes = 0;   // buffers × buffer size actually allocated
  std::uint32_t buffers = 0;
  std::uint64_t buffer_size = 0;
  std::size_t chunks = 0;
  std::string io_engine;
  unsigned threads = 0;
  std::string update_on;  // "cpu", or the device's name with optimizer.update: device
  // Medians over rounds, seconds.
  double t_read = 0, t_update = 0, t_write = 0;
  double t_step = 0;         // pipelined
  double t_step_serial = 0;  // read → update → write, one chunk at a time (0 if not measured)
  double t_update_in_step = 0, t_wait_read = 0, t_wait_write = 0;  // inside the pipelined step
  double overlap_efficiency = 0;  // max(t_read, t_update, t_write) / t_step (of the medians)
  // The same ratio per round (legs and step measured back to back), median over rounds: steadier
  // on a loaded machine.
  double overlap_efficiency_rounds = 0;
  // t_io: read ‖ write of every chunk with no update (the device's bound when reads and writes
  // share its bandwidth); device_efficiency = max(t_io, t_update) / t_step.
  double t_io = 0;
  double device_efficiency = 0;
  // Peak RSS while the steps ran (VmHWM reset after setup), and the part of it the caller holds
  // (gradients and model-dtype parameters, which scale with the model).
  std::uint64_t peak_rss_bytes = 0;
  std::uint64_t caller_held_bytes = 0;
};

StepBenchResult run_step_bench(const StepBenchOptions& options);

}  // namespace strata::profile
