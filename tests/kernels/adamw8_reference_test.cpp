// 8-bit AdamW on the CPU against the implementation it replaced, kept here as the reference: one state block at a
// time, value[code] * absmax to decode, adamw_element and from_float for the update, the largest |m|, |v| as the
// new scales, and nearest_code (the binary search over the midpoints) to encode. The library's adamw8_cpu (its
// generic clones and, where the CPU has AVX-512 VBMI, the hand-vectorised path) must give the same bytes: params,
// masters, codes and block scales (a NaN weight matching any NaN), for every param/grad type pair, over several steps,
// on sizes that are not multiples of 256, with zero blocks, zero and huge and tiny gradients, infinities and NaNs.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "squeeze/kernels/adamw8.hpp"
#include "adamw8_state.hpp"
#include "test_util.hpp"

namespace sk = squeeze::kernels;
using namespace squeeze;

namespace {

// The replaced implementation, element by element.
template <class P, class G>
void reference_adamw8(const sk::AdamW8Tensor<P, G>& t, const sk::AdamWCoeffs& c, const sk::AdamWDynamic& d) {
  const sk::AdamWScalars s = sk::adamw_scalars(c, d);
  if (s.skip) return;
  const sk::StateCodeMap& mm = sk::signed_state_map();
  const sk::StateCodeMap& vm = sk::unsigned_state_map();
  float* w = std::is_same_v<P, float> ? reinterpret_cast<float*>(t.param) : t.master;
  for (std::int64_t b = 0; b < sk::state_blocks(t.n); ++b) {
    const std::int64_t lo = b * sk::kStateBlock, hi = std::min(t.n, lo + sk::kStateBlock);
    std::vector<float> m, v;
    float m_max = 0.0f, v_max = 0.0f;
    for (std::int64_t i = lo; i < hi; ++i) {
      float mi = mm.value[t.exp_avg[i]] * t.exp_avg_absmax[b], vi = vm.value[t.exp_avg_sq[i]] * t.exp_avg_sq_absmax[b];
      float wi = w[i];
      sk::adamw_element(wi, mi, vi, to_float(t.grad[i]), s);
      w[i] = wi;
      if constexpr (!std::is_same_v<P, float>) t.param[i] = from_float<P>(wi);
      m_max = std::fabs(mi) > m_max ? std::fabs(mi) : m_max;
      v_max = std::fabs(vi) > v_max ? std::fabs(vi) : v_max;
      m.push_back(mi);
      v.push_back(vi);
    }
    const float m_inv = sk::inverse_absmax(m_max), v_inv = sk::inverse_absmax(v_max);
    for (std::int64_t i = lo; i < hi; ++i) {
      t.exp_avg[i] = sk::nearest_code(mm.mid, m[std::size_t(i - lo)] * m_inv);
      t.exp_avg_sq[i] = sk::nearest_code(vm.mid, v[std::size_t(i - lo)] * v_inv);
    }
    t.exp_avg_absmax[b] = m_max;
    t.exp_avg_sq_absmax[b] = v_max;
  }
}

// A gradient with the awkward cases mixed in: whole zero blocks, scattered zeros, values 26 decades apart, denormals,
// 1e18 (its square near float's top), and (when `special`) 1e30 (whose square overflows v), infinities and NaNs.
template <class G>
std::vector<G> awkward_grad(std::int64_t n, std::mt19937& rng, bool special) {
  std::uniform_real_distribution<float> e(-20.f, 6.f), u(0.f, 1.f);
  std::vector<G> g(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t block = i / sk::kStateBlock;
    float x = std::exp2(e(rng)) * (u(rng) < 0.5f ? -1.f : 1.f);
    const float r = u(rng);
    if (block % 7 == 3)
      x = 0.f;  // a zero block
    else if (r < 0.05f)
      x = 0.f;
    else if (r < 0.07f)
      x = std::numeric_limits<float>::denorm_min() * 37.f;
    else if (r < 0.08f)
      x = special ? 1e30f : 1e18f;
    else if (special && r < 0.081f)
      x = std::numeric_limits<float>::infinity();
    else if (special && r < 0.082f)
      x = std::numeric_limits<float>::quiet_NaN();
    g[std::size_t(i)] = from_float<G>(x);
  }
  return g;
}

template <class P, class G>
void expect_matches_reference(std::int64_t n, std::uint32_t seed, bool special) {
  std::mt19937 rng(seed);
  const std::string label =
      std::string(dtype_name<P>()) + "/" + std::string(dtype_name<G>()) + " n=" + std::to_string(n) + (special ? " with inf/NaN" : "");
  std::vector<float> w0 = test::random_vec<float>(n, rng, -1.f, 1.f);
  for (float& w : w0) w = to_float(from_float<P>(w));
  test::Adam8State<P, G> ref(n, w0);
  for (int step = 1; step <= 4; ++step) {
    ref.grad = awkward_grad<G>(n, rng, special && step == 3);
    // inv_scale and clip folded in on the last step, through a device-style step counter.
    const float inv = 0.25f, clip = 0.5f;
    const std::int64_t applied = step - 1;
    const sk::AdamWDynamic d = step == 4 ? sk::AdamWDynamic{&inv, nullptr, &clip, &applied} : sk::AdamWDynamic{};
    const auto c = sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, step);
    test::Adam8State<P, G> gen = ref, fast = ref;
    reference_adamw8(ref.tensor(), c, d);
    sk::cpu::avx512::use_codec(false);
    sk::adamw8_cpu(gen.tensor(), c, d);
    sk::cpu::avx512::use_codec(true);
    test::expect_state_bitwise(gen, ref, label + " generic, step " + std::to_string(step), /*nan_matches_nan=*/true);
    if (sk::cpu::avx512::codec_available()) {
      sk::adamw8_cpu(fast.tensor(), c, d);
      test::expect_state_bitwise(fast, ref, label + " AVX-512, step " + std::to_string(step), /*nan_matches_nan=*/true);
    }
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(Adam8Reference, EveryTypePairMatchesTheReplacedImplementationBitwise) {
  std::uint32_t seed = 100;
  test::for_each_type_pair([&]<class P, class G>() {
    for (std::int64_t n :
         {std::int64_t(1), std::int64_t(63), std::int64_t(255), std::int64_t(257), std::int64_t(1000), std::int64_t(70001)})
      expect_matches_reference<P, G>(n, ++seed, false);
  });
}

TEST(Adam8Reference, InfinitiesAndNaNsMatchTheReplacedImplementation) {
  std::uint32_t seed = 200;
  test::for_each_type_pair([&]<class P, class G>() { expect_matches_reference<P, G>(5003, ++seed, true); });
}

// bf16 weights that are their own master (the compact host state): the moments' codes and scales equal the run with a
// float master of the same values, and each new weight is one of the two bf16 neighbours of that run's fp32 master
// (stochastic rounding picks either). The generic clones and the AVX-512 blocks give the same bytes.
TEST(Adam8Reference, OwnMasterRoundsToANeighbourOfTheMasterUpdate) {
  const std::int64_t n = 70001;
  std::mt19937 rng(400);
  std::vector<float> w0 = test::random_vec<float>(n, rng, -1.f, 1.f);
  for (float& w : w0) w = to_float(from_float<bf16>(w));
  test::Adam8State<bf16, bf16> with_master(n, w0), generic(n, w0);
  generic.master.clear();
  for (int step = 1; step <= 3; ++step) {
    with_master.grad = generic.grad = awkward_grad<bf16>(n, rng, false);
    for (std::int64_t i = 0; i < n; ++i) with_master.master[std::size_t(i)] = to_float(generic.param[std::size_t(i)]);
    const auto c = sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, step);
    test::Adam8State<bf16, bf16> fast = generic;
    sk::adamw8_cpu(with_master.tensor(), c);
    sk::cpu::avx512::use_codec(false);
    sk::adamw8_cpu(generic.tensor(), c);
    sk::cpu::avx512::use_codec(true);
    EXPECT_EQ(generic.m, with_master.m);
    EXPECT_EQ(generic.v, with_master.v);
    EXPECT_EQ(generic.m_absmax, with_master.m_absmax);
    EXPECT_EQ(generic.v_absmax, with_master.v_absmax);
    std::int64_t off = 0, up = 0, down = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const float exact = with_master.master[std::size_t(i)], got = to_float(generic.param[std::size_t(i)]);
      // The two neighbours: truncated toward zero, and one bf16 place further out (the same when exact is a bf16).
      const std::uint32_t bits = std::bit_cast<std::uint32_t>(exact), kept = bits & 0xffff0000u;
      const float lo = std::bit_cast<float>(kept), hi = std::bit_cast<float>(kept == bits ? kept : kept + 0x10000u);
      off += got != lo && got != hi;
      (got == lo ? down : up) += lo != hi;
    }
    EXPECT_EQ(off, 0) << "step " << step << ": weights not on a bf16 neighbour of the fp32 update";
    EXPECT_GT(up, n / 20) << "step " << step;  // both directions are taken
    EXPECT_GT(down, n / 20) << "step " << step;
    if (sk::cpu::avx512::codec_available()) {
      sk::adamw8_cpu(fast.tensor(), c);
      test::expect_state_bitwise(fast, generic, "own master, AVX-512 against generic, step " + std::to_string(step));
    }
    if (::testing::Test::HasFailure()) return;
  }
}

