// CPU twins of the quant kernels against dequantize + matmul in float64. Tolerances (stated per case):
//   dequantize: the float result is exact (same formula); fp16/bf16 outputs within half an ulp
//   gemv (fp32 accumulate): 1e-5 * sum|x w| + half an ulp of the output type
//   3/4/8-bit tensor-core GEMM twin (double accumulate, exact q - z): 1e-9 * sum|x w| + half an ulp of the output type
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <squeeze/kernels/quant/dequant.cuh>
#include <squeeze/kernels/quant/gemm/cpu.hpp>
#include <squeeze/kernels/quant/gemm/decode.hpp>
#include <squeeze/quant/tiles.hpp>
#include <squeeze/quant/rtn.hpp>

#include "random_layer.hpp"

using namespace squeeze;
namespace kq = squeeze::kernels::quant;

namespace {
using test::random_layer;
using test::random_x;
kq::GptqView view(const quant::PackedLinear& p) {
  return {p.qweight.data(), p.qzeros.data(), p.scales.data(), p.g_idx.data(), p.in, p.out, p.bits};
}
template <class T>
double half_ulp(double y) {
  const int mant = std::is_same_v<T, float> ? 24 : std::is_same_v<T, half> ? 11 : 8;
  return std::ldexp(std::abs(y), -mant) + 1e-30;
}
// reference y [M, out] and sum |x||w| per output, float64
template <class T>
void reference(const quant::PackedLinear& p, const std::vector<T>& x, std::int64_t M, std::vector<double>& y, std::vector<double>& mag) {
  const auto w = quant::dequantize(p);
  y.assign(M * p.out, 0.0);
  mag.assign(M * p.out, 0.0);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t o = 0; o < p.out; ++o)
      for (std::int64_t i = 0; i < p.in; ++i) {
        const double xv = to_float(x[m * p.in + i]), wv = w[o * p.in + i];
        y[m * p.out + o] += xv * wv;
        mag[m * p.out + o] += std::abs(xv * wv);
      }
}
}  // namespace

