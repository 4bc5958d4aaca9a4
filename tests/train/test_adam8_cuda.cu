// train::Trainer with 8-bit optimizer state on CUDA tensors in an nvcc translation unit, where the device update is
// the CUDA kernel (kernels/adamw8.cuh through engine::detail::adamw8_device_update), not torch ops. Label cuda; skips
// without a device or without libtorch's CUDA side.
//   * the update helper on device tensors against kernels::adamw8_cpu on host copies: bitwise (the kernel is the CPU
//     twin's arithmetic: tests/kernels/adamw8_cuda_test.cu), bf16 params with fp32 masters, bf16 and fp32 gradients,
//     a ragged size, with an inverse loss scale and a clip coefficient;
//   * the trainer on CUDA against the same run on the CPU: the loss falls by > 10% and the mean of the last 5 steps
//     is within 3% of the CPU run's (the forward and backward differ: cuBLAS against the CPU's GEMMs).
#include "zero_common.hpp"

#include <squeeze/kernels/adamw8.hpp>
#include <squeeze/engine/adamw_torch_ops.hpp>

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

TEST(Adam8TrainerCuda, DeviceUpdateIsTheCpuTwinBitwise) {
  REQUIRE_CUDA();
  expect_device_update_bitwise<bf16>(torch::kBFloat16);
  expect_device_update_bitwise<float>(torch::kFloat32);
}

TEST(Adam8TrainerCuda, KernelPathTracksTheCpuRun) {
  REQUIRE_CUDA();
  using S = Strategy<Precision<bf16, float>, QuantizedState<8>>;
  const Data data = make_data(Model::llama, 1, 2, 6);
  auto run = [&](torch::Device dev) {
    auto model = make_model(Model::llama, torch::kBFloat16);
    model->to(dev);
    auto trainer = zero_trainer<S>(model, Hyper{}, LocalComm::single());
    std::vector<double> losses;
    for (int s = 0; s < 30; ++s)
      losses.push_back(trainer.step([&] { return model_loss(Model::llama, *model, data.x[s % 2][0].to(dev), data.y[s % 2][0]); }).loss);
    for (const auto& part : trainer.optimizer_state())
      EXPECT_EQ(part[1].device().type(), dev.type()) << "the 8-bit state lives with the model";
    return losses;
  };
  auto mean = [](const std::vector<double>& l, std::size_t from, std::size_t to) {
    double s = 0;
    for (std::size_t i = from; i < to; ++i) s += l[i];
    return s / double(to - from);
  };
  const auto cpu = run(torch::kCPU), gpu = run(torch::Device(torch::kCUDA));
  const double first = mean(gpu, 0, 5), last = mean(gpu, 25, 30), cpu_last = mean(cpu, 25, 30);
  std::printf("CUDA 8-bit state (kernel): loss %.4f -> %.4f; CPU: %.4f\n", first, last, cpu_last);
  EXPECT_LT(last, 0.9 * first);
  EXPECT_LE(std::abs(last - cpu_last), 0.03 * cpu_last);
}

}  // namespace

int main(int argc, char** argv) {
  zero_test::reproducible_cpu_math();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
