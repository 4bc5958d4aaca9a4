#pragma once
// (About 1,000 lines: one class template whose members share the Strategy's compile-time switches; its seams are
// files of their own: options.hpp, adopt.hpp, buckets.hpp, stage3.hpp, offload.hpp, flat_params.hpp.)
//
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
// The module comes as built, on its device: in float (the trainer converts it to the Strategy's compute type and
// seeds fp32 masters from the float values) or already in the compute type; its layers are adopted as the
// Strategy requires (train/adopt.hpp). Every rank builds the same module; rank 0's initial values are broadcast.
//
// One step() call is one micro-batch: closure() returns that micro-batch's mean loss; the trainer
// backpropagates loss * scale / accumulation_steps (token-weighted: step(closure, tokens), see step()). The optimizer runs on every accumulation_steps-th
// call (the boundary); the others return applied = false, boundary = false. What happens per stage:
//
//            non-final micro-step                                  boundary micro-step
//   Stage0   grads accumulate in the full local buffer (fp32       all-reduce (average) the full buffer,
//            accumulator when mixed precision), no communication   AdamW on all of it on every rank
//   Stage1   as Stage0                                             reduce-scatter (average) into this
//                                                                  rank's shard, AdamW on the shard,
//                                                                  all-gather the updated parameters
//   Stage2   gradients reduce-scattered DURING backward, bucket    as the non-final step, then AdamW per
//            by bucket (about TrainerOptions::bucket_bytes each,   bucket shard and all-gather of each
//            the parameters in reverse registration order, i.e.    bucket's updated parameters
//            roughly the order backward finishes them): a post-
//            accumulate-grad hook per parameter copies its .grad
//            into the bucket's send buffer and frees the .grad;
//            when the bucket's last parameter arrived it is
//            reduce-scattered (average) and added into this rank's
//            gradient shard (fp32 when mixed), the buffer freed
//   Stage3   as Stage2, per layer inside the layer's backward;     AdamW on the parameter shard; nothing
//            parameters all-gathered per layer in forward and      to gather (the next forward does)
//            backward (whole-kept parameters: Stage2's buckets)
//
// Stage 2/3 accumulation choice: reduce-scatter after every micro-step and accumulate into the shard.
// Memory per rank: gradient shard Ψ/N (fp32 when mixed: 4Ψ/N bytes) + the in-flight buckets, instead of the
// full Ψ·p_c buffer (plus Ψ·4 fp32 accumulator when mixed) that keeping local gradients to the last micro-step
// would need. Communication: A reduce-scatters of Ψ·p_c per optimizer step instead of 1 (Trainer::
// reduce_scatter_bytes() counts them; test_zero's Stage2.GradientsStreamInBuckets prints both). ZeRO-2 is
// chosen for memory, so it pays the traffic; with A > 1 on a fast link the traffic overlaps backward.
// Without Accumulate the two choices coincide. All ranks must run the same graph (the buckets complete in the
// same order everywhere; parameters that get no gradient are reduced as zeros after backward, in bucket order).
//
// Offload<Host> (train/offload.hpp): each partition's gradient shard streams to pinned host memory as soon as it
// is final (inside backward), with its sum of squares (summed on the GPU before the copy; by the CPU worker
// for a CPU model); then
//   eager    (no clipping and no loss scaling: the update cannot depend on the other partitions) the worker
//            runs AdamW on the partition at once and streams its parameters back, during backward; what it has
//            not done when backward ends it works off first layer first beside the next forward (step() waits
//            for the gradient copies only, and each stage-3 gather for its own partition);
//   deferred (clipping or loss scaling) after backward the global norm decides skip/clip, then the worker
//            updates partition by partition; stage 3 returns from step() at once and each layer's next
//            gather waits only for its own partition, so the CPU AdamW overlaps the next forward.
// TrainerOptions::overlap_offload = false runs the same jobs in program order (bitwise the same results).
// A non-finite gradient in eager mode: the partitions this rank updated before it was seen keep their update (as an
// optimizer-in-backward does); the rest are not updated and the step reports applied = false.
//
// Boundary, in order: global L2 norm of the reduced gradients (sum of squares per shard in double,
// all-reduced; unscaled by the loss scale) -> non-finite norm = overflow on some rank: every rank skips
// the step, state untouched, the dynamic scale backs off -> clip coefficient min(1, max/(norm+1e-6)) ->
// fused AdamW (kernels::adamw_cpu for host buffers; torch ops for device buffers in a non-nvcc TU) with
// unscale and clip folded in -> scale growth bookkeeping.
//
// Quantized<8, Blockwise8>: Adam's m and v are kept as uint8 codes with one fp32 absmax per 256 elements
// (kernels/adamw8.hpp: Dettmers et al.'s block-wise dynamic quantization), 2 bytes + 8/256 per parameter
// instead of 8; the update decodes, runs the same AdamW element, re-encodes. Blocks start at the first element of
// each partition's segment (below), so stages and world sizes that cut partitions differently group different
// elements under one absmax: the cross-stage bitwise guarantees below do not hold for it (overlapped == in-order
// offload does).
//
// Parameter groups (TrainerOptions::param_groups; by default no decay on norms, biases and embeddings): each
// partition is cut into segments of one group (Segment), each updated with its group's coefficients.
//
// Parity guarantees on LocalComm (reduction in rank order, see comm/local.hpp), float or bf16, same data:
//   accumulation 1: Stage0 == Stage1 == Stage2 == Stage3 bitwise, with or without Offload<Host> (overlapped
//   or not), whatever the bucket size;
//   accumulation N: Stage0 == Stage1 and Stage2 == Stage3 bitwise; Stage0/1 vs Stage2/3 differ by the
//   order of (sum over ranks, sum over micro-steps), within rounding of the gradient dtype.
//   With clipping active, Stage2/3 vs the others differ by norm rounding (the shard/bucket order of the sum).
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <atomic>
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
#include "adamw_torch_ops.hpp"
#include "adopt.hpp"
#include "buckets.hpp"
#include "collectives.hpp"
#include "flat_params.hpp"
#include "offload.hpp"
#include "options.hpp"
#include "stage3.hpp"
#include "torch_types.hpp"
#include "squeeze/kernels/adamw.hpp"
#include "squeeze/kernels/adamw8.hpp"
#include "squeeze/kernels/grad_norm.hpp"
#include "squeeze/kernels/loss_scale.hpp"

namespace squeeze::train {

template <StrategyType S, AdamWHyperparameters O>
class Trainer {
 public:
  using strategy = S;
  using Compute = typename S::compute_type;
  // LoRA trains adapters kept in the master type (fp32), cast to the activations' dtype in forward: they are their
  // own masters. Full training keeps parameters in the compute type (with fp32 masters when that is 16-bit).
  using Param = std::conditional_t<S::has_lora, typename S::master_type, Compute>;
  static constexpr bool kMaster = !std::is_same_v<Param, float>;
  static constexpr int kStage = S::stage;
  static constexpr int kAccum = S::accumulation_steps;
  static constexpr bool kOffload = S::offload_to_host;
  // Mixed-precision micro-batches are summed in fp32 (the planner counts the same).
  static constexpr bool kFp32Accum = kAccum > 1 && kMaster;
  static_assert(S::training, "make_trainer needs a training Strategy: remove Inference (an inference model needs no trainer)");
  // 8-bit Adam moments (Quantized<8, Blockwise8>): uint8 codes + one fp32 absmax per kernels::kStateBlock
  // elements (kernels/adamw8.hpp). Host buffers (Offload<Host>, CPU models) run kernels::adamw8_cpu; device
  // buffers the CUDA kernel (kernels/adamw8.cuh) where this header is compiled by nvcc, else the same maps and
  // rule in torch ops.
  static constexpr bool k8bit = S::state_bits == 8;
  static_assert(!k8bit || S::state_quantization::group == int(kernels::kStateBlock),
                "train::Trainer's 8-bit optimizer state uses blocks of 256 values: write Quantized<8, Blockwise8> (or Group<256>)");

