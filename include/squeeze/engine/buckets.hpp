#pragma once
// Gradient reduction of the whole-kept parameters under stages 2 and 3: buckets of about
// TrainerOptions::bucket_bytes, reduce-scattered during backward by a post-accumulate-grad hook per parameter;
// and GradState, what those hooks and stage 3's callbacks reach while backward runs. Used by train/trainer.hpp.
// With asynchronous device collectives (NCCL) a bucket's reduce-scatter, its add into the shard and its offload
// hand-over run on the collectives' side stream (the one stage 3 uses), behind the compute that filled the bucket,
// so backward goes on meanwhile; the trainer joins the side stream once backward's buckets are all reduced.
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>

#include "squeeze/comm/communicator.hpp"
#include "squeeze/engine/collectives.hpp"
#include "squeeze/engine/flat_params.hpp"
#include "squeeze/engine/offload.hpp"
#include "squeeze/engine/streams.hpp"
#include "squeeze/kernels/grad_norm.hpp"

namespace squeeze::engine {

namespace detail {

// Sum of squares in double, deterministic: host sequentially; device by sum_squares_tensor (engine/offload.hpp, the
// function Offload<Host> runs on the device too, so offloaded and device-resident partitions give the same bits),
// one read-back.
inline double sum_squares(const torch::Tensor& t) {
  if (t.numel() == 0) return 0.0;
  if (!t.is_cpu()) return sum_squares_tensor(t).item<double>();
  const torch::Tensor c = t.contiguous();
  const int64_t n = c.numel();
  double acc = 0;
  auto run = [&]<class T>(const T* p) {
    for (int64_t i = 0; i < n; ++i) acc = kernels::NormOp<kernels::NormType::L2>::element(acc, to_float(p[i]));
  };
  switch (c.scalar_type()) {
    case torch::kFloat32:
      run(c.data_ptr<float>());
      break;
    case torch::kBFloat16:
      run(reinterpret_cast<const bf16*>(c.data_ptr()));
      break;
    case torch::kFloat16:
      run(reinterpret_cast<const half*>(c.data_ptr()));
      break;
    default:
      TORCH_CHECK(false, "sum_squares: unsupported gradient dtype ", c.scalar_type());
  }
  return acc;
}

}  // namespace detail

namespace detail {

// What backward hooks and stage-3 callbacks reach while backward runs (on the heap: the Trainer may move).
struct GradState {
  comm::CommPtr comm;
  SideStream* collectives = nullptr;  // the trainer's; active only for asynchronous device collectives (see the header)
  torch::Device device{torch::kCPU};
  bool final_micro = false;  // this micro-step ends the accumulation window
  bool defer = false;        // hooks only collect; buckets are reduced after backward (see Trainer)
  OffloadPipeline* offload = nullptr;
  OffloadPipeline::Fn eager;         // set for a boundary micro-step when the offloaded update may run at once
  int64_t shard_bytes = 0;           // device bytes of the reduced gradient shards (constant)
  int64_t live = 0;                  // device bytes of in-flight bucket buffers
  int64_t peak_live = 0;             // most of `live` seen
  int64_t peak_grad = 0;             // most of shard_bytes + live + one parameter's .grad seen in a hook
  int64_t reduce_scatter_bytes = 0;  // bytes entering reduce-scatters, this accumulation window
  void note(int64_t transient) {
    peak_live = std::max(peak_live, live);
    peak_grad = std::max(peak_grad, shard_bytes + live + transient);
  }
};

// Stage 2 (and stage 3's whole-kept parameters): parameters whose gradients are reduce-scattered together.
struct Bucket {
  FlatParams flat;       // [padded] parameters; the module's parameters are views into it
  torch::Tensor send;    // [padded] compute dtype: this micro-step's local gradients while they arrive
  int pending = 0;       // parameters whose gradient has not arrived this micro-step
  bool reduced = false;  // reduce-scattered this micro-step
  Partition own;         // this rank's shard of the bucket
};

// Sends a bucket's gradients (zeros where none arrived) through the reduce-scatter into its shard.
inline void reduce_bucket(Bucket& b, GradState& st) {
  if (!b.send.defined()) {
    b.send = torch::zeros({b.flat.padded()}, b.flat.options());
    st.live += int64_t(b.send.nbytes());
  }
  const int64_t mine_bytes = b.flat.shard() * int64_t(b.send.element_size());  // the shard the reduce-scatter writes
  st.live += mine_bytes;
  st.note(0);
  const bool hand_over = st.final_micro && st.offload && st.offload->threaded();
  reduce_scatter_add(*st.comm, *st.collectives, st.device, b.send, b.own.grad, [&] {
    if (hand_over) st.offload->gradient_ready(b.own, st.eager);  // its copies queue behind the add
  });
  st.reduce_scatter_bytes += int64_t(b.send.nbytes());
  st.live -= int64_t(b.send.nbytes()) + mine_bytes;
  b.send = torch::Tensor();
  b.reduced = true;
}

// The post-accumulate-grad hook of one bucketed parameter: its .grad moves into the bucket buffer.
struct BucketHook final : torch::autograd::PostAccumulateGradHook {
  Bucket* bucket;
  const FlatEntry* entry;
  GradState* state;
  BucketHook(Bucket* b, const FlatEntry* e, GradState* s) : bucket(b), entry(e), state(s) {}
  void operator()(const torch::autograd::Variable& param) override {
    const torch::Tensor g = param.grad();
    if (!g.defined()) return;
    Bucket& b = *bucket;
    GradState& st = *state;
    TORCH_CHECK(!b.reduced, "Stage2: a gradient of '", entry->name,
                "' arrived after its bucket was reduced (a second "
                "backward in one step() is not supported)");
    if (!b.send.defined()) {
      b.send = torch::zeros({b.flat.padded()}, b.flat.options());
      st.live += int64_t(b.send.nbytes());
    }
    st.note(int64_t(g.nbytes()));
    FlatParams::view(b.send, *entry).copy_(g);
    param.mutable_grad().reset();  // autograd's full-size .grad is freed: only the bucket holds it
    if (--b.pending == 0 && !st.defer) reduce_bucket(b, st);
  }
};

}  // namespace detail

}  // namespace squeeze::engine
