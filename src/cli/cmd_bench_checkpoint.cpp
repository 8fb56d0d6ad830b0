// `strata bench checkpoint CONFIG [--params N] [--state nvme,cpu] [--dir DIR] [--rounds N]
// [--steps N] [--json]`: what a checkpoint save costs training, for a one-rank engine of N
// parameters (default 133.5M) with its optimizer state on NVMe (tiers.nvme.paths) and/or in
// pinned host memory (profile/checkpoint_bench.hpp):
//   - blocked time: a blocking save against an asynchronous save's call (the snapshot), ratio;
//   - the background writer's throughput on an idle step loop against a raw sequential write of
//     the same bytes through the I/O engine (O_DIRECT, the disk's bound), and, state on NVMe,
//     against the same writes with the writer's reads beside them, in the same run, alternated;
//   - steps taken while the writer works against idle steps and against what their share of the
//     disk and the CPUs predicts (the idle steps' spread: the run's noise), the writer's pauses for
//     the steps' own I/O, and the CPU time of an idle step and of the writer.
// The checkpoints go to DIR/.strata-bench-checkpoint-<pid> (DIR: --dir, default the first
// tiers.nvme.paths entry, else $TMPDIR or /tmp), removed afterwards. Progress on stderr.
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "cli/command.hpp"
#include "profile/checkpoint_bench.hpp"
#include "strata/config.hpp"
#include "strata/error.hpp"
#include "strata/units.hpp"

namespace strata::profile {
// --json: every member of a result under its own name.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(CheckpointBenchResult, state, params, shard_bytes,
                                   blocking_save_s, async_blocked_s, blocked_ratio, writer_s,
                                   writer_bytes_per_s, raw_write_s, raw_write_bytes_per_s,
                                   writer_vs_raw, state_read_bytes, raw_move_s, writer_vs_move,
                                   idle_step_s, busy_step_s, busy_steps, busy_slowdown,
                                   predicted_busy_slowdown, busy_vs_predicted, idle_step_spread,
                                   idle_step_cpu_s, writer_cpu_s, writer_busy_s, writer_paused_s,
                                   writer_pauses)
}  // namespace strata::profile

