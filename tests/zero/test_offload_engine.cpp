// The Engine with its optimizer state streamed from NVMe (offload.optimizer.tier nvme) against the
// same run with everything resident: FP32 parameters bitwise identical after 22 steps that include
// overflow-skipped steps, stages 1-3, 1-4 in-process ranks, NVMe fractions 1 and 0.3, pools of
// 1, 2 and 4 buffers (several chunks per sub-group and several sub-groups per chunk pool).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <map>
#include <random>

#include "../comm/comm_test_util.hpp"
#include "ckpt_model.hpp"
#include "strata/engine.hpp"
#include "strata/device.hpp"
#include "strata/device_fault.hpp"
#include "strata/error.hpp"
#include "strata/io_fault.hpp"
#include "test_util.hpp"
#include "zero/offload_store.hpp"

namespace strata::testing {
namespace {

struct RunSpec {
  int stage = 1;
  int world = 1;
  double fraction = 0;  // 0: resident
  double grad_fraction = 0;  // offload.gradients on nvme (stage >= 2); 0: resident
  double param_fraction = 0;  // offload.params on nvme (stage 3); 0: resident
  std::uint32_t buffers = 4;
  std::uint64_t buffer_size = 3 * 4096;
  int steps = 22;
  bool device_update = false;  // optimizer.update: device on the host-emulated device
};

Config offload_config(const RunSpec& r, const std::string& dir) {
  Config cfg;
  cfg.zero.stage = r.stage;
  cfg.zero.reduce_bucket_size = 2000;
  cfg.zero.sub_group_size = 2500;  // cut inside chunks of 1024/2048 elements
  cfg.precision.params = DType::kFp32;
  cfg.precision.grads = DType::kFp32;
  cfg.optimizer.type = OptimizerType::kAdamW;
  cfg.optimizer.lr = 1e-2;
  cfg.optimizer.weight_decay = 0.01;
  cfg.optimizer.grad_clip = 1.0;
  cfg.runtime.cpu_threads = 1;
  cfg.runtime.collective_timeout_s = 30.0;
  if (r.device_update) {
    cfg.optimizer.update = OptimizerUpdate::kDevice;
    cfg.runtime.device = DeviceKind::kHost;
  }
  if (r.grad_fraction > 0) {
    cfg.offload.gradients.tier = Tier::kNvme;
    cfg.offload.gradients.fraction = r.grad_fraction;
  }
  if (r.param_fraction > 0) {
    cfg.offload.params.tier = Tier::kNvme;
    cfg.offload.params.fraction = r.param_fraction;
  }
  if (r.fraction > 0 || r.grad_fraction > 0 || r.param_fraction > 0) {
    if (r.fraction > 0) {
      cfg.offload.optimizer.tier = Tier::kNvme;
      cfg.offload.optimizer.fraction = r.fraction;
    }
    cfg.tiers.host.buffer_count = r.buffers;
    cfg.tiers.host.buffer_size = r.buffer_size;
    cfg.tiers.nvme.paths = {dir};
    cfg.tiers.nvme.engine = IoEngineKind::kThreads;
    cfg.tiers.nvme.queue_depth = 4;
  }
  return cfg;
}

const std::vector<std::size_t> kSizes{3001, 7, 0, 5120, 129, 4000, 1};

// Rank-distinct random FP32 gradients; steps 4 and 11 carry an inf / NaN on the last rank, so the
// step is skipped on every rank.
std::vector<float> gradient(std::uint64_t seed, int rank, int world, int step, std::size_t t, std::size_t n) {
  std::mt19937_64 rng(seed ^ (static_cast<std::uint64_t>(rank) << 40) ^ (static_cast<std::uint64_t>(step) << 20) ^ t);
  std::normal_distribution<float> d(0.0f, 0.5f);
  std::vector<float> g(n);
  for (auto& x : g) x = d(rng);
  if (n > 3 && rank == world - 1 && (step == 4 || step == 11) && t == 3)
    g[n / 2] = step == 4 ? std::numeric_limits<float>::infinity() : std::nanf("");
  return g;
}

std::vector<std::vector<float>> train(Communicator& comm, const RunSpec& run, const std::string& dir,
                                      std::uint64_t seed, int* skipped) {
  Engine e(offload_config(run, dir), comm);
  std::vector<TensorId> ids;
  for (std::size_t t = 0; t < kSizes.size(); ++t) {
    std::mt19937_64 rng(seed + t);
    std::uniform_real_distribution<float> d(-1, 1);
    std::vector<float> init(kSizes[t]);
    for (auto& x : init) x = d(rng);
    ids.push_back(e.add_parameter("t" + std::to_string(t), init));
  }
  e.finalize();
  for (int s = 0; s < run.steps; ++s) {
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
      auto g = gradient(seed, comm.rank(), comm.size(), s, *it, kSizes[*it]);
      e.set_gradient(*it, g.data());
    }
    if (!e.step().applied) ++*skipped;
  }
  return ckpt_params(e, kSizes);  // ids are 0..kSizes.size()-1
}

std::vector<std::vector<std::vector<float>>> run_world(const RunSpec& r, std::uint64_t seed, int* skipped) {
  TempDir dir("strata-offload");
  auto comms = make_inprocess_communicators(r.world, 30.0);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(r.world));
  std::vector<int> skips(static_cast<std::size_t>(r.world), 0);
  rethrow_any(run_ranks(comms, [&](int rank, Communicator& comm) {
    got[static_cast<std::size_t>(rank)] = train(comm, r, dir.str(), seed, &skips[static_cast<std::size_t>(rank)]);
  }));
  *skipped = skips[0];
  // Swap directories are gone once the engines are.
  std::size_t left = 0;
  for (auto& entry : std::filesystem::directory_iterator(dir.path())) left += entry.path().empty() ? 0 : 1;
  EXPECT_EQ(left, 0u) << "swap files left behind";
  return got;
}

