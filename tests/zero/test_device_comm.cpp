// Collectives run where the buffers live: with a communicator that takes device memory (as NCCL
// does; here DeviceOnlyComm over the in-process one, on the host-emulated device through the
// storage's test seam), every buffer the engine hands it — the backward's buckets, the norm
// agreement, the parameter all-gathers, the initial broadcast, read_state / write_state, and the
// checkpoint's agreements (save and load) — lies in device memory. Numbers: a checkpoint saved and
// loaded under it resumes bitwise. The production refusal (runtime.device: host with a
// device-buffer communicator) stays. Without the engine (engine-less ranks of the checkpoint
// tests): a RankState without staging is refused on every rank, before any shard is written, and
// one with staging saves and loads.
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <filesystem>

#include "../comm/comm_test_util.hpp"
#include "checkpoint/fake_rank.hpp"
#include "ckpt_model.hpp"
#include "device_watch.hpp"
#include "engine_test_util.hpp"
#include "strata/error.hpp"
#include "test_util.hpp"
#include "zero/engine_access.hpp"

namespace strata::testing {
namespace {

using DeviceCommCase = StageWorld;

// The ranks' communicators (device-only wrappers) and each rank's allocation map.
struct World {
  std::vector<std::shared_ptr<AllocationMap>> maps;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<DeviceOnlyComm*> watch;
  explicit World(int n) {
    auto inner = make_inprocess_communicators(n, 30.0);
    for (int r = 0; r < n; ++r) {
      maps.push_back(std::make_shared<AllocationMap>());
      auto c = std::make_unique<DeviceOnlyComm>(std::move(inner[static_cast<std::size_t>(r)]),
                                                maps.back());
      watch.push_back(c.get());
      comms.push_back(std::move(c));
    }
  }
};

// An engine on the rank's watched host device (runtime.device auto resolves to cuda for a
// device-buffer communicator; the seam makes the host-emulated device instead).
std::unique_ptr<Engine> make_engine(const Config& cfg, Communicator& comm,
                                    std::shared_ptr<AllocationMap> map) {
  auto e = std::make_unique<Engine>(cfg, comm);
  zero::StorageWrap w;
  w.make = [map](DeviceKind kind, int) -> std::unique_ptr<Device> {
    EXPECT_EQ(kind, DeviceKind::kCuda);
    return std::make_unique<WatchedDevice>(make_host_device(), map);
  };
  zero::EngineAccess::set_storage_wrap(*e, std::move(w));
  ckpt_register(*e, kCkptSizes);
  return e;
}

class DeviceComm : public ::testing::TestWithParam<DeviceCommCase> {};

TEST_P(DeviceComm, TheEngineAndItsCheckpointsHandItOnlyDeviceMemory) {
  const DeviceCommCase c = GetParam();
  TempDir swap("strata-devcomm-swap"), ckpt("strata-devcomm-ckpt");
  const Config cfg = ckpt_config(c.stage, 0.5, swap.str());  // optimizer state half on NVMe
  ASSERT_EQ(cfg.runtime.device, DeviceKind::kAuto);
  const auto n = static_cast<std::size_t>(c.world);
  std::vector<std::vector<std::vector<float>>> want(n), got(n);
  // Train 5 steps (an overflow skip at step 3), save, read and write a state, one more step.
  {
    World w(c.world);
    rethrow_any(run_ranks(w.comms, [&](int rank, Communicator& comm) {
      auto e = make_engine(cfg, comm, w.maps[static_cast<std::size_t>(rank)]);
      for (int s = 0; s < 5; ++s) ckpt_step(*e, kCkptSizes, rank, s);
      e->save_checkpoint(ckpt.str());
      std::vector<float> m(kCkptSizes[0]);
      e->read_state(0, StateKind::kExpAvg, m);
      e->write_state(0, StateKind::kExpAvg, m);
      ckpt_step(*e, kCkptSizes, rank, 5);
      want[static_cast<std::size_t>(rank)] = read_params(*e, kCkptSizes);
    }));
    for (int r = 0; r < c.world; ++r)
      EXPECT_EQ(w.watch[static_cast<std::size_t>(r)]->host_buffers(), 0u)
          << "rank " << r << ": " << w.watch[static_cast<std::size_t>(r)]->first_host_buffer();
  }
  // New engines load the checkpoint (its agreements under the same communicator) and take the
  // same step.
  {
    World w(c.world);
    rethrow_any(run_ranks(w.comms, [&](int rank, Communicator& comm) {
      auto e = make_engine(cfg, comm, w.maps[static_cast<std::size_t>(rank)]);
      e->load_checkpoint(ckpt.str());
      EXPECT_EQ(e->stats().steps, 5u);
      ckpt_step(*e, kCkptSizes, rank, 5);
      got[static_cast<std::size_t>(rank)] = read_params(*e, kCkptSizes);
    }));
    for (int r = 0; r < c.world; ++r)
      EXPECT_EQ(w.watch[static_cast<std::size_t>(r)]->host_buffers(), 0u)
          << "rank " << r << ": " << w.watch[static_cast<std::size_t>(r)]->first_host_buffer();
  }
  for (std::size_t r = 0; r < n; ++r) expect_bitwise_equal(got[r], want[r], strcat("rank ", r));
}

INSTANTIATE_TEST_SUITE_P(Cases, DeviceComm,
                         ::testing::Values(DeviceCommCase{0, 2}, DeviceCommCase{1, 2},
                                           DeviceCommCase{2, 3}, DeviceCommCase{3, 2},
                                           DeviceCommCase{3, 3}),
                         stage_world_name);

// The seam replaces only the device's making: runtime.device host with a device-buffer
// communicator is still refused, before anything is built.
TEST(DeviceCommRefusal, HostDeviceWithADeviceBufferCommunicatorIsRefused) {
  World w(1);
  Config cfg = ckpt_config(2, 0, "");
  cfg.runtime.device = DeviceKind::kHost;
  try {
    Engine e(cfg, *w.comms[0]);
    FAIL() << "not refused";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), ErrorCode::kUnsupported) << err.what();
  }
}

