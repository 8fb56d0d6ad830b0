// Compute references: CPU Adam and GPU Adam throughput on the configured dtypes, and the memory
// bandwidth of a STREAM triad (a[i] = b[i] + s * c[i]) as the CPU's reference.
#include <algorithm>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "profile/profile_internal.hpp"
#include "strata/adam.hpp"
#include "strata/device.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "strata/plan.hpp"

namespace strata::profile {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void fill_random(void* data, std::size_t bytes, std::uint64_t seed) {
  // xorshift64*: fast enough for gigabytes, and never all zero.
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ULL + 0x2545F4914F6CDD1DULL;
  auto* p = static_cast<std::uint8_t*>(data);
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    const std::uint64_t v = x * 0x2545F4914F6CDD1DULL;
    std::memcpy(p + i, &v, 8);
  }
  for (; i < bytes; ++i) p[i] = static_cast<std::uint8_t>(i * 131 + seed);
}

void add_random_parameter(Engine& engine, const std::string& name, std::size_t n, float bound,
                          std::mt19937& rng) {
  std::vector<float> init(n);
  std::uniform_real_distribution<float> d(-bound, bound);
  for (auto& x : init) x = d(rng);
  engine.add_parameter(name, init);
}

namespace {

// Small finite values of the dtype (random, never all zero).
void fill_values(void* data, DType dtype, std::size_t n, std::uint64_t seed, float scale) {
  std::uint32_t x = static_cast<std::uint32_t>(seed * 2654435761u + 12345u);
  auto next = [&] {
    x = x * 1664525u + 1013904223u;
    return (static_cast<float>(x >> 8) / 8388608.0f - 1.0f) * scale;  // [-scale, scale)
  };
  if (dtype == DType::kFp32) {
    auto* f = static_cast<float*>(data);
    for (std::size_t i = 0; i < n; ++i) f[i] = next();
    return;
  }
  std::vector<float> tmp(std::min<std::size_t>(n, 1 << 16));
  auto* h = static_cast<std::uint16_t*>(data);
  for (std::size_t off = 0; off < n; off += tmp.size()) {
    const std::size_t k = std::min(tmp.size(), n - off);
    for (std::size_t i = 0; i < k; ++i) tmp[i] = next();
    if (dtype == DType::kFp16)
      convert_fp32_to_fp16(tmp.data(), h + off, k);
    else
      convert_fp32_to_bf16(tmp.data(), h + off, k);
  }
}

// Bytes of state one Adam update touches per element: p, m, v read + written (fp32), the
// gradient read, the 16-bit parameter copy written.
double adam_bytes_per_element(const Config& c) {
  return 24.0 + static_cast<double>(dtype_size(c.precision.accum_dtype())) +
         (c.precision.params == DType::kFp32 ? 0.0
                                             : static_cast<double>(dtype_size(c.precision.params)));
}

// n floats, page-aligned (std::vector's large blocks are not even 64-byte aligned), zeroed.
struct AlignedFloats {
  explicit AlignedFloats(std::size_t n)
      : data(static_cast<float*>(std::aligned_alloc(kPage, round_up_page(n * sizeof(float))))) {
    if (!data && n)
      fail(ErrorCode::kOutOfMemory,
           strcat("profile: CPU Adam's out-of-place arrays: cannot allocate ", n * 4, " bytes"));
    if (data) std::memset(data, 0, n * sizeof(float));
  }
  ~AlignedFloats() { std::free(data); }
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
  static constexpr std::size_t kPage = 4096;
  static std::size_t round_up_page(std::size_t b) { return (b + kPage - 1) / kPage * kPage; }
  float* data;
};

// One thread's memcpy of `bytes` (as a tier store's mover copies a host buffer), median of 5.
double host_copy_rate(void* to, const void* from, std::size_t bytes) {
  if (bytes == 0) return 0;
  std::vector<double> t;
  for (int i = 0; i < 5; ++i) {
    Stopwatch sw;
    std::memcpy(to, from, bytes);
    t.push_back(sw.seconds());
  }
  const double s = median(t);
  return s > 0 ? static_cast<double>(bytes) / s : 0.0;
}

}  // namespace

AdamMeasure measure_cpu_adam(const Config& c, std::uint64_t elements) {
  AdamMeasure m;
  CpuAdam adam(c.runtime.cpu_threads);
  const std::size_t n = elements;
  std::vector<float> p(n), ma(n), va(n);
  fill_values(p.data(), DType::kFp32, n, 1, 1.0f);
  fill_values(ma.data(), DType::kFp32, n, 2, 0.01f);
  fill_values(va.data(), DType::kFp32, n, 3, 0.01f);
  for (auto& x : va) x = x * x;
  const DType gd = c.precision.accum_dtype();  // the step's Adam reads the held gradients
  std::vector<std::uint8_t> grad(n * dtype_size(gd));
  fill_values(grad.data(), gd, n, 4, 0.1f);
  std::vector<std::uint8_t> copy(c.precision.params == DType::kFp32 ? 0 : n * 2);
  AdamTensors t;
  t.param = p.data();
  t.exp_avg = ma.data();
  t.exp_avg_sq = va.data();
  t.grad = grad.data();
  t.grad_dtype = gd;
  t.param_copy = copy.empty() ? nullptr : copy.data();
  t.param_copy_dtype = c.precision.params == DType::kFp32 ? DType::kBf16 : c.precision.params;
  t.n = n;
  const AdamParams hp = AdamParams::from_config(c.optimizer);
  // Out of place: into arrays aligned as the store's pending versions are (non-temporal stores).
  const AlignedFloats po(n), mo(n), vo(n);
  AdamTensors out = t;
  out.param_out = po.data;
  out.exp_avg_out = mo.data;
  out.exp_avg_sq_out = vo.data;
  std::vector<double> times, factors;
  for (int i = 0; i < 6; ++i) {  // in place, then out of place, alternating
    Stopwatch sw;
    adam.step(hp, t, {i + 1, 1.0f, false});
    const double in_place = sw.seconds();
    Stopwatch so;
    adam.step(hp, out, {i + 1, 1.0f, false});
    const double out_of_place = so.seconds();
    if (i == 0) continue;  // the first touches the pages
    times.push_back(in_place);
    factors.push_back(out_of_place / in_place);
  }
  m.measured = true;
  m.device = strcat("cpu ", adam_path_name(adam.path()), " x", adam.threads());
  m.elements = elements;
  m.seconds = median(times);
  m.params_per_second = static_cast<double>(n) / m.seconds;
  m.bytes_per_second = m.params_per_second * adam_bytes_per_element(c);
  m.out_of_place_factor = median(factors);
  m.host_copy_bytes_per_second = host_copy_rate(po.data, p.data(), n * sizeof(float));
  return m;
}

