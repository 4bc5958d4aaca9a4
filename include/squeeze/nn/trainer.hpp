#pragma once
// make_trainer<Strategy>(module, adamw, comm): data-parallel training with ZeRO stages 0-3, optional
// Offload<Host>, gradient accumulation, loss scaling, global-norm clipping and memory accounting.
//
//   auto comm    = squeeze::comm::from_env();
//   auto trainer = squeeze::make_trainer<Strategy<Sharded<Stage2>, Accumulate<4>, Precision<bf16, float>>>(
//                      model, AdamW{.lr = 3e-4f, .weight_decay = 0.1f}, comm, {.max_grad_norm = 1.0f});
//   for (auto& batch : loader) {                 // one call per micro-batch
//     auto r = trainer.step([&] { return model->loss(batch); });
//     if (r.applied) log(r.loss, r.grad_norm, r.scale);
//   }
//
// The module must already be in the Strategy's compute type (module->to(torch::kBFloat16)) and on its
// device. Every rank builds the same module; rank 0's initial values are broadcast to all.
//
// One step() call is one micro-batch: closure() returns that micro-batch's mean loss; the trainer
// backpropagates loss * scale / accumulation_steps. The optimizer runs on every accumulation_steps-th
// call (the boundary); the others return applied = false, boundary = false. What happens per stage:
//
//            non-final micro-step                                  boundary micro-step
//   Stage0   grads accumulate in the full local buffer (fp32       all-reduce (average) the full buffer,
//            accumulator when mixed precision), no communication   AdamW on all of it on every rank
//   Stage1   as Stage0                                             reduce-scatter (average) into this
//                                                                  rank's shard, AdamW on the shard,
//                                                                  all-gather the updated parameters
//   Stage2   reduce-scatter (average) after every micro-step,      as Stage1 from the accumulated shard
//            add into the rank's gradient shard (fp32 when
//            mixed), zero the full buffer
//   Stage3   as Stage2, per layer inside backward; parameters      AdamW on the parameter shard; nothing
//            all-gathered per layer in forward and backward        to gather (the next forward does)
//
// Boundary, in order: global L2 norm of the reduced gradients (sum of squares per shard in double,
// all-reduced; unscaled by the loss scale) -> non-finite norm = overflow on some rank: every rank skips
// the step, state untouched, the dynamic scale backs off -> clip coefficient min(1, max/(norm+1e-6)) ->
// fused AdamW (kernels::adamw_cpu for host buffers; torch ops for device buffers in a non-nvcc TU) with
// unscale and clip folded in -> scale growth bookkeeping.
//
// Parity guarantees on LocalComm (reduction in rank order, see comm/local.hpp), float or bf16, same data:
//   accumulation 1: Stage0 == Stage1 == Stage2 == Stage3 bitwise, with or without Offload<Host>;
//   accumulation N: Stage0 == Stage1 and Stage2 == Stage3 bitwise; Stage0/1 vs Stage2/3 differ by the
//   order of (sum over ranks, sum over micro-steps), within rounding of the gradient dtype.
//   With clipping active, Stage3 vs the others differ by norm rounding (shard order of the sum).
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include "../comm/communicator.hpp"
#include "../plan/memory.hpp"
#include "../policy/strategy.hpp"
#include "flat_params.hpp"
#include "sharded.hpp"
#include "squeeze/kernels/adamw.hpp"
#include "squeeze/kernels/grad_norm.hpp"
#include "squeeze/kernels/loss_scale.hpp"

