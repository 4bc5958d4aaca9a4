#pragma once
// CUDA launchers of the global gradient norm (math and CPU twin: grad_norm.hpp).
//   grad_norm_cuda(grad | table, type, max_norm, inv_scale, out, workspace, stream)
//   grad_norm_finalize_cuda(reduced, type, max_norm, inv_scale, out, stream)   from a sum reduced elsewhere
// Two kernels, no host sync, deterministic (fixed grid, fixed reduction order):
//   1. up to kNormMaxBlocks blocks stride over the chunks; each thread accumulates in double, CUB's
//      BlockReduce combines the block, one partial per block goes to `workspace`;
//   2. one block reduces the partials (CUB again) and writes norm / clip_coef / found_inf (device pointers),
//      which adamw_cuda then reads through AdamWDynamic.
#include <cub/block/block_reduce.cuh>

#include "squeeze/kernels/grad_norm.hpp"
#include "squeeze/kernels/tensor_list.cuh"
#include "squeeze/kernels/types.cuh"

namespace squeeze::kernels {

inline constexpr int kNormThreads = 256;
inline constexpr int kNormQuads = 2;
inline constexpr int kNormMaxBlocks = 1024;  // partials in the workspace: [kNormMaxBlocks] double
static_assert(kChunkElems % (kNormThreads * kQuad * kNormQuads) == 0);

// Device scratch for grad_norm_cuda: kNormMaxBlocks doubles. Allocate once, reuse every step.
class GradNormWorkspace {
 public:
  GradNormWorkspace() { SQUEEZE_CUDA_CHECK(cudaMalloc(&p_, kNormMaxBlocks * sizeof(double))); }
  GradNormWorkspace(const GradNormWorkspace&) = delete;
  GradNormWorkspace& operator=(const GradNormWorkspace&) = delete;
  ~GradNormWorkspace() {
    if (p_) cudaFree(p_);
  }
  double* get() const { return p_; }

