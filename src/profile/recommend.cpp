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

std::vector<IoRecommendation> recommend_io(const std::vector<IoPoint>& points) {
  // (path) -> (engine, bs, qd, rings) -> {read, write}
  using Key = std::tuple<std::string, std::uint64_t, std::uint32_t, std::uint32_t>;
  std::map<std::string, std::map<Key, std::pair<double, double>>> by_path;
  std::vector<std::string> order;
  for (const auto& p : points) {
    if (!by_path.count(p.path)) order.push_back(p.path);
    auto& rw = by_path[p.path][Key{p.engine, p.block_size, p.queue_depth, p.rings}];
    (p.op == "read" ? rw.first : rw.second) = p.bytes_per_second;
  }
  std::vector<IoRecommendation> out;
  for (const auto& path : order) {
    // Score: the rate at which equal amounts are read and written (harmonic mean), as a step does.
    struct Cand {
      Key key;
      double read, write, score;
    };
    std::vector<Cand> cands;
    for (const auto& [key, rw] : by_path[path]) {
      if (rw.first <= 0 || rw.second <= 0) continue;
      cands.push_back({key, rw.first, rw.second, 2.0 / (1.0 / rw.first + 1.0 / rw.second)});
    }
    if (cands.empty()) continue;
    const double best = std::max_element(cands.begin(), cands.end(), [](auto& a, auto& b) {
                          return a.score < b.score;
                        })->score;
    // Within 5 % of the best, take the lightest setting (fewest bytes in flight, fewest rings):
    // the difference is measurement noise, the memory and threads are not.
    const Cand* pick = nullptr;
    for (const auto& cand : cands) {
      if (cand.score < 0.95 * best) continue;
      auto weight = [](const Cand& x) {
        return std::make_tuple(std::get<1>(x.key) * std::get<2>(x.key) * std::get<3>(x.key),
                               std::get<3>(x.key), -x.score);
      };
      if (!pick || weight(cand) < weight(*pick)) pick = &cand;
    }
    IoRecommendation r;
    r.path = path;
    r.engine = std::get<0>(pick->key);
    r.block_size = std::get<1>(pick->key);
    r.queue_depth = std::get<2>(pick->key);
    r.rings = std::get<3>(pick->key);
    r.read_bps = pick->read;
    r.write_bps = pick->write;
    r.reason = strcat("read ", format_rate(r.read_bps), ", write ", format_rate(r.write_bps),
                      "; the lightest setting within 5% of the best read/write harmonic mean (",
                      format_rate(best), ") of ", cands.size(), " measured");
    out.push_back(r);
  }
  return out;
}

PlacementRecommendation recommend_placement(const Config& c, const Bandwidths& bw,
                                            double target_overhead_s, bool nvme_usable) {
  PlacementRecommendation rec;
  std::vector<int> stages{c.zero.stage};
  const Recommendation fit = recommend(c);
  if (fit.found && fit.layout.stage != c.zero.stage) stages.push_back(fit.layout.stage);
  const double fractions[] = {0.25, 0.5, 0.75, 1.0};
  for (int stage : stages) {
    std::vector<OffloadConfig> offloads;
    OffloadConfig base;
    base.params = stage == 3 ? c.offload.params : OffloadTarget{};
    offloads.push_back(base);
    if (stage >= 1) {
      std::vector<Tier> tiers{Tier::kCpu};
      if (nvme_usable) tiers.push_back(Tier::kNvme);
      for (Tier t : tiers)
        for (double f : fractions)
          for (bool grads_cpu : {false, true}) {
            if (grads_cpu && stage < 2) continue;
            OffloadConfig o = base;
            o.optimizer = {t, f, t == Tier::kCpu ? c.offload.optimizer.pin_memory : false};
            if (grads_cpu) o.gradients = {Tier::kCpu, 1.0, c.offload.gradients.pin_memory};
            offloads.push_back(o);
          }
    }
    for (const auto& o : offloads) {
      const Layout l = plan_layout(c, stage, o);
      const StepPrediction p = predict_step(c, l, bw);
      PlacementOption opt;
      opt.stage = stage;
      opt.offload = o;
      opt.description = l.describe();
      opt.fits = l.fits();
      opt.gpu_bytes_per_rank = l.per_rank.gpu;
      opt.overhead_pipelined_s = p.overhead_pipelined_s;
      opt.step_pipelined_s = p.pipelined_s;
      rec.considered.push_back(opt);
    }
  }
  const PlacementOption* best = nullptr;
  for (const auto& o : rec.considered) {
    if (!o.fits || o.overhead_pipelined_s > target_overhead_s) continue;
    if (!best || o.gpu_bytes_per_rank < best->gpu_bytes_per_rank ||
        (o.gpu_bytes_per_rank == best->gpu_bytes_per_rank &&
         o.overhead_pipelined_s < best->overhead_pipelined_s))
      best = &o;
  }
  if (best) {
    rec.found = true;
    rec.choice = *best;
    rec.reason = strcat(best->description, ": fits the budgets and its predicted transfer overhead (",
                        best->overhead_pipelined_s, " s pipelined) meets the target of ",
                        target_overhead_s, " s with the least GPU memory (",
                        format_bytes(best->gpu_bytes_per_rank), " per rank) of ",
                        rec.considered.size(), " placements considered");
    return rec;
  }
  for (const auto& o : rec.considered) {
    if (!o.fits) continue;
    if (!best || o.overhead_pipelined_s < best->overhead_pipelined_s) best = &o;
  }
  if (best) {
    rec.found = true;
    rec.choice = *best;
    rec.reason = strcat("no placement that fits meets the target of ", target_overhead_s,
                        " s; the fastest that fits: ", best->description, " (",
                        best->overhead_pipelined_s, " s)");
  } else {
    rec.reason = strcat("no placement of the ", rec.considered.size(),
                        " considered fits the tier budgets",
                        nvme_usable ? "" : " (NVMe placements need tiers.nvme.paths)");
  }
  return rec;
}

}  // namespace strata::profile
