// LoRALinear, apply_lora, merge_lora (libtorch, CPU).
// Tolerances (stated): float matmuls vs float64 references: |y - ref| <= 1e-5 * (|x| |W|^T) + 1e-6;
// bf16: 2^-7 * (|x| |W|^T) (inputs and dequantised weights are bf16 in both; the difference is the bf16
// rounding of the output and of partial sums). "Exactly" means torch::equal.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <squeeze/comm/local.hpp>
#include <squeeze/nn/llama.hpp>
#include <squeeze/train/trainer.hpp>
#include <squeeze/optim/adamw.hpp>
#include <squeeze/nn/lora.hpp>
#include <squeeze/plan/memory.hpp>
#include <squeeze/policy/strategy.hpp>

#include <sstream>
#include <functional>
#include <string>
#include <vector>

using namespace squeeze;
namespace F = torch::nn::functional;

namespace {

// A LLaMA-shaped toy block: q, k, v, o, gate, up, down (squeeze::nn::Linear, which apply_lora backs with adapters
// in place), called by name through forward_linear as nn::Llama does. Needs 2 * kv_dim == hidden.
struct ToyBlockImpl : torch::nn::Module {
  torch::Tensor gain;
  explicit ToyBlockImpl(const plan::ModelShape& s) {
    const auto lin = [](int64_t in, int64_t out) { return nn::Linear(torch::nn::LinearOptions(in, out).bias(false)); };
    register_module("q", lin(s.hidden, s.hidden));
    register_module("k", lin(s.hidden, s.kv_dim()));
    register_module("v", lin(s.hidden, s.kv_dim()));
    register_module("o", lin(s.hidden, s.hidden));
    register_module("gate", lin(s.hidden, s.ffn));
    register_module("up", lin(s.hidden, s.ffn));
    register_module("down", lin(s.ffn, s.hidden));
    gain = register_parameter("gain", torch::ones({s.hidden}));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // x: [B, h]
    using nn::forward_linear;
    const torch::Tensor kv = torch::cat({forward_linear(*this, "k", x), forward_linear(*this, "v", x)}, -1);  // [B, h]
    const torch::Tensor a = x + forward_linear(*this, "o", torch::tanh(forward_linear(*this, "q", x) + kv));
    const torch::Tensor m = F::silu(forward_linear(*this, "gate", a)) * forward_linear(*this, "up", a);  // [B, ffn]
    return (a + forward_linear(*this, "down", m)) * gain.to(x.scalar_type());
  }
};
TORCH_MODULE(ToyBlock);

struct ToyImpl : torch::nn::Module {
  std::vector<ToyBlock> blocks;
  explicit ToyImpl(const plan::ModelShape& s) {
    for (int64_t i = 0; i < s.layers; ++i) blocks.push_back(register_module("block" + std::to_string(i), ToyBlock(s)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks) x = b(x);
    return x;
  }
};
TORCH_MODULE(Toy);

constexpr plan::ModelShape kShape{/*vocab=*/100, /*hidden=*/64, /*layers=*/2, /*heads=*/4, /*kv_heads=*/2, /*ffn=*/96};

using Dense = Strategy<LoRA<4, 8>>;
using QLoRA = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed>;
using AllTargets = Strategy<Quantized<4, NF4>, LoRA<2, 4,
                                                    LoraTargets::q | LoraTargets::k | LoraTargets::v | LoraTargets::o | LoraTargets::gate |
                                                        LoraTargets::up | LoraTargets::down>>;

// max |y - ref| / (|x| |W|^T) style check in float64.
void expect_close(const torch::Tensor& y, const torch::Tensor& ref, const torch::Tensor& mag, double rel, double abs,
                  const std::string& what) {
  const torch::Tensor err = (y.to(torch::kFloat64) - ref).abs() - (mag * rel + abs);
  EXPECT_LE(err.max().item<double>(), 0.0) << what << ": max |y - ref| = " << (y.to(torch::kFloat64) - ref).abs().max().item<double>();
}

}  // namespace

TEST(LoRA, AtInitOutputEqualsTheBaseExactly) {
  torch::manual_seed(1);
  Toy model(kShape);
  const torch::Tensor x = torch::randn({5, kShape.hidden});
  const torch::Tensor before = model(x);
  const auto adapted = nn::apply_lora<Dense>(*model);
  ASSERT_EQ(adapted.size(), 4u);  // q and v in two blocks
  EXPECT_EQ(adapted[0].name, "block0.q");
  EXPECT_EQ(adapted[1].name, "block0.v");
  EXPECT_TRUE(torch::equal(model(x), before));
}

TEST(LoRA, GradientsFlowOnlyToAdapters) {
  torch::manual_seed(2);
  Toy model(kShape);
  const auto adapted = nn::apply_lora<Dense>(*model);
  const torch::Tensor x = torch::randn({7, kShape.hidden});
  for (int round = 0; round < 2; ++round) {
    model->zero_grad();
    model(x).pow(2).mean().backward();
    for (const auto& p : model->named_parameters()) {
      const bool adapter = p.key().ends_with("lora_A") || p.key().ends_with("lora_B");
      EXPECT_EQ(p.value().requires_grad(), adapter) << p.key();
      if (!adapter) {
        EXPECT_FALSE(p.value().grad().defined()) << p.key();
        continue;
      }
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      // At init B = 0, so A gets a zero gradient and B a non-zero one; once B is non-zero both move.
      const bool expect_nonzero = round == 1 || p.key().ends_with("lora_B");
      EXPECT_EQ(p.value().grad().abs().sum().item<double>() > 0, expect_nonzero) << p.key() << " round " << round;
    }
    for (const auto& b : model->named_buffers()) EXPECT_FALSE(b.value().requires_grad()) << b.key();
    torch::NoGradGuard ng;
    for (auto& a : adapted) a.layer->lora_B.normal_(0, 0.1);
  }
}

TEST(LoRA, Nf4BaseEqualsDequantisedWeightMatmul) {
  torch::manual_seed(3);
  struct Case {
    int64_t out, in;
    bool dq;
  };
  for (const Case c : {Case{48, 100, false}, Case{37, 33, true}, Case{64, 512, true}}) {
    const torch::Tensor w = torch::randn({c.out, c.in}) * 0.05;
    const torch::Tensor bias = torch::randn({c.out});
    nn::LoRALinear layer(nn::Nf4Weight::quantize(w, {.block = 64, .double_quant = c.dq}), bias, nn::LoRAOptions{.rank = 4, .alpha = 8});
    // the float64 reference weight, from the torch-free codec on the same values
    const auto p = quant::nf4_quantize(w.contiguous().data_ptr<float>(), w.numel(), {.block = 64, .double_quant = c.dq});
    torch::Tensor wd = torch::empty({c.out, c.in});
    quant::nf4_dequantize(p, wd.data_ptr<float>());
    EXPECT_EQ(layer->base_bytes(), p.bytes());
    const torch::Tensor wd64 = wd.to(torch::kFloat64);
    for (const auto dt : {torch::kFloat32, torch::kBFloat16}) {
      const torch::Tensor x = torch::randn({3, 5, c.in}).to(dt).requires_grad_(true);
      const torch::Tensor y = layer(x);  // B = 0: the base alone
      ASSERT_EQ(y.scalar_type(), dt);
      ASSERT_EQ(y.sizes(), (std::vector<int64_t>{3, 5, c.out}));
      const torch::Tensor w_ref = dt == torch::kFloat32 ? wd64 : wd.to(dt).to(torch::kFloat64);  // the weight the layer sees
      const torch::Tensor x64 = x.detach().to(torch::kFloat64);
      const torch::Tensor ref = torch::matmul(x64, w_ref.t()) + bias.to(dt).to(torch::kFloat64);
      const torch::Tensor mag = torch::matmul(x64.abs(), w_ref.abs().t()) + bias.abs().to(torch::kFloat64);
      const double rel = dt == torch::kFloat32 ? 1e-5 : std::ldexp(1.0, -7);
      expect_close(y, ref, mag, rel, 1e-6, std::string("forward ") + c10::toString(dt));
      // backward re-dequantises: dL/dx = g W
      const torch::Tensor g = torch::randn(y.sizes()).to(dt);
      y.backward(g);
      const torch::Tensor g64 = g.to(torch::kFloat64);
      expect_close(x.grad(), torch::matmul(g64, w_ref), torch::matmul(g64.abs(), w_ref.abs()), rel, 1e-6,
                   std::string("dx ") + c10::toString(dt));
    }
  }
}

// An NF4 base with a trained (non-zero) adapter, with a bias when the input needs no gradient: the one-node forward and backward
// (Nf4LoraFn) against the float64 composition y = x W^T + s (x A^T) B^T, dX = dY W + s (dY B) A, dA = s (dY B)^T x, dB = s dY^T (x A^T),
// with W, A and B as the layer sees them (A and B rounded to the compute type). Tolerance: |error| <= rel * (the same products over
// absolute values) + 1e-6; rel 1e-5 in float, 2^-6 in bf16 (x A^T and dY B are rounded to bf16 before their second product). Sizes that
// divide nothing; an input that needs no gradient gets none.
TEST(LoRA, Nf4AdapterNodeMatchesTheComposition) {
  torch::manual_seed(4);
  for (const bool x_grad : {true, false})
    for (const auto dt : {torch::kFloat32, torch::kBFloat16}) {
      const int64_t out = 37, in = 70, r = 3;
      const torch::Tensor w = torch::randn({out, in}) * 0.05;
      const torch::Tensor bias = x_grad ? torch::Tensor() : torch::randn({out});
      nn::LoRALinear layer(nn::Nf4Weight::quantize(w, {.block = 64, .double_quant = true}), bias, nn::LoRAOptions{.rank = r, .alpha = 7});
      {
        torch::NoGradGuard ng;
        layer->lora_B.normal_(0, 0.1);  // a trained adapter: B = 0 would hide its gradient paths
      }
      const double s = layer->scaling();
      const torch::Tensor x = torch::randn({2, 9, in}).to(dt).requires_grad_(x_grad);
      const torch::Tensor y = layer(x);
      ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 9, out}));
      ASSERT_EQ(y.scalar_type(), dt);
      const torch::Tensor dy = torch::randn(y.sizes()).to(dt);
      y.backward(dy);

      auto f64 = [&](const torch::Tensor& t) { return t.detach().to(dt).to(torch::kFloat64); };  // as the layer sees it
      const torch::Tensor W = f64(layer->packed_nf4()->dequantize(dt)), A = f64(layer->lora_A), B = f64(layer->lora_B);
      const torch::Tensor X = f64(x).reshape({-1, in}), G = f64(dy).reshape({-1, out});
      const double rel = dt == torch::kFloat32 ? 1e-5 : std::ldexp(1.0, -6);
      const std::string what = std::string(c10::toString(dt)) + (x_grad ? "" : ", x without grad, a bias");
      const torch::Tensor b0 = x_grad ? torch::zeros({out}, torch::kFloat64) : f64(bias);
      expect_close(y.reshape({-1, out}), X.mm(W.t()) + b0 + s * X.mm(A.t()).mm(B.t()),
                   X.abs().mm(W.abs().t()) + b0.abs() + s * X.abs().mm(A.abs().t()).mm(B.abs().t()), rel, 1e-6, "y " + what);
      if (x_grad)
        expect_close(x.grad().reshape({-1, in}), G.mm(W) + s * G.mm(B).mm(A), G.abs().mm(W.abs()) + s * G.abs().mm(B.abs()).mm(A.abs()),
                     rel, 1e-6, "dx " + what);
      else
        EXPECT_FALSE(x.grad().defined()) << what;
      expect_close(layer->lora_A.grad(), s * G.mm(B).t().mm(X), s * G.abs().mm(B.abs()).t().mm(X.abs()), rel, 1e-6, "dA " + what);
      expect_close(layer->lora_B.grad(), s * G.t().mm(X.mm(A.t())), s * G.abs().t().mm(X.abs().mm(A.abs().t())), rel, 1e-6, "dB " + what);
    }
}

