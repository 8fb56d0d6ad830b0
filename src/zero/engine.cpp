// The ZeRO engine (see include/strata/engine.hpp for the contract).
#include "strata/engine.hpp"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>

#include "core/numeric.hpp"
#include "strata/adam.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"
#include "zero/checkpoint.hpp"
#include "zero/offload_store.hpp"
#include "zero/optimizer_state.hpp"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kMaxBucketsInFlight = 2;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::vector<unsigned char> zeros(std::size_t bytes) { return std::vector<unsigned char>(bytes, 0); }

}  // namespace

struct Engine::Impl {
  // Collectives still in flight (an engine destroyed mid-backward, e.g. after a failure) read the
  // bucket buffers and write the receive buffers: let them finish before anything is freed. Each
  // wait is bounded by the communicator's timeout; their errors were or will never be reported.
  ~Impl() {
    for (auto& f : inflight) {
      try {
        f.handle->wait();
      } catch (const std::exception&) {
      }
    }
    for (auto& h : gathering) {
      if (!h) continue;
      try {
        h->wait();
      } catch (const std::exception&) {
      }
    }
  }
  Impl(const Config& c, Communicator& cm)
      : cfg(c), comm(cm), rank(cm.rank()), world(cm.size()), stage(c.zero.stage),
        pdt(c.precision.params), gdt(c.precision.grads), pes(elem_size(pdt)),
        ges(elem_size(gdt)) {
    if (stage < 0 || stage > 3)
      fail(ErrorCode::kInvalidArgument, strcat("engine: zero.stage ", stage, " is not 0..3"));
    if (comm.buffer_location() != BufferLocation::kHost)
      fail(ErrorCode::kUnsupported,
           strcat("engine: the ", comm.backend_name(),
                  " communicator needs device buffers; the engine keeps its state in host memory "
                  "(use the in-process or MPI communicator)"));
    scaling = c.precision.loss_scaling();  // fp16 gradients unless precision.loss_scale.enabled says
    scale = scaling ? c.precision.loss_scale.initial : 1.0;
    groups.push_back({c.optimizer.lr, c.optimizer.weight_decay});
  }

  // ---- configuration and layout ----
  Config cfg;
  Communicator& comm;
  int rank, world, stage;
  DType pdt, gdt;
  std::size_t pes, ges;
  std::vector<TensorSpec> specs;
  std::vector<std::vector<float>> initial;
  // ---- parameter groups ----
  std::vector<ParamGroupOptions> groups;  // [0]: optimizer.lr / optimizer.weight_decay
  std::vector<GroupId> tensor_group;      // per tensor
  // Runs of the flat element space by group, ascending: {first flat element, group}. Padding takes
  // the group of the tensor before it (it stays zero whatever the group: zero gradient, zero decay).
  std::vector<std::pair<std::size_t, GroupId>> group_runs;
  std::unique_ptr<Device> main_device;  // device(): the host-emulated device for now
  bool finalized = false;
  std::unique_ptr<Partition> part;
  std::size_t own_begin = 0, psize = 0;
  std::size_t opt_begin = 0, opt_count = 0;  // flat range this rank runs Adam on

  // ---- state ----
  std::unique_ptr<CpuAdam> adam;
  std::unique_ptr<Device> device;            // optimizer.update: device
  std::unique_ptr<DeviceAdam> device_adam;   // (declared after `device`: destroyed first)
  std::unique_ptr<zero::OptimizerStateStore> state;
  std::vector<unsigned char> flat_params;  // stages 0-2: every parameter, model dtype
  std::vector<unsigned char> own_params;   // stage 3: own partition [pn, psize), model dtype
  std::unique_ptr<zero::NvmeArray> param_nvme;  // stage 3, offload.params nvme: [0, pn)
  std::size_t pn = 0;
  std::vector<std::vector<unsigned char>> gather_send;  // per tensor: own slice read from NVMe
  std::vector<unsigned char> param_tmp, ckpt_params;
  std::vector<unsigned char> flat_grads;   // stages 0-1
  std::vector<unsigned char> own_grads;    // stages 2-3, unless offload.gradients puts a share on NVMe
  std::unique_ptr<zero::NvmeArray> grad_nvme;  // offload.gradients nvme: the leading share [0, gn)
  std::size_t gn = 0;
  std::vector<unsigned char> grad_rest;    // offload.gradients nvme: the resident share [gn, psize)
  std::vector<unsigned char> grad_tmp;     // one piece's gradients, read back from NVMe
  std::vector<bool> arrived;

