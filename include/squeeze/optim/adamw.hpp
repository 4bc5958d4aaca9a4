#pragma once
// AdamW over flat buffers, driven by a Strategy: the optimizer layer above squeeze/kernels.
//
//   using S = Strategy<Sharded<Stage1>, Offload<Host>, Precision<bf16, float>, Accumulate<4>>;
//   optim::FlatAdamW<S> opt(AdamW{.lr = 3e-4f, .weight_decay = 0.1f, .max_grad_norm = 1.0f});
//   opt.add_group(params, grads, n);                      // a flat buffer [n] and its gradient buffer [n]
//   opt.add_group(norms, norm_grads, k, {.weight_decay = 0.f});
//   for each micro-batch: backward into grads; opt.accumulate(tokens_i / tokens_total);
//   opt.step();
//
// What the Strategy decides (at compile time):
//   Precision<C, M>    params/grads are C; C != float keeps an fp32 master copy here (M must be float then).
//   Accumulate<N>      N > 1: fp32 accumulation buffers live here, accumulate() adds each micro-batch
//                      (weight = its share of the tokens, see kernels/accumulate.hpp) and step() needs N calls.
//   loss scaling       Precision<half, ...> (or DynamicLossScale): a dynamic scaler; step() checks for
//                      inf/NaN in the same pass as the norm and skips the update on overflow.
//   Offload<Host>      every buffer handed in is host memory and the CPU AdamW runs (all cores);
//                      otherwise device memory and the CUDA kernels (this header must then be compiled by nvcc).
// Sharding is the caller's business: hand in this rank's shard of each flat buffer.
// A step's order: [grad norm + overflow check] -> AdamW (unscale, clip, skip fused) -> step count -> scale update.
// On the device none of it syncs with the host; on the host the applied flag is known at once.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "squeeze/error.hpp"
#include "squeeze/kernels/accumulate.hpp"
#include "squeeze/kernels/adamw.hpp"
#include "squeeze/kernels/grad_norm.hpp"
#include "squeeze/kernels/loss_scale.hpp"
#include "squeeze/policy/strategy.hpp"

#if defined(__CUDACC__)
#include "squeeze/kernels/accumulate.cuh"
#include "squeeze/kernels/adamw.cuh"
#include "squeeze/kernels/grad_norm.cuh"
#include "squeeze/kernels/loss_scale.cuh"
#endif

namespace squeeze {

// AdamW's runtime knobs (an aggregate: AdamW{.lr = 3e-4f, .weight_decay = 0.1f}). Defaults are PyTorch's.
struct AdamW {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;
  float max_grad_norm = 0.0f;                // > 0: clip the global L2 gradient norm to this
  kernels::LossScaleOptions loss_scale = {};  // used when the Strategy scales the loss
};

inline void validate(const AdamW& o) {
  (void)kernels::adamw_coeffs(o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, 1);  // throws naming the bad knob
  kernels::check_max_norm(o.max_grad_norm);
  kernels::validate(o.loss_scale);
}

namespace optim {

using AdamW = squeeze::AdamW;  // the same options, spelled from the optim namespace

// Per-group overrides (negative: use the optimizer's value).
struct GroupOptions {
  float lr_scale = 1.0f;       // this group's lr = AdamW::lr * lr_scale
  float weight_decay = -1.0f;  // e.g. 0 for norms and biases
};

// What a step did. `applied` is known on the host backend; on the device it would need a sync, so it is
// empty there (read loss_scale() / applied_steps() when you want to know, they sync).
struct StepResult {
  std::optional<bool> applied;
};

namespace detail {

template <class T>
struct HostArray {
  std::vector<T> v;
  void resize(std::int64_t n) { v.resize(std::size_t(n)); }
  T* data() { return v.data(); }
};

#if defined(__CUDACC__)
template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  ~DeviceArray() {
    if (p_) cudaFree(p_);
  }
  void resize(std::int64_t n) {
    check(p_ == nullptr, "DeviceArray: resized twice");
    if (n > 0) SQUEEZE_CUDA_CHECK(cudaMalloc(&p_, std::size_t(n) * sizeof(T)));
  }
  T* data() { return p_; }

 private:
  T* p_ = nullptr;
};
#endif

template <class>
inline constexpr bool always_false = false;

}  // namespace detail

template <StrategyType St>
class FlatAdamW {
 public:
  using param_type = typename St::compute_type;  // params and backward's gradients
  static constexpr bool on_host = St::offload_to_host;
  static constexpr int accumulation_steps = St::accumulation_steps;
  static constexpr bool accumulates = accumulation_steps > 1;
  static constexpr bool scales_loss = St::dynamic_loss_scaling;
  static constexpr bool has_master = !std::is_same_v<param_type, float>;
  // The gradient the update reads: the fp32 accumulation buffer, or backward's gradient directly.
  using step_grad_type = std::conditional_t<accumulates, float, param_type>;

