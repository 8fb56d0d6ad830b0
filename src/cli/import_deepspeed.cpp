// DeepSpeed config import (see import_deepspeed.hpp).
#include "cli/import_deepspeed.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "core/bounded_json.hpp"
#include "core/printable.hpp"
#include "strata/build_info.hpp"
#include "strata/config.hpp"
#include "strata/error.hpp"
#include "strata/units.hpp"

namespace strata::cli {
namespace {

using nlohmann::json;

constexpr int kMaxDepth = 64;

// HF Trainer defaults used for "auto" (transformers.TrainingArguments).
constexpr double kHfLr = 5e-5, kHfBeta1 = 0.9, kHfBeta2 = 0.999, kHfEps = 1e-8,
                 kHfWeightDecay = 0.0;
constexpr double kHfMaxGradNorm = 1.0;
constexpr std::uint64_t kHfMicroBatch = 8;
// DeepSpeed defaults.
constexpr std::uint64_t kDsReduceBucket = 500'000'000, kDsSubGroup = 1'000'000'000;

std::string fmt(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e15) return std::to_string(static_cast<long long>(v));
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}
std::string fmt(std::uint64_t v) { return std::to_string(v); }

// A key as a JSON-pointer token ("~" -> "~0", "/" -> "~1").
std::string esc(const std::string& k) {
  std::string out;
  for (char c : k)
    out += c == '~' ? std::string("~0") : c == '/' ? std::string("~1") : std::string(1, c);
  return out;
}

// For messages, warnings and YAML comments: the key's control characters escaped (printable()).
std::string dotted(const std::string& ptr) {
  std::string s = ptr.empty() ? "(top level)" : ptr.substr(1);
  std::replace(s.begin(), s.end(), '/', '.');
  return printable(s, 200);
}

std::string fmt(double v);
std::string summary(const json& v) {
  if (v.is_number_float()) return fmt(v.get<double>());
  std::string s = v.dump();
  return s.size() > 48 ? s.substr(0, 45) + "..." : s;
}

std::string yaml_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\')
      out += '\\', out += static_cast<char>(c);
    else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else
      out += static_cast<char>(c);
  }
  return out + "\"";
}

// The bounded parse (core/bounded_json.hpp): a DeepSpeed config is read as a YAML config is, at
// most 1 MiB, nested at most kMaxDepth deep, its numbers finite doubles, no duplicate keys
// (DeepSpeed's loader refuses them too).
json parse_json(const std::string& text, const std::string& source) {
  JsonLimits limits;
  limits.max_depth = kMaxDepth;
  return parse_bounded_json(text, source, limits);
}

class Importer {
 public:
  Importer(const json& root, const DsImportOptions& o) : root_(root), o_(o) {}

  DsImportResult run() {
    if (!root_.is_object())
      bad("", strcat("the top level is a JSON ", root_.type_name(), ", not an object"));
    model();
    precision();
    grad_accum();
    optimizer();
    batches();
    zero();
    aio();
    ignored();
    unknown("", root_);
    DsImportResult r;
    r.yaml = emit();
    r.warnings = warnings_;
    try {
      (void)parse_config(r.yaml, o_.source + " (imported)");
    } catch (const ConfigError& e) {
      fail(ErrorCode::kInvalidArgument,
           strcat(o_.source, ": the imported configuration is not valid for strata: ", e.what()));
    }
    return r;
  }

 private:
  struct Entry {
    std::string value, comment;
  };

  // ---- reading the JSON ----
  const json* find(const std::string& ptr) {
    const json::json_pointer p(ptr);
    if (!root_.contains(p)) return nullptr;
    consumed_.insert(ptr);
    return &root_.at(p);
  }
  const json* section(const std::string& ptr) {
    const json* s = find(ptr);
    if (s && !s->is_object()) bad(ptr, strcat("expected an object, got ", s->type_name()));
    return s;
  }
  [[noreturn]] void bad(const std::string& ptr, const std::string& what) const {
    throw ConfigError(o_.source, 0, 0, ptr.empty() ? "" : dotted(ptr), what);
  }
  static bool is_auto(const json& v) { return v.is_string() && v.get<std::string>() == "auto"; }
  double number(const std::string& ptr, const json& v, double lo, double hi) const {
    if (!v.is_number()) bad(ptr, strcat("expected a number, got ", summary(v)));
    const double x = v.get<double>();
    if (!std::isfinite(x) || x < lo || x > hi)
      bad(ptr, strcat(fmt(x), " is out of range [", fmt(lo), ", ", fmt(hi), "]"));
    return x;
  }
  std::uint64_t count(const std::string& ptr, const json& v, std::uint64_t lo,
                      std::uint64_t hi) const {
    const double x = number(ptr, v, static_cast<double>(lo), static_cast<double>(hi));
    if (x != std::floor(x)) bad(ptr, strcat(fmt(x), " is not a whole number"));
    return static_cast<std::uint64_t>(x);
  }
  bool boolean(const std::string& ptr, const json& v) const {
    if (!v.is_boolean()) bad(ptr, strcat("expected true or false, got ", summary(v)));
    return v.get<bool>();
  }
  std::string string(const std::string& ptr, const json& v) const {
    if (!v.is_string()) bad(ptr, strcat("expected a string, got ", summary(v)));
    return v.get<std::string>();
  }
  // A key with no strata meaning: consumed (with its subtree) and listed.
  void ignore(const std::string& ptr, const std::string& reason) {
    const json::json_pointer p(ptr);
    if (!root_.contains(p)) return;
    subtree_.insert(ptr);
    warn(strcat(dotted(ptr), " (", summary(root_.at(p)), ") has no strata meaning: ", reason));
  }
  // The keys of `section` (at pointer `prefix`) not read yet that `reasons` names: ignored, each
  // with its reason.
  void ignore_known(const json& section, const std::string& prefix,
                    const std::map<std::string, std::string>& reasons) {
    for (auto& [k, v] : section.items()) {
      const std::string p = prefix + esc(k);
      if (consumed_.count(p) || subtree_.count(p)) continue;
      auto it = reasons.find(k);
      if (it != reasons.end()) ignore(p, it->second);
    }
  }
  // `yaml` from the value `v` at `ptr`: "auto" resolves to `resolved` (`why`: whose default),
  // noted and warned about (`hint` appended to the warning); any other value is `read(v)`.
  template <typename Read>
  void set_resolving_auto(const std::string& yaml, const std::string& ptr, const json& v,
                          const std::string& resolved, const std::string& why,
                          const std::string& hint, Read&& read) {
    if (is_auto(v)) {
      set(yaml, resolved, strcat(dotted(ptr), ": \"auto\" -> ", resolved, " (", why, ")"));
      warn(strcat(dotted(ptr), " \"auto\" resolved to ", resolved, " (", why, ")", hint));
      return;
    }
    set(yaml, read(v), src(ptr, v));
  }
  void warn(const std::string& w) { warnings_.push_back(w); }
  void set(const std::string& path, const std::string& value, const std::string& comment) {
    entries_[path] = {value, comment};
  }
  std::string src(const std::string& ptr, const json& v) const {
    return strcat(dotted(ptr), ": ", summary(v));
  }

