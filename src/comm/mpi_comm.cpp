// MPI backend (host buffers). Collectives are built from non-blocking point-to-point messages on a
// private duplicate of MPI_COMM_WORLD, so that (a) a wait can poll with MPI_Test against the
// deadline and name the peers it has not heard from, and (b) reductions are done locally in rank
// order (deterministic, identical on every rank, bitwise equal to the in-process backend):
//   reduce-scatter: every rank sends each peer that peer's slice (what a ring moves, in one hop);
//   all-gather: every rank sends its slice to each peer; all-reduce: reduce-scatter of an equal
//   split, then all-gather; broadcast: the root sends to each peer; barrier: empty messages.
// Messages larger than 1 GiB are cut into pieces (MPI counts are int).
// The C API only: never pull in the deprecated C++ bindings (they need libmpi_cxx).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "comm/backend.hpp"
#include "core/mutex.hpp"
#include "strata/log.hpp"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kMaxMessage = std::size_t{1} << 30;

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, buf, &len);
  fail(ErrorCode::kComm,
       strcat("MPI ", what, " failed: ", std::string(buf, static_cast<std::size_t>(len))));
}

// Process-wide MPI lifetime: initialized by the first communicator if needed, finalized when the
// last one created here goes away (unless MPI was started by someone else, or a peer was lost).
Mutex g_mpi_mu;
int g_mpi_users GUARDED_BY(g_mpi_mu) = 0;
bool g_we_initialized GUARDED_BY(g_mpi_mu) = false;
bool g_mpi_poisoned GUARDED_BY(g_mpi_mu) = false;

struct Request {
  MPI_Request req = MPI_REQUEST_NULL;
  int peer = 0;
  bool recv = false;
};

class MpiCommunicator;

class MpiHandle final : public CommHandle {
 public:
  MpiHandle(MpiCommunicator* comm, std::string what) : comm_(comm), what_(std::move(what)) {}
  ~MpiHandle() override;
  void wait() override;
  bool done() override;

  MpiCommunicator* comm_;
  std::string what_;
  Clock::time_point deadline_;
  std::vector<Request> reqs_;
  std::vector<std::vector<unsigned char>> tmp_;
  std::function<void()> finish_;                // after the requests complete
  std::function<void(MpiHandle&)> next_stage_;  // posts a second round (all-reduce)
  bool finished_ = false;
  bool waited_ = false;

