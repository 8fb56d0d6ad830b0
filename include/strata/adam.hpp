// Adam / AdamW optimizer kernels: one fused pass over a flat FP32 master + moments, on the CPU
// (AVX-512, AVX2+FMA or portable code, chosen at run time) or on a CUDA device.
//
// Semantics are those of torch.optim.Adam / torch.optim.AdamW (torch 1.13, amsgrad=False,
// maximize=False), element by element, in FP32, in torch's operation order:
//
//   g   = (float(grad) / grad_divisor) * grad_scale    (grad_divisor = N ranks: the average of
//                                                     the ranks' summed gradients, divided as
//                                                     torch does; grad_scale = clip_coef /
//                                                     loss_scale; no division when divisor is 1)
//   Adam : g = g + weight_decay * p                    (L2 decay, only if weight_decay != 0)
//   AdamW: p = p * float(1 - lr * weight_decay)        (decoupled decay, before the update)
//   m   = m * beta1 + (1 - beta1) * g               (fused multiply-add, like torch's add_)
//   v   = v * beta2 + ((1 - beta2) * g) * g          (fused multiply-add, like torch's addcmul_)
//   bc1 = 1 - beta1^step, bc2 = 1 - beta2^step         (in double, `step` = this update's number)
//   denom = sqrt(v) / float(sqrt(bc2)) + eps
//   p   = p + (-(lr / bc1) * m) / denom
//   param_copy (optional) = fp16/bf16(p), round to nearest even
//
// Non-finite gradients: when AdamStepOptions::check_finite is set, the gradients (after
// grad_scale) are checked BEFORE anything is written; if any element is inf or NaN the call
// returns applied=false and p, m, v and param_copy are left exactly as they were. (The check is an
// extra read pass over the gradients; an engine that already called adam_grad_stats() for the
// global norm / overflow decision passes check_finite=false.)
//
// Pointers and aliasing: param, exp_avg, exp_avg_sq, grad and param_copy must each address `n`
// elements of their type; any alignment is accepted beyond the element's natural one (float* 4
// bytes, fp16/bf16 2 bytes: no 16/32/64-byte alignment is required). The five arrays must not
// overlap each other, with one exception: grad may alias param_copy exactly (same address, both
// 16-bit), the usual "gradient buffer reused for the new weights" pattern — every element's
// gradient is read before its copy is written. n == 0 is a no-op (applied=true).
//
// Thread-safety: CpuAdam serializes its own calls (a mutex); different CpuAdam objects run
// concurrently. The arrays must not be touched by anyone else during a call. The free functions
// are thread-safe. Failure: invalid arguments (null pointer with n > 0, bad dtype, step < 1,
// lr/eps/weight_decay < 0, beta out of [0,1), misaligned or overlapping arrays) throw
// Error(kInvalidArgument) before any state is changed.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "strata/config.hpp"

namespace strata {

// Hyper-parameters of one parameter group (per call; may change between calls).
struct AdamParams {
  OptimizerType type = OptimizerType::kAdamW;
  double lr = 1.0e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1.0e-8;
  double weight_decay = 0.0;

