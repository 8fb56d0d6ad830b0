// File helpers for checkpoint tests: read/write whole files, re-seal an edited manifest (as a
// crafted manifest would be), list shard files.
#pragma once

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/crc32c.hpp"
#include "strata/error.hpp"

namespace strata::testing {

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline void write_file(const std::filesystem::path& p, const std::string& data) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
}

// Seals a JSON object as strata does (checkpoint/format.cpp): the dump without its closing brace,
// then the "manifest_crc32c" member holding the CRC32C of everything before it.
inline std::string seal(nlohmann::json j) {
  j.erase("manifest_crc32c");
  std::string body = j.dump(1);
  body.resize(body.size() - 2);
  char hex[9];
  std::snprintf(hex, sizeof(hex), "%08x", crc32c(body.data(), body.size()));
  return body + ",\n \"manifest_crc32c\": \"" + hex + "\"\n}\n";
}

inline std::vector<std::filesystem::path> shard_files(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> out;
  for (auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().rfind("shard-", 0) == 0) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace strata::testing