namespace {
// Fits y = x (W + dW)^T, dW of rank 2, with the adapter of `layer`; returns (first, last) loss.
std::pair<double, double> fit(nn::LoRALinear& layer, const torch::Tensor& base_w, int steps) {
  torch::manual_seed(10);
  const int64_t out = layer->out_features(), in = layer->in_features();
  const torch::Tensor dW = torch::matmul(torch::randn({out, 2}), torch::randn({2, in})) * 0.05;
  const torch::Tensor x = torch::randn({256, in});
  const torch::Tensor target = torch::matmul(x, (base_w + dW).t());
  torch::optim::AdamW opt(nn::lora_parameters(*layer), torch::optim::AdamWOptions(1e-2).weight_decay(0));
  double first = 0, last = 0;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    const torch::Tensor loss = F::mse_loss(layer(x), target);
    loss.backward();
    opt.step();
    (s == 0 ? first : last) = loss.item<double>();
  }
  return {first, last};
}
// The message of the c10::Error or squeeze::Error f throws ("" when none).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const squeeze::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(LoRA, TrainingReducesLossAndMergeKeepsOutputs) {
  torch::manual_seed(4);
  const torch::Tensor w = torch::randn({32, 64}) * 0.1;
  for (const bool nf4 : {false, true}) {
    nn::LoRALinear layer = nf4 ? nn::LoRALinear(nn::Nf4Weight::quantize(w, {.block = 64, .double_quant = true}), torch::Tensor(),
                                                nn::LoRAOptions{.rank = 4, .alpha = 8})
                               : nn::LoRALinear(w, torch::Tensor(), nn::LoRAOptions{.rank = 4, .alpha = 8});
    // the base as the layer sees it (NF4: dequantised), so the adapter only has dW to learn
    const torch::Tensor base = nf4 ? layer->nf4_weight().dequantize(torch::kFloat32) : w;
    const auto [first, last] = fit(layer, base, 150);
    EXPECT_LT(last, 0.02 * first) << "nf4=" << nf4 << " first " << first << " last " << last;
    // merge: one dense Linear with W + scaling B A gives the same outputs
    torch::NoGradGuard ng;
    const torch::Tensor x = torch::randn({9, 64});
    const torch::Tensor y = layer(x);
    torch::nn::Linear merged = layer->merged();
    const torch::Tensor x64 = x.to(torch::kFloat64);
    const torch::Tensor mag =
        torch::matmul(x64.abs(), layer->merged_weight().abs().to(torch::kFloat64).t()) +
        torch::matmul(torch::matmul(x64.abs(), layer->lora_A.abs().to(torch::kFloat64).t()), layer->lora_B.abs().to(torch::kFloat64).t()) *
            layer->scaling();
    expect_close(merged(x), y.to(torch::kFloat64), mag, 1e-5, 1e-6, std::string("merged nf4=") + (nf4 ? "1" : "0"));
  }
}

