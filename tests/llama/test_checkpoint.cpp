// Activation checkpointing: gradients equal those of the plain graph (random ops and autocast inside the
// block included), the caller's RNG stream is left as it would be without checkpointing, and the
// activations kept between forward and backward shrink.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <squeeze/nn/activation_checkpoint.hpp>

#include "memory_meter.hpp"

namespace {

using squeeze::nn::checkpoint;
using squeeze::nn::checkpoint_sequential;

// A block with a random op: Linear -> GELU -> dropout -> Linear, residual.
struct NoisyMlpImpl : torch::nn::Module {
  torch::nn::Linear up{nullptr}, down{nullptr};
  NoisyMlpImpl(int64_t h, int64_t f) {
    up = register_module("up", torch::nn::Linear(h, f));
    down = register_module("down", torch::nn::Linear(f, h));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + down(torch::dropout(torch::gelu(up(x)), /*p=*/0.25, /*train=*/true)); }
};
TORCH_MODULE(NoisyMlp);

struct Stack {
  std::vector<NoisyMlp> layers;
  Stack(int n, int64_t h, int64_t f, torch::Dtype dtype) {
    torch::manual_seed(7);
    for (int i = 0; i < n; ++i) {
      layers.emplace_back(h, f);
      layers.back()->to(dtype);
    }
  }
  std::vector<torch::Tensor> params() const {
    std::vector<torch::Tensor> p;
    for (const auto& l : layers)
      for (auto& t : l->parameters()) p.push_back(t);
    return p;
  }
  // every: -1 no checkpointing; 0 the whole stack as one checkpoint; N segments of N layers.
  torch::Tensor run(const torch::Tensor& x, int every) {
    const auto layer = [this](int64_t i, const torch::Tensor& h) { return layers[i]->forward(h); };
    const auto layer_params = [this](int64_t i) { return layers[i]->parameters(); };
    const int64_t n = static_cast<int64_t>(layers.size());
    if (every < 0) return checkpoint_sequential(n, 0, x, layer, layer_params);
    if (every == 0)
      return checkpoint(x, params(), [this, n, layer](const torch::Tensor& h) {
        torch::Tensor y = h;
        for (int64_t i = 0; i < n; ++i) y = layer(i, y);
        return y;
      });
    return checkpoint_sequential(n, every, x, layer, layer_params);
  }
  void zero_grad() {
    for (auto& p : params()) p.mutable_grad() = torch::Tensor();
  }
};

struct Grads {
  torch::Tensor input;
  std::vector<torch::Tensor> params;
  torch::Tensor next_random;  // the caller's RNG stream after backward
};

Grads run_and_backward(Stack& s, const torch::Tensor& x0, int every) {
  s.zero_grad();
  torch::Tensor x = x0.detach().clone().requires_grad_(true);
  torch::manual_seed(1234);
  torch::Tensor y = s.run(x, every);
  torch::Tensor w = torch::linspace(-1.0, 1.0, y.numel(), y.options()).view_as(y);  // non-uniform upstream grad
  (y * w).sum().backward();
  Grads g;
  g.input = x.grad().clone();
  for (auto& p : s.params()) g.params.push_back(p.grad().clone());
  g.next_random = torch::rand({4}, torch::kFloat64);
  return g;
}

void expect_same(const Grads& a, const Grads& b, double tol) {
  ASSERT_TRUE(a.input.defined() && b.input.defined());
  EXPECT_LE((a.input - b.input).abs().max().item<double>(), tol);
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    ASSERT_TRUE(a.params[i].defined() && b.params[i].defined()) << "param " << i;
    EXPECT_LE((a.params[i] - b.params[i]).abs().max().item<double>(), tol) << "param " << i;
  }
  EXPECT_TRUE(torch::equal(a.next_random, b.next_random)) << "checkpointing changed the caller's RNG stream";
}

TEST(Checkpoint, GradientsMatchPlainFloat64WithDropout) {
  Stack s(5, 24, 40, torch::kFloat64);  // 5 layers: segments of 2 leave a shorter last one
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({3, 7, 24}, torch::kFloat64);
  const Grads plain = run_and_backward(s, x, -1);
  // DropoutWithoutReplayWouldDiffer shows the masks matter, so equality here means they were replayed.
  for (int every : {0, 1, 2, 5, 9}) {
    SCOPED_TRACE("every=" + std::to_string(every));
    expect_same(run_and_backward(s, x, every), plain, 1e-12);
  }
}

