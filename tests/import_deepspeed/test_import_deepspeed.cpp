// `strata import-deepspeed` (issue 14.4) on six realistic DeepSpeed configs of the kinds
// DeepSpeed's docs and tutorials show (configs/): every mapped key lands in the YAML with a comment
// naming its DeepSpeed source, the result loads (load_config) with the expected values and passes
// `strata plan`; keys with no strata meaning and unknown keys are each listed in a warning; "auto"
// values are resolved and reported; malformed JSON exits 2 naming the position.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "strata/config.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

std::string config_dir() { return source_dir() + "/tests/import_deepspeed/configs/"; }

std::string slurp(const std::string& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

struct CliRun {
  int rc = -1;
  std::string out, err;
};
CliRun run(const std::string& args) {
  TempDir tmp("strata-import-err");
  CliRun r;
  r.rc = run_command("{ " + strata_cli() + " " + args + " 2>" + tmp.str() + "/err; }", &r.out);
  r.err = slurp(tmp.str() + "/err");
  return r;
}

// Every YAML line with a value carries a comment saying where it came from.
void expect_commented(const std::string& yaml, const std::string& what) {
  std::istringstream in(yaml);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#' || line.back() == ':') continue;
    EXPECT_NE(line.find("  # "), std::string::npos)
        << what << ": a value without its source: " << line;
  }
}

struct ImportCase {
  const char* file;
  const char* args;
  std::function<void(const Config&)> check;
  std::vector<std::string> warnings;  // words each expected somewhere in the warnings
};

void PrintTo(const ImportCase& c, std::ostream* os) { *os << c.file << " " << c.args; }

class ImportDeepSpeed : public ::testing::TestWithParam<ImportCase> {};

TEST_P(ImportDeepSpeed, MapsEveryKeyAndPassesPlan) {
  const ImportCase& c = GetParam();
  TempDir tmp("strata-import");
  const std::string out = tmp.str() + "/strata.yaml";
  const CliRun r = run(strcat("import-deepspeed ", config_dir(), c.file, " -o ", out, " ", c.args));
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  EXPECT_TRUE(r.out.empty()) << "stdout should be empty with -o: " << r.out;
  const std::string yaml = slurp(out);
  expect_commented(yaml, c.file);
  Config cfg;
  ASSERT_NO_THROW(cfg = load_config(out)) << yaml;
  c.check(cfg);
  for (const auto& w : c.warnings) {
    EXPECT_NE(r.err.find(w), std::string::npos) << c.file << ": no warning mentions '" << w << "'\n"
                                                << r.err;
    EXPECT_NE(yaml.find(w), std::string::npos)
        << c.file << ": the YAML does not list '" << w << "'";
  }
  const CliRun plan = run("plan " + out + " --json");
  EXPECT_EQ(plan.rc, 0) << plan.out << plan.err;
  // Without -o the YAML goes to stdout (and is the same).
  const CliRun again = run(strcat("import-deepspeed ", config_dir(), c.file, " ", c.args));
  EXPECT_EQ(again.rc, 0);
  EXPECT_EQ(again.out, yaml);
}

