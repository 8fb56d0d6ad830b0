// Element conversions and the deterministic host reduction shared by the host backends and the
// ZeRO engine: FP16/BF16 <-> FP32 (round-to-nearest-even), and "sum over ranks in rank order in
// FP32, round once".
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "strata/config.hpp"

namespace strata::comm {

inline std::size_t elem_size(DType t) { return t == DType::kFp32 ? 4 : 2; }

inline float half_to_float(std::uint16_t h) {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1f;
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
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  std::uint16_t sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  std::uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // inf or nan
    return static_cast<std::uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
  }
  if (absx >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (absx < 0x38800000u) {  // result is subnormal or zero
    if (absx < 0x33000000u) return sign;  // < 2^-25: rounds to zero
    std::uint32_t exp = absx >> 23;
    std::uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
    std::uint32_t shift = 126 - exp;  // value / 2^-24 = mant * 2^(exp - 126); shift in [14, 24]
    std::uint32_t val = mant >> shift;
    std::uint32_t rem = mant & ((1u << shift) - 1);
    std::uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (val & 1u))) ++val;
    return static_cast<std::uint16_t>(sign | val);
  }
  std::uint32_t val = absx - (112u << 23);  // rebias 127 -> 15
  std::uint32_t rem = val & 0x1fffu;
  val >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (val & 1u))) ++val;
  return static_cast<std::uint16_t>(sign | val);
}

inline float bf16_to_float(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  std::uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;
  return static_cast<std::uint16_t>(x >> 16);
}

inline float load_elem(const void* base, std::size_t i, DType t) {
  switch (t) {
    case DType::kFp32:
      return static_cast<const float*>(base)[i];
    case DType::kFp16:
      return half_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::kBf16:
      return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
  }
  return 0.0f;
}

inline void store_elem(void* base, std::size_t i, DType t, float v) {
  switch (t) {
    case DType::kFp32:
      static_cast<float*>(base)[i] = v;
      break;
    case DType::kFp16:
      static_cast<std::uint16_t*>(base)[i] = float_to_half(v);
      break;
    case DType::kBf16:
      static_cast<std::uint16_t*>(base)[i] = float_to_bf16(v);
      break;
  }
}

// out[i] = round(sum_{r=0}^{n-1} float(srcs[r][i])) for i < count, summing in rank order in FP32.
// `out` may alias any source (each element is read before it is written).
inline void ordered_sum(const void* const* srcs, int n, void* out, std::size_t count, DType t) {
  if (t == DType::kFp32) {
    float* o = static_cast<float*>(out);
    for (std::size_t i = 0; i < count; ++i) {
      float acc = static_cast<const float*>(srcs[0])[i];
      for (int r = 1; r < n; ++r) acc += static_cast<const float*>(srcs[r])[i];
      o[i] = acc;
    }
    return;
  }
  for (std::size_t i = 0; i < count; ++i) {
    float acc = load_elem(srcs[0], i, t);
    for (int r = 1; r < n; ++r) acc += load_elem(srcs[r], i, t);
    store_elem(out, i, t, acc);
  }
}

}  // namespace strata::comm
