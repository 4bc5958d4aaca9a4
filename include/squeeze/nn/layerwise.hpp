#pragma once
// A quantized LLaMA built one block at a time, so neither the host nor the device ever holds the float model:
//
//   build_quantized_llama<S>(config, options)   drawn at random (the values nn::Llama(config, ParamInit{.seed}) has,
//                                               made on options.device)
//   build_quantized_llama<S>(hf_dir, options)   read from a Hugging Face directory (the values load_hf_llama reads)
//
// Each block is made in float (drawn at random: on options.device, from its own generator there, nn/llama.hpp's
// draw_llama_part; read from files: on the host, tensor by tensor from the safetensors files), then handed to
// apply_lora<S> (nn/lora.hpp), which packs its seven linears on options.device (NF4, or the GPTQ layout by
// round-to-nearest) and attaches S's adapters, before the next block exists. The embedding, the norms and the head
// stay dense (float; the trainer converts them) and move to options.device as they are made. The result is what
// make_trainer<S> would have made of the whole float model made on that device, bit for bit: the same packed bases,
// the same adapters (apply_lora's per-layer seeds run on from block to block), and make_trainer adopts it as it is
// (its apply_lora keeps the adapters).
//
// Before anything is allocated, layerwise_memory<S> says what building needs (the packed blocks and adapters as the
// planner counts them, the dense rest in float, one float block) and, with options.train, what plan_memory says the
// training step needs on the device; a build that would not fit in the host's available memory (/proc/meminfo's
// MemAvailable) or the GPU's total is refused with the figures and what to change. options.progress reports each
// packed block with the elapsed time and an estimate of the time left.
//
// GPTQ: with options.calibration (token ids), a Quantized<B, GPTQ, ...> strategy quantizes each block by GPTQ on the
// Hessians of its linears' inputs, the block's input coming from the blocks before it, already quantized (their
// output, adapters at zero): the calibration hidden states go through the model one block at a time beside it. One
// forward of the float block gives all seven Hessians (q, k and v share one, as do gate and up). Without calibration
// the GPTQ layout is filled by round-to-nearest, as apply_lora fills it for a whole model. ActOrder is not supported.
#include <torch/torch.h>

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

#include "squeeze/engine/memory_info.hpp"
#include "squeeze/engine/torch_types.hpp"
#include "squeeze/plan/memory.hpp"
#include "squeeze/policy/strategy.hpp"
#include "squeeze/policy/strategy_name.hpp"
#include "squeeze/nn/gptq.hpp"
#include "squeeze/nn/hf_llama.hpp"
#include "squeeze/nn/llama.hpp"
#include "squeeze/nn/lora.hpp"

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
  // Drawn at random onto a GPU: each part made and drawn there (its generator is the device's; a 175B block's 1.8 G
  // values take minutes on one host thread). false: on the host, one float block less on the device (7.3 GB at 175B).
  bool draw_on_device = true;
  // The training step the model is built for: the device check then takes plan_memory<S>'s peak for it, not only the
  // build's own. Unset: the build alone is checked.
  std::optional<plan::TrainShape> train;
  // What the checks compare with; unset: /proc/meminfo's MemAvailable, and a CUDA device's total memory.
  std::optional<int64_t> available_host_bytes, available_device_bytes;
  io::ConfigOptions config;      // reading config.json (the Hugging Face overload)
  LayerwiseProgressFn progress;  // after each block
  // Quantized<B, GPTQ, ...>: token ids [sequences, tokens] (int64) whose hidden states calibrate each block's GPTQ;
  // undefined: round-to-nearest. gptq: GPTQ's run-time knobs (damping, symmetric grid, column block); bits and group
  // come from the policy.
  torch::Tensor calibration;
  GptqOptions gptq;
};

// Whether a build makes and draws its float parts on options.device: drawn at random onto a GPU with draw_on_device;
// read from files, or drawn on the host, they are made on the host.
inline bool drawn_on_device(const LayerwiseOptions& o, bool from_files) { return !from_files && o.draw_on_device && o.device.is_cuda(); }

