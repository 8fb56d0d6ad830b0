// A rank's one storage layer (DESIGN.md): one Device from runtime.device (CUDA, or the
// host-emulated device), one I/O engine and one swap space (when anything lives on NVMe), one
// pinned pool registered with that device (cudaHostRegister on CUDA, mlock on the host device),
// and the TierStore that holds every byte of the rank's training state. Every budget is enforced
// once, there, per rank:
//   gpu   tiers.gpu.budget                                   (per rank already)
//   host  tiers.host.budget / ranks on the node              (the pool included)
//   pool  tiers.host.pinned_budget / ranks on the node       (buffer_count × buffer_size)
//   nvme  tiers.nvme.budget / ranks on the node              (0 = unlimited; the swap space
//         reserves exactly what the layout needs, up front)
//
// Device choice: runtime.device auto follows the communicator (collectives run where the buffers
// live): a device-buffer communicator (NCCL) gets the CUDA device of the rank's local ordinal, a
// host-buffer one (in-process, MPI) the host-emulated device. runtime.device cuda with a host
// communicator, or host with NCCL, is refused (Error(kUnsupported)) saying which goes with which.
//
// Ownership: owns all four; destroys the store first, the device last. Thread-safety: as the
// TierStore (the members are set up once by the engine's thread).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "device/pinned_pool.hpp"
#include "strata/communicator.hpp"
#include "strata/config.hpp"
#include "strata/device.hpp"
#include "strata/io_engine.hpp"
#include "tier/tier_store.hpp"

namespace strata::zero {

// Per-rank fault injection (tests): what the rank's storage builds is passed through these (each
// may be empty) before use, e.g. into a FaultInjectingDevice / FaultInjectingIoEngine.
struct StorageWrap {
  std::function<std::unique_ptr<Device>(std::unique_ptr<Device>)> device;
  std::function<std::unique_ptr<IoEngine>(std::unique_ptr<IoEngine>)> io;
  // Makes the rank's device in place of make_device(kind, ordinal) (kind as resolved, and refused,
  // against the communicator): e.g. the host-emulated device under a communicator that reports
  // device buffers, to run a NCCL-like pairing without a GPU. Empty: make_device. (Last, so that
  // {device, io} initializers stay valid.)
  std::function<std::unique_ptr<Device>(DeviceKind kind, int ordinal)> make;
};

// What the engine's layout asks of the storage (after the device is known).
struct StorageNeeds {
  bool pool = false;  // anything is staged between host and device or NVMe
  std::uint32_t pool_buffers = 0;
  std::uint64_t pool_buffer_size = 0;
  std::uint64_t nvme_bytes = 0;  // swap space to reserve (0: no NVMe tier)
  // The optimizer state on NVMe: tiers.nvme.snapshot_room of it is reserved besides nvme_bytes
  // for pinned versions (asynchronous checkpoints: TierStore versioned state).
  std::uint64_t nvme_opt_bytes = 0;
  // The speculative update's pending versions on NVMe (new slots beside the committed ones:
  // optimizer.overlap on/auto; at most optimizer.speculation_budget), reserved besides nvme_bytes
  // as strata plan counts them ("pending versions").
  std::uint64_t nvme_pending_bytes = 0;
  std::uint32_t movers = 2;  // the store's transfer threads
};

// The device kind a rank's engine uses with this communicator (see above).
DeviceKind resolve_device_kind(const Config& config, const Communicator& comm);

class RankStorage {
 public:
  // Creates the device (runtime.device resolved against the communicator).
  RankStorage(const Config& config, const Communicator& comm, const StorageWrap& wrap);
  ~RankStorage();
  RankStorage(const RankStorage&) = delete;
  RankStorage& operator=(const RankStorage&) = delete;

  // Creates the I/O engine, swap space, pool and store. Throws Error(kBudget) when the NVMe need
  // exceeds this rank's share of tiers.nvme.budget (naming both), Error(kInvalidArgument) without
  // tiers.nvme.paths when NVMe is needed, and whatever the pool, swap space or engine throw.
  void open(const StorageNeeds& needs);

  Device& device() { return *device_; }
  TierStore& store() { return *store_; }
  const TierStore& store() const { return *store_; }
  PinnedPool* pool() { return pool_.get(); }
  IoEngine* io() { return io_.get(); }
  bool is_open() const { return store_ != nullptr; }

  // This rank's share of the node-wide budgets.
  std::uint64_t host_budget() const;
  std::uint64_t pinned_budget() const;
  std::uint64_t nvme_budget() const;  // 0 = unlimited

 private:
  Config cfg_;
  int rank_;
  StorageWrap wrap_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<IoEngine> io_;
  std::unique_ptr<PinnedPool> pool_;
  std::unique_ptr<TierStore> store_;
};

}  // namespace strata::zero
