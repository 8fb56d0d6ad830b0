// The engine's chunk grid and its buffers in the rank's TierStore (see engine_impl.hpp, "Storage").
#include <algorithm>
#include <cmath>
#include <cstring>

#include "strata/io_file.hpp"
#include "strata/log.hpp"
#include "zero/engine_impl.hpp"

namespace strata {
namespace {

constexpr std::uint64_t kAlign = 4096;
std::uint64_t round_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

// The leading elements of `count` that a placement puts off the gpu (rounded up to 1024).
std::size_t leading(const OffloadTarget& t, std::size_t count) {
  if (t.tier == Tier::kGpu || t.fraction <= 0 || count == 0) return 0;
  const double want = std::ceil(std::min(1.0, t.fraction) * static_cast<double>(count));
  return std::min<std::size_t>(count, round_up(static_cast<std::uint64_t>(want), 1024));
}

}  // namespace

void Engine::Impl::build_layout() {
  const std::size_t count = opt_count;
  const std::size_t opt_on = leading(cfg.offload.optimizer, count);
  const std::size_t grad_on = stage >= 2 ? leading(cfg.offload.gradients, count) : 0;
  const std::size_t param_on = stage == 3 ? leading(cfg.offload.params, count) : 0;
  const bool staging =
      storage->device().kind() == DeviceKind::kCuda || opt_on || grad_on || param_on;
  // Chunk capacity: what one pinned buffer stages — master | m | v + gradients + parameters, each
  // padded to 4096 B.
  chunk_cap = count ? count : 1;
  if (staging) {
    // The most elements n with round_up(12n) + round_up(n × grad) + round_up(n × param) <= the
    // buffer, cut to a multiple of 64 (1024 when large).
    const std::uint64_t buf = cfg.tiers.host.buffer_size;
    auto fits = [&](std::uint64_t n) {
      return round_up(12 * n, kAlign) + round_up(n * ges, kAlign) + round_up(n * pes, kAlign) <=
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
    std::uint64_t cap = lo >= 1024 ? lo / 1024 * 1024 : lo >= 64 ? lo / 64 * 64 : lo;
    if (cap == 0)
      fail(ErrorCode::kInvalidArgument,
           strcat("engine: tiers.host.buffer_size ", buf, " bytes is below the minimum of ",
                  3 * kAlign,
                  " bytes: one pinned buffer stages a chunk (FP32 master and moments, gradients, "
                  "parameters: ",
                  12 + ges + pes, " B per element) in 3 regions of 4096-byte alignment"));
    chunk_cap = static_cast<std::size_t>(cap);
  }
  chunks.clear();
  for (const Range& sg : part->sub_groups(0, count)) {
    for (std::size_t b = sg.begin; b < sg.end();) {
      std::size_t e = std::min(sg.end(), b + chunk_cap);
      for (std::size_t cut : {opt_on, grad_on, param_on})
        if (cut > b && cut < e) e = cut;
      zero::Chunk c;
      c.r = {b, e - b};
      c.opt_tier = b < opt_on ? cfg.offload.optimizer.tier : Tier::kGpu;
      c.grad_tier = b < grad_on ? cfg.offload.gradients.tier : Tier::kGpu;
      c.param_tier = b < param_on ? cfg.offload.params.tier : Tier::kGpu;
      chunks.push_back(c);
      b = e;
    }
  }

  storage->open(storage_needs());

  // The buffers.
  const std::size_t flat = part->flat_size();
  if (stage < 3 && flat) {
    params_id = add_buffer("params", flat * pes, Tier::kGpu, zero::BufferKind::kParams);
    params_dev =
        static_cast<unsigned char*>(store().acquire(params_id, Tier::kGpu, Access::kRead, timeout));
  }
  if (stage < 2 && flat) {
    grads_id = add_buffer("grads", flat * ges, Tier::kGpu, zero::BufferKind::kGrads);
    grads_dev =
        static_cast<unsigned char*>(store().acquire(grads_id, Tier::kGpu, Access::kRead, timeout));
  }
  for (std::size_t k = 0; k < chunks.size(); ++k) {
    zero::Chunk& c = chunks[k];
    c.opt = add_buffer(strcat("opt.", k), 12 * c.r.count, c.opt_tier, zero::BufferKind::kOptimizer,
                       cfg.offload.optimizer.pin_memory);
    if (stage >= 2)
      c.grad = add_buffer(strcat("grad.", k), c.r.count * ges, c.grad_tier,
                          zero::BufferKind::kGrads, cfg.offload.gradients.pin_memory);
    if (stage == 3)
      c.param = add_buffer(strcat("param.", k), c.r.count * pes, c.param_tier,
                           zero::BufferKind::kParams, cfg.offload.params.pin_memory);
  }
  norm_id = add_buffer("rt.norm", 16 * static_cast<std::uint64_t>(world + 1), Tier::kGpu,
                       zero::BufferKind::kRuntime);
  norm_dev =
      static_cast<unsigned char*>(store().acquire(norm_id, Tier::kGpu, Access::kRead, timeout));
  word_stream = storage->device().create_stream();
}

zero::StorageNeeds Engine::Impl::storage_needs() const {
  zero::StorageNeeds n;
  std::uint64_t need = 0;
  for (const zero::Chunk& c : chunks) {
    const std::uint64_t e = c.r.count;
    const bool grads_cpu = stage >= 2 && c.grad_tier == Tier::kCpu;
    const bool params_cpu = stage == 3 && c.param_tier == Tier::kCpu;
    if (c.opt_tier != Tier::kGpu) {  // the update computes on the host
      std::uint64_t slot = c.opt_tier == Tier::kNvme ? round_up(12 * e, kAlign) : 0;
      if (!grads_cpu) slot += round_up(e * ges, kAlign);
      if (!params_cpu) slot += round_up(e * pes, kAlign);
      need = std::max(need, slot);
    }
    if (!grads_cpu) need = std::max(need, round_up(e * ges, kAlign));  // the statistics pass
    if (c.opt_tier == Tier::kNvme) n.nvme_bytes += round_up(12 * e, kAlign);
    if (stage >= 2 && c.grad_tier == Tier::kNvme) n.nvme_bytes += round_up(e * ges, kAlign);
    if (stage == 3 && c.param_tier == Tier::kNvme) n.nvme_bytes += round_up(e * pes, kAlign);
  }
  const bool offloaded = std::any_of(chunks.begin(), chunks.end(), [&](const zero::Chunk& c) {
    return c.opt_tier != Tier::kGpu || (stage >= 2 && c.grad_tier != Tier::kGpu) ||
           (stage == 3 && c.param_tier != Tier::kGpu);
  });
  n.pool = offloaded || storage->device().kind() == DeviceKind::kCuda;
  if (n.pool) {
    // tiers.host.buffer_size, unless the whole state is smaller than one chunk of it (then the
    // buffers are sized to the need).
    const bool capped = std::any_of(chunks.begin(), chunks.end(),
                                    [&](const zero::Chunk& c) { return c.r.count == chunk_cap; });
    n.pool_buffer_size = capped ? cfg.tiers.host.buffer_size
                                : std::min<std::uint64_t>(cfg.tiers.host.buffer_size,
                                                          std::max<std::uint64_t>(need, kAlign));
    n.pool_buffers = static_cast<std::uint32_t>(std::min<std::size_t>(
        cfg.tiers.host.buffer_count, std::max<std::size_t>(1, chunks.size())));
  }
  n.movers = std::clamp<std::uint32_t>(n.pool_buffers, 2, 4);
  return n;
}

BufferId Engine::Impl::add_buffer(const std::string& name, std::uint64_t bytes, Tier home,
                                  zero::BufferKind kind, bool pinned) {
  BufferSpec spec;
  spec.name = name;
  spec.bytes = bytes;
  spec.dtype = kind == zero::BufferKind::kOptimizer ? DType::kFp32
               : kind == zero::BufferKind::kGrads   ? gdt
                                                    : pdt;
  spec.home = home;
  spec.allowed = {home};
  spec.pinned = pinned && home == Tier::kCpu;
  const BufferId id = store().register_buffer(spec);
  kinds.emplace_back(id, kind);
  return id;
}

void Engine::Impl::put(BufferId id, std::uint64_t offset, std::uint64_t bytes, const void* host) {
  if (bytes == 0) return;
  const BufferInfo info = store().info(id);
  if (info.home != Tier::kNvme) {
    store().write(id, offset, bytes, host, Tier::kCpu).wait(timeout);
    return;
  }
  IoBuffer buf = IoBuffer::allocate(store().padded_bytes(id), HugePageMode::kNone);  // zero padding
  if (offset != 0 || bytes != info.bytes)
    store().read(id, 0, 0, buf.data(), Tier::kCpu, true).wait(timeout);
  std::memcpy(buf.bytes() + offset, host, bytes);
  store().write(id, 0, 0, buf.data(), Tier::kCpu).wait(timeout);
}

void Engine::Impl::get(BufferId id, std::uint64_t offset, std::uint64_t bytes, void* host) {
  if (bytes == 0) return;
  store().read(id, offset, bytes, host, Tier::kCpu).wait(timeout);
}

Engine::Impl::DevBuf Engine::Impl::make_dev_buf(const std::string& name, std::uint64_t bytes) {
  DevBuf d;
  d.id =
      add_buffer(name, std::max<std::uint64_t>(bytes, 16), Tier::kGpu, zero::BufferKind::kRuntime);
  d.ptr = static_cast<unsigned char*>(store().acquire(d.id, Tier::kGpu, Access::kRead, timeout));
  return d;
}

void Engine::Impl::free_dev_buf(DevBuf& d) {
  if (!d.id) return;
  store().release(d.id, Tier::kGpu);
  store().unregister_buffer(d.id);
  kinds.erase(
      std::remove_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == d.id; }),
      kinds.end());
  d = {};
}

