#pragma once
// Streaming 4-bit GEMM for batches of 1..16 rows: y [M, N] = x [M, K] * W^T on mma.sync, weights as the A operand.
//
// Why another kernel: at these batches the work is reading the weights once; the mma.sync GEMM (gemm/mma_sync.cuh)
// splits the work into many short blocks that each stage x and a group table in shared memory behind a barrier, fill
// their load pipeline, drain it and end (H200: its load-only twin streamed at 0.6-0.7 of copy bandwidth, the
// whole kernel at 0.45). Here the grid holds only as many warps as the GPU runs at once, each warp streams its
// K part of one column group with PF chunks in flight, and no warp waits for another (no shared memory, no
// block barrier).
// Status: an experiment, not dispatched, so it lives with the benchmarks, in the library's namespace (bench_qgemm_sm90
// --streaming times it, tests/quant/test_qgemv_cuda.cu checks it). On the H200 (best configuration and part count per
// case) it ran 1.08-1.19x slower than the mma.sync kernel at M = 1, and at M 9..16 between 0.93x and 1.22x of its
// time, slower than the wgmma kernel the dispatch takes there on three shapes. Suspected: the x fragments, 8 (M <= 8)
// or 16 4-byte global loads per chunk and lane issued only one chunk ahead; the next step is x staged once per block in
// shared memory (the block's four warps share a K part) and read by ldmatrix, as the mma.sync GEMM does. The GPU tests
// check every configuration against the CPU twin.
//
// Layout: the GEMM's tiles (gemm/layout.hpp: 64 k x 16 n, 512 bytes at 4 bits), unchanged; lane l's 16 bytes of a
// tile are the A fragments of its four k-steps (word ks: pairs 0 / 2 / 1 / 3 = a0..a3, rows n = l/4 and l/4 + 8). x is the B
// operand of m16n8k16 (8 batch rows per mma, NB = 1 or 2 mmas per tile and k-step), its fragments read straight
// from global memory (cached: every warp reads the same few KB).
// Work: warp w takes column group cg = w % groups (NT tiles) and K part w / groups (a contiguous range of 64-k
// chunks, parts of equal length to one chunk); the parts per column group are as many as fill the GPU's
// resident warps (occupancy). Warps with neighbouring numbers read neighbouring tiles at the same time, so
// the GPU streams a few bands of whole tile rows (each row of tiles is contiguous in memory). (A first
// form gave each warp one contiguous run of units numbered column-group-major, stream-K style: every warp read
// a 1 KB piece far from every other warp's, and it ran 1.4x slower than the mma.sync kernel on the H200.) With one
// part, a warp stores y; with more, each writes its fp32 partial to the workspace and bumps its column group's
// counter; the warp that completes the count adds the parts in part order (deterministic), stores y and resets the
// counter to zero for the next launch.
// Groups: one 64-k chunk lies in one group (group % 64 == 0, or per channel), so a unit's mma sum of
// x * (q - z) (exact small integers times x, fp32) is multiplied by its group's scale once, as in the mma.sync GEMM.
// Limits (qgemv_reason): 4-bit tiles, M <= 16, K % 8 == 0 (4-byte x pairs), group % 64 == 0; qgemm_cuda serves
// the rest.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda_runtime.h>

#include <squeeze/kernels/quant/gemm/decode.cuh>
#include <squeeze/kernels/quant/gemm/layout.hpp>
#include <squeeze/kernels/quant/gemm/launch_plan.hpp>
#include <squeeze/kernels/quant/gemm/ptx.cuh>

