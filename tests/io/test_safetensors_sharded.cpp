// Sharded safetensors: write -> read round trips with sizes that do not divide, streaming reads (one tensor or
// a byte range at a time, nothing read on open), the float conversions, and every bad input named.
#include <gtest/gtest.h>

#include <fstream>
#include <numeric>
#include <random>
#include <squeeze/io/safetensors_sharded.hpp>

#include "io_test_util.hpp"

using namespace squeeze;
namespace fs = std::filesystem;
using io_test::expect_error;

namespace {

struct Tensor {
  io::TensorSpec spec;
  std::vector<std::byte> bytes;
};

// Tensors of awkward sizes and mixed dtypes, bytes from a seeded generator.
std::vector<Tensor> sample_tensors() {
  std::vector<Tensor> out;
  std::mt19937 rng(7);
  auto add = [&](std::string name, io::DType d, std::vector<std::int64_t> shape) {
    std::size_t n = io::dtype_size(d);
    for (auto s : shape) n *= std::size_t(s);
    std::vector<std::byte> b(n);
    for (auto& x : b) x = std::byte(rng() & 0xff);
    out.push_back({{std::move(name), d, std::move(shape)}, std::move(b)});
  };
  add("model.embed_tokens.weight", io::DType::BF16, {37, 6});
  add("model.layers.0.self_attn.q_proj.weight", io::DType::F32, {6, 6});
  add("model.layers.0.input_layernorm.weight", io::DType::F16, {6});
  add("model.layers.0.mlp.up_proj.weight", io::DType::F32, {11, 6});
  add("empty", io::DType::U8, {0, 4});
  add("scalar", io::DType::F32, {});
  add("ints", io::DType::I32, {13});
  add("model.norm.weight", io::DType::BF16, {6});
  add("lm_head.weight", io::DType::BF16, {37, 6});
  return out;
}

std::vector<io::TensorSpec> specs_of(const std::vector<Tensor>& ts) {
  std::vector<io::TensorSpec> s;
  for (const auto& t : ts) s.push_back(t.spec);
  return s;
}

void write_all(const fs::path& dir, const std::vector<Tensor>& ts, std::uint64_t max_bytes) {
  io::ShardedSafetensorsWriter w(dir, specs_of(ts), max_bytes);
  for (auto it = ts.rbegin(); it != ts.rend(); ++it) w.write(it->spec.name, it->bytes);  // any order
  w.finish();
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}
void write_text(const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::trunc) << s; }
// A raw safetensors file: declared header length, header text, data bytes.
void write_raw(const fs::path& p, const std::string& header, std::size_t data_bytes, std::uint64_t declared = ~0ull) {
  const std::uint64_t n = declared == ~0ull ? header.size() : declared;
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  for (int i = 0; i < 8; ++i) f.put(char((n >> (8 * i)) & 0xff));
  f << header << std::string(data_bytes, '\x11');
}
std::size_t rss_bytes() {
  std::ifstream in("/proc/self/statm");
  std::size_t pages = 0, resident = 0;
  in >> pages >> resident;
  return resident * std::size_t(::sysconf(_SC_PAGESIZE));
}

}  // namespace

