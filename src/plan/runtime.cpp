// What the engine holds besides the model state, with the formulas it allocates by
// (src/zero/engine_layout.cpp, engine_grads.cpp, engine_params.cpp): the pinned staging pool and
// the runtime buffers in device memory. docs/config.md "Pinned pool" and "Runtime buffers".
#include <algorithm>
#include <array>
#include <cmath>
#include <string>

#include "core/checked_math.hpp"
#include "plan/plan_internal.hpp"
#include "strata/plan.hpp"

namespace strata {
namespace {

constexpr std::uint64_t kAlign = 4096;            // a chunk's staging regions (engine_layout.cpp)
constexpr std::uint64_t kPartitionAlign = 64;     // Partition::kDefaultPartitionAlign
constexpr std::uint64_t kXferPiece = 1ULL << 24;  // FP32 elements per broadcast piece (64 MiB)
// Stages 0-1: the hand-in staging buffer's bound (src/zero/gradient_reducer.cpp).
constexpr std::uint64_t kHandInStagingBytes = 64ULL << 20;
constexpr std::uint64_t kShareStagingBytes = 64ULL << 20;  // tier::Filler::kStagingMax
// Stages 2-3: reduce-scatters in flight, and receive buffers (those in flight and one whose share
// is still being copied out) (src/zero/gradient_reducer.cpp, kMaxBucketsInFlight, kMaxRecvBuffers).
constexpr std::uint64_t kBucketsInFlight = 2;
constexpr std::uint64_t kReceiveBuffers = kBucketsInFlight + 1;

// v rounded up to a multiple of a, or kSaturated.
std::uint64_t sat_round_up(std::uint64_t v, std::uint64_t a) { return sat_mul((v + a - 1) / a, a); }
std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return a / b + (a % b != 0); }

std::uint64_t ranks_of(const Config& c) { return std::max<std::uint32_t>(c.world.ranks, 1); }

// The engine's leading(): the first ceil(fraction x count) elements, rounded up to 1024, are on the
// placement's tier.
std::uint64_t leading(const OffloadTarget& t, std::uint64_t count) {
  if (t.tier == Tier::kGpu || t.fraction <= 0 || count == 0) return 0;
  const double want = std::ceil(std::min(1.0, t.fraction) * static_cast<double>(count));
  return std::min(count, sat_round_up(static_cast<std::uint64_t>(want), 1024));
}

// The most elements one pool buffer stages: round_up(12n) + round_up(n x grad) + round_up(n x
// param) <= buffer_size, cut to a multiple of 1024 (64 when small).
std::uint64_t chunk_capacity(std::uint64_t buf, std::uint64_t gb, std::uint64_t pb) {
  auto fits = [&](std::uint64_t n) {
    return sat_add(sat_round_up(sat_mul(12, n), kAlign), sat_round_up(sat_mul(n, gb), kAlign),
                   sat_round_up(sat_mul(n, pb), kAlign)) <= buf;
  };
  std::uint64_t lo = 0, hi = buf;
  while (lo < hi) {
    const std::uint64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid))
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo >= 1024 ? lo / 1024 * 1024 : lo >= 64 ? lo / 64 * 64 : lo;
}

}  // namespace

std::uint64_t partition_elements(const Config& c) {
  return sat_round_up(ceil_div(c.model.parameters, ranks_of(c)), kPartitionAlign);
}

std::uint64_t PoolPlan::bytes() const {
  return used ? sat_add(sat_mul(buffers, buffer_size), share_staging) : 0;
}

namespace {
// Stages 2-3 on a GPU with gradients off it, added (train.accumulate > 1) or converted (grad_accum
// differs from precision.grads): the shares go device -> host through the gradient filler's
// staging buffer, one share of min(B, P) hand-in elements, at most 64 MiB (kShareStagingBytes;
// zero/gradient_reducer.cpp, tier/fill.hpp), page-locked. REQUIRES: the stage, device and gradients
// as said.
std::uint64_t share_staging(const Config& c, std::uint64_t psize) {
  if (c.model.parameters == 0 ||
      (c.train.accumulate <= 1 && c.precision.accum_dtype() == c.precision.grads))
    return 0;
  const std::uint64_t hb = dtype_size(c.precision.grads);
  const std::uint64_t bucket = std::max<std::uint64_t>(c.zero.reduce_bucket_size, 1);
  return std::min(sat_mul(std::min(bucket, psize), hb), kShareStagingBytes);
}
}  // namespace

