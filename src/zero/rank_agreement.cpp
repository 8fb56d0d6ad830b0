// What every rank must decide alike (see rank_agreement.hpp).
#include "zero/rank_agreement.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <vector>

#include "comm/rank_status.hpp"
#include "strata/error.hpp"

namespace strata::zero {
namespace {

DeviceMemory allocate_words(Device& device, std::size_t bytes) {
  try {
    return device.allocate(bytes);
  } catch (const Error& e) {
    throw Error(e.code(), strcat("engine: the ranks' agreement buffer (", bytes,
                                 " bytes in the gpu tier): ", e.what()));
  }
}

}  // namespace

RankAgreement::RankAgreement(Communicator& comm, Device& device, std::chrono::milliseconds timeout)
    : comm_(comm),
      rank_(comm.rank()),
      world_(comm.size()),
      timeout_(timeout),
      device_(device),
      stream_(device.create_stream()),
      words_(allocate_words(device, kMaxExchangeBytes * (static_cast<std::size_t>(world_) + 1))) {}

void RankAgreement::exchange(const void* send, void* recv, std::size_t bytes) {
  if (bytes % 4 != 0 || bytes > kMaxExchangeBytes || bytes == 0)
    fail(ErrorCode::kInternal, strcat("engine: an exchange of ", bytes, " bytes (1 to ",
                                      kMaxExchangeBytes / 4, " 4-byte words per rank)"));
  if (world_ == 1) {
    std::memcpy(recv, send, bytes);
    return;
  }
  auto* dev = static_cast<unsigned char*>(words_.get());
  stream_->memcpy_async(dev, send, bytes);
  stream_->synchronize(timeout_);
  comm_.all_gather(dev, dev + kMaxExchangeBytes, bytes / 4, DType::kFp32);
  stream_->memcpy_async(recv, dev + kMaxExchangeBytes, bytes * static_cast<std::size_t>(world_));
  stream_->synchronize(timeout_);
}

// (sum of squares as FP64 bits, finite flag, failed flag) from every rank, summed in rank order.
StepAgreement RankAgreement::agree_step(const AdamGradStats& local, bool failed_here,
                                        bool skipped_here) {
  std::uint32_t mine[4];
  const std::uint64_t bits =
      std::bit_cast<std::uint64_t>(local.finite && !failed_here ? local.sum_sq : 0.0);
  mine[0] = static_cast<std::uint32_t>(bits);
  mine[1] = static_cast<std::uint32_t>(bits >> 32);
  const bool durable = ckpt_.durable && ckpt_.durable();
  mine[2] = (local.finite ? 1u : 0u) | (skipped_here ? 2u : 0u) | (durable ? 4u : 0u);
  mine[3] = failed_here ? 1u : 0u;
  std::vector<std::uint32_t> all(4 * static_cast<std::size_t>(world_));
  exchange(mine, all.data(), sizeof(mine));
  StepAgreement a;
  bool durable_everywhere = static_cast<bool>(ckpt_.everywhere);
  for (int r = 0; r < world_; ++r) {
    const std::uint32_t* p = all.data() + 4 * r;
    durable_everywhere = durable_everywhere && (p[2] & 4u) != 0u;
    if (p[3] != 0u && r != rank_ && a.failed_peer < 0) a.failed_peer = r;
    a.finite = a.finite && (p[2] & 1u) != 0u;
    a.any_skipped = a.any_skipped || (p[2] & 2u) != 0u;
    a.sum_sq += std::bit_cast<double>(static_cast<std::uint64_t>(p[0]) |
                                      (static_cast<std::uint64_t>(p[1]) << 32));
  }
  if (durable_everywhere) ckpt_.everywhere();
  return a;
}

void RankAgreement::set_checkpoint_hooks(CheckpointHooks hooks) { ckpt_ = std::move(hooks); }

std::vector<bool> RankAgreement::agree_used(const std::vector<bool>& used) {
  const std::size_t words = (used.size() + 31) / 32, bytes = 4 * std::max<std::size_t>(words, 1);
  std::vector<std::uint32_t> mine(bytes / 4, 0u);
  for (std::size_t i = 0; i < used.size(); ++i)
    if (used[i]) mine[i / 32] |= 1u << (i % 32);
  std::vector<std::uint32_t> all(mine.size() * static_cast<std::size_t>(world_));
  if (world_ == 1) {
    all = mine;
  } else {
    DeviceMemory buf = allocate_words(device_, bytes * (static_cast<std::size_t>(world_) + 1));
    auto* dev = static_cast<unsigned char*>(buf.get());
    stream_->memcpy_async(dev, mine.data(), bytes);
    stream_->synchronize(timeout_);
    comm_.all_gather(dev, dev + bytes, bytes / 4, DType::kFp32);
    stream_->memcpy_async(all.data(), dev + bytes, bytes * static_cast<std::size_t>(world_));
    stream_->synchronize(timeout_);
  }
  std::vector<bool> any(used.size(), false);
  for (std::size_t r = 0; r < static_cast<std::size_t>(world_); ++r)
    for (std::size_t i = 0; i < used.size(); ++i)
      if ((all[r * mine.size() + i / 32] >> (i % 32)) & 1u) any[i] = true;
  return any;
}

int RankAgreement::agree_outcome(bool ok_here) {
  if (ckpt_.step_ended) ckpt_.step_ended();
  if (world_ == 1) return -1;
  const std::uint32_t mine[1] = {ok_here ? 0u : 1u};
  std::vector<std::uint32_t> all(static_cast<std::size_t>(world_));
  exchange(mine, all.data(), sizeof(mine));
  for (int r = 0; r < world_; ++r)
    if (r != rank_ && all[static_cast<std::size_t>(r)] != 0u) return r;
  return -1;
}

void RankAgreement::agree_start(const std::exception_ptr& failure) {
  const auto all =
      exchange_status(RankStatus::of(failure), world_,
                      [this](const void* s, void* r, std::size_t b) { exchange(s, r, b); });
  const int peer = first_failed_peer(all, rank_);
  if (failure || peer < 0) return;
  const RankStatus& p = all[static_cast<std::size_t>(peer)];
  const int errnum = static_cast<int>(p.extra);
  fail(ErrorCode::kComm,
       strcat("engine rank ", rank_, ": rank ", peer, " failed at start-up (",
              error_code_name(p.code), errnum > 0 ? strcat(": ", std::strerror(errnum)) : "",
              "; its own error names the cause), so this rank stops too"));
}

void RankAgreement::fail_for_peer(int peer, const char* phase) const {
  fail(ErrorCode::kComm,
       strcat("engine rank ", rank_, ": rank ", peer, " failed in this step's ", phase,
              " (its own error names the cause); the step did not complete on every rank, so "
              "this rank stops too: build new engines and load_checkpoint() the last checkpoint "
              "on every rank"));
}

}  // namespace strata::zero
