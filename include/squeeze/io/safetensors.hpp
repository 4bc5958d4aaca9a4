#pragma once
// safetensors read/write on raw bytes, torch-free.
//
// File: 8-byte little-endian header length N, N bytes of JSON, then the data section. The JSON maps
// tensor names to {"dtype": "F16", "shape": [..], "data_offsets": [begin, end]} (offsets relative to
// the data section) plus an optional "__metadata__" object of string values.
// Reading validates everything before handing out a byte: header length bounds, JSON syntax and types,
// known dtypes, non-negative shapes without overflow, byte count == numel * element size, offsets inside
// the file and non-overlapping. A corrupt or hostile file yields squeeze::Error naming the problem.
// Writing goes to "<path>.tmp" and renames over <path>, so a failed save never destroys an old file.
#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../error.hpp"

namespace squeeze::io {

enum class DType { BOOL, U8, I8, I16, U16, I32, U32, I64, U64, F16, BF16, F32, F64 };

inline constexpr std::pair<DType, std::string_view> kDTypeNames[] = {
    {DType::BOOL, "BOOL"}, {DType::U8, "U8"},   {DType::I8, "I8"},     {DType::I16, "I16"}, {DType::U16, "U16"},
    {DType::I32, "I32"},   {DType::U32, "U32"}, {DType::I64, "I64"},   {DType::U64, "U64"}, {DType::F16, "F16"},
    {DType::BF16, "BF16"}, {DType::F32, "F32"}, {DType::F64, "F64"}};

inline std::string_view dtype_name(DType d) {
  for (auto [t, n] : kDTypeNames)
    if (t == d) return n;
  return "?";
}
inline std::optional<DType> parse_dtype(std::string_view s) {
  for (auto [t, n] : kDTypeNames)
    if (n == s) return t;
  return std::nullopt;
}
inline std::size_t dtype_size(DType d) {
  switch (d) {
    case DType::BOOL: case DType::U8: case DType::I8: return 1;
    case DType::I16: case DType::U16: case DType::F16: case DType::BF16: return 2;
    case DType::I32: case DType::U32: case DType::F32: return 4;
    default: return 8;
  }
}

// A tensor to write: bytes owned by the caller.
struct TensorRef {
  DType dtype;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;
};
template <class T>
TensorRef tensor_ref(DType dtype, std::vector<std::int64_t> shape, std::span<const T> values) {
  return {dtype, std::move(shape), std::as_bytes(values)};
}

struct TensorInfo {
  DType dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;  // within the data section
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
};

inline constexpr std::uint64_t kMaxHeaderBytes = 100ull << 20;  // the format's own limit

namespace detail {
// numel * element size, or nullopt on overflow / negative dims
inline std::optional<std::uint64_t> byte_count(const std::vector<std::int64_t>& shape, DType d) {
  std::uint64_t n = dtype_size(d);
  for (auto s : shape) {
    if (s < 0) return std::nullopt;
    if (s != 0 && n > (std::uint64_t(1) << 62) / std::uint64_t(s)) return std::nullopt;
    n *= std::uint64_t(s);
  }
  return n;
}
}  // namespace detail

class SafetensorsFile {
 public:
  // Reads and validates a whole file.
  static SafetensorsFile open(const std::filesystem::path& path) {
    std::ifstream f(path, std::ios::binary);
    check(bool(f), "safetensors: cannot open " + path.string());
    f.seekg(0, std::ios::end);
    const auto size = std::uint64_t(f.tellg());
    f.seekg(0);
    std::vector<std::byte> bytes(size);
    f.read(reinterpret_cast<char*>(bytes.data()), std::streamsize(size));
    check(bool(f), "safetensors: short read from " + path.string());
    return parse(std::move(bytes), path.string());
  }

