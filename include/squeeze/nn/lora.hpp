#pragma once
// LoRA / QLoRA for libtorch modules.
//   nn::Nf4Weight         a frozen [out, in] weight packed as NF4 (nn/nf4_weight.hpp)
//   nn::LoRALinear        y = base(x) + scaling * (x A^T) B^T,  scaling = alpha / r
//                         base: a frozen dense weight, an Nf4Weight dequantised to x's dtype per forward
//                         (and again in backward: only the packed bytes stay alive between the two), or an
//                         nn::QuantizedLinear (GPTQ v1 packed layout, 2/3/4/8 bits; its own CPU / tensor-core
//                         GEMM / GEMV forward, dX = dY W on a transient dequantized W in backward)
//                         A [r, in] kaiming-uniform (a = sqrt 5, as torch::nn::Linear), B [out, r] zeros, so
//                         an adapted model starts out computing exactly what the base did.
//                         Only A ("lora_A") and B ("lora_B") are parameters; the base is buffers.
//   apply_lora<S>(model)  freezes every parameter of `model` and swaps each torch::nn::Linear / Linear
//                         child whose name is one of LoRA's targets (q, k, v, o, gate, up, down; also the
//                         Hugging Face spelling q_proj, ..., down_proj) for a LoRALinear; under
//                         Quantized<4, NF4, ...> the base is packed to NF4 first, and the other block linears
//                         (same seven names) become frozen Nf4Linears; under Quantized<B, GPTQ|RTN, Group<G>|
//                         PerChannel> the same with the GPTQ packed layout and frozen nn::QuantizedLinears.
//                         A child that is already an nn::QuantizedLinear (a GPTQ checkpoint loaded packed) is
//                         adopted as it is: targets get adapters on it, the others stay.
//   nn::Nf4Linear         a frozen NF4 linear without adapter (QLoRA's non-target projections)
//   prepare_lora<S>(model, device)   to device + compute type, apply_lora<S>, parameters for the optimizer
//   forward_linear(parent, "q", x)   the child registered as "q", whatever it now is (for modules that
//                         keep typed members: replace_module cannot re-point a member, see apply_lora);
//                         modules implementing nn::LinearForward plug in too
//   merge_lora(model)     folds scaling * B A into each adapter's base, back to a dense torch::nn::Linear (export)
//   merge_adapters(model) / unmerge_adapters(model)   the same in place and back (dense bases; PEFT's merge_adapter)
// GPTQ-format bases and apply_lora: apply_lora has no calibration data, so it fills the GPTQ layout by
// round-to-nearest (quant/rtn.hpp: asymmetric, fp16 scales, g_idx = i / G; packed on the CPU, then moved back
// to the weight's device). A Hessian-quantized (GPTQ) base comes from quantizing first (examples/llama_gptq
// writes packed checkpoints): load it packed (nn::QuantizedLinear children) and apply_lora, or attach one
// adapter with LoRALinear(QuantizedLinear, options). Format, memory and kernels are the same either way.
// CUDA: NF4 dequantisation and the GPTQ kernels on the GPU need this header in a .cu translation unit (nvcc);
// elsewhere CUDA inputs with a packed base get a clear error. Dense bases run on any device.
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "squeeze/plan/memory.hpp"
#include "squeeze/policy/strategy.hpp"
#include "squeeze/quant/nf4.hpp"
#include "squeeze/quant/rtn.hpp"
#include "squeeze/engine/torch_types.hpp"
#include "squeeze/nn/quantized_linear.hpp"
#include "squeeze/nn/layers.hpp"
#include "squeeze/nn/nf4_weight.hpp"
#include "squeeze/nn/rtn.hpp"

namespace squeeze::nn {

// ---- LoRALinear ------------------------------------------------------------------------------------------------
struct LoRAOptions {
  int64_t rank = 8;
  double alpha = 16;                                  // scaling = alpha / rank
  torch::ScalarType adapter_dtype = torch::kFloat32;  // A and B (the trainable "master" copy)
  // >= 0: A is drawn from a generator seeded with this (apply_lora: one seed per layer), so every rank and every
  // run starts from the same adapters whatever else drew from torch's global generator; < 0: the global generator.
  int64_t seed = -1;
};

namespace detail {
// y = x W^T (+ bias) + s (x A^T) B^T on an NF4 base as one autograd node (the whole forward of such a layer: the base
// runs only here). Its backward adds the adapter's input gradient in
// the base GEMM's epilogue (dX = dY W, then dX += (s dY B) A in place) where the two-node form writes a second
// [N, in] gradient and adds them: one pass over [N, in] written and two read fewer per adapter. The forward is the
// two-node form's, op for op. a [r, in], b [out, r] and bias [out] (frozen, or undefined) in x's dtype; W dequantised
// in each pass and freed after.
struct Nf4LoraFn : torch::autograd::Function<Nf4LoraFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& a,
                               const torch::Tensor& b, const std::optional<torch::Tensor>& bias, int64_t weight_ptr, double scaling) {
    const auto* w = reinterpret_cast<const Nf4Weight*>(weight_ptr);
    const torch::Tensor x2 = x.reshape({-1, x.size(-1)});                 // [N, in]
    torch::Tensor y = torch::mm(x2, w->dequantize(x.scalar_type()).t());  // [N, out]
    if (bias) y.add_(*bias);
    const torch::Tensor xa = torch::mm(x2, a.t());  // [N, r]
    y.addmm_(xa, b.t(), /*beta=*/1, /*alpha=*/scaling);
    ctx->save_for_backward({x2, a, b, xa});
    ctx->saved_data["w"] = weight_ptr;
    ctx->saved_data["scaling"] = scaling;
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = y.size(1);
    return y.view(sizes);  // [..., out]
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list g) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x2 = saved[0], &a = saved[1], &b = saved[2], &xa = saved[3];
    const double scaling = ctx->saved_data["scaling"].toDouble();
    const torch::Tensor dy = g[0].reshape({-1, b.size(0)});  // [N, out]
    const torch::Tensor dxa = torch::mm(dy, b) * scaling;    // [N, r]
    torch::Tensor dx;
    if (ctx->needs_input_grad(0)) {
      const auto* w = reinterpret_cast<const Nf4Weight*>(ctx->saved_data["w"].toInt());
      dx = torch::mm(dy, w->dequantize(dy.scalar_type()));  // [N, in]
      dx.addmm_(dxa, a);
      std::vector<int64_t> sizes = g[0].sizes().vec();
      sizes.back() = x2.size(1);
      dx = dx.view(sizes);
    }
    const torch::Tensor da = ctx->needs_input_grad(1) ? torch::mm(dxa.t(), x2) : torch::Tensor();           // [r, in]
    const torch::Tensor db = ctx->needs_input_grad(2) ? torch::mm(dy.t(), xa) * scaling : torch::Tensor();  // [out, r]
    return {dx, da, db, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};
}  // namespace detail

