// libstrata.so: every layer's objects in one shared library (src/CMakeLists.txt), the form in which
// strata is installed for consumers (find_package(strata) -> strata::strata, pkg-config strata).
// CUDA, NCCL, MPI, liburing and yaml-cpp are linked into it privately, so a consumer of the
// engine or CpuAdam needs none of their development files. This file only gives the target a
// source of its own.
namespace strata::build {
extern const char* const kSharedLibrary;
const char* const kSharedLibrary = "libstrata";
}  // namespace strata::build
