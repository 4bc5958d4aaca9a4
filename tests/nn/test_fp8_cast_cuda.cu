// The FP8 cast kernels (kernels/fp8_cast.cuh, through nn::to_fp8 in this nvcc translation unit) against their CPU twin
// byte for byte: values, transposes and scales on sizes that don't divide the 64-wide tiles, in float, bf16 and half,
// with a NaN; and fp8_linear's outputs and gradients through the kernels equal to those through torch ops (the same
// FP8 bytes into the same GEMMs); the amax the RMSNorm and SwiGLU kernels write of their outputs (forward and backward)
// equal to max |output|, and the casts taking it equal to the twin's casts of those outputs. Skipped without a CUDA device.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <utility>
#include <vector>

#include <squeeze/nn/fp8_linear.hpp>

using namespace squeeze;

namespace {

bool no_gpu() { return !torch::cuda::is_available(); }

TEST(Fp8Cuda, KernelsEqualTheCpuTwin) {
  if (no_gpu()) GTEST_SKIP() << "no CUDA device (or libtorch without CUDA)";
  torch::manual_seed(12);
  // {100, 136}, {8, 4, 36}, {130, 64}: four values a thread (and {130, 64}'s transpose one, 130 rows); the rest, and
  // {104, 136} one element into its storage, one
  const std::vector<std::vector<int64_t>> shapes = {{1, 1},     {37, 130},  {130, 37}, {3, 11, 45}, {4099, 257},
                                                    {100, 136}, {8, 4, 36}, {130, 64}, {104, 136}};
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16})
    for (const auto& sizes : shapes)
      for (auto format : {torch::kFloat8_e4m3fn, torch::kFloat8_e5m2})
        for (bool with_nan : {false, true}) {
          torch::Tensor x = (torch::randn(sizes) * 5).to(dtype);
          if (with_nan) x.view({-1})[x.numel() / 2] = NAN;
          x = x.cuda();
          if (sizes.size() == 2 && sizes[0] == 104) {  // {104, 136} one element in: no longer quad-aligned, so one value a thread
            torch::Tensor shifted = torch::empty({x.numel() + 1}, x.options());
            shifted.narrow(0, 1, x.numel()).copy_(x.view({-1}));
            x = shifted.narrow(0, 1, x.numel()).view(x.sizes());
          }
          const nn::Fp8Operand gpu = nn::to_fp8(x, format, nn::Fp8Layout::both),
                               cpu = nn::to_fp8_twin(x.cpu(), format, nn::Fp8Layout::both);
          const auto what = ::testing::Message() << dtype << " " << format << " " << x.sizes() << (with_nan ? " with a NaN" : "");
          EXPECT_TRUE(torch::equal(gpu.values.cpu().view(torch::kUInt8), cpu.values.view(torch::kUInt8))) << what;
          EXPECT_TRUE(torch::equal(gpu.transposed.cpu().view(torch::kUInt8), cpu.transposed.view(torch::kUInt8))) << what;
          EXPECT_EQ(gpu.inverse_scale.item<float>(), cpu.inverse_scale.item<float>()) << what;
          const nn::Fp8Operand only_t = nn::to_fp8(x, format, nn::Fp8Layout::transposed);
          EXPECT_FALSE(only_t.values.defined());
          EXPECT_TRUE(torch::equal(only_t.transposed.cpu().view(torch::kUInt8), cpu.transposed.view(torch::kUInt8))) << what;
        }
}

TEST(Fp8Cuda, LinearThroughTheKernelsEqualsTorchOps) {
  if (no_gpu()) GTEST_SKIP() << "no CUDA device (or libtorch without CUDA)";
  torch::manual_seed(13);
  const auto bf = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const torch::Tensor x0 = torch::randn({4, 33, 96}, bf), w0 = torch::randn({80, 96}, bf) * 0.1, up = torch::randn({4, 33, 80}, bf);
  const auto run = [&](bool torch_ops) {
    std::optional<nn::ForceTorchOps> ops;
    if (torch_ops) ops.emplace();
    nn::fp8_input_cache().clear();
    torch::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    const torch::Tensor y = nn::fp8_linear(x, w);
    (y.to(torch::kFloat32) * up.to(torch::kFloat32)).sum().backward();
    return std::vector<torch::Tensor>{y, x.grad(), w.grad()};
  };
  const std::vector<torch::Tensor> kernels = run(false), ops = run(true);
  for (size_t i = 0; i < kernels.size(); ++i) EXPECT_TRUE(torch::equal(kernels[i], ops[i])) << "output " << i;
}