  // ---- the mappings ----
  void model() {
    if (o_.parameters) {
      set("model.parameters", fmt(*o_.parameters),
          "--parameters (a DeepSpeed config does not say the model size)");
    } else {
      set("model.parameters", "1B",
          "PLACEHOLDER: a DeepSpeed config does not say the model size; set it (--parameters)");
      warn(
          "model.parameters is a placeholder (1B): a DeepSpeed config does not say the model size; "
          "pass "
          "--parameters or edit the YAML before trusting `strata plan`");
    }
  }

  // fp16 enabled: the model dtype and DeepSpeed's loss-scale settings (and its defaults).
  void precision_fp16(bool from_auto) {
    const std::string c = from_auto ? "fp16.enabled: \"auto\" -> fp16" : "fp16.enabled: true";
    set("precision.params", "fp16", c);
    set("precision.grads", "fp16", c);
    double ls = 0;
    if (const json* v = find("/fp16/loss_scale"); v && !is_auto(*v))
      ls = number("/fp16/loss_scale", *v, 0, 1e30);
    if (ls == 0) {
      set("precision.loss_scale.dynamic", "true",
          find("/fp16/loss_scale") ? "fp16.loss_scale: 0 (dynamic)"
                                   : "fp16: dynamic loss scaling (DeepSpeed's default)");
      std::uint64_t power = 16;
      std::string pc = "fp16.initial_scale_power: 16 (DeepSpeed's default) -> 2^16";
      if (const json* v = find("/fp16/initial_scale_power"); v && !is_auto(*v)) {
        power = count("/fp16/initial_scale_power", *v, 0, 100);
        pc = strcat("fp16.initial_scale_power: ", power, " -> 2^", power);
      }
      set("precision.loss_scale.initial", fmt(std::ldexp(1.0, static_cast<int>(power))), pc);
    } else {
      set("precision.loss_scale.dynamic", "false",
          strcat("fp16.loss_scale: ", fmt(ls), " (static)"));
      set("precision.loss_scale.initial", fmt(ls), strcat("fp16.loss_scale: ", fmt(ls)));
    }
    if (const json* v = find("/fp16/loss_scale_window"); v && !is_auto(*v))
      set("precision.loss_scale.growth_interval",
          fmt(count("/fp16/loss_scale_window", *v, 1, 1u << 31)),
          src("/fp16/loss_scale_window", *v));
    else
      set("precision.loss_scale.growth_interval", "1000",
          "fp16.loss_scale_window: 1000 (DeepSpeed's default)");
    set("precision.loss_scale.growth_factor", "2", "DeepSpeed's fixed factor");
    set("precision.loss_scale.backoff_factor", "0.5", "DeepSpeed's fixed factor");
    if (const json* v = find("/fp16/min_loss_scale"); v && !is_auto(*v))
      set("precision.loss_scale.min_scale", fmt(number("/fp16/min_loss_scale", *v, 1e-30, 1e30)),
          src("/fp16/min_loss_scale", *v));
    else
      set("precision.loss_scale.min_scale", "1", "fp16.min_loss_scale: 1 (DeepSpeed's default)");
    std::uint64_t hysteresis = 2;
    if (const json* v = find("/fp16/hysteresis"); v && !is_auto(*v))
      hysteresis = count("/fp16/hysteresis", *v, 0, 1u << 31);
    if (hysteresis > 1)
      warn(strcat("fp16.hysteresis: ", hysteresis,
                  hysteresis == 2 && !find("/fp16/hysteresis") ? " (DeepSpeed's default)" : "",
                  ": strata backs the loss scale off at the first overflow (hysteresis 1), "
                  "DeepSpeed after ",
                  hysteresis, " consecutive ones"));
    ignore("/fp16/consecutive_hysteresis", "strata backs off at every overflow");
    ignore("/fp16/auto_cast", "strata does not run the model's forward pass");
    ignore("/fp16/fp16_master_weights_and_grads", "strata keeps FP32 master weights");
  }

  // fp16/bf16 "enabled": "auto" (f, b: -1) -> 0 or 1: --precision, else bf16 where the template
  // allows it and bf16 is supported, else fp16 where it allows that, else fp32
  // (import_deepspeed.hpp).
  void resolve_auto_precision(int& f, int& b, const std::string& bkey) {
    const std::string keys = f < 0 && b < 0 ? strcat("fp16.enabled and ", bkey, ".enabled")
                             : f < 0        ? std::string("fp16.enabled")
                                            : strcat(bkey, ".enabled");
    std::string p = o_.precision, why = "--precision";
    if (p.empty()) {
      if (b < 0 && o_.bf16_supported) {
        p = "bf16";
        why = strcat("bf16 supported: ", o_.bf16_why);
      } else if (f < 0) {
        p = "fp16";
        why = b < 0 ? strcat("bf16 not supported: ", o_.bf16_why) : "fp16 is the one \"auto\"";
      } else {
        p = "fp32";
        why = strcat("bf16 not supported: ", o_.bf16_why);
      }
      why += "; pass --precision fp16|bf16|fp32 to choose";
    }
    warn(strcat(keys, " \"auto\" resolved to ", p, " (", why, ")"));
    if (f < 0) f = p == "fp16";
    if (b < 0) b = p == "bf16";
  }

