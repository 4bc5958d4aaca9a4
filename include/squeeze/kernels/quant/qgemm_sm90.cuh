#pragma once
// Hopper (sm_90a) 4-bit weight GEMM: y [M, N] = x [M, K] * W^T on wgmma, or below 9 batch rows on mma.sync consumers
// (SYNC) in the same warp-specialised ring.
//
// Why another kernel: qgemm.cuh's mma.sync kernel re-reads x per strip and runs far below the tensor-core
// rate once M reaches 64 (H200: 0.41-0.48x cuBLAS bf16 at M = 64, 0.23-0.34x at M = 128). Here the product is
// computed transposed, Y^T [N, M] = W [N, K] * X^T [K, M], so the large N is wgmma's M dimension (64 per
// instruction) and the batch is wgmma's N dimension (BN = 16, 32, 64 or 128): one m64nBNk16 wgmma covers 64 output
// features x the whole batch slice x 16 k.
//
// Operands:
//   A (weights) from registers. The tile layout of qgemm.cuh (quant/tiles.hpp builds it at load, the same
//     buffers qgemm_cuda takes) already holds, in 32-bit word ks of lane l of a 64 k x 16 n tile, the eight
//     codes of that lane's A fragment for k-step ks: pairs 0 / 2 / 1 / 3 of the word are the fragment's
//     registers a0..a3 (rows n = l/4, l/4 + 8; k = 2 (l%4), 2 (l%4) + 8). wgmma's register A fragment is
//     the mma.m16n8k16 one per warp, warp w of the warpgroup taking rows 16 w .. 16 w + 15, so warp w simply
//     decodes tile w of four consecutive tiles (64 n) and the four warps form the m64 operand.
//     Decode: a magic-number LOP3 gives (magic + q) as two fp16 / bf16 values, minus (magic + z) is the exact
//     small integer q - z, times the group's scale gives the weight, rounded to T once (fp16: 2^-11 relative;
//     bf16: the fp16 scale rounded to bf16 and the product rounded, ~2^-8). Accumulation is fp32.
//   B (x^T) from shared memory, K-major, 128-byte swizzle: a stage holds x [BN rows][64 k] (128 B per row,
//     8-row atoms of 1024 B, 16-byte chunk c of row r at chunk c ^ (r % 8)); the descriptor of k-step ks
//     starts 32 B further into the atom (the hardware applies the swizzle to the address bits).
//
// Block: WGS = 2 or 4 consumer warpgroups take a strip of 64 WM WGS output features (warpgroup g takes 64 WM of
// them: WM wgmma per k-step) x BN batch rows x one K range of cps 64-k chunks, through a STAGES-deep ring in
// shared memory; one stage = x [BN][64] (swizzled), the strip's weight tiles of the chunk (4 WM WGS contiguous
// 512-byte tiles) and the scale / zero-point rows of the (at most four) groups the chunk touches. Per chunk and
// k-step a consumer decodes its WM A fragments, fences and queues WM wgmma; it then commits and waits for the
// chunk's wgmma (OVERLAP: for the chunk before) before the stage is refilled. Two ways to fill the ring:
//   block-synchronous: every thread queues its share of 16-byte cp.async per chunk, and a block barrier per chunk
//     hands stages over;
//   warp-specialised (WS, what the dispatch uses): one more warp is the producer (with 4 consumer warpgroups a
//     fifth warpgroup, which gives its registers to the consumers by setmaxnreg); one lane queues a chunk as one
//     TMA copy of x (2-D tensor map, 128-byte swizzle, zeros past M and K) plus bulk copies of the tiles and the
//     group rows, on a full mbarrier with the expected byte count; each consumer warp releases a stage on its
//     empty mbarrier. On the H200 this took 4096 x 4096 at M = 64 from 0.035 ms (best block-synchronous
//     configuration) to 0.020 ms: Nsight Compute had shown the block-synchronous form busy with its copy loops'
//     address arithmetic and barrier, and a WS form with cp.async x waiting on its producer
//     (bench/results/h200/ncu-sm90-stalls.txt).
// mma.sync consumers (SYNC, dispatched at M <= 8 since session 17): the same block, ring, producer and epilogue, but each
//   consumer warp multiplies its own 16-feature tiles with mma.sync.m16n8k16 (the A fragment decoded as for wgmma, x's
//   B fragments by ldmatrix from the swizzled stage) in 8-row batch slices. A warpgroup's wgmma must hold a chunk's A
//   registers until the group completes, and with three blocks per SM ptxas serializes them for want of registers
//   (C7512); mma.sync holds one fragment per instruction and each warp runs on its own, so 8-row slices fit three or
//   four blocks per SM without serialized tensor work. H200 (gemm4_probe-session17-run4, the dispatch): 8192 x 28672 at
//   M = 1 in 44.6 us against the wgmma dispatch's 51.2 (session 16 run 6), 4096 x 11008 in 14.8 against 17.0.
// K splits (small N: too few strips for the SMs), summed one of two ways (the plan picks, sm90_split_cost):
//   in a cluster: the K ranges of one (batch slice, strip) tile are the blocks of one thread-block cluster (1 x 1 x
//     splits, at most 8). Each block leaves its fp32 sums in its own shared memory; after a cluster barrier each
//     sums a 1/splits share of the tile over the cluster's buffers (distributed shared memory) and writes it to y.
//     No global traffic, fence or serial tail: where the clusters fit the GPU in one wave it was 5% faster (median,
//     13% at the 10th percentile) than the global form on the H200 (gemm4_probe-session10-run1 against -run3).
//     But a cluster's blocks must share a GPC, so fewer of them fit (15 clusters of 8 one-per-SM blocks on the
//     H200's 132 SMs), and where that adds a wave the global form wins (median 5%, up to 1.5x);
//   through global memory: fp32 partials, up to 16 K ranges (11008 x 4096 at M <= 32 takes 16). Where the whole grid
//     fits the GPU at once (spread), every block of a tile waits for the tile's others (a counter each; a cooperative
//     launch, so all are resident) and sums a 1/splits share of it, as in a cluster but from L2; else the last block of
//     a tile to finish sums it all. The last block alone was bound by one SM's loads: on the H200 11008 x 4096 at M 32
//     took 0.0240 ms that way and 0.0204 spread (gemm4_probe-session13-run3, -session14-run1), and the spread form
//     beat the cluster at 4096 x 11008 M 128 (3 K ranges, 0.0338 ms against 2 in a cluster 0.0359, -session14-run2):
//     a cluster's blocks must share a GPC, a spread grid only has to fit the GPU.
// All add the K ranges in order (deterministic).
// (Session 9 also built stream-K, persistent blocks walking an even share of the (tile, chunk) units: correct, but
// slower than the best K split count in all but one case on the H200, gemm4_probe-session9-run3: 8192 x 28672 at
// M = 128, 0.128 against 0.112 ms, and its per-block segment state cost the two-blocks-per-SM and g4
// configurations 44-96 bytes of register spills; removed in session 10. Session 12 built it again, because 8192 x
// 28672 at M = 16 leaves the H200's SMs unevenly loaded: its 224 blocks of 2 K ranges took 0.0604 ms, and 8192 x
// 33792, 264 blocks with 18% more work, 0.0599 (gemm4_probe-session12-run2). Stream-K over the 264 slots was slower
// than the best K-split plan in 245 of 260 (configuration, case) pairs, median 1.22x; wg_b16m2s8x2w at M = 16 0.0638
// against 0.0609 ms (run 3); at M = 9 its copies alone (Sm90Probe 2) took 0.0457 ms at the stream-K plan against
// 0.0343 at 2 K ranges (run 5): blocks that start at scattered K positions read the weights more slowly than K
// ranges that move in step. K ranges of 7 (784 blocks, three even waves) were 5% slower than 2 as well (run 4).
// Removed again.)
// (Session 15 built a persistent grid of the (tile, K range) units instead, taken in order as the grid's blocks are, so
// the K ranges in flight still move in step: one block per slot, the last-block reduction, the ring running on from one
// unit into the next, so that no block starts or fills its ring anew after the first wave. The dispatched plan on 8192 x
// 28672 at M 1..8 is two waves of 7 K ranges (784 blocks on 396 slots), and its span (50.2 us) is ~6 us longer than two
// median blocks (21.6 us each) plus the launch. On the H200 (gemm4_probe-session15-run2..6):
//   - a static share (units b, b + 396, ...): 1.15-1.3x the grid's time (wg_b16m2s5x3wf at 7 K ranges 0.0682 against
//     0.0530 ms, run 2); a counter handing out the next unit to whichever block asks first was as slow (run 3);
//   - the timeline showed why: the persistent kernel on a block per unit (the grid's scheduling, its code) ran its main
//     loop 1.32x as long (23.5 against 17.8 us, run 5). The unit's coordinates, read at run time, put the ring position
//     in vector registers: every wgmma descriptor and barrier address took a conversion to a uniform register, the loop
//     ~18% more instructions, and it spilled. Counting the ring position one chunk at a time fixed that (17.1 against
//     17.4 us, run 6);
//   - then the persistent grid was no faster: span 52.9 against 50.2 us, its median block 44.0 us for two units but its
//     slowest 53.1 (blocks on some SMs run ~25% longer than the median whatever units they take, and with two to four
//     units a slot the counter cannot even that out), the first chunk later (2.7 against 1.6 us); over 7..16 K ranges
//     0.0544-0.0581 ms against the best plan's 0.0532. Removed.)
// (Session 19 built x multicast over pairs of strips, for 64-128 batch rows, where x is most of the bytes a block copies:
// clusters of two neighbouring strips of one batch slice, each block's producer copying half of x's rows into both
// blocks (TMA .multicast::cluster), each consumer warp releasing a stage in both blocks, the strips padded to whole pairs.
// Right results (the CPU twin, every form), but no faster on the H200 (gemm4_probe-session19-run2, each at its best K
// splits): 8192 x 28672 at M 64 wg_b64m2s8w 0.0876 ms, with multicast 0.0861; at M 128 wg_b128m1s8wg4 0.1084 against
// 0.1102; 4096 x 4096 at M 64 / 128 0.0158 / 0.0200 against 0.0164 / 0.0215. The copies alone (Sm90Probe 2) were not
// shorter either: 8192 x 28672 at M 128, wg_b128m1s8wg4 54.5 us, with multicast 56.6. So the ring is bound by what an SM
// takes in (~25 KB a chunk at ~59 bytes/ns), not by L2 reading x once per strip. With the remote arrive at cluster scope
// (.release.cluster) every multicast form took 1.3-2.0x its base's time, ~0.6 us more per chunk (run 1). Removed.)
// (Session 20 had the producer's lane set the ring's barriers up and queue the first chunk before the block's barrier,
// instead of after it: on the H200's timeline (gemm4_probe-session20-run4) the first copy left 0.32 us after entry
// instead of 0.63 and the block's set-up plus first chunk took 1.49 us instead of 1.89 (4096 x 4096 at M 1, span 6.85
// against 7.23 us), but the dispatch's times did not move (0.0107 ms there, 8192 x 28672 at M 1 0.0450 against 0.0447)
// and M 128 ran slower (8192 x 28672 0.1149 against 0.1089 ms; cuBLAS moved 3% the other way). Reverted.)
// Not done: 128 x 128 tiles per warpgroup (two 64 x 128 accumulators: ptxas serializes the wgmma, C7512),
// overlapping one chunk's wgmma with the next chunk's decode in a warpgroup (C7513), 8- and 3-bit tiles.
//
// Limits (checked by qgemm_sm90_reason; qgemm_cuda keeps serving the rest): 4-bit tiles, K % 8 == 0
// (16-byte x copies; the tensor map's row pitch), 16-byte aligned x / tiles / scales / zeros, group % 16 == 0 (as qgemm.cuh). Any M, N
// and K (M past BN: more batch slices; N, K not tile multiples: zero-filled copies, stores predicated).
// Act-order: as for qgemm_cuda, the caller gathers x by QTiles::perm (the tiles are in kernel row order).
// Needs sm_90a (wgmma): compiled for another target (plain sm_90 included) the kernel is empty and the
// launcher returns cudaErrorNotSupported (qgemm_sm90_supported() says so without launching the GEMM).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include <squeeze/kernels/quant/qgemm.cuh>

#if defined(__CUDACC__)
#include <cuda.h>  // CUtensorMap (the type only: the encoder is reached through the runtime, no libcuda link)
#include <cudaTypedefs.h>
#endif

#if defined(__CUDACC__)

// wgmma exists only on the arch-specific target sm_90a (nvcc defines __CUDA_ARCH_FEAT_SM90_ALL there).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SQUEEZE_SM90_WGMMA 1
#else
#define SQUEEZE_SM90_WGMMA 0
#endif

