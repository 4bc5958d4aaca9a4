#pragma once
// The LLaMA example's strategies and its one trainer (shared by train.cpp, the llama tests and bench/table): every
// strategy goes through squeeze::make_trainer<S> (train/trainer.hpp), which does all that S says (precision and
// masters, loss scaling, accumulation, ZeRO stages, host offload, 8-bit state, LoRA / QLoRA, checkpointing).
// Checkpoints (save/load) are the library's (train/checkpoint.hpp): per-rank safetensors shards, an index, crash-safe
// saves, loading at any world size and stage.
#include <squeeze/comm/local.hpp>
#include <squeeze/nn/hf_llama.hpp>
#include <squeeze/nn/layerwise.hpp>
#include <squeeze/nn/llama.hpp>
#include <squeeze/nn/lora.hpp>
#include <squeeze/train/checkpoint.hpp>
#include <squeeze/train/trainer.hpp>
#include <squeeze/optim/adamw.hpp>
#include <squeeze/plan.hpp>
#include <squeeze/policy.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#if defined(SQUEEZE_TORCH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace squeeze::llama {

using squeeze::nn::Llama;
using squeeze::nn::LlamaConfig;

// A strategy and its --strategy name: one row of the table below.
template <std::size_t N>
struct RowName {
  char text[N];
  constexpr RowName(const char (&s)[N]) { std::copy_n(s, N, text); }
};
template <RowName Name, StrategyType S>
struct Named {
  static constexpr std::string_view name{Name.text};
  using strategy = S;
};