AdamMeasure measure_gpu_adam(const Config& c, Device& device, std::uint64_t elements) {
  AdamMeasure m;
  if (device.kind() != DeviceKind::kCuda) {
    m.skipped = "skipped: no GPU";
    return m;
  }
  if (!adam_cuda_available()) {
    m.skipped = "skipped: this build has no CUDA Adam kernels";
    return m;
  }
  const std::size_t n = elements;
  const DType gd = c.precision.accum_dtype();  // the step's Adam reads the held gradients
  const std::size_t gb = dtype_size(gd);
  DeviceMemory p = device.allocate(n * 4), ma = device.allocate(n * 4), va = device.allocate(n * 4);
  DeviceMemory grad = device.allocate(n * gb);
  DeviceMemory copy = device.allocate(n * 2);
  {
    // Random host values copied up (zeros would make the timing meaningless for no one, but keep
    // the data honest).
    std::vector<std::uint8_t> host(n * 4);
    auto stream = device.create_stream();
    fill_values(host.data(), DType::kFp32, n, 5, 1.0f);
    stream->memcpy_async(p.get(), host.data(), n * 4);
    stream->synchronize(std::chrono::seconds(60));
    fill_values(host.data(), DType::kFp32, n, 6, 0.01f);
    stream->memcpy_async(ma.get(), host.data(), n * 4);
    stream->synchronize(std::chrono::seconds(60));
    auto* f = reinterpret_cast<float*>(host.data());
    for (std::size_t i = 0; i < n; ++i) f[i] = f[i] * f[i];
    stream->memcpy_async(va.get(), host.data(), n * 4);
    stream->synchronize(std::chrono::seconds(60));
    fill_values(host.data(), gd, n, 7, 0.1f);
    stream->memcpy_async(grad.get(), host.data(), n * gb);
    stream->synchronize(std::chrono::seconds(60));
  }
  AdamTensors t;
  t.param = static_cast<float*>(p.get());
  t.exp_avg = static_cast<float*>(ma.get());
  t.exp_avg_sq = static_cast<float*>(va.get());
  t.grad = grad.get();
  t.grad_dtype = gd;
  t.param_copy = c.precision.params == DType::kFp32 ? nullptr : copy.get();
  t.param_copy_dtype = c.precision.params == DType::kFp32 ? DType::kBf16 : c.precision.params;
  t.n = n;
  const AdamParams hp = AdamParams::from_config(c.optimizer);
  // On a stream of `device` (the rank's GPU): the legacy stream would be the calling thread's
  // current device's, which need not be the one holding the arrays.
  auto run = device.create_stream();
  adam_step_cuda(hp, t, {1, 1.0f, false}, run->native_handle());
  run->synchronize(std::chrono::seconds(60));
  std::vector<double> times;
  for (int i = 0; i < 10; ++i) {
    Stopwatch sw;
    adam_step_cuda(hp, t, {i + 2, 1.0f, false}, run->native_handle());
    run->synchronize(std::chrono::seconds(60));
    times.push_back(sw.seconds());
  }
  m.measured = true;
  m.device = device.name();
  m.elements = elements;
  m.seconds = median(times);
  m.params_per_second = static_cast<double>(n) / m.seconds;
  m.bytes_per_second = m.params_per_second * adam_bytes_per_element(c);
  return m;
}

double measure_triad(std::uint64_t bytes, unsigned threads) {
  const std::size_t n = std::max<std::uint64_t>(bytes / 24, 1024);
  std::vector<double> a(n), b(n), c(n);
  for (std::size_t i = 0; i < n; ++i) {
    b[i] = static_cast<double>(i % 1000) * 0.5;
    c[i] = static_cast<double>(i % 77) * 0.25;
  }
  const double s = 3.0;
  threads = std::max(1u, threads);
  auto run = [&] {
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const std::size_t lo = n * t / threads, hi = n * (t + 1) / threads;
        for (std::size_t i = lo; i < hi; ++i) a[i] = b[i] + s * c[i];
      });
    }
    for (auto& th : pool) th.join();
  };
  run();  // touch the pages
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    Stopwatch sw;
    run();
    best = std::min(best, sw.seconds());
  }
  if (a[n / 2] != b[n / 2] + s * c[n / 2]) fail(ErrorCode::kInternal, "triad: wrong result");
  return static_cast<double>(3 * n * sizeof(double)) / best;
}

}  // namespace strata::profile