// round_stochastic (selects, no branch) against its definition on a stride through all float patterns: finite values
// add the random bits below bf16's last place and truncate, infinities keep their bits, NaN is from_float's quiet NaN.
TEST(Adam8Reference, StochasticRoundingMatchesItsDefinitionOnAStrideOfAllFloats) {
  std::vector<std::uint32_t> patterns = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u,
                                         0xffffffffu, 0x7f7fffffu, 0x00000001u, 0x80000000u};
  for (std::uint64_t bits = 0; bits < (std::uint64_t(1) << 32); bits += 97) patterns.push_back(std::uint32_t(bits));
  std::int64_t nan = 0, inf = 0;
  for (const std::uint32_t u : patterns) {
    const float w = std::bit_cast<float>(u);
    const std::uint32_t random = sk::rounding_bits(7, u);
    std::uint16_t want;
    if (std::isnan(w))
      want = std::bit_cast<std::uint16_t>(from_float<bf16>(w)), ++nan;
    else if (std::isinf(w))
      want = std::uint16_t(u >> 16), ++inf;
    else
      want = std::uint16_t((u + (random & 0xffffu)) >> 16);
    ASSERT_EQ(std::bit_cast<std::uint16_t>(sk::round_stochastic(w, random)), want) << "bits " << u;
  }
  EXPECT_GT(nan, 1000);
  EXPECT_GE(inf, 2);
}

