#pragma once
// Hugging Face checkpoint files, torch-free: `model.safetensors`, or `model.safetensors.index.json` naming
// the shard each tensor lives in ({"metadata": {"total_size": N}, "weight_map": {tensor: file}}) plus the
// shards themselves.
//
// SafetensorsCheckpoint opens a directory (or an index / a single file), validates every shard's header
// against the index and lists all tensors with dtype and shape; tensor bytes are read one tensor (or one
// byte range of it) at a time, never the whole model. Errors name the file and the tensor.
//
// ShardedSafetensorsWriter takes the list of tensors up front, assigns them in order to files of at most
// max_shard_bytes bytes each (header included; a tensor too large for any file gets one of its own), writes
// every header at once and then each tensor's bytes at its offset, one tensor at a time in any order (a
// trainer gathering one layer at a time never holds more). finish() moves the files into place and writes
// the index (transformers' names: model-00001-of-00003.safetensors; one file: model.safetensors, no index).
// Until finish() succeeds only "*.tmp" files exist, and they are removed if the writer is abandoned.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"
#include "squeeze/io/json_file.hpp"
#include "squeeze/io/safetensors.hpp"

namespace squeeze::io {

inline constexpr std::string_view kSafetensorsSingleFile = "model.safetensors";
inline constexpr std::string_view kSafetensorsIndexFile = "model.safetensors.index.json";

// ---- float conversions for F32 / F16 / BF16 (/ F64) tensors -------------------------------------------------
// Checkpoints come in bf16, fp16 or fp32; these convert one tensor's bytes to float and back (round to
// nearest even), so a loader can fill fp32 masters and an exporter can write the checkpoint's dtype.
inline bool is_float_dtype(DType d) { return d == DType::F32 || d == DType::F16 || d == DType::BF16 || d == DType::F64; }

inline std::vector<float> decode_float(DType d, std::span<const std::byte> bytes) {
  check(is_float_dtype(d), "decode_float: dtype " + std::string(dtype_name(d)) + " is not a floating-point dtype");
  check(bytes.size() % dtype_size(d) == 0, "decode_float: byte count is not a multiple of the element size");
  const std::size_t n = bytes.size() / dtype_size(d);
  std::vector<float> out(n);
  if (d == DType::F32) {
    if (n) std::memcpy(out.data(), bytes.data(), bytes.size());
  } else if (d == DType::F64) {
    for (std::size_t i = 0; i < n; ++i) {
      double v;
      std::memcpy(&v, bytes.data() + 8 * i, 8);
      out[i] = float(v);
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      std::uint16_t b;
      std::memcpy(&b, bytes.data() + 2 * i, 2);
      out[i] = d == DType::BF16 ? to_float(std::bit_cast<bf16>(b)) : to_float(std::bit_cast<half>(b));
    }
  }
  return out;
}

inline std::vector<std::byte> encode_float(DType d, std::span<const float> values) {
  check(d == DType::F32 || d == DType::F16 || d == DType::BF16,
        "encode_float: dtype " + std::string(dtype_name(d)) + " is not F32, F16 or BF16");
  std::vector<std::byte> out(values.size() * dtype_size(d));
  if (d == DType::F32) {
    if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
    return out;
  }
  for (std::size_t i = 0; i < values.size(); ++i) {
    const std::uint16_t b = d == DType::BF16 ? std::bit_cast<std::uint16_t>(from_float<bf16>(values[i]))
                                             : std::bit_cast<std::uint16_t>(from_float<half>(values[i]));
    std::memcpy(out.data() + 2 * i, &b, 2);
  }
  return out;
}

// ---- reading ----------------------------------------------------------------------------------------------
struct CheckpointTensor {
  DType dtype;
  std::vector<std::int64_t> shape;
  std::string file;  // the shard's file name inside the checkpoint directory
  std::uint64_t bytes = 0;
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
};

class SafetensorsCheckpoint {
 public:
  // A model directory: model.safetensors if present (transformers looks for it first), else
  // model.safetensors.index.json and its shards.
  static SafetensorsCheckpoint open(const std::filesystem::path& dir) {
    namespace fs = std::filesystem;
    check(fs::is_directory(dir), "checkpoint: " + dir.string() + " is not a directory");
    if (fs::exists(dir / kSafetensorsSingleFile)) return open_file(dir / kSafetensorsSingleFile);
    if (fs::exists(dir / kSafetensorsIndexFile)) return open_index(dir / kSafetensorsIndexFile);
    throw Error("checkpoint: " + dir.string() + " holds neither " + std::string(kSafetensorsSingleFile) + " nor " +
                std::string(kSafetensorsIndexFile) + " (is it a Hugging Face model directory with safetensors weights?)");
  }

