#pragma once
// make_trainer<Strategy>(module, adamw, comm): data-parallel training with ZeRO stages 0-3, Offload<Host>, gradient
// accumulation, loss scaling, global-norm clipping and memory accounting, composed of the parts the Strategy picks
// (train/parts/parts.hpp). What each stage does, when, and the bitwise guarantees between them:
// docs/architecture.md ("One training step", "The trainer's parts").
//
//   auto comm    = squeeze::comm::from_env();
//   auto trainer = squeeze::make_trainer<Strategy<Sharded<Stage2>, Accumulate<4>, Precision<bf16, float>>>(
//                      model, AdamW{.lr = 3e-4f, .weight_decay = 0.1f}, comm, {.max_grad_norm = 1.0f});
//   for (auto& batch : loader) {                 // one call per micro-batch
//     auto r = trainer.step([&] { return model->loss(batch); });
//     if (r.applied) log(r.loss, r.grad_norm, r.scale);
//   }
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "squeeze/comm/communicator.hpp"
#include "squeeze/plan/memory.hpp"
#include "squeeze/policy/strategy.hpp"
#include "squeeze/policy/strategy_name.hpp"
#include "squeeze/train/adopt.hpp"
#include "squeeze/train/options.hpp"
#include "squeeze/train/parts/parts.hpp"
#include "squeeze/engine/memory_info.hpp"
#include "squeeze/engine/torch_types.hpp"
#include "squeeze/kernels/grad_norm.hpp"

namespace squeeze::train {

template <StrategyType S, AdamWHyperparameters O>
class Trainer {
  using Parts = TrainerParts<S>;

 public:
  using strategy = S;
  using Compute = typename TrainTypes<S>::Compute;
  using Param = typename TrainTypes<S>::Param;
  static_assert(S::training, "make_trainer needs a training Strategy: remove Inference (an inference model needs no trainer)");