namespace squeeze::kernels::quant {

// ---- configuration and plan (host) ----------------------------------------------------------------------
// BN: batch rows per block (wgmma N: 16, 32, 64 or 128; a smaller N wastes less tensor work on short batches);
// WM: m64 tiles per warpgroup (block strip = 64 WM WGS features);
// STAGES: chunks in the ring; MINB: blocks per SM for __launch_bounds__ (2 halves the registers);
// OVERLAP: a warpgroup keeps one chunk's wgmma in flight while it decodes the next (waits for the chunk before,
// wgmma.wait_group 1) into the second set of A registers; costs one stage of copy distance (STAGES - 2 chunks
// ahead instead of STAGES - 1). ptxas serializes the wgmma of this form (C7513: registers of a wgmma input set
// defined inside an open pipeline stage), so it is kept for measurement only. (Session 7's first form reused one
// register set and relied on the allocator for the overlap: the OVERLAP configurations measured on the H200 until
// then read A registers the next chunk's decode could overwrite, and WS with WM = 2 did compute wrong results.)
// WS (warp-specialised): a ninth warp is the producer: one lane queues every copy of a chunk (x by the TMA from a
// tensor map, bulk copies of the weight tiles and the scale / zero rows) and full / empty mbarriers per stage hand
// stages over, so the consumer warpgroups run no address arithmetic and no block barrier per chunk; the ring runs
// STAGES chunks ahead.
// WGS: consumer warpgroups (2 or 4); each takes 64 WM of the block's features, so 4 of them double the strip and
// halve the x bytes read per weight byte without the registers of a second accumulator set (WM = 2 with BN = 128).
// GSCALE: the A operand is the exact small integer q - z (no scale multiply in the decode: 3 of the decode's ~12
// instructions per 8 weights, and the weights are no longer rounded to T); the wgmma accumulate a group's sums, which
// are scaled in fp32 into the result once per group. Needs groups of whole 64-k chunks (group % 64 == 0; per
// channel qualifies) and the warp-specialised form; a second accumulator set, so meant for 16- and 32-row slices.
// Nsight Compute on wg_b16m2s8x2w at M = 16 (bench/results/h200/ncu-sm90-K8192_N28672_M16-wg_b16m2s8x2w.txt) counted
// ~210 instructions per warp and chunk in the main loop, 32 of them the scale's HMUL2, at 0.54 issued per scheduler
// and cycle. Measured in session 11: 1-3% faster than wg_b16m2s8x2w on 8192 x 28672 at M 9..16 (then Sm90TinyScaled,
// at two blocks per SM), within 2% either way on the 4096-wide layers: the decode is bound by more than its
// instruction count (see Sm90Probe).
// Session 11 also folded the zero point out (A = magic + q, each group's sums corrected by (magic + z) * sum x, the
// column sums from one more m64n16k16 wgmma per k-step with A = 1): the decode fell to 7 instructions per 8 weights, yet
// it ran slower than the same configuration without it (wg_b16m2s8w, wg_b32m2s8w) on every case but one (1.00-1.43x,
// mean 1.14x; 8192 x 28672 at M = 16 0.0833 ms against 0.0603, gemm4_probe-session11-run6):
// the one extra wgmma in three cost more than the four HSUB2 it saved. Not by the tensor cores' rate: session 12 timed
// m64n16k16 with A from registers at 13.2-15.3 cycles of an SM with two or four warpgroups issuing (25.0 with one;
// bench_wgmma_rate, wgmma_rate-session12-run1), so 8192 x 28672's 1,738 per SM take ~23k of the ~106k cycles the
// kernel runs; more likely the longer chain of wgmma each warpgroup waits for per chunk, and the registers.
// SYNC: the consumers multiply with mma.sync.m16n8k16 instead of wgmma: each warp takes its own 16-feature tiles
// (the rows its warpgroup's wgmma would give it, so the accumulators and the epilogue are the same) and n8 slices of
// the batch, with x's B fragments read by ldmatrix from the swizzled stage. No warpgroup-wide asynchronous pipeline:
// the A fragment lives for one instruction (4 registers instead of a chunk's 2 x 4 x WM x 4), nothing waits for a
// wgmma group, and ptxas has no wgmma to serialize (C7512 caps the three-block wgmma forms). Meant for batches of up
// to 16 rows (BN 8 or 16), where the tensor work is small; names start with mma_ instead of wg_.
// (Session 17 also folded the zero point out of the mma.sync decode: A = magic + q, each group's sums corrected by
// (magic + z) times the group's x sums from one more m16n8k16 per k-step with A = ones. No faster on the H200: within
// -2..+4% of the same configuration at 8 rows, 3-12% slower at 16 rows, which it made spill (gemm4_probe-session17-run2);
// removed.)
template <int BN_, int WM_, int STAGES_, int MINB_ = 1, bool OVERLAP_ = false, bool WS_ = false, int WGS_ = 2, bool GSCALE_ = false,
          bool SYNC_ = false>
struct Sm90Cfg {
  static constexpr int BN = BN_, WM = WM_, STAGES = STAGES_, MINB = MINB_, WGS = WGS_;
  static constexpr bool OVERLAP = OVERLAP_, WS = WS_, GSCALE = GSCALE_, SYNC = SYNC_;
  static constexpr int PROBE = 0;  // Sm90Probe: a measuring variant that skips work (wrong results; benchmark only)
  static_assert(!GSCALE || (WS && !OVERLAP), "per-group fp32 scaling (GSCALE) is built for the warp-specialised form without OVERLAP");
  static_assert(!SYNC || (WS && !OVERLAP && BN <= 16), "mma.sync consumers (SYNC) are built for the warp-specialised form without OVERLAP, batch slices of 8 or 16 rows");
  static constexpr int AHEAD = OVERLAP ? STAGES - 2 : STAGES - 1;  // chunks the copy ring runs ahead (not WS)
  static constexpr int CONSUMERS = 128 * WGS;                      // the consumer warpgroups
  // + the producer: one warp; with 4 consumer warpgroups a whole warpgroup, so that it can hand its registers to
  // the consumers (setmaxnreg works per warpgroup). 4 x 128 + 32 threads would cap every thread at 96 registers,
  // too few for a 64 x 128 accumulator without serialized wgmma (ptxas C7512).
  static constexpr int PRODUCERS = WS ? (WGS == 4 ? 128 : 32) : 0;
  static constexpr int THREADS = CONSUMERS + PRODUCERS;
  // setmaxnreg targets (WGS = 4): the block starts with the registers __launch_bounds__ gives every thread
  // (64 K over THREADS, in steps of 8) and may only move them between warpgroups: the producer keeps 24
  static constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8, PRODUCER_REGS = 24;
  static constexpr int CONSUMER_REGS = (THREADS * LAUNCH_REGS - PRODUCERS * PRODUCER_REGS) / CONSUMERS / 8 * 8;
  static constexpr int STRIP = WGS * 64 * WM;    // output features per block
  static constexpr int TILES = STRIP / kTileN;   // 16-feature tiles per block
  static constexpr int GROWS = 4;                // group rows per stage: a 64-k chunk meets <= 4 groups of >= 16
  // stage layout (bytes): x [BN][128 B] first (1024-aligned for the swizzle), weights [TILES][512 B],
  // scales [GROWS][STRIP] fp16, zero points [GROWS][STRIP] uint8; stages 1024-aligned
  static constexpr int X_BYTES = BN * 128, W_BYTES = TILES * 512, S_BYTES = GROWS * STRIP * 2, Z_BYTES = GROWS * STRIP;
  static constexpr int STAGE_BYTES = (X_BYTES + W_BYTES + S_BYTES + Z_BYTES + 1023) / 1024 * 1024;
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024;  // + 1024: the kernel aligns the base itself
  // K splits: the block's fp32 sums, [BN][SPLIT_PITCH] over the ring (+4 floats a row: the four rows one store
  // instruction writes, 2 apart, fall in different banks)
  static constexpr int SPLIT_PITCH = STRIP + 4;
  static_assert(BN * SPLIT_PITCH * 4 <= STAGES * STAGE_BYTES, "the K-split sums must fit in the ring");
  static_assert(BN == 16 || BN == 32 || BN == 64 || BN == 128 || (SYNC && BN == 8),
                "batch rows per block: 16, 32, 64 or 128 (the wgmma wrappers), or 8 with mma.sync (SYNC)");
  static_assert(WM >= 1 && WM <= 4, "m64 tiles per warpgroup: 1..4");
  static_assert(WGS == 2 || WGS == 4, "consumer warpgroups: 2 or 4");
  static_assert(STAGES >= (OVERLAP ? 3 : 2), "at least two stages (three with OVERLAP)");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per block");
  // H200 (bench_qgemm_sm90 at 2101881): wg_b64m2s6ow and wg_b64m2s8ow gave results 0.1-0.25 (relative to max |y|)
  // away from the mma.sync kernel's on every shape, while WS with WM = 1 and every non-WS configuration agreed.
  // The likely cause, the single A register set under OVERLAP, is gone (two sets now). WS with WM = 2 sits in
  // the tuning list (checked against the CPU twin by the GPU tests) since session 8.
};

// Measuring variants of a warp-specialised configuration (bench_qgemm_sm90 --probes): the same grid, ring and
// copies, less of the consumers' work, so the time says what bounds the real kernel. Their results are wrong.
//   PROBE 1: no decode: the raw tile words are the A operand, no group constants (the wgmma, the copies remain);
//   PROBE 2: no consumer work: each consumer warp waits for every stage and hands it back (the copies remain).
// H200, 8192 x 28672 at M = 16, wg_b16m2s8x2w, 2 K ranges in a cluster (gemm4_probe-session11-run2): the kernel 0.0605 ms,
// without the decode 0.0427, the copies alone 0.0351, a plain read of the tiles 0.0322. So the ring streams at the
// read bound and the consumers' decode and wgmma are the cost (see ZFOLD at Sm90Cfg). Nsight Compute on the kernel (ncu-sm90-...-session11-run4): the
// integer pipe 40% busy, the FMA pipes 18 / 36%, 0.57 instructions issued per scheduler and cycle, the stalls
// spread over fixed-latency waits (15%), the wgmma wait (5%) and the consumers' wait for their first chunk (13%).
// Tried in session 11 and dropped, each against its base at the same plan (gemm4_probe-session11-run3 / -run5): the
// decode's shifts by multiply-high (IMAD.HI, off the integer pipe): 0-17% slower; one wgmma wait per two chunks (both A
// register sets live, so one block per SM): within 2.5% of its one-block base up to M = 32 (mean 1.4% faster there),
// 1.25-1.35x slower at M = 64 on two shapes, and 0.98-1.42x the time of the two-block wg_b16m2s8x2w the dispatch takes; a
// producer that queues its first chunk alone and waits for it before filling the ring: 0-10% slower (mean 1-3%).
//   PROBE 3: all the work (right results) plus a timeline: per block the clock at kSm90TraceSlots points into
//     Sm90Params::trace (see there), so the benchmark can split a launch into start-up, wait for the first chunk, main
//     loop and epilogue.
template <class Base, int PROBE_>
struct Sm90Probe : Base {
  static_assert(Base::WS && !Base::OVERLAP, "probes measure the warp-specialised form");
  static_assert(PROBE_ >= 1 && PROBE_ <= 3, "probe 1 (no decode), 2 (no consumer work) or 3 (timeline)");
  static_assert(!(Base::GSCALE && PROBE_ == 1), "probe 1 loads no group constants, which GSCALE's per-group scaling reads: probe its base without GSCALE");
  static constexpr int PROBE = PROBE_;
};

struct Sm90Plan {
  int zslices = 1;  // ceil(M / BN)
  int strips = 1;   // ceil(Npad / STRIP)
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
         (p.splits > 1 ? (p.cluster ? " (cluster)" : p.spread ? " (global, spread)" : " (global)") : "") + " cps " + std::to_string(p.cps) +
         (p.lead < p.splits ? " taper " + std::to_string(p.lead) + "+" + std::to_string(p.cps_tail) : "") + " smem " + std::to_string(p.smem_bytes) + " B";
}
// K range `split`'s chunks [kc0, kc0 + nck) of kchunks: `lead` ranges of cps chunks, then ranges of cps_tail (the
// kernel and the plan's checks alike)
struct Sm90Range {
  int kc0, nck;
};
__host__ __device__ constexpr Sm90Range sm90_k_range(int split, int kchunks, int cps, int lead, int cps_tail) {
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
// The largest cluster the plan picks by itself: in the H200 sweep of session 10 (gemm4_probe-session10-run7, 480
// configuration x shape x batch cases) a cluster of 8 was never the fastest (the H200 holds 15 of them of one-per-SM
// blocks; 4096 x 4096 at M = 16, 16 tiles: 8 in a cluster 0.0137 ms, 6 in a cluster 0.0125).
inline constexpr int kSm90AutoClusterSplits = 6;
// ... but for the mma.sync configurations (SYNC) clusters of 8 at three blocks per SM and none at four. H200
// (gemm4_probe-session17-run2, -run3): mma_b8m2s5x3wf ran 4096 x 11008 at M 1 / 4 / 8 in 14.5-15.3 us with 8 K ranges
// in a cluster, 15.5-16.5 through global memory (the plan's pick with clusters of at most 6); mma_b8m2s4x4wf ran 8192 x
// 28672 at M 1 / 4 / 8 with every cluster plan (5..8 K ranges) 7-14% slower than 7..9 through global memory (M 8: 4 in
// a cluster, which the cost model put level with 9 through global memory, 49.9 us against 46.8).
template <class C>
constexpr int sm90_auto_cluster_splits() {
  return !C::SYNC ? kSm90AutoClusterSplits : C::MINB >= 4 ? 1 : kSm90MaxClusterSplits;
}
// How the K ranges of a tile are summed: Auto lets the plan pick (splits_override then fixes only the count).
// Cluster: in a cluster's distributed shared memory. Global: fp32 partials through global memory, summed by every block
// of the tile, a share each, where the whole grid fits the GPU at once (launched cooperatively, so that the blocks may
// wait for each other), else by the tile's last block. GlobalLast: the last block sums, whatever the grid (measurement).
enum class Sm90Reduce { Auto, Cluster, Global, GlobalLast };
// What the GPU holds of one configuration at once: `slots` blocks (SMs x blocks per SM), and clusters[k] clusters of k
// blocks (a cluster's blocks share a GPC, so a GPC whose free slots are fewer than k wastes them: the H200 holds
// 15 clusters of 8 one-per-SM blocks, 120 of its 132 SMs). sm90_capacity<C>(sm_count) asks the device
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
//   the weight bytes, once per batch slice (zslices: every slice streams them again, and above 128 rows the tensor
//   work, which grows with the slices, is what bounds a block; counted once, the reduction outweighed it and 4096 x 4096
//   at M 384 / 512 ran one K range on 48 / 64 of the H200's SMs in 56.3 / 56.0 us, against 35.6 / 36.0 with 2 in a
//   cluster, gemm4_probe-session18-run3; no plan up to 128 rows changes: one slice), over the fraction of the GPU's
//   slots the grid keeps busy (idle slots stretch the time; a wave is
//   the blocks, or for a cluster reduction the clusters of `splits` blocks, the GPU holds at once); through global
//   memory in more than one wave, over the fraction of the SMs' blocks: an SM starts its next block as one of its own
//   ends, so the grid lasts as long as ceil(blocks / SMs) blocks on one SM (session 17: with 7 K ranges for 784 blocks
//   of mma_b8m2s4x4wf on the H200's 528 slots ~6 a SM, 0.99 of SM-blocks busy, against 0.74 counted in whole waves.
//   The H200 ran 8192 x 28672 at M 1 with 5 / 6 / 7 / 8 / 9 / 10 / 12 / 16 K ranges in 50.7 / 48.5 / 45.9 / 45.6 / 46.6
//   (tapered) / 46.7 / 47.0 / 48.5 us, gemm4_probe-session17-run3; this measure gives 1.18 / 1.18 / 1.01 / 1.03 / 1.05
//   / 1.06 / 1.08 / 1.03 (16: more partials to add), whole waves 1.89 / 1.57 / 1.35 / 1.18 / 1.05 / 1.41 / 1.18 /
//   1.18. No plan of the wgmma configurations in SplitPlanFollowsTheMeasuredSweep changed);
//   x kSm90LoneBlock where a two-blocks-per-SM configuration has at most one block per SM (a block alone on an SM
//   runs faster than each of a pair: on the H200 wg_b16m2s8x2w's 112 blocks on 8192 x 28672 at M = 16 took 0.0785
//   ms for 128 chunks each, 224 blocks of 64 chunks 0.0609, gemm4_probe-session12-run3);
//   + kSm90WaveBytes per wave after the first (a block's ring fills again);
//   + the reduction per split, row and column: 6 B through global memory summed by the tile's last block (fp32
//   partials written and read back, mostly in L2) plus kSm90GlobalBytes once (its fence and serial tail); 4 B through
//   global memory summed by every block (spread: the grid fits the GPU at once, no serial tail); 4 B in a cluster
//   (distributed shared memory).
// The spread form's 4 B and no tail (session 14): of 2, 3, 3.5, 4, 4.5, 5, 6 and 8 B with no tail or a tail of 0.5e6,
// 1e6, 2e6 or 4e6 bytes, the plans it picks are on average 0.1% slower than the best measured (at most 1.022x: 4096 x 4096
// at M 128, 6 K ranges in a cluster against 8 spread) over the H200 sweep of the dispatched configurations at 2, 3, 4,
// 5, 6, 7, 8, 10, 12 and 16 K ranges, each reduced three ways (gemm4_probe-session14-run5, 24 shape x batch cases);
// costing it as the last-block form, 3.3% (at most 1.16x).
// Fitted to the H200 sweep of both reductions at every count of 1..16 K ranges with a clean L2 (gemm4_probe-session12-
// run5, the seven dispatched configurations, 168 configuration x shape x batch cases; clusters of at most
// kSm90AutoClusterSplits): the plan's choice is the sweep's best on 23 of the 24 dispatched cases (the 24th, 11008 x
// 4096 at M = 64, 8% slower than 7 in a cluster), on average 2.0% slower than the best over all 168 (at most 1.25x).
// Session 10's model (6 B global, 3 B cluster, counts 1, 2, 3, 4, 6, 8, 12, 16) missed 4096 x 11008 at M 9..32 by up
// to 1.26x (6 K ranges through global memory; 5 in a cluster is best) and 4096 x 4096 at M 9..16 by up to 1.09x.
inline constexpr double kSm90LoneBlock = 0.8, kSm90WaveBytes = 4e6, kSm90GlobalBytes = 4e6, kSm90SpreadBytes = 4.0;
// The spread form from 8 batch rows on: below, the last block's sum covers few rows (its serial tail is short) while the
// spread form always waits for a tile's slowest block. H200 (gemm4_probe-session14-run6), wg_b16m2s8x2w at M 1 / 2 / 4:
// 4096 x 4096, 8 K ranges, 11.3 / 11.3 / 11.5 us the last block summing against 12.0 / 11.7 / 12.4 spread; 11008 x 4096,
// 16, 16.6 / 16.9 / 17.2 against 17.7 / 17.7 / 17.8; at M 8 spread was as fast or faster (12.0 against 12.3, 17.7
// against 18.2). With this bound the plans of the dispatched configurations are on average 0.1% slower than the best
// measured over runs 5 and 6 (40 shape x batch cases, at most 1.022x), 1.0% without it (at most 1.084x).
inline constexpr std::int64_t kSm90SpreadMinRows = 8;
// Whether K splits through global memory are summed spread (every block a share) rather than by the tile's last block:
// the grid of `blocks` fits the GPU at once (the cooperative launch) and the batch has kSm90SpreadMinRows rows or more.
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
    cost += (cluster ? 4.0 : spread ? kSm90SpreadBytes : 6.0) * splits * double(s.M) * double(s.Npad) + (cluster || spread ? 0.0 : kSm90GlobalBytes);
  return cost;
}
// Tapers a plan's K ranges through global memory: its first `lead` K ranges longer, the other splits - lead of
// cps_tail chunks each (the last takes the remainder), so that the blocks a grid of more than one wave starts last
// are the short ones (the grid runs K range by K range: blockIdx.z). Why: the blocks of the last wave start as the
// blocks before them end, and blocks on some SMs run ~25% longer than the median (session 15's timelines), so the
// span overhangs by a fraction of the last blocks' length. "" when done; else why not (the plan is unchanged).
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
// kSm90TaperRatio with the K ranges the first wave holds whole, plus one, as lead: on the H200 (gemm4_probe-session16-run1,
// wg_b16m2s5x3wf on 8192 x 28672, 7 K ranges, 784 blocks on 396 slots) 4 + 16 chunks (4 of 20, 3 of 16) took 0.0514 /
// 0.0532 / 0.0570 ms at M 1 / 8 / 16 against the uniform 19's 0.0522 / 0.0543 / 0.0577; ratios 0.4-0.7 and 8-12 K
// ranges, tapered or not, were no faster.
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

// K ranges of at least kSm90MinChunks chunks, kSm90MinChunksFewRows below kSm90SpreadMinRows batch rows (the partials
// are small there): on the H200 4096 x 4096 (64 chunks) at M 1 / 2 / 4 ran 16 K ranges in 0.0111 / 0.0114 / 0.0118 ms
// against 8's 0.0118 / 0.0116 / 0.0119 (wg_b16m2s8x2w, the last block summing; three passes, gemm4_probe-session16-run5),
// while at M 8 16 spread took 0.0125 against 8's 0.0123.
inline constexpr int kSm90MinChunks = 8, kSm90MinChunksFewRows = 4;
// K splits: the count (1..16; K ranges of at least kSm90MinChunks: with 4, 4096 x 4096 at M 9..16 took 16 splits,
// 10% slower than 8 on the H200, gemm4_probe-session9-run6/7) and the reduction with the least sm90_split_cost, unless
// given.
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
      cluster = splits <= kSm90MaxClusterSplits &&
                sm90_split_cost(s, p.zslices, tiles, splits, true, cap, C::MINB) < sm90_split_cost(s, p.zslices, tiles, splits, false, cap, C::MINB);
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

// ---- device functions ---------------------------------------------------------------------------------
namespace detail {

// wgmma ordering: fence before wgmma reads registers written by ordinary instructions; commit closes a group;
// wait<N> returns when at most N groups are in flight (N = 0: every wgmma of this warpgroup finished).
__device__ __forceinline__ void wgmma_fence() {
#if SQUEEZE_SM90_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if SQUEEZE_SM90_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if SQUEEZE_SM90_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Pins a register at this point of the program: after wgmma_wait, so the compiler neither reads an accumulator
// early nor hands an A register an in-flight wgmma still reads to another value (the register stays live, so
// reserved, from its definition to the pin).
__device__ __forceinline__ void pin(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void pin(std::uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
// After a wgmma_wait: the A registers of a finished chunk (live until here, so not reused while it ran).
template <int WM>
__device__ __forceinline__ void pin_a(std::uint32_t (&a)[4][WM][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int t = 0; t < WM; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) pin(a[ks][t][i]);
}
// After a wgmma_wait<0>: every A register and accumulator of the finished wgmma.
template <int WM, int NACC>
__device__ __forceinline__ void pin_operands(std::uint32_t (&a)[4][WM][4], float (&acc)[WM][NACC]) {
  pin_a(a);
#pragma unroll
  for (int t = 0; t < WM; ++t)
#pragma unroll
    for (int i = 0; i < NACC; ++i) pin(acc[t][i]);
}
// A K-split tile's counter in global memory. The block's partials are ordered before its arrival by a block barrier
// and one thread's release (PTX's memory model: the barrier, then release cumulativity), and the other blocks'
// partials before its reads by that thread's acquire and the next block barrier, so no thread fences on its own.
// (Until session 21 every consumer thread ran __threadfence() before the arrival, and thread 0 again after it: a
// fence.sc with an L1 invalidation per warp, 10.5% of the stall samples of the M <= 8 form on 8192 x 28672 at M 1,
// ncu-sm90-K8192_N28672_M1-mma_b8m2s4x4wf-session21-run3. On the H200 every dispatched case that sums K ranges through
// global memory ran 1-5% faster in two runs than in three runs of the old code, e.g. 4096 x 4096 at M 16 11.9 / 12.0
// against 12.6 / 13.1 / 12.6 us; the cluster and one-range cases within 1%: gemm4_probe-session21-run7, -run8.)
__device__ __forceinline__ int atom_add_acq_rel_gpu(int* p, int v) {
  int old;
  asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Every thread of every block of the cluster (release / acquire: shared-memory writes before it are seen by the
// cluster's reads after it).
__device__ __forceinline__ void cluster_sync() {
#if SQUEEZE_SM90_WGMMA
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// The address of the same shared-memory byte in block `rank` of the cluster, and a 16-byte load from it.
__device__ __forceinline__ unsigned map_cluster(unsigned saddr, int rank) {
  unsigned out = saddr;
#if SQUEEZE_SM90_WGMMA
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(saddr), "r"(rank));
#endif
  return out;
}
__device__ __forceinline__ float4 ld_cluster_f4(unsigned caddr) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if SQUEEZE_SM90_WGMMA
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(caddr) : "memory");
#endif
  return v;
}
// Named barrier 1 over the consumer threads only (the producer has left by then).
__device__ __forceinline__ void consumer_bar_sync(int count) { asm volatile("bar.sync 1, %0;\n" ::"r"(count) : "memory"); }
// The register budget of this warp's warpgroup from here on (every warp of the warpgroup executes it).
template <int N>
__device__ __forceinline__ void set_max_regs_dec() {
#if SQUEEZE_SM90_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void set_max_regs_inc() {
#if SQUEEZE_SM90_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
// cp.async writes shared memory through the generic proxy, wgmma reads it through the async proxy.
__device__ __forceinline__ void fence_proxy_async() {
#if SQUEEZE_SM90_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// A 2-D tile of x ([64 k] x [rows] at (k0, m0), 128-byte swizzled as the descriptor expects, zero past the
// tensor's edges) into shared memory by the tensor-memory accelerator, completing on bar's tx count.
__device__ __forceinline__ void tma_load_x(void* dst, const CUtensorMap& map, int k0, int m0, std::uint64_t* bar) {
#if SQUEEZE_SM90_WGMMA
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_addr(dst)),
               "l"(reinterpret_cast<std::uint64_t>(&map)), "r"(k0), "r"(m0), "r"(smem_addr(bar))
               : "memory");
#endif
}

// Shared-memory matrix descriptor of a K-major operand with 128-byte swizzle: start address / 16 (bits 0-13),
// leading byte offset 16 B (unused by this layout; bits 16-29), stride byte offset 1024 B between 8-row atoms
// (bits 32-45), layout 1 = 128B swizzle (bits 62-63). Base offset 0: the atoms are 1024-byte aligned.
__device__ __forceinline__ std::uint64_t sw128_desc(std::uint32_t saddr) {
  return std::uint64_t((saddr & 0x3FFFF) >> 4) | (std::uint64_t(16 >> 4) << 16) | (std::uint64_t(1024 >> 4) << 32) | (std::uint64_t(1) << 62);
}

// The wgmma wrappers below: one asm text per shape, with the element type (bf16 / f16) spliced in by a local macro.
// m64n16k16, A from registers, B from shared memory (K-major, tnspB 0), fp32 accumulators d[8].
template <class T>
__device__ __forceinline__ void wgmma_rs(float (&d)[8], const std::uint32_t (&a)[4], std::uint64_t desc_b) {
#if SQUEEZE_SM90_WGMMA
#define SQUEEZE_WGMMA_RS_N16(TY)  \
  asm volatile(  \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"  \
        "wgmma.mma_async.sync.aligned.m64n16k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"  \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])  \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1))
  if constexpr (std::is_same_v<T, bf16>) SQUEEZE_WGMMA_RS_N16("bf16");
  else SQUEEZE_WGMMA_RS_N16("f16");
#undef SQUEEZE_WGMMA_RS_N16
#endif
}

// m64n32k16, A from registers, B from shared memory (K-major, tnspB 0), fp32 accumulators d[16].
template <class T>
__device__ __forceinline__ void wgmma_rs(float (&d)[16], const std::uint32_t (&a)[4], std::uint64_t desc_b) {
#if SQUEEZE_SM90_WGMMA
#define SQUEEZE_WGMMA_RS_N32(TY)  \
  asm volatile(  \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"  \
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"  \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])  \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1))
  if constexpr (std::is_same_v<T, bf16>) SQUEEZE_WGMMA_RS_N32("bf16");
  else SQUEEZE_WGMMA_RS_N32("f16");
#undef SQUEEZE_WGMMA_RS_N32
#endif
}

// m64n64k16, A from registers, B from shared memory (K-major, tnspB 0), fp32 accumulators d[32].
template <class T>
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const std::uint32_t (&a)[4], std::uint64_t desc_b) {
#if SQUEEZE_SM90_WGMMA
#define SQUEEZE_WGMMA_RS_N64(TY)  \
  asm volatile(  \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"  \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"  \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])  \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1))
  if constexpr (std::is_same_v<T, bf16>) SQUEEZE_WGMMA_RS_N64("bf16");
  else SQUEEZE_WGMMA_RS_N64("f16");
