// The sm90 GEMM (gemm/sm90.cuh) and the library's GEMM entry (quant_gemm_cuda, gemm.cuh) against the CPU twin
// (label cuda). The wgmma GEMM rounds each weight (q - z) * scale to T once: fp16 2^-10, bf16 2^-7 of sum|x w| + one
// ulp (as the scaled-B configurations of the mma.sync kernel); its tests skip unless the device is sm_90 and the
// build has sm_90a device code. The host plans and dispatch table are tested on the CPU (test_gemm_plan.cpp).
#include <cstring>

#include "quant_cuda_common.cuh"

// ---- the sm90 GEMM (gemm/sm90.cuh) ----------------------------------------------------------------------
#define REQUIRE_SM90()             \
  REQUIRE_DEVICE();                \
  if (!kq::qgemm_sm90_supported()) \
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
    EXPECT_EQ((kq::detail::launch_qgemm_sm90_cfg<T, C>(tc.dx.p, tc.dt.p, tc.ds.p, tc.dz.p, tc.dy.p, tc.shape, plan, {}, nullptr)),
              cudaErrorInvalidValue)
        << kq::detail::sm90_cfg_name<C>() << " group " << tc.shape.group;
    return;
  }
  for (const int sp : split_counts)
    for (const auto reduce : {kq::Sm90Reduce::Cluster, kq::Sm90Reduce::Global, kq::Sm90Reduce::GlobalLast}) {
      if (sp == 0 && reduce != kq::Sm90Reduce::Cluster) continue;  // the plan's own choice: once
      const auto plan =
          kq::plan_qgemm_sm90<C>(tc.shape, kq::detail::sm90_capacity<C>(sm_count()), sp, sp == 0 ? kq::Sm90Reduce::Auto : reduce);
      launches_match_twin(tc, plan.partial_elems, plan.counter_elems, reps,
                          kq::detail::sm90_cfg_name<C>() + " (" + kq::describe(plan) + ")", rel, [&](const kq::QGemmWorkspace& ws) {
                            return kq::detail::launch_qgemm_sm90_cfg<T, C>(tc.dx.p, tc.dt.p, tc.ds.p, tc.dz.p, tc.dy.p, tc.shape, plan, ws,
                                                                           nullptr);
                          });
      if (::testing::Test::HasFatalFailure()) return;
    }
}
template <class T, class... Cs>
void sm90_all_cfgs(bg::CfgList<Cs...>, const TwinCase<T>& tc, const std::vector<int>& split_counts) {
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
      sm90_all_cfgs(bg::Sm90TuningCfgs{}, TwinCase<bf16>(p, t, M), {0, 1, 3, 7});
      if (::testing::Test::HasFatalFailure()) return;
      sm90_all_cfgs(bg::Sm90TuningCfgs{}, TwinCase<half>(p, t, M), {0, 1, 3, 7});
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}
// The mma.sync consumers (Sm90_M8, Sm90_M8_Large, 8-row slices) at the batches they are dispatched for and
// past them: M 1 / 5 / 8 / 11 (11: a second, partial slice), fp16 and bf16, N 299 / 296, K 1096, groups of 128, per
// channel and 32 (refused: GSCALE), the plan's K splits and forced 1, 3 and 7, each reduced the three ways.
TEST(QuantCudaSm90, MmaSyncConfigurationsMatchCpuTwin) {
  REQUIRE_SM90();
  using SyncCfgs = bg::CfgList<kq::Sm90_M8, kq::Sm90_M8_Large>;
  static_assert(kq::Sm90_M8::SYNC && kq::Sm90_M8_Large::SYNC && kq::Sm90_M8::BN == 8);
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
      launches_match_twin(tc, plan.partial_elems, plan.counter_elems, 2, kq::detail::sm90_cfg_name<C>() + " (" + kq::describe(plan) + ")",
                          rel, [&](const kq::QGemmWorkspace& ws) {
                            return kq::detail::launch_qgemm_sm90_cfg<T, C>(tc.dx.p, tc.dt.p, tc.ds.p, tc.dz.p, tc.dy.p, tc.shape, plan, ws,
                                                                           nullptr);
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
      sm90_tapered_runs<bf16, kq::Sm90_M16>(TwinCase<bf16>(p, t, M));
      sm90_tapered_runs<half, kq::Sm90_M16_Large>(TwinCase<half>(p, t, M));
      sm90_tapered_runs<bf16, kq::Sm90_M16_LargeScaled>(TwinCase<bf16>(p, t, M));
      sm90_tapered_runs<half, kq::Sm90_M16_LargeScaled>(TwinCase<half>(p, t, M));
      sm90_tapered_runs<bf16, kq::Sm90_M8_Large>(TwinCase<bf16>(p, t, M));
      sm90_tapered_runs<half, kq::Sm90_M8>(TwinCase<half>(p, t, M));
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
    launches_match_twin(tc, need.partial_elems, need.counter_elems, reps,
                        "qgemm_sm90_cuda (" + kq::describe(kq::qgemm_sm90_plan(tc.shape, sm, sp)) + ")", rel,
                        [&](const kq::QGemmWorkspace& ws) {
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
// The timeline probe (bench/quant/gemm_configs.cuh's Sm90Probe<Cfg, 3>, what bench_qgemm_sm90 --timeline runs) does the kernel's whole
// work, so its y matches the CPU twin, and each block's trace points come in program order: entry, set-up, first chunk, loop end, the
// epilogue's barriers, end (one SM's clock); the producer's first chunk queued before its last; the global timer at
// entry before the one at the end. One K range, and 3 K ranges summed each way: in a cluster, spread, and by the
// tile's last block (only that block reaches the stores).
TEST(QuantCudaSm90, TimelineProbeComputesAndTracesInOrder) {
  REQUIRE_SM90();
  using P = bg::Sm90Probe<kq::Sm90_M16, 3>;
  namespace slot = bg::sm90_trace_slot;
  constexpr int kSlots = bg::kSm90TraceSlots;
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
      return bg::launch_sm90_timeline<bf16, P>(tc.dx.p, tc.dt.p, tc.ds.p, tc.dz.p, tc.dy.p, tc.shape, plan, ws, nullptr, trace.p);
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
// The library's entry (quant_gemm_cuda, what QuantizedLinear calls): on sm_90a builds the sm90 kernel for 4-bit layers
// at every M (8-row mma.sync slices up to M = 8 with groups of whole chunks, 16-row wgmma slices up to M = 16, 32-row up
// to 32 (one block per SM below kSm90MediumLayer weights, three from kSm90LargeLayer), 64-row up to 64 with two tiles
// per warpgroup on large layers, 128-row slices above with four consumer warpgroups), mma.sync otherwise. The choice
// in words first, then the results at M 1, 8, 9, 16, 17, 33 and 100 (16-row slices with 1 and 8 rows; each boundary
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
// Plans the launcher cannot run are refused before any launch, on any machine (the reasons for shapes it declines:
// test_gemm_plan.cpp).
TEST(QuantCudaSm90, RejectsPlansItCannotRun) {
  // plans the launcher cannot run: more K splits than a portable cluster holds, K splits through global memory
  // with a workspace short of the partials or counters (or misaligned), a grid past 2^31 - 1 blocks (2^20 batch
  // slices of 16 rows x 2^22 strips), the timeline probe without a trace buffer; refused before any launch, on any
  // machine
  using Small = kq::Sm90_M64;
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
  EXPECT_EQ(launch_with({partial + 1, global_plan.partial_elems, cnt.data(), global_plan.counter_elems}),
            cudaErrorInvalidValue);  // float4 sums
  // per-group fp32 scaling (group_scale) with groups that are not whole 64-k chunks
  using TinyScaled = kq::Sm90Config<kq::Sm90Knobs{
      .batch_rows = 16, .m64_tiles = 2, .stages = 8, .blocks_per_sm = 2, .warp_specialized = true, .group_scale = true}>;
  const kq::QGemmShape group32{16, 200, 1096, 1152, 208, 32, 4};
  EXPECT_EQ((kq::detail::launch_qgemm_sm90_cfg<half, TinyScaled>(
                nullptr, nullptr, nullptr, nullptr, nullptr, group32,
                kq::plan_qgemm_sm90<TinyScaled>(group32, kq::sm90_even_capacity<TinyScaled>(132), 1), {}, nullptr)),
            cudaErrorInvalidValue);
  using Tiny = kq::Sm90_M16;
  const kq::QGemmShape huge{std::int64_t(1) << 24, std::int64_t(1) << 30, 64, 64, std::int64_t(1) << 30, 64, 4};
  const auto huge_plan = kq::plan_qgemm_sm90<Tiny>(huge, kq::sm90_even_capacity<Tiny>(132), 1);
  EXPECT_GT(std::int64_t(huge_plan.zslices) * huge_plan.strips, 0x7fffffff);
  EXPECT_EQ((kq::detail::launch_qgemm_sm90_cfg<half, Tiny>(nullptr, nullptr, nullptr, nullptr, nullptr, huge, huge_plan, {}, nullptr)),
            cudaErrorInvalidValue);
  const kq::QGemmShape odd_k{64, 200, 1100, 1152, 208, 128, 4};
  EXPECT_EQ(kq::qgemm_sm90_cuda<half>(nullptr, nullptr, nullptr, nullptr, nullptr, odd_k, {}, 132, nullptr), cudaErrorInvalidValue);
  // the timeline probe (bench_qgemm_sm90 --timeline) without its trace buffer
  using Timeline = bg::Sm90Probe<Tiny, 3>;
  const auto one_range = kq::plan_qgemm_sm90<Timeline>(deep, kq::sm90_even_capacity<Timeline>(132), 1);
  ASSERT_EQ(one_range.splits, 1);
  EXPECT_EQ((bg::launch_sm90_timeline<half, Timeline>(nullptr, nullptr, nullptr, nullptr, nullptr, deep, one_range, {}, nullptr, nullptr)),
            cudaErrorInvalidValue);
}
