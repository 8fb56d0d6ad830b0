// Internal: the CUDA kernels' element update written once over its arithmetic (adam_update<Ops>),
// and the NaN an x86 CPU computes (X86NanOps), for device code (adam_cuda.cu) and the fake CUDA
// runtime's reference of it (tests/fakecuda/fake_kernels.cpp) alike.
//
// Why (issue 47, point 6): a GPU's single-precision arithmetic returns one canonical NaN,
// 0x7fffffff, whatever NaN went in, and CUDA's fp16 -> fp32 conversion gives it too. An x86 CPU
// (SSE / AVX / AVX-512, the CPU kernels) passes the first NaN operand on, quieted (sign and payload
// kept), and makes the "indefinite" NaN 0xffc00000 (sign set) for an invalid operation (inf - inf,
// 0 * inf, inf / inf, sqrt of a negative); core's fp16 -> fp32 conversion keeps a NaN's sign and
// payload. So a NaN master weight of sign 1 gives the CPU kernels' fp16 copy 0xfe00
// (float_to_half keeps the sign) and the GPU's arithmetic 0x7e00. The kernels evaluate an element
// whose result is NaN (rare: a NaN in the state, or non-finite gradients with the finite check
// off) again with X86NanOps, so that the GPU stores the CPU kernels' bits.
//
// The x86 rules, operation by operation: the first NaN operand in the order the expression names
// them (a, b, c), quieted (bit 22 set); else the IEEE result, and 0xffc00000 if that is a NaN.
// Where two NaN operands meet in one operation, x86 returns its first source operand, which for
// an addition, a multiplication or an FMA is the compiler's choice of operand order: there the
// CPU kernels' own bits are not fixed by the source, and this takes the source's order.
#pragma once

#include <cstdint>
#include <cstring>

#include "optim/adam_kernels.hpp"

#if defined(__CUDACC__)
#define STRATA_HD __host__ __device__ __forceinline__
#else
#define STRATA_HD inline
#endif

namespace strata::optim {

STRATA_HD std::uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}
STRATA_HD float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}
STRATA_HD bool nan_bits(float x) { return (float_bits(x) & 0x7fffffffu) > 0x7f800000u; }

// An fp16 NaN widened as core's half_to_float does it: sign and payload kept, not quieted.
STRATA_HD bool fp16_is_nan(std::uint16_t h) { return (h & 0x7fffu) > 0x7c00u; }
STRATA_HD float fp16_nan_as_cpu(std::uint16_t h) {
  return bits_float((std::uint32_t(h & 0x8000u) << 16) | 0x7f800000u |
                    (std::uint32_t(h & 0x3ffu) << 13));
}

// The element's update in the kernels' operation order (torch's; adam_kernel_body.hpp's
// s_adam_elem is the CPU kernels' copy of it), over Ops' correctly rounded add, mul, div, fma and
// sqrt.
template <class Ops>
STRATA_HD void adam_update(const AdamConsts& c, float& p, float& m, float& v, float g) {
  if (c.has_divisor) g = Ops::div(g, c.grad_divisor);
  g = Ops::mul(g, c.grad_scale);
  if (c.has_weight_decay) {
    if (c.adamw)
      p = Ops::mul(p, c.decay_mul);
    else
      g = Ops::fma(p, c.weight_decay, g);
  }
  m = Ops::fma(g, c.one_minus_beta1, Ops::mul(m, c.beta1));
  v = Ops::fma(Ops::mul(c.one_minus_beta2, g), g, Ops::mul(v, c.beta2));
  const float denom = Ops::add(Ops::div(Ops::sqrt(v), c.bc2_sqrt), c.eps);
  p = Ops::add(p, Ops::div(Ops::mul(c.neg_step_size, m), denom));
}

// Round-to-nearest-even arithmetic with x86's NaN results (see the top of this file). Finite and
// infinite results are the IEEE ones, as on both machines.
struct X86NanOps {
  STRATA_HD static float quiet(float a) { return bits_float(float_bits(a) | 0x00400000u); }
  STRATA_HD static float result(float r) { return nan_bits(r) ? bits_float(0xffc00000u) : r; }
  STRATA_HD static float add(float a, float b) {
    if (nan_bits(a)) return quiet(a);
    if (nan_bits(b)) return quiet(b);
#if defined(__CUDA_ARCH__)
    return result(__fadd_rn(a, b));
#else
    return result(a + b);
#endif
  }
  STRATA_HD static float mul(float a, float b) {
    if (nan_bits(a)) return quiet(a);
    if (nan_bits(b)) return quiet(b);
#if defined(__CUDA_ARCH__)
    return result(__fmul_rn(a, b));
#else
    return result(a * b);
#endif
  }
  STRATA_HD static float div(float a, float b) {
    if (nan_bits(a)) return quiet(a);
    if (nan_bits(b)) return quiet(b);
#if defined(__CUDA_ARCH__)
    return result(__fdiv_rn(a, b));
#else
    return result(a / b);
#endif
  }
  STRATA_HD static float fma(float a, float b, float c) {
    if (nan_bits(a)) return quiet(a);
    if (nan_bits(b)) return quiet(b);
    if (nan_bits(c)) return quiet(c);
#if defined(__CUDA_ARCH__)
    return result(__fmaf_rn(a, b, c));
#else
    return result(__builtin_fmaf(a, b, c));
#endif
  }
  STRATA_HD static float sqrt(float a) {
    if (nan_bits(a)) return quiet(a);
#if defined(__CUDA_ARCH__)
    return result(__fsqrt_rn(a));
#else
    return result(__builtin_sqrtf(a));
#endif
  }
};

}  // namespace strata::optim