 private:
  double* p_ = nullptr;
};

namespace detail {

template <NormType N, class G, class Source>
__global__ void __launch_bounds__(kNormThreads) grad_norm_partial_kernel(const Source src, double* __restrict__ partials) {
  constexpr int Q = kNormQuads, T = kNormThreads;
  constexpr std::int64_t kTile = std::int64_t(T) * kQuad * Q;
  double acc = 0;
  for (std::int64_t chunk = blockIdx.x; chunk < src.chunks; chunk += gridDim.x) {
    std::int64_t local = 0;
    const Buffer<const G> b = src.locate(chunk, local);
    const std::int64_t begin = local * kChunkElems;
    const std::int64_t end = begin + kChunkElems < b.n ? begin + kChunkElems : b.n;
    std::int64_t scalar_begin = begin;
    if (quad_aligned(b.data)) {
      const std::int64_t vec_end = vector_end(begin, end, kTile);
      for (std::int64_t base = begin; base < vec_end; base += kTile) {
        float g[kQuad * Q];
        load_quads<Q>(b.data + quad_start(base, int(threadIdx.x), 0, T), T, g);
#pragma unroll
        for (int j = 0; j < kQuad * Q; ++j) acc = NormOp<N>::element(acc, g[j]);
      }
      scalar_begin = vec_end;
    }
    for (std::int64_t i = scalar_begin + threadIdx.x; i < end; i += T) acc = NormOp<N>::element(acc, to_float(b.data[i]));
  }
  using Reduce = cub::BlockReduce<double, kNormThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const double block = Reduce(tmp).Reduce(acc, NormOp<N>{});
  if (threadIdx.x == 0) partials[blockIdx.x] = block;
}

template <NormType N>
__global__ void __launch_bounds__(kNormThreads)
    grad_norm_final_kernel(const double* __restrict__ partials, int count, float max_norm, const float* inv_scale, GradNormOut out) {
  double acc = 0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc = NormOp<N>{}(acc, partials[i]);
  using Reduce = cub::BlockReduce<double, kNormThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const double total = Reduce(tmp).Reduce(acc, NormOp<N>{});
  if (threadIdx.x == 0) grad_norm_finalize(total, N, max_norm, inv_scale, out);
}

template <NormType N, class G, class Source>
cudaError_t grad_norm_launch(const Source& src, float max_norm, const float* inv_scale, const GradNormOut& out, double* workspace,
                             cudaStream_t stream) {
  const int blocks = int(src.chunks < kNormMaxBlocks ? src.chunks : kNormMaxBlocks);
  if (blocks > 0) grad_norm_partial_kernel<N, G><<<blocks, kNormThreads, 0, stream>>>(src, workspace);
  grad_norm_final_kernel<N><<<1, kNormThreads, 0, stream>>>(workspace, blocks, max_norm, inv_scale, out);
  return cudaGetLastError();
}

template <class G, class Source>
cudaError_t grad_norm_dispatch(const Source& src, NormType type, float max_norm, const float* inv_scale, const GradNormOut& out,
                               double* workspace, cudaStream_t stream) {
  check_max_norm(max_norm);
  check(workspace != nullptr, "grad_norm_cuda: workspace is null (use GradNormWorkspace)");
  if (type == NormType::L2) return grad_norm_launch<NormType::L2, G>(src, max_norm, inv_scale, out, workspace, stream);
  return grad_norm_launch<NormType::Inf, G>(src, max_norm, inv_scale, out, workspace, stream);
}

template <NormType N>  // a template so the header can be included by many .cu files
__global__ void grad_norm_finalize_kernel(const double* reduced, float max_norm, const float* inv_scale, GradNormOut out) {
  grad_norm_finalize(*reduced, N, max_norm, inv_scale, out);
}

}  // namespace detail

// From an accumulator already reduced on the device (a sum of squares over partitions and ranks, or a largest |g|) to
// norm / clip_coef / found_inf, as grad_norm_cuda's last kernel does. All pointers are device pointers.
inline cudaError_t grad_norm_finalize_cuda(const double* reduced, NormType type, float max_norm, const float* inv_scale,
                                           const GradNormOut& out, cudaStream_t stream = nullptr) {
  check_max_norm(max_norm);
  check(reduced != nullptr, "grad_norm_finalize_cuda: the accumulator is null");
  if (type == NormType::L2)
    detail::grad_norm_finalize_kernel<NormType::L2><<<1, 1, 0, stream>>>(reduced, max_norm, inv_scale, out);
  else
    detail::grad_norm_finalize_kernel<NormType::Inf><<<1, 1, 0, stream>>>(reduced, max_norm, inv_scale, out);
  return cudaGetLastError();
}

// Norm of one flat gradient buffer. inv_scale and out's pointers are device pointers (or null).
template <class G>
cudaError_t grad_norm_cuda(const Buffer<const G>& grad, NormType type, float max_norm, const float* inv_scale, const GradNormOut& out,
                           double* workspace, cudaStream_t stream = nullptr) {
  validate(grad, "grad_norm (CUDA)");
  return detail::grad_norm_dispatch<G>(FlatSource<Buffer<const G>>{grad, chunks_of(grad.n)}, type, max_norm, inv_scale, out, workspace,
                                       stream);
}

// Norm over a device table of gradient buffers (one pass over all of them).
template <class G>
cudaError_t grad_norm_cuda(const TensorTable<Buffer<const G>>& grads, NormType type, float max_norm, const float* inv_scale,
                           const GradNormOut& out, double* workspace, cudaStream_t stream = nullptr) {
  check(grads.count == 0 || (grads.entries != nullptr && grads.chunk_prefix != nullptr), "grad_norm (CUDA): table has null entries");
  return detail::grad_norm_dispatch<G>(TableSource<Buffer<const G>>{grads, grads.chunks}, type, max_norm, inv_scale, out, workspace,
                                       stream);
}

}  // namespace squeeze::kernels
