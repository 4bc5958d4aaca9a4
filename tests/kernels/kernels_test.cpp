// CPU twins of the training kernels against float64 references (ctest label `kernels`).
// Tolerances (stated per quantity; the twins compute in float):
//   AdamW master / float params after 3 steps: |err| <= 4e-6 * max(1, |ref|); m: rel 2e-6 + 2e-8 abs (m is a
//   difference of terms ~0.05, so its error is absolute); v: rel 2e-6;
//   low-precision params: exactly round-to-nearest-even of the fp32 master.
//   unscale: |err| <= u(G) * |ref| (one rounding into G; u = 2^-24 / 2^-11 / 2^-8 for float / half / bf16).
//   accumulate: rel 1e-6 of the sum of |terms|.   norms: rel 1e-6 (double accumulation, float output).
#include <algorithm>
#include <cmath>
#include <limits>
#include <span>

#include "squeeze/kernels/accumulate.hpp"
#include "squeeze/kernels/adamw.hpp"
#include "squeeze/kernels/grad_norm.hpp"
#include "squeeze/kernels/loss_scale.hpp"
#include "test_util.hpp"

namespace sk = squeeze::kernels;
using namespace squeeze;
using squeeze::test::for_each_type;
using squeeze::test::for_each_type_pair;
using squeeze::test::kSizes;

namespace {

// ---- AdamW ---------------------------------------------------------------------------------------------

struct Hyper {
  float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, wd = 0.1f;
};

// Buffers of one AdamW tensor on the host, with a float64 shadow state.
template <class P, class G>
struct AdamWCase {
  std::int64_t n;
  std::vector<P> param;
  std::vector<float> master;  // empty for float params
  std::vector<G> grad;
  std::vector<float> m, v;
  std::vector<double> rw, rm, rv;  // reference state