// The strategies this example compiles in, each with its --strategy name. Add a row here to add one.
// clang-format off
using StrategyTable = std::tuple<
    Named<"fp32", Strategy<>>,
    Named<"accum4", Strategy<Accumulate<4>>>,
    Named<"bf16", Strategy<Precision<bf16, float>>>,
    Named<"fp16", Strategy<Precision<half, float>>>,  // dynamic loss scaling
    Named<"ckpt", Strategy<Checkpointed>>,
    Named<"ckpt2", Strategy<CheckpointEvery<2>>>,
    Named<"bf16-ckpt", Strategy<Precision<bf16, float>, Checkpointed>>,
    // ... with the checkpointed block inputs kept in 8 bits (blockwise absmax): the fidelity benchmark's comparison.
    Named<"bf16-ckpt-int8", Strategy<Precision<bf16, float>, Checkpointed, CheckpointOffload<Device, Int8>>>,
    // The block linears' GEMMs in FP8 (e4m3, gradients e5m2; Ada or Hopper on the GPU): the twins of bf16 and bf16-ckpt
    Named<"fp8", Strategy<Precision<fp8, bf16, float>>>,
    Named<"fp8-ckpt", Strategy<Precision<fp8, bf16, float>, Checkpointed>>,
    Named<"fp16-accum4", Strategy<Precision<half, float>, Accumulate<4>>>,
    Named<"bf16-accum4-ckpt", Strategy<Precision<bf16, float>, Accumulate<4>, Checkpointed>>,
    // ZeRO (squeeze's sharded trainer). Over N GPUs stage 3 alone keeps 16 bytes/parameter / N of model state (the
    // scaling rows of bench_table); on one GPU, Offload<Host> is what saves memory.
    Named<"zero2-bf16", Strategy<Sharded<Stage2>, Precision<bf16, float>>>,
    Named<"zero3-bf16", Strategy<Sharded<Stage3>, Precision<bf16, float>>>,
    Named<"zero3-bf16-ckpt", Strategy<Sharded<Stage3>, Precision<bf16, float>, Checkpointed>>,
    Named<"zero3-fp8-ckpt", Strategy<Sharded<Stage3>, Precision<fp8, bf16, float>, Checkpointed>>,
    Named<"zero3-offload", Strategy<Sharded<Stage3>, Offload<Host>>>,
    Named<"zero3-offload-fp16", Strategy<Sharded<Stage3>, Offload<Host>, Precision<half, float>>>,
    Named<"zero3-offload-fp16-accum4", Strategy<Sharded<Stage3>, Offload<Host>, Precision<half, float>, Accumulate<4>>>,
    Named<"zero3-offload-bf16-ckpt", Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed>>,
    Named<"zero3-offload-fp8-ckpt", Strategy<Sharded<Stage3>, Offload<Host>, Precision<fp8, bf16, float>, Checkpointed>>,
    // The same with 8-bit Adam moments (block-wise quantized, 2 bytes per parameter instead of 8 on the host).
    Named<"zero3-offload-bf16-ckpt-adam8",
          Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed, QuantizedState<8>>>,
    // The checkpointed block inputs in host memory too, copied out as the forward goes and back ahead of each recomputation.
    Named<"zero3-offload-bf16-hostckpt",
          Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed, CheckpointOffload<Host>>>,
    // The parameters in host memory too, each block copied to the GPU for its forward and again for its backward.
    Named<"zero3-stream-bf16-ckpt", Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, float>, Checkpointed>>,
    Named<"zero3-stream-bf16-ckpt-adam8",
          Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, float>, Checkpointed, QuantizedState<8>>>,
    // The compact host state: bf16 weights as their own master (stochastic rounding) + 8-bit moments, 6 bytes a parameter.
    Named<"zero3-stream-compact-ckpt",
          Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, bf16>, Checkpointed, QuantizedState<8>>>,
    // LoRA on a dense frozen bf16 base (the fine-tuning comparison's plain LoRA: QLoRA without the quantization).
    Named<"lora", Strategy<LoRA<8, 16>, Precision<bf16, float>, Checkpointed>>,
    // QLoRA: NF4 base weights, bf16 compute, fp32 adapters. CPU, or CUDA from an nvcc TU.
    Named<"qlora", Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed>>,
    // ... with forward and backward replayed from a CUDA graph (short samples: launches are most of the step)
    Named<"qlora-graphed", Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed, Graphed>>,
    // ... with adapters on all seven linears of each block, as the QLoRA paper trains them
    Named<"qlora-all", Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16, all_linears>, Precision<bf16, float>, Checkpointed>>,
    // The longest context: r=16 adapters on all linears, the checkpointed block inputs in host memory in 8 bits
    Named<"qlora-all16-hostckpt8", Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<16, 32, all_linears>, Precision<bf16, float>, Checkpointed,
                                            CheckpointOffload<Host, Int8>>>,
    // 70B on one GPU: r=16 adapters on all linears with 8-bit moments, the checkpointed block inputs in host memory; NF4 or
    // a GPTQ-format 4-bit base (group 128)
    Named<"qlora-all16-hostckpt-adam8", Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<16, 32, all_linears>, Precision<bf16, float>,
                                                 Checkpointed, CheckpointOffload<Host>, QuantizedState<8>>>,
    Named<"gptq4-all16-hostckpt-adam8", Strategy<Quantized<4, RTN, Group<128>>, LoRA<16, 32, all_linears>, Precision<bf16, float>,
                                                 Checkpointed, CheckpointOffload<Host>, QuantizedState<8>>>,
    // ... the same at 3 bits: the smallest GPU peak of a resident 70B base
    Named<"gptq3-all16-hostckpt-adam8", Strategy<Quantized<3, RTN, Group<128>>, LoRA<16, 32, all_linears>, Precision<bf16, float>,
                                                 Checkpointed, CheckpointOffload<Host>, QuantizedState<8>>>,
    // 175B on one GPU: the same with the NF4 blocks themselves in host memory, streamed through the GPU a block at a time,
    // and the checkpointed block inputs there in 8 bits
    Named<"qlora-all16-stream", Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<16, 32, all_linears>, Precision<bf16, float>, Checkpointed,
                                         CheckpointOffload<Host, Int8>, QuantizedState<8>, Offload<Host, Streamed>>>,
    // ... with the checkpointed block inputs in host memory between forward and backward
    Named<"qlora-hostckpt",
          Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed, CheckpointOffload<Host>>>,
    // ... and the NF4 blocks in host memory too, streamed through the GPU a block at a time (QLoRA 7B in about 3 GB)
    Named<"qlora-stream-hostckpt", Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed,
                                            CheckpointOffload<Host>, Offload<Host, Streamed>>>,
    // ... with the adapters' Adam moments as 8-bit codes (2 bytes + 8/256 per adapter value instead of 8)
    Named<"qlora-adam8", Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed, QuantizedState<8>>>,
    // The same on a GPTQ-format 4-bit base (group 128; the values by round-to-nearest: apply_lora has no calibration
    // data; a GPTQ-quantized checkpoint has the same format, memory and kernels).
    Named<"gptq4-lora", Strategy<Quantized<4, RTN, Group<128>>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed>>>;
