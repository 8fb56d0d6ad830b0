// The basic value types every layer shares (core): element types, tiers, and the kinds a config
// chooses between, with the one table of their names (what the YAML, the CLI, the logs and the
// JSON spell) and the one table of element sizes. config.hpp includes this header; this header
// includes nothing of strata's.
//
// Thread-safety: the tables are constant; every function is safe to call from any thread.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

namespace strata {

enum class DType { kFp16, kBf16, kFp32 };
enum class OptimizerType { kAdam, kAdamW };
// Where the optimizer update runs: the CPU kernel on host memory, or the runtime.device's kernel
// after a host-to-device copy (DeviceAdam).
enum class OptimizerUpdate { kCpu, kDevice, kAuto };
// Whether the update runs speculatively during the backward (optimizer.overlap, docs/offload.md).
enum class OptimizerOverlap { kOff, kOn, kAuto };
// Where a piece of state lives. kCpu is host memory (pinned or pageable, see OffloadTarget).
enum class Tier { kGpu, kCpu, kNvme };
enum class IoEngineKind { kAuto, kIoUring, kThreads };
enum class DirectIoMode { kAuto, kRequired, kOff };
enum class DeviceKind { kAuto, kCuda, kHost };
enum class CommBackend { kAuto, kInProcess, kMpi, kNccl };

// One row of an enum's name table.
template <class E>
struct EnumName {
  E value;
  const char* name;
};

// A table's rows (a span; this header also compiles as C++17, in CUDA translation units).
template <class E>
struct EnumNames {
  const EnumName<E>* rows;
  std::size_t count;
  const EnumName<E>* begin() const { return rows; }
  const EnumName<E>* end() const { return rows + count; }
  std::size_t size() const { return count; }
  const EnumName<E>& operator[](std::size_t i) const { return rows[i]; }
};

// The name table of E, in the enum's order: defined (in src/core/types.cpp) for each enum that
// STRATA_NAMED_ENUMS lists (an X-macro: STRATA_NAMED_ENUMS(F) expands F(E) for each).
template <class E>
EnumNames<E> enum_names();
// clang-format off
#define STRATA_NAMED_ENUMS(F)                                             \
  F(DType) F(Tier) F(OptimizerType) F(OptimizerUpdate) F(OptimizerOverlap) \
  F(IoEngineKind) F(DirectIoMode) F(DeviceKind) F(CommBackend)
// clang-format on
#define STRATA_DECLARE_ENUM_NAMES(E) \
  template <>                        \
  EnumNames<E> enum_names<E>();
STRATA_NAMED_ENUMS(STRATA_DECLARE_ENUM_NAMES)
#undef STRATA_DECLARE_ENUM_NAMES

// The name of `v` from its table; "?" for a value outside it (a cast from a bad integer).
template <class E>
const char* enum_name(E v) {
  for (const auto& row : enum_names<E>())
    if (row.value == v) return row.name;
  return "?";
}

// The value named `name` in E's table; nullopt for an unknown name.
template <class E>
std::optional<E> enum_from_name(std::string_view name) {
  for (const auto& row : enum_names<E>())
    if (name == row.name) return row.value;
  return std::nullopt;
}

// Bytes per element: 2 (fp16, bf16) or 4 (fp32), from the one size table.
std::size_t dtype_size(DType t);

// The names, by enum (each one row of its table).
const char* dtype_name(DType t);                         // "fp16" | "bf16" | "fp32"
const char* tier_name(Tier t);                           // "gpu" | "cpu" | "nvme"
const char* optimizer_name(OptimizerType t);             // "adam" | "adamw"
const char* optimizer_update_name(OptimizerUpdate u);    // "cpu" | "device" | "auto"
const char* optimizer_overlap_name(OptimizerOverlap o);  // "off" | "on" | "auto"
const char* io_engine_name(IoEngineKind k);              // "auto" | "io_uring" | "threads"
const char* direct_io_name(DirectIoMode m);              // "auto" | "required" | "off"
const char* device_name(DeviceKind k);                   // "auto" | "cuda" | "host"
const char* comm_backend_name(CommBackend b);            // "auto" | "inprocess" | "mpi" | "nccl"

}  // namespace strata
