// CUDA Adam/AdamW: the same update as the CPU kernels (adam_kernel_body.hpp), element by element,
// in torch's operation order with explicitly rounded intrinsics (no FMA contraction beyond the
// ones torch's CPU kernels use), bf16/fp16 conversions with round to nearest even. A NaN result
// carries the CPU kernels' bits, not the GPU's canonical NaN (optim/adam_nan.hpp): an element
// whose update is NaN is evaluated again with x86's NaN rules, out of line.
// Non-finite handling is asynchronous: a check kernel sets a device flag, the update kernel
// returns immediately when the flag is set.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda/device_guard.hpp"
#include "optim/accumulate.hpp"
#include "optim/adam_kernels.hpp"
#include "optim/adam_nan.hpp"
#include "strata/error.hpp"

namespace strata {

namespace {

using optim::AdamConsts;
using optim::CopyKind;

constexpr int kBlock = 256;

void check_cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();  // never leave a non-sticky error for someone else's check
  fail(ErrorCode::kDevice, strcat(what, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
}

// Clears the thread's last-error slot before a launch, so that the check after it reports the
// launch and not what an earlier call left there (a cudaErrorNotReady from a stream query, say).
// A sticky error (the context is broken) cannot be cleared: it is reported here.
void clear_last_error(const char* who) {
  const cudaError_t stale = cudaGetLastError();
  if (stale != cudaSuccess && cudaPeekAtLastError() == stale)
    check_cuda(stale, strcat(who, ": the CUDA context is broken").c_str());
}

// `dev`: the device of the launch's stream (which the caller made current).
unsigned grid_for(std::size_t work, int dev) {
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
             "adam_step_cuda: cudaDeviceGetAttribute(multiProcessorCount)");
  const std::size_t want = (work + kBlock - 1) / kBlock;
  const std::size_t cap = std::size_t(sms > 0 ? sms : 1) * 16;
  return unsigned(want < cap ? (want ? want : 1) : cap);
}

// GD: 0 fp32, 1 bf16, 2 fp16.
template <int GD>
__device__ __forceinline__ float grad_at(const void* g, std::size_t i) {
  if constexpr (GD == 0) return static_cast<const float*>(g)[i];
  if constexpr (GD == 1) return __bfloat162float(static_cast<const __nv_bfloat16*>(g)[i]);
  if constexpr (GD == 2) return __half2float(static_cast<const __half*>(g)[i]);
  return 0.0f;
}

// A stored value as the CPU kernels read it (core/numeric.hpp load_elem): as grad_at<D>, except
// an fp16 NaN, which the CPU widens with its sign and payload and CUDA's __half2float to the
// canonical NaN. For the NaN paths only (cpu_nan_elem, cpu_nan_accumulate).
template <int D>
__device__ __forceinline__ float cpu_load(const void* a, std::size_t i) {
  if constexpr (D == 2) {
    const std::uint16_t h = static_cast<const std::uint16_t*>(a)[i];
    if (optim::fp16_is_nan(h)) return optim::fp16_nan_as_cpu(h);
  }
  return grad_at<D>(a, i);
}

// The 16-bit copies, NaN included, exactly as the CPU kernels (core/numeric.hpp, torch's CPU
// conversions): CUDA's conversions canonicalise NaN to 0x7fff, the CPU's give bf16 0x7fc0 and
// fp16 sign|0x7e00 (the sign of the NaN they are given: the CPU's, see cpu_nan_elem). Finite and
// infinite values round the same way on both.
__device__ __forceinline__ std::uint16_t bf16_bits(float p) {
  if (isnan(p)) return 0x7fc0;
  return __bfloat16_as_ushort(__float2bfloat16_rn(p));
}
__device__ __forceinline__ std::uint16_t fp16_bits(float p) {
  if (isnan(p)) return std::uint16_t(((__float_as_uint(p) >> 16) & 0x8000u) | 0x7e00u);
  return __half_as_ushort(__float2half_rn(p));
}

template <int CK>
__device__ __forceinline__ void store_copy(void* out, std::size_t i, float p) {
  if constexpr (CK == int(CopyKind::kFp32)) static_cast<float*>(out)[i] = p;
  if constexpr (CK == int(CopyKind::kBf16)) static_cast<std::uint16_t*>(out)[i] = bf16_bits(p);
  if constexpr (CK == int(CopyKind::kFp16)) static_cast<std::uint16_t*>(out)[i] = fp16_bits(p);
}

// The correctly rounded intrinsics, no contraction (optim::adam_update's Ops).
struct RnOps {
  static __device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
  static __device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
  static __device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
  static __device__ __forceinline__ float fma(float a, float b, float c) {
    return __fmaf_rn(a, b, c);
  }
  static __device__ __forceinline__ float sqrt(float a) { return __fsqrt_rn(a); }
};

__device__ __forceinline__ void adam_elem(const AdamConsts& c, float& p, float& m, float& v,
                                          float g) {
  optim::adam_update<RnOps>(c, p, m, v, g);
}

// Element j, updated and stored with the CPU kernels' NaN (optim/adam_nan.hpp: X86NanOps gives
// the same finite and infinite results as RnOps), from its inputs, still in memory: for an
// iteration whose update made a NaN p, as it does wherever m or v came out NaN, and which stored
// nothing.
template <int GD, int CK>
__device__ __forceinline__ void cpu_nan_elem(const AdamConsts& c, float* p, float* m, float* v,
                                             const void* g, void* out, std::size_t j) {
  float pj = p[j], mj = m[j], vj = v[j];
  optim::adam_update<optim::X86NanOps>(c, pj, mj, vj, cpu_load<GD>(g, j));
  p[j] = pj;
  m[j] = mj;
  v[j] = vj;
  store_copy<CK>(out, j, pj);
}

// Elements [i, i + k) so, out of line: the vec4 loop pays one test per element for it and holds
// no registers for it; `c` is the kernel's parameter itself (__grid_constant__), not a copy in
// local memory. (The element-wise loop takes cpu_nan_elem inline: fewer registers there.)
template <int GD, int CK>
__device__ __noinline__ void cpu_nan_elems(const AdamConsts& c, float* p, float* m, float* v,
                                           const void* g, void* out, std::size_t i, std::size_t k) {
  for (std::size_t j = i; j < i + k; ++j) cpu_nan_elem<GD, CK>(c, p, m, v, g, out, j);
}

// The registers of the kernels before the NaN paths (sm_80 / sm_90, ptxas -v): at most 40 with
// vec4 and 32 without (6 and 8 blocks of 256 threads per SM); the NaN paths must not lower that
// occupancy (without the cap the element-wise variant without a copy takes 33). __maxnreg__:
// CUDA 12.4.
#if __CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4)
#define STRATA_ADAM_MAXNREG(vec4) __maxnreg__((vec4) ? 40 : 32)
#else
#define STRATA_ADAM_MAXNREG(vec4)
#endif

// vec4: p, m, v (and a 4-byte copy / grad) are 16-byte aligned, 16-bit arrays 8-byte aligned;
// then 4 elements per thread per iteration with vector loads; the tail (n % 4) element-wise.
template <int GD, int CK, bool kVec4>
__global__ void STRATA_ADAM_MAXNREG(kVec4)
    adam_kernel(const __grid_constant__ AdamConsts c, float* p, float* m, float* v, const void* g,
                void* out, std::size_t n, const int* skip_flag) {
  if (skip_flag && *static_cast<const volatile int*>(skip_flag) != 0) return;
  const std::size_t stride = std::size_t(blockDim.x) * gridDim.x;
  const std::size_t tid = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  std::size_t done = 0;
  if constexpr (kVec4) {
    const std::size_t n4 = n / 4;
    for (std::size_t q = tid; q < n4; q += stride) {
      float4 pv = reinterpret_cast<float4*>(p)[q];
      float4 mv = reinterpret_cast<float4*>(m)[q];
      float4 vv = reinterpret_cast<float4*>(v)[q];
      float gv[4];
      if constexpr (GD == 0) {
        const float4 t = reinterpret_cast<const float4*>(g)[q];
        gv[0] = t.x, gv[1] = t.y, gv[2] = t.z, gv[3] = t.w;
      } else {
        const uint2 raw = reinterpret_cast<const uint2*>(g)[q];
        const std::uint16_t h[4] = {std::uint16_t(raw.x), std::uint16_t(raw.x >> 16),
                                    std::uint16_t(raw.y), std::uint16_t(raw.y >> 16)};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if constexpr (GD == 1)
            gv[k] = __uint_as_float(std::uint32_t(h[k]) << 16);
          else
            gv[k] = __half2float(__ushort_as_half(h[k]));
        }
      }
      adam_elem(c, pv.x, mv.x, vv.x, gv[0]);
      adam_elem(c, pv.y, mv.y, vv.y, gv[1]);
      adam_elem(c, pv.z, mv.z, vv.z, gv[2]);
      adam_elem(c, pv.w, mv.w, vv.w, gv[3]);
      if (isnan(pv.x) || isnan(pv.y) || isnan(pv.z) || isnan(pv.w)) {
        cpu_nan_elems<GD, CK>(c, p, m, v, g, out, q * 4, 4);
        continue;
      }
      reinterpret_cast<float4*>(p)[q] = pv;
      reinterpret_cast<float4*>(m)[q] = mv;
      reinterpret_cast<float4*>(v)[q] = vv;
      if constexpr (CK == int(CopyKind::kFp32)) {
        reinterpret_cast<float4*>(out)[q] = pv;
      } else if constexpr (CK == int(CopyKind::kBf16) || CK == int(CopyKind::kFp16)) {
        std::uint16_t h[4];
        const float ps[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if constexpr (CK == int(CopyKind::kBf16))
            h[k] = bf16_bits(ps[k]);
          else
            h[k] = fp16_bits(ps[k]);
        }
        reinterpret_cast<uint2*>(out)[q] =
            make_uint2(std::uint32_t(h[0]) | (std::uint32_t(h[1]) << 16),
                       std::uint32_t(h[2]) | (std::uint32_t(h[3]) << 16));
      }
    }
    done = n4 * 4;
  }
  for (std::size_t i = done + tid; i < n; i += stride) {
    float pi = p[i], mi = m[i], vi = v[i];
    adam_elem(c, pi, mi, vi, grad_at<GD>(g, i));
    if (isnan(pi)) {
      cpu_nan_elem<GD, CK>(c, p, m, v, g, out, i);
      continue;
    }
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    store_copy<CK>(out, i, pi);
  }
}

template <int GD>
__global__ void check_kernel(const void* g, std::size_t n, float divisor, float scale, int* flag) {
  const std::size_t stride = std::size_t(blockDim.x) * gridDim.x;
  bool bad = false;
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float x = grad_at<GD>(g, i);
    if (divisor != 1.0f) x = __fdiv_rn(x, divisor);
    bad |= !isfinite(__fmul_rn(x, scale));
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

// Gradient accumulation (accumulate.hpp): DD / SD the dtypes of dst / src (0 fp32, 1 bf16,
// 2 fp16); ADD: dst = round_DD(dst + src) (one __fadd_rn, no contraction), else dst =
// round_DD(src). A NaN result is the CPU's (accumulate_elems: dst + src with x86's NaN, from the
// CPU's widening; cpu_nan_accumulate), 16-bit results round to nearest even with the CPU's NaN
// bits (bf16_bits / fp16_bits).
template <int DD>
__device__ __forceinline__ void store_elem(void* out, std::size_t i, float x) {
  if constexpr (DD == 0) static_cast<float*>(out)[i] = x;
  if constexpr (DD == 1) static_cast<std::uint16_t*>(out)[i] = bf16_bits(x);
  if constexpr (DD == 2) static_cast<std::uint16_t*>(out)[i] = fp16_bits(x);
}

template <int DD, int SD, bool ADD>
__device__ __noinline__ float cpu_nan_accumulate(const void* dst, const void* src, std::size_t i) {
  const float s = cpu_load<SD>(src, i);
  return ADD ? optim::X86NanOps::add(cpu_load<DD>(dst, i), s) : s;
}

template <int DD, int SD, bool ADD>
__global__ void accumulate_kernel(void* dst, const void* src, std::size_t n) {
  const std::size_t stride = std::size_t(blockDim.x) * gridDim.x;
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float s = grad_at<SD>(src, i);
    float x = ADD ? __fadd_rn(grad_at<DD>(dst, i), s) : s;
    if (isnan(x)) x = cpu_nan_accumulate<DD, SD, ADD>(dst, src, i);
    store_elem<DD>(dst, i, x);
  }
}

int dtype_code(DType t) { return t == DType::kFp32 ? 0 : t == DType::kBf16 ? 1 : 2; }

template <int DD, int SD>
void launch_accumulate(void* dst, const void* src, std::size_t n, bool add, cudaStream_t s,
                       int dev) {
  if (add)
    accumulate_kernel<DD, SD, true><<<grid_for(n, dev), kBlock, 0, s>>>(dst, src, n);
  else
    accumulate_kernel<DD, SD, false><<<grid_for(n, dev), kBlock, 0, s>>>(dst, src, n);
}

// The pairs the engine uses: a dtype into itself, a 16-bit dtype into fp32.
void launch_accumulate(int dd, int sd, void* dst, const void* src, std::size_t n, bool add,
                       cudaStream_t s, int dev) {
  if (dd == 0 && sd == 0) return launch_accumulate<0, 0>(dst, src, n, add, s, dev);
  if (dd == 1 && sd == 1) return launch_accumulate<1, 1>(dst, src, n, add, s, dev);
  if (dd == 2 && sd == 2) return launch_accumulate<2, 2>(dst, src, n, add, s, dev);
  if (dd == 0 && sd == 1) return launch_accumulate<0, 1>(dst, src, n, add, s, dev);
  if (dd == 0 && sd == 2) return launch_accumulate<0, 2>(dst, src, n, add, s, dev);
  fail(ErrorCode::kInvalidArgument, "accumulate_cuda: unsupported pair of dtypes");
}

template <int GD, int CK>
void launch_adam(const AdamConsts& c, const AdamTensors& t, bool vec4, const int* flag,
                 cudaStream_t s, int dev) {
  const std::size_t work = vec4 ? (t.n + 3) / 4 : t.n;
  const unsigned grid = grid_for(work, dev);
  if (vec4)
    adam_kernel<GD, CK, true><<<grid, kBlock, 0, s>>>(c, t.param, t.exp_avg, t.exp_avg_sq, t.grad,
                                                      t.param_copy, t.n, flag);
  else
    adam_kernel<GD, CK, false><<<grid, kBlock, 0, s>>>(c, t.param, t.exp_avg, t.exp_avg_sq, t.grad,
                                                       t.param_copy, t.n, flag);
}

template <int GD>
void launch_copy_kind(const AdamConsts& c, const AdamTensors& t, CopyKind ck, bool vec4,
                      const int* flag, cudaStream_t s, int dev) {
  switch (ck) {
    case CopyKind::kNone: return launch_adam<GD, int(CopyKind::kNone)>(c, t, vec4, flag, s, dev);
    case CopyKind::kFp32: return launch_adam<GD, int(CopyKind::kFp32)>(c, t, vec4, flag, s, dev);
    case CopyKind::kFp16: return launch_adam<GD, int(CopyKind::kFp16)>(c, t, vec4, flag, s, dev);
    case CopyKind::kBf16: return launch_adam<GD, int(CopyKind::kBf16)>(c, t, vec4, flag, s, dev);
  }
}

bool aligned(const void* p, std::size_t a) {
  return p == nullptr || reinterpret_cast<std::uintptr_t>(p) % a == 0;
}

}  // namespace

