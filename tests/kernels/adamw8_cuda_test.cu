// AdamW with 8-bit state: the CUDA launcher (adamw8.cuh) against its CPU twin (adamw8.hpp). Label `cuda`;
// skips without a device (argument checks run everywhere).
// One step from the same state: bitwise equal (weights, params, codes, block scales). adamw_element writes its
// multiply-adds as fmaf and the bias correction uses plain multiplications (adamw.hpp), so nvcc's contraction
// no longer makes the kernel differ from the CPU twin (before: ~2e-5 relative on a weight after the update's
// cancellation, then a half param one subnormal step apart). Checked for every P/G pair and ragged sizes.
// 20 steps in a row through tables (TensorTableInOneLaunchOverManySteps) keep their tolerances: weights within
// 2e-3 (lr 3e-3), absmax rel 1e-2, codes not compared.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "squeeze/kernels/adamw.cuh"
#include "squeeze/kernels/adamw8.cuh"
#include "adamw8_state.hpp"
#include "test_util.hpp"

#include "../cuda_buffer.hpp"

namespace sk = squeeze::kernels;
using namespace squeeze;

namespace {

using test::Dev;

// Host buffers of one tensor with 8-bit state: random weights (exact in P, so the master equals the parameter)
// and gradients, fresh moments.
template <class P, class G>
using Host8 = test::Adam8State<P, G>;
template <class P, class G>
Host8<P, G> random_state8(std::int64_t n, std::mt19937& rng) {
  std::vector<float> w0 = test::random_vec<float>(n, rng, -1.f, 1.f);
  for (float& w : w0) w = to_float(from_float<P>(w));
  Host8<P, G> h(n, w0);
  h.grad = test::random_vec<G>(n, rng, -1.f, 1.f);
  return h;
}

template <class P, class G>
struct Device8 {
  Dev<P> param;
  Dev<float> master;
  Dev<G> grad;
  Dev<std::uint8_t> m, v;
  Dev<float> ma, va;
  std::int64_t n;
  explicit Device8(const Host8<P, G>& h)
      : param(h.param), master(h.master), grad(h.grad), m(h.m), v(h.v), ma(h.m_absmax), va(h.v_absmax), n(h.n) {}
  sk::AdamW8Tensor<P, G> tensor() {
    return {param.p, std::is_same_v<P, float> ? nullptr : master.p, grad.p, m.p, ma.p, v.p, va.p, n};
  }
  Host8<P, G> download(const Host8<P, G>& like) const {
    Host8<P, G> h = like;
    h.param = param.get();
    if (!h.master.empty()) h.master = master.get();
    h.m = m.get();
    h.v = v.get();
    h.m_absmax = ma.get();
    h.v_absmax = va.get();
    return h;
  }
};

template <class P, class G>
void expect_close(const Host8<P, G>& gpu, const Host8<P, G>& cpu, double w_tol, double absmax_tol, double flip_share,
                  const std::string& label) {
  int bad = 0;
  std::int64_t flips = 0;
  for (std::size_t i = 0; i < std::size_t(cpu.n) && bad < 5; ++i) {
    const float wg = gpu.weight(i), wc = cpu.weight(i);
    const float pg = to_float(gpu.param[i]), pc = to_float(cpu.param[i]);
    const int dm = std::abs(int(gpu.m[i]) - int(cpu.m[i])), dv = std::abs(int(gpu.v[i]) - int(cpu.v[i]));
    flips += (dm != 0) + (dv != 0);
    const bool ok = std::abs(wg - wc) <= w_tol * std::max(1.f, std::abs(wc)) &&
                    (std::is_same_v<P, float> || std::abs(pg - pc) <= test::unit_roundoff<P>() * 2 * std::abs(pc) + 1e-30) &&
                    (flip_share >= 1 || (dm <= 1 && dv <= 1));
    if (!ok) {
      ++bad;
      ADD_FAILURE() << label << " i=" << i << " w gpu " << wg << " cpu " << wc << " param " << pg << " / " << pc << " m code "
                    << int(gpu.m[i]) << " / " << int(cpu.m[i]) << " v code " << int(gpu.v[i]) << " / " << int(cpu.v[i]);
    }
  }
  EXPECT_LE(double(flips), flip_share * double(2 * cpu.n) + 0.5) << label << ": codes that differ";
  for (std::size_t b = 0; b < cpu.m_absmax.size(); ++b) {
    ASSERT_LE(std::abs(gpu.m_absmax[b] - cpu.m_absmax[b]), absmax_tol * cpu.m_absmax[b] + 1e-30) << label << " m absmax, block " << b;
    ASSERT_LE(std::abs(gpu.v_absmax[b] - cpu.v_absmax[b]), absmax_tol * cpu.v_absmax[b] + 1e-30) << label << " v absmax, block " << b;
  }
}

const std::vector<std::int64_t> kSizes8 = {1, 255, 257, 1000, (std::int64_t(1) << 14) + 5, (std::int64_t(1) << 20) + 3};

TEST(Adam8Cuda, FlatMatchesCpuTwinForEveryTypePairAndSize) {
  REQUIRE_DEVICE();
  std::mt19937 rng(301);
  test::for_each_type_pair([&]<class P, class G>() {
    for (std::int64_t n : kSizes8) {
      const std::string label = std::string(dtype_name<P>()) + "/" + std::string(dtype_name<G>()) + " n=" + std::to_string(n);
      Host8<P, G> h = random_state8<P, G>(n, rng);
      // Non-trivial state from two CPU steps.
      sk::adamw8_cpu(h.tensor(), sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 1));
      h.grad = test::random_vec<G>(n, rng, -1.f, 1.f);
      sk::adamw8_cpu(h.tensor(), sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 2));
      h.grad = test::random_vec<G>(n, rng, -2.f, 2.f);
      Device8<P, G> d(h);
      // One step with unscale, clip and a device step counter on both sides.
      const float inv = 1.f / 4, clip = 0.75f, no_inf = 0.f;
      const std::int64_t applied = 2;
      Dev<float> dyn(std::vector<float>{inv, no_inf, clip});
      Dev<std::int64_t> step(std::vector<std::int64_t>{applied});
      const auto c = sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 1);
      ASSERT_EQ(sk::adamw8_cuda(d.tensor(), c, {dyn.p, dyn.p + 1, dyn.p + 2, step.p}), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      sk::adamw8_cpu(h.tensor(), c, {&inv, &no_inf, &clip, &applied});
      test::expect_state_bitwise(d.download(h), h, label);
    }
  });
}

