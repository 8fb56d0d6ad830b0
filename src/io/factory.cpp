// Options, the io_uring probe, and the engine factory.
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>

#include "core/safe_fs.hpp"
#include "io/engine_base.hpp"
#include "io/uring_setup.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata {

namespace io {
std::unique_ptr<IoEngine> make_uring_engine_impl(const IoEngineOptions& options);
std::unique_ptr<IoEngine> make_thread_engine_impl(const IoEngineOptions& options);
}  // namespace io

const char* io_op_name(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

IoEngineOptions IoEngineOptions::from(const NvmeTierConfig& config) {
  IoEngineOptions o;
  o.kind = config.engine;
  o.block_size = config.block_size;
  o.queue_depth = config.queue_depth;
  o.io_threads = config.io_threads;
  o.direct_io = config.direct_io;
  o.sqpoll = config.sqpoll;
  return o;
}

void IoEngineOptions::validate() const {
  if (block_size == 0 || block_size % 4096 != 0 || block_size > (1ULL << 30))
    fail(ErrorCode::kInvalidArgument,
         strcat("io: block_size ", block_size, " must be a multiple of 4096, at most 1 GiB"));
  if (queue_depth < 1 || queue_depth > 4096)
    fail(ErrorCode::kInvalidArgument, strcat("io: queue_depth ", queue_depth, " must be 1..4096"));
  if (io_threads < 1 || io_threads > 64)
    fail(ErrorCode::kInvalidArgument, strcat("io: io_threads ", io_threads, " must be 1..64"));
  if (shutdown_timeout.count() < 0)
    fail(ErrorCode::kInvalidArgument, "io: shutdown_timeout must not be negative");
}

FileId IoEngine::open_file(const std::string& path, IoFileOptions file_options) {
  file_options.direct_io = options().direct_io;
  return register_file(std::make_shared<IoFile>(IoFile::open(path, file_options)));
}

void IoEngine::wait_for(IoTicket ticket, std::chrono::nanoseconds timeout) {
  if (!wait(ticket, timeout))
    fail(ErrorCode::kTimeout,
         strcat("io: ", name(), " request (ticket ", ticket, ") not complete after ",
                std::chrono::duration<double>(timeout).count(), " s"));
}

void IoEngine::wait_all_for(std::chrono::nanoseconds timeout) {
  if (!wait_all(timeout))
    fail(ErrorCode::kTimeout, strcat("io: ", name(), " requests not complete after ",
                                     std::chrono::duration<double>(timeout).count(), " s"));
}

namespace {

std::string probe_name() {
  static std::atomic<unsigned> counter{0};
  std::random_device rd;
  return strcat(".strata-io-probe-", ::getpid(), "-", counter.fetch_add(1), "-", rd());
}

// `dir`, or its nearest ancestor that exists (where `dir` would be created).
std::string existing_ancestor(const std::string& dir) {
  std::string p = normalize_path(dir.empty() ? "." : dir);
  for (;;) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) == 0 || errno != ENOENT) return p;
    const auto slash = p.rfind('/');
    if (slash == std::string::npos) return ".";
    p = slash == 0 ? "/" : p.substr(0, slash);
  }
}

// One I/O through the ring, checked; returns "" or what failed.
std::string ring_io(io_uring* ring, bool write, int fd, void* buf, unsigned len) {
  io_uring_sqe* sqe = io_uring_get_sqe(ring);
  if (!sqe) return "no submission queue entry";
  if (write)
    io_uring_prep_write(sqe, fd, buf, len, 0);
  else
    io_uring_prep_read(sqe, fd, buf, len, 0);
  int rc = io_uring_submit(ring);
  if (rc != 1)
    return strcat("io_uring_submit: ", rc < 0 ? std::strerror(-rc) : "nothing submitted");
  io_uring_cqe* cqe = nullptr;
  __kernel_timespec ts{10, 0};
  rc = io_uring_wait_cqe_timeout(ring, &cqe, &ts);
  if (rc < 0) return strcat("waiting for the ", write ? "write" : "read", ": ", std::strerror(-rc));
  int res = cqe->res;
  io_uring_cqe_seen(ring, cqe);
  if (res < 0) return strcat(write ? "write" : "read", " completion: ", std::strerror(-res));
  if (static_cast<unsigned>(res) != len)
    return strcat(write ? "write" : "read", " completion: ", res, " of ", len, " bytes");
  return {};
}

}  // namespace

