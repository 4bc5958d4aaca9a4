#pragma once
// CUDA launchers of AdamW with 8-bit block-wise state (maps, block update and CPU twin: adamw8.hpp).
//   adamw8_cuda(tensor, coeffs, dynamic, stream)   one flat buffer
//   adamw8_cuda(table, coeffs, dynamic, stream)    a DeviceTensorTable of tensors, ONE launch for all
// (advance a device step counter with adamw_commit_step_cuda from adamw.cuh, as for the fp32 state).
//
// A half-warp per state block of 256 elements: lane l of the half owns elements 16l .. 16l + 15, moved with 16-byte
// loads and stores (codes 16 at a time, 2-byte params and gradients 8, floats 4), decodes m and v from the value
// tables in shared memory, runs adamw_element, reduces the block's two absmax values with shuffles inside the half,
// and encodes by bucket_code over the bucket tables in shared memory (one read per value; the tables are built
// once per block from the maps by bucket_entry, the CPU's own function). Blocks of 8 warps walk the 16 Ki-element
// chunks of tensor_list.hpp grid-stride, a resident grid's worth of blocks, so the tables are built a few times per
// SM, not once per chunk. Tensors whose buffers are not 16-byte aligned, and each tensor's last partial state block,
// take the same path element by element.
//
// Same arithmetic as the CPU twin, bit for bit: adamw_element's multiply-adds are explicit FMAs on both sides
// (adamw.hpp), the maps, the bucket tables and the nearest-code rule are shared. tests/kernels/adamw8_cuda_test.cu
// checks one step bitwise for every type pair.
#include <atomic>

#include "squeeze/kernels/adamw8.hpp"
#include "squeeze/kernels/tensor_list.cuh"
#include "squeeze/kernels/types.cuh"

