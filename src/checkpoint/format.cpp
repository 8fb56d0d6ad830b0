// The checkpoint format, version 2 (see format.hpp).
#include "checkpoint/format.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/bounded_json.hpp"
#include "core/checked_math.hpp"
#include "core/crc32c.hpp"
#include "core/printable.hpp"
#include "strata/error.hpp"
#include "strata/partition.hpp"

namespace strata::checkpoint {
namespace {

using nlohmann::json;

constexpr char kMagic[8] = {'S', 'T', 'R', 'A', 'T', 'A', 'C', 'K'};
constexpr std::size_t kHeaderFixed = 128;  // fixed fields; the CRC tables follow
constexpr std::string_view kTrailerHead = ",\n \"manifest_crc32c\": \"";
constexpr std::string_view kTrailerTail = "\"\n}\n";
constexpr std::size_t kTrailerBytes = kTrailerHead.size() + 8 + kTrailerTail.size();
constexpr std::uint64_t kMaxElems = 1ull << 50;  // flat size, far beyond any model
constexpr std::size_t kQuoteBytes = 80;          // of a manifest's string quoted in a message

// What a manifest's JSON may be (docs/offload.md, "Checkpoint format"): the format nests 3 deep;
// a manifest has at most kMaxManifestBytes and kMaxManifestValues values (4 per tensor).
JsonLimits manifest_limits() {
  JsonLimits l;
  l.max_bytes = kMaxManifestBytes;
  l.max_depth = 16;
  l.max_values = kMaxManifestValues;
  l.max_number_chars = 64;
  return l;
}

[[noreturn]] void refuse_json(const ConfigError& e, const std::string& path, const char* what) {
  fail(ErrorCode::kInvalidArgument,
       strcat("checkpoint manifest ", path, ": ", what,
              e.line() ? strcat("line ", e.line(), ", column ", e.column(), ": ") : std::string(),
              e.key_path().empty() ? std::string() : strcat("'", e.key_path(), "': "), e.detail()));
}

std::uint64_t dtype_code(DType t) {
  switch (t) {
    case DType::kFp16: return 1;
    case DType::kBf16: return 2;
    case DType::kFp32: return 3;
  }
  return 0;
}

std::string hex8(std::uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", v);
  return buf;
}

// Typed, range-checked access to the manifest's fields; every failure names the file and field.
class Fields {
 public:
  explicit Fields(const std::string& file) : file_(file) {}

