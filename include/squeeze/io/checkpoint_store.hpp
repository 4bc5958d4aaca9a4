#pragma once
// CheckpointStore: a directory of training checkpoints, torch-free and crash-safe (docs/checkpoints.md).
//
//   <root>/latest                                        "step-000123\n": the checkpoint to resume from
//   <root>/step-000123/index.json                        what the checkpoint is (CheckpointIndex)
//   <root>/step-000123/rank-00000-of-00004.safetensors   rank 0's tensors: its own shard only
//   <root>/step-000123/rank-00001-of-00004.safetensors   ...
//
// Saving from one process (ranks on any threads):
//   CheckpointStore store(root, {.keep_last = 3});
//   CheckpointSave save = store.begin(step, {.world_size = 4, .stage = 3, .strategy = name, ...});
//   save.write_rank(r, views);            // every rank, from any thread; tensors streamed one at a time
//   save.commit();                        // after every write_rank returned
// Saving from one process per rank (the caller owns the communicator and its barrier):
//   rank 0:  save = store.begin(step, meta);       then broadcast save.token()
//   others:  save = store.join(step, token, world_size);
//   all:     save.write_rank(rank, views);         then barrier
//   rank 0:  save.commit();                        then barrier before any rank reads the checkpoint
// Loading: store.open_latest({.world_size = 4}) checks the index, every file's size and sha256, then
// read_rank(rank, name) / read_rank_into(...) with expect_tensor(...) for dtype and shape.
//
// Crash safety: begin() creates step-000123.tmp-<token>/; every file in it is written under a temporary
// name, fsync'd and renamed; commit() writes index.json the same way, fsyncs the directory, renames it to
// step-000123 and fsyncs the root; only then is `latest` replaced (temporary file, fsync, rename, fsync of
// the root), and only after that are old checkpoints pruned (renamed away, the root fsync'd, then removed).
// So a directory under a final step name is always whole and `latest` always names one. Leftovers of an
// interrupted save have temporary names: readers ignore them and the next begin() removes them.
// One saving job per root at a time; the root must be one directory every rank sees.
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "squeeze/error.hpp"
#include "squeeze/io/posix_file.hpp"
#include "squeeze/io/safetensors.hpp"
#include "squeeze/io/safetensors_stream.hpp"
#include "squeeze/io/sha256.hpp"

namespace squeeze::io {

inline constexpr std::string_view kCheckpointFormat = "squeeze-checkpoint";
inline constexpr std::string_view kCheckpointShardFormat = "squeeze-checkpoint-shard";
inline constexpr int kCheckpointFormatVersion = 1;
inline constexpr int kMaxCheckpointWorld = 99999;  // five digits in the file names

inline std::string step_dir_name(std::int64_t step) {
  check(step >= 0, "checkpoint: step must be >= 0, got " + std::to_string(step));
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%06lld", static_cast<long long>(step));
  return buf;
}
// "step-000123" -> 123; anything else (temporaries such as "step-000123.tmp-x") -> nullopt.
inline std::optional<std::int64_t> parse_step_dir_name(std::string_view s) {
  if (!s.starts_with("step-") || s.size() < 6 || s.size() > 5 + 18) return std::nullopt;
  std::int64_t v = 0;
  for (char c : s.substr(5)) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  return v;
}
inline std::string rank_file_name(int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "rank-%05d-of-%05d.safetensors", rank, world);
  return buf;
}

// What the caller says about a checkpoint when it begins one.
struct CheckpointMeta {
  int world_size = 1;
  int stage = 0;
  std::string strategy;                                 // the Strategy's canonical name
  nlohmann::json partitions = nlohmann::json::array();  // partition layouts (e.g. flat_layouts_to_json)
  nlohmann::json record = nlohmann::json::object();     // small caller record: data position, ...
};

// One rank's file as the index records it.
struct CheckpointFile {
  int rank = 0;
  std::string name;
  std::uint64_t bytes = 0;
  std::string sha256;
  std::map<std::string, TensorInfo> tensors;  // dtype, shape, data_offsets
};

// index.json.
struct CheckpointIndex {
  int format_version = kCheckpointFormatVersion;
  std::int64_t step = 0;
  int world_size = 1;
  int stage = 0;
  std::string strategy;
  nlohmann::json partitions = nlohmann::json::array();
  nlohmann::json record = nlohmann::json::object();
  std::vector<CheckpointFile> files;  // files[r] is rank r's

  nlohmann::json to_json() const;
  static CheckpointIndex from_json(const nlohmann::json& j, const std::string& source);
};

