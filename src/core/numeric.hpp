// The one copy of the element conversions every layer uses: FP16 / BF16 <-> FP32 (round to
// nearest even, exact in the other direction) and typed element load/store (element sizes:
// dtype_size(), strata/types.hpp). The
// host reductions (src/comm), the engine (src/zero), the CPU Adam kernels' scalar lanes and tails
// (src/optim) and the CLI all call these; the SIMD lanes of the kernels (F16C, AVX-512) produce
// the same bits (tests/core/test_numeric.cpp, tests/optim).
//
// NaN: FP32 NaN -> BF16 0x7FC0 (the quiet NaN torch's round_to_nearest_even produces, sign
// dropped); FP32 NaN -> FP16 sign | 0x7E00. Infinities and overflow to infinity keep their sign.
//
// The functions have internal linkage on purpose (an unnamed namespace): the per-ISA kernel
// translation units include this header with AVX2 / AVX-512 target flags, and an inline function
// with vague linkage could have such a copy picked by the linker for every other caller.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "strata/types.hpp"

namespace strata {
namespace {  // NOLINT(google-build-namespaces,cert-dcl59-cpp): see above

inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1f;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | (static_cast<std::uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

inline std::uint16_t float_to_half(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t absx = x & 0x7fffffffu;
  if (absx > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);  // NaN
  if (absx >= 0x477ff000u)
    return static_cast<std::uint16_t>(sign | 0x7c00u);  // inf, or rounds to it
  if (absx < 0x38800000u) {                             // result is subnormal or zero
    if (absx < 0x33000000u) return sign;                // < 2^-25: rounds to zero
    const std::uint32_t exp = absx >> 23;
    const std::uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift =
        126 - exp;  // value / 2^-24 = mant * 2^(exp - 126); shift in [14, 24]
    std::uint32_t val = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1);
    const std::uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (val & 1u))) ++val;
    return static_cast<std::uint16_t>(sign | val);
  }
  std::uint32_t val = absx - (112u << 23);  // rebias 127 -> 15
  const std::uint32_t rem = val & 0x1fffu;
  val >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (val & 1u))) ++val;
  return static_cast<std::uint16_t>(sign | val);
}

inline float bf16_to_float(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN, as torch
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(x >> 16);
}

inline float load_elem(const void* base, std::size_t i, DType t) {
  switch (t) {
    case DType::kFp32: return static_cast<const float*>(base)[i];
    case DType::kFp16: return half_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::kBf16: return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
  }
  return 0.0f;
}

inline void store_elem(void* base, std::size_t i, DType t, float v) {
  switch (t) {
    case DType::kFp32: static_cast<float*>(base)[i] = v; break;
    case DType::kFp16: static_cast<std::uint16_t*>(base)[i] = float_to_half(v); break;
    case DType::kBf16: static_cast<std::uint16_t*>(base)[i] = float_to_bf16(v); break;
  }
}

// dst[i] += src[i] in FP32, element by element (gradient accumulation over micro-batches).
inline void accumulate_fp32(float* dst, const float* src, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) dst[i] += src[i];
}

// Gradient accumulation in any pair of dtypes, element by element: with `add`,
// dst[i] = round_dd(float(dst[i]) + float(src[i])) (one FP32 add, then round to nearest even
// into dst's dtype, as torch adds 16-bit tensors); without, dst[i] = round_dd(float(src[i])) (a
// conversion; exact into FP32). Non-finite values stay non-finite (no saturation).
inline void accumulate_elems(void* dst, DType dd, const void* src, DType sd, std::size_t n,
                             bool add) noexcept {
  if (dd == DType::kFp32 && sd == DType::kFp32 && add) {
    accumulate_fp32(static_cast<float*>(dst), static_cast<const float*>(src), n);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const float s = load_elem(src, i, sd);
    store_elem(dst, i, dd, add ? load_elem(dst, i, dd) + s : s);
  }
}

}  // namespace
}  // namespace strata
