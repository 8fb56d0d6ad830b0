// The ZeRO engine: what a data-parallel training loop embeds. One Engine per rank, built from a
// Config (zero.*, precision.*, optimizer.*, offload.*, tiers.*, runtime.*) and a Communicator
// (borrowed).
//
// Memory. The engine keeps every byte of the rank's training state in its one storage layer: the
// FP32 master weights and Adam moments, the gradients and the parameters, each in the tier
// offload.* names (gpu = device memory of device(), cpu = host memory, nvme = swap files under
// tiers.nvme.paths; `fraction` of it there, the rest on gpu), within the tiers.* budgets
// (gpu per rank; host, pinned and nvme per node, divided among the node's ranks). Parameters in
// the model dtype (stages 0-2: all of them; stage 3: the gathered ones) and the gradients handed
// in are device memory of device().
// Device and communicator go together: collectives run where the buffers live. runtime.device
// auto picks the CUDA device of the rank's local ordinal (LOCAL_RANK, the MPI launchers' local
// rank, else rank modulo world.ranks_per_node) for a device-buffer communicator (NCCL), and the
// host-emulated device (whose "device memory" is host memory) for a host-buffer one (in-process,
// MPI). runtime.device cuda with a host-buffer communicator, or host with NCCL, is refused at
// construction with Error(kUnsupported).
//
// Which memory each call's pointers may be (a GPU engine: device() is CUDA). The engine checks
// what the CUDA runtime can tell (cudaPointerGetAttributes, strata/device_query.hpp) and throws
// Error(kInvalidArgument) naming the call, the tensor and the memory instead of touching memory it
// cannot (host code reading device memory dies with SIGSEGV; a kernel reading pageable host memory
// faults the device):
//   host memory only (host code copies it): add_parameter's initial values, read_state's `out`,
//     write_state's `in`, read_param's `out`, the checkpoint model's extra tensors;
//   device memory of device(), or host memory (staged through a bounded buffer, synchronous):
//     set_gradient (all overloads), set_gradients, set_gradient_host; device memory of another
//     GPU is refused;
//   device memory of device() (read by torch's kernels, written by the engine's): param(id).
// On the host-emulated device every pointer is host memory and nothing is checked.
//
// Life cycle, on every rank in the same order:
//   Engine e(config, comm);
//   auto w = e.add_parameter("w1", initial_values);  ... (all tensors)
//   e.finalize();                        // partitions; rank 0's initial values win everywhere
//   loop:
//     e.gather(ids) / e.release(ids)     // stage 3 only (no-ops otherwise): full tensors on demand
//     forward with e.param(id) (model dtype, precision.params), loss *= e.loss_scale()
//     backward: e.set_gradient(id, grad) per tensor as it is produced (precision.grads dtype)
//     e.step()                           // reduce, norm/clip, overflow check, Adam, params back
//
// Stages (zero.stage):
//   0: every rank keeps everything; gradients are all-reduced at step(); each rank runs Adam on
//      all parameters.
//   1: optimizer state sharded; gradients are reduce-scattered at step() (the part of an
//      all-reduce a rank needs: 1 Ψ of traffic instead of 2), each rank updates its partition,
//      parameters are all-gathered (1 Ψ).
//   2: + gradients sharded: gradients are reduce-scattered in buckets of zero.reduce_bucket_size
//      elements as soon as a bucket is complete, overlapping the rest of backward; only the own
//      partition of the gradients is kept (plus the buckets in flight).
//   3: + parameters sharded: each rank keeps only its partition of the parameters;
//      gather(ids) all-gathers full tensors until release(ids). After the first step the engine
//      replays the order of gather() calls and prefetches the next call's tensors asynchronously;
//      prefetch(ids) does the same on request.
// Traffic per rank and step (Ψ = padded element count × element size, N ranks, ring-equivalent
// bytes): stages 0–2 2Ψ(N−1)/N, stage 3 3Ψ(N−1)/N when the loop gathers each tensor once in
// forward and once in backward; plus 16(N−1) bytes for the norm/overflow exchange.
//
// The step: the global gradient norm over all ranks (gradients averaged over ranks and unscaled),
// clipping to optimizer.grad_clip, an overflow (inf/NaN anywhere) agreed by all ranks; on
// overflow the step is skipped on every rank and the dynamic loss scale backs off; otherwise Adam
// (strata/adam.hpp) runs on the rank's partition chunk by chunk (sub-groups of
// zero.sub_group_size elements, cut to what one pinned buffer stages), streamed: the next chunks'
// state read ahead from NVMe, the CPU kernel for state on cpu/nvme (the device kernel for state on
// gpu), the parameters written behind in the model dtype to the device; stages 1-2 then
// all-gather them on the device.
// Loss scaling (precision.loss_scale) applies to fp16 gradients; bf16 and fp32 gradients are not
// scaled (scale 1, as torch AMP and DeepSpeed) unless precision.loss_scale.enabled is true;
// non-finite gradients always skip the step.
// Determinism: with a host communicator the result is bitwise identical to a single rank running
// CpuAdam on the rank-ordered sum of the ranks' gradients (rounded to the gradient dtype), divided
// by N as torch averages (AdamStepOptions::grad_divisor = N), then times grad_scale =
// clip_coef / loss_scale, for every stage, world size and placement (state on
// gpu on the host-emulated device included; on CUDA the device kernel is written to the same
// operation order).
//
// Requirements on the loop: every rank registers the same tensors in the same order, and hands in
// gradients, calls gather/prefetch/release and step() in the same order (collectives are matched
// by order). Each tensor's gradient is handed in exactly once per step (set_gradient, or
// skip_gradient for a tensor the loss did not use; those may differ between ranks).
//
// Thread-safety: an Engine is driven by one thread. Failure: bad use (unknown id, gradient twice,
// gradient missing at step(), param() of an ungathered stage-3 tensor, calls before finalize())
// throws Error(kInvalidArgument); a budget that cannot hold the layout fails finalize() with
// Error(kBudget) naming the tier and buffer. Communication failures (timeouts, lost peers)
// propagate from the communicator as Error(kTimeout/kComm). An I/O error, checksum mismatch or
// device failure during set_gradient() or step() throws IoError / Error(kChecksum / kDevice)
// naming the buffer, the swap file, offset and errno; the rank's state may then mix two steps and
// the engine is failed: every later set_gradient / step / gather / read_state / write_state /
// checkpoint call throws Error(kIo) "unusable after a failed step". Destroy the engines and
// load_checkpoint() the last checkpoint (docs/offload.md, "Faults"). A failed read in a stage-3
// gather() changes nothing and may be retried.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "strata/checkpoint_model.hpp"
#include "strata/communicator.hpp"
#include "strata/config.hpp"
#include "strata/partition.hpp"

