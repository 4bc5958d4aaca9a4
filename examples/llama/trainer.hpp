#pragma once
// One optimizer step of the LLaMA example, templated on a squeeze Strategy (shared by train.cpp, the llama
// tests and bench/table):
//   Precision<C, M>  the model's parameters are kept in C (forward, backward and gradients in C); float
//                    master weights M and the AdamW state live beside them, gradients are moved into the
//                    master copy after each backward and the updated masters are copied back into C.
//   loss scaling     fp16 gradients underflow: the loss is multiplied by a dynamic scale before backward;
//                    a step whose gradients hold inf/NaN is skipped and the scale halved; 2000 good steps
//                    double it.
//   Accumulate<N>    the batch is split into N micro-batches whose gradients are summed before one update
//                    (into the float master gradients when there is a master copy).
//   Checkpointed / CheckpointEvery<N>   the model recomputes segments of N blocks in backward.
// Sharded<StageN> and Offload<Host> go to squeeze's ZeRO trainer (nn/trainer.hpp) through ZeroTrainer below,
// on one rank by default or on the communicator given (e.g. LocalComm ranks in tests).
// Checkpoints (save/load, every trainer) hold the float weights, the optimizer state, the step and the loss
// scale; they are written to a temporary file and renamed, so a failed save never replaces a good checkpoint.
#include <squeeze/comm/local.hpp>
#include <squeeze/nn/llama.hpp>
#include <squeeze/nn/lora.hpp>
#include <squeeze/train/trainer.hpp>
#include <squeeze/optim/adamw.hpp>
#include <squeeze/plan.hpp>
#include <squeeze/policy.hpp>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(SQUEEZE_TORCH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace squeeze::llama {

using squeeze::nn::Llama;
using squeeze::nn::LlamaConfig;

template <class T>
constexpr torch::ScalarType torch_dtype() {
  if constexpr (std::is_same_v<T, float>) return torch::kFloat32;
  else if constexpr (std::is_same_v<T, squeeze::bf16>) return torch::kBFloat16;
  else return torch::kFloat16;
}

// The strategies this example compiles in, each with its --strategy name. Add a row here to add one.
template <class F>
void for_each_strategy(F&& f) {
  f.template operator()<Strategy<>>("fp32");
  f.template operator()<Strategy<Accumulate<4>>>("accum4");
  f.template operator()<Strategy<Precision<bf16, float>>>("bf16");
  f.template operator()<Strategy<Precision<half, float>>>("fp16");  // dynamic loss scaling
  f.template operator()<Strategy<Checkpointed>>("ckpt");
  f.template operator()<Strategy<CheckpointEvery<2>>>("ckpt2");
  f.template operator()<Strategy<Precision<bf16, float>, Checkpointed>>("bf16-ckpt");
  f.template operator()<Strategy<Precision<half, float>, Accumulate<4>>>("fp16-accum4");
  f.template operator()<Strategy<Precision<bf16, float>, Accumulate<4>, Checkpointed>>("bf16-accum4-ckpt");
  // ZeRO (squeeze's sharded trainer). Over N GPUs stage 3 alone keeps 16 bytes/parameter / N of model state (the
  // scaling rows of bench_table); on one GPU, Offload<Host> is what saves memory.
  f.template operator()<Strategy<Sharded<Stage2>, Precision<bf16, float>>>("zero2-bf16");
  f.template operator()<Strategy<Sharded<Stage3>, Precision<bf16, float>>>("zero3-bf16");
  f.template operator()<Strategy<Sharded<Stage3>, Precision<bf16, float>, Checkpointed>>("zero3-bf16-ckpt");
  f.template operator()<Strategy<Sharded<Stage3>, Offload<Host>>>("zero3-offload");
  f.template operator()<Strategy<Sharded<Stage3>, Offload<Host>, Precision<half, float>>>("zero3-offload-fp16");
  f.template operator()<Strategy<Sharded<Stage3>, Offload<Host>, Precision<half, float>, Accumulate<4>>>("zero3-offload-fp16-accum4");
  f.template operator()<Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed>>("zero3-offload-bf16-ckpt");
  // The same with 8-bit Adam moments (block-wise quantized, 2 bytes per parameter instead of 8 on the host).
  f.template operator()<Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed, Quantized<8, Blockwise8>>>(
      "zero3-offload-bf16-ckpt-adam8");
  // QLoRA (squeeze's LoraTrainer): NF4 base weights, bf16 compute, fp32 adapters. CPU, or CUDA from an nvcc TU.
  f.template operator()<Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed>>("qlora");
  // ... with the adapters' Adam moments as 8-bit codes (nn::AdamW8; 2 bytes + 8/256 per adapter value instead of 8)
  f.template operator()<Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed, Quantized<8, Blockwise8>>>(
      "qlora-adam8");
  // The same on a GPTQ-format 4-bit base (group 128; the values by round-to-nearest: apply_lora has no calibration
  // data; a GPTQ-quantized checkpoint has the same format, memory and kernels).
  f.template operator()<Strategy<Quantized<4, RTN, Group<128>>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed>>("gptq4-lora");
}

