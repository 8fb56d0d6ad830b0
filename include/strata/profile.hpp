// The profiler behind `strata profile`: measures what each link of the configured tiers costs on
// this machine (NVMe through the strata I/O engine, host <-> device copies, CPU/GPU Adam, memory
// bandwidth, collectives), predicts the optimizer-step time and the per-step transfer overhead
// from the plan's bytes per link (plan.hpp) with a cost model, checks the prediction against a
// real step on a sample of the configured state (NVMe swap through the TierStore + CpuAdam), and
// recommends I/O settings and a tier placement.
//
// The cost model (predict_step) is a pure function of a Config and measured Bandwidths; see
// docs/profile.md for the formulas.
//
// Ownership: run_profile() owns everything it creates (engines, files, a temporary NVMe directory
// when none is configured) and removes it before returning, also on failure.
// Thread-safety: run_profile() and predict_step() are reentrant; ProfileOptions::progress is called
// from the calling thread only.
// Failure: bad input (a configured NVMe path that is missing, not a directory, not writable, or on
// tmpfs with direct_io: required; bad options) throws Error(kInvalidArgument) naming the path and
// the reason before anything is measured. Failures while measuring propagate (IoError, Error).
// The GPU sections are skipped (reported, not failed) without a CUDA device; the host-emulated
// device never counts as a GPU.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "strata/config.hpp"
#include "strata/plan.hpp"

