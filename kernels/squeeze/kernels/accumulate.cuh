#pragma once
// CUDA launchers of gradient accumulation (math, averaging rule and CPU twin: accumulate.hpp).
//   accumulate_cuda(tensor, scale, overwrite, stream)   one flat buffer
//   accumulate_cuda(table, scale, overwrite, stream)    a DeviceTensorTable, one launch
// Quad loads/stores of acc (fp32) and grad (G) in the tile layout of tensor_list.hpp, 8 elements per thread per pass.
#include "squeeze/kernels/accumulate.hpp"
#include "squeeze/kernels/tensor_list.cuh"
#include "squeeze/kernels/types.cuh"

namespace squeeze::kernels {

inline constexpr int kAccumThreads = 256;
inline constexpr int kAccumQuads = 2;
static_assert(kChunkElems % (kAccumThreads * kQuad * kAccumQuads) == 0);

namespace detail {

template <class G, class Source>
__global__ void __launch_bounds__(kAccumThreads) accumulate_kernel(const Source src, const float scale, const bool overwrite) {
  constexpr int Q = kAccumQuads, T = kAccumThreads;
  constexpr std::int64_t kTile = std::int64_t(T) * kQuad * Q;
  for (std::int64_t chunk = blockIdx.x; chunk < src.chunks; chunk += gridDim.x) {
    std::int64_t local = 0;
    const AccumTensor<G> t = src.locate(chunk, local);
    const std::int64_t begin = local * kChunkElems;
    const std::int64_t end = begin + kChunkElems < t.n ? begin + kChunkElems : t.n;
    std::int64_t scalar_begin = begin;
    if (quad_aligned(t.acc) && quad_aligned(t.grad)) {
      const std::int64_t vec_end = vector_end(begin, end, kTile);
      for (std::int64_t base = begin; base < vec_end; base += kTile) {
        const std::int64_t i = quad_start(base, int(threadIdx.x), 0, T);
        float a[kQuad * Q] = {}, g[kQuad * Q];
        if (!overwrite) load_quads<Q>(t.acc + i, T, a);  // the first micro-batch does not read acc
        load_quads<Q>(t.grad + i, T, g);
#pragma unroll
        for (int j = 0; j < kQuad * Q; ++j) a[j] = accumulate_element(a[j], g[j], scale, overwrite);
        store_quads<Q>(t.acc + i, T, a);
      }
      scalar_begin = vec_end;
    }
    for (std::int64_t i = scalar_begin + threadIdx.x; i < end; i += T)
      t.acc[i] = accumulate_element(overwrite ? 0.0f : t.acc[i], to_float(t.grad[i]), scale, overwrite);
  }
}

}  // namespace detail

template <class G>
cudaError_t accumulate_cuda(const AccumTensor<G>& t, float scale, bool overwrite, cudaStream_t stream = nullptr) {
  check_accumulate_scale(scale);
  validate(t, "accumulate (CUDA) tensor");
  const std::int64_t chunks = chunks_of(t.n);
  if (chunks == 0) return cudaSuccess;
  detail::accumulate_kernel<G>
      <<<grid_for_chunks(chunks), kAccumThreads, 0, stream>>>(FlatSource<AccumTensor<G>>{t, chunks}, scale, overwrite);
  return cudaGetLastError();
}

template <class G>
cudaError_t accumulate_cuda(const TensorTable<AccumTensor<G>>& table, float scale, bool overwrite, cudaStream_t stream = nullptr) {
  check_accumulate_scale(scale);
  check(table.count == 0 || (table.entries != nullptr && table.chunk_prefix != nullptr), "accumulate (CUDA): table has null entries");
  if (table.chunks == 0) return cudaSuccess;
  detail::accumulate_kernel<G>
      <<<grid_for_chunks(table.chunks), kAccumThreads, 0, stream>>>(TableSource<AccumTensor<G>>{table, table.chunks}, scale, overwrite);
  return cudaGetLastError();
}

}  // namespace squeeze::kernels