namespace detail {
inline nlohmann::json tensors_json(const std::map<std::string, TensorInfo>& ts) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, t] : ts) j[name] = tensor_json(t, true);
  return j;
}
inline nlohmann::json file_json(const CheckpointFile& f) {
  return {{"rank", f.rank}, {"file", f.name}, {"bytes", f.bytes}, {"sha256", f.sha256}, {"tensors", tensors_json(f.tensors)}};
}

// Strict readers of JSON fields: the message names the source and the field.
inline bool non_negative_integer(const nlohmann::json& v) {
  return v.is_number_unsigned() || (v.is_number_integer() && v.get<std::int64_t>() >= 0);
}
[[noreturn]] inline void bad_field(const std::string& source, const std::string& key, const std::string& want) {
  throw Error(source + ": '" + key + "' " + want);
}
inline const nlohmann::json& field(const nlohmann::json& j, const std::string& key, const std::string& source) {
  if (!j.is_object() || !j.contains(key)) bad_field(source, key, "is missing");
  return j[key];
}
inline std::int64_t int_field(const nlohmann::json& j, const std::string& key, const std::string& source, std::int64_t lo = 0) {
  const auto& v = field(j, key, source);
  if (!v.is_number_integer() || v.get<std::int64_t>() < lo) bad_field(source, key, "must be an integer >= " + std::to_string(lo));
  return v.get<std::int64_t>();
}
inline std::string string_field(const nlohmann::json& j, const std::string& key, const std::string& source) {
  const auto& v = field(j, key, source);
  if (!v.is_string()) bad_field(source, key, "must be a string");
  return v.get<std::string>();
}
inline std::map<std::string, TensorInfo> tensors_from_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) bad_field(source, "tensors", "must be an object");
  std::map<std::string, TensorInfo> out;
  for (const auto& [name, v] : j.items()) {
    const std::string src = source + ", tensor '" + name + "'";
    const auto dt = parse_dtype(string_field(v, "dtype", src));
    if (!dt) bad_field(src, "dtype", "names no known dtype");
    TensorInfo t{*dt, {}, 0, 0};
    const auto& shape = field(v, "shape", src);
    if (!shape.is_array()) bad_field(src, "shape", "must be an array");
    for (const auto& d : shape) {
      if (!non_negative_integer(d)) bad_field(src, "shape", "must hold non-negative integers");
      t.shape.push_back(d.get<std::int64_t>());
    }
    const auto& o = field(v, "data_offsets", src);
    if (!o.is_array() || o.size() != 2 || !non_negative_integer(o[0]) || !non_negative_integer(o[1]))
      bad_field(src, "data_offsets", "must be two non-negative integers");
    t.begin = o[0].get<std::uint64_t>();
    t.end = o[1].get<std::uint64_t>();
    out.emplace(name, std::move(t));
  }
  return out;
}
inline CheckpointFile file_from_json(const nlohmann::json& j, const std::string& source) {
  CheckpointFile f;
  f.rank = int(int_field(j, "rank", source));
  f.name = string_field(j, "file", source);
  f.bytes = std::uint64_t(int_field(j, "bytes", source));
  f.sha256 = string_field(j, "sha256", source);
  if (f.sha256.size() != 64 || f.sha256.find_first_not_of("0123456789abcdef") != std::string::npos)
    bad_field(source, "sha256", "must be 64 lowercase hex digits");
  f.tensors = tensors_from_json(field(j, "tensors", source), source);
  return f;
}
inline std::string read_text_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  check(bool(f), "cannot open " + p.string());
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
inline nlohmann::json read_json_file(const std::filesystem::path& p) {
  const auto j = nlohmann::json::parse(read_text_file(p), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw Error(p.string() + ": not valid JSON (the file is corrupt)");
  return j;
}
inline bool equal_tensor_info(const TensorInfo& a, const TensorInfo& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.begin == b.begin && a.end == b.end;
}
inline std::string shape_text(const std::vector<std::int64_t>& s) {
  std::string t = "[";
  for (std::size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}
inline std::string record_name(int rank, int world) {
  std::string n = rank_file_name(rank, world);
  return n.substr(0, n.size() - std::string_view(".safetensors").size()) + ".json";
}
// Names an interrupted save or prune leaves behind.
inline bool is_leftover(std::string_view name) {
  return (name.starts_with("step-") && (name.find(".tmp-") != std::string_view::npos || name.find(".old-") != std::string_view::npos)) ||
         name.starts_with("latest.tmp-");
}
inline std::vector<std::int64_t> list_steps(const std::filesystem::path& root) {
  std::vector<std::int64_t> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(root, ec))
    if (auto s = parse_step_dir_name(e.path().filename().string()); s && e.is_directory()) out.push_back(*s);
  std::sort(out.begin(), out.end());
  return out;
}
inline std::string steps_hint(const std::filesystem::path& root) {
  const auto steps = list_steps(root);
  if (steps.empty()) return " (no step directories there)";
  std::string t = " (step directories there: ";
  for (std::size_t i = 0; i < steps.size(); ++i) t += (i ? ", " : "") + step_dir_name(steps[i]);
  return t + "; each can be opened and verified with open(step))";
}
// The directory name `latest` holds; nullopt when there is none.
inline std::optional<std::string> read_latest(const std::filesystem::path& root) {
  const auto p = root / "latest";
  if (!std::filesystem::exists(p)) return std::nullopt;
  std::string t = read_text_file(p);
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
  check(parse_step_dir_name(t).has_value(),
        "checkpoint store " + root.string() + ": 'latest' holds '" + t.substr(0, 64) + "', not a step directory name (step-NNNNNN)");
  return t;
}
inline std::string make_token() {
  std::random_device rd;
  char buf[48];
  std::snprintf(buf, sizeof buf, "%ld-%08x", static_cast<long>(::getpid()), static_cast<unsigned>(rd()));
  return buf;
}
inline bool valid_token(std::string_view t) {
  return !t.empty() && t.size() <= 64 &&
         t.find_first_not_of("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-") == std::string_view::npos;
}
}  // namespace detail