  // ---- stage 2/3 buckets ----
  std::size_t bucket_elems = 0, nbuckets = 0;
  std::vector<std::size_t> bucket_expected, bucket_pending;
  std::vector<std::vector<unsigned char>> bucket_buf;
  std::vector<bool> bucket_issued;
  std::vector<std::vector<unsigned char>> pool;
  struct InFlight {
    std::unique_ptr<CommHandle> handle;
    std::size_t bucket;
    // With gradients on NVMe: the rank's share of the bucket ([share_begin, +share_count) of the
    // partition) lands here and is spilled (NVMe part) / copied (resident part) when it completes.
    std::vector<unsigned char> recv;
    std::size_t share_begin = 0, share_count = 0;
  };
  unsigned char dummy_recv[16] = {};  // receive buffer of a rank with no share of a bucket
  std::deque<InFlight> inflight;

  // ---- stage 3 gathers ----
  std::vector<std::vector<unsigned char>> gathered;
  std::vector<std::unique_ptr<CommHandle>> gathering;
  std::vector<bool> is_gathered;
  std::vector<std::vector<TensorId>> trace_prev, trace_cur;
  std::size_t trace_pos = 0;
  bool trace_ok = true;

  // ---- loss scale, counters ----
  bool scaling = false;
  double scale = 1.0;
  std::uint32_t good_steps = 0;
  std::int64_t adam_step = 0;
  EngineStats st;

  void require_finalized(const char* what) const {
    if (!finalized) fail(ErrorCode::kInvalidArgument, strcat("engine: ", what, " before finalize()"));
  }
  // Set when a step failed after it began changing state (gradients moved, Adam started): the
  // rank's state may mix two steps, whatever tier failed. Every later step / checkpoint refuses.
  std::string broken;
  void require_usable(const char* what) const {
    if (!broken.empty())
      fail(ErrorCode::kIo, strcat("engine rank ", rank, ": ", what, " refused: unusable after a failed step (",
                                  broken, "); build a new engine and load_checkpoint() the last checkpoint, "
                                  "or restart"));
  }
  void check_id(TensorId id, const char* what) const {
    if (id >= specs.size())
      fail(ErrorCode::kInvalidArgument, strcat("engine: ", what, ": unknown tensor id ", id));
  }

  std::size_t bucket_begin(std::size_t b) const { return b * bucket_elems; }
  std::size_t bucket_len(std::size_t b) const {
    return std::min(bucket_elems, part->flat_size() - bucket_begin(b));
  }

  void finalize() {
    if (finalized) fail(ErrorCode::kInvalidArgument, "engine: finalize() called twice");
    part = std::make_unique<Partition>(specs, world, cfg.zero.sub_group_size);
    main_device = make_host_device();
    own_begin = part->partition_begin(rank);
    psize = part->partition_size();
    const std::size_t flat = part->flat_size();
    std::vector<float> init(flat, 0.0f);
    for (std::size_t i = 0; i < specs.size(); ++i)
      std::copy(initial[i].begin(), initial[i].end(), init.begin() + static_cast<std::ptrdiff_t>(part->offset(i)));
    initial.clear();
    initial.shrink_to_fit();
    if (world > 1) comm.broadcast(init.data(), flat, DType::kFp32, 0);

    group_runs.clear();
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const std::size_t b = i == 0 ? 0 : part->offset(i);
      if (group_runs.empty() || group_runs.back().second != tensor_group[i]) group_runs.push_back({b, tensor_group[i]});
    }
    if (group_runs.empty()) group_runs.push_back({0, 0});
    opt_begin = stage == 0 ? 0 : own_begin;
    opt_count = stage == 0 ? flat : psize;
    // Resident, or streamed from NVMe per offload.optimizer (zero/offload_store.hpp).
    state = zero::make_state_store(cfg, rank, std::span<const float>(init.data() + opt_begin, opt_count),
                                   part->sub_groups(0, opt_count));
    const unsigned threads = cfg.runtime.cpu_threads;
    adam = std::make_unique<CpuAdam>(threads);
    if (cfg.optimizer.update == OptimizerUpdate::kDevice) {
      device = zero::make_optimizer_device(cfg);
      const auto timeout = std::chrono::milliseconds(
          static_cast<std::int64_t>(cfg.runtime.collective_timeout_s * 1000.0));
      device_adam = std::make_unique<DeviceAdam>(*device, threads, timeout);
      if (rank == 0) log_info("engine: optimizer update on ", device->name());
    }

