// NF4 CUDA launchers against the CPU twin (label cuda; skips without a device).
// Tolerance: none. Dequantise and quantise apply the same element functions (absmax' as a rounded product then a
// rounded sum on both sides), so outputs are bit-identical; the one exception is the DoubleQuant mean (float64 sums
// in another order), which may differ in its last bit: then the device's nested statistics are checked against the
// CPU's DoubleQuant of the same absmax with the device's own offset, again exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

// The device's dequantisation of n random weights (block `block`, out `shift` elements past an aligned address)
// against the twin's, byte for byte.
template <class T>
void expect_dequantize_matches_twin(std::int64_t n, int block, bool dq, std::size_t shift) {
  const auto w = normal_weights<float>(n, std::uint32_t(n + block));
  const auto p = quant::nf4_quantize(w.data(), n, {.block = block, .double_quant = dq});
  std::vector<T> twin(static_cast<std::size_t>(n));
  quant::nf4_dequantize(p, twin.data());
  Dev<std::uint8_t> codes(p.codes), absmax_code(p.absmax_code);
  Dev<float> absmax(p.absmax), nested(p.nested_absmax), map(p.nested_map), offset(std::vector<float>{p.absmax_offset});
  Dev<T> out(static_cast<std::size_t>(n) + shift);
  kq::Nf4View v = p.view();
  v.codes = codes.p;
  v.absmax = dq ? nullptr : absmax.p;
  v.absmax_code = dq ? absmax_code.p : nullptr;
  v.nested_absmax = dq ? nested.p : nullptr;
  v.nested_map = dq ? map.p : nullptr;
  v.absmax_offset = dq ? offset.p : nullptr;
  SQUEEZE_CUDA_CHECK(kq::nf4_dequantize_cuda(v, out.p + shift));
  SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<T> got = out.get();
  got.erase(got.begin(), got.begin() + std::ptrdiff_t(shift));
  EXPECT_TRUE(same_bits(got, twin)) << "n=" << n << " block=" << block << " dq=" << dq << " shift=" << shift;
}

TYPED_TEST(Nf4Cuda, DequantizeMatchesTwinBitForBit) {
  REQUIRE_DEVICE();
  for (const bool dq : {false, true})
    for (const std::int64_t n : kSizes) expect_dequantize_matches_twin<TypeParam>(n, 64, dq, 0);
}

// Both kernels: sixteen values a thread where blocks hold whole groups of 16 and the output is 16-byte aligned (with
// the last n % 16 values apart), one code byte a thread otherwise (blocks of 8, a shifted output, n < 16).
TYPED_TEST(Nf4Cuda, DequantizeEveryPathMatchesTwin) {
  REQUIRE_DEVICE();
  for (const bool dq : {false, true})
    for (const int block : {8, 16, 32, 256})
      for (const std::size_t shift : {0, 1})
        for (const std::int64_t n : {7, 16, 31, 256 * 3 + 9, 4096 * 7 + 16}) expect_dequantize_matches_twin<TypeParam>(n, block, dq, shift);
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
      Dev<std::uint8_t> codes(p.codes.size()), absmax_code(static_cast<std::size_t>(blocks));
      Dev<float> absmax(static_cast<std::size_t>(blocks)), nested(static_cast<std::size_t>(kq::nf4_dq_groups(blocks))), offset(1);
      const Dev<float> map(std::vector<float>(quant::bnb_dynamic_map().begin(), quant::bnb_dynamic_map().end()));
      SQUEEZE_CUDA_CHECK(kq::nf4_quantize_cuda(dw.p, n, 64, dq,
                                               {.codes = codes.p,
                                                .absmax = absmax.p,
                                                .absmax_code = absmax_code.p,
                                                .nested_absmax = nested.p,
                                                .nested_map = map.p,
                                                .absmax_offset = offset.p}));
      SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(same_bits(codes.get(), p.codes)) << "n=" << n << " (the codes come from the exact absmax in both modes)";
      if (!dq) {
        EXPECT_TRUE(same_bits(absmax.get(), p.absmax)) << "n=" << n;
        continue;
      }
      const float dev_offset = offset.get()[0];
      EXPECT_NEAR(dev_offset, p.absmax_offset, 1e-6f * p.absmax_offset) << "n=" << n;
      std::vector<std::uint8_t> ref_code = p.absmax_code;
      std::vector<float> ref_nested = p.nested_absmax;
      if (dev_offset != p.absmax_offset)  // the CPU's nested statistics from the device's offset
        kq::nf4_nested_quantize_cpu(absmax.get().data(), blocks, p.nested_map.data(), dev_offset, ref_code.data(), ref_nested.data());
      EXPECT_TRUE(same_bits(absmax_code.get(), ref_code)) << "n=" << n;
      EXPECT_TRUE(same_bits(nested.get(), ref_nested)) << "n=" << n;
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
