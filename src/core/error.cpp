#include "strata/error.hpp"

#include <cerrno>
#include <cstring>

namespace strata {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kConfig: return "config";
    case ErrorCode::kIo: return "io";
    case ErrorCode::kChecksum: return "checksum";
    case ErrorCode::kOutOfMemory: return "out of memory";
    case ErrorCode::kBudget: return "budget";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kDevice: return "device";
    case ErrorCode::kComm: return "comm";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kNumeric: return "numeric";
    case ErrorCode::kCancelled: return "cancelled";
    case ErrorCode::kInternal: return "internal";
  }
  return "unknown";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(message), code_(code) {}

int Error::exit_code() const noexcept {
  return (bad_input_ || code_ == ErrorCode::kConfig || code_ == ErrorCode::kInvalidArgument) ? 2
                                                                                             : 1;
}

namespace {
std::string config_message(const std::string& file, int line, int column, const std::string& key,
                           const std::string& message) {
  std::string out;
  if (!file.empty()) {
    out += file;
    if (line > 0) {
      out += ":" + std::to_string(line);
      if (column > 0) out += ":" + std::to_string(column);
    }
    out += ": ";
  }
  if (!key.empty()) out += key + ": ";
  out += message;
  return out;
}

std::string io_message(const std::string& op, const std::string& path, std::uint64_t offset,
                       std::uint64_t length, int errnum, const std::string& context) {
  std::string out =
      op + " " + path + " offset=" + std::to_string(offset) + " length=" + std::to_string(length);
  if (errnum != 0) {
    out += ": ";
    out += std::strerror(errnum);
    out += " (errno " + std::to_string(errnum) + ")";
  }
  if (!context.empty()) out += ": " + context;
  return out;
}

bool is_path_error(const std::string& op, int errnum) {
  static const char* const kPathOps[] = {"open",     "stat",    "lstat",   "mkdir",
                                         "rmdir",    "unlink",  "rename",  "access",
                                         "readlink", "opendir", "statvfs", "mkdtemp"};
  bool path_op = false;
  for (const char* p : kPathOps) path_op = path_op || op == p;
  if (!path_op) return false;
  switch (errnum) {
    case ENOENT:
    case ENOTDIR:
    case EISDIR:
    case EACCES:
    case EPERM:
    case ELOOP:
    case ENAMETOOLONG:
    case EEXIST:
    case EROFS:
    case ENXIO:
    case ENODEV:
    case EINVAL: return true;
    default: return false;
  }
}
}  // namespace

ConfigError::ConfigError(std::string file, int line, int column, std::string key_path,
                         std::string message)
    : Error(ErrorCode::kConfig, config_message(file, line, column, key_path, message)),
      file_(std::move(file)),
      line_(line),
      column_(column),
      key_path_(std::move(key_path)),
      detail_(std::move(message)) {}

IoError::IoError(std::string op, std::string path, std::uint64_t offset, std::uint64_t length,
                 int errnum, std::string context)
    : Error(ErrorCode::kIo, io_message(op, path, offset, length, errnum, context)),
      op_(std::move(op)),
      path_(std::move(path)),
      context_(std::move(context)),
      offset_(offset),
      length_(length),
      errnum_(errnum) {
  bad_input_ = is_path_error(op_, errnum_);
}

IoError IoError::with_context(const std::string& more) const {
  return IoError(op_, path_, offset_, length_, errnum_,
                 context_.empty() ? more : context_ + "; " + more);
}

void fail(ErrorCode code, const std::string& message) { throw Error(code, message); }

}  // namespace strata