// Peak AdamW learning rate when none is given, by preset (llama_train and bench_table): what trains each from
// scratch: tiny 3e-3; 125m 1e-3 (run_gpu.sh's llama_gptq model, 1000 steps); TinyLlama 3e-4 (the strategy
// table's); LLaMA-7B 1e-5 (at 32 layers 3e-4 and 3e-5 diverge within a few steps, fp32 and bf16 alike:
// bench/results/h200/diag7b.jsonl; B=8 is still unsteady at 1e-5: table-7b.jsonl).
inline double default_lr(std::string_view preset) {
  if (preset == "125m") return 1e-3;
  if (preset == "tinyllama-1.1b") return 3e-4;
  if (preset == "llama-7b") return 1e-5;
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
  double clip = 1.0;              // global gradient-norm clip; <= 0: off
  double initial_scale = 65536;   // dynamic loss scale (fp16 only)
  int64_t scale_growth_interval = 2000;
  // Tokens per chunk of the model's loss (nn::LlamaImpl::loss_chunk_tokens; 0: unchunked); plan_for takes the same.
  int64_t loss_chunk_tokens = plan::kDefaultLossChunkTokens;
};

struct StepResult {
  double loss = 0;       // mean over the batch
  double grad_norm = 0;  // before clipping, unscaled
  double scale = 1;      // loss scale used for this step
  bool applied = true;   // false: gradients overflowed, step skipped
};

// Device memory in bytes: allocated now and the peak since the last reset (CUDA caching allocator), or the
// process's resident set on the CPU (peak: high-water mark).
struct MemoryUse { double current_gb = 0, peak_gb = 0, reserved_peak_gb = 0; };

#if defined(SQUEEZE_TORCH_CUDA)
// c10's CUDA caching allocator sets itself up at the first CUDA allocation (C++ has no lazy init as Python
// does); its statistics calls fail with "Invalid device argument" before that. A one-element tensor does it.
inline c10::DeviceIndex cuda_allocator_ready(const torch::Device& device) {
  const c10::DeviceIndex index = device.index() < 0 ? c10::DeviceIndex(0) : device.index();
  (void)torch::empty({1}, torch::TensorOptions().device(torch::kCUDA, index));
  return index;
}
#endif

inline MemoryUse memory_use(const torch::Device& device) {
  MemoryUse m;
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
  TORCH_CHECK(x.sizes() == y.sizes() && x.dim() == 2, "Trainer::step: inputs ", x.sizes(), " and targets ", y.sizes(),
              " must both be [batch, seq]");
  TORCH_CHECK(x.size(0) % micro_batches == 0, "Trainer::step: batch ", x.size(0), " does not split into Accumulate<", micro_batches,
              "> micro-batches: use a batch that is a multiple of ", micro_batches);
}

// Mean loss over (x, y) batches without gradients, in eval mode.
inline double evaluate_loss(Llama& model, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches) {
  TORCH_CHECK(!batches.empty(), "Trainer::evaluate: no validation batches");
  torch::NoGradGuard no_grad;
  model->eval();
  double sum = 0;
  for (const auto& [x, y] : batches) sum += model->loss(x, y).item<double>();
  model->train();
  return sum / double(batches.size());
}

// ---- checkpoints (every trainer) -----------------------------------------------------------------------
// A torch archive: format tag, the trainer kind ("local", "zero", "lora": each has its own state), the
// strategy and geometry it was written under, then the trainer's named tensors and scalars. Written to
// FILE.tmp and renamed, so a failed save never replaces a good checkpoint.
inline constexpr const char* kCheckpointFormat = "squeeze-llama-checkpoint-2";

inline std::vector<int64_t> geometry_of(const LlamaConfig& c) { return {c.vocab, c.hidden, c.layers, c.heads, c.kv_heads, c.ffn}; }

