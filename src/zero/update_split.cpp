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

std::size_t split_elements(std::size_t n, double cpu_rate, double device_rate, double left_s,
                           std::size_t queued) {
  const double both = double(n) * device_rate / (device_rate + cpu_rate);  // finish together
  const double budget = left_s - double(queued) / cpu_rate;  // the chunk's time before the end
  double d = both;
  if (budget > 0) {
    const double cpu_can = budget * cpu_rate;
    if (cpu_can >= double(n)) {
      d = 0;  // the CPU alone finishes it in time
    } else if (double(n) - cpu_can <= budget * device_rate) {
      d = double(n) - cpu_can;  // the device takes only what the CPU cannot do in time
    }
  }
  return std::min(n, static_cast<std::size_t>(std::llround(std::max(d, 0.0))));
}

void UpdateSplit::set_backward_end(std::optional<std::chrono::steady_clock::time_point> end) {
  end_ns_ =
      end ? std::max<std::int64_t>(
                1, std::chrono::duration_cast<std::chrono::nanoseconds>(end->time_since_epoch())
                       .count())
          : 0;
}

std::size_t UpdateSplit::device_share(std::size_t chunk, std::size_t n) const {
  std::size_t d = 0;
  if (forced_ || !(cpu_rate_ > 0 && device_rate_ > 0)) {
    const double share = forced_ ? forced_(chunk) : kFirstShare;
    if (!(share >= 0 && share <= 1))
      fail(ErrorCode::kInternal, strcat("update split: share ", share, " of chunk ", chunk));
    d = static_cast<std::size_t>(std::llround(share * double(n)));
  } else {
    const std::int64_t end = end_ns_.load();
    const std::int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 std::chrono::steady_clock::now().time_since_epoch())
                                 .count();
    const double left = end ? 1e-9 * double(end - now) : 0.0;
    // The queue counts this chunk while the speculation has it posted.
    const std::int64_t behind = queued_.load() - static_cast<std::int64_t>(n);
    d = split_elements(n, cpu_rate_, device_rate_, left,
                       static_cast<std::size_t>(std::max<std::int64_t>(behind, 0)));
  }
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
