// YAML (+ --set overrides) -> validated Config. Every failure is a ConfigError naming
// FILE:LINE:COL (1-based) or "--set key=value", the key path, and what is wrong.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <system_error>

#include "config/schema.hpp"
#include "config/suggest.hpp"
#include "strata/config.hpp"
#include "strata/error.hpp"
#include "strata/units.hpp"

namespace strata {
namespace {

using config_detail::closest;

constexpr std::size_t kMaxConfigBytes = 1 << 20;  // a config file or text is at most 1 MiB
using config_detail::schema_root;
using config_detail::SchemaNode;

std::string join_path(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}

std::string list_names(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + names[i];
  return out;
}

// parent[key], or a null node when parent is not a mapping or has no such key (indexing a
// missing yaml-cpp node throws).
YAML::Node child(const YAML::Node& parent, const char* key) {
  if (!parent.IsDefined() || !parent.IsMap()) return YAML::Node();
  const YAML::Node n = parent[key];
  if (!n.IsDefined()) return YAML::Node();
  return n;
}

const char* kind_name(const YAML::Node& n) {
  if (!n.IsDefined()) return "nothing";
  switch (n.Type()) {
    case YAML::NodeType::Map: return "a mapping";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Scalar: return "a scalar";
    case YAML::NodeType::Null: return "no value";
    case YAML::NodeType::Undefined: return "nothing";
  }
  return "?";
}

YAML::Node load_single_document(std::string_view yaml, const std::string& source,
                                const std::string& key);

// Reads one YAML tree into a Config; knows where every key came from.
class Reader {
 public:
  explicit Reader(std::string file) : file_(std::move(file)) {}

  [[noreturn]] void error(const std::string& path, const std::string& message) const {
    // An overridden key (or one inside an overridden mapping) is reported at its --set.
    for (std::string p = path;;) {
      if (auto it = overrides_.find(p); it != overrides_.end())
        throw ConfigError(it->second, 0, 0, path, message);
      auto dot = p.rfind('.');
      if (dot == std::string::npos) break;
      p = p.substr(0, dot);
    }
    for (std::string p = path;;) {
      if (auto it = marks_.find(p); it != marks_.end()) {
        throw ConfigError(file_, it->second.line >= 0 ? it->second.line + 1 : 0,
                          it->second.column >= 0 ? it->second.column + 1 : 0, path, message);
      }
      if (p.empty()) break;
      auto dot = p.rfind('.');
      p = dot == std::string::npos ? std::string() : p.substr(0, dot);
    }
    throw ConfigError(file_, 0, 0, path, message);
  }

  [[noreturn]] void error_at(const YAML::Mark& mark, const std::string& path,
                             const std::string& message) const {
    throw ConfigError(file_, mark.line >= 0 ? mark.line + 1 : 0,
                      mark.column >= 0 ? mark.column + 1 : 0, path, message);
  }

  // --set key.path=value, applied to the tree before anything is read.
  void apply_override(YAML::Node& root, const std::string& text) {
    const std::string where = "--set " + text;
    auto eq = text.find('=');
    if (eq == std::string::npos)
      throw ConfigError(where, 0, 0, "", "expected KEY.PATH=VALUE, e.g. --set zero.stage=3");
    std::string path = text.substr(0, eq);
    std::string value_text = text.substr(eq + 1);
    std::vector<std::string> parts;
    {
      std::stringstream ss(path);
      std::string seg;
      while (std::getline(ss, seg, '.')) parts.push_back(seg);
    }
    if (path.empty() || parts.empty())
      throw ConfigError(where, 0, 0, "", "empty key path; expected KEY.PATH=VALUE");
    const SchemaNode* schema = &schema_root();
    std::string so_far;
    for (const auto& seg : parts) {
      const SchemaNode* next = schema->is_mapping() ? schema->child(seg) : nullptr;
      std::string here = join_path(so_far, seg);
      if (!next) {
        if (!schema->is_mapping())
          throw ConfigError(where, 0, 0, here, "'" + so_far + "' is a value, not a section");
        std::string msg =
            "unknown key '" + seg + "'" + (so_far.empty() ? std::string() : " in '" + so_far + "'");
        std::string s = closest(seg, schema->child_names());
        if (!s.empty()) msg += "; did you mean '" + s + "'?";
        msg += " (valid keys: " + list_names(schema->child_names()) + ")";
        throw ConfigError(where, 0, 0, here, msg);
      }
      schema = next;
      so_far = here;
    }
    YAML::Node value;
    try {
      value = load_single_document(value_text, where, path);
    } catch (const ConfigError& e) {
      throw ConfigError(where, 0, 0, path, "the value is not valid YAML: " + e.detail());
    }
    if (!value.IsDefined() || value.IsNull())
      throw ConfigError(where, 0, 0, path, "no value given after '='");
    YAML::Node cur;
    cur.reset(root);
    so_far.clear();
    for (std::size_t i = 0; i + 1 < parts.size(); ++i) {
      so_far = join_path(so_far, parts[i]);
      YAML::Node next = cur[parts[i]];
      if (!next.IsDefined() || next.IsNull()) {
        cur[parts[i]] = YAML::Node(YAML::NodeType::Map);
      } else if (next.IsScalar() && so_far.rfind("offload.", 0) == 0) {
        YAML::Node m(YAML::NodeType::Map);
        m["tier"] = next.Scalar();
        cur[parts[i]] = m;
      } else if (!next.IsMap()) {
        throw ConfigError(where, 0, 0, so_far,
                          std::string("cannot set a key inside it: it is ") + kind_name(next) +
                              " in the config, not a mapping");
      }
      YAML::Node child = cur[parts[i]];
      cur.reset(child);
    }
    cur[parts.back()] = value;
    overrides_[path] = where;
  }