  Trainer(std::shared_ptr<torch::nn::Module> module, O adamw, comm::CommPtr comm, TrainerOptions opt = {})
      : module_(std::move(module)), adamw_(adamw), comm_(std::move(comm)), opt_(resolve(adamw, opt)),
        scaler_(*opt_.loss_scale) {
    TORCH_CHECK(module_ != nullptr, "make_trainer: module is null");
    TORCH_CHECK(comm_ != nullptr, "make_trainer: communicator is null");
    TORCH_CHECK(opt_.align_bytes >= 1, "make_trainer: align_bytes must be >= 1");
    TORCH_CHECK(opt_.bucket_bytes >= 1, "make_trainer: bucket_bytes must be >= 1");
    TORCH_CHECK(!std::isnan(opt_.max_grad_norm), "make_trainer: max_grad_norm is NaN (use 0 for no clipping)");
    rank_ = comm_->rank();
    world_ = comm_->size();
    compute_dtype_ = torch_dtype<Param>();
    grad_dtype_ = kFp32Accum ? torch::kFloat32 : compute_dtype_;
    if constexpr (S::loss_scaling && !S::dynamic_loss_scaling) static_scale_ = std::ldexp(1.0f, S::loss_scale::log2_scale);
    // Validate the AdamW hyper-parameters now, not at the first boundary.
    (void)kernels::adamw_coeffs(adamw_.lr, adamw_.beta1, adamw_.beta2, adamw_.eps, adamw_.weight_decay, 1);

    // The module as built (float, or already in the compute type) becomes what S trains: layers adopted,
    // parameters converted; the float values seed the masters (train/adopt.hpp).
    adopted_ = adopt_model<S>(*module_, AdoptOptions{opt_.replicate, opt_.device});
    if (!opt_.master_init && !adopted_.float_values.empty()) {
      opt_.master_init = [this](const std::string& name) {
        auto it = adopted_.float_values.find(name);
        TORCH_CHECK(it != adopted_.float_values.end(), "make_trainer: no float value kept for '", name, "'");
        return it->second;
      };
    }
    std::vector<std::pair<std::string, torch::Tensor>> trainable;
    for (auto& item : module_->named_parameters(/*recurse=*/true)) {
      if (!item.value().requires_grad()) continue;
      TORCH_CHECK(item.value().scalar_type() == compute_dtype_, "make_trainer: parameter '", item.key(), "' is ",
                  item.value().scalar_type(), " but the Strategy trains it in ", compute_dtype_);
      trainable.emplace_back(item.key(), item.value());
    }
    TORCH_CHECK(!trainable.empty(), "make_trainer: the module has no trainable parameters");
    assign_groups(trainable);
    device_ = trainable.front().second.device();
    if (world_ > 1) {
      TORCH_CHECK(!device_.is_cuda() || comm_->device_buffers(), "make_trainer: the module is on ", device_, " but the '",
                  comm_->backend(), "' communicator takes host buffers only; LocalComm takes CUDA memory when its TU is "
                  "compiled by nvcc or with SQUEEZE_WITH_CUDA_RUNTIME=1 (link CUDA::cudart); or use NcclComm");
      TORCH_CHECK(device_.is_cuda() || comm_->host_buffers(), "make_trainer: the module is on the CPU but the '",
                  comm_->backend(), "' communicator takes device buffers only: move the module to its GPU");
    }
    collectives_ = std::make_unique<SideStream>(asynchronous_collectives(device_, *comm_) ? SideStream(device_) : SideStream());
    state_ = std::make_unique<detail::GradState>();
    state_->comm = comm_;
    state_->collectives = collectives_.get();
    state_->device = device_;
    // Thread-ranks sharing one GPU cannot meet in a collective inside backward: libtorch runs every CUDA
    // backward of the process on one worker thread per device. Their buckets are reduced after backward.
    state_->defer = device_.is_cuda() && world_ > 1 && comm_->backend() == "local";
    if constexpr (kOffload) offload_ = std::make_unique<OffloadPipeline>(device_, opt_.overlap_offload);
    state_->offload = offload_.get();

    std::unordered_set<const void*> sharded;  // TensorImpls owned by stage-3 groups
    if constexpr (kStage == 3) {
      runtime_ = std::make_unique<Stage3Runtime>(comm_, opt_.prefetch_depth, opt_.keep_last_gathered, device_, *collectives_);
      // Sharded layers by gather unit, units in the order of their first layer, layers in module order.
      const std::vector<std::string> units = gather_unit_names();
      std::vector<std::pair<std::string, std::vector<std::pair<std::string, Shardable*>>>> by_unit;
      for (auto& item : module_->named_modules()) {
        auto* s = dynamic_cast<Shardable*>(item.value().get());
        if (s == nullptr) continue;
        int64_t n = 0;
        bool frozen = false;
        for (auto& [name, p] : s->shardable_parameters()) p.requires_grad() ? void(n += p.numel()) : void(frozen = true);
        if (n == 0 || n < opt_.persistence_threshold) continue;  // small: stays whole (replicated)
        TORCH_CHECK(!frozen, "Stage3: layer '", item.key(), "' mixes frozen and trainable parameters");
        const std::string unit = unit_of(units, item.key());
        auto it = std::find_if(by_unit.begin(), by_unit.end(), [&](const auto& u) { return u.first == unit; });
        if (it == by_unit.end()) it = by_unit.insert(by_unit.end(), {unit, {}});
        it->second.emplace_back(item.key(), s);
      }
      for (auto& [unit, layers] : by_unit) add_stage3_group(unit, layers, sharded);
    }
    std::vector<std::pair<std::string, torch::Tensor>> replicated;
    for (auto& p : trainable)
      if (!sharded.count(p.second.unsafeGetTensorImpl())) replicated.push_back(p);
    if (!replicated.empty()) {
      if constexpr (kStage >= 2) add_buckets(std::move(replicated));
      else add_replicated_group(std::move(replicated));
    }
    if constexpr (kStage >= 2)
      for (Partition* p : partitions()) state_->shard_bytes += int64_t(p->grad.nbytes());
    rank_offload_jobs();
    opt_.master_init = nullptr;  // used only while building: what it refers to may go now
    adopted_.float_values.clear();
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
  // Everything hooks, callbacks and the offload worker point to lives behind unique_ptrs: a move keeps it in place.
  Trainer(Trainer&&) = default;
  Trainer& operator=(Trainer&&) = delete;
  // Stage 3: the layers are detached (their emptied weights then fail loudly in forward instead of
  // reading freed shards); call restore_module() first to keep training or evaluating the module alone.
  // Stage 2: the gradient hooks are removed (the parameters keep their values, in the buckets' buffers).
  ~Trainer() {
    if (offload_) {
      try {
        offload_->wait_all();
      } catch (...) {  // a failed update was reported by step(); nothing to do here
      }
    }
    for (Shardable* s : attached_) s->attach(nullptr, 0);
    for (auto& b : buckets_)
      for (auto& e : b->flat.entries()) torch::autograd::impl::set_post_acc_grad_hooks(e.param, nullptr);
  }

  // Stage 3: gathers every sharded layer back into its module's own parameters and detaches it
  // (a collective). The trainer must not step afterwards.
  void restore_module() {
    sync();
    for (auto& g : groups3_) {
      auto full = torch::empty({g->layout.padded()}, g->shard.options().requires_grad(false));
      gather_into(*comm_, g->shard.detach(), full);
      torch::NoGradGuard ng;
      for (auto& e : g->layout.entries()) e.param.set_data(FlatParams::view(full, e).clone());
    }
    for (Shardable* s : attached_) s->attach(nullptr, 0);
    attached_.clear();
  }

  // One micro-batch. closure() returns the micro-batch's scalar loss (graph attached).
  StepResult step(const std::function<torch::Tensor()>& closure) { return run_micro_batch(closure, 0); }
  // Token-weighted accumulation: the micro-batch's loss (its mean over `tokens` targets) weighs tokens / (the
  // window's tokens on all ranks) instead of 1 / (accumulation steps x ranks), so the window's gradient is that of
  // one big batch whatever the micro-batches' sizes. Every micro-batch of a window passes its count, or none does.
  StepResult step(const std::function<torch::Tensor()>& closure, int64_t tokens) {
    TORCH_CHECK(tokens >= 1, "Trainer::step: tokens must be >= 1 (the micro-batch's target count), got ", tokens);
    return run_micro_batch(closure, tokens);
  }

 private:
  StepResult run_micro_batch(const std::function<torch::Tensor()>& closure, int64_t tokens) {
    StepResult r;
    last_gathered_ = {};  // the step changes the weights
    r.scale = scale();
    const bool boundary = micro_ + 1 == kAccum;
    if (micro_ == 0) window_weighted_ = tokens > 0, window_tokens_ = 0;
    TORCH_CHECK(window_weighted_ == (tokens > 0), "Trainer::step: micro-batch ", micro_ + 1, " of ", kAccum,
                tokens > 0 ? " passes a token count but the window's first did not"
                           : " passes no token count but the window's first did: pass it to every step() of a window");
    double weight = 1.0 / double(kAccum);
    if (tokens > 0) {
      if (token_ref_ == 0) token_ref_ = agreed_token_reference(tokens);
      weight = double(tokens) / double(token_ref_);
      window_tokens_ += tokens;
    }
    begin_micro_step(boundary);
    // If the closure or backward throws, free what stage 3 gathered (the window's gradients are kept;
    // the other ranks will fail their next collective by timeout, as a lost rank would make them).
    struct PassGuard {
      Stage3Runtime* rt;
      ~PassGuard() {
        if (rt) {
          rt->release_all();
          try {
            rt->set_phase(Stage3Runtime::Phase::idle);
          } catch (...) {
          }
        }
      }
    } guard{runtime_.get()};
    if (runtime_) runtime_->set_phase(Stage3Runtime::Phase::forward);
    torch::Tensor loss;
    {
      // Checkpointed: nn::checkpoint(block, x) recomputes while this closure runs (nn/activation_checkpoint.hpp).
      struct RecomputeGuard {
        int saved = nn::detail::RecomputeScope::every();
        ~RecomputeGuard() { nn::detail::RecomputeScope::every() = saved; }
      } recompute;
      nn::detail::RecomputeScope::every() = S::checkpoint_every;
      const int64_t calls = nn::detail::RecomputeScope::calls();
      loss = closure();
      if constexpr (S::checkpoint_every > 0) {
        TORCH_CHECK(adopted_.recomputable > 0 || nn::detail::RecomputeScope::calls() > calls,
                    "make_trainer: the Strategy is Checkpointed but the model recomputed nothing: run its blocks through "
                    "squeeze::nn::Blocks, or call squeeze::nn::checkpoint(block, x) in its forward (or drop Checkpointed)");
        adopted_.recomputable = std::max(adopted_.recomputable, 1);  // checked once
      }
    }
    TORCH_CHECK(loss.defined() && loss.numel() == 1, "Trainer::step: the closure must return a scalar loss, got ",
                loss.defined() ? loss.sizes() : torch::IntArrayRef{});
    TORCH_CHECK(loss.requires_grad(), "Trainer::step: the loss does not require grad (computed under NoGradGuard?)");
    if (runtime_) {
      runtime_->set_phase(Stage3Runtime::Phase::backward);  // the forward order is known from here on
      if (!ranked_by_forward_) rank_offload_jobs();
    }
    attach_at_backward();
    (loss * (double(r.scale) * weight)).backward();
    if (runtime_) runtime_->finish_backward();
    r.loss_value = loss.detach().to(torch::kFloat32).reshape({});
    r.loss = opt_.read_loss ? r.loss_value.item<float>() : std::nanf("");  // read after backward: no stall between them
    if (runtime_) {
      runtime_->release_all();
      runtime_->set_phase(Stage3Runtime::Phase::idle);
    }
    guard.rt = nullptr;
    after_backward(boundary);
    micro_ = boundary ? 0 : micro_ + 1;
    r.step = applied_;
    if (!boundary) return r;
    r.boundary = true;
    finish_window(r);
    r.step = applied_;
    return r;
  }

  // Token weighting's reference count: the largest first micro-batch over the ranks (one collective, once), so
  // each micro-batch's gradient is scaled by about 1 (no overflow under fp16's loss scale).
  int64_t agreed_token_reference(int64_t tokens) {
    if (world_ == 1) return tokens;
    auto t = torch::full({1}, double(tokens), torch::TensorOptions().dtype(torch::kFloat64).device(device_));
    all_reduce_inplace(*comm_, t, comm::ReduceOp::max);
    return int64_t(t.item<double>());
  }
  // Token weighting: the factor that turns the reduced (rank-averaged) gradient into the token-weighted mean.
  double token_weighting_factor() {
    double total = double(window_tokens_);
    if (world_ > 1) {
      auto t = torch::full({1}, total, torch::TensorOptions().dtype(torch::kFloat64).device(device_));
      all_reduce_inplace(*comm_, t, comm::ReduceOp::sum);
      total = t.item<double>();
    }
    return double(world_) * double(token_ref_) / total;
  }

 public:

  float scale() const {
    if constexpr (S::dynamic_loss_scaling) return scaler_.scale();
    else return static_scale_;
  }
  int64_t steps_applied() const { return applied_; }
  // The learning rate of the following optimizer steps (schedules: warm-up, cosine). Checked like AdamW's
  // constructor arguments; an Offload<Host> step already under way keeps the rate it started with.
  void set_lr(float lr) {
    (void)kernels::adamw_coeffs(lr, adamw_.beta1, adamw_.beta2, adamw_.eps, adamw_.weight_decay, 1);
    adamw_.lr = lr;
  }
  float lr() const { return adamw_.lr; }
  // Stages 0-1: when the full gradient buffer exists from the next window on (TrainerOptions::gradient_buffers).
  // Between windows only: a window's gradients live where it began them.
  void set_gradient_buffers(GradientBuffers g) {
    TORCH_CHECK(micro_ == 0, "Trainer::set_gradient_buffers: called at micro-batch ", micro_ + 1, " of ", kAccum,
                "; change it between optimizer steps, when no window has begun");
    if (g == opt_.gradient_buffers) return;
    const bool was_kept = opt_.gradient_buffers == GradientBuffers::kept;
    opt_.gradient_buffers = g;
    if (!rep_) return;
    if (g == GradientBuffers::kept) attach_replicated_grads();
    else if (was_kept) release_replicated_grads();
  }
  int64_t steps_skipped() const { return skipped_; }
  // Resuming from a checkpoint whose parameters and optimizer state were copied in: AdamW's bias correction
  // continues from `steps_applied`; the dynamic loss scale (ignored for a static or no scale) and its clean
  // steps since the last change come back as they were saved.
  void restore_counters(int64_t steps_applied, float loss_scale, int64_t good_steps, int64_t skipped = 0) {
    TORCH_CHECK(skipped >= 0, "Trainer::restore_counters: skipped must be >= 0, got ", skipped);
    TORCH_CHECK(steps_applied >= 0, "Trainer::restore_counters: steps_applied must be >= 0, got ", steps_applied);
    TORCH_CHECK(good_steps >= 0 && good_steps <= std::numeric_limits<std::int32_t>::max(),
                "Trainer::restore_counters: good_steps out of range: ", good_steps);
    sync();  // no offloaded update may land after the counters changed
    if constexpr (S::dynamic_loss_scaling) {
      try {
        scaler_.restore(loss_scale, std::int32_t(good_steps));
      } catch (const squeeze::Error& e) {
        TORCH_CHECK(false, "Trainer::restore_counters: ", e.what());
      }
    }
    applied_ = steps_applied;
    skipped_ = skipped;
  }
  const kernels::LossScaler& loss_scaler() const { return scaler_; }
  comm::Communicator& communicator() { return *comm_; }
  // Stage 2/3 buckets: bytes that entered gradient reduce-scatters in the last finished window.
  int64_t reduce_scatter_bytes() const { return last_window_rs_bytes_; }
  // Offload<Host>: whether the last boundary updated partitions during backward (see the header).
  bool updated_during_backward() const { return last_eager_; }
  // Offload<Host>: host time of the pipeline since the last reset (see OffloadStats); zeros otherwise.
  OffloadStats offload_stats() const { return offload_ ? offload_->stats() : OffloadStats{}; }
  void reset_offload_stats() {
    if (offload_) offload_->reset_stats();
  }
  // Waits for Offload<Host> work still in flight (step() may return before the last updates of stage 3 land).
  void sync() {
    if (offload_) offload_->wait_all();
  }

  // Full values of every trainable parameter by name (gathers stage-3 shards: a collective, every rank
  // must call it). For checkpoints and tests.
  std::vector<std::pair<std::string, torch::Tensor>> full_parameters() {
    sync();
    std::vector<std::pair<std::string, torch::Tensor>> out;
    if (rep_) for (auto& e : rep_->flat.entries()) out.emplace_back(e.name, e.param.detach().clone());
    for (auto& b : buckets_)
      for (auto& e : b->flat.entries()) out.emplace_back(e.name, e.param.detach().clone());
    for (auto& g : groups3_) {
      auto full = torch::empty({g->layout.padded()}, g->shard.options().requires_grad(false));
      gather_into(*comm_, g->shard.detach(), full);
      for (auto& e : g->layout.entries()) out.emplace_back(e.name, FlatParams::view(full, e).clone());
    }
    return out;
  }

  // Full values of one trainable parameter (a copy). Under stage 3 this gathers only the layer that holds it, so a
  // caller walking the parameters layer by layer (an export) holds one layer gathered at a time; the last layer
  // gathered is kept for the next call. A collective under stage 3: every rank asks for the same names in order.
  torch::Tensor gather_parameter(const std::string& name) {
    sync();
    auto find = [&](const FlatParams& flat) -> const FlatEntry* {
      for (auto& e : flat.entries())
        if (e.name == name) return &e;
      return nullptr;
    };
    if (rep_)
      if (auto* e = find(rep_->flat)) return e->param.detach().clone();
    for (auto& b : buckets_)
      if (auto* e = find(b->flat)) return e->param.detach().clone();
    for (auto& g : groups3_)
      if (auto* e = find(g->layout)) {
        if (last_gathered_.first != g.get()) {
          last_gathered_.second = torch::Tensor();  // one layer gathered at a time
          auto full = torch::empty({g->layout.padded()}, g->shard.options().requires_grad(false));
          gather_into(*comm_, g->shard.detach(), full);
          last_gathered_ = {g.get(), full};
        }
        return FlatParams::view(last_gathered_.second, *e).clone();
      }
    TORCH_CHECK(false, "gather_parameter: '", name, "' is not a trainable parameter of this trainer (frozen parameters stay in the module)");
    return {};
  }
  // Drops the layer gather_parameter keeps (after an export; the next step would make it stale).
  void release_gathered() { last_gathered_ = {}; }

  // Whether `name` is a trainable parameter the trainer holds (load_parameter / gather_parameter take it).
  bool has_parameter(const std::string& name) const { return group_of_.count(name) != 0; }

  // Sets trainable parameter `name` to `value` (its full shape, any float dtype, any device): the parameter in the
  // compute dtype and, where it has one, its fp32 master from `value` itself (a bf16 file gives exact masters; an
  // fp32 one keeps its extra bits). Under stages 1-3 each rank writes only the part it owns, so a loader streaming a
  // checkpoint tensor by tensor fills stage-3 shards without a full copy of the model anywhere. Not a collective:
  // every rank passes the same full value. Adam moments are left as they are (zero before the first step).
  void load_parameter(const std::string& name, const torch::Tensor& value) {
    sync();
    release_gathered();
    TORCH_CHECK(value.defined() && value.is_floating_point(), "load_parameter: the value for '", name, "' must be a floating-point tensor");
    const auto layouts = partition_layouts();
    const std::vector<Partition*> parts = partitions();
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const FlatParams& layout = *layouts[i].first;
      for (const FlatEntry& e : layout.entries()) {
        if (e.name != name) continue;
        TORCH_CHECK(value.sizes().vec() == e.shape, "load_parameter: '", name, "' is ", c10::IntArrayRef(e.shape), " but the value is ",
                    value.sizes());
        torch::NoGradGuard ng;
        const torch::Tensor flat = value.detach().contiguous().view({-1});
        const bool sharded = i >= parts.size() - own3_.size();  // stage 3: e.param is emptied, the shard holds the values
        if (!sharded) e.param.detach().copy_(flat.view(e.param.sizes()));  // stages 0-2: every rank holds the full value
        Partition& o = *parts[i];
        const int64_t begin = layouts[i].second, end = begin + o.param.numel();
        const int64_t lo = std::max(begin, e.offset), hi = std::min(end, e.offset + e.numel);
        if (lo >= hi) return;
        const torch::Tensor part = flat.narrow(0, lo - e.offset, hi - lo);
        if (sharded) o.param.narrow(0, lo - begin, hi - lo).copy_(part);
        if (o.master.defined()) o.master.narrow(0, lo - begin, hi - lo).copy_(part);
        return;
      }
    }
    TORCH_CHECK(false, "load_parameter: '", name, "' is not a trainable parameter of this trainer (frozen parameters stay in the module)");
  }

