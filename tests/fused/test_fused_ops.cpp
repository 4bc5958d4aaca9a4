// The fused LLaMA ops on the CPU (the CPU twins of kernels/rms_norm, rope, swiglu, through nn/fused_ops.hpp):
//   * against float64 torch references of the same (rounded) inputs, on odd sizes (rows 13, hidden 97) in every dtype;
//   * backward against float64 autograd of the unfused reference, and against float64 finite differences of the
//     float64 twins (central differences, step 1e-6);
//   * the torch-ops path (what CUDA tensors take in a host TU) against the twins;
//   * nn::Llama with fused_kernels against the unfused model: logits and every parameter's gradient;
//   * bad shapes, dtypes, layouts and devices rejected with messages that say what to pass.
// Tolerances, rel = max |got - ref| / max |ref|: float64 1e-12 (finite differences 1e-7); float32 1e-5 (fp32 math,
// one fp32 rounding); float16 1e-3 and bfloat16 8e-3 (one rounding of the output: unit roundoff 2^-11, 2^-8).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include <squeeze/nn/fused_ops.hpp>
#include <squeeze/nn/llama.hpp>

namespace {

namespace nn = squeeze::nn;
namespace kernels = squeeze::kernels;

double rel(const torch::Tensor& got, const torch::Tensor& ref) {
  const torch::Tensor r = ref.to(torch::kFloat64);
  return (got.to(torch::kFloat64) - r).abs().max().item<double>() / std::max(r.abs().max().item<double>(), 1e-300);
}

struct DtypeTol {
  torch::ScalarType dt;
  double tol;
};
const std::vector<DtypeTol> kDtypes = {
    {torch::kFloat64, 1e-12}, {torch::kFloat32, 1e-5}, {torch::kFloat16, 1e-3}, {torch::kBFloat16, 8e-3}};
std::string name(torch::ScalarType dt) { return c10::toString(dt); }

torch::Tensor randn(std::vector<int64_t> shape, torch::ScalarType dt, double scale = 1.0) {
  return (torch::randn(shape, torch::kFloat64) * scale).to(dt);
}

// float64 references.
torch::Tensor rms_ref(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return x * torch::rsqrt(x.pow(2).mean(-1, true) + eps) * w;
}
torch::Tensor rope_ref(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {  // x [B, T, H, D]
  return nn::apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2);
}

// Central finite differences of L = sum(f(inputs) * R) in float64 against autograd's gradients of every input.
using Fn = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;
void expect_finite_differences(const Fn& f, std::vector<torch::Tensor> inputs, const std::string& what, double tol = 1e-7) {
  for (auto& t : inputs) t = t.to(torch::kFloat64).detach().clone().requires_grad_(true);
  const torch::Tensor out = f(inputs);
  const torch::Tensor R = torch::randn(out.sizes(), torch::kFloat64);
  (out * R).sum().backward();
  torch::NoGradGuard no_grad;
  const double step = 1e-6;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    std::vector<torch::Tensor> probe;
    for (const auto& t : inputs) probe.push_back(t.detach().clone());
    torch::Tensor flat = probe[k].view({-1});
    torch::Tensor fd = torch::empty({flat.numel()}, torch::kFloat64);
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const double x0 = flat[i].item<double>();
      flat[i] = x0 + step;
      const double lp = (f(probe) * R).sum().item<double>();
      flat[i] = x0 - step;
      const double lm = (f(probe) * R).sum().item<double>();
      flat[i] = x0;
      fd[i] = (lp - lm) / (2 * step);
    }
    EXPECT_LT(rel(inputs[k].grad().reshape({-1}), fd), tol) << what << ": input " << k;
  }
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}
#define EXPECT_ERROR(stmt, text)                                          \
  do {                                                                    \
    const std::string msg_ = error_of([&] { (void)(stmt); });             \
    EXPECT_NE(msg_.find(text), std::string::npos) << "message: " << msg_; \
  } while (0)

constexpr int64_t kRows = 13, kHidden = 97;
constexpr double kEps = 1e-5;

