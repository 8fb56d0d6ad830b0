// The thread-pool engine: io_threads x queue_depth workers (capped at 256) doing pread/pwrite,
// one piece each at a time, for machines where io_uring is unavailable.
#include <unistd.h>

#include <cerrno>
#include <deque>
#include <thread>

#include "core/mutex.hpp"
#include "io/engine_base.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata::io {

namespace {

constexpr std::uint32_t kMaxWorkers = 256;

class ThreadEngine final : public EngineBase {
 public:
  explicit ThreadEngine(const IoEngineOptions& options) : EngineBase(options) {
    std::uint64_t n = std::uint64_t{options_.io_threads} * options_.queue_depth;
    if (n > kMaxWorkers) n = kMaxWorkers;
    for (std::uint64_t i = 0; i < n; ++i) workers_.emplace_back([this] { work(); });
  }
  ~ThreadEngine() override { shutdown(); }

  IoEngineKind kind() const override { return IoEngineKind::kThreads; }
  const char* name() const override { return "threads"; }

  void shutdown() override {
    MutexLock slock(shutdown_mu_);
    if (shut_) return;
    shut_ = true;
    stop_accepting();
    {
      MutexLock lock(mu_);
      stopping_ = true;
      deadline_ = std::chrono::steady_clock::now() + options_.shutdown_timeout;
    }
    cv_.notify_all();
    // Bounded drain: after the deadline, queued pieces are cancelled (workers check it).
    std::thread canceller([this] {
      UniqueLock lock(mu_);
      if (cv_done_.wait_until(lock, deadline_, [this]() REQUIRES(mu_) { return queue_.empty(); }))
        return;
      std::deque<Piece> dropped;
      dropped.swap(queue_);
      lock.unlock();
      log_warn("io threads: shutdown timeout; cancelling ", dropped.size(), " queued I/O pieces");
      for (auto& p : dropped) cancel_piece(p);
    });
    canceller.join();
    for (auto& t : workers_) t.join();
  }

 protected:
  void dispatch(std::vector<Piece>& pieces) override {
    bool dead = false;
    {
      MutexLock lock(mu_);
      if (exited_)
        dead = true;
      else
        for (auto& p : pieces) queue_.push_back(p);
    }
    if (dead) {
      for (auto& p : pieces) cancel_piece(p);
      return;
    }
    if (pieces.size() == 1)
      cv_.notify_one();
    else
      cv_.notify_all();
  }

 private:
  void work() {
    for (;;) {
      Piece p;
      {
        UniqueLock lock(mu_);
        cv_.wait(lock, [this]() REQUIRES(mu_) { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) {
          if (++stopped_workers_ == workers_.size()) exited_ = true;
          cv_done_.notify_all();
          return;
        }
        p = queue_.front();
        queue_.pop_front();
        if (queue_.empty()) cv_done_.notify_all();
      }
      execute(p);
    }
  }

  void execute(Piece& p) {
    const int fd = p.file->fd();
    for (;;) {
      std::uint8_t* buf = p.buffer + p.done;
      std::size_t len = p.length - p.done;
      auto off = static_cast<off_t>(p.offset + p.done);
      long r = p.kind == IoOp::kRead ? static_cast<long>(::pread(fd, buf, len, off))
                                     : static_cast<long>(::pwrite(fd, buf, len, off));
      if (r < 0) r = -errno;
      r = apply_raw_result_hook(p, r);
      if (r == -EAGAIN || r == -EINTR) {
        if (++p.attempts <= kMaxRetries) {
          count_retry();
          continue;
        }
        fail_piece(p, static_cast<int>(-r),
                   strcat("still failing after ", kMaxRetries, " retries").c_str());
        return;
      }
      if (r < 0) {
        fail_piece(p, static_cast<int>(-r), nullptr);
        return;
      }
      auto got = static_cast<std::uint64_t>(r);
      if (got >= len) {
        complete_piece(p, nullptr);
        return;
      }
      if (got == 0 && (p.kind == IoOp::kRead || ++p.attempts > kMaxRetries)) {
        std::string ctx = strcat(p.kind == IoOp::kRead ? "short read: end of file after "
                                                       : "short write: no progress after ",
                                 p.done, " of ", p.length, " bytes");
        fail_piece(p, 0, ctx.c_str());
        return;
      }
      p.done += got;
      std::uint32_t a = p.file->alignment();
      if (a > 1) p.done -= p.done % a;
      count_retry();
    }
  }

  Mutex mu_;
  CondVar cv_, cv_done_;
  std::deque<Piece> queue_ GUARDED_BY(mu_);
  std::vector<std::thread> workers_;  // filled by the constructor, joined by shutdown()
  bool stopping_ GUARDED_BY(mu_) = false;
  bool exited_ GUARDED_BY(mu_) = false;
  std::size_t stopped_workers_ GUARDED_BY(mu_) = 0;
  std::chrono::steady_clock::time_point deadline_ GUARDED_BY(mu_);
  Mutex shutdown_mu_;
  bool shut_ GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace

std::unique_ptr<IoEngine> make_thread_engine_impl(const IoEngineOptions& options) {
  return std::make_unique<ThreadEngine>(options);
}

}  // namespace strata::io
