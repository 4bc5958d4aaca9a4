#pragma once
// squeeze::nn::Linear and squeeze::nn::Embedding: drop-in for torch::nn::Linear / Embedding (same options,
// parameter names, initialisation and math). A trainer adopts them and changes their backing while the
// object (and so the user's member holding it) stays the same:
//   plain              until a trainer adopts them (stages 0-2, or plain use): weight / bias are ordinary parameters
//   sharded (Stage 3)  the layer's parameters live as 1/N shards in a engine::Stage3Group; weight / bias are emptied
//                      (numel 0) and gathered around the layer's forward and backward (engine/stage3.hpp)
//   backed (LoRA)      Linear only: a frozen base (dense, NF4 or GPTQ-packed) with or without LoRA adapters, a child
//                      module registered as "lora" (adapters) or "frozen" (nn/lora.hpp: apply_lora)
//
// Why autograd Functions for the sharded form: libtorch modules have no forward hooks, so the gather must sit
// inside the layer's own forward; and a layer's backward must run even when its input needs no gradient (the
// first layer), so the shard tensor is an input of the Function (a leaf that requires grad; its own .grad stays
// empty: the reduced gradient goes to the group's gradient shard in its accumulation dtype). The backward uses
// exactly the ATen ops of linear's / embedding's own derivatives (g^T x, g W, sum over rows;
// embedding_dense_backward), so stage 3 produces the same gradient bits as an unsharded layer.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "squeeze/engine/stage3.hpp"
#include "squeeze/nn/fp8_linear.hpp"

namespace squeeze::nn {

using engine::FlatParams;

// Where a layer allocates its parameters and whether it draws their initial values. The default is torch's:
// float on the CPU, random. random = false leaves the memory uninitialised, for weights loaded right after
// construction (nn/hf_llama.hpp), so a 7B model is neither built in float on the host first nor drawn at random.
// seed: draw from a generator of its own seeded with this, leaving torch's global generator alone (nn::Llama: the
// model's seed, from which each part gets its own stream); unset: torch's global generator decides.
struct ParamInit {
  torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat32);
  bool random = true;
  std::optional<uint64_t> seed;
};

// A generator for tensors on `device` seeded with `seed`, apart from the device's global generator (whose state
// stays as it was): the same seed gives the same values on the same kind of device, whatever ran before.
inline at::Generator seeded_generator(torch::Device device, uint64_t seed) {
  if (device.is_cpu()) return at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Generator global = at::globalContext().defaultGenerator(device);
  at::Generator g;
  {
    std::lock_guard<std::mutex> lock(global.mutex());
    g = global.clone();
  }
  g.set_current_seed(seed);
  return g;
}

// One 64-bit draw from torch's global CPU generator: a seed that torch::manual_seed decides.
inline uint64_t seed_from_global_generator() {
  at::Generator g = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get<at::CPUGeneratorImpl>()->random64();
}
using engine::Shardable;
using engine::Stage3Group;

