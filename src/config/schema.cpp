#include "config/schema.hpp"

namespace strata::config_detail {

const SchemaNode* SchemaNode::child(const std::string& key) const {
  for (const auto& c : children)
    if (c.name == key) return &c;
  return nullptr;
}

std::vector<std::string> SchemaNode::child_names() const {
  std::vector<std::string> out;
  for (const auto& c : children) out.push_back(c.name);
  return out;
}

namespace {
SchemaNode leaf(const char* n) { return SchemaNode{n, {}}; }
SchemaNode offload_target(const char* n) {
  return SchemaNode{n, {leaf("tier"), leaf("fraction"), leaf("pin_memory")}};
}
SchemaNode build() {
  return SchemaNode{
      "",
      {
          SchemaNode{
              "model",
              {leaf("parameters"), leaf("largest_layer"), leaf("layers"), leaf("hidden_size"),
               leaf("heads"), leaf("sequence_length"), leaf("micro_batch")}},
          SchemaNode{
              "precision",
              {leaf("params"), leaf("grads"), leaf("grad_accum"),
               SchemaNode{"loss_scale",
                          {leaf("enabled"), leaf("dynamic"), leaf("initial"), leaf("growth_factor"),
                           leaf("backoff_factor"), leaf("growth_interval"), leaf("min_scale")}}}},
          SchemaNode{
              "optimizer",
              {leaf("type"), leaf("lr"), leaf("betas"), leaf("eps"), leaf("weight_decay"),
               leaf("grad_clip"), leaf("update"), leaf("overlap"), leaf("speculation_budget")}},
          SchemaNode{"world", {leaf("ranks"), leaf("ranks_per_node"), leaf("network_bandwidth")}},
          SchemaNode{"zero", {leaf("stage"), leaf("sub_group_size"), leaf("reduce_bucket_size")}},
          SchemaNode{
              "offload",
              {offload_target("optimizer"), offload_target("gradients"), offload_target("params")}},
          SchemaNode{
              "tiers",
              {SchemaNode{"gpu", {leaf("budget"), leaf("update_window")}},
               SchemaNode{"host",
                          {leaf("budget"), leaf("pinned_budget"), leaf("buffer_count"),
                           leaf("buffer_size")}},
               SchemaNode{"nvme",
                          {leaf("paths"), leaf("engine"), leaf("block_size"), leaf("queue_depth"),
                           leaf("io_threads"), leaf("direct_io"), leaf("checksum"), leaf("sqpoll"),
                           leaf("budget"), leaf("snapshot_room")}}}},
          SchemaNode{"runtime",
                     {leaf("device"), leaf("communicator"), leaf("collective_timeout_s"),
                      leaf("cpu_threads")}},
          SchemaNode{"train", {leaf("accumulate")}},
      }};
}
}  // namespace

const SchemaNode& schema_root() {
  static const SchemaNode root = build();
  return root;
}

}  // namespace strata::config_detail