// ---- RMSNorm ------------------------------------------------------------------------------------------
TEST(FusedRmsNorm, ForwardMatchesFloat64InEveryDtype) {
  for (const auto& [dt, tol] : kDtypes)
    for (const int64_t h : {kHidden, int64_t(96), int64_t(1)}) {
      torch::manual_seed(1);
      const torch::Tensor x = randn({kRows, h}, dt, 3.0), w = randn({h}, dt);
      const torch::Tensor y = nn::fused_rms_norm(x, w, kEps);
      EXPECT_EQ(y.scalar_type(), dt);
      EXPECT_LT(rel(y, rms_ref(x.to(torch::kFloat64), w.to(torch::kFloat64), kEps)), tol) << name(dt) << " h " << h;
    }
  // leading dims are rows: [2, 3, 5, h]
  const torch::Tensor x = torch::randn({2, 3, 5, kHidden}), w = torch::randn({kHidden});
  EXPECT_LT(rel(nn::fused_rms_norm(x, w, kEps), rms_ref(x.to(torch::kFloat64), w.to(torch::kFloat64), kEps)), 1e-5);
}

TEST(FusedRmsNorm, BackwardMatchesFloat64AutogradInEveryDtype) {
  for (const auto& [dt, tol] : kDtypes) {
    torch::manual_seed(2);
    const torch::Tensor x0 = randn({kRows, kHidden}, dt, 2.0), w0 = randn({kHidden}, dt), dy = randn({kRows, kHidden}, dt);
    const torch::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    nn::fused_rms_norm(x, w, kEps).backward(dy);
    const torch::Tensor xr = x0.to(torch::kFloat64).requires_grad_(true), wr = w0.to(torch::kFloat64).requires_grad_(true);
    rms_ref(xr, wr, kEps).backward(dy.to(torch::kFloat64));
    EXPECT_EQ(x.grad().scalar_type(), dt);
    EXPECT_EQ(w.grad().scalar_type(), dt);
    EXPECT_LT(rel(x.grad(), xr.grad()), tol) << name(dt) << " dx";
    EXPECT_LT(rel(w.grad(), wr.grad()), tol) << name(dt) << " dweight";
  }
}

TEST(FusedRmsNorm, BackwardMatchesFiniteDifferences) {
  torch::manual_seed(3);
  expect_finite_differences([](const std::vector<torch::Tensor>& in) { return nn::fused_rms_norm(in[0], in[1], kEps); },
                            {torch::randn({kRows, kHidden}), torch::randn({kHidden})}, "rms_norm");
}

TEST(FusedRmsNorm, FrozenWeightGetsNoGradient) {
  const torch::Tensor x = torch::randn({kRows, kHidden}).requires_grad_(true), w = torch::randn({kHidden});
  nn::fused_rms_norm(x, w, kEps).sum().backward();
  EXPECT_TRUE(x.grad().defined());
  EXPECT_FALSE(w.grad().defined());
}

TEST(FusedAddRmsNorm, MatchesFloat64ForwardAndBackwardInEveryDtype) {
  for (const auto& [dt, tol] : kDtypes) {
    torch::manual_seed(4);
    const torch::Tensor x0 = randn({kRows, kHidden}, dt), r0 = randn({kRows, kHidden}, dt), w0 = randn({kHidden}, dt);
    const torch::Tensor ds = randn({kRows, kHidden}, dt), dy = randn({kRows, kHidden}, dt);
    const torch::Tensor x = x0.clone().requires_grad_(true), r = r0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    const auto [s, y] = nn::fused_add_rms_norm(x, r, w, kEps);
    const auto f64 = [](const torch::Tensor& t) { return t.to(torch::kFloat64); };
    EXPECT_LT(rel(s, f64(x0) + f64(r0)), tol) << name(dt) << " sum";
    EXPECT_LT(rel(y, rms_ref(f64(x0 + r0), f64(w0), kEps)), tol) << name(dt) << " y";  // the norm of the stored (rounded) sum
    torch::autograd::backward({s, y}, {ds, dy});
    const torch::Tensor xr = f64(x0).requires_grad_(true), rr = f64(r0).requires_grad_(true), wr = f64(w0).requires_grad_(true);
    const torch::Tensor sr = xr + rr;
    torch::autograd::backward({sr, rms_ref(sr, wr, kEps)}, {f64(ds), f64(dy)});
    // the sum is rounded to dt before it is normalised: its rounding shows in the gradients at 2 ulp of dt
    const double gtol = dt == torch::kFloat64 ? tol : 2 * tol;
    EXPECT_LT(rel(x.grad(), xr.grad()), gtol) << name(dt) << " dx";
    EXPECT_LT(rel(r.grad(), rr.grad()), gtol) << name(dt) << " dresidual";
    EXPECT_LT(rel(w.grad(), wr.grad()), gtol) << name(dt) << " dweight";
  }
}

