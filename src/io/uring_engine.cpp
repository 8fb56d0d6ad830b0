// The io_uring engine: io_threads rings, each created and driven by its own thread (so that
// SINGLE_ISSUER / DEFER_TASKRUN hold: every io_uring call on a ring, registration included, is
// made by that ring's thread). Submitters hand pieces to a ring through a mutex-protected queue and
// wake it through an eventfd whose read is always armed in the ring.
#include <liburing.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <future>
#include <thread>

#include "core/mutex.hpp"
#include "io/engine_base.hpp"
#include "io/uring_setup.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata::io {

namespace {

constexpr std::uint64_t kWakeTag = 1;
constexpr std::uint64_t kCancelTag = 2;
constexpr unsigned kMaxFiles = 1024;

class UringEngine final : public EngineBase {
 public:
  explicit UringEngine(const IoEngineOptions& options);
  ~UringEngine() override { shutdown(); }

  IoEngineKind kind() const override { return IoEngineKind::kIoUring; }
  const char* name() const override { return "io_uring"; }
  void shutdown() override;

 protected:
  void dispatch(std::vector<Piece>& pieces) override;
  int on_file_registered(int slot, int fd) override;
  void on_file_unregistered(int slot) override;
  bool on_buffers_registered(std::span<const IoRegion> regions) override;

 private:
  using Command = std::function<int(io_uring*)>;
  struct Ring {
    std::thread thread;
    Mutex mu;  // between the ring's thread and submitters
    std::vector<Piece*> incoming GUARDED_BY(mu);
    std::vector<std::pair<Command, std::promise<int>>> commands GUARDED_BY(mu);
    bool need_wake GUARDED_BY(mu) = false;
    bool exited GUARDED_BY(mu) = false;
    bool stopping GUARDED_BY(mu) = false;
    std::chrono::steady_clock::time_point stop_deadline GUARDED_BY(mu);
    int efd = -1;                   // set before the thread starts, closed after it ends
    bool files_registered = false;  // set by the thread before it reports ready
  };

  // The ring thread's own state (run() and its steps; no other thread touches it).
  struct Loop {
    io_uring ring{};
    std::deque<Piece*> pending;  // taken from the submitters, not yet in the kernel
    unsigned in_flight = 0;      // pieces in the kernel
    bool cancelling = false, cancel_sent = false;
    std::uint64_t efd_value = 0;  // the eventfd read's target
    bool efd_armed = false;
    bool stopping = false;  // shutdown() has been called (copied from the Ring)
    std::chrono::steady_clock::time_point deadline;
  };

  void run(Ring& r, std::promise<std::string>& ready);
  bool open_ring(Ring& r, Loop& l, std::promise<std::string>& ready);
  void arm_wake(Ring& r, Loop& l);
  void take_incoming(Ring& r, Loop& l);
  void cancel_when_due(Loop& l);
  void cancel_pending(Loop& l);
  void start_pending(Ring& r, Loop& l);
  bool submit_and_wait(Ring& r, Loop& l);
  void reap(Ring& r, Loop& l);
  void close_ring(Ring& r, Loop& l);
  void wake(Ring& r);
  int run_on_ring(Ring& r, Command cmd);
  int run_on_all(const Command& cmd);
  void handle(Ring& r, io_uring* ring, Piece* p, int res, std::deque<Piece*>& pending,
              bool cancelling);
  static void prep(io_uring_sqe* sqe, Piece* p, bool files_registered);

