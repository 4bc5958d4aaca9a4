// The sm_90 wgmma GEMM (qgemm_sm90.cuh) and the library's GEMM entry (quant_gemm_cuda) against the CPU twin
// (label cuda). The wgmma GEMM rounds each weight (q - z) * scale to T once: fp16 2^-10, bf16 2^-7 of sum|x w| + one
// ulp (as the scaled-B configurations of the mma.sync kernel); its tests skip unless the device is sm_90 and the
// build has sm_90a device code. The split-plan test is host logic and runs everywhere.
#include <cstring>

#include "quant_cuda_common.cuh"

// ---- sm_90 wgmma GEMM (qgemm_sm90.cuh, batch 33..128) ---------------------------------------------------
#define REQUIRE_SM90()                                                                                                \
  REQUIRE_DEVICE();                                                                                                   \
  if (!kq::qgemm_sm90_supported())                                                                                    \
  GTEST_SKIP() << "the wgmma GEMM needs an sm_90 device and sm_90a device code (configure with CMAKE_CUDA_ARCHITECTURES=90a)"

// Configuration C on a twin case for each K split count (0: the plan's own), reps launches each on the same
// counters (the kernel leaves them zero). Bound: each weight rounded to T once, as for scaled B (cfg_runs).
// A forced split count runs with each reduction: in a cluster, through global memory summed by every block of a tile
// (spread: the test grids fit the GPU at once) and by the tile's last block.
template <class T, class C>
void sm90_cfg_runs(const TwinCase<T>& tc, const std::vector<int>& split_counts, int reps) {
  const double rel = std::is_same_v<T, bf16> ? 0x1p-7 : 0x1p-10;
  if (C::GSCALE && tc.shape.group % 64) {  // per-group fp32 scaling takes groups of whole 64-k chunks only
    const auto plan = kq::plan_qgemm_sm90<C>(tc.shape, kq::detail::sm90_capacity<C>(sm_count()));
    EXPECT_EQ((kq::detail::launch_qgemm_sm90_cfg<T, C>(tc.dx.p, tc.dt.p, tc.ds.p, tc.dz.p, tc.dy.p, tc.shape, plan, {}, nullptr)), cudaErrorInvalidValue)
        << kq::detail::sm90_cfg_name<C>() << " group " << tc.shape.group;
    return;
  }
  for (const int sp : split_counts)
    for (const auto reduce : {kq::Sm90Reduce::Cluster, kq::Sm90Reduce::Global, kq::Sm90Reduce::GlobalLast}) {
      if (sp == 0 && reduce != kq::Sm90Reduce::Cluster) continue;  // the plan's own choice: once
      const auto plan = kq::plan_qgemm_sm90<C>(tc.shape, kq::detail::sm90_capacity<C>(sm_count()), sp, sp == 0 ? kq::Sm90Reduce::Auto : reduce);
      launches_match_twin(tc, plan.partial_elems, plan.counter_elems, reps, kq::detail::sm90_cfg_name<C>() + " (" + kq::describe(plan) + ")", rel,
                          [&](const kq::QGemmWorkspace& ws) {
                            return kq::detail::launch_qgemm_sm90_cfg<T, C>(tc.dx.p, tc.dt.p, tc.ds.p, tc.dz.p, tc.dy.p, tc.shape, plan, ws, nullptr);
                          });
      if (::testing::Test::HasFatalFailure()) return;
    }
}
template <class T, class... Cs>
void sm90_all_cfgs(kq::detail::CfgList<Cs...>, const TwinCase<T>& tc, const std::vector<int>& split_counts) {
  (sm90_cfg_runs<T, Cs>(tc, split_counts, 2), ...);
}
// Every configuration the benchmark times, fp16 and bf16, M 33 / 64 / 100 / 128 (partial batch slices: 33 and
// 100 are not multiples of 8), N 299 (odd: two strips of 256 or three of 128, the last partial, and a partial tile;
// y's rows are not 16-byte aligned, so the epilogue stores element by element) and with groups of 128 N 296 (16-byte
// rows, stored 8 features at a time; a partial tile), K 1096 (a multiple of 8, padded to 1152),
// groups of 32 with act-order (four groups per chunk, x gathered by perm), 128 and per channel; the plan's
// K splits and forced 1, 3 and 7, each summed in a cluster and both ways through global memory (sm90_cfg_runs). The GSCALE
// configurations refuse the groups of 32 (not whole 64-k chunks).
TEST(QuantCudaSm90, EveryConfigurationMatchesCpuTwin) {
  REQUIRE_SM90();
  for (int group : {32, 128, 0}) {
    const auto p = random_layer(group == 128 ? 296 : 299, 1096, 4, group, group == 32, 301 + group);
    const auto t = quant::to_tiles(p);
    for (std::int64_t M : {33, 64, 100, 128}) {
      SCOPED_TRACE("group " + std::to_string(group) + " M " + std::to_string(M));
      sm90_all_cfgs(kq::detail::Sm90TuningCfgs{}, TwinCase<bf16>(p, t, M), {0, 1, 3, 7});
      if (::testing::Test::HasFatalFailure()) return;
      sm90_all_cfgs(kq::detail::Sm90TuningCfgs{}, TwinCase<half>(p, t, M), {0, 1, 3, 7});
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}
// The mma.sync configurations (SYNC: Sm90Row8, Sm90Row8Large, 8-row slices) at the batches they are dispatched for and
// past them: M 1 / 5 / 8 / 11 (11: a second, partial slice), fp16 and bf16, N 299 / 296, K 1096, groups of 128, per
// channel and 32 (refused: GSCALE), the plan's K splits and forced 1, 3 and 7, each reduced the three ways.
TEST(QuantCudaSm90, MmaSyncConfigurationsMatchCpuTwin) {
  REQUIRE_SM90();
  using SyncCfgs = kq::detail::CfgList<kq::detail::Sm90Row8, kq::detail::Sm90Row8Large>;
  static_assert(kq::detail::Sm90Row8::SYNC && kq::detail::Sm90Row8Large::SYNC && kq::detail::Sm90Row8::BN == 8);
  for (int group : {128, 0, 32}) {
    const auto p = random_layer(group == 128 ? 296 : 299, 1096, 4, group, group == 32, 501 + group);
    const auto t = quant::to_tiles(p);
    for (std::int64_t M : {1, 5, 8, 11}) {
      SCOPED_TRACE("group " + std::to_string(group) + " M " + std::to_string(M));
      sm90_all_cfgs(SyncCfgs{}, TwinCase<bf16>(p, t, M), {0, 1, 3, 7});
      if (::testing::Test::HasFatalFailure()) return;
      sm90_all_cfgs(SyncCfgs{}, TwinCase<half>(p, t, M), {0, 1, 3, 7});
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}
// Tapered K ranges (sm90_taper: the lead ranges longer than the rest) give the CPU twin's result: the dispatched
// 16-row configurations (GSCALE among them: groups of 128 and per channel) and the 8-row mma.sync ones (M 9 / 16: two
// slices), fp16 and bf16, M 1 / 9 / 16, N 299 and
// 296, K 1096 (18 chunks; 7 K ranges asked, 6 given) summed by the tile's last block and spread, tapered 2 x 5 + 4 x 2
// and 3 x 5 + 3 x 1 chunks (groups of 128 cut by K ranges of odd length).
template <class T, class C>
void sm90_tapered_runs(const TwinCase<T>& tc) {
  const double rel = std::is_same_v<T, bf16> ? 0x1p-7 : 0x1p-10;
  for (const auto reduce : {kq::Sm90Reduce::GlobalLast, kq::Sm90Reduce::Global})
    for (const auto [lead, tail] : {std::pair{2, 2}, std::pair{3, 1}}) {
      auto plan = kq::plan_qgemm_sm90<C>(tc.shape, kq::detail::sm90_capacity<C>(sm_count()), 7, reduce);
      ASSERT_EQ(plan.splits, 6);  // 18 chunks: 6 ranges of 3 (no empty seventh)
      ASSERT_EQ(kq::sm90_taper(plan, tc.shape, lead, tail), "") << kq::describe(plan);
      launches_match_twin(tc, plan.partial_elems, plan.counter_elems, 2, kq::detail::sm90_cfg_name<C>() + " (" + kq::describe(plan) + ")", rel,
                          [&](const kq::QGemmWorkspace& ws) {
                            return kq::detail::launch_qgemm_sm90_cfg<T, C>(tc.dx.p, tc.dt.p, tc.ds.p, tc.dz.p, tc.dy.p, tc.shape, plan, ws, nullptr);
                          });
      if (::testing::Test::HasFatalFailure()) return;
    }
}
TEST(QuantCudaSm90, TaperedKRangesMatchCpuTwin) {
  REQUIRE_SM90();
  for (int group : {128, 0}) {
    const auto p = random_layer(group == 128 ? 296 : 299, 1096, 4, group, false, 401 + group);
    const auto t = quant::to_tiles(p);
    for (std::int64_t M : {1, 9, 16}) {
      SCOPED_TRACE("group " + std::to_string(group) + " M " + std::to_string(M));
      sm90_tapered_runs<bf16, kq::detail::Sm90Tiny>(TwinCase<bf16>(p, t, M));
      sm90_tapered_runs<half, kq::detail::Sm90TinyLarge>(TwinCase<half>(p, t, M));
      sm90_tapered_runs<bf16, kq::detail::Sm90TinyScaled>(TwinCase<bf16>(p, t, M));
      sm90_tapered_runs<half, kq::detail::Sm90TinyScaled>(TwinCase<half>(p, t, M));
      sm90_tapered_runs<bf16, kq::detail::Sm90Row8Large>(TwinCase<bf16>(p, t, M));
      sm90_tapered_runs<half, kq::detail::Sm90Row8>(TwinCase<half>(p, t, M));
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}
// qgemm_sm90_cuda (the configuration it picks by M, its own plan and 5 K splits: clusters of 5 blocks) on a
// LLaMA-sized layer, repeatedly (many blocks and clusters in flight), and a ragged one (N 2090, K 3000, groups of
// 32, act-order).
template <class T>
void sm90_dispatch_check(const quant::PackedLinear& p, std::int64_t M, int reps) {
  const auto t = quant::to_tiles(p);
  const TwinCase<T> tc(p, t, M);
  const double rel = std::is_same_v<T, bf16> ? 0x1p-7 : 0x1p-10;
  const int sm = sm_count();
  for (int sp : {0, 5, 12}) {  // 12: through global memory (more than a cluster holds)
    const auto need = kq::qgemm_sm90_workspace_size(tc.shape, sm, sp);
    launches_match_twin(tc, need.partial_elems, need.counter_elems, reps, "qgemm_sm90_cuda (" + kq::describe(kq::qgemm_sm90_plan(tc.shape, sm, sp)) + ")",
                        rel, [&](const kq::QGemmWorkspace& ws) {
                          return kq::qgemm_sm90_cuda(tc.dx.p, tc.dt.p, tc.ds.p, tc.dz.p, tc.dy.p, tc.shape, ws, sm, nullptr, sp);
                        });
    if (::testing::Test::HasFatalFailure()) return;
  }
}
TEST(QuantCudaSm90, DispatchOnLargeLayersRepeatedly) {
  REQUIRE_SM90();
  const auto big = random_layer(4096, 4096, 4, 128, false, 7);
  sm90_dispatch_check<bf16>(big, 64, 4);
  sm90_dispatch_check<half>(big, 128, 4);
  sm90_dispatch_check<bf16>(big, 16, 4);  // 16-row slices
  sm90_dispatch_check<half>(big, 24, 4);  // 32-row slices
  const auto ragged = random_layer(2090, 3000, 4, 32, true, 8);
  sm90_dispatch_check<bf16>(ragged, 100, 3);
  sm90_dispatch_check<half>(ragged, 33, 3);
}
// The timeline probe (Sm90Probe<Cfg, 3>, what bench_qgemm_sm90 --timeline runs) does the kernel's whole work, so its y
// matches the CPU twin, and each block's trace points come in program order: entry, set-up, first chunk, loop end, the
// epilogue's barriers, end (one SM's clock); the producer's first chunk queued before its last; the global timer at
// entry before the one at the end. One K range, and 3 K ranges summed each way: in a cluster, spread, and by the
// tile's last block (only that block reaches the stores).
TEST(QuantCudaSm90, TimelineProbeComputesAndTracesInOrder) {
  REQUIRE_SM90();
  using P = kq::Sm90Probe<kq::detail::Sm90Tiny, 3>;
  namespace slot = kq::detail::sm90_trace_slot;
  constexpr int kSlots = kq::detail::kSm90TraceSlots;
  const auto layer = random_layer(296, 1096, 4, 128, false, 77);
  const auto tiles = quant::to_tiles(layer);
  const TwinCase<bf16> tc(layer, tiles, 16);
  const int sms = sm_count();
  struct Way {
    int splits;
    kq::Sm90Reduce reduce;
  };
  for (const Way way : {Way{1, kq::Sm90Reduce::Global}, Way{3, kq::Sm90Reduce::Cluster}, Way{3, kq::Sm90Reduce::Global},
                        Way{3, kq::Sm90Reduce::GlobalLast}}) {
    const auto plan = kq::plan_qgemm_sm90<P>(tc.shape, kq::detail::sm90_capacity<P>(sms), way.splits, way.reduce);
    const std::string what = "timeline probe (" + kq::describe(plan) + ")";
    Dev<std::uint64_t> trace(std::size_t(plan.blocks()) * kSlots);
    SQUEEZE_CUDA_CHECK(cudaMemset(trace.p, 0, trace.n * sizeof(std::uint64_t)));
    launches_match_twin(tc, plan.partial_elems, plan.counter_elems, 1, what, 0x1p-7, [&](const kq::QGemmWorkspace& ws) {
      return kq::detail::launch_qgemm_sm90_cfg<bf16, P>(tc.dx.p, tc.dt.p, tc.ds.p, tc.dz.p, tc.dy.p, tc.shape, plan, ws, nullptr, trace.p);
    });
    if (::testing::Test::HasFatalFailure()) return;
    const std::vector<std::uint64_t> v = trace.get();
    std::int64_t stored = 0;
    for (std::int64_t b = 0; b < plan.blocks(); ++b) {
      const std::uint64_t* at = v.data() + b * kSlots;
      SCOPED_TRACE(what + " block " + std::to_string(b));
      EXPECT_GT(at[slot::Entry], 0u);
      EXPECT_LE(at[slot::Entry], at[slot::SetUp]);
      EXPECT_LE(at[slot::SetUp], at[slot::FirstChunk]);
      EXPECT_LE(at[slot::FirstChunk], at[slot::LoopEnd]);
      EXPECT_LE(at[slot::LoopEnd], at[slot::EpilogueWaited]);
      EXPECT_LE(at[slot::EpilogueWaited], at[slot::EpilogueStaged]);
      if (at[slot::EpilogueStored] != 0) {
        ++stored;
        EXPECT_LE(at[slot::EpilogueStaged], at[slot::EpilogueStored]);
        EXPECT_LE(at[slot::EpilogueStored], at[slot::End]);
      } else {
        EXPECT_LE(at[slot::EpilogueStaged], at[slot::End]);
      }
      EXPECT_LT(at[slot::Sm], std::uint64_t(sms));
      EXPECT_GT(at[slot::EntryNs], 0u);
      EXPECT_LE(at[slot::EntryNs], at[slot::EndNs]);
      EXPECT_GT(at[slot::ProducerStart], 0u);
      EXPECT_LE(at[slot::ProducerStart], at[slot::ProducerX]);
      EXPECT_LE(at[slot::ProducerX], at[slot::QueuedFirst]);
      EXPECT_LE(at[slot::QueuedFirst], at[slot::QueuedLast]);
    }
    const bool last_block = plan.splits > 1 && !plan.cluster && !plan.spread;
    EXPECT_EQ(stored, last_block ? std::int64_t(plan.zslices) * plan.strips : plan.blocks()) << what;
  }
}
// The library's entry (quant_gemm_cuda, what QuantizedLinear calls): on sm_90a builds the Hopper kernel for 4-bit
// layers at every M (8-row mma.sync slices up to M = 8 with groups of whole chunks, 16-row wgmma slices up to M = 16, 32-row up to 32 (one block per SM below kSm90NarrowLayer weights,
// three from kSm90LargeLayer),
// 64-row up to 64 with two tiles per warpgroup on large layers, 128-row slices above with four consumer warpgroups),
// mma.sync otherwise. The choice in words first (host
// logic, any device), then the results at M 1, 8, 9, 16, 17, 33 and 100 (16-row slices with 1 and 8 rows; each boundary
// between slice sizes), and of a 3-bit layer against the CPU twin.
TEST(QuantCudaSm90, LibraryEntryPicksTheKernelByBatch) {
  REQUIRE_DEVICE();
  const bool wg = kq::qgemm_sm90_supported();
  auto says = [](const kq::QGemmShape& s, int sm) { return kq::quant_gemm_describe(s, sm); };
  auto starts = [](const std::string& text, const std::string& head) { return text.rfind(head, 0) == 0; };
  const kq::QGemmShape wide{17, 28672, 8192, 8192, 28672, 128, 4}, narrow{64, 4096, 4096, 4096, 4096, 128, 4};
  EXPECT_TRUE(starts(says(wide, 132), wg ? "sm90 wg_b32m2s4x3w " : "mma.sync ")) << says(wide, 132);
  EXPECT_TRUE(starts(says(narrow, 132), wg ? "sm90 wg_b64m1s6x2w " : "mma.sync ")) << says(narrow, 132);
  EXPECT_TRUE(starts(says({65, 4096, 4096, 4096, 4096, 128, 4}, 132), wg ? "sm90 wg_b128m1s8wg4 " : "mma.sync "));
  EXPECT_TRUE(starts(says({128, 11008, 4096, 4096, 11008, 128, 4}, 132), wg ? "sm90 wg_b128m1s8wg4 " : "mma.sync "));
  EXPECT_TRUE(starts(says({65, 28672, 8192, 8192, 28672, 128, 4}, 132), wg ? "sm90 wg_b128m1s8wg4 " : "mma.sync "));
  // large layers with groups of whole 64-k chunks: per-group fp32 scaling (GSCALE); groups of 32 cannot take it
  EXPECT_TRUE(starts(says({16, 28672, 8192, 8192, 28672, 128, 4}, 132), wg ? "sm90 wg_b16m2s5x3wf " : "mma.sync "));
  EXPECT_TRUE(starts(says({9, 28672, 8192, 8192, 28672, 32, 4}, 132), wg ? "sm90 wg_b16m2s5x3w " : "mma.sync "));
  EXPECT_TRUE(starts(says({48, 28672, 8192, 8192, 28672, 128, 4}, 132), wg ? "sm90 wg_b64m2s8w " : "mma.sync "));  // large layer
  EXPECT_TRUE(starts(says({16, 4096, 4096, 4096, 4096, 128, 4}, 132), wg ? "sm90 wg_b16m2s8x2w " : "mma.sync "));
  EXPECT_TRUE(starts(says({9, 4096, 4096, 4096, 4096, 128, 4}, 132), wg ? "sm90 wg_b16m2s8x2w " : "mma.sync "));
  EXPECT_TRUE(starts(says({32, 4096, 11008, 11008, 4096, 128, 4}, 132), wg ? "sm90 wg_b32m2s6x2w " : "mma.sync "));
  EXPECT_TRUE(starts(says({24, 4096, 4096, 4096, 4096, 128, 4}, 132), wg ? "sm90 wg_b32m2s8w " : "mma.sync "));  // small layer
  EXPECT_TRUE(starts(says({24, 11008, 4096, 4096, 11008, 128, 4}, 132), wg ? "sm90 wg_b32m2s6x2w " : "mma.sync "));
  EXPECT_TRUE(starts(says({33, 4096, 11008, 11008, 4096, 128, 4}, 132), wg ? "sm90 wg_b64m1s6x2w " : "mma.sync "));
  // up to 8 rows with groups of whole chunks: mma.sync consumers in 8-row slices; groups of 32: 16-row wgmma slices
  EXPECT_TRUE(starts(says({8, 4096, 4096, 4096, 4096, 128, 4}, 132), wg ? "sm90 mma_b8m2s5x3wf " : "mma.sync "));
  EXPECT_TRUE(starts(says({1, 28672, 8192, 8192, 28672, 128, 4}, 132), wg ? "sm90 mma_b8m2s4x4wf " : "mma.sync "));
  EXPECT_TRUE(starts(says({8, 4096, 4096, 4096, 4096, 32, 4}, 132), wg ? "sm90 wg_b16m2s8x2w " : "mma.sync "));
  EXPECT_TRUE(starts(says({64, 28672, 8192, 8192, 28672, 128, 3}, 132), "mma.sync "));
  EXPECT_TRUE(starts(says({64, 28672, 8196, 8256, 28672, 128, 4}, 132), "mma.sync "));  // K % 8: the wgmma kernel declines
  const int sm = sm_count();
  for (const int bits : {4, 3}) {
    const auto p = random_layer(1000, 1096, bits, 32, bits == 4, 40 + bits);
    const auto t = quant::to_tiles(p);
    for (const std::int64_t M : {1, 8, 9, 16, 17, 33, 100}) {
      const TwinCase<bf16> tc(p, t, M);
      const auto need = kq::quant_gemm_workspace_size(tc.shape, sm);
      Dev<float> part(std::size_t(std::max<std::int64_t>(need.partial_elems, 1)));
      Dev<int> cnt(std::vector<int>(std::size_t(std::max<std::int64_t>(need.counter_elems, 1)), 0));
      const kq::QGemmWorkspace ws{part.p, need.partial_elems, cnt.p, need.counter_elems};
      SQUEEZE_CUDA_CHECK(kq::quant_gemm_cuda(tc.dx.p, tc.dt.p, tc.ds.p, tc.dz.p, tc.dy.p, tc.shape, ws, sm, nullptr));
      SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
      expect_close_to_twin(tc.mag, tc.ref, tc.dy.get(), "quant_gemm_cuda (" + says(tc.shape, sm) + ") M " + std::to_string(M), 0x1p-7);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}
// The H200's capacity (cudaOccupancyMaxActiveClusters, gemm4_probe-session10-run3.log): clusters of 1..8 blocks it
// holds of a configuration with one, two, three or four blocks per SM (three: gemm4_probe-session12-run7.log; four:
// gemm4_probe-session17-run1.log).
template <class C>
kq::Sm90Capacity h200_capacity() {
  static_assert(C::MINB >= 1 && C::MINB <= 4, "the H200 capacities known here: one to four blocks per SM");
  static constexpr int per_sm[4][9] = {{0, 132, 66, 39, 30, 22, 17, 15, 15},
                                       {0, 264, 132, 79, 62, 47, 39, 32, 30},
                                       {0, 396, 198, 124, 92, 69, 62, 47, 45},
                                       {0, 528, 264, 163, 124, 94, 79, 69, 62}};
  kq::Sm90Capacity c;
  c.slots = c.spread_slots = 132 * C::MINB;
  for (int k = 1; k <= kq::kSm90MaxClusterSplits; ++k) c.clusters[k] = per_sm[C::MINB - 1][k];
  return c;
}
// The K-split plan of the dispatched configurations on the H200's capacity (host logic: runs without a GPU), against
// the H200 sweep of the three reductions at 2, 3, 4, 5, 6, 7, 8, 10, 12 and 16 K ranges (gemm4_probe-session14-run5,
// clean L2, M 9 / 16 / 24 / 32 / 64 / 128; at M 1..8 the mma.sync configurations' sweep of 5..16 K ranges,
// gemm4_probe-session17-run3): the expected plans are the model's and the sweep's best but where a comment
// gives the best; comments give what session 13's plan took, against the plan here. Every plan covers K exactly once
// with no empty range; multi-wave plans through global memory are tapered (sm90_taper_ratio).
TEST(QuantCudaSm90, SplitPlanFollowsTheMeasuredSweep) {
  enum Reduce { One, Cluster, Spread, Last };  // one K range; in a cluster; global, every block sums; global, the last block
  struct Case {
    std::int64_t K, N, M;
    int splits;
    Reduce reduce;
  };
  const Case cases[] = {
      {4096, 4096, 9, 8, Spread},    // sweep: 16 spread, 0.1% faster; session 13: 6 in a cluster, 1.01x
      {4096, 4096, 16, 8, Spread},   // 6 in a cluster: 1.02x
      {4096, 11008, 9, 6, Spread},   // 5 in a cluster: 1.03x
      {4096, 11008, 16, 6, Spread},  // 5 in a cluster: 1.03x
      {4096, 11008, 24, 6, Spread},  // 5 in a cluster: 1.05x
      {4096, 11008, 32, 6, Spread},  // 5 in a cluster: 1.02x
      {11008, 4096, 16, 16, Spread},  // the last block summing: 1.09x
      {8192, 28672, 9, 7, Last},     // 784 blocks: more than the GPU holds at once
      {4096, 4096, 1, 16, Last},     // below kSm90SpreadMinRows, K ranges of 4 chunks (kSm90MinChunksFewRows): 8 1.06x (session 16 run 5)
      {4096, 4096, 4, 16, Last},     // 8 1.01x
      {4096, 11008, 1, 8, Cluster},  // mma_b8m2s5x3wf (session 17 run 3): 8 through global memory 1.07x
      {11008, 4096, 1, 16, Last},    // 16 spread: 1.07x
      {4096, 11008, 8, 8, Cluster},  // 8 spread 1.08x
      {4096, 4096, 8, 8, Spread},     // 16 the last block summing 0.98x, 8 in a cluster 1.05x
      {11008, 4096, 8, 16, Spread},
      {8192, 28672, 4, 7, Last},      // mma_b8m2s4x4wf: 7 / 8 / 9 K ranges within 2%, every cluster plan 1.07-1.14x
      {8192, 28672, 8, 7, Last},
      {8192, 28672, 1, 7, Last},
      {8192, 28672, 16, 3, Cluster},
      {8192, 28672, 24, 3, Cluster},
      {8192, 28672, 32, 3, Cluster},
      {4096, 4096, 24, 8, Spread},   // 6 in a cluster: 1.07x
      {11008, 4096, 24, 16, Spread},  // the last block summing: 1.13x
      {4096, 4096, 64, 8, Spread},   // 6 in a cluster: 1.06x
      {4096, 4096, 128, 6, Cluster},  // sweep: 8 spread, 2% faster
      {4096, 11008, 33, 3, Spread},  // (M 33: not in the sweep)
      {4096, 11008, 64, 3, Spread},  // the last block summing: 1.11x
      {4096, 11008, 128, 3, Spread},  // 2 in a cluster: 1.16x
      {11008, 4096, 33, 8, Spread},
      {11008, 4096, 64, 8, Spread},   // 6 in a cluster: 1.15x
      {11008, 4096, 128, 8, Spread},  // 6 in a cluster: 1.12x
      {8192, 28672, 33, 1, One},
      {8192, 28672, 64, 1, One},
      {8192, 28672, 128, 1, One},
      // above 128 rows (wg_b128m1s8wg4 in 2..4 batch slices; gemm4_probe-session18-run3, 4096 x 4096 only: the other
      // shapes' plans did not change when the cost counted the weights once per slice): 3 in a cluster 1.07x / 1.05x,
      // one K range 2.19x / 2.12x / 1.59x / 1.56x (the plans before session 18: 3 in a cluster, 3, 1, 1)
      {4096, 4096, 192, 4, Spread},
      {4096, 4096, 256, 4, Spread},
      {4096, 4096, 384, 2, Cluster},
      {4096, 4096, 512, 2, Cluster},
      {4096, 11008, 256, 1, One},
      {8192, 28672, 256, 1, One}};
  for (const auto& c : cases) {
    const kq::QGemmShape s{c.M, c.N, c.K, (c.K + 63) / 64 * 64, (c.N + 15) / 16 * 16, 128, 4};
    const auto p = kq::detail::with_sm90_cfg(s, [&](auto cfg) {
      using C = decltype(cfg);
      return kq::plan_qgemm_sm90<C>(s, h200_capacity<C>());
    });
    SCOPED_TRACE("K " + std::to_string(c.K) + " N " + std::to_string(c.N) + " M " + std::to_string(c.M) + ": " + kq::describe(p));
    EXPECT_EQ(p.splits, c.splits);
    EXPECT_EQ(p.cluster, c.reduce == Cluster);
    EXPECT_EQ(p.spread, c.reduce == Spread);
    EXPECT_TRUE(kq::sm90_ranges_cover(p, s.Kpad / 64));
    // more than one wave through global memory (8192 x 28672 at M <= 16: 784 blocks on 396 or 528 slots): tapered,
    // the first wave's 3 (M 9..16: three blocks per SM) or 4 (M <= 8: four) K ranges + 1 lead (kSm90TaperRatio: 20
    // chunks each, the rest 16); uniform everywhere else
    if (c.K == 8192 && c.reduce == Last) {
      EXPECT_EQ(p.lead, c.M <= 8 ? 5 : 4);
      EXPECT_EQ(p.cps, 20);
      EXPECT_EQ(p.cps_tail, 16);
    } else {
      EXPECT_EQ(p.lead, p.splits);
      EXPECT_EQ(p.cps_tail, p.cps);
    }
  }
  // an override is clamped to the chunks there are (K = 200: 4 chunks)
  const kq::QGemmShape small{40, 64, 200, 256, 64, 32, 4};
  EXPECT_EQ(kq::qgemm_sm90_plan(small, 132, 16).splits, 4);
}
// Through global memory, every block of a tile sums a share of it (spread) only where the whole grid fits the GPU at
// once (the blocks wait for each other; the launch is cooperative) and the batch has kSm90SpreadMinRows rows or more,
// else the tile's last block sums; GlobalLast forces the latter. Host logic only.
TEST(QuantCudaSm90, SpreadReductionOnlyWhereTheGridFitsTheGpu) {
  using Tiny = kq::Sm90Cfg<16, 2, 8, 2, false, true>;  // 256-feature strips, two blocks per SM
  const kq::QGemmShape s{16, 4096, 11008, 11008, 4096, 128, 4};  // 16 strips x 16 K ranges = 256 blocks
  const auto fits = kq::plan_qgemm_sm90<Tiny>(s, kq::sm90_even_capacity<Tiny>(132), 16, kq::Sm90Reduce::Global);
  ASSERT_EQ(fits.blocks(), 256);
  EXPECT_FALSE(fits.cluster);
  EXPECT_TRUE(fits.spread);  // 264 slots
  EXPECT_NE(kq::describe(fits).find("(global, spread)"), std::string::npos) << kq::describe(fits);
  EXPECT_EQ(fits.counter_elems, 16);
  EXPECT_EQ(fits.partial_elems, 16ll * 16 * 4096);
  const auto last = kq::plan_qgemm_sm90<Tiny>(s, kq::sm90_even_capacity<Tiny>(132), 16, kq::Sm90Reduce::GlobalLast);
  EXPECT_EQ(last.splits, 16);
  EXPECT_FALSE(last.spread);
  EXPECT_EQ(kq::describe(last).find("spread"), std::string::npos) << kq::describe(last);
  const auto over = kq::plan_qgemm_sm90<Tiny>(s, kq::sm90_even_capacity<Tiny>(127), 16, kq::Sm90Reduce::Global);  // 254 slots
  EXPECT_EQ(over.splits, 16);
  EXPECT_FALSE(over.spread);
  const auto cluster = kq::plan_qgemm_sm90<Tiny>(s, kq::sm90_even_capacity<Tiny>(132), 4, kq::Sm90Reduce::Cluster);
  EXPECT_TRUE(cluster.cluster);
  EXPECT_FALSE(cluster.spread);
  // fewer than kSm90SpreadMinRows rows: the last block sums (its serial tail is short)
  const kq::QGemmShape few{4, 4096, 11008, 11008, 4096, 128, 4};
  const auto small = kq::plan_qgemm_sm90<Tiny>(few, kq::sm90_even_capacity<Tiny>(132), 16, kq::Sm90Reduce::Global);
  EXPECT_EQ(small.splits, 16);
  EXPECT_FALSE(small.spread);
  const auto one = kq::plan_qgemm_sm90<Tiny>(s, kq::sm90_even_capacity<Tiny>(132), 1, kq::Sm90Reduce::Global);
  EXPECT_EQ(one.splits, 1);
  EXPECT_FALSE(one.spread);
}
// Tapered K ranges (sm90_taper): the lead ranges of cps chunks, the rest of cps_tail, the last the remainder; together
// every chunk once, none empty; the launcher refuses plans whose ranges do not cover K. Host logic only.
TEST(QuantCudaSm90, TaperedKRangesCoverKOnce) {
  using Scaled = kq::detail::Sm90TinyScaled;
  const kq::QGemmShape s{1, 28672, 8192, 8192, 28672, 128, 4};  // 128 chunks, 112 strips
  auto plan = kq::plan_qgemm_sm90<Scaled>(s, kq::sm90_even_capacity<Scaled>(132), 7, kq::Sm90Reduce::GlobalLast);
  ASSERT_EQ(plan.splits, 7);
  EXPECT_EQ(plan.lead, 7);  // uniform: every range cps chunks
  EXPECT_EQ(plan.cps_tail, plan.cps);
  auto walk = [](const kq::Sm90Plan& p, int kchunks) {
    int next = 0;
    for (int sp = 0; sp < p.splits; ++sp) {
      const kq::Sm90Range r = kq::sm90_k_range(sp, kchunks, p.cps, p.lead, p.cps_tail);
      EXPECT_EQ(r.kc0, next) << "K range " << sp << " of " << kq::describe(p);
      EXPECT_GE(r.nck, 1) << "K range " << sp << " of " << kq::describe(p);
      if (sp + 1 < p.splits) EXPECT_EQ(r.nck, sp < p.lead ? p.cps : p.cps_tail) << "K range " << sp;
      next = r.kc0 + r.nck;
    }
    EXPECT_EQ(next, kchunks) << kq::describe(p);
  };
  walk(plan, 128);
  for (int lead = 1; lead < 7; ++lead)
    for (int tail = 1; tail <= 19; ++tail) {
      auto t = plan;
      const std::string why = kq::sm90_taper(t, s, lead, tail);
      SCOPED_TRACE("lead " + std::to_string(lead) + " tail " + std::to_string(tail) + ": " + why);
      if (!why.empty()) {  // refused: the plan is unchanged
        EXPECT_EQ(t.lead, plan.lead);
        EXPECT_EQ(t.cps, plan.cps);
        continue;
      }
      EXPECT_EQ(t.lead, lead);
      EXPECT_EQ(t.cps_tail, tail);
      EXPECT_GE(t.cps, tail);
      EXPECT_TRUE(kq::sm90_ranges_cover(t, 128));
      EXPECT_NE(kq::describe(t).find("taper " + std::to_string(lead) + "+" + std::to_string(tail)), std::string::npos) << kq::describe(t);
      walk(t, 128);
    }
  {  // 4 K ranges of 22 chunks, then 14, 14 and the remaining 12
    auto t = plan;
    ASSERT_EQ(kq::sm90_taper(t, s, 4, 14), "");
    EXPECT_EQ(t.cps, 22);
    EXPECT_EQ(kq::sm90_k_range(6, 128, t.cps, t.lead, t.cps_tail).nck, 12);
    auto r = plan;  // by ratio: 0.6 x 128 / (4 + 0.6 x 3) = 13.2 chunks a tail range, then 4 of 23
    ASSERT_EQ(kq::sm90_taper_ratio(r, s, 4, 0.6), "");
    EXPECT_EQ(r.cps_tail, 13);
    EXPECT_EQ(r.cps, 23);
    walk(r, 128);
  }
  // refused: a tail longer than the lead ranges, lead out of range, no K splits, a cluster plan, a bad ratio
  auto t = plan;
  EXPECT_NE(kq::sm90_taper(t, s, 4, 40), "");
  EXPECT_NE(kq::sm90_taper(t, s, 0, 10), "");
  EXPECT_NE(kq::sm90_taper(t, s, 7, 10), "");
  EXPECT_NE(kq::sm90_taper(t, s, 3, 0), "");
  EXPECT_NE(kq::sm90_taper_ratio(t, s, 3, 0.0), "");
  EXPECT_NE(kq::sm90_taper_ratio(t, s, 3, 1.5), "");
  auto one = kq::plan_qgemm_sm90<Scaled>(s, kq::sm90_even_capacity<Scaled>(132), 1, kq::Sm90Reduce::GlobalLast);
  EXPECT_NE(kq::sm90_taper(one, s, 1, 1), "");
  auto cluster = kq::plan_qgemm_sm90<Scaled>(s, kq::sm90_even_capacity<Scaled>(132), 4, kq::Sm90Reduce::Cluster);
  ASSERT_TRUE(cluster.cluster);
  EXPECT_NE(kq::sm90_taper(cluster, s, 2, 20), "");
  EXPECT_EQ(t.lead, plan.lead);
  // ranges that miss chunks, or reach past K with an empty last range
  auto gap = plan;
  gap.cps = 10;  // 7 x 10 < 128
  EXPECT_FALSE(kq::sm90_ranges_cover(gap, 128));
  auto empty_last = plan;
  empty_last.cps = 22;  // 6 x 22 = 132: the seventh range starts past K
  EXPECT_FALSE(kq::sm90_ranges_cover(empty_last, 128));
  const kq::QGemmWorkspace none{};
  EXPECT_EQ((kq::detail::launch_qgemm_sm90_cfg<bf16, Scaled>(nullptr, nullptr, nullptr, nullptr, nullptr, s, gap, none, nullptr)), cudaErrorInvalidValue);
}
// The group constants' zero-point patterns, put together as bits in the kernel, are the values the decode subtracts
// (both halves): bf16 128 + z, fp16 1024 + z and -(64 + z), for every zero point up to 63 (4-bit ones are < 16).
// Host logic only.
TEST(QuantCudaSm90, ZeroPointPatternsAreTheMagicValues) {
  auto pair = [](std::uint32_t bits16) { return bits16 | bits16 << 16; };
  auto half_bits = [](float v) { return std::uint32_t(__half_raw(__float2half_rn(v)).x); };
  for (std::uint32_t z = 0; z < 64; ++z) {
    const float magic_bf16 = 128.f + float(z);  // exact in bf16 (7 mantissa bits): the top half of the float's bits
    std::uint32_t f32 = 0;
    std::memcpy(&f32, &magic_bf16, sizeof f32);
    ASSERT_EQ(f32 & 0xffffu, 0u);
    EXPECT_EQ(kq::detail::sm90_bf16_magic_zero(z), pair(f32 >> 16)) << "z " << z;
    EXPECT_EQ(kq::detail::sm90_half_magic_zero(z), pair(half_bits(1024.f + float(z)))) << "z " << z;
    EXPECT_EQ(kq::detail::sm90_half_odd_zero(z), pair(half_bits(-64.f - float(z)))) << "z " << z;
  }
}
// The dispatch table in names, host logic only (any machine): which configuration qgemm_sm90_cuda runs for a batch,
// layer size and group. Up to M = 8 with groups of whole 64-k chunks (per channel included): 8-row slices on mma.sync,
// four blocks per SM on layers from kSm90LargeLayer weights, three below. Up to M = 16: 16-row slices on wgmma, three
// blocks per SM on those layers (with per-group fp32 scaling where the groups are whole 64-k chunks), two below; up to
// M = 32: 32-row slices, three blocks per SM on those layers too.
TEST(QuantCudaSm90, DispatchTableByBatchLayerAndGroup) {
  auto cfg = [](std::int64_t M, std::int64_t N, std::int64_t K, std::int64_t group) {
    const std::int64_t Kpad = (K + 63) / 64 * 64, Npad = (N + 15) / 16 * 16;
    return kq::qgemm_sm90_cfg_name({M, N, K, Kpad, Npad, group == 0 ? Kpad : group, 4});
  };
  EXPECT_EQ(cfg(1, 28672, 8192, 0), "mma_b8m2s4x4wf");    // per channel, four blocks per SM
  EXPECT_EQ(cfg(8, 28672, 8192, 128), "mma_b8m2s4x4wf");
  EXPECT_EQ(cfg(1, 4096, 4096, 128), "mma_b8m2s5x3wf");   // below kSm90LargeLayer: three
  EXPECT_EQ(cfg(8, 11008, 4096, 0), "mma_b8m2s5x3wf");
  EXPECT_EQ(cfg(1, 28672, 8192, 32), "wg_b16m2s5x3w");    // groups of 32: not whole chunks
  EXPECT_EQ(cfg(4, 4096, 4096, 32), "wg_b16m2s8x2w");
  EXPECT_EQ(cfg(9, 28672, 8192, 128), "wg_b16m2s5x3wf");  // three blocks per SM
  EXPECT_EQ(cfg(16, 28672, 8192, 128), "wg_b16m2s5x3wf");
  EXPECT_EQ(cfg(9, 28672, 8192, 32), "wg_b16m2s5x3w");    // groups of 32: not whole chunks
  EXPECT_EQ(cfg(16, 11008, 4096, 128), "wg_b16m2s8x2w");  // below kSm90LargeLayer
  EXPECT_EQ(cfg(16, 4096, 11008, 128), "wg_b16m2s8x2w");
  EXPECT_EQ(cfg(24, 28672, 8192, 128), "wg_b32m2s4x3w");  // three blocks per SM on large layers
  EXPECT_EQ(cfg(32, 28672, 8192, 32), "wg_b32m2s4x3w");
  EXPECT_EQ(cfg(24, 11008, 4096, 128), "wg_b32m2s6x2w");
  EXPECT_EQ(cfg(24, 4096, 4096, 128), "wg_b32m2s8w");
  EXPECT_EQ(cfg(48, 28672, 8192, 128), "wg_b64m2s8w");
  EXPECT_EQ(cfg(64, 4096, 4096, 128), "wg_b64m1s6x2w");
  EXPECT_EQ(cfg(65, 4096, 4096, 128), "wg_b128m1s8wg4");
  EXPECT_EQ(cfg(128, 28672, 8192, 32), "wg_b128m1s8wg4");
}
// What the wgmma GEMM does not take is rejected before any launch, with the reason named (qgemm_cuda serves it).
TEST(QuantCudaSm90, RejectsShapesItCannotTake) {
  auto reason = [](kq::QGemmShape s) { return kq::qgemm_sm90_reason(s); };
  EXPECT_EQ(reason({64, 200, 1096, 1152, 208, 128, 4}), "");
  EXPECT_NE(reason({64, 200, 1096, 1152, 208, 128, 3}).find("4-bit"), std::string::npos);
  EXPECT_NE(reason({64, 200, 1100, 1152, 208, 128, 4}).find("multiple of 8"), std::string::npos);
  EXPECT_NE(reason({64, 200, 1096, 1152, 208, 24, 4}).find("group"), std::string::npos);
  // plans the launcher cannot run: more K splits than a portable cluster holds, K splits through global memory
  // with a workspace short of the partials or counters (or misaligned), a grid past 2^31 - 1 blocks (2^20 batch
  // slices of 16 rows x 2^22 strips), the timeline probe without a trace buffer; refused before any launch, on any
  // machine
  using Small = kq::Sm90Cfg<64, 1, 6, 2, false, true>;
  const kq::QGemmShape deep{64, 200, 4096, 4096, 208, 128, 4};
  auto cluster_plan = kq::plan_qgemm_sm90<Small>(deep, kq::sm90_even_capacity<Small>(132), 12, kq::Sm90Reduce::Cluster);
  EXPECT_EQ(cluster_plan.splits, kq::kSm90MaxClusterSplits);  // an override is clamped to the cluster limit
  EXPECT_TRUE(cluster_plan.cluster);
  cluster_plan.splits = kq::kSm90MaxClusterSplits + 1;
  EXPECT_EQ((kq::detail::launch_qgemm_sm90_cfg<half, Small>(nullptr, nullptr, nullptr, nullptr, nullptr, deep, cluster_plan, {}, nullptr)),
            cudaErrorInvalidValue);
  const auto global_plan = kq::plan_qgemm_sm90<Small>(deep, kq::sm90_even_capacity<Small>(132), 12, kq::Sm90Reduce::Global);
  ASSERT_EQ(global_plan.splits, 11);  // 64 chunks in ranges of 6
  ASSERT_FALSE(global_plan.cluster);
  EXPECT_EQ(global_plan.partial_elems, 11 * 64 * 208);
  EXPECT_EQ(global_plan.counter_elems, 2);
  std::vector<float4> part(std::size_t(global_plan.partial_elems / 4 + 1));  // host memory: nothing is launched
  std::vector<int> cnt(std::size_t(global_plan.counter_elems + 1));
  auto launch_with = [&](const kq::QGemmWorkspace& ws) {
    return kq::detail::launch_qgemm_sm90_cfg<half, Small>(nullptr, nullptr, nullptr, nullptr, nullptr, deep, global_plan, ws, nullptr);
  };
  float* const partial = reinterpret_cast<float*>(part.data());
  EXPECT_EQ(launch_with({partial, global_plan.partial_elems - 1, cnt.data(), global_plan.counter_elems}), cudaErrorInvalidValue);
  EXPECT_EQ(launch_with({partial, global_plan.partial_elems, cnt.data(), global_plan.counter_elems - 1}), cudaErrorInvalidValue);
  EXPECT_EQ(launch_with({partial, global_plan.partial_elems, nullptr, global_plan.counter_elems}), cudaErrorInvalidValue);
  EXPECT_EQ(launch_with({partial + 1, global_plan.partial_elems, cnt.data(), global_plan.counter_elems}), cudaErrorInvalidValue);  // float4 sums
  // per-group fp32 scaling (GSCALE) with groups that are not whole 64-k chunks
  using TinyScaled = kq::Sm90Cfg<16, 2, 8, 2, false, true, 2, true>;
  const kq::QGemmShape group32{16, 200, 1096, 1152, 208, 32, 4};
  EXPECT_EQ((kq::detail::launch_qgemm_sm90_cfg<half, TinyScaled>(nullptr, nullptr, nullptr, nullptr, nullptr, group32,
                                                                  kq::plan_qgemm_sm90<TinyScaled>(group32, kq::sm90_even_capacity<TinyScaled>(132), 1), {},
                                                                  nullptr)),
            cudaErrorInvalidValue);
  using Tiny = kq::Sm90Cfg<16, 2, 8, 2, false, true>;
  const kq::QGemmShape huge{std::int64_t(1) << 24, std::int64_t(1) << 30, 64, 64, std::int64_t(1) << 30, 64, 4};
  const auto huge_plan = kq::plan_qgemm_sm90<Tiny>(huge, kq::sm90_even_capacity<Tiny>(132), 1);
  EXPECT_GT(std::int64_t(huge_plan.zslices) * huge_plan.strips, 0x7fffffff);
  EXPECT_EQ((kq::detail::launch_qgemm_sm90_cfg<half, Tiny>(nullptr, nullptr, nullptr, nullptr, nullptr, huge, huge_plan, {}, nullptr)),
            cudaErrorInvalidValue);
  const kq::QGemmShape odd_k{64, 200, 1100, 1152, 208, 128, 4};
  EXPECT_EQ(kq::qgemm_sm90_cuda<half>(nullptr, nullptr, nullptr, nullptr, nullptr, odd_k, {}, 132, nullptr), cudaErrorInvalidValue);
  // the timeline probe (bench_qgemm_sm90 --timeline) without its trace buffer
  using Timeline = kq::Sm90Probe<Tiny, 3>;
  const auto one_range = kq::plan_qgemm_sm90<Timeline>(deep, kq::sm90_even_capacity<Timeline>(132), 1);
  ASSERT_EQ(one_range.splits, 1);
  EXPECT_EQ((kq::detail::launch_qgemm_sm90_cfg<half, Timeline>(nullptr, nullptr, nullptr, nullptr, nullptr, deep, one_range, {}, nullptr, nullptr)),
            cudaErrorInvalidValue);
}