  static_assert(St::training, "FlatAdamW trains: remove Inference from the Strategy");
  static_assert(std::is_same_v<typename St::master_type, float> || std::is_same_v<param_type, float>,
                "FlatAdamW keeps fp32 master weights for half/bf16 params: write Precision<bf16, float> or Precision<half, float>");
  static_assert(St::state_bits == 32, "FlatAdamW keeps fp32 Adam moments; for 8-bit state (Quantized<8, Blockwise8>) use train::Trainer (make_trainer) or kernels::adamw8_cpu / adamw8_cuda");
  static_assert(!St::loss_scaling || St::dynamic_loss_scaling,
                "FlatAdamW implements dynamic loss scaling; for a fixed scale use DynamicLossScale with a huge growth_interval");
#if !defined(__CUDACC__)
  static_assert(on_host || detail::always_false<St>,
                "FlatAdamW on the device runs CUDA kernels: compile this translation unit with nvcc (a .cu file), or add "
                "Offload<Host> (with Sharded<StageN>) to run the CPU AdamW");
#endif

  explicit FlatAdamW(const AdamW& options
#if defined(__CUDACC__)
                     ,
                     cudaStream_t stream = nullptr
#endif
                     )
      : opt_(options)
#if defined(__CUDACC__)
        ,
        stream_(stream)
#endif
  {
    validate(opt_);
    if constexpr (scales_loss && on_host) host_scaler_.emplace(opt_.loss_scale);
#if defined(__CUDACC__)
    if constexpr (!on_host) dev_.init(opt_, scales_loss, stream_);
#endif
  }
  FlatAdamW(const FlatAdamW&) = delete;
  FlatAdamW& operator=(const FlatAdamW&) = delete;

  // Registers a flat parameter buffer params[n] and its gradient buffer grads[n] (host pointers with
  // Offload<Host>, device pointers otherwise). The fp32 master copy is initialised from params; m, v = 0.
  // Returns the group's index.
  int add_group(param_type* params, const param_type* grads, std::int64_t n, const GroupOptions& g = {}) {
    const std::string what = "FlatAdamW::add_group(group " + std::to_string(groups_.size()) + ")";
    check(n > 0, what + ": n must be > 0, got " + std::to_string(n));
    check(params != nullptr, what + ": params pointer is null");
    check(grads != nullptr, what + ": grads pointer is null");
    check(g.lr_scale >= 0 && std::isfinite(g.lr_scale), what + ": lr_scale must be finite and >= 0");
    check(std::isnan(g.weight_decay) == false, what + ": weight_decay is NaN");
    check(micro_ == 0, what + ": cannot add groups in the middle of an accumulation window");
    Group& gr = groups_.emplace_back();
    gr.params = params;
    gr.grads = grads;
    gr.n = n;
    gr.options = g;
    gr.m.resize(n);
    gr.v.resize(n);
    if constexpr (has_master) gr.master.resize(n);
    if constexpr (accumulates) gr.acc.resize(n);
    if constexpr (on_host) {
      std::fill(gr.m.v.begin(), gr.m.v.end(), 0.f);
      std::fill(gr.v.v.begin(), gr.v.v.end(), 0.f);
      if constexpr (has_master)
        for (std::int64_t i = 0; i < n; ++i) gr.master.v[std::size_t(i)] = to_float(params[i]);
    } else {
#if defined(__CUDACC__)
      SQUEEZE_CUDA_CHECK(cudaMemsetAsync(gr.m.data(), 0, std::size_t(n) * sizeof(float), stream_));
      SQUEEZE_CUDA_CHECK(cudaMemsetAsync(gr.v.data(), 0, std::size_t(n) * sizeof(float), stream_));
      if constexpr (has_master) {
        // master = float(params): the accumulate kernel with scale 1 is exactly that cast.
        SQUEEZE_CUDA_CHECK(kernels::accumulate_cuda(kernels::AccumTensor<param_type>{gr.master.data(), params, n}, 1.0f, true, stream_));
      }
#endif
    }
    tables_dirty_ = true;
    return int(groups_.size()) - 1;
  }

  // Accumulate<N>: adds every group's current gradients into its fp32 buffer with `weight` (the
  // micro-batch's share of the step's tokens; default 1/N). Call once per micro-batch, N times per step.
  void accumulate(float weight = 1.0f / float(accumulation_steps)) {
    static_assert(accumulates, "accumulate() is for Accumulate<N> with N > 1; with N = 1 step() reads the gradients directly");
    check(!groups_.empty(), "FlatAdamW::accumulate: no parameter groups (call add_group first)");
    check(micro_ < accumulation_steps, "FlatAdamW::accumulate: already " + std::to_string(micro_) + " micro-batches of " +
                                           std::to_string(accumulation_steps) + " this step; call step()");
    const bool first = micro_ == 0;
    if constexpr (on_host) {
      for (auto& g : groups_) kernels::accumulate_cpu(kernels::AccumTensor<param_type>{g.acc.data(), g.grads, g.n}, weight, first);
    } else {
#if defined(__CUDACC__)
      build_tables();
      SQUEEZE_CUDA_CHECK(kernels::accumulate_cuda(dev_.accum_table.view(), weight, first, stream_));
#endif
    }
    ++micro_;
  }

