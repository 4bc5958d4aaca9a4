#pragma once
// What the quantized Hugging Face LLaMA layouts share (hf_gptq.hpp, hf_bnb.hpp): the seven linears of a block
// are quantized under their module names, embeddings / norms / lm_head stay dense; config.json carries a
// "quantization_config". Assembling the tensor list (every linear and dense tensor the config implies, nothing
// else), writing it sharded in state-dict order, and reading the dense part back.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "squeeze/io/hf_config.hpp"
#include "squeeze/io/hf_names.hpp"
#include "squeeze/io/safetensors_sharded.hpp"

namespace squeeze::io {

// A tensor with its own bytes, ready for a safetensors writer.
struct OwnedTensor {
  DType dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> bytes;
  TensorRef ref() const { return {dtype, shape, bytes}; }
};
template <class T>
OwnedTensor owned_tensor(DType d, std::vector<std::int64_t> shape, std::span<const T> v) {
  const auto b = std::as_bytes(v);
  return {d, std::move(shape), {b.begin(), b.end()}};
}

using NamedTensors = std::vector<std::pair<std::string, OwnedTensor>>;

// The seven linears of a block are quantized; embeddings, norms and the head stay dense.
inline bool is_quantized_kind(ParamKind k) {
  switch (k) {
    case ParamKind::Q:
    case ParamKind::K:
    case ParamKind::V:
    case ParamKind::O:
    case ParamKind::Gate:
    case ParamKind::Up:
    case ParamKind::Down:
      return true;
    default:
      return false;
  }
}
// "block0.attn.q.weight" -> "block0.attn.q"
inline std::string module_of(const std::string& weight_name) { return weight_name.substr(0, weight_name.size() - 7); }

// Every tensor of a quantized checkpoint of `c`, in state-dict order. `layers` maps squeeze module names
// ("block0.attn.q") to layers; `linear(layer, hf_module, shape [out, in])` gives a layer's tensors (checking its
// shape); `dense` maps squeeze parameter names to float values, written as `dense_dtype`. Errors start with `who`.
template <class Layers, class Linear>
NamedTensors quantized_llama_tensors(const LlamaConfig& c, const Layers& layers, const std::map<std::string, std::vector<float>>& dense,
                                     DType dense_dtype, Linear&& linear, const std::string& who) {
  NamedTensors out;
  std::size_t linears = 0, denses = 0;
  for (const auto& e : hf_checkpoint_tensors(c)) {
    if (is_quantized_kind(e.kind)) {
      const auto name = module_of(e.squeeze), hf = module_of(e.hf);
      const auto it = layers.find(name);
      check(it != layers.end(), who + ": no quantized layer '" + name + "' (for " + hf + ")");
      for (auto& t : linear(it->second, hf, e.shape)) out.push_back(std::move(t));
      ++linears;
      continue;
    }
    const auto it = dense.find(e.squeeze);
    check(it != dense.end(), who + ": no dense tensor '" + e.squeeze + "' (for " + e.hf + ")");
    std::int64_t numel = 1;
    for (auto d : e.shape) numel *= d;
    check(std::int64_t(it->second.size()) == numel,
          who + ": '" + e.squeeze + "' has " + std::to_string(it->second.size()) + " values, " + e.hf + " is " + shape_string(e.shape));
    out.push_back({e.hf, {dense_dtype, e.shape, encode_float(dense_dtype, it->second)}});
    ++denses;
  }
  check(linears == layers.size(), who + ": " + std::to_string(layers.size() - linears) +
                                      " quantized layers are not LLaMA linears of this config (names like 'block0.attn.q')");
  const std::size_t tied_head = c.tie_word_embeddings && dense.count("head.weight") ? 1 : 0;  // no file name of its own
  check(denses + tied_head == dense.size(), who + ": some dense tensors are not LLaMA tensors of this config");
  return out;
}

// Writes the tensors (sharded at max_shard_bytes, 0 = one file) and config.json into `dir`.
inline void write_quantized_llama(const std::filesystem::path& dir, const NamedTensors& tensors, const nlohmann::json& config,
                                  std::uint64_t max_shard_bytes, const std::string& who) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.dtype, t.shape});
  std::filesystem::create_directories(dir);
  ShardedSafetensorsWriter w(dir, specs, max_shard_bytes, {{"format", "pt"}, {"quantizer", "squeeze"}});
  for (const auto& [name, t] : tensors) w.write(name, std::span<const std::byte>(t.bytes));
  w.finish();
  save_json(dir / "config.json", config, who);
}

inline nlohmann::json read_json_object(const std::filesystem::path& f, const std::string& who) {
  std::ifstream in(f);
  check(bool(in), who + ": cannot open " + f.string());
  auto j = nlohmann::json::parse(in, nullptr, false);
  check(!j.is_discarded() && j.is_object(), who + ": " + f.string() + " is not a JSON object");
  return j;
}

// config.json less its quantization_config, as a LlamaConfig.
inline LlamaConfig llama_config_of_quantized(nlohmann::json j, const std::filesystem::path& file) {
  j.erase("quantization_config");
  return llama_config_from_json(j, file.string());
}

// The dense tensors of a checkpoint of `c`, by squeeze name (the tied embedding fills head.weight too).
inline std::map<std::string, std::vector<float>> read_llama_dense(const SafetensorsCheckpoint& ck, const LlamaConfig& c,
                                                                  const std::string& who) {
  std::map<std::string, std::vector<float>> dense;
  for (const auto& e : hf_checkpoint_tensors(c)) {
    if (is_quantized_kind(e.kind)) continue;
    check(ck.contains(e.hf), who + ": tensor '" + e.hf + "' is missing");
    check(ck.info(e.hf).shape == e.shape,
          who + ": tensor '" + e.hf + "' is " + shape_string(ck.info(e.hf).shape) + ", expected " + shape_string(e.shape));
    const auto v = ck.read_float(e.hf);
    for (const auto& s : squeeze_names_for(e.hf, c)) dense[s] = v;
  }
  return dense;
}

}  // namespace squeeze::io
