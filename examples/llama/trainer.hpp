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
// Checkpoints (save/load) hold the float weights, the AdamW state, the step and the loss scale; they are
// written to a temporary file and renamed, so a failed save never replaces a good checkpoint.
#include <squeeze/comm/local.hpp>
#include <squeeze/nn/llama.hpp>
#include <squeeze/nn/lora.hpp>
#include <squeeze/nn/trainer.hpp>
#include <squeeze/optim/adamw.hpp>
#include <squeeze/plan.hpp>
#include <squeeze/policy.hpp>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
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
  // ZeRO (squeeze's sharded trainer); on one GPU, Offload<Host> is what saves memory.
  f.template operator()<Strategy<Sharded<Stage2>, Precision<bf16, float>>>("zero2-bf16");
  f.template operator()<Strategy<Sharded<Stage3>, Offload<Host>>>("zero3-offload");
  f.template operator()<Strategy<Sharded<Stage3>, Offload<Host>, Precision<half, float>, Accumulate<4>>>("zero3-offload-fp16-accum4");
  f.template operator()<Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed>>("zero3-offload-bf16-ckpt");
  // QLoRA (squeeze's LoraTrainer): NF4 base weights, bf16 compute, fp32 adapters. CPU, or CUDA from an nvcc TU.
  f.template operator()<Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed>>("qlora");
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

template <StrategyType S>
class LocalTrainer {
  static_assert(S::training, "the LLaMA trainer trains: remove Inference");
  static_assert(S::stage == 0 && !S::offload_to_host, "Sharded<...>/Offload<Host> strategies train with ZeroTrainer");
  static_assert(!S::quantized_weights && !S::has_lora && S::state_bits == 32,
                "quantized weights, LoRA and 8-bit optimizer state belong to the QLoRA example, not this trainer");

 public:
  using compute_type = typename S::compute_type;
  static constexpr bool has_master = S::has_master_copy;
  static constexpr int micro_batches = S::accumulation_steps;

  LocalTrainer(LlamaConfig config, TrainOptions options, torch::Device device)
      : model_(std::move(config)), options_(options), device_(device), scale_(S::loss_scaling ? options.initial_scale : 1.0) {
    // Masters are taken from the float initialisation, so every strategy starts from the same weights.
    std::vector<torch::Tensor> optimized;
    if constexpr (has_master) {
      torch::NoGradGuard no_grad;
      for (auto& p : model_->parameters())
        master_.push_back(p.detach().to(device_, torch_dtype<typename S::master_type>()).requires_grad_(true));
      optimized = master_;
    }
    model_->to(device_, torch_dtype<compute_type>());
    model_->checkpoint_every = S::checkpoint_every;
    model_->train();
    if constexpr (!has_master) optimized = model_->parameters();
    optimizer_ = std::make_unique<torch::optim::AdamW>(
        optimized, torch::optim::AdamWOptions(options.lr)
                       .betas({options.beta1, options.beta2})
                       .eps(options.eps)
                       .weight_decay(options.weight_decay));
  }

  Llama& model() { return model_; }
  int64_t step_count() const { return step_; }
  double loss_scale() const { return scale_; }
  void set_lr(double lr) {
    for (auto& g : optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
  }

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
      if constexpr (has_master) move_grads_to_master();  // sums micro-batches in float
    }
    r.loss = loss_sum.item<double>() / micro_batches;

    std::vector<torch::Tensor>& params = optimized();
    if (scale_ != 1.0) {
      torch::NoGradGuard no_grad;
      for (auto& p : params)
        if (p.grad().defined()) p.mutable_grad().mul_(1.0 / scale_);
    }
    r.grad_norm = torch::nn::utils::clip_grad_norm_(params, options_.clip > 0 ? options_.clip : std::numeric_limits<double>::infinity());
    if (!std::isfinite(r.grad_norm)) {  // overflow (fp16) or divergence: skip the update
      r.applied = false;
      if constexpr (S::dynamic_loss_scaling) {
        scale_ = std::max(1.0, scale_ / 2);
        good_steps_ = 0;
      }
      zero_grads();
      return r;
    }
    optimizer_->step();
    zero_grads();
    if constexpr (has_master) {
      torch::NoGradGuard no_grad;
      auto model_params = model_->parameters();
      for (size_t i = 0; i < model_params.size(); ++i) model_params[i].copy_(master_[i]);  // round to compute type
    }
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
  static constexpr const char* kFormat = "squeeze-llama-checkpoint-1";

