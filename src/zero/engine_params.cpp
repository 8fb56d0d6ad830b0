// Parameters: param() / read_param, the stage-3 gathers into device memory (with the replayed
// prefetch), collectives on host arrays staged through device memory, read_state / write_state,
// and the checkpoint seam (zero::RankState).
#include <algorithm>
#include <cstring>
#include <exception>

#include "strata/log.hpp"
#include "zero/engine_impl.hpp"

namespace strata {

// ---- parameters
// -------------------------------------------------------------------------------------

const void* Engine::Impl::param(TensorId id) const {
  require_finalized("param");
  check_id(id, "param");
  if (stage < 3) return params_dev ? params_dev + part->offset(id) * pes : nullptr;
  const Gathered& g = gathered[id];
  if (!g.ready)
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: param('", specs[id].name, "') at stage 3 without gather()"));
  return g.buf.ptr;
}

void Engine::Impl::read_param(TensorId id, std::span<float> out) {
  require_finalized("read_param");
  check_id(id, "read_param");
  const std::size_t n = specs[id].numel;
  if (out.size() != n)
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: read_param: ", out.size(), " != ", n, " elements"));
  (void)param(id);  // stage 3: must be gathered
  if (n == 0) return;
  std::vector<unsigned char> tmp(n * pes);
  if (stage < 3)
    get(params_id, part->offset(id) * pes, n * pes, tmp.data());
  else
    get(gathered[id].buf.id, 0, n * pes, tmp.data());
  for (std::size_t i = 0; i < n; ++i) out[i] = load_elem(tmp.data(), i, pdt);
}

// Stage 3: own partition elements [b, b + n) in the model dtype, from / into the param chunks.
void Engine::Impl::read_own(std::size_t b, std::size_t n, unsigned char* host) {
  for (std::size_t pos = b; pos < b + n;) {
    const zero::Chunk& c = chunk_at(pos);
    const std::size_t stop = std::min(b + n, c.r.end());
    get(c.param, (pos - c.r.begin) * pes, (stop - pos) * pes, host + (pos - b) * pes);
    pos = stop;
  }
}

void Engine::Impl::write_own(std::size_t b, std::size_t n, const unsigned char* host) {
  for (std::size_t pos = b; pos < b + n;) {
    const zero::Chunk& c = chunk_at(pos);
    const std::size_t stop = std::min(b + n, c.r.end());
    put(c.param, (pos - c.r.begin) * pes, (stop - pos) * pes, host + (pos - b) * pes);
    pos = stop;
  }
}

// ---- stage-3 gathers
// ------------------------------------------------------------------------------------

// The tensor's own slice is copied from the param chunks (wherever they live) into a device send
// buffer, and the all-gather fills a device buffer with the whole tensor.
void Engine::Impl::start_gather(TensorId id) {
  Gathered& g = gathered[id];
  if (g.ready || g.handle) return;
  const std::size_t n = specs[id].numel;
  if (n == 0) {
    g.ready = true;
    return;
  }
  g.buf = make_dev_buf(strcat("rt.gather.", id), n * pes);
  try {
    start_gather_io(id);
  } catch (...) {  // a failed read changes nothing: the gather can be retried
    free_dev_buf(g.send);
    free_dev_buf(g.buf);
    throw;
  }
}

void Engine::Impl::start_gather_io(TensorId id) {
  Gathered& g = gathered[id];
  const std::size_t n = specs[id].numel, off = part->offset(id);
  auto counts = part->counts_in(off, off + n);
  const unsigned char* send = g.buf.ptr;  // a rank with no share sends nothing
  if (const std::size_t mine = counts[static_cast<std::size_t>(rank)]) {
    const std::size_t b = std::max(off, own_begin) - own_begin;
    g.send = make_dev_buf(strcat("rt.send.", id), mine * pes);
    std::vector<Transfer> reads;
    for (std::size_t pos = b; pos < b + mine;) {
      const zero::Chunk& c = chunk_at(pos);
      const std::size_t stop = std::min(b + mine, c.r.end());
      reads.push_back(store().read(c.param, (pos - c.r.begin) * pes, (stop - pos) * pes,
                                   g.send.ptr + (pos - b) * pes, Tier::kGpu));
      pos = stop;
    }
    std::exception_ptr error;  // every read lands (or fails) before the buffer may be freed
    for (auto& t : reads) {
      try {
        t.wait(timeout);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
    send = g.send.ptr;
  }
  g.handle = comm.all_gather_async(send, g.buf.ptr, counts, pdt);
}

void Engine::Impl::finish_gather(TensorId id) {
  Gathered& g = gathered[id];
  if (!g.handle) return;
  auto h = std::move(g.handle);
  h->wait();
  g.ready = true;
  free_dev_buf(g.send);
}

void Engine::Impl::drop(TensorId id) {
  finish_gather(id);
  Gathered& g = gathered[id];
  g.ready = false;
  free_dev_buf(g.buf);
}

void Engine::Impl::gather(std::span<const TensorId> ids) {
  require_finalized("gather");
  require_usable("gather");
  for (auto id : ids) check_id(id, "gather");
  if (stage < 3) return;
  auto t0 = zero::Clock::now();
  std::vector<TensorId> call(ids.begin(), ids.end());
  for (auto id : ids) start_gather(id);
  // Replay of the previous step's gather order: prefetch the next call's tensors.
  if (trace_ok && trace_pos < trace_prev.size() && trace_prev[trace_pos] == call) {
    ++trace_pos;
    if (trace_pos < trace_prev.size())
      for (auto id : trace_prev[trace_pos]) start_gather(id);
  } else {
    trace_ok = false;
  }
  trace_cur.push_back(std::move(call));
  for (auto id : ids) finish_gather(id);
  st.gather_s += zero::seconds_since(t0);
}

void Engine::Impl::prefetch(std::span<const TensorId> ids) {
  require_finalized("prefetch");
  require_usable("prefetch");
  for (auto id : ids) check_id(id, "prefetch");
  if (stage < 3) return;
  for (auto id : ids) start_gather(id);
}

void Engine::Impl::release(std::span<const TensorId> ids) {
  require_finalized("release");
  for (auto id : ids) check_id(id, "release");
  if (stage < 3) return;
  auto t0 = zero::Clock::now();
  for (auto id : ids) drop(id);
  st.gather_s += zero::seconds_since(t0);
}

// ---- collectives on host arrays
// ---------------------------------------------------------------------------

// Staged through a device buffer in pieces: collectives run where the buffers live.
void Engine::Impl::broadcast_host(void* data, std::size_t count, DType dt, int root) {
  const std::size_t es = elem_size(dt);
  const std::size_t piece = std::min<std::size_t>(count, (64u << 20) / es);
  if (piece == 0) return;
  DevBuf x = make_dev_buf("rt.xfer", piece * es);
  try {
    for (std::size_t b = 0; b < count; b += piece) {
      const std::size_t n = std::min(piece, count - b);
      auto* h = static_cast<unsigned char*>(data) + b * es;
      if (rank == root) store().write(x.id, 0, n * es, h, Tier::kCpu).wait(timeout);
      comm.broadcast(x.ptr, n, dt, root);
      store().read(x.id, 0, n * es, h, Tier::kCpu).wait(timeout);
    }
  } catch (...) {
    free_dev_buf(x);
    throw;
  }
  free_dev_buf(x);
}

void Engine::Impl::all_gather_host(const void* send, void* recv,
                                   std::span<const std::size_t> counts, DType dt) {
  const std::size_t es = elem_size(dt);
  std::size_t total = 0;
  for (auto c : counts) total += c;
  const std::size_t mine = counts[static_cast<std::size_t>(rank)];
  DevBuf x = make_dev_buf("rt.xfer", (mine + total) * es);
  try {
    if (mine) store().write(x.id, 0, mine * es, send, Tier::kCpu).wait(timeout);
    comm.all_gather(x.ptr, x.ptr + mine * es, counts, dt);
    if (total) store().read(x.id, mine * es, total * es, recv, Tier::kCpu).wait(timeout);
  } catch (...) {
    free_dev_buf(x);
    throw;
  }
  free_dev_buf(x);
}

// A few bytes per rank (the step's and the checkpoint's agreements): through rt.norm, which exists
// from finalize() on, so that the exchange allocates nothing (a rank failing to allocate would
// leave the others waiting in the collective), copied on word_stream, not through the store (a
// rank whose store failed still takes part); larger exchanges through all_gather_host.
void Engine::Impl::all_gather_bytes(const void* send, void* recv, std::size_t bytes) {
  if (bytes % 4 != 0)
    fail(ErrorCode::kInternal,
         strcat("engine: an exchange of ", bytes, " bytes (not 4-byte words)"));
  if (bytes > 16) {
    const std::vector<std::size_t> counts(static_cast<std::size_t>(world), bytes / 4);
    all_gather_host(send, recv, counts, DType::kFp32);
    return;
  }
  word_stream->memcpy_async(norm_dev, send, bytes);
  word_stream->synchronize(timeout);
  comm.all_gather(norm_dev, norm_dev + 16, bytes / 4, DType::kFp32);
  word_stream->memcpy_async(recv, norm_dev + 16, bytes * static_cast<std::size_t>(world));
  word_stream->synchronize(timeout);
}

// ---- optimizer state access
// ---------------------------------------------------------------------------------

namespace {
float* state_array(const zero::StateView& v, StateKind kind) {
  return kind == StateKind::kMaster   ? v.master
         : kind == StateKind::kExpAvg ? v.exp_avg
                                      : v.exp_avg_sq;
}
}  // namespace

void Engine::Impl::read_state(TensorId id, StateKind kind, std::span<float> out) {
  require_finalized("read_state");
  require_usable("read_state");
  check_id(id, "read_state");
  const std::size_t n = specs[id].numel, off = part->offset(id);
  if (out.size() != n)
    fail(ErrorCode::kInvalidArgument, strcat("engine: read_state('", specs[id].name, "'): ",
                                             out.size(), " elements given, the tensor has ", n));
  if (n == 0) return;
  // The part of the tensor this rank's optimizer range holds, and the all-gather counts.
  std::vector<std::size_t> counts;
  Range local{off, n};
  if (stage > 0) {
    counts = part->counts_in(off, off + n);
    const std::size_t mine = counts[static_cast<std::size_t>(rank)];
    local = {mine ? std::max(off, own_begin) - own_begin : 0, mine};
  }
  std::vector<float> mine(local.count);
  if (local.count) {
    const zero::StateView v = state->acquire(local);
    std::memcpy(mine.data(), state_array(v, kind), local.count * sizeof(float));
    state->release(local, false);
  }
  if (stage == 0 || world == 1) {
    std::copy(mine.begin(), mine.end(), out.begin());
    return;
  }
  all_gather_host(mine.data(), out.data(), counts, DType::kFp32);
}

void Engine::Impl::write_state(TensorId id, StateKind kind, std::span<const float> in) {
  require_finalized("write_state");
  require_usable("write_state");
  check_id(id, "write_state");
  const std::size_t n = specs[id].numel, off = part->offset(id);
  if (in.size() != n)
    fail(ErrorCode::kInvalidArgument, strcat("engine: write_state('", specs[id].name, "'): ",
                                             in.size(), " elements given, the tensor has ", n));
  if (n == 0) return;
  Range local{off, n};
  if (stage > 0) {
    const auto counts = part->counts_in(off, off + n);
    const std::size_t mine = counts[static_cast<std::size_t>(rank)];
    local = {mine ? std::max(off, own_begin) - own_begin : 0, mine};
  }
  const std::size_t from = local.count ? opt_begin + local.begin - off : 0;  // in `in`
  if (local.count) {
    const zero::StateView v = state->acquire(local);
    std::memcpy(state_array(v, kind), in.data() + from, local.count * sizeof(float));
    state->release(local, true);
  }
  if (kind != StateKind::kMaster) return;
  // The model-dtype parameters follow the master.
  if (stage < 3) {
    std::vector<unsigned char> tmp(n * pes);
    for (std::size_t i = 0; i < n; ++i) store_elem(tmp.data(), i, pdt, in[i]);
    put(params_id, off * pes, n * pes, tmp.data());
    return;
  }
  if (local.count) {
    std::vector<unsigned char> tmp(local.count * pes);
    for (std::size_t i = 0; i < local.count; ++i) store_elem(tmp.data(), i, pdt, in[from + i]);
    write_own(local.begin, local.count, tmp.data());
  }
  finish_gather(id);
  if (gathered[id].ready && gathered[id].buf.id) {
    std::vector<unsigned char> tmp(n * pes);
    for (std::size_t i = 0; i < n; ++i) store_elem(tmp.data(), i, pdt, in[i]);
    put(gathered[id].buf.id, 0, n * pes, tmp.data());
  }
}

// ---- checkpoints
// ---------------------------------------------------------------------------------------------

// The seam: the rank's parameters (model dtype) materialized in host memory for the duration of
// the call, and the optimizer state through host views of the TierStore.
zero::RankState Engine::Impl::rank_state() {
  zero::RankState r;
  r.rank = rank;
  r.world = world;
  r.stage = stage;
  r.param_dtype = pdt;
  r.flat_size = part->flat_size();
  r.partition_size = psize;
  r.partition = part.get();
  r.opt_begin = opt_begin;
  if (stage == 3) {
    ckpt_params.resize(psize * pes);
    read_own(0, psize, ckpt_params.data());
  } else if (stage == 0) {
    ckpt_params.resize(part->flat_size() * pes);
    get(params_id, 0, ckpt_params.size(), ckpt_params.data());
  } else {
    ckpt_params.resize(psize * pes);
    get(params_id, own_begin * pes, ckpt_params.size(), ckpt_params.data());
  }
  r.params = {ckpt_params.data(), ckpt_params.size()};
  r.store = state.get();
  r.all_gather = [this](const void* send, void* recv, std::size_t bytes) {
    all_gather_bytes(send, recv, bytes);
  };
  r.adam_step = adam_step;
  r.loss_scale = scale;
  r.good_steps = good_steps;
  r.steps = st.steps;
  r.applied_steps = st.applied_steps;
  r.skipped_steps = st.skipped_steps;
  return r;
}

// After zero::load_checkpoint filled the seam: parameters back where they live, counters.
void Engine::Impl::after_load(const zero::RankState& r) {
  if (stage == 3) {
    write_own(0, psize, ckpt_params.data());
  } else if (stage == 0) {
    put(params_id, 0, ckpt_params.size(), ckpt_params.data());
  } else {
    put(params_id, own_begin * pes, ckpt_params.size(), ckpt_params.data());
    if (world > 1) comm.all_gather(params_dev + own_begin * pes, params_dev, psize, pdt);
  }
  ckpt_params.clear();
  ckpt_params.shrink_to_fit();
  adam_step = r.adam_step;
  scale = r.loss_scale;
  good_steps = r.good_steps;
  st.steps = r.steps;
  st.applied_steps = r.applied_steps;
  st.skipped_steps = r.skipped_steps;
  st.loss_scale = r.loss_scale;
  std::fill(arrived.begin(), arrived.end(), false);
  if (stage >= 2) reset_buckets();
}

}  // namespace strata
