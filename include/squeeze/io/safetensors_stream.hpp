#pragma once
// Streaming safetensors for checkpoints (the format of safetensors.hpp):
//  * write_safetensors_durably takes tensors as views (host bytes, or a callback that fills chunks, e.g.
//    from device memory through a staging buffer), writes them one after another under a temporary name,
//    hashes as it writes, fsyncs and renames: no file is ever gathered in memory.
//  * SafetensorsReader keeps only the header in memory and reads byte ranges on demand. It validates like
//    the reference implementation: the header starts with '{', the tensors cover the data section exactly,
//    tensor after tensor, without gaps or overlaps, and every byte count is numel * element size.
#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../error.hpp"
#include "posix_file.hpp"
#include "safetensors.hpp"
#include "sha256.hpp"

namespace squeeze::io {

// One tensor to write. Either `data` (borrowed host bytes) or `fill`, which produces bytes
// [offset, offset + out.size()) of the tensor into `out` (chunks of at most the writer's chunk size).
struct TensorView {
  using Fill = std::function<void(std::uint64_t offset, std::span<std::byte> out)>;
  std::string name;
  DType dtype = DType::U8;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;
  Fill fill;

  TensorView() = default;
  TensorView(std::string n, DType d, std::vector<std::int64_t> s, const void* bytes, std::size_t size)
      : name(std::move(n)), dtype(d), shape(std::move(s)), data(static_cast<const std::byte*>(bytes), size) {}
  TensorView(std::string n, DType d, std::vector<std::int64_t> s, Fill f)
      : name(std::move(n)), dtype(d), shape(std::move(s)), fill(std::move(f)) {}

