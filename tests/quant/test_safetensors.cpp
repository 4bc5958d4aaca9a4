// safetensors round trip and hostile/corrupt headers; packed GPTQ checkpoints round trip and mismatches.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <squeeze/io/posix_file.hpp>
#include <squeeze/io/safetensors.hpp>
#include <squeeze/io/gptq_file.hpp>
#include <squeeze/quant/rtn.hpp>

using namespace squeeze;
namespace fs = std::filesystem;

namespace {
fs::path temp_dir(const std::string& name) {
  auto d = fs::temp_directory_path() / ("squeeze_quant_" + name + "_" + std::to_string(::getpid()));
  squeeze::io::remove_tree(d);
  fs::create_directories(d);
  return d;
}
std::vector<std::byte> raw_file(const std::string& header, std::size_t data_bytes, std::uint64_t declared_len = ~0ull) {
  const std::uint64_t n = declared_len == ~0ull ? header.size() : declared_len;
  std::vector<std::byte> b(8 + header.size() + data_bytes, std::byte{0x5a});
  for (int i = 0; i < 8; ++i) b[i] = std::byte((n >> (8 * i)) & 0xff);
  std::memcpy(b.data() + 8, header.data(), header.size());
  return b;
}
// expects parse to throw squeeze::Error whose message contains `needle`
void expect_rejected(const std::vector<std::byte>& bytes, const std::string& needle) {
  try {
    io::SafetensorsFile::parse(bytes, "test");
    ADD_FAILURE() << "accepted a bad file; expected: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}
quant::PackedLinear layer(std::int64_t out, std::int64_t in, int bits, int group, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 0.1f);
  std::vector<float> w(out * in);
  for (auto& v : w) v = nd(rng);
  auto p = quant::rtn_quantize(w, out, in, {.bits = bits, .group_size = group, .sym = false});
  if (group > 0) std::reverse(p.g_idx.begin(), p.g_idx.end());  // an act-order-like g_idx must survive too
  return p;
}
}  // namespace

TEST(Safetensors, RoundTripKeepsBytesDtypesShapesMetadata) {
  const auto dir = temp_dir("rt");
  std::vector<float> a = {1.5f, -2.f, 3.25f, 4.f, 5.f, 6.f};
  std::vector<std::int32_t> b = {7, -8, 9};
  std::vector<half> c(5);
  for (int i = 0; i < 5; ++i) c[i] = from_float<half>(float(i) * 0.5f);
  std::vector<std::uint8_t> e;  // an empty tensor
  io::save_safetensors(dir / "t.safetensors",
                       {{"a", io::tensor_ref<float>(io::DType::F32, {2, 3}, a)},
                        {"b", io::tensor_ref<std::int32_t>(io::DType::I32, {3}, b)},
                        {"c.half", io::tensor_ref<half>(io::DType::F16, {5, 1}, c)},
                        {"empty", io::tensor_ref<std::uint8_t>(io::DType::U8, {0, 4}, e)}},
                       {{"k", "v"}});
  EXPECT_FALSE(fs::exists(dir / "t.safetensors.tmp"));
  const auto f = io::SafetensorsFile::open(dir / "t.safetensors");
  EXPECT_EQ(f.tensors().size(), 4u);
  EXPECT_EQ(f.metadata().at("k"), "v");
  EXPECT_EQ(f.read<float>("a", io::DType::F32), a);
  EXPECT_EQ(f.info("a").shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(f.read<std::int32_t>("b", io::DType::I32), b);
  const auto c2 = f.read<half>("c.half", io::DType::F16);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(to_float(c2[i]), to_float(c[i]));
  EXPECT_EQ(f.info("empty").numel(), 0);
  EXPECT_THROW(f.read<float>("b", io::DType::F32), Error);  // wrong dtype asked
  EXPECT_THROW(f.info("missing"), Error);
  // the header length is a multiple of 8 so the data section is aligned
  std::ifstream in(dir / "t.safetensors", std::ios::binary);
  std::uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
  squeeze::io::remove_tree(dir);
}

TEST(Safetensors, WriterRejectsInconsistentTensor) {
  const auto dir = temp_dir("wr");
  std::vector<float> a = {1, 2, 3};
  EXPECT_THROW(io::save_safetensors(dir / "x.safetensors", {{"a", io::tensor_ref<float>(io::DType::F32, {2, 2}, a)}}), Error);
  squeeze::io::remove_tree(dir);
}

TEST(Safetensors, CorruptAndHostileHeadersGiveClearErrors) {
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_NO_THROW(io::SafetensorsFile::parse(raw_file(ok, 8)));
  expect_rejected(std::vector<std::byte>(5), "shorter than the 8-byte header length");
  expect_rejected(raw_file(ok, 8, 1ull << 60), "exceeds the 100 MiB limit");
  expect_rejected(raw_file(ok, 8, ok.size() + 100), "runs past the end of the file");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32",)", 8), "not valid JSON");
  expect_rejected(raw_file(R"([1,2,3])", 0), "does not start with '{'");
  expect_rejected(raw_file(R"({"a":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype 'F31'");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "non-negative integers");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "need 12");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4), "past the data section");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "begin > end");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8), "two non-negative integers");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8), "overflows");
  expect_rejected(
      raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[2],"data_offsets":[4,12]}})", 12),
      "overlap");
  expect_rejected(raw_file(R"({"__metadata__":{"k":1}})", 0), "is not a string");
  expect_rejected(raw_file(R"({"a":7})", 0), "entry is not an object");
}

