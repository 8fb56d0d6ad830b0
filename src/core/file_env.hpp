// FileEnv: the one file seam of checkpoints (internal header), of leveldb's Env kind
// (include/leveldb/env.h): the file operations a writer and a reader of files in a SafeDir make —
// create a file and write it at offsets, truncate and sync it; open one and read it at offsets;
// rename within the directory; sync the directory. FileEnv::standard() does them with the
// syscalls; FileEnvWrapper forwards every call to another FileEnv (override what you change), and
// FaultInjectingFileEnv (below) is the wrapper tests inject failures and delays with.
//
// Which FileEnv a caller uses: the one it is handed (checkpoint RankState::env), else
// FileEnv::current(): standard() unless a ScopedFileEnv installed another for the process — how a
// test's child process (a helper, a test-only build of the `strata` command) slows or fails its
// own saves. There is no environment-variable switch.
//
// Failures: every call throws IoError naming the op, the path, offset, length and errno, as the
// syscalls it stands for; a read that meets the end of the file throws Error(kChecksum)
// "truncated". Thread-safety: standard() may be used from any thread; a file object from one thread
// at a time, except that a WritableFile's write_at may be called from several threads at once for
// disjoint ranges (as pwrite), never concurrently with its truncate or sync.
#pragma once

#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/mutex.hpp"
#include "core/safe_fs.hpp"

namespace strata {

// Positional I/O on a descriptor that completes short transfers (EINTR retried): IoError naming
// `path`, offset and length; pread_full meeting the end of the file: Error(kChecksum) "truncated".
// What the standard FileEnv's files do; for files outside the seam (none in checkpoints).
void pread_full(int fd, void* buf, std::uint64_t n, std::uint64_t offset, const std::string& path);
void pwrite_full(int fd, const void* buf, std::uint64_t n, std::uint64_t offset,
                 const std::string& path);

// How a created file is written. kBuffered: through the page cache. kDirect: a write_at whose
// buffer address, offset and length are all multiples of kDirectAlignment bypasses the page cache
// (O_DIRECT, through a second descriptor of the same open file), any other write goes through it;
// sync() makes both durable. Where the file system refuses O_DIRECT (tmpfs) every write is
// buffered (WritableFile::direct() says which). For large streamed writes: the data goes to the
// disk as it is written, with no copy into the cache and no flush of gigabytes at sync().
enum class WriteMode { kBuffered, kDirect };
inline constexpr std::uint64_t kDirectAlignment = 4096;
// Whether a write of `n` bytes from `data` at `offset` can bypass the page cache: all three are
// multiples of kDirectAlignment.
inline bool direct_aligned(const void* data, std::uint64_t n, std::uint64_t offset) {
  return reinterpret_cast<std::uintptr_t>(data) % kDirectAlignment == 0 &&
         n % kDirectAlignment == 0 && offset % kDirectAlignment == 0;
}

// A file being written at offsets (the whole range or an IoError).
class WritableFile {
 public:
  virtual ~WritableFile() = default;
  virtual const std::string& path() const = 0;
  virtual void write_at(const void* data, std::uint64_t n, std::uint64_t offset) = 0;
  virtual void truncate(std::uint64_t size) = 0;
  virtual void sync() = 0;  // the data and the size durable (fdatasync)
  // Whether aligned writes bypass the page cache (created kDirect where O_DIRECT is allowed).
  virtual bool direct() const = 0;
};

// A file read at offsets (the whole range, or an error: end of file is kChecksum "truncated").
class RandomAccessFile {
 public:
  virtual ~RandomAccessFile() = default;
  virtual const std::string& path() const = 0;
  virtual struct stat status() const = 0;  // fstat
  virtual void read_at(void* dst, std::uint64_t n, std::uint64_t offset) = 0;
};

class FileEnv {
 public:
  virtual ~FileEnv() = default;
  static FileEnv& standard();  // the syscalls
  static FileEnv& current();   // standard(), or what a ScopedFileEnv installed

  // SafeDir::create_file(name, O_WRONLY, mode): exclusive, no symbolic link followed.
  virtual std::unique_ptr<WritableFile> create_file(const SafeDir& dir, std::string_view name,
                                                    mode_t mode = 0600,
                                                    WriteMode how = WriteMode::kBuffered) = 0;
  // SafeDir::open_file(name, O_RDONLY | O_NONBLOCK): a symbolic link fails with ELOOP, a FIFO
  // does not block (the caller checks status()).
  virtual std::unique_ptr<RandomAccessFile> open_file(const SafeDir& dir,
                                                      std::string_view name) = 0;
  virtual void rename(const SafeDir& dir, std::string_view from, std::string_view to) = 0;
  virtual void sync_dir(const SafeDir& dir) = 0;
};

// Forwards every call to `target` (which must outlive it).
class FileEnvWrapper : public FileEnv {
 public:
  explicit FileEnvWrapper(FileEnv& target) : target_(target) {}
  FileEnv& target() const { return target_; }
  std::unique_ptr<WritableFile> create_file(const SafeDir& dir, std::string_view name,
                                            mode_t mode = 0600,
                                            WriteMode how = WriteMode::kBuffered) override {
    return target_.create_file(dir, name, mode, how);
  }
  std::unique_ptr<RandomAccessFile> open_file(const SafeDir& dir, std::string_view name) override {
    return target_.open_file(dir, name);
  }
  void rename(const SafeDir& dir, std::string_view from, std::string_view to) override {
    target_.rename(dir, from, to);
  }
  void sync_dir(const SafeDir& dir) override { target_.sync_dir(dir); }