namespace squeeze::nn {

// Anything with AdamW's five hyper-parameters (optim::AdamW, or an aggregate of your own).
template <class O>
concept AdamWHyperparameters = requires(const O& o) {
  float(o.lr);
  float(o.beta1);
  float(o.beta2);
  float(o.eps);
  float(o.weight_decay);
};

// Clipping and loss scaling come from the AdamW options when they carry them (squeeze::AdamW has
// max_grad_norm and loss_scale); set them here only for an options type without them. Setting both is an error.
struct TrainerOptions {
  float max_grad_norm = 0;                                // clip the global L2 norm to this; <= 0: no clipping
  std::optional<kernels::LossScaleOptions> loss_scale{};  // used when the Strategy scales the loss (half compute)
  int64_t persistence_threshold = 0;       // stage 3: sharded layers with fewer parameters stay whole
  int64_t align_bytes = 256;               // every tensor and every shard of a flat buffer starts aligned
  bool prefetch = true;                    // stage 3: gather the next layer right after the current one
};

struct StepResult {
  float loss = 0;                  // this micro-batch's loss (unscaled)
  bool applied = false;            // the optimizer updated the parameters on this call
  bool boundary = false;           // this call ended an accumulation window (applied or skipped)
  float scale = 1;                 // the loss scale used for this micro-batch
  float grad_norm = std::nanf("");  // global L2 norm of the unscaled gradient (boundary only)
};

// Bytes this rank holds per category; "device" is where the compute parameters live (the CPU in CPU
// runs), "host" what Offload<Host> moved to host memory.
struct MemoryUse {
  plan::Placement parameters, gradients, master_weights, optimizer_state, communication;
  int64_t persistent_params = 0;  // stage 3: elements kept whole on every rank (not sharded)
  plan::Placement model_state() const {
    plan::Placement p = parameters;
    p += gradients; p += master_weights; p += optimizer_state;
    return p;
  }
};

struct MemoryReport {
  MemoryUse actual;
  plan::MemoryPlan predicted;
  // A table: category, actual device/host bytes, predicted device/host bytes.
  std::string table() const {
    std::ostringstream s;
    auto row = [&](const char* name, plan::Placement a, plan::Placement p) {
      s << name << "  actual device " << a.device << " host " << a.host << "  |  planned device " << p.device << " host "
        << p.host << "\n";
    };
    row("parameters     ", actual.parameters, predicted.parameters);
    row("gradients      ", actual.gradients, predicted.gradients);
    row("master_weights ", actual.master_weights, predicted.master_weights);
    row("optimizer_state", actual.optimizer_state, predicted.optimizer_state);
    row("communication  ", actual.communication, predicted.communication);
    return s.str();
  }
};

namespace detail {

template <class T> constexpr torch::ScalarType scalar_type_of() {
  if constexpr (std::is_same_v<T, float>) return torch::kFloat32;
  else if constexpr (std::is_same_v<T, half>) return torch::kFloat16;
  else return torch::kBFloat16;
}

// Sum of squares in double, sequential (deterministic), host or device.
inline double sum_squares(const torch::Tensor& t) {
  if (t.numel() == 0) return 0.0;
  if (!t.is_cpu()) return t.to(torch::kFloat64).square().sum().item<double>();
  const torch::Tensor c = t.contiguous();
  const int64_t n = c.numel();
  double acc = 0;
  auto run = [&]<class T>(const T* p) {
    for (int64_t i = 0; i < n; ++i) acc = kernels::NormOp<kernels::NormType::L2>::element(acc, to_float(p[i]));
  };
  switch (c.scalar_type()) {
    case torch::kFloat32: run(c.data_ptr<float>()); break;
    case torch::kBFloat16: run(reinterpret_cast<const bf16*>(c.data_ptr())); break;
    case torch::kFloat16: run(reinterpret_cast<const half*>(c.data_ptr())); break;
    default: TORCH_CHECK(false, "sum_squares: unsupported gradient dtype ", c.scalar_type());
  }
  return acc;
}

}  // namespace detail

template <StrategyType S, AdamWHyperparameters O>
class Trainer {
 public:
  using Compute = typename S::compute_type;
  static constexpr int kStage = S::stage;
  static constexpr int kAccum = S::accumulation_steps;
  static constexpr bool kOffload = S::offload_to_host;
  // Mixed-precision micro-batches are summed in fp32 (the planner counts the same).
  static constexpr bool kFp32Accum = kAccum > 1 && S::has_master_copy;
  static_assert(S::training, "make_trainer needs a training Strategy (remove Inference)");
  static_assert(!S::quantized_weights && !S::has_lora,
                "make_trainer trains full weights; quantized/LoRA strategies have their own trainers");