class LoRALinearImpl : public torch::nn::Module {
 public:
  // Dense frozen base: weight [out, in] (kept as given: store it in the compute dtype), bias [out] or undefined.
  LoRALinearImpl(const torch::Tensor& weight, const torch::Tensor& bias, const LoRAOptions& o) : opt_(o) {
    TORCH_CHECK(weight.dim() == 2 && weight.numel() > 0, "LoRALinear: base weight must be a non-empty [out, in] tensor, got ",
                weight.sizes());
    out_ = weight.size(0);
    in_ = weight.size(1);
    weight_ = register_buffer("weight", weight.detach().clone());
    init(bias, weight.device());
  }
  // NF4 frozen base.
  LoRALinearImpl(Nf4Weight w, const torch::Tensor& bias, const LoRAOptions& o) : opt_(o), nf4_(std::move(w)), is_nf4_(true) {
    out_ = nf4_.out;
    in_ = nf4_.in;
    nf4_.codes = register_buffer("nf4_codes", nf4_.codes);
    nf4_.absmax = register_buffer("nf4_absmax", nf4_.absmax);
    nf4_.absmax_code = register_buffer("nf4_absmax_code", nf4_.absmax_code);
    nf4_.nested_absmax = register_buffer("nf4_nested_absmax", nf4_.nested_absmax);
    nf4_.nested_map = register_buffer("nf4_nested_map", nf4_.nested_map);
    nf4_.absmax_offset = register_buffer("nf4_absmax_offset", nf4_.absmax_offset);
    init(bias, nf4_.device());
  }
  // GPTQ-format frozen base (registered as child "base"; its bias, if any, is the base's). Build it from a
  // packed checkpoint layer (QuantizedLinear(quant::PackedLinear)) or from a dense weight (quantize_rtn).
  LoRALinearImpl(QuantizedLinear base, const LoRAOptions& o) : opt_(o) {
    TORCH_CHECK(base, "LoRALinear: the QuantizedLinear base is empty");
    gptq_ = register_module("base", std::move(base));
    out_ = gptq_->out_features();
    in_ = gptq_->in_features();
    init(torch::Tensor(), gptq_->device());
  }

  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override {
    detail::to_keep_types(*this, device, dtype, non_blocking, stays());
  }
  void to(torch::Dtype dtype, bool non_blocking = false) override {
    detail::to_keep_types(*this, std::nullopt, dtype, non_blocking, stays());
  }
  void to(torch::Device device, bool non_blocking = false) override {
    detail::to_keep_types(*this, device, std::nullopt, non_blocking, stays());
  }

  // The NF4 base's buffers (null for a dense or GPTQ-format base): Offload<Host, Streamed> moves them to host memory.
  Nf4Weight* packed_nf4() { return is_nf4_ ? &nf4_ : nullptr; }
  // The NF4 buffers stay in their host memory when the module moves (its unit brings them where they are used).
  std::string_view stays() const { return is_nf4_ && nf4_.home ? "nf4_" : ""; }

