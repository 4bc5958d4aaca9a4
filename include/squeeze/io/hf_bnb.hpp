#pragma once
// bitsandbytes NF4 LLaMA checkpoints in the Hugging Face layout (what from_pretrained saves for
// load_in_4bit=True), torch-free: config.json with the BitsAndBytesConfig quantization_config, and per linear
// module the Linear4bit keys of io/bnb_nf4.hpp; embeddings, norms and lm_head dense in the config's dtype
// (bf16 when it names none). In memory: bitsandbytes' weights under squeeze's module names ("block0.attn.q").
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "squeeze/io/bnb_nf4.hpp"
#include "squeeze/io/hf_quant_layout.hpp"

namespace squeeze::io {

struct HfBnbModel {
  LlamaConfig config;
  BnbConfig bnb;
  std::map<std::string, BnbNf4Weight> layers;       // squeeze module names
  std::map<std::string, std::vector<float>> dense;  // squeeze parameter names
};

inline nlohmann::json hf_bnb_config_json(LlamaConfig c, const BnbConfig& b) {
  if (!c.dtype) c.dtype = DType::BF16;
  auto j = llama_config_json(c);
  j["quantization_config"] = bnb_quantization_config_json(b);
  return j;
}

inline void save_hf_bnb(const std::filesystem::path& dir, const HfBnbModel& m, std::uint64_t max_shard_bytes = 0) {
  const auto linear = [&](const BnbNf4Weight& w, const std::string& hf, const std::vector<std::int64_t>& shape) {
    check(w.info.shape == shape,
          "save_hf_bnb: layer " + hf + " is " + shape_string(w.info.shape) + ", the config needs " + shape_string(shape));
    check(w.info.nested == m.bnb.double_quant, "save_hf_bnb: layer " + hf + (w.info.nested ? " is" : " is not") +
                                                   " nested but bnb_4bit_use_double_quant is " + (m.bnb.double_quant ? "true" : "false"));
    return bnb_nf4_tensors(hf, w);
  };
  const auto tensors = quantized_llama_tensors(m.config, m.layers, m.dense, m.config.dtype.value_or(DType::BF16), linear, "save_hf_bnb");
  write_quantized_llama(dir, tensors, hf_bnb_config_json(m.config, m.bnb), max_shard_bytes, "save_hf_bnb");
}

inline HfBnbModel load_hf_bnb(const std::filesystem::path& dir) {
  HfBnbModel m;
  const auto j = read_json_object(dir / "config.json", "hf bitsandbytes");
  check(j.contains("quantization_config"), "hf bitsandbytes: " + (dir / "config.json").string() + " has no quantization_config");
  m.bnb = parse_bnb_quantization_config(j["quantization_config"]);
  m.config = llama_config_of_quantized(j, dir / "config.json");
  const auto ck = SafetensorsCheckpoint::open(dir);
  for (const auto& e : hf_checkpoint_tensors(m.config)) {
    if (!is_quantized_kind(e.kind)) continue;
    auto w = read_bnb_nf4(ck, module_of(e.hf));
    check(w.info.shape == e.shape, "hf bitsandbytes: " + module_of(e.hf) + " quant state has shape " + shape_string(w.info.shape) +
                                       ", the config needs " + shape_string(e.shape));
    m.layers[module_of(e.squeeze)] = std::move(w);
  }
  m.dense = read_llama_dense(ck, m.config, "hf bitsandbytes");
  return m;
}

}  // namespace squeeze::io
