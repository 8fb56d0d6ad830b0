// The one pipelined loop of strata: "stream a sequence of items through k slots, reading ahead,
// computing, writing behind". The engine's optimizer step (and its gradient statistics pass),
// `strata bench step` and the profiler's sample step all run it (the last two by running the
// engine's step), so what the profiler measures is what training does.
//
// An item is what one compute call needs: up to kMaxParts byte ranges of TierStore buffers (an
// optimizer chunk's master | exp_avg | exp_avg_sq, the gradients of its elements, the parameters
// it writes). The compute function sees one pointer per part, in host memory (Where::kHost: CPU
// Adam, the statistics) or in device memory of the store's Device (Where::kDevice: the CUDA Adam
// for state placed on gpu). A part is viewed in place when its buffer lives where the compute
// runs (home tier cpu for kHost, gpu for kDevice: the copy is acquired, no bytes move; on the
// host-emulated device, whose memory is host memory, a gpu-home part is viewed in place by kHost
// compute too, unless options.stage_device_memory: CUDA memory is always staged). Otherwise it is
// staged in the item's slot: kHost slots are pinned pool buffers (one per item, the parts
// laid out one after another, 4096-aligned), kDevice slots are device scratch buffers registered
// in the store for the loop's duration. Staged parts with `in` are read before the compute
// (TierStore::read: NVMe with its CRC checked, or a device→host copy on a mover's stream); parts
// with `out` are written after it (TierStore::write: to NVMe with fresh CRCs, or host→device).
//
// Versions: a part marked `pending` is read from the committed version and written to the
// block's pending version (the speculative update, issue 26); the one loop serves both updates.
// Staged, the slot holds the committed bytes, the compute changes them there and they are written
// to the pending version (TierStore::write_pending). With options.out_views, a pending part whose
// home the compute can view is not staged: the compute reads the committed copy in place (an
// acquire for reading) and writes its result straight into the pending version's memory
// (TierStore::pending_view; the range then recorded by write_pending, no copy) — an update out of
// place, what CPU Adam does for a pending version of host state.
//
// Schedule: with a window of w slots, item i+1..i+w-1 are read while fn runs on item i and the
// writes of i-1.. are still in flight; a slot is reused only after its writes completed (drain
// before release), and goes back as soon as they did (checked, without waiting, before each
// item's reads are issued and again before its compute). w = 1 (or pipelined = false) is serial:
// read, compute, write, one item at a time. The window is min(options.window, pool buffers) for
// kHost and options.window for kDevice; with every part in place no slot is needed and nothing
// moves.
//
// Failure: an error of any transfer (IoError, Error(kChecksum), Error(kDevice), Error(kTimeout))
// or of fn stops the loop: every transfer still in flight is waited for (bounded; a slot whose
// transfer does not finish is never given back to the pool), every in-place acquire is released,
// then the error is rethrown with the loop's name, the item, the part's buffer and the slot, and
// how many items were computed and written. Items before the failing one are computed (and, once
// their writes completed, stored); the rest are not. Whether that is a failed state is the
// caller's decision (the engine marks itself failed; the store marks itself failed when a buffer
// lost its only copy).
//
// Gate (options.gate): a decision the computes wait for but the transfers need not, e.g. the
// optimizer step's gradient norm and overflow agreement. It is called once, on the caller's
// thread, after the first window's reads (and in-place acquires) have been issued and before the
// first compute (with no items: at once), so those transfers go on while it runs. true: the loop
// goes on. false: the run is cancelled before any compute: the reads in flight are waited for
// (their errors reported as above), every slot and acquire goes back, nothing is written, and the
// result says cancelled. An exception from the gate is rethrown as it is, after the same drain.
// The gate may run other loops on the same store only on other buffers or in-place reads of the
// same ones, and only ones that need no pool slot (this run's slots are held while it runs).
//
// Thread-safety: one call runs on the caller's thread (plus the store's movers). Different calls
// on one store may run concurrently only on disjoint buffers.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tier/tier_store.hpp"

namespace strata::tier {

enum class Where { kHost, kDevice };

struct StreamPart {
  BufferId id = 0;
  std::uint64_t offset = 0;  // bytes into the buffer
  std::uint64_t bytes = 0;   // 0: from offset to the end of the buffer
  bool in = true;            // its current contents are needed by the compute
  bool out = false;          // the compute changes it: store it afterwards
  // The version selector (docs/versioned_state.md): false, the committed version is read and
  // written; true, the committed version is read and the result is written to the block's
  // pending version (TierStore::write_pending; open_pending first). The committed bytes never
  // change: a pending part is staged in the slot, or (options.out_views) read in place and
  // written to the pending version's memory.
  bool pending = false;
};

inline constexpr std::size_t kMaxParts = 4;

struct StreamItem {
  std::vector<StreamPart> parts;  // at most kMaxParts
};

struct StreamOptions {
  Where where = Where::kHost;
  std::uint32_t window = 4;  // slots in flight (read-ahead + compute + write-behind)
  bool pipelined = true;     // false: read, compute, write, one item at a time
  std::chrono::milliseconds timeout{120000};  // bound on each wait
  std::string what = "stream";                // names the loop in errors and logs
  // kHost compute on a store whose Device is the host-emulated one: true stages gpu-home parts
  // through the pool as on CUDA (tests keep that path covered); false views them in place.
  bool stage_device_memory = false;
  // Called once before the first compute, after the first reads were issued (see "Gate" above);
  // empty: no gate.
  std::function<bool()> gate;
  // The compute writes its results to the out views (StreamFn), never into the views it reads:
  // pending parts of memory homes are then viewed in place (see "Versions" above).
  bool out_views = false;
};

// Timings of one run, seconds, and bytes moved.
struct StreamStats {
  double t_total = 0;
  double t_compute = 0;                       // in fn, on the calling thread
  double t_wait_in = 0;                       // waiting for reads
  double t_wait_out = 0;                      // waiting for writes (to free a slot, and at the end)
  double t_gate = 0;                          // in options.gate (part of t_total)
  bool cancelled = false;                     // the gate said no: nothing computed or written
  std::uint64_t bytes_in = 0, bytes_out = 0;  // staged bytes read / written
  std::size_t items = 0;
  std::uint32_t slots = 0;  // slots the run used (0: everything in place)
  std::uint64_t slot_bytes = 0;
};

// fn(item index, views): 2n pointers for an item of n parts, in the item's order: views[k] is
// what the compute reads of part k, views[n + k] where it writes part k's result. They are the
// same pointer except for a pending part viewed in place (options.out_views): views[k] is then
// the committed copy, read only, and views[n + k] the pending version's memory. A compute without
// options.out_views may use views[k] for both.
using StreamFn = std::function<void(std::size_t item, std::span<void* const> views)>;

StreamStats run_stream(TierStore& store, std::span<const StreamItem> items, const StreamFn& fn,
                       const StreamOptions& options);

// The bytes an item's staged parts take in a slot (each part padded to 4096) when `where` is the
// compute location, gpu-home parts staged as on CUDA, pending parts as options.out_views says;
// 0 when every part is viewed in place. Callers size their items with it.
std::uint64_t staged_bytes(const TierStore& store, const StreamItem& item, Where where,
                           bool out_views = false);
// Whether run_stream(store, {item}, fn, options) views every part of the item in place (needs no
// slot; moves nothing).
bool in_place(const TierStore& store, const StreamItem& item, const StreamOptions& options);

}  // namespace strata::tier