  // One .safetensors file holding every tensor.
  static SafetensorsCheckpoint open_file(const std::filesystem::path& file) {
    SafetensorsCheckpoint c;
    c.dir_ = file.parent_path();
    c.source_ = file.string();
    c.add_shard(file.filename().string(), SafetensorsReader::open(file));
    for (const auto& [name, t] : c.shards_[0].tensors()) c.tensors_[name] = {t.dtype, t.shape, c.files_[0], t.end - t.begin};
    check(!c.tensors_.empty(), "checkpoint " + c.source_ + ": holds no tensors");
    return c;
  }

  // An index JSON and the shards it names (file names relative to the index's directory).
  static SafetensorsCheckpoint open_index(const std::filesystem::path& index) {
    SafetensorsCheckpoint c;
    c.dir_ = index.parent_path();
    c.source_ = index.string();
    c.sharded_ = true;
    const std::string src = "checkpoint index " + index.string();
    auto fail = [&](const std::string& what) { throw Error(src + ": " + what); };
    std::ifstream in(index);
    if (!in) fail("cannot open");
    std::stringstream ss;
    ss << in.rdbuf();
    const auto parsed = detail::parse_json_unique_keys(ss.str());  // a tensor mapped twice would keep only its last shard
    const nlohmann::json& j = parsed.json;
    if (j.is_discarded()) fail("not valid JSON");
    if (!parsed.duplicate.empty()) fail("duplicate key " + parsed.duplicate);
    if (!j.is_object()) fail("not a JSON object");
    if (j.contains("metadata") && !j["metadata"].is_null()) {
      if (!j["metadata"].is_object()) fail("'metadata' is not an object");
      if (j["metadata"].contains("total_size")) {
        const auto& ts = j["metadata"]["total_size"];
        if (!ts.is_number_unsigned()) fail("'metadata.total_size' is not a non-negative integer");
        c.index_total_size_ = ts.get<std::uint64_t>();
      }
    }
    if (!j.contains("weight_map") || !j["weight_map"].is_object()) fail("missing object 'weight_map'");
    if (j["weight_map"].empty()) fail("'weight_map' lists no tensors");
    std::map<std::string, std::string> weight_map;
    std::map<std::string, std::vector<std::string>> by_file;  // file -> tensors the index puts there
    for (const auto& [name, f] : j["weight_map"].items()) {
      if (!f.is_string()) fail("'weight_map' entry of tensor '" + name + "' is not a string");
      const auto file = f.get<std::string>();
      if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos || file.find('\\') != std::string::npos)
        fail("tensor '" + name + "' is mapped to '" + file + "', which is not a file name in " + c.dir_.string());
      weight_map[name] = file;
      by_file[file].push_back(name);
    }
    check_shard_series(by_file, src);
    for (const auto& [file, names] : by_file) {
      const auto path = c.dir_ / file;
      if (!std::filesystem::exists(path))
        fail("shard '" + file + "' (holding '" + names.front() + "'" +
             (names.size() > 1 ? " and " + std::to_string(names.size() - 1) + " more tensors" : std::string()) + ") does not exist in " +
             c.dir_.string());
      c.add_shard(file, SafetensorsReader::open(path));
    }
    // Every tensor the index names is in its shard, and every tensor of every shard is in the index, once.
    std::map<std::string, std::string> seen;  // tensor -> the shard whose header holds it
    for (std::size_t s = 0; s < c.shards_.size(); ++s)
      for (const auto& [name, _] : c.shards_[s].tensors()) {
        if (auto it = seen.find(name); it != seen.end())
          fail("tensor '" + name + "' is stored in two shards: '" + it->second + "' and '" + c.files_[s] + "'");
        seen[name] = c.files_[s];
      }
    for (std::size_t s = 0; s < c.shards_.size(); ++s) {
      for (const auto& [name, t] : c.shards_[s].tensors()) {
        const auto w = weight_map.find(name);
        if (w == weight_map.end()) fail("shard '" + c.files_[s] + "' holds tensor '" + name + "', which the weight_map does not list");
        if (w->second != c.files_[s])
          fail("tensor '" + name + "' is mapped to shard '" + w->second + "' but stored in shard '" + c.files_[s] + "'");
        c.tensors_[name] = {t.dtype, t.shape, c.files_[s], t.end - t.begin};
      }
    }
    for (const auto& [name, file] : weight_map)
      if (!seen.count(name)) fail("tensor '" + name + "' is mapped to shard '" + file + "', whose header has no such tensor");
    return c;
  }

