// Gradient accumulation over micro-batches: dst[i] += src[i] in FP32, element by element (the
// order torch's p.grad accumulation adds in; no contraction).
#pragma once

#include <chrono>
#include <cstddef>

namespace strata {
class Stream;

// (Host memory: accumulate_fp32, core/numeric.hpp.) Both arrays in `stream`'s device memory, in
// stream order after the work queued on it: a CUDA
// kernel on a CUDA stream (returns once enqueued); on the host-emulated device the stream is
// synchronized (bounded by `timeout`) and the sum computed on the calling thread. Throws
// Error(kDevice / kTimeout) as the stream does, Error(kUnsupported) for CUDA in a build without it.
void accumulate_on_device(Stream& stream, bool cuda, float* dst, const float* src, std::size_t n,
                          std::chrono::milliseconds timeout);

// The kernel (adam_cuda.cu; adam_cuda_stub.cpp without CUDA): enqueued on `stream`
// (a cudaStream_t), on the stream's device.
void accumulate_cuda(float* dst, const float* src, std::size_t n, void* stream);

}  // namespace strata