class DequantTwin : public ::testing::TestWithParam<int> {};
TEST_P(DequantTwin, MatchesFormulaAllDtypes) {
  const int bits = GetParam();
  for (auto [out, in, group, ao] : {std::tuple{37, 100, 32, false}, std::tuple{16, 96, 32, true}, std::tuple{5, 33, 0, false}}) {
    const auto p = random_layer(out, in, bits, group, ao, 100 + bits);
    const auto ref = quant::dequantize(p);
    std::vector<float> wf(out * in);
    std::vector<half> wh(out * in);
    std::vector<bf16> wb(out * in);
    kq::dequantize_cpu(view(p), wf.data());
    kq::dequantize_cpu(view(p), wh.data());
    kq::dequantize_cpu(view(p), wb.data());
    for (std::size_t k = 0; k < ref.size(); ++k) {
      ASSERT_EQ(wf[k], ref[k]);
      ASSERT_LE(std::abs(to_float(wh[k]) - ref[k]), half_ulp<half>(ref[k]));
      ASSERT_LE(std::abs(to_float(wb[k]) - ref[k]), half_ulp<bf16>(ref[k]));
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Bits, DequantTwin, ::testing::Values(2, 3, 4, 8));

class GemvTwin : public ::testing::TestWithParam<int> {};
TEST_P(GemvTwin, MatchesFloat64Matmul) {
  const int bits = GetParam();
  const std::int64_t out = 45, in = 160, M = 3;
  const auto p = random_layer(out, in, bits, 32, bits == 3, 7 + bits);
  const auto x = random_x<bf16>(M * in, 11);
  std::vector<bf16> y(M * out);
  kq::gemv_cpu(view(p), x.data(), y.data(), M);
  std::vector<double> ref, mag;
  reference(p, x, M, ref, mag);
  for (std::int64_t k = 0; k < M * out; ++k) ASSERT_LE(std::abs(to_float(y[k]) - ref[k]), 1e-5 * mag[k] + half_ulp<bf16>(ref[k])) << k;
}
INSTANTIATE_TEST_SUITE_P(Bits, GemvTwin, ::testing::Values(2, 3, 4, 8));

struct GemmCase {
  std::int64_t M, N, K;
  int group;
  bool act_order;
  int bits;
};
template <class T>
void check_qgemm(const GemmCase& c) {
  const auto p = random_layer(c.N, c.K, c.bits, c.group, c.act_order, std::uint32_t(c.M * 7 + c.N * 3 + c.K + c.bits));
  const auto t = quant::to_tiles(p);
  EXPECT_EQ(t.perm.empty(), !c.act_order);
  const auto x = random_x<T>(c.M * c.K, 5);
  // the kernel reads x in kernel row order: gather x[:, perm] as the torch layer does
  std::vector<T> xg = x;
  if (!t.perm.empty())
    for (std::int64_t m = 0; m < c.M; ++m)
      for (std::int64_t k = 0; k < c.K; ++k) xg[m * c.K + k] = x[m * c.K + t.perm[k]];
  std::vector<T> y(c.M * c.N);
  kq::qgemm_cpu(xg.data(), t.tiles.data(), t.scales.data(), t.zeros.data(), y.data(), t.shape(c.M));
  std::vector<double> ref, mag;
  reference(p, x, c.M, ref, mag);
  for (std::int64_t k = 0; k < c.M * c.N; ++k)
    ASSERT_LE(std::abs(double(to_float(y[k])) - ref[k]), 1e-9 * mag[k] + half_ulp<T>(ref[k]))
        << "bits " << c.bits << " M " << c.M << " N " << c.N << " K " << c.K << " group " << c.group << " at " << k;
}
class QGemmTwin : public ::testing::TestWithParam<GemmCase> {};
TEST_P(QGemmTwin, Fp16MatchesFloat64) { check_qgemm<half>(GetParam()); }
TEST_P(QGemmTwin, Bf16MatchesFloat64) { check_qgemm<bf16>(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Shapes, QGemmTwin,
                         ::testing::Values(GemmCase{1, 8, 64, 32, false, 4}, GemmCase{5, 40, 200, 32, false, 4},
                                           GemmCase{19, 100, 264, 64, true, 4}, GemmCase{3, 24, 130, 0, false, 4},
                                           GemmCase{2, 70, 256, 128, true, 4}, GemmCase{33, 17, 96, 16, false, 4},
                                           GemmCase{1, 8, 64, 32, false, 8}, GemmCase{5, 40, 200, 32, true, 8},
                                           GemmCase{19, 100, 264, 0, false, 8}, GemmCase{33, 17, 96, 16, false, 8},
                                           GemmCase{1, 8, 64, 32, false, 3}, GemmCase{5, 40, 200, 32, true, 3},
                                           GemmCase{19, 100, 264, 0, false, 3}, GemmCase{8, 300, 520, 128, false, 3}));

TEST(QTiles, TileCoordIsABijectionOntoTheTile) {
  for (int bits : {4, 8}) {
    std::vector<int> seen(64 * 16, 0);
    for (int lane = 0; lane < 32; ++lane)
      for (int w = 0; w < kq::lane_words(bits); ++w)
        for (int p = 0; p < 32 / bits; ++p) {
          const auto c = kq::tile_coord(bits, lane, w, p);
          ASSERT_TRUE(c.k >= 0 && c.k < 64 && c.n >= 0 && c.n < 16);
          ++seen[c.k * 16 + c.n];
        }
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int v) { return v == 1; })) << bits;
  }
}
TEST(QTiles, ThreeBitLayoutUsesEveryCodeAndEveryBitOnce) {
  std::vector<int> seen(64 * 16, 0), bit_used(96 * 32, 0);
  for (int lane = 0; lane < 32; ++lane)
    for (int q = 0; q < 16; ++q)
      for (int e = 0; e < 2; ++e) {
        const auto c = kq::tile3_coord(lane, q, e);
        ASSERT_TRUE(c.k >= 0 && c.k < 64 && c.n >= 0 && c.n < 16);
        ++seen[c.k * 16 + c.n];
        for (int b = 0; b < 3; ++b) {
          const auto pos = kq::tile3_bit(q, e, b);
          ASSERT_TRUE(pos.word >= 0 && pos.word < 3 && pos.bit >= 0 && pos.bit < 32);
          ++bit_used[(32 * pos.word + lane) * 32 + pos.bit];
        }
      }
  EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int v) { return v == 1; }));
  EXPECT_TRUE(std::all_of(bit_used.begin(), bit_used.end(), [](int v) { return v == 1; }));
  // the decode pattern of every pair reads back the codes placed there
  std::mt19937 rng(3);
  for (int rep = 0; rep < 20; ++rep) {
    std::uint32_t w[3] = {0, 0, 0};
    int code[16][2];
    for (int q = 0; q < 16; ++q)
      for (int e = 0; e < 2; ++e) {
        code[q][e] = int(rng() % 8);
        for (int b = 0; b < 3; ++b) {
          const auto pos = kq::tile3_bit(q, e, b);
          w[pos.word] |= std::uint32_t((code[q][e] >> b) & 1) << pos.bit;
        }
      }
    for (int q = 0; q < 16; ++q)
      for (int e = 0; e < 2; ++e) {
        const auto f16 = kq::magic3_pair<half>(w[0], w[1], w[2], q), b16 = kq::magic3_pair<bf16>(w[0], w[1], w[2], q);
        EXPECT_EQ(kq::magic_value_minus_zero<half>(std::uint16_t(f16 >> (16 * e)), 0, 2), float(code[q][e] - 2)) << q << " " << e;
        EXPECT_EQ(kq::magic_value_minus_zero<bf16>(std::uint16_t(b16 >> (16 * e)), 0, 5), float(code[q][e] - 5)) << q << " " << e;
      }
  }
}

