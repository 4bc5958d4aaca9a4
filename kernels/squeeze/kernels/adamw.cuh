#pragma once
// CUDA launchers of the fused AdamW (math and CPU twin: adamw.hpp).
//   adamw_cuda(tensor, coeffs, dynamic, stream)   one flat buffer
//   adamw_cuda(table, coeffs, dynamic, stream)    a DeviceTensorTable of tensors, ONE launch for all
//   adamw_commit_step_cuda(step, found_inf, s)    advances the device step counter unless skipped
//
// Memory-bound: 28 bytes per parameter (fp32: read w, g, m, v, write w, m, v; bf16 param + fp32 master
// with bf16 grads: read master, g(2), m, v, write master, m, v, param(2)). Each thread moves 8 elements
// per pass with 16-byte loads/stores (fp32: 2 x LDG.128 per array, bf16: 1), all loads issued before
// any math, so ~128 bytes per thread are in flight; one 16 Ki-element chunk per block, one block per
// chunk so the scheduler balances the tail. Unaligned tensors (not 16-byte aligned) and the last
// n % 8 elements of a tensor take the scalar path with the same element functor.
#include "squeeze/kernels/adamw.hpp"
#include "squeeze/kernels/tensor_list.cuh"
#include "squeeze/kernels/types.cuh"

namespace squeeze::kernels {

inline constexpr int kAdamWThreads = 256;  // threads per block
inline constexpr int kAdamWVec = 8;        // elements per thread per pass
static_assert(kChunkElems % (kAdamWThreads * kAdamWVec) == 0, "a chunk must be whole passes of a block");

namespace detail {

template <class P, class G, class S>
SQUEEZE_DEVICE bool adamw_vectorizable(const AdamWTensor<P, G, S>& t) {
  bool ok = vec_aligned(t.param) && vec_aligned(t.grad) && vec_aligned(t.exp_avg) && vec_aligned(t.exp_avg_sq);
  if constexpr (!std::is_same_v<P, float>) ok = ok && vec_aligned(t.master);
  return ok;
}

// Elements [begin, end) of tensor t by one block. begin is a multiple of kChunkElems.
template <class P, class G, class S>
SQUEEZE_DEVICE void adamw_block_range(const AdamWTensor<P, G, S>& t, std::int64_t begin, std::int64_t end,
                                      const AdamWScalars& s) {
  constexpr int V = kAdamWVec;
  std::int64_t scalar_begin = begin;
  if (adamw_vectorizable(t)) {
    float* __restrict__ wp;
    if constexpr (std::is_same_v<P, float>) wp = t.param;
    else wp = t.master;
    const std::int64_t vec_end = begin + (end - begin) / V * V;
    for (std::int64_t i = begin + std::int64_t(threadIdx.x) * V; i < vec_end; i += std::int64_t(blockDim.x) * V) {
      float w[V], g[V], m[V], v[V];  // [V] registers each
      load_float<V>(wp + i, w);
      load_float<V>(t.grad + i, g);
      load_float<V>(t.exp_avg + i, m);
      load_float<V>(t.exp_avg_sq + i, v);
#pragma unroll
      for (int j = 0; j < V; ++j) adamw_element(w[j], m[j], v[j], g[j], s);
      store_float<V>(wp + i, w);
      store_float<V>(t.exp_avg + i, m);
      store_float<V>(t.exp_avg_sq + i, v);
      if constexpr (!std::is_same_v<P, float>) store_float<V>(t.param + i, w);
    }
    scalar_begin = vec_end;
  }
  for (std::int64_t i = scalar_begin + threadIdx.x; i < end; i += blockDim.x) adamw_at(t, i, s);
}

template <class P, class G, class S, class Source>
__global__ void __launch_bounds__(kAdamWThreads) adamw_kernel(const Source src, const AdamWCoeffs c, const AdamWDynamic d) {
  const AdamWScalars s = adamw_scalars(c, d);
  if (s.skip) return;  // found_inf: every block leaves everything untouched
  for (std::int64_t chunk = blockIdx.x; chunk < src.chunks; chunk += gridDim.x) {
    std::int64_t local = 0;
    const AdamWTensor<P, G, S> t = src.locate(chunk, local);
    const std::int64_t begin = local * kChunkElems;
    const std::int64_t end = begin + kChunkElems < t.n ? begin + kChunkElems : t.n;
    adamw_block_range(t, begin, end, s);
  }
}

template <class Int>  // a template so the header can be included by many .cu files
__global__ void adamw_commit_step_kernel(Int* step, const float* found_inf) {
  adamw_commit_step(step, found_inf);
}

}  // namespace detail

// One flat buffer. All pointers are device pointers (d's too). Returns the launch status.
template <class P, class G, class S>
cudaError_t adamw_cuda(const AdamWTensor<P, G, S>& t, const AdamWCoeffs& c, const AdamWDynamic& d = {},
                       cudaStream_t stream = nullptr) {
  validate(t, "AdamW (CUDA) tensor");
  const std::int64_t chunks = chunks_of(t.n);
  if (chunks == 0) return cudaSuccess;
  const FlatSource<AdamWTensor<P, G, S>> src{t, chunks};
  detail::adamw_kernel<P, G, S><<<grid_for_chunks(chunks), kAdamWThreads, 0, stream>>>(src, c, d);
  return cudaGetLastError();
}

// A list of tensors in one launch. The table was validated when uploaded.
template <class P, class G, class S>
cudaError_t adamw_cuda(const TensorTable<AdamWTensor<P, G, S>>& table, const AdamWCoeffs& c,
                       const AdamWDynamic& d = {}, cudaStream_t stream = nullptr) {
  check(table.count == 0 || (table.entries != nullptr && table.chunk_prefix != nullptr),
        "AdamW (CUDA): tensor table has null entries; build it with DeviceTensorTable::upload");
  if (table.chunks == 0) return cudaSuccess;
  const TableSource<AdamWTensor<P, G, S>> src{table, table.chunks};
  detail::adamw_kernel<P, G, S><<<grid_for_chunks(table.chunks), kAdamWThreads, 0, stream>>>(src, c, d);
  return cudaGetLastError();
}

// ++*step unless *found_inf != 0 (found_inf may be null). Launch after adamw_cuda when AdamWDynamic::step is used.
inline cudaError_t adamw_commit_step_cuda(std::int64_t* step, const float* found_inf, cudaStream_t stream = nullptr) {
  check(step != nullptr, "adamw_commit_step_cuda: step pointer is null");
  detail::adamw_commit_step_kernel<std::int64_t><<<1, 1, 0, stream>>>(step, found_inf);
  return cudaGetLastError();
}

}  // namespace squeeze::kernels
