#pragma once
// Fused 4-bit / 8-bit weight GEMM on tensor cores: y [M, N] = x [M, K] (fp16 or bf16) * W^T, W [N, K].
//
// Weights live in a kernel layout ("tiles", built once at load by quant/tiles.hpp from the GPTQ
// checkpoint layout) shaped for mma.sync.m16n8k16: one tile = 64 k x 16 n = 1024 codes, i.e. per lane
// one (4-bit) or two (8-bit) 16-byte loads. The words of lane l hold exactly the codes that lane needs as
// the B operand of the four k-steps ks for both n8 halves j of the tile (tile_coord):
//   4-bit: word ks, nibble p:      k = 16 ks + 2 (l % 4) + (p >> 2) + 8 (p & 1),  n = 8 ((p >> 1) & 1) + l / 4
//   8-bit: word 2 ks + j, byte b:  k = 16 ks + 2 (l % 4) + (b & 1) + 8 (b >> 1),  n = 8 j + l / 4
// so nibbles (p, p + 4) / bytes (2r, 2r + 1) are the two 16-bit halves of one B register, and a
// magic-number decode ((w & mask) | exponent bits) turns two codes into one half2/bfloat162 with one LOP3.
// Tiles are stored k-chunk-major ([Kpad/64][Npad/16] tiles): at any moment the warps of the grid read
// neighbouring tiles, so DRAM sees dense address ranges rather than one stream per warp at a large
// power-of-two stride. K is padded to a
// multiple of 64 and N to a multiple of 16 with code 0; padded k rows meet zero activations (x is
// staged with zero fill) and padded n columns are never stored, so padding never reaches the result.
//
// Groups: zero points (uint8 [groups, Npad]) and fp16 scales ([groups, Npad]) per `group` consecutive
// k (group % 16 == 0; per-channel = one group of Kpad). The mma multiplies x by the exact small
// integers (q - z) into fp32 accumulators kept in units of the current group's scale: when the group
// changes they are multiplied by s_old / s_new, and by the last scale at the end. So fp16 and bf16
// activations get fp32-accurate products (w is never rounded) with one accumulator set per warp.
// Scales must be nonzero (tiles.hpp maps a zero-scale group to codes == zero with scale 1).
// Act-order checkpoints are handled at load: k rows are sorted by group, x is gathered by `perm`.
//
// Work split: a block = 4 warps = 64 output columns x all M rows (up to 128 per launch, 16-row mma
// tiles). Per-chunk compute is short, so loads run far ahead: x goes through a STAGES-deep cp.async
// ring in shared memory (64 k per stage, read with ldmatrix) and each warp keeps PF chunks of its own
// column of weight tiles in flight in registers. grid.y splits K so the grid fills the GPU in one wave;
// each split writes fp32 partials and the last block of a column strip (found with a counter) reduces
// them and writes y, then resets its counter to 0, so one launch does everything and the counters stay
// zero between launches.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <type_traits>
#include <cstring>
#include <vector>

#include <squeeze/dtype.hpp>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

