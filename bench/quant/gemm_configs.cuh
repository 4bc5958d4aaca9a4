#pragma once
// The 4-bit GEMM configurations the benchmarks time and the GPU tests check against the CPU twin, beyond the ones the
// dispatch runs (gemm/config.hpp), and the measuring variants. Not library code: the kernels only read their knobs.
// Names (detail::cfg_name / sm90_cfg_name) are how results and logs refer to them.
#include <squeeze/kernels/quant/gemm/config.hpp>

namespace squeeze::bench::gemm {

namespace kq = squeeze::kernels::quant;
using kq::QGemmLoader;
using kq::QGemmMode;
using kq::QGemmConfig;
using kq::Sm90Config;
using QK = kq::QGemmKnobs;
using SK = kq::Sm90Knobs;
// (the configurations are spelled out, QGemmConfig<QK{...}>: nvcc's host compiler rejects an alias template with a
// class-type template parameter inside another template's argument list)

// A list of configuration types (the benchmarks and tests expand it with a fold over its parameters).
template <class... Cs>
struct CfgList {};

// ---- the mma.sync family: every configuration bench_quant_gemm times side by side (test_quant_cuda checks each) -----
using TuningCfgs = CfgList<
    // 8 rows, the register and cp.async loaders
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 8}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 4}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 16}>,
    QGemmConfig<QK{.rows = 8, .warps = 8, .tiles_per_warp = 1, .chunks_in_flight = 8}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 8}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 16, .loader = QGemmLoader::CpAsync}>,
    QGemmConfig<QK{.rows = 8, .warps = 8, .tiles_per_warp = 1, .chunks_in_flight = 16, .loader = QGemmLoader::CpAsync}>,
    // 16 rows
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 1, .chunks_in_flight = 8}>,
    QGemmConfig<QK{.rows = 16, .warps = 8, .tiles_per_warp = 1, .chunks_in_flight = 8}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 4}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 1, .chunks_in_flight = 16, .loader = QGemmLoader::CpAsync}>,
    // 32 and 64 rows
    QGemmConfig<QK{.rows = 32, .tiles_per_warp = 1, .chunks_in_flight = 8}>,
    QGemmConfig<QK{.rows = 32, .tiles_per_warp = 2, .chunks_in_flight = 4}>,
    QGemmConfig<QK{.rows = 64, .tiles_per_warp = 1, .chunks_in_flight = 8}>,
    QGemmConfig<QK{.rows = 64, .tiles_per_warp = 2, .chunks_in_flight = 4}>,
    QGemmConfig<QK{.rows = 64, .warps = 8, .tiles_per_warp = 1, .chunks_in_flight = 4}>,
    // folded zero points
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 8, .fold_zeros = true}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 1, .chunks_in_flight = 8, .fold_zeros = true}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 4, .fold_zeros = true}>,
    QGemmConfig<QK{.rows = 32, .tiles_per_warp = 1, .chunks_in_flight = 8, .fold_zeros = true}>,
    QGemmConfig<QK{.rows = 64, .tiles_per_warp = 2, .chunks_in_flight = 4, .fold_zeros = true}>,
    // the bulk loader (one producer warp, a ring of whole-strip chunks)
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 16, .loader = QGemmLoader::Bulk}>,
    QGemmConfig<QK{.rows = 8, .warps = 8, .tiles_per_warp = 1, .chunks_in_flight = 16, .loader = QGemmLoader::Bulk}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 16, .loader = QGemmLoader::Bulk}>,
    QGemmConfig<QK{.rows = 16, .warps = 8, .tiles_per_warp = 2, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 4, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk}>,
    QGemmConfig<QK{.rows = 32, .tiles_per_warp = 2, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk}>,
    QGemmConfig<QK{.rows = 32, .warps = 8, .tiles_per_warp = 2, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk}>,
    QGemmConfig<QK{.rows = 64, .tiles_per_warp = 2, .chunks_in_flight = 4, .loader = QGemmLoader::Bulk}>,
    QGemmConfig<QK{.rows = 64, .warps = 8, .tiles_per_warp = 2, .chunks_in_flight = 4, .loader = QGemmLoader::Bulk}>,
    // the bulk loader on a persistent grid (persist: blocks per SM), consecutive items per block
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 16, .loader = QGemmLoader::Bulk, .persist = 2}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 16, .loader = QGemmLoader::Bulk, .persist = 2}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk, .persist = 3}>,
    QGemmConfig<QK{.rows = 32, .tiles_per_warp = 2, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk, .persist = 2}>,
    QGemmConfig<QK{.rows = 64, .tiles_per_warp = 2, .chunks_in_flight = 4, .loader = QGemmLoader::Bulk, .persist = 1}>,
    // scaled B (weights rounded to T, no per-group sums): more rows per warp or warps per SM
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 4, .scaled_b = true}>,
    QGemmConfig<QK{.rows = 32, .tiles_per_warp = 2, .chunks_in_flight = 4, .scaled_b = true}>,
    QGemmConfig<QK{.rows = 64, .tiles_per_warp = 2, .chunks_in_flight = 4, .scaled_b = true}>,
    QGemmConfig<QK{.rows = 64, .warps = 8, .tiles_per_warp = 1, .chunks_in_flight = 4, .scaled_b = true}>,
    QGemmConfig<QK{.rows = 32, .tiles_per_warp = 2, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk, .scaled_b = true}>,
    QGemmConfig<QK{.rows = 64, .tiles_per_warp = 2, .chunks_in_flight = 4, .loader = QGemmLoader::Bulk, .scaled_b = true}>,
    // register caps for occupancy (min_blocks)
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 4, .min_blocks = 4}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 4, .min_blocks = 4}>,
    QGemmConfig<QK{.rows = 32, .tiles_per_warp = 2, .chunks_in_flight = 4, .min_blocks = 3}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk, .min_blocks = 3}>,
    // weights as the A operand (batch 1..16 on the mma's n8: one mma per 16 columns x 16 k x 8 rows), with folded zero
    // points, the bulk loader, a persistent grid or scaled B
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 4, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 8, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 4, .fold_zeros = true, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 8, .fold_zeros = true, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 8, .warps = 8, .tiles_per_warp = 1, .chunks_in_flight = 8, .fold_zeros = true, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 4, .fold_zeros = true, .min_blocks = 5, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 4, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 1, .chunks_in_flight = 8, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk, .fold_zeros = true, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk, .fold_zeros = true, .min_blocks = 5, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 8, .warps = 8, .tiles_per_warp = 1, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 8, .warps = 8, .tiles_per_warp = 1, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk, .fold_zeros = true, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 16, .loader = QGemmLoader::Bulk, .fold_zeros = true, .persist = 2, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 16, .loader = QGemmLoader::Bulk, .persist = 2, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 4, .scaled_b = true, .weights_as_a = true}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 4, .scaled_b = true, .weights_as_a = true}>>;