inline nlohmann::json CheckpointIndex::to_json() const {
  nlohmann::json fs = nlohmann::json::array();
  for (const auto& f : files) fs.push_back(detail::file_json(f));
  return {{"format", std::string(kCheckpointFormat)},
          {"format_version", format_version},
          {"step", step},
          {"world_size", world_size},
          {"stage", stage},
          {"strategy", strategy},
          {"partitions", partitions},
          {"record", record},
          {"files", fs}};
}

inline CheckpointIndex CheckpointIndex::from_json(const nlohmann::json& j, const std::string& source) {
  using namespace detail;
  if (!j.is_object()) throw Error(source + ": not a JSON object");
  const std::string format = string_field(j, "format", source);
  if (format != kCheckpointFormat) throw Error(source + ": format is '" + format + "', not '" + std::string(kCheckpointFormat) + "'");
  CheckpointIndex idx;
  idx.format_version = int(int_field(j, "format_version", source, 1));
  if (idx.format_version > kCheckpointFormatVersion)
    throw Error(source + ": format_version " + std::to_string(idx.format_version) + " is newer than this library reads (" +
                std::to_string(kCheckpointFormatVersion) + "); read it with a newer squeeze");
  idx.step = int_field(j, "step", source);
  idx.world_size = int(int_field(j, "world_size", source, 1));
  if (idx.world_size > kMaxCheckpointWorld) bad_field(source, "world_size", "must be at most " + std::to_string(kMaxCheckpointWorld));
  idx.stage = int(int_field(j, "stage", source));
  idx.strategy = string_field(j, "strategy", source);
  idx.partitions = field(j, "partitions", source);
  idx.record = field(j, "record", source);
  const auto& fs = field(j, "files", source);
  if (!fs.is_array()) bad_field(source, "files", "must be an array");
  if (fs.size() != std::size_t(idx.world_size))
    throw Error(source + ": lists " + std::to_string(fs.size()) + " files for world size " + std::to_string(idx.world_size));
  for (std::size_t r = 0; r < fs.size(); ++r) {
    CheckpointFile f = file_from_json(fs[r], source + ", files[" + std::to_string(r) + "]");
    if (f.rank != int(r) || f.name != rank_file_name(int(r), idx.world_size))
      throw Error(source + ": files[" + std::to_string(r) + "] is '" + f.name + "' of rank " + std::to_string(f.rank) + ", expected '" +
                  rank_file_name(int(r), idx.world_size) + "'");
    idx.files.push_back(std::move(f));
  }
  return idx;
}

struct StoreOptions {
  int keep_last = 0;                               // keep the newest K checkpoints (<= 0: keep all)
  std::size_t chunk_bytes = std::size_t(8) << 20;  // staging chunk for TensorView::fill sources
  FaultHook fault_hook;                            // tests: called after every durable step of a save
};

// How much of a checkpoint open() proves before handing it out.
enum class Verify {
  sizes,             // the index and every file's size (headers checked on first use)
  checksums_on_use,  // sizes now; a file's sha256 and header when it is first read (each rank reads its own)
  checksums,         // every file's size, sha256 and header now
};

