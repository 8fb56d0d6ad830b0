// Collective bus bandwidth (nccl-tests' definitions) over the real communicator of a
// multi-process launch: reduce-scatter and all-gather, every rank at once.
//   S = the full (pre-reduce / gathered) buffer per rank, t = the slowest rank's time of the
//   collective after a barrier (best of the repeats), algbw = S / t, busbw = algbw * (n - 1) / n.
// Never measured between threads of one process: that measures the memory bus of one machine,
// not the network between ranks (docs/profile.md "Ranks on a node").
#include <algorithm>
#include <bit>
#include <cstring>

#include "profile/profile_internal.hpp"
#include "strata/communicator.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"
#include "strata/units.hpp"

namespace strata::profile {

double max_over_ranks(Communicator& host, double v) {
  const int n = host.size();
  if (n == 1) return v;
  std::uint32_t mine[2];
  std::memcpy(mine, &v, sizeof v);
  std::vector<std::uint32_t> all(2 * static_cast<std::size_t>(n));
  host.all_gather(mine, all.data(), 2, DType::kFp32);
  double m = v;
  for (int r = 0; r < n; ++r) {
    double x;
    std::memcpy(&x, all.data() + 2 * r, sizeof x);
    m = std::max(m, x);
  }
  return m;
}

std::vector<CollectivePoint> measure_collectives(const Config& c, Communicator& comm,
                                                 Communicator& host, Device* device,
                                                 const Sizes& sizes, const Progress& progress) {
  std::vector<CollectivePoint> out;
  const int n = comm.size();
  if (n < 2) return out;
  const bool on_device = comm.buffer_location() == BufferLocation::kDevice;
  if (on_device && !device)
    fail(ErrorCode::kInternal, "profile: a device communicator needs a device for its buffers");
  for (CollectiveKind kind : {CollectiveKind::kReduceScatter, CollectiveKind::kAllGather}) {
    const DType dtype =
        kind == CollectiveKind::kReduceScatter ? c.precision.grads : c.precision.params;
    const std::size_t es = dtype_size(dtype);
    for (std::uint64_t s_bytes : sizes.collective_sizes) {
      const std::size_t per_rank = std::max<std::size_t>(s_bytes / es / n, 1);
      const std::size_t total = per_rank * n;
      std::vector<std::uint8_t> full_h, part_h;
      DeviceMemory full_d, part_d;
      void* full = nullptr;
      void* part = nullptr;
      if (on_device) {
        full_d = device->allocate(total * es);
        part_d = device->allocate(per_rank * es);
        auto stream = device->create_stream();
        stream->memset_async(full_d.get(), 0, total * es);
        stream->memset_async(part_d.get(), 0, per_rank * es);
        stream->synchronize(std::chrono::seconds(60));
        full = full_d.get();
        part = part_d.get();
      } else {
        full_h.resize(total * es);
        part_h.resize(per_rank * es);
        fill_random(full_h.data(), full_h.size(), 11 + comm.rank());
        // Keep 16-bit / 32-bit values finite: clear the exponent's top bit of every element.
        for (std::size_t i = es - 1; i < full_h.size(); i += es) full_h[i] &= 0x3f;
        std::copy_n(full_h.begin(), part_h.size(), part_h.begin());
        full = full_h.data();
        part = part_h.data();
      }
      double best = 1e30;
      for (int rep = 0; rep < 4; ++rep) {
        host.barrier();
        Stopwatch sw;
        if (kind == CollectiveKind::kReduceScatter)
          comm.reduce_scatter(full, part, per_rank, dtype);
        else
          comm.all_gather(part, full, per_rank, dtype);
        if (rep > 0) best = std::min(best, sw.seconds());
      }
      CollectivePoint p;
      p.collective = collective_name(kind);
      p.backend = comm.backend_name();
      p.ranks = n;
      p.bytes = total * es;
      p.seconds = max_over_ranks(host, best);
      p.algbw_bytes_per_second = static_cast<double>(p.bytes) / p.seconds;
      p.busbw_bytes_per_second = p.algbw_bytes_per_second * (n - 1) / n;
      out.push_back(p);
      if (progress)
        progress(strcat("collective ", p.collective, " ", p.backend, " ", n, " ranks ",
                        format_bytes(p.bytes, true), ": busbw ",
                        format_rate(p.busbw_bytes_per_second)));
    }
  }
  return out;
}

}  // namespace strata::profile