namespace strata {

class Device;
namespace zero {
struct EngineAccess;  // tests and measurements (src/zero/engine_access.hpp)
}

using TensorId = std::size_t;
// A native stream of the caller's, opaque here: a cudaStream_t of device() on a GPU (e.g.
// torch.cuda.current_stream().cuda_stream); nullptr is CUDA's legacy default stream (torch's
// default stream) of device(). On the host-emulated device only nullptr is accepted (host code
// is ordered by the call itself); another handle is Error(kInvalidArgument).
using StreamHandle = void*;
// A parameter group (torch's param_groups): its own learning rate, weight decay, betas and eps.
// Group 0 always exists and starts with optimizer.lr, .weight_decay, .betas and .eps; a beta or eps
// a group leaves unset is optimizer.*'s.
using GroupId = std::size_t;

struct ParamGroupOptions {
  double lr = 1.0e-3;
  double weight_decay = 0.0;
  std::optional<double> beta1, beta2, eps;  // unset: optimizer.betas / optimizer.eps
};

// Which FP32 optimizer array of a tensor (read_state / write_state).
enum class StateKind { kMaster, kExpAvg, kExpAvgSq };
const char* state_kind_name(StateKind kind);  // "master" | "exp_avg" | "exp_avg_sq"

// One write of Engine::write_states: tensor `id`'s array `kind` from `in` (numel(id) elements).
struct StateWrite {
  TensorId id = 0;
  StateKind kind = StateKind::kMaster;
  std::span<const float> in;
};

struct StepResult {
  bool applied = false;  // false: skipped for an overflow
  bool overflow = false;
  double grad_norm = 0;   // global, of the averaged, unscaled gradients (before clipping)
  double clip_coef = 1;   // applied to the gradients (1 when no clipping)
  double loss_scale = 1;  // the scale for the next step
  // The speculative update (optimizer.overlap, docs/offload.md): chunks of the rank's state
  // updated during the backward into pending versions, of which committed (no clip, no overflow)
  // or rolled back (discarded: at step(), or before it by a change of the state or the
  // hyper-parameters, a micro-batch beyond the expected ones, dropped gradients; the serial update
  // ran instead). speculated = committed + rolled_back.
  std::uint32_t speculated_chunks = 0, committed_chunks = 0, rolled_back_chunks = 0;
  // Seconds from the last gradient handed in (or from step()'s start, if later) to the end of
  // step(): the optimizer time the backward did not hide.
  double exposed_s = 0;
};

struct EngineStats {
  double loss_scale = 1;
  std::uint64_t steps = 0;          // step() calls
  std::uint64_t applied_steps = 0;  // Adam updates (the optimizer's step count)
  std::uint64_t skipped_steps = 0;  // overflows
  double last_grad_norm = 0;
  CommStats comm;  // bytes sent and calls per collective kind, since construction
  // Stages 2-3: gradient buckets reduced, since construction (a reduce-scatter issued; one rank
  // issues none: its bucket is its own share).
  std::uint64_t buckets_reduced = 0;
  // Seconds spent, summed over steps, per phase.
  double reduce_s = 0;  // gradient all-reduce / reduce-scatter (issue + waits)
  double grad_spill_s =
      0;              // of which: writing the NVMe share of the gradients (offload.gradients nvme)
  double norm_s = 0;  // gradient statistics and their exchange
  double optimizer_s = 0;  // Adam over the sub-groups
  double gather_s = 0;     // parameter all-gather after the step, and stage-3 gathers
  double step_s = 0;       // whole step() calls
  // Seconds the caller was blocked by checkpoints: whole blocking saves; for asynchronous ones,
  // the snapshot, the waits for the writer (its commit, or a step making room) and the commit.
  double checkpoint_blocked_s = 0;
  // The speculative update, summed over steps (see StepResult).
  std::uint64_t speculated_chunks = 0, committed_chunks = 0, rolled_back_chunks = 0;
  double exposed_s = 0;
};

// Engine::save_checkpoint: wait for the whole save, or snapshot and write in the background.
enum class SaveMode { kBlocking, kAsync };

class Engine {
 public:
  // `comm` is borrowed and must outlive the engine. Throws Error(kUnsupported) when runtime.device
  // cannot go with the communicator's buffers (see "Device and communicator").
  Engine(const Config& config, Communicator& comm);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Before finalize(): registers a tensor with its initial FP32 values (copied), in parameter
  // group `group` (0, or an id from add_param_group). Unknown group: Error(kInvalidArgument).
  TensorId add_parameter(std::string name, std::span<const float> initial, GroupId group = 0);
  // The same without the copy: `initial` is the caller's memory, read by finalize() and required to
  // stay valid and unchanged until finalize() returns (a training loop whose model already holds
  // the values: start-up holds no second copy of the model). Host memory, as add_parameter's.
  TensorId add_parameter_borrowed(std::string name, std::span<const float> initial,
                                  GroupId group = 0);
  // Before finalize(): a new parameter group; returns its id (1, 2, ...). lr >= 0 and
  // weight_decay >= 0, else Error(kInvalidArgument).
  GroupId add_param_group(const ParamGroupOptions& options);
  std::size_t num_groups() const;
  GroupId group_of(TensorId id) const;

