// CUDA quant kernels against their CPU twins (label cuda; skips without a device). Dequantize: test_dequant_cuda.cu.
// Tolerances: gemv and the int4 GEMM sum in a different order than their twins: |gpu - twin| <= 1e-5 * sum|x w| + one
// ulp of the output type.
// The 3/4/8-bit GEMM is checked in every configuration the benchmark times, with and without K splits.
// The sm_90 wgmma GEMM and the library's GEMM entry: test_quant_sm90.cu (binary test_quant_sm90).
#include "quant_cuda_common.cuh"

TEST(QuantCuda, GemvMatchesCpuTwin) {
  REQUIRE_DEVICE();
  for (int bits : {2, 3, 4, 8})
    for (int M : {1, 3, 9}) {
      const auto p = random_layer(301, 520, bits, 64, false, 9 + bits);
      DevLayer d(p);
      const kq::GptqView hv{p.qweight.data(), p.qzeros.data(), p.scales.data(), p.g_idx.data(), p.in, p.out, p.bits};
      const auto x = random_x<half>(M * p.in, 4);
      std::vector<half> ref(M * p.out);
      kq::gemv_cpu(hv, x.data(), ref.data(), M);
      Dev<half> dx(x), dy(ref.size());
      Dev<float> acc(ref.size());
      SQUEEZE_CUDA_CHECK(kq::gemv_cuda(d.view(p), dx.p, dy.p, M, acc.p, nullptr));
      const auto got = dy.get();
      for (std::size_t k = 0; k < ref.size(); ++k)
        ASSERT_NEAR(to_float(got[k]), to_float(ref[k]), 1e-3 + 2 * ulp<half>(to_float(ref[k]))) << bits << " M " << M << " " << k;
    }
}

struct GemmCase {
  std::int64_t M, N, K;
  int group;
  bool act_order;
  int bits;
};
template <class T>
void qgemm_check(const quant::PackedLinear& p, const GemmCase& c) {
  const auto t = quant::to_tiles(p);
  const auto x = kernel_order_x<T>(t, c.M, c.K, 17);
  std::vector<T> ref(c.M * c.N);
  const auto shape = t.shape(c.M);
  kq::qgemm_cpu(x.data(), t.tiles.data(), t.scales.data(), t.zeros.data(), ref.data(), shape);
  const auto mag = magnitudes(p, t, x, c.M);
  Dev<T> dx(x), dy(ref.size());
  Dev<std::uint32_t> dt(t.tiles);
  Dev<half> ds(t.scales);
  Dev<std::uint8_t> dz(t.zeros);
  const int sm = sm_count();
  for (int cps : {0, 1, 3}) {  // the library's plan, and forced K splits (many partials to reduce)
    auto need = kq::qgemm_workspace_size(shape, sm, cps);
    SCOPED_TRACE("plan: " + kq::describe(kq::qgemm_plan(shape, sm, cps)));
    Dev<float> part(std::size_t(std::max<std::int64_t>(need.partial_elems, 1)));
    Dev<int> cnt(std::vector<int>(std::size_t(std::max<std::int64_t>(need.counter_elems, 1)), 0));
    const kq::QGemmWorkspace ws{part.p, need.partial_elems, cnt.p, need.counter_elems};
    for (int rep = 0; rep < 2; ++rep) {  // the second launch checks the split-K counters were reset
      SQUEEZE_CUDA_CHECK(cudaMemset(dy.p, 0xff, dy.n * sizeof(T)));
      SQUEEZE_CUDA_CHECK(kq::qgemm_cuda(dx.p, dt.p, ds.p, dz.p, dy.p, shape, ws, sm, nullptr, cps));
      SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
      expect_close_to_twin(mag, ref, dy.get(),
                           "bits " + std::to_string(c.bits) + " M " + std::to_string(c.M) + " N " + std::to_string(c.N) + " K " +
                               std::to_string(c.K) + " group " + std::to_string(c.group) + " cps " + std::to_string(cps) + " rep " +
                               std::to_string(rep));
      if (::testing::Test::HasFatalFailure()) return;
    }
    const auto counters = cnt.get();
    EXPECT_TRUE(std::all_of(counters.begin(), counters.end(), [](int v) { return v == 0; }));
  }
}
template <class T>
void qgemm_case(const GemmCase& c) {
  qgemm_check<T>(random_layer(c.N, c.K, c.bits, c.group, c.act_order, std::uint32_t(c.M + 31 * c.N + c.K + c.bits)), c);
}
class QuantCudaGemm : public ::testing::TestWithParam<GemmCase> {};
TEST_P(QuantCudaGemm, Fp16MatchesCpuTwin) {
  REQUIRE_DEVICE();
  qgemm_case<half>(GetParam());
}
TEST_P(QuantCudaGemm, Bf16MatchesCpuTwin) {
  REQUIRE_DEVICE();
  qgemm_case<bf16>(GetParam());
}
INSTANTIATE_TEST_SUITE_P(
    Shapes, QuantCudaGemm,
    ::testing::Values(GemmCase{1, 8, 64, 32, false, 4}, GemmCase{1, 4096, 4096, 128, false, 4}, GemmCase{7, 100, 200, 32, false, 4},
                      GemmCase{16, 1000, 1100, 128, true, 4}, GemmCase{17, 72, 520, 0, false, 4}, GemmCase{40, 333, 768, 64, false, 4},
                      GemmCase{64, 512, 2048, 128, false, 4}, GemmCase{100, 130, 384, 32, true, 4}, GemmCase{128, 256, 4096, 128, false, 4},
                      GemmCase{300, 48, 256, 128, false, 4}, GemmCase{1, 4096, 4096, 128, false, 8}, GemmCase{16, 1000, 1100, 128, true, 8},
                      GemmCase{40, 333, 770, 0, false, 8}, GemmCase{128, 256, 2048, 64, false, 8}, GemmCase{1, 4096, 4096, 128, false, 3},
                      GemmCase{3, 100, 200, 32, true, 3}, GemmCase{8, 1000, 1100, 128, false, 3}, GemmCase{17, 72, 520, 0, false, 3},
                      GemmCase{64, 256, 2048, 64, true, 3}));

