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
#include <squeeze/kernels/quant/qgemm.cuh>
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
  for (std::int64_t k = 0; k < M * out; ++k)
    ASSERT_LE(std::abs(to_float(y[k]) - ref[k]), 1e-5 * mag[k] + half_ulp<bf16>(ref[k])) << k;
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
                         ::testing::Values(GemmCase{1, 8, 64, 32, false, 4}, GemmCase{5, 40, 200, 32, false, 4}, GemmCase{19, 100, 264, 64, true, 4},
                                           GemmCase{3, 24, 130, 0, false, 4}, GemmCase{2, 70, 256, 128, true, 4}, GemmCase{33, 17, 96, 16, false, 4},
                                           GemmCase{1, 8, 64, 32, false, 8}, GemmCase{5, 40, 200, 32, true, 8}, GemmCase{19, 100, 264, 0, false, 8},
                                           GemmCase{33, 17, 96, 16, false, 8}, GemmCase{1, 8, 64, 32, false, 3}, GemmCase{5, 40, 200, 32, true, 3},
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
    for (std::size_t k = 0; k < y.size(); ++k) ASSERT_LE(std::abs(double(to_float(y[k])) - ref[k]), 1e-9 * mag[k] + half_ulp<half>(ref[k])) << k;
  }
}

TEST(QTiles, RejectsWhatTheKernelCannotServe) {
  EXPECT_THROW(quant::to_tiles(random_layer(8, 64, 2, 32, false, 1)), Error);  // 2 bits
  EXPECT_THROW(quant::to_tiles(random_layer(8, 64, 4, 8, false, 1)), Error);   // group 8
  auto p = random_layer(8, 64, 4, 32, false, 1);
  p.g_idx[0] = 1;  // group 1 now has 33 rows
  EXPECT_THROW(quant::to_tiles(p), Error);
}

TEST(QGemmPlan, SplitsCoverKAndSharedMemoryHoldsTheBlock) {
  for (std::int64_t M : {1, 7, 16, 17, 64, 128})
    for (std::int64_t K : {64, 200, 4096, 11008})
      for (std::int64_t N : {16, 300, 4096, 28672})
        for (int group : {16, 128, 0})
          for (int rows : {8, 16, 32, 64})
            for (int cps_override : {0, 3, 64}) {
              const std::int64_t Kpad = kq::pad_to(K, 64), Npad = kq::pad_to(N, 16);
              const kq::QGemmShape s{M, N, K, Kpad, Npad, group > 0 ? group : Kpad, 4};
              const kq::QGemmGeometry g{rows, 64, 4, 0};
              const auto p = kq::plan_qgemm(s, g, 132, cps_override);
              const std::int64_t chunks = Kpad / 64;
              EXPECT_GE(std::int64_t(p.splits) * p.cps, chunks);          // K covered
              EXPECT_LT(std::int64_t(p.splits - 1) * p.cps, chunks);      // no empty split
              EXPECT_GE(std::int64_t(p.zslices) * p.rows, M);
              EXPECT_LT(std::int64_t(p.zslices - 1) * p.rows, M);
              EXPECT_GE(std::int64_t(p.strips) * 64, Npad);
              EXPECT_LE(p.smem_bytes, 130 * 1024);  // x <= 96 KB, group table <= 32 KB: fits an H200 block (227 KB)
              // every K range fits its group table: count the groups the worst-aligned range touches
              for (int sp = 0; sp < p.splits; ++sp) {
                const std::int64_t kb = std::int64_t(sp) * p.cps * 64, ke = std::min<std::int64_t>(K, kb + std::int64_t(p.cps) * 64);
                EXPECT_LE((ke - 1) / s.group - kb / s.group + 1, p.ngroups);
              }
              EXPECT_EQ(p.partial_elems, p.splits > 1 ? std::int64_t(p.splits) * M * Npad : 0);
              EXPECT_EQ(p.counter_elems, std::int64_t(p.strips) * p.zslices);
            }
}

