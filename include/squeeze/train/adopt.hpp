#pragma once
// How make_trainer turns the model a user built into what Strategy S trains, before any partition exists:
//   1. refuses plain libtorch layers S would have to shard (Stage 3), quantize (Quantized<...>) or swap for an adapted
//      or packed layer (LoRA's projections), naming each with its parameter count, unless TrainerOptions::replicate
//      lists it (then it is kept whole, counted in memory()); under LoRA every other plain layer is frozen as it is;
//   2. refuses parameters in a dtype S cannot start from (anything but float and S's compute type);
//   3. converts the module to S's compute type, keeping the float values of trainable parameters for the masters
//      (under a quantized base, all but the dense linears apply_lora packs: it moves those one at a time);
//   4. LoRA strategies: apply_lora<S> (nn/lora.hpp) gives squeeze::nn::Linear layers their frozen (dense, NF4 or
//      GPTQ-packed) base and adapters, the same objects throughout;
//   5. Checkpointed strategies: switches on every nn::Recomputable module (nn::Blocks, nn::Llama); a model with none
//      must call nn::checkpoint(block, x), which the trainer checks on its first step.
// This is the layer above nn/: the engine's other files know nothing of modules.
#include <torch/torch.h>

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "squeeze/nn/activation_checkpoint.hpp"
#include "squeeze/nn/layers.hpp"
#include "squeeze/nn/lora.hpp"
#include "squeeze/policy/strategy.hpp"
#include "squeeze/engine/torch_types.hpp"

namespace squeeze::train {

// The engine below the trainer (flat parameters, buckets, gather units, offload, streams, collectives): its
// names are the trainer's vocabulary, and squeeze::train::X keeps naming them for code written against it.
using namespace squeeze::engine;

struct AdoptOptions {
  std::vector<std::string> replicate;   // TrainerOptions::replicate
  std::optional<torch::Device> device;  // TrainerOptions::device
  int prefetch_depth = 1;               // TrainerOptions::prefetch_depth: a streamed quantized base's blocks copied ahead
};

struct AdoptedModel {
  std::map<std::string, torch::Tensor> float_values;  // trainable parameters' float values before the conversion
  std::vector<nn::AdaptedLayer> adapted;              // LoRA: the layers that got adapters
  int64_t quantized_layers = 0;                       // layers whose base S quantized
  int recomputable = 0;                               // nn::Recomputable modules switched on
  int64_t fp8_layers = 0;                             // Precision<fp8, ...>: linears whose GEMMs run in FP8
};

namespace detail {
// The model's blocks, in module order: modules deriving from GatherUnit (nn::Llama's blocks) and an nn::Blocks'
// children. What the streamed base moves to host memory one at a time and where FP8 GEMMs run.
inline std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> blocks_of(torch::nn::Module& model) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> blocks;
  for (const auto& item : model.named_modules()) {
    if (dynamic_cast<const GatherUnit*>(item.value().get()) != nullptr) blocks.emplace_back(item.key(), item.value());
    if (dynamic_cast<const nn::BlocksImpl*>(item.value().get()) != nullptr)
      for (const auto& c : item.value()->named_children())
        blocks.emplace_back(item.key().empty() ? c.key() : item.key() + "." + c.key(), c.value());
  }
  return blocks;
}
// module.to(device, dtype) (module.to(dtype) without a device), except the dense linears apply_lora packs.
inline void to_except_packed_bases(torch::nn::Module& m, const std::optional<torch::Device>& device, torch::Dtype dtype) {
  for (const auto& c : m.named_children()) {
    if (nn::detail::is_packed_base(c.key(), *c.value())) continue;
    if (nn::detail::holds_packed_base(*c.value()))
      to_except_packed_bases(*c.value(), device, dtype);
    else if (device)
      c.value()->to(*device, dtype);
    else
      c.value()->to(dtype);
  }
  torch::NoGradGuard ng;
  const auto moved = [&](const torch::Tensor& t) { return device ? t.to(*device, dtype) : t.to(dtype); };
  for (auto& p : m.named_parameters(/*recurse=*/false)) p.value().set_data(moved(p.value()));
  for (auto& b : m.named_buffers(/*recurse=*/false)) b.value().set_data(moved(b.value()));
}
}  // namespace detail