TEST(FusedAddRmsNorm, BackwardMatchesFiniteDifferences) {
  torch::manual_seed(5);
  expect_finite_differences(
      [](const std::vector<torch::Tensor>& in) {
        const auto [s, y] = nn::fused_add_rms_norm(in[0], in[1], in[2], kEps);
        return torch::cat({s, y * 1.5}, 0);  // both outputs reach the loss
      },
      {torch::randn({kRows, kHidden}), torch::randn({kRows, kHidden}), torch::randn({kHidden})}, "add_rms_norm");
}

// ---- RoPE ---------------------------------------------------------------------------------------------
TEST(FusedRope, InPlaceMatchesFloat64ApplyRopeInEveryDtype) {
  const int64_t B = 2, T = 13, H = 3, D = 18;
  const auto [cos, sin] = nn::rope_tables(T, D, 10000.0, torch::kCPU);  // [T, D] fp32
  for (const auto& [dt, tol] : kDtypes) {
    torch::manual_seed(6);
    const torch::Tensor x0 = randn({B, T, H, D}, dt);
    const torch::Tensor ref = rope_ref(x0.to(torch::kFloat64), cos.to(torch::kFloat64), sin.to(torch::kFloat64));
    torch::Tensor x = x0.clone();
    const torch::Tensor out = nn::fused_rope_(x, cos, sin);
    EXPECT_TRUE(out.is_same(x)) << "in place";
    EXPECT_LT(rel(x, ref), tol) << name(dt) << " [B, T, H, D]";
    torch::Tensor flat = x0.clone().view({B, T, H * D});  // the projection's layout, half tables
    nn::fused_rope_(flat, cos.narrow(1, 0, D / 2).contiguous(), sin.narrow(1, 0, D / 2).contiguous(), D);
    EXPECT_LT(rel(flat.view({B, T, H, D}), ref), tol) << name(dt) << " [B, T, H * D]";
    const torch::Tensor before = x0.clone();
    const torch::Tensor copy = nn::fused_rope(x0, cos, sin);  // out of place: same values, x0 untouched
    EXPECT_TRUE(torch::equal(copy, x)) << name(dt);
    EXPECT_TRUE(torch::equal(x0, before)) << name(dt);
  }
  EXPECT_FALSE(nn::can_modify_in_place(torch::randn({2}).requires_grad_(true)));
  EXPECT_TRUE(nn::can_modify_in_place(torch::randn({2}).requires_grad_(true) * 2));
}

TEST(FusedRope, BackwardIsTheInverseRotation) {
  const int64_t B = 2, T = 13, H = 3, D = 18;
  const auto [cos, sin] = nn::rope_tables(T, D, 500.0, torch::kCPU);
  for (const auto& [dt, tol] : kDtypes) {
    torch::manual_seed(7);
    const torch::Tensor x0 = randn({B, T, H, D}, dt), dy = randn({B, T, H, D}, dt);
    const torch::Tensor leaf = x0.clone().requires_grad_(true);
    nn::fused_rope_(leaf * 1, cos, sin).backward(dy);  // leaf * 1: in place on a non-leaf
    const torch::Tensor xr = x0.to(torch::kFloat64).requires_grad_(true);
    rope_ref(xr, cos.to(torch::kFloat64), sin.to(torch::kFloat64)).backward(dy.to(torch::kFloat64));
    EXPECT_LT(rel(leaf.grad(), xr.grad()), tol) << name(dt);
  }
  torch::manual_seed(8);
  expect_finite_differences([&](const std::vector<torch::Tensor>& in) { return nn::fused_rope_(in[0].clone(), cos, sin); },
                            {torch::randn({B, T, H, D})}, "rope");
}

// ---- SwiGLU -------------------------------------------------------------------------------------------
TEST(FusedSwiglu, MatchesFloat64ForwardAndBackwardInEveryDtype) {
  for (const auto& [dt, tol] : kDtypes) {
    torch::manual_seed(9);
    const torch::Tensor g0 = randn({kRows, kHidden}, dt, 3.0), u0 = randn({kRows, kHidden}, dt), dh = randn({kRows, kHidden}, dt);
    const torch::Tensor g = g0.clone().requires_grad_(true), u = u0.clone().requires_grad_(true);
    const torch::Tensor h = nn::fused_swiglu(g, u);
    const torch::Tensor gr = g0.to(torch::kFloat64).requires_grad_(true), ur = u0.to(torch::kFloat64).requires_grad_(true);
    const torch::Tensor hr = torch::silu(gr) * ur;
    EXPECT_LT(rel(h, hr), tol) << name(dt) << " h";
    h.backward(dh);
    hr.backward(dh.to(torch::kFloat64));
    EXPECT_LT(rel(g.grad(), gr.grad()), tol) << name(dt) << " dg";
    EXPECT_LT(rel(u.grad(), ur.grad()), tol) << name(dt) << " du";
  }
  torch::manual_seed(10);
  expect_finite_differences([](const std::vector<torch::Tensor>& in) { return nn::fused_swiglu(in[0], in[1]); },
                            {torch::randn({kRows, kHidden}) * 3, torch::randn({kRows, kHidden})}, "swiglu");
}

