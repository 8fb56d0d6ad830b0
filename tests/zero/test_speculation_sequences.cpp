// Call sequences around the speculative update (optimizer.overlap: on) that a loop can make
// between the backward's gradients and step(): a clip decision dropped with its gradients, a
// hyper-parameter changed and changed back inside one backward, the state written between steps
// or before finalize(). Each is compared bitwise with the same sequence run serially (overlap
// off): master weights, both moments and every tensor's step count.
#include <gtest/gtest.h>

#include <bit>
#include <functional>
#include <random>

#include "../comm/comm_test_util.hpp"
#include "engine_basics.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

constexpr std::size_t kTensors = 4;
constexpr std::size_t kElems = 3000;  // two buckets of 2000 cut the tensors unevenly

Config sequence_config(bool overlap) {
  Config cfg = small_engine_config(2, 2000, 1000, 30.0);
  cfg.offload.optimizer = {Tier::kCpu, 1.0, false};
  cfg.optimizer.lr = 0.01;
  cfg.optimizer.weight_decay = 0.1;
  cfg.runtime.cpu_threads = 1;
  cfg.optimizer.overlap = overlap ? OptimizerOverlap::kOn : OptimizerOverlap::kOff;
  return cfg;
}

std::vector<float> values(std::uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(kElems);
  for (float& x : v) x = d(rng);
  return v;
}

struct SeqRun {
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Engine> e;
  bool overlap;
  explicit SeqRun(bool on) : overlap(on) {
    comm = std::move(make_inprocess_communicators(1, 30.0)[0]);
    e = std::make_unique<Engine>(sequence_config(on), *comm);
    for (std::size_t t = 0; t < kTensors; ++t)
      e->add_parameter("t" + std::to_string(t), values(100 + t, 0.5f));
  }
  void grad(int step, std::size_t t) {
    const std::vector<float> g = values(1000 * static_cast<std::uint64_t>(step) + t, 0.01f);
    e->set_gradient_host(t, g.data());
  }
  // Every tensor's gradient of `step` in backward order (the last tensor first), `skip` skipped.
  void backward(int step, int skip = -1) {
    for (std::size_t t = kTensors; t-- > 0;) {
      if (static_cast<int>(t) == skip)
        e->skip_gradient(t);
      else
        grad(step, t);
    }
  }
};

// Master, moments and step counts of both runs, bit for bit.
void expect_same_state(Engine& on, Engine& off) {
  for (std::size_t t = 0; t < kTensors; ++t) {
    EXPECT_EQ(on.optimizer_step(t), off.optimizer_step(t)) << "tensor " << t;
    for (StateKind k : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
      std::vector<float> a(kElems), b(kElems);
      on.read_state(t, k, a);
      off.read_state(t, k, b);
      for (std::size_t i = 0; i < kElems; ++i)
        ASSERT_EQ(std::bit_cast<std::uint32_t>(a[i]), std::bit_cast<std::uint32_t>(b[i]))
            << "tensor " << t << " state " << static_cast<int>(k) << " element " << i;
    }
  }
}

// Runs `seq` on an overlapped and a serial engine; the overlapped one must have speculated.
void compare(const std::function<void(SeqRun&)>& seq) {
  SeqRun on(true), off(false);
  on.e->finalize();
  off.e->finalize();
  seq(on);
  seq(off);
  EXPECT_GT(on.e->stats().speculated_chunks, 0u);
  EXPECT_EQ(off.e->stats().speculated_chunks, 0u);
  expect_same_state(*on.e, *off.e);
}

// A clip decision that skipped t2 (no gradient) is dropped with its gradients; the retry uses t2.
// The counts already differ (t0 skipped in step 0), so a stale decision would freeze t2's update.
TEST(SpeculationSequences, AClipDecisionDroppedWithItsGradientsIsForgotten) {
  compare([](SeqRun& r) {
    r.backward(0, 0);
    r.e->step();
    r.backward(1, 2);
    r.e->clip_grad_norm(1e9);
    r.e->discard_gradients();
    r.backward(1);
    const StepResult s = r.e->step();
    EXPECT_TRUE(s.applied);
  });
}

