// Ring creation shared by the io_uring engine and the probe: tries COOP_TASKRUN, SINGLE_ISSUER
// and DEFER_TASKRUN (or SQPOLL) and drops each flag the kernel rejects with EINVAL, as fio does.
// The calling thread becomes the ring's single issuer.
#pragma once

#include <liburing.h>

#include <string>

namespace strata::io {

struct UringSetup {
  int rc = 0;          // 0 or -errno
  unsigned flags = 0;  // setup flags accepted
};

// Honors the STRATA_IO_URING_FAIL test hook (rc = -ENOSYS).
UringSetup setup_ring(io_uring* ring, unsigned entries, bool sqpoll);
std::string describe_setup_flags(unsigned flags);

}  // namespace strata::io
