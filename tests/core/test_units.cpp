#include <gtest/gtest.h>

#include "strata/error.hpp"
#include "strata/units.hpp"

using namespace strata;

TEST(Units, ParsesBinaryAndSiBytes) {
  EXPECT_EQ(parse_bytes("4GiB"), 4ULL << 30);
  EXPECT_EQ(parse_bytes("512MiB"), 512ULL << 20);
  EXPECT_EQ(parse_bytes("80GB"), 80'000'000'000ULL);
  EXPECT_EQ(parse_bytes("1MB"), 1'000'000ULL);
  EXPECT_EQ(parse_bytes("4096"), 4096ULL);
  EXPECT_EQ(parse_bytes("4 KiB"), 4096ULL);
  EXPECT_EQ(parse_bytes("1.5GiB"), 3ULL << 29);
  EXPECT_EQ(parse_bytes(" 7B "), 7ULL);
  EXPECT_EQ(parse_bytes("1e3"), 1000ULL);
}

TEST(Units, RejectsMalformedBytes) {
  for (const char* bad : {"4 GiBs", "-1", "1e400", "", "GiB", "1.5", "4XB", "0x10", "1e20GB"}) {
    try {
      parse_bytes(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << bad;
      EXPECT_EQ(e.exit_code(), 2);
    }
  }
}

TEST(Units, ParsesCounts) {
  EXPECT_EQ(parse_count("7.5B"), 7'500'000'000ULL);
  EXPECT_EQ(parse_count("350M"), 350'000'000ULL);
  EXPECT_EQ(parse_count("7.5e9"), 7'500'000'000ULL);
  EXPECT_EQ(parse_count("12K"), 12'000ULL);
  EXPECT_EQ(parse_count("1200"), 1200ULL);
  EXPECT_THROW(parse_count("1.5"), Error);
  EXPECT_THROW(parse_count("-3M"), Error);
  EXPECT_THROW(parse_count("7.5X"), Error);
  EXPECT_THROW(parse_count("nan"), Error);
}

TEST(Units, Formats) {
  EXPECT_EQ(format_bytes(41'250'000'000ULL), "41.25 GB");
  EXPECT_EQ(format_bytes(120'000'000'000ULL), "120 GB");
  EXPECT_EQ(format_bytes(1ULL << 20, true), "1 MiB");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_count(7'500'000'000ULL), "7.5B");
  EXPECT_EQ(format_rate(2.5e9), "2.5 GB/s");
}
