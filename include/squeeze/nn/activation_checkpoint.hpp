#pragma once
// Activation checkpointing for libtorch C++ (which has no torch.utils.checkpoint).
//
//   y = checkpoint(fn, {x}, block->parameters());
//
// runs fn({x}) under no-grad, so none of its intermediate activations are kept: only the inputs are saved.
// In backward the block is run again with grad enabled (with the RNG and autocast state it saw the first
// time, so dropout-like randomness and mixed-precision casts repeat exactly) and backpropagated.
//
// The block's parameters are passed as inputs of the autograd node, so their gradients flow through the
// ordinary graph into their AccumulateGrad nodes (and any hooks there, e.g. a sharded optimizer's); a block
// whose tensor inputs need no grad (token ids into a whole-model checkpoint) still gets a backward. Pass
// whatever leaves the block reads: module parameters, or the flat shards a Stage-3 gather views.
//
// checkpoint_sequential(n, every, x, layer, params) checkpoints n layers in segments of `every` layers:
// every = 1 keeps one activation per layer, every = n keeps one for the whole stack.
//
// checkpoint_chunked_sum(chunk, rows, shared, fn) sums fn over chunks of rows, each chunk checkpointed, so one
// chunk's intermediates exist at a time (a language model's head + cross-entropy over token chunks).
//
// Under a trainer (the Checkpointed / CheckpointEvery<N> policies), for any model:
//   nn::Blocks            a container that chains its blocks; a Checkpointed trainer makes it recompute them
//                         (segments of N blocks), otherwise it is a plain chain
//   nn::checkpoint(b, x)  b(x), recomputed in backward while a Checkpointed trainer's step runs, a plain call otherwise
// Both keep their segments' inputs in host memory while a CheckpointOffloadScope is open (CheckpointOffload<Host>).
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "squeeze/engine/activation_store.hpp"
#include "squeeze/nn/layers.hpp"

namespace squeeze::nn {

// A checkpointed block: tensors in, one tensor out. It must compute the same function when called twice
// (it may draw random numbers: the RNG state is replayed). It is called again during backward, after the
// caller's scope has ended: capture tensors by value, not by reference.
using BlockFn = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

namespace detail {

// The default generators' states: the CPU one and one per CUDA device the block touches.
struct RngState {
  torch::Tensor cpu;
  std::vector<std::pair<c10::Device, torch::Tensor>> cuda;

  static at::Generator generator(c10::Device d) { return at::globalContext().defaultGenerator(d); }

  static RngState capture(const std::vector<c10::Device>& cuda_devices) {
    RngState s;
    {
      auto g = generator(c10::Device(c10::kCPU));
      std::lock_guard<std::mutex> lock(g.mutex());
      s.cpu = g.get_state();
    }
    for (auto d : cuda_devices) {
      auto g = generator(d);
      std::lock_guard<std::mutex> lock(g.mutex());
      s.cuda.emplace_back(d, g.get_state());
    }
    return s;
  }
  void restore() const {
    {
      auto g = generator(c10::Device(c10::kCPU));
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(cpu);
    }
    for (const auto& [d, state] : cuda) {
      auto g = generator(d);
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(state);
    }
  }
};

// Autocast settings (CPU and CUDA) of the calling thread.
struct AutocastState {
  bool cpu_enabled = false, cuda_enabled = false, cache_enabled = true;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;

  static AutocastState capture() {
    AutocastState s;
    s.cpu_enabled = at::autocast::is_autocast_enabled(at::kCPU);
    s.cuda_enabled = at::autocast::is_autocast_enabled(at::kCUDA);
    s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
    s.cache_enabled = at::autocast::is_autocast_cache_enabled();
    return s;
  }
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu_enabled);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda_enabled);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
    at::autocast::set_autocast_cache_enabled(cache_enabled);
  }
};

