// NF4 CUDA launchers against the CPU twin (label cuda; skips without a device).
// Tolerance: none. Dequantise and quantise apply the same element functions (explicit fmaf for absmax'),
// so outputs are bit-identical; the one exception is the DoubleQuant mean (float64 sums in another order),
// which may differ in its last bit: then the device codes are checked against a CPU encode that uses the
// device's own offset and scales, again exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <squeeze/error.hpp>
#include <squeeze/kernels/quant/nf4.cuh>
#include <squeeze/quant/nf4.hpp>

#include "../cuda_buffer.hpp"

using namespace squeeze;
namespace kq = squeeze::kernels::quant;

namespace {
using test::Dev;

template <class T>
std::vector<T> normal_weights(std::int64_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 0.02f);
  std::vector<T> w(static_cast<std::size_t>(n));
  for (auto& v : w) v = from_float<T>(nd(rng));
  return w;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

const std::int64_t kSizes[] = {1, 63, 64 * 1000 + 17, 64 * 256 * 5, 3 * 1000 * 1001};
}  // namespace

template <class T>
class Nf4Cuda : public ::testing::Test {};
using Elements = ::testing::Types<float, bf16, half>;
TYPED_TEST_SUITE(Nf4Cuda, Elements);

TYPED_TEST(Nf4Cuda, DequantizeMatchesTwinBitForBit) {
  REQUIRE_DEVICE();
  using T = TypeParam;
  for (const bool dq : {false, true})
    for (const std::int64_t n : kSizes) {
      const auto w = normal_weights<float>(n, std::uint32_t(n));
      const auto p = quant::nf4_quantize(w.data(), n, {.block = 64, .double_quant = dq});
      std::vector<T> twin(static_cast<std::size_t>(n));
      quant::nf4_dequantize(p, twin.data());
      Dev<std::uint8_t> codes(p.codes);
      Dev<float> absmax(p.absmax), scale(p.absmax_scale);
      Dev<std::int8_t> absmax_q(p.absmax_q);
      Dev<T> out(static_cast<std::size_t>(n));
      kq::Nf4View v = p.view();
      v.codes = codes.p;
      v.absmax = dq ? nullptr : absmax.p;
      v.absmax_q = dq ? absmax_q.p : nullptr;
      v.absmax_scale = dq ? scale.p : nullptr;
      SQUEEZE_CUDA_CHECK(kq::nf4_dequantize_cuda(v, out.p));
      SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(same_bits(out.get(), twin)) << "n=" << n << " dq=" << dq;
    }
}

TYPED_TEST(Nf4Cuda, QuantizeMatchesTwin) {
  REQUIRE_DEVICE();
  using T = TypeParam;
  for (const bool dq : {false, true})
    for (const std::int64_t n : kSizes) {
      const auto w = normal_weights<T>(n, std::uint32_t(n + 5));
      const auto p = quant::nf4_quantize(w.data(), n, {.block = 64, .double_quant = dq});
      const std::int64_t blocks = p.blocks();
      Dev<T> dw(w);
      Dev<std::uint8_t> codes(p.codes.size());
      Dev<float> absmax(static_cast<std::size_t>(blocks)), scale(static_cast<std::size_t>(kq::nf4_dq_groups(blocks))), offset(1);
      Dev<std::int8_t> absmax_q(static_cast<std::size_t>(blocks));
      float dev_offset = 0.f;
      SQUEEZE_CUDA_CHECK(kq::nf4_quantize_cuda(dw.p, n, 64, dq, {codes.p, absmax.p, absmax_q.p, scale.p, offset.p}, &dev_offset));
      SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
      if (!dq) {
        EXPECT_TRUE(same_bits(absmax.get(), p.absmax)) << "n=" << n;
        EXPECT_TRUE(same_bits(codes.get(), p.codes)) << "n=" << n;
        continue;
      }
      EXPECT_NEAR(dev_offset, p.absmax_offset, 1e-6f * p.absmax_offset) << "n=" << n;
      if (dev_offset == p.absmax_offset) {
        EXPECT_TRUE(same_bits(absmax_q.get(), p.absmax_q)) << "n=" << n;
        EXPECT_TRUE(same_bits(scale.get(), p.absmax_scale)) << "n=" << n;
        EXPECT_TRUE(same_bits(codes.get(), p.codes)) << "n=" << n;
      } else {  // re-encode on the CPU with the device's scales: the codes must agree exactly
        quant::Nf4Packed d = p;
        d.absmax_q = absmax_q.get();
        d.absmax_scale = scale.get();
        d.absmax_offset = dev_offset;
        std::vector<std::uint8_t> ref(p.codes.size());
        kq::nf4_encode_cpu(d.view(), w.data(), ref.data());
        EXPECT_TRUE(same_bits(codes.get(), ref)) << "n=" << n;
      }
    }
}

TEST(Nf4CudaErrors, BadArgumentsAreClearErrors) {
  // Argument checks run before any CUDA call, so this runs without a device too.
  kq::Nf4View v;
  float* out = nullptr;
  EXPECT_THROW(kq::nf4_dequantize_cuda(v, out), squeeze::Error);
  EXPECT_THROW(kq::nf4_quantize_cuda(static_cast<const float*>(nullptr), 100, 48, false, {}), squeeze::Error);
  try {
    kq::nf4_quantize_cuda(static_cast<const float*>(nullptr), 0, 64, false, {});
    ADD_FAILURE() << "no error for n = 0";
  } catch (const squeeze::Error& e) {
    EXPECT_NE(std::string(e.what()).find("at least one value"), std::string::npos) << e.what();
  }
}
