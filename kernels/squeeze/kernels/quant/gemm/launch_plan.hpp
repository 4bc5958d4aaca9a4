#pragma once
// Host side of the quantized GEMM: how each kernel family splits the work (plans, workspace sizes), the sm90 kernel's
// cost model of K splits, and which configuration the dispatch takes for a shape. Plain C++ with no device code (it
// compiles with g++; tests/quant/test_gemm_plan.cpp checks it on the CPU); the kernels launch exactly these plans.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "squeeze/kernels/quant/gemm/config.hpp"
#include "squeeze/kernels/quant/gemm/layout.hpp"

namespace squeeze::kernels::quant {

// Workspace for one call: partial fp32 [partial_elems] (any contents) and counters int32 [counter_elems] that must be
// zero before the first call (the kernels leave them zero). The *_workspace_size functions fill in the sizes.
struct QGemmWorkspace {
  float* partial = nullptr;
  std::int64_t partial_elems = 0;
  int* counters = nullptr;
  std::int64_t counter_elems = 0;
};

// ==== the mma.sync family =============================================================================================
// A block = W warps; warp w owns NT consecutive 16-column tiles, so a block owns a strip of W * NT * 16 columns; it
// multiplies `rows` x rows by one K range of `cps` 64-k chunks. The block's x slice [rows, cps * 64] and its scales /
// zero points are staged in shared memory once, so the main loop has no barrier. K splits are summed by the last block
// of a (z slice, strip) to finish (fp32 partials in the workspace, a counter per (z slice, strip)).
struct QGemmPlan {
  int rows = 8;                       // x rows per block
  int zslices = 1;                    // ceil(M / rows)
  int strips = 1;                     // ceil(Npad / strip_cols)
  int splits = 1;                     // K ranges
  int cps = 1;                        // 64-k chunks per K range (the last one may be shorter)
  int ngroups = 1;                    // scale groups one K range can touch (shared-memory table rows)
  int smem_bytes = 0;                 // dynamic shared memory per block
  std::int64_t partial_elems = 0;     // fp32 [splits, M, Npad] when splits > 1
  std::int64_t counter_elems = 0;     // int32 [zslices, strips], zero between launches
  int items_per_block = 1;            // work items (z slice, strip, K range) per block: > 1 for a persistent grid
  int slot_bytes = 0, slot_rows = 0;  // bulk loader: bytes per ring slot, group rows per slot
  std::int64_t items() const { return std::int64_t(strips) * splits * zslices; }
  std::int64_t blocks() const { return (items() + items_per_block - 1) / items_per_block; }
};

// One line naming a plan (for error messages and benchmark logs).
inline std::string describe(const QGemmPlan& p) {
  return "rows " + std::to_string(p.rows) + " zslices " + std::to_string(p.zslices) + " strips " + std::to_string(p.strips) + " splits " +
         std::to_string(p.splits) + " cps " + std::to_string(p.cps) + " groups " + std::to_string(p.ngroups) + " smem " +
         std::to_string(p.smem_bytes) + " B" + (p.items_per_block > 1 ? " items/block " + std::to_string(p.items_per_block) : "");
}

// Shared memory of one block: x [rows][cps*64 + 8] (16 B of padding per row: the 8 rows an ldmatrix reads
// fall in distinct bank groups), scales [ngroups][strip] fp16, zero points [ngroups][strip] uint8, then an
// optional ring for the cp.async weight loader.
struct QGemmSmem {
  int x = 0, scales = 0, zeros = 0, ring = 0, total = 0;
};
SQUEEZE_HD QGemmSmem qgemm_smem(int rows, int cps, int ngroups, int strip_cols, int ring_bytes) {
  QGemmSmem s;
  int o = 0;
  s.x = o;
  o += rows * (cps * kTileK + 8) * 2;
  s.scales = o;
  o += ngroups * strip_cols * 2;
  s.zeros = o;
  o += ngroups * strip_cols;
  o = (o + 15) & ~15;
  s.ring = o;
  o += ring_bytes;
  s.total = o;
  return s;
}

// What the plan needs of a configuration (the rest is compile-time in the kernel).
struct QGemmGeometry {
  int rows = 8;         // x rows per block
  int strip_cols = 64;  // W * NT * 16
  int warps = 4;
  int ring_bytes = 0;  // cp.async / bulk loader ring per block (bulk: the weight part)
  int bulk_slots = 0;  // bulk loader: ring slots, each one chunk of the strip's weights plus the scale / zero rows
                       // of the groups that start in it (0: the group table is staged in shared memory)
  int persist = 0;     // > 0: a grid of at most persist blocks per SM, each taking consecutive work items
  bool swap = false;   // weights as A: only min(rows, M) x rows are staged (the missing B columns read the last row)
};
template <class C, int BITS>
QGemmGeometry qgemm_geometry() {
  return {C::ROWS, C::STRIP, C::W, C::template kRingBytes<BITS>, C::LOADER == QGemmLoader::Bulk ? C::PF : 0, C::PERSIST, C::SWAP};
}

// cps_override > 0 forces the chunks per K range (benchmarks sweep it); otherwise K ranges of cps_target chunks, halved
// (down to 4) while the grid would hold fewer than 2 blocks per SM: 16 chunks was the fastest or close on every shape
// with enough strips, shorter ranges paid only on small grids (measured: docs/kernels/quant-gemm.md). x_smem_cap
// bounds the x slice (and so cps) per block; small groups bound it through the group table.
inline QGemmPlan plan_qgemm(const QGemmShape& s, const QGemmGeometry& g, int sm_count, int cps_override = 0, int cps_target = 16,
                            int x_smem_cap = 96 * 1024) {
  QGemmPlan p;
  const std::int64_t kchunks = s.Kpad / kTileK;
  p.rows = g.rows;
  const int xrows = g.swap ? int(std::min<std::int64_t>(g.rows, s.M)) : g.rows;  // x rows in shared memory
  p.zslices = int((s.M + g.rows - 1) / g.rows);
  p.strips = int((s.Npad + g.strip_cols - 1) / g.strip_cols);
  // bulk ring slots: weights, then scales [slot_rows][strip] fp16 and zero points [slot_rows][strip]; a 64-k
  // chunk holds at most 63 / group + 2 group starts (the first chunk of a K range also the group it begins in)
  const bool bulk = g.bulk_slots > 0;
  if (bulk) {
    p.slot_rows = int(std::min<std::int64_t>(63 / s.group + 2, 1 << 20));
    p.slot_bytes = g.ring_bytes / g.bulk_slots + (p.slot_rows * g.strip_cols * 3 + 15) / 16 * 16;
  }
  const int ring_bytes = bulk ? p.slot_bytes * g.bulk_slots : g.ring_bytes;
  // x slice within x_smem_cap (less the ring: a block stays under 220 KB), group table (3 B per column and
  // group) within 32 KB
  x_smem_cap = std::max(4 * 1024, std::min(x_smem_cap, 220 * 1024 - (bulk ? 0 : 32 * 1024) - ring_bytes));
  const std::int64_t table_groups = std::max<std::int64_t>(3, 32 * 1024 / (3 * g.strip_cols));
  const std::int64_t cps_max =
      std::max<std::int64_t>(1, std::min<std::int64_t>((x_smem_cap / (2 * xrows) - 8) / kTileK,
                                                       bulk ? std::int64_t(1) << 30 : (table_groups - 2) * s.group / kTileK));
  std::int64_t cps = cps_override;
  if (cps <= 0) {
    cps = std::max(cps_target, 1);
    auto blocks = [&](std::int64_t c) { return std::int64_t(p.strips) * p.zslices * ((kchunks + c - 1) / c); };
    while (cps > 4 && blocks(cps) < 2 * std::int64_t(std::max(sm_count, 1))) cps /= 2;
  }
  cps = std::clamp<std::int64_t>(cps, 1, std::min(cps_max, kchunks));
  p.splits = int((kchunks + cps - 1) / cps);
  p.cps = int((kchunks + p.splits - 1) / p.splits);  // even ranges, no empty split
  const std::int64_t total_groups = (s.K - 1) / s.group + 1;
  p.ngroups = bulk ? 0 : int(std::min<std::int64_t>(total_groups, (std::int64_t(p.cps) * kTileK - 1) / s.group + 2));
  p.smem_bytes = qgemm_smem(xrows, p.cps, p.ngroups, g.strip_cols, ring_bytes).total;
  p.partial_elems = p.splits > 1 ? std::int64_t(p.splits) * s.M * s.Npad : 0;
  p.counter_elems = std::int64_t(p.strips) * p.zslices;
  if (g.persist > 0) {  // as many blocks as fit g.persist per SM (shared memory permitting), consecutive items each
    const std::int64_t fit = std::max<std::int64_t>(1, 227 * 1024 / (p.smem_bytes + 1024));
    const std::int64_t slots = std::max<std::int64_t>(1, std::int64_t(std::max(sm_count, 1)) * std::min<std::int64_t>(g.persist, fit));
    p.items_per_block = int((p.items() + slots - 1) / slots);
  }
  return p;
}

// The dispatch's choice: 3 and 4 bits QGemm_M8 (M <= 8), QGemm_M16 (M <= 16), QGemm_M32 (above, in 32-row z slices);
// 8 bits 8 / 16 / 32 / 64 rows by batch. Calls f(std::integral_constant<int, BITS>{}, C{}) with the width the kernel
// is instantiated for (3, 8, else 4) and the configuration.
inline int qgemm_batch_class(std::int64_t M) { return M <= 8 ? 0 : M <= 16 ? 1 : M <= 32 ? 2 : M <= 64 ? 3 : 4; }
template <class F>
decltype(auto) with_qgemm_cfg(const QGemmShape& s, F&& f) {
  const int c = qgemm_batch_class(s.M);
  if (s.bits == 8) {
    constexpr std::integral_constant<int, 8> b8{};
    if (c == 0) return f(b8, QGemm8_M8{});
    if (c == 1) return f(b8, QGemm8_M16{});
    if (c == 2) return f(b8, QGemm8_M32{});
    return f(b8, QGemm8_M64{});
  }
  auto narrow = [&](auto bits) -> decltype(auto) {
    if (c == 0) return f(bits, QGemm_M8{});
    if (c == 1) return f(bits, QGemm_M16{});
    return f(bits, QGemm_M32{});
  };
  return s.bits == 3 ? narrow(std::integral_constant<int, 3>{}) : narrow(std::integral_constant<int, 4>{});
}
// The plan qgemm_cuda uses for s on a device with sm_count SMs, its configuration's name, and its workspace sizes
// (pointers left null).
inline QGemmPlan qgemm_plan(const QGemmShape& s, int sm_count, int cps_override = 0) {
  return with_qgemm_cfg(
      s, [&](auto bits, auto c) { return plan_qgemm(s, qgemm_geometry<decltype(c), decltype(bits)::value>(), sm_count, cps_override); });
}
inline std::string qgemm_cfg_name(const QGemmShape& s) {
  return with_qgemm_cfg(s, [](auto, auto c) { return detail::cfg_name<decltype(c)>(); });
}
inline QGemmWorkspace qgemm_workspace_size(const QGemmShape& s, int sm_count, int cps_override = 0) {
  const QGemmPlan p = qgemm_plan(s, sm_count, cps_override);
  return {nullptr, p.partial_elems, nullptr, p.counter_elems};
}

// ==== the sm90 family =================================================================================================
// A block = WGS consumer warpgroups x one strip of 64 WM WGS features x BN batch rows x one K range (gemm/sm90.cuh).
// K splits (when the strips are too few for the SMs) are summed in order (deterministic) one of three ways, the plan
// picks by sm90_split_cost: in a thread-block cluster through distributed shared memory (no global traffic, but a
// cluster's blocks must share a GPC); through global memory summed by every block of a tile, a share each ("spread":
// the grid must fit the GPU at once, a cooperative launch); or by the tile's last block to finish.
struct Sm90Plan {
  int zslices = 1;       // ceil(M / BN)
  int strips = 1;        // ceil(Npad / STRIP)
  int splits = 1;        // K ranges
  int cps = 1;           // 64-k chunks of each of the first `lead` K ranges
  int lead = 1;          // K ranges of cps chunks; the rest have cps_tail (tapered, sm90_taper), the last the remainder
  int cps_tail = 1;      // (uniform plans: lead = splits, cps_tail = cps)
  bool cluster = false;  // K splits reduce within a cluster of `splits` blocks (else through global memory)
  bool spread = false;   // through global memory, every block of a tile sums a share (else the tile's last block sums all)
  int smem_bytes = 0;
  std::int64_t partial_elems = 0;  // fp32 [splits, M, Npad] for a reduction through global memory
  std::int64_t counter_elems = 0;  // int32 [zslices, strips], zero between launches (the same)
  std::int64_t blocks() const { return std::int64_t(zslices) * strips * splits; }
};
inline std::string describe(const Sm90Plan& p) {
  return "zslices " + std::to_string(p.zslices) + " strips " + std::to_string(p.strips) + " splits " + std::to_string(p.splits) +
         (p.splits > 1 ? (p.cluster  ? " (cluster)"
                          : p.spread ? " (global, spread)"
                                     : " (global)")
                       : "") +
         " cps " + std::to_string(p.cps) +
         (p.lead < p.splits ? " taper " + std::to_string(p.lead) + "+" + std::to_string(p.cps_tail) : "") + " smem " +
         std::to_string(p.smem_bytes) + " B";
}
// K range `split`'s chunks [kc0, kc0 + nck) of kchunks: `lead` ranges of cps chunks, then ranges of cps_tail (the
// kernel and the plan's checks alike)
struct Sm90Range {
  int kc0, nck;
};
SQUEEZE_HD constexpr Sm90Range sm90_k_range(int split, int kchunks, int cps, int lead, int cps_tail) {
  const int kc0 = split < lead ? split * cps : lead * cps + (split - lead) * cps_tail;
  const int end = kc0 + (split < lead ? cps : cps_tail);
  return {kc0, (end < kchunks ? end : kchunks) - kc0};
}
// Whether the plan's K ranges cover kchunks chunks, each at least one, and none past the end.
inline bool sm90_ranges_cover(const Sm90Plan& p, std::int64_t kchunks) {
  if (p.splits < 1 || p.lead < 1 || p.lead > p.splits || p.cps < 1 || p.cps_tail < 1 || kchunks > 0x7fffffff) return false;
  const Sm90Range last = sm90_k_range(p.splits - 1, int(kchunks), p.cps, p.lead, p.cps_tail);
  const std::int64_t reach = std::int64_t(p.lead) * p.cps + std::int64_t(p.splits - p.lead) * p.cps_tail;
  return last.nck >= 1 && reach >= kchunks;
}

// K splits: at most 16 K ranges, at most 8 when they reduce within a cluster (a cluster of up to 8 blocks is portable).
inline constexpr int kSm90MaxSplits = 16, kSm90MaxClusterSplits = 8;
// The largest cluster the plan picks by itself: a cluster of 8 was never the fastest for the wgmma forms (a GPU holds
// few of them of one-per-SM blocks). The mma.sync forms take clusters of 8 at three blocks per SM (faster than through
// global memory) and none at four (every cluster plan slower) (measured: docs/kernels/quant-gemm.md).
inline constexpr int kSm90AutoClusterSplits = 6;
template <class C>
constexpr int sm90_auto_cluster_splits() {
  return !C::SYNC ? kSm90AutoClusterSplits : C::MINB >= 4 ? 1 : kSm90MaxClusterSplits;
}
// How the K ranges of a tile are summed: Auto lets the plan pick (splits_override then fixes only the count); Cluster,
// Global (spread where the grid fits, else the last block) or GlobalLast (the last block whatever the grid: measurement).
enum class Sm90Reduce { Auto, Cluster, Global, GlobalLast };
// What the GPU holds of one configuration at once: `slots` blocks (SMs x blocks per SM), and clusters[k] clusters of k
// blocks (a cluster's blocks share a GPC, so a GPC whose free slots are fewer than k wastes them: a GPU may hold
// clusters of 8 one-per-SM blocks on fewer SMs than it has). sm90_capacity<C>(sm_count) asks the device
// (cudaOccupancyMaxActiveClusters).
struct Sm90Capacity {
  int slots = 1;
  // blocks of the global-reduction kernels (fp16 and bf16) the GPU holds at once: the spread reduction's cooperative
  // launch needs its whole grid resident (their registers can differ from the cluster kernel's)
  int spread_slots = 1;
  int clusters[kSm90MaxClusterSplits + 1] = {};
};
// Every slot usable by clusters of every size: an idealised GPU of sm_count SMs (no device query).
template <class C>
Sm90Capacity sm90_even_capacity(int sm_count) {
  Sm90Capacity c;
  c.slots = c.spread_slots = std::max(sm_count, 1) * C::MINB;
  for (int k = 1; k <= kSm90MaxClusterSplits; ++k) c.clusters[k] = c.slots / k;
  return c;
}
// The estimated cost of `splits` K ranges of `tiles` tiles reduced one way, in bytes of weights streamed:
//   the weight bytes, once per batch slice, over the fraction of the GPU's slots the grid keeps busy (a wave is the
//   blocks, or for a cluster reduction the clusters, the GPU holds at once); through global memory in more than one
//   wave, as ceil(blocks / SMs) blocks on one SM (an SM starts its next block as one of its own ends);
//   x kSm90LoneBlock where a two-blocks-per-SM configuration has at most one block per SM (a block alone runs faster);
//   + kSm90WaveBytes per wave after the first (a block's ring fills again);
//   + the reduction per split, row and column: 6 B through global memory summed by the last block (partials written
//   and read back) plus kSm90GlobalBytes once (its serial tail); kSm90SpreadBytes spread; 4 B in a cluster.
// Fitted to sweeps of every reduction at 1..16 K ranges: the plans it picks are close to the best measured over the
// dispatched configurations (measured: docs/kernels/quant-gemm.md).
inline constexpr double kSm90LoneBlock = 0.8, kSm90WaveBytes = 4e6, kSm90GlobalBytes = 4e6, kSm90SpreadBytes = 4.0;
// The spread form from 8 batch rows on: below, the last block's sum covers few rows (a short serial tail) while the
// spread form waits for a tile's slowest block (the last block summing was faster at M 1..4).
inline constexpr std::int64_t kSm90SpreadMinRows = 8;
// Whether K splits through global memory are summed spread rather than by the tile's last block: the grid of `blocks`
// fits the GPU at once (the cooperative launch) and the batch has kSm90SpreadMinRows rows or more.
inline bool sm90_spreads(const QGemmShape& s, std::int64_t blocks, const Sm90Capacity& cap) {
  return blocks <= cap.spread_slots && s.M >= kSm90SpreadMinRows;
}
inline double sm90_split_cost(const QGemmShape& s, int zslices, std::int64_t tiles, int splits, bool cluster, const Sm90Capacity& cap,
                              int blocks_per_sm) {
  const double wbytes = double(s.Npad) * double(s.Kpad) / 2 * zslices;
  const std::int64_t slots = std::max(cap.slots, 1), blocks = tiles * splits;
  std::int64_t waves = 1, wave_blocks = 0, wave_slots = slots;  // wave_slots: the slots a wave stands for
  if (cluster) {
    const std::int64_t per_wave = std::max(cap.clusters[splits], 1);
    waves = (tiles + per_wave - 1) / per_wave;
    wave_blocks = std::min(tiles, per_wave) * splits;
    wave_slots = std::max(slots, per_wave * splits);
  } else {
    waves = (blocks + slots - 1) / slots;
    wave_blocks = std::min(blocks, slots);
  }
  double cost = wbytes * double(waves * wave_slots) / double(blocks);
  if (!cluster && waves > 1) {
    // more than one wave: an SM takes its next block as one of its own ends, so the grid ends with the SM that ran the
    // most blocks: ceil(blocks / SMs) of them
    const std::int64_t sms = std::max<std::int64_t>(slots / std::max(blocks_per_sm, 1), 1);
    cost = wbytes * double((blocks + sms - 1) / sms * sms) / double(blocks);
  }
  if (blocks_per_sm > 1 && wave_blocks * blocks_per_sm <= slots && !cluster) cost *= kSm90LoneBlock;
  cost += kSm90WaveBytes * double(waves - 1);
  const bool spread = !cluster && sm90_spreads(s, blocks, cap);
  if (splits > 1)
    cost += (cluster  ? 4.0
             : spread ? kSm90SpreadBytes
                      : 6.0) *
                splits * double(s.M) * double(s.Npad) +
            (cluster || spread ? 0.0 : kSm90GlobalBytes);
  return cost;
}
// Tapers a plan's K ranges through global memory: its first `lead` K ranges longer, the other splits - lead of cps_tail
// chunks each (the last takes the remainder), so that the blocks a grid of more than one wave starts last are the
// short ones (the grid runs K range by K range: blockIdx.z), as blocks on some SMs run markedly longer than the median.
// "" when done; else why not (the plan is unchanged).
inline std::string sm90_taper(Sm90Plan& p, const QGemmShape& s, int lead, int cps_tail) {
  const std::int64_t kchunks = s.Kpad / kTileK;
  if (p.splits < 2 || p.cluster) return "tapered K ranges need K splits through global memory (this plan: " + describe(p) + ")";
  if (lead < 1 || lead >= p.splits) return "lead " + std::to_string(lead) + " is not within 1.." + std::to_string(p.splits - 1);
  if (cps_tail < 1) return "cps_tail " + std::to_string(cps_tail) + " is not positive";
  const std::int64_t rest = kchunks - std::int64_t(p.splits - lead) * cps_tail;  // chunks left to the lead ranges
  Sm90Plan t = p;
  t.lead = lead;
  t.cps_tail = cps_tail;
  t.cps = int(std::max<std::int64_t>((rest + lead - 1) / lead, 1));
  if (rest < lead || t.cps < cps_tail || !sm90_ranges_cover(t, kchunks))
    return std::to_string(p.splits - lead) + " K ranges of " + std::to_string(cps_tail) + " chunks after " + std::to_string(lead) +
           " longer ones do not fit " + std::to_string(kchunks) + " chunks";
  p = t;
  return "";
}

// sm90_taper with the tail ranges `ratio` times as long as the lead ones (rounded, at least one chunk). The plan takes
// kSm90TaperRatio with the K ranges the first wave holds whole, plus one, as lead: a grid of a few waves ran faster
// tapered than in uniform K ranges (measured: docs/kernels/quant-gemm.md).
inline constexpr double kSm90TaperRatio = 0.8;
// The K ranges the plan's first wave holds whole (global-reduction kernels: the grid runs K range by K range).
inline int sm90_first_wave_ranges(const Sm90Plan& p, const Sm90Capacity& cap) {
  return int(cap.spread_slots / std::max<std::int64_t>(std::int64_t(p.zslices) * p.strips, 1));
}
inline std::string sm90_taper_ratio(Sm90Plan& p, const QGemmShape& s, int lead, double ratio) {
  if (!(ratio > 0 && ratio <= 1)) return "taper ratio " + std::to_string(ratio) + " is not within (0, 1]";
  const double kchunks = double(s.Kpad / kTileK), tail = ratio * kchunks / (lead + ratio * (p.splits - lead));
  return sm90_taper(p, s, lead, std::max(1, int(std::lround(tail))));
}

// K ranges of at least kSm90MinChunks chunks (shorter ones were slower from 9 rows on), of kSm90MinChunksFewRows below
// kSm90SpreadMinRows batch rows, where the partials are small (there more, shorter ranges were faster).
inline constexpr int kSm90MinChunks = 8, kSm90MinChunksFewRows = 4;
// K splits: the count (1..16) and the reduction with the least sm90_split_cost, unless given.
template <class C>
Sm90Plan plan_qgemm_sm90(const QGemmShape& s, const Sm90Capacity& cap, int splits_override = 0, Sm90Reduce reduce = Sm90Reduce::Auto) {
  Sm90Plan p;
  const std::int64_t kchunks = s.Kpad / kTileK;
  p.zslices = int((s.M + C::BN - 1) / C::BN);
  p.strips = int((s.Npad + C::STRIP - 1) / C::STRIP);
  const std::int64_t tiles = std::int64_t(p.zslices) * p.strips;
  p.smem_bytes = C::SMEM_BYTES;
  // the count a request for sp K ranges gives (no empty K range)
  auto ranges = [&](std::int64_t sp) {
    const std::int64_t cps = (kchunks + sp - 1) / sp;
    return int((kchunks + cps - 1) / cps);
  };
  const int limit = reduce == Sm90Reduce::Cluster ? kSm90MaxClusterSplits : kSm90MaxSplits;
  int splits = splits_override > 0 ? ranges(std::clamp<std::int64_t>(splits_override, 1, std::min<std::int64_t>(kchunks, limit))) : 1;
  const bool global = reduce == Sm90Reduce::Global || reduce == Sm90Reduce::GlobalLast;
  bool cluster = !global;
  if (splits_override > 0) {
    if (reduce == Sm90Reduce::Auto)
      cluster = splits <= kSm90MaxClusterSplits && sm90_split_cost(s, p.zslices, tiles, splits, true, cap, C::MINB) <
                                                       sm90_split_cost(s, p.zslices, tiles, splits, false, cap, C::MINB);
  } else {
    const int min_chunks = s.M < kSm90SpreadMinRows ? kSm90MinChunksFewRows : kSm90MinChunks;
    const int max_splits = int(std::clamp<std::int64_t>(kchunks / min_chunks, 1, limit));
    double best = 0;
    for (int sp = 1; sp <= max_splits; ++sp) {
      const int r = ranges(sp);
      for (const bool cl : {true, false}) {
        if (reduce != Sm90Reduce::Auto && cl == global) continue;
        if (cl && r > sm90_auto_cluster_splits<C>()) continue;
        const double cost = sm90_split_cost(s, p.zslices, tiles, r, cl, cap, C::MINB);
        if (best == 0 || cost < best) {
          best = cost;
          splits = r;
          cluster = cl;
        }
      }
    }
  }
  p.cps = int((kchunks + splits - 1) / splits);
  p.splits = int((kchunks + p.cps - 1) / p.cps);
  p.lead = p.splits;
  p.cps_tail = p.cps;
  p.cluster = p.splits > 1 && cluster;
  p.spread = p.splits > 1 && !p.cluster && reduce != Sm90Reduce::GlobalLast && sm90_spreads(s, p.blocks(), cap);
  p.partial_elems = p.splits > 1 && !p.cluster ? std::int64_t(p.splits) * s.M * s.Npad : 0;
  p.counter_elems = p.splits > 1 && !p.cluster ? tiles : 0;
  // a plan of its own choosing through global memory of more than one wave: tapered (forced counts stay uniform)
  if (splits_override == 0 && p.splits > 1 && !p.cluster && !p.spread && p.blocks() > cap.spread_slots)
    sm90_taper_ratio(p, s, sm90_first_wave_ranges(p, cap) + 1, kSm90TaperRatio);  // refused: stays uniform
  return p;
}

// Why the sm_90 kernel cannot take this shape ("" = it can); pointers are checked by the launcher.
inline std::string qgemm_sm90_reason(const QGemmShape& s) {
  if (s.bits != 4) return "the sm_90 GEMM takes 4-bit weights (this layer has " + std::to_string(s.bits) + ")";
  if (s.M <= 0 || s.N <= 0 || s.K <= 0) return "empty shape";
  if (s.K % 8) return "K = " + std::to_string(s.K) + " is not a multiple of 8 (16-byte x copies)";
  if (s.Kpad % kTileK || s.Npad % kTileN || s.Kpad < s.K || s.Kpad >= s.K + kTileK || s.Npad < s.N || s.Npad >= s.N + kTileN)
    return "Kpad / Npad are not the tile padding of K / N";
  if (s.group <= 0 || s.group % 16) return "group " + std::to_string(s.group) + " is not a positive multiple of 16";
  if (s.K > (1ll << 30) || s.N > (1ll << 30) || s.M > (1ll << 24)) return "shape too large";
  return "";
}

// Npad * Kpad from which a layer counts as large (8192 x 28672 is above, LLaMA-7B's 4096-wide layers below), and from
// which M 17..32 takes Sm90_M32 rather than Sm90_M32_Small (4096 x 4096 is below, the three larger LLaMA shapes above).
inline constexpr std::int64_t kSm90LargeLayer = std::int64_t(1) << 27;
inline constexpr std::int64_t kSm90MediumLayer = std::int64_t(1) << 25;
// The dispatch's choice for a 4-bit shape the sm90 kernel takes: calls f(C{}) with the configuration.
template <class F>
decltype(auto) with_sm90_cfg(const QGemmShape& s, F&& f) {
  if (s.M > 64) return f(Sm90_M128{});
  if (s.M <= 8 && s.group % kTileK == 0) return s.Npad * s.Kpad >= kSm90LargeLayer ? f(Sm90_M8_Large{}) : f(Sm90_M8{});
  if (s.M <= 16) {
    if (s.Npad * s.Kpad < kSm90LargeLayer) return f(Sm90_M16{});
    return s.group % kTileK == 0 ? f(Sm90_M16_LargeScaled{}) : f(Sm90_M16_Large{});
  }
  if (s.M <= 32) {
    if (s.Npad * s.Kpad >= kSm90LargeLayer) return f(Sm90_M32_Large{});
    return s.Npad * s.Kpad >= kSm90MediumLayer ? f(Sm90_M32{}) : f(Sm90_M32_Small{});
  }
  if (s.Npad * s.Kpad >= kSm90LargeLayer) return f(Sm90_M64_Large{});
  return f(Sm90_M64{});
}
// The name of the configuration qgemm_sm90_cuda takes for s.
inline std::string qgemm_sm90_cfg_name(const QGemmShape& s) {
  return with_sm90_cfg(s, [](auto c) { return detail::sm90_cfg_name<decltype(c)>(); });
}

}  // namespace squeeze::kernels::quant