  // Optimizer state per partition (replicated group or buckets first, then stage-3 layers): {master, m, v},
  // fp32; with 8-bit state {master, m, v, m_absmax, v_absmax}: m, v uint8 codes [n], their block scales fp32
  // [ceil(n / 256)] (names: optimizer_state_names()). master is undefined where the parameter is its own master
  // (float compute, no offload). Views, not copies: copying saved values into them restores the state.
  std::vector<std::vector<torch::Tensor>> optimizer_state() {
    sync();
    std::vector<std::vector<torch::Tensor>> out;
    for (Partition* o : partitions()) {
      if constexpr (k8bit) out.push_back({o->master, o->m, o->v, o->m_absmax, o->v_absmax});
      else out.push_back({o->master, o->m, o->v});
    }
    return out;
  }
  // Where each optimizer_state() partition sits: its flat layout (parameter names, offsets, shapes) and the index
  // of its first element in that layout's flat buffer (this rank's shard; 0 for stage 0's whole buffer).
  std::vector<std::pair<const FlatParams*, int64_t>> partition_layouts() const {
    std::vector<std::pair<const FlatParams*, int64_t>> out;
    if (rep_) out.emplace_back(&rep_->flat, kStage == 0 ? 0 : int64_t(rank_) * rep_->flat.shard());
    for (auto& b : buckets_) out.emplace_back(&b->flat, int64_t(rank_) * b->flat.shard());
    for (auto& g : groups3_) out.emplace_back(&g->layout, int64_t(rank_) * g->layout.shard());
    return out;
  }
  // One optimizer partition as a checkpoint stores it (train/checkpoint.hpp): its flat layout, whether every rank
  // holds all of it (stage 0's replicated buffer) or its own shard, and its buffers. Views: copying values into
  // them restores them (then share_loaded_parameters()).
  struct PartitionBuffers {
    std::string key;           // "replicated", "bucket<i>" or the stage-3 layer's name: unique within the trainer
    const FlatParams* layout;  // parameter names, shapes and offsets of the flat buffer the partition cuts
    int64_t align;             // the layout's alignment in elements
    bool whole;                // stage 0: the buffers hold the whole padded layout on every rank
    std::vector<std::pair<std::string, torch::Tensor>> elementwise;  // one element per parameter element: param, master, m, v
    std::vector<std::pair<std::string, torch::Tensor>> blockwise;    // 8-bit state: m_absmax, v_absmax (one per 256-element block)
    std::vector<int> groups;   // each layout entry's parameter group (its 8-bit blocks start at each group's run)
  };
  std::vector<PartitionBuffers> partition_buffers() {
    sync();
    std::vector<PartitionBuffers> out;
    const auto layouts = partition_layouts();
    const std::vector<Partition*> parts = partitions();
    for (size_t i = 0; i < parts.size(); ++i) {
      const Partition& o = *parts[i];
      PartitionBuffers b{i == 0 && rep_ ? "replicated" : "", layouts[i].first, align_elems(), kStage == 0 && rep_ && i == 0, {}, {}, {}};
      for (const auto& e : layouts[i].first->entries()) b.groups.push_back(group_of_.at(e.name));
      if (b.key.empty()) b.key = i < (rep_ ? 1 : 0) + buckets_.size() ? "bucket" + std::to_string(i - (rep_ ? 1 : 0))
                                                                      : groups3_[i - (rep_ ? 1 : 0) - buckets_.size()]->name;
      b.elementwise.emplace_back("param", o.param.detach());
      if (o.master.defined()) b.elementwise.emplace_back("master", o.master);
      b.elementwise.emplace_back("m", o.m);
      b.elementwise.emplace_back("v", o.v);
      if constexpr (k8bit) b.blockwise = {{"m_absmax", o.m_absmax}, {"v_absmax", o.v_absmax}};
      out.push_back(std::move(b));
    }
    return out;
  }
  // After a checkpoint's values were copied into partition_buffers(): stages 1-2 give every rank the parameters
  // the other ranks own (a collective).
  void share_loaded_parameters() {
    sync();
    torch::NoGradGuard no_grad;
    gather_replicated();
  }
  // Micro-batches stepped in the current accumulation window (0 at a boundary).
  int micro_step() const { return micro_; }
  torch::nn::Module& module() { return *module_; }
  const TrainerOptions& options() const { return opt_; }
  static std::vector<std::string> optimizer_state_names() {
    if constexpr (k8bit) return {"master", "m", "v", "m_absmax", "v_absmax"};
    else return {"master", "m", "v"};
  }