IoUringProbe probe_io_uring(const IoEngineOptions& options, const std::string& dir) {
  IoUringProbe out;
  io_uring ring{};
  io::UringSetup setup = io::setup_ring(&ring, 4, options.sqpoll);
  if (setup.rc < 0) {
    out.reason =
        strcat("io_uring_setup failed: ", std::strerror(-setup.rc), " (errno ", -setup.rc, ")");
    return out;
  }
  const std::string at = existing_ancestor(dir);
  if (at != normalize_path(dir))
    log_debug("io: ", dir, " does not exist yet; probing io_uring in ", at);
  std::string path;
  try {
    SafeDir d = SafeDir::open(at, {.role = "I/O directory"});
    const std::string name = probe_name();
    path = d.child_path(name);
    IoFileOptions fo;
    fo.create = true;
    fo.exclusive = true;
    fo.direct_io = options.direct_io;
    IoFile file = [&] {
      try {
        return IoFile::open_at(d.fd(), name, path, fo);
      } catch (const Error&) {
        out.file_error = std::current_exception();
        throw;
      }
    }();
    d.try_remove(name, false);
    const unsigned len = 4096;
    IoBuffer wbuf = IoBuffer::allocate(2 * len, HugePageMode::kNone);
    std::mt19937 rng(std::random_device{}());
    for (unsigned i = 0; i < len; ++i) wbuf.bytes()[i] = static_cast<std::uint8_t>(rng());
    std::uint8_t* rbuf = wbuf.bytes() + len;
    std::string e = ring_io(&ring, true, file.fd(), wbuf.data(), len);
    if (e.empty()) e = ring_io(&ring, false, file.fd(), rbuf, len);
    if (e.empty() && std::memcmp(wbuf.data(), rbuf, len) != 0) e = "data read back differs";
    if (e.empty())
      out.ok = true;
    else
      out.reason = strcat("round trip on ", dir, ": ", e);
  } catch (const Error& ex) {
    if (!out.file_error && path.empty()) out.file_error = std::current_exception();  // SafeDir
    out.reason = strcat("probe file in ", dir, ": ", ex.what());
  } catch (const std::exception& ex) {
    out.reason = strcat("probe file in ", dir, ": ", ex.what());
  }
  io_uring_queue_exit(&ring);
  return out;
}

std::unique_ptr<IoEngine> make_io_uring_engine(const IoEngineOptions& options) {
  return io::make_uring_engine_impl(options);
}

std::unique_ptr<IoEngine> make_thread_io_engine(const IoEngineOptions& options) {
  return io::make_thread_engine_impl(options);
}

std::unique_ptr<IoEngine> make_io_engine(const IoEngineOptions& options,
                                         const std::string& probe_dir) {
  options.validate();
  if (options.kind == IoEngineKind::kThreads) {
    log_info("io: using the thread-pool engine (forced by engine: threads)");
    return make_thread_io_engine(options);
  }
  IoUringProbe probe = probe_io_uring(options, probe_dir);
  if (probe.file_error) std::rethrow_exception(probe.file_error);
  if (probe.ok) {
    try {
      auto engine = make_io_uring_engine(options);
      log_debug("io: using the io_uring engine (", options.io_threads, " ring(s), queue depth ",
                options.queue_depth, ")");
      return engine;
    } catch (const Error& e) {
      probe.reason = e.what();
    }
  }
  if (options.kind == IoEngineKind::kIoUring)
    fail(ErrorCode::kUnsupported,
         strcat("io: engine io_uring was requested but is unavailable: ", probe.reason));
  log_warn("io: io_uring unavailable (", probe.reason, "); using the thread-pool engine");
  return make_thread_io_engine(options);
}

}  // namespace strata
