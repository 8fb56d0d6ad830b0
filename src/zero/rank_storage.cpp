// A rank's one storage layer (see rank_storage.hpp).
#include "zero/rank_storage.hpp"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "strata/device_query.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"
#include "strata/units.hpp"

namespace strata::zero {

DeviceKind resolve_device_kind(const Config& c, const Communicator& comm) {
  const bool device_buffers = comm.buffer_location() == BufferLocation::kDevice;
  DeviceKind k = c.runtime.device;
  if (k == DeviceKind::kAuto) return device_buffers ? DeviceKind::kCuda : DeviceKind::kHost;
  if (k == DeviceKind::kCuda && !device_buffers)
    fail(ErrorCode::kUnsupported,
         strcat(
             "engine: runtime.device is cuda but the ", comm.backend_name(),
             " communicator works on host memory; collectives run where the buffers live: use the "
             "nccl communicator with a GPU (runtime.communicator: nccl), or runtime.device: host"));
  if (k == DeviceKind::kHost && device_buffers)
    fail(ErrorCode::kUnsupported,
         strcat("engine: the ", comm.backend_name(),
                " communicator needs CUDA device memory but runtime.device is host; use "
                "runtime.device: cuda (or auto), or the in-process / MPI communicator"));
  return k;
}

RankStorage::RankStorage(const Config& config, const Communicator& comm, const StorageWrap& wrap)
    : cfg_(config), rank_(comm.rank()), wrap_(wrap) {
  const DeviceKind kind = resolve_device_kind(config, comm);
  int ordinal = 0;
  if (kind == DeviceKind::kCuda) {
    // The rank's GPU on its node: LOCAL_RANK (torchrun), the MPI launchers' local rank, else the
    // rank modulo the node's ranks; modulo the visible devices (as profile and bench step).
    ordinal = local_device_ordinal(rank_, static_cast<int>(config.ranks_per_node()),
                                   static_cast<int>(query_cuda_devices().devices.size()));
  }
  device_ =
      wrap_.make ? wrap_.make(kind, ordinal) : make_device(kind, ordinal, config.tiers.gpu.budget);
  if (!device_) fail(ErrorCode::kInternal, "engine: the storage wrap made no device");
  if (wrap_.device) device_ = wrap_.device(std::move(device_));
  if (rank_ == 0)
    log_info("engine: device ", device_->name(), " (runtime.device ",
             device_name(config.runtime.device), ")");
}

RankStorage::~RankStorage() {
  store_.reset();  // waits for its transfers, removes the swap files
  pool_.reset();
  io_.reset();
  device_.reset();
}

std::uint64_t RankStorage::host_budget() const {
  return cfg_.tiers.host.budget / std::max<std::uint32_t>(1, cfg_.ranks_per_node());
}
std::uint64_t RankStorage::pinned_budget() const {
  return cfg_.tiers.host.pinned_budget / std::max<std::uint32_t>(1, cfg_.ranks_per_node());
}
std::uint64_t RankStorage::nvme_budget() const {
  return cfg_.tiers.nvme.budget / std::max<std::uint32_t>(1, cfg_.ranks_per_node());
}

void RankStorage::open(const StorageNeeds& needs) {
  if (store_) fail(ErrorCode::kInternal, "storage: opened twice");
  const Config& c = cfg_;
  if (needs.nvme_bytes > 0) {
    if (c.tiers.nvme.paths.empty())
      fail(ErrorCode::kInvalidArgument,
           "storage: state is placed on nvme but tiers.nvme.paths is empty: name a directory on "
           "NVMe");
    if (nvme_budget() > 0 && needs.nvme_bytes > nvme_budget())
      fail(ErrorCode::kBudget,
           strcat("storage rank ", rank_, ": the state placed on nvme needs ", needs.nvme_bytes,
                  " bytes (", format_bytes(needs.nvme_bytes, true),
                  ") of swap space but tiers.nvme.budget leaves this rank ", nvme_budget(),
                  " bytes (", format_bytes(nvme_budget(), true), ")"));
    // Missing swap directories are created by the SwapSpace (safely: tier/swap_space.hpp).
    io_ = make_io_engine(IoEngineOptions::from(c.tiers.nvme), c.tiers.nvme.paths.front());
    if (wrap_.io) io_ = wrap_.io(std::move(io_));
  }
  if (needs.pool) {
    PinnedPoolOptions po;
    po.buffer_count = std::max<std::uint32_t>(1, needs.pool_buffers);
    po.buffer_size = needs.pool_buffer_size;
    po.pinned_budget = pinned_budget();
    pool_ = std::make_unique<PinnedPool>(po, device_.get(), io_.get());
  }
  TierStoreOptions so;
  so.gpu_budget = c.tiers.gpu.budget;
  so.host_budget = host_budget();
  so.pinned_budget = pinned_budget();
  so.nvme_capacity = needs.nvme_bytes;
  if (needs.nvme_bytes > 0) {  // room for pinned versions, within what the budget leaves
    std::uint64_t room = static_cast<std::uint64_t>(static_cast<double>(needs.nvme_opt_bytes) *
                                                    c.tiers.nvme.snapshot_room);
    room = (room + 4095) / 4096 * 4096;
    room += needs.nvme_pending_bytes;  // the speculative update's new slots
    if (nvme_budget() > 0) room = std::min(room, nvme_budget() - needs.nvme_bytes);
    so.nvme_capacity += room;
  }
  so.nvme_paths = c.tiers.nvme.paths;
  so.block_size = c.tiers.nvme.block_size;
  so.checksum = c.tiers.nvme.checksum;
  so.rank = static_cast<std::uint32_t>(rank_);
  so.movers = std::max<std::uint32_t>(1, needs.movers);
  so.timeout = std::chrono::milliseconds(
      static_cast<std::int64_t>(std::max(1.0, c.runtime.collective_timeout_s) * 1000.0));
  store_ = std::make_unique<TierStore>(so, *device_, io_.get(), pool_.get());
  log_debug("storage rank ", rank_, ": ", device_->name(), ", pool ",
            pool_ ? strcat(pool_->buffer_count(), " x ", pool_->buffer_size(), " B (",
                           pool_->lock_method(), ")")
                  : std::string("none"),
            ", swap ", needs.nvme_bytes, " B");
}

}  // namespace strata::zero