namespace detail {

using Member = engine::UnitMember;

// y = x W^T + b with W, b gathered from the unit. x: [..., in], y: [..., out]. With `fp8` the GEMMs run in FP8
// (nn/fp8_linear.hpp) on the gathered weight, and x^T is kept in e4m3 instead of x.
struct ShardedLinearFn : torch::autograd::Function<ShardedLinearFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& shard, Member m,
                               bool has_bias, bool fp8) {
    (void)shard;
    const torch::Tensor full = m.group->runtime->acquire(*m.group);
    const torch::Tensor w = FlatParams::view(full, m.entry(0));
    const torch::Tensor b = has_bias ? FlatParams::view(full, m.entry(1)) : torch::Tensor();
    torch::Tensor y;
    if (fp8) {
      Fp8Saved saved;
      y = fp8_linear_forward(x, w, /*keep_x_t=*/true, saved);
      if (has_bias) y = y + b.to(y.scalar_type());
      ctx->save_for_backward({saved.x_t, saved.x_inverse_scale});
      ctx->saved_data["dtype"] = int64_t(x.scalar_type());
      ctx->saved_data["x_sizes"] = x.sizes().vec();
    } else {
      y = torch::nn::functional::linear(x, w, b);
      ctx->save_for_backward({x});
    }
    m.group->runtime->release(*m.group);
    m.save(ctx);
    ctx->saved_data["bias"] = has_bias;
    ctx->saved_data["fp8"] = fp8;
    return y;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list grads) {
    const Member m = Member::saved(ctx);
    Stage3Group& g = *m.group;
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor full = g.runtime->acquire(g);
    const torch::Tensor w = FlatParams::view(full, m.entry(0));  // [out, in]
    const int64_t out = w.size(0);
    const torch::Tensor go = grads[0].reshape({-1, out});  // [rows, out]
    const torch::Tensor full_grad = g.runtime->gradient_buffer(g, full.options());
    torch::Tensor gx;
    if (ctx->saved_data["fp8"].toBool()) {
      auto [dx, dw] = fp8_linear_backward(go, w, {saved[0], saved[1]}, ctx->needs_input_grad(0), /*want_dw=*/true,
                                          ctx->saved_data["x_sizes"].toIntVector(), torch::ScalarType(ctx->saved_data["dtype"].toInt()));
      gx = dx;
      FlatParams::view(full_grad, m.entry(0)).add_(dw);
    } else {
      const torch::Tensor& x = saved[0];
      const torch::Tensor x2 = x.reshape({-1, w.size(1)});  // [rows, in]
      if (ctx->needs_input_grad(0)) gx = go.mm(w).view(x.sizes());
      FlatParams::view(full_grad, m.entry(0)).add_(go.t().mm(x2));  // [out, in], as AddmmBackward computes it
    }
    if (ctx->saved_data["bias"].toBool()) FlatParams::view(full_grad, m.entry(1)).add_(go.sum(0));
    g.runtime->release(g);
    g.runtime->added(g);
    return {gx, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// W [out, in] gathered from the shard as a tensor autograd differentiates, for a caller that reads it several
// times (a chunked loss): autograd sums the gradients of every use before this node's backward runs, which
// reduce-scatters the sum once. The runtime forgets the gathered buffer at once; it lives as long as W does.
struct GatheredWeightFn : torch::autograd::Function<GatheredWeightFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& shard, Member m) {
    (void)shard;
    const torch::Tensor full = m.group->runtime->acquire(*m.group);
    torch::Tensor w = FlatParams::view(full, m.entry(0));  // [out, in]
    m.group->runtime->release(*m.group);
    m.save(ctx);
    return w;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list grads) {
    const Member m = Member::saved(ctx);
    Stage3Group& g = *m.group;
    const torch::Tensor full_grad = g.runtime->gradient_buffer(g, g.shard.options());
    if (grads[0].defined()) FlatParams::view(full_grad, m.entry(0)).add_(grads[0]);
    g.runtime->added(g);
    return {torch::Tensor(), torch::Tensor()};
  }
};

// A sharded layer's first parameter as GatheredWeightFn's gathered tensor, counted as one use of the layer.
inline torch::Tensor gathered_weight(Stage3Group* g, std::size_t first) {
  if (torch::GradMode::is_enabled()) ++g->uses;
  return GatheredWeightFn::apply(g->shard, Member{g, first});
}