  Trainer(std::shared_ptr<torch::nn::Module> module, O adamw, comm::CommPtr comm, TrainerOptions opt = {})
      : module_(std::move(module)), adamw_(adamw) {
    TORCH_CHECK(module_ != nullptr, "make_trainer: module is null");
    TORCH_CHECK(comm != nullptr, "make_trainer: communicator is null");
    opt = resolve(adamw, std::move(opt));
    TORCH_CHECK(opt.align_bytes >= 1, "make_trainer: align_bytes must be >= 1");
    TORCH_CHECK(opt.bucket_bytes >= 1, "make_trainer: bucket_bytes must be >= 1");
    TORCH_CHECK(!std::isnan(opt.max_grad_norm), "make_trainer: max_grad_norm is NaN (use 0 for no clipping)");
    // Validate the AdamW hyper-parameters now, not at the first boundary.
    (void)kernels::adamw_coeffs(adamw_.lr, adamw_.beta1, adamw_.beta2, adamw_.eps, adamw_.weight_decay, 1);
    ctx_ = std::make_unique<TrainContext>();
    TrainContext& c = *ctx_;
    c.comm = std::move(comm);
    c.rank = c.comm->rank();
    c.world = c.comm->size();
    c.compute_dtype = torch_dtype<Param>();
    c.grad_dtype = TrainTypes<S>::kFp32Accum ? torch::kFloat32 : c.compute_dtype;
    c.opt = std::move(opt);
    if constexpr (S::graphed) c.opt.gradient_buffers = GradientBuffers::kept;  // the graph adds into fixed buffers

    refuse_beyond_device_memory();
    if constexpr (S::offload_to_host) refuse_beyond_host_memory();
    // The module as built (float, or already in the compute type) becomes what S trains: layers adopted,
    // parameters converted; the float values seed the masters (train/adopt.hpp).
    AdoptedModel adopted = adopt_model<S>(*module_, AdoptOptions{c.opt.replicate, c.opt.device, c.opt.prefetch_depth});
    recomputable_ = adopted.recomputable > 0;
    if constexpr (S::stream_frozen_base) frozen_home_ = nn::frozen_home(*module_);
    if (!c.opt.master_init && !adopted.float_values.empty()) {
      c.opt.master_init = [&adopted](const std::string& name) {
        auto it = adopted.float_values.find(name);
        TORCH_CHECK(it != adopted.float_values.end(), "make_trainer: no float value kept for '", name, "'");
        return it->second;
      };
    }
    NamedTensors trainable;
    for (auto& item : module_->named_parameters(/*recurse=*/true)) {
      if (!item.value().requires_grad()) continue;
      TORCH_CHECK(item.value().scalar_type() == c.compute_dtype, "make_trainer: parameter '", item.key(), "' is ",
                  item.value().scalar_type(), " but the Strategy trains it in ", c.compute_dtype);
      trainable.emplace_back(item.key(), item.value());
    }
    TORCH_CHECK(!trainable.empty(), "make_trainer: the module has no trainable parameters");
    std::unordered_set<std::string> embeddings;
    for (const auto& m : module_->named_modules())
      if (is_embedding(*m.value())) embeddings.insert(m.key().empty() ? "weight" : m.key() + ".weight");
    c.groups = ParamGroups(c.opt, trainable, embeddings);
    // Where the model trains: a trainable parameter's device (streamed units may still be on the host here: the
    // first one that is not, else TrainerOptions::device).
    c.device = trainable.front().second.device();
    for (const auto& [name, p] : trainable)
      if (!p.is_cpu()) {
        c.device = p.device();
        break;
      }
    if (c.device.is_cpu() && c.opt.device && !c.opt.device->is_cpu())
      c.device = c.opt.device->has_index() ? *c.opt.device : torch::Device(c.opt.device->type(), 0);
    if (c.world > 1) {
      TORCH_CHECK(!c.device.is_cuda() || c.comm->device_buffers(), "make_trainer: the module is on ", c.device, " but the '",
                  c.comm->backend(),
                  "' communicator takes host buffers only; LocalComm takes CUDA memory when its TU is "
                  "compiled by nvcc or with SQUEEZE_WITH_CUDA_RUNTIME=1 (link CUDA::cudart); or use NcclComm");
      TORCH_CHECK(c.device.is_cuda() || c.comm->host_buffers(), "make_trainer: the module is on the CPU but the '", c.comm->backend(),
                  "' communicator takes device buffers only: move the module to its GPU");
    }
    c.collectives = std::make_unique<SideStream>(asynchronous_collectives(c.device, *c.comm) ? SideStream(c.device) : SideStream());
    c.grads.comm = c.comm;
    c.grads.collectives = c.collectives.get();
    c.grads.device = c.device;
    // Thread-ranks sharing one GPU cannot meet in a collective inside backward: libtorch runs every CUDA
    // backward of the process on one worker thread per device. Their buckets are reduced after backward.
    c.grads.defer = c.device.is_cuda() && c.world > 1 && c.comm->backend() == "local";

    parts_ = std::make_unique<PartsHeld>(c, *module_, std::move(trainable));
    if constexpr (S::stage >= 2) c.grads.shard_bytes = parts_->sync.shard_bytes();
    rank_jobs();
    c.opt.master_init = nullptr;  // used only while building: what it refers to goes now
  }

  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
  // Everything hooks, callbacks and the offload worker point to lives behind unique_ptrs: a move keeps it in place.
  Trainer(Trainer&&) = default;
  Trainer& operator=(Trainer&&) = delete;

  // One micro-batch. closure() returns the micro-batch's scalar loss (graph attached).
  StepResult step(const std::function<torch::Tensor()>& closure) {
    static_assert(!S::graphed,
                  "Graphed replays the step from input buffers the trainer keeps: call step(batch, closure), the "
                  "closure reading the tensors it is given");
    return run_micro_batch(
        {}, [&](const StepInputs&) { return closure(); }, 0);
  }
  // Token-weighted accumulation: the micro-batch's loss (its mean over `tokens` targets) weighs tokens / (the
  // window's tokens on all ranks) instead of 1 / (accumulation steps x ranks), so the window's gradient is that of
  // one big batch whatever the micro-batches' sizes. Every micro-batch of a window passes its count, or none does.
  StepResult step(const std::function<torch::Tensor()>& closure, int64_t tokens) {
    static_assert(!S::graphed, "Graphed replays a fixed loss weight: token-weighted accumulation cannot be graphed; remove Graphed");
    TORCH_CHECK(tokens >= 1, "Trainer::step: tokens must be >= 1 (the micro-batch's target count), got ", tokens);
    return run_micro_batch(
        {}, [&](const StepInputs&) { return closure(); }, tokens);
  }
  // One micro-batch of `batch`'s tensors: closure(inputs) returns its scalar loss, reading `inputs` (batch itself, or
  // under Graphed the trainer's copies of it, of the same shapes every call).
  StepResult step(const StepInputs& batch, const std::function<torch::Tensor(const StepInputs&)>& closure) {
    return run_micro_batch(batch, closure, 0);
  }
  // Graphed: how many micro-batches ran eagerly before the capture, and whether the graph exists.
  int eager_micro_batches() const { return parts_->launch.eager_runs(); }
  bool graph_captured() const { return parts_->launch.captured(); }

