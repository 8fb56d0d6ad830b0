// Collective communication between data-parallel ranks: the one interface the ZeRO engine talks
// to, with three backends (in-process threads, MPI, NCCL) and a fault-injecting wrapper for tests.
//
// Semantics shared by every backend:
// - Every rank of a communicator must issue the same collectives in the same order with matching
//   counts and dtypes (as in MPI/NCCL). Buffers are borrowed: they must stay valid and untouched
//   (recv) / unmodified (send) until the handle's wait() returns.
// - Reductions are sums. FP16 and BF16 are summed in FP32 and rounded to the buffer's type once
//   (round-to-nearest-even). The host backends (in-process, MPI) add the ranks' contributions in
//   rank order 0, 1, ..., N-1 starting from the rank-0 value, so results are deterministic and
//   bitwise identical on every rank and equal to a serial loop over ranks. NCCL uses its own
//   (deterministic for a fixed communicator) reduction order and arithmetic.
// - Timeouts: every collective has a deadline (runtime.collective_timeout_s). A peer that is dead,
//   stalled, or out of step makes wait() throw Error(kTimeout) naming the collective, its sequence
//   number, this rank and the rank(s) not heard from — never a hang. After a timeout or any other
//   failure the communicator is broken: later collectives throw Error(kComm) at once.
// - Bytes accounting (stats()): the bytes a bandwidth-optimal algorithm sends from this rank:
//   reduce-scatter and all-gather (sum(counts) - counts[rank]) * elem; all-reduce the same for
//   the equal split of count into size() chunks, twice (reduce-scatter + all-gather); broadcast
//   count * elem * (size - 1) on the root, 0 elsewhere; barrier 0. The host backends move
//   exactly these bytes (plus nothing else); NCCL's figure is the same formula.
//
// Thread-safety: a Communicator is used by one thread at a time (the training loop's); handles
// are waited on by the thread that issued them. Different communicators (e.g. the in-process
// ranks) are used from different threads concurrently.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/config.hpp"

namespace strata {

enum class CollectiveKind { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kBarrier };
inline constexpr std::size_t kCollectiveKinds = 5;
const char* collective_name(CollectiveKind kind);  // "all_reduce", "reduce_scatter", ...

// Where a backend expects its buffers.
enum class BufferLocation { kHost, kDevice };

struct CommStats {
  // Indexed by CollectiveKind.
  std::array<std::uint64_t, kCollectiveKinds> bytes_sent{};
  std::array<std::uint64_t, kCollectiveKinds> calls{};
  std::uint64_t total_bytes_sent() const;
};

// The handle of an asynchronous collective. wait() blocks until the collective finished on this
// rank (its recv buffer is valid, its send buffer may be reused) or throws (timeout, peer failure,
// backend error). wait() on a finished handle returns at once; a handle destroyed without wait()
// waits in its destructor and logs (never throws) a failure.
class CommHandle {
 public:
  virtual ~CommHandle() = default;
  virtual void wait() = 0;
  virtual bool done() = 0;  // non-blocking; true once wait() would not block
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend_name() const = 0;  // "inprocess" | "mpi" | "nccl" | "faulty(...)"
  virtual BufferLocation buffer_location() const = 0;
  double timeout_s() const { return timeout_s_; }

  // recv[i] = sum over ranks of send[i], i < count. send may equal recv (in place).
  virtual std::unique_ptr<CommHandle> all_reduce_async(const void* send, void* recv,
                                                       std::size_t count, DType dtype) = 0;
  // send holds sum(counts) elements: counts[0] for rank 0, then counts[1] for rank 1, ...
  // recv (counts[rank] elements) = the sum over ranks of this rank's slice. counts.size() ==
  // size().
  virtual std::unique_ptr<CommHandle> reduce_scatter_async(const void* send, void* recv,
                                                           std::span<const std::size_t> counts,
                                                           DType dtype) = 0;
  // recv (sum(counts) elements) = the ranks' send buffers (counts[r] each) concatenated in rank
  // order. send may point into recv at this rank's slice.
  virtual std::unique_ptr<CommHandle> all_gather_async(const void* send, void* recv,
                                                       std::span<const std::size_t> counts,
                                                       DType dtype) = 0;
  // buffer (count elements) on every rank = root's buffer.
  virtual std::unique_ptr<CommHandle> broadcast_async(void* buffer, std::size_t count, DType dtype,
                                                      int root) = 0;
  virtual std::unique_ptr<CommHandle> barrier_async() = 0;

  // Blocking forms, and equal-chunk forms (recv_count / send_count elements per rank).
  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype);
  void reduce_scatter(const void* send, void* recv, std::span<const std::size_t> counts,
                      DType dtype);
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dtype);
  void all_gather(const void* send, void* recv, std::span<const std::size_t> counts, DType dtype);
  void all_gather(const void* send, void* recv, std::size_t send_count, DType dtype);
  void broadcast(void* buffer, std::size_t count, DType dtype, int root);
  void barrier();

  virtual CommStats stats() const = 0;

 protected:
  explicit Communicator(double timeout_s) : timeout_s_(timeout_s) {}
  double timeout_s_;
};

// ---- factories ---------------------------------------------------------------------------------

// `ranks` in-process communicators that talk through shared memory; communicator i is rank i and
// must be driven by its own thread. The shared state lives as long as any of them.
std::vector<std::unique_ptr<Communicator>> make_inprocess_communicators(int ranks,
                                                                        double timeout_s);

// True when this build has the MPI backend.
bool mpi_available();
// The MPI_COMM_WORLD communicator of this process (host buffers). Initializes MPI (threads:
// MPI_THREAD_SERIALIZED) if it is not yet initialized, and finalizes it when the last MPI
// communicator created this way is destroyed. Throws Error(kUnsupported) in a build without MPI,
// Error(kComm) when MPI cannot start.
std::unique_ptr<Communicator> make_mpi_communicator(double timeout_s);
// True when this process was started by mpirun/mpiexec (OMPI_COMM_WORLD_SIZE, PMI_SIZE, ...).
bool launched_by_mpi();

// True when this build has the NCCL backend.
bool nccl_available();
// How NCCL ranks exchange their unique id: through a host communicator (e.g. MPI; its rank and
// size are used) or through a file that rank 0 writes and the others poll (single node).
struct NcclBootstrap {
  Communicator* host = nullptr;  // borrowed; used only during construction
  std::string file;              // used when host is null
  int rank = 0;                  // with file
  int size = 1;                  // with file
};
// A NCCL communicator on CUDA device `device` (buffers are device pointers). Throws
// Error(kUnsupported) without NCCL, Error(kDevice/kComm/kTimeout) when it cannot start.
std::unique_ptr<Communicator> make_nccl_communicator(const NcclBootstrap& bootstrap, int device,
                                                     double timeout_s);

// Fault injection, for tests: wraps `inner`; from the `after`-th collective (0-based) on, the
// wrapper either throws Error(kComm) without taking part (kError), or sleeps `stall_s` seconds
// and then throws (kStall), so the other ranks see a dead or stalled peer.
struct FaultSpec {
  enum class Mode { kNone, kError, kStall };
  Mode mode = Mode::kNone;
  std::uint64_t after = 0;
  double stall_s = 1.0;
};
std::unique_ptr<Communicator> make_faulty_communicator(std::unique_ptr<Communicator> inner,
                                                       FaultSpec spec);

}  // namespace strata
