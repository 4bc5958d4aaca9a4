// optim::FlatAdamW on the host backend (Offload<Host>): the Strategy's Precision / Accumulate / loss scaling
// wiring, checked bitwise against the same kernel sequence spelled out by hand, and against float64.
#include <limits>

#include "squeeze/optim/adamw.hpp"
#include "test_util.hpp"

namespace sk = squeeze::kernels;
using namespace squeeze;

namespace {

using MixedAcc4 = Strategy<Sharded<Stage1>, Offload<Host>, Precision<bf16, float>, Accumulate<4>>;
using HalfScaled = Strategy<Sharded<Stage2>, Offload<Host>, Precision<half, float>>;
using Fp32Host = Strategy<Sharded<Stage1>, Offload<Host>>;

static_assert(std::is_same_v<optim::FlatAdamW<MixedAcc4>::param_type, bf16>);
static_assert(std::is_same_v<optim::FlatAdamW<MixedAcc4>::step_grad_type, float>, "Accumulate<4>: the update reads fp32 sums");
static_assert(optim::FlatAdamW<HalfScaled>::scales_loss && !optim::FlatAdamW<MixedAcc4>::scales_loss);
static_assert(std::is_same_v<optim::FlatAdamW<HalfScaled>::step_grad_type, half>);
static_assert(!optim::FlatAdamW<Fp32Host>::has_master);

TEST(FlatAdamWHost, MixedPrecisionAccumulate4MatchesTheKernelSequence) {
  std::mt19937 rng(5);
  const AdamW o{.lr = 1e-2f, .weight_decay = 0.1f, .max_grad_norm = 0.5f};
  const std::int64_t n0 = 1023, n1 = 7;
  auto p0 = test::random_vec<bf16>(n0, rng, -1.f, 1.f), p1 = test::random_vec<bf16>(n1, rng, -1.f, 1.f);
  std::vector<bf16> g0(n0), g1(n1);
  // The hand-written reference: same buffers, kernels called directly.
  auto rp0 = p0, rp1 = p1;
  std::vector<float> rmaster0(n0), rmaster1(n1), rm0(n0), rv0(n0), rm1(n1), rv1(n1), acc0(n0), acc1(n1);
  for (std::int64_t i = 0; i < n0; ++i) rmaster0[i] = to_float(p0[i]);
  for (std::int64_t i = 0; i < n1; ++i) rmaster1[i] = to_float(p1[i]);

  optim::FlatAdamW<MixedAcc4> opt(o);
  opt.add_group(p0.data(), g0.data(), n0);
  opt.add_group(p1.data(), g1.data(), n1, {.lr_scale = 0.5f, .weight_decay = 0.f});
  const float weights[4] = {0.1f, 0.4f, 0.3f, 0.2f};  // token shares of 4 micro-batches
  for (int step = 1; step <= 3; ++step) {
    for (int k = 0; k < 4; ++k) {
      const auto r0 = test::random_vec<bf16>(n0, rng, -1.f, 1.f), r1 = test::random_vec<bf16>(n1, rng, -1.f, 1.f);
      std::copy(r0.begin(), r0.end(), g0.begin());  // in place: the optimizer holds g0's pointer
      std::copy(r1.begin(), r1.end(), g1.begin());
      opt.accumulate(weights[k]);
      sk::accumulate_cpu(sk::AccumTensor<bf16>{acc0.data(), g0.data(), n0}, weights[k], k == 0);
      sk::accumulate_cpu(sk::AccumTensor<bf16>{acc1.data(), g1.data(), n1}, weights[k], k == 0);
    }
    const auto r = opt.step();
    ASSERT_TRUE(r.applied.has_value());
    EXPECT_TRUE(*r.applied);
    float clip = 0, found = 0;
    const std::vector<sk::Buffer<const float>> grads = {{acc0.data(), n0}, {acc1.data(), n1}};
    sk::grad_norm_cpu<float>(grads, sk::NormType::L2, o.max_grad_norm, nullptr, {nullptr, &clip, &found});
    EXPECT_LT(clip, 1.f) << "the test should exercise clipping";
    EXPECT_EQ(opt.last_clip_coef(), clip);
    const sk::AdamWDynamic d{nullptr, &found, &clip, nullptr};
    sk::adamw_cpu(sk::AdamWTensor<bf16, float>{rp0.data(), rmaster0.data(), acc0.data(), rm0.data(), rv0.data(), n0},
                  sk::adamw_coeffs(o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, step), d);
    sk::adamw_cpu(sk::AdamWTensor<bf16, float>{rp1.data(), rmaster1.data(), acc1.data(), rm1.data(), rv1.data(), n1},
                  sk::adamw_coeffs(o.lr * 0.5f, o.beta1, o.beta2, o.eps, 0.f, step), d);
  }
  EXPECT_TRUE(test::bits_equal(p0, rp0));
  EXPECT_TRUE(test::bits_equal(p1, rp1));
  EXPECT_TRUE(test::bits_equal(std::vector<float>(opt.master(0), opt.master(0) + n0), rmaster0));
  EXPECT_TRUE(test::bits_equal(std::vector<float>(opt.exp_avg_sq(1), opt.exp_avg_sq(1) + n1), rv1));
  EXPECT_EQ(opt.applied_steps(), 3);
}

// fp16 with dynamic loss scaling: an overflow step changes nothing but the scale; the applied steps
// match a float64 AdamW on the unscaled gradients. Tolerance: |err| <= 1e-5 * max(1, |w|) on the master.
TEST(FlatAdamWHost, HalfLossScalingSkipsOverflowStepsAndMatchesFloat64) {
  std::mt19937 rng(6);
  AdamW o{.lr = 1e-2f, .weight_decay = 0.05f};
  o.loss_scale.init_scale = 1024.f;
  const std::int64_t n = 1023;
  auto p = test::random_vec<half>(n, rng, -1.f, 1.f);
  std::vector<half> g(n);
  std::vector<double> w(n), m(n, 0.0), v(n, 0.0);
  for (std::int64_t i = 0; i < n; ++i) w[i] = to_float(p[i]);
  optim::FlatAdamW<HalfScaled> opt(o);
  opt.add_group(p.data(), g.data(), n);
  std::int64_t t = 0;
  for (int it = 0; it < 4; ++it) {
    const float scale = opt.loss_scale();
    const auto true_g = test::random_vec<float>(n, rng, -0.01f, 0.01f);
    for (std::int64_t i = 0; i < n; ++i) g[i] = from_float<half>(true_g[i] * scale);
    const bool overflow = it == 1;
    if (overflow) g[100] = from_float<half>(std::numeric_limits<float>::infinity());
    const auto master0 = std::vector<float>(opt.master(0), opt.master(0) + n);
    const auto m0 = std::vector<float>(opt.exp_avg(0), opt.exp_avg(0) + n);
    const auto params0 = p;
    const auto r = opt.step();
    EXPECT_EQ(*r.applied, !overflow) << "iteration " << it;
    if (overflow) {
      EXPECT_TRUE(test::bits_equal(std::vector<float>(opt.master(0), opt.master(0) + n), master0));
      EXPECT_TRUE(test::bits_equal(std::vector<float>(opt.exp_avg(0), opt.exp_avg(0) + n), m0));
      EXPECT_TRUE(test::bits_equal(p, params0));
      EXPECT_EQ(opt.loss_scale(), scale / 2);
      continue;
    }
    ++t;
    const double bc1 = 1 - std::pow(0.9, double(t)), bc2 = 1 - std::pow(0.999, double(t));
    for (std::int64_t i = 0; i < n; ++i) {
      const double gi = double(to_float(g[i])) / scale;  // what the optimizer sees: the half grad, unscaled
      m[i] = 0.9 * m[i] + 0.1 * gi;
      v[i] = 0.999 * v[i] + 0.001 * gi * gi;
      w[i] = w[i] * (1 - 1e-2 * 0.05) - 1e-2 / bc1 * m[i] / (std::sqrt(v[i] / bc2) + 1e-8);
    }
  }
  EXPECT_EQ(opt.applied_steps(), 3);
  for (std::int64_t i = 0; i < n; ++i) {
    ASSERT_LE(std::abs(opt.master(0)[i] - w[i]), 1e-5 * std::max(1.0, std::abs(w[i]))) << "i=" << i;
    ASSERT_TRUE(test::bits_equal(std::vector<half>{p[i]}, std::vector<half>{from_float<half>(opt.master(0)[i])}));
  }
}

TEST(FlatAdamWHost, Fp32WithoutExtrasIsExactlyTheKernel) {
  std::mt19937 rng(8);
  const AdamW o{.lr = 3e-3f};
  const std::int64_t n = (std::int64_t(1) << 20) + 3;
  auto p = test::random_vec<float>(n, rng, -1.f, 1.f), g = test::random_vec<float>(n, rng, -1.f, 1.f);
  auto rp = p;
  std::vector<float> m(n, 0.f), v(n, 0.f);
  optim::FlatAdamW<Fp32Host> opt(o);
  opt.add_group(p.data(), g.data(), n);
  for (int t = 1; t <= 2; ++t) {
    opt.step();
    sk::adamw_cpu(sk::AdamWTensor<float, float>{rp.data(), nullptr, g.data(), m.data(), v.data(), n},
                  sk::adamw_coeffs(o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, t));
  }
  EXPECT_TRUE(test::bits_equal(p, rp));
  EXPECT_EQ(opt.master(0), p.data()) << "float params are their own master";
}

TEST(FlatAdamWHost, BadInputGivesClearErrors) {
  std::vector<bf16> p(8), g(8);
  test::expect_error([] { optim::FlatAdamW<MixedAcc4> bad(AdamW{.beta1 = 1.f}); }, "beta1");
  test::expect_error([] { optim::FlatAdamW<MixedAcc4> bad(AdamW{.max_grad_norm = NAN}); }, "max_norm is NaN");
  optim::FlatAdamW<MixedAcc4> opt(AdamW{});
  test::expect_error([&] { opt.step(); }, "no parameter groups");
  test::expect_error([&] { opt.add_group(nullptr, g.data(), 8); }, "params pointer is null");
  test::expect_error([&] { opt.add_group(p.data(), nullptr, 8); }, "grads pointer is null");
  test::expect_error([&] { opt.add_group(p.data(), g.data(), 0); }, "n must be > 0");
  opt.add_group(p.data(), g.data(), 8);
  opt.accumulate();
  opt.accumulate();
  test::expect_error([&] { opt.step(); }, "needs 4 accumulate() calls per step, got 2");
  opt.accumulate();
  opt.accumulate();
  test::expect_error([&] { opt.accumulate(); }, "already 4 micro-batches");
  test::expect_error([&] { opt.accumulate(NAN); }, "already 4");
  EXPECT_TRUE(*opt.step().applied);
  test::expect_error([&] { opt.accumulate(NAN); }, "scale must be finite");
  test::expect_error([&] { opt.set_lr(-1.f); }, "lr must be finite and >= 0");
}

}  // namespace
