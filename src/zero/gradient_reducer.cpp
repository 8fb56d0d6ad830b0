// The gradients of a step, from hand-in to the rank's gradient range (see gradient_reducer.hpp).
#include "zero/gradient_reducer.hpp"

#include <algorithm>

#include "optim/accumulate.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "strata/plan.hpp"
#include "strata/types.hpp"
#include "zero/clock.hpp"

namespace strata::zero {
namespace {

constexpr std::size_t kMaxBucketsInFlight = 2;
// Receive buffers: those of the collectives in flight, and one whose share is still being copied
// out while the next buckets reduce.
constexpr std::size_t kMaxRecvBuffers = kMaxBucketsInFlight + 1;
// One rank: a bucket buffer is its own receive buffer (share_bucket), so as many as the buckets and
// receive buffers above together (what strata plan counts).
constexpr std::size_t kMaxOneRankBuckets = kMaxBucketsInFlight + 1 + kMaxRecvBuffers;

std::vector<std::size_t> expected_per_bucket(const EngineLayout& l, std::size_t bucket_elems,
                                             std::size_t nbuckets) {
  std::vector<std::size_t> expected(nbuckets, 0);
  for (std::size_t i = 0; nbuckets > 0 && i < l.tensors(); ++i) {
    const std::size_t b = l.partition().offset(i), e = b + l.tensor(i).numel;
    for (std::size_t pos = b; pos < e;) {
      const std::size_t k = pos / bucket_elems;
      const std::size_t stop = std::min(e, (k + 1) * bucket_elems);
      expected[k] += stop - pos;
      pos = stop;
    }
  }
  return expected;
}

// Per bucket, the ranges of its elements no tensor covers (alignment padding, the partition's
// tail), relative to the bucket's start: the only elements zeroed when a bucket buffer is taken.
std::vector<std::vector<GradientReducer::Range>> gaps_per_bucket(const EngineLayout& l,
                                                                 std::size_t bucket_elems,
                                                                 std::size_t nbuckets) {
  std::vector<std::vector<GradientReducer::Range>> gaps(nbuckets);
  auto add_gap = [&](std::size_t b, std::size_t e) {  // flat [b, e), split at bucket bounds
    while (b < e) {
      const std::size_t k = b / bucket_elems, stop = std::min(e, (k + 1) * bucket_elems);
      gaps[k].push_back({b - k * bucket_elems, stop - b});
      b = stop;
    }
  };
  std::size_t covered = 0;  // tensors lie in increasing order in the flat layout
  for (std::size_t i = 0; nbuckets > 0 && i < l.tensors(); ++i) {
    const std::size_t b = l.partition().offset(i);
    if (l.tensor(i).numel == 0) continue;
    add_gap(covered, b);
    covered = b + l.tensor(i).numel;
  }
  if (nbuckets > 0) add_gap(covered, l.flat_size());
  return gaps;
}

// Sets the reducer's asynchronous flag for one hand-in; clears it however the hand-in ends.
class AsyncScope {
 public:
  AsyncScope(bool& flag, bool on) : flag_(flag) { flag_ = on; }
  ~AsyncScope() { flag_ = false; }
  AsyncScope(const AsyncScope&) = delete;
  AsyncScope& operator=(const AsyncScope&) = delete;

