#pragma once
// ZeRO stage 3 in libtorch: layers whose parameters live as 1/N shards and are all-gathered just
// before the layer's forward and again before its backward, then freed.
//
//   nn::ShardedLinear / nn::ShardedEmbedding  drop-in for torch::nn::Linear / Embedding (same parameter
//       names, init and math). Unattached (stages 0-2, or plain use) they ARE a Linear / Embedding.
//       Attached by a stage-3 trainer, each owns a Stage3Group: its parameters' flat layout, its shard
//       [S] and its gradient shard; the module's own `weight`/`bias` are emptied (numel 0).
//   Stage3Runtime   the gathers: all_gather into a transient [padded] buffer, release after use, and
//       prefetch of the next layer in execution order (forward order recorded on the first pass,
//       backward = its reverse). Gradients: the layer's full gradient is reduce-scattered (average) in
//       its backward and added into the group's gradient shard, then freed.
//
// Why autograd Functions: libtorch modules have no forward hooks, so the gather must sit inside the
// layer's own forward; and a layer's backward must run even when its input needs no gradient (the
// first layer), so the shard tensor is an input of the Function (a leaf that requires grad; its own
// .grad stays empty: the reduced gradient goes to the group's gradient shard in its accumulation dtype).
//
// The backward uses exactly the ATen ops of linear's / embedding's own derivatives (g^T·x,
// g·W, sum over rows; embedding_dense_backward), so stage 3 produces the same gradient bits as an
// unsharded layer.
//
// Threads as ranks: CPU backward runs on the calling thread, so LocalComm's thread-ranks work. libtorch
// runs all CUDA backward work of a process on one worker thread per device, so thread-ranks sharing one
// GPU would block each other inside backward: on GPUs use one process per device (NcclComm), or
// LocalComm at world size 1.
//
// Prefetch: one layer ahead (forward order in forward, its reverse in backward), issued right after the
// current layer's gather. On CUDA with a device communicator (NcclComm) the gathers and the
// gradient reduce-scatters run on a side stream (train/streams.hpp): the side stream waits for the compute
// issued so far, the collective is enqueued without a host wait, and the compute stream waits for the
// gathered buffer only where the layer uses it -- so the next layer's gather overlaps this layer's compute.
// Elsewhere (CPU, LocalComm) the same operations run in the same order, blocking.
//
// Readiness: a layer's gradient is final for the micro-step when it has been reduced as many times as
// the layer ran with grad enabled (uses counted in the module's forward: a checkpointed segment's no-grad
// first pass does not count, its recompute does; a layer used twice reduces twice). Then grad_done() runs
// (the trainer's hook: Offload<Host> streams the shard to the host there).
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "../comm/communicator.hpp"
#include "../train/flat_params.hpp"
#include "../train/streams.hpp"

namespace squeeze::nn {

inline comm::DType comm_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return comm::DType::f32;
    case torch::kFloat16: return comm::DType::f16;
    case torch::kBFloat16: return comm::DType::bf16;
    case torch::kFloat64: return comm::DType::f64;
    case torch::kInt32: return comm::DType::i32;
    case torch::kInt64: return comm::DType::i64;
    case torch::kUInt8: return comm::DType::u8;
    default: TORCH_CHECK(false, "squeeze comm: unsupported dtype ", t);
  }
}

