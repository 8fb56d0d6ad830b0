#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>

#include "cli/command.hpp"
#include "core/printable.hpp"
#include "strata/build_info.hpp"
#include "strata/cleanup.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata::cli {
namespace {
std::vector<CommandSpec>& registry() {
  static std::vector<CommandSpec> specs;
  return specs;
}
}  // namespace

bool register_command(CommandSpec spec) {
  registry().push_back(std::move(spec));
  return true;
}

void add_set_option(CLI::App& cmd, std::vector<std::string>& overrides) {
  cmd.add_option("--set", overrides,
                 "Override a config value, e.g. --set zero.stage=3 (repeatable)")
      ->type_name("KEY.PATH=VALUE")
      ->allow_extra_args(false);
}

namespace {

// SIGTERM, SIGINT, SIGHUP: remove the files registered with strata/cleanup.hpp (swap files,
// benchmark files), then end the way the signal would have (status 128 + signal).
extern "C" void on_terminating_signal(int sig) {
  run_signal_cleanup(true);
  ::signal(sig, SIG_DFL);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  ::raise(sig);
}

void install_cleanup_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_terminating_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&sa.sa_mask, sig);
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) {
    struct sigaction old {};
    if (sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;  // nohup, &
    sigaction(sig, &sa, nullptr);
  }
}

using Runners = std::vector<std::pair<CLI::App*, std::shared_ptr<RunFn>>>;

// No option or operand of any command takes an empty string: `--checkpoint-dir ''` or `-o ''`
// (an unset shell variable) is refused (exit 2) instead of being read as "not given".
void refuse_empty_values(CLI::App& cmd) {
  const CLI::Validator nonempty(
      [](std::string& value) -> std::string {
        return value.empty() ? "an empty value (give one, or leave the option out)" : "";
      },
      "", "NONEMPTY");
  for (CLI::Option* opt : cmd.get_options())
    if (opt->get_type_size_max() > 0) opt->check(nonempty);
}

// Adds every registered command to `app` ("bench io" under a "bench" group), in name order.
Runners add_commands(CLI::App& app) {
  std::map<std::string, CLI::App*> groups;
  std::map<CLI::App*, int> groups_listed;  // commands named in each group's description so far
  Runners runners;
  auto specs = registry();
  std::stable_sort(specs.begin(), specs.end(),
                   [](const auto& a, const auto& b) { return a.name < b.name; });
  for (auto& spec : specs) {
    CLI::App* parent = &app;
    std::string leaf = spec.name;
    if (auto sp = spec.name.find(' '); sp != std::string::npos) {
      std::string group = spec.name.substr(0, sp);
      leaf = spec.name.substr(sp + 1);
      auto it = groups.find(group);
      if (it == groups.end()) {
        CLI::App* g = app.add_subcommand(group, "Benchmarks: " + group);
        g->require_subcommand(1);
        it = groups.emplace(group, g).first;
      }
      parent = it->second;
    }
    if (parent != &app)  // the group's description lists its commands: "bench adam|checkpoint|..."
      parent->description(parent->get_description() + (groups_listed[parent]++ ? "|" : " ") + leaf);
    CLI::App* sub = parent->add_subcommand(leaf, spec.description);
    auto run = std::make_shared<RunFn>(spec.setup(*sub));
    refuse_empty_values(*sub);
    runners.emplace_back(sub, run);
  }

  return runners;
}

// After a parse error: true (having said so) when an argument names no command. An unknown
// command reads better than CLI11's "A subcommand is required".
bool reported_unknown_command(CLI::App& app, int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.empty() || a[0] == '-') {
      if (a == "--log-level") ++i;
      continue;
    }
    const auto subs = app.get_subcommands([](CLI::App*) { return true; });
    if (std::none_of(subs.begin(), subs.end(), [&](CLI::App* sub) { return sub->check_name(a); })) {
      std::string names;
      for (const auto* sub : subs) names += (names.empty() ? "" : ", ") + sub->get_name();
      std::cerr << "strata: error: unknown command '" << a << "' (commands: " << names
                << "; see --help)\n";
      return true;
    }
    return false;
  }
  return false;
}

// After an ExtrasError: the arguments no command takes, quoted (an empty one is said so, where
// CLI11 would print nothing). Returns exit code 2.
int report_extras(CLI::App& app) {
  std::string list;
  for (const std::string& a : app.remaining(true))
    list += (list.empty() ? "'" : ", '") + printable(a, 200) + (a.empty() ? "' (empty)" : "'");
  std::cerr << "strata: error: unexpected argument(s): " << list << " (see --help)\n";
  return 2;
}

}  // namespace
}  // namespace strata::cli

int main(int argc, char** argv) {
  using namespace strata;
  cli::install_cleanup_handlers();
  CLI::App app{"strata: tiered ZeRO training state across GPU, pinned host memory and NVMe"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("strata ") + build::kVersion +
                                        (build::kWithCuda ? " (CUDA" : " (no CUDA") +
                                        (build::kWithMpi ? ", MPI)" : ", no MPI)"));
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "debug, info, warn, error, off (stderr)")
      ->capture_default_str();
  const cli::Runners runners = cli::add_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    if (cli::reported_unknown_command(app, argc, argv)) return 2;
    if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) return cli::report_extras(app);
    app.exit(e);
    return 2;
  }
  try {
    set_log_level(parse_log_level(log_level));
    for (auto& [sub, run] : runners) {
      if (sub->parsed()) return (*run)();
    }
    std::cerr << "strata: error: no command given (see --help)\n";
    return 2;
  } catch (const Error& e) {
    std::cout.flush();
    std::cerr << "strata: error: " << printable_lines(e.what()) << "\n";
    return e.exit_code();
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "strata: error: " << printable_lines(e.what()) << "\n";
    return 1;
  }
}