// Bytes a block-by-block build of S needs, by the planner's counts.
struct LayerwiseMemory {
  int64_t packed_bytes = 0;        // the packed block linears and S's adapters (plan_memory's parameters, less the dense rest)
  int64_t dense_rest_bytes = 0;    // embedding, head and norms in float, as built
  int64_t float_block_bytes = 0;   // one block's float parameters, made on the host before they are packed
  int64_t read_buffer_bytes = 0;   // from files: the largest checkpoint tensor, in float, read before it is copied
  int64_t calibration_bytes = 0;   // GPTQ calibration: the hidden states, one block's intermediates and its Hessians
  int64_t planned_step_bytes = 0;  // options.train: plan_memory<S>'s device peak of one training step; else 0
  int64_t host_bytes = 0;          // the host's peak (on a CPU device, everything, and the training step's peak if planned)
  int64_t device_bytes = 0;        // a CUDA device's peak: the build's (packed + dense rest + one dense linear in the
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
  // Parameters less the dense rest (a streamed base: on the host, and its device slots are not what is built).
  r.packed_bytes = S::stream_frozen_base ? planned.parameters.host + int64_t(sizeof(typename S::master_type)) * planned.trainable_params
                                         : planned.parameters.device - m.unquantized_params() * p_c;
  r.float_block_bytes = m.block_params() * 4;
  int64_t largest_linear = 0;
  for (const auto& l : m.block_linears()) largest_linear = std::max(largest_linear, l.in * l.out);
  if (from_files) r.read_buffer_bytes = std::max(largest_linear, m.embedding_params()) * 4;
  if (o.calibration.defined() && std::is_same_v<typename S::weight_quantization::method, GPTQ>) {
    const int64_t tokens = o.calibration.numel();
    const int64_t hessians = 2 * m.hidden * m.hidden + m.q_dim() * m.q_dim() + m.ffn * m.ffn;  // q/k/v, o, gate/up, down
    r.calibration_bytes = (tokens * (4 * m.hidden + 2 * m.kv_dim() + 4 * m.ffn) + hessians) * 4;
  }
  if (o.train) r.planned_step_bytes = planned.peak().device;
  if (o.device.is_cpu()) {
    r.host_bytes = r.packed_bytes + r.dense_rest_bytes + r.float_block_bytes + r.read_buffer_bytes + r.calibration_bytes;
    if (o.train) r.host_bytes = std::max(r.host_bytes, planned.peak().device + planned.peak().host);
  } else {
    // Drawn at random, each part is made on the device (see build_layerwise); read from files, the embedding and the
    // head are made on the host too, each moved to the device before the next part exists.
    const bool made_on_host = !drawn_on_device(o, from_files);  // o.device is not the CPU here
    const int64_t float_on_host = made_on_host ? std::max(r.float_block_bytes, m.embedding_params() * 4) + r.read_buffer_bytes : 0;
    r.host_bytes = float_on_host;
    if (S::stream_frozen_base) r.host_bytes += planned.parameters.host;  // the packed blocks, moved there one by one
    if (o.train)
      r.host_bytes = std::max(r.host_bytes, planned.peak().host + (S::stream_frozen_base && made_on_host ? r.float_block_bytes : 0));
    // Calibrated, the float block moves to the device to run the calibration forward; drawn there, it is there.
    // Quantizing (round to nearest) and packing into the GPTQ layout run on the device a piece of rows at a time
    // (nn::rtn_pack, nn::pack_linear): one piece's temporaries.
    const int64_t rtn = std::is_same_v<typename S::weight_quantization::method, GPTQ>
                            ? std::min(largest_linear, kRtnPieceValues) * kRtnDeviceBytesPerValue  // a piece: <= 2^25 values
                            : 0;
    const int64_t packing = r.calibration_bytes > 0 ? r.float_block_bytes + r.calibration_bytes + rtn
                            : made_on_host          ? largest_linear * p_c + rtn
                                                    : r.float_block_bytes + largest_linear * p_c + rtn;
    // A streamed base: the adapters stay, and one block's packed bytes until it moves to the host.
    const int64_t on_device = S::stream_frozen_base
                                  ? r.packed_bytes - planned.parameters.host + planned.parameters.host / std::max<int64_t>(1, m.layers)
                                  : r.packed_bytes;
    r.device_bytes = std::max(on_device + r.dense_rest_bytes + packing, r.planned_step_bytes);
  }
  return r;
}