namespace squeeze::kernels {

inline constexpr int kAdamW8Threads = 256;  // 8 warps per block
inline constexpr int kAdamW8PerLane = 16;   // elements per lane: a half-warp per state block
static_assert(kChunkElems % kStateBlock == 0, "chunks must be whole state blocks");
static_assert(kStateBlock == 16 * kAdamW8PerLane, "a half-warp per state block");

// The two maps' values, passed by value to the kernel (2 KiB of parameters); midpoints and bucket tables are rebuilt
// in shared memory with the host's expressions, so they are the same numbers.
struct StateMapValues {
  float m[kStateCodes];
  float v[kStateCodes];
};

inline StateMapValues state_map_values() {
  StateMapValues out;
  std::memcpy(out.m, signed_state_map().value, sizeof out.m);
  std::memcpy(out.v, unsigned_state_map().value, sizeof out.v);
  return out;
}

namespace detail {

// Largest value over the 16 lanes of this half-warp (both halves reduce at once).
SQUEEZE_DEVICE float half_warp_max(float x) {
#pragma unroll
  for (int o = 8; o >= 1; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

template <class T>
SQUEEZE_DEVICE bool aligned16(const T* p) {
  return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0;
}

// 16 consecutive elements at p (16-byte aligned) to float registers, in 16-byte loads (ld.global.cg, as the fp32
// kernels: through L2 only, the stream is read once).
template <class T>
SQUEEZE_DEVICE void load16(const T* p, float (&out)[kAdamW8PerLane]) {
  constexpr int kPer = 16 / int(sizeof(T));
#pragma unroll
  for (int k = 0; k < kAdamW8PerLane / kPer; ++k) {
    const uint4 bits = __ldcg(reinterpret_cast<const uint4*>(p) + k);
    T v[kPer];
    memcpy(v, &bits, sizeof bits);
#pragma unroll
    for (int j = 0; j < kPer; ++j) out[k * kPer + j] = to_float(v[j]);
  }
}
template <class T>
SQUEEZE_DEVICE void store16(T* p, const float (&in)[kAdamW8PerLane]) {
  constexpr int kPer = 16 / int(sizeof(T));
#pragma unroll
  for (int k = 0; k < kAdamW8PerLane / kPer; ++k) {
    T v[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) v[j] = from_float<T>(in[k * kPer + j]);
    uint4 bits;
    memcpy(&bits, v, sizeof bits);
    __stwb(reinterpret_cast<uint4*>(p) + k, bits);
  }
}

template <class P, class G, class Source>
__global__ void __launch_bounds__(kAdamW8Threads)
    adamw8_kernel(const Source src, const StateMapValues maps, const AdamWCoeffs c, const AdamWDynamic d) {
  constexpr int kN = kAdamW8PerLane;
  __shared__ AdamWScalars shared;
  __shared__ float mval[kStateCodes], vval[kStateCodes], mmid[kStateCodes], vmid[kStateCodes];
  __shared__ std::int32_t mbucket[kCodeBuckets], vbucket[kCodeBuckets];
  for (int i = threadIdx.x; i < kStateCodes; i += blockDim.x) {
    mval[i] = maps.m[i];
    vval[i] = maps.v[i];
  }
  if (threadIdx.x == 0) shared = adamw_scalars(c, d);
  __syncthreads();
  const AdamWScalars s = shared;
  if (s.skip) return;  // found_inf: uniform over the grid, nothing is written
  for (int i = threadIdx.x; i + 1 < kStateCodes; i += blockDim.x) {
    mmid[i] = 0.5f * (mval[i] + mval[i + 1]);
    vmid[i] = 0.5f * (vval[i] + vval[i + 1]);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kCodeBuckets; i += blockDim.x) {
    mbucket[i] = bucket_entry(mmid, kBucketKeyLo + i, true);
    vbucket[i] = bucket_entry(vmid, kBucketKeyLo + i, false);
  }
  __syncthreads();
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int half = lane / 16, e0 = (lane % 16) * kN;  // this lane's first element inside its state block
  constexpr int kWarps = kAdamW8Threads / 32;
  for (std::int64_t chunk = blockIdx.x; chunk < src.chunks; chunk += gridDim.x) {
    std::int64_t local = 0;
    const AdamW8Tensor<P, G> t = src.locate(chunk, local);
    const std::int64_t first = local * (kChunkElems / kStateBlock);  // state block index inside the tensor
    const std::int64_t end = first + kChunkElems / kStateBlock, blocks = state_blocks(t.n);
    const std::int64_t last = end < blocks ? end : blocks;
    float* wp;
    if constexpr (std::is_same_v<P, float>) wp = t.param;
    else wp = t.master;
    const bool aligned = aligned16(t.param) && aligned16(wp) && aligned16(t.grad) && aligned16(t.exp_avg) && aligned16(t.exp_avg_sq);
    for (std::int64_t pair = first + 2 * warp; pair < last; pair += 2 * kWarps) {  // uniform over the warp
      const std::int64_t b = pair + half;
      const bool valid = b < last;
      const std::int64_t lo = b * kStateBlock;
      const int len = valid ? int(t.n - lo < kStateBlock ? t.n - lo : kStateBlock) : 0;
      const bool vector = aligned && len == kStateBlock;
      float w[kN], g[kN], m[kN], v[kN];
      std::uint8_t mc[kN], vc[kN];
      if (vector) {
        load16(wp + lo + e0, w);
        load16(t.grad + lo + e0, g);
        const uint4 mb = __ldcg(reinterpret_cast<const uint4*>(t.exp_avg + lo + e0));
        const uint4 vb = __ldcg(reinterpret_cast<const uint4*>(t.exp_avg_sq + lo + e0));
        memcpy(mc, &mb, sizeof mb);
        memcpy(vc, &vb, sizeof vb);
      } else {
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          const bool in = e0 + k < len;
          const std::int64_t i = lo + e0 + k;
          w[k] = in ? wp[i] : 0.0f;
          g[k] = in ? to_float(t.grad[i]) : 0.0f;
          mc[k] = in ? t.exp_avg[i] : 0;
          vc[k] = in ? t.exp_avg_sq[i] : 0;
        }
      }
      const float m_scale = valid ? t.exp_avg_absmax[b] : 0.0f, v_scale = valid ? t.exp_avg_sq_absmax[b] : 0.0f;
      float m_max = 0.0f, v_max = 0.0f;
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        m[k] = mval[mc[k]] * m_scale;
        v[k] = vval[vc[k]] * v_scale;
        adamw_element(w[k], m[k], v[k], g[k], s);
        if (e0 + k < len) {
          m_max = fabsf(m[k]) > m_max ? fabsf(m[k]) : m_max;  // as the CPU twin (NaN never wins)
          v_max = fabsf(v[k]) > v_max ? fabsf(v[k]) : v_max;
        }
      }
      m_max = half_warp_max(m_max);
      v_max = half_warp_max(v_max);
      const float m_inv = inverse_absmax(m_max), v_inv = inverse_absmax(v_max);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        mc[k] = std::uint8_t(bucket_code(mbucket, m[k] * m_inv, true));
        vc[k] = std::uint8_t(bucket_code(vbucket, v[k] * v_inv, false));
      }
      if (vector) {
        store16(wp + lo + e0, w);
        if constexpr (!std::is_same_v<P, float>) store16(t.param + lo + e0, w);
        uint4 mb, vb;
        memcpy(&mb, mc, sizeof mb);
        memcpy(&vb, vc, sizeof vb);
        __stwb(reinterpret_cast<uint4*>(t.exp_avg + lo + e0), mb);
        __stwb(reinterpret_cast<uint4*>(t.exp_avg_sq + lo + e0), vb);
      } else {
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          if (e0 + k >= len) continue;
          const std::int64_t i = lo + e0 + k;
          wp[i] = w[k];
          if constexpr (!std::is_same_v<P, float>) t.param[i] = from_float<P>(w[k]);
          t.exp_avg[i] = mc[k];
          t.exp_avg_sq[i] = vc[k];
        }
      }
      if (valid && e0 == 0) {
        t.exp_avg_absmax[b] = m_max;
        t.exp_avg_sq_absmax[b] = v_max;
      }
    }
  }
}