  // One optimizer step over every group.
  StepResult step() {
    check(!groups_.empty(), "FlatAdamW::step: no parameter groups (call add_group first)");
    if constexpr (accumulates)
      check(micro_ == accumulation_steps, "FlatAdamW::step: Accumulate<" + std::to_string(accumulation_steps) + "> needs " +
                                              std::to_string(accumulation_steps) + " accumulate() calls per step, got " +
                                              std::to_string(micro_));
    micro_ = 0;
    if constexpr (on_host) return host_step();
#if defined(__CUDACC__)
    else return device_step();
#else
    else return {};  // unreachable: the class-level static_assert rejects device strategies without nvcc
#endif
  }

  // Loss scale to multiply the loss by before backward (1 without loss scaling). Syncs on the device.
  float loss_scale() const {
    if constexpr (!scales_loss) return 1.0f;
    else if constexpr (on_host) return host_scaler_->scale();
#if defined(__CUDACC__)
    else return dev_.scaler->scale(stream_);
#endif
  }
  // Steps applied so far (skipped overflow steps do not count). Syncs on the device.
  std::int64_t applied_steps() const {
    if constexpr (on_host) return applied_;
#if defined(__CUDACC__)
    else {
      std::int64_t h = 0;
      SQUEEZE_CUDA_CHECK(cudaMemcpyAsync(&h, dev_.step.data(), sizeof h, cudaMemcpyDeviceToHost, stream_));
      SQUEEZE_CUDA_CHECK(cudaStreamSynchronize(stream_));
      return h;
    }
#endif
  }
  // The last step's clip coefficient (1 when not clipping). Syncs on the device.
  float last_clip_coef() const {
    if constexpr (on_host) return clip_;
#if defined(__CUDACC__)
    else {
      float h = 1;
      SQUEEZE_CUDA_CHECK(cudaMemcpyAsync(&h, dev_.scalars.data(), sizeof h, cudaMemcpyDeviceToHost, stream_));
      SQUEEZE_CUDA_CHECK(cudaStreamSynchronize(stream_));
      return h;
    }
#endif
  }

  void set_lr(float lr) {
    (void)kernels::adamw_coeffs(lr, opt_.beta1, opt_.beta2, opt_.eps, opt_.weight_decay, 1);
    opt_.lr = lr;
  }
  const AdamW& options() const { return opt_; }
  int groups() const { return int(groups_.size()); }
  // fp32 master weights of a group (host or device pointer); for float params, the params themselves.
  const float* master(int group) {
    Group& g = groups_.at(std::size_t(group));
    if constexpr (has_master) return g.master.data();
    else return g.params;
  }
  const float* exp_avg(int group) { return groups_.at(std::size_t(group)).m.data(); }
  const float* exp_avg_sq(int group) { return groups_.at(std::size_t(group)).v.data(); }

 private:
#if defined(__CUDACC__)
  template <class T>
  using Array = std::conditional_t<on_host, detail::HostArray<T>, detail::DeviceArray<T>>;
#else
  template <class T>
  using Array = detail::HostArray<T>;
#endif

  struct Group {
    param_type* params = nullptr;
    const param_type* grads = nullptr;
    std::int64_t n = 0;
    GroupOptions options;
    Array<float> master, m, v, acc;
  };

  const step_grad_type* step_grads(Group& g) {
    if constexpr (accumulates) return g.acc.data();
    else return g.grads;
  }
  kernels::AdamWTensor<param_type, step_grad_type> tensor(Group& g) {
    float* master = nullptr;
    if constexpr (has_master) master = g.master.data();
    return {g.params, master, step_grads(g), g.m.data(), g.v.data(), g.n};
  }
  kernels::AdamWCoeffs coeffs(const Group& g, std::int64_t t) const {
    const float wd = g.options.weight_decay >= 0 ? g.options.weight_decay : opt_.weight_decay;
    return kernels::adamw_coeffs(opt_.lr * g.options.lr_scale, opt_.beta1, opt_.beta2, opt_.eps, wd, t);
  }
  bool needs_norm_pass() const { return scales_loss || opt_.max_grad_norm > 0; }