bool adam_cuda_available() { return true; }

void adam_check_finite_cuda(const void* grad, DType dtype, std::size_t n, float grad_scale,
                            int* device_found_nonfinite, void* stream, float grad_divisor) {
  if (n == 0) return;
  if (!grad || !device_found_nonfinite)
    fail(ErrorCode::kInvalidArgument, "adam_check_finite_cuda: null grad or flag pointer");
  if (!(grad_divisor > 0.0f) || !std::isfinite(grad_divisor))
    fail(ErrorCode::kInvalidArgument,
         "adam_check_finite_cuda: grad_divisor must be finite and > 0");
  auto s = static_cast<cudaStream_t>(stream);
  // Kernels launch on the current device: make it the stream's, for this call only.
  const int dev = cuda::stream_device(stream);
  cuda::DeviceGuard guard(dev);
  const unsigned grid = grid_for(n, dev);
  clear_last_error("adam_check_finite_cuda");
  switch (dtype) {
    case DType::kFp32:
      check_kernel<0>
          <<<grid, kBlock, 0, s>>>(grad, n, grad_divisor, grad_scale, device_found_nonfinite);
      break;
    case DType::kBf16:
      check_kernel<1>
          <<<grid, kBlock, 0, s>>>(grad, n, grad_divisor, grad_scale, device_found_nonfinite);
      break;
    case DType::kFp16:
      check_kernel<2>
          <<<grid, kBlock, 0, s>>>(grad, n, grad_divisor, grad_scale, device_found_nonfinite);
      break;
  }
  check_cuda(cudaGetLastError(), "adam_check_finite_cuda: kernel launch");
}

