// Adam over the rank's chunk grid, and the gradient statistics (see optimizer_step.hpp).
#include "zero/optimizer_step.hpp"

#include <algorithm>
#include <bit>
#include <cstring>

#include "core/numeric.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"
#include "strata/plan.hpp"
#include "zero/clock.hpp"

namespace strata::zero {

// ---- gradient statistics over pieces

bool AheadStats::covers(std::size_t begin, std::size_t n) const {
  constexpr std::size_t kTile = CpuAdam::kStatsTileElems;
  if (n == 0) return true;
  if (begin % kTile != 0 || begin + n > total) return false;
  if ((begin + n) % kTile != 0 && begin + n != total) return false;
  for (std::size_t t = begin / kTile; t < CpuAdam::tiles_of(begin + n); ++t)
    if (known[t] == 0) return false;
  return true;
}

StatsStream::StatsStream(CpuAdam& adam, DType dtype, float scale, const AheadStats* ahead)
    : adam_(adam),
      dtype_(dtype),
      elem_bytes_(dtype_size(dtype)),
      scale_(scale),
      ahead_(ahead),
      carry_(CpuAdam::kStatsTileElems * dtype_size(dtype)) {}

// pos_ % kStatsTileElems == carried_ throughout: whole tiles start at pos_ when nothing is carried.
void StatsStream::feed(const void* grads, std::size_t n) {
  constexpr std::size_t kTile = CpuAdam::kStatsTileElems;
  const auto* p = static_cast<const unsigned char*>(grads);
  if (carried_) {  // complete the carried partial tile first
    const std::size_t take = std::min(kTile - carried_, n);
    std::memcpy(carry_.data() + carried_ * elem_bytes_, p, take * elem_bytes_);
    carried_ += take;
    pos_ += take;
    p += take * elem_bytes_;
    n -= take;
    if (carried_ < kTile) return;
    acc_ = adam_.grad_stats_continue(acc_, carry_.data(), dtype_, kTile, scale_);
    carried_ = 0;
  }
  const std::size_t whole = n / kTile * kTile;
  if (whole) feed_tiles(p, whole);
  pos_ += whole;
  if (n > whole) {
    std::memcpy(carry_.data(), p + whole * elem_bytes_, (n - whole) * elem_bytes_);
    carried_ = n - whole;
    pos_ += carried_;
  }
}

// n elements (whole tiles) at p, from pos_: runs of tiles not known ahead are computed, the known
// ones added in their place.
void StatsStream::feed_tiles(const unsigned char* p, std::size_t n) {
  constexpr std::size_t kTile = CpuAdam::kStatsTileElems;
  if (!ahead_) {
    acc_ = adam_.grad_stats_continue(acc_, p, dtype_, n, scale_);
    return;
  }
  const std::size_t tiles = n / kTile, tile0 = pos_ / kTile;
  std::size_t first = 0;  // the first tile of the run not known ahead
  for (std::size_t t = 0; t <= tiles; ++t) {
    const bool known = t < tiles && ahead_->known[tile0 + t] != 0;
    if (t < tiles && !known) continue;
    if (t > first)
      acc_ = adam_.grad_stats_continue(acc_, p + first * kTile * elem_bytes_, dtype_,
                                       (t - first) * kTile, scale_);
    if (known) add_known(tile0 + t);
    first = t + 1;
  }
}

void StatsStream::add_known(std::size_t tile) {
  acc_.finite = acc_.finite && ahead_->known[tile] == 1;
  acc_.sum_sq += ahead_->sums[tile];
  ++known_used_;
}

void StatsStream::skip(std::size_t n) {
  if (n == 0) return;
  if (!ahead_ || carried_ != 0 || !ahead_->covers(pos_, n))
    fail(ErrorCode::kInternal,
         strcat("engine: statistics skipped over [", pos_, ", ", pos_ + n, ") not known ahead"));
  for (std::size_t t = pos_ / CpuAdam::kStatsTileElems; t < CpuAdam::tiles_of(pos_ + n); ++t)
    add_known(t);
  pos_ += n;
}

AdamGradStats StatsStream::finish() {
  if (carried_) acc_ = adam_.grad_stats_continue(acc_, carry_.data(), dtype_, carried_, scale_);
  carried_ = 0;
  return acc_;
}

// ---- construction

namespace {
std::unique_ptr<DeviceAdam> make_device_adam(const EngineLayout& l, TierStore& store,
                                             bool update_on_device) {
  if (!update_on_device && !l.any_chunk_on(Tier::kGpu)) return nullptr;
  if (l.rank() == 0 && update_on_device)
    log_info("engine: optimizer update on ", store.device().name());
  return std::make_unique<DeviceAdam>(store.device(), l.config().runtime.cpu_threads, l.timeout());
}

std::size_t largest_chunk(const EngineLayout& l) {
  std::size_t m = 0;
  for (const Chunk& c : l.chunks()) m = std::max(m, c.r.count);
  return m;
}
}  // namespace

OptimizerStep::OptimizerStep(const EngineLayout& layout, TierStore& store,
                             const std::vector<ParamGroupOptions>& groups)
    : layout_(layout),
      store_(store),
      groups_(groups),
      update_on_device_(layout.config().optimizer.update == strata::OptimizerUpdate::kDevice),
      adam_(std::make_unique<CpuAdam>(layout.config().runtime.cpu_threads)),
      device_adam_(make_device_adam(layout, store, update_on_device_)),
      grads_on_nvme_(layout.stage() >= 2 && layout.any_grad_chunk_on(Tier::kNvme)) {
  // optimizer.update auto: host-state chunks shared with a GPU (the host device: the CPU alone).
  if (layout.config().optimizer.update == strata::OptimizerUpdate::kAuto &&
      store.device().kind() == DeviceKind::kCuda && !layout.chunks().empty())
    split_ = std::make_unique<UpdateSplit>(
        store.device(), layout.config().runtime.cpu_threads, layout.timeout(),
        update_window_elements(layout.config().tiers.gpu.update_window, layout.grad_elem_bytes(),
                               layout.param_elem_bytes(), largest_chunk(layout)));
}

OptimizerStep::~OptimizerStep() = default;

void OptimizerStep::force_update_split(std::function<double(std::size_t)> share) {
  split_.reset();
  if (share)
    split_ =
        std::make_unique<UpdateSplit>(store_.device(), layout_.config().runtime.cpu_threads,
                                      layout_.timeout(), largest_chunk(layout_), std::move(share));
}

// ---- the loops' items

tier::StreamOptions OptimizerStep::stream_options(tier::Where where, const char* what) const {
  tier::StreamOptions o;
  o.where = where;
  o.window = layout_.config().tiers.host.buffer_count;
  o.pipelined = pipelined_;
  o.stage_device_memory = stage_device_memory_;
  o.timeout = layout_.timeout();
  o.what = strcat("engine rank ", layout_.rank(), " ", what);
  return o;
}

// One item per chunk whose Adam runs on the host (device = false) or on the device (true):
// master | m | v (read and written), the chunk's gradients (read), its parameters (written; read
// too where they are the master: m | v in the first part then).
tier::StreamItem OptimizerStep::chunk_item(const Chunk& c) const {
  const std::size_t ges = layout_.grad_elem_bytes(), pes = layout_.param_elem_bytes();
  const std::size_t opt_begin = layout_.opt_begin();
  tier::StreamItem it;
  it.parts.push_back({c.opt, 0, 0, true, true});
  if (layout_.stage() < 2)
    it.parts.push_back(
        {layout_.grads_buffer(), (opt_begin + c.r.begin) * ges, c.r.count * ges, true, false});
  else
    it.parts.push_back({c.grad, 0, 0, true, false});
  if (layout_.stage() < 3)
    it.parts.push_back({layout_.params_buffer(), (opt_begin + c.r.begin) * pes, c.r.count * pes,
                        c.master_in_params, true});
  else
    it.parts.push_back({c.param, 0, 0, false, true});
  return it;
}

// The chunks whose Adam runs on the device (true) or the host, in order, less those `done`.
std::vector<const Chunk*> OptimizerStep::update_chunks(bool device,
                                                       const std::vector<bool>& done) const {
  std::vector<const Chunk*> of;
  const auto& chunks = layout_.chunks();
  for (std::size_t i = 0; i < chunks.size(); ++i)
    if ((chunks[i].opt_tier == Tier::kGpu) == device && (done.empty() || !done[i]))
      of.push_back(&chunks[i]);
  return of;
}

std::vector<tier::StreamItem> OptimizerStep::update_items(bool device,
                                                          const std::vector<bool>& done) const {
  std::vector<tier::StreamItem> items;
  for (const Chunk* c : update_chunks(device, done)) items.push_back(chunk_item(*c));
  return items;
}

// The rank's gradient range in chunk-sized pieces (stages 0-1: of the flat gradients; at stage 0
// the rank's own partition, whose statistics it contributes).
std::vector<tier::StreamItem> OptimizerStep::stats_items() const {
  std::vector<tier::StreamItem> items;
  if (layout_.stage() >= 2) {
    for (const Chunk& c : layout_.chunks()) items.push_back({{{c.grad, 0, 0, true, false}}});
    return items;
  }
  // Pieces no longer than the longest chunk: what the pool's buffers were sized to stage (the
  // chunk capacity, or less when sub-groups cut every chunk shorter and the pool fits the need).
  const std::size_t cap = std::max<std::size_t>(1, largest_chunk(layout_));
  const std::size_t ges = layout_.grad_elem_bytes(), psize = layout_.partition_size();
  for (std::size_t b = 0; b < psize; b += cap) {
    const std::size_t n = std::min(cap, psize - b);
    items.push_back(
        {{{layout_.grads_buffer(), (layout_.own_begin() + b) * ges, n * ges, true, false}}});
  }
  return items;
}

// ---- the statistics

// The statistics pass: streamed chunk by chunk through host staging (gradients in device memory
// are copied to pinned buffers, those on NVMe read back), bitwise what one pass over the whole
// range gives. On the host-emulated device the device memory is read in place.
AdamGradStats OptimizerStep::grad_stats(float inv) {
  if (gating_) return grad_stats_in_place(inv);
  const AheadStats* ahead = usable_ahead(inv);
  StatsStream stats(*adam_, layout_.grad_dtype(), inv, ahead);
  const auto all = stats_items();
  const std::vector<std::size_t> at = stats_offsets(all);
  // The pieces every tile of which the speculation computed are not read at all: skipped in
  // their place in the order (skip_before[j]: elements skipped before the j-th piece read).
  std::vector<tier::StreamItem> items;
  std::vector<std::size_t> skip_before{0};
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (ahead && ahead->covers(at[i], at[i + 1] - at[i])) {
      skip_before.back() += at[i + 1] - at[i];
      continue;
    }
    items.push_back(all[i]);
    skip_before.push_back(0);
  }
  const tier::Where where = store_.pool() ? tier::Where::kHost : tier::Where::kDevice;
  if (where == tier::Where::kDevice && store_.device().kind() != DeviceKind::kHost)
    fail(ErrorCode::kInternal,
         "engine: gradient statistics in device memory need the host-emulated device");
  const std::size_t ges = layout_.grad_elem_bytes();
  tier::run_stream(
      store_, items,
      [&](std::size_t i, std::span<void* const> v) {
        const tier::StreamPart& p = items[i].parts[0];
        stats.skip(skip_before[i]);
        stats.feed(v[0], (p.bytes ? p.bytes : store_.info(p.id).bytes) / ges);
      },
      stream_options(where, "gradient statistics"));
  stats.skip(skip_before.back());
  const AdamGradStats r = stats.finish();
  tiles_known_ahead_ += stats.known_used();
  return r;
}