TEST(LoRA, MergeLoraReplacesEveryAdapter) {
  torch::manual_seed(5);
  Toy model(kShape);
  const auto adapted = nn::apply_lora<Dense>(*model);
  {
    torch::NoGradGuard ng;
    for (auto& a : adapted) a.layer->lora_B.normal_(0, 0.1);
  }
  const torch::Tensor x = torch::randn({6, kShape.hidden});
  const torch::Tensor y = model(x).detach();
  EXPECT_EQ(nn::merge_lora(*model), 4);
  for (const auto& m : model->modules()) EXPECT_EQ(std::dynamic_pointer_cast<nn::LoRALinearImpl>(m), nullptr);
  EXPECT_TRUE(torch::allclose(model(x), y, /*rtol=*/1e-5, /*atol=*/1e-5));
}

// merge_adapters / unmerge_adapters in place (PEFT's merge_adapter / unmerge_adapter). Merged, the model computes
// what the adapted one does (fp32: within the rounding of W + scaling B A); unmerged, every base weight comes back
// within one rounding of its elements and the adapters train again. Training while merged, merging twice and an
// NF4 base are refused by name.
TEST(LoRA, MergeAndUnmergeInPlace) {
  torch::manual_seed(6);
  Toy model(kShape);
  const auto adapted = nn::apply_lora<Dense>(*model);
  std::vector<std::pair<std::shared_ptr<nn::LoRALinearImpl>, torch::Tensor>> bases;
  {
    torch::NoGradGuard ng;
    for (auto& a : adapted) a.layer->lora_B.normal_(0, 0.1);
    for (const auto& m : model->modules())
      if (auto l = std::dynamic_pointer_cast<nn::LoRALinearImpl>(m)) bases.emplace_back(l, l->named_buffers()["weight"].clone());
  }
  ASSERT_EQ(bases.size(), 4u);
  const torch::Tensor x = torch::randn({6, kShape.hidden});
  torch::Tensor y;
  {
    torch::NoGradGuard ng;
    y = model(x);
  }
  EXPECT_EQ(nn::merge_adapters(*model), 4);
  {
    torch::NoGradGuard ng;
    EXPECT_TRUE(torch::allclose(model(x), y, /*rtol=*/1e-5, /*atol=*/1e-5));
  }
  EXPECT_NE(error_of([&] { model(x); }).find("unmerge_adapter() first"), std::string::npos) << "training while merged";
  EXPECT_NE(error_of([&] { nn::merge_adapters(*model); }).find("already merged"), std::string::npos);
  EXPECT_EQ(nn::unmerge_adapters(*model), 4);
  for (const auto& [l, w] : bases) {
    const torch::Tensor now = l->named_buffers()["weight"];
    EXPECT_LE((now - w).abs().max().item<double>(), 1e-6) << "the base weight after merge and unmerge";
    EXPECT_FALSE(l->adapter_merged());
  }
  model(x).square().mean().backward();  // training again reaches the adapters
  for (auto& a : adapted) EXPECT_TRUE(a.layer->lora_B.grad().defined());
  nn::LoRALinear q(nn::Nf4Weight::quantize(torch::randn({8, 64}), {.block = 64}), torch::Tensor(), nn::LoRAOptions{.rank = 2, .alpha = 4});
  EXPECT_NE(error_of([&] { q->merge_adapter(); }).find("needs a dense base"), std::string::npos);
}

TEST(LoRA, AdapterParametersEqualThePlanner) {
  torch::manual_seed(6);
  {
    Toy model(kShape);
    nn::apply_lora<Dense>(*model);
    int64_t n = 0;
    for (const auto& p : nn::lora_parameters(*model)) n += p.numel();
    EXPECT_EQ(n, kShape.layers * plan::lora_block_params<Dense::lora>(kShape));
  }
  {
    Toy model(kShape);
    const auto adapted = nn::apply_lora<AllTargets>(*model);
    EXPECT_EQ(int64_t(adapted.size()), 7 * kShape.layers);
    int64_t n = 0, base_bytes = 0;
    for (const auto& p : nn::lora_parameters(*model)) n += p.numel();
    for (const auto& a : adapted) base_bytes += a.layer->base_bytes();
    EXPECT_EQ(base_bytes, nn::frozen_base_bytes(*model));
    EXPECT_EQ(n, kShape.layers * plan::lora_block_params<AllTargets::lora>(kShape));
    int64_t planned = 0;
    for (auto lin : kShape.block_linears())
      planned += kShape.layers * plan::quantized_matrix_bytes<AllTargets::weight_quantization>(lin.in, lin.out);
    EXPECT_EQ(base_bytes, planned);
  }
}

