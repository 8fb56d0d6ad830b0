// UpdateSplit (update_split.hpp): the device's share of a chunk's Adam beside the CPU's.
#include "zero/update_split.hpp"

#include <algorithm>
#include <cmath>

#include "strata/error.hpp"

namespace strata::zero {

namespace {
// Before both sides were measured: the device takes this share (its rate is then measured too).
constexpr double kFirstShare = 0.25;
// A new measure's weight in the rates (the rest: the rates so far).
constexpr double kRateWeight = 0.5;

double seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

void blend(double& rate, std::size_t n, double s) {
  if (n == 0 || !(s > 0)) return;
  const double r = double(n) / s;
  rate = rate > 0 ? (1 - kRateWeight) * rate + kRateWeight * r : r;
}
}  // namespace

UpdateSplit::UpdateSplit(Device& device, unsigned cpu_threads, std::chrono::milliseconds timeout,
                         std::size_t window_elements, std::function<double(std::size_t)> forced)
    : forced_(std::move(forced)),
      window_(window_elements),
      device_(std::make_unique<DeviceAdam>(device, cpu_threads, timeout)) {}

std::size_t UpdateSplit::device_share(std::size_t chunk, std::size_t n) const {
  double share = kFirstShare;
  if (forced_) {
    share = forced_(chunk);
  } else if (cpu_rate_ > 0 && device_rate_ > 0) {
    share = device_rate_ / (device_rate_ + cpu_rate_);  // both sides finish together
  }
  if (!(share >= 0 && share <= 1))
    fail(ErrorCode::kInternal, strcat("update split: share ", share, " of chunk ", chunk));
  const auto d = static_cast<std::size_t>(std::llround(share * double(n)));
  return std::min({d, n, window_});
}

void UpdateSplit::run(std::size_t device_n, std::size_t n,
                      const std::function<void()>& queue_device,
                      const std::function<void()>& run_cpu) {
  const auto t0 = std::chrono::steady_clock::now();
  queue_device();
  const auto t1 = std::chrono::steady_clock::now();
  try {
    run_cpu();
  } catch (...) {
    try {
      device_->wait();  // its arrays are the chunk's: nothing may still write them
    } catch (...) {
    }
    throw;
  }
  const auto t2 = std::chrono::steady_clock::now();
  device_->wait();
  blend(cpu_rate_, n - device_n, seconds(t2 - t1));
  if (device_n) blend(device_rate_, device_n, seconds(device_->completed_at() - t0));
  cpu_elements_ += n - device_n;
  device_elements_ += device_n;
}

}  // namespace strata::zero
