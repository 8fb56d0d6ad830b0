// `strata clean PATH... [--dry-run] [--json]`: removes what killed strata processes left under
// swap paths (per-run swap directories, `bench io` files), as every run does at start-up for its
// own tiers.nvme.paths. PATH is a swap path (tiers.nvme.paths entry) or one per-run directory.
// Exit code 0 when everything found was removed (or nothing was found in a PATH that is empty or
// holds strata's entries), 1 when removing something failed, 2 for a bad or unsafe PATH, and for a
// PATH that holds other things but nothing of strata's (`strata clean /etc`: a mistyped path is
// not reported as clean). Every PATH is checked before anything is removed.
#include <algorithm>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/command.hpp"
#include "core/safe_fs.hpp"
#include "strata/error.hpp"
#include "strata/units.hpp"
#include "tier/swap_space.hpp"

namespace cmd_clean {
namespace {

using namespace strata;

struct Options {
  std::vector<std::string> paths;
  bool dry_run = false;
  bool json = false;
};

bool strata_name(std::string_view name) {
  return name.starts_with("strata-") || name.starts_with(".strata-");
}

// Refuses (exit 2) a PATH that holds entries but none of strata's (strata-swap-* directories,
// .strata-bench-io-* files): not a swap path. An empty directory is a swap path after clean runs.
void check_swap_path(const std::string& path) {
  const std::string norm = normalize_path(path);
  const std::string base = norm.substr(norm.find_last_of('/') + 1);
  if (base.starts_with("strata-swap-")) return;  // one per-run directory itself
  const SafeDir dir = SafeDir::open(path, {.role = "swap path", .read_only = true});
  const std::vector<std::string> names = dir.entries();
  if (names.empty() || std::any_of(names.begin(), names.end(), strata_name)) return;
  fail(ErrorCode::kInvalidArgument,
       strcat("clean: ", path, " holds nothing of strata's (", names.size(),
              names.size() == 1 ? " entry" : " entries",
              ", none a strata-swap-* directory or a bench io file): not a swap path "
              "(a tiers.nvme.paths entry or a strata-swap-* directory); nothing was removed"));
}

int run(const Options& o) {
  for (const auto& p : o.paths) check_swap_path(p);
  std::vector<SwapLeftover> all;
  for (const auto& p : o.paths) {
    auto found = find_swap_leftovers(p, !o.dry_run);
    all.insert(all.end(), found.begin(), found.end());
  }
  std::uint64_t freed = 0;
  std::size_t removed = 0, failed = 0, kept = 0;
  for (const auto& l : all) {
    if (l.status == SwapLeftover::Status::kRemoved ||
        l.status == SwapLeftover::Status::kWouldRemove) {
      freed += l.bytes;
      ++removed;
    } else if (l.status == SwapLeftover::Status::kFailed) {
      ++failed;
    } else {
      ++kept;
    }
  }
  if (o.json) {
    nlohmann::json j;
    j["paths"] = o.paths;
    j["dry_run"] = o.dry_run;
    j["entries"] = nlohmann::json::array();
    for (const auto& l : all) {
      j["entries"].push_back({{"path", l.path},
                              {"pid", l.pid},
                              {"uid", l.uid},
                              {"bytes", l.bytes},
                              {"status", swap_leftover_status_name(l.status)},
                              {"detail", l.detail}});
    }
    j[o.dry_run ? "would_free_bytes" : "freed_bytes"] = freed;
    j["failed"] = failed;
    std::cout << j.dump(2) << "\n";
  } else {
    for (const auto& l : all) {
      std::cout << swap_leftover_status_name(l.status) << ": " << l.path << " (process " << l.pid
                << ", " << format_bytes(l.bytes, true) << ")";
      if (!l.detail.empty()) std::cout << ": " << l.detail;
      std::cout << "\n";
    }
    if (all.empty()) {
      std::cout << "nothing left by strata processes under";
      for (const auto& p : o.paths) std::cout << " " << p;
      std::cout << "\n";
    } else {
      std::cout << (o.dry_run ? "would free " : "freed ") << format_bytes(freed, true) << " ("
                << freed << " bytes) in " << removed << " entr" << (removed == 1 ? "y" : "ies");
      if (kept) std::cout << "; kept " << kept;
      if (failed) std::cout << "; " << failed << " failed";
      std::cout << "\n";
    }
  }
  return failed ? 1 : 0;
}

const bool kRegistered = strata::cli::register_command(
    {"clean", "Remove swap directories and benchmark files left by killed strata runs",
     [](CLI::App& cmd) {
       auto o = std::make_shared<Options>();
       cmd.add_option("PATH", o->paths,
                      "A swap path (a tiers.nvme.paths entry) or one strata-swap-* directory")
           ->required();
       cmd.add_flag("--dry-run", o->dry_run, "Only list what would be removed");
       cmd.add_flag("--json", o->json, "Print one JSON document");
       cmd.footer(
           "An entry is removed when its process (the pid in its name) is gone and nobody holds "
           "its lock; entries of running processes and of other users (unless run as root) are "
           "kept. Every strata run does this for its own tiers.nvme.paths at start-up. A PATH "
           "that holds other files but nothing of strata's is refused (exit 2) before anything "
           "is removed; an empty one has nothing to clean (exit 0).");
       return [o]() -> int { return run(*o); };
     }});

}  // namespace
}  // namespace cmd_clean