  // Bytes held now by this rank, per category (communication: the largest transient buffers seen).
  MemoryUse memory() const {
    MemoryUse m;
    auto add = [](plan::Placement& p, const torch::Tensor& t, bool host) {
      if (!t.defined()) return;
      (host ? p.host : p.device) += int64_t(t.nbytes());
    };
    auto add_owned = [&](const Partition& o, bool grad_is_separate) {
      if (grad_is_separate) add(m.gradients, o.grad, false);
      add(m.master_weights, o.master, kOffload);
      add(m.optimizer_state, o.m, kOffload);
      add(m.optimizer_state, o.v, kOffload);
      add(m.optimizer_state, o.m_absmax, kOffload);
      add(m.optimizer_state, o.v_absmax, kOffload);
      add(m.gradients, o.host_grad, true);
    };
    if (rep_) {
      add(m.parameters, rep_->flat.flat(), false);
      add(m.gradients, rep_->flat.grad(), false);
      add(m.gradients, rep_->acc_full, false);
      add_owned(rep_->own, false);
      m.peak_gradient_bytes = m.gradients.device;
      m.full_gradient_bytes += rep_->flat.numel() * rep_->flat.element_size();
    }
    for (auto& b : buckets_) {
      add(m.parameters, b->flat.flat(), false);
      add_owned(b->own, true);
      if constexpr (kStage == 3) m.persistent_params += b->flat.numel();
      m.full_gradient_bytes += b->flat.numel() * b->flat.element_size();
    }
    for (std::size_t i = 0; i < groups3_.size(); ++i) {
      add(m.parameters, groups3_[i]->shard, false);
      add_owned(*own3_[i], true);
      m.full_gradient_bytes += groups3_[i]->layout.numel() * groups3_[i]->layout.element_size();
    }
    if constexpr (kStage >= 2) {
      m.communication.device = state_->peak_live;                  // in-flight gradient buckets
      m.peak_gradient_bytes = std::max(state_->peak_grad, m.gradients.device);
    }
    if (runtime_) m.communication.device = std::max(m.communication.device, runtime_->peak_bytes());
    return m;
  }

