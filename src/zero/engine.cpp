// The ZeRO engine: the public API, construction and finalize() (see include/strata/engine.hpp for
// the contract and zero/engine_impl.hpp for the internals).
#include "strata/engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "strata/device.hpp"
#include "strata/log.hpp"
#include "zero/engine_impl.hpp"

namespace strata {

Engine::Impl::Impl(const Config& c, Communicator& cm)
    : cfg(c),
      comm(cm),
      rank(cm.rank()),
      world(cm.size()),
      stage(c.zero.stage),
      pdt(c.precision.params),
      gdt(c.precision.grads),
      pes(elem_size(pdt)),
      ges(elem_size(gdt)) {
  if (stage < 0 || stage > 3)
    fail(ErrorCode::kInvalidArgument, strcat("engine: zero.stage ", stage, " is not 0..3"));
  // Refused here, before anything is built: a device the communicator cannot reach.
  (void)zero::resolve_device_kind(c, cm);
  scaling = c.precision.loss_scaling();  // fp16 gradients unless precision.loss_scale.enabled says
  scale = scaling ? c.precision.loss_scale.initial : 1.0;
  groups.push_back({c.optimizer.lr, c.optimizer.weight_decay});
  timeout = std::chrono::milliseconds(
      static_cast<std::int64_t>(std::max(1.0, c.runtime.collective_timeout_s) * 1000.0));
}

// Collectives still in flight (an engine destroyed mid-backward, e.g. after a failure) read the
// bucket buffers and write the receive buffers: they finish before anything is freed. Each wait is
// bounded by the communicator's timeout; their errors were or will never be reported.
Engine::Impl::~Impl() {
  for (auto& f : inflight) {
    try {
      f.handle->wait();
    } catch (const std::exception&) {
    }
  }
  for (auto& g : gathered) {
    if (!g.handle) continue;
    try {
      g.handle->wait();
    } catch (const std::exception&) {
    }
  }
  grad_fill.reset();
  state.reset();
  device_adam.reset();
}

void Engine::Impl::require_finalized(const char* what) const {
  if (!finalized) fail(ErrorCode::kInvalidArgument, strcat("engine: ", what, " before finalize()"));
}

void Engine::Impl::require_usable(const char* what) {
  if (broken.empty() && storage && storage->is_open()) {
    const std::string failure = storage->store().failure();
    if (!failure.empty()) {
      // The first call to see the store failed by a transfer that ran on its own (a gradient
      // share's copy while the backward went on) reports that failure itself — the failed copy
      // when the filler has it — and the engine is failed from here on.
      try {
        fail(ErrorCode::kIo, failure);
      } catch (const std::exception& e) {
        std::rethrow_exception(fail_call(e));
      }
    }
  }
  const std::string& why = broken;
  if (!why.empty())
    fail(ErrorCode::kIo,
         strcat("engine rank ", rank, ": ", what, " refused: unusable after a failed step (", why,
                "); build a new engine and load_checkpoint() the last checkpoint, "
                "or restart"));
}

void Engine::Impl::mark_broken(const std::string& what) noexcept {
  try {
    broken = what.size() > 300 ? what.substr(0, 300) + "..." : what;
  } catch (...) {
  }
  if (grad_fill) grad_fill->abandon();
}

std::exception_ptr Engine::Impl::fail_call(const std::exception& e) noexcept {
  std::exception_ptr cause = grad_fill ? grad_fill->abandon_for_cause() : nullptr;
  std::string what = e.what();
  if (cause) {
    try {
      std::rethrow_exception(cause);
    } catch (const std::exception& c) {
      what = c.what();
    } catch (...) {
    }
  }
  mark_broken(what);
  return cause ? cause : std::current_exception();
}

void Engine::Impl::check_id(TensorId id, const char* what) const {
  if (id >= specs.size())
    fail(ErrorCode::kInvalidArgument, strcat("engine: ", what, ": unknown tensor id ", id));
}

void Engine::Impl::finalize() {
  if (finalized) fail(ErrorCode::kInvalidArgument, "engine: finalize() called twice");
  part = std::make_unique<Partition>(specs, world, cfg.zero.sub_group_size);
  own_begin = part->partition_begin(rank);
  psize = part->partition_size();
  const std::size_t flat = part->flat_size();
  opt_begin = stage == 0 ? 0 : own_begin;
  opt_count = stage == 0 ? flat : psize;

  group_runs.clear();
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const std::size_t b = i == 0 ? 0 : part->offset(i);
    if (group_runs.empty() || group_runs.back().second != tensor_group[i])
      group_runs.push_back({b, tensor_group[i]});
  }
  if (group_runs.empty()) group_runs.push_back({0, 0});

