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

namespace detail {
// a op b op ..., folded left with `overflows(x, y, &r)` (a __builtin_*_overflow), or kSaturated
// as soon as one partial result does not fit in 64 bits.
template <typename Overflows>
constexpr std::uint64_t saturating_fold(Overflows, std::uint64_t a) {
  return a;
}
template <typename Overflows, typename... Rest>
constexpr std::uint64_t saturating_fold(Overflows overflows, std::uint64_t a, std::uint64_t b,
                                        Rest... rest) {
  std::uint64_t r = 0;
  if (overflows(a, b, &r)) return kSaturated;
  return saturating_fold(overflows, r, static_cast<std::uint64_t>(rest)...);
}
inline constexpr auto kMulOverflows = [](std::uint64_t x, std::uint64_t y, std::uint64_t* r) {
  return __builtin_mul_overflow(x, y, r);
};
inline constexpr auto kAddOverflows = [](std::uint64_t x, std::uint64_t y, std::uint64_t* r) {
  return __builtin_add_overflow(x, y, r);
};
}  // namespace detail

// a × b × ..., or kSaturated when the product does not fit in 64 bits.
template <typename... Rest>
constexpr std::uint64_t sat_mul(std::uint64_t a, Rest... rest) {
  return detail::saturating_fold(detail::kMulOverflows, a, rest...);
}

// v rounded up to a multiple of a (a > 0; v + a - 1 must fit).
constexpr std::uint64_t round_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

// a + b + ..., or kSaturated when the sum does not fit.
template <typename... Rest>
constexpr std::uint64_t sat_add(std::uint64_t a, Rest... rest) {
  return detail::saturating_fold(detail::kAddOverflows, a, rest...);
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
