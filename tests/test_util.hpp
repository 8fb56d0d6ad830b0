// Helpers shared by tests: temporary directories, random data, the source/binary dirs, and the one
// check of an expected error (expect_error).
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "strata/error.hpp"

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
std::string strata_cli();  // the build's `strata` command (binary_dir()/strata)

// Runs a shell command, returns its exit status; stdout+stderr captured into *output.
int run_command(const std::string& command, std::string* output);

// A child process (the kill-during-save tests): argv[0] executed with argv, its stdout on a pipe
// whose read end is `out` (the parent's), its stderr on /dev/null unless keep_stderr.
struct Child {
  pid_t pid = -1;
  int out = -1;
};
Child start_child(const std::vector<std::string>& argv, bool keep_stderr = false);
// argv[0] started with argv (posix_spawn, this environment), its stdout on /dev/null, its stderr
// too unless keep_stderr. Returns its pid, or -1 when it could not be started.
pid_t spawn_quiet(const std::vector<std::string>& argv, bool keep_stderr = false);
// Reads lines from `fd` (appending each to *log) until `done(line)` holds (true), or EOF or 60 s
// pass (false).
bool read_line_until(int fd, const std::function<bool(const std::string&)>& done, std::string* log);

// The attacker of the file-safety tests: user `nobody` (uid/gid 65534).
constexpr uid_t kNobodyUid = 65534;
constexpr gid_t kNobodyGid = 65534;
// True when this process can act as another user (it runs as root): tests that need it
// GTEST_SKIP otherwise.
bool can_switch_user();
// Runs fn in a forked child that has dropped to uid/gid (supplementary groups cleared) and
// returns its result (fn's return value, or -1 if the child died or could not switch).
// REQUIRES: can_switch_user(). fn must only make plain syscalls (the child of a threaded
// process).
int run_as_user(uid_t uid, gid_t gid, const std::function<int()>& fn);

// Lists of FP32 tensors (model parameters) equal bit for bit; the first difference is a fatal
// failure naming `what`, the tensor, the element and both values.
void expect_bitwise_equal(const std::vector<std::vector<float>>& got,
                          const std::vector<std::vector<float>>& want, const std::string& what);

// The part of an IoError's message that names errno `errnum` ("... (errno 28)"): with
// expect_error<IoError>, it checks the error number.
inline std::string errno_text(int errnum) { return "(errno " + std::to_string(errnum) + ")"; }

// The caller's file and line, taken as a default argument (`CallSite where = CallSite::current()`),
// as std::source_location::current() does, with only __builtin_FILE / __builtin_LINE (which every
// GCC and clang has; std::source_location needs clang >= 15).
struct CallSite {
  const char* file;
  int line;
  static constexpr CallSite current(const char* file = __builtin_FILE(),
                                    int line = __builtin_LINE()) {
    return {file, line};
  }
};

// Runs fn, which must throw E (strata::Error or a subclass: IoError, ConfigError) with `code`
// and a message that contains `fragment` (an empty fragment: any message). Anything else (no
// throw, another code or message, another exception type) is a test failure reported at the
// caller's line. Returns the message ("" when fn did not throw E), for further checks.
//   expect_error(ErrorCode::kBudget, "buffer 'second'", [&] { swap.allocate(n, "second"); });
//   expect_error<IoError>(ErrorCode::kIo, errno_text(ENOSPC), [&] { ... });
template <class E = Error, class Fn>
std::string expect_error(ErrorCode code, std::string_view fragment, Fn&& fn,
                         CallSite where = CallSite::current()) {
  const auto fail_here = [&](const std::string& what) {
    ADD_FAILURE_AT(where.file, where.line) << what;
  };
  try {
    fn();
  } catch (const E& e) {
    const std::string msg = e.what();
    if (e.code() != code)
      fail_here("error code " + std::string(error_code_name(e.code())) + ", expected " +
                error_code_name(code) + ": " + msg);
    if (msg.find(fragment) == std::string::npos)
      fail_here("the message does not contain \"" + std::string(fragment) + "\": " + msg);
    return msg;
  } catch (const std::exception& e) {
    fail_here(std::string("threw another exception (expected ") + error_code_name(code) +
              "): " + e.what());
    return "";
  }
  fail_here(std::string("did not throw (expected ") + error_code_name(code) + " naming \"" +
            std::string(fragment) + "\")");
  return "";
}

}  // namespace strata::testing