// Everything backward needs besides the saved inputs. Held by the autograd context as a capsule.
struct CheckpointCall : torch::CustomClassHolder {
  BlockFn fn;
  BlockFn recompute;                  // what backward runs in fn's place (the same graph, its value never read); empty: fn
  std::vector<torch::Tensor> params;  // leaves the block reads (references, no copies)
  RngState rng;
  AutocastState autocast;
  engine::ActivationStore* store = nullptr;             // where the inputs wait for backward (null: saved on their device)
  std::vector<engine::ActivationStore::SlotPtr> slots;  // store: one per input
  std::vector<bool> input_requires_grad;                // store: what save_for_backward would have remembered
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // Runs under no-grad (Function::apply turns grad mode off around forward).
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, c10::intrusive_ptr<CheckpointCall> call, at::TensorList inputs,
                               at::TensorList params) {
    (void)params;  // they are inputs of the node for their gradient edges; the call holds them
    std::vector<torch::Tensor> in(inputs.begin(), inputs.end());
    torch::Tensor out = call->fn(in);
    if (call->store != nullptr) {  // the only activations kept, in host memory
      for (const torch::Tensor& x : in) {
        call->slots.push_back(call->store->stash(x));
        call->input_requires_grad.push_back(x.requires_grad());
      }
    } else {
      ctx->save_for_backward(in);  // the only activations kept
    }
    ctx->saved_data["call"] = c10::IValue::make_capsule(std::move(call));
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad_out) {
    auto call = c10::static_intrusive_pointer_cast<CheckpointCall>(ctx->saved_data["call"].toCapsule());
    std::vector<torch::Tensor> saved;
    std::vector<bool> needs_grad;
    if (call->store != nullptr) {
      for (const auto& slot : call->slots) saved.push_back(call->store->fetch(slot));
      needs_grad = call->input_requires_grad;
    } else {
      saved = ctx->get_saved_variables();
      for (const auto& t : saved) needs_grad.push_back(t.requires_grad());
    }

    // Fresh leaves for the inputs, so the recomputed graph ends here and not in the outer graph.
    std::vector<torch::Tensor> inputs;
    std::vector<torch::Tensor> wrt;  // what we differentiate with respect to: grad-needing inputs, then params
    std::vector<int> input_slot(saved.size(), -1);
    inputs.reserve(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      torch::Tensor x = saved[i].detach();
      if (needs_grad[i]) {
        x.requires_grad_(true);
        input_slot[i] = static_cast<int>(wrt.size());
        wrt.push_back(x);
      }
      inputs.push_back(x);
    }
    std::vector<int> param_slot(call->params.size(), -1);
    for (size_t i = 0; i < call->params.size(); ++i) {
      if (call->params[i].requires_grad()) {
        param_slot[i] = static_cast<int>(wrt.size());
        wrt.push_back(call->params[i]);
      }
    }

    // Recompute with the forward's RNG and autocast state; give the caller's state back afterwards.
    torch::Tensor out;
    {
      std::vector<c10::Device> cuda_devices;
      for (const auto& [d, s] : call->rng.cuda) cuda_devices.push_back(d);
      const RngState caller_rng = RngState::capture(cuda_devices);
      const AutocastState caller_autocast = AutocastState::capture();
      call->rng.restore();
      call->autocast.apply();
      try {
        torch::AutoGradMode grad_on(true);
        out = call->recompute ? call->recompute(inputs) : call->fn(inputs);
      } catch (...) {
        caller_autocast.apply();
        caller_rng.restore();
        throw;
      }
      caller_autocast.apply();
      caller_rng.restore();
    }

    TORCH_CHECK(!grad_out[0].defined() || (out.sizes() == grad_out[0].sizes() && out.scalar_type() == grad_out[0].scalar_type()),
                "squeeze::nn::checkpoint: the block recomputed in backward returned ", out.sizes(), " ", out.scalar_type(),
                ", its forward ", grad_out[0].sizes(), " ", grad_out[0].scalar_type(),
                ": it must compute the same function when called twice");
    std::vector<torch::Tensor> grads(wrt.size());
    if (out.requires_grad() && !wrt.empty()) {
      grads = torch::autograd::grad({out}, wrt, {grad_out[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                    /*allow_unused=*/true);
    }

    // One gradient per forward argument: none for the call, then inputs, then params.
    torch::autograd::variable_list result;
    result.reserve(1 + saved.size() + call->params.size());
    result.emplace_back();
    for (int slot : input_slot) result.push_back(slot < 0 ? torch::Tensor() : grads[slot]);
    for (int slot : param_slot) result.push_back(slot < 0 ? torch::Tensor() : grads[slot]);
    return result;
  }
};

inline std::vector<c10::Device> cuda_devices_of(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  std::vector<c10::Device> out;
  auto add = [&](const torch::Tensor& t) {
    if (t.defined() && t.is_cuda() && std::find(out.begin(), out.end(), t.device()) == out.end()) out.push_back(t.device());
  };
  for (const auto& t : a) add(t);
  for (const auto& t : b) add(t);
  return out;
}

}  // namespace detail