  // The learning rate of a group, used by the next step() (torch LR schedulers set it between
  // steps). Any time, on every rank alike; lr >= 0 (Error(kInvalidArgument) otherwise).
  void set_lr(double lr, GroupId group = 0);
  double lr(GroupId group = 0) const;
  void set_weight_decay(double weight_decay, GroupId group = 0);
  double weight_decay(GroupId group = 0) const;
  // Adam's betas and eps of a group, any time like set_lr (torch's OneCycleLR and CyclicLR cycle
  // beta1 per step): 0 <= beta < 1, eps >= 0 (Error(kInvalidArgument) otherwise).
  void set_betas(double beta1, double beta2, GroupId group = 0);
  std::pair<double, double> betas(GroupId group = 0) const;
  void set_eps(double eps, GroupId group = 0);
  double eps(GroupId group = 0) const;
  // Builds the partition and the state; rank 0's initial values are broadcast to all ranks.
  void finalize();

  int stage() const;
  DType param_dtype() const;           // precision.params
  DType grad_dtype() const;            // precision.grads
  const Partition& partition() const;  // after finalize()
  std::size_t numel(TensorId id) const;

  // The device the engine's parameters and gradients live on (runtime.device resolved against the
  // communicator): a CUDA GPU, or the host-emulated device, whose "device memory" is host memory.
  // After finalize().
  Device& device();