namespace squeeze::kernels::quant {

inline constexpr int kTileK = 64, kTileN = 16;
// 32-bit words per tile and per lane
SQUEEZE_HD constexpr int tile_words(int bits) { return bits == 8 ? 256 : 128; }
SQUEEZE_HD constexpr int lane_words(int bits) { return tile_words(bits) / 32; }

struct TileCoord {
  int k, n;  // within the 64 x 16 tile
};
// Element function of the layout: (bits, lane, word w of the lane, code p of the word) -> (k, n) in a tile.
SQUEEZE_HD TileCoord tile_coord(int bits, int lane, int w, int p) {
  if (bits == 8) return {16 * (w >> 1) + 2 * (lane & 3) + (p & 1) + 8 * (p >> 1), 8 * (w & 1) + (lane >> 2)};
  return {16 * w + 2 * (lane & 3) + (p >> 2) + 8 * (p & 1), 8 * ((p >> 1) & 1) + (lane >> 2)};
}
SQUEEZE_HD std::int64_t pad_to(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

// ---- the decode, shared by the CUDA kernel and the CPU twin ------------------------------------------------
// Pair i (0..3) of a word: two 16-bit patterns (low half = nibble i, high half = nibble i + 4) that read
// as fp16 1024 + v (even i) / 1024 + 16 v (odd i), or as bf16 128 + v (every i).
//   pair 0: nibbles 0,4   pair 1: nibbles 1,5   pair 2: nibbles 2,6   pair 3: nibbles 3,7
template <class T>
SQUEEZE_HD std::uint32_t magic_pair(std::uint32_t w, int i) {
  if constexpr (std::is_same_v<T, bf16>) {
    return ((w >> (4 * i)) & 0x000F000Fu) | 0x43004300u;  // bf16 has 7 mantissa bits: shift every nibble down
  } else {
    const std::uint32_t s = w >> (8 * (i >> 1));
    return (i & 1) ? ((s & 0x00F000F0u) | 0x64006400u) : ((s & 0x000F000Fu) | 0x64006400u);
  }
}
// 8-bit: half r (0, 1) of a word = bytes (2r, 2r + 1), as fp16 1024 + v (bf16 uses fp32, see decode8).
SQUEEZE_HD std::uint32_t magic8_pair_f16(std::uint32_t w, int r) {
  const std::uint32_t s = w >> (16 * r);
  return (s & 0xFFu) | ((s & 0xFF00u) << 8) | 0x64006400u;
}

// Host reading of one 16-bit half of magic_pair: the code value minus zero, exactly as the device's
// half2 arithmetic computes it (all values are small integers, so fp16/bf16 arithmetic is exact).
template <class T>
inline float magic_value_minus_zero(std::uint16_t bits, int i, int zero) {
  if constexpr (std::is_same_v<T, bf16>) {
    return std::bit_cast<float>(std::uint32_t(bits) << 16) - float(128 + zero);
  } else {
    half h;
    std::memcpy(&h, &bits, 2);
    const float v = to_float(h);
    return (i & 1) ? v * (1.f / 16.f) + float(-64 - zero) : v - float(1024 + zero);
  }
}

// ---- geometry and plan -------------------------------------------------------------------------------------
struct QGemmShape {
  std::int64_t M, N, K;    // logical sizes
  std::int64_t Kpad, Npad;  // tile-padded
  std::int64_t group;       // k per group after padding rules (multiple of 16; per-channel: Kpad)
  int bits = 4;             // 4 or 8
};
struct QGemmPlan {
  int m_tiles;   // 1, 2, 4 or 8 (M rows per launch <= 16 m_tiles)
  int splits;    // grid.y
  int chunks_per_split;
  std::int64_t n_blocks;  // grid.x = Npad / 64 rounded up
  std::int64_t partial_elems() const { return std::int64_t(splits > 1 ? splits : 0) * 16 * m_tiles * n_blocks * 64; }
  std::int64_t counter_elems() const { return n_blocks; }
};
inline constexpr int kWarps = 4, kBlockN = kWarps * kTileN;

// blocks_per_sm: resident blocks of the kernel instantiation (CUDA occupancy). K is split so the grid
// fills the GPU in ONE wave (floor, never a partial second wave) when the column strips alone do not.
// splits_override > 0 forces the K split (clamped to [1, K / 64]); benchmarks use it to sweep.
inline QGemmPlan plan_qgemm(std::int64_t M, std::int64_t Npad, std::int64_t Kpad, int sm_count, int blocks_per_sm, int splits_override = 0) {
  QGemmPlan p{};
  const std::int64_t m = std::min<std::int64_t>(M, 128);
  p.m_tiles = m <= 16 ? 1 : m <= 32 ? 2 : m <= 64 ? 4 : 8;
  p.n_blocks = (Npad + kBlockN - 1) / kBlockN;
  const std::int64_t chunks = Kpad / kTileK;
  const std::int64_t resident = std::int64_t(std::max(sm_count, 1)) * std::max(blocks_per_sm, 1);
  std::int64_t splits = std::clamp<std::int64_t>(splits_override > 0 ? splits_override : resident / p.n_blocks, 1, chunks);
  p.chunks_per_split = int((chunks + splits - 1) / splits);
  p.splits = int((chunks + p.chunks_per_split - 1) / p.chunks_per_split);  // no empty split
  return p;
}

// Counters a layer needs (one per 64-column strip), independent of the plan.
inline std::int64_t qgemm_counter_elems(std::int64_t Npad) { return (Npad + kBlockN - 1) / kBlockN; }

// ---- CPU twin ----------------------------------------------------------------------------------------------
// Same layout, same decode, same per-group accumulation (double here), result rounded to T.
// 8-bit codes: the device's decode is exact (q - z as a small integer), so the twin reads q - z directly.
template <class T>
void qgemm_cpu(const T* x /*[M, K]*/, const std::uint32_t* tiles, const half* scales /*[groups, Npad]*/,
                   const std::uint8_t* zeros /*[groups, Npad]*/, T* y /*[M, N]*/, const QGemmShape& s) {
  const std::int64_t ntiles = s.Npad / kTileN, kchunks = s.Kpad / kTileK;
  std::vector<double> acc(s.M * kTileN), gacc(s.M * kTileN);
#if defined(_OPENMP)
#pragma omp parallel for firstprivate(acc, gacc) schedule(static)
#endif
  for (std::int64_t nt = 0; nt < ntiles; ++nt) {
    std::fill(acc.begin(), acc.end(), 0.0);
    std::fill(gacc.begin(), gacc.end(), 0.0);
    std::int64_t cur_group = 0;
    auto flush = [&](std::int64_t g) {
      for (std::int64_t m = 0; m < s.M; ++m)
        for (int n = 0; n < kTileN; ++n) {
          acc[m * kTileN + n] += gacc[m * kTileN + n] * double(to_float(scales[g * s.Npad + nt * kTileN + n]));
          gacc[m * kTileN + n] = 0;
        }
    };
    const int tw = tile_words(s.bits), lw = lane_words(s.bits);
    for (std::int64_t kc = 0; kc < kchunks; ++kc) {
      const std::uint32_t* tile = tiles + (kc * ntiles + nt) * tw;
      for (int ks = 0; ks < 4; ++ks) {
        const std::int64_t k0 = kc * kTileK + ks * 16;
        const std::int64_t g = std::min(k0, s.K - 1) / s.group;  // padded rows use the last group (x is 0 there)
        if (g != cur_group) {
          flush(cur_group);
          cur_group = g;
        }
        for (int lane = 0; lane < 32; ++lane) {
          auto add = [&](const TileCoord& c, auto value_minus_zero) {
            const std::int64_t k = kc * kTileK + c.k, n = nt * kTileN + c.n;
            if (k >= s.K) return;  // padded rows meet zero activations
            const double v = value_minus_zero(int(zeros[g * s.Npad + n]));
            for (std::int64_t m = 0; m < s.M; ++m) gacc[m * kTileN + c.n] += double(to_float(x[m * s.K + k])) * v;
          };
          if (s.bits == 8) {
            for (int j = 0; j < 2; ++j) {
              const std::uint32_t w = tile[lane * lw + 2 * ks + j];
              for (int b = 0; b < 4; ++b)
                add(tile_coord(8, lane, 2 * ks + j, b), [&](int z) { return double((w >> (8 * b)) & 0xFFu) - z; });
            }
          } else {
            const std::uint32_t w = tile[lane * lw + ks];
            for (int pair = 0; pair < 4; ++pair) {
              const std::uint32_t bits = magic_pair<T>(w, pair);
              for (int e = 0; e < 2; ++e)
                add(tile_coord(4, lane, ks, pair + 4 * e),
                    [&](int z) { return double(magic_value_minus_zero<T>(std::uint16_t(bits >> (16 * e)), pair, z)); });
            }
          }
        }
      }
    }
    flush(cur_group);
    for (std::int64_t m = 0; m < s.M; ++m)
      for (int n = 0; n < kTileN; ++n)
        if (nt * kTileN + n < s.N) y[m * s.N + nt * kTileN + n] = from_float<T>(float(acc[m * kTileN + n]));
  }
}

// Workspace for one call: partial fp32 [plan.partial_elems()] (any contents) and counters int32
// [plan.counter_elems()] that must be zero before the first call (the kernel leaves them zero).
struct QGemmWorkspace {
  float* partial = nullptr;
  std::int64_t partial_elems = 0;
  int* counters = nullptr;
  std::int64_t counter_elems = 0;
};

#if defined(__CUDACC__)
namespace detail {

template <class T> struct Vec2;
template <> struct Vec2<half> { using type = __half2; };
template <> struct Vec2<bf16> { using type = __nv_bfloat162; };

__device__ __forceinline__ std::uint32_t u32(__half2 v) { return *reinterpret_cast<std::uint32_t*>(&v); }
__device__ __forceinline__ std::uint32_t u32(__nv_bfloat162 v) { return *reinterpret_cast<std::uint32_t*>(&v); }
template <class V>
__device__ __forceinline__ V as_vec2(std::uint32_t u) { return *reinterpret_cast<V*>(&u); }

// Not volatile: a pure register operation, so the compiler may interleave it with loads and decode.
template <class T>
__device__ __forceinline__ void mma16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  if constexpr (std::is_same_v<T, bf16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&a)[4], const void* smem_row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr));
}