  [[noreturn]] void bad(const std::string& field, const std::string& what) const {
    fail(ErrorCode::kInvalidArgument,
         strcat("checkpoint manifest ", file_, ": field '", field, "': ", what));
  }
  const json& member(const json& obj, const std::string& where, const char* key) const {
    const std::string field = where.empty() ? key : where + "." + key;
    if (!obj.is_object()) bad(where.empty() ? "(top level)" : where, "expected an object");
    auto it = obj.find(key);
    if (it == obj.end()) bad(field, "missing");
    return *it;
  }
  std::uint64_t u64(const json& obj, const std::string& where, const char* key, std::uint64_t lo,
                    std::uint64_t hi) const {
    const json& v = member(obj, where, key);
    const std::string field = where.empty() ? key : where + "." + key;
    if (!v.is_number_unsigned()) {
      if (v.is_number_integer()) bad(field, strcat(v.get<std::int64_t>(), " is negative"));
      bad(field, strcat("expected an unsigned integer, got ", v.type_name()));
    }
    const std::uint64_t x = v.get<std::uint64_t>();
    if (x < lo || x > hi) bad(field, strcat(x, " is out of range [", lo, ", ", hi, "]"));
    return x;
  }
  std::int64_t i64(const json& obj, const std::string& where, const char* key,
                   std::int64_t lo) const {
    const json& v = member(obj, where, key);
    const std::string field = where.empty() ? key : where + "." + key;
    if (v.is_number_unsigned()) {
      if (v.get<std::uint64_t>() >
          static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        bad(field, "out of range");
    } else if (!v.is_number_integer()) {
      bad(field, strcat("expected an integer, got ", v.type_name()));
    }
    const std::int64_t x = v.get<std::int64_t>();
    if (x < lo) bad(field, strcat(x, " is below ", lo));
    return x;
  }
  double non_negative(const json& obj, const std::string& where, const char* key) const {
    const json& v = member(obj, where, key);
    const std::string field = where.empty() ? key : where + "." + key;
    if (!v.is_number()) bad(field, strcat("expected a number, got ", v.type_name()));
    const double x = v.get<double>();
    if (!std::isfinite(x) || !(x >= 0)) bad(field, strcat(x, " must be finite and >= 0"));
    return x;
  }
  double positive(const json& obj, const std::string& where, const char* key) const {
    const json& v = member(obj, where, key);
    const std::string field = where.empty() ? key : where + "." + key;
    if (!v.is_number()) bad(field, strcat("expected a number, got ", v.type_name()));
    const double x = v.get<double>();
    if (!std::isfinite(x) || !(x > 0)) bad(field, strcat(x, " must be finite and > 0"));
    return x;
  }
  std::string str(const json& obj, const std::string& where, const char* key) const {
    const json& v = member(obj, where, key);
    if (!v.is_string())
      bad(where.empty() ? key : where + "." + key,
          strcat("expected a string, got ", v.type_name()));
    return v.get<std::string>();
  }
  const json& array(const json& obj, const std::string& where, const char* key) const {
    const json& v = member(obj, where, key);
    if (!v.is_array())
      bad(where.empty() ? key : where + "." + key,
          strcat("expected an array, got ", v.type_name()));
    return v;
  }

 private:
  const std::string& file_;
};

// A manifest that does not verify: if it parses and names another format or version, say so
// (kInvalidArgument); otherwise nothing. JSON beyond the limits (nested too deep, too many values,
// numbers out of range) is no strata manifest of any version: refused (kInvalidArgument) before
// it is parsed.
void explain_foreign_format(std::string_view text, const std::string& path,
                            const std::string& problem) {
  try {
    check_json_limits(text, path, manifest_limits());
  } catch (const ConfigError& e) {
    refuse_json(e, path, "not a strata checkpoint: ");
  }
  json j = json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return;
  auto fmt = j.find("format");
  if (fmt != j.end() && !(fmt->is_string() && fmt->get<std::string>() == kFormatName))
    fail(ErrorCode::kInvalidArgument,
         strcat("checkpoint manifest ", path, ": not a strata checkpoint (field 'format' is ",
                printable(fmt->dump(), kQuoteBytes), ")"));
  std::string writer = "an unknown strata version";
  if (auto sv = j.find("strata_version"); sv != j.end() && sv->is_string())
    writer = "strata " + printable(sv->get<std::string>(), kQuoteBytes);
  auto ver = j.find("format_version");
  if (ver != j.end() && ver->is_number_unsigned() && ver->get<std::uint64_t>() != kFormatVersion) {
    const auto v = ver->get<std::uint64_t>();
    fail(ErrorCode::kInvalidArgument,
         strcat("checkpoint manifest ", path, ": format version ", v, " (written by ", writer,
                "); this strata reads ", "format ", kFormatVersion,
                v > kFormatVersion ? ": upgrade strata to load it" : "", " (", problem,
                " under format ", kFormatVersion, ")"));
  }
  if (ver == j.end() && fmt != j.end()) {
    auto old = j.find("version");
    if (old != j.end() && old->is_number_unsigned())
      fail(ErrorCode::kInvalidArgument,
           strcat("checkpoint manifest ", path, ": format version ", old->get<std::uint64_t>(),
                  " (an unsealed manifest of an older strata); this strata reads format ",
                  kFormatVersion,
                  ": load it with the strata that wrote it and save it again, or start over"));
  }
}

}  // namespace

std::string shard_file_name(std::uint64_t serial, int rank) {
  return strcat("shard-", serial, "-r", rank, ".bin");
}

bool parse_shard_file_name(std::string_view name, std::uint64_t* serial, int* rank) {
  unsigned long long s = 0;
  int r = 0, end = 0;
  const std::string n(name);
  if (std::sscanf(n.c_str(), "shard-%llu-r%d.bin%n", &s, &r, &end) != 2) return false;
  if (static_cast<std::size_t>(end) != n.size() || shard_file_name(s, r) != n) return false;
  *serial = s;
  *rank = r;
  return true;
}

std::string extra_file_name(std::uint64_t serial) { return strcat("extra-", serial, ".bin"); }

bool parse_extra_file_name(std::string_view name, std::uint64_t* serial) {
  unsigned long long s = 0;
  int end = 0;
  const std::string n(name);
  if (std::sscanf(n.c_str(), "extra-%llu.bin%n", &s, &end) != 1) return false;
  if (static_cast<std::size_t>(end) != n.size() || extra_file_name(s) != n) return false;
  *serial = s;
  return true;
}

bool checkpoint_file_serial(std::string_view name, std::uint64_t* serial) {
  int rank = 0;
  return parse_shard_file_name(name, serial, &rank) || parse_extra_file_name(name, serial);
}

std::uint64_t extra_dtype_size(std::string_view dtype) {
  static constexpr std::pair<std::string_view, std::uint64_t> kSizes[] = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
      {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1}};
  for (const auto& [name, size] : kSizes)
    if (name == dtype) return size;
  return 0;
}

std::uint64_t shape_numel(const std::vector<std::uint64_t>& shape, const std::string& what) {
  if (shape.size() > kMaxShapeDims)
    fail(ErrorCode::kInvalidArgument,
         strcat(what, ": ", shape.size(), " dimensions, more than ", kMaxShapeDims));
  std::uint64_t n = 1;
  for (const std::uint64_t d : shape) {
    if (d > kMaxElems || (d && n > kMaxElems / d))
      fail(ErrorCode::kInvalidArgument,
           strcat(what, ": more than ", kMaxElems, " elements (dimension ", d, ")"));
    n *= d;
  }
  return n;
}

void check_model_names(const Manifest& m) {
  std::set<std::string_view> names;
  auto add = [&](const std::string& name) {
    if (name.empty() || name == "__metadata__")
      fail(ErrorCode::kInvalidArgument,
           strcat("checkpoint ", m.path, ": tensor name '", printable(name, kQuoteBytes),
                  "' cannot be a safetensors tensor name"));
    if (!names.insert(name).second)
      fail(ErrorCode::kInvalidArgument,
           strcat("checkpoint ", m.path, ": tensor name '", printable(name, kQuoteBytes),
                  "' appears twice; safetensors needs unique names"));
  };
  for (const TensorEntry& t : m.tensors) {
    add(t.name);
    for (const std::string& a : t.aliases) add(a);
  }
  for (const ExtraEntry& e : m.extra) add(e.name);
}

namespace {
void set_tensor_shapes(Manifest& m, const CheckpointModel& model) {
  if ((!model.shapes.empty() && model.shapes.size() != m.tensors.size()) ||
      (!model.aliases.empty() && model.aliases.size() != m.tensors.size()))
    fail(ErrorCode::kInvalidArgument,
         strcat("checkpoint: the model description has ", model.shapes.size(), " shapes and ",
                model.aliases.size(), " alias lists for ", m.tensors.size(), " tensors"));
  for (std::size_t i = 0; i < m.tensors.size(); ++i) {
    TensorEntry& t = m.tensors[i];
    if (!model.shapes.empty()) {
      const std::uint64_t n = shape_numel(model.shapes[i], "checkpoint: tensor '" + t.name + "'");
      if (n != t.numel)
        fail(ErrorCode::kInvalidArgument,
             strcat("checkpoint: tensor '", printable(t.name, kQuoteBytes), "': shape of ", n,
                    " elements, the tensor has ", t.numel));
      t.has_shape = true;
      t.shape = model.shapes[i];
    }
    if (!model.aliases.empty()) t.aliases = model.aliases[i];
  }
}
}  // namespace

void set_model(Manifest& m, const CheckpointModel& model, bool crcs) {
  set_tensor_shapes(m, model);
  m.extra.clear();
  m.extra_file.clear();
  m.extra_bytes = 0;
  for (const CheckpointModel::Extra& x : model.extra) {
    const std::string what = "checkpoint: extra tensor '" + printable(x.name, kQuoteBytes) + "'";
    const std::uint64_t es = extra_dtype_size(x.dtype);
    if (es == 0)
      fail(ErrorCode::kInvalidArgument,
           strcat(what, ": dtype '", printable(x.dtype, kQuoteBytes),
                  "' is not one of F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL"));
    const std::uint64_t n = shape_numel(x.shape, what);
    if (x.data.size() / es != n || x.data.size() % es != 0)
      fail(ErrorCode::kInvalidArgument,
           strcat(what, ": ", x.data.size(), " bytes of data for ", n, " elements of ", x.dtype));
    ExtraEntry e{x.name, x.dtype, x.shape, m.extra_bytes, x.data.size(), 0};
    if (crcs) e.crc32c = crc32c(x.data.data(), x.data.size());
    m.extra_bytes += e.bytes;
    m.extra.push_back(std::move(e));
  }
  if (!model.extra.empty()) m.extra_file = extra_file_name(m.serial);
  check_model_names(m);
}

// nlohmann's own strict check (it rejects overlong forms and surrogates too).
bool valid_utf8(std::string_view s) {
  try {
    (void)json(std::string(s)).dump();
    return true;
  } catch (const json::type_error&) {
    return false;
  }
}

namespace {
void write_groups_and_client_state(const Manifest& m, json& j) {
  if (!m.groups.empty()) {
    json groups = json::array();
    for (const GroupEntry& g : m.groups)
      groups.push_back({{"lr", g.lr},
                        {"weight_decay", g.weight_decay},
                        {"beta1", g.beta1},
                        {"beta2", g.beta2},
                        {"eps", g.eps}});
    j["groups"] = std::move(groups);
  }
  if (!m.extra_file.empty()) {
    json tensors = json::array();
    for (const ExtraEntry& e : m.extra)
      tensors.push_back({{"name", e.name},
                         {"dtype", e.dtype},
                         {"shape", e.shape},
                         {"offset", e.offset},
                         {"bytes", e.bytes},
                         {"crc32c", e.crc32c}});
    j["extra"] = {
        {"file", m.extra_file}, {"bytes", m.extra_bytes}, {"tensors", std::move(tensors)}};
  }
  if (m.client_state.empty()) return;
  if (m.client_state.size() > kMaxClientStateBytes || !valid_utf8(m.client_state))
    fail(ErrorCode::kInvalidArgument,
         strcat("checkpoint: the client state (", m.client_state.size(),
                " bytes) must be UTF-8 text of at most ", kMaxClientStateBytes, " bytes"));
  j["client_state"] = m.client_state;
}
}  // namespace

json manifest_fields(const Manifest& m) {
  json j;
  j["format"] = kFormatName;
  j["format_version"] = m.format_version;
  j["strata_version"] = m.strata_version;
  j["serial"] = m.serial;
  j["world"] = m.world;
  j["stage"] = m.stage;
  j["param_dtype"] = dtype_name(m.param_dtype);
  j["flat_size"] = m.flat_size;
  j["partition_size"] = m.partition_size;
  j["block_elems"] = m.block_elems;
  json tensors = json::array();
  for (std::size_t i = 0; i < m.tensors.size(); ++i) {
    const TensorEntry& t = m.tensors[i];
    json e = {{"name", t.name}, {"numel", t.numel}, {"offset", t.offset}};
    if (!m.tensor_steps.empty()) e["step"] = m.tensor_steps.at(i);
    if (t.has_shape) e["shape"] = t.shape;
    if (!t.aliases.empty()) e["aliases"] = t.aliases;
    tensors.push_back(std::move(e));
  }
  j["tensors"] = std::move(tensors);
  j["adam_step"] = m.adam_step;
  j["loss_scale"] = m.loss_scale;
  j["good_steps"] = m.good_steps;
  j["steps"] = m.steps;
  j["applied_steps"] = m.applied_steps;
  j["skipped_steps"] = m.skipped_steps;
  j["config"] = m.config_yaml;
  write_groups_and_client_state(m, j);
  json shards = json::array();
  for (const auto& s : m.shards)
    shards.push_back({{"rank", s.rank},
                      {"file", s.file},
                      {"bytes", s.bytes},
                      {"begin", s.begin},
                      {"count", s.count},
                      {"header_crc32c", s.header_crc32c}});
  j["shards"] = std::move(shards);
  return j;
}

std::string serialize_manifest(const Manifest& m) {
  auto check_name = [](const std::string& name) {
    if (!valid_utf8(name))
      fail(ErrorCode::kInvalidArgument,
           strcat("checkpoint: tensor name '", printable(name, kQuoteBytes),
                  "' is not valid UTF-8"));
  };
  for (const auto& t : m.tensors) {
    check_name(t.name);
    for (const auto& a : t.aliases) check_name(a);
  }
  for (const auto& e : m.extra) check_name(e.name);
  if (!std::isfinite(m.loss_scale) || !(m.loss_scale > 0))
    fail(ErrorCode::kInternal,
         strcat("checkpoint: loss scale ", m.loss_scale, " is not finite and > 0"));
  const json j = manifest_fields(m);
  // The config may hold non-UTF-8 path bytes: they are replaced (it is informational only).
  std::string body = j.dump(1, ' ', false, json::error_handler_t::replace);
  // body ends with "\n}": the seal goes before the closing brace.
  body.resize(body.size() - 2);
  const std::uint32_t crc = crc32c(body.data(), body.size());
  body += kTrailerHead;
  body += hex8(crc);
  body += kTrailerTail;
  return body;
}

namespace {

// 1. The seal: the trailer's CRC32C over the bytes before it. Returns that CRC.
std::uint32_t check_seal(std::string_view text, const std::string& path) {
  bool sealed = text.size() > kTrailerBytes;
  std::uint32_t stored = 0;
  if (sealed) {
    const std::string_view tail = text.substr(text.size() - kTrailerBytes);
    sealed = tail.substr(0, kTrailerHead.size()) == kTrailerHead &&
             tail.substr(kTrailerHead.size() + 8) == kTrailerTail;
    for (std::size_t i = 0; sealed && i < 8; ++i) {
      const char c = tail[kTrailerHead.size() + i];
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) sealed = false;
      stored = stored << 4 | static_cast<std::uint32_t>(d < 0 ? 0 : d);
    }
  }
  if (!sealed) {
    explain_foreign_format(text, path, "no checksum trailer");
    fail(ErrorCode::kChecksum, strcat("checkpoint manifest ", path, " (", text.size(),
                                      " bytes) is truncated or damaged: it does not end "
                                      "with its \"manifest_crc32c\" seal"));
  }
  const std::string_view body = text.substr(0, text.size() - kTrailerBytes);
  const std::uint32_t crc = crc32c(body.data(), body.size());
  if (crc != stored) {
    explain_foreign_format(text, path, "its checksum does not verify");
    fail(ErrorCode::kChecksum,
         strcat("checkpoint manifest ", path, ": field 'manifest_crc32c': CRC32C of the ",
                body.size(), " bytes before it is ", hex8(crc), ", the manifest says ",
                hex8(stored), " (the file was changed or damaged after it was written)"));
  }
  return crc;
}

// 2. The format and its version.
void read_format(const json& j, Fields& f, Manifest& m) {
  if (f.str(j, "", "format") != kFormatName) f.bad("format", strcat("not '", kFormatName, "'"));
  m.format_version = static_cast<std::uint32_t>(f.u64(j, "", "format_version", 0, ~0u));
  m.strata_version = f.str(j, "", "strata_version");
  if (m.format_version != kFormatVersion)
    f.bad("format_version",
          strcat(m.format_version, " (written by strata ", printable(m.strata_version, kQuoteBytes),
                 "); this strata reads format ", kFormatVersion,
                 m.format_version > kFormatVersion ? ": upgrade strata to load it" : ""));
}

// A shape: an array of at most kMaxShapeDims unsigned integers; returns its element count.
std::uint64_t read_shape(const json& obj, const std::string& where, Fields& f,
                         std::vector<std::uint64_t>& shape) {
  const json& dims = f.array(obj, where, "shape");
  if (dims.size() > kMaxShapeDims)
    f.bad(where + ".shape", strcat(dims.size(), " dimensions, more than ", kMaxShapeDims));
  std::uint64_t n = 1;
  for (const json& d : dims) {
    if (!d.is_number_unsigned() || d.get<std::uint64_t>() > kMaxElems)
      f.bad(where + ".shape", strcat("a dimension is not an unsigned integer up to ", kMaxElems));
    const std::uint64_t x = d.get<std::uint64_t>();
    if (x && n > kMaxElems / x)
      f.bad(where + ".shape", strcat("more than ", kMaxElems, " elements"));
    n *= x;
    shape.push_back(x);
  }
  return n;
}

// A tensor's optional model shape (its element count must be numel) and aliases.
void read_shape_and_aliases(const json& obj, const std::string& where, Fields& f, TensorEntry& t) {
  if (obj.contains("shape")) {
    t.has_shape = true;
    const std::uint64_t n = read_shape(obj, where, f, t.shape);
    if (n != t.numel) f.bad(where + ".shape", strcat(n, " elements, the tensor has ", t.numel));
  }
  if (!obj.contains("aliases")) return;
  const json& aliases = f.array(obj, where, "aliases");
  for (std::size_t k = 0; k < aliases.size(); ++k) {
    if (!aliases[k].is_string() || aliases[k].get<std::string>().empty())
      f.bad(strcat(where, ".aliases[", k, "]"), "expected a non-empty string");
    t.aliases.push_back(aliases[k].get<std::string>());
  }
}

// 3. The layout: world, stage, dtype, sizes, tensors (checked against the engine's partition).
void read_layout(const json& j, Fields& f, Manifest& m) {
  m.serial = f.u64(j, "", "serial", 1, 1ull << 62);
  m.world = static_cast<int>(f.u64(j, "", "world", 1, kMaxWorld));
  m.stage = static_cast<int>(f.u64(j, "", "stage", 0, 3));
  const std::string dt = f.str(j, "", "param_dtype");
  if (dt == "fp16")
    m.param_dtype = DType::kFp16;
  else if (dt == "bf16")
    m.param_dtype = DType::kBf16;
  else if (dt == "fp32")
    m.param_dtype = DType::kFp32;
  else
    f.bad("param_dtype", strcat("'", printable(dt, kQuoteBytes), "' is not fp16, bf16 or fp32"));
  m.partition_size =
      f.u64(j, "", "partition_size", 1, kMaxElems / static_cast<std::uint64_t>(m.world));
  m.flat_size = f.u64(j, "", "flat_size", 1, kMaxElems);
  if (m.flat_size != m.partition_size * static_cast<std::uint64_t>(m.world))
    f.bad("flat_size",
          strcat(m.flat_size, " != partition_size ", m.partition_size, " x world ", m.world));
  m.block_elems = f.u64(j, "", "block_elems", 1, kMaxBlockElems);
  const json& tensors = f.array(j, "", "tensors");
  std::uint64_t end = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::string where = strcat("tensors[", i, "]");
    TensorEntry t;
    t.name = f.str(tensors[i], where, "name");
    t.numel = f.u64(tensors[i], where, "numel", 0, m.flat_size);
    t.offset = f.u64(tensors[i], where, "offset", end, m.flat_size - t.numel);
    end = t.offset + t.numel;
    read_shape_and_aliases(tensors[i], where, f, t);
    m.tensors.push_back(std::move(t));
    // Optional, on every tensor or none: each tensor's own step count.
    const bool has_step = tensors[i].contains("step");
    if (i > 0 && has_step != !m.tensor_steps.empty())
      f.bad(where + ".step", "present for some tensors only");
    if (has_step) m.tensor_steps.push_back(f.i64(tensors[i], where, "step", 0));
  }
  // The layout is the engine's (strata/partition.hpp): offsets and partition size follow from the
  // tensor sizes and the world.
  std::vector<TensorSpec> specs;
  for (const auto& t : m.tensors) specs.push_back({t.name, t.numel});
  const Partition p(std::move(specs), m.world, 1);
  for (std::size_t i = 0; i < m.tensors.size(); ++i)
    if (p.offset(i) != m.tensors[i].offset)
      f.bad(strcat("tensors[", i, "].offset"),
            strcat(m.tensors[i].offset, " is not the layout's ", p.offset(i)));
  if (p.partition_size() != m.partition_size)
    f.bad("partition_size", strcat(m.partition_size, " is not the layout's ", p.partition_size()));
}