class CheckpointWriter {
 public:
  CheckpointWriter(const LlamaConfig& c, std::string_view strategy, std::string_view kind) {
    archive_.write("format", c10::IValue(std::string(kCheckpointFormat)));
    archive_.write("kind", c10::IValue(std::string(kind)));
    archive_.write("strategy", c10::IValue(std::string(strategy)));
    archive_.write("preset", c10::IValue(c.name));
    archive_.write("geometry", c10::IValue(geometry_of(c)));
  }
  void tensor(const std::string& key, const torch::Tensor& t) { archive_.write(key, t.detach().to(torch::kCPU).clone()); }
  void scalar(const std::string& key, int64_t v) { archive_.write(key, c10::IValue(v)); }
  void scalar(const std::string& key, double v) { archive_.write(key, c10::IValue(v)); }
  void archive(const std::string& key, torch::serialize::OutputArchive& a) { archive_.write(key, a); }
  void save(const std::string& path) {
    const std::string tmp = path + ".tmp";
    try {
      archive_.save_to(tmp);
    } catch (const std::exception& e) {
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
      TORCH_CHECK(false, "could not write checkpoint '", tmp, "': ", e.what(), " (", path, " was left as it was)");
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    TORCH_CHECK(!ec, "could not rename '", tmp, "' to '", path, "': ", ec.message());
  }

 private:
  torch::serialize::OutputArchive archive_;
};

// Opens and checks a checkpoint (format, kind, geometry); the trainer then reads everything it needs and
// checks it before changing anything.
class CheckpointReader {
 public:
  CheckpointReader(const std::string& path, const LlamaConfig& c, std::string_view kind) : path_(path) {
    TORCH_CHECK(std::filesystem::exists(path), "checkpoint '", path, "' does not exist");
    try {
      archive_.load_from(path);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      TORCH_CHECK(false, "checkpoint '", path, "' is corrupt or not a checkpoint (", what.substr(0, what.find('\n')), ")");
    }
    c10::IValue v;
    TORCH_CHECK(archive_.try_read("format", v) && v.isString() && v.toStringRef() == kCheckpointFormat, "'", path,
                "' is not a squeeze LLaMA checkpoint (format tag missing or of another version)");
    const std::string got_kind = string("kind"), strategy = string("strategy");
    TORCH_CHECK(got_kind == kind, "checkpoint '", path, "' was written by strategy '", strategy, "' (", got_kind,
                " trainer); this strategy uses the ", std::string(kind), " trainer: load it with a strategy of the same kind");
    const std::vector<int64_t> want = geometry_of(c);
    TORCH_CHECK(archive_.try_read("geometry", v) && v.isIntList(), "checkpoint '", path, "' has no geometry");
    const std::vector<int64_t> got = v.toIntVector();
    TORCH_CHECK(got == want, "checkpoint '", path, "' holds preset '", string("preset"), "' with (vocab, hidden, layers, heads, kv_heads, ffn) = ",
                c10::IntArrayRef(got), ", but this model is '", c.name, "' ", c10::IntArrayRef(want));
  }
  std::string string(const std::string& key) {
    c10::IValue v;
    TORCH_CHECK(archive_.try_read(key, v) && v.isString(), "checkpoint '", path_, "' has no '", key, "'");
    return v.toStringRef();
  }
  int64_t integer(const std::string& key) {
    c10::IValue v;
    TORCH_CHECK(archive_.try_read(key, v) && v.isInt(), "checkpoint '", path_, "' has no '", key, "'");
    return v.toInt();
  }
  double real(const std::string& key) {
    c10::IValue v;
    TORCH_CHECK(archive_.try_read(key, v) && v.isDouble(), "checkpoint '", path_, "' has no '", key, "'");
    return v.toDouble();
  }
  torch::serialize::InputArchive archive(const std::string& key) {
    torch::serialize::InputArchive a;
    TORCH_CHECK(archive_.try_read(key, a), "checkpoint '", path_, "' has no '", key, "'");
    return a;
  }
  // A tensor of the given shape (finite, if floating-point).
  torch::Tensor tensor(const std::string& key, c10::IntArrayRef shape) {
    torch::Tensor t;
    TORCH_CHECK(archive_.try_read(key, t), "checkpoint '", path_, "' has no tensor '", key, "'");
    TORCH_CHECK(t.sizes() == shape, "checkpoint '", path_, "': '", key, "' is ", t.sizes(), ", the model expects ", shape);
    if (t.is_floating_point()) TORCH_CHECK(t.isfinite().all().item<bool>(), "checkpoint '", path_, "': '", key, "' holds inf/NaN");
    return t;
  }

 private:
  std::string path_;
  torch::serialize::InputArchive archive_;
};

// Stage 0 on one device. Memory, step by step (what the planner's peak() models with free_grads = true):
//   kept between steps  the model in the compute type, fp32 masters (mixed precision), AdamW's m and v
//   backward            creates the gradients in the compute type, layer by layer, as activations are freed
//   Accumulate<N>       mixed precision: each micro-batch's gradients are added into fp32 accumulators (which
//                       live until the update) and freed; float: they accumulate in place in .grad
//   update              per tensor: unscale + clip folded into one multiplier, AdamW on the fp32 weights (the
//                       gradient converted one tensor at a time), the compute copy rounded from the master;
//                       then the gradients are freed (set to none). Temporaries: two fp32 tensors of the
//                       largest parameter.
// AdamW is PyTorch's (decoupled decay, bias correction), written with torch ops so it runs on any device from
// a host-compiled translation unit.
template <StrategyType S>
class LocalTrainer {
  static_assert(S::training, "the LLaMA trainer trains: remove Inference");
  static_assert(S::stage == 0 && !S::offload_to_host, "Sharded<...>/Offload<Host> strategies train with ZeroTrainer");
  static_assert(!S::quantized_weights && !S::has_lora && S::state_bits == 32,
                "quantized weights and LoRA train with LoraTrainer; 8-bit optimizer state with squeeze's ZeRO trainer (add Sharded<...>), not this trainer");

