// The quantized GEMM's host logic on the CPU (gemm/launch_plan.hpp, plain C++): the mma.sync family's work split and
// dispatch table, the sm90 family's K-split plans, cost model and dispatch table, and the zero-point patterns the sm90
// kernel's decode subtracts. No GPU: the sm90 capacities are the H200's (as cudaOccupancyMaxActiveClusters reports
// them) or an even GPU of 132 SMs.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <string>

#include <squeeze/kernels/quant/gemm/decode.hpp>
#include <squeeze/kernels/quant/gemm/launch_plan.hpp>

using namespace squeeze;
namespace kq = squeeze::kernels::quant;

// ==== the mma.sync family ============================================================================================

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
              EXPECT_GE(std::int64_t(p.splits) * p.cps, chunks);      // K covered
              EXPECT_LT(std::int64_t(p.splits - 1) * p.cps, chunks);  // no empty split
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

// Bulk-loader plans (the mma.sync family, QGemmLoader::Bulk): each ring slot has room for the scale / zero rows the
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
                if (persist == 0)
                  EXPECT_EQ(p.items_per_block, 1);
                else
                  EXPECT_LE(p.blocks(), 132 * persist);
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
  EXPECT_EQ(plan(1, 4096, 4096).cps, 4);    // 32 strips: 16 chunks would leave 128 blocks for 132 SMs
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

// The mma.sync dispatch table (with_qgemm_cfg): 3 and 4 bits 8 rows with the weights as A up to M = 8, 16 rows up to 16,
// 32-row slices above; 8 bits 8 / 16 / 32 / 64 rows by batch. qgemm_plan is plan_qgemm with that configuration.
TEST(QGemmPlan, DispatchTableByBatchAndWidth) {
  auto shape = [](std::int64_t M, int bits) { return kq::QGemmShape{M, 4096, 4096, 4096, 4096, 128, bits}; };
  for (int bits : {3, 4}) {
    EXPECT_EQ(kq::qgemm_cfg_name(shape(1, bits)), "r8w4n2p4x");
    EXPECT_EQ(kq::qgemm_cfg_name(shape(8, bits)), "r8w4n2p4x");
    EXPECT_EQ(kq::qgemm_cfg_name(shape(9, bits)), "r16w4n2p4");
    EXPECT_EQ(kq::qgemm_cfg_name(shape(16, bits)), "r16w4n2p4");
    EXPECT_EQ(kq::qgemm_cfg_name(shape(17, bits)), "r32w4n2p4");
    EXPECT_EQ(kq::qgemm_cfg_name(shape(128, bits)), "r32w4n2p4");
  }
  EXPECT_EQ(kq::qgemm_cfg_name(shape(8, 8)), "r8w4n1p4");
  EXPECT_EQ(kq::qgemm_cfg_name(shape(16, 8)), "r16w4n1p4");
  EXPECT_EQ(kq::qgemm_cfg_name(shape(32, 8)), "r32w4n1p4");
  EXPECT_EQ(kq::qgemm_cfg_name(shape(33, 8)), "r64w4n1p4");
  EXPECT_EQ(kq::qgemm_cfg_name(shape(1000, 8)), "r64w4n1p4");
  for (std::int64_t M : {1, 12, 40, 200}) {
    const auto s = shape(M, 4);
    const auto want = M <= 8    ? kq::plan_qgemm(s, kq::qgemm_geometry<kq::QGemm_M8, 4>(), 132)
                      : M <= 16 ? kq::plan_qgemm(s, kq::qgemm_geometry<kq::QGemm_M16, 4>(), 132)
                                : kq::plan_qgemm(s, kq::qgemm_geometry<kq::QGemm_M32, 4>(), 132);
    EXPECT_EQ(kq::describe(kq::qgemm_plan(s, 132)), kq::describe(want)) << "M " << M;
    const auto ws = kq::qgemm_workspace_size(s, 132);
    EXPECT_EQ(ws.partial_elems, want.partial_elems);
    EXPECT_EQ(ws.counter_elems, want.counter_elems);
  }
}

