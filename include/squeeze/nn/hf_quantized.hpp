#pragma once
// Quantized Hugging Face LLaMA checkpoints into nn::Llama. A bitsandbytes NF4 directory (io/hf_bnb.hpp: what
// transformers writes for load_in_4bit, nested statistics or plain) becomes a model of nn::Nf4Linear projections
// holding bitsandbytes' codes as they are and its decoded block scales (fp32: what dequantize_4bit multiplies by),
// the base of a QLoRA run. A GPTQ directory (io/hf_gptq.hpp: AutoGPTQ / GPTQModel's
// layout, v1 zero points read word-wise, with or without g_idx, any sharding) becomes a model whose block
// projections are nn::QuantizedLinear over the packed weights (its CPU / GEMV / GEMM paths), the embedding, norms
// and head dense in the chosen dtype. nn::apply_lora adopts those layers as frozen bases, so the same model is the
// base of a gptq4-lora run:
//
//   nn::Llama m = nn::load_hf_gptq_llama("TheBloke-llama-gptq/", {.dtype = torch::kBFloat16, .device = torch::kCUDA});
//   nn::apply_lora<Strategy<Quantized<4, GPTQ, Group<128>>, LoRA<8, 16>, Precision<bf16, float>>>(*m);
//
// Host memory: the packed layers are read whole (io::load_hf_gptq); the model is built once, uninitialised in its dtype
// on its device (ParamInit), and its projections released as they are replaced.
#include <torch/torch.h>

#include <filesystem>
#include <string>

#include "squeeze/io/hf_bnb.hpp"
#include "squeeze/io/hf_gptq.hpp"
#include "squeeze/nn/hf_llama.hpp"
#include "squeeze/nn/lora.hpp"
#include "squeeze/nn/quantized_linear.hpp"

namespace squeeze::nn {

struct HfQuantizedLoadOptions {
  torch::ScalarType dtype = torch::kFloat32;  // the dense tensors and the layers' compute dtype
  torch::Device device = torch::kCPU;
};

namespace detail {
// A model of `config` with its dense tensors from `dense` (squeeze names, float) and each block projection named in
// `layers` replaced by make(layer): on o.device, dense tensors in o.dtype.
template <class Layers, class Make>
Llama quantized_llama(const std::filesystem::path& dir, const io::LlamaConfig& config,
                      const std::map<std::string, std::vector<float>>& dense, const Layers& layers, Make&& make,
                      const HfQuantizedLoadOptions& o, const char* what) {
  // Built uninitialised in its dtype on its device: every parameter is written from `dense` or replaced by its
  // quantized projection (checked below), so a 7B model is neither drawn at random nor built in float on the host.
  Llama model(from_hf_config(config), ParamInit{torch::TensorOptions().dtype(o.dtype).device(o.device), /*random=*/false});
  torch::NoGradGuard no_grad;
  const auto params = model->named_parameters();
  for (const auto& [name, values] : dense) {
    if (config.tie_word_embeddings && name == "head.weight") continue;  // the embedding's values again: a tied model reads embed.weight
    const torch::Tensor* p = params.find(name);
    TORCH_CHECK(p != nullptr, what, ": ", dir.string(), " holds '", name, "', which the model has no parameter for");
    TORCH_CHECK(p->numel() == int64_t(values.size()), what, ": ", dir.string(), ": '", name, "' has ", values.size(),
                " values, the model's parameter ", p->sizes());
    p->copy_(torch::from_blob(const_cast<float*>(values.data()), p->sizes(), torch::kFloat32));
  }
  for (const auto& p : params) {
    const std::string& name = p.key();
    const bool replaced = name.ends_with(".weight") && layers.count(name.substr(0, name.size() - 7)) > 0;
    TORCH_CHECK(replaced || dense.count(name) > 0, what, ": ", dir.string(), " has neither a dense tensor nor a quantized layer for the ",
                "model's '", name, "'");
  }
  const auto modules = model->named_modules();
  for (const auto& [name, layer] : layers) {  // "block3.attn.q"
    const auto dot = name.rfind('.');
    const std::string parent_path = name.substr(0, dot), child = name.substr(dot + 1);
    const auto* parent = modules.find(parent_path);
    TORCH_CHECK(parent != nullptr && (*parent)->named_children().contains(child), what, ": ", dir.string(), " holds the quantized layer '",
                name, "', which the model does not have");
    const std::shared_ptr<torch::nn::Module> old = (*parent)->named_children()[child];
    if (auto lin = std::dynamic_pointer_cast<LinearImpl>(old)) {  // the typed member keeps pointing here: free its weight
      lin->weight.set_data(torch::empty({0}, lin->weight.options()));
      if (lin->has_bias()) lin->bias.set_data(torch::empty({0}, lin->bias.options()));
    }
    (*parent)->replace_module(child, make(layer));
  }
  return model;
}
}  // namespace detail

inline Llama load_hf_bnb_llama(const std::filesystem::path& dir, const HfQuantizedLoadOptions& o = {}) {
  const io::HfBnbModel m = detail::torch_errors([&] { return io::load_hf_bnb(dir); });
  return detail::quantized_llama(
      dir, m.config, m.dense, m.layers,
      [&](const io::BnbNf4Weight& w) {
        TORCH_CHECK(w.info.shape.size() == 2, "load_hf_bnb_llama: an NF4 weight of shape ", io::shape_string(w.info.shape),
                    " is not [out, in]");
        const quant::Nf4Packed p = detail::torch_errors([&] { return io::to_nf4_packed(w); });
        Nf4Linear l(Nf4Weight::from_packed(p, w.info.shape[0], w.info.shape[1], o.device), torch::Tensor());
        return l;
      },
      o, "load_hf_bnb_llama");
}

inline Llama load_hf_gptq_llama(const std::filesystem::path& dir, const HfQuantizedLoadOptions& o = {}) {
  const io::HfGptqModel m = detail::torch_errors([&] { return io::load_hf_gptq(dir); });
  return detail::quantized_llama(
      dir, m.config, m.dense, m.layers,
      [&](const quant::PackedLinear& packed) {
        QuantizedLinear q(packed);
        q->to(o.device);
        return q;
      },
      o, "load_hf_gptq_llama");
}

}  // namespace squeeze::nn
