// Every rank's outcome of a phase (see rank_status.hpp).
#include "comm/rank_status.hpp"

#include <cstring>

namespace strata {

RankStatus RankStatus::of(const std::exception_ptr& error) {
  RankStatus s;
  if (!error) return s;
  s.failed = true;
  try {
    std::rethrow_exception(error);
  } catch (const IoError& e) {
    s.code = e.code();
    s.extra = static_cast<std::uint64_t>(e.errnum());
  } catch (const Error& e) {
    s.code = e.code();
  } catch (...) {
  }
  return s;
}

std::vector<RankStatus> exchange_status(const RankStatus& mine, int world,
                                        const WordExchange& exchange) {
  const std::uint32_t local[4] = {mine.failed ? 1u : 0u, static_cast<std::uint32_t>(mine.code),
                                  static_cast<std::uint32_t>(mine.extra),
                                  static_cast<std::uint32_t>(mine.extra >> 32)};
  std::vector<std::uint32_t> words(4 * static_cast<std::size_t>(world));
  if (world > 1) {
    exchange(local, words.data(), sizeof(local));
  } else {
    std::memcpy(words.data(), local, sizeof(local));
  }
  std::vector<RankStatus> all(static_cast<std::size_t>(world));
  for (std::size_t r = 0; r < all.size(); ++r) {
    const std::uint32_t* p = words.data() + 4 * r;
    all[r].failed = p[0] != 0u;
    all[r].code = static_cast<ErrorCode>(p[1]);
    all[r].extra = p[2] | static_cast<std::uint64_t>(p[3]) << 32;
  }
  return all;
}

int first_failed_peer(const std::vector<RankStatus>& all, int rank) {
  for (std::size_t r = 0; r < all.size(); ++r)
    if (all[r].failed && static_cast<int>(r) != rank) return static_cast<int>(r);
  return -1;
}

}  // namespace strata
