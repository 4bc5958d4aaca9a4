// The Hugging Face GPTQ layout: names, shapes, dtypes, config, shards, and what other writers leave out.
#include <gtest/gtest.h>

#include <random>
#include <set>

#include <squeeze/io/hf_gptq.hpp>

#include "io_test_util.hpp"

namespace fs = std::filesystem;
namespace io = squeeze::io;
namespace q = squeeze::quant;

namespace {

io::LlamaConfig tiny_config() {
  io::LlamaConfig c;
  c.vocab_size = 50;
  c.hidden_size = 64;
  c.intermediate_size = 80;  // 80 / 32: a short last group
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.eos_token_ids = {2};
  return c;
}

// A random layer: zero points over the whole range (0 and the largest included), act-order g_idx if asked.
q::PackedLinear random_layer(std::int64_t out, std::int64_t in, int bits, int group, bool act_order, bool bias, std::mt19937& rng) {
  const std::int64_t groups = group > 0 ? (in + group - 1) / group : 1;
  const int maxq = (1 << bits) - 1;
  std::uniform_int_distribution<int> code(0, maxq);
  std::uniform_real_distribution<float> scale(0.001f, 0.1f);
  std::vector<std::uint8_t> c(out * in), z(groups * out);
  for (auto& v : c) v = std::uint8_t(code(rng));
  for (auto& v : z) v = std::uint8_t(code(rng));
  z[0] = 0;
  z[1] = std::uint8_t(maxq);
  std::vector<float> s(groups * out);
  for (auto& v : s) v = scale(rng);
  auto g = q::default_g_idx(in, group);
  if (act_order) std::shuffle(g.begin(), g.end(), rng);
  auto p = q::pack(c, z, s, g, out, in, bits, group);
  if (bias)
    for (std::int64_t o = 0; o < out; ++o) p.bias.push_back(squeeze::from_float<squeeze::half>(scale(rng) - 0.05f));
  return p;
}

io::HfGptqModel random_model(int bits, int group, bool act_order, std::uint32_t seed) {
  std::mt19937 rng(seed);
  io::HfGptqModel m;
  m.config = tiny_config();
  m.quant.bits = bits;
  m.quant.group_size = group;
  m.quant.desc_act = act_order;
  m.quant.sym = false;
  std::normal_distribution<float> n(0.f, 1.f);
  for (const auto& e : io::hf_checkpoint_tensors(m.config)) {
    if (e.shape.size() == 2 && e.kind != io::ParamKind::Embedding && e.kind != io::ParamKind::Head) {
      const auto name = e.squeeze.substr(0, e.squeeze.size() - 7);
      m.layers[name] = random_layer(e.shape[0], e.shape[1], bits, group, act_order, e.kind == io::ParamKind::Q, rng);
    } else {
      std::int64_t k = 1;
      for (auto d : e.shape) k *= d;
      auto& v = m.dense[e.squeeze];
      for (std::int64_t i = 0; i < k; ++i) v.push_back(squeeze::to_float(squeeze::from_float<squeeze::half>(n(rng))));
    }
  }
  return m;
}

void expect_same_layers(const io::HfGptqModel& a, const io::HfGptqModel& b) {
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (const auto& [name, p] : a.layers) {
    const auto& r = b.layers.at(name);
    EXPECT_EQ(r.qweight, p.qweight) << name;
    EXPECT_EQ(r.qzeros, p.qzeros) << name;
    EXPECT_EQ(q::unpack_zeros(r), q::unpack_zeros(p)) << name;
    EXPECT_EQ(r.g_idx, p.g_idx) << name;
    EXPECT_EQ(q::dequantize(r), q::dequantize(p)) << name;
    ASSERT_EQ(r.bias.size(), p.bias.size()) << name;
    for (std::size_t i = 0; i < p.bias.size(); ++i) EXPECT_EQ(squeeze::to_float(r.bias[i]), squeeze::to_float(p.bias[i]));
  }
  EXPECT_EQ(a.dense, b.dense);
}

nlohmann::json read_json(const fs::path& f) { return nlohmann::json::parse(std::ifstream(f)); }

// Rewrites a single-file checkpoint with `edit` applied to a copy of its tensors (name -> dtype, shape, bytes).
struct Raw {
  io::DType dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> bytes;
};
void rewrite(const fs::path& dir, const std::function<void(std::map<std::string, Raw>&)>& edit) {
  std::map<std::string, Raw> t;
  {
    const auto f = io::SafetensorsFile::open(dir / "model.safetensors");
    for (const auto& [name, info] : f.tensors()) {
      const auto b = f.bytes(name);
      t[name] = {info.dtype, info.shape, {b.begin(), b.end()}};
    }
  }
  edit(t);
  std::map<std::string, io::TensorRef> refs;
  for (const auto& [name, r] : t) refs[name] = {r.dtype, r.shape, r.bytes};
  io::save_safetensors(dir / "model.safetensors", refs, {{"format", "pt"}});
}

}  // namespace

