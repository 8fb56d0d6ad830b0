// Host <-> device copy bandwidth through the Device interface: pinned (IoBuffer page-locked with
// Device::register_host) and pageable host memory, both directions; device -> pinned host alone
// (the step bench's reference for its gradient hand-ins).
#include <algorithm>
#include <cstring>
#include <memory>

#include "profile/profile_internal.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "strata/io_file.hpp"
#include "strata/units.hpp"

namespace strata::profile {
namespace {

// Un-registers a registered host range on every exit path.
struct HostRegistration {
  Device& device;
  void* ptr;
  bool registered;
  ~HostRegistration() {
    if (registered) device.unregister_host(ptr);
  }
};

double time_copy(Stream& stream, void* dst, const void* src, std::size_t bytes, int repeats) {
  const auto timeout = std::chrono::milliseconds(120000);
  stream.memcpy_async(dst, src, bytes);  // warm-up
  stream.synchronize(timeout);
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    Stopwatch sw;
    stream.memcpy_async(dst, src, bytes);
    stream.synchronize(timeout);
    best = std::min(best, sw.seconds());
  }
  return best;
}

}  // namespace

std::vector<CopyPoint> measure_copies(Device& device, const Sizes& sizes,
                                      const Progress& progress) {
  std::vector<CopyPoint> out;
  if (sizes.copy_sizes.empty()) return out;
  const std::size_t max_bytes = *std::max_element(sizes.copy_sizes.begin(), sizes.copy_sizes.end());
  auto stream = device.create_stream();
  DeviceMemory dev = device.allocate(max_bytes);
  IoBuffer pinned = IoBuffer::allocate(max_bytes);
  fill_random(pinned.data(), max_bytes, 42);
  HostRegistration reg{device, pinned.data(), device.register_host(pinned.data(), max_bytes)};
  std::unique_ptr<std::uint8_t[]> pageable(new std::uint8_t[max_bytes]);
  std::memcpy(pageable.get(), pinned.data(), max_bytes);

  for (bool is_pinned : {true, false}) {
    std::uint8_t* host = is_pinned ? pinned.bytes() : pageable.get();
    for (std::uint64_t bytes : sizes.copy_sizes) {
      const int repeats = bytes >= (256ULL << 20) ? 3 : 5;
      for (bool h2d : {true, false}) {
        CopyPoint p;
        p.direction = h2d ? "host_to_device" : "device_to_host";
        p.pinned = is_pinned;
        p.bytes = bytes;
        p.seconds = h2d ? time_copy(*stream, dev.get(), host, bytes, repeats)
                        : time_copy(*stream, host, dev.get(), bytes, repeats);
        p.bytes_per_second = p.seconds > 0 ? static_cast<double>(bytes) / p.seconds : 0;
        out.push_back(p);
        if (progress)
          progress(strcat("copy ", p.direction, is_pinned ? " pinned " : " pageable ",
                          format_bytes(bytes, true), ": ", format_rate(p.bytes_per_second)));
      }
    }
  }
  return out;
}

double measure_d2h_pinned(Device& device, Stream& stream, const void* src, std::size_t bytes) {
  if (bytes == 0) return 0;
  IoBuffer pinned = IoBuffer::allocate(bytes);
  HostRegistration reg{device, pinned.data(), device.register_host(pinned.data(), bytes)};
  const double s = time_copy(stream, pinned.data(), src, bytes, 3);
  return s > 0 ? static_cast<double>(bytes) / s : 0;
}

}  // namespace strata::profile