    auto to_model = [&](std::size_t begin, std::size_t count, std::vector<unsigned char>& out) {
      out.assign(count * pes, 0);
      for (std::size_t i = 0; i < count; ++i) store_elem(out.data(), i, pdt, init[begin + i]);
    };
    if (stage < 3) {
      to_model(0, flat, flat_params);
    } else {
      to_model(own_begin, psize, own_params);
      param_nvme = zero::make_nvme_params(cfg, rank, psize, pes);
      if (param_nvme) {
        pn = param_nvme->elems();
        param_nvme->put(own_params.data());
        own_params.erase(own_params.begin(), own_params.begin() + static_cast<std::ptrdiff_t>(pn * pes));
        own_params.shrink_to_fit();
      }
      gather_send.resize(specs.size());
      gathered.resize(specs.size());
      gathering.resize(specs.size());
      is_gathered.assign(specs.size(), false);
    }
    if (stage < 2) {
      flat_grads = zeros(flat * ges);
    } else {
      grad_nvme = zero::make_nvme_gradients(cfg, rank, psize, ges);
      if (grad_nvme) gn = grad_nvme->elems();
      else own_grads = zeros(psize * ges);
      bucket_elems = std::max<std::uint64_t>(1, cfg.zero.reduce_bucket_size);
      nbuckets = (flat + bucket_elems - 1) / bucket_elems;
      bucket_expected.assign(nbuckets, 0);
      for (std::size_t i = 0; i < specs.size(); ++i) {
        std::size_t b = part->offset(i), e = b + specs[i].numel;
        for (std::size_t pos = b; pos < e;) {
          std::size_t k = pos / bucket_elems;
          std::size_t stop = std::min(e, (k + 1) * bucket_elems);
          bucket_expected[k] += stop - pos;
          pos = stop;
        }
      }
      bucket_buf.resize(nbuckets);
      reset_buckets();
    }
    arrived.assign(specs.size(), false);
    finalized = true;
    log_debug("engine rank ", rank, ": stage ", stage, ", ", specs.size(), " tensors, ",
              part->numel(), " elements, flat ", flat, ", partition ", psize);
  }

  // Stage 3: elements [b, b + n) of the own partition, from NVMe [0, pn) and host [pn, psize).
  void read_own(std::size_t b, std::size_t n, unsigned char* dst) {
    const std::size_t on = b < pn ? std::min(b + n, pn) - b : 0;
    if (on) param_nvme->get({b, on}, dst);
    if (on < n) std::memcpy(dst + on * pes, own_params.data() + (b + on - pn) * pes, (n - on) * pes);
  }
  void write_own(std::size_t b, std::size_t n, const unsigned char* src) {
    const std::size_t on = b < pn ? std::min(b + n, pn) - b : 0;
    if (on) param_nvme->set({b, on}, src);
    if (on < n) std::memcpy(own_params.data() + (b + on - pn) * pes, src + on * pes, (n - on) * pes);
  }

  void reset_buckets() {
    bucket_pending = bucket_expected;
    bucket_issued.assign(nbuckets, false);
  }

  // ---- gradients ----
  std::vector<unsigned char> take_buffer(std::size_t bytes) {
    std::vector<unsigned char> b;
    if (!pool.empty()) {
      b = std::move(pool.back());
      pool.pop_back();
    }
    b.assign(bytes, 0);
    return b;
  }

  // Where this backward's reduced gradients go: own_grads (resident), or — offload.gradients on
  // NVMe — grad_rest for the resident share and the NVMe array, filled bucket by bucket, for the
  // rest, so the partition is never held whole in host memory.
  void ensure_grad_targets() {
    if (!grad_nvme) return;
    if (grad_nvme->filling()) return;
    grad_nvme->begin_fill();
    grad_rest.assign((psize - gn) * ges, 0);
  }

  void retire_oldest() {
    auto f = std::move(inflight.front());
    inflight.pop_front();
    f.handle->wait();
    pool.push_back(std::move(bucket_buf[f.bucket]));
    bucket_buf[f.bucket].clear();
    if (!f.recv.empty()) {
      const std::size_t on = std::min(f.share_begin + f.share_count, gn) - f.share_begin;
      auto t0 = Clock::now();
      grad_nvme->fill({f.share_begin, on}, f.recv.data());
      st.grad_spill_s += seconds_since(t0);
      if (on < f.share_count)  // the share runs past gn: its tail starts grad_rest
        std::memcpy(grad_rest.data(), f.recv.data() + on * ges, (f.share_count - on) * ges);
      pool.push_back(std::move(f.recv));
    }
  }

  void issue_bucket(std::size_t k) {
    const std::size_t b = bucket_begin(k), e = b + bucket_len(k);
    auto counts = part->counts_in(b, e);
    const std::size_t mine = counts[static_cast<std::size_t>(rank)];
    while (inflight.size() >= kMaxBucketsInFlight) retire_oldest();
    const std::size_t s = mine ? std::max(b, own_begin) - own_begin : 0;
    InFlight f;
    f.bucket = k;
    unsigned char* recv = dummy_recv;
    if (!grad_nvme) {
      if (own_grads.size() != psize * ges) own_grads = zeros(psize * ges);
      if (mine) recv = own_grads.data() + s * ges;
    } else if (mine) {
      ensure_grad_targets();
      if (s >= gn) {
        recv = grad_rest.data() + (s - gn) * ges;
      } else {
        f.recv = take_buffer(mine * ges);
        f.share_begin = s;
        f.share_count = mine;
        recv = f.recv.data();
      }
    }
    f.handle = comm.reduce_scatter_async(bucket_buf[k].data(), recv, counts, gdt);
    inflight.push_back(std::move(f));
    bucket_issued[k] = true;
  }

  // Gradients [b, b + n) of the partition into dst, from NVMe [0, gn) and grad_rest [gn, psize).
  void fetch_grads(std::size_t b, std::size_t n, unsigned char* dst) {
    const std::size_t on = b < gn ? std::min(b + n, gn) - b : 0;
    if (on) grad_nvme->get({b, on}, dst);
    if (on < n) std::memcpy(dst + on * ges, grad_rest.data() + (b + on - gn) * ges, (n - on) * ges);
  }

  // grad_stats over the spilled partition, streamed in parts of whole stats tiles (on all of
  // CpuAdam's threads): bitwise what one call over the whole partition gives.
  AdamGradStats spilled_grad_stats(float scale) {
    const std::size_t part_elems = 32 * CpuAdam::kStatsTileElems;  // 1M elements: 2-4 MB
    std::vector<unsigned char> tmp(std::min(part_elems, psize) * ges);
    AdamGradStats r;
    for (std::size_t b = 0; b < psize; b += part_elems) {
      const std::size_t n = std::min(part_elems, psize - b);
      fetch_grads(b, n, tmp.data());
      r = adam->grad_stats_continue(r, tmp.data(), gdt, n, scale);
    }
    return r;
  }

  void set_gradient(TensorId id, const void* grad) {
    require_finalized("set_gradient");
    require_usable("set_gradient");
    check_id(id, "set_gradient");
    if (arrived[id])
      fail(ErrorCode::kInvalidArgument,
           strcat("engine: gradient of tensor '", specs[id].name, "' handed in twice in one step"));
    arrived[id] = true;
    const std::size_t n = specs[id].numel, off = part->offset(id);
    if (n == 0) return;
    if (grad == nullptr)
      fail(ErrorCode::kInvalidArgument, strcat("engine: null gradient for '", specs[id].name, "'"));
    auto t0 = Clock::now();
    const auto* src = static_cast<const unsigned char*>(grad);
    // From here on a failure (a collective, the gradient spill) leaves the backward half done.
    try {
      if (stage < 2) {
        std::memcpy(flat_grads.data() + off * ges, src, n * ges);
      } else {
        for (std::size_t pos = off; pos < off + n;) {
          std::size_t k = pos / bucket_elems;
          std::size_t stop = std::min(off + n, bucket_begin(k) + bucket_len(k));
          if (bucket_buf[k].empty()) bucket_buf[k] = take_buffer(bucket_len(k) * ges);
          std::memcpy(bucket_buf[k].data() + (pos - bucket_begin(k)) * ges, src + (pos - off) * ges,
                      (stop - pos) * ges);
          bucket_pending[k] -= stop - pos;
          if (bucket_pending[k] == 0) issue_bucket(k);
          pos = stop;
        }
      }
    } catch (const std::exception& e) {
      broken = e.what();
      throw;
    }
    st.reduce_s += seconds_since(t0);
  }

  void check_all_arrived() {
    std::string missing;
    for (std::size_t i = 0; i < specs.size(); ++i)
      if (!arrived[i]) missing += strcat(missing.empty() ? "" : ", ", "'", specs[i].name, "'");
    if (!missing.empty())
      fail(ErrorCode::kInvalidArgument, strcat("engine: step() without the gradients of ", missing));
  }

  // Reduces the gradients; returns the rank's gradient range (opt_count elements).
  const unsigned char* reduce_gradients() {
    auto t0 = Clock::now();
    check_all_arrived();
    const unsigned char* g = nullptr;
    if (stage == 0) {
      if (world > 1) comm.all_reduce(flat_grads.data(), flat_grads.data(), part->flat_size(), gdt);
      g = flat_grads.data();
    } else if (stage == 1) {
      if (world > 1)
        comm.reduce_scatter(flat_grads.data(), flat_grads.data() + own_begin * ges, psize, gdt);
      g = flat_grads.data() + own_begin * ges;
    } else {
      // Buckets holding only padding are never handed in: their part of own_grads stays zero.
      while (!inflight.empty()) retire_oldest();
      for (std::size_t k = 0; k < nbuckets; ++k) {
        if (!bucket_issued[k] && bucket_expected[k] > 0)
          fail(ErrorCode::kInternal, strcat("engine: bucket ", k, " incomplete at step()"));
        if (!bucket_buf[k].empty()) {
          pool.push_back(std::move(bucket_buf[k]));
          bucket_buf[k].clear();
        }
      }
      if (grad_nvme) {
        ensure_grad_targets();  // (no bucket had a share for this rank)
        auto t1 = Clock::now();
        grad_nvme->end_fill();
        st.grad_spill_s += seconds_since(t1);
        g = nullptr;  // spilled: read back by spilled_grad_stats and fetch_grads
      } else {
        if (own_grads.size() != psize * ges) own_grads = zeros(psize * ges);
        g = own_grads.data();
      }
    }
    st.reduce_s += seconds_since(t0);
    return g;
  }

  // ---- stage 3 gathers ----
  void start_gather(TensorId id) {
    if (is_gathered[id] || gathering[id]) return;
    const std::size_t n = specs[id].numel, off = part->offset(id);
    gathered[id].assign(n * pes, 0);
    if (n == 0) {
      is_gathered[id] = true;
      return;
    }
    auto counts = part->counts_in(off, off + n);
    const unsigned char* send = own_params.data();
    if (const std::size_t mine = counts[static_cast<std::size_t>(rank)]) {
      const std::size_t b = std::max(off, own_begin) - own_begin;
      if (pn) {
        gather_send[id].resize(mine * pes);
        read_own(b, mine, gather_send[id].data());
        send = gather_send[id].data();
      } else {
        send += b * pes;
      }
    }
    gathering[id] = comm.all_gather_async(send, gathered[id].data(), counts, pdt);
  }
  void finish_gather(TensorId id) {
    if (gathering[id]) {
      auto h = std::move(gathering[id]);
      h->wait();
      is_gathered[id] = true;
      if (pn) {
        gather_send[id].clear();
        gather_send[id].shrink_to_fit();
      }
    }
  }
  void drop(TensorId id) {
    finish_gather(id);
    is_gathered[id] = false;
    gathered[id].clear();
    gathered[id].shrink_to_fit();
  }

  void gather(std::span<const TensorId> ids) {
    require_finalized("gather");
    for (auto id : ids) check_id(id, "gather");
    if (stage < 3) return;
    auto t0 = Clock::now();
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
    st.gather_s += seconds_since(t0);
  }
  void prefetch(std::span<const TensorId> ids) {
    require_finalized("prefetch");
    for (auto id : ids) check_id(id, "prefetch");
    if (stage < 3) return;
    for (auto id : ids) start_gather(id);
  }
  void release(std::span<const TensorId> ids) {
    require_finalized("release");
    for (auto id : ids) check_id(id, "release");
    if (stage < 3) return;
    auto t0 = Clock::now();
    for (auto id : ids) drop(id);
    st.gather_s += seconds_since(t0);
  }

  const void* param(TensorId id) const {
    require_finalized("param");
    check_id(id, "param");
    if (stage < 3) return flat_params.data() + part->offset(id) * pes;
    if (!is_gathered[id])
      fail(ErrorCode::kInvalidArgument,
           strcat("engine: param('", specs[id].name, "') at stage 3 without gather()"));
    return gathered[id].data();
  }

  // ---- the step ----
  StepResult step() {
    require_finalized("step");
    auto t_step = Clock::now();
    ++st.steps;
    if (stage == 3) {  // in-flight prefetches read own_params, which Adam is about to change
      for (std::size_t i = 0; i < specs.size(); ++i) drop(i);
      trace_prev = std::move(trace_cur);
      trace_cur.clear();
      trace_pos = 0;
      trace_ok = true;
    }
    const unsigned char* g = reduce_gradients();

    // Norm and overflow over the rank's partition, agreed through an all-gather of
    // (sum of squares as FP64 bits, finite flag): summed in rank order, identical everywhere.
    auto t0 = Clock::now();
    const double inv = 1.0 / (scale * world);
    const std::size_t stat_begin = stage == 0 ? own_begin : 0;
    AdamGradStats local = g ? adam->grad_stats(g + stat_begin * ges, gdt, psize, static_cast<float>(inv))
                            : spilled_grad_stats(static_cast<float>(inv));
    std::uint32_t mine[4];
    std::uint64_t bits = std::bit_cast<std::uint64_t>(local.finite ? local.sum_sq : 0.0);
    mine[0] = static_cast<std::uint32_t>(bits);
    mine[1] = static_cast<std::uint32_t>(bits >> 32);
    mine[2] = local.finite ? 1u : 0u;
    mine[3] = 0;
    std::vector<std::uint32_t> all(4 * static_cast<std::size_t>(world));
    if (world > 1) {
      comm.all_gather(mine, all.data(), 4, DType::kFp32);
    } else {
      std::memcpy(all.data(), mine, sizeof(mine));
    }
    bool finite = true;
    double sum_sq = 0;
    for (int r = 0; r < world; ++r) {
      const std::uint32_t* p = all.data() + 4 * r;
      finite = finite && p[2] == 1u;
      sum_sq += std::bit_cast<double>(static_cast<std::uint64_t>(p[0]) | (static_cast<std::uint64_t>(p[1]) << 32));
    }
    st.norm_s += seconds_since(t0);

    StepResult res;
    res.overflow = !finite;
    if (!finite) {
      ++st.skipped_steps;
      good_steps = 0;
      if (scaling && cfg.precision.loss_scale.dynamic)
        scale = std::max(cfg.precision.loss_scale.min_scale,
                         scale * cfg.precision.loss_scale.backoff_factor);
      if (rank == 0) log_info("engine: gradient overflow, step skipped; loss scale now ", scale);
    } else {
      res.grad_norm = std::sqrt(sum_sq);
      const double clip = cfg.optimizer.grad_clip;
      res.clip_coef = clip > 0 && res.grad_norm > clip ? clip / (res.grad_norm + 1e-6) : 1.0;
      const float grad_scale = static_cast<float>(res.clip_coef / scale);  // after g / world
      st.last_grad_norm = res.grad_norm;

      t0 = Clock::now();
      ++adam_step;
      unsigned char* p = stage == 3 ? own_params.data() : flat_params.data() + opt_begin * pes;
      const std::vector<Range> sgs = part->sub_groups(0, opt_count);
      // offload.gradients nvme: the NVMe share was spilled during the backward; the update reads
      // it back piece by piece (the array reads ahead).
      auto grad_of = [&](Range r) -> const unsigned char* {
        if (!grad_nvme) return g + r.begin * ges;
        if (r.begin >= gn) return grad_rest.data() + (r.begin - gn) * ges;
        grad_tmp.resize(r.count * ges);
        fetch_grads(r.begin, r.count, grad_tmp.data());
        return grad_tmp.data();
      };
      state->update(sgs, [&](Range r, const zero::StateView& v) {
        const unsigned char* grad = grad_of(r);
        if (pn) param_tmp.resize(r.count * pes);
        unsigned char* copy = pn ? param_tmp.data() : p + r.begin * pes;
        // One Adam call per parameter group the piece spans (usually one): element-wise, so the
        // cut changes no bit.
        for_each_group_run(opt_begin + r.begin, r.count, [&](std::size_t o, std::size_t n, GroupId gid) {
          AdamParams hp = AdamParams::from_config(cfg.optimizer);
          hp.lr = groups[gid].lr;
          hp.weight_decay = groups[gid].weight_decay;
          AdamTensors t;
          t.param = v.master + o;
          t.exp_avg = v.exp_avg + o;
          t.exp_avg_sq = v.exp_avg_sq + o;
          t.grad = grad + o * ges;
          t.grad_dtype = gdt;
          t.param_copy = copy + o * pes;
          t.param_copy_dtype = pdt;
          t.n = n;
          const AdamStepOptions so{adam_step, grad_scale, false, static_cast<float>(world)};
          if (device_adam) device_adam->step(hp, t, so);
          else adam->step(hp, t, so);
        });
        if (pn) write_own(r.begin, r.count, param_tmp.data());
      });
      if (param_nvme) param_nvme->flush();
      st.optimizer_s += seconds_since(t0);
      if ((stage == 1 || stage == 2) && world > 1) {
        t0 = Clock::now();
        comm.all_gather(flat_params.data() + own_begin * pes, flat_params.data(), psize, pdt);
        st.gather_s += seconds_since(t0);
      }
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
    st.step_s += seconds_since(t_step);
    return res;
  }

  // fn(offset in the run [flat_b, flat_b + n), count, group) for the group runs covering it.
  template <typename F>
  void for_each_group_run(std::size_t flat_b, std::size_t n, F&& fn) const {
    auto it = std::upper_bound(group_runs.begin(), group_runs.end(), flat_b,
                               [](std::size_t x, const auto& run) { return x < run.first; });
    --it;  // group_runs[0].first == 0 <= flat_b
    for (std::size_t pos = flat_b; pos < flat_b + n; ++it) {
      const std::size_t stop = std::next(it) == group_runs.end() ? flat_b + n
                                                                 : std::min(flat_b + n, std::next(it)->first);
      if (stop > pos) fn(pos - flat_b, stop - pos, it->second);
      pos = std::max(pos, stop);
    }
  }

  // ---- optimizer state access (read_state / write_state) ----
  // The part of tensor id's flat range [off, off + n) that this rank's optimizer range holds:
  // {begin within the optimizer range, count}, and the all-gather counts (stages 1-3).
  struct StatePart {
    Range local;
    std::vector<std::size_t> counts;
  };
  StatePart state_part(TensorId id) const {
    const std::size_t n = specs[id].numel, off = part->offset(id);
    StatePart sp;
    if (stage == 0) {
      sp.local = {off, n};
      return sp;
    }
    sp.counts = part->counts_in(off, off + n);
    const std::size_t mine = sp.counts[static_cast<std::size_t>(rank)];
    sp.local = {mine ? std::max(off, own_begin) - own_begin : 0, mine};
    return sp;
  }
  static float* state_array(const zero::StateView& v, StateKind kind) {
    return kind == StateKind::kMaster ? v.master : kind == StateKind::kExpAvg ? v.exp_avg : v.exp_avg_sq;
  }
  void check_state_call(TensorId id, std::size_t size, const char* what) const {
    require_finalized(what);
    require_usable(what);
    check_id(id, what);
    if (size != specs[id].numel)
      fail(ErrorCode::kInvalidArgument, strcat("engine: ", what, "('", specs[id].name, "'): ", size,
                                               " elements given, the tensor has ", specs[id].numel));
  }
  void read_state(TensorId id, StateKind kind, std::span<float> out) {
    check_state_call(id, out.size(), "read_state");
    const std::size_t n = specs[id].numel;
    if (n == 0) return;
    const StatePart sp = state_part(id);
    std::vector<float> mine(sp.local.count);
    if (sp.local.count) {
      zero::StateView v = state->acquire(sp.local);
      std::memcpy(mine.data(), state_array(v, kind), sp.local.count * sizeof(float));
      state->release(sp.local, false);
    }
    if (stage == 0 || world == 1) {
      std::copy(mine.begin(), mine.end(), out.begin());
      return;
    }
    comm.all_gather(mine.data(), out.data(), sp.counts, DType::kFp32);
  }
  void write_state(TensorId id, StateKind kind, std::span<const float> in) {
    check_state_call(id, in.size(), "write_state");
    const std::size_t n = specs[id].numel, off = part->offset(id);
    if (n == 0) return;
    const StatePart sp = state_part(id);
    const std::size_t from = sp.local.count ? opt_begin + sp.local.begin - off : 0;  // in `in`
    if (sp.local.count) {
      zero::StateView v = state->acquire(sp.local);
      std::memcpy(state_array(v, kind), in.data() + from, sp.local.count * sizeof(float));
      state->release(sp.local, true);
    }
    if (kind != StateKind::kMaster) return;
    if (stage < 3) {
      for (std::size_t i = 0; i < n; ++i) store_elem(flat_params.data() + off * pes, i, pdt, in[i]);
      return;
    }
    if (sp.local.count) {
      std::vector<unsigned char> tmp(sp.local.count * pes);
      for (std::size_t i = 0; i < sp.local.count; ++i) store_elem(tmp.data(), i, pdt, in[from + i]);
      write_own(sp.local.begin, sp.local.count, tmp.data());
      if (param_nvme) param_nvme->flush();
    }
    finish_gather(id);
    if (is_gathered[id])
      for (std::size_t i = 0; i < n; ++i) store_elem(gathered[id].data(), i, pdt, in[i]);
  }

  // ---- checkpoints (zero/checkpoint.cpp) ----
  zero::RankState rank_state() {
    Impl& m = *this;
    zero::RankState r;
    r.rank = m.rank;
    r.world = m.world;
    r.stage = m.stage;
    r.param_dtype = m.pdt;
    r.flat_size = m.part->flat_size();
    r.partition_size = m.psize;
    r.partition = m.part.get();
    r.opt_begin = m.opt_begin;
    if (m.stage == 3 && m.pn) {  // materialized for the checkpoint (read back after a load)
      m.ckpt_params.resize(m.psize * m.pes);
      m.read_own(0, m.psize, m.ckpt_params.data());
      r.params = {m.ckpt_params.data(), m.ckpt_params.size()};
    } else if (m.stage == 3) {
      r.params = {m.own_params.data(), m.own_params.size()};
    } else if (m.stage == 0) {
      r.params = {m.flat_params.data(), m.flat_params.size()};
    } else {
      r.params = {m.flat_params.data() + m.own_begin * m.pes, m.psize * m.pes};
    }
    r.store = m.state.get();
    r.adam_step = m.adam_step;
    r.loss_scale = m.scale;
    r.good_steps = m.good_steps;
    r.steps = m.st.steps;
    r.applied_steps = m.st.applied_steps;
    r.skipped_steps = m.st.skipped_steps;
    return r;
  }
};

