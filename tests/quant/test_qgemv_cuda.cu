// The streaming 4-bit GEMM for batches 1..16 (bench/quant/qgemv.cuh, an experiment) against the CPU twin (label cuda), and its work split
// (host logic, runs without a GPU). Its own small binary, so the GPU machine builds it in about a minute. Bound: the kernel multiplies x by
// the exact integers q - z in fp32 and scales each 64-k chunk's sum once, as the mma.sync kernel's exact modes: 1e-5 of sum |x w| + one ulp
// of T (fp32 sums in another order than the twin's).
#include "quant_cuda_common.cuh"

#include "../../bench/quant/qgemv.cuh"

namespace {

// Parts fill the resident warps (never more than the chunks), K parts cover every chunk once with lengths that differ
// by at most one, the workspace matches.
TEST(QGemvPlan, PartsFillTheResidentWarps) {
  struct Case {
    std::int64_t K, N;
    int sm, wps, override_parts, parts;
  };
  for (const Case& c : std::vector<Case>{{4096, 4096, 132, 16, 0, 16},  // 128 groups of 2 tiles, 2112 warps: 16 parts
                                         {8192, 28672, 132, 12, 0, 1},  // 896 groups > 1584 / 2: one part
                                         {11008, 4096, 132, 8, 0, 8},   // 1056 / 128
                                         {4096, 11008, 132, 16, 0, 6},  // 2112 / 344
                                         {1096, 203, 132, 16, 0, 18},   // capped at 18 chunks
                                         {1096, 203, 132, 16, 7, 7},    // forced
                                         {64, 16, 132, 16, 0, 1}}) {    // one chunk
    const std::int64_t Kpad = (c.K + 63) / 64 * 64, Npad = (c.N + 15) / 16 * 16, kchunks = Kpad / 64;
    const kq::QGemmShape s{1, c.N, c.K, Kpad, Npad, 128, 4};
    const auto p = kq::plan_qgemv(s, 2, c.sm, c.wps, c.override_parts);
    SCOPED_TRACE("K " + std::to_string(c.K) + " N " + std::to_string(c.N) + ": " + kq::describe(p));
    EXPECT_EQ(p.groups, (Npad / 16 + 1) / 2);
    EXPECT_EQ(p.parts, c.parts);
    EXPECT_EQ(p.warps, p.groups * p.parts);
    EXPECT_EQ(p.blocks, (p.warps + 3) / 4);
    EXPECT_EQ(p.partial_elems, p.parts > 1 ? p.groups * p.parts * 8 * 16 * 2 : 0);
    EXPECT_EQ(p.counter_elems, p.parts > 1 ? p.groups : 0);
    std::int64_t covered = 0, most = 0, least = kchunks;
    for (int part = 0; part < p.parts; ++part) {  // the kernel's K range of a part
      const std::int64_t kc0 = part * kchunks / p.parts, kc1 = (part + 1) * kchunks / p.parts;
      ASSERT_EQ(kc0, covered);
      covered = kc1;
      most = std::max(most, kc1 - kc0);
      least = std::min(least, kc1 - kc0);
    }
    EXPECT_EQ(covered, kchunks);
    EXPECT_GE(least, 1);
    EXPECT_LE(most - least, 1);
  }
}

TEST(QGemvPlan, RejectsShapesItCannotTake) {
  const kq::QGemmShape ok{16, 4096, 4096, 4096, 4096, 128, 4};
  EXPECT_EQ(kq::qgemv_reason(ok), "");
  auto with = [&](auto f) {
    auto s = ok;
    f(s);
    return kq::qgemv_reason(s);
  };
  EXPECT_NE(with([](auto& s) { s.bits = 3; }).find("4-bit"), std::string::npos);
  EXPECT_NE(with([](auto& s) { s.M = 17; }).find("1..16"), std::string::npos);
  EXPECT_NE(with([](auto& s) { s.K = 4092; }).find("multiple of 8"), std::string::npos);
  EXPECT_NE(with([](auto& s) { s.group = 32; }).find("multiple of 64"), std::string::npos);
  EXPECT_NE(with([](auto& s) { s.Npad = 4112; }).find("padding"), std::string::npos);
}

// Configuration C on a twin case with `parts` K parts (0: the plan's own), reps launches on the same counters.
template <class T, class C>
void qgemv_runs(const TwinCase<T>& tc, int parts, int reps) {
  const auto plan = kq::plan_qgemv(tc.shape, C::NT, sm_count(), kq::detail::qgemv_warps_per_sm<T, C>(tc.shape.M <= 8 ? 1 : 2), parts);
  launches_match_twin(tc, plan.partial_elems, plan.counter_elems, reps, kq::detail::qgemv_cfg_name<C>() + " (" + kq::describe(plan) + ")",
                      1e-5, [&](const kq::QGemmWorkspace& ws) {
                        return kq::detail::launch_qgemv_cfg<T, C>(tc.dx.p, tc.dt.p, tc.ds.p, tc.dz.p, tc.dy.p, tc.shape, plan, ws, nullptr);
                      });
}
template <class T, class... Cs>
void qgemv_all_cfgs(kq::detail::QGemvCfgList<Cs...>, const TwinCase<T>& tc) {
  // one part (y stored directly), 2 and 7 parts (uneven K ranges), one chunk per part (18), the plan's own
  for (const int parts : {1, 2, 7, 18, 0}) (qgemv_runs<T, Cs>(tc, parts, 2), ...);
}

// Every configuration, fp16 and bf16, M 1 / 3 / 8 / 9 / 16 (one and two n8 batch blocks, partial ones), N 203 (a
// partial column group and tile), K 1096 (padded to 1152: x past K reads zero), groups of 128 with act-order (x
// gathered by perm), of 64, and per channel.
TEST(QGemvCuda, EveryConfigurationMatchesCpuTwin) {
  REQUIRE_DEVICE();
  for (int group : {128, 64, 0}) {
    const auto p = random_layer(203, 1096, 4, group, group == 128, 501 + group);
    const auto t = quant::to_tiles(p);
    for (std::int64_t M : {1, 3, 8, 9, 16}) {
      SCOPED_TRACE("group " + std::to_string(group) + " M " + std::to_string(M));
      qgemv_all_cfgs(kq::detail::QGemvTuningCfgs{}, TwinCase<bf16>(p, t, M));
      if (::testing::Test::HasFatalFailure()) return;
      qgemv_all_cfgs(kq::detail::QGemvTuningCfgs{}, TwinCase<half>(p, t, M));
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// qgemv_cuda with its own plan (the occupancy calculator's warps) on a LLaMA-sized layer, repeatedly.
TEST(QGemvCuda, LargeLayerRepeatedly) {
  REQUIRE_DEVICE();
  const auto p = random_layer(4096, 4096, 4, 128, false, 9);
  const auto t = quant::to_tiles(p);
  const int sm = sm_count();
  for (const std::int64_t M : {1, 16}) {
    const TwinCase<bf16> tc(p, t, M);
    const auto need = kq::qgemv_workspace_size<bf16>(tc.shape, sm);
    launches_match_twin(tc, need.partial_elems, need.counter_elems, 4,
                        "qgemv_cuda (" + kq::describe(kq::qgemv_plan<bf16>(tc.shape, sm)) + ")", 1e-5, [&](const kq::QGemmWorkspace& ws) {
                          return kq::qgemv_cuda(tc.dx.p, tc.dt.p, tc.ds.p, tc.dz.p, tc.dy.p, tc.shape, ws, sm, nullptr);
                        });
    if (::testing::Test::HasFatalFailure()) return;
    // a workspace smaller than the plan's is refused before any launch
    if (need.partial_elems > 0) {
      Dev<float> part(std::size_t(need.partial_elems));
      Dev<int> cnt(std::vector<int>(std::size_t(need.counter_elems), 0));
      EXPECT_EQ(kq::qgemv_cuda(tc.dx.p, tc.dt.p, tc.ds.p, tc.dz.p, tc.dy.p, tc.shape,
                               kq::QGemmWorkspace{part.p, need.partial_elems - 1, cnt.p, need.counter_elems}, sm, nullptr),
                cudaErrorInvalidValue);
    }
  }
}

}  // namespace