  AdamWCase(std::int64_t n_, std::mt19937& rng) : n(n_) {
    auto w0 = test::random_vec<float>(n, rng, -1.f, 1.f);
    param.resize(std::size_t(n));
    for (std::int64_t i = 0; i < n; ++i) param[i] = from_float<P>(w0[i]);
    if constexpr (!std::is_same_v<P, float>) master = w0;
    m = test::random_vec<float>(n, rng, -0.05f, 0.05f);
    v = test::random_vec<float>(n, rng, 1e-6f, 1e-2f);
    rw.assign(w0.begin(), w0.end());
    rm.assign(m.begin(), m.end());
    rv.assign(v.begin(), v.end());
  }
  sk::AdamWTensor<P, G> tensor() { return {param.data(), master.empty() ? nullptr : master.data(), grad.data(), m.data(), v.data(), n}; }
  const float* weights() const {
    if constexpr (std::is_same_v<P, float>)
      return param.data();
    else
      return master.data();
  }
  // One float64 AdamW step (PyTorch's formula) with grads multiplied by gmul.
  void reference_step(const Hyper& h, std::int64_t t, double gmul) {
    const double bc1 = 1 - std::pow(double(h.beta1), double(t)), bc2 = 1 - std::pow(double(h.beta2), double(t));
    for (std::int64_t i = 0; i < n; ++i) {
      const double g = double(to_float(grad[i])) * gmul;
      rm[i] = h.beta1 * rm[i] + (1 - double(h.beta1)) * g;
      rv[i] = h.beta2 * rv[i] + (1 - double(h.beta2)) * g * g;
      rw[i] = rw[i] * (1 - double(h.lr) * h.wd) - double(h.lr) / bc1 * rm[i] / (std::sqrt(rv[i]) / std::sqrt(bc2) + h.eps);
    }
  }
};

template <class P, class G>
void check_against_reference(AdamWCase<P, G>& c, const std::string& label) {
  const float* w = c.weights();
  int bad = 0;
  for (std::int64_t i = 0; i < c.n && bad < 5; ++i) {
    const bool ok_w = std::abs(w[i] - c.rw[i]) <= 4e-6 * std::max(1.0, std::abs(c.rw[i]));
    const bool ok_m = std::abs(c.m[i] - c.rm[i]) <= 2e-6 * std::abs(c.rm[i]) + 2e-8;  // abs part: m cancels terms of size ~0.05
    const bool ok_v = std::abs(c.v[i] - c.rv[i]) <= 2e-6 * std::abs(c.rv[i]) + 1e-14;
    bool ok_p = true;
    if constexpr (!std::is_same_v<P, float>)
      ok_p = test::bits_equal(std::vector<P>{c.param[i]}, std::vector<P>{from_float<P>(c.master[i])});
    if (!(ok_w && ok_m && ok_v && ok_p)) {
      ++bad;
      ADD_FAILURE() << label << " i=" << i << " w=" << w[i] << " ref " << c.rw[i] << " m=" << c.m[i] << " ref " << c.rm[i]
                    << " v=" << c.v[i] << " ref " << c.rv[i] << " param ok=" << ok_p;
    }
  }
}

TEST(AdamWCpu, MatchesFloat64ReferenceForEveryTypePairAndSize) {
  std::mt19937 rng(1234);
  const Hyper h;
  for_each_type_pair([&]<class P, class G>() {
    for (std::int64_t n : kSizes) {
      const std::string label = std::string(dtype_name<P>()) + "/" + std::string(dtype_name<G>()) + " n=" + std::to_string(n);
      AdamWCase<P, G> c(n, rng);
      // Step 1: plain; step 2: loss-scaled grads with inv_scale; step 3: inv_scale and a clip coefficient.
      const float loss_scale = 1024.f, inv_scale = 1.f / loss_scale, clip = 0.7f, no_inf = 0.f;
      for (std::int64_t t = 1; t <= 3; ++t) {
        const float gscale = t == 1 ? 1.f : loss_scale;
        c.grad = test::random_vec<G>(n, rng, -0.1f * gscale, 0.1f * gscale);
        sk::AdamWDynamic d;
        if (t >= 2) d.inv_scale = &inv_scale, d.found_inf = &no_inf;
        if (t == 3) d.clip_coef = &clip;
        sk::adamw_cpu(c.tensor(), sk::adamw_coeffs(h.lr, h.beta1, h.beta2, h.eps, h.wd, t), d);
        c.reference_step(h, t, (t >= 2 ? double(inv_scale) : 1.0) * (t == 3 ? double(clip) : 1.0));
      }
      check_against_reference(c, label);
    }
  });
}

// The CPU launcher runs its multiversioned loop (cpu_parallel.hpp's SQUEEZE_CPU_CLONES: the AVX-512 or AVX2+FMA
// clone on an x86-64 host of this decade), in dynamically handed-out pieces. This TU's own loop below is built for
// the baseline ISA, where fmaf is libm's: bitwise equality shows the clone computes adamw_element's exact operations
// (explicit FMAs; the CUDA kernels do the same, so they agree with it bitwise too). Sizes around the piece size.
TEST(AdamWCpu, MultiversionedLauncherEqualsTheScalarElementBitwise) {
  std::mt19937 rng(99);
  for_each_type_pair([&]<class P, class G>() {
    for (std::int64_t n : {std::int64_t(1), std::int64_t(17), sk::cpu::kPiece - 1, 3 * sk::cpu::kPiece + 77}) {
      const std::string label = std::string(dtype_name<P>()) + "/" + std::string(dtype_name<G>()) + " n=" + std::to_string(n);
      AdamWCase<P, G> fast(n, rng);
      fast.grad = test::random_vec<G>(n, rng, -2.f, 2.f);
      AdamWCase<P, G> slow = fast;
      const float inv = 0.5f, clip = 0.75f, no_inf = 0.f;
      const sk::AdamWDynamic d{&inv, &no_inf, &clip, nullptr};
      const auto c = sk::adamw_coeffs(3e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 4);
      sk::adamw_cpu(fast.tensor(), c, d);
      const sk::AdamWScalars s = sk::adamw_scalars(c, d);
      const auto t = slow.tensor();
      for (std::int64_t i = 0; i < n; ++i) sk::adamw_at(t, i, s);
      EXPECT_TRUE(test::bits_equal(fast.param, slow.param)) << label;
      EXPECT_TRUE(test::bits_equal(fast.master, slow.master)) << label;
      EXPECT_TRUE(test::bits_equal(fast.m, slow.m)) << label;
      EXPECT_TRUE(test::bits_equal(fast.v, slow.v)) << label;
    }
  });
}

// beta^t by squaring (the same multiplications on host and device) against std::pow: relative error <= 2t * 2^-53
// (a squaring doubles the relative error it gets), so the bias correction 1 - beta^t is off by <= 2 t beta^t 2^-53,
// at most ~1e-12 for beta <= 0.9999: nothing a float step size can see.
TEST(AdamWCpu, PowerBySquaringMatchesPow) {
  EXPECT_EQ(sk::adamw_power(0.9, 0), 1.0);
  EXPECT_EQ(sk::adamw_power(0.9, 1), 0.9);
  for (double b : {0.9, 0.95, 0.999, double(0.999f), 0.9999})
    for (std::int64_t t : {2, 3, 10, 1000, 123457, 1000000}) {
      const double ref = std::pow(b, double(t));
      EXPECT_NEAR(sk::adamw_power(b, t), ref, 2.0 * double(t) * 0x1p-53 * ref + 1e-300) << b << "^" << t;
      EXPECT_NEAR(1 - sk::adamw_power(b, t), 1 - ref, 1e-12 * (1 - ref)) << "bias correction " << b << "^" << t;
    }
}

TEST(AdamWCpu, SkippedStepLeavesEverythingBitwiseUnchanged) {
  std::mt19937 rng(7);
  for_each_type_pair([&]<class P, class G>() {
    for (std::int64_t n : {std::int64_t(7), std::int64_t(1) << 17}) {
      AdamWCase<P, G> c(n, rng);
      c.grad = test::random_vec<G>(n, rng, -1.f, 1.f);
      c.grad[n / 2] = from_float<G>(std::numeric_limits<float>::infinity());
      c.grad[0] = from_float<G>(std::numeric_limits<float>::quiet_NaN());
      const auto param0 = c.param;
      const auto master0 = c.master;
      const auto m0 = c.m, v0 = c.v;
      const float found_inf = 1.f, inv_scale = 0.5f;
      sk::adamw_cpu(c.tensor(), sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 5), {&inv_scale, &found_inf, nullptr, nullptr});
      EXPECT_TRUE(test::bits_equal(c.param, param0)) << dtype_name<P>() << "/" << dtype_name<G>();
      EXPECT_TRUE(test::bits_equal(c.master, master0));
      EXPECT_TRUE(test::bits_equal(c.m, m0));
      EXPECT_TRUE(test::bits_equal(c.v, v0));
    }
  });
}