// "norm" matches "norm" and "blocks.3.norm"; "*" matches every module.
inline bool listed(const std::vector<std::string>& names, const std::string& module) {
  for (const auto& n : names) {
    if (n == "*" || n == module) return true;
    if (module.size() > n.size() && module.ends_with(n) && module[module.size() - n.size() - 1] == '.') return true;
  }
  return false;
}

inline bool is_embedding(const torch::nn::Module& m) {
  return dynamic_cast<const nn::EmbeddingImpl*>(&m) != nullptr || dynamic_cast<const torch::nn::EmbeddingImpl*>(&m) != nullptr;
}

template <StrategyType S>
AdoptedModel adopt_model(torch::nn::Module& model, const AdoptOptions& o) {
  using Compute = typename S::compute_type;
  const auto compute = torch_dtype<Compute>();
  AdoptedModel out;

  // 1. plain layers S cannot handle
  std::string refused;
  int64_t refused_count = 0;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    torch::nn::Module& m = *item.value();
    const std::string name = item.key().empty() ? "(the model itself)" : item.key();
    int64_t own = 0;
    for (const auto& p : m.parameters(/*recurse=*/false))
      if (p.defined() && p.requires_grad()) own += p.numel();
    const bool torch_linear = dynamic_cast<torch::nn::LinearImpl*>(&m) != nullptr;
    const bool squeeze_layer = dynamic_cast<Shardable*>(&m) != nullptr || dynamic_cast<KeptWhole*>(&m) != nullptr;
    std::string why;
    if constexpr (S::has_lora) {
      // LoRA freezes every parameter as it is; apply_lora swaps out only the projections (LoRA's targets, and under a
      // quantized base all seven, packed), which a plain layer's typed member would not follow. Any other plain layer
      // (a torch::nn::Linear head) stays frozen and whole, as under replicate.
      const std::string child = item.key().substr(item.key().rfind('.') + 1);
      if (torch_linear && nn::detail::is_lora_target(child, S::quantized_weights ? 127u : S::lora::targets))
        why = S::quantized_weights ? "S quantizes linear layers of this name" : "LoRA adapts layers of this name";
    } else if constexpr (S::quantized_weights) {
      if (torch_linear) why = "S quantizes linear layers";
    } else if constexpr (S::stage == 3) {
      if (own > 0 && !squeeze_layer) why = "Stage 3 shards every layer";
    }
    if (why.empty() || listed(o.replicate, item.key())) continue;
    refused += "\n  '" + name + "' (" + m.name() + ", " + std::to_string(own) + " parameters): " + why;
    ++refused_count;
  }
  TORCH_CHECK(refused_count == 0, "make_trainer: ", refused_count, " plain libtorch layer(s) the Strategy cannot handle:", refused,
              "\nWrite squeeze::nn::Linear / squeeze::nn::Embedding for torch::nn::Linear / Embedding (same options and "
              "parameters), or keep small layers whole on every rank with TrainerOptions::replicate (e.g. .replicate = "
              "{\"norm\"}).");

  // 2., 3. dtypes and the conversion
  bool convert = false;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    const auto t = p.value().scalar_type();
    if (!p.value().is_floating_point()) continue;
    TORCH_CHECK(t == torch::kFloat32 || t == compute, "make_trainer: parameter '", p.key(), "' is ", t,
                "; the Strategy starts from float parameters (converting them to its ", compute, ") or from ", compute, " ones");
    if (t != compute) {
      convert = true;
      // Kept to seed the fp32 masters; weights that are their own master (Precision<bf16, bf16>) need none.
      if (!S::has_lora && !S::stochastic_rounding && p.value().requires_grad()) out.float_values[p.key()] = p.value().detach();
    }
  }
  // One conversion, straight onto the training device when one is given: the float storage stays where it was.
  // Under a quantized base the dense linears apply_lora packs stay behind: it moves them one at a time (LoRA, below),
  // so the device never holds the dense model (LLaMA-7B: 13.5 GB of bf16 for a 3.5 GB NF4 base).
  nn::LoraBasePlacement base_placement;
  if constexpr (S::quantized_weights) {
    if (o.device || convert) {
      base_placement = {o.device, compute};
      detail::to_except_packed_bases(model, o.device, compute);
    }
  } else if constexpr (S::stream_params) {
    // Streamed: the shardable layers' parameters are converted where they are (a model built on the host stays
    // there: the trainer cuts its shards into pinned host memory, so the device never holds the model); the rest
    // (norms, buffers) goes to the device.
    if (convert) model.to(compute);
    if (o.device) {
      torch::NoGradGuard ng;
      for (const auto& m : model.modules(/*include_self=*/true)) {
        if (dynamic_cast<Shardable*>(m.get()) != nullptr) continue;
        for (auto& p : m->parameters(/*recurse=*/false)) p.set_data(p.to(*o.device));
        for (auto& b : m->buffers(/*recurse=*/false)) b.set_data(b.to(*o.device));
      }
    }
  } else {
    if (o.device)
      model.to(*o.device, compute);
    else if (convert)
      model.to(compute);
  }

  // 4. LoRA
  if constexpr (S::has_lora) {
    bool has_linear = false;
    for (const auto& m : model.modules()) has_linear |= dynamic_cast<nn::LinearImpl*>(m.get()) != nullptr;
    TORCH_CHECK(has_linear, "make_trainer: a LoRA Strategy needs squeeze::nn::Linear layers to adapt; the model has none");
    try {
      if constexpr (S::stream_frozen_base) {
        // Each block packed, then moved to host memory before the next is packed: the device never holds the base.
        std::shared_ptr<FrozenUnits> home = nn::frozen_home(model);  // a model built block by block has one already
        if (!home) {
          torch::Device device = o.device.value_or(torch::kCPU);
          for (const auto& p : model.parameters())
            if (!o.device) {
              device = p.device();
              break;
            }
          home = std::make_shared<FrozenUnits>(device, o.prefetch_depth);
        }
        int64_t seeds = 0;  // the adapters made so far: the next layer's seed, as one apply_lora over the model counts
        for (const auto& [name, block] : detail::blocks_of(model)) {
          seeds += int64_t(nn::apply_lora<S>(*block, base_placement, seeds).size());
          nn::home_packed_bases(*block, name, home);
        }
      }
      out.adapted = nn::apply_lora<S>(model, base_placement);  // the rest; the blocks' adapters are kept and reported
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "make_trainer: ", e.what_without_backtrace(),
                  " (LoRA<R, A, Targets> names the layers it adapts: q, k, v, o, gate, up, down, or q_proj, ...)");
    }
    for (const auto& m : model.modules())
      if (auto* l = dynamic_cast<nn::LinearImpl*>(m.get()); l && l->backed()) {
        auto b = l->backing();
        if (auto* a = dynamic_cast<nn::LoRALinearImpl*>(b.get()))
          out.quantized_layers += a->nf4() || a->gptq();
        else
          ++out.quantized_layers;  // a frozen quantized base without adapter
      }
    if constexpr (S::quantized_weights)
      TORCH_CHECK(out.quantized_layers > 0, "make_trainer: the Strategy quantizes the base weights, but no layer was quantized");
  }

  // 5. activation checkpointing
  if constexpr (S::checkpoint_every > 0)
    for (const auto& m : model.modules(/*include_self=*/true))
      if (auto* r = dynamic_cast<nn::Recomputable*>(m.get())) r->set_recompute(S::checkpoint_every), ++out.recomputable;

  // 6. FP8 GEMMs: the linears of the blocks (gather units: nn::Llama's blocks, an nn::Blocks' children); the embedding
  // and the head, outside them, keep bf16 GEMMs (the first and last layers are the most sensitive to FP8's rounding).
  if constexpr (S::fp8_gemms) {
    for (const auto& [name, b] : detail::blocks_of(model))
      for (const auto& m : b->modules(/*include_self=*/true))
        if (auto* l = dynamic_cast<nn::LinearImpl*>(m.get()); l && !l->fp8_gemms()) l->set_fp8_gemms(true), ++out.fp8_layers;
    TORCH_CHECK(out.fp8_layers > 0,
                "make_trainer: Precision<fp8, bf16, float> runs the GEMMs of the model's blocks in FP8 (squeeze::nn::Linear layers "
                "inside modules deriving from engine::GatherUnit, as nn::Llama's blocks are, or in an nn::Blocks), but the model has none");
  }
  return out;
}

}  // namespace squeeze::train