  Trainer(std::shared_ptr<torch::nn::Module> module, O adamw, comm::CommPtr comm, TrainerOptions opt = {})
      : module_(std::move(module)), adamw_(adamw), comm_(std::move(comm)), opt_(resolve(adamw, opt)),
        scaler_(*opt_.loss_scale) {
    TORCH_CHECK(module_ != nullptr, "make_trainer: module is null");
    TORCH_CHECK(comm_ != nullptr, "make_trainer: communicator is null");
    TORCH_CHECK(opt_.align_bytes >= 1, "make_trainer: align_bytes must be >= 1");
    TORCH_CHECK(!std::isnan(opt_.max_grad_norm), "make_trainer: max_grad_norm is NaN (use 0 for no clipping)");
    rank_ = comm_->rank();
    world_ = comm_->size();
    compute_dtype_ = detail::scalar_type_of<Compute>();
    grad_dtype_ = kFp32Accum ? torch::kFloat32 : compute_dtype_;
    if constexpr (S::loss_scaling && !S::dynamic_loss_scaling) static_scale_ = std::ldexp(1.0f, S::loss_scale::log2_scale);
    // Validate the AdamW hyper-parameters now, not at the first boundary.
    (void)kernels::adamw_coeffs(adamw_.lr, adamw_.beta1, adamw_.beta2, adamw_.eps, adamw_.weight_decay, 1);

    std::vector<std::pair<std::string, torch::Tensor>> trainable;
    for (auto& item : module_->named_parameters(/*recurse=*/true)) {
      if (!item.value().requires_grad()) continue;
      TORCH_CHECK(item.value().scalar_type() == compute_dtype_, "make_trainer: parameter '", item.key(), "' is ",
                  item.value().scalar_type(), " but the Strategy computes in ", compute_dtype_,
                  "; convert the module first: module->to(", compute_dtype_, ")");
      trainable.emplace_back(item.key(), item.value());
    }
    TORCH_CHECK(!trainable.empty(), "make_trainer: the module has no trainable parameters");
    device_ = trainable.front().second.device();
    if (world_ > 1) {
      TORCH_CHECK(!device_.is_cuda() || comm_->device_buffers(), "make_trainer: the module is on ", device_, " but the '",
                  comm_->backend(), "' communicator takes host buffers only; LocalComm takes CUDA memory when its TU is "
                  "compiled by nvcc or with SQUEEZE_WITH_CUDA_RUNTIME=1 (link CUDA::cudart); or use NcclComm");
      TORCH_CHECK(device_.is_cuda() || comm_->host_buffers(), "make_trainer: the module is on the CPU but the '",
                  comm_->backend(), "' communicator takes device buffers only: move the module to its GPU");
    }

    std::unordered_set<const void*> sharded;  // TensorImpls owned by stage-3 groups
    if constexpr (kStage == 3) {
      runtime_ = std::make_unique<Stage3Runtime>(comm_, opt_.prefetch);
      for (auto& item : module_->named_modules()) {
        auto* s = dynamic_cast<Shardable*>(item.value().get());
        if (s == nullptr) continue;
        auto params = s->shardable_parameters();
        int64_t n = 0;
        for (auto& [name, p] : params) n += p.requires_grad() ? p.numel() : 0;
        if (n == 0 || n < opt_.persistence_threshold) continue;  // small: stays whole (replicated)
        for (auto& [name, p] : params) {
          TORCH_CHECK(p.requires_grad(), "Stage3: layer '", item.key(), "' mixes frozen and trainable parameters");
          name = item.key() + "." + name;
        }
        add_stage3_group(item.key(), std::move(params), *s, sharded);
      }
    }
    std::vector<std::pair<std::string, torch::Tensor>> replicated;
    for (auto& p : trainable)
      if (!sharded.count(p.second.unsafeGetTensorImpl())) replicated.push_back(p);
    if (!replicated.empty()) add_replicated_group(std::move(replicated));
  }

  // Merges the clipping / loss-scale knobs of the AdamW options into the trainer options.
  static TrainerOptions resolve(const O& adamw, TrainerOptions opt) {
    if constexpr (requires { float(adamw.max_grad_norm); }) {
      if (adamw.max_grad_norm > 0) {
        TORCH_CHECK(!(opt.max_grad_norm > 0), "make_trainer: max_grad_norm is set both in the AdamW options (",
                    adamw.max_grad_norm, ") and in TrainerOptions (", opt.max_grad_norm, "): set it once");
        opt.max_grad_norm = adamw.max_grad_norm;
      }
    }
    if constexpr (requires { kernels::LossScaleOptions(adamw.loss_scale); }) {
      if (!opt.loss_scale) opt.loss_scale = adamw.loss_scale;
    }
    if (!opt.loss_scale) opt.loss_scale = kernels::LossScaleOptions{};
    return opt;
  }

  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
  Trainer(Trainer&&) = default;  // groups and runtime live behind unique_ptrs: the modules' pointers stay valid
  Trainer& operator=(Trainer&&) = delete;
  // Stage 3: the layers are detached (their emptied weights then fail loudly in forward instead of
  // reading freed shards); call restore_module() first to keep training or evaluating the module alone.
  ~Trainer() {
    for (Shardable* s : attached_) s->attach(nullptr);
  }

