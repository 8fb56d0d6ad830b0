// NCCL backend (device buffers). The communicator is created non-blocking so that start-up and
// every collective can be bounded: after each NCCL call the state is polled with
// ncclCommGetAsyncError until it leaves ncclInProgress, and a handle's wait polls a CUDA event
// plus the async error against the deadline; on timeout the communicator is aborted
// (ncclCommAbort) and the error names the collective and this rank (NCCL does not say which peer).
// Uneven reduce-scatter / all-gather are grouped ncclReduce / ncclBroadcast calls, one per root.
#include <cuda_runtime.h>
#include <nccl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "comm/backend.hpp"
#include "core/poll_backoff.hpp"
#include "cuda/device_guard.hpp"
#include "strata/log.hpp"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

void check_cuda(cudaError_t rc, const std::string& what) {
  if (rc == cudaSuccess) return;
  (void)cudaGetLastError();  // not left for a later, unrelated launch check
  fail(ErrorCode::kDevice, strcat(what, ": ", cudaGetErrorName(rc), ": ", cudaGetErrorString(rc)));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kFp32: return ncclFloat32;
    case DType::kFp16: return ncclFloat16;
    case DType::kBf16: return ncclBfloat16;
  }
  return ncclFloat32;
}

Clock::time_point deadline_in(double s) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// The bootstrap file: the id, then a line naming its writer ("owner HOST PID START"): a file
// left by an earlier run on this host (its writer is gone, or the pid is now another process)
// is stale and ignored — reading it would make this rank wait for a root that does not exist.
// A writer on another host cannot be checked from here and is trusted.
std::string process_start(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  std::getline(f, stat);
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return "";
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
    if (i == 22) return field;  // starttime, in clock ticks since boot
  }
  return "";
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

std::string owner_line() {
  return strcat("owner ", host_name(), " ", ::getpid(), " ", process_start(::getpid()), "\n");
}

// True when the owner line names a process of this host that no longer exists.
bool stale_owner(const std::string& line) {
  std::istringstream in(line);
  std::string tag, host, start;
  long pid = 0;
  if (!(in >> tag >> host >> pid) || tag != "owner") return false;
  in >> start;
  if (host != host_name()) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  return !start.empty() && process_start(static_cast<pid_t>(pid)) != start;
}

void write_unique_id(const std::string& path, const ncclUniqueId& id) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(id.internal, sizeof(id.internal));
    const std::string owner = owner_line();
    f.write(owner.data(), static_cast<std::streamsize>(owner.size()));
    f.flush();
    if (!f) throw IoError("write", tmp, 0, sizeof(id.internal), errno, "NCCL unique id");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw IoError("rename", tmp, 0, 0, ec.value(), "NCCL unique id -> " + path);
}

