#pragma once
// Quantized Hugging Face LLaMA checkpoints into nn::Llama. A GPTQ directory (io/hf_gptq.hpp: AutoGPTQ / GPTQModel's
// layout, v1 zero points read word-wise, with or without g_idx, any sharding) becomes a model whose block
// projections are nn::QuantizedLinear over the packed weights (its CPU / GEMV / GEMM paths), the embedding, norms
// and head dense in the chosen dtype. nn::apply_lora adopts those layers as frozen bases, so the same model is the
// base of a gptq4-lora run:
//
//   nn::Llama m = nn::load_hf_gptq_llama("TheBloke-llama-gptq/", {.dtype = torch::kBFloat16, .device = torch::kCUDA});
//   nn::apply_lora<Strategy<Quantized<4, GPTQ, Group<128>>, LoRA<8, 16>, Precision<bf16, float>>>(*m);
//
// Host memory: the packed layers are read whole (io::load_hf_gptq), the dense model is built once and its
// projections released as they are replaced.
#include <torch/torch.h>

#include <filesystem>
#include <string>

#include "../io/hf_gptq.hpp"
#include "hf_llama.hpp"
#include "quantized_linear.hpp"

namespace squeeze::nn {

struct HfQuantizedLoadOptions {
  torch::ScalarType dtype = torch::kFloat32;  // the dense tensors and the layers' compute dtype
  torch::Device device = torch::kCPU;
};

inline Llama load_hf_gptq_llama(const std::filesystem::path& dir, const HfQuantizedLoadOptions& o = {}) {
  const io::HfGptqModel m = detail::torch_errors([&] { return io::load_hf_gptq(dir); });
  Llama model(from_hf_config(m.config));
  torch::NoGradGuard no_grad;
  const auto params = model->named_parameters();
  for (const auto& [name, values] : m.dense) {
    const torch::Tensor* p = params.find(name);
    TORCH_CHECK(p != nullptr, "load_hf_gptq_llama: ", dir.string(), " holds '", name, "', which the model has no parameter for");
    TORCH_CHECK(p->numel() == int64_t(values.size()), "load_hf_gptq_llama: ", dir.string(), ": '", name, "' has ", values.size(),
                " values, the model's parameter ", p->sizes());
    p->copy_(torch::from_blob(const_cast<float*>(values.data()), p->sizes(), torch::kFloat32));
  }
  model->to(o.device, o.dtype);  // before the packed layers join: their integer and fp16 tensors keep their types
  const auto modules = model->named_modules();
  for (const auto& [name, packed] : m.layers) {  // "block3.attn.q"
    const auto dot = name.rfind('.');
    const std::string parent_path = name.substr(0, dot), child = name.substr(dot + 1);
    const auto* parent = modules.find(parent_path);
    TORCH_CHECK(parent != nullptr && (*parent)->named_children().contains(child), "load_hf_gptq_llama: ", dir.string(),
                " holds the packed layer '", name, "', which the model does not have");
    const std::shared_ptr<torch::nn::Module> old = (*parent)->named_children()[child];
    if (auto lin = std::dynamic_pointer_cast<LinearImpl>(old)) {  // the typed member keeps pointing here: free its weight
      lin->weight.set_data(torch::empty({0}, lin->weight.options()));
      if (lin->has_bias()) lin->bias.set_data(torch::empty({0}, lin->bias.options()));
    }
    QuantizedLinear q(packed);
    q->to(o.device);
    (*parent)->replace_module(child, q);
  }
  return model;
}

}  // namespace squeeze::nn