  // The tensor's current parameters in the model dtype (numel(id) elements), in device() memory.
  // Stages 0–2: always valid, at the same address for the engine's lifetime (a training loop may
  // alias its model tensors to it), updated in place by step() and load_checkpoint(). Stage 3:
  // valid between gather() and release().
  const void* param(TensorId id) const;
  // The same, converted to FP32 into `out` (numel(id) elements).
  void read_param(TensorId id, std::span<float> out) const;
  // Whether the parameters are the FP32 master weights themselves for every element this rank
  // updates (stages 0-1, precision.params fp32, the host-emulated device, state not on nvme:
  // docs/offload.md, "One copy of the weights"): the update runs on param()'s memory, and a write
  // into it is a write of the master (write_state(kMaster) need not follow). After finalize().
  bool params_are_master() const;
  // Stages 0-1: the tensor's gradient as this rank holds it in the current step — what its
  // hand-ins put there (the micro-batches' sum, this rank's own: step() reduces it across the ranks
  // in place), numel(id) elements in precision.grad_accum, in device() memory, at the same address
  // for the engine's lifetime. Its contents are defined from the tensor's hand-in in a step until
  // step() or discard_gradients(); a write into it then changes what step() uses. Stages 2-3:
  // nullptr (the gradients are bucketed and reduce-scattered, no per-tensor copy is kept).
  const void* gradient(TensorId id) const;

  // Stage 3: make full tensors available (blocking) / start doing so / drop them. No-ops at
  // stages 0–2. Gathering a gathered tensor is a no-op; releasing a released one too.
  void gather(std::span<const TensorId> ids);
  void prefetch(std::span<const TensorId> ids);
  void release(std::span<const TensorId> ids);

  // The loss scale the loop multiplies its loss by (1 with fp32 gradients).
  double loss_scale() const;