// The QLoRA strategy end to end on the toy: NF4 + DoubleQuant bases for all seven linears (adapters on q, v),
// bf16 activations, float adapters; bytes and adapter parameters as the planner counts them.
TEST(LoRA, QLoRAStrategyTrainsInBf16) {
  torch::manual_seed(7);
  Toy model(kShape);
  const nn::LoraSetup setup = nn::prepare_lora<QLoRA>(*model, torch::kCPU);
  const auto& adapted = setup.layers;
  ASSERT_EQ(adapted.size(), 4u);
  EXPECT_EQ(setup.adapter_params, kShape.layers * plan::lora_block_params<QLoRA::lora>(kShape));
  int64_t planned = 0;
  for (auto lin : kShape.block_linears())
    planned += kShape.layers * plan::quantized_matrix_bytes<QLoRA::weight_quantization>(lin.in, lin.out);
  EXPECT_EQ(setup.base_bytes, planned);
  int64_t nf4_linears = 0;
  for (const auto& m : model->modules()) nf4_linears += std::dynamic_pointer_cast<nn::Nf4LinearImpl>(m) != nullptr;
  EXPECT_EQ(nf4_linears, 5 * kShape.layers);
  for (const auto& p : model->parameters()) EXPECT_EQ(p.requires_grad(), p.scalar_type() == torch::kFloat32 && p.dim() == 2);
  for (const auto& a : adapted) {
    EXPECT_TRUE(a.layer->nf4());
    EXPECT_EQ(a.layer->nf4_weight().double_quant, true);
    EXPECT_EQ(a.layer->rank(), 8);
    EXPECT_EQ(a.layer->scaling(), 2.0);
    EXPECT_EQ(a.layer->lora_A.scalar_type(), torch::kFloat32);
  }
  const torch::Tensor x = torch::randn({16, kShape.hidden}).to(torch::kBFloat16);
  const torch::Tensor target = torch::randn({16, kShape.hidden}).to(torch::kBFloat16);
  torch::optim::AdamW opt(setup.parameters, torch::optim::AdamWOptions(1e-2).weight_decay(0));
  double first = 0, last = 0;
  for (int s = 0; s < 60; ++s) {
    opt.zero_grad();
    const torch::Tensor y = model(x);
    ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
    const torch::Tensor loss = F::mse_loss(y.to(torch::kFloat32), target.to(torch::kFloat32));
    loss.backward();
    opt.step();
    (s == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, 0.9 * first) << first << " -> " << last;
  // module.to(dtype) after apply_lora converts neither the packed buffers nor the fp32 adapters
  {
    const torch::Tensor y0 = model(x).detach();
    model->to(torch::kBFloat16);
    EXPECT_EQ(adapted[0].layer->lora_A.scalar_type(), torch::kFloat32);
    EXPECT_EQ(adapted[0].layer->nf4_weight().codes.scalar_type(), torch::kUInt8);
    EXPECT_TRUE(torch::equal(model(x), y0));
  }
  // export: every NF4 / LoRA layer back to a dense Linear, same outputs up to bf16 rounding
  torch::NoGradGuard ng;
  const torch::Tensor y = model(x).to(torch::kFloat32);
  EXPECT_EQ(nn::merge_lora(*model), 4);
  model->to(torch::kFloat32);
  const torch::Tensor ym = model(x.to(torch::kFloat32));
  EXPECT_LE((ym - y).abs().max().item<double>(), 0.05 * y.abs().max().item<double>());
  for (const auto& m : model->modules()) EXPECT_EQ(std::dynamic_pointer_cast<nn::Nf4LinearImpl>(m), nullptr);
}

// squeeze's LLaMA names its projections q, k, v, o, gate, up, down: apply_lora finds q and v in every block.
TEST(LoRA, FindsTheLlamaProjections) {
  nn::LlamaConfig c;
  c.layers = 2;
  nn::Llama model(c);
  const auto adapted = nn::apply_lora<Dense>(*model);
  ASSERT_EQ(adapted.size(), 4u);
  EXPECT_EQ(adapted[0].name, "block0.attn.q");
  EXPECT_EQ(adapted[1].name, "block0.attn.v");
  EXPECT_EQ(adapted[0].layer->out_features(), c.hidden);
  EXPECT_EQ(adapted[1].layer->out_features(), c.kv_heads * c.head_dim());
  // the typed members still point at the old layers, whose weights were released
  EXPECT_EQ(model->blocks[0]->attn->q->weight.numel(), 0);
}

TEST(LoRA, BadInputIsAClearError) {
  torch::nn::Sequential none(torch::nn::Linear(4, 4));
  EXPECT_NE(error_of([&] { nn::apply_lora<Dense>(*none); }).find("no Linear child named like LoRA's targets"), std::string::npos);
  nn::LoRALinear l(torch::randn({8, 16}), torch::Tensor(), nn::LoRAOptions{.rank = 2, .alpha = 4});
  EXPECT_NE(error_of([&] { l(torch::randn({3, 15})); }).find("layer expects 16"), std::string::npos);
  EXPECT_NE(error_of([&] { l(torch::ones({3, 16}, torch::kInt64)); }).find("floating-point"), std::string::npos);
  EXPECT_NE(error_of([&] {
              nn::LoRALinear(torch::randn({8, 16}), torch::Tensor(), nn::LoRAOptions{.rank = 0});
            }).find("rank must be >= 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              nn::LoRALinear(torch::randn({8, 16}), torch::randn({7}), nn::LoRAOptions{});
            }).find("bias must be [8]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { nn::Nf4Weight::quantize(torch::randn({16}), {}); }).find("[out, in]"), std::string::npos);
  EXPECT_NE(error_of([&] { nn::Nf4Weight::quantize(torch::randn({4, 16}), {.block = 48}); }).find("power of two"), std::string::npos);
  torch::Tensor bad = torch::randn({4, 16});
  bad[1][2] = std::nan("");
  EXPECT_NE(error_of([&] { nn::Nf4Weight::quantize(bad, {}); }).find("weight 18 is not finite"), std::string::npos);
}

// QLoRA through make_trainer with Accumulate<2> on the toy; the window's two equal half batches average to the
// full-batch loss, and training reduces the loss.
TEST(LoRA, MakeTrainerQloraAccumulatesAndLearns) {
  using QLoRA2 = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>, Accumulate<2>>;
  torch::manual_seed(8);
  Toy model(kShape);
  auto trainer = make_trainer<QLoRA2>(model, AdamW{.lr = 1e-2f, .weight_decay = 0.0f, .max_grad_norm = 1.0f}, comm::LocalComm::single());
  int64_t adapter_params = 0;
  for (const auto& p : nn::lora_parameters(*model)) adapter_params += p.numel();
  EXPECT_EQ(adapter_params, kShape.layers * plan::lora_block_params<QLoRA2::lora>(kShape));
  const torch::Tensor x = torch::randn({16, kShape.hidden}).to(torch::kBFloat16);
  const torch::Tensor target = torch::randn({16, kShape.hidden});
  const auto micro = [&](int i) { return F::mse_loss(model(x.narrow(0, 8 * i, 8)).to(torch::kFloat32), target.narrow(0, 8 * i, 8)); };
  const auto full = [&] {
    torch::NoGradGuard ng;
    return F::mse_loss(model(x).to(torch::kFloat32), target).item<double>();
  };
  const double before = full();
  const StepResult a = trainer.step([&] { return micro(0); }), b = trainer.step([&] { return micro(1); });
  EXPECT_NEAR(0.5 * (a.loss + b.loss), before, 1e-5 * before);  // equal halves: the mean of the two means is the full mean
  EXPECT_FALSE(a.boundary);
  EXPECT_TRUE(b.applied);
  EXPECT_GT(b.grad_norm, 0);
  for (int s = 0; s < 80; ++s) trainer.step([&] { return micro(s % 2); });
  EXPECT_LT(full(), 0.9 * before);
  EXPECT_THROW(trainer.step([&] { return model(x).to(torch::kFloat32); }), c10::Error);  // not a scalar
}

// QLoRA with the adapters' Adam moments as 8-bit codes (QuantizedState<8>) against fp32 moments, same model
// and data. Tolerances: after the first step the adapters agree to 2^-23 of their largest magnitude, a rounding or
// two (the first update reads the moments before they are encoded); after 30 steps the 8-bit run's change of the
// adapters is within 10% (relative, L2) of the fp32 run's, and its loss within 1% of the starting loss of the fp32 run's.
TEST(LoRA, MakeTrainerQloraWith8BitStateTracksFp32State) {
  using Q32 = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>>;
  using Q8 = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>, QuantizedState<8>>;
  torch::manual_seed(9);
  Toy m32(kShape);
  torch::manual_seed(9);
  Toy m8(kShape);
  const AdamW hyper{.lr = 1e-2f, .weight_decay = 0.01f};
  auto t32 = make_trainer<Q32>(m32, hyper, comm::LocalComm::single());
  auto t8 = make_trainer<Q8>(m8, hyper, comm::LocalComm::single());
  const auto p32 = nn::lora_parameters(*m32), p8 = nn::lora_parameters(*m8);  // views into the trainers' buffers
  torch::manual_seed(21);
  const torch::Tensor x = torch::randn({16, kShape.hidden}).to(torch::kBFloat16);
  const torch::Tensor target = torch::randn({16, kShape.hidden});
  std::vector<torch::Tensor> start;
  for (std::size_t i = 0; i < p8.size(); ++i) {
    // lora_B starts at zero, so its A's first gradient is zero: give B values to move both
    torch::NoGradGuard ng;
    EXPECT_TRUE(torch::equal(p8[i], p32[i])) << "the same adapters at the start";
    if (p8[i].abs().sum().item<float>() == 0) {
      const torch::Tensor b = torch::randn(p8[i].sizes()) * 0.05;
      p8[i].copy_(b), p32[i].copy_(b);
    }
    start.push_back(p8[i].detach().clone());
  }
  const auto loss_of = [&](Toy& m) { return [&] { return F::mse_loss(m(x).to(torch::kFloat32), target); }; };
  const auto full = [&](Toy& m) {
    torch::NoGradGuard ng;
    return F::mse_loss(m(x).to(torch::kFloat32), target).item<double>();
  };
  const double before = full(m8);
  const auto change = [&](const std::vector<torch::Tensor>& ps) {
    std::vector<torch::Tensor> d;
    for (std::size_t i = 0; i < ps.size(); ++i) d.push_back((ps[i].detach() - start[i]).flatten());
    return torch::cat(d);
  };
  t32.step(loss_of(m32));
  t8.step(loss_of(m8));
  {
    const torch::Tensor d32 = change(p32), d8 = change(p8);
    double largest = 0;
    for (const auto& p : p32) largest = std::max(largest, p.detach().abs().max().item<double>());
    EXPECT_LE((d8 - d32).abs().max().item<double>(), std::ldexp(largest, -23)) << "first step";
    EXPECT_GT(d32.abs().max().item<double>(), 1e-3) << "the first step moved the adapters";
  }
  for (int s = 0; s < 29; ++s) t32.step(loss_of(m32)), t8.step(loss_of(m8));
  const torch::Tensor d32 = change(p32), d8 = change(p8);
  EXPECT_LE((d8 - d32).norm().item<double>(), 0.1 * d32.norm().item<double>());
  const double after32 = full(m32), after8 = full(m8);
  EXPECT_LT(after8, 0.9 * before);
  EXPECT_LE(std::abs(after8 - after32), 0.01 * before);
  // state: 2 bytes a value + 8 bytes per 256-value block, over the trainer's partitions (tensors start on a block)
  int64_t values = 0, blocks = 0;
  for (const auto& part : t8.optimizer_state()) values += part[1].numel(), blocks += part[3].numel();
  EXPECT_EQ(t8.memory().optimizer_state.host + t8.memory().optimizer_state.device, 2 * values + 8 * blocks);
  EXPECT_LE(
      values, int64_t(p8.size()) * 256 + [&] {
        int64_t n = 0;
        for (auto& p : p8) n += p.numel();
        return n;
      }());
}

// ---- GPTQ-format bases (nn::QuantizedLinear: GPTQ v1 packed layout, filled by RTN or loaded from a checkpoint) ----
// Tolerances: fp32 as above (1e-5 relative to |x| |W|^T + |b| + s |x| |A|^T |B|^T); bf16 with a non-zero adapter
// 2^-6 (the base output, x A^T, the adapter output and their sum are each rounded to bf16: 4 roundings of
// 2^-8 relative in the worst case; the CPU base product itself runs in float).
namespace {
constexpr plan::ModelShape kOddShape{/*vocab=*/100, /*hidden=*/40, /*layers=*/2, /*heads=*/4, /*kv_heads=*/2, /*ffn=*/72};
using Gptq4 = Strategy<Quantized<4, RTN, Group<32>>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed>;

// Layer-level check of one GPTQ-based LoRALinear against float64: forward and input gradient, fp32 and bf16.
void check_gptq_layer(int bits, int64_t out, int64_t in, int group) {
  const std::string what =
      std::to_string(bits) + " bits [" + std::to_string(out) + ", " + std::to_string(in) + "] group " + std::to_string(group);
  const torch::Tensor w = torch::randn({out, in}) * 0.05;
  const torch::Tensor bias = torch::randn({out}) * 0.1;
  const quant::RtnOptions o{bits, group, false};
  nn::LoRALinear layer(nn::quantize_rtn(w, bias, o), nn::LoRAOptions{.rank = 4, .alpha = 8});
  // the tile copy (fused GEMM layout) where the kernel takes the layer: Kpad * Npad * bits / 8 + 3 bytes per group and padded column
  const bool tiled = bits != 2 && group % 16 == 0;
  EXPECT_EQ(layer->gptq_base()->fused_tiles(), tiled) << what;
  const int64_t Kpad = (in + 63) / 64 * 64, Npad = (out + 15) / 16 * 16, G = group > 0 ? (in + group - 1) / group : 1;
  EXPECT_EQ(layer->base_bytes(), layer->gptq_base()->packed_bytes() + out * 2 + (tiled ? Kpad * Npad * bits / 8 + G * Npad * 3 : 0))
      << what;
  EXPECT_FALSE(nn::quantize_rtn(w, bias, o, /*fused_tiles=*/false)->fused_tiles());
  {
    torch::NoGradGuard ng;
    layer->lora_B.normal_(0, 0.2);  // a non-zero adapter: its term is part of what is checked
  }
  ASSERT_TRUE(layer->gptq());
  // the float64 reference weight, from the torch-free RTN + reference dequantize on the same values
  const torch::Tensor wc = w.contiguous();
  const quant::PackedLinear p = quant::rtn_quantize({wc.data_ptr<float>(), size_t(wc.numel())}, out, in, o);
  const std::vector<float> wd_v = quant::dequantize(p);
  const torch::Tensor wd = torch::from_blob(const_cast<float*>(wd_v.data()), {out, in}, torch::kFloat32).clone();
  EXPECT_TRUE(torch::equal(layer->gptq_base()->dequantize(torch::kFloat32), wd)) << what;
  EXPECT_EQ(layer->gptq_base()->packed_bytes(),
            int64_t(p.qweight.size() + p.qzeros.size() + p.g_idx.size()) * 4 + int64_t(p.scales.size()) * 2)
      << what;
  const torch::Tensor w64 = wd.to(torch::kFloat64), b64 = bias.to(torch::kHalf).to(torch::kFloat64);  // bias stored fp16
  const double s = layer->scaling();
  for (const auto dt : {torch::kFloat32, torch::kBFloat16}) {
    const std::string tag = what + " " + c10::toString(dt);
    const torch::Tensor A64 = layer->lora_A.detach().to(dt).to(torch::kFloat64), B64 = layer->lora_B.detach().to(dt).to(torch::kFloat64);
    const torch::Tensor x = torch::randn({3, 5, in}).to(dt).requires_grad_(true);
    const torch::Tensor y = layer(x);
    ASSERT_EQ(y.scalar_type(), dt) << tag;
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{3, 5, out})) << tag;
    const torch::Tensor x64 = x.detach().to(torch::kFloat64);
    const torch::Tensor ref = torch::matmul(x64, w64.t()) + b64 + torch::matmul(torch::matmul(x64, A64.t()), B64.t()) * s;
    const torch::Tensor mag =
        torch::matmul(x64.abs(), w64.abs().t()) + b64.abs() + torch::matmul(torch::matmul(x64.abs(), A64.abs().t()), B64.abs().t()) * s;
    const double rel = dt == torch::kFloat32 ? 1e-5 : std::ldexp(1.0, -6);
    expect_close(y, ref, mag, rel, 1e-6, "forward " + tag);
    // dL/dx = g (W + s B A): the base part re-dequantizes W in backward
    const torch::Tensor g = torch::randn(y.sizes()).to(dt);
    y.backward(g);
    const torch::Tensor g64 = g.to(torch::kFloat64);
    const torch::Tensor dx_ref = torch::matmul(g64, w64) + torch::matmul(torch::matmul(g64, B64), A64) * s;
    const torch::Tensor dx_mag = torch::matmul(g64.abs(), w64.abs()) + torch::matmul(torch::matmul(g64.abs(), B64.abs()), A64.abs()) * s;
    ASSERT_TRUE(x.grad().defined()) << tag;
    expect_close(x.grad(), dx_ref, dx_mag, rel, 1e-6, "dx " + tag);
    // the frozen base gets no gradient: it is buffers only
    for (const auto& b : layer->named_buffers()) EXPECT_FALSE(b.value().requires_grad()) << b.key();
    EXPECT_TRUE(layer->lora_A.grad().defined() && layer->lora_B.grad().defined()) << tag;
    layer->zero_grad();
  }
}
}  // namespace

