// The c10d Communicator (see c10d_communicator.hpp). The only translation unit of the extension
// that includes torch headers.
#include "c10d_communicator.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "comm/backend.hpp"
#include "strata/log.hpp"

// torch binds ProcessGroup with an intrusive_ptr holder (torch/csrc/utils/pybind.h says the same).
PYBIND11_DECLARE_HOLDER_TYPE(T, c10::intrusive_ptr<T>, true);

namespace py = pybind11;

namespace strata::python {
namespace {

using Clock = std::chrono::steady_clock;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

std::chrono::milliseconds to_ms(double s) {
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(s * 1000.0)));
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// The message of a c10d failure without torch's C++ backtrace.
std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

at::Tensor bytes(std::size_t n) { return at::empty({static_cast<std::int64_t>(n)}, at::kByte); }
unsigned char* ptr(const at::Tensor& t) { return static_cast<unsigned char*>(t.data_ptr()); }

class C10dCommunicator;

// One collective: a sequence of c10d operations (stages), each issued when the previous one has
// completed and its `finish` (copy out, rank-ordered sum) has run.
struct Stage {
  std::function<WorkPtr()> issue;
  std::function<void()> finish;
};

class C10dHandle final : public CommHandle {
 public:
  C10dHandle(C10dCommunicator& comm, std::string what, std::vector<Stage> stages);
  ~C10dHandle() override {
    if (finished_ || failed_) return;
    try {
      wait();
    } catch (const std::exception& e) {
      log_warn("c10d communicator: ", what_, " dropped without wait() failed: ", e.what());
    }
  }
  void wait() override;
  bool done() override;

 private:
  void complete_stage();  // REQUIRES: work_ completed
  [[noreturn]] void failed(const std::string& why, bool timeout);
  bool timed_out(const std::string& m) const;