  void precision() {
    const json* fp16 = section("/fp16");
    const json* bf16 = section("/bf16");
    std::string bptr = "/bf16";
    if (!bf16) {
      bf16 = section("/bfloat16");
      bptr = "/bfloat16";
    }
    // 1 enabled, 0 not, -1 "auto".
    auto enabled = [&](const json* sec, const std::string& ptr) -> int {
      if (!sec) return 0;
      const json* e = find(ptr + "/enabled");
      if (!e) return 0;  // DeepSpeed's default
      if (is_auto(*e)) return -1;
      return boolean(ptr + "/enabled", *e) ? 1 : 0;
    };
    int f = enabled(fp16, "/fp16"), b = enabled(bf16, bptr);
    const bool f_auto = f < 0, b_auto = b < 0;
    std::string why_f = fp16 && find("/fp16/enabled")
                            ? src("/fp16/enabled", root_.at(json::json_pointer("/fp16/enabled")))
                            : "";
    if (f < 0 || b < 0) resolve_auto_precision(f, b, dotted(bptr));
    if (f && b) bad(bptr + "/enabled", "fp16 and bf16 are both enabled");
    if (f) {
      precision_fp16(f_auto);
    } else if (b) {
      const std::string c =
          strcat(dotted(bptr), b_auto ? ".enabled: \"auto\" -> bf16" : ".enabled: true");
      set("precision.params", "bf16", c);
      set("precision.grads", "bf16", c);
      set("precision.loss_scale.dynamic", "false", "bf16: no loss scaling (as DeepSpeed)");
      set("precision.loss_scale.initial", "1", "bf16: no loss scaling (as DeepSpeed)");
    } else {
      const std::string c = why_f.empty() ? "neither fp16 nor bf16 enabled: FP32 training"
                                          : why_f + " (FP32 training)";
      set("precision.params", "fp32", c);
      set("precision.grads", "fp32", c);
    }
    // The keys of a section that is not enabled do not apply.
    for (const auto& [sec, ptr, on] :
         {std::tuple{fp16, std::string("/fp16"), f}, std::tuple{bf16, bptr, b}}) {
      if (!sec) continue;
      for (auto& [k, v] : sec->items()) {
        const std::string p = ptr + "/" + esc(k);
        if (consumed_.count(p) || subtree_.count(p)) continue;
        if (!on) ignore(p, strcat(dotted(ptr), " is not enabled"));
      }
    }
    if (b) {
      ignore(bptr + "/immediate_grad_update", "strata reduces and applies gradients at step()");
      ignore(bptr + "/check_grad_overflow", "strata checks every step for inf/NaN");
    }
  }

  // data_types.grad_accum_dtype -> precision.grad_accum (DeepSpeed's DtypeEnum names). strata holds
  // 16-bit gradients in their own dtype or in fp32; another 16-bit dtype is refused.
  void grad_accum() {
    const std::string ptr = "/data_types/grad_accum_dtype";
    (void)section("/data_types");
    const json* v = find(ptr);
    if (!v || v->is_null()) return;
    const std::string name = string(ptr, *v);
    static const std::map<std::string, std::string> names{
        {"fp32", "fp32"}, {"float32", "fp32"},  {"float", "fp32"},  {"torch.float32", "fp32"},
        {"fp16", "fp16"}, {"float16", "fp16"},  {"half", "fp16"},   {"torch.float16", "fp16"},
        {"bf16", "bf16"}, {"bfloat16", "bf16"}, {"bfloat", "bf16"}, {"torch.bfloat16", "bf16"}};
    const auto it = names.find(name);
    if (it == names.end())
      bad(ptr, strcat("'", name, "' is not a dtype strata accumulates in (fp32, fp16, bf16)"));
    const std::string grads = entries_.at("precision.grads").value;
    if (it->second != grads && it->second != "fp32")
      bad(ptr,
          strcat("gradients are ", grads, " (", entries_.at("precision.grads").comment,
                 "): strata accumulates them in ",
                 grads == "fp32" ? std::string("fp32") : grads + " or fp32", ", not ", it->second));
    set("precision.grad_accum", it->second, src(ptr, *v));
  }

  void optimizer() {
    if (const json* v = find("/gradient_clipping")) {
      set_resolving_auto("optimizer.grad_clip", "/gradient_clipping", *v, fmt(kHfMaxGradNorm),
                         "the HF Trainer's default max_grad_norm", "", [&](const json& x) {
                           return fmt(number("/gradient_clipping", x, 0, 1e30));
                         });
    }
    const json* opt = section("/optimizer");
    if (!opt) {
      warn(
          "no optimizer section: strata's defaults (adamw, lr 1e-4, ...) apply; DeepSpeed would "
          "use the "
          "client's optimizer");
      return;
    }
    std::string type = "adamw";
    std::string tc = "optimizer: no type (adamw)";
    const json* params = section("/optimizer/params");
    bool adam_w_mode = true;
    std::string awc = "adam_w_mode: true (DeepSpeed's default)";
    if (params) {
      if (const json* v = find("/optimizer/params/adam_w_mode")) {
        adam_w_mode = boolean("/optimizer/params/adam_w_mode", *v);
        awc = strcat("optimizer.params.adam_w_mode: ", adam_w_mode);
      }
    }
    if (const json* t = find("/optimizer/type")) {
      const std::string name = printable(string("/optimizer/type", *t), 200);  // quoted in comments
      std::string lower = name;
      std::transform(lower.begin(), lower.end(), lower.begin(),
                     [](unsigned char c) { return std::tolower(c); });
      if (lower == "adam" || lower == "fusedadam" || lower == "cpuadam" ||
          lower == "deepspeedcpuadam") {
        type = adam_w_mode ? "adamw" : "adam";
        tc = strcat("optimizer.type: ", name, " with ", awc);
      } else if (lower == "adamw") {
        type = "adamw";
        tc = strcat("optimizer.type: ", name);
        if (!adam_w_mode)
          warn(
              "optimizer.params.adam_w_mode: false is ignored with type AdamW (DeepSpeed ignores "
              "it too)");
      } else {
        tc = strcat("optimizer.type: ", name, " has no strata equivalent: imported as adamw");
        warn(strcat("optimizer.type '", name,
                    "' has no strata equivalent (strata runs Adam / AdamW with two FP32 "
                    "moments): imported as adamw; the optimizer state and its size may differ from "
                    "DeepSpeed's"));
      }
    }
    set("optimizer.type", type, tc);
    if (!params) return;
    optimizer_params();
  }

