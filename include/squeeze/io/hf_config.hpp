#pragma once
// A Hugging Face LLaMA config.json, torch-free: parsed into io::LlamaConfig, refused by key name where it
// asks for something squeeze does not implement, and written back in a form transformers loads.
//
// Read: model_type "llama", or "mistral" without a sliding window (the same network and tensor names).
// Geometry keys vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads are
// required; num_key_value_heads defaults to the head count, head_dim to hidden_size / heads, the rest to
// transformers' LlamaConfig defaults. RoPE comes as rope_theta + rope_scaling (transformers 4.x) or
// rope_parameters (transformers 5.x), both accepted; where both appear they must agree. Scaling types:
// null / "default" (none), "linear" (every frequency divided by factor) and "llama3" (Llama 3.1's
// wavelength-dependent scaling); "dynamic", "yarn", "longrope" and any other are refused, as is any key
// inside the scaling object that its type does not use.
// Refused by key: attention_bias / mlp_bias true, hidden_act other than "silu", pretraining_tp > 1,
// attention_dropout != 0, a sliding_window, quantization_config, auto_map, architectures other than
// LlamaForCausalLM / MistralForCausalLM. Keys that change nothing (transformers_version, use_cache,
// initializer_range, generation defaults, ...) are ignored and listed in LlamaConfig::ignored_keys; any
// other key is refused by name unless ConfigOptions::allow_unknown_keys, since an unknown key may change
// the network (a silently wrong model is worse than a refusal).
//
// Written (llama_config_json / save_llama_config): architectures ["LlamaForCausalLM"], model_type "llama",
// the geometry, rope_theta + rope_scaling and torch_dtype: the spelling transformers 4.x reads natively
// and 5.x converts on load (to rope_parameters and dtype).
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "squeeze/error.hpp"
#include "squeeze/io/json_file.hpp"
#include "squeeze/plan/rope.hpp"
#include "squeeze/io/safetensors.hpp"

namespace squeeze::io {

struct LlamaConfig {
  std::string model_type = "llama";
  std::int64_t vocab_size = 32000;
  std::int64_t hidden_size = 4096;
  std::int64_t intermediate_size = 11008;
  std::int64_t num_hidden_layers = 32;
  std::int64_t num_attention_heads = 32;
  std::int64_t num_key_value_heads = 32;
  std::int64_t head_dim = 128;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  plan::RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  std::int64_t max_position_embeddings = 2048;
  std::optional<DType> dtype;  // torch_dtype / dtype: F32, F16 or BF16; absent when the file names none
  std::optional<std::int64_t> bos_token_id, pad_token_id;
  std::vector<std::int64_t> eos_token_ids;  // config.json holds one id or a list (Llama 3 instruct models)
  std::vector<std::string> ignored_keys;    // keys read and deliberately ignored (not compared by ==)

  bool operator==(const LlamaConfig& o) const {
    return model_type == o.model_type && vocab_size == o.vocab_size && hidden_size == o.hidden_size &&
           intermediate_size == o.intermediate_size && num_hidden_layers == o.num_hidden_layers &&
           num_attention_heads == o.num_attention_heads && num_key_value_heads == o.num_key_value_heads && head_dim == o.head_dim &&
           rms_norm_eps == o.rms_norm_eps && rope_theta == o.rope_theta && rope_scaling == o.rope_scaling &&
           tie_word_embeddings == o.tie_word_embeddings && max_position_embeddings == o.max_position_embeddings && dtype == o.dtype &&
           bos_token_id == o.bos_token_id && pad_token_id == o.pad_token_id && eos_token_ids == o.eos_token_ids;
  }

