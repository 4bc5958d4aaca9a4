#pragma once
// GPTQ LLaMA checkpoints in the Hugging Face layout (what transformers / GPTQModel / vLLM load), torch-free:
//   config.json              LlamaForCausalLM config + "quantization_config" (quant_method "gptq", bits,
//                            group_size, desc_act, sym, checkpoint_format "gptq"), torch_dtype float16
//   quantize_config.json     the same keys (AutoGPTQ / GPTQModel read this one)
//   model.safetensors or model-0000k-of-0000n.safetensors + model.safetensors.index.json:
//     model.layers.{i}.self_attn.{q,k,v,o}_proj.{qweight,qzeros,scales,g_idx[,bias]}
//     model.layers.{i}.mlp.{gate,up,down}_proj.{...}
//       qweight I32 [in*bits/32, out]  qzeros I32 [groups, out*bits/32]  scales F16 [groups, out]  g_idx I32 [in]
//     embeddings, norms and lm_head F16 under their usual names (io/hf_names.hpp)
// In memory the layers are squeeze's PackedLinear under squeeze's module names ("block3.attn.q", as
// quant/gptq_file.hpp keys them) and the dense tensors float under squeeze's parameter names.
// Reading takes v1 zero points word-wise (quant/v1_zeros.hpp), files without g_idx (g_idx = i / group_size),
// biases F16 or F32 (kept as fp16, PackedLinear's bias type) and any sharding.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../quant/gptq_file.hpp"
#include "../quant/v1_zeros.hpp"
#include "hf_config.hpp"
#include "hf_names.hpp"
#include "json_file.hpp"
#include "safetensors_sharded.hpp"