  const std::map<std::string, CheckpointTensor>& tensors() const { return tensors_; }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [n, _] : tensors_) out.push_back(n);
    return out;
  }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  const CheckpointTensor& info(const std::string& name) const {
    auto it = tensors_.find(name);
    check(it != tensors_.end(), "checkpoint " + source_ + ": tensor '" + name + "' is missing");
    return it->second;
  }
  const std::vector<std::string>& files() const { return files_; }
  const std::filesystem::path& dir() const { return dir_; }
  bool sharded() const { return sharded_; }
  std::optional<std::uint64_t> index_total_size() const { return index_total_size_; }  // as the index states it
  std::uint64_t total_bytes() const {
    std::uint64_t n = 0;
    for (const auto& [_, t] : tensors_) n += t.bytes;
    return n;
  }

  // The open shard holding `name` (its header and a pread handle).
  const SafetensorsReader& shard_of(const std::string& name) const { return shards_[shard_index_.at(info(name).file)]; }

  // Bytes [offset, offset + out.size()) of one tensor, read from its shard into `out`.
  void read_bytes(const std::string& name, std::span<std::byte> out, std::uint64_t offset = 0) const {
    shard_of(name).read_bytes(name, out, offset);
  }
  std::vector<std::byte> read_bytes(const std::string& name) const { return shard_of(name).read_bytes(name); }
  // Every shard into the page cache, in file order (SafetensorsReader::will_need: a hint; may block while queued).
  void will_need() const {
    for (const auto& s : shards_) s.will_need();
  }
  template <class T>
  std::vector<T> read(const std::string& name, DType expected) const {
    return shard_of(name).template read<T>(name, expected);
  }
  // One floating-point tensor (F32, F16, BF16 or F64) converted to float.
  std::vector<float> read_float(const std::string& name) const {
    const auto& t = info(name);
    check(is_float_dtype(t.dtype), "checkpoint " + source_ + ": tensor '" + name + "' in '" + t.file + "' has dtype " +
                                       std::string(dtype_name(t.dtype)) + ", not a floating-point dtype");
    return decode_float(t.dtype, read_bytes(name));
  }

 private:
  void add_shard(std::string file, SafetensorsReader r) {
    shard_index_[file] = shards_.size();
    files_.push_back(std::move(file));
    shards_.push_back(std::move(r));
  }

  // Names like "model-00002-of-00003.safetensors" promise a series: all of 1..N must be named, with one N.
  static void check_shard_series(const std::map<std::string, std::vector<std::string>>& by_file, const std::string& src) {
    std::map<std::string, std::set<unsigned long>> series;                // "<prefix>|<total>" -> part numbers seen
    std::map<std::string, std::pair<std::string, std::string>> parts_of;  // same key -> (prefix, total as written)
    for (const auto& [file, _] : by_file) {
      const auto of = file.rfind("-of-");
      const std::string_view ext = ".safetensors";
      if (of == std::string::npos || of == 0 || !file.ends_with(ext)) continue;
      const auto dash = file.rfind('-', of - 1);
      if (dash == std::string::npos) continue;
      const std::string part = file.substr(dash + 1, of - dash - 1);
      const std::string total = file.substr(of + 4, file.size() - ext.size() - of - 4);
      const auto digits = [](const std::string& x) {
        return !x.empty() && std::all_of(x.begin(), x.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
      };
      if (!digits(part) || !digits(total) || part.size() > 9 || total.size() > 9) continue;
      const auto key = file.substr(0, dash) + "|" + total;
      series[key].insert(std::stoul(part));
      parts_of[key] = {file.substr(0, dash), total};
    }
    for (const auto& [key, parts] : series) {
      const auto& [prefix, total] = parts_of[key];
      const unsigned long n = std::stoul(total);
      for (unsigned long k = 1; k <= n; ++k) {
        if (parts.count(k)) continue;
        std::string num = std::to_string(k);
        num.insert(0, total.size() > num.size() ? total.size() - num.size() : 0, '0');
        throw Error(src + ": the weight_map names shards '" + prefix + "-*-of-" + total + ".safetensors' but no tensor in '" + prefix +
                    "-" + num + "-of-" + total + ".safetensors' (a missing shard?)");
      }
      if (*parts.rbegin() > n || *parts.begin() == 0)
        throw Error(src + ": the weight_map names a shard numbered outside 1.." + total + " in series '" + prefix + "'");
    }
  }

  std::filesystem::path dir_;
  std::string source_;
  bool sharded_ = false;
  std::optional<std::uint64_t> index_total_size_;
  std::vector<std::string> files_;
  std::vector<SafetensorsReader> shards_;
  std::map<std::string, std::size_t> shard_index_;
  std::map<std::string, CheckpointTensor> tensors_;
};