  // optimizer.params: lr, eps, weight decay, betas ("auto" as the HF Trainer), and what strata
  // does not support.
  void optimizer_params() {
    auto value = [&](const char* key, double hf, double lo, double hi, const char* yaml) {
      const std::string ptr = strcat("/optimizer/params/", key);
      const json* v = find(ptr);
      if (!v) return;
      set_resolving_auto(yaml, ptr, *v, fmt(hf), "the HF Trainer's default",
                         strcat("; edit ", yaml, " if your run sets it"),
                         [&](const json& x) { return fmt(number(ptr, x, lo, hi)); });
    };
    value("lr", kHfLr, 0, 1e6, "optimizer.lr");
    value("eps", kHfEps, 1e-300, 1, "optimizer.eps");
    value("weight_decay", kHfWeightDecay, 0, 1e6, "optimizer.weight_decay");
    if (const json* v = find("/optimizer/params/betas")) {
      if (is_auto(*v)) {
        set("optimizer.betas", strcat("[", fmt(kHfBeta1), ", ", fmt(kHfBeta2), "]"),
            "optimizer.params.betas: \"auto\" -> the HF Trainer's default");
        warn("optimizer.params.betas \"auto\" resolved to [0.9, 0.999] (the HF Trainer's default)");
      } else {
        if (!v->is_array() || v->size() != 2)
          bad("/optimizer/params/betas", "expected [beta1, beta2]");
        const double b1 = number("/optimizer/params/betas", (*v)[0], 0, 1);
        const double b2 = number("/optimizer/params/betas", (*v)[1], 0, 1);
        set("optimizer.betas", strcat("[", fmt(b1), ", ", fmt(b2), "]"),
            src("/optimizer/params/betas", *v));
      }
    }
    if (const json* v = find("/optimizer/params/bias_correction");
        v && !boolean("/optimizer/params/bias_correction", *v))
      warn(
          "optimizer.params.bias_correction: false is not supported: strata's Adam always corrects "
          "the bias");
    if (const json* v = find("/optimizer/params/amsgrad");
        v && boolean("/optimizer/params/amsgrad", *v))
      warn("optimizer.params.amsgrad: true is not supported: strata runs plain Adam / AdamW");
    ignore("/optimizer/params/torch_adam",
           "strata runs its own CPU (SIMD) or CUDA Adam (optimizer.update)");
    ignore("/optimizer/params/fp32_optimizer_states",
           "strata keeps the optimizer state in FP32 always");
  }

  // train_batch_size given: the one of micro batch, accumulation steps and ranks not given (or
  // all checked against it when every one is).
  void batches_from_total(std::uint64_t total, std::optional<std::uint64_t>& micro,
                          std::optional<std::uint64_t>& gas, std::optional<std::uint64_t>& ranks,
                          std::string& mc, std::string& rc) {
    const std::optional<std::uint64_t> tbs = total;
    if (micro && gas) {
      const std::uint64_t per = *micro * *gas;
      if (ranks && per * *ranks != *tbs)
        bad("/train_batch_size",
            strcat(*tbs, " != train_micro_batch_size_per_gpu ", *micro,
                   " x gradient_accumulation_steps ", *gas, " x ", *ranks, " ranks"));
      if (!ranks) {
        if (*tbs % per != 0)
          bad("/train_batch_size",
              strcat(*tbs, " is not a multiple of train_micro_batch_size_per_gpu ", *micro,
                     " x gradient_accumulation_steps ", *gas));
        ranks = *tbs / per;
        rc = strcat("train_batch_size ", *tbs, " / (micro ", *micro,
                    " x gradient_accumulation_steps ", *gas, ")");
      }
    } else if (micro) {
      if (!ranks) {
        gas = 1;
        if (*tbs % *micro != 0)
          bad("/train_batch_size", strcat(*tbs, " is not a multiple of the micro batch ", *micro));
        ranks = *tbs / *micro;
        rc = strcat("train_batch_size ", *tbs, " / micro ", *micro,
                    " (gradient_accumulation_steps 1 assumed)");
        warn(strcat("world.ranks ", *ranks,
                    " derived assuming gradient_accumulation_steps 1; pass --ranks if not"));
      } else {
        if (*tbs % (*micro * *ranks) != 0)
          bad("/train_batch_size",
              strcat(*tbs, " is not a multiple of micro ", *micro, " x ", *ranks, " ranks"));
        gas = *tbs / (*micro * *ranks);
      }
    } else {
      const std::uint64_t g = gas ? *gas : 1, r = ranks ? *ranks : 1;
      if (*tbs % (g * r) != 0)
        bad("/train_batch_size", strcat(*tbs, " is not a multiple of gradient_accumulation_steps ",
                                        g, " x ", r, " ranks"));
      micro = *tbs / (g * r);
      mc = strcat("train_batch_size ", *tbs, " / (gradient_accumulation_steps ", g, " x ", r,
                  " ranks)");
      if (!ranks) {
        ranks = 1;
        rc = "train_batch_size alone does not say the world size: 1 assumed";
        warn(
            "world.ranks 1 assumed: train_batch_size alone does not say the world size; pass "
            "--ranks");
      }
    }
  }