 private:
  bool& flag_;
};

// Stages 0-1, host memory on a CUDA device: the hand-in staging buffer holds at most
// min(zero.reduce_bucket_size, 64 MiB) of hand-in elements (src/plan/runtime.cpp counts it).
constexpr std::size_t kHandInStagingBytes = std::size_t{64} << 20;
std::size_t hand_in_staging_elems(const EngineLayout& l) {
  const std::size_t hes = l.hand_in_elem_bytes();
  return std::max<std::size_t>(
      1, std::min<std::uint64_t>(l.config().zero.reduce_bucket_size, kHandInStagingBytes / hes));
}

bool direct_of(const EngineLayout& l, const Communicator& comm, TierStore& store) {
  return hand_in_to_chunks(l.config(), l.stage(), comm.size(), l.any_grad_chunk_on(Tier::kNvme),
                           store.device().kind());
}

// Per gradient chunk (one rank: partition = flat), the elements of tensors in it: what the hand-ins
// fill (the rest is alignment padding, zeroed by the filler's round).
std::vector<std::size_t> expected_per_chunk(const EngineLayout& l, bool direct) {
  std::vector<std::size_t> expected(direct ? l.chunks().size() : 0, 0);
  for (std::size_t i = 0; direct && i < l.tensors(); ++i)
    l.for_each_chunk_piece(
        l.partition().offset(i) - l.own_begin(), l.tensor(i).numel,
        [&](std::size_t ci, std::size_t pos, std::size_t stop) { expected[ci] += stop - pos; });
  return expected;
}

std::size_t bucket_elems_of(const EngineLayout& l) {
  return l.stage() >= 2 ? std::max<std::uint64_t>(1, l.config().zero.reduce_bucket_size) : 1;
}

// Stages 2-3: the filler's staging buffer, through which shares copied out of device memory are
// added or converted into host memory: one share (a receive buffer's min(B, P) hand-in elements),
// at most tier::Filler::kStagingMax, 64 MiB (a larger share goes in parts; src/plan/runtime.cpp
// counts it; allocated only when such a share comes).
std::size_t share_staging_bytes(const EngineLayout& l) {
  const std::size_t share = std::min<std::size_t>(bucket_elems_of(l), l.partition_size());
  return std::min(share * l.hand_in_elem_bytes(), tier::Filler::kStagingMax);
}

}  // namespace

GradientReducer::GradientReducer(const EngineLayout& layout, Communicator& comm, TierStore& store,
                                 ScratchArena& scratch)
    : RankResources(layout, comm, store, scratch),
      direct_(direct_of(layout, comm, store)),
      bucket_elems_(bucket_elems_of(layout)),
      nbuckets_(layout.stage() >= 2 && !direct_
                    ? (layout.flat_size() + bucket_elems_ - 1) / bucket_elems_
                    : 0),
      bucket_expected_(expected_per_bucket(layout, bucket_elems_, nbuckets_)),
      bucket_gaps_(gaps_per_bucket(layout, bucket_elems_, nbuckets_)),
      retire_early_(!layout.any_grad_chunk_on(Tier::kNvme)),
      share_buckets_(retire_early_ && comm.size() == 1),
      stream_(store.device().create_stream()),
      arrived_(layout.tensors(), false),
      used_(layout.tensors(), false),
      bucket_of_(nbuckets_),
      chunk_expected_(expected_per_chunk(layout, direct_)) {
  if (layout.stage() >= 2) {
    std::vector<BufferId> grad_ids;
    for (const Chunk& c : layout.chunks()) grad_ids.push_back(c.grad);
    const bool cuda = store.device().kind() == DeviceKind::kCuda;
    const auto timeout = timeout_;
    const DType held = layout.grad_dtype(), reduced = layout.hand_in_dtype();
    fill_ = std::make_unique<tier::Filler>(
        store, std::move(grad_ids), timeout_,
        [cuda, timeout, held, reduced](Stream& s, void* dst, const void* src, std::size_t n,
                                       bool add) {
          accumulate_on_device(s, cuda, dst, held, src, reduced, n, add, timeout);
        },
        reduced, held, share_staging_bytes(layout));
  }
  reset();
}

// Collectives still in flight (a reducer destroyed mid-backward, e.g. after a failure) read the
// bucket buffers and write the receive buffers: they finish before anything is given back. Each
// wait is bounded by the communicator's timeout; their errors were or will never be reported.
GradientReducer::~GradientReducer() {
  for (auto& f : inflight_) {
    try {
      f.handle->wait();
    } catch (const std::exception&) {
    }
  }
  fill_.reset();  // waits for the copies out of the receive buffers
}

std::size_t GradientReducer::bucket_len(std::size_t b) const {
  return std::min(bucket_elems_, layout_.flat_size() - bucket_begin(b));
}

void GradientReducer::reset() {
  micro_ = 0;
  std::fill(used_.begin(), used_.end(), false);
  n_used_ = 0;
  reset_micro_batch();
}

// No tensor arrived, no bucket pending or issued, no chunk filled: a micro-batch's beginning.
void GradientReducer::reset_micro_batch() {
  std::fill(arrived_.begin(), arrived_.end(), false);
  n_arrived_ = 0;
  bucket_pending_.assign(bucket_expected_.begin(), bucket_expected_.end());
  bucket_issued_.assign(nbuckets_, false);
  next_issue_ = nbuckets_;
  chunk_filled_.assign(layout_.chunks().size(), 0);
  filled_.clear();
}

// The chunks it returns have their fills complete, or queued in the store ahead of any read (the
// speculative update reads them next through the store; an accumulating or converting piece
// completes on the filler's stream, outside the store's order, and is waited for).
std::vector<std::size_t> GradientReducer::take_filled_chunks(bool wait) {
  std::vector<std::size_t> out;
  if (filled_.empty()) return out;
  const auto t0 = Clock::now();
  if (wait) {  // for the last chunk whose fills are not queued in the store (and all before it)
    const auto it = std::find_if(filled_.rbegin(), filled_.rend(),
                                 [&](const auto& f) { return !fill_->in_store_order(f.first); });
    if (it != filled_.rend()) fill_->wait(it->second);
  }
  while (!filled_.empty() &&
         (fill_->in_store_order(filled_.front().first) || fill_->done(filled_.front().second))) {
    out.push_back(filled_.front().first);
    filled_.pop_front();
  }
  times_.grad_spill_s += seconds_since(t0);
  return out;
}

void GradientReducer::discard() {
  sync_hand_ins();  // copies still writing the gradients (stages 0-1) or the buckets
  while (!inflight_.empty()) {
    InFlight f = std::move(inflight_.front());
    inflight_.pop_front();
    f.handle->wait();
    free_recvs_.push_back(std::move(f.recv));
  }
  if (fill_ && fill_->active()) {
    collect_copies(true);
    fill_->abandon();
  }
  for (std::size_t k = 0; k < nbuckets_; ++k)
    if (bucket_of_[k]) free_buckets_.push_back(std::move(bucket_of_[k]));
  reset();
}

void GradientReducer::check_hand_in(TensorId id, const void* grad, bool zeros) const {
  const TensorSpec& t = layout_.tensor(id);
  if (arrived_[id] && n_arrived_ < arrived_.size()) {
    std::size_t missing = 0;
    while (arrived_[missing]) ++missing;
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: gradient of tensor '", t.name, "' handed in again (micro-batch ",
                micro_ + 2, ") before micro-batch ", micro_ + 1, " handed in every gradient ('",
                layout_.tensor(missing).name, "' and ", arrived_.size() - n_arrived_ - 1,
                " more missing)"));
  }
  if (!zeros && t.numel > 0 && grad == nullptr)
    fail(ErrorCode::kInvalidArgument, strcat("engine: null gradient for '", t.name, "'"));
}

