// A small, strict reader of the safetensors format (https://huggingface.co/docs/safetensors),
// written from the specification for the export tests: 8-byte little-endian header length N, N
// bytes of JSON header ({name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__":
// {string: string}}), then the byte buffer, which the tensors must cover exactly, without holes or
// overlaps. Each tensor's byte count must be the product of its shape times its dtype's size.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace strata::testing {

struct SafeTensor {
  std::string dtype;
  std::vector<std::uint64_t> shape;
  std::string bytes;
};

struct SafeTensorsFile {
  std::map<std::string, SafeTensor> tensors;
  std::map<std::string, std::string> metadata;
};

inline SafeTensorsFile parse_safetensors(const std::string& file) {
  if (file.size() < 8) throw std::runtime_error("shorter than the 8-byte header length");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = n << 8 | static_cast<unsigned char>(file[static_cast<std::size_t>(i)]);
  if (n > file.size() - 8) throw std::runtime_error("header length beyond the file");
  const nlohmann::json h = nlohmann::json::parse(file.substr(8, n));
  if (!h.is_object()) throw std::runtime_error("header is not an object");
  const std::string data = file.substr(8 + n);
  SafeTensorsFile out;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  for (auto& [name, t] : h.items()) {
    if (name == "__metadata__") {
      for (auto& [k, v] : t.items()) out.metadata[k] = v.get<std::string>();
      continue;
    }
    SafeTensor st;
    st.dtype = t.at("dtype").get<std::string>();
    st.shape = t.at("shape").get<std::vector<std::uint64_t>>();
    const auto off = t.at("data_offsets").get<std::vector<std::uint64_t>>();
    if (off.size() != 2 || off[0] > off[1] || off[1] > data.size())
      throw std::runtime_error(name + ": bad data_offsets");
    std::uint64_t elems = 1;
    for (auto d : st.shape) elems *= d;
    const std::uint64_t es = st.dtype == "F32"                           ? 4
                             : (st.dtype == "BF16" || st.dtype == "F16") ? 2
                                                                         : 0;
    if (es == 0) throw std::runtime_error(name + ": unknown dtype " + st.dtype);
    if (elems * es != off[1] - off[0])
      throw std::runtime_error(name + ": byte count does not match the shape");
    st.bytes = data.substr(off[0], off[1] - off[0]);
    ranges.emplace_back(off[0], off[1]);
    out.tensors[name] = std::move(st);
  }
  std::sort(ranges.begin(), ranges.end());
  std::uint64_t pos = 0;
  for (auto& [b, e] : ranges) {
    if (b != pos) throw std::runtime_error("the byte buffer has a hole or an overlap");
    pos = e;
  }
  if (pos != data.size())
    throw std::runtime_error("the byte buffer has unindexed bytes at its end");
  return out;
}

}  // namespace strata::testing