// ==== the sm90 family ================================================================================================
// The H200's capacity as cudaOccupancyMaxActiveClusters reports it: clusters of 1..8 blocks it holds of a configuration
// with one, two, three or four blocks per SM.
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
// The K-split plan of the dispatched configurations on the H200's capacity, against the H200 sweep of the three
// reductions at 2..16 K ranges (clean L2, M 9 / 16 / 24 / 32 / 64 / 128; at M 1..8 the mma.sync consumers' sweep of
// 5..16 K ranges): the expected plans are the model's and the sweep's best but where a comment gives the best and the
// alternative's time over it. Every plan covers K exactly once with no empty range; multi-wave plans through global
// memory are tapered (sm90_taper_ratio).
TEST(QGemmSm90Plan, SplitPlanFollowsTheMeasuredSweep) {
  enum Reduce { One, Cluster, Spread, Last };  // one K range; in a cluster; global, every block sums; global, the last block
  struct Case {
    std::int64_t K, N, M;
    int splits;
    Reduce reduce;
  };
  const Case cases[] = {{4096, 4096, 9, 8, Spread},     // sweep: 16 spread, 0.1% faster; 6 in a cluster 1.01x
                        {4096, 4096, 16, 8, Spread},    // 6 in a cluster: 1.02x
                        {4096, 11008, 9, 6, Spread},    // 5 in a cluster: 1.03x
                        {4096, 11008, 16, 6, Spread},   // 5 in a cluster: 1.03x
                        {4096, 11008, 24, 6, Spread},   // 5 in a cluster: 1.05x
                        {4096, 11008, 32, 6, Spread},   // 5 in a cluster: 1.02x
                        {11008, 4096, 16, 16, Spread},  // the last block summing: 1.09x
                        {8192, 28672, 9, 7, Last},      // 784 blocks: more than the GPU holds at once
                        {4096, 4096, 1, 16, Last},      // below kSm90SpreadMinRows, K ranges of 4 chunks (kSm90MinChunksFewRows): 8 1.06x
                        {4096, 4096, 4, 16, Last},      // 8 1.01x
                        {4096, 11008, 1, 8, Cluster},   // mma_b8m2s5x3wf: 8 through global memory 1.07x
                        {11008, 4096, 1, 16, Last},     // 16 spread: 1.07x
                        {4096, 11008, 8, 8, Cluster},   // 8 spread 1.08x
                        {4096, 4096, 8, 8, Spread},     // 16 the last block summing 0.98x, 8 in a cluster 1.05x
                        {11008, 4096, 8, 16, Spread},
                        {8192, 28672, 4, 7, Last},  // mma_b8m2s4x4wf: 7 / 8 / 9 K ranges within 2%, every cluster plan 1.07-1.14x
                        {8192, 28672, 8, 7, Last},
                        {8192, 28672, 1, 7, Last},
                        {8192, 28672, 16, 3, Cluster},
                        {8192, 28672, 24, 3, Cluster},
                        {8192, 28672, 32, 3, Cluster},
                        {4096, 4096, 24, 8, Spread},    // 6 in a cluster: 1.07x
                        {11008, 4096, 24, 16, Spread},  // the last block summing: 1.13x
                        {4096, 4096, 64, 8, Spread},    // 6 in a cluster: 1.06x
                        {4096, 4096, 128, 6, Cluster},  // sweep: 8 spread, 2% faster
                        {4096, 11008, 33, 3, Spread},   // (M 33: not in the sweep)
                        {4096, 11008, 64, 3, Spread},   // the last block summing: 1.11x
                        {4096, 11008, 128, 3, Spread},  // 2 in a cluster: 1.16x
                        {11008, 4096, 33, 8, Spread},
                        {11008, 4096, 64, 8, Spread},   // 6 in a cluster: 1.15x
                        {11008, 4096, 128, 8, Spread},  // 6 in a cluster: 1.12x
                        {8192, 28672, 33, 1, One},
                        {8192, 28672, 64, 1, One},
                        {8192, 28672, 128, 1, One},
                        // above 128 rows (wg_b128m1s8wg4 in 2..4 batch slices, 4096 x 4096; the weights cost once per slice): 3 in a
                        // cluster 1.07x / 1.05x, one K range 2.19x / 2.12x / 1.59x / 1.56x
                        {4096, 4096, 192, 4, Spread},
                        {4096, 4096, 256, 4, Spread},
                        {4096, 4096, 384, 2, Cluster},
                        {4096, 4096, 512, 2, Cluster},
                        {4096, 11008, 256, 1, One},
                        {8192, 28672, 256, 1, One}};
  for (const auto& c : cases) {
    const kq::QGemmShape s{c.M, c.N, c.K, (c.K + 63) / 64 * 64, (c.N + 15) / 16 * 16, 128, 4};
    const auto p = kq::with_sm90_cfg(s, [&](auto cfg) {
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
  EXPECT_EQ(kq::plan_qgemm_sm90<kq::Sm90_M64>(small, h200_capacity<kq::Sm90_M64>(), 16).splits, 4);
}
// Through global memory, every block of a tile sums a share of it (spread) only where the whole grid fits the GPU at
// once (the blocks wait for each other; the launch is cooperative) and the batch has kSm90SpreadMinRows rows or more,
// else the tile's last block sums; GlobalLast forces the latter.
TEST(QGemmSm90Plan, SpreadReductionOnlyWhereTheGridFitsTheGpu) {
  using Tiny = kq::Sm90_M16;                                     // 256-feature strips, two blocks per SM
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
// every chunk once, none empty; plans whose ranges do not cover K are recognised (the launcher refuses them).
TEST(QGemmSm90Plan, TaperedKRangesCoverKOnce) {
  using Scaled = kq::Sm90_M16_LargeScaled;
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
}
// The sm90 decode's zero-point patterns, put together as bits, are the values the decode subtracts (both halves): bf16
// 128 + z, fp16 1024 + z and -(64 + z), for every zero point up to 63 (4-bit ones are < 16).
TEST(QGemmSm90Plan, ZeroPointPatternsAreTheMagicValues) {
  auto pair = [](std::uint32_t bits16) { return bits16 | bits16 << 16; };
  auto half_bits = [](float v) { return std::uint32_t(std::bit_cast<std::uint16_t>(from_float<half>(v))); };
  for (std::uint32_t z = 0; z < 64; ++z) {
    const std::uint32_t f32 = std::bit_cast<std::uint32_t>(128.f + float(z));  // exact in bf16: the float's top half
    ASSERT_EQ(f32 & 0xffffu, 0u);
    EXPECT_EQ(kq::detail::sm90_bf16_magic_zero(z), pair(f32 >> 16)) << "z " << z;
    EXPECT_EQ(kq::detail::sm90_half_magic_zero(z), pair(half_bits(1024.f + float(z)))) << "z " << z;
    EXPECT_EQ(kq::detail::sm90_half_odd_zero(z), pair(half_bits(-64.f - float(z)))) << "z " << z;
  }
}
// The sm90 dispatch table in names: which configuration qgemm_sm90_cuda runs for a batch, layer size and group. Up to
// M = 8 with groups of whole 64-k chunks (per channel included): 8-row slices on mma.sync, four blocks per SM on layers
// from kSm90LargeLayer weights, three below. Up to M = 16: 16-row slices on wgmma, three blocks per SM on those layers
// (with per-group fp32 scaling where the groups are whole 64-k chunks), two below; up to M = 32: 32-row slices, three
// blocks per SM on those layers too, two from kSm90MediumLayer, one below; 64-row slices up to 64, 128 above.
TEST(QGemmSm90Plan, DispatchTableByBatchLayerAndGroup) {
  auto cfg = [](std::int64_t M, std::int64_t N, std::int64_t K, std::int64_t group) {
    const std::int64_t Kpad = (K + 63) / 64 * 64, Npad = (N + 15) / 16 * 16;
    return kq::qgemm_sm90_cfg_name({M, N, K, Kpad, Npad, group == 0 ? Kpad : group, 4});
  };
  EXPECT_EQ(cfg(1, 28672, 8192, 0), "mma_b8m2s4x4wf");  // per channel, four blocks per SM
  EXPECT_EQ(cfg(8, 28672, 8192, 128), "mma_b8m2s4x4wf");
  EXPECT_EQ(cfg(1, 4096, 4096, 128), "mma_b8m2s5x3wf");  // below kSm90LargeLayer: three
  EXPECT_EQ(cfg(8, 11008, 4096, 0), "mma_b8m2s5x3wf");
  EXPECT_EQ(cfg(1, 28672, 8192, 32), "wg_b16m2s5x3w");  // groups of 32: not whole chunks
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
// What the sm90 kernel does not take is named before any launch (qgemm_cuda serves it); forced K splits are clamped to
// what a cluster holds and sized for the global reduction.
TEST(QGemmSm90Plan, ReasonsAndForcedSplits) {
  auto reason = [](kq::QGemmShape s) { return kq::qgemm_sm90_reason(s); };
  EXPECT_EQ(reason({64, 200, 1096, 1152, 208, 128, 4}), "");
  EXPECT_NE(reason({64, 200, 1096, 1152, 208, 128, 3}).find("4-bit"), std::string::npos);
  EXPECT_NE(reason({64, 200, 1100, 1152, 208, 128, 4}).find("multiple of 8"), std::string::npos);
  EXPECT_NE(reason({64, 200, 1096, 1152, 208, 24, 4}).find("group"), std::string::npos);
  using Small = kq::Sm90_M64;
  const kq::QGemmShape deep{64, 200, 4096, 4096, 208, 128, 4};
  const auto cluster_plan = kq::plan_qgemm_sm90<Small>(deep, kq::sm90_even_capacity<Small>(132), 12, kq::Sm90Reduce::Cluster);
  EXPECT_EQ(cluster_plan.splits, kq::kSm90MaxClusterSplits);
  EXPECT_TRUE(cluster_plan.cluster);
  const auto global_plan = kq::plan_qgemm_sm90<Small>(deep, kq::sm90_even_capacity<Small>(132), 12, kq::Sm90Reduce::Global);
  EXPECT_EQ(global_plan.splits, 11);  // 64 chunks in ranges of 6
  EXPECT_FALSE(global_plan.cluster);
  EXPECT_EQ(global_plan.partial_elems, 11 * 64 * 208);
  EXPECT_EQ(global_plan.counter_elems, 2);
}
