// Collectives on host arrays, staged through device scratch: collectives run where the
// communicator's buffers live (the host-emulated device's memory, or CUDA memory for NCCL). Used
// for the initial values' broadcast and read_state's gather; pieces of at most 64 MiB.
//
// Ownership: borrows the communicator, the device and the arena; owns its copy stream.
// Thread-safety: one thread (the engine's). Failure: the communicator's, device's and arena's
// errors propagate; nothing stays allocated.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <span>

#include "strata/communicator.hpp"
#include "strata/device.hpp"
#include "tier/scratch_arena.hpp"

namespace strata::zero {

class HostCollectives {
 public:
  HostCollectives(Communicator& comm, Device& device, ScratchArena& scratch,
                  std::chrono::milliseconds timeout);

  void broadcast(void* data, std::size_t count, DType dtype, int root);
  // counts[r] elements from rank r; recv gets them all, in rank order.
  void all_gather(const void* send, void* recv, std::span<const std::size_t> counts, DType dtype);

 private:
  void copy(void* dst, const void* src, std::size_t bytes);  // synchronous, on stream_

  Communicator& comm_;
  ScratchArena& scratch_;
  const std::chrono::milliseconds timeout_;
  std::unique_ptr<Stream> stream_;
};

}  // namespace strata::zero
