// `strata plan CONFIG [--set k=v]... [--json] [--check]`: what lives in which tier, what crosses
// each link per step, whether it fits, and the ladder of every stage x offload rung with the
// recommendation (include/strata/plan.hpp). --check: exit 3 when the configured layout does not
// fit (a launch script's gate).
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/command.hpp"
#include "strata/config.hpp"
#include "strata/device_query.hpp"
#include "strata/error.hpp"
#include "strata/plan.hpp"
#include "strata/units.hpp"

namespace cmd_plan {
namespace {

using nlohmann::json;
using strata::format_bytes;

json state_json(const strata::StateBytes& s) {
  return {
      {"params", s.params}, {"grads", s.grads}, {"optimizer", s.optimizer}, {"total", s.total()}};
}

json tiers_json(const strata::TierBytes& t) {
  return {{"gpu", t.gpu},
          {"pinned_host", t.pinned_host},
          {"pageable_host", t.pageable_host},
          {"nvme", t.nvme},
          {"total", t.total()}};
}

json target_json(const strata::OffloadTarget& t) {
  return {
      {"tier", strata::tier_name(t.tier)}, {"fraction", t.fraction}, {"pin_memory", t.pin_memory}};
}

json pool_json(const strata::PoolPlan& p) {
  return {{"used", p.used},
          {"buffers", p.buffers},
          {"buffer_size_bytes", p.buffer_size},
          {"share_staging_bytes", p.share_staging},
          {"bytes", p.bytes()},
          {"why", p.why}};
}

json runtime_json(const strata::RuntimeBuffers& r) {
  return {{"buckets", r.buckets},
          {"bucket_count", r.bucket_count},
          {"receive", r.receive},
          {"receive_count", r.receive_count},
          {"gathered", r.gathered},
          {"send", r.send},
          {"layer_elements", r.layer},
          {"layer_estimated", r.layer_estimated},
          {"norm", r.norm},
          {"staging", r.staging},
          {"adam_scratch", r.adam_scratch},
          {"update_slots", r.update_slots},
          {"hand_in_staging", r.hand_in_staging},
          {"step", r.step()},
          {"total", r.total()}};
}

json layout_json(const strata::Layout& l) {
  json j;
  j["stage"] = l.stage;
  j["description"] = l.describe();
  j["offload"] = {{"optimizer", target_json(l.offload.optimizer)},
                  {"gradients", target_json(l.offload.gradients)},
                  {"params", target_json(l.offload.params)}};
  j["state_per_rank_bytes"] = state_json(l.footprint.bytes);
  j["by_kind_per_rank_bytes"] = {{"gpu", state_json(l.on_gpu)},
                                 {"host", state_json(l.on_host)},
                                 {"nvme", state_json(l.on_nvme)}};
  j["master_in_params"] = l.master_in_params;
  j["pinned_pool_per_rank"] = pool_json(l.pool);
  j["runtime_buffers_per_rank_bytes"] = runtime_json(l.runtime);
  j["speculation_per_rank_bytes"] = {{"gpu", l.speculation.gpu},
                                     {"pinned_host", l.speculation.pinned_host},
                                     {"pageable_host", l.speculation.pageable_host},
                                     {"nvme", l.speculation.nvme}};
  j["per_rank_bytes"] = tiers_json(l.per_rank);
  j["per_node_bytes"] = tiers_json(l.per_node);
  j["traffic_per_rank_per_step_bytes"] = {{"nvme_read", l.traffic.nvme_read},
                                          {"nvme_write", l.traffic.nvme_write},
                                          {"host_to_device", l.traffic.host_to_device},
                                          {"device_to_host", l.traffic.device_to_host},
                                          {"network", l.traffic.network}};
  j["verdicts"] = json::array();
  for (const auto& v : l.verdicts) {
    json vj = {{"tier", v.tier}, {"scope", v.scope}, {"used_bytes", v.used}, {"fits", v.fits()}};
    vj["budget_bytes"] = v.limited ? json(v.budget) : json(nullptr);
    vj["overflow_bytes"] = v.overflow();
    j["verdicts"].push_back(vj);
  }
  j["fits"] = l.fits();
  return j;
}

json rung_json(const strata::Rung& r) {
  return {{"stage", r.layout.stage},
          {"description", r.layout.describe()},
          {"offload",
           {{"optimizer", target_json(r.layout.offload.optimizer)},
            {"gradients", target_json(r.layout.offload.gradients)},
            {"params", target_json(r.layout.offload.params)}}},
          {"gpu_model_state_per_rank_bytes", r.layout.on_gpu.total()},
          {"runtime_buffers_per_rank_bytes", r.layout.runtime.total()},
          {"gathered_per_rank_bytes", r.layout.runtime.gathered + r.layout.runtime.send},
          {"activations_per_rank_bytes", r.activations},
          {"activation_checkpointing", r.checkpointing},
          {"gpu_per_rank_bytes", r.gpu_total},
          {"host_per_node_bytes", r.layout.per_node.host()},
          {"pinned_host_per_node_bytes", r.layout.per_node.pinned_host},
          {"nvme_per_node_bytes", r.layout.per_node.nvme},
          {"fits", r.fits},
          {"verdict", r.verdict}};
}

// What the plan counts runtime.device as. auto is planned as a GPU (the gpu tier device memory, a
// staging pool, the master weights of their own); where no GPU answers the engine runs on the host
// device instead, so the line says what this machine would resolve (strata plan is run on a node
// like the training ones, as for the host budget).
struct PlannedDevice {
  std::string configured, planned_as, here, text;
};
PlannedDevice planned_device(const strata::Config& c) {
  PlannedDevice d;
  d.configured = strata::device_name(c.runtime.device);
  d.planned_as = c.runtime.device == strata::DeviceKind::kHost ? "host" : "gpu";
  if (c.runtime.device == strata::DeviceKind::kHost) {
    d.text = "host-emulated (runtime.device host): the gpu tier is host memory";
  } else if (c.runtime.device == strata::DeviceKind::kCuda) {
    d.text = "a GPU (runtime.device cuda)";
  } else {
    const strata::GpuQuery q = strata::query_cuda_devices();
    d.here = q.status;
    d.text = "runtime.device auto, planned as a GPU; this machine: " + q.status;
    if (q.devices.empty())
      d.text +=
          " — the engine would run on the host device here (--set runtime.device=host "
          "plans that; the gpu tier is then host memory)";
  }
  return d;
}

json plan_json(const strata::Config& c, const strata::Plan& p) {
  json j;
  j["config"] = c.source;
  const PlannedDevice d = planned_device(c);
  j["device"] = {{"configured", d.configured},
                 {"planned_as", d.planned_as},
                 {"this_machine", d.here},
                 {"text", d.text}};
  j["host_budget"] = {{"bytes", p.host_budget.bytes},
                      {"source", strata::host_budget_source_name(p.host_budget.source)},
                      {"text", p.host_budget.text}};
  j["parameters"] = p.parameters;
  j["ranks"] = p.ranks;
  j["ranks_per_node"] = p.ranks_per_node;
  j["nodes"] = p.nodes;
  j["precision"] = {{"params", strata::dtype_name(c.precision.params)},
                    {"grads", strata::dtype_name(c.precision.grads)},
                    {"grad_accum", strata::dtype_name(c.precision.accum_dtype())}};
  const auto& b = p.bytes_per_param;
  j["bytes_per_param"] = {{"params", b.params},
                          {"grads", b.grads},
                          {"master", b.master},
                          {"moments", b.moments},
                          {"total", b.total()}};
  j["stages"] = json::array();
  for (const auto& s : p.stages)
    j["stages"].push_back({{"stage", s.stage},
                           {"param_elements", s.param_elements},
                           {"grad_elements", s.grad_elements},
                           {"optimizer_elements", s.optimizer_elements},
                           {"per_rank_bytes", state_json(s.bytes)}});
  j["configured"] = layout_json(p.configured);
  json a = {{"available", p.activations.available}};
  if (p.activations.available) {
    a["per_layer_bytes"] = p.activations.per_layer;
    a["without_checkpointing_bytes"] = p.activations.without_checkpointing;
    a["with_checkpointing_bytes"] = p.activations.with_checkpointing;
    a["fits_without_checkpointing"] = p.activations.fits_without_checkpointing;
    a["fits_with_checkpointing"] = p.activations.fits_with_checkpointing;
  }
  j["activations_per_rank"] = a;
  j["configured_fits"] = p.configured_fits();
  j["configured_verdict"] = rung_json(p.configured_rung);
  j["recommendation"] = {{"found", p.recommendation.found},
                         {"reason", p.recommendation.reason},
                         {"activation_checkpointing", p.recommendation.checkpointing}};
  if (p.recommendation.found) j["recommendation"]["layout"] = layout_json(p.recommendation.layout);
  j["ladder"] = json::array();
  for (const auto& r : p.recommendation.ladder) j["ladder"].push_back(rung_json(r));
  j["assumptions"] = p.assumptions;
  j["notes"] = p.notes;
  return j;
}

std::string cell(const std::string& s, std::size_t w) {
  return s.size() >= w ? s + " " : s + std::string(w - s.size(), ' ');
}
std::string rcell(const std::string& s, std::size_t w) {
  return s.size() >= w ? " " + s : std::string(w - s.size(), ' ') + s;
}

// The model, its bytes per parameter, the world.
void print_header(std::ostream& o, const strata::Config& c, const strata::Plan& p) {
  const auto& b = p.bytes_per_param;
  o << "strata plan: " << c.source << "\n"
    << "  model: " << strata::format_count(p.parameters) << " parameters, "
    << strata::dtype_name(c.precision.params) << " params, "
    << strata::dtype_name(c.precision.grads) << " grads"
    << (c.precision.accum_dtype() != c.precision.grads
            ? std::string(" (held in ") + strata::dtype_name(c.precision.accum_dtype()) + ")"
            : std::string())
    << ", " << strata::optimizer_name(c.optimizer.type) << "\n"
    << "  bytes per parameter: " << b.params << " params + " << b.grads << " grads + "
    << b.optimizer() << " optimizer (" << b.master << " master + " << b.moments
    << " moments) = " << b.total() << "\n"
    << "  world: " << p.ranks << " ranks, " << p.ranks_per_node << " per node, " << p.nodes
    << " node(s)\n"
    << "  device: " << planned_device(c).text << "\n"
    << "  host budget: " << p.host_budget.text << "\n\n";
}

// Model state per rank for every stage.
void print_stages(std::ostream& o, const strata::Config& c, const strata::Plan& p) {
  o << "Model state per rank by ZeRO stage (nothing offloaded):\n"
    << "  " << cell("stage", 8) << rcell("params", 12) << rcell("grads", 12)
    << rcell("optimizer", 12) << rcell("total", 12) << "\n";
  for (const auto& s : p.stages)
    o << "  " << cell(std::to_string(s.stage) + (s.stage == c.zero.stage ? " *" : ""), 8)
      << rcell(format_bytes(s.bytes.params), 12) << rcell(format_bytes(s.bytes.grads), 12)
      << rcell(format_bytes(s.bytes.optimizer), 12) << rcell(format_bytes(s.bytes.total()), 12)
      << "\n";
}

// The configured layout: bytes per tier, the pool, the runtime buffers.
void print_configured(std::ostream& o, const strata::Config& c, const strata::Plan& p) {
  const auto& l = p.configured;
  o << "\nConfigured: " << l.describe() << "\n"
    << "  " << cell("tier", 20) << rcell("per rank", 12) << rcell("per node", 12) << "\n";
  auto row = [&](const char* name, std::uint64_t r, std::uint64_t n) {
    o << "  " << cell(name, 20) << rcell(format_bytes(r), 12) << rcell(format_bytes(n), 12) << "\n";
  };
  row("gpu", l.per_rank.gpu, l.per_node.gpu);
  row("  model state", l.on_gpu.total(), l.on_gpu.total() * p.ranks_per_node);
  row("  runtime buffers", l.runtime.total(), l.runtime.total() * p.ranks_per_node);
  if (l.speculation.total() > 0)
    row("  pending versions", l.speculation.total(), l.speculation.total() * p.ranks_per_node);
  row("pinned host", l.per_rank.pinned_host, l.per_node.pinned_host);
  row("pageable host", l.per_rank.pageable_host, l.per_node.pageable_host);
  row("nvme", l.per_rank.nvme, l.per_node.nvme);
  if (l.master_in_params)
    o << "  master weights = the parameters (FP32 on the host device): the optimizer state in\n"
         "    memory holds the moments only, 8 B a parameter\n";
  o << "  pinned staging pool: "
    << (l.pool.used
            ? format_bytes(l.pool.bytes()) + " per rank (" + std::to_string(l.pool.buffers) +
                  " x " + format_bytes(l.pool.buffer_size, true) +
                  (l.pool.share_staging
                       ? " + " + format_bytes(l.pool.share_staging) + " gradient share staging"
                       : std::string()) +
                  "), in pinned host: " + l.pool.why
            : l.pool.why)
    << "\n";
  const auto& rt = l.runtime;
  o << "  gpu runtime buffers per rank: " << format_bytes(rt.total()) << "\n";
  auto part = [&](const std::string& name, std::uint64_t v, const std::string& how) {
    if (v) o << "    " << cell(name, 12) << rcell(format_bytes(v), 12) << "  " << how << "\n";
  };
  part("buckets", rt.buckets,
       std::to_string(rt.bucket_count) + " x zero.reduce_bucket_size (" +
           strata::format_count(c.zero.reduce_bucket_size) + ") gradients");
  part("receive", rt.receive, std::to_string(rt.receive_count) + " in flight");
  part("gathered", rt.gathered,
       "2 x a layer of " + strata::format_count(rt.layer) +
           (rt.layer_estimated ? " (estimated from hidden_size)" : "") + " parameters, prefetched");
  part("send", rt.send, "the rank's slices of those layers");
  part("norm", rt.norm, "norm and overflow exchange");
  part("staging", rt.staging, "collective staging of the initial values (finalize)");
  part("adam scratch", rt.adam_scratch,
       "optimizer.update device: one host chunk's copy; auto on a GPU: the split's window");
  part("update slots", rt.update_slots,
       "gpu state's gradients or parameters staged for the device update (tiers.host.buffer_count"
       " slots)");
  part("hand-in", rt.hand_in_staging,
       "stages 0-1: staging for a gradient from host memory added or converted on the device");
}

// Bytes per step on each link, the verdict per tier, the activations.
void print_traffic_and_verdict(std::ostream& o, const strata::Plan& p) {
  const auto& l = p.configured;
  o << "\nBytes per optimizer step, per rank:\n";
  auto link = [&](const char* name, std::uint64_t v) {
    o << "  " << cell(name, 16) << rcell(format_bytes(v), 12) << "\n";
  };
  link("nvme read", l.traffic.nvme_read);
  link("nvme write", l.traffic.nvme_write);
  link("host->device", l.traffic.host_to_device);
  link("device->host", l.traffic.device_to_host);
  link("network", l.traffic.network);

  o << "\nVerdict: "
    << (p.configured_fits() ? p.configured_rung.verdict
                            : "DOES NOT FIT (" + p.configured_rung.verdict + ")")
    << "\n";
  for (const auto& v : l.verdicts) {
    o << "  " << cell(v.tier, 12) << rcell(format_bytes(v.used), 12) << " per " << cell(v.scope, 5);
    if (!v.limited)
      o << "  (no budget)\n";
    else
      o << " of " << rcell(format_bytes(v.budget), 10)
        << (v.fits() ? "  ok" : "  OVER by " + format_bytes(v.overflow())) << "\n";
  }

  if (p.activations.available) {
    const auto& a = p.activations;
    o << "\nActivations per rank (Korthikanti et al., 16-bit):\n"
      << "  without checkpointing: " << format_bytes(a.without_checkpointing)
      << (a.fits_without_checkpointing ? " (fits with the gpu figure above)"
                                       : " (does not fit with the gpu figure above)")
      << "\n  with checkpointing:    " << format_bytes(a.with_checkpointing)
      << (a.fits_with_checkpointing ? " (fits with the gpu figure above)"
                                    : " (does not fit with the gpu figure above)")
      << "\n";
  }
}

// Every rung of the recommender's ladder.
void print_ladder(std::ostream& o, const strata::Plan& p) {
  o << "\nEvery stage x offload rung, in the recommender's order (lowest stage, then least "
       "offload; NVMe last):\n"
    << "  " << cell("rung", 62) << rcell("state", 10) << rcell("runtime", 10)
    << rcell("+activ.", 11) << rcell("gpu/rank", 11) << rcell("host/node", 11)
    << rcell("nvme/node", 11) << "  verdict\n";
  for (const auto& r : p.recommendation.ladder) {
    const bool chosen = p.recommendation.found && r.fits &&
                        r.layout.describe() == p.recommendation.layout.describe();
    std::string act = r.activations ? format_bytes(r.activations) + (r.checkpointing ? "*" : "")
                                    : std::string("-");
    o << (chosen ? "> " : "  ") << cell(r.layout.describe(), 62)
      << rcell(format_bytes(r.layout.on_gpu.total()), 10)
      << rcell(format_bytes(r.layout.runtime.total()), 10) << rcell(act, 11)
      << rcell(format_bytes(r.gpu_total), 11) << rcell(format_bytes(r.layout.per_node.host()), 11)
      << rcell(format_bytes(r.layout.per_node.nvme), 11) << "  " << r.verdict << "\n";
  }
  o << "  (state: gpu model state; runtime: the engine's gpu buffers; gpu/rank: both + "
       "activations"
    << (p.activations.available ? "; * with full activation checkpointing" : "") << ")\n";
}

// The recommendation, notes and assumptions.
void print_recommendation(std::ostream& o, const strata::Plan& p) {
  o << "\nRecommendation: "
    << (p.recommendation.found
            ? p.recommendation.layout.describe() +
                  (p.recommendation.checkpointing ? std::string(", with activation checkpointing")
                                                  : std::string())
            : std::string("none"))
    << "\n  " << p.recommendation.reason << "\n";
  if (!p.notes.empty()) {
    o << "\nNotes:\n";
    for (const auto& n : p.notes) o << "  - " << n << "\n";
  }
  o << "\nAssumptions:\n";
  for (const auto& a : p.assumptions) o << "  - " << a << "\n";
}

void print_human(std::ostream& o, const strata::Config& c, const strata::Plan& p) {
  print_header(o, c, p);
  print_stages(o, c, p);
  print_configured(o, c, p);
  print_traffic_and_verdict(o, p);
  print_ladder(o, p);
  print_recommendation(o, p);
}

struct Options : strata::cli::ConfigArgs {
  bool json = false;
  bool check = false;
};

// `strata plan --check`: the configured layout does not fit.
constexpr int kExitDoesNotFit = 3;

const bool kRegistered = strata::cli::register_command(
    {"plan", "Show what a config puts in each tier, what crosses each link, and whether it fits",
     [](CLI::App& cmd) {
       auto opts = std::make_shared<Options>();
       cmd.add_option("CONFIG", opts->config, "YAML config file")->required();
       strata::cli::add_set_option(cmd, opts->overrides);
       cmd.add_flag("--json", opts->json, "Print one JSON document (sizes in bytes)");
       cmd.add_flag("--check", opts->check,
                    "Exit with status 3 when the configured layout does not fit (model state, "
                    "pinned pool, runtime buffers, and activations when the model shape is given)");
       return [opts]() -> int {
         strata::Config c = strata::load_config(opts->config, opts->overrides);
         if (c.model.parameters == 0)
           strata::fail(strata::ErrorCode::kInvalidArgument,
                        c.source +
                            ": model.parameters: strata plan needs the model's parameter "
                            "count (e.g. model: {parameters: 7.5B})");
         // tiers.host.budget not set: this machine's memory (strata/plan.hpp, docs/config.md).
         strata::Plan p = strata::make_plan(c, strata::read_machine_memory());
         if (opts->json) {
           std::cout << plan_json(c, p).dump(2) << "\n";
         } else {
           print_human(std::cout, c, p);
         }
         if (opts->check && !p.configured_fits()) {
           std::cout.flush();
           std::cerr << "strata: plan --check: the configured layout (" << p.configured.describe()
                     << ") does not fit: " << p.configured_rung.verdict << "\n";
           return kExitDoesNotFit;
         }
         return 0;
       };
     }});

}  // namespace
}  // namespace cmd_plan