  // Actual bytes beside the planner's prediction for the same shapes.
  MemoryReport memory_report(const plan::ModelShape& shape, const plan::TrainShape& train) const {
    return {memory(), plan::plan_memory<S>(shape, train, world_)};
  }

 private:
  struct Replicated {
    FlatParams flat;          // full parameters + full gradient buffer (compute dtype)
    torch::Tensor acc_full;   // [padded] fp32 accumulator (stage 0/1 with mixed-precision accumulation)
    Partition own;
  };

  int64_t align_elems() const {
    const int64_t es = int64_t(c10::elementSize(compute_dtype_));
    return std::max<int64_t>(1, opt_.align_bytes / es);
  }
  // [n] optimizer-state buffer: on the device, or on the host with Offload<Host>. From a GPU, what the pipeline's
  // asynchronous copies touch (`transferred`: the host gradient copy, which also carries the rounded new parameters
  // back, and the fp32 master where it is the upload's source) is pinned host memory of exactly n elements
  // (train::pinned_empty: torch's caching host allocator would round each one up to a power of two). The moments
  // never cross PCIe, so they stay pageable: pinning them would lock most of the host state (54 of 94 GB at 7B) and
  // cost seconds per 10 GB when the trainer is built, for no copy.
  // Host state the copies never touch comes zeroed from train::host_zeros, which writes nothing until first use.
  torch::Tensor state_empty(int64_t n, torch::ScalarType dtype, bool transferred) const {
    if (!kOffload) return torch::empty({n}, torch::TensorOptions().dtype(dtype).device(device_));
    return device_.is_cuda() && transferred ? pinned_empty(n, dtype) : host_zeros(n, dtype);
  }
  torch::Tensor state_zeros(int64_t n, torch::ScalarType dtype, bool transferred) const {
    torch::Tensor t = state_empty(n, dtype, transferred);
    return kOffload && !(device_.is_cuda() && transferred) ? t : t.zero_();
  }
  // The fp32 master is the upload's source unless the CPU AdamW stages the rounded parameters in the host
  // gradient copy (a 16-bit gradient of the parameter's dtype: OffloadPipeline::write_back's staged path).
  bool master_uploaded() const { return !(kMaster && grad_dtype_ == compute_dtype_); }

  void make_owned(Partition& o, torch::Tensor param, torch::Tensor grad) {
    o.param = param;
    o.grad = grad;
    const int64_t n = param.numel();
    if (kOffload || kMaster) {
      o.master = state_empty(n, torch::kFloat32, master_uploaded());
      o.master.copy_(param);
    }
    if constexpr (k8bit) {
      // Zero codes with zero block scales are the zero state (absmax 0 decodes every code to 0).
      o.m = state_zeros(n, torch::kUInt8, false);
      o.v = state_zeros(n, torch::kUInt8, false);
      // Blocks start at each segment's first element (one group's elements under one absmax).
      int64_t blocks = 0;
      for (const Segment& s : o.segments) blocks += kernels::state_blocks(s.len);
      o.m_absmax = state_zeros(blocks, torch::kFloat32, false);
      o.v_absmax = state_zeros(blocks, torch::kFloat32, false);
    } else {
      o.m = state_zeros(n, torch::kFloat32, false);
      o.v = state_zeros(n, torch::kFloat32, false);
    }
    // The gradient travels in its own dtype (bf16: half the PCIe bytes of fp32); the CPU AdamW widens it.
    if (kOffload) o.host_grad = state_zeros(n, grad_dtype_, true);
    if (kOffload && device_.is_cuda()) o.host_sumsq = state_zeros(1, torch::kFloat64, true);
  }

  void broadcast(torch::Tensor& t) { broadcast_inplace(*comm_, t, 0); }

  void add_replicated_group(std::vector<std::pair<std::string, torch::Tensor>> params) {
    rep_ = std::make_unique<Replicated>();
    rep_->flat = FlatParams(std::move(params), world_, align_elems());
    torch::Tensor flat = rep_->flat.flat();
    broadcast(flat);
    if (opt_.gradient_buffers == GradientBuffers::kept) attach_replicated_grads();
    if constexpr (kStage == 0) {
      set_segments(rep_->own, rep_->flat, 0, flat.numel());
      make_owned(rep_->own, flat, kFp32Accum ? rep_->acc_full : rep_->flat.grad());
      seed_master(rep_->own, rep_->flat, 0);
    } else {
      // The full gradient buffer is kept anyway: reduce-scatter in place into this rank's slice of it.
      set_segments(rep_->own, rep_->flat, int64_t(rank_) * rep_->flat.shard(), rep_->flat.shard());
      const torch::Tensor& g = kFp32Accum ? rep_->acc_full : rep_->flat.grad();  // undefined until backward, unless kept
      make_owned(rep_->own, rep_->flat.shard_of(flat, rank_), g.defined() ? rep_->flat.shard_of(g, rank_) : torch::Tensor());
      seed_master(rep_->own, rep_->flat, int64_t(rank_) * rep_->flat.shard());
    }
  }

  // Stages 0-1: the full gradient buffer (and the fp32 accumulator with mixed-precision accumulation), attached as
  // the parameters' .grad: when the trainer is built (kept) or at a window's first backward (at_backward).
  void attach_replicated_grads() {
    auto& flat = rep_->flat;
    if (!flat.grad().defined()) flat.attach_grads();
    if (kFp32Accum && !rep_->acc_full.defined())
      rep_->acc_full = torch::zeros({flat.padded()}, flat.options().dtype(torch::kFloat32));
    point_own_grad();
  }
  // The partition's gradient is (this rank's slice of) the buffer the update reads.
  void point_own_grad() {
    const torch::Tensor& g = kFp32Accum ? rep_->acc_full : rep_->flat.grad();
    rep_->own.grad = kStage == 0 ? g : rep_->flat.shard_of(g, rank_);
  }
  // GradientBuffers::after_backward: backward leaves one gradient per parameter, made as activations are freed (as
  // torch's set_to_none does). After backward they move into the flat buffers (the fp32 accumulator at each
  // micro-batch; the compute-type buffer at the window's end, where float gradients accumulated in place in .grad),
  // which live until the update (at_backward too with an fp32 accumulator: plan::effective_gradient_buffers).
  GradientBuffers effective_gradient_buffers() const { return plan::effective_gradient_buffers(opt_.gradient_buffers, kFp32Accum); }
  // at_backward: attached before the window's first backward, which then adds into it (its activations are all
  // alive, so this is the lower peak only where they are fewer bytes than the buffer: plan::best_gradient_buffers).
  void attach_at_backward() {
    if (rep_ && effective_gradient_buffers() == GradientBuffers::at_backward && !rep_->flat.grad().defined())
      attach_replicated_grads();
  }
  void collect_replicated_grads(bool boundary) {
    auto& flat = rep_->flat;
    if (kFp32Accum) flat.move_grads_into(rep_->acc_full, torch::kFloat32);
    else if (boundary) flat.collect_grads();
    else return;
    point_own_grad();
  }
  void release_replicated_grads() {
    if (opt_.gradient_buffers == GradientBuffers::kept || !rep_) return;
    rep_->flat.release_grads();
    rep_->acc_full = torch::Tensor();
    rep_->own.grad = torch::Tensor();
  }