  // Rejects unknown and duplicate keys everywhere; records where each value is.
  void check_keys(const YAML::Node& map, const SchemaNode& schema, const std::string& path) {
    std::set<std::string> seen;
    for (auto it = map.begin(); it != map.end(); ++it) {
      // Copies: yaml-cpp's iterator proxy (it->) is a temporary.
      const YAML::Node key = it->first;
      const YAML::Node value = it->second;
      if (!key.IsScalar())
        error_at(key.Mark(), path,
                 std::string("a key must be a plain name, got ") + kind_name(key));
      const std::string name = key.Scalar();
      const std::string here = join_path(path, name);
      const SchemaNode* child = schema.child(name);
      if (!child) {
        std::string msg =
            "unknown key '" + name + "'" + (path.empty() ? std::string() : " in '" + path + "'");
        std::string s = closest(name, schema.child_names());
        if (!s.empty()) msg += "; did you mean '" + s + "'?";
        msg += " (valid keys: " + list_names(schema.child_names()) + ")";
        if (overrides_.count(path) || overrides_.count(here)) error(here, msg);
        error_at(key.Mark(), here, msg);
      }
      if (!seen.insert(name).second) error_at(key.Mark(), here, "duplicate key '" + name + "'");
      marks_[here] = value.Mark().is_null() ? key.Mark() : value.Mark();
      if (child->is_mapping()) {
        if (value.IsMap()) {
          check_keys(value, *child, here);
        } else if (value.IsNull()) {
          // An empty section: all defaults.
        } else if (value.IsScalar() && path == "offload") {
          // Shorthand `optimizer: cpu` = {tier: cpu}.
        } else {
          error(here, std::string("expected a mapping with keys (") +
                          list_names(child->child_names()) + "), got " + kind_name(value));
        }
      }
    }
  }

  // ---- values ----------------------------------------------------------------------------
  const std::string& scalar(const YAML::Node& n, const std::string& path, const char* what) {
    if (!n.IsScalar()) error(path, std::string("expected ") + what + ", got " + kind_name(n));
    return n.Scalar();
  }

  // A scalar (`what` it should be) read by `parse` (parse_count, parse_bytes), in [lo, hi]; the
  // parser's refusal is reported at the node.
  std::uint64_t parsed(const YAML::Node& n, const std::string& path, const char* what,
                       std::uint64_t (*parse)(std::string_view), std::uint64_t lo,
                       std::uint64_t hi) {
    const std::string& s = scalar(n, path, what);
    std::uint64_t v = 0;
    try {
      v = parse(s);
    } catch (const Error& e) {
      error(path, e.what());
    }
    range(path, s, v, lo, hi);
    return v;
  }

  std::uint64_t count(const YAML::Node& n, const std::string& path, std::uint64_t lo,
                      std::uint64_t hi) {
    return parsed(n, path, "a count (e.g. 7.5B, 350M, 1200)", parse_count, lo, hi);
  }

  std::uint64_t integer(const YAML::Node& n, const std::string& path, std::uint64_t lo,
                        std::uint64_t hi) {
    return count(n, path, lo, hi);
  }

  std::uint64_t bytes(const YAML::Node& n, const std::string& path, std::uint64_t lo,
                      std::uint64_t hi = std::numeric_limits<std::uint64_t>::max()) {
    return parsed(n, path, "a size (e.g. 4GiB, 512MiB, 80GB)", parse_bytes, lo, hi);
  }

  void range(const std::string& path, const std::string& s, std::uint64_t v, std::uint64_t lo,
             std::uint64_t hi) {
    if (v < lo || v > hi) {
      std::string r = hi == std::numeric_limits<std::uint64_t>::max()
                          ? ">= " + std::to_string(lo)
                          : "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
      error(path, "'" + s + "' is out of range: must be " + r);
    }
  }

