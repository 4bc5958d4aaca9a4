// AdamW with 8-bit state: the CUDA launcher (adamw8.cuh) against its CPU twin (adamw8.hpp). Label `cuda`;
// skips without a device (argument checks run everywhere).
// Bitwise equal to the CPU twin (weights, params, codes, block scales): adamw_element writes its multiply-adds as
// fmaf and the bias correction uses plain multiplications (adamw.hpp), so nvcc's contraction does not make the kernel
// differ (before: ~2e-5 relative on a weight after the update's cancellation, then a half param one subnormal step
// apart); both encode by bucket_code over tables built by bucket_entry, decode by the same value table, and IEEE
// division and square root (no fast-math) round the same. Checked for every P/G pair and ragged sizes (the 16-byte
// path and the element path of the last partial block), buffers at odd offsets (the element path throughout), 20
// steps in a row through a table, and gradients with zero blocks, huge and tiny values, infinities and NaNs (there a
// NaN weight matches any NaN: which NaN an operation returns is left open by IEEE and differs between CPU and GPU).
// Every kernel shape (bench/kernels/adamw8_shapes.cuh's Shapes: the library's two and the ones kept for the comparison)
// runs every test: a typed suite, Adam8Cuda/<shape>.<test>; the sizes
// leave partial state blocks, partial chunks and warps with fewer blocks than their neighbours.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "squeeze/kernels/adamw.cuh"
#include "squeeze/kernels/adamw8.cuh"
#include "../../bench/kernels/adamw8_shapes.cuh"
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

