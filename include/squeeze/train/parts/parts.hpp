#pragma once
// The parts a Trainer is composed of, chosen by its Strategy (docs/architecture.md, "The trainer's parts"):
//
//   part                   concept              chosen by                  implementations
//   gradient sync          GradientSyncPart     Sharded<Stage0..3>         ReplicatedGrads, BucketedGrads, GatherUnits
//   parameter home         ParamHomePart        Offload<Host, Streamed>      DeviceParams, HostParams (stage-3 units)
//   optimizer state        OptimizerStatePart   Offload<Host>, Quantized8  DeviceAdamW, HostAdamW
//   loss scale             (LossScale<S>)       the loss-scale policy      none, static, dynamic
//   accumulation window    (AccumulationWindow) Accumulate<N>              one
//   checkpoint home        CheckpointHomePart   CheckpointOffload<..>      DeviceCheckpoints, StoredCheckpoints
//   step launch            StepLaunchPart       Eager, Graphed             EagerStep, StepGraph
//
// A new way to hold or move tensors is one new part: a class that satisfies its concept, named in TrainerParts.
#include <torch/torch.h>

#include <concepts>
#include <type_traits>
#include <vector>

#include "squeeze/train/parts/activation_home.hpp"
#include "squeeze/train/parts/adamw_state.hpp"
#include "squeeze/train/parts/bucketed_grads.hpp"
#include "squeeze/train/parts/context.hpp"
#include "squeeze/train/parts/gather_units.hpp"
#include "squeeze/train/parts/loss_scale.hpp"
#include "squeeze/train/parts/param_home.hpp"
#include "squeeze/train/parts/replicated_grads.hpp"
#include "squeeze/train/parts/step_graph.hpp"
#include "squeeze/train/parts/window.hpp"

namespace squeeze::train {

// Where the optimizer state lives and who updates it.
template <class P>
concept OptimizerStatePart = requires(P& p, Partition& o, const std::vector<Partition*>& parts, const GroupCoeffs& cs, torch::Tensor t,
                                      const FlatParams& layout) {
  { P::on_host } -> std::convertible_to<bool>;
  { P::zeroes_gradients } -> std::convertible_to<bool>;
  { P::decides_on_device } -> std::convertible_to<bool>;  // apply_deciding_on_device (DeviceAdamW in an nvcc TU)
  p.own(o, t, t, layout, int64_t(0));                     // allocate and seed a partition's state
  { p.sums_on_device() } -> std::convertible_to<bool>;
  { p.host_sum_squares(o) } -> std::convertible_to<double>;
  p.begin_micro_step(true, true, cs);               // boundary, nothing global bars an early update, next coeffs
  p.gradients_final(parts);                         // the window's gradients are all reduced
  { p.take_eager() } -> std::convertible_to<bool>;  // whether updates already ran as gradients landed
  p.apply(parts, cs, 1.0f, 1.0f, false);            // coeffs, inverse loss scale, clip coefficient, eager
  p.skip();                                         // the step overflowed
  p.wait_all();
};

// Where a stage-3 unit's shard lives between uses, and how its gradient leaves the device.
template <class P>
concept ParamHomePart = requires(P& p, const P& cp, Stage3Group& g, Partition& o, MemoryUse& m, const torch::Tensor& t) {
  { P::on_host } -> std::convertible_to<bool>;
  { cp.place(t) } -> std::same_as<torch::Tensor>;           // the unit's shard [S] where it lives
  { cp.gradient_shard(t) } -> std::same_as<torch::Tensor>;  // its device gradient shard (undefined: none)
  cp.connect(g, o);                                         // the unit's hooks into the optimizer state's pipeline
  cp.add_memory(m, g);
};

// How gradients are synchronised over ranks, and which partitions this rank updates.
template <class P>
concept GradientSyncPart = requires(P& p, const P& cp, MemoryUse& m, DeviceAdamW<Strategy<>>& state) {
  { P::hands_over_in_backward } -> std::convertible_to<bool>;
  { p.partitions() } -> std::same_as<std::vector<Partition*>>;
  { p.views() } -> std::same_as<std::vector<PartitionView>>;
  p.rank_partitions();
  { cp.ranked_by_forward() } -> std::convertible_to<bool>;
  p.begin_micro_step(true);
  p.begin_forward();
  p.begin_backward();
  p.end_backward();
  p.abort_pass();
  p.after_backward(true);
  { p.sum_squares(state) } -> std::convertible_to<double>;
  { p.device_sum_squares() } -> std::same_as<torch::Tensor>;  // the same sum left on the device (device partitions)
  p.gather_updated();
  p.zero_window(true);
  cp.add_memory(m, true);
  { cp.reduce_scatter_bytes() } -> std::convertible_to<int64_t>;
  p.gradient_buffers_changed(GradientBuffers::kept);
  p.restore_module();
};

// The table: one type per part for Strategy S.
template <StrategyType S>
struct TrainerParts {
  using ParamHome = ParamHomeOf<S>;
  using GradientSync =
      std::conditional_t<S::stage == 3, GatherUnits<S, ParamHome>, std::conditional_t<S::stage == 2, BucketedGrads<S>, ReplicatedGrads<S>>>;
  using OptimizerState = std::conditional_t<S::offload_to_host, HostAdamW<S>, DeviceAdamW<S>>;
  using Scale = LossScale<S>;
  using Window = AccumulationWindow<S::accumulation_steps>;
  using Checkpoints = CheckpointHomeOf<S>;
  using StepLaunch = StepLaunchOf<S>;
  static_assert(ParamHomePart<ParamHome>);
  static_assert(GradientSyncPart<GradientSync>);
  static_assert(OptimizerStatePart<OptimizerState>);
  static_assert(CheckpointHomePart<Checkpoints>);
  static_assert(StepLaunchPart<StepLaunch>);
};

}  // namespace squeeze::train
