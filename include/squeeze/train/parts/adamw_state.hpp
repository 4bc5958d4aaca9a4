#pragma once
// Where the optimizer state lives and who updates it: the state part of a trainer (docs/architecture.md).
//   DeviceAdamW<S>  the state beside the parameters (on the GPU, or on the host for a CPU model); the trainer's own
//                   thread updates every partition at the boundary: the fused CUDA kernels (fp32 or 8-bit moments)
//                   where this header is compiled by nvcc, torch ops on device buffers elsewhere, the CPU AdamW on
//                   host tensors.
//   HostAdamW<S>    Offload<Host>: the state in host memory, updated by the offload worker (engine/offload.hpp) as
//                   each gradient lands; the new parameters stream back.
// Both allocate a partition's state the same way (AdamWState) and run the same CPU arithmetic on host buffers.
#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "squeeze/engine/device_adamw.hpp"
#include "squeeze/train/parts/context.hpp"
#include "squeeze/kernels/adamw.hpp"
#include "squeeze/kernels/adamw8.hpp"
#if defined(__CUDACC__)
#include "squeeze/kernels/grad_norm.cuh"
#endif

namespace squeeze::train {

// Host bytes an Offload<Host> trainer holds for n trainable elements of one rank (the refusal made before allocating
// reads it): the fp32 master, the moments (8-bit: codes and a scale per block), the gradient copy in the gradient's
// dtype and, streamed (Offload<Host, Streamed>), the parameters themselves and a second gradient copy for accumulation.
struct HostStateBytes {
  bool state_8bit = false;
  int64_t master = 4, gradient = 4, parameters = 0, staging = 0;  // bytes per element
  int64_t bytes(int64_t n) const {
    const int64_t moments = state_8bit ? 2 * n + 2 * kernels::state_blocks(n) * 4 : 8 * n;
    return moments + (master + gradient + parameters + staging) * n;
  }
  std::string describe() const {
    std::string d = (master ? std::string("fp32 master 4 B, ") : std::string()) + "moments " + (state_8bit ? "2 B" : "8 B") +
                    ", gradient copy " + std::to_string(gradient) + " B";
    if (parameters) d += ", parameters " + std::to_string(parameters) + " B";
    if (staging) d += ", accumulation copy " + std::to_string(staging) + " B";
    return d + " per element";
  }
};
template <StrategyType S>
HostStateBytes host_state_bytes(torch::ScalarType compute, torch::ScalarType grad) {
  HostStateBytes b;
  b.state_8bit = S::state_bits == 8;
  b.master = S::stochastic_rounding ? 0 : 4;
  b.gradient = int64_t(c10::elementSize(grad));
  if (S::stream_params) b.parameters = int64_t(c10::elementSize(compute));
  if (S::stream_params && S::accumulation_steps > 1) b.staging = b.gradient;
  return b;
}

template <StrategyType S, bool OnHost>
class AdamWState {
 protected:
  using T = TrainTypes<S>;
  using Param = typename T::Param;

 public:
  static constexpr bool on_host = OnHost;  // the state lives in host memory while the parameters train on the device
  static_assert(!T::k8bit || S::state_quantization::group == int(kernels::kStateBlock),
                "train::Trainer's 8-bit optimizer state uses blocks of 256 values: write QuantizedState<8> (or Group<256>)");

  explicit AdamWState(TrainContext& ctx) : ctx_(ctx) {}

  // Partition o will update `param` [n] (elements [begin, begin + n) of layout's flat buffer) from `grad` [n]: its
  // segments, its state, and its fp32 master seeded from the float values the parameters were rounded from.
  void own(Partition& o, torch::Tensor param, torch::Tensor grad, const FlatParams& layout, int64_t begin) {
    o.segments = ctx_.segments(layout, begin, param.numel());
    o.rounding_index = (std::uint64_t(++partitions_) << 40) + std::uint64_t(begin);  // distinct streams, in build order
    allocate(o, std::move(param), std::move(grad));
    seed_master(o, layout, begin);
  }