  torch::Tensor forward(const torch::Tensor& x) {  // x: [..., in] -> [..., out]
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_, "LoRALinear: input has ", x.dim() ? x.size(-1) : 0, " features, layer expects ", in_);
    TORCH_CHECK(x.is_floating_point(), "LoRALinear: floating-point input required, got ", x.scalar_type());
    const auto dt = x.scalar_type();
    if (is_nf4_) {  // QLoRA's layers: one node, base included (an NF4 base is never merged: merge_adapter refuses it)
      TORCH_CHECK(x.device() == nf4_.device(), "LoRALinear: input on ", x.device(), " but the NF4 weight on ", nf4_.device());
      return detail::Nf4LoraFn::apply(x, lora_A.to(dt), lora_B.to(dt), bias_.defined() ? std::optional(bias_.to(dt)) : std::nullopt,
                                      reinterpret_cast<int64_t>(&nf4_), scaling());
    }
    torch::Tensor y = base_forward(x);
    if (merged_) {  // the adapter is in the base weight (merge_adapter)
      TORCH_CHECK(!(is_training() && torch::GradMode::is_enabled() && lora_B.requires_grad()),
                  "LoRALinear: the adapter is merged into the base weight, so training would not reach it: unmerge_adapter() first");
      return y;
    }
    const torch::Tensor xa = torch::matmul(x, lora_A.to(dt).t()).reshape({-1, lora_A.size(0)});  // [N, r]
    // y + scaling * xa B^T as one GEMM whose epilogue adds y: no separate scale and add passes over [N, out] (forward,
    // recomputation), and backward's gradient of y is the incoming one as it is.
    const torch::Tensor out = torch::addmm(y.reshape({-1, out_}), xa, lora_B.to(dt).t(), /*beta=*/1, /*alpha=*/scaling());  // [N, out]
    return out.view(y.sizes());                                                                                             // [..., out]
  }
  // The frozen base alone (no adapter).
  torch::Tensor base_forward(const torch::Tensor& x) {
    if (gptq_) return gptq_->forward(x);  // its kernels by device and batch; backward dX = dY W (quantized_linear.hpp)
    torch::Tensor y;
    if (is_nf4_) {
      TORCH_CHECK(x.device() == nf4_.device(), "LoRALinear: input on ", x.device(), " but the NF4 weight on ", nf4_.device());
      // (module.to(device) moves buffers with set_data, so nf4_'s tensors follow it)
      y = detail::Nf4MatmulFn::apply(x, reinterpret_cast<int64_t>(&nf4_));
      if (bias_.defined()) y = y + bias_.to(x.scalar_type());
      return y;
    }
    // torch::nn::Linear's own call, so an adapter with B = 0 reproduces the replaced layer bit for bit
    return torch::nn::functional::linear(x, weight_.to(x.scalar_type()), bias_.defined() ? bias_.to(x.scalar_type()) : torch::Tensor());
  }

  // The base weight [out, in] in float (dequantised when NF4), plus scaling * B A.
  torch::Tensor merged_weight() const {
    torch::NoGradGuard ng;
    const torch::Tensor base = gptq_     ? gptq_.ptr()->dequantize(torch::kFloat32)
                               : is_nf4_ ? nf4_.dequantize(torch::kFloat32)
                                         : weight_.to(torch::kFloat32);
    return merged_ ? base : base + delta_weight();
  }
  // A dense torch::nn::Linear with the adapter folded in (float weights, on the layer's device).
  torch::nn::Linear merged() const {
    const torch::Tensor& bias = gptq_ ? gptq_->bias() : bias_;
    torch::nn::Linear lin(torch::nn::LinearOptions(in_, out_).bias(bias.defined()));
    torch::NoGradGuard ng;
    lin->weight.set_data(merged_weight());
    if (bias.defined()) lin->bias.set_data(bias.to(torch::kFloat32).clone());
    return lin;
  }

  // PEFT's merge_adapter / unmerge_adapter, in place on a dense base: W += scaling · B A (computed in float, added in
  // the base's dtype) and the forward skips the adapter while merged; unmerge subtracts the same product. In float
  // the round trip gives W back to within its rounding; NF4 and GPTQ bases cannot take it (merge_lora exports them).
  void merge_adapter() {
    TORCH_CHECK(!merged_, "LoRALinear: the adapter is already merged");
    TORCH_CHECK(!is_nf4_ && !gptq_, "LoRALinear: merge_adapter needs a dense base; an ", is_nf4_ ? "NF4" : "GPTQ",
                " base stays quantized (merge_lora exports a dense copy instead)");
    torch::NoGradGuard ng;
    weight_.add_(delta_weight().to(weight_.scalar_type()));
    merged_ = true;
  }
  void unmerge_adapter() {
    TORCH_CHECK(merged_, "LoRALinear: the adapter is not merged");
    torch::NoGradGuard ng;
    weight_.sub_(delta_weight().to(weight_.scalar_type()));
    merged_ = false;
  }
  bool adapter_merged() const { return merged_; }
  // scaling · B A [out, in] in float: what the adapter adds to the base weight.
  torch::Tensor delta_weight() const {
    torch::NoGradGuard ng;
    return torch::matmul(lora_B.to(torch::kFloat32), lora_A.to(torch::kFloat32)) * scaling();
  }

  double scaling() const { return opt_.alpha / double(opt_.rank); }
  int64_t rank() const { return opt_.rank; }
  double alpha() const { return opt_.alpha; }
  // Imported adapters (PEFT's lora_alpha) may carry any positive alpha, not the strategy's integer one.
  void set_alpha(double alpha) {
    TORCH_CHECK(alpha > 0 && std::isfinite(alpha), "LoRALinear: alpha must be positive, got ", alpha);
    opt_.alpha = alpha;
  }
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  bool nf4() const { return is_nf4_; }
  const Nf4Weight& nf4_weight() const { return nf4_; }
  bool gptq() const { return !gptq_.is_empty(); }
  QuantizedLinear gptq_base() const { return gptq_; }  // the shared base layer; empty unless gptq()
  // Bytes of the frozen base (packed NF4, GPTQ layout with everything its QuantizedLinear keeps resident, or dense).
  int64_t base_bytes() const {
    if (gptq_) return gptq_->bytes();
    return is_nf4_ ? nf4_.bytes() : weight_.numel() * int64_t(weight_.element_size());
  }

  torch::Tensor lora_A;  // [r, in]   trainable
  torch::Tensor lora_B;  // [out, r]  trainable

 private:
  void init(const torch::Tensor& bias, torch::Device dev) {
    TORCH_CHECK(opt_.rank >= 1, "LoRALinear: rank must be >= 1, got ", opt_.rank);
    TORCH_CHECK(opt_.alpha > 0 && std::isfinite(opt_.alpha), "LoRALinear: alpha must be positive, got ", opt_.alpha);
    TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == out_), "LoRALinear: bias must be [", out_, "]");
    if (bias.defined()) bias_ = register_buffer("bias", bias.detach().clone());
    const auto o = torch::TensorOptions().dtype(opt_.adapter_dtype).device(dev);
    torch::Tensor a = torch::empty({opt_.rank, in_}, o);
    if (opt_.seed >= 0) {  // kaiming_uniform_ with a = sqrt 5 is U(-1/sqrt(in), 1/sqrt(in)); drawn on the CPU, then moved
      const double bound = 1.0 / std::sqrt(double(in_));
      auto gen = at::make_generator<at::CPUGeneratorImpl>(uint64_t(opt_.seed));
      a.copy_(torch::empty({opt_.rank, in_}, torch::kFloat64).uniform_(-bound, bound, gen));
    } else {
      torch::nn::init::kaiming_uniform_(a, std::sqrt(5.0));  // = U(-1/sqrt(in), 1/sqrt(in)), torch::nn::Linear's init
    }
    lora_A = register_parameter("lora_A", a);
    lora_B = register_parameter("lora_B", torch::zeros({out_, opt_.rank}, o));
  }

  LoRAOptions opt_;
  int64_t in_ = 0, out_ = 0;
  bool merged_ = false;  // merge_adapter: scaling · B A is in weight_
  torch::Tensor weight_, bias_;
  Nf4Weight nf4_;
  bool is_nf4_ = false;
  QuantizedLinear gptq_{nullptr};
};
TORCH_MODULE(LoRALinear);