struct OpenOptions {
  std::optional<int> world_size;        // the caller's world: a different one is an error unless allow_reshard
  std::optional<std::string> strategy;  // the caller's Strategy name: a different one is an error
  std::optional<int> stage;
  bool allow_reshard = false;
  Verify verify = Verify::checksums;
};

// A checkpoint opened for reading. Copies share one state; reads may run on any threads.
class CheckpointReader {
 public:
  static CheckpointReader open(const std::filesystem::path& dir, const OpenOptions& opt = {}) {
    namespace fs = std::filesystem;
    check(fs::is_directory(dir), "checkpoint directory " + dir.string() + " does not exist");
    const fs::path ip = dir / "index.json";
    check(fs::exists(ip), "checkpoint " + dir.string() + ": index.json is missing (not a checkpoint, or an unfinished one)");
    auto s = std::make_shared<Impl>();
    s->dir = dir;
    s->verify = opt.verify;
    s->index = CheckpointIndex::from_json(detail::read_json_file(ip), ip.string());
    const CheckpointIndex& idx = s->index;
    if (const auto named = parse_step_dir_name(dir.filename().string()); named && *named != idx.step)
      throw Error(ip.string() + ": records step " + std::to_string(idx.step) + " but sits in " + dir.filename().string());
    if (opt.world_size && *opt.world_size != idx.world_size && !opt.allow_reshard)
      throw Error("checkpoint " + dir.string() + " was written by " + std::to_string(idx.world_size) + " ranks; this run has " +
                  std::to_string(*opt.world_size) + ": load it at world size " + std::to_string(idx.world_size) +
                  " or reshard it (OpenOptions::allow_reshard and plan_reshard)");
    if (opt.strategy && *opt.strategy != idx.strategy)
      throw Error("checkpoint " + dir.string() + " was written by strategy '" + idx.strategy + "'; this run's strategy is '" +
                  *opt.strategy + "'");
    if (opt.stage && *opt.stage != idx.stage)
      throw Error("checkpoint " + dir.string() + " was written at ZeRO stage " + std::to_string(idx.stage) + "; this run is stage " +
                  std::to_string(*opt.stage));
    s->files.resize(std::size_t(idx.world_size));
    CheckpointReader r(std::move(s));
    for (int rank = 0; rank < idx.world_size; ++rank) r.check_size(rank);
    if (opt.verify == Verify::checksums)
      for (int rank = 0; rank < idx.world_size; ++rank) r.rank_file(rank);
    return r;
  }

  const CheckpointIndex& index() const { return s_->index; }
  const std::filesystem::path& dir() const { return s_->dir; }
  std::int64_t step() const { return s_->index.step; }
  int world_size() const { return s_->index.world_size; }
  std::filesystem::path rank_path(int rank) const {
    check_rank(rank);
    return s_->dir / s_->index.files[std::size_t(rank)].name;
  }

  // Rank `rank`'s file with its header validated against the index (and its sha256, unless Verify::sizes).
  const SafetensorsReader& rank_file(int rank) const {
    check_rank(rank);
    {
      std::lock_guard lock(s_->mu);
      if (const auto& slot = s_->files[std::size_t(rank)]) return *slot;
    }
    // Hash and parse outside the lock: ranks read by different threads verify in parallel.
    if (s_->verify != Verify::sizes) verify_checksum(rank);
    auto f = std::make_unique<SafetensorsReader>(open_header(rank));
    std::lock_guard lock(s_->mu);
    auto& slot = s_->files[std::size_t(rank)];
    if (!slot) slot = std::move(f);
    return *slot;
  }
  // Hashes rank `rank`'s file now and compares with the index.
  void verify_checksum(int rank) const {
    check_rank(rank);
    check_size(rank);
    const CheckpointFile& e = s_->index.files[std::size_t(rank)];
    const std::string got = sha256_file(s_->dir / e.name);
    if (got != e.sha256)
      throw Error(file_label(rank) + ": checksum mismatch: index.json records sha256 " + e.sha256 + ", the file hashes to " + got +
                  " (the file is corrupt)");
  }