#undef SQUEEZE_WGMMA_RS_N64
#endif
}

// m64n128k16, A from registers, B from shared memory (K-major, tnspB 0), fp32 accumulators d[64].
template <class T>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const std::uint32_t (&a)[4], std::uint64_t desc_b) {
#if SQUEEZE_SM90_WGMMA
#define SQUEEZE_WGMMA_RS_N128(TY)  \
  asm volatile(  \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"  \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"  \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])  \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1))
  if constexpr (std::is_same_v<T, bf16>) SQUEEZE_WGMMA_RS_N128("bf16");
  else SQUEEZE_WGMMA_RS_N128("f16");
#undef SQUEEZE_WGMMA_RS_N128
#endif
}

// Group constants of one thread's two A rows (r = 0: row l/4, r = 1: row l/4 + 8) of one tile, as T2 patterns:
// zc = magic + z (fp16 1024 + z, bf16 128 + z), zo = -(64 + z) (fp16 odd pairs, which read as 1024 + 16 q),
// sc = the scale (bf16: rounded from fp16).
struct Sm90Group {
  std::uint32_t zc[2], zo[2], sc[2];
  float scale[2];  // GSCALE: the rows' fp16 scales as fp32 (exact)
};
// The zero point's patterns put together as bits (one integer op each instead of a conversion to float, an add, a
// rounding and a pack): z (a 4-bit zero point, < 16; exact up to 63) is the low mantissa bits of 128 + z in bf16
// (exponent 7), of 1024 + z in fp16 (exponent 10), and z << 4 those of -(64 + z) in fp16 (exponent 6); both halves.
// H200: the median time 1.1% less over the 36 dispatched cases (gemm4_probe-session15-run7 against -run1).
__host__ __device__ constexpr std::uint32_t sm90_bf16_magic_zero(std::uint32_t z) { return 0x43004300u | z * 0x10001u; }
__host__ __device__ constexpr std::uint32_t sm90_half_magic_zero(std::uint32_t z) { return 0x64006400u | z * 0x10001u; }
__host__ __device__ constexpr std::uint32_t sm90_half_odd_zero(std::uint32_t z) { return 0xD400D400u | z * 0x10001u << 4; }
template <class T>
__device__ __forceinline__ Sm90Group sm90_group(const half* srow, const std::uint8_t* zrow, int n_lo) {
  Sm90Group g;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::uint32_t z = zrow[n_lo + 8 * r];
    const float s = __half2float(srow[n_lo + 8 * r]);
    g.scale[r] = s;
    if constexpr (std::is_same_v<T, bf16>) {
      g.zc[r] = sm90_bf16_magic_zero(z);
      g.zo[r] = 0;
      g.sc[r] = u32(__float2bfloat162_rn(s));
    } else {
      g.zc[r] = sm90_half_magic_zero(z);
      g.zo[r] = sm90_half_odd_zero(z);
      g.sc[r] = u32(__float2half2_rn(s));  // exact: s is fp16
    }
  }
  return g;
}
// One tile word (k-step) -> the wgmma A fragment: pair i (nibbles i, i + 4) covers row l/4 + 8 (i >> 1) and
// k 2 (l%4) + 8 (i & 1) (+1), i.e. register a[2 (i & 1) + (i >> 1)]; value (q - z) * scale rounded to T, or with
// SCALE false the exact q - z (the scale is applied to the group's fp32 sums, GSCALE).
template <class T, bool SCALE = true>
__device__ __forceinline__ void sm90_decode(std::uint32_t w, const Sm90Group& g, std::uint32_t (&a)[4]) {
  using V = typename Vec2<T>::type;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = i >> 1;
    const V pair = as_vec2<V>(magic_pair<T>(w, i));
    V v;
    if constexpr (std::is_same_v<T, bf16>) {
      v = __hsub2(pair, as_vec2<V>(g.zc[r]));  // exact small integer q - z
    } else if (i & 1) {
      v = __hfma2(pair, __float2half2_rn(1.f / 16.f), as_vec2<V>(g.zo[r]));  // (1024 + 16 q) / 16 - (64 + z), exact
    } else {
      v = __hsub2(pair, as_vec2<V>(g.zc[r]));
    }
    if constexpr (SCALE) a[2 * (i & 1) + r] = u32(__hmul2(v, as_vec2<V>(g.sc[r])));
    else a[2 * (i & 1) + r] = u32(v);
  }
}

