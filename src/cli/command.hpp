// The CLI's command registry. Each command lives in its own cmd_*.cpp file in this folder and
// registers itself with a static initializer, everything of the file inside a namespace named for
// the file and an unnamed one within it (so that the files' helpers, Options and kRegistered do not
// meet in a unity build, which compiles several files as one):
//
//   namespace cmd_bench_io {
//   namespace {
//   const bool kRegistered = strata::cli::register_command(
//       {"bench io", "Sequential O_DIRECT throughput of an I/O engine", [](CLI::App& cmd) {
//          auto opts = std::make_shared<Options>();
//          cmd.add_option("--dir", opts->dir, "...")->required();
//          return [opts]() -> int { ...; return 0; };   // run after parsing; returns exit code
//        }});
//   }  // namespace
//   }  // namespace cmd_bench_io
//
// A name with a space ("bench io") becomes a subcommand of a group ("bench"). The run function
// prints its result on stdout (with --json: one JSON document and nothing else there), progress
// and warnings on stderr, and either returns an exit code or throws strata::Error (the main
// function turns it into "strata: error: ..." and exit code 2 for bad input, 1 otherwise).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace strata::cli {

using RunFn = std::function<int()>;

struct CommandSpec {
  std::string name;                       // "plan", "bench io"
  std::string description;                // one line for --help
  std::function<RunFn(CLI::App&)> setup;  // adds options to the subcommand, returns the runner
};

bool register_command(CommandSpec spec);

// Adds --set key.path=value (repeatable) to a command.
void add_set_option(CLI::App& cmd, std::vector<std::string>& overrides);

// What every command that reads a YAML config takes: its path (CONFIG) and its --set overrides
// (load_config(config, overrides)). A command's Options derive from it.
struct ConfigArgs {
  std::string config;
  std::vector<std::string> overrides;
};

}  // namespace strata::cli