void GradientReducer::mark_arrived(TensorId id) {
  if (arrived_[id]) start_micro_batch();
  arrived_[id] = true;
  ++n_arrived_;
}

void GradientReducer::hand_in(TensorId id, const void* grad, Tier memory,
                              const void* const* producer) {
  if (producer) stream_->wait_external(const_cast<void*>(*producer));  // fails: nothing changed
  const AsyncScope scope(async_, producer != nullptr);
  mark_arrived(id);
  if (!used_[id]) ++n_used_;
  used_[id] = true;
  const std::size_t n = layout_.tensor(id).numel, off = layout_.partition().offset(id);
  if (n == 0) return;
  const auto t0 = Clock::now();
  const auto* src = static_cast<const unsigned char*>(grad);
  const std::size_t ges = layout_.grad_elem_bytes();
  const bool same = layout_.grad_dtype() == layout_.hand_in_dtype();
  if (layout_.stage() < 2 && (micro_ > 0 || !same)) {
    accumulate_flat(off, n, src, memory, micro_ > 0);
  } else if (layout_.stage() < 2) {
    copy(layout_.grads_device() + off * ges, src, n * ges);  // the caller's thread on a host device
  } else if (direct_) {
    hand_in_direct(off, n, src);
  } else {
    hand_in_bucketed(off, n, src);
    retire_done();
    collect_copies(false);  // progress: finished copies free their buffers, spills start
  }
  times_.reduce_s += seconds_since(t0);
}