struct Sm90Params {
  const void* x;               // T [M, K]
  const std::uint32_t* tiles;  // [Kpad/64][Npad/16] tiles
  const half* scales;          // [groups, Npad]
  const std::uint8_t* zeros;   // [groups, Npad]
  void* y;                     // T [M, N]
  float* partial;              // [splits, M, Npad] (K splits through global memory)
  int* counters;               // [zslices, strips], zero between launches (K splits through global memory)
  int M, N, K, Npad, group;
  int kchunks, cps, lead, cps_tail, strips, splits, zslices;  // K ranges: sm90_k_range
  int spread;  // K splits through global memory: every block sums a share (Sm90Plan::spread; a cooperative launch)
  // Sm90Probe 3 only: kSm90TraceSlots values per block (block blockIdx.x + gridDim.x * blockIdx.z), see sm90_trace_slot
  std::uint64_t* trace = nullptr;
};
// The timeline of Sm90Probe 3, per block (the slots of Sm90Params::trace; clock64 unless named ns or Sm):
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
  EpilogueWaited,  // after the consumers' first barrier (every warpgroup's last chunk done; global: partials written)
  EpilogueStaged,  // after the next barrier (one K range: the tile staged; cluster: every block's sums in place;
                   // spread: the other shares written and every block of the tile arrived; last block: the counter read)
  EpilogueStored,  // after the stores (0 where not reached: not the last block of a last-block reduction)
  ProducerStart,   // the producer before it queues its first chunk
  ProducerX,       // ... after that chunk's x (before its bulk copies)
  Count
};
}  // namespace sm90_trace_slot
inline constexpr int kSm90TraceSlots = sm90_trace_slot::Count;
__device__ __forceinline__ std::uint64_t global_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
template <class C>
__device__ __forceinline__ void sm90_trace(const Sm90Params& p, int slot, std::uint64_t value) {
  if constexpr (C::PROBE == 3) p.trace[(std::int64_t(blockIdx.z) * gridDim.x + blockIdx.x) * kSm90TraceSlots + slot] = value;
}

// grid (zslices x strips, 1, splits); C::THREADS threads, C::SMEM_BYTES dynamic shared memory.
// CLUSTER: K splits reduce within clusters of (1, 1, splits) blocks; otherwise K splits (if any) go through global
// memory. Two kernels rather than a flag, so that the global one carries no cluster code: one kernel holding both ran
// the global plans ~1% slower (median) on the H200 (gemm4_probe-session10-run4 against -run5; the larger loss seen
// in run 4 was the reduction loop, see below).
// x_map: (WS) x as a TMA tensor map, box [64 k] x [BN rows], 128-byte swizzle (unused otherwise)
template <class T, class C, bool CLUSTER>
__global__ void __launch_bounds__(C::THREADS, C::MINB) qgemm_sm90_kernel(const Sm90Params p, const __grid_constant__ CUtensorMap x_map) {
#if SQUEEZE_SM90_WGMMA
  constexpr int BN = C::BN, WM = C::WM, S = C::STAGES, STRIP = C::STRIP, TILES = C::TILES, NACC = BN / 2;
  constexpr int XB = C::X_BYTES, WB = C::W_BYTES, SB = C::S_BYTES;
  extern __shared__ unsigned char smem_raw[];
  __shared__ int last_flag;  // K splits through global memory: this block is the tile's last
  // the 128B swizzle repeats every 1024 B of address: align the ring to it
  unsigned char* const smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);

  // the warp index through a shuffle: the compiler then knows it is warp-uniform, so a branch on it (the
  // producer's) is not a divergent path around the wgmma (which would serialize them)
  const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0), wg = warp >> 2, wq = warp & 3;
  if (C::PROBE == 3 && tid == 0) {
    sm90_trace<C>(p, sm90_trace_slot::EntryNs, global_ns());
    sm90_trace<C>(p, sm90_trace_slot::Entry, clock64());
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    sm90_trace<C>(p, sm90_trace_slot::Sm, sm);
  }
  const int g4 = lane >> 2, c4 = lane & 3;
  const int ntiles = p.Npad / kTileN;
  const T* const x = static_cast<const T*>(p.x);
  // This block's work: batch slice z, strip, chunks [kc0, kc0 + nck), K range `split` of p.splits (1: y stored
  // directly). The batch slices of a strip are neighbouring blocks, so they run at the same time and the slices
  // after the first find the strip's weights in L2.
  const int z = int(blockIdx.x % p.zslices), strip = int(blockIdx.x / p.zslices), split = int(blockIdx.z);
  const int n0 = strip * STRIP, tile0 = strip * TILES, m0 = z * BN;
  const Sm90Range range = sm90_k_range(split, p.kchunks, p.cps, p.lead, p.cps_tail);
  const int kc0 = range.kc0, nck = range.nck;
  // padded k rows (k >= K) belong to the last group (x is zero there), as in the CPU twin
  auto group_of = [&](int k) { return min(k, p.K - 1) / p.group; };

  // ---- one chunk (64 k) into stage s; every thread queues its share of 16-byte cp.async (0 source bytes =
  // zero fill: rows past M, k past K, tiles / columns past Npad)
  auto load_chunk = [&](int kc, int s) {
    unsigned char* const st = smem + s * C::STAGE_BYTES;
    for (int i = tid; i < BN * 8; i += C::THREADS) {  // x [BN][64], 128B-swizzled
      const int r = i >> 3, c = i & 7, m = m0 + r, k = kc * kTileK + c * 8;
      const bool ok = m < p.M && k < p.K;
      cp_async16(st + r * 128 + ((c ^ (r & 7)) << 4), ok ? x + std::int64_t(m) * p.K + k : x, ok ? 16 : 0);
    }
    const std::uint32_t* const wsrc = p.tiles + (std::int64_t(kc) * ntiles + tile0) * (kTileK * kTileN / 8);
    for (int i = tid; i < TILES * 32; i += C::THREADS) {  // the strip's tiles of this chunk: contiguous
      const bool ok = tile0 + (i >> 5) < ntiles;
      cp_async16(st + XB + i * 16, ok ? wsrc + i * 4 : p.tiles, ok ? 16 : 0);
    }
    const int g0 = group_of(kc * kTileK), rows = group_of(kc * kTileK + 48) - g0 + 1;
    for (int i = tid; i < rows * (STRIP / 8); i += C::THREADS) {  // scales [rows][STRIP]
      const int r = i / (STRIP / 8), n = n0 + (i % (STRIP / 8)) * 8;
      const bool ok = n < p.Npad;
      cp_async16(st + XB + WB + (r * STRIP + n - n0) * 2, ok ? p.scales + std::int64_t(g0 + r) * p.Npad + n : p.scales, ok ? 16 : 0);
    }
    for (int i = tid; i < rows * (STRIP / 16); i += C::THREADS) {  // zero points [rows][STRIP]
      const int r = i / (STRIP / 16), n = n0 + (i % (STRIP / 16)) * 16;
      const bool ok = n < p.Npad;
      cp_async16(st + XB + WB + SB + r * STRIP + n - n0, ok ? p.zeros + std::int64_t(g0 + r) * p.Npad + n : p.zeros, ok ? 16 : 0);
    }
  };

  float acc[WM][NACC];
  // GSCALE: the wgmma accumulate the current group's unscaled sums here; scale_group adds them, scaled, to acc
  float acc_group[WM][NACC];
  float (&mma_acc)[WM][NACC] = C::GSCALE ? acc_group : acc;

  // this thread's A rows: tile (wg * 4 WM + 4 t + wq) of the strip, rows l/4 and l/4 + 8 of it
  const int nl = wg * 64 * WM + wq * 16 + g4;  // feature of row l/4 of tile t = 0, relative to the strip
  // The first k of the group after the one grp holds: the k-steps walk K in order, and a group (>= 16 k) ends
  // at most once per k-step, so a compare replaces a division per k-step (Nsight Compute on the H200 had the
  // divisions at a quarter of the main loop's instructions). Starts at the first k-step's own group, so that
  // the first k-step loads its constants.
  int next_group_k = group_of(kc0 * kTileK) * p.group;
