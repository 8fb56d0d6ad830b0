// The engine's own step measured (strata bench step, and the profiler's sample step): a one-rank
// Engine built from the config (offload.*, tiers.*, precision.*, optimizer.*, runtime.*; the rank
// holds `elements` parameters in one tensor), whose step() runs the one pipelined loop. Measured
// through the same loop and slots (zero/engine_access.hpp): t_read, t_update, t_write alone, the
// I/O of the step without the update (t_io, the device bound), the engine's step() pipelined and
// serial, and the peak resident set during the steps.
//
// Thread-safety: plain functions; each call builds and tears down its own engine (storage, swap
// files, I/O engine). Failure: as Engine (IoError, Error(kInvalidArgument / kBudget / kChecksum)).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/config.hpp"

namespace strata::profile {

struct StepBenchOptions {
  // The engine's config; world.ranks is taken as 1 (one rank measured, in-process). offload.*
  // says where the state lives, as in training.
  Config config;
  std::uint64_t elements = 0;  // optimizer elements of the rank
  int rounds = 3;              // measured rounds (medians), after one warm-up step
  bool serial = true;          // also measure the unpipelined step
};

struct StepBenchResult {
  std::uint64_t elements = 0;
  std::uint64_t state_bytes = 0;  // optimizer state streamed by the update (padded chunks)
  std::uint64_t pool_bytes = 0;   // buffers × buffer size actually allocated
  std::uint32_t buffers = 0;
  std::uint64_t buffer_size = 0;
  std::size_t chunks = 0;
  std::string io_engine;
  unsigned threads = 0;
  std::string update_on;  // "cpu", or the device's name with optimizer.update: device
  // Medians over rounds, seconds.
  double t_read = 0, t_update = 0, t_write = 0;
  // The step's update loop, pipelined. With state on NVMe it includes the statistics pass and
  // the agreement, which run as its gate while its first reads are in flight (stream_loop.hpp);
  // the serial loop does not (they run before it).
  double t_step = 0;
  double t_engine_step = 0;  // the whole Engine::step() (reduction, statistics pass, update)
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
  // Peak RSS while the steps ran (VmHWM reset after setup), and the part of it that scales with
  // the model by design: the bench's gradient source, and the parameters and gradients in "device
  // memory", which on the host-emulated device is host memory.
  std::uint64_t peak_rss_bytes = 0;
  std::uint64_t caller_held_bytes = 0;
};

StepBenchResult run_step_bench(const StepBenchOptions& options);

// The speculative update against the serial one (strata bench step --backward): a one-rank
// Engine at stage 2 (zero.stage 0-1 are raised to 2: only stages 2-3 speculate) holding
// `elements` parameters in `tensors` tensors, whose simulated backward hands the gradients in one
// tensor at a time, last first, the k-th at k * backward_s / tensors after it began (sleeping in
// between: no CPU spent; a hand-in that runs late delays the next), then calls step(). On a CUDA
// device the gradients are device memory, as a GPU backward leaves them: allocated and filled
// once (a copy on the bench's producer stream, not waited for), each handed in with
// set_gradient(id, grad, producer) on that stream; on the host-emulated device host memory,
// set_gradient_host. The device -> host bandwidth is measured in the same run, after the rounds
// (profile_internal.hpp measure_d2h_pinned), as the hand-ins' reference. Four
// engines: optimizer.overlap off (the serial step), on, on with clipping forced every step
// (clip_grad_norm with a tiny max norm: every speculated chunk rolled back: the rollback's cost),
// and auto with clipping forced (auto stops speculating after two rollbacks in four steps: what a
// run that clips every step pays). Each of the last three runs one warm-up step, then `rounds`
// rounds, each right after a round of a serial engine (overlap off; for the two that clip, one
// that clips too: the same work): every ratio is the median of per-round ratios against the serial
// round beside it (a disk whose speed drifts during the run moves both). Two engines are alive at
// once.
struct OverlapBenchOptions {
  Config config;
  std::uint64_t elements = 0;
  // T; < 0 (auto): the serial step after the backward, measured in the round before (the serial
  // warm-up step's for the first).
  double backward_s = -1;
  std::size_t tensors = 32;
  int rounds = 3;
};

struct OverlapBenchResult {  // each member a field of `strata bench step --backward` --json
  std::uint64_t elements = 0;
  double backward_s = 0;  // T used (median over the overlapped rounds)
  // step() after the last gradient (the optimizer time not hidden by the backward), and the
  // whole backward + step().
  double serial_step_s = 0, serial_total_s = 0;
  double overlapped_step_s = 0, overlapped_total_s = 0;
  double exposed_s = 0;  // StepResult::exposed_s of the overlapped step
  // The caller's time in the hand-ins (set_gradient with the producer stream, or
  // set_gradient_host) during the simulated backward, per round.
  double serial_hand_in_s = 0, overlapped_hand_in_s = 0;
  // Where the handed-in gradients live: "device" (a CUDA engine) or "host" (the host-emulated
  // device); the bytes handed in per round (every tensor's gradient once, precision.grads), and
  // those bytes over the hand-in times above.
  std::string gradients;
  std::uint64_t hand_in_bytes = 0;
  double serial_hand_in_bytes_per_second = 0, overlapped_hand_in_bytes_per_second = 0;
  // The device -> pinned host copy bandwidth of the engines' GPU measured in this run
  // (d2h_copy_bytes per copy, min(hand_in_bytes, 256 MiB)); 0 on the host-emulated device.
  std::uint64_t d2h_copy_bytes = 0;
  double d2h_bytes_per_second = 0;
  // The results: the overlapped engine's FP32 master weights after its steps against the serial
  // engine's (the same steps from the same gradients): the speculative update is bitwise the
  // serial one; and the CRC32C of the serial engine's (every tensor in order), which is the same
  // for the same config and size whatever the device and wherever the gradients live.
  bool overlapped_equals_serial = false;
  std::uint32_t serial_master_crc32c = 0;
  // The serial step with clipping forced (the reference of the two below).
  double serial_clip_step_s = 0, serial_clip_total_s = 0;
  double rollback_step_s = 0, rollback_total_s = 0;    // clipping forced, overlap on
  double auto_clip_step_s = 0, auto_clip_total_s = 0;  // clipping forced, overlap auto
  std::uint64_t auto_clip_rolled_back_steps = 0;       // of its warm-up step and rounds
  std::uint64_t speculated_chunks = 0, committed_chunks = 0, rolled_back_chunks = 0;  // per step
  // Where the overlapped engine's last step updated its elements (optimizer.update auto on a GPU
  // splits each host-state chunk between the CPU and the device: zero/update_split.hpp); the CPU
  // alone otherwise (device 0).
  std::uint64_t update_cpu_elements = 0, update_device_elements = 0;
  int rounds = 0;  // of each variant, each alternating with a round of the serial step
  // Medians over the rounds of each round's ratio to the serial round run just before it:
  // exposed / serial step; backward + step / max(T, serial step) (and the serial round's own);
  // backward + step with clipping forced under on, and under auto, / the serial backward + step
  // with clipping forced.
  double exposed_ratio = 0, total_ratio = 0, serial_total_ratio = 0;
  double rollback_ratio = 0, auto_clip_ratio = 0;
  // What clipping costs (issue 49, point 4): the step after the last gradient of the serial engine
  // that clips / the serial engine that does not, and backward + step under auto with clipping
  // forced / under on without it — each the median over the rounds of round i of one against round
  // i of the other (the same run, not side by side: they belong to different variants' rounds).
  double clip_serial_ratio = 0, clip_overlapped_ratio = 0;
  // The overlap-on rounds one by one, in order (the spread the medians hide): T, the serial step
  // of the round, the overlapped step's exposed time and its backward + step.
  std::vector<double> backward_s_rounds, serial_step_s_rounds, exposed_s_rounds,
      overlapped_total_s_rounds;
};

OverlapBenchResult run_overlap_bench(const OverlapBenchOptions& options);

}  // namespace strata::profile