class OffloadMatchesResident : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(OffloadMatchesResident, Bitwise) {
  const auto [stage, world] = GetParam();
  const auto seed = test_seed("offload-engine");
  RunSpec base;
  base.stage = stage;
  base.world = world;
  int skipped_ref = 0;
  auto want = run_world(base, seed, &skipped_ref);
  EXPECT_EQ(skipped_ref, 2);
  struct Variant {
    double fraction;
    std::uint32_t buffers;
    std::uint64_t size;
    double grads = 0;  // offload.gradients fraction on nvme (stage >= 2 only)
    double params = 0;  // offload.params fraction on nvme (stage 3 only)
    bool device = false;  // optimizer.update: device (host-emulated)
  };
  std::vector<Variant> variants{Variant{1.0, 4, 3 * 4096}, Variant{1.0, 1, 6 * 4096},
                                Variant{0.3, 2, 3 * 4096}, Variant{1.0, 3, 1 << 20}};
  // Adam on the device after a host-to-device copy: from the pinned buffers and from host memory.
  variants.push_back(Variant{1.0, 3, 3 * 4096, 0, 0, true});
  variants.push_back(Variant{0.0, 4, 3 * 4096, 0, 0, true});
  if (stage >= 2) {  // gradients on NVMe, with and without the optimizer state there
    variants.push_back(Variant{1.0, 2, 3 * 4096, 1.0});
    variants.push_back(Variant{0.0, 4, 4096, 0.3});
  }
  if (stage == 3) {  // parameters on NVMe too (read at each gather, written after each step)
    variants.push_back(Variant{1.0, 2, 3 * 4096, 1.0, 1.0});
    variants.push_back(Variant{0.0, 1, 4096, 0.0, 0.3});
  }
  for (Variant v : variants) {
    RunSpec r = base;
    r.fraction = v.fraction;
    r.grad_fraction = v.grads;
    r.param_fraction = v.params;
    r.buffers = v.buffers;
    r.buffer_size = v.size;
    r.device_update = v.device;
    int skipped = 0;
    auto got = run_world(r, seed, &skipped);
    EXPECT_EQ(skipped, 2);
    for (int k = 0; k < world; ++k)
      for (std::size_t t = 0; t < kSizes.size(); ++t)
        for (std::size_t i = 0; i < kSizes[t]; ++i)
          ASSERT_EQ(std::bit_cast<std::uint32_t>(got[k][t][i]), std::bit_cast<std::uint32_t>(want[k][t][i]))
              << "fraction " << v.fraction << " grads " << v.grads << " params " << v.params << " device " << v.device << " buffers " << v.buffers << " size " << v.size << " rank "
              << k << " tensor " << t << " element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, OffloadMatchesResident,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(1, 2, 3, 4)),
                         [](const auto& info) {
                           return strcat("stage", std::get<0>(info.param), "_world", std::get<1>(info.param));
                         });

TEST(OffloadEngine, BufferBelowMinimumSaysWhatIsNeeded) {
  TempDir dir("strata-offload");
  RunSpec r;
  r.fraction = 1.0;
  r.buffer_size = 8192;
  auto comms = make_inprocess_communicators(1, 30.0);
  Engine e(offload_config(r, dir.str()), *comms[0]);
  e.add_parameter("w", std::vector<float>(5000, 0.5f));
  try {
    e.finalize();
    FAIL() << "finalize accepted an 8 KiB buffer";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(err.what()).find("12288"), std::string::npos) << err.what();
  }
}