TEST(AdamWCpu, DeviceStyleStepCounterMatchesHostStepAndSkipsDontCount) {
  std::mt19937 rng(9);
  AdamWCase<bf16, bf16> a(1000, rng), b(1000, rng);
  b = a;
  a.grad = b.grad = test::random_vec<bf16>(1000, rng, -1.f, 1.f);
  std::int64_t applied = 2;  // two steps applied so far: this is step 3
  sk::adamw_cpu(a.tensor(), sk::adamw_coeffs(1e-3f, 0.9f, 0.99f, 1e-8f, 0.f, 3));
  sk::adamw_cpu(b.tensor(), sk::adamw_coeffs(1e-3f, 0.9f, 0.99f, 1e-8f, 0.f, 1), {nullptr, nullptr, nullptr, &applied});
  EXPECT_TRUE(test::bits_equal(a.master, b.master));
  EXPECT_TRUE(test::bits_equal(a.m, b.m));
  const float inf = 1.f, clean = 0.f;
  sk::adamw_commit_step(&applied, &inf);
  EXPECT_EQ(applied, 2);
  sk::adamw_commit_step(&applied, &clean);
  sk::adamw_commit_step(&applied, nullptr);
  EXPECT_EQ(applied, 4);
}

TEST(AdamWCpu, TensorListEqualsOneCallPerTensor) {
  std::mt19937 rng(11);
  std::vector<AdamWCase<half, float>> one, many;
  for (std::int64_t n : {1, 7, 1023, 70000, 0}) {
    one.emplace_back(n, rng);
    one.back().grad = test::random_vec<float>(n, rng, -1.f, 1.f);
  }
  many = one;
  const auto c = sk::adamw_coeffs(1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1);
  for (auto& x : one) sk::adamw_cpu(x.tensor(), c);
  std::vector<sk::AdamWTensor<half, float>> list;
  for (auto& x : many) list.push_back(x.tensor());
  sk::adamw_cpu(std::span<const sk::AdamWTensor<half, float>>(list), c);
  for (std::size_t i = 0; i < one.size(); ++i) {
    EXPECT_TRUE(test::bits_equal(one[i].param, many[i].param));
    EXPECT_TRUE(test::bits_equal(one[i].master, many[i].master));
    EXPECT_TRUE(test::bits_equal(one[i].v, many[i].v));
  }
}