// Many threads' pieces and the prefetch past each piece's end: a tensor of ~1.2 Mi elements with a ragged tail.
TEST(Adam8Reference, LargeTensorMatchesBitwise) { expect_matches_reference<bf16, bf16>((std::int64_t(1) << 20) + 200003, 300, false); }

// The encoders on a stride through all 2^32 float patterns (every 61st: 70 M values, every exponent and sign, NaN
// payloads, denormals), both maps, against the binary search (the block encoders and the GPU's branch-free rule).
TEST(Adam8Reference, EncodersMatchTheBinarySearchOnAStrideOfAllFloats) {
  constexpr std::uint64_t kStride = 61;
  for (bool is_signed : {true, false}) {
    const sk::StateCodeMap& map = is_signed ? sk::signed_state_map() : sk::unsigned_state_map();
    std::vector<float> x(4096);
    std::vector<std::uint8_t> generic(x.size()), fast(x.size());
    const bool avx512 = sk::cpu::avx512::codec_available();
    for (std::uint64_t u = 0; u < (std::uint64_t(1) << 32); u += kStride * x.size()) {
      const std::size_t len = std::size_t(std::min<std::uint64_t>(x.size(), ((std::uint64_t(1) << 32) - u + kStride - 1) / kStride));
      for (std::size_t k = 0; k < len; ++k) x[k] = std::bit_cast<float>(std::uint32_t(u + k * kStride));
      for (std::size_t o = 0; o < len; o += 256) {
        const int l = int(std::min<std::size_t>(256, len - o));
        sk::cpu::encode_block(map, x.data() + o, 1.0f, l, generic.data() + o);
        if (avx512) sk::cpu::avx512::encode_block(map, x.data() + o, 1.0f, l, fast.data() + o);
      }
      for (std::size_t k = 0; k < len; ++k) {
        const std::uint8_t want = sk::nearest_code(map.mid, x[k]);
        ASSERT_EQ(generic[k], want) << "generic encoder, bits " << std::bit_cast<std::uint32_t>(x[k]);
        ASSERT_EQ(sk::bucket_code_branch_free(map.bucket, x[k], is_signed), want)
            << "branch-free rule, bits " << std::bit_cast<std::uint32_t>(x[k]);
        if (avx512) ASSERT_EQ(fast[k], want) << "AVX-512 encoder, bits " << std::bit_cast<std::uint32_t>(x[k]);
      }
    }
  }
}