TEST(LoRA, GptqBaseEqualsDequantizedWeightPlusAdapter) {
  torch::manual_seed(11);
  // group 32 over in-features that are not a multiple of 32 (a partial last group), per channel, odd shapes
  for (const int bits : {4, 3, 8, 2}) {
    check_gptq_layer(bits, 48, 100, 32);
    check_gptq_layer(bits, 37, 33, 32);
    check_gptq_layer(bits, 20, 70, 0);
  }
  check_gptq_layer(4, 64, 256, 128);
}

// The GPTQ-format strategy end to end on a toy with odd widths (40, 72: partial groups of 32): all seven linears
// 4-bit (adapters on q, v), bf16 activations, fp32 adapters. The packed base is what the planner counts, stays
// bit-identical through AdamW steps, gets no gradient; the adapters move and the loss falls.
TEST(LoRA, GptqStrategyTrainsAdaptersOnFrozenPackedBase) {
  torch::manual_seed(12);
  Toy model(kOddShape);
  const nn::LoraSetup setup = nn::prepare_lora<Gptq4>(*model, torch::kCPU);
  const auto& adapted = setup.layers;
  ASSERT_EQ(adapted.size(), 4u);
  EXPECT_EQ(setup.adapter_params, kOddShape.layers * plan::lora_block_params<Gptq4::lora>(kOddShape));
  int64_t packed = 0, resident = 0, linears = 0;
  for (const auto& m : model->modules())
    if (auto q = std::dynamic_pointer_cast<nn::QuantizedLinearImpl>(m)) {
      packed += q->packed_bytes();
      resident += q->bytes();
      ++linears;
      EXPECT_EQ(q->bits(), 4);
      EXPECT_EQ(q->group_size(), 32);
    }
  EXPECT_EQ(linears, 7 * kOddShape.layers);  // 5 frozen + 2 under adapters, per block
  int64_t planned = 0;
  for (auto lin : kOddShape.block_linears())
    planned += kOddShape.layers * plan::quantized_matrix_bytes<Gptq4::weight_quantization>(lin.in, lin.out);
  EXPECT_EQ(packed, planned);  // the GPTQ layout is exactly what the planner counts
  EXPECT_EQ(setup.base_bytes, resident);
  EXPECT_EQ(resident, planned);  // training: no tensor-core tile copy is kept (QuantizedLinearImpl's fused_tiles)
  for (const auto& a : adapted) {
    EXPECT_TRUE(a.layer->gptq());
    EXPECT_EQ(a.layer->rank(), 8);
    EXPECT_EQ(a.layer->lora_A.scalar_type(), torch::kFloat32);
  }
  for (const auto& p : model->parameters()) EXPECT_EQ(p.requires_grad(), p.scalar_type() == torch::kFloat32 && p.dim() == 2);

  std::vector<std::pair<std::string, torch::Tensor>> before;  // every packed buffer, and the adapters
  for (const auto& b : model->named_buffers()) before.emplace_back(b.key(), b.value().clone());
  std::vector<torch::Tensor> adapters0;
  for (const auto& p : setup.parameters) adapters0.push_back(p.detach().clone());

  const torch::Tensor x = torch::randn({16, kOddShape.hidden}).to(torch::kBFloat16);
  const torch::Tensor target = torch::randn({16, kOddShape.hidden});
  torch::optim::AdamW opt(setup.parameters, torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  double first = 0, last = 0;
  for (int s = 0; s < 40; ++s) {
    opt.zero_grad();
    const torch::Tensor y = model(x);
    ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
    const torch::Tensor loss = F::mse_loss(y.to(torch::kFloat32), target);
    loss.backward();
    for (const auto& b : model->named_buffers()) ASSERT_FALSE(b.value().grad().defined()) << b.key();
    opt.step();
    (s == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, 0.9 * first) << first << " -> " << last;
  const auto after = model->named_buffers();
  ASSERT_EQ(after.size(), before.size());
  for (const auto& [name, t] : before) EXPECT_TRUE(torch::equal(after[name], t)) << name << " changed";
  for (size_t i = 0; i < adapters0.size(); ++i)
    EXPECT_FALSE(torch::equal(setup.parameters[i].detach(), adapters0[i])) << "adapter " << i << " did not move";

  // module.to(dtype) converts neither the packed buffers nor the fp32 adapters
  {
    torch::NoGradGuard ng;
    const torch::Tensor y0 = model(x);
    model->to(torch::kBFloat16);
    EXPECT_EQ(adapted[0].layer->lora_A.scalar_type(), torch::kFloat32);
    for (const auto& [name, t] : before) EXPECT_EQ(after[name].scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(torch::equal(model(x), y0));
  }
  // export: every GPTQ / LoRA layer back to a dense Linear, same outputs up to bf16 rounding
  torch::NoGradGuard ng;
  const torch::Tensor y = model(x).to(torch::kFloat32);
  EXPECT_EQ(nn::merge_lora(*model), 4);
  for (const auto& m : model->modules()) EXPECT_EQ(std::dynamic_pointer_cast<nn::QuantizedLinearImpl>(m), nullptr);
  model->to(torch::kFloat32);
  const torch::Tensor ym = model(x.to(torch::kFloat32));
  EXPECT_LE((ym - y).abs().max().item<double>(), 0.05 * y.abs().max().item<double>());
}

// apply_lora at 3 and 8 bits (and per channel): at init the adapted model computes what the dense model does with
// every block linear replaced by its RTN-dequantized weight (fp32).
TEST(LoRA, GptqThreeAndEightBitBasesMatchDequantizedModel) {
  const auto check = [](auto strategy, int bits, int group) {
    using S = decltype(strategy);
    torch::manual_seed(13);
    Toy model(kOddShape), ref(kOddShape);
    {
      torch::NoGradGuard ng;
      const auto src = model->named_parameters();
      for (auto& p : ref->named_parameters()) {
        torch::Tensor v = src[p.key()].clone();
        if (v.dim() == 2) {  // a block linear: its RTN-dequantized weight
          const torch::Tensor vc = v.contiguous();
          const auto d = quant::dequantize(
              quant::rtn_quantize({vc.data_ptr<float>(), size_t(vc.numel())}, v.size(0), v.size(1), {bits, group, false}));
          v = torch::from_blob(const_cast<float*>(d.data()), v.sizes(), torch::kFloat32).clone();
        }
        p.value().copy_(v);
      }
    }
    nn::apply_lora<S>(*model);
    const torch::Tensor x = torch::randn({9, kOddShape.hidden});
    torch::NoGradGuard ng;
    const torch::Tensor y = model(x), yr = ref(x);
    EXPECT_LE((y - yr).abs().max().item<double>(), 1e-5 * (1 + yr.abs().max().item<double>())) << bits << " bits, group " << group;
    int64_t q = 0;
    for (const auto& m : model->modules())
      if (auto l = std::dynamic_pointer_cast<nn::QuantizedLinearImpl>(m)) q += l->bits() == bits;
    EXPECT_EQ(q, 7 * kOddShape.layers);
  };
  check(Strategy<Quantized<3, GPTQ, Group<32>>, LoRA<4, 8>>{}, 3, 32);
  check(Strategy<Quantized<8, GPTQ, PerChannel>, LoRA<4, 8>>{}, 8, 0);
  check(Strategy<Quantized<4, RTN, Group<16>>, LoRA<4, 8>>{}, 4, 16);
}

// A real GPTQ checkpoint layer (act-order g_idx, not RTN values) attached through apply_lora: the QuantizedLinear
// already in the model is adopted, not repacked, and the adapter trains on it.
TEST(LoRA, AttachesAdaptersToAPackedCheckpointLayer) {
  torch::manual_seed(14);
  const int64_t out = 24, in = 64, group = 16;
  std::vector<uint8_t> codes(out * in), zeros(4 * out);
  std::vector<float> scales(4 * out);
  for (auto& c : codes) c = uint8_t(torch::randint(0, 16, {1}).item<int>());
  for (auto& z : zeros) z = uint8_t(torch::randint(1, 16, {1}).item<int>());
  for (auto& s : scales) s = 0.01f + 0.02f * torch::rand({1}).item<float>();
  std::vector<int32_t> g_idx(in);
  const torch::Tensor perm = torch::randperm(in);
  for (int64_t i = 0; i < in; ++i) g_idx[perm[i].item<int64_t>()] = int32_t(i / group);  // act-order: groups scattered
  const quant::PackedLinear p = quant::pack(codes, zeros, scales, g_idx, out, in, 4, group);
  nn::QuantizedLinear loaded(p);
  struct Holder : torch::nn::Module {
    explicit Holder(nn::QuantizedLinear q) { register_module("q_proj", q); }
  };
  auto holder = std::make_shared<Holder>(loaded);
  const auto adapted = nn::apply_lora<Strategy<LoRA<4, 8>>>(*holder);
  ASSERT_EQ(adapted.size(), 1u);
  ASSERT_TRUE(adapted[0].layer->gptq());
  EXPECT_EQ(adapted[0].layer->gptq_base().ptr(), loaded.ptr());  // the same layer, not a copy
  const std::vector<float> wd_v = quant::dequantize(p);
  const torch::Tensor w = torch::from_blob(const_cast<float*>(wd_v.data()), {out, in}, torch::kFloat32).clone();
  nn::LoRALinear layer = adapted[0].layer;
  const auto [first, last] = fit(layer, w, 150);
  EXPECT_LT(last, 0.02 * first) << first << " -> " << last;
  const torch::Tensor x = torch::randn({5, in});
  torch::NoGradGuard ng;
  EXPECT_TRUE(torch::allclose(nn::forward_linear(*holder, "q_proj", x), torch::matmul(x, layer->merged_weight().t()), 1e-4, 1e-5));
}

TEST(LoRA, GptqBadInputIsAClearError) {
  EXPECT_NE(error_of([&] { nn::LoRALinear(nn::QuantizedLinear(nullptr), nn::LoRAOptions{}); }).find("base is empty"), std::string::npos);
  EXPECT_NE(error_of([&] { nn::quantize_rtn(torch::randn({16}), torch::Tensor(), {}); }).find("[out, in]"), std::string::npos);
  EXPECT_NE(error_of([&] { nn::quantize_rtn(torch::randn({4, 16}), torch::randn({3}), {}); }).find("bias must be [4]"), std::string::npos);
  EXPECT_NE(error_of([&] {
              nn::quantize_rtn(torch::randn({4, 16}), torch::Tensor(), {.bits = 5});
            }).find("2, 3, 4 or 8 bits"),
            std::string::npos);
  torch::Tensor bad = torch::randn({4, 16});
  bad[1][2] = std::nan("");
  EXPECT_NE(error_of([&] { nn::quantize_rtn(bad, torch::Tensor(), {}); }).find("not finite"), std::string::npos);
  quant::PackedLinear p = quant::rtn_quantize(std::vector<float>(8 * 40, 0.5f), 8, 40, {4, 32, false});
  p.qzeros.pop_back();
  EXPECT_NE(error_of([&] { nn::QuantizedLinear{p}; }).find("qzeros has"), std::string::npos);
  nn::LoRALinear l(nn::quantize_rtn(torch::randn({8, 40}), torch::Tensor(), {4, 32, false}), nn::LoRAOptions{.rank = 2, .alpha = 4});
  EXPECT_NE(error_of([&] { l(torch::randn({3, 39})); }).find("layer expects 40"), std::string::npos);
  EXPECT_NE(error_of([&] { l(torch::ones({3, 40}, torch::kInt64)); }).find("floating-point"), std::string::npos);
  EXPECT_NE(error_of([&] {
              nn::LoRALinear(nn::quantize_rtn(torch::randn({8, 40}), torch::Tensor(), {}), nn::LoRAOptions{.rank = 0});
            }).find("rank must be >= 1"),
            std::string::npos);
}

// squeeze's LLaMA under the GPTQ-format strategy: every block linear packed (planner bytes), the loss trains the
// adapters only (the base linears pass input gradients through their dequantized weights).
TEST(LoRA, GptqStrategyOnTheLlama) {
  torch::manual_seed(15);
  nn::LlamaConfig c;
  c.layers = 2;
  nn::Llama model(c);
  const nn::LoraSetup setup = nn::prepare_lora<Gptq4>(*model, torch::kCPU);
  ASSERT_EQ(setup.layers.size(), 4u);
  EXPECT_EQ(setup.layers[0].name, "block0.attn.q");
  int64_t planned = 0;
  for (auto lin : c.shape().block_linears())
    planned += c.layers * plan::quantized_matrix_bytes<Gptq4::weight_quantization>(lin.in, lin.out);
  EXPECT_EQ(setup.base_bytes, planned);
  const torch::Tensor ids = torch::randint(0, c.vocab, {2, 24}), targets = torch::randint(0, c.vocab, {2, 24});
  torch::optim::AdamW opt(setup.parameters, torch::optim::AdamWOptions(1e-2).weight_decay(0));
  double first = 0, last = 0;
  for (int s = 0; s < 15; ++s) {
    opt.zero_grad();
    const torch::Tensor loss = model->loss(ids, targets);
    loss.backward();
    for (const auto& p : setup.parameters) ASSERT_TRUE(p.grad().defined());
    opt.step();
    (s == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first) << first << " -> " << last;
}