// ---- writing ----------------------------------------------------------------------------------------------
struct TensorSpec {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
};

namespace detail {
// The header text of one file holding `specs` back to back in that order (padded to 8 bytes, as
// save_safetensors pads, so the data section starts aligned).
inline std::string shard_header(const std::vector<const TensorSpec*>& specs, const std::map<std::string, std::string>& metadata) {
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::uint64_t off = 0;
  for (const auto* s : specs) {
    const std::uint64_t n = *byte_count(s->shape, s->dtype);
    h[s->name] = {{"dtype", std::string(dtype_name(s->dtype))}, {"shape", s->shape}, {"data_offsets", {off, off + n}}};
    off += n;
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}
}  // namespace detail

class ShardedSafetensorsWriter {
 public:
  // max_shard_bytes: the largest file written, header included (0: everything in one file). Tensors keep
  // the order of `specs`, which fills one file after another.
  ShardedSafetensorsWriter(std::filesystem::path dir, std::vector<TensorSpec> specs, std::uint64_t max_shard_bytes,
                           std::map<std::string, std::string> metadata = {{"format", "pt"}})
      : dir_(std::move(dir)), specs_(std::move(specs)), metadata_(std::move(metadata)) {
    check(!specs_.empty(), "ShardedSafetensorsWriter: no tensors to write");
    std::set<std::string> names;
    for (const auto& s : specs_) {
      check(!s.name.empty() && s.name != "__metadata__", "ShardedSafetensorsWriter: invalid tensor name '" + s.name + "'");
      check(names.insert(s.name).second, "ShardedSafetensorsWriter: tensor '" + s.name + "' is listed twice");
      check(detail::byte_count(s.shape, s.dtype).has_value(), "ShardedSafetensorsWriter: tensor '" + s.name + "': shape overflows");
    }
    std::filesystem::create_directories(dir_);
    plan(max_shard_bytes);
    try {
      create_files();
    } catch (...) {
      abandon();
      throw;
    }
  }
  ShardedSafetensorsWriter(const ShardedSafetensorsWriter&) = delete;
  ShardedSafetensorsWriter& operator=(const ShardedSafetensorsWriter&) = delete;
  ~ShardedSafetensorsWriter() {
    if (!finished_) abandon();
  }

  std::size_t shard_count() const { return shards_.size(); }
  std::vector<std::string> files() const {
    std::vector<std::string> out;
    for (const auto& s : shards_) out.push_back(s.file);
    return out;
  }
  const std::string& file_of(const std::string& name) const { return shards_[slot(name).shard].file; }
  // Sum of the tensors' bytes (the index's metadata.total_size).
  std::uint64_t total_size() const {
    std::uint64_t n = 0;
    for (const auto& t : slots_) n += t.bytes;
    return n;
  }

