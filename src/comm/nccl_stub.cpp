// The NCCL factory of a build without NCCL.
#include "strata/communicator.hpp"
#include "strata/error.hpp"

namespace strata {

bool nccl_available() { return false; }

std::unique_ptr<Communicator> make_nccl_communicator(const NcclBootstrap&, int, double) {
  fail(ErrorCode::kUnsupported,
       "this build of strata has no NCCL support (CUDA toolkit with NCCL)");
}

}  // namespace strata
