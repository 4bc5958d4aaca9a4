#pragma once
// Where checkpointed segment inputs wait for backward: a part of the trainer (docs/architecture.md, "The trainer's
// parts"), chosen by the CheckpointOffload policy.
//   DeviceCheckpoints  on the device, saved by autograd (plain checkpointing).
//   StoredCheckpoints  CheckpointOffload<Host>: copied to pinned host memory as the forward goes and brought back ahead
//                      of each segment's recomputation (engine::ActivationStore); the last TrainerOptions::
//                      checkpoint_prefetch stay on the device, and as many are prefetched in backward.
//                      CheckpointOffload<Host or Device, Int8>: the same, or kept on the device, in 8 bits.
// Each opens its scope around a step's forward (nn::checkpoint reads it) and ends the pass after backward.
#include <torch/torch.h>

#include <concepts>
#include <memory>

#include "squeeze/engine/activation_store.hpp"
#include "squeeze/nn/activation_checkpoint.hpp"
#include "squeeze/train/parts/context.hpp"

namespace squeeze::train {

template <class P>
concept CheckpointHomePart = requires(P& p, const P& cp, MemoryUse& m, TransferCounters& t) {
  { P::on_host } -> std::convertible_to<bool>;
  p.scope();     // an RAII object alive over the forward
  p.end_pass();  // after backward, or when it failed
  cp.add_memory(m);
  cp.add_transfers(t);
};

struct DeviceCheckpoints {
  static constexpr bool on_host = false;
  explicit DeviceCheckpoints(TrainContext&) {}
  struct Scope {};
  Scope scope() { return {}; }
  void end_pass() {}
  void add_memory(MemoryUse&) const {}
  void add_transfers(TransferCounters&) const {}
};

template <StrategyType S>
class StoredCheckpoints {
 public:
  static constexpr bool on_host = S::checkpoints_on_host;
  explicit StoredCheckpoints(TrainContext& ctx)
      : store_(std::make_unique<engine::ActivationStore>(ctx.device, ctx.opt.checkpoint_prefetch, ctx.opt.activation_host_bytes,
                                                         S::checkpoint_bits == 8, S::checkpoints_on_host)) {}
  nn::CheckpointOffloadScope scope() { return nn::CheckpointOffloadScope(store_.get()); }
  void end_pass() { store_->end_pass(); }
  void add_memory(MemoryUse& m) const { m.checkpoint_host_bytes += store_->stats().host_bytes; }
  void add_transfers(TransferCounters& t) const {
    const engine::ActivationStats s = store_->stats();
    t.d2h_bytes += s.d2h_bytes;
    t.h2d_bytes += s.h2d_bytes;
  }
  const engine::ActivationStore& store() const { return *store_; }

 private:
  std::unique_ptr<engine::ActivationStore> store_;  // on the heap: the autograd graph points to it
};

template <StrategyType S>
using CheckpointHomeOf = std::conditional_t<S::checkpoint_offload::stores, StoredCheckpoints<S>, DeviceCheckpoints>;

}  // namespace squeeze::train