  // One tensor's bytes, all at once (any order; each tensor exactly once).
  void write(const std::string& name, std::span<const std::byte> data) {
    auto& t = slot(name);
    check(t.written == 0, "ShardedSafetensorsWriter: tensor '" + name + "' was already written");
    check(data.size() == t.bytes, "ShardedSafetensorsWriter: tensor '" + name + "' needs " + std::to_string(t.bytes) +
                                      " bytes (its dtype and shape), got " + std::to_string(data.size()));
    append(name, data);
  }
  void write(const std::string& name, const TensorRef& ref) {
    const auto& s = specs_[slot(name).spec];
    check(ref.dtype == s.dtype && ref.shape == s.shape, "ShardedSafetensorsWriter: tensor '" + name + "' was planned as " +
                                                            std::string(dtype_name(s.dtype)) + " " + shape_text(s.shape) + ", got " +
                                                            std::string(dtype_name(ref.dtype)) + " " + shape_text(ref.shape));
    write(name, ref.data);
  }
  // The next bytes of one tensor (it may arrive in pieces, e.g. converted a row block at a time).
  void append(const std::string& name, std::span<const std::byte> data) {
    check(!finished_, "ShardedSafetensorsWriter: already finished");
    auto& t = slot(name);
    check(data.size() <= t.bytes - t.written, "ShardedSafetensorsWriter: tensor '" + name +
                                                  "': " + std::to_string(t.written + data.size()) + " bytes written, it holds " +
                                                  std::to_string(t.bytes));
    auto& sh = shards_[t.shard];
    std::size_t done = 0;
    while (done < data.size()) {
      const ::ssize_t r = ::pwrite(sh.fd.get(), data.data() + done, data.size() - done, ::off_t(t.offset + t.written + done));
      if (r < 0 && errno == EINTR) continue;
      check(r > 0,
            "ShardedSafetensorsWriter: writing tensor '" + name + "' to " + tmp_path(sh).string() + " failed: " + detail::errno_text());
      done += std::size_t(r);
    }
    t.written += data.size();
  }

  // Every tensor complete: closes the shards, renames them into place, then writes the index (sharded) and
  // removes a stale model.safetensors / index that would make readers see an older checkpoint.
  void finish() {
    check(!finished_, "ShardedSafetensorsWriter: already finished");
    std::vector<std::string> incomplete;
    for (const auto& t : slots_)
      if (t.written != t.bytes) incomplete.push_back(specs_[t.spec].name);
    if (!incomplete.empty()) {
      std::string list;
      for (std::size_t i = 0; i < incomplete.size() && i < 5; ++i) list += (i ? ", '" : "'") + incomplete[i] + "'";
      if (incomplete.size() > 5) list += " and " + std::to_string(incomplete.size() - 5) + " more";
      throw Error("ShardedSafetensorsWriter: " + std::to_string(incomplete.size()) + " tensors not (fully) written: " + list);
    }
    for (auto& sh : shards_) {
      const int fd = sh.fd.get();
      check(::fsync(fd) == 0, "ShardedSafetensorsWriter: flushing " + tmp_path(sh).string() + " failed: " + detail::errno_text());
      sh.fd = detail::Fd();
    }
    namespace fs = std::filesystem;
    for (auto& sh : shards_) fs::rename(tmp_path(sh), dir_ / sh.file);
    if (shards_.size() == 1) {
      fs::remove(dir_ / kSafetensorsIndexFile);
    } else {
      nlohmann::json idx;
      idx["metadata"] = {{"total_size", total_size()}};
      idx["weight_map"] = nlohmann::json::object();
      for (const auto& t : slots_) idx["weight_map"][specs_[t.spec].name] = shards_[t.shard].file;
      save_json(dir_ / kSafetensorsIndexFile, idx, "ShardedSafetensorsWriter");
      fs::remove(dir_ / kSafetensorsSingleFile);
    }
    finished_ = true;
  }

 private:
  struct Slot {
    std::size_t spec = 0, shard = 0;
    std::uint64_t offset = 0;  // of the tensor's first byte in its file
    std::uint64_t bytes = 0, written = 0;
  };
  struct Shard {
    std::string file;
    std::vector<std::size_t> specs;
    std::string header;
    detail::Fd fd;
  };

