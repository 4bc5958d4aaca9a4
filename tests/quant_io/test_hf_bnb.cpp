// bitsandbytes NF4 LLaMA checkpoints in the Hugging Face layout.
#include <gtest/gtest.h>

#include <random>

#include <squeeze/io/hf_bnb.hpp>

#include "io_test_util.hpp"

namespace fs = std::filesystem;
namespace io = squeeze::io;

namespace {
io::HfBnbModel random_bnb_model(bool nested, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 0.02f);
  io::HfBnbModel m;
  m.config.vocab_size = 40;
  m.config.hidden_size = 64;
  m.config.intermediate_size = 72;
  m.config.num_hidden_layers = 2;
  m.config.num_attention_heads = 4;
  m.config.num_key_value_heads = 2;
  m.config.head_dim = 16;
  m.config.tie_word_embeddings = true;
  m.bnb.double_quant = nested;
  for (const auto& e : io::hf_checkpoint_tensors(m.config)) {
    std::int64_t k = 1;
    for (auto d : e.shape) k *= d;
    std::vector<float> v(static_cast<std::size_t>(k));
    for (auto& x : v) x = n(rng);
    if (io::is_quantized_kind(e.kind)) {
      m.layers[io::module_of(e.squeeze)] = io::bnb_nf4_quantize(v, e.shape, nested);
    } else {
      for (auto& x : v) x = squeeze::to_float(squeeze::from_float<squeeze::bf16>(x));
      for (const auto& s : io::squeeze_names_for(e.hf, m.config)) m.dense[s] = v;
    }
  }
  return m;
}
}  // namespace

TEST(HfBnb, ShardedRoundTripNestedAndPlain) {
  for (bool nested : {true, false}) {
    io_test::TempDir dir(std::string("hf_bnb_") + (nested ? "nested" : "plain"));
    const auto m = random_bnb_model(nested, 7);
    io::save_hf_bnb(dir.path, m, 16 << 10);
    EXPECT_TRUE(fs::exists(dir.path / "model.safetensors.index.json"));
    const auto ck = io::SafetensorsCheckpoint::open(dir.path);
    const std::string w = "model.layers.1.mlp.up_proj.weight";
    EXPECT_EQ(ck.info(w).dtype, io::DType::U8);
    EXPECT_EQ(ck.info(w).shape, (std::vector<std::int64_t>{72 * 64 / 2, 1}));
    EXPECT_EQ(ck.info(w + ".absmax").dtype, nested ? io::DType::U8 : io::DType::F32);
    EXPECT_EQ(ck.contains(w + ".nested_absmax"), nested);
    EXPECT_EQ(ck.info("model.embed_tokens.weight").dtype, io::DType::BF16);
    EXPECT_FALSE(ck.contains("lm_head.weight"));  // tied
    const auto back = io::load_hf_bnb(dir.path);
    EXPECT_EQ(back.bnb, m.bnb);
    EXPECT_EQ(back.dense, m.dense);
    ASSERT_EQ(back.layers.size(), m.layers.size());
    for (const auto& [name, l] : m.layers) EXPECT_EQ(io::bnb_nf4_dequantize(back.layers.at(name)), io::bnb_nf4_dequantize(l)) << name;
  }
}

TEST(HfBnb, BadInputNamesTheKey) {
  io_test::TempDir dir("hf_bnb_bad");
  auto m = random_bnb_model(true, 8);
  m.layers.at("block0.attn.v").info.nested = false;
  io_test::expect_error([&] { io::save_hf_bnb(dir.path, m); }, {"model.layers.0.self_attn.v_proj", "bnb_4bit_use_double_quant"});
  m = random_bnb_model(true, 8);
  io::save_hf_bnb(dir.path, m);
  auto cfg = io::read_json_object(dir.path / "config.json", "test");
  cfg["quantization_config"]["bnb_4bit_quant_type"] = "fp4";
  io::save_json(dir.path / "config.json", cfg, "test");
  io_test::expect_error([&] { io::load_hf_bnb(dir.path); }, {"bnb_4bit_quant_type 'fp4'"});
}