TEST(Fp8Cuda, NormAndSwigluKernelsWriteTheirOutputsAmax) {
  if (no_gpu()) GTEST_SKIP() << "no CUDA device (or libtorch without CUDA)";
  nn::fp8_amax_from_producers() = true;
  nn::ProducedAmax& notes = nn::produced_amax();
  torch::manual_seed(14);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16})
    for (auto sizes : {std::vector<int64_t>{7, 45}, std::vector<int64_t>{4099, 257}, std::vector<int64_t>{3, 64, 512}})
      for (bool with_nan : {false, true}) {
        const auto what = ::testing::Message() << dtype << " " << torch::IntArrayRef(sizes) << (with_nan ? " with a NaN" : "");
        torch::Tensor x = (torch::randn(sizes) * 3).to(dtype);
        if (with_nan) x.view({-1})[x.numel() / 3] = NAN;
        const torch::Tensor r = torch::randn(sizes).to(dtype), w = (torch::rand({sizes.back()}) + 0.5).to(dtype);
        using Op = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;
        namespace fd = nn::fused_detail;
        const auto norm_dx = [](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& g) {
          const fd::RmsForward f = fd::rms_norm_forward(a, b, g, 1e-5);  // backward of the sum, with b as the sum's own gradient
          return fd::rms_norm_backward(f.sum, g, f.rrms.view({-1}), a * 0.5, b, true).first;
        };
        const std::vector<std::pair<const char*, Op>> ops = {
            {"rms_norm", [](auto& a, auto&, auto& g) { return nn::fused_rms_norm(a, g); }},
            {"add + rms_norm", [](auto& a, auto& b, auto& g) { return nn::fused_add_rms_norm(a, b, g).second; }},
            {"swiglu", [](auto& a, auto& b, auto&) { return nn::fused_swiglu(a, b); }},
            {"rms_norm backward, dx", norm_dx},
            {"swiglu backward, dg", [](auto& a, auto& b, auto&) { return fd::swiglu_backward(a, b, a - b).first; }},
            {"swiglu backward, du", [](auto& a, auto& b, auto&) { return fd::swiglu_backward(a, b, a - b).second; }}};
        for (const auto& [name, op] : ops) {
          const torch::Tensor on_gpu = op(x.cuda(), r.cuda(), w.cuda());
          const torch::Tensor gpu_amax = notes.of(on_gpu);
          ASSERT_TRUE(gpu_amax.defined() && gpu_amax.is_cuda()) << name << " " << what;
          // the kernels' own outputs (the twins' round differently in the last place: tests/fused)
          const float got = gpu_amax.item<float>(), want = on_gpu.abs().max().to(torch::kFloat32).item<float>();
          EXPECT_TRUE(got == want || (std::isnan(got) && std::isnan(want))) << name << " " << what << ": " << got << " vs " << want;
          const int64_t used = notes.used;
          const nn::Fp8Operand gpu = nn::to_fp8(on_gpu, torch::kFloat8_e4m3fn, nn::Fp8Layout::both);
          EXPECT_EQ(notes.used, used + 1) << name << " " << what;
          const nn::Fp8Operand cpu = nn::to_fp8_twin(on_gpu.cpu(), torch::kFloat8_e4m3fn, nn::Fp8Layout::both);
          EXPECT_TRUE(torch::equal(gpu.values.cpu().view(torch::kUInt8), cpu.values.view(torch::kUInt8))) << name << " " << what;
          EXPECT_TRUE(torch::equal(gpu.transposed.cpu().view(torch::kUInt8), cpu.transposed.view(torch::kUInt8))) << name << " " << what;
          EXPECT_EQ(gpu.inverse_scale.item<float>(), cpu.inverse_scale.item<float>()) << name << " " << what;
        }
      }
  notes.clear();
}

}  // namespace
