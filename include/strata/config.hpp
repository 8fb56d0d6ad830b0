// The typed, validated configuration every layer reads. Built from YAML by load_config(); every
// field below has the default documented in docs/config.md and configs/default.yaml.
//
// Key names are the contract between the YAML, the CLI, the layers and the tests (DESIGN.md).
//
// Errors: load_config()/parse_config()/apply_override() throw ConfigError (file:line:col, key
// path, message) for every bad input; they never crash on malformed YAML.
// Thread-safety: Config is a plain value; loading has no global state.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

// DType, Tier, ... and their names: re-exported, so callers that include config.hpp keep them.
#include "strata/types.hpp"

namespace strata {

// The ranges the loader enforces (docs/config.md, "Ranges"). They are chosen so that everything
// strata derives from a config fits its type: 28 B of state and traffic per parameter, times
// kMaxRanksPerNode, stays below 2^64; the collective timeout in nanoseconds fits an int64.
namespace limits {
constexpr std::uint64_t kMaxParameters = 100'000'000'000'000ULL;  // 100T (also sub_group_size,
                                                                  // reduce_bucket_size)
constexpr std::uint32_t kMaxLayers = 1u << 20;
constexpr std::uint32_t kMaxHiddenSize = 1u << 20;
constexpr std::uint32_t kMaxHeads = 1u << 16;
constexpr std::uint32_t kMaxSequenceLength = 1u << 24;
constexpr std::uint32_t kMaxMicroBatch = 1u << 16;
constexpr double kMaxLossScale = 4294967296.0;  // 2^32 (initial and min_scale)
constexpr std::uint32_t kMaxRanks = 1u << 20;
constexpr std::uint32_t kMaxRanksPerNode = 4096;
constexpr std::uint32_t kMaxBufferCount = 4096;
constexpr std::uint64_t kMaxBufferSize = 1ULL << 36;  // 64 GiB
constexpr std::uint64_t kMaxBlockSize = 1ULL << 30;   // 1 GiB, as the I/O engines accept
constexpr std::uint32_t kMaxQueueDepth = 4096;
constexpr std::uint32_t kMaxIoThreads = 64;
constexpr double kMinCollectiveTimeoutS = 0.001;
constexpr double kMaxCollectiveTimeoutS = 1e6;      // 11.6 days; 1e15 ns fits an int64
constexpr std::uint32_t kMaxCpuThreads = 1024;      // as CpuAdam accepts
constexpr std::uint32_t kMaxAccumulate = 1u << 16;  // micro-batches per optimizer step
}  // namespace limits

struct ModelConfig {
  // 0 = unknown: the engine and `strata train` take sizes from the parameters they are given;
  // `strata plan` needs it. At most limits::kMaxParameters.
  std::uint64_t parameters = 0;
  std::uint64_t largest_layer = 0;  // 0 = unknown
  // Optional shape for the activation estimate; 0 = not given.
  std::uint32_t layers = 0;
  std::uint32_t hidden_size = 0;
  std::uint32_t heads = 0;
  std::uint32_t sequence_length = 0;
  std::uint32_t micro_batch = 1;
  bool has_shape() const {
    return layers && hidden_size && heads && sequence_length && micro_batch;
  }
};

// Whether gradients are loss-scaled: kAuto = only fp16 gradients (as torch AMP and DeepSpeed:
// bf16 has fp32's exponent range and needs no scaling); kOn / kOff force it.
enum class LossScaling { kAuto, kOn, kOff };

struct LossScaleConfig {
  LossScaling enabled = LossScaling::kAuto;
  bool dynamic = true;                   // dynamic loss scaling (when scaling is enabled)
  double initial = 65536.0;              // initial (or static) loss scale, > 0
  double growth_factor = 2.0;            // > 1
  double backoff_factor = 0.5;           // in (0, 1)
  std::uint32_t growth_interval = 1000;  // steps without overflow before growing, >= 1
  double min_scale = 1.0;                // > 0
};

struct PrecisionConfig {
  DType params = DType::kFp16;
  DType grads = DType::kFp16;
  // The dtype the step's gradient is held (and accumulated over micro-batches) in: unset (`auto`)
  // = grads; fp32 with 16-bit grads holds the rank's gradients in FP32 (4 bytes/element) while
  // the hand-ins, buckets and stage 2-3 collectives stay 16-bit. Only grads or fp32 is valid.
  std::optional<DType> grad_accum;
  LossScaleConfig loss_scale;
  DType accum_dtype() const { return grad_accum.value_or(grads); }
  // Loss scaling in effect: loss_scale.enabled, with kAuto = (grads == fp16).
  bool loss_scaling() const {
    return loss_scale.enabled == LossScaling::kAuto ? grads == DType::kFp16
                                                    : loss_scale.enabled == LossScaling::kOn;
  }
};

struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  double lr = 1.0e-4;          // >= 0
  double beta1 = 0.9;          // [0, 1)
  double beta2 = 0.999;        // [0, 1)
  double eps = 1.0e-8;         // > 0
  double weight_decay = 0.01;  // >= 0
  double grad_clip = 0.0;      // max global gradient L2 norm; 0 = no clipping
  OptimizerUpdate update = OptimizerUpdate::kCpu;
  // The speculative update during the backward (docs/offload.md, "The speculative update"): off,
  // on (refused where unsupported), auto (where supported; paused while rollbacks are frequent).
  OptimizerOverlap overlap = OptimizerOverlap::kOff;
  // Bytes of pending versions one step may hold (host, device and NVMe together); 0 = no bound
  // beyond the tiers' budgets. Chunks beyond it wait for the decision.
  std::uint64_t speculation_budget = 0;
};

