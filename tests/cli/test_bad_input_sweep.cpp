// The bad-input sweep (issue 25, point 6): every `strata` command is given nonsense operands,
// paths and flags — a directory that holds nothing of strata's, a missing path, /etc, an empty
// string, an unknown flag, an extra operand — and each case either does what was asked or exits 2
// with a message naming what was wrong (docs/errors.md, "The command line"). The cases that used
// to exit 0 having ignored what they were given are listed one by one below the sweep.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "test_util.hpp"

namespace strata::testing {
namespace {

namespace fs = std::filesystem;

// A shell word: single-quoted ('' for the empty string).
std::string quoted(const std::string& s) { return "'" + s + "'"; }

struct Outcome {
  int rc = 0;
  std::string out;  // stdout and stderr
};
Outcome run_sweep(const std::string& args) {
  Outcome r;
  r.rc = run_command("timeout 120 " + strata_cli() + " " + args + " </dev/null 2>&1", &r.out);
  return r;
}

void expect_refused(const std::string& args, const std::string& needle) {
  SCOPED_TRACE(args);
  const Outcome r = run_sweep(args);
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find(needle), std::string::npos) << "message does not name '" << needle << "':\n"
                                                   << r.out;
}

// What the sweep hands the commands: a config, a DeepSpeed config, directories.
struct Inputs {
  TempDir dir{"strata-sweep"};
  std::string config = dir.str() + "/small.yaml";
  std::string ds = dir.str() + "/ds.json";
  std::string foreign = dir.str() + "/not-strata";  // a directory with a file of someone else's
  std::string empty = dir.str() + "/empty";         // an empty directory
  std::string missing = dir.str() + "/missing";
  std::string out = dir.str() + "/out.safetensors";
  Inputs() {
    std::ofstream(config) << "model: {parameters: 20K, largest_layer: 10K}\n"
                             "tiers: {nvme: {paths: ["
                          << dir.str() << "/swap]}}\n";
    std::ofstream(ds) << R"({"train_batch_size": 8, "zero_optimization": {"stage": 2}})";
    fs::create_directory(foreign);
    std::ofstream(foreign + "/notes.txt") << "not strata's\n";
    fs::create_directory(empty);
  }
};

// A command and how one nonsense operand is put into it ({} is replaced); `valid` is a well-formed
// invocation that an extra operand is appended to.
struct Command {
  std::string name;  // as `strata --help` lists it ("bench io")
  std::string form;  // "plan {}"
  std::string valid;
  // Any directory is nonsense for it (not bench io --dir: it benchmarks any directory, and would
  // write in /etc).
  bool takes_dir = true;
};

std::vector<Command> commands(const Inputs& in) {
  return {
      {"bench adam", "bench adam --params 1K --rounds 1 {}", "bench adam --params 1K --rounds 1"},
      {"bench io", "bench io --size 1MiB --dir {}", "bench io --size 1MiB --dir " + in.empty,
       false},
      {"bench checkpoint", "bench checkpoint {}", "bench checkpoint " + in.config},
      {"bench step", "bench step {}", "bench step " + in.config},
      {"checkpoint info", "checkpoint info {}", "checkpoint info " + in.empty},
      {"checkpoint verify", "checkpoint verify {}", "checkpoint verify " + in.empty},
      {"checkpoint export", "checkpoint export --out " + in.out + " {}",
       "checkpoint export --out " + in.out + " " + in.empty},
      {"clean", "clean {}", "clean " + in.empty},
      {"import-deepspeed", "import-deepspeed {}", "import-deepspeed " + in.ds},
      {"info", "info {}", "info"},
      {"plan", "plan {}", "plan " + in.config},
      {"profile", "profile --quick {}", "profile --quick " + in.config},
      {"train", "train --steps 1 {}", "train --steps 1 " + in.config},
  };
}

std::string fill(const std::string& form, const std::string& operand) {
  std::string s = form;
  s.replace(s.find("{}"), 2, operand);
  return s;
}

// The names `strata --help`, `strata bench --help` and `strata checkpoint --help` list.
std::set<std::string> listed_commands() {
  std::set<std::string> names;
  auto scan = [&](const std::string& group) {
    const Outcome r = run_sweep(group + " --help");
    std::istringstream lines(r.out);
    bool in_list = false;
    for (std::string line; std::getline(lines, line);) {
      if (line.starts_with("Subcommands:")) {
        in_list = true;
        continue;
      }
      if (!in_list || line.size() < 3 || line[0] != ' ') continue;
      std::istringstream words(line);
      std::string name;
      words >> name;
      names.insert(group.empty() ? name : group + " " + name);
    }
  };
  scan("");
  scan("bench");
  scan("checkpoint");
  names.erase("bench");
  names.erase("checkpoint");
  return names;
}

TEST(BadInputSweep, CoversEveryCommand) {
  if (!fs::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  const Inputs in;
  std::set<std::string> swept;
  for (const Command& c : commands(in)) swept.insert(c.name);
  const std::set<std::string> listed = listed_commands();
  ASSERT_GE(listed.size(), 10u);
  EXPECT_EQ(swept, listed) << "a command is missing from the sweep (or the sweep names one that "
                              "is gone)";
}

// Every command, every nonsense operand: exit 2, and the message names the operand.
TEST(BadInputSweep, NonsenseOperandsExitTwoNamingThem) {
  if (!fs::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  const Inputs in;
  for (const Command& c : commands(in)) {
    SCOPED_TRACE(c.name);
    expect_refused(fill(c.form, quoted(in.missing)), in.missing);
    expect_refused(fill(c.form, quoted("")), "empty");
    expect_refused(c.valid + " --no-such-flag", "--no-such-flag");
    expect_refused(c.valid + " surplus-operand", "surplus-operand");
    if (c.name == "bench adam" || c.name == "info" || !c.takes_dir) continue;
    expect_refused(fill(c.form, quoted(in.foreign)), in.foreign);
    expect_refused(fill(c.form, "/etc"), "/etc");
  }
}

// `strata clean` on a directory that holds nothing of strata's said "nothing left" and exited 0.
TEST(BadInputSweep, CleanRefusesAPathWithNothingOfStratasBeforeRemovingAnything) {
  if (!fs::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  const Inputs in;
  for (const std::string flags : {"", "--dry-run ", "--json "}) {
    expect_refused("clean " + flags + "/etc", "/etc holds nothing of strata's");
    expect_refused("clean " + flags + in.foreign, "nothing of strata's");
  }
  // A leftover of a gone process in a good path is kept when another PATH is refused.
  const std::string left = in.empty + "/strata-swap-999999999-r0-00000000";
  fs::create_directory(left);
  expect_refused("clean " + in.empty + " /etc", "/etc");
  EXPECT_TRUE(fs::exists(left));
  // An empty swap path has nothing to clean; one with a leftover is cleaned.
  fs::remove(left);
  const Outcome empty = run_sweep("clean " + in.empty);
  EXPECT_EQ(empty.rc, 0) << empty.out;
  EXPECT_NE(empty.out.find("nothing left"), std::string::npos) << empty.out;
  fs::create_directory(left);
  const Outcome cleaned = run_sweep("clean " + in.empty);
  EXPECT_EQ(cleaned.rc, 0) << cleaned.out;
  EXPECT_FALSE(fs::exists(left)) << cleaned.out;
}

// Options given an empty string, or given without the option they qualify, were ignored (exit 0).
TEST(BadInputSweep, EmptyAndDanglingOptionsAreRefused) {
  if (!fs::exists(strata_cli())) GTEST_SKIP() << "no strata CLI built";
  const Inputs in;
  const std::string io = "bench io --size 1MiB --dir " + in.empty;
  expect_refused("train " + in.config + " --steps 1 --checkpoint-dir ''", "--checkpoint-dir");
  expect_refused("profile --quick " + in.config + " --write-config ''", "--write-config");
  expect_refused("profile --quick " + in.config + " --json-file ''", "--json-file");
  expect_refused("profile --quick " + in.config + " --repeats 0", "--repeats");
  expect_refused("import-deepspeed " + in.ds + " -o ''", "--output");
  expect_refused("import-deepspeed " + in.ds + " --overwrite", "--overwrite");
  expect_refused("import-deepspeed " + in.ds + " --parameters ''", "--parameters");
  expect_refused("import-deepspeed " + in.ds + " --hidden-size ''", "--hidden-size");
  expect_refused("import-deepspeed " + in.ds + " --micro-batch ''", "--micro-batch");
  expect_refused(io + " --keep", "--keep");
  expect_refused(io + " --overwrite", "--overwrite");
  expect_refused(io + " --file ''", "--file");
  expect_refused("bench step " + in.config + " --params ''", "--params");
  expect_refused("--log-level '' info", "log level");
  EXPECT_TRUE(fs::is_empty(in.empty)) << "a refused command left something behind";
}

}  // namespace
}  // namespace strata::testing
