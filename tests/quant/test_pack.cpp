// Packing round trips (2/3/4/8 bits, odd shapes), the layout against hand-computed words, and the RTN grid.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <squeeze/quant/pack.hpp>
#include <squeeze/quant/rtn.hpp>

using namespace squeeze;
using namespace squeeze::quant;

namespace {
struct Shape {
  std::int64_t out, in;
  int group;
};
}  // namespace

class PackRoundTrip : public ::testing::TestWithParam<int> {};

TEST_P(PackRoundTrip, CodesZerosScalesSurviveOddShapes) {
  const int bits = GetParam();
  const std::uint32_t maxq = (1u << bits) - 1u;
  std::mt19937 rng(1234 + bits);
  for (Shape s : {Shape{1, 1, 0}, Shape{7, 33, 16}, Shape{13, 100, 32}, Shape{33, 257, 128}, Shape{5, 64, 0}, Shape{11, 96, 32}}) {
    const std::int64_t groups = s.group > 0 ? (s.in + s.group - 1) / s.group : 1;
    std::vector<std::uint8_t> q(s.out * s.in), z(groups * s.out);
    std::vector<float> sc(groups * s.out);
    for (auto& v : q) v = std::uint8_t(rng() & maxq);
    for (auto& v : z) v = std::uint8_t(1 + rng() % maxq);  // v1 stores zero - 1: zeros in [1, maxq]
    for (auto& v : sc) v = std::uniform_real_distribution<float>(1e-3f, 2.f)(rng);
    const auto gi = default_g_idx(s.in, s.group);
    const PackedLinear p = pack(q, z, sc, gi, s.out, s.in, bits, s.group);
    EXPECT_EQ(std::int64_t(p.qweight.size()), (s.in * bits + 31) / 32 * s.out);
    EXPECT_EQ(std::int64_t(p.qzeros.size()), groups * ((s.out * bits + 31) / 32));
    EXPECT_EQ(unpack_codes(p), q) << "bits " << bits << " shape " << s.out << "x" << s.in;
    EXPECT_EQ(unpack_zeros(p), z);
    for (std::size_t k = 0; k < sc.size(); ++k) EXPECT_EQ(p.scales[k].operator float(), round_to_half(sc[k]));
    // dequantize follows the stated formula
    const auto w = dequantize(p);
    for (std::int64_t o = 0; o < s.out; ++o)
      for (std::int64_t i = 0; i < s.in; ++i) {
        const auto g = gi[i];
        const double ref = double(round_to_half(sc[g * s.out + o])) * (double(q[o * s.in + i]) - double(z[g * s.out + o]));
        ASSERT_NEAR(w[o * s.in + i], ref, 1e-6 * std::abs(ref) + 1e-12);
      }
  }
}
INSTANTIATE_TEST_SUITE_P(Bits, PackRoundTrip, ::testing::Values(2, 3, 4, 8));

// The word layout against words written out by hand from the format description.
TEST(PackLayout, FourBitColumnIsNibbleStreamAlongInput) {
  // one output column, 8 inputs with codes 1..8 -> one word 0x87654321
  std::vector<std::uint8_t> q = {1, 2, 3, 4, 5, 6, 7, 8}, z = {9};
  std::vector<float> sc = {1.f};
  const auto p = pack(q, z, sc, default_g_idx(8, 0), 1, 8, 4, 0);
  ASSERT_EQ(p.qweight.size(), 1u);
  EXPECT_EQ(std::uint32_t(p.qweight[0]), 0x87654321u);
  EXPECT_EQ(std::uint32_t(p.qzeros[0]), 8u);  // zero 9 stored as 8
}

TEST(PackLayout, ThreeBitCodesStraddleWords) {
  // 32 inputs, all codes 0 except code 10 = 0b111 and code 21 = 0b101: code 10 occupies bits 30,31 of
  // word 0 and bit 0 of word 1; code 21 occupies bit 31 of word 1 and bits 0,1 of word 2.
  std::vector<std::uint8_t> q(32, 0), z = {4};
  q[10] = 7;
  q[21] = 5;
  std::vector<float> sc = {1.f};
  const auto p = pack(q, z, sc, default_g_idx(32, 0), 1, 32, 3, 0);
  ASSERT_EQ(p.qweight.size(), 3u);
  EXPECT_EQ(std::uint32_t(p.qweight[0]), 0xC0000000u);
  EXPECT_EQ(std::uint32_t(p.qweight[1]), 0x80000001u);
  EXPECT_EQ(std::uint32_t(p.qweight[2]), 0x00000002u);
}

