// CpuAdam: argument checks, tiling over the persistent pool, the non-finite pre-pass.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "core/numeric.hpp"
#include "optim/adam_kernels.hpp"
#include "optim/thread_pool.hpp"
#include "strata/error.hpp"

namespace strata {

namespace {
// Elements per tile: 128 KiB of each FP32 array, 7 arrays ~ 900 KiB, about one L2. A multiple of
// every vector width, so only the last tile of a call has a scalar tail.
constexpr std::size_t kTile = CpuAdam::kStatsTileElems;

std::size_t tiles_for(std::size_t n) { return (n + kTile - 1) / kTile; }

const std::uint8_t* byte_ptr(const void* p) { return static_cast<const std::uint8_t*>(p); }
std::uint8_t* byte_ptr(void* p) { return static_cast<std::uint8_t*>(p); }

// The arrays of the tile at element `off`: read from t's, written in place or to its out arrays.
optim::AdamArrays tile_arrays(const AdamTensors& t, std::size_t off) {
  const bool in_place = t.param_out == nullptr;
  return {t.param + off,
          t.exp_avg + off,
          t.exp_avg_sq + off,
          (in_place ? t.param : t.param_out) + off,
          (in_place ? t.exp_avg : t.exp_avg_out) + off,
          (in_place ? t.exp_avg_sq : t.exp_avg_sq_out) + off};
}
}  // namespace

struct CpuAdam::Impl {
  AdamPath path;
  const optim::KernelTable* k;
  optim::ThreadPool pool;
  std::mutex mu;
  Impl(AdamPath p, unsigned threads) : path(p), k(&optim::kernels_for(p)), pool(threads) {}

  // Each tile's sum of squares and finite flag, on the pool's threads.
  void tile_stats(const void* grad, DType dtype, std::size_t n, float divisor, float scale,
                  double* sums, std::uint8_t* finite) {
    const std::size_t esz = dtype_size(dtype);
    auto task = [&](std::size_t t) {
      const std::size_t off = t * kTile, len = std::min(kTile, n - off);
      bool f = true;
      double s = 0.0;
      k->grad_stats(dtype, byte_ptr(grad) + off * esz, len, divisor, scale, &f, &s);
      sums[t] = s;
      finite[t] = f ? 1 : 0;
    };
    pool.parallel_for(tiles_for(n), task);
  }
  // The tiles' sums added in order to `start`.
  AdamGradStats stats(const void* grad, DType dtype, std::size_t n, float divisor, float scale,
                      double start = 0.0) {
    const std::size_t tiles = tiles_for(n);
    std::vector<double> sums(tiles, 0.0);
    std::vector<std::uint8_t> finite(tiles, 1);
    tile_stats(grad, dtype, n, divisor, scale, sums.data(), finite.data());
    AdamGradStats r;
    r.sum_sq = start;
    for (std::size_t t = 0; t < tiles; ++t) {
      r.finite = r.finite && finite[t] != 0;
      r.sum_sq += sums[t];
    }
    return r;
  }
};

CpuAdam::CpuAdam(unsigned threads, AdamPath path) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  if (threads > 1024)
    fail(ErrorCode::kInvalidArgument, strcat("CpuAdam: threads=", threads, " > 1024"));
  const AdamPath resolved = path == AdamPath::kAuto ? adam_default_path() : path;
  if (!adam_path_supported(resolved))
    fail(ErrorCode::kUnsupported,
         strcat("CpuAdam: path ", adam_path_name(resolved), " is not supported by this CPU"));
  impl_ = std::make_unique<Impl>(resolved, threads);
}

CpuAdam::~CpuAdam() = default;

AdamPath CpuAdam::path() const { return impl_->path; }
unsigned CpuAdam::threads() const { return impl_->pool.size(); }