 private:
  // forward -> backward -> synchronise -> (at the window's end) update.
  StepResult run_micro_batch(const StepInputs& batch, const std::function<torch::Tensor(const StepInputs&)>& closure, int64_t tokens) {
    auto& sync = parts_->sync;
    auto& state = parts_->state;
    auto& window = parts_->window;
    StepResult r;
    last_gathered_ = {};  // the step changes the weights
    r.scale = parts_->scale.scale();
    const auto mb = window.begin(tokens, *ctx_->comm, ctx_->device);
    begin_micro_step(mb.boundary);

    const double loss_weight = double(r.scale) * mb.weight;
    Pass pass{&sync, &parts_->checkpoints};  // stage 3 gathers from here; freed if the closure or backward throws
    r.loss_value = parts_->launch.run(batch, loss_weight, [&](const StepInputs& inputs) {
      torch::Tensor loss = forward([&] { return closure(inputs); });  // [] this micro-batch's mean loss, graph attached
      sync.begin_backward();                                          // stage 3: the forward order is known from here on
      if (!ranked_by_forward_) rank_jobs();
      (loss * loss_weight).backward();
      return loss.detach().to(torch::kFloat32).reshape({});
    });
    pass.end();
    r.loss = ctx_->opt.read_loss ? r.loss_value.item<float>() : std::nanf("");  // after backward: no stall between them

    sync.after_backward(mb.boundary);  // synchronise (stages 2-3 reduced most of it during backward)
    if (mb.boundary) state.gradients_final(sync.partitions());
    window.end(mb.boundary);
    r.step = applied_;
    if (!mb.boundary) return r;
    r.boundary = true;
    update(r);
    r.step = applied_;
    r.transfers = transfers_since_boundary();
    return r;
  }

  // The pipeline's and the streamed units' counters since the last boundary.
  TransferCounters transfers_since_boundary() {
    TransferCounters now;
    const OffloadStats o = parts_->state.stats();
    now.d2h_bytes = o.d2h_bytes;
    now.h2d_bytes = o.h2d_bytes;
    now.host_update_s = o.sum_squares_s + o.update_s;
    now.host_wait_s = o.transfer_wait_s;
    parts_->checkpoints.add_transfers(now);
    if (frozen_home_) now.h2d_bytes += frozen_home_->stats().h2d_bytes;  // the streamed quantized base's blocks
    if constexpr (S::stream_params) {
      const StreamStats st = parts_->sync.stream_stats();
      now.h2d_bytes += st.h2d_bytes;
      now.h2d_copy_s = st.h2d_copy_s;
      now.copy_wait_s = st.wait_s;
    }
    return now - std::exchange(transfers_, now);
  }

  // One forward and backward: the sync part's pass (stage 3's gathers) and the checkpoints it kept, aborted if it does
  // not end.
  struct Pass {
    typename Parts::GradientSync* sync;
    typename Parts::Checkpoints* checkpoints;
    void end() {
      std::exchange(sync, nullptr)->end_backward();
      checkpoints->end_pass();
    }
    ~Pass() {
      if (!sync) return;
      sync->abort_pass();
      checkpoints->end_pass();
    }
  };

  void begin_micro_step(bool boundary) {
    auto& sync = parts_->sync;
    ctx_->grads.final_micro = boundary;
    if (parts_->window.micro() == 0) ctx_->grads.reduce_scatter_bytes = 0;
    sync.begin_micro_step(boundary);
    // Nothing global can change this window's update (no clipping, loss scale or token weighting) where gradients
    // are final partition by partition during backward: an offloaded update may start as each one lands.
    const bool global_free =
        Parts::GradientSync::hands_over_in_backward && !(ctx_->opt.max_grad_norm > 0) && !S::loss_scaling && !parts_->window.weighted();
    parts_->state.begin_micro_step(boundary, global_free, ctx_->groups.coeffs(adamw_, applied_ + 1));
    if (boundary)
      for (Partition* p : sync.partitions()) p->submitted = false;
  }

