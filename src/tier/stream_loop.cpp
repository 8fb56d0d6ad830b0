// The one pipelined loop (see stream_loop.hpp).
#include "tier/stream_loop.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <exception>
#include <optional>

#include "core/checked_math.hpp"
#include "device/pinned_pool.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata::tier {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}
constexpr std::uint64_t kAlign = 4096;

Tier compute_tier(Where w) { return w == Where::kHost ? Tier::kCpu : Tier::kGpu; }

// How one part is seen by the compute.
struct PartPlan {
  bool in_place = false;
  bool pending_out = false;             // in place, written to the pending version (out views)
  Tier tier = Tier::kCpu;               // in place: the tier whose copy is acquired
  std::uint64_t offset = 0, bytes = 0;  // the range, resolved
  std::uint64_t slot_offset = 0;        // staged: where in the slot
  std::uint64_t slot_bytes = 0;         // staged: room it takes (padded)
  bool whole = false;                   // the whole buffer (NVMe transfers need it)
};

struct ItemPlan {
  std::array<PartPlan, kMaxParts> parts{};
  std::uint64_t slot_bytes = 0;
};

// Whether a part whose buffer's home is `home` is viewed in place (else staged in a slot).
// device_is_host: the store's Device is the host-emulated one and device memory may be viewed by
// kHost compute (StreamOptions::stage_device_memory is off).
bool views_in_place(Tier home, Where where, bool device_is_host) {
  return home == compute_tier(where) ||
         (where == Where::kHost && home == Tier::kGpu && device_is_host);
}

// Whether the run's kHost compute may view device memory in place: the store's Device is the
// host-emulated one and options.stage_device_memory is off.
bool device_is_host(const TierStore& store, const StreamOptions& o) {
  return !o.stage_device_memory && store.device().kind() == DeviceKind::kHost;
}

ItemPlan plan_item(const TierStore& store, const StreamItem& item, Where where, bool device_is_host,
                   bool out_views) {
  if (item.parts.size() > kMaxParts)
    fail(ErrorCode::kInvalidArgument,
         strcat("stream: an item has ", item.parts.size(), " parts (at most ", kMaxParts, ")"));
  ItemPlan p;
  for (std::size_t k = 0; k < item.parts.size(); ++k) {
    const StreamPart& sp = item.parts[k];
    const BufferInfo info = store.info(sp.id);
    PartPlan& pp = p.parts[k];
    if (sp.offset > info.bytes)
      fail(ErrorCode::kInvalidArgument, strcat("stream: part of '", info.name, "' at offset ",
                                               sp.offset, " beyond its ", info.bytes, " bytes"));
    pp.offset = sp.offset;
    pp.bytes = sp.bytes ? sp.bytes : info.bytes - sp.offset;
    if (pp.offset + pp.bytes > info.bytes)
      fail(ErrorCode::kInvalidArgument,
           strcat("stream: part [", pp.offset, ", ", pp.offset + pp.bytes, ") of '", info.name,
                  "' beyond its ", info.bytes, " bytes"));
    pp.whole = pp.offset == 0 && pp.bytes == info.bytes;
    pp.in_place = (!sp.pending || out_views) && views_in_place(info.home, where, device_is_host);
    pp.pending_out = sp.pending && pp.in_place;
    pp.tier = info.home;
    if (!pp.in_place) {
      if (info.home == Tier::kNvme && !pp.whole)
        fail(ErrorCode::kInvalidArgument,
             strcat("stream: a part of '", info.name, "' (on nvme) must be the whole buffer"));
      pp.slot_offset = p.slot_bytes;
      pp.slot_bytes = round_up(pp.whole ? store.padded_bytes(sp.id) : pp.bytes, kAlign);
      p.slot_bytes += pp.slot_bytes;
    }
  }
  return p;
}

// One slot: where an item's staged parts live while it is read, computed and written.
struct Slot {
  PinnedBuffer host;    // kHost
  BufferId device = 0;  // kDevice: a scratch buffer registered in the store
  void* base = nullptr;
  std::uint32_t index = 0;
};

