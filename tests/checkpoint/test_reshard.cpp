// Resharding plans against a brute-force reference (every N -> M for 1..4, sizes that do not divide,
// different alignments and groupings), the same through checkpoint files, and consolidation.
#include <random>

#include <squeeze/io/reshard.hpp>

#include "ckpt_test_util.hpp"

using namespace ckpt_test;

namespace {

using Params = std::vector<std::pair<std::string, std::vector<std::int64_t>>>;

std::int64_t numel(const std::vector<std::int64_t>& s) {
  std::int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}
// Parameter p's element j: distinct everywhere, never zero (padding is).
std::uint32_t value(std::size_t p, std::int64_t j) { return std::uint32_t((p + 1) * 100003u + std::uint64_t(j) + 1); }

// The padded flat buffer of a layout at `world`, built element by element from the parameters.
std::vector<std::uint32_t> full_buffer(const FlatLayout& l, int world, const Params& params) {
  std::vector<std::uint32_t> b(std::size_t(l.padded(world)), 0);
  for (const auto& e : l.entries) {
    const auto p = std::size_t(std::find_if(params.begin(), params.end(), [&](auto& q) { return q.first == e.name; }) - params.begin());
    for (std::int64_t j = 0; j < e.numel; ++j) b[std::size_t(e.offset + j)] = value(p, j);
  }
  return b;
}
std::vector<std::uint32_t> shard_of(const std::vector<std::uint32_t>& full, std::int64_t shard, int rank) {
  return {full.begin() + rank * shard, full.begin() + (rank + 1) * shard};
}

// Splits the parameters into `groups` consecutive partitions with alignment `align`.
std::vector<FlatLayout> group(const Params& params, std::size_t groups, std::int64_t align, const std::string& prefix) {
  std::vector<FlatLayout> out;
  groups = std::min(groups, params.size());
  std::size_t at = 0;
  for (std::size_t g = 0; g < groups; ++g) {
    const std::size_t n = (params.size() - at) / (groups - g);
    out.push_back(FlatLayout::pack(prefix + std::to_string(g), Params(params.begin() + at, params.begin() + at + n), align));
    at += n;
  }
  return out;
}

Params random_params(std::mt19937& rng) {
  std::uniform_int_distribution<int> count(1, 7), dim(1, 13), rank(1, 2), zero(0, 9);
  Params ps;
  const int n = count(rng);
  for (int i = 0; i < n; ++i) {
    std::vector<std::int64_t> s;
    for (int d = rank(rng); d > 0; --d) s.push_back(dim(rng));
    if (zero(rng) == 0) s[0] = 0;  // an empty parameter now and then
    ps.emplace_back("layer" + std::to_string(i) + (i % 2 ? ".bias" : ".weight"), s);
  }
  return ps;
}

TEST(FlatLayout, SameAsFlatParams) {
  // offsets round up to align after each parameter; padded rounds up to world * align
  const FlatLayout l = FlatLayout::pack("g", {{"a", {5}}, {"b", {3}}, {"c", {2, 5}}}, 4);
  ASSERT_EQ(l.entries.size(), 3u);
  EXPECT_EQ(l.entries[1].offset, 8);
  EXPECT_EQ(l.entries[2].offset, 12);
  EXPECT_EQ(l.used(), 22);
  EXPECT_EQ(l.padded(3), 24);
  EXPECT_EQ(l.shard(3), 8);
  EXPECT_EQ(l.padded(1), 24);
  EXPECT_EQ(l.padded(2), 24);
  EXPECT_EQ(l.padded(4), 32);
  const FlatLayout u = FlatLayout::pack("u", {{"a", {5}}, {"b", {3}}, {"c", {2, 5}}});
  EXPECT_EQ(u.used(), 18);
  EXPECT_EQ(u.shard(4), 5);
  // A FlatParams look-alike (entries, world, padded) converts, and a wrong alignment is caught.
  struct Entry {
    std::string name;
    std::vector<std::int64_t> shape;
    std::int64_t offset, numel;
  };
  struct Fake {
    std::vector<Entry> es;
    const std::vector<Entry>& entries() const { return es; }
    int world() const { return 3; }
    std::int64_t pad = 24;
    std::int64_t padded() const { return pad; }
  } fake{{{"a", {5}, 0, 5}, {"b", {3}, 8, 3}, {"c", {2, 5}, 12, 10}}};
  EXPECT_EQ(flat_layout_of("g", fake, 4).entries[2].offset, 12);
  EXPECT_HAS(error_of([&] { flat_layout_of("g", fake, 3); }), "overlaps its predecessor or is not aligned");
  fake.pad = 36;
  EXPECT_HAS(error_of([&] { flat_layout_of("g", fake, 4); }), "does not reproduce the buffer's padding");
}

TEST(FlatLayout, JsonRoundTripAndRejects) {
  const std::vector<FlatLayout> ls = {FlatLayout::pack("p0", {{"a", {5}}, {"b", {3, 2}}}, 4), FlatLayout::pack("p1", {{"c", {7}}})};
  const auto back = flat_layouts_from_json(flat_layouts_to_json(ls), "test");
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0].entries[1].offset, 8);
  EXPECT_EQ(back[0].entries[1].numel, 6);
  EXPECT_EQ(back[1].key, "p1");
  auto j = flat_layouts_to_json(ls);
  j[0]["entries"][1]["offset"] = 2;
  EXPECT_HAS(error_of([&] { flat_layouts_from_json(j, "idx"); }), "overlaps its predecessor");
  j = flat_layouts_to_json(ls);
  j[1]["key"] = "p0";
  EXPECT_HAS(error_of([&] { flat_layouts_from_json(j, "idx"); }), "key 'p0' appears twice");
  j = flat_layouts_to_json(ls);
  j[0].erase("align");
  EXPECT_HAS(error_of([&] { flat_layouts_from_json(j, "idx"); }), "'align' is missing");
}