struct WorldConfig {
  std::uint32_t ranks = 1;           // >= 1
  std::uint32_t ranks_per_node = 0;  // 0 = min(ranks, 8); must be <= ranks
  // Collective bus bandwidth between the ranks (nccl-tests' busbw), bytes per second; used by
  // `strata profile` when it cannot measure the real communicator (not launched across
  // processes). 0 = not given.
  std::uint64_t network_bandwidth = 0;
};

struct ZeroConfig {
  int stage = 2;                                   // 0..3
  std::uint64_t sub_group_size = 100'000'000;      // elements, >= 1
  std::uint64_t reduce_bucket_size = 500'000'000;  // elements, >= 1
};

struct OffloadTarget {
  Tier tier = Tier::kGpu;
  double fraction = 1.0;    // share of this state on `tier`; the rest stays on gpu. [0, 1]
  bool pin_memory = false;  // for tier cpu: keep it in page-locked memory
};

struct OffloadConfig {
  OffloadTarget optimizer;  // FP32 master + both moments
  OffloadTarget gradients;
  OffloadTarget params;  // cpu/nvme only at stage 3
};

struct GpuTierConfig {
  std::uint64_t budget = 80'000'000'000ULL;
  // optimizer.update auto on a GPU: the device memory the update's split stages its share of a
  // chunk in (master, moments, gradients, parameter copy); 0 = a whole chunk's.
  std::uint64_t update_window = 0;
};

struct HostTierConfig {
  // Per node. Not given in the config (budget_set false): the default, 512 GiB, is what the engine
  // counts against, while `strata plan` checks against the machine's memory (make_plan with a
  // MachineMemory, strata/plan.hpp).
  std::uint64_t budget = 512ULL << 30;
  bool budget_set = false;  // tiers.host.budget was given (parse_config/load_config set it)
  std::uint64_t pinned_budget = 8ULL << 30;
  std::uint32_t buffer_count = 4;            // >= 1
  std::uint64_t buffer_size = 256ULL << 20;  // multiple of 4096
};

struct NvmeTierConfig {
  std::vector<std::string> paths;
  IoEngineKind engine = IoEngineKind::kAuto;
  std::uint64_t block_size = 1ULL << 20;  // multiple of 4096
  std::uint32_t queue_depth = 32;         // 1..4096
  std::uint32_t io_threads = 1;           // rings (io_uring) or workers (threads), 1..64
  DirectIoMode direct_io = DirectIoMode::kAuto;
  bool checksum = true;
  bool sqpoll = false;       // io_uring submission-queue polling thread
  std::uint64_t budget = 0;  // bytes of swap space per node across all paths; 0 = unlimited
  // Swap space kept beside the optimizer state on nvme for the pinned versions of an asynchronous
  // checkpoint, as a fraction of that state (0..1): a block rewritten while a save is in flight
  // takes a new slot; reserved at start-up (the swap file grows by it) and counted by `strata
  // plan`. 0 (default): none, and a step after an asynchronous save waits for its writer.
  double snapshot_room = 0.0;
};

struct TiersConfig {
  GpuTierConfig gpu;
  HostTierConfig host;
  NvmeTierConfig nvme;
};

struct RuntimeConfig {
  DeviceKind device = DeviceKind::kAuto;
  CommBackend communicator = CommBackend::kAuto;
  double collective_timeout_s = 300.0;  // > 0
  std::uint32_t cpu_threads = 0;        // optimizer threads; 0 = all cores
};

// How a training loop steps (DeepSpeed's gradient_accumulation_steps): read by `strata train`
// (its --accumulate overrides it). An embedder's loop decides its own micro-batches per step:
// the Engine and strata.torch sum whatever is handed in before step() (docs/python.md).
struct TrainConfig {
  std::uint32_t accumulate = 1;  // micro-batches per optimizer step, 1..kMaxAccumulate
};

struct Config {
  ModelConfig model;
  PrecisionConfig precision;
  OptimizerConfig optimizer;
  WorldConfig world;
  ZeroConfig zero;
  OffloadConfig offload;
  TiersConfig tiers;
  RuntimeConfig runtime;
  TrainConfig train;

  std::string source;  // file the config was loaded from ("<string>" for parse_config)

  std::uint32_t ranks_per_node() const;
  std::uint32_t nodes() const;  // ceil(ranks / ranks_per_node)
};

// Reads and validates a YAML file. Throws ConfigError on a missing, unreadable or empty file, a
// syntax error, a document that is not a mapping, an unknown key (with the closest valid key
// suggested), a wrong type, a value out of range, a malformed unit, or an impossible combination.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// Same, from YAML text; `source_name` is used in error messages.
Config parse_config(std::string_view yaml, const std::string& source_name = "<string>",
                    const std::vector<std::string>& overrides = {});

// Renders a Config back to YAML that load_config accepts (every key written).
std::string to_yaml(const Config& config);

}  // namespace strata