namespace cmd_bench_checkpoint {
namespace {

using namespace strata;
using nlohmann::json;

struct Options : strata::cli::ConfigArgs {
  std::string params = "133.5M";
  std::string state = "nvme,cpu";
  std::string dir;
  int rounds = 3;
  int steps = 3;
  bool json = false;
};

std::vector<Tier> placements(const std::string& list) {
  std::vector<Tier> out;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');) {
    if (item == "nvme")
      out.push_back(Tier::kNvme);
    else if (item == "cpu")
      out.push_back(Tier::kCpu);
    else
      fail(ErrorCode::kInvalidArgument,
           strcat("bench checkpoint: --state '", item, "': nvme or cpu (comma-separated)"));
  }
  if (out.empty()) fail(ErrorCode::kInvalidArgument, "bench checkpoint: --state is empty");
  return out;
}

void print_human(const profile::CheckpointBenchResult& r) {
  auto ms = [](double s) { return s * 1e3; };
  auto rate = [](double b) { return format_bytes(static_cast<std::uint64_t>(b), true) + "/s"; };
  std::cout << "state on " << r.state << ": " << format_count(r.params) << " parameters, shard "
            << format_bytes(r.shard_bytes, true) << "\n"
            << "  blocked: blocking save " << ms(r.blocking_save_s) << " ms, asynchronous save "
            << ms(r.async_blocked_s) << " ms (ratio " << r.blocked_ratio << ", target <= 0.05)\n"
            << "  writer on an idle loop " << rate(r.writer_bytes_per_s) << ", raw sequential "
            << "write " << rate(r.raw_write_bytes_per_s) << " (ratio " << r.writer_vs_raw
            << ", target >= 0.85)\n";
  if (r.state_read_bytes > 0)
    std::cout << "  the writer also reads " << format_bytes(r.state_read_bytes, true)
              << " of state from the disk it writes to: raw write with those reads beside it "
              << ms(r.raw_move_s) << " ms, writer " << ms(r.writer_s) << " ms (ratio "
              << r.writer_vs_move << ")\n";
  std::cout << "  steps: idle " << ms(r.idle_step_s) << " ms, while writing " << ms(r.busy_step_s)
            << " ms over " << r.busy_steps << " step(s) (x" << r.busy_slowdown
            << "; their share of the disk and CPUs predicts x" << r.predicted_busy_slowdown
            << ", ratio " << r.busy_vs_predicted << "; idle steps differ by "
            << r.idle_step_spread * 100 << "%); the writer took " << ms(r.writer_busy_s)
            << " ms a round; over all rounds it paused " << ms(r.writer_paused_s) << " ms in "
            << r.writer_pauses << " pause(s) for the steps\n"
            << "  CPU time: an idle step " << ms(r.idle_step_cpu_s) << " ms, the writer "
            << ms(r.writer_cpu_s) << " ms a save\n";
}

std::string bench_dir(const Options& o, const Config& cfg) {
  std::string base = o.dir;
  if (base.empty() && !cfg.tiers.nvme.paths.empty()) base = cfg.tiers.nvme.paths.front();
  if (base.empty()) {
    const char* t = std::getenv("TMPDIR");
    base = t && *t ? t : "/tmp";
  }
  return (std::filesystem::path(base) / strcat(".strata-bench-checkpoint-", ::getpid())).string();
}

int run(const Options& o) {
  const Config cfg = load_config(o.config, o.overrides);
  profile::CheckpointBenchOptions bo;
  bo.config = cfg;
  bo.elements = parse_count(o.params);
  bo.rounds = o.rounds;
  bo.steps = o.steps;
  bo.dir = bench_dir(o, cfg);
  const std::vector<Tier> tiers = placements(o.state);
  json all = json::array();
  struct Remove {  // the bench's checkpoints, however the run ends
    std::string dir;
    ~Remove() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } remove{bo.dir};
  for (Tier t : tiers) {
    bo.state = t;
    std::cerr << "strata: bench checkpoint: " << format_count(bo.elements) << " parameters, state "
              << "on " << tier_name(t) << ", " << bo.rounds << " round(s), checkpoints in "
              << bo.dir << "..." << std::endl;
    const profile::CheckpointBenchResult r = profile::run_checkpoint_bench(bo);
    all.push_back(json(r));
    if (!o.json) print_human(r);
  }
  if (o.json) std::cout << json{{"command", "bench checkpoint"}, {"results", all}}.dump(2) << "\n";
  return 0;
}

const bool kRegistered = strata::cli::register_command(
    {"bench checkpoint",
     "What a checkpoint save costs training: blocked time (blocking vs asynchronous), the "
     "background writer vs the disk's raw write (and read || write), steps while it writes",
     [](CLI::App& cmd) {
       auto o = std::make_shared<Options>();
       cmd.add_option("CONFIG", o->config, "YAML config (precision.*, optimizer.*, tiers.*)")
           ->required();
       cmd.add_option("--params", o->params, "Parameters of the rank (e.g. 133.5M, 33M)")
           ->capture_default_str();
       cmd.add_option("--state", o->state,
                      "Where the optimizer state lives, comma-separated: nvme (tiers.nvme.paths), "
                      "cpu (pinned host memory)")
           ->capture_default_str();
       cmd.add_option("--dir", o->dir,
                      "Directory for the checkpoints and the raw writes (default: the first "
                      "tiers.nvme.paths entry, else $TMPDIR or /tmp)");
       cmd.add_option("--rounds", o->rounds, "Measured rounds (medians)")->capture_default_str();
       cmd.add_option("--steps", o->steps, "Idle steps timed per round")->capture_default_str();
       cmd.add_flag("--json", o->json, "Print one JSON document");
       strata::cli::add_set_option(cmd, o->overrides);
       return [o]() -> int { return run(*o); };
     }});

}  // namespace
}  // namespace cmd_bench_checkpoint
