// A strata Communicator over a torch.distributed process group (c10d, torch 1.13): what the engine
// talks to under torchrun. This header is torch-free; c10d_communicator.cpp is the one translation
// unit of the extension that includes torch's headers.
//
// How the collectives map onto c10d (the group's own backend: gloo on CPU):
//   reduce-scatter: alltoall_base (each rank sends every peer that peer's slice, as a ring moves
//     them, in one hop), then the slices are summed locally in rank order 0, 1, ..., N-1 starting
//     from rank 0's (FP16/BF16 in FP32, rounded once): bitwise what the in-process and MPI
//     backends give, whatever order the group's own all-reduce would have used.
//   all-reduce: reduce-scatter of an equal split, then all-gather (the same bytes as a ring).
//   all-gather (counts may differ per rank): alltoall_base of the own slice to every peer.
//   broadcast, barrier: the group's own.
// Buffers are staged through CPU tensors the handle owns, so a collective abandoned after a timeout
// can never write into the caller's memory. Every operation carries runtime.collective_timeout_s
// as its c10d timeout and wait() waits no longer: a dead or stalled peer gives Error(kTimeout)
// (deadline) or Error(kComm) (the backend saw the peer's connection close), naming the collective,
// its sequence number and this rank; the communicator is then broken: later collectives, and
// waits on those still in flight, throw Error(kComm) at once.
// Thread-safety: as every Communicator (one issuing thread). The GIL is not needed.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "strata/communicator.hpp"

namespace strata::python {

// `process_group`: a torch.distributed ProcessGroup (e.g. the default group after
// init_process_group("gloo")); held for the communicator's lifetime. Its tensors must be CPU
// tensors (gloo, or MPI): Error(kUnsupported) for a group whose backend needs CUDA tensors.
std::unique_ptr<Communicator> make_c10d_communicator(pybind11::handle process_group,
                                                     double timeout_s);

}  // namespace strata::python
