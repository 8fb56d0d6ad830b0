// The engine's internals for tests and measurements (see engine_access.hpp).
#include "zero/engine_access.hpp"

#include <cstring>

#include "zero/engine_impl.hpp"

namespace strata::zero {

void EngineAccess::set_storage_wrap(Engine& e, StorageWrap wrap) {
  if (e.impl_->finalized)
    fail(ErrorCode::kInvalidArgument, "engine: set_storage_wrap after finalize()");
  e.impl_->wrap = std::move(wrap);
}

RankStorage& EngineAccess::storage(Engine& e) {
  e.impl_->require_finalized("storage");
  return *e.impl_->storage;
}

StorageReport EngineAccess::report(const Engine& e) {
  e.impl_->require_finalized("report");
  return e.impl_->report();
}

const std::vector<Chunk>& EngineAccess::chunks(const Engine& e) { return e.impl_->chunks; }

tier::StreamStats EngineAccess::last_update(const Engine& e) { return e.impl_->last_update; }

void EngineAccess::set_pipelined(Engine& e, bool on) { e.impl_->pipelined = on; }

void EngineAccess::set_stage_device_memory(Engine& e, bool on) {
  e.impl_->stage_device_memory = on;
}

tier::StreamStats EngineAccess::measure(Engine& e, Measure what, bool pipelined) {
  Engine::Impl& m = *e.impl_;
  m.require_finalized("measure");
  m.require_usable("measure");
  auto items = m.update_items(false);
  tier::StreamOptions o = m.stream_options(tier::Where::kHost, "measurement");
  o.pipelined = pipelined;
  if (what == Measure::kUpdate) {
    // Adam alone: the first chunk's staged state and gradients, copied once, reused for every
    // chunk's update (same element counts and group runs as the step).
    if (items.empty()) return {};
    std::vector<std::vector<unsigned char>> held;
    std::vector<std::uint64_t> sizes;
    tier::run_stream(
        m.store(), std::span(items).first(1),
        [&](std::size_t, std::span<void* const> v) {
          for (std::size_t k = 0; k < v.size(); ++k) {
            const auto& p = items[0].parts[k];
            const std::uint64_t n = p.bytes ? p.bytes : m.store().info(p.id).bytes;
            held.emplace_back(static_cast<unsigned char*>(v[k]),
                              static_cast<unsigned char*>(v[k]) + n);
          }
        },
        o);
    std::vector<const Chunk*> of;
    for (const Chunk& c : m.chunks)
      if (c.opt_tier != Tier::kGpu) of.push_back(&c);
    std::size_t biggest = 0;
    for (const Chunk* c : of) biggest = std::max(biggest, c->r.count);
    std::vector<float> state(3 * biggest);
    std::vector<unsigned char> grads(biggest * m.ges), params(biggest * m.pes);
    for (std::size_t i = 0; i < biggest; ++i) {
      const std::size_t j = i % of[0]->r.count;
      const auto* s = reinterpret_cast<const float*>(held[0].data());
      state[i] = s[j];
      state[biggest + i] = s[of[0]->r.count + j];
      state[2 * biggest + i] = s[2 * of[0]->r.count + j];
      std::memcpy(grads.data() + i * m.ges, held[1].data() + j * m.ges, m.ges);
    }
    tier::StreamStats s;
    auto t0 = Clock::now();
    for (const Chunk* c : of) {
      const StateView v{state.data(), state.data() + biggest, state.data() + 2 * biggest,
                        c->r.count};
      m.adam_chunk(*c, v, grads.data(), params.data(), false, 1.0f);
    }
    s.t_compute = s.t_total = seconds_since(t0);
    s.items = of.size();
    return s;
  }
  for (auto& it : items) {
    it.parts.resize(2);  // state and gradients
    if (what == Measure::kRead) it.parts[0].out = false;
    if (what == Measure::kWrite) {
      it.parts[0].in = false;
      it.parts.resize(1);
    }
  }
  return tier::run_stream(
      m.store(), items, [](std::size_t, std::span<void* const>) {}, o);
}

}  // namespace strata::zero
