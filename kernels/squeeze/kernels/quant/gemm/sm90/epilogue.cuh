#pragma once
// The sm90 family (gemm/sm90.cuh): the epilogue, stores and the K-split reductions (cluster, spread, last block).
#if !defined(__CUDACC__)
#error "gemm/sm90/epilogue.cuh is a CUDA header: compile this translation unit with nvcc"
#endif

#include "squeeze/kernels/quant/gemm/sm90/mma.cuh"

namespace squeeze::kernels::quant {
namespace detail {

// ==== epilogue =========================================================================================================
// Accumulator i of tile t holds (feature nl + 64 t + 8 ((i >> 1) & 1), batch row 8 (i >> 2) + 2 c4 + (i & 1)). y is
// written 8 features (16 bytes) per store where rows of y are 16-byte aligned: the accumulators' own layout would store
// 2 bytes per thread, 16 contiguous bytes per 8 lanes (a store loop several times slower).
struct Sm90Out {
  int rows, cols;  // of the tile inside y
  bool y_vec;      // 16-byte stores
};
// Features cc..cc + 7 of row r of the tile, from fp32 sums.
template <class T>
__device__ inline void sm90_write8(const Sm90Params& p, const Sm90Tile& b, const Sm90Out& o, int r, int cc, const float (&v)[8]) {
  T* const dst = static_cast<T*>(p.y) + std::int64_t(b.m0 + r) * p.N + b.n0 + cc;
  if (o.y_vec && cc + 8 <= o.cols) {
    uint4 packed;
    T* const h = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int j = 0; j < 8; ++j) h[j] = from_float<T>(v[j]);
    *reinterpret_cast<uint4*>(dst) = packed;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (cc + j < o.cols) dst[j] = from_float<T>(v[j]);
  }
}
// Lanes 2j and 2j + 1 hold features cc..cc + 3 and cc + 4..cc + 7 of one row: the even lane stores all eight.
template <class T>
__device__ inline void sm90_store_pairs(const Sm90Params& p, const Sm90Tile& b, const Sm90Out& o, bool valid, int lane, int r, int cc,
                                        const float4& sum) {
  const float v[8] = {sum.x,
                      sum.y,
                      sum.z,
                      sum.w,
                      __shfl_down_sync(0xffffffffu, sum.x, 1),
                      __shfl_down_sync(0xffffffffu, sum.y, 1),
                      __shfl_down_sync(0xffffffffu, sum.z, 1),
                      __shfl_down_sync(0xffffffffu, sum.w, 1)};
  if (valid && (lane & 1) == 0) sm90_write8<T>(p, b, o, r, cc, v);
}
__device__ inline void sm90_add4(float4& sum, const float4& v) {
  sum.x += v.x;
  sum.y += v.y;
  sum.z += v.z;
  sum.w += v.w;
}
// The output loop of every K-split reduction: float4 units [u_begin, u_end) of the tile (row r, features cc..cc + 3),
// each the sum of its K ranges in K-range order: from the cluster's shared memory (buf in every block), from the fp32
// partials with this block's own range from buf (spread), or from the partials alone (the last block); stored 8
// features a lane (sm90_store_pairs). (Loading 8 features a lane, two float4 32 bytes apart, ran the cluster reduction
// slower: the lanes' loads no longer contiguous.) The loop runs whole warps (the shuffle).
enum class Sm90SumFrom { Cluster, Spread, Last };
template <class T, class C, Sm90SumFrom FROM>
__device__ __forceinline__ void sm90_store_sums(const Sm90Params& p, const Sm90Tile& b, const Sm90Out& o, int u_begin, int u_end, int tid,
                                                int lane, const float* buf, std::int64_t split_stride) {
  constexpr int STRIP = C::STRIP, PITCH = C::SPLIT_PITCH;
  [[maybe_unused]] const unsigned base = FROM == Sm90SumFrom::Cluster ? smem_addr(buf) : 0u;
  for (int w0 = u_begin + (tid & ~31); w0 < u_end; w0 += C::CONSUMERS) {
    const int u = w0 + lane, r = u / (STRIP / 4), cc = (u % (STRIP / 4)) * 4;
    const bool valid = u < u_end && cc < o.cols;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    if (valid) {
      if constexpr (FROM == Sm90SumFrom::Cluster) {
        const unsigned off = base + unsigned(r * PITCH + cc) * 4u;
        float4 v[kSm90MaxClusterSplits];
#pragma unroll
        for (int sp = 0; sp < kSm90MaxClusterSplits; ++sp)
          if (sp < p.splits) v[sp] = ld_cluster_f4(map_cluster(off, sp));
        sum = v[0];
#pragma unroll
        for (int sp = 1; sp < kSm90MaxClusterSplits; ++sp)
          if (sp < p.splits) sm90_add4(sum, v[sp]);
      } else if constexpr (FROM == Sm90SumFrom::Spread) {
        const float* const src = p.partial + std::int64_t(b.m0 + r) * p.Npad + b.n0 + cc;
        const float4 own = *reinterpret_cast<const float4*>(buf + r * PITCH + cc);
        // 8 K ranges' loads in flight at a time
        for (int sp0 = 0; sp0 < p.splits; sp0 += 8) {
          float4 v[8];
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (sp0 + j < p.splits)
              v[j] = sp0 + j == b.split ? own : __ldcg(reinterpret_cast<const float4*>(src + (sp0 + j) * split_stride));
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (sp0 + j < p.splits) {
              if (sp0 + j == 0)
                sum = v[j];
              else
                sm90_add4(sum, v[j]);
            }
        }
      } else {
        // 4 K ranges' loads in flight at a time (Npad and n0 are multiples of 16: the float4 loads are aligned; batches
        // of 8 predicated loads, as in the cluster form, were slower)
        const float* src = p.partial + std::int64_t(b.m0 + r) * p.Npad + b.n0 + cc;
        int sp = 0;
        for (; sp + 4 <= p.splits; sp += 4) {
          float4 v[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) v[j] = __ldcg(reinterpret_cast<const float4*>(src + (sp + j) * split_stride));
#pragma unroll
          for (int j = 0; j < 4; ++j) sm90_add4(sum, v[j]);
        }
        for (; sp < p.splits; ++sp) sm90_add4(sum, __ldcg(reinterpret_cast<const float4*>(src + sp * split_stride)));
      }
    }
    sm90_store_pairs<T>(p, b, o, valid, lane, r, cc, sum);
  }
}
// One K range: the tile as T through the ring, [BN][PITCH] (after the barrier every warpgroup's wgmma finished reading
// the ring; every copy landed), then 16-byte rows out. +8 elements a row: the four rows one store writes, 2 apart, fall
// in different banks.
template <class T, class C, class Work>
__device__ __forceinline__ void sm90_store_tile(const Sm90Params& p, unsigned char* smem, const Sm90Tile& b, const Sm90Out& o,
                                                const float (&acc)[C::WM][C::BN / 2], int tid, int c4, int nl) {
  constexpr int BN = C::BN, WM = C::WM, STRIP = C::STRIP, NACC = BN / 2, PITCH = STRIP + 8;
  static_assert(BN * PITCH * int(sizeof(T)) <= C::STAGES * C::STAGE_BYTES, "the output tile must fit in the ring");
  T* const y = static_cast<T*>(p.y);
  T* const out = reinterpret_cast<T*>(smem);
  consumer_bar_sync(C::CONSUMERS);
  if (tid == 0) Work::at(p, Sm90Point::EpilogueWaited);
#pragma unroll
  for (int t = 0; t < WM; ++t)
#pragma unroll
    for (int i = 0; i < NACC; ++i)
      out[(8 * (i >> 2) + 2 * c4 + (i & 1)) * PITCH + nl + 64 * t + 8 * ((i >> 1) & 1)] = from_float<T>(acc[t][i]);
  consumer_bar_sync(C::CONSUMERS);
  if (tid == 0) Work::at(p, Sm90Point::EpilogueStaged);
  for (int u = tid; u < o.rows * (STRIP / 8); u += C::CONSUMERS) {
    const int r = u / (STRIP / 8), cc = (u % (STRIP / 8)) * 8;
    if (cc >= o.cols) continue;
    const T* const src = out + r * PITCH + cc;
    T* const dst = y + std::int64_t(b.m0 + r) * p.N + b.n0 + cc;
    if (o.y_vec && cc + 8 <= o.cols) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int j = 0; j < 8 && cc + j < o.cols; ++j) dst[j] = src[j];
    }
  }
  if (tid == 0) Work::at(p, Sm90Point::EpilogueStored);
}
// K splits reduced by share (in a cluster, or spread through global memory): this block's sums into its shared memory,
// [BN][SPLIT_PITCH] fp32 over the ring (every copy landed, and after the barrier every warpgroup's wgmma finished
// reading it).
template <class C, class Work>
__device__ __forceinline__ void sm90_stage_sums(const Sm90Params& p, float* buf, const float (&acc)[C::WM][C::BN / 2], int tid, int c4,
                                                int nl) {
  constexpr int PITCH = C::SPLIT_PITCH;
  consumer_bar_sync(C::CONSUMERS);
  if (tid == 0) Work::at(p, Sm90Point::EpilogueWaited);
#pragma unroll
  for (int t = 0; t < C::WM; ++t)
#pragma unroll
    for (int i = 0; i < C::BN / 2; ++i) buf[(8 * (i >> 2) + 2 * c4 + (i & 1)) * PITCH + nl + 64 * t + 8 * ((i >> 1) & 1)] = acc[t][i];
}
// After the last chunk (consumer threads only; every thread when not WS): y from the accumulators, directly (one K
// range) or through a K-split reduction, all in K-range order (deterministic): in the cluster's distributed shared
// memory, through global memory by every block of the tile (spread), or by its last block.
template <class T, class C, bool CLUSTER, class Work>
__device__ __forceinline__ void sm90_epilogue(const Sm90Params& p, unsigned char* smem, const Sm90Tile& b,
                                              const float (&acc)[C::WM][C::BN / 2], int tid, int lane, int c4, int nl, int& last_flag) {
  constexpr int BN = C::BN, WM = C::WM, STRIP = C::STRIP, NACC = BN / 2;
  const Sm90Out o{min(BN, p.M - b.m0), min(STRIP, p.N - b.n0), p.N % 8 == 0 && (reinterpret_cast<std::uintptr_t>(p.y) & 15) == 0};
  if (p.splits == 1) {
    sm90_store_tile<T, C, Work>(p, smem, b, o, acc, tid, c4, nl);
    return;
  }
  // each block sums its share of the tile, float4 units [u_begin, u_end) (whole 8-feature units: lanes 2j and 2j + 1
  // hold one)
  constexpr int PITCH = C::SPLIT_PITCH;
  float* const buf = reinterpret_cast<float*>(smem);
  const int units8 = o.rows * (STRIP / 8);
  const int u_begin = 2 * int(std::int64_t(units8) * b.split / p.splits), u_end = 2 * int(std::int64_t(units8) * (b.split + 1) / p.splits);
  if constexpr (CLUSTER) {
    // in the cluster: the shares summed over the cluster's buffers (distributed shared memory); the cost is these
    // loads
    sm90_stage_sums<C, Work>(p, buf, acc, tid, c4, nl);
    cluster_sync();  // every K range's sums are in its block's shared memory
    if (tid == 0) Work::at(p, Sm90Point::EpilogueStaged);
    sm90_store_sums<T, C, Sm90SumFrom::Cluster>(p, b, o, u_begin, u_end, tid, lane, buf, 0);
    if (tid == 0) Work::at(p, Sm90Point::EpilogueStored);
    cluster_sync();  // no block leaves (its shared memory) while another still reads it
    return;
  }
  int* const counter = p.counters + b.z * p.strips + b.strip;
  const std::int64_t split_stride = std::int64_t(p.M) * p.Npad;
  if (p.spread) {
    // Through global memory, spread: every block of the tile sums its share, as in a cluster, from fp32 partials in L2
    // (the last block summing all of them alone is bound by one SM's loads from L2; measured: docs/kernels/quant-gemm.md).
    // Each block writes the other blocks' shares of its sums (16-byte stores from the staged tile; its own
    // share stays in shared memory), waits for the tile's other blocks (the cooperative launch makes every block
    // resident), then adds the K ranges of its share in order, its own from shared memory. The counter counts arrivals
    // (up to splits), then departures; the last to leave sets it to zero for the next launch.
    sm90_stage_sums<C, Work>(p, buf, acc, tid, c4, nl);
    consumer_bar_sync(C::CONSUMERS);
    float* const part = p.partial + b.split * split_stride;
    const int units = o.rows * (STRIP / 4);
    for (int u = tid; u < units; u += C::CONSUMERS) {
      const int r = u / (STRIP / 4), cc = (u % (STRIP / 4)) * 4;
      if ((u < u_begin || u >= u_end) && cc < o.cols)
        __stcg(reinterpret_cast<float4*>(part + std::int64_t(b.m0 + r) * p.Npad + b.n0 + cc),
               *reinterpret_cast<const float4*>(buf + r * PITCH + cc));
    }
    consumer_bar_sync(C::CONSUMERS);  // every share written, then released by thread 0's arrival
    if (tid == 0) {
      atom_add_acq_rel_gpu(counter, 1);
      while (ld_acquire_gpu(counter) < p.splits) __nanosleep(64);
    }
    consumer_bar_sync(C::CONSUMERS);  // the other blocks' shares, acquired by thread 0, for every thread
    if (tid == 0) Work::at(p, Sm90Point::EpilogueStaged);
    sm90_store_sums<T, C, Sm90SumFrom::Spread>(p, b, o, u_begin, u_end, tid, lane, buf, split_stride);
    if (tid == 0) Work::at(p, Sm90Point::EpilogueStored);
    if (tid == 0 && atomicAdd(counter, 1) == 2 * p.splits - 1) *counter = 0;  // every block has left the wait
    return;
  }
  // through global memory, the last block: fp32 partials, and the last block of the tile to finish (a counter each)
  // sums them
  float* const part = p.partial + std::int64_t(b.split) * p.M * p.Npad;
#pragma unroll
  for (int t = 0; t < WM; ++t)
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
      const int n = b.n0 + nl + 64 * t + 8 * ((i >> 1) & 1), m = b.m0 + 8 * (i >> 2) + 2 * c4 + (i & 1);
      if (m < p.M && n < p.Npad) part[std::int64_t(m) * p.Npad + n] = acc[t][i];
    }
  consumer_bar_sync(C::CONSUMERS);  // every partial written, then released by thread 0's arrival
  if (tid == 0) Work::at(p, Sm90Point::EpilogueWaited);
  if (tid == 0) last_flag = atom_add_acq_rel_gpu(counter, 1) == p.splits - 1;  // the last: the others' partials acquired
  consumer_bar_sync(C::CONSUMERS);
  if (tid == 0) Work::at(p, Sm90Point::EpilogueStaged);
  if (!last_flag) return;
  // the last block sums every K range
  sm90_store_sums<T, C, Sm90SumFrom::Last>(p, b, o, 0, o.rows * (STRIP / 4), tid, lane, buf, split_stride);
  if (tid == 0) Work::at(p, Sm90Point::EpilogueStored);
  if (tid == 0) *counter = 0;  // ready for the next launch
}

}  // namespace detail
}  // namespace squeeze::kernels::quant
