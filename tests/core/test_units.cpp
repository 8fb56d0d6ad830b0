#include <gtest/gtest.h>

#include "strata/error.hpp"
#include "strata/units.hpp"
#include "test_util.hpp"

using namespace strata;

TEST(Units, ParsesBinaryAndSiBytes) {
  EXPECT_EQ(parse_bytes("4GiB"), 4ULL << 30);
  EXPECT_EQ(parse_bytes("512MiB"), 512ULL << 20);
  EXPECT_EQ(parse_bytes("80GB"), 80'000'000'000ULL);
  EXPECT_EQ(parse_bytes("1MB"), 1'000'000ULL);
  EXPECT_EQ(parse_bytes("4096B"), 4096ULL);
  EXPECT_EQ(parse_bytes("4 KiB"), 4096ULL);
  EXPECT_EQ(parse_bytes("1.5GiB"), 3ULL << 29);
  EXPECT_EQ(parse_bytes(" 7B "), 7ULL);
  EXPECT_EQ(parse_bytes("1e3B"), 1000ULL);
  EXPECT_EQ(parse_bytes("4KB"), 4000ULL);
  EXPECT_EQ(parse_bytes("4kB"), 4000ULL);
  EXPECT_EQ(parse_bytes("2TiB"), 2ULL << 40);
  EXPECT_EQ(parse_bytes("3PiB"), 3ULL << 50);
  EXPECT_EQ(parse_bytes("2TB"), 2'000'000'000'000ULL);
  EXPECT_EQ(parse_bytes("3PB"), 3'000'000'000'000'000ULL);
  // 0 needs no unit.
  EXPECT_EQ(parse_bytes("0"), 0ULL);
  EXPECT_EQ(parse_bytes("0.0"), 0ULL);
}

TEST(Units, BytesNeedAUnit) {
  // issue 16: `budget: 80` silently meant 80 bytes.
  const std::string msg = strata::testing::expect_error(
      ErrorCode::kInvalidArgument, "'80' has no unit", [] { parse_bytes("80"); });
  EXPECT_NE(msg.find("80B"), std::string::npos) << msg;
}

struct FioCase {
  const char* in;
  const char* suggestion;
};
class FioStyleUnits : public ::testing::TestWithParam<FioCase> {};
TEST_P(FioStyleUnits, AreRefusedWithASuggestion) {
  strata::testing::expect_error(ErrorCode::kInvalidArgument, GetParam().suggestion,
                                [&] { parse_bytes(GetParam().in); });
}
INSTANTIATE_TEST_SUITE_P(Cases, FioStyleUnits,
                         ::testing::Values(FioCase{"1M", "did you mean 1MiB (or 1MB)?"},
                                           FioCase{"4k", "did you mean 4KiB (or 4kB)?"},
                                           FioCase{"4K", "did you mean 4KiB (or 4kB)?"},
                                           FioCase{"2G", "did you mean 2GiB (or 2GB)?"},
                                           FioCase{"1.5T", "did you mean 1.5TiB (or 1.5TB)?"},
                                           FioCase{"3P", "did you mean 3PiB (or 3PB)?"},
                                           FioCase{"1M", "(2^20 for fio, 10^6 for others)"},
                                           FioCase{"4k", "(2^10 for fio, 10^3 for others)"},
                                           FioCase{"3P", "(2^50 for fio, 10^15 for others)"}));

TEST(Units, ExactFormatReadsBack) {
  EXPECT_EQ(format_bytes_exact(0), "0");
  EXPECT_EQ(format_bytes_exact(256ULL << 20), "256MiB");
  EXPECT_EQ(format_bytes_exact(80'000'000'000ULL), "80GB");
  EXPECT_EQ(format_bytes_exact(512ULL << 30), "512GiB");
  EXPECT_EQ(format_bytes_exact(4097), "4097B");
  EXPECT_EQ(format_bytes_exact(4096), "4KiB");
  EXPECT_EQ(format_bytes_exact(1000), "1kB");
  for (std::uint64_t v :
       {std::uint64_t{1}, std::uint64_t{4096}, std::uint64_t{1} << 63, ~std::uint64_t{0},
        std::uint64_t{123'000'000'000}, std::uint64_t{3} << 40}) {
    EXPECT_EQ(parse_bytes(format_bytes_exact(v)), v) << format_bytes_exact(v);
  }
}

TEST(Units, RejectsMalformedBytes) {
  for (const char* bad :
       {"4 GiBs", "-1", "1e400", "", "GiB", "1.5", "4XB", "0x10", "1e20GB", "1.5B", "4096", "1M"}) {
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