// 16-byte global -> shared copy; src_bytes < 16 zero-fills the rest (0: all zeros, src not read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// B registers (q - z) of one k-step for both n8 halves j: b[j][r].
template <class T>
__device__ __forceinline__ void decode_word(std::uint32_t w, const std::uint32_t (&zlo)[2], const std::uint32_t (&zhi)[2],
                                            std::uint32_t (&b)[2][2]) {
  using V = typename Vec2<T>::type;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const V lo = as_vec2<V>(magic_pair<T>(w, 2 * j)), hi = as_vec2<V>(magic_pair<T>(w, 2 * j + 1));
    if constexpr (std::is_same_v<T, bf16>) {
      b[j][0] = u32(__hsub2(lo, as_vec2<V>(zlo[j])));
      b[j][1] = u32(__hsub2(hi, as_vec2<V>(zlo[j])));
    } else {
      b[j][0] = u32(__hsub2(lo, as_vec2<V>(zlo[j])));
      b[j][1] = u32(__hfma2(hi, __float2half2_rn(1.f / 16.f), as_vec2<V>(zhi[j])));
    }
  }
}

// 8-bit: B registers of one k-step from words w0 (n8 half 0) and w1 (half 1). fp16: 1024 + v magic,
// minus (1024 + z). bf16 (7 mantissa bits cannot hold 8-bit codes): fp32 magic 2^23 + v minus (2^23 + z),
// then pairs to bf16 (|q - z| <= 255 is exact in bf16).
template <class T>
__device__ __forceinline__ void decode_word8(std::uint32_t w0, std::uint32_t w1, const std::uint32_t (&zlo)[2], const float (&zf)[2],
                                             std::uint32_t (&b)[2][2]) {
  const std::uint32_t w[2] = {w0, w1};
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (std::is_same_v<T, bf16>) {
        const std::uint32_t s = w[j] >> (16 * r);
        const float lo = __uint_as_float(0x4B000000u | (s & 0xFFu)) - zf[j];
        const float hi = __uint_as_float(0x4B000000u | ((s >> 8) & 0xFFu)) - zf[j];
        b[j][r] = u32(__floats2bfloat162_rn(lo, hi));
      } else {
        b[j][r] = u32(__hsub2(as_vec2<__half2>(magic8_pair_f16(w[j], r)), as_vec2<__half2>(zlo[j])));
      }
    }
}

