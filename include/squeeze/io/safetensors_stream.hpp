#pragma once
// Streaming safetensors for checkpoints (the format of safetensors.hpp):
//  * write_safetensors_durably takes tensors as views (host bytes, or a callback that fills chunks, e.g.
//    from device memory through a staging buffer), writes them one after another under a temporary name,
//    hashes as it writes, fsyncs and renames: no file is ever gathered in memory.
// Reading is safetensors.hpp's SafetensorsReader (the header in memory, byte ranges on demand), which validates as
// the reference implementation does: the header starts with '{', the tensors cover the data section exactly, tensor
// after tensor, and every byte count is numel * element size.
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

#include "squeeze/error.hpp"
#include "squeeze/io/chunk_pipeline.hpp"
#include "squeeze/io/posix_file.hpp"
#include "squeeze/io/safetensors.hpp"
#include "squeeze/io/sha256.hpp"

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
                                             const std::map<std::string, std::string>& metadata = {}, const StreamWriteOptions& opt = {}) {
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
    std::byte len[8];
    for (int i = 0; i < 8; ++i) len[i] = std::byte((std::uint64_t(header.size()) >> (8 * i)) & 0xff);
    for (std::span<const std::byte> b : {std::span<const std::byte>(len), std::as_bytes(std::span(header.data(), header.size()))}) {
      f.write_all(b);
      sha.update(b);
    }
    // The data section as chunks of at most chunk_bytes, each inside one tensor.
    struct Chunk {
      std::size_t tensor;
      std::uint64_t at;
      std::size_t size;
    };
    std::vector<Chunk> chunks;
    for (std::size_t t = 0; t < tensors.size(); ++t)
      for (std::uint64_t at = 0, n = tensors[t].nbytes(); at < n; at += opt.chunk_bytes)
        chunks.push_back({t, at, std::size_t(std::min<std::uint64_t>(opt.chunk_bytes, n - at))});
    std::vector<std::byte> staging[2];
    std::span<const std::byte> ready[2];
    pipeline_chunks(
        chunks.size(),
        [&](std::size_t i, int slot) {  // fill views copy here, on the caller's thread (and CUDA stream)
          const Chunk& c = chunks[i];
          const TensorView& t = tensors[c.tensor];
          if (t.fill) {
            if (staging[slot].size() < c.size) staging[slot].resize(c.size);
            t.fill(c.at, std::span(staging[slot].data(), c.size));
            ready[slot] = std::span<const std::byte>(staging[slot].data(), c.size);
          } else {
            ready[slot] = t.data.subspan(std::size_t(c.at), c.size);
          }
        },
        [&](std::size_t, int slot) { run_both([&] { f.write_all(ready[slot]); }, [&] { sha.update(ready[slot]); }); });
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

}  // namespace squeeze::io
