// config.json: real-shaped TinyLlama / Llama 3.1 / Llama 3.2 / Mistral configs, the transformers 5 spelling,
// refusals by key name, the writer's round trip, and the RoPE inverse frequencies (llama3, linear).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <numbers>
#include <squeeze/io/hf_config.hpp>

#include "io_test_util.hpp"

using namespace squeeze;
using io_test::expect_error;

namespace {

// TinyLlama-1.1B (published config.json values, transformers 4.35).
const char* kTinyLlama = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 5632,
  "max_position_embeddings": 2048,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 22,
  "num_key_value_heads": 4,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 10000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.35.0",
  "use_cache": true,
  "vocab_size": 32000
})";

// Llama-3.1-8B (published config.json values).
const char* kLlama31_8B = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// The same model as transformers 5 saves it: rope_parameters and dtype instead of rope_theta, rope_scaling
// and torch_dtype.
const char* kLlama31_8B_v5 = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "dtype": "bfloat16",
  "eos_token_id": 128001,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pad_token_id": null,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rope_type": "llama3"
  },
  "tie_word_embeddings": false,
  "transformers_version": "5.0.0",
  "use_cache": true,
  "vocab_size": 128256
})";

// A tiny LLaMA-3-style model as transformers 5.17 saved it (tied, GQA, head_dim != hidden / heads, llama3).
const char* kSavedByTransformers5 = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "dtype": "bfloat16",
  "eos_token_id": 2,
  "head_dim": 16,
  "hidden_act": "silu",
  "hidden_size": 16,
  "initializer_range": 0.02,
  "intermediate_size": 24,
  "max_position_embeddings": 128,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 2,
  "num_hidden_layers": 2,
  "num_key_value_heads": 1,
  "pad_token_id": null,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500000.0,
    "rope_type": "llama3"
  },
  "tie_word_embeddings": true,
  "transformers_version": "5.17.0",
  "use_cache": true,
  "vocab_size": 32
})";

// Llama-3.2-1B: tied embeddings, explicit head_dim, rope factor 32.
const char* kLlama32_1B = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// Mistral-7B-v0.3-shaped: no sliding window, so the LLaMA network.
const char* kMistral = R"({
  "architectures": ["MistralForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.42.0.dev0",
  "use_cache": true,
  "vocab_size": 32768
})";

nlohmann::json js(const char* text) { return nlohmann::json::parse(text); }
io::LlamaConfig parse(const nlohmann::json& j, io::ConfigOptions o = {}) { return io::llama_config_from_json(j, "test.json", o); }
bool has(const std::vector<std::string>& v, const std::string& x) { return std::find(v.begin(), v.end(), x) != v.end(); }

}  // namespace

TEST(HfConfig, TinyLlama) {
  const auto c = io::parse_llama_config(kTinyLlama, "tinyllama/config.json");
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.intermediate_size, 5632);
  EXPECT_EQ(c.num_hidden_layers, 22);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 64);  // hidden / heads
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rope_scaling.type, plan::RopeType::Default);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_EQ(c.dtype, io::DType::BF16);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_ids, std::vector<std::int64_t>{2});
  EXPECT_FALSE(c.pad_token_id.has_value());
  EXPECT_TRUE(has(c.ignored_keys, "transformers_version"));
  EXPECT_TRUE(has(c.ignored_keys, "use_cache"));
  EXPECT_TRUE(has(c.ignored_keys, "initializer_range"));
}

TEST(HfConfig, Llama31WithLlama3RopeScaling) {
  const auto c = io::parse_llama_config(kLlama31_8B);
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.type, plan::RopeType::Llama3);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c.bos_token_id, 128000);
  EXPECT_EQ(c.eos_token_ids, std::vector<std::int64_t>{128001});
}

TEST(HfConfig, Transformers5SpellingReadsTheSame) {
  EXPECT_EQ(io::parse_llama_config(kLlama31_8B_v5), io::parse_llama_config(kLlama31_8B));
  // both spellings at once, agreeing, are accepted too
  auto j = js(kLlama31_8B);
  j["rope_parameters"] = js(kLlama31_8B_v5)["rope_parameters"];
  j["dtype"] = "bfloat16";
  EXPECT_EQ(parse(j), io::parse_llama_config(kLlama31_8B));
}