  static AdamParams from_config(const OptimizerConfig& c) {
    return AdamParams{c.type, c.lr, c.beta1, c.beta2, c.eps, c.weight_decay};
  }
};

// The arrays one call updates (host pointers for CpuAdam, device pointers for adam_step_cuda).
struct AdamTensors {
  float* param = nullptr;       // FP32 master weights, updated in place (unless param_out)
  float* exp_avg = nullptr;     // first moment m, FP32, updated in place (unless exp_avg_out)
  float* exp_avg_sq = nullptr;  // second moment v, FP32, updated in place (unless exp_avg_sq_out)
  const void* grad = nullptr;   // gradients, grad_dtype; read only
  DType grad_dtype = DType::kFp32;
  void* param_copy = nullptr;  // optional: the updated weights written as param_copy_dtype
  DType param_copy_dtype = DType::kBf16;  // kFp16 or kBf16 (kFp32 allowed: a plain copy)
  std::size_t n = 0;                      // elements
  // Optional, all three or none (CpuAdam only): where the updated state goes, the three arrays
  // above then read only (a new version beside the old one, as the speculative update writes). They
  // overlap no other array. Bitwise the same values as the update in place.
  float* param_out = nullptr;
  float* exp_avg_out = nullptr;
  float* exp_avg_sq_out = nullptr;
};

// CPU code path. kAuto = the best this CPU supports, unless $STRATA_ADAM_PATH
// (avx512 | avx2 | scalar) says otherwise. Forcing a path the CPU lacks throws Error(kUnsupported).
enum class AdamPath { kAuto, kAvx512, kAvx2, kScalar };
const char* adam_path_name(AdamPath p);  // "auto" | "avx512" | "avx2" | "scalar"
// The path kAuto resolves to on this machine (honours $STRATA_ADAM_PATH).
AdamPath adam_default_path();
bool adam_path_supported(AdamPath p);  // CPUID (and OS support for the register state)

struct AdamStepOptions {
  std::int64_t step = 1;     // this update's step number, >= 1 (the group's count after ++)
  float grad_scale = 1.0f;   // multiplies every gradient: clip_coef / loss_scale
  bool check_finite = true;  // see "Non-finite gradients" above
  // Divides every gradient before grad_scale: the number of ranks whose gradients were summed
  // (torch's average is sum / N in FP32; multiplying by float(1/N) differs for N = 3). > 0 and
  // finite; 1 = no division (bitwise the same as before the option existed).
  float grad_divisor = 1.0f;
};

struct AdamStepResult {
  bool applied = true;  // false: a gradient was inf/NaN and nothing was written
};

// Result of a pass over the gradients ((g / grad_divisor) * grad_scale): finite flag and the sum of
// squares (float partial sums over blocks of 2048, added in double; meaningless when !finite) for
// the global norm / clip coefficient.
struct AdamGradStats {
  bool finite = true;
  double sum_sq = 0.0;
};

// CPU Adam with a persistent thread pool (threads are created once, in the constructor; a step
// splits the arrays into cache-sized tiles handed to the workers and the calling thread).
// Ownership: owns its worker threads, joins them in the destructor. Not copyable or movable.
class CpuAdam {
 public:
  // threads: total threads working on a step, including the caller; 0 = hardware concurrency.
  // path: kAuto = adam_default_path().
  explicit CpuAdam(unsigned threads = 0, AdamPath path = AdamPath::kAuto);
  ~CpuAdam();
  CpuAdam(const CpuAdam&) = delete;
  CpuAdam& operator=(const CpuAdam&) = delete;

  AdamPath path() const;  // the resolved path (never kAuto)
  unsigned threads() const;

  AdamStepResult step(const AdamParams& params, const AdamTensors& t, const AdamStepOptions& o);

  // Finite check + sum of squares over n gradients (times grad_scale), on the pool's threads. The
  // sum is formed per tile of kStatsTileElems elements, and the tiles' sums are added in order
  // starting from 0.0: splitting a call at multiples of kStatsTileElems and adding the parts'
  // sum_sq in order gives the same bits (how the engine checks gradients spilled to NVMe).
  static constexpr std::size_t kStatsTileElems = 32768;
  // grad_divisor: as AdamStepOptions::grad_divisor (each value is (g / grad_divisor) * grad_scale).
  AdamGradStats grad_stats(const void* grad, DType dtype, std::size_t n, float grad_scale = 1.0f,
                           float grad_divisor = 1.0f);
  // The same pass continued over the next part of the array: this part's tile sums are added to
  // so_far.sum_sq in order (finite flags ANDed). Parts that are whole multiples of
  // kStatsTileElems (all but the last) give bitwise what one grad_stats over the whole array gives.
  AdamGradStats grad_stats_continue(const AdamGradStats& so_far, const void* grad, DType dtype,
                                    std::size_t n, float grad_scale = 1.0f,
                                    float grad_divisor = 1.0f);

  // The same pass, tile by tile: tile t's sum of squares (over elements [t, t + 1) *
  // kStatsTileElems of grad) into tile_sums[t] and its finite flag into tile_finite[t] (1 finite,
  // 0 not), for tiles_of(n) tiles. Adding the tiles' sums in order to a running sum gives the bits
  // grad_stats_continue gives (how the engine computes statistics ahead, during the backward).
  static std::size_t tiles_of(std::size_t n) { return (n + kStatsTileElems - 1) / kStatsTileElems; }
  void grad_stats_tiles(const void* grad, DType dtype, std::size_t n, double* tile_sums,
                        std::uint8_t* tile_finite, float grad_scale = 1.0f,
                        float grad_divisor = 1.0f);

