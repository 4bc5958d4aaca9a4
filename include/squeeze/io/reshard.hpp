#pragma once
// Resharding and consolidation of checkpoints of flat partitions, torch-free (docs/checkpoints.md).
//
// A partition is a flat buffer of named parameters laid out as FlatParams lays it out (engine/flat_params.hpp):
//   offset_0 = 0, offset_{i+1} = round_up(offset_i + numel_i, align),  used = offset_last + numel_last,
//   padded(world) = round_up(max(used, 1), world * align),  shard(world) = padded(world) / world.
// A checkpoint stores each buffer of a partition (master, m, v, ...) as one 1-D tensor per rank named
// "<key>/<buffer>" (shard_tensor_name), holding elements [rank * shard, (rank + 1) * shard) of the padded
// buffer; padding and alignment gaps are zero.
// plan_reshard maps every shard of a target layout (another world size, alignment or grouping) to copy
// segments out of the source shards, parameter by parameter, with gaps zero-filled; read_resharded executes
// one through ranged reads; consolidate streams every partition into one safetensors file of full
// parameters, padding dropped, optionally converted between F32, BF16 and F16.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"
#include "squeeze/io/checkpoint_store.hpp"
#include "squeeze/io/safetensors.hpp"
#include "squeeze/io/safetensors_stream.hpp"

namespace squeeze::io {

struct FlatLayoutEntry {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;  // elements into the flat buffer
  std::int64_t numel = 0;
  int group = -1;  // the trainer's parameter group (8-bit state blocks start at each group's run); -1: not recorded
};

struct FlatLayout {
  std::string key;                       // the partition's name, unique in a checkpoint
  std::int64_t align = 1;                // elements
  std::vector<FlatLayoutEntry> entries;  // ascending offsets

  // The layout FlatParams(params, world, align) builds.
  static FlatLayout pack(std::string key, const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& params,
                         std::int64_t align = 1) {
    check(align >= 1, "FlatLayout '" + key + "': align must be >= 1");
    FlatLayout l{std::move(key), align, {}};
    std::int64_t off = 0;
    for (const auto& [name, shape] : params) {
      std::int64_t n = 1;
      for (auto d : shape) {
        check(d >= 0 && (d == 0 || n <= (std::int64_t(1) << 62) / d),
              "FlatLayout '" + l.key + "': parameter '" + name + "' has a bad shape");
        n *= d;
      }
      off = round_up(off, align);
      l.entries.push_back({name, shape, off, n});
      off += n;
    }
    l.validate();
    return l;
  }
  static std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

  std::int64_t used() const { return entries.empty() ? 0 : entries.back().offset + entries.back().numel; }
  std::int64_t padded(int world) const {
    check(world >= 1, "FlatLayout: world size must be >= 1");
    return round_up(std::max<std::int64_t>(used(), 1), std::int64_t(world) * align);
  }
  std::int64_t shard(int world) const { return padded(world) / world; }

  void validate() const {
    const std::string w = "FlatLayout '" + key + "': ";
    check(!key.empty(), "FlatLayout: a partition needs a key");
    check(align >= 1, w + "align must be >= 1");
    check(!entries.empty(), w + "a partition needs at least one parameter");
    std::int64_t end = 0;
    std::set<std::string> names;
    for (const auto& e : entries) {
      check(!e.name.empty() && names.insert(e.name).second, w + "parameter names must be non-empty and unique ('" + e.name + "')");
      std::int64_t n = 1;
      for (auto d : e.shape) {
        check(d >= 0 && (d == 0 || n <= (std::int64_t(1) << 62) / d), w + "parameter '" + e.name + "' has a bad shape");
        n *= d;
      }
      check(e.numel == n,
            w + "parameter '" + e.name + "' has numel " + std::to_string(e.numel) + " but its shape holds " + std::to_string(n));
      check(e.offset >= end && e.offset % align == 0, w + "parameter '" + e.name + "' at offset " + std::to_string(e.offset) +
                                                          " overlaps its predecessor or is not aligned to " + std::to_string(align));
      end = e.offset + e.numel;
    }
  }
};

// The layout of a FlatParams (or anything with entries() of {name, shape, offset, numel}, world() and
// padded()); align_elems must be the alignment it was built with, which the padding cross-checks.
template <class FP>
FlatLayout flat_layout_of(std::string key, const FP& flat, std::int64_t align_elems) {
  FlatLayout l{std::move(key), align_elems, {}};
  for (const auto& e : flat.entries())
    l.entries.push_back({e.name, std::vector<std::int64_t>(e.shape.begin(), e.shape.end()), std::int64_t(e.offset), std::int64_t(e.numel)});
  l.validate();
  check(l.padded(int(flat.world())) == std::int64_t(flat.padded()),
        "flat_layout_of('" + l.key + "'): align " + std::to_string(align_elems) + " does not reproduce the buffer's padding");
  return l;
}

inline std::string shard_tensor_name(const std::string& key, const std::string& buffer) { return key + "/" + buffer; }

inline nlohmann::json flat_layouts_to_json(const std::vector<FlatLayout>& ls) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& l : ls) {
    nlohmann::json es = nlohmann::json::array();
    for (const auto& e : l.entries) {
      es.push_back({{"name", e.name}, {"shape", e.shape}, {"offset", e.offset}});
      if (e.group >= 0) es.back()["group"] = e.group;
    }
    a.push_back({{"key", l.key}, {"align", l.align}, {"entries", es}});
  }
  return a;
}