TEST(Checkpoint, GradientsMatchPlainFloat32Bitwise) {
  Stack s(3, 16, 33, torch::kFloat32);
  torch::manual_seed(4);
  const torch::Tensor x = torch::randn({2, 5, 16});
  const Grads plain = run_and_backward(s, x, -1);
  for (int every : {0, 1, 2}) {
    SCOPED_TRACE("every=" + std::to_string(every));
    expect_same(run_and_backward(s, x, every), plain, 0.0);
  }
}

TEST(Checkpoint, DropoutWithoutReplayWouldDiffer) {
  // Guards the test above: a different seed gives different gradients, so equality is not vacuous.
  Stack s(2, 16, 32, torch::kFloat64);
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({2, 4, 16}, torch::kFloat64);
  const Grads a = run_and_backward(s, x, 1);
  s.zero_grad();
  torch::Tensor x2 = x.clone().requires_grad_(true);
  torch::manual_seed(999);
  s.run(x2, 1).sum().backward();
  EXPECT_GT((a.input - x2.grad()).abs().max().item<double>(), 1e-6);
}

TEST(Checkpoint, WholeModelWithIntegerInputs) {
  // Token ids need no gradient; the parameters still get theirs through the checkpoint node.
  torch::manual_seed(11);
  torch::nn::Embedding emb(50, 12);
  torch::nn::Linear head(12, 50);
  emb->to(torch::kFloat64);
  head->to(torch::kFloat64);
  const torch::Tensor ids = torch::randint(0, 50, {3, 9}, torch::kLong);
  auto model = [emb, head](const std::vector<torch::Tensor>& in) mutable {
    return torch::log_softmax(head(torch::dropout(emb(in[0]), 0.1, true)), -1).mean();
  };
  std::vector<torch::Tensor> params = emb->parameters();
  for (auto& p : head->parameters()) params.push_back(p);

  torch::manual_seed(21);
  model({ids}).backward();
  std::vector<torch::Tensor> plain;
  for (auto& p : params) {
    plain.push_back(p.grad().clone());
    p.mutable_grad() = torch::Tensor();
  }

  torch::manual_seed(21);
  torch::Tensor loss = checkpoint(model, {ids}, params);
  ASSERT_TRUE(loss.requires_grad());
  loss.backward();
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(params[i].grad().defined()) << i;
    EXPECT_LE((params[i].grad() - plain[i]).abs().max().item<double>(), 1e-12) << i;
  }
}

TEST(Checkpoint, ReplaysAutocastState) {
  // Forward under CPU autocast (bf16 matmuls); backward after autocast is switched off. Recomputing in
  // float would give different (more precise) gradients than the plain autocast graph.
  if (!at::autocast::is_autocast_available(at::kCPU)) GTEST_SKIP() << "no CPU autocast in this libtorch";
  torch::manual_seed(8);
  torch::nn::Linear a(32, 48), b(48, 32);
  const torch::Tensor x0 = torch::randn({4, 32});
  std::vector<torch::Tensor> params = a->parameters();
  for (auto& p : b->parameters()) params.push_back(p);
  auto block = [a, b](const torch::Tensor& x) mutable { return b(torch::silu(a(x))).to(torch::kFloat32); };

  const auto run = [&](bool ckpt) {
    for (auto& p : params) p.mutable_grad() = torch::Tensor();
    torch::Tensor x = x0.clone().requires_grad_(true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    torch::Tensor y = ckpt ? checkpoint(x, params, block) : block(x);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    (y * y).sum().backward();
    std::vector<torch::Tensor> g{x.grad().clone()};
    for (auto& p : params) g.push_back(p.grad().clone());
    return g;
  };
  const auto plain = run(false);
  const auto ckpt = run(true);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU)) << "backward left autocast switched on";
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_LE((plain[i] - ckpt[i]).abs().max().item<double>(), 1e-6) << "tensor " << i;

  // And the float recompute really differs (so the comparison above can fail).
  for (auto& p : params) p.mutable_grad() = torch::Tensor();
  torch::Tensor x = x0.clone().requires_grad_(true);
  torch::Tensor y = block(x);
  (y * y).sum().backward();
  EXPECT_GT((x.grad() - plain[0]).abs().max().item<double>(), 1e-4);
}