  std::vector<std::unique_ptr<Ring>> rings_;
  std::atomic<std::uint64_t> rr_{0};
  Mutex shutdown_mu_;
  bool shut_ GUARDED_BY(shutdown_mu_) = false;
};

UringEngine::UringEngine(const IoEngineOptions& options) : EngineBase(options) {
  std::string error;
  for (std::uint32_t i = 0; i < options_.io_threads; ++i) {
    auto r = std::make_unique<Ring>();
    r->efd = eventfd(0, EFD_CLOEXEC);
    if (r->efd < 0) {
      error = strcat("eventfd: ", std::strerror(errno));
      break;
    }
    std::promise<std::string> ready;
    auto fut = ready.get_future();
    Ring* rp = r.get();
    r->thread = std::thread([this, rp, &ready] { run(*rp, ready); });
    rings_.push_back(std::move(r));
    std::string e = fut.get();
    if (!e.empty()) {
      error = e;
      break;
    }
  }
  if (!error.empty()) {
    shutdown();
    fail(ErrorCode::kUnsupported, strcat("io_uring: ", error));
  }
}

void UringEngine::shutdown() {
  MutexLock lock(shutdown_mu_);
  if (shut_) return;
  shut_ = true;
  stop_accepting();
  auto deadline = std::chrono::steady_clock::now() + options_.shutdown_timeout;
  for (auto& r : rings_) {
    {
      MutexLock rl(r->mu);
      r->stopping = true;
      r->stop_deadline = deadline;
    }
    wake(*r);
  }
  for (auto& r : rings_) {
    if (r->thread.joinable()) r->thread.join();
    if (r->efd >= 0) ::close(r->efd);
    r->efd = -1;
  }
}

void UringEngine::wake(Ring& r) {
  std::uint64_t one = 1;
  if (r.efd >= 0) {
    ssize_t n = ::write(r.efd, &one, sizeof one);
    (void)n;  // eventfd write cannot fail short of overflow, and any pending value wakes it
  }
}

void UringEngine::dispatch(std::vector<Piece>& pieces) {
  const std::size_t n = rings_.size();
  std::vector<std::vector<Piece*>> per_ring(n);
  std::uint64_t start = rr_.fetch_add(pieces.size(), std::memory_order_relaxed);
  for (std::size_t i = 0; i < pieces.size(); ++i)
    per_ring[(start + i) % n].push_back(new Piece(pieces[i]));
  for (std::size_t i = 0; i < n; ++i) {
    if (per_ring[i].empty()) continue;
    Ring& r = *rings_[i];
    bool wake_it = false, dead = false;
    {
      MutexLock lock(r.mu);
      if (r.exited) {
        dead = true;
      } else {
        r.incoming.insert(r.incoming.end(), per_ring[i].begin(), per_ring[i].end());
        wake_it = r.need_wake;
        r.need_wake = false;
      }
    }
    if (dead) {
      for (Piece* p : per_ring[i]) {
        cancel_piece(*p);
        delete p;
      }
    } else if (wake_it) {
      wake(r);
    }
  }
}

int UringEngine::run_on_ring(Ring& r, Command cmd) {
  std::promise<int> prom;
  auto fut = prom.get_future();
  {
    MutexLock lock(r.mu);
    if (r.exited) return -ESHUTDOWN;
    r.commands.emplace_back(std::move(cmd), std::move(prom));
    r.need_wake = false;
  }
  wake(r);
  if (fut.wait_for(std::chrono::seconds(30)) != std::future_status::ready) return -ETIMEDOUT;
  return fut.get();
}

int UringEngine::run_on_all(const Command& cmd) {
  for (auto& r : rings_) {
    int rc = run_on_ring(*r, cmd);
    if (rc < 0) return rc;
  }
  return 0;
}

int UringEngine::on_file_registered(int slot, int fd) {
  if (slot < 0 || static_cast<unsigned>(slot) >= kMaxFiles) return -1;
  for (auto& r : rings_)
    if (!r->files_registered) return -1;
  int rc = run_on_all([slot, fd](io_uring* ring) {
    int f = fd;
    int n = io_uring_register_files_update(ring, static_cast<unsigned>(slot), &f, 1);
    return n == 1 ? 0 : (n < 0 ? n : -EIO);
  });
  if (rc < 0) {
    log_debug("io_uring: registering fd ", fd, " failed (", std::strerror(-rc),
              "); using it unregistered");
    return -1;
  }
  return slot;
}

void UringEngine::on_file_unregistered(int slot) {
  run_on_all([slot](io_uring* ring) {
    int f = -1;
    io_uring_register_files_update(ring, static_cast<unsigned>(slot), &f, 1);
    return 0;
  });
}

bool UringEngine::on_buffers_registered(std::span<const IoRegion> regions) {
  std::vector<iovec> iov;
  for (auto& r : regions) iov.push_back({r.base, r.length});
  int rc = run_on_all([&iov](io_uring* ring) {
    io_uring_unregister_buffers(ring);  // -ENXIO when none: fine
    return io_uring_register_buffers(ring, iov.data(), static_cast<unsigned>(iov.size()));
  });
  if (rc < 0) {
    log_warn("io_uring: registering ", regions.size(), " buffer region(s) failed (",
             std::strerror(-rc), "); using unregistered buffers");
    run_on_all([](io_uring* ring) {
      io_uring_unregister_buffers(ring);
      return 0;
    });
    return false;
  }
  return true;
}

void UringEngine::prep(io_uring_sqe* sqe, Piece* p, bool files_registered) {
  int fd = p->file->fd();
  bool fixed_file = files_registered && p->fixed_file >= 0;
  if (fixed_file) fd = p->fixed_file;
  std::uint8_t* buf = p->buffer + p->done;
  auto len = static_cast<unsigned>(p->length - p->done);
  std::uint64_t off = p->offset + p->done;
  if (p->kind == IoOp::kRead) {
    if (p->buf_index >= 0)
      io_uring_prep_read_fixed(sqe, fd, buf, len, off, p->buf_index);
    else
      io_uring_prep_read(sqe, fd, buf, len, off);
  } else {
    if (p->buf_index >= 0)
      io_uring_prep_write_fixed(sqe, fd, buf, len, off, p->buf_index);
    else
      io_uring_prep_write(sqe, fd, buf, len, off);
  }
  if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data(sqe, p);
}

void UringEngine::handle(Ring& r, io_uring* ring, Piece* p, int res, std::deque<Piece*>& pending,
                         bool cancelling) {
  (void)r;
  (void)ring;
  long result = apply_raw_result_hook(*p, res);
  if (result == -ECANCELED && cancelling) {
    cancel_piece(*p);
    delete p;
    return;
  }
  if (result == -EAGAIN || result == -EINTR) {
    if (++p->attempts <= kMaxRetries) {
      count_retry();
      pending.push_front(p);
      return;
    }
    fail_piece(*p, static_cast<int>(-result),
               strcat("still failing after ", kMaxRetries, " retries").c_str());
    delete p;
    return;
  }
  if (result < 0) {
    fail_piece(*p, static_cast<int>(-result), nullptr);
    delete p;
    return;
  }
  std::uint64_t remaining = p->length - p->done;
  auto got = static_cast<std::uint64_t>(result);
  if (got >= remaining) {
    complete_piece(*p, nullptr);
    delete p;
    return;
  }
  if (got == 0) {
    if (p->kind == IoOp::kRead || ++p->attempts > kMaxRetries) {
      std::string ctx = strcat(p->kind == IoOp::kRead ? "short read: end of file after "
                                                      : "short write: no progress after ",
                               p->done, " of ", p->length, " bytes");
      fail_piece(*p, 0, ctx.c_str());
      delete p;
      return;
    }
  }
  // Short transfer: resubmit the rest (under O_DIRECT from the last aligned boundary).
  p->done += got;
  std::uint32_t a = p->file->alignment();
  if (a > 1) p->done -= p->done % a;
  count_retry();
  pending.push_front(p);
}

// The ring thread: takes pieces and commands from the submitters, keeps up to queue_depth pieces
// in the kernel, reaps completions, and at shutdown drains (or, past the deadline, cancels).
void UringEngine::run(Ring& r, std::promise<std::string>& ready) {
  Loop l;
  if (!open_ring(r, l, ready)) return;
  arm_wake(r, l);
  for (;;) {
    take_incoming(r, l);
    cancel_when_due(l);
    start_pending(r, l);
    if (l.stopping && l.pending.empty() && l.in_flight == 0) {
      MutexLock lock(r.mu);
      if (r.incoming.empty() && r.commands.empty()) break;
      continue;
    }
    if (!submit_and_wait(r, l)) break;
    reap(r, l);
  }
  close_ring(r, l);
}

// Sets the ring up and tells the constructor (`ready`: "" or what failed). False when it failed.
bool UringEngine::open_ring(Ring& r, Loop& l, std::promise<std::string>& ready) {
  UringSetup setup = setup_ring(&l.ring, options_.queue_depth + 2, options_.sqpoll);
  if (setup.rc < 0) {
    ready.set_value(strcat("io_uring_queue_init_params: ", std::strerror(-setup.rc), " (errno ",
                           -setup.rc, ")"));
    MutexLock lock(r.mu);
    r.exited = true;
    return false;
  }
  r.files_registered = io_uring_register_files_sparse(&l.ring, kMaxFiles) == 0;
  io_uring_register_ring_fd(&l.ring);  // optional speed-up; errors ignored
  log_debug("io_uring: ring up, flags ", describe_setup_flags(setup.flags),
            r.files_registered ? ", registered files" : "");
  ready.set_value({});
  return true;
}

// Arms the read of the ring's eventfd, through which submitters wake the thread.
void UringEngine::arm_wake(Ring& r, Loop& l) {
  io_uring_sqe* sqe = io_uring_get_sqe(&l.ring);
  if (!sqe) return;
  io_uring_prep_read(sqe, r.efd, &l.efd_value, sizeof l.efd_value, 0);
  io_uring_sqe_set_data64(sqe, kWakeTag);
  l.efd_armed = true;
}

// Moves what the submitters queued into the loop, runs the commands, reads the shutdown state.
void UringEngine::take_incoming(Ring& r, Loop& l) {
  std::vector<std::pair<Command, std::promise<int>>> commands;
  {
    MutexLock lock(r.mu);
    for (Piece* p : r.incoming) l.pending.push_back(p);
    r.incoming.clear();
    commands.swap(r.commands);
    l.stopping = r.stopping;
    l.deadline = r.stop_deadline;
  }
  for (auto& [cmd, prom] : commands) prom.set_value(cmd(&l.ring));
}

// Past the shutdown deadline: cancels the queued pieces and asks the kernel to cancel the rest.
void UringEngine::cancel_when_due(Loop& l) {
  if (l.stopping && !l.cancelling && std::chrono::steady_clock::now() >= l.deadline) {
    l.cancelling = true;
    log_warn("io_uring: shutdown timeout; cancelling ", l.pending.size(), " queued and ",
             l.in_flight, " in-flight I/O pieces");
    cancel_pending(l);
  }
  if (l.cancelling && !l.cancel_sent && l.in_flight > 0) {
    if (io_uring_sqe* sqe = io_uring_get_sqe(&l.ring)) {
      io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY);
      io_uring_sqe_set_data64(sqe, kCancelTag);
      l.cancel_sent = true;
    }
  }
}