TEST(Adam8Cuda, TensorTableInOneLaunchOverManySteps) {
  REQUIRE_DEVICE();
  std::mt19937 rng(302);
  using P = bf16;
  using G = bf16;
  std::vector<Host8<P, G>> host;
  for (std::int64_t n : {std::int64_t(3), std::int64_t(0), std::int64_t(40000), std::int64_t(256), std::int64_t(16389)})
    host.push_back(random_state8<P, G>(n, rng));
  std::vector<std::unique_ptr<Device8<P, G>>> dev;
  std::vector<sk::AdamW8Tensor<P, G>> dt, ht;
  for (auto& h : host) {
    dev.push_back(std::make_unique<Device8<P, G>>(h));
    dt.push_back(dev.back()->tensor());
  }
  sk::DeviceTensorTable<sk::AdamW8Tensor<P, G>> table(dt);
  for (auto& h : host) ht.push_back(h.tensor());
  for (int t = 1; t <= 20; ++t) {
    const auto c = sk::adamw_coeffs(3e-3f, 0.9f, 0.95f, 1e-8f, 0.05f, t);
    ASSERT_EQ(sk::adamw8_cuda(table.view(), c), cudaSuccess);
    sk::adamw8_cpu(std::span<const sk::AdamW8Tensor<P, G>>(ht), c);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (std::size_t k = 0; k < host.size(); ++k)
    expect_close(dev[k]->download(host[k]), host[k], 2e-3, 1e-2, 1.0, "tensor " + std::to_string(k));
}

TEST(Adam8Cuda, SkippedStepLeavesEveryByteUnchanged) {
  REQUIRE_DEVICE();
  std::mt19937 rng(303);
  Host8<half, half> h = random_state8<half, half>(5000, rng);
  sk::adamw8_cpu(h.tensor(), sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 1));
  Device8<half, half> d(h);
  Dev<float> dyn(std::vector<float>{1.f, 1.f});  // inv_scale, found_inf != 0
  ASSERT_EQ(sk::adamw8_cuda(d.tensor(), sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 2), {dyn.p, dyn.p + 1, nullptr, nullptr}),
            cudaSuccess);
  test::expect_state_bitwise(d.download(h), h, "skipped step on the GPU");
}

TEST(Adam8CudaArgs, BadInputGivesClearErrors) {
  const auto c = sk::adamw_coeffs(1e-3f, 0.9f, 0.999f, 1e-8f, 0.f, 1);
  float* fake = reinterpret_cast<float*>(std::uintptr_t(256));
  auto* codes = reinterpret_cast<std::uint8_t*>(fake);
  test::expect_error([&] { (void)sk::adamw8_cuda(sk::AdamW8Tensor<float, float>{fake, nullptr, fake, codes, nullptr, codes, fake, 10}, c); },
                     "block scales");
  test::expect_error([&] { (void)sk::adamw8_cuda(sk::TensorTable<sk::AdamW8Tensor<float, float>>{nullptr, nullptr, 3, 5}, c); },
                     "tensor table has null entries");
}

}  // namespace