constexpr int kStride = kTileK + 8;  // halves per staged x row (144 B): rows stay 16-byte aligned for ldmatrix and
                                     // its 8 row reads hit 8 distinct 4-bank groups

// Resident blocks wanted per SM (caps registers): more warps hide more latency.
template <int MT>
inline constexpr int kMinBlocks = MT == 1 ? 5 : MT == 2 ? 4 : MT == 4 ? 4 : 3;

template <class T, int MT, int BITS>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks<MT>) qgemm_kernel(const T* __restrict__ x, const uint4* __restrict__ tiles,
                                                               const half* __restrict__ scales, const std::uint8_t* __restrict__ zeros,
                                                               T* __restrict__ y, float* __restrict__ partial, int* __restrict__ counters,
                                                               int M, int N, int K, int Npad, int Kpad, int group, int chunks_per_split) {
  // Latency hiding: per-chunk compute is short (a few hundred cycles), so loads are issued far ahead:
  // PF weight chunks per warp in registers, STAGES x chunks in a cp.async ring in shared memory.
  constexpr int LV = lane_words(BITS) / 4;  // 16-byte loads per lane per chunk (1 for 4-bit, 2 for 8-bit)
  constexpr int PF = 4 / LV;  // (the chunk loop is unrolled PF times: larger PF bloats the code)
  constexpr int STAGES = MT == 1 ? 8 : MT == 2 ? 6 : MT == 4 ? 4 : 2;
  struct Chunk {
    uint4 v[LV];
  };
  constexpr int ROWS = 16 * MT;
  __shared__ __align__(16) std::uint16_t xs[STAGES][ROWS * kStride];
  __shared__ int last_flag;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
  const int kchunks = Kpad / kTileK;
  const int nt = blockIdx.x * kWarps + warp;  // this warp's 16-column tile
  const bool warp_active = nt * kTileN < Npad;
  const int kc0 = blockIdx.y * chunks_per_split;
  const int kc1 = min(kchunks, kc0 + chunks_per_split);
  const int nck = kc1 - kc0;
  const int g4 = lane >> 2, c4 = lane & 3;

  // ---- x staging: rows < M loaded per chunk; rows >= M zeroed once in every ring buffer ----
  const bool vec_ok = (K % 8 == 0) && ((reinterpret_cast<std::uintptr_t>(x) & 15) == 0);
  for (int i = tid; i < ROWS * kStride; i += kWarps * 32) {
    const int r = i / kStride;
    if (r >= M) {
#pragma unroll
      for (int st = 0; st < STAGES; ++st) xs[st][i] = 0;
    }
  }
  // One chunk of x (rows < M, 64 k) into buffer `buf`: 16-byte cp.async (zero-filled past K) when rows are
  // 16-byte aligned, else element by element. No registers held across the compute.
  constexpr int SEGS = ROWS * (kTileK / 8);  // 8-element segments per chunk
  constexpr int SEG_ITERS = (SEGS + kWarps * 32 - 1) / (kWarps * 32);
  auto stage_x = [&](int kc, int buf) {
#pragma unroll
    for (int it = 0; it < SEG_ITERS; ++it) {
      const int sgi = tid + it * kWarps * 32;
      const int r = sgi / (kTileK / 8), kk = (sgi % (kTileK / 8)) * 8;
      const int k = kc * kTileK + kk;
      if (sgi < SEGS && r < M) {
        std::uint16_t* d = &xs[buf][r * kStride + kk];  // 16-byte aligned: kStride * 2 = 144
        if (vec_ok) {  // K % 8 == 0: a segment is all inside K or all past it
          const T* src = k < K ? x + std::int64_t(r) * K + k : x;
          cp_async16(d, src, k < K ? 16 : 0);
        } else {
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            std::uint16_t e = 0;
            if (k + q < K) {
              const T t = x[std::int64_t(r) * K + k + q];
              e = *reinterpret_cast<const std::uint16_t*>(&t);
            }
            d[q] = e;
          }
        }
      }
    }
  };

  float acc[MT][2][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.f;

  // per-group constants: zero points for the B columns (n = 8j + g4), scales for the C columns (8j + 2c4 + {0,1})
  int cur_group = -1, next_group_k = -1;
  std::uint32_t zlo[2] = {0, 0}, zhi[2] = {0, 0};
  float zf[2] = {0.f, 0.f};
  float sc[2][2] = {{1.f, 1.f}, {1.f, 1.f}};  // the scale acc is currently expressed in
  const int ncol0 = nt * kTileN;
  // Group constants are fetched one group ahead (the next group's loads overlap this group's work),
  // so a group change never waits on global memory.
  const int last_group = (K - 1) / group;
  int pf_group = -1;                   // group held in pz / ps
  std::uint32_t pz[2] = {0, 0};        // zero points (as int)
  std::uint32_t ps[2] = {0, 0};        // fp16 scale pairs (as bits)
  auto fetch_group = [&](int g, std::uint32_t (&z)[2], std::uint32_t (&s2)[2]) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      z[j] = warp_active ? zeros[std::int64_t(g) * Npad + ncol0 + 8 * j + g4] : 0u;
      s2[j] = warp_active ? *reinterpret_cast<const std::uint32_t*>(scales + std::int64_t(g) * Npad + ncol0 + 8 * j + 2 * c4) : 0u;
    }
  };
  auto load_group = [&](int g) {
    std::uint32_t zz[2], ss[2];
    if (g == pf_group) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        zz[j] = pz[j];
        ss[j] = ps[j];
      }
    } else {
      fetch_group(g, zz, ss);
    }
    if (g < last_group) {
      fetch_group(g + 1, pz, ps);
      pf_group = g + 1;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int z = int(zz[j]);
      if constexpr (BITS == 8) {
        zf[j] = 8388608.f + float(z);
        zlo[j] = u32(__float2half2_rn(float(1024 + z)));
      } else if constexpr (std::is_same_v<T, bf16>) {
        zlo[j] = u32(__float2bfloat162_rn(float(128 + z)));
      } else {
        zlo[j] = u32(__float2half2_rn(float(1024 + z)));
        zhi[j] = u32(__float2half2_rn(float(-64 - z)));
      }
      const __half2 s2 = as_vec2<__half2>(ss[j]);
      const float n0 = __low2float(s2), n1 = __high2float(s2);
      const float r0 = __fdividef(sc[j][0], n0), r1 = __fdividef(sc[j][1], n1);  // re-express acc in the new scale (2 ulp)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        acc[mt][j][0] *= r0;
        acc[mt][j][1] *= r1;
        acc[mt][j][2] *= r0;
        acc[mt][j][3] *= r1;
      }
      sc[j][0] = n0;
      sc[j][1] = n1;
    }
  };
  auto finish = [&]() {  // acc in units of the last scale -> real units
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][j][e] *= sc[j][e & 1];
  };

  const int ntiles = Npad / kTileN;
  const uint4* wt = tiles + std::int64_t(warp_active ? nt : 0) * (tile_words(BITS) / 4) + lane * LV;
  auto load_chunk = [&](int kc) {
    Chunk c;
#pragma unroll
    for (int v = 0; v < LV; ++v) c.v[v] = __ldcs(wt + std::int64_t(kc) * ntiles * (tile_words(BITS) / 4) + v);
    return c;
  };
  Chunk bq[PF];
