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

#include "comm/numeric.hpp"
#include "core/printable.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata::checkpoint {
namespace {

constexpr std::uint64_t kConvertPiece = 1u << 20;  // elements converted and written at a time

const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::kFp32: return "F32";
    case DType::kBf16: return "BF16";
    case DType::kFp16: return "F16";
  }
  return "?";
}

// The extra file: present, of its size, every tensor's CRC32C (problems collected).
void verify_extra(const SafeDir& dir, const Manifest& m, VerifyReport& rep) {
  if (m.extra_file.empty()) return;
  std::unique_ptr<RandomAccessFile> file;
  try {
    file = open_extra_file(dir, m);
  } catch (const std::exception& e) {
    rep.problems.push_back(e.what());
    return;
  }
  for (std::size_t i = 0; i < m.extra.size(); ++i) {
    try {
      read_extra_tensor(*file, m, i, [](const unsigned char*, std::uint64_t) {});
      rep.bytes_checked += m.extra[i].bytes;
    } catch (const std::exception& e) {
      rep.problems.push_back(e.what());
    }
  }
}

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
  verify_extra(dir, m, rep);
  for (const std::string& name : dir.entries()) {
    std::uint64_t serial = 0;
    if (checkpoint_file_serial(name, &serial) && serial != m.serial)
      rep.notes.push_back(strcat(
          dir.child_path(name), ": file of serial ", serial,
          ", not part of this checkpoint (left by an interrupted save; the next save removes it)"));
    if (name == kManifestTmpName)
      rep.notes.push_back(
          strcat(dir.child_path(name), ": an uncommitted manifest (left by an interrupted save)"));
  }
  return rep;
}

namespace {

// One tensor of the safetensors header at data offset *data (advanced past it).
void header_entry(nlohmann::json& h, const std::string& name, const char* dtype,
                  const std::vector<std::uint64_t>& shape, std::uint64_t bytes,
                  std::uint64_t* data) {
  h[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {*data, *data + bytes}}};
  *data += bytes;
}

// The safetensors header (padded to 8 bytes): every trained tensor under its name and each alias
// (the data written once per name: safetensors tensors do not share bytes), in its model shape
// when the checkpoint has it (else 1-D), then the extra tensors as saved; the metadata.
std::string safetensors_header(const Manifest& m, DType dtype, std::uint64_t* params) {
  check_model_names(m);
  const std::uint64_t es = dtype_size(dtype);
  nlohmann::json h = nlohmann::json::object();
  std::uint64_t data = 0;
  for (const TensorEntry& t : m.tensors) {
    const std::vector<std::uint64_t> shape = t.has_shape ? t.shape : std::vector{t.numel};
    header_entry(h, t.name, safetensors_dtype(dtype), shape, t.numel * es, &data);
    for (const std::string& a : t.aliases)
      header_entry(h, a, safetensors_dtype(dtype), shape, t.numel * es, &data);
    *params += t.numel;
  }
  for (const ExtraEntry& e : m.extra)
    header_entry(h, e.name, e.dtype.c_str(), e.shape, e.bytes, &data);
  h["__metadata__"] = {{"format", "pt"},
                       {"source", "strata checkpoint export"},
                       {"strata_version", m.strata_version},
                       {"checkpoint_serial", std::to_string(m.serial)},
                       {"step", std::to_string(m.steps)},
                       {"optimizer_step", std::to_string(m.adam_step)},
                       {"saved_world", std::to_string(m.world)},
                       {"saved_stage", std::to_string(m.stage)},
                       {"values", strcat("FP32 master weights as ", dtype_name(dtype),
                                         m.extra.empty() ? "" : "; untrained tensors as saved")}};
  std::string header = h.dump();
  header.resize((header.size() + 7) / 8 * 8, ' ');
  return header;
}

// One trained tensor's values, piece by piece, shard by shard, from file offset `pos`; returns the
// offset after it.
std::uint64_t write_tensor(const SafeDir& dir, const Manifest& m, const TensorEntry& t, DType dtype,
                           WritableFile& out, std::uint64_t pos,
                           std::vector<std::unique_ptr<ShardReader>>& readers, int& current) {
  const std::uint64_t es = dtype_size(dtype);
  std::vector<float> in;
  std::vector<unsigned char> conv;
  for (std::uint64_t done = 0; done < t.numel;) {
    const std::uint64_t flat = t.offset + done;
    const auto shard = static_cast<int>(flat / m.partition_size);
    const std::uint64_t src = flat - static_cast<std::uint64_t>(shard) * m.partition_size;
    const std::uint64_t n = std::min({t.numel - done, m.partition_size - src, kConvertPiece});
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
      for (std::uint64_t i = 0; i < n; ++i) store_elem(conv.data(), i, dtype, in[i]);
      bytes = conv.data();
    }
    out.write_at(bytes, n * es, pos);
    pos += n * es;
    done += n;
  }
  return pos;
}

// The data in the header's order, from file offset `pos`; returns the offset after it. Every byte
// read is verified (block CRC32C for the shards, per tensor for the extra file).
std::uint64_t write_tensors(const SafeDir& dir, const Manifest& m, DType dtype, WritableFile& out,
                            std::uint64_t pos) {
  std::vector<std::unique_ptr<ShardReader>> readers(m.shards.size());
  int current = -1;
  for (const TensorEntry& t : m.tensors)
    for (std::size_t copy = 0; copy <= t.aliases.size(); ++copy)
      pos = write_tensor(dir, m, t, dtype, out, pos, readers, current);
  if (m.extra_file.empty()) return pos;
  const std::unique_ptr<RandomAccessFile> file = open_extra_file(dir, m);
  for (std::size_t i = 0; i < m.extra.size(); ++i)
    read_extra_tensor(*file, m, i, [&](const unsigned char* p, std::uint64_t n) {
      out.write_at(p, n, pos);
      pos += n;
    });
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
  std::uint64_t tensors = m.extra.size();
  for (const TensorEntry& t : m.tensors) tensors += 1 + t.aliases.size();
  log_info("checkpoint: exported ", tensors, " tensors (", params, " trained parameters, ",
           dtype_name(o.dtype), m.extra.empty() ? "" : strcat("; ", m.extra.size(), " untrained"),
           ") to ", outfile.path());
  return {tensors, params, pos};
}

}  // namespace strata::checkpoint
