// The rank's layout: the partition, the chunk grid and the state buffers (see engine_layout.hpp).
#include "zero/engine_layout.hpp"

#include <cmath>
#include <cstring>

#include "core/checked_math.hpp"
#include "core/numeric.hpp"
#include "device/pinned_pool.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "strata/io_file.hpp"
#include "strata/plan.hpp"
#include "tier/scratch_arena.hpp"

namespace strata::zero {
namespace {

constexpr std::uint64_t kAlign = 4096;

// The leading elements of `count` that a placement puts off the gpu (rounded up to 1024).
std::size_t leading(const OffloadTarget& t, std::size_t count) {
  if (t.tier == Tier::kGpu || t.fraction <= 0 || count == 0) return 0;
  const double want = std::ceil(std::min(1.0, t.fraction) * static_cast<double>(count));
  return std::min<std::size_t>(count, round_up(static_cast<std::uint64_t>(want), 1024));
}

std::vector<std::pair<std::size_t, GroupId>> make_group_runs(const Partition& part,
                                                             const std::vector<GroupId>& groups) {
  std::vector<std::pair<std::size_t, GroupId>> runs;
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const std::size_t b = i == 0 ? 0 : part.offset(i);
    if (runs.empty() || runs.back().second != groups[i]) runs.push_back({b, groups[i]});
  }
  if (runs.empty()) runs.push_back({0, 0});
  return runs;
}

std::chrono::milliseconds timeout_of(const Config& c) {
  return std::chrono::milliseconds(
      static_cast<std::int64_t>(std::max(1.0, c.runtime.collective_timeout_s) * 1000.0));
}

}  // namespace

EngineLayout::EngineLayout(const Config& config, int rank, int world, std::vector<TensorSpec> specs,
                           std::vector<GroupId> tensor_groups, RankStorage& storage)
    : cfg_(config),
      rank_(rank),
      world_(world),
      stage_(config.zero.stage),
      param_dtype_(config.precision.params),
      grad_dtype_(config.precision.accum_dtype()),
      hand_in_dtype_(config.precision.grads),
      param_elem_(dtype_size(param_dtype_)),
      grad_elem_(dtype_size(grad_dtype_)),
      hand_in_elem_(dtype_size(hand_in_dtype_)),
      timeout_(timeout_of(config)),
      partition_(
          std::make_unique<const Partition>(std::move(specs), world, config.zero.sub_group_size)),
      own_begin_(partition_->partition_begin(rank)),
      partition_size_(partition_->partition_size()),
      opt_begin_(stage_ == 0 ? 0 : own_begin_),
      opt_count_(stage_ == 0 ? partition_->flat_size() : partition_size_),
      group_runs_(make_group_runs(*partition_, tensor_groups)),
      store_([&]() -> TierStore& {
        const bool cuda = storage.device().kind() == DeviceKind::kCuda;
        cut_chunks(config.tiers.host.buffer_size, cuda);
        storage.open(storage_needs(cuda));
        return storage.store();
      }()) {
  register_buffers();
}

// The chunk grid: sub-groups cut at the placement boundaries and at the chunk capacity (what one
// pinned buffer stages, when anything is staged). REQUIRES: called once, by the constructor.
void EngineLayout::cut_chunks(std::uint64_t buffer_size, bool cuda) {
  const std::size_t count = opt_count_;
  const std::size_t opt_on = leading(cfg_.offload.optimizer, count);
  const std::size_t grad_on = stage_ >= 2 ? leading(cfg_.offload.gradients, count) : 0;
  const std::size_t param_on = stage_ == 3 ? leading(cfg_.offload.params, count) : 0;
  const bool staging = cuda || opt_on || grad_on || param_on;
  chunk_cap_ = staging ? staged_chunk_cap(buffer_size) : std::max<std::size_t>(count, 1);
  for (const Range& sg : partition_->sub_groups(0, count)) {
    for (std::size_t b = sg.begin; b < sg.end();) {
      std::size_t e = std::min(sg.end(), b + chunk_cap_);
      for (std::size_t cut : {opt_on, grad_on, param_on})
        if (cut > b && cut < e) e = cut;
      Chunk c;
      c.r = {b, e - b};
      c.opt_tier = b < opt_on ? cfg_.offload.optimizer.tier : Tier::kGpu;
      c.grad_tier = b < grad_on ? cfg_.offload.gradients.tier : Tier::kGpu;
      c.param_tier = b < param_on ? cfg_.offload.params.tier : Tier::kGpu;
      chunks_.push_back(c);
      b = e;
    }
  }
}