// Zeros: stages 0-1 clear the tensor's flat gradients in the first micro-batch (a later one adds
// nothing); stages 2-3 write zeros into its elements of their buckets.
void GradientReducer::hand_in_zero(TensorId id) {
  // Zeros read no caller memory: queued without a wait on a GPU (as an asynchronous hand-in).
  const AsyncScope scope(async_, store_.device().kind() == DeviceKind::kCuda);
  mark_arrived(id);
  const std::size_t n = layout_.tensor(id).numel, off = layout_.partition().offset(id);
  if (n == 0) return;
  const auto t0 = Clock::now();
  const std::size_t ges = layout_.stage() < 2 ? layout_.grad_elem_bytes()      // the flat gradients
                                              : layout_.hand_in_elem_bytes();  // the buckets
  if (layout_.stage() < 2 && micro_ == 0) {
    fill(layout_.grads_device() + off * ges, n * ges);
  } else if (direct_) {
    // The filler's round zeroes what no piece fills (replacing), or keeps it (adding zeros).
    layout_.for_each_chunk_piece(off - layout_.own_begin(), n,
                                 [&](std::size_t ci, std::size_t pos, std::size_t stop) {
                                   count_filled(ci, stop - pos, 0);
                                 });
  } else if (layout_.stage() >= 2) {
    // Last bucket first, as hand_in_bucketed.
    for (std::size_t stop = off + n; stop > off;) {
      const std::size_t k = (stop - 1) / bucket_elems_;
      const std::size_t pos = std::max(off, bucket_begin(k));
      fill(bucket_buffer(k).data() + (pos - bucket_begin(k)) * ges, (stop - pos) * ges);
      bucket_pending_[k] -= stop - pos;
      if (bucket_pending_[k] == 0) bucket_complete(k);
      stop = pos;
    }
    retire_done();
    collect_copies(false);
  }
  times_.reduce_s += seconds_since(t0);
}

// Bucket k holds every gradient: issued now on one rank; on several, with every complete bucket
// below the ones already issued, in descending order.
void GradientReducer::bucket_complete(std::size_t k) {
  sync_hand_ins();  // its collective or copy out reads what the hand-ins' copies wrote
  if (comm_.size() == 1) {
    issue_bucket(k);
    return;
  }
  while (next_issue_ > 0 && bucket_pending_[next_issue_ - 1] == 0) {
    --next_issue_;
    if (bucket_expected_[next_issue_] > 0) issue_bucket(next_issue_);
  }
}

// Every tensor arrived in the current micro-batch and one is handed in again: the next begins.
// Stages 2-3 finish the micro-batch's reductions and fills first; the next one's shares add.
void GradientReducer::start_micro_batch() {
  if (layout_.stage() >= 2) {
    finish_round();
    fill_->begin(tier::Filler::Mode::kAccumulate);
  }
  reset_micro_batch();
  ++micro_;
}