  // opt_.master_init: the fp32 master of partition o (elements [begin, begin + o.master.numel()) of layout's
  // flat buffer) takes the float values each parameter was rounded from.
  void seed_master(Partition& o, const FlatParams& layout, int64_t begin) {
    if constexpr (kMaster) {
      if (!opt_.master_init || !o.master.defined()) return;
      torch::NoGradGuard ng;
      const int64_t end = begin + o.master.numel();
      for (const FlatEntry& e : layout.entries()) {
        torch::Tensor w = opt_.master_init(e.name);
        TORCH_CHECK(w.defined(), "make_trainer: master_init returned no tensor for '", e.name, "'");
        TORCH_CHECK(w.numel() == e.numel && w.sizes().vec() == e.shape, "make_trainer: master_init('", e.name, "') has shape ",
                    w.sizes(), "; the parameter has ", c10::IntArrayRef(e.shape));
        TORCH_CHECK(w.is_floating_point(), "make_trainer: master_init('", e.name, "') is ", w.scalar_type(), ", not floating point");
        w = w.detach().to(torch::kFloat32).contiguous().view({-1});
        if (world_ > 1) {  // rank 0's values, as the parameters were broadcast (device_ buffers suit the communicator)
          w = w.to(device_);
          broadcast(w);
        }
        const int64_t lo = std::max(begin, e.offset), hi = std::min(end, e.offset + e.numel);
        if (lo >= hi) continue;
        const torch::Tensor part = w.narrow(0, lo - e.offset, hi - lo);
        TORCH_CHECK(torch::equal(part.to(o.param.device(), o.param.scalar_type()), o.param.narrow(0, lo - begin, hi - lo)),
                    "make_trainer: master_init('", e.name, "') does not round to the parameter's ", o.param.scalar_type(),
                    " values: pass the float values the module was converted from");
        o.master.narrow(0, lo - begin, hi - lo).copy_(part);
      }
    }
  }

  // Stage 2/3: buckets of about bucket_bytes in reverse registration order (backward finishes the last
  // layers first); inside a bucket the parameters keep their order. Every bucket is padded for its own shards.
  void add_buckets(std::vector<std::pair<std::string, torch::Tensor>> params) {
    std::vector<std::vector<std::pair<std::string, torch::Tensor>>> groups;
    int64_t bytes = 0;
    for (auto it = params.rbegin(); it != params.rend(); ++it) {
      const int64_t b = int64_t(it->second.nbytes());
      if (groups.empty() || bytes + b > opt_.bucket_bytes) groups.emplace_back(), bytes = 0;
      groups.back().push_back(*it);
      bytes += b;
    }
    for (auto& g : groups) {
      std::reverse(g.begin(), g.end());
      auto b = std::make_unique<detail::Bucket>();
      b->flat = FlatParams(std::move(g), world_, align_elems());
      torch::Tensor flat = b->flat.flat();
      broadcast(flat);
      set_segments(b->own, b->flat, int64_t(rank_) * b->flat.shard(), b->flat.shard());
      make_owned(b->own, b->flat.shard_of(flat, rank_), torch::zeros({b->flat.shard()}, flat.options().dtype(grad_dtype_)));
      seed_master(b->own, b->flat, int64_t(rank_) * b->flat.shard());
      for (auto& e : b->flat.entries()) {
        e.param.mutable_grad().reset();
        torch::autograd::impl::set_post_acc_grad_hooks(e.param, std::make_unique<detail::BucketHook>(b.get(), &e, state_.get()));
      }
      buckets_.push_back(std::move(b));
    }
  }

  // Stage 3's gather units (train/stage3.hpp): the modules TrainerOptions::gather_unit names, or by default those
  // deriving from GatherUnit and the blocks of an nn::Blocks.
  std::vector<std::string> gather_unit_names() const {
    std::vector<std::string> units;
    for (const auto& item : module_->named_modules()) {
      const torch::nn::Module& m = *item.value();
      if (opt_.gather_unit ? opt_.gather_unit(item.key(), m) : dynamic_cast<const GatherUnit*>(&m) != nullptr)
        units.push_back(item.key());
      if (!opt_.gather_unit && dynamic_cast<const nn::BlocksImpl*>(&m) != nullptr)
        for (const auto& c : m.named_children()) units.push_back(item.key().empty() ? c.key() : item.key() + "." + c.key());
    }
    return units;
  }
  // The outermost unit holding layer `name`, or the layer itself.
  static std::string unit_of(const std::vector<std::string>& units, const std::string& name) {
    const std::string* best = nullptr;
    for (const auto& u : units)
      if ((u.empty() || name == u || (name.size() > u.size() && name.starts_with(u) && name[u.size()] == '.')) &&
          (best == nullptr || u.size() < best->size()))
        best = &u;
    return best ? *best : name;
  }

  // One gather unit: its layers' trainable parameters in one flat layout, sharded; each layer attached to it.
  void add_stage3_group(const std::string& name, const std::vector<std::pair<std::string, Shardable*>>& layers,
                        std::unordered_set<const void*>& sharded) {
    std::vector<std::pair<std::string, torch::Tensor>> params;
    std::vector<std::size_t> first;  // each layer's first entry
    for (const auto& [layer, s] : layers) {
      first.push_back(params.size());
      for (auto& [pname, p] : s->shardable_parameters()) params.emplace_back(layer + "." + pname, p);
    }
    auto g = std::make_unique<Stage3Group>();
    g->name = name.empty() ? "model" : name;
    g->members = int(layers.size());
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
    auto own = std::make_unique<Partition>();
    set_segments(*own, g->layout, int64_t(rank_) * g->layout.shard(), g->layout.shard());
    make_owned(*own, g->shard.detach(), g->grad_shard);
    seed_master(*own, g->layout, int64_t(rank_) * g->layout.shard());
    if (offload_) {
      Partition* p = own.get();
      OffloadPipeline* pipe = offload_.get();
      detail::GradState* st = state_.get();
      g->before_gather = [pipe, p] { pipe->wait(*p); };
      g->update_landed = [pipe, p] { return pipe->finished(*p); };
      if (pipe->threaded())
        g->grad_done = [pipe, p, st] {
          if (st->final_micro) pipe->gradient_ready(*p, st->eager);
        };
    }
    runtime_->add_group(*g);
    for (std::size_t i = 0; i < layers.size(); ++i) {
      layers[i].second->attach(g.get(), first[i]);
      attached_.push_back(layers[i].second);
    }
    own3_.push_back(std::move(own));
    groups3_.push_back(std::move(g));
  }

  // Offload<Host>: the worker's order among queued jobs (Partition::priority), the order the next forward needs the
  // partitions: replicated and bucketed ones first (the step waits for them), then stage-3 layers in the forward
  // order the runtime recorded (until it has, in the order the layers were registered).
  void rank_offload_jobs() {
    if (!offload_) return;
    offload_->wait_all();  // no job is queued while the priorities change: the worker reads them
    int64_t rank = 0;
    if (rep_) rep_->own.priority = rank++;
    for (auto& b : buckets_) b->own.priority = rank++;
    const int64_t seen = runtime_ ? int64_t(runtime_->forward_order_size()) : 0;
    for (std::size_t i = 0; i < own3_.size(); ++i) {
      const auto pos = runtime_ ? runtime_->forward_position(*groups3_[i]) : std::nullopt;
      own3_[i]->priority = rank + (pos ? int64_t(*pos) : seen + int64_t(i));
    }
    ranked_by_forward_ = own3_.empty() || (runtime_ && runtime_->forward_order_final());
  }

  void begin_micro_step(bool boundary) {
    state_->final_micro = boundary;
    state_->eager = {};
    if (micro_ == 0) state_->reduce_scatter_bytes = 0;
    for (auto& b : buckets_) b->pending = int(b->flat.entries().size()), b->reduced = false;
    if constexpr (kOffload && kStage >= 2) {
      // Eager: nothing global can change this step's update (no clipping, no loss scale), so each partition
      // is updated as soon as its gradient is on the host.
      if (boundary && offload_->threaded() && !(opt_.max_grad_norm > 0) && !S::loss_scaling && !window_weighted_) {
        // One worker runs the jobs: from the first non-finite partition it takes on, nothing is updated. The flag
        // is this window's own: the window's last updates may still run while the next window begins.
        auto non_finite = std::make_shared<std::atomic<bool>>(false);
        state_->eager = [non_finite, upd = host_update(coeffs_for_next_step(), 1.0f, 1.0f)](Partition& p) {
          if (!std::isfinite(p.sumsq)) *non_finite = true;
          if (!*non_finite) upd(p);
        };
      }
    }
    last_eager_ = bool(state_->eager);
    if (boundary)
      for (Partition* p : partitions()) p->submitted = false;
  }

  void after_backward(bool boundary) {
    if (rep_) {
      auto& flat = rep_->flat;
      if (effective_gradient_buffers() == GradientBuffers::after_backward) {
        collect_replicated_grads(boundary);
      } else if (kFp32Accum) {
        rep_->acc_full.add_(flat.grad());
        flat.zero_grad();
      }
      if (boundary) {
        const torch::Tensor src = kFp32Accum ? rep_->acc_full : flat.grad();
        if constexpr (kStage == 0) all_reduce_inplace(*comm_, src, comm::ReduceOp::avg);
        else reduce_scatter_avg(*comm_, src, rep_->own.grad);  // in place: own.grad is this rank's slice of src
      }
    }
    // Buckets that did not complete in backward (parameters without a gradient; or thread-ranks on one
    // GPU, which reduce everything here), in bucket order on every rank.
    for (auto& b : buckets_)
      if (!b->reduced) detail::reduce_bucket(*b, *state_);
    if (!buckets_.empty() && collectives_->active()) {
      // The buckets' reductions ran on the side stream: the update reads their shards on this one. A failed or
      // timed-out collective throws here.
      wait_current(device_, collectives_->record());
      comm_->synchronize(collectives_->handle());
    }
    if (boundary) {
      last_window_rs_bytes_ = state_->reduce_scatter_bytes;
      // Offload: every partition not yet handed over (all of them when not overlapping) goes now, in order.
      if (offload_)
        for (Partition* p : partitions())
          if (!p->submitted) offload_->gradient_ready(*p, state_->eager);
    }
  }

