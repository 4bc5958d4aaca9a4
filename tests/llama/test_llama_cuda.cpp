// The same model, checkpointing and trainer on a CUDA device: CUDA RNG replay, the fused GQA attention in
// bf16 against a float64 reference, every strategy training, allocator statistics. Run by ctest label
// `cuda` (test llama.cuda); they skip without a device.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <squeeze/nn/activation_checkpoint.hpp>

#include "trainer.hpp"

namespace {

using namespace squeeze::llama;
using squeeze::nn::LlamaConfig;

#define SQUEEZE_NEED_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"

LlamaConfig cuda_config() {
  LlamaConfig c;
  c.name = "cuda-test";
  c.vocab = 256, c.hidden = 128, c.layers = 3, c.heads = 4, c.kv_heads = 2, c.ffn = 344;
  return c;
}

TEST(LlamaCuda, CheckpointReplaysCudaDropout) {
  SQUEEZE_NEED_CUDA();
  const torch::Device dev(torch::kCUDA);
  torch::manual_seed(1);
  torch::nn::Linear a(64, 256), b(256, 64);
  a->to(dev), b->to(dev);
  std::vector<torch::Tensor> params = a->parameters();
  for (auto& p : b->parameters()) params.push_back(p);
  auto block = [a, b](const torch::Tensor& x) mutable { return x + b(torch::dropout(torch::gelu(a(x)), 0.3, true)); };
  const torch::Tensor x0 = torch::randn({8, 16, 64}, dev);
  const auto run = [&](bool ckpt) {
    for (auto& p : params) p.mutable_grad() = torch::Tensor();
    torch::Tensor x = x0.clone().requires_grad_(true);
    torch::manual_seed(77);
    torch::Tensor y = ckpt ? squeeze::nn::checkpoint(x, params, block) : block(x);
    (y * y).sum().backward();
    std::vector<torch::Tensor> g{x.grad().clone()};
    for (auto& p : params) g.push_back(p.grad().clone());
    g.push_back(torch::rand({4}, dev));  // the caller's CUDA RNG stream afterwards
    return g;
  };
  const auto plain = run(false), ck = run(true);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_LE((plain[i] - ck[i]).abs().max().item<double>(), 1e-6) << i;
}

TEST(LlamaCuda, FusedGqaAttentionInBf16MatchesFloat64) {
  SQUEEZE_NEED_CUDA();
  torch::manual_seed(2);
  const LlamaConfig c = cuda_config();
  squeeze::nn::Attention cpu(c);
  cpu->to(torch::kFloat64);
  squeeze::nn::Attention gpu(c);
  {
    torch::NoGradGuard g;
    auto src = cpu->parameters(), dst = gpu->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  gpu->to(torch::kCUDA, torch::kBFloat16);
  const int64_t T = 40;
  const torch::Tensor x = torch::randn({2, T, c.hidden}, torch::kFloat64);
  const auto [cos, sin] = squeeze::nn::rope_tables(T, c.head_dim(), c.rope_theta, torch::kCPU);
  const auto [gcos, gsin] = squeeze::nn::rope_tables(T, c.head_dim(), c.rope_theta, torch::kCUDA);
  torch::NoGradGuard g;
  const torch::Tensor ref = cpu->forward(x, cos.to(torch::kFloat64), sin.to(torch::kFloat64));
  const torch::Tensor got = gpu->forward(x.to(torch::kCUDA, torch::kBFloat16), gcos, gsin).to(torch::kCPU, torch::kFloat64);
  // bf16 keeps 8 bits of mantissa: relative error of a few 1e-3 per op, compounded over 4 matmuls.
  EXPECT_LE(((got - ref).norm() / ref.norm()).item<double>(), 2e-2);
}

TEST(LlamaCuda, EveryStrategyLowersTheLossAndReportsMemory) {
  SQUEEZE_NEED_CUDA();
  const torch::Device dev(torch::kCUDA);
  std::string text;
  for (int i = 0; i < 60; ++i) text += i % 2 ? "And God saw the light, that it was good.\n" : "And there was evening and morning.\n";
  const torch::Tensor data = torch::from_blob(text.data(), {int64_t(text.size())}, torch::kUInt8).to(torch::kLong);
  for_each_strategy([&]<squeeze::StrategyType S>(std::string_view name) {
    if constexpr (S::has_lora) return;  // NF4 on CUDA needs an nvcc-compiled TU; this one is host-compiled
    SCOPED_TRACE(std::string(name));
    TrainOptions o;
    o.lr = 1e-2, o.weight_decay = 0;
    torch::manual_seed(3);
    reset_peak_memory(dev);
    LlamaRun<S> t(cuda_config(), o, dev);
    double first = 0, last = 0;
    for (int step = 0; step < 30; ++step) {
      auto gen = at::detail::createCPUGenerator(uint64_t(step));
      const torch::Tensor start = torch::randint(0, data.size(0) - 65, {8, 1}, gen, torch::kLong);
      const torch::Tensor w = data.index_select(0, (start + torch::arange(65, torch::kLong)).reshape({-1})).view({8, 65}).to(dev);
      const BatchResult r = t.step(w.narrow(1, 0, 64), w.narrow(1, 1, 64));
      if (step == 0) first = r.loss;
      last = r.loss;
    }
    EXPECT_LT(last, first - 1.5) << first << " -> " << last;
#if defined(SQUEEZE_TORCH_CUDA)
    EXPECT_GT(device_memory(dev).peak_gb, 0.0);
#endif
  });
}

}  // namespace