TEST(PackLayout, RejectsOutOfRangeCodesAndBadBits) {
  std::vector<std::uint8_t> q = {16}, z = {1};
  std::vector<float> sc = {1.f};
  EXPECT_THROW(pack(q, z, sc, default_g_idx(1, 0), 1, 1, 4, 0), Error);
  EXPECT_THROW(pack(q, z, sc, default_g_idx(1, 0), 1, 1, 5, 0), Error);
}

// ---- RTN grid -----------------------------------------------------------------------------------------------
TEST(RtnGrid, ErrorBoundedByHalfStepAndZeroNeverZero) {
  std::mt19937 rng(7);
  for (int bits : {2, 3, 4, 8})
    for (bool sym : {false, true}) {
      const std::int64_t out = 9, in = 75;
      const int gs = 32;
      std::vector<float> w(out * in);
      std::normal_distribution<float> nd(0.f, 0.05f);
      for (auto& v : w) v = nd(rng);
      for (std::int64_t i = 0; i < in; ++i) w[3 * in + i] = std::abs(w[3 * in + i]);  // a row >= 0 (asym zero -> 1)
      const auto p = rtn_quantize(w, out, in, {.bits = bits, .group_size = gs, .sym = sym});
      const auto wq = dequantize(p);
      for (std::int64_t o = 0; o < out; ++o)
        for (std::int64_t i = 0; i < in; ++i) {
          const auto g = i / gs;
          const float s = p.scale(g, o);
          if (!sym) {  // asymmetric grid covers [min, max] of the group: error <= half a step, plus the
                       // fp16 rounding of the scale accumulated over maxq steps at the grid's ends
            const float maxq = float((1u << bits) - 1u);
            EXPECT_LE(std::abs(wq[o * in + i] - w[o * in + i]), 0.5f * s + maxq * s / 2048.f + 1e-7f) << bits;
          }
          EXPECT_GE(p.zero(g, o), 1u);
        }
    }
}

TEST(RtnGrid, MoreBitsLessError) {
  std::mt19937 rng(3);
  const std::int64_t out = 16, in = 256;
  std::vector<float> w(out * in);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : w) v = nd(rng);
  double prev = 1e30;
  for (int bits : {2, 3, 4, 8}) {
    const auto wq = dequantize(rtn_quantize(w, out, in, {.bits = bits, .group_size = 0, .sym = false}));
    double e = 0;
    for (std::size_t k = 0; k < w.size(); ++k) e += double(wq[k] - w[k]) * double(wq[k] - w[k]);
    EXPECT_LT(e, prev) << bits;
    prev = e;
  }
}

TEST(RtnGrid, RejectsNonFinite) {
  std::vector<float> w = {1.f, NAN};
  EXPECT_THROW(rtn_quantize(w, 1, 2, {}), Error);
}

// The codes rtn_quantize writes (its group loops compiled for the host's vector width) are quantize_code of each value
// on its group's grid, the grid find_grid of the group's min and max: odd sizes, values on half steps, every width.
TEST(RtnGrid, CodesAreQuantizeCodeOfEachValue) {
  std::mt19937 rng(11);
  const std::int64_t out = 9, in = 333;  // groups of 64: five whole and a partial one
  std::vector<float> w(out * in);
  std::normal_distribution<float> nd(0.f, 0.05f);
  for (auto& v : w) v = nd(rng);
  for (std::int64_t i = 0; i < in; ++i) w[2 * in + i] = 0.25f * float(i % 9);  // row 2: on and between the grid's steps
  for (int bits : {2, 3, 4, 8})
    for (int group : {64, 0}) {
      const PackedLinear p = rtn_quantize(w, out, in, {.bits = bits, .group_size = group, .sym = false});
      const std::int64_t gs = group > 0 ? group : in;
      for (std::int64_t o = 0; o < out; ++o)
        for (std::int64_t g0 = 0; g0 < in; g0 += gs) {
          const std::int64_t g1 = std::min(in, g0 + gs);
          float mn = w[o * in + g0], mx = mn;
          for (std::int64_t i = g0; i < g1; ++i) mn = std::min(mn, w[o * in + i]), mx = std::max(mx, w[o * in + i]);
          const Grid grid = find_grid(mn, mx, bits, false);
          for (std::int64_t i = g0; i < g1; ++i)
            ASSERT_EQ(p.code(i, o), quantize_code(w[o * in + i], grid, bits))
                << "bits " << bits << " group " << group << " at " << o << ", " << i;
        }
    }
}

TEST(RtnGrid, RejectsInfinityAsNaN) {
  std::vector<float> w(300, 0.5f);
  w[257] = INFINITY;  // in the last, partial group of 128
  EXPECT_THROW(rtn_quantize(w, 1, 300, {}), Error);
  w[257] = -INFINITY;
  EXPECT_THROW(rtn_quantize(w, 1, 300, {}), Error);
}
