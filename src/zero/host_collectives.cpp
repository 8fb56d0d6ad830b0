// Collectives on host arrays staged through device scratch (see host_collectives.hpp).
#include "zero/host_collectives.hpp"

#include <algorithm>

#include "core/numeric.hpp"
#include "zero/engine_layout.hpp"

namespace strata::zero {

HostCollectives::HostCollectives(Communicator& comm, Device& device, ScratchArena& scratch,
                                 std::chrono::milliseconds timeout)
    : comm_(comm), scratch_(scratch), timeout_(timeout), stream_(device.create_stream()) {}

void HostCollectives::copy(void* dst, const void* src, std::size_t bytes) {
  copy_sync(*stream_, dst, src, bytes, timeout_);
}

void HostCollectives::broadcast(void* data, std::size_t count, DType dt, int root) {
  const std::size_t es = dtype_size(dt);
  const std::size_t piece = std::min<std::size_t>(count, (64u << 20) / es);
  if (piece == 0) return;
  Scratch x = scratch_.take(piece * es, "broadcast staging");
  for (std::size_t b = 0; b < count; b += piece) {
    const std::size_t n = std::min(piece, count - b);
    auto* h = static_cast<unsigned char*>(data) + b * es;
    if (comm_.rank() == root) copy(x.data(), h, n * es);
    comm_.broadcast(x.data(), n, dt, root);
    copy(h, x.data(), n * es);
  }
}

void HostCollectives::all_gather(const void* send, void* recv, std::span<const std::size_t> counts,
                                 DType dt) {
  const std::size_t es = dtype_size(dt);
  std::size_t total = 0;
  for (auto c : counts) total += c;
  const std::size_t mine = counts[static_cast<std::size_t>(comm_.rank())];
  Scratch x = scratch_.take((mine + total) * es, "all-gather staging");
  copy(x.data(), send, mine * es);
  comm_.all_gather(x.data(), x.data() + mine * es, counts, dt);
  copy(recv, x.data() + mine * es, total * es);
}

}  // namespace strata::zero