#pragma unroll
  for (int t = 0; t < WM; ++t)
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[t][i] = acc_group[t][i] = 0.f;
  Sm90Group grp[WM];
  // GSCALE, after the wait for a group's last chunk: its sums, times the rows' scales, into acc
  auto scale_group = [&] {
#pragma unroll
    for (int t = 0; t < WM; ++t)
#pragma unroll
      for (int i = 0; i < NACC; ++i) {
        acc[t][i] = fmaf(grp[t].scale[(i >> 1) & 1], acc_group[t][i], acc[t][i]);
        acc_group[t][i] = 0.f;
      }
  };
  // x's descriptor at the ring's base: a stage's and k-step's descriptor adds their byte offset / 16 (the start
  // address field; the ring lies below 2^18 bytes, so the sum stays within it)
  const std::uint64_t x_desc0 = sw128_desc(smem_addr(smem));
  // A fragments, two sets used by alternate chunks: a wgmma reads its A registers until it completes, so with
  // OVERLAP (chunk c in flight while chunk c + 1 is decoded) chunk c + 1 must decode into the other set. Each set
  // is pinned after the wait that retires its chunk, which keeps its registers reserved until then (a rolled loop
  // with one set would decode chunk c + 1 into the registers chunk c's wgmma is still reading).
  std::uint32_t a0[4][WM][4] = {}, a1[4][WM][4] = {};
  // ---- one chunk (stage st holds chunk kc): per k-step decode WM A fragments into a and queue WM wgmma, then
  // commit. after_first(): run once the first k-step is queued.
  auto mma_chunk = [&](const unsigned char* st, int kc, auto& a, auto&& after_first) {
    uint4 wv[WM];  // this lane's 4 words (4 k-steps) of each of its tiles
#pragma unroll
    for (int t = 0; t < WM; ++t) wv[t] = lds128(st + XB + ((wg * 4 * WM + 4 * t + wq) * 32 + lane) * 16);
    [[maybe_unused]] const std::uint64_t x_desc = x_desc0 + std::uint64_t((st - smem) >> 4);
    // SYNC: x's B fragments of k-steps 2 kp and 2 kp + 1 (kp = ks / 2), n8 slice j: ldmatrix.x4 of the 8 x 8 matrices
    // (batch rows 8 j.., k 32 kp + 8 i..), lane L addressing row 8 j + L % 8 of matrix L / 8; x's 16-byte unit u of row
    // r lies at (u ^ r % 8) << 4 (the TMA's 128-byte swizzle). Register i = matrix i: (b0, b1) of k-step 2 kp are
    // registers 0, 1, of k-step 2 kp + 1 registers 2, 3. Loaded a pair of k-steps at a time (registers).
    [[maybe_unused]] std::uint32_t bx[C::SYNC ? BN / 8 : 1][4];
    int grow = 0;  // the stage's group row of the group grp holds (row 0: the group of the chunk's first k)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      // a new group (uniform across the block); Sm90Probe 1 loads no group constants (until session 14 the timeline probe,
      // Sm90Probe 3, skipped them too: its y was wrong and its loop slightly short, TimelineProbeComputesAndTracesInOrder)
      if (C::PROBE != 1 && min(kc * kTileK + 16 * ks, p.K - 1) >= next_group_k) {
        next_group_k += p.group;
        if (ks > 0) ++grow;
        const half* srow = reinterpret_cast<const half*>(st + XB + WB) + grow * STRIP;
        const std::uint8_t* zrow = st + XB + WB + SB + grow * STRIP;
#pragma unroll
        for (int t = 0; t < WM; ++t) grp[t] = sm90_group<T>(srow, zrow, nl + 64 * t);
      }
      if constexpr (C::SYNC) {
        if (ks % 2 == 0)
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
            const int r = 8 * j + (lane & 7), u = 2 * ks + (lane >> 3);
            ldmatrix_x4(bx[j], st + r * 128 + ((u ^ (r & 7)) << 4));
          }
#pragma unroll
        for (int t = 0; t < WM; ++t) {
          const std::uint32_t w = ks == 0 ? wv[t].x : ks == 1 ? wv[t].y : ks == 2 ? wv[t].z : wv[t].w;
          std::uint32_t af[4];
          if constexpr (C::PROBE == 1) {
            af[0] = w, af[1] = w ^ 1u, af[2] = w ^ 2u, af[3] = w ^ 3u;
          } else {
            sm90_decode<T, !C::GSCALE>(w, grp[t], af);
          }
#pragma unroll
          for (int j = 0; j < BN / 8; ++j)
            mma16816<T>(*reinterpret_cast<float(*)[4]>(&mma_acc[t][4 * j]), af, bx[j][2 * (ks & 1)], bx[j][2 * (ks & 1) + 1]);
        }
      } else {
#pragma unroll
        for (int t = 0; t < WM; ++t) {
          const std::uint32_t w = ks == 0 ? wv[t].x : ks == 1 ? wv[t].y : ks == 2 ? wv[t].z : wv[t].w;
          if constexpr (C::PROBE == 1) {
            a[ks][t][0] = w, a[ks][t][1] = w ^ 1u, a[ks][t][2] = w ^ 2u, a[ks][t][3] = w ^ 3u;
          } else {
            sm90_decode<T, !C::GSCALE>(w, grp[t], a[ks][t]);
          }
        }
        wgmma_fence();
#pragma unroll
        for (int t = 0; t < WM; ++t) wgmma_rs<T>(mma_acc[t], a[ks][t], x_desc + 2 * ks);  // + 32 B per k-step
      }
      if (ks == 0) after_first();
    }
    if constexpr (!C::SYNC) wgmma_commit();
  };
  // After mma_chunk(a_cur): wait for the chunk before (OVERLAP; its set a_other is free again) or for this one.
  auto retire = [&](auto& a_cur, auto& a_other) {
    if constexpr (C::SYNC) {
      // mma.sync: the results are in registers when the next instruction reads them; nothing in flight
    } else if constexpr (C::OVERLAP) {
      wgmma_wait<1>();
      pin_a(a_other);
    } else {
      wgmma_wait<0>();
      pin_operands(a_cur, mma_acc);
    }
  };

  // ---- after the last chunk (consumer threads only; every thread when not WS)
  auto epilogue = [&] {
    if constexpr (C::OVERLAP) {  // the last chunk's wgmma; accumulators are read only after this
      wgmma_wait<0>();
      pin_operands(a0, mma_acc);
      pin_a(a1);
    }

    // ---- epilogue: accumulator i of tile t holds (feature nl + 64 t + 8 ((i >> 1) & 1), batch row 8 (i >> 2) + 2 c4 + (i & 1)).
    // y is written 8 features (16 bytes) per store where rows of y are 16-byte aligned: the accumulators' own layout
    // would store 2 bytes per thread, 16 contiguous bytes per 8 lanes. (Session 13's timeline, Sm90Probe 3, on the
    // H200: that store loop took 5.3 us of wg_b128m1s8wg4's 106 us blocks on 8192 x 28672 at M = 128, 1.9 since;
    // gemm4_probe-session13-run1 / -run3.)
    T* const y = static_cast<T*>(p.y);
    const int rows = min(BN, p.M - m0), cols = min(STRIP, p.N - n0);
    const bool y_vec = p.N % 8 == 0 && (reinterpret_cast<std::uintptr_t>(p.y) & 15) == 0;
    // features cc..cc + 7 of row r of the tile, from fp32 sums
    auto write8 = [&](int r, int cc, const float (&v)[8]) {
      T* const dst = y + std::int64_t(m0 + r) * p.N + n0 + cc;
      if (y_vec && cc + 8 <= cols) {
        uint4 packed;
        T* const h = reinterpret_cast<T*>(&packed);
#pragma unroll
        for (int j = 0; j < 8; ++j) h[j] = from_float<T>(v[j]);
        *reinterpret_cast<uint4*>(dst) = packed;
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (cc + j < cols) dst[j] = from_float<T>(v[j]);
      }
    };
    if (p.splits == 1) {
      // the tile as T through the ring, [BN][PITCH] (after the barrier every warpgroup's wgmma finished reading the
      // ring; every copy landed), then 16-byte rows out. +8 elements a row: the four rows one store writes, 2 apart,
      // fall in different banks.
      constexpr int PITCH = STRIP + 8;
      static_assert(BN * PITCH * int(sizeof(T)) <= S * C::STAGE_BYTES, "the output tile must fit in the ring");
      T* const out = reinterpret_cast<T*>(smem);
      consumer_bar_sync(C::CONSUMERS);
      if (C::PROBE == 3 && tid == 0) sm90_trace<C>(p, sm90_trace_slot::EpilogueWaited, clock64());
#pragma unroll
      for (int t = 0; t < WM; ++t)
#pragma unroll
        for (int i = 0; i < NACC; ++i) out[(8 * (i >> 2) + 2 * c4 + (i & 1)) * PITCH + nl + 64 * t + 8 * ((i >> 1) & 1)] = from_float<T>(acc[t][i]);
      consumer_bar_sync(C::CONSUMERS);
      if (C::PROBE == 3 && tid == 0) sm90_trace<C>(p, sm90_trace_slot::EpilogueStaged, clock64());
      for (int u = tid; u < rows * (STRIP / 8); u += C::CONSUMERS) {
        const int r = u / (STRIP / 8), cc = (u % (STRIP / 8)) * 8;
        if (cc >= cols) continue;
        const T* const src = out + r * PITCH + cc;
        T* const dst = y + std::int64_t(m0 + r) * p.N + n0 + cc;
        if (y_vec && cc + 8 <= cols) {
          *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
          for (int j = 0; j < 8 && cc + j < cols; ++j) dst[j] = src[j];
        }
      }
      if (C::PROBE == 3 && tid == 0) sm90_trace<C>(p, sm90_trace_slot::EpilogueStored, clock64());
      return;
    }
    // K splits: the K ranges' sums of one float4 of the tile (row r, features cc..cc + 3) are added in K-range order
    // (deterministic); lanes 2j and 2j + 1 hold features cc..cc + 7 of one row, and the even lane stores all eight.
    // (Loading 8 features a lane, two float4 32 bytes apart, ran the cluster reduction 2x slower on the H200: the
    // lanes' loads no longer contiguous.) The loops run whole warps (the shuffle), u over float4 units.
    // The cluster form's cost is its loads: a block reads BN x STRIP fp32 sums from the cluster's shared memory, 128 KB
    // at M = 128, which took 4.7 of wg_b128m1s8wg4's 15.8 us blocks on 4096 x 4096 (~27 bytes/ns; two units a lane in
    // flight together made no difference: gemm4_probe-session13-run5 / -run6).
    auto add4 = [](float4& sum, const float4& v) {
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    };
    auto store_pairs = [&](bool valid, int r, int cc, const float4& sum) {
      const float v[8] = {sum.x, sum.y, sum.z, sum.w, __shfl_down_sync(0xffffffffu, sum.x, 1), __shfl_down_sync(0xffffffffu, sum.y, 1),
                          __shfl_down_sync(0xffffffffu, sum.z, 1), __shfl_down_sync(0xffffffffu, sum.w, 1)};
      if (valid && (lane & 1) == 0) write8(r, cc, v);
    };
    // K splits reduced by share (in a cluster, or spread through global memory): this block's sums into its shared
    // memory, [BN][PITCH] fp32 over the ring (every copy landed, and after the barrier every warpgroup's wgmma
    // finished reading it); each block then sums its share of the tile, float4 units [u_begin, u_end) (whole 8-feature
    // units: lanes 2j and 2j + 1 hold one)
    constexpr int PITCH = C::SPLIT_PITCH;
    float* const buf = reinterpret_cast<float*>(smem);
    const int units8 = rows * (STRIP / 8);
    const int u_begin = 2 * int(std::int64_t(units8) * split / p.splits), u_end = 2 * int(std::int64_t(units8) * (split + 1) / p.splits);
    auto stage_sums = [&] {
      consumer_bar_sync(C::CONSUMERS);
      if (C::PROBE == 3 && tid == 0) sm90_trace<C>(p, sm90_trace_slot::EpilogueWaited, clock64());
#pragma unroll
      for (int t = 0; t < WM; ++t)
#pragma unroll
        for (int i = 0; i < NACC; ++i) buf[(8 * (i >> 2) + 2 * c4 + (i & 1)) * PITCH + nl + 64 * t + 8 * ((i >> 1) & 1)] = acc[t][i];
    };
    if constexpr (CLUSTER) {
      // in the cluster: the shares summed over the cluster's buffers (distributed shared memory)
      stage_sums();
      cluster_sync();  // every K range's sums are in its block's shared memory
      if (C::PROBE == 3 && tid == 0) sm90_trace<C>(p, sm90_trace_slot::EpilogueStaged, clock64());
      const unsigned base = smem_addr(buf);
      for (int w0 = u_begin + (tid & ~31); w0 < u_end; w0 += C::CONSUMERS) {
        const int u = w0 + lane, r = u / (STRIP / 4), cc = (u % (STRIP / 4)) * 4;
        const bool valid = u < u_end && cc < cols;
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
        if (valid) {
          const unsigned off = base + unsigned(r * PITCH + cc) * 4u;
          float4 v[kSm90MaxClusterSplits];
#pragma unroll
          for (int sp = 0; sp < kSm90MaxClusterSplits; ++sp)
            if (sp < p.splits) v[sp] = ld_cluster_f4(map_cluster(off, sp));
          sum = v[0];
#pragma unroll
          for (int sp = 1; sp < kSm90MaxClusterSplits; ++sp)
            if (sp < p.splits) add4(sum, v[sp]);
        }
        store_pairs(valid, r, cc, sum);
      }
      if (C::PROBE == 3 && tid == 0) sm90_trace<C>(p, sm90_trace_slot::EpilogueStored, clock64());
      cluster_sync();  // no block leaves (its shared memory) while another still reads it
      return;
    }
    int* const counter = p.counters + z * p.strips + strip;
    const std::int64_t split_stride = std::int64_t(p.M) * p.Npad;
    if (p.spread) {
      // Through global memory, spread: every block of the tile sums its share, as in a cluster, from fp32 partials in L2.
      // (The last block summing all of them alone was bound by one SM's loads from L2: 11008 x 4096 at M 32, 16 K
      // ranges, took 0.0240 ms that way and 0.0204 spread, gemm4_probe-session13-run3 / -session14-run1.) Each block
      // writes the other blocks' shares of its sums (16-byte stores from the staged tile; its own share stays in shared
      // memory), waits for the tile's other blocks (the cooperative launch makes every block resident), then adds the
      // K ranges of its share in order, its own from shared memory. The counter counts arrivals (up to splits), then
      // departures; the last to leave sets it to zero for the next launch.
      stage_sums();
      consumer_bar_sync(C::CONSUMERS);
      float* const part = p.partial + split * split_stride;
      const int units = rows * (STRIP / 4);
      for (int u = tid; u < units; u += C::CONSUMERS) {
        const int r = u / (STRIP / 4), cc = (u % (STRIP / 4)) * 4;
        if ((u < u_begin || u >= u_end) && cc < cols)
          __stcg(reinterpret_cast<float4*>(part + std::int64_t(m0 + r) * p.Npad + n0 + cc), *reinterpret_cast<const float4*>(buf + r * PITCH + cc));
      }
      consumer_bar_sync(C::CONSUMERS);  // every share written, then released by thread 0's arrival
      if (tid == 0) {
        atom_add_acq_rel_gpu(counter, 1);
        while (ld_acquire_gpu(counter) < p.splits) __nanosleep(64);
      }
      consumer_bar_sync(C::CONSUMERS);  // the other blocks' shares, acquired by thread 0, for every thread
      if (C::PROBE == 3 && tid == 0) sm90_trace<C>(p, sm90_trace_slot::EpilogueStaged, clock64());
      for (int w0 = u_begin + (tid & ~31); w0 < u_end; w0 += C::CONSUMERS) {  // whole warps (store_pairs shuffles)
        const int u = w0 + lane, r = u / (STRIP / 4), cc = (u % (STRIP / 4)) * 4;
        const bool valid = u < u_end && cc < cols;
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
        if (valid) {
          const float* const src = p.partial + std::int64_t(m0 + r) * p.Npad + n0 + cc;
          const float4 own = *reinterpret_cast<const float4*>(buf + r * PITCH + cc);
          // 8 K ranges' loads in flight at a time
          for (int sp0 = 0; sp0 < p.splits; sp0 += 8) {
            float4 v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j)
              if (sp0 + j < p.splits) v[j] = sp0 + j == split ? own : __ldcg(reinterpret_cast<const float4*>(src + (sp0 + j) * split_stride));
#pragma unroll
            for (int j = 0; j < 8; ++j)
              if (sp0 + j < p.splits) {
                if (sp0 + j == 0) sum = v[j];
                else add4(sum, v[j]);
              }
          }
        }
        store_pairs(valid, r, cc, sum);
      }
      if (C::PROBE == 3 && tid == 0) sm90_trace<C>(p, sm90_trace_slot::EpilogueStored, clock64());
      if (tid == 0 && atomicAdd(counter, 1) == 2 * p.splits - 1) *counter = 0;  // every block has left the wait
      return;
    }
    // through global memory, the last block: fp32 partials, and the last block of the tile to finish (a counter each)
    // sums them
    float* const part = p.partial + std::int64_t(split) * p.M * p.Npad;