  // Stage 3: gathers every sharded layer back into its module's own parameters and detaches it
  // (a collective). The trainer must not step afterwards.
  void restore_module() {
    for (std::size_t i = 0; i < groups3_.size(); ++i) {
      auto& g = *groups3_[i];
      auto full = torch::empty({g.layout.padded()}, g.shard.options().requires_grad(false));
      gather_into(*comm_, g.shard.detach(), full);
      torch::NoGradGuard ng;
      for (auto& e : g.layout.entries()) e.param.set_data(FlatParams::view(full, e).clone());
      attached_[i]->attach(nullptr);
    }
    attached_.clear();
  }

  // One micro-batch. closure() returns the micro-batch's scalar loss (graph attached).
  StepResult step(const std::function<torch::Tensor()>& closure) {
    StepResult r;
    r.scale = scale();
    const bool boundary = micro_ + 1 == kAccum;
    // If the closure or backward throws, free what stage 3 gathered (the window's gradients are kept;
    // the other ranks will fail their next collective by timeout, as a lost rank would make them).
    struct PassGuard {
      Stage3Runtime* rt;
      ~PassGuard() {
        if (rt) {
          rt->release_all();
          rt->set_phase(Stage3Runtime::Phase::idle);
        }
      }
    } guard{runtime_.get()};
    if (runtime_) runtime_->set_phase(Stage3Runtime::Phase::forward);
    torch::Tensor loss = closure();
    TORCH_CHECK(loss.defined() && loss.numel() == 1, "Trainer::step: the closure must return a scalar loss, got ",
                loss.defined() ? loss.sizes() : torch::IntArrayRef{});
    TORCH_CHECK(loss.requires_grad(), "Trainer::step: the loss does not require grad (computed under NoGradGuard?)");
    r.loss = loss.detach().to(torch::kFloat32).item<float>();
    if (runtime_) runtime_->set_phase(Stage3Runtime::Phase::backward);
    (loss * double(r.scale / float(kAccum))).backward();
    if (runtime_) {
      runtime_->release_all();
      runtime_->set_phase(Stage3Runtime::Phase::idle);
    }
    guard.rt = nullptr;
    after_backward(boundary);
    micro_ = boundary ? 0 : micro_ + 1;
    if (!boundary) return r;
    r.boundary = true;
    finish_window(r);
    return r;
  }

  float scale() const {
    if constexpr (S::dynamic_loss_scaling) return scaler_.scale();
    else return static_scale_;
  }
  int64_t steps_applied() const { return applied_; }
  int64_t steps_skipped() const { return skipped_; }
  const kernels::LossScaler& loss_scaler() const { return scaler_; }
  comm::Communicator& communicator() { return *comm_; }

  // Full values of every trainable parameter by name (gathers stage-3 shards: a collective, every rank
  // must call it). For checkpoints and tests.
  std::vector<std::pair<std::string, torch::Tensor>> full_parameters() {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    if (rep_) for (auto& e : rep_->flat.entries()) out.emplace_back(e.name, e.param.detach().clone());
    for (auto& g : groups3_) {
      auto full = torch::empty({g->layout.padded()}, g->shard.options().requires_grad(false));
      gather_into(*comm_, g->shard.detach(), full);
      for (auto& e : g->layout.entries()) out.emplace_back(e.name, FlatParams::view(full, e).clone());
    }
    return out;
  }

  // Optimizer state per partition (replicated group first, then stage-3 layers): {master, m, v}; master
  // is undefined where the parameter is its own master (float compute, no offload). Views, not copies.
  std::vector<std::vector<torch::Tensor>> optimizer_state() {
    std::vector<std::vector<torch::Tensor>> out;
    for (Owned* o : partitions()) out.push_back({o->master, o->m, o->v});
    return out;
  }