namespace squeeze::io {

struct HfGptqModel {
  LlamaConfig config;
  quant::QuantizeConfig quant;
  std::map<std::string, quant::PackedLinear> layers;  // "block{i}.attn.q", ... (squeeze module names)
  std::map<std::string, std::vector<float>> dense;     // "embed.weight", "block{i}.attn_norm.weight", ...
};

struct HfGptqWriteOptions {
  std::uint64_t max_shard_bytes = 0;  // 0: one model.safetensors
  quant::ZeroArithmetic zeros = quant::ZeroArithmetic::word;  // how v1 stores a zero point of 0
};

namespace detail {
// The seven linears of a block are quantized; embeddings, norms and the head stay dense.
inline bool is_linear_kind(ParamKind k) {
  switch (k) {
    case ParamKind::Q: case ParamKind::K: case ParamKind::V: case ParamKind::O: case ParamKind::Gate: case ParamKind::Up:
    case ParamKind::Down: return true;
    default: return false;
  }
}
// "x.weight" -> "x"
inline std::string module_of(const std::string& weight_name) { return weight_name.substr(0, weight_name.size() - 7); }

// The five GPTQ parts of one layer as the Hugging Face layout stores them (bias only when present).
inline std::vector<TensorSpec> gptq_specs(const std::string& hf_module, const quant::PackedLinear& p) {
  std::vector<TensorSpec> s = {{hf_module + ".qweight", DType::I32, {p.qweight_rows(), p.out}},
                               {hf_module + ".qzeros", DType::I32, {p.groups(), p.qzeros_cols()}},
                               {hf_module + ".scales", DType::F16, {p.groups(), p.out}},
                               {hf_module + ".g_idx", DType::I32, {p.in}}};
  if (!p.bias.empty()) s.push_back({hf_module + ".bias", DType::F16, {p.out}});
  return s;
}
}  // namespace detail

// config.json's object: the LLaMA config (fp16) with the quantization_config transformers reads.
inline nlohmann::json hf_gptq_config_json(LlamaConfig c, const quant::QuantizeConfig& q) {
  c.dtype = DType::F16;
  auto j = llama_config_json(c);
  j["quantization_config"] = quant::quantize_config_json(q);
  return j;
}

// Writes `m` into `dir` (created) in the Hugging Face GPTQ layout. Every linear of every layer and every
// dense tensor the config implies must be present with its shape; extra names are refused.
inline void save_hf_gptq(const std::filesystem::path& dir, const HfGptqModel& m, const HfGptqWriteOptions& o = {}) {
  const auto entries = hf_checkpoint_tensors(m.config);
  std::vector<TensorSpec> specs;
  std::map<std::string, std::vector<std::int32_t>> qzeros;  // by HF module name
  std::map<std::string, std::vector<std::byte>> dense16;     // by HF tensor name
  std::size_t linears = 0, denses = 0;
  for (const auto& e : entries) {
    if (detail::is_linear_kind(e.kind)) {
      const auto name = detail::module_of(e.squeeze), hf = detail::module_of(e.hf);
      const auto it = m.layers.find(name);
      check(it != m.layers.end(), "save_hf_gptq: no quantized layer '" + name + "' (for " + hf + ")");
      const auto& p = it->second;
      p.validate();
      check(p.out == e.shape[0] && p.in == e.shape[1], "save_hf_gptq: layer '" + name + "' is [" + std::to_string(p.out) + ", " +
                                                           std::to_string(p.in) + "], the config needs " + shape_string(e.shape));
      check(p.bits == m.quant.bits && p.group_size == m.quant.group_size,
            "save_hf_gptq: layer '" + name + "' has bits " + std::to_string(p.bits) + " group " + std::to_string(p.group_size) +
                ", the quantization config bits " + std::to_string(m.quant.bits) + " group " + std::to_string(m.quant.group_size));
      for (auto& s : detail::gptq_specs(hf, p)) specs.push_back(std::move(s));
      qzeros[hf] = quant::qzeros_from_packed(p, o.zeros);
      ++linears;
    } else {
      const auto it = m.dense.find(e.squeeze);
      check(it != m.dense.end(), "save_hf_gptq: no dense tensor '" + e.squeeze + "' (for " + e.hf + ")");
      std::int64_t numel = 1;
      for (auto d : e.shape) numel *= d;
      check(std::int64_t(it->second.size()) == numel,
            "save_hf_gptq: '" + e.squeeze + "' has " + std::to_string(it->second.size()) + " values, " + e.hf + " is " + shape_string(e.shape));
      specs.push_back({e.hf, DType::F16, e.shape});
      dense16[e.hf] = encode_float(DType::F16, it->second);
      ++denses;
    }
  }
  check(linears == m.layers.size(), "save_hf_gptq: " + std::to_string(m.layers.size() - linears) +
                                        " quantized layers are not LLaMA linears of this config (names like 'block0.attn.q')");
  // head.weight is in dense but has no file name under tied embeddings
  const std::size_t tied_head = m.config.tie_word_embeddings && m.dense.count("head.weight") ? 1 : 0;
  check(denses + tied_head == m.dense.size(), "save_hf_gptq: some dense tensors are not LLaMA tensors of this config");

  std::filesystem::create_directories(dir);
  ShardedSafetensorsWriter w(dir, specs, o.max_shard_bytes, {{"format", "pt"}, {"quantizer", "squeeze"}});
  for (const auto& e : entries) {
    if (!detail::is_linear_kind(e.kind)) {
      w.write(e.hf, std::span<const std::byte>(dense16[e.hf]));
      continue;
    }
    const auto& p = m.layers.at(detail::module_of(e.squeeze));
    const auto hf = detail::module_of(e.hf);
    w.write(hf + ".qweight", std::as_bytes(std::span(p.qweight)));
    w.write(hf + ".qzeros", std::as_bytes(std::span(qzeros[hf])));
    w.write(hf + ".scales", std::as_bytes(std::span(p.scales)));
    w.write(hf + ".g_idx", std::as_bytes(std::span(p.g_idx)));
    if (!p.bias.empty()) w.write(hf + ".bias", std::as_bytes(std::span(p.bias)));
  }
  w.finish();
  save_json(dir / "config.json", hf_gptq_config_json(m.config, m.quant), "save_hf_gptq");
  save_json(dir / "quantize_config.json", quant::quantize_config_json(m.quant), "save_hf_gptq");
}

namespace detail {
inline nlohmann::json read_json_file(const std::filesystem::path& f) {
  std::ifstream in(f);
  check(bool(in), "hf gptq: cannot open " + f.string());
  auto j = nlohmann::json::parse(in, nullptr, false);
  check(!j.is_discarded() && j.is_object(), "hf gptq: " + f.string() + " is not a JSON object");
  return j;
}

// One quantized layer from the checkpoint, its shapes checked against the config and the bit width.
inline quant::PackedLinear read_gptq_layer(const SafetensorsCheckpoint& ck, const std::string& hf, std::int64_t out, std::int64_t in,
                                           const quant::QuantizeConfig& q) {
  quant::PackedLinear p;
  p.bits = q.bits;
  p.group_size = q.group_size;
  p.in = in;
  p.out = out;
  const auto need = [&](const std::string& part, std::vector<std::int64_t> shape, std::initializer_list<DType> dtypes) {
    const auto name = hf + part;
    check(ck.contains(name), "hf gptq: tensor '" + name + "' is missing");
    const auto& t = ck.info(name);
    check(t.shape == shape, "hf gptq: tensor '" + name + "' is " + shape_string(t.shape) + ", expected " + shape_string(shape) + " for [" +
                                std::to_string(out) + ", " + std::to_string(in) + "] at " + std::to_string(q.bits) + " bits, group_size " +
                                std::to_string(q.group_size > 0 ? q.group_size : -1));
    bool ok = false;
    for (auto d : dtypes) ok = ok || t.dtype == d;
    check(ok, "hf gptq: tensor '" + name + "' has dtype " + std::string(dtype_name(t.dtype)) + ", expected " +
                  std::string(dtype_name(*dtypes.begin())));
    return name;
  };
  const auto to_half = [](const std::vector<float>& v) {
    std::vector<half> h(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) h[i] = from_float<half>(v[i]);
    return h;
  };
  p.qweight = ck.read<std::int32_t>(need(".qweight", {p.qweight_rows(), out}, {DType::I32}), DType::I32);
  const auto qz = ck.read<std::int32_t>(need(".qzeros", {p.groups(), p.qzeros_cols()}, {DType::I32}), DType::I32);
  p.qzeros = quant::qzeros_to_packed(qz, p.groups(), out, q.bits, quant::ZeroArithmetic::word);
  p.scales = to_half(ck.read_float(need(".scales", {p.groups(), out}, {DType::F16, DType::F32, DType::BF16})));
  if (ck.contains(hf + ".g_idx")) {
    p.g_idx = ck.read<std::int32_t>(need(".g_idx", {in}, {DType::I32}), DType::I32);
  } else {
    check(!q.desc_act, "hf gptq: tensor '" + hf + ".g_idx' is missing and desc_act is true (act-order needs it)");
    p.g_idx = quant::default_g_idx(in, q.group_size);
  }
  if (ck.contains(hf + ".bias")) p.bias = to_half(ck.read_float(need(".bias", {out}, {DType::F16, DType::F32})));
  try {
    p.validate();
  } catch (const Error& e) {
    throw Error("hf gptq: layer '" + hf + "': " + e.what());
  }
  return p;
}
}  // namespace detail

// The quantization config of a model directory: config.json's quantization_config, else quantize_config.json;
// when both exist they must agree on bits and group_size.
inline quant::QuantizeConfig read_hf_gptq_quant_config(const std::filesystem::path& dir, const nlohmann::json& config) {
  std::optional<quant::QuantizeConfig> a, b;
  if (config.contains("quantization_config"))
    a = quant::parse_quantize_config(config["quantization_config"], "config.json quantization_config");
  if (std::filesystem::exists(dir / "quantize_config.json"))
    b = quant::parse_quantize_config(detail::read_json_file(dir / "quantize_config.json"), "quantize_config.json");
  check(a || b, "hf gptq: " + dir.string() + " has neither a quantization_config in config.json nor a quantize_config.json");
  if (a && b)
    check(a->bits == b->bits && a->group_size == b->group_size,
          "hf gptq: config.json's quantization_config (bits " + std::to_string(a->bits) + ", group_size " + std::to_string(a->group_size) +
              ") and quantize_config.json (bits " + std::to_string(b->bits) + ", group_size " + std::to_string(b->group_size) + ") disagree");
  return a ? *a : *b;
}

inline HfGptqModel load_hf_gptq(const std::filesystem::path& dir) {
  HfGptqModel m;
  auto j = detail::read_json_file(dir / "config.json");
  m.quant = read_hf_gptq_quant_config(dir, j);
  j.erase("quantization_config");
  m.config = llama_config_from_json(j, (dir / "config.json").string());
  const auto ck = SafetensorsCheckpoint::open(dir);
  for (const auto& e : hf_checkpoint_tensors(m.config)) {
    if (detail::is_linear_kind(e.kind)) {
      m.layers[detail::module_of(e.squeeze)] = detail::read_gptq_layer(ck, detail::module_of(e.hf), e.shape[0], e.shape[1], m.quant);
      continue;
    }
    check(ck.contains(e.hf), "hf gptq: tensor '" + e.hf + "' is missing");
    check(ck.info(e.hf).shape == e.shape, "hf gptq: tensor '" + e.hf + "' is " + shape_string(ck.info(e.hf).shape) + ", expected " +
                                              shape_string(e.shape));
    auto v = ck.read_float(e.hf);
    for (const auto& s : squeeze_names_for(e.hf, m.config)) m.dense[s] = v;
  }
  return m;
}

}  // namespace squeeze::io