  std::vector<Partition*> partitions() {
    std::vector<Partition*> p;
    if (rep_) p.push_back(&rep_->own);
    for (auto& b : buckets_) p.push_back(&b->own);
    for (auto& o : own3_) p.push_back(o.get());
    return p;
  }

  // The global sum of squares of the reduced gradients (scaled), identical on every rank. Device partitions are
  // summed on the device in the same order and association as the host's doubles (so the same bits) and read back
  // once: one host sync per optimizer step, not one per partition.
  double global_sum_squares() {
    const bool on_device = !kOffload && !device_.is_cpu();
    const auto f64 = torch::TensorOptions().dtype(torch::kFloat64).device(device_);
    if constexpr (kStage == 0) {
      // Same association as stage 1: per rank-sized chunk, chunks in rank order.
      const torch::Tensor& g = rep_->own.grad;
      const int64_t shard = rep_->flat.shard();
      if (on_device) {
        torch::Tensor total = torch::zeros({}, f64);
        for (int r = 0; r < world_; ++r) total.add_(sum_squares_tensor(g.narrow(0, int64_t(r) * shard, shard)));
        return total.item<double>();
      }
      double total = 0;
      for (int r = 0; r < world_; ++r) {
        const double part = detail::sum_squares(g.narrow(0, int64_t(r) * shard, shard));
        total = r == 0 ? part : total + part;
      }
      return total;
    } else {
      // Where the communicator takes buffers: device memory for NCCL.
      torch::Tensor t;
      if (on_device) {
        t = torch::zeros({1}, f64);
        for (Partition* o : partitions()) t.add_(sum_squares_tensor(o->grad));
      } else {
        double local = 0;
        // Offload: each partition's sum of its host copy's values (summed on the device with the copy, or by the
        // worker from the copy: the same way whether overlapped or not).
        for (Partition* o : partitions()) local += kOffload ? offload_->gradient_sum_squares(*o) : detail::sum_squares(o->grad);
        if (world_ == 1) return local;
        t = torch::full({1}, local, f64);
      }
      if (world_ > 1) all_reduce_inplace(*comm_, t, comm::ReduceOp::sum);
      return t.item<double>();
    }
  }

  // One set of AdamW coefficients per parameter group (index: Segment::group).
  GroupCoeffs coeffs_for_next_step() const {
    GroupCoeffs cs;
    for (const GroupSetting& g : group_settings_)
      cs.push_back(kernels::adamw_coeffs(adamw_.lr * g.lr_scale, adamw_.beta1, adamw_.beta2, adamw_.eps,
                                         g.weight_decay < 0 ? adamw_.weight_decay : g.weight_decay, applied_ + 1));
    return cs;
  }

  // Which group each trainable parameter is in (TrainerOptions::param_groups, then the default rule).
  void assign_groups(const std::vector<std::pair<std::string, torch::Tensor>>& trainable) {
    std::unordered_set<std::string> embeddings;
    for (const auto& m : module_->named_modules())
      if (is_embedding(*m.value())) embeddings.insert(m.key().empty() ? "weight" : m.key() + ".weight");
    group_settings_ = {{1.0f, -1.0f}, {1.0f, 0.0f}};  // 0: AdamW's settings, 1: no decay (norms, biases, embeddings)
    for (const ParamGroup& g : opt_.param_groups) {
      TORCH_CHECK(bool(g.match), "make_trainer: a parameter group has no match function");
      TORCH_CHECK(g.lr_scale >= 0 && std::isfinite(g.lr_scale), "make_trainer: a parameter group's lr_scale must be >= 0, got ", g.lr_scale);
      group_settings_.push_back({g.lr_scale, g.weight_decay});
    }
    for (const auto& [name, p] : trainable) {
      int gi = -1;
      for (std::size_t i = 0; i < opt_.param_groups.size() && gi < 0; ++i)
        if (opt_.param_groups[i].match(name)) gi = int(i) + 2;
      if (gi < 0) gi = !opt_.decay_norms_biases_embeddings && (p.dim() <= 1 || embeddings.count(name)) ? 1 : 0;
      group_of_[name] = gi;
    }
  }
  // The segments of a partition (elements [begin, begin + n) of layout's flat buffer) that share a group: each
  // entry's range runs to the next entry's offset, so alignment gaps (zeros, which no update changes) join it.
  void set_segments(Partition& o, const FlatParams& layout, int64_t begin, int64_t n) {
    o.segments = state_segments(layout.entries(), layout.padded(), begin, n, [this](const FlatEntry& e) { return group_of_.at(e.name); });
  }

  // The CPU AdamW of one offloaded partition: fp32 master, m, v and the host gradient copy. When the
  // gradient is in the (16-bit) compute dtype, the rounded new parameters overwrite it element by element
  // (each element's gradient is read before its parameter is written), so the upload moves half the bytes
  // of the fp32 master and needs no conversion on the device.
  static OffloadPipeline::Fn host_update(GroupCoeffs c, float inv_scale, float clip) {
    return [c, inv_scale, clip](Partition& p) {
      const kernels::AdamWDynamic d{&inv_scale, nullptr, &clip, nullptr};
      if constexpr (kMaster) {
        if (p.host_grad.scalar_type() == p.param.scalar_type()) {
          Param* staged = reinterpret_cast<Param*>(p.host_grad.data_ptr());
          adamw_on_host<Param, Param>(p, staged, p.master.data_ptr<float>(), staged, c, d);
          p.staged = true;
          return;
        }
      }
      if (p.host_grad.scalar_type() == torch::kFloat32)
        adamw_on_host<float, float>(p, p.master.data_ptr<float>(), nullptr, p.host_grad.data_ptr<float>(), c, d);
      else
        adamw_on_host<float, Param>(p, p.master.data_ptr<float>(), nullptr, reinterpret_cast<const Param*>(p.host_grad.data_ptr()), c, d);
    };
  }

  void finish_window(StepResult& r) {
    // Offload: the norm needs every partition's gradient copy (global_sum_squares waits for each), not the eager
    // updates, which go on beside the next forward (each stage-3 gather waits for its own partition).
    const float inv_scale = float((1.0 / double(r.scale)) * (window_weighted_ ? token_weighting_factor() : 1.0));
    float norm = 0, clip = 1, found_inf = 0;
    kernels::grad_norm_finalize(global_sum_squares(), kernels::NormType::L2, opt_.max_grad_norm, &inv_scale,
                                {&norm, &clip, &found_inf});
    r.grad_norm = norm;
    const bool eager = bool(state_->eager);
    state_->eager = {};
    if (found_inf != 0) {
      // Some rank's shard overflowed: everyone saw the same global sum, so everyone skips.
      if (offload_) offload_->wait_all();  // the jobs that saw it have stopped updating
      ++skipped_;
      if constexpr (S::dynamic_loss_scaling) {
        *scaler_.found_inf() = 1.0f;
        scaler_.update();
      }
      if (eager) gather_replicated();  // updated buckets stay updated (see the header): keep ranks consistent
      zero_window();
      r.applied = false;
      return;
    }
    const auto coeffs = coeffs_for_next_step();
    if constexpr (kOffload) {
      if (!eager)
        for (Partition* o : partitions()) offload_->update(*o, host_update(coeffs, inv_scale, clip));
      // Replicated parameters are used by the next forward without a hook: wait for them here. Stage-3
      // layers are waited for by their next gather.
      if (rep_) offload_->wait(rep_->own);
      for (auto& b : buckets_) offload_->wait(b->own);
    } else {
      const kernels::AdamWDynamic dyn{&inv_scale, nullptr, &clip, nullptr};
      for (Partition* o : partitions()) update(*o, coeffs, dyn, inv_scale * clip);
    }
    ++applied_;
    if constexpr (S::dynamic_loss_scaling) scaler_.update();
    gather_replicated();
    zero_window();
    r.applied = true;
  }

  // Stages 1-2 (and stage 3's whole-kept parameters): everyone gets the updated shards back.
  void gather_replicated() {
    if (rep_ && kStage >= 1) {
      auto& flat = rep_->flat;
      gather_into(*comm_, flat.shard_of(flat.flat(), rank_), flat.flat());  // in place
    }
    for (auto& b : buckets_) gather_into(*comm_, b->flat.shard_of(b->flat.flat(), rank_), b->flat.flat());
  }