// Stages 0-1: the gradient (hand-in dtype) is added into the flat gradients (grad dtype) on the
// device (`add`: a later micro-batch), or converted into them (the first, when the dtypes
// differ); from host memory on a CUDA device through one staging buffer of at most
// hand_in_staging_elems, piece by piece (strata plan: RuntimeBuffers::hand_in_staging).
// Each piece's copy (synchronous) waits for the stream, the previous piece's kernel included,
// before it overwrites the staging buffer; the last kernel is waited for at the end.
void GradientReducer::accumulate_flat(std::size_t off, std::size_t n, const unsigned char* src,
                                      Tier memory, bool add) {
  const bool cuda = store_.device().kind() == DeviceKind::kCuda;
  const std::size_t hes = layout_.hand_in_elem_bytes();
  unsigned char* dst = layout_.grads_device() + off * layout_.grad_elem_bytes();
  if (memory != Tier::kCpu || !cuda) {
    accumulate_on_device(*stream_, cuda, dst, layout_.grad_dtype(), src, layout_.hand_in_dtype(), n,
                         add, timeout_);
    if (async_) {
      unsynced_ = true;  // the caller keeps `src` until reduce() waits for the stream
    } else {
      stream_->synchronize(timeout_);
    }
    return;
  }
  const std::size_t piece = std::min(n, hand_in_staging_elems(layout_));
  Scratch staged = scratch_.take(piece * hes, "gradient accumulation staging");
  for (std::size_t done = 0; done < n; done += piece) {
    const std::size_t m = std::min(piece, n - done);
    copy(staged.data(), src + done * hes, m * hes);
    accumulate_on_device(*stream_, cuda, dst + done * layout_.grad_elem_bytes(),
                         layout_.grad_dtype(), staged.data(), layout_.hand_in_dtype(), m, add,
                         timeout_);
  }
  stream_->synchronize(timeout_);
}

// The copy stream takes host and device memory alike. A tensor spanning several buckets fills them
// last bucket first: a backward handing in tensors in reverse order then completes buckets in
// descending order, the order in which several ranks issue them (bucket_complete), so no complete
// bucket waits for a higher one with its buffer held.
void GradientReducer::hand_in_bucketed(std::size_t off, std::size_t n, const unsigned char* src) {
  const std::size_t ges = layout_.hand_in_elem_bytes();
  for (std::size_t stop = off + n; stop > off;) {
    const std::size_t k = (stop - 1) / bucket_elems_;
    const std::size_t pos = std::max(off, bucket_begin(k));
    copy(bucket_buffer(k).data() + (pos - bucket_begin(k)) * ges, src + (pos - off) * ges,
         (stop - pos) * ges);
    bucket_pending_[k] -= stop - pos;
    if (bucket_pending_[k] == 0) bucket_complete(k);
    stop = pos;
  }
}

// One rank, nothing speculated (direct_): the hand-in is filled straight into the gradient chunks
// it lies in (a copy, or an add in a later micro-batch, converted where the dtypes differ) and
// waited for: the caller may reuse `src` when hand_in returns. The chunks are then the gradients'
// only copy (no bucket buffer: the least host memory).
void GradientReducer::hand_in_direct(std::size_t off, std::size_t n, const unsigned char* src) {
  if (!fill_->active()) fill_->begin();
  const std::size_t ges = layout_.grad_elem_bytes(), hes = layout_.hand_in_elem_bytes();
  const std::size_t begin = off - layout_.own_begin();
  tier::Filler::Ticket last = 0;
  layout_.for_each_chunk_piece(begin, n, [&](std::size_t ci, std::size_t pos, std::size_t stop) {
    const Chunk& c = layout_.chunks()[ci];
    // The host-emulated device's memory is host memory: the piece is named as in the chunk's
    // home, so that an add or conversion runs straight into it (the filler adds into a gpu home
    // from device memory, into a cpu home from host memory in the caller).
    const Tier in = c.grad_tier == Tier::kCpu ? Tier::kCpu : Tier::kGpu;
    last = fill_->fill_async(ci, (pos - c.r.begin) * ges, (stop - pos) * ges,
                             src + (pos - begin) * hes, in);
    count_filled(ci, stop - pos, last);
  });
  const auto t0 = Clock::now();
  fill_->wait(last);
  times_.grad_spill_s += seconds_since(t0);
}