  double number(const YAML::Node& n, const std::string& path) {
    const std::string& s = scalar(n, path, "a number");
    const char* b = s.c_str();
    char* end = nullptr;
    errno = 0;
    double v = std::strtod(b, &end);
    if (s.empty() || end != b + s.size() || s.find_first_of("xXnN") != std::string::npos)
      error(path, "'" + s + "' is not a number");
    if (errno == ERANGE && std::fabs(v) > 1.0)
      error(path, "'" + s + "' is out of range for a number");
    if (!std::isfinite(v)) error(path, "'" + s + "' is not a finite number");
    return v;
  }

  // A number in [lo, hi] (lo excluded when lo_open, hi excluded when hi_open).
  double number_in(const YAML::Node& n, const std::string& path, double lo, double hi,
                   bool lo_open = false, bool hi_open = false) {
    const double v = number(n, path);
    const bool low = lo_open ? !(v > lo) : !(v >= lo);
    const bool high = hi_open ? !(v < hi) : !(v <= hi);
    if (low || high) {
      auto fmt = [](double x) {
        std::ostringstream os;
        os << x;
        return os.str();
      };
      error(path, "'" + n.Scalar() + "' is out of range: must be in " + (lo_open ? "(" : "[") +
                      fmt(lo) + ", " + fmt(hi) + (hi_open ? ")" : "]"));
    }
    return v;
  }

  bool boolean(const YAML::Node& n, const std::string& path) {
    const std::string& s = scalar(n, path, "true or false");
    if (s == "true" || s == "True" || s == "TRUE" || s == "yes" || s == "on") return true;
    if (s == "false" || s == "False" || s == "FALSE" || s == "no" || s == "off") return false;
    error(path, "'" + s + "' is not a boolean: use true or false");
  }

  template <typename T>
  T choice(const YAML::Node& n, const std::string& path,
           const std::vector<std::pair<std::string, T>>& options) {
    const std::string& s = scalar(n, path, "a name");
    std::vector<std::string> names;
    for (const auto& [name, v] : options) {
      if (name == s) return v;
      names.push_back(name);
    }
    std::string msg = "'" + s + "' is not one of: " + list_names(names);
    std::string sug = closest(s, names);
    if (!sug.empty()) msg += "; did you mean '" + sug + "'?";
    error(path, msg);
  }

  std::vector<std::string> strings(const YAML::Node& n, const std::string& path) {
    std::vector<std::string> out;
    if (n.IsScalar()) {
      out.push_back(n.Scalar());
    } else if (n.IsSequence()) {
      for (std::size_t i = 0; i < n.size(); ++i) {
        std::string p = path + "[" + std::to_string(i) + "]";
        if (!n[i].IsScalar()) error(path, p + ": expected a path, got " + kind_name(n[i]));
        out.push_back(n[i].Scalar());
      }
    } else if (!n.IsNull()) {
      error(path, std::string("expected a list of paths, got ") + kind_name(n));
    }
    for (const auto& s : out)
      if (s.empty()) error(path, "an empty path");
    return out;
  }

  // Calls fn(node, path) when `key` is present in `parent` and has a value.
  template <typename F>
  void with(const YAML::Node& parent, const std::string& parent_path, const char* key, F&& fn) {
    if (!parent.IsDefined() || !parent.IsMap()) return;
    const YAML::Node n = parent[key];
    if (!n.IsDefined()) return;
    const std::string path = join_path(parent_path, key);
    if (n.IsNull()) error(path, "no value given");
    fn(n, path);
  }

  Config read(const YAML::Node& root);

 private:
  void read_offload(const YAML::Node& n, const std::string& path, OffloadTarget& t);
  void read_model(const YAML::Node& root, Config& c);
  void read_precision(const YAML::Node& root, Config& c);
  void read_optimizer(const YAML::Node& root, Config& c);
  void read_world(const YAML::Node& root, Config& c);
  void read_offload_section(const YAML::Node& root, Config& c);
  void read_host_tiers(const YAML::Node& root, Config& c);
  void read_nvme_tier(const YAML::Node& root, Config& c);
  void read_runtime(const YAML::Node& root, Config& c);
  void validate(const Config& c);
  void validate_grad_accum(const PrecisionConfig& p);