// The same over gradients that are viewed in place (gated(): no slot, nothing moves): each piece
// is pinned where it lives for as long as it is read.
AdamGradStats OptimizerStep::grad_stats_in_place(float inv) {
  const AheadStats* ahead = usable_ahead(inv);
  StatsStream stats(*adam_, layout_.grad_dtype(), inv, ahead);
  const std::size_t ges = layout_.grad_elem_bytes();
  const auto items = stats_items();
  const std::vector<std::size_t> at = stats_offsets(items);
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (ahead && ahead->covers(at[i], at[i + 1] - at[i])) {
      stats.skip(at[i + 1] - at[i]);
      continue;
    }
    const tier::StreamPart& p = items[i].parts[0];
    const BufferInfo info = store_.info(p.id);
    const auto* base = static_cast<const unsigned char*>(
        store_.acquire(p.id, info.home, Access::kRead, layout_.timeout()));
    try {
      stats.feed(base + p.offset, (p.bytes ? p.bytes : info.bytes - p.offset) / ges);
    } catch (...) {
      store_.release(p.id, info.home);
      throw;
    }
    store_.release(p.id, info.home);
  }
  const AdamGradStats r = stats.finish();
  tiles_known_ahead_ += stats.known_used();
  return r;
}

// Where each statistics piece begins in the rank's gradient range (elements), and the range's end
// last.
std::vector<std::size_t> OptimizerStep::stats_offsets(
    const std::vector<tier::StreamItem>& items) const {
  const std::size_t ges = layout_.grad_elem_bytes();
  std::vector<std::size_t> at{0};
  for (const tier::StreamItem& it : items) {
    const tier::StreamPart& p = it.parts[0];
    at.push_back(at.back() + (p.bytes ? p.bytes : store_.info(p.id).bytes - p.offset) / ges);
  }
  return at;
}