// y = W[idx]. idx: [...] int64, y: [..., dim].
struct ShardedEmbeddingFn : torch::autograd::Function<ShardedEmbeddingFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& idx, const torch::Tensor& shard, Member m) {
    (void)shard;
    const torch::Tensor full = m.group->runtime->acquire(*m.group);
    const torch::Tensor w = FlatParams::view(full, m.entry(0));
    torch::Tensor y = torch::embedding(w, idx);
    m.group->runtime->release(*m.group);
    ctx->save_for_backward({idx});
    m.save(ctx);
    return y;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list grads) {
    const Member m = Member::saved(ctx);
    Stage3Group& g = *m.group;
    const torch::Tensor idx = ctx->get_saved_variables()[0];
    const auto& e = m.entry(0);
    const torch::Tensor full_grad = g.runtime->gradient_buffer(g, grads[0].options());
    FlatParams::view(full_grad, e).add_(torch::embedding_dense_backward(grads[0], idx, e.shape[0], -1, false));
    g.runtime->added(g);
    return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace detail

// ---- modules ---------------------------------------------------------------------------------------

// What a Linear runs when a trainer has given it another backing (nn/lora.hpp: a LoRA adapter over a frozen
// dense, NF4 or GPTQ-packed base, or such a frozen base alone).
using LinearBacking = std::function<torch::Tensor(const torch::Tensor&)>;

class LinearImpl : public torch::nn::Cloneable<LinearImpl>, public Shardable {
 public:
  LinearImpl(int64_t in, int64_t out) : LinearImpl(torch::nn::LinearOptions(in, out)) {}
  explicit LinearImpl(const torch::nn::LinearOptions& o, ParamInit init = {}) : options(o), init_(std::move(init)) { reset(); }

  // torch::nn::Linear's initialisation: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.
  void reset() override {
    TORCH_CHECK(options.in_features() > 0 && options.out_features() > 0, "squeeze::nn::Linear: sizes must be positive, got ",
                options.in_features(), "x", options.out_features());
    const double bound = 1.0 / std::sqrt(double(options.in_features()));
    std::optional<at::Generator> gen;  // one stream for weight and bias
    if (init_.random && init_.seed) gen = seeded_generator(init_.options.device(), *init_.seed);
    const auto make = [&](torch::IntArrayRef shape) {
      torch::Tensor t = torch::empty(shape, init_.options);
      return init_.random ? t.uniform_(-bound, bound, gen) : t;
    };
    weight = register_parameter("weight", make({options.out_features(), options.in_features()}));
    if (options.bias()) bias = register_parameter("bias", make({options.out_features()}));
  }
  void pretty_print(std::ostream& s) const override {
    s << "squeeze::nn::Linear(in_features=" << options.in_features() << ", out_features=" << options.out_features()
      << ", bias=" << std::boolalpha << options.bias()
      << (group_     ? ", sharded"
          : backing_ ? ", backed"
                     : "")
      << ")";
  }

  torch::Tensor forward(const torch::Tensor& x) {  // x: [..., in] -> [..., out]
    if (backing_) return backing_(x);
    if (group_ == nullptr) return fp8_gemms_ ? fp8_linear(x, weight, bias) : torch::nn::functional::linear(x, weight, bias);
    if (torch::GradMode::is_enabled()) ++group_->uses;
    return detail::ShardedLinearFn::apply(x, group_->shard, engine::UnitMember{group_, first_entry_}, options.bias(), fp8_gemms_);
  }
  // The weight [out, in] as one tensor, for a caller that reads it several times (nn::Llama's chunked loss): the
  // parameter itself, or, once a stage-3 trainer has sharded the layer, a gathered copy held while autograd needs
  // it, whose backward reduce-scatters the gradients of all uses summed: one gather and one reduction per pass
  // however many chunks read it (one use for the runtime's readiness count). Layers without a bias only.
  torch::Tensor full_weight() {
    TORCH_CHECK(!options.bias(), "squeeze::nn::Linear::full_weight: the layer has a bias, which full_weight() would leave out");
    TORCH_CHECK(!backing_, "squeeze::nn::Linear::full_weight: the layer is backed by a frozen quantized base");
    return group_ == nullptr ? weight : detail::gathered_weight(group_, first_entry_);
  }

  std::vector<std::pair<std::string, torch::Tensor>> shardable_parameters() override {
    std::vector<std::pair<std::string, torch::Tensor>> p{{"weight", weight}};
    if (options.bias()) p.emplace_back("bias", bias);
    return p;
  }
  void attach(Stage3Group* g, std::size_t first_entry) override { group_ = g, first_entry_ = first_entry; }
  Stage3Group* group() const override { return group_; }

  // The layer now runs `forward` of `module` (registered as child `name`); its own weight and bias are released.
  void back_with(const std::string& name, std::shared_ptr<torch::nn::Module> module, LinearBacking forward) {
    TORCH_CHECK(group_ == nullptr, "squeeze::nn::Linear: a sharded layer cannot take another backing");
    TORCH_CHECK(!backing_, "squeeze::nn::Linear: the layer already has a backing ('", backing_name_, "')");
    register_module(name, std::move(module));
    backing_ = std::move(forward);
    backing_name_ = name;
    torch::NoGradGuard ng;
    weight.set_data(torch::empty({0}, weight.options()));
    if (bias.defined()) bias.set_data(torch::empty({0}, bias.options()));
  }
  // Back to a plain layer holding weight [out, in] and bias [out] (merge_lora's export of an adapted layer).
  void unback(const torch::Tensor& w, const torch::Tensor& b) {
    TORCH_CHECK(backing_, "squeeze::nn::Linear::unback: the layer has no backing");
    TORCH_CHECK(w.sizes() == torch::IntArrayRef({out_features(), in_features()}), "squeeze::nn::Linear::unback: weight must be [",
                out_features(), ", ", in_features(), "], got ", w.sizes());
    unregister_module(backing_name_);
    backing_ = {};
    backing_name_.clear();
    torch::NoGradGuard ng;
    weight.set_data(w);
    if (bias.defined() && b.defined()) bias.set_data(b);
  }
  // Precision<fp8, bf16, float>: this layer's GEMMs in FP8 (nn/fp8_linear.hpp); its weight (or Stage 3's gathered copy)
  // stays bf16.
  void set_fp8_gemms(bool on) {
    TORCH_CHECK(!on || !backing_, "squeeze::nn::Linear: FP8 GEMMs need the layer's own (or its gathered) weight, not a backed one");
    fp8_gemms_ = on;
    if (on) fp8_amax_from_producers() = true;  // the norms and SwiGLU feeding FP8 GEMMs write their outputs' amax
  }
  bool fp8_gemms() const { return fp8_gemms_; }
  bool backed() const { return bool(backing_); }
  std::shared_ptr<torch::nn::Module> backing() const { return backed() ? named_children()[backing_name_] : nullptr; }

  int64_t in_features() const { return options.in_features(); }
  int64_t out_features() const { return options.out_features(); }
  bool has_bias() const { return options.bias(); }

  torch::nn::LinearOptions options;
  torch::Tensor weight;  // [out, in]
  torch::Tensor bias;    // [out], or undefined without bias

 private:
  ParamInit init_;
  Stage3Group* group_ = nullptr;
  std::size_t first_entry_ = 0;  // weight's entry in group_'s layout (bias: the next)
  LinearBacking backing_;
  std::string backing_name_;
  bool fp8_gemms_ = false;
};
TORCH_MODULE(Linear);

class EmbeddingImpl : public torch::nn::Cloneable<EmbeddingImpl>, public Shardable {
 public:
  EmbeddingImpl(int64_t num, int64_t dim) : EmbeddingImpl(torch::nn::EmbeddingOptions(num, dim)) {}
  explicit EmbeddingImpl(const torch::nn::EmbeddingOptions& o, ParamInit init = {}) : options(o), init_(std::move(init)) {
    TORCH_CHECK(!o.padding_idx() && !o.max_norm() && !o.scale_grad_by_freq() && !o.sparse() && !o._weight().defined(),
                "squeeze::nn::Embedding supports num_embeddings and embedding_dim only (padding_idx, max_norm, "
                "scale_grad_by_freq, sparse and _weight are not implemented): load weights after construction instead");
    reset();
  }
  // torch::nn::Embedding's initialisation: N(0, 1).
  void reset() override {
    TORCH_CHECK(options.num_embeddings() > 0 && options.embedding_dim() > 0, "squeeze::nn::Embedding: sizes must be positive");
    torch::Tensor w = torch::empty({options.num_embeddings(), options.embedding_dim()}, init_.options);
    std::optional<at::Generator> gen;
    if (init_.random && init_.seed) gen = seeded_generator(init_.options.device(), *init_.seed);
    weight = register_parameter("weight", init_.random ? w.normal_(0.0, 1.0, gen) : w);
  }
  void pretty_print(std::ostream& s) const override {
    s << "squeeze::nn::Embedding(num_embeddings=" << options.num_embeddings() << ", embedding_dim=" << options.embedding_dim()
      << (group_ ? ", sharded" : "") << ")";
  }
  torch::Tensor forward(const torch::Tensor& idx) {  // idx: [...] int64 -> [..., dim]
    if (group_ == nullptr) return torch::embedding(weight, idx);
    if (torch::GradMode::is_enabled()) ++group_->uses;
    return detail::ShardedEmbeddingFn::apply(idx, group_->shard, engine::UnitMember{group_, first_entry_});
  }
  // The table [num, dim] as one tensor, for a tied LM head that reads it as a linear weight: the parameter, or
  // once sharded a gathered copy whose backward reduce-scatters its gradient (see LinearImpl::full_weight).
  torch::Tensor full_weight() { return group_ == nullptr ? weight : detail::gathered_weight(group_, first_entry_); }
  std::vector<std::pair<std::string, torch::Tensor>> shardable_parameters() override { return {{"weight", weight}}; }
  void attach(Stage3Group* g, std::size_t first_entry) override { group_ = g, first_entry_ = first_entry; }
  Stage3Group* group() const override { return group_; }

  torch::nn::EmbeddingOptions options;
  torch::Tensor weight;  // [num, dim]

 private:
  ParamInit init_;
  Stage3Group* group_ = nullptr;
  std::size_t first_entry_ = 0;
};
TORCH_MODULE(Embedding);

// The tensors a module's forward reads that get gradients: its parameters, or for layers a stage-3 trainer has
// sharded (their own weights emptied) the shard each gathers from. What activation checkpointing hands to autograd.
inline std::vector<torch::Tensor> trainable_leaves(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  std::vector<const Stage3Group*> units;  // a unit's shard once, however many of its layers are here
  for (const auto& sub : m.modules(/*include_self=*/true)) {
    if (auto* s = dynamic_cast<Shardable*>(sub.get()); s != nullptr && s->group() != nullptr) {
      if (std::find(units.begin(), units.end(), s->group()) == units.end()) {
        units.push_back(s->group());
        out.push_back(s->group()->shard);
      }
      continue;
    }
    for (const auto& p : sub->parameters(/*recurse=*/false))
      if (p.defined() && p.numel() > 0) out.push_back(p);
  }
  return out;
}

}  // namespace squeeze::nn