// clang-format on

namespace detail {
template <std::size_t I, int Part, int Parts, class F>
void visit_strategy(F& f) {
  if constexpr (I % Parts == Part) {  // only this part's rows are instantiated
    using R = std::tuple_element_t<I, StrategyTable>;
    f.template operator()<typename R::strategy>(R::name);
  }
}
}  // namespace detail

// Calls f.template operator()<S>(name) for each row of the table, in order; with Parts > 1 only for the rows whose
// position is Part modulo Parts, so that several translation units can each compile a share of the rows.
template <int Part = 0, int Parts = 1, class F>
void for_each_strategy(F&& f) {
  static_assert(Parts >= 1 && Part >= 0 && Part < Parts, "for_each_strategy<Part, Parts>: 0 <= Part < Parts");
  [&]<std::size_t... I>(std::index_sequence<I...>) { (detail::visit_strategy<I, Part, Parts>(f), ...); }
  (std::make_index_sequence<std::tuple_size_v<StrategyTable>>{});
}

// Peak AdamW learning rate when none is given, by preset (llama_train and bench_table): what trains each from
// scratch: tiny 3e-3; 125m 1e-3 (run_gpu.sh's llama_gptq model, 1000 steps); TinyLlama 3e-4 (the strategy
// table's); LLaMA-7B 5e-6, warmed up (at 32 layers 3e-4 and 3e-5 diverge within a few steps, fp32 and bf16 alike;
// at B=8, 1e-5 falls to 5.4 and climbs back to 11.2, 5e-6 goes 11.2 -> 4.4 in 12 steps: bench/results/h200/diag7b.jsonl).
// The larger presets take LLaMA-7B's rate: untried from scratch, and deeper or wider models want no larger one.
inline double default_lr(std::string_view preset) {
  if (preset == "125m") return 1e-3;
  if (preset == "tinyllama-1.1b") return 3e-4;
  if (preset == "llama-7b" || preset == "llama-13b" || preset == "llama3-8b" || preset == "llama-70b" || preset == "llama-175b")
    return 5e-6;
  return 3e-3;
}

inline std::vector<std::string> strategy_names() {
  std::vector<std::string> names;
  for_each_strategy([&]<StrategyType S>(std::string_view name) { names.emplace_back(name); });
  return names;
}

// Calls f.template operator()<S>() for the strategy called `name`; throws listing the names otherwise.
template <class F>
void with_strategy(std::string_view name, F&& f) {
  bool found = false;
  for_each_strategy([&]<StrategyType S>(std::string_view n) {
    if (n == name && !found) {
      found = true;
      f.template operator()<S>();
    }
  });
  if (!found) {
    std::string known;
    for (const auto& n : strategy_names()) known += (known.empty() ? "" : ", ") + n;
    TORCH_CHECK(false, "unknown strategy '", std::string(name), "': this build has ", known);
  }
}