// 4b. The optional groups and client state (absent: empty).
void read_groups_and_client_state(const json& j, Fields& f, Manifest& m) {
  if (j.contains("groups")) {
    const json& groups = f.array(j, "", "groups");
    if (groups.size() > kMaxGroups) f.bad("groups", strcat(groups.size(), " entries"));
    for (std::size_t i = 0; i < groups.size(); ++i) {
      const std::string where = strcat("groups[", i, "]");
      GroupEntry g;
      g.lr = f.non_negative(groups[i], where, "lr");
      g.weight_decay = f.non_negative(groups[i], where, "weight_decay");
      g.beta1 = f.non_negative(groups[i], where, "beta1");
      g.beta2 = f.non_negative(groups[i], where, "beta2");
      g.eps = f.non_negative(groups[i], where, "eps");
      if (g.beta1 >= 1 || g.beta2 >= 1) f.bad(where, "a beta is not below 1");
      m.groups.push_back(g);
    }
  }
  if (j.contains("client_state")) {
    m.client_state = f.str(j, "", "client_state");
    if (m.client_state.size() > kMaxClientStateBytes)
      f.bad("client_state",
            strcat(m.client_state.size(), " bytes, more than ", kMaxClientStateBytes));
  }
}

// 4c. The optional extra file: its name, size, and its tensors back to back inside it.
void read_extra(const json& j, Fields& f, Manifest& m) {
  if (!j.contains("extra")) return;
  const json& x = f.member(j, "", "extra");
  m.extra_file = f.str(x, "extra", "file");
  if (m.extra_file != extra_file_name(m.serial))
    f.bad("extra.file", strcat("'", printable(m.extra_file, kQuoteBytes), "' is not '",
                               extra_file_name(m.serial), "'"));
  m.extra_bytes = f.u64(x, "extra", "bytes", 0, 1ull << 62);
  const json& tensors = f.array(x, "extra", "tensors");
  std::uint64_t end = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::string where = strcat("extra.tensors[", i, "]");
    ExtraEntry e;
    e.name = f.str(tensors[i], where, "name");
    if (e.name.empty()) f.bad(where + ".name", "empty");
    e.dtype = f.str(tensors[i], where, "dtype");
    const std::uint64_t es = extra_dtype_size(e.dtype);
    if (es == 0)
      f.bad(where + ".dtype", strcat("'", printable(e.dtype, kQuoteBytes),
                                     "' is not one of F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL"));
    const std::uint64_t n = read_shape(tensors[i], where, f, e.shape);
    e.offset = f.u64(tensors[i], where, "offset", end, end);
    e.bytes = f.u64(tensors[i], where, "bytes", 0, m.extra_bytes - end);
    if (n > e.bytes / es || n * es != e.bytes)
      f.bad(where + ".bytes", strcat(e.bytes, " bytes for ", n, " elements of ", e.dtype));
    e.crc32c = static_cast<std::uint32_t>(f.u64(tensors[i], where, "crc32c", 0, ~0u));
    end += e.bytes;
    m.extra.push_back(std::move(e));
  }
  if (end != m.extra_bytes)
    f.bad("extra.bytes", strcat(m.extra_bytes, " bytes, its tensors hold ", end));
}

