#pragma once
// CUDA launchers of the fused AdamW (math and CPU twin: adamw.hpp).
//   adamw_cuda(tensor, coeffs, dynamic, stream)   one flat buffer
//   adamw_cuda(table, coeffs, dynamic, stream)    a DeviceTensorTable of tensors, ONE launch for all
//   adamw_commit_step_cuda(step, found_inf, s)    advances the device step counter unless skipped
//
// Memory-bound: 28 bytes per parameter (fp32: read w, g, m, v, write w, m, v; bf16 param + fp32 master
// with bf16 grads: read master, g(2), m, v, write master, m, v, param(2)). Each thread moves 8 elements
// per pass as 2 quads (fp32: 2 x LDG.128 per array, bf16: 2 x LDG.64) in the warp-contiguous tile layout
// of tensor_list.hpp, all loads issued before any math, so ~112-128 bytes per thread are in flight; one
// 16 Ki-element chunk per block, one block per chunk so the scheduler balances the tail. Unaligned
// tensors and the elements after a chunk's last whole tile (2048 elements) take the scalar path with
// the same element functor.
#include "squeeze/kernels/adamw.hpp"
#include "squeeze/kernels/tensor_list.cuh"
#include "squeeze/kernels/types.cuh"

namespace squeeze::kernels {

inline constexpr int kAdamWThreads = 256;  // threads per block
inline constexpr int kAdamWQuads = 2;      // quads (4 elements) per thread per pass: 8 elements
static_assert(kChunkElems % (kAdamWThreads * kQuad * kAdamWQuads) == 0, "a chunk must be whole passes of a block");

namespace detail {

template <class P, class G, class S>
SQUEEZE_DEVICE bool adamw_vectorizable(const AdamWTensor<P, G, S>& t) {
  bool ok = quad_aligned(t.param) && quad_aligned(t.grad) && quad_aligned(t.exp_avg) && quad_aligned(t.exp_avg_sq);
  if constexpr (!std::is_same_v<P, float>) ok = ok && quad_aligned(t.master);
  return ok;
}

// Elements [begin, end) of tensor t by one block. begin is a multiple of kChunkElems.
template <class P, class G, class S>
SQUEEZE_DEVICE void adamw_block_range(const AdamWTensor<P, G, S>& t, std::int64_t begin, std::int64_t end, const AdamWScalars& s) {
  constexpr int Q = kAdamWQuads, T = kAdamWThreads;
  constexpr std::int64_t kTile = std::int64_t(T) * kQuad * Q;
  std::int64_t scalar_begin = begin;
  if (adamw_vectorizable(t)) {
    float* __restrict__ wp;
    if constexpr (std::is_same_v<P, float>)
      wp = t.param;
    else
      wp = t.master;
    const std::int64_t vec_end = vector_end(begin, end, kTile);
    for (std::int64_t base = begin; base < vec_end; base += kTile) {
      const std::int64_t i = quad_start(base, int(threadIdx.x), 0, T);
      float w[kQuad * Q], g[kQuad * Q], m[kQuad * Q], v[kQuad * Q];  // this thread's 8 elements of each array
      load_quads<Q>(wp + i, T, w);
      load_quads<Q>(t.grad + i, T, g);
      load_quads<Q>(t.exp_avg + i, T, m);
      load_quads<Q>(t.exp_avg_sq + i, T, v);
#pragma unroll
      for (int j = 0; j < kQuad * Q; ++j) adamw_element(w[j], m[j], v[j], g[j], s);
      store_quads<Q>(wp + i, T, w);
      store_quads<Q>(t.exp_avg + i, T, m);
      store_quads<Q>(t.exp_avg_sq + i, T, v);
      if constexpr (!std::is_same_v<P, float>) store_quads<Q>(t.param + i, T, w);
    }
    scalar_begin = vec_end;
  }
  for (std::int64_t i = scalar_begin + threadIdx.x; i < end; i += T) adamw_at(t, i, s);
}

template <class P, class G, class S, class Source>
__global__ void __launch_bounds__(kAdamWThreads) adamw_kernel(const Source src, const AdamWCoeffs c, const AdamWDynamic d) {
  // One thread reads the dynamic values (and, with a device step counter, does the double-precision
  // bias correction) for the whole block.
  __shared__ AdamWScalars shared;
  if (threadIdx.x == 0) shared = adamw_scalars(c, d);
  __syncthreads();
  const AdamWScalars s = shared;
  if (s.skip) return;  // found_inf: every block leaves everything untouched (uniform: no thread diverges)
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
cudaError_t adamw_cuda(const AdamWTensor<P, G, S>& t, const AdamWCoeffs& c, const AdamWDynamic& d = {}, cudaStream_t stream = nullptr) {
  validate(t, "AdamW (CUDA) tensor");
  const std::int64_t chunks = chunks_of(t.n);
  if (chunks == 0) return cudaSuccess;
  const FlatSource<AdamWTensor<P, G, S>> src{t, chunks};
  detail::adamw_kernel<P, G, S><<<grid_for_chunks(chunks), kAdamWThreads, 0, stream>>>(src, c, d);
  return cudaGetLastError();
}

// A list of tensors in one launch. The table was validated when uploaded.
template <class P, class G, class S>
cudaError_t adamw_cuda(const TensorTable<AdamWTensor<P, G, S>>& table, const AdamWCoeffs& c, const AdamWDynamic& d = {},
                       cudaStream_t stream = nullptr) {
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