// The most elements n with round_up(12n) + round_up(n × grad) + round_up(n × param) <= the
// buffer (master | m | v + gradients + parameters, each padded to 4096 B), cut to a multiple of
// 64 (1024 when large).
std::size_t EngineLayout::staged_chunk_cap(std::uint64_t buf) const {
  auto fits = [&](std::uint64_t n) {
    return round_up(12 * n, kAlign) + round_up(n * grad_elem_, kAlign) +
               round_up(n * param_elem_, kAlign) <=
           buf;
  };
  std::uint64_t lo = 0, hi = buf;
  while (lo < hi) {
    const std::uint64_t mid = (lo + hi + 1) / 2;
    if (fits(mid))
      lo = mid;
    else
      hi = mid - 1;
  }
  const std::uint64_t cap = lo >= 1024 ? lo / 1024 * 1024 : lo >= 64 ? lo / 64 * 64 : lo;
  if (cap == 0)
    fail(ErrorCode::kInvalidArgument,
         strcat(
             "engine: tiers.host.buffer_size ", buf, " bytes is below the minimum of ", 3 * kAlign,
             " bytes: one pinned buffer stages a chunk (FP32 master and moments, gradients, "
             "parameters: ",
             12 + grad_elem_ + param_elem_, " B per element) in 3 regions of 4096-byte alignment"));
  return static_cast<std::size_t>(cap);
}

// The NVMe slots of the speculative update's pending versions (speculator.cpp): the
// optimizer state on NVMe and, at stage 3, the parameters on NVMe, where the update can be
// speculated (stages 2-3, host-updated state, no gradients on NVMe), within
// optimizer.speculation_budget. strata plan counts the same (plan/layout.cpp speculation_room).
std::uint64_t EngineLayout::speculation_nvme_bytes(std::uint64_t nvme_opt_bytes) const {
  const Config& c = config();
  if (c.optimizer.overlap == OptimizerOverlap::kOff || stage_ < 2 ||
      c.optimizer.update == OptimizerUpdate::kDevice)
    return 0;
  std::uint64_t bytes = nvme_opt_bytes;
  for (const Chunk& ch : chunks_) {
    if (ch.grad_tier == Tier::kNvme) return 0;
    if (stage_ == 3 && ch.param_tier == Tier::kNvme)
      bytes += round_up(ch.r.count * param_elem_, kAlign);
  }
  if (c.optimizer.speculation_budget > 0) bytes = std::min(bytes, c.optimizer.speculation_budget);
  return bytes;
}

StorageNeeds EngineLayout::storage_needs(bool cuda) const {
  StorageNeeds n;
  std::uint64_t need = 0;
  for (const Chunk& c : chunks_) {
    const std::uint64_t e = c.r.count;
    const bool grads_cpu = stage_ >= 2 && c.grad_tier == Tier::kCpu;
    const bool params_cpu = stage_ == 3 && c.param_tier == Tier::kCpu;
    if (c.opt_tier != Tier::kGpu) {  // the update computes on the host
      // With overlap: on, a speculative update stages its pending state and parameters too
      // (OptimizerStep::can_speculate), also where they live in host memory. Not for auto: there
      // the buffers stay sized to the serial step (a chunk of host-resident state whose pending
      // copies would not fit is updated serially; docs/offload.md, "The speculative update").
      const bool spec = stage_ >= 2 && cfg_.optimizer.overlap == OptimizerOverlap::kOn;
      std::uint64_t slot = c.opt_tier == Tier::kNvme || spec ? round_up(12 * e, kAlign) : 0;
      if (!grads_cpu) slot += round_up(e * grad_elem_, kAlign);
      if (!params_cpu || spec) slot += round_up(e * param_elem_, kAlign);
      need = std::max(need, slot);
    }
    if (!grads_cpu) need = std::max(need, round_up(e * grad_elem_, kAlign));  // statistics pass
    if (c.opt_tier == Tier::kNvme) n.nvme_bytes += round_up(12 * e, kAlign);
    if (c.opt_tier == Tier::kNvme) n.nvme_opt_bytes += round_up(12 * e, kAlign);
    if (stage_ >= 2 && c.grad_tier == Tier::kNvme) n.nvme_bytes += round_up(e * grad_elem_, kAlign);
    if (stage_ == 3 && c.param_tier == Tier::kNvme)
      n.nvme_bytes += round_up(e * param_elem_, kAlign);
  }
  n.nvme_pending_bytes = speculation_nvme_bytes(n.nvme_opt_bytes);
  const bool offloaded = std::any_of(chunks_.begin(), chunks_.end(), [&](const Chunk& c) {
    return c.opt_tier != Tier::kGpu || (stage_ >= 2 && c.grad_tier != Tier::kGpu) ||
           (stage_ == 3 && c.param_tier != Tier::kGpu);
  });
  n.pool = offloaded || cuda;
  if (n.pool) {
    // tiers.host.buffer_size, unless the whole state is smaller than one chunk of it (then the
    // buffers are sized to the need).
    const bool capped = std::any_of(chunks_.begin(), chunks_.end(),
                                    [&](const Chunk& c) { return c.r.count == chunk_cap_; });
    const std::uint64_t size = cfg_.tiers.host.buffer_size;
    n.pool_buffer_size =
        capped ? size : std::min<std::uint64_t>(size, std::max<std::uint64_t>(need, kAlign));
    n.pool_buffers = static_cast<std::uint32_t>(std::min<std::size_t>(
        cfg_.tiers.host.buffer_count, std::max<std::size_t>(1, chunks_.size())));
  }
  n.movers = std::clamp<std::uint32_t>(n.pool_buffers, 2, 4);
  return n;
}