  void batches() {
    // DeepSpeed: train_batch_size = micro x gradient_accumulation_steps x world.
    auto get = [&](const char* key, std::optional<std::uint64_t>& out, bool& is_auto_value) {
      const std::string ptr = strcat("/", key);
      if (const json* v = find(ptr)) {
        if (is_auto(*v))
          is_auto_value = true;
        else
          out = count(ptr, *v, 1, 1ull << 40);
      }
    };
    std::optional<std::uint64_t> tbs, micro, gas;
    bool tbs_auto = false, micro_auto = false, gas_auto = false;
    get("train_batch_size", tbs, tbs_auto);
    get("train_micro_batch_size_per_gpu", micro, micro_auto);
    get("gradient_accumulation_steps", gas, gas_auto);
    std::string mc;
    if (micro_auto) {
      micro = o_.micro_batch ? *o_.micro_batch : kHfMicroBatch;
      mc = strcat("train_micro_batch_size_per_gpu: \"auto\" -> ", *micro,
                  o_.micro_batch ? " (--micro-batch)" : " (the HF Trainer's default)");
      if (!o_.micro_batch)
        warn(strcat("train_micro_batch_size_per_gpu \"auto\" resolved to ", *micro,
                    " (the HF Trainer's default per_device_train_batch_size); pass --micro-batch"));
    }
    if (gas_auto) {
      gas = 1;
      warn("gradient_accumulation_steps \"auto\" resolved to 1 (the HF Trainer's default)");
    }
    std::optional<std::uint64_t> ranks;
    std::string rc;
    if (o_.ranks) {
      ranks = *o_.ranks;
      rc = "--ranks";
    }
    if (tbs) {
      batches_from_total(*tbs, micro, gas, ranks, mc, rc);
    } else if (tbs_auto && micro) {
      warn(
          "train_batch_size \"auto\": DeepSpeed computes it as micro x gradient_accumulation_steps "
          "x world size");
    }
    if (!ranks)
      warn(
          "world.ranks not given and not derivable from the batch sizes (train_batch_size): "
          "strata's default 1; "
          "pass --ranks");
    if (micro)
      set("model.micro_batch", fmt(*micro),
          mc.empty()
              ? src("/train_micro_batch_size_per_gpu", *find("/train_micro_batch_size_per_gpu"))
              : mc);
    if (ranks) set("world.ranks", fmt(*ranks), rc);
    // (gas may hold the 1 batches_from_total assumed for a config without the key: no key then.)
    if (const json* v = find("/gradient_accumulation_steps"); gas && (v || gas_auto))
      set("train.accumulate", fmt(*gas),
          gas_auto ? "gradient_accumulation_steps: \"auto\" -> 1 (the HF Trainer's default)"
                   : src("/gradient_accumulation_steps", *v) +
                         " (strata train's micro-batches per step; a torch loop keeps its own)");
  }

  void offload(const char* kind, const std::string& ptr, int stage, std::set<std::string>& paths,
               std::uint64_t& buffers, std::string& buffers_from, std::uint64_t& buffer_bytes,
               std::string& bytes_from) {
    const json* sec = section(ptr);
    if (!sec) return;
    std::string device = "none";
    if (const json* d = find(ptr + "/device")) device = string(ptr + "/device", *d);
    if (device != "cpu" && device != "nvme" && device != "none")
      bad(ptr + "/device", strcat("'", device, "' is not cpu, nvme or none"));
    const std::string yaml = strcat("offload.", kind);
    if (device == "none") {
      for (auto& [k, v] : sec->items())
        if (k != "device") ignore(ptr + "/" + esc(k), "the offload device is none");
      return;
    }
    set(yaml + ".tier", device, strcat(dotted(ptr), ".device: ", device));
    if (const json* r = find(ptr + "/ratio")) {
      set(yaml + ".fraction", fmt(number(ptr + "/ratio", *r, 0, 1)), src(ptr + "/ratio", *r));
    }
    if (const json* pm = find(ptr + "/pin_memory")) {
      const bool pin = boolean(ptr + "/pin_memory", *pm);
      if (device == "cpu")
        set(yaml + ".pin_memory", pin ? "true" : "false", src(ptr + "/pin_memory", *pm));
      else if (!pin)
        warn(strcat(dotted(ptr),
                    ".pin_memory: false: strata's NVMe swap buffers are always page-locked"));
    }
    if (const json* p = find(ptr + "/nvme_path")) {
      const std::string path = string(ptr + "/nvme_path", *p);
      if (device == "nvme")
        paths.insert(path);
      else
        warn(strcat(dotted(ptr), ".nvme_path is not used with device cpu"));
    }
    if (const json* bc = find(ptr + "/buffer_count")) {
      const std::uint64_t n = count(ptr + "/buffer_count", *bc, 1, 4096);
      if (device == "nvme") {
        if (n > buffers) buffers = n;
        buffers_from += (buffers_from.empty() ? "" : ", ") + src(ptr + "/buffer_count", *bc);
      } else {
        warn(strcat(dotted(ptr), ".buffer_count is used for nvme offload only"));
      }
    }
    if (const json* bs = find(ptr + "/buffer_size")) {
      // DeepSpeed counts parameters (elements); strata's buffers are bytes.
      const std::uint64_t elems = count(ptr + "/buffer_size", *bs, 1, 1ull << 40);
      const std::uint64_t pb = params_bytes();
      const std::uint64_t bytes = (elems * pb + 4095) / 4096 * 4096;
      if (device == "nvme") {
        buffer_bytes = std::max(buffer_bytes, bytes);
        bytes_from =
            strcat(src(ptr + "/buffer_size", *bs), " elements x ", pb, " B, rounded to 4 KiB");
      } else {
        warn(strcat(dotted(ptr), ".buffer_size is used for nvme offload only"));
      }
    }
    ignore(ptr + "/fast_init", "strata initialises its swap space once, at start-up");
    ignore(ptr + "/max_in_cpu", "strata keeps no host cache of NVMe-offloaded parameters");
    for (auto& [k, v] : sec->items()) {
      const std::string p = ptr + "/" + esc(k);
      if (!consumed_.count(p) && !subtree_.count(p))
        ignore(p, "not a key strata knows in this section");
    }
    (void)stage;
  }