#pragma unroll
  for (int p = 0; p < PF; ++p)
    if (warp_active && p < nck) bq[p] = load_chunk(kc0 + p);

  // x ring: chunk ci lives in buffer ci % STAGES; one commit group per chunk (empty past the end) keeps
  // the group count uniform, so "wait until STAGES - 2 groups are pending" means "chunk ci + 1 landed".
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < nck) stage_x(kc0 + st, st);
    cp_async_commit();
  }
  cp_async_wait<STAGES - 2>();
  __syncthreads();

  for (int base = 0; base < nck; base += PF) {
#pragma unroll
    for (int p = 0; p < PF; ++p) {
      const int ci = base + p;
      if (ci < nck) {  // block-uniform
        const int kc = kc0 + ci;
        const Chunk cur = bq[p];
        if (warp_active && ci + PF < nck) bq[p] = load_chunk(kc + PF);
        // buffer (ci + STAGES - 1) % STAGES was last read in iteration ci - 1, before the previous barrier
        if (ci + STAGES - 1 < nck) stage_x(kc + STAGES - 1, (ci + STAGES - 1) % STAGES);
        cp_async_commit();
        if (warp_active) {
          const std::uint16_t* xb = xs[ci % STAGES];
          std::uint32_t words[4 * LV];
#pragma unroll
          for (int v = 0; v < LV; ++v) {
            words[4 * v] = cur.v[v].x;
            words[4 * v + 1] = cur.v[v].y;
            words[4 * v + 2] = cur.v[v].z;
            words[4 * v + 3] = cur.v[v].w;
          }
#pragma unroll
          for (int ks = 0; ks < 4; ++ks) {
            const int k0 = kc * kTileK + ks * 16;
            if (k0 >= next_group_k) {  // divide only when a group may end (k-steps never straddle groups)
              const int g = min(k0, K - 1) / group;  // padded rows: last group (x is 0 there)
              if (g != cur_group) {
                cur_group = g;
                load_group(g);
              }
              next_group_k = (g + 1) * group;
            }
            std::uint32_t b[2][2];
            if constexpr (BITS == 8) {
              decode_word8<T>(words[2 * ks], words[2 * ks + 1], zlo, zf, b);
            } else {
              decode_word<T>(words[ks], zlo, zhi, b);
            }
            // A fragments of rows mt*16.., k-step ks: ldmatrix.x4, lane l addresses row (l % 8) + 8 ((l / 8) & 1),
            // column 8 (l / 16) of the 16 x 16 block; registers come back in mma's a0..a3 order. Loaded in
            // batches of up to 4 m-tiles ahead of their mma so the loads' latency overlaps.
            constexpr int AB = MT < 4 ? MT : 4;
#pragma unroll
            for (int m0 = 0; m0 < MT; m0 += AB) {
              std::uint32_t a[AB][4];
#pragma unroll
              for (int i = 0; i < AB; ++i)
                ldmatrix_x4(a[i], xb + ((m0 + i) * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * kStride + ks * 16 + 8 * (lane >> 4));
#pragma unroll
              for (int i = 0; i < AB; ++i) {
                mma16816<T>(acc[m0 + i][0], a[i], b[0][0], b[0][1]);
                mma16816<T>(acc[m0 + i][1], a[i], b[1][0], b[1][1]);
              }
            }
          }
        }
        cp_async_wait<STAGES - 2>();
        __syncthreads();
      }
    }
  }
  finish();

  // ---- epilogue: C fragment (row g4 / g4 + 8, columns 2 c4, 2 c4 + 1 of each n8 half) ----
  const int splits = gridDim.y;
  if (splits == 1) {
    if (warp_active)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int m = mt * 16 + g4 + 8 * (e >> 1), n = ncol0 + 8 * j + 2 * c4 + (e & 1);
            if (m < M && n < N) y[std::int64_t(m) * N + n] = from_float<T>(acc[mt][j][e]);
          }
    return;
  }
  // split-K: partial [splits][ROWS][n_blocks * 64]
  const std::int64_t pw = std::int64_t(gridDim.x) * kBlockN;
  float* mine = partial + std::int64_t(blockIdx.y) * ROWS * pw;
  if (warp_active)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int m = mt * 16 + g4 + 8 * h, n = ncol0 + 8 * j + 2 * c4;
          if (m < M) *reinterpret_cast<float2*>(mine + std::int64_t(m) * pw + n) = make_float2(acc[mt][j][2 * h], acc[mt][j][2 * h + 1]);
        }
  __threadfence();
  __syncthreads();
  if (tid == 0) last_flag = (atomicAdd(counters + blockIdx.x, 1) == splits - 1);
  __syncthreads();
  if (!last_flag) return;
  __threadfence();
  const int rows = min(M, ROWS);
  for (int i = tid; i < rows * kBlockN; i += kWarps * 32) {
    const int m = i / kBlockN, n = blockIdx.x * kBlockN + i % kBlockN;
    if (n >= N) continue;
    float s = 0.f;
    for (int sp = 0; sp < splits; ++sp) s += __ldcg(partial + (std::int64_t(sp) * ROWS + m) * pw + n);
    y[std::int64_t(m) * N + n] = from_float<T>(s);
  }
  if (tid == 0) counters[blockIdx.x] = 0;  // ready for the next launch
}