// The statistics computed ahead, if they were computed for this scale.
const AheadStats* OptimizerStep::usable_ahead(float inv) const {
  const AheadStats& a = ahead_stats_;
  if (a.known.empty() || std::bit_cast<std::uint32_t>(a.inv) != std::bit_cast<std::uint32_t>(inv))
    return nullptr;
  return &a;
}

// On the speculation thread: the statistics of the tiles that lie whole inside chunk ci (its
// gradient at `grad`, host memory), for `inv`. Stages 2-3: the statistics' pieces are the chunks.
void OptimizerStep::compute_ahead(std::size_t ci, const void* grad, float inv) {
  constexpr std::size_t kTile = CpuAdam::kStatsTileElems;
  if (layout_.stage() < 2) return;
  AheadStats& a = ahead_stats_;
  if (a.known.empty() || std::bit_cast<std::uint32_t>(a.inv) != std::bit_cast<std::uint32_t>(inv)) {
    a = AheadStats{};
    a.inv = inv;
    a.offsets = stats_offsets(stats_items());
    a.total = a.offsets.back();
    a.sums.assign(CpuAdam::tiles_of(a.total), 0.0);
    a.known.assign(a.sums.size(), 0);
  }
  const std::size_t begin = a.offsets[ci], end = a.offsets[ci + 1];
  const std::size_t first = (begin + kTile - 1) / kTile;
  const std::size_t stop = end == a.total ? CpuAdam::tiles_of(end) : end / kTile;  // tiles
  if (stop <= first) return;
  const std::size_t n = std::min(stop * kTile, end) - first * kTile;
  std::vector<std::uint8_t> finite(stop - first);
  const auto* g =
      static_cast<const unsigned char*>(grad) + (first * kTile - begin) * layout_.grad_elem_bytes();
  adam_->grad_stats_tiles(g, layout_.grad_dtype(), n, a.sums.data() + first, finite.data(), inv);
  for (std::size_t t = first; t < stop; ++t) a.known[t] = finite[t - first] ? 1 : 2;
}

