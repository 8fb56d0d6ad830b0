// `strata profile --write-config`: tuned_config_text edits the user's YAML in place — comments,
// key order and units survive, changed sizes are written with units, missing keys are added, a
// shorthand target becomes a map, --set overrides are applied — and the text loads as the tuned
// config. An unusual layout falls back to a full rendering and says so.
#include <gtest/gtest.h>

#include "strata/config.hpp"
#include "strata/profile.hpp"

namespace strata {
namespace {

const char* kOriginal = R"(# My training job.
model:
  parameters: 7.5B   # Llama-ish
world: {ranks: 8}
zero:
  stage: 2           # keep it at 2
offload:
  optimizer: cpu     # shorthand
tiers:
  gpu: {budget: 80GB}
  host:
    budget: 512GiB   # per node
    pinned_budget: 8GiB
  nvme:
    paths: [/mnt/nvme0/strata]
    block_size: 1MiB # the old setting
    queue_depth: 32
)";

TEST(TunedYaml, EditsValuesInPlaceKeepingCommentsAndUnits) {
  const Config original = parse_config(kOriginal, "job.yaml");
  Config tuned = original;
  tuned.tiers.nvme.block_size = 512 << 10;
  tuned.tiers.nvme.queue_depth = 8;
  tuned.tiers.nvme.engine = IoEngineKind::kIoUring;  // key not in the file: added
  tuned.zero.stage = 3;
  tuned.offload.optimizer = OffloadTarget{Tier::kNvme, 1.0, false};
  tuned.offload.gradients = OffloadTarget{Tier::kCpu, 1.0, false};  // `gradients` absent: added
  std::string note;
  const std::string text = tuned_config_text(kOriginal, original, tuned, {}, &note);
  EXPECT_TRUE(note.empty()) << note;
  for (const char* kept :
       {"# My training job.", "parameters: 7.5B   # Llama-ish", "budget: 512GiB   # per node",
        "pinned_budget: 8GiB", "budget: 80GB", "stage: 3           # keep it at 2",
        "block_size: 512KiB # the old setting", "queue_depth: 8", "engine: io_uring"})
    EXPECT_NE(text.find(kept), std::string::npos) << kept << "\n" << text;
  EXPECT_EQ(text.find("549755813888"), std::string::npos) << text;  // no unit-less bytes
  const Config back = parse_config(text, "tuned.yaml");
  EXPECT_EQ(to_yaml(back), to_yaml(tuned));
}

TEST(TunedYaml, NothingChangedIsTheOriginalText) {
  const Config original = parse_config(kOriginal, "job.yaml");
  std::string note;
  EXPECT_EQ(tuned_config_text(kOriginal, original, original, {}, &note), kOriginal);
}

TEST(TunedYaml, AppliesOverridesAndAddsMissingSections) {
  const std::string text0 = "model: {parameters: 1B}\n# no tiers section at all\n";
  const std::vector<std::string> overrides = {"world.ranks=2", "zero.sub_group_size=8M"};
  const Config original = parse_config(text0, "a.yaml", overrides);
  Config tuned = original;
  tuned.tiers.nvme.queue_depth = 64;
  tuned.offload.optimizer = OffloadTarget{Tier::kCpu, 0.5, true};
  std::string note;
  const std::string text = tuned_config_text(text0, original, tuned, overrides, &note);
  EXPECT_TRUE(note.empty()) << note << "\n" << text;
  EXPECT_NE(text.find("# no tiers section at all"), std::string::npos) << text;
  EXPECT_NE(text.find("sub_group_size: 8M"), std::string::npos) << text;
  EXPECT_EQ(to_yaml(parse_config(text, "t.yaml")), to_yaml(tuned)) << text;
}

TEST(TunedYaml, UnusualLayoutFallsBackToAFullRendering) {
  // The paths list in block style cannot be replaced in place by a --set list.
  const std::string text0 = "model: {parameters: 1B}\ntiers:\n  nvme:\n    paths:\n      - /a\n";
  const std::vector<std::string> overrides = {"tiers.nvme.paths=[/b]"};
  const Config original = parse_config(text0, "a.yaml", overrides);
  std::string note;
  const std::string text = tuned_config_text(text0, original, original, overrides, &note);
  EXPECT_NE(note.find("full rendering"), std::string::npos);
  EXPECT_EQ(to_yaml(parse_config(text, "t.yaml")), to_yaml(original));
}

}  // namespace
}  // namespace strata
