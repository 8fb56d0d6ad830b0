// A test-only build of the `strata` command (src/cli's objects plus this file) whose rank 1 finds
// its disk full: every write of a checkpoint shard of rank 1 (`shard-<serial>-r1.bin`) fails with
// ENOSPC, through a FaultInjectingFileEnv installed as the process's FileEnv before main runs.
// Other ranks write as usual. The shipped `strata` has no such switch.
#include <cerrno>

#include "core/file_env.hpp"

namespace {

struct Rank1DiskFull {
  strata::FaultInjectingFileEnv env{strata::FileEnv::standard()};
  strata::ScopedFileEnv installed{env};
  Rank1DiskFull() {
    strata::FileFault f = strata::FileFault::fail_nth(strata::FileOp::kWrite, 1, ENOSPC);
    f.name = "-r1.bin";
    f.count = 0;  // every one
    env.add_fault(f);
  }
};

Rank1DiskFull rank1_disk_full;

}  // namespace