 public:
  using compute_type = typename S::compute_type;
  static constexpr bool has_master = S::has_master_copy;
  static constexpr int micro_batches = S::accumulation_steps;
  static constexpr bool fp32_accumulators = micro_batches > 1 && has_master;
  static constexpr bool frees_gradients = true;  // for the planner (plan::TrainShape::free_grads)

  LocalTrainer(LlamaConfig config, TrainOptions options, torch::Device device)
      : model_(std::move(config)), options_(options), device_(device), scale_(S::loss_scaling ? options.initial_scale : 1.0) {
    // Masters are taken from the float initialisation, so every strategy starts from the same weights.
    const auto f32 = torch::TensorOptions().device(device_).dtype(torch::kFloat32);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model_->parameters()) {
        if constexpr (has_master) master_.push_back(p.detach().to(f32).contiguous());
        m_.push_back(torch::zeros(p.sizes(), f32));
        v_.push_back(torch::zeros(p.sizes(), f32));
        if constexpr (fp32_accumulators) acc_.push_back(torch::zeros(p.sizes(), f32));
      }
    }
    model_->to(device_, torch_dtype<compute_type>());
    model_->checkpoint_every = S::checkpoint_every;
    model_->loss_chunk_tokens = options.loss_chunk_tokens;
    model_->train();
    params_ = model_->parameters();
  }

  Llama& model() { return model_; }
  int64_t step_count() const { return step_; }
  double loss_scale() const { return scale_; }
  void set_lr(double lr) { options_.lr = lr; }
  void sync() {}  // every update has landed when step() returns

  // One optimizer step on tokens x -> targets y, both [B, T] int64 on the trainer's device.
  StepResult step(const torch::Tensor& x, const torch::Tensor& y) {
    check_batch(x, y, micro_batches);
    StepResult r;
    r.scale = scale_;
    const int64_t micro = x.size(0) / micro_batches;
    torch::Tensor loss_sum = torch::zeros({}, torch::TensorOptions().device(device_));
    for (int i = 0; i < micro_batches; ++i) {
      const torch::Tensor xi = x.narrow(0, i * micro, micro), yi = y.narrow(0, i * micro, micro);  // [B/N, T]
      const torch::Tensor loss = model_->loss(xi, yi);
      loss_sum += loss.detach();
      (loss * (scale_ / micro_batches)).backward();
      if constexpr (fp32_accumulators) accumulate(i == 0);
    }
    r.loss = loss_sum.item<double>() / micro_batches;

    // Global L2 norm of the (scaled) gradients, in double over per-tensor fp32 norms.
    double sumsq = 0;
    {
      torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> norms;
      for (size_t i = 0; i < params_.size(); ++i)
        if (const torch::Tensor& g = grad(i); g.defined()) norms.push_back(at::linalg_vector_norm(g, 2, std::nullopt, false, torch::kFloat32));
      if (!norms.empty()) sumsq = torch::stack(norms).to(torch::kFloat64).square().sum().item<double>();
    }
    r.grad_norm = std::sqrt(sumsq) / scale_;
    if (!std::isfinite(r.grad_norm)) {  // overflow (fp16) or divergence: skip the update
      r.applied = false;
      if constexpr (S::dynamic_loss_scaling) {
        scale_ = std::max(1.0, scale_ / 2);
        good_steps_ = 0;
      }
      free_grads();
      return r;
    }
    const double clip = options_.clip > 0 ? std::min(1.0, options_.clip / (r.grad_norm + 1e-6)) : 1.0;
    update(clip / scale_);
    free_grads();
    if constexpr (S::dynamic_loss_scaling) {
      if (++good_steps_ >= options_.scale_growth_interval) {
        scale_ *= 2;
        good_steps_ = 0;
      }
    }
    ++step_;
    return r;
  }

  // Mean loss over (x, y) batches without gradients, in eval mode.
  double evaluate(const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches) {
    return evaluate_loss(model_, batches);
  }

  // ---- checkpoints ------------------------------------------------------------------------------------
  // Float weights (the masters, or the float parameters), AdamW's moments, the step and the loss scale.
  // One written under any local strategy loads under any other of the same model.
  void save(const std::string& path, std::string_view strategy_name) {
    CheckpointWriter w(model_->config, strategy_name, "local");
    w.scalar("step", step_);
    w.scalar("loss_scale", scale_);
    w.scalar("good_steps", good_steps_);
    const auto names = model_->named_parameters().keys();
    for (size_t i = 0; i < names.size(); ++i) {
      w.tensor("weights/" + names[i], weights(i));
      w.tensor("adam_m/" + names[i], m_[i]);
      w.tensor("adam_v/" + names[i], v_[i]);
    }
    w.save(path);
  }

  // Loads a checkpoint written by save(), from any local strategy of the same geometry. Everything is read
  // and checked before the model is touched; a file that is not a checkpoint, or is of another model, throws.
  void load(const std::string& path) {
    CheckpointReader r(path, model_->config, "local");
    const auto names = model_->named_parameters().keys();
    std::vector<torch::Tensor> w(names.size()), m(names.size()), v(names.size());
    for (size_t i = 0; i < names.size(); ++i) {
      w[i] = r.tensor("weights/" + names[i], params_[i].sizes());
      m[i] = r.tensor("adam_m/" + names[i], params_[i].sizes());
      v[i] = r.tensor("adam_v/" + names[i], params_[i].sizes());
    }
    const int64_t step = r.integer("step"), good = r.integer("good_steps");
    const double scale = r.real("loss_scale");
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < names.size(); ++i) {
      weights(i).copy_(w[i]);
      if constexpr (has_master) params_[i].copy_(w[i]);
      m_[i].copy_(m[i]);
      v_[i].copy_(v[i]);
    }
    step_ = step;
    if constexpr (S::loss_scaling) {
      scale_ = scale;
      good_steps_ = good;
    }
  }

 private:
  // The fp32 weights AdamW updates: the master copy, or the float parameter itself.
  torch::Tensor& weights(size_t i) {
    if constexpr (has_master) return master_[i];
    else return params_[i];
  }
  // The gradient the update reads: the fp32 accumulator, or backward's.
  const torch::Tensor& grad(size_t i) {
    if constexpr (fp32_accumulators) return acc_[i];
    else return params_[i].grad();
  }

  // Mixed-precision micro-batch: add the compute-type gradients into the fp32 accumulators, free them.
  void accumulate(bool first) {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      torch::Tensor& g = params_[i].mutable_grad();
      if (first) acc_[i].zero_();
      if (g.defined()) acc_[i].add_(g);
      g = torch::Tensor();
    }
  }

  // AdamW on every tensor; gmul = clip / loss scale multiplies the gradients.
  void update(double gmul) {
    torch::NoGradGuard no_grad;
    const auto c = kernels::adamw_coeffs(float(options_.lr), float(options_.beta1), float(options_.beta2), float(options_.eps),
                                         float(options_.weight_decay), step_ + 1);
    for (size_t i = 0; i < params_.size(); ++i) {
      const torch::Tensor& g = grad(i);
      if (!g.defined()) continue;
      // fp32 gradient: a temporary for 16-bit gradients; float ones (freed or re-zeroed after the step) are
      // scaled in place. With denom that is at most two fp32 temporaries of the largest parameter.
      torch::Tensor g32 = g.to(torch::kFloat32);
      if (gmul != 1.0) g32.mul_(gmul);
      nn::detail::adamw_torch_ops(weights(i), m_[i], v_[i], g32, c);
      if constexpr (has_master) params_[i].copy_(weights(i));  // round to the compute type
    }
  }

  void free_grads() {
    for (auto& p : params_) p.mutable_grad() = torch::Tensor();
  }

  Llama model_;
  TrainOptions options_;
  torch::Device device_;
  std::vector<torch::Tensor> params_;            // the model's parameters (compute type)
  std::vector<torch::Tensor> master_;            // fp32 copies (mixed precision only)
  std::vector<torch::Tensor> m_, v_;             // AdamW moments, fp32
  std::vector<torch::Tensor> acc_;               // fp32 gradient accumulators (mixed precision + Accumulate<N>)
  double scale_ = 1.0;
  int64_t good_steps_ = 0;
  int64_t step_ = 0;
};

