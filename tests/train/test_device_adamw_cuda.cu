// train::Trainer with its optimizer state on CUDA tensors in an nvcc translation unit, where the device update is the
// CUDA kernel (fp32 moments: kernels/adamw.cuh through engine::detail::adamw_device_update; 8-bit:
// kernels/adamw8.cuh through adamw8_device_update), not torch ops. Label cuda; skips without a device or without
// libtorch's CUDA side.
//   * each update helper on device tensors against its CPU launcher (kernels::adamw_cpu, adamw8_cpu) on host copies:
//     bitwise (the kernels are the CPU twins' arithmetic: tests/kernels/), bf16 params with fp32 masters and float
//     params, bf16 and fp32 gradients, a ragged size, buffers that start off a 16-byte boundary (the kernels' scalar
//     path), with an inverse loss scale and a clip coefficient;
//   * the gradients' sum of squares (engine::sum_squares_tensor: the gradient-norm kernels in an nvcc TU) against the
//     float64 sum, float / bf16 / half, ragged sizes, a buffer off a 16-byte boundary; NaN and infinity propagate;
//   * the trainer on CUDA against the same run on the CPU, fp32 and 8-bit moments: the loss falls by > 10% and the
//     mean of the last 5 steps is within 3% of the CPU run's (the forward and backward differ: cuBLAS against the
//     CPU's GEMMs).
#include "zero_common.hpp"

#include <squeeze/kernels/adamw.hpp>
#include <squeeze/kernels/adamw8.hpp>
#include <squeeze/engine/device_adamw.hpp>
#include <squeeze/engine/offload.hpp>

namespace {

using namespace zero_test;
namespace sk = squeeze::kernels;

#define REQUIRE_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device (or a libtorch without CUDA)"

template <class G>
void expect_device_update_bitwise(torch::ScalarType grad_dtype) {
  torch::manual_seed(11);
  const int64_t n = 70001;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  torch::Tensor master = torch::randn({n}, f32) * 0.5, param = master.to(torch::kBFloat16),
                grad = (torch::randn({n}, f32) * 1e-2).to(grad_dtype);
  torch::Tensor mc = torch::randint(0, 256, {n}, torch::kUInt8), vc = torch::randint(0, 256, {n}, torch::kUInt8);
  torch::Tensor ma = torch::rand({sk::state_blocks(n)}, f32) * 0.1, va = torch::rand({sk::state_blocks(n)}, f32) * 0.01;
  const float values[2] = {0.25f, 0.75f};  // inverse loss scale, clip coefficient
  const auto c = sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 3);
  const torch::Device dev(torch::kCUDA);
  auto on = [&](const torch::Tensor& t) { return t.to(dev).contiguous(); };
  torch::Tensor dp = on(param), dm = on(master), dmc = on(mc), dma = on(ma), dvc = on(vc), dva = on(va);
  engine::detail::adamw8_device_update<bf16, G>(dp, dm, on(grad), dmc, dma, dvc, dva,
                                                on(torch::from_blob(const_cast<float*>(values), {2}, f32)), c);
  const sk::AdamWDynamic d{&values[0], nullptr, &values[1], nullptr};
  sk::adamw8_cpu(sk::AdamW8Tensor<bf16, G>{reinterpret_cast<bf16*>(param.data_ptr()), master.data_ptr<float>(),
                                           reinterpret_cast<const G*>(grad.data_ptr()), mc.data_ptr<std::uint8_t>(), ma.data_ptr<float>(),
                                           vc.data_ptr<std::uint8_t>(), va.data_ptr<float>(), n},
                 c, d);
  EXPECT_TRUE(torch::equal(dp.cpu(), param)) << "params";
  EXPECT_TRUE(torch::equal(dm.cpu(), master)) << "masters";
  EXPECT_TRUE(torch::equal(dmc.cpu(), mc)) << "m codes";
  EXPECT_TRUE(torch::equal(dvc.cpu(), vc)) << "v codes";
  EXPECT_TRUE(torch::equal(dma.cpu(), ma)) << "m absmax";
  EXPECT_TRUE(torch::equal(dva.cpu(), va)) << "v absmax";
}

// fp32 moments: P the parameter type (bf16 with an fp32 master, or float, its own), G the gradient's; `shift` elements
// dropped from the front of every buffer (1: none is 16-byte aligned, the kernel's scalar path).
template <class P, class G>
void expect_fp32_update_bitwise(torch::ScalarType param_dtype, torch::ScalarType grad_dtype, int64_t shift) {
  torch::manual_seed(12);
  const int64_t n = 70001;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  constexpr bool has_master = !std::is_same_v<P, float>;
  torch::Tensor master = (torch::randn({n + shift}, f32) * 0.5).narrow(0, shift, n);
  torch::Tensor param = master.to(param_dtype), grad = (torch::randn({n}, f32) * 1e-2).to(grad_dtype);
  torch::Tensor m = torch::randn({n}, f32) * 1e-3, v = torch::rand({n}, f32) * 1e-5;
  const float values[2] = {0.25f, 0.75f};  // inverse loss scale, clip coefficient
  const auto c = sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 3);
  const torch::Device dev(torch::kCUDA);
  auto on = [&](const torch::Tensor& t) {  // a device copy starting `shift` elements into its buffer
    return torch::empty({t.numel() + shift}, t.options().device(dev)).narrow(0, shift, t.numel()).copy_(t);
  };
  torch::Tensor dp = on(param), dm = has_master ? on(master) : torch::Tensor(), dg = on(grad), dmm = on(m), dv = on(v);
  engine::detail::adamw_device_update<P, G>(dp, dm, dg, dmm, dv, torch::from_blob(const_cast<float*>(values), {2}, f32).to(dev), c);
  const sk::AdamWDynamic d{&values[0], nullptr, &values[1], nullptr};
  const torch::Tensor pc = param.contiguous(), mc = master.contiguous(), gc = grad.contiguous();
  const sk::AdamWTensor<P, G> t{reinterpret_cast<P*>(pc.data_ptr()),
                                has_master ? mc.data_ptr<float>() : nullptr,
                                reinterpret_cast<const G*>(gc.data_ptr()),
                                m.data_ptr<float>(),
                                v.data_ptr<float>(),
                                n};
  sk::adamw_cpu(std::span<const sk::AdamWTensor<P, G>>(&t, 1), c, d);
  const std::string what =
      std::string(c10::toString(param_dtype)) + " params, " + c10::toString(grad_dtype) + " grads, shift " + std::to_string(shift);
  EXPECT_TRUE(torch::equal(dp.cpu(), pc)) << "params, " << what;
  if (has_master) EXPECT_TRUE(torch::equal(dm.cpu(), mc)) << "masters, " << what;
  EXPECT_TRUE(torch::equal(dmm.cpu(), m)) << "m, " << what;
  EXPECT_TRUE(torch::equal(dv.cpu(), v)) << "v, " << what;
}

