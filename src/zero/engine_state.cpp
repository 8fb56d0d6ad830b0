// Parameters (param / read_param, stage 3's gathers), the optimizer state (read_state /
// write_state) and the checkpoint seam (checkpoint::RankState), over the layout and the
// collaborators.
#include <algorithm>
#include <cstring>

#include "core/numeric.hpp"
#include "strata/device.hpp"
#include "strata/log.hpp"
#include "zero/clock.hpp"
#include "zero/engine_impl.hpp"
#include "zero/memory_checks.hpp"

namespace strata {

// ---- parameters

namespace {
// Runs `work`, adding the seconds it took to `total`.
template <typename Work>
void add_seconds(double& total, Work&& work) {
  const auto t0 = zero::Clock::now();
  work();
  total += zero::seconds_since(t0);
}
}  // namespace

const void* Engine::Impl::param(TensorId id) const {
  require_finalized("param");
  check_id(id, "param");
  if (layout->stage() < 3) {
    unsigned char* p = layout->params_device();
    return p ? p + layout->partition().offset(id) * layout->param_elem_bytes() : nullptr;
  }
  if (!gatherer->ready(id))
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: param('", specs[id].name, "') at stage 3 without gather()"));
  return gatherer->data(id);
}

const void* Engine::Impl::gradient(TensorId id) const {
  require_finalized("gradient");
  check_id(id, "gradient");
  unsigned char* g = layout->stage() < 2 ? layout->grads_device() : nullptr;
  return g ? g + layout->partition().offset(id) * layout->grad_elem_bytes() : nullptr;
}

void Engine::Impl::read_param(TensorId id, std::span<float> out) {
  require_finalized("read_param");
  check_id(id, "read_param");
  const std::size_t n = specs[id].numel, pes = layout->param_elem_bytes();
  if (out.size() != n)
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: read_param: ", out.size(), " != ", n, " elements"));
  (void)param(id);  // stage 3: must be gathered
  if (n == 0) return;
  std::vector<unsigned char> tmp(n * pes);
  if (layout->stage() < 3)
    zero::get_bytes(store(), layout->params_buffer(), layout->partition().offset(id) * pes, n * pes,
                    tmp.data(), layout->timeout());
  else
    gatherer->read(id, tmp.data());
  for (std::size_t i = 0; i < n; ++i) out[i] = load_elem(tmp.data(), i, layout->param_dtype());
}

void Engine::Impl::gather(std::span<const TensorId> ids) {
  require_finalized("gather");
  require_usable("gather");
  for (auto id : ids) check_id(id, "gather");
  if (layout->stage() == 3) add_seconds(st.gather_s, [&] { gatherer->gather(ids); });
}

void Engine::Impl::prefetch(std::span<const TensorId> ids) {
  require_finalized("prefetch");
  require_usable("prefetch");
  for (auto id : ids) check_id(id, "prefetch");
  if (layout->stage() == 3) gatherer->prefetch(ids);
}

void Engine::Impl::release(std::span<const TensorId> ids) {
  require_finalized("release");
  for (auto id : ids) check_id(id, "release");
  if (layout->stage() == 3) add_seconds(st.gather_s, [&] { gatherer->release(ids); });
}

namespace {
// Own partition elements [b, b + n) run by run over the param chunks that hold them:
// `move(chunk, offset in the chunk, bytes, offset in the host buffer)`, in bytes of the model
// dtype.
template <typename Move>
void for_each_own_run(const zero::EngineLayout& layout, std::size_t b, std::size_t n, Move move) {
  const std::size_t pes = layout.param_elem_bytes();
  layout.for_each_chunk_piece(b, n, [&](std::size_t ci, std::size_t pos, std::size_t stop) {
    const zero::Chunk& c = layout.chunks()[ci];
    move(c, (pos - c.r.begin) * pes, (stop - pos) * pes, (pos - b) * pes);
  });
}
}  // namespace

// Stage 3: own partition elements [b, b + n) in the model dtype, from / into the param chunks.
void Engine::Impl::read_own(std::size_t b, std::size_t n, unsigned char* host) {
  for_each_own_run(*layout, b, n,
                   [&](const zero::Chunk& c, std::size_t off, std::size_t len, std::size_t at) {
                     zero::get_bytes(store(), c.param, off, len, host + at, layout->timeout());
                   });
}

void Engine::Impl::write_own(std::size_t b, std::size_t n, const unsigned char* host) {
  for_each_own_run(*layout, b, n,
                   [&](const zero::Chunk& c, std::size_t off, std::size_t len, std::size_t at) {
                     zero::put_bytes(store(), c.param, off, len, host + at, layout->timeout());
                   });
}

// ---- optimizer state

namespace {
// The array a kind is: 0 master, 1 exp_avg, 2 exp_avg_sq (a StateView's order, state_place's).
int state_index(StateKind kind) {
  return kind == StateKind::kMaster ? 0 : kind == StateKind::kExpAvg ? 1 : 2;
}

float* state_array(const checkpoint::StateView& v, StateKind kind) {
  float* const arrays[3] = {v.master, v.exp_avg, v.exp_avg_sq};
  return arrays[state_index(kind)];
}

void check_size(const TensorSpec& t, std::size_t given, const char* what) {
  if (given != t.numel)
    fail(ErrorCode::kInvalidArgument, strcat("engine: ", what, "('", t.name, "'): ", given,
                                             " elements given, the tensor has ", t.numel));
}

// What read_state and write_state check first: a finalized, usable engine, a registered tensor,
// and `given` elements, the tensor's size.
template <typename EngineImpl>  // Engine::Impl, private to Engine: deduced, not named
void check_state_call(EngineImpl& impl, TensorId id, const float* p, std::size_t given,
                      const char* what) {
  impl.require_finalized(what);
  impl.require_usable(what);
  impl.check_id(id, what);
  check_size(impl.specs[id], given, what);
  if (given && impl.storage->device().kind() == DeviceKind::kCuda)  // host code reads / writes it
    zero::require_host_memory(p, what, impl.specs[id].name);
}

// One array of the rank's state over `r` (optimizer-range elements) into `out`: each chunk's part
// read from where it lives (state_place), not the three arrays a StateView holds (a torch
// state_dict() reads each array of each tensor once: 3x the bytes through a StateView).
void read_state_array(const zero::EngineLayout& l, TierStore& store, StateKind kind, Range r,
                      float* out) {
  std::vector<Transfer> reads;
  try {
    l.for_each_chunk_piece(r.begin, r.count, [&](std::size_t ci, std::size_t b, std::size_t e) {
      const zero::Chunk& c = l.chunks()[ci];
      const zero::StatePlace at = zero::state_place(c, state_index(kind));
      reads.push_back(store.read(at.id, at.offset + (b - c.r.begin) * sizeof(float),
                                 (e - b) * sizeof(float), out + (b - r.begin), Tier::kCpu));
    });
  } catch (...) {
    try {
      zero::wait_all(reads, l.timeout());  // the reads issued write into `out`
    } catch (...) {
    }
    throw;
  }
  zero::wait_all(reads, l.timeout());
}

// A write's part in one chunk: the rank's elements [begin, end) (optimizer range) of array `kind`.
struct StatePiece {
  std::size_t chunk, begin, end;
  StateKind kind;
  const float* from;
};

// *began: set before the first write into the state (a failure from there on may leave it part
// written).
void write_pieces(zero::TierStateStore& state, Range r, std::span<const StatePiece> pieces,
                  bool* began) {
  const checkpoint::StateView v = state.acquire(r);
  for (const StatePiece& p : pieces)
    std::memcpy(state_array(v, p.kind) + (p.begin - r.begin), p.from,
                (p.end - p.begin) * sizeof(float));
  *began = true;
  state.release(r, true);
}

// The rank's part of each write into the state arrays, chunk by chunk: a chunk on NVMe (one
// checksummed block, written whole) read and written once for all the pieces in it, a chunk in
// memory piece by piece, in place (tier_state_store.cpp).
void write_state_arrays(const zero::EngineLayout& l, zero::TierStateStore& state,
                        std::span<const StateWrite> writes, bool* began) {
  std::vector<StatePiece> pieces;
  for (const StateWrite& w : writes) {
    if (w.in.empty()) continue;
    const zero::TensorShare share = l.share(w.id);
    l.for_each_chunk_piece(share.local.begin, share.local.count,
                           [&](std::size_t ci, std::size_t b, std::size_t e) {
                             const float* from = w.in.data() + share.from + (b - share.local.begin);
                             pieces.push_back({ci, b, e, w.kind, from});
                           });
  }
  std::stable_sort(pieces.begin(), pieces.end(),
                   [](const StatePiece& a, const StatePiece& b) { return a.chunk < b.chunk; });
  for (auto it = pieces.begin(); it != pieces.end();) {
    const zero::Chunk& c = l.chunks()[it->chunk];
    const auto stop =
        std::find_if(it, pieces.end(), [&](const StatePiece& p) { return p.chunk != it->chunk; });
    if (c.opt_tier == Tier::kNvme) {
      write_pieces(state, c.r, {it, stop}, began);
    } else {
      for (auto p = it; p != stop; ++p)
        write_pieces(state, {p->begin, p->end - p->begin}, {p, 1}, began);
    }
    it = stop;
  }
}
}  // namespace

void Engine::Impl::read_state(TensorId id, StateKind kind, std::span<float> out) {
  check_state_call(*this, id, out.data(), out.size(), "read_state");
  if (out.empty()) return;
  const zero::TensorShare share = layout->share(id);
  if ((layout->stage() == 0 || world == 1) && share.local.count == out.size()) {
    read_state_array(*layout, store(), kind, share.local, out.data());  // the whole tensor
    return;
  }
  std::vector<float> mine(share.local.count);
  if (share.local.count) read_state_array(*layout, store(), kind, share.local, mine.data());
  if (layout->stage() == 0 || world == 1) {
    std::copy(mine.begin(), mine.end(), out.begin());
    return;
  }
  host_comm->all_gather(mine.data(), out.data(), share.counts, DType::kFp32);
}

// The master keeps params == round(master) (params_follow_master): the parameters are written
// from the same values with the same conversion. A failure once the writing began (an I/O error,
// a checksum error reading a later chunk) may leave the rank's state part old, part new, and the
// parameters not following the master: the engine marks itself failed (docs/errors.md, rule 4);
// a failure before it (the checks, the first read) changes nothing.
void Engine::Impl::write_states(std::span<const StateWrite> writes, const char* what) {
  for (const StateWrite& w : writes) check_state_call(*this, w.id, w.in.data(), w.in.size(), what);
  bool began = false;
  try {
    write_state_arrays(*layout, *state, writes, &began);
    for (const StateWrite& w : writes)  // the parameters follow
      if (w.kind == StateKind::kMaster && !w.in.empty()) {
        began = true;
        write_params(w.id, w.in, layout->share(w.id));
      }
  } catch (const std::exception& e) {
    if (began) {
      params_follow_master = false;
      mark_broken(strcat(what, " failed part-way: ", e.what()));
    }
    throw;
  }
}

// The model-dtype parameters of tensor `id` from its new FP32 master `in`: stages 0-2 in the flat
// parameters, stage 3 the own slice in the chunks and the gathered copy if there is one.
void Engine::Impl::write_params(TensorId id, std::span<const float> in,
                                const zero::TensorShare& share) {
  const DType pdt = layout->param_dtype();
  const std::size_t pes = layout->param_elem_bytes(), n = in.size();
  auto encode = [&](std::size_t first, std::size_t count) {
    std::vector<unsigned char> tmp(count * pes);
    for (std::size_t i = 0; i < count; ++i) store_elem(tmp.data(), i, pdt, in[first + i]);
    return tmp;
  };
  if (layout->stage() < 3) {
    const auto tmp = encode(0, n);
    zero::put_bytes(store(), layout->params_buffer(), layout->partition().offset(id) * pes, n * pes,
                    tmp.data(), layout->timeout());
    return;
  }
  if (share.local.count)
    write_own(share.local.begin, share.local.count, encode(share.from, share.local.count).data());
  gatherer->write_if_gathered(id, encode(0, n).data());
}

// ---- the checkpoint seam
//
// params_follow_master (stages 0-2): the rank's parameters for its optimizer range are bitwise
// store_elem(master, model dtype) (core/numeric.hpp), so that an asynchronous save makes them
// from its pinned master instead of copying them (async_checkpoint.hpp). Every path that writes
// either keeps it:
//   finalize     EngineLayout::initialize writes params = store_elem(init), master = init.
//   step         the update writes every chunk's parameters from its new master through the
//                kernels' param copy (CpuAdam's scalar / F16C / AVX-512 lanes and the CUDA kernel
//                produce store_elem's bits, NaN included); a run whose tensors do not step (unused,
//                skip_gradient) gets store_elem(master) (OptimizerStep::params_from_master); an
//                overflow changes neither. Stages 1-2 all-gather the other ranks' partitions only.
//   write_state  kMaster writes the parameters from the same values (store_elem); the moments
//                do not touch them; a failure part-way breaks it (write_state).
//   load         the parameters and the master come from the checkpoint (any world, any stage):
//                checkpoint load compares every loaded element (RankState::params_follow_master)
//                and a checkpoint whose parameters are not its master's rounding breaks it until
//                the next load; a failed restore leaves the engine broken (no save).
// What it cannot see: a write into the parameters' memory behind the engine's back (Engine::
// param() is const; the Python binding's `.data` views are writable): the next applied step
// overwrites it from the master; a blocking save writes it, an asynchronous one the master's
// rounding (docs/offload.md). Where the parameters are the master (Chunk::master_in_params) such
// a write is the master's, as it is AdamW's, and a load leaves the checkpoint's parameters as the
// master (the state written first, then the parameters over it): they follow it trivially.

// The rank's parameters (model dtype) materialized in host memory for the duration of the call
// (unless !copy_params: an asynchronous save reads them from its snapshot), and the optimizer
// state through host views of the TierStore.
checkpoint::RankState Engine::Impl::rank_state(bool copy_params) {
  const int stage = layout->stage();
  const std::size_t pes = layout->param_elem_bytes(), psize = layout->partition_size();
  checkpoint::RankState r;
  r.rank = rank;
  r.world = world;
  r.stage = stage;
  r.param_dtype = layout->param_dtype();
  r.flat_size = layout->flat_size();
  r.partition_size = psize;
  r.partition = &layout->partition();
  r.opt_begin = layout->opt_begin();
  const std::size_t first = stage == 0 ? 0 : layout->own_begin();
  ckpt_params.resize(copy_params ? (stage == 0 ? layout->flat_size() : psize) * pes : 0);
  if (copy_params && stage == 3)
    read_own(0, psize, ckpt_params.data());
  else if (copy_params)
    zero::get_bytes(store(), layout->params_buffer(), first * pes, ckpt_params.size(),
                    ckpt_params.data(), layout->timeout());
  r.params = {ckpt_params.data(), ckpt_params.size()};
  r.store = state.get();
  r.all_gather = [this](const void* send, void* recv, std::size_t bytes) {
    agreement->exchange(send, recv, bytes);
  };
  r.adam_step = optimizer->step_count();
  r.tensor_steps = optimizer->step_counts();
  r.loss_scale = scaler.scale();
  r.good_steps = scaler.state().good_steps;
  r.steps = st.steps;
  r.applied_steps = st.applied_steps;
  r.skipped_steps = st.skipped_steps;
  for (const ParamGroupOptions& g : groups)
    r.groups.push_back({g.lr, g.weight_decay, *g.beta1, *g.beta2, *g.eps});
  return r;
}

// After checkpoint::load_checkpoint filled the seam: parameters back where they live, counters.
void Engine::Impl::after_load(const checkpoint::RankState& r) {
  const int stage = layout->stage();
  const std::size_t pes = layout->param_elem_bytes();
  if (stage == 3) {
    write_own(0, layout->partition_size(), ckpt_params.data());
  } else {
    const std::size_t first = stage == 0 ? 0 : layout->own_begin();
    zero::put_bytes(store(), layout->params_buffer(), first * pes, ckpt_params.size(),
                    ckpt_params.data(), layout->timeout());
    if (stage > 0 && world > 1) all_gather_params();
  }
  ckpt_params.clear();
  ckpt_params.shrink_to_fit();
  params_follow_master = r.params_follow_master || layout->params_are_master();
  optimizer->set_step_counts(r.adam_step, r.tensor_steps);
  scaler.restore({r.loss_scale, r.good_steps});
  st.steps = r.steps;
  st.applied_steps = r.applied_steps;
  st.skipped_steps = r.skipped_steps;
  st.loss_scale = r.loss_scale;
  restore_groups(r.groups);
  loaded_client_state = r.client_state;
  reducer->reset();
  early.reset();
  optimizer->clear_skipped();
}

// The groups' hyper-parameters as saved (torch's optimizer.load_state_dict restores them too). A
// checkpoint without them (written before they were kept) or with another number of groups (a
// model regrouped since) leaves the current ones, said once.
void Engine::Impl::restore_groups(const std::vector<checkpoint::GroupEntry>& saved) {
  if (saved.size() == groups.size()) {
    for (std::size_t i = 0; i < saved.size(); ++i)
      groups[i] = {saved[i].lr, saved[i].weight_decay, saved[i].beta1, saved[i].beta2,
                   saved[i].eps};
  } else if (rank == 0) {
    log_warn("engine: the checkpoint holds the hyper-parameters of ", saved.size(),
             " parameter groups, this engine has ", groups.size(),
             ": the groups' lr, weight decay, betas and eps are kept as they are");
  }
}

}  // namespace strata