// The decoders: every code at several scales (zero, one, a power of two, an odd scale, a denormal one), ragged lengths.
TEST(Adam8Reference, DecodersMatchTheTable) {
  for (bool is_signed : {true, false}) {
    const sk::StateCodeMap& map = is_signed ? sk::signed_state_map() : sk::unsigned_state_map();
    std::vector<std::uint8_t> codes(1000);
    for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = std::uint8_t((i * 113 + 7) % 256);
    for (float scale : {0.f, 1.f, 0.125f, 3.7e-3f, 1e-40f, 6e37f}) {
      for (int len : {1, 63, 64, 65, 200, 256}) {
        std::vector<float> generic(std::size_t(len), -1.f), fast(std::size_t(len), -1.f);
        sk::cpu::decode_block(map, codes.data(), scale, len, generic.data());
        for (int j = 0; j < len; ++j)
          ASSERT_EQ(std::bit_cast<std::uint32_t>(generic[std::size_t(j)]),
                    std::bit_cast<std::uint32_t>(map.value[codes[std::size_t(j)]] * scale));
        if (!sk::cpu::avx512::codec_available()) continue;
        std::vector<float> guard(std::size_t(len) + 64, -2.f);
        sk::cpu::avx512::decode_block(map, codes.data(), scale, len, guard.data());
        for (int j = 0; j < len; ++j)
          ASSERT_EQ(std::bit_cast<std::uint32_t>(guard[std::size_t(j)]), std::bit_cast<std::uint32_t>(generic[std::size_t(j)]))
              << "code " << int(codes[std::size_t(j)]) << " scale " << scale;
        for (std::size_t j = std::size_t(len); j < guard.size(); ++j) ASSERT_EQ(guard[j], -2.f) << "wrote past the block";
      }
    }
  }
}

// The vectorisable rounding of the block update is from_float<bf16> bit for bit.
TEST(Adam8Reference, ParamRoundingIsFromFloat) {
  std::mt19937 rng(7);
  std::vector<std::uint32_t> bits = {0u,          0x80000000u, 1u,          0x807fffffu, 0x7f7fffffu, 0xff7fffffu,
                                     0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x3f808000u,
                                     0x3f818000u, 0x3f80ffffu, 0x00008000u, 0x00018000u};
  for (int k = 0; k < 2000000; ++k) bits.push_back(std::uint32_t(rng()));
  for (std::uint32_t u : bits) {
    const float f = std::bit_cast<float>(u);
    const bf16 a = sk::cpu::round_param<bf16>(f), b = from_float<bf16>(f);
    ASSERT_EQ(std::memcmp(&a, &b, sizeof a), 0) << "bits " << u;
  }
}

}  // namespace