// Resident blocks per SM of one instantiation (cached; same on every device of one build).
template <class T, int MT, int BITS>
int qgemm_blocks_per_sm() {
  static const int n = [] {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, qgemm_kernel<T, MT, BITS>, kWarps * 32, 0) != cudaSuccess) b = 1;
    return std::max(b, 1);
  }();
  return n;
}
template <class T, int BITS>
int qgemm_blocks_per_sm(int m_tiles) {
  switch (m_tiles) {
    case 1: return qgemm_blocks_per_sm<T, 1, BITS>();
    case 2: return qgemm_blocks_per_sm<T, 2, BITS>();
    case 4: return qgemm_blocks_per_sm<T, 4, BITS>();
    default: return qgemm_blocks_per_sm<T, 8, BITS>();
  }
}
template <class T>
QGemmPlan plan_for_device(std::int64_t rows, const QGemmShape& s, int sm_count, int splits_override = 0) {
  const int mt = plan_qgemm(rows, s.Npad, s.Kpad, sm_count, 1).m_tiles;
  const int occ = s.bits == 8 ? qgemm_blocks_per_sm<T, 8>(mt) : qgemm_blocks_per_sm<T, 4>(mt);
  return plan_qgemm(rows, s.Npad, s.Kpad, sm_count, occ, splits_override);
}