TEST(AdamWCpu, BadInputGivesClearErrors) {
  std::vector<float> w(4, 1.f), g(4, 1.f), m(4, 0.f), v(4, 0.f), master(4, 1.f);
  std::vector<half> ph(4);
  const auto c = sk::adamw_coeffs(1e-3f, 0.9f, 0.999f, 1e-8f, 0.f, 1);
  test::expect_error(
      [&] {
        sk::adamw_cpu(sk::AdamWTensor<float, float>{w.data(), nullptr, nullptr, m.data(), v.data(), 4}, c);
      },
      "grad pointer is null");
  test::expect_error(
      [&] {
        sk::adamw_cpu(sk::AdamWTensor<float, float>{nullptr, nullptr, g.data(), m.data(), v.data(), 4}, c);
      },
      "param pointer is null");
  test::expect_error(
      [&] {
        sk::adamw_cpu(sk::AdamWTensor<float, float>{w.data(), nullptr, g.data(), nullptr, v.data(), 4}, c);
      },
      "exp_avg");
  // fp16 params need a master; bf16 ones may be their own (rounded stochastically), on the CPU only.
  test::expect_error(
      [&] {
        sk::adamw_cpu(sk::AdamWTensor<half, float>{ph.data(), nullptr, g.data(), m.data(), v.data(), 4}, c);
      },
      "half params need fp32 master weights");
  test::expect_error(
      [&] {
        sk::adamw_cpu(sk::AdamWTensor<float, float>{w.data(), master.data(), g.data(), m.data(), v.data(), 4}, c);
      },
      "their own master");
  test::expect_error(
      [&] {
        sk::adamw_cpu(sk::AdamWTensor<float, float>{w.data(), nullptr, g.data(), m.data(), v.data(), -1}, c);
      },
      "negative element count");
  test::expect_error([] { sk::adamw_coeffs(1e-3f, 1.0f, 0.999f, 1e-8f, 0.f, 1); }, "beta1");
  test::expect_error([] { sk::adamw_coeffs(1e-3f, 0.9f, -0.1f, 1e-8f, 0.f, 1); }, "beta2");
  test::expect_error([] { sk::adamw_coeffs(1e-3f, 0.9f, 0.999f, 0.f, 0.f, 1); }, "eps");
  test::expect_error([] { sk::adamw_coeffs(-1.f, 0.9f, 0.999f, 1e-8f, 0.f, 1); }, "lr");
  test::expect_error([] { sk::adamw_coeffs(1e-3f, 0.9f, 0.999f, 1e-8f, 0.f, 0); }, "step counts from 1");
  // Nothing was lost: the buffers are untouched by the failed calls.
  EXPECT_EQ(w, std::vector<float>(4, 1.f));
  EXPECT_EQ(m, std::vector<float>(4, 0.f));
}

// ---- loss scaling --------------------------------------------------------------------------------------

TEST(LossScale, GradScalerSequenceInfInfThenCleanWindow) {
  sk::LossScaler s;  // defaults: 2^16, x2 per 2000 clean steps, x0.5 on overflow
  EXPECT_EQ(s.scale(), 65536.f);
  EXPECT_EQ(s.inv_scale(), 1.f / 65536.f);
  *s.found_inf() = 1.f;
  EXPECT_FALSE(s.update());
  EXPECT_EQ(s.scale(), 32768.f);
  EXPECT_EQ(*s.found_inf(), 0.f) << "the update consumes the flag";
  *s.found_inf() = 1.f;
  EXPECT_FALSE(s.update());
  EXPECT_EQ(s.scale(), 16384.f);
  for (int i = 1; i <= 1999; ++i) {
    ASSERT_TRUE(s.update());
    ASSERT_EQ(s.scale(), 16384.f) << "clean step " << i;
    ASSERT_EQ(s.state().growth_tracker, i);
  }
  EXPECT_TRUE(s.update());  // 2000th clean step
  EXPECT_EQ(s.scale(), 32768.f);
  EXPECT_EQ(s.inv_scale(), 1.f / 32768.f);
  EXPECT_EQ(s.state().growth_tracker, 0);
  // An overflow in the middle of a window restarts the count.
  for (int i = 0; i < 1000; ++i) s.update();
  *s.found_inf() = 1.f;
  s.update();
  EXPECT_EQ(s.scale(), 16384.f);
  for (int i = 0; i < 1999; ++i) s.update();
  EXPECT_EQ(s.scale(), 16384.f);
  s.update();
  EXPECT_EQ(s.scale(), 32768.f);
}

