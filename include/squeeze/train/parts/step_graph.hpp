#pragma once
// How a micro-batch's forward and backward are launched: a part of the trainer (docs/architecture.md, "The trainer's
// parts"), chosen by the graph policy (policy/graph.hpp).
//   EagerStep  Eager: the closure runs on the caller's tensors, every kernel launched as it comes.
//   StepGraph  Graphed: the batch is copied into input buffers the part keeps (the same shapes, types and device every
//              call: checked), the first kGraphWarmup micro-batches run eagerly on a side stream (libraries make their
//              workspaces and plans on first use, which a capture may not), the next one is captured into a CUDA graph
//              and every one from then on replays it. The loss weight is part of the graph: it must not change.
//              On a CPU device there are no graphs and every micro-batch runs eagerly, under the same rules.
// Both run `forward_backward(inputs)` (the closure's forward, backward into the gradient buffers, the detached loss);
// whatever the host does around it (the window, the update, the loss read-back) runs on every call.
#include <torch/torch.h>

#include <concepts>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "squeeze/engine/streams.hpp"
#include "squeeze/policy/strategy.hpp"

#if SQUEEZE_NN_STREAMS
#include <ATen/cuda/CUDAGraph.h>
#endif

namespace squeeze::train {

using StepInputs = std::vector<torch::Tensor>;
using ForwardBackward = std::function<torch::Tensor(const StepInputs&)>;  // -> [] the micro-batch's loss, detached

template <class P>
concept StepLaunchPart = requires(P& p, const StepInputs& in, const ForwardBackward& f) {
  { P::graphed } -> std::convertible_to<bool>;
  { p.run(in, 1.0, f) } -> std::same_as<torch::Tensor>;  // the batch, the loss weight, forward + backward
};

struct EagerStep {
  static constexpr bool graphed = false;
  explicit EagerStep(torch::Device) {}
  torch::Tensor run(const StepInputs& batch, double, const ForwardBackward& forward_backward) { return forward_backward(batch); }
};

class StepGraph {
 public:
  static constexpr bool graphed = true;
  static constexpr int kGraphWarmup = 3;  // eager micro-batches before the capture (as PyTorch's whole-network example)

  explicit StepGraph(torch::Device device) : device_(device) {}

  torch::Tensor run(const StepInputs& batch, double loss_weight, const ForwardBackward& forward_backward) {
    stage(batch);
    check_weight(loss_weight);
#if SQUEEZE_NN_STREAMS
    if (device_.is_cuda()) return run_cuda(forward_backward);
#endif
    return forward_backward(inputs_);
  }

  // How many micro-batches ran eagerly, and whether the graph exists (Trainer::eager_micro_batches, graph_captured).
  int eager_runs() const { return eager_runs_; }
  bool captured() const {
#if SQUEEZE_NN_STREAMS
    return graph_ != nullptr;
#else
    return false;
#endif
  }

 private:
  static std::string describe(const torch::Tensor& t) {
    std::ostringstream s;
    s << t.sizes() << " " << t.scalar_type() << " on " << t.device();
    return s.str();
  }

  // The batch into the part's buffers: made at the first call, the same shapes ever after.
  void stage(const StepInputs& batch) {
    if (inputs_.empty()) {  // made whole or not at all: a refused first batch leaves the next call a first one
      TORCH_CHECK(!batch.empty(), "Trainer::step (Graphed): the batch has no tensors; pass the tensors the closure reads");
      StepInputs made;
      for (std::size_t i = 0; i < batch.size(); ++i) {
        TORCH_CHECK(batch[i].defined(), "Trainer::step (Graphed): input ", i, " of the batch is undefined");
        made.push_back(torch::empty_like(batch[i], batch[i].options().device(device_), at::MemoryFormat::Contiguous));
      }
      inputs_ = std::move(made);
    }
    TORCH_CHECK(batch.size() == inputs_.size(), "Trainer::step (Graphed): ", batch.size(), " inputs, but the first micro-batch had ",
                inputs_.size(), ": pass the same tensors every call");
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const torch::Tensor& t = batch[i];
      const torch::Tensor& b = inputs_[i];
      TORCH_CHECK(t.defined() && t.sizes() == b.sizes() && t.scalar_type() == b.scalar_type(), "Trainer::step (Graphed): input ", i, " is ",
                  t.defined() ? describe(t) : std::string("undefined"), ", but the step's buffers hold ", describe(b),
                  " since the first micro-batch: a CUDA graph replays fixed shapes; pad or cut every batch to that shape, or "
                  "remove Graphed");
      b.copy_(t, /*non_blocking=*/true);
    }
  }

  void check_weight(double w) {
    if (!weight_) weight_ = w;
    TORCH_CHECK(*weight_ == w, "Trainer::step (Graphed): the micro-batch's loss weight is ", w, " but the step was built with ", *weight_,
                ": the graph multiplies by the weight it was captured with, so a weight that changes cannot be replayed; "
                "remove Graphed");
  }

#if SQUEEZE_NN_STREAMS
  torch::Tensor run_cuda(const ForwardBackward& forward_backward) {
    if (graph_) {
      graph_->replay();  // on the current stream, after the inputs' copies
      return loss_.clone();
    }
    if (!side_) side_ = std::make_unique<engine::SideStream>(device_);
    side_->wait(engine::record_current(device_));
    torch::Tensor loss;
    if (eager_runs_ < kGraphWarmup) {
      side_->run([&] { loss = forward_backward(inputs_); });
      ++eager_runs_;
    } else {
      auto graph = std::make_unique<at::cuda::CUDAGraph>();
      side_->run([&] {
        graph->capture_begin();
        try {
          loss_ = forward_backward(inputs_);
        } catch (const std::exception& e) {
          abandon(*graph);
          TORCH_CHECK(false, "Trainer::step (Graphed): capturing forward and backward into a CUDA graph failed: ", e.what(),
                      "\nsomething in them waits for the device (a .item(), a copy to the host) or changes from call to call; "
                      "remove Graphed, or keep such work out of the closure");
        }
        graph->capture_end();
      });
      graph_ = std::move(graph);
    }
    engine::wait_current(device_, side_->record());
    if (!graph_) return loss;
    graph_->replay();  // the capture only recorded the kernels: this micro-batch runs now
    return loss_.clone();
  }

  // A capture that threw: end it (the allocator stops drawing from the graph's pool first), whatever state it is in.
  static void abandon(at::cuda::CUDAGraph& graph) {
    try {
      graph.capture_end();
    } catch (const std::exception&) {}
    (void)cudaGetLastError();
  }

  std::unique_ptr<engine::SideStream> side_;
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
  torch::Tensor loss_;  // [] written by every replay
#endif

  torch::Device device_;
  StepInputs inputs_;
  std::optional<double> weight_;
  int eager_runs_ = 0;
};

template <StrategyType S>
using StepLaunchOf = std::conditional_t<S::graphed, StepGraph, EagerStep>;

static_assert(StepLaunchPart<EagerStep> && StepLaunchPart<StepGraph>);

}  // namespace squeeze::train