// The engine's chunk grid over the rank's optimizer range (sub-groups of zero.sub_group_size, cut
// where a placement's share ends and at what one buffer stages) decides how many buffers the pool
// gets and, when no chunk fills a buffer, how large they are. Regions between the placement cuts
// are counted in closed form (no loop over chunks).
PoolPlan plan_pool(const Config& c, int stage, const OffloadConfig& o) {
  PoolPlan p;
  const std::uint64_t n = ranks_of(c);
  const std::uint64_t psize = partition_elements(c);
  const std::uint64_t count = stage == 0 ? sat_mul(psize, n) : psize;
  const std::uint64_t opt_on = leading(o.optimizer, count);
  const std::uint64_t grad_on = stage >= 2 ? leading(o.gradients, count) : 0;
  const std::uint64_t param_on = stage == 3 ? leading(o.params, count) : 0;
  const bool gpu = c.runtime.device != DeviceKind::kHost;
  const bool off = opt_on || grad_on || param_on;
  if (!off && !gpu) {
    p.why = "none: no state off the gpu and runtime.device is host";
    return p;
  }
  p.used = true;
  p.why = off ? "state off the gpu is staged through it"
              : std::string("the device is a GPU (runtime.device ") +
                    device_name(c.runtime.device) +
                    "): copies between device and host are staged through it";
  const std::uint64_t gb = dtype_size(c.precision.accum_dtype());  // the held gradients
  const std::uint64_t pb = dtype_size(c.precision.params);
  const std::uint64_t buf = c.tiers.host.buffer_size;
  const std::uint64_t cap = std::max<std::uint64_t>(chunk_capacity(buf, gb, pb), 1);
  const std::uint64_t sg = std::max<std::uint64_t>(c.zero.sub_group_size, 1);

  // Regions between the cuts have one placement each.
  std::array<std::uint64_t, 5> cuts = {0, opt_on, grad_on, param_on, count};
  std::sort(cuts.begin(), cuts.end());
  std::uint64_t chunks = 0, need = 0;
  bool capped = false;
  for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
    const std::uint64_t x = cuts[i], y = cuts[i + 1];
    if (x >= y) continue;
    const bool opt_off = x < opt_on, opt_nvme = opt_off && o.optimizer.tier == Tier::kNvme;
    const bool grads_cpu = x < grad_on && o.gradients.tier == Tier::kCpu;
    const bool params_cpu = x < param_on && o.params.tier == Tier::kCpu;
    auto piece = [&](std::uint64_t len, std::uint64_t times) {  // `times` pieces of `len` elements
      if (len == 0 || times == 0) return;
      chunks = sat_add(chunks, sat_mul(ceil_div(len, cap), times));
      const std::uint64_t e = std::min(len, cap);  // the largest chunk of the piece
      if (e == cap) capped = true;
      if (opt_off) {
        p.largest_host_chunk = std::max(p.largest_host_chunk, e);
        // With overlap: on, a speculative update stages its pending state and parameters too,
        // also where they live in host memory (zero/engine_layout.cpp, storage_needs).
        const bool spec = stage >= 2 && c.optimizer.overlap == OptimizerOverlap::kOn;
        std::uint64_t slot = opt_nvme || spec ? sat_round_up(12 * e, kAlign) : 0;
        if (!grads_cpu) slot += sat_round_up(e * gb, kAlign);
        if (!params_cpu || spec) slot += sat_round_up(e * pb, kAlign);
        need = std::max(need, slot);
      }
      if (!grads_cpu) need = std::max(need, sat_round_up(e * gb, kAlign));  // the statistics pass
      if (!opt_off) {  // the device update loop stages what is not on the gpu (tier/stream_loop)
        std::uint64_t slot = x < grad_on ? sat_round_up(e * gb, kAlign) : 0;
        if (x < param_on) slot = sat_add(slot, sat_round_up(e * pb, kAlign));
        p.device_slot = std::max(p.device_slot, slot);
      }
    };
    // [x, y) cut at the multiples of the sub-group size.
    const std::uint64_t first_end = std::min(y, sat_mul(x / sg + 1, sg));
    piece(first_end - x, 1);
    if (first_end < y) {
      piece(sg, (y - first_end) / sg);
      piece((y - first_end) % sg, 1);
    }
  }
  p.buffers = static_cast<std::uint32_t>(
      std::min<std::uint64_t>(c.tiers.host.buffer_count, std::max<std::uint64_t>(chunks, 1)));
  p.buffer_size = capped ? buf : std::min(buf, std::max(need, kAlign));
  if (stage >= 2 && gpu && grad_on > 0) p.share_staging = share_staging(c, psize);
  return p;
}

std::uint64_t RuntimeBuffers::step() const {
  return sat_add(buckets, receive, gathered, send, norm, adam_scratch, update_slots,
                 hand_in_staging);
}
std::uint64_t RuntimeBuffers::total() const { return sat_add(step(), staging); }

bool update_split(const Config& c) {
  return c.optimizer.update == OptimizerUpdate::kAuto && c.runtime.device != DeviceKind::kHost;
}

std::uint64_t update_window_elements(std::uint64_t window, std::uint64_t grad_bytes,
                                     std::uint64_t param_bytes, std::uint64_t whole) {
  if (window == 0 || whole == 0) return whole;
  constexpr std::uint64_t kPads = 5 * 256;  // one pad per array at most
  const std::uint64_t per = 12 + grad_bytes + param_bytes;
  return std::clamp<std::uint64_t>(window > kPads ? (window - kPads) / per : 0, 1, whole);
}