namespace strata {

class Communicator;
class Engine;

// How much to measure. kTiny is for tests (a few points, kilobytes to megabytes).
enum class ProfileMode { kTiny, kQuick, kDefault, kFull };
const char* profile_mode_name(ProfileMode m);  // "tiny" | "quick" | "default" | "full"

struct ProfileOptions {
  ProfileMode mode = ProfileMode::kDefault;
  // The communicator of a multi-process launch (mpirun: one profile process per rank), borrowed;
  // null = a single process. With it, every rank runs the same measurements at the same time
  // (so ranks on a node really share its disks, cores and memory bandwidth), the collectives are
  // measured over it, and the engine check runs a real multi-rank Engine step. Every rank must
  // call run_profile() with the same config and options.
  Communicator* comm = nullptr;
  // Processes of this launch on this node; 0 = count the ranks whose host name is this one's.
  std::uint32_t local_processes = 0;
  // Target transfer overhead per step (seconds) for the placement recommendation.
  double target_overhead_s = 1.0;
  // Times the sample step is run (each mode: serial and pipelined); the median is reported.
  std::uint32_t sample_repeats = 0;  // 0 = the mode's default
  // Progress lines ("nvme /tmp/x: write 1 MiB qd 32 io_uring x1 ... 1.2 GB/s"); may be empty.
  std::function<void(const std::string&)> progress;
};

// ---- environment
// ---------------------------------------------------------------------------------
struct PathInfo {
  std::string path;
  std::string filesystem;  // "ext4", "xfs", "tmpfs"...
  std::string device;      // mount source ("/dev/nvme0n1p1") or "" if unknown
  std::string mount_point;
  std::uint64_t free_bytes = 0;
  bool temporary = false;  // created by the profiler because no path was configured
};

struct Environment {
  std::string hostname, kernel, cpu_model;
  unsigned cores = 0;
  std::uint64_t memory_bytes = 0;
  // The page-lock limit that applies: RLIMIT_MEMLOCK's soft limit, ~0 when unlimited or when the
  // process holds CAP_IPC_LOCK (which lifts it).
  std::uint64_t memlock_limit_bytes = 0;
  std::string gpu;        // "cuda:0 NVIDIA H200 (...)" or "no GPU: <reason>"
  bool has_gpu = false;   // a CUDA device (never the host-emulated one)
  std::string adam_path;  // CPU Adam code path
  double load_average_1m = 0;
  std::vector<PathInfo> paths;
  std::string timestamp_utc;
};

// ---- measurements
// --------------------------------------------------------------------------------
struct IoPoint {
  std::string path;
  std::string engine;  // "io_uring" | "threads"
  std::string op;      // "read" | "write"
  std::uint64_t block_size = 0;
  std::uint32_t queue_depth = 0;
  std::uint32_t rings = 0;  // io_threads
  bool direct = false;      // O_DIRECT in effect
  std::uint64_t bytes = 0;  // moved during the timed part (all passes)
  double seconds = 0;
  double bytes_per_second = 0;   // median over the passes
  std::vector<double> runs_bps;  // each pass (the sweep alternates the order of the points)
};

struct CopyPoint {
  std::string direction;  // "host_to_device" | "device_to_host"
  bool pinned = false;
  std::uint64_t bytes = 0;
  double seconds = 0;  // per copy (best of the repeats)
  double bytes_per_second = 0;
};

struct AdamMeasure {
  bool measured = false;
  std::string skipped;  // reason when !measured
  std::string device;   // "cpu avx2 x2" / "cuda:0 ..."
  std::uint64_t elements = 0;
  double seconds = 0;  // per step (best of the repeats)
  double params_per_second = 0;
  double bytes_per_second = 0;  // state bytes touched per second (fp32 p, m, v rw + grads r)
  // CPU only: the same update out of place (the new state written beside the old, as the
  // speculative update writes a pending version), alternating with the in-place one: its time /
  // the in-place time, median of the pairs (0 = not measured).
  double out_of_place_factor = 0;
  // CPU only: a memcpy of a state array (one thread, as a tier store's mover copies), bytes/s.
  double host_copy_bytes_per_second = 0;
};

struct CollectivePoint {
  std::string collective;  // "reduce_scatter" | "all_gather"
  std::string backend;
  int ranks = 0;
  std::uint64_t bytes = 0;  // S: the full (gathered / pre-reduce) buffer per rank
  double seconds = 0;
  double algbw_bytes_per_second = 0;  // S / t
  double busbw_bytes_per_second = 0;  // algbw * (n - 1) / n (nccl-tests)
};

// ---- the cost model
// ------------------------------------------------------------------------------ Bandwidths per
// rank the model uses. 0 = not measured (the leg then costs nothing and a note says so), except
// that nvme/adam rates must be > 0 when the layout needs them.
struct Bandwidths {
  double nvme_read_bps = 0;  // through the tier store at the configured I/O settings
  double nvme_write_bps = 0;
  bool nvme_duplex = false;  // false: reads and writes share the devices (legs add up)
  // Read + write bytes per second when a read and a write-back run at the same time, as in the
  // pipeline's steady state; 0 = derive from the two rates above (duplex or not).
  double nvme_mixed_bps = 0;
  double h2d_bps = 0;  // pinned host -> GPU
  double d2h_bps = 0;
  double cpu_adam_params_per_s = 0;
  // CPU Adam over state resident in host memory (optimizer state in the cpu tier): a working set
  // beyond the caches, read from and written to memory; 0 = cpu_adam_params_per_s.
  double cpu_adam_memory_params_per_s = 0;
  double memory_adam_rate() const {  // the rate the model uses for host-memory state
    return cpu_adam_memory_params_per_s > 0 ? cpu_adam_memory_params_per_s : cpu_adam_params_per_s;
  }
  // The speculative update of memory-resident state runs out of place: its time / the in-place
  // update's (AdamMeasure::out_of_place_factor); 0 = 1.
  double cpu_adam_out_of_place_factor = 0;
  // The commit of speculatively updated parameters held in host memory (no GPU: the host-emulated
  // device's memory) is a host copy at this rate; 0 = not counted (a GPU's device-to-device copy).
  double host_copy_bps = 0;
  double gpu_adam_params_per_s = 0;
  double reduce_scatter_busbw = 0;
  double all_gather_busbw = 0;
  // CPU contention in the pipeline (0 = not modelled): CPU-seconds the NVMe legs cost per byte
  // moved (checksums, page faults of the host copies, submission), CPU-seconds per Adam element
  // (over all its threads), and the cores they share.
  double cpu_s_per_nvme_byte = 0;
  double cpu_s_per_adam_element = 0;
  double cores = 0;
  // Where the collective bandwidths come from: "measured" (the real communicator of a
  // multi-process launch), "configured" (world.network_bandwidth), or "" (not known: the network
  // leg is not counted and a note says so).
  std::string network_source;
};

// The legs of one sub-group (seconds).
struct SubGroupLegs {
  std::uint64_t elements = 0;
  double nvme_read_s = 0, h2d_s = 0, d2h_s = 0, adam_s = 0, nvme_write_s = 0;
  double cpu_s = 0;         // CPU-seconds of all legs / cores: the CPU as a shared resource
  double nvme_mixed_s = 0;  // read + write bytes at nvme_mixed_bps (0 = not measured)
  double sum() const { return nvme_read_s + h2d_s + d2h_s + adam_s + nvme_write_s; }
  // The busiest resource: NVMe (read + write, or the larger with duplex), PCIe, the optimizer,
  // the CPU (cpu_s).
  double slot(bool nvme_duplex) const;
};

struct StepPrediction {
  std::uint64_t optimizer_elements = 0;  // the rank's optimizer partition
  std::uint64_t offloaded_elements = 0;  // of which off the GPU (cpu or nvme)
  std::uint64_t sub_group_elements = 0;
  std::uint64_t sub_groups = 0;
  std::vector<SubGroupLegs> legs;  // distinct sub-group shapes: full ones, then the last partial
  std::vector<std::uint64_t> legs_count;  // how many sub-groups have legs[i]
  double nvme_read_s = 0, nvme_write_s = 0, h2d_s = 0, d2h_s = 0;
  double adam_s = 0;         // optimizer compute over the whole partition (cpu + gpu share)
  double adam_memory_s = 0;  // of which over state resident in host memory (cpu tier)
  double adam_gpu_s = 0;     // of which over state on the GPU
  double network_s = 0;      // reduce-scatter of gradients + all-gather of parameters
  double serial_s = 0;       // optimizer step, legs one after another: sum over sub-groups
  double pipelined_s = 0;    // first sub-group's legs (fill/drain) + slot of each further one
  // What the tiers add to a step over an in-GPU optimizer: step - adam + network.
  double overhead_serial_s = 0;
  double overhead_pipelined_s = 0;
  std::vector<std::string> notes;
};

// Pure: the optimizer step of `config`'s layout `layout` (plan_layout / make_plan().configured)
// with bandwidths `bw`. Sub-groups of zero.sub_group_size elements over the offloaded optimizer
// elements; the plan's per-link bytes are spread over them in proportion to elements.
StepPrediction predict_step(const Config& config, const Layout& layout, const Bandwidths& bw);

// The same model for an explicit sample: `sub_groups` sub-groups of `elements` each, optimizer
// state fully on NVMe (bytes_per_element_nvme read and written per element), CPU Adam.
StepPrediction predict_sample(std::uint64_t elements, std::uint64_t sub_groups,
                              std::uint64_t bytes_per_element_nvme, const Bandwidths& bw);

// The optimizer step hidden behind a backward of `backward_s` seconds (optimizer.overlap: each
// chunk's update runs once its gradient is final, during the backward; docs/offload.md).
//
// What of the engine's schedule the overlap depends on (overlap_shape: from the config). A rank's
// gradients become final bucket by bucket: a reduce bucket (zero.reduce_bucket_size elements of
// the flat space) is reduced once its last tensor is handed in, so the rank's range becomes final
// in `pieces` = ceil(range / bucket) pieces (at most one per chunk) — a model smaller than the
// bucket becomes final all at once, at the last gradient. And the backward hands the tensors in
// last first, so the rank whose range is handed in last (rank 0, the first elements), which the
// step waits for, gets its gradients only during the last range / flat of the backward (the
// window, T' = T / ranks for equal ranges). Stages 0-1 reduce at step(): nothing is final before.
struct OverlapShape {
  int stage = 2;
  std::uint64_t model_elements = 0;   // the flat space; 0: the rank's range (the whole backward)
  std::uint64_t bucket_elements = 0;  // 0: one piece per chunk
  // Stage 2: the rank's share of the flat parameters, which the model holds, so the commit copies
  // the speculation's new parameters in (stage 3's parameter blocks are swapped, not copied).
  std::uint64_t param_commit_bytes = 0;
  // optimizer.update auto on a GPU (docs/offload.md, "Where the update runs"): the update of the
  // memory-resident state is shared with the device, which moves split_in_bytes per element to it
  // (master, moments, gradient) and split_out_bytes back (master, moments, parameter copy).
  bool split = false;
  std::uint64_t split_in_bytes = 0, split_out_bytes = 0;
};
OverlapShape overlap_shape(const Config& config);

// The model: the pieces become final evenly over the window, and the update works through them in
// that order at the speculative pace W_s, each once it is final and the one before it is done.
// W_s is the step's pipelined time W (pipelined_s) with the Adam of memory-resident state out of
// place (W + (f - 1) adam_memory_s, f = Bandwidths::cpu_adam_out_of_place_factor): the update
// writes pending versions beside the committed state. The update then ends max over j < n of
// ((j + 1) W_s - j T') / n after the last gradient: W_s / n (the last piece alone) when the window
// is the longer, W_s - T' (n - 1) / n when the update is (stages 0-1: the serial W). State on the
// GPU is not speculated: its update (adam_gpu_s) runs after the decision, beside the rest. Then
// the commit copies the new parameters of the state off the GPU in (that share of
// param_commit_bytes, at host_copy_bps). Not counted:
// the hand-ins' copies (which share the CPU and memory with the update during the backward), the
// last bucket's reduction, the decision, and a clip or an overflow (a rollback: the serial step
// again); a bound from below. With shape.split (and the GPU's rates measured: h2d_bps, d2h_bps,
// gpu_adam_params_per_s), the Adam of memory-resident state in W_s runs on both sides at once,
// each element on the device taking in / h2d + 1 / gpu rate + out / d2h (one stream), shared so
// both finish together (the engine's split); NVMe state's Adam is under its I/O in the pipeline
// and is not split in the model.
struct OverlapPrediction {
  double backward_s = 0;     // T, given
  std::uint64_t chunks = 0;  // the step's sub-groups
  std::uint64_t pieces = 0;  // n: the pieces in which the rank's gradients become final
  double window_s = 0;       // T': the part of the backward that hands in the rank's range
  double optimizer_s = 0;    // W, the serial optimizer step it hides (pipelined_s)
  double speculative_s = 0;  // W_s: the same update into pending versions
  double commit_s = 0;       // the parameters' commit copy after the decision (0: none)
  // split: the memory-resident elements the device updates (during the backward only what the
  // CPU cannot update in the window; the last piece shared so that both finish together)
  double device_share = 0;
  double exposed_s = 0;            // the update's time after the last gradient, with the commit
  double backward_and_step_s = 0;  // T + exposed_s
  double serial_s = 0;             // T + W: backward, then the whole step
};

// Pure. Throws Error(kInvalidArgument) for a negative or non-finite backward_s.
OverlapPrediction predict_overlap(const StepPrediction& step, double backward_s,
                                  const OverlapShape& shape = {}, const Bandwidths& bw = {});

// ---- the sample step
// -----------------------------------------------------------------------------
struct SampleRun {
  std::string mode;                // "serial" | "pipelined"
  std::vector<double> measured_s;  // each repeat (empty when only the median is known)
  std::uint32_t repeats = 0;       // how many runs measured_median_s is the median of
  double measured_median_s = 0;
  double predicted_s = 0;
  double error = 0;  // (predicted - measured) / measured
};

// The pinned pool a measurement really used, against the configured one, and why they differ.
struct PoolUse {
  std::uint32_t configured_buffers = 0;
  std::uint64_t configured_buffer_size = 0;
  std::uint32_t buffers = 0;
  std::uint64_t buffer_size = 0;
  std::uint64_t memlock_limit = 0;  // the page-lock limit that applies; ~0 = none
  std::string reason;               // "as configured" or why it was cut
};

struct SampleStep {
  bool ran = false;
  PoolUse pool;                // the profile loop's pool (one buffer: the NVMe piece size)
  PoolUse engine_pool;         // the zero layer's step: its pinned buffers
  std::string implementation;  // what ran it (the profile layer's TierStore + CpuAdam loop)
  std::uint64_t elements_per_sub_group = 0;
  std::uint64_t sub_groups = 0;
  std::uint64_t nvme_bytes_per_element = 0;
  // Legs measured in isolation on the sample's buffers (inputs of the prediction): the median
  // over the repeats, each repeat measuring its legs just before its serial and pipelined runs.
  double tier_read_bps = 0, tier_write_bps = 0, adam_params_per_s = 0;
  double tier_mixed_bps = 0;  // a read and a write-back at once: read + write bytes per second
  std::vector<double> tier_read_runs, tier_write_runs, adam_runs, tier_mixed_runs;
  double cpu_s_per_nvme_byte = 0, cpu_s_per_adam_element = 0;  // process CPU time (getrusage)
  SampleRun serial, pipelined;
  // The zero layer's own pipelined offloaded step (its OffloadStateStore, chunks of the pinned
  // pool's buffers) on the same sample, predicted from its legs alone with the same model.
  bool engine_ran = false;
  std::string engine_skipped;  // why not, when !engine_ran
  std::uint64_t engine_chunks = 0, engine_buffer_size = 0;
  std::uint32_t engine_buffers = 0;
  double engine_read_s = 0, engine_update_s = 0, engine_write_s = 0;  // legs alone (medians)
  SampleRun engine_serial, engine_pipelined;
};

// ---- recommendation
// ------------------------------------------------------------------------------
struct IoRecommendation {
  std::string path;
  bool configured_kept = false;  // the configured setting is within the noise of the best
  double noise = 0;              // relative band treated as measurement noise
  std::string engine;
  std::uint64_t block_size = 0;
  std::uint32_t queue_depth = 0;
  std::uint32_t rings = 0;
  double read_bps = 0, write_bps = 0;
  std::string reason;
};

struct PlacementOption {
  int stage = 0;
  OffloadConfig offload;
  std::string description;
  bool fits = false;
  std::string verdict;  // the plan's verdict for this rung (why it does not fit)
  bool checkpointing = false;
  std::uint64_t gpu_bytes_per_rank = 0;  // the plan's gpu figure: model state + runtime buffers
  double overhead_pipelined_s = 0;
  double step_pipelined_s = 0;
};

struct PlacementRecommendation {
  bool found = false;
  PlacementOption choice;
  std::string reason;
  std::vector<PlacementOption> considered;
};

// How the model shares a node between its ranks (docs/profile.md "Ranks on a node").
struct NodeSharing {
  std::uint32_t ranks_per_node = 1;   // the config's ranks on the fullest node
  std::uint32_t local_processes = 1;  // profile processes that ran on this node at once
  std::uint32_t nvme_devices = 1;     // distinct block devices under tiers.nvme.paths
  // NVMe: concurrent streams measured in this process (0 = not measured: one rank per node, or
  // every local rank measured itself), one stream's rate and the streams' total.
  std::uint32_t nvme_streams = 0;
  double nvme_single_read_bps = 0, nvme_single_write_bps = 0;
  double nvme_aggregate_read_bps = 0, nvme_aggregate_write_bps = 0;
  double nvme_read_factor = 1, nvme_write_factor = 1;  // applied to the sample's tier rates
  double cpu_factor = 1;                               // applied to the CPU Adam rate
  double cores_per_rank = 0;
  std::vector<std::string> notes;  // one line per decision, for the report
};

// A real multi-rank Engine step (the public Engine API over the launch's communicator) on a
// sample model, against the model's prediction for it from this profile's measured legs.
struct EngineCheck {
  bool ran = false;
  std::string skipped;  // why not
  int ranks = 0;
  std::string backend;             // communicator
  std::string layout;              // "stage 2, optimizer on nvme"
  std::uint64_t elements = 0;      // model elements (all ranks)
  std::vector<double> measured_s;  // per measured step: the slowest rank's set_gradient + step()
  double measured_median_s = 0;
  double predicted_s = 0;
  double error = 0;  // (predicted - measured) / measured
  StepPrediction prediction;
  // The prediction's parts: the optimizer step (from `optimizer_from`), the step's collectives
  // replayed alone before the steps (prediction.network_s), the gradient copy + the rest of a
  // one-rank step() around its update loop (grad_passes_s).
  double predicted_optimizer_s = 0;
  std::string optimizer_from;
  double grad_passes_s = 0;
  // The engine's own phase times (mean per step, slowest rank): reduce, norm, optimizer, gather.
  double reduce_s = 0, norm_s = 0, optimizer_s = 0, gather_s = 0;
};

struct ProfileReport {
  std::string config_source;
  ProfileMode mode = ProfileMode::kDefault;
  Environment environment;
  std::vector<std::string> notes;  // "no NVMe path configured: using temporary directory ..."
  std::vector<IoPoint> io;
  std::string copies_skipped;  // "skipped: no GPU (...)" or ""
  std::vector<CopyPoint> copies;
  double triad_bytes_per_second = 0;
  unsigned triad_threads = 0;
  AdamMeasure cpu_adam, gpu_adam;
  std::string collectives_skipped;
  std::vector<CollectivePoint> collectives;
  NodeSharing sharing;
  Bandwidths bandwidths;  // what the model used for the configured step (per rank)
  Plan plan;
  StepPrediction configured;  // the configured model, stage and tiers
  SampleStep sample;
  std::vector<IoRecommendation> io_recommendations;
  PlacementRecommendation placement;
  EngineCheck engine_check;
  int rank = 0, world = 1;  // of the launch (rank 0 reports)
  // The config with the recommendations applied (tuned_config_text for --write-config). The I/O
  // settings are applied only when tiers.nvme.paths is configured (measurements in a temporary
  // directory describe that directory's disk, not the user's NVMe); tuned_notes says what was
  // and was not applied.
  Config tuned;
  std::vector<std::string> tuned_notes;
  std::vector<std::pair<std::string, double>> phase_seconds;  // wall time of each phase
  double elapsed_s = 0;
};

// Validates the NVMe paths (see "Failure" above). Returns their info. Exposed for tests.
std::vector<PathInfo> check_nvme_paths(const NvmeTierConfig& nvme);

// The text of `--write-config`: the user's original YAML (`original_text`; `original` is the
// config the profile ran, --set included) with only the values that differ in `tuned` changed in
// place, so comments, key order and units survive (sizes are written with units: `block_size:
// 512KiB`). Keys the file did not have are added beside their siblings. The result is re-parsed and
// must load as `tuned`; when the text cannot be edited in place (an unusual layout), a full
// rendering is returned instead and *note says so. Throws Error(kInternal) only if neither loads as
// `tuned`. `overrides` are the command line's --set key.path=value, applied to the text first (they
// are part of `tuned`).
std::string tuned_config_text(const std::string& original_text, const Config& original,
                              const Config& tuned, const std::vector<std::string>& overrides,
                              std::string* note);

ProfileReport run_profile(const Config& config, const ProfileOptions& options);

// The device bound of an engine's update as `strata bench step` measures it (benchmarks only:
// bench/python/bench_optimizer_step.py through the Python package): the update's chunks read and
// written back unchanged, reads || writes (t_io_s), and Adam alone on chunks held in memory
// (t_update_s); the state is not changed. And the last step's host update loop: its time, its
// computes, its waits for reads and writes, its gate (last_loop_*). After finalize(), between
// steps.
struct EngineBound {
  double t_io_s = 0, t_update_s = 0;
  double last_loop_s = 0, last_loop_compute_s = 0, last_loop_wait_read_s = 0,
         last_loop_wait_write_s = 0, last_loop_gate_s = 0;
};
EngineBound measure_engine_bound(Engine& engine);

}  // namespace strata
