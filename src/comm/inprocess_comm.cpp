// In-process backend: ranks are threads of one process that meet in shared memory.
//
// Each communicator owns a worker thread that runs its collectives in issue order (so async
// handles overlap with the caller). A collective is a rendezvous in a slot keyed by its sequence
// number: every rank posts its buffers (phase 1, with the deadline), then each rank computes its
// own result from the others' send buffers into a private temporary (rank-ordered FP32 sums), marks
// itself done and waits until every rank is done reading (phase 2) before writing its recv
// buffer and returning, so send buffers may be reused as soon as wait() returns.
//
// A rank that does not arrive before the deadline makes the waiting ranks throw Error(kTimeout)
// naming it; the group is then broken and every later collective throws Error(kComm).
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <thread>

#include "comm/backend.hpp"
#include "core/mutex.hpp"
#include "strata/log.hpp"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

struct Post {
  CollectiveKind kind{};
  const void* send = nullptr;
  void* recv = nullptr;
  std::vector<std::size_t> counts;  // reduce_scatter / all_gather
  std::size_t count = 0;            // all_reduce / broadcast
  DType dtype = DType::kFp32;
  int root = 0;
};

struct Slot {
  std::vector<const Post*> posts;  // by rank; null until that rank arrives
  int arrived = 0;
  int done = 0;
  int departed = 0;
};

class Group {
 public:
  explicit Group(int n) : n_(n) {}
  int n() const { return n_; }
  Mutex mu;
  CondVar cv;
  std::map<std::uint64_t, Slot> slots GUARDED_BY(mu);
  bool broken GUARDED_BY(mu) = false;
  std::string broken_reason GUARDED_BY(mu);

 private:
  int n_;
};

std::string describe(CollectiveKind kind, std::uint64_t seq, int rank, int n) {
  return strcat("inprocess ", collective_name(kind), " #", seq, " (rank ", rank, " of ", n, ")");
}

// Phase 1: posts `mine` in the collective's slot and waits until every rank has posted. Throws
// on timeout (naming the ranks that did not arrive: the group is broken from then on) or when
// the group is (or becomes) broken.
const Slot& arrive(Group& g, int rank, std::uint64_t seq, const Post& mine, const std::string& what,
                   double timeout_s) {
  const int n = g.n();
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  UniqueLock lock(g.mu);
  if (g.broken) fail(ErrorCode::kComm, strcat(what, ": communicator is broken: ", g.broken_reason));
  Slot& s = g.slots[seq];
  if (s.posts.empty()) s.posts.assign(static_cast<std::size_t>(n), nullptr);
  s.posts[static_cast<std::size_t>(rank)] = &mine;
  ++s.arrived;
  if (s.arrived == n) g.cv.notify_all();
  while (s.arrived < n && !g.broken) {
    if (g.cv.wait_until(lock, deadline) == std::cv_status::timeout && s.arrived < n && !g.broken) {
      std::string missing;
      for (int r = 0; r < n; ++r)
        if (!s.posts[static_cast<std::size_t>(r)]) missing += strcat(missing.empty() ? "" : ",", r);
      std::string msg =
          strcat(what, ": timed out after ", timeout_s, " s waiting for rank(s) ", missing);
      g.broken = true;
      g.broken_reason = msg;
      g.cv.notify_all();
      fail(ErrorCode::kTimeout, msg);
    }
  }
  if (s.arrived < n) {  // broken by another rank while we waited
    fail(ErrorCode::kComm, strcat(what, ": communicator is broken: ", g.broken_reason));
  }
  return s;
}

// "" when every rank posted the same collective as `mine`, else what differs.
std::string find_mismatch(const Slot& slot, const Post& mine, int n, const std::string& what) {
  for (int r = 0; r < n; ++r) {
    const Post& p = *slot.posts[static_cast<std::size_t>(r)];
    if (p.kind != mine.kind || p.dtype != mine.dtype || p.counts != mine.counts ||
        p.count != mine.count || p.root != mine.root)
      return strcat(what, ": rank ", r, " issued a mismatched collective (",
                    collective_name(p.kind), ", dtype ", dtype_name(p.dtype), ")");
  }
  return {};
}