  std::string file_;
  std::map<std::string, std::string> overrides_;
  std::map<std::string, YAML::Mark> marks_;
};

// The options of a choice: E's name table (strata/types.hpp, the one copy), each row followed by
// the aliases of its value.
template <class E>
std::vector<std::pair<std::string, E>> options_of(
    const std::vector<std::pair<std::string, E>>& aliases = {}) {
  std::vector<std::pair<std::string, E>> out;
  for (const auto& row : enum_names<E>()) {
    out.emplace_back(row.name, row.value);
    for (const auto& alias : aliases)
      if (alias.second == row.value) out.push_back(alias);
  }
  return out;
}

const std::vector<std::pair<std::string, DType>> kDTypes = options_of<DType>();
const std::vector<std::pair<std::string, Tier>> kTiers = options_of<Tier>({{"host", Tier::kCpu}});
constexpr std::uint64_t kU32 = std::numeric_limits<std::uint32_t>::max();
using limits::kMaxParameters;
constexpr std::uint64_t kMaxLayers = limits::kMaxLayers;
constexpr std::uint64_t kMaxHidden = limits::kMaxHiddenSize;
constexpr std::uint64_t kMaxHeads = limits::kMaxHeads;
constexpr std::uint64_t kMaxSequence = limits::kMaxSequenceLength;
constexpr std::uint64_t kMaxMicroBatch = limits::kMaxMicroBatch;
using limits::kMaxLossScale;
constexpr std::uint64_t kMaxRanks = limits::kMaxRanks;
using limits::kMaxBlockSize;
using limits::kMaxBufferSize;
using limits::kMaxCollectiveTimeoutS;
using limits::kMinCollectiveTimeoutS;
constexpr std::uint64_t kMaxCpuThreads = limits::kMaxCpuThreads;
constexpr std::uint64_t kMaxAccumulate = limits::kMaxAccumulate;

void Reader::read_offload(const YAML::Node& n, const std::string& path, OffloadTarget& t) {
  if (!n.IsDefined() || n.IsNull()) return;
  if (n.IsScalar()) {
    t.tier = choice(n, path + ".tier", kTiers);
    return;
  }
  with(n, path, "tier", [&](auto& v, auto& p) { t.tier = choice(v, p, kTiers); });
  with(n, path, "fraction", [&](auto& v, auto& p) {
    t.fraction = number(v, p);
    if (t.fraction < 0.0 || t.fraction > 1.0)
      error(p, "'" + v.Scalar() + "' is out of range: a fraction must be in [0, 1]");
  });
  with(n, path, "pin_memory", [&](auto& v, auto& p) { t.pin_memory = boolean(v, p); });
}

// The model section.
void Reader::read_model(const YAML::Node& root, Config& c) {
  const YAML::Node model = child(root, "model");
  with(model, "model", "parameters",
       [&](auto& v, auto& p) { c.model.parameters = count(v, p, 0, kMaxParameters); });
  with(model, "model", "largest_layer",
       [&](auto& v, auto& p) { c.model.largest_layer = count(v, p, 0, kMaxParameters); });
  with(model, "model", "layers",
       [&](auto& v, auto& p) { c.model.layers = integer(v, p, 0, kMaxLayers); });
  with(model, "model", "hidden_size",
       [&](auto& v, auto& p) { c.model.hidden_size = integer(v, p, 0, kMaxHidden); });
  with(model, "model", "heads",
       [&](auto& v, auto& p) { c.model.heads = integer(v, p, 0, kMaxHeads); });
  with(model, "model", "sequence_length",
       [&](auto& v, auto& p) { c.model.sequence_length = integer(v, p, 0, kMaxSequence); });
  with(model, "model", "micro_batch",
       [&](auto& v, auto& p) { c.model.micro_batch = integer(v, p, 1, kMaxMicroBatch); });
}

// The precision section and its loss_scale.
void Reader::read_precision(const YAML::Node& root, Config& c) {
  const YAML::Node prec = child(root, "precision");
  with(prec, "precision", "params",
       [&](auto& v, auto& p) { c.precision.params = choice(v, p, kDTypes); });
  with(prec, "precision", "grads",
       [&](auto& v, auto& p) { c.precision.grads = choice(v, p, kDTypes); });
  with(prec, "precision", "grad_accum", [&](auto& v, auto& p) {
    if (v.IsScalar() && v.Scalar() == "auto")
      c.precision.grad_accum.reset();
    else
      c.precision.grad_accum = choice(v, p, kDTypes);
  });
  const YAML::Node ls = child(prec, "loss_scale");
  const std::string lsp = "precision.loss_scale";
  auto& L = c.precision.loss_scale;
  with(ls, lsp, "enabled", [&](auto& v, auto& p) {
    if (v.IsScalar() && v.Scalar() == "auto")
      L.enabled = LossScaling::kAuto;
    else
      L.enabled = boolean(v, p) ? LossScaling::kOn : LossScaling::kOff;
  });
  with(ls, lsp, "dynamic", [&](auto& v, auto& p) { L.dynamic = boolean(v, p); });
  with(ls, lsp, "initial",
       [&](auto& v, auto& p) { L.initial = number_in(v, p, 0, kMaxLossScale, true); });
  with(ls, lsp, "growth_factor",
       [&](auto& v, auto& p) { L.growth_factor = number_in(v, p, 1, 1024, true); });
  with(ls, lsp, "backoff_factor",
       [&](auto& v, auto& p) { L.backoff_factor = number_in(v, p, 0, 1, true, true); });
  with(ls, lsp, "growth_interval",
       [&](auto& v, auto& p) { L.growth_interval = integer(v, p, 1, kU32); });
  with(ls, lsp, "min_scale",
       [&](auto& v, auto& p) { L.min_scale = number_in(v, p, 0, kMaxLossScale, true); });
}

// The optimizer section.
void Reader::read_optimizer(const YAML::Node& root, Config& c) {
  const YAML::Node opt = child(root, "optimizer");
  auto& O = c.optimizer;
  with(opt, "optimizer", "type",
       [&](auto& v, auto& p) { O.type = choice(v, p, options_of<OptimizerType>()); });
  with(opt, "optimizer", "lr", [&](auto& v, auto& p) { O.lr = number_in(v, p, 0, 1e3); });
  with(opt, "optimizer", "betas", [&](auto& v, auto& p) {
    if (!v.IsSequence() || v.size() != 2)
      error(p, std::string("expected a list of two numbers [beta1, beta2], got ") + kind_name(v));
    O.beta1 = number(v[0], p);
    O.beta2 = number(v[1], p);
    if (O.beta1 < 0 || O.beta1 >= 1 || O.beta2 < 0 || O.beta2 >= 1)
      error(p, "each beta must be in [0, 1)");
  });
  with(opt, "optimizer", "eps", [&](auto& v, auto& p) { O.eps = number_in(v, p, 0, 1, true); });
  with(opt, "optimizer", "weight_decay",
       [&](auto& v, auto& p) { O.weight_decay = number_in(v, p, 0, 1e3); });
  with(opt, "optimizer", "grad_clip",
       [&](auto& v, auto& p) { O.grad_clip = number_in(v, p, 0, 1e30); });
  with(opt, "optimizer", "update",
       [&](auto& v, auto& p) { O.update = choice(v, p, options_of<OptimizerUpdate>()); });
  with(opt, "optimizer", "overlap",
       [&](auto& v, auto& p) { O.overlap = choice(v, p, options_of<OptimizerOverlap>()); });
  with(opt, "optimizer", "speculation_budget",
       [&](auto& v, auto& p) { O.speculation_budget = bytes(v, p, 0); });
}

// The world and zero sections.
void Reader::read_world(const YAML::Node& root, Config& c) {
  const YAML::Node world = child(root, "world");
  with(world, "world", "ranks", [&](auto& v, auto& p) {
    const std::string& s = scalar(v, p, "a count");
    if (!s.empty() && s[0] == '-')
      error(p, "'" + s + "' is out of range: world.ranks must be >= 1");
    c.world.ranks = integer(v, p, 1, kMaxRanks);
  });
  with(world, "world", "ranks_per_node", [&](auto& v, auto& p) {
    c.world.ranks_per_node = integer(v, p, 0, limits::kMaxRanksPerNode);
  });
  with(world, "world", "network_bandwidth",
       [&](auto& v, auto& p) { c.world.network_bandwidth = bytes(v, p, 0); });

  const YAML::Node zero = child(root, "zero");
  with(zero, "zero", "stage",
       [&](auto& v, auto& p) { c.zero.stage = static_cast<int>(integer(v, p, 0, 3)); });
  with(zero, "zero", "sub_group_size",
       [&](auto& v, auto& p) { c.zero.sub_group_size = count(v, p, 1, kMaxParameters); });
  with(zero, "zero", "reduce_bucket_size",
       [&](auto& v, auto& p) { c.zero.reduce_bucket_size = count(v, p, 1, kMaxParameters); });
}

// The offload section.
void Reader::read_offload_section(const YAML::Node& root, Config& c) {
  const YAML::Node off = child(root, "offload");
  if (off.IsMap()) {
    read_offload(child(off, "optimizer"), "offload.optimizer", c.offload.optimizer);
    read_offload(child(off, "gradients"), "offload.gradients", c.offload.gradients);
    read_offload(child(off, "params"), "offload.params", c.offload.params);
  }
}

// tiers.gpu and tiers.host.
void Reader::read_host_tiers(const YAML::Node& root, Config& c) {
  const YAML::Node tiers = child(root, "tiers");
  const YAML::Node gpu = child(tiers, "gpu");
  const YAML::Node host = child(tiers, "host");
  auto& T = c.tiers;
  with(gpu, "tiers.gpu", "budget", [&](auto& v, auto& p) { T.gpu.budget = bytes(v, p, 1); });
  with(gpu, "tiers.gpu", "update_window",
       [&](auto& v, auto& p) { T.gpu.update_window = bytes(v, p, 0); });
  with(host, "tiers.host", "budget", [&](auto& v, auto& p) {
    T.host.budget = bytes(v, p, 1);
    T.host.budget_set = true;
  });
  with(host, "tiers.host", "pinned_budget",
       [&](auto& v, auto& p) { T.host.pinned_budget = bytes(v, p, 0); });
  with(host, "tiers.host", "buffer_count",
       [&](auto& v, auto& p) { T.host.buffer_count = integer(v, p, 1, limits::kMaxBufferCount); });
  with(host, "tiers.host", "buffer_size", [&](auto& v, auto& p) {
    T.host.buffer_size = bytes(v, p, 4096, kMaxBufferSize);
    if (T.host.buffer_size % 4096 != 0)
      error(p, "'" + v.Scalar() + "' (" + std::to_string(T.host.buffer_size) +
                   " bytes) is not a multiple of 4096");
  });
}

// tiers.nvme.
void Reader::read_nvme_tier(const YAML::Node& root, Config& c) {
  const YAML::Node nvme = child(child(root, "tiers"), "nvme");
  auto& T = c.tiers;
  with(nvme, "tiers.nvme", "paths", [&](auto& v, auto& p) { T.nvme.paths = strings(v, p); });
  with(nvme, "tiers.nvme", "engine",
       [&](auto& v, auto& p) { T.nvme.engine = choice(v, p, options_of<IoEngineKind>()); });
  with(nvme, "tiers.nvme", "block_size", [&](auto& v, auto& p) {
    T.nvme.block_size = bytes(v, p, 4096, kMaxBlockSize);
    if (T.nvme.block_size % 4096 != 0)
      error(p, "'" + v.Scalar() + "' (" + std::to_string(T.nvme.block_size) +
                   " bytes) is not a multiple of 4096");
  });
  with(nvme, "tiers.nvme", "queue_depth",
       [&](auto& v, auto& p) { T.nvme.queue_depth = integer(v, p, 1, limits::kMaxQueueDepth); });
  with(nvme, "tiers.nvme", "io_threads",
       [&](auto& v, auto& p) { T.nvme.io_threads = integer(v, p, 1, limits::kMaxIoThreads); });
  with(nvme, "tiers.nvme", "direct_io",
       [&](auto& v, auto& p) { T.nvme.direct_io = choice(v, p, options_of<DirectIoMode>()); });
  with(nvme, "tiers.nvme", "checksum", [&](auto& v, auto& p) { T.nvme.checksum = boolean(v, p); });
  with(nvme, "tiers.nvme", "sqpoll", [&](auto& v, auto& p) { T.nvme.sqpoll = boolean(v, p); });
  with(nvme, "tiers.nvme", "budget", [&](auto& v, auto& p) { T.nvme.budget = bytes(v, p, 0); });
  with(nvme, "tiers.nvme", "snapshot_room", [&](auto& v, auto& p) {
    T.nvme.snapshot_room = number(v, p);
    if (!(T.nvme.snapshot_room >= 0.0 && T.nvme.snapshot_room <= 1.0))
      error(p, "'" + v.Scalar() + "' is out of range: a fraction must be in [0, 1]");
  });
}

// The runtime section.
void Reader::read_runtime(const YAML::Node& root, Config& c) {
  const YAML::Node rt = child(root, "runtime");
  with(rt, "runtime", "device",
       [&](auto& v, auto& p) { c.runtime.device = choice(v, p, options_of<DeviceKind>()); });
  with(rt, "runtime", "communicator",
       [&](auto& v, auto& p) { c.runtime.communicator = choice(v, p, options_of<CommBackend>()); });
  with(rt, "runtime", "collective_timeout_s", [&](auto& v, auto& p) {
    c.runtime.collective_timeout_s =
        number_in(v, p, kMinCollectiveTimeoutS, kMaxCollectiveTimeoutS);
  });
  with(rt, "runtime", "cpu_threads",
       [&](auto& v, auto& p) { c.runtime.cpu_threads = integer(v, p, 0, kMaxCpuThreads); });
  const YAML::Node train = child(root, "train");
  with(train, "train", "accumulate",
       [&](auto& v, auto& p) { c.train.accumulate = integer(v, p, 1, kMaxAccumulate); });
}

Config Reader::read(const YAML::Node& root) {
  Config c;
  marks_[""] = root.Mark();
  check_keys(root, schema_root(), "");
  read_model(root, c);
  read_precision(root, c);
  read_optimizer(root, c);
  read_world(root, c);
  read_offload_section(root, c);
  read_host_tiers(root, c);
  read_nvme_tier(root, c);
  read_runtime(root, c);
  validate(c);
  return c;
}

// precision.grad_accum: the gradients' own dtype or fp32 (a 16-bit sum of FP32 gradients would
// round every micro-batch; one 16-bit format accumulated in the other loses range or precision).
void Reader::validate_grad_accum(const PrecisionConfig& p) {
  if (!p.grad_accum || *p.grad_accum == p.grads || *p.grad_accum == DType::kFp32) return;
  const std::string a = dtype_name(*p.grad_accum), g = dtype_name(p.grads);
  error("precision.grad_accum", "gradients of precision.grads " + g + " cannot be accumulated in " +
                                    a + ": use precision.grad_accum " + g +
                                    " (the gradients' own dtype, the default) or fp32");
}

void Reader::validate(const Config& c) {
  if (c.model.parameters != 0 && c.model.largest_layer > c.model.parameters)
    error("model.largest_layer", "is larger than model.parameters");
  if (c.model.hidden_size && c.model.heads > c.model.hidden_size)
    error("model.heads", "model.heads (" + std::to_string(c.model.heads) +
                             ") must be <= model.hidden_size (" +
                             std::to_string(c.model.hidden_size) + ")");
  if (c.model.hidden_size && c.model.heads && c.model.hidden_size % c.model.heads != 0)
    error("model.heads", "model.hidden_size (" + std::to_string(c.model.hidden_size) +
                             ") must be a multiple of model.heads (" +
                             std::to_string(c.model.heads) + ")");
  validate_grad_accum(c.precision);
  if (c.precision.loss_scale.min_scale > c.precision.loss_scale.initial)
    error("precision.loss_scale.min_scale", "must be <= precision.loss_scale.initial");
  if (c.world.ranks_per_node > c.world.ranks)
    error("world.ranks_per_node", "(" + std::to_string(c.world.ranks_per_node) +
                                      ") must be <= world.ranks (" + std::to_string(c.world.ranks) +
                                      ")");
  if (c.tiers.host.pinned_budget > c.tiers.host.budget)
    error("tiers.host.pinned_budget", "(" + format_bytes(c.tiers.host.pinned_budget) +
                                          ") must be <= tiers.host.budget (" +
                                          format_bytes(c.tiers.host.budget) + ")");
  auto offloaded = [](const OffloadTarget& t) { return t.tier != Tier::kGpu && t.fraction > 0; };
  const int s = c.zero.stage;
  const std::string stage = "zero.stage is " + std::to_string(s);
  if (offloaded(c.offload.params) && s < 3)
    error("offload.params.tier", "parameters can live on " +
                                     std::string(tier_name(c.offload.params.tier)) +
                                     " only at zero.stage 3 (" + stage +
                                     "): below stage 3 every rank needs all parameters on its gpu");
  if (offloaded(c.offload.gradients) && s < 2)
    error("offload.gradients.tier",
          "gradients can be offloaded only at zero.stage >= 2 (" + stage +
              "): below stage 2 every rank keeps the full gradient for the all-reduce");
  if (offloaded(c.offload.optimizer) && s < 1)
    error("offload.optimizer.tier", "optimizer state can be offloaded only at zero.stage >= 1 (" +
                                        stage + "): use stage 1 or higher to partition it first");
  for (const auto* name : {"optimizer", "gradients", "params"}) {
    const OffloadTarget& t = std::string(name) == "optimizer"   ? c.offload.optimizer
                             : std::string(name) == "gradients" ? c.offload.gradients
                                                                : c.offload.params;
    if (t.tier == Tier::kNvme && t.fraction > 0 && c.tiers.nvme.paths.empty())
      error(std::string("offload.") + name + ".tier",
            "the nvme tier is used but tiers.nvme.paths is empty: give at least one directory, "
            "e.g. tiers.nvme.paths: [/mnt/nvme0/strata]");
  }
}

// Records the first event of one YAML document (yaml-cpp's event interface).
class FirstEvent : public YAML::EventHandler {
 public:
  bool any = false;
  bool lone_null = false;  // the document is one null and nothing else
  YAML::Mark mark;
  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark& m, YAML::anchor_t) override { note(m, true); }
  void OnAlias(const YAML::Mark& m, YAML::anchor_t) override { note(m, false); }
  void OnScalar(const YAML::Mark& m, const std::string&, YAML::anchor_t,
                const std::string&) override {
    note(m, false);
  }
  void OnSequenceStart(const YAML::Mark& m, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {
    note(m, false);
  }
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark& m, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {
    note(m, false);
  }
  void OnMapEnd() override {}

 private:
  void note(const YAML::Mark& m, bool is_null) {
    if (!any) {
      any = true;
      mark = m;
      lone_null = is_null;
    } else {
      lone_null = false;
    }
  }
};

[[noreturn]] void throw_at(const std::string& source, const YAML::Mark& m, const std::string& key,
                           const std::string& message) {
  throw ConfigError(source, m.line >= 0 ? m.line + 1 : 0, m.column >= 0 ? m.column + 1 : 0, key,
                    message);
}

// Parses YAML text that must hold at most one document, without yaml-cpp's LoadAll: LoadAll
// loops forever, allocating, on a flow indicator (',', ']' or '}') outside a flow collection,
// e.g. "," or "{a: 1},": yaml-cpp's document parser returns a null document without consuming the
// token, so the "next" document is the same one again. Here the stream is walked with a counting
// event handler for at most two documents (the second one, if any, is an error: a stray
// indicator or a second document), and only then is the first document built with YAML::Load.
// Returns a null node for an empty stream. Throws ConfigError at the offending position.
YAML::Node load_single_document(std::string_view yaml, const std::string& source,
                                const std::string& key) {
  if (yaml.size() > kMaxConfigBytes)
    throw ConfigError(source, 0, 0, key,
                      strcat("the YAML text is ", yaml.size(), " bytes; a config is at most ",
                             kMaxConfigBytes, " bytes (1 MiB)"));
  const std::string text(yaml);
  auto stray = [&](const FirstEvent& ev) -> char {
    if (!ev.lone_null || ev.mark.pos < 0 || static_cast<std::size_t>(ev.mark.pos) >= text.size())
      return 0;
    const char c = text[static_cast<std::size_t>(ev.mark.pos)];
    return (c == ',' || c == ']' || c == '}') ? c : 0;
  };
  try {
    std::istringstream in(text);
    YAML::Parser parser(in);
    FirstEvent first;
    if (!parser.HandleNextDocument(first)) return YAML::Node();  // empty stream
    if (char c = stray(first))
      throw_at(source, first.mark, key,
               strcat("YAML syntax error: unexpected '", c,
                      "' outside a flow collection ([...] or {...})"));
    FirstEvent second;
    if (parser.HandleNextDocument(second)) {
      if (char c = stray(second))
        throw_at(source, second.mark, key,
                 strcat("YAML syntax error: unexpected '", c,
                        "' after the end of the document (a trailing comma or bracket?)"));
      throw_at(source, second.mark, key, "more than one YAML document; a config is one mapping");
    }
    return YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    throw_at(source, e.mark, key, "YAML syntax error: " + e.msg);
  } catch (const YAML::Exception& e) {
    throw ConfigError(source, 0, 0, key, std::string("YAML error: ") + e.what());
  }
}

YAML::Node load_document(std::string_view yaml, const std::string& source) {
  YAML::Node root = load_single_document(yaml, source, "");
  if (!root.IsDefined() || root.IsNull())
    throw ConfigError(source, 0, 0, "",
                      "the config is empty: give at least one section, e.g. "
                      "`model: {parameters: 7.5B}`");
  if (!root.IsMap()) {
    auto m = root.Mark();
    throw ConfigError(source, m.line >= 0 ? m.line + 1 : 1, m.column >= 0 ? m.column + 1 : 1, "",
                      std::string("the config must be a mapping of sections (model, precision, "
                                  "optimizer, world, zero, offload, tiers, runtime), got ") +
                          kind_name(root));
  }
  return root;
}

}  // namespace

Config parse_config(std::string_view yaml, const std::string& source_name,
                    const std::vector<std::string>& overrides) {
  YAML::Node root = load_document(yaml, source_name);
  Reader reader(source_name);
  for (const auto& o : overrides) reader.apply_override(root, o);
  Config c = reader.read(root);
  c.source = source_name;
  return c;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  if (path.empty()) throw ConfigError("", 0, 0, "", "no config file given");
  auto cannot = [&](const std::string& why) {
    return ConfigError(path, 0, 0, "", "cannot read the config: " + why);
  };
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    throw cannot(err == ENOENT ? std::string("no such file") : std::strerror(err));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw cannot(std::strerror(errno));
  if (S_ISDIR(st.st_mode)) throw cannot("it is a directory");
  if (!S_ISREG(st.st_mode)) {
    const char* kind = S_ISFIFO(st.st_mode)   ? "a FIFO"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "not a regular file";
    throw cannot(strcat("it is ", kind, "; a config must be a regular file"));
  }
  if (static_cast<std::uint64_t>(st.st_size) > kMaxConfigBytes)
    throw cannot(strcat("it is ", st.st_size, " bytes; a config is at most ", kMaxConfigBytes,
                        " bytes (1 MiB)"));
  // Read at most one byte past the cap, whatever the size said (the file may grow meanwhile).
  std::string text;
  text.resize(kMaxConfigBytes + 1);
  std::size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw cannot(std::strerror(errno));
    }
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  if (got > kMaxConfigBytes)
    throw cannot(strcat("it is more than ", kMaxConfigBytes, " bytes; a config is at most 1 MiB"));
  text.resize(got);
  return parse_config(text, path, overrides);
}

}  // namespace strata