// Sharded<StageN> / Offload<Host>: squeeze's ZeRO trainer (nn/trainer.hpp) behind the same interface. The
// model is built in float (the same initial weights as LocalTrainer), converted to the compute type and
// handed over; the trainer keeps the masters (from the converted weights) and AdamW state, sharded and/or
// on the host. set_lr forwards to nn::Trainer::set_lr (the schedule of train.cpp applies to every strategy).
template <StrategyType S>
class ZeroTrainer {
 public:
  static constexpr int micro_batches = S::accumulation_steps;
  static constexpr bool frees_gradients = false;  // flat gradient buffers (plan::TrainShape::free_grads)

  ZeroTrainer(LlamaConfig config, TrainOptions options, torch::Device device, comm::CommPtr comm = nullptr)
      : ZeroTrainer(Llama(std::move(config)), options, device, std::move(comm)) {}
  // A model built by the caller (e.g. one per rank, built in order so every rank starts alike). Each rank
  // of `comm` constructs its ZeroTrainer at the same time (the constructor broadcasts rank 0's weights).
  ZeroTrainer(Llama model, TrainOptions options, torch::Device device, comm::CommPtr comm)
      : model_(std::move(model)) {
    // The fp32 masters start from the float initialisation, as LocalTrainer's do (not from its bf16 rounding,
    // which would drop every update smaller than half a bf16 step for the first steps). The float tensors stay
    // alive only until the trainer has taken them (master_init moves each one out).
    std::map<std::string, torch::Tensor> float_init;
    if constexpr (S::has_master_copy && !std::is_same_v<typename S::compute_type, float>)
      for (const auto& p : model_->named_parameters())
        if (p.value().scalar_type() == torch::kFloat32) float_init.emplace(p.key(), p.value().detach());
    model_->to(device, torch_dtype<typename S::compute_type>());
    model_->checkpoint_every = S::checkpoint_every;
    model_->loss_chunk_tokens = options.loss_chunk_tokens;
    model_->train();
    for (const auto& p : model_->named_parameters()) shapes_.emplace_back(p.key(), p.value().sizes().vec());  // before stage 3 empties them
    squeeze::AdamW adamw{.lr = float(options.lr), .beta1 = float(options.beta1), .beta2 = float(options.beta2), .eps = float(options.eps),
                .weight_decay = float(options.weight_decay), .max_grad_norm = float(std::max(0.0, options.clip))};
    adamw.loss_scale.init_scale = float(options.initial_scale);
    adamw.loss_scale.growth_interval = int(options.scale_growth_interval);
    nn::TrainerOptions topt;
    if (!float_init.empty())
      topt.master_init = [&float_init](const std::string& name) {
        const auto it = float_init.find(name);
        TORCH_CHECK(it != float_init.end(), "ZeroTrainer: no float initialisation for '", name, "'");
        torch::Tensor t = std::move(it->second);
        float_init.erase(it);
        return t;
      };
    trainer_.emplace(make_trainer<S>(model_, adamw, comm ? std::move(comm) : comm::LocalComm::single(), std::move(topt)));
  }
  ZeroTrainer(const ZeroTrainer&) = delete;

