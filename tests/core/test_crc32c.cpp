#include <gtest/gtest.h>

#include <cstring>

#include "core/crc32c.hpp"
#include "test_util.hpp"

using namespace strata;
namespace st = strata::testing;

TEST(Crc32c, KnownVectors) {
  const char* s = "123456789";
  EXPECT_EQ(crc32c_portable(s, 9), 0xE3069283u);
  EXPECT_EQ(crc32c(s, 9), 0xE3069283u);
  std::vector<std::uint8_t> zeros(32, 0);
  EXPECT_EQ(crc32c_portable(zeros.data(), 32), 0x8A9136AAu);  // RFC 3720 B.4
  std::vector<std::uint8_t> ones(32, 0xFF);
  EXPECT_EQ(crc32c(ones.data(), 32), 0x62A8AB43u);
}

TEST(Crc32c, HardwareMatchesPortableOnUnevenLengthsAndOffsets) {
  auto data = st::random_bytes(100003, 11);
  for (std::size_t off : {0, 1, 3, 7}) {
    for (std::size_t len : {0, 1, 7, 8, 9, 63, 4096, 65537, 99990}) {
      ASSERT_EQ(crc32c_hw(data.data() + off, len), crc32c_portable(data.data() + off, len))
          << off << " " << len;
    }
  }
  // Continuation: crc(a+b) == crc(b, crc(a)).
  EXPECT_EQ(crc32c(data.data(), 5000),
            crc32c(data.data() + 1234, 5000 - 1234, crc32c(data.data(), 1234)));
  // A single flipped bit changes it.
  auto copy = data;
  copy[777] ^= 0x10;
  EXPECT_NE(crc32c(copy.data(), copy.size()), crc32c(data.data(), data.size()));
}