  void save(const std::string& path, std::string_view strategy_name) {
    torch::serialize::OutputArchive archive;
    const LlamaConfig& c = model_->config;
    archive.write("format", c10::IValue(std::string(kFormat)));
    archive.write("strategy", c10::IValue(std::string(strategy_name)));
    archive.write("preset", c10::IValue(c.name));
    archive.write("geometry", c10::IValue(std::vector<int64_t>{c.vocab, c.hidden, c.layers, c.heads, c.kv_heads, c.ffn}));
    archive.write("step", c10::IValue(step_));
    archive.write("loss_scale", c10::IValue(scale_));
    archive.write("good_steps", c10::IValue(good_steps_));
    const auto names = model_->named_parameters().keys();
    std::vector<torch::Tensor>& weights = optimized();  // the float truth (masters, or the float params)
    for (size_t i = 0; i < names.size(); ++i) archive.write("weights/" + names[i], weights[i].detach().cpu());
    torch::serialize::OutputArchive opt;
    optimizer_->save(opt);
    archive.write("optimizer", opt);

    const std::string tmp = path + ".tmp";
    try {
      archive.save_to(tmp);
    } catch (const std::exception& e) {
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
      TORCH_CHECK(false, "could not write checkpoint '", tmp, "': ", e.what(), " (", path, " was left as it was)");
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    TORCH_CHECK(!ec, "could not rename '", tmp, "' to '", path, "': ", ec.message());
  }

  // Loads a checkpoint written by save(), from any strategy of the same geometry. Everything is read and
  // checked before the model is touched; a file that is not a checkpoint, or is of another model, throws.
  void load(const std::string& path) {
    TORCH_CHECK(std::filesystem::exists(path), "checkpoint '", path, "' does not exist");
    torch::serialize::InputArchive archive;
    try {
      archive.load_from(path);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "checkpoint '", path, "' is corrupt or not a checkpoint (", first_line(e.what()), ")");
    }
    c10::IValue v;
    TORCH_CHECK(archive.try_read("format", v) && v.isString() && v.toStringRef() == kFormat, "'", path,
                "' is not a squeeze LLaMA checkpoint (format tag missing or of another version)");
    const LlamaConfig& c = model_->config;
    const std::vector<int64_t> want{c.vocab, c.hidden, c.layers, c.heads, c.kv_heads, c.ffn};
    archive.read("geometry", v);
    const std::vector<int64_t> got = v.toIntVector();
    c10::IValue preset;
    archive.read("preset", preset);
    TORCH_CHECK(got == want, "checkpoint '", path, "' holds preset '", preset.toStringRef(), "' with (vocab, hidden, layers, heads, kv_heads, ffn) = ",
                c10::IntArrayRef(got), ", but this model is '", c.name, "' ", c10::IntArrayRef(want));

    const auto names = model_->named_parameters().keys();
    std::vector<torch::Tensor>& weights = optimized();
    std::vector<torch::Tensor> loaded(names.size());
    for (size_t i = 0; i < names.size(); ++i) {
      TORCH_CHECK(archive.try_read("weights/" + names[i], loaded[i]), "checkpoint '", path, "' has no tensor for ", names[i]);
      TORCH_CHECK(loaded[i].sizes() == weights[i].sizes(), "checkpoint '", path, "': ", names[i], " is ", loaded[i].sizes(),
                  ", the model expects ", weights[i].sizes());
      TORCH_CHECK(loaded[i].isfinite().all().item<bool>(), "checkpoint '", path, "': ", names[i], " holds inf/NaN");
    }
    torch::serialize::InputArchive opt;
    TORCH_CHECK(archive.try_read("optimizer", opt), "checkpoint '", path, "' has no optimizer state");
    archive.read("step", v);
    const int64_t step = v.toInt();
    archive.read("loss_scale", v);
    const double scale = v.toDouble();
    archive.read("good_steps", v);
    const int64_t good = v.toInt();

    optimizer_->load(opt);
    torch::NoGradGuard no_grad;
    auto model_params = model_->parameters();
    for (size_t i = 0; i < names.size(); ++i) {
      weights[i].copy_(loaded[i]);
      if constexpr (has_master) model_params[i].copy_(loaded[i]);
    }
    step_ = step;
    if constexpr (S::loss_scaling) {
      scale_ = scale;
      good_steps_ = good;
    }
  }

 private:
  static std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

  std::vector<torch::Tensor>& optimized() {
    if constexpr (has_master) return master_;
    else {
      if (params_.empty()) params_ = model_->parameters();
      return params_;
    }
  }

  // Adds the compute-type gradients into the float master gradients and frees them.
  void move_grads_to_master() {
    torch::NoGradGuard no_grad;
    auto model_params = model_->parameters();
    for (size_t i = 0; i < model_params.size(); ++i) {
      torch::Tensor& g = model_params[i].mutable_grad();
      if (!g.defined()) continue;
      torch::Tensor& mg = master_[i].mutable_grad();
      if (mg.defined()) mg.add_(g);
      else mg = g.to(torch::kFloat32);
      g = torch::Tensor();
    }
  }

