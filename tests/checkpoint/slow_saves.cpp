// A test-only build of the `strata` command (src/cli's objects plus this file): every write of a
// checkpoint file takes at least 4 ms more, through a FaultInjectingFileEnv installed as the
// process's FileEnv before main runs, so that a SIGKILL sent while a save runs lands inside it
// whatever the machine's load. The shipped `strata` has no such switch (no environment variable).
#include <chrono>

#include "core/file_env.hpp"

namespace {

struct SlowSaves {
  strata::FaultInjectingFileEnv env{strata::FileEnv::standard()};
  strata::ScopedFileEnv installed{env};
  SlowSaves() {
    env.add_fault(
        strata::FileFault::delay_every(strata::FileOp::kWrite, std::chrono::milliseconds(4)));
  }
};

SlowSaves slow_saves;

}  // namespace