void EngineLayout::register_buffers() {
  const std::size_t flat = flat_size();
  if (stage_ < 3 && flat) {
    params_id_ = add_buffer("params", flat * param_elem_, Tier::kGpu, BufferKind::kParams);
    params_dev_ = static_cast<unsigned char*>(
        store().acquire(params_id_, Tier::kGpu, Access::kRead, timeout_));
  }
  if (stage_ < 2 && flat) {
    grads_id_ = add_buffer("grads", flat * grad_elem_, Tier::kGpu, BufferKind::kGrads);
    grads_dev_ = static_cast<unsigned char*>(
        store().acquire(grads_id_, Tier::kGpu, Access::kRead, timeout_));
  }
  // State in memory whose master weights are the parameters: opt holds the moments only.
  const bool alias =
      flat && master_in_params(cfg_, stage_, cfg_.offload.optimizer, store().device().kind());
  for (std::size_t k = 0; k < chunks_.size(); ++k) {
    Chunk& c = chunks_[k];
    if (alias && c.opt_tier != Tier::kNvme) {
      c.master_in_params = true;
      c.params = params_id_;
      c.master_at = (opt_begin_ + c.r.begin) * sizeof(float);
    }
    c.opt = add_buffer(strcat("opt.", k), (c.master_in_params ? 8 : 12) * c.r.count, c.opt_tier,
                       BufferKind::kOptimizer, cfg_.offload.optimizer.pin_memory);
    if (stage_ >= 2)
      c.grad = add_buffer(strcat("grad.", k), c.r.count * grad_elem_, c.grad_tier,
                          BufferKind::kGrads, cfg_.offload.gradients.pin_memory);
    if (stage_ == 3)
      c.param = add_buffer(strcat("param.", k), c.r.count * param_elem_, c.param_tier,
                           BufferKind::kParams, cfg_.offload.params.pin_memory);
  }
}

BufferId EngineLayout::add_buffer(const std::string& name, std::uint64_t bytes, Tier home,
                                  BufferKind kind, bool pinned) {
  BufferSpec spec;
  spec.name = name;
  spec.bytes = bytes;
  spec.dtype = kind == BufferKind::kOptimizer ? DType::kFp32
               : kind == BufferKind::kGrads   ? grad_dtype_
                                              : param_dtype_;
  spec.home = home;
  spec.allowed = {home};
  spec.pinned = pinned && home == Tier::kCpu;
  const BufferId id = store().register_buffer(spec);
  kinds_.emplace_back(id, kind);
  return id;
}

void EngineLayout::initialize(const FlatValues& values) const {
  if (stage_ < 3) write_initial(params_id_, 0, flat_size(), param_dtype_, values);
  for (const Chunk& c : chunks_) {
    if (stage_ == 3)
      write_initial(c.param, own_begin_ + c.r.begin, c.r.count, param_dtype_, values);
    if (!c.master_in_params)  // (else the parameters written above: FP32, the same values)
      write_initial(c.opt, opt_begin_ + c.r.begin, c.r.count, DType::kFp32, values);  // the master
  }
}

// Flat elements [first, first + count) into the first count elements of buffer `id` (`dtype`).
void EngineLayout::write_initial(BufferId id, std::size_t first, std::size_t count, DType dtype,
                                 const FlatValues& values) const {
  constexpr std::size_t kPiece = 1 << 20;
  const std::size_t es = dtype_size(dtype);
  const bool nvme = store().info(id).home == Tier::kNvme;
  IoBuffer whole;  // nvme: written whole, once (the rest of it stays zero)
  if (nvme && count) whole = IoBuffer::allocate(store().padded_bytes(id), HugePageMode::kNone);
  std::vector<float> vals;
  std::vector<unsigned char> tmp;
  for (std::size_t b = 0; b < count; b += kPiece) {
    const std::size_t n = std::min(kPiece, count - b);
    vals.resize(n);
    values(first + b, vals);
    if (!nvme) tmp.resize(n * es);
    unsigned char* dst = nvme ? whole.bytes() + b * es : tmp.data();
    for (std::size_t i = 0; i < n; ++i) store_elem(dst, i, dtype, vals[i]);
    if (!nvme) store().write(id, b * es, n * es, dst, Tier::kCpu).wait(timeout_);
  }
  if (nvme && count) store().write(id, 0, 0, whole.data(), Tier::kCpu).wait(timeout_);
}