// This rank's result, computed from every rank's send buffer (valid until all are done); empty
// when the rank receives nothing.
std::vector<unsigned char> compute(const Slot& slot, const Post& mine, CollectiveKind kind,
                                   int rank, int n) {
  const std::size_t es = dtype_size(mine.dtype);
  std::vector<unsigned char> tmp;
  std::vector<const void*> srcs(static_cast<std::size_t>(n));
  const auto send = [&](int r) { return slot.posts[static_cast<std::size_t>(r)]->send; };
  switch (kind) {
    case CollectiveKind::kAllReduce: {
      tmp.resize(mine.count * es);
      for (int r = 0; r < n; ++r) srcs[static_cast<std::size_t>(r)] = send(r);
      comm::ordered_sum(srcs.data(), n, tmp.data(), mine.count, mine.dtype);
      break;
    }
    case CollectiveKind::kReduceScatter: {
      std::size_t off = 0;
      for (int r = 0; r < rank; ++r) off += mine.counts[static_cast<std::size_t>(r)];
      std::size_t cnt = mine.counts[static_cast<std::size_t>(rank)];
      tmp.resize(cnt * es);
      for (int r = 0; r < n; ++r)
        srcs[static_cast<std::size_t>(r)] = static_cast<const unsigned char*>(send(r)) + off * es;
      comm::ordered_sum(srcs.data(), n, tmp.data(), cnt, mine.dtype);
      break;
    }
    case CollectiveKind::kAllGather: {
      tmp.resize(comm::sum_counts(mine.counts) * es);
      std::size_t off = 0;
      for (int r = 0; r < n; ++r) {
        std::size_t cnt = mine.counts[static_cast<std::size_t>(r)];
        if (cnt) std::memcpy(tmp.data() + off * es, send(r), cnt * es);
        off += cnt;
      }
      break;
    }
    case CollectiveKind::kBroadcast:
      if (rank != mine.root && mine.count) {
        tmp.resize(mine.count * es);
        std::memcpy(tmp.data(), send(mine.root), mine.count * es);
      }
      break;
    case CollectiveKind::kBarrier: break;
  }
  return tmp;
}

// Phase 2: waits until every rank has read the send buffers (so they may be reused), the last
// one out frees the slot; a mismatch breaks the group.
void depart(Group& g, std::uint64_t seq, const std::string& what, double timeout_s,
            const std::string& mismatch) {
  const int n = g.n();
  UniqueLock lock(g.mu);
  Slot& s = g.slots[seq];
  ++s.done;
  if (s.done == n) g.cv.notify_all();
  // Phase 2 depends only on the others finishing their local copy (they have all arrived), so
  // it cannot stall on a peer; the deadline below only guards against a bug.
  const auto safety =
      Clock::now() + std::chrono::seconds(60) +
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  while (s.done < n) {
    if (g.cv.wait_until(lock, safety) == std::cv_status::timeout && s.done < n)
      fail(ErrorCode::kInternal, strcat(what, ": peers did not finish reading"));
  }
  if (++s.departed == n) g.slots.erase(seq);
  if (!mismatch.empty()) {
    g.broken = true;
    g.broken_reason = mismatch;
    g.cv.notify_all();
  }
}

// Runs one collective for `rank`. Throws on timeout or a broken group.
void run_collective(Group& g, int rank, std::uint64_t seq, const Post& mine, double timeout_s) {
  const int n = g.n();
  const std::string what = describe(mine.kind, seq, rank, n);
  const Slot& slot = arrive(g, rank, seq, mine, what, timeout_s);
  // Every rank arrived: the posts (and the buffers they name) stay valid until all are done.
  const std::string mismatch = find_mismatch(slot, mine, n, what);
  const std::vector<unsigned char> tmp =
      compute(slot, mine, mismatch.empty() ? mine.kind : CollectiveKind::kBarrier, rank, n);
  depart(g, seq, what, timeout_s, mismatch);
  if (!mismatch.empty()) fail(ErrorCode::kComm, mismatch);
  if (!tmp.empty()) std::memcpy(mine.recv, tmp.data(), tmp.size());
}

struct OpState {
  Mutex mu;
  CondVar cv;
  bool finished GUARDED_BY(mu) = false;
  std::exception_ptr error GUARDED_BY(mu);
  Post post;
  std::uint64_t seq = 0;
};

class InProcessHandle final : public CommHandle {
 public:
  explicit InProcessHandle(std::shared_ptr<OpState> op) : op_(std::move(op)) {}
  ~InProcessHandle() override { comm::wait_unwaited(*this, waited_); }
  void wait() override {
    waited_ = true;
    UniqueLock lock(op_->mu);
    // (The worker enforces the deadline.)
    op_->cv.wait(lock, [&]() REQUIRES(op_->mu) { return op_->finished; });
    if (op_->error) {
      auto e = op_->error;
      op_->error = nullptr;
      std::rethrow_exception(e);
    }
  }
  bool done() override {
    MutexLock lock(op_->mu);
    return op_->finished;
  }

