#pragma once
// Gradient synchronisation for stage 2, and for the parameters stage 3 keeps whole (docs/architecture.md): buckets of
// about TrainerOptions::bucket_bytes in reverse registration order (backward finishes the last layers first), each
// padded for its own shards. A post-accumulate-grad hook per parameter copies its .grad into the bucket's buffer and
// frees it; the bucket's last gradient reduce-scatters (average) the buffer into this rank's gradient shard (fp32 when
// mixed), during backward (engine/buckets.hpp). Accumulation reduce-scatters every micro-batch: Ψ/N of gradient
// memory for A times the traffic (Trainer::reduce_scatter_bytes counts it). All ranks run the same graph; parameters
// that got no gradient are reduced as zeros after backward, in bucket order.
#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "squeeze/train/parts/gradient_sync.hpp"

namespace squeeze::train {

template <StrategyType S>
class BucketedGrads {
  static_assert(S::stage >= 2,
                "BucketedGrads synchronises stage 2 (and stage 3's whole-kept parameters): write ReplicatedGrads for stages 0-1");

 public:
  static constexpr bool hands_over_in_backward = true;  // each bucket's shard is final when its reduce-scatter is

  template <class State>
  BucketedGrads(TrainContext& ctx, State& state, torch::nn::Module&, NamedTensors params) : ctx_(ctx) {
    if (params.empty()) return;
    std::vector<NamedTensors> groups;
    int64_t bytes = 0;
    for (auto it = params.rbegin(); it != params.rend(); ++it) {
      const int64_t b = int64_t(it->second.nbytes());
      if (groups.empty() || bytes + b > ctx.opt.bucket_bytes) groups.emplace_back(), bytes = 0;
      groups.back().push_back(*it);
      bytes += b;
    }
    for (auto& g : groups) {
      std::reverse(g.begin(), g.end());
      auto b = std::make_unique<engine::detail::Bucket>();
      b->flat = FlatParams(std::move(g), ctx.world, ctx.align_elems());
      torch::Tensor flat = b->flat.flat();
      ctx.broadcast(flat);
      const int64_t begin = int64_t(ctx.rank) * b->flat.shard();
      state.own(b->own, b->flat.shard_of(flat, ctx.rank), torch::zeros({b->flat.shard()}, flat.options().dtype(ctx.grad_dtype)), b->flat,
                begin);
      for (auto& e : b->flat.entries()) {
        e.param.mutable_grad().reset();
        torch::autograd::impl::set_post_acc_grad_hooks(e.param, std::make_unique<engine::detail::BucketHook>(b.get(), &e, &ctx.grads));
      }
      buckets_.push_back(std::move(b));
    }
  }
  BucketedGrads(const BucketedGrads&) = delete;
  BucketedGrads& operator=(const BucketedGrads&) = delete;
  ~BucketedGrads() {
    for (auto& b : buckets_)
      for (auto& e : b->flat.entries()) torch::autograd::impl::set_post_acc_grad_hooks(e.param, nullptr);
  }

  std::vector<Partition*> partitions() {
    std::vector<Partition*> p;
    for (auto& b : buckets_) p.push_back(&b->own);
    return p;
  }
  std::vector<PartitionView> views() {
    std::vector<PartitionView> v;
    for (std::size_t i = 0; i < buckets_.size(); ++i)
      v.push_back({"bucket" + std::to_string(i), &buckets_[i]->flat, int64_t(ctx_.rank) * buckets_[i]->flat.shard(), false, false,
                   &buckets_[i]->own});
    return v;
  }
  // Offload<Host>: bucketed partitions come first in the worker's order (the step waits for them); returns the next.
  int64_t rank_partitions(int64_t first = 0) {
    for (auto& b : buckets_) b->own.priority = first++;
    return first;
  }
  bool ranked_by_forward() const { return true; }

  void begin_micro_step(bool) {
    for (auto& b : buckets_) b->pending = int(b->flat.entries().size()), b->reduced = false;
  }
  void begin_forward() {}
  void begin_backward() {}
  void end_backward() {}
  void abort_pass() {}

  // Buckets that did not complete in backward (parameters without a gradient; or thread-ranks on one GPU, which
  // reduce everything here), in bucket order on every rank; then the side stream joins this one.
  void after_backward(bool boundary) {
    for (auto& b : buckets_)
      if (!b->reduced) engine::detail::reduce_bucket(*b, ctx_.grads);
    if (!buckets_.empty() && ctx_.collectives->active()) {
      // The buckets' reductions ran on the side stream: the update reads their shards on this one. A failed or
      // timed-out collective throws here.
      wait_current(ctx_.device, ctx_.collectives->record());
      ctx_.comm->synchronize(ctx_.collectives->handle());
    }
    if (boundary) last_window_rs_bytes_ = ctx_.grads.reduce_scatter_bytes;
  }

  template <class State>
  double sum_squares(State& state) {
    return partition_sum_squares(ctx_, partitions(), state);
  }
  torch::Tensor device_sum_squares() { return train::device_sum_squares(ctx_, partitions()); }
  // Everyone gets each bucket's updated shard back.
  void gather_updated() {
    for (auto& b : buckets_) gather_into(*ctx_.comm, b->flat.shard_of(b->flat.flat(), ctx_.rank), b->flat.flat());
  }
  void zero_window(bool gradients_zeroed) {
    if (!gradients_zeroed)
      for (auto& b : buckets_) b->own.grad.zero_();
  }

  // Stage 2: the buckets' bytes, then the in-flight and peak figures.
  void add_memory(MemoryUse& m, bool state_on_host) const {
    add_bucket_memory(m, state_on_host, /*kept_whole=*/false);
    finish_memory(m);
  }
  // The buckets' bytes alone; kept_whole: stage 3 counts these parameters as persistent (not sharded).
  void add_bucket_memory(MemoryUse& m, bool state_on_host, bool kept_whole) const {
    for (auto& b : buckets_) {
      m.parameters.device += int64_t(b->flat.flat().nbytes());
      add_partition_memory(m, b->own, true, state_on_host);
      if (kept_whole) m.persistent_params += b->flat.numel();
      m.full_gradient_bytes += b->flat.numel() * b->flat.element_size();
    }
  }
  // After every part added its bytes: the in-flight buckets and the most gradient bytes alive in backward.
  void finish_memory(MemoryUse& m) const {
    m.communication.device = ctx_.grads.peak_live;
    m.peak_gradient_bytes = std::max(ctx_.grads.peak_grad, m.gradients.device);
  }
  int64_t reduce_scatter_bytes() const { return last_window_rs_bytes_; }
  void gradient_buffers_changed(GradientBuffers) {}
  void restore_module() {}
  // The gradient shards' device bytes (GradState::shard_bytes counts them for the peak).
  int64_t shard_bytes() const {
    int64_t n = 0;
    for (auto& b : buckets_) n += int64_t(b->own.grad.nbytes());
    return n;
  }

 private:
  TrainContext& ctx_;
  std::vector<std::unique_ptr<engine::detail::Bucket>> buckets_;
  int64_t last_window_rs_bytes_ = 0;
};

}  // namespace squeeze::train
