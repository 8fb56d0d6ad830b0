// Helpers for the optimizer tests: independent reference conversions, a double-precision Adam
// reference, random state, error metrics.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "strata/adam.hpp"

namespace strata::testing {

inline const char* dt_name(DType d) {
  return d == DType::kFp32 ? "fp32" : d == DType::kBf16 ? "bf16" : "fp16";
}
inline std::size_t dt_size(DType d) { return d == DType::kFp32 ? 4 : 2; }

inline std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16 -> float: exact.
inline float ref_bf16_to_f(std::uint16_t h) { return float_of(std::uint32_t(h) << 16); }

// float -> bf16, round to nearest even, chosen by comparing distances in double (independent of
// the kernels' bit trick). NaN -> 0x7FC0 (torch's choice).
inline std::uint16_t ref_f_to_bf16(float x) {
  if (std::isnan(x)) return 0x7FC0;
  const std::uint32_t u = bits_of(x);
  const std::uint32_t lo = u & 0xFFFF0000u;
  if (lo == u) return std::uint16_t(lo >> 16);
  const std::uint32_t hi = lo + 0x10000u;  // next bf16 away from zero (may become inf)
  const double dx = x, dlo = float_of(lo);
  // the magnitude above lo: if hi is inf (exponent overflow), use 2^128 as its value
  const double dhi = ((hi & 0x7F800000u) == 0x7F800000u) ? std::copysign(std::ldexp(1.0, 128), dx)
                                                         : double(float_of(hi));
  const double dl = std::fabs(dx - dlo), dh = std::fabs(dhi - dx);
  if (dl < dh) return std::uint16_t(lo >> 16);
  if (dh < dl) return std::uint16_t(hi >> 16);
  return ((lo >> 16) & 1u) ? std::uint16_t(hi >> 16) : std::uint16_t(lo >> 16);
}

// fp16 via the compiler's _Float16 (correctly rounded conversions).
inline float ref_fp16_to_f(std::uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}
inline std::uint16_t ref_f_to_fp16(float x) {
  _Float16 v = static_cast<_Float16>(x);
  std::uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}

inline float ref_grad(DType dt, const void* g, std::size_t i) {
  switch (dt) {
    case DType::kFp32: return static_cast<const float*>(g)[i];
    case DType::kBf16: return ref_bf16_to_f(static_cast<const std::uint16_t*>(g)[i]);
    default: return ref_fp16_to_f(static_cast<const std::uint16_t*>(g)[i]);
  }
}

// One Adam/AdamW step in double arithmetic on double state.
// torch_constants: the hyper-parameter constants are rounded to FP32 where torch 1.13 hands its
//   Python floats to FP32 kernels (beta1, 1-beta1, beta2, 1-beta2, weight_decay, 1-lr*wd,
//   sqrt(bc2), eps, lr/bc1). That rounding is part of torch's FP32 semantics (e.g. float(0.99999)
//   drifts AdamW's decay by ~3e-8 per step); without it this is the exact mathematical update.
// fp32_state: the state is FP32 and rounded where torch's in-place ops store it: p after the
//   decoupled decay (param.mul_), m after mul_ and after add_, v after mul_ and after addcmul_,
//   p after addcdiv_. Everything else (products, sqrt, division, eps) stays in double. (A reference
//   rounding p only once per step drifts from torch's FP32 AdamW by up to ~5e-6 in 100 steps:
//   the separate decay rounding is biased the same way step after step.)
inline void ref_adam_step(const AdamParams& hp, std::int64_t step, double grad_scale, double* p,
                          double* m, double* v, const std::vector<float>& grads_f32,
                          bool fp32_state, bool torch_constants = true) {
  auto k = [&](double x) { return torch_constants ? double(float(x)) : x; };
  auto st = [&](double x) { return fp32_state ? double(float(x)) : x; };
  const double bc1 = 1.0 - std::pow(hp.beta1, double(step));
  const double bc2 = 1.0 - std::pow(hp.beta2, double(step));
  const double b1 = k(hp.beta1), omb1 = k(1.0 - hp.beta1), b2 = k(hp.beta2),
               omb2 = k(1.0 - hp.beta2), wd = k(hp.weight_decay),
               decay = k(1.0 - hp.lr * hp.weight_decay), bc2s = k(std::sqrt(bc2)), eps = k(hp.eps),
               step_size = k(hp.lr / bc1), scale = k(grad_scale);
  for (std::size_t i = 0; i < grads_f32.size(); ++i) {
    double g = double(grads_f32[i]) * scale;
    if (hp.type == OptimizerType::kAdam)
      g += wd * p[i];
    else
      p[i] = st(p[i] * decay);
    m[i] = st(st(b1 * m[i]) + omb1 * g);
    v[i] = st(st(b2 * v[i]) + omb2 * g * g);
    const double denom = std::sqrt(v[i]) / bc2s + eps;
    p[i] = st(p[i] - step_size * m[i] / denom);
  }
}

// max_i |a_i - r_i| / max(|r_i|, floor)
inline double max_rel_err(const float* a, const double* r, std::size_t n, double floor) {
  double e = 0;
  for (std::size_t i = 0; i < n; ++i)
    e = std::max(e, std::fabs(double(a[i]) - r[i]) / std::max(std::fabs(r[i]), floor));
  return e;
}
// ||a - r||_2 / ||r||_2
inline double norm_rel_err(const float* a, const double* r, std::size_t n) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    num += (double(a[i]) - r[i]) * (double(a[i]) - r[i]);
    den += r[i] * r[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Random gradients as float (values exactly representable in `dt`) plus their raw encoding.
struct RandomGrads {
  std::vector<float> f32;           // the values the kernel sees (after decoding)
  std::vector<std::uint16_t> half;  // raw bf16/fp16 bits (empty for fp32)
  const void* data(DType dt) const {
    return dt == DType::kFp32 ? static_cast<const void*>(f32.data()) : half.data();
  }
};
inline RandomGrads random_grads(std::mt19937_64& rng, std::size_t n, DType dt, float sigma) {
  std::normal_distribution<float> nd(0.0f, sigma);
  RandomGrads r;
  r.f32.resize(n);
  if (dt != DType::kFp32) r.half.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    float x = nd(rng);
    if (dt == DType::kBf16) {
      r.half[i] = ref_f_to_bf16(x);
      x = ref_bf16_to_f(r.half[i]);
    } else if (dt == DType::kFp16) {
      r.half[i] = ref_f_to_fp16(x);
      x = ref_fp16_to_f(r.half[i]);
    }
    r.f32[i] = x;
  }
  return r;
}

inline std::vector<AdamPath> supported_paths() {
  std::vector<AdamPath> out;
  for (AdamPath p : {AdamPath::kScalar, AdamPath::kAvx2, AdamPath::kAvx512})
    if (adam_path_supported(p)) out.push_back(p);
  return out;
}

}  // namespace strata::testing