  // Sizes positive, heads a multiple of the KV heads, an even head_dim (RoPE rotates pairs), hidden a
  // multiple of the heads (transformers 5 requires it even with an explicit head_dim), sane RoPE parameters.
  void validate(std::string_view source = "LlamaConfig") const {
    const std::string src(source);
    auto need = [&](bool ok, const std::string& what) { check(ok, src + ": " + what); };
    need(vocab_size > 0 && hidden_size > 0 && intermediate_size > 0 && num_hidden_layers > 0 && num_attention_heads > 0 &&
             num_key_value_heads > 0 && head_dim > 0 && max_position_embeddings > 0,
         "every size must be positive");
    need(num_attention_heads % num_key_value_heads == 0, "num_attention_heads (" + std::to_string(num_attention_heads) +
                                                             ") must be a multiple of num_key_value_heads (" +
                                                             std::to_string(num_key_value_heads) + ")");
    need(hidden_size % num_attention_heads == 0, "hidden_size (" + std::to_string(hidden_size) +
                                                     ") must be a multiple of num_attention_heads (" + std::to_string(num_attention_heads) +
                                                     ")");
    need(head_dim % 2 == 0, "head_dim (" + std::to_string(head_dim) + ") must be even for RoPE");
    need(rms_norm_eps > 0 && std::isfinite(rms_norm_eps), "rms_norm_eps must be positive");
    need(rope_theta > 0 && std::isfinite(rope_theta), "rope_theta must be positive");
    if (rope_scaling.type != plan::RopeType::Default)
      need(rope_scaling.factor > 0 && std::isfinite(rope_scaling.factor), "rope_scaling.factor must be positive");
    if (rope_scaling.type == plan::RopeType::Llama3) {
      need(rope_scaling.low_freq_factor > 0, "rope_scaling.low_freq_factor must be positive");
      need(rope_scaling.high_freq_factor > rope_scaling.low_freq_factor,
           "rope_scaling.high_freq_factor must be greater than low_freq_factor (the llama3 formula divides by their difference)");
      need(rope_scaling.original_max_position_embeddings > 0, "rope_scaling.original_max_position_embeddings must be positive");
    }
    need(!dtype || *dtype == DType::F32 || *dtype == DType::F16 || *dtype == DType::BF16, "dtype must be F32, F16 or BF16");
    auto id_ok = [&](std::int64_t id) { return id >= 0 && id < vocab_size; };
    if (bos_token_id) need(id_ok(*bos_token_id), "bos_token_id " + std::to_string(*bos_token_id) + " is outside the vocabulary");
    for (auto e : eos_token_ids) need(id_ok(e), "eos_token_id " + std::to_string(e) + " is outside the vocabulary");
  }
};

struct ConfigOptions {
  bool allow_unknown_keys = false;  // true: unknown keys are ignored (and listed in ignored_keys) instead of refused
};

namespace detail {
inline std::string_view torch_dtype_name(DType d) {
  switch (d) {
    case DType::F16:
      return "float16";
    case DType::BF16:
      return "bfloat16";
    default:
      return "float32";
  }
}

// Keys that do not change the network or its weights.
inline const std::set<std::string, std::less<>>& ignorable_config_keys() {
  static const std::set<std::string, std::less<>> keys = {
      "transformers_version", "_name_or_path", "name_or_path", "_commit_hash", "_attn_implementation", "_attn_implementation_autoset",
      "use_cache", "initializer_range", "output_attentions", "output_hidden_states", "return_dict", "torchscript", "use_return_dict",
      "chunk_size_feed_forward", "id2label", "label2id", "num_labels", "problem_type", "tokenizer_class", "prefix", "task_specific_params",
      "finetuning_task", "pruned_heads", "tf_legacy_loss", "use_bfloat16", "is_decoder", "is_encoder_decoder", "add_cross_attention",
      "cross_attention_hidden_size", "tie_encoder_decoder", "sep_token_id", "decoder_start_token_id",
      // generation defaults, which transformers moves out of the model config
      "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature",
      "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
      "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
      "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens"};
  return keys;
}

class ConfigReader {
 public:
  ConfigReader(const nlohmann::json& j, std::string source) : j_(j), src_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& what) const { throw Error("config " + src_ + ": " + what); }
  [[noreturn]] void refuse(const std::string& key, const std::string& value, const std::string& why) const {
    fail("'" + key + "': " + value + " is not supported (" + why + ")");
  }