 private:
  bool poll();  // true when every request of the current stage completed
};

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(double timeout_s) : Communicator(timeout_s) {
    {
      MutexLock lock(g_mpi_mu);
      int inited = 0, finalized = 0;
      MPI_Initialized(&inited);
      MPI_Finalized(&finalized);
      if (finalized) fail(ErrorCode::kComm, "MPI communicator: MPI was already finalized");
      if (!inited) {
        int provided = 0;
        check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided),
                  "MPI_Init_thread");
        g_we_initialized = true;
      }
      ++g_mpi_users;
    }
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    log_debug("MPI communicator: rank ", rank_, " of ", size_);
  }
  ~MpiCommunicator() override {
    if (broken_.empty()) MPI_Comm_free(&comm_);
    MutexLock lock(g_mpi_mu);
    if (!broken_.empty()) g_mpi_poisoned = true;
    if (--g_mpi_users == 0 && g_we_initialized) {
      if (g_mpi_poisoned) {
        log_warn("MPI: not finalizing after a lost peer (MPI_Finalize could hang)");
      } else {
        MPI_Finalize();
      }
      g_we_initialized = false;
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend_name() const override { return "mpi"; }
  BufferLocation buffer_location() const override { return BufferLocation::kHost; }

  std::unique_ptr<CommHandle> all_reduce_async(const void* send, void* recv, std::size_t count,
                                               DType dtype) override {
    auto counts = comm::split_counts(count, size_);
    stats_.add(CollectiveKind::kAllReduce, 2 * comm::scatter_gather_bytes(counts, rank_, dtype));
    auto h = start(CollectiveKind::kAllReduce);
    std::size_t es = dtype_size(dtype);
    std::size_t off = 0;
    for (int r = 0; r < rank_; ++r) off += counts[static_cast<std::size_t>(r)];
    // Stage 1: reduce-scatter into a private chunk; stage 2: all-gather the chunks into recv.
    auto chunk =
        std::make_shared<std::vector<unsigned char>>(counts[static_cast<std::size_t>(rank_)] * es);
    post_reduce_scatter(*h, send, chunk->data(), counts, dtype);
    const int tag2 = next_tag();
    h->next_stage_ = [this, chunk, counts, recv, off, es, dtype, tag2](MpiHandle& hh) {
      std::memcpy(static_cast<unsigned char*>(recv) + off * es, chunk->data(), chunk->size());
      post_all_gather(hh, static_cast<unsigned char*>(recv) + off * es, recv, counts, dtype, tag2);
    };
    return h;
  }
  std::unique_ptr<CommHandle> reduce_scatter_async(const void* send, void* recv,
                                                   std::span<const std::size_t> counts,
                                                   DType dtype) override {
    auto h = start_counted(CollectiveKind::kReduceScatter, counts, dtype);
    post_reduce_scatter(*h, send, recv, {counts.begin(), counts.end()}, dtype);
    return h;
  }
  std::unique_ptr<CommHandle> all_gather_async(const void* send, void* recv,
                                               std::span<const std::size_t> counts,
                                               DType dtype) override {
    auto h = start_counted(CollectiveKind::kAllGather, counts, dtype);
    post_all_gather(*h, send, recv, {counts.begin(), counts.end()}, dtype, next_tag());
    return h;
  }
  std::unique_ptr<CommHandle> broadcast_async(void* buffer, std::size_t count, DType dtype,
                                              int root) override {
    if (root < 0 || root >= size_)
      fail(ErrorCode::kInvalidArgument, strcat("broadcast: root ", root, " out of range"));
    std::size_t bytes = count * dtype_size(dtype);
    stats_.add(CollectiveKind::kBroadcast, rank_ == root ? bytes * (size_ - 1) : 0);
    auto h = start(CollectiveKind::kBroadcast);
    int tag = next_tag();
    if (rank_ == root) {
      for (int p = 0; p < size_; ++p)
        if (p != rank_) isend(*h, buffer, bytes, p, tag);
    } else {
      irecv(*h, buffer, bytes, root, tag);
    }
    return h;
  }
  std::unique_ptr<CommHandle> barrier_async() override {
    stats_.add(CollectiveKind::kBarrier, 0);
    auto h = start(CollectiveKind::kBarrier);
    int tag = next_tag();
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      isend(*h, nullptr, 0, p, tag);
      irecv(*h, nullptr, 0, p, tag);
    }
    return h;
  }
  CommStats stats() const override { return stats_.snapshot(); }

  // Called by a handle that timed out or failed: later collectives fail at once.
  void mark_broken(const std::string& why) {
    if (broken_.empty()) broken_ = why;
  }

 private:
  // start() of a collective over per-rank `counts`, its bytes counted in stats_.
  std::unique_ptr<MpiHandle> start_counted(CollectiveKind kind, std::span<const std::size_t> counts,
                                           DType dtype) {
    comm::count_per_rank(stats_, kind, counts, rank_, size_, dtype);
    return start(kind);
  }
  std::unique_ptr<MpiHandle> start(CollectiveKind kind) {
    std::string what =
        strcat("mpi ", collective_name(kind), " #", seq_++, " (rank ", rank_, " of ", size_, ")");
    if (!broken_.empty())
      fail(ErrorCode::kComm, strcat(what, ": communicator is broken: ", broken_));
    auto h = std::make_unique<MpiHandle>(this, std::move(what));
    h->deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(timeout_s_));
    return h;
  }
  int next_tag() { return static_cast<int>(tag_++ % 32767); }

  void isend(MpiHandle& h, const void* buf, std::size_t bytes, int peer, int tag) {
    std::size_t off = 0;
    do {
      std::size_t n = std::min(bytes - off, kMaxMessage);
      Request r{MPI_REQUEST_NULL, peer, false};
      check_mpi(MPI_Isend(bytes ? static_cast<const unsigned char*>(buf) + off : nullptr,
                          static_cast<int>(n), MPI_BYTE, peer, tag, comm_, &r.req),
                "MPI_Isend");
      h.reqs_.push_back(r);
      off += n;
    } while (off < bytes);
  }
  void irecv(MpiHandle& h, void* buf, std::size_t bytes, int peer, int tag) {
    std::size_t off = 0;
    do {
      std::size_t n = std::min(bytes - off, kMaxMessage);
      Request r{MPI_REQUEST_NULL, peer, true};
      check_mpi(MPI_Irecv(bytes ? static_cast<unsigned char*>(buf) + off : nullptr,
                          static_cast<int>(n), MPI_BYTE, peer, tag, comm_, &r.req),
                "MPI_Irecv");
      h.reqs_.push_back(r);
      off += n;
    } while (off < bytes);
  }

  void post_reduce_scatter(MpiHandle& h, const void* send, void* recv,
                           std::vector<std::size_t> counts, DType dtype) {
    const std::size_t es = dtype_size(dtype);
    const int tag = next_tag();
    std::vector<std::size_t> offs(counts.size());
    std::size_t off = 0;
    for (std::size_t r = 0; r < counts.size(); ++r) {
      offs[r] = off;
      off += counts[r];
    }
    const std::size_t mine = counts[static_cast<std::size_t>(rank_)];
    h.tmp_.assign(static_cast<std::size_t>(size_), {});
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      h.tmp_[static_cast<std::size_t>(p)].resize(mine * es);
      irecv(h, h.tmp_[static_cast<std::size_t>(p)].data(), mine * es, p, tag);
    }
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      isend(h, static_cast<const unsigned char*>(send) + offs[static_cast<std::size_t>(p)] * es,
            counts[static_cast<std::size_t>(p)] * es, p, tag);
    }
    const void* own =
        static_cast<const unsigned char*>(send) + offs[static_cast<std::size_t>(rank_)] * es;
    MpiHandle* hp = &h;
    h.finish_ = [hp, own, recv, mine, dtype, this] {
      std::vector<const void*> srcs(static_cast<std::size_t>(size_));
      for (int p = 0; p < size_; ++p)
        srcs[static_cast<std::size_t>(p)] =
            p == rank_ ? own : hp->tmp_[static_cast<std::size_t>(p)].data();
      comm::ordered_sum(srcs.data(), size_, recv, mine, dtype);
      hp->tmp_.clear();
    };
  }

  void post_all_gather(MpiHandle& h, const void* send, void* recv,
                       const std::vector<std::size_t>& counts, DType dtype, int tag) {
    const std::size_t es = dtype_size(dtype);
    std::size_t off = 0, own_off = 0;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_)
        own_off = off;
      else
        irecv(h, static_cast<unsigned char*>(recv) + off * es,
              counts[static_cast<std::size_t>(p)] * es, p, tag);
      off += counts[static_cast<std::size_t>(p)];
    }
    const std::size_t mine = counts[static_cast<std::size_t>(rank_)] * es;
    for (int p = 0; p < size_; ++p)
      if (p != rank_) isend(h, send, mine, p, tag);
    unsigned char* dst = static_cast<unsigned char*>(recv) + own_off * es;
    h.finish_ = [dst, send, mine] {
      if (mine && dst != send) std::memmove(dst, send, mine);
    };
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::uint64_t seq_ = 0;
  std::uint64_t tag_ = 0;
  std::string broken_;
  comm::StatsCounter stats_;
};