 private:
  FileEnv& target_;
};

// `text` into dir/name by way of dir/tmp_name, through `env`: a leftover tmp_name is removed (the
// link, if one: never its target), tmp_name created (exclusive, no-follow, `mode`), written,
// synced, renamed onto `name`, and the directory synced. A crash at any point leaves the old
// `name` or the new one, whole.
void write_file_atomically(FileEnv& env, const SafeDir& dir, std::string_view name,
                           std::string_view tmp_name, std::string_view text, mode_t mode = 0600);

// A new file at `path`, written beside it (".NAME.tmp-PID" in its directory: exclusive, no-follow,
// `mode`; a leftover of that name removed) and renamed onto it by commit(): the outputs of
// `strata import-deepspeed -o` and `strata checkpoint export --out`. An existing `path` is refused
// unless `overwrite`, and even then unless it is a regular file (SafeDir::check_replaceable):
// checked when constructed and again at commit(), whose rename replaces nothing unless
// `overwrite`. Destroyed uncommitted (an exception on the way): the temporary file is removed.
// `option` names the path in messages ("-o", "--out"); a path that names no file ("", "dir/.")
// is Error(kInvalidArgument).
class ReplacingFile {
 public:
  ReplacingFile(const std::string& path, const std::string& option, bool overwrite,
                mode_t mode = 0600, FileEnv& env = FileEnv::current());
  ~ReplacingFile();
  ReplacingFile(const ReplacingFile&) = delete;
  ReplacingFile& operator=(const ReplacingFile&) = delete;
  WritableFile& file() { return *file_; }                      // the temporary file
  std::string path() const { return dir_.child_path(name_); }  // the destination
  void commit();  // sync, check again, rename onto path(), sync the directory

 private:
  SafeDir dir_;
  std::string name_, tmp_;
  const bool overwrite_;
  FileEnv& env_;
  std::unique_ptr<WritableFile> file_;
  bool committed_ = false;
};

// Installs `env` as FileEnv::current() for the process while it lives (restores the previous).
// For a test's process or a child it starts, before the work it affects; not while another thread
// uses FileEnv::current().
class ScopedFileEnv {
 public:
  explicit ScopedFileEnv(FileEnv& env);
  ~ScopedFileEnv();
  ScopedFileEnv(const ScopedFileEnv&) = delete;
  ScopedFileEnv& operator=(const ScopedFileEnv&) = delete;

 private:
  FileEnv* previous_;
};

// ---- faults
// ---------------------------------------------------------------------------------------

enum class FileOp { kWrite, kSync, kRead, kRename, kSyncDir };
const char* file_op_name(FileOp op);  // "write", "fsync", "read", "rename", "fsync dir"

// One fault: calls of `op` (on files whose name contains `name`, when set) are counted from 1;
// calls number nth .. nth + count - 1 (count 0: every one from nth on) fail with IoError(errnum)
// whose context says "injected fault" (nothing is done), or, with `delay` > 0 and errnum 0, are
// done after sleeping `delay` (a save that lasts long enough to be killed inside).
struct FileFault {
  FileOp op = FileOp::kWrite;
  std::string name;  // part of the file name ("" = any file)
  std::uint64_t nth = 1;
  std::uint64_t count = 1;
  int errnum = EIO;
  std::chrono::milliseconds delay{0};

  static FileFault fail_nth(FileOp op, std::uint64_t nth, int errnum = EIO);
  static FileFault delay_every(FileOp op, std::chrono::milliseconds delay);
};

// A FileEnvWrapper that applies FileFaults (thread-safe: faults may be added while files are in
// use; a call is matched once, when it is made).
class FaultInjectingFileEnv : public FileEnvWrapper {
 public:
  explicit FaultInjectingFileEnv(FileEnv& target) : FileEnvWrapper(target) {}
  std::size_t add_fault(const FileFault& fault);  // an id for fired()
  void clear_faults();
  std::uint64_t fired(std::size_t fault_id) const;  // calls it failed or delayed
  std::uint64_t calls(FileOp op) const;             // calls of `op` seen (faulted or not)

  std::unique_ptr<WritableFile> create_file(const SafeDir& dir, std::string_view name,
                                            mode_t mode = 0600,
                                            WriteMode how = WriteMode::kBuffered) override;
  std::unique_ptr<RandomAccessFile> open_file(const SafeDir& dir, std::string_view name) override;
  void rename(const SafeDir& dir, std::string_view from, std::string_view to) override;
  void sync_dir(const SafeDir& dir) override;

  // Applies the faults matching a call of `op` on `name` (throws for an error fault, sleeps for a
  // delay). Used by the file objects this wrapper hands out.
  void before(FileOp op, std::string_view name, const std::string& path, std::uint64_t offset,
              std::uint64_t length);

 private:
  struct State {
    FileFault fault;
    std::uint64_t matched = 0, fired = 0;
  };
  mutable Mutex mu_;
  std::vector<State> faults_ GUARDED_BY(mu_);
  std::uint64_t calls_[5] GUARDED_BY(mu_) = {};
};

}  // namespace strata
