// The fake runtime's launch ABI (what nvcc's host stubs call: __cudaRegisterFatBinary,
// __cudaRegisterFunction, __cudaPush/PopCallConfiguration, __cudaGetKernel, __cudaLaunchKernel)
// and CPU reference implementations of strata's kernels, chosen by the kernel's mangled name:
// adam_kernel<GD, CK, vec4>, check_kernel<GD>, accumulate_kernel<DD, SD, ADD>
// (src/optim/adam_cuda.cu) and probe_kernel (src/cuda/device_query.cu). The references follow the
// device code's definition with CUDA's own host-side conversions (cuda_bf16.h / cuda_fp16.h): they
// are an independent statement of what the GPU computes, not a call into strata's CPU kernels.
//
// A kernel must be launched into a stream of the calling thread's current device (else
// cudaErrorInvalidResourceHandle, as on a GPU). Its pointer arguments must address device memory
// of that device with room for every element it touches, and the vectorised variant needs the
// alignment its vector loads need; otherwise it faults at execution: cudaErrorIllegalAddress /
// cudaErrorMisalignedAddress, sticky for the device, with a line on stderr saying which argument.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <regex>
#include <string>

#include "fakecuda/fake_internal.hpp"
#include "optim/adam_kernel_body.hpp"
#include "optim/adam_kernels.hpp"
#include "optim/adam_nan.hpp"

using namespace fakecuda;
using strata::optim::AdamConsts;
using strata::optim::X86NanOps;