  const nlohmann::json* find(std::string_view key) const {
    auto it = j_.find(key);
    return it == j_.end() ? nullptr : &*it;
  }
  static std::optional<std::int64_t> as_int(const nlohmann::json& v) {
    if (v.is_number_unsigned()) {
      const auto u = v.get<std::uint64_t>();
      if (u > std::uint64_t(INT64_MAX)) return std::nullopt;
      return std::int64_t(u);
    }
    if (v.is_number_integer()) return v.get<std::int64_t>();
    return std::nullopt;
  }
  std::int64_t int_value(const nlohmann::json& v, const std::string& key) const {
    const auto i = as_int(v);
    if (!i) fail("'" + key + "' must be an integer, got " + v.dump());
    return *i;
  }
  double number_value(const nlohmann::json& v, const std::string& key) const {
    if (!v.is_number()) fail("'" + key + "' must be a number, got " + v.dump());
    return v.get<double>();
  }
  // An integer key; nullopt when absent or null.
  std::optional<std::int64_t> opt_int(std::string_view key) const {
    const auto* v = find(key);
    if (!v || v->is_null()) return std::nullopt;
    return int_value(*v, std::string(key));
  }
  std::int64_t req_int(std::string_view key) const {
    const auto v = opt_int(key);
    if (!v) fail("missing required integer '" + std::string(key) + "'");
    return *v;
  }
  std::optional<double> opt_number(std::string_view key) const {
    const auto* v = find(key);
    if (!v || v->is_null()) return std::nullopt;
    return number_value(*v, std::string(key));
  }
  std::optional<bool> opt_bool(std::string_view key) const {
    const auto* v = find(key);
    if (!v || v->is_null()) return std::nullopt;
    if (!v->is_boolean()) fail("'" + std::string(key) + "' must be true or false, got " + v->dump());
    return v->get<bool>();
  }
  std::optional<std::string> opt_string(std::string_view key) const {
    const auto* v = find(key);
    if (!v || v->is_null()) return std::nullopt;
    if (!v->is_string()) fail("'" + std::string(key) + "' must be a string, got " + v->dump());
    return v->get<std::string>();
  }