// Tensor collectives of the torch layer (blocking: they synchronize the communicator). At world size 1
// they are a torch copy or nothing, so a single process works with any backend on any device, whatever
// its translation unit was compiled with.
//   gather_into:         shard [n] -> full [size*n] (shard may be full's own slice: in place)
//   reduce_scatter_avg:  full [size*n] -> shard [n], average over ranks (shard may be full's own slice)
inline void gather_into(comm::Communicator& c, const torch::Tensor& shard, const torch::Tensor& full) {
  if (c.size() == 1) {
    if (shard.data_ptr() != full.data_ptr()) full.copy_(shard);
    return;
  }
  c.all_gather(shard.data_ptr(), full.data_ptr(), std::size_t(shard.numel()), comm_dtype(full.scalar_type()));
  c.synchronize();
}
inline void reduce_scatter_avg(comm::Communicator& c, const torch::Tensor& full, const torch::Tensor& shard) {
  if (c.size() == 1) {
    if (shard.data_ptr() != full.data_ptr()) shard.copy_(full.narrow(0, 0, shard.numel()));
    return;
  }
  c.reduce_scatter(full.data_ptr(), shard.data_ptr(), std::size_t(shard.numel()), comm_dtype(full.scalar_type()),
                   comm::ReduceOp::avg);
  c.synchronize();
}
inline void all_reduce_inplace(comm::Communicator& c, const torch::Tensor& t, comm::ReduceOp op) {
  if (c.size() == 1) return;
  c.all_reduce(t.data_ptr(), t.data_ptr(), std::size_t(t.numel()), comm_dtype(t.scalar_type()), op);
  c.synchronize();
}
inline void broadcast_inplace(comm::Communicator& c, const torch::Tensor& t, int root) {
  if (c.size() == 1) return;
  c.broadcast(t.data_ptr(), t.data_ptr(), std::size_t(t.numel()), comm_dtype(t.scalar_type()), root);
  c.synchronize();
}

class Stage3Runtime;

// One sharded layer's state (owned by the Stage3Runtime, pointed to by the module).
struct Stage3Group {
  std::string name;
  FlatParams layout;          // entries + sizes; no flat buffer of its own
  torch::Tensor shard;        // [S] compute dtype; leaf that requires grad (see above)
  torch::Tensor grad_shard;   // [S] accumulation dtype: reduced gradients of this step's micro-batches
  torch::Tensor gathered;     // [padded] while gathered (forward/backward of this layer), else undefined
  Event gathered_ready;       // side-stream gather still in flight (CUDA)
  Stage3Runtime* runtime = nullptr;
  int uses = 0, reduced = 0;  // this micro-step: grad-enabled forwards, gradient reductions
  std::function<void()> before_gather;  // trainer: wait until this shard's update has landed
  std::function<void()> grad_done;      // trainer: the gradient shard is final for this micro-step
  bool finished() const { return uses > 0 && reduced == uses; }
};

// Interface of modules that a stage-3 trainer can shard.
class Shardable {
 public:
  virtual ~Shardable() = default;
  // (name, parameter) in flat order.
  virtual std::vector<std::pair<std::string, torch::Tensor>> shardable_parameters() = 0;
  virtual void attach(Stage3Group* group) = 0;
  virtual Stage3Group* group() const = 0;
};

class Stage3Runtime {
 public:
  Stage3Runtime(comm::CommPtr comm, bool prefetch, torch::Device device = torch::kCPU)
      : comm_(std::move(comm)), prefetch_(prefetch), device_(device) {
    // Asynchronous collectives need a communicator that takes device memory and honours streams (NCCL; at
    // world size 1 too, where NCCL's collectives are copies: that is how one GPU tests this path).
    if (device.is_cuda() && comm_->device_buffers() && comm_->backend() != "local")
      side_ = SideStream(device);
  }

  void add_group(Stage3Group& g) { groups_.push_back(&g); }

  enum class Phase { forward, backward, idle };
  void set_phase(Phase p) {
    if (p == Phase::forward)
      for (auto* g : groups_) g->uses = g->reduced = 0;
    phase_ = p;
    if (p == Phase::backward || p == Phase::idle) {
      if (!order_.empty()) order_final_ = true;
    }
    if (p == Phase::idle && side_.active()) {
      // The compute stream waits for the side stream's reductions; a failed or timed-out collective throws here.
      wait_current(device_, side_.record());
      comm_->synchronize(side_.handle());
    }
  }
  Phase phase() const { return phase_; }

