// Gradients: set_gradient, the stage-2/3 buckets reduce-scattered as the backward produces them,
// the rank's share of each bucket filled into the gradient chunks wherever they live (device
// memory, or device→host on the store's copy streams, spilled on to NVMe) — queued, not waited
// for: the backward goes on while the share is copied out, and its receive buffer is reused only
// once the copy completed — and step()'s reduction.
#include <algorithm>
#include <cstring>

#include "strata/log.hpp"
#include "zero/engine_impl.hpp"

namespace strata {

namespace {
constexpr std::size_t kMaxBucketsInFlight = 2;
// Receive buffers: those of the collectives in flight, and one whose share is still being copied
// out while the next buckets reduce.
constexpr std::size_t kMaxRecvBuffers = kMaxBucketsInFlight + 1;
}  // namespace

void Engine::Impl::reset_buckets() {
  bucket_pending = bucket_expected;
  bucket_issued.assign(nbuckets, false);
}

void Engine::Impl::set_gradient(TensorId id, const void* grad, Tier memory) {
  require_finalized("set_gradient");
  require_usable("set_gradient");
  check_id(id, "set_gradient");
  if (arrived[id])
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: gradient of tensor '", specs[id].name, "' handed in twice in one step"));
  const std::size_t n = specs[id].numel, off = part->offset(id);
  if (n > 0 && grad == nullptr)
    fail(ErrorCode::kInvalidArgument, strcat("engine: null gradient for '", specs[id].name, "'"));
  arrived[id] = true;
  if (n == 0) return;
  auto t0 = zero::Clock::now();
  const auto* src = static_cast<const unsigned char*>(grad);
  // From here on a failure (a copy, a collective, the gradient spill) leaves the backward half
  // done.
  try {
    if (stage < 2) {
      store().write(grads_id, off * ges, n * ges, src, memory).wait(timeout);
    } else {
      for (std::size_t pos = off; pos < off + n;) {
        const std::size_t k = pos / bucket_elems;
        const std::size_t stop = std::min(off + n, bucket_begin(k) + bucket_len(k));
        if (!bucket_of[k].id) {
          if (!free_buckets.empty()) {
            bucket_of[k] = free_buckets.back();
            free_buckets.pop_back();
            // A reused buffer: the bucket's padding (elements of no tensor) must be zero again.
            store().zero(bucket_of[k].id).wait(timeout);
          } else {
            // Sized for the longest bucket, the first: min(B, F) elements (a model smaller than
            // zero.reduce_bucket_size gets a buffer of its own size, not of B elements).
            bucket_of[k] = make_dev_buf(strcat("rt.bucket.", dev_bufs_made++), bucket_len(0) * ges);
          }
        }
        store()
            .write(bucket_of[k].id, (pos - bucket_begin(k)) * ges, (stop - pos) * ges,
                   src + (pos - off) * ges, memory)
            .wait(timeout);
        bucket_pending[k] -= stop - pos;
        if (bucket_pending[k] == 0) issue_bucket(k);
        pos = stop;
      }
      collect_copies(false);  // progress: finished copies free their buffers, spills start
    }
  } catch (const std::exception& e) {
    std::rethrow_exception(fail_call(e));
  }
  st.reduce_s += zero::seconds_since(t0);
}

void Engine::Impl::check_all_arrived() {
  std::string missing;
  for (std::size_t i = 0; i < specs.size(); ++i)
    if (!arrived[i]) missing += strcat(missing.empty() ? "" : ", ", "'", specs[i].name, "'");
  if (!missing.empty())
    fail(ErrorCode::kInvalidArgument, strcat("engine: step() without the gradients of ", missing));
}

// Starts bucket k's reduce-scatter on the device buffers; the rank's share lands in a receive
// buffer and is filled into the gradient chunks when the collective completes (retire_oldest).
void Engine::Impl::issue_bucket(std::size_t k) {
  const std::size_t b = bucket_begin(k), e = b + bucket_len(k);
  auto counts = part->counts_in(b, e);
  const std::size_t mine = counts[static_cast<std::size_t>(rank)];
  while (inflight.size() >= kMaxBucketsInFlight) retire_oldest();
  InFlight f;
  f.bucket = k;
  f.recv = take_recv();
  f.share_begin = mine ? std::max(b, own_begin) - own_begin : 0;
  f.share_count = mine;
  f.handle = comm.reduce_scatter_async(bucket_of[k].ptr, f.recv.ptr, counts, gdt);
  inflight.push_back(std::move(f));
  bucket_issued[k] = true;
}

Engine::Impl::DevBuf Engine::Impl::take_recv() {
  collect_copies(false);
  if (free_recvs.empty() && recvs_made < kMaxRecvBuffers) {
    ++recvs_made;
    return make_dev_buf(strcat("rt.recv.", dev_bufs_made++), std::min(bucket_elems, psize) * ges);
  }
  if (free_recvs.empty()) {  // every buffer is copying out: wait for the oldest
    auto t0 = zero::Clock::now();
    grad_fill->wait(copying.front().ticket);
    st.grad_spill_s += zero::seconds_since(t0);
    collect_copies(false);
  }
  DevBuf b = free_recvs.back();
  free_recvs.pop_back();
  return b;
}

void Engine::Impl::retire_oldest() {
  InFlight f = std::move(inflight.front());
  inflight.pop_front();
  f.handle->wait();
  free_buckets.push_back(bucket_of[f.bucket]);
  bucket_of[f.bucket] = {};
  if (!f.share_count) {
    free_recvs.push_back(f.recv);
    return;
  }
  auto t0 = zero::Clock::now();
  if (!grad_fill->active()) grad_fill->begin();
  tier::Filler::Ticket last = 0;
  for (std::size_t pos = f.share_begin; pos < f.share_begin + f.share_count;) {
    std::size_t ci = static_cast<std::size_t>(&chunk_at(pos) - chunks.data());
    const zero::Chunk& c = chunks[ci];
    const std::size_t stop = std::min(f.share_begin + f.share_count, c.r.end());
    last = grad_fill->fill_async(ci, (pos - c.r.begin) * ges, (stop - pos) * ges,
                                 f.recv.ptr + (pos - f.share_begin) * ges, Tier::kGpu);
    pos = stop;
  }
  copying.push_back({f.recv, last});
  st.grad_spill_s += zero::seconds_since(t0);
}

void Engine::Impl::collect_copies(bool all) {
  if (copying.empty()) {
    if (grad_fill && grad_fill->active()) grad_fill->poll();  // NVMe writes that landed
    return;
  }
  auto t0 = zero::Clock::now();
  while (!copying.empty()) {
    if (all) {
      grad_fill->wait(copying.front().ticket);
    } else if (!grad_fill->done(copying.front().ticket)) {
      break;
    }
    free_recvs.push_back(copying.front().recv);
    copying.pop_front();
  }
  st.grad_spill_s += zero::seconds_since(t0);
}

// Step part 1: every gradient reduced into the rank's range. Stages 0-1: the all-reduce /
// reduce-scatter of the flat gradients in device memory. Stages 2-3: the buckets still in flight
// are retired and the gradient chunks completed (zeros where no bucket had a share: padding).
std::exception_ptr Engine::Impl::reduce() {
  auto t0 = zero::Clock::now();
  std::exception_ptr local;
  if (stage == 0) {
    if (world > 1) comm.all_reduce(grads_dev, grads_dev, part->flat_size(), gdt);
  } else if (stage == 1) {
    if (world > 1) comm.reduce_scatter(grads_dev, grads_dev + own_begin * ges, psize, gdt);
  } else {
    // Every collective was issued by set_gradient; what remains is waiting for them and this
    // rank's own copies and spills. A failure here is returned, not thrown: the rank still takes
    // part in the step's agreement so that the others stop too (the collectives in flight hold
    // this rank's contribution already).
    try {
      while (!inflight.empty()) retire_oldest();
      collect_copies(true);
      for (std::size_t k = 0; k < nbuckets; ++k) {
        if (!bucket_issued[k] && bucket_expected[k] > 0)
          fail(ErrorCode::kInternal, strcat("engine: bucket ", k, " incomplete at step()"));
        if (bucket_of[k].id) {
          free_buckets.push_back(bucket_of[k]);
          bucket_of[k] = {};
        }
      }
      auto t1 = zero::Clock::now();
      if (!grad_fill->active()) grad_fill->begin();
      grad_fill->end();
      st.grad_spill_s += zero::seconds_since(t1);
    } catch (...) {
      local = std::current_exception();
    }
  }
  st.reduce_s += zero::seconds_since(t0);
  return local;
}

}  // namespace strata