TEST(Checkpoint, KeepsFewerActivations) {
  // 6 wide layers: the plain graph keeps each layer's hidden activations (several B*T*f tensors per
  // layer), the checkpointed one keeps each segment's input (B*T*h) plus the output.
  Stack s(6, 64, 512, torch::kFloat32);
  torch::manual_seed(9);
  const torch::Tensor x = torch::randn({8, 32, 64}).requires_grad_(true);
  const auto held_after_forward = [&](int every) {
    squeeze::test::MemoryMeter meter;
    torch::Tensor y = s.run(x, every);
    const int64_t held = meter.live_bytes();  // y and everything its graph saved
    y.sum().backward();
    s.zero_grad();
    return held;
  };
  const int64_t plain = held_after_forward(-1);
  const int64_t every1 = held_after_forward(1);
  const int64_t every3 = held_after_forward(3);
  const int64_t whole = held_after_forward(0);
  const int64_t act = 8 * 32 * 64 * 4;  // one B*T*h float activation
  // Plain: per layer at least up(x) and gelu and the dropout mask/output at f = 8h -> far above 6*act.
  EXPECT_GT(plain, 6 * 8 * act);
  // Checkpointed: one saved input per segment (x itself is the caller's, not counted) + the output.
  // Slack: each checkpoint also keeps the CPU generator's state (about 5 kB).
  const int64_t rng = 8192;
  EXPECT_LE(every1, (5 + 1) * act + 6 * rng);
  EXPECT_LE(every3, (1 + 1) * act + 2 * rng);
  EXPECT_LE(whole, 1 * act + rng);
  EXPECT_LT(every1 * 8, plain);
  std::cout << "bytes held after forward: plain " << plain << ", every 1: " << every1 << ", every 3: " << every3 << ", whole: " << whole
            << "\n";
}

TEST(Checkpoint, NoGraphOutsideGradMode) {
  Stack s(2, 8, 16, torch::kFloat32);
  torch::NoGradGuard no_grad;
  torch::Tensor y = s.run(torch::randn({2, 8}), 1);
  EXPECT_FALSE(y.requires_grad());
}

TEST(Checkpoint, RejectsEmptyFunctionAndUndefinedInput) {
  EXPECT_THROW(checkpoint(squeeze::nn::BlockFn{}, {torch::randn({2})}, {}), c10::Error);
  EXPECT_THROW(checkpoint([](const std::vector<torch::Tensor>& v) { return v[0]; }, {torch::Tensor()}, {}), c10::Error);
}

// checkpoint_chunked_sum: Σ over row chunks (37 rows in chunks of 8: the last has 5) of tanh(x_k W)·t_k equals the
// whole sum, and so do the gradients of the rows and of the shared W (float64: 1e-12 relative); the chunks'
// intermediates ([8, 5] products) are not kept between forward and backward.
TEST(Checkpoint, ChunkedSumMatchesTheWholeSum) {
  torch::manual_seed(31);
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const torch::Tensor x = torch::randn({37, 6}, f64).requires_grad_(true), w = torch::randn({6, 5}, f64).requires_grad_(true);
  const torch::Tensor t = torch::randn({37, 5}, f64);
  const squeeze::nn::BlockFn fn = [](const std::vector<torch::Tensor>& in) { return (torch::tanh(in[0].mm(in[2])) * in[1]).sum(); };
  const torch::Tensor whole = fn({x, t, w});
  const auto gw = torch::autograd::grad({whole}, {x, w});
  for (bool recompute : {true, false}) {
    const torch::Tensor sum = squeeze::nn::checkpoint_chunked_sum(8, {x, t}, {w}, fn, recompute);
    EXPECT_NEAR(sum.item<double>(), whole.item<double>(), 1e-12 * std::abs(whole.item<double>()));
    const auto g = torch::autograd::grad({sum}, {x, w});
    for (int i = 0; i < 2; ++i) EXPECT_LE(((g[i] - gw[i]).norm() / gw[i].norm()).item<double>(), 1e-12) << "recompute " << recompute;
  }
  EXPECT_THROW(squeeze::nn::checkpoint_chunked_sum(0, {x, t}, {w}, fn), c10::Error);
  EXPECT_THROW(squeeze::nn::checkpoint_chunked_sum(-4, {x, t}, {w}, fn), c10::Error);
  EXPECT_THROW(squeeze::nn::checkpoint_chunked_sum(8, {x, t.narrow(0, 0, 36)}, {w}, fn), c10::Error) << "rows differ";
  EXPECT_THROW(squeeze::nn::checkpoint_chunked_sum(8, {}, {w}, fn), c10::Error);
}

}  // namespace