#pragma unroll
    for (int t = 0; t < WM; ++t)
#pragma unroll
      for (int i = 0; i < NACC; ++i) {
        const int n = n0 + nl + 64 * t + 8 * ((i >> 1) & 1), m = m0 + 8 * (i >> 2) + 2 * c4 + (i & 1);
        if (m < p.M && n < p.Npad) part[std::int64_t(m) * p.Npad + n] = acc[t][i];
      }
    consumer_bar_sync(C::CONSUMERS);  // every partial written, then released by thread 0's arrival
    if (C::PROBE == 3 && tid == 0) sm90_trace<C>(p, sm90_trace_slot::EpilogueWaited, clock64());
    if (tid == 0) last_flag = atom_add_acq_rel_gpu(counter, 1) == p.splits - 1;  // the last: the others' partials acquired
    consumer_bar_sync(C::CONSUMERS);
    if (C::PROBE == 3 && tid == 0) sm90_trace<C>(p, sm90_trace_slot::EpilogueStaged, clock64());
    if (!last_flag) return;
    // the last block: 4 features per lane, 4 K ranges' loads in flight at a time (Npad and n0 are multiples of 16:
    // the float4 loads are aligned). (Batches of 8 predicated loads, as in the cluster form, measured 4% slower at 4
    // splits and 12% at 16 on the H200, gemm4_probe-session10-run5 against -run1.)
    const int units = rows * (STRIP / 4);
    for (int w0 = tid & ~31; w0 < units; w0 += C::CONSUMERS) {
      const int u = w0 + lane, r = u / (STRIP / 4), cc = (u % (STRIP / 4)) * 4;
      const bool valid = u < units && cc < cols;
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
      if (valid) {
        const float* src = p.partial + std::int64_t(m0 + r) * p.Npad + n0 + cc;
        int sp = 0;
        for (; sp + 4 <= p.splits; sp += 4) {
          float4 v[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) v[j] = __ldcg(reinterpret_cast<const float4*>(src + (sp + j) * split_stride));
#pragma unroll
          for (int j = 0; j < 4; ++j) add4(sum, v[j]);
        }
        for (; sp < p.splits; ++sp) add4(sum, __ldcg(reinterpret_cast<const float4*>(src + sp * split_stride)));
      }
      store_pairs(valid, r, cc, sum);
    }
    if (C::PROBE == 3 && tid == 0) sm90_trace<C>(p, sm90_trace_slot::EpilogueStored, clock64());
    if (tid == 0) *counter = 0;  // ready for the next launch
  };

  if constexpr (C::WS) {
    // full[s]: the producer's expect-tx arrive + the TMA / bulk bytes;
    // empty[s]: one arrive per consumer warp once the wgmma reading stage s finished
    __shared__ std::uint64_t full_bar[S], empty_bar[S];
    // the producer's first TMA copy needs x's tensor map: fetch it while the barriers are set up
    if (warp == C::CONSUMERS / 32 && lane == 0) asm volatile("prefetch.tensormap [%0];\n" ::"l"(&x_map) : "memory");
    if (tid == 0) {
#pragma unroll
      for (int sl = 0; sl < S; ++sl) {
        mbar_init(full_bar + sl, 1);
        mbar_init(empty_bar + sl, C::CONSUMERS / 32);
      }
      mbar_init_fence();
    }
    __syncthreads();
    if (C::PROBE == 3 && tid == 0) sm90_trace<C>(p, sm90_trace_slot::SetUp, clock64());
    if (warp >= C::CONSUMERS / 32) {  // the producer (warp CONSUMERS / 32; with WGS = 4 the rest of its warpgroup idles)
      if constexpr (C::PRODUCERS == 128) set_max_regs_dec<C::PRODUCER_REGS>();
      // the cluster barriers of the K-split reduction count every thread: the producer's take part, idle
      if (warp > C::CONSUMERS / 32) {
        if (CLUSTER && p.splits > 1) {
          cluster_sync();
          cluster_sync();
        }
        return;
      }
      const int cols = min(STRIP, p.Npad - n0);  // features of this strip (multiple of 16)
      const unsigned wbytes = unsigned(cols / kTileN) * 512u;
      for (int c = 0; c < nck; ++c) {  // chunk c of the K range into ring stage c % S
        const int ring = c % S, kc = kc0 + c;
        if (c >= S) mbar_wait(empty_bar + ring, unsigned(c / S - 1) & 1u);
        unsigned char* const st = smem + ring * C::STAGE_BYTES;
        const int g0 = group_of(kc * kTileK), rows = group_of(kc * kTileK + 48) - g0 + 1;
        if (lane == 0) {  // x (the TMA counts the whole box, zero-filled parts included), tiles, group rows
          // (Session 13 queued the bulk copies before x, in case the first TMA copy waited for x's tensor map: Sm90Probe 3
          // then had x's copy queued 0.03 us after the bulk copies' 0.19, and the first chunk in hand no sooner, 1.21 us
          // after the set-up barrier against 1.10; gemm4_probe-session13-run7 against -run6.)
          if (C::PROBE == 3 && c == 0) sm90_trace<C>(p, sm90_trace_slot::ProducerStart, clock64());
          mbar_arrive_expect_tx(full_bar + ring, unsigned(XB) + wbytes + unsigned(rows * cols * 3));
          tma_load_x(st, x_map, kc * kTileK, m0, full_bar + ring);
          if (C::PROBE == 3 && c == 0) sm90_trace<C>(p, sm90_trace_slot::ProducerX, clock64());
          bulk_copy_g2s(st + XB, p.tiles + (std::int64_t(kc) * ntiles + tile0) * (kTileK * kTileN / 8), wbytes, full_bar + ring);
          for (int r = 0; r < rows; ++r) {
            const std::int64_t off = std::int64_t(g0 + r) * p.Npad + n0;
            bulk_copy_g2s(st + XB + WB + r * STRIP * 2, p.scales + off, unsigned(cols * 2), full_bar + ring);
            bulk_copy_g2s(st + XB + WB + SB + r * STRIP, p.zeros + off, unsigned(cols), full_bar + ring);
          }
          if (C::PROBE == 3 && c == 0) sm90_trace<C>(p, sm90_trace_slot::QueuedFirst, clock64());
          if (C::PROBE == 3 && c + 1 == nck) sm90_trace<C>(p, sm90_trace_slot::QueuedLast, clock64());
        }
        __syncwarp();
      }
      if (CLUSTER && p.splits > 1) {  // the reduction's two cluster barriers (see epilogue)
        cluster_sync();
        cluster_sync();
      }
      return;  // the consumers wait for every copy it queued (full barriers) before they leave
    } else {
      if constexpr (C::PRODUCERS == 128) set_max_regs_inc<C::CONSUMER_REGS>();
      auto consume = [&](int c, auto& a_cur, auto& a_other) {  // chunk c of the K range, from ring stage c % S
        const int ring = c % S;
        mbar_wait(full_bar + ring, unsigned(c / S) & 1u);
        if (C::PROBE == 3 && c == 0 && tid == 0) sm90_trace<C>(p, sm90_trace_slot::FirstChunk, clock64());
        __syncwarp();  // converged again before the .aligned wgmma operations
        if constexpr (C::PROBE == 2) {
          if (lane == 0) mbar_arrive(empty_bar + ring);
          __syncwarp();
          return;
        }
        mma_chunk(smem + ring * C::STAGE_BYTES, kc0 + c, a_cur, [] {});
        retire(a_cur, a_other);
        // GSCALE: the group ends with this chunk (the K range's last, or the next chunk starts the group after:
        // groups are whole chunks, and next_group_k is where the one grp holds ends)
        if constexpr (C::GSCALE)
          if (c + 1 == nck || (kc0 + c + 1) * kTileK >= next_group_k) scale_group();
        // the stage the finished wgmma read goes back to the producer (OVERLAP: the chunk before's)
        if (lane == 0 && (!C::OVERLAP || c > 0)) mbar_arrive(empty_bar + (C::OVERLAP ? (c + S - 1) % S : ring));
        __syncwarp();
      };
      for (int c = 0; c < nck; c += 2) {  // pairs: the two A sets alternate with static names
        consume(c, a0, a1);
        if (c + 1 < nck) consume(c + 1, a1, a0);
      }
      if (C::PROBE == 3 && tid == 0) sm90_trace<C>(p, sm90_trace_slot::LoopEnd, clock64());
      epilogue();
      if (C::PROBE == 3 && tid == 0) {
        sm90_trace<C>(p, sm90_trace_slot::End, clock64());
        sm90_trace<C>(p, sm90_trace_slot::EndNs, global_ns());
      }
    }
  } else {
    constexpr int AHEAD = C::AHEAD;
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {  // prologue: AHEAD chunks in flight (a group per stage, empty ones too)
      if (s < nck) load_chunk(kc0 + s, s);
      cp_async_commit();
    }
    auto step = [&](int c, auto& a_cur, auto& a_other) {
      cp_async_wait<AHEAD - 1>();  // this thread's copies of chunk c landed
      fence_proxy_async();
      // everyone's copies landed; every wgmma of chunk c - 1 (OVERLAP: c - 2) finished (retired below), so the
      // stage it read may be refilled
      __syncthreads();
      mma_chunk(smem + (c % S) * C::STAGE_BYTES, kc0 + c, a_cur, [&] {  // refill the stage chunk c - 1 (OVERLAP: c - 2) used
        const int nx = c + AHEAD;
        if (nx < nck) load_chunk(kc0 + nx, nx % S);
        cp_async_commit();
        __syncwarp();  // the copy loops' trip counts differ per thread: reconverge before the .aligned wgmma ops
      });
      retire(a_cur, a_other);
    };
    for (int c = 0; c < nck; c += 2) {
      step(c, a0, a1);
      if (c + 1 < nck) step(c + 1, a1, a0);
    }
    cp_async_wait<0>();  // no copy may land after the block exits
    epilogue();
  }