// ---- the update

// Adam on one chunk: master | m | v at `v`, its gradients, its parameters written in the model
// dtype. One call per parameter group the chunk spans (usually one): element-wise, so the cut
// changes no bit. Where the tensors' step counts differ (skip_gradient), a group's run is cut
// further at the tensors whose count differs from their neighbour's; a skipped tensor keeps its
// state and gets its parameters from its master. on_device: the arrays are device memory (state
// placed on gpu). On the device every run's update is queued on DeviceAdam's stream and the chunk
// waits once (F9).
void OptimizerStep::adam_chunk(const Chunk& c, const checkpoint::StateView& v, const void* grad,
                               void* param_copy, bool on_device, float grad_scale,
                               const checkpoint::StateView* out) {
  const ChunkArrays a{v, static_cast<const unsigned char*>(grad),
                      static_cast<unsigned char*>(param_copy), out};
  const std::size_t flat_b = layout_.opt_begin() + c.r.begin;
  const bool queued = on_device || update_on_device_;
  // The elements [0, dev_n) the device's Adam updates beside the CPU (host state: UpdateSplit).
  const std::size_t dev_n = split_ && !queued ? split_->device_share(chunk_index(c), c.r.count) : 0;
  auto pass = [&](bool device_part) {
    auto group = [&](std::size_t o, std::size_t n, GroupId gid) {
      const AdamParams hp = group_params(gid);
      auto run = [&](std::size_t ro, std::size_t rn, std::int64_t step) {
        // [ro, cut) on the device, the rest on the CPU (a skipped run: all on the CPU).
        const std::size_t cut = step == 0 ? ro : std::clamp(dev_n, ro, ro + rn);
        if (device_part) {
          if (cut > ro)
            split_->device().enqueue(hp, chunk_tensors(a, ro, cut - ro), options(step, grad_scale));
        } else if (cut < ro + rn) {
          run_part(hp, a, cut, ro + rn - cut, step, grad_scale, on_device);
        }
      };
      if (counts_.empty()) return run(o, n, adam_step_ + ahead_);  // the common case: one count
      for_each_count_run(flat_b + o, n, [&](std::size_t ro, std::size_t rn, std::int64_t step) {
        run(o + ro, rn, step);
      });
    };
    layout_.for_each_group_run(flat_b, c.r.count, group);
  };
  try {
    if (split_ && !queued) {
      split_->run(
          dev_n, c.r.count, [&] { pass(true); }, [&] { pass(false); });
    } else {
      pass(false);
    }
  } catch (...) {
    if (queued) device_adam_->wait();  // the runs queued so far still use the chunk's arrays
    throw;
  }
  if (queued) device_adam_->wait();
}