  // The tensor's entry, after checking it exists with this dtype and shape.
  const TensorInfo& expect_tensor(int rank, const std::string& name, DType dtype, const std::vector<std::int64_t>& shape) const {
    const SafetensorsReader& f = rank_file(rank);
    const TensorInfo& t = f.info(name);
    if (t.dtype != dtype || t.shape != shape)
      throw Error("checkpoint file " + f.path().string() + ": tensor '" + name + "' is " + std::string(dtype_name(t.dtype)) + " " +
                  detail::shape_text(t.shape) + ", expected " + std::string(dtype_name(dtype)) + " " + detail::shape_text(shape));
    return t;
  }
  std::vector<std::byte> read_rank(int rank, const std::string& name) const { return rank_file(rank).read_bytes(name); }
  // The whole tensor into `out`, whose size must be the tensor's byte count.
  void read_rank_into(int rank, const std::string& name, std::span<std::byte> out) const {
    const SafetensorsReader& f = rank_file(rank);
    const TensorInfo& t = f.info(name);
    check(out.size() == t.end - t.begin, "checkpoint file " + f.path().string() + ": tensor '" + name + "' has " +
                                             std::to_string(t.end - t.begin) + " bytes; the destination has " + std::to_string(out.size()));
    f.read_bytes(name, out);
  }
  void read_rank_range(int rank, const std::string& name, std::uint64_t byte_offset, std::span<std::byte> out) const {
    rank_file(rank).read_bytes(name, out, byte_offset);
  }
  // Values of a tensor of the expected dtype (T's size must be the dtype's).
  template <class T>
  std::vector<T> read_rank_as(int rank, const std::string& name, DType dtype) const {
    check(sizeof(T) == dtype_size(dtype), "read_rank_as: element type size does not match dtype " + std::string(dtype_name(dtype)));
    const SafetensorsReader& f = rank_file(rank);
    const TensorInfo& t = f.info(name);
    if (t.dtype != dtype)
      throw Error("checkpoint file " + f.path().string() + ": tensor '" + name + "' is " + std::string(dtype_name(t.dtype)) +
                  ", expected " + std::string(dtype_name(dtype)));
    std::vector<T> out(std::size_t((t.end - t.begin) / sizeof(T)));
    f.read_bytes(name, std::as_writable_bytes(std::span(out)));
    return out;
  }

 private:
  struct Impl {
    std::filesystem::path dir;
    CheckpointIndex index;
    Verify verify = Verify::checksums;
    std::mutex mu;
    std::vector<std::unique_ptr<SafetensorsReader>> files;
  };
  explicit CheckpointReader(std::shared_ptr<Impl> s) : s_(std::move(s)) {}

  void check_rank(int rank) const {
    check(rank >= 0 && rank < s_->index.world_size, "checkpoint " + s_->dir.string() + ": rank " + std::to_string(rank) +
                                                        " is outside its world of " + std::to_string(s_->index.world_size));
  }
  std::string file_label(int rank) const { return "checkpoint file " + (s_->dir / s_->index.files[std::size_t(rank)].name).string(); }

  void check_size(int rank) const {
    const CheckpointFile& e = s_->index.files[std::size_t(rank)];
    const auto p = s_->dir / e.name;
    std::error_code ec;
    const auto size = std::filesystem::file_size(p, ec);
    if (ec) throw Error(file_label(rank) + ": missing (index.json lists it with " + std::to_string(e.bytes) + " bytes)");
    if (size != e.bytes)
      throw Error(file_label(rank) + ": size mismatch: index.json records " + std::to_string(e.bytes) + " bytes, the file has " +
                  std::to_string(size) + (size < e.bytes ? " (truncated)" : ""));
  }
  // The header, validated on its own and against the index entry.
  SafetensorsReader open_header(int rank) const {
    const CheckpointFile& e = s_->index.files[std::size_t(rank)];
    SafetensorsReader f = SafetensorsReader::open(s_->dir / e.name);
    const std::string who = file_label(rank);
    const auto& md = f.metadata();
    auto meta = [&](const std::string& k) {
      const auto it = md.find(k);
      return it == md.end() ? std::string("<none>") : it->second;
    };
    if (meta("format") != kCheckpointShardFormat)
      throw Error(who + ": not a squeeze checkpoint shard (metadata 'format' is " + meta("format") + ")");
    const std::string want_rank = std::to_string(rank), want_world = std::to_string(s_->index.world_size),
                      want_step = std::to_string(s_->index.step);
    if (meta("rank") != want_rank || meta("world_size") != want_world || meta("step") != want_step)
      throw Error(who + ": index/shard mismatch: the file says rank " + meta("rank") + " of " + meta("world_size") + " at step " +
                  meta("step") + ", the index expects rank " + want_rank + " of " + want_world + " at step " + want_step);
    for (const auto& [name, t] : e.tensors) {
      if (!f.contains(name)) throw Error(who + ": index/shard mismatch: tensor '" + name + "' is in index.json but not in the file");
      if (!detail::equal_tensor_info(t, f.info(name)))
        throw Error(who + ": index/shard mismatch: tensor '" + name + "' differs between index.json and the file header");
    }
    for (const auto& [name, _] : f.tensors())
      if (!e.tensors.count(name)) throw Error(who + ": index/shard mismatch: tensor '" + name + "' is in the file but not in index.json");
    return f;
  }

