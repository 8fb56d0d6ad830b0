// include/strata/types.hpp: one name table per enum (every value named once, names unique, the
// round trip name -> value -> name exact), one element-size table, and the named accessors the
// layers call reading the same tables.
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <string>

#include "strata/types.hpp"

namespace strata {
namespace {

// Every value of E from 0 to `count` - 1 has exactly one row, in order; names are unique and
// read back to their value; a name outside the table is refused.
template <class E>
void expect_table(int count) {
  const auto rows = enum_names<E>();
  ASSERT_EQ(rows.size(), static_cast<std::size_t>(count));
  std::set<std::string> seen;
  for (int i = 0; i < count; ++i) {
    const E v = static_cast<E>(i);
    EXPECT_EQ(rows[static_cast<std::size_t>(i)].value, v) << "row " << i << " out of order";
    const std::string name = enum_name(v);
    EXPECT_TRUE(seen.insert(name).second) << "duplicate name " << name;
    EXPECT_NE(name, "?");
    ASSERT_TRUE(enum_from_name<E>(name).has_value()) << name;
    EXPECT_EQ(*enum_from_name<E>(name), v) << name;
  }
  EXPECT_FALSE(enum_from_name<E>("no-such-name").has_value());
  EXPECT_FALSE(enum_from_name<E>("").has_value());
  EXPECT_STREQ(enum_name(static_cast<E>(count)), "?");
}

TEST(Types, EveryEnumHasOneCompleteNameTable) {
  expect_table<DType>(3);
  expect_table<Tier>(3);
  expect_table<OptimizerType>(2);
  expect_table<OptimizerUpdate>(2);
  expect_table<IoEngineKind>(3);
  expect_table<DirectIoMode>(3);
  expect_table<DeviceKind>(3);
  expect_table<CommBackend>(4);
}

TEST(Types, NamedAccessorsReadTheTables) {
  EXPECT_STREQ(dtype_name(DType::kFp16), "fp16");
  EXPECT_STREQ(dtype_name(DType::kBf16), "bf16");
  EXPECT_STREQ(dtype_name(DType::kFp32), "fp32");
  EXPECT_STREQ(tier_name(Tier::kGpu), "gpu");
  EXPECT_STREQ(tier_name(Tier::kCpu), "cpu");
  EXPECT_STREQ(tier_name(Tier::kNvme), "nvme");
  EXPECT_STREQ(optimizer_name(OptimizerType::kAdamW), "adamw");
  EXPECT_STREQ(optimizer_update_name(OptimizerUpdate::kDevice), "device");
  EXPECT_STREQ(io_engine_name(IoEngineKind::kIoUring), "io_uring");
  EXPECT_STREQ(direct_io_name(DirectIoMode::kRequired), "required");
  EXPECT_STREQ(device_name(DeviceKind::kHost), "host");
  EXPECT_STREQ(comm_backend_name(CommBackend::kInProcess), "inprocess");
  EXPECT_STREQ(tier_name(static_cast<Tier>(7)), "?");
}

TEST(Types, ElementSizes) {
  EXPECT_EQ(dtype_size(DType::kFp16), 2u);
  EXPECT_EQ(dtype_size(DType::kBf16), 2u);
  EXPECT_EQ(dtype_size(DType::kFp32), 4u);
}

}  // namespace
}  // namespace strata