struct TrainOptions {
  double lr = 3e-3;
  double weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double clip = 1.0;  // global gradient-norm clip; <= 0: off
  // Each step's loss read back (BatchResult::loss). false: it stays on the device (BatchResult::loss_value) and a step
  // syncs the host at most once, or not at all where the trainer decides on the device (TrainerOptions::read_loss).
  bool read_loss = true;
  double initial_scale = 65536;  // dynamic loss scale (fp16 only)
  int64_t scale_growth_interval = 2000;
  // Tokens per chunk of the model's loss (nn::LlamaImpl::loss_chunk_tokens; 0: unchunked); plan_for takes the same.
  int64_t loss_chunk_tokens = plan::kDefaultLossChunkTokens;
  // The loss through nn::fused_linear_cross_entropy (nn::LlamaImpl::fused_loss).
  bool fused_loss = false;
  // The step the run is built for, B sequences of T tokens per optimizer step on this rank: when both are set, the
  // trainer refuses, before it moves anything to the device, a step the planner puts beyond the device's memory
  // (TrainerOptions::planned_step). 0: not checked.
  int64_t planned_batch = 0, planned_seq = 0;
  // Tokens per tile of each block's MLP (nn::LlamaImpl::mlp_tile_tokens; 0: untiled); plan_for takes the same.
  // llama_train and bench_table take plan::pick_mlp_tile's for the GPU when asked for "auto".
  int64_t mlp_tile_tokens = 0;
  bool decay_norms_biases_embeddings = false;  // TrainerOptions' default: no weight decay on them
  // Stage 3: every linear its own gather unit instead of each block (TrainerOptions::gather_unit), to compare the two.
  bool gather_layers_alone = false;
  // Stages 0-1: when the full gradient buffer exists (TrainerOptions::gradient_buffers). Unset: the timing with the
  // lower planned peak for each step's batch shape (plan::best_gradient_buffers, as plan_for plans it).
  std::optional<plan::GradientBuffers> gradient_buffers{};
  // Quantized strategies build the model block by block (nn::build_quantized_llama): its progress callback, the
  // training step to check the device against, the memory to compare with. Its device and seed are LlamaRun's.
  nn::LayerwiseOptions layerwise{};
};

// Long work's progress lines: one at most every 5 seconds, and the last one always.
struct ProgressThrottle {
  double last_s = 0;
  bool due(double seconds, bool done) {
    if (!done && seconds - last_s < 5) return false;
    last_s = seconds;
    return true;
  }
};

// Progress of a block-by-block build (nn::build_quantized_llama) on stderr: every 5 s and when done, with the time left.
inline nn::LayerwiseProgressFn build_progress(const std::string& model, bool print) {
  if (!print) return {};
  auto throttle = std::make_shared<ProgressThrottle>();
  return [model, throttle](const nn::LayerwiseProgress& p) {
    const bool done = p.blocks == p.blocks_total;
    if (!throttle->due(p.seconds, done)) return;
    std::fprintf(stderr, "building %s block by block: %lld/%lld blocks packed (%.2f GB), %.1f s%s\n", model.c_str(), (long long)p.blocks,
                 (long long)p.blocks_total, double(p.packed_bytes) / 1e9, p.seconds,
                 done ? "" : (", about " + std::to_string(int64_t(std::ceil(p.seconds_left))) + " s left").c_str());
  };
}

// The planner's TrainShape for B sequences of T tokens per optimizer step on one rank (S's micro-batches of B / N).
template <StrategyType S>
plan::TrainShape train_shape(const LlamaConfig& c, int64_t batch, int64_t seq, int world, int64_t loss_chunk_tokens,
                             std::optional<plan::GradientBuffers> gradient_buffers, int64_t mlp_tile_tokens = 0) {
  plan::TrainShape t{.micro_batch = batch / S::accumulation_steps,
                     .seq = seq,
                     .loss_chunk_tokens = loss_chunk_tokens,
                     .fused_kernels = c.fused_kernels,
                     .mlp_tile_tokens = mlp_tile_tokens};
  t.gradient_buffers = gradient_buffers ? *gradient_buffers : plan::best_gradient_buffers<S>(c.shape(), t, world);
  return t;
}

struct BatchResult {
  double loss = 0;                    // mean over the batch (NaN under TrainOptions::read_loss = false)
  torch::Tensor loss_value;           // [] float32 where the model runs: the same mean, never read here
  double grad_norm = 0;               // before clipping, unscaled
  double scale = 1;                   // loss scale used for this step
  bool applied = true;                // false: gradients overflowed, step skipped
  train::TransferCounters transfers;  // Offload<Host>: what crossed PCIe for this step and what it cost
};