struct Pending {  // one item between its issue and the end of its writes
  std::size_t item = 0;
  Slot slot;
  bool has_slot = false;
  std::vector<std::pair<Transfer, std::size_t>> reads;  // (transfer, part)
  std::vector<std::pair<Transfer, std::size_t>> acquires;
  std::array<void*, kMaxParts> views{};
  std::array<void*, kMaxParts> outs{};     // pending_out parts: where the compute writes
  std::array<bool, kMaxParts> pinned{};    // in-place acquire held (release after compute)
  std::array<Access, kMaxParts> access{};  // ... asked for this access
  std::vector<std::pair<Transfer, std::size_t>> writes;
};

class Runner {
 public:
  Runner(TierStore& store, std::span<const StreamItem> items, const StreamFn& fn,
         const StreamOptions& o)
      : store_(store), items_(items), fn_(fn), o_(o), t_(compute_tier(o.where)) {}

  ~Runner() { drain(); }

  StreamStats run() {
    auto t0 = Clock::now();
    plans_.reserve(items_.size());
    std::uint64_t biggest = 0;
    for (const StreamItem& it : items_) {
      plans_.push_back(plan_item(store_, it, o_.where, device_is_host(store_, o_), o_.out_views));
      biggest = std::max(biggest, plans_.back().slot_bytes);
    }
    setup_slots(biggest);
    if (items_.empty() && o_.gate) {
      stats_.cancelled = !pass_gate();
      stats_.t_total = since(t0);
      return stats_;
    }
    std::exception_ptr gate_error;
    bool cancelled = false;
    try {
      std::size_t next = 0;  // next item to issue
      for (std::size_t i = 0; i < items_.size(); ++i) {
        current_ = i;
        issue_ahead(i, next);
        if (i == 0 && o_.gate) {
          try {
            cancelled = !pass_gate();
          } catch (...) {
            gate_error = std::current_exception();
            break;
          }
          if (cancelled) {
            // Every issued item's inputs are waited for (their errors count), then given back.
            for (Pending& p : inflight_) wait_inputs(p);
            break;
          }
        }
        Pending& p = find(i);
        wait_inputs(p);
        // Writes that completed while the inputs were awaited free their slots: read further
        // ahead now, so that the transfers go on while fn computes.
        if (o_.pipelined) issue_ahead(i, next);
        compute(p);
        write_back(p);  // may retire p (nothing written behind): do not touch it after
        if (!o_.pipelined) finish_writes(i);
      }
      if (!cancelled && !gate_error)
        while (!inflight_.empty()) finish_writes(inflight_.front().item);
    } catch (const std::exception& e) {
      drain();
      rethrow_with_context(e);
    }
    if (cancelled || gate_error) {
      drain();  // nothing in flight: releases the acquires, gives the slots back
      if (gate_error) std::rethrow_exception(gate_error);
      stats_.cancelled = true;
      stats_.t_total = since(t0);
      return stats_;
    }
    stats_.t_total = since(t0);
    stats_.items = items_.size();
    return stats_;
  }

 private:
  bool pass_gate() {
    phase_ = "deciding";
    auto t = Clock::now();
    struct Timed {  // t_gate also when the gate throws
      double& acc;
      Clock::time_point t;
      ~Timed() { acc += since(t); }
    } timed{stats_.t_gate, t};
    return o_.gate();
  }

  void setup_slots(std::uint64_t biggest) {
    if (biggest == 0) return;  // everything in place
    stats_.slot_bytes = biggest;
    if (o_.where == Where::kHost) {
      PinnedPool* pool = store_.pool();
      if (!pool)
        fail(ErrorCode::kInvalidArgument,
             strcat(o_.what,
                    ": parts must be staged in host memory but the store has no pinned pool"));
      if (pool->buffer_size() < biggest)
        fail(ErrorCode::kInvalidArgument, strcat(o_.what, ": an item needs ", biggest,
                                                 " bytes of pinned staging but a pool buffer has ",
                                                 pool->buffer_size(), " (tiers.host.buffer_size)"));
      window_ = std::max<std::uint32_t>(1, std::min(o_.window, pool->buffer_count()));
    } else {
      window_ = std::max<std::uint32_t>(1, o_.window);
      for (std::uint32_t s = 0; s < window_; ++s) {
        BufferSpec spec;
        spec.name = strcat(o_.what, ".scratch.", s, ".", reinterpret_cast<std::uintptr_t>(this));
        spec.bytes = biggest;
        spec.home = Tier::kGpu;
        spec.allowed = {Tier::kGpu};
        const BufferId id = store_.register_buffer(spec);
        scratch_.push_back(id);
        free_device_.push_back(s);
      }
    }
    stats_.slots = window_;
  }