INSTANTIATE_TEST_SUITE_P(
    Configs, ImportDeepSpeed,
    ::testing::Values(
        // ZeRO-2 with the optimizer on the CPU (DeepSpeed's ZeRO-Offload tutorial).
        ImportCase{"zero2_cpu_offload.json",
                   "--parameters 10B --ranks 8",
                   [](const Config& c) {
                     EXPECT_EQ(c.model.parameters, 10'000'000'000ull);
                     EXPECT_EQ(c.zero.stage, 2);
                     EXPECT_EQ(c.offload.optimizer.tier, Tier::kCpu);
                     EXPECT_TRUE(c.offload.optimizer.pin_memory);
                     EXPECT_EQ(c.offload.gradients.tier, Tier::kCpu);
                     EXPECT_EQ(c.precision.params, DType::kFp16);
                     EXPECT_TRUE(c.precision.loss_scale.dynamic);
                     EXPECT_EQ(c.precision.loss_scale.initial, 65536.0);
                     EXPECT_EQ(c.optimizer.type,
                               OptimizerType::kAdamW);  // Adam, adam_w_mode default true
                     EXPECT_EQ(c.optimizer.lr, 0.00015);
                     EXPECT_EQ(c.world.ranks, 8u);
                     EXPECT_EQ(c.model.micro_batch, 8u);  // 64 / (1 x 8)
                   },
                   {"overlap_comm", "contiguous_gradients", "hysteresis"}},
        // ZeRO-3 with optimizer and parameters on NVMe (ZeRO-Infinity).
        ImportCase{"zero3_nvme_infinity.json",
                   "--parameters 30B",
                   [](const Config& c) {
                     EXPECT_EQ(c.zero.stage, 3);
                     EXPECT_EQ(c.offload.optimizer.tier, Tier::kNvme);
                     EXPECT_EQ(c.offload.params.tier, Tier::kNvme);
                     EXPECT_EQ(c.tiers.nvme.paths, std::vector<std::string>{"/local_nvme"});
                     EXPECT_EQ(c.tiers.host.buffer_count, 5u);
                     EXPECT_EQ(c.tiers.host.buffer_size,
                               200003584u);  // 1e8 fp16 elements, 4 KiB multiple
                     EXPECT_EQ(c.tiers.nvme.block_size, 1048576u);
                     EXPECT_EQ(c.tiers.nvme.queue_depth, 8u);
                     EXPECT_EQ(c.tiers.nvme.io_threads, 1u);
                     EXPECT_EQ(c.zero.sub_group_size, 1'000'000'000u);
                     EXPECT_EQ(c.zero.reduce_bucket_size, 500'000'000u);
                     // stage3_max_live_parameters bounds live parameters, not a layer's size.
                     EXPECT_EQ(c.model.largest_layer, 0u);
                     EXPECT_EQ(c.optimizer.lr, 3e-5);
                     EXPECT_EQ(c.optimizer.weight_decay, 0.01);
                     EXPECT_EQ(c.optimizer.grad_clip, 1.0);
                     EXPECT_EQ(c.precision.loss_scale.growth_interval, 1000u);
                   },
                   {"fast_init", "max_in_cpu", "stage3_prefetch_bucket_size",
                    "stage3_max_live_parameters", "does not bound the parameters gathered",
                    "stage3_max_reuse_distance", "stage3_param_persistence_threshold",
                    "stage3_gather_16bit_weights_on_model_save", "world.ranks not given"}},
        // bf16, ZeRO-3, batch sizes that give the world size.
        ImportCase{"bf16_zero3.json",
                   "--parameters 70B",
                   [](const Config& c) {
                     EXPECT_EQ(c.precision.params, DType::kBf16);
                     EXPECT_EQ(c.precision.grads, DType::kBf16);
                     EXPECT_FALSE(c.precision.loss_scale.dynamic);
                     EXPECT_EQ(c.precision.loss_scale.initial, 1.0);
                     EXPECT_EQ(c.world.ranks, 8u);  // 512 / (4 x 16)
                     EXPECT_EQ(c.model.micro_batch, 4u);
                     EXPECT_EQ(c.optimizer.beta2, 0.95);
                     EXPECT_EQ(c.optimizer.weight_decay, 0.1);
                     EXPECT_EQ(c.train.accumulate, 16u);  // gradient_accumulation_steps
                     EXPECT_EQ(c.precision.grad_accum, DType::kFp32);  // data_types
                   },
                   {"steps_per_print", "wall_clock_breakdown"}},
        // fp16 with dynamic loss scaling, classic Adam (adam_w_mode false), a scheduler.
        ImportCase{"fp16_dynamic_zero1.json",
                   "--parameters 1.3B",
                   [](const Config& c) {
                     EXPECT_EQ(c.zero.stage, 1);
                     EXPECT_EQ(c.optimizer.type, OptimizerType::kAdam);
                     EXPECT_TRUE(c.precision.loss_scale.dynamic);
                     EXPECT_EQ(c.precision.loss_scale.initial, 4096.0);  // 2^12
                     EXPECT_EQ(c.precision.loss_scale.growth_interval, 500u);
                     EXPECT_EQ(c.precision.loss_scale.min_scale, 1.0);
                     EXPECT_EQ(c.zero.reduce_bucket_size, 200'000'000u);
                     EXPECT_EQ(c.world.ranks, 8u);  // 32 / 4, accumulation 1 assumed
                   },
                   {"scheduler", "allgather_bucket_size", "auto_cast", "consecutive_hysteresis",
                    "hysteresis: 2", "assuming gradient_accumulation_steps 1"}},
        // The HF Trainer's ZeRO-3 template, all "auto".
        ImportCase{
            "hf_trainer_zero3_auto.json",
            "--parameters 7B --hidden-size 4096 --ranks 4 --precision bf16",
            [](const Config& c) {
              EXPECT_EQ(c.precision.params, DType::kBf16);
              EXPECT_EQ(c.zero.reduce_bucket_size, 4096u * 4096u);
              EXPECT_EQ(c.optimizer.lr, 5e-5);
              EXPECT_EQ(c.optimizer.weight_decay, 0.0);
              EXPECT_EQ(c.optimizer.grad_clip, 1.0);
              EXPECT_EQ(c.model.micro_batch, 8u);
              EXPECT_EQ(c.world.ranks, 4u);
              EXPECT_EQ(c.offload.params.tier, Tier::kCpu);
              EXPECT_TRUE(c.offload.params.pin_memory);
              EXPECT_EQ(c.train.accumulate, 1u);  // "auto": the HF Trainer's default
              EXPECT_EQ(c.model.largest_layer, 0u);
            },
            {"\"auto\" resolved to 5e-05", "reduce_bucket_size \"auto\" resolved to 16777216",
             "gradient_clipping \"auto\" resolved to 1", "--precision",
             "fp16.loss_scale_window (1000) has no "
             "strata meaning: fp16 is not enabled"}},
        // The HF Trainer's ZeRO-3 template as the Trainer fills it (numbers, 1e9 written as
        // such) with fp16/bf16 still "auto" and no --precision (issue 24.6): bf16 where bf16 is
        // supported (this machine: no GPU visible, or GPUs of compute capability >= 8.0),
        // gradient_accumulation_steps -> train.accumulate, stage3_max_live_parameters and
        // stage3_prefetch_bucket_size reported as what strata does instead (no largest_layer).
        ImportCase{"hf_trainer_zero3_gas.json",
                   "--parameters 7B",
                   [](const Config& c) {
                     EXPECT_EQ(c.precision.params, DType::kBf16);
                     EXPECT_EQ(c.precision.grads, DType::kBf16);
                     EXPECT_FALSE(c.precision.loss_scaling());
                     EXPECT_EQ(c.train.accumulate, 4u);
                     EXPECT_EQ(c.world.ranks, 4u);  // 32 / (2 x 4)
                     EXPECT_EQ(c.model.micro_batch, 2u);
                     EXPECT_EQ(c.model.largest_layer, 0u);
                     EXPECT_EQ(c.zero.sub_group_size, 1'000'000'000u);
                     EXPECT_EQ(c.zero.reduce_bucket_size, 16777216u);
                   },
                   {"fp16.enabled and bf16.enabled \"auto\" resolved to bf16 (bf16 supported: ",
                    "--precision fp16|bf16|fp32", "stage3_max_live_parameters",
                    "does not bound the parameters gathered at once", "stage3_prefetch_bucket_size",
                    "not sized in elements"}},
        // Unknown keys and keys without a strata meaning, aio values strata rounds or does
        // differently.
        ImportCase{
            "unknown_keys_zero2.json",
            "--parameters 3B",
            [](const Config& c) {
              EXPECT_EQ(c.zero.stage, 2);
              EXPECT_EQ(c.offload.optimizer.fraction, 0.6);
              EXPECT_EQ(c.tiers.nvme.block_size, 303104u);  // 300000 rounded up to 4 KiB
              EXPECT_EQ(c.tiers.nvme.queue_depth, 16u);
              EXPECT_EQ(c.tiers.nvme.io_threads, 4u);
              EXPECT_EQ(c.precision.params, DType::kBf16);
              EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);
            },
            {"my_custom_setting", "zero_optimization.stagee3_max_live_parameters",
             "optimizer.params.max_coeff", "Lamb", "flops_profiler", "tensorboard",
             "activation_checkpointing", "comms_logger", "zero_hpz_partition_size",
             "round_robin_gradients", "single_submit", "overlap_events", "rounded up to 303104"}}),
    [](const ::testing::TestParamInfo<ImportCase>& i) {
      std::string n = i.param.file;
      return n.substr(0, n.find('.'));
    });

TEST(ImportDeepSpeedErrors, MalformedJsonNamesThePosition) {
  TempDir tmp("strata-import");
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(tmp.str() + "/" + name) << text;
    return tmp.str() + "/" + name;
  };
  struct Bad {
    std::string text, want;
  };
  const std::vector<Bad> bad{
      {"{\n  \"zero_optimization\": {\n    \"stage\": 3,\n  }\n}\n",
       "trailing.json:4:3: malformed JSON"},
      {"{\"fp16\": {\"enabled\": true,, }}", "trailing.json:1:27: malformed JSON"},
      {"{\"train_batch_size\": 8", "trailing.json:1:22: malformed JSON"},
      {"", "trailing.json:1:1: malformed JSON"},
      {std::string(100, '[') + std::string(100, ']'), "nested deeper than 64"},
      {"{\"fp16\": {}, \"fp16\": {}}", "fp16: duplicate key"},
      {"{\"zero_optimization\": {\"stage\": 4}}", "zero_optimization.stage: 4 is out of range"},
      {"{\"zero_optimization\": {\"stage\": \"3\"}}", "zero_optimization.stage: expected a number"},
      {"{\"fp16\": {\"enabled\": true}, \"bf16\": {\"enabled\": true}}",
       "fp16 and bf16 are both enabled"},
      {"{\"train_batch_size\": 30, \"train_micro_batch_size_per_gpu\": 4, "
       "\"gradient_accumulation_steps\": 2}",
       "not a multiple"},
      {"{\"zero_optimization\": {\"stage\": 1, \"offload_param\": {\"device\": \"cpu\"}}}",
       "not valid for strata"},
      {"[1, 2]", "not an object"},
      {"{\"bf16\": {\"enabled\": true}, \"data_types\": {\"grad_accum_dtype\": \"fp16\"}}",
       "data_types.grad_accum_dtype: gradients are bf16"},
      {"{\"data_types\": {\"grad_accum_dtype\": \"int8\"}}",
       "'int8' is not a dtype strata accumulates in"},
  };
  for (const auto& b : bad) {
    const std::string f = write("trailing.json", b.text);
    const CliRun r = run("import-deepspeed " + f);
    EXPECT_EQ(r.rc, 2) << b.text << "\n" << r.err;
    EXPECT_NE(r.err.find(b.want), std::string::npos) << b.text << "\n" << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
  EXPECT_EQ(run("import-deepspeed " + tmp.str() + "/missing.json").rc, 2);
  EXPECT_EQ(run("import-deepspeed " + tmp.str()).rc, 2);  // a directory
  // -o never replaces an existing file unless --overwrite.
  const std::string good = config_dir() + "zero2_cpu_offload.json";
  const std::string out = write("existing.yaml", "mine\n");
  CliRun r = run("import-deepspeed " + good + " -o " + out);
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--overwrite"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(out), "mine\n");
  EXPECT_EQ(run("import-deepspeed " + good + " -o " + out + " --overwrite").rc, 0);
  EXPECT_NE(slurp(out).find("zero_optimization.stage: 2"), std::string::npos);
}

// Issue 25.6: numbers a double cannot hold, values beyond the bounded parse's limits, and keys
// holding control characters are bad input (exit 2) with a position, not the JSON library's
// message (exit 1); nothing a terminal acts on reaches stderr.
TEST(ImportDeepSpeedErrors, NumberValueAndControlCharacterLimits) {
  TempDir tmp("strata-import-limits");
  auto write = [&](const std::string& text) {
    std::ofstream(tmp.str() + "/ds.json") << text;
    return tmp.str() + "/ds.json";
  };
  std::string many = "{\"x\": [";
  for (int i = 0; i < 70000; ++i) many += i ? ",0" : "0";
  many += "]}";
  struct Bad {
    std::string text, want;
  };
  const std::vector<Bad> bad{
      {"{\"optimizer\": {\"params\": {\"lr\": 1e400}}}",
       "ds.json:1:33: malformed JSON: the number 1e400 is out of the range"},
      {"{\"optimizer\": {\"params\": {\"lr\": -1e400}}}",
       "ds.json:1:33: malformed JSON: the number -1e400"},
      {"{\"train_batch_size\": " + std::string(100, '9') + "}",
       "ds.json:1:22: malformed JSON: a number of 100"},
      {many, "malformed JSON: more than 65536 values"},
      {"{\"\\u001b[2Jkey\\u0007\": 1, \"\\u001b[2Jkey\\u0007\": 2}", "duplicate key"},
      {"{\"zero_optimization\": {\"stage\": \"\\u001b]0;owned\\u0007\"}}",
       "zero_optimization.stage"},
  };
  for (const auto& b : bad) {
    const CliRun r = run("import-deepspeed " + write(b.text));
    EXPECT_EQ(r.rc, 2) << b.text.substr(0, 80) << "\n" << r.err;
    EXPECT_NE(r.err.find(b.want), std::string::npos) << b.text.substr(0, 80) << "\n" << r.err;
    EXPECT_LT(r.err.size(), 4096u) << r.err.substr(0, 200);
    for (char c : r.err)
      EXPECT_TRUE(c == '\n' || static_cast<unsigned char>(c) >= 0x20)
          << "control character in: " << r.err;
  }
}

// Issue 25.3: --overwrite replaces a regular file only; a FIFO or a device node at -o is refused
// (exit 2) and left as it was.
TEST(ImportDeepSpeedErrors, OverwriteRefusesFifoAndDevice) {
  TempDir tmp("strata-import-overwrite");
  const std::string good = config_dir() + "zero2_cpu_offload.json";
  const std::string fifo = tmp.str() + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  CliRun r = run("import-deepspeed " + good + " -o " + fifo + " --overwrite");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("is a FIFO; --overwrite replaces only a regular file"), std::string::npos)
      << r.err;
  struct stat st {};
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  // A character device like /dev/null (1, 3), made here when we may (root).
  const std::string dev = tmp.str() + "/null";
  if (::mknod(dev.c_str(), S_IFCHR | 0600, makedev(1, 3)) == 0) {
    r = run("import-deepspeed " + good + " -o " + dev + " --overwrite");
    EXPECT_EQ(r.rc, 2) << r.err;
    EXPECT_NE(r.err.find("is a character device"), std::string::npos) << r.err;
    ASSERT_EQ(::lstat(dev.c_str(), &st), 0);
    EXPECT_TRUE(S_ISCHR(st.st_mode));
  } else {
    std::printf("(no mknod here, errno %d: the device case is not run)\n", errno);
  }
  // Nothing left beside them.
  std::string names;
  for (const auto& e : std::filesystem::directory_iterator(tmp.path()))
    names += e.path().filename().string() + " ";
  EXPECT_TRUE(names == "fifo null " || names == "null fifo " || names == "fifo ") << names;
  // A regular file is still replaced.
  std::ofstream(tmp.str() + "/x.yaml") << "mine\n";
  EXPECT_EQ(run("import-deepspeed " + good + " -o " + tmp.str() + "/x.yaml --overwrite").rc, 0);
}

}  // namespace
}  // namespace strata::testing