  Llama& model() { return model_; }
  int64_t step_count() const { return trainer_->steps_applied(); }
  double loss_scale() const { return trainer_->scale(); }
  void set_lr(double lr) { trainer_->set_lr(float(lr)); }
  // Offload<Host> may still be updating layers on the CPU after step() returns (it overlaps the next
  // forward): wait for every update to land (time a step with it; evaluation's gathers wait by themselves).
  void sync() { trainer_->sync(); }
  // Where the Offload<Host> pipeline's host time went since the last reset (zeros without offload).
  nn::OffloadStats offload_stats() const { return trainer_->offload_stats(); }
  void reset_offload_stats() { trainer_->reset_offload_stats(); }

  StepResult step(const torch::Tensor& x, const torch::Tensor& y) {
    check_batch(x, y, micro_batches);
    StepResult r;
    r.scale = trainer_->scale();
    const int64_t micro = x.size(0) / micro_batches;
    for (int i = 0; i < micro_batches; ++i) {
      const torch::Tensor xi = x.narrow(0, i * micro, micro), yi = y.narrow(0, i * micro, micro);  // [B/N, T]
      const nn::StepResult m = trainer_->step([&] { return model_->loss(xi, yi); });
      r.loss += double(m.loss) / micro_batches;
      if (m.boundary) {
        r.applied = m.applied;
        r.grad_norm = m.grad_norm;
      }
    }
    return r;
  }

  double evaluate(const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches) { return evaluate_loss(model_, batches); }
  // Full values of every trainable parameter by name (stage 3 gathers them: a collective, every rank calls it).
  std::vector<std::pair<std::string, torch::Tensor>> full_parameters() { return trainer_->full_parameters(); }

  // ---- checkpoints ------------------------------------------------------------------------------------
  // Every rank writes its own file (PATH at world size 1, PATH.rank<r>-of-<N> otherwise): the full weights
  // by name (float; gathering them is a collective, so every rank calls save), this rank's optimizer
  // partitions (fp32 master, m, v, in the trainer's flat layout) and the counters. A checkpoint loads into
  // the same strategy at the same world size.
  void save(const std::string& path, std::string_view strategy_name) {
    comm::Communicator& c = trainer_->communicator();
    CheckpointWriter w(model_->config, strategy_name, "zero");
    w.scalar("world", int64_t(c.size()));
    w.scalar("rank", int64_t(c.rank()));
    w.scalar("step", trainer_->steps_applied());
    w.scalar("loss_scale", double(trainer_->scale()));
    w.scalar("good_steps", int64_t(trainer_->loss_scaler().state().growth_tracker));
    for (const auto& [name, t] : trainer_->full_parameters()) w.tensor("weights/" + name, t.to(torch::kFloat32));
    const auto state = trainer_->optimizer_state();
    for (size_t k = 0; k < state.size(); ++k)
      for (size_t j = 0; j < state[k].size(); ++j)
        if (state[k][j].defined()) w.tensor(partition_key(k, j), state[k][j]);
    w.save(rank_path(path));
  }