TEST(LossScale, HysteresisDelaysBackoff) {
  sk::LossScaleOptions o;
  o.init_scale = 1024.f;
  o.hysteresis = 2;
  o.growth_interval = 3;
  sk::LossScaler s(o);
  const std::vector<int> inf = {1, 1, 1, 0, 0, 0, 1, 1};
  // overflow 1: tolerated (hysteresis 2 -> 1); overflow 2, 3: back off; 3 clean: grow and refill; then tolerated, back off.
  const std::vector<float> expect = {1024, 512, 256, 256, 256, 512, 512, 256};
  for (std::size_t i = 0; i < inf.size(); ++i) {
    *s.found_inf() = float(inf[i]);
    s.update();
    EXPECT_EQ(s.scale(), expect[i]) << "step " << i;
  }
  // consecutive_hysteresis: any clean step refills the tolerance.
  o.consecutive_hysteresis = true;
  sk::LossScaler c(o);
  for (int f : {1, 0, 1, 0, 1, 1}) {
    *c.found_inf() = float(f);
    c.update();
  }
  EXPECT_EQ(c.scale(), 512.f);  // only the last back-to-back pair backs off
}

TEST(LossScale, MinimumScaleAndErrorAtMinimum) {
  sk::LossScaleOptions o;
  o.init_scale = 8.f;
  o.min_scale = 2.f;
  sk::LossScaler s(o);
  for (float expect : {4.f, 2.f, 2.f, 2.f}) {
    *s.found_inf() = 1.f;
    s.update();
    EXPECT_EQ(s.scale(), expect);
  }
  o.raise_at_min_scale = true;
  sk::LossScaler r(o);
  *r.found_inf() = 1.f;
  r.update();  // 4
  *r.found_inf() = 1.f;
  r.update();  // 2: reaching the minimum is fine
  EXPECT_EQ(r.scale(), 2.f);
  *r.found_inf() = 1.f;
  test::expect_error([&] { r.update(); }, "overflowed while the loss scale sat at its minimum");
}

// A resumed scaler continues exactly as the one that was saved: same scale now, same step of growth later.
TEST(LossScale, RestoreContinuesLikeTheSavedScaler) {
  sk::LossScaleOptions o;
  o.init_scale = 1024.f;
  o.growth_interval = 3;
  sk::LossScaler a(o);
  *a.found_inf() = 1.f;
  a.update();  // 512
  a.update();  // one clean step
  sk::LossScaler b(o);
  b.restore(a.scale(), a.state().growth_tracker);
  EXPECT_EQ(b.scale(), 512.f);
  EXPECT_EQ(b.inv_scale(), 1.f / 512.f);
  for (int i = 0; i < 4; ++i) {
    a.update();
    b.update();
    EXPECT_EQ(a.scale(), b.scale()) << i;  // grows to 1024 on the same step
  }
  test::expect_error([&] { b.restore(0.f, 0); }, "cannot restore a scale of");
  test::expect_error([&] { b.restore(std::numeric_limits<float>::infinity(), 0); }, "cannot restore a scale of");
  test::expect_error([&] { b.restore(8.f, -1); }, "negative growth tracker");
  o.min_scale = 16.f;
  sk::LossScaler c(o);
  test::expect_error([&] { c.restore(8.f, 0); }, "min_scale");
}

TEST(LossScale, GrowthNeverOverflowsToInf) {
  sk::LossScaleOptions o;
  o.init_scale = 0x1p127f;
  o.growth_interval = 1;
  sk::LossScaler s(o);
  s.update();
  EXPECT_EQ(s.scale(), 0x1p127f);
}

