// What a checkpoint records of the model beyond the trained tensors (Engine::save_checkpoint's
// `model`), so that `strata checkpoint export` writes every tensor under its model names and in
// its model shape, the tensors the engine does not train included (docs/offload.md, "Exporting a
// checkpoint"). An embedder that gives none (the C++ API's default, `strata train`) gets the
// tensors under their registered names, 1-D, as before.
//
// Checked when the checkpoint is saved (Error(kInvalidArgument) on every rank, nothing
// committed): a shape's element count is the tensor's, names are non-empty UTF-8, unique across
// tensor names, aliases and extra tensors and not "__metadata__", an extra tensor's dtype is one
// of the names below and its data holds exactly numel x element size bytes.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace strata {

struct CheckpointModel {
  // Per trained tensor, in TensorId order (or empty: none given): its shape in the model (an
  // empty shape is a scalar), and the other names it has there (a tied weight's second name).
  std::vector<std::vector<std::uint64_t>> shapes;
  std::vector<std::vector<std::string>> aliases;
  // A tensor the engine does not train (a frozen parameter, a buffer), saved as given into one
  // extra file of the checkpoint (rank 0's are saved; CRC32C per tensor in the manifest).
  struct Extra {
    std::string name;
    // safetensors' names: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL.
    std::string dtype;
    std::vector<std::uint64_t> shape;
    std::span<const unsigned char> data;  // host memory, row-major; borrowed for the call
  };
  std::vector<Extra> extra;
  bool empty() const { return shapes.empty() && aliases.empty() && extra.empty(); }
};

}  // namespace strata