  std::uint64_t params_bytes() const {
    auto it = entries_.find("precision.params");
    if (it == entries_.end()) return 2;
    return it->second.value == "fp32" ? 4 : 2;
  }

  void zero() {
    const json* z = section("/zero_optimization");
    if (!z) {
      set("zero.stage", "0",
          "no zero_optimization section: DeepSpeed's default stage 0 (plain data parallel)");
      return;
    }
    int stage = 0;
    if (const json* s = find("/zero_optimization/stage")) {
      stage = static_cast<int>(count("/zero_optimization/stage", *s, 0, 3));
      set("zero.stage", fmt(static_cast<std::uint64_t>(stage)),
          src("/zero_optimization/stage", *s));
    } else {
      set("zero.stage", "0", "zero_optimization.stage not given: DeepSpeed's default 0");
    }
    zero_sizes();
    zero_live_parameters(stage);
    zero_offload(stage);
    zero_ignored(*z);
  }

  // zero_optimization.sub_group_size and reduce_bucket_size ("auto" resolved as DeepSpeed / HF).
  void zero_sizes() {
    if (const json* v = find("/zero_optimization/sub_group_size")) {
      set_resolving_auto("zero.sub_group_size", "/zero_optimization/sub_group_size", *v,
                         fmt(kDsSubGroup), "DeepSpeed's default", "", [&](const json& x) {
                           return fmt(count("/zero_optimization/sub_group_size", x, 1, 1ull << 50));
                         });
    }
    if (const json* v = find("/zero_optimization/reduce_bucket_size")) {
      const auto h = o_.hidden_size;
      set_resolving_auto(
          "zero.reduce_bucket_size", "/zero_optimization/reduce_bucket_size", *v,
          h ? fmt(*h * *h) : fmt(kDsReduceBucket),
          h ? strcat("hidden_size^2 = ", *h, "^2, as the HF Trainer does") : "DeepSpeed's default",
          h ? "" : "; pass --hidden-size for the HF Trainer's hidden_size^2", [&](const json& x) {
            return fmt(count("/zero_optimization/reduce_bucket_size", x, 1, 1ull << 50));
          });
    }
  }

  // stage3_max_live_parameters: DeepSpeed's bound on the parameters gathered at once (it frees
  // gathered ones early to stay below it). strata has no such bound: what is gathered at once is
  // the loop's current gather call and the next one, prefetched (the plan counts 2 x
  // model.largest_layer). Not mapped (it is no layer size), said with the value.
  void zero_live_parameters(int stage) {
    const std::string ptr = "/zero_optimization/stage3_max_live_parameters";
    if (const json* v = find(ptr)) {
      if (stage == 3 && !is_auto(*v)) (void)count(ptr, *v, 0, 1ull << 50);
      ignore(ptr,
             stage == 3
                 ? "strata does not bound the parameters gathered at once: a stage-3 loop holds "
                   "its current gather call's tensors and the next call's, prefetched (the "
                   "plan counts 2 x model.largest_layer: set model.largest_layer to your "
                   "largest layer's parameter count)"
                 : "only meaningful at stage 3");
    }
  }

  // Offload: optimizer state, parameters (and the legacy ZeRO-Offload switches).
  void zero_offload(int stage) {
    std::set<std::string> paths;
    std::uint64_t buffers = 0, buffer_bytes = 0;
    std::string buffers_from, bytes_from;
    offload("optimizer", "/zero_optimization/offload_optimizer", stage, paths, buffers,
            buffers_from, buffer_bytes, bytes_from);
    offload("params", "/zero_optimization/offload_param", stage, paths, buffers, buffers_from,
            buffer_bytes, bytes_from);
    if (const json* v = find("/zero_optimization/cpu_offload");
        v && boolean("/zero_optimization/cpu_offload", *v) &&
        !entries_.count("offload.optimizer.tier"))
      set("offload.optimizer.tier", "cpu",
          "zero_optimization.cpu_offload: true (legacy ZeRO-Offload switch)");
    if (const json* v = find("/zero_optimization/cpu_offload_params");
        v && boolean("/zero_optimization/cpu_offload_params", *v) &&
        !entries_.count("offload.params.tier"))
      set("offload.params.tier", "cpu",
          "zero_optimization.cpu_offload_params: true (legacy switch)");
    if (const json* v = find("/zero_optimization/cpu_offload_use_pin_memory"); v) {
      const bool pin = boolean("/zero_optimization/cpu_offload_use_pin_memory", *v);
      for (const char* k : {"optimizer", "params"})
        if (entries_.count(strcat("offload.", k, ".tier")) &&
            entries_[strcat("offload.", k, ".tier")].value == "cpu")
          set(strcat("offload.", k, ".pin_memory"), pin ? "true" : "false",
              src("/zero_optimization/cpu_offload_use_pin_memory", *v));
    }
    auto opt = entries_.find("offload.optimizer.tier");
    if (stage >= 2 && opt != entries_.end() && opt->second.value != "gpu")
      set("offload.gradients.tier", "cpu",
          strcat("zero_optimization.offload_optimizer.device: ", opt->second.value,
                 ": DeepSpeed (ZeRO-Offload) keeps the gradient partition in host memory"));
    if (!paths.empty()) {
      std::string list = "[";
      for (const auto& p : paths) list += (list.size() > 1 ? ", " : "") + yaml_string(p);
      set("tiers.nvme.paths", list + "]", "zero_optimization.offload_*.nvme_path");
    }
    if (buffers)
      set("tiers.host.buffer_count", fmt(buffers),
          buffers_from + " (one pool per rank: the larger)");
    if (buffer_bytes) set("tiers.host.buffer_size", format_bytes_exact(buffer_bytes), bytes_from);
  }