  std::shared_ptr<Impl> s_;
};

// One save in progress (see the header comment for the protocol). Movable; write_rank may run on
// several threads at once, commit once after all of them returned.
class CheckpointSave {
 public:
  std::int64_t step() const { return s_->step; }
  const std::string& token() const { return s_->token; }  // what join() needs on the other processes
  int world_size() const { return s_->world; }
  bool is_coordinator() const { return s_->meta.has_value(); }
  const std::filesystem::path& staging_dir() const { return s_->staging; }
  bool committed() const {
    std::lock_guard lock(s_->mu);
    return s_->committed;
  }

  // Writes rank `rank`'s file from views, one tensor after another (nothing gathered), then its record
  // (size, sha256, tensors) beside it for commit() to collect.
  WrittenFile write_rank(int rank, std::span<const TensorView> tensors) {
    State& s = *s_;
    check(rank >= 0 && rank < s.world, "checkpoint save of step " + std::to_string(s.step) + ": rank " + std::to_string(rank) +
                                           " is outside the world of " + std::to_string(s.world));
    {
      std::lock_guard lock(s.mu);
      check(!s.committed && !s.abandoned, "checkpoint save of step " + std::to_string(s.step) + ": already committed or abandoned");
      check(s.writing.insert(rank).second,
            "checkpoint save of step " + std::to_string(s.step) + ": rank " + std::to_string(rank) + " is written twice");
    }
    try {
      const auto rec = s.staging / detail::record_name(rank, s.world);
      check(!std::filesystem::exists(rec), "checkpoint save of step " + std::to_string(s.step) + ": rank " + std::to_string(rank) +
                                               " was already written by another process");
      const std::map<std::string, std::string> md = {{"format", std::string(kCheckpointShardFormat)},
                                                     {"step", std::to_string(s.step)},
                                                     {"rank", std::to_string(rank)},
                                                     {"world_size", std::to_string(s.world)}};
      WrittenFile wf = write_safetensors_durably(s.staging / rank_file_name(rank, s.world), tensors, md, {s.chunk_bytes, s.hook});
      const CheckpointFile cf{rank, rank_file_name(rank, s.world), wf.bytes, wf.sha256, wf.tensors};
      write_file_durably(rec, rec.string() + ".tmp", detail::file_json(cf).dump(), s.hook, rec.filename().string());
      return wf;
    } catch (...) {
      std::lock_guard lock(s.mu);
      s.writing.erase(rank);  // the rank may try again
      throw;
    }
  }
  WrittenFile write_rank(int rank, const std::vector<TensorView>& tensors) {
    return write_rank(rank, std::span<const TensorView>(tensors));
  }

  // Coordinator only, after every rank's write_rank returned: writes index.json, moves the directory
  // into place, points `latest` at it and prunes. Returns the checkpoint's directory.
  std::filesystem::path commit() {
    namespace fs = std::filesystem;
    State& s = *s_;
    std::lock_guard lock(s.mu);
    const std::string what = "checkpoint save of step " + std::to_string(s.step) + " in " + s.root.string();
    check(s.meta.has_value(), what + ": only the process that called begin() commits; the others write their rank and wait at the barrier");
    check(!s.committed && !s.abandoned, what + ": already committed or abandoned");
    const CheckpointMeta& m = *s.meta;
    CheckpointIndex idx;
    idx.step = s.step;
    idx.world_size = m.world_size;
    idx.stage = m.stage;
    idx.strategy = m.strategy;
    idx.partitions = m.partitions;
    idx.record = m.record;
    std::string missing;
    for (int r = 0; r < s.world; ++r) {
      const auto rec = s.staging / detail::record_name(r, s.world);
      if (!fs::exists(rec)) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        continue;
      }
      CheckpointFile f = detail::file_from_json(detail::read_json_file(rec), rec.string());
      check(f.rank == r && f.name == rank_file_name(r, s.world), what + ": " + rec.string() + " describes another rank's file");
      std::error_code ec;
      const auto size = fs::file_size(s.staging / f.name, ec);
      check(!ec && size == f.bytes, what + ": " + f.name + " is missing or changed size after its rank wrote it");
      idx.files.push_back(std::move(f));
    }
    check(missing.empty(), what + ": rank(s) " + missing + " have not written their files to " + s.staging.string() +
                               " (every rank calls write_rank, then the caller's barrier, then commit)");
    for (const auto& e : fs::directory_iterator(s.staging))
      check(!e.path().filename().string().ends_with(".tmp"),
            what + ": " + e.path().string() + " is still being written (commit before the barrier?)");