// Device memory in bytes: allocated now and the peak since the last reset (CUDA caching allocator), or the
// process's resident set on the CPU (peak: high-water mark).
struct DeviceMemory {
  double current_gb = 0, peak_gb = 0, reserved_peak_gb = 0;
};

#if defined(SQUEEZE_TORCH_CUDA)
// c10's CUDA caching allocator sets itself up at the first CUDA allocation (C++ has no lazy init as Python
// does); its statistics calls fail with "Invalid device argument" before that. A one-element tensor does it.
inline c10::DeviceIndex cuda_allocator_ready(const torch::Device& device) {
  const c10::DeviceIndex index = device.index() < 0 ? c10::DeviceIndex(0) : device.index();
  (void)torch::empty({1}, torch::TensorOptions().device(torch::kCUDA, index));
  return index;
}
#endif

inline DeviceMemory device_memory(const torch::Device& device) {
  DeviceMemory m;
#if defined(SQUEEZE_TORCH_CUDA)
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(cuda_allocator_ready(device));
    m.current_gb = double(stats.allocated_bytes[0].current) / 1e9;  // [0]: all pools together
    m.peak_gb = double(stats.allocated_bytes[0].peak) / 1e9;
    m.reserved_peak_gb = double(stats.reserved_bytes[0].peak) / 1e9;  // what the allocator took from the driver
    return m;
  }
#endif
  (void)device;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) m.current_gb = std::stod(line.substr(6)) * 1024 / 1e9;
    if (line.rfind("VmHWM:", 0) == 0) m.peak_gb = std::stod(line.substr(6)) * 1024 / 1e9;
  }
  return m;
}

inline void reset_peak_memory(const torch::Device& device) {
#if defined(SQUEEZE_TORCH_CUDA)
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(cuda_allocator_ready(device));
#endif
  (void)device;
}

inline void check_batch(const torch::Tensor& x, const torch::Tensor& y, int micro_batches) {
  TORCH_CHECK(x.sizes() == y.sizes() && x.dim() == 2, "LlamaRun::step: inputs ", x.sizes(), " and targets ", y.sizes(),
              " must both be [batch, seq]");
  TORCH_CHECK(x.size(0) % micro_batches == 0, "LlamaRun::step: batch ", x.size(0), " does not split into Accumulate<", micro_batches,
              "> micro-batches: use a batch that is a multiple of ", micro_batches);
}

// Mean loss over (x, y) batches without gradients, in eval mode.
inline double evaluate_loss(Llama& model, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches) {
  TORCH_CHECK(!batches.empty(), "LlamaRun::evaluate: no validation batches");
  torch::NoGradGuard no_grad;
  model->eval();
  double sum = 0;
  for (const auto& [x, y] : batches) sum += model->loss(x, y).item<double>();
  model->train();
  return sum / double(batches.size());
}

// ---- checkpoints (every trainer) -----------------------------------------------------------------------
// The library's (squeeze::save_checkpoint, train/checkpoint.hpp): a directory of step-NNNNNN/ checkpoints, one
// safetensors file per rank and an index, `latest` naming the newest; the model's geometry rides in the record.
inline nlohmann::json geometry_of(const LlamaConfig& c) {
  const plan::RopeScaling& r = c.rope_scaling;
  return {{"preset", c.name},
          {"vocab", c.vocab},
          {"hidden", c.hidden},
          {"layers", c.layers},
          {"heads", c.heads},
          {"kv_heads", c.kv_heads},
          {"ffn", c.ffn},
          {"head_dim", c.head_dim()},
          {"tie_embeddings", c.tie_embeddings},
          {"rope_theta", c.rope_theta},
          {"norm_eps", c.norm_eps},
          {"rope_scaling",
           {{"type", plan::rope_type_name(r.type)},
            {"factor", r.factor},
            {"low_freq_factor", r.low_freq_factor},
            {"high_freq_factor", r.high_freq_factor},
            {"original_max_position_embeddings", r.original_max_position_embeddings}}}};
}