  void load(const std::string& path) {
    comm::Communicator& c = trainer_->communicator();
    CheckpointReader r(rank_path(path), model_->config, "zero");
    TORCH_CHECK(r.integer("world") == c.size() && r.integer("rank") == c.rank(), "checkpoint '", rank_path(path), "' is rank ",
                r.integer("rank"), " of ", r.integer("world"), "; this trainer is rank ", c.rank(), " of ", c.size());
    std::map<std::string, torch::Tensor> weights;
    for (const auto& [name, shape] : shapes_) weights[name] = r.tensor("weights/" + name, shape);
    auto state = trainer_->optimizer_state();
    std::vector<std::vector<torch::Tensor>> loaded(state.size());
    for (size_t k = 0; k < state.size(); ++k) {
      loaded[k].resize(state[k].size());
      for (size_t j = 0; j < state[k].size(); ++j) {
        if (!state[k][j].defined()) continue;
        const std::string key = partition_key(k, j);
        loaded[k][j] = r.tensor(key, state[k][j].sizes());
        // 8-bit state (uint8 codes) and fp32 moments have the same shapes: the dtype tells them apart.
        TORCH_CHECK(loaded[k][j].scalar_type() == state[k][j].scalar_type(), "checkpoint '", rank_path(path), "': '", key, "' is ",
                    loaded[k][j].scalar_type(), " but this strategy keeps ", state[k][j].scalar_type(),
                    " (fp32 vs 8-bit optimizer state): load it with the strategy it was written by");
      }
    }
    const int64_t step = r.integer("step");
    const double scale = r.real("loss_scale");
    const int64_t good = r.integer("good_steps");

    trainer_->sync();  // an offloaded update still in flight must not land on the loaded values
    torch::NoGradGuard no_grad;
    // Compute-type parameters: whole ones are views into the trainer's flat buffer; stage-3 layers keep a
    // shard of their flat layout, cut from the full values here.
    for (auto& p : model_->named_parameters())
      if (p.value().numel() > 0) p.value().copy_(weights.at(p.key()));
    for (auto& item : model_->named_modules()) {
      auto* sh = dynamic_cast<nn::Shardable*>(item.value().get());
      if (sh == nullptr || sh->group() == nullptr) continue;
      nn::Stage3Group& g = *sh->group();
      torch::Tensor full = torch::zeros({g.layout.padded()}, g.shard.options().requires_grad(false));
      for (const auto& e : g.layout.entries()) nn::FlatParams::view(full, e).copy_(weights.at(e.name));
      g.shard.detach().copy_(g.layout.shard_of(full, c.rank()));
    }
    for (size_t k = 0; k < state.size(); ++k)
      for (size_t j = 0; j < state[k].size(); ++j)
        if (state[k][j].defined()) state[k][j].copy_(loaded[k][j]);
    trainer_->restore_counters(step, float(scale), good);
  }

 private:
  // zero/<partition>/<master|m|v> (+ m_absmax, v_absmax with 8-bit state: nn::Trainer::optimizer_state_names).
  static std::string partition_key(size_t k, size_t j) {
    return "zero/" + std::to_string(k) + "/" + nn::Trainer<S, squeeze::AdamW>::optimizer_state_names().at(j);
  }
  std::string rank_path(const std::string& path) {
    comm::Communicator& c = trainer_->communicator();
    return c.size() == 1 ? path : path + ".rank" + std::to_string(c.rank()) + "-of-" + std::to_string(c.size());
  }

  Llama model_;
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes_;
  std::optional<nn::Trainer<S, squeeze::AdamW>> trainer_;
};

// LoRA<R, A> strategies: squeeze's LoraTrainer (nn/lora.hpp: frozen, possibly NF4-quantized base; AdamW over
// the adapters) behind the same interface.
template <StrategyType S>
class AdapterTrainer {
 public:
  static constexpr int micro_batches = S::accumulation_steps;
  static constexpr bool frees_gradients = true;  // torch::optim's zero_grad sets them to none

  AdapterTrainer(LlamaConfig config, TrainOptions options, torch::Device device) : model_(std::move(config)) {
    model_->checkpoint_every = S::checkpoint_every;
    model_->loss_chunk_tokens = options.loss_chunk_tokens;
    model_->train();
    nn::LoraTrainOptions o;
    o.lr = options.lr, o.weight_decay = 0.0, o.beta1 = options.beta1, o.beta2 = options.beta2, o.eps = options.eps, o.clip = options.clip;
    trainer_ = std::make_unique<nn::LoraTrainer<S>>(*model_, device, o);
  }

