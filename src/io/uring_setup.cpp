#include "io/uring_setup.hpp"

#include <cerrno>

#include "io/engine_base.hpp"

namespace strata::io {

UringSetup setup_ring(io_uring* ring, unsigned entries, bool sqpoll) {
  UringSetup out;
  if (io_uring_fail_simulated()) {
    out.rc = -ENOSYS;
    return out;
  }
  io_uring_params p{};
  if (sqpoll) {
    p.flags = IORING_SETUP_SQPOLL | IORING_SETUP_SINGLE_ISSUER;
    p.sq_thread_idle = 1000;  // ms
  } else {
    p.flags = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
  }
  for (;;) {
    io_uring_params q = p;
    int rc = io_uring_queue_init_params(entries, ring, &q);
    if (rc == 0) {
      out.flags = p.flags;
      return out;
    }
    if (rc == -EINVAL) {
      // Drop the newest flag first, as fio does.
      if (p.flags & IORING_SETUP_DEFER_TASKRUN) {
        p.flags &= ~IORING_SETUP_DEFER_TASKRUN;
        continue;
      }
      if (p.flags & IORING_SETUP_SINGLE_ISSUER) {
        p.flags &= ~IORING_SETUP_SINGLE_ISSUER;
        continue;
      }
      if (p.flags & IORING_SETUP_COOP_TASKRUN) {
        p.flags &= ~IORING_SETUP_COOP_TASKRUN;
        continue;
      }
    }
    out.rc = rc;
    return out;
  }
}

std::string describe_setup_flags(unsigned flags) {
  std::string s;
  auto add = [&](unsigned f, const char* name) {
    if (flags & f) {
      if (!s.empty()) s += "|";
      s += name;
    }
  };
  add(IORING_SETUP_SQPOLL, "SQPOLL");
  add(IORING_SETUP_COOP_TASKRUN, "COOP_TASKRUN");
  add(IORING_SETUP_SINGLE_ISSUER, "SINGLE_ISSUER");
  add(IORING_SETUP_DEFER_TASKRUN, "DEFER_TASKRUN");
  return s.empty() ? "none" : s;
}

}  // namespace strata::io
