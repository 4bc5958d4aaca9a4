// llm.c token shards: both widths round trip with odd sizes, corrupt headers and truncation named, windows
// sequential and shuffled (deterministic by seed, a permutation per epoch), ranks disjoint, vocab checks, and which
// files of a directory are a split's shards.
#include <gtest/gtest.h>

#include <fstream>
#include <numeric>
#include <set>
#include <squeeze/io/token_shards.hpp>

#include "io_test_util.hpp"

using namespace squeeze;
namespace fs = std::filesystem;
using io_test::expect_error;

namespace {

std::vector<std::int32_t> ramp(std::int32_t n, std::int32_t start = 0, std::int32_t mod = 1 << 30) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) v[std::size_t(i)] = (start + i) % mod;
  return v;
}
void poke_int32(const fs::path& p, std::size_t index, std::int32_t value) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(std::streamoff(index * 4));
  f.write(reinterpret_cast<const char*>(&value), 4);
}
std::vector<std::int32_t> header_ints(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::vector<std::int32_t> h(256);
  f.read(reinterpret_cast<char*>(h.data()), 1024);
  return h;
}
std::set<std::uint64_t> epoch_windows(const io::TokenDataset& d, std::uint64_t epoch) {
  std::set<std::uint64_t> s;
  for (std::uint64_t b = 0; b < d.batches_per_epoch(); ++b)
    for (auto w : d.window_ids(epoch * d.batches_per_epoch() + b)) EXPECT_TRUE(s.insert(w).second) << "window " << w << " twice";
  return s;
}

}  // namespace

TEST(TokenShards, BothWidthsRoundTripWithOddSizes) {
  io_test::TempDir dir("rt");
  const auto a = ramp(1001, 0, 65536);  // uint16: ids up to 65535
  const auto b = ramp(777, 65530);      // uint32: ids past 65535
  io::write_token_shard(dir.path / "a.bin", a, io::TokenWidth::U16);
  io::write_token_shard(dir.path / "b.bin", b, io::TokenWidth::U32);
  EXPECT_FALSE(fs::exists(dir.path / "a.bin.tmp"));
  EXPECT_EQ(fs::file_size(dir.path / "a.bin"), 1024u + 2 * 1001);
  EXPECT_EQ(fs::file_size(dir.path / "b.bin"), 1024u + 4 * 777);
  // llm.c's header: magic, version, count, then zeros
  auto h = header_ints(dir.path / "a.bin");
  EXPECT_EQ(h[0], 20240520);
  EXPECT_EQ(h[1], 1);
  EXPECT_EQ(h[2], 1001);
  EXPECT_TRUE(std::all_of(h.begin() + 3, h.end(), [](int x) { return x == 0; }));
  h = header_ints(dir.path / "b.bin");
  EXPECT_EQ(h[0], 20240801);
  EXPECT_EQ(h[1], 7);
  EXPECT_EQ(h[2], 777);

  const auto sa = io::TokenShard::open(dir.path / "a.bin");
  const auto sb = io::TokenShard::open(dir.path / "b.bin");
  EXPECT_EQ(sa.width(), io::TokenWidth::U16);
  EXPECT_EQ(sb.width(), io::TokenWidth::U32);
  ASSERT_EQ(sa.size(), 1001u);
  ASSERT_EQ(sb.size(), 777u);
  std::vector<std::int32_t> ra(1001), rb(777);
  sa.copy(0, ra);
  sb.copy(0, rb);
  EXPECT_EQ(ra, a);
  EXPECT_EQ(rb, b);
  EXPECT_EQ(sb[776], 65530u + 776);
  EXPECT_EQ(io::token_width_for(32000), io::TokenWidth::U16);
  EXPECT_EQ(io::token_width_for(65536), io::TokenWidth::U16);
  EXPECT_EQ(io::token_width_for(128256), io::TokenWidth::U32);
  // empty shards are valid files
  io::write_token_shard(dir.path / "e.bin", std::vector<std::int32_t>{}, io::TokenWidth::U16);
  EXPECT_EQ(io::TokenShard::open(dir.path / "e.bin").size(), 0u);
}

TEST(TokenShards, WriterInPiecesAndItsChecks) {
  io_test::TempDir dir("writer");
  {
    io::TokenShardWriter w(dir.path / "p.bin", io::TokenWidth::U16);
    w.append(ramp(10));
    w.append(std::vector<std::uint32_t>{5, 6, 7});
    EXPECT_EQ(w.count(), 13u);
    expect_error([&] { w.append(std::vector<std::int32_t>{1, 65536}); }, {"token 65536", "position 14", "uint16"});
    expect_error([&] { w.append(std::vector<std::int64_t>{-1}); }, {"token -1"});
    w.close();
    expect_error([&] { w.close(); }, {"already closed"});
  }
  const auto s = io::TokenShard::open(dir.path / "p.bin");
  EXPECT_EQ(s.size(), 13u);
  EXPECT_EQ(s[12], 7u);
  {
    io::TokenShardWriter w(dir.path / "abandoned.bin", io::TokenWidth::U32);
    w.append(ramp(4));
  }
  EXPECT_FALSE(fs::exists(dir.path / "abandoned.bin"));
  EXPECT_FALSE(fs::exists(dir.path / "abandoned.bin.tmp"));
}