namespace detail {
// checkpoint(fn, inputs, params) with the inputs kept in `store` (null: on their device); backward runs `recompute` in
// fn's place where it is set (the same graph and output shape, whose value backward never reads).
inline torch::Tensor checkpoint_into(engine::ActivationStore* store, BlockFn fn, std::vector<torch::Tensor> inputs,
                                     std::vector<torch::Tensor> params, BlockFn recompute = {}) {
  TORCH_CHECK(static_cast<bool>(fn), "squeeze::nn::checkpoint: the block function is empty");
  for (size_t i = 0; i < inputs.size(); ++i)
    TORCH_CHECK(inputs[i].defined(), "squeeze::nn::checkpoint: input ", i, " is an undefined tensor");
  const auto needs_grad = [](const std::vector<torch::Tensor>& v) {
    return std::any_of(v.begin(), v.end(), [](const torch::Tensor& t) { return t.defined() && t.requires_grad(); });
  };
  if (!torch::GradMode::is_enabled() || !(needs_grad(inputs) || needs_grad(params))) return fn(inputs);

  auto call = c10::make_intrusive<CheckpointCall>();
  call->fn = std::move(fn);
  call->recompute = std::move(recompute);
  call->params = std::move(params);
  call->rng = RngState::capture(cuda_devices_of(inputs, call->params));
  call->autocast = AutocastState::capture();
  call->store = store;
  std::vector<torch::Tensor> param_refs = call->params;  // the node's gradient edges
  return detail::CheckpointFunction::apply(std::move(call), at::TensorList(inputs), at::TensorList(param_refs));
}
}  // namespace detail

// While alive on a thread, the segments checkpoint_sequential and checkpoint(block, x) make keep their inputs in
// `store` (host memory, brought back ahead of each recomputation) instead of on the device. A CheckpointOffload<Host>
// trainer opens one around each step's closure; scopes nest, the inner one winning until it closes.
class CheckpointOffloadScope {
 public:
  explicit CheckpointOffloadScope(engine::ActivationStore* store) : saved_(current()) { current() = store; }
  CheckpointOffloadScope(const CheckpointOffloadScope&) = delete;
  CheckpointOffloadScope& operator=(const CheckpointOffloadScope&) = delete;
  ~CheckpointOffloadScope() { current() = saved_; }
  static engine::ActivationStore* active() { return current(); }  // null where none is open on this thread

 private:
  static engine::ActivationStore*& current() {
    thread_local engine::ActivationStore* store = nullptr;
    return store;
  }
  engine::ActivationStore* saved_;
};

// Runs fn(inputs) keeping only `inputs` for backward; `params` are the leaves fn reads that need gradients.
// Outside grad mode, or when nothing needs a gradient, it is just fn(inputs).
inline torch::Tensor checkpoint(BlockFn fn, std::vector<torch::Tensor> inputs, std::vector<torch::Tensor> params) {
  return detail::checkpoint_into(nullptr, std::move(fn), std::move(inputs), std::move(params));
}

// One-input convenience: checkpoint(x, params, [&](const Tensor& x) { return block(x); }).
template <class F>
requires std::is_invocable_r_v < torch::Tensor, std::decay_t<F>
&, const torch::Tensor& > inline torch::Tensor checkpoint(const torch::Tensor& x, std::vector<torch::Tensor> params, F&& f) {
  return checkpoint([f = std::forward<F>(f)](const std::vector<torch::Tensor>& in) mutable { return f(in[0]); }, {x}, std::move(params));
}

// Runs layers 0..n-1 on x (x = layer(i, x)), checkpointing segments of `every` consecutive layers; the last
// segment may be shorter. every <= 0 runs them plainly. params(i) lists layer i's parameters. last_recomputed (when
// set) stands in for `layer` at the last layer of a segment recomputed in backward, whose output's value nothing reads
// (only its graph is differentiated): a layer that checkpoints parts of itself can skip computing them there.
inline torch::Tensor checkpoint_sequential(int64_t n, int64_t every, torch::Tensor x,
                                           const std::function<torch::Tensor(int64_t, const torch::Tensor&)>& layer,
                                           const std::function<std::vector<torch::Tensor>(int64_t)>& params,
                                           const std::function<torch::Tensor(int64_t, const torch::Tensor&)>& last_recomputed = {}) {
  TORCH_CHECK(n >= 0, "squeeze::nn::checkpoint_sequential: negative layer count ", n);
  if (every <= 0) {
    for (int64_t i = 0; i < n; ++i) x = layer(i, x);
    return x;
  }
  for (int64_t begin = 0; begin < n; begin += every) {
    const int64_t end = std::min(n, begin + every);
    std::vector<torch::Tensor> segment_params;
    for (int64_t i = begin; i < end; ++i) {
      auto p = params(i);
      segment_params.insert(segment_params.end(), p.begin(), p.end());
    }
    BlockFn segment = [layer, begin, end](const std::vector<torch::Tensor>& in) {  // copies: runs again in backward
      torch::Tensor y = in[0];
      for (int64_t i = begin; i < end; ++i) y = layer(i, y);
      return y;
    };
    BlockFn recomputed;
    if (last_recomputed)
      recomputed = [layer, last_recomputed, begin, end](const std::vector<torch::Tensor>& in) {
        torch::Tensor y = in[0];
        for (int64_t i = begin; i < end; ++i) y = i + 1 < end ? layer(i, y) : last_recomputed(i, y);
        return y;
      };
    x = detail::checkpoint_into(CheckpointOffloadScope::active(), std::move(segment), {x}, std::move(segment_params),
                                std::move(recomputed));
  }
  return x;
}

