#pragma once
// The 4-bit GEMM configurations the benchmarks time and the GPU tests check against the CPU twin, beyond the ones the
// dispatch runs (gemm/config.hpp), and the measuring variants with the work policies that make them (C::Work: the
// kernels call it where the GEMM's own would decode, multiply or store). Not library code. Names (detail::cfg_name /
// sm90_cfg_name) are how results and logs refer to them.
#include <cstdint>
#include <type_traits>

#include <squeeze/kernels/quant/gemm/config.hpp>
#include <squeeze/kernels/quant/gemm/mma_sync.cuh>
#include <squeeze/kernels/quant/gemm/sm90.cuh>

namespace squeeze::bench::gemm {

namespace kq = squeeze::kernels::quant;
using squeeze::half;
using kq::QGemmLoader;
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

// ---- measuring variants of the mma.sync kernel (bench_quant_gemm's diag section) ------------------------------------
// Work policies (gemm/mma_sync.cuh's QGemmWork interface) that skip the math: the loads alone, or the loads and the
// decode without the mma and the epilogue. What they skip is folded into a word stored only under a condition that
// never holds, so the compiler keeps the loads and the decode (wrong results by design).
struct LoadSink {
  std::uint32_t word = 0;
};
template <bool DECODE>
struct QGemmMeasureWork {
  static constexpr bool kDecode = DECODE, kMultiply = false;
  static constexpr const char* suffix = DECODE ? "-decode" : "-load";
  using Sink = LoadSink;
  template <class Words>
  __device__ __forceinline__ static void keep(Sink& s, const Words& w) {
    const std::uint32_t* v = reinterpret_cast<const std::uint32_t*>(&w);
#pragma unroll
    for (int i = 0; i < int(sizeof(Words) / 4); ++i) s.word ^= v[i];
  }
  template <class T>
  __device__ __forceinline__ static void finish(const Sink& s, const kq::detail::QGemmParams& p) {
    if (s.word == 0x9e3779b9u && p.M < 0) static_cast<T*>(p.y)[0] = squeeze::from_float<T>(float(s.word));  // never true
  }
};
using LoadOnly = QGemmMeasureWork<false>;
using LoadDecode = QGemmMeasureWork<true>;
// Configuration Base with measuring work W (names end in -load / -decode).
template <class Base, class W>
struct QGemmMeasure : Base {
  using Work = W;
};

using DiagnosticCfgs = CfgList<
    // the loads alone, the loads and the decode (no mma)
    QGemmMeasure<QGemmConfig<QK{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 8}>, LoadOnly>,
    QGemmMeasure<QGemmConfig<QK{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 8}>, LoadDecode>,
    QGemmMeasure<QGemmConfig<QK{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 8, .fold_zeros = true}>, LoadDecode>,
    QGemmMeasure<QGemmConfig<QK{.rows = 8, .tiles_per_warp = 1, .chunks_in_flight = 16, .loader = QGemmLoader::CpAsync}>, LoadOnly>,
    QGemmMeasure<QGemmConfig<QK{.rows = 16, .tiles_per_warp = 1, .chunks_in_flight = 8}>, LoadDecode>,
    QGemmMeasure<QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 16, .loader = QGemmLoader::Bulk}>, LoadOnly>,
    QGemmMeasure<QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 8, .loader = QGemmLoader::Bulk}>, LoadOnly>,
    QGemmMeasure<QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 16, .loader = QGemmLoader::Bulk}>, LoadDecode>,
    QGemmMeasure<QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 16, .loader = QGemmLoader::Bulk, .persist = 2}>, LoadOnly>,
    // does capping registers (more warps per SM) speed the decode? QGemm_M16 without and with a cap
    QGemmMeasure<QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 4}>, LoadDecode>,
    QGemmMeasure<QGemmConfig<QK{.rows = 16, .tiles_per_warp = 2, .chunks_in_flight = 4, .min_blocks = 4}>, LoadDecode>,
    // weights as A at 8 rows: the loads alone
    QGemmMeasure<QGemmConfig<QK{.rows = 8, .tiles_per_warp = 2, .chunks_in_flight = 4, .weights_as_a = true}>, LoadOnly>>;

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