// A frozen NF4 linear without adapter: the QLoRA base of the projections LoRA does not target (all seven
// block linears are 4-bit under Quantized<4, NF4>, as the planner counts them).
class Nf4LinearImpl : public torch::nn::Module {
 public:
  Nf4LinearImpl(Nf4Weight w, const torch::Tensor& bias) : nf4_(std::move(w)) {
    nf4_.codes = register_buffer("nf4_codes", nf4_.codes);
    nf4_.absmax = register_buffer("nf4_absmax", nf4_.absmax);
    nf4_.absmax_code = register_buffer("nf4_absmax_code", nf4_.absmax_code);
    nf4_.nested_absmax = register_buffer("nf4_nested_absmax", nf4_.nested_absmax);
    nf4_.nested_map = register_buffer("nf4_nested_map", nf4_.nested_map);
    nf4_.absmax_offset = register_buffer("nf4_absmax_offset", nf4_.absmax_offset);
    TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == nf4_.out), "Nf4Linear: bias must be [", nf4_.out, "]");
    if (bias.defined()) bias_ = register_buffer("bias", bias.detach().clone());
  }
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override {
    detail::to_keep_types(*this, device, dtype, non_blocking, stays());
  }
  void to(torch::Dtype dtype, bool non_blocking = false) override {
    detail::to_keep_types(*this, std::nullopt, dtype, non_blocking, stays());
  }
  void to(torch::Device device, bool non_blocking = false) override {
    detail::to_keep_types(*this, device, std::nullopt, non_blocking, stays());
  }

  torch::Tensor forward(const torch::Tensor& x) {  // x: [..., in] -> [..., out]
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == nf4_.in, "Nf4Linear: input has ", x.dim() ? x.size(-1) : 0, " features, layer expects ",
                nf4_.in);
    TORCH_CHECK(x.is_floating_point(), "Nf4Linear: floating-point input required, got ", x.scalar_type());
    TORCH_CHECK(x.device() == nf4_.device(), "Nf4Linear: input on ", x.device(), " but the NF4 weight on ", nf4_.device());
    torch::Tensor y = detail::Nf4MatmulFn::apply(x, reinterpret_cast<int64_t>(&nf4_));
    return bias_.defined() ? y + bias_.to(x.scalar_type()) : y;
  }
  Nf4Weight* packed_nf4() { return &nf4_; }
  std::string_view stays() const { return nf4_.home ? "nf4_" : ""; }
  const Nf4Weight& nf4_weight() const { return nf4_; }
  const torch::Tensor& bias() const { return bias_; }  // undefined without one
  int64_t base_bytes() const { return nf4_.bytes(); }
  // A dense torch::nn::Linear (float), for export.
  torch::nn::Linear dense() const {
    torch::NoGradGuard ng;
    torch::nn::Linear lin(torch::nn::LinearOptions(nf4_.in, nf4_.out).bias(bias_.defined()));
    lin->weight.set_data(nf4_.dequantize(torch::kFloat32));
    if (bias_.defined()) lin->bias.set_data(bias_.to(torch::kFloat32).clone());
    return lin;
  }

 private:
  Nf4Weight nf4_;
  torch::Tensor bias_;
};
TORCH_MODULE(Nf4Linear);