template <class T, int MT, int BITS>
cudaError_t launch_qgemm(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y, float* partial,
                         int* counters, int M, const QGemmShape& s, const QGemmPlan& p, cudaStream_t stream) {
  dim3 grid(unsigned(p.n_blocks), unsigned(p.splits));
  qgemm_kernel<T, MT, BITS><<<grid, kWarps * 32, 0, stream>>>(x, reinterpret_cast<const uint4*>(tiles), scales, zeros, y, partial,
                                                              counters, M, int(s.N), int(s.K), int(s.Npad), int(s.Kpad), int(s.group),
                                                              p.chunks_per_split);
  return cudaGetLastError();
}
template <class T, int BITS>
cudaError_t launch_qgemm(int m_tiles, const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y,
                         float* partial, int* counters, int M, const QGemmShape& s, const QGemmPlan& p, cudaStream_t stream) {
  switch (m_tiles) {
    case 1: return launch_qgemm<T, 1, BITS>(x, tiles, scales, zeros, y, partial, counters, M, s, p, stream);
    case 2: return launch_qgemm<T, 2, BITS>(x, tiles, scales, zeros, y, partial, counters, M, s, p, stream);
    case 4: return launch_qgemm<T, 4, BITS>(x, tiles, scales, zeros, y, partial, counters, M, s, p, stream);
    default: return launch_qgemm<T, 8, BITS>(x, tiles, scales, zeros, y, partial, counters, M, s, p, stream);
  }
}
}  // namespace detail

