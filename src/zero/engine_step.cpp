// The step, orchestrated over the collaborators: reduce (GradientReducer) / agree on the norm and
// overflow (OptimizerStep's statistics, RankAgreement) / loss scale (LossScaler) / update
// (OptimizerStep) / publish the parameters.
#include <algorithm>
#include <cmath>

#include "strata/device.hpp"
#include "strata/device_query.hpp"
#include "strata/log.hpp"
#include "zero/clock.hpp"
#include "zero/engine_impl.hpp"
#include "zero/memory_checks.hpp"

namespace strata {

void Engine::Impl::set_gradient(TensorId id, const void* grad, Tier memory,
                                const StreamHandle* producer) {
  require_finalized("set_gradient");
  require_usable("set_gradient");
  check_id(id, "set_gradient");
  if (early)
    fail(ErrorCode::kInvalidArgument,
         "engine: set_gradient after clip_grad_norm() and before step(): this step's gradients "
         "are already reduced");
  reducer->check_hand_in(id, grad);  // argument errors change nothing
  memory = gradient_memory(id, grad, memory);
  if (producer && memory == Tier::kCpu) {  // host memory: copied before return, after `producer`
    wait_for_caller(*producer, "set_gradient");
    producer = nullptr;
  }
  speculator->before_hand_in(id);
  // From here on a failure (a copy, a collective, the gradient spill) leaves the backward half
  // done.
  try {
    reducer->hand_in(id, grad, memory, producer);
    last_grad = zero::Clock::now();
    speculator->after_hand_in();
  } catch (const std::exception& e) {
    std::rethrow_exception(fail_call(e));
  }
}

// Where a gradient handed in really is. On a GPU: device memory of the engine's GPU (kGpu),
// host memory (kCpu: staged, whatever the caller said), or Error(kInvalidArgument) for another
// GPU's memory; on the host-emulated device all memory is host memory, as the caller said.
Tier Engine::Impl::gradient_memory(TensorId id, const void* grad, Tier said) const {
  const Device& d = storage->device();
  if (d.kind() != DeviceKind::kCuda || grad == nullptr) return said;
  const PointerInfo info = query_pointer(grad);
  if (info.kind != MemoryKind::kDevice && info.kind != MemoryKind::kManaged) return Tier::kCpu;
  zero::require_device_memory(d, info, "set_gradient", specs[id].name);
  return Tier::kGpu;
}

void Engine::Impl::skip_gradient(TensorId id) {
  require_finalized("skip_gradient");
  require_usable("skip_gradient");
  check_id(id, "skip_gradient");
  if (early)
    fail(ErrorCode::kInvalidArgument,
         "engine: skip_gradient after clip_grad_norm() and before step(): this step's gradients "
         "are already reduced");
  reducer->check_hand_in(id, nullptr, true);
  speculator->before_hand_in(id);
  try {
    reducer->hand_in_zero(id);
    last_grad = zero::Clock::now();
    speculator->after_hand_in();
  } catch (const std::exception& e) {
    std::rethrow_exception(fail_call(e));
  }
}

// The tensors no rank used (each rank's bits of use, OR-ed), after agree_step said some rank
// skipped one. Every rank calls it alike.
std::vector<bool> Engine::Impl::agree_skipped() {
  const std::vector<bool> used = agreement->agree_used(reducer->used());
  std::vector<bool> skipped(used.size());
  for (std::size_t i = 0; i < used.size(); ++i) skipped[i] = !used[i];
  return skipped;
}

// REQUIRES: finalized, usable, every gradient arrived. A rank whose reduction, statistics or
// update fails still takes part in the step's two exchanges (agree_step, agree_outcome), so that
// every rank stops in this step naming it instead of waiting out the collective timeout in its
// next collective.
StepResult Engine::Impl::step() {
  const auto t_step = zero::Clock::now();
  speculator->join();
  ++st.steps;
  gatherer->begin_step();  // prefetches in flight read the parameters Adam is about to change
  std::exception_ptr local = early ? nullptr : reducer->reduce();
  StepResult res;
  float grad_scale = 0;
  bool decided = false;  // the decision ran (this rank joined the agreement)
  bool agreed = false;   // every rank passed the agreement and will join agree_outcome
  auto decide_once = [&] {
    decided = true;
    if (!early) return decide(local, res, &grad_scale, &agreed);
    res = early->res;  // clip_grad_norm() decided: every rank passed the agreement then
    grad_scale = early->grad_scale;
    agreed = true;
    return early->go;
  };
  bool applied = false;
  const bool speculated = speculator->speculated();
  try {
    if (local) decide_once();  // joins the agreement with its failed flag, then throws `local`
    if (speculated) {          // the decision first: commit or roll back, then the rest
      const bool go = decide_once();
      const std::vector<bool> done = speculator->settle(go, res);
      applied = optimizer->run([go] { return go; }, grad_scale, done);
    } else {
      applied = optimizer->run(decide_once, grad_scale);
    }
  } catch (...) {
    speculator->abandon_step();
    const std::exception_ptr error = std::current_exception();
    if (!decided) {
      // The update failed before its gate ran the agreement (the loop's first reads could not be
      // issued, e.g. on a failed store): join the agreement with a failed flag anyway.
      local = error;
      try {
        decide_once();
      } catch (...) {
      }
    } else if (agreed) {
      finish_update(false);
    }
    std::rethrow_exception(error);
  }
  if (const int peer = agreement->agree_outcome(true); peer >= 0)
    agreement->fail_for_peer(peer, "update");
  speculator->note_micro_batches(reducer->micro_batch() + 1);
  end_step(applied, res);
  speculator->end_step(speculated, res);  // and the chunks discarded before step()
  st.speculated_chunks += res.speculated_chunks;
  st.committed_chunks += res.committed_chunks;
  st.rolled_back_chunks += res.rolled_back_chunks;
  res.exposed_s = zero::seconds_since(std::max(last_grad, t_step));
  st.exposed_s += res.exposed_s;
  st.step_s += zero::seconds_since(t_step);
  return res;
}

// The reduction and the decision of step(), taken early so that the loop can clip to its own
// max_norm with the global norm (torch.nn.utils.clip_grad_norm_'s coefficient, computed in fp32 as
// torch does).
double Engine::Impl::clip_grad_norm(double max_norm) {
  speculator->join();
  if (!early) {
    std::exception_ptr local = reducer->reduce();
    EarlyDecision d;
    d.loss_scale = scaler.scale();
    bool agreed = false;
    d.go = decide(local, d.res, &d.grad_scale, &agreed);
    early = d;
  }
  if (!early->go) return HUGE_VAL;  // overflow: the step is skipped
  const float norm = static_cast<float>(early->res.grad_norm);
  const float coef = std::min(1.0f, static_cast<float>(max_norm) / (norm + 1e-6f));
  early->res.clip_coef = std::min(early->res.clip_coef, static_cast<double>(coef));
  early->grad_scale = static_cast<float>(early->res.clip_coef / early->loss_scale);
  return early->res.grad_norm;
}

// Parts 2-3: the statistics (unless this rank already failed), the agreement, the loss scale and
// the clip coefficient. Returns whether the update runs.
bool Engine::Impl::decide(std::exception_ptr& local, StepResult& res, float* grad_scale,
                          bool* agreed) {
  const auto t0 = zero::Clock::now();
  const double scale = scaler.scale();
  AdamGradStats stats;
  if (!local) {
    try {
      stats = optimizer->grad_stats(static_cast<float>(1.0 / (scale * world)));
    } catch (...) {
      local = std::current_exception();
    }
  }
  const zero::StepAgreement a =
      agreement->agree_step(stats, local != nullptr, !reducer->all_used());
  st.norm_s += zero::seconds_since(t0);
  if (local) std::rethrow_exception(local);
  if (a.failed_peer >= 0)
    agreement->fail_for_peer(a.failed_peer, "gradient reduction or statistics");
  *agreed = true;
  res.overflow = !a.finite;
  if (!a.finite) {  // skipped on every rank; a dynamic scale backs off
    ++st.skipped_steps;
    const double now = scaler.on_overflow();
    if (rank == 0 && scaler.scaling())
      log_info("engine: gradient overflow, step skipped; loss scale now ", now);
    else if (rank == 0)  // no loss scale to back off: a NaN or Inf in the training itself
      log_warn("engine: a gradient is not finite (NaN or Inf, on some rank) with no loss scaling: ",
               "step skipped on every rank (torch's AdamW would have written it into the weights)");
    return false;
  }
  optimizer->set_skipped(a.any_skipped ? agree_skipped() : std::vector<bool>{});
  res.grad_norm = std::sqrt(a.sum_sq);
  const double clip = cfg.optimizer.grad_clip;
  res.clip_coef = clip > 0 && res.grad_norm > clip ? clip / (res.grad_norm + 1e-6) : 1.0;
  st.last_grad_norm = res.grad_norm;
  *grad_scale = static_cast<float>(res.clip_coef / scale);  // after g / world (OptimizerStep)
  return true;
}

void Engine::Impl::finish_update(bool ok_here) {
  try {
    (void)agreement->agree_outcome(ok_here);
  } catch (const std::exception& e) {
    log_error("engine rank ", rank, ": telling the other ranks that the update failed: ", e.what());
  }
}

// Stages 1-2 all-gather the updated parameters on the device.
void Engine::Impl::publish_params() {
  const int stage = layout->stage();
  if ((stage == 1 || stage == 2) && world > 1) {
    const auto t0 = zero::Clock::now();
    all_gather_params();
    st.gather_s += zero::seconds_since(t0);
  }
}

void Engine::Impl::all_gather_params() {
  const std::size_t pes = layout->param_elem_bytes();
  unsigned char* params = layout->params_device();
  comm.all_gather(params + layout->own_begin() * pes, params, layout->partition_size(),
                  layout->param_dtype());
}

void Engine::Impl::end_step(bool applied, StepResult& res) {
  if (applied) {
    publish_params();
    ++st.applied_steps;
    res.applied = true;
    scaler.on_applied();
  }
  reducer->reset();
  early.reset();
  res.loss_scale = scaler.scale();
  st.loss_scale = scaler.scale();
}

}  // namespace strata
