// Sizes and counts as people write them.
//   bytes:  "4GiB", "512MiB", "80GB", "1MB", "4096B", "4 KiB", "1.5GiB" (SI: kB/KB, MB, GB, TB,
//           PB = 10^3..10^15; binary: KiB, MiB, GiB, TiB, PiB = 2^10..2^50; B = bytes). A unit is
//           required (`80` is refused: 80 bytes or 80 GB?), except for 0; a one-letter unit
//           ("1M", fio's 2^20) is refused with "did you mean 1MiB (or 1MB)?".
//   counts: "7.5B", "350M", "7.5e9", "1200", "12K", "1.2T" (K = 10^3, M = 10^6, B/G = 10^9,
//           T = 10^12)
// Parsing is strict: negative, non-finite, overflowing, fractional-byte or unknown-unit input
// throws Error(kInvalidArgument) whose message says what was wrong and what is accepted.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace strata {

std::uint64_t parse_bytes(std::string_view text);
std::uint64_t parse_count(std::string_view text);

// "41.25 GB" (decimal units, up to 2 decimals, trailing zeros dropped) or "1 MiB" with binary.
std::string format_bytes(std::uint64_t bytes, bool binary = false);
// The shortest exact form that parse_bytes() reads back to the same value: "256MiB", "80GB",
// "4097B", "0".
std::string format_bytes_exact(std::uint64_t bytes);
// "7.5B", "350M", "1.2K"
std::string format_count(std::uint64_t count);
// "2.35 GB/s"
std::string format_rate(double bytes_per_second);

}  // namespace strata
