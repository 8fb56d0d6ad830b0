#include "core/file_env.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata {

void pread_full(int fd, void* buf, std::uint64_t n, std::uint64_t offset, const std::string& path) {
  auto* p = static_cast<unsigned char*>(buf);
  for (std::uint64_t done = 0; done < n;) {
    const ssize_t r = ::pread(fd, p + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw IoError("read", path, offset + done, n - done, errno, "checkpoint");
    if (r == 0)
      fail(ErrorCode::kChecksum,
           strcat("checkpoint file ", path, ": unexpected end of file at offset ", offset + done,
                  " (", n - done, " more bytes expected): truncated"));
    done += static_cast<std::uint64_t>(r);
  }
}

void pwrite_full(int fd, const void* buf, std::uint64_t n, std::uint64_t offset,
                 const std::string& path) {
  const auto* p = static_cast<const unsigned char*>(buf);
  for (std::uint64_t done = 0; done < n;) {
    const ssize_t r = ::pwrite(fd, p + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw IoError("write", path, offset + done, n - done, errno);
    if (r == 0) throw IoError("write", path, offset + done, n - done, EIO, "wrote nothing");
    done += static_cast<std::uint64_t>(r);
  }
}

namespace {

// A second descriptor of the open file `fd`, with O_DIRECT (reopened through /proc/self/fd, so
// that it is the same file whatever happened to its name); none where the file system refuses
// O_DIRECT (EINVAL: tmpfs) or /proc is not mounted.
UniqueFd reopen_direct(int fd, const std::string& path) {
  const std::string self = strcat("/proc/self/fd/", fd);
  int d;
  do {
    d = ::open(self.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
  } while (d < 0 && errno == EINTR);
  if (d < 0)
    log_debug("file ", path, ": written through the page cache (O_DIRECT: ", std::strerror(errno),
              ")");
  return UniqueFd(d);
}

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(UniqueFd fd, std::string path, WriteMode how)
      : fd_(std::move(fd)),
        path_(std::move(path)),
        direct_fd_(how == WriteMode::kDirect ? reopen_direct(fd_.get(), path_) : UniqueFd()) {}
  const std::string& path() const override { return path_; }
  void write_at(const void* data, std::uint64_t n, std::uint64_t offset) override {
    const bool direct = direct_fd_ && direct_aligned(data, n, offset);
    pwrite_full(direct ? direct_fd_.get() : fd_.get(), data, n, offset, path_);
  }
  void truncate(std::uint64_t size) override {
    if (::ftruncate(fd_.get(), static_cast<off_t>(size)) != 0)
      throw IoError("ftruncate", path_, size, 0, errno);
  }
  void sync() override {
    if (::fdatasync(fd_.get()) != 0) throw IoError("fdatasync", path_, 0, 0, errno);
  }
  bool direct() const override { return static_cast<bool>(direct_fd_); }

 private:
  const UniqueFd fd_;
  const std::string path_;
  const UniqueFd direct_fd_;
};

class PosixRandomAccessFile final : public RandomAccessFile {
 public:
  PosixRandomAccessFile(UniqueFd fd, std::string path)
      : fd_(std::move(fd)), path_(std::move(path)) {}
  const std::string& path() const override { return path_; }
  struct stat status() const override {
    struct stat st {};
    if (::fstat(fd_.get(), &st) != 0) throw IoError("stat", path_, 0, 0, errno);
    return st;
  }
  void read_at(void* dst, std::uint64_t n, std::uint64_t offset) override {
    pread_full(fd_.get(), dst, n, offset, path_);
  }

 private:
  const UniqueFd fd_;
  const std::string path_;
};

class PosixFileEnv final : public FileEnv {
 public:
  std::unique_ptr<WritableFile> create_file(const SafeDir& dir, std::string_view name, mode_t mode,
                                            WriteMode how) override {
    UniqueFd fd = dir.create_file(name, O_WRONLY, mode);
    return std::make_unique<PosixWritableFile>(std::move(fd), dir.child_path(name), how);
  }
  std::unique_ptr<RandomAccessFile> open_file(const SafeDir& dir, std::string_view name) override {
    UniqueFd fd = dir.open_file(name, O_RDONLY | O_NONBLOCK);
    return std::make_unique<PosixRandomAccessFile>(std::move(fd), dir.child_path(name));
  }
  void rename(const SafeDir& dir, std::string_view from, std::string_view to) override {
    dir.rename(from, to);
  }
  void sync_dir(const SafeDir& dir) override { dir.sync(); }
};

std::atomic<FileEnv*>& current_env() {
  static std::atomic<FileEnv*> env{&FileEnv::standard()};
  return env;
}

}  // namespace

FileEnv& FileEnv::standard() {
  static PosixFileEnv env;
  return env;
}

FileEnv& FileEnv::current() { return *current_env().load(); }

void write_file_atomically(FileEnv& env, const SafeDir& dir, std::string_view name,
                           std::string_view tmp_name, std::string_view text, mode_t mode) {
  dir.try_remove(tmp_name, false);
  {
    const std::unique_ptr<WritableFile> file = env.create_file(dir, tmp_name, mode);
    file->write_at(text.data(), text.size(), 0);
    file->sync();
  }
  env.rename(dir, tmp_name, name);
  env.sync_dir(dir);
}

namespace {

// (directory, name) of an output path; Error(kInvalidArgument) naming `option` when it names no
// file.
std::pair<std::string, std::string> split_output_path(const std::string& path,
                                                      const std::string& option) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const auto slash = p.rfind('/');
  std::string parent = slash == std::string::npos ? "." : slash == 0 ? "/" : p.substr(0, slash);
  std::string name = slash == std::string::npos ? p : p.substr(slash + 1);
  if (name.empty() || name == "." || name == "..")
    fail(ErrorCode::kInvalidArgument, strcat(option, " '", path, "' does not name a file"));
  return {parent, name};
}

}  // namespace

ReplacingFile::ReplacingFile(const std::string& path, const std::string& option, bool overwrite,
                             mode_t mode, FileEnv& env)
    : overwrite_(overwrite), env_(env) {
  auto [parent, name] = split_output_path(path, option);
  SafeDirOptions o;
  o.role = option + " directory";
  dir_ = SafeDir::open(parent, o);
  name_ = std::move(name);
  dir_.check_replaceable(name_, overwrite_);
  tmp_ = strcat(".", name_, ".tmp-", ::getpid());
  dir_.try_remove(tmp_, false);
  file_ = env_.create_file(dir_, tmp_, mode);
}

ReplacingFile::~ReplacingFile() {
  file_.reset();
  if (!committed_ && dir_) dir_.try_remove(tmp_, false);
}

void ReplacingFile::commit() {
  file_->sync();
  file_.reset();
  dir_.check_replaceable(name_, overwrite_);  // again: it may have appeared while we wrote
  const unsigned flags = overwrite_ ? 0u : static_cast<unsigned>(RENAME_NOREPLACE);
  if (::renameat2(dir_.fd(), tmp_.c_str(), dir_.fd(), name_.c_str(), flags) != 0) {
    const int err = errno;
    if (err == EEXIST)
      fail(ErrorCode::kInvalidArgument, strcat(path(), " exists; pass --overwrite to replace it"));
    throw IoError("rename", dir_.child_path(tmp_), 0, 0, err, strcat("to ", path()));
  }
  committed_ = true;
  dir_.sync();
}

ScopedFileEnv::ScopedFileEnv(FileEnv& env) : previous_(current_env().exchange(&env)) {}
ScopedFileEnv::~ScopedFileEnv() { current_env().store(previous_); }

// ---- faults
// ---------------------------------------------------------------------------------------

const char* file_op_name(FileOp op) {
  switch (op) {
    case FileOp::kWrite: return "write";
    case FileOp::kSync: return "fsync";
    case FileOp::kRead: return "read";
    case FileOp::kRename: return "rename";
    case FileOp::kSyncDir: return "fsync dir";
  }
  return "?";
}

FileFault FileFault::fail_nth(FileOp op, std::uint64_t nth, int errnum) {
  FileFault f;
  f.op = op;
  f.nth = nth;
  f.errnum = errnum;
  return f;
}

FileFault FileFault::delay_every(FileOp op, std::chrono::milliseconds delay) {
  FileFault f;
  f.op = op;
  f.count = 0;
  f.errnum = 0;
  f.delay = delay;
  return f;
}

std::size_t FaultInjectingFileEnv::add_fault(const FileFault& fault) {
  MutexLock lock(mu_);
  faults_.push_back({fault});
  return faults_.size() - 1;
}

void FaultInjectingFileEnv::clear_faults() {
  MutexLock lock(mu_);
  faults_.clear();
}

std::uint64_t FaultInjectingFileEnv::fired(std::size_t fault_id) const {
  MutexLock lock(mu_);
  return fault_id < faults_.size() ? faults_[fault_id].fired : 0;
}

std::uint64_t FaultInjectingFileEnv::calls(FileOp op) const {
  MutexLock lock(mu_);
  return calls_[static_cast<int>(op)];
}

void FaultInjectingFileEnv::before(FileOp op, std::string_view name, const std::string& path,
                                   std::uint64_t offset, std::uint64_t length) {
  int errnum = 0;
  std::chrono::milliseconds delay{0};
  {
    MutexLock lock(mu_);
    ++calls_[static_cast<int>(op)];
    for (State& s : faults_) {
      const FileFault& f = s.fault;
      if (f.op != op || (!f.name.empty() && name.find(f.name) == std::string_view::npos)) continue;
      const std::uint64_t k = ++s.matched;
      if (k < f.nth || (f.count != 0 && k >= f.nth + f.count)) continue;
      ++s.fired;
      if (f.errnum != 0 && errnum == 0) errnum = f.errnum;
      delay = std::max(delay, f.delay);
    }
  }
  if (errnum != 0) throw IoError(file_op_name(op), path, offset, length, errnum, "injected fault");
  if (delay.count() > 0) std::this_thread::sleep_for(delay);
}

namespace {

// The file objects of a FaultInjectingFileEnv: each call asks the env first (`ask`: the operation,
// the file's name in its directory and path, the byte range), then goes to the wrapped file.
template <typename File>
class FaultyFile : public File {
 public:
  FaultyFile(FaultInjectingFileEnv& env, std::unique_ptr<File> file, std::string name)
      : env_(env), file_(std::move(file)), name_(std::move(name)) {}
  const std::string& path() const override { return file_->path(); }

 protected:
  File& ask(FileOp op, std::uint64_t offset, std::uint64_t n) {
    env_.before(op, name_, path(), offset, n);
    return *file_;
  }
  File& file() const { return *file_; }

 private:
  FaultInjectingFileEnv& env_;
  const std::unique_ptr<File> file_;
  const std::string name_;
};

class FaultyWritableFile final : public FaultyFile<WritableFile> {
 public:
  using FaultyFile::FaultyFile;
  void write_at(const void* data, std::uint64_t n, std::uint64_t offset) override {
    ask(FileOp::kWrite, offset, n).write_at(data, n, offset);
  }
  void truncate(std::uint64_t size) override { file().truncate(size); }
  void sync() override { ask(FileOp::kSync, 0, 0).sync(); }
  bool direct() const override { return file().direct(); }
};

class FaultyRandomAccessFile final : public FaultyFile<RandomAccessFile> {
 public:
  using FaultyFile::FaultyFile;
  struct stat status() const override {
    return file().status();
  }
  void read_at(void* dst, std::uint64_t n, std::uint64_t offset) override {
    ask(FileOp::kRead, offset, n).read_at(dst, n, offset);
  }
};

}  // namespace

std::unique_ptr<WritableFile> FaultInjectingFileEnv::create_file(const SafeDir& dir,
                                                                 std::string_view name, mode_t mode,
                                                                 WriteMode how) {
  return std::make_unique<FaultyWritableFile>(
      *this, FileEnvWrapper::create_file(dir, name, mode, how), std::string(name));
}

std::unique_ptr<RandomAccessFile> FaultInjectingFileEnv::open_file(const SafeDir& dir,
                                                                   std::string_view name) {
  return std::make_unique<FaultyRandomAccessFile>(*this, FileEnvWrapper::open_file(dir, name),
                                                  std::string(name));
}

void FaultInjectingFileEnv::rename(const SafeDir& dir, std::string_view from, std::string_view to) {
  before(FileOp::kRename, from, dir.child_path(from), 0, 0);
  FileEnvWrapper::rename(dir, from, to);
}

void FaultInjectingFileEnv::sync_dir(const SafeDir& dir) {
  before(FileOp::kSyncDir, "", dir.path(), 0, 0);
  FileEnvWrapper::sync_dir(dir);
}

}  // namespace strata
