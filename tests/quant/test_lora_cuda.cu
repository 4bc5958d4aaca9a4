// LoRALinear with an NF4 or GPTQ-format base on CUDA (nvcc TU: the NF4 / GPTQ CUDA launchers; label cuda; skips without a device
// or without libtorch's CUDA side).
// Tolerances: dequantisation is bit-identical to the CPU twin (same element functions); the bf16 forward /
// backward vs the CPU layer differ by summation order and bf16 output rounding: <= 2^-7 * (|x| |W|^T).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <squeeze/nn/layerwise.hpp>
#include <squeeze/nn/lora.hpp>
#if defined(SQUEEZE_TORCH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/cuda.h>

#include <squeeze/comm/local.hpp>
#include <squeeze/nn/llama.hpp>
#include <squeeze/optim/adamw.hpp>
#include <squeeze/train/trainer.hpp>
#endif

#include "random_layer.hpp"

using namespace squeeze;
namespace F = torch::nn::functional;

namespace {
bool have_cuda() { return torch::cuda::is_available(); }
#define REQUIRE_CUDA() \
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device (or libtorch without CUDA)"

struct TwoProj : torch::nn::Module {
  TwoProj(int64_t h) {
    register_module("q_proj", torch::nn::Linear(torch::nn::LinearOptions(h, h).bias(false)));
    register_module("v_proj", torch::nn::Linear(torch::nn::LinearOptions(h, h).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return nn::forward_linear(*this, "v_proj", F::gelu(nn::forward_linear(*this, "q_proj", x)));
  }
};
}  // namespace

TEST(LoRACuda, Nf4DequantizeMatchesCpuBitForBit) {
  REQUIRE_CUDA();
  torch::manual_seed(1);
  for (const bool dq : {false, true}) {
    const torch::Tensor w = torch::randn({300, 257}) * 0.02;  // odd element count, 1205 blocks (5 DoubleQuant groups)
    const nn::Nf4Weight cpu = nn::Nf4Weight::quantize(w, {.block = 64, .double_quant = dq});
    nn::Nf4Weight gpu = cpu;
    gpu.codes = cpu.codes.to(torch::kCUDA);
    gpu.absmax = cpu.absmax.to(torch::kCUDA);
    gpu.absmax_code = cpu.absmax_code.to(torch::kCUDA);
    gpu.nested_absmax = cpu.nested_absmax.to(torch::kCUDA);
    gpu.nested_map = cpu.nested_map.to(torch::kCUDA);
    gpu.absmax_offset = cpu.absmax_offset.to(torch::kCUDA);
    for (const auto dt : {torch::kFloat32, torch::kBFloat16, torch::kHalf})
      EXPECT_TRUE(torch::equal(gpu.dequantize(dt).cpu(), cpu.dequantize(dt))) << "dq=" << dq << " " << dt;
    // a CUDA weight is packed on the GPU (nvcc TU): the same codes (chosen against the exact absmax); the nested
    // statistics too, except where the DoubleQuant mean (float64 sums in another order) differs in its last bit
    const nn::Nf4Weight from_gpu = nn::Nf4Weight::quantize(w.to(torch::kCUDA), {.block = 64, .double_quant = dq});
    ASSERT_TRUE(from_gpu.codes.is_cuda());
    EXPECT_TRUE(torch::equal(from_gpu.codes.cpu(), cpu.codes)) << "dq=" << dq;
    if (!dq || torch::equal(from_gpu.absmax_offset.cpu(), cpu.absmax_offset)) {
      EXPECT_TRUE(torch::equal(from_gpu.dequantize(torch::kFloat32).cpu(), cpu.dequantize(torch::kFloat32))) << "dq=" << dq;
    } else {
      const float g = from_gpu.absmax_offset.cpu().item<float>(), c = cpu.absmax_offset.item<float>();
      EXPECT_NEAR(g, c, 1e-6 * c);
      EXPECT_LT(from_gpu.absmax_code.cpu().ne(cpu.absmax_code).sum().item<int64_t>(), 1 + cpu.absmax_code.numel() / 100);
    }
  }
}

TEST(LoRACuda, Nf4LayerMatchesCpuLayer) {
  REQUIRE_CUDA();
  torch::manual_seed(2);
  const torch::Tensor w = torch::randn({96, 160}) * 0.05;
  nn::LoRALinear cpu(nn::Nf4Weight::quantize(w, {.block = 64, .double_quant = true}), torch::Tensor(),
                     nn::LoRAOptions{.rank = 4, .alpha = 8});
  {
    torch::NoGradGuard ng;
    cpu->lora_B.normal_(0, 0.1);
  }
  nn::LoRALinear gpu(nn::Nf4Weight::quantize(w, {.block = 64, .double_quant = true}), torch::Tensor(),
                     nn::LoRAOptions{.rank = 4, .alpha = 8});
  {
    torch::NoGradGuard ng;
    gpu->lora_A.copy_(cpu->lora_A);
    gpu->lora_B.copy_(cpu->lora_B);
  }
  gpu->to(torch::kCUDA);  // buffers and parameters move; the layer follows them
  ASSERT_TRUE(gpu->nf4_weight().codes.is_cuda());
  const torch::Tensor x = torch::randn({4, 33, 160}).to(torch::kBFloat16);
  const torch::Tensor xc = x.clone().requires_grad_(true), xg = x.to(torch::kCUDA).requires_grad_(true);
  const torch::Tensor yc = cpu(xc), yg = gpu(xg);
  ASSERT_TRUE(yg.is_cuda());
  ASSERT_EQ(yg.scalar_type(), torch::kBFloat16);
  const torch::Tensor wd = cpu->merged_weight().to(torch::kFloat64);
  const torch::Tensor mag = torch::matmul(x.to(torch::kFloat64).abs(), wd.abs().t()) + 1e-3;
  EXPECT_LE(((yg.cpu().to(torch::kFloat64) - yc.to(torch::kFloat64)).abs() / mag).max().item<double>(), std::ldexp(1.0, -7));
  const torch::Tensor g = torch::randn(yc.sizes()).to(torch::kBFloat16);
  yc.backward(g);
  yg.backward(g.to(torch::kCUDA));
  EXPECT_TRUE(torch::allclose(gpu->lora_B.grad().cpu(), cpu->lora_B.grad(), 2e-2, 2e-2));
  EXPECT_TRUE(torch::allclose(gpu->lora_A.grad().cpu(), cpu->lora_A.grad(), 2e-2, 2e-2));
  const torch::Tensor gmag = torch::matmul(g.to(torch::kFloat64).abs(), wd.abs()) + 1e-3;
  EXPECT_LE(((xg.grad().cpu().to(torch::kFloat64) - xc.grad().to(torch::kFloat64)).abs() / gmag).max().item<double>(), std::ldexp(1.0, -6));
}

// The model's output plus a rank-2 change of gelu(q_proj(x)) in fp32 [rows, 256]: a target LoRA on q can reach.
torch::Tensor low_rank_target(TwoProj& model, const torch::Tensor& x) {
  torch::NoGradGuard ng;
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const torch::Tensor h = F::gelu(nn::forward_linear(model, "q_proj", x)).to(torch::kFloat32);  // [rows, 256]
  const torch::Tensor dW = torch::matmul(torch::randn({256, 2}, cuda), torch::randn({2, 256}, cuda)) * 0.05;
  return model.forward(x).to(torch::kFloat32) + torch::matmul(h, dW.t());
}
// 100 AdamW steps (lr 1e-2) on the adapters alone towards `target` (MSE): the first and the last loss.
std::pair<double, double> train_adapters(TwoProj& model, const torch::Tensor& x, const torch::Tensor& target) {
  torch::optim::AdamW opt(nn::lora_parameters(model), torch::optim::AdamWOptions(1e-2).weight_decay(0));
  double first = 0, last = 0;
  for (int s = 0; s < 100; ++s) {
    opt.zero_grad();
    const torch::Tensor loss = F::mse_loss(model.forward(x).to(torch::kFloat32), target);
    loss.backward();
    opt.step();
    (s == 0 ? first : last) = loss.item<double>();
  }
  return {first, last};
}

// The v adapter can represent the target exactly: target = (model at init) + gelu(q(x)) dW^T with dW of rank 2.
TEST(LoRACuda, QLoRATrainsOnTheGpu) {
  REQUIRE_CUDA();
  torch::manual_seed(3);
  using QLoRA =
      Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16, LoraTargets::q | LoraTargets::v>, Precision<bf16, float>, Checkpointed>;
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  auto model = std::make_shared<TwoProj>(256);
  model->to(torch::kCUDA, torch::kBFloat16);
  const torch::Tensor x = torch::randn({64, 256}, cuda).to(torch::kBFloat16);
  const torch::Tensor target = low_rank_target(*model, x);
  const auto adapted = nn::apply_lora<QLoRA>(*model);
  ASSERT_EQ(adapted.size(), 2u);
  EXPECT_TRUE(adapted[0].layer->lora_A.is_cuda());
  EXPECT_TRUE(adapted[0].layer->nf4_weight().codes.is_cuda());
  const auto [first, last] = train_adapters(*model, x, target);
  EXPECT_LT(last, 0.5 * first) << first << " -> " << last;
}

// LoRALinear on a GPTQ-format base (nn::QuantizedLinear) on CUDA vs the same layer on the CPU, over every forward
// path: fused tensor-core GEMM (tiles, rows <= 256), GEMV (no tiles, rows <= 8), dequantize + cuBLAS (more rows).
// Backward dX = dY W dequantizes W in bf16 on the GPU. Tolerance: 2^-6 * (|x| |W|^T) (bf16 output, x A^T and sum
// roundings; the CPU reference runs the base in float).
TEST(LoRACuda, GptqLayerMatchesCpuLayerOnEveryPath) {
  REQUIRE_CUDA();
  torch::manual_seed(4);
  struct Case {
    int bits;
    int64_t out, in;
    int group;
    bool tiles;
    int64_t rows;
    const char* path;
  };
  for (const Case c :
       {Case{4, 96, 160, 32, true, 4, "fused"}, Case{4, 96, 160, 32, true, 132, "fused"}, Case{3, 80, 200, 32, true, 4, "fused 3-bit"},
        Case{8, 48, 96, 0, true, 4, "fused 8-bit"}, Case{4, 96, 160, 32, false, 4, "gemv"},
        Case{4, 96, 160, 32, false, 300, "dequant+cublas"}, Case{2, 40, 72, 32, true, 300, "2-bit dequant+cublas"},
        Case{4, 96, 160, 32, true, 300, "fused at 300 rows (Hopper)"},
        Case{3, 80, 200, 32, true, 100, "3-bit dequant+cublas past max_fused_rows"}}) {
    const torch::Tensor w = torch::randn({c.out, c.in}) * 0.05;
    const quant::RtnOptions o{c.bits, c.group, false};
    nn::LoRALinear cpu(nn::quantize_rtn(w, torch::Tensor(), o), nn::LoRAOptions{.rank = 4, .alpha = 8});
    nn::LoRALinear gpu(nn::quantize_rtn(w, torch::Tensor(), o, c.tiles), nn::LoRAOptions{.rank = 4, .alpha = 8});
    {
      torch::NoGradGuard ng;
      cpu->lora_B.normal_(0, 0.1);
      gpu->lora_A.copy_(cpu->lora_A);
      gpu->lora_B.copy_(cpu->lora_B);
    }
    gpu->to(torch::kCUDA);
    ASSERT_TRUE(gpu->gptq_base()->device().is_cuda()) << c.path;
    const torch::Tensor x = torch::randn({c.rows, c.in}).to(torch::kBFloat16);
    const torch::Tensor xc = x.clone().requires_grad_(true), xg = x.to(torch::kCUDA).requires_grad_(true);
    const torch::Tensor yc = cpu(xc), yg = gpu(xg);
    ASSERT_EQ(yg.scalar_type(), torch::kBFloat16) << c.path;
    const torch::Tensor wd = cpu->merged_weight().to(torch::kFloat64);
    const torch::Tensor mag = torch::matmul(x.to(torch::kFloat64).abs(), wd.abs().t()) + 1e-3;
    EXPECT_LE(((yg.cpu().to(torch::kFloat64) - yc.to(torch::kFloat64)).abs() / mag).max().item<double>(), std::ldexp(1.0, -6)) << c.path;
    const torch::Tensor g = torch::randn(yc.sizes()).to(torch::kBFloat16);
    yc.backward(g);
    yg.backward(g.to(torch::kCUDA));
    const torch::Tensor gmag = torch::matmul(g.to(torch::kFloat64).abs(), wd.abs()) + 1e-3;
    EXPECT_LE(((xg.grad().cpu().to(torch::kFloat64) - xc.grad().to(torch::kFloat64)).abs() / gmag).max().item<double>(),
              std::ldexp(1.0, -6))
        << c.path;
    EXPECT_TRUE(torch::allclose(gpu->lora_B.grad().cpu(), cpu->lora_B.grad(), 2e-2, 2e-2)) << c.path;
    // the GPU dequantize kernel gives the CPU twin's weights exactly
    EXPECT_TRUE(torch::equal(gpu->gptq_base()->dequantize(torch::kFloat32).cpu(), cpu->gptq_base()->dequantize(torch::kFloat32))) << c.path;
  }
}

// QuantizedLinear on an act-order GPTQ layer (g_idx shuffled, as GPTQ writes it): the GPU dequantize (the kernel for
// scattered groups it picks from g_idx: a shared-memory table at 5 and 128 groups, lookups at 130) gives the CPU layer's
// weights exactly in fp32 and bf16, and the forward through dequantize + cuBLAS (fused limit 1 row) matches the CPU
// layer within 2^-6 (|x| |W|^T) in bf16.
TEST(LoRACuda, ActOrderGptqLayerDequantizesOnTheGpu) {
  REQUIRE_CUDA();
  struct Case {
    std::int64_t out, in;
    int group;
  };
  for (const Case c : {Case{96, 160, 32}, Case{72, 4096, 32}, Case{40, 4160, 32}}) {
    const auto p = test::random_layer(c.out, c.in, 4, c.group, true, 11 + std::uint32_t(c.in));
    ASSERT_FALSE(std::is_sorted(p.g_idx.begin(), p.g_idx.end()));
    nn::QuantizedLinear cpu(p), gpu(p);
    gpu->to(torch::kCUDA);
    gpu->set_max_fused_rows(1);
    for (const auto dtype : {torch::kFloat32, torch::kBFloat16})
      EXPECT_TRUE(torch::equal(gpu->dequantize(dtype).cpu(), cpu->dequantize(dtype))) << c.in << " in, dtype " << dtype;
    torch::manual_seed(5);
    const torch::Tensor x = torch::randn({16, c.in}).to(torch::kBFloat16);
    const torch::Tensor yc = cpu(x), yg = gpu(x.to(torch::kCUDA));
    const torch::Tensor mag = torch::matmul(x.to(torch::kFloat64).abs(), cpu->dequantize(torch::kFloat64).abs().t()) + 1e-3;
    EXPECT_LE(((yg.cpu().to(torch::kFloat64) - yc.to(torch::kFloat64)).abs() / mag).max().item<double>(), std::ldexp(1.0, -6))
        << c.in << " in";
  }
}

// QuantizedLinear takes the fused GEMM up to max_fused_rows() batch rows and dequantize + cuBLAS above: 1024 where the
// Hopper kernel serves the layer (4 bits on an sm_90a build and device), 64 on the mma.sync kernel at 3 / 4 bits, 32 at
// 8 (where dequantize + cuBLAS overtakes it: docs/results.md, "GPTQ dequantize"); set_max_fused_rows moves it.
TEST(LoRACuda, QuantizedLinearPicksFusedOrDequantizeByBatch) {
  REQUIRE_CUDA();
  using Path = nn::QuantizedLinearImpl::Path;
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  for (const int bits : {3, 4, 8}) {
    nn::QuantizedLinear q = nn::quantize_rtn(torch::randn({96, 160}), torch::Tensor(), {.bits = bits, .group_size = 32});
    q->to(torch::kCUDA);
    const bool hopper = bits == 4 && kernels::quant::quant_gemm_uses_sm90({1, 96, 160, 192, 96, 32, 4});
    const std::int64_t limit = hopper ? 1024 : bits == 8 ? 32 : 64;
    EXPECT_EQ(q->max_fused_rows(), limit) << bits;
    EXPECT_EQ(q->path_for(torch::empty({limit, 160}, cuda)), Path::TensorCoreGemm) << bits;
    EXPECT_EQ(q->path_for(torch::empty({limit + 1, 160}, cuda)), Path::DequantMatmul) << bits;
    q->set_max_fused_rows(limit + 1);
    EXPECT_EQ(q->path_for(torch::empty({limit + 1, 160}, cuda)), Path::TensorCoreGemm) << bits;
  }
}

TEST(LoRACuda, GptqLoRATrainsOnTheGpu) {
  REQUIRE_CUDA();
  torch::manual_seed(5);
  using GptqLoRA =
      Strategy<Quantized<4, RTN, Group<128>>, LoRA<8, 16, LoraTargets::q | LoraTargets::v>, Precision<bf16, float>, Checkpointed>;
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  auto model = std::make_shared<TwoProj>(256);
  model->to(torch::kCUDA, torch::kBFloat16);
  const torch::Tensor x = torch::randn({512, 256}, cuda).to(torch::kBFloat16);  // 512 rows: the training path (dequantize + cuBLAS)
  const torch::Tensor target = low_rank_target(*model, x);
  const auto adapted = nn::apply_lora<GptqLoRA>(*model);
  ASSERT_EQ(adapted.size(), 2u);
  ASSERT_TRUE(adapted[0].layer->gptq());
  EXPECT_TRUE(adapted[0].layer->gptq_base()->device().is_cuda());
  EXPECT_FALSE(adapted[0].layer->gptq_base()->fused_tiles());
  std::vector<torch::Tensor> base0;
  for (const auto& b : model->buffers()) base0.push_back(b.clone());
  const auto [first, last] = train_adapters(*model, x, target);
  EXPECT_LT(last, 0.5 * first) << first << " -> " << last;
  const auto bufs = model->buffers();
  ASSERT_EQ(bufs.size(), base0.size());
  for (size_t i = 0; i < bufs.size(); ++i) EXPECT_TRUE(torch::equal(bufs[i], base0[i])) << "buffer " << i << " changed";
}

#if defined(SQUEEZE_TORCH_CUDA)
// A quantized base never stands dense on the GPU: make_trainer leaves the linears it packs on the host and apply_lora
// moves them one at a time, so the device's peak while the trainer is built stays under the dense bf16 linears' bytes
// (before: the whole model went over in bf16 first; LLaMA-7B's QLoRA row peaked at 13.6 GB, its training at 11).
// Here, in an nvcc TU, because the step after it dequantises NF4 on the GPU.
TEST(LoRACuda, QuantizedBaseIsPackedOneLayerAtATime) {
  REQUIRE_CUDA();
  const torch::Device dev(torch::kCUDA, 0);
  using S = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>>;
  nn::LlamaConfig c;
  c.vocab = 256, c.hidden = 1024, c.layers = 6, c.heads = 8, c.kv_heads = 8, c.ffn = 2816;
  torch::manual_seed(3);
  nn::Llama model(c);  // float, on the host
  int64_t dense = 0;   // the seven projections of every block in bf16
  for (const auto& p : model->named_parameters())
    if (p.value().dim() == 2 && p.key().find("embed") == std::string::npos && p.key().find("head") == std::string::npos)
      dense += p.value().numel() * 2;
  ASSERT_GT(dense, 150'000'000);
  torch::cuda::synchronize();
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  const int64_t before = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current;
  auto trainer = make_trainer<S>(model, squeeze::AdamW{}, comm::LocalComm::single(), {.device = dev});
  torch::cuda::synchronize();
  const int64_t peak = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak - before;
  std::printf("[ measured ] building the QLoRA trainer: device peak %.1f MB, dense bf16 linears %.1f MB\n", peak / 1e6, dense / 1e6);
  EXPECT_LT(peak, dense / 2) << "the dense base went to the device at once";
  const torch::Tensor x = torch::randint(0, c.vocab, {2, 64}, torch::TensorOptions().dtype(torch::kLong).device(dev));
  const auto r = trainer.step([&] { return model->loss(x, x); });
  EXPECT_TRUE(std::isfinite(r.loss)) << r.loss;
}
#endif

#if defined(SQUEEZE_TORCH_CUDA)
// Offload<Host, Streamed> on the NF4 base: the blocks in pinned host memory, copied to the GPU on a side stream ahead of
// use. Three steps train the adapters bitwise as the resident base does; the device holds two blocks' packed bytes (the
// one in use and one prefetched), and after the first step no block is fetched late.
TEST(LoRACuda, StreamedNf4BaseTrainsAsTheResidentBaseOnTheGpu) {
  REQUIRE_CUDA();
  const torch::Device dev(torch::kCUDA, 0);
  using Resident = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16, all_linears>, Precision<bf16, float>, Checkpointed>;
  using Streamed =
      Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16, all_linears>, Precision<bf16, float>, Checkpointed, Offload<Host, Streamed>>;
  nn::LlamaConfig c;
  c.vocab = 97, c.hidden = 136, c.layers = 5, c.heads = 4, c.kv_heads = 2, c.ffn = 360;
  torch::manual_seed(8);
  const torch::Tensor x = torch::randint(0, c.vocab, {3, 41}, torch::TensorOptions().dtype(torch::kLong).device(dev));
  const auto train = [&](auto strategy, std::shared_ptr<engine::FrozenUnits>* home_out) {
    using S = decltype(strategy);
    torch::manual_seed(5);
    nn::Llama model(c);
    model->checkpoint_every = 1;
    auto trainer = make_trainer<S>(model, squeeze::AdamW{.lr = 1e-3f}, comm::LocalComm::single(), {.device = dev});
    for (int s = 0; s < 3; ++s) {
      if (s == 1 && home_out && nn::frozen_home(*model)) nn::frozen_home(*model)->reset_counters();
      trainer.step([&] { return model->loss(x.narrow(1, 0, 40), x.narrow(1, 1, 40)); });
    }
    if (home_out) *home_out = nn::frozen_home(*model);
    std::map<std::string, torch::Tensor> adapters;
    for (const auto& p : model->named_parameters())
      if (p.value().requires_grad()) adapters[p.key()] = p.value().detach().cpu();
    return adapters;
  };
  std::shared_ptr<engine::FrozenUnits> home;
  const auto resident = train(Resident{}, nullptr);
  const auto streamed = train(Streamed{}, &home);
  ASSERT_NE(home, nullptr);
  ASSERT_EQ(resident.size(), streamed.size());
  for (const auto& [name, t] : resident) EXPECT_TRUE(torch::equal(streamed.at(name), t)) << name;
  const engine::FrozenUnitStats s = home->stats();
  EXPECT_EQ(s.units, c.layers);
  EXPECT_EQ(s.fetched_late, 0) << "steps 2-3 fetched a block late (" << s.prefetched << " prefetched)";
  EXPECT_EQ(s.device_bytes, 2 * home->unit_bytes(0));
  std::printf("[ measured ] streamed NF4 base: %lld units, %.2f MB on the host, %.2f MB of slots, %.2f MB copied in 2 steps\n",
              (long long)s.units, s.host_bytes / 1e6, s.device_bytes / 1e6, s.h2d_bytes / 1e6);
}

#endif

// A block-by-block build onto the GPU draws each part there (LayerwiseOptions::draw_on_device): the same packed bases,
// adapters and dense parts, bit for bit, as the whole float model drawn on the GPU and packed there by apply_lora; drawn
// on the host instead (draw_on_device = false), those of the whole model drawn on the CPU.
TEST(LoRACuda, LayerwiseBuildDrawnOnTheGpuEqualsTheWholeModelDrawnThere) {
  REQUIRE_CUDA();
  const torch::Device dev(torch::kCUDA, 0);
  using S = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16, all_linears>, Precision<bf16, float>, Checkpointed>;
  nn::LlamaConfig c;
  c.vocab = 97, c.hidden = 128, c.layers = 3, c.heads = 4, c.kv_heads = 2, c.ffn = 256;
  const auto expect_same = [](torch::nn::Module& a, torch::nn::Module& b, const char* what) {
    const auto pa = a.named_parameters(), pb = b.named_parameters();
    ASSERT_EQ(pa.keys(), pb.keys()) << what;
    for (const auto& p : pa) EXPECT_TRUE(torch::equal(p.value().cpu(), pb[p.key()].cpu())) << what << ": " << p.key();
    const auto ba = a.named_buffers(), bb = b.named_buffers();
    ASSERT_EQ(ba.keys(), bb.keys()) << what;
    for (const auto& t : ba) EXPECT_TRUE(torch::equal(t.value().cpu(), bb[t.key()].cpu())) << what << ": " << t.key();
  };
  for (bool on_gpu : {true, false}) {
    nn::LayerwiseOptions o;
    o.device = dev, o.seed = 21, o.draw_on_device = on_gpu;
    nn::Llama built = nn::build_quantized_llama<S>(c, o);
    nn::Llama whole(
        c, nn::ParamInit{torch::TensorOptions().dtype(torch::kFloat32).device(on_gpu ? dev : torch::Device(torch::kCPU)), true, 21});
    nn::apply_lora<S>(*whole, {dev, torch::kBFloat16});
    whole->to(dev);  // the norms, embedding and head, as the build leaves them
    expect_same(*built, *whole, on_gpu ? "drawn on the GPU" : "drawn on the host");
  }
}