// The single-rank engine tests below: kSizes tensors, tensor t filled with value + t * per_tensor.
std::vector<TensorId> add_constant_tensors(Engine& e, float value, float per_tensor = 0.0f) {
  std::vector<TensorId> ids;
  for (std::size_t t = 0; t < kSizes.size(); ++t)
    ids.push_back(e.add_parameter("t" + std::to_string(t),
                                  std::vector<float>(kSizes[t], value + static_cast<float>(t) * per_tensor)));
  return ids;
}

// Hands in every gradient of one rank-0 / world-1 step in backward order (last tensor first).
void hand_in_gradients(Engine& e, const std::vector<TensorId>& ids, std::uint64_t seed, int step) {
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    auto g = gradient(seed, 0, 1, step, *it, kSizes[*it]);
    e.set_gradient(*it, g.data());
  }
}

// offload.gradients / offload.params on NVMe with the optimizer state resident: an I/O fault in
// the gradient spill (written after the reduce-scatter, read back by Adam) or in the parameter
// write-back fails the step with an IoError naming the array, the swap path and errno, and the
// engine then refuses further steps and checkpoints (its state may mix two steps) until a new
// engine loads a checkpoint. A failed read at a stage-3 gather changes nothing: the gather can be
// retried.
TEST(OffloadEngine, GradientAndParameterFaultsFailTheStep) {
  struct Case {
    const char* what;
    IoOp op;
    int errnum;
    bool at_gather;
  };
  const Case cases[] = {{"gradients", IoOp::kRead, EIO, false},
                        {"gradients", IoOp::kWrite, ENOSPC, false},
                        {"parameters", IoOp::kWrite, EIO, false},
                        {"parameters", IoOp::kRead, EIO, true}};
  for (const Case& c : cases) {
    SCOPED_TRACE(strcat(c.what, " ", io_op_name(c.op), " errno ", c.errnum));
    TempDir dir("strata-offload-fault");
    RunSpec r;
    r.stage = 3;
    r.grad_fraction = 1.0;
    r.param_fraction = 1.0;
    r.buffers = 2;
    r.buffer_size = 4096;
    std::map<std::string, FaultInjectingIoEngine*> engines;
    zero::set_offload_io_wrapper([&](std::unique_ptr<IoEngine> e, const std::string& what, int) {
      auto f = std::make_shared<FaultInjectingIoEngine>(std::move(e));
      engines[what] = f.get();
      return std::shared_ptr<IoEngine>(f);
    });
    auto comms = make_inprocess_communicators(1, 30.0);
    Engine e(offload_config(r, dir.str()), *comms[0]);
    const std::vector<TensorId> ids = add_constant_tensors(e, 0.5f, 1.0f);
    e.finalize();  // builds the state and its I/O engines
    zero::set_offload_io_wrapper(nullptr);
    ASSERT_EQ(engines.count("gradients"), 1u);
    ASSERT_EQ(engines.count("parameters"), 1u);
    EXPECT_EQ(engines.count("optimizer"), 0u);  // resident
    auto one_step = [&](int s) {
      hand_in_gradients(e, ids, 99, s + 20);
      return e.step();
    };
    ASSERT_TRUE(one_step(0).applied);
    IoFault fault = IoFault::fail_nth(2, c.errnum, c.op);
    engines[c.what]->add_fault(fault);
    if (c.at_gather) {
      try {
        e.gather(ids);
        FAIL() << "gather ignored a failed parameter read";
      } catch (const IoError& err) {
        EXPECT_EQ(err.errnum(), c.errnum) << err.what();
        EXPECT_NE(std::string(err.what()).find(dir.str()), std::string::npos) << err.what();
        EXPECT_NE(std::string(err.what()).find("nvme parameters"), std::string::npos) << err.what();
      }
      engines[c.what]->clear_faults();
      e.release(ids);
      e.gather(ids);  // retried: nothing had changed
      std::vector<float> p(kSizes[0]);
      e.read_param(ids[0], p);
      for (float x : p) ASSERT_TRUE(std::isfinite(x));
      e.release(ids);
      EXPECT_TRUE(one_step(1).applied);
      continue;
    }
    try {
      one_step(1);
      FAIL() << "the step ignored the fault";
    } catch (const IoError& err) {
      const std::string msg = err.what();
      EXPECT_EQ(err.errnum(), c.errnum) << msg;
      EXPECT_NE(msg.find(dir.str()), std::string::npos) << msg;
      EXPECT_NE(msg.find(strcat("nvme ", c.what)), std::string::npos) << msg;
    }
    engines[c.what]->clear_faults();
    for (int attempt = 0; attempt < 2; ++attempt) {
      try {
        if (attempt == 0) one_step(2);
        else e.save_checkpoint((dir.path() / "ckpt").string());
        FAIL() << (attempt == 0 ? "step" : "save_checkpoint") << " accepted after a failed step";
      } catch (const Error& err) {
        EXPECT_EQ(err.code(), ErrorCode::kIo) << err.what();
        EXPECT_NE(std::string(err.what()).find("unusable after a failed step"), std::string::npos) << err.what();
        EXPECT_NE(std::string(err.what()).find("load_checkpoint"), std::string::npos) << err.what();
      }
    }
  }
}