 private:
  std::shared_ptr<OpState> op_;
  bool waited_ = false;
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<Group> group, int rank, double timeout_s)
      : Communicator(timeout_s), group_(std::move(group)), rank_(rank) {
    worker_ = std::thread([this] { work(); });
  }
  ~InProcessCommunicator() override {
    {
      MutexLock lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  int rank() const override { return rank_; }
  int size() const override { return group_->n(); }
  const char* backend_name() const override { return "inprocess"; }
  BufferLocation buffer_location() const override { return BufferLocation::kHost; }

  std::unique_ptr<CommHandle> all_reduce_async(const void* send, void* recv, std::size_t count,
                                               DType dtype) override {
    Post p{CollectiveKind::kAllReduce, send, recv, {}, count, dtype, 0};
    auto c = comm::split_counts(count, size());
    stats_.add(p.kind, 2 * comm::scatter_gather_bytes(c, rank_, dtype));
    return submit(std::move(p));
  }
  std::unique_ptr<CommHandle> reduce_scatter_async(const void* send, void* recv,
                                                   std::span<const std::size_t> counts,
                                                   DType dtype) override {
    return submit_per_rank(CollectiveKind::kReduceScatter, send, recv, counts, dtype);
  }
  std::unique_ptr<CommHandle> all_gather_async(const void* send, void* recv,
                                               std::span<const std::size_t> counts,
                                               DType dtype) override {
    return submit_per_rank(CollectiveKind::kAllGather, send, recv, counts, dtype);
  }
  std::unique_ptr<CommHandle> broadcast_async(void* buffer, std::size_t count, DType dtype,
                                              int root) override {
    if (root < 0 || root >= size())
      fail(ErrorCode::kInvalidArgument, strcat("broadcast: root ", root, " out of range"));
    Post p{CollectiveKind::kBroadcast, buffer, buffer, {}, count, dtype, root};
    stats_.add(p.kind, rank_ == root ? count * dtype_size(dtype) * (size() - 1) : 0);
    return submit(std::move(p));
  }
  std::unique_ptr<CommHandle> barrier_async() override {
    stats_.add(CollectiveKind::kBarrier, 0);
    return submit(Post{CollectiveKind::kBarrier, nullptr, nullptr, {}, 0, DType::kFp32, 0});
  }
  CommStats stats() const override { return stats_.snapshot(); }

 private:
  // reduce_scatter / all_gather: counts[r] elements at rank r.
  std::unique_ptr<CommHandle> submit_per_rank(CollectiveKind kind, const void* send, void* recv,
                                              std::span<const std::size_t> counts, DType dtype) {
    comm::count_per_rank(stats_, kind, counts, rank_, size(), dtype);
    return submit(Post{kind, send, recv, {counts.begin(), counts.end()}, 0, dtype, 0});
  }
  std::unique_ptr<CommHandle> submit(Post p) {
    auto op = std::make_shared<OpState>();
    op->post = std::move(p);
    op->seq = next_seq_++;
    {
      MutexLock lock(mu_);
      queue_.push_back(op);
    }
    cv_.notify_all();
    return std::make_unique<InProcessHandle>(op);
  }

  void work() {
    for (;;) {
      std::shared_ptr<OpState> op;
      {
        UniqueLock lock(mu_);
        cv_.wait(lock, [&]() REQUIRES(mu_) { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        op = queue_.front();
        queue_.pop_front();
      }
      std::exception_ptr err;
      try {
        run_collective(*group_, rank_, op->seq, op->post, timeout_s_);
      } catch (...) {
        err = std::current_exception();
      }
      {
        // Hand the only reference to the waiter: the exception object must not be released by
        // this thread after publication (its refcount is invisible to ThreadSanitizer).
        MutexLock lock(op->mu);
        op->finished = true;
        op->error = std::move(err);
        op->cv.notify_all();
      }
    }
  }

  std::shared_ptr<Group> group_;
  int rank_;
  std::uint64_t next_seq_ = 0;  // issuing thread only
  comm::StatsCounter stats_;
  Mutex mu_;
  CondVar cv_;
  std::deque<std::shared_ptr<OpState>> queue_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread worker_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_inprocess_communicators(int ranks,
                                                                        double timeout_s) {
  if (ranks < 1)
    fail(ErrorCode::kInvalidArgument, strcat("in-process communicator: ", ranks, " ranks"));
  if (!(timeout_s > 0))
    fail(ErrorCode::kInvalidArgument, "in-process communicator: timeout must be > 0");
  auto group = std::make_shared<Group>(ranks);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < ranks; ++r)
    out.push_back(std::make_unique<InProcessCommunicator>(group, r, timeout_s));
  return out;
}

}  // namespace strata