  // The layer's full flat parameters [padded] (gathering them unless already prefetched), then
  // prefetches the next layer of this pass.
  torch::Tensor acquire(Stage3Group& g) {
    if (phase_ == Phase::forward && !order_final_) {
      index_[&g] = order_.size();
      order_.push_back(&g);
    }
    if (!g.gathered.defined()) gather(g);
    torch::Tensor full = g.gathered;
    if (!g.gathered_ready.empty()) {  // side-stream gather: the compute stream waits here, not the host
      wait_current(device_, g.gathered_ready);
      record_use_current(full);
      g.gathered_ready = Event();
    }
    if (prefetch_ && order_final_) {
      auto it = index_.find(&g);
      if (it != index_.end()) {
        const std::ptrdiff_t i = std::ptrdiff_t(it->second), next = phase_ == Phase::backward ? i - 1 : i + 1;
        if (next >= 0 && next < std::ptrdiff_t(order_.size())) {
          Stage3Group& n = *order_[std::size_t(next)];
          // Not a layer whose backward is done (a checkpoint recompute may run ahead of the order).
          if (!n.gathered.defined() && !(phase_ == Phase::backward && n.finished())) gather(n);
        }
      }
    }
    return full;
  }
  void release(Stage3Group& g) {
    if (g.gathered.defined()) {
      live_bytes_ -= g.gathered.nbytes();
      g.gathered = torch::Tensor();
    }
  }
  // Frees whatever a pass left gathered (a prefetch the graph did not use).
  void release_all() {
    for (auto* g : order_) release(*g);
  }

  // Reduce-scatters a layer's full gradient [padded] (average over ranks) and adds it into its shard;
  // calls g.grad_done() once the layer's gradient for this micro-step is complete.
  void reduce_grad(Stage3Group& g, const torch::Tensor& full_grad) {
    track(full_grad.nbytes());
    if (side_.active()) {
      side_.wait(record_current(device_));
      side_.record_use(full_grad);
      side_.run([&] {
        auto mine = torch::empty({g.layout.shard()}, full_grad.options());
        comm_->reduce_scatter(full_grad.data_ptr(), mine.data_ptr(), std::size_t(mine.numel()),
                              comm_dtype(full_grad.scalar_type()), comm::ReduceOp::avg, side_.handle());
        g.grad_shard.add_(mine);
        if (++g.reduced == g.uses && g.grad_done) g.grad_done();  // its transfers queue behind the add
      });
    } else {
      auto mine = torch::empty({g.layout.shard()}, full_grad.options());
      reduce_scatter_avg(*comm_, full_grad, mine);
      g.grad_shard.add_(mine);
      if (++g.reduced == g.uses && g.grad_done) g.grad_done();
    }
    live_bytes_ -= full_grad.nbytes();
  }

  comm::Communicator& comm() { return *comm_; }
  int64_t peak_bytes() const { return peak_bytes_; }  // largest sum of live gathered + gradient buffers
  void reset_peak() { peak_bytes_ = live_bytes_; }

 private:
  void gather(Stage3Group& g) {
    if (g.before_gather) g.before_gather();
    if (side_.active()) {
      side_.wait(record_current(device_));  // the shard's latest values are queued on the compute stream
      auto full = side_.run([&] { return torch::empty({g.layout.padded()}, g.shard.options().requires_grad(false)); });
      track(full.nbytes());
      comm_->all_gather(g.shard.data_ptr(), full.data_ptr(), std::size_t(g.layout.shard()),
                        comm_dtype(full.scalar_type()), side_.handle());
      g.gathered = full;
      g.gathered_ready = side_.record();
      return;
    }
    auto full = torch::empty({g.layout.padded()}, g.shard.options().requires_grad(false));
    track(full.nbytes());
    gather_into(*comm_, g.shard.detach(), full);
    g.gathered = full;
  }
  void track(int64_t bytes) {
    live_bytes_ += bytes;
    peak_bytes_ = std::max(peak_bytes_, live_bytes_);
  }

  comm::CommPtr comm_;
  bool prefetch_;
  torch::Device device_;
  SideStream side_;  // active only for asynchronous device collectives (see the header comment)
  Phase phase_ = Phase::idle;
  std::vector<Stage3Group*> groups_;
  std::vector<Stage3Group*> order_;
  std::unordered_map<const Stage3Group*, std::size_t> index_;
  bool order_final_ = false;
  int64_t live_bytes_ = 0, peak_bytes_ = 0;
};