  // The rest of zero_optimization: keys strata has no use for, each with the reason.
  void zero_ignored(const json& zsec) {
    const std::map<std::string, std::string> reasons{
        {"allgather_partitions",
         "strata all-gathers the updated parameters after every step (stages 1-2)"},
        {"allgather_bucket_size", "strata all-gathers each partition in one collective"},
        {"overlap_comm",
         "strata always overlaps the gradient reduce-scatter with the backward pass (stages 2-3)"},
        {"reduce_scatter", "strata always reduce-scatters gradients at stages 1-3"},
        {"contiguous_gradients", "strata's gradient partition is always contiguous"},
        {"load_from_fp32_weights", "strata checkpoints always hold the FP32 master weights"},
        {"elastic_checkpoint", "strata checkpoints load into any world size (resharding)"},
        {"round_robin_gradients", "strata partitions the flat gradient space contiguously"},
        {"stage3_max_reuse_distance", "strata releases what the loop releases (gather/release)"},
        {"stage3_prefetch_bucket_size",
         "strata's prefetch is not sized in elements: it prefetches exactly the next gather "
         "call's tensors (the order replayed from the first step), whatever their size; there is "
         "no setting for it"},
        {"stage3_param_persistence_threshold", "strata partitions every tensor at stage 3"},
        {"stage3_gather_16bit_weights_on_model_save",
         "use `strata checkpoint export DIR --out model.safetensors --dtype fp16|bf16` for "
         "consolidated weights"},
        {"stage3_gather_fp16_weights_on_model_save",
         "use `strata checkpoint export DIR --out model.safetensors --dtype fp16` for consolidated "
         "weights"},
        {"ignore_unused_parameters",
         "a parameter no rank has a gradient for is skipped for the step when the loop says so "
         "(Engine::skip_gradient; strata.torch does it for every parameter its backward left "
         "out, warning once unless unused_parameters='ignore')"},
        {"legacy_stage1", "strata has one stage-1 implementation"},
        {"zero_hpz_partition_size", "strata has no hierarchical partitioning (ZeRO++)"},
        {"zero_quantized_weights", "strata does not quantize communication (ZeRO++)"},
        {"zero_quantized_gradients", "strata does not quantize communication (ZeRO++)"},
        {"mics_shard_size", "strata has no MiCS sharding"},
        {"mics_hierarchical_params_gather", "strata has no MiCS sharding"},
        {"memory_efficient_linear", "strata does not run the model's layers"},
        {"use_multi_rank_bucket_allreduce", "strata reduces each bucket with one collective"},
    };
    ignore_known(zsec, "/zero_optimization/", reasons);
  }

  void aio() {
    const json* a = section("/aio");
    if (!a) return;
    const bool nvme = entries_.count("tiers.nvme.paths") > 0;
    if (!nvme) warn("aio: no offload to nvme in this config; the settings are imported but unused");
    if (const json* v = find("/aio/block_size")) {
      const std::uint64_t b = count("/aio/block_size", *v, 1, 1ull << 30);
      const std::uint64_t r = (b + 4095) / 4096 * 4096;
      set("tiers.nvme.block_size", format_bytes_exact(r),
          src("/aio/block_size", *v) + (r != b ? " (rounded up to 4 KiB)" : ""));
      if (r != b)
        warn(strcat("aio.block_size ", b, " rounded up to ", r,
                    " (strata's requests are 4 KiB multiples)"));
    }
    if (const json* v = find("/aio/queue_depth"))
      set("tiers.nvme.queue_depth", fmt(count("/aio/queue_depth", *v, 1, 4096)),
          src("/aio/queue_depth", *v));
    for (const char* k : {"thread_count", "intra_op_parallelism"})
      if (const json* v = find(strcat("/aio/", k)))
        set("tiers.nvme.io_threads", fmt(count(strcat("/aio/", k), *v, 1, 64)),
            src(strcat("/aio/", k), *v));
    if (const json* v = find("/aio/single_submit"); v && boolean("/aio/single_submit", *v))
      warn(
          "aio.single_submit: true: strata submits each batch of requests with one call (as "
          "single_submit false)");
    if (const json* v = find("/aio/overlap_events"); v && !boolean("/aio/overlap_events", *v))
      warn(
          "aio.overlap_events: false: strata always overlaps I/O with compute (read-ahead, "
          "write-behind)");
    ignore("/aio/use_gds", "strata reads NVMe into pinned host buffers (no GPUDirect Storage)");
    for (auto& [k, v] : a->items()) {
      const std::string p = "/aio/" + esc(k);
      if (!consumed_.count(p) && !subtree_.count(p)) ignore(p, "not a key strata knows in aio");
    }
  }