  Slot take_slot(bool block) {
    Slot s;
    if (o_.where == Where::kHost) {
      while (true) {
        s.host = store_.pool()->try_acquire();
        if (s.host) break;
        if (!block) return s;
        if (!inflight_.empty() && inflight_.front().item < current_) {
          finish_writes(inflight_.front().item);  // the oldest slot with writes in flight
          continue;
        }
        auto t = Clock::now();
        s.host = store_.pool()->acquire(o_.timeout);
        stats_.t_wait_out += since(t);
        break;
      }
      s.base = s.host.data();
      s.index = s.host.index();
    } else {
      while (free_device_.empty()) {
        if (!block) return s;
        finish_writes(inflight_.front().item);
      }
      s.index = free_device_.back();
      free_device_.pop_back();
      s.device = scratch_[s.index];
      s.base = store_.acquire(s.device, Tier::kGpu, Access::kRead, o_.timeout);
    }
    return s;
  }
  void give_slot(Slot& s) {
    if (o_.where == Where::kHost) {
      s.host.release();
    } else if (s.device) {
      store_.release(s.device, Tier::kGpu);
      free_device_.push_back(s.index);
      s.device = 0;
    }
  }

  bool can_issue(std::size_t i) const {
    if (plans_[i].slot_bytes == 0) return true;
    if (o_.where == Where::kHost) return store_.pool()->available() > 0;
    return !free_device_.empty();
  }

  // Issues the items after i that the window allows (i itself when not issued yet), once the
  // slots of items whose writes already completed are given back.
  void issue_ahead(std::size_t i, std::size_t& next) {
    reap_written(i);
    const std::size_t ahead = o_.pipelined ? std::max<std::size_t>(1, window_) : 1;
    while (next < items_.size() && next < i + ahead && (next == i || can_issue(next)))
      issue(next++);
  }

  // Retires, oldest first, the items before i whose writes have all completed (without waiting):
  // their slots go back. (A slot was otherwise given back only when one was needed and none was
  // free, so a completed write held its slot and the read-ahead stalled: the disk idled while fn
  // ran.)
  void reap_written(std::size_t i) {
    while (!inflight_.empty() && inflight_.front().item < i) {
      const Pending& p = inflight_.front();
      for (const auto& w : p.writes)
        if (!w.first.ready()) return;
      finish_writes(p.item);
    }
  }

  Pending& find(std::size_t i) {
    for (auto& p : inflight_)
      if (p.item == i) return p;
    fail(ErrorCode::kInternal, strcat(o_.what, ": item ", i, " was not issued"));
  }

  void issue(std::size_t i) {
    enter("reading", i);
    inflight_.emplace_back();
    Pending& p = inflight_.back();
    p.item = i;
    const ItemPlan& plan = plans_[i];
    if (plan.slot_bytes) {
      p.slot = take_slot(true);
      p.has_slot = true;
    }
    const StreamItem& item = items_[i];
    for (std::size_t k = 0; k < item.parts.size(); ++k) {
      const StreamPart& sp = item.parts[k];
      const PartPlan& pp = plan.parts[k];
      phase_part_ = k;
      if (pp.pending_out) {
        p.outs[k] = static_cast<unsigned char*>(store_.pending_view(sp.id)) + pp.offset;
        if (!sp.in) {  // nothing to read: the compute sees the pending bytes
          p.views[k] = p.outs[k];
          continue;
        }
      }
      if (pp.in_place) {
        const Access a = sp.out && !pp.pending_out
                             ? (sp.in || !pp.whole ? Access::kWrite : Access::kDiscard)
                             : Access::kRead;
        p.acquires.emplace_back(store_.acquire_async(sp.id, pp.tier, a), k);
        p.access[k] = a;
        continue;
      }
      auto* at = static_cast<unsigned char*>(p.slot.base) + pp.slot_offset;
      p.views[k] = at;
      if (sp.in) {
        p.reads.emplace_back(store_.read(sp.id, pp.offset, pp.whole ? 0 : pp.bytes, at, t_, true),
                             k);
        stats_.bytes_in += pp.bytes;
      }
    }
  }