  // The rank's storage: device, then the layout's buffers in the store.
  storage = std::make_unique<zero::RankStorage>(cfg, comm, wrap);
  build_layout();

  const unsigned threads = cfg.runtime.cpu_threads;
  adam = std::make_unique<CpuAdam>(threads);
  update_on_device = cfg.optimizer.update == OptimizerUpdate::kDevice;
  const bool any_gpu_state = std::any_of(
      chunks.begin(), chunks.end(), [](const zero::Chunk& c) { return c.opt_tier == Tier::kGpu; });
  if (update_on_device || any_gpu_state) {
    device_adam = std::make_unique<DeviceAdam>(storage->device(), threads, timeout);
    if (rank == 0 && update_on_device)
      log_info("engine: optimizer update on ", storage->device().name());
  }

  // Rank 0's initial values win everywhere.
  std::vector<float> init(flat, 0.0f);
  for (std::size_t i = 0; i < specs.size(); ++i)
    std::copy(initial[i].begin(), initial[i].end(),
              init.begin() + static_cast<std::ptrdiff_t>(part->offset(i)));
  initial.clear();
  initial.shrink_to_fit();
  if (world > 1) broadcast_host(init.data(), flat, DType::kFp32, 0);
  initialize_state(init);

  state = std::make_unique<zero::TierStateStore>(store(), chunks, opt_count, timeout);
  if (stage >= 2) {
    bucket_elems = std::max<std::uint64_t>(1, cfg.zero.reduce_bucket_size);
    nbuckets = (flat + bucket_elems - 1) / bucket_elems;
    bucket_expected.assign(nbuckets, 0);
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const std::size_t b = part->offset(i), e = b + specs[i].numel;
      for (std::size_t pos = b; pos < e;) {
        const std::size_t k = pos / bucket_elems;
        const std::size_t stop = std::min(e, (k + 1) * bucket_elems);
        bucket_expected[k] += stop - pos;
        pos = stop;
      }
    }
    bucket_of.assign(nbuckets, {});
    std::vector<BufferId> grad_ids;
    for (const auto& c : chunks) grad_ids.push_back(c.grad);
    grad_fill = std::make_unique<tier::Filler>(store(), std::move(grad_ids), timeout);
    reset_buckets();
  }
  if (stage == 3) gathered.resize(specs.size());
  arrived.assign(specs.size(), false);
  finalized = true;
  log_debug("engine rank ", rank, ": stage ", stage, ", ", specs.size(), " tensors, ",
            part->numel(), " elements, flat ", flat, ", partition ", psize, ", ", chunks.size(),
            " chunks of <= ", chunk_cap);
}

// ---- the public API
// -------------------------------------------------------------------------------

void Engine::save_checkpoint(const std::string& dir) {
  Impl& m = *impl_;
  m.require_finalized("save_checkpoint");
  m.require_usable("save_checkpoint");
  zero::RankState r = m.rank_state();
  r.config_yaml = to_yaml(m.cfg);
  zero::save_checkpoint(dir, r, m.comm);
  m.ckpt_params.clear();
  m.ckpt_params.shrink_to_fit();
}

void Engine::load_checkpoint(const std::string& dir) {
  Impl& m = *impl_;
  m.require_finalized("load_checkpoint");
  m.require_usable("load_checkpoint");
  if (m.stage == 3)
    for (std::size_t i = 0; i < m.specs.size(); ++i) m.drop(i);
  zero::RankState r = m.rank_state();
  try {
    zero::load_checkpoint(dir, r, m.comm);
  } catch (const std::exception& e) {
    // Verification failures change nothing; a failure while restoring left partial state.
    if (r.restore_started)
      m.mark_broken(strcat("checkpoint load failed while restoring: ", e.what()));
    throw;
  }
  m.after_load(r);
}

Engine::Engine(const Config& config, Communicator& comm)
    : impl_(std::make_unique<Impl>(config, comm)) {}
Engine::~Engine() = default;

const char* state_kind_name(StateKind kind) {
  switch (kind) {
    case StateKind::kMaster:
      return "master";
    case StateKind::kExpAvg:
      return "exp_avg";
    case StateKind::kExpAvgSq:
      return "exp_avg_sq";
  }
  return "?";
}

namespace {
void check_group_value(double x, const char* what) {
  if (!(x >= 0) || !std::isfinite(x))
    fail(ErrorCode::kInvalidArgument, strcat("engine: ", what, " ", x, " must be finite and >= 0"));
}
ParamGroupOptions& group_ref(std::vector<ParamGroupOptions>& groups, GroupId g, const char* what) {
  if (g >= groups.size())
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: ", what, ": unknown group ", g, " (", groups.size(), " groups)"));
  return groups[g];
}
}  // namespace

