// launched_by_mpi(): whether an MPI launcher started this process.
#include <cstdlib>

#include "strata/communicator.hpp"

namespace strata {

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return true;
  return false;
}

}  // namespace strata
