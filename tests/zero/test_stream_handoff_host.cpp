// The engine's stream hand-offs (F7, issue 27) on the host-emulated device: it has no native
// streams, so the null handle is the only one (a no-op: host code is ordered by the call itself)
// and any other is refused before anything changes. The CUDA side: test_stream_handoff_cuda.cpp.
#include <gtest/gtest.h>

#include <bit>

#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"

namespace strata::testing {
namespace {

Config host_config() {
  Config cfg;
  cfg.runtime.device = DeviceKind::kHost;
  cfg.runtime.cpu_threads = 1;
  cfg.optimizer.lr = 1e-2;
  return cfg;
}

std::vector<float> one_step(bool with_handles) {
  auto comm = make_inprocess_communicators(1, 30.0);
  Engine e(host_config(), *comm[0]);
  const std::vector<float> w{0.5f, -1.0f, 2.0f, 0.25f};
  const TensorId id = e.add_parameter("w", w);
  e.finalize();
  const std::vector<float> g{0.1f, -0.2f, 0.3f, -0.4f};
  if (with_handles) {
    int not_a_stream = 0;
    expect_error(ErrorCode::kInvalidArgument, "host-emulated",
                 [&] { e.set_gradient(id, g.data(), &not_a_stream); });
    e.set_gradient(id, g.data(), nullptr);  // the engine is still usable, nothing handed in yet
    expect_error(ErrorCode::kInvalidArgument, "host-emulated", [&] { e.step(&not_a_stream); });
    EXPECT_TRUE(e.step(nullptr).applied);
  } else {
    e.set_gradient(id, g.data());
    EXPECT_TRUE(e.step().applied);
  }
  std::vector<float> out(w.size());
  e.read_param(id, out);
  return out;
}

TEST(StreamHandOffHost, TheNullHandleIsANoOpAndAnyOtherIsRefusedChangingNothing) {
  const auto plain = one_step(false), handed = one_step(true);
  ASSERT_EQ(plain.size(), handed.size());
  for (std::size_t i = 0; i < plain.size(); ++i)
    EXPECT_EQ(std::bit_cast<std::uint32_t>(plain[i]), std::bit_cast<std::uint32_t>(handed[i]))
        << "element " << i;
}

}  // namespace
}  // namespace strata::testing