TEST(TokenShards, CorruptHeadersAndTruncationAreNamed) {
  io_test::TempDir dir("bad");
  const auto p = dir.path / "s.bin";
  auto fresh = [&] { io::write_token_shard(p, ramp(100), io::TokenWidth::U16); };
  auto open = [&] { io::TokenShard::open(p); };
  fresh();
  poke_int32(p, 0, 12345);
  expect_error(open, {p.string(), "bad magic 12345", "20240520", "20240801"});
  fresh();
  poke_int32(p, 1, 2);
  expect_error(open, {p.string(), "version 1", "says 2"});
  fresh();
  poke_int32(p, 0, 20240801);  // uint32 magic with the uint16 version
  expect_error(open, {"needs version 7"});
  fresh();
  fs::resize_file(p, 1024 + 150);
  expect_error(open, {p.string(), "promises 100 tokens", "truncated"});
  fresh();
  fs::resize_file(p, 1024 + 202);
  expect_error(open, {p.string(), "2 bytes after"});
  fresh();
  poke_int32(p, 2, -5);
  expect_error(open, {"negative token count"});
  fresh();
  fs::resize_file(p, 100);
  expect_error(open, {p.string(), "shorter than the 1024-byte header"});
  expect_error([&] { io::TokenShard::open(dir.path / "absent.bin"); }, {"cannot open", "absent.bin"});
}

TEST(TokenDataset, SequentialWindowsAreContiguous) {
  io_test::TempDir dir("seq");
  io::write_token_shard(dir.path / "a.bin", ramp(1000), io::TokenWidth::U16);
  const std::int64_t B = 3, T = 16;
  io::TokenDataset d({dir.path / "a.bin"}, {.batch = B, .seq = T, .shuffle = false});
  EXPECT_EQ(d.windows(), (1000u - 1) / 16);  // 62 windows of 17 tokens, each starting T after the last
  EXPECT_EQ(d.batches_per_epoch(), 62u / 3);
  const auto b0 = d.batch(0);
  ASSERT_EQ(b0.size(), std::size_t(B * (T + 1)));
  for (std::int64_t r = 0; r < B; ++r)
    for (std::int64_t t = 0; t <= T; ++t) EXPECT_EQ(b0[std::size_t(r * (T + 1) + t)], r * T + t);  // inputs and next-token targets
  const auto b1 = d.batch(1);
  EXPECT_EQ(b1[0], 3 * T);
  // the last window of the shard ends exactly at its last token or before
  const auto ids = d.window_ids(d.batches_per_epoch() - 1);
  EXPECT_LE((ids.back() + 1) * T + 1, 1000u);
  // next() / seek()
  EXPECT_EQ(d.next(), b0);
  EXPECT_EQ(d.next(), b1);
  EXPECT_EQ(d.step(), 2u);
  d.seek(0);
  EXPECT_EQ(d.next(), b0);
}

TEST(TokenDataset, ShuffledIsDeterministicAndAPermutationPerEpoch) {
  io_test::TempDir dir("shuf");
  io::write_token_shard(dir.path / "a.bin", ramp(5003), io::TokenWidth::U16);
  const io::TokenDatasetOptions o{.batch = 4, .seq = 8, .seed = 42};
  io::TokenDataset d({dir.path / "a.bin"}, o), same({dir.path / "a.bin"}, o);
  auto o2 = o;
  o2.seed = 43;
  io::TokenDataset other({dir.path / "a.bin"}, o2);
  EXPECT_EQ(d.batch(5), same.batch(5));
  EXPECT_NE(d.batch(5), other.batch(5));
  const auto e0 = epoch_windows(d, 0), e1 = epoch_windows(d, 1);
  EXPECT_EQ(e0.size(), d.batches_per_epoch() * 4);
  EXPECT_EQ(e1.size(), e0.size());
  EXPECT_LT(*e0.rbegin(), d.windows());
  EXPECT_NE(d.window_ids(0), d.window_ids(d.batches_per_epoch()));  // a new order each epoch
  // windows are still whole, contiguous runs of the file
  const auto b = d.batch(3);
  for (std::size_t r = 0; r < 4; ++r)
    for (std::size_t t = 1; t <= 8; ++t) EXPECT_EQ(b[r * 9 + t], b[r * 9 + t - 1] + 1);
  // not the file order
  const auto ids = d.window_ids(0);
  EXPECT_FALSE(ids[0] == 0 && ids[1] == 1 && ids[2] == 2 && ids[3] == 3);
}

