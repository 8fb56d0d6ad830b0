// Internal: the Adam / stream / statistics / conversion kernels, written once over a small
// "vector traits" type V and included by each per-ISA translation unit (adam_kernel_*.cpp), which
// defines V and then calls STRATA_DEFINE_KERNEL_TABLE. Everything here has internal linkage
// (anonymous namespace): the code is compiled with different target flags in each TU.
//
// V provides: F (W floats), H (W 16-bit values), W, load/store (unaligned), load16/store16,
// store_nt/store16_nt (non-temporal: the address aligned to sizeof(F) / sizeof(H)), fence()
// (orders the non-temporal stores before what follows: _mm_sfence),
// set1, add, mul, div, sqrt, fmadd(a, b, c) = a * b + c with one rounding,
// bf16_to_f / f_to_bf16 / fp16_to_f / f_to_fp16 (round to nearest even; bf16 NaN -> 0x7FC0 like
// torch), nan_if_nonfinite(x) = x * 0, and hsum(F) -> float, hsum_nan(F) for the finite check.
//
// Operation order (torch 1.13 _single_tensor_adam / _multi_tensor_adam, CPU kernels):
//   grad.add(param, alpha=wd)         -> fmadd(p, wd, g)
//   param.mul_(1 - lr*wd)             -> p * decay
//   exp_avg.mul_(b1).add_(g, alpha)   -> fmadd(g, 1-b1, m * b1)
//   exp_avg_sq.mul_(b2).addcmul_(g,g) -> fmadd((1-b2) * g, g, v * b2)
// (checked element by element against torch 1.13's CPU kernels: m and v bit-exact.)
//   (sqrt(v) / bc2_sqrt) + eps        -> add(div(sqrt(v), bc2s), eps)
//   param.addcdiv_(m, denom, -step)   -> p + ((-step) * m) / denom
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/numeric.hpp"
#include "optim/adam_kernels.hpp"