inline std::vector<FlatLayout> flat_layouts_from_json(const nlohmann::json& j, const std::string& source) {
  using detail::field;
  check(j.is_array(), source + ": partition layouts must be a JSON array");
  std::vector<FlatLayout> out;
  std::set<std::string> keys;
  for (std::size_t i = 0; i < j.size(); ++i) {
    const std::string src = source + ", partition " + std::to_string(i);
    FlatLayout l;
    l.key = detail::string_field(j[i], "key", src);
    check(keys.insert(l.key).second, src + ": key '" + l.key + "' appears twice");
    l.align = detail::int_field(j[i], "align", src, 1);
    const auto& es = field(j[i], "entries", src);
    check(es.is_array(), src + ": 'entries' must be an array");
    for (const auto& e : es) {
      FlatLayoutEntry fe;
      fe.name = detail::string_field(e, "name", src);
      fe.offset = detail::int_field(e, "offset", src + ", '" + fe.name + "'");
      const auto& shape = field(e, "shape", src + ", '" + fe.name + "'");
      check(shape.is_array(), src + ", '" + fe.name + "': 'shape' must be an array");
      fe.numel = 1;
      for (const auto& d : shape) {
        check(detail::non_negative_integer(d) && d.get<std::uint64_t>() <= (std::uint64_t(1) << 40),
              src + ", '" + fe.name + "': shape entries must be non-negative integers");
        fe.shape.push_back(d.get<std::int64_t>());
        fe.numel *= fe.shape.back();
      }
      if (e.contains("group")) fe.group = int(detail::int_field(e, "group", src + ", '" + fe.name + "'"));
      l.entries.push_back(std::move(fe));
    }
    l.validate();
    out.push_back(std::move(l));
  }
  return out;
}

// ---- plans ---------------------------------------------------------------------------------------------

struct CopySegment {
  std::int64_t dst_offset = 0;  // elements into the target shard
  std::int64_t count = 0;
  int src_partition = -1;  // index into ReshardPlan::from; -1: zero fill (padding, alignment gaps)
  int src_rank = 0;
  std::int64_t src_offset = 0;  // elements into that source rank's shard
  bool zero_fill() const { return src_partition < 0; }
  bool operator==(const CopySegment&) const = default;
};

struct ShardPlan {
  int partition = 0;  // index into ReshardPlan::to
  int rank = 0;
  std::int64_t elements = 0;  // the target shard's size; the segments cover it in order
  std::vector<CopySegment> segments;
};

struct ReshardPlan {
  int from_world = 1, to_world = 1;
  std::vector<FlatLayout> from, to;
  std::vector<std::vector<ShardPlan>> shards;  // [target partition][target rank]
  const ShardPlan& at(std::size_t partition, int rank) const {
    check(partition < shards.size() && rank >= 0 && rank < to_world,
          "ReshardPlan: no target shard (" + std::to_string(partition) + ", " + std::to_string(rank) + ")");
    return shards[partition][std::size_t(rank)];
  }
};