  // Bytes the dtype and shape need (throws on a negative or overflowing shape).
  std::uint64_t nbytes() const {
    const auto n = detail::byte_count(shape, dtype);
    check(n.has_value(), "tensor '" + name + "': shape has a negative or overflowing dimension");
    return *n;
  }
};

template <class T>
TensorView tensor_view(std::string name, DType dtype, std::vector<std::int64_t> shape, std::span<const T> values) {
  return TensorView(std::move(name), dtype, std::move(shape), values.data(), values.size_bytes());
}
template <class T>
TensorView tensor_view(std::string name, DType dtype, std::vector<std::int64_t> shape, const std::vector<T>& values) {
  return tensor_view(std::move(name), dtype, std::move(shape), std::span<const T>(values));
}

struct StreamWriteOptions {
  std::size_t chunk_bytes = std::size_t(8) << 20;  // staging buffer for `fill` views; hashing granularity
  FaultHook hook;                                  // "<file name>:written" / ":fsynced" / ":renamed"
};

struct WrittenFile {
  std::filesystem::path path;
  std::uint64_t bytes = 0;
  std::string sha256;
  std::map<std::string, TensorInfo> tensors;
};

namespace detail {
inline nlohmann::json tensor_json(const TensorInfo& t, bool offsets) {
  nlohmann::json j = {{"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape}};
  if (offsets) j["data_offsets"] = {t.begin, t.end};
  return j;
}
}  // namespace detail

// Writes the tensors (in the given order, back to back) and string metadata to `path` through
// "<path>.tmp": data fsync'd before the rename, so `path` is either absent or whole. The caller fsyncs
// the directory. On an error the temporary file is removed and `path` is left as it was.
inline WrittenFile write_safetensors_durably(const std::filesystem::path& path, std::span<const TensorView> tensors,
                                             const std::map<std::string, std::string>& metadata = {},
                                             const StreamWriteOptions& opt = {}) {
  static_assert(std::endian::native == std::endian::little, "safetensors stores little-endian data");
  check(opt.chunk_bytes >= 8 && opt.chunk_bytes % 8 == 0, "safetensors: chunk_bytes must be a positive multiple of 8");
  WrittenFile out;
  out.path = path;
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::uint64_t off = 0;
  for (const TensorView& t : tensors) {
    check(!t.name.empty() && t.name != "__metadata__", "safetensors " + path.string() + ": invalid tensor name '" + t.name + "'");
    check(!out.tensors.count(t.name), "safetensors " + path.string() + ": tensor '" + t.name + "' is given twice");
    const std::uint64_t n = t.nbytes();
    check(bool(t.fill) || t.data.size() == n, "safetensors " + path.string() + ": tensor '" + t.name + "' has " +
                                                  std::to_string(t.data.size()) + " bytes, its dtype " + std::string(dtype_name(t.dtype)) +
                                                  " and shape need " + std::to_string(n));
    TensorInfo info{t.dtype, t.shape, off, off + n};
    h[t.name] = detail::tensor_json(info, true);
    out.tensors.emplace(t.name, std::move(info));
    off += n;
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  const std::filesystem::path tmp = path.string() + ".tmp";
  const std::string label = path.filename().string();
  bool renamed = false;
  try {
    PosixFile f = PosixFile::create(tmp);
    Sha256 sha;
    auto put = [&](std::span<const std::byte> b) {
      f.write_all(b);
      sha.update(b);
    };
    std::byte len[8];
    for (int i = 0; i < 8; ++i) len[i] = std::byte((std::uint64_t(header.size()) >> (8 * i)) & 0xff);
    put(len);
    put(std::as_bytes(std::span(header.data(), header.size())));
    std::vector<std::byte> staging;
    for (const TensorView& t : tensors) {
      const std::uint64_t n = t.nbytes();
      for (std::uint64_t at = 0; at < n;) {
        const std::size_t k = std::size_t(std::min<std::uint64_t>(opt.chunk_bytes, n - at));
        if (t.fill) {
          if (staging.size() < k) staging.resize(k);
          t.fill(at, std::span(staging.data(), k));
          put(std::span(staging.data(), k));
        } else {
          put(t.data.subspan(std::size_t(at), k));
        }
        at += k;
      }
    }
    out.bytes = 8 + header.size() + off;
    out.sha256 = sha.hex();
    detail::hook(opt.hook, label + ":written");
    f.sync();
    detail::hook(opt.hook, label + ":fsynced");
    f.close();
    rename_path(tmp, path);
    renamed = true;
    detail::hook(opt.hook, label + ":renamed");
  } catch (...) {
    if (!renamed) {
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
    }
    throw;
  }
  return out;
}

// A safetensors file opened for ranged reads: the header parsed and validated, the data left on disk.
class SafetensorsReader {
 public:
  static SafetensorsReader open(const std::filesystem::path& path) {
    SafetensorsReader r;
    r.file_ = PosixFile::open_read(path);
    r.size_ = r.file_.size();
    const std::string src = path.string();
    auto fail = [&](const std::string& what) { throw Error("safetensors " + src + ": " + what); };
    if (r.size_ < 8) fail("truncated header: the file has " + std::to_string(r.size_) + " bytes, fewer than the 8-byte header length");
    std::byte len[8];
    r.file_.pread_exact(0, len);
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | std::uint64_t(std::to_integer<std::uint8_t>(len[i]));
    if (n > kMaxHeaderBytes) fail("header length " + std::to_string(n) + " exceeds the 100 MiB limit");
    if (n > r.size_ - 8)
      fail("truncated header: its length field says " + std::to_string(n) + " bytes, the file has only " + std::to_string(r.size_ - 8) +
           " after it");
    std::string text(std::size_t(n), '\0');
    r.file_.pread_exact(8, std::as_writable_bytes(std::span(text.data(), text.size())));
    if (text.empty() || text.front() != '{') fail("header does not start with '{'");
    const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) fail("header is not valid JSON");
    if (!j.is_object()) fail("header JSON is not an object");
    r.data_offset_ = 8 + n;
    const std::uint64_t data_size = r.size_ - r.data_offset_;
    for (const auto& [name, v] : j.items()) {
      if (name == "__metadata__") {
        if (!v.is_object()) fail("__metadata__ is not an object");
        for (const auto& [k, mv] : v.items()) {
          if (!mv.is_string()) fail("__metadata__ value of '" + k + "' is not a string");
          r.metadata_[k] = mv.get<std::string>();
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
      const auto& o = v.contains("data_offsets") ? v["data_offsets"] : nlohmann::json();
      if (!o.is_array() || o.size() != 2 || !o[0].is_number_unsigned() || !o[1].is_number_unsigned())
        bad("'data_offsets' must be two non-negative integers");
      info.begin = o[0].get<std::uint64_t>();
      info.end = o[1].get<std::uint64_t>();
      if (info.begin > info.end) bad("data_offsets begin > end");
      if (info.end > data_size)
        bad("data_offsets end " + std::to_string(info.end) + " is past the data section (" + std::to_string(data_size) +
            " bytes): the file is truncated");
      const auto want = detail::byte_count(info.shape, info.dtype);
      if (!want) bad("shape overflows");
      if (*want != info.end - info.begin)
        bad("holds " + std::to_string(info.end - info.begin) + " bytes but dtype " + std::string(dtype_name(info.dtype)) +
            " and its shape need " + std::to_string(*want));
      r.tensors_.emplace(name, std::move(info));
    }
    // Tensor after tensor from offset 0 to the end of the file: no gap, no overlap, no trailing bytes.
    std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
    for (const auto& [_, t] : r.tensors_) spans.emplace_back(t.begin, t.end);
    std::sort(spans.begin(), spans.end());
    std::uint64_t at = 0;
    for (const auto& [b, e] : spans) {
      if (b != at) fail("tensor data is not contiguous at data offset " + std::to_string(std::min(b, at)) + " (gap or overlap)");
      at = e;
    }
    if (at != data_size)
      fail("the tensors cover " + std::to_string(at) + " bytes of a " + std::to_string(data_size) + "-byte data section");
    return r;
  }

  const std::filesystem::path& path() const { return file_.path(); }
  std::uint64_t file_size() const { return size_; }
  std::uint64_t data_offset() const { return data_offset_; }
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }

  const TensorInfo& info(const std::string& name) const {
    const auto it = tensors_.find(name);
    if (it == tensors_.end()) {
      std::string have;
      int shown = 0;
      for (const auto& [k, _] : tensors_) {
        if (shown++ == 8) {
          have += ", ...";
          break;
        }
        have += (have.empty() ? "" : ", ") + k;
      }
      throw Error("safetensors " + path().string() + ": tensor '" + name + "' is missing (the file holds " +
                  std::to_string(tensors_.size()) + ": " + have + ")");
    }
    return it->second;
  }
  // Offset in the file of the tensor's first byte.
  std::uint64_t file_offset(const std::string& name) const { return data_offset_ + info(name).begin; }

  // Bytes [byte_offset, byte_offset + out.size()) of the tensor.
  void read(const std::string& name, std::uint64_t byte_offset, std::span<std::byte> out) const {
    const TensorInfo& t = info(name);
    check(byte_offset <= t.end - t.begin && out.size() <= t.end - t.begin - byte_offset,
          "safetensors " + path().string() + ": range [" + std::to_string(byte_offset) + ", " + std::to_string(byte_offset + out.size()) +
              ") is outside tensor '" + name + "' (" + std::to_string(t.end - t.begin) + " bytes)");
    if (!out.empty()) file_.pread_exact(data_offset_ + t.begin + byte_offset, out);
  }
  std::vector<std::byte> read(const std::string& name) const {
    const TensorInfo& t = info(name);
    std::vector<std::byte> out(std::size_t(t.end - t.begin));
    read(name, 0, out);
    return out;
  }

 private:
  SafetensorsReader() = default;
  PosixFile file_;
  std::uint64_t size_ = 0, data_offset_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace squeeze::io
