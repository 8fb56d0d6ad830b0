#include "test_util.hpp"

#include <fcntl.h>
#include <grp.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <stdexcept>

namespace strata::testing {

TempDir::TempDir(const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/" + prefix + "-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + tmpl);
  path_ = buf.data();
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::uint64_t test_seed(const char* what) {
  std::uint64_t seed;
  if (const char* env = std::getenv("STRATA_TEST_SEED"); env && *env) {
    seed = std::strtoull(env, nullptr, 0);
  } else {
    seed = std::random_device{}();
    seed = (seed << 32) ^ std::random_device{}();
  }
  std::cerr << "[seed] " << what << ": STRATA_TEST_SEED=" << seed << "\n";
  return seed;
}

std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint64_t seed) {
  std::vector<std::uint8_t> out(n);
  std::mt19937_64 rng(seed);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t v = rng();
    for (int k = 0; k < 8; ++k) out[i + k] = static_cast<std::uint8_t>(v >> (8 * k));
  }
  std::uint64_t v = rng();
  for (; i < n; ++i, v >>= 8) out[i] = static_cast<std::uint8_t>(v);
  return out;
}

std::string source_dir() {
  const char* d = std::getenv("STRATA_SOURCE_DIR");
  return d ? d : ".";
}
std::string binary_dir() {
  const char* d = std::getenv("STRATA_BINARY_DIR");
  return d ? d : ".";
}

std::string strata_cli() { return binary_dir() + "/strata"; }

int run_command(const std::string& command, std::string* output) {
  std::string cmd = command + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return -1;
  std::array<char, 4096> buf;
  std::string out;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  int status = pclose(p);
  if (output) *output = out;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return -1;
}

Child start_child(const std::vector<std::string>& argv, bool keep_stderr) {
  int fds[2];
  if (::pipe(fds) != 0) return {};
  std::vector<std::string> args = argv;  // copied before fork: the child only makes syscalls
  std::vector<char*> ptrs;
  for (auto& a : args) ptrs.push_back(a.data());
  ptrs.push_back(nullptr);
  std::cout.flush();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    if (!keep_stderr) {
      const int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, 2);
    }
    ::close(fds[0]);
    ::close(fds[1]);
    ::execv(ptrs[0], ptrs.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  if (pid < 0) {
    ::close(fds[0]);
    return {};
  }
  return {pid, fds[0]};
}

pid_t spawn_quiet(const std::vector<std::string>& argv, bool keep_stderr) {
  std::vector<std::string> args = argv;
  std::vector<char*> ptrs;
  for (auto& a : args) ptrs.push_back(a.data());
  ptrs.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  if (!keep_stderr) posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, ptrs[0], &fa, nullptr, ptrs.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  return rc == 0 ? pid : -1;
}

bool read_line_until(int fd, const std::function<bool(const std::string&)>& done,
                     std::string* log) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::string line;
  char c;
  while (std::chrono::steady_clock::now() < deadline) {
    if (::read(fd, &c, 1) <= 0) return false;
    if (c != '\n') {
      line += c;
      continue;
    }
    *log += line + "\n";
    if (done(line)) return true;
    line.clear();
  }
  return false;
}

bool can_switch_user() { return ::geteuid() == 0; }

int run_as_user(uid_t uid, gid_t gid, const std::function<int()>& fn) {
  std::cout.flush();
  std::cerr.flush();
  pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setresgid(gid, gid, gid) != 0 ||
        ::setresuid(uid, uid, uid) != 0)
      ::_exit(255);
    int rc = fn();
    ::_exit(rc & 0xff);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) == 255) return -1;
  return WEXITSTATUS(status);
}

void expect_bitwise_equal(const std::vector<std::vector<float>>& got,
                          const std::vector<std::vector<float>>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t t = 0; t < got.size(); ++t) {
    ASSERT_EQ(got[t].size(), want[t].size()) << what << ": tensor " << t;
    for (std::size_t i = 0; i < got[t].size(); ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got[t][i]), std::bit_cast<std::uint32_t>(want[t][i]))
          << what << ": tensor " << t << " element " << i << ": " << got[t][i] << " vs "
          << want[t][i];
  }
}

}  // namespace strata::testing
