// DeepSpeed ds_config.json -> strata YAML (`strata import-deepspeed`, docs/config.md, "Importing a
// DeepSpeed config").
//
// Maps what has a strata meaning — zero_optimization.stage, offload_optimizer / offload_param
// (device, nvme_path, pin_memory, buffer_count, buffer_size, ratio), aio (block_size, queue_depth,
// thread_count; single_submit and overlap_events are compared with what strata does),
// sub_group_size, reduce_bucket_size, optimizer (type, lr, betas, eps,
// weight_decay, adam_w_mode), fp16 (enabled, loss_scale, initial_scale_power, loss_scale_window,
// hysteresis, min_loss_scale), bf16, gradient_clipping, gradient_accumulation_steps
// (train.accumulate) and the batch sizes — to YAML keys, each
// with a comment naming the DeepSpeed key (and value) it came from. Every other key, known to
// DeepSpeed or not, is listed in a warning with the reason (and at the end of the YAML), never
// dropped silently. "auto" values (the HF Trainer's) are resolved from the options (hidden size,
// ranks, precision, micro batch) or from the HF Trainer's defaults, and each resolution is
// reported. The result is checked with parse_config before it is returned.
//
// Failures: malformed JSON (Error kConfig: "FILE:LINE:COL: ..."), a duplicate key, a value of the
// wrong type or out of range, inconsistent batch sizes, fp16 and bf16 both enabled, a result that
// strata rejects: ConfigError / Error(kInvalidArgument) (exit code 2).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace strata::cli {

struct DsImportOptions {
  std::string source = "ds_config.json";     // file name for messages and the header comment
  std::optional<std::uint64_t> parameters;   // model.parameters (a DeepSpeed config has none)
  std::optional<std::uint64_t> hidden_size;  // resolves "auto" bucket sizes (HF: hidden^2)
  std::optional<std::uint32_t> ranks;        // world.ranks (else from the batch sizes)
  std::optional<std::uint32_t> micro_batch;  // resolves "auto" train_micro_batch_size_per_gpu
  std::string precision;                     // "", fp16, bf16, fp32: resolves fp16/bf16 "auto"
  // Without --precision, fp16/bf16 "auto" resolves as a Trainer run with mixed precision on this
  // hardware would: bf16 when bf16.enabled is "auto" and bf16 is supported, else fp16 when
  // fp16.enabled is "auto", else fp32. Supported: every CUDA GPU this process sees has compute
  // capability >= 8.0 (Ampere and later: what transformers' is_torch_bf16_gpu_available checks),
  // or none is visible (strata's build targets, sm_80 and sm_90, all run bf16). `bf16_why` says
  // which, for the warning.
  bool bf16_supported = true;
  std::string bf16_why = "no GPU visible here: strata's targets (sm_80, sm_90) run bf16";
};

struct DsImportResult {
  std::string yaml;
  std::vector<std::string> warnings;  // keys without a strata meaning, "auto" resolutions, notes
};

DsImportResult import_deepspeed(const std::string& json_text, const DsImportOptions& options);

}  // namespace strata::cli
