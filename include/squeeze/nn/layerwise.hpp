#pragma once
// A quantized LLaMA built one block at a time, so neither the host nor the device ever holds the float model:
//
//   build_quantized_llama<S>(config, options)   drawn at random (the values nn::Llama(config, ParamInit{.seed}) has)
//   build_quantized_llama<S>(hf_dir, options)   read from a Hugging Face directory (the values load_hf_llama reads)
//
// Each block is made in float on the host, filled (drawn from its own generator, nn/llama.hpp's draw_llama_part, or
// read tensor by tensor from the safetensors files), then handed to apply_lora<S> (nn/lora.hpp), which packs its
// seven linears on options.device (NF4, or the GPTQ layout by round-to-nearest) and attaches S's adapters, before the
// next block exists. The embedding, the norms and the head stay dense (float; the trainer converts them) and move to
// options.device as they are made. The result is what make_trainer<S> would have made of the whole float model
// bit for bit: the same packed bases, the same adapters (apply_lora's per-layer seeds run on from block to block),
// and make_trainer adopts it as it is (its apply_lora keeps the adapters).
//
// Before anything is allocated, layerwise_memory<S> says what building needs (the packed blocks and adapters as the
// planner counts them, the dense rest in float, one float block) and, with options.train, what plan_memory says the
// training step needs on the device; a build that would not fit in the host's available memory (/proc/meminfo's
// MemAvailable) or the GPU's total is refused with the figures and what to change. options.progress reports each
// packed block with the elapsed time and an estimate of the time left.
//
// Not here: GPTQ's Hessian calibration. A Quantized<B, GPTQ, ...> strategy gets the GPTQ layout filled by
// round-to-nearest, as apply_lora gives the whole model (examples/llama_gptq calibrates a whole float model).
#include <torch/torch.h>

#include <ATen/DeviceAccelerator.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "../engine/torch_types.hpp"
#include "../plan/memory.hpp"
#include "../policy/strategy.hpp"
#include "../policy/strategy_name.hpp"
#include "hf_llama.hpp"
#include "llama.hpp"
#include "lora.hpp"