// A device copy of a host vector starting `off` elements into its allocation (off = 1: no longer 16-byte aligned).
template <class T>
struct Shifted {
  Dev<T> buf;
  std::size_t off;
  Shifted(const std::vector<T>& h, std::size_t offset) : buf(h.size() + offset), off(offset) {
    if (!h.empty()) SQUEEZE_CUDA_CHECK(cudaMemcpy(buf.p + off, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  T* p() const { return buf.p + off; }
  std::vector<T> get() const {
    std::vector<T> h(buf.n - off);
    if (!h.empty()) SQUEEZE_CUDA_CHECK(cudaMemcpy(h.data(), buf.p + off, h.size() * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

template <class P, class G>
struct Device8 {
  Shifted<P> param;
  Shifted<float> master;
  Shifted<G> grad;
  Shifted<std::uint8_t> m, v;
  Shifted<float> ma, va;
  std::int64_t n;
  explicit Device8(const Host8<P, G>& h, std::size_t off = 0)
      : param(h.param, off),
        master(h.master, off),
        grad(h.grad, off),
        m(h.m, off),
        v(h.v, off),
        ma(h.m_absmax, off),
        va(h.v_absmax, off),
        n(h.n) {}
  sk::AdamW8Tensor<P, G> tensor() {
    return {param.p(), std::is_same_v<P, float> ? nullptr : master.p(), grad.p(), m.p(), ma.p(), v.p(), va.p(), n};
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

const std::vector<std::int64_t> kSizes8 = {
    1, 255, 257, 1000, (std::int64_t(1) << 14) + 5, (std::int64_t(1) << 16) + 37 * 256 + 100, (std::int64_t(1) << 20) + 3};

// The suite runs once per shape; names are the policies' with '_' for '-' (a '-' would split a --gtest_filter).
template <class Tuple>
struct GTestTypesOf;
template <class... Ts>
struct GTestTypesOf<std::tuple<Ts...>> {
  using type = ::testing::Types<Ts...>;
};
struct PolicyName {
  template <class Policy>
  static std::string GetName(int) {
    std::string s = Policy::name;
    std::replace(s.begin(), s.end(), '-', '_');
    return s;
  }
};
template <class Policy>
class Adam8Cuda : public ::testing::Test {};
TYPED_TEST_SUITE(Adam8Cuda, GTestTypesOf<squeeze::bench::adamw8::Shapes>::type, PolicyName);

TYPED_TEST(Adam8Cuda, FlatMatchesCpuTwinForEveryTypePairAndSize) {
  REQUIRE_DEVICE();
  using Policy = TypeParam;
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
      ASSERT_EQ(sk::adamw8_cuda<Policy>(d.tensor(), c, {dyn.p, dyn.p + 1, dyn.p + 2, step.p}), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      sk::adamw8_cpu(h.tensor(), c, {&inv, &no_inf, &clip, &applied});
      test::expect_state_bitwise(d.download(h), h, label);
    }
  });
}

TYPED_TEST(Adam8Cuda, TensorTableInOneLaunchOverManySteps) {
  REQUIRE_DEVICE();
  using Policy = TypeParam;
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
    ASSERT_EQ(sk::adamw8_cuda<Policy>(table.view(), c), cudaSuccess);
    sk::adamw8_cpu(std::span<const sk::AdamW8Tensor<P, G>>(ht), c);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (std::size_t k = 0; k < host.size(); ++k)
    test::expect_state_bitwise(dev[k]->download(host[k]), host[k], "tensor " + std::to_string(k));
}

// Buffers one element past an aligned address: every block takes the element path, still bitwise.
TYPED_TEST(Adam8Cuda, BuffersAtOddOffsetsMatchCpuTwinBitwise) {
  REQUIRE_DEVICE();
  using Policy = TypeParam;
  std::mt19937 rng(304);
  test::for_each_type_pair([&]<class P, class G>() {
    for (std::int64_t n : {std::int64_t(300), std::int64_t(40001)}) {
      const std::string label = std::string(dtype_name<P>()) + "/" + std::string(dtype_name<G>()) + " n=" + std::to_string(n) + " offset 1";
      Host8<P, G> h = random_state8<P, G>(n, rng);
      sk::adamw8_cpu(h.tensor(), sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 1));
      h.grad = test::random_vec<G>(n, rng, -1.f, 1.f);
      Device8<P, G> d(h, 1);
      const auto c = sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 2);
      ASSERT_EQ(sk::adamw8_cuda<Policy>(d.tensor(), c), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      sk::adamw8_cpu(h.tensor(), c);
      test::expect_state_bitwise(d.download(h), h, label);
    }
  });
}

// One table launch over aligned and odd-offset tensors with gradients that have zero blocks, values 26 decades
// apart, denormals, 1e30 (v overflows), infinities and NaNs, three steps in a row.
TYPED_TEST(Adam8Cuda, AwkwardGradientsInATableMatchCpuTwin) {
  REQUIRE_DEVICE();
  using Policy = TypeParam;
  std::mt19937 rng(305);
  using P = bf16;
  using G = float;
  std::uniform_real_distribution<float> e(-20.f, 6.f), u(0.f, 1.f);
  auto awkward = [&](std::int64_t n) {
    std::vector<G> g(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      float x = std::exp2(e(rng)) * (u(rng) < 0.5f ? -1.f : 1.f);
      const float r = u(rng);
      if ((i / sk::kStateBlock) % 5 == 2)
        x = 0.f;
      else if (r < 0.05f)
        x = 0.f;
      else if (r < 0.06f)
        x = std::numeric_limits<float>::denorm_min() * 9.f;
      else if (r < 0.07f)
        x = 1e30f;
      else if (r < 0.071f)
        x = -std::numeric_limits<float>::infinity();
      else if (r < 0.072f)
        x = std::numeric_limits<float>::quiet_NaN();
      g[std::size_t(i)] = x;
    }
    return g;
  };
  std::vector<Host8<P, G>> host;
  const std::vector<std::int64_t> sizes = {777, 4096, 20000, 5};
  for (std::int64_t n : sizes) host.push_back(random_state8<P, G>(n, rng));
  for (int t = 1; t <= 3; ++t) {
    for (auto& h : host) h.grad = awkward(h.n);
    std::vector<std::unique_ptr<Device8<P, G>>> dev;
    std::vector<sk::AdamW8Tensor<P, G>> dt;
    for (std::size_t k = 0; k < host.size(); ++k) {
      dev.push_back(std::make_unique<Device8<P, G>>(host[k], k % 2));  // odd tensors at an odd offset
      dt.push_back(dev.back()->tensor());
    }
    sk::DeviceTensorTable<sk::AdamW8Tensor<P, G>> table(dt);
    const auto c = sk::adamw_coeffs(1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, t);
    ASSERT_EQ(sk::adamw8_cuda<Policy>(table.view(), c), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<Host8<P, G>> want = host;
    for (auto& h : want) sk::adamw8_cpu(h.tensor(), c);
    for (std::size_t k = 0; k < host.size(); ++k) {
      host[k] = dev[k]->download(host[k]);
      test::expect_state_bitwise(host[k], want[k], "step " + std::to_string(t) + " tensor " + std::to_string(k), /*nan_matches_nan=*/true);
      host[k] = want[k];  // the next step from the CPU's state (identical but for NaN bits)
    }
  }
}

TYPED_TEST(Adam8Cuda, SkippedStepLeavesEveryByteUnchanged) {
  REQUIRE_DEVICE();
  using Policy = TypeParam;
  std::mt19937 rng(303);
  Host8<half, half> h = random_state8<half, half>(5000, rng);
  sk::adamw8_cpu(h.tensor(), sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 1));
  Device8<half, half> d(h);
  Dev<float> dyn(std::vector<float>{1.f, 1.f});  // inv_scale, found_inf != 0
  ASSERT_EQ(
      sk::adamw8_cuda<Policy>(d.tensor(), sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 2), {dyn.p, dyn.p + 1, nullptr, nullptr}),
      cudaSuccess);
  test::expect_state_bitwise(d.download(h), h, "skipped step on the GPU");
}

TEST(Adam8CudaArgs, BadInputGivesClearErrors) {
  const auto c = sk::adamw_coeffs(1e-3f, 0.9f, 0.999f, 1e-8f, 0.f, 1);
  float* fake = reinterpret_cast<float*>(std::uintptr_t(256));
  auto* codes = reinterpret_cast<std::uint8_t*>(fake);
  test::expect_error(
      [&] {
        (void)sk::adamw8_cuda(sk::AdamW8Tensor<float, float>{fake, nullptr, fake, codes, nullptr, codes, fake, 10}, c);
      },
      "block scales");
  test::expect_error(
      [&] {
        (void)sk::adamw8_cuda(sk::TensorTable<sk::AdamW8Tensor<float, float>>{nullptr, nullptr, 3, 5}, c);
      },
      "tensor table has null entries");
}

}  // namespace