// ---- applying to a model ---------------------------------------------------------------------------------------
namespace detail {
// Child names (squeeze's LLaMA, then the Hugging Face spelling) per LoraTargets bit q, k, v, o, gate, up, down.
inline constexpr std::string_view kLoraTargetNames[7] = {"q", "k", "v", "o", "gate", "up", "down"};
inline bool is_lora_target(std::string_view name, unsigned targets) {
  for (int i = 0; i < 7; ++i) {
    if (!(targets & (1u << i))) continue;
    const std::string_view t = kLoraTargetNames[i];
    if (name == t) return true;
    if (name.size() == t.size() + 5 && name.substr(0, t.size()) == t && name.substr(t.size()) == "_proj") return true;
  }
  return false;
}

// Whether apply_lora packs child `name` of its parent under a quantized strategy: a dense linear (torch's, or squeeze's
// neither backed nor sharded) named like one of the seven projections. make_trainer leaves these on the host.
inline bool is_packed_base(const std::string& name, torch::nn::Module& m) {
  if (!is_lora_target(name, 127u)) return false;
  if (dynamic_cast<torch::nn::LinearImpl*>(&m) != nullptr) return true;
  const auto* l = dynamic_cast<LinearImpl*>(&m);
  return l != nullptr && !l->backed() && l->group() == nullptr;
}
inline bool holds_packed_base(torch::nn::Module& m) {
  for (const auto& c : m.named_children())
    if (is_packed_base(c.key(), *c.value()) || holds_packed_base(*c.value())) return true;
  return false;
}

// Quantized<B, GPTQ|RTN, Group<G>|PerChannel> -> the round-to-nearest options filling its GPTQ layout.
template <class Q>
constexpr quant::RtnOptions rtn_options() {
  static_assert(std::is_same_v<typename Q::method, GPTQ> || std::is_same_v<typename Q::method, RTN>,
                "rtn_options<Q> takes a Quantized<B, GPTQ|RTN, ...> policy");
  return quant::RtnOptions{Q::bits, Q::group, /*sym=*/false};
}
}  // namespace detail

// A frozen nn::QuantizedLinear holding w [out, in] (and bias [out], stored fp16 as GPTQ checkpoints do) in the
// GPTQ packed layout, filled by round-to-nearest: quant::rtn_quantize on the host's cores for a CPU w, rtn_pack
// (nn/rtn.hpp, the same bits) on w's GPU for a CUDA one; the layer goes to w's device. fused_tiles: see
// QuantizedLinearImpl's constructor.
inline QuantizedLinear quantize_rtn(const torch::Tensor& w, const torch::Tensor& bias, const quant::RtnOptions& o,
                                    bool fused_tiles = true) {
  TORCH_CHECK(w.dim() == 2 && w.numel() > 0, "quantize_rtn: weight must be a non-empty [out, in] tensor, got ", w.sizes());
  TORCH_CHECK(w.is_floating_point(), "quantize_rtn: floating-point weight required, got ", w.scalar_type());
  TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == w.size(0)), "quantize_rtn: bias must be [", w.size(0), "]");
  quant::PackedLinear p;
  if (w.is_cuda()) {  // on the device, a piece at a time: only the packed words come to the host (same bits)
    p = rtn_pack(w.detach(), o, rtn_piece_rows(w.size(1)));
  } else {
    const torch::Tensor wc = w.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    try {
      p = quant::rtn_quantize({wc.data_ptr<float>(), size_t(wc.numel())}, wc.size(0), wc.size(1), o);
    } catch (const squeeze::Error& e) {
      TORCH_CHECK(false, "quantize_rtn: ", e.what());
    }
  }
  if (bias.defined()) {
    const torch::Tensor b = bias.detach().to(torch::kCPU, torch::kHalf).contiguous();
    const auto* bp = reinterpret_cast<const half*>(b.data_ptr<at::Half>());
    p.bias.assign(bp, bp + b.numel());
  }
  QuantizedLinear q(p, fused_tiles);
  q->to(w.device());
  return q;
}

struct AdaptedLayer {
  std::string name;  // dotted path, e.g. "block0.attn.q"
  LoRALinear layer;
};

// Where apply_lora puts each dense base just before it packs or adapts it: one layer at a time, so the device never
// holds the whole dense model (make_trainer's quantized strategies leave the bases on the host for this). Unset: the
// bases stay where they are.
// pack: under Quantized<B, GPTQ, ...>, what fills the GPTQ layout for the layer at `path` (its dotted name below the
// module apply_lora was given) from its placed weight and bias, e.g. GPTQ on that layer's calibration Hessian
// (nn/layerwise.hpp). Unset: round-to-nearest (quantize_rtn).
struct LoraBasePlacement {
  std::optional<torch::Device> device;
  std::optional<torch::Dtype> dtype;
  std::function<QuantizedLinear(const std::string& path, const torch::Tensor& weight, const torch::Tensor& bias)> pack;
};

