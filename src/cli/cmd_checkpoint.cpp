// `strata checkpoint info|verify|export DIR`: inspect, check and consolidate a checkpoint written
// by Engine::save_checkpoint / `strata train --checkpoint-dir` (docs/offload.md, "Checkpoints").
//   info DIR [--json]                     world, stage, step, tensors, sizes, where each shard
//   lives verify DIR [--json]                   every checksum; exit 0 (intact) or 1 (what is
//   wrong) export DIR --out F [--dtype D] [--overwrite] [--json]
//                                         the model (FP32 master, or converted) as safetensors
// Exit codes: 0 ok; 1 a damaged checkpoint (checksum, missing or truncated shard) or another
// failure; 2 bad input (no checkpoint in DIR, a format this strata does not read, bad arguments).
#include <sys/stat.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "checkpoint/tools.hpp"
#include "cli/command.hpp"
#include "core/printable.hpp"
#include "strata/error.hpp"
#include "strata/units.hpp"

namespace cmd_checkpoint {
namespace {

using namespace strata;
using namespace strata::checkpoint;
using nlohmann::json;

struct Options {
  std::string dir;
  std::string out;
  std::string dtype = "fp32";
  bool overwrite = false;
  bool json = false;
};

std::string human(std::uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

std::uint64_t parameters(const checkpoint::Manifest& m) {
  std::uint64_t n = 0;
  for (const auto& t : m.tensors) n += t.numel;
  return n;
}

// The manifest's fields (as manifest.json names them), where the directory is, the parameter
// count, and whether each shard is there with its size.
json manifest_json(const checkpoint::Manifest& m, const checkpoint::SafeDir& dir) {
  json j = checkpoint::manifest_fields(m);
  j["dir"] = dir.path();
  j["optimizer_step"] = m.adam_step;  // the name `info --json` has always used
  j["parameters"] = parameters(m);
  for (json& s : j["shards"]) {
    const std::string file = s["file"].get<std::string>();
    struct stat st {};
    const bool present = dir.stat_entry(file, &st);
    s["path"] = dir.child_path(file);
    s["present"] = present;
    s["size_matches"] = present && static_cast<std::uint64_t>(st.st_size) == s["bytes"];
  }
  return j;
}

int run_info(const Options& o) {
  const checkpoint::SafeDir dir = checkpoint::SafeDir::open(o.dir, {.read_only = true});
  const checkpoint::Manifest m = checkpoint::read_manifest(dir);
  const json j = manifest_json(m, dir);
  if (o.json) {
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << "checkpoint " << printable(dir.path()) << ": format " << m.format_version
            << " (written by strata " << printable(m.strata_version) << "), serial " << m.serial
            << "\n"
            << "  saved by " << m.world << " rank(s) at ZeRO stage " << m.stage << ", parameters "
            << dtype_name(m.param_dtype) << "\n"
            << "  after step " << m.steps << " (" << m.applied_steps << " applied, "
            << m.skipped_steps << " skipped; optimizer step " << m.adam_step << "), loss scale "
            << m.loss_scale << "\n"
            << "  " << m.tensors.size() << " tensors, " << parameters(m) << " parameters ("
            << m.flat_size << " elements with padding, " << m.partition_size
            << " per shard), checksum blocks of " << m.block_elems << " elements\n";
  std::cout << "tensors:\n";
  // Names as printable() writes them: a name's control characters (escape sequences) are not
  // sent to the terminal.
  std::vector<std::string> names;
  std::size_t w = 4;
  for (const auto& t : m.tensors) w = std::max(w, names.emplace_back(printable(t.name)).size());
  for (std::size_t i = 0; i < m.tensors.size(); ++i) {
    const auto& t = m.tensors[i];
    std::cout << "  " << names[i] << std::string(w - names[i].size(), ' ') << "  " << t.numel
              << " elements at flat offset " << t.offset << " (shard";
    const std::uint64_t first = t.offset / m.partition_size;
    const std::uint64_t last = t.numel ? (t.offset + t.numel - 1) / m.partition_size : first;
    std::cout << (first == last ? " " : "s ") << first;
    if (last != first) std::cout << "-" << last;
    std::cout << ")\n";
  }
  std::cout << "shards:\n";
  for (const auto& s : j["shards"]) {
    std::cout << "  rank " << s["rank"].get<int>() << "  "
              << printable(s["path"].get<std::string>()) << "  elements ["
              << s["begin"].get<std::uint64_t>() << ", "
              << s["begin"].get<std::uint64_t>() + s["count"].get<std::uint64_t>() << ")  "
              << human(s["bytes"].get<std::uint64_t>())
              << (!s["present"].get<bool>()        ? "  MISSING"
                  : !s["size_matches"].get<bool>() ? "  SIZE DIFFERS (damaged)"
                                                   : "")
              << "\n";
  }
  return 0;
}

int run_verify(const Options& o) {
  const VerifyReport r = verify_checkpoint(o.dir);
  if (o.json) {
    json j;
    j["dir"] = o.dir;
    j["ok"] = r.problems.empty();
    j["serial"] = r.manifest.serial;
    j["shards"] = r.manifest.world;
    j["bytes_checked"] = r.bytes_checked;
    j["blocks_checked"] = r.blocks_checked;
    j["problems"] = r.problems;
    j["notes"] = r.notes;
    std::cout << j.dump(2) << "\n";
  } else {
    for (const auto& n : r.notes) std::cerr << "strata: note: " << n << "\n";
    for (const auto& p : r.problems) std::cout << "DAMAGED: " << p << "\n";
    if (r.problems.empty())
      std::cout << "ok: checkpoint " << o.dir << " (serial " << r.manifest.serial << ", "
                << r.manifest.world << " shards, " << human(r.bytes_checked) << ", "
                << r.blocks_checked << " blocks): the manifest and every checksum verify\n";
    else
      std::cout << r.problems.size() << " problem(s) in checkpoint " << o.dir << "\n";
  }
  return r.problems.empty() ? 0 : 1;
}

int run_export(const Options& o) {
  ExportOptions e;
  if (o.dtype == "fp32")
    e.dtype = DType::kFp32;
  else if (o.dtype == "bf16")
    e.dtype = DType::kBf16;
  else if (o.dtype == "fp16")
    e.dtype = DType::kFp16;
  else
    fail(ErrorCode::kInvalidArgument,
         strcat("--dtype '", o.dtype, "': must be fp32, bf16 or fp16"));
  e.overwrite = o.overwrite;
  const ExportResult r = export_safetensors(o.dir, o.out, e);
  if (o.json) {
    json j{{"dir", o.dir},
           {"out", o.out},
           {"dtype", o.dtype},
           {"tensors", r.tensors},
           {"parameters", r.parameters},
           {"bytes", r.bytes}};
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << "exported " << r.tensors << " tensors (" << r.parameters << " trained parameters, "
              << o.dtype << ") to " << o.out << " (" << human(r.bytes) << ")\n";
  }
  return 0;
}

const bool kRegistered = strata::cli::register_command(
    {"checkpoint", "Inspect, verify or export a checkpoint directory (info | verify | export)",
     [](CLI::App& cmd) {
       auto o = std::make_shared<Options>();
       cmd.require_subcommand(1);
       CLI::App* info = cmd.add_subcommand(
           "info", "World, stage, step, tensors, sizes and where each shard lives");
       info->add_option("dir", o->dir, "Checkpoint directory")->required();
       info->add_flag("--json", o->json, "Print one JSON document");
       CLI::App* verify = cmd.add_subcommand(
           "verify",
           "Check the manifest and every checksum of every shard (exit 0: intact, 1: damaged)");
       verify->add_option("dir", o->dir, "Checkpoint directory")->required();
       verify->add_flag("--json", o->json, "Print one JSON document");
       CLI::App* exp = cmd.add_subcommand(
           "export",
           "Write the consolidated model as one safetensors file: the trained tensors' FP32 master "
           "weights (or --dtype) and, from checkpoints strata.torch saved, every state_dict entry "
           "under its model name and shape (tied weights under each name, frozen parameters and "
           "buffers as saved): model.load_state_dict(strict=True) takes it. Checkpoints without "
           "that record (the C++ API, strata train) export each trained tensor 1-D under its "
           "registered name");
       exp->add_option("dir", o->dir, "Checkpoint directory")->required();
       exp->add_option("--out", o->out, "Output file (model.safetensors)")->required();
       exp->add_option("--dtype", o->dtype, "fp32 (default), bf16 or fp16")
           ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
           ->capture_default_str();
       exp->add_flag("--overwrite", o->overwrite, "Replace --out if it exists");
       exp->add_flag("--json", o->json, "Print one JSON document");
       return [o, info, verify, exp]() -> int {
         if (info->parsed()) return run_info(*o);
         if (verify->parsed()) return run_verify(*o);
         if (exp->parsed()) return run_export(*o);
         return 2;
       };
     }});

}  // namespace
}  // namespace cmd_checkpoint
