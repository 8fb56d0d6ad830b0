// "The lowest stage, and the least offload, that fits the budgets."
#include "strata/plan.hpp"
#include "strata/units.hpp"

namespace strata {
namespace {

OffloadTarget on(Tier t) { return OffloadTarget{t, 1.0, false}; }

struct Candidate {
  int stage;
  OffloadConfig offload;
};

std::vector<Candidate> candidates() {
  std::vector<Candidate> out;
  const OffloadConfig none;
  for (int s = 0; s <= 3; ++s) out.push_back({s, none});
  OffloadConfig o = none;
  o.optimizer = on(Tier::kCpu);
  for (int s = 1; s <= 3; ++s) out.push_back({s, o});
  o.gradients = on(Tier::kCpu);
  for (int s = 2; s <= 3; ++s) out.push_back({s, o});
  o = none;
  o.optimizer = on(Tier::kNvme);
  for (int s = 1; s <= 3; ++s) out.push_back({s, o});
  o.gradients = on(Tier::kCpu);
  for (int s = 2; s <= 3; ++s) out.push_back({s, o});
  o = none;
  o.optimizer = on(Tier::kCpu);
  o.gradients = on(Tier::kCpu);
  o.params = on(Tier::kCpu);
  out.push_back({3, o});
  o.optimizer = on(Tier::kNvme);
  out.push_back({3, o});
  o.gradients = on(Tier::kNvme);
  o.params = on(Tier::kNvme);
  out.push_back({3, o});
  return out;
}

std::string overflow_text(const Layout& l) {
  std::string s;
  for (const auto& v : l.verdicts) {
    if (v.fits()) continue;
    if (!s.empty()) s += ", ";
    s += v.tier + " needs " + format_bytes(v.used) + " per " + v.scope + " > budget " +
         format_bytes(v.budget) + " (over by " + format_bytes(v.overflow()) + ")";
  }
  return s;
}

bool uses_nvme(const OffloadConfig& o) {
  return o.optimizer.tier == Tier::kNvme || o.gradients.tier == Tier::kNvme ||
         o.params.tier == Tier::kNvme;
}

}  // namespace

Recommendation recommend(const Config& c) {
  Recommendation r;
  Layout previous;
  bool have_previous = false;
  for (const auto& cand : candidates()) {
    Layout l = plan_layout(c, cand.stage, cand.offload);
    if (l.fits()) {
      r.found = true;
      r.layout = l;
      r.reason = l.describe() + " is the first layout, in the order lowest stage then least "
                                "offload, whose model state fits every budget";
      if (have_previous)
        r.reason += "; the one before it (" + previous.describe() + ") does not: " +
                    overflow_text(previous);
      if (uses_nvme(cand.offload) && c.tiers.nvme.paths.empty())
        r.reason += "; it needs tiers.nvme.paths";
      return r;
    }
    previous = l;
    have_previous = true;
  }
  r.reason = "nothing fits: even " + previous.describe() + " overflows: " + overflow_text(previous) +
             "; add ranks, or raise the budgets";
  return r;
}

}  // namespace strata