// Freezes every parameter of `model`, then replaces each Linear / Linear child named by S's LoRA targets
// with a LoRALinear: rank and alpha from LoRA<R, A>; under Quantized<4, NF4, ...> the base is packed to NF4
// (block and DoubleQuant from the policy), under Quantized<B, GPTQ|RTN, Group<G>|PerChannel> to the GPTQ layout
// by round-to-nearest (B bits, group G; see the note at the top), otherwise kept dense in S's compute type;
// adapters in S's master type. Children that already are nn::QuantizedLinear or nn::Nf4Linear (a quantized
// checkpoint's layers, nn/hf_quantized.hpp) are adopted as they are.
// GPTQ-format layers it packs itself keep no tensor-core tile copy when S trains (QuantizedLinearImpl's
// fused_tiles: a training forward runs more rows than the fused GEMM serves), so their bytes are the planner's.
// The replaced layer's weight is released (set to an empty tensor), so a typed member that still points at the
// old layer (e.g. nn/llama.hpp's `Linear q`) holds no memory: such modules must call their projections
// through forward_linear(*this, "q", x). `place` moves each dense base (weight and bias) first. Layers an earlier call
// adapted keep their adapters (trainable as they were) and are reported again. Each new adapter's A is drawn from
// a generator seeded with its position among the adapted layers in module order, counted from first_seed: a model
// adapted part by part (nn/layerwise.hpp, one block at a time, first_seed = the adapters of the blocks before)
// gets the adapters the whole model would. Returns the adapted layers in module order; errors when none matched.
template <class S>
std::vector<AdaptedLayer> apply_lora(torch::nn::Module& model, const LoraBasePlacement& place = {}, int64_t first_seed = 0) {
  static_assert(S::has_lora,
                "apply_lora<S> needs a strategy with LoRA<R, A>: e.g. Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, ...>");
  using L = typename S::lora;
  using WQ = typename S::weight_quantization;
  constexpr bool nf4 = S::quantized_weights && std::is_same_v<typename WQ::method, NF4>;
  constexpr bool gptq = S::quantized_weights && !nf4;  // GPTQ or RTN: the strategy's traits allow nothing else
  static_assert(!gptq || !WQ::act_order,
                "apply_lora fills the GPTQ layout by round-to-nearest, which has no column order: drop ActOrder, or quantize with "
                "GPTQ + ActOrder first (examples/llama_gptq) and apply_lora to the packed model");
  LoRAOptions opt{L::rank, double(L::alpha), torch_dtype<typename S::master_type>()};
  const auto pack_gptq = [&](const std::string& path, const torch::Tensor& w, const torch::Tensor& b) -> QuantizedLinear {
    if constexpr (gptq)
      return place.pack ? place.pack(path, w, b) : quantize_rtn(w, b, detail::rtn_options<WQ>(), !S::training);
    else
      return QuantizedLinear{nullptr};
  };
  int64_t layer_index = first_seed;  // each adapted layer's generator seed: its position in module order
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (dynamic_cast<LoRALinearImpl*>(m.get()) != nullptr) continue;  // adapters of an earlier call keep training
    for (auto& p : m->parameters(/*recurse=*/false)) p.set_requires_grad(false);
  }

  const auto placed = [&](torch::Tensor t) {  // set_data: the layer's own parameter (the same TensorImpl) follows
    if (!t.defined() || (!place.device && !place.dtype)) return;
    torch::NoGradGuard ng;
    t.set_data(t.to(place.device.value_or(t.device()), place.dtype.value_or(t.scalar_type())));
  };
  std::vector<AdaptedLayer> adapted;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const std::shared_ptr<torch::nn::Module>& parent = item.value();
    for (const auto& child : parent->named_children()) {
      const bool target = detail::is_lora_target(child.key(), L::targets);
      if (!target && !(S::quantized_weights && detail::is_lora_target(child.key(), 127u))) continue;
      torch::Tensor weight, bias;
      if (auto ql = std::dynamic_pointer_cast<QuantizedLinearImpl>(child.value())) {  // already packed: keep it
        if (!target) continue;
        LoRALinear rep(QuantizedLinear(ql), opt);
        parent->replace_module(child.key(), rep);
        adapted.push_back({item.key().empty() ? child.key() : item.key() + "." + child.key(), rep});
        continue;
      }
      if (auto nl = std::dynamic_pointer_cast<Nf4LinearImpl>(child.value())) {  // an NF4 checkpoint's layer: its codes as they are
        if (!target) continue;
        LoRALinear rep(nl->nf4_weight(), nl->bias(), opt);
        parent->replace_module(child.key(), rep);
        adapted.push_back({item.key().empty() ? child.key() : item.key() + "." + child.key(), rep});
        continue;
      }
      if (auto lin = std::dynamic_pointer_cast<torch::nn::LinearImpl>(child.value())) {
        placed(lin->weight);
        placed(lin->bias);
        weight = lin->weight;
        bias = lin->bias;
      } else if (auto sl = std::dynamic_pointer_cast<LinearImpl>(child.value())) {
        // squeeze's own Linear keeps its identity (a user's member stays valid): it gets the new backing.
        const std::string path = item.key().empty() ? child.key() : item.key() + "." + child.key();
        TORCH_CHECK(sl->group() == nullptr, "apply_lora: ", path, " is sharded by a stage-3 trainer; apply LoRA before sharding");
        if (sl->backed()) {  // adapted or packed already: an adapter counts in the seeds' order and is reported
          if (auto l = std::dynamic_pointer_cast<LoRALinearImpl>(sl->backing())) {
            ++layer_index;
            adapted.push_back({path, LoRALinear(l)});
          }
          continue;
        }
        placed(sl->weight);
        if (sl->has_bias()) placed(sl->bias);
        torch::NoGradGuard ng;
        const torch::Tensor w = sl->weight, b = sl->has_bias() ? sl->bias : torch::Tensor();
        if (!target) {
          if constexpr (nf4) {
            Nf4Linear q(Nf4Weight::quantize(w, quant::nf4_options<WQ>()), b);
            sl->back_with("frozen", q.ptr(), [m = q.get()](const torch::Tensor& x) { return m->forward(x); });
          }
          if constexpr (gptq) {
            QuantizedLinear q = pack_gptq(path, w, b);
            sl->back_with("frozen", q.ptr(), [m = q.get()](const torch::Tensor& x) { return m->forward(x); });
          }
          continue;
        }
        LoRALinear rep{nullptr};
        opt.seed = layer_index++;
        if constexpr (nf4)
          rep = LoRALinear(Nf4Weight::quantize(w, quant::nf4_options<WQ>()), b, opt);
        else if constexpr (gptq)
          rep = LoRALinear(pack_gptq(path, w, b), opt);
        else
          rep = LoRALinear(w.to(torch_dtype<typename S::compute_type>()), b, opt);
        sl->back_with("lora", rep.ptr(), [m = rep.get()](const torch::Tensor& x) { return m->forward(x); });
        adapted.push_back({path, rep});
        continue;
      } else {
        continue;  // already adapted, or not a linear layer
      }
      torch::NoGradGuard ng;
      const std::string path = item.key().empty() ? child.key() : item.key() + "." + child.key();
      if (!target) {  // a frozen quantized base without adapter
        if constexpr (nf4) parent->replace_module(child.key(), Nf4Linear(Nf4Weight::quantize(weight, quant::nf4_options<WQ>()), bias));
        if constexpr (gptq) parent->replace_module(child.key(), pack_gptq(path, weight, bias));
      } else {
        LoRALinear rep{nullptr};
        if constexpr (nf4)
          rep = LoRALinear(Nf4Weight::quantize(weight, quant::nf4_options<WQ>()), bias, opt);
        else if constexpr (gptq)
          rep = LoRALinear(pack_gptq(path, weight, bias), opt);
        else
          rep = LoRALinear(weight.to(torch_dtype<typename S::compute_type>()), bias, opt);
        parent->replace_module(child.key(), rep);
        adapted.push_back({path, rep});
      }
      weight.set_data(torch::empty({0}, weight.options()));  // release the dense copy (see above)
      if (bias.defined()) bias.set_data(torch::empty({0}, bias.options()));
    }
  }
  TORCH_CHECK(!adapted.empty(),
              "apply_lora: no Linear child named like LoRA's targets (q, k, v, o, gate, up, down or q_proj, ...) in the model");
  return adapted;
}