// optimizer.update: device with a failing device copy in the middle of the step: the step throws
// Error(kDevice), the NVMe store reports the partial update, and the engine refuses further steps.
TEST(OffloadEngine, DeviceFaultDuringTheUpdateFailsTheStep) {
  TempDir dir("strata-offload-devfault");
  RunSpec r;
  r.stage = 2;
  r.fraction = 1.0;
  r.buffers = 3;
  r.device_update = true;
  FaultInjectingDevice* faults = nullptr;
  zero::set_optimizer_device_wrapper([&](std::unique_ptr<Device> d) -> std::unique_ptr<Device> {
    auto f = std::make_unique<FaultInjectingDevice>(std::move(d));
    faults = f.get();
    return f;
  });
  auto comms = make_inprocess_communicators(1, 30.0);
  Engine e(offload_config(r, dir.str()), *comms[0]);
  const std::vector<TensorId> ids = add_constant_tensors(e, 0.25f);
  e.finalize();
  zero::set_optimizer_device_wrapper(nullptr);
  ASSERT_NE(faults, nullptr);
  auto one_step = [&](int s) {
    hand_in_gradients(e, ids, 5, s + 30);
    return e.step();
  };
  ASSERT_TRUE(one_step(0).applied);
  const std::size_t id = faults->add_fault({DeviceFaultKind::kCopyFail, 11, 1, {}});  // 3rd update's copy in
  try {
    one_step(1);
    FAIL() << "the failed device copy went unnoticed";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), ErrorCode::kDevice) << err.what();
    EXPECT_NE(std::string(err.what()).find("partially updated"), std::string::npos) << err.what();
  }
  EXPECT_EQ(faults->fired(id), 1u);
  try {
    one_step(2);
    FAIL() << "a step was accepted after a failed one";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), ErrorCode::kIo) << err.what();
  }
}