void Engine::save_checkpoint(const std::string& dir) {
  impl_->require_finalized("save_checkpoint");
  impl_->require_usable("save_checkpoint");
  zero::RankState r = impl_->rank_state();
  r.config_yaml = to_yaml(impl_->cfg);
  zero::save_checkpoint(dir, r, impl_->comm);
  impl_->ckpt_params.clear();
  impl_->ckpt_params.shrink_to_fit();
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
    if (r.restore_started) m.broken = strcat("checkpoint load failed while restoring: ", e.what());
    throw;
  }
  if (m.stage == 3 && m.pn) {
    m.write_own(0, m.psize, m.ckpt_params.data());
    m.param_nvme->flush();
    m.ckpt_params.clear();
    m.ckpt_params.shrink_to_fit();
  }
  if ((m.stage == 1 || m.stage == 2) && m.world > 1)
    m.comm.all_gather(m.flat_params.data() + m.own_begin * m.pes, m.flat_params.data(), m.psize, m.pdt);
  m.adam_step = r.adam_step;
  m.scale = r.loss_scale;
  m.good_steps = r.good_steps;
  m.st.steps = r.steps;
  m.st.applied_steps = r.applied_steps;
  m.st.skipped_steps = r.skipped_steps;
  m.st.loss_scale = r.loss_scale;
  std::fill(m.arrived.begin(), m.arrived.end(), false);
  if (m.stage >= 2) m.reset_buckets();
}

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
}  // namespace