  // Bytes held now by this rank, per category (communication: the largest transient buffers seen).
  MemoryUse memory() const {
    MemoryUse m;
    auto add = [](plan::Placement& p, const torch::Tensor& t, bool host) {
      if (!t.defined()) return;
      (host ? p.host : p.device) += int64_t(t.nbytes());
    };
    auto add_owned = [&](const Owned& o, bool grad_is_separate) {
      if (grad_is_separate) add(m.gradients, o.grad, false);
      add(m.master_weights, o.master, kOffload);
      add(m.optimizer_state, o.m, kOffload);
      add(m.optimizer_state, o.v, kOffload);
      add(m.gradients, o.host_grad, true);
    };
    if (rep_) {
      add(m.parameters, rep_->flat.flat(), false);
      add(m.gradients, rep_->flat.grad(), false);
      add(m.gradients, rep_->acc_full, false);
      add_owned(rep_->own, kStage >= 2);
      if constexpr (kStage >= 2) m.communication.device += rep_->flat.shard() * rep_->flat.element_size();  // reduce-scatter target
      if constexpr (kStage == 3) m.persistent_params += rep_->flat.numel();
    }
    for (std::size_t i = 0; i < groups3_.size(); ++i) {
      add(m.parameters, groups3_[i]->shard, false);
      add_owned(own3_[i], true);
    }
    if (runtime_) m.communication.device = std::max(m.communication.device, runtime_->peak_bytes());
    return m;
  }

  // Actual bytes beside the planner's prediction for the same shapes.
  MemoryReport memory_report(const plan::ModelShape& shape, const plan::TrainShape& train) const {
    return {memory(), plan::plan_memory<S>(shape, train, world_)};
  }

 private:
  // One optimizer partition: what this rank updates.
  struct Owned {
    torch::Tensor param;      // [n] compute dtype, written by AdamW (flat-buffer slice or stage-3 shard)
    torch::Tensor grad;       // [n] reduced gradient, grad_dtype_ (stage 0: the full buffer itself)
    torch::Tensor master;     // [n] fp32 master (mixed precision, or on the host under offload)
    torch::Tensor m, v;       // [n] fp32 Adam moments
    torch::Tensor host_grad;  // [n] fp32 host copy of grad (offload)
  };
  struct Replicated {
    FlatParams flat;          // full parameters + full gradient buffer (compute dtype)
    torch::Tensor acc_full;   // [padded] fp32 accumulator (stage 0/1 with mixed-precision accumulation)
    Owned own;
  };

  int64_t align_elems() const {
    const int64_t es = int64_t(c10::elementSize(compute_dtype_));
    return std::max<int64_t>(1, opt_.align_bytes / es);
  }
  torch::TensorOptions state_options() const {
    auto o = torch::TensorOptions().dtype(torch::kFloat32);
    return kOffload ? o.device(torch::kCPU).pinned_memory(device_.is_cuda()) : o.device(device_);
  }
  Owned make_owned(torch::Tensor param, torch::Tensor grad) {
    Owned o;
    o.param = param;
    o.grad = grad;
    const int64_t n = param.numel();
    if (kOffload || S::has_master_copy) {
      o.master = torch::empty({n}, state_options());
      o.master.copy_(param);
    }
    o.m = torch::zeros({n}, state_options());
    o.v = torch::zeros({n}, state_options());
    if (kOffload) o.host_grad = torch::zeros({n}, state_options());
    return o;
  }

  void broadcast(torch::Tensor& t) { broadcast_inplace(*comm_, t, 0); }

  void add_replicated_group(std::vector<std::pair<std::string, torch::Tensor>> params) {
    rep_.emplace();
    rep_->flat = FlatParams(std::move(params), world_, align_elems());
    torch::Tensor flat = rep_->flat.flat();
    broadcast(flat);
    rep_->flat.attach_grads();
    if (kFp32Accum && kStage <= 1) rep_->acc_full = torch::zeros({rep_->flat.padded()}, flat.options().dtype(torch::kFloat32));
    if constexpr (kStage == 0) {
      rep_->own = make_owned(flat, kFp32Accum ? rep_->acc_full : rep_->flat.grad());
    } else if constexpr (kStage == 1) {
      // The full gradient buffer is kept anyway: reduce-scatter in place into this rank's slice of it.
      rep_->own = make_owned(rep_->flat.shard_of(flat, rank_),
                             rep_->flat.shard_of(kFp32Accum ? rep_->acc_full : rep_->flat.grad(), rank_));
    } else {
      rep_->own = make_owned(rep_->flat.shard_of(flat, rank_),
                             torch::zeros({rep_->flat.shard()}, flat.options().dtype(grad_dtype_)));
    }
  }