  static SafetensorsFile parse(std::vector<std::byte> bytes, const std::string& source = "<memory>") {
    SafetensorsFile sf;
    sf.source_ = source;
    auto fail = [&](const std::string& what) { throw Error("safetensors " + source + ": " + what); };
    if (bytes.size() < 8) fail("file has " + std::to_string(bytes.size()) + " bytes, shorter than the 8-byte header length");
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | std::uint64_t(std::to_integer<std::uint8_t>(bytes[i]));
    if (n > kMaxHeaderBytes) fail("header length " + std::to_string(n) + " exceeds the 100 MiB limit");
    if (n > bytes.size() - 8) fail("header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(bytes.size()) + " bytes)");
    const std::string_view text(reinterpret_cast<const char*>(bytes.data()) + 8, std::size_t(n));
    const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) fail("header is not valid JSON");
    if (!j.is_object()) fail("header JSON is not an object");
    const std::uint64_t data_size = bytes.size() - 8 - n;
    for (const auto& [name, v] : j.items()) {
      if (name == "__metadata__") {
        if (!v.is_object()) fail("__metadata__ is not an object");
        for (const auto& [k, mv] : v.items()) {
          if (!mv.is_string()) fail("__metadata__ value of '" + k + "' is not a string");
          sf.metadata_[k] = mv.get<std::string>();
        }
        continue;
      }
      auto bad = [&](const std::string& what) { fail("tensor '" + name + "': " + what); };
      if (!v.is_object()) bad("entry is not an object");
      if (!v.contains("dtype") || !v["dtype"].is_string()) bad("missing string 'dtype'");
      const auto dt = parse_dtype(v["dtype"].get<std::string>());
      if (!dt) bad("unknown dtype '" + v["dtype"].get<std::string>() + "'");
      if (!v.contains("shape") || !v["shape"].is_array()) bad("missing array 'shape'");
      TensorInfo info{*dt, {}, 0, 0};
      for (const auto& d : v["shape"]) {
        if (!d.is_number_unsigned()) bad("shape entries must be non-negative integers");
        const auto u = d.get<std::uint64_t>();
        if (u > (std::uint64_t(1) << 62)) bad("shape entry too large");
        info.shape.push_back(std::int64_t(u));
      }
      if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2 ||
          !v["data_offsets"][0].is_number_unsigned() || !v["data_offsets"][1].is_number_unsigned())
        bad("'data_offsets' must be two non-negative integers");
      info.begin = v["data_offsets"][0].get<std::uint64_t>();
      info.end = v["data_offsets"][1].get<std::uint64_t>();
      if (info.begin > info.end) bad("data_offsets begin > end");
      if (info.end > data_size)
        bad("data_offsets end " + std::to_string(info.end) + " is past the data section (" + std::to_string(data_size) + " bytes)");
      const auto want = detail::byte_count(info.shape, info.dtype);
      if (!want) bad("shape overflows");
      if (*want != info.end - info.begin)
        bad("holds " + std::to_string(info.end - info.begin) + " bytes but dtype " + std::string(dtype_name(info.dtype)) +
            " and its shape need " + std::to_string(*want));
      sf.tensors_[name] = std::move(info);
    }
    // non-overlapping
    std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
    for (const auto& [_, t] : sf.tensors_)
      if (t.end > t.begin) spans.emplace_back(t.begin, t.end);
    std::sort(spans.begin(), spans.end());
    for (std::size_t i = 1; i < spans.size(); ++i)
      if (spans[i].first < spans[i - 1].second) fail("tensor byte ranges overlap at data offset " + std::to_string(spans[i].first));
    sf.data_offset_ = 8 + n;
    sf.bytes_ = std::move(bytes);
    return sf;
  }

  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& source() const { return source_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }

  const TensorInfo& info(const std::string& name) const {
    auto it = tensors_.find(name);
    check(it != tensors_.end(), "safetensors " + source_ + ": no tensor named '" + name + "'");
    return it->second;
  }
  std::span<const std::byte> bytes(const std::string& name) const {
    const auto& t = info(name);
    return {bytes_.data() + data_offset_ + t.begin, std::size_t(t.end - t.begin)};
  }
  // Copy of a tensor's values; the dtype must be `expected` (element size must match T).
  template <class T>
  std::vector<T> read(const std::string& name, DType expected) const {
    const auto& t = info(name);
    check(t.dtype == expected, "safetensors " + source_ + ": tensor '" + name + "' has dtype " + std::string(dtype_name(t.dtype)) +
                                   ", expected " + std::string(dtype_name(expected)));
    check(sizeof(T) == dtype_size(expected), "safetensors: element type size does not match the dtype");
    std::vector<T> out(std::size_t(t.numel()));
    const auto b = bytes(name);
    if (!b.empty()) std::memcpy(out.data(), b.data(), b.size());
    return out;
  }

 private:
  std::string source_;
  std::vector<std::byte> bytes_;
  std::uint64_t data_offset_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes tensors (sorted by name, packed back to back) and string metadata.
inline void save_safetensors(const std::filesystem::path& path, const std::map<std::string, TensorRef>& tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  static_assert(std::endian::native == std::endian::little, "safetensors stores little-endian data");
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::uint64_t off = 0;
  for (const auto& [name, t] : tensors) {
    check(name != "__metadata__" && !name.empty(), "safetensors: invalid tensor name '" + name + "'");
    const auto want = detail::byte_count(t.shape, t.dtype);
    check(want && *want == t.data.size(), "safetensors: tensor '" + name + "' has " + std::to_string(t.data.size()) +
                                              " bytes, its dtype and shape need " + (want ? std::to_string(*want) : "an overflowing count"));
    h[name] = {{"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape}, {"data_offsets", {off, off + t.data.size()}}};
    off += t.data.size();
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  const auto tmp = std::filesystem::path(path.string() + ".tmp");
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    check(bool(f), "safetensors: cannot write " + tmp.string());
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((std::uint64_t(header.size()) >> (8 * i)) & 0xff);
    f.write(reinterpret_cast<const char*>(len), 8);
    f.write(header.data(), std::streamsize(header.size()));
    for (const auto& [_, t] : tensors) f.write(reinterpret_cast<const char*>(t.data.data()), std::streamsize(t.data.size()));
    f.flush();
    check(bool(f), "safetensors: write to " + tmp.string() + " failed (disk full?)");
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace squeeze::io
