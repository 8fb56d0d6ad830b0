// Fault-injecting wrapper (tests): from the `after`-th collective on, this rank stops taking part,
// either failing at once (kError: a crashed rank) or after sleeping (kStall: a hung rank). Either
// way its peers see a rank that never arrives and must time out naming it.
#include <chrono>
#include <thread>

#include "comm/backend.hpp"

namespace strata {
namespace {

class FaultyCommunicator final : public Communicator {
 public:
  FaultyCommunicator(std::unique_ptr<Communicator> inner, FaultSpec spec)
      : Communicator(inner->timeout_s()), inner_(std::move(inner)), spec_(spec) {
    name_ = std::string("faulty(") + inner_->backend_name() + ")";
  }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const char* backend_name() const override { return name_.c_str(); }
  BufferLocation buffer_location() const override { return inner_->buffer_location(); }

  std::unique_ptr<CommHandle> all_reduce_async(const void* send, void* recv, std::size_t count,
                                               DType dtype) override {
    if (auto h = inject(CollectiveKind::kAllReduce)) return h;
    return inner_->all_reduce_async(send, recv, count, dtype);
  }
  std::unique_ptr<CommHandle> reduce_scatter_async(const void* send, void* recv,
                                                   std::span<const std::size_t> counts,
                                                   DType dtype) override {
    if (auto h = inject(CollectiveKind::kReduceScatter)) return h;
    return inner_->reduce_scatter_async(send, recv, counts, dtype);
  }
  std::unique_ptr<CommHandle> all_gather_async(const void* send, void* recv,
                                               std::span<const std::size_t> counts,
                                               DType dtype) override {
    if (auto h = inject(CollectiveKind::kAllGather)) return h;
    return inner_->all_gather_async(send, recv, counts, dtype);
  }
  std::unique_ptr<CommHandle> broadcast_async(void* buffer, std::size_t count, DType dtype,
                                              int root) override {
    if (auto h = inject(CollectiveKind::kBroadcast)) return h;
    return inner_->broadcast_async(buffer, count, dtype, root);
  }
  std::unique_ptr<CommHandle> barrier_async() override {
    if (auto h = inject(CollectiveKind::kBarrier)) return h;
    return inner_->barrier_async();
  }
  CommStats stats() const override { return inner_->stats(); }

 private:
  std::unique_ptr<CommHandle> inject(CollectiveKind kind) {
    const std::uint64_t n = count_++;
    if (spec_.mode == FaultSpec::Mode::kNone || n < spec_.after) return nullptr;
    if (spec_.mode == FaultSpec::Mode::kStall)
      std::this_thread::sleep_for(std::chrono::duration<double>(spec_.stall_s));
    return std::make_unique<comm::ReadyHandle>(std::make_exception_ptr(Error(
        ErrorCode::kComm, strcat("injected fault: rank ", rank(), " ",
                                 spec_.mode == FaultSpec::Mode::kStall ? "stalled in " : "failed ",
                                 collective_name(kind), " #", n))));
  }

  std::unique_ptr<Communicator> inner_;
  FaultSpec spec_;
  std::string name_;
  std::uint64_t count_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_faulty_communicator(std::unique_ptr<Communicator> inner,
                                                       FaultSpec spec) {
  if (!inner) fail(ErrorCode::kInvalidArgument, "make_faulty_communicator: null communicator");
  return std::make_unique<FaultyCommunicator>(std::move(inner), spec);
}

}  // namespace strata