// Σ_k fn({rows[0]_k, rows[1]_k, ..., shared...}) where rows[j]_k is rows [k·chunk, (k+1)·chunk) of rows[j] (split
// along dim 0; every tensor in `rows` has the same number of rows; the last chunk may be shorter) and `shared`
// tensors are passed whole to every call. fn returns a scalar. With recompute (and grad mode), each term is
// checkpointed: only its inputs are kept (views of `rows`, and `shared`) and fn runs again in backward, one chunk
// at a time; autograd sums the chunks' gradients of a shared tensor before passing them on, and joins the rows'
// gradients once (one split node per tensor). Without recompute or grad mode the chunks just run one by one.
inline torch::Tensor checkpoint_chunked_sum(int64_t chunk, const std::vector<torch::Tensor>& rows, const std::vector<torch::Tensor>& shared,
                                            const BlockFn& fn, bool recompute = true) {
  TORCH_CHECK(chunk > 0, "squeeze::nn::checkpoint_chunked_sum: the chunk must be a positive number of rows, got ", chunk);
  TORCH_CHECK(!rows.empty(), "squeeze::nn::checkpoint_chunked_sum: no tensor to split into chunks");
  TORCH_CHECK(static_cast<bool>(fn), "squeeze::nn::checkpoint_chunked_sum: the chunk function is empty");
  const int64_t n = rows[0].size(0);
  for (size_t j = 0; j < rows.size(); ++j)
    TORCH_CHECK(rows[j].defined() && rows[j].dim() > 0 && rows[j].size(0) == n, "squeeze::nn::checkpoint_chunked_sum: tensor ", j, " has ",
                rows[j].defined() && rows[j].dim() > 0 ? rows[j].size(0) : 0, " rows, tensor 0 has ", n);
  TORCH_CHECK(n > 0, "squeeze::nn::checkpoint_chunked_sum: nothing to sum (0 rows)");
  std::vector<std::vector<torch::Tensor>> parts;  // [tensor][chunk]
  for (const auto& r : rows) parts.push_back(r.split(chunk, 0));
  torch::Tensor total;
  for (size_t k = 0; k < parts[0].size(); ++k) {
    std::vector<torch::Tensor> in;
    for (const auto& p : parts) in.push_back(p[k]);
    in.insert(in.end(), shared.begin(), shared.end());
    torch::Tensor term = recompute ? checkpoint(fn, std::move(in), {}) : fn(in);
    total = total.defined() ? total + term : term;
  }
  return total;
}

// fn applied to `rows` [N, ...] in tiles of `tile` rows (the last may be shorter), the outputs joined along dim 0:
// for a function that works row by row (a block's MLP and its norm), whose intermediates would otherwise exist
// for all N rows at once. Training (grad mode and something needs a gradient), each tile is checkpointed: it keeps
// only its rows (views of `rows`) and runs again in its own backward, one tile's intermediates at a time; `params`
// are the leaves fn reads, as checkpoint takes them. Otherwise the tiles just run one by one. tile <= 0 or
// >= N: fn(rows) once, plainly. The tiles' matrix products run over fewer rows: the same values, summed over the
// rows in another order for the weights' gradients (fp32 reduction order). values_unused: the caller only
// differentiates the output (the last layer of a segment recomputed in backward: checkpoint_sequential's
// last_recomputed), so the tiles keep their rows for their backward without running fn now, which saves one of the
// three runs of fn a checkpointed, tiled layer would otherwise make; fn must then return rows of its input's shape and
// dtype and draw no random numbers (the MLP and its norm).
inline torch::Tensor checkpoint_tiled(int64_t tile, const torch::Tensor& rows, const std::vector<torch::Tensor>& params,
                                      const std::function<torch::Tensor(const torch::Tensor&)>& fn, bool values_unused = false) {
  TORCH_CHECK(rows.defined() && rows.dim() > 0, "squeeze::nn::checkpoint_tiled: the rows must be a tensor of at least one dimension");
  TORCH_CHECK(static_cast<bool>(fn), "squeeze::nn::checkpoint_tiled: the tile function is empty");
  const int64_t n = rows.size(0);
  if (tile <= 0 || tile >= n) return fn(rows);
  std::vector<torch::Tensor> out;
  out.reserve(std::size_t((n + tile - 1) / tile));
  const BlockFn run = [fn](const std::vector<torch::Tensor>& in) { return fn(in[0]); };
  const BlockFn placeholder = [](const std::vector<torch::Tensor>& in) { return torch::empty_like(in[0]); };
  for (const torch::Tensor& part : rows.split(tile, 0))
    out.push_back(values_unused ? detail::checkpoint_into(nullptr, placeholder, {part}, params, run) : checkpoint(run, {part}, params));
  return torch::cat(out, 0);
}