TensorShare EngineLayout::share(TensorId id) const {
  const std::size_t n = tensor(id).numel, off = partition_->offset(id);
  TensorShare s;
  s.local = {off, n};
  if (stage_ > 0) {
    s.counts = partition_->counts_in(off, off + n);
    const std::size_t mine = s.counts[static_cast<std::size_t>(rank_)];
    s.local = {mine ? std::max(off, own_begin_) - own_begin_ : 0, mine};
  }
  s.from = s.local.count ? opt_begin_ + s.local.begin - off : 0;
  return s;
}

const Chunk& EngineLayout::chunk_at(std::size_t element) const {
  auto it = std::upper_bound(chunks_.begin(), chunks_.end(), element,
                             [](std::size_t x, const Chunk& c) { return x < c.r.begin; });
  if (it == chunks_.begin())
    fail(ErrorCode::kInternal, strcat("engine: no chunk holds element ", element));
  return *std::prev(it);
}

bool EngineLayout::any_chunk_on(Tier opt_tier) const {
  return std::any_of(chunks_.begin(), chunks_.end(),
                     [&](const Chunk& c) { return c.opt_tier == opt_tier; });
}

bool EngineLayout::params_are_master() const {
  return !chunks_.empty() && std::all_of(chunks_.begin(), chunks_.end(),
                                         [](const Chunk& c) { return c.master_in_params; });
}

bool EngineLayout::any_grad_chunk_on(Tier grad_tier) const {
  return std::any_of(chunks_.begin(), chunks_.end(),
                     [&](const Chunk& c) { return c.grad_tier == grad_tier; });
}

StorageReport EngineLayout::report(RankStorage& storage, const ScratchArena& scratch) const {
  StorageReport r;
  const TierStore& s = storage.store();
  for (const auto& [id, kind] : kinds_) {
    const BufferInfo info = s.info(id);
    r.bytes[static_cast<int>(info.home)][static_cast<int>(kind)] += s.padded_bytes(id);
  }
  const ScratchStats sc = scratch.stats();
  r.bytes[static_cast<int>(Tier::kGpu)][static_cast<int>(BufferKind::kRuntime)] =
      sc.live_bytes + sc.kept_bytes;
  if (const PinnedPool* p = storage.pool())
    r.pool = std::uint64_t(p->buffer_count()) * p->buffer_size();
  for (Tier t : {Tier::kGpu, Tier::kCpu, Tier::kNvme}) {
    const TierUsage u = s.usage(t);
    r.used[static_cast<int>(t)] = u.used;
    r.budget[static_cast<int>(t)] = u.budget;
  }
  return r;
}

void put_bytes(TierStore& store, BufferId id, std::uint64_t offset, std::uint64_t bytes,
               const void* host, std::chrono::milliseconds timeout) {
  if (bytes == 0) return;
  const BufferInfo info = store.info(id);
  if (info.home != Tier::kNvme) {
    store.write(id, offset, bytes, host, Tier::kCpu).wait(timeout);
    return;
  }
  IoBuffer buf = IoBuffer::allocate(store.padded_bytes(id), HugePageMode::kNone);  // zero padding
  if (offset != 0 || bytes != info.bytes)
    store.read(id, 0, 0, buf.data(), Tier::kCpu, true).wait(timeout);
  std::memcpy(buf.bytes() + offset, host, bytes);
  store.write(id, 0, 0, buf.data(), Tier::kCpu).wait(timeout);
}

void get_bytes(TierStore& store, BufferId id, std::uint64_t offset, std::uint64_t bytes, void* host,
               std::chrono::milliseconds timeout) {
  if (bytes == 0) return;
  store.read(id, offset, bytes, host, Tier::kCpu).wait(timeout);
}

void wait_all(std::vector<Transfer>& transfers, std::chrono::milliseconds timeout) {
  std::exception_ptr first;
  for (Transfer& t : transfers) {
    try {
      t.wait(timeout);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

void copy_sync(Stream& stream, void* dst, const void* src, std::size_t bytes,
               std::chrono::milliseconds timeout) {
  stream.copy(dst, src, bytes, timeout);
}

}  // namespace strata::zero
