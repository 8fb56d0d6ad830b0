// The placement matrix shared by tests/zero/test_placements.cpp (host-emulated device, CI) and
// test_placements_cuda.cpp (a CUDA device with NCCL, scripts/gpu_check.sh): every placement of
// {optimizer, gradients, params} x {gpu, cpu, nvme} a stage allows, the engine's loop and the
// unsharded single-rank CpuAdam reference.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

#include "../comm/comm_test_util.hpp"
#include "core/numeric.hpp"
#include "engine_basics.hpp"
#include "strata/adam.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"
#include "zero/engine_access.hpp"

namespace strata::testing {

struct Placement {
  int stage = 0;
  Tier opt = Tier::kGpu, grads = Tier::kGpu, params = Tier::kGpu;
  double fraction = 1.0;  // of each offloaded kind
  int world = 1;
  DType pdt = DType::kFp32, gdt = DType::kFp32;
  bool pin = false;  // offload.*.pin_memory: the cpu share page-locked
  // The host-computed loops stage gpu-home parts through the pinned pool as on CUDA (the
  // host-emulated device otherwise views its memory in place: EngineAccess).
  bool staged = false;
  // Micro-batches per step (gradient accumulation): each hands in every gradient; the overflow
  // steps carry their inf / NaN in the middle one (K / 2).
  int accumulate = 1;
  // optimizer.overlap on: the update speculated during the last micro-batch's backward.
  bool overlap = false;
  // clip_grad_norm(1e-3) before step() on steps 2, 5 and 8: clipping forced on chosen steps.
  bool force_clip = false;
  // precision.grad_accum fp32 (16-bit gradients held and accumulated in FP32); else the
  // gradients' own dtype.
  bool accum_fp32 = false;
  // Host-state chunks' Adam shared with the device's (zero/update_split.hpp), forced per chunk:
  // 0 the CPU alone (no split), 1 all on the CPU through the split, 2 all on the device,
  // 3 alternating chunks, 4 the device takes the chunks final last (the lowest two), 5 a share
  // inside every chunk, 6 optimizer.update auto (not forced: the rates choose; on a CUDA engine).
  int split = 0;
  DType held() const { return accum_fp32 ? DType::kFp32 : gdt; }
};

inline std::function<double(std::size_t)> split_share(int mode) {
  switch (mode) {
    case 1: return [](std::size_t) { return 0.0; };
    case 2: return [](std::size_t) { return 1.0; };
    case 3: return [](std::size_t i) { return i % 2 ? 1.0 : 0.0; };
    case 4: return [](std::size_t i) { return i < 2 ? 1.0 : 0.0; };
    case 5: return [](std::size_t i) { return 0.3 + 0.1 * static_cast<double>(i % 5); };
    default: return {};
  }
}

inline std::string case_name(const ::testing::TestParamInfo<Placement>& i) {
  const Placement& p = i.param;
  std::string s =
      strata::strcat("stage", p.stage, "_opt_", tier_name(p.opt), "_grads_", tier_name(p.grads),
                     "_params_", tier_name(p.params), "_world", p.world);
  if (p.fraction < 1) s += strata::strcat("_fraction", static_cast<int>(p.fraction * 100));
  if (p.pdt != DType::kFp32 || p.gdt != DType::kFp32)
    s += strata::strcat("_", dtype_name(p.pdt), "_", dtype_name(p.gdt));
  if (p.pin) s += "_pinned";
  if (p.staged) s += "_staged";
  if (p.accumulate > 1) s += strata::strcat("_accumulate", p.accumulate);
  if (p.overlap) s += "_overlap";
  if (p.force_clip) s += "_clip";
  if (p.accum_fp32) s += "_accum_fp32";
  if (p.split) s += strata::strcat("_split", p.split);
  return s;
}

// The speculative update (optimizer.overlap on): stages 2-3, state on cpu / nvme, gradients on
// gpu / cpu, K = 1-3 micro-batches on 1-4 ranks; a fraction, page-locked host state.
inline std::vector<Placement> overlap_cases() {
  std::vector<Placement> v;
  for (int stage = 2; stage <= 3; ++stage)
    for (Tier o : {Tier::kCpu, Tier::kNvme})
      for (Tier g : {Tier::kGpu, Tier::kCpu})
        for (auto [k, world] : {std::pair{1, 1}, {2, 2}, {3, 4}}) {
          v.push_back({stage, o, g, stage == 3 ? o : Tier::kGpu, 1.0, world});
          v.back().accumulate = k;
          v.back().overlap = true;
        }
  v.push_back({2, Tier::kNvme, Tier::kCpu, Tier::kGpu, 0.5, 2});
  v.back().accumulate = 2;
  v.back().overlap = true;
  v.push_back({3, Tier::kCpu, Tier::kCpu, Tier::kCpu, 1.0, 2, DType::kFp32, DType::kFp32, true});
  v.back().overlap = true;
  v.push_back({2, Tier::kCpu, Tier::kGpu, Tier::kGpu, 1.0, 3, DType::kBf16, DType::kFp16});
  v.back().overlap = true;
  return v;
}

// 16-bit gradients accumulated (issue 26): each stage, bf16 and fp16, held in their own dtype or
// in FP32 (precision.grad_accum), gradients on gpu / cpu / nvme, K = 1-3 on 1-4 ranks, the
// overflow in the middle micro-batch; a fraction, staged device memory, the speculative update.
inline std::vector<Placement> accum16_cases() {
  const DType bf = DType::kBf16, fp = DType::kFp16;
  const Tier G = Tier::kGpu, C = Tier::kCpu, N = Tier::kNvme;
  struct Case {
    Placement p;
    int k;
    bool fp32;
  };
  std::vector<Placement> v;
  for (const Case& c : std::initializer_list<Case>{{{0, G, G, G, 1.0, 2, bf, bf}, 3, false},
                                                   {{0, G, G, G, 1.0, 1, fp, fp}, 2, true},
                                                   {{1, N, G, G, 1.0, 2, bf, fp}, 3, true},
                                                   {{1, C, G, G, 1.0, 1, bf, bf}, 2, false},
                                                   {{1, C, G, G, 1.0, 2, bf, bf}, 1, true},
                                                   {{2, C, C, G, 1.0, 2, bf, bf}, 3, false},
                                                   {{2, N, N, G, 1.0, 2, fp, fp}, 2, true},
                                                   {{2, C, G, G, 1.0, 4, bf, bf}, 2, true},
                                                   {{2, C, C, G, 1.0, 2, fp, fp}, 1, true},
                                                   {{3, N, N, N, 1.0, 2, fp, fp}, 3, false},
                                                   {{3, G, G, G, 1.0, 2, fp, fp}, 2, false},
                                                   {{3, C, G, C, 1.0, 1, bf, bf}, 3, true},
                                                   {{3, N, C, N, 0.5, 3, bf, bf}, 2, true}}) {
    v.push_back(c.p);
    v.back().accumulate = c.k;
    v.back().accum_fp32 = c.fp32;
  }
  v.push_back({2, N, C, G, 1.0, 2, bf, bf});  // staged as on CUDA
  v.back().staged = true;
  v.back().accumulate = 2;
  v.back().accum_fp32 = true;
  v.push_back({2, C, G, G, 1.0, 2, bf, bf});  // the speculative update over FP32-held gradients
  v.back().accumulate = 2;
  v.back().accum_fp32 = v.back().overlap = true;
  v.push_back({3, N, C, N, 1.0, 2, fp, fp});
  v.back().accumulate = 3;
  v.back().overlap = true;
  return v;
}

// Every placement a stage allows (config validation: optimizer off gpu from stage 1, gradients
// from 2, parameters at 3), for 1-4 ranks; then the extra cases.
inline std::vector<Placement> all_cases() {
  const Tier tiers[3] = {Tier::kGpu, Tier::kCpu, Tier::kNvme};
  std::vector<Placement> v;
  for (int stage = 0; stage <= 3; ++stage)
    for (Tier o : tiers)
      for (Tier g : tiers)
        for (Tier p : tiers) {
          if ((stage < 1 && o != Tier::kGpu) || (stage < 2 && g != Tier::kGpu) ||
              (stage < 3 && p != Tier::kGpu))
            continue;
          for (int world = 1; world <= 4; ++world) v.push_back({stage, o, g, p, 1.0, world});
        }
  // Part of each kind on its tier, the rest on gpu.
  v.push_back({3, Tier::kNvme, Tier::kNvme, Tier::kNvme, 0.5, 3});
  v.push_back({3, Tier::kCpu, Tier::kNvme, Tier::kCpu, 0.3, 2});
  v.push_back({2, Tier::kNvme, Tier::kCpu, Tier::kGpu, 0.6, 4});
  v.push_back({1, Tier::kNvme, Tier::kGpu, Tier::kGpu, 0.5, 1});
  // 16-bit parameters and gradients: loss scaling, overflow backs the scale off.
  for (int stage = 0; stage <= 3; ++stage) {
    const Tier t = stage == 0 ? Tier::kGpu : Tier::kNvme;
    v.push_back({stage, t, stage >= 2 ? Tier::kCpu : Tier::kGpu,
                 stage == 3 ? Tier::kNvme : Tier::kGpu, 1.0, 3, DType::kBf16, DType::kFp16});
  }
  v.push_back({3, Tier::kGpu, Tier::kGpu, Tier::kGpu, 1.0, 2, DType::kFp16, DType::kBf16});
  // The cpu share page-locked (pin_memory).
  v.push_back({3, Tier::kCpu, Tier::kCpu, Tier::kCpu, 1.0, 2, DType::kFp32, DType::kFp32, true});
  // Device memory staged through the pinned pool as on CUDA (gradients copied device→host,
  // parameters host→device), where some of it is computed on the host.
  const DType f32 = DType::kFp32;
  for (const Placement& s : std::initializer_list<Placement>{
           {1, Tier::kCpu, Tier::kGpu, Tier::kGpu, 1.0, 2},
           {1, Tier::kNvme, Tier::kGpu, Tier::kGpu, 1.0, 3},
           {2, Tier::kCpu, Tier::kGpu, Tier::kGpu, 1.0, 4},
           {2, Tier::kNvme, Tier::kCpu, Tier::kGpu, 0.6, 4},
           {3, Tier::kNvme, Tier::kGpu, Tier::kGpu, 1.0, 2},
           {3, Tier::kCpu, Tier::kCpu, Tier::kGpu, 1.0, 1},
           {1, Tier::kNvme, Tier::kGpu, Tier::kGpu, 1.0, 3, DType::kBf16, DType::kFp16},
           {3, Tier::kCpu, Tier::kGpu, Tier::kCpu, 1.0, 2, f32, f32, true}}) {
    v.push_back(s);
    v.back().staged = true;
  }
  // Gradient accumulation: 2 and 3 micro-batches per step, every stage, every gradient tier a
  // stage allows, 1-4 ranks; parts on their tier.
  for (int stage = 0; stage <= 3; ++stage)
    for (Tier g : tiers) {
      if (stage < 2 && g != Tier::kGpu) continue;
      const Tier o = stage == 0 ? Tier::kGpu : Tier::kNvme;
      const Tier prm = stage == 3 ? Tier::kCpu : Tier::kGpu;
      for (auto [k, world] : {std::pair{2, 1}, {3, 2}, {2, 4}}) {
        v.push_back({stage, o, g, prm, 1.0, world});
        v.back().accumulate = k;
      }
    }
  for (const Placement& s :
       std::initializer_list<Placement>{{3, Tier::kNvme, Tier::kNvme, Tier::kNvme, 0.5, 3},
                                        {2, Tier::kCpu, Tier::kNvme, Tier::kGpu, 0.4, 2},
                                        {1, Tier::kNvme, Tier::kGpu, Tier::kGpu, 0.5, 3}}) {
    v.push_back(s);
    v.back().accumulate = 3;
  }
  v.push_back({2, Tier::kNvme, Tier::kCpu, Tier::kGpu, 1.0, 2});  // staged as on CUDA
  v.back().staged = true;
  v.back().accumulate = 2;
  for (const Placement& s : overlap_cases()) v.push_back(s);
  for (const Placement& s : accum16_cases()) v.push_back(s);
  return v;
}

inline const std::vector<std::size_t> kSizes{3001, 7, 0, 2120, 129, 1000, 1};
// Ten steps: two overflow (3: an inf, 7: a NaN), each with applied steps before and after it, and
// three clipped ones between them (2, 5, 8). A case's time is mostly its steps' handoffs between
// threads (22 steps before: 1.5x the time here, 2x on the fake GPUs, for the same cases).
inline constexpr int kSteps = 10;

inline Config placement_config(const Placement& p, const std::string& dir) {
  Config cfg;
  cfg.world.ranks = static_cast<std::uint32_t>(p.world);
  cfg.world.ranks_per_node = static_cast<std::uint32_t>(p.world);
  cfg.zero.stage = p.stage;
  cfg.zero.reduce_bucket_size = 1500;
  cfg.zero.sub_group_size = 2500;  // cut inside the chunks
  cfg.precision.params = p.pdt;
  cfg.precision.grads = p.gdt;
  if (p.accum_fp32) cfg.precision.grad_accum = DType::kFp32;
  use_reference_adamw(cfg);
  cfg.runtime.cpu_threads = 1;
  cfg.runtime.collective_timeout_s = 30.0;
  cfg.runtime.device = DeviceKind::kHost;
  cfg.offload.optimizer = {p.opt, p.fraction, p.pin};
  cfg.offload.gradients = {p.grads, p.fraction, p.pin};
  cfg.offload.params = {p.params, p.fraction, p.pin};
  use_test_swap(cfg, dir, 3, 16 << 10);  // ~640 elements per chunk: several chunks per rank
  cfg.tiers.nvme.queue_depth = 4;
  cfg.train.accumulate = static_cast<std::uint32_t>(p.accumulate);
  cfg.optimizer.overlap = p.overlap ? OptimizerOverlap::kOn : OptimizerOverlap::kOff;
  if (p.split == 6) cfg.optimizer.update = OptimizerUpdate::kAuto;
  return cfg;
}

inline std::vector<float> initial(std::size_t t) {
  std::mt19937_64 rng(77 + t);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<float> v(kSizes[t]);
  for (auto& x : v) x = d(rng);
  return v;
}

// Rank- and micro-batch-distinct gradients (in the gradient dtype); steps 3 and 7 carry an inf /
// a NaN on the last rank, in micro-batch `overflow_micro`.
inline std::vector<unsigned char> gradient(int rank, int world, int step, std::size_t t, DType dt,
                                           int micro = 0, int overflow_micro = 0) {
  std::mt19937_64 rng(0x5eed ^ (static_cast<std::uint64_t>(rank) << 40) ^
                      (static_cast<std::uint64_t>(step) << 20) ^
                      (static_cast<std::uint64_t>(micro) << 12) ^ t);
  std::normal_distribution<float> d(0.0f, 0.5f);
  std::vector<unsigned char> g(kSizes[t] * dtype_size(dt));
  for (std::size_t i = 0; i < kSizes[t]; ++i) store_elem(g.data(), i, dt, d(rng));
  if (kSizes[t] > 3 && rank == world - 1 && (step == 3 || step == 7) && t == 3 &&
      micro == overflow_micro)
    store_elem(g.data(), kSizes[t] / 2, dt,
               step == 3 ? std::numeric_limits<float>::infinity() : std::nanf(""));
  return g;
}

// One micro-batch: the forward gathers every tensor one at a time (stage 3) and reads it through
// param(); the backward hands in the gradients in reverse order, from device memory.
inline void micro_batch(Engine& e, const std::vector<TensorId>& ids, Stream& stream,
                        Communicator& comm, const Placement& p, int step, int micro) {
  for (auto id : ids) {
    e.gather({&id, 1});
    if (kSizes[id]) {
      EXPECT_NE(e.param(id), nullptr);
    }
    e.release({&id, 1});
  }
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    e.gather({&*it, 1});
    auto g = gradient(comm.rank(), comm.size(), step, *it, p.gdt, micro, p.accumulate / 2);
    if (!g.empty()) {
      DeviceMemory d = e.device().allocate(g.size());
      stream.memcpy_async(d.get(), g.data(), g.size());
      stream.synchronize(std::chrono::seconds(30));
      e.set_gradient(*it, d.get());
    } else {
      e.set_gradient(*it, g.data());
    }
    e.release({&*it, 1});
  }
}