    write_file_durably(s.staging / "index.json", s.staging / "index.json.tmp", idx.to_json().dump(2) + "\n", s.hook, "index.json");
    for (int r = 0; r < s.world; ++r) fs::remove(s.staging / detail::record_name(r, s.world));
    detail::hook(s.hook, "rank-records:removed");
    fsync_directory(s.staging);
    detail::hook(s.hook, "staging:fsynced");

    const std::string name = step_dir_name(s.step);
    const fs::path final_dir = s.root / name;
    fs::path displaced;  // an earlier directory of this step, removed once `latest` moved
    if (fs::exists(final_dir)) {
      if (detail::read_latest(s.root) == name) {
        // `latest` names it: swap atomically so that it names a whole checkpoint at every instant.
        check(exchange_paths(s.staging, final_dir),
              what + ": " + final_dir.string() + " exists, `latest` names it, and this file system cannot swap directories atomically");
        displaced = s.staging;
      } else {
        displaced = s.root / (name + ".old-" + s.token);
        rename_path(final_dir, displaced);
        rename_path(s.staging, final_dir);
      }
    } else {
      rename_path(s.staging, final_dir);
    }
    detail::hook(s.hook, name + ":renamed");
    fsync_directory(s.root);
    detail::hook(s.hook, "root:fsynced");

    write_file_durably(s.root / "latest", s.root / ("latest.tmp-" + s.token), name + "\n", s.hook, "latest");
    fsync_directory(s.root);
    detail::hook(s.hook, "root:fsynced-latest");
    s.committed = true;

    try {
      if (!displaced.empty()) {
        remove_tree(displaced);
        detail::hook(s.hook, "displaced:removed");
      }
      prune(s);
    } catch (const std::exception& e) {
      // The checkpoint is whole and `latest` names it; say so rather than let this look like a failed save.
      throw Error(what + ": committed as " + final_dir.string() +
                  ", but removing old checkpoints failed (the next save retries): " + e.what());
    }
    return final_dir;
  }

  // Gives up an uncommitted save: removes its staging directory (coordinator only; a save that is merely
  // dropped leaves it for the next begin() to remove).
  void abandon() {
    std::lock_guard lock(s_->mu);
    check(s_->meta.has_value(), "checkpoint save: only the coordinator abandons a save");
    if (s_->committed || s_->abandoned) return;
    remove_tree(s_->staging);
    s_->abandoned = true;
  }

 private:
  friend class CheckpointStore;
  struct State {
    std::filesystem::path root, staging;
    std::int64_t step = 0;
    std::string token;
    int world = 1;
    std::optional<CheckpointMeta> meta;  // set on the coordinator
    int keep_last = 0;
    std::size_t chunk_bytes = 0;
    FaultHook hook;
    mutable std::mutex mu;
    std::set<int> writing;
    bool committed = false, abandoned = false;
  };
  explicit CheckpointSave(std::unique_ptr<State> s) : s_(std::move(s)) {}

  // Keeps the newest keep_last checkpoints at or below the step `latest` names (which is always kept);
  // directories of higher steps belong to no committed save and are left alone. Each victim is renamed to
  // a temporary name before its removal, so a final name never holds a half-deleted checkpoint.
  static void prune(const State& s) {
    namespace fs = std::filesystem;
    if (s.keep_last <= 0) return;
    std::vector<std::int64_t> old;
    for (std::int64_t st : detail::list_steps(s.root))
      if (st <= s.step) old.push_back(st);
    if (old.size() <= std::size_t(s.keep_last)) return;
    old.resize(old.size() - std::size_t(s.keep_last));  // ascending: the oldest go
    std::vector<fs::path> moved;
    for (std::int64_t st : old) {
      const std::string n = step_dir_name(st);
      moved.push_back(s.root / (n + ".old-" + s.token));
      rename_path(s.root / n, moved.back());
      detail::hook(s.hook, n + ":pruned");
    }
    fsync_directory(s.root);
    detail::hook(s.hook, "root:fsynced-prune");
    for (const auto& p : moved) {
      remove_tree(p);
      const std::string n = p.filename().string();
      detail::hook(s.hook, n.substr(0, n.find('.')) + ":removed");
    }
  }

  std::unique_ptr<State> s_;
};