namespace {

struct Registry {
  std::mutex mu;
  std::map<const void*, std::string> names;  // host stub -> mangled device name
};

Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

struct LaunchConfig {
  dim3 grid, block;
  std::size_t shmem = 0;
  void* stream = nullptr;
};
thread_local std::vector<LaunchConfig> t_configs;

// ---- the reference arithmetic (adam_cuda.cu's adam_elem, intrinsic by intrinsic) ----------------

float grad_at(int gd, const void* g, std::size_t i) {
  if (gd == 0) return static_cast<const float*>(g)[i];
  std::uint16_t raw;
  std::memcpy(&raw, static_cast<const char*>(g) + 2 * i, 2);
  if (gd == 1) return __bfloat162float(__ushort_as_bfloat16(raw));
  return __half2float(__ushort_as_half(raw));
}

// The kernel's 16-bit copies: CUDA's round-to-nearest-even conversions, except NaN, which the
// kernel writes with the CPU kernels' bits (bf16 0x7fc0, fp16 sign|0x7e00; adam_cuda.cu
// bf16_bits / fp16_bits) where CUDA's conversions would give 0x7fff.
void store_copy(int ck, void* out, std::size_t i, float p) {
  if (ck == 1) static_cast<float*>(out)[i] = p;
  std::uint32_t x;
  std::memcpy(&x, &p, 4);
  std::uint16_t h = 0;
  if (ck == 2)
    h = std::isnan(p) ? static_cast<std::uint16_t>(((x >> 16) & 0x8000u) | 0x7e00u)
                      : __half_as_ushort(__float2half_rn(p));
  if (ck == 3) h = std::isnan(p) ? 0x7fc0 : __bfloat16_as_ushort(__float2bfloat16_rn(p));
  if (ck == 2 || ck == 3) std::memcpy(static_cast<char*>(out) + 2 * i, &h, 2);
}

// The GPU's single-precision arithmetic (add, mul, div, fma, sqrt: __fadd_rn ... __fsqrt_rn)
// returns one canonical NaN, 0x7fffffff, whatever NaN went in or however it arose: no sign, no
// payload (CUDA keeps no NaN payload in single precision; cuda_fp16.hpp / cuda_bf16.hpp state the
// same for the conversions, whose host paths above give 0x7fff / 0x7fffffff). An x86 CPU instead
// passes the first NaN operand on, quieted, and makes 0xffc00000 (negative) for an invalid
// operation. `x` is a result of such an operation as the CPU computed it.
float gpu_arith(float x) {
  if (!std::isnan(x)) return x;
  const std::uint32_t canonical = 0x7fffffffu;
  std::memcpy(&x, &canonical, 4);
  return x;
}

// adam_cuda.cu's adam_elem computes, bitwise, the CPU kernels' element for every finite or
// infinite result (the GPU and CPU updates are equal bit for bit, tests/optim): the scalar lane,
// the one copy of that arithmetic. p, m and v each come out of an arithmetic operation, and a NaN
// never turns back into a number on the way (no min, max or comparison), so a NaN among them is
// the GPU's canonical one.
void adam_elem(const AdamConsts& c, float& p, float& m, float& v, float g) {
  s_adam_elem(c, p, m, v, g);
  p = gpu_arith(p), m = gpu_arith(m), v = gpu_arith(v);
}

// ---- the kernels' NaN paths (adam_cuda.cu cpu_nan_elem, cpu_nan_accumulate) --------------------
// Where the GPU's result is NaN, the kernels compute the element again from its inputs with the
// CPU's NaN (optim/adam_nan.hpp, shared with the device code): x86's NaN rules operation by
// operation, from the gradient as the CPU widens it. (The vec4 kernel takes all four elements of
// its iteration through that path when one is NaN; X86NanOps gives the other three the same bits
// as the common path, so element by element here is the same.)

// adam_cuda.cu cpu_load: an fp16 NaN with its sign and payload, else as grad_at.
float cpu_load(int dt, const void* a, std::size_t i) {
  if (dt == 2) {
    std::uint16_t raw;
    std::memcpy(&raw, static_cast<const char*>(a) + 2 * i, 2);
    if (strata::optim::fp16_is_nan(raw)) return strata::optim::fp16_nan_as_cpu(raw);
  }
  return grad_at(dt, a, i);
}

// adam_kernel's element i: the GPU's arithmetic, then the NaN path where p came out NaN.
void adam_elem_at(const AdamConsts& c, int gd, float* p, float* m, float* v, const void* g,
                  std::size_t i) {
  float pi = p[i], mi = m[i], vi = v[i];
  adam_elem(c, pi, mi, vi, grad_at(gd, g, i));
  if (std::isnan(pi)) {
    pi = p[i], mi = m[i], vi = v[i];
    strata::optim::adam_update<X86NanOps>(c, pi, mi, vi, cpu_load(gd, g, i));
  }
  p[i] = pi, m[i] = mi, v[i] = vi;
}

// ---- argument checks -------------------------------------------------------------------------

struct Fault {
  cudaError_t code = cudaSuccess;
  std::string why;
};

// Device pointer `p` of `bytes` on device `dev` -> its shadow, or a fault.
char* dev_ptr(const void* p, std::size_t bytes, int dev, const char* arg, Fault* f) {
  if (f->code != cudaSuccess) return nullptr;
  if (!p && bytes == 0) return nullptr;
  int owner = -1;
  char* s = Runtime::get().shadow_of(p, bytes ? bytes : 1, &owner);
  if (!s || owner != dev) {
    f->code = cudaErrorIllegalAddress;
    f->why = std::string(arg) + " is not device memory of device " + std::to_string(dev) +
             " with " + std::to_string(bytes) + " bytes";
    return nullptr;
  }
  return s;
}

void need_align(const void* p, std::size_t a, const char* arg, Fault* f) {
  if (f->code == cudaSuccess && p && reinterpret_cast<std::uintptr_t>(p) % a != 0) {
    f->code = cudaErrorMisalignedAddress;
    f->why = std::string(arg) + " is not " + std::to_string(a) + "-byte aligned (vector loads)";
  }
}

struct AdamLaunch {
  int gd = 0, ck = 0;
  bool vec4 = false;
};

std::function<void()> adam_task(const AdamLaunch& k, void** args, int dev, Fault* f) {
  const AdamConsts c = *static_cast<AdamConsts*>(args[0]);
  float* p = *static_cast<float**>(args[1]);
  float* m = *static_cast<float**>(args[2]);
  float* v = *static_cast<float**>(args[3]);
  const void* g = *static_cast<const void**>(args[4]);
  void* out = *static_cast<void**>(args[5]);
  const std::size_t n = *static_cast<std::size_t*>(args[6]);
  const int* flag = *static_cast<const int**>(args[7]);
  const std::size_t gs = k.gd == 0 ? 4 : 2, cs = k.ck == 1 ? 4 : 2;
  if (k.vec4) {
    need_align(p, 16, "param", f), need_align(m, 16, "exp_avg", f);
    need_align(v, 16, "exp_avg_sq", f), need_align(g, 4 * gs, "grad", f);
    if (k.ck) need_align(out, 4 * cs, "param_copy", f);
  }
  auto* sp = reinterpret_cast<float*>(dev_ptr(p, n * 4, dev, "param", f));
  auto* sm = reinterpret_cast<float*>(dev_ptr(m, n * 4, dev, "exp_avg", f));
  auto* sv = reinterpret_cast<float*>(dev_ptr(v, n * 4, dev, "exp_avg_sq", f));
  const char* sg = dev_ptr(g, n * gs, dev, "grad", f);
  char* so = k.ck ? dev_ptr(out, n * cs, dev, "param_copy", f) : nullptr;
  const int* sf = flag ? reinterpret_cast<const int*>(dev_ptr(flag, 4, dev, "flag", f)) : nullptr;
  const int ck = k.ck, gd = k.gd;
  return [=] {
    if (sf && *sf != 0) return;  // read at execution, in stream order, like the kernel
    for (std::size_t i = 0; i < n; ++i) {
      adam_elem_at(c, gd, sp, sm, sv, sg, i);
      if (ck) store_copy(ck, so, i, sp[i]);
    }
  };
}

std::function<void()> check_task(int gd, void** args, int dev, Fault* f) {
  const void* g = *static_cast<const void**>(args[0]);
  const std::size_t n = *static_cast<std::size_t*>(args[1]);
  const float divisor = *static_cast<float*>(args[2]);
  const float scale = *static_cast<float*>(args[3]);
  int* flag = *static_cast<int**>(args[4]);
  const char* sg = dev_ptr(g, n * (gd == 0 ? 4 : 2), dev, "grad", f);
  int* sf = reinterpret_cast<int*>(dev_ptr(flag, 4, dev, "flag", f));
  return [=] {
    for (std::size_t i = 0; i < n; ++i) {
      float x = grad_at(gd, sg, i);
      if (divisor != 1.0f) x = x / divisor;
      if (!std::isfinite(x * scale)) {
        *sf = 1;
        return;
      }
    }
  };
}

// accumulate_kernel<DD, SD, ADD>: dst = round_DD(dst + src) (ADD) or round_DD(src), one FP32 add
// (the GPU's), a NaN result again with the CPU's NaN (cpu_nan_accumulate), CUDA's
// round-to-nearest-even conversions with the CPU's NaN bits (store_copy's).
std::function<void()> accumulate_task(int dd, int sd, bool add, void** args, int dev, Fault* f) {
  void* dst = *static_cast<void**>(args[0]);
  const void* src = *static_cast<const void**>(args[1]);
  const std::size_t n = *static_cast<std::size_t*>(args[2]);
  char* sdst = dev_ptr(dst, n * (dd == 0 ? 4 : 2), dev, "dst", f);
  const char* ssrc = dev_ptr(src, n * (sd == 0 ? 4 : 2), dev, "src", f);
  const int ck = dd == 0 ? 1 : dd == 1 ? 3 : 2;  // store_copy's kinds: fp32 1, fp16 2, bf16 3
  return [=] {
    for (std::size_t i = 0; i < n; ++i) {
      const float s = grad_at(sd, ssrc, i);
      float x = add ? gpu_arith(grad_at(dd, sdst, i) + s) : s;
      if (std::isnan(x)) {
        const float sc = cpu_load(sd, ssrc, i);
        x = add ? X86NanOps::add(cpu_load(dd, sdst, i), sc) : sc;
      }
      store_copy(ck, sdst, i, x);
    }
  };
}

// The CPU work of a launch, or a fault (f) for bad arguments; null for an unknown kernel.
std::function<void()> make_task(const std::string& name, void** args, int dev, Fault* f) {
  static const std::regex adam("adam_kernelILi([0-2])ELi([0-3])ELb([01])E");
  static const std::regex check("check_kernelILi([0-2])E");
  std::smatch mt;
  if (std::regex_search(name, mt, adam)) {
    AdamLaunch k{std::stoi(mt[1]), std::stoi(mt[2]), mt[3] == "1"};
    return adam_task(k, args, dev, f);
  }
  if (std::regex_search(name, mt, check)) return check_task(std::stoi(mt[1]), args, dev, f);
  static const std::regex accumulate("accumulate_kernelILi([0-2])ELi([0-2])ELb([01])E");
  if (std::regex_search(name, mt, accumulate))
    return accumulate_task(std::stoi(mt[1]), std::stoi(mt[2]), mt[3] == "1", args, dev, f);
  if (name.find("probe_kernel") != std::string::npos) {
    int* sp = reinterpret_cast<int*>(dev_ptr(*static_cast<int**>(args[0]), 4, dev, "out", f));
    return [sp] { *sp = 42; };
  }
  return nullptr;
}

cudaError_t check_config(dim3 grid, dim3 block) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x == 0 || block.y == 0 || block.z == 0)
    return cudaErrorInvalidConfiguration;
  if (std::uint64_t(block.x) * block.y * block.z > 1024) return cudaErrorInvalidConfiguration;
  return cudaSuccess;
}

}  // namespace