  void add_stage3_group(const std::string& name, std::vector<std::pair<std::string, torch::Tensor>> params, Shardable& s,
                        std::unordered_set<const void*>& sharded) {
    auto g = std::make_unique<Stage3Group>();
    g->name = name;
    g->layout = FlatParams(params, world_, align_elems(), /*materialize=*/false);
    auto full = torch::zeros({g->layout.padded()}, params.front().second.options().requires_grad(false));
    {
      torch::NoGradGuard ng;
      for (auto& e : g->layout.entries()) FlatParams::view(full, e).copy_(e.param.detach());
    }
    broadcast(full);
    g->shard = g->layout.shard_of(full, rank_).clone().requires_grad_(true);
    g->grad_shard = torch::zeros({g->layout.shard()}, full.options().dtype(grad_dtype_));
    g->runtime = runtime_.get();
    {
      torch::NoGradGuard ng;  // the module's own tensors give their memory up: the shard holds the values
      for (auto& e : g->layout.entries()) {
        sharded.insert(e.param.unsafeGetTensorImpl());
        e.param.set_data(torch::empty({0}, e.param.options()));
      }
    }
    s.attach(g.get());
    attached_.push_back(&s);
    own3_.push_back(make_owned(g->shard.detach(), g->grad_shard));
    groups3_.push_back(std::move(g));
  }

  void after_backward(bool boundary) {
    if (!rep_) return;
    auto& flat = rep_->flat;
    auto& own = rep_->own;
    if constexpr (kStage <= 1) {
      if (kFp32Accum) {
        rep_->acc_full.add_(flat.grad());
        flat.zero_grad();
      }
      if (!boundary) return;
      const torch::Tensor src = kFp32Accum ? rep_->acc_full : flat.grad();
      if constexpr (kStage == 0) all_reduce_inplace(*comm_, src, comm::ReduceOp::avg);
      else reduce_scatter_avg(*comm_, src, own.grad);  // in place: own.grad is this rank's slice of src
    } else {
      auto mine = torch::empty({flat.shard()}, flat.grad().options());
      reduce_scatter_avg(*comm_, flat.grad(), mine);
      own.grad.add_(mine);
      flat.zero_grad();
    }
  }

  std::vector<Owned*> partitions() {
    std::vector<Owned*> p;
    if (rep_) p.push_back(&rep_->own);
    for (auto& o : own3_) p.push_back(&o);
    return p;
  }

  // The global sum of squares of the reduced gradients (scaled), identical on every rank.
  double global_sum_squares() {
    if constexpr (kStage == 0) {
      // Same association as the sharded stages: per rank-sized chunk, chunks in rank order.
      const torch::Tensor& g = rep_->own.grad;
      const int64_t shard = rep_->flat.shard();
      double total = 0;
      for (int r = 0; r < world_; ++r) {
        const double part = detail::sum_squares(g.narrow(0, int64_t(r) * shard, shard));
        total = r == 0 ? part : total + part;
      }
      return total;
    } else {
      double local = 0;
      for (Owned* o : partitions()) local += detail::sum_squares(o->grad);
      if (world_ == 1) return local;
      // Where the communicator takes buffers: device memory for NCCL.
      auto t = torch::full({1}, local, torch::TensorOptions().dtype(torch::kFloat64).device(device_));
      all_reduce_inplace(*comm_, t, comm::ReduceOp::sum);
      return t.item<double>();
    }
  }

  void finish_window(StepResult& r) {
    const float inv_scale = 1.0f / r.scale;
    float norm = 0, clip = 1, found_inf = 0;
    kernels::grad_norm_finalize(global_sum_squares(), kernels::NormType::L2, opt_.max_grad_norm, &inv_scale,
                                {&norm, &clip, &found_inf});
    r.grad_norm = norm;
    if (found_inf != 0) {
      // Some rank's shard overflowed: everyone saw the same global sum, so everyone skips.
      ++skipped_;
      if constexpr (S::dynamic_loss_scaling) {
        *scaler_.found_inf() = 1.0f;
        scaler_.update();
      }
      zero_window();
      r.applied = false;
      return;
    }
    const auto coeffs = kernels::adamw_coeffs(adamw_.lr, adamw_.beta1, adamw_.beta2, adamw_.eps, adamw_.weight_decay,
                                              applied_ + 1);
    const kernels::AdamWDynamic dyn{&inv_scale, nullptr, &clip, nullptr};
    for (Owned* o : partitions()) update(*o, coeffs, dyn, inv_scale * clip);
    ++applied_;
    if constexpr (S::dynamic_loss_scaling) scaler_.update();
    // Stages 1-2 (and stage 3's whole-kept parameters): everyone gets the updated shards back.
    if (rep_ && kStage >= 1) {
      auto& flat = rep_->flat;
      gather_into(*comm_, flat.shard_of(flat.flat(), rank_), flat.flat());  // in place
    }
    zero_window();
    r.applied = true;
  }