TEST(HfGptq, ShardedRoundTripWithPublishedNamesShapesAndDtypes) {
  io_test::TempDir dir("hf_gptq_sharded");
  const auto m = random_model(4, 32, /*act_order=*/true, 1);
  io::save_hf_gptq(dir.path, m, {.max_shard_bytes = 24 << 10});
  ASSERT_TRUE(fs::exists(dir.path / "model.safetensors.index.json"));
  ASSERT_FALSE(fs::exists(dir.path / "model.safetensors"));

  const auto ck = io::SafetensorsCheckpoint::open(dir.path);
  std::set<std::string> shards;
  const auto index = read_json(dir.path / "model.safetensors.index.json");
  for (const auto& [name, file] : index.at("weight_map").items()) shards.insert(file);
  EXPECT_GT(shards.size(), 1u);
  const std::int64_t in = 64, out = 64, bits = 4, groups = 2;  // layer 1's q_proj
  const std::string qp = "model.layers.1.self_attn.q_proj";
  EXPECT_EQ(ck.info(qp + ".qweight").dtype, io::DType::I32);
  EXPECT_EQ(ck.info(qp + ".qweight").shape, (std::vector<std::int64_t>{in * bits / 32, out}));
  EXPECT_EQ(ck.info(qp + ".qzeros").dtype, io::DType::I32);
  EXPECT_EQ(ck.info(qp + ".qzeros").shape, (std::vector<std::int64_t>{groups, out * bits / 32}));
  EXPECT_EQ(ck.info(qp + ".scales").dtype, io::DType::F16);
  EXPECT_EQ(ck.info(qp + ".scales").shape, (std::vector<std::int64_t>{groups, out}));
  EXPECT_EQ(ck.info(qp + ".g_idx").dtype, io::DType::I32);
  EXPECT_EQ(ck.info(qp + ".g_idx").shape, (std::vector<std::int64_t>{in}));
  EXPECT_EQ(ck.info(qp + ".bias").dtype, io::DType::F16);
  EXPECT_EQ(ck.info("model.layers.0.mlp.down_proj.qweight").shape, (std::vector<std::int64_t>{80 * 4 / 32, 64}));
  EXPECT_EQ(ck.info("model.layers.0.mlp.down_proj.scales").shape, (std::vector<std::int64_t>{3, 64}));
  for (const char* d : {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight"})
    EXPECT_EQ(ck.info(d).dtype, io::DType::F16) << d;
  EXPECT_FALSE(ck.contains("model.layers.0.self_attn.q_proj.weight"));

  const auto cfg = read_json(dir.path / "config.json");
  const auto& qc = cfg.at("quantization_config");
  EXPECT_EQ(qc.at("quant_method"), "gptq");
  EXPECT_EQ(qc.at("bits"), 4);
  EXPECT_EQ(qc.at("group_size"), 32);
  EXPECT_EQ(qc.at("desc_act"), true);
  EXPECT_EQ(qc.at("sym"), false);
  EXPECT_EQ(qc.at("checkpoint_format"), "gptq");
  EXPECT_EQ(cfg.at("torch_dtype"), "float16");
  EXPECT_EQ(read_json(dir.path / "quantize_config.json").at("bits"), 4);

  const auto back = io::load_hf_gptq(dir.path);
  EXPECT_EQ(back.quant.bits, 4);
  EXPECT_EQ(back.quant.group_size, 32);
  EXPECT_TRUE(back.quant.desc_act);
  EXPECT_EQ(back.config.hidden_size, 64);
  expect_same_layers(m, back);
}

TEST(HfGptq, RoundTripEveryWidthAndPerChannel) {
  for (int bits : {2, 3, 8})
    for (int group : {32, 0}) {
      io_test::TempDir dir("hf_gptq_bits" + std::to_string(bits) + "_" + std::to_string(group));
      const auto m = random_model(bits, group, false, 10u + bits);
      io::save_hf_gptq(dir.path, m);
      const auto back = io::load_hf_gptq(dir.path);
      EXPECT_EQ(back.quant.group_size, group);
      expect_same_layers(m, back);
      if (group == 0) EXPECT_EQ(read_json(dir.path / "config.json")["quantization_config"]["group_size"], -1);
    }
}

// The file holds GPTQModel's word-wise v1 zeros: where a zero point is 0 they differ from PackedLinear's
// per-field words, and the reader still gets every zero point back.
TEST(HfGptq, ZeroPointZeroIsStoredWordWise) {
  io_test::TempDir dir("hf_gptq_zero");
  const auto m = random_model(4, 32, false, 3);
  io::save_hf_gptq(dir.path, m);
  const auto ck = io::SafetensorsCheckpoint::open(dir.path);
  const auto& p = m.layers.at("block0.attn.k");
  const auto file = ck.read<std::int32_t>("model.layers.0.self_attn.k_proj.qzeros", io::DType::I32);
  EXPECT_NE(file, p.qzeros);  // z[0] = 0 borrows
  EXPECT_EQ(file, q::encode_v1_qzeros(q::unpack_zeros(p), p.groups(), p.out, 4));
  EXPECT_EQ(q::unpack_zeros(io::load_hf_gptq(dir.path).layers.at("block0.attn.k")), q::unpack_zeros(p));
}

TEST(HfGptq, ReadsFilesWithoutGIdxAndWithFp32BiasAndOnlyQuantizeConfig) {
  io_test::TempDir dir("hf_gptq_nogidx");
  const auto m = random_model(4, 32, false, 4);
  io::save_hf_gptq(dir.path, m);
  rewrite(dir.path, [](std::map<std::string, Raw>& t) {
    for (auto it = t.begin(); it != t.end();) it = it->first.ends_with(".g_idx") ? t.erase(it) : std::next(it);
    auto& b = t.at("model.layers.0.self_attn.q_proj.bias");
    std::vector<float> f = io::decode_float(b.dtype, b.bytes);
    b = {io::DType::F32, b.shape, io::encode_float(io::DType::F32, f)};
  });
  auto cfg = read_json(dir.path / "config.json");
  cfg.erase("quantization_config");  // AutoGPTQ's older exports: quantize_config.json only
  io::save_json(dir.path / "config.json", cfg, "test");
  const auto back = io::load_hf_gptq(dir.path);
  EXPECT_EQ(back.layers.at("block0.mlp.down").g_idx, q::default_g_idx(80, 32));
  expect_same_layers(m, back);
}

TEST(HfGptq, BadInputNamesTheTensorOrKey) {
  io_test::TempDir dir("hf_gptq_bad");
  const auto m = random_model(4, 32, false, 5);
  const auto write = [&] { io::save_hf_gptq(dir.path, m); };
  const auto load = [&] { io::load_hf_gptq(dir.path); };

  write();
  rewrite(dir.path, [](auto& t) { t.erase("model.layers.1.mlp.up_proj.scales"); });
  io_test::expect_error(load, {"model.layers.1.mlp.up_proj.scales", "missing"});

  write();
  rewrite(dir.path, [](auto& t) { t.erase("model.layers.0.self_attn.v_proj.qzeros"); });
  io_test::expect_error(load, {"model.layers.0.self_attn.v_proj.qzeros"});

  write();
  rewrite(dir.path, [](auto& t) {
    auto& g = t.at("model.layers.0.self_attn.o_proj.g_idx");
    reinterpret_cast<std::int32_t*>(g.bytes.data())[5] = 9;  // 2 groups
  });
  io_test::expect_error(load, {"model.layers.0.self_attn.o_proj", "g_idx[5] = 9"});

  // another bit width in the config than the tensors hold
  write();
  auto cfg = read_json(dir.path / "config.json");
  auto qc = read_json(dir.path / "quantize_config.json");
  cfg["quantization_config"]["bits"] = 8;
  qc["bits"] = 8;
  io::save_json(dir.path / "config.json", cfg, "test");
  io::save_json(dir.path / "quantize_config.json", qc, "test");
  io_test::expect_error(load, {"model.layers.0.self_attn.q_proj.qweight", "expected [16, 64]"});

  qc["bits"] = 4;
  io::save_json(dir.path / "quantize_config.json", qc, "test");
  io_test::expect_error(load, {"disagree"});

  cfg["quantization_config"]["bits"] = 5;
  io::save_json(dir.path / "config.json", cfg, "test");
  io_test::expect_error(load, {"quantization_config", "bits 5"});

  cfg["quantization_config"]["bits"] = 4;
  cfg["quantization_config"]["quant_method"] = "awq";
  io::save_json(dir.path / "config.json", cfg, "test");
  io_test::expect_error(load, {"quant_method 'awq'"});

  cfg["quantization_config"]["quant_method"] = "gptq";
  cfg["quantization_config"]["checkpoint_format"] = "gptq_v2";
  io::save_json(dir.path / "config.json", cfg, "test");
  io_test::expect_error(load, {"checkpoint_format 'gptq_v2'"});

  // writer: a missing layer, a layer of the wrong shape
  std::mt19937 rng(1);
  auto bad = m;
  bad.layers.erase("block1.mlp.gate");
  io_test::expect_error([&] { io::save_hf_gptq(dir.path, bad); }, {"block1.mlp.gate", "model.layers.1.mlp.gate_proj"});
  bad = m;
  bad.layers["block0.attn.q"] = random_layer(16, 64, 4, 32, false, false, rng);
  io_test::expect_error([&] { io::save_hf_gptq(dir.path, bad); }, {"model.layers.0.self_attn.q_proj", "[64, 64]"});
}