  // The user's forward, with the Strategy's recomputation switched on (nn::checkpoint reads it).
  torch::Tensor forward(const std::function<torch::Tensor()>& closure) {
    parts_->sync.begin_forward();
    nn::RecomputeScope recompute(S::checkpoint_every);
    auto kept = parts_->checkpoints.scope();  // CheckpointOffload<Host>: the segments' inputs go to host memory
    torch::Tensor loss = closure();
    if constexpr (S::checkpoint_every > 0) {
      TORCH_CHECK(recomputable_ || recompute.recomputed(),
                  "make_trainer: the Strategy is Checkpointed but the model recomputed nothing: run its blocks through "
                  "squeeze::nn::Blocks, or call squeeze::nn::checkpoint(block, x) in its forward (or drop Checkpointed)");
      recomputable_ = true;  // checked once
    }
    TORCH_CHECK(loss.defined() && loss.numel() == 1, "Trainer::step: the closure must return a scalar loss, got ",
                loss.defined() ? loss.sizes() : torch::IntArrayRef{});
    TORCH_CHECK(loss.requires_grad(), "Trainer::step: the loss does not require grad (computed under NoGradGuard?)");
    return loss;
  }

  // The window's end: the global norm decides skip or clip, then AdamW on this rank's partitions (offloaded updates
  // may already have run as gradients landed), then the parameters other ranks updated come back.
  void update(StepResult& r) {
    auto& sync = parts_->sync;
    auto& state = parts_->state;
    const float inv_scale = float((1.0 / double(r.scale)) * parts_->window.token_factor(*ctx_->comm, ctx_->device));
    if constexpr (Parts::OptimizerState::decides_on_device && !S::loss_scaling) {
      if (!ctx_->opt.read_loss && ctx_->device.is_cuda()) {  // nothing read back: the decisions stay on the device
        const torch::Tensor dyn = state.apply_deciding_on_device(sync.partitions(), ctx_->groups.coeffs(adamw_, applied_ + 1),
                                                                 sync.device_sum_squares(), inv_scale, ctx_->opt.max_grad_norm, applied_);
        r.grad_norm_value = dyn.narrow(0, 3, 1).reshape({});
        ++applied_;  // as far as the host knows: a step the device skipped is counted when the counters are read
        device_counts_ = true;
        end_window(r, /*applied=*/true, /*gather=*/true);
        return;
      }
    }
    float norm = 0, clip = 1, found_inf = 0;
    kernels::grad_norm_finalize(sync.sum_squares(state), kernels::NormType::L2, ctx_->opt.max_grad_norm, &inv_scale,
                                {&norm, &clip, &found_inf});
    r.grad_norm = norm;
    const bool eager = state.take_eager();
    if (found_inf != 0) {  // some rank's shard overflowed: everyone saw the same global sum, so everyone skips
      state.skip();
      ++skipped_;
      parts_->scale.overflowed();
      end_window(r, /*applied=*/false, /*gather=*/eager);  // partitions updated during backward stay updated: keep ranks consistent
      return;
    }
    state.apply(sync.partitions(), ctx_->groups.coeffs(adamw_, applied_ + 1), inv_scale, clip, eager);
    ++applied_;
    parts_->scale.applied();
    end_window(r, /*applied=*/true, /*gather=*/true);
  }

  // Every way out of update: the parameters other ranks updated come back, the window's gradients are zeroed.
  void end_window(StepResult& r, bool applied, bool gather) {
    if (gather) parts_->sync.gather_updated();
    parts_->sync.zero_window(Parts::OptimizerState::zeroes_gradients);
    r.applied = applied;
  }

  // Offload<Host>: the worker's order among queued jobs, the order the next forward needs the partitions.
  void rank_jobs() {
    parts_->state.rank_jobs(parts_->sync);
    ranked_by_forward_ = parts_->sync.ranked_by_forward();
  }