TEST(ShardedSafetensors, RoundTripWithSizesThatDoNotDivide) {
  const auto ts = sample_tensors();
  for (std::uint64_t limit : {0ull, 300ull, 777ull, 1ull}) {
    SCOPED_TRACE("max_shard_bytes " + std::to_string(limit));
    io_test::TempDir dir("rt" + std::to_string(limit));
    write_all(dir.path, ts, limit);
    const auto c = io::SafetensorsCheckpoint::open(dir.path);
    ASSERT_EQ(c.tensors().size(), ts.size());
    for (const auto& t : ts) {
      const auto& info = c.info(t.spec.name);
      EXPECT_EQ(info.dtype, t.spec.dtype);
      EXPECT_EQ(info.shape, t.spec.shape);
      EXPECT_EQ(c.read_bytes(t.spec.name), t.bytes) << t.spec.name;
    }
    std::uint64_t total = 0;
    for (const auto& t : ts) total += t.bytes.size();
    EXPECT_EQ(c.total_bytes(), total);
    if (limit == 0) {
      EXPECT_FALSE(c.sharded());
      EXPECT_TRUE(fs::exists(dir.path / "model.safetensors"));
      EXPECT_FALSE(fs::exists(dir.path / "model.safetensors.index.json"));
      continue;
    }
    EXPECT_TRUE(c.sharded());
    EXPECT_FALSE(fs::exists(dir.path / "model.safetensors"));
    const auto idx = read_json(dir.path / "model.safetensors.index.json");
    EXPECT_EQ(idx["metadata"]["total_size"].get<std::uint64_t>(), total);
    EXPECT_EQ(c.index_total_size(), total);
    EXPECT_EQ(idx["weight_map"].size(), ts.size());
    const std::size_t n = c.files().size();
    EXPECT_GT(n, 1u);
    if (limit == 1) EXPECT_EQ(n, ts.size());  // every tensor alone, each over the limit
    for (std::size_t k = 0; k < n; ++k) {
      char want[64];
      std::snprintf(want, sizeof want, "model-%05zu-of-%05zu.safetensors", k + 1, n);
      const auto path = dir.path / want;
      ASSERT_TRUE(fs::exists(path)) << want;
      // each file within the limit unless it holds a single tensor too large for any file
      const auto f = io::SafetensorsFile::open(path);
      if (f.tensors().size() > 1) EXPECT_LE(fs::file_size(path), limit) << want;
      // transformers' format checks: "pt" metadata, and data packed from offset 0 without a gap to the end
      EXPECT_EQ(f.metadata().at("format"), "pt");
      std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
      for (const auto& [_, t] : f.tensors()) spans.emplace_back(t.begin, t.end);
      std::sort(spans.begin(), spans.end());
      std::uint64_t at = 0;
      for (auto [b, e] : spans) {
        EXPECT_EQ(b, at);
        at = e;
      }
      const auto r = io::SafetensorsReader::open(path);
      EXPECT_EQ(r.data_offset() % 8, 0u);
      EXPECT_EQ(r.data_offset() + at, fs::file_size(path));
    }
    // tensors fill the files in the order given
    std::size_t last = 0;
    for (const auto& t : ts) {
      const std::size_t k = std::size_t(std::find(c.files().begin(), c.files().end(), c.info(t.spec.name).file) - c.files().begin());
      EXPECT_GE(k, last);
      last = k;
    }
  }
}

TEST(ShardedSafetensors, TensorsWrittenInPieces) {
  io_test::TempDir dir("pieces");
  const auto ts = sample_tensors();
  {
    io::ShardedSafetensorsWriter w(dir.path, specs_of(ts), 400);
    for (const auto& t : ts) {
      const std::span<const std::byte> b(t.bytes);
      for (std::size_t at = 0; at < b.size(); at += 5) w.append(t.spec.name, b.subspan(at, std::min<std::size_t>(5, b.size() - at)));
    }
    expect_error([&] { w.append(ts[0].spec.name, std::span(ts[0].bytes).first(1)); }, {ts[0].spec.name, "bytes written"});
    w.finish();
    expect_error([&] { w.finish(); }, {"already finished"});
  }
  const auto c = io::SafetensorsCheckpoint::open(dir.path);
  for (const auto& t : ts) EXPECT_EQ(c.read_bytes(t.spec.name), t.bytes) << t.spec.name;
}