TEST(HfConfig, ReadsWhatTransformers5Saves) {
  const auto c = io::parse_llama_config(kSavedByTransformers5);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.num_key_value_heads, 1);
  EXPECT_EQ(c.dtype, io::DType::BF16);
  EXPECT_EQ(c.rope_scaling.type, plan::RopeType::Llama3);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 16);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  // that model's inv_freq buffer (bf16): our double values round to it
  const double theirs[] = {0.57421875,          0.0242919921875,       0.00469970703125,      0.000911712646484375, 0.00017642974853515625,
                           3.4332275390625e-05, 6.645917892456055e-06, 1.2889504432678223e-06};
  const auto f = io::rope_inv_freq(c);
  ASSERT_EQ(f.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(f[i], theirs[i], theirs[i] * (1.0 / 256)) << i;  // within bf16's rounding
}

TEST(HfConfig, InstructEosListTiedEmbeddingsAndExplicitHeadDim) {
  auto j = js(kLlama31_8B);
  j["eos_token_id"] = {128001, 128008, 128009};
  EXPECT_EQ(parse(j).eos_token_ids, (std::vector<std::int64_t>{128001, 128008, 128009}));

  const auto c = io::parse_llama_config(kLlama32_1B);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 32.0);

  // head_dim different from hidden / heads (LLaMA-3-style small models, Mistral-Nemo) is kept as given
  auto k = js(kTinyLlama);
  k["head_dim"] = 128;
  EXPECT_EQ(parse(k).head_dim, 128);
  // null means the default
  k["head_dim"] = nullptr;
  k["num_key_value_heads"] = nullptr;
  EXPECT_EQ(parse(k).head_dim, 64);
  EXPECT_EQ(parse(k).num_key_value_heads, 32);
}

TEST(HfConfig, MistralWithoutSlidingWindow) {
  const auto c = io::parse_llama_config(kMistral);
  EXPECT_EQ(c.model_type, "mistral");
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  auto j = js(kMistral);
  j["sliding_window"] = 4096;
  expect_error([&] { parse(j); }, {"'sliding_window'", "4096", "test.json"});
  j.erase("sliding_window");
  expect_error([&] { parse(j); }, {"sliding_window", "default 4096"});
  j = js(kMistral);
  j.erase("num_key_value_heads");
  expect_error([&] { parse(j); }, {"num_key_value_heads"});
}

TEST(HfConfig, RefusesWhatSqueezeDoesNotImplementByKeyName) {
  struct Case {
    const char* key;
    nlohmann::json value;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"attention_bias", true, {"'attention_bias'", "true"}},
      {"mlp_bias", true, {"'mlp_bias'"}},
      {"hidden_act", "gelu", {"'hidden_act'", "gelu"}},
      {"pretraining_tp", 2, {"'pretraining_tp'", "2"}},
      {"attention_dropout", 0.1, {"'attention_dropout'"}},
      {"model_type", "qwen2", {"'model_type'", "qwen2"}},
      {"architectures", {"LlamaForSequenceClassification"}, {"'architectures'", "LlamaForSequenceClassification"}},
      {"torch_dtype", "float64", {"'torch_dtype'", "float64"}},
      {"quantization_config", {{"quant_method", "gptq"}}, {"'quantization_config'"}},
      {"auto_map", {{"AutoModelForCausalLM", "modeling.X"}}, {"'auto_map'"}},
      {"sliding_window", 4096, {"'sliding_window'"}},
      {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}, {"'rope_scaling.rope_type'", "yarn"}},
      {"rope_scaling", {{"type", "dynamic"}, {"factor", 2.0}}, {"'rope_scaling.rope_type'", "dynamic"}},
      {"rope_scaling", {{"rope_type", "longrope"}}, {"longrope"}},
      {"rope_scaling",
       {{"rope_type", "llama3"},
        {"factor", 8.0},
        {"low_freq_factor", 1.0},
        {"high_freq_factor", 4.0},
        {"original_max_position_embeddings", 8192},
        {"attention_factor", 0.5}},
       {"'rope_scaling.attention_factor'"}},
      {"rope_scaling", {{"type", "linear"}, {"factor", 2.0}, {"low_freq_factor", 1.0}}, {"'rope_scaling.low_freq_factor'", "linear"}},
      {"rope_scaling", {{"factor", 2.0}}, {"rope_scaling", "rope_type"}},
      {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}}, {"low_freq_factor"}},
      {"rope_scaling", {{"rope_type", "linear"}, {"type", "llama3"}, {"factor", 2.0}}, {"two types"}},
      {"rope_parameters",
       {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5}},
       {"'rope_parameters.partial_rotary_factor'"}},
      {"qk_norm", true, {"unknown key", "'qk_norm'"}},
      {"hidden_size", "2048", {"'hidden_size'", "integer"}},
      {"hidden_size", 2048.5, {"'hidden_size'", "integer"}},
      {"num_key_value_heads", 5, {"num_key_value_heads (5)"}},
      {"head_dim", 63, {"head_dim (63)", "even"}},
      {"bos_token_id", 40000, {"bos_token_id 40000", "vocabulary"}},
      {"tie_word_embeddings", "yes", {"'tie_word_embeddings'"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(c.key) + " = " + c.value.dump());
    auto j = js(kTinyLlama);
    j[c.key] = c.value;
    std::vector<std::string> needles = c.needles;
    needles.push_back("test.json");
    const std::string msg = io_test::error_of([&] { parse(j); });
    ASSERT_FALSE(msg.empty()) << "accepted";
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
  // the same values where they are harmless are accepted
  auto ok = js(kTinyLlama);
  ok["attention_bias"] = false;
  ok["mlp_bias"] = false;
  ok["pretraining_tp"] = nullptr;
  ok["quantization_config"] = nullptr;
  ok["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_NO_THROW(parse(ok));
}

TEST(HfConfig, MissingKeysAndUnknownKeysOption) {
  for (const char* k : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "model_type"}) {
    auto j = js(kTinyLlama);
    j.erase(k);
    expect_error([&] { parse(j); }, {k});
  }
  auto j = js(kTinyLlama);
  j["qk_norm"] = true;
  j["some_future_key"] = 3;
  expect_error([&] { parse(j); }, {"unknown keys", "'qk_norm'", "'some_future_key'"});
  const auto c = parse(j, {.allow_unknown_keys = true});
  EXPECT_TRUE(has(c.ignored_keys, "qk_norm"));
  EXPECT_TRUE(has(c.ignored_keys, "some_future_key"));
  expect_error([] { io::parse_llama_config("{not json", "broken.json"); }, {"broken.json", "JSON"});
  expect_error([] { io::parse_llama_config("[1, 2]", "list.json"); }, {"list.json", "object"});
}