// With overlap on, a rank speculates the same chunks on every step (those whose buckets retired
// during the backward: on several ranks the lowest partitions' buckets retire at step(), so a rank
// may speculate none); the overflow steps (and the clipped ones) rolled back, the others committed.
inline void check_speculation(const EngineStats& st, const Placement& p) {
  EXPECT_EQ(st.speculated_chunks, st.committed_chunks + st.rolled_back_chunks);
  EXPECT_EQ(st.speculated_chunks % kSteps, 0u) << "not the same chunks on every step";
  const std::uint64_t per_step = st.speculated_chunks / kSteps;
  EXPECT_EQ(st.rolled_back_chunks, (p.force_clip ? 5 : 2) * per_step)
      << "two overflow steps" << (p.force_clip ? " and three clipped ones" : "");
}

// Each side took what the forced split gives it (elements counted by the split: updated runs).
inline void check_split(const Engine& e, const Placement& p) {
  const auto [cpu, device] = zero::EngineAccess::update_split_elements(e);
  if (p.split == 1 || p.split == 5) {
    EXPECT_GT(cpu, 0u) << "split " << p.split << ": nothing on the CPU";
  }
  if (p.split == 1) {
    EXPECT_EQ(device, 0u);
  } else {
    EXPECT_GT(device, 0u) << "split " << p.split << ": nothing on the device";
  }
  if (p.split == 2) {
    EXPECT_EQ(cpu, 0u);
  }
}