TEST(ShardedSafetensors, WriterChecksAndLeavesNothingBehindWhenAbandoned) {
  io_test::TempDir dir("writer");
  const auto ts = sample_tensors();
  {
    io::ShardedSafetensorsWriter w(dir.path, specs_of(ts), 300);
    EXPECT_GT(w.shard_count(), 1u);
    w.write(ts[0].spec.name, ts[0].bytes);
    expect_error([&] { w.write(ts[0].spec.name, ts[0].bytes); }, {"already written", ts[0].spec.name});
    expect_error([&] { w.write(ts[1].spec.name, std::span(ts[1].bytes).first(3)); }, {ts[1].spec.name, "needs 144 bytes"});
    expect_error([&] { w.write("nope", ts[1].bytes); }, {"'nope'", "not among"});
    const std::vector<float> wrong(36);
    expect_error([&] { w.write(ts[1].spec.name, io::tensor_ref<float>(io::DType::F32, {36}, wrong)); }, {"planned as F32 [6, 6]", "[36]"});
    expect_error([&] { w.finish(); }, {"not (fully) written", ts[1].spec.name});
    bool any_tmp = false;
    for (const auto& e : fs::directory_iterator(dir.path)) any_tmp |= e.path().extension() == ".tmp";
    EXPECT_TRUE(any_tmp);
  }
  EXPECT_TRUE(fs::is_empty(dir.path));  // abandoned: its temporary files are gone, nothing else was written
  auto dup = specs_of(ts);
  dup.push_back(dup[0]);
  expect_error([&] { io::ShardedSafetensorsWriter(dir.path, dup, 0); }, {"listed twice", dup[0].name});
  expect_error([&] { io::ShardedSafetensorsWriter(dir.path, {{"__metadata__", io::DType::F32, {1}}}, 0); }, {"invalid tensor name"});
}

TEST(ShardedSafetensors, RewritingADirectoryReplacesTheOldCheckpoint) {
  io_test::TempDir dir("rewrite");
  const auto ts = sample_tensors();
  write_all(dir.path, ts, 0);    // model.safetensors
  write_all(dir.path, ts, 300);  // sharded: the single file must go, or readers would load it first
  EXPECT_FALSE(fs::exists(dir.path / "model.safetensors"));
  EXPECT_TRUE(io::SafetensorsCheckpoint::open(dir.path).sharded());
  write_all(dir.path, ts, 0);  // single again: the index goes
  EXPECT_FALSE(fs::exists(dir.path / "model.safetensors.index.json"));
  EXPECT_FALSE(io::SafetensorsCheckpoint::open(dir.path).sharded());
}

