#pragma once
// safetensors read/write on raw bytes, torch-free.
//
// File: 8-byte little-endian header length N, N bytes of JSON, then the data section. The JSON maps
// tensor names to {"dtype": "F16", "shape": [..], "data_offsets": [begin, end]} (offsets relative to
// the data section) plus an optional "__metadata__" object of string values.
// Reading validates everything before handing out a byte: header length bounds, JSON syntax and types,
// no duplicate keys, known dtypes, non-negative shapes without overflow, byte count == numel * element size, offsets inside
// the file and non-overlapping. A corrupt or hostile file yields squeeze::Error naming the problem.
// Writing goes to "<path>.tmp" and renames over <path>, so a failed save never destroys an old file.
//
// SafetensorsFile holds a whole file in memory (small checkpoints). SafetensorsReader reads only the
// header when opened and each tensor's bytes on request (pread), so a model larger than host memory can
// be loaded one tensor, or one slice of a tensor, at a time. Sharded checkpoints: safetensors_sharded.hpp.
#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <nlohmann/json.hpp>

#include "squeeze/error.hpp"

namespace squeeze::io {

enum class DType { BOOL, U8, I8, I16, U16, I32, U32, I64, U64, F16, BF16, F32, F64 };

inline constexpr std::pair<DType, std::string_view> kDTypeNames[] = {
    {DType::BOOL, "BOOL"}, {DType::U8, "U8"},   {DType::I8, "I8"},   {DType::I16, "I16"}, {DType::U16, "U16"},
    {DType::I32, "I32"},   {DType::U32, "U32"}, {DType::I64, "I64"}, {DType::U64, "U64"}, {DType::F16, "F16"},
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
    case DType::BOOL:
    case DType::U8:
    case DType::I8:
      return 1;
    case DType::I16:
    case DType::U16:
    case DType::F16:
    case DType::BF16:
      return 2;
    case DType::I32:
    case DType::U32:
    case DType::F32:
      return 4;
    default:
      return 8;
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

inline std::uint64_t read_le64(const std::byte* p) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::uint64_t(std::to_integer<std::uint8_t>(p[i]));
  return n;
}

// The 8-byte header length n of a file of file_size bytes: within the format's limit and the file.
inline void check_header_length(std::uint64_t n, std::uint64_t file_size, const std::string& source) {
  auto fail = [&](const std::string& what) { throw Error("safetensors " + source + ": " + what); };
  if (n > kMaxHeaderBytes) fail("header length " + std::to_string(n) + " exceeds the 100 MiB limit");
  if (n > file_size - 8)
    fail("truncated header: header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(file_size) +
         " bytes)");
}

struct Header {
  std::map<std::string, TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
};

// read<T>(name, expected) of SafetensorsFile and SafetensorsReader: the stored dtype and T's size must match.
inline void check_read_type(const TensorInfo& t, DType expected, std::size_t element_size, const std::string& source,
                            const std::string& name) {
  check(t.dtype == expected, "safetensors " + source + ": tensor '" + name + "' has dtype " + std::string(dtype_name(t.dtype)) +
                                 ", expected " + std::string(dtype_name(expected)));
  check(element_size == dtype_size(expected), "safetensors: element type size does not match the dtype");
}

// JSON text parsed, and the first key an object repeats ("'k'" at the top level, "'k' in 'parent'" below it; empty if
// none). nlohmann::json silently keeps the last of duplicate keys, while the safetensors format disallows them (its
// reference reader refuses such a header): a name given two tensors must not quietly load one of them.
struct UniqueKeysJson {
  nlohmann::json json;  // discarded when the text is not valid JSON
  std::string duplicate;
};
inline UniqueKeysJson parse_json_unique_keys(std::string_view text) {
  UniqueKeysJson out;
  struct Level {
    bool object = false;
    std::string key;  // the member being parsed
    std::set<std::string> keys;
  };
  std::vector<Level> open;  // the objects and arrays around the parser's position
  const auto callback = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start || event == E::array_start) {
      open.push_back({event == E::object_start, {}, {}});
    } else if (event == E::object_end || event == E::array_end) {
      if (!open.empty()) open.pop_back();
    } else if (event == E::key && !open.empty()) {
      Level& level = open.back();
      level.key = parsed.get<std::string>();
      if (!level.keys.insert(level.key).second && out.duplicate.empty()) {
        out.duplicate = "'" + level.key + "'";
        if (open.size() >= 2 && open[open.size() - 2].object) out.duplicate += " in '" + open[open.size() - 2].key + "'";
      }
    }
    return true;
  };
  out.json = nlohmann::json::parse(text, callback, /*allow_exceptions=*/false);
  return out;
}