ncclUniqueId read_unique_id(const std::string& path, double timeout_s) {
  auto deadline = deadline_in(timeout_s);
  bool said_stale = false;
  for (;;) {
    std::ifstream f(path, std::ios::binary);
    ncclUniqueId id{};
    if (f && f.read(id.internal, sizeof(id.internal)) && f.gcount() == sizeof(id.internal)) {
      std::string owner;
      std::getline(f, owner);
      if (!stale_owner(owner)) return id;
      if (!said_stale)
        log_warn("NCCL bootstrap: ", path, " was written by a process that is gone (", owner,
                 "): waiting for this run's rank 0 to replace it");
      said_stale = true;
    }
    if (Clock::now() > deadline)
      fail(ErrorCode::kTimeout,
           strcat("NCCL bootstrap: rank 0 did not write its unique id to ", path, " within ",
                  timeout_s, " s",
                  said_stale ? " (the file there is a stale one of an earlier run)" : ""));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

class NcclCommunicator;

class NcclHandle final : public CommHandle {
 public:
  NcclHandle(NcclCommunicator* c, std::string what, cudaEvent_t ev, Clock::time_point deadline)
      : comm_(c), what_(std::move(what)), event_(ev), deadline_(deadline) {}
  ~NcclHandle() override;
  void wait() override;
  bool done() override;

 private:
  NcclCommunicator* comm_;
  std::string what_;
  cudaEvent_t event_;
  Clock::time_point deadline_;
  bool finished_ = false;
  bool waited_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const NcclBootstrap& boot, int device, double timeout_s)
      : Communicator(timeout_s), device_(device) {
    if (boot.host) {
      rank_ = boot.host->rank();
      size_ = boot.host->size();
    } else {
      rank_ = boot.rank;
      size_ = boot.size;
      if (boot.file.empty())
        fail(ErrorCode::kInvalidArgument, "NCCL bootstrap: neither a host communicator nor a file");
    }
    if (rank_ < 0 || rank_ >= size_)
      fail(ErrorCode::kInvalidArgument, strcat("NCCL bootstrap: rank ", rank_, " of ", size_));
    cuda::DeviceGuard guard(device_);  // NCCL binds the current device; the caller's is restored
    ncclUniqueId id{};
    if (rank_ == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    if (boot.host) {
      static_assert(sizeof(id.internal) % 4 == 0);
      boot.host->broadcast(id.internal, sizeof(id.internal) / 4, DType::kFp32, 0);
    } else if (rank_ == 0) {
      write_unique_id(boot.file, id);
    } else {
      id = read_unique_id(boot.file, timeout_s);
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t rc = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
    if (rc != ncclSuccess && rc != ncclInProgress) check_nccl(rc, "ncclCommInitRankConfig");
    settle("ncclCommInitRankConfig");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check_cuda(cudaMalloc(&scratch_, sizeof(float)), "cudaMalloc(barrier scratch)");
    log_info("NCCL communicator: rank ", rank_, " of ", size_, " on device ", device_);
  }
  ~NcclCommunicator() override {
    try {
      cuda::DeviceGuard guard(device_);
      teardown();
    } catch (const std::exception& e) {
      log_error("NCCL communicator teardown (rank ", rank_, "): ", e.what());
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend_name() const override { return "nccl"; }
  BufferLocation buffer_location() const override { return BufferLocation::kDevice; }

  std::unique_ptr<CommHandle> all_reduce_async(const void* send, void* recv, std::size_t count,
                                               DType dtype) override {
    auto c = comm::split_counts(count, size_);
    stats_.add(CollectiveKind::kAllReduce, 2 * comm::scatter_gather_bytes(c, rank_, dtype));
    std::string what = begin(CollectiveKind::kAllReduce);
    enqueue(what, [&] {
      return ncclAllReduce(send, recv, count, nccl_type(dtype), ncclSum, comm_, stream_);
    });
    return finish(std::move(what));
  }
  std::unique_ptr<CommHandle> reduce_scatter_async(const void* send, void* recv,
                                                   std::span<const std::size_t> counts,
                                                   DType dtype) override {
    const std::size_t es = dtype_size(dtype);
    const auto* in = static_cast<const unsigned char*>(send);
    return shares_collective(
        CollectiveKind::kReduceScatter, counts, dtype,
        [&] {
          return ncclReduceScatter(send, recv, counts[0], nccl_type(dtype), ncclSum, comm_,
                                   stream_);
        },
        [&](int p, std::size_t off, std::size_t c) {  // rank p's share reduced to rank p
          return ncclReduce(in + off * es, recv, c, nccl_type(dtype), ncclSum, p, comm_, stream_);
        });
  }
  std::unique_ptr<CommHandle> all_gather_async(const void* send, void* recv,
                                               std::span<const std::size_t> counts,
                                               DType dtype) override {
    const std::size_t es = dtype_size(dtype);
    auto* out = static_cast<unsigned char*>(recv);
    return shares_collective(
        CollectiveKind::kAllGather, counts, dtype,
        [&] { return ncclAllGather(send, recv, counts[0], nccl_type(dtype), comm_, stream_); },
        [&](int p, std::size_t off, std::size_t c) {  // rank p's share broadcast from rank p
          return ncclBroadcast(send, out + off * es, c, nccl_type(dtype), p, comm_, stream_);
        });
  }
  std::unique_ptr<CommHandle> broadcast_async(void* buffer, std::size_t count, DType dtype,
                                              int root) override {
    if (root < 0 || root >= size_)
      fail(ErrorCode::kInvalidArgument, strcat("broadcast: root ", root, " out of range"));
    stats_.add(CollectiveKind::kBroadcast,
               rank_ == root ? count * dtype_size(dtype) * (size_ - 1) : 0);
    std::string what = begin(CollectiveKind::kBroadcast);
    enqueue(what, [&] {
      return ncclBroadcast(buffer, buffer, count, nccl_type(dtype), root, comm_, stream_);
    });
    return finish(std::move(what));
  }
  std::unique_ptr<CommHandle> barrier_async() override {
    stats_.add(CollectiveKind::kBarrier, 0);
    std::string what = begin(CollectiveKind::kBarrier);
    enqueue(what, [&] {
      return ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_);
    });
    return finish(std::move(what));
  }
  CommStats stats() const override { return stats_.snapshot(); }

  // Used by handles.
  void poll_async_error(const std::string& what) {
    if (!comm_) return;
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      broken_ = strcat(what, ": ", ncclGetErrorString(async));
      fail(ErrorCode::kComm, broken_);
    }
  }
  void abort_on_timeout(const std::string& msg) {
    broken_ = msg;
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  // Empty while the communicator works; after an abort or an asynchronous error, why not.
  const std::string& broken() const { return broken_; }
  int device() const { return device_; }

 private:
  void check_nccl(ncclResult_t rc, const std::string& what) {
    if (rc != ncclSuccess && rc != ncclInProgress) {
      broken_ = strcat(what, ": ", ncclGetErrorString(rc));
      fail(ErrorCode::kComm, strcat("NCCL ", broken_, " (rank ", rank_, " of ", size_, ")"));
    }
  }
  // Bounded teardown: outstanding work gets the communicator's timeout, then the communicator is
  // aborted (a dead peer must not hang the destructor).
  void teardown() {
    if (comm_ && broken_.empty()) {
      const auto deadline = deadline_in(timeout_s_);
      cudaError_t rc;
      PollBackoff backoff(std::chrono::microseconds(100));
      while ((rc = cudaStreamQuery(stream_)) == cudaErrorNotReady && Clock::now() < deadline) {
        (void)cudaGetLastError();
        backoff.pause();
      }
      (void)cudaGetLastError();
      if (rc == cudaSuccess) {
        ncclCommDestroy(comm_);
        comm_ = nullptr;
      } else {
        log_error("NCCL communicator (rank ", rank_,
                  "): outstanding collectives did not finish "
                  "within ",
                  timeout_s_, " s of teardown: aborting it");
      }
    }
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
    if (scratch_) log_cuda(cudaFree(scratch_), "cudaFree(barrier scratch)");
    if (stream_) log_cuda(cudaStreamDestroy(stream_), "cudaStreamDestroy");
  }
  static void log_cuda(cudaError_t rc, const char* what) {
    if (rc == cudaSuccess) return;
    (void)cudaGetLastError();
    log_error("NCCL communicator: ", what, ": ", cudaGetErrorString(rc));
  }
  // Polls a non-blocking communicator until its last call has left ncclInProgress (a PollBackoff
  // up to 100 us: an init takes milliseconds, an enqueue microseconds).
  void settle(const std::string& what) {
    auto deadline = deadline_in(timeout_s_);
    PollBackoff backoff(std::chrono::microseconds(100));
    for (;;) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
      if (rc != ncclSuccess) check_nccl(rc, what + " (ncclCommGetAsyncError)");
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) check_nccl(state, what);
      if (Clock::now() > deadline) {
        std::string msg = strcat("nccl ", what, " (rank ", rank_, " of ", size_,
                                 "): timed out after ", timeout_s_, " s (a peer did not join)");
        abort_on_timeout(msg);
        fail(ErrorCode::kTimeout, msg);
      }
      backoff.pause();
    }
  }
  std::string begin(CollectiveKind kind) {
    std::string what =
        strcat("nccl ", collective_name(kind), " #", seq_++, " (rank ", rank_, " of ", size_, ")");
    if (!broken_.empty() || !comm_)
      fail(ErrorCode::kComm, strcat(what, ": communicator is broken: ", broken_));
    return what;
  }
  // A collective over per-rank shares (reduce-scatter, all-gather): `even()`, one NCCL call, when
  // every share has the same size; otherwise `per_rank(p, offset, count)` (in elements) for each
  // rank with a share, in one NCCL group that is always closed (the first failure ends the loop).
  template <typename Even, typename PerRank>
  std::unique_ptr<CommHandle> shares_collective(CollectiveKind kind,
                                                std::span<const std::size_t> counts, DType dtype,
                                                Even&& even, PerRank&& per_rank) {
    comm::count_per_rank(stats_, kind, counts, rank_, size_, dtype);
    std::string what = begin(kind);
    if (std::all_of(counts.begin(), counts.end(), [&](std::size_t c) { return c == counts[0]; })) {
      enqueue(what, even);
      return finish(std::move(what));
    }
    enqueue(what, [&] {
      ncclResult_t rc = ncclGroupStart();
      std::size_t off = 0;
      for (int p = 0; p < size_ && (rc == ncclSuccess || rc == ncclInProgress); ++p) {
        const std::size_t c = counts[static_cast<std::size_t>(p)];
        if (c) rc = per_rank(p, off, c);
        off += c;
      }
      const ncclResult_t end = ncclGroupEnd();
      return rc != ncclSuccess && rc != ncclInProgress ? rc : end;
    });
    return finish(std::move(what));
  }
  // Issues one NCCL call with this communicator's device current (restored afterwards); polls
  // only when NCCL says the call is still in progress (a non-blocking communicator).
  template <typename F>
  void enqueue(const std::string& what, F&& call) {
    cuda::DeviceGuard guard(device_);
    const ncclResult_t rc = call();
    check_nccl(rc, what);
    if (rc == ncclInProgress) settle(what);
  }
  std::unique_ptr<CommHandle> finish(std::string what) {
    cuda::DeviceGuard guard(device_);  // the event must be of the stream's device
    cudaEvent_t ev = nullptr;
    check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), what + ": cudaEventCreate");
    cudaError_t rc = cudaEventRecord(ev, stream_);
    if (rc != cudaSuccess) {
      cudaEventDestroy(ev);
      check_cuda(rc, what + ": cudaEventRecord");
    }
    return std::make_unique<NcclHandle>(this, std::move(what), ev, deadline_in(timeout_s_));
  }

  int device_;
  int rank_ = 0;
  int size_ = 1;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
  std::uint64_t seq_ = 0;
  std::string broken_;
  comm::StatsCounter stats_;
};

