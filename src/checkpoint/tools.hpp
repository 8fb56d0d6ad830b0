// Offline tools on a checkpoint directory (no engine, no world): `strata checkpoint verify` and
// `strata checkpoint export` (docs/offload.md, "Checkpoints").
//
// verify_checkpoint: reads the manifest (its failures throw, as read_manifest does), then every
// shard in full: size, header, every block's CRC32C, and the zero padding between sections, and
// the extra file (size, each tensor's CRC32C). The problems are collected, not thrown: the report
// lists each, naming file, section and offset.
//
// export_safetensors: the consolidated model in the safetensors format
// (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, the JSON
// header (padded with spaces to a multiple of 8), then every tensor's data in header order.
// Trained tensors: the FP32 master weights, converted to `dtype` (round to nearest even), under
// their registered names and, where the checkpoint records them (strata.torch's save_checkpoint
// does), in their model shapes and under each alias too (a tied weight's data written once per
// name); a checkpoint without shapes (the C++ API without a CheckpointModel, `strata train`) gives
// 1-D tensors ([numel]). Then the untrained tensors of the checkpoint's extra file (frozen
// parameters and buffers), in their saved dtype and shape. So a torch model's
// load_state_dict(strict=True) takes what a plain safetensors reader returns. "__metadata__"
// records the source (serial, step, world, stage). Streamed: memory is a few blocks, whatever the
// model size, and every byte read is CRC-verified. Written to a temporary file next to `out`
// (O_EXCL, no symlink), fsynced, then renamed onto `out`; an existing `out` is an error (Error
// kInvalidArgument) unless `overwrite`. Duplicate or empty tensor names: kInvalidArgument.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/format.hpp"
#include "strata/config.hpp"

namespace strata::checkpoint {

struct VerifyReport {
  Manifest manifest;
  std::vector<std::string> problems;  // empty: every checksum holds
  std::vector<std::string> notes;     // leftovers in the directory (not problems)
  std::uint64_t bytes_checked = 0;
  std::uint64_t blocks_checked = 0;
};
VerifyReport verify_checkpoint(const std::string& dir);

struct ExportOptions {
  DType dtype = DType::kFp32;
  bool overwrite = false;
};
struct ExportResult {
  std::uint64_t tensors = 0;     // names written (aliases and untrained tensors included)
  std::uint64_t parameters = 0;  // trained elements (each tensor once)
  std::uint64_t bytes = 0;       // size of the file written
};
ExportResult export_safetensors(const std::string& dir, const std::string& out,
                                const ExportOptions& options);

}  // namespace strata::checkpoint