// Validates a header's JSON text against a data section of data_size bytes (shared by the in-memory
// SafetensorsFile and the streaming SafetensorsReader, so both refuse exactly the same files).
inline Header parse_header(std::string_view text, std::uint64_t data_size, const std::string& source) {
  Header out;
  auto fail = [&](const std::string& what) { throw Error("safetensors " + source + ": " + what); };
  if (text.empty() || text.front() != '{') fail("header does not start with '{'");
  const auto parsed = parse_json_unique_keys(text);
  const nlohmann::json& j = parsed.json;
  if (j.is_discarded()) fail("header is not valid JSON");
  if (!parsed.duplicate.empty()) fail("header has the duplicate key " + parsed.duplicate + " (the format allows each key once)");
  if (!j.is_object()) fail("header JSON is not an object");
  for (const auto& item : j.items()) {  // not a structured binding: clang 14 (the fuzz build) cannot capture one
    const std::string& name = item.key();
    const nlohmann::json& v = item.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail("__metadata__ is not an object");
      for (const auto& [k, mv] : v.items()) {
        if (!mv.is_string()) fail("__metadata__ value of '" + k + "' is not a string");
        out.metadata[k] = mv.get<std::string>();
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
    const auto want = byte_count(info.shape, info.dtype);
    if (!want) bad("shape overflows");
    if (*want != info.end - info.begin)
      bad("holds " + std::to_string(info.end - info.begin) + " bytes but dtype " + std::string(dtype_name(info.dtype)) +
          " and its shape need " + std::to_string(*want));
    out.tensors[name] = std::move(info);
  }
  // Tensor after tensor from offset 0 to the end of the data section, as the format's reference reader requires:
  // no overlap, no gap, no trailing bytes.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  for (const auto& [_, t] : out.tensors) spans.emplace_back(t.begin, t.end);
  std::sort(spans.begin(), spans.end());
  std::uint64_t at = 0;
  for (const auto& [b, e] : spans) {
    if (b < at) fail("tensor byte ranges overlap at data offset " + std::to_string(b));
    if (b > at) fail("tensor data is not contiguous at data offset " + std::to_string(at) + " (a gap)");
    at = e;
  }
  if (at != data_size) fail("the tensors cover " + std::to_string(at) + " bytes of a " + std::to_string(data_size) + "-byte data section");
  return out;
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
    if (bytes.size() < 8)
      fail("truncated header: the file has " + std::to_string(bytes.size()) + " bytes, shorter than the 8-byte header length");
    const std::uint64_t n = detail::read_le64(bytes.data());
    detail::check_header_length(n, bytes.size(), source);
    const std::string_view text(reinterpret_cast<const char*>(bytes.data()) + 8, std::size_t(n));
    auto h = detail::parse_header(text, bytes.size() - 8 - n, source);
    sf.tensors_ = std::move(h.tensors);
    sf.metadata_ = std::move(h.metadata);
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
    check(it != tensors_.end(), "safetensors " + source_ + ": tensor '" + name + "' is missing");
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
    detail::check_read_type(t, expected, sizeof(T), source_, name);
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

namespace detail {
// An open file descriptor, closed on destruction (move-only).
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

inline std::string errno_text() { return std::strerror(errno); }

// Reads exactly out.size() bytes at `offset`; false if the file ends first. Retries short reads and EINTR.
inline bool pread_all(int fd, std::span<std::byte> out, std::uint64_t offset, const std::string& source) {
  std::size_t done = 0;
  while (done < out.size()) {
    const ::ssize_t r = ::pread(fd, out.data() + done, out.size() - done, ::off_t(offset + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw Error("safetensors " + source + ": read failed: " + errno_text());
    }
    if (r == 0) return false;
    done += std::size_t(r);
  }
  return true;
}
}  // namespace detail

// A safetensors file whose header is read and validated on open (as SafetensorsFile does) and whose tensor
// bytes stay on disk until read_bytes / read asks for them. Reads of different tensors may run concurrently.
class SafetensorsReader {
 public:
  static SafetensorsReader open(const std::filesystem::path& path) {
    SafetensorsReader r;
    r.path_ = path;
    r.source_ = path.string();
    auto fail = [&](const std::string& what) { throw Error("safetensors " + r.source_ + ": " + what); };
    r.fd_ = detail::Fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (r.fd_.get() < 0) throw Error("safetensors: cannot open " + r.source_ + ": " + detail::errno_text());
    struct ::stat st {};
    if (::fstat(r.fd_.get(), &st) != 0) fail("cannot stat: " + detail::errno_text());
    if (!S_ISREG(st.st_mode)) fail("not a regular file");
    const auto size = std::uint64_t(st.st_size);
    if (size < 8) fail("truncated header: the file has " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
    std::byte len[8];
    if (!detail::pread_all(r.fd_.get(), len, 0, r.source_)) fail("file ended inside the header length");
    const std::uint64_t n = detail::read_le64(len);
    detail::check_header_length(n, size, r.source_);
    std::string text(std::size_t(n), '\0');
    if (!detail::pread_all(r.fd_.get(), std::as_writable_bytes(std::span(text)), 8, r.source_)) fail("file ended inside the header");
    auto h = detail::parse_header(text, size - 8 - n, r.source_);
    r.tensors_ = std::move(h.tensors);
    r.metadata_ = std::move(h.metadata);
    r.data_offset_ = 8 + n;
    r.file_size_ = size;
    return r;
  }

  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& source() const { return source_; }
  const std::filesystem::path& path() const { return path_; }
  std::uint64_t file_size() const { return file_size_; }
  std::uint64_t data_offset() const { return data_offset_; }  // where the data section starts in the file
  // Where tensor `name`'s bytes start in the file (for copies of byte ranges between files).
  std::uint64_t file_offset(const std::string& name) const { return data_offset_ + info(name).begin; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }

  const TensorInfo& info(const std::string& name) const {
    auto it = tensors_.find(name);
    check(it != tensors_.end(), "safetensors " + source_ + ": tensor '" + name + "' is missing");
    return it->second;
  }

  // Bytes [offset, offset + out.size()) of tensor `name` into `out`: a whole tensor, or the rows of one
  // rank's shard of it, without reading anything else.
  void read_bytes(const std::string& name, std::span<std::byte> out, std::uint64_t offset = 0) const {
    const auto& t = info(name);
    const std::uint64_t n = t.end - t.begin;
    check(offset <= n && out.size() <= n - offset, "safetensors " + source_ + ": tensor '" + name + "': bytes [" + std::to_string(offset) +
                                                       ", " + std::to_string(offset + out.size()) + ") requested of its " +
                                                       std::to_string(n));
    if (out.empty()) return;
    check(detail::pread_all(fd_.get(), out, data_offset_ + t.begin + offset, source_),
          "safetensors " + source_ + ": tensor '" + name + "': the file ended before its bytes (truncated after it was opened?)");
  }
  std::vector<std::byte> read_bytes(const std::string& name) const {
    const auto& t = info(name);
    std::vector<std::byte> out(std::size_t(t.end - t.begin));
    read_bytes(name, out);
    return out;
  }
  // Asks the kernel to start reading the whole file into the page cache (posix_fadvise WILLNEED). A hint:
  // failures are ignored. It may block while the reads are queued, so a loader calls it from a thread of its own.
  void will_need() const { (void)::posix_fadvise(fd_.get(), 0, 0, POSIX_FADV_WILLNEED); }
  // Copy of a tensor's values; the dtype must be `expected` (element size must match T).
  template <class T>
  std::vector<T> read(const std::string& name, DType expected) const {
    const auto& t = info(name);
    detail::check_read_type(t, expected, sizeof(T), source_, name);
    std::vector<T> out(std::size_t(t.numel()));
    read_bytes(name, std::as_writable_bytes(std::span(out)));
    return out;
  }

 private:
  std::filesystem::path path_;
  std::string source_;
  detail::Fd fd_;
  std::uint64_t data_offset_ = 0, file_size_ = 0;
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
                                              " bytes, its dtype and shape need " +
                                              (want ? std::to_string(*want) : "an overflowing count"));
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
