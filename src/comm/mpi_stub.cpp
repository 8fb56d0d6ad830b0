// The MPI factory of a build without MPI.
#include "strata/communicator.hpp"
#include "strata/error.hpp"

namespace strata {

bool mpi_available() { return false; }

std::unique_ptr<Communicator> make_mpi_communicator(double) {
  fail(ErrorCode::kUnsupported, "this build of strata has no MPI support (STRATA_WITH_MPI)");
}

}  // namespace strata