namespace fakecuda {

void register_kernel(const void* host_fun, const char* device_name) {
  std::lock_guard<std::mutex> lock(registry().mu);
  registry().names[host_fun] = device_name ? device_name : "";
}

cudaError_t launch_kernel(const void* host_fun, dim3 grid, dim3 block, void** args, std::size_t,
                          cudaStream_t stream) {
  if (thread_state().in_host_func) return ret(cudaErrorNotPermitted);
  Runtime& rt = Runtime::get();
  if (!rt.valid_stream(stream)) return ret(cudaErrorInvalidResourceHandle);
  auto s = rt.stream(stream);
  const int dev = thread_state().current;
  {
    std::lock_guard<std::mutex> lock(rt.mu());
    if (rt.device(dev).sticky != cudaSuccess) return ret(rt.device(dev).sticky);
  }
  if (s->device != dev) return ret(cudaErrorInvalidResourceHandle);  // stream of another device
  if (cudaError_t e = check_config(grid, block); e != cudaSuccess) return ret(e);
  std::string name;
  {
    std::lock_guard<std::mutex> lock(registry().mu);
    auto it = registry().names.find(host_fun);
    if (it == registry().names.end()) return ret(cudaErrorInvalidDeviceFunction);
    name = it->second;
  }
  touch_context(dev);
  Fault f;
  std::function<void()> work = make_task(name, args, dev, &f);
  if (!work && f.code == cudaSuccess) return ret(cudaErrorInvalidDeviceFunction);
  bool inject = false;
  {
    std::lock_guard<std::mutex> lock(rt.mu());
    inject = rt.device(dev).fail_next_kernel;
    rt.device(dev).fail_next_kernel = false;
  }
  if (inject) f = Fault{cudaErrorIllegalAddress, "injected by fakecuda_fail_next_kernel"};
  rt.count("kernel");
  Pending pend;
  pend.kernel_device = dev;
  Task t;
  t.what = name;
  t.run = [work, f, dev, name] {
    if (f.code == cudaSuccess) return work();
    std::fprintf(stderr, "fakecuda: kernel %s faulted on device %d: %s (%s)\n", name.c_str(), dev,
                 cudaGetErrorName(f.code), f.why.c_str());
    Runtime& r = Runtime::get();
    std::lock_guard<std::mutex> lock(r.mu());
    r.device(dev).sticky = f.code;
  };
  rt.enqueue(s, std::move(t), std::move(pend));
  return cudaSuccess;
}

}  // namespace fakecuda