TensorId Engine::add_parameter(std::string name, std::span<const float> initial, GroupId group) {
  if (impl_->finalized)
    fail(ErrorCode::kInvalidArgument, strcat("engine: add_parameter('", name, "') after finalize()"));
  if (group >= impl_->groups.size())
    fail(ErrorCode::kInvalidArgument, strcat("engine: add_parameter('", name, "'): unknown group ", group,
                                             " (", impl_->groups.size(), " groups)"));
  impl_->tensor_group.push_back(group);
  impl_->specs.push_back({std::move(name), initial.size()});
  impl_->initial.emplace_back(initial.begin(), initial.end());
  return impl_->specs.size() - 1;
}
GroupId Engine::add_param_group(const ParamGroupOptions& options) {
  if (impl_->finalized) fail(ErrorCode::kInvalidArgument, "engine: add_param_group() after finalize()");
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
namespace {
ParamGroupOptions& group_ref(std::vector<ParamGroupOptions>& groups, GroupId g, const char* what) {
  if (g >= groups.size())
    fail(ErrorCode::kInvalidArgument, strcat("engine: ", what, ": unknown group ", g, " (", groups.size(), " groups)"));
  return groups[g];
}
}  // namespace
void Engine::set_lr(double lr, GroupId group) {
  check_group_value(lr, "set_lr: lr");
  group_ref(impl_->groups, group, "set_lr").lr = lr;
}
double Engine::lr(GroupId group) const {
  return group_ref(impl_->groups, group, "lr").lr;
}
void Engine::set_weight_decay(double weight_decay, GroupId group) {
  check_group_value(weight_decay, "set_weight_decay: weight_decay");
  group_ref(impl_->groups, group, "set_weight_decay").weight_decay = weight_decay;
}
double Engine::weight_decay(GroupId group) const {
  return group_ref(impl_->groups, group, "weight_decay").weight_decay;
}
Device& Engine::device() {
  impl_->require_finalized("device");
  return *impl_->main_device;
}
void Engine::set_gradient_host(TensorId id, const void* grad) { impl_->set_gradient(id, grad); }
void Engine::read_state(TensorId id, StateKind kind, std::span<float> out) { impl_->read_state(id, kind, out); }
void Engine::write_state(TensorId id, StateKind kind, std::span<const float> in) {
  impl_->write_state(id, kind, in);
}
std::int64_t Engine::optimizer_step() const { return impl_->adam_step; }
void Engine::set_optimizer_step(std::int64_t step) {
  if (step < 0) fail(ErrorCode::kInvalidArgument, strcat("engine: set_optimizer_step(", step, "): must be >= 0"));
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
void Engine::read_param(TensorId id, std::span<float> out) const {
  const void* p = impl_->param(id);
  const std::size_t n = impl_->specs[id].numel;
  if (out.size() != n)
    fail(ErrorCode::kInvalidArgument, strcat("engine: read_param: ", out.size(), " != ", n, " elements"));
  for (std::size_t i = 0; i < n; ++i) out[i] = load_elem(p, i, impl_->pdt);
}
void Engine::gather(std::span<const TensorId> ids) { impl_->gather(ids); }
void Engine::prefetch(std::span<const TensorId> ids) { impl_->prefetch(ids); }
void Engine::release(std::span<const TensorId> ids) { impl_->release(ids); }
double Engine::loss_scale() const { return impl_->scale; }
void Engine::set_gradient(TensorId id, const void* grad) { impl_->set_gradient(id, grad); }
void Engine::set_gradients(std::span<const void* const> grads) {
  if (grads.size() != impl_->specs.size())
    fail(ErrorCode::kInvalidArgument, strcat("engine: set_gradients: ", grads.size(),
                                             " gradients for ", impl_->specs.size(), " tensors"));
  for (std::size_t i = 0; i < grads.size(); ++i) impl_->set_gradient(i, grads[i]);
}
StepResult Engine::step() {
  impl_->require_finalized("step");
  impl_->require_usable("step");
  impl_->check_all_arrived();  // a usage error, before anything changes: not a failed step
  try {
    return impl_->step();
  } catch (const std::exception& e) {
    std::string what = e.what();
    if (what.size() > 300) what = what.substr(0, 300) + "...";
    impl_->broken = what;
    throw;
  }
}
EngineStats Engine::stats() const {
  EngineStats s = impl_->st;
  s.loss_scale = impl_->scale;
  s.comm = impl_->comm.stats();
  return s;
}

}  // namespace strata