// ---- the torch-ops path (CUDA tensors in host TUs) against the CPU twins --------------------------------
TEST(FusedOps, TorchOpsPathMatchesTheCpuTwins) {
  const int64_t B = 2, T = 13, H = 3, D = 18;
  const auto [cos, sin] = nn::rope_tables(T, D, 10000.0, torch::kCPU);
  for (const auto& [dt, tol] : kDtypes) {
    torch::manual_seed(11);
    const torch::Tensor x0 = randn({B, T, H * D}, dt), r0 = randn({B, T, H * D}, dt), w0 = randn({H * D}, dt);
    const auto run = [&] {
      const torch::Tensor x = x0.clone().requires_grad_(true), r = r0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
      const auto [s, y] = nn::fused_add_rms_norm(x, r, w, kEps);
      const torch::Tensor z = nn::fused_rms_norm(nn::fused_swiglu(nn::fused_rope_(y * 1, cos, sin, D), s), w, kEps);
      (z * z).sum().backward();
      return std::vector<torch::Tensor>{z.detach(), x.grad(), r.grad(), w.grad()};
    };
    const auto twin = run();
    std::vector<torch::Tensor> ops;
    {
      const nn::ForceTorchOps torch_ops;
      ops = run();
    }
    for (std::size_t i = 0; i < twin.size(); ++i) EXPECT_LT(rel(ops[i], twin[i]), 4 * tol) << name(dt) << " output " << i;
  }
}

// ---- nn::Llama fused against unfused ------------------------------------------------------------------
squeeze::nn::LlamaConfig small_llama(bool fused) {
  squeeze::nn::LlamaConfig c;
  c.vocab = 61, c.hidden = 60, c.layers = 2, c.heads = 3, c.kv_heads = 1, c.ffn = 97;
  c.fused_kernels = fused;
  return c;
}

struct LlamaRun {
  torch::Tensor logits;
  std::vector<std::pair<std::string, torch::Tensor>> grads;
};
LlamaRun run_llama(bool fused, torch::ScalarType dt, int checkpoint_every) {
  torch::manual_seed(12);
  nn::Llama model(small_llama(fused));  // same seed: same weights fused or not
  model->to(dt);
  model->set_recompute(checkpoint_every);
  const torch::Tensor ids = torch::randint(61, {2, 13}, torch::kLong), targets = torch::randint(61, {2, 13}, torch::kLong);
  const torch::Tensor logits = model->forward(ids);
  torch::nn::functional::cross_entropy(logits.flatten(0, 1).to(dt == torch::kFloat64 ? dt : torch::kFloat32), targets.flatten()).backward();
  LlamaRun r{logits.detach(), {}};
  for (const auto& p : model->named_parameters()) r.grads.emplace_back(p.key(), p.value().grad());
  return r;
}

TEST(FusedLlama, FusedMatchesUnfusedLogitsAndGradients) {
  EXPECT_TRUE(squeeze::nn::LlamaConfig{}.fused_kernels) << "fused kernels are the default";
  // two layers, one model: errors of the two paths' roundings add up over the layers and the head. float64: the unfused
  // RMSNorm computes its statistics in float32 whatever the model's dtype (the fused one in float64), hence 1e-6.
  for (const auto& [dt, tol] :
       std::vector<DtypeTol>{{torch::kFloat64, 1e-6}, {torch::kFloat32, 2e-6}, {torch::kBFloat16, 1.5e-2}, {torch::kFloat16, 2e-3}}) {
    const LlamaRun ref = run_llama(false, dt, 0), got = run_llama(true, dt, 0);
    EXPECT_LT(rel(got.logits, ref.logits), tol) << name(dt) << " logits";
    ASSERT_EQ(got.grads.size(), ref.grads.size());
    double worst = 0;
    std::string worst_name;
    for (std::size_t i = 0; i < ref.grads.size(); ++i) {
      ASSERT_EQ(got.grads[i].first, ref.grads[i].first);
      ASSERT_TRUE(got.grads[i].second.defined()) << got.grads[i].first;
      const double e = rel(got.grads[i].second, ref.grads[i].second);
      if (e > worst) worst = e, worst_name = ref.grads[i].first;
    }
    EXPECT_LT(worst, 4 * tol) << name(dt) << " worst gradient: " << worst_name;
    std::printf("%s: logits rel %.3g, worst gradient rel %.3g (%s)\n", name(dt).c_str(), rel(got.logits, ref.logits), worst,
                worst_name.c_str());
  }
}