// Measuring variants of the mma.sync kernel (bench_quant_gemm's diag section): the same loads without the math, the
// loads and the decode without the mma.
using DiagnosticCfgs = CfgList<
    // the loads alone, the loads and the decode (no mma)
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 8, .mode = QGemmMode::LoadOnly}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 8, .mode = QGemmMode::LoadDecode}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 8, .fold_zeros = true, .mode = QGemmMode::LoadDecode}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 16, .loader = QGemmLoader::CpAsync, .mode = QGemmMode::LoadOnly}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 1, .chunks_in_flight = 8, .mode = QGemmMode::LoadDecode}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 16, .loader = QGemmLoader::Bulk, .mode = QGemmMode::LoadOnly}>,
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk, .mode = QGemmMode::LoadOnly}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 16, .loader = QGemmLoader::Bulk, .mode = QGemmMode::LoadDecode}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 16, .loader = QGemmLoader::Bulk, .mode = QGemmMode::LoadOnly, .persist = 2}>,
    // does capping registers (more warps per SM) speed the decode? QGemm_M16 without and with a cap
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 4, .mode = QGemmMode::LoadDecode}>,
    QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 4, .mode = QGemmMode::LoadDecode, .min_blocks = 4}>,
    // weights as A at 8 rows: the loads alone
    QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 4, .mode = QGemmMode::LoadOnly, .weights_as_a = true}>>;