// The record of the checkpoint under `root` that a load would read, after checking it holds this geometry.
inline nlohmann::json checked_record(const std::string& root, const LlamaConfig& c) {
  const io::CheckpointReader r = io::CheckpointStore(root).open_latest({.verify = io::Verify::sizes});
  const nlohmann::json rec = r.index().record.value("user", nlohmann::json::object());
  const nlohmann::json want = geometry_of(c);
  nlohmann::json got = rec.value("model", nlohmann::json::object());
  TORCH_CHECK(got.is_object(), "checkpoint ", r.dir().string(), " has no model geometry: it was not written by this example");
  // Records that predate a field were written when it could only have its default (head_dim: hidden / heads).
  LlamaConfig defaults = c;
  defaults.explicit_head_dim = 0, defaults.tie_embeddings = false, defaults.rope_theta = LlamaConfig{}.rope_theta;
  defaults.norm_eps = LlamaConfig{}.norm_eps, defaults.rope_scaling = {};
  for (const auto& [key, value] : geometry_of(defaults).items())
    if (!got.contains(key)) got[key] = value;
  nlohmann::json a = got, b = want;
  a.erase("preset"), b.erase("preset");
  TORCH_CHECK(a == b, "checkpoint ", r.dir().string(), " holds preset '", got.value("preset", std::string("?")), "' ", got.dump(),
              ", but this model is '", c.name, "' ", want.dump());
  return rec;
}

// The example's trainer for any strategy: squeeze::make_trainer<S> on an nn::Llama built in float (rank 0's
// initial values are broadcast; the trainer converts the model to S's compute type with fp32 masters from the float
// values, gives LoRA strategies their frozen base and adapters, and switches Checkpointed on), stepped one batch of
// S::accumulation_steps micro-batches at a time. On one rank by default, or on the communicator given (LocalComm
// ranks in tests, NcclComm under squeeze-launch).
// TrainerOptions::gather_unit for TrainOptions::gather_layers_alone: no module is a unit, so each layer is one.
inline bool every_layer_alone(const std::string&, const torch::nn::Module&) { return false; }

// The model a LlamaRun<S> starts from, drawn from torch's global generator: in float on the host, or under a
// quantized strategy built block by block, each block packed on `device` before the next exists (the same values:
// nn/layerwise.hpp), so neither the host nor the device holds the float model.
template <StrategyType S>
Llama initial_model(LlamaConfig config, const TrainOptions& options, torch::Device device) {
  if constexpr (S::quantized_weights && S::has_lora) {
    nn::LayerwiseOptions o = options.layerwise;
    o.device = device;
    return nn::build_quantized_llama<S>(config, o);
  } else {
    return Llama(std::move(config));
  }
}

template <StrategyType S>
class LlamaRun {
 public:
  static constexpr int micro_batches = S::accumulation_steps;
  LlamaRun(LlamaConfig config, TrainOptions options, torch::Device device, comm::CommPtr comm = nullptr)
      : LlamaRun(initial_model<S>(std::move(config), options, device), options, device, std::move(comm)) {}
  // A model built by the caller (e.g. one per rank, built in order so every rank starts alike). Each rank
  // of `comm` constructs its LlamaRun at the same time (the constructor broadcasts rank 0's weights).
  LlamaRun(Llama model, TrainOptions options, torch::Device device, comm::CommPtr comm)
      : model_(std::move(model)), gradient_buffers_(options.gradient_buffers) {
    model_->loss_chunk_tokens = options.loss_chunk_tokens;
    model_->fused_loss = options.fused_loss;
    model_->mlp_tile_tokens = options.mlp_tile_tokens;
    model_->train();
    squeeze::AdamW adamw{.lr = float(options.lr),
                         .beta1 = float(options.beta1),
                         .beta2 = float(options.beta2),
                         .eps = float(options.eps),
                         .weight_decay = float(S::has_lora ? 0.0 : options.weight_decay),
                         .max_grad_norm = float(std::max(0.0, options.clip))};
    adamw.loss_scale.init_scale = float(options.initial_scale);
    adamw.loss_scale.growth_interval = int(options.scale_growth_interval);
    std::optional<train::TrainerOptions::PlannedStep> planned;
    if (options.planned_batch > 0 && options.planned_seq > 0)
      planned = train::TrainerOptions::PlannedStep{
          model_->config.shape(), train_shape<S>(model_->config, options.planned_batch, options.planned_seq, comm ? comm->size() : 1,
                                                 options.loss_chunk_tokens, options.gradient_buffers, options.mlp_tile_tokens)};
    // The model is built on the host in float (or already packed: initial_model); the trainer converts it on its way to
    // `device`, so the device never holds the float copy (the masters start from the float values kept on the host).
    trainer_.emplace(make_trainer<S>(model_, adamw, comm ? std::move(comm) : comm::LocalComm::single(),
                                     {.device = device,
                                      .gradient_buffers = options.gradient_buffers.value_or(plan::GradientBuffers::after_backward),
                                      .decay_norms_biases_embeddings = options.decay_norms_biases_embeddings,
                                      .gather_unit = options.gather_layers_alone ? every_layer_alone : nullptr,
                                      .planned_step = planned,
                                      .read_loss = options.read_loss}));
  }
  LlamaRun(const LlamaRun&) = delete;
  LlamaRun(LlamaRun&&) = default;