// One rank's loop. Gradients are handed in from device memory of the engine's device (a copy on a
// stream: on the host-emulated device that is host memory too).
inline std::vector<std::vector<float>> train(Communicator& comm, const Placement& p,
                                             const std::string& dir, int* skipped,
                                             DeviceKind device = DeviceKind::kHost,
                                             EngineStats* stats = nullptr) {
  Config cfg = placement_config(p, dir);
  cfg.runtime.device = device;
  Engine e(cfg, comm);
  std::vector<TensorId> ids;
  for (std::size_t t = 0; t < kSizes.size(); ++t)
    ids.push_back(e.add_parameter(strata::strcat("t", t), initial(t)));
  e.finalize();
  zero::EngineAccess::set_stage_device_memory(e, p.staged);
  if (p.split && p.split != 6) zero::EngineAccess::force_update_split(e, split_share(p.split));
  auto stream = e.device().create_stream();  // the "backward"'s: gradients into device memory
  int gated = 0, cancelled = 0;
  for (int s = 0; s < kSteps; ++s) {
    for (int k = 0; k < p.accumulate; ++k) micro_batch(e, ids, *stream, comm, p, s, k);
    if (p.force_clip && (s == 2 || s == 5 || s == 8)) e.clip_grad_norm(1e-3);
    const StepResult r = e.step();
    if (!r.applied) ++*skipped;
    EXPECT_EQ(r.speculated_chunks, r.committed_chunks + r.rolled_back_chunks);
    if (!p.overlap) {
      EXPECT_EQ(r.speculated_chunks, 0u);
    }
    const tier::StreamStats u = zero::EngineAccess::last_update(e);
    gated += u.t_gate > 0;
    cancelled += u.cancelled;
  }
  // With state on NVMe the norm and overflow decision runs while the update's first reads are in
  // flight (the loop's gate; a skipped step cancels the loop), unless the statistics pass needs a
  // pool slot: gradients on NVMe, or some in device memory that is staged (CUDA, or `staged`).
  if (stats) *stats = e.stats();
  if (p.overlap) check_speculation(e.stats(), p);
  if (p.split) check_split(e, p);
  const bool some_grads_on_device = p.grads == Tier::kGpu || p.fraction < 1;
  const bool stats_staged =
      p.grads == Tier::kNvme || (some_grads_on_device && (device == DeviceKind::kCuda || p.staged));
  if (p.overlap) {
    // (a speculated step decides first; a rolled-back one may gate its serial update)
  } else if (p.opt == Tier::kNvme && !stats_staged) {
    EXPECT_EQ(gated, kSteps) << "steps whose decision ran under the update's reads";
    EXPECT_EQ(cancelled, 2) << "skipped steps that cancelled the update's reads";
  } else {
    EXPECT_EQ(gated, 0) << "the decision ran as a gate, yet needs a slot or has nothing to overlap";
    EXPECT_EQ(cancelled, 0);
  }
  if (device == DeviceKind::kHost && p.opt != Tier::kGpu) {
    // The last update's staged bytes: device memory passed the pool only when staged.
    const tier::StreamStats u = zero::EngineAccess::last_update(e);
    if (p.staged) {
      EXPECT_GT(u.bytes_in + u.bytes_out, 0u) << "staged, yet nothing passed the pool";
    } else if (p.opt == Tier::kCpu && p.grads != Tier::kNvme && p.params != Tier::kNvme) {
      EXPECT_EQ(u.bytes_in + u.bytes_out, 0u) << "host-device memory was copied, not viewed";
    }
  }
  return read_params(e, kSizes);
}