  // The CPU AdamW on one partition's host buffers (fp32 or 8-bit moments): param [n] (P), master [n] or null,
  // grad [n], segment by segment (their groups' coefficients; 8-bit segments start on a state block).
  template <class P, class G>
  static void adamw_on_host(Partition& p, P* param, float* master, const G* grad, const GroupCoeffs& cs, const kernels::AdamWDynamic& d) {
    for (const Segment& s : p.segments) {
      const int64_t o = s.begin, n = s.len;
      float* mo = master ? master + o : nullptr;
      if constexpr (T::k8bit) {
        const int64_t b = s.block;
        const kernels::AdamW8Tensor<P, G> t{param + o,
                                            mo,
                                            grad + o,
                                            p.m.template data_ptr<std::uint8_t>() + o,
                                            p.m_absmax.template data_ptr<float>() + b,
                                            p.v.template data_ptr<std::uint8_t>() + o,
                                            p.v_absmax.template data_ptr<float>() + b,
                                            n,
                                            p.rounding_index + std::uint64_t(o)};
        kernels::adamw8_cpu(t, cs[std::size_t(s.group)], d);
      } else {
        const kernels::AdamWTensor<P, G> t{param + o,
                                           mo,
                                           grad + o,
                                           p.m.template data_ptr<float>() + o,
                                           p.v.template data_ptr<float>() + o,
                                           n,
                                           p.rounding_index + std::uint64_t(o)};
        kernels::adamw_cpu(t, cs[std::size_t(s.group)], d);
      }
    }
  }

 protected:
  // [n] optimizer-state buffer: on the device, or on the host with Offload<Host>. From a GPU, what the pipeline's
  // asynchronous copies touch (`transferred`: the host gradient copy, which also carries the rounded new parameters
  // back, and the fp32 master where it is the upload's source) is pinned host memory of exactly n elements
  // (train::pinned_empty: torch's caching host allocator would round each one up to a power of two). The moments
  // never cross PCIe, so they stay pageable: pinning them would lock most of the host state and cost seconds per
  // 10 GB when the trainer is built, for no copy. Host state the copies never touch comes zeroed from
  // train::host_zeros, which writes nothing until first use.
  torch::Tensor state_empty(int64_t n, torch::ScalarType dtype, bool transferred) const {
    if (!OnHost) return torch::empty({n}, torch::TensorOptions().dtype(dtype).device(ctx_.device));
    return ctx_.device.is_cuda() && transferred ? pinned_empty(n, dtype) : host_zeros(n, dtype);
  }
  torch::Tensor state_zeros(int64_t n, torch::ScalarType dtype, bool transferred) const {
    torch::Tensor t = state_empty(n, dtype, transferred);
    return OnHost && !(ctx_.device.is_cuda() && transferred) ? t : t.zero_();
  }
  // The fp32 master is the upload's source unless the CPU AdamW stages the rounded parameters in the host
  // gradient copy (a 16-bit gradient of the parameter's dtype: OffloadPipeline::write_back's staged path).
  bool master_uploaded() const { return !(T::kMaster && ctx_.grad_dtype == ctx_.compute_dtype); }

