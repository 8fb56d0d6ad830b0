// Helper process for the SIGKILL-during-save test: one rank, optimizer state half on NVMe; trains
// one step, then saves a checkpoint, printing "saving K" before and "saved K" after each save
// (K = steps done), for K = 1..LAST; then it waits (at most 120 s) to be killed, so that a kill
// sent late (the test process descheduled on a loaded machine) still finds the checkpoint of step
// LAST - 1 or LAST, never a later one. Every checkpoint write takes >= 8 ms more (about 80 ms a
// save of its ten writes), through a delaying FaultInjectingFileEnv installed as the process's
// FileEnv, so that a save lasts long enough to be killed inside whatever the build (sanitizers)
// and the machine's load.
// Usage: zero_ckpt_helper CHECKPOINT_DIR SWAP_DIR LAST
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <thread>

#include "ckpt_model.hpp"
#include "core/file_env.hpp"
#include "strata/communicator.hpp"

int main(int argc, char** argv) {
  using namespace strata;
  using namespace strata::testing;
  const int last = argc == 4 ? std::atoi(argv[3]) : 0;
  if (argc != 4 || last < 1) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR SWAP_DIR LAST\n", argv[0]);
    return 2;
  }
  FaultInjectingFileEnv slow(FileEnv::standard());
  slow.add_fault(FileFault::delay_every(FileOp::kWrite, std::chrono::milliseconds(8)));
  const ScopedFileEnv installed(slow);
  try {
    const std::vector<std::size_t> sizes{600000, 33, 900001};
    auto comms = make_inprocess_communicators(1, 30.0);
    Engine e(ckpt_config(1, 0.5, argv[2]), *comms[0]);
    ckpt_register(e, sizes);
    for (int k = 1; k <= last; ++k) {
      ckpt_step(e, sizes, 0, k - 1);
      std::printf("saving %d\n", k);
      std::fflush(stdout);
      e.save_checkpoint(argv[1]);
      std::printf("saved %d\n", k);
      std::fflush(stdout);
    }
    std::this_thread::sleep_for(std::chrono::seconds(120));  // the test kills it before
    std::fprintf(stderr, "helper: not killed within 120 s of its last save\n");
    return 3;
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "helper: %s\n", ex.what());
    return 1;
  }
  return 0;
}