// Runs a plan on in-memory source shards.
std::vector<std::uint32_t> run_plan(const ReshardPlan& plan, std::size_t tp, int t,
                                    const std::vector<std::vector<std::vector<std::uint32_t>>>& src) {
  const ShardPlan& sp = plan.at(tp, t);
  std::vector<std::uint32_t> out(std::size_t(sp.elements), 0xdeadbeefu);
  execute_shard_plan(sp, 4, std::as_writable_bytes(std::span(out)), [&](int p, int r, std::uint64_t off, std::span<std::byte> dst) {
    const auto& s = src[std::size_t(p)][std::size_t(r)];
    ASSERT_LE(off + dst.size(), s.size() * 4);
    std::memcpy(dst.data(), reinterpret_cast<const std::byte*>(s.data()) + off, dst.size());
  });
  return out;
}

TEST(Reshard, PlansMatchBruteForce) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> groups(1, 3);
  const std::int64_t aligns[] = {1, 2, 3, 8};
  int cases = 0;
  for (int trial = 0; trial < 150; ++trial) {
    const Params ps = random_params(rng);
    const auto from = group(ps, std::size_t(groups(rng)), aligns[rng() % 4], "src");
    const auto to = trial % 3 == 0 ? group(ps, from.size(), from[0].align, "src")  // same layout, other world
                                   : group(ps, std::size_t(groups(rng)), aligns[rng() % 4], "dst");
    for (int n = 1; n <= 4; ++n) {
      std::vector<std::vector<std::vector<std::uint32_t>>> src;
      for (const auto& l : from) {
        const auto full = full_buffer(l, n, ps);
        auto& per_rank = src.emplace_back();
        for (int r = 0; r < n; ++r) per_rank.push_back(shard_of(full, l.shard(n), r));
      }
      for (int m = 1; m <= 4; ++m) {
        const ReshardPlan plan = plan_reshard(from, n, to, m);
        for (std::size_t tp = 0; tp < to.size(); ++tp) {
          const auto full = full_buffer(to[tp], m, ps);
          for (int t = 0; t < m; ++t) {
            const ShardPlan& sp = plan.at(tp, t);
            std::int64_t covered = 0;  // segments cover the shard in order
            for (const auto& s : sp.segments) {
              EXPECT_EQ(s.dst_offset, covered);
              EXPECT_GT(s.count, 0);
              covered += s.count;
            }
            EXPECT_EQ(covered, to[tp].shard(m));
            ASSERT_EQ(run_plan(plan, tp, t, src), shard_of(full, to[tp].shard(m), t))
                << "trial " << trial << " " << n << " -> " << m << ", partition " << tp << ", rank " << t;
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 3000);
}

TEST(Reshard, SameWorldAndLayoutIsOneCopyPerShard) {
  const auto ls = group({{"a", {7}}, {"b", {5, 3}}, {"c", {11}}}, 2, 4, "p");
  const ReshardPlan plan = plan_reshard(ls, 3, ls, 3);
  for (std::size_t p = 0; p < ls.size(); ++p)
    for (int r = 0; r < 3; ++r)
      for (const auto& s : plan.at(p, r).segments)
        if (!s.zero_fill()) {
          EXPECT_EQ(s.src_rank, r);
          EXPECT_EQ(s.src_partition, int(p));
          EXPECT_EQ(s.src_offset, s.dst_offset);
        }
}

TEST(Reshard, PlanErrors) {
  const auto from = group({{"a", {7}}, {"b", {5, 3}}}, 1, 1, "p");
  EXPECT_HAS(error_of([&] {
               plan_reshard(from, 2, group({{"a", {7}}}, 1, 1, "p"), 3);
             }),
             "checkpoint parameter 'b' (partition 'p0') has no place in the target layout");
  EXPECT_HAS(error_of([&] {
               plan_reshard(from, 2, group({{"a", {7}}, {"b", {5, 3}}, {"z", {1}}}, 1, 1, "p"), 3);
             }),
             "target parameter 'z' (partition 'p0') is not in the checkpoint");
  EXPECT_HAS(error_of([&] {
               plan_reshard(from, 2, group({{"a", {7}}, {"b", {3, 5}}}, 1, 1, "p"), 3);
             }),
             "parameter 'b' is [5, 3] in the checkpoint and [3, 5] in the target layout");
  auto twice = from;
  twice.push_back(FlatLayout::pack("q", {{"a", {7}}}));
  EXPECT_HAS(error_of([&] { plan_reshard(twice, 2, from, 3); }), "parameter 'a' is in two partitions");
}

// A checkpoint at world n whose partitions hold buffer "master" (F32, values exact) and "step" (U32).
fs::path write_sharded(const CheckpointStore& store, std::int64_t step, int n, const std::vector<FlatLayout>& ls, const Params& ps) {
  CheckpointMeta m;
  m.world_size = n;
  m.stage = 3;
  m.strategy = "zero3-fp32";
  m.partitions = flat_layouts_to_json(ls);
  CheckpointSave s = store.begin(step, m);
  for (int r = 0; r < n; ++r) {
    std::vector<std::vector<float>> masters;
    std::vector<std::vector<std::uint32_t>> raws;
    std::vector<TensorView> views;
    for (const auto& l : ls) {
      raws.push_back(shard_of(full_buffer(l, n, ps), l.shard(n), r));
      masters.emplace_back(raws.back().begin(), raws.back().end());
    }
    for (std::size_t p = 0; p < ls.size(); ++p) {
      views.push_back(tensor_view(shard_tensor_name(ls[p].key, "master"), DType::F32, {ls[p].shard(n)}, masters[p]));
      views.push_back(tensor_view(shard_tensor_name(ls[p].key, "raw"), DType::U32, {ls[p].shard(n)}, raws[p]));
    }
    s.write_rank(r, views);
  }
  return s.commit();
}

TEST(Reshard, ThroughCheckpointFiles) {
  const Params ps = {{"embed", {13, 5}}, {"l0.w", {7, 3}}, {"l0.b", {7}}, {"l1.w", {3, 11}}, {"norm", {1}}};
  const auto from = group(ps, 2, 4, "bucket");
  const auto to = group(ps, 3, 2, "layer");
  for (int n = 1; n <= 4; ++n) {
    TempRoot root("reshard");
    CheckpointStore store(root.path);
    write_sharded(store, 10, n, from, ps);
    const CheckpointReader r = store.open_latest({.world_size = 4, .allow_reshard = true});
    const auto stored = flat_layouts_from_json(r.index().partitions, "index");
    for (int m = 1; m <= 4; ++m) {
      const ReshardPlan plan = plan_reshard(stored, r.world_size(), to, m);
      for (std::size_t tp = 0; tp < to.size(); ++tp) {
        const auto want = full_buffer(to[tp], m, ps);
        for (int t = 0; t < m; ++t) {
          const auto expect = shard_of(want, to[tp].shard(m), t);
          std::vector<std::uint32_t> got(expect.size(), 7);
          EXPECT_EQ(read_resharded(r, plan, tp, t, "raw", std::as_writable_bytes(std::span(got))), DType::U32);
          EXPECT_EQ(got, expect) << n << " -> " << m;
          std::vector<float> master(expect.size(), -1.f);
          read_resharded(r, plan, tp, t, "master", std::as_writable_bytes(std::span(master)));
          EXPECT_EQ(master, std::vector<float>(expect.begin(), expect.end()));
          // The same shard assembled from raw byte ranges of the rank files.
          std::vector<std::uint32_t> bytes(expect.size(), 7);
          for (const FileCopy& c : file_copies(r, plan, tp, t, "raw")) {
            auto* dst = reinterpret_cast<char*>(bytes.data()) + c.dst_offset;
            if (c.src_rank < 0) {
              std::memset(dst, 0, c.bytes);
              continue;
            }
            std::ifstream f(c.file, std::ios::binary);
            f.seekg(std::streamoff(c.file_offset));
            f.read(dst, std::streamsize(c.bytes));
            ASSERT_TRUE(bool(f));
          }
          EXPECT_EQ(bytes, expect);
        }
      }
    }
    const ReshardPlan plan = plan_reshard(stored, n, to, 2);
    std::vector<std::uint32_t> wrong(3);
    EXPECT_HAS(error_of([&] { read_resharded(r, plan, 0, 0, "raw", std::as_writable_bytes(std::span(wrong))); }),
               "the destination has 12 bytes");
    EXPECT_HAS(error_of([&] { read_resharded(r, plan, 0, 0, "m", std::as_writable_bytes(std::span(wrong))); }),
               "tensor 'bucket0/m' is missing");
    EXPECT_HAS(error_of([&] { read_resharded(r, plan_reshard(stored, n + 1, to, 2), 0, 0, "raw", {}); }), "the plan is from world");
  }
}

TEST(Consolidate, FullParametersPaddingDropped) {
  const Params ps = {{"embed", {13, 5}}, {"l0.w", {7, 3}}, {"l0.b", {7}}, {"l1.w", {3, 11}}, {"norm", {1}}};
  const auto ls = group(ps, 3, 8, "g");
  for (int n = 1; n <= 4; ++n) {
    TempRoot root("consolidate");
    CheckpointStore store(root.path);
    write_sharded(store, 3, n, ls, ps);
    const CheckpointReader r = store.open_latest();
    const auto layouts = flat_layouts_from_json(r.index().partitions, "index");
    const fs::path out = root / "model.safetensors";
    const WrittenFile wf = consolidate(r, layouts, out, {.buffer = "master", .metadata = {{"format", "pt"}}, .chunk_bytes = 16});
    EXPECT_EQ(wf.sha256, sha256_file(out));
    const auto sf = SafetensorsFile::open(out);  // the strict in-memory reader
    EXPECT_EQ(sf.tensors().size(), ps.size());
    EXPECT_EQ(sf.metadata().at("format"), "pt");
    std::int64_t total = 0;
    for (std::size_t p = 0; p < ps.size(); ++p) {
      const auto& [name, shape] = ps[p];
      EXPECT_EQ(sf.info(name).shape, shape);
      const auto got = sf.read<float>(name, DType::F32);
      ASSERT_EQ(std::int64_t(got.size()), numel(shape));
      for (std::int64_t j = 0; j < numel(shape); ++j) ASSERT_EQ(got[std::size_t(j)], float(value(p, j))) << name << "[" << j << "]";
      total += numel(shape);
    }
    EXPECT_EQ(std::uint64_t(total) * 4, wf.bytes - SafetensorsReader::open(out).data_offset());

    // bf16 output with renamed tensors
    const fs::path half = root / "model-bf16.safetensors";
    consolidate(r, layouts, half, {.buffer = "master", .dtype = DType::BF16, .rename = [](const std::string& s) { return "model." + s; }});
    const auto hf = SafetensorsFile::open(half);
    const auto got = hf.read<std::uint16_t>("model.l1.w", DType::BF16);
    for (std::int64_t j = 0; j < 33; ++j) {
      const squeeze::bf16 b = squeeze::from_float<squeeze::bf16>(float(value(3, j)));
      std::uint16_t bits;
      std::memcpy(&bits, &b, 2);
      ASSERT_EQ(got[std::size_t(j)], bits);
    }
    EXPECT_HAS(error_of([&] { consolidate(r, layouts, root / "x.safetensors", {.buffer = "raw", .dtype = DType::BF16}); }),
               "cannot convert U32 to BF16");
  }
}

}  // namespace