TEST(HfConfig, RopeSourcesMustAgree) {
  auto j = js(kLlama31_8B_v5);
  j["rope_theta"] = 10000.0;  // disagrees with rope_parameters.rope_theta
  expect_error([&] { parse(j); }, {"rope_parameters.rope_theta", "rope_theta"});
  j = js(kLlama31_8B_v5);
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  expect_error([&] { parse(j); }, {"rope_scaling", "rope_parameters", "different"});
  j = js(kLlama31_8B_v5);
  j["torch_dtype"] = "float16";
  expect_error([&] { parse(j); }, {"torch_dtype", "dtype", "disagree"});
  auto k = js(kLlama31_8B);
  k["rope_scaling"]["high_freq_factor"] = 1.0;  // == low_freq_factor: the blend divides by zero
  expect_error([&] { parse(k); }, {"high_freq_factor"});
}

TEST(HfConfig, WriterRoundTripsAndSpellsWhatTransformersReads) {
  for (const char* text : {kTinyLlama, kLlama31_8B, kLlama32_1B}) {
    const auto c = io::parse_llama_config(text);
    const auto j = io::llama_config_json(c);
    EXPECT_EQ(j["architectures"], nlohmann::json({"LlamaForCausalLM"}));
    EXPECT_EQ(j["model_type"], "llama");
    EXPECT_EQ(j["torch_dtype"], "bfloat16");
    EXPECT_EQ(j["hidden_act"], "silu");
    EXPECT_EQ(j["attention_bias"], false);
    EXPECT_EQ(j["mlp_bias"], false);
    EXPECT_EQ(j["head_dim"], c.head_dim);
    EXPECT_EQ(parse(j), c);
    EXPECT_TRUE(parse(j).ignored_keys.size() <= 2);  // initializer_range, use_cache
  }
  const auto j = io::llama_config_json(io::parse_llama_config(kLlama31_8B));
  EXPECT_EQ(j["rope_scaling"]["rope_type"], "llama3");
  EXPECT_EQ(j["rope_scaling"]["original_max_position_embeddings"], 8192);
  EXPECT_EQ(j["rope_theta"], 500000.0);
  EXPECT_TRUE(io::llama_config_json(io::parse_llama_config(kTinyLlama))["rope_scaling"].is_null());

  // linear scaling, a pad id, several eos ids, no dtype (written as float32)
  io::LlamaConfig c;
  c.vocab_size = 512, c.hidden_size = 64, c.intermediate_size = 176, c.num_hidden_layers = 2, c.num_attention_heads = 4;
  c.num_key_value_heads = 2, c.head_dim = 32, c.rms_norm_eps = 1e-5, c.rope_theta = 5e5;
  c.rope_scaling = {plan::RopeType::Linear, 4.0};
  c.pad_token_id = 0, c.bos_token_id = 1, c.eos_token_ids = {2, 3};
  const auto w = io::llama_config_json(c);
  EXPECT_EQ(w["torch_dtype"], "float32");
  EXPECT_EQ(w["eos_token_id"], nlohmann::json({2, 3}));
  auto back = parse(w);
  EXPECT_EQ(back.dtype, io::DType::F32);
  back.dtype.reset();
  EXPECT_EQ(back, c);

  // Mistral is written as the LLaMA it is
  const auto m = io::parse_llama_config(kMistral);
  auto as_llama = parse(io::llama_config_json(m));
  EXPECT_EQ(as_llama.model_type, "llama");
  as_llama.model_type = "mistral";
  EXPECT_EQ(as_llama, m);

  // an invalid config is not written
  c.num_key_value_heads = 3;
  expect_error([&] { io::llama_config_json(c); }, {"num_key_value_heads"});
}

