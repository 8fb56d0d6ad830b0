// Helpers shared by tests: temporary directories, random data, the source/binary dirs.
#pragma once

#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

namespace strata::testing {

// A fresh directory under $TMPDIR (or /tmp), removed (recursively) on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "strata-test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// Seed for randomized tests: $STRATA_TEST_SEED if set, else a fresh random one. Printed once
// per call so a failure can be reproduced.
std::uint64_t test_seed(const char* what);

// Deterministic pseudo-random bytes.
std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint64_t seed);

std::string source_dir();  // repository root ($STRATA_SOURCE_DIR set by CTest)
std::string binary_dir();  // build root ($STRATA_BINARY_DIR set by CTest)

// Runs a shell command, returns its exit status; stdout+stderr captured into *output.
int run_command(const std::string& command, std::string* output);

}  // namespace strata::testing