TEST(FusedLlama, CheckpointedFusedMatchesUnfused) {  // the fused ops (in-place RoPE too) under recomputation
  const LlamaRun ref = run_llama(false, torch::kFloat32, 0);
  const LlamaRun got = [] {
    torch::manual_seed(12);
    nn::Llama model(small_llama(true));
    model->train();
    model->set_recompute(1);
    const torch::Tensor ids = torch::randint(61, {2, 13}, torch::kLong), targets = torch::randint(61, {2, 13}, torch::kLong);
    const torch::Tensor logits = model->forward(ids);
    torch::nn::functional::cross_entropy(logits.flatten(0, 1), targets.flatten()).backward();
    LlamaRun r{logits.detach(), {}};
    for (const auto& p : model->named_parameters()) r.grads.emplace_back(p.key(), p.value().grad());
    return r;
  }();
  EXPECT_LT(rel(got.logits, ref.logits), 2e-5);
  for (std::size_t i = 0; i < ref.grads.size(); ++i) EXPECT_LT(rel(got.grads[i].second, ref.grads[i].second), 1e-4) << ref.grads[i].first;
}

// ---- bad input ----------------------------------------------------------------------------------------
TEST(FusedOps, RejectsBadInputWithClearMessages) {
  const torch::Tensor x = torch::randn({kRows, kHidden}), w = torch::randn({kHidden});
  EXPECT_ERROR(nn::fused_rms_norm(x.to(torch::kInt), w), "pass float32, bfloat16 or float16");
  EXPECT_ERROR(nn::fused_rms_norm(x, w.to(torch::kBFloat16)), "convert it with .to(x.scalar_type())");
  EXPECT_ERROR(nn::fused_rms_norm(x, torch::randn({kHidden + 1})), "weight must be [hidden] = [97]");
  EXPECT_ERROR(nn::fused_rms_norm(torch::randn({kHidden, kRows}).t(), w), "pass x.contiguous()");
  EXPECT_ERROR(nn::fused_rms_norm(x, w, -1.0), "eps must be >= 0");
  EXPECT_ERROR(nn::fused_rms_norm(x, torch::empty({kHidden}, torch::TensorOptions().device(torch::kMeta))), "move it with .to(x.device())");
  EXPECT_ERROR(nn::fused_add_rms_norm(x, torch::randn({kRows, kHidden - 1}), w), "must have x's shape");
  EXPECT_ERROR(nn::fused_swiglu(x, torch::randn({kRows, 3})), "must have one shape");
  EXPECT_ERROR(nn::fused_swiglu(x, x.to(torch::kHalf)), "convert it with .to(g.scalar_type())");
  const auto [cos, sin] = nn::rope_tables(13, 18, 10000.0, torch::kCPU);
  EXPECT_ERROR(nn::fused_rope_(torch::randn({2, 13, 54}), cos, sin), "pass head_dim for a [B, T, H * D] x");
  EXPECT_ERROR(nn::fused_rope_(torch::randn({2, 13, 3, 17}), cos, sin), "head_dim must be positive and even");
  EXPECT_ERROR(nn::fused_rope_(torch::randn({2, 14, 3, 18}), cos, sin), "cos / sin must be [>= 14");
  EXPECT_ERROR(nn::fused_rope_(torch::randn({13, 54}), cos, sin, 18), "x must be [B, T, H, D]");
  EXPECT_ERROR(nn::fused_rope_(torch::randn({2, 13, 3, 18}).requires_grad_(true), cos, sin), "leaf");
  // the kernel layer's own checks (squeeze::Error)
  float buf[4] = {};
  EXPECT_ERROR(kernels::rope_cpu(kernels::RopeArgs<float>{buf, nullptr, buf, buf, 1, 1, 1, 3, 2}), "head_dim must be even");
  EXPECT_ERROR(kernels::rms_norm_forward_cpu(kernels::RmsNormForward<float>{buf, buf, buf, buf, nullptr, nullptr, 1, 4}),
               "a residual needs the sum output");
  EXPECT_THROW(kernels::swiglu_forward_cpu(kernels::SwigluArgs<float>{nullptr, buf, buf, nullptr, nullptr, nullptr, 4}), squeeze::Error);
}

}  // namespace