namespace squeeze::kernels::quant {

// NT: 16-column tiles per column group (the bytes of one load step: NT x 512); PF: chunks in flight per warp;
// MINB: blocks (of 4 warps) per SM for __launch_bounds__, which caps the registers per thread.
template <int NT_, int PF_, int MINB_ = 1>
struct QGemvCfg {
  static constexpr int NT = NT_, PF = PF_, MINB = MINB_;
  static constexpr int WARPS = 4, THREADS = 32 * WARPS;
  static_assert(NT >= 1 && NT <= 4, "1..4 tiles per unit");
  static_assert(PF >= 2, "at least two chunks in flight");
};

struct QGemvPlan {
  int nb = 1;                 // n8 mma columns (batch blocks of 8 rows): 1 (M <= 8) or 2
  std::int64_t groups = 0;    // column groups (NT tiles each)
  int parts = 1;              // K parts per column group
  std::int64_t warps = 0;     // groups * parts
  std::int64_t blocks = 0;    // warps / 4, rounded up
  std::int64_t partial_elems = 0;  // fp32 [groups, parts, 8 nb, 16 NT] when parts > 1
  std::int64_t counter_elems = 0;  // int32 [groups], zero between launches
};
inline std::string describe(const QGemvPlan& p) {
  return "groups " + std::to_string(p.groups) + " parts " + std::to_string(p.parts) + " warps " + std::to_string(p.warps);
}

// warps_per_sm: streaming warps one SM holds at once (the launcher asks the occupancy calculator); parts_override
// > 0 forces the K parts (tests, benchmarks).
inline QGemvPlan plan_qgemv(const QGemmShape& s, int nt, int sm_count, int warps_per_sm, int parts_override = 0) {
  QGemvPlan p;
  const std::int64_t kchunks = s.Kpad / kTileK, ntiles = s.Npad / kTileN;
  p.nb = s.M <= 8 ? 1 : 2;
  p.groups = (ntiles + nt - 1) / nt;
  const std::int64_t resident = std::int64_t(std::max(sm_count, 1)) * std::max(warps_per_sm, 1);
  p.parts = int(std::clamp<std::int64_t>(parts_override > 0 ? parts_override : resident / p.groups, 1, kchunks));
  p.warps = p.groups * p.parts;
  p.blocks = (p.warps + 3) / 4;
  p.partial_elems = p.parts > 1 ? p.groups * p.parts * 8 * p.nb * 16 * nt : 0;
  p.counter_elems = p.parts > 1 ? p.groups : 0;
  return p;
}

// Why the streaming kernel cannot take this shape ("" = it can).
inline std::string qgemv_reason(const QGemmShape& s) {
  if (s.bits != 4) return "the streaming GEMM takes 4-bit weights (this layer has " + std::to_string(s.bits) + ")";
  if (s.M <= 0 || s.N <= 0 || s.K <= 0) return "empty shape";
  if (s.M > 16) return "M = " + std::to_string(s.M) + " rows: the streaming GEMM takes 1..16";
  if (s.K % 8) return "K = " + std::to_string(s.K) + " is not a multiple of 8";
  if (s.Kpad % kTileK || s.Npad % kTileN || s.Kpad < s.K || s.Kpad >= s.K + kTileK || s.Npad < s.N || s.Npad >= s.N + kTileN)
    return "Kpad / Npad are not the tile padding of K / N";
  if (s.group <= 0 || s.group % kTileK) return "group " + std::to_string(s.group) + " is not a positive multiple of 64";
  if (s.K > (1ll << 30) || s.N > (1ll << 30)) return "shape too large";
  return "";
}

#if defined(__CUDACC__)
struct QGemvParams {
  const void* x;               // T [M, K]
  const std::uint32_t* tiles;  // [Kpad/64][Npad/16] tiles
  const half* scales;          // [groups, Npad]
  const std::uint8_t* zeros;   // [groups, Npad]
  void* y;                     // T [M, N]
  float* partial;              // [groups, parts, 8 NB, 16 NT]
  int* counters;               // [groups]
  int M, N, K, Npad, group, kchunks, ntiles;
  int groups, parts;
};

namespace detail {
__device__ __forceinline__ std::uint32_t ldg_u16(const void* p) { return __ldg(static_cast<const unsigned short*>(p)); }
__device__ __forceinline__ std::uint32_t ldg_u8(const std::uint8_t* p) { return __ldg(p); }

template <class T, int NB, class C>
__global__ void __launch_bounds__(C::THREADS, C::MINB) qgemv_kernel(const QGemvParams p) {
  constexpr int NT = C::NT, PF = C::PF, ROWS = 8 * NB, COLS = NT * kTileN;
  const int lane = threadIdx.x & 31, g4 = lane >> 2, c4 = lane & 3;
  const int gw = blockIdx.x * C::WARPS + (threadIdx.x >> 5);
  if (gw >= p.groups * p.parts) return;  // warp-uniform
  const int cg = gw % p.groups, part = gw / p.groups;
  const int kchunks = p.kchunks;
  const int kc0 = int(std::int64_t(part) * kchunks / p.parts), kc1 = int(std::int64_t(part + 1) * kchunks / p.parts);
  const T* x = static_cast<const T*>(p.x);

  // One unit as this lane holds it: the tiles' 16 bytes, and the group's scale (low 16 bits) and zero point
  // (bits 16..23) of column 32 j + lane of the unit (shuffled to the lanes that need them: 1 register instead of 4
  // per tile). x fragments (k 2 c4 + 8 r of k-step ks, batch row 8 nb + g4) travel one unit ahead only: every
  // warp reads the same few KB of x, so they come from L1 / L2, not DRAM.
  constexpr int SZ = (COLS + 31) / 32;
  struct Unit {
    uint4 w[NT];
    std::uint32_t sz[SZ];
  };
  struct XFrag {
    std::uint32_t b[NB][4][2];
  };
  auto load = [&](int kc) {
    Unit un;
    const int k0 = kc * kTileK;
    const std::int64_t grow = std::int64_t(min(k0, p.K - 1) / p.group) * p.Npad;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int nt = min(cg * NT + t, p.ntiles - 1);  // tiles past N read the last one (never stored)
      un.w[t] = ldg_stream(reinterpret_cast<const uint4*>(p.tiles + (std::int64_t(kc) * p.ntiles + nt) * 128) + lane);
    }
#pragma unroll
    for (int j = 0; j < SZ; ++j) {
      const std::int64_t o = grow + min(cg * COLS + 32 * j + lane, p.Npad - 1);
      un.sz[j] = ldg_u16(p.scales + o) | (ldg_u8(p.zeros + o) << 16);
    }
    return un;
  };
  auto load_x = [&](int kc) {
    XFrag xf;
    const int k0 = kc * kTileK;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const int row = 8 * nb + g4;
      const T* xr = x + std::int64_t(min(row, p.M - 1)) * p.K;
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int k = k0 + 16 * ks + 2 * c4 + 8 * r;
          xf.b[nb][ks][r] = (row < p.M && k < p.K) ? __ldg(reinterpret_cast<const unsigned*>(xr + k)) : 0u;
        }
    }
    return xf;
  };

  // acc: this warp's sum for its column group and K part, C fragment element e at (n = g4 + 8 (e >> 1) of tile t,
  // batch row 8 nb + 2 c4 + (e & 1))
  float acc[NT][NB][4] = {};
  auto compute = [&](const Unit& un, const XFrag& xf) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      std::uint32_t zlo[2], zhi[2];
      float sc[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // tile row n = 8 h + g4: unit column 16 t + 8 h + g4
        const std::uint32_t v = __shfl_sync(0xffffffffu, un.sz[(16 * t + 8 * h) / 32], (16 * t + 8 * h) % 32 + g4);
        sc[h] = __half2float(__ushort_as_half(static_cast<unsigned short>(v & 0xFFFFu)));
        zero_operands<T>(v >> 16, zlo[h], zhi[h]);
      }
      float tmp[NB][4];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) tmp[nb][e] = 0.f;
      const std::uint32_t words[4] = {un.w[t].x, un.w[t].y, un.w[t].z, un.w[t].w};
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        std::uint32_t b[2][2];
        decode_word<T>(words[ks], zlo, zhi, b);
        const std::uint32_t a[4] = {b[0][0], b[1][0], b[0][1], b[1][1]};
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) mma16816<T>(tmp[nb], a, xf.b[nb][ks][0], xf.b[nb][ks][1]);
      }
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][nb][e] = fmaf(tmp[nb][e], sc[e >> 1], acc[t][nb][e]);
    }
  };

  // ---- the stream: PF chunks of weights and group constants in flight, x one chunk ahead ----
  const int n_units = kc1 - kc0;
  Unit buf[PF];
