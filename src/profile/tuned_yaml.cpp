// tuned_config_text(): `strata profile --write-config` edits the user's YAML in place (values that
// changed only), so comments, key order and units survive; a full rendering is the fallback.
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <string>
#include <vector>

#include "strata/error.hpp"
#include "strata/profile.hpp"
#include "strata/units.hpp"

namespace strata {
namespace {

struct Edit {
  std::vector<std::string> path;
  std::string value;  // YAML text of the new value
};

std::string num_text(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

class Unsupported : public std::exception {};

// The end of a scalar's text that starts at `pos`: quoted scalars to their closing quote; plain
// scalars to the end of the line, a comment, or (in flow context) a ',', '}' or ']'.
std::size_t scalar_end(const std::string& t, std::size_t pos, bool flow) {
  if (pos >= t.size()) throw Unsupported();
  if (t[pos] == '"' || t[pos] == '\'') {
    const char q = t[pos];
    for (std::size_t i = pos + 1; i < t.size(); ++i) {
      if (q == '"' && t[i] == '\\') {
        ++i;
        continue;
      }
      if (t[i] == q) {
        if (q == '\'' && i + 1 < t.size() && t[i + 1] == '\'') {
          ++i;
          continue;
        }
        return i + 1;
      }
    }
    throw Unsupported();
  }
  std::size_t i = pos;
  for (; i < t.size(); ++i) {
    const char ch = t[i];
    if (ch == '\n' || ch == '\r') break;
    if (ch == '#' && i > pos && (t[i - 1] == ' ' || t[i - 1] == '\t')) break;
    if (flow && (ch == ',' || ch == '}' || ch == ']')) break;
  }
  while (i > pos && (t[i - 1] == ' ' || t[i - 1] == '\t')) --i;
  if (i == pos) throw Unsupported();
  return i;
}

std::string nest(const std::vector<std::string>& keys, std::size_t from, const std::string& value) {
  if (from == keys.size()) return value;
  return "{" + keys[from] + ": " + nest(keys, from + 1, value) + "}";
}

// Applies one edit to `text` (re-parsed each time, so positions are always current).
void apply(std::string& text, const Edit& e) {
  YAML::Node root = YAML::Load(text);
  if (!root.IsMap()) throw Unsupported();
  YAML::Node node = root;
  bool flow = false;
  for (std::size_t i = 0; i < e.path.size(); ++i) {
    const std::string& key = e.path[i];
    // (reset(), not operator=: assigning to a YAML::Node that refers into a tree rewrites the
    // tree; and a default Node is a defined null, so "found" is its own flag.)
    YAML::Node child;
    bool found = false;
    for (auto it = node.begin(); it != node.end(); ++it)
      if (it->first.IsScalar() && it->first.Scalar() == key) {
        child.reset(it->second);
        found = true;
      }
    const bool node_flow = node.Style() == YAML::EmitterStyle::Flow;
    if (!found) {
      // Add "key: value" as the map's first entry (flow: after '{'; block: the first key's line).
      const std::string entry = key + ": " + nest(e.path, i + 1, e.value);
      if (node_flow) {
        const std::size_t brace = static_cast<std::size_t>(node.Mark().pos);
        if (brace >= text.size() || text[brace] != '{') throw Unsupported();
        text.insert(brace + 1, node.size() ? entry + ", " : entry);
        return;
      }
      const YAML::Mark first = node.begin()->first.Mark();
      if (first.pos < 0) throw Unsupported();
      const std::size_t line_start = static_cast<std::size_t>(first.pos - first.column);
      text.insert(line_start,
                  std::string(static_cast<std::size_t>(first.column), ' ') + entry + "\n");
      return;
    }
    if (i + 1 == e.path.size() || !child.IsMap()) {
      // Replace the value's text: a scalar (also the shorthand `optimizer: cpu`, replaced by a
      // flow map of the rest of the path).
      if (!child.IsScalar()) throw Unsupported();
      const YAML::Mark m = child.Mark();
      if (m.pos < 0) throw Unsupported();
      const std::size_t pos = static_cast<std::size_t>(m.pos);
      const std::size_t end = scalar_end(text, pos, flow || node_flow);
      text.replace(pos, end - pos, nest(e.path, i + 1, e.value));
      return;
    }
    flow = flow || node_flow;
    node.reset(child);
  }
}

void add_target_edits(std::vector<Edit>& edits, const char* name, const OffloadTarget& was,
                      const OffloadTarget& now) {
  if (was.tier == now.tier && was.fraction == now.fraction && was.pin_memory == now.pin_memory)
    return;
  // The keys that differ (a shorthand scalar or a missing target becomes a flow map on the first).
  if (was.tier != now.tier) edits.push_back({{"offload", name, "tier"}, tier_name(now.tier)});
  if (was.fraction != now.fraction)
    edits.push_back({{"offload", name, "fraction"}, num_text(now.fraction)});
  if (was.pin_memory != now.pin_memory)
    edits.push_back({{"offload", name, "pin_memory"}, now.pin_memory ? "true" : "false"});
}

}  // namespace

std::string tuned_config_text(const std::string& original_text, const Config& original,
                              const Config& tuned, const std::vector<std::string>& overrides,
                              std::string* note) {
  std::vector<Edit> edits;
  for (const auto& ov : overrides) {  // key.path=value, as --set
    const auto eq = ov.find('=');
    if (eq == std::string::npos) continue;
    Edit e;
    std::string key = ov.substr(0, eq);
    for (std::size_t pos = 0;;) {
      const auto dot = key.find('.', pos);
      e.path.push_back(key.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos));
      if (dot == std::string::npos) break;
      pos = dot + 1;
    }
    e.value = ov.substr(eq + 1);
    edits.push_back(e);
  }
  const NvmeTierConfig &a = original.tiers.nvme, &b = tuned.tiers.nvme;
  if (a.engine != b.engine)
    edits.push_back({{"tiers", "nvme", "engine"}, io_engine_name(b.engine)});
  if (a.block_size != b.block_size)
    edits.push_back({{"tiers", "nvme", "block_size"}, format_bytes_exact(b.block_size)});
  if (a.queue_depth != b.queue_depth)
    edits.push_back({{"tiers", "nvme", "queue_depth"}, std::to_string(b.queue_depth)});
  if (a.io_threads != b.io_threads)
    edits.push_back({{"tiers", "nvme", "io_threads"}, std::to_string(b.io_threads)});
  if (original.zero.stage != tuned.zero.stage)
    edits.push_back({{"zero", "stage"}, std::to_string(tuned.zero.stage)});
  add_target_edits(edits, "optimizer", original.offload.optimizer, tuned.offload.optimizer);
  add_target_edits(edits, "gradients", original.offload.gradients, tuned.offload.gradients);
  add_target_edits(edits, "params", original.offload.params, tuned.offload.params);

  const std::string want = to_yaml(tuned);
  auto loads_as_tuned = [&](const std::string& text) {
    try {
      Config c = parse_config(text, original.source);
      return to_yaml(c) == want;
    } catch (const Error&) {
      return false;
    }
  };
  std::string text = original_text;
  if (!text.empty() && text.back() != '\n') text += '\n';
  bool edited = true;
  try {
    // A key path absent from the file (e.g. no `offload:` at all) appears with its first edit;
    // later edits of the same target then set keys inside it.
    for (const auto& e : edits) apply(text, e);
  } catch (const Unsupported&) {
    edited = false;
  } catch (const YAML::Exception&) {
    edited = false;
  }
  if (edited && loads_as_tuned(text)) return text;
  if (note)
    *note =
        "the original file could not be edited in place; wrote a full rendering of the tuned "
        "config (comments and units of the original are not kept)";
  text = want;
  if (!loads_as_tuned(text))
    fail(ErrorCode::kInternal, "profile: the tuned config does not load back as itself");
  return text;
}

}  // namespace strata