  void wait_inputs(Pending& p) {
    enter("reading", p.item);
    auto t = Clock::now();
    for (auto& [tr, k] : p.acquires) {
      phase_part_ = k;
      tr.wait(o_.timeout);
      p.pinned[k] = true;
      const PartPlan& pp = plans_[p.item].parts[k];
      p.views[k] = static_cast<unsigned char*>(tr.pointer()) + pp.offset;
    }
    p.acquires.clear();
    for (auto& [tr, k] : p.reads) {
      phase_part_ = k;
      tr.wait(o_.timeout);
    }
    p.reads.clear();
    stats_.t_wait_in += since(t);
  }

  void compute(Pending& p) {
    enter("computing", p.item);
    const StreamItem& item = items_[p.item];
    const ItemPlan& plan = plans_[p.item];
    // Staged outputs that are not read: their padding must hold zeros (it is written to NVMe).
    for (std::size_t k = 0; k < item.parts.size(); ++k) {
      const PartPlan& pp = plan.parts[k];
      if (pp.in_place || item.parts[k].in || !item.parts[k].out || pp.slot_bytes == pp.bytes)
        continue;
      auto* tail = static_cast<unsigned char*>(p.views[k]) + pp.bytes;
      if (o_.where == Where::kHost) {
        std::memset(tail, 0, pp.slot_bytes - pp.bytes);
      } else {
        memset_device(tail, pp.slot_bytes - pp.bytes);
      }
    }
    const std::size_t n = item.parts.size();
    std::array<void*, 2 * kMaxParts> views{};  // what it reads, then where it writes
    for (std::size_t k = 0; k < n; ++k) {
      views[k] = p.views[k];
      views[n + k] = plan.parts[k].pending_out ? p.outs[k] : p.views[k];
    }
    auto t = Clock::now();
    fn_(p.item, std::span<void* const>(views.data(), 2 * n));
    stats_.t_compute += since(t);
    ++computed_;
  }

  void enter(const char* phase, std::size_t item) {
    phase_ = phase;
    phase_item_ = item;
  }

  void memset_device(void* at, std::uint64_t bytes) {
    if (!stream_) stream_ = store_.device().create_stream();
    stream_->memset_async(at, 0, bytes);
    stream_->synchronize(o_.timeout);
  }

  void write_back(Pending& p) {
    enter("writing", p.item);
    const StreamItem& item = items_[p.item];
    const ItemPlan& plan = plans_[p.item];
    for (std::size_t k = 0; k < item.parts.size(); ++k) {
      if (p.pinned[k]) {
        store_.release(item.parts[k].id, plan.parts[k].tier, p.access[k]);
        p.pinned[k] = false;
      }
    }
    for (std::size_t k = 0; k < item.parts.size(); ++k) {
      const StreamPart& sp = item.parts[k];
      const PartPlan& pp = plan.parts[k];
      if (pp.pending_out && sp.out) {  // written in place: the range is recorded, nothing copied
        phase_part_ = k;
        p.writes.emplace_back(store_.write_pending(sp.id, pp.offset, pp.bytes, p.outs[k], t_), k);
        continue;
      }
      if (pp.in_place || !sp.out) continue;
      phase_part_ = k;
      const std::uint64_t n = pp.whole ? 0 : pp.bytes;
      p.writes.emplace_back(sp.pending ? store_.write_pending(sp.id, pp.offset, n, p.views[k], t_)
                                       : store_.write(sp.id, pp.offset, n, p.views[k], t_),
                            k);
      stats_.bytes_out += pp.bytes;
    }
    if (p.writes.empty()) {
      // Nothing behind: the slot is free at once.
      finish_writes(p.item);
    }
  }

  // Waits for item i's writes (and every older item's) and frees their slots.
  void finish_writes(std::size_t i) {
    while (!inflight_.empty() && inflight_.front().item <= i) {
      Pending& p = inflight_.front();
      enter("writing", p.item);
      auto t = Clock::now();
      for (auto& [tr, k] : p.writes) {
        phase_part_ = k;
        tr.wait(o_.timeout);
      }
      p.writes.clear();
      stats_.t_wait_out += since(t);
      if (p.has_slot) give_slot(p.slot);
      ++written_;
      inflight_.pop_front();
    }
  }