// lr changed after two tensors' gradients and changed back before the last: the chunks
// speculated with 0.05 must not be committed as if the step had run with 0.01 throughout.
TEST(SpeculationSequences, AHyperParameterChangedAndUndoneInOneBackward) {
  for (int which = 0; which < 4; ++which) {
    SCOPED_TRACE(which);
    compare([which](SeqRun& r) {
      r.backward(0);  // speculated and committed: the counter above is not this step's alone
      r.e->step();
      auto set = [&](double x) {
        if (which == 0) r.e->set_lr(x);
        if (which == 1) r.e->set_weight_decay(x);
        if (which == 2) r.e->set_betas(0.9, 0.999 - x);
        if (which == 3) r.e->set_eps(x);
      };
      const double before = which == 0 ? 0.01 : which == 1 ? 0.1 : which == 2 ? 0.0 : 1e-8;
      r.grad(1, 3);
      r.grad(1, 2);
      set(0.05);
      r.grad(1, 1);
      set(before);
      r.grad(1, 0);
      // (Whether chunks were speculated before the change is timing: the fills of the first
      // hand-ins may complete after it. Either way the counts add up and the state is serial.)
      const StepResult s = r.e->step();
      EXPECT_EQ(s.speculated_chunks, s.committed_chunks + s.rolled_back_chunks);
    });
  }
}

// State written between steps (a resume's load_state_dict) leaves the next step overlapped, and
// equal to the serial one.
TEST(SpeculationSequences, StateWrittenBetweenStepsKeepsTheNextStepOverlapped) {
  SeqRun on(true), off(false);
  for (SeqRun* r : {&on, &off}) {
    r->e->finalize();
    r->backward(0);
    r->e->step();
    const std::vector<float> m = values(7, 0.1f);
    r->e->write_state(1, StateKind::kMaster, m);
    r->e->set_optimizer_step(3);
    r->backward(1);
    const StepResult s = r->e->step();
    EXPECT_EQ(s.speculated_chunks > 0, r == &on);
    EXPECT_EQ(s.committed_chunks, s.speculated_chunks);
  }
  expect_same_state(*on.e, *off.e);
}

// The master written after the last gradient and before step() (strata.torch: weights the loop
// wrote then): what was speculated from the old master is discarded (rolled back) and the step
// runs from the new one, as the serial engine does.
TEST(SpeculationSequences, StateWrittenAfterTheGradientsIsSteppedFrom) {
  compare([](SeqRun& r) {
    r.backward(0);
    r.e->step();
    r.backward(1);
    r.e->write_state(2, StateKind::kMaster, values(9, 0.2f));
    const StepResult s = r.e->step();
    EXPECT_TRUE(s.applied);
    EXPECT_EQ(s.rolled_back_chunks > 0, r.overlap);
    EXPECT_EQ(s.committed_chunks, 0u);
  });
}

// More micro-batches than train.accumulate (1): the second one's hand-ins add into the gradients
// the speculation of the first may still be reading; it is stopped before them (it was stopped
// after the first of them), nothing speculated is committed, and the step is the serial one. (The
// read/add overlap itself is a matter of timing: TSan reported none here either way.)
TEST(SpeculationSequences, AMicroBatchBeyondAccumulateStopsTheSpeculation) {
  compare([](SeqRun& r) {
    r.backward(0);
    r.e->step();
    r.backward(1);
    r.backward(2);
    const StepResult s = r.e->step();
    EXPECT_TRUE(s.applied);
    EXPECT_EQ(s.committed_chunks, 0u);
    // What was speculated in micro-batch 1 is reported rolled back (it was not reported at all).
    EXPECT_EQ(s.rolled_back_chunks > 0, r.overlap);
    EXPECT_EQ(s.speculated_chunks, s.committed_chunks + s.rolled_back_chunks);
  });
}

// A loop that accumulates 3 micro-batches while train.accumulate says 1: the first step's
// speculation (in micro-batch 1) is discarded; from the next step on the engine expects 3 and
// speculates in the third, committed. Bitwise the serial steps throughout.
TEST(SpeculationSequences, TheLoopsMicroBatchCountIsLearned) {
  compare([](SeqRun& r) {
    for (int step = 0; step < 3; ++step) {
      for (int micro = 0; micro < 3; ++micro) r.backward(10 * step + micro);
      const StepResult s = r.e->step();
      EXPECT_TRUE(s.applied);
      if (!r.overlap) continue;
      if (step == 0) {
        EXPECT_EQ(s.committed_chunks, 0u);
      } else {
        EXPECT_GT(s.committed_chunks, 0u) << "step " << step;
      }
    }
  });
}

// Before finalize() there is no state: an error that says so, not a crash.
TEST(SpeculationSequences, StateCallsBeforeFinalizeAreRefused) {
  SeqRun r(true);
  const std::vector<float> v(kElems, 1.0f);
  expect_error(ErrorCode::kInvalidArgument, "finalize",
               [&] { r.e->write_state(0, StateKind::kMaster, v); });
  expect_error(ErrorCode::kInvalidArgument, "finalize", [&] { r.e->set_optimizer_step(1); });
}

}  // namespace
}  // namespace strata::testing
