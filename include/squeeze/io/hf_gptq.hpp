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
// io/gptq_file.hpp keys them) and the dense tensors float under squeeze's parameter names.
// Reading takes v1 zero points word-wise (quant/v1_zeros.hpp), files without g_idx (g_idx = i / group_size),
// scales F16 (F32 / BF16 rounded to fp16), biases F16 or F32 (kept as fp16, PackedLinear's bias type) and any
// sharding. Writing assembles every tensor in memory first (io/hf_quant_layout.hpp), fine up to a few GB.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "squeeze/io/gptq_file.hpp"
#include "squeeze/quant/v1_zeros.hpp"
#include "squeeze/io/hf_quant_layout.hpp"
#include "squeeze/io/json_file.hpp"

namespace squeeze::io {

struct HfGptqModel {
  LlamaConfig config;
  io::QuantizeConfig quant;
  std::map<std::string, quant::PackedLinear> layers;  // "block{i}.attn.q", ... (squeeze module names)
  std::map<std::string, std::vector<float>> dense;    // "embed.weight", "block{i}.attn_norm.weight", ...
};

struct HfGptqWriteOptions {
  std::uint64_t max_shard_bytes = 0;                          // 0: one model.safetensors
  quant::ZeroArithmetic zeros = quant::ZeroArithmetic::word;  // how v1 stores a zero point of 0
};

namespace detail {
// The GPTQ tensors of one layer as the Hugging Face layout stores them (bias only when present).
inline NamedTensors gptq_tensors(const quant::PackedLinear& p, const std::string& hf, const io::QuantizeConfig& q,
                                 quant::ZeroArithmetic zeros) {
  p.validate();
  check(p.bits == q.bits && p.group_size == q.group_size, "save_hf_gptq: layer " + hf + " has bits " + std::to_string(p.bits) + " group " +
                                                              std::to_string(p.group_size) + ", the quantization config bits " +
                                                              std::to_string(q.bits) + " group " + std::to_string(q.group_size));
  NamedTensors t;
  t.push_back({hf + ".qweight", owned_tensor<std::int32_t>(DType::I32, {p.qweight_rows(), p.out}, p.qweight)});
  t.push_back({hf + ".qzeros", owned_tensor<std::int32_t>(DType::I32, {p.groups(), p.qzeros_cols()}, quant::qzeros_from_packed(p, zeros))});
  t.push_back({hf + ".scales", owned_tensor<half>(DType::F16, {p.groups(), p.out}, p.scales)});
  t.push_back({hf + ".g_idx", owned_tensor<std::int32_t>(DType::I32, {p.in}, p.g_idx)});
  if (!p.bias.empty()) t.push_back({hf + ".bias", owned_tensor<half>(DType::F16, {p.out}, p.bias)});
  return t;
}
}  // namespace detail

// config.json's object: the LLaMA config (fp16) with the quantization_config transformers reads.
inline nlohmann::json hf_gptq_config_json(LlamaConfig c, const io::QuantizeConfig& q) {
  c.dtype = DType::F16;
  auto j = llama_config_json(c);
  j["quantization_config"] = io::quantize_config_json(q);
  return j;
}

// Writes `m` into `dir` (created) in the Hugging Face GPTQ layout. Every linear of every layer and every
// dense tensor the config implies must be present with its shape; extra names are refused.
inline void save_hf_gptq(const std::filesystem::path& dir, const HfGptqModel& m, const HfGptqWriteOptions& o = {}) {
  const auto linear = [&](const quant::PackedLinear& p, const std::string& hf, const std::vector<std::int64_t>& shape) {
    check(p.out == shape[0] && p.in == shape[1], "save_hf_gptq: layer " + hf + " is [" + std::to_string(p.out) + ", " +
                                                     std::to_string(p.in) + "], the config needs " + shape_string(shape));
    return detail::gptq_tensors(p, hf, m.quant, o.zeros);
  };
  const auto tensors = quantized_llama_tensors(m.config, m.layers, m.dense, DType::F16, linear, "save_hf_gptq");
  write_quantized_llama(dir, tensors, hf_gptq_config_json(m.config, m.quant), o.max_shard_bytes, "save_hf_gptq");
  save_json(dir / "quantize_config.json", io::quantize_config_json(m.quant), "save_hf_gptq");
}

namespace detail {
// One quantized layer from the checkpoint, its shapes checked against the config and the bit width.
inline quant::PackedLinear read_gptq_layer(const SafetensorsCheckpoint& ck, const std::string& hf, std::int64_t out, std::int64_t in,
                                           const io::QuantizeConfig& q) {
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
inline io::QuantizeConfig read_hf_gptq_quant_config(const std::filesystem::path& dir, const nlohmann::json& config) {
  std::optional<io::QuantizeConfig> a, b;
  if (config.contains("quantization_config"))
    a = io::parse_quantize_config(config["quantization_config"], "config.json quantization_config");
  if (std::filesystem::exists(dir / "quantize_config.json"))
    b = io::parse_quantize_config(read_json_object(dir / "quantize_config.json", "hf gptq"), "quantize_config.json");
  check(a || b, "hf gptq: " + dir.string() + " has neither a quantization_config in config.json nor a quantize_config.json");
  if (a && b)
    check(a->bits == b->bits && a->group_size == b->group_size,
          "hf gptq: config.json's quantization_config (bits " + std::to_string(a->bits) + ", group_size " + std::to_string(a->group_size) +
              ") and quantize_config.json (bits " + std::to_string(b->bits) + ", group_size " + std::to_string(b->group_size) +
              ") disagree");
  return a ? *a : *b;
}

inline HfGptqModel load_hf_gptq(const std::filesystem::path& dir) {
  HfGptqModel m;
  const auto j = read_json_object(dir / "config.json", "hf gptq");
  m.quant = read_hf_gptq_quant_config(dir, j);
  m.config = llama_config_of_quantized(j, dir / "config.json");
  const auto ck = SafetensorsCheckpoint::open(dir);
  for (const auto& e : hf_checkpoint_tensors(m.config))
    if (is_quantized_kind(e.kind))
      m.layers[module_of(e.squeeze)] = detail::read_gptq_layer(ck, module_of(e.hf), e.shape[0], e.shape[1], m.quant);
  m.dense = read_llama_dense(ck, m.config, "hf gptq");
  return m;
}

}  // namespace squeeze::io