  void allocate(Partition& o, torch::Tensor param, torch::Tensor grad) {
    o.param = param;
    o.grad = grad;
    const int64_t n = param.numel();
    if constexpr (T::kStochastic) {
      // Host parameters are their own master. A kept-whole layer's on the device is updated in a host copy of its
      // own dtype, uploaded like a master (a checkpoint restores it from the parameter, exactly).
      if (!param.is_cpu()) {
        o.master = state_empty(n, param.scalar_type(), true);
        o.master.copy_(param);
      }
    } else if (OnHost || T::kMaster) {
      o.master = state_empty(n, torch::kFloat32, master_uploaded());
      o.master.copy_(param);
    }
    if constexpr (T::k8bit) {
      // Zero codes with zero block scales are the zero state (absmax 0 decodes every code to 0).
      o.m = state_zeros(n, torch::kUInt8, false);
      o.v = state_zeros(n, torch::kUInt8, false);
      int64_t blocks = 0;  // blocks start at each segment's first element (one group's elements under one absmax)
      for (const Segment& s : o.segments) blocks += kernels::state_blocks(s.len);
      o.m_absmax = state_zeros(blocks, torch::kFloat32, false);
      o.v_absmax = state_zeros(blocks, torch::kFloat32, false);
    } else {
      o.m = state_zeros(n, torch::kFloat32, false);
      o.v = state_zeros(n, torch::kFloat32, false);
    }
    // The gradient travels in its own dtype (bf16: half the PCIe bytes of fp32); the CPU AdamW widens it.
    if (OnHost) o.host_grad = state_zeros(n, ctx_.grad_dtype, true);
    if (OnHost && ctx_.device.is_cuda()) o.host_sumsq = state_zeros(1, torch::kFloat64, true);
  }