#endif
}

// Writes 1 when this build's device code has wgmma (compiled for sm_90a), 0 otherwise. A template, so that
// several translation units of one program may include this header.
template <int = 0>
__global__ void qgemm_sm90_probe(int* out) { *out = SQUEEZE_SM90_WGMMA; }

}  // namespace detail

// ---- host launchers ------------------------------------------------------------------------------------
// True when the current device is sm_90 and this build's device code has wgmma (sm_90a). The first call
// launches a one-thread probe and synchronizes; the answer is cached for the process.
inline bool qgemm_sm90_supported() {
  static const bool ok = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess || major != 9 || minor != 0) {
      cudaGetLastError();
      return false;
    }
    int* flag = nullptr;
    int host = 0;
    bool good = cudaMalloc(&flag, sizeof(int)) == cudaSuccess;
    if (good) {
      detail::qgemm_sm90_probe<><<<1, 1>>>(flag);
      good = cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess && host == 1;
      cudaFree(flag);
    }
    cudaGetLastError();  // a launch without a kernel image for this device is an answer, not a sticky error
    return good;
  }();
  return ok;
}

namespace detail {
template <class C>
std::string sm90_cfg_name() {
  return (C::SYNC ? "mma_b" : "wg_b") + std::to_string(C::BN) + "m" + std::to_string(C::WM) + "s" + std::to_string(C::STAGES) +
         (C::MINB > 1 ? "x" + std::to_string(C::MINB) : "") + (C::OVERLAP ? "o" : "") + (C::WS ? "w" : "") +
         (C::WGS != 2 ? "g" + std::to_string(C::WGS) : "") + (C::GSCALE ? "f" : "") + (C::PROBE ? "_probe" + std::to_string(C::PROBE) : "");
}
// Configurations the benchmark times (batch rows per block, m64 tiles per warpgroup, stages, blocks per SM,
// overlap across chunks, warp-specialised, consumer warpgroups, per-group fp32 scaling; names
// wg_b<BN>m<WM>s<STAGES>[x<MINB>][o][w][g<WGS>][f]). The H200 sweep of session 7
// (bench/results/h200/gemm4-sm90-session7.*, gemm4_probe.*) also timed m2 / 4-stage forms, slower on every case.
using Sm90TuningCfgs = CfgList<Sm90Cfg<64, 1, 6, 2>, Sm90Cfg<128, 2, 6>,
                               // warp-specialised (a producer warp, TMA / bulk copies, mbarriers; names end in w)
                               Sm90Cfg<64, 1, 6, 2, false, true>, Sm90Cfg<64, 1, 7, 2, false, true>, Sm90Cfg<128, 1, 6, 1, false, true>,
                               Sm90Cfg<128, 1, 6, 1, true, true>,
                               // two m64 tiles per warpgroup (half the x reads per weight byte); with 128-row slices
                               // ptxas serializes the wgmma (C7512: too few registers for two 64 x 128 accumulators)
                               Sm90Cfg<64, 2, 6, 1, false, true>, Sm90Cfg<64, 2, 8, 1, false, true>,
                               // four consumer warpgroups and a producer warpgroup (setmaxnreg): 256-feature strips
                               // with one accumulator set per warpgroup (names end in g4)
                               Sm90Cfg<64, 1, 8, 1, false, true, 4>, Sm90Cfg<128, 1, 6, 1, false, true, 4>,
                               Sm90Cfg<128, 1, 8, 1, false, true, 4>,
                               // 16- and 32-row batch slices (m64n16k16 / m64n32k16: a quarter / half the tensor work
                               // of 64-row slices for batches up to 16 / 32); small accumulators leave room for two
                               // blocks per SM
                               Sm90Cfg<16, 2, 8, 1, false, true>, Sm90Cfg<16, 2, 8, 2, false, true>, Sm90Cfg<32, 2, 6, 2, false, true>,
                               Sm90Cfg<32, 2, 8, 1, false, true>,
                               // three blocks per SM (5 stages to fit), plain and with the A operand unscaled and each
                               // group's sums scaled in fp32 (GSCALE; names end in f): dispatched on large layers
                               // (Sm90TinyLarge, Sm90TinyScaled). (A 32-row GSCALE form spilled 392 bytes in its fp16
                               // build at two blocks per SM.) 32-row slices at three blocks per SM (4 stages):
                               // Sm90NarrowLarge
                               Sm90Cfg<16, 2, 5, 3, false, true>, Sm90Cfg<16, 2, 5, 3, false, true, 2, true>, Sm90Cfg<32, 2, 4, 3, false, true>,
                               // mma.sync consumers (SYNC; names start with mma_) in 8-row slices with GSCALE, three and
                               // four blocks per SM: Sm90Row8, Sm90Row8Large
                               Sm90Cfg<8, 2, 5, 3, false, true, 2, true, true>, Sm90Cfg<8, 2, 4, 4, false, true, 2, true, true>>;
// Measuring variants (bench_qgemm_sm90 --probes; names end in _probe1 / _probe2): what the dispatched 16-row and
// 128-row forms cost without their decode, and without any consumer work.
using Sm90ProbeCfgs = CfgList<Sm90Probe<Sm90Cfg<16, 2, 8, 2, false, true>, 1>, Sm90Probe<Sm90Cfg<16, 2, 8, 2, false, true>, 2>,
                              Sm90Probe<Sm90Cfg<16, 2, 8, 1, false, true>, 2>, Sm90Probe<Sm90Cfg<64, 2, 8, 1, false, true>, 2>,
                              Sm90Probe<Sm90Cfg<128, 1, 8, 1, false, true, 4>, 1>, Sm90Probe<Sm90Cfg<128, 1, 8, 1, false, true, 4>, 2>>;
// What qgemm_sm90_cuda runs: the warp-specialised form; batch slices of 64 rows up to M = 64, of 128 rows above.
// H200, clean L2, x cuBLAS bf16 on 4096 x 4096 / 4096 x 11008 / 11008 x 4096 / 8192 x 28672, each configuration
// at its best split count (bench/results/h200/gemm4_probe-session8-run4.*, 554a9c6):
//   M = 9:   wg_b64m2s8w 1.09 / 1.18 / 1.26 / 1.27, wg_b64m1s6x2w 1.07 / 1.04 / 1.11 / 1.08 (mma.sync 0.75 / 1.13 / 1.07 / 1.40)
//   M = 16:  wg_b64m2s8w 1.02 / 1.11 / 1.20 / 1.26, wg_b64m1s6x2w 0.99 / 1.01 / 1.07 / 1.07 (mma.sync 0.62 / 0.97 / 0.85 / 1.26)
//   M = 33:  wg_b64m2s8w 0.89 / 1.02 / 1.02 / 1.26, wg_b64m1s6x2w 0.97 / 0.98 / 0.99 / 1.06
//   M = 64:  wg_b64m2s8w 0.60 / 0.85 / 0.88 / 1.28, wg_b64m1s6x2w 0.74 / 0.90 / 0.91 / 1.05
//   M = 128: wg_b128m1s6w 0.67 / 0.62 / 0.75 / 0.78, the fastest configuration on every shape (before the g4 forms).
// So two m64 tiles per warpgroup (half the x reads per weight byte) up to M = 64 on layers of kSm90LargeLayer weights
// or more; one tile and two blocks per SM for M 33..64 on the smaller layers.
// Batches of up to 16 / 32 rows: slices of 16 / 32 rows (a quarter / half the tensor work of 64-row slices) and two
// blocks per SM. H200 (gemm4_probe-session9-run6, 74973de, x cuBLAS bf16 at the best split count): M = 9 wg_b16m2s8x2w
// 1.21 / 1.46 / 1.62 / 1.94, M = 16 1.13 / 1.35 / 1.54 / 1.91 (the dispatch then: 1.10 / 1.18 / 1.27 / 1.37 and 1.05 /
// 1.12 / 1.25 / 1.27, mma.sync on 8192 x 28672); wg_b32m2s6x2w was the runner-up at both.
// With the two K-split reductions (session 10), each configuration at the split plan it gets, H200, clean L2
// (gemm4_probe-session10-run5; ms on 4096 x 4096 / 4096 x 11008 / 11008 x 4096 / 8192 x 28672):
//   M = 24: wg_b32m2s6x2w 0.0133 (6 in a cluster; its plan takes 8 through global memory, 0.0152) / 0.0221 / 0.0216 /
//     0.0649 (run 7), wg_b32m2s8w 0.0135 (its plan: 6 in a cluster) / 0.0242 / 0.0238 / 0.0806 (run 5 / 7): two blocks
//     per SM from kSm90NarrowLayer weights, 8 stages and one block per SM below (4096 x 4096; session 9 took
//     wg_b64m1s6x2w there, 0.0151 in run 5);
//   M = 128: wg_b128m1s8wg4 0.0202 / 0.0357 / 0.0355 / 0.1168, wg_b128m1s6w 0.0208 / 0.0430 / 0.0419 / 0.1546: four
//     consumer warpgroups on every layer now that 4096-wide layers reduce 6 K ranges in a cluster (session 9 took
//     wg_b128m1s6w below 8192 outputs).
using Sm90Tiny = Sm90Cfg<16, 2, 8, 2, false, true>;
// On layers of kSm90LargeLayer weights and more: three blocks per SM (24 consumer warps on an SM instead of 16, to
// hide more of the decode's latencies; 5 stages, so that three rings fit), although ptxas serializes their
// wgmma (C7512, registers capped at 72 a thread). With groups of whole 64-k chunks (per channel included) per-group
// fp32 scaling too (GSCALE). H200, 8192 x 28672, each at its best K-split plan (gemm4_probe-session12-run7): M = 9
// wg_b16m2s5x3wf 0.0553 ms, wg_b16m2s5x3w 0.0553, wg_b16m2s8x2wf 0.0595, wg_b16m2s8x2w 0.0604; M = 16 0.0571, 0.0582,
// 0.0601, 0.0612. Not on the 4096-wide layers: there the three-block forms were 0.98-1.08x the time of wg_b16m2s8x2w.
// (Session 11 measured GSCALE at two blocks per SM 1-3% faster on 8192 x 28672, within 2% either way on 4096-wide layers.)
using Sm90TinyLarge = Sm90Cfg<16, 2, 5, 3, false, true>;
using Sm90TinyScaled = Sm90Cfg<16, 2, 5, 3, false, true, 2, true>;
using Sm90Narrow = Sm90Cfg<32, 2, 6, 2, false, true>;
// M 17..32 on layers of kSm90LargeLayer weights and more: three blocks per SM as well (4 stages; 72 registers, wgmma
// serialized, C7512). H200, 8192 x 28672, each at its best K-split plan (gemm4_probe-session12-run9): M = 24
// wg_b32m2s4x3w 0.0626 ms (3 in a cluster) against wg_b32m2s6x2w 0.0645 (2 in a cluster); M = 32 0.0636 against 0.0650.
using Sm90NarrowLarge = Sm90Cfg<32, 2, 4, 3, false, true>;
// M <= 8 with groups of whole 64-k chunks: mma.sync consumers in 8-row slices (SYNC), three blocks per SM (5 stages), on
// layers of kSm90LargeLayer weights and more four (4 stages; ptxas spills 12-24 bytes at the 56 registers that leaves).
// H200, each at its best K splits (gemm4_probe-session17-run2): mma_b8m2s5x3wf 10.5 / 14.7 / 15.6 us at M 1 on 4096 x
// 4096 / 4096 x 11008 / 11008 x 4096 (the best wgmma forms: 11.1 / 16.2 / 16.8), mma_b8m2s4x4wf 45.3 us on 8192 x
// 28672 (51.9), 47.7 at M 8 (53.3). The 16-row mma.sync forms ran M 9 / 12 / 16 within -5..+4% of the best wgmma form
// (runs 2, 5), so those batches keep wgmma.
using Sm90Row8 = Sm90Cfg<8, 2, 5, 3, false, true, 2, true, true>;
using Sm90Row8Large = Sm90Cfg<8, 2, 4, 4, false, true, 2, true, true>;
using Sm90NarrowDeep = Sm90Cfg<32, 2, 8, 1, false, true>;
using Sm90Small = Sm90Cfg<64, 1, 6, 2, false, true>;
using Sm90SmallWide = Sm90Cfg<64, 2, 8, 1, false, true>;
// M > 64: four consumer warpgroups (256-feature strips, half the x bytes per weight byte).
using Sm90Large = Sm90Cfg<128, 1, 8, 1, false, true, 4>;
}  // namespace detail
// Npad * Kpad from which a layer counts as large (8192 x 28672 is above, LLaMA-7B's 4096-wide layers below).
inline constexpr std::int64_t kSm90LargeLayer = std::int64_t(1) << 27;
// Npad * Kpad from which M 17..32 takes Sm90Narrow (4096 x 4096 is below, the three larger LLaMA shapes above).
inline constexpr std::int64_t kSm90NarrowLayer = std::int64_t(1) << 25;
namespace detail {
// Calls f(C{}) with the configuration type qgemm_sm90_cuda uses for this shape.
template <class F>
decltype(auto) with_sm90_cfg(const QGemmShape& s, F&& f) {
  if (s.M > 64) return f(Sm90Large{});
  if (s.M <= 8 && s.group % kTileK == 0) return s.Npad * s.Kpad >= kSm90LargeLayer ? f(Sm90Row8Large{}) : f(Sm90Row8{});
  if (s.M <= 16) {
    if (s.Npad * s.Kpad < kSm90LargeLayer) return f(Sm90Tiny{});
    return s.group % kTileK == 0 ? f(Sm90TinyScaled{}) : f(Sm90TinyLarge{});
  }
  if (s.M <= 32) {
    if (s.Npad * s.Kpad >= kSm90LargeLayer) return f(Sm90NarrowLarge{});
    return s.Npad * s.Kpad >= kSm90NarrowLayer ? f(Sm90Narrow{}) : f(Sm90NarrowDeep{});
  }
  if (s.Npad * s.Kpad >= kSm90LargeLayer) return f(Sm90SmallWide{});
  return f(Sm90Small{});
}

// x [M, K] (fp16 / bf16, row-major, K % 8 == 0, 16-byte aligned) as a TMA tensor map: boxes of [64 k] x [box_rows]
// rows, 128-byte swizzle (the layout sw128_desc describes), zeros past M and K. The driver's encoder is looked up
// once through the runtime (no link against libcuda); cudaErrorNotSupported when the driver has none.
inline cudaError_t make_x_tensor_map(CUtensorMap& map, const void* x, std::int64_t M, std::int64_t K, int box_rows, bool bf16_data) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    cudaGetLastError();
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {cuuint64_t(K), cuuint64_t(M)};
  const cuuint64_t row_stride[1] = {cuuint64_t(K) * 2};
  const cuuint32_t box[2] = {cuuint32_t(kTileK), cuuint32_t(box_rows)};
  const cuuint32_t step[2] = {1, 1};
  const CUresult r = encode(&map, bf16_data ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, const_cast<void*>(x), dims,
                            row_stride, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The launch of a configuration-C kernel over `grid`, in clusters of (1, 1, cluster) blocks (the K ranges of a tile),
// or without a cluster attribute for cluster 0; for cudaLaunchKernelEx and cudaOccupancyMaxActiveClusters (which
// wants the attribute, 1 included). cooperative: every block resident at once, or the launch fails (the spread
// reduction's blocks wait for each other). Not copyable: cfg points at attrs.
template <class C>
struct Sm90Launch {
  cudaLaunchAttribute attrs[2]{};
  cudaLaunchConfig_t cfg{};
  Sm90Launch(dim3 grid, int cluster, cudaStream_t stream, bool cooperative = false) {
    cfg.gridDim = grid;
    cfg.blockDim = dim3(C::THREADS);
    cfg.dynamicSmemBytes = C::SMEM_BYTES;
    cfg.stream = stream;
    cfg.attrs = attrs;
    if (cluster > 0) {
      cudaLaunchAttribute& a = attrs[cfg.numAttrs++];
      a.id = cudaLaunchAttributeClusterDimension;
      a.val.clusterDim.x = 1;
      a.val.clusterDim.y = 1;
      a.val.clusterDim.z = unsigned(cluster);
    }
    if (cooperative) {
      cudaLaunchAttribute& a = attrs[cfg.numAttrs++];
      a.id = cudaLaunchAttributeCooperative;
      a.val.cooperative = 1;
    }
  }
  Sm90Launch(const Sm90Launch&) = delete;
  Sm90Launch& operator=(const Sm90Launch&) = delete;
};

// Lets the kernels of (T, C), both reductions, take C::SMEM_BYTES of dynamic shared memory: once per (T, C), for the
// launcher and the capacity query alike.
template <class T, class C>
cudaError_t sm90_allow_smem() {
  static const cudaError_t attr = [] {
    const cudaError_t a = cudaFuncSetAttribute(qgemm_sm90_kernel<T, C, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM_BYTES);
    return a != cudaSuccess ? a : cudaFuncSetAttribute(qgemm_sm90_kernel<T, C, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM_BYTES);
  }();
  return attr;
}

// The current device's capacity for configuration C: blocks per SM x SMs, and cudaOccupancyMaxActiveClusters per
// cluster size; asked once per configuration. Where the device cannot say (no sm_90a code, not an sm_90 device), the
// even capacity of sm_count SMs.
template <class C>
Sm90Capacity sm90_capacity(int sm_count) {
  static const Sm90Capacity asked = [] {
    Sm90Capacity c;
    c.slots = 0;
    if (!qgemm_sm90_supported()) return c;
    const auto kernel = qgemm_sm90_kernel<bf16, C, true>;  // the cluster kernels (fp16 takes the same resources)
    int dev = 0, sms = 0, per_sm = 0, per_sm_bf16 = 0, per_sm_half = 0;
    if (sm90_allow_smem<bf16, C>() != cudaSuccess || sm90_allow_smem<half, C>() != cudaSuccess || cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, C::THREADS, C::SMEM_BYTES) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_bf16, qgemm_sm90_kernel<bf16, C, false>, C::THREADS, C::SMEM_BYTES) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_half, qgemm_sm90_kernel<half, C, false>, C::THREADS, C::SMEM_BYTES) != cudaSuccess) {
      cudaGetLastError();
      return c;
    }
    c.slots = per_sm * sms;
    c.spread_slots = std::min(per_sm_bf16, per_sm_half) * sms;
    for (int k = 1; k <= kSm90MaxClusterSplits; ++k) {
      const Sm90Launch<C> launch(dim3(1, 1, unsigned(k)), k, nullptr);
      if (cudaOccupancyMaxActiveClusters(&c.clusters[k], kernel, &launch.cfg) != cudaSuccess) {
        cudaGetLastError();
        c.clusters[k] = 0;
      }
    }
    return c;
  }();
  return asked.slots > 0 ? asked : sm90_even_capacity<C>(sm_count);
}