 public:
  float scale() const { return parts_->scale.scale(); }
  // Where the device decided (read_loss off), the first read after a step syncs with it: a step whose gradients were not
  // finite was skipped there.
  int64_t steps_applied() const {
    take_device_counts();
    return applied_;
  }
  int64_t steps_skipped() const {
    take_device_counts();
    return skipped_;
  }
  // Micro-batches stepped in the current accumulation window (0 at a boundary).
  int micro_step() const { return parts_->window.micro(); }
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
    TORCH_CHECK(micro_step() == 0, "Trainer::set_gradient_buffers: called at micro-batch ", micro_step() + 1, " of ", S::accumulation_steps,
                "; change it between optimizer steps, when no window has begun");
    TORCH_CHECK(!S::graphed || g == GradientBuffers::kept,
                "Trainer::set_gradient_buffers: Graphed keeps the gradient buffers (its "
                "CUDA graph adds into fixed ones), got ",
                plan::to_string(g));
    const GradientBuffers was = ctx_->opt.gradient_buffers;
    if (g == was) return;
    ctx_->opt.gradient_buffers = g;
    parts_->sync.gradient_buffers_changed(was);
  }
  // Resuming from a checkpoint whose parameters and optimizer state were copied in: AdamW's bias correction
  // continues from `steps_applied`; the dynamic loss scale (ignored for a static or no scale) and its clean
  // steps since the last change come back as they were saved.
  void restore_counters(int64_t steps_applied, float loss_scale, int64_t good_steps, int64_t skipped = 0) {
    TORCH_CHECK(skipped >= 0, "Trainer::restore_counters: skipped must be >= 0, got ", skipped);
    TORCH_CHECK(steps_applied >= 0, "Trainer::restore_counters: steps_applied must be >= 0, got ", steps_applied);
    sync();  // no offloaded update may land after the counters changed
    parts_->scale.restore(loss_scale, good_steps);
    applied_ = steps_applied;
    skipped_ = skipped;
    if constexpr (Parts::OptimizerState::decides_on_device) parts_->state.forget_device_steps();
    device_counts_ = false;
  }
  const kernels::LossScaler& loss_scaler() const { return parts_->scale.scaler(); }
  comm::Communicator& communicator() { return *ctx_->comm; }
  // Stage 2/3 buckets: bytes that entered gradient reduce-scatters in the last finished window.
  int64_t reduce_scatter_bytes() const { return parts_->sync.reduce_scatter_bytes(); }
  // Offload<Host>: whether the last boundary updated partitions during backward (HostAdamW).
  bool updated_during_backward() const { return parts_->state.updated_during_backward(); }
  // Offload<Host>: host time of the pipeline since the last reset (see OffloadStats); zeros otherwise.
  OffloadStats offload_stats() const { return parts_->state.stats(); }
  void reset_offload_stats() {
    parts_->state.reset_stats();
    transfers_ = {};
    if constexpr (S::stream_params) parts_->sync.reset_stream_stats();
  }
  // Waits for Offload<Host> work still in flight (step() may return before the last updates of stage 3 land).
  void sync() { parts_->state.wait_all(); }
  torch::nn::Module& module() { return *module_; }
  const TrainerOptions& options() const { return ctx_->opt; }

  // Stage 3: gathers every sharded layer back into its module's own parameters and detaches it (a collective). The
  // trainer must not step afterwards. (Destroying the trainer detaches the layers without restoring them: their
  // emptied weights then fail loudly in forward.)
  void restore_module() {
    sync();
    parts_->sync.restore_module();
  }

  // Full values of every trainable parameter by name (gathers stage-3 shards: a collective, every rank
  // must call it). For checkpoints and tests.
  std::vector<std::pair<std::string, torch::Tensor>> full_parameters() {
    sync();
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (const PartitionView& v : parts_->sync.views()) {
      if (!v.sharded) {
        for (auto& e : v.layout->entries()) out.emplace_back(e.name, e.param.detach().clone());
        continue;
      }
      const torch::Tensor full = gather_full(v);
      for (auto& e : v.layout->entries()) out.emplace_back(e.name, FlatParams::view(full, e).clone());
    }
    return out;
  }

  // Full values of one trainable parameter (a copy). Under stage 3 this gathers only the unit that holds it, so a
  // caller walking the parameters layer by layer (an export) holds one unit gathered at a time; the last unit
  // gathered is kept for the next call. A collective under stage 3: every rank asks for the same names in order.
  torch::Tensor gather_parameter(const std::string& name) {
    sync();
    for (const PartitionView& v : parts_->sync.views())
      for (auto& e : v.layout->entries()) {
        if (e.name != name) continue;
        if (!v.sharded) return e.param.detach().clone();
        if (last_gathered_.first != v.state) {
          last_gathered_.second = torch::Tensor();  // one unit gathered at a time
          last_gathered_ = {v.state, gather_full(v)};
        }
        return FlatParams::view(last_gathered_.second, e).clone();
      }
    TORCH_CHECK(false, "gather_parameter: '", name,
                "' is not a trainable parameter of this trainer (frozen parameters stay in the module)");
    return {};
  }
  // Drops the unit gather_parameter keeps (after an export; the next step would make it stale).
  void release_gathered() { last_gathered_ = {}; }

  // Whether `name` is a trainable parameter the trainer holds (load_parameter / gather_parameter take it).
  bool has_parameter(const std::string& name) const { return ctx_->groups.group_of.count(name) != 0; }

