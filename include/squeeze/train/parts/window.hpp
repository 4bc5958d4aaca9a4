#pragma once
// The accumulation window of a trainer (docs/architecture.md): which micro-batch of Accumulate<N> this is, and the
// weight of its loss: 1 / N, or with token weighting its tokens / (the window's tokens on all ranks), so the
// window's gradient is that of one big batch whatever the micro-batches' sizes.
#include <torch/torch.h>

#include <cstdint>

#include "squeeze/engine/collectives.hpp"

namespace squeeze::train {

template <int N>
class AccumulationWindow {
 public:
  struct MicroBatch {
    bool boundary;  // the window's last micro-batch: the update follows
    double weight;  // the loss's weight in the window's gradient
  };

  // tokens: the micro-batch's target count, or 0 when the window is not token-weighted.
  MicroBatch begin(int64_t tokens, comm::Communicator& comm, torch::Device device) {
    if (micro_ == 0) weighted_ = tokens > 0, tokens_ = 0;
    TORCH_CHECK(weighted_ == (tokens > 0), "Trainer::step: micro-batch ", micro_ + 1, " of ", N,
                tokens > 0 ? " passes a token count but the window's first did not"
                           : " passes no token count but the window's first did: pass it to every step() of a window");
    MicroBatch mb{micro_ + 1 == N, 1.0 / double(N)};
    if (tokens > 0) {
      // The reference count: the largest first micro-batch over the ranks (one collective, once), so each
      // micro-batch's gradient is scaled by about 1 (no overflow under fp16's loss scale).
      if (reference_ == 0) reference_ = comm.size() == 1 ? tokens : int64_t(reduce(comm, device, double(tokens), comm::ReduceOp::max));
      mb.weight = double(tokens) / double(reference_);
      tokens_ += tokens;
    }
    return mb;
  }
  void end(bool boundary) { micro_ = boundary ? 0 : micro_ + 1; }

  // The factor that turns the reduced (rank-averaged) gradient into the token-weighted mean (1 unweighted).
  double token_factor(comm::Communicator& comm, torch::Device device) const {
    if (!weighted_) return 1.0;
    const double total = comm.size() == 1 ? double(tokens_) : reduce(comm, device, double(tokens_), comm::ReduceOp::sum);
    return double(comm.size()) * double(reference_) / total;
  }
  bool weighted() const { return weighted_; }
  int micro() const { return micro_; }  // micro-batches stepped in the current window

 private:
  static double reduce(comm::Communicator& comm, torch::Device device, double x, comm::ReduceOp op) {
    auto t = torch::full({1}, x, torch::TensorOptions().dtype(torch::kFloat64).device(device));
    all_reduce_inplace(comm, t, op);
    return t.item<double>();
  }
  int micro_ = 0;
  bool weighted_ = false;  // this window's micro-batches pass token counts
  int64_t tokens_ = 0;     // their sum on this rank
  int64_t reference_ = 0;  // token weighting's reference count
};

}  // namespace squeeze::train