// `n` more elements of chunk ci filled (its pieces up to ticket `last`): a chunk whose elements
// all arrived is final (take_filled_chunks) — every element from the buckets (their padding
// included), its tensors' elements straight from the hand-ins (direct_).
void GradientReducer::count_filled(std::size_t ci, std::size_t n, tier::Filler::Ticket last) {
  chunk_filled_[ci] += n;
  const std::size_t whole = direct_ ? chunk_expected_[ci] : layout_.chunks()[ci].r.count;
  if (chunk_filled_[ci] == whole) filled_.emplace_back(ci, last);
}

// Bucket k's buffer, its padding (elements of no tensor) zeroed when it is taken: every other
// element is written by a hand-in (hand_in_zero writes zeros) before the bucket is complete.
Scratch& GradientReducer::bucket_buffer(std::size_t k) {
  Scratch& b = bucket_of_[k];
  if (b) return b;
  // A rank makes one buffer per bucket up to its cap (what strata plan counts) before it reuses
  // any: their number is then the same every step (a steady-state step allocates nothing), not a
  // matter of how fast the collectives completed or the shares' copies out ran. Several ranks
  // make more past the cap when none is free (a hand-in order that holds more buckets).
  const std::size_t cap =
      std::min(nbuckets_, share_buckets_ ? kMaxOneRankBuckets : kMaxBucketsInFlight + 1);
  const bool make = buckets_made_ < cap;
  if (!make && free_buckets_.empty() && share_buckets_ && !copying_.empty())
    wait_oldest_copy();  // the buffers are copying their shares out
  if (!make && !free_buckets_.empty()) {
    b = std::move(free_buckets_.back());
    free_buckets_.pop_back();
  } else {
    // Sized for the longest bucket, the first: min(B, F) elements (a model smaller than
    // zero.reduce_bucket_size gets a buffer of its own size, not of B elements).
    b = scratch_.take(bucket_len(0) * layout_.hand_in_elem_bytes(), "gradient bucket");
    ++buckets_made_;
  }
  const std::size_t ges = layout_.hand_in_elem_bytes();
  for (const Range& g : bucket_gaps_[k]) fill(b.data() + g.begin * ges, g.count * ges);
  return b;
}

void GradientReducer::copy(void* dst, const void* src, std::size_t bytes) {
  if (!async_) return stream_->copy(dst, src, bytes, timeout_);
  stream_->memcpy_async(dst, src, bytes);
  unsynced_ = true;
}

void GradientReducer::fill(void* dst, std::size_t bytes) {
  if (!async_) return stream_->fill(dst, 0, bytes, timeout_);
  stream_->memset_async(dst, 0, bytes);
  unsynced_ = true;
}

// One host wait for every copy queued since the last: where a bucket completes and at reduce(),
// never per hand-in. A failed copy throws here (the engine then fails, as for a synchronous one).
void GradientReducer::sync_hand_ins() {
  if (!unsynced_) return;
  stream_->synchronize(timeout_);
  unsynced_ = false;
}

void GradientReducer::check_all_arrived() const {
  std::string missing;
  for (std::size_t i = 0; i < arrived_.size(); ++i)
    if (!arrived_[i])
      missing += strcat(missing.empty() ? "" : ", ", "'", layout_.tensor(i).name, "'");
  if (!missing.empty())
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: step() without the gradients of ", missing,
                micro_ > 0 ? strcat(" in micro-batch ", micro_ + 1) : std::string()));
}