  // A trainer starting from the Hugging Face LLaMA in `dir`. Strategies that train full weights build the model
  // uninitialised in the compute dtype on `device` and stream the file into the trainer (under stage 3 each rank's
  // shards, the masters from the file's values): host memory holds the optimizer state and at most two checkpoint
  // tensors. Quantized strategies read the file block by block, each block packed before the next is read
  // (nn::build_quantized_llama; options.layerwise.progress after each block); other LoRA strategies load the float
  // model first and convert their frozen base from it. progress is called after each checkpoint tensor (not under a
  // quantized strategy).
  static LlamaRun from_hf(const std::filesystem::path& dir, TrainOptions options, torch::Device device, comm::CommPtr comm = nullptr,
                          const nn::HfProgressFn& progress = {}) {
    if constexpr (S::quantized_weights && S::has_lora) {
      nn::LayerwiseOptions o = options.layerwise;
      o.device = device;
      return LlamaRun(nn::build_quantized_llama<S>(dir, o), options, device, std::move(comm));
    } else if constexpr (S::has_lora) {
      return LlamaRun(nn::load_hf_llama(dir, {.dtype = torch::kFloat32, .progress = progress}), options, device, std::move(comm));
    } else {
      // The files start into the page cache while the trainer allocates its state (a hint; the loader below
      // checks the directory and reports what is wrong with it).
      std::thread warm([dir] {
        try {
          io::SafetensorsCheckpoint::open(dir).will_need();
        } catch (...) {}
      });
      struct Join {
        std::thread& t;
        ~Join() { t.join(); }
      } join{warm};
      const io::LlamaConfig hf = io::load_llama_config(dir);
      // Streamed parameters are made on the host, where their shards will live: the device never holds the model.
      const auto compute = torch::TensorOptions()
                               .dtype(torch_dtype<typename S::compute_type>())
                               .device(S::stream_params ? torch::Device(torch::kCPU) : device);
      LlamaRun t(Llama(nn::from_hf_config(hf, dir.string()), nn::ParamInit{compute, /*random=*/false}), options, device, std::move(comm));
      nn::load_hf_weights(*t.trainer_, *t.model_, dir, {}, progress);
      return t;
    }
  }

  Llama& model() { return model_; }
  train::Trainer<S, squeeze::AdamW>& trainer() { return *trainer_; }  // the library's trainer it drives
  int64_t step_count() const { return trainer_->steps_applied(); }
  double loss_scale() const { return trainer_->scale(); }
  void set_lr(double lr) { trainer_->set_lr(float(lr)); }
  // Offload<Host> may still be updating layers on the CPU after step() returns (it overlaps the next
  // forward): wait for every update to land (time a step with it; evaluation's gathers wait by themselves).
  void sync() { trainer_->sync(); }
  // Where the Offload<Host> pipeline's host time went since the last reset (zeros without offload).
  train::OffloadStats offload_stats() const { return trainer_->offload_stats(); }
  void reset_offload_stats() { trainer_->reset_offload_stats(); }