TEST(ShardedSafetensors, StreamsOneTensorAtATime) {
  io_test::TempDir dir("stream");
  // a 48 MiB tensor next to small ones
  const std::int64_t rows = 3 * 1024, cols = 4096;
  std::vector<io::TensorSpec> specs = {
      {"small", io::DType::F32, {4}}, {"big", io::DType::F32, {rows, cols}}, {"tail", io::DType::BF16, {3}}};
  {
    io::ShardedSafetensorsWriter w(dir.path, specs, 1 << 20);
    const std::vector<float> small = {1, 2, 3, 4};
    w.write("small", io::tensor_ref<float>(io::DType::F32, {4}, small));
    std::vector<float> row(static_cast<std::size_t>(cols));
    for (std::int64_t r = 0; r < rows; ++r) {  // one row at a time: the writer never needs the whole tensor
      std::iota(row.begin(), row.end(), float(r * cols));
      w.append("big", std::as_bytes(std::span(row)));
    }
    w.write("tail", io::encode_float(io::DType::BF16, std::vector<float>{0.5f, -2.f, 8.f}));
    w.finish();
  }
  const std::size_t before = rss_bytes();
  const auto c = io::SafetensorsCheckpoint::open(dir.path);
  EXPECT_LT(rss_bytes(), before + (8u << 20)) << "opening read tensor data";
  EXPECT_EQ(c.files().size(), 3u);
  EXPECT_EQ(c.read<float>("small", io::DType::F32), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(c.read_float("tail"), (std::vector<float>{0.5f, -2.f, 8.f}));
  // one row of the big tensor: a byte range, read alone
  std::vector<float> row(static_cast<std::size_t>(cols));
  const std::int64_t r = 2001;
  c.read_bytes("big", std::as_writable_bytes(std::span(row)), std::uint64_t(r * cols) * 4);
  EXPECT_EQ(row.front(), float(r * cols));
  EXPECT_EQ(row.back(), float(r * cols + cols - 1));
  expect_error([&] { c.read_bytes("big", std::as_writable_bytes(std::span(row)), std::uint64_t(rows * cols) * 4 - 8); },
               {"'big'", "requested"});
  // data is read when asked for, not cached at open: overwrite "small" on disk and read again
  const auto& sh = c.shard_of("small");
  {
    std::fstream f(sh.path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(sh.data_offset() + sh.info("small").begin));
    const float nine = 9.f;
    f.write(reinterpret_cast<const char*>(&nine), 4);
  }
  EXPECT_EQ(c.read<float>("small", io::DType::F32)[0], 9.f);
  expect_error([&] { c.read<float>("tail", io::DType::F32); }, {"'tail'", "BF16", "expected F32"});
  expect_error([&] { c.info("absent"); }, {"tensor 'absent' is missing"});
}

TEST(ShardedSafetensors, FloatConversions) {
  const std::vector<float> v = {0.f, 1.f, -1.5f, 3.140625f, 65504.f, 1e-3f};
  for (auto d : {io::DType::F32, io::DType::F16, io::DType::BF16}) {
    const auto back = io::decode_float(d, io::encode_float(d, v));
    ASSERT_EQ(back.size(), v.size());
    const float tol = d == io::DType::F32 ? 0.f : d == io::DType::F16 ? 1e-3f : 8e-3f;
    for (std::size_t i = 0; i < v.size(); ++i) EXPECT_NEAR(back[i], v[i], tol * std::abs(v[i])) << io::dtype_name(d) << " " << v[i];
  }
  // bf16 rounds to nearest even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 and goes to 1
  EXPECT_EQ(io::decode_float(io::DType::BF16, io::encode_float(io::DType::BF16, std::vector<float>{1.f + 1.f / 256}))[0], 1.f);
  const std::vector<double> d = {2.5, -0.25};
  EXPECT_EQ(io::decode_float(io::DType::F64, std::as_bytes(std::span(d))), (std::vector<float>{2.5f, -0.25f}));
  expect_error([] { io::decode_float(io::DType::I32, {}); }, {"I32", "not a floating-point"});
  expect_error([] { io::encode_float(io::DType::F64, {}); }, {"F64"});
}

TEST(ShardedSafetensors, BadDirectoriesAndIndexes) {
  io_test::TempDir dir("badidx");
  const auto ts = sample_tensors();
  const auto& p = dir.path;
  expect_error([&] { io::SafetensorsCheckpoint::open(p); }, {"model.safetensors", "model.safetensors.index.json", p.string()});
  expect_error([&] { io::SafetensorsCheckpoint::open(p / "nope"); }, {"not a directory"});

  write_all(p, ts, 300);
  const auto idx_path = p / "model.safetensors.index.json";
  const auto good = read_json(idx_path);
  auto with = [&](const nlohmann::json& j) { write_text(idx_path, j.dump()); };
  auto open = [&] { io::SafetensorsCheckpoint::open(p); };
  const std::string first = ts[0].spec.name;
  const std::string shard1 = good["weight_map"][first];
  const std::string n = shard1.substr(shard1.size() - std::string("00003.safetensors").size(), 5);  // the series' total

  // a tensor that shares its shard with others (so the shard stays in the index when it is moved)
  std::map<std::string, int> per_file;
  for (const auto& [k, v] : good["weight_map"].items()) ++per_file[v.get<std::string>()];
  std::string shared, shared_file;
  for (const auto& [k, v] : good["weight_map"].items())
    if (per_file[v.get<std::string>()] > 1) shared = k, shared_file = v.get<std::string>();
  ASSERT_FALSE(shared.empty());
  // the index names a file that does not exist
  auto j = good;
  j["weight_map"][shared] = "elsewhere.safetensors";
  with(j);
  expect_error(open, {"shard 'elsewhere.safetensors'", "'" + shared + "'", "does not exist"});
  // a shard of the series is never named (its tensors are missing from the index)
  j = good;
  const std::string second = "model-00002-of-" + n + ".safetensors";
  for (auto& [k, v] : j["weight_map"].items())
    if (v == second) v = shard1;
  with(j);
  expect_error(open, {second, "missing shard"});
  // a shard file deleted
  with(good);
  fs::rename(p / second, p / "moved");
  expect_error(open, {"shard '" + second + "'", "does not exist"});
  fs::rename(p / "moved", p / second);
  // the index maps a tensor to a shard that does not hold it
  const std::string other = shared_file == shard1 ? second : shard1;
  j = good;
  j["weight_map"][shared] = other;
  with(j);
  expect_error(open, {"'" + shared + "'", "mapped to shard '" + other + "'", "stored in shard '" + shared_file + "'"});
  // a tensor the index does not list
  j = good;
  j["weight_map"].erase(shared);
  with(j);
  expect_error(open, {shared_file, "'" + shared + "'", "does not list"});
  // the index lists a tensor no shard holds
  j = good;
  j["weight_map"]["ghost"] = shard1;
  with(j);
  expect_error(open, {"'ghost'", shard1, "no such tensor"});
  // paths outside the directory, malformed JSON and types
  j = good;
  j["weight_map"][first] = "../" + shard1;
  with(j);
  expect_error(open, {"not a file name", first});
  write_text(idx_path, "{\"weight_map\": ");
  expect_error(open, {idx_path.string(), "not valid JSON"});
  with({{"metadata", {{"total_size", 1}}}});
  expect_error(open, {"missing object 'weight_map'"});
  with({{"weight_map", nlohmann::json::object()}});
  expect_error(open, {"lists no tensors"});
  j = good;
  j["weight_map"][first] = 3;
  with(j);
  expect_error(open, {"'" + first + "'", "not a string"});
  j = good;
  j["metadata"]["total_size"] = "big";
  with(j);
  expect_error(open, {"total_size"});
}

TEST(ShardedSafetensors, IndexMetadataAsTransformers5WritesIt) {
  io_test::TempDir dir("tf5");
  const auto ts = sample_tensors();
  write_all(dir.path, ts, 300);
  auto idx = read_json(dir.path / "model.safetensors.index.json");
  idx["metadata"]["total_parameters"] = 1234;  // transformers 5 adds it; nothing to check against
  write_text(dir.path / "model.safetensors.index.json", idx.dump());
  EXPECT_EQ(io::SafetensorsCheckpoint::open(dir.path).tensors().size(), ts.size());
}

TEST(ShardedSafetensors, TensorInTwoShards) {
  io_test::TempDir dir("twice");
  const std::vector<float> a = {1, 2}, b = {3};
  io::save_safetensors(dir.path / "model-00001-of-00002.safetensors",
                       {{"a", io::tensor_ref<float>(io::DType::F32, {2}, a)}, {"b", io::tensor_ref<float>(io::DType::F32, {1}, b)}});
  io::save_safetensors(dir.path / "model-00002-of-00002.safetensors", {{"a", io::tensor_ref<float>(io::DType::F32, {2}, a)}});
  write_text(
      dir.path / "model.safetensors.index.json",
      R"({"metadata": {"total_size": 12}, "weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}})");
  expect_error([&] { io::SafetensorsCheckpoint::open(dir.path); },
               {"'a'", "two shards", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"});
}

// The format disallows duplicate keys and its reference reader refuses them; nlohmann::json alone would keep the last
// one. Every way in (SafetensorsFile, SafetensorsReader, a checkpoint directory and its index) names the key.
TEST(ShardedSafetensors, DuplicateKeysAreRefused) {
  io_test::TempDir dir("dupkeys");
  const auto& p = dir.path;
  const auto file = p / "model.safetensors";
  // "a" twice with different bytes: which one loads would depend on the JSON library
  write_raw(file,
            R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},)"
            R"( "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
            8);
  expect_error([&] { io::SafetensorsReader::open(file); }, {file.string(), "duplicate key 'a'"});
  expect_error([&] { io::SafetensorsFile::open(file); }, {file.string(), "duplicate key 'a'"});
  expect_error([&] { io::SafetensorsCheckpoint::open(p); }, {file.string(), "duplicate key 'a'"});
  // inside a tensor's entry and inside __metadata__
  write_raw(file, R"({"w": {"dtype": "F32", "shape": [1], "dtype": "I32", "data_offsets": [0, 4]}})", 4);
  expect_error([&] { io::SafetensorsReader::open(file); }, {"duplicate key 'dtype' in 'w'"});
  write_raw(file, R"({"__metadata__": {"format": "pt", "format": "np"}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 4);
  expect_error([&] { io::SafetensorsReader::open(file); }, {"duplicate key 'format' in '__metadata__'"});
  // the same key in two different objects is no duplicate
  write_raw(file,
            R"({"v": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
            8);
  EXPECT_EQ(io::SafetensorsReader::open(file).tensors().size(), 2u);
  fs::remove(file);

  // an index mapping one tensor to two shards
  const std::vector<float> a = {1, 2}, b = {3};
  io::save_safetensors(p / "model-00001-of-00002.safetensors", {{"a", io::tensor_ref<float>(io::DType::F32, {2}, a)}});
  io::save_safetensors(p / "model-00002-of-00002.safetensors", {{"b", io::tensor_ref<float>(io::DType::F32, {1}, b)}});
  const auto idx = p / "model.safetensors.index.json";
  write_text(idx, R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors", )"
                  R"("a": "model-00002-of-00002.safetensors"}})");
  expect_error([&] { io::SafetensorsCheckpoint::open(p); }, {idx.string(), "duplicate key 'a' in 'weight_map'"});
  write_text(idx, R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})");
  EXPECT_EQ(io::SafetensorsCheckpoint::open(p).tensors().size(), 2u);
}

