#pragma once
// CUDA side of dynamic loss scaling (math and CPU twin: loss_scale.hpp).
//   check_and_unscale_cuda(grads, found_inf, inv_scale, stream)   fused non-finite check + unscale, in place
//   DeviceLossScaler                                              state in device memory; update() is one
//                                                                 tiny kernel, no host sync
// Typical fp16 step, all on the stream: backward of loss * scale -> grad_norm_cuda(..., inv_scale,
// {.clip_coef, .found_inf}) -> adamw_cuda(..., {.inv_scale, .found_inf, .clip_coef}) -> scaler.update().
#include "squeeze/kernels/loss_scale.hpp"
#include "squeeze/kernels/tensor_list.cuh"
#include "squeeze/kernels/types.cuh"

namespace squeeze::kernels {

inline constexpr int kUnscaleThreads = 256;
inline constexpr int kUnscaleQuads = 2;
static_assert(kChunkElems % (kUnscaleThreads * kQuad * kUnscaleQuads) == 0);

namespace detail {

template <class G, class Source>
__global__ void __launch_bounds__(kUnscaleThreads)
    check_and_unscale_kernel(const Source src, float* found_inf, const float* inv_scale_ptr) {
  constexpr int Q = kUnscaleQuads, T = kUnscaleThreads;
  constexpr std::int64_t kTile = std::int64_t(T) * kQuad * Q;
  const float inv_scale = *inv_scale_ptr;
  bool bad = false;
  for (std::int64_t chunk = blockIdx.x; chunk < src.chunks; chunk += gridDim.x) {  // uniform per block
    std::int64_t local = 0;
    const Buffer<G> b = src.locate(chunk, local);
    const std::int64_t begin = local * kChunkElems;
    const std::int64_t end = begin + kChunkElems < b.n ? begin + kChunkElems : b.n;
    std::int64_t scalar_begin = begin;
    if (quad_aligned(b.data)) {
      const std::int64_t vec_end = vector_end(begin, end, kTile);
      for (std::int64_t base = begin; base < vec_end; base += kTile) {
        const std::int64_t i = quad_start(base, int(threadIdx.x), 0, T);
        float g[kQuad * Q];
        load_quads<Q>(b.data + i, T, g);
#pragma unroll
        for (int j = 0; j < kQuad * Q; ++j) g[j] = unscale_element(g[j], inv_scale, bad);
        store_quads<Q>(b.data + i, T, g);
      }
      scalar_begin = vec_end;
    }
    for (std::int64_t i = scalar_begin + threadIdx.x; i < end; i += T)
      b.data[i] = from_float<G>(unscale_element(to_float(b.data[i]), inv_scale, bad));
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;  // one write per block
}

template <class Int>  // a template so the header can be included by many .cu files
__global__ void loss_scale_update_kernel(LossScaleState* st, const LossScaleOptions o, Int) {
  loss_scale_update(*st, o);
}

}  // namespace detail

// Unscales one flat gradient buffer in place; sets *found_inf = 1 on inf/NaN (never clears it).
// found_inf and inv_scale are device pointers (e.g. DeviceLossScaler::found_inf()/inv_scale()).
template <class G>
cudaError_t check_and_unscale_cuda(const Buffer<G>& grad, float* found_inf, const float* inv_scale, cudaStream_t stream = nullptr) {
  validate(grad, "check_and_unscale (CUDA)");
  check(found_inf != nullptr && inv_scale != nullptr, "check_and_unscale (CUDA): found_inf / inv_scale device pointer is null");
  const std::int64_t chunks = chunks_of(grad.n);
  if (chunks == 0) return cudaSuccess;
  detail::check_and_unscale_kernel<G>
      <<<grid_for_chunks(chunks), kUnscaleThreads, 0, stream>>>(FlatSource<Buffer<G>>{grad, chunks}, found_inf, inv_scale);
  return cudaGetLastError();
}

// The same over a device table of gradient buffers, one launch.
template <class G>
cudaError_t check_and_unscale_cuda(const TensorTable<Buffer<G>>& grads, float* found_inf, const float* inv_scale,
                                   cudaStream_t stream = nullptr) {
  check(found_inf != nullptr && inv_scale != nullptr, "check_and_unscale (CUDA): found_inf / inv_scale device pointer is null");
  check(grads.count == 0 || (grads.entries != nullptr && grads.chunk_prefix != nullptr),
        "check_and_unscale (CUDA): table has null entries");
  if (grads.chunks == 0) return cudaSuccess;
  detail::check_and_unscale_kernel<G>
      <<<grid_for_chunks(grads.chunks), kUnscaleThreads, 0, stream>>>(TableSource<Buffer<G>>{grads, grads.chunks}, found_inf, inv_scale);
  return cudaGetLastError();
}

// Loss scaler whose state lives in device memory. Kernels read inv_scale() and write found_inf() directly;
// update() enqueues the scale update on the stream. Reading the scale back (state(), scale()) synchronises
// and throws squeeze::Error if an overflow hit the minimum scale with raise_at_min_scale.
class DeviceLossScaler {
 public:
  explicit DeviceLossScaler(const LossScaleOptions& o = {}, cudaStream_t stream = nullptr) : opt_(o) {
    const LossScaleState init = loss_scale_init(o);
    SQUEEZE_CUDA_CHECK(cudaMalloc(&st_, sizeof(LossScaleState)));
    SQUEEZE_CUDA_CHECK(cudaMemcpyAsync(st_, &init, sizeof init, cudaMemcpyHostToDevice, stream));
    SQUEEZE_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  DeviceLossScaler(const DeviceLossScaler&) = delete;
  DeviceLossScaler& operator=(const DeviceLossScaler&) = delete;
  ~DeviceLossScaler() {
    if (st_) cudaFree(st_);
  }

  float* found_inf() { return &st_->found_inf; }              // device pointer
  const float* inv_scale() const { return &st_->inv_scale; }  // device pointer
  const float* scale_ptr() const { return &st_->scale; }      // device pointer (multiply the loss by it)
  LossScaleState* device_state() { return st_; }
  const LossScaleOptions& options() const { return opt_; }

  // Enqueues the update (consumes and clears found_inf). No host sync.
  cudaError_t update(cudaStream_t stream = nullptr) {
    detail::loss_scale_update_kernel<<<1, 1, 0, stream>>>(st_, opt_, 0);
    return cudaGetLastError();
  }
  // Copies the state to the host (synchronises the stream); throws if the scaler hit its error condition.
  LossScaleState state(cudaStream_t stream = nullptr) const {
    LossScaleState h;
    SQUEEZE_CUDA_CHECK(cudaMemcpyAsync(&h, st_, sizeof h, cudaMemcpyDeviceToHost, stream));
    SQUEEZE_CUDA_CHECK(cudaStreamSynchronize(stream));
    check(h.error == 0, "loss scale: gradients overflowed while the loss scale sat at its minimum (" + std::to_string(opt_.min_scale) +
                            "); the run is diverging: lower the learning rate or check the data");
    return h;
  }
  float scale(cudaStream_t stream = nullptr) const { return state(stream).scale; }

 private:
  LossScaleOptions opt_;
  LossScaleState* st_ = nullptr;
};

}  // namespace squeeze::kernels