void Engine::Impl::initialize_state(std::vector<float>& init) {
  // Parameters in the model dtype.
  constexpr std::size_t kPiece = 1 << 20;
  std::vector<unsigned char> tmp;
  if (stage < 3) {
    const std::size_t flat = part->flat_size();
    for (std::size_t b = 0; b < flat; b += kPiece) {
      const std::size_t n = std::min(kPiece, flat - b);
      tmp.resize(n * pes);
      for (std::size_t i = 0; i < n; ++i) store_elem(tmp.data(), i, pdt, init[b + i]);
      put(params_id, b * pes, n * pes, tmp.data());
    }
  }
  for (const zero::Chunk& c : chunks) {
    const std::size_t n = c.r.count;
    if (stage == 3) {
      tmp.resize(n * pes);
      for (std::size_t i = 0; i < n; ++i)
        store_elem(tmp.data(), i, pdt, init[own_begin + c.r.begin + i]);
      put(c.param, 0, n * pes, tmp.data());
    }
    // FP32 master from the initial values, moments zero.
    tmp.assign(12 * n, 0);
    std::memcpy(tmp.data(), init.data() + opt_begin + c.r.begin, n * sizeof(float));
    put(c.opt, 0, 12 * n, tmp.data());
  }
}

const zero::Chunk& Engine::Impl::chunk_at(std::size_t element) const {
  auto it = std::upper_bound(chunks.begin(), chunks.end(), element,
                             [](std::size_t x, const zero::Chunk& c) { return x < c.r.begin; });
  if (it == chunks.begin())
    fail(ErrorCode::kInternal, strcat("engine: no chunk holds element ", element));
  return *std::prev(it);
}

zero::StorageReport Engine::Impl::report() const {
  zero::StorageReport r;
  const TierStore& s = storage->store();
  for (const auto& [id, kind] : kinds) {
    const BufferInfo info = s.info(id);
    r.bytes[static_cast<int>(info.home)][static_cast<int>(kind)] += s.padded_bytes(id);
  }
  if (const PinnedPool* p = const_cast<zero::RankStorage&>(*storage).pool())
    r.pool = std::uint64_t(p->buffer_count()) * p->buffer_size();
  for (Tier t : {Tier::kGpu, Tier::kCpu, Tier::kNvme}) {
    const TierUsage u = s.usage(t);
    r.used[static_cast<int>(t)] = u.used;
    r.budget[static_cast<int>(t)] = u.budget;
  }
  return r;
}

}  // namespace strata