  // TrainerOptions::master_init: the fp32 master of partition o (elements [begin, begin + o.master.numel()) of
  // layout's flat buffer) takes the float values each parameter was rounded from.
  void seed_master(Partition& o, const FlatParams& layout, int64_t begin) {
    if constexpr (T::kMaster) {
      const auto& init = ctx_.opt.master_init;
      if (!init || !o.master.defined()) return;
      torch::NoGradGuard ng;
      const int64_t end = begin + o.master.numel();
      for (const FlatEntry& e : layout.entries()) {
        torch::Tensor w = init(e.name);
        TORCH_CHECK(w.defined(), "make_trainer: master_init returned no tensor for '", e.name, "'");
        TORCH_CHECK(w.numel() == e.numel && w.sizes().vec() == e.shape, "make_trainer: master_init('", e.name, "') has shape ", w.sizes(),
                    "; the parameter has ", c10::IntArrayRef(e.shape));
        TORCH_CHECK(w.is_floating_point(), "make_trainer: master_init('", e.name, "') is ", w.scalar_type(), ", not floating point");
        w = w.detach().to(torch::kFloat32).contiguous().view({-1});
        if (ctx_.world > 1) {  // rank 0's values, as the parameters were broadcast (device buffers suit the communicator)
          w = w.to(ctx_.device);
          ctx_.broadcast(w);
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

  TrainContext& ctx_;
  std::uint64_t partitions_ = 0;
};

// The state beside the parameters; the trainer's thread updates at the boundary.
template <StrategyType S>
class DeviceAdamW : public AdamWState<S, false> {
  using Base = AdamWState<S, false>;
  using T = typename Base::T;
  using Param = typename Base::Param;
  using Base::ctx_;

 public:
  explicit DeviceAdamW(TrainContext& ctx) : Base(ctx) {}

  // Gradient sums of squares are taken on the device (one read-back a step) unless the model is on the CPU.
  bool sums_on_device() const { return !ctx_.device.is_cpu(); }
  double host_sum_squares(Partition& o) { return engine::detail::sum_squares(o.grad); }
  static constexpr bool zeroes_gradients = false;  // the window's end zeroes the gradient shards

  void begin_micro_step(bool, bool, const GroupCoeffs&) {}
  void gradients_final(const std::vector<Partition*>&) {}
  bool take_eager() { return false; }
  bool updated_during_backward() const { return false; }
  // Partition::priority orders offloaded jobs only.
  template <class Sync>
  void rank_jobs(Sync&) {}
  void skip() {}

  void apply(const std::vector<Partition*>& parts, const GroupCoeffs& cs, float inv_scale, float clip, bool /*eager*/) {
    torch::NoGradGuard ng;
    const kernels::AdamWDynamic dyn{&inv_scale, nullptr, &clip, nullptr};
#if defined(__CUDACC__)
    if constexpr (!T::kStochastic) {  // (the kernels round a master into its param; a bf16 param as its own master stays in torch ops)
      if (ctx_.device.is_cuda()) {    // the kernels read the values from device memory: one upload a step
        const torch::Tensor values = upload({inv_scale, clip});
        const float* d = values.data_ptr<float>();
        for (Partition* o : parts)
          o->param.is_cpu() ? update(*o, cs, dyn, inv_scale * clip) : update_device(*o, cs, {d, nullptr, d + 1, nullptr});
        return;
      }
    }
#endif
    for (Partition* o : parts) update(*o, cs, dyn, inv_scale * clip);
  }

  // Whether the window's decisions (clip, skip) can be taken on the device with no host sync: the CUDA kernels, where
  // this header is compiled by nvcc (apply_deciding_on_device).
#if defined(__CUDACC__)
  static constexpr bool decides_on_device = !T::kStochastic;
#else
  static constexpr bool decides_on_device = false;
#endif
#if defined(__CUDACC__)
  // The window's update with every decision on the device: from the gradients' sum of squares `sum` ([1] float64 on the
  // device, all-reduced) the norm, the clip coefficient and the overflow flag (kernels::grad_norm_finalize_cuda), then
  // AdamW, which keeps every bit when the flag is set and counts the steps it applies on the device (its bias
  // correction reads that count). `steps_applied`: the host's count, which seeds the device's the first time. Returns
  // [4] float32 on the device: the inverse loss scale, the clip coefficient, the flag, the norm.
  torch::Tensor apply_deciding_on_device(const std::vector<Partition*>& parts, const GroupCoeffs& cs, const torch::Tensor& sum,
                                         float inv_scale, float max_norm, int64_t steps_applied) {
    torch::NoGradGuard ng;
    if (!device_steps_.defined())
      device_steps_ = torch::full({1}, steps_applied, torch::TensorOptions().dtype(torch::kInt64).device(ctx_.device));
    const torch::Tensor dyn = upload({inv_scale, 1.0f, 0.0f, 0.0f});
    float* d = dyn.data_ptr<float>();
    auto* steps = device_steps_.data_ptr<int64_t>();
    engine::launch_on_current_stream(dyn, "the gradient norm (CUDA)", [&](cudaStream_t st) {
      return kernels::grad_norm_finalize_cuda(sum.data_ptr<double>(), kernels::NormType::L2, max_norm, d, {d + 3, d + 1, d + 2}, st);
    });
    const kernels::AdamWDynamic dd{d, d + 2, d + 1, steps};
    for (Partition* o : parts) update_device(*o, cs, dd);
    engine::launch_on_current_stream(dyn, "AdamW's step count (CUDA)",
                                     [&](cudaStream_t st) { return kernels::adamw_commit_step_cuda(steps, d + 2, st); });
    return dyn;
  }
#endif
  // The steps the device applied, where it decided (a host sync); -1 where it never did. forget_device_steps: the host's
  // count is the one to seed from next time (a checkpoint restored it).
  int64_t device_steps() const { return device_steps_.defined() ? device_steps_.item<int64_t>() : -1; }
  void forget_device_steps() { device_steps_ = torch::Tensor(); }

  void wait(Partition&) {}
  void wait_all() {}
  OffloadStats stats() const { return {}; }
  void reset_stats() {}

 private:
  void update(Partition& o, const GroupCoeffs& cs, const kernels::AdamWDynamic& d, float gmul) {
    if (o.param.is_cpu()) {
      if (o.grad.scalar_type() == torch::kFloat32)
        update_host<float>(o, cs, d);
      else
        update_host<Param>(o, cs, d);
      return;
    }
    update_torch_ops(o, cs, gmul);
  }

  template <class G>
  void update_host(Partition& o, const GroupCoeffs& c, const kernels::AdamWDynamic& d) {
    Base::template adamw_on_host<Param, G>(o, reinterpret_cast<Param*>(o.param.data_ptr()),
                                           T::kMaster ? o.master.template data_ptr<float>() : nullptr,
                                           reinterpret_cast<const G*>(o.grad.data_ptr()), c, d);
  }

  // Device buffers from a host-compiled TU: the same math in torch ops (an nvcc TU launches the 8-bit kernel).
  // Elementwise, so chunking changes no bit; it bounds the temporaries to one chunk. 8-bit: segments start on
  // a state block of their own and kDeviceChunk is a multiple of one, so each chunk's blocks are its own.
  void update_torch_ops(Partition& o, const GroupCoeffs& cs, float gmul) {
    for (const Segment& seg : o.segments)
      for (int64_t off = seg.begin; off < seg.begin + seg.len; off += engine::detail::kDeviceChunk) {
        const auto& c = cs[std::size_t(seg.group)];
        const int64_t len = std::min(engine::detail::kDeviceChunk, seg.begin + seg.len - off);
        auto part = [&](const torch::Tensor& t) { return t.narrow(0, off, len); };
        const torch::Tensor g = part(o.grad).to(torch::kFloat32) * gmul;
        torch::Tensor w = part(T::kMaster ? o.master : o.param);
        if constexpr (T::k8bit) {
          auto blocks = [&](const torch::Tensor& t) {
            return t.narrow(0, seg.block + (off - seg.begin) / kernels::kStateBlock, kernels::state_blocks(len));
          };
          if (!maps_.m.value.defined()) maps_ = engine::detail::state_maps(ctx_.device);
          engine::detail::adamw8_torch_ops(w, g, part(o.m), blocks(o.m_absmax), part(o.v), blocks(o.v_absmax), maps_, c);
        } else {
          torch::Tensor m = part(o.m), v = part(o.v);
          engine::detail::adamw_torch_ops(w, m, v, g, c);
        }
        if (T::kMaster) part(o.param).copy_(w);
      }
  }

#if defined(__CUDACC__)
  // values on the device, for the kernels to read: pinned and copied asynchronously (no host synchronisation).
  torch::Tensor upload(std::initializer_list<float> values) const {
    return torch::tensor(at::ArrayRef<float>(values), torch::kFloat32).pin_memory().to(ctx_.device, /*non_blocking=*/true);
  }
  // Device state in an nvcc TU: the CUDA kernel per segment (its group's coefficients; 8-bit blocks start at each
  // segment), reading the inverse loss scale, clip coefficient (and overflow flag and step count, where set) from the
  // device memory dyn points to.
  void update_device(Partition& o, const GroupCoeffs& cs, const kernels::AdamWDynamic& dyn) {
    const bool fp32_grad = o.grad.scalar_type() == torch::kFloat32;
    for (const Segment& seg : o.segments) {
      auto part = [&](const torch::Tensor& t) { return t.narrow(0, seg.begin, seg.len); };
      const torch::Tensor master = T::kMaster ? part(o.master) : torch::Tensor();
      const auto& c = cs[std::size_t(seg.group)];
      if constexpr (T::k8bit) {
        auto blocks = [&](const torch::Tensor& t) { return t.narrow(0, seg.block, kernels::state_blocks(seg.len)); };
        if (fp32_grad)
          engine::detail::adamw8_device_update<Param, float>(part(o.param), master, part(o.grad), part(o.m), blocks(o.m_absmax), part(o.v),
                                                             blocks(o.v_absmax), dyn, c);
        else
          engine::detail::adamw8_device_update<Param, Param>(part(o.param), master, part(o.grad), part(o.m), blocks(o.m_absmax), part(o.v),
                                                             blocks(o.v_absmax), dyn, c);
      } else if (fp32_grad) {
        engine::detail::adamw_device_update<Param, float>(part(o.param), master, part(o.grad), part(o.m), part(o.v), dyn, c);
      } else {
        engine::detail::adamw_device_update<Param, Param>(part(o.param), master, part(o.grad), part(o.m), part(o.v), dyn, c);
      }
    }
  }
#endif

  engine::detail::StateMaps maps_;  // 8-bit state on the device: the signed (m) and unsigned (v) maps
  torch::Tensor device_steps_;      // [1] int64: the steps applied, where the device decides (apply_deciding_on_device)
};

// Offload<Host>: the state in host memory, updated by the offload worker (engine/offload.hpp). Each partition's
// final gradient shard streams to pinned host memory as soon as it is reduced, its sum of squares taken on the GPU in
// float64 first; the CPU AdamW writes the rounded parameters over that copy, which streams back.
//   eager    (no clipping, no loss scaling, no token weighting: the update cannot depend on the other partitions)
//            the worker updates each partition as its gradient lands, during backward; what it has not done when
//            backward ends it works off first layer first beside the next forward;
//   deferred after backward the global norm decides skip / clip, then the worker updates partition by partition;
//            stage 3 returns from step() at once and each layer's next gather waits only for its own partition.
// TrainerOptions::overlap_offload = false runs the same jobs in program order (bitwise the same results). A
// non-finite gradient in eager mode: the partitions updated before it was seen keep their update (as an
// optimizer-in-backward does); the rest are not updated and the step reports applied = false.
template <StrategyType S>
class HostAdamW : public AdamWState<S, true> {
  using Base = AdamWState<S, true>;
  using T = typename Base::T;
  using Param = typename Base::Param;
  using Base::ctx_;

 public:
  explicit HostAdamW(TrainContext& ctx) : Base(ctx), pipeline_(std::make_unique<OffloadPipeline>(ctx.device, ctx.opt.overlap_offload)) {
    ctx.offload = pipeline_.get();
    ctx.grads.offload = pipeline_.get();
  }
  ~HostAdamW() {
    try {
      pipeline_->wait_all();
    } catch (...) {  // a failed update was reported by step(); nothing to do here
    }
  }

  bool sums_on_device() const { return false; }     // each partition's sum came with its host copy
  static constexpr bool decides_on_device = false;  // the worker's update reads its decisions on the host
  double host_sum_squares(Partition& o) { return pipeline_->gradient_sum_squares(o); }
  static constexpr bool zeroes_gradients = true;  // each gradient shard is zeroed right after its host copy

  // A boundary micro-step may update each partition as its gradient lands when nothing global can change the update.
  void begin_micro_step(bool boundary, bool global_free, const GroupCoeffs& next) {
    ctx_.grads.eager = {};
    if (boundary && pipeline_->threaded() && global_free) {
      // One worker runs the jobs: from the first non-finite partition it takes on, nothing is updated. The flag
      // is this window's own: the window's last updates may still run while the next window begins.
      auto non_finite = std::make_shared<std::atomic<bool>>(false);
      ctx_.grads.eager = [non_finite, upd = job(next, 1.0f, 1.0f)](Partition& p) {
        if (!std::isfinite(p.sumsq)) *non_finite = true;
        if (!*non_finite) upd(p);
      };
    }
    last_eager_ = bool(ctx_.grads.eager);
  }
  // After the boundary's backward: every partition not yet handed over (all of them when not overlapping), in order.
  void gradients_final(const std::vector<Partition*>& parts) {
    for (Partition* p : parts)
      if (!p->submitted) pipeline_->gradient_ready(*p, ctx_.grads.eager);
  }
  bool take_eager() {
    const bool eager = bool(ctx_.grads.eager);
    ctx_.grads.eager = {};
    return eager;
  }
  bool updated_during_backward() const { return last_eager_; }
  // The worker's order among queued jobs (Partition::priority): the order the next forward needs the partitions.
  template <class Sync>
  void rank_jobs(Sync& sync) {
    pipeline_->wait_all();  // no job is queued while the priorities change: the worker reads them
    sync.rank_partitions();
  }
  void skip() { pipeline_->wait_all(); }  // the jobs that saw the overflow have stopped updating

  void apply(const std::vector<Partition*>& parts, const GroupCoeffs& cs, float inv_scale, float clip, bool eager) {
    if (!eager)
      for (Partition* o : parts) pipeline_->update(*o, job(cs, inv_scale, clip));
    // Partitions the next forward uses without a gather are waited for here; stage-3 units by their next gather.
    for (Partition* o : parts)
      if (!o->waited_by_gather) pipeline_->wait(*o);
  }
  void wait(Partition& p) { pipeline_->wait(p); }
  void wait_all() { pipeline_->wait_all(); }
  OffloadStats stats() const { return pipeline_->stats(); }
  void reset_stats() { pipeline_->reset_stats(); }

 private:
  // The CPU AdamW of one offloaded partition: fp32 master, m, v and the host gradient copy. A streamed unit's new
  // parameters are rounded over its gradient copy, which then becomes its shard (swap_storage); other host parameters
  // take them in place. When the gradient is in
  // the (16-bit) compute dtype, the rounded new parameters overwrite it element by element (each element's gradient
  // is read before its parameter is written), so the upload moves half the bytes of the fp32 master and needs no
  // conversion on the device.
  static OffloadPipeline::Fn job(GroupCoeffs c, float inv_scale, float clip) {
    return [c, inv_scale, clip](Partition& p) {
      const kernels::AdamWDynamic d{&inv_scale, nullptr, &clip, nullptr};
      if constexpr (T::kStochastic) {  // bf16 weights are their own master: host shards in place, a device layer's host copy
        torch::Tensor& own = p.master.defined() ? p.master : p.param;
        Base::template adamw_on_host<Param, Param>(p, reinterpret_cast<Param*>(own.data_ptr()), nullptr,
                                                   reinterpret_cast<const Param*>(p.host_grad.data_ptr()), c, d);
        p.written = !p.master.defined();  // else the copy is uploaded as a master is
        return;
      }
      if constexpr (T::kMaster) {
        if (p.streamed && p.host_grad.scalar_type() == p.param.scalar_type()) {  // staged, then the buffers trade places
          Param* staged = reinterpret_cast<Param*>(p.host_grad.data_ptr());
          Base::template adamw_on_host<Param, Param>(p, staged, p.master.template data_ptr<float>(), staged, c, d);
          swap_storage(p.param, p.host_grad);
          p.written = true;
          return;
        }
        if (p.param.is_cpu()) {  // host parameters (streamed units, a CPU model): rounded into place, nothing to upload
          Param* param = reinterpret_cast<Param*>(p.param.data_ptr());
          if (p.host_grad.scalar_type() == torch::kFloat32)
            Base::template adamw_on_host<Param, float>(p, param, p.master.template data_ptr<float>(),
                                                       p.host_grad.template data_ptr<float>(), c, d);
          else
            Base::template adamw_on_host<Param, Param>(p, param, p.master.template data_ptr<float>(),
                                                       reinterpret_cast<const Param*>(p.host_grad.data_ptr()), c, d);
          p.written = true;
          return;
        }
        if (p.host_grad.scalar_type() == p.param.scalar_type()) {
          Param* staged = reinterpret_cast<Param*>(p.host_grad.data_ptr());
          Base::template adamw_on_host<Param, Param>(p, staged, p.master.template data_ptr<float>(), staged, c, d);
          p.staged = true;
          return;
        }
      }
      if (p.host_grad.scalar_type() == torch::kFloat32)
        Base::template adamw_on_host<float, float>(p, p.master.template data_ptr<float>(), nullptr, p.host_grad.template data_ptr<float>(),
                                                   c, d);
      else
        Base::template adamw_on_host<float, Param>(p, p.master.template data_ptr<float>(), nullptr,
                                                   reinterpret_cast<const Param*>(p.host_grad.data_ptr()), c, d);
    };
  }

  std::unique_ptr<OffloadPipeline> pipeline_;
  bool last_eager_ = false;
};

}  // namespace squeeze::train
