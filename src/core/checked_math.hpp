// Overflow-safe arithmetic on sizes and counts (internal header). Figures derived from a config
// (bytes per tier, activation memory, traffic) must never wrap around to a small number that
// "fits": they saturate at kSaturated instead, which every budget comparison treats as "does not
// fit", or throw where a wrong figure must not be used at all.
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include "strata/error.hpp"

namespace strata {

constexpr std::uint64_t kSaturated = std::numeric_limits<std::uint64_t>::max();

// a × b × ..., or kSaturated when the product does not fit in 64 bits.
constexpr std::uint64_t sat_mul(std::uint64_t a) { return a; }
template <typename... Rest>
constexpr std::uint64_t sat_mul(std::uint64_t a, std::uint64_t b, Rest... rest) {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return kSaturated;
  return sat_mul(r, static_cast<std::uint64_t>(rest)...);
}

// a + b + ..., or kSaturated when the sum does not fit.
constexpr std::uint64_t sat_add(std::uint64_t a) { return a; }
template <typename... Rest>
constexpr std::uint64_t sat_add(std::uint64_t a, std::uint64_t b, Rest... rest) {
  std::uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) return kSaturated;
  return sat_add(r, static_cast<std::uint64_t>(rest)...);
}

// `used` fits `budget` (a saturated figure never fits).
constexpr bool fits_budget(std::uint64_t used, std::uint64_t budget) {
  return used != kSaturated && used <= budget;
}

// a × b, or Error(kInvalidArgument) naming `what` when it does not fit in 64 bits.
inline std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b, const std::string& what) {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    fail(ErrorCode::kInvalidArgument, strcat(what, ": ", a, " x ", b, " does not fit in 64 bits"));
  return r;
}

}  // namespace strata
