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
//   * the window's decisions on the device (TrainerOptions::read_loss off): the same parameters and norms, bit for bit,
//     as the run that reads the norm back and decides on the host, clipping on, at stages 0 and 3, fp32 and 8-bit
//     moments; no host sync in an optimizer step; a step with non-finite gradients skipped on the device, the
//     counters catching up when read;
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
  const torch::Tensor dyn = on(torch::from_blob(const_cast<float*>(values), {2}, f32));
  engine::detail::adamw8_device_update<bf16, G>(dp, dm, on(grad), dmc, dma, dvc, dva,
                                                {dyn.data_ptr<float>(), nullptr, dyn.data_ptr<float>() + 1, nullptr}, c);
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
  const torch::Tensor dyn = torch::from_blob(const_cast<float*>(values), {2}, f32).to(dev);
  engine::detail::adamw_device_update<P, G>(dp, dm, dg, dmm, dv, {dyn.data_ptr<float>(), nullptr, dyn.data_ptr<float>() + 1, nullptr}, c);
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

#if defined(SQUEEZE_TORCH_CUDA)  // count_host_syncs: libtorch's sync debug mode
// One run of the MLP on the GPU, 8 steps, clipping on; the loss of step `bad` (-1: none) made infinite, so its gradients
// are not finite. Returns the parameters after it, the boundary norms and the host syncs of steps 2 to 7.
struct DecidedRun {
  std::vector<torch::Tensor> params;
  std::vector<float> norms;
  std::vector<int> syncs;
  int64_t applied = 0, skipped = 0;
};
template <class S>
DecidedRun decided_run(bool read_loss, int bad) {
  const torch::Device dev(torch::kCUDA, 0);
  const Data data = make_data(Model::mlp, 1, 8, 8);
  auto m = make_model(Model::mlp, torch::kFloat32);
  m->to(dev);
  train::TrainerOptions o;
  o.read_loss = read_loss;
  auto t = zero_trainer<S>(m, AdamW{.lr = 1e-2f, .max_grad_norm = 0.05f}, LocalComm::single(), o);  // 0.05: every step clips
  std::vector<torch::Tensor> x, y;  // on the device before the steps: a blocking upload is a sync of its own
  for (int s = 0; s < 8; ++s) x.push_back(data.x[s][0].to(dev)), y.push_back(data.y[s][0].to(dev));
  DecidedRun out;
  for (int s = 0; s < 8; ++s) {
    train::StepResult r;
    const auto step = [&] {
      r = t.step([&] {
        const torch::Tensor loss = model_loss(Model::mlp, *m, x[s], y[s]);
        return s == bad ? loss * std::numeric_limits<float>::infinity() : loss;
      });
    };
    if (s >= 2)
      out.syncs.push_back(count_host_syncs(step));
    else
      step();
    out.norms.push_back(read_loss ? r.grad_norm : r.grad_norm_value.item<float>());
  }
  out.applied = t.steps_applied();
  out.skipped = t.steps_skipped();
  for (const auto& [name, v] : t.full_parameters()) out.params.push_back(v.to(torch::kCPU, torch::kFloat32));
  return out;
}

template <class S>
void expect_device_decisions_match(const std::string& what) {
  for (const int bad : {-1, 4}) {
    const std::string tag = what + (bad < 0 ? "" : ", a non-finite step");
    const DecidedRun host = decided_run<S>(true, bad), device = decided_run<S>(false, bad);
    ASSERT_EQ(host.params.size(), device.params.size()) << tag;
    for (std::size_t i = 0; i < host.params.size(); ++i)
      EXPECT_TRUE(torch::equal(host.params[i], device.params[i])) << tag << ": parameter " << i;
    for (std::size_t i = 0; i < host.norms.size(); ++i)
      EXPECT_TRUE(host.norms[i] == device.norms[i] || (std::isnan(host.norms[i]) && std::isnan(device.norms[i])) ||
                  (std::isinf(host.norms[i]) && std::isinf(device.norms[i])))
          << tag << ": norm " << i << " " << host.norms[i] << " against " << device.norms[i];
    for (const int n : device.syncs) EXPECT_EQ(n, 0) << tag << ": host syncs in a step that decided on the device";
    EXPECT_EQ(device.applied, host.applied) << tag;
    EXPECT_EQ(device.skipped, host.skipped) << tag;
    EXPECT_EQ(device.skipped, bad < 0 ? 0 : 1) << tag;
  }
}

TEST(AdamWTrainerCuda, DecisionsOnTheDeviceAreTheHostsWithoutASync) {
  REQUIRE_CUDA();
  expect_device_decisions_match<Strategy<Precision<bf16, float>>>("stage 0");
  expect_device_decisions_match<Strategy<Sharded<Stage3>, Precision<bf16, float>>>("stage 3");
  expect_device_decisions_match<Strategy<Precision<bf16, float>, QuantizedState<8>>>("8-bit state");
}
#endif

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