MpiHandle::~MpiHandle() { comm::wait_unwaited(*this, waited_); }

bool MpiHandle::poll() {
  bool all = true;
  for (auto& r : reqs_) {
    if (r.req == MPI_REQUEST_NULL) continue;
    int flag = 0;
    MPI_Status st;
    int rc = MPI_Test(&r.req, &flag, &st);
    if (rc != MPI_SUCCESS) {
      comm_->mark_broken(what_);
      check_mpi(rc, strcat(what_, ": MPI_Test (peer ", r.peer, ")").c_str());
    }
    if (!flag) all = false;
  }
  return all;
}

bool MpiHandle::done() {
  if (finished_) return true;
  if (!poll()) return false;
  if (finish_) {
    auto f = std::move(finish_);
    finish_ = nullptr;
    f();
  }
  if (next_stage_) {
    auto s = std::move(next_stage_);
    next_stage_ = nullptr;
    reqs_.clear();
    s(*this);
    return done();
  }
  finished_ = true;
  return true;
}

void MpiHandle::wait() {
  waited_ = true;
  int spins = 0;
  while (!done()) {
    if (Clock::now() > deadline_) {
      std::string peers;
      for (auto& r : reqs_) {
        if (r.req == MPI_REQUEST_NULL) continue;
        std::string p = std::to_string(r.peer);
        if (peers.find(p) == std::string::npos) peers += (peers.empty() ? "" : ",") + p;
        if (r.recv) {
          MPI_Cancel(&r.req);
          MPI_Request_free(&r.req);
        }
      }
      std::string msg =
          strcat(what_, ": timed out after ", comm_->timeout_s(), " s waiting for rank(s) ", peers);
      comm_->mark_broken(msg);
      finished_ = true;
      fail(ErrorCode::kTimeout, msg);
    }
    if (++spins > 100)
      std::this_thread::sleep_for(std::chrono::microseconds(spins > 1000 ? 500 : 20));
  }
}

}  // namespace

bool mpi_available() { return true; }

std::unique_ptr<Communicator> make_mpi_communicator(double timeout_s) {
  if (!(timeout_s > 0)) fail(ErrorCode::kInvalidArgument, "MPI communicator: timeout must be > 0");
  return std::make_unique<MpiCommunicator>(timeout_s);
}

}  // namespace strata