TEST(QTiles, ZeroScaleGroupIsExactlyZero) {
  // each group's integer sum is multiplied by its scale: a zero scale gives exactly zero weights
  for (int bits : {3, 4, 8}) {
    auto p = random_layer(24, 96, bits, 32, true, 5);
    p.scales[1 * p.out + 5] = from_float<half>(0.f);
    const auto t = quant::to_tiles(p);
    const auto x = random_x<half>(3 * 96, 8);
    std::vector<half> xg = x;
    for (std::int64_t m = 0; m < 3; ++m)
      for (std::int64_t k = 0; k < 96; ++k) xg[m * 96 + k] = x[m * 96 + t.perm[k]];
    std::vector<half> y(3 * 24);
    kq::qgemm_cpu(xg.data(), t.tiles.data(), t.scales.data(), t.zeros.data(), y.data(), t.shape(3));
    std::vector<double> ref, mag;
    reference(p, x, 3, ref, mag);  // dequantize(): scale 0 -> those weights are 0
    for (std::size_t k = 0; k < y.size(); ++k)
      ASSERT_LE(std::abs(double(to_float(y[k])) - ref[k]), 1e-9 * mag[k] + half_ulp<half>(ref[k])) << k;
  }
}

TEST(QTiles, RejectsWhatTheKernelCannotServe) {
  EXPECT_THROW(quant::to_tiles(random_layer(8, 64, 2, 32, false, 1)), Error);  // 2 bits
  EXPECT_THROW(quant::to_tiles(random_layer(8, 64, 4, 8, false, 1)), Error);   // group 8
  auto p = random_layer(8, 64, 4, 32, false, 1);
  p.g_idx[0] = 1;  // group 1 now has 33 rows
  EXPECT_THROW(quant::to_tiles(p), Error);
}