TEST(HfConfig, SaveAndLoadFile) {
  io_test::TempDir dir("config");
  const auto c = io::parse_llama_config(kLlama32_1B);
  io::save_llama_config(dir.path, c);
  EXPECT_FALSE(std::filesystem::exists(dir.path / "config.json.tmp"));
  EXPECT_EQ(io::load_llama_config(dir.path), c);
  EXPECT_EQ(io::load_llama_config(dir.path / "config.json"), c);
  expect_error([&] { io::load_llama_config(dir.path / "absent"); }, {"cannot open", "absent"});
}

// head_dim 8, theta 10000: base frequencies 10000^(-2i/8) = 1, 0.1, 0.01, 0.001 (wavelengths 2 pi / f =
// 6.283, 62.83, 628.3, 6283). llama3 with L = 1024, low_freq_factor 1, high_freq_factor 4, factor 8: kept
// below L / 4 = 256, divided by 8 above L / 1 = 1024, blended between. The third: s = (1024 / 628.3185 - 1) / 3
// = 0.2099155, f' = 0.01 (1 - s) / 8 + 0.01 s = 0.0030867610.
TEST(RopeFrequencies, Llama3HandComputed) {
  const plan::RopeScaling s{plan::RopeType::Llama3, 8.0, 1.0, 4.0, 1024};
  const auto f = plan::rope_inv_freq(8, 10000.0, s);
  ASSERT_EQ(f.size(), 4u);
  EXPECT_NEAR(f[0], 1.0, 1e-15);
  EXPECT_NEAR(f[1], 0.1, 1e-15);
  EXPECT_NEAR(f[2], 0.0030867610, 1e-10);
  EXPECT_NEAR(f[3], 0.000125, 1e-15);
}

TEST(RopeFrequencies, DefaultAndLinear) {
  const auto d = plan::rope_inv_freq(8, 10000.0, {});
  const auto l = plan::rope_inv_freq(8, 10000.0, {plan::RopeType::Linear, 4.0});
  const double base[] = {1.0, 0.1, 0.01, 0.001};
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(d[i], base[i], 1e-15 * 10);
    EXPECT_NEAR(l[i], base[i] / 4, 1e-15 * 10);
  }
  expect_error([] { plan::rope_inv_freq(7, 10000.0, {}); }, {"head_dim", "even"});
}

TEST(RopeFrequencies, Llama31Geometry) {
  const auto c = io::parse_llama_config(kLlama31_8B);
  const auto f = io::rope_inv_freq(c);
  const auto base = plan::rope_inv_freq(c.head_dim, c.rope_theta, {});
  ASSERT_EQ(f.size(), 64u);
  int kept = 0, divided = 0, blended = 0;
  for (std::size_t i = 0; i < f.size(); ++i) {
    const double w = 2 * std::numbers::pi / base[i];
    if (w < 8192.0 / 4) {
      EXPECT_EQ(f[i], base[i]);
      ++kept;
    } else if (w > 8192.0) {
      EXPECT_DOUBLE_EQ(f[i], base[i] / 8);
      ++divided;
    } else {
      EXPECT_TRUE(f[i] < base[i] && f[i] > base[i] / 8);
      ++blended;
    }
    if (i > 0) EXPECT_LT(f[i], f[i - 1]);  // still decreasing: the blend is continuous at both ends
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
  EXPECT_EQ(kept + divided + blended, 64);
}