// 4. The scalars and the config.
void read_scalars(const json& j, Fields& f, Manifest& m) {
  m.adam_step = f.i64(j, "", "adam_step", 0);
  m.loss_scale = f.positive(j, "", "loss_scale");
  m.good_steps = static_cast<std::uint32_t>(f.u64(j, "", "good_steps", 0, ~0u));
  m.steps = f.u64(j, "", "steps", 0, ~0ull);
  m.applied_steps = f.u64(j, "", "applied_steps", 0, m.steps);
  m.skipped_steps = f.u64(j, "", "skipped_steps", 0, m.steps);
  m.config_yaml = f.str(j, "", "config");
}

// 5. One shard per rank, each exactly where the layout puts it.
void read_shards(const json& j, Fields& f, Manifest& m) {
  const json& shards = f.array(j, "", "shards");
  if (shards.size() != static_cast<std::size_t>(m.world))
    f.bad("shards", strcat(shards.size(), " entries for world ", m.world));
  const ShardLayout layout = shard_layout(m.partition_size, m.param_dtype, m.block_elems);
  for (std::size_t r = 0; r < shards.size(); ++r) {
    const std::string where = strcat("shards[", r, "]");
    ShardEntry s;
    s.rank = static_cast<int>(f.u64(shards[r], where, "rank", r, r));
    s.file = f.str(shards[r], where, "file");
    if (s.file != shard_file_name(m.serial, s.rank))
      f.bad(where + ".file", strcat("'", printable(s.file, kQuoteBytes), "' is not '",
                                    shard_file_name(m.serial, s.rank), "'"));
    s.begin = f.u64(shards[r], where, "begin", r * m.partition_size, r * m.partition_size);
    s.count = f.u64(shards[r], where, "count", m.partition_size, m.partition_size);
    s.bytes = f.u64(shards[r], where, "bytes", layout.total, layout.total);
    s.header_crc32c = static_cast<std::uint32_t>(f.u64(shards[r], where, "header_crc32c", 0, ~0u));
    m.shards.push_back(std::move(s));
  }
}

}  // namespace