AdamParams OptimizerStep::group_params(GroupId gid) const {
  AdamParams hp = AdamParams::from_config(layout_.config().optimizer);
  hp.lr = groups_[gid].lr;
  hp.weight_decay = groups_[gid].weight_decay;
  hp.beta1 = groups_[gid].beta1.value_or(hp.beta1);
  hp.beta2 = groups_[gid].beta2.value_or(hp.beta2);
  hp.eps = groups_[gid].eps.value_or(hp.eps);
  return hp;
}

// Elements [ro, ro + rn) of a chunk's arrays (out of place where a.out is given).
AdamTensors OptimizerStep::chunk_tensors(const ChunkArrays& a, std::size_t ro,
                                         std::size_t rn) const {
  AdamTensors t;
  t.param = a.v.master + ro;
  t.exp_avg = a.v.exp_avg + ro;
  t.exp_avg_sq = a.v.exp_avg_sq + ro;
  t.grad = a.grad + ro * layout_.grad_elem_bytes();
  t.grad_dtype = layout_.grad_dtype();
  t.param_copy = a.param_copy ? a.param_copy + ro * layout_.param_elem_bytes() : nullptr;
  t.param_copy_dtype = layout_.param_dtype();
  t.n = rn;
  if (a.out) {
    t.param_out = a.out->master + ro;
    t.exp_avg_out = a.out->exp_avg + ro;
    t.exp_avg_sq_out = a.out->exp_avg_sq + ro;
  }
  return t;
}

// A run of one step count on the CPU (or queued on the device for gpu-placed state / update:
// device); step 0: skipped (out of place: its state copied over to the pending version).
void OptimizerStep::run_part(const AdamParams& hp, const ChunkArrays& a, std::size_t ro,
                             std::size_t rn, std::int64_t step, float grad_scale, bool on_device) {
  const AdamTensors t = chunk_tensors(a, ro, rn);
  if (step != 0) return adam_run(hp, t, step, grad_scale, on_device);
  if (a.out) {
    std::memcpy(t.param_out, t.param, rn * sizeof(float));
    std::memcpy(t.exp_avg_out, t.exp_avg, rn * sizeof(float));
    std::memcpy(t.exp_avg_sq_out, t.exp_avg_sq, rn * sizeof(float));
  }
  params_from_master(t, on_device);
}

AdamStepOptions OptimizerStep::options(std::int64_t step, float grad_scale) const {
  return AdamStepOptions{step, grad_scale, false, static_cast<float>(layout_.world())};
}

void OptimizerStep::adam_run(const AdamParams& hp, const AdamTensors& t, std::int64_t step,
                             float grad_scale, bool on_device) {
  const AdamStepOptions so = options(step, grad_scale);  // g / N, as torch
  if (on_device)
    device_adam_->enqueue_resident(hp, t, so);  // adam_chunk waits once for the whole chunk
  else if (update_on_device_)
    device_adam_->enqueue(hp, t, so);
  else
    adam_->step(hp, t, so);
}