  C10dCommunicator& comm_;
  std::string what_;
  std::vector<Stage> stages_;
  std::size_t stage_ = 0;
  WorkPtr work_;
  Clock::time_point deadline_;
  bool finished_ = false;
  bool failed_ = false;
};

class C10dCommunicator final : public Communicator {
 public:
  C10dCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> pg, double timeout_s)
      : Communicator(timeout_s), pg_(std::move(pg)), rank_(pg_->getRank()), size_(pg_->getSize()) {
    backend_ = pg_->getBackendName();
    name_ = "c10d(" + backend_ + ")";
    if (backend_ == "nccl" || backend_ == "ucc")
      fail(ErrorCode::kUnsupported,
           strcat("c10d communicator: the '", backend_,
                  "' process group needs CUDA tensors; strata's "
                  "engine reduces host buffers: pass a gloo group (torch.distributed.new_group("
                  "backend='gloo'))"));
    log_debug("c10d communicator: rank ", rank_, " of ", size_, " (", backend_, ")");
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend_name() const override { return name_.c_str(); }
  BufferLocation buffer_location() const override { return BufferLocation::kHost; }
  CommStats stats() const override { return stats_.snapshot(); }

  std::unique_ptr<CommHandle> reduce_scatter_async(const void* send, void* recv,
                                                   std::span<const std::size_t> counts,
                                                   DType dtype) override {
    comm::count_per_rank(stats_, CollectiveKind::kReduceScatter, counts, rank_, size_, dtype);
    const std::size_t mine = counts[static_cast<std::size_t>(rank_)];
    if (auto h = alone(send, recv, mine * dtype_size(dtype))) return h;
    const std::string what = describe(CollectiveKind::kReduceScatter);
    if (comm::sum_counts(counts) == 0) return ready();
    return start(what, {reduce_scatter_stage(static_cast<const unsigned char*>(send), counts, dtype,
                                             [recv](const at::Tensor&) { return recv; })});
  }

  std::unique_ptr<CommHandle> all_gather_async(const void* send, void* recv,
                                               std::span<const std::size_t> counts,
                                               DType dtype) override {
    comm::count_per_rank(stats_, CollectiveKind::kAllGather, counts, rank_, size_, dtype);
    const std::size_t es = dtype_size(dtype), total = comm::sum_counts(counts);
    if (auto h = alone(send, recv, total * es)) return h;
    const std::string what = describe(CollectiveKind::kAllGather);
    if (total == 0) return ready();
    const auto* src = static_cast<const unsigned char*>(send);
    return start(what, {all_gather_stage([src]() { return src; },
                                         std::vector<std::size_t>(counts.begin(), counts.end()), es,
                                         static_cast<unsigned char*>(recv))});
  }

  std::unique_ptr<CommHandle> all_reduce_async(const void* send, void* recv, std::size_t count,
                                               DType dtype) override {
    auto counts = comm::split_counts(count, size_);
    stats_.add(CollectiveKind::kAllReduce, 2 * comm::scatter_gather_bytes(counts, rank_, dtype));
    const std::size_t es = dtype_size(dtype);
    if (auto h = alone(send, recv, count * es)) return h;
    const std::string what = describe(CollectiveKind::kAllReduce);
    if (count == 0) return ready();
    // Stage 1 reduces this rank's chunk into `chunk`; stage 2 all-gathers the chunks into recv.
    auto chunk = std::make_shared<at::Tensor>(bytes(counts[static_cast<std::size_t>(rank_)] * es));
    Stage rs = reduce_scatter_stage(
        static_cast<const unsigned char*>(send), counts, dtype,
        [chunk](const at::Tensor&) { return static_cast<void*>(ptr(*chunk)); });
    Stage ag =
        all_gather_stage([chunk]() { return static_cast<const unsigned char*>(ptr(*chunk)); },
                         counts, es, static_cast<unsigned char*>(recv));
    return start(what, {std::move(rs), std::move(ag)});
  }

  std::unique_ptr<CommHandle> broadcast_async(void* buffer, std::size_t count, DType dtype,
                                              int root) override {
    if (root < 0 || root >= size_)
      fail(ErrorCode::kInvalidArgument, strcat("broadcast: root ", root, " of ", size_, " ranks"));
    const std::size_t n = count * dtype_size(dtype);
    stats_.add(CollectiveKind::kBroadcast,
               rank_ == root ? n * static_cast<std::size_t>(size_ - 1) : 0);
    if (size_ == 1 || n == 0) return ready();
    const std::string what = describe(CollectiveKind::kBroadcast);
    auto t = std::make_shared<at::Tensor>(bytes(n));
    if (rank_ == root) std::memcpy(ptr(*t), buffer, n);
    Stage s;
    s.issue = [this, t, root]() {
      std::vector<at::Tensor> v{*t};
      c10d::BroadcastOptions o;
      o.rootRank = root;
      o.timeout = to_ms(timeout_s_);
      return pg_->broadcast(v, o);
    };
    s.finish = [this, t, buffer, n, root]() {
      if (rank_ != root) std::memcpy(buffer, ptr(*t), n);
    };
    return start(what, {std::move(s)});
  }

  std::unique_ptr<CommHandle> barrier_async() override {
    stats_.add(CollectiveKind::kBarrier, 0);
    if (size_ == 1) return ready();
    Stage s;
    s.issue = [this]() {
      c10d::BarrierOptions o;
      o.timeout = to_ms(timeout_s_);
      return pg_->barrier(o);
    };
    s.finish = [] {};
    return start(describe(CollectiveKind::kBarrier), {std::move(s)});
  }

  // ---- used by the handles ----
  const std::string& broken() const { return broken_; }
  [[noreturn]] void broke(const std::string& what, const std::string& why, bool timeout) {
    if (broken_.empty()) broken_ = what + ": " + why;
    fail(timeout ? ErrorCode::kTimeout : ErrorCode::kComm, strcat(what, ": ", why));
  }

 private:
  std::string describe(CollectiveKind kind) {
    return strcat(name_, " ", collective_name(kind), " #", seq_++, " (rank ", rank_, " of ", size_,
                  ")");
  }
  static std::unique_ptr<CommHandle> ready() { return std::make_unique<comm::ReadyHandle>(); }
  // A world of one rank: `bytes` of send copied to recv (they may overlap), a finished handle;
  // null with more ranks.
  std::unique_ptr<CommHandle> alone(const void* send, void* recv, std::size_t bytes) const {
    if (size_ != 1) return nullptr;
    std::memmove(recv, send, bytes);
    return ready();
  }

  std::unique_ptr<CommHandle> start(const std::string& what, std::vector<Stage> stages) {
    if (!broken_.empty())
      fail(ErrorCode::kComm,
           strcat(what, ": the communicator is broken by an earlier failure (", broken_, ")"));
    return std::make_unique<C10dHandle>(*this, what, std::move(stages));
  }

  // Each rank sends every peer r its slice (counts[r] elements of `send`); this rank's slices from
  // all ranks are then summed in rank order into out(...).
  Stage reduce_scatter_stage(const unsigned char* send, std::span<const std::size_t> counts,
                             DType dtype, std::function<void*(const at::Tensor&)> out) {
    const std::size_t es = dtype_size(dtype), total = comm::sum_counts(counts);
    const std::size_t mine = counts[static_cast<std::size_t>(rank_)];
    auto in = std::make_shared<at::Tensor>(bytes(total * es));
    std::memcpy(ptr(*in), send, total * es);
    auto got = std::make_shared<at::Tensor>(bytes(mine * es * static_cast<std::size_t>(size_)));
    std::vector<std::int64_t> in_split,
        out_split(static_cast<std::size_t>(size_), static_cast<std::int64_t>(mine * es));
    for (auto c : counts) in_split.push_back(static_cast<std::int64_t>(c * es));
    Stage s;
    s.issue = [this, in, got, in_split, out_split]() mutable {
      c10d::AllToAllOptions o;
      o.timeout = to_ms(timeout_s_);
      return pg_->alltoall_base(*got, *in, out_split, in_split, o);
    };
    s.finish = [this, got, mine, es, dtype, out = std::move(out)]() {
      std::vector<const void*> srcs;
      for (int r = 0; r < size_; ++r)
        srcs.push_back(ptr(*got) + static_cast<std::size_t>(r) * mine * es);
      comm::ordered_sum(srcs.data(), size_, out(*got), mine, dtype);
    };
    return s;
  }

  // Every rank sends its slice (counts[rank] elements from send()) to each peer; recv receives
  // all slices in rank order. send() is called when the stage is issued.
  Stage all_gather_stage(std::function<const unsigned char*()> send,
                         std::vector<std::size_t> counts, std::size_t es, unsigned char* recv) {
    const std::size_t mine = counts[static_cast<std::size_t>(rank_)],
                      total = comm::sum_counts(counts);
    auto got = std::make_shared<at::Tensor>(bytes(total * es));
    Stage s;
    s.issue = [this, send = std::move(send), got, counts, es, mine]() {
      at::Tensor in = bytes(mine * es * static_cast<std::size_t>(size_));
      const unsigned char* src = send();
      for (int r = 0; r < size_; ++r)
        std::memcpy(ptr(in) + static_cast<std::size_t>(r) * mine * es, src, mine * es);
      std::vector<std::int64_t> in_split(static_cast<std::size_t>(size_),
                                         static_cast<std::int64_t>(mine * es));
      std::vector<std::int64_t> out_split;
      for (auto c : counts) out_split.push_back(static_cast<std::int64_t>(c * es));
      at::Tensor out = *got;
      c10d::AllToAllOptions o;
      o.timeout = to_ms(timeout_s_);
      return pg_->alltoall_base(out, in, out_split, in_split, o);
    };
    s.finish = [got, recv, total, es]() { std::memcpy(recv, ptr(*got), total * es); };
    return s;
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int rank_, size_;
  std::string backend_, name_;
  std::uint64_t seq_ = 0;
  std::string broken_;  // set by the first failure; later collectives refuse
  comm::StatsCounter stats_;

  friend class C10dHandle;
};

C10dHandle::C10dHandle(C10dCommunicator& comm, std::string what, std::vector<Stage> stages)
    : comm_(comm), what_(std::move(what)), stages_(std::move(stages)) {
  deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(comm_.timeout_s()));
  try {
    work_ = stages_[0].issue();
  } catch (const std::exception& e) {
    failed(message_of(e), false);
  }
}

void C10dHandle::failed(const std::string& why, bool timeout) {
  failed_ = true;
  work_.reset();
  if (!timeout) comm_.broke(what_, why, false);
  comm_.broke(
      what_,
      strcat(why, ": no completion within runtime.collective_timeout_s = ", comm_.timeout_s(),
             " s: a peer rank is dead, stalled or out of step (every rank must issue the same "
             "collectives in the same order)"),
      true);
}

// Whether the work's failure `m` is its timeout: c10d's own deadline ("Operation timed out!"),
// gloo's ("Timed out waiting ...", "Application timeout caused pair closure"), or any failure
// after this handle's deadline. The work's own timeout equals runtime.collective_timeout_s and
// starts after the deadline was set, so which of the two fires first (a matter of scheduling on
// a loaded machine) does not change the error: a stalled peer is a timeout either way.
bool C10dHandle::timed_out(const std::string& m) const {
  const std::string l = lower(m);
  return l.find("timed out") != std::string::npos || l.find("timeout") != std::string::npos ||
         Clock::now() >= deadline_;
}

void C10dHandle::complete_stage() {
  std::exception_ptr err = work_->exception();
  if (err) {
    try {
      std::rethrow_exception(err);
    } catch (const std::exception& e) {
      const std::string m = message_of(e);
      failed(m, timed_out(m));
    }
  }
  stages_[stage_].finish();
  work_.reset();
  if (++stage_ == stages_.size()) {
    finished_ = true;
    return;
  }
  try {
    work_ = stages_[stage_].issue();
  } catch (const std::exception& e) {
    failed(message_of(e), false);
  }
}

void C10dHandle::wait() {
  if (failed_) fail(ErrorCode::kComm, strcat(what_, ": waited on again after it failed"));
  // Another collective already failed: this one cannot complete either (its peer is gone or out
  // of step); don't wait out its deadline. (The work keeps its staged tensors alive.)
  if (!finished_ && !comm_.broken().empty()) {
    failed_ = true;
    work_.reset();
    fail(ErrorCode::kComm,
         strcat(what_, ": abandoned: the communicator is broken (", comm_.broken(), ")"));
  }
  while (!finished_) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
    bool completed = false;
    try {
      completed = work_->wait(std::max(left, std::chrono::milliseconds(1)));
    } catch (const std::exception& e) {
      const std::string m = message_of(e);
      failed(m, timed_out(m));
    }
    if (!completed) failed("the work was aborted", false);
    complete_stage();
  }
}

bool C10dHandle::done() {
  if (failed_) return true;
  while (!finished_ && work_->isCompleted()) complete_stage();
  return finished_;
}

}  // namespace

std::unique_ptr<Communicator> make_c10d_communicator(py::handle process_group, double timeout_s) {
  if (!(timeout_s > 0))
    fail(ErrorCode::kInvalidArgument,
         strcat("c10d communicator: timeout ", timeout_s, " s must be > 0"));
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  try {
    pg = py::cast<c10::intrusive_ptr<c10d::ProcessGroup>>(process_group);
  } catch (const py::cast_error&) {
    fail(ErrorCode::kInvalidArgument,
         strcat("c10d communicator: expected a torch.distributed ProcessGroup, got ",
                std::string(py::str(py::type::handle_of(process_group).attr("__name__")))));
  }
  if (!pg) fail(ErrorCode::kInvalidArgument, "c10d communicator: null process group");
  return std::make_unique<C10dCommunicator>(std::move(pg), timeout_s);
}

}  // namespace strata::python
