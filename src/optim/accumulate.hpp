// Gradient accumulation over micro-batches: dst[i] += src[i] element by element, one FP32 add
// rounded to nearest even into dst's dtype (the order torch's p.grad accumulation adds in; no
// contraction), and the conversion of a gradient into the accumulation dtype. Host memory:
// accumulate_elems (core/numeric.hpp).
#pragma once

#include <chrono>
#include <cstddef>

#include "strata/types.hpp"

namespace strata {
class Stream;

// dst (dtype `dd`) op= src (dtype `sd`), n elements, both in `stream`'s device memory, in stream
// order after the work queued on it: `add` dst = round(dst + src), else dst = round(src). A CUDA
// kernel on a CUDA stream (returns once enqueued); on the host-emulated device the stream is
// synchronized (bounded by `timeout`) and the result computed on the calling thread. Throws
// Error(kDevice / kTimeout) as the stream does, Error(kUnsupported) for CUDA in a build without it.
void accumulate_on_device(Stream& stream, bool cuda, void* dst, DType dd, const void* src, DType sd,
                          std::size_t n, bool add, std::chrono::milliseconds timeout);

// The kernel (adam_cuda.cu; adam_cuda_stub.cpp without CUDA): enqueued on `stream`
// (a cudaStream_t), on the stream's device.
void accumulate_cuda(void* dst, DType dd, const void* src, DType sd, std::size_t n, bool add,
                     void* stream);

}  // namespace strata