Manifest parse_manifest(std::string_view text, const std::string& path) {
  const std::uint32_t crc = check_seal(text, path);
  json j;
  try {
    j = parse_bounded_json(text, path, manifest_limits());
  } catch (const ConfigError& e) {
    refuse_json(e, path, "sealed, but not a manifest's JSON: ");
  }
  Fields f(path);
  Manifest m;
  m.path = path;
  m.crc32c = crc;
  read_format(j, f, m);
  read_layout(j, f, m);
  read_scalars(j, f, m);
  read_groups_and_client_state(j, f, m);
  read_extra(j, f, m);
  read_shards(j, f, m);
  return m;
}

Manifest read_manifest(const SafeDir& dir, FileEnv& env) {
  const std::string path = dir.child_path(kManifestName);
  std::unique_ptr<RandomAccessFile> file;
  try {
    file = env.open_file(dir, kManifestName);
  } catch (const IoError& e) {
    if (e.errnum() == ENOENT)
      throw IoError("open", path, 0, 0, ENOENT, "no checkpoint in this directory");
    throw;
  }
  const struct stat st = file->status();
  if (!S_ISREG(st.st_mode))
    fail(ErrorCode::kInvalidArgument,
         strcat("checkpoint manifest ", path, " is not a regular file"));
  if (static_cast<std::uint64_t>(st.st_size) > kMaxManifestBytes)
    fail(ErrorCode::kInvalidArgument,
         strcat("checkpoint manifest ", path, " is ", st.st_size, " bytes, more than the ",
                kMaxManifestBytes, " a manifest may have"));
  std::string text(static_cast<std::size_t>(st.st_size), '\0');
  file->read_at(text.data(), text.size(), 0);
  return parse_manifest(text, path);
}