NcclHandle::~NcclHandle() {
  comm::wait_unwaited(*this, waited_);
  if (event_) cudaEventDestroy(event_);
}

bool NcclHandle::done() {
  if (finished_) return true;
  // After an abort (another handle's timeout) the aborted kernels drain and this event completes,
  // with the data never exchanged: that is a failure, not completion.
  if (!comm_->broken().empty())
    fail(ErrorCode::kComm, strcat(what_, ": the NCCL communicator was aborted: ", comm_->broken()));
  cudaError_t rc = cudaEventQuery(event_);
  if (rc == cudaSuccess) {
    finished_ = true;
    return true;
  }
  if (rc != cudaErrorNotReady) check_cuda(rc, what_ + ": cudaEventQuery");
  (void)cudaGetLastError();  // the NotReady the query recorded in this thread's last error
  comm_->poll_async_error(what_);
  return false;
}

// Polls with a PollBackoff (a short spin, then sleeps up to 50 us), not a fixed sleep per poll: a
// collective that ends within microseconds is seen within microseconds.
void NcclHandle::wait() {
  waited_ = true;
  PollBackoff backoff(std::chrono::microseconds(50));
  while (!done()) {
    if (Clock::now() > deadline_) {
      std::string msg = strcat(what_, ": timed out after ", comm_->timeout_s(),
                               " s (a peer is dead or stalled; NCCL communicator aborted)");
      finished_ = true;
      comm_->abort_on_timeout(msg);
      fail(ErrorCode::kTimeout, msg);
    }
    backoff.pause();
  }
}

}  // namespace

bool nccl_available() { return true; }

std::unique_ptr<Communicator> make_nccl_communicator(const NcclBootstrap& bootstrap, int device,
                                                     double timeout_s) {
  if (!(timeout_s > 0)) fail(ErrorCode::kInvalidArgument, "NCCL communicator: timeout must be > 0");
  return std::make_unique<NcclCommunicator>(bootstrap, device, timeout_s);
}

}  // namespace strata
