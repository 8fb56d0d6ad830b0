// The tree of valid config keys: used to reject unknown keys (with a suggestion) in the YAML and
// in --set key paths. Leaves are values; nodes with children are mappings.
#pragma once

#include <string>
#include <vector>

namespace strata::config_detail {

struct SchemaNode {
  std::string name;
  std::vector<SchemaNode> children;  // empty = a value

  bool is_mapping() const { return !children.empty(); }
  const SchemaNode* child(const std::string& key) const;
  std::vector<std::string> child_names() const;
};

const SchemaNode& schema_root();

}  // namespace strata::config_detail