// ---- measuring variants of the sm90 kernel (bench_qgemm_sm90 --probes, --timeline) ---------------------------------
// Work policies (gemm/sm90.cuh's Sm90Work interface) for a warp-specialised configuration: the same grid, ring and
// copies, less of the consumers' work, so the time says what bounds the real kernel.
//   PROBE 1: no decode: the raw tile words are the A operand, no group constants (the wgmma and the copies remain);
//   PROBE 2: no consumer work: each consumer warp waits for every stage and hands it back (the copies remain);
//   PROBE 3: all the work (right results) plus a timeline: per block the clock at kSm90TraceSlots points into the buffer
//     launch_sm90_timeline passes as Sm90Params::work_data, so the benchmark can split a launch into start-up, wait for
//     the first chunk, loop, epilogue.
// Probes 1 and 2 give wrong results by design. (On the H200, 8192 x 28672 at M = 16, Sm90_M16 with 2 K ranges in a
// cluster: the kernel 0.0605 ms, without the decode 0.0427, the copies alone 0.0351, a plain read of the tiles 0.0322:
// the ring streams at the read bound, the consumers' decode and wgmma are the cost.)
// The timeline's slots per block (block blockIdx.x + gridDim.x * blockIdx.z; clock64 unless named ns or Sm).
namespace sm90_trace_slot {
enum : int {
  EntryNs,         // %globaltimer (ns) at entry
  Entry,           // entry
  SetUp,           // after the set-up barrier
  FirstChunk,      // consumer thread 0 has its first chunk
  LoopEnd,         // ... retired its last
  End,             // after the epilogue
  EndNs,           // %globaltimer after the epilogue
  Sm,              // the SM
  QueuedFirst,     // the producer queued its first chunk
  QueuedLast,      // ... its last
  EpilogueWaited,  // Sm90Point::EpilogueWaited (after the consumers' first barrier)
  EpilogueStaged,  // Sm90Point::EpilogueStaged (after the next)
  EpilogueStored,  // after the stores (0 where not reached: not the last block of a last-block reduction)
  ProducerStart,   // the producer before it queues its first chunk
  ProducerX,       // ... after that chunk's x (before its bulk copies)
  Count
};
}  // namespace sm90_trace_slot
inline constexpr int kSm90TraceSlots = sm90_trace_slot::Count;
// The global timer (ns).
__device__ __forceinline__ std::uint64_t global_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
template <int PROBE>
struct Sm90ProbeWork : kq::detail::Sm90Work {
  static_assert(PROBE >= 1 && PROBE <= 3, "probe 1 (no decode), 2 (no consumer work) or 3 (timeline)");
  static constexpr bool kGroupConstants = PROBE != 1, kConsume = PROBE != 2;
  static constexpr const char* suffix = PROBE == 1 ? "_probe1" : PROBE == 2 ? "_probe2" : "_probe3";
  template <class T, bool SCALE>
  __device__ __forceinline__ static void decode(std::uint32_t w, const kq::detail::Sm90Group& g, std::uint32_t (&a)[4]) {
    if constexpr (PROBE == 1) a[0] = w, a[1] = w ^ 1u, a[2] = w ^ 2u, a[3] = w ^ 3u;
    else kq::detail::sm90_decode<T, SCALE>(w, g, a);
  }
  __device__ __forceinline__ static void at(const kq::detail::Sm90Params& p, kq::detail::Sm90Point point) {
    if constexpr (PROBE == 3) {
      using P = kq::detail::Sm90Point;
      namespace S = sm90_trace_slot;
      std::uint64_t* const slot = static_cast<std::uint64_t*>(p.work_data) + (std::int64_t(blockIdx.z) * gridDim.x + blockIdx.x) * kSm90TraceSlots;
      switch (point) {
        case P::Entry: {
          slot[S::EntryNs] = global_ns();
          slot[S::Entry] = clock64();
          unsigned sm;
          asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
          slot[S::Sm] = sm;
          break;
        }
        case P::End:
          slot[S::End] = clock64();
          slot[S::EndNs] = global_ns();
          break;
        case P::SetUp: slot[S::SetUp] = clock64(); break;
        case P::FirstChunk: slot[S::FirstChunk] = clock64(); break;
        case P::LoopEnd: slot[S::LoopEnd] = clock64(); break;
        case P::EpilogueWaited: slot[S::EpilogueWaited] = clock64(); break;
        case P::EpilogueStaged: slot[S::EpilogueStaged] = clock64(); break;
        case P::EpilogueStored: slot[S::EpilogueStored] = clock64(); break;
        case P::ProducerStart: slot[S::ProducerStart] = clock64(); break;
        case P::ProducerX: slot[S::ProducerX] = clock64(); break;
        case P::QueuedFirst: slot[S::QueuedFirst] = clock64(); break;
        case P::QueuedLast: slot[S::QueuedLast] = clock64(); break;
      }
    }
  }
};
// Configuration Base measured by probe PROBE_ (names end in _probe<n>).
template <class Base, int PROBE_>
struct Sm90Probe : Base {
  static_assert(Base::WS && !Base::OVERLAP, "probes measure the warp-specialised form");
  static_assert(!(Base::GSCALE && PROBE_ == 1), "probe 1 loads no group constants, which per-group scaling reads: probe its base without it");
  using Work = Sm90ProbeWork<PROBE_>;
};
// The timeline probe (Sm90Probe<Base, 3>) with its buffer, trace: plan.blocks() x kSm90TraceSlots values (required).
template <class T, class C>
cudaError_t launch_sm90_timeline(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y,
                                 const kq::QGemmShape& s, const kq::Sm90Plan& plan, const kq::QGemmWorkspace& ws, cudaStream_t stream,
                                 std::uint64_t* trace) {
  static_assert(std::is_same_v<typename C::Work, Sm90ProbeWork<3>>, "the timeline probe: Sm90Probe<Base, 3>");
  if (trace == nullptr) return cudaErrorInvalidValue;
  return kq::detail::launch_qgemm_sm90_cfg<T, C>(x, tiles, scales, zeros, y, s, plan, ws, stream, trace);
}
// What the dispatched 16-row and 128-row forms cost without their decode, and without any consumer work.
using Sm90ProbeCfgs = CfgList<
    Sm90Probe<Sm90Config<SK{.batch_rows = 16, .m64_tiles = 2, .stages = 8, .blocks_per_sm = 2, .warp_specialized = true}>, 1>,
    Sm90Probe<Sm90Config<SK{.batch_rows = 16, .m64_tiles = 2, .stages = 8, .blocks_per_sm = 2, .warp_specialized = true}>, 2>,
    Sm90Probe<Sm90Config<SK{.batch_rows = 16, .m64_tiles = 2, .stages = 8, .warp_specialized = true}>, 2>,
    Sm90Probe<Sm90Config<SK{.batch_rows = 64, .m64_tiles = 2, .stages = 8, .warp_specialized = true}>, 2>,
    Sm90Probe<Sm90Config<SK{.batch_rows = 128, .m64_tiles = 1, .stages = 8, .warp_specialized = true, .consumer_warpgroups = 4}>, 1>,
    Sm90Probe<Sm90Config<SK{.batch_rows = 128, .m64_tiles = 1, .stages = 8, .warp_specialized = true, .consumer_warpgroups = 4}>, 2>>;

}  // namespace squeeze::bench::gemm