TEST(TokenDataset, RanksSeeDisjointWindows) {
  io_test::TempDir dir("ranks");
  io::write_token_shard(dir.path / "a.bin", ramp(4099), io::TokenWidth::U32);
  io::write_token_shard(dir.path / "b.bin", ramp(3001), io::TokenWidth::U16);
  for (bool shuffle : {false, true}) {
    SCOPED_TRACE(shuffle ? "shuffled" : "sequential");
    const std::int64_t world = 4;
    std::set<std::uint64_t> all;
    std::uint64_t per_rank = 0;
    for (std::int64_t r = 0; r < world; ++r) {
      io::TokenDataset d({dir.path / "a.bin", dir.path / "b.bin"},
                         {.batch = 5, .seq = 32, .shuffle = shuffle, .seed = 9, .rank = r, .world = world});
      if (r == 0) per_rank = d.batches_per_epoch();
      EXPECT_EQ(d.batches_per_epoch(), per_rank);  // ranks stay in lockstep
      for (auto w : epoch_windows(d, 0)) EXPECT_TRUE(all.insert(w).second) << "window " << w << " on two ranks";
    }
    EXPECT_EQ(all.size(), per_rank * 5 * world);
  }
  expect_error([&] { io::TokenDataset({dir.path / "a.bin"}, {.rank = 4, .world = 4}); }, {"rank 4"});
}

TEST(TokenDataset, WindowsStayInsideOneShard) {
  io_test::TempDir dir("multi");
  io::write_token_shard(dir.path / "a.bin", ramp(301, 0), io::TokenWidth::U16);
  io::write_token_shard(dir.path / "b.bin", ramp(10, 0), io::TokenWidth::U16);  // shorter than a window: no windows
  io::write_token_shard(dir.path / "c.bin", ramp(257, 50000), io::TokenWidth::U16);
  io::TokenDataset d({dir.path / "a.bin", dir.path / "b.bin", dir.path / "c.bin"}, {.batch = 2, .seq = 16, .seed = 1});
  EXPECT_EQ(d.windows(), 300u / 16 + 0 + 256u / 16);
  for (std::uint64_t s = 0; s < d.batches_per_epoch(); ++s) {
    const auto b = d.batch(s);
    for (std::size_t r = 0; r < 2; ++r) {
      const bool from_c = b[r * 17] >= 50000;
      for (std::size_t t = 1; t < 17; ++t) {
        EXPECT_EQ(b[r * 17 + t] >= 50000, from_c);
        EXPECT_EQ(b[r * 17 + t], b[r * 17 + t - 1] + 1);
      }
    }
  }
}

TEST(TokenDataset, VocabularyAndSizeChecks) {
  io_test::TempDir dir("vocab");
  auto t = ramp(200);
  t[150] = 32000;
  io::write_token_shard(dir.path / "a.bin", t, io::TokenWidth::U16);
  io::TokenDataset d({dir.path / "a.bin"}, {.batch = 1, .seq = 10, .vocab = 32000, .shuffle = false});
  EXPECT_NO_THROW(d.batch(0));
  expect_error([&] { d.batch(14); }, {"a.bin", "token 32000", "position 150", "vocabulary of 32000"});  // window 14: tokens 140..150
  expect_error([&] { d.shard(0).check_vocab(32000); }, {"position 150"});
  EXPECT_NO_THROW(d.shard(0).check_vocab(32001));
  expect_error([&] { io::TokenDataset({dir.path / "a.bin"}, {.batch = 8, .seq = 100, .world = 2}); },
               {"1 windows of 101 tokens", "batch of 8", "2 rank(s)"});
  expect_error([&] { io::TokenDataset({}, {}); }, {"no shard"});
}

TEST(TokenDataset, IndexPermutationIsABijection) {
  for (std::uint64_t n : {1ull, 2ull, 3ull, 17ull, 1000ull, 4097ull, 65536ull}) {
    const io::detail::IndexPermutation p(n, 1234567);
    std::vector<std::uint64_t> out(n);
    for (std::uint64_t i = 0; i < n; ++i) out[i] = p(i);
    std::sort(out.begin(), out.end());
    for (std::uint64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], i) << "n = " << n;
  }
}

TEST(TokenShards, SplitFilesFollowLlmcNaming) {
  io_test::TempDir dir("names");
  for (const char* n : {"train_000001.bin", "train_000000.bin", "fineweb_train_000002.bin", "tiny_shakespeare_val.bin", "val_000000.bin",
                        "trainer_000000.bin", "train_000000.bin.tmp", "retrain.bin", "val.txt"})
    std::ofstream(dir.path / n) << "x";
  fs::create_directory(dir.path / "train_dir.bin");
  std::vector<std::string> train, val;
  for (const auto& p : io::token_shard_files(dir.path, "train")) train.push_back(p.filename().string());
  for (const auto& p : io::token_shard_files(dir.path, "val")) val.push_back(p.filename().string());
  EXPECT_EQ(train, (std::vector<std::string>{"fineweb_train_000002.bin", "train_000000.bin", "train_000001.bin"}));
  EXPECT_EQ(val, (std::vector<std::string>{"tiny_shakespeare_val.bin", "val_000000.bin"}));
  expect_error([&] { io::token_shard_files(dir.path / "missing", "train"); }, {"missing", "not a directory"});
}
