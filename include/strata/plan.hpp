// The planner: what a configuration puts in each tier, what crosses each link per optimizer step,
// and whether it fits the tier budgets. A pure function of a Config (no I/O, no devices).
//
// Per rank it counts what the engine's TierStore holds (src/zero/engine_layout.cpp): the model
// state in each tier, the pinned staging pool in host memory, and the engine's runtime buffers in
// device memory (gradient buckets and their receive buffers, stage-3 gathered tensors and send
// slices, the norm exchange, collective staging), each with the formula the engine allocates by.
// Activations are estimated separately (when the model shape is given). Not counted: the CUDA
// context, NCCL's own buffers, allocator overhead (Plan::assumptions says so in words). Formulas:
// docs/config.md "The plan"; tests/zero/test_plan_agreement.cpp checks them against the engine.
//
// Thread-safety: make_plan() is reentrant; Plan is a plain value.
// Failure: make_plan() expects a validated Config (load_config/parse_config); it does not throw
// for any Config those accept. Figures beyond 2^64 bytes saturate and never fit.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "strata/config.hpp"

namespace strata {

// Bytes of model state per parameter, from the dtypes. The optimizer state is an FP32 master copy
// (4 B — kept whatever precision.params is: the engine's working parameters and its master are two
// arrays, fp32 ones included, as in DeepSpeed) plus Adam's two FP32 moments (2 x 4 B).
// fp16/fp16: 2 + 2 + 12 = 16; bf16/fp32: 2 + 4 + 12 = 18; fp32/fp32: 4 + 4 + 12 = 20.
struct BytesPerParam {
  std::uint64_t params = 0;
  std::uint64_t grads = 0;
  std::uint64_t master = 0;
  std::uint64_t moments = 0;
  std::uint64_t optimizer() const { return master + moments; }
  std::uint64_t total() const { return params + grads + optimizer(); }
};
BytesPerParam bytes_per_param(const PrecisionConfig& precision);

// Bytes of each kind of model state (per rank unless said otherwise).
struct StateBytes {
  std::uint64_t params = 0;
  std::uint64_t grads = 0;
  std::uint64_t optimizer = 0;
  std::uint64_t total() const { return params + grads + optimizer; }
};

// Bytes in each tier. Host memory is split into page-locked (pinned) and pageable.
struct TierBytes {
  std::uint64_t gpu = 0;
  std::uint64_t pinned_host = 0;
  std::uint64_t pageable_host = 0;
  std::uint64_t nvme = 0;
  std::uint64_t host() const;  // saturating (figures beyond 2^64 bytes never fit)
  std::uint64_t total() const;
  TierBytes& operator+=(const TierBytes& o);
};

// One ZeRO stage's per-rank model state, nothing offloaded. Elements per rank: the sharded kinds
// hold ceil(parameters / ranks) elements (stage >= 1: optimizer, >= 2: gradients, 3: params).
struct StageFootprint {
  int stage = 0;
  std::uint64_t param_elements = 0;
  std::uint64_t grad_elements = 0;
  std::uint64_t optimizer_elements = 0;
  StateBytes bytes;
};
StageFootprint stage_footprint(const Config& config, int stage);

// Bytes crossing each link per optimizer step, for one rank.
struct LinkTraffic {
  std::uint64_t nvme_read = 0;
  std::uint64_t nvme_write = 0;
  std::uint64_t host_to_device = 0;
  std::uint64_t device_to_host = 0;
  std::uint64_t network = 0;  // sent by one rank in the collectives (ZeRO paper volume)
};

// One tier's use against its budget.
struct TierVerdict {
  std::string tier;   // "gpu" | "host" | "pinned_host" | "nvme"
  std::string scope;  // "rank" (gpu) or "node" (host, pinned_host, nvme)
  std::uint64_t used = 0;
  std::uint64_t budget = 0;  // 0 with limited == false: no budget (nvme without tiers.nvme.budget)
  bool limited = true;
  bool fits() const { return !limited || used <= budget; }
  std::uint64_t overflow() const { return fits() ? 0 : used - budget; }
};

// The engine's pinned staging pool per rank (host memory, page-locked, in the TierStore's host
// usage): it exists when any state is off the gpu or the device is a GPU (runtime.device cuda or
// auto: the plan is for a machine with GPUs); `buffers` = min(buffer_count, chunks of the rank's
// optimizer range), each tiers.host.buffer_size, unless the whole range is smaller than one
// chunk (then sized to the largest chunk's staging need). docs/config.md "Pinned pool".
struct PoolPlan {
  bool used = false;
  std::uint32_t buffers = 0;
  std::uint64_t buffer_size = 0;
  std::string why;  // "state off the gpu", "the device is a GPU (runtime.device auto)", or why not
  std::uint64_t largest_host_chunk = 0;  // elements of the largest chunk updated on the host
  // Bytes one slot of the device update loop stages: a chunk whose state is on the gpu while its
  // gradients (stages 2-3) or parameters (stage 3) are not; each part padded to 4096. 0: none.
  std::uint64_t device_slot = 0;
  // Stages 2-3 on a GPU with gradients off it, train.accumulate > 1 or grad_accum != grads: the
  // gradient shares pass a page-locked staging buffer on their way device -> host, min(B, P,
  // 64 MiB / grad bytes) x grad bytes (B, P: RuntimeBuffers below). 0: none.
  std::uint64_t share_staging = 0;
  std::uint64_t bytes() const;  // buffers x buffer_size + share_staging (0 when !used)
};
PoolPlan plan_pool(const Config& config, int stage, const OffloadConfig& offload);

// The engine's runtime buffers in device memory per rank (rt.* in the TierStore), at their peak
// (docs/config.md "Runtime buffers"). B = zero.reduce_bucket_size elements, L = the elements of
// one gather call (model.largest_layer, else estimated from hidden_size as one transformer block,
// 12h^2 + 13h; 0 when neither is given), P = the rank's partition (ceil(parameters / ranks)
// rounded up to 64), F = ranks x P.
struct RuntimeBuffers {
  // Stages 2-3: min(ceil(F / B), 3) buckets (two in flight, one being filled) and as many
  // receive buffers (two in flight, one copying its share out); one rank without gradients on
  // nvme: min(ceil(F / B), 6) buckets, each its own receive buffer, and none of those.
  std::uint64_t bucket_count = 0;
  std::uint64_t buckets = 0;        // bucket_count x min(B, F) x grad bytes (rt.bucket.<n>)
  std::uint64_t receive_count = 0;  // see bucket_count
  std::uint64_t receive = 0;        // receive_count x min(B, P) x grad bytes (rt.recv.<n>)
  std::uint64_t layer = 0;          // L
  bool layer_estimated = false;     // L from hidden_size, not model.largest_layer
  std::uint64_t gathered = 0;       // stage 3: 2 x L x param bytes (the call + the prefetched next)
  std::uint64_t send = 0;           // stage 3: 2 x min(L, P) x param bytes (their own slices)
  std::uint64_t norm = 0;           // 16 x (ranks + 1) (rt.norm)
  std::uint64_t staging = 0;        // ranks > 1: finalize()'s broadcast staging (rt.xfer),
                                    // min(F, 2^24) x 4
  std::uint64_t adam_scratch = 0;   // optimizer.update device with state off the gpu: the
                                    // device update's copy of the largest host chunk C (auto
                                    // on a GPU: C = min(it, update_window_elements)),
                                    // 3 x pad(4C) + pad(C x grad) + pad(C x param), pad = 256 B
  std::uint64_t update_slots = 0;   // state on the gpu with its gradients or stage-3 parameters
                                    // off it: the device update loop stages those parts in
                                    // tiers.host.buffer_count slots of PoolPlan::device_slot
  std::uint64_t hand_in_staging = 0;  // stages 0-1 on a GPU with train.accumulate > 1 or
                                      // grad_accum != grads: a hand-in from host memory is
                                      // staged in min(F, B, 64 MiB / grad bytes) x grad bytes
  std::uint64_t step() const;         // buckets + receive + gathered + send + norm + adam_scratch
                                      // + update_slots + hand_in_staging
  std::uint64_t total() const;        // step() + staging: what the plan counts on the gpu
};
RuntimeBuffers runtime_buffers(const Config& config, int stage, const OffloadConfig& offload);

// Whether `config`'s host-state updates are shared with a GPU's Adam (optimizer.update auto with a
// runtime.device that may be a GPU: cuda or auto; docs/offload.md "Where the update runs").
bool update_split(const Config& config);

// optimizer.update auto on a GPU: the elements of one chunk (`whole`) the device side of the split
// may take within tiers.gpu.update_window bytes (`window`; 0: the whole chunk) — DeviceAdam's
// staging of master and moments (FP32), gradients (`grad_bytes` each) and the parameter copy
// (`param_bytes` each), each array padded to 256 B. At least 1 when `whole` is not 0.
std::uint64_t update_window_elements(std::uint64_t window, std::uint64_t grad_bytes,
                                     std::uint64_t param_bytes, std::uint64_t whole);

// Whether the FP32 master weights of the optimizer state in memory (placed on gpu or cpu, not
// nvme) are the parameters themselves (docs/offload.md, "One copy of the weights"): stages 0-1,
// and stage 2 where nothing can be speculated (optimizer.overlap off, optimizer.update device, or
// no state off the gpu: `optimizer`, the placement of the state — the config's for the engine, a
// ladder rung's for the plan), precision.params fp32, on the host-emulated device (`device`:
// runtime.device as the engine resolved it; the plan passes the configured one, where auto may be a
// GPU). There the parameters are host memory holding exactly the master's values, so the engine
// keeps one copy: the update runs on the parameters and the state holds Adam's two moments only (8
// bytes a parameter, not 12).
bool master_in_params(const Config& config, int stage, const OffloadTarget& optimizer,
                      DeviceKind device);

// Whether each gradient handed in goes straight into the gradient chunks, with no bucket buffers
// (docs/offload.md, "Gradient buckets"): stages 2-3 on one rank (`ranks`; a sum over one rank is
// its own values, so there is nothing to reduce), no gradient on nvme (`grads_on_nvme`: those are
// assembled in pool buffers), optimizer.overlap off (nothing is speculated, so the backward need
// not go on while a copy out runs: the hand-in waits for its copy), on the host-emulated device
// (`device` as for master_in_params: a GPU's hand-in does not wait for the device). The engine and
// strata plan then count no bucket buffer: the gradients' only copy is the chunks.
bool hand_in_to_chunks(const Config& config, int stage, int ranks, bool grads_on_nvme,
                       DeviceKind device);

// A stage + offload choice worked out in full.
struct Layout {
  int stage = 0;
  OffloadConfig offload;
  StageFootprint footprint;
  StateBytes on_gpu, on_host, on_nvme;  // per rank, by kind of state
  // The master weights of the state in memory are the parameters (master_in_params):
  // on_gpu.optimizer and, for a cpu share, on_host.optimizer count the moments only.
  bool master_in_params = false;
  PoolPlan pool;           // the pinned staging pool (in pinned_host)
  RuntimeBuffers runtime;  // the engine's runtime buffers (in gpu)
  // Swap space reserved for the pinned versions of asynchronous checkpoints
  // (tiers.nvme.snapshot_room x the optimizer state on nvme, within the budget; in per_rank.nvme).
  std::uint64_t snapshot_room = 0;
  // The speculative update's pending versions at most (optimizer.overlap on / auto where it
  // speculates, docs/offload.md; within optimizer.speculation_budget): the off-gpu optimizer state
  // (pageable host, nvme) and the parameters it writes (stages 1-2: the flat parameters, gpu;
  // stage 3: in the parameters' tier). In per_rank.
  TierBytes speculation;
  TierBytes per_rank;   // state + pool (pinned host) + runtime buffers (gpu) + snapshot room (nvme)
  TierBytes per_node;   // per_rank x ranks on the fullest node
  LinkTraffic traffic;  // per rank per optimizer step
  std::vector<TierVerdict> verdicts;  // gpu, host, pinned_host, nvme (of per_rank / per_node)
  bool fits() const;
  std::string describe() const;  // "stage 2, optimizer on cpu"
};
Layout plan_layout(const Config& config, int stage, const OffloadConfig& offload);

// Activation memory per rank, Korthikanti et al. 2022 (16-bit activations, no tensor or sequence
// parallelism): per layer s*b*h*(34 + 5*a*s/h) bytes. With full checkpointing only each layer's
// input (2*s*b*h bytes) is kept, plus one layer's full activations during recomputation.
struct ActivationEstimate {
  bool available = false;  // model shape given
  std::uint64_t per_layer = 0;
  std::uint64_t without_checkpointing = 0;
  std::uint64_t with_checkpointing = 0;
  // With `gpu_bytes` (the layout's gpu figure: model state + runtime buffers) within
  // tiers.gpu.budget.
  bool fits_without_checkpointing = false;
  bool fits_with_checkpointing = false;
};
ActivationEstimate estimate_activations(const Config& config, std::uint64_t gpu_bytes);

// One rung of the recommendation ladder: a stage + offload choice, what the engine holds for it
// (the Layout: model state, pool, runtime buffers — stage-3 gathered layers among them) and what
// the GPU must also hold: activations (when the model shape is given; with full activation
// checkpointing when that is what it takes to fit).
struct Rung {
  Layout layout;
  std::uint64_t activations = 0;  // per rank, as counted (0 without a model shape)
  bool checkpointing = false;     // activations counted with full checkpointing
  std::uint64_t gpu_total = 0;    // layout.per_rank.gpu (state + runtime) + activations
  bool fits = false;              // every budget, the gpu one with gpu_total
  std::string verdict;            // "fits" or which budget overflows, by how much
};

// The ladder, in order (docs/config.md "Recommendation"): lowest stage first, then least offload;
// every rung that keeps all state off NVMe comes before any rung that uses NVMe:
//   stage 0; stage 1; stage 2, + optimizer on cpu, + gradients on cpu; stage 3, + optimizer on
//   cpu, + gradients on cpu, + params on cpu; then stage 2 optimizer on nvme (+ gradients on cpu);
//   stage 3 optimizer on nvme (+ gradients on cpu, + params on cpu); stage 3 everything on nvme.
// Stage 1 with offload is not a rung: stage 2 with the same offload moves the same bytes and needs
// less GPU memory. Fractions are 1 and host memory pageable on every rung.
std::vector<std::pair<int, OffloadConfig>> ladder_rungs();
Rung evaluate_rung(const Config& config, int stage, const OffloadConfig& offload);

struct Recommendation {
  bool found = false;
  Layout layout;               // valid when found
  bool checkpointing = false;  // the recommended rung needs full activation checkpointing
  std::string reason;          // why this one (or why nothing fits)
  std::vector<Rung> ladder;    // every rung, in ladder order, with its verdict
};
// The one recommender (`strata plan` and `strata profile`): the first rung of the ladder that
// fits. Pure; never throws for a validated Config.
Recommendation recommend(const Config& config);

// The machine's memory, for a plan whose config does not set tiers.host.budget. MemTotal, not
// MemAvailable: the budget is what the node can hold (as tiers.gpu.budget is the GPU's size), and
// the same config plans the same on the same machine whatever else runs or sits in the page cache
// right now; a config leaves room for the OS and other processes by setting tiers.host.budget.
// Where the process runs in a cgroup with a memory limit below MemTotal (a container, a Slurm job,
// a systemd unit), the limit: the kernel stops the process there whatever the node holds.
struct MachineMemory {
  bool known = false;
  std::uint64_t total = 0;  // bytes (MemTotal, or the cgroup's limit where lower)
  // "MemTotal in /proc/meminfo", "the memory limit of this process's cgroup, <file>, below
  // MemTotal's 64 GiB", or why it could not be read.
  std::string source;
};
// Reads MemTotal from `meminfo` (the /proc/meminfo format) and the memory limit of the process's
// cgroup: its line in `proc_cgroup` (/proc/self/cgroup: "0::/path" for cgroup v2, "N:memory:/path"
// for v1), found under the hierarchy's mount in `mountinfo` (/proc/self/mountinfo); the lowest of
// memory.max (v2) / memory.limit_in_bytes (v1) from that cgroup up to the mount. The planner's
// only I/O; never throws; bounded reads.
MachineMemory read_machine_memory(const std::string& meminfo = "/proc/meminfo",
                                  const std::string& proc_cgroup = "/proc/self/cgroup",
                                  const std::string& mountinfo = "/proc/self/mountinfo");

// The host budget a plan checks against, and where it came from.
struct HostBudget {
  enum class Source { kConfig, kMachine, kDefault };
  Source source = Source::kConfig;
  std::uint64_t bytes = 0;
  // "1 TiB (tiers.host.budget)", "the machine's 23.4 GiB (25.1 GB; MemTotal in /proc/meminfo;
  // tiers.host.budget not set)", or "the default 512 GiB (tiers.host.budget not set; ...)".
  std::string text;
};
const char* host_budget_source_name(HostBudget::Source s);  // "config" | "machine" | "default"

struct Plan {
  HostBudget host_budget;  // what the host verdicts are against
  std::uint64_t parameters = 0;
  std::uint32_t ranks = 1;
  std::uint32_t ranks_per_node = 1;  // ranks on the fullest node
  std::uint32_t nodes = 1;
  BytesPerParam bytes_per_param;
  std::array<StageFootprint, 4> stages;  // stages 0-3 side by side, nothing offloaded
  Layout configured;                     // the configured stage and offload
  ActivationEstimate activations;
  // The configured layout fits: model state, pool and runtime buffers within every budget and,
  // when the model shape is given, + activations on the gpu (with checkpointing if needed).
  // `strata plan --check` exits 3 when false.
  Rung configured_rung;
  bool configured_fits() const { return configured_rung.fits; }
  Recommendation recommendation;
  std::vector<std::string> assumptions;
  std::vector<std::string> notes;  // e.g. activations, not model state, do not fit
};
// Pure: the config's host budget as it stands (its default 512 GiB when tiers.host.budget is not
// set; host_budget says so).
Plan make_plan(const Config& config);
// `strata plan`: tiers.host.budget not set, the machine's memory is the host budget (every verdict
// and rung of the ladder); not known, the default, and host_budget says the memory was not read.
Plan make_plan(const Config& config, const MachineMemory& machine);

}  // namespace strata
