#pragma once
// Gradient synchronisation for stages 0 and 1 (docs/architecture.md): every trainable parameter is a view of one
// flat buffer, its gradient of one flat gradient buffer. Nothing is communicated until the window's last backward:
// stage 0 all-reduces (average) the whole buffer and updates all of it on every rank; stage 1 reduce-scatters it in
// place into this rank's slice, updates the slice and all-gathers the parameters.
//
// When the gradient buffer exists (TrainerOptions::gradient_buffers, plan::effective_gradient_buffers):
//   after_backward  backward leaves one gradient per parameter (as torch's set_to_none does); after backward they
//                   move into the flat buffers (the fp32 accumulator at each micro-batch, the compute-type buffer at
//                   the window's end), which live until the update;
//   at_backward     attached before the window's first backward, which then adds into it (the lower peak where the
//                   activations are fewer bytes than the buffer: plan::best_gradient_buffers);
//   kept            attached when the trainer is built and between steps.
#include <torch/torch.h>

#include <memory>
#include <vector>

#include "squeeze/train/parts/gradient_sync.hpp"

namespace squeeze::train {

template <StrategyType S>
class ReplicatedGrads {
  using T = TrainTypes<S>;
  static constexpr int kStage = S::stage;
  static_assert(kStage <= 1, "ReplicatedGrads synchronises stages 0 and 1: write BucketedGrads or GatherUnits for stages 2-3");

 public:
  static constexpr bool hands_over_in_backward = false;  // gradients are final only after the window's backward

  template <class State>
  ReplicatedGrads(TrainContext& ctx, State& state, torch::nn::Module&, NamedTensors trainable) : ctx_(ctx) {
    flat_ = FlatParams(std::move(trainable), ctx.world, ctx.align_elems());
    torch::Tensor flat = flat_.flat();
    ctx.broadcast(flat);
    if (ctx.opt.gradient_buffers == GradientBuffers::kept) attach();
    if constexpr (kStage == 0) {
      state.own(own_, flat, T::kFp32Accum ? acc_full_ : flat_.grad(), flat_, 0);
    } else {
      // The full gradient buffer is kept anyway: reduce-scatter in place into this rank's slice of it.
      const torch::Tensor& g = T::kFp32Accum ? acc_full_ : flat_.grad();  // undefined until backward, unless kept
      state.own(own_, flat_.shard_of(flat, ctx.rank), g.defined() ? flat_.shard_of(g, ctx.rank) : torch::Tensor(), flat_,
                int64_t(ctx.rank) * flat_.shard());
    }
  }

  std::vector<Partition*> partitions() { return {&own_}; }
  std::vector<PartitionView> views() {
    return {{"replicated", &flat_, kStage == 0 ? 0 : int64_t(ctx_.rank) * flat_.shard(), kStage == 0, false, &own_}};
  }
  void rank_partitions() { own_.priority = 0; }
  bool ranked_by_forward() const { return true; }

  // The pass: nothing is gathered.
  void begin_micro_step(bool) {}
  void begin_forward() {}
  void begin_backward() {
    if (effective() == GradientBuffers::at_backward && !flat_.grad().defined()) attach();
  }
  void end_backward() {}
  void abort_pass() {}

  // Stage 0: all-reduce (average) the window's gradients; stage 1: reduce-scatter them into this rank's slice.
  void after_backward(bool boundary) {
    if (effective() == GradientBuffers::after_backward) {
      collect(boundary);
    } else if (T::kFp32Accum) {
      acc_full_.add_(flat_.grad());
      flat_.zero_grad();
    }
    if (!boundary) return;
    const torch::Tensor src = T::kFp32Accum ? acc_full_ : flat_.grad();
    if constexpr (kStage == 0)
      all_reduce_inplace(*ctx_.comm, src, comm::ReduceOp::avg);
    else
      reduce_scatter_avg(*ctx_.comm, src, own_.grad);  // in place: own_.grad is this rank's slice of src
  }