extern "C" {

void** __cudaRegisterFatBinary(void*) {
  static void* handle[1] = {nullptr};
  return handle;
}

void __cudaRegisterFatBinaryEnd(void**) {}
void __cudaUnregisterFatBinary(void**) {}

void __cudaRegisterFunction(void**, const char* host_fun, char*, const char* device_name, int,
                            uint3*, uint3*, dim3*, dim3*, int*) {
  fakecuda::register_kernel(host_fun, device_name);
}

unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t shmem, struct CUstream_st* s) {
  t_configs.push_back(LaunchConfig{grid, block, shmem, s});
  return 0;
}

cudaError_t __cudaPopCallConfiguration(dim3* grid, dim3* block, size_t* shmem, void* stream) {
  if (t_configs.empty()) return cudaErrorInvalidConfiguration;
  const LaunchConfig c = t_configs.back();
  t_configs.pop_back();
  *grid = c.grid;
  *block = c.block;
  *shmem = c.shmem;
  *static_cast<void**>(stream) = c.stream;
  return cudaSuccess;
}

cudaError_t __cudaGetKernel(cudaKernel_t* k, const void* fun) {
  std::lock_guard<std::mutex> lock(registry().mu);
  if (!registry().names.count(fun)) return cudaErrorInvalidDeviceFunction;
  *k = reinterpret_cast<cudaKernel_t>(const_cast<void*>(fun));
  return cudaSuccess;
}

cudaError_t __cudaLaunchKernel(cudaKernel_t k, dim3 grid, dim3 block, void** args, size_t shmem,
                               cudaStream_t s) {
  if (!k) return ret(cudaErrorInvalidDeviceFunction);
  return fakecuda::launch_kernel(reinterpret_cast<const void*>(k), grid, block, args, shmem, s);
}

cudaError_t cudaLaunchKernel(const void* fun, dim3 grid, dim3 block, void** args, size_t shmem,
                             cudaStream_t s) {
  return fakecuda::launch_kernel(fun, grid, block, args, shmem, s);
}

}  // extern "C"