TEST(QuantizedModelFile, RoundTripsLayersAndConfig) {
  const auto dir = temp_dir("ck");
  std::map<std::string, quant::PackedLinear> layers = {{"model.layers.0.mlp.up_proj", layer(48, 96, 3, 32, 1)},
                                                       {"model.layers.0.self_attn.q_proj", layer(17, 64, 3, 32, 2)}};
  layers.begin()->second.bias.assign(48, from_float<half>(0.25f));
  std::vector<float> emb = {1, 2, 3, 4};
  io::QuantizeConfig cfg{.bits = 3, .group_size = 32, .desc_act = true, .sym = false};
  io::save_quantized(dir, layers, cfg, {{"model.embed_tokens.weight", io::tensor_ref<float>(io::DType::F32, {2, 2}, emb)}});
  const auto ck = io::load_quantized(dir);
  EXPECT_EQ(ck.config.bits, 3);
  EXPECT_EQ(ck.config.group_size, 32);
  EXPECT_TRUE(ck.config.desc_act);
  EXPECT_FALSE(ck.config.sym);
  ASSERT_EQ(ck.layers.size(), 2u);
  for (const auto& [name, p] : layers) {
    const auto& q = ck.layers.at(name);
    EXPECT_EQ(q.qweight, p.qweight);
    EXPECT_EQ(q.qzeros, p.qzeros);
    EXPECT_EQ(q.g_idx, p.g_idx);
    EXPECT_EQ(quant::dequantize(q), quant::dequantize(p));
    EXPECT_EQ(q.bias.size(), p.bias.size());
  }
  EXPECT_EQ(ck.file.read<float>("model.embed_tokens.weight", io::DType::F32), emb);
  // the config file is what other GPTQ loaders read
  std::ifstream f(dir / "quantize_config.json");
  const auto j = nlohmann::json::parse(f);
  EXPECT_EQ(j["bits"], 3);
  EXPECT_EQ(j["group_size"], 32);
  EXPECT_EQ(j["desc_act"], true);
  EXPECT_EQ(j["checkpoint_format"], "gptq");
  squeeze::io::remove_tree(dir);
}

namespace {
void expect_load_error(const fs::path& dir, const std::string& needle) {
  try {
    io::load_quantized(dir);
    ADD_FAILURE() << "loaded a bad checkpoint; expected: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}
void write_config(const fs::path& dir, const nlohmann::json& j) { std::ofstream(dir / "quantize_config.json") << j.dump(); }
}  // namespace

TEST(QuantizedModelFile, MismatchedOrCorruptCheckpointsGiveClearErrors) {
  const auto dir = temp_dir("bad");
  std::map<std::string, quant::PackedLinear> layers = {{"l", layer(16, 64, 4, 32, 3)}};
  const io::QuantizeConfig cfg{.bits = 4, .group_size = 32};
  io::save_quantized(dir, layers, cfg);
  EXPECT_NO_THROW(io::load_quantized(dir));
  auto j = nlohmann::json::parse(std::ifstream(dir / "quantize_config.json"));

  auto jb = j;
  jb["bits"] = 3;  // tensors are 4-bit
  write_config(dir, jb);
  expect_load_error(dir, "the bit width does not match the tensors");
  jb = j;
  jb["bits"] = 8;  // 64 inputs at 8 bits need 16 rows, qweight has 8
  write_config(dir, jb);
  expect_load_error(dir, "the bit width does not match the tensors");
  jb = j;
  jb["group_size"] = 16;
  write_config(dir, jb);
  expect_load_error(dir, "the group size does not match the tensors");
  jb = j;
  jb["group_size"] = -1;
  write_config(dir, jb);
  expect_load_error(dir, "the group size does not match the tensors");
  jb = j;
  jb["bits"] = 5;
  write_config(dir, jb);
  expect_load_error(dir, "bits 5 unsupported");
  jb = j;
  jb["checkpoint_format"] = "gptq_v2";
  write_config(dir, jb);
  expect_load_error(dir, "not supported");
  std::ofstream(dir / "quantize_config.json") << "{ not json";
  expect_load_error(dir, "not a JSON object");
  write_config(dir, j);

  // g_idx pointing outside the groups
  {
    auto p = layers.at("l");
    p.g_idx[3] = 7;
    std::map<std::string, io::TensorRef> t = {
        {"l.qweight", io::tensor_ref<std::int32_t>(io::DType::I32, {p.qweight_rows(), p.out}, p.qweight)},
        {"l.qzeros", io::tensor_ref<std::int32_t>(io::DType::I32, {p.groups(), p.qzeros_cols()}, p.qzeros)},
        {"l.scales", io::tensor_ref<half>(io::DType::F16, {p.groups(), p.out}, p.scales)},
        {"l.g_idx", io::tensor_ref<std::int32_t>(io::DType::I32, {p.in}, p.g_idx)}};
    io::save_safetensors(dir / "model.safetensors", t);
    expect_load_error(dir, "g_idx[3] = 7");
    // scales stored as F32: wrong dtype
    std::vector<float> s32(p.scales.size(), 1.f);
    t["l.g_idx"] = io::tensor_ref<std::int32_t>(io::DType::I32, {p.in}, layers.at("l").g_idx);
    t["l.scales"] = io::tensor_ref<float>(io::DType::F32, {p.groups(), p.out}, s32);
    io::save_safetensors(dir / "model.safetensors", t);
    expect_load_error(dir, "has dtype F32, expected F16");
    // a missing part
    t.erase("l.qzeros");
    io::save_safetensors(dir / "model.safetensors", t);
    expect_load_error(dir, "no 'l.qzeros'");
  }
  // truncated file
  io::save_quantized(dir, layers, cfg);
  fs::resize_file(dir / "model.safetensors", fs::file_size(dir / "model.safetensors") - 10);
  expect_load_error(dir, "past the data section");
  squeeze::io::remove_tree(dir);
}
