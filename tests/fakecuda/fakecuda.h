// Control API of the test-only fake CUDA runtime + fake NCCL (libstrata_fakecuda.so).
//
// The `fakecuda` CTest label runs the `gpu` test binaries with LD_PRELOAD=libstrata_fakecuda.so:
// every cuda*/nccl* entry point strata (and the test) calls then resolves to the fake instead of
// libcudart/libnccl. The declarations below are weak, so the same test binaries link and run
// against the real runtime on a GPU, where fakecuda_active is null and fake-only checks skip.
//
// Environment read by the fake (at first use):
//   STRATA_FAKECUDA_DEVICES    number of fake GPUs (default 2), ordinals 0..N-1
//   STRATA_FAKECUDA_MEMORY     bytes of device memory per GPU (default 8 GiB, sparse)
//   STRATA_FAKECUDA_JITTER_US  each stream task waits a seeded random 0..J us first (default 200)
//   STRATA_FAKECUDA_SEED       seed of that jitter (default 1)
//   STRATA_FAKECUDA_DRIVER_LOCK  1: cudaFree waits for every device's streams (the driver lock
//                              behind the multi-GPU-in-one-process NCCL hang), else its own device
//   STRATA_FAKECUDA_REPORT     a file: "context DEVICE pid PID" appended when a context is created
#pragma once

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FAKECUDA_WEAK __attribute__((weak))

// 1 when the fake runtime is the one answering (the weak symbol is null otherwise).
FAKECUDA_WEAK int fakecuda_active(void);
// 1 when some thread of this process created device `dev`'s primary context (CUDA >= 12:
// cudaSetDevice, or any context-creating call with `dev` current).
FAKECUDA_WEAK int fakecuda_context_created(int dev);
// Counters since the last reset, by name: "malloc", "free", "host_register", "host_unregister",
// "pageable_copy", "device_sync" (calls that synchronise the device or the host), "kernel",
// "not_ready" (NotReady answers of stream/event queries), "nccl_collective", "host_sync" (the
// host learning that device work completed: a cudaStreamQuery/cudaEventQuery answering success
// for work no earlier observation of that stream covered, a cudaStreamSynchronize /
// cudaEventSynchronize that waited for such work, a cudaDeviceSynchronize; strata's bounded waits
// poll queries, so each of its waits on new work is one — however many queries it took).
FAKECUDA_WEAK long fakecuda_counter(const char* name);
FAKECUDA_WEAK void fakecuda_reset_counters(void);
// The next kernel launched on `dev` faults at execution: cudaErrorIllegalAddress, sticky for the
// device (every later call that touches it returns it), as a real device fault is.
FAKECUDA_WEAK void fakecuda_fail_next_kernel(int dev);
// Paused: the streams of `dev` execute nothing until resumed (a wedged GPU / a stalled DMA).
FAKECUDA_WEAK void fakecuda_set_paused(int dev, int paused);
// Bytes of host memory registered (cudaHostRegister) and not unregistered.
FAKECUDA_WEAK size_t fakecuda_registered_bytes(void);
// Number of host ranges registered now.
FAKECUDA_WEAK int fakecuda_registered_ranges(void);

#ifdef __cplusplus
}
#endif
