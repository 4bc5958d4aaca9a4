#pragma once
// CUDA launchers of AdamW with 8-bit block-wise state (maps, block update and CPU twin: adamw8.hpp).
//   adamw8_cuda(tensor, coeffs, dynamic, stream)   one flat buffer
//   adamw8_cuda(table, coeffs, dynamic, stream)    a DeviceTensorTable of tensors, ONE launch for all
// (advance a device step counter with adamw_commit_step_cuda from adamw.cuh, as for the fp32 state).
//
// One warp per state block of 256 elements: lane l owns elements l, l + 32, ... (8 of them; coalesced),
// decodes m and v, runs adamw_element, the warp reduces the two absmax values with shuffles, every lane
// encodes its 8 values by binary search over the map's midpoints in shared memory. A block of 8 warps
// walks one 16 Ki-element chunk of tensor_list.hpp (64 state blocks; chunks start at multiples of 256,
// so state blocks never straddle chunks or tensors).
//
// Same arithmetic as the CPU twin, bit for bit: adamw_element's multiply-adds are explicit FMAs on both sides
// (adamw.hpp), the maps and the nearest-code rule are shared. tests/kernels/adamw8_cuda_test.cu checks one step
// bitwise for every type pair.
#include "squeeze/kernels/adamw8.hpp"
#include "squeeze/kernels/tensor_list.cuh"
#include "squeeze/kernels/types.cuh"

namespace squeeze::kernels {

inline constexpr int kAdamW8Threads = 256;  // 8 warps per block
static_assert(kChunkElems % kStateBlock == 0, "chunks must be whole state blocks");

// The two maps' values, passed by value to the kernel (2 KiB of parameters); midpoints are rebuilt in
// shared memory with the host's expression, so they are the same floats.
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

SQUEEZE_DEVICE float warp_max(float x) {
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

template <class P, class G, class Source>
__global__ void __launch_bounds__(kAdamW8Threads)
    adamw8_kernel(const Source src, const StateMapValues maps, const AdamWCoeffs c, const AdamWDynamic d) {
  constexpr int kPer = int(kStateBlock) / 32;  // elements per lane
  __shared__ AdamWScalars shared;
  __shared__ float mval[kStateCodes], vval[kStateCodes], mmid[kStateCodes], vmid[kStateCodes];
  for (int i = threadIdx.x; i < kStateCodes; i += blockDim.x) {
    mval[i] = maps.m[i];
    vval[i] = maps.v[i];
  }
  if (threadIdx.x == 0) shared = adamw_scalars(c, d);
  __syncthreads();
  for (int i = threadIdx.x; i + 1 < kStateCodes; i += blockDim.x) {
    mmid[i] = 0.5f * (mval[i] + mval[i + 1]);
    vmid[i] = 0.5f * (vval[i] + vval[i + 1]);
  }
  __syncthreads();
  const AdamWScalars s = shared;
  if (s.skip) return;  // found_inf: uniform over the grid, nothing is written
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
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
    for (std::int64_t b = first + warp; b < last; b += kWarps) {
      const std::int64_t lo = b * kStateBlock;
      const float m_scale = t.exp_avg_absmax[b], v_scale = t.exp_avg_sq_absmax[b];
      float m[kPer], v[kPer];
      float m_max = 0.0f, v_max = 0.0f;
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const std::int64_t i = lo + lane + 32 * k;
        m[k] = 0.0f;
        v[k] = 0.0f;
        if (i < t.n) {
          m[k] = mval[t.exp_avg[i]] * m_scale;
          v[k] = vval[t.exp_avg_sq[i]] * v_scale;
          float w = wp[i];
          adamw_element(w, m[k], v[k], to_float(t.grad[i]), s);
          wp[i] = w;
          if constexpr (!std::is_same_v<P, float>) t.param[i] = from_float<P>(w);
          m_max = fabsf(m[k]) > m_max ? fabsf(m[k]) : m_max;  // as the CPU twin
          v_max = fabsf(v[k]) > v_max ? fabsf(v[k]) : v_max;
        }
      }
      m_max = warp_max(m_max);
      v_max = warp_max(v_max);
      const float m_inv = inverse_absmax(m_max), v_inv = inverse_absmax(v_max);
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const std::int64_t i = lo + lane + 32 * k;
        if (i < t.n) {
          t.exp_avg[i] = nearest_code(mmid, m[k] * m_inv);
          t.exp_avg_sq[i] = nearest_code(vmid, v[k] * v_inv);
        }
      }
      if (lane == 0) {
        t.exp_avg_absmax[b] = m_max;
        t.exp_avg_sq_absmax[b] = v_max;
      }
    }
  }
}

}  // namespace detail

// One flat buffer. All pointers are device pointers (d's too). Returns the launch status.
template <class P, class G>
cudaError_t adamw8_cuda(const AdamW8Tensor<P, G>& t, const AdamWCoeffs& c, const AdamWDynamic& d = {},
                        cudaStream_t stream = nullptr) {
  validate(t, "AdamW8 (CUDA) tensor");
  const std::int64_t chunks = chunks_of(t.n);
  if (chunks == 0) return cudaSuccess;
  const FlatSource<AdamW8Tensor<P, G>> src{t, chunks};
  detail::adamw8_kernel<P, G><<<grid_for_chunks(chunks), kAdamW8Threads, 0, stream>>>(src, state_map_values(), c, d);
  return cudaGetLastError();
}

// A list of tensors in one launch. The table was validated when uploaded.
template <class P, class G>
cudaError_t adamw8_cuda(const TensorTable<AdamW8Tensor<P, G>>& table, const AdamWCoeffs& c, const AdamWDynamic& d = {},
                        cudaStream_t stream = nullptr) {
  check(table.count == 0 || (table.entries != nullptr && table.chunk_prefix != nullptr),
        "AdamW8 (CUDA): tensor table has null entries; build it with DeviceTensorTable::upload");
  if (table.chunks == 0) return cudaSuccess;
  const TableSource<AdamW8Tensor<P, G>> src{table, table.chunks};
  detail::adamw8_kernel<P, G><<<grid_for_chunks(table.chunks), kAdamW8Threads, 0, stream>>>(src, state_map_values(), c, d);
  return cudaGetLastError();
}

}  // namespace squeeze::kernels
