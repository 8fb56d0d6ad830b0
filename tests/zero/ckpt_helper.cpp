// Helper process for the SIGKILL-during-save test: one rank, optimizer state half on NVMe; trains
// one step, then saves a checkpoint, for K = 1..LAST, printing "saving K" before and
// "saved K ops N" after each save (N: the file operations the save made). In the save of LAST it
// stops before its file operation number PAUSE_AT (counted from 1; a file create, write, truncate,
// sync, rename or directory sync, through a FileEnv wrapper installed as the process's FileEnv),
// prints "paused K OP NAME committed C" (C = 1 once that save has renamed its manifest into place)
// and waits to be killed: the test kills it at a known point of a save, whatever the machine's
// load. A PAUSE_AT past the save's last operation: the save completes, then the helper waits.
// It waits at most 120 s.
// Usage: zero_ckpt_helper CHECKPOINT_DIR SWAP_DIR LAST PAUSE_AT
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>

#include "ckpt_model.hpp"
#include "core/file_env.hpp"
#include "strata/communicator.hpp"

namespace {

using namespace strata;

[[noreturn]] void wait_to_be_killed() {
  std::this_thread::sleep_for(std::chrono::seconds(120));  // the test kills it before
  std::fprintf(stderr, "helper: not killed within 120 s\n");
  std::_Exit(3);
}

// Counts the file operations made through it; once armed, stops before the pause_at-th.
class PausingFileEnv final : public FileEnvWrapper {
 public:
  using FileEnvWrapper::FileEnvWrapper;
  void arm(std::uint64_t pause_at) { pause_at_ = pause_at; }
  std::uint64_t take_count() { return ops_.exchange(0); }

  // One operation `op` on file `name`: counted; the pause_at-th of an armed save never returns.
  void op(const char* what, std::string_view name) {
    const std::uint64_t k = ops_.fetch_add(1) + 1;
    if (k == pause_at_.load()) {
      std::printf("paused %llu %s %.*s committed %d\n", static_cast<unsigned long long>(k), what,
                  static_cast<int>(name.size()), name.data(), committed_.load() ? 1 : 0);
      std::fflush(stdout);
      wait_to_be_killed();
    }
  }

  std::unique_ptr<WritableFile> create_file(const SafeDir& dir, std::string_view name, mode_t mode,
                                            WriteMode how) override;
  void rename(const SafeDir& dir, std::string_view from, std::string_view to) override {
    op("rename", to);
    FileEnvWrapper::rename(dir, from, to);
    if (pause_at_.load() != 0 && to == "manifest.json") committed_ = true;
  }
  void sync_dir(const SafeDir& dir) override {
    op("sync-dir", ".");
    FileEnvWrapper::sync_dir(dir);
  }

 private:
  std::atomic<std::uint64_t> ops_{0}, pause_at_{0};
  std::atomic<bool> committed_{false};
};

class CountedFile final : public WritableFile {
 public:
  CountedFile(PausingFileEnv& env, std::unique_ptr<WritableFile> file, std::string name)
      : env_(env), file_(std::move(file)), name_(std::move(name)) {}
  const std::string& path() const override { return file_->path(); }
  void write_at(const void* data, std::uint64_t n, std::uint64_t offset) override {
    env_.op("write", name_);
    file_->write_at(data, n, offset);
  }
  void truncate(std::uint64_t size) override {
    env_.op("truncate", name_);
    file_->truncate(size);
  }
  void sync() override {
    env_.op("sync", name_);
    file_->sync();
  }
  bool direct() const override { return file_->direct(); }

 private:
  PausingFileEnv& env_;
  std::unique_ptr<WritableFile> file_;
  const std::string name_;
};

std::unique_ptr<WritableFile> PausingFileEnv::create_file(const SafeDir& dir, std::string_view name,
                                                          mode_t mode, WriteMode how) {
  op("create", name);
  return std::make_unique<CountedFile>(*this, FileEnvWrapper::create_file(dir, name, mode, how),
                                       std::string(name));
}

}  // namespace

int main(int argc, char** argv) {
  using namespace strata::testing;
  const int last = argc == 5 ? std::atoi(argv[3]) : 0;
  const long long pause_at = argc == 5 ? std::atoll(argv[4]) : 0;
  if (argc != 5 || last < 1 || pause_at < 1) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR SWAP_DIR LAST PAUSE_AT\n", argv[0]);
    return 2;
  }
  PausingFileEnv counting(FileEnv::standard());
  const ScopedFileEnv installed(counting);
  try {
    const std::vector<std::size_t>& sizes = kKillSizes;
    auto comms = make_inprocess_communicators(1, 30.0);
    Engine e(ckpt_config(1, 0.5, argv[2]), *comms[0]);
    ckpt_register(e, sizes);
    for (int k = 1; k <= last; ++k) {
      ckpt_step(e, sizes, 0, k - 1);
      std::printf("saving %d\n", k);
      std::fflush(stdout);
      counting.take_count();
      if (k == last) counting.arm(static_cast<std::uint64_t>(pause_at));
      e.save_checkpoint(argv[1]);
      std::printf("saved %d ops %llu\n", k, static_cast<unsigned long long>(counting.take_count()));
      std::fflush(stdout);
    }
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "helper: %s\n", ex.what());
    return 1;
  }
  wait_to_be_killed();
}
