// Internal pieces of the profiler (src/profile): one measurement per file, the sizes each mode
// uses, and small helpers. Not part of the public API.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "strata/profile.hpp"

namespace strata {
class Device;
}

namespace strata::profile {

using Progress = std::function<void(const std::string&)>;

// What a mode measures.
struct Sizes {
  std::vector<std::uint64_t> block_sizes;
  std::vector<std::uint32_t> queue_depths;
  std::vector<std::uint32_t> rings;
  bool both_engines = true;     // io_uring and threads (else: the configured/auto one)
  std::uint64_t io_region = 0;  // bytes of the test file region swept
  double io_point_s = 0;        // time per I/O point
  std::vector<std::uint64_t> copy_sizes;
  std::uint64_t adam_elements = 0;
  std::uint64_t gpu_adam_elements = 0;
  std::uint64_t triad_bytes = 0;  // all three arrays
  std::vector<std::uint64_t> collective_sizes;
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

double median(std::vector<double> v);
void fill_random(void* data, std::size_t bytes, std::uint64_t seed);

Environment collect_environment(const std::vector<std::string>& paths, const std::string& adam_path);
PathInfo describe_path(const std::string& path);

std::vector<IoPoint> sweep_io(const Config& config, const std::string& dir, const Sizes& sizes,
                              const Progress& progress);

// Host <-> device copies through the Device interface (CUDA only).
std::vector<CopyPoint> measure_copies(Device& device, const Sizes& sizes, const Progress& progress);

AdamMeasure measure_cpu_adam(const Config& config, std::uint64_t elements);
AdamMeasure measure_gpu_adam(const Config& config, Device& device, std::uint64_t elements);
double measure_triad(std::uint64_t bytes, unsigned threads);

// Empty result with *skipped set when the backend / rank count cannot be measured here.
std::vector<CollectivePoint> measure_collectives(const Config& config, const Sizes& sizes,
                                                 std::string* skipped, const Progress& progress);

SampleStep run_sample_step(const Config& config, const std::vector<std::string>& paths,
                           std::uint64_t elements, std::uint64_t sub_groups,
                           std::uint32_t repeats, const Progress& progress);

std::vector<IoRecommendation> recommend_io(const std::vector<IoPoint>& points);
PlacementRecommendation recommend_placement(const Config& config, const Bandwidths& bw,
                                            double target_overhead_s, bool nvme_usable);

// GPU synchronization for the raw CUDA Adam kernel (legacy default stream); no-op without CUDA.
void gpu_synchronize();

}  // namespace strata::profile