namespace squeeze::nn {

// Where a block-by-block build stands, after each block is packed.
struct LayerwiseProgress {
  int64_t blocks = 0, blocks_total = 0;  // packed so far, of all
  double seconds = 0;                    // since building began
  double seconds_left = 0;               // the mean time per block so far times the blocks left
  int64_t packed_bytes = 0;              // frozen bases packed so far (frozen_base_bytes of the blocks done)
};
using LayerwiseProgressFn = std::function<void(const LayerwiseProgress&)>;

struct LayerwiseOptions {
  torch::Device device = torch::kCPU;  // where the packed blocks and the dense rest of the model live
  std::optional<uint64_t> seed;        // the random initialisation's (ParamInit::seed); unset: drawn from torch's global generator
  // The training step the model is built for: the device check then takes plan_memory<S>'s peak for it, not only the
  // build's own. Unset: the build alone is checked.
  std::optional<plan::TrainShape> train;
  // What the checks compare with; unset: /proc/meminfo's MemAvailable, and a CUDA device's total memory.
  std::optional<int64_t> available_host_bytes, available_device_bytes;
  io::ConfigOptions config;      // reading config.json (the Hugging Face overload)
  LayerwiseProgressFn progress;  // after each block
};

// Bytes a block-by-block build of S needs, by the planner's counts.
struct LayerwiseMemory {
  int64_t packed_bytes = 0;       // the packed block linears and S's adapters (plan_memory's parameters, less the dense rest)
  int64_t dense_rest_bytes = 0;   // embedding, head and norms in float, as built
  int64_t float_block_bytes = 0;  // one block's float parameters, made on the host before they are packed
  int64_t read_buffer_bytes = 0;  // from files: the largest checkpoint tensor, in float, read before it is copied
  int64_t planned_step_bytes = 0; // options.train: plan_memory<S>'s device peak of one training step; else 0
  int64_t host_bytes = 0;         // the host's peak (on a CPU device, everything, and the training step's peak if planned)
  int64_t device_bytes = 0;       // a CUDA device's peak: the build's (packed + dense rest + one dense linear in the
                                  // compute type while it is packed), or the planned step's when larger; 0 on the CPU
};

template <StrategyType S>
LayerwiseMemory layerwise_memory(const LlamaConfig& c, const LayerwiseOptions& o = {}, bool from_files = false) {
  const plan::ModelShape m = c.shape();
  const int64_t p_c = sizeof(typename S::compute_type);
  LayerwiseMemory r;
  plan::TrainShape step = o.train.value_or(plan::TrainShape{});
  const plan::MemoryPlan planned = plan::plan_memory<S>(m, step, 1);
  r.dense_rest_bytes = m.unquantized_params() * 4;
  r.packed_bytes = planned.parameters.device - m.unquantized_params() * p_c;
  r.float_block_bytes = m.block_params() * 4;
  int64_t largest_linear = 0;
  for (const auto& l : m.block_linears()) largest_linear = std::max(largest_linear, l.in * l.out);
  if (from_files) r.read_buffer_bytes = std::max(largest_linear, m.embedding_params()) * 4;
  if (o.train) r.planned_step_bytes = planned.peak().device;
  if (o.device.is_cpu()) {
    r.host_bytes = r.packed_bytes + r.dense_rest_bytes + r.float_block_bytes + r.read_buffer_bytes;
    if (o.train) r.host_bytes = std::max(r.host_bytes, planned.peak().device + planned.peak().host);
  } else {
    // The embedding and the head are made on the host too, each moved to the device before the next part exists.
    r.host_bytes = std::max(r.float_block_bytes, m.embedding_params() * 4) + r.read_buffer_bytes;
    if (o.train) r.host_bytes = std::max(r.host_bytes, planned.peak().host);
    r.device_bytes = std::max(r.packed_bytes + r.dense_rest_bytes + largest_linear * p_c, r.planned_step_bytes);
  }
  return r;
}

namespace detail {
inline std::string gigabytes(int64_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f GB", double(bytes) / 1e9);
  return s;
}

// /proc/meminfo's MemAvailable in bytes; unset where it cannot be read.
inline std::optional<int64_t> host_memory_available() {
  std::ifstream f("/proc/meminfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("MemAvailable:", 0) == 0) return int64_t(std::stoll(line.substr(13))) * 1024;
  return std::nullopt;
}

// A CUDA device's total memory; unset for other devices or where the runtime cannot say.
inline std::optional<int64_t> device_memory_total(torch::Device d) {
  if (!d.is_cuda()) return std::nullopt;
  try {
    return int64_t(at::accelerator::getMemoryInfo(d.has_index() ? d.index() : c10::DeviceIndex(0)).second);
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

template <StrategyType S>
void check_layerwise_fits(const LlamaConfig& c, const LayerwiseOptions& o, bool from_files) {
  const LayerwiseMemory need = layerwise_memory<S>(c, o, from_files);
  const std::string what = "build_quantized_llama: '" + c.name + "' (" + std::to_string(c.shape().params()) + " parameters) under " +
                           strategy_name<S>();
  const std::string step = o.train ? "; plan_memory's peak of a training step of micro-batch " + std::to_string(o.train->micro_batch) +
                                         " x seq " + std::to_string(o.train->seq) + ": " + gigabytes(need.planned_step_bytes)
                                   : "";
  const std::optional<int64_t> host = o.available_host_bytes ? o.available_host_bytes : host_memory_available();
  if (host) {
    TORCH_CHECK(need.host_bytes <= *host, what, " needs ", gigabytes(need.host_bytes), " of host memory (",
                o.device.is_cpu() ? "packed blocks and adapters " + gigabytes(need.packed_bytes) + " + embedding, head and norms in float " +
                                        gigabytes(need.dense_rest_bytes) + " + "
                                  : std::string(),
                "one float block ", gigabytes(need.float_block_bytes),
                need.read_buffer_bytes > 0 ? " + one checkpoint tensor " + gigabytes(need.read_buffer_bytes) : std::string(),
                o.device.is_cpu() ? step : std::string(), "), but ", gigabytes(*host), " is available",
                o.available_host_bytes ? " (LayerwiseOptions::available_host_bytes)" : " (MemAvailable in /proc/meminfo)",
                ": quantize to fewer bits (Quantized<3, ...>)",
                o.device.is_cpu() ? ", build onto a GPU (LayerwiseOptions::device)" : "",
                o.train && o.device.is_cpu() ? ", train a smaller micro-batch or shorter sequences" : "", ", or choose a smaller model");
  }
  if (o.device.is_cpu()) return;
  const std::optional<int64_t> device = o.available_device_bytes ? o.available_device_bytes : device_memory_total(o.device);
  if (!device) return;
  TORCH_CHECK(need.device_bytes <= *device, what, " needs ", gigabytes(need.device_bytes), " on ", o.device.str(),
              " (packed blocks and adapters ", gigabytes(need.packed_bytes), " + embedding, head and norms in float ",
              gigabytes(need.dense_rest_bytes), " + one dense linear being packed", step, "), but the device has ", gigabytes(*device),
              o.available_device_bytes ? " (LayerwiseOptions::available_device_bytes)" : "",
              ": quantize to fewer bits (Quantized<3, ...>)",
              o.train ? ", train a smaller micro-batch or shorter sequences, add Checkpointed, offload the optimizer state "
                        "(Sharded<Stage1> + Offload<Host>)"
                      : "",
              ", or choose a smaller model");
}

// The build itself: nn::Llama's constructor makes the parts in order; `fill` (if set) writes each part's values
// before its block is packed (random: already drawn).
template <StrategyType S>
Llama build_layerwise(const LlamaConfig& c, const LayerwiseOptions& o, bool random,
                      const std::function<void(const std::string&, torch::nn::Module&)>& fill) {
  using Clock = std::chrono::steady_clock;
  const auto since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  const LoraBasePlacement place{o.device, torch_dtype<typename S::compute_type>()};
  const auto start = Clock::now();
  std::optional<Clock::time_point> blocks_start;  // after the embedding: what the blocks' mean time is taken over
  int64_t adapters = 0;                           // adapters of the blocks before: the next block's first seed
  LayerwiseProgress p;
  p.blocks_total = c.layers;
  const auto built = [&](const std::string& name, torch::nn::Module& part) {
    if (fill) fill(name, part);
    auto* block = dynamic_cast<BlockImpl*>(&part);
    if (block == nullptr) {
      part.to(o.device);
      if (!blocks_start) blocks_start = Clock::now();
      return;
    }
    adapters += int64_t(apply_lora<S>(*block, place, adapters).size());
    block->to(o.device);  // the norms; the packed layers are there already
    ++p.blocks;
    p.packed_bytes += frozen_base_bytes(*block);
    p.seconds = since(start);
    p.seconds_left = since(*blocks_start) / double(p.blocks) * double(p.blocks_total - p.blocks);
    if (o.progress) o.progress(p);
  };
  Llama model(c, ParamInit{torch::TensorOptions().dtype(torch::kFloat32), random, o.seed}, built);
  for (const auto& m : model->modules(/*include_self=*/true)) {  // frozen as apply_lora leaves a whole model
    if (dynamic_cast<LoRALinearImpl*>(m.get()) != nullptr) continue;
    for (auto& t : m->parameters(/*recurse=*/false)) t.set_requires_grad(false);
  }
  return model;
}
}  // namespace detail

// A LLaMA of `config` under quantized strategy S, drawn at random and built block by block (see the top of this
// file): the values of nn::Llama(config, ParamInit{.seed = options.seed}) (unset seed: both draw theirs from torch's
// global generator), packed and adapted as make_trainer<S> would. Refused before anything is allocated when the
// config is invalid or the build does not fit (layerwise_memory).
template <StrategyType S>
Llama build_quantized_llama(const LlamaConfig& config, const LayerwiseOptions& options = {}) {
  static_assert(S::quantized_weights && S::has_lora,
                "build_quantized_llama<S> packs each block as apply_lora<S> does: S needs Quantized<...> and LoRA<R, A>, e.g. "
                "Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<16, 32, all_linears>, Precision<bf16, float>, Checkpointed>");
  config.validate();
  detail::check_layerwise_fits<S>(config, options, /*from_files=*/false);
  return detail::build_layerwise<S>(config, options, /*random=*/true, {});
}

// The Hugging Face LLaMA in `dir` (config.json + safetensors), read block by block: the values
// load_hf_llama(dir, {.dtype = torch::kFloat32}) reads, packed and adapted as make_trainer<S> would. The directory is
// checked (every tensor there with its shape and a floating-point dtype) before the first block is made; each tensor
// is read when its part is made, so the files' order does not matter.
template <StrategyType S>
Llama build_quantized_llama(const std::filesystem::path& dir, const LayerwiseOptions& options = {}) {
  static_assert(S::quantized_weights && S::has_lora,
                "build_quantized_llama<S> packs each block as apply_lora<S> does: S needs Quantized<...> and LoRA<R, A>, e.g. "
                "Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<16, 32, all_linears>, Precision<bf16, float>, Checkpointed>");
  const io::LlamaConfig hf = detail::torch_errors([&] { return io::load_llama_config(dir, options.config); });
  const LlamaConfig config = from_hf_config(hf, dir.string());
  config.validate();
  detail::check_layerwise_fits<S>(config, options, /*from_files=*/true);
  const detail::HfWeights w = detail::open_hf_weights(config, dir, options.config);
  std::map<std::string, std::vector<const io::NameEntry*>> by_part;  // "block3" -> its tensors
  for (const io::NameEntry& e : w.entries) by_part[e.squeeze.substr(0, e.squeeze.find('.'))].push_back(&e);
  const auto fill = [&](const std::string& name, torch::nn::Module& part) {
    torch::NoGradGuard no_grad;
    auto params = part.named_parameters();
    for (const io::NameEntry* e : by_part[name]) {
      torch::Tensor* p = params.find(e->squeeze.substr(name.size() + 1));
      TORCH_CHECK(p != nullptr && p->sizes().vec() == e->shape, "build_quantized_llama: the model has no parameter '", e->squeeze,
                  "' of shape ", io::shape_string(e->shape), " for '", e->hf, "'");
      p->copy_(detail::read_hf_tensor(w, *e));  // one tensor in the file's dtype at a time
    }
  };
  return detail::build_layerwise<S>(config, options, /*random=*/false, fill);
}

}  // namespace squeeze::nn
