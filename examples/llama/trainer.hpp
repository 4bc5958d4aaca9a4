#pragma once
// The LLaMA example's strategies and its one trainer (shared by train.cpp, the llama tests and bench/table): every
// strategy goes through squeeze::make_trainer<S> (train/trainer.hpp), which does all that S says (precision and
// masters, loss scaling, accumulation, ZeRO stages, host offload, 8-bit state, LoRA / QLoRA, checkpointing).
// Checkpoints (save/load) hold the trainable weights, the optimizer state, the step and the loss scale; they are
// written to a temporary file and renamed, so a failed save never replaces a good checkpoint.
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
  // QLoRA: NF4 base weights, bf16 compute, fp32 adapters. CPU, or CUDA from an nvcc TU.
  f.template operator()<Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed>>("qlora");
  // ... with the adapters' Adam moments as 8-bit codes (2 bytes + 8/256 per adapter value instead of 8)
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
  bool decay_norms_biases_embeddings = false;  // TrainerOptions' default: no weight decay on them
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
// A torch archive: format tag, the strategy and geometry it was written under, then the trainer's named tensors
// and scalars. Written to
// FILE.tmp and renamed, so a failed save never replaces a good checkpoint.
inline constexpr const char* kCheckpointFormat = "squeeze-llama-checkpoint-3";

inline std::vector<int64_t> geometry_of(const LlamaConfig& c) { return {c.vocab, c.hidden, c.layers, c.heads, c.kv_heads, c.ffn}; }

