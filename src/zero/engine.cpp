// The ZeRO engine: the public API, construction and finalize() (see include/strata/engine.hpp for
// the contract and zero/engine_impl.hpp for the internals).
#include "strata/engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "strata/device.hpp"
#include "strata/log.hpp"
#include "zero/clock.hpp"
#include "zero/engine_impl.hpp"
#include "zero/memory_checks.hpp"

namespace strata {

Engine::Impl::Impl(const Config& c, Communicator& cm)
    : cfg(c), comm(cm), rank(cm.rank()), world(cm.size()), scaler(c.precision) {
  if (c.zero.stage < 0 || c.zero.stage > 3)
    fail(ErrorCode::kInvalidArgument, strcat("engine: zero.stage ", c.zero.stage, " is not 0..3"));
  // Refused here, before anything is built: a device the communicator cannot reach.
  (void)zero::resolve_device_kind(c, cm);
  groups.push_back({c.optimizer.lr, c.optimizer.weight_decay, c.optimizer.beta1, c.optimizer.beta2,
                    c.optimizer.eps});
}

// The speculator first (its jobs use the optimizer and the store; it borrows the scaler and the
// groups), then the collaborators (they wait for their work), storage last.
Engine::Impl::~Impl() { speculator.reset(); }

void Engine::Impl::require_finalized(const char* what) const {
  if (!finalized())
    fail(ErrorCode::kInvalidArgument, strcat("engine: ", what, " before finalize()"));
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
  if (!broken.empty())
    fail(
        ErrorCode::kIo,
        strcat("engine rank ", rank, ": ", what, " refused: unusable after a failed call (", broken,
               "); build a new engine and load_checkpoint() the last checkpoint, or restart"));
}

void Engine::Impl::mark_broken(const std::string& what) noexcept {
  try {
    broken = what.size() > 300 ? what.substr(0, 300) + "..." : what;
  } catch (...) {
  }
  if (reducer) reducer->abandon();
}

std::exception_ptr Engine::Impl::fail_call(const std::exception& e) noexcept {
  std::exception_ptr cause = reducer ? reducer->abandon_for_cause() : nullptr;
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

void Engine::Impl::wait_for_caller(StreamHandle caller, const char* what) {
  try {
    if (!caller_handoff) caller_handoff = storage->device().create_stream();
    caller_handoff->wait_external(caller);
    caller_handoff->synchronize(layout->timeout());
  } catch (const Error& e) {
    fail(e.code(),
         strcat("engine rank ", rank, ": ", what, ": waiting for the caller's stream: ", e.what()));
  }
}

void Engine::Impl::check_id(TensorId id, const char* what) const {
  if (id >= specs.size())
    fail(ErrorCode::kInvalidArgument, strcat("engine: ", what, ": unknown tensor id ", id));
}

// Start-up is agreed like a step: a rank whose storage cannot be built (swap space on a full
// disk, a pool over the memlock limit, a budget) tells the others in the start-up agreement, so
// every rank fails at once naming it, instead of waiting out the collective timeout in the
// initial broadcast.
void Engine::Impl::finalize() {
  if (finalized()) fail(ErrorCode::kInvalidArgument, "engine: finalize() called twice");
  storage = std::make_unique<zero::RankStorage>(cfg, comm, wrap);  // the device
  const auto timeout = std::chrono::milliseconds(
      static_cast<std::int64_t>(std::max(1.0, cfg.runtime.collective_timeout_s) * 1000.0));
  agreement = std::make_unique<zero::RankAgreement>(comm, storage->device(), timeout);
  std::exception_ptr failure;
  try {
    build_collaborators();
    speculator = std::make_unique<zero::Speculator>(cfg, rank, world, *layout, *reducer, *optimizer,
                                                    store(), scaler, groups);
  } catch (...) {
    failure = std::current_exception();
  }
  try {
    agreement->agree_start(failure);
  } catch (...) {
    if (!failure) failure = std::current_exception();
  }
  if (failure) {
    speculator.reset();
    state.reset();
    optimizer.reset();
    gatherer.reset();
    reducer.reset();
    host_comm.reset();
    scratch.reset();
    layout.reset();
    agreement.reset();
    storage.reset();
    std::rethrow_exception(failure);
  }
  initialize_state();
  log_debug("engine rank ", rank, ": stage ", layout->stage(), ", ", specs.size(), " tensors, ",
            layout->partition().numel(), " elements, flat ", layout->flat_size(), ", partition ",
            layout->partition_size(), ", ", layout->chunks().size(),
            " chunks of <= ", layout->chunk_cap());
}

void Engine::Impl::build_collaborators() {
  layout =
      std::make_unique<const zero::EngineLayout>(cfg, rank, world, specs, tensor_group, *storage);
  store().reserve(Tier::kGpu, agreement->device_bytes(), "scratch of the ranks' agreement");
  scratch = std::make_unique<ScratchArena>(store(), storage->device());
  host_comm =
      std::make_unique<zero::HostCollectives>(comm, storage->device(), *scratch, layout->timeout());
  reducer = std::make_unique<zero::GradientReducer>(*layout, comm, store(), *scratch);
  gatherer = std::make_unique<zero::ParamGatherer>(*layout, comm, store(), *scratch);
  optimizer = std::make_unique<zero::OptimizerStep>(*layout, store(), groups);
  state = std::make_unique<zero::TierStateStore>(store(), layout->chunks(), layout->opt_count(),
                                                 layout->timeout());
}

// Rank 0's initial values win everywhere; the staging of their broadcast is given back after. One
// rank reads them where they are, a piece at a time (no flat copy of the model).
void Engine::Impl::initialize_state() {
  const zero::FlatValues from_tensors = [this](std::size_t begin, std::span<float> out) {
    std::fill(out.begin(), out.end(), 0.0f);  // the padding between tensors
    const Partition& p = layout->partition();
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const std::size_t b = std::max(begin, p.offset(i));
      const std::size_t e = std::min(begin + out.size(), p.offset(i) + specs[i].numel);
      if (b < e)
        std::copy_n(initial[i].data() + (b - p.offset(i)), e - b, out.data() + (b - begin));
    }
  };
  std::vector<float> flat;  // several ranks: rank 0's values, broadcast
  zero::FlatValues values = from_tensors;
  if (world > 1) {
    flat.resize(layout->flat_size());
    from_tensors(0, flat);
    host_comm->broadcast(flat.data(), flat.size(), DType::kFp32, 0);
    values = [&flat](std::size_t begin, std::span<float> out) {
      std::copy_n(flat.data() + begin, out.size(), out.data());
    };
  }
  layout->initialize(values);
  initial.clear();
  initial.shrink_to_fit();
  initial_copies.clear();
  initial_copies.shrink_to_fit();
  scratch->trim();
}

zero::StorageReport Engine::Impl::report() const {
  zero::StorageReport r = layout->report(*storage, *scratch);
  r.bytes[static_cast<int>(Tier::kGpu)][static_cast<int>(zero::BufferKind::kRuntime)] +=
      agreement->device_bytes();
  return r;
}

EngineStats Engine::Impl::stats() const {
  if (speculator) speculator->wait();  // the optimizer's timings: the speculative jobs finished
  EngineStats s = st;
  s.loss_scale = scaler.scale();
  s.comm = comm.stats();
  if (reducer) {
    s.reduce_s = reducer->times().reduce_s;
    s.grad_spill_s = reducer->times().grad_spill_s;
    s.buckets_reduced = reducer->buckets_reduced();
  }
  if (optimizer) s.optimizer_s = optimizer->seconds();
  return s;
}

// ---- the public API
// -------------------------------------------------------------------------------

void Engine::save_checkpoint(const std::string& dir, std::string_view client_state,
                             const CheckpointModel& model) {
  save_checkpoint(dir, SaveMode::kBlocking, client_state, model);
}

void Engine::save_checkpoint(const std::string& dir, SaveMode mode, std::string_view client_state,
                             const CheckpointModel& model) {
  Impl& m = *impl_;
  m.require_finalized("save_checkpoint");
  m.require_usable("save_checkpoint");
  m.speculator->join();  // the snapshot pins blocks the speculative jobs may be writing
  m.save(dir, mode, client_state, model.empty() ? nullptr : &model);
}

void Engine::wait_checkpoint() {
  impl_->require_finalized("wait_checkpoint");
  impl_->finish_saving();
}

bool Engine::checkpoint_pending() const { return impl_->saving != nullptr; }

void Engine::load_checkpoint(const std::string& dir) {
  Impl& m = *impl_;
  m.require_finalized("load_checkpoint");
  m.require_usable("load_checkpoint");
  if (m.reducer->in_step() || m.early)
    fail(ErrorCode::kInvalidArgument,
         "engine: load_checkpoint() between a step's gradients and step(): they were computed "
         "from the state the load replaces; discard_gradients() first (nothing changed)");
  m.finish_saving();
  m.speculator->cancel(false);
  m.gatherer->drop_all();
  checkpoint::RankState r = m.rank_state();
  try {
    checkpoint::load_checkpoint(dir, r, m.comm);
  } catch (const std::exception& e) {
    // Verification failures change nothing; a failure while restoring left partial state.
    if (r.restore_started)
      m.mark_broken(strcat("checkpoint load failed while restoring: ", e.what()));
    throw;
  }
  m.after_load(r);
  m.scratch->trim();
}

const std::string& Engine::checkpoint_client_state() const { return impl_->loaded_client_state; }

Engine::Engine(const Config& config, Communicator& comm)
    : impl_(std::make_unique<Impl>(config, comm)) {}
Engine::~Engine() = default;

const char* state_kind_name(StateKind kind) {
  switch (kind) {
    case StateKind::kMaster: return "master";
    case StateKind::kExpAvg: return "exp_avg";
    case StateKind::kExpAvgSq: return "exp_avg_sq";
  }
  return "?";
}

namespace {
void check_group_value(double x, const char* what) {
  if (!(x >= 0) || !std::isfinite(x))
    fail(ErrorCode::kInvalidArgument, strcat("engine: ", what, " ", x, " must be finite and >= 0"));
}
void check_beta(double b, const char* what) {
  if (!(b >= 0 && b < 1))
    fail(ErrorCode::kInvalidArgument, strcat("engine: ", what, " ", b, " must be in [0, 1)"));
}
// Betas and eps unset in `o` become optimizer.*'s; each value is checked.
ParamGroupOptions resolved(ParamGroupOptions o, const OptimizerConfig& c, const char* what) {
  check_group_value(o.lr, strcat(what, ": lr").c_str());
  check_group_value(o.weight_decay, strcat(what, ": weight_decay").c_str());
  o.beta1 = o.beta1.value_or(c.beta1);
  o.beta2 = o.beta2.value_or(c.beta2);
  o.eps = o.eps.value_or(c.eps);
  check_beta(*o.beta1, strcat(what, ": beta1").c_str());
  check_beta(*o.beta2, strcat(what, ": beta2").c_str());
  check_group_value(*o.eps, strcat(what, ": eps").c_str());
  return o;
}
ParamGroupOptions& group_ref(std::vector<ParamGroupOptions>& groups, GroupId g, const char* what) {
  if (g >= groups.size())
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: ", what, ": unknown group ", g, " (", groups.size(), " groups)"));
  return groups[g];
}
}  // namespace

TensorId Engine::add_parameter(std::string name, std::span<const float> initial, GroupId group) {
  const TensorId id = add_parameter_borrowed(std::move(name), initial, group);
  auto& copy = impl_->initial_copies.emplace_back(initial.begin(), initial.end());
  impl_->initial[id] = copy;  // (a moved vector keeps its elements where they are)
  return id;
}

TensorId Engine::add_parameter_borrowed(std::string name, std::span<const float> initial,
                                        GroupId group) {
  if (impl_->finalized())
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: add_parameter('", name, "') after finalize()"));
  if (group >= impl_->groups.size())
    fail(ErrorCode::kInvalidArgument, strcat("engine: add_parameter('", name, "'): unknown group ",
                                             group, " (", impl_->groups.size(), " groups)"));
  // Read by host code: device memory is an error, not a SIGSEGV (only where a GPU may be the
  // engine's: the query needs the CUDA runtime).
  if (impl_->cfg.runtime.device != DeviceKind::kHost && !initial.empty())
    zero::require_host_memory(initial.data(), "add_parameter", name);
  impl_->tensor_group.push_back(group);
  impl_->specs.push_back({std::move(name), initial.size()});
  impl_->initial.push_back(initial);
  return impl_->specs.size() - 1;
}
GroupId Engine::add_param_group(const ParamGroupOptions& options) {
  if (impl_->finalized())
    fail(ErrorCode::kInvalidArgument, "engine: add_param_group() after finalize()");
  impl_->groups.push_back(resolved(options, impl_->cfg.optimizer, "add_param_group"));
  return impl_->groups.size() - 1;
}
std::size_t Engine::num_groups() const { return impl_->groups.size(); }
GroupId Engine::group_of(TensorId id) const {
  impl_->check_id(id, "group_of");
  return impl_->tensor_group[id];
}
void Engine::set_lr(double lr, GroupId group) {
  check_group_value(lr, "set_lr: lr");
  ParamGroupOptions& g = group_ref(impl_->groups, group, "set_lr");
  impl_->before_group_change(g.lr != lr);
  g.lr = lr;
}
double Engine::lr(GroupId group) const { return group_ref(impl_->groups, group, "lr").lr; }
void Engine::set_weight_decay(double weight_decay, GroupId group) {
  check_group_value(weight_decay, "set_weight_decay: weight_decay");
  ParamGroupOptions& g = group_ref(impl_->groups, group, "set_weight_decay");
  impl_->before_group_change(g.weight_decay != weight_decay);
  g.weight_decay = weight_decay;
}
double Engine::weight_decay(GroupId group) const {
  return group_ref(impl_->groups, group, "weight_decay").weight_decay;
}
void Engine::set_betas(double beta1, double beta2, GroupId group) {
  check_beta(beta1, "set_betas: beta1");
  check_beta(beta2, "set_betas: beta2");
  ParamGroupOptions& g = group_ref(impl_->groups, group, "set_betas");
  impl_->before_group_change(g.beta1 != beta1 || g.beta2 != beta2);
  g.beta1 = beta1;
  g.beta2 = beta2;
}
std::pair<double, double> Engine::betas(GroupId group) const {
  const ParamGroupOptions& g = group_ref(impl_->groups, group, "betas");
  return {*g.beta1, *g.beta2};
}
void Engine::set_eps(double eps, GroupId group) {
  check_group_value(eps, "set_eps: eps");
  ParamGroupOptions& g = group_ref(impl_->groups, group, "set_eps");
  impl_->before_group_change(g.eps != eps);
  g.eps = eps;
}
double Engine::eps(GroupId group) const { return *group_ref(impl_->groups, group, "eps").eps; }
Device& Engine::device() {
  impl_->require_finalized("device");
  return impl_->storage->device();
}
void Engine::read_state(TensorId id, StateKind kind, std::span<float> out) {
  if (impl_->speculator) impl_->speculator->join();
  impl_->read_state(id, kind, out);
}
void Engine::write_state(TensorId id, StateKind kind, std::span<const float> in) {
  const StateWrite w{id, kind, in};
  impl_->require_finalized("write_state");
  impl_->make_room_for_update();
  impl_->speculator->before_state_change();
  impl_->write_states({&w, 1}, "write_state");
}
void Engine::write_states(std::span<const StateWrite> writes) {
  impl_->require_finalized("write_states");
  impl_->make_room_for_update();
  impl_->speculator->before_state_change();
  impl_->write_states(writes, "write_states");
}
std::int64_t Engine::optimizer_step() const {
  if (impl_->speculator) impl_->speculator->wait();  // a speculative job counts one step ahead
  return impl_->optimizer ? impl_->optimizer->step_count() : 0;
}
void Engine::set_optimizer_step(std::int64_t step) {
  if (step < 0)
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: set_optimizer_step(", step, "): must be >= 0"));
  impl_->require_finalized("set_optimizer_step");
  impl_->speculator->before_state_change();
  impl_->optimizer->set_step_count(step);
}
std::int64_t Engine::optimizer_step(TensorId id) const {
  impl_->check_id(id, "optimizer_step");
  if (impl_->speculator) impl_->speculator->wait();
  return impl_->optimizer ? impl_->optimizer->step_count(id) : 0;
}
void Engine::set_optimizer_step(TensorId id, std::int64_t step) {
  impl_->check_id(id, "set_optimizer_step");
  if (step < 0)
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: set_optimizer_step(", id, ", ", step, "): must be >= 0"));
  impl_->require_finalized("set_optimizer_step");
  impl_->speculator->before_state_change();
  impl_->optimizer->set_step_count(id, step);
}
void Engine::finalize() { impl_->finalize(); }
int Engine::stage() const { return impl_->cfg.zero.stage; }
DType Engine::param_dtype() const { return impl_->cfg.precision.params; }
DType Engine::grad_dtype() const { return impl_->cfg.precision.grads; }
const Partition& Engine::partition() const {
  impl_->require_finalized("partition");
  return impl_->layout->partition();
}
std::size_t Engine::numel(TensorId id) const {
  impl_->check_id(id, "numel");
  return impl_->specs[id].numel;
}
const void* Engine::param(TensorId id) const { return impl_->param(id); }
const void* Engine::gradient(TensorId id) const { return impl_->gradient(id); }
void Engine::read_param(TensorId id, std::span<float> out) const { impl_->read_param(id, out); }
bool Engine::params_are_master() const {
  impl_->require_finalized("params_are_master");
  return impl_->layout->params_are_master();
}
void Engine::gather(std::span<const TensorId> ids) { impl_->gather(ids); }
void Engine::prefetch(std::span<const TensorId> ids) { impl_->prefetch(ids); }
void Engine::release(std::span<const TensorId> ids) { impl_->release(ids); }
double Engine::loss_scale() const { return impl_->scaler.scale(); }
void Engine::set_gradient(TensorId id, const void* grad) {
  impl_->set_gradient(id, grad, Tier::kGpu);
}
void Engine::set_gradient(TensorId id, const void* grad, StreamHandle producer) {
  impl_->require_finalized("set_gradient");
  impl_->require_usable("set_gradient");
  impl_->wait_for_caller(producer, "set_gradient");
  impl_->set_gradient(id, grad, Tier::kGpu);
}
void Engine::set_gradient_async(TensorId id, const void* grad, StreamHandle producer) {
  impl_->require_finalized("set_gradient_async");
  if (impl_->storage->device().kind() != DeviceKind::kCuda)
    return set_gradient(id, grad, producer);  // host memory: copied before return
  impl_->set_gradient(id, grad, Tier::kGpu, &producer);
}
StreamHandle Engine::gradient_stream() {
  impl_->require_finalized("gradient_stream");
  return impl_->reducer->stream().native_handle();
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
void Engine::skip_gradient(TensorId id) { impl_->skip_gradient(id); }
double Engine::clip_grad_norm(double max_norm) {
  impl_->require_finalized("clip_grad_norm");
  impl_->require_usable("clip_grad_norm");
  if (!(max_norm >= 0))
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: clip_grad_norm(", max_norm, "): max_norm must be >= 0"));
  impl_->reducer->check_all_arrived();  // a usage error, before anything changes
  try {
    return impl_->clip_grad_norm(max_norm);
  } catch (const std::exception& e) {
    std::rethrow_exception(impl_->fail_call(e));
  }
}
void Engine::discard_gradients() {
  impl_->require_finalized("discard_gradients");
  impl_->require_usable("discard_gradients");
  try {
    impl_->speculator->cancel(false);
    impl_->reducer->discard();
    impl_->early.reset();
    impl_->optimizer->clear_skipped();  // decided by a clip_grad_norm for the dropped gradients
  } catch (const std::exception& e) {
    std::rethrow_exception(impl_->fail_call(e));
  }
}
StepResult Engine::step() {
  impl_->require_finalized("step");
  impl_->require_usable("step");
  impl_->reducer->check_all_arrived();  // a usage error, before anything changes
  impl_->make_room_for_update(true);
  try {
    return impl_->step();
  } catch (const std::exception& e) {
    std::rethrow_exception(impl_->fail_call(e));
  }
}
StepResult Engine::step(StreamHandle consumer) {
  impl_->require_finalized("step");
  impl_->require_usable("step");
  impl_->reducer->check_all_arrived();
  impl_->wait_for_caller(consumer, "step");
  return step();
}
EngineStats Engine::stats() const { return impl_->stats(); }

}  // namespace strata