// A skipped run: the state stays; the parameters the loop writes back are the master's, rounded
// to the model dtype (what they already were). Device memory of a CUDA device goes through the
// host.
void OptimizerStep::params_from_master(const AdamTensors& t, bool on_device) {
  if (!t.param_copy) return;  // the parameters are the master
  const DType dt = t.param_copy_dtype;
  if (!on_device || store_.device().kind() == DeviceKind::kHost) {
    for (std::size_t i = 0; i < t.n; ++i) store_elem(t.param_copy, i, dt, t.param[i]);
    return;
  }
  if (!copy_stream_) copy_stream_ = store_.device().create_stream();
  std::vector<float> master(t.n);
  std::vector<unsigned char> params(t.n * dtype_size(dt));
  copy_sync(*copy_stream_, master.data(), t.param, t.n * sizeof(float), layout_.timeout());
  for (std::size_t i = 0; i < t.n; ++i) store_elem(params.data(), i, dt, master[i]);
  copy_sync(*copy_stream_, t.param_copy, params.data(), params.size(), layout_.timeout());
}

std::int64_t OptimizerStep::update_step(TensorId id) const {
  if (!skipped_.empty() && skipped_[id]) return 0;
  return (counts_.empty() ? adam_step_ : counts_[id]) + ahead_;
}

void OptimizerStep::for_each_count_run(
    std::size_t flat_b, std::size_t n,
    const std::function<void(std::size_t, std::size_t, std::int64_t)>& fn) const {
  const Partition& part = layout_.partition();
  const std::size_t tensors = part.num_tensors(), end = flat_b + n;
  std::size_t lo = 0, hi = tensors;  // the last tensor starting at or before flat_b
  while (lo < hi) {
    const std::size_t mid = (lo + hi) / 2;
    if (part.offset(mid) <= flat_b)
      lo = mid + 1;
    else
      hi = mid;
  }
  std::size_t run_b = flat_b;
  std::int64_t run_step = -1;
  for (std::size_t t = lo == 0 ? 0 : lo - 1, pos = flat_b; pos < end; ++t) {
    const std::size_t stop = t + 1 < tensors ? std::min(end, part.offset(t + 1)) : end;
    if (stop > pos) {
      const std::int64_t step = update_step(t);
      if (step != run_step && pos > run_b) fn(run_b - flat_b, pos - run_b, run_step);
      if (step != run_step) run_b = pos;
      run_step = step;
      pos = stop;
    }
  }
  if (end > run_b) fn(run_b - flat_b, end - run_b, run_step);
}

void OptimizerStep::count_update() {
  if (!skipped_.empty() && counts_.empty()) counts_.assign(layout_.tensors(), adam_step_);
  ++adam_step_;
  for (std::size_t t = 0; t < counts_.size(); ++t)
    if (skipped_.empty() || !skipped_[t]) ++counts_[t];
}

void OptimizerStep::set_step_count(TensorId id, std::int64_t step) {
  if (counts_.empty()) counts_.assign(layout_.tensors(), adam_step_);
  counts_[id] = step;
  set_step_counts(adam_step_, std::move(counts_));
}

void OptimizerStep::set_step_counts(std::int64_t global, std::vector<std::int64_t> counts) {
  adam_step_ = global;
  counts_ = std::move(counts);
  if (std::all_of(counts_.begin(), counts_.end(), [&](std::int64_t c) { return c == global; }))
    counts_.clear();  // back to the common case
}

// Whether the decision can run while the host update's first reads are in flight: the state of
// some host-updated chunk is on NVMe (reads worth overlapping) and the statistics need no pool
// slot (gradients in host memory, or in the host-emulated device's memory viewed in place).
bool OptimizerStep::gated(std::span<const tier::StreamItem> host_items) const {
  if (!pipelined_ || host_items.empty() || !layout_.any_chunk_on(Tier::kNvme)) return false;
  const tier::StreamOptions o = stream_options(tier::Where::kHost, "gradient statistics");
  for (const tier::StreamItem& it : stats_items())
    if (!tier::in_place(store_, it, o)) return false;
  return true;
}