namespace detail {
using engine::device_memory_total;
using engine::gigabytes;
using engine::host_memory_available;

template <StrategyType S>
void check_layerwise_fits(const LlamaConfig& c, const LayerwiseOptions& o, bool from_files) {
  const LayerwiseMemory need = layerwise_memory<S>(c, o, from_files);
  const bool made_on_device = drawn_on_device(o, from_files);
  const std::string what =
      "build_quantized_llama: '" + c.name + "' (" + std::to_string(c.shape().params()) + " parameters) under " + strategy_name<S>();
  const std::string step = o.train ? "; plan_memory's peak of a training step of micro-batch " + std::to_string(o.train->micro_batch) +
                                         " x seq " + std::to_string(o.train->seq) + ": " + gigabytes(need.planned_step_bytes)
                                   : "";
  // The remedies that apply to this strategy and this build, as "a, b, or c"; at 3 bits there are no fewer bits to offer.
  const auto remedies = [](std::vector<std::string> r) {
    r.push_back("choose a smaller model");
    std::string joined;
    for (size_t i = 0; i < r.size(); ++i) joined += (i == 0 ? "" : i + 1 == r.size() ? ", or " : ", ") + r[i];
    return joined;
  };
  const bool more_than_3_bits = S::weight_bits > 3;
  const std::optional<int64_t> host = o.available_host_bytes ? o.available_host_bytes : host_memory_available();
  if (host) {
    std::vector<std::string> parts;  // what the host figure is made of
    if (o.device.is_cpu())
      parts = {"packed blocks and adapters " + gigabytes(need.packed_bytes),
               "embedding, head and norms in float " + gigabytes(need.dense_rest_bytes)};
    else if (S::stream_frozen_base)
      parts = {"packed blocks and adapters, the blocks streamed from pinned host memory " + gigabytes(need.packed_bytes)};
    if (!made_on_device) parts.push_back("one float block " + gigabytes(need.float_block_bytes));
    if (need.read_buffer_bytes > 0) parts.push_back("one checkpoint tensor " + gigabytes(need.read_buffer_bytes));
    std::string made_of;
    for (const std::string& part : parts) made_of += (made_of.empty() ? "" : " + ") + part;
    std::vector<std::string> r;
    if (more_than_3_bits) r.push_back("quantize to fewer bits (Quantized<3, ...>)");
    if (o.device.is_cpu()) r.push_back("build onto a GPU (LayerwiseOptions::device)");
    if (S::stream_frozen_base) r.push_back("keep the packed blocks on the GPU (remove Offload<Host, Streamed>)");
    if (o.train && o.device.is_cpu()) r.push_back("train a smaller micro-batch or shorter sequences");
    TORCH_CHECK(need.host_bytes <= *host, what, " needs ", gigabytes(need.host_bytes), " of host memory (", made_of,
                o.device.is_cpu() ? step : std::string(), "), but ", gigabytes(*host), " is available",
                o.available_host_bytes ? " (LayerwiseOptions::available_host_bytes)" : " (MemAvailable in /proc/meminfo)", ": ",
                remedies(std::move(r)));
  }
  if (o.device.is_cpu()) return;
  const std::optional<int64_t> device = o.available_device_bytes ? o.available_device_bytes : device_memory_total(o.device);
  if (!device) return;
  std::vector<std::string> r;
  if (more_than_3_bits) r.push_back("quantize to fewer bits (Quantized<3, ...>)");
  if (made_on_device) r.push_back("draw on the host (LayerwiseOptions::draw_on_device = false)");
  if (o.train)
    r.push_back(
        "train a smaller micro-batch or shorter sequences, add Checkpointed, offload the optimizer state "
        "(Sharded<Stage1> + Offload<Host>)");
  TORCH_CHECK(need.device_bytes <= *device, what, " needs ", gigabytes(need.device_bytes), " on ", o.device.str(),
              S::stream_frozen_base ? " (adapters and the packed block in flight, " : " (packed blocks and adapters ",
              gigabytes(S::stream_frozen_base ? need.device_bytes - need.dense_rest_bytes : need.packed_bytes),
              " + embedding, head and norms in float ", gigabytes(need.dense_rest_bytes),
              made_on_device ? " + one float block drawn there and one dense linear being packed" : " + one dense linear being packed",
              step, "), but the device has ", gigabytes(*device),
              o.available_device_bytes ? " (LayerwiseOptions::available_device_bytes)" : "", ": ", remedies(std::move(r)));
}

// A stand-in for one of a block's linears during the calibration forward: adds its input to the Hessian it shares
// with the linears that read the same tensor (once per tensor), and runs the dense layer.
struct HessianTap : torch::nn::Module, LinearForward {
  struct Shared {
    Hessian hessian;
    torch::Tensor last;  // the input already added in this pass
  };
  HessianTap(std::shared_ptr<torch::nn::Module> layer, Shared* shared) : layer_(std::move(layer)), shared_(shared) {}
  torch::Tensor forward_linear(const torch::Tensor& x) override {
    if (!shared_->last.defined() || !shared_->last.is_same(x)) {
      shared_->hessian.add(x);
      shared_->last = x;
    }
    return dynamic_cast<LinearImpl&>(*layer_).forward(x);
  }