  static std::string shape_text(const std::vector<std::int64_t>& s) {
    std::string out = "[";
    for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
  }
  std::filesystem::path tmp_path(const Shard& s) const { return dir_ / (s.file + ".tmp"); }
  Slot& slot(const std::string& name) {
    auto it = by_name_.find(name);
    check(it != by_name_.end(), "ShardedSafetensorsWriter: tensor '" + name + "' is not among the planned tensors");
    return slots_[it->second];
  }
  const Slot& slot(const std::string& name) const { return const_cast<ShardedSafetensorsWriter*>(this)->slot(name); }

  // Greedy in order: a tensor joins the current file while 8 + header + data stays within the limit.
  void plan(std::uint64_t max_bytes) {
    std::vector<std::vector<std::size_t>> groups(1);
    std::uint64_t data = 0;
    std::vector<const TensorSpec*> cur;
    for (std::size_t i = 0; i < specs_.size(); ++i) {
      const std::uint64_t n = *detail::byte_count(specs_[i].shape, specs_[i].dtype);
      if (max_bytes != 0 && !cur.empty()) {
        cur.push_back(&specs_[i]);
        const std::uint64_t size = 8 + detail::shard_header(cur, metadata_).size() + data + n;
        cur.pop_back();
        if (size > max_bytes) {
          groups.emplace_back();
          cur.clear();
          data = 0;
        }
      }
      groups.back().push_back(i);
      cur.push_back(&specs_[i]);
      data += n;
    }
    const std::size_t total = groups.size();
    auto name_of = [&](std::size_t k) {
      if (total == 1) return std::string(kSafetensorsSingleFile);
      char buf[64];
      std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, total);
      return std::string(buf);
    };
    slots_.resize(specs_.size());
    for (std::size_t k = 0; k < total; ++k) {
      Shard sh;
      sh.file = name_of(k);
      sh.specs = groups[k];
      std::vector<const TensorSpec*> ps;
      for (auto i : groups[k]) ps.push_back(&specs_[i]);
      sh.header = detail::shard_header(ps, metadata_);
      std::uint64_t off = 8 + sh.header.size();
      for (auto i : groups[k]) {
        const std::uint64_t n = *detail::byte_count(specs_[i].shape, specs_[i].dtype);
        slots_[i] = {i, k, off, n, 0};
        by_name_[specs_[i].name] = i;
        off += n;
      }
      shards_.push_back(std::move(sh));
    }
  }

  // Each file gets its header now and its full length (the data region stays a hole until written).
  void create_files() {
    for (auto& sh : shards_) {
      const auto path = tmp_path(sh);
      sh.fd = detail::Fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
      check(sh.fd.get() >= 0, "ShardedSafetensorsWriter: cannot create " + path.string() + ": " + detail::errno_text());
      created_.push_back(path);
      std::string head(8, '\0');
      for (int i = 0; i < 8; ++i) head[i] = char((std::uint64_t(sh.header.size()) >> (8 * i)) & 0xff);
      head += sh.header;
      std::uint64_t size = head.size();
      for (auto i : sh.specs) size += slots_[i].bytes;
      check(::pwrite(sh.fd.get(), head.data(), head.size(), 0) == ::ssize_t(head.size()),
            "ShardedSafetensorsWriter: writing the header of " + path.string() + " failed: " + detail::errno_text());
      check(::ftruncate(sh.fd.get(), ::off_t(size)) == 0,
            "ShardedSafetensorsWriter: sizing " + path.string() + " failed: " + detail::errno_text());
    }
  }

  void abandon() noexcept {
    for (auto& sh : shards_) sh.fd = detail::Fd();
    std::error_code ec;
    for (const auto& p : created_) std::filesystem::remove(p, ec);
  }

  std::filesystem::path dir_;
  std::vector<TensorSpec> specs_;
  std::map<std::string, std::string> metadata_;
  std::vector<Slot> slots_;
  std::map<std::string, std::size_t> by_name_;
  std::vector<Shard> shards_;
  std::vector<std::filesystem::path> created_;
  bool finished_ = false;
};

}  // namespace squeeze::io