#pragma unroll
  for (int q = 0; q < PF; ++q)
    if (q < n_units) buf[q] = load(kc0 + q);
  XFrag xcur = load_x(kc0);
  for (int base = 0; base < n_units; base += PF) {
#pragma unroll
    for (int q = 0; q < PF; ++q) {
      const int i = base + q;
      if (i < n_units) {
        const Unit cur = buf[q];
        if (i + PF < n_units) buf[q] = load(kc0 + i + PF);
        XFrag xnext;
        if (i + 1 < n_units) xnext = load_x(kc0 + i + 1);
        compute(cur, xcur);
        xcur = xnext;
      }
    }
  }

  // ---- y, or this part's partial and the counter ----
  T* y = static_cast<T*>(p.y);
  auto for_each = [&](auto&& f) {  // f(t, nb, e, m, n_local): C fragment element e of tile t, batch block nb
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(t, nb, e, 8 * nb + 2 * c4 + (e & 1), t * kTileN + g4 + 8 * (e >> 1));
  };
  const int n0 = cg * COLS;
  if (p.parts == 1) {
    for_each([&](int t, int nb, int e, int m, int nl) {
      if (m < p.M && n0 + nl < p.N) y[std::int64_t(m) * p.N + n0 + nl] = from_float<T>(acc[t][nb][e]);
    });
    return;
  }
  float* const base = p.partial + std::int64_t(cg) * p.parts * ROWS * COLS;
  float* const mine = base + part * ROWS * COLS;
  for_each([&](int t, int nb, int e, int m, int nl) {
    if (m < p.M) mine[m * COLS + nl] = acc[t][nb][e];
  });
  __threadfence();  // this lane's partial is visible before the count says so
  __syncwarp();
  int last = 0;
  if (lane == 0) last = atomicAdd(p.counters + cg, 1) == p.parts - 1;
  last = __shfl_sync(0xffffffffu, last, 0);
  if (!last) return;
  __threadfence();
  for_each([&](int, int, int, int m, int nl) {
    if (m >= p.M || n0 + nl >= p.N) return;
    float sum = 0.f;
    for (int q = 0; q < p.parts; ++q) sum += __ldcg(base + q * ROWS * COLS + m * COLS + nl);
    y[std::int64_t(m) * p.N + n0 + nl] = from_float<T>(sum);
  });
  if (lane == 0) p.counters[cg] = 0;  // ready for the next launch
}

