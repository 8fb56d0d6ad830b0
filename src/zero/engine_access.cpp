// The engine's internals for tests and measurements (see engine_access.hpp).
#include "zero/engine_access.hpp"

#include "zero/engine_impl.hpp"

namespace strata::zero {

void EngineAccess::set_storage_wrap(Engine& e, StorageWrap wrap) {
  if (e.impl_->finalized())
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

const std::vector<Chunk>& EngineAccess::chunks(const Engine& e) {
  e.impl_->require_finalized("chunks");
  return e.impl_->layout->chunks();
}

ReducerBuffers EngineAccess::reducer_buffers(const Engine& e) {
  e.impl_->require_finalized("reducer_buffers");
  return {e.impl_->reducer->bucket_buffers(), e.impl_->reducer->receive_buffers()};
}

ScratchStats EngineAccess::scratch(const Engine& e) {
  e.impl_->require_finalized("scratch");
  return e.impl_->scratch->stats();
}

std::uint64_t EngineAccess::stats_tiles_known_ahead(const Engine& e) {
  e.impl_->require_finalized("stats_tiles_known_ahead");
  return e.impl_->optimizer->tiles_known_ahead();
}

std::uint64_t EngineAccess::speculation_bytes(const Engine& e) {
  return e.impl_->speculator ? e.impl_->speculator->bytes() : 0;
}

tier::StreamStats EngineAccess::last_update(const Engine& e) {
  e.impl_->require_finalized("last_update");
  return e.impl_->optimizer->last_update();
}

void EngineAccess::set_pipelined(Engine& e, bool on) {
  e.impl_->require_finalized("set_pipelined");
  e.impl_->optimizer->set_pipelined(on);
}

void EngineAccess::set_stage_device_memory(Engine& e, bool on) {
  e.impl_->require_finalized("set_stage_device_memory");
  e.impl_->optimizer->set_stage_device_memory(on);
}

void EngineAccess::force_update_split(Engine& e, std::function<double(std::size_t)> share) {
  e.impl_->require_finalized("force_update_split");
  if (e.impl_->speculator) e.impl_->speculator->join();  // its jobs use the optimizer
  e.impl_->optimizer->force_update_split(std::move(share));
}

std::pair<std::uint64_t, std::uint64_t> EngineAccess::update_split_elements(const Engine& e) {
  e.impl_->require_finalized("update_split_elements");
  return {e.impl_->optimizer->cpu_elements(), e.impl_->optimizer->device_elements()};
}

tier::StreamStats EngineAccess::measure(Engine& e, Measure what, bool pipelined) {
  Engine::Impl& m = *e.impl_;
  m.require_finalized("measure");
  m.require_usable("measure");
  if (what == Measure::kUpdate) return m.optimizer->measure_adam(pipelined);
  return m.optimizer->measure_io(what == Measure::kRead, what == Measure::kWrite, pipelined);
}

AsyncCheckpoint::WriterStats EngineAccess::wait_checkpoint_writer(Engine& e) {
  if (!e.impl_->saving) return {};
  e.impl_->saving->wait_local();
  return e.impl_->saving->writer_stats();
}

bool EngineAccess::checkpoint_writing(const Engine& e) {
  return e.impl_->saving && e.impl_->saving->writing();
}

std::size_t EngineAccess::checkpoint_param_copy_bytes(const Engine& e) {
  return e.impl_->saving ? e.impl_->saving->param_copy_bytes() : 0;
}

bool EngineAccess::params_follow_master(const Engine& e) { return e.impl_->params_follow_master; }

}  // namespace strata::zero
