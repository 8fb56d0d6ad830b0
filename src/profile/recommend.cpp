// Recommendations: the best I/O settings per NVMe path (from the sweep), and a tier placement that
// meets a target transfer overhead per step (from the cost model).
#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "profile/profile_internal.hpp"
#include "strata/error.hpp"
#include "strata/units.hpp"

namespace strata::profile {

namespace {

// A measured setting: (engine, block size, queue depth, rings).
using Key = std::tuple<std::string, std::uint64_t, std::uint32_t, std::uint32_t>;

struct RW {
  double read = 0, write = 0;
  double spread = 0;  // largest relative spread between passes of the two ops
  std::size_t passes = 0;
};

// A setting with both rates, scored by the rate at which equal amounts are read and written
// (harmonic mean), as a step does.
struct Cand {
  Key key;
  double read, write, score;
};

// The points grouped by path (in the order the paths came) and setting.
std::map<std::string, std::map<Key, RW>> group(const std::vector<IoPoint>& points,
                                               std::vector<std::string>& order) {
  std::map<std::string, std::map<Key, RW>> by_path;
  for (const auto& p : points) {
    if (!by_path.count(p.path)) order.push_back(p.path);
    RW& rw = by_path[p.path][Key{p.engine, p.block_size, p.queue_depth, p.rings}];
    (p.op == "read" ? rw.read : rw.write) = p.bytes_per_second;
    if (p.runs_bps.size() > 1 && p.bytes_per_second > 0) {
      const auto [lo, hi] = std::minmax_element(p.runs_bps.begin(), p.runs_bps.end());
      rw.spread = std::max(rw.spread, (*hi - *lo) / p.bytes_per_second);
    }
    rw.passes = std::max(rw.passes, std::max<std::size_t>(p.runs_bps.size(), 1));
  }
  return by_path;
}

// The configured setting when it is within the noise band of the best score (*kept = true),
// else the lightest setting within it (fewest bytes in flight, fewest rings: the difference is
// noise, the memory and threads are not).
const Cand* pick(const std::vector<Cand>& cands, const Key& configured, double best, double noise,
                 bool* kept) {
  const Cand* chosen = nullptr;
  *kept = false;
  for (const auto& cand : cands)
    if (cand.key == configured && cand.score >= (1.0 - noise) * best) {
      chosen = &cand;
      *kept = true;
    }
  for (const auto& cand : cands) {
    if (*kept || cand.score < (1.0 - noise) * best) continue;
    auto weight = [](const Cand& x) {
      return std::make_tuple(std::get<1>(x.key) * std::get<2>(x.key) * std::get<3>(x.key),
                             std::get<3>(x.key), std::get<0>(x.key), -x.score);
    };
    if (!chosen || weight(cand) < weight(*chosen)) chosen = &cand;
  }
  return chosen;
}

IoRecommendation describe(const std::string& path, const Cand& chosen, bool kept, double noise,
                          std::size_t passes, double best, std::size_t measured) {
  IoRecommendation r;
  r.path = path;
  r.engine = std::get<0>(chosen.key);
  r.block_size = std::get<1>(chosen.key);
  r.queue_depth = std::get<2>(chosen.key);
  r.rings = std::get<3>(chosen.key);
  r.read_bps = chosen.read;
  r.write_bps = chosen.write;
  r.configured_kept = kept;
  r.noise = noise;
  const std::string band =
      strcat(static_cast<int>(std::lround(noise * 100)), "% (",
             passes > 1 ? "twice the median spread of " + std::to_string(passes) + " passes"
                        : std::string("one pass: the minimum band"),
             ")");
  r.reason = strcat("read ", format_rate(r.read_bps), ", write ", format_rate(r.write_bps), "; ",
                    kept ? "the configured setting is within the noise band " + band +
                               " of the best read/write harmonic mean (" + format_rate(best) + ")"
                         : "the lightest setting within the noise band " + band +
                               " of the best read/write harmonic mean (" + format_rate(best) +
                               "); the configured setting is not within it",
                    "; ", measured, " settings measured");
  return r;
}

}  // namespace

std::vector<IoRecommendation> recommend_io(const std::vector<IoPoint>& points,
                                           const NvmeTierConfig& configured,
                                           const std::string& configured_engine) {
  std::vector<std::string> order;
  auto by_path = group(points, order);
  const Key configured_key{configured_engine, configured.block_size, configured.queue_depth,
                           configured.io_threads};
  std::vector<IoRecommendation> out;
  for (const auto& path : order) {
    std::vector<Cand> cands;
    std::vector<double> spreads;
    std::size_t passes = 1;
    for (const auto& [key, rw] : by_path[path]) {
      if (rw.read <= 0 || rw.write <= 0) continue;
      cands.push_back({key, rw.read, rw.write, 2.0 / (1.0 / rw.read + 1.0 / rw.write)});
      spreads.push_back(rw.spread);
      passes = std::max(passes, rw.passes);
    }
    if (cands.empty()) continue;
    const double best = std::max_element(cands.begin(), cands.end(), [](auto& a, auto& b) {
                          return a.score < b.score;
                        })->score;
    // The noise band: twice the median pass-to-pass spread, within [5%, 25%].
    const double noise = passes > 1 ? std::clamp(2.0 * median(spreads), 0.05, 0.25) : 0.05;
    bool kept = false;
    const Cand* chosen = pick(cands, configured_key, best, noise, &kept);
    out.push_back(describe(path, *chosen, kept, noise, passes, best, cands.size()));
  }
  return out;
}

PlacementRecommendation recommend_placement(const Config& c, const Bandwidths& bw,
                                            double target_overhead_s, bool nvme_usable) {
  // The plan's recommender decides (one recommender for `plan` and `profile`); the profile adds
  // what each rung is predicted to cost per step with the measured bandwidths.
  const Recommendation fit = recommend(c);
  PlacementRecommendation rec;
  const PlacementOption* chosen = nullptr;
  for (const Rung& rung : fit.ladder) {
    const StepPrediction p = predict_step(c, rung.layout, bw);
    PlacementOption opt;
    opt.stage = rung.layout.stage;
    opt.offload = rung.layout.offload;
    opt.description = rung.layout.describe();
    opt.fits = rung.fits;
    opt.verdict = rung.verdict;
    opt.checkpointing = rung.checkpointing;
    opt.gpu_bytes_per_rank = rung.layout.per_rank.gpu;
    opt.overhead_pipelined_s = p.overhead_pipelined_s;
    opt.step_pipelined_s = p.pipelined_s;
    rec.considered.push_back(opt);
  }
  for (std::size_t i = 0; i < fit.ladder.size(); ++i)
    if (fit.found && fit.ladder[i].fits && !chosen) chosen = &rec.considered[i];
  if (!chosen) {
    rec.reason = fit.reason;
    return rec;
  }
  rec.found = true;
  rec.choice = *chosen;
  rec.reason = strcat(fit.reason, "; predicted transfer overhead ", chosen->overhead_pipelined_s,
                      " s per step (pipelined, per rank, with the measured bandwidths)");
  if (chosen->overhead_pipelined_s > target_overhead_s) {
    const PlacementOption* fastest = nullptr;
    for (const auto& o : rec.considered)
      if (o.fits && (!fastest || o.overhead_pipelined_s < fastest->overhead_pipelined_s))
        fastest = &o;
    rec.reason += strcat("; above the target of ", target_overhead_s, " s");
    if (fastest && fastest != chosen &&
        fastest->overhead_pipelined_s < chosen->overhead_pipelined_s)
      rec.reason += strcat(" (", fastest->description, " fits and is predicted at ",
                           fastest->overhead_pipelined_s, " s, but comes later on the ladder)");
  }
  if (!nvme_usable &&
      (chosen->offload.optimizer.tier == Tier::kNvme ||
       chosen->offload.gradients.tier == Tier::kNvme || chosen->offload.params.tier == Tier::kNvme))
    rec.reason += "; configure tiers.nvme.paths to use it";
  return rec;
}

}  // namespace strata::profile
