// The step: reduce (engine_grads.cpp) / agree on the norm and overflow / loss scale / update /
// gather. The update and the statistics pass run the one pipelined loop (tier/stream_loop.hpp)
// over the chunk grid: read ahead, Adam, write behind.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "strata/log.hpp"
#include "zero/engine_impl.hpp"

namespace strata {

// ---- gradient statistics over pieces
// ---------------------------------------------------------------

namespace zero {

StatsStream::StatsStream(CpuAdam& adam, DType dtype, float scale)
    : adam_(adam),
      dt_(dtype),
      es_(elem_size(dtype)),
      scale_(scale),
      carry_(CpuAdam::kStatsTileElems * elem_size(dtype)) {}

void StatsStream::feed(const void* grads, std::size_t n) {
  constexpr std::size_t kTile = CpuAdam::kStatsTileElems;
  const auto* p = static_cast<const unsigned char*>(grads);
  if (carried_) {  // complete the carried partial tile first
    const std::size_t take = std::min(kTile - carried_, n);
    std::memcpy(carry_.data() + carried_ * es_, p, take * es_);
    carried_ += take;
    p += take * es_;
    n -= take;
    if (carried_ < kTile) return;
    acc_ = adam_.grad_stats_continue(acc_, carry_.data(), dt_, kTile, scale_);
    carried_ = 0;
  }
  const std::size_t whole = n / kTile * kTile;
  if (whole) acc_ = adam_.grad_stats_continue(acc_, p, dt_, whole, scale_);
  if (n > whole) {
    std::memcpy(carry_.data(), p + whole * es_, (n - whole) * es_);
    carried_ = n - whole;
  }
}

AdamGradStats StatsStream::finish() {
  if (carried_) acc_ = adam_.grad_stats_continue(acc_, carry_.data(), dt_, carried_, scale_);
  carried_ = 0;
  return acc_;
}

}  // namespace zero

// ---- the loops' items
// ----------------------------------------------------------------------------------

tier::StreamOptions Engine::Impl::stream_options(tier::Where where, const char* what) const {
  tier::StreamOptions o;
  o.where = where;
  o.window = cfg.tiers.host.buffer_count;
  o.pipelined = pipelined;
  o.stage_device_memory = stage_device_memory;
  o.timeout = timeout;
  o.what = strcat("engine rank ", rank, " ", what);
  return o;
}

// One item per chunk whose Adam runs on the host (device = false) or on the device (true):
// master | m | v (read and written), the chunk's gradients (read), its parameters (written).
std::vector<tier::StreamItem> Engine::Impl::update_items(bool device) const {
  std::vector<tier::StreamItem> items;
  for (const zero::Chunk& c : chunks) {
    if ((c.opt_tier == Tier::kGpu) != device) continue;
    tier::StreamItem it;
    it.parts.push_back({c.opt, 0, 0, true, true});
    if (stage < 2) {
      it.parts.push_back({grads_id, (opt_begin + c.r.begin) * ges, c.r.count * ges, true, false});
    } else {
      it.parts.push_back({c.grad, 0, 0, true, false});
    }
    if (stage < 3) {
      it.parts.push_back({params_id, (opt_begin + c.r.begin) * pes, c.r.count * pes, false, true});
    } else {
      it.parts.push_back({c.param, 0, 0, false, true});
    }
    items.push_back(std::move(it));
  }
  return items;
}

// The rank's gradient range in chunk-sized pieces (stages 0-1: of the flat gradients; at stage 0
// the rank's own partition, whose statistics it contributes).
std::vector<tier::StreamItem> Engine::Impl::stats_items() const {
  std::vector<tier::StreamItem> items;
  if (stage >= 2) {
    for (const zero::Chunk& c : chunks) items.push_back({{{c.grad, 0, 0, true, false}}});
    return items;
  }
  for (std::size_t b = 0; b < psize; b += chunk_cap) {
    const std::size_t n = std::min(chunk_cap, psize - b);
    items.push_back({{{grads_id, (own_begin + b) * ges, n * ges, true, false}}});
  }
  return items;
}

// ---- the step
// -------------------------------------------------------------------------------------------

StepResult Engine::Impl::step() {
  auto t_step = zero::Clock::now();
  ++st.steps;
  if (stage == 3) {  // in-flight prefetches read the parameters Adam is about to change
    for (std::size_t i = 0; i < specs.size(); ++i) drop(i);
    trace_prev = std::move(trace_cur);
    trace_cur.clear();
    trace_pos = 0;
    trace_ok = true;
  }
  std::exception_ptr local = reduce();

  // Parts 2-3 decide whether and with which scale the update runs; on NVMe state they run while
  // the update's first reads are in flight (update()). A rank whose reduction or statistics
  // failed still takes part in the agreement, so that every rank stops in this step naming it
  // (instead of waiting out the collective timeout in its next collective); likewise a rank whose
  // update fails tells the others in agree_outcome().
  StepResult res;
  float grad_scale = 0;
  bool decide_ran = false;
  bool agreed = false;  // every rank passed agree() and will call agree_outcome()
  auto decide = [&] {
    decide_ran = true;
    auto t0 = zero::Clock::now();
    const double inv = 1.0 / (scale * world);
    AdamGradStats stats;
    if (!local) {
      try {
        stats = local_grad_stats(static_cast<float>(inv));
      } catch (...) {
        local = std::current_exception();
      }
    }
    bool finite = true;
    double sum_sq = 0;
    const int peer = agree(stats, local != nullptr, &finite, &sum_sq);
    st.norm_s += zero::seconds_since(t0);
    if (local) std::rethrow_exception(local);
    if (peer >= 0) fail_for_peer(peer, "gradient reduction or statistics");
    agreed = true;
    apply_loss_scale(finite, res);
    if (finite) {
      res.grad_norm = std::sqrt(sum_sq);
      const double clip = cfg.optimizer.grad_clip;
      res.clip_coef = clip > 0 && res.grad_norm > clip ? clip / (res.grad_norm + 1e-6) : 1.0;
      st.last_grad_norm = res.grad_norm;
      grad_scale = static_cast<float>(res.clip_coef / scale);  // after g / world (step_options)
    }
    return finite;
  };
  bool applied = false;
  try {
    if (local) decide();  // joins the agreement with its failed flag, then throws `local`
    applied = update(decide, grad_scale);
  } catch (...) {
    if (!decide_ran) {
      // The update failed before its gate ran the agreement (the loop's first reads could not be
      // issued, e.g. on a failed store): join the agreement with a failed flag anyway.
      const std::exception_ptr error = std::current_exception();
      local = error;
      try {
        decide();
      } catch (...) {
      }
      std::rethrow_exception(error);
    }
    if (!agreed) throw;  // failed in or after the agreement's exchange: every rank knows it
    try {
      agree_outcome(false);
    } catch (const std::exception& e) {
      log_error("engine rank ", rank, ": telling the other ranks that the update failed: ",
                e.what());
    }
    throw;
  }
  if (const int peer = agree_outcome(true); peer >= 0) fail_for_peer(peer, "update");
  if (applied) {
    gather_params();
    ++st.applied_steps;
    res.applied = true;
    if (scaling && cfg.precision.loss_scale.dynamic &&
        ++good_steps >= cfg.precision.loss_scale.growth_interval) {
      scale *= cfg.precision.loss_scale.growth_factor;
      good_steps = 0;
    }
  }
  std::fill(arrived.begin(), arrived.end(), false);
  if (stage >= 2) reset_buckets();
  res.loss_scale = scale;
  st.loss_scale = scale;
  st.step_s += zero::seconds_since(t_step);
  return res;
}

// The statistics pass: finite check and sum of squares of the rank's gradients (times `inv`),
// streamed chunk by chunk through host staging (gradients in device memory are copied to pinned
// buffers, those on NVMe read back), bitwise what one pass over the whole range gives. On the
// host-emulated device the device memory is read in place (with or without a pool).
AdamGradStats Engine::Impl::local_grad_stats(float inv) {
  zero::StatsStream stats(*adam, gdt, inv);
  const auto items = stats_items();
  const tier::Where where = storage->pool() ? tier::Where::kHost : tier::Where::kDevice;
  if (where == tier::Where::kDevice && storage->device().kind() != DeviceKind::kHost)
    fail(ErrorCode::kInternal,
         "engine: gradient statistics in device memory need the host-emulated device");
  tier::run_stream(
      store(), items,
      [&](std::size_t i, std::span<void* const> v) {
        const BufferInfo info = store().info(items[i].parts[0].id);
        const std::uint64_t bytes = items[i].parts[0].bytes ? items[i].parts[0].bytes : info.bytes;
        stats.feed(v[0], bytes / ges);
      },
      stream_options(where, "gradient statistics"));
  return stats.finish();
}

// Step part 2: the ranks agree on the norm and the overflow through an all-gather of (sum of
// squares as FP64 bits, finite flag, failed flag), summed in rank order: identical on every rank.
int Engine::Impl::agree(const AdamGradStats& local, bool failed_here, bool* finite,
                        double* sum_sq) {
  std::uint32_t mine[4];
  const std::uint64_t bits =
      std::bit_cast<std::uint64_t>(local.finite && !failed_here ? local.sum_sq : 0.0);
  mine[0] = static_cast<std::uint32_t>(bits);
  mine[1] = static_cast<std::uint32_t>(bits >> 32);
  mine[2] = local.finite ? 1u : 0u;
  mine[3] = failed_here ? 1u : 0u;
  std::vector<std::uint32_t> all(4 * static_cast<std::size_t>(world));
  if (world > 1) {
    all_gather_bytes(mine, all.data(), sizeof(mine));  // in device memory, where collectives run
  } else {
    std::memcpy(all.data(), mine, sizeof(mine));
  }
  *finite = true;
  *sum_sq = 0;
  int peer = -1;
  for (int r = 0; r < world; ++r) {
    const std::uint32_t* p = all.data() + 4 * r;
    if (p[3] != 0u && r != rank && peer < 0) peer = r;
    *finite = *finite && p[2] == 1u;
    *sum_sq += std::bit_cast<double>(static_cast<std::uint64_t>(p[0]) |
                                     (static_cast<std::uint64_t>(p[1]) << 32));
  }
  return peer;
}

int Engine::Impl::agree_outcome(bool ok_here) {
  if (world == 1) return -1;
  const std::uint32_t mine[1] = {ok_here ? 0u : 1u};
  std::vector<std::uint32_t> all(static_cast<std::size_t>(world));
  all_gather_bytes(mine, all.data(), sizeof(mine));
  for (int r = 0; r < world; ++r)
    if (r != rank && all[static_cast<std::size_t>(r)] != 0u) return r;
  return -1;
}

void Engine::Impl::fail_for_peer(int peer, const char* phase) const {
  fail(ErrorCode::kComm,
       strcat("engine rank ", rank, ": rank ", peer, " failed in this step's ", phase,
              " (its own error names the cause); the step did not complete on every rank, so "
              "this rank stops too: build new engines and load_checkpoint() the last checkpoint "
              "on every rank"));
}

// Step part 3: an overflow skips the step on every rank and backs the dynamic loss scale off.
void Engine::Impl::apply_loss_scale(bool finite, StepResult& res) {
  res.overflow = !finite;
  if (finite) return;
  ++st.skipped_steps;
  good_steps = 0;
  if (scaling && cfg.precision.loss_scale.dynamic)
    scale = std::max(cfg.precision.loss_scale.min_scale,
                     scale * cfg.precision.loss_scale.backoff_factor);
  if (rank == 0) log_info("engine: gradient overflow, step skipped; loss scale now ", scale);
}

// The options of every Adam call of a step (the one place they are made).
AdamStepOptions Engine::Impl::step_options(float grad_scale) const {
  return AdamStepOptions{adam_step, grad_scale, false,
                         static_cast<float>(world)};  // g / N, as torch
}

// Adam on one chunk: master | m | v at `v`, its gradients, its parameters written in the model
// dtype. One call per parameter group the chunk spans (usually one): element-wise, so the cut
// changes no bit. on_device: the arrays are device memory (state placed on gpu).
void Engine::Impl::adam_chunk(const zero::Chunk& c, const zero::StateView& v, const void* grad,
                              void* param_copy, bool on_device, float grad_scale) {
  const auto* g = static_cast<const unsigned char*>(grad);
  auto* p = static_cast<unsigned char*>(param_copy);
  for_each_group_run(opt_begin + c.r.begin, c.r.count,
                     [&](std::size_t o, std::size_t n, GroupId gid) {
                       AdamParams hp = AdamParams::from_config(cfg.optimizer);
                       hp.lr = groups[gid].lr;
                       hp.weight_decay = groups[gid].weight_decay;
                       AdamTensors t;
                       t.param = v.master + o;
                       t.exp_avg = v.exp_avg + o;
                       t.exp_avg_sq = v.exp_avg_sq + o;
                       t.grad = g + o * ges;
                       t.grad_dtype = gdt;
                       t.param_copy = p + o * pes;
                       t.param_copy_dtype = pdt;
                       t.n = n;
                       const AdamStepOptions so = step_options(grad_scale);
                       if (on_device)
                         device_adam->step_resident(hp, t, so);
                       else if (update_on_device)
                         device_adam->step(hp, t, so);
                       else
                         adam->step(hp, t, so);
                     });
}

// Whether the decision (norm, overflow, loss scale) can run while the host update's first reads
// are in flight: the state of some host-updated chunk is on NVMe (reads worth overlapping) and the
// statistics pass needs no pool slot (the update's read-ahead holds them): gradients in host
// memory, or in the host-emulated device's memory viewed in place.
bool Engine::Impl::decide_under_reads(std::span<const tier::StreamItem> host_items) {
  if (!pipelined || host_items.empty()) return false;
  const bool reads = std::any_of(chunks.begin(), chunks.end(), [](const zero::Chunk& c) {
    return c.opt_tier == Tier::kNvme;
  });
  if (!reads) return false;
  const tier::StreamOptions o = stream_options(tier::Where::kHost, "gradient statistics");
  for (const tier::StreamItem& it : stats_items())
    if (!tier::in_place(store(), it, o)) return false;
  return true;
}

// Step part 4: Adam over the chunk grid, if `decide` (parts 2-3) says so; it sets grad_scale.
// Chunks whose state is on cpu or nvme run CpuAdam on the host (state read ahead from NVMe into
// pinned buffers, gradients copied device→host, parameters written behind host→device in the
// model dtype, overlapping the next chunk); chunks on gpu run the device kernel on device memory.
// With state on NVMe the decision runs as the host loop's gate: the first reads are in flight
// while the statistics pass and the ranks' agreement run (a skipped step cancels them). Returns
// whether the update ran.
bool Engine::Impl::update(const std::function<bool()>& decide, const float& grad_scale) {
  auto t0 = zero::Clock::now();
  const auto host_items = update_items(false);
  const bool gated = decide_under_reads(host_items);
  double t_decide = 0;
  auto decided = [&] {
    auto t = zero::Clock::now();
    const bool go = decide();
    t_decide += zero::seconds_since(t);
    if (go) ++adam_step;
    return go;
  };
  if (!gated && !decided()) return false;
  for (const bool device : {false, true}) {
    std::vector<tier::StreamItem> dev_items;
    if (device) dev_items = update_items(true);
    const auto& items = device ? dev_items : host_items;
    if (items.empty()) continue;
    // Item i is the i-th chunk of this kind, in order.
    std::vector<const zero::Chunk*> of;
    for (const zero::Chunk& c : chunks)
      if ((c.opt_tier == Tier::kGpu) == device) of.push_back(&c);
    auto fn = [&](std::size_t i, std::span<void* const> v) {
      const zero::Chunk& c = *of[i];
      auto* base = static_cast<float*>(v[0]);
      const zero::StateView sv{base, base + c.r.count, base + 2 * c.r.count, c.r.count};
      adam_chunk(c, sv, v[1], v[2], device, grad_scale);
    };
    tier::StreamOptions o = stream_options(device ? tier::Where::kDevice : tier::Where::kHost,
                                           device ? "optimizer step (device)" : "optimizer step");
    if (!device && gated) o.gate = decided;
    const auto s = tier::run_stream(store(), items, fn, o);
    if (!device) last_update = s;
    if (s.cancelled) {  // the gate said skip: nothing was computed or written
      st.optimizer_s += zero::seconds_since(t0) - t_decide;
      return false;
    }
  }
  st.optimizer_s += zero::seconds_since(t0) - t_decide;
  return true;
}

// Step part 5: stages 1-2 all-gather the updated parameters on the device.
void Engine::Impl::gather_params() {
  if ((stage == 1 || stage == 2) && world > 1) {
    auto t0 = zero::Clock::now();
    comm.all_gather(params_dev + own_begin * pes, params_dev, psize, pdt);
    st.gather_s += zero::seconds_since(t0);
  }
}

}  // namespace strata
