#include "core/crc32c.hpp"

#include <array>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define STRATA_CRC_X86 1
#endif

namespace strata {
namespace {

constexpr std::uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  Tables() {
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1) ? kPoly : 0);
      t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

std::uint32_t crc32c_portable(const void* data, std::size_t n, std::uint32_t crc) {
  const auto& t = tables().t;
  auto* p = static_cast<const std::uint8_t*>(data);
  std::uint32_t c = ~crc;
  while (n >= 8) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);  // little-endian hosts only (x86-64, aarch64)
    v ^= c;
    c = t[7][v & 0xFF] ^ t[6][(v >> 8) & 0xFF] ^ t[5][(v >> 16) & 0xFF] ^ t[4][(v >> 24) & 0xFF] ^
        t[3][(v >> 32) & 0xFF] ^ t[2][(v >> 40) & 0xFF] ^ t[1][(v >> 48) & 0xFF] ^ t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
  return ~c;
}

#ifdef STRATA_CRC_X86
namespace {

// Three independent crc32 streams hide the instruction's 3-cycle latency; the partial CRCs are
// combined by "shifting" a CRC over a run of zeros with precomputed GF(2) operator tables
// (Mark Adler's method, as in his crc32c.c).
constexpr std::size_t kLong = 8192;
constexpr std::size_t kShort = 256;

std::uint32_t gf2_times(const std::uint32_t* mat, std::uint32_t vec) {
  std::uint32_t sum = 0;
  while (vec) {
    if (vec & 1) sum ^= *mat;
    vec >>= 1;
    ++mat;
  }
  return sum;
}

void gf2_square(std::uint32_t* square, const std::uint32_t* mat) {
  for (int n = 0; n < 32; ++n) square[n] = gf2_times(mat, mat[n]);
}

// The operator that appends `len` zero bytes to a CRC.
void zeros_op(std::uint32_t* even, std::size_t len) {
  std::uint32_t odd[32];
  odd[0] = kPoly;
  std::uint32_t row = 1;
  for (int n = 1; n < 32; ++n) {
    odd[n] = row;
    row <<= 1;
  }
  gf2_square(even, odd);  // 2 zero bits
  gf2_square(odd, even);  // 4 zero bits
  do {
    gf2_square(even, odd);
    len >>= 1;
    if (len == 0) return;
    gf2_square(odd, even);
    len >>= 1;
  } while (len);
  for (int n = 0; n < 32; ++n) even[n] = odd[n];
}

struct ShiftTable {
  std::uint32_t t[4][256];
  explicit ShiftTable(std::size_t len) {
    std::uint32_t op[32];
    zeros_op(op, len);
    for (std::uint32_t n = 0; n < 256; ++n) {
      t[0][n] = gf2_times(op, n);
      t[1][n] = gf2_times(op, n << 8);
      t[2][n] = gf2_times(op, n << 16);
      t[3][n] = gf2_times(op, n << 24);
    }
  }
  std::uint32_t shift(std::uint32_t crc) const {
    return t[0][crc & 0xFF] ^ t[1][(crc >> 8) & 0xFF] ^ t[2][(crc >> 16) & 0xFF] ^ t[3][crc >> 24];
  }
};

const ShiftTable& long_table() {
  static const ShiftTable t(kLong);
  return t;
}
const ShiftTable& short_table() {
  static const ShiftTable t(kShort);
  return t;
}

__attribute__((target("sse4.2"))) std::uint64_t load64(const std::uint8_t* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

template <std::size_t kBlock>
__attribute__((target("sse4.2"))) void three_way(const std::uint8_t*& p, std::size_t& n,
                                                 std::uint64_t& c0, const ShiftTable& table) {
  while (n >= 3 * kBlock) {
    std::uint64_t c1 = 0, c2 = 0;
    const std::uint8_t* end = p + kBlock;
    do {
      c0 = _mm_crc32_u64(c0, load64(p));
      c1 = _mm_crc32_u64(c1, load64(p + kBlock));
      c2 = _mm_crc32_u64(c2, load64(p + 2 * kBlock));
      p += 8;
    } while (p < end);
    c0 = table.shift(static_cast<std::uint32_t>(c0)) ^ static_cast<std::uint32_t>(c1);
    c0 = table.shift(static_cast<std::uint32_t>(c0)) ^ static_cast<std::uint32_t>(c2);
    p += 2 * kBlock;
    n -= 3 * kBlock;
  }
}

}  // namespace

__attribute__((target("sse4.2"))) std::uint32_t crc32c_hw(const void* data, std::size_t n,
                                                          std::uint32_t crc) {
  auto* p = static_cast<const std::uint8_t*>(data);
  std::uint64_t c = ~crc & 0xFFFFFFFFu;
  // Align to 8 bytes, then three streams of long blocks, then of short blocks.
  while (n && (reinterpret_cast<std::uintptr_t>(p) & 7)) {
    c = _mm_crc32_u8(static_cast<std::uint32_t>(c), *p++);
    --n;
  }
  three_way<kLong>(p, n, c, long_table());
  three_way<kShort>(p, n, c, short_table());
  while (n >= 8) {
    c = _mm_crc32_u64(c, load64(p));
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<std::uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
}
bool crc32c_hw_available() {
  static const bool ok = __builtin_cpu_supports("sse4.2");
  return ok;
}
#else
std::uint32_t crc32c_hw(const void* data, std::size_t n, std::uint32_t crc) {
  return crc32c_portable(data, n, crc);
}
bool crc32c_hw_available() { return false; }
#endif

std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t crc) {
  return crc32c_hw_available() ? crc32c_hw(data, n, crc) : crc32c_portable(data, n, crc);
}

}  // namespace strata