TEST(QuantCuda, GemmZeroScaleGroupIsExactlyZero) {
  REQUIRE_DEVICE();
  for (int bits : {3, 4, 8}) {
    const GemmCase c{5, 40, 256, 64, true, bits};
    auto p = random_layer(c.N, c.K, bits, c.group, c.act_order, 77);
    p.scales[2 * p.out + 7] = from_float<half>(0.f);  // group 2 of column 7: all weights 0
    p.scales[0 * p.out + 39] = from_float<half>(0.f);
    qgemm_check<bf16>(p, c);
  }
}

// Every configuration the benchmark times (bench/quant/gemm_configs.cuh, TuningCfgs), on shapes that do not divide the
// tiles, with and without K splits: a configuration the library may switch to is correct before it is timed.
// Runs configuration C on the case for each (K range length, SM count the plan assumes), reps launches each
// (the same counters: the kernel leaves them zero), every result against the twin.
template <class T, class C, int BITS = 4>
void cfg_runs(const TwinCase<T>& tc, const std::vector<std::pair<int, int>>& runs, int reps) {
  // scaled-B configurations round each weight (q - z) * s to T once: fp16 2^-11 relative; bf16 2^-9 for the
  // scale's rounding to bf16 and 2^-9 for the product; bounds: twice that, per unit of sum |x w|
  // folded zero points with the weights as A: the fp32 sums carry (magic + q) * x, magic = 1024 for fp16, and the
  // column sums of x come from the tensor core's fp32 accumulation (truncating): each rounding costs up to
  // magic * 2^-24 of sum |x| * scale, which is sum |x w| / |q - z| (small at 3 bits). Measured on the H200
  // (b073755, e8d7c8e): fp16 errors up to 7.5e-5 of sum |x w| (3-bit, persistent r8w4n2p16bp2zx at M 13),
  // above the exact modes' 1e-5; bound 2^-12. bf16's magic is 128: the exact modes' bound holds.
  const double zfold_rel = C::ZFOLD && C::SWAP && std::is_same_v<T, half> ? 0x1p-12 : 1e-5;
  const double rel = C::SCALEB ? (std::is_same_v<T, bf16> ? 0x1p-7 : 0x1p-10) : zfold_rel;
  for (const auto& [cps, sm] : runs) {
    const auto plan = kq::plan_qgemm(tc.shape, kq::qgemm_geometry<C, BITS>(), sm, cps);
    SCOPED_TRACE(kq::detail::cfg_name<C>() + ": " + kq::describe(plan));
    Dev<float> part(std::size_t(std::max<std::int64_t>(plan.partial_elems, 1)));
    Dev<int> cnt(std::vector<int>(std::size_t(plan.counter_elems), 0));
    const kq::QGemmWorkspace ws{part.p, plan.partial_elems, cnt.p, plan.counter_elems};
    for (int rep = 0; rep < reps; ++rep) {
      SQUEEZE_CUDA_CHECK(cudaMemset(tc.dy.p, 0xff, tc.dy.n * sizeof(T)));
      SQUEEZE_CUDA_CHECK(
          (kq::detail::launch_qgemm_cfg<T, BITS, C>(tc.dx.p, tc.dt.p, tc.ds.p, tc.dz.p, tc.dy.p, tc.shape, plan, ws, nullptr)));
      SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
      expect_close_to_twin(tc.mag, tc.ref, tc.dy.get(),
                           kq::detail::cfg_name<C>() + " bits " + std::to_string(BITS) + " M " + std::to_string(tc.M) + " N " +
                               std::to_string(tc.shape.N) + " K " + std::to_string(tc.shape.K) + " cps " + std::to_string(cps) +
                               " splits " + std::to_string(plan.splits) + " items/block " + std::to_string(plan.items_per_block) + " rep " +
                               std::to_string(rep),
                           rel);
      if (::testing::Test::HasFatalFailure()) return;
    }
    const auto counters = cnt.get();
    EXPECT_TRUE(std::all_of(counters.begin(), counters.end(), [](int v) { return v == 0; })) << kq::detail::cfg_name<C>();
  }
}
template <class T, class C, int BITS = 4>
void cfg_check(const quant::PackedLinear& p, const quant::QTiles& t, std::int64_t M) {
  const TwinCase<T> tc(p, t, M);
  // (K range length, SM count the plan assumes): persistent-grid configurations also run on a plan for 3 SMs,
  // so every block walks many consecutive items (x slices restaged, split partials reduced mid-sequence)
  std::vector<std::pair<int, int>> runs = {{0, sm_count()}, {2, sm_count()}, {5, sm_count()}};
  if constexpr (C::PERSIST > 0) runs.insert(runs.end(), {{0, 3}, {2, 3}, {5, 1}});
  cfg_runs<T, C, BITS>(tc, runs, 2);
}
template <class T, class... Cs>
void all_cfgs(bg::CfgList<Cs...>, const quant::PackedLinear& p, const quant::QTiles& t, std::int64_t M) {
  (cfg_check<T, Cs>(p, t, M), ...);
}
TEST(QuantCuda, EveryTunedConfigurationMatchesCpuTwin) {
  REQUIRE_DEVICE();
  // N = 300 (odd tile count: a warp's second tile past N), K = 1000 (padded), act-order groups of 64
  const auto p = random_layer(300, 1000, 4, 64, true, 91);
  const auto t = quant::to_tiles(p);
  for (std::int64_t M : {1, 5, 16, 37, 70}) {
    all_cfgs<bf16>(bg::TuningCfgs{}, p, t, M);
    all_cfgs<half>(bg::TuningCfgs{}, p, t, M);
  }
}
// The bulk loader (one producer warp, whole-strip chunks) at every width and group kind: N = 200 (13 tiles:
// the last strip is partial, so fewer consumer warps take part and its copy is shorter), K = 1100 (padded
// to 1152), groups of 32 (two per chunk), 128 and per channel, M not a multiple of the rows per block.
template <class T, int BITS, class C>
void bulk_check(const quant::PackedLinear& p, const quant::QTiles& t, std::int64_t M) {
  if constexpr (C::LOADER == kq::QGemmLoader::Bulk) cfg_check<T, C, BITS>(p, t, M);
}
template <class T, int BITS, class... Cs>
void bulk_cfgs(bg::CfgList<Cs...>, const quant::PackedLinear& p, const quant::QTiles& t, std::int64_t M) {
  (bulk_check<T, BITS, Cs>(p, t, M), ...);
}
template <int BITS>
void bulk_all_groups() {
  for (int group : {32, 128, 0}) {
    const auto p = random_layer(200, 1100, BITS, group, group == 128, 101 + BITS + group);
    const auto t = quant::to_tiles(p);
    for (std::int64_t M : {3, 17, 70}) {
      SCOPED_TRACE("group " + std::to_string(group) + " M " + std::to_string(M));
      bulk_cfgs<bf16, BITS>(bg::TuningCfgs{}, p, t, M);
      bulk_cfgs<half, BITS>(bg::TuningCfgs{}, p, t, M);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}
TEST(QuantCuda, BulkLoaderMatchesCpuTwinAt3Bits) {
  REQUIRE_DEVICE();
  bulk_all_groups<3>();
}
TEST(QuantCuda, BulkLoaderMatchesCpuTwinAt4Bits) {
  REQUIRE_DEVICE();
  bulk_all_groups<4>();
}
TEST(QuantCuda, BulkLoaderMatchesCpuTwinAt8Bits) {
  REQUIRE_DEVICE();
  bulk_all_groups<8>();
}

// Weights as the mma A operand (SWAP configurations, batch 1..16): every width (3/4/8 bits: the decoded word is
// the A fragment), groups of 32 (two per chunk), 128 and per channel, folded zero points (z) and scaled B (s);
// N = 200 (13 tiles: the last warp's second tile past N, a partial last strip), K = 1100 (padded to 1152),
// M = 1, 7 (a partial batch block), 13 (16 rows: a partial second block), 16. Tolerances as in cfg_runs.
template <class T, int BITS, class C>
void swap_check(const quant::PackedLinear& p, const quant::QTiles& t, std::int64_t M) {
  if constexpr (C::SWAP && !(BITS == 3 && C::LOADER == kq::QGemmLoader::CpAsync)) cfg_check<T, C, BITS>(p, t, M);
}
template <class T, int BITS, class... Cs>
void swap_cfgs(bg::CfgList<Cs...>, const quant::PackedLinear& p, const quant::QTiles& t, std::int64_t M) {
  (swap_check<T, BITS, Cs>(p, t, M), ...);
}
template <int BITS>
void swap_all_groups() {
  for (int group : {32, 128, 0}) {
    const auto p = random_layer(200, 1100, BITS, group, group == 32, 211 + BITS + group);
    const auto t = quant::to_tiles(p);
    for (std::int64_t M : {1, 7, 13, 16}) {
      SCOPED_TRACE("group " + std::to_string(group) + " M " + std::to_string(M));
      swap_cfgs<bf16, BITS>(bg::TuningCfgs{}, p, t, M);
      swap_cfgs<half, BITS>(bg::TuningCfgs{}, p, t, M);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}
TEST(QuantCuda, WeightsAsAOperandMatchCpuTwinAt3Bits) {
  REQUIRE_DEVICE();
  swap_all_groups<3>();
}
TEST(QuantCuda, WeightsAsAOperandMatchCpuTwinAt4Bits) {
  REQUIRE_DEVICE();
  swap_all_groups<4>();
}
TEST(QuantCuda, WeightsAsAOperandMatchCpuTwinAt8Bits) {
  REQUIRE_DEVICE();
  swap_all_groups<8>();
}

// Large layers, many launches: every tuned configuration (compute mode) at the sizes where the GPU run of
// 4350b90 saw wrong results from two bulk-loader configurations (r32w4n2p8b, r32w4n2p8bp2 on K, N >= 4096
// at M 64 / 128, in the benchmark's single check; the small shapes above passed). Races show up only with
// many blocks in flight and many repetitions: 4096 x 4096 at M 16 and 64 (z slices), K ranges of 4 / 16
// chunks and the plan's own, 5 launches each; persistent configurations also on a 7-SM plan (long item
// sequences per block). Then a ragged layer (N 2096: partial last strip, K 3000: padded, groups of 32).
template <class T, class C>
void stress_cfg(const TwinCase<T>& tc, bool ragged) {
  if (ragged && C::LOADER != kq::QGemmLoader::Bulk) return;    // the ragged layer is for the bulk loader
  if (C::ROWS > 2 * std::max<std::int64_t>(tc.M, 16)) return;  // far from this batch (as the benchmark skips it)
  std::vector<std::pair<int, int>> runs = {{0, sm_count()}, {4, sm_count()}, {16, sm_count()}};
  if constexpr (C::PERSIST > 0) runs.insert(runs.end(), {{4, 7}, {16, 7}});
  cfg_runs<T, C>(tc, runs, 5);
}
template <class T, class... Cs>
void stress_cfgs(bg::CfgList<Cs...>, const TwinCase<T>& tc, bool ragged) {
  (stress_cfg<T, Cs>(tc, ragged), ...);
}
TEST(QuantCuda, EveryTunedConfigurationOnLargeLayersRepeatedly) {
  REQUIRE_DEVICE();
  {
    const auto p = random_layer(4096, 4096, 4, 128, false, 5);
    const auto t = quant::to_tiles(p);
    for (std::int64_t M : {16, 64}) {
      const TwinCase<bf16> tc(p, t, M);
      stress_cfgs(bg::TuningCfgs{}, tc, false);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  const auto p = random_layer(2096, 3000, 4, 32, true, 6);
  const auto t = quant::to_tiles(p);
  const TwinCase<half> tc(p, t, 48);
  stress_cfgs(bg::TuningCfgs{}, tc, true);
}

TEST(QuantCuda, GemmRejectsBadArguments) {
  REQUIRE_DEVICE();
  kq::QGemmShape s{1, 16, 64, 64, 16, 24};  // group not a multiple of 16
  EXPECT_EQ(kq::qgemm_cuda<half>(nullptr, nullptr, nullptr, nullptr, nullptr, s, {}, 132, nullptr), cudaErrorInvalidValue);
}