  Llama& model() { return model_; }
  int64_t step_count() const { return steps_; }
  double loss_scale() const { return 1.0; }
  void sync() {}
  void set_lr(double lr) {
    for (auto& g : trainer_->optimizer().param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
  }

  StepResult step(const torch::Tensor& x, const torch::Tensor& y) {
    check_batch(x, y, micro_batches);
    const int64_t micro = x.size(0) / micro_batches;
    const nn::LoraStepResult m =
        trainer_->step([&](int i) { return model_->loss(x.narrow(0, i * micro, micro), y.narrow(0, i * micro, micro)); });
    steps_ += m.applied ? 1 : 0;
    StepResult r;
    r.loss = m.loss, r.grad_norm = m.grad_norm, r.applied = m.applied;
    return r;
  }

  double evaluate(const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches) { return evaluate_loss(model_, batches); }

  // ---- checkpoints ------------------------------------------------------------------------------------
  // The adapters (fp32) and their AdamW state, the step, and the frozen base as stored (dense tensors, NF4
  // codes and scales). The base is built from the seed and quantized at start-up; load checks that this
  // model's base is the saved one (every tensor, and each NF4 layer's absmax offset, which is no tensor) and
  // refuses otherwise: a resumed run must use the same --seed.
  void save(const std::string& path, std::string_view strategy_name) {
    CheckpointWriter w(model_->config, strategy_name, "lora");
    w.scalar("step", steps_);
    for (const auto& p : model_->named_parameters()) w.tensor((p.value().requires_grad() ? "adapters/" : "base/") + p.key(), p.value());
    for (const auto& b : model_->named_buffers()) w.tensor("base/" + b.key(), b.value());
    for (const auto& [name, offset] : nf4_offsets()) w.scalar("nf4_offset/" + name, offset);
    torch::serialize::OutputArchive opt;
    trainer_->optimizer().save(opt);
    w.archive("optimizer", opt);
    w.save(path);
  }

  void load(const std::string& path) {
    CheckpointReader r(path, model_->config, "lora");
    std::vector<std::pair<torch::Tensor, torch::Tensor>> adapters;  // (destination, loaded)
    const auto read = [&](const std::string& key, const torch::Tensor& like) {
      torch::Tensor t = r.tensor(key, like.sizes());
      TORCH_CHECK(t.scalar_type() == like.scalar_type(), "checkpoint '", path, "': '", key, "' is ", t.scalar_type(), ", the model holds ",
                  like.scalar_type());
      return t;
    };
    const auto same_base = [&](const std::string& key, const torch::Tensor& mine) {
      TORCH_CHECK(torch::equal(read(key, mine), mine.detach().cpu()), "checkpoint '", path, "': the frozen base differs from this model's ('",
                  key, "'); it is built from the seed: resume with the --seed it was trained with");
    };
    for (const auto& p : model_->named_parameters()) {
      if (p.value().requires_grad()) adapters.emplace_back(p.value(), read("adapters/" + p.key(), p.value()));
      else same_base("base/" + p.key(), p.value());
    }
    for (const auto& b : model_->named_buffers()) same_base("base/" + b.key(), b.value());
    for (const auto& [name, offset] : nf4_offsets())
      TORCH_CHECK(r.real("nf4_offset/" + name) == offset, "checkpoint '", path, "': the frozen base differs from this model's (absmax offset of ",
                  name, "); it is built from the seed: resume with the --seed it was trained with");
    torch::serialize::InputArchive opt = r.archive("optimizer");
    const int64_t step = r.integer("step");
    trainer_->optimizer().load(opt);
    torch::NoGradGuard no_grad;
    for (auto& [dst, t] : adapters) dst.copy_(t);
    steps_ = step;
  }

 private:
  // The absmax offset of each NF4 layer (DoubleQuant keeps it as a number, not a tensor).
  std::vector<std::pair<std::string, double>> nf4_offsets() {
    std::vector<std::pair<std::string, double>> out;
    for (const auto& item : model_->named_modules()) {
      if (auto* l = dynamic_cast<nn::LoRALinearImpl*>(item.value().get()); l != nullptr && l->nf4())
        out.emplace_back(item.key(), double(l->nf4_weight().absmax_offset));
      if (auto* l = dynamic_cast<nn::Nf4LinearImpl*>(item.value().get())) out.emplace_back(item.key(), double(l->nf4_weight().absmax_offset));
    }
    return out;
  }

  Llama model_;
  std::unique_ptr<nn::LoraTrainer<S>> trainer_;
  int64_t steps_ = 0;
};

// The trainer for a strategy: LoraTrainer for LoRA, squeeze's ZeRO trainer for Sharded/Offload, ours otherwise.
template <StrategyType S>
using Trainer = std::conditional_t<S::has_lora, AdapterTrainer<S>,
                                   std::conditional_t<(S::stage > 0 || S::offload_to_host), ZeroTrainer<S>, LocalTrainer<S>>>;

// The planner for S with B sequences of T tokens per optimizer step on one rank, and the example's trainer
// (whether it frees its gradients between steps or keeps flat buffers) with the model's loss chunk
// (TrainOptions::loss_chunk_tokens): plan_for<S>(c, B, T).peak().device.
template <StrategyType S>
plan::MemoryPlan plan_for(const LlamaConfig& c, int64_t batch, int64_t seq, int world = 1,
                          int64_t loss_chunk_tokens = plan::kDefaultLossChunkTokens) {
  return plan::plan_memory<S>(c.shape(), {batch / S::accumulation_steps, seq, Trainer<S>::frees_gradients, loss_chunk_tokens}, world);
}

}  // namespace squeeze::llama