bool OptimizerStep::run(const std::function<bool()>& decide, const float& grad_scale,
                        const std::vector<bool>& done) {
  const auto t0 = Clock::now();
  done_ = done;
  const auto host_items = update_items(false, done_);
  const bool gate = done_.empty() && gated(host_items);
  double t_decide = 0;
  auto decided = [&] {
    const auto t = Clock::now();
    const bool go = decide();
    t_decide += seconds_since(t);
    if (go) count_update();
    return go;
  };
  bool ran = false;
  try {
    if (gate || decided()) ran = run_loops(host_items, gate, decided, grad_scale);
  } catch (...) {
    skipped_.clear();
    done_.clear();
    throw;
  }
  skipped_.clear();
  done_.clear();
  set_step_counts(adam_step_, std::move(counts_));
  optimizer_s_ += seconds_since(t0) - t_decide;
  return ran;
}

// The host loop (gated by the decision when `gate`), then the device loop. Returns false when the
// gate said skip (nothing was computed or written).
bool OptimizerStep::run_loops(const std::vector<tier::StreamItem>& host_items, bool gate,
                              const std::function<bool()>& decided, const float& grad_scale) {
  for (const bool device : {false, true}) {
    const std::vector<tier::StreamItem> dev_items =
        device ? update_items(true, done_) : std::vector<tier::StreamItem>{};
    const auto& items = device ? dev_items : host_items;
    if (items.empty()) continue;
    // item i is the i-th chunk of this kind, in order
    const std::vector<const Chunk*> of = update_chunks(device, done_);
    auto fn = [&](std::size_t i, std::span<void* const> v) {
      run_chunk(*of[i], v, device, grad_scale);
    };
    tier::StreamOptions o = stream_options(device ? tier::Where::kDevice : tier::Where::kHost,
                                           device ? "optimizer step (device)" : "optimizer step");
    if (!device && gate) o.gate = [&] { return in_gate(decided); };
    const auto s = tier::run_stream(store_, items, fn, o);
    if (!device) last_update_ = s;
    if (s.cancelled) return false;
  }
  return true;
}

// v: the stream loop's views (reads, then writes: tier/stream_loop.hpp); the state is updated out
// of place when its write view differs (a pending version viewed in place). Where the master is
// the parameters (chunk_item) the update writes no parameter copy.
void OptimizerStep::run_chunk(const Chunk& c, std::span<void* const> v, bool device,
                              float grad_scale) {
  const std::size_t n = v.size() / 2;
  const checkpoint::StateView in = state_view(c, v[0], v[2]), out = state_view(c, v[n], v[n + 2]);
  adam_chunk(c, in, v[1], c.master_in_params ? nullptr : v[n + 2], device, grad_scale,
             v[n] != v[0] ? &out : nullptr);
}

// A chunk's state arrays from the stream loop's view of its opt part and of its parameters.
checkpoint::StateView OptimizerStep::state_view(const Chunk& c, void* opt, void* params) {
  auto* base = static_cast<float*>(opt);
  const std::size_t n = c.r.count;
  if (c.master_in_params) return {static_cast<float*>(params), base, base + n, n};
  return {base, base + n, base + 2 * n, n};
}

// ---- the speculative update

// Not with any gradient chunk on NVMe: the gradient filler holds pool buffers for them during the
// backward, which the speculative loop on the same thread would wait for.
bool OptimizerStep::can_speculate(std::size_t ci) const {
  const Chunk& c = layout_.chunks()[ci];
  if (c.opt_tier == Tier::kGpu || c.master_in_params || update_on_device_ || !store_.pool())
    return false;
  if (layout_.stage() < 2 || grads_on_nvme_) return false;
  tier::StreamItem it = chunk_item(c);
  it.parts[0].pending = it.parts[2].pending = true;
  return tier::staged_bytes(store_, it, tier::Where::kHost, true) <= store_.pool()->buffer_size();
}

void OptimizerStep::speculate(std::span<const std::size_t> chunks, float grad_scale,
                              float stats_inv) {
  if (chunks.empty()) return;
  const auto t0 = Clock::now();
  std::vector<tier::StreamItem> items;
  std::vector<const Chunk*> of;
  for (std::size_t ci : chunks) {
    of.push_back(&layout_.chunks()[ci]);
    items.push_back(chunk_item(*of.back()));
    items.back().parts[0].pending = items.back().parts[2].pending = true;
  }
  ahead_ = 1;
  try {
    tier::run_stream(
        store_, items,
        [&](std::size_t i, std::span<void* const> v) {
          compute_ahead(chunks[i], v[1], stats_inv);  // v[1]: the gradient, read next by Adam
          run_chunk(*of[i], v, false, grad_scale);
          if (split_) split_->queue(-static_cast<std::int64_t>(of[i]->r.count));
        },
        speculative_options());
  } catch (...) {
    ahead_ = 0;
    throw;
  }
  ahead_ = 0;
  optimizer_s_ += seconds_since(t0);
}

