// Communicator's blocking and equal-chunk forms, names and stats helpers.
#include "strata/communicator.hpp"

#include "comm/backend.hpp"

namespace strata {

const char* collective_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kBarrier: return "barrier";
  }
  return "?";
}

std::uint64_t CommStats::total_bytes_sent() const {
  std::uint64_t t = 0;
  for (auto b : bytes_sent) t += b;
  return t;
}

void Communicator::all_reduce(const void* send, void* recv, std::size_t count, DType dtype) {
  all_reduce_async(send, recv, count, dtype)->wait();
}
void Communicator::reduce_scatter(const void* send, void* recv, std::span<const std::size_t> counts,
                                  DType dtype) {
  reduce_scatter_async(send, recv, counts, dtype)->wait();
}
void Communicator::reduce_scatter(const void* send, void* recv, std::size_t recv_count,
                                  DType dtype) {
  std::vector<std::size_t> counts(static_cast<std::size_t>(size()), recv_count);
  reduce_scatter_async(send, recv, counts, dtype)->wait();
}
void Communicator::all_gather(const void* send, void* recv, std::span<const std::size_t> counts,
                              DType dtype) {
  all_gather_async(send, recv, counts, dtype)->wait();
}
void Communicator::all_gather(const void* send, void* recv, std::size_t send_count, DType dtype) {
  std::vector<std::size_t> counts(static_cast<std::size_t>(size()), send_count);
  all_gather_async(send, recv, counts, dtype)->wait();
}
void Communicator::broadcast(void* buffer, std::size_t count, DType dtype, int root) {
  broadcast_async(buffer, count, dtype, root)->wait();
}
void Communicator::barrier() { barrier_async()->wait(); }

}  // namespace strata
