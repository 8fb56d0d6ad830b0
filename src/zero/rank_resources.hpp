// RankResources: what the engine hands each collaborator that moves a rank's data through its
// communicator and its store (GradientReducer, ParamGatherer), as leveldb's DBImpl hands its state
// to its collaborators: the layout (const after finalize()), the communicator, the store, the
// scratch arena and the collectives' timeout. A base the collaborator derives from privately, so
// that its code names them as its own members (layout_, comm_, store_, scratch_, timeout_).
//
// Ownership: borrows all four (the engine's; they outlive the collaborator). Thread-safety: as the
// collaborator's.
#pragma once

#include <chrono>

#include "strata/communicator.hpp"
#include "tier/scratch_arena.hpp"
#include "zero/engine_layout.hpp"

namespace strata::zero {

class RankResources {
 protected:
  RankResources(const EngineLayout& layout, Communicator& comm, TierStore& store,
                ScratchArena& scratch)
      : layout_(layout),
        comm_(comm),
        store_(store),
        scratch_(scratch),
        timeout_(layout.timeout()) {}

  const EngineLayout& layout_;
  Communicator& comm_;
  TierStore& store_;
  ScratchArena& scratch_;
  const std::chrono::milliseconds timeout_;
};

}  // namespace strata::zero