TEST(AdamWTrainerCuda, Fp32StateUpdateIsTheCpuTwinBitwise) {
  REQUIRE_CUDA();
  for (const int64_t shift : {0, 1}) {
    expect_fp32_update_bitwise<bf16, bf16>(torch::kBFloat16, torch::kBFloat16, shift);
    expect_fp32_update_bitwise<bf16, float>(torch::kBFloat16, torch::kFloat32, shift);
    expect_fp32_update_bitwise<float, float>(torch::kFloat32, torch::kFloat32, shift);
  }
}

TEST(AdamWTrainerCuda, EightBitStateUpdateIsTheCpuTwinBitwise) {
  REQUIRE_CUDA();
  expect_device_update_bitwise<bf16>(torch::kBFloat16);
  expect_device_update_bitwise<float>(torch::kFloat32);
}

// The sum of squares the boundary's norm is taken from: within float64 rounding of the exact sum (|error| <= n 2^-52
// of it: every term is non-negative), one read of each value; NaN and infinity come through (the overflow check).
TEST(AdamWTrainerCuda, SumOfSquaresIsTheFloat64Sum) {
  REQUIRE_CUDA();
  torch::manual_seed(13);
  const torch::Device dev(torch::kCUDA);
  for (const auto dt : {torch::kFloat32, torch::kBFloat16, torch::kFloat16})
    for (const int64_t n : {int64_t(1), int64_t(4097), int64_t(3000001)})
      for (const int64_t shift : {0, 1}) {
        const torch::Tensor t = (torch::randn({n + shift}) * 3).to(dt).to(dev).narrow(0, shift, n);
        const double want = t.to(torch::kFloat64).square().sum().item<double>();
        const double got = engine::sum_squares_tensor(t).item<double>();
        EXPECT_NEAR(got, want, double(n) * std::ldexp(want, -52)) << c10::toString(dt) << " n " << n << " shift " << shift;
      }
  torch::Tensor g = torch::randn({70001}, torch::TensorOptions().device(dev));
  g[123] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(engine::sum_squares_tensor(g).item<double>()));
  g[456] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(engine::sum_squares_tensor(g).item<double>()));
}

// The trainer with state S on CUDA (the kernel path) against the same run on the CPU.
template <class S>
void expect_kernel_path_tracks_the_cpu_run(const char* what) {
  const Data data = make_data(Model::llama, 1, 2, 6);
  auto run = [&](torch::Device dev) {
    auto model = make_model(Model::llama, torch::kBFloat16);
    model->to(dev);
    auto trainer = zero_trainer<S>(model, Hyper{}, LocalComm::single());
    std::vector<double> losses;
    for (int s = 0; s < 30; ++s)
      losses.push_back(trainer.step([&] { return model_loss(Model::llama, *model, data.x[s % 2][0].to(dev), data.y[s % 2][0]); }).loss);
    for (const auto& part : trainer.optimizer_state())
      EXPECT_EQ(part[1].device().type(), dev.type()) << what << ": the state lives with the model";
    return losses;
  };
  auto mean = [](const std::vector<double>& l, std::size_t from, std::size_t to) {
    double s = 0;
    for (std::size_t i = from; i < to; ++i) s += l[i];
    return s / double(to - from);
  };
  const auto cpu = run(torch::kCPU), gpu = run(torch::Device(torch::kCUDA));
  const double first = mean(gpu, 0, 5), last = mean(gpu, 25, 30), cpu_last = mean(cpu, 25, 30);
  std::printf("CUDA %s (kernel): loss %.4f -> %.4f; CPU: %.4f\n", what, first, last, cpu_last);
  EXPECT_LT(last, 0.9 * first) << what;
  EXPECT_LE(std::abs(last - cpu_last), 0.03 * cpu_last) << what;
}

TEST(AdamWTrainerCuda, KernelPathTracksTheCpuRun) {
  REQUIRE_CUDA();
  expect_kernel_path_tracks_the_cpu_run<Strategy<Precision<bf16, float>>>("fp32 state");
  expect_kernel_path_tracks_the_cpu_run<Strategy<Precision<bf16, float>, QuantizedState<8>>>("8-bit state");
}

}  // namespace

int main(int argc, char** argv) {
  zero_test::reproducible_cpu_math();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