  // Sets trainable parameter `name` to `value` (its full shape, any float dtype, any device): the parameter in the
  // compute dtype and, where it has one, its fp32 master from `value` itself (a bf16 file gives exact masters; an
  // fp32 one keeps its extra bits). Under stages 1-3 each rank writes only the part it owns, so a loader streaming a
  // checkpoint tensor by tensor fills stage-3 shards without a full copy of the model anywhere. Not a collective:
  // every rank passes the same full value. Adam moments are left as they are (zero before the first step).
  void load_parameter(const std::string& name, const torch::Tensor& value) {
    sync();
    release_gathered();
    TORCH_CHECK(value.defined() && value.is_floating_point(), "load_parameter: the value for '", name, "' must be a floating-point tensor");
    for (const PartitionView& v : parts_->sync.views())
      for (const FlatEntry& e : v.layout->entries()) {
        if (e.name != name) continue;
        TORCH_CHECK(value.sizes().vec() == e.shape, "load_parameter: '", name, "' is ", c10::IntArrayRef(e.shape), " but the value is ",
                    value.sizes());
        torch::NoGradGuard ng;
        const torch::Tensor flat = value.detach().contiguous().view({-1});
        if (!v.sharded) e.param.detach().copy_(flat.view(e.param.sizes()));  // stages 0-2: every rank holds the full value
        Partition& o = *v.state;
        const int64_t begin = v.begin, end = begin + o.param.numel();
        const int64_t lo = std::max(begin, e.offset), hi = std::min(end, e.offset + e.numel);
        if (lo >= hi) return;
        const torch::Tensor part = flat.narrow(0, lo - e.offset, hi - lo);
        if (v.sharded) o.param.narrow(0, lo - begin, hi - lo).copy_(part);
        if (o.master.defined()) o.master.narrow(0, lo - begin, hi - lo).copy_(part);
        return;
      }
    TORCH_CHECK(false, "load_parameter: '", name, "' is not a trainable parameter of this trainer (frozen parameters stay in the module)");
  }

  // Optimizer state per partition (whole-kept groups first, then stage-3 units): {master, m, v}, fp32; with 8-bit
  // state {master, m, v, m_absmax, v_absmax}: m, v uint8 codes [n], their block scales fp32 [ceil(n / 256)] (names:
  // optimizer_state_names()). master is undefined where the parameter is its own master (float compute, no
  // offload). Views, not copies: copying saved values into them restores the state.
  std::vector<std::vector<torch::Tensor>> optimizer_state() {
    sync();
    std::vector<std::vector<torch::Tensor>> out;
    for (Partition* o : parts_->sync.partitions()) {
      if constexpr (TrainTypes<S>::k8bit)
        out.push_back({o->master, o->m, o->v, o->m_absmax, o->v_absmax});
      else
        out.push_back({o->master, o->m, o->v});
    }
    return out;
  }
  static std::vector<std::string> optimizer_state_names() {
    if constexpr (TrainTypes<S>::k8bit)
      return {"master", "m", "v", "m_absmax", "v_absmax"};
    else
      return {"master", "m", "v"};
  }
  // Where each optimizer_state() partition sits: its flat layout (parameter names, offsets, shapes) and the index
  // of its first element in that layout's flat buffer (this rank's shard; 0 for stage 0's whole buffer).
  std::vector<std::pair<const FlatParams*, int64_t>> partition_layouts() const {
    std::vector<std::pair<const FlatParams*, int64_t>> out;
    for (const PartitionView& v : parts_->sync.views()) out.emplace_back(v.layout, v.begin);
    return out;
  }
  // One optimizer partition as a checkpoint stores it (train/checkpoint.hpp): its flat layout, whether every rank
  // holds all of it (stage 0's replicated buffer) or its own shard, and its buffers. Views: copying values into
  // them restores them (then share_loaded_parameters()).
  struct PartitionBuffers {
    std::string key;           // "replicated", "bucket<i>" or the stage-3 unit's name: unique within the trainer
    const FlatParams* layout;  // parameter names, shapes and offsets of the flat buffer the partition cuts
    int64_t align;             // the layout's alignment in elements
    bool whole;                // stage 0: the buffers hold the whole padded layout on every rank
    std::vector<std::pair<std::string, torch::Tensor>> elementwise;  // one element per parameter element: param, master, m, v
    std::vector<std::pair<std::string, torch::Tensor>> blockwise;    // 8-bit state: m_absmax, v_absmax (one per 256-element block)
    std::vector<int> groups;  // each layout entry's parameter group (its 8-bit blocks start at each group's run)
  };
  std::vector<PartitionBuffers> partition_buffers() {
    sync();
    std::vector<PartitionBuffers> out;
    for (const PartitionView& v : parts_->sync.views()) {
      const Partition& o = *v.state;
      PartitionBuffers b{v.key, v.layout, ctx_->align_elems(), v.whole, {}, {}, {}};
      for (const auto& e : v.layout->entries()) b.groups.push_back(ctx_->groups.group_of.at(e.name));
      b.elementwise.emplace_back("param", o.param.detach());
      if (o.master.defined()) b.elementwise.emplace_back("master", o.master);
      b.elementwise.emplace_back("m", o.m);
      b.elementwise.emplace_back("v", o.v);
      if constexpr (TrainTypes<S>::k8bit) b.blockwise = {{"m_absmax", o.m_absmax}, {"v_absmax", o.v_absmax}};
      out.push_back(std::move(b));
    }
    return out;
  }
  // After a checkpoint's values were copied into partition_buffers(): stages 1-2 give every rank the parameters
  // the other ranks own (a collective).
  void share_loaded_parameters() {
    sync();
    torch::NoGradGuard no_grad;
    parts_->sync.gather_updated();
  }