  // A rope_scaling / rope_parameters object: its scaling and, if it names one, its rope_theta.
  std::pair<plan::RopeScaling, std::optional<double>> rope(const nlohmann::json& o, const std::string& where) const {
    if (!o.is_object()) fail("'" + where + "' must be an object or null, got " + o.dump());
    std::optional<std::string> type;
    for (const char* k : {"rope_type", "type"}) {
      if (!o.contains(k)) continue;
      if (!o[k].is_string()) fail("'" + where + "." + k + "' must be a string");
      const auto t = o[k].get<std::string>();
      if (type && *type != t) fail("'" + where + "' names two types: rope_type '" + *type + "' and type '" + t + "'");
      type = t;
    }
    if (!type) {
      if (where == "rope_scaling") fail("'rope_scaling' has no 'rope_type' (or 'type')");
      type = "default";
    }
    plan::RopeScaling r;
    std::set<std::string> allowed = {"rope_type", "type", "rope_theta", "partial_rotary_factor"};
    if (*type == "default") {
      r.type = plan::RopeType::Default;
    } else if (*type == "linear") {
      r.type = plan::RopeType::Linear;
      allowed.insert("factor");
    } else if (*type == "llama3") {
      r.type = plan::RopeType::Llama3;
      allowed.insert({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"});
    } else {
      refuse(where + ".rope_type", "'" + *type + "'", "squeeze implements RoPE types default, linear and llama3");
    }
    for (const auto& [k, v] : o.items())
      if (!allowed.count(k)) refuse(where + "." + k, v.dump(), "RoPE type '" + *type + "' in squeeze takes no such parameter");
    auto num = [&](const char* k) -> double {
      if (!o.contains(k) || o[k].is_null()) fail("'" + where + "' of type '" + *type + "' needs '" + k + "'");
      return number_value(o[k], where + "." + k);
    };
    if (r.type != plan::RopeType::Default) r.factor = num("factor");
    if (r.type == plan::RopeType::Llama3) {
      r.low_freq_factor = num("low_freq_factor");
      r.high_freq_factor = num("high_freq_factor");
      if (!o.contains("original_max_position_embeddings"))
        fail("'" + where + "' of type 'llama3' needs 'original_max_position_embeddings'");
      r.original_max_position_embeddings = int_value(o["original_max_position_embeddings"], where + ".original_max_position_embeddings");
    }
    if (o.contains("partial_rotary_factor") && !(o["partial_rotary_factor"].is_number() && o["partial_rotary_factor"].get<double>() == 1.0))
      refuse(where + ".partial_rotary_factor", o["partial_rotary_factor"].dump(), "squeeze rotates the whole head");
    std::optional<double> theta;
    if (o.contains("rope_theta") && !o["rope_theta"].is_null()) theta = number_value(o["rope_theta"], where + ".rope_theta");
    return {r, theta};
  }

 private:
  const nlohmann::json& j_;
  std::string src_;
};
}  // namespace detail

// Reads and validates a parsed config.json object. `source` names it in errors (its path, usually).
inline LlamaConfig llama_config_from_json(const nlohmann::json& j, std::string_view source = "config.json", ConfigOptions options = {}) {
  const detail::ConfigReader r(j, std::string(source));
  if (!j.is_object()) r.fail("not a JSON object");
  LlamaConfig c;
  std::set<std::string, std::less<>> handled;
  auto take = [&](std::string_view k) { handled.insert(std::string(k)); };

  // what kind of model
  take("model_type");
  const auto model_type = r.opt_string("model_type");
  if (!model_type) r.fail("missing 'model_type' (expected \"llama\" or \"mistral\")");
  if (*model_type != "llama" && *model_type != "mistral")
    r.refuse("model_type", "'" + *model_type + "'",
             "squeeze loads LLaMA-architecture models: \"llama\", or \"mistral\" without sliding window");
  c.model_type = *model_type;
  const bool mistral = c.model_type == "mistral";
  take("architectures");
  if (const auto* a = r.find("architectures"); a && !a->is_null()) {
    if (!a->is_array()) r.fail("'architectures' must be a list of strings");
    for (const auto& v : *a)
      if (!v.is_string() || (v.get<std::string>() != "LlamaForCausalLM" && v.get<std::string>() != "MistralForCausalLM"))
        r.refuse("architectures", v.dump(), "squeeze loads causal-LM checkpoints: LlamaForCausalLM or MistralForCausalLM");
  }

  // geometry
  for (auto k : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"}) take(k);
  c.vocab_size = r.req_int("vocab_size");
  c.hidden_size = r.req_int("hidden_size");
  c.intermediate_size = r.req_int("intermediate_size");
  c.num_hidden_layers = r.req_int("num_hidden_layers");
  c.num_attention_heads = r.req_int("num_attention_heads");
  take("num_key_value_heads");
  // MistralConfig's default is 8 KV heads, LlamaConfig's the head count: a Mistral file must say.
  if (mistral && !r.opt_int("num_key_value_heads"))
    r.fail("a mistral config must state 'num_key_value_heads' (its default is 8, not the head count)");
  c.num_key_value_heads = r.opt_int("num_key_value_heads").value_or(c.num_attention_heads);
  take("head_dim");
  if (c.num_attention_heads <= 0) r.fail("'num_attention_heads' must be positive");
  c.head_dim = r.opt_int("head_dim").value_or(c.hidden_size / c.num_attention_heads);
  take("rms_norm_eps");
  c.rms_norm_eps = r.opt_number("rms_norm_eps").value_or(1e-6);
  take("max_position_embeddings");
  c.max_position_embeddings = r.opt_int("max_position_embeddings").value_or(mistral ? 4096 * 32 : 2048);
  take("tie_word_embeddings");
  c.tie_word_embeddings = r.opt_bool("tie_word_embeddings").value_or(false);

  // RoPE: rope_theta + rope_scaling (transformers 4.x) and/or rope_parameters (5.x)
  for (auto k : {"rope_theta", "rope_scaling", "rope_parameters"}) take(k);
  std::optional<double> theta = r.opt_number("rope_theta");
  auto merge_theta = [&](std::optional<double> t, const std::string& where) {
    if (!t) return;
    if (theta && *theta != *t)
      r.fail("'" + where + ".rope_theta' (" + std::to_string(*t) + ") disagrees with rope_theta (" + std::to_string(*theta) + ")");
    theta = t;
  };
  std::optional<plan::RopeScaling> from_scaling, from_params;
  if (const auto* s = r.find("rope_scaling"); s && !s->is_null()) {
    auto [rs, t] = r.rope(*s, "rope_scaling");
    from_scaling = rs;
    merge_theta(t, "rope_scaling");
  }
  if (const auto* p = r.find("rope_parameters"); p && !p->is_null()) {
    auto [rs, t] = r.rope(*p, "rope_parameters");
    from_params = rs;
    merge_theta(t, "rope_parameters");
  }
  if (from_scaling && from_params && !(*from_scaling == *from_params))
    r.fail("'rope_scaling' (type " + std::string(plan::rope_type_name(from_scaling->type)) + ") and 'rope_parameters' (type " +
           std::string(plan::rope_type_name(from_params->type)) + ") describe different RoPE scalings");
  c.rope_scaling = from_scaling ? *from_scaling : from_params ? *from_params : plan::RopeScaling{};
  c.rope_theta = theta.value_or(10000.0);

  // dtype
  for (auto k : {"torch_dtype", "dtype"}) take(k);
  std::optional<std::string> dt;
  for (auto k : {"torch_dtype", "dtype"}) {
    const auto v = r.opt_string(k);
    if (!v) continue;
    if (dt && *dt != *v) r.fail("'torch_dtype' and 'dtype' disagree ('" + *dt + "' vs '" + *v + "')");
    dt = v;
  }
  if (dt) {
    if (*dt == "float32")
      c.dtype = DType::F32;
    else if (*dt == "float16")
      c.dtype = DType::F16;
    else if (*dt == "bfloat16")
      c.dtype = DType::BF16;
    else
      r.refuse(r.find("torch_dtype") ? "torch_dtype" : "dtype", "'" + *dt + "'", "squeeze reads float32, float16 and bfloat16 checkpoints");
  }

  // special tokens
  for (auto k : {"bos_token_id", "eos_token_id", "pad_token_id"}) take(k);
  c.bos_token_id = r.opt_int("bos_token_id");
  c.pad_token_id = r.opt_int("pad_token_id");
  if (const auto* e = r.find("eos_token_id"); e && !e->is_null()) {
    if (e->is_array())
      for (const auto& v : *e) c.eos_token_ids.push_back(r.int_value(v, "eos_token_id"));
    else
      c.eos_token_ids.push_back(r.int_value(*e, "eos_token_id"));
  }

  // what squeeze does not implement, by key
  take("attention_bias");
  if (r.opt_bool("attention_bias").value_or(false)) r.refuse("attention_bias", "true", "squeeze's q/k/v/o projections have no bias");
  take("mlp_bias");
  if (r.opt_bool("mlp_bias").value_or(false)) r.refuse("mlp_bias", "true", "squeeze's gate/up/down projections have no bias");
  take("hidden_act");
  if (const auto act = r.opt_string("hidden_act"); act && *act != "silu")
    r.refuse("hidden_act", "'" + *act + "'", "squeeze's MLP is SwiGLU: silu");
  take("pretraining_tp");
  if (const auto tp = r.opt_int("pretraining_tp"); tp && *tp != 1)
    r.refuse("pretraining_tp", std::to_string(*tp), "squeeze computes each projection as one matmul; only 1 is supported");
  take("attention_dropout");
  if (const auto d = r.opt_number("attention_dropout"); d && *d != 0.0)
    r.refuse("attention_dropout", std::to_string(*d), "squeeze's attention has no dropout");
  take("sliding_window");
  if (const auto* w = r.find("sliding_window"); w && !w->is_null())
    r.refuse("sliding_window", w->dump(), "squeeze's attention is full causal attention; null is required");
  if (mistral && !r.find("sliding_window"))
    r.fail("a mistral config must state 'sliding_window': null (absent means MistralConfig's default 4096)");
  for (auto k : {"quantization_config", "auto_map"}) {
    take(k);
    if (const auto* v = r.find(k); v && !v->is_null())
      r.refuse(k, "present", std::string(k) == "auto_map" ? "custom model code is not loaded" : "squeeze loads unquantized weights only");
  }

  // the rest: harmless, or unknown
  std::vector<std::string> unknown;
  for (const auto& [k, _] : j.items()) {
    if (handled.count(k)) continue;
    if (detail::ignorable_config_keys().count(k) || options.allow_unknown_keys)
      c.ignored_keys.push_back(k);
    else
      unknown.push_back(k);
  }
  if (!unknown.empty()) {
    std::string list;
    for (const auto& k : unknown) list += (list.empty() ? "'" : ", '") + k + "'";
    r.fail("unknown key" + std::string(unknown.size() > 1 ? "s " : " ") + list +
           " (squeeze does not know whether it changes the model; ConfigOptions::allow_unknown_keys ignores such keys)");
  }
  c.validate("config " + std::string(source));
  return c;
}

// The same from config.json text.
inline LlamaConfig parse_llama_config(std::string_view text, std::string_view source = "config.json", ConfigOptions options = {}) {
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  check(!j.is_discarded(), "config " + std::string(source) + ": not valid JSON");
  return llama_config_from_json(j, source, options);
}

// A config.json file, or a model directory holding one.
inline LlamaConfig load_llama_config(const std::filesystem::path& path, ConfigOptions options = {}) {
  const auto file = std::filesystem::is_directory(path) ? path / "config.json" : path;
  std::ifstream in(file);
  check(bool(in), "config: cannot open " + file.string());
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_llama_config(ss.str(), file.string(), options);
}

// The config.json transformers' LlamaConfig / LlamaForCausalLM.from_pretrained reads back as `c`.
inline nlohmann::json llama_config_json(const LlamaConfig& c) {
  c.validate("llama_config_json");
  nlohmann::json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["initializer_range"] = 0.02;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  if (c.rope_scaling.type == plan::RopeType::Default) {
    j["rope_scaling"] = nullptr;
  } else {
    nlohmann::json s = {{"rope_type", std::string(plan::rope_type_name(c.rope_scaling.type))}, {"factor", c.rope_scaling.factor}};
    if (c.rope_scaling.type == plan::RopeType::Llama3) {
      s["low_freq_factor"] = c.rope_scaling.low_freq_factor;
      s["high_freq_factor"] = c.rope_scaling.high_freq_factor;
      s["original_max_position_embeddings"] = c.rope_scaling.original_max_position_embeddings;
    }
    j["rope_scaling"] = s;
  }
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["mlp_bias"] = false;
  j["pretraining_tp"] = 1;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["torch_dtype"] = std::string(detail::torch_dtype_name(c.dtype.value_or(DType::F32)));
  j["use_cache"] = true;
  j["bos_token_id"] = c.bos_token_id ? nlohmann::json(*c.bos_token_id) : nlohmann::json(nullptr);
  if (c.eos_token_ids.size() == 1)
    j["eos_token_id"] = c.eos_token_ids[0];
  else if (c.eos_token_ids.empty())
    j["eos_token_id"] = nullptr;
  else
    j["eos_token_id"] = c.eos_token_ids;
  if (c.pad_token_id) j["pad_token_id"] = *c.pad_token_id;
  return j;
}

// Writes <dir>/config.json (via a temporary file, so a failure leaves any old one intact).
inline void save_llama_config(const std::filesystem::path& dir, const LlamaConfig& c) {
  std::filesystem::create_directories(dir);
  save_json(dir / "config.json", llama_config_json(c), "config");
}

// The scaled RoPE inverse frequencies of a config (plan/rope.hpp).
inline std::vector<double> rope_inv_freq(const LlamaConfig& c) { return plan::rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling); }

}  // namespace squeeze::io