// ---- what a trainer switches on -----------------------------------------------------------------------------

// A module whose forward recomputes its parts when a Checkpointed trainer says so (every: blocks per segment).
class Recomputable {
 public:
  virtual ~Recomputable() = default;
  virtual void set_recompute(int every) = 0;  // 0: keep every activation
};

// While alive on a thread, checkpoint(block, x) recomputes block in backward, segment by segment of `every` blocks
// (0: a plain call). A Checkpointed trainer opens one around the closure of each step(); scopes nest, the inner one
// winning until it closes.
class RecomputeScope {
 public:
  explicit RecomputeScope(int every) : saved_(current()), calls_at_open_(calls()) { current() = every; }
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;
  ~RecomputeScope() { current() = saved_; }
  // Whether checkpoint(block, x) recomputed anything since this scope opened.
  bool recomputed() const { return calls() > calls_at_open_; }
  // The innermost open scope's setting on this thread (0 where none is open).
  static int active() { return current(); }
  static void count_call() { ++calls(); }  // checkpoint(block, x) counts itself

 private:
  static int& current() {
    thread_local int e = 0;
    return e;
  }
  static int64_t& calls() {  // checkpoint(block, x) calls on this thread
    thread_local int64_t c = 0;
    return c;
  }
  int saved_;
  int64_t calls_at_open_;
};
// block(x), recomputed in backward while a Checkpointed trainer's step runs (only x is kept), else a plain call.
// block: a module holder (or pointer) whose forward takes one tensor.
template <class M>
requires requires(M& m, const torch::Tensor& x) {
  { m->forward(x) } -> std::convertible_to<torch::Tensor>;
}
torch::Tensor checkpoint(M& block, const torch::Tensor& x) {
  if (RecomputeScope::active() <= 0) return block->forward(x);
  RecomputeScope::count_call();
  auto b = block;  // a copy (shared ownership): the recompute runs in backward, after the caller's scope
  return detail::checkpoint_into(
      CheckpointOffloadScope::active(), [b](const std::vector<torch::Tensor>& in) mutable { return b->forward(in[0]); }, {x},
      trainable_leaves(*b));
}

// Blocks run one after another: x = block_i(x). Under a Checkpointed trainer each segment of N blocks keeps only
// its input and runs again in backward (CheckpointEvery<N>; Checkpointed: N = 1); otherwise a plain chain.
class BlocksImpl : public torch::nn::Module, public Recomputable {
 public:
  BlocksImpl() = default;
  // block: a module holder whose forward takes and returns one tensor [..., h]; registered as child "<index>".
  template <class M>
  requires requires(M& m, const torch::Tensor& x) {
    { m->forward(x) } -> std::convertible_to<torch::Tensor>;
  }
  void push_back(M block) {
    auto ptr = register_module(std::to_string(blocks_.size()), block.ptr());
    blocks_.push_back({ptr, [ptr](const torch::Tensor& x) { return ptr->forward(x); }});
  }
  int64_t size() const { return int64_t(blocks_.size()); }
  torch::Tensor forward(const torch::Tensor& x) {
    const int every = is_training() ? every_ : 0;
    return checkpoint_sequential(
        size(), every, x, [this](int64_t i, const torch::Tensor& h) { return blocks_[std::size_t(i)].run(h); },
        [this](int64_t i) { return trainable_leaves(*blocks_[std::size_t(i)].module); });
  }
  void set_recompute(int every) override { every_ = every; }
  int recompute_every() const { return every_; }

 private:
  struct Entry {
    std::shared_ptr<torch::nn::Module> module;
    std::function<torch::Tensor(const torch::Tensor&)> run;
  };
  std::vector<Entry> blocks_;
  int every_ = 0;
};
TORCH_MODULE(Blocks);

}  // namespace squeeze::nn