// Bulk-loader plans (qgemm.cuh, QGemmLoader::Bulk): each ring slot has room for the scale / zero rows the
// producer copies with its chunk, i.e. the groups that start in the chunk plus, for the first chunk of a
// K range, the group the range begins in (counted here by brute force over k); no group table in shared
// memory; the block fits an H200 (227 KB); a persistent grid gives every work item to exactly one block and
// uses at most `persist` blocks per SM.
TEST(QGemmPlan, BulkSlotsHoldTheirGroupRowsAndPersistentGridsCoverEveryItem) {
  constexpr int kSlots = 8, kStrip = 128, kSlotWeights = 4096;  // r*w4n2p8b at 4 bits: 8 tiles of 512 B per slot
  for (std::int64_t M : {1, 16, 64, 128})
    for (std::int64_t K : {200, 4096, 11008})
      for (std::int64_t N : {300, 4096, 28672})
        for (int group : {16, 32, 48, 128, 0})
          for (int rows : {8, 16, 32, 64})
            for (int persist : {0, 2})
              for (int cps_override : {0, 3}) {
                const std::int64_t Kpad = kq::pad_to(K, 64), Npad = kq::pad_to(N, 16);
                const kq::QGemmShape s{M, N, K, Kpad, Npad, group > 0 ? group : Kpad, 4};
                const kq::QGemmGeometry g{rows, kStrip, 4, kSlots * kSlotWeights, kSlots, persist};
                const auto p = kq::plan_qgemm(s, g, 132, cps_override);
                SCOPED_TRACE(kq::describe(p) + " K " + std::to_string(K) + " group " + std::to_string(s.group));
                EXPECT_EQ(p.ngroups, 0);
                EXPECT_EQ(p.slot_bytes % 16, 0);
                EXPECT_GE(p.slot_bytes, kSlotWeights + p.slot_rows * kStrip * 3);
                EXPECT_LE(p.smem_bytes, 220 * 1024 + 16);
                const std::int64_t chunks = Kpad / 64;
                int need_max = 0;
                for (std::int64_t kc = 0; kc < chunks; ++kc) {
                  const bool first = kc % p.cps == 0;
                  const std::int64_t k_lo = kc * 64, k_hi = std::min(k_lo + 64, K) - 1;
                  int need = 0;
                  std::int64_t last = -1;
                  for (std::int64_t k = k_lo; k <= k_hi; ++k) {
                    const std::int64_t gi = k / s.group;
                    if (gi != last && (gi * s.group >= k_lo || (first && k == k_lo))) ++need;
                    last = gi;
                  }
                  need_max = std::max(need_max, need);
                }
                EXPECT_LE(need_max, p.slot_rows);
                EXPECT_GE(p.blocks() * p.items_per_block, p.items());
                EXPECT_LT((p.blocks() - 1) * p.items_per_block, p.items());
                if (persist == 0) EXPECT_EQ(p.items_per_block, 1);
                else EXPECT_LE(p.blocks(), 132 * persist);
              }
}

// The K-range rule the dispatch uses (plan_qgemm without override), on the benchmark's shapes with the
// geometry of the 16-row, two-tiles-per-warp configuration: 16 chunks, halved while under 2 blocks per SM.
TEST(QGemmPlan, KRangesOf16ChunksHalvedOnSmallGrids) {
  const kq::QGemmGeometry g{16, 128, 4, 0};
  auto plan = [&](std::int64_t M, std::int64_t K, std::int64_t N) {
    const std::int64_t Kpad = kq::pad_to(K, 64), Npad = kq::pad_to(N, 16);
    return kq::plan_qgemm(kq::QGemmShape{M, N, K, Kpad, Npad, 128, 4}, g, 132);
  };
  EXPECT_EQ(plan(1, 8192, 28672).cps, 16);
  EXPECT_EQ(plan(1, 4096, 11008).cps, 16);
  EXPECT_EQ(plan(1, 4096, 4096).cps, 4);  // 32 strips: 16 chunks would leave 128 blocks for 132 SMs
  EXPECT_EQ(plan(64, 4096, 4096).cps, 16);  // 4 z slices x 32 strips x 4 splits = 512 blocks
}

// Weights as A (geometry.swap): the block stages min(rows, M) x rows, so batch 1 takes one row of shared memory
// (the kernel computes the same layout from M); the split of K and the z slices are those of the plain geometry.
TEST(QGemmPlan, WeightsAsAStagesOnlyTheBatchRows) {
  for (int rows : {8, 16})
    for (std::int64_t M : {1, 5, 8, 13, 16, 40})
      for (int group : {32, 128}) {
        const std::int64_t K = 4096, N = 11008;
        const kq::QGemmShape s{M, N, K, K, N, group, 4};
        kq::QGemmGeometry g{rows, 128, 4, 0};
        const auto plain = kq::plan_qgemm(s, g, 132);
        g.swap = true;
        const auto p = kq::plan_qgemm(s, g, 132);
        const int xrows = int(std::min<std::int64_t>(rows, M));
        EXPECT_EQ(p.smem_bytes, kq::qgemm_smem(xrows, p.cps, p.ngroups, 128, 0).total) << "rows " << rows << " M " << M;
        EXPECT_EQ(plain.smem_bytes, kq::qgemm_smem(rows, plain.cps, plain.ngroups, 128, 0).total);
        EXPECT_LE(p.smem_bytes, plain.smem_bytes);
        EXPECT_EQ(p.zslices, plain.zslices);
        EXPECT_EQ(p.splits, plain.splits);
        if (M < rows) EXPECT_LT(p.smem_bytes, plain.smem_bytes);
      }
}