// ---- the sm90 family: every configuration bench_qgemm_sm90 times at several K splits (test_quant_sm90 checks each) -
using Sm90TuningCfgs = CfgList<
    // block-synchronous cp.async ring
    Sm90Config<SK{.batch_rows = 64, .m64_tiles = 1, .stages = 6, .blocks_per_sm = 2}>,
    Sm90Config<SK{.batch_rows = 128, .m64_tiles = 2, .stages = 6}>,
    // warp-specialised (a producer warp, TMA / bulk copies, mbarriers; names end in w), with overlap (o)
    Sm90Config<SK{.batch_rows = 64, .m64_tiles = 1, .stages = 6, .blocks_per_sm = 2, .warp_specialized = true}>,
    Sm90Config<SK{.batch_rows = 64, .m64_tiles = 1, .stages = 7, .blocks_per_sm = 2, .warp_specialized = true}>,
    Sm90Config<SK{.batch_rows = 128, .m64_tiles = 1, .stages = 6, .warp_specialized = true}>,
    Sm90Config<SK{.batch_rows = 128, .m64_tiles = 1, .stages = 6, .overlap = true, .warp_specialized = true}>,
    // two m64 tiles per warpgroup (half the x reads per weight byte)
    Sm90Config<SK{.batch_rows = 64, .m64_tiles = 2, .stages = 6, .warp_specialized = true}>,
    Sm90Config<SK{.batch_rows = 64, .m64_tiles = 2, .stages = 8, .warp_specialized = true}>,
    // four consumer warpgroups and a producer warpgroup (setmaxnreg): 256-feature strips (names end in g4)
    Sm90Config<SK{.batch_rows = 64, .m64_tiles = 1, .stages = 8, .warp_specialized = true, .consumer_warpgroups = 4}>,
    Sm90Config<SK{.batch_rows = 128, .m64_tiles = 1, .stages = 6, .warp_specialized = true, .consumer_warpgroups = 4}>,
    Sm90Config<SK{.batch_rows = 128, .m64_tiles = 1, .stages = 8, .warp_specialized = true, .consumer_warpgroups = 4}>,
    // 16- and 32-row batch slices (a quarter / half the tensor work of 64-row slices): room for two blocks per SM
    Sm90Config<SK{.batch_rows = 16, .m64_tiles = 2, .stages = 8, .warp_specialized = true}>,
    Sm90Config<SK{.batch_rows = 16, .m64_tiles = 2, .stages = 8, .blocks_per_sm = 2, .warp_specialized = true}>,
    Sm90Config<SK{.batch_rows = 32, .m64_tiles = 2, .stages = 6, .blocks_per_sm = 2, .warp_specialized = true}>,
    Sm90Config<SK{.batch_rows = 32, .m64_tiles = 2, .stages = 8, .warp_specialized = true}>,
    // three blocks per SM (5 stages to fit), plain and with per-group scaling (names end in f); 32 rows at 4 stages
    Sm90Config<SK{.batch_rows = 16, .m64_tiles = 2, .stages = 5, .blocks_per_sm = 3, .warp_specialized = true}>,
    Sm90Config<SK{.batch_rows = 16, .m64_tiles = 2, .stages = 5, .blocks_per_sm = 3, .warp_specialized = true, .group_scale = true}>,
    Sm90Config<SK{.batch_rows = 32, .m64_tiles = 2, .stages = 4, .blocks_per_sm = 3, .warp_specialized = true}>,
    // mma.sync consumers (names start with mma_) in 8-row slices, three and four blocks per SM
    Sm90Config<SK{.batch_rows = 8, .m64_tiles = 2, .stages = 5, .blocks_per_sm = 3, .warp_specialized = true, .group_scale = true, .mma_sync = true}>,
    Sm90Config<SK{.batch_rows = 8, .m64_tiles = 2, .stages = 4, .blocks_per_sm = 4, .warp_specialized = true, .group_scale = true, .mma_sync = true}>>;