  // Never leaves a slot in use by a transfer: waits for everything in flight (errors ignored);
  // a slot whose transfer may still run is leaked, not given back.
  void drain() noexcept {
    for (auto& p : inflight_) {
      bool unsafe = false;
      auto settle = [&](std::vector<std::pair<Transfer, std::size_t>>& v, bool pin) {
        for (auto& [tr, k] : v) {
          try {
            tr.wait(o_.timeout);
            if (pin) p.pinned[k] = true;
          } catch (const Error& e) {
            if (e.code() == ErrorCode::kTimeout) unsafe = true;
          } catch (...) {
          }
        }
        v.clear();
      };
      settle(p.acquires, true);
      settle(p.reads, false);
      settle(p.writes, false);
      const StreamItem& item = items_[p.item];
      for (std::size_t k = 0; k < item.parts.size(); ++k) {
        if (!p.pinned[k]) continue;
        try {
          store_.release(item.parts[k].id, plans_[p.item].parts[k].tier, p.access[k]);
        } catch (...) {
        }
        p.pinned[k] = false;
      }
      if (p.has_slot) {
        if (unsafe) {
          log_error(o_.what, ": a transfer of item ", p.item, " did not finish; slot ",
                    p.slot.index, " is not reused");
          p.slot.host.detach();
          p.slot.device = 0;
        } else {
          try {
            give_slot(p.slot);
          } catch (...) {
          }
        }
      }
    }
    inflight_.clear();
    for (BufferId id : scratch_) {
      try {
        store_.unregister_buffer(id);
      } catch (const std::exception& e) {
        log_error(o_.what, ": scratch buffer not freed: ", e.what());
      }
    }
    scratch_.clear();
    if (stream_) {
      try {
        stream_->synchronize(o_.timeout);
      } catch (...) {
      }
    }
  }

  [[noreturn]] void rethrow_with_context(const std::exception& e) {
    std::string part = "-";
    if (phase_item_ < items_.size() && phase_part_ < items_[phase_item_].parts.size()) {
      try {
        part = store_.info(items_[phase_item_].parts[phase_part_].id).name;
      } catch (...) {
      }
    }
    const std::string where =
        strcat(o_.what, " failed ", phase_, " item ", phase_item_, " of ", items_.size(),
               " (buffer '", part, "'); ", computed_, " items computed, ", written_, " stored");
    if (const auto* io = dynamic_cast<const IoError*>(&e)) throw io->with_context(where);
    if (const auto* er = dynamic_cast<const Error*>(&e))
      throw Error(er->code(), strcat(er->what(), "; ", where));
    throw Error(ErrorCode::kInternal, strcat(e.what(), "; ", where));
  }

  TierStore& store_;
  std::span<const StreamItem> items_;
  const StreamFn& fn_;
  StreamOptions o_;
  Tier t_;
  std::vector<ItemPlan> plans_;
  std::deque<Pending> inflight_;  // issued, oldest first
  std::uint32_t window_ = 1;
  std::vector<BufferId> scratch_;  // kDevice slots
  std::vector<std::uint32_t> free_device_;
  std::unique_ptr<Stream> stream_;
  // The item being computed: the ones before it were computed and written back, so a slot held
  // only by their writes may be reclaimed (take_slot). Not the item being issued: a read ahead
  // that finds the pool taken by another user of it (can_issue saw a free buffer) must not retire
  // an item not yet computed (it did: "item 0 was not issued", 0 computed, 1 stored).
  std::size_t current_ = 0;
  std::size_t computed_ = 0, written_ = 0;
  // Where the loop is (named in the error of a step that fails): set by enter(), the part by
  // the steps that go part by part.
  const char* phase_ = "starting";
  std::size_t phase_item_ = 0, phase_part_ = 0;
  StreamStats stats_;
};

}  // namespace

std::uint64_t staged_bytes(const TierStore& store, const StreamItem& item, Where where,
                           bool out_views) {
  return plan_item(store, item, where, false, out_views).slot_bytes;
}

bool in_place(const TierStore& store, const StreamItem& item, const StreamOptions& options) {
  return plan_item(store, item, options.where, device_is_host(store, options), options.out_views)
             .slot_bytes == 0;
}

StreamStats run_stream(TierStore& store, std::span<const StreamItem> items, const StreamFn& fn,
                       const StreamOptions& options) {
  Runner r(store, items, fn, options);
  return r.run();
}

}  // namespace strata::tier