  void zero_window() {
    if (rep_) {
      rep_->flat.zero_grad();
      if (rep_->acc_full.defined()) rep_->acc_full.zero_();
    }
    for (Owned* o : partitions()) o->grad.zero_();
  }

  template <class G>
  void adamw_host(Owned& o, const kernels::AdamWCoeffs& c, const kernels::AdamWDynamic& d) {
    kernels::AdamWTensor<Compute, G> t;
    t.param = reinterpret_cast<Compute*>(o.param.data_ptr());
    t.master = std::is_same_v<Compute, float> ? nullptr : o.master.template data_ptr<float>();
    t.grad = reinterpret_cast<const G*>(o.grad.data_ptr());
    t.exp_avg = o.m.template data_ptr<float>();
    t.exp_avg_sq = o.v.template data_ptr<float>();
    t.n = o.param.numel();
    kernels::adamw_cpu(t, c, d);
  }

  void update(Owned& o, const kernels::AdamWCoeffs& c, const kernels::AdamWDynamic& d, float gmul) {
    if constexpr (kOffload) {
      // Gradients down, the CPU AdamW on the fp32 host master, parameters (compute type) back up.
      o.host_grad.copy_(o.grad);
      kernels::AdamWTensor<float, float> t{o.master.template data_ptr<float>(), nullptr, o.host_grad.template data_ptr<float>(),
                                           o.m.template data_ptr<float>(), o.v.template data_ptr<float>(), o.master.numel()};
      kernels::adamw_cpu(t, c, d);
      o.param.copy_(o.master);
    } else if (o.param.is_cpu()) {
      if (o.grad.scalar_type() == torch::kFloat32) adamw_host<float>(o, c, d);
      else adamw_host<Compute>(o, c, d);
    } else {
      // Device buffers from a host-compiled TU: the same math in torch ops (an nvcc TU could launch
      // kernels/adamw.cuh instead).
      torch::NoGradGuard ng;
      const torch::Tensor g = o.grad.to(torch::kFloat32) * gmul;
      torch::Tensor w = S::has_master_copy ? o.master : o.param;
      o.m.mul_(c.beta1).add_(g, 1.0f - c.beta1);
      o.v.mul_(c.beta2).addcmul_(g, g, 1.0f - c.beta2);
      const torch::Tensor denom = o.v.sqrt().mul_(c.inv_sqrt_bc2).add_(c.eps);
      w.mul_(1.0f - c.lr * c.weight_decay).addcdiv_(o.m, denom, -c.step_size);
      if (S::has_master_copy) o.param.copy_(w);
    }
  }

  std::shared_ptr<torch::nn::Module> module_;
  O adamw_;
  comm::CommPtr comm_;
  TrainerOptions opt_;
  kernels::LossScaler scaler_;
  float static_scale_ = 1.0f;
  int rank_ = 0, world_ = 1;
  torch::ScalarType compute_dtype_, grad_dtype_;
  torch::Device device_{torch::kCPU};
  std::unique_ptr<Stage3Runtime> runtime_;
  std::optional<Replicated> rep_;
  std::vector<std::unique_ptr<Stage3Group>> groups3_;
  std::vector<Owned> own3_;
  std::vector<Shardable*> attached_;
  int micro_ = 0;
  int64_t applied_ = 0, skipped_ = 0;
};

// module: a torch::nn::ModuleHolder (e.g. an `MLP` from TORCH_MODULE) or a shared_ptr to a Module.
template <StrategyType S, class M, AdamWHyperparameters O>
auto make_trainer(M& module, O adamw, comm::CommPtr comm, TrainerOptions opt = {}) {
  std::shared_ptr<torch::nn::Module> m;
  if constexpr (requires { module.ptr(); }) m = module.ptr();
  else m = module;
  return Trainer<S, O>(std::move(m), adamw, std::move(comm), opt);
}

}  // namespace squeeze::nn

namespace squeeze {
using nn::make_trainer;
}  // namespace squeeze