  void zero_grads() {
    for (auto& p : optimized()) p.mutable_grad() = torch::Tensor();
    if constexpr (has_master)
      for (auto& p : model_->parameters()) p.mutable_grad() = torch::Tensor();
  }

  Llama model_;
  TrainOptions options_;
  torch::Device device_;
  std::vector<torch::Tensor> master_;  // float copies (mixed precision only)
  std::vector<torch::Tensor> params_;  // the model's parameters (no master copy)
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  double scale_ = 1.0;
  int64_t good_steps_ = 0;
  int64_t step_ = 0;
};

// Sharded<StageN> / Offload<Host>: squeeze's ZeRO trainer (nn/trainer.hpp) behind the same interface. The
// model is built in float (the same initial weights as LocalTrainer), converted to the compute type and
// handed over; the trainer keeps the masters (from the converted weights) and AdamW state, sharded and/or
// on the host. Its AdamW options are fixed at construction: set_lr is not available (constant rate).
template <StrategyType S>
class ZeroTrainer {
 public:
  static constexpr int micro_batches = S::accumulation_steps;

  ZeroTrainer(LlamaConfig config, TrainOptions options, torch::Device device, comm::CommPtr comm = nullptr)
      : ZeroTrainer(Llama(std::move(config)), options, device, std::move(comm)) {}
  // A model built by the caller (e.g. one per rank, built in order so every rank starts alike). Each rank
  // of `comm` constructs its ZeroTrainer at the same time (the constructor broadcasts rank 0's weights).
  ZeroTrainer(Llama model, TrainOptions options, torch::Device device, comm::CommPtr comm)
      : model_(std::move(model)) {
    model_->to(device, torch_dtype<typename S::compute_type>());
    model_->checkpoint_every = S::checkpoint_every;
    model_->train();
    squeeze::AdamW adamw{.lr = float(options.lr), .beta1 = float(options.beta1), .beta2 = float(options.beta2), .eps = float(options.eps),
                .weight_decay = float(options.weight_decay), .max_grad_norm = float(std::max(0.0, options.clip))};
    adamw.loss_scale.init_scale = float(options.initial_scale);
    adamw.loss_scale.growth_interval = int(options.scale_growth_interval);
    trainer_.emplace(make_trainer<S>(model_, adamw, comm ? std::move(comm) : comm::LocalComm::single()));
  }
  ZeroTrainer(const ZeroTrainer&) = delete;

  Llama& model() { return model_; }
  int64_t step_count() const { return trainer_->steps_applied(); }
  double loss_scale() const { return trainer_->scale(); }
  void set_lr(double) {}  // constant (see above)

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

  void save(const std::string&, std::string_view) {
    TORCH_CHECK(false, "checkpoints of Sharded/Offload strategies are not written by this example yet: train without --save");
  }
  void load(const std::string&) {
    TORCH_CHECK(false, "checkpoints of Sharded/Offload strategies are not read by this example yet: train without --load");
  }

 private:
  Llama model_;
  std::optional<nn::Trainer<S, squeeze::AdamW>> trainer_;
};

// LoRA<R, A> strategies: squeeze's LoraTrainer (nn/lora.hpp: frozen, possibly NF4-quantized base; AdamW over
// the adapters) behind the same interface. No checkpoints yet.
template <StrategyType S>
class AdapterTrainer {
 public:
  static constexpr int micro_batches = S::accumulation_steps;

  AdapterTrainer(LlamaConfig config, TrainOptions options, torch::Device device) : model_(std::move(config)) {
    model_->checkpoint_every = S::checkpoint_every;
    model_->train();
    nn::LoraTrainOptions o;
    o.lr = options.lr, o.weight_decay = 0.0, o.beta1 = options.beta1, o.beta2 = options.beta2, o.eps = options.eps, o.clip = options.clip;
    trainer_ = std::make_unique<nn::LoraTrainer<S>>(*model_, device, o);
  }

  Llama& model() { return model_; }
  int64_t step_count() const { return steps_; }
  double loss_scale() const { return 1.0; }
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
  void save(const std::string&, std::string_view) { TORCH_CHECK(false, "checkpoints of LoRA strategies are not written by this example yet"); }
  void load(const std::string&) { TORCH_CHECK(false, "checkpoints of LoRA strategies are not read by this example yet"); }

 private:
  Llama model_;
  std::unique_ptr<nn::LoraTrainer<S>> trainer_;
  int64_t steps_ = 0;
};

// The trainer for a strategy: LoraTrainer for LoRA, squeeze's ZeRO trainer for Sharded/Offload, ours otherwise.
template <StrategyType S>
using Trainer = std::conditional_t<S::has_lora, AdapterTrainer<S>,
                                   std::conditional_t<(S::stage > 0 || S::offload_to_host), ZeroTrainer<S>, LocalTrainer<S>>>;

}  // namespace squeeze::llama