// A usage error in step() (a gradient missing) changes nothing and does not fail the engine.
TEST(OffloadEngine, MissingGradientIsAUsageErrorNotAFailedStep) {
  TempDir dir("strata-offload-usage");
  RunSpec r;
  r.stage = 2;
  r.fraction = 1.0;
  auto comms = make_inprocess_communicators(1, 30.0);
  Engine e(offload_config(r, dir.str()), *comms[0]);
  const std::vector<TensorId> ids = add_constant_tensors(e, 0.5f);
  e.finalize();
  for (std::size_t t = 1; t < kSizes.size(); ++t) {
    auto g = gradient(3, 0, 1, 0, t, kSizes[t]);
    e.set_gradient(ids[t], g.data());
  }
  try {
    e.step();
    FAIL() << "step() without every gradient";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), ErrorCode::kInvalidArgument) << err.what();
  }
  auto g = gradient(3, 0, 1, 0, 0, kSizes[0]);
  e.set_gradient(ids[0], g.data());
  EXPECT_TRUE(e.step().applied);
}

// offload.gradients on NVMe: the reduced gradients are spilled bucket by bucket during the
// backward (written before step() is called), not collected whole in host memory first.
TEST(OffloadEngine, GradientsSpillDuringTheBackward) {
  TempDir dir("strata-offload-spill");
  RunSpec r;
  r.stage = 2;
  r.grad_fraction = 1.0;
  r.buffers = 2;
  r.buffer_size = 4096;
  FaultInjectingIoEngine* grads = nullptr;
  zero::set_offload_io_wrapper([&](std::unique_ptr<IoEngine> e, const std::string& what, int) {
    auto f = std::make_shared<FaultInjectingIoEngine>(std::move(e));
    if (what == "gradients") grads = f.get();
    return std::shared_ptr<IoEngine>(f);
  });
  auto comms = make_inprocess_communicators(1, 30.0);
  Engine e(offload_config(r, dir.str()), *comms[0]);
  const std::vector<TensorId> ids = add_constant_tensors(e, 0.5f);
  std::size_t total = 0;
  for (std::size_t n : kSizes) total += n;
  e.finalize();
  zero::set_offload_io_wrapper(nullptr);
  ASSERT_NE(grads, nullptr);
  for (int s = 0; s < 2; ++s) {
    const std::uint64_t before = grads->stats().bytes_written;
    hand_in_gradients(e, ids, 17, s);
    const std::uint64_t during = grads->stats().bytes_written - before;
    EXPECT_GT(during, 0u) << "step " << s << ": nothing spilled before step()";
    e.step();
    // Everything (the partition, 4 KiB chunks) is on NVMe once the step has run.
    EXPECT_GE(grads->stats().bytes_written - before, total * sizeof(float)) << "step " << s;
  }
  EXPECT_GT(e.stats().grad_spill_s, 0.0);
}

}  // namespace
}  // namespace strata::testing