  template <class State>
  double sum_squares(State& state) {
    if constexpr (kStage == 0) {
      // Same association as stage 1: per rank-sized chunk, chunks in rank order.
      const int64_t shard = flat_.shard();
      if (state.sums_on_device()) return device_sum_squares().template item<double>();
      double total = 0;
      for (int r = 0; r < ctx_.world; ++r) {
        const double part = engine::detail::sum_squares(own_.grad.narrow(0, int64_t(r) * shard, shard));
        total = r == 0 ? part : total + part;
      }
      return total;
    } else {
      return partition_sum_squares(ctx_, partitions(), state);
    }
  }
  // The same sum left on the device ([1] float64, no host sync).
  torch::Tensor device_sum_squares() {
    if constexpr (kStage == 0) {
      const int64_t shard = flat_.shard();
      torch::Tensor total = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat64).device(ctx_.device));
      for (int r = 0; r < ctx_.world; ++r) total.add_(sum_squares_tensor(own_.grad.narrow(0, int64_t(r) * shard, shard)));
      return total;
    } else {
      return train::device_sum_squares(ctx_, partitions());
    }
  }

  // Stage 1: everyone gets the updated slices back.
  void gather_updated() {
    if constexpr (kStage >= 1) gather_into(*ctx_.comm, flat_.shard_of(flat_.flat(), ctx_.rank), flat_.flat());  // in place
  }
  void zero_window(bool gradients_zeroed) {
    flat_.zero_grad();
    if (acc_full_.defined()) acc_full_.zero_();
    if (!gradients_zeroed && own_.grad.defined()) own_.grad.zero_();
    release();
  }

  void add_memory(MemoryUse& m, bool state_on_host) const {
    auto add = [](plan::Placement& p, const torch::Tensor& t) {
      if (t.defined()) p.device += int64_t(t.nbytes());
    };
    add(m.parameters, flat_.flat());
    add(m.gradients, flat_.grad());
    add(m.gradients, acc_full_);
    add_partition_memory(m, own_, false, state_on_host);
    m.peak_gradient_bytes = m.gradients.device;
    m.full_gradient_bytes += flat_.numel() * flat_.element_size();
  }
  int64_t reduce_scatter_bytes() const { return 0; }

  // TrainerOptions::gradient_buffers changed (between windows) from `was`.
  void gradient_buffers_changed(GradientBuffers was) {
    if (ctx_.opt.gradient_buffers == GradientBuffers::kept)
      attach();
    else if (was == GradientBuffers::kept)
      release();
  }
  void restore_module() {}

 private:
  GradientBuffers effective() const { return plan::effective_gradient_buffers(ctx_.opt.gradient_buffers, T::kFp32Accum); }
  // The full gradient buffer (and the fp32 accumulator with mixed-precision accumulation), attached as the
  // parameters' .grad.
  void attach() {
    if (!flat_.grad().defined()) flat_.attach_grads();
    if (T::kFp32Accum && !acc_full_.defined()) acc_full_ = torch::zeros({flat_.padded()}, flat_.options().dtype(torch::kFloat32));
    point_own_grad();
  }
  // The partition's gradient is (this rank's slice of) the buffer the update reads.
  void point_own_grad() {
    const torch::Tensor& g = T::kFp32Accum ? acc_full_ : flat_.grad();
    own_.grad = kStage == 0 ? g : flat_.shard_of(g, ctx_.rank);
  }
  void collect(bool boundary) {
    if (T::kFp32Accum)
      flat_.move_grads_into(acc_full_, torch::kFloat32);
    else if (boundary)
      flat_.collect_grads();
    else
      return;
    point_own_grad();
  }
  void release() {
    if (ctx_.opt.gradient_buffers == GradientBuffers::kept) return;
    flat_.release_grads();
    acc_full_ = torch::Tensor();
    own_.grad = torch::Tensor();
  }

  TrainContext& ctx_;
  FlatParams flat_;         // full parameters + full gradient buffer (compute dtype)
  torch::Tensor acc_full_;  // [padded] fp32 accumulator (mixed-precision accumulation)
  Partition own_;
};

}  // namespace squeeze::train