  StepResult host_step() {
    float found_local = 0.f;
    float* found = &found_local;
    const float* inv_scale = nullptr;
    if constexpr (scales_loss) {
      found = host_scaler_->found_inf();
      inv_scale = host_scaler_->inv_scale_ptr();
    }
    clip_ = 1.0f;
    if (needs_norm_pass()) {
      std::vector<kernels::Buffer<const step_grad_type>> grads;
      for (auto& g : groups_) grads.push_back({step_grads(g), g.n});
      kernels::grad_norm_cpu<step_grad_type>(grads, kernels::NormType::L2, opt_.max_grad_norm, inv_scale, {nullptr, &clip_, found});
    }
    const bool applied = *found == 0.f;
    const kernels::AdamWDynamic dyn{inv_scale, found, &clip_, nullptr};
    for (auto& g : groups_) kernels::adamw_cpu(tensor(g), coeffs(g, applied_ + 1), dyn);
    if (applied) ++applied_;
    if constexpr (scales_loss) host_scaler_->update();  // consumes found_inf; throws at the minimum scale if asked
    return {applied};
  }

#if defined(__CUDACC__)
  // Device-side state of the CUDA backend (absent for Offload<Host>, so a host optimizer needs no GPU).
  struct DeviceState {
    mutable detail::DeviceArray<float> scalars;       // [clip_coef, found_inf when there is no scaler]
    mutable detail::DeviceArray<std::int64_t> step;   // applied steps (bias correction, no host sync)
    std::optional<kernels::GradNormWorkspace> workspace;
    std::optional<kernels::DeviceLossScaler> scaler;
    kernels::DeviceTensorTable<kernels::Buffer<const step_grad_type>> norm_table;
    kernels::DeviceTensorTable<kernels::AccumTensor<param_type>> accum_table;
    void init(const AdamW& o, bool with_scaler, cudaStream_t s) {
      scalars.resize(2);
      step.resize(1);
      workspace.emplace();
      if (with_scaler) scaler.emplace(o.loss_scale, s);
      const float init[2] = {1.f, 0.f};
      SQUEEZE_CUDA_CHECK(cudaMemcpyAsync(scalars.data(), init, sizeof init, cudaMemcpyHostToDevice, s));
      SQUEEZE_CUDA_CHECK(cudaMemsetAsync(step.data(), 0, sizeof(std::int64_t), s));
      SQUEEZE_CUDA_CHECK(cudaStreamSynchronize(s));
    }
  };
  struct NoDeviceState {};

  void build_tables() {
    if (!tables_dirty_) return;
    std::vector<kernels::Buffer<const step_grad_type>> grads;
    for (auto& g : groups_) grads.push_back({step_grads(g), g.n});
    dev_.norm_table.upload(grads);
    if constexpr (accumulates) {
      std::vector<kernels::AccumTensor<param_type>> acc;
      for (auto& g : groups_) acc.push_back({g.acc.data(), g.grads, g.n});
      dev_.accum_table.upload(acc);
    }
    tables_dirty_ = false;
  }

  StepResult device_step() {
    build_tables();
    float* clip = dev_.scalars.data();
    float* found = dev_.scalars.data() + 1;
    const float* inv_scale = nullptr;
    if constexpr (scales_loss) {
      found = dev_.scaler->found_inf();
      inv_scale = dev_.scaler->inv_scale();
    }
    const bool norm = needs_norm_pass();
    if (norm) {
      if constexpr (!scales_loss) SQUEEZE_CUDA_CHECK(cudaMemsetAsync(found, 0, sizeof(float), stream_));
      SQUEEZE_CUDA_CHECK(kernels::grad_norm_cuda<step_grad_type>(dev_.norm_table.view(), kernels::NormType::L2, opt_.max_grad_norm, inv_scale,
                                                                 {nullptr, clip, found}, dev_.workspace->get(), stream_));
    }
    const kernels::AdamWDynamic dyn{inv_scale, norm ? found : nullptr, norm ? clip : nullptr, dev_.step.data()};
    // Bias correction comes from the device step counter (t = applied + 1), so the host step is unused.
    for (auto& g : groups_) SQUEEZE_CUDA_CHECK(kernels::adamw_cuda(tensor(g), coeffs(g, 1), dyn, stream_));
    SQUEEZE_CUDA_CHECK(kernels::adamw_commit_step_cuda(dev_.step.data(), norm ? found : nullptr, stream_));
    if constexpr (scales_loss) SQUEEZE_CUDA_CHECK(dev_.scaler->update(stream_));
    return {};
  }

  cudaStream_t stream_ = nullptr;
  std::conditional_t<on_host, NoDeviceState, DeviceState> dev_;
#endif

  AdamW opt_;
  std::vector<Group> groups_;
  int micro_ = 0;
  bool tables_dirty_ = true;
  std::int64_t applied_ = 0;
  float clip_ = 1.0f;
  std::optional<kernels::LossScaler> host_scaler_;
};

}  // namespace optim
}  // namespace squeeze
