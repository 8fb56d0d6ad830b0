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
    case DType::kFp32:
      return "F32";
    case DType::kBf16:
      return "BF16";
    case DType::kFp16:
      return "F16";
  }
  return "?";
}

// Splits "a/b/c" into ("a/b", "c"); "c" into (".", "c"). The name must be one component.
std::pair<std::string, std::string> split_path(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const auto slash = p.rfind('/');
  std::string parent = slash == std::string::npos ? "." : slash == 0 ? "/" : p.substr(0, slash);
  std::string name = slash == std::string::npos ? p : p.substr(slash + 1);
  if (name.empty() || name == "." || name == "..")
    fail(ErrorCode::kInvalidArgument, strcat("--out '", path, "' does not name a file"));
  return {parent, name};
}

// Removes the temporary file unless committed.
struct TempFile {
  const SafeDir& dir;
  std::string name;
  bool committed = false;
  ~TempFile() {
    if (!committed) dir.try_remove(name, false);
  }
};

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

ExportResult export_safetensors(const std::string& dir_path, const std::string& out,
                                const ExportOptions& o) {
  const SafeDir dir = SafeDir::open(dir_path, {});
  const Manifest m = read_manifest(dir);
  // The header.
  const std::uint64_t es = dtype_size(o.dtype);
  nlohmann::json h;
  std::set<std::string> names;
  std::uint64_t data = 0, params = 0;
  for (const TensorEntry& t : m.tensors) {
    if (t.name.empty() || t.name == "__metadata__")
      fail(ErrorCode::kInvalidArgument,
           strcat("checkpoint ", m.path, ": tensor name '", printable(t.name, 200),
                  "' cannot be a safetensors tensor name"));
    if (!names.insert(t.name).second)
      fail(ErrorCode::kInvalidArgument,
           strcat("checkpoint ", m.path, ": tensor name '", printable(t.name, 200),
                  "' appears twice; safetensors needs unique names"));
    h[t.name] = {{"dtype", safetensors_dtype(o.dtype)},
                 {"shape", {t.numel}},
                 {"data_offsets", {data, data + t.numel * es}}};
    data += t.numel * es;
    params += t.numel;
  }
  h["__metadata__"] = {{"format", "pt"},
                       {"source", "strata checkpoint export"},
                       {"strata_version", m.strata_version},
                       {"checkpoint_serial", std::to_string(m.serial)},
                       {"step", std::to_string(m.steps)},
                       {"optimizer_step", std::to_string(m.adam_step)},
                       {"saved_world", std::to_string(m.world)},
                       {"saved_stage", std::to_string(m.stage)},
                       {"values", strcat("FP32 master weights as ", dtype_name(o.dtype))}};
  std::string header = h.dump();
  header.resize((header.size() + 7) / 8 * 8, ' ');
  const std::uint64_t hlen = header.size();
  // The output: a temporary file beside it, renamed onto it at the end.
  const auto [parent, name] = split_path(out);
  SafeDirOptions po;
  po.role = "--out directory";
  const SafeDir odir = SafeDir::open(parent, po);
  odir.check_replaceable(name, o.overwrite);
  TempFile tmp{odir, strcat(".", name, ".tmp-", ::getpid())};
  odir.try_remove(tmp.name, false);
  UniqueFd fd = odir.create_file(tmp.name, O_WRONLY);
  const std::string tpath = odir.child_path(tmp.name);
  std::uint64_t pos = 0;
  pwrite_full(fd.get(), &hlen, 8, pos, tpath);
  pos += 8;
  pwrite_full(fd.get(), header.data(), hlen, pos, tpath);
  pos += hlen;
  // The data, tensor by tensor, piece by piece, shard by shard.
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
      if (o.dtype != DType::kFp32) {
        conv.resize(n * es);
        for (std::uint64_t i = 0; i < n; ++i) comm::store_elem(conv.data(), i, o.dtype, in[i]);
        bytes = conv.data();
      }
      pwrite_full(fd.get(), bytes, n * es, pos, tpath);
      pos += n * es;
      done += n;
    }
  }
  if (::fsync(fd.get()) != 0) throw IoError("fsync", tpath, 0, pos, errno, "safetensors export");
  fd.reset();
  odir.check_replaceable(name, o.overwrite);  // again: it may have appeared while we wrote
  const unsigned flags = o.overwrite ? 0u : static_cast<unsigned>(RENAME_NOREPLACE);
  if (::renameat2(odir.fd(), tmp.name.c_str(), odir.fd(), name.c_str(), flags) != 0) {
    const int err = errno;
    if (err == EEXIST)
      fail(ErrorCode::kInvalidArgument,
           strcat(odir.child_path(name), " exists; pass --overwrite to replace it"));
    throw IoError("rename", tpath, 0, 0, err, strcat("to ", odir.child_path(name)));
  }
  tmp.committed = true;
  odir.sync();
  log_info("checkpoint: exported ", m.tensors.size(), " tensors (", params, " parameters, ",
           dtype_name(o.dtype), ") to ", odir.child_path(name));
  return {m.tensors.size(), params, pos};
}

}  // namespace strata::zero