TEST(LossScale, BadOptionsGiveClearErrors) {
  auto with = [](auto f) {
    sk::LossScaleOptions o;
    f(o);
    return o;
  };
  test::expect_error([&] { sk::LossScaler(with([](auto& o) { o.init_scale = 0; })); }, "init_scale");
  test::expect_error([&] { sk::LossScaler(with([](auto& o) { o.growth_factor = 1; })); }, "growth_factor");
  test::expect_error([&] { sk::LossScaler(with([](auto& o) { o.backoff_factor = 1; })); }, "backoff_factor");
  test::expect_error([&] { sk::LossScaler(with([](auto& o) { o.growth_interval = 0; })); }, "growth_interval");
  test::expect_error([&] { sk::LossScaler(with([](auto& o) { o.hysteresis = 0; })); }, "hysteresis");
  test::expect_error([&] { sk::LossScaler(with([](auto& o) { o.min_scale = 1e9f; })); }, "min_scale");
}

TEST(CheckAndUnscale, MatchesFloat64AndFlagsNonFinite) {
  std::mt19937 rng(21);
  for_each_type([&]<class G>() {
    for (std::int64_t n : kSizes) {
      auto g = test::random_vec<G>(n, rng, -60000.f, 60000.f);
      const auto g0 = g;
      float found_inf = 0;
      const float inv = 1.f / 4096.f;
      sk::Buffer<G> b{g.data(), n};
      sk::check_and_unscale_cpu(std::span<const sk::Buffer<G>>(&b, 1), &found_inf, inv);
      EXPECT_EQ(found_inf, 0.f);
      for (std::int64_t i = 0; i < n; ++i) {
        const double ref = double(to_float(g0[i])) * inv;
        ASSERT_LE(std::abs(double(to_float(g[i])) - ref), test::unit_roundoff<G>() * std::abs(ref) + 1e-30)
            << dtype_name<G>() << " n=" << n << " i=" << i;
      }
      g[n - 1] = from_float<G>(std::numeric_limits<float>::infinity());
      sk::check_and_unscale_cpu(std::span<const sk::Buffer<G>>(&b, 1), &found_inf, inv);
      EXPECT_EQ(found_inf, 1.f) << dtype_name<G>() << " n=" << n;
    }
  });
  test::expect_error([] { sk::check_and_unscale_cpu<float>({}, nullptr, 1.f); }, "found_inf pointer is null");
}

// ---- accumulation ----------------------------------------------------------------------------------------

TEST(Accumulate, CastAndAddMatchesFloat64) {
  std::mt19937 rng(31);
  for_each_type([&]<class G>() {
    for (std::int64_t n : kSizes) {
      std::vector<float> acc(std::size_t(n), 12345.f);  // garbage: the first micro-batch overwrites
      std::vector<double> ref(std::size_t(n), 0.0), mag(std::size_t(n), 0.0);
      const float weights[3] = {0.25f, 0.5f, 0.25f};
      for (int k = 0; k < 3; ++k) {
        const auto g = test::random_vec<G>(n, rng, -2.f, 2.f);
        sk::accumulate_cpu(sk::AccumTensor<G>{acc.data(), g.data(), n}, weights[k], k == 0);
        for (std::int64_t i = 0; i < n; ++i) {
          ref[i] += double(weights[k]) * to_float(g[i]);
          mag[i] += std::abs(double(weights[k]) * to_float(g[i]));
        }
      }
      for (std::int64_t i = 0; i < n; ++i)
        ASSERT_LE(std::abs(acc[i] - ref[i]), 1e-6 * mag[i] + 1e-30) << dtype_name<G>() << " n=" << n << " i=" << i;
    }
  });
}

