// libFuzzer target for the checkpoint manifest reader: any bytes given to parse_manifest() either
// parse or throw strata::Error (kChecksum or kInvalidArgument), within the fuzzer's time and
// memory limits, and every message is bounded and free of control characters other than '\n'.
// The seal is checked first, so most inputs stop there; the target also seals each input as
// strata does (a crafted manifest with a valid checksum) so that the JSON, the limits and every
// field check are reached. A manifest that parses serializes to text that parses back to the
// same manifest.
// Built with clang (tests/fuzz/CMakeLists.txt) and run under CTest (label "fuzz").
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "checkpoint/format.hpp"
#include "core/crc32c.hpp"
#include "strata/error.hpp"

namespace {

using namespace strata;
using namespace strata::checkpoint;

void check_message(const Error& e) {
  const ErrorCode c = e.code();
  if (c != ErrorCode::kChecksum && c != ErrorCode::kInvalidArgument) __builtin_trap();
  const std::string_view w = e.what();
  if (w.size() > 4096) __builtin_trap();  // a message quotes at most a little of the input
  for (char ch : w)
    if (ch != '\n' && static_cast<unsigned char>(ch) < 0x20) __builtin_trap();
}

bool same(const Manifest& a, const Manifest& b) {
  if (a.tensors.size() != b.tensors.size() || a.shards.size() != b.shards.size()) return false;
  for (std::size_t i = 0; i < a.tensors.size(); ++i)
    if (a.tensors[i].name != b.tensors[i].name || a.tensors[i].numel != b.tensors[i].numel ||
        a.tensors[i].offset != b.tensors[i].offset)
      return false;
  for (std::size_t i = 0; i < a.shards.size(); ++i)
    if (a.shards[i].file != b.shards[i].file || a.shards[i].bytes != b.shards[i].bytes ||
        a.shards[i].header_crc32c != b.shards[i].header_crc32c)
      return false;
  return a.serial == b.serial && a.world == b.world && a.stage == b.stage &&
         a.param_dtype == b.param_dtype && a.flat_size == b.flat_size &&
         a.block_elems == b.block_elems && a.adam_step == b.adam_step &&
         a.loss_scale == b.loss_scale && a.steps == b.steps && a.strata_version == b.strata_version;
}

void one(std::string_view text) {
  try {
    const Manifest m = parse_manifest(text, "fuzz/manifest.json");
    const std::string again = serialize_manifest(m);
    if (!same(parse_manifest(again, "again"), m)) __builtin_trap();
  } catch (const Error& e) {
    check_message(e);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  one(text);
  // Sealed: everything up to the last "}" (the object's end) as the body.
  std::string body(text);
  while (!body.empty() && (body.back() == '\n' || body.back() == ' ')) body.pop_back();
  if (!body.empty() && body.back() == '}') body.pop_back();
  while (!body.empty() && (body.back() == '\n' || body.back() == ' ')) body.pop_back();
  char hex[9];
  std::snprintf(hex, sizeof hex, "%08x", crc32c(body.data(), body.size()));
  one(body + ",\n \"manifest_crc32c\": \"" + hex + "\"\n}\n");
  return 0;
}