namespace detail {

inline Stage3Group* group_from(torch::autograd::AutogradContext* ctx) {
  return reinterpret_cast<Stage3Group*>(ctx->saved_data["group"].toInt());
}

// y = x W^T + b with W, b gathered from the shard. x: [..., in], y: [..., out].
struct ShardedLinearFn : torch::autograd::Function<ShardedLinearFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& shard,
                               int64_t group_ptr) {
    (void)shard;
    auto* g = reinterpret_cast<Stage3Group*>(group_ptr);
    const torch::Tensor full = g->runtime->acquire(*g);
    const auto& es = g->layout.entries();
    const torch::Tensor w = FlatParams::view(full, es[0]);
    const torch::Tensor b = es.size() > 1 ? FlatParams::view(full, es[1]) : torch::Tensor();
    torch::Tensor y = torch::nn::functional::linear(x, w, b);
    g->runtime->release(*g);
    ctx->save_for_backward({x});
    ctx->saved_data["group"] = group_ptr;
    return y;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list grads) {
    Stage3Group* g = group_from(ctx);
    const torch::Tensor x = ctx->get_saved_variables()[0];
    const torch::Tensor full = g->runtime->acquire(*g);
    const auto& es = g->layout.entries();
    const torch::Tensor w = FlatParams::view(full, es[0]);  // [out, in]
    const int64_t out = w.size(0), in = w.size(1);
    const torch::Tensor go = grads[0].reshape({-1, out});    // [rows, out]
    const torch::Tensor x2 = x.reshape({-1, in});           // [rows, in]
    torch::Tensor gx;
    if (ctx->needs_input_grad(0)) gx = go.mm(w).view(x.sizes());
    auto full_grad = torch::zeros({g->layout.padded()}, full.options());
    FlatParams::view(full_grad, es[0]).copy_(go.t().mm(x2));  // [out, in], as AddmmBackward computes it
    if (es.size() > 1) FlatParams::view(full_grad, es[1]).copy_(go.sum(0));
    g->runtime->release(*g);
    g->runtime->reduce_grad(*g, full_grad);
    return {gx, torch::Tensor(), torch::Tensor()};
  }
};

// W [out, in] gathered from the shard as a tensor autograd differentiates, for a caller that reads it several
// times (a chunked loss): autograd sums the gradients of every use before this node's backward runs, which
// reduce-scatters the sum once. The runtime forgets the gathered buffer at once; it lives as long as W does.
struct GatheredWeightFn : torch::autograd::Function<GatheredWeightFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& shard, int64_t group_ptr) {
    (void)shard;
    auto* g = reinterpret_cast<Stage3Group*>(group_ptr);
    const torch::Tensor full = g->runtime->acquire(*g);
    torch::Tensor w = FlatParams::view(full, g->layout.entries()[0]);  // [out, in]
    g->runtime->release(*g);
    ctx->saved_data["group"] = group_ptr;
    return w;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list grads) {
    Stage3Group* g = group_from(ctx);
    auto full_grad = torch::zeros({g->layout.padded()}, g->shard.options().requires_grad(false));
    if (grads[0].defined()) FlatParams::view(full_grad, g->layout.entries()[0]).copy_(grads[0]);
    g->runtime->reduce_grad(*g, full_grad);
    return {torch::Tensor(), torch::Tensor()};
  }
};