RuntimeBuffers runtime_buffers(const Config& c, int stage, const OffloadConfig& offload) {
  RuntimeBuffers r;
  const std::uint64_t n = ranks_of(c);
  const std::uint64_t psize = partition_elements(c);
  const std::uint64_t flat = sat_mul(psize, n);
  // Buckets and receive buffers in precision.grads; the held gradients in grad_accum.
  const std::uint64_t gb = dtype_size(c.precision.grads), pb = dtype_size(c.precision.params);
  const std::uint64_t held = dtype_size(c.precision.accum_dtype());
  const std::uint64_t bucket = std::max<std::uint64_t>(c.zero.reduce_bucket_size, 1);
  r.norm = 16 * (n + 1);
  if (c.model.largest_layer > 0) {
    r.layer = std::min(c.model.largest_layer, c.model.parameters);
  } else if (c.model.hidden_size > 0) {
    // One transformer block: attention 4h^2 + 4h, MLP 8h^2 + 5h, two layer norms 4h.
    const std::uint64_t h = c.model.hidden_size;
    r.layer = std::min(sat_add(sat_mul(12, h, h), sat_mul(13, h)), c.model.parameters);
    r.layer_estimated = r.layer > 0;
  }
  if (stage >= 2 && c.model.parameters > 0) {
    // Buffers are min(B, F) elements each (no bucket is longer than the flat gradients). Handed in
    // tensor by tensor in backward order (a tensor spanning buckets fills its last one first), at
    // most two buckets are in flight and one is being filled, which also waits for its earlier
    // tensors (src/zero/gradient_reducer.cpp). Receive buffers: two reduce-scatters in flight plus
    // one whose share is still being copied out to the host (ZeRO-Offload overlap). Each kind is
    // made one per bucket up to its count before any is reused (the same number every step).
    const std::uint64_t nbuckets = ceil_div(flat, bucket);
    const bool grads_nvme =
        offload.gradients.tier == Tier::kNvme && leading(offload.gradients, psize) > 0;
    if (hand_in_to_chunks(c, stage, static_cast<int>(n), grads_nvme, c.runtime.device)) {
      // Straight into the gradient chunks: no bucket buffer.
    } else if (n == 1 && !grads_nvme) {
      // One rank, no gradient on nvme: no collective, a bucket buffer is its own receive buffer
      // (its share is filled into the gradients from it); it makes one per bucket up to both
      // counts together (kMaxOneRankBuckets) and no receive buffer.
      r.bucket_count = std::min(nbuckets, kBucketsInFlight + 1 + kReceiveBuffers);
    } else {
      r.bucket_count = std::min(nbuckets, kBucketsInFlight + 1);
      r.receive_count = std::min(nbuckets, kReceiveBuffers);
    }
    r.buckets = sat_mul(r.bucket_count, std::min(bucket, flat), gb);
    r.receive = sat_mul(r.receive_count, std::min(bucket, psize), gb);
  }
  if (stage == 3 && r.layer > 0) {
    r.gathered = sat_mul(2, r.layer, pb);
    r.send = sat_mul(2, std::min(r.layer, psize), pb);
  }
  // finalize() broadcasts rank 0's initial values (FP32) through one device buffer of at most
  // 2^24 elements. (read_state / write_state of a tensor of T elements stage T + its share in
  // FP32 for the call: not counted, the plan does not know tensor sizes.)
  if (n > 1 && c.model.parameters > 0) r.staging = sat_mul(std::min(flat, kXferPiece), 4);
  // Stages 0-1 on a GPU, a hand-in from host memory that is added (train.accumulate > 1) or
  // converted (grad_accum differs from precision.grads) on the device goes through one staging
  // buffer of min(F, B, 64 MiB / grad bytes) elements (the plan counts it when either holds).
  if (stage < 2 && c.runtime.device != DeviceKind::kHost && c.model.parameters > 0 &&
      (c.train.accumulate > 1 || c.precision.accum_dtype() != c.precision.grads))
    r.hand_in_staging = sat_mul(std::min({flat, bucket, kHandInStagingBytes / gb}), gb);
  const PoolPlan pool = plan_pool(c, stage, offload);
  // optimizer.update device: DeviceAdam copies each host-updated chunk to the device and back
  // through one scratch buffer sized to the largest (src/optim/device_adam.cpp); auto on a GPU:
  // the split's share of one, at most tiers.gpu.update_window (src/zero/update_split.hpp).
  const bool split = update_split(c);
  if (c.optimizer.update == OptimizerUpdate::kDevice || split) {
    std::uint64_t e = pool.largest_host_chunk;
    if (split) e = std::min(e, update_window_elements(c.tiers.gpu.update_window, held, pb, e));
    auto pad = [](std::uint64_t b) { return sat_round_up(b, 256); };
    if (e) r.adam_scratch = sat_add(sat_mul(3, pad(4 * e)), pad(e * held), pad(e * pb));
  }
  // State on the gpu with its gradients or parameters elsewhere: the update loop's device slots
  // (registered for the step, as many as tiers.host.buffer_count: its window).
  r.update_slots = sat_mul(pool.device_slot, c.tiers.host.buffer_count);
  return r;
}

}  // namespace strata