  // Bytes held now by this rank, per category (communication: the largest transient buffers seen).
  MemoryUse memory() const {
    MemoryUse m;
    parts_->sync.add_memory(m, Parts::OptimizerState::on_host);
    parts_->checkpoints.add_memory(m);
    if (frozen_home_) {  // the streamed quantized base: its blocks in host memory, the slots on the device
      const FrozenUnitStats f = frozen_home_->stats();
      m.parameters.host += f.host_bytes;
      m.parameters.device += f.device_bytes;
    }
    return m;
  }
  // Actual bytes beside the planner's prediction for the same shapes.
  MemoryReport memory_report(const plan::ModelShape& shape, const plan::TrainShape& train) const {
    return {memory(), plan::plan_memory<S>(shape, train, ctx_->world)};
  }

 private:
  // TrainerOptions::planned_step: refuses, before adopting the module, a step planned beyond the device's memory.
  void refuse_beyond_device_memory() const {
    const TrainContext& c = *ctx_;
    if (!c.opt.planned_step) return;
    std::optional<int64_t> available = c.opt.available_device_bytes;
    if (!available && c.opt.device) available = device_memory_total(*c.opt.device);
    if (!available) return;  // unknown: nothing to compare with
    const plan::MemoryPlan p = plan::plan_memory<S>(c.opt.planned_step->model, c.opt.planned_step->train, c.world);
    const int64_t need = p.peak().device;
    if (need <= *available) return;
    const plan::TrainShape& t = c.opt.planned_step->train;
    TORCH_CHECK(false, "make_trainer: ", strategy_name<S>(), " plans ", gigabytes(need), " on the device for micro-batches of ",
                t.micro_batch, " x ", t.seq, " tokens (parameters ", gigabytes(p.parameters.device), ", activations ",
                gigabytes(p.activations.device), ", the rest ", gigabytes(need - p.parameters.device - p.activations.device), ") but ",
                gigabytes(*available),
                c.opt.available_device_bytes ? " is allowed (TrainerOptions::available_device_bytes)" : " is the device's total", ": ",
                gigabytes(need - *available), " short. Use a smaller micro-batch or sequence, Checkpointed",
                S::stage >= 3 ? ", Offload<Host, Streamed> (the parameters in host memory)" : ", Sharded<Stage3> with Offload<Host>",
                ", CheckpointOffload<Host> or QuantizedState<8>");
  }

  // Offload<Host>: refuses, before allocating, host state (and streamed parameters) beyond what the host can give.
  // A module built on the host for a GPU trainer gives its host tensors back once built (moved to the device, the
  // float values kept only until the masters are seeded): they count as available.
  void refuse_beyond_host_memory() const {
    const TrainContext& c = *ctx_;
    int64_t elements = 0, returned = 0;
    const bool to_device = c.opt.device && !c.opt.device->is_cpu();
    for (const auto& p : module_->parameters(/*recurse=*/true)) {
      if (p.requires_grad()) elements += p.numel();
      if (to_device && p.is_cpu()) returned += int64_t(p.nbytes());
    }
    const HostStateBytes per = host_state_bytes<S>(c.compute_dtype, c.grad_dtype);
    const int64_t mine = (elements + c.world - 1) / c.world;  // this rank's share
    const int64_t need = per.bytes(mine);
    std::optional<int64_t> available = c.opt.available_host_bytes;
    if (!available && (available = host_memory_available())) *available += returned;
    if (!available || need <= *available) return;  // unknown: nothing to compare with
    TORCH_CHECK(false, "make_trainer: ", strategy_name<S>(), " needs ", gigabytes(need), " of host memory on this rank (", per.describe(),
                ", ", mine, " elements) but ", gigabytes(*available),
                c.opt.available_host_bytes ? " is allowed (TrainerOptions::available_host_bytes)"
                                           : " is available (MemAvailable, with the module's own host tensors)",
                ": ", gigabytes(need - *available),
                " short. Write QuantizedState<8> (2 bytes of moments per element instead of 8), shard over more ranks",
                S::stream_params ? ", keep the parameters on the device (Offload<Host>)," : ",", " or free host memory");
  }