void accumulate_cuda(void* dst, DType dd, const void* src, DType sd, std::size_t n, bool add,
                     void* stream) {
  if (n == 0) return;
  if (!dst || !src) fail(ErrorCode::kInvalidArgument, "accumulate_cuda: null pointer");
  auto s = static_cast<cudaStream_t>(stream);
  const int dev = cuda::stream_device(stream);
  cuda::DeviceGuard guard(dev);
  clear_last_error("accumulate_cuda");
  launch_accumulate(dtype_code(dd), dtype_code(sd), dst, src, n, add, s, dev);
  check_cuda(cudaGetLastError(), "accumulate_cuda: kernel launch");
}

void adam_step_cuda(const AdamParams& params, const AdamTensors& t, const AdamStepOptions& o,
                    void* stream, int* device_found_nonfinite) {
  optim::validate_adam_call(params, t, o, "adam_step_cuda");
  if (t.param_out)
    fail(ErrorCode::kUnsupported,
         "adam_step_cuda: an update out of place (param_out) is CpuAdam's");
  if (o.check_finite && !device_found_nonfinite)
    fail(ErrorCode::kInvalidArgument,
         "adam_step_cuda: check_finite needs device_found_nonfinite (a zeroed device int)");
  if (t.n == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const int dev = cuda::stream_device(stream);
  cuda::DeviceGuard guard(dev);
  if (o.check_finite)
    adam_check_finite_cuda(t.grad, t.grad_dtype, t.n, o.grad_scale, device_found_nonfinite, stream,
                           o.grad_divisor);
  const AdamConsts c = optim::make_adam_consts(params, o);
  const CopyKind ck = optim::copy_kind(t);
  const std::size_t gsz = dtype_size(t.grad_dtype);
  const std::size_t csz = t.param_copy ? dtype_size(t.param_copy_dtype) : 4;
  const bool vec4 = aligned(t.param, 16) && aligned(t.exp_avg, 16) && aligned(t.exp_avg_sq, 16) &&
                    aligned(t.grad, 4 * gsz) && aligned(t.param_copy, 4 * csz);
  const int* flag = o.check_finite ? device_found_nonfinite : nullptr;
  clear_last_error("adam_step_cuda");
  switch (t.grad_dtype) {
    case DType::kFp32: launch_copy_kind<0>(c, t, ck, vec4, flag, s, dev); break;
    case DType::kBf16: launch_copy_kind<1>(c, t, ck, vec4, flag, s, dev); break;
    case DType::kFp16: launch_copy_kind<2>(c, t, ck, vec4, flag, s, dev); break;
  }
  check_cuda(cudaGetLastError(), "adam_step_cuda: kernel launch");
}

}  // namespace strata
