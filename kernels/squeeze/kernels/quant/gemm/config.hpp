#pragma once
// Compile-time configurations of the two GEMM kernel families, and the ones the dispatch runs. Plain C++ (the host
// plans in plan.hpp read them under any compiler).
//
// A configuration is written with named knobs, QGemmConfig<QGemmKnobs{.rows = 16, ...}> or
// Sm90Config<Sm90Knobs{.batch_rows = 16, ...}>; omitted knobs keep their defaults. The configuration type derives what
// the kernel needs from them (threads, shared-memory layout, ...) as static members, in the kernels' short names
// (ROWS8, W, NT, ... / BN, WM, STAGES, ...), and checks the combination at compile time. Benchmark-only configurations
// (tuning lists, measuring variants) are in bench/quant/gemm_configs.cuh: a measuring variant is a configuration that
// names the work its kernel does as Work (see WorkOf).
#include <string>

#include "squeeze/kernels/quant/gemm/layout.hpp"

namespace squeeze::kernels::quant {

// ---- the mma.sync family (gemm/mma_sync.cuh): x [rows] x W strips on mma.sync.m16n8k16, any sm_80+ GPU ------------
// Weight loaders: Registers (each lane's loads straight into registers, chunks_in_flight deep), CpAsync (each lane's
// 16-byte cp.async into a per-thread ring), Bulk (one producer warp copies each chunk's whole strip with bulk copies
// into a ring of mbarrier-guarded slots; sm_90).
enum class QGemmLoader { Registers = 0, CpAsync = 1, Bulk = 2 };

struct QGemmKnobs {
  int rows = 0;              // x rows per block: 8, 16, 32 or 64 (8 rows use half an m16 tile, two k-steps per ldmatrix.x4)
  int warps = 4;             // warps per block
  int tiles_per_warp = 0;    // 16-column tiles per warp (an A fragment feeds 2 mma per tile)
  int chunks_in_flight = 0;  // 64-k weight chunks in flight per warp (registers or ring slots)
  QGemmLoader loader = QGemmLoader::Registers;
  // zero points folded out of the decode: the mma multiplies x by (magic + q) and each group's sum is corrected by
  // (magic + z) * sum(x over the group), the sums from one more mma per k-step against ones (8-bit bf16 keeps the
  // per-element subtraction: bf16 cannot hold 128 + 255)
  bool fold_zeros = false;
  int persist = 0;  // Bulk only: > 0 = a persistent grid of at most `persist` blocks per SM
  // B = (q - z) * scale rounded to T, accumulated straight into the result: no per-group sums, half the accumulators;
  // NOT exact (each weight rounded to T once: fp16 2^-11, bf16 2^-8 relative)
  bool scaled_b = false;
  int min_blocks = 1;  // blocks per SM for __launch_bounds__ (caps the registers per thread)
  // weights as the mma A operand, x as B (8 or 16 rows): a tile word already is the A fragment of its 16 n x 16 k, so
  // one mma covers 16 columns x 8 batch rows (x as A at 8 rows wasted 15 of the 16 A rows)
  bool weights_as_a = false;
};

template <QGemmKnobs K>
struct QGemmConfig {
  static constexpr QGemmKnobs knobs = K;
  static constexpr int ROWS8 = K.rows / 8, W = K.warps, NT = K.tiles_per_warp, PF = K.chunks_in_flight, PERSIST = K.persist,
                       MINB = K.min_blocks;
  static constexpr QGemmLoader LOADER = K.loader;
  static constexpr bool ZFOLD = K.fold_zeros, SCALEB = K.scaled_b, SWAP = K.weights_as_a;
  static constexpr int ROWS = 8 * ROWS8, MT = ROWS8 < 2 ? 1 : ROWS8 / 2, STRIP = W * NT * kTileN;
  static constexpr int THREADS = (W + (LOADER == QGemmLoader::Bulk ? 1 : 0)) * 32;  // Bulk: + the producer warp
  static_assert(K.rows == 8 || K.rows == 16 || K.rows == 32 || K.rows == 64, "rows per block: 8, 16, 32 or 64");
  static_assert(W >= 1 && NT >= 1, "at least one warp and one tile per warp");
  static_assert(PF >= 2, "at least two chunks in flight");
  static_assert(PERSIST == 0 || LOADER == QGemmLoader::Bulk, "a persistent grid needs the bulk loader (its producer streams across items)");
  static_assert(!(SCALEB && ZFOLD), "scaled B and folded zero points exclude each other");
  static_assert(MINB >= 1, "at least one block per SM");
  static_assert(!SWAP || ROWS8 == 1 || ROWS8 == 2, "weights as A: 8 or 16 rows per block");
  // the ring of the shared-memory loaders: PF slots of one chunk of the strip (W * NT tiles; Bulk: plus the group rows,
  // sized by the plan)
  template <int BITS>
  static constexpr int kRingBytes = LOADER != QGemmLoader::Registers ? PF* W* NT* tile_words(BITS) * 4 : 0;
};

// The dispatch's configurations (plan.hpp's with_qgemm_cfg picks one by batch and width).
// 3 and 4 bits: 8 rows with the weights as A up to M = 8, 16 rows up to 16, 32-row slices above (two tiles per warp and
// 4 chunks in flight keep the most bytes in flight per register).
using QGemm_M8 = QGemmConfig<QGemmKnobs{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 4, .weights_as_a = true}>;
using QGemm_M16 = QGemmConfig<QGemmKnobs{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 4}>;
using QGemm_M32 = QGemmConfig<QGemmKnobs{.rows = 32, .tiles_per_warp = 2, .chunks_in_flight = 4}>;
// 8 bits: one tile per warp (twice the words per tile), rows by batch.
using QGemm8_M8 = QGemmConfig<QGemmKnobs{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 4}>;
using QGemm8_M16 = QGemmConfig<QGemmKnobs{.rows = 16, .tiles_per_warp = 1, .chunks_in_flight = 4}>;
using QGemm8_M32 = QGemmConfig<QGemmKnobs{.rows = 32, .tiles_per_warp = 1, .chunks_in_flight = 4}>;
using QGemm8_M64 = QGemmConfig<QGemmKnobs{.rows = 64, .tiles_per_warp = 1, .chunks_in_flight = 4}>;

// ---- the sm90 family (gemm/sm90.cuh): Y^T = W * X^T on wgmma (or mma.sync consumers), sm_90a ----------------------
struct Sm90Knobs {
  int batch_rows = 0;     // batch rows per block = wgmma's N: 16, 32, 64 or 128 (8 with mma_sync)
  int m64_tiles = 0;      // m64 tiles per consumer warpgroup (the block's strip: 64 x m64_tiles x consumer_warpgroups features)
  int stages = 0;         // 64-k chunks in the shared-memory ring
  int blocks_per_sm = 1;  // for __launch_bounds__ (2 halves the registers)
  // a warpgroup keeps one chunk's wgmma in flight while it decodes the next into a second A register set; ptxas
  // serializes this form's wgmma (C7513), so it is kept for measurement only
  bool overlap = false;
  // a producer warp queues every copy of a chunk (x by the TMA, bulk copies of tiles and group rows) and mbarriers
  // hand stages over: the consumers run no address arithmetic and no block barrier per chunk (else block-synchronous
  // cp.async)
  bool warp_specialized = false;
  int consumer_warpgroups = 2;  // 2 or 4 (4: a whole producer warpgroup, which gives its registers away by setmaxnreg)
  // the A operand is the exact q - z and each group's fp32 sums are scaled once per group (no scale multiply in the
  // decode); needs groups of whole 64-k chunks and a second accumulator set
  bool group_scale = false;
  // each consumer warp multiplies its own 16-feature tiles with mma.sync.m16n8k16 in 8-row batch slices: no
  // warpgroup-wide pipeline holding a chunk's A registers, so three or four blocks fit an SM without serialized wgmma
  bool mma_sync = false;
};

template <Sm90Knobs K>
struct Sm90Config {
  static constexpr Sm90Knobs knobs = K;
  static constexpr int BN = K.batch_rows, WM = K.m64_tiles, STAGES = K.stages, MINB = K.blocks_per_sm, WGS = K.consumer_warpgroups;
  static constexpr bool OVERLAP = K.overlap, WS = K.warp_specialized, GSCALE = K.group_scale, SYNC = K.mma_sync;
  static_assert(!GSCALE || (WS && !OVERLAP), "per-group fp32 scaling (group_scale) is built for the warp-specialised form without overlap");
  static_assert(!SYNC || (WS && !OVERLAP && BN <= 16),
                "mma.sync consumers are built for the warp-specialised form without overlap, batch slices of 8 or 16 rows");
  static constexpr int AHEAD = OVERLAP ? STAGES - 2 : STAGES - 1;  // chunks the copy ring runs ahead (block-synchronous)
  static constexpr int CONSUMERS = 128 * WGS;                      // the consumer warpgroups
  // + the producer: one warp; with 4 consumer warpgroups a whole warpgroup, so that it can hand its registers to the
  // consumers (setmaxnreg works per warpgroup): 4 x 128 + 32 threads would cap every thread at 96 registers, too few
  // for a 64 x 128 accumulator without serialized wgmma (ptxas C7512)
  static constexpr int PRODUCERS = WS ? (WGS == 4 ? 128 : 32) : 0;
  static constexpr int THREADS = CONSUMERS + PRODUCERS;
  // setmaxnreg targets (WGS = 4): the block starts with the registers __launch_bounds__ gives every thread (64 K over
  // THREADS, in steps of 8) and may only move them between warpgroups: the producer keeps 24
  static constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8, PRODUCER_REGS = 24;
  static constexpr int CONSUMER_REGS = (THREADS * LAUNCH_REGS - PRODUCERS * PRODUCER_REGS) / CONSUMERS / 8 * 8;
  static constexpr int STRIP = WGS * 64 * WM;   // output features per block
  static constexpr int TILES = STRIP / kTileN;  // 16-feature tiles per block
  static constexpr int GROWS = 4;               // group rows per stage: a 64-k chunk meets <= 4 groups of >= 16
  // stage layout (bytes): x [BN][128 B] first (1024-aligned for the swizzle), weights [TILES][512 B], scales
  // [GROWS][STRIP] fp16, zero points [GROWS][STRIP] uint8; stages 1024-aligned
  static constexpr int X_BYTES = BN * 128, W_BYTES = TILES * 512, S_BYTES = GROWS * STRIP * 2, Z_BYTES = GROWS * STRIP;
  static constexpr int STAGE_BYTES = (X_BYTES + W_BYTES + S_BYTES + Z_BYTES + 1023) / 1024 * 1024;
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024;  // + 1024: the kernel aligns the base itself
  // K splits: the block's fp32 sums, [BN][SPLIT_PITCH] over the ring (+4 floats a row: the four rows one store
  // instruction writes, 2 apart, fall in different banks)
  static constexpr int SPLIT_PITCH = STRIP + 4;
  static_assert(BN * SPLIT_PITCH * 4 <= STAGES * STAGE_BYTES, "the K-split sums must fit in the ring");
  static_assert(BN == 16 || BN == 32 || BN == 64 || BN == 128 || (SYNC && BN == 8),
                "batch rows per block: 16, 32, 64 or 128 (the wgmma wrappers), or 8 with mma.sync consumers");
  static_assert(WM >= 1 && WM <= 4, "m64 tiles per warpgroup: 1..4");
  static_assert(WGS == 2 || WGS == 4, "consumer warpgroups: 2 or 4");
  static_assert(STAGES >= (OVERLAP ? 3 : 2), "at least two stages (three with overlap)");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per block");
};

// The dispatch's configurations, all warp-specialised (plan.hpp's with_sm90_cfg picks one by batch, layer size and group;
// docs/kernels/quant-gemm.md has the measurements behind each).
// M <= 8, groups of whole chunks: mma.sync consumers in 8-row slices with per-group scaling, three blocks per SM
// (5 stages fit three rings); on large layers four (4 stages).
using Sm90_M8 = Sm90Config<Sm90Knobs{
    .batch_rows = 8, .m64_tiles = 2, .stages = 5, .blocks_per_sm = 3, .warp_specialized = true, .group_scale = true, .mma_sync = true}>;
using Sm90_M8_Large = Sm90Config<Sm90Knobs{
    .batch_rows = 8, .m64_tiles = 2, .stages = 4, .blocks_per_sm = 4, .warp_specialized = true, .group_scale = true, .mma_sync = true}>;
// M <= 16: 16-row slices (a quarter of the tensor work of 64-row ones), two blocks per SM; on large layers three (more
// warps to hide the decode's latencies, although ptxas then serializes the wgmma, C7512), with per-group scaling where
// the groups are whole chunks.
using Sm90_M16 = Sm90Config<Sm90Knobs{.batch_rows = 16, .m64_tiles = 2, .stages = 8, .blocks_per_sm = 2, .warp_specialized = true}>;
using Sm90_M16_Large = Sm90Config<Sm90Knobs{.batch_rows = 16, .m64_tiles = 2, .stages = 5, .blocks_per_sm = 3, .warp_specialized = true}>;
using Sm90_M16_LargeScaled =
    Sm90Config<Sm90Knobs{.batch_rows = 16, .m64_tiles = 2, .stages = 5, .blocks_per_sm = 3, .warp_specialized = true, .group_scale = true}>;
// M <= 32: 32-row slices; one block per SM and a deep ring on small layers, two from kSm90MediumLayer weights, three on
// large layers.
using Sm90_M32_Small = Sm90Config<Sm90Knobs{.batch_rows = 32, .m64_tiles = 2, .stages = 8, .warp_specialized = true}>;
using Sm90_M32 = Sm90Config<Sm90Knobs{.batch_rows = 32, .m64_tiles = 2, .stages = 6, .blocks_per_sm = 2, .warp_specialized = true}>;
using Sm90_M32_Large = Sm90Config<Sm90Knobs{.batch_rows = 32, .m64_tiles = 2, .stages = 4, .blocks_per_sm = 3, .warp_specialized = true}>;
// M <= 64: one m64 tile a warpgroup and two blocks per SM; on large layers two tiles (half the x reads per weight byte).
using Sm90_M64 = Sm90Config<Sm90Knobs{.batch_rows = 64, .m64_tiles = 1, .stages = 6, .blocks_per_sm = 2, .warp_specialized = true}>;
using Sm90_M64_Large = Sm90Config<Sm90Knobs{.batch_rows = 64, .m64_tiles = 2, .stages = 8, .warp_specialized = true}>;
// M > 64: 128-row slices, four consumer warpgroups (256-feature strips: half the x bytes per weight byte without a
// second accumulator set).
using Sm90_M128 = Sm90Config<Sm90Knobs{.batch_rows = 128, .m64_tiles = 1, .stages = 8, .warp_specialized = true, .consumer_warpgroups = 4}>;

namespace detail {
// The work configuration C's kernel does: Default, the GEMM's own (declared with the kernel), unless C names another as
// C::Work, as the measuring variants of bench/quant/gemm_configs.cuh do.
template <class C, class Default>
struct WorkOf {
  using type = Default;
};
template <class C, class Default>
requires requires { typename C::Work; }
struct WorkOf<C, Default> {
  using type = typename C::Work;
};
// The name suffix of a measuring variant (its Work's), else "".
template <class C>
std::string work_suffix() {
  if constexpr (requires { C::Work::suffix; })
    return C::Work::suffix;
  else
    return "";
}

// A configuration's name in logs and results: mma.sync r<rows>w<warps>n<tiles>p<depth>, then a (cp.async loader) or b
// (bulk loader), p<n> (persistent grid), z (folded zero points), s (scaled B), x (weights as A), m<n> (blocks per SM),
// then a measuring variant's suffix (work_suffix).
template <class C>
std::string cfg_name() {
  std::string n = "r" + std::to_string(C::ROWS) + "w" + std::to_string(C::W) + "n" + std::to_string(C::NT) + "p" + std::to_string(C::PF);
  if (C::LOADER == QGemmLoader::CpAsync) n += "a";
  if (C::LOADER == QGemmLoader::Bulk) n += "b";
  if (C::PERSIST > 0) n += "p" + std::to_string(C::PERSIST);
  if (C::ZFOLD) n += "z";
  if (C::SCALEB) n += "s";
  if (C::SWAP) n += "x";
  if (C::MINB > 1) n += "m" + std::to_string(C::MINB);
  return n + work_suffix<C>();
}
// sm90: wg_b<BN>m<WM>s<STAGES>[x<MINB>][o][w][g<WGS>][f] (mma_ for mma.sync consumers), then a measuring variant's suffix.
template <class C>
std::string sm90_cfg_name() {
  return (C::SYNC ? "mma_b" : "wg_b") + std::to_string(C::BN) + "m" + std::to_string(C::WM) + "s" + std::to_string(C::STAGES) +
         (C::MINB > 1 ? "x" + std::to_string(C::MINB) : "") + (C::OVERLAP ? "o" : "") + (C::WS ? "w" : "") +
         (C::WGS != 2 ? "g" + std::to_string(C::WGS) : "") + (C::GSCALE ? "f" : "") + work_suffix<C>();
}
}  // namespace detail

}  // namespace squeeze::kernels::quant
