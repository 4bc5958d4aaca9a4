#pragma once
// What the gradient-synchronisation parts share (docs/architecture.md, "The trainer's parts"): the global sum of
// squares over partitions and the memory a partition's state holds. The parts themselves:
//   ReplicatedGrads<S>  stages 0-1: one flat buffer of every trainable parameter, reduced at the window's end
//   BucketedGrads<S>    stage 2: buckets reduce-scattered during backward by a hook per parameter
//   GatherUnits<S>      stage 3: gather units, each gathered for its forward and backward and reduce-scattered once
//                       (with BucketedGrads for the parameters kept whole)
#include <torch/torch.h>

#include <vector>

#include "squeeze/train/options.hpp"
#include "squeeze/train/parts/context.hpp"

namespace squeeze::train {

// The global sum of squares of the partitions' reduced gradients (scaled), identical on every rank. Device partitions
// are summed on the device in the same order and association as the host's doubles (so the same bits): device_sum_squares
// leaves the sum there ([1] float64, all-reduced over ranks, no host sync) and partition_sum_squares reads it back once,
// one host sync per optimizer step, not one per partition. Where the state part holds host copies, each partition's
// sum comes from it.
inline torch::Tensor device_sum_squares(TrainContext& ctx, const std::vector<Partition*>& parts) {
  torch::Tensor t =
      torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat64).device(ctx.device));  // where the communicator takes buffers
  for (Partition* o : parts) t.add_(sum_squares_tensor(o->grad));
  if (ctx.world > 1) all_reduce_inplace(*ctx.comm, t, comm::ReduceOp::sum);
  return t;
}
template <class State>
double partition_sum_squares(TrainContext& ctx, const std::vector<Partition*>& parts, State& state) {
  if (state.sums_on_device()) return device_sum_squares(ctx, parts).item<double>();
  double local = 0;
  for (Partition* o : parts) local += state.host_sum_squares(*o);
  if (ctx.world == 1) return local;
  torch::Tensor t = torch::full({1}, local, torch::TensorOptions().dtype(torch::kFloat64).device(ctx.device));
  all_reduce_inplace(*ctx.comm, t, comm::ReduceOp::sum);
  return t.item<double>();
}

// Bytes of partition o's state in m: its gradient where it is a buffer of its own, the master and moments where the
// state lives, the host gradient copy.
inline void add_partition_memory(MemoryUse& m, const Partition& o, bool grad_is_separate, bool state_on_host) {
  auto add = [](plan::Placement& p, const torch::Tensor& t, bool host) {
    if (t.defined()) (host ? p.host : p.device) += int64_t(t.nbytes());
  };
  if (grad_is_separate) add(m.gradients, o.grad, false);
  add(m.master_weights, o.master, state_on_host);
  add(m.optimizer_state, o.m, state_on_host);
  add(m.optimizer_state, o.v, state_on_host);
  add(m.optimizer_state, o.m_absmax, state_on_host);
  add(m.optimizer_state, o.v_absmax, state_on_host);
  add(m.gradients, o.host_grad, true);
}

}  // namespace squeeze::train
