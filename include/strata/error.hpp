// strata's one error policy (see docs/errors.md): every failure is reported by throwing
// strata::Error or one of its subclasses. Nothing is swallowed, nothing calls exit() or abort().
//
// - ConfigError: bad YAML or --set input; names file:line:col and the key path.
// - IoError: a failed read, write, open, fallocate...; names path, offset, length and errno.
// - Every other failure is an Error with an ErrorCode saying which class it is.
//
// Asynchronous work (I/O completions, device streams, collectives) reports its failure at the
// wait that observes it, as one of these exceptions.
//
// Thread-safety: these are plain value types; copy them freely across threads
// (std::exception_ptr is how asynchronous layers carry them to the waiting thread).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace strata {

enum class ErrorCode {
  kInvalidArgument,  // bad input from the caller: arguments, paths, options (exit code 2)
  kConfig,           // bad configuration (exit code 2)
  kIo,               // an I/O call or completion failed
  kChecksum,         // data read back does not match what was written
  kOutOfMemory,      // an allocation or a pinned/device budget could not be met
  kBudget,           // a tier's configured budget would be exceeded
  kTimeout,          // a wait ran past its deadline (collective, pool, completion)
  kDevice,           // a CUDA (or emulated device) call failed
  kComm,             // a collective or its bootstrap failed (MPI, NCCL, peer lost)
  kUnsupported,      // a feature this build or this machine does not have
  kNumeric,          // inf/NaN or other numeric failure that the caller must handle
  kCancelled,        // the operation was cancelled (engine shut down with it in flight)
  kInternal,         // a broken invariant inside strata: a bug
};

const char* error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const noexcept { return code_; }
  // Process exit code the CLI uses for this error: 2 for bad input (kConfig, kInvalidArgument,
  // and an IoError that is a path error, see IoError::bad_path()), 1 for everything else.
  int exit_code() const noexcept;

 protected:
  bool bad_input_ = false;  // set by subclasses whose instance is bad input despite its code

 private:
  ErrorCode code_;
};

// A configuration error. what() is "FILE:LINE:COL: KEY.PATH: message" (parts that are unknown
// are left out, e.g. "--set zero.stage=9: zero.stage: ...").
class ConfigError : public Error {
 public:
  ConfigError(std::string file, int line, int column, std::string key_path, std::string message);
  const std::string& file() const noexcept { return file_; }
  int line() const noexcept { return line_; }      // 1-based, 0 when unknown
  int column() const noexcept { return column_; }  // 1-based, 0 when unknown
  const std::string& key_path() const noexcept { return key_path_; }
  const std::string& detail() const noexcept { return detail_; }

 private:
  std::string file_;
  int line_;
  int column_;
  std::string key_path_;
  std::string detail_;
};

// An I/O error. what() is "OP PATH offset=O length=L: strerror(errno) (errno N)[: context]".
// errnum is a positive errno value (0 when the failure is not an errno, e.g. a short read that
// could not be completed).
class IoError : public Error {
 public:
  IoError(std::string op, std::string path, std::uint64_t offset, std::uint64_t length, int errnum,
          std::string context = {});
  const std::string& op() const noexcept { return op_; }
  const std::string& path() const noexcept { return path_; }
  std::uint64_t offset() const noexcept { return offset_; }
  std::uint64_t length() const noexcept { return length_; }
  int errnum() const noexcept { return errnum_; }
  const std::string& context() const noexcept { return context_; }  // what the caller was doing
  // True when the error is about the path the caller gave rather than the device: a path
  // operation (open, stat, mkdir, rmdir, unlink, rename, access, readlink, opendir, statvfs,
  // mkdtemp) failing with ENOENT, ENOTDIR, EISDIR, EACCES, EPERM, ELOOP, ENAMETOOLONG, EEXIST,
  // EROFS, ENXIO, ENODEV or EINVAL (O_DIRECT refused). exit_code() is 2 for these.
  bool bad_path() const noexcept { return bad_input_; }
  // The same error with `more` added after the context ("context; more"): for a layer that
  // rethrows with what it was doing (docs/errors.md, rule 7).
  IoError with_context(const std::string& more) const;

 private:
  std::string op_;
  std::string path_;
  std::string context_;
  std::uint64_t offset_;
  std::uint64_t length_;
  int errnum_;
};

// Throws Error(code, message). For one-line checks: `if (!ok) fail(ErrorCode::kIo, "...")`.
[[noreturn]] void fail(ErrorCode code, const std::string& message);

// Builds a message from streamable parts: strcat("offset ", off, " is not aligned").
template <typename... Args>
std::string strcat(const Args&... args);

}  // namespace strata

#include <sstream>
template <typename... Args>
std::string strata::strcat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