namespace {

using strata::DType;
using strata::optim::AdamArrays;
using strata::optim::AdamConsts;
using strata::optim::CopyKind;

// ---- scalar helpers shared by every TU (used for the vector tails, so tails match lanes) -----
// The scalar conversions are core's (one copy, core/numeric.hpp); the vector lanes give the same
// bits.
inline float s_bf16_to_f(std::uint16_t h) { return strata::bf16_to_float(h); }
inline std::uint16_t s_f_to_bf16(float f) { return strata::float_to_bf16(f); }
inline float s_fp16_to_f(std::uint16_t h) { return strata::half_to_float(h); }
inline std::uint16_t s_f_to_fp16(float f) { return strata::float_to_half(f); }

inline float s_load_grad(DType dt, const void* g, std::size_t i) {
  switch (dt) {
    case DType::kFp32: return static_cast<const float*>(g)[i];
    case DType::kBf16: return s_bf16_to_f(static_cast<const std::uint16_t*>(g)[i]);
    default: return s_fp16_to_f(static_cast<const std::uint16_t*>(g)[i]);
  }
}

// One element of the update, in exactly the vector kernels' order.
inline void s_adam_elem(const AdamConsts& c, float& p, float& m, float& v, float g) {
  if (c.has_divisor) g = g / c.grad_divisor;
  g = g * c.grad_scale;
  if (c.has_weight_decay) {
    if (c.adamw)
      p = p * c.decay_mul;
    else
      g = __builtin_fmaf(p, c.weight_decay, g);
  }
  m = __builtin_fmaf(g, c.one_minus_beta1, m * c.beta1);
  v = __builtin_fmaf(c.one_minus_beta2 * g, g, v * c.beta2);
  const float denom = __builtin_sqrtf(v) / c.bc2_sqrt + c.eps;
  p = p + (c.neg_step_size * m) / denom;
}

inline void s_store_copy(CopyKind k, void* out, std::size_t i, float p) {
  switch (k) {
    case CopyKind::kNone: break;
    case CopyKind::kFp32: static_cast<float*>(out)[i] = p; break;
    case CopyKind::kBf16: static_cast<std::uint16_t*>(out)[i] = s_f_to_bf16(p); break;
    case CopyKind::kFp16: static_cast<std::uint16_t*>(out)[i] = s_f_to_fp16(p); break;
  }
}

// ---- vector kernels ----------------------------------------------------------------------------
template <class V, DType GD>
inline typename V::F v_load_grad(const void* g, std::size_t i) {
  if constexpr (GD == DType::kFp32) {
    return V::load(static_cast<const float*>(g) + i);
  } else if constexpr (GD == DType::kBf16) {
    return V::bf16_to_f(V::load16(static_cast<const std::uint16_t*>(g) + i));
  } else {
    return V::fp16_to_f(V::load16(static_cast<const std::uint16_t*>(g) + i));
  }
}

// The updated-parameter copy is written and not read again by the kernel: with `nt` (the copy
// aligned for it, v_copy_nt) it goes out with non-temporal stores, which skip the read for
// ownership of each line (a fp32 copy: 4 of the 36 bytes moved per parameter; measured: Adam
// with a fp32 copy 0.115-0.120 s -> 0.092-0.096 s for 133.5M parameters on 2 threads).
template <class V, CopyKind CK>
inline void v_store_copy(void* out, std::size_t i, typename V::F p, bool nt) {
  if constexpr (CK == CopyKind::kFp32) {
    float* at = static_cast<float*>(out) + i;
    nt ? V::store_nt(at, p) : V::store(at, p);
  } else if constexpr (CK == CopyKind::kBf16 || CK == CopyKind::kFp16) {
    std::uint16_t* at = static_cast<std::uint16_t*>(out) + i;
    const auto h = CK == CopyKind::kBf16 ? V::f_to_bf16(p) : V::f_to_fp16(p);
    nt ? V::store16_nt(at, h) : V::store16(at, h);
  }
}

// The new p, m, v of lanes [i, i + W): out of place (a pending version, not read again before
// the commit) with non-temporal stores where nt, else plain stores.
template <class V>
[[gnu::always_inline]] inline void v_store_state(float* po, float* mo, float* vo, std::size_t i,
                                                 typename V::F pv, typename V::F mv,
                                                 typename V::F vv, bool nt) {
  if (nt) {
    V::store_nt(mo + i, mv);
    V::store_nt(vo + i, vv);
    V::store_nt(po + i, pv);
  } else {
    V::store(mo + i, mv);
    V::store(vo + i, vv);
    V::store(po + i, pv);
  }
}

// Whether a copy of element size `bytes` at `out` can take non-temporal stores: every vector of
// it aligned (the kernel steps W elements from `out`).
template <class V>
inline bool v_copy_nt(const void* out, std::size_t bytes) {
  const std::size_t align = bytes == 4 ? sizeof(typename V::F) : sizeof(typename V::H);
  return out && V::W > 1 && reinterpret_cast<std::uintptr_t>(out) % align == 0;
}

// Software prefetch of array `a` (elements of elem_bytes) `ahead` elements ahead of i, once per 16
// elements (i steps by V::W from 0: once per 64-byte line of fp32), into the cache level
// kLocality names (__builtin_prefetch: 3 = prefetcht0, 1 = prefetcht2). A prefetch never faults;
// the bound check only keeps the address arithmetic inside the array. always_inline: GCC 12
// finds a function of prefetches alone free of side effects and drops its calls at -O2 (no
// prefetch instruction in the object); inlined first, the prefetches stay.
template <int kLocality>
[[gnu::always_inline]] inline void v_prefetch_one(const void* a, std::size_t elem_bytes,
                                                  std::size_t ahead, std::size_t i, std::size_t n) {
  if (i % 16 != 0 || n - i <= ahead) return;
  __builtin_prefetch(static_cast<const char*>(a) + (i + ahead) * elem_bytes, 0, kLocality);
}

// Adam and the stream kernel read p, m, v and g: prefetched kPrefetchAhead elements ahead into
// L1. Adam's long per-element chain (square root, two divisions) keeps fewer demand misses in
// flight than a plain stream; without this it ran at 0.85-0.86 of the same-pattern stream below,
// with it at 0.97-0.98 (50M params, 2 threads, AVX-512; 1 KiB ahead 0.97-0.98, 2 KiB 0.98, 4 KiB
// 0.96, 512 B 0.94-0.95; prefetcht2 instead 0.94-0.96). The stream kernel prefetches the same way
// (it gains about 1 %), so the bound stays the faster of the two patterns.
constexpr std::size_t kPrefetchAhead = 512;
[[gnu::always_inline]] inline void v_prefetch(const float* p, const float* m, const float* v,
                                              const void* g, std::size_t grad_bytes, std::size_t i,
                                              std::size_t n) {
  v_prefetch_one<3>(p, 4, kPrefetchAhead, i, n);
  v_prefetch_one<3>(m, 4, kPrefetchAhead, i, n);
  v_prefetch_one<3>(v, 4, kPrefetchAhead, i, n);
  v_prefetch_one<3>(g, grad_bytes, kPrefetchAhead, i, n);
}

// The statistics pass reads one array: prefetched 1024 elements ahead (4 KiB of fp32) into L2
// (prefetcht2). Measured (133.5M fp32 grads, 2 threads, alternating): none 26-28 ms, prefetcht0
// 21-22 ms (512 ahead 22, 2048 21-22, 4096 21), prefetcht2 19.1-19.5 ms against prefetcht0's
// 19.8-20.3 (four alternating pairs).
constexpr std::size_t kStatsPrefetchAhead = 1024;

template <class V, DType GD, CopyKind CK, bool kWd, bool kAdamW, bool kDiv>
void v_adam(const AdamConsts& c, const AdamArrays& a, const void* g, void* out, std::size_t n) {
  using F = typename V::F;
  const F divisor = V::set1(c.grad_divisor);
  const F scale = V::set1(c.grad_scale), b1 = V::set1(c.beta1), omb1 = V::set1(c.one_minus_beta1),
          b2 = V::set1(c.beta2), omb2 = V::set1(c.one_minus_beta2), wd = V::set1(c.weight_decay),
          decay = V::set1(c.decay_mul), bc2s = V::set1(c.bc2_sqrt), eps = V::set1(c.eps),
          nstep = V::set1(c.neg_step_size);
  const float *p = a.p, *m = a.m, *v = a.v;
  float *po = a.p_out, *mo = a.m_out, *vo = a.v_out;
  std::size_t i = 0;
  const std::size_t nv = n - n % V::W;
  const bool nt = CK != CopyKind::kNone && v_copy_nt<V>(out, CK == CopyKind::kFp32 ? 4 : 2);
  // Out of place (a pending version): the new state is not read again either (v_store_copy).
  const bool nt_state =
      p != po && v_copy_nt<V>(po, 4) && v_copy_nt<V>(mo, 4) && v_copy_nt<V>(vo, 4);
  constexpr std::size_t kGradBytes = GD == DType::kFp32 ? 4 : 2;
  for (; i < nv; i += V::W) {
    v_prefetch(p, m, v, g, kGradBytes, i, nv);
    F gv = v_load_grad<V, GD>(g, i);
    if constexpr (kDiv) gv = V::div(gv, divisor);
    gv = V::mul(gv, scale);
    F pv = V::load(p + i);
    F mv = V::load(m + i);
    F vv = V::load(v + i);
    if constexpr (kWd) {
      if constexpr (kAdamW)
        pv = V::mul(pv, decay);
      else
        gv = V::fmadd(pv, wd, gv);
    }
    mv = V::fmadd(gv, omb1, V::mul(mv, b1));
    vv = V::fmadd(V::mul(omb2, gv), gv, V::mul(vv, b2));
    const F denom = V::add(V::div(V::sqrt(vv), bc2s), eps);
    pv = V::add(pv, V::div(V::mul(nstep, mv), denom));
    v_store_state<V>(po, mo, vo, i, pv, mv, vv, nt_state);
    v_store_copy<V, CK>(out, i, pv, nt);
  }
  if (nt || nt_state) V::fence();
  for (; i < n; ++i) {
    float pe = p[i], me = m[i], ve = v[i];
    s_adam_elem(c, pe, me, ve, s_load_grad(GD, g, i));
    po[i] = pe;
    mo[i] = me;
    vo[i] = ve;
    s_store_copy(CK, out, i, pe);
  }
}

template <class V, DType GD, CopyKind CK, bool kDiv>
void v_adam_wd_div(const AdamConsts& c, const AdamArrays& a, const void* g, void* out,
                   std::size_t n) {
  if (!c.has_weight_decay)
    v_adam<V, GD, CK, false, false, kDiv>(c, a, g, out, n);
  else if (c.adamw)
    v_adam<V, GD, CK, true, true, kDiv>(c, a, g, out, n);
  else
    v_adam<V, GD, CK, true, false, kDiv>(c, a, g, out, n);
}

template <class V, DType GD, CopyKind CK>
void v_adam_wd(const AdamConsts& c, const AdamArrays& a, const void* g, void* out, std::size_t n) {
  if (c.has_divisor)
    v_adam_wd_div<V, GD, CK, true>(c, a, g, out, n);
  else
    v_adam_wd_div<V, GD, CK, false>(c, a, g, out, n);
}

template <class V, DType GD>
void v_adam_copy(const AdamConsts& c, CopyKind ck, const AdamArrays& a, const void* g, void* out,
                 std::size_t n) {
  switch (ck) {
    case CopyKind::kNone: return v_adam_wd<V, GD, CopyKind::kNone>(c, a, g, out, n);
    case CopyKind::kFp32: return v_adam_wd<V, GD, CopyKind::kFp32>(c, a, g, out, n);
    case CopyKind::kFp16: return v_adam_wd<V, GD, CopyKind::kFp16>(c, a, g, out, n);
    case CopyKind::kBf16: return v_adam_wd<V, GD, CopyKind::kBf16>(c, a, g, out, n);
  }
}

template <class V>
void v_adam_entry(const AdamConsts& c, DType gd, CopyKind ck, const AdamArrays& a, const void* g,
                  void* out, std::size_t n) {
  switch (gd) {
    case DType::kFp32: return v_adam_copy<V, DType::kFp32>(c, ck, a, g, out, n);
    case DType::kBf16: return v_adam_copy<V, DType::kBf16>(c, ck, a, g, out, n);
    case DType::kFp16: return v_adam_copy<V, DType::kFp16>(c, ck, a, g, out, n);
  }
}

// Finite check and sum of squares: float partial sums per block, added in double per block.
template <class V, DType GD, bool kDiv>
void v_stats(const void* g, std::size_t n, float divisor, float scale, bool* finite,
             double* sum_sq) {
  using F = typename V::F;
  constexpr std::size_t kBlock = 2048;
  const F sc = V::set1(scale);
  const F dv = V::set1(divisor);
  const F zero = V::set1(0.0f);
  F nanacc = zero;
  double total = 0.0;
  std::size_t i = 0;
  const std::size_t nv = n - n % V::W;
  while (i < nv) {
    const std::size_t end = (nv - i > kBlock) ? i + kBlock : nv;
    F acc = zero;
    for (; i < end; i += V::W) {
      v_prefetch_one<1>(g, GD == DType::kFp32 ? 4 : 2, kStatsPrefetchAhead, i, nv);
      F x = v_load_grad<V, GD>(g, i);
      if constexpr (kDiv) x = V::div(x, dv);
      x = V::mul(x, sc);
      nanacc = V::add(nanacc, V::mul(x, zero));  // NaN iff some x is inf or NaN
      acc = V::fmadd(x, x, acc);
    }
    total += double(V::hsum(acc));
  }
  float tail_nan = 0.0f;
  for (; i < n; ++i) {
    float x = s_load_grad(GD, g, i);
    if constexpr (kDiv) x = x / divisor;
    x = x * scale;
    tail_nan = tail_nan + x * 0.0f;
    total += double(x) * double(x);
  }
  const float nanv = V::hsum(nanacc) + tail_nan;
  if (nanv != nanv) *finite = false;
  *sum_sq += total;
}

template <class V, bool kDiv>
void v_stats_dtype(DType gd, const void* g, std::size_t n, float divisor, float scale, bool* finite,
                   double* sum_sq) {
  switch (gd) {
    case DType::kFp32: return v_stats<V, DType::kFp32, kDiv>(g, n, divisor, scale, finite, sum_sq);
    case DType::kBf16: return v_stats<V, DType::kBf16, kDiv>(g, n, divisor, scale, finite, sum_sq);
    case DType::kFp16: return v_stats<V, DType::kFp16, kDiv>(g, n, divisor, scale, finite, sum_sq);
  }
}

template <class V>
void v_stats_entry(DType gd, const void* g, std::size_t n, float divisor, float scale, bool* finite,
                   double* sum_sq) {
  if (divisor != 1.0f)
    v_stats_dtype<V, true>(gd, g, n, divisor, scale, finite, sum_sq);
  else
    v_stats_dtype<V, false>(gd, g, n, divisor, scale, finite, sum_sq);
}

// The bandwidth reference: the same arrays, the same directions, trivial arithmetic. copy_bytes
// (0, 2 or 4): the updated-parameter copy Adam writes, of that element size: 4 — p's new value;
// 2 — g's bits for 16-bit grads, p's new value as bf16 for fp32 grads. Out of place (a.p_out !=
// a.p) the new p, m, v go to the out arrays with the stores Adam uses there (v_adam's nt_state).
template <class V, bool f32>
void v_stream_g(const AdamArrays& a, const void* g, void* out, std::size_t copy_bytes,
                std::size_t n) {
  using F = typename V::F;
  const float *p = a.p, *m = a.m, *v = a.v;
  float *po = a.p_out, *mo = a.m_out, *vo = a.v_out;
  std::size_t i = 0;
  const std::size_t nv = n - n % V::W;
  float* of = copy_bytes == 4 ? static_cast<float*>(out) : nullptr;
  std::uint16_t* oh = copy_bytes == 2 ? static_cast<std::uint16_t*>(out) : nullptr;
  // The copy with the stores Adam uses for it (v_store_copy).
  const bool nt = copy_bytes && v_copy_nt<V>(out, copy_bytes);
  const bool nt_state =
      p != po && v_copy_nt<V>(po, 4) && v_copy_nt<V>(mo, 4) && v_copy_nt<V>(vo, 4);
  auto put = [&](std::size_t at, F x) { nt ? V::store_nt(of + at, x) : V::store(of + at, x); };
  auto put16 = [&](std::size_t at, typename V::H x) {
    nt ? V::store16_nt(oh + at, x) : V::store16(oh + at, x);
  };
  const float* gf = static_cast<const float*>(g);
  const std::uint16_t* gh = static_cast<const std::uint16_t*>(g);
  for (; i < nv; i += V::W) {
    v_prefetch(p, m, v, g, f32 ? 4 : 2, i, nv);
    typename V::H hv{};
    F gv;
    if constexpr (f32) {
      gv = V::load(gf + i);
    } else {
      hv = V::load16(gh + i);
      gv = V::bf16_to_f(hv);
    }
    const F pv = V::add(V::load(p + i), gv);
    v_store_state<V>(po, mo, vo, i, pv, V::add(V::load(m + i), gv), V::add(V::load(v + i), gv),
                     nt_state);
    if (of) put(i, f32 ? pv : gv);
    if (oh) put16(i, f32 ? V::f_to_bf16(pv) : hv);
  }
  if (nt || nt_state) V::fence();
  for (; i < n; ++i) {
    const float gv = f32 ? gf[i] : s_bf16_to_f(gh[i]);
    po[i] = p[i] + gv;
    mo[i] = m[i] + gv;
    vo[i] = v[i] + gv;
    if (of) of[i] = f32 ? po[i] : gv;
    if (oh) oh[i] = f32 ? s_f_to_bf16(po[i]) : gh[i];
  }
}
template <class V>
void v_stream(DType gd, const AdamArrays& a, const void* g, void* out, std::size_t copy_bytes,
              std::size_t n) {
  if (gd == DType::kFp32) return v_stream_g<V, true>(a, g, out, copy_bytes, n);
  v_stream_g<V, false>(a, g, out, copy_bytes, n);
}

// FP32 -> a 16-bit type: W lanes at a time through `vec`, the tail through `one` (the same bits).
template <class V, auto vec, auto one>
void v_narrow(const void* src, void* dst, std::size_t n) {
  const float* s = static_cast<const float*>(src);
  std::uint16_t* d = static_cast<std::uint16_t*>(dst);
  std::size_t i = 0;
  for (; i + V::W <= n; i += V::W) V::store16(d + i, vec(V::load(s + i)));
  for (; i < n; ++i) d[i] = one(s[i]);
}
// A 16-bit type -> FP32, the same way.
template <class V, auto vec, auto one>
void v_widen(const void* src, void* dst, std::size_t n) {
  const std::uint16_t* s = static_cast<const std::uint16_t*>(src);
  float* d = static_cast<float*>(dst);
  std::size_t i = 0;
  for (; i + V::W <= n; i += V::W) V::store(d + i, vec(V::load16(s + i)));
  for (; i < n; ++i) d[i] = one(s[i]);
}

template <class V>
strata::optim::KernelTable make_table() {
  return {&v_adam_entry<V>,
          &v_stats_entry<V>,
          &v_stream<V>,
          &v_narrow<V, V::f_to_bf16, s_f_to_bf16>,
          &v_narrow<V, V::f_to_fp16, s_f_to_fp16>,
          &v_widen<V, V::bf16_to_f, s_bf16_to_f>,
          &v_widen<V, V::fp16_to_f, s_fp16_to_f>};
}

// Portable traits: one lane, the scalar helpers.
struct ScalarV {
  using F = float;
  using H = std::uint16_t;
  static constexpr std::size_t W = 1;
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static H load16(const std::uint16_t* p) { return *p; }
  static void store16(std::uint16_t* p, H x) { *p = x; }
  static void store_nt(float* p, F x) { *p = x; }  // never chosen: W == 1 (v_copy_nt)
  static void store16_nt(std::uint16_t* p, H x) { *p = x; }
  static void fence() {}
  static F set1(float x) { return x; }
  static F add(F a, F b) { return a + b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return __builtin_sqrtf(a); }
  static F fmadd(F a, F b, F c) { return __builtin_fmaf(a, b, c); }
  static F bf16_to_f(H h) { return s_bf16_to_f(h); }
  static H f_to_bf16(F f) { return s_f_to_bf16(f); }
  static F fp16_to_f(H h) { return s_fp16_to_f(h); }
  static H f_to_fp16(F f) { return s_f_to_fp16(f); }
  static float hsum(F a) { return a; }
};

}  // namespace