AdamStepResult CpuAdam::step(const AdamParams& params, const AdamTensors& t,
                             const AdamStepOptions& o) {
  optim::validate_adam_call(params, t, o, "CpuAdam::step");
  AdamStepResult result;
  if (t.n == 0) return result;
  std::lock_guard<std::mutex> lk(impl_->mu);
  if (o.check_finite &&
      !impl_->stats(t.grad, t.grad_dtype, t.n, o.grad_divisor, o.grad_scale).finite) {
    result.applied = false;
    return result;
  }
  const optim::AdamConsts c = optim::make_adam_consts(params, o);
  const optim::CopyKind ck = optim::copy_kind(t);
  const std::size_t gsz = dtype_size(t.grad_dtype);
  const std::size_t csz = t.param_copy ? dtype_size(t.param_copy_dtype) : 0;
  const optim::KernelTable* k = impl_->k;
  auto task = [&](std::size_t tile) {
    const std::size_t off = tile * kTile, len = std::min(kTile, t.n - off);
    k->adam(c, t.grad_dtype, ck, tile_arrays(t, off), byte_ptr(t.grad) + off * gsz,
            t.param_copy ? byte_ptr(t.param_copy) + off * csz : nullptr, len);
  };
  impl_->pool.parallel_for(tiles_for(t.n), task);
  return result;
}

namespace {
// The argument checks of grad_stats / grad_stats_continue (`what` names the call); n > 0.
void check_grad_args(const char* what, const void* grad, DType dtype, std::size_t n,
                     float divisor) {
  if (!grad) fail(ErrorCode::kInvalidArgument, strcat(what, ": null grad with n=", n));
  if (!(divisor > 0.0f) || !std::isfinite(divisor))
    fail(ErrorCode::kInvalidArgument,
         strcat(what, ": grad_divisor=", divisor, " must be finite and > 0"));
  if (dtype != DType::kFp32 && dtype != DType::kFp16 && dtype != DType::kBf16)
    fail(ErrorCode::kInvalidArgument, strcat(what, ": unknown dtype"));
  if (reinterpret_cast<std::uintptr_t>(grad) % dtype_size(dtype) != 0)
    fail(ErrorCode::kInvalidArgument, strcat(what, ": grad not aligned to its element size"));
}
}  // namespace

AdamGradStats CpuAdam::grad_stats(const void* grad, DType dtype, std::size_t n, float grad_scale,
                                  float grad_divisor) {
  if (n == 0) return {};
  check_grad_args("CpuAdam::grad_stats", grad, dtype, n, grad_divisor);
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->stats(grad, dtype, n, grad_divisor, grad_scale);
}

AdamGradStats CpuAdam::grad_stats_continue(const AdamGradStats& so_far, const void* grad,
                                           DType dtype, std::size_t n, float grad_scale,
                                           float grad_divisor) {
  if (n == 0) return so_far;
  check_grad_args("CpuAdam::grad_stats_continue", grad, dtype, n, grad_divisor);
  std::lock_guard<std::mutex> lk(impl_->mu);
  AdamGradStats r = impl_->stats(grad, dtype, n, grad_divisor, grad_scale, so_far.sum_sq);
  r.finite = r.finite && so_far.finite;
  return r;
}

void CpuAdam::grad_stats_tiles(const void* grad, DType dtype, std::size_t n, double* tile_sums,
                               std::uint8_t* tile_finite, float grad_scale, float grad_divisor) {
  if (n == 0) return;
  check_grad_args("CpuAdam::grad_stats_tiles", grad, dtype, n, grad_divisor);
  if (!tile_sums || !tile_finite)
    fail(ErrorCode::kInvalidArgument, "CpuAdam::grad_stats_tiles: null output arrays");
  std::lock_guard<std::mutex> lk(impl_->mu);
  impl_->tile_stats(grad, dtype, n, grad_divisor, grad_scale, tile_sums, tile_finite);
}

void CpuAdam::stream_reference(const AdamTensors& t) {
  AdamStepOptions o;
  optim::validate_adam_call(AdamParams{}, t, o, "CpuAdam::stream_reference");
  if (t.n == 0) return;
  std::lock_guard<std::mutex> lk(impl_->mu);
  const std::size_t gsz = dtype_size(t.grad_dtype);
  const std::size_t csz = t.param_copy ? dtype_size(t.param_copy_dtype) : 0;
  const optim::KernelTable* k = impl_->k;
  auto task = [&](std::size_t tile) {
    const std::size_t off = tile * kTile, len = std::min(kTile, t.n - off);
    k->stream(t.grad_dtype, tile_arrays(t, off), byte_ptr(t.grad) + off * gsz,
              csz ? byte_ptr(t.param_copy) + off * csz : nullptr, csz, len);
  };
  impl_->pool.parallel_for(tiles_for(t.n), task);
}

}  // namespace strata