// bench_qgemm_sm90 --extra: further configurations, timed and compared with the mma.sync kernel's result but not
// checked by the GPU tests: 32-row slices at three blocks per SM with one m64 tile per warpgroup, and 16-row slices on
// mma.sync consumers (within -5..+4% of the best wgmma form at M 9..16 on the H200, so not dispatched).
using Sm90ExtraCfgs = CfgList<
    Sm90Config<SK{.batch_rows = 32, .m64_tiles = 1, .stages = 6, .blocks_per_sm = 3, .warp_specialized = true}>,
    Sm90Config<SK{.batch_rows = 16, .m64_tiles = 2, .stages = 5, .blocks_per_sm = 3, .warp_specialized = true, .group_scale = true, .mma_sync = true}>>;

// Measuring variants of a warp-specialised sm90 configuration (bench_qgemm_sm90 --probes, --timeline): the same grid,
// ring and copies, less of the consumers' work, so the time says what bounds the real kernel.
//   PROBE 1: no decode: the raw tile words are the A operand, no group constants (the wgmma and the copies remain);
//   PROBE 2: no consumer work: each consumer warp waits for every stage and hands it back (the copies remain);
//   PROBE 3: all the work (right results) plus a timeline: per block the clock at kSm90TraceSlots points into
//     Sm90Params::trace, so the benchmark can split a launch into start-up, wait for the first chunk, loop, epilogue.
// Probes 1 and 2 give wrong results by design. (On the H200, 8192 x 28672 at M = 16, Sm90_M16 with 2 K ranges in a
// cluster: the kernel 0.0605 ms, without the decode 0.0427, the copies alone 0.0351, a plain read of the tiles 0.0322:
// the ring streams at the read bound, the consumers' decode and wgmma are the cost.)
template <class Base, int PROBE_>
struct Sm90Probe : Base {
  static_assert(Base::WS && !Base::OVERLAP, "probes measure the warp-specialised form");
  static_assert(PROBE_ >= 1 && PROBE_ <= 3, "probe 1 (no decode), 2 (no consumer work) or 3 (timeline)");
  static_assert(!(Base::GSCALE && PROBE_ == 1), "probe 1 loads no group constants, which per-group scaling reads: probe its base without it");
  static constexpr int PROBE = PROBE_;
};
// What the dispatched 16-row and 128-row forms cost without their decode, and without any consumer work.
using Sm90ProbeCfgs = CfgList<
    Sm90Probe<Sm90Config<SK{.batch_rows = 16, .m64_tiles = 2, .stages = 8, .blocks_per_sm = 2, .warp_specialized = true}>, 1>,
    Sm90Probe<Sm90Config<SK{.batch_rows = 16, .m64_tiles = 2, .stages = 8, .blocks_per_sm = 2, .warp_specialized = true}>, 2>,
    Sm90Probe<Sm90Config<SK{.batch_rows = 16, .m64_tiles = 2, .stages = 8, .warp_specialized = true}>, 2>,
    Sm90Probe<Sm90Config<SK{.batch_rows = 64, .m64_tiles = 2, .stages = 8, .warp_specialized = true}>, 2>,
    Sm90Probe<Sm90Config<SK{.batch_rows = 128, .m64_tiles = 1, .stages = 8, .warp_specialized = true, .consumer_warpgroups = 4}>, 1>,
    Sm90Probe<Sm90Config<SK{.batch_rows = 128, .m64_tiles = 1, .stages = 8, .warp_specialized = true, .consumer_warpgroups = 4}>, 2>>;

}  // namespace squeeze::bench::gemm