  // Hands in one tensor's gradient (grad_dtype, numel(id) elements, scaled by loss_scale()); the
  // data is copied (on the device) before return. Gradient accumulation: once every tensor's
  // gradient arrived, handing one in again starts the next micro-batch, and the step's gradient is
  // the sum of the micro-batches', held in precision.grad_accum (the gradients' own dtype unless
  // fp32; each add one FP32 add rounded into it). A tensor handed in again before every tensor
  // arrived throws Error(kInvalidArgument), nothing changed. Where and in which order the sum is
  // formed: docs/offload.md, "Gradient accumulation". At stages 2–3 this may start a bucket's
  // reduce-scatter on the device, finish an earlier one and queue the copy of the rank's share of
  // it to where offload.gradients puts it (device→host on the storage's copy streams, then on to
  // NVMe) without waiting for it: a later set_gradient() or step() collects it, and a failure of
  // that copy is thrown there. Argument errors throw Error(kInvalidArgument) and change nothing;
  // a failed collective, copy or gradient write throws and leaves the engine failed: every later
  // set_gradient / step / checkpoint call throws Error(kIo) until a new engine loads a checkpoint
  // (docs/offload.md).
  // `grad` is device() memory (host memory on the host-emulated device).
  // Ordering (GPU): strata's copy streams are non-blocking, ordered after nothing the caller
  // queued. With this overload the work that wrote `grad` must be complete before the call (e.g.
  // torch.cuda.current_stream().synchronize()); the overload below takes the producer's stream.
  void set_gradient(TensorId id, const void* grad);
  // The same, with the producer's stream (see StreamHandle): the copy starts only after the work
  // queued on `producer` before this call (an event recorded on it, which strata's hand-off stream
  // waits on; the calling thread waits for that stream, then copies, and returns once the copy is
  // done, as above: no device-wide synchronisation, but the call blocks until the producer's
  // queued work is done). A hand-off that fails (the
  // producer's device failed, a timeout after runtime.collective_timeout_s, a stream of another
  // device: Error(kDevice / kTimeout / kInvalidArgument)) changes nothing.
  void set_gradient(TensorId id, const void* grad, StreamHandle producer);
  // The same without waiting for the GPU (a GPU backward's hand-in: the thread that queues the
  // backward's kernels returns at once). strata's gradient stream waits for the work queued on
  // `producer` so far (an event, no host wait) and the copy (or the accumulation) is queued after
  // it; the hand-in waits on the host only where the gradient completes a bucket (stages 2-3: its
  // collective reads it) — never per tensor otherwise — and step() / clip_grad_norm() /
  // discard_gradients() wait for the rest. `grad` (device memory of device()) must stay valid and
  // unchanged until the work queued on gradient_stream() by this call completes: torch:
  // g.record_stream(torch.cuda.ExternalStream(engine.gradient_stream())), which keeps the caching
  // allocator from handing g's memory out before. A copy that fails is thrown by the wait that
  // observes it and leaves the engine failed, as for set_gradient. Host memory, or the
  // host-emulated device: set_gradient(id, grad, producer) (copied before return).
  void set_gradient_async(TensorId id, const void* grad, StreamHandle producer);
  // The stream set_gradient_async's copies run on (a cudaStream_t of device()); nullptr on the
  // host-emulated device. After finalize().
  StreamHandle gradient_stream();
  // The same from host memory, whatever the device (a convenience: one host-to-device copy on a
  // GPU, synchronous).
  void set_gradient_host(TensorId id, const void* grad);
  // All tensors at once, grads[i] for tensor i in registration order (device() memory).
  void set_gradients(std::span<const void* const> grads);
  // Tensor `id` has no gradient on this rank in this micro-batch: the loss did not use it (torch's
  // p.grad is None; DDP's find_unused_parameters). It counts as handed in, with zeros: a tensor
  // some ranks used gets the others' zeros in its sum (as DDP's all-reduce). A tensor that no rank
  // used in any micro-batch of the step is skipped by that step's update, as torch.optim.AdamW
  // skips a parameter whose grad is None: no Adam update, no weight decay, its moments unchanged
  // and its own step count not advanced (optimizer_step(id); the bias correction of its later
  // updates uses that count). The ranks agree on which tensors every rank skipped inside step()
  // (one more exchange of a bit per tensor, only when some rank skipped one). Errors as
  // set_gradient's argument errors (unknown id, handed in again before every tensor arrived).
  void skip_gradient(TensorId id);

