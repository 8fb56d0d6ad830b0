// Helper process for the SIGKILL-during-save test: one rank, optimizer state half on NVMe; trains
// one step, then saves a checkpoint, forever, printing "saving K" before and "saved K" after each
// save (K = steps done). Usage: zero_ckpt_helper CHECKPOINT_DIR SWAP_DIR
#include <cstdio>
#include <exception>

#include "ckpt_model.hpp"
#include "strata/communicator.hpp"

int main(int argc, char** argv) {
  using namespace strata;
  using namespace strata::testing;
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR SWAP_DIR\n", argv[0]);
    return 2;
  }
  try {
    const std::vector<std::size_t> sizes{600000, 33, 900001};
    auto comms = make_inprocess_communicators(1, 30.0);
    Engine e(ckpt_config(1, 0.5, argv[2]), *comms[0]);
    ckpt_register(e, sizes);
    for (int k = 1; k < 1000; ++k) {
      ckpt_step(e, sizes, 0, k - 1);
      std::printf("saving %d\n", k);
      std::fflush(stdout);
      e.save_checkpoint(argv[1]);
      std::printf("saved %d\n", k);
      std::fflush(stdout);
    }
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "helper: %s\n", ex.what());
    return 1;
  }
  return 0;
}
