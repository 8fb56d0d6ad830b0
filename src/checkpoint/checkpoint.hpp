// Checkpoints of the engine's sharded state (Engine::save_checkpoint / load_checkpoint), in the
// format of checkpoint/format.hpp (version 2; docs/offload.md, "Checkpoints").
//
// The seam with the engine is RankState: the rank's layout (partition, stage, world, dtype), the
// flat element range it holds, [opt_begin, opt_begin + store->size()), its optimizer state for
// that range (store) and its parameters for the same range (params, model dtype, host memory),
// and the scalars.
//
// Save (collective): rank r writes shard r, the flat range [r * partition_size, +partition_size)
// (its partition at stages 1-3, the same slice of its replicated state at stage 0), streamed from
// the store in pieces, with a CRC32C per block, then fdatasyncs it. The ranks agree that every
// shard is written; rank 0 writes manifest.json.tmp (O_EXCL, no symlink), fsyncs it, renames it
// over manifest.json (atomic), fsyncs the directory, removes the shards of other serials; the
// ranks agree again. A process killed at any point leaves manifest.json naming a complete set of
// shards: the previous checkpoint until the rename, the new one after. Any rank's failure fails
// the call on every rank (nothing hangs), and the previous checkpoint stays.
//
// Load (collective, any world size 1..N and any stage 0-3, resharding as it goes): every rank
// reads and checks the manifest (seal, every field, the model's tensors and dtype), maps its own
// range onto the saved shards, and reads the header of each shard it needs and every block that
// holds its elements, verifying each CRC32C (pass 1; nothing changes). The ranks agree (all
// succeeded, all read the same manifest); only then does pass 2 read the same blocks again
// (verified again) into the store and params, piece by piece (memory: a few blocks per section,
// never a whole tensor), and set the scalars. Each rank reads only the blocks that hold its
// elements. Padding elements of the new layout are zero.
// Failures: see format.hpp; a failure of pass 1 on any rank throws on every rank with
// nothing changed. A failure in pass 2 (I/O error, or a shard changed between the passes) leaves
// the rank partially restored: restore_started tells the engine, which then refuses to step.
// The directory must be visible to every rank (a shared file system for multi-node runs).
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "checkpoint/format.hpp"
#include "checkpoint/optimizer_state.hpp"
#include "core/file_env.hpp"
#include "strata/communicator.hpp"
#include "strata/config.hpp"