namespace detail {
struct ParamAt {
  int partition;
  const FlatLayoutEntry* entry;
};
inline std::map<std::string, ParamAt> index_params(const std::vector<FlatLayout>& ls, const std::string& what) {
  std::map<std::string, ParamAt> m;
  std::set<std::string> keys;
  for (std::size_t p = 0; p < ls.size(); ++p) {
    ls[p].validate();
    check(keys.insert(ls[p].key).second, what + ": partition key '" + ls[p].key + "' appears twice");
    for (const auto& e : ls[p].entries)
      check(m.emplace(e.name, ParamAt{int(p), &e}).second, what + ": parameter '" + e.name + "' is in two partitions");
  }
  return m;
}
inline void push_segment(std::vector<CopySegment>& v, CopySegment s) {
  if (s.count == 0) return;
  if (!v.empty()) {
    CopySegment& b = v.back();
    const bool adjacent = b.dst_offset + b.count == s.dst_offset;
    if (adjacent && b.zero_fill() && s.zero_fill()) {
      b.count += s.count;
      return;
    }
    if (adjacent && !b.zero_fill() && b.src_partition == s.src_partition && b.src_rank == s.src_rank &&
        b.src_offset + b.count == s.src_offset) {
      b.count += s.count;
      return;
    }
  }
  v.push_back(s);
}
// Source elements [g, g + n) of a flat buffer sharded `shard` elements per rank, as (rank, offset, count).
template <class F>
void split_by_shard(std::int64_t g, std::int64_t n, std::int64_t shard, F&& f) {
  while (n > 0) {
    const int r = int(g / shard);
    const std::int64_t off = g % shard, take = std::min(n, shard - off);
    f(r, off, take);
    g += take;
    n -= take;
  }
}
}  // namespace detail

// For each target partition and rank of world `to_world`, the segments that fill its shard from the
// shards of world `from_world`. Every parameter must be in both layouts with the same shape; partitions
// may be grouped and aligned differently.
inline ReshardPlan plan_reshard(std::vector<FlatLayout> from, int from_world, std::vector<FlatLayout> to, int to_world) {
  check(from_world >= 1 && to_world >= 1, "plan_reshard: world sizes must be >= 1");
  ReshardPlan plan{from_world, to_world, std::move(from), std::move(to), {}};
  const auto src = detail::index_params(plan.from, "plan_reshard (checkpoint layout)");
  const auto dst = detail::index_params(plan.to, "plan_reshard (target layout)");
  for (const auto& [name, at] : src)
    check(dst.count(name), "plan_reshard: checkpoint parameter '" + name + "' (partition '" + plan.from[std::size_t(at.partition)].key +
                               "') has no place in the target layout");
  for (const auto& [name, at] : dst) {
    const auto it = src.find(name);
    check(it != src.end(), "plan_reshard: target parameter '" + name + "' (partition '" + plan.to[std::size_t(at.partition)].key +
                               "') is not in the checkpoint");
    check(it->second.entry->shape == at.entry->shape, "plan_reshard: parameter '" + name + "' is " +
                                                          detail::shape_text(it->second.entry->shape) + " in the checkpoint and " +
                                                          detail::shape_text(at.entry->shape) + " in the target layout");
  }
  for (std::size_t tp = 0; tp < plan.to.size(); ++tp) {
    const FlatLayout& tl = plan.to[tp];
    const std::int64_t sm = tl.shard(to_world);
    auto& row = plan.shards.emplace_back();
    for (int t = 0; t < to_world; ++t) {
      ShardPlan sp{int(tp), t, sm, {}};
      const std::int64_t lo = std::int64_t(t) * sm, hi = lo + sm;
      std::int64_t cur = lo;
      for (const auto& e : tl.entries) {
        const std::int64_t a = std::max(lo, e.offset), b = std::min(hi, e.offset + e.numel);
        if (a >= b) continue;
        const auto it = src.find(e.name);
        const FlatLayoutEntry& se = *it->second.entry;
        detail::push_segment(sp.segments, {cur - lo, a - cur, -1, 0, 0});
        std::int64_t dst_at = a - lo;
        const int p = it->second.partition;
        detail::split_by_shard(se.offset + (a - e.offset), b - a, plan.from[std::size_t(p)].shard(from_world),
                               [&](int r, std::int64_t off, std::int64_t n) {
                                 detail::push_segment(sp.segments, {dst_at, n, p, r, off});
                                 dst_at += n;
                               });
        cur = b;
      }
      detail::push_segment(sp.segments, {cur - lo, hi - cur, -1, 0, 0});
      row.push_back(std::move(sp));
    }
  }
  return plan;
}

