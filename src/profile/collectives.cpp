// Collective bus bandwidth (nccl-tests' definitions): reduce-scatter and all-gather over the
// configured rank count, with in-process ranks (one thread each) in this process.
//   S = the full buffer per rank (reduce-scatter input, all-gather output), t = time of the
//   collective on rank 0 after a barrier, algbw = S / t, busbw = algbw * (n - 1) / n.
#include <algorithm>
#include <exception>
#include <thread>

#include "profile/profile_internal.hpp"
#include "strata/error.hpp"
#include "strata/communicator.hpp"
#include "strata/units.hpp"

namespace strata::profile {

std::vector<CollectivePoint> measure_collectives(const Config& c, const Sizes& sizes,
                                                 std::string* skipped, const Progress& progress) {
  std::vector<CollectivePoint> out;
  const int n = static_cast<int>(c.world.ranks);
  if (n < 2) {
    *skipped = "skipped: 1 rank (world.ranks = 1), no collective in a step";
    return out;
  }
  if (n > 64) {
    *skipped = strcat("skipped: ", n, " ranks are too many to emulate with threads in one process");
    return out;
  }
  std::string backend = "inprocess";
  if (c.runtime.communicator == CommBackend::kMpi || c.runtime.communicator == CommBackend::kNccl)
    *skipped = strcat("note: runtime.communicator is ", comm_backend_name(c.runtime.communicator),
                      "; measured the in-process backend with ", n,
                      " ranks (run under mpirun for the real backend)");
  const double timeout = std::max(30.0, c.runtime.collective_timeout_s);
  for (CollectiveKind kind : {CollectiveKind::kReduceScatter, CollectiveKind::kAllGather}) {
    const DType dtype = kind == CollectiveKind::kReduceScatter ? c.precision.grads : c.precision.params;
    const std::size_t es = dtype_size(dtype);
    for (std::uint64_t s_bytes : sizes.collective_sizes) {
      const std::size_t per_rank = std::max<std::size_t>(s_bytes / es / n, 1);
      const std::size_t total = per_rank * n;
      auto comms = make_inprocess_communicators(n, timeout);
      std::vector<double> best(n, 1e30);
      std::vector<std::exception_ptr> errors(n);
      std::vector<std::thread> threads;
      for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
          try {
            Communicator& comm = *comms[r];
            std::vector<std::uint8_t> full(total * es), part(per_rank * es);
            fill_random(full.data(), full.size(), 11 + r);
            // Keep 16-bit values finite: clear the exponent's top bit of every element.
            if (es == 2)
              for (std::size_t i = 1; i < full.size(); i += 2) full[i] &= 0x3f;
            else
              for (std::size_t i = 3; i < full.size(); i += 4) full[i] &= 0x3f;
            std::copy_n(full.begin(), part.size(), part.begin());
            for (int rep = 0; rep < 3; ++rep) {
              comm.barrier();
              Stopwatch sw;
              if (kind == CollectiveKind::kReduceScatter)
                comm.reduce_scatter(full.data(), part.data(), per_rank, dtype);
              else
                comm.all_gather(part.data(), full.data(), per_rank, dtype);
              if (rep > 0) best[r] = std::min(best[r], sw.seconds());
            }
          } catch (...) {
            errors[r] = std::current_exception();
          }
        });
      }
      for (auto& t : threads) t.join();
      for (auto& e : errors)
        if (e) std::rethrow_exception(e);
      CollectivePoint p;
      p.collective = collective_name(kind);
      p.backend = backend;
      p.ranks = n;
      p.bytes = total * es;
      p.seconds = *std::max_element(best.begin(), best.end());
      p.algbw_bytes_per_second = static_cast<double>(p.bytes) / p.seconds;
      p.busbw_bytes_per_second = p.algbw_bytes_per_second * (n - 1) / n;
      out.push_back(p);
      if (progress)
        progress(strcat("collective ", p.collective, " ", n, " ranks ", format_bytes(p.bytes, true),
                        ": busbw ", format_rate(p.busbw_bytes_per_second)));
    }
  }
  return out;
}

}  // namespace strata::profile
