// CRC32C (Castagnoli), the checksum of swap-space extents: the SSE4.2 crc32 instruction when the
// CPU has it (checked once at run time), else a portable slicing-by-8 table.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

// CRC32C of `n` bytes, continuing from `crc` (0 for a fresh checksum).
std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t crc = 0);
// The two implementations, for tests and the benchmark.
std::uint32_t crc32c_portable(const void* data, std::size_t n, std::uint32_t crc = 0);
std::uint32_t crc32c_hw(const void* data, std::size_t n, std::uint32_t crc = 0);  // x86 SSE4.2
bool crc32c_hw_available();

}  // namespace strata
