#include <gtest/gtest.h>

#include <cerrno>

#include "strata/device_query.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"

using namespace strata;

TEST(Error, ConfigErrorNamesFileLineColumnAndKey) {
  ConfigError e("a.yaml", 12, 3, "zero.stage", "must be 0, 1, 2 or 3");
  EXPECT_STREQ(e.what(), "a.yaml:12:3: zero.stage: must be 0, 1, 2 or 3");
  EXPECT_EQ(e.exit_code(), 2);
  EXPECT_EQ(e.line(), 12);
  EXPECT_EQ(e.key_path(), "zero.stage");
}

TEST(Error, IoErrorNamesPathOffsetLengthErrno) {
  IoError e("read", "/mnt/x/swap.0", 4096, 1048576, EIO);
  std::string w = e.what();
  EXPECT_NE(w.find("/mnt/x/swap.0"), std::string::npos) << w;
  EXPECT_NE(w.find("offset=4096"), std::string::npos) << w;
  EXPECT_NE(w.find("length=1048576"), std::string::npos) << w;
  EXPECT_NE(w.find("errno 5"), std::string::npos) << w;
  EXPECT_EQ(e.exit_code(), 1);
  EXPECT_EQ(e.errnum(), EIO);
}

TEST(Error, IoErrorWithContextKeepsTheFieldsAndAppends) {
  IoError e("write", "/mnt/x/swap.0", 8192, 4096, ENOSPC, "chunk 3");
  IoError outer = e.with_context("optimizer step");
  EXPECT_EQ(outer.op(), "write");
  EXPECT_EQ(outer.path(), "/mnt/x/swap.0");
  EXPECT_EQ(outer.offset(), 8192u);
  EXPECT_EQ(outer.length(), 4096u);
  EXPECT_EQ(outer.errnum(), ENOSPC);
  EXPECT_EQ(outer.context(), "chunk 3; optimizer step");
  EXPECT_NE(std::string(outer.what()).find("chunk 3; optimizer step"), std::string::npos)
      << outer.what();
  EXPECT_EQ(IoError("read", "/p", 0, 1, EIO).with_context("x").context(), "x");
}

TEST(Log, SinkReceivesMessagesAtOrAboveLevel) {
  std::vector<std::string> got;
  set_log_sink([&](LogLevel, std::string_view m) { got.emplace_back(m); });
  set_log_level(LogLevel::kWarn);
  log_info("hidden ", 1);
  log_warn("shown ", 2);
  set_log_sink(nullptr);
  set_log_level(LogLevel::kInfo);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0], "shown 2");
}

TEST(DeviceQuery, NeverThrowsAndExplainsAbsence) {
  auto q = query_cuda_devices();
  EXPECT_FALSE(q.status.empty());
  if (q.devices.empty()) {
    EXPECT_EQ(q.status.rfind("no GPU", 0), 0u) << q.status;
  }
}

TEST(Error, PathErrorsFromOpenAreBadInput) {
  // A path the user gave that cannot be used exits 2, like other bad input; a device failure 1.
  EXPECT_EQ(IoError("open", "/missing/x", 0, 0, ENOENT).exit_code(), 2);
  EXPECT_TRUE(IoError("open", "/missing/x", 0, 0, ENOENT).bad_path());
  EXPECT_EQ(IoError("mkdir", "/ro/x", 0, 0, EACCES).exit_code(), 2);
  EXPECT_EQ(IoError("open", "/x/swap.bin", 0, 0, EEXIST).exit_code(), 2);
  EXPECT_EQ(IoError("open", "/dev/shm/f", 0, 0, EINVAL, "O_DIRECT refused").exit_code(), 2);
  EXPECT_EQ(IoError("open", "/x", 0, 0, EIO).exit_code(), 1);
  EXPECT_EQ(IoError("read", "/x", 0, 4096, ENOENT).exit_code(), 1);
  EXPECT_EQ(IoError("fallocate", "/x", 0, 4096, ENOSPC).exit_code(), 1);
  // Context added on the way up keeps the classification.
  EXPECT_EQ(IoError("open", "/missing/x", 0, 0, ENOENT).with_context("bench io").exit_code(), 2);
}
