// Engine::Impl: checkpoint saves, blocking and asynchronous (engine.hpp, "Checkpoints";
// zero/async_checkpoint.hpp), over the checkpoint seam of engine_state.cpp.
#include <algorithm>

#include "checkpoint/format.hpp"
#include "strata/log.hpp"
#include "zero/clock.hpp"
#include "zero/engine_impl.hpp"

namespace strata {

void Engine::Impl::save(const std::string& dir, SaveMode mode, std::string_view client_state,
                        const CheckpointModel* model) {
  if (client_state.size() > checkpoint::kMaxClientStateBytes ||
      !checkpoint::valid_utf8(client_state))
    fail(ErrorCode::kInvalidArgument,
         strcat("engine: save_checkpoint: the client state (", client_state.size(),
                " bytes) must be UTF-8 text of at most ", checkpoint::kMaxClientStateBytes,
                " bytes; nothing was written"));
  const auto t0 = zero::Clock::now();
  struct Blocked {  // the caller's time in this call, however it ends
    EngineStats& st;
    zero::Clock::time_point t0;
    ~Blocked() { st.checkpoint_blocked_s += zero::seconds_since(t0); }
  } blocked{st, t0};
  finish_saving();  // the previous save first (its failure is reported here)
  const bool async = mode == SaveMode::kAsync;
  // Asynchronous: the writer reads the parameters from the snapshot, the call copies none: at
  // stage 3 the parameter blocks are pinned with the optimizer state; at stages 0-2 the writer
  // makes them from the pinned master, unless the rank's parameters may differ from its master's
  // rounding (params_follow_master, engine_state.cpp): then the call copies them.
  using Source = zero::ParamBlocks::Source;
  const Source source = !async                 ? Source::kNone
                        : layout->stage() == 3 ? Source::kBlocks
                        : params_follow_master ? Source::kFromMaster
                                               : Source::kNone;
  const zero::ParamBlocks params{source, layout->param_dtype(), layout->param_elem_bytes()};
  checkpoint::RankState r = rank_state(!params.in_snapshot());
  r.params_in_store = params.in_snapshot();
  r.config_yaml = to_yaml(cfg);
  r.client_state = client_state;
  r.model = model;
  if (!async) {
    checkpoint::save_checkpoint(dir, r, comm);
  } else {
    if (!r.env) r.env = &FileEnv::current();  // the writer thread uses the seam of this call
    checkpoint::PendingSave p = checkpoint::begin_save(dir, r, comm);
    r.model = nullptr;  // borrowed for the call: begin_save wrote what the manifest needs of it
    saving = std::make_unique<zero::AsyncCheckpoint>(store(), layout->chunks(), params,
                                                     std::move(p), std::move(r),
                                                     std::move(ckpt_params), layout->timeout());
    // Every rank's "my shard is durable" rides on the step agreements that follow: the first one
    // in which every rank says so lets rank 0 commit at the start of the next step.
    // While a step runs (make_room_for_update .. its outcome agreement) the writer pauses.
    zero::AsyncCheckpoint* a = saving.get();
    agreement->set_checkpoint_hooks({[a] { return a->durable(); },
                                     [a] { a->mark_durable_everywhere(); },
                                     [a] { a->set_step_running(false); }});
  }
  ckpt_params.clear();
  ckpt_params.shrink_to_fit();
  scratch->trim();
}

void Engine::Impl::finish_saving() {
  if (!saving) return;
  const auto t0 = zero::Clock::now();
  std::unique_ptr<zero::AsyncCheckpoint> s = std::move(saving);
  agreement->set_checkpoint_hooks({});
  try {
    s->finish(comm);
  } catch (...) {
    st.checkpoint_blocked_s += zero::seconds_since(t0);
    throw;
  }
  st.checkpoint_blocked_s += zero::seconds_since(t0);
}

namespace {
// The swap space's room for pinned versions: tiers.nvme.snapshot_room of the optimizer state on
// nvme, as the storage reserved it (rank_storage.cpp; strata plan counts the same), less what the
// versions hold already — not whatever else of the swap file happens to be free (its rounding to
// whole extents): with snapshot_room 0 a step waits for the writer instead of taking new slots.
std::uint64_t nvme_version_room(const zero::EngineLayout& layout, const TierStore& store) {
  auto round_up = [](std::uint64_t v) { return (v + 4095) / 4096 * 4096; };
  std::uint64_t opt_bytes = 0;  // EngineLayout::storage_needs' nvme_opt_bytes
  for (const zero::Chunk& c : layout.chunks())
    if (c.opt_tier == Tier::kNvme) opt_bytes += round_up(12 * c.r.count);
  const std::uint64_t room = round_up(static_cast<std::uint64_t>(
      static_cast<double>(opt_bytes) * layout.config().tiers.nvme.snapshot_room));
  const std::uint64_t held = store.version_usage().held[Tier::kNvme];
  return room > held ? room - held : 0;
}
}  // namespace

void Engine::Impl::make_room_for_update(bool step) {
  if (!saving) return;
  if (saving->commit_if_durable()) {  // every rank's shard durable: committed (rank 0) now
    agreement->set_checkpoint_hooks({});
    return;
  }
  if (!saving->writing()) return;
  if (step) saving->set_step_running(true);  // its I/O first (until the outcome agreement)
  const VersionBytes cost = saving->rewrite_cost();
  TierStore& s = store();
  for (Tier t : {Tier::kGpu, Tier::kCpu, Tier::kNvme}) {
    const TierUsage u = s.usage(t);
    std::uint64_t room = u.budget > u.used ? u.budget - u.used : 0;
    if (t == Tier::kNvme) room = std::min(room, nvme_version_room(*layout, s));
    if (cost[t] <= room) continue;
    log_info("engine rank ", rank, ": the checkpoint writer of ", saving->path(),
             " still pins state whose copy-on-write (", cost[t], " bytes) exceeds the room in the ",
             tier_name(t), " tier (", room, " bytes): waiting for it before the update");
    const auto t0 = zero::Clock::now();
    saving->wait_local();
    st.checkpoint_blocked_s += zero::seconds_since(t0);
    return;
  }
}

}  // namespace strata
