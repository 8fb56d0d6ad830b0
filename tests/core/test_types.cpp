// include/strata/types.hpp: one name table per enum (every value named once, names unique, the
// round trip name -> value -> name exact), one element-size table, and the named accessors the
// layers call reading the same tables.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <string>

#include "strata/types.hpp"

namespace strata {
namespace {

// The names of E's values 0, 1, ... in order, space-separated ("?" for a value with no row).
template <class E>
std::string names_in_order(std::size_t count) {
  std::string out;
  for (std::size_t i = 0; i < count; ++i)
    out += (i ? " " : "") + std::string(enum_name(static_cast<E>(i)));
  return out;
}

// E's table holds exactly `names` (space-separated), value 0 first; names are unique and read
// back to their value; a name outside the table is refused; past the last value the name is "?".
template <class E>
void expect_table(const std::string& names) {
  const auto rows = enum_names<E>();
  const auto count = static_cast<std::size_t>(std::count(names.begin(), names.end(), ' ') + 1);
  ASSERT_EQ(rows.size(), count) << names;
  EXPECT_EQ(names_in_order<E>(count), names);
  std::set<std::string> seen;
  for (std::size_t i = 0; i < count; ++i) {
    const E v = static_cast<E>(i);
    EXPECT_EQ(rows[i].value, v) << "row " << i << " out of order";
    const std::string name = enum_name(v);
    EXPECT_TRUE(seen.insert(name).second) << "duplicate name " << name;
    ASSERT_TRUE(enum_from_name<E>(name).has_value()) << name;
    EXPECT_EQ(*enum_from_name<E>(name), v) << name;
  }
  EXPECT_FALSE(enum_from_name<E>("no-such-name").has_value());
  EXPECT_FALSE(enum_from_name<E>("").has_value());
  EXPECT_STREQ(enum_name(static_cast<E>(count)), "?");
}

TEST(Types, EveryEnumHasOneCompleteNameTable) {
  expect_table<DType>("fp16 bf16 fp32");
  expect_table<Tier>("gpu cpu nvme");
  expect_table<OptimizerType>("adam adamw");
  expect_table<OptimizerUpdate>("cpu device auto");
  expect_table<OptimizerOverlap>("off on auto");
  expect_table<IoEngineKind>("auto io_uring threads");
  expect_table<DirectIoMode>("auto required off");
  expect_table<DeviceKind>("auto cuda host");
  expect_table<CommBackend>("auto inprocess mpi nccl");
}

// A named accessor (what the layers call) answers what the table says for every value, and "?"
// past its end.
template <class E>
void expect_accessor(const char* (*accessor)(E), int count) {
  for (int i = 0; i <= count; ++i)
    EXPECT_STREQ(accessor(static_cast<E>(i)), enum_name(static_cast<E>(i))) << "value " << i;
  EXPECT_STREQ(accessor(static_cast<E>(count)), "?");
}

TEST(Types, NamedAccessorsReadTheTables) {
  expect_accessor(dtype_name, 3);
  expect_accessor(tier_name, 3);
  expect_accessor(optimizer_name, 2);
  expect_accessor(optimizer_update_name, 3);
  expect_accessor(optimizer_overlap_name, 3);
  expect_accessor(io_engine_name, 3);
  expect_accessor(direct_io_name, 3);
  expect_accessor(device_name, 3);
  expect_accessor(comm_backend_name, 4);
}

TEST(Types, ElementSizes) {
  EXPECT_EQ(dtype_size(DType::kFp16), 2u);
  EXPECT_EQ(dtype_size(DType::kBf16), 2u);
  EXPECT_EQ(dtype_size(DType::kFp32), 4u);
}

}  // namespace
}  // namespace strata