class CheckpointStore {
 public:
  explicit CheckpointStore(std::filesystem::path root, StoreOptions opt = {}) : root_(std::move(root)), opt_(std::move(opt)) {}

  const std::filesystem::path& root() const { return root_; }
  const StoreOptions& options() const { return opt_; }
  std::filesystem::path step_dir(std::int64_t step) const { return root_ / step_dir_name(step); }

  // Starts a save (the coordinator): removes leftovers of interrupted saves, creates the staging directory.
  CheckpointSave begin(std::int64_t step, CheckpointMeta meta) const {
    namespace fs = std::filesystem;
    check(step >= 0, "checkpoint: step must be >= 0, got " + std::to_string(step));
    check(meta.world_size >= 1 && meta.world_size <= kMaxCheckpointWorld,
          "checkpoint: world_size must be in [1, " + std::to_string(kMaxCheckpointWorld) + "], got " + std::to_string(meta.world_size));
    check(meta.stage >= 0, "checkpoint: stage must be >= 0");
    check(!meta.strategy.empty(), "checkpoint: CheckpointMeta::strategy must name the Strategy (its canonical name)");
    if (fs::create_directories(root_)) fsync_directory(root_.has_parent_path() ? root_.parent_path() : fs::path("."));
    remove_leftovers();
    detail::hook(opt_.fault_hook, "leftovers:removed");
    auto s = std::make_unique<CheckpointSave::State>();
    s->root = root_;
    s->step = step;
    s->token = detail::make_token();
    s->staging = root_ / (step_dir_name(step) + ".tmp-" + s->token);
    s->world = meta.world_size;
    s->meta = std::move(meta);
    s->keep_last = opt_.keep_last;
    s->chunk_bytes = opt_.chunk_bytes;
    s->hook = opt_.fault_hook;
    check(fs::create_directory(s->staging), "checkpoint: staging directory " + s->staging.string() + " already exists");
    detail::hook(opt_.fault_hook, "staging:created");
    return CheckpointSave(std::move(s));
  }

  // Joins the coordinator's save from another process (same root, step and token).
  CheckpointSave join(std::int64_t step, const std::string& token, int world_size) const {
    check(detail::valid_token(token), "checkpoint: '" + token + "' is not a save token (CheckpointSave::token() of the coordinator)");
    check(world_size >= 1 && world_size <= kMaxCheckpointWorld, "checkpoint: world_size out of range");
    auto s = std::make_unique<CheckpointSave::State>();
    s->root = root_;
    s->step = step;
    s->token = token;
    s->staging = root_ / (step_dir_name(step) + ".tmp-" + token);
    s->world = world_size;
    s->chunk_bytes = opt_.chunk_bytes;
    s->hook = opt_.fault_hook;
    check(std::filesystem::is_directory(s->staging), "checkpoint: no save of step " + std::to_string(step) + " with token " + token +
                                                         " is in progress in " + root_.string() +
                                                         " (join after the coordinator's begin(), with its token())");
    return CheckpointSave(std::move(s));
  }

  // The step `latest` names, if any.
  std::optional<std::int64_t> latest_step() const {
    const auto n = detail::read_latest(root_);
    if (!n) return std::nullopt;
    return parse_step_dir_name(*n);
  }
  // Step directories under final names, ascending (not verified: open() verifies).
  std::vector<std::int64_t> steps() const { return detail::list_steps(root_); }

  CheckpointReader open(std::int64_t step, const OpenOptions& opt = {}) const { return CheckpointReader::open(step_dir(step), opt); }

  // The checkpoint `latest` names, verified; never falls back to an older one silently.
  CheckpointReader open_latest(const OpenOptions& opt = {}) const {
    const auto n = detail::read_latest(root_);
    if (!n)
      throw Error("checkpoint store " + root_.string() + ": no checkpoint to resume from ('latest' is missing)" +
                  detail::steps_hint(root_));
    const auto dir = root_ / *n;
    if (!std::filesystem::is_directory(dir))
      throw Error("checkpoint store " + root_.string() + ": 'latest' names " + *n + ", which does not exist" + detail::steps_hint(root_));
    return CheckpointReader::open(dir, opt);
  }

  // Removes what interrupted saves and prunes left behind (temporary names only).
  void remove_leftovers() const {
    std::error_code ec;
    std::vector<std::filesystem::path> victims;
    for (const auto& e : std::filesystem::directory_iterator(root_, ec))
      if (detail::is_leftover(e.path().filename().string())) victims.push_back(e.path());
    for (const auto& p : victims) remove_tree(p);
  }

 private:
  std::filesystem::path root_;
  StoreOptions opt_;
};

}  // namespace squeeze::io
