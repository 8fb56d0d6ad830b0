// Helpers for communicator tests: run one function per rank on threads, deterministic
// rank-distinguishable data, the serial reference reduction.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "comm/numeric.hpp"
#include "strata/communicator.hpp"

namespace strata::testing {

// Runs fn(rank, comm) on one thread per communicator; returns each rank's exception (or null).
inline std::vector<std::exception_ptr> run_ranks(
    std::vector<std::unique_ptr<Communicator>>& comms,
    const std::function<void(int, Communicator&)>& fn) {
  std::vector<std::exception_ptr> errors(comms.size());
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < comms.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        fn(static_cast<int>(r), *comms[r]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

inline void rethrow_any(const std::vector<std::exception_ptr>& errors) {
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// `n` elements of `dtype` (raw bytes), values in [-4, 4), different for every (seed, rank, tag).
inline std::vector<unsigned char> rank_data(std::uint64_t seed, int rank, int tag, std::size_t n,
                                            DType dtype) {
  std::mt19937_64 rng(seed * 1000003u + static_cast<std::uint64_t>(rank) * 7919u +
                      static_cast<std::uint64_t>(tag));
  std::uniform_real_distribution<float> d(-4.0f, 4.0f);
  std::vector<unsigned char> out(n * dtype_size(dtype));
  for (std::size_t i = 0; i < n; ++i) store_elem(out.data(), i, dtype, d(rng) + rank * 0.125f);
  return out;
}

// Serial reference: rank-ordered FP32 sum of the ranks' [off, off + n) elements, rounded once.
inline std::vector<unsigned char> reference_sum(
    const std::vector<std::vector<unsigned char>>& per_rank, std::size_t off, std::size_t n,
    DType dtype) {
  std::vector<unsigned char> out(n * dtype_size(dtype));
  for (std::size_t i = 0; i < n; ++i) {
    float acc = load_elem(per_rank[0].data(), off + i, dtype);
    for (std::size_t r = 1; r < per_rank.size(); ++r)
      acc += load_elem(per_rank[r].data(), off + i, dtype);
    store_elem(out.data(), i, dtype, acc);
  }
  return out;
}

}  // namespace strata::testing