// y = W[idx]. idx: [...] int64, y: [..., dim].
struct ShardedEmbeddingFn : torch::autograd::Function<ShardedEmbeddingFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& idx, const torch::Tensor& shard,
                               int64_t group_ptr) {
    (void)shard;
    auto* g = reinterpret_cast<Stage3Group*>(group_ptr);
    const torch::Tensor full = g->runtime->acquire(*g);
    const torch::Tensor w = FlatParams::view(full, g->layout.entries()[0]);
    torch::Tensor y = torch::embedding(w, idx);
    g->runtime->release(*g);
    ctx->save_for_backward({idx});
    ctx->saved_data["group"] = group_ptr;
    return y;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list grads) {
    Stage3Group* g = group_from(ctx);
    const torch::Tensor idx = ctx->get_saved_variables()[0];
    const auto& e = g->layout.entries()[0];
    auto full_grad = torch::zeros({g->layout.padded()}, grads[0].options());
    FlatParams::view(full_grad, e).copy_(torch::embedding_dense_backward(grads[0], idx, e.shape[0], -1, false));
    g->runtime->reduce_grad(*g, full_grad);
    return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace detail

// ---- modules ---------------------------------------------------------------------------------------

struct ShardedLinearImpl : torch::nn::Cloneable<ShardedLinearImpl>, Shardable {
  int64_t in_features, out_features;
  bool with_bias;
  torch::Tensor weight;  // [out, in]
  torch::Tensor bias;    // [out]
  Stage3Group* group_ = nullptr;

  ShardedLinearImpl(int64_t in, int64_t out, bool bias_ = true) : in_features(in), out_features(out), with_bias(bias_) {
    reset();
  }
  // torch::nn::Linear's initialisation: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.
  void reset() override {
    TORCH_CHECK(in_features > 0 && out_features > 0, "ShardedLinear: sizes must be positive, got ", in_features, "x", out_features);
    const double bound = 1.0 / std::sqrt(double(in_features));
    weight = register_parameter("weight", torch::empty({out_features, in_features}).uniform_(-bound, bound));
    if (with_bias) bias = register_parameter("bias", torch::empty({out_features}).uniform_(-bound, bound));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // x: [..., in] -> [..., out]
    if (group_ == nullptr) return torch::nn::functional::linear(x, weight, bias);
    if (torch::GradMode::is_enabled()) ++group_->uses;
    return detail::ShardedLinearFn::apply(x, group_->shard, reinterpret_cast<int64_t>(group_));
  }
  // The weight [out, in] as one tensor, for a caller that reads it several times (nn::Llama's chunked loss): the
  // parameter itself, or, once a stage-3 trainer has sharded the layer, a gathered copy held while autograd needs
  // it, whose backward reduce-scatters the gradients of all uses summed: one gather and one reduction per pass
  // however many chunks read it (one use for the runtime's readiness count). Layers without a bias only.
  torch::Tensor full_weight() {
    TORCH_CHECK(!with_bias, "ShardedLinear::full_weight: the layer has a bias, which full_weight() would leave out");
    if (group_ == nullptr) return weight;
    if (torch::GradMode::is_enabled()) ++group_->uses;
    return detail::GatheredWeightFn::apply(group_->shard, reinterpret_cast<int64_t>(group_));
  }
  std::vector<std::pair<std::string, torch::Tensor>> shardable_parameters() override {
    std::vector<std::pair<std::string, torch::Tensor>> p{{"weight", weight}};
    if (with_bias) p.emplace_back("bias", bias);
    return p;
  }
  void attach(Stage3Group* g) override { group_ = g; }
  Stage3Group* group() const override { return group_; }
};
TORCH_MODULE(ShardedLinear);

struct ShardedEmbeddingImpl : torch::nn::Cloneable<ShardedEmbeddingImpl>, Shardable {
  int64_t num_embeddings, embedding_dim;
  torch::Tensor weight;  // [num, dim]
  Stage3Group* group_ = nullptr;

  ShardedEmbeddingImpl(int64_t num, int64_t dim) : num_embeddings(num), embedding_dim(dim) { reset(); }
  // torch::nn::Embedding's initialisation: N(0, 1).
  void reset() override {
    TORCH_CHECK(num_embeddings > 0 && embedding_dim > 0, "ShardedEmbedding: sizes must be positive");
    weight = register_parameter("weight", torch::randn({num_embeddings, embedding_dim}));
  }
  torch::Tensor forward(const torch::Tensor& idx) {  // idx: [...] int64 -> [..., dim]
    if (group_ == nullptr) return torch::embedding(weight, idx);
    if (torch::GradMode::is_enabled()) ++group_->uses;
    return detail::ShardedEmbeddingFn::apply(idx, group_->shard, reinterpret_cast<int64_t>(group_));
  }
  std::vector<std::pair<std::string, torch::Tensor>> shardable_parameters() override { return {{"weight", weight}}; }
  void attach(Stage3Group* g) override { group_ = g; }
  Stage3Group* group() const override { return group_; }
};
TORCH_MODULE(ShardedEmbedding);

}  // namespace squeeze::nn