const std::vector<std::size_t> kFakeSizes{1000, 3, 257};

TEST(DeviceCommCheckpoint, WithoutStagingEveryRankRefusesBeforeWriting) {
  TempDir ckpt("strata-devcomm-ckpt");
  World w(2);
  std::vector<int> codes(2, -1);
  rethrow_any(run_ranks(w.comms, [&](int rank, Communicator& comm) {
    FakeRank f = make_fake_rank(kFakeSizes, 2, rank, 1, DType::kFp32, 7);
    try {
      checkpoint::save_checkpoint(ckpt.str(), f.state, comm);
    } catch (const Error& e) {
      codes[static_cast<std::size_t>(rank)] = static_cast<int>(e.code());
      EXPECT_NE(std::string(e.what()).find("RankState::all_gather"), std::string::npos) << e.what();
    }
  }));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(codes[static_cast<std::size_t>(r)], static_cast<int>(ErrorCode::kInvalidArgument));
    EXPECT_EQ(w.watch[static_cast<std::size_t>(r)]->host_buffers(), 0u);
  }
  for (auto& e : std::filesystem::directory_iterator(ckpt.path()))
    ADD_FAILURE() << "left behind: " << e.path();
}

TEST(DeviceCommCheckpoint, WithStagingEngineLessRanksSaveAndLoad) {
  TempDir ckpt("strata-devcomm-ckpt");
  for (bool load : {false, true}) {
    World w(2);
    rethrow_any(run_ranks(w.comms, [&](int rank, Communicator& comm) {
      WatchedDevice dev(make_host_device(), w.maps[static_cast<std::size_t>(rank)]);
      DeviceMemory buf = dev.allocate(16 * 3);  // 16 B out, 16 B per rank in
      auto* b = static_cast<unsigned char*>(buf.get());
      FakeRank f = make_fake_rank(kFakeSizes, 2, rank, 2, DType::kFp32, load ? 0 : 9);
      f.state.all_gather = [&](const void* send, void* recv, std::size_t bytes) {
        ASSERT_LE(bytes, 16u);
        std::memcpy(b, send, bytes);  // the host device's memory is host memory
        comm.all_gather(b, b + 16, bytes / 4, DType::kFp32);
        std::memcpy(recv, b + 16, 2 * bytes);
      };
      if (load) {
        checkpoint::load_checkpoint(ckpt.str(), f.state, comm);
        EXPECT_EQ(check_fake_rank(f, kFakeSizes, 9, "load"), 0u);
      } else {
        checkpoint::save_checkpoint(ckpt.str(), f.state, comm);
      }
    }));
    for (int r = 0; r < 2; ++r)
      EXPECT_EQ(w.watch[static_cast<std::size_t>(r)]->host_buffers(), 0u)
          << w.watch[static_cast<std::size_t>(r)]->first_host_buffer();
  }
}

}  // namespace
}  // namespace strata::testing