  // Between the last set_gradient() of a step and step() (collective: every rank alike): finishes
  // the reduction, agrees on the global L2 norm of the averaged, unscaled gradients and returns it
  // (+infinity when some rank's gradients overflowed: the step will be skipped); step() then scales
  // the gradients by min(1, max_norm / (norm + 1e-6)) — torch.nn.utils.clip_grad_norm_'s
  // coefficient — and by optimizer.grad_clip's too when that is set (the smaller applies). A
  // second call in the same step returns the same norm and clips to the smaller max_norm;
  // max_norm = +infinity only reads the norm. No set_gradient() may follow until step(). A missing
  // gradient or max_norm < 0 (or NaN) throws Error(kInvalidArgument) and changes nothing; any
  // other failure leaves the engine failed, as for step().
  double clip_grad_norm(double max_norm);

  // Drops the gradients handed in since the last step (torch's zero_grad between backward and
  // step; also after step() refused a missing gradient): the next set_gradient() starts the step
  // afresh. Starts no collective (those already in flight complete first); every rank should call
  // it at the same point, as every rank hands in the same gradients. A failure of a collective in
  // flight leaves the engine failed, as for set_gradient.
  void discard_gradients();

  // Reduces, checks and applies the step. A gradient missing from the (last) micro-batch throws
  // Error(kInvalidArgument) and changes nothing. Any other failure (collective, NVMe I/O, checksum,
  // device) throws it and leaves the engine failed, as for set_gradient; its state may mix two
  // steps.
  StepResult step();
  // The same, with the consumer's stream: the step first waits for the work queued on `consumer`
  // before the call (kernels still reading param() or the gradients), then runs as step(). The
  // update is complete on the device when step() returns (strata synchronises its own streams):
  // work the caller queues afterwards, on any stream, reads the new parameters. A hand-off that
  // fails changes nothing (as for set_gradient).
  StepResult step(StreamHandle consumer);

  EngineStats stats() const;

  // The optimizer state of one tensor, between steps (after finalize(), not inside a backward;
  // at stages 0-2 write_state also between a step's last gradient and step(): a speculative
  // update started from the old state is discarded, the step runs serially from the new one).
  // Both are collective: every rank calls them for the same tensors in the same order.
  // read_state: `out` (numel(id) elements) receives the tensor's FP32 master weights or moments,
  // gathered from the ranks that own them; every rank gets the whole tensor.
  // write_state: every rank passes the same whole tensor; each keeps the part it owns. Writing
  // kMaster also sets the model-dtype parameters (rounded to precision.params) on every rank.
  // Wrong sizes: Error(kInvalidArgument), nothing changed. A failed engine refuses (Error(kIo)).
  // A write that fails once it began writing (an I/O or checksum error in a later chunk) may leave
  // the state part written: it throws that error and the engine is failed from then on.
  void read_state(TensorId id, StateKind kind, std::span<float> out);
  void write_state(TensorId id, StateKind kind, std::span<const float> in);
  // Several write_state calls as one, in order (a later write of the same array wins): every
  // write is checked before any is made (a wrong size: Error(kInvalidArgument), nothing changed),
  // and each chunk of state on NVMe that the writes touch is read and written once, where a
  // write_state of each tensor reads and rewrites the chunk it lies in (a torch-style
  // load_state_dict of every tensor: 3 writes per tensor). Collective, as write_state.
  void write_states(std::span<const StateWrite> writes);
  // Adam's step count (torch's state["step"]): applied updates since the start or the checkpoint.
  std::int64_t optimizer_step() const;
  // Between steps, on every rank alike (load_state_dict); >= 0. Sets every tensor's count.
  void set_optimizer_step(std::int64_t step);
  // One tensor's own step count (torch's per-parameter state["step"]): the global count less the
  // steps whose update skipped the tensor (skip_gradient), or what set_optimizer_step(id, step)
  // set. Checkpoints keep them.
  std::int64_t optimizer_step(TensorId id) const;
  void set_optimizer_step(TensorId id, std::int64_t step);