// Runs a shard plan: read(src_partition, src_rank, byte_offset, out) fills `out` from that source shard;
// zero-fill segments are zeroed. `out` holds the target shard (plan.elements * elem_size bytes).
template <class Read>
void execute_shard_plan(const ShardPlan& plan, std::size_t elem_size, std::span<std::byte> out, Read&& read) {
  check(out.size() == std::size_t(plan.elements) * elem_size, "execute_shard_plan: the destination has " + std::to_string(out.size()) +
                                                                  " bytes; the shard needs " +
                                                                  std::to_string(std::size_t(plan.elements) * elem_size));
  for (const CopySegment& s : plan.segments) {
    auto dst = out.subspan(std::size_t(s.dst_offset) * elem_size, std::size_t(s.count) * elem_size);
    if (s.zero_fill())
      std::memset(dst.data(), 0, dst.size());
    else
      read(s.src_partition, s.src_rank, std::uint64_t(s.src_offset) * elem_size, dst);
  }
}

namespace detail {
// The dtype of buffer `buffer` in the checkpoint, after checking that every partition's tensor on every rank
// exists as a 1-D shard of the layout's size and that all share one dtype.
inline DType check_shard_tensors(const CheckpointReader& src, const std::vector<FlatLayout>& layouts, const std::string& buffer) {
  std::optional<DType> dt;
  for (const auto& l : layouts) {
    const std::int64_t shard = l.shard(src.world_size());
    const std::string name = shard_tensor_name(l.key, buffer);
    for (int r = 0; r < src.world_size(); ++r) {
      const SafetensorsReader& f = src.rank_file(r);
      const TensorInfo& t = f.info(name);
      check(t.shape == std::vector<std::int64_t>{shard}, "checkpoint file " + f.path().string() + ": tensor '" + name + "' is " +
                                                             shape_text(t.shape) + ", the layout's shard at world " +
                                                             std::to_string(src.world_size()) + " is [" + std::to_string(shard) + "]");
      check(!dt || *dt == t.dtype, "checkpoint file " + f.path().string() + ": tensor '" + name + "' is " +
                                       std::string(dtype_name(t.dtype)) + "; the other shards of buffer '" + buffer + "' are " +
                                       std::string(dtype_name(dt ? *dt : t.dtype)));
      dt = t.dtype;
    }
  }
  check(dt.has_value(), "checkpoint: no partitions to read");
  return *dt;
}
}  // namespace detail

// The target shard (partition, rank) of `plan`, buffer `buffer`, read from the checkpoint into `out`
// (plan.at(partition, rank).elements elements of the stored dtype, which is returned).
inline DType read_resharded(const CheckpointReader& src, const ReshardPlan& plan, std::size_t partition, int rank,
                            const std::string& buffer, std::span<std::byte> out) {
  check(src.world_size() == plan.from_world, "read_resharded: the plan is from world " + std::to_string(plan.from_world) +
                                                 ", the checkpoint " + src.dir().string() + " has world " +
                                                 std::to_string(src.world_size()));
  const DType dt = detail::check_shard_tensors(src, plan.from, buffer);
  execute_shard_plan(plan.at(partition, rank), dtype_size(dt), out, [&](int p, int r, std::uint64_t off, std::span<std::byte> dst) {
    src.read_rank_range(r, shard_tensor_name(plan.from[std::size_t(p)].key, buffer), off, dst);
  });
  return dt;
}

// Byte ranges of source rank files that make up a target shard (for copying with other tools).
struct FileCopy {
  int src_rank = -1;  // -1: zero fill
  std::filesystem::path file;
  std::uint64_t file_offset = 0;
  std::uint64_t bytes = 0;
  std::uint64_t dst_offset = 0;  // bytes into the target shard
};
inline std::vector<FileCopy> file_copies(const CheckpointReader& src, const ReshardPlan& plan, std::size_t partition, int rank,
                                         const std::string& buffer) {
  check(src.world_size() == plan.from_world, "file_copies: the plan's source world differs from the checkpoint's");
  const std::size_t es = dtype_size(detail::check_shard_tensors(src, plan.from, buffer));
  std::vector<FileCopy> out;
  for (const CopySegment& s : plan.at(partition, rank).segments) {
    FileCopy c;
    c.bytes = std::uint64_t(s.count) * es;
    c.dst_offset = std::uint64_t(s.dst_offset) * es;
    if (!s.zero_fill()) {
      c.src_rank = s.src_rank;
      c.file = src.rank_path(s.src_rank);
      c.file_offset = src.rank_file(s.src_rank).file_offset(shard_tensor_name(plan.from[std::size_t(s.src_partition)].key, buffer)) +
                      std::uint64_t(s.src_offset) * es;
    }
    out.push_back(std::move(c));
  }
  return out;
}