 private:
  std::shared_ptr<torch::nn::Module> layer_;
  Shared* shared_;
};

// The Hessians of a float block's seven linears (by path: "attn.q", ...) from one forward of its input x [B, T, h].
inline std::map<std::string, std::shared_ptr<HessianTap::Shared>> block_hessians(BlockImpl& block, const torch::Tensor& x,
                                                                                 const torch::Tensor& cos, const torch::Tensor& sin) {
  struct Site {
    torch::nn::Module* parent;
    const char* name;
    const char* input;  // the linears reading one tensor share a Hessian
  };
  const Site sites[] = {{block.attn.get(), "q", "attn.in"},   {block.attn.get(), "k", "attn.in"},  {block.attn.get(), "v", "attn.in"},
                        {block.attn.get(), "o", "attn.o"},    {block.mlp.get(), "gate", "mlp.in"}, {block.mlp.get(), "up", "mlp.in"},
                        {block.mlp.get(), "down", "mlp.down"}};
  std::map<std::string, std::shared_ptr<HessianTap::Shared>> by_input, out;
  std::vector<std::pair<const Site*, std::shared_ptr<torch::nn::Module>>> replaced;
  const auto restore = [&] {
    for (auto& [site, layer] : replaced) site->parent->replace_module(site->name, layer);
    replaced.clear();
  };
  try {
    for (const Site& site : sites) {
      std::shared_ptr<torch::nn::Module> layer = site.parent->named_children()[site.name];
      auto* linear = dynamic_cast<LinearImpl*>(layer.get());
      TORCH_CHECK(linear != nullptr && !linear->backed(), "build_quantized_llama: block linear '", site.name, "' is not a dense Linear");
      auto& shared = by_input[site.input];
      if (!shared) shared = std::make_shared<HessianTap::Shared>(HessianTap::Shared{Hessian(linear->in_features(), x.device()), {}});
      out[std::string(site.parent == block.attn.get() ? "attn." : "mlp.") + site.name] = shared;
      site.parent->replace_module(site.name, std::make_shared<HessianTap>(layer, shared.get()));
      replaced.emplace_back(&site, layer);
    }
    torch::NoGradGuard no_grad;
    (void)block.forward(x, cos, sin);
  } catch (...) {
    restore();
    throw;
  }
  restore();
  for (auto& [input, shared] : by_input) shared->last = torch::Tensor();
  return out;
}

// The build itself: nn::Llama's constructor makes the parts in order; `fill` (if set) writes each part's values
// before its block is packed (random: already drawn).
template <StrategyType S>
Llama build_layerwise(const LlamaConfig& c, const LayerwiseOptions& o, bool random,
                      const std::function<void(const std::string&, torch::nn::Module&)>& fill) {
  using Clock = std::chrono::steady_clock;
  const auto since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  const LoraBasePlacement place{o.device, torch_dtype<typename S::compute_type>()};
  const torch::Device made_on = drawn_on_device(o, /*from_files=*/!random) ? o.device : torch::Device(torch::kCPU);
  const auto start = Clock::now();
  std::optional<Clock::time_point> blocks_start;  // after the embedding: what the blocks' mean time is taken over
  int64_t adapters = 0;                           // adapters of the blocks before: the next block's first seed
  // Offload<Host, Streamed>: the host memory each packed block moves to (engine/frozen_units.hpp).
  const auto home =
      S::stream_frozen_base ? std::make_shared<engine::FrozenUnits>(o.device, o.train ? int(o.train->prefetch_depth) : 1) : nullptr;
  LayerwiseProgress p;
  p.blocks_total = c.layers;
  // GPTQ calibration: the hidden states [sequences, tokens, h] in float on the device, through the blocks packed so far.
  using WQ = typename S::weight_quantization;
  constexpr bool gptq = std::is_same_v<typename WQ::method, GPTQ>;
  const bool calibrate = gptq && o.calibration.defined();
  torch::Tensor hidden, cos, sin;
  GptqOptions gptq_options = o.gptq;
  if constexpr (gptq) {
    gptq_options.bits = WQ::bits;
    gptq_options.group_size = WQ::group;
    gptq_options.act_order = false;  // apply_lora refuses ActOrder with a GPTQ layout
  }
  const auto built = [&](const std::string& name, torch::nn::Module& part) {
    if (fill) fill(name, part);
    auto* block = dynamic_cast<BlockImpl*>(&part);
    if (block == nullptr) {
      part.to(o.device);
      if (calibrate && name == "embed") {
        torch::NoGradGuard no_grad;
        hidden = dynamic_cast<EmbeddingImpl&>(part).forward(o.calibration.to(o.device)).to(torch::kFloat32);  // [N, T, h]
        std::tie(cos, sin) = rope_tables(o.calibration.size(1), c, o.device);
      }
      if (!blocks_start) blocks_start = Clock::now();
      return;
    }
    LoraBasePlacement block_place = place;
    std::map<std::string, std::shared_ptr<HessianTap::Shared>> hessians;
    if (calibrate) {
      block->to(o.device);  // the float block, for its calibration forward
      hessians = block_hessians(*block, hidden, cos, sin);
      block_place.pack = [&](const std::string& path, const torch::Tensor& w, const torch::Tensor& b) {
        const GptqResult r = gptq_quantize(w.to(torch::kFloat32), hessians.at(path)->hessian.matrix(), gptq_options);
        quant::PackedLinear packed = r.pack();
        if (b.defined()) {
          const torch::Tensor bh = b.detach().to(torch::kCPU, torch::kHalf).contiguous();
          const auto* bp = reinterpret_cast<const half*>(bh.data_ptr<at::Half>());
          packed.bias.assign(bp, bp + bh.numel());
        }
        QuantizedLinear q(packed, /*fused_tiles=*/!S::training);
        q->to(w.device());
        return q;
      };
    }
    adapters += int64_t(apply_lora<S>(*block, block_place, adapters).size());
    if constexpr (S::stream_frozen_base) home_packed_bases(*block, name, home);  // its packed bytes to host memory now
    block->to(o.device);                                                         // the norms; the packed layers are there already
    if (calibrate) {  // the next block calibrates on what this one, quantized, computes
      torch::NoGradGuard no_grad;
      hessians.clear();
      hidden = block->forward(hidden, cos, sin);
    }
    ++p.blocks;
    p.packed_bytes += frozen_base_bytes(*block);
    p.seconds = since(start);
    p.seconds_left = since(*blocks_start) / double(p.blocks) * double(p.blocks_total - p.blocks);
    if (o.progress) o.progress(p);
  };
  if (o.calibration.defined()) {
    TORCH_CHECK(gptq, "build_quantized_llama: LayerwiseOptions::calibration calibrates GPTQ, but the strategy quantizes by ",
                std::is_same_v<typename WQ::method, NF4> ? "NF4" : "round-to-nearest",
                ": write Quantized<B, GPTQ, ...>, or leave calibration out");
    TORCH_CHECK(o.calibration.dim() == 2 && o.calibration.scalar_type() == torch::kLong && o.calibration.numel() > 0,
                "build_quantized_llama: calibration must be token ids [sequences, tokens] in int64, got ", o.calibration.sizes(), " ",
                o.calibration.scalar_type());
    TORCH_CHECK(o.calibration.min().item<int64_t>() >= 0 && o.calibration.max().item<int64_t>() < c.vocab,
                "build_quantized_llama: calibration token ids must lie in [0, ", c.vocab, "), the model's vocabulary");
  }
  Llama model(c, ParamInit{torch::TensorOptions().dtype(torch::kFloat32).device(made_on), random, o.seed}, built);
  for (const auto& m : model->modules(/*include_self=*/true)) {  // frozen as apply_lora leaves a whole model
    if (dynamic_cast<LoRALinearImpl*>(m.get()) != nullptr) continue;
    for (auto& t : m->parameters(/*recurse=*/false)) t.set_requires_grad(false);
  }
  return model;
}
}  // namespace detail

// A LLaMA of `config` under quantized strategy S, drawn at random and built block by block (see the top of this
// file): the values of nn::Llama(config, ParamInit{.seed = options.seed}) made on options.device (unset seed: both
// draw theirs from torch's global generator), packed and adapted as make_trainer<S> would. Refused before anything is allocated when the
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