// The documented rule: token-weighted accumulation of per-micro-batch mean gradients equals the
// gradient of the mean loss over the whole batch. Per-token gradient rows x_j [tokens, dim]; a micro-batch
// gradient is the mean of its rows; micro-batches have 3, 10 and 1 tokens.
TEST(Accumulate, TokenWeightedMicroBatchesEqualOneBigBatch) {
  std::mt19937 rng(41);
  const std::int64_t dim = 1023;
  const std::vector<int> tokens = {3, 10, 1};
  const int total = 14;
  const auto rows = test::random_vec<float>(std::int64_t(total) * dim, rng, -1.f, 1.f);  // [14, dim]
  std::vector<double> big(dim, 0.0);
  for (int j = 0; j < total; ++j)
    for (std::int64_t d = 0; d < dim; ++d) big[d] += rows[std::size_t(j * dim + d)] / double(total);
  std::vector<float> acc(dim), naive(dim);
  int first = 0;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    std::vector<float> mean(dim, 0.f);  // this micro-batch's mean-loss gradient
    for (int j = first; j < first + tokens[i]; ++j)
      for (std::int64_t d = 0; d < dim; ++d) mean[d] += rows[std::size_t(j * dim + d)] / float(tokens[i]);
    sk::accumulate_cpu(sk::AccumTensor<float>{acc.data(), mean.data(), dim}, float(tokens[i]) / total, i == 0);
    sk::accumulate_cpu(sk::AccumTensor<float>{naive.data(), mean.data(), dim}, 1.f / 3, i == 0);
    first += tokens[i];
  }
  double worst = 0, naive_err = 0;
  for (std::int64_t d = 0; d < dim; ++d) {
    worst = std::max(worst, std::abs(acc[d] - big[d]));
    naive_err = std::max(naive_err, std::abs(naive[d] - big[d]));
  }
  EXPECT_LT(worst, 1e-6);
  EXPECT_GT(naive_err, 1e-2) << "a plain 1/k average differs when micro-batches have different token counts";
}

TEST(Accumulate, BadInputGivesClearErrors) {
  std::vector<float> a(3);
  test::expect_error([&] { sk::accumulate_cpu(sk::AccumTensor<float>{a.data(), nullptr, 3}, 1.f, false); }, "gradient pointer is null");
  test::expect_error([&] { sk::accumulate_cpu(sk::AccumTensor<float>{nullptr, a.data(), 3}, 1.f, false); }, "accumulation buffer");
  test::expect_error([&] { sk::accumulate_cpu(sk::AccumTensor<float>{a.data(), a.data(), 3}, NAN, false); }, "scale must be finite");
}

// ---- gradient norm ---------------------------------------------------------------------------------------

TEST(GradNorm, L2AndInfMatchFloat64OverBufferLists) {
  std::mt19937 rng(51);
  for_each_type([&]<class G>() {
    std::vector<std::vector<G>> data;
    for (std::int64_t n : kSizes) data.push_back(test::random_vec<G>(n, rng, -3.f, 3.f));
    double sq = 0, mx = 0;
    std::vector<sk::Buffer<const G>> list;
    for (auto& d : data) {
      list.push_back({d.data(), std::int64_t(d.size())});
      for (auto x : d) sq += double(to_float(x)) * to_float(x), mx = std::max(mx, std::abs(double(to_float(x))));
    }
    const float inv = 0.125f, max_norm = 1.0f;
    float norm = 0, clip = 0, found = 0;
    sk::grad_norm_cpu<G>(list, sk::NormType::L2, max_norm, &inv, {&norm, &clip, &found});
    const double ref = std::sqrt(sq) * inv;
    EXPECT_NEAR(norm, ref, 1e-6 * ref) << dtype_name<G>();
    EXPECT_NEAR(clip, max_norm / (ref + 1e-6), 1e-6) << dtype_name<G>();
    EXPECT_EQ(found, 0.f);
    const float inf_norm = sk::grad_norm_cpu<G>(list, sk::NormType::Inf, 0.f, nullptr, {nullptr, &clip, &found});
    EXPECT_EQ(double(inf_norm), mx) << dtype_name<G>();
    EXPECT_EQ(clip, 1.f) << "max_norm <= 0: no clipping";
    // A norm under max_norm does not scale up.
    sk::grad_norm_cpu<G>(list, sk::NormType::L2, 1e9f, nullptr, {nullptr, &clip, nullptr});
    EXPECT_EQ(clip, 1.f);
    // One NaN or inf anywhere: norm not finite, found_inf raised, for both norms.
    for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
      for (auto type : {sk::NormType::L2, sk::NormType::Inf}) {
        auto saved = data[2][5];
        data[2][5] = from_float<G>(bad);
        found = 0;
        const float n2 = sk::grad_norm_cpu<G>(list, type, max_norm, nullptr, {nullptr, &clip, &found});
        EXPECT_FALSE(std::isfinite(n2));
        EXPECT_EQ(found, 1.f);
        EXPECT_EQ(clip, 1.f);
        data[2][5] = saved;
      }
    }
  });
  test::expect_error([] { sk::grad_norm_cpu<float>({}, sk::NormType::L2, NAN); }, "max_norm is NaN");
  const sk::Buffer<const float> null_buf{nullptr, 3};
  test::expect_error([&] { sk::grad_norm_cpu<float>(std::span(&null_buf, 1), sk::NormType::L2); }, "data pointer is null");
}

