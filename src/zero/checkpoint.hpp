// Checkpoints of the engine's sharded state (Engine::save_checkpoint / load_checkpoint).
//
// Directory layout (DIR is the caller's directory, created if missing):
//   DIR/manifest.json           the complete checkpoint: serial, world, stage, flat and partition
//                               sizes, dtypes, step counters, loss scale, the config (YAML), and
//                               per rank the shard file name, its size and per-section CRC32C.
//   DIR/shard-<serial>-r<rank>.bin  one per rank: header, the rank's parameters in the model dtype,
//                               FP32 master, exp_avg, exp_avg_sq (the rank's optimizer range).
// Save: every rank writes its shard through the I/O engine (streamed from the optimizer state
// store, whatever tier it lives in), fdatasyncs it, and the ranks' sizes and checksums are
// all-gathered; rank 0 writes the manifest as manifest.json.tmp, fsyncs it, renames it over
// manifest.json (atomic) and fsyncs DIR; then the shards of the previous serial are removed and a
// barrier ends the call. A process killed at any point leaves manifest.json naming a complete set
// of shards: the previous checkpoint until the rename, the new one after. Leftovers of a killed
// save (shards of an unreferenced serial, manifest.json.tmp) are removed by the next save.
// Load: reads manifest.json, checks world size, stage class and layout against the engine, checks
// every section's size and CRC32C of this rank's shard before changing anything, then restores
// into the engine's current store (the tiers of the current YAML) and parameters.
// World size: loading into another world size is refused (Error kInvalidArgument); the shards
// hold partition-ordered slices, a resharding loader is not implemented.
// The directory must be visible to every rank (a shared file system for multi-node MPI runs).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "strata/communicator.hpp"
#include "strata/config.hpp"
#include "zero/optimizer_state.hpp"

namespace strata::zero {

struct RankState {
  int rank = 0, world = 1, stage = 0;
  DType param_dtype = DType::kFp32;
  std::size_t flat_size = 0, partition_size = 0;
  const Partition* partition = nullptr;  // the engine's layout (tensor names, sizes, offsets)
  std::size_t opt_begin = 0;  // flat offset of the store's element 0 (0 at stage 0, else own_begin)
  std::span<unsigned char> params;  // this rank's parameters (model dtype) as saved/restored
  OptimizerStateStore* store = nullptr;  // the rank's optimizer range
  // Scalars (saved from / restored into).
  std::int64_t adam_step = 0;
  double loss_scale = 1;
  std::uint32_t good_steps = 0;
  std::uint64_t steps = 0, applied_steps = 0, skipped_steps = 0;
  std::string config_yaml;
};

void save_checkpoint(const std::string& dir, const RankState& state, Communicator& comm);
// Fills params, the store and the scalars of `state`; layout fields must be set by the caller.
void load_checkpoint(const std::string& dir, RankState& state, Communicator& comm);

}  // namespace strata::zero