// Blocks for a launch over `chunks`: as many as are resident at once (the tables are built once per block), no
// more than there are chunks.
template <class P, class G, class Source>
cudaError_t adamw8_grid(std::int64_t chunks, unsigned& grid) {
  static std::atomic<int> cached{0};  // per instantiation; the same on every GPU of one build's architecture
  int per_sm = cached.load(std::memory_order_relaxed);
  if (per_sm == 0) {
    if (const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, adamw8_kernel<P, G, Source>, kAdamW8Threads, 0);
        e != cudaSuccess)
      return e;
    per_sm = per_sm < 1 ? 1 : per_sm;
    cached.store(per_sm, std::memory_order_relaxed);
  }
  int sms = 1;
  if (const cudaError_t e = sm_count(sms); e != cudaSuccess) return e;
  grid = unsigned(std::min<std::int64_t>(chunks, std::int64_t(sms) * per_sm));
  return cudaSuccess;
}

}  // namespace detail

// One flat buffer. All pointers are device pointers (d's too). Returns the launch status.
template <class P, class G>
cudaError_t adamw8_cuda(const AdamW8Tensor<P, G>& t, const AdamWCoeffs& c, const AdamWDynamic& d = {},
                        cudaStream_t stream = nullptr) {
  validate(t, "AdamW8 (CUDA) tensor");
  const std::int64_t chunks = chunks_of(t.n);
  if (chunks == 0) return cudaSuccess;
  using Source = FlatSource<AdamW8Tensor<P, G>>;
  unsigned grid = 0;
  if (const cudaError_t e = detail::adamw8_grid<P, G, Source>(chunks, grid); e != cudaSuccess) return e;
  detail::adamw8_kernel<P, G><<<grid, kAdamW8Threads, 0, stream>>>(Source{t, chunks}, state_map_values(), c, d);
  return cudaGetLastError();
}

// A list of tensors in one launch. The table was validated when uploaded.
template <class P, class G>
cudaError_t adamw8_cuda(const TensorTable<AdamW8Tensor<P, G>>& table, const AdamWCoeffs& c, const AdamWDynamic& d = {},
                        cudaStream_t stream = nullptr) {
  check(table.count == 0 || (table.entries != nullptr && table.chunk_prefix != nullptr),
        "AdamW8 (CUDA): tensor table has null entries; build it with DeviceTensorTable::upload");
  if (table.chunks == 0) return cudaSuccess;
  using Source = TableSource<AdamW8Tensor<P, G>>;
  unsigned grid = 0;
  if (const cudaError_t e = detail::adamw8_grid<P, G, Source>(table.chunks, grid); e != cudaSuccess) return e;
  detail::adamw8_kernel<P, G><<<grid, kAdamW8Threads, 0, stream>>>(Source{table, table.chunks}, state_map_values(), c, d);
  return cudaGetLastError();
}

}  // namespace squeeze::kernels