std::unique_ptr<RandomAccessFile> open_extra_file(const SafeDir& dir, const Manifest& m,
                                                  FileEnv& env) {
  const std::string path = dir.child_path(m.extra_file);
  std::unique_ptr<RandomAccessFile> file;
  try {
    file = env.open_file(dir, m.extra_file);
  } catch (const IoError& e) {
    if (e.errnum() == ENOENT)
      fail(ErrorCode::kChecksum, strcat("checkpoint extra file ", path, ", named by ", m.path,
                                        ", is missing: the checkpoint is incomplete"));
    throw;
  }
  const struct stat st = file->status();
  if (!S_ISREG(st.st_mode))
    fail(ErrorCode::kChecksum, strcat("checkpoint extra file ", path, " is not a regular file"));
  if (static_cast<std::uint64_t>(st.st_size) != m.extra_bytes)
    fail(ErrorCode::kChecksum,
         strcat("checkpoint extra file ", path, " is ", st.st_size, " bytes, the manifest says ",
                m.extra_bytes, ": the checkpoint is damaged"));
  return file;
}

void read_extra_tensor(RandomAccessFile& file, const Manifest& m, std::size_t i,
                       const std::function<void(const unsigned char*, std::uint64_t)>& sink) {
  const ExtraEntry& e = m.extra.at(i);
  std::vector<unsigned char> buf(std::min(e.bytes, kExtraPiece));
  std::uint32_t crc = 0;
  for (std::uint64_t done = 0; done < e.bytes;) {
    const std::uint64_t n = std::min(e.bytes - done, kExtraPiece);
    file.read_at(buf.data(), n, e.offset + done);
    crc = crc32c(buf.data(), n, crc);
    sink(buf.data(), n);
    done += n;
  }
  if (crc != e.crc32c)
    fail(ErrorCode::kChecksum,
         strcat("checkpoint extra file ", m.extra_file, " of ", m.path, ": tensor '",
                printable(e.name, kQuoteBytes), "' (offset ", e.offset, ", ", e.bytes,
                " bytes) CRC32C ", hex8(crc), ", the manifest says ", hex8(e.crc32c)));
}

