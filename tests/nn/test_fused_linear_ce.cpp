// fused_linear_cross_entropy against float64 autograd of linear + cross_entropy, on sizes no chunk divides and
// with ignored targets; float64 finite differences; nn::Llama with fused_loss against its chunked loss.
// Tolerances, rel = max |got - ref| / max |ref|: float64 1e-12; float32 2e-5 (fp32 logits and GEMMs); bf16 3e-2
// for the loss and 4e-2 for the gradients against the float64 reference of the same bf16-rounded inputs (the
// logits and dlogits are rounded to bf16 before their GEMMs: unit roundoff 2^-9, summed over V and N).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include <squeeze/nn/fused_linear_cross_entropy.hpp>
#include <squeeze/nn/llama.hpp>

namespace {

using squeeze::nn::fused_linear_cross_entropy;

double rel(const torch::Tensor& got, const torch::Tensor& ref) {
  return (got.to(torch::kFloat64) - ref.to(torch::kFloat64)).abs().max().item<double>() /
         std::max(ref.to(torch::kFloat64).abs().max().item<double>(), 1e-300);
}

struct Case {
  torch::Tensor x, w, t;
};
Case random_case(int64_t N, int64_t h, int64_t V, torch::ScalarType dt, uint64_t seed) {
  torch::manual_seed(seed);
  Case c{torch::randn({N, h}, torch::kFloat64).to(dt), (torch::randn({V, h}, torch::kFloat64) * 0.3).to(dt),
         torch::randint(V, {N}, torch::kLong)};
  c.t.index_put_({torch::arange(0, N, 5)}, -100);  // every fifth target ignored
  return c;
}

// Loss and gradients of the float64 reference, from the same (rounded) inputs.
struct Result {
  torch::Tensor loss, dx, dw;
};
Result reference(const Case& c) {
  const torch::Tensor x = c.x.to(torch::kFloat64).detach().requires_grad_(true), w = c.w.to(torch::kFloat64).detach().requires_grad_(true);
  const torch::Tensor loss = torch::nn::functional::cross_entropy(torch::nn::functional::linear(x, w), c.t);
  loss.backward();
  return {loss.detach(), x.grad(), w.grad()};
}
Result fused(const Case& c, int64_t chunk) {
  const torch::Tensor x = c.x.detach().requires_grad_(true), w = c.w.detach().requires_grad_(true);
  const torch::Tensor loss = fused_linear_cross_entropy(x, w, c.t, chunk);
  loss.backward();
  return {loss.detach(), x.grad(), w.grad()};
}

TEST(FusedLinearCrossEntropy, MatchesFloat64AutogradInEveryDtype) {
  struct Tol {
    torch::ScalarType dt;
    double loss, grad;
  };
  for (const Tol& tol : {Tol{torch::kFloat64, 1e-12, 1e-12}, Tol{torch::kFloat32, 2e-5, 2e-5}, Tol{torch::kBFloat16, 3e-2, 4e-2}})
    for (const int64_t chunk : {1, 8, 37, 1000}) {
      const Case c = random_case(37, 19, 53, tol.dt, 7);
      const Result ref = reference(c), got = fused(c, chunk);
      const std::string what = std::string(c10::toString(tol.dt)) + " chunk " + std::to_string(chunk);
      EXPECT_EQ(got.dx.scalar_type(), tol.dt) << what;
      EXPECT_EQ(got.dw.scalar_type(), tol.dt) << what;
      EXPECT_LE(rel(got.loss, ref.loss), tol.loss) << what;
      EXPECT_LE(rel(got.dx, ref.dx), tol.grad) << what;
      EXPECT_LE(rel(got.dw, ref.dw), tol.grad) << what;
    }
}

// The same on a CUDA device (cuBLAS GEMMs; skipped without one), larger and still odd: 1000 rows of 4099 classes.
TEST(FusedLinearCrossEntropy, MatchesFloat64AutogradOnCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (const auto dt : {torch::kFloat32, torch::kBFloat16}) {
    Case c = random_case(1000, 257, 4099, dt, 8);
    const Result ref = reference(c);
    c.x = c.x.cuda(), c.w = c.w.cuda(), c.t = c.t.cuda();
    const Result got = fused(c, 300);
    const double tol_loss = dt == torch::kFloat32 ? 2e-5 : 3e-2,
                 tol_grad = dt == torch::kFloat32 ? 5e-5 : 4e-2;  // TF32 off: torch's default
    EXPECT_LE(rel(got.loss.cpu(), ref.loss), tol_loss) << c10::toString(dt);
    EXPECT_LE(rel(got.dx.cpu(), ref.dx), tol_grad) << c10::toString(dt);
    EXPECT_LE(rel(got.dw.cpu(), ref.dw), tol_grad) << c10::toString(dt);
  }
}

TEST(FusedLinearCrossEntropy, GradientsMatchFiniteDifferences) {
  const Case c = random_case(11, 7, 13, torch::kFloat64, 3);
  const Result got = fused(c, 4);
  const double eps = 1e-6;
  torch::NoGradGuard no_grad;
  auto loss_at = [&](const torch::Tensor& x, const torch::Tensor& w) { return fused_linear_cross_entropy(x, w, c.t, 4).item<double>(); };
  for (int64_t i : {0, 13, 40, 76}) {  // elements of x [11, 7] and w [13, 7]
    torch::Tensor xp = c.x.clone(), xm = c.x.clone();
    xp.view(-1)[i] += eps, xm.view(-1)[i] -= eps;
    EXPECT_NEAR((loss_at(xp, c.w) - loss_at(xm, c.w)) / (2 * eps), got.dx.view(-1)[i].item<double>(), 1e-8) << "x[" << i << "]";
    torch::Tensor wp = c.w.clone(), wm = c.w.clone();
    wp.view(-1)[i] += eps, wm.view(-1)[i] -= eps;
    EXPECT_NEAR((loss_at(c.x, wp) - loss_at(c.x, wm)) / (2 * eps), got.dw.view(-1)[i].item<double>(), 1e-8) << "w[" << i << "]";
  }
}

// The incoming gradient scales both gradients (a loss scale); all targets ignored: loss and gradients 0.
TEST(FusedLinearCrossEntropy, IncomingGradientAndAllIgnored) {
  const Case c = random_case(9, 5, 7, torch::kFloat64, 4);
  const Result once = fused(c, 4);
  const torch::Tensor x = c.x.detach().requires_grad_(true), w = c.w.detach().requires_grad_(true);
  (fused_linear_cross_entropy(x, w, c.t, 4) * 3.0).backward();
  EXPECT_LE(rel(x.grad(), once.dx * 3), 1e-14);
  EXPECT_LE(rel(w.grad(), once.dw * 3), 1e-14);
  Case none = c;
  none.t = torch::full({9}, -100, torch::kLong);
  const Result z = fused(none, 4);
  EXPECT_EQ(z.loss.item<double>(), 0.0);
  EXPECT_EQ(z.dx.abs().max().item<double>(), 0.0);
  EXPECT_EQ(z.dw.abs().max().item<double>(), 0.0);
}

TEST(FusedLinearCrossEntropy, BadInputIsRefusedByName) {
  const Case c = random_case(6, 4, 5, torch::kFloat32, 5);
  auto error_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "";
  };
  EXPECT_NE(error_of([&] { fused_linear_cross_entropy(c.x, c.w.t().contiguous(), c.t); }).find("features"), std::string::npos);
  EXPECT_NE(error_of([&] { fused_linear_cross_entropy(c.x, c.w.to(torch::kFloat64), c.t); }).find("one floating-point dtype"),
            std::string::npos);
  EXPECT_NE(error_of([&] { fused_linear_cross_entropy(c.x, c.w, c.t.to(torch::kInt)); }).find("targets must be [N] int64"),
            std::string::npos);
  EXPECT_NE(error_of([&] { fused_linear_cross_entropy(c.x.unsqueeze(0), c.w, c.t); }).find("x must be [N, h]"), std::string::npos);
  EXPECT_NE(error_of([&] { fused_linear_cross_entropy(c.x, c.w, c.t, 0); }).find("chunk must be >= 1"), std::string::npos);
}