// ---- the CUDA kernels' work split, checked on the CPU ------------------------------------------------------

// The tile layout every streaming kernel uses (256 threads, 2 quads): each element of a chunk is visited
// exactly once by the vector path plus the scalar tail, for chunk lengths around the tile and chunk sizes.
TEST(TileLayout, VectorPathPlusTailCoverEveryElementOnce) {
  for (int threads : {256, 128, 32}) {
    for (int quads : {1, 2, 4}) {
      const std::int64_t tile = sk::tile_elems(threads, quads);
      for (std::int64_t len :
           {std::int64_t(1), std::int64_t(3), std::int64_t(4), tile - 1, tile, tile + 1, sk::kChunkElems - 1, sk::kChunkElems}) {
        const std::int64_t begin = 3 * sk::kChunkElems, end = begin + len;
        std::vector<int> hits(std::size_t(len), 0);
        const std::int64_t vend = sk::vector_end(begin, end, tile);
        ASSERT_EQ((vend - begin) % tile, 0);
        for (std::int64_t base = begin; base < vend; base += tile)
          for (int t = 0; t < threads; ++t)
            for (int q = 0; q < quads; ++q) {
              const std::int64_t i0 = sk::quad_start(base, t, q, threads);
              ASSERT_EQ(i0 % sk::kQuad, 0) << "quads stay 4-element aligned";
              for (int j = 0; j < sk::kQuad; ++j) {
                ASSERT_TRUE(i0 + j >= begin && i0 + j < vend) << "vector path out of its tiles";
                ++hits[std::size_t(i0 + j - begin)];
              }
            }
        for (int t = 0; t < threads; ++t)
          for (std::int64_t i = vend + t; i < end; i += threads) ++hits[std::size_t(i - begin)];
        for (std::int64_t i = 0; i < len; ++i)
          ASSERT_EQ(hits[std::size_t(i)], 1) << "threads " << threads << " quads " << quads << " len " << len << " i " << i;
      }
    }
  }
}

// Chunk -> tensor lookup of the one-launch kernels: empty tensors own no chunk, every chunk has one owner.
TEST(TensorList, ChunkLookupSkipsEmptyTensors) {
  struct E {
    std::int64_t n;
  };
  const std::vector<E> entries = {{0}, {1}, {0}, {sk::kChunkElems}, {sk::kChunkElems + 1}, {0}, {5 * sk::kChunkElems - 3}, {0}};
  const auto prefix = sk::chunk_prefix_of(std::span<const E>(entries));
  ASSERT_EQ(prefix.back(), 1 + 1 + 2 + 5);
  const sk::TensorTable<E> table{entries.data(), prefix.data(), int(entries.size()), prefix.back()};
  std::vector<std::int64_t> seen(entries.size(), 0);
  for (std::int64_t c = 0; c < table.chunks; ++c) {
    const int i = sk::tensor_of_chunk(table, c);
    ASSERT_GT(entries[std::size_t(i)].n, 0) << "chunk " << c;
    const std::int64_t local = c - prefix[std::size_t(i)];
    ASSERT_LT(local * sk::kChunkElems, entries[std::size_t(i)].n);
    ++seen[std::size_t(i)];
  }
  for (std::size_t i = 0; i < entries.size(); ++i) EXPECT_EQ(seen[i], sk::chunks_of(entries[i].n));
  test::expect_error(
      [] {
        const std::vector<E> bad = {{-1}};
        sk::chunk_prefix_of(std::span<const E>(bad));
      },
      "negative element count");
}

}  // namespace