// Any other module that stands in for a linear layer under forward_linear (e.g. examples/llama_gptq's
// Hessian-capturing layer and its nn::QuantizedLinear holder): implement this next to torch::nn::Module.
struct LinearForward {
  virtual ~LinearForward() = default;
  virtual torch::Tensor forward_linear(const torch::Tensor& x) = 0;  // [..., in] -> [..., out]
};

// y = child `name` of parent applied to x, whatever module apply_lora/merge_lora left there.
inline torch::Tensor forward_linear(torch::nn::Module& parent, const std::string& name, const torch::Tensor& x) {
  const auto children = parent.named_children();
  const auto* found = children.find(name);
  TORCH_CHECK(found != nullptr, "forward_linear: no child named '", name, "'");
  const std::shared_ptr<torch::nn::Module>& m = *found;
  if (auto l = std::dynamic_pointer_cast<LinearForward>(m)) return l->forward_linear(x);
  if (auto l = std::dynamic_pointer_cast<LoRALinearImpl>(m)) return l->forward(x);
  if (auto l = std::dynamic_pointer_cast<Nf4LinearImpl>(m)) return l->forward(x);
  if (auto l = std::dynamic_pointer_cast<QuantizedLinearImpl>(m)) return l->forward(x);
  if (auto l = std::dynamic_pointer_cast<LinearImpl>(m)) return l->forward(x);
  if (auto l = std::dynamic_pointer_cast<torch::nn::LinearImpl>(m)) return l->forward(x);
  TORCH_CHECK(false, "forward_linear: child '", name, "' is not a Linear, Linear, LoRALinear, Nf4Linear, QuantizedLinear or LinearForward");
  return {};
}

// Trainable adapter parameters (lora_A, lora_B of every LoRALinear): what the optimizer gets.
inline std::vector<torch::Tensor> lora_parameters(torch::nn::Module& model) {
  std::vector<torch::Tensor> ps;
  for (const auto& p : model.named_parameters())
    if (p.value().requires_grad()) ps.push_back(p.value());
  return ps;
}

// Replaces every LoRALinear in `model` by a dense torch::nn::Linear holding W + scaling * B A (float), for
// export. Returns how many were merged.
inline int64_t merge_lora(torch::nn::Module& model) {
  int64_t merged = 0;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    if (std::dynamic_pointer_cast<LoRALinearImpl>(item.value())) continue;  // its GPTQ base goes with it
    if (auto sl = std::dynamic_pointer_cast<LinearImpl>(item.value()); sl && sl->backed()) {
      const auto back = sl->backing();
      torch::nn::Linear dense{nullptr};
      if (auto l = std::dynamic_pointer_cast<LoRALinearImpl>(back))
        dense = l->merged(), ++merged;
      else if (auto q = std::dynamic_pointer_cast<Nf4LinearImpl>(back))
        dense = q->dense();
      else if (auto g = std::dynamic_pointer_cast<QuantizedLinearImpl>(back))
        dense = g->dense();
      else
        TORCH_CHECK(false, "merge_lora: ", item.key(), " has a backing merge_lora does not know");
      sl->unback(dense->weight.detach(), sl->has_bias() ? dense->bias.detach() : torch::Tensor());
      continue;
    }
    if (std::dynamic_pointer_cast<LinearImpl>(item.value())) continue;  // its backing was handled above
    for (const auto& child : item.value()->named_children())
      if (auto l = std::dynamic_pointer_cast<LoRALinearImpl>(child.value())) {
        item.value()->replace_module(child.key(), l->merged());
        ++merged;
      } else if (auto q = std::dynamic_pointer_cast<Nf4LinearImpl>(child.value())) {
        item.value()->replace_module(child.key(), q->dense());
      } else if (auto g = std::dynamic_pointer_cast<QuantizedLinearImpl>(child.value())) {
        item.value()->replace_module(child.key(), g->dense());
      }
  }
  return merged;
}