  // One optimizer step: x, y [B, T] in S::accumulation_steps micro-batches of B / N rows.
  BatchResult step(const torch::Tensor& x, const torch::Tensor& y) {
    check_batch(x, y, micro_batches);
    if (!gradient_buffers_)  // the planner's choice for this batch shape (plan_for plans the same)
      trainer_->set_gradient_buffers(train_shape<S>(model_->config, x.size(0), x.size(1), trainer_->communicator().size(),
                                                    model_->loss_chunk_tokens, {}, model_->mlp_tile_tokens)
                                         .gradient_buffers);
    BatchResult r;
    r.scale = trainer_->scale();
    const int64_t micro = x.size(0) / micro_batches;
    for (int i = 0; i < micro_batches; ++i) {
      const torch::Tensor xi = x.narrow(0, i * micro, micro), yi = y.narrow(0, i * micro, micro);  // [B/N, T]
      const train::StepResult m = trainer_->step({xi, yi}, [&](const train::StepInputs& in) { return model_->loss(in[0], in[1]); });
      r.loss += double(m.loss) / micro_batches;
      r.loss_value = i == 0 ? m.loss_value / micro_batches : r.loss_value + m.loss_value / micro_batches;
      if (m.boundary) {
        r.applied = m.applied;
        r.grad_norm = m.grad_norm;
        r.transfers = m.transfers;
      }
    }
    return r;
  }

  double evaluate(const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches) { return evaluate_loss(model_, batches); }
  // Full values of every trainable parameter by name (stage 3 gathers them: a collective, every rank calls it).
  std::vector<std::pair<std::string, torch::Tensor>> full_parameters() { return trainer_->full_parameters(); }

  // ---- checkpoints ------------------------------------------------------------------------------------
  // Every rank calls save (a collective) and writes its own shard of the optimizer state; load maps a checkpoint
  // of any world size and stage onto this trainer (squeeze::load_checkpoint), after checking the geometry.
  void save(const std::string& root, nlohmann::json record = nlohmann::json::object()) {
    record["model"] = geometry_of(model_->config);
    save_checkpoint(*trainer_, root, std::move(record));
  }
  nlohmann::json load(const std::string& root) {
    checked_record(root, model_->config);
    return load_checkpoint(*trainer_, root);
  }

 private:
  Llama model_;
  std::optional<plan::GradientBuffers> gradient_buffers_;  // TrainOptions::gradient_buffers
  std::optional<train::Trainer<S, squeeze::AdamW>> trainer_;
};

// The trained weights of a checkpoint written by LlamaRun<S>::save for a strategy that trains full weights, as a new
// model on `device` (geometry checked against `config`): what llama_gptq quantizes.
inline Llama load_weights(const std::string& root, LlamaConfig config, torch::Device device) {
  checked_record(root, config);
  Llama model(std::move(config));
  load_checkpoint_weights(*model, root);
  model->to(device);
  return model;
}

// The planner for S with B sequences of T tokens per optimizer step on one rank, and the example's trainer (its
// gradient buffer timing, TrainOptions::gradient_buffers or unset the planner's choice) with the model's loss chunk
// (TrainOptions::loss_chunk_tokens) and MLP tile (TrainOptions::mlp_tile_tokens): plan_for<S>(c, B, T).peak().device.
template <StrategyType S>
plan::MemoryPlan plan_for(const LlamaConfig& c, int64_t batch, int64_t seq, int world = 1,
                          int64_t loss_chunk_tokens = plan::kDefaultLossChunkTokens,
                          std::optional<plan::GradientBuffers> gradient_buffers = {}, int64_t mlp_tile_tokens = 0) {
  return plan::plan_memory<S>(c.shape(), train_shape<S>(c, batch, seq, world, loss_chunk_tokens, gradient_buffers, mlp_tile_tokens), world);
}

}  // namespace squeeze::llama