  // Merges the clipping / loss-scale knobs of the AdamW options into the trainer options.
  static TrainerOptions resolve(const O& adamw, TrainerOptions opt) {
    if constexpr (requires { float(adamw.max_grad_norm); }) {
      if (adamw.max_grad_norm > 0) {
        TORCH_CHECK(!(opt.max_grad_norm > 0), "make_trainer: max_grad_norm is set both in the AdamW options (", adamw.max_grad_norm,
                    ") and in TrainerOptions (", opt.max_grad_norm, "): set it once");
        opt.max_grad_norm = adamw.max_grad_norm;
      }
    }
    if constexpr (requires { kernels::LossScaleOptions(adamw.loss_scale); }) {
      if (!opt.loss_scale) opt.loss_scale = adamw.loss_scale;
    }
    if (!opt.loss_scale) opt.loss_scale = kernels::LossScaleOptions{};
    return opt;
  }

  // A sharded partition's whole flat buffer [padded], gathered from every rank's shard (a collective).
  torch::Tensor gather_full(const PartitionView& v) {
    auto full = torch::empty({v.layout->padded()}, v.state->param.options().device(ctx_->device).requires_grad(false));
    gather_into(*ctx_->comm, v.state->param.to(ctx_->device), full);  // streamed units' shards are in host memory
    return full;
  }

  // The parts, built in order (the state first: the sync part allocates each partition's state through it) and
  // torn down after the offload worker is idle (nothing it runs points to a partition being destroyed).
  struct PartsHeld {
    typename Parts::OptimizerState state;
    typename Parts::GradientSync sync;
    typename Parts::Scale scale;
    typename Parts::Window window;
    typename Parts::Checkpoints checkpoints;
    typename Parts::StepLaunch launch;
    PartsHeld(TrainContext& c, torch::nn::Module& module, NamedTensors trainable)
        : state(c), sync(c, state, module, std::move(trainable)), scale(*c.opt.loss_scale), checkpoints(c), launch(c.device) {}
    ~PartsHeld() {
      try {
        state.wait_all();
      } catch (...) {  // a failed update was reported by step(); nothing to do here
      }
    }
  };

  // Declaration order = reverse destruction order: the parts go before the context they point into.
  std::shared_ptr<torch::nn::Module> module_;
  O adamw_;
  std::unique_ptr<TrainContext> ctx_;
  std::unique_ptr<PartsHeld> parts_;
  std::pair<const Partition*, torch::Tensor> last_gathered_;  // gather_parameter's unit
  // Optimizer steps applied and skipped. mutable: where the device decides, the host's counts catch up with its own when
  // read (take_device_counts).
  mutable int64_t applied_ = 0, skipped_ = 0;
  mutable bool device_counts_ = false;  // steps were decided on the device since the counts were last taken
  void take_device_counts() const {
    if constexpr (Parts::OptimizerState::decides_on_device) {
      if (!device_counts_) return;
      const int64_t applied = parts_->state.device_steps();
      skipped_ += applied_ - applied;
      applied_ = applied;
      device_counts_ = false;
    }
  }
  bool recomputable_ = false;                 // Checkpointed: the model recomputes (checked at the first step)
  std::shared_ptr<FrozenUnits> frozen_home_;  // Offload<Host, Streamed> on a quantized base: where its blocks live
  bool ranked_by_forward_ = false;            // Partition::priority follows the recorded forward order
  TransferCounters transfers_;                // the counters' totals at the last boundary
};

// module: a torch::nn::ModuleHolder (e.g. an `MLP` from TORCH_MODULE) or a shared_ptr to a Module.
template <StrategyType S, class M, AdamWHyperparameters O>
auto make_trainer(M& module, O adamw, comm::CommPtr comm, TrainerOptions opt = {}) {
  std::shared_ptr<torch::nn::Module> m;
  if constexpr (requires { module.ptr(); })
    m = module.ptr();
  else
    m = module;
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