class CheckpointWriter {
 public:
  CheckpointWriter(const LlamaConfig& c, std::string_view strategy) {
    archive_.write("format", c10::IValue(std::string(kCheckpointFormat)));
    archive_.write("strategy", c10::IValue(std::string(strategy)));
    archive_.write("preset", c10::IValue(c.name));
    archive_.write("geometry", c10::IValue(geometry_of(c)));
  }
  void tensor(const std::string& key, const torch::Tensor& t) { archive_.write(key, t.detach().to(torch::kCPU).clone()); }
  void scalar(const std::string& key, int64_t v) { archive_.write(key, c10::IValue(v)); }
  void scalar(const std::string& key, double v) { archive_.write(key, c10::IValue(v)); }
  void string(const std::string& key, const std::string& v) { archive_.write(key, c10::IValue(v)); }
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

// Opens and checks a checkpoint (format, geometry); the trainer then reads everything it needs and
// checks it before changing anything.
class CheckpointReader {
 public:
  CheckpointReader(const std::string& path, const LlamaConfig& c) : path_(path) {
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

// The example's trainer for any strategy: squeeze::make_trainer<S> on an nn::Llama built in float (rank 0's
// initial values are broadcast; the trainer converts the model to S's compute type with fp32 masters from the float
// values, gives LoRA strategies their frozen base and adapters, and switches Checkpointed on), stepped one batch of
// S::accumulation_steps micro-batches at a time. On one rank by default, or on the communicator given (LocalComm
// ranks in tests, NcclComm under squeeze-launch).
template <StrategyType S>
class Trainer {
 public:
  static constexpr int micro_batches = S::accumulation_steps;
  // Stages 0-1 release their flat gradient buffers between steps (TrainerOptions::free_gradients), stages 2-3 keep
  // their shards: plan::TrainShape::free_grads.
  static constexpr bool frees_gradients = S::stage <= 1;

  Trainer(LlamaConfig config, TrainOptions options, torch::Device device, comm::CommPtr comm = nullptr)
      : Trainer(Llama(std::move(config)), options, device, std::move(comm)) {}
  // A model built by the caller (e.g. one per rank, built in order so every rank starts alike). Each rank
  // of `comm` constructs its Trainer at the same time (the constructor broadcasts rank 0's weights).
  Trainer(Llama model, TrainOptions options, torch::Device device, comm::CommPtr comm) : model_(std::move(model)) {
    model_->loss_chunk_tokens = options.loss_chunk_tokens;
    model_->train();
    squeeze::AdamW adamw{.lr = float(options.lr), .beta1 = float(options.beta1), .beta2 = float(options.beta2), .eps = float(options.eps),
                         .weight_decay = float(S::has_lora ? 0.0 : options.weight_decay), .max_grad_norm = float(std::max(0.0, options.clip))};
    adamw.loss_scale.init_scale = float(options.initial_scale);
    adamw.loss_scale.growth_interval = int(options.scale_growth_interval);
    // The model is built on the host in float; the trainer converts it on its way to `device`, so the device never
    // holds the float copy (the masters start from the float values kept on the host).
    trainer_.emplace(make_trainer<S>(model_, adamw, comm ? std::move(comm) : comm::LocalComm::single(),
                                     {.device = device, .decay_norms_biases_embeddings = options.decay_norms_biases_embeddings}));
    for (const auto& [layout, begin] : trainer_->partition_layouts())
      for (const auto& e : layout->entries()) shapes_.emplace_back(e.name, e.shape);
  }
  Trainer(const Trainer&) = delete;

  Llama& model() { return model_; }
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
  StepResult step(const torch::Tensor& x, const torch::Tensor& y) {
    check_batch(x, y, micro_batches);
    StepResult r;
    r.scale = trainer_->scale();
    const int64_t micro = x.size(0) / micro_batches;
    for (int i = 0; i < micro_batches; ++i) {
      const torch::Tensor xi = x.narrow(0, i * micro, micro), yi = y.narrow(0, i * micro, micro);  // [B/N, T]
      const train::StepResult m = trainer_->step([&] { return model_->loss(xi, yi); });
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
  // Every rank writes its own file (PATH at world size 1, PATH.rank<r>-of-<N> otherwise): the full trainable
  // weights by name (float; gathering them is a collective, so every rank calls save), this rank's optimizer
  // partitions (fp32 master, m, v, in the trainer's flat layout), the counters, and the frozen base as stored
  // (LoRA: dense tensors, NF4 codes and scales, GPTQ buffers; built from the seed, so load checks it is this
  // model's). A checkpoint loads into the same strategy at the same world size.
  void save(const std::string& path, std::string_view strategy_name) {
    comm::Communicator& c = trainer_->communicator();
    CheckpointWriter w(model_->config, strategy_name);
    w.scalar("world", int64_t(c.size()));
    w.scalar("rank", int64_t(c.rank()));
    w.scalar("step", trainer_->steps_applied());
    w.scalar("loss_scale", double(trainer_->scale()));
    w.scalar("good_steps", int64_t(trainer_->loss_scaler().state().growth_tracker));
    w.string("layout", layout());
    for (const auto& [name, t] : trainer_->full_parameters()) w.tensor("weights/" + name, t.to(torch::kFloat32));
    for (const auto& [name, t] : frozen()) w.tensor("base/" + name, t);
    const auto state = trainer_->optimizer_state();
    for (size_t k = 0; k < state.size(); ++k)
      for (size_t j = 0; j < state[k].size(); ++j)
        if (state[k][j].defined()) w.tensor(partition_key(k, j), state[k][j]);
    w.save(rank_path(path));
  }

  void load(const std::string& path) {
    comm::Communicator& c = trainer_->communicator();
    CheckpointReader r(rank_path(path), model_->config);
    TORCH_CHECK(r.integer("world") == c.size() && r.integer("rank") == c.rank(), "checkpoint '", rank_path(path), "' is rank ",
                r.integer("rank"), " of ", r.integer("world"), "; this trainer is rank ", c.rank(), " of ", c.size());
    const std::string theirs = r.string("layout"), mine = layout();
    TORCH_CHECK(theirs == mine, "checkpoint '", rank_path(path), "' was written by strategy '", r.string("strategy"), "' (", theirs,
                "); this strategy keeps ", mine, ": load it with the strategy it was written by");
    std::map<std::string, torch::Tensor> weights;
    for (const auto& [name, shape] : shapes_) weights[name] = r.tensor("weights/" + name, shape);
    for (const auto& [name, mine] : frozen())
      TORCH_CHECK(torch::equal(r.tensor("base/" + name, mine.sizes()), mine.detach().cpu()), "checkpoint '", rank_path(path),
                  "': the frozen base differs from this model's ('", name, "'); it is built from the seed: resume with the --seed it was trained with");
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
    // Trainable parameters: whole ones are views into the trainer's flat buffers; stage-3 layers keep a shard of
    // their flat layout, cut from the full values here.
    for (auto& p : model_->named_parameters())
      if (p.value().requires_grad() && p.value().numel() > 0) p.value().copy_(weights.at(p.key()));
    for (auto& item : model_->named_modules()) {
      auto* sh = dynamic_cast<train::Shardable*>(item.value().get());
      if (sh == nullptr || sh->group() == nullptr) continue;
      train::Stage3Group& g = *sh->group();
      torch::Tensor full = torch::zeros({g.layout.padded()}, g.shard.options().requires_grad(false));
      for (const auto& e : g.layout.entries()) train::FlatParams::view(full, e).copy_(weights.at(e.name));
      g.shard.detach().copy_(g.layout.shard_of(full, c.rank()));
    }
    for (size_t k = 0; k < state.size(); ++k)
      for (size_t j = 0; j < state[k].size(); ++j)
        if (state[k][j].defined()) state[k][j].copy_(loaded[k][j]);
    trainer_->restore_counters(step, float(scale), good);
  }

 private:
  // What the optimizer state looks like: a checkpoint loads only into a trainer that keeps the same.
  std::string layout() {
    std::string s = std::string(S::has_lora ? "adapters" : "weights") + ", " + (S::state_bits == 8 ? "8-bit" : "fp32") + " moments, " +
                    (S::has_master_copy && !S::has_lora ? "fp32 masters" : "no masters") + ", partitions";
    for (const auto& [layout, begin] : trainer_->partition_layouts()) s += " " + std::to_string(layout->shard());
    return s;
  }
  // The frozen tensors (a LoRA strategy's base: parameters that take no gradient and every buffer), by name.
  std::vector<std::pair<std::string, torch::Tensor>> frozen() {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (const auto& p : model_->named_parameters())
      if (!p.value().requires_grad() && p.value().numel() > 0) out.emplace_back(p.key(), p.value());
    for (const auto& b : model_->named_buffers()) out.emplace_back(b.key(), b.value());
    return out;
  }
  // zero/<partition>/<master|m|v> (+ m_absmax, v_absmax with 8-bit state: train::Trainer::optimizer_state_names).
  static std::string partition_key(size_t k, size_t j) {
    return "zero/" + std::to_string(k) + "/" + train::Trainer<S, squeeze::AdamW>::optimizer_state_names().at(j);
  }
  std::string rank_path(const std::string& path) {
    comm::Communicator& c = trainer_->communicator();
    return c.size() == 1 ? path : path + ".rank" + std::to_string(c.rank()) + "-of-" + std::to_string(c.size());
  }

  Llama model_;
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes_;
  std::optional<train::Trainer<S, squeeze::AdamW>> trainer_;
};

// The float weights of a checkpoint written by Trainer<S>::save for any strategy that trains full weights, as a new
// model on `device` (geometry checked against `config`): what llama_gptq quantizes.
inline Llama load_weights(const std::string& path, LlamaConfig config, torch::Device device) {
  CheckpointReader r(path, config);
  Llama model(std::move(config));
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters()) p.value().copy_(r.tensor("weights/" + p.key(), p.value().sizes()));
  model->to(device);
  return model;
}

// The planner for S with B sequences of T tokens per optimizer step on one rank, and the example's trainer
// (whether it frees its gradients between steps or keeps flat buffers) with the model's loss chunk
// (TrainOptions::loss_chunk_tokens): plan_for<S>(c, B, T).peak().device.
template <StrategyType S>
plan::MemoryPlan plan_for(const LlamaConfig& c, int64_t batch, int64_t seq, int world = 1,
                          int64_t loss_chunk_tokens = plan::kDefaultLossChunkTokens) {
  return plan::plan_memory<S>(c.shape(), {batch / S::accumulation_steps, seq, Trainer<S>::frees_gradients, loss_chunk_tokens}, world);
}

}  // namespace squeeze::llama
