// The engine's internals for tests and the measuring code (src/profile): per-rank fault
// injection into the rank's storage (the one fault-injecting wrapper per rank; set before
// finalize()), the rank's TierStore and what it holds per tier and kind (against `strata plan`),
// and the update loop's legs measured alone (strata bench step, the profiler's sample step).
// Not part of the public API.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>

#include "strata/engine.hpp"
#include "tier/scratch_arena.hpp"
#include "tier/stream_loop.hpp"
#include "zero/async_checkpoint.hpp"
#include "zero/chunk.hpp"
#include "zero/rank_storage.hpp"

namespace strata::zero {

// What measure() runs over the update's chunks (those whose Adam runs on the host), through the
// same loop and slots as step(): read every chunk's state and gradients (kRead); read and write
// them back unchanged (kIo: the device bound when reads and writes share a disk); write them from
// the slots' contents (kWrite: benchmarks only, it replaces the state with garbage); Adam on chunks
// held in memory with no I/O (kUpdate: the first chunk's staged data reused for every chunk).
enum class Measure { kRead, kIo, kWrite, kUpdate };

struct ReducerBuffers {
  std::size_t buckets = 0, receives = 0;  // made so far by the gradient reducer
};

struct EngineAccess {
  // Before finalize(): what the rank's storage builds (device, I/O engine) goes through `wrap`.
  static void set_storage_wrap(Engine& e, StorageWrap wrap);
  // After finalize().
  static RankStorage& storage(Engine& e);
  static StorageReport report(const Engine& e);
  static const std::vector<Chunk>& chunks(const Engine& e);
  static ReducerBuffers reducer_buffers(const Engine& e);
  static ScratchStats scratch(const Engine& e);
  // The last step's update loop (the host-computed chunks): timings and bytes.
  static tier::StreamStats last_update(const Engine& e);
  // Statistics tiles the decisions took from the speculative update's (AheadStats), so far.
  static std::uint64_t stats_tiles_known_ahead(const Engine& e);
  // Padded bytes of the pending versions the speculative update was given so far this step (the
  // caller's count, made when chunks are handed to it, before its thread runs them).
  static std::uint64_t speculation_bytes(const Engine& e);
  static tier::StreamStats measure(Engine& e, Measure what, bool pipelined = true);
  // The step's loops pipelined (default) or serial: read, compute, write, one chunk at a time.
  static void set_pipelined(Engine& e, bool on);
  // On the host-emulated device: the host-computed loops stage gpu-home parts through the pinned
  // pool as on CUDA (on), or view them in place (off, the default): tests cover both paths.
  static void set_stage_device_memory(Engine& e, bool on);
  // Host-state chunks updated partly by the device's Adam (zero/update_split.hpp): `share(i)` is
  // the device's share of chunk i; empty: the CPU alone. The elements each side took so far.
  static void force_update_split(Engine& e, std::function<double(std::size_t)> share);
  static std::pair<std::uint64_t, std::uint64_t> update_split_elements(const Engine& e);
  // Waits for this rank's asynchronous checkpoint writer, if one is at work (local, no collective;
  // the save stays uncommitted until a step agreement or wait_checkpoint()); returns its figures
  // (zero without an asynchronous save pending).
  static AsyncCheckpoint::WriterStats wait_checkpoint_writer(Engine& e);
  // An asynchronous save's writer is at work.
  static bool checkpoint_writing(const Engine& e);
  // Parameter bytes the pending asynchronous save's call copied (0 without one; 0 when its
  // snapshot holds them: stage 3's pinned blocks, stages 0-2 made from the pinned master).
  static std::size_t checkpoint_param_copy_bytes(const Engine& e);
  // Stages 0-2: the rank's parameters are known to be its master's rounding (engine_state.cpp).
  static bool params_follow_master(const Engine& e);
};

}  // namespace strata::zero
