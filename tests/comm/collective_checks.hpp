// Collective correctness checks shared by the in-process test and the MPI test (which runs the
// same checks with one process per rank). Every rank can compute every rank's input from the
// seed, so each rank checks its own results against the serial reference.
#pragma once

#include <gtest/gtest.h>

#include <cstring>

#include "comm_test_util.hpp"

namespace strata::testing {

inline std::vector<std::vector<unsigned char>> all_inputs(std::uint64_t seed, int world, int tag,
                                                          std::size_t n, DType dt) {
  std::vector<std::vector<unsigned char>> v;
  for (int r = 0; r < world; ++r) v.push_back(rank_data(seed, r, tag, n, dt));
  return v;
}

// Uneven counts with zeros: rank r gets (r * 7 + base) % 11 elements (some ranks 0).
inline std::vector<std::size_t> uneven_counts(int world, std::size_t base) {
  std::vector<std::size_t> c;
  for (int r = 0; r < world; ++r) c.push_back((static_cast<std::size_t>(r) * 7 + base) % 11);
  return c;
}

inline void check_collectives(Communicator& comm, std::uint64_t seed) {
  const int rank = comm.rank(), world = comm.size();
  int tag = 0;
  for (DType dt : {DType::kFp32, DType::kFp16, DType::kBf16}) {
    const std::size_t es = dtype_size(dt);
    // all-reduce, odd length, out of place and in place
    for (std::size_t n : {std::size_t{1}, std::size_t{37}, std::size_t{1000}}) {
      auto in = all_inputs(seed, world, ++tag, n, dt);
      auto want = reference_sum(in, 0, n, dt);
      std::vector<unsigned char> out(n * es, 0xAB);
      comm.all_reduce(in[static_cast<std::size_t>(rank)].data(), out.data(), n, dt);
      EXPECT_EQ(0, std::memcmp(out.data(), want.data(), out.size())) << "all_reduce n=" << n;
      auto inplace = in[static_cast<std::size_t>(rank)];
      comm.all_reduce(inplace.data(), inplace.data(), n, dt);
      EXPECT_EQ(0, std::memcmp(inplace.data(), want.data(), out.size())) << "in-place all_reduce";
    }
    // reduce-scatter with uneven counts (some zero)
    {
      auto counts = uneven_counts(world, 3);
      std::size_t total = 0, off = 0;
      for (int r = 0; r < world; ++r) {
        if (r == rank) off = total;
        total += counts[static_cast<std::size_t>(r)];
      }
      auto in = all_inputs(seed, world, ++tag, total, dt);
      auto want = reference_sum(in, off, counts[static_cast<std::size_t>(rank)], dt);
      std::vector<unsigned char> out(counts[static_cast<std::size_t>(rank)] * es + 1, 0xCD);
      comm.reduce_scatter(in[static_cast<std::size_t>(rank)].data(), out.data(), counts, dt);
      EXPECT_EQ(0, std::memcmp(out.data(), want.data(), want.size())) << "reduce_scatter";
      EXPECT_EQ(0xCD, out.back()) << "reduce_scatter wrote past its slice";
    }
    // all-gather, uneven, and in place (send inside recv)
    {
      auto counts = uneven_counts(world, 5);
      std::size_t total = 0, off = 0;
      for (int r = 0; r < world; ++r) {
        if (r == rank) off = total;
        total += counts[static_cast<std::size_t>(r)];
      }
      std::vector<unsigned char> want;
      for (int r = 0; r < world; ++r) {
        auto d = rank_data(seed, r, tag + 1, counts[static_cast<std::size_t>(r)], dt);
        want.insert(want.end(), d.begin(), d.end());
      }
      auto mine = rank_data(seed, rank, tag + 1, counts[static_cast<std::size_t>(rank)], dt);
      ++tag;
      std::vector<unsigned char> out(total * es, 0xEF);
      comm.all_gather(mine.data(), out.data(), counts, dt);
      EXPECT_EQ(out, want) << "all_gather";
      std::vector<unsigned char> inplace(total * es, 0x11);
      if (!mine.empty()) std::memcpy(inplace.data() + off * es, mine.data(), mine.size());
      comm.all_gather(inplace.data() + off * es, inplace.data(), counts, dt);
      EXPECT_EQ(inplace, want) << "in-place all_gather";
    }
    // broadcast from every root
    for (int root = 0; root < world; ++root) {
      auto want = rank_data(seed, root, ++tag, 77, dt);
      auto buf = rank == root ? want : std::vector<unsigned char>(want.size(), 0x22);
      comm.broadcast(buf.data(), 77, dt, root);
      EXPECT_EQ(buf, want) << "broadcast root " << root;
    }
  }
  // Several async collectives outstanding at once, waited out of order.
  {
    auto a = all_inputs(seed, world, ++tag, 101, DType::kFp32);
    auto b = all_inputs(seed, world, ++tag, 55, DType::kBf16);
    std::vector<unsigned char> ra(101 * 4), rb(55 * 2);
    auto h1 = comm.all_reduce_async(a[static_cast<std::size_t>(rank)].data(), ra.data(), 101,
                                    DType::kFp32);
    auto h2 = comm.barrier_async();
    auto h3 = comm.all_reduce_async(b[static_cast<std::size_t>(rank)].data(), rb.data(), 55,
                                    DType::kBf16);
    h3->wait();
    h1->wait();
    h2->wait();
    EXPECT_TRUE(h1->done());
    EXPECT_EQ(ra, reference_sum(a, 0, 101, DType::kFp32));
    EXPECT_EQ(rb, reference_sum(b, 0, 55, DType::kBf16));
  }
  comm.barrier();
}

}  // namespace strata::testing