  // For benchmarks: a plain stream kernel with step()'s memory access pattern (reads param,
  // exp_avg, exp_avg_sq, grad; writes param, exp_avg, exp_avg_sq — or, out of place, param_out,
  // exp_avg_out, exp_avg_sq_out with the stores step() uses there — and, when set, param_copy in
  // its dtype), on the same threads and tiles. Trivial arithmetic; it overwrites the written
  // arrays' contents. The bandwidth it reaches is the bound step() is measured against.
  void stream_reference(const AdamTensors& t);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Conversions used by the kernels (round to nearest even; NaN stays NaN), exposed for callers
// and tests. Any length and alignment.
void convert_fp32_to_bf16(const float* src, std::uint16_t* dst, std::size_t n);
void convert_fp32_to_fp16(const float* src, std::uint16_t* dst, std::size_t n);
void convert_bf16_to_fp32(const std::uint16_t* src, float* dst, std::size_t n);
void convert_fp16_to_fp32(const std::uint16_t* src, float* dst, std::size_t n);

// --- On a Device ---------------------------------------------------------------------------------
class Device;
class Stream;

// Adam on a Device for arrays that live in host memory (pinned buffers of the offloaded step, or
// host-resident state): each step() copies master, moments and gradients to device memory, runs the
// update there and copies master, moments and the param copy back (into param_out, exp_avg_out,
// exp_avg_sq_out when given: an update out of place, the inputs unchanged), on one stream,
// returning when it is done. On a CUDA device the update is adam_step_cuda; on the host-emulated
// device it is CpuAdam run on the stream's worker, so that the same code path is tested without a
// GPU (and is bitwise identical to CpuAdam). Device buffers grow to the largest n seen and are
// kept. Failure: Error(kOutOfMemory) for device memory, Error(kDevice) for a failed copy or kernel,
// Error(kTimeout) past `timeout`; the host arrays are then in an unknown state (partly copied
// back) and the caller must treat its step as failed. o.check_finite must be false (check the
// gradients first, as the engine does): Error(kInvalidArgument) otherwise.
// Ownership: borrows `device` (must outlive this); owns its stream and buffers.
// Thread-safety: one caller at a time.
class DeviceAdam {
 public:
  DeviceAdam(Device& device, unsigned cpu_threads, std::chrono::milliseconds timeout);
  ~DeviceAdam();
  DeviceAdam(const DeviceAdam&) = delete;
  DeviceAdam& operator=(const DeviceAdam&) = delete;

  void step(const AdamParams& params, const AdamTensors& host, const AdamStepOptions& o);
  // The same update on arrays that already live in the device's memory (optimizer state placed on
  // gpu): no copies; on a CUDA device adam_step_cuda on this object's stream, on the host-emulated
  // device CpuAdam on the stream's worker. Returns when it is done. Failures as step().
  void step_resident(const AdamParams& params, const AdamTensors& device, const AdamStepOptions& o);
  // Stream-ordered batches (several parameter groups of one chunk: one wait, not one per group):
  // enqueue() / enqueue_resident() queue what step() / step_resident() do and return at once;
  // wait() returns when everything queued is done (the arrays may then be read, reused or freed)
  // and reports a failure of any of it. The arrays of every queued update must stay valid until
  // then. A queued step() that needs larger device buffers than the batch's earlier ones first
  // waits for them (the buffers are reallocated). An enqueue that fails has waited for what was
  // queued before it rethrows (Error(kTimeout) instead when that did not finish in time: the
  // arrays may still be in use).
  void enqueue(const AdamParams& params, const AdamTensors& host, const AdamStepOptions& o);
  void enqueue_resident(const AdamParams& params, const AdamTensors& device,
                        const AdamStepOptions& o);
  void wait();
  // After wait(): when the last update enqueue() queued finished on the device (its copies back
  // included): how long the device side took, for a caller that splits work with the CPU.
  std::chrono::steady_clock::time_point completed_at() const;
  std::uint64_t device_bytes() const;  // device memory held
  const Device& device() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// --- CUDA ---------------------------------------------------------------------------------------
// Whether this build has the CUDA kernels (they may still fail at run time without a device).
bool adam_cuda_available();

// Same update on device pointers, enqueued on `stream` (a cudaStream_t; nullptr = the legacy
// default stream); returns once enqueued (asynchronous, no host synchronization).
// Non-finite handling is asynchronous too: with check_finite, `device_found_nonfinite` (an int in
// device memory the caller owns and zeroes) is required; a check kernel sets it to 1 if a
// gradient is inf/NaN, and the update kernel does nothing when it is non-zero. The flag is sticky,
// so one flag can guard several calls (check all groups first, then update them all). Without
// check_finite the flag may be null and is ignored.
// Throws Error(kUnsupported) when built without CUDA, Error(kDevice) when a launch fails,
// Error(kInvalidArgument) like the CPU version.
void adam_step_cuda(const AdamParams& params, const AdamTensors& t, const AdamStepOptions& o,
                    void* stream, int* device_found_nonfinite = nullptr);

// Enqueues only the check: sets *device_found_nonfinite = 1 if any (grad / grad_divisor) *
// grad_scale is inf/NaN.
void adam_check_finite_cuda(const void* grad, DType dtype, std::size_t n, float grad_scale,
                            int* device_found_nonfinite, void* stream, float grad_divisor = 1.0f);

}  // namespace strata