TensorId Engine::add_parameter(std::string name, std::span<const float> initial, GroupId group) {
  if (impl_->finalized)
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: add_parameter('", name, "') after finalize()"));
  if (group >= impl_->groups.size())
    fail(ErrorCode::kInvalidArgument, strcat("engine: add_parameter('", name, "'): unknown group ",
                                             group, " (", impl_->groups.size(), " groups)"));
  impl_->tensor_group.push_back(group);
  impl_->specs.push_back({std::move(name), initial.size()});
  impl_->initial.emplace_back(initial.begin(), initial.end());
  return impl_->specs.size() - 1;
}
GroupId Engine::add_param_group(const ParamGroupOptions& options) {
  if (impl_->finalized)
    fail(ErrorCode::kInvalidArgument, "engine: add_param_group() after finalize()");
  check_group_value(options.lr, "add_param_group: lr");
  check_group_value(options.weight_decay, "add_param_group: weight_decay");
  impl_->groups.push_back(options);
  return impl_->groups.size() - 1;
}
std::size_t Engine::num_groups() const { return impl_->groups.size(); }
GroupId Engine::group_of(TensorId id) const {
  impl_->check_id(id, "group_of");
  return impl_->tensor_group[id];
}
void Engine::set_lr(double lr, GroupId group) {
  check_group_value(lr, "set_lr: lr");
  group_ref(impl_->groups, group, "set_lr").lr = lr;
}
double Engine::lr(GroupId group) const { return group_ref(impl_->groups, group, "lr").lr; }
void Engine::set_weight_decay(double weight_decay, GroupId group) {
  check_group_value(weight_decay, "set_weight_decay: weight_decay");
  group_ref(impl_->groups, group, "set_weight_decay").weight_decay = weight_decay;
}
double Engine::weight_decay(GroupId group) const {
  return group_ref(impl_->groups, group, "weight_decay").weight_decay;
}
Device& Engine::device() {
  impl_->require_finalized("device");
  return impl_->storage->device();
}
void Engine::read_state(TensorId id, StateKind kind, std::span<float> out) {
  impl_->read_state(id, kind, out);
}
void Engine::write_state(TensorId id, StateKind kind, std::span<const float> in) {
  impl_->write_state(id, kind, in);
}
std::int64_t Engine::optimizer_step() const { return impl_->adam_step; }
void Engine::set_optimizer_step(std::int64_t step) {
  if (step < 0)
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: set_optimizer_step(", step, "): must be >= 0"));
  impl_->adam_step = step;
}
void Engine::finalize() { impl_->finalize(); }
int Engine::stage() const { return impl_->stage; }
DType Engine::param_dtype() const { return impl_->pdt; }
DType Engine::grad_dtype() const { return impl_->gdt; }
const Partition& Engine::partition() const {
  impl_->require_finalized("partition");
  return *impl_->part;
}
std::size_t Engine::numel(TensorId id) const {
  impl_->check_id(id, "numel");
  return impl_->specs[id].numel;
}
const void* Engine::param(TensorId id) const { return impl_->param(id); }
void Engine::read_param(TensorId id, std::span<float> out) const { impl_->read_param(id, out); }
void Engine::gather(std::span<const TensorId> ids) { impl_->gather(ids); }
void Engine::prefetch(std::span<const TensorId> ids) { impl_->prefetch(ids); }
void Engine::release(std::span<const TensorId> ids) { impl_->release(ids); }
double Engine::loss_scale() const { return impl_->scale; }
void Engine::set_gradient(TensorId id, const void* grad) {
  impl_->set_gradient(id, grad, Tier::kGpu);
}
void Engine::set_gradient_host(TensorId id, const void* grad) {
  impl_->set_gradient(id, grad, Tier::kCpu);
}
void Engine::set_gradients(std::span<const void* const> grads) {
  if (grads.size() != impl_->specs.size())
    fail(ErrorCode::kInvalidArgument, strcat("engine: set_gradients: ", grads.size(),
                                             " gradients for ", impl_->specs.size(), " tensors"));
  for (std::size_t i = 0; i < grads.size(); ++i) impl_->set_gradient(i, grads[i], Tier::kGpu);
}
StepResult Engine::step() {
  impl_->require_finalized("step");
  impl_->require_usable("step");
  impl_->check_all_arrived();  // a usage error, before anything changes: not a failed step
  try {
    return impl_->step();
  } catch (const std::exception& e) {
    std::rethrow_exception(impl_->fail_call(e));
  }
}
EngineStats Engine::stats() const {
  EngineStats s = impl_->st;
  s.loss_scale = impl_->scale;
  s.comm = impl_->comm.stats();
  return s;
}

}  // namespace strata