template <class T, class C>
cudaError_t launch_qgemv_cfg(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y, const QGemmShape& s,
                             const QGemvPlan& p, const QGemmWorkspace& ws, cudaStream_t stream) {
  if (!qgemv_reason(s).empty()) return cudaErrorInvalidValue;
  if (p.parts > 1 && (ws.partial == nullptr || ws.partial_elems < p.partial_elems || ws.counters == nullptr || ws.counter_elems < p.counter_elems))
    return cudaErrorInvalidValue;
  if ((reinterpret_cast<std::uintptr_t>(x) & 3) || (reinterpret_cast<std::uintptr_t>(tiles) & 15)) return cudaErrorInvalidValue;
  const QGemvParams prm{x, tiles, scales, zeros, y, ws.partial, ws.counters, int(s.M), int(s.N), int(s.K), int(s.Npad), int(s.group),
                        int(s.Kpad / kTileK), int(s.Npad / kTileN), int(p.groups), p.parts};
  if (p.nb == 1) qgemv_kernel<T, 1, C><<<unsigned(p.blocks), C::THREADS, 0, stream>>>(prm);
  else qgemv_kernel<T, 2, C><<<unsigned(p.blocks), C::THREADS, 0, stream>>>(prm);
  return cudaGetLastError();
}

// Streaming warps per SM for configuration C at nb (occupancy calculator, once per instantiation).
template <class T, class C>
int qgemv_warps_per_sm(int nb) {
  auto resident = [](auto kernel) {
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, C::THREADS, 0) != cudaSuccess) cudaGetLastError();
    return std::max(blocks, 1) * C::WARPS;
  };
  static const int w[2] = {resident(qgemv_kernel<T, 1, C>), resident(qgemv_kernel<T, 2, C>)};
  return w[nb == 1 ? 0 : 1];
}

// Configurations the benchmark times side by side (and the GPU tests check against the CPU twin).
template <class... Cs>
struct QGemvCfgList {};
using QGemvTuningCfgs = QGemvCfgList<QGemvCfg<2, 6>, QGemvCfg<2, 4>, QGemvCfg<2, 8>, QGemvCfg<1, 8>, QGemvCfg<1, 12>, QGemvCfg<4, 4>>;
using QGemvDefault = QGemvCfg<2, 6>;
template <class C>
std::string qgemv_cfg_name() {
  return "sv_n" + std::to_string(C::NT) + "p" + std::to_string(C::PF) + (C::MINB > 1 ? "m" + std::to_string(C::MINB) : std::string());
}
}  // namespace detail

// Plan of configuration C (default: the dispatch's) for this shape on this device.
template <class T, class C = detail::QGemvDefault>
QGemvPlan qgemv_plan(const QGemmShape& s, int sm_count) {
  return plan_qgemv(s, C::NT, sm_count, detail::qgemv_warps_per_sm<T, C>(s.M <= 8 ? 1 : 2));
}
template <class T, class C = detail::QGemvDefault>
QGemmWorkspace qgemv_workspace_size(const QGemmShape& s, int sm_count) {
  const QGemvPlan p = qgemv_plan<T, C>(s, sm_count);
  return {nullptr, p.partial_elems, nullptr, p.counter_elems};
}
// y [M, N] = x [M, K] * W^T (4-bit tiles, M <= 16) with the same arguments as qgemm_cuda. cudaErrorInvalidValue:
// a shape qgemv_reason rejects, misaligned x (4 B) / tiles (16 B), or a short workspace.
template <class T, class C = detail::QGemvDefault>
cudaError_t qgemv_cuda(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y, const QGemmShape& s,
                       const QGemmWorkspace& ws, int sm_count, cudaStream_t stream) {
  static_assert(std::is_same_v<T, half> || std::is_same_v<T, bf16>, "the quantized GEMM takes fp16 or bf16 activations");
  if (!qgemv_reason(s).empty()) return cudaErrorInvalidValue;
  return detail::launch_qgemv_cfg<T, C>(x, tiles, scales, zeros, y, s, qgemv_plan<T, C>(s, sm_count), ws, stream);
}
#endif  // __CUDACC__

}  // namespace squeeze::kernels::quant
