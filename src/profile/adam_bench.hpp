// Internal: the Adam kernel benchmark shared by `strata bench adam`, bench/optim and the profiler.
//
// Allocates the arrays for `params` elements, then measures, ALTERNATELY for `rounds` rounds and
// on the same CpuAdam (same threads, same tiles, same arrays), one Adam step and one pass of the
// plain stream kernel with the same access pattern (CpuAdam::stream_reference). Memory bandwidth
// on shared machines drifts between runs, so the figure of merit is the per-round ratio
// stream_time / adam_time ("fraction of the bound"), reported as the median over rounds.
//
// In the same rounds, alternating with those two: the same Adam step OUT OF PLACE, as the
// speculative update runs it (docs/offload.md): the committed master and moments and the gradients
// read, the new state written into a second set of page-aligned arrays (non-temporal stores), which
// then become the committed ones (the commit's swap: the old set is the next step's destination).
// The in-place step runs on whichever set is committed. The figure: the per-round ratio
// out_of_place_time / in_place_time, median over rounds (the target is <= 1.10, issue 49). Its
// floor on the machine: the stream reference out of place against in place, also alternated.
#pragma once

#include <cstddef>
#include <vector>

#include "strata/adam.hpp"

namespace strata::profile {

struct AdamBenchOptions {
  std::size_t params = 50'000'000;
  unsigned threads = 2;
  DType grads = DType::kFp32;
  bool param_copy = false;  // also write the updated weights as `copy_dtype`
  DType copy_dtype = DType::kBf16;
  int rounds = 7;
  AdamPath path = AdamPath::kAuto;
  bool check_finite = false;  // include the non-finite pre-pass in the Adam timing
};

struct AdamBenchResult {
  AdamBenchOptions options;
  AdamPath path = AdamPath::kAuto;  // resolved
  // Memory traffic of one step: p, m, v read and written, the grads, the copy when there is one,
  // the grads again with check_finite. One stream pass moves the same without the check_finite
  // read.
  double bytes_per_param = 0;
  std::vector<double> adam_seconds, stream_seconds;  // one entry per round
  double adam_seconds_median = 0, stream_seconds_median = 0;
  double adam_params_per_second = 0, stream_params_per_second = 0;  // from the medians
  double adam_bytes_per_second = 0, stream_bytes_per_second = 0;
  double fraction_of_bound = 0;  // median over rounds of stream_time / adam_time (wall clock)
  double fraction_min = 0, fraction_max = 0;
  // The same ratio from process CPU time (all threads) per pass: less sensitive to the
  // scheduler on a loaded machine (time slices lost to other processes do not count).
  std::vector<double> adam_cpu_seconds, stream_cpu_seconds;
  double fraction_of_bound_cpu_time = 0;
  // The out-of-place step (same bytes per parameter as the step in place).
  std::vector<double> out_of_place_seconds, out_of_place_cpu_seconds;  // one entry per round
  double out_of_place_seconds_median = 0;
  double out_of_place_params_per_second = 0, out_of_place_bytes_per_second = 0;
  double out_of_place_ratio = 0;  // median over rounds of out_of_place_time / adam_time (wall)
  double out_of_place_ratio_min = 0, out_of_place_ratio_max = 0;
  double out_of_place_ratio_cpu_time = 0;  // the same from process CPU time
  // The stream reference out of place (the out-of-place step's pattern: the new p, m, v into the
  // second set of arrays, the same stores), swapped in like the step.
  std::vector<double> out_of_place_stream_seconds, out_of_place_stream_cpu_seconds;
  double out_of_place_stream_seconds_median = 0;
  // Median over rounds of out-of-place stream time / out-of-place Adam time: how close the
  // out-of-place step runs to its own pattern's bound.
  double out_of_place_fraction_of_bound = 0;
  // Median over rounds of out-of-place stream time / in-place stream time: what writing a new
  // version instead of overwriting costs this machine's memory system, whatever the arithmetic
  // (out_of_place_ratio cannot go below it at the bound).
  double out_of_place_pattern_ratio = 0;
  double out_of_place_pattern_ratio_min = 0, out_of_place_pattern_ratio_max = 0;
};

// Throws Error(kInvalidArgument) for params == 0, threads == 0, rounds < 1; Error(kOutOfMemory)
// when the arrays cannot be allocated.
AdamBenchResult run_adam_bench(const AdamBenchOptions& o);

}  // namespace strata::profile

namespace strata::profile {

// GPU: one Adam step (fp32 grads, 28 B/param) and one cudaMemcpy device-to-device of the same
// traffic (14 B/param read + written), alternately; fraction = copy_time / adam_time (median).
struct AdamCudaBenchResult {
  std::vector<double> adam_seconds, copy_seconds;
  double adam_params_per_second = 0, adam_bytes_per_second = 0;
  double copy_bytes_per_second = 0;  // bytes read + written per second
  double fraction_of_copy = 0;
};
// Throws Error(kUnsupported) without CUDA (build or device).
AdamCudaBenchResult run_adam_cuda_bench(std::size_t params, int rounds);

}  // namespace strata::profile