// ---- consolidation ---------------------------------------------------------------------------------------

namespace detail {
inline bool float_dtype(DType d) { return d == DType::F32 || d == DType::BF16 || d == DType::F16; }
inline float load_float(const std::byte* p, DType d) {
  if (d == DType::F32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  if (d == DType::BF16) {
    squeeze::bf16 b;
    std::memcpy(&b, p, 2);
    return squeeze::to_float(b);
  }
  squeeze::half h;
  std::memcpy(&h, p, 2);
  return squeeze::to_float(h);
}
inline void store_float(std::byte* p, DType d, float f) {
  if (d == DType::F32)
    std::memcpy(p, &f, 4);
  else if (d == DType::BF16) {
    const squeeze::bf16 b = squeeze::from_float<squeeze::bf16>(f);
    std::memcpy(p, &b, 2);
  } else {
    const squeeze::half h = squeeze::from_float<squeeze::half>(f);
    std::memcpy(p, &h, 2);
  }
}
}  // namespace detail

struct ConsolidateOptions {
  std::string buffer = "master";                          // which stored buffer holds the weights
  std::optional<DType> dtype;                             // convert to (F32 / BF16 / F16); default: as stored
  std::function<std::string(const std::string&)> rename;  // output tensor name of a parameter; default: its name
  std::map<std::string, std::string> metadata;
  std::size_t chunk_bytes = std::size_t(8) << 20;
};

// Streams every parameter of `layouts` out of the checkpoint's shards into one safetensors file at `out`
// (written under a temporary name, fsync'd, renamed, its directory fsync'd): tensor by tensor through one
// chunk buffer, padding dropped. Never holds a shard or a parameter whole.
inline WrittenFile consolidate(const CheckpointReader& src, const std::vector<FlatLayout>& layouts, const std::filesystem::path& out,
                               const ConsolidateOptions& opt = {}) {
  detail::index_params(layouts, "consolidate");
  const DType sd = detail::check_shard_tensors(src, layouts, opt.buffer);
  const DType od = opt.dtype.value_or(sd);
  check(od == sd || (detail::float_dtype(sd) && detail::float_dtype(od)), "consolidate: cannot convert " + std::string(dtype_name(sd)) +
                                                                              " to " + std::string(dtype_name(od)) +
                                                                              " (only between F32, BF16, F16)");
  const std::size_t ses = dtype_size(sd), oes = dtype_size(od);
  const int world = src.world_size();
  std::vector<std::byte> convert_buf;
  std::vector<TensorView> views;
  std::set<std::string> out_names;
  for (const FlatLayout& l : layouts) {
    const std::string tensor = shard_tensor_name(l.key, opt.buffer);
    const std::int64_t shard = l.shard(world);
    for (const FlatLayoutEntry& e : l.entries) {
      const std::string name = opt.rename ? opt.rename(e.name) : e.name;
      check(out_names.insert(name).second, "consolidate: two parameters are both named '" + name + "' in the output");
      // Source elements [g, g + n) into dst (stored dtype).
      auto read_src = [&src, tensor, shard, ses](std::int64_t g, std::int64_t n, std::byte* dst) {
        detail::split_by_shard(g, n, shard, [&](int r, std::int64_t off, std::int64_t k) {
          src.read_rank_range(r, tensor, std::uint64_t(off) * ses, std::span(dst, std::size_t(k) * ses));
          dst += std::size_t(k) * ses;
        });
      };
      const std::int64_t base = e.offset;
      views.emplace_back(name, od, e.shape, [read_src, base, sd, od, ses, oes, &convert_buf](std::uint64_t offset, std::span<std::byte> o) {
        const std::int64_t k = std::int64_t(offset / oes), n = std::int64_t(o.size() / oes);
        if (sd == od) return read_src(base + k, n, o.data());
        convert_buf.resize(std::size_t(n) * ses);
        read_src(base + k, n, convert_buf.data());
        for (std::int64_t i = 0; i < n; ++i)
          detail::store_float(o.data() + std::size_t(i) * oes, od, detail::load_float(convert_buf.data() + std::size_t(i) * ses, sd));
      });
    }
  }
  StreamWriteOptions wo;
  wo.chunk_bytes = opt.chunk_bytes;
  WrittenFile wf = write_safetensors_durably(out, views, opt.metadata, wo);
  fsync_directory(out.has_parent_path() ? out.parent_path() : std::filesystem::path("."));
  return wf;
}

}  // namespace squeeze::io