ShardLayout shard_layout(std::uint64_t count, DType param_dtype, std::uint64_t block_elems) {
  ShardLayout l;
  l.nblocks = (count + block_elems - 1) / block_elems;
  const std::uint64_t table = kSections * 4 * l.nblocks;
  if (table > kMaxHeaderBytes)
    fail(ErrorCode::kInvalidArgument,
         strcat("checkpoint: ", l.nblocks, " blocks per section need a header of ", table,
                " bytes (at most ", kMaxHeaderBytes, ")"));
  l.header_bytes = round_up(kHeaderFixed + table, kSectionAlign);
  l.elem_bytes[kParams] = dtype_size(param_dtype);
  l.elem_bytes[kMaster] = l.elem_bytes[kExpAvg] = l.elem_bytes[kExpAvgSq] = 4;
  std::uint64_t off = l.header_bytes;
  for (int s = 0; s < kSections; ++s) {
    l.offset[s] = off;
    l.bytes[s] = count * l.elem_bytes[s];
    off = round_up(off + l.bytes[s], kSectionAlign);
    l.padded[s] = off - l.offset[s];
  }
  l.total = off;
  return l;
}

namespace {

// The shard header's ten fixed fields (after magic and version), in order: what a shard of
// `rank` must say under manifest `m` and layout `l`. Written by encode_shard_header, checked by
// ShardReader.
constexpr int kHeaderFields = 10;
std::array<std::uint64_t, kHeaderFields> header_fields(const Manifest& m, int rank,
                                                       const ShardLayout& l) {
  const ShardEntry& s = m.shards.at(static_cast<std::size_t>(rank));
  return {l.header_bytes,
          m.serial,
          static_cast<std::uint64_t>(rank),
          static_cast<std::uint64_t>(m.world),
          static_cast<std::uint64_t>(m.stage),
          dtype_code(m.param_dtype),
          s.begin,
          s.count,
          m.block_elems,
          l.nblocks};
}

}  // namespace

std::vector<unsigned char> encode_shard_header(
    const Manifest& m, int rank, const ShardLayout& l,
    const std::vector<std::uint32_t> (&crcs)[kSections]) {
  std::vector<unsigned char> h(l.header_bytes, 0);
  std::memcpy(h.data(), kMagic, 8);
  const std::uint32_t version = kFormatVersion;
  std::memcpy(h.data() + 8, &version, 4);
  const auto fields = header_fields(m, rank, l);
  std::memcpy(h.data() + 16, fields.data(), sizeof(fields));
  for (int sec = 0; sec < kSections; ++sec) {
    if (crcs[sec].size() != l.nblocks)
      fail(ErrorCode::kInternal,
           strcat("checkpoint: ", crcs[sec].size(), " block CRCs for ", l.nblocks, " blocks"));
    std::memcpy(h.data() + kHeaderFixed + 4 * l.nblocks * static_cast<std::uint64_t>(sec),
                crcs[sec].data(), 4 * l.nblocks);
  }
  return h;
}

// ---- ShardReader
// ----------------------------------------------------------------------------------

ShardReader::ShardReader(const SafeDir& dir, const Manifest& m, int shard, FileEnv& env)
    : m_(m), shard_(shard), layout_(shard_layout(m.partition_size, m.param_dtype, m.block_elems)) {
  const ShardEntry& e = m.shards.at(static_cast<std::size_t>(shard));
  path_ = dir.child_path(e.file);
  try {
    file_ = env.open_file(dir, e.file);
  } catch (const IoError& err) {
    if (err.errnum() == ENOENT)
      fail(ErrorCode::kChecksum,
           strcat("checkpoint shard ", path_, " (rank ", shard, "), named by ", m.path,
                  ", is missing: the checkpoint is incomplete"));
    throw;
  }
  const struct stat st = file_->status();
  if (!S_ISREG(st.st_mode))
    fail(ErrorCode::kChecksum, strcat("checkpoint shard ", path_, " is not a regular file"));
  if (static_cast<std::uint64_t>(st.st_size) != e.bytes)
    fail(ErrorCode::kChecksum,
         strcat("checkpoint shard ", path_, " is ", st.st_size, " bytes, the manifest says ",
                e.bytes, static_cast<std::uint64_t>(st.st_size) < e.bytes ? " (truncated)" : "",
                ": the checkpoint is damaged"));
  std::vector<unsigned char> h(layout_.header_bytes);
  file_->read_at(h.data(), h.size(), 0);
  bytes_read_ += h.size();
  const std::uint32_t crc = crc32c(h.data(), h.size());
  if (crc != e.header_crc32c)
    fail(ErrorCode::kChecksum,
         strcat("checkpoint shard ", path_, ": header (", h.size(), " bytes at offset 0) CRC32C ",
                hex8(crc), ", the manifest says ", hex8(e.header_crc32c)));
  std::uint32_t version = 0;
  std::memcpy(&version, h.data() + 8, 4);
  std::uint64_t fields[kHeaderFields];
  std::memcpy(fields, h.data() + 16, sizeof(fields));
  const auto want = header_fields(m, shard, layout_);
  const char* names[kHeaderFields] = {"header_bytes", "serial", "rank",  "world",       "stage",
                                      "param_dtype",  "begin",  "count", "block_elems", "nblocks"};
  if (std::memcmp(h.data(), kMagic, 8) != 0 || version != kFormatVersion)
    fail(ErrorCode::kChecksum,
         strcat("checkpoint shard ", path_, ": not a strata shard of format ", kFormatVersion));
  for (int i = 0; i < kHeaderFields; ++i)
    if (fields[i] != want[i])
      fail(ErrorCode::kChecksum,
           strcat("checkpoint shard ", path_, ": header field ", names[i], " is ", fields[i],
                  ", the manifest ", m.path, " implies ", want[i]));
  for (int s = 0; s < kSections; ++s) {
    crc_[s].resize(layout_.nblocks);
    verified_[s].assign(layout_.nblocks, false);
    std::memcpy(crc_[s].data(),
                h.data() + kHeaderFixed + 4 * layout_.nblocks * static_cast<std::uint64_t>(s),
                4 * layout_.nblocks);
  }
}