  // Known DeepSpeed keys with no strata meaning.
  void ignored() {
    const std::map<std::string, std::string> reasons{
        {"scheduler",
         "strata has no LR schedule in its config; a loop calls Engine::set_lr between steps"},
        {"steps_per_print", "strata train prints every step"},
        {"wall_clock_breakdown",
         "strata reports phase times in EngineStats and `strata train --json`"},
        {"dump_state", "no strata meaning"},
        {"prescale_gradients", "strata averages gradients once, after the reduction"},
        {"gradient_predivide_factor", "strata averages gradients once, after the reduction"},
        {"communication_data_type",
         "strata reduces in precision.grads and holds the sum in precision.grad_accum"},
        {"activation_checkpointing",
         "strata does not run the model (model.* shape keys drive the activation estimate)"},
        {"flops_profiler", "use `strata profile`"},
        {"tensorboard", "no monitoring backends"},
        {"wandb", "no monitoring backends"},
        {"csv_monitor", "no monitoring backends"},
        {"comet", "no monitoring backends"},
        {"comms_logger", "collective bytes are in EngineStats.comm"},
        {"autotuning", "use `strata profile --write-config`"},
        {"elasticity", "strata checkpoints reshard to any world size instead"},
        {"amp", "strata does not run the model's forward pass"},
        {"zero_allow_untested_optimizer", "strata runs its own Adam / AdamW"},
        {"zero_force_ds_cpu_optimizer", "strata runs its own CPU Adam"},
        {"memory_breakdown", "use `strata plan`"},
        {"sparse_attention", "strata does not run the model"},
        {"sparse_gradients", "strata reduces dense gradients"},
        {"pipeline", "strata is data parallel only"},
        {"checkpoint",
         "strata checkpoints: `strata train --checkpoint-dir`, Engine::save_checkpoint"},
        {"data_efficiency", "strata does not load data"},
        {"curriculum_learning", "strata does not load data"},
        {"compression_training", "strata does not compress"},
        {"disable_allgather", "no strata meaning"},
        {"nebula", "strata checkpoints: `strata train --checkpoint-dir`"},
        {"load_universal_checkpoint",
         "strata checkpoints load into any world size and stage by themselves"},
        {"use_node_local_storage", "strata checkpoints need a directory every rank sees"},
        {"graph_harvesting", "no strata meaning"},
        {"timers", "no strata meaning"},
        {"hybrid_engine", "no strata meaning"},
        {"weight_quantization", "strata does not quantize"},
        {"quantize_training", "strata does not quantize"},
        {"seq_parallel_communication_data_type", "strata is data parallel only"},
        {"fp16_master_weights_and_grads", "strata keeps FP32 master weights"},
        {"gradient_accumulation_dtype",
         "DeepSpeed reads data_types.grad_accum_dtype (mapped to precision.grad_accum)"},
    };
    ignore_known(root_, "/", reasons);
  }

  // Anything neither mapped nor known: listed as unknown.
  void unknown(const std::string& ptr, const json& v) {
    if (subtree_.count(ptr)) return;
    if (!ptr.empty() && !consumed_.count(ptr)) {
      warn(strcat(dotted(ptr), " (", summary(v),
                  "): not a DeepSpeed key strata knows (a typo, or a newer "
                  "DeepSpeed option?); ignored"));
      return;
    }
    if (!v.is_object()) return;
    for (auto& [k, c] : v.items()) unknown(ptr + "/" + esc(k), c);
  }

  // ---- the YAML ----
  std::string emit() const {
    static const char* const kOrder[] = {"model.parameters",
                                         "model.largest_layer",
                                         "model.micro_batch",
                                         "precision.params",
                                         "precision.grads",
                                         "precision.grad_accum",
                                         "precision.loss_scale.dynamic",
                                         "precision.loss_scale.initial",
                                         "precision.loss_scale.growth_factor",
                                         "precision.loss_scale.backoff_factor",
                                         "precision.loss_scale.growth_interval",
                                         "precision.loss_scale.min_scale",
                                         "optimizer.type",
                                         "optimizer.lr",
                                         "optimizer.betas",
                                         "optimizer.eps",
                                         "optimizer.weight_decay",
                                         "optimizer.grad_clip",
                                         "world.ranks",
                                         "zero.stage",
                                         "zero.sub_group_size",
                                         "zero.reduce_bucket_size",
                                         "offload.optimizer.tier",
                                         "offload.optimizer.fraction",
                                         "offload.optimizer.pin_memory",
                                         "offload.gradients.tier",
                                         "offload.params.tier",
                                         "offload.params.pin_memory",
                                         "tiers.host.buffer_count",
                                         "tiers.host.buffer_size",
                                         "tiers.nvme.paths",
                                         "tiers.nvme.block_size",
                                         "tiers.nvme.queue_depth",
                                         "tiers.nvme.io_threads",
                                         "train.accumulate"};
    std::string out = strcat(
        "# strata configuration imported from ", o_.source,
        " by `strata import-deepspeed` (strata ", build::kVersion, ").\n",
        "# Each key names the DeepSpeed key it came from; keys not listed keep strata's defaults\n"
        "# (configs/default.yaml, docs/config.md). Check the lines marked PLACEHOLDER and "
        "\"auto\".\n");
    std::vector<std::string> open;  // the mapping path currently open
    for (const char* key : kOrder) {
      auto it = entries_.find(key);
      if (it == entries_.end()) continue;
      std::vector<std::string> parts;
      for (std::size_t b = 0, e; b <= std::strlen(key); b = e + 1) {
        e = std::string(key).find('.', b);
        if (e == std::string::npos) e = std::strlen(key);
        parts.push_back(std::string(key).substr(b, e - b));
      }
      std::size_t common = 0;
      while (common < open.size() && common + 1 < parts.size() && open[common] == parts[common])
        ++common;
      open.resize(common);
      for (std::size_t i = common; i + 1 < parts.size(); ++i) {
        if (i == 0) out += "\n";
        out += std::string(2 * i, ' ') + parts[i] + ":\n";
        open.push_back(parts[i]);
      }
      std::string line =
          std::string(2 * (parts.size() - 1), ' ') + parts.back() + ": " + it->second.value;
      if (line.size() < 34) line.resize(34, ' ');
      out += line + "  # " + it->second.comment + "\n";
    }
    if (!warnings_.empty()) {
      out += "\n# Not imported, or imported with a difference (also printed as warnings):\n";
      for (const auto& w : warnings_) out += "#   - " + w + "\n";
    }
    return out;
  }

  const json& root_;
  const DsImportOptions& o_;
  std::set<std::string> consumed_;  // JSON pointers read (their children are checked separately)
  std::set<std::string> subtree_;   // JSON pointers consumed with everything below them
  std::vector<std::string> warnings_;
  std::map<std::string, Entry> entries_;  // by YAML key path
};

}  // namespace

DsImportResult import_deepspeed(const std::string& json_text, const DsImportOptions& options) {
  const json root = parse_json(json_text, options.source);
  return Importer(root, options).run();
}

}  // namespace strata::cli