// The accumulation of docs/offload.md, element by element: `a` (dtype `held`) becomes
// round_held(a + b) (b in dtype `in`: one FP32 add, rounded to nearest even), or round_held(b)
// when `a` is empty (the first micro-batch).
inline void add_into(std::vector<unsigned char>& a, DType held, const std::vector<unsigned char>& b,
                     DType in) {
  const std::size_t n = b.size() / dtype_size(in);
  const bool first = a.empty();
  if (first) a.resize(n * dtype_size(held));
  for (std::size_t i = 0; i < n; ++i) {
    const float x = load_elem(b.data(), i, in);
    store_elem(a.data(), i, held, first ? x : load_elem(a.data(), i, held) + x);
  }
}

// The step's gradient sum over ranks and micro-batches, in the engine's order, in the held dtype
// (precision.grad_accum): stages 0-1 sum each rank's micro-batches first and reduce once (in the
// held dtype); stages 2-3 reduce each micro-batch (in the gradient dtype) and sum the reduced
// ones. The rank sum is the collective's (rank-ordered, rounded to its dtype).
inline std::vector<unsigned char> accumulated_sum(const Placement& p, int step, std::size_t t) {
  const int k_over = p.accumulate / 2;
  auto grad = [&](int r, int k) { return gradient(r, p.world, step, t, p.gdt, k, k_over); };
  std::vector<std::vector<unsigned char>> per_rank;
  if (p.stage < 2) {
    for (int r = 0; r < p.world; ++r) {
      per_rank.emplace_back();
      for (int k = 0; k < p.accumulate; ++k) add_into(per_rank.back(), p.held(), grad(r, k), p.gdt);
    }
    return reference_sum(per_rank, 0, kSizes[t], p.held());
  }
  std::vector<unsigned char> sum;
  for (int k = 0; k < p.accumulate; ++k) {
    per_rank.clear();
    for (int r = 0; r < p.world; ++r) per_rank.push_back(grad(r, k));
    add_into(sum, p.held(), reference_sum(per_rank, 0, kSizes[t], p.gdt), p.gdt);
  }
  return sum;
}

