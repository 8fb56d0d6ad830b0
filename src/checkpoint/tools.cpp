// Offline checkpoint tools: verify, export to safetensors (see tools.hpp).
#include "checkpoint/tools.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "comm/numeric.hpp"
#include "core/printable.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata::zero {
namespace {

using namespace ckpt;

constexpr std::uint64_t kPiece = 1u << 20;  // elements converted and written at a time

const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::kFp32: return "F32";
    case DType::kBf16: return "BF16";
    case DType::kFp16: return "F16";
  }
  return "?";
}

// Splits "a/b/c" into ("a/b", "c"); "c" into (".", "c"). The name must be one component.
}  // namespace

VerifyReport verify_checkpoint(const std::string& dir_path) {
  VerifyReport rep;
  // Reports only: a checkpoint another user owns (or can write) may be inspected; what loads or
  // exports it still requires a safe directory (its contents could be swapped under the reader).
  const SafeDir dir = SafeDir::open(dir_path, {.read_only = true});
  rep.manifest = read_manifest(dir);
  const Manifest& m = rep.manifest;
  for (int j = 0; j < m.world; ++j) {
    try {
      ShardReader r(dir, m, j);
      const ShardLayout& l = r.layout();
      for (int s = 0; s < kSections; ++s) {
        r.verify(static_cast<Section>(s), 0, m.shards[static_cast<std::size_t>(j)].count);
        r.drop_cache();
      }
      rep.blocks_checked += kSections * l.nblocks;
      rep.bytes_checked += l.total;
    } catch (const std::exception& e) {
      rep.problems.push_back(e.what());
    }
  }
  for (const std::string& name : dir.entries()) {
    std::uint64_t serial = 0;
    int rank = 0;
    if (parse_shard_file_name(name, &serial, &rank) && serial != m.serial)
      rep.notes.push_back(strcat(
          dir.child_path(name), ": shard of serial ", serial,
          ", not part of this checkpoint (left by an interrupted save; the next save removes it)"));
    if (name == kManifestTmpName)
      rep.notes.push_back(
          strcat(dir.child_path(name), ": an uncommitted manifest (left by an interrupted save)"));
  }
  return rep;
}

namespace {

// The safetensors header (padded to 8 bytes): every tensor under its name, the metadata.
std::string safetensors_header(const Manifest& m, DType dtype, std::uint64_t* params) {
  const std::uint64_t es = dtype_size(dtype);
  nlohmann::json h;
  std::set<std::string> names;
  std::uint64_t data = 0;
  for (const TensorEntry& t : m.tensors) {
    if (t.name.empty() || t.name == "__metadata__")
      fail(ErrorCode::kInvalidArgument,
           strcat("checkpoint ", m.path, ": tensor name '", printable(t.name, 200),
                  "' cannot be a safetensors tensor name"));
    if (!names.insert(t.name).second)
      fail(ErrorCode::kInvalidArgument,
           strcat("checkpoint ", m.path, ": tensor name '", printable(t.name, 200),
                  "' appears twice; safetensors needs unique names"));
    h[t.name] = {{"dtype", safetensors_dtype(dtype)},
                 {"shape", {t.numel}},
                 {"data_offsets", {data, data + t.numel * es}}};
    data += t.numel * es;
    *params += t.numel;
  }
  h["__metadata__"] = {{"format", "pt"},
                       {"source", "strata checkpoint export"},
                       {"strata_version", m.strata_version},
                       {"checkpoint_serial", std::to_string(m.serial)},
                       {"step", std::to_string(m.steps)},
                       {"optimizer_step", std::to_string(m.adam_step)},
                       {"saved_world", std::to_string(m.world)},
                       {"saved_stage", std::to_string(m.stage)},
                       {"values", strcat("FP32 master weights as ", dtype_name(dtype))}};
  std::string header = h.dump();
  header.resize((header.size() + 7) / 8 * 8, ' ');
  return header;
}

// The data, tensor by tensor, piece by piece, shard by shard, from file offset `pos`; returns the
// offset after it.
std::uint64_t write_tensors(const SafeDir& dir, const Manifest& m, DType dtype, WritableFile& out,
                            std::uint64_t pos) {
  const std::uint64_t es = dtype_size(dtype);
  std::vector<std::unique_ptr<ShardReader>> readers(m.shards.size());
  int current = -1;
  std::vector<float> in;
  std::vector<unsigned char> conv;
  for (const TensorEntry& t : m.tensors) {
    for (std::uint64_t done = 0; done < t.numel;) {
      const std::uint64_t flat = t.offset + done;
      const auto shard = static_cast<int>(flat / m.partition_size);
      const std::uint64_t src = flat - static_cast<std::uint64_t>(shard) * m.partition_size;
      const std::uint64_t n = std::min({t.numel - done, m.partition_size - src, kPiece});
      auto& r = readers[static_cast<std::size_t>(shard)];
      if (shard != current) {
        if (current >= 0) readers[static_cast<std::size_t>(current)].reset();
        current = shard;
      }
      if (!r) r = std::make_unique<ShardReader>(dir, m, shard);
      in.resize(n);
      r->read(kMaster, src, n, in.data());
      const void* bytes = in.data();
      if (dtype != DType::kFp32) {
        conv.resize(n * es);
        for (std::uint64_t i = 0; i < n; ++i) comm::store_elem(conv.data(), i, dtype, in[i]);
        bytes = conv.data();
      }
      out.write_at(bytes, n * es, pos);
      pos += n * es;
      done += n;
    }
  }
  return pos;
}

}  // namespace

ExportResult export_safetensors(const std::string& dir_path, const std::string& out,
                                const ExportOptions& o) {
  const SafeDir dir = SafeDir::open(dir_path, {});
  const Manifest m = read_manifest(dir);
  std::uint64_t params = 0;
  const std::string header = safetensors_header(m, o.dtype, &params);
  const std::uint64_t hlen = header.size();
  // The output: a temporary file beside it, renamed onto it at the end.
  ReplacingFile outfile(out, "--out", o.overwrite);
  WritableFile& f = outfile.file();
  f.write_at(&hlen, 8, 0);
  f.write_at(header.data(), hlen, 8);
  const std::uint64_t pos = write_tensors(dir, m, o.dtype, f, 8 + hlen);
  outfile.commit();
  log_info("checkpoint: exported ", m.tensors.size(), " tensors (", params, " parameters, ",
           dtype_name(o.dtype), ") to ", outfile.path());
  return {m.tensors.size(), params, pos};
}

}  // namespace strata::zero