// merge_adapter / unmerge_adapter on every LoRALinear of `model` (dense bases; PEFT's merge_adapter and
// unmerge_adapter): inference without the adapter's two extra products, then back to training. Returns how many.
inline int64_t merge_adapters(torch::nn::Module& model) {
  int64_t n = 0;
  for (const auto& m : model.modules(/*include_self=*/true))
    if (auto l = std::dynamic_pointer_cast<LoRALinearImpl>(m)) l->merge_adapter(), ++n;
  return n;
}
inline int64_t unmerge_adapters(torch::nn::Module& model) {
  int64_t n = 0;
  for (const auto& m : model.modules(/*include_self=*/true))
    if (auto l = std::dynamic_pointer_cast<LoRALinearImpl>(m)) l->unmerge_adapter(), ++n;
  return n;
}

// The dense float weight [out, in] a Linear's backing computes with (export): a LoRALinear's base, dequantised
// when NF4 or GPTQ, plus scaling * B A; an Nf4Linear's or QuantizedLinear's base dequantised. Undefined for any
// other module.
inline torch::Tensor dense_weight(torch::nn::Module& backing) {
  torch::NoGradGuard ng;
  if (auto* l = dynamic_cast<LoRALinearImpl*>(&backing)) return l->merged_weight();
  if (auto* q = dynamic_cast<Nf4LinearImpl*>(&backing)) return q->nf4_weight().dequantize(torch::kFloat32);
  if (auto* g = dynamic_cast<QuantizedLinearImpl*>(&backing)) return g->dequantize(torch::kFloat32);
  return {};
}

// Bytes of the frozen bases of every LoRALinear / Nf4Linear / QuantizedLinear in `model` (packed NF4, dense, or
// everything a QuantizedLinear keeps resident: QuantizedLinearImpl::bytes()).
inline int64_t frozen_base_bytes(torch::nn::Module& model) {
  int64_t bytes = 0;
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (auto l = std::dynamic_pointer_cast<LoRALinearImpl>(m); l && !l->gptq()) bytes += l->base_bytes();  // GPTQ: its child, below
    if (auto q = std::dynamic_pointer_cast<Nf4LinearImpl>(m)) bytes += q->base_bytes();
    if (auto q = std::dynamic_pointer_cast<QuantizedLinearImpl>(m)) bytes += q->bytes();
  }
  return bytes;
}

// ---- the NF4 base in host memory (Offload<Host, Streamed>) ------------------------------------------------------
namespace detail {
inline std::vector<Nf4Weight*> packed_nf4_weights(torch::nn::Module& m) {
  std::vector<Nf4Weight*> out;
  for (const auto& x : m.modules(/*include_self=*/true)) {
    Nf4Weight* w = nullptr;
    if (auto l = std::dynamic_pointer_cast<LoRALinearImpl>(x)) w = l->packed_nf4();
    if (auto l = std::dynamic_pointer_cast<Nf4LinearImpl>(x)) w = l->packed_nf4();
    if (w != nullptr) out.push_back(w);
  }
  return out;
}
}  // namespace detail

// The NF4 bases below `unit` (one block) not yet in host memory become one unit of `home`: their bytes move to its
// pinned host buffer and come back to the device when a layer of the block runs (engine/frozen_units.hpp). Returns
// the layers moved.
inline int64_t home_packed_bases(torch::nn::Module& unit, const std::string& name, const std::shared_ptr<engine::FrozenUnits>& home) {
  TORCH_CHECK(home != nullptr, "home_packed_bases: no FrozenUnits given");
  std::vector<Nf4Weight*> weights;
  for (Nf4Weight* w : detail::packed_nf4_weights(unit))
    if (w->home == nullptr) weights.push_back(w);
  if (weights.empty()) return 0;
  std::vector<torch::Tensor> tensors;
  for (Nf4Weight* w : weights)
    for (const auto& t : w->buffers()) tensors.push_back(t);
  const int index = home->add_unit(name, tensors);
  for (Nf4Weight* w : weights) {
    w->home = home;
    w->home_unit = index;
  }
  return int64_t(weights.size());
}

// The host memory the NF4 bases of `model` live in under Offload<Host, Streamed> (null: none do).
inline std::shared_ptr<engine::FrozenUnits> frozen_home(torch::nn::Module& model) {
  for (Nf4Weight* w : detail::packed_nf4_weights(model))
    if (w->home) return w->home;
  return nullptr;
}

// What a trainer needs for S's LoRA / QLoRA: the model moved to `device` in S's compute type, then
// apply_lora<S> (bases packed to NF4 on that device under Quantized<4, NF4>; adapters in S's master type).
// The optimizer takes `parameters`; nothing else of the model trains.
struct LoraSetup {
  std::vector<AdaptedLayer> layers;
  std::vector<torch::Tensor> parameters;  // every lora_A / lora_B
  int64_t adapter_params = 0;             // == layers x plan::lora_block_params<S::lora>(shape) for a LLaMA
  int64_t base_bytes = 0;                 // frozen_base_bytes (NF4: == the planner's quantized_matrix_bytes sum;
                                          // GPTQ/RTN packed by apply_lora: the same; adopted checkpoint layers
                                          // with tiles: + their tile copy, QuantizedLinearImpl::bytes)
};
template <class S>
LoraSetup prepare_lora(torch::nn::Module& model, torch::Device device) {
  model.to(device, torch_dtype<typename S::compute_type>());
  LoraSetup s;
  s.layers = apply_lora<S>(model);
  s.parameters = lora_parameters(model);
  for (const auto& p : s.parameters) s.adapter_params += p.numel();
  s.base_bytes = frozen_base_bytes(model);
  return s;
}

}  // namespace squeeze::nn