// The unsharded reference.
inline std::vector<std::vector<float>> reference(const Placement& p, int* skipped) {
  const Config cfg = placement_config(p, "");
  const bool scaling = cfg.precision.loss_scaling();  // fp16 only, unless configured
  double scale = scaling ? cfg.precision.loss_scale.initial : 1.0;
  CpuAdam adam(1);
  const AdamParams hp = AdamParams::from_config(cfg.optimizer);
  std::vector<std::vector<float>> master, m, v;
  std::vector<std::vector<unsigned char>> copy;
  for (std::size_t t = 0; t < kSizes.size(); ++t) {
    master.push_back(initial(t));
    m.emplace_back(kSizes[t], 0.0f);
    v.emplace_back(kSizes[t], 0.0f);
    copy.emplace_back(kSizes[t] * dtype_size(p.pdt));
    for (std::size_t i = 0; i < kSizes[t]; ++i) store_elem(copy[t].data(), i, p.pdt, master[t][i]);
  }
  std::int64_t step = 0;
  for (int s = 0; s < kSteps; ++s) {
    std::vector<std::vector<unsigned char>> sums;
    bool finite = true;
    // torch's averaging: the sum divided by N, then unscaled (AdamStepOptions::grad_divisor).
    const float inv = static_cast<float>(1.0 / scale);
    for (std::size_t t = 0; t < kSizes.size(); ++t) {
      sums.push_back(accumulated_sum(p, s, t));
      for (std::size_t i = 0; i < kSizes[t]; ++i)
        finite = finite && std::isfinite((load_elem(sums[t].data(), i, p.held()) / p.world) * inv);
    }
    if (!finite) {
      ++*skipped;
      if (scaling)
        scale = std::max(cfg.precision.loss_scale.min_scale,
                         scale * cfg.precision.loss_scale.backoff_factor);
      continue;
    }
    ++step;
    for (std::size_t t = 0; t < kSizes.size(); ++t) {
      AdamTensors at{master[t].data(), m[t].data(),    v[t].data(), sums[t].data(),
                     p.held(),         copy[t].data(), p.pdt,       kSizes[t]};
      adam.step(hp, at, AdamStepOptions{step, inv, false, static_cast<float>(p.world)});
    }
  }
  std::vector<std::vector<float>> out;
  for (std::size_t t = 0; t < kSizes.size(); ++t) {
    out.emplace_back(kSizes[t]);
    for (std::size_t i = 0; i < kSizes[t]; ++i) out[t][i] = load_elem(copy[t].data(), i, p.pdt);
  }
  return out;
}

}  // namespace strata::testing