void OptimizerStep::queue_speculation(std::span<const std::size_t> chunks) {
  if (!split_) return;
  std::int64_t n = 0;
  for (std::size_t ci : chunks) n += static_cast<std::int64_t>(layout_.chunks()[ci].r.count);
  split_->queue(n);
}

// Host state is updated out of place, from the committed copy straight into the pending version
// (no staging, no copy at the commit: TierStore's commit swaps the buffers).
tier::StreamOptions OptimizerStep::speculative_options() const {
  tier::StreamOptions o = stream_options(tier::Where::kHost, "speculative optimizer step");
  o.out_views = true;
  return o;
}

// The gate: the decision runs with the statistics read in place (gated() checked they can be).
bool OptimizerStep::in_gate(const std::function<bool()>& decided) {
  gating_ = true;
  try {
    const bool go = decided();
    gating_ = false;
    return go;
  } catch (...) {
    gating_ = false;
    throw;
  }
}

// ---- measurements

tier::StreamStats OptimizerStep::measure_io(bool read_only, bool write_only, bool pipelined) {
  auto items = update_items(false);
  tier::StreamOptions o = stream_options(tier::Where::kHost, "measurement");
  o.pipelined = pipelined;
  for (auto& it : items) {
    it.parts.resize(2);  // state and gradients
    if (read_only) it.parts[0].out = false;
    if (write_only) {
      it.parts[0].in = false;
      it.parts.resize(1);
    }
  }
  return tier::run_stream(
      store_, items, [](std::size_t, std::span<void* const>) {}, o);
}

// Adam alone: the first chunk's staged state and gradients, copied once, reused for every chunk's
// update (same element counts and group runs as the step).
tier::StreamStats OptimizerStep::measure_adam(bool pipelined) {
  auto items = update_items(false);
  if (items.empty()) return {};
  tier::StreamOptions o = stream_options(tier::Where::kHost, "measurement");
  o.pipelined = pipelined;
  std::vector<std::vector<unsigned char>> held;
  tier::run_stream(
      store_, std::span(items).first(1),
      [&](std::size_t, std::span<void* const> v) {
        for (std::size_t k = 0; k < items[0].parts.size(); ++k) {
          const auto& p = items[0].parts[k];
          const std::uint64_t n = p.bytes ? p.bytes : store_.info(p.id).bytes;
          const auto* b = static_cast<unsigned char*>(v[k]);
          held.emplace_back(b, b + n);
        }
      },
      o);
  std::vector<const Chunk*> of;
  for (const Chunk& c : layout_.chunks())
    if (c.opt_tier != Tier::kGpu) of.push_back(&c);
  std::size_t biggest = 0;
  for (const Chunk* c : of) biggest = std::max(biggest, c->r.count);
  const std::size_t ges = layout_.grad_elem_bytes(), first = of[0]->r.count;
  std::vector<float> state(3 * biggest);
  std::vector<unsigned char> grads(biggest * ges), params(biggest * layout_.param_elem_bytes());
  const checkpoint::StateView s = state_view(*of[0], held[0].data(), held[2].data());
  for (std::size_t i = 0; i < biggest; ++i) {
    const std::size_t j = i % first;
    state[i] = s.master[j];
    state[biggest + i] = s.exp_avg[j];
    state[2 * biggest + i] = s.exp_avg_sq[j];
    std::memcpy(grads.data() + i * ges, held[1].data() + j * ges, ges);
  }
  tier::StreamStats st;
  const auto t0 = Clock::now();
  for (const Chunk* c : of) {
    const checkpoint::StateView v{state.data(), state.data() + biggest, state.data() + 2 * biggest,
                                  c->r.count};
    adam_chunk(*c, v, grads.data(), c->master_in_params ? nullptr : params.data(), false, 1.0f);
  }
  st.t_compute = st.t_total = seconds_since(t0);
  st.items = of.size();
  return st;
}

}  // namespace strata::zero