// Workspace for qgemm_cuda<T> with M rows (M is processed in slices of 128 rows).
template <class T>
QGemmWorkspace qgemm_workspace_size(std::int64_t M, const QGemmShape& s, int sm_count, int splits_override = 0) {
  std::int64_t partial = 0;
  for (std::int64_t rows : {std::min<std::int64_t>(M, 128), M % 128})
    if (rows > 0) partial = std::max(partial, detail::plan_for_device<T>(rows, s, sm_count, splits_override).partial_elems());
  return {nullptr, partial, nullptr, qgemm_counter_elems(s.Npad)};
}

// y [M, N] = x [M, K] * W^T on `stream` (s.bits 4 or 8). Returns cudaErrorInvalidValue for unsupported
// arguments (or a workspace smaller than qgemm_workspace_size).
template <class T>
cudaError_t qgemm_cuda(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y, const QGemmShape& s,
                       const QGemmWorkspace& ws, int sm_count, cudaStream_t stream, int splits_override = 0) {
  static_assert(std::is_same_v<T, half> || std::is_same_v<T, bf16>, "the quantized GEMM takes fp16 or bf16 activations");
  if (s.M <= 0 || s.N <= 0 || s.K <= 0 || s.Kpad % kTileK || s.Npad % kTileN || s.Kpad < s.K || s.Npad < s.N || s.group <= 0 ||
      s.group % 16 || s.K > (1ll << 30) || s.N > (1ll << 30) || !(s.bits == 4 || s.bits == 8))
    return cudaErrorInvalidValue;
  for (std::int64_t m0 = 0; m0 < s.M; m0 += 128) {
    const int rows = int(std::min<std::int64_t>(128, s.M - m0));
    const auto p = detail::plan_for_device<T>(rows, s, sm_count, splits_override);
    if (p.splits > 1 && (ws.partial == nullptr || ws.partial_elems < p.partial_elems() || ws.counters == nullptr ||
                         ws.counter_elems < p.counter_elems()))
      return cudaErrorInvalidValue;
    const T* xm = x + m0 * s.K;
    T* ym = y + m0 * s.N;
    const cudaError_t e = s.bits == 8
                              ? detail::launch_qgemm<T, 8>(p.m_tiles, xm, tiles, scales, zeros, ym, ws.partial, ws.counters, rows, s, p, stream)
                              : detail::launch_qgemm<T, 4>(p.m_tiles, xm, tiles, scales, zeros, ym, ws.partial, ws.counters, rows, s, p, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}
#endif  // __CUDACC__

}  // namespace squeeze::kernels::quant