  // Checkpoints (after finalize(), between steps, called by every rank in the same order; a load
  // between a step's gradients and step() is Error(kInvalidArgument), nothing changed:
  // discard_gradients() first).
  // save_checkpoint: each rank writes its shard (its parameters in the model dtype, FP32 master and
  // Adam moments wherever offload.* keeps them, step counts, loss scale) into `dir` through the
  // I/O engine; rank 0 then commits DIR/manifest.json (sizes, CRC32C per section, the config) by an
  // atomic rename, and only then removes the previous checkpoint's shards: a process killed during
  // a save leaves the previous checkpoint loadable. load_checkpoint: verifies the manifest and
  // every shard's checksums (all ranks agree before anything changes), then restores into the
  // tiers this engine's config names; resuming is bitwise identical to not stopping. The world
  // size and the stage (0-3) may differ from the saved ones: the load reshards, each rank reading
  // only what it holds; the tensors and precision.params must match (else Error(kInvalidArgument),
  // nothing changed). Failures: IoError / Error(kChecksum / kInvalidArgument), nothing changed,
  // unless the files change between verification and restore (the engine then refuses to step).
  // Layout and format: src/checkpoint/format.hpp, docs/offload.md.
  // Both also keep the parameter groups' lr, weight decay, betas and eps (restored by the load
  // when the group count matches; else kept, with a warning), and the embedder's client_state
  // (UTF-8 text of at most 1 MiB, e.g. JSON: its loop's step, data position, scheduler; rank 0's
  // is saved; else Error(kInvalidArgument), nothing written), committed with the checkpoint.
  // `model` (strata/checkpoint_model.hpp) records the tensors' model shapes and aliases and saves
  // the tensors the engine does not train, for `strata checkpoint export`; the load restores the
  // trained state only.
  void save_checkpoint(const std::string& dir, std::string_view client_state = {},
                       const CheckpointModel& model = {});
  // The same with a mode. kBlocking: as above. kAsync: returns once every rank agreed on the save
  // (directory, serial) and took its snapshot: the counters, loss scale, groups and client_state
  // captured, the parameters copied into host memory, the optimizer state pinned where it lives
  // (TierStore versioned state: no copy; a block rewritten by a later step keeps its pinned
  // version, on NVMe in a new swap slot, in memory as a copy counted against the tier's budget).
  // A background thread then writes the rank's shard (fdatasync) while training goes on. The save
  // is committed (rank 0 renames the manifest, once every rank's shard is durable) by the next
  // wait_checkpoint(), save_checkpoint() or load_checkpoint() — collective calls every rank makes
  // alike; a failure of the background writer on any rank is reported there (IoError naming the
  // path and errno, on every rank), the previous checkpoint stays loadable and the training state
  // is untouched. A step() whose copy-on-write would not fit in the tiers' budgets first waits for
  // this rank's writer (counted in EngineStats::checkpoint_blocked_s). The destructor waits for
  // the writer but does not commit: call wait_checkpoint() before it.
  // `model`'s untrained tensors are written by rank 0 during the call, whatever the mode (their
  // data is borrowed for the call only).
  void save_checkpoint(const std::string& dir, SaveMode mode, std::string_view client_state = {},
                       const CheckpointModel& model = {});
  // Waits for an asynchronous save and commits it (collective; nothing to do without one). Throws
  // the save's failure. Allowed on a failed engine (the snapshot predates the failure).
  void wait_checkpoint();
  // An asynchronous save has begun and not yet been committed by wait_checkpoint() & co.
  bool checkpoint_pending() const;
  void load_checkpoint(const std::string& dir);
  // The client_state of the checkpoint last loaded ("" before any load, or when it had none).
  const std::string& checkpoint_client_state() const;

 private:
  friend struct zero::EngineAccess;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