TEST(ShardedSafetensors, BadShardFiles) {
  io_test::TempDir dir("badshard");
  const auto& p = dir.path;
  auto open1 = [&] { io::SafetensorsCheckpoint::open(p); };
  const auto file = p / "model.safetensors";
  // header length beyond the format's limit, and beyond the file
  write_raw(file, "{}", 0, 200ull << 20);
  expect_error(open1, {file.string(), "exceeds the 100 MiB limit"});
  write_raw(file, "{}", 0, 4096);
  expect_error(open1, {file.string(), "runs past the end of the file"});
  write_raw(file, "", 0, 0);
  fs::resize_file(file, 5);
  expect_error(open1, {file.string(), "shorter than the 8-byte header length"});
  // unknown dtype
  write_raw(file, R"({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}})", 2);
  expect_error(open1, {file.string(), "tensor 'w'", "unknown dtype 'Q4'"});
  // truncated file: the last tensor's bytes run past the end
  const std::vector<float> a(10, 1.f), b(10, 2.f);
  io::save_safetensors(file,
                       {{"a", io::tensor_ref<float>(io::DType::F32, {10}, a)}, {"b", io::tensor_ref<float>(io::DType::F32, {10}, b)}});
  fs::resize_file(file, fs::file_size(file) - 6);
  expect_error(open1, {file.string(), "tensor 'b'", "past the data section"});
  // truncated after opening: the read names the tensor
  io::save_safetensors(file,
                       {{"a", io::tensor_ref<float>(io::DType::F32, {10}, a)}, {"b", io::tensor_ref<float>(io::DType::F32, {10}, b)}});
  const auto c = io::SafetensorsCheckpoint::open(p);
  fs::resize_file(file, fs::file_size(file) - 6);
  expect_error([&] { c.read_bytes("b"); }, {file.string(), "tensor 'b'", "file ended"});
  EXPECT_EQ(c.read<float>("a", io::DType::F32), a);
  expect_error([&] { io::SafetensorsCheckpoint::open_file(p / "absent.safetensors"); }, {"cannot open", "absent.safetensors"});
  // a truncated shard of a sharded checkpoint is named with its tensor
  io_test::TempDir d2("badshard2");
  write_all(d2.path, sample_tensors(), 300);
  const auto shard = d2.path / io::SafetensorsCheckpoint::open(d2.path).files().at(1);
  fs::resize_file(shard, fs::file_size(shard) - 1);
  expect_error([&] { io::SafetensorsCheckpoint::open(d2.path); }, {shard.string(), "tensor '", "past the data section"});
}
