// NF4 codec (torch-free): code table, nearest-code encoding, blockwise round trip against a float64
// reference, padding for sizes that are not a multiple of the block, DoubleQuant, byte count vs the planner,
// bad input.
//
// Error bounds (stated): NF4 with exact absmax: |w - deq| <= G/2 * absmax_b (G = largest gap between
// neighbouring codes = 1 - 0.6961928 = 0.3038072), plus the output dtype's rounding of deq (relative 2^-24
// float, 2^-8 bf16, 2^-11 half). DoubleQuant (bitsandbytes' nested form): the codes are chosen against the exact
// absmax, the decoder uses absmax' with |absmax' - absmax| <= D/2 * nested (D = largest gap of the dynamic map,
// nested = the group's max |absmax - mean|, plus float rounding): |w - deq| <= G/2 * absmax + D/2 * nested.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <squeeze/error.hpp>
#include <squeeze/plan/memory.hpp>
#include <squeeze/policy/quantization.hpp>
#include <squeeze/quant/nf4.hpp>

using namespace squeeze;
namespace kq = squeeze::kernels::quant;

namespace {

double code(int c) { return double(kq::nf4_code_value(c)); }

double max_gap() {
  double g = 0;
  for (int c = 0; c < 15; ++c) g = std::max(g, code(c + 1) - code(c));
  return g;
}

// The largest gap between neighbouring entries of bitsandbytes' dynamic map (0.9 / 64 among the largest).
double map_max_gap() {
  const auto& m = quant::bnb_dynamic_map();
  double g = 0;
  for (std::size_t i = 0; i + 1 < m.size(); ++i) g = std::max(g, double(m[i + 1]) - double(m[i]));
  return g;
}

// Inverse standard normal CDF by bisection on erfc (float64, ~1e-15).
double norm_ppf(double p) {
  double lo = -40, hi = 40;
  for (int it = 0; it < 200; ++it) {
    const double mid = 0.5 * (lo + hi);
    (0.5 * std::erfc(-mid / std::sqrt(2.0)) < p ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

template <class T>
std::vector<T> normal_weights(std::int64_t n, std::uint32_t seed, float sigma = 0.02f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, sigma);
  std::vector<T> w(static_cast<std::size_t>(n));
  for (auto& v : w) v = from_float<T>(nd(rng));
  return w;
}

template <class T>
double out_rel_eps() {
  if constexpr (std::is_same_v<T, float>)
    return std::ldexp(1.0, -24);
  else if constexpr (std::is_same_v<T, bf16>)
    return std::ldexp(1.0, -8) + std::ldexp(1.0, -24);  // + the fp32 product
  else
    return std::ldexp(1.0, -11) + std::ldexp(1.0, -24);
}

// Brute-force float64 block absmax over the valid values of block b.
template <class T>
double ref_absmax(const std::vector<T>& w, std::int64_t b, int block) {
  double m = 0;
  for (std::int64_t i = b * block; i < std::min<std::int64_t>(std::int64_t(w.size()), (b + 1) * block); ++i)
    m = std::max(m, std::fabs(double(to_float(w[i]))));
  return m;
}

}  // namespace

// ---- code table -----------------------------------------------------------------------------------------------
TEST(Nf4Codes, PublishedTableProperties) {
  EXPECT_EQ(code(0), -1.0);
  EXPECT_EQ(code(15), 1.0);
  EXPECT_EQ(code(7), 0.0);  // exact zero, so zero-padding and pruned weights stay exact
  for (int c = 0; c < 15; ++c) EXPECT_LT(code(c), code(c + 1)) << "codes not strictly increasing at " << c;
  int neg = 0, pos = 0;
  for (int c = 0; c < 16; ++c) (code(c) < 0 ? neg : code(c) > 0 ? pos : neg) += code(c) != 0;
  EXPECT_EQ(neg, 7);
  EXPECT_EQ(pos, 8);
  // Asymmetric by one value, but each side is a set of normal quantiles: mirrored values differ by < 0.3.
  for (int k = 1; k <= 7; ++k) EXPECT_NEAR(-code(7 - k), code(7 + k), 0.3) << k;
  EXPECT_NEAR(max_gap(), 1.0 - 0.6961928009986877, 1e-7);
}

// The published values are the normalised N(0, 1) quantiles of the QLoRA construction: 8 positive values at
// linspace(delta, 1/2, 9)[:-1] and 7 negative at linspace(delta, 1/2, 8)[:-1] (negated), delta = 0.9677083,
// each divided by ppf(delta). Recomputed in float64 here (float32 linspace in the original: 1e-6 slack).
TEST(Nf4Codes, AreNormalisedNormalQuantiles) {
  const double delta = 0.9677083, top = norm_ppf(delta);
  std::vector<double> v{0.0};
  for (int k = 0; k < 8; ++k) v.push_back(norm_ppf(delta + (0.5 - delta) * k / 8.0) / top);
  for (int k = 0; k < 7; ++k) v.push_back(-norm_ppf(delta + (0.5 - delta) * k / 7.0) / top);
  std::sort(v.begin(), v.end());
  ASSERT_EQ(v.size(), 16u);
  for (int c = 0; c < 16; ++c) EXPECT_NEAR(code(c), v[std::size_t(c)], 2e-6) << "code " << c;
}

TEST(Nf4Codes, EncodePicksTheNearestCode) {
  for (int c = 0; c < 16; ++c) EXPECT_EQ(kq::nf4_encode(float(code(c))), c);
  EXPECT_EQ(kq::nf4_encode(-3.f), 0);  // clamps
  EXPECT_EQ(kq::nf4_encode(2.f), 15);
  EXPECT_EQ(kq::nf4_encode(std::nanf("")), 7);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> ud(-1.f, 1.f);
  for (int t = 0; t < 20000; ++t) {
    const float x = ud(rng);
    const int got = kq::nf4_encode(x);
    for (int c = 0; c < 16; ++c)
      ASSERT_LE(std::fabs(double(x) - code(got)), std::fabs(double(x) - code(c)) + 1e-7)
          << "x=" << x << " got " << got << " but " << c << " is nearer";
  }
}

// The thresholds between codes are bitsandbytes' (its decision tree's constants): the float64 midpoints of the
// published values, within a float32 rounding of the float32 table's midpoints.
TEST(Nf4Codes, ThresholdsAreBitsandbytesMidpoints) {
  EXPECT_EQ(kq::nf4_midpoint(7), 0.03979014977812767f);
  EXPECT_EQ(kq::nf4_midpoint(14), 0.8614784181118011f);
  for (int k = 0; k < 15; ++k) {
    EXPECT_NEAR(kq::nf4_midpoint(k), 0.5 * (code(k) + code(k + 1)), 1.2e-7) << k;
    EXPECT_EQ(kq::nf4_encode(kq::nf4_midpoint(k)), k) << "a tie goes to the lower code";
    EXPECT_EQ(kq::nf4_encode(std::nextafter(kq::nf4_midpoint(k), 2.f)), k + 1) << k;
  }
}

// The nested (DoubleQuant) code: the nearest map entry, a tie to the even index, NaN to 0 (bitsandbytes' search).
TEST(Nf4Codes, NestedCodeIsTheNearestMapEntry) {
  const auto& m = quant::bnb_dynamic_map();
  for (int c = 0; c < 256; ++c) EXPECT_EQ(kq::nf4_nested_code(m.data(), m[std::size_t(c)]), c) << c;
  EXPECT_EQ(kq::nf4_nested_code(m.data(), -2.f), 0);
  EXPECT_EQ(kq::nf4_nested_code(m.data(), 2.f), 255);
  EXPECT_EQ(kq::nf4_nested_code(m.data(), std::nanf("")), 0);
  for (int c : {10, 11, 126, 127, 200, 253, 254}) {
    const float mid = (m[std::size_t(c)] + m[std::size_t(c + 1)]) * 0.5f;
    EXPECT_EQ(kq::nf4_nested_code(m.data(), mid), c % 2 == 0 ? c : c + 1) << "tie between " << c << " and " << c + 1;
  }
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> ud(-1.f, 1.f);
  for (int t = 0; t < 20000; ++t) {
    const float x = ud(rng);
    const int got = kq::nf4_nested_code(m.data(), x);
    for (int c = 0; c < 256; ++c)
      ASSERT_LE(std::fabs(double(x) - m[std::size_t(got)]), std::fabs(double(x) - m[std::size_t(c)]) + 1e-9)
          << "x=" << x << " got " << got << " but " << c;
  }
}

TEST(Nf4Codec, NibbleOrderIsHighThenLow) {
  const std::vector<float> w{-1.f, 1.f, 0.f};  // codes 0, 15, 7 (+ padding nibble 7)
  const auto p = quant::nf4_quantize(w.data(), 3, {.block = 64});
  ASSERT_EQ(p.codes.size(), 2u);
  EXPECT_EQ(p.codes[0], 0x0F);
  EXPECT_EQ(p.codes[1], 0x77);
  EXPECT_EQ(p.absmax.size(), 1u);
  EXPECT_EQ(p.absmax[0], 1.f);
}

// ---- round trip -----------------------------------------------------------------------------------------------
template <class T>
class Nf4RoundTrip : public ::testing::Test {};
using Elements = ::testing::Types<float, bf16, half>;
TYPED_TEST_SUITE(Nf4RoundTrip, Elements);

TYPED_TEST(Nf4RoundTrip, PlainWithinHalfGapTimesAbsmaxAndNearest) {
  using T = TypeParam;
  const double half_gap = 0.5 * max_gap();
  for (const int block : {64, 32, 128}) {
    for (const std::int64_t n :
         {std::int64_t(64 * 37), std::int64_t(1000), std::int64_t(1), std::int64_t(63), std::int64_t(65), std::int64_t(4097)}) {
      const auto w = normal_weights<T>(n, std::uint32_t(n * 7 + block));
      const auto p = quant::nf4_quantize(w.data(), n, {.block = block});
      ASSERT_EQ(p.blocks(), (n + block - 1) / block);
      ASSERT_EQ(std::int64_t(p.codes.size()), (n + 1) / 2);
      std::vector<T> back(static_cast<std::size_t>(n));
      quant::nf4_dequantize(p, back.data());
      for (std::int64_t b = 0; b < p.blocks(); ++b) ASSERT_EQ(double(p.absmax[std::size_t(b)]), ref_absmax(w, b, block)) << "block " << b;
      for (std::int64_t i = 0; i < n; ++i) {
        const double x = to_float(w[i]), a = ref_absmax(w, i / block, block), d = to_float(back[i]);
        const double exact = code(kq::nf4_code_at(p.codes.data(), i)) * a;
        ASSERT_LE(std::fabs(d - exact), std::fabs(exact) * out_rel_eps<T>() + 6e-8) << "output rounding, i=" << i;
        ASSERT_LE(std::fabs(x - exact), half_gap * a * (1 + 1e-6)) << "n=" << n << " block=" << block << " i=" << i;
        // nearest code (float64 reference; ties within float rounding of x / absmax)
        double best = 1e300;
        for (int c = 0; c < 16; ++c) best = std::min(best, std::fabs(x - code(c) * a));
        ASSERT_LE(std::fabs(x - exact), best + 1e-6 * a) << "not the nearest code at i=" << i;
      }
      if (n % 2) EXPECT_EQ(p.codes.back() & 15, 7) << "padding nibble";
    }
  }
}

TYPED_TEST(Nf4RoundTrip, DoubleQuantBoundAndCloseToPlain) {
  using T = TypeParam;
  const double half_gap = 0.5 * max_gap(), half_map_gap = 0.5 * map_max_gap();
  EXPECT_NEAR(map_max_gap(), 0.9 / 64, 1e-6);
  for (const std::int64_t n : {std::int64_t(256 * 64 * 3 + 1000), std::int64_t(64 * 300), std::int64_t(999)}) {
    const auto w = normal_weights<T>(n, std::uint32_t(n));
    const auto plain = quant::nf4_quantize(w.data(), n, {.block = 64});
    const auto dq = quant::nf4_quantize(w.data(), n, {.block = 64, .double_quant = true});
    ASSERT_TRUE(dq.absmax.empty());
    ASSERT_EQ(std::int64_t(dq.absmax_code.size()), dq.blocks());
    ASSERT_EQ(std::int64_t(dq.nested_absmax.size()), (dq.blocks() + 255) / 256);
    ASSERT_EQ(dq.nested_map.size(), 256u);
    EXPECT_EQ(dq.codes, plain.codes) << "both modes choose the codes against the exact absmax";
    // offset = mean of the block absmax values; nested = max |absmax - offset| per 256 blocks
    double mean = 0;
    for (float a : plain.absmax) mean += a;
    mean /= double(plain.absmax.size());
    EXPECT_NEAR(dq.absmax_offset, mean, 1e-6 * mean);
    for (std::int64_t g = 0; g < std::int64_t(dq.nested_absmax.size()); ++g) {
      float m = 0.f;
      for (std::int64_t b = g * 256; b < std::min<std::int64_t>(dq.blocks(), (g + 1) * 256); ++b)
        m = std::max(m, std::fabs(plain.absmax[b] - dq.absmax_offset));
      EXPECT_EQ(dq.nested_absmax[std::size_t(g)], m) << "group " << g;
    }
    std::vector<double> b_dq(std::size_t(dq.blocks()));
    for (std::int64_t b = 0; b < dq.blocks(); ++b) {
      const double s = half_map_gap * dq.nested_absmax[std::size_t(b / 256)];
      b_dq[std::size_t(b)] = kq::nf4_block_absmax(dq.view(), b);
      ASSERT_LE(std::fabs(b_dq[std::size_t(b)] - plain.absmax[std::size_t(b)]), s + 1e-6 * plain.absmax[std::size_t(b)])
          << "absmax' of block " << b;
    }
    std::vector<double> back_plain(static_cast<std::size_t>(n)), back_dq(static_cast<std::size_t>(n));
    std::vector<float> tmp(static_cast<std::size_t>(n));
    quant::nf4_dequantize(plain, tmp.data());
    std::copy(tmp.begin(), tmp.end(), back_plain.begin());
    quant::nf4_dequantize(dq, tmp.data());
    std::copy(tmp.begin(), tmp.end(), back_dq.begin());
    double se_plain = 0, se_dq = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const double x = to_float(w[i]), s = half_map_gap * dq.nested_absmax[std::size_t(i / 64 / 256)];
      ASSERT_LE(std::fabs(x - back_dq[i]), half_gap * plain.absmax[std::size_t(i / 64)] + s + 1e-6 * std::fabs(x)) << "i=" << i;
      se_plain += (x - back_plain[i]) * (x - back_plain[i]);
      se_dq += (x - back_dq[i]) * (x - back_dq[i]);
    }
    // 8-bit nested absmax values cost little: the RMS error grows by < 2 %.
    EXPECT_LE(std::sqrt(se_dq / se_plain), 1.02) << "n=" << n;
    EXPECT_GE(std::sqrt(se_dq / se_plain), 0.98) << "n=" << n;
  }
}

// A block of zeros among normal blocks: exact zeros back (absmax 0 -> code 7), DoubleQuant too.
TEST(Nf4Codec, ZeroBlockStaysZero) {
  auto w = normal_weights<float>(64 * 10, 3);
  std::fill(w.begin() + 128, w.begin() + 192, 0.f);
  for (bool dqf : {false, true}) {
    const auto p = quant::nf4_quantize(w.data(), std::int64_t(w.size()), {.block = 64, .double_quant = dqf});
    std::vector<float> back(w.size());
    quant::nf4_dequantize(p, back.data());
    for (int i = 128; i < 192; ++i) {
      ASSERT_EQ(kq::nf4_code_at(p.codes.data(), i), 7) << i;  // 0 / absmax' is 0 whatever absmax' is
      ASSERT_EQ(back[std::size_t(i)], 0.f) << i;
    }
  }
}

// Sizes above the CPU twins' serial threshold (64 Ki values) run on several threads: same bounds.
TEST(Nf4Codec, LargeTensorOnThreadsWithinBounds) {
  const double half_gap = 0.5 * max_gap();
  const std::int64_t n = (std::int64_t(1) << 18) + 3;
  const auto w = normal_weights<float>(n, 99);
  for (const bool dqf : {false, true}) {
    const auto p = quant::nf4_quantize(w.data(), n, {.block = 64, .double_quant = dqf});
    std::vector<float> back(static_cast<std::size_t>(n));
    quant::nf4_dequantize(p, back.data());
    for (std::int64_t i = 0; i < n; ++i) {
      const double a = ref_absmax(w, i / 64, 64);
      const double s = dqf ? 0.5 * map_max_gap() * double(p.nested_absmax[std::size_t(i / 64 / 256)]) : 0.0;
      ASSERT_LE(std::fabs(double(w[std::size_t(i)]) - double(back[std::size_t(i)])), half_gap * a + s + 1e-6 * std::fabs(w[std::size_t(i)]))
          << "dq=" << dqf << " i=" << i;
    }
  }
}

// ---- bytes vs the planner ------------------------------------------------------------------------------------
TEST(Nf4Codec, BytesEqualThePlanner) {
  struct Shape {
    std::int64_t in, out;
  };
  for (const Shape s : {Shape{256, 768}, Shape{2048, 256}, Shape{100, 30}, Shape{4096, 64}, Shape{1000, 1002}}) {
    const auto w = normal_weights<float>(s.in * s.out, 11);
    const std::int64_t n = s.in * s.out;
    EXPECT_EQ((quant::nf4_quantize<Quantized<4, NF4>>(w.data(), n).bytes()),
              (plan::quantized_matrix_bytes<Quantized<4, NF4>>(s.in, s.out)));
    EXPECT_EQ((quant::nf4_quantize<Quantized<4, NF4, DoubleQuant>>(w.data(), n).bytes()),
              (plan::quantized_matrix_bytes<Quantized<4, NF4, DoubleQuant>>(s.in, s.out)));
    EXPECT_EQ((quant::nf4_quantize<Quantized<4, NF4, Group<128>, DoubleQuant>>(w.data(), n).bytes()),
              (plan::quantized_matrix_bytes<Quantized<4, NF4, Group<128>, DoubleQuant>>(s.in, s.out)));
    EXPECT_EQ((quant::nf4_quantize<Quantized<4, NF4, Group<32>>>(w.data(), n).bytes()),
              (plan::quantized_matrix_bytes<Quantized<4, NF4, Group<32>>>(s.in, s.out)));
  }
  static_assert(quant::nf4_options<Quantized<4, NF4>>().block == 64 && !quant::nf4_options<Quantized<4, NF4>>().double_quant);
  static_assert(quant::nf4_options<Quantized<4, NF4, Group<128>, DoubleQuant>>().block == 128);
}

// ---- bad input -----------------------------------------------------------------------------------------------
namespace {
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const squeeze::Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Nf4Codec, BadInputIsAClearError) {
  const std::vector<float> w(100, 0.5f);
  EXPECT_NE(error_of([&] { quant::nf4_quantize(w.data(), 0); }).find("at least one value"), std::string::npos);
  EXPECT_NE(error_of([&] { quant::nf4_quantize(w.data(), -5); }).find("n = -5"), std::string::npos);
  EXPECT_NE(error_of([&] { quant::nf4_quantize(w.data(), 100, {.block = 48}); }).find("power of two"), std::string::npos);
  EXPECT_NE(error_of([&] { quant::nf4_quantize(w.data(), 100, {.block = 0}); }).find("block size"), std::string::npos);
  EXPECT_NE(error_of([&] { quant::nf4_quantize(static_cast<const float*>(nullptr), 100); }).find("null"), std::string::npos);
  std::vector<float> bad = w;
  bad[42] = std::nanf("");
  EXPECT_NE(error_of([&] { quant::nf4_quantize(bad.data(), 100); }).find("weight 42 is not finite"), std::string::npos);
  bad[42] = INFINITY;
  EXPECT_NE(error_of([&] { quant::nf4_quantize(bad.data(), 100); }).find("weight 42"), std::string::npos);
  quant::Nf4Packed empty;
  std::vector<float> out(1);
  EXPECT_NE(error_of([&] { quant::nf4_dequantize(empty, out.data()); }).find("nf4_dequantize"), std::string::npos);
  const auto p = quant::nf4_quantize(w.data(), 100);
  EXPECT_NE(error_of([&] { quant::nf4_dequantize(p, static_cast<float*>(nullptr)); }).find("output pointer is null"), std::string::npos);
}
