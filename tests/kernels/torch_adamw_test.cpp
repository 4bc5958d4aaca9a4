// squeeze's CPU AdamW against libtorch's torch::optim::AdamW (label `kernels`; the area's one torch TU).
// Tolerance over 100 float steps: |ours - torch| <= 1.2e-5 * max(1, |w|) on the weights: ours rounds the weight
// update w * decay - step once (an explicit FMA, kernels/adamw.hpp), torch twice, so each step may differ by one
// ulp of max(1, |w|) (2^-23) and 100 steps by <= 100 * 2^-23 = 1.19e-5 (seen: 4.5e-6 at n = 1 Mi, a random walk's
// tail); the errors are rounding, not drift. m within 2e-6, v 1e-7 absolute. For the MLP, whose gradients depend
// on the weights, 1e-5.
#include <torch/torch.h>

#include "squeeze/kernels/adamw.hpp"
#include "squeeze/optim/torch_adamw.hpp"
#include "test_util.hpp"

namespace sk = squeeze::kernels;
using namespace squeeze;

namespace {

constexpr float kLr = 1e-3f, kB1 = 0.9f, kB2 = 0.999f, kEps = 1e-8f, kWd = 0.01f;

torch::optim::AdamW torch_adamw(std::vector<torch::Tensor> params) {
  return torch::optim::AdamW(std::move(params), torch::optim::AdamWOptions(kLr).betas({kB1, kB2}).eps(kEps).weight_decay(kWd));
}

double max_rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  const auto da = a.to(torch::kDouble), db = b.to(torch::kDouble);
  return ((da - db).abs() / db.abs().clamp_min(1.0)).max().item<double>();
}

TEST(AdamWVsTorch, CpuKernelMatchesTorchOptimAdamWOver100Steps) {
  torch::manual_seed(0);
  for (std::int64_t n : test::kSizes) {
    auto ours = torch::rand({n}) * 2 - 1;
    auto ref = ours.clone().set_requires_grad(true);
    auto m = torch::zeros({n}), v = torch::zeros({n});
    auto opt = torch_adamw({ref});
    for (int t = 1; t <= 100; ++t) {
      auto g = torch::randn({n}) * 0.1;
      ref.mutable_grad() = g.clone();
      opt.step();
      sk::adamw_cpu(
          sk::AdamWTensor<float, float>{ours.data_ptr<float>(), nullptr, g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n},
          sk::adamw_coeffs(kLr, kB1, kB2, kEps, kWd, t));
    }
    EXPECT_LE(max_rel_diff(ours, ref.detach()), 100 * 0x1p-23) << "n=" << n;
    auto& state = static_cast<torch::optim::AdamWParamState&>(*opt.state().begin()->second);
    EXPECT_LE(max_rel_diff(m, state.exp_avg()), 2e-6) << "n=" << n;
    EXPECT_LE((v - state.exp_avg_sq()).abs().max().item<float>(), 1e-7) << "n=" << n;
  }
}

struct Mlp : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  Mlp() {
    a = register_module("a", torch::nn::Linear(16, 33));
    b = register_module("b", torch::nn::Linear(33, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::tanh(a(x))); }
};

TEST(TorchAdamW, TrainsAModuleLikeTorchOptimAdamW) {
  torch::manual_seed(1);
  auto net = std::make_shared<Mlp>(), twin = std::make_shared<Mlp>();
  {
    torch::NoGradGuard ng;
    for (std::size_t i = 0; i < net->parameters().size(); ++i) twin->parameters()[i].copy_(net->parameters()[i]);
  }
  optim::TorchAdamW ours(net->parameters(), AdamW{.lr = kLr, .beta1 = kB1, .beta2 = kB2, .eps = kEps, .weight_decay = kWd});
  auto ref = torch_adamw(twin->parameters());
  for (int t = 0; t < 100; ++t) {
    const auto x = torch::randn({8, 16}), y = torch::randn({8, 4});
    ours.zero_grad();
    torch::mse_loss(net->forward(x), y).backward();
    ours.step();
    ref.zero_grad();
    torch::mse_loss(twin->forward(x), y).backward();
    ref.step();
  }
  for (std::size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_LE(max_rel_diff(net->parameters()[i].detach(), twin->parameters()[i].detach()), 1e-5) << "parameter " << i;
    EXPECT_EQ(ours.step_count(i), 100);
  }
}

// bf16 params, bf16 grads: the fp32 master follows torch's float AdamW fed the same (bf16) gradients,
// and the bf16 params are the master rounded to nearest even.
TEST(TorchAdamW, Bf16ParamsKeepAnFp32Master) {
  torch::manual_seed(2);
  const std::int64_t n = 1023;
  auto w32 = torch::rand({n}) * 2 - 1;
  auto p = w32.to(torch::kBFloat16).set_requires_grad(true);
  auto ref = p.detach().to(torch::kFloat).set_requires_grad(true);
  optim::TorchAdamW ours({p}, AdamW{.lr = kLr, .beta1 = kB1, .beta2 = kB2, .eps = kEps, .weight_decay = kWd});
  auto opt = torch_adamw({ref});
  for (int t = 0; t < 100; ++t) {
    const auto g = (torch::randn({n}) * 0.1).to(torch::kBFloat16);
    p.mutable_grad() = g;
    ours.step();
    ref.mutable_grad() = g.to(torch::kFloat);
    opt.step();
  }
  EXPECT_LE(max_rel_diff(ours.master(0), ref.detach()), 2e-6);
  EXPECT_TRUE(torch::equal(p.detach(), ours.master(0).to(torch::kBFloat16)));
}

TEST(TorchAdamW, BadInputGivesClearErrors) {
  auto expect_torch_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "expected an error containing " << needle;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_torch_error([] { optim::TorchAdamW({torch::zeros({3}, torch::kInt)}); }, "has dtype Int");
  expect_torch_error([] { optim::TorchAdamW({torch::zeros({4, 3}).t()}); }, "not contiguous");
  expect_torch_error([] { optim::TorchAdamW({torch::zeros({3})}, AdamW{.beta2 = 1.5f}); }, "beta2");
  expect_torch_error([] { optim::TorchAdamW({torch::zeros({3})}, AdamW{.max_grad_norm = 1.f}); }, "clip gradients before step");
  auto f = torch::ones({3}).requires_grad_(true);
  optim::TorchAdamW ok({f});
  f.mutable_grad() = torch::ones({3}, torch::kDouble);
  expect_torch_error([&] { ok.step(); }, "gradient 0 has dtype Double");
  EXPECT_TRUE(torch::equal(f.detach(), torch::ones({3}))) << "a failed step changes nothing";
  EXPECT_EQ(ok.step_count(0), 0);
  f.mutable_grad() = torch::ones({4});
  expect_torch_error([&] { ok.step(); }, "has 3 elements, its gradient 4");
  EXPECT_TRUE(torch::equal(f.detach(), torch::ones({3})));
  expect_torch_error([&] { ok.set_lr(-1.f); }, "lr must be finite");
}

}  // namespace
