// Without CUDA there is no GPU work to wait for.
#include "profile/profile_internal.hpp"

namespace strata::profile {

void gpu_synchronize() {}

}  // namespace strata::profile