// Starts bucket k's reduce-scatter; the rank's share lands in a receive buffer and is filled into
// the gradient chunks when the collective completes (retire_oldest).
void GradientReducer::issue_bucket(std::size_t k) {
  const std::size_t b = bucket_begin(k), e = b + bucket_len(k);
  auto counts = layout_.partition().counts_in(b, e);
  const std::size_t mine = counts[static_cast<std::size_t>(layout_.rank())];
  ++buckets_reduced_;
  if (share_buckets_) {
    bucket_issued_[k] = true;
    return share_bucket(k, mine);
  }
  while (inflight_.size() >= kMaxBucketsInFlight) retire_oldest();
  InFlight f;
  f.bucket = k;
  f.recv = take_recv();
  f.share_begin = mine ? std::max(b, layout_.own_begin()) - layout_.own_begin() : 0;
  f.share_count = mine;
  f.handle = comm_.reduce_scatter_async(bucket_of_[k].data(), f.recv.data(), counts,
                                        layout_.hand_in_dtype());
  inflight_.push_back(std::move(f));
  bucket_issued_[k] = true;
}

// One rank: the reduce-scatter of a bucket is the bucket itself (a sum over one rank is its own
// values, bit for bit). Its share is filled into the chunks from the bucket buffer at once: no
// collective, no copy into a receive buffer, and the chunks it completes are final at the hand-in
// that completed it, not at a later one that finds its collective done (the speculative update's
// tail: in `strata bench step --tensors 16` the last two buckets' chunks, 9 of 67, waited for the
// last gradient). Not with gradients on NVMe (retire_early_).
void GradientReducer::share_bucket(std::size_t k, std::size_t mine) {
  const std::size_t b = bucket_begin(k);
  start_share(std::move(bucket_of_[k]), mine ? b - layout_.own_begin() : 0, mine, true);
}

void GradientReducer::wait_oldest_copy() {
  const auto t0 = Clock::now();
  fill_->wait(copying_.front().ticket);
  times_.grad_spill_s += seconds_since(t0);
  collect_copies(false);
}

Scratch GradientReducer::take_recv() {
  collect_copies(false);
  // Made up to the cap before any is reused, as the bucket buffers (bucket_buffer).
  if (recvs_made_ < std::min(nbuckets_, kMaxRecvBuffers)) {
    ++recvs_made_;
    const std::size_t elems = std::min(bucket_elems_, layout_.partition_size());
    return scratch_.take(elems * layout_.hand_in_elem_bytes(), "gradient receive buffer");
  }
  if (free_recvs_.empty()) wait_oldest_copy();  // every buffer is copying out
  Scratch b = std::move(free_recvs_.back());
  free_recvs_.pop_back();
  return b;
}

// The oldest collective completed: its bucket buffer freed, its share's copy queued (not waited
// for).
void GradientReducer::retire_oldest() {
  InFlight f = std::move(inflight_.front());
  inflight_.pop_front();
  f.handle->wait();
  free_buckets_.push_back(std::move(bucket_of_[f.bucket]));
  start_share(std::move(f.recv), f.share_begin, f.share_count, false);
}

// The share (`count` partition elements from `begin`, in `buf`) is filled into the gradient
// chunks, queued; `buf` goes back to its pool (buckets when `bucket`, else receive buffers) once
// the copy completed (collect_copies).
void GradientReducer::start_share(Scratch buf, std::size_t begin, std::size_t count, bool bucket) {
  if (!count) {
    (bucket ? free_buckets_ : free_recvs_).push_back(std::move(buf));
    return;
  }
  const auto t0 = Clock::now();
  if (!fill_->active()) fill_->begin();
  // Offsets into the chunk in the held dtype, into the receive buffer in the reduced one.
  const std::size_t ges = layout_.grad_elem_bytes(), hes = layout_.hand_in_elem_bytes();
  tier::Filler::Ticket last = 0;
  try {
    layout_.for_each_chunk_piece(
        begin, count, [&](std::size_t ci, std::size_t pos, std::size_t stop) {
          const std::size_t at = layout_.chunks()[ci].r.begin;
          last = fill_->fill_async(ci, (pos - at) * ges, (stop - pos) * ges,
                                   buf.data() + (pos - begin) * hes, Tier::kGpu);
          count_filled(ci, stop - pos, last);
        });
  } catch (...) {
    // The fills queued so far still read `buf`: it stays with them (the round is broken).
    if (last) copying_.push_back({std::move(buf), last, bucket});
    throw;
  }
  copying_.push_back({std::move(buf), last, bucket});
  times_.grad_spill_s += seconds_since(t0);
}