// Configuration C with an explicit plan (benchmarks, tests). K splits reduced in a cluster launch as clusters of
// (1, 1, splits) blocks; reduced through global memory they need the plan's workspace. trace: Sm90Probe 3's timeline
// (blocks x kSm90TraceSlots values), required there and unused otherwise.
template <class T, class C>
cudaError_t launch_qgemm_sm90_cfg(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y,
                                  const QGemmShape& s, const Sm90Plan& p, const QGemmWorkspace& ws, cudaStream_t stream,
                                  std::uint64_t* trace = nullptr) {
  static_assert(std::is_same_v<T, half> || std::is_same_v<T, bf16>, "the quantized GEMM takes fp16 or bf16 activations");
  if (!qgemm_sm90_reason(s).empty()) return cudaErrorInvalidValue;
  if ((reinterpret_cast<std::uintptr_t>(x) | reinterpret_cast<std::uintptr_t>(tiles) | reinterpret_cast<std::uintptr_t>(scales) |
       reinterpret_cast<std::uintptr_t>(zeros)) & 15)
    return cudaErrorInvalidValue;  // 16-byte copies
  if (std::int64_t(p.zslices) * p.strips > 0x7fffffff) return cudaErrorInvalidValue;  // the grid's x dimension
  if (p.splits < 1 || p.splits > (p.cluster ? kSm90MaxClusterSplits : kSm90MaxSplits)) return cudaErrorInvalidValue;  // a portable cluster
  if (!sm90_ranges_cover(p, s.Kpad / kTileK) || (p.cluster && p.lead < p.splits)) return cudaErrorInvalidValue;
  if (C::GSCALE && s.group % kTileK) return cudaErrorInvalidValue;  // per-group scaling: groups of whole chunks
  const bool global = p.splits > 1 && !p.cluster;
  if (global && (ws.partial == nullptr || ws.partial_elems < p.partial_elems || ws.counters == nullptr || ws.counter_elems < p.counter_elems))
    return cudaErrorInvalidValue;
  if (global && (reinterpret_cast<std::uintptr_t>(ws.partial) & 15)) return cudaErrorInvalidValue;  // float4 sums
  if (C::PROBE == 3 && trace == nullptr) return cudaErrorInvalidValue;  // the timeline's buffer: blocks x kSm90TraceSlots
  if (!qgemm_sm90_supported()) return cudaErrorNotSupported;
  const auto kernel = p.cluster ? qgemm_sm90_kernel<T, C, true> : qgemm_sm90_kernel<T, C, false>;
  if (const cudaError_t attr = sm90_allow_smem<T, C>(); attr != cudaSuccess) return attr;
  CUtensorMap x_map{};
  if constexpr (C::WS)
    if (const cudaError_t e = make_x_tensor_map(x_map, x, s.M, s.K, C::BN, std::is_same_v<T, bf16>); e != cudaSuccess) return e;
  const Sm90Params prm{x, tiles, scales, zeros, y, ws.partial, ws.counters, int(s.M), int(s.N), int(s.K), int(s.Npad), int(s.group),
                       int(s.Kpad / kTileK), p.cps, p.lead, p.cps_tail, p.strips, p.splits, p.zslices, int(global && p.spread), trace};
  const Sm90Launch<C> launch(dim3(unsigned(p.zslices * p.strips), 1, unsigned(p.splits)), p.cluster ? p.splits : 0, stream, global && p.spread);
  return cudaLaunchKernelEx(&launch.cfg, kernel, prm, x_map);
}
}  // namespace detail

// The configuration (name) and plan qgemm_sm90_cuda uses for s.M rows (splits_override > 0 forces the K splits).
inline std::string qgemm_sm90_cfg_name(const QGemmShape& s) {
  return detail::with_sm90_cfg(s, [](auto c) { return detail::sm90_cfg_name<decltype(c)>(); });
}
inline Sm90Plan qgemm_sm90_plan(const QGemmShape& s, int sm_count, int splits_override = 0) {
  return detail::with_sm90_cfg(s, [&](auto c) {
    using C = decltype(c);
    return plan_qgemm_sm90<C>(s, detail::sm90_capacity<C>(sm_count), splits_override);
  });
}

inline QGemmWorkspace qgemm_sm90_workspace_size(const QGemmShape& s, int sm_count, int splits_override = 0) {
  const Sm90Plan p = qgemm_sm90_plan(s, sm_count, splits_override);
  return {nullptr, p.partial_elems, nullptr, p.counter_elems};
}

// y [M, N] = x [M, K] * W^T with the same arguments as qgemm_cuda (4-bit tiles). cudaErrorInvalidValue: a shape
// qgemm_sm90_reason rejects, misaligned pointers or a short workspace; cudaErrorNotSupported: no sm_90a device
// code or not an sm_90 device (qgemm_sm90_supported).
template <class T>
cudaError_t qgemm_sm90_cuda(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y, const QGemmShape& s,
                            const QGemmWorkspace& ws, int sm_count, cudaStream_t stream, int splits_override = 0) {
  return detail::with_sm90_cfg(s, [&](auto c) {
    using C = decltype(c);
    const Sm90Plan p = plan_qgemm_sm90<C>(s, detail::sm90_capacity<C>(sm_count), splits_override);
    return detail::launch_qgemm_sm90_cfg<T, C>(x, tiles, scales, zeros, y, s, p, ws, stream);
  });
}

// ---- the library's quantized GEMM: the kernel each batch size is served by ----------------------------------
// On an sm_90 device with sm_90a device code, 4-bit shapes the wgmma kernel takes run qgemm_sm90_cuda at every M;
// everything else (3- and 8-bit, shapes it declines, other devices) runs qgemm_cuda (mma.sync). H200, clean L2: at M
// 9..16 the 16-row slices (Sm90Tiny) beat the mma.sync kernel on every shape since session 9 (8192 x 28672 at M = 9:
// 0.061 against 0.086 ms, gemm4_probe-session9-run6); at M 1..8 (the mma.sync kernel's 8-row weights-as-A form served
// them until session 13) they are as fast or faster since session 14 (gemm4_probe-session14-run6, at their plans): M 1
// on 4096 x 4096 / 4096 x 11008 / 11008 x 4096 / 8192 x 28672 0.0113 / 0.0167 / 0.0166 / 0.0527 ms against 0.0112 /
// 0.0186 / 0.0187 / 0.0605, M 8 0.0120 / 0.0172 / 0.0177 / 0.0548 against 0.0150 / 0.0225 / 0.0260 / 0.0715.
inline bool quant_gemm_uses_sm90(const QGemmShape& s) { return qgemm_sm90_reason(s).empty() && qgemm_sm90_supported(); }
// Workspace sizes for quant_gemm_cuda (pointers left null): partial fp32 (any contents) and counters int32
// (zero before the first call; the kernels leave them zero).
inline QGemmWorkspace quant_gemm_workspace_size(const QGemmShape& s, int sm_count) {
  return quant_gemm_uses_sm90(s) ? qgemm_sm90_workspace_size(s, sm_count) : qgemm_workspace_size(s, sm_count);
}
// The kernel, configuration and plan quant_gemm_cuda takes for this shape, in words (error messages, benchmarks).
inline std::string quant_gemm_describe(const QGemmShape& s, int sm_count) {
  if (quant_gemm_uses_sm90(s)) return "sm90 " + qgemm_sm90_cfg_name(s) + " " + describe(qgemm_sm90_plan(s, sm_count));
  const std::string cfg = s.bits == 8 ? detail::default_cfg_name<8>(s.M) : s.bits == 3 ? detail::default_cfg_name<3>(s.M) : detail::default_cfg_name<4>(s.M);
  return "mma.sync " + cfg + " " + describe(qgemm_plan(s, sm_count));
}
// y [M, N] = x [M, K] * W^T (3-, 4- or 8-bit tiles) on `stream` with the kernel quant_gemm_uses_sm90 picks.
template <class T>
cudaError_t quant_gemm_cuda(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y, const QGemmShape& s,
                            const QGemmWorkspace& ws, int sm_count, cudaStream_t stream) {
  if (quant_gemm_uses_sm90(s)) return qgemm_sm90_cuda<T>(x, tiles, scales, zeros, y, s, ws, sm_count, stream);
  return qgemm_cuda<T>(x, tiles, scales, zeros, y, s, ws, sm_count, stream);
}

}  // namespace squeeze::kernels::quant

#endif  // __CUDACC__