void ShardReader::load_blocks(Section s, std::uint64_t b0, std::uint64_t b1) {
  const std::uint64_t be = m_.block_elems, eb = layout_.elem_bytes[s];
  const std::uint64_t count = m_.shards[static_cast<std::size_t>(shard_)].count;
  const std::uint64_t first = b0 * be, last = std::min(count, b1 * be);
  Cache& c = cache_[s];
  c.b0 = c.b1 = 0;
  // The last block's checksum covers the section's padding too.
  const std::uint64_t pad = b1 == layout_.nblocks ? layout_.padded[s] - layout_.bytes[s] : 0;
  c.buf.resize((last - first) * eb + pad);
  const std::uint64_t off = layout_.offset[s] + first * eb;
  file_->read_at(c.buf.data(), c.buf.size(), off);
  bytes_read_ += c.buf.size();
  for (std::uint64_t b = b0; b < b1; ++b) {
    const std::uint64_t e0 = b * be, e1 = std::min(count, e0 + be);
    const std::uint64_t n = (e1 - e0) * eb + (b + 1 == layout_.nblocks ? pad : 0);
    check_block_crc(s, b, layout_.offset[s] + e0 * eb, n,
                    crc32c(c.buf.data() + (e0 - first) * eb, n));
  }
  c.b0 = b0;
  c.b1 = b1;
}

void ShardReader::check_range(std::uint64_t first, std::uint64_t n) const {
  const std::uint64_t count = m_.shards[static_cast<std::size_t>(shard_)].count;
  if (first > count || n > count - first)
    fail(ErrorCode::kInternal,
         strcat("checkpoint: read of [", first, ", +", n, ") beyond shard ", path_));
}

void ShardReader::read(Section s, std::uint64_t first, std::uint64_t n, void* dst) {
  check_range(first, n);
  const std::uint64_t be = m_.block_elems, eb = layout_.elem_bytes[s];
  auto* out = static_cast<unsigned char*>(dst);
  const std::uint64_t last_block = n ? (first + n - 1) / be : 0;
  // At most kCacheBytes of blocks at a time (one block at least).
  const std::uint64_t per_load =
      std::max<std::uint64_t>(1, std::min(kCacheBlocks, kCacheBytes / (be * eb)));
  for (std::uint64_t pos = first; pos < first + n;) {
    const std::uint64_t b = pos / be;
    Cache& c = cache_[s];
    if (b < c.b0 || b >= c.b1) load_blocks(s, b, std::min(b + per_load, last_block + 1));
    const std::uint64_t stop = std::min(first + n, c.b1 * be);
    std::memcpy(out + (pos - first) * eb, c.buf.data() + (pos - c.b0 * be) * eb, (stop - pos) * eb);
    pos = stop;
  }
}

void ShardReader::verify(Section s, std::uint64_t first, std::uint64_t n) {
  check_range(first, n);
  if (n == 0) return;
  const std::uint64_t be = m_.block_elems, eb = layout_.elem_bytes[s];
  const std::uint64_t count = m_.shards[static_cast<std::size_t>(shard_)].count;
  std::vector<unsigned char> buf;
  for (std::uint64_t b = first / be; b <= (first + n - 1) / be; ++b) {
    const Cache& c = cache_[s];
    if (b >= c.b0 && b < c.b1) continue;  // verified when it was loaded
    if (verified_[s][b]) continue;        // a tensor before this one shares the block
    // The block in pieces of at most kVerifyPiece bytes, its CRC32C continued over them.
    const std::uint64_t e0 = b * be, e1 = std::min(count, e0 + be);
    const std::uint64_t pad = b + 1 == layout_.nblocks ? layout_.padded[s] - layout_.bytes[s] : 0;
    const std::uint64_t off = layout_.offset[s] + e0 * eb, len = (e1 - e0) * eb + pad;
    buf.resize(std::min(len, kVerifyPiece));
    std::uint32_t crc = 0;
    for (std::uint64_t done = 0; done < len;) {
      const std::uint64_t k = std::min(len - done, kVerifyPiece);
      file_->read_at(buf.data(), k, off + done);
      crc = crc32c(buf.data(), k, crc);
      done += k;
    }
    bytes_read_ += len;
    check_block_crc(s, b, off, len, crc);
    verified_[s][b] = true;
  }
}

void ShardReader::check_block_crc(Section s, std::uint64_t b, std::uint64_t offset,
                                  std::uint64_t len, std::uint32_t crc) const {
  if (crc != crc_[s][b])
    fail(ErrorCode::kChecksum,
         strcat("checkpoint shard ", path_, ": section ", kSectionNames[s], " block ", b,
                " (offset ", offset, ", ", len, " bytes) CRC32C ", hex8(crc), ", the header says ",
                hex8(crc_[s][b])));
}

}  // namespace strata::checkpoint