// Receive buffers whose copy completed go back to free_recvs_; all: wait for every copy.
void GradientReducer::collect_copies(bool all) {
  if (copying_.empty()) {
    if (fill_ && fill_->active()) fill_->poll();  // NVMe writes that landed
    return;
  }
  const auto t0 = Clock::now();
  while (!copying_.empty()) {
    if (all) {
      fill_->wait(copying_.front().ticket);
    } else if (!fill_->done(copying_.front().ticket)) {
      break;
    }
    Copying& c = copying_.front();
    (c.bucket ? free_buckets_ : free_recvs_).push_back(std::move(c.buf));
    copying_.pop_front();
  }
  times_.grad_spill_s += seconds_since(t0);
}

std::exception_ptr GradientReducer::reduce() {
  const auto t0 = Clock::now();
  std::exception_ptr local;
  if (layout_.stage() < 2) sync_hand_ins();  // (stages 2-3: every bucket completed waited)
  const int world = comm_.size();
  const std::size_t ges = layout_.grad_elem_bytes();
  unsigned char* grads = layout_.grads_device();
  if (layout_.stage() == 0) {
    if (world > 1) comm_.all_reduce(grads, grads, layout_.flat_size(), layout_.grad_dtype());
  } else if (layout_.stage() == 1) {
    if (world > 1)
      comm_.reduce_scatter(grads, grads + layout_.own_begin() * ges, layout_.partition_size(),
                           layout_.grad_dtype());
  } else {
    // Every collective was issued by hand_in; what remains is waiting for them and this rank's
    // own copies and spills. A failure is returned, not thrown: the rank still takes part in the
    // step's agreement so that the others stop too.
    try {
      finish_round();
    } catch (...) {
      local = std::current_exception();
    }
  }
  times_.reduce_s += seconds_since(t0);
  return local;
}

// The collectives that already completed are retired, oldest first, without waiting: their shares'
// fills start now, so a chunk's gradient is final (take_filled_chunks) as soon as its last bucket
// is reduced — not only when a later bucket's issue needs the slot (two in flight) or at the
// micro-batch's last hand-in, which left the last buckets' chunks (a sixth of the model in `strata
// bench step`) to the speculative update after the backward.
// Not with gradient chunks on NVMe: their shares are assembled in pool buffers, and a fill
// started early would make the hand-in wait for one (fill.hpp) where the backward went on; nothing
// is speculated there either.
void GradientReducer::retire_done() {
  if (!retire_early_) return;
  while (!inflight_.empty() && inflight_.front().handle->done()) retire_oldest();
}

void GradientReducer::retire_all() {
  const auto t0 = Clock::now();
  while (!inflight_.empty()) retire_oldest();
  times_.reduce_s += seconds_since(t0);
}

void GradientReducer::finish_round() {
  while (!inflight_.empty()) retire_oldest();
  collect_copies(true);
  for (std::size_t k = 0; k < nbuckets_; ++k) {
    if (!bucket_issued_[k] && bucket_expected_[k] > 0)
      fail(ErrorCode::kInternal, strcat("engine: bucket ", k, " incomplete at step()"));
    if (bucket_of_[k]) free_buckets_.push_back(std::move(bucket_of_[k]));
  }
  const auto t1 = Clock::now();
  if (!fill_->active()) fill_->begin();
  fill_->end();
  times_.grad_spill_s += seconds_since(t1);
}

void GradientReducer::abandon() noexcept {
  if (fill_) fill_->abandon();
}

std::exception_ptr GradientReducer::abandon_for_cause() noexcept {
  return fill_ ? fill_->abandon_for_cause() : nullptr;
}

}  // namespace strata::zero