namespace strata::checkpoint {

// The training counters (TrainingCounters) are saved from / restored into.
struct RankState : TrainingCounters {
  int rank = 0, world = 1, stage = 0;
  DType param_dtype = DType::kFp32;
  std::size_t flat_size = 0, partition_size = 0;
  const Partition* partition = nullptr;  // the engine's layout (tensor names, sizes, offsets)
  std::size_t opt_begin = 0;  // flat offset of the store's element 0 (0 at stage 0, else own_begin)
  // This rank's parameters (model dtype) for the store's flat range: store->size() elements.
  std::span<unsigned char> params;
  OptimizerStateStore* store = nullptr;  // the rank's optimizer range
  // Save only: the store's views carry the parameters (StateView::params; `params` is empty) — an
  // asynchronous save's snapshot, where copying them would make the save call's time grow with
  // the model.
  bool params_in_store = false;
  std::string config_yaml;
  // Save: the embedder's model description (shapes, aliases, extra tensors; rank 0's extra
  // tensors are written, to extra-<serial>.bin); nullptr: none (strata/checkpoint_model.hpp).
  const CheckpointModel* model = nullptr;
  // The ranks' agreement (a few bytes per rank, host memory in and out) run where the
  // communicator's buffers live: all_gather(send, recv, bytes) leaves every rank's `bytes` bytes
  // in recv, in rank order (bytes a multiple of 4). The engine stages it through its device memory
  // (required with a device-buffer communicator such as NCCL); empty: the communicator is called
  // on the host arrays (host-buffer communicators only; a device one fails with
  // Error(kInvalidArgument) on every rank, before anything is written or read).
  std::function<void(const void* send, void* recv, std::size_t bytes)> all_gather;
  // The file seam every checkpoint file of this rank is written and read through; nullptr:
  // FileEnv::current() (the syscalls unless a test installed a wrapper). Tests hand in a
  // FaultInjectingFileEnv (core/file_env.hpp) to fail or slow a rank's writes, reads, syncs.
  FileEnv* env = nullptr;
  // Set by load_checkpoint.
  bool restore_started = false;  // pass 2 began: a failure from here on left partial state
  // Checkpoint bytes this rank read: pass 1 (bytes_verified: the manifest's shards' headers and
  // every block holding the rank's elements, each block once, CRC-checked before anything
  // changes) + pass 2 (bytes_restored: the same blocks read again into the store, checked again).
  // A whole-checkpoint load reads about twice the shards' size: once per pass.
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_verified = 0;
  std::uint64_t bytes_restored = 0;
  // Every loaded parameter is bitwise its loaded master rounded to param_dtype (store_elem, what
  // the update writes): an asynchronous save may then make them from the master (the engine).
  bool params_follow_master = true;
};

struct SaveOptions {
  std::uint64_t block_elems = 0;  // elements per checksummed block; 0 = the default (256 Ki)
};

void save_checkpoint(const std::string& dir, const RankState& state, Communicator& comm,
                     const SaveOptions& options = {});

// The same save in three phases, for a save whose shard is written in the background
// (Engine::save_checkpoint with SaveMode::kAsync); save_checkpoint runs them in a row.
//   begin_save   collective (the caller's thread): the directory and the serial; the manifest is
//                laid out from `state`'s layout and scalars (captured now).
//   write_shard  this rank only, any thread (no collective): the rank's shard through the file
//                seam, fdatasynced; returns its header's CRC32C. A failure removes the partial
//                shard and throws.
//   finish_save  collective (the caller's thread, the same on every rank): every rank's outcome of
//                write_shard (`error` null: succeeded with `header_crc`); when all succeeded rank 0
//                commits the manifest; any failure throws on every rank, the previous checkpoint
//                stays. `state` supplies the rank, the world and the exchange (all_gather).
// Or, when every rank's write_shard is known to have succeeded (each rank said so in an exchange of
// its own, e.g. the engine's step agreement), without waiting for a call of every rank:
//   commit_durable_save    rank 0 only, not collective: reads every shard's header CRC32C back
//                          (each is durable), commits the manifest; returns its failure (null:
//                          committed; other ranks: null, nothing done).
//   finish_committed_save  collective, later: every rank learns rank 0's outcome (throws on every
//                          rank when it failed; the previous checkpoint stays).
struct PendingSave {
  std::string path;  // the directory as given
  SafeDir dir;
  Manifest manifest;
  std::exception_ptr extra_error;  // rank 0's write of the untrained tensors failed
  // Rank 0: the directory's save lock (flock, owner pid in DIR/writer.pid), released when this
  // goes; another run's save into the directory meanwhile is refused naming this pid.
  std::shared_ptr<void> lock;
};
PendingSave begin_save(const std::string& dir, const RankState& state, Communicator& comm,
                       const SaveOptions& options = {});
std::uint32_t write_shard(const PendingSave& save, const RankState& state);
void finish_save(PendingSave& save, const RankState& state, Communicator& comm,
                 std::exception_ptr error, std::uint32_t header_crc);
std::exception_ptr commit_durable_save(PendingSave& save, const RankState& state);
void finish_committed_save(const PendingSave& save, const RankState& state, Communicator& comm,
                           std::exception_ptr commit_error);
// Fills params, the store and the scalars of `state`; layout fields must be set by the caller.
void load_checkpoint(const std::string& dir, RankState& state, Communicator& comm);

}  // namespace strata::checkpoint