// nn::Llama with fused_loss: the same loss and gradients as its checkpointed chunked loss (float32), tied and untied.
TEST(FusedLinearCrossEntropy, LlamaFusedLossMatchesTheChunkedLoss) {
  for (const bool tied : {false, true}) {
    squeeze::nn::LlamaConfig cfg = squeeze::nn::LlamaConfig::preset("tiny");
    cfg.tie_embeddings = tied;
    torch::manual_seed(11);
    squeeze::nn::Llama a(cfg), b(cfg);
    {
      torch::NoGradGuard ng;
      for (auto& p : b->named_parameters()) p.value().copy_(a->named_parameters()[p.key()]);
    }
    a->loss_chunk_tokens = b->loss_chunk_tokens = 29;  // 3 x 41 tokens: chunks that do not divide
    b->fused_loss = true;
    const torch::Tensor ids = torch::randint(cfg.vocab, {3, 42}, torch::kLong);
    const torch::Tensor la = a->loss(ids.narrow(1, 0, 41), ids.narrow(1, 1, 41)), lb = b->loss(ids.narrow(1, 0, 41), ids.narrow(1, 1, 41));
    la.backward();
    lb.backward();
    EXPECT_LE(rel(lb, la), 2e-6) << "tied " << tied;
    for (auto& p : a->named_parameters()) EXPECT_LE(rel(b->named_parameters()[p.key()].grad(), p.value().grad()), 1e-4) << p.key();
  }
}

}  // namespace