  void zero_window() {
    if (rep_) {
      rep_->flat.zero_grad();
      if (rep_->acc_full.defined()) rep_->acc_full.zero_();
    }
    if constexpr (!kOffload)  // offloaded gradient shards were zeroed right after their host copy
      for (Partition* o : partitions())
        if (o->grad.defined()) o->grad.zero_();
    release_replicated_grads();
  }

  // The CPU AdamW on one partition's host state (fp32 or 8-bit moments): param [n] (P), master [n] or null, grad [n],
  // segment by segment (their groups' coefficients; 8-bit segments start on a state block, see align_elems).
  template <class P, class G>
  static void adamw_on_host(Partition& p, P* param, float* master, const G* grad, const GroupCoeffs& cs,
                            const kernels::AdamWDynamic& d) {
    for (const Segment& s : p.segments) {
      const int64_t o = s.begin, n = s.len;
      float* mo = master ? master + o : nullptr;
      if constexpr (k8bit) {
        const int64_t b = s.block;
        const kernels::AdamW8Tensor<P, G> t{param + o, mo, grad + o, p.m.data_ptr<std::uint8_t>() + o, p.m_absmax.data_ptr<float>() + b,
                                            p.v.data_ptr<std::uint8_t>() + o, p.v_absmax.data_ptr<float>() + b, n};
        kernels::adamw8_cpu(t, cs[std::size_t(s.group)], d);
      } else {
        const kernels::AdamWTensor<P, G> t{param + o, mo, grad + o, p.m.data_ptr<float>() + o, p.v.data_ptr<float>() + o, n};
        kernels::adamw_cpu(t, cs[std::size_t(s.group)], d);
      }
    }
  }

  template <class G>
  void adamw_host(Partition& o, const GroupCoeffs& c, const kernels::AdamWDynamic& d) {
    adamw_on_host<Param, G>(o, reinterpret_cast<Param*>(o.param.data_ptr()),
                              kMaster ? o.master.template data_ptr<float>() : nullptr,
                              reinterpret_cast<const G*>(o.grad.data_ptr()), c, d);
  }

  void update(Partition& o, const GroupCoeffs& cs, const kernels::AdamWDynamic& d, float gmul) {
    if (o.param.is_cpu()) {
      if (o.grad.scalar_type() == torch::kFloat32) adamw_host<float>(o, cs, d);
      else adamw_host<Param>(o, cs, d);
      return;
    }
    torch::NoGradGuard ng;
#if defined(__CUDACC__)
    if constexpr (k8bit) update_device8(o, cs, d);
    else update_torch_ops(o, cs, gmul);
#else
    update_torch_ops(o, cs, gmul);
#endif
  }

  // Device buffers from a host-compiled TU: the same math in torch ops (an nvcc TU could launch
  // kernels/adamw.cuh instead; it does for 8-bit state).
  // Elementwise, so chunking changes no bit; it bounds the temporaries to one chunk. 8-bit: segments start on
  // a state block of their own and kDeviceChunk is a multiple of one, so each chunk's blocks are its own.
  void update_torch_ops(Partition& o, const GroupCoeffs& cs, float gmul) {
    for (const Segment& seg : o.segments)
      for (int64_t off = seg.begin; off < seg.begin + seg.len; off += detail::kDeviceChunk) {
        const auto& c = cs[std::size_t(seg.group)];
        const int64_t len = std::min(detail::kDeviceChunk, seg.begin + seg.len - off);
        auto part = [&](const torch::Tensor& t) { return t.narrow(0, off, len); };
        const torch::Tensor g = part(o.grad).to(torch::kFloat32) * gmul;
        torch::Tensor w = part(kMaster ? o.master : o.param);
        if constexpr (k8bit) {
          auto blocks = [&](const torch::Tensor& t) {
            return t.narrow(0, seg.block + (off - seg.begin) / kernels::kStateBlock, kernels::state_blocks(len));
          };
          if (!maps_.m.value.defined()) maps_ = detail::state_maps(device_);
          detail::adamw8_torch_ops(w, g, part(o.m), blocks(o.m_absmax), part(o.v), blocks(o.v_absmax), maps_, c);
        } else {
          torch::Tensor m = part(o.m), v = part(o.v);
          detail::adamw_torch_ops(w, m, v, g, c);
        }
        if (kMaster) part(o.param).copy_(w);
      }
  }

#if defined(__CUDACC__)
  // 8-bit state on the device, an nvcc TU: the CUDA kernel per segment (its group's coefficients; blocks start at
  // each segment), reading the inverse loss scale and clip coefficient from a 2-float device copy of d's values.
  void update_device8(Partition& o, const GroupCoeffs& cs, const kernels::AdamWDynamic& d) {
    const float values[2] = {d.inv_scale ? *d.inv_scale : 1.0f, d.clip_coef ? *d.clip_coef : 1.0f};
    const torch::Tensor dyn = torch::from_blob(const_cast<float*>(values), {2}, torch::kFloat32).to(device_);
    const bool fp32_grad = o.grad.scalar_type() == torch::kFloat32;
    for (const Segment& seg : o.segments) {
      auto part = [&](const torch::Tensor& t) { return t.narrow(0, seg.begin, seg.len); };
      auto blocks = [&](const torch::Tensor& t) { return t.narrow(0, seg.block, kernels::state_blocks(seg.len)); };
      const torch::Tensor master = kMaster ? part(o.master) : torch::Tensor();
      const auto& c = cs[std::size_t(seg.group)];
      if (fp32_grad)
        detail::adamw8_device_update<Param, float>(part(o.param), master, part(o.grad), part(o.m), blocks(o.m_absmax), part(o.v),
                                                   blocks(o.v_absmax), dyn, c);
      else
        detail::adamw8_device_update<Param, Param>(part(o.param), master, part(o.grad), part(o.m), blocks(o.m_absmax), part(o.v),
                                                   blocks(o.v_absmax), dyn, c);
    }
  }
#endif

  struct GroupSetting {
    float lr_scale, weight_decay;  // weight_decay < 0: AdamW's
  };

  // Declaration order = reverse destruction order: the offload worker stops before what it points to goes.
  std::shared_ptr<torch::nn::Module> module_;
  AdoptedModel adopted_;
  std::vector<GroupSetting> group_settings_;
  std::unordered_map<std::string, int> group_of_;
  bool window_weighted_ = false;  // this window's micro-batches pass token counts
  int64_t window_tokens_ = 0;     // their sum on this rank
  int64_t token_ref_ = 0;         // token weighting's reference count (agreed_token_reference)
  O adamw_;
  comm::CommPtr comm_;
  TrainerOptions opt_;
  kernels::LossScaler scaler_;
  float static_scale_ = 1.0f;
  int rank_ = 0, world_ = 1;
  torch::ScalarType compute_dtype_, grad_dtype_;
  torch::Device device_{torch::kCPU};
  std::unique_ptr<SideStream> collectives_;  // the collectives' side stream (stage 3's gathers, buckets' reductions)
  std::unique_ptr<detail::GradState> state_;
  std::unique_ptr<Stage3Runtime> runtime_;
  std::unique_ptr<Replicated> rep_;
  std::vector<std::unique_ptr<detail::Bucket>> buckets_;
  std::vector<std::unique_ptr<Stage3Group>> groups3_;
  std::pair<const Stage3Group*, torch::Tensor> last_gathered_;  // gather_parameter's layer
  std::vector<std::unique_ptr<Partition>> own3_;
  std::vector<Shardable*> attached_;
  std::unique_ptr<OffloadPipeline> offload_;
  int micro_ = 0;
  int64_t applied_ = 0, skipped_ = 0;
  int64_t last_window_rs_bytes_ = 0;
  bool last_eager_ = false;
  bool ranked_by_forward_ = false;  // Partition::priority follows the recorded forward order
  detail::StateMaps maps_;  // 8-bit state on the device: the signed (m) and unsigned (v) maps
};

// module: a torch::nn::ModuleHolder (e.g. an `MLP` from TORCH_MODULE) or a shared_ptr to a Module.
template <StrategyType S, class M, AdamWHyperparameters O>
auto make_trainer(M& module, O adamw, comm::CommPtr comm, TrainerOptions opt = {}) {
  std::shared_ptr<torch::nn::Module> m;
  if constexpr (requires { module.ptr(); }) m = module.ptr();
  else m = module;
  return Trainer<S, O>(std::move(m), adamw, std::move(comm), opt);
}

}  // namespace squeeze::train

namespace squeeze {
using train::make_trainer;
using train::MemoryReport;
using train::MemoryUse;
using train::ParamGroup;
using train::StepResult;
using train::TrainerOptions;
}  // namespace squeeze
