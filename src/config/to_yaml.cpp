// Config -> YAML text that parse_config() reads back to an equal Config (every key written).
#include <charconv>
#include <cstdio>
#include <sstream>

#include "strata/config.hpp"
#include "strata/units.hpp"

namespace strata {
namespace {

std::string num(double v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest round-trip form
  std::string s(buf, r.ptr);
  return s;
}

std::string boolean(bool b) { return b ? "true" : "false"; }

// A double-quoted YAML scalar that load_config() reads back byte for byte: '"' and '\\' and
// control characters are escaped; bytes >= 0x80 are written as they are, so UTF-8 stays readable
// and a path that is not valid UTF-8 (Linux allows any byte but '/' and NUL) is not turned into
// U+FFFD, which yaml-cpp's emitter would do. (yaml-cpp passes such bytes through unchanged;
// "\xNN" would mean the code point U+00NN, two bytes in UTF-8.)
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\x%02x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
  return out;
}

std::string bytes_text(std::uint64_t bytes) { return format_bytes_exact(bytes); }

void target(std::ostringstream& o, const char* name, const OffloadTarget& t) {
  o << "  " << name << ": {tier: " << tier_name(t.tier) << ", fraction: " << num(t.fraction)
    << ", pin_memory: " << boolean(t.pin_memory) << "}\n";
}

void tiers(std::ostringstream& o, const TiersConfig& t) {
  o << "tiers:\n"
    << "  gpu:\n"
    << "    budget: " << bytes_text(t.gpu.budget) << "\n"
    << "    update_window: " << bytes_text(t.gpu.update_window) << "\n"
    << "  host:\n";
  // Not set: left out, so that strata plan on this YAML checks the machine's memory as it would on
  // the config it came from (the engine's figure is the same default either way).
  if (t.host.budget_set) {
    o << "    budget: " << bytes_text(t.host.budget) << "\n";
  } else {
    o << "    # budget: not set (strata plan: this machine's memory; the engine: "
      << bytes_text(t.host.budget) << ")\n";
  }
  o << "    pinned_budget: " << bytes_text(t.host.pinned_budget) << "\n"
    << "    buffer_count: " << t.host.buffer_count << "\n"
    << "    buffer_size: " << bytes_text(t.host.buffer_size) << "\n"
    << "  nvme:\n"
    << "    paths: [";
  for (std::size_t i = 0; i < t.nvme.paths.size(); ++i)
    o << (i ? ", " : "") << quoted(t.nvme.paths[i]);
  o << "]\n"
    << "    engine: " << io_engine_name(t.nvme.engine) << "\n"
    << "    block_size: " << bytes_text(t.nvme.block_size) << "\n"
    << "    queue_depth: " << t.nvme.queue_depth << "\n"
    << "    io_threads: " << t.nvme.io_threads << "\n"
    << "    direct_io: " << direct_io_name(t.nvme.direct_io) << "\n"
    << "    checksum: " << boolean(t.nvme.checksum) << "\n"
    << "    sqpoll: " << boolean(t.nvme.sqpoll) << "\n"
    << "    budget: " << bytes_text(t.nvme.budget) << "\n"
    << "    snapshot_room: " << num(t.nvme.snapshot_room) << "\n";
}

}  // namespace

std::string to_yaml(const Config& c) {
  std::ostringstream o;
  o << "model:\n"
    << "  parameters: " << c.model.parameters << "\n"
    << "  largest_layer: " << c.model.largest_layer << "\n"
    << "  layers: " << c.model.layers << "\n"
    << "  hidden_size: " << c.model.hidden_size << "\n"
    << "  heads: " << c.model.heads << "\n"
    << "  sequence_length: " << c.model.sequence_length << "\n"
    << "  micro_batch: " << c.model.micro_batch << "\n";
  const auto& ls = c.precision.loss_scale;
  o << "precision:\n"
    << "  params: " << dtype_name(c.precision.params) << "\n"
    << "  grads: " << dtype_name(c.precision.grads) << "\n"
    << "  grad_accum: "
    << (c.precision.grad_accum ? dtype_name(*c.precision.grad_accum) : std::string("auto")) << "\n"
    << "  loss_scale:\n"
    << "    enabled: "
    << (ls.enabled == LossScaling::kAuto ? "auto" : boolean(ls.enabled == LossScaling::kOn)) << "\n"
    << "    dynamic: " << boolean(ls.dynamic) << "\n"
    << "    initial: " << num(ls.initial) << "\n"
    << "    growth_factor: " << num(ls.growth_factor) << "\n"
    << "    backoff_factor: " << num(ls.backoff_factor) << "\n"
    << "    growth_interval: " << ls.growth_interval << "\n"
    << "    min_scale: " << num(ls.min_scale) << "\n";
  o << "optimizer:\n"
    << "  type: " << optimizer_name(c.optimizer.type) << "\n"
    << "  lr: " << num(c.optimizer.lr) << "\n"
    << "  betas: [" << num(c.optimizer.beta1) << ", " << num(c.optimizer.beta2) << "]\n"
    << "  eps: " << num(c.optimizer.eps) << "\n"
    << "  weight_decay: " << num(c.optimizer.weight_decay) << "\n"
    << "  grad_clip: " << num(c.optimizer.grad_clip) << "\n"
    << "  update: " << optimizer_update_name(c.optimizer.update) << "\n"
    << "  overlap: " << optimizer_overlap_name(c.optimizer.overlap) << "\n"
    << "  speculation_budget: " << bytes_text(c.optimizer.speculation_budget) << "\n";
  o << "world:\n"
    << "  ranks: " << c.world.ranks << "\n"
    << "  ranks_per_node: " << c.world.ranks_per_node << "\n"
    << "  network_bandwidth: " << bytes_text(c.world.network_bandwidth) << "\n";
  o << "zero:\n"
    << "  stage: " << c.zero.stage << "\n"
    << "  sub_group_size: " << c.zero.sub_group_size << "\n"
    << "  reduce_bucket_size: " << c.zero.reduce_bucket_size << "\n";
  o << "offload:\n";
  target(o, "optimizer", c.offload.optimizer);
  target(o, "gradients", c.offload.gradients);
  target(o, "params", c.offload.params);
  tiers(o, c.tiers);
  o << "runtime:\n"
    << "  device: " << device_name(c.runtime.device) << "\n"
    << "  communicator: " << comm_backend_name(c.runtime.communicator) << "\n"
    << "  collective_timeout_s: " << num(c.runtime.collective_timeout_s) << "\n"
    << "  cpu_threads: " << c.runtime.cpu_threads << "\n";
  o << "train:\n"
    << "  accumulate: " << c.train.accumulate << "\n";
  return o.str();
}

}  // namespace strata
