// Internal pieces of the profiler (src/profile): one measurement per file, the sizes each mode
// uses, and small helpers. Not part of the public API.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/page_lock.hpp"
#include "strata/communicator.hpp"
#include "strata/profile.hpp"

namespace strata {
class Device;
class Stream;
class Communicator;
class Engine;
}  // namespace strata

namespace strata::profile {

using Progress = std::function<void(const std::string&)>;

// What a mode measures.
struct Sizes {
  std::vector<std::uint64_t> block_sizes;
  std::vector<std::uint32_t> queue_depths;
  std::vector<std::uint32_t> rings;
  bool both_engines = true;     // io_uring and threads (else: the configured/auto one)
  std::uint64_t io_region = 0;  // bytes of the test file region swept
  double io_point_s = 0;        // time per I/O point and pass
  std::uint32_t io_passes = 1;  // passes over the grid, alternating direction (noise estimate)
  std::vector<std::uint64_t> copy_sizes;
  std::uint64_t adam_elements = 0;
  std::uint64_t gpu_adam_elements = 0;
  std::uint64_t triad_bytes = 0;  // all three arrays
  std::vector<std::uint64_t> collective_sizes;
  std::uint32_t max_streams = 8;    // NVMe streams for the node-sharing measurement
  std::uint64_t stream_region = 0;  // bytes per stream file
  double stream_s = 0;              // seconds per stream measurement
  int engine_check_steps = 0;
  std::uint64_t sample_elements = 0;  // cap on the sample's sub-group size
  std::uint64_t sample_sub_groups = 0;
  std::uint32_t sample_repeats = 0;
};
Sizes mode_sizes(ProfileMode mode);

class Stopwatch {
 public:
  Stopwatch() : t0_(std::chrono::steady_clock::now()) {}
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }

 private:
  std::chrono::steady_clock::time_point t0_;
};

// The median of v (the mean of the two middle values for an even count; 0 for none).
double median(std::vector<double> v);
// The one rank's communicator of a measured engine: NCCL (device buffers) when the engine will run
// on a CUDA device, else the in-process one (step_bench.cpp).
std::unique_ptr<Communicator> one_rank(const Config& cfg);
void fill_random(void* data, std::size_t bytes, std::uint64_t seed);
// The model of a measured engine: one parameter `name` of n values uniform in [-bound, bound),
// drawn from rng.
void add_random_parameter(Engine& engine, const std::string& name, std::size_t n, float bound,
                          std::mt19937& rng);

Environment collect_environment(const std::vector<std::string>& paths,
                                const std::string& adam_path);
PathInfo describe_path(const std::string& path);

std::vector<IoPoint> sweep_io(const Config& config, const std::string& dir, const Sizes& sizes,
                              const Progress& progress);

// NVMe bandwidth a node's ranks share: `streams` concurrent sequential streams (each its own file
// of `region` bytes and its own engine at the configured settings) against one stream alone,
// ~`seconds` each, writes then reads.
struct StreamRates {
  std::uint32_t streams = 0;
  double single_read = 0, single_write = 0, aggregate_read = 0, aggregate_write = 0;
};
StreamRates measure_streams(const Config& config, const std::string& dir, std::uint32_t streams,
                            std::uint64_t region, double seconds);

// Host <-> device copies through the Device interface (CUDA only).
std::vector<CopyPoint> measure_copies(Device& device, const Sizes& sizes, const Progress& progress);
// Device -> pinned host: `bytes` of `device` memory at `src` copied on `stream` (in its order,
// after what is queued there) into page-locked host memory, the best of 3 after a warm-up; bytes
// per second. The bandwidth a gradient's share crosses from a GPU to host memory.
double measure_d2h_pinned(Device& device, Stream& stream, const void* src, std::size_t bytes);

AdamMeasure measure_cpu_adam(const Config& config, std::uint64_t elements);
AdamMeasure measure_gpu_adam(const Config& config, Device& device, std::uint64_t elements);
double measure_triad(std::uint64_t bytes, unsigned threads);

// Reduce-scatter and all-gather over `comm` (every rank calls this at once): buffers in host
// memory, or in `device` memory for a device communicator (NCCL). `host` exchanges the ranks'
// times (the slowest rank's time is the collective's). Empty for a 1-rank communicator.
std::vector<CollectivePoint> measure_collectives(const Config& config, Communicator& comm,
                                                 Communicator& host, Device* device,
                                                 const Sizes& sizes, const Progress& progress);
// The largest value over the ranks of `host` (every rank calls it).
double max_over_ranks(Communicator& host, double v);

// The engine check (EngineCheck in profile.hpp): a real Engine over `comm` on `elements` model
// elements (all ranks) in sub-groups of `sub_group`, `steps` measured steps after one warm-up,
// predicted from `bw` (the sample step's legs) or, optimizer on NVMe, `sample`'s zero-layer step.
EngineCheck run_engine_check(const Config& config, const std::vector<std::string>& paths,
                             Communicator& comm, const Bandwidths& bw, const SampleStep& sample,
                             std::uint64_t elements, std::uint64_t sub_group, int steps,
                             const Progress& progress);

// The pinned pool a measurement can really page-lock: the configured tiers.host pool, at most
// `max_buffers` buffers, cut to fit RLIMIT_MEMLOCK where it applies (`lock`: not with
// CAP_IPC_LOCK; at most `max_cut_buffers` buffers then).
PoolUse choose_pool(const Config& config, std::uint32_t max_buffers, std::uint32_t max_cut_buffers,
                    const PageLockLimit& lock = page_lock_limit());

// Under a launch every rank runs the sample at once; `sync` (a barrier across the ranks, or empty
// for one process) is called before each measurement — each leg, each step — so that the legs,
// the model's inputs, are measured under the same sharing of the disk and cores as the steps.
SampleStep run_sample_step(const Config& config, const std::vector<std::string>& paths,
                           std::uint64_t elements, std::uint64_t sub_groups, std::uint32_t repeats,
                           const Progress& progress, const std::function<void()>& sync = {});

// The I/O settings per path: the configured setting (engine `configured_engine`, the config's
// block size, queue depth and io_threads) when its read/write harmonic mean is within the noise
// band of the best; otherwise the lightest setting within the band. The band is twice the median
// spread between the sweep's passes, clamped to [5%, 25%] (5% with one pass).
std::vector<IoRecommendation> recommend_io(const std::vector<IoPoint>& points,
                                           const NvmeTierConfig& configured,
                                           const std::string& configured_engine);
PlacementRecommendation recommend_placement(const Config& config, const Bandwidths& bw,
                                            double target_overhead_s, bool nvme_usable);

// GPU synchronization for the raw CUDA Adam kernel (legacy default stream); no-op without CUDA.
void gpu_synchronize();

}  // namespace strata::profile