void UringEngine::cancel_pending(Loop& l) {
  for (Piece* p : l.pending) {
    cancel_piece(*p);
    delete p;
  }
  l.pending.clear();
}

// Prepares queued pieces while the queue depth allows (none once cancelling).
void UringEngine::start_pending(Ring& r, Loop& l) {
  while (!l.cancelling && l.in_flight < options_.queue_depth && !l.pending.empty()) {
    io_uring_sqe* sqe = io_uring_get_sqe(&l.ring);
    if (!sqe) break;
    Piece* p = l.pending.front();
    l.pending.pop_front();
    prep(sqe, p, r.files_registered);
    ++l.in_flight;
  }
}

// Submits what is prepared and waits for a completion when nothing else can be done now (with a
// timeout while stopping, to check the deadline). False: give up (pieces stuck in the kernel 10 s
// after the cancel).
bool UringEngine::submit_and_wait(Ring& r, Loop& l) {
  const unsigned qd = options_.queue_depth;
  bool block;
  {
    MutexLock lock(r.mu);
    block = r.incoming.empty() && r.commands.empty() &&
            (l.pending.empty() || l.in_flight >= qd || l.cancelling);
    // Ask submitters for an eventfd wake only when new pieces could be started now. Blocked on
    // a full queue, the next completion wakes this thread anyway and it picks up whatever
    // arrived meanwhile: a wake per submission would cost an extra io_uring_enter and re-arm.
    // (Commands and shutdown always wake.)
    if (block) r.need_wake = l.in_flight < qd && !l.cancelling;
  }
  int rc;
  if (block && l.stopping) {
    if (l.cancelling && std::chrono::steady_clock::now() >= l.deadline + std::chrono::seconds(10)) {
      log_error("io_uring: ", l.in_flight,
                " I/O piece(s) still in the kernel 10 s after cancel;"
                " giving up on them (their waits will time out)");
      return false;
    }
    __kernel_timespec ts{0, 100'000'000};  // wake up now and then to check the deadline
    io_uring_cqe* cqe = nullptr;
    rc = io_uring_submit_and_wait_timeout(&l.ring, &cqe, 1, &ts, nullptr);
  } else if (block) {
    rc = io_uring_submit_and_wait(&l.ring, 1);
  } else {
    rc = io_uring_submit_and_get_events(&l.ring);
  }
  if (rc < 0 && rc != -ETIME && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
    log_error("io_uring: io_uring_enter failed: ", std::strerror(-rc), " (errno ", -rc, ")");
    // Avoid a hot loop; completions still get reaped below.
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Handles every completion in the queue; re-arms the wake; cancels retries asked for while
// cancelling.
void UringEngine::reap(Ring& r, Loop& l) {
  io_uring_cqe* cqe;
  unsigned head, seen = 0;
  io_uring_for_each_cqe(&l.ring, head, cqe) {
    ++seen;
    std::uint64_t tag = cqe->user_data;
    if (tag == kWakeTag) {
      l.efd_armed = false;
      continue;
    }
    if (tag == kCancelTag) continue;
    --l.in_flight;
    handle(r, &l.ring, reinterpret_cast<Piece*>(tag), cqe->res, l.pending, l.cancelling);
  }
  io_uring_cq_advance(&l.ring, seen);
  if (!l.efd_armed) arm_wake(r, l);
  if (l.cancelling) cancel_pending(l);  // retries requested while cancelling
}

// The thread ends: whatever arrived too late is cancelled, commands answered -ESHUTDOWN.
void UringEngine::close_ring(Ring& r, Loop& l) {
  std::vector<Piece*> late;
  {
    MutexLock lock(r.mu);
    r.exited = true;
    late.swap(r.incoming);
    for (auto& [cmd, prom] : r.commands) prom.set_value(-ESHUTDOWN);
    r.commands.clear();
  }
  for (Piece* p : late) {
    cancel_piece(*p);
    delete p;
  }
  io_uring_queue_exit(&l.ring);  // cancels the armed eventfd read
}

}  // namespace

std::unique_ptr<IoEngine> make_uring_engine_impl(const IoEngineOptions& options) {
  return std::make_unique<UringEngine>(options);
}

}  // namespace strata::io
