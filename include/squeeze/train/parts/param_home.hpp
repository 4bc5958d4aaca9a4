#pragma once
// Where a stage-3 gather unit's parameters live between uses: a part of the trainer (docs/architecture.md, "The
// trainer's parts"), chosen by the Offload policy.
//   DeviceParams  the unit's shard on the device (ZeRO-3): all-gathered for use, or used in place on one rank; its
//                 gradient shard on the device too, handed to the offload worker when final (Offload<Host>).
//   HostParams    Offload<Host, Streamed>: the shard in pinned host memory, copied to the device for each gather and
//                 dropped after use; each pass's reduced gradient streams to the host at once (accumulated there), and
//                 the host AdamW leaves the new values in the shard (HostAdamW: rounded over the gradient copy, which
//                 then becomes the shard): nothing of the unit stays on the GPU.
#include <torch/torch.h>

#include "squeeze/engine/stage3.hpp"
#include "squeeze/train/parts/context.hpp"

namespace squeeze::train {

// Wires a unit to the offload pipeline's waits: its next gather waits for its update to land; the prefetch skips it
// while it has not.
inline void wait_for_update_before_gather(Stage3Group& g, Partition& p, OffloadPipeline& pipe) {
  Partition* q = &p;
  OffloadPipeline* w = &pipe;
  g.before_gather = [w, q] { w->wait(*q); };
  g.update_landed = [w, q] { return w->finished(*q); };
}

class DeviceParams {
 public:
  static constexpr bool on_host = false;
  explicit DeviceParams(TrainContext& ctx) : ctx_(ctx) {}

  // The unit's shard [S], cut from the (device) full buffer, and its gradient shard [S] in the accumulation dtype.
  torch::Tensor place(const torch::Tensor& shard) const { return shard.clone(); }
  torch::Tensor gradient_shard(const torch::Tensor& shard) const {
    return torch::zeros({shard.numel()}, shard.options().dtype(ctx_.grad_dtype));
  }

  // Offload<Host>: the gradient shard goes to the host once final for the window (during backward when the pipeline
  // overlaps; else the state part hands every partition over after backward).
  void connect(Stage3Group& g, Partition& p) const {
    OffloadPipeline* pipe = ctx_.offload;
    if (pipe == nullptr) return;
    wait_for_update_before_gather(g, p, *pipe);
    engine::detail::GradState* st = &ctx_.grads;
    Partition* q = &p;
    if (pipe->threaded())
      g.grad_done = [pipe, q, st] {
        if (st->final_micro) pipe->gradient_ready(*q, st->eager);
      };
  }
  void add_memory(MemoryUse& m, const Stage3Group& g) const { m.parameters.device += int64_t(g.shard.nbytes()); }

 private:
  TrainContext& ctx_;
};

template <StrategyType S>
class HostParams {
 public:
  static constexpr bool on_host = true;
  explicit HostParams(TrainContext& ctx) : ctx_(ctx) {
    TORCH_CHECK(ctx.offload != nullptr, "HostParams: streamed parameters need the host optimizer state (Offload<Host, Streamed>)");
  }

  // Pinned host memory of exactly S elements for a GPU model (the gathers copy from it asynchronously); a host copy
  // for a CPU model, which runs the same steps in program order.
  torch::Tensor place(const torch::Tensor& shard) const {
    if (!ctx_.device.is_cuda()) return shard.clone();
    torch::Tensor host = pinned_empty(shard.numel(), shard.scalar_type());
    host.copy_(shard);
    return host;
  }
  torch::Tensor gradient_shard(const torch::Tensor&) const { return {}; }  // none: each pass's gradient goes to the host

  // Each reduction of the unit's gradient is one part of the window's (accumulated on the host); once the window's
  // last pass completed it, the update may run (during backward when the pipeline overlaps).
  void connect(Stage3Group& g, Partition& p) const {
    OffloadPipeline* pipe = ctx_.offload;
    wait_for_update_before_gather(g, p, *pipe);
    g.on_host = true;
    p.streamed = true;
    if constexpr (S::accumulation_steps > 1)  // a later micro-batch's part lands here before the worker adds it
      p.host_stage = host_stage_for(p, ctx_.device);
    engine::detail::GradState* st = &ctx_.grads;
    Partition* q = &p;
    g.grad_handover = [pipe, q, st](const torch::Tensor& grad, bool complete) {
      pipe->gradient_part(*q, grad);
      if (complete && st->final_micro && pipe->threaded()) pipe->gradient_ready(*q, st->eager);
    };
  }
  void add_memory(MemoryUse& m, const Stage3Group& g) const { m.parameters.host += int64_t(g.shard.nbytes()); }

 private:
  TrainContext& ctx_;
};

template <StrategyType S>
using ParamHomeOf = std::conditional_t<S::stream_params, HostParams<S>, DeviceParams>;

}  // namespace squeeze::train
