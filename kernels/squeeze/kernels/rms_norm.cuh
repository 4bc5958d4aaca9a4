#pragma once
// CUDA launchers of the fused RMSNorm (math, functor and CPU twin: rms_norm.hpp).
//   rms_norm_forward_cuda(args, stream)                        one block per row (grid-stride over rows)
//   rms_norm_backward_workspace(rows, h)                       floats of device scratch backward needs for dweight
//   rms_norm_backward_cuda(args, workspace, stream)            dx per row; dweight by per-block fp32 partials
// Forward reduces max |y| into a.amax on request, backward max |dx| (block_amax_into: one atomic a block).
// Per row: pass 1 reads the row (vector loads of 4 elements when h % 4 == 0 and the pointers are aligned) and
// reduces sum(v^2) (forward) or sum(dy w v) (backward) with CUB's BlockReduce; pass 2 reads it again (L1/L2
// hits) and writes y or dx. Backward: each block accumulates dweight for its rows in shared memory (h floats),
// writes one partial row to the workspace, and a second kernel sums the partials column by column in block
// order: deterministic, no atomics. Bytes moved: forward 2 reads + 1 write of [rows, h] (3 with a residual,
// +1 write of the sum), backward 2 reads + 1 write (+1 read of dsum).
#include "squeeze/kernels/fused_common.cuh"
#include "squeeze/kernels/rms_norm.hpp"

namespace squeeze::kernels {

namespace detail {

template <class T>
bool rms_norm_vectorizable(std::int64_t h, std::initializer_list<const T*> ptrs) {
  if (h % kQuad != 0) return false;
  for (const T* p : ptrs)
    if (p != nullptr && !quad_aligned(p)) return false;
  return true;
}

template <class T, int Threads>
__global__ void __launch_bounds__(Threads) rms_norm_forward_kernel(const RmsNormForward<T> a, const bool vec) {
  using Op = RmsNormOp<float>;
  using Reduce = cub::BlockReduce<float, Threads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ float shared_r;
  const std::int64_t h = a.h, quads = h / kQuad;
  float m = 0;  // max |y| as stored, over this thread's elements (read only when a.amax is set)
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const std::int64_t base = r * h;
    const T* x = a.x + base;
    const T* res = a.residual ? a.residual + base : nullptr;
    T* sum = res ? a.sum + base : nullptr;
    float ss = 0;
    if (vec) {
      for (std::int64_t q = threadIdx.x; q < quads; q += Threads) {
        float v[kQuad];
        load4(x + q * kQuad, v);
        if (res) {
          float b[kQuad];
          load4(res + q * kQuad, b);
#pragma unroll
          for (int k = 0; k < kQuad; ++k) v[k] = round_acc<T>(v[k] + b[k]);
          store4(sum + q * kQuad, v);
        }
#pragma unroll
        for (int k = 0; k < kQuad; ++k) ss += v[k] * v[k];
      }
    } else {
      for (std::int64_t j = threadIdx.x; j < h; j += Threads) {
        const float v = rms_norm_input(x, res, j);
        if (res) sum[j] = store_acc<T>(v);
        ss += v * v;
      }
    }
    ss = Reduce(tmp).Sum(ss);
    if (threadIdx.x == 0) {
      const float rr = Op::rrms(ss, h, float(a.eps));
      shared_r = rr;
      if (a.rrms) a.rrms[r] = rr;
    }
    __syncthreads();
    const float rr = shared_r;
    const T* src = res ? sum : x;  // each thread reads back only the sum elements it wrote
    T* y = a.y + base;
    if (vec) {
      for (std::int64_t q = threadIdx.x; q < quads; q += Threads) {
        float v[kQuad], w[kQuad], out[kQuad];
        load4(src + q * kQuad, v);
        load4(a.weight + q * kQuad, w);
#pragma unroll
        for (int k = 0; k < kQuad; ++k) {
          out[k] = Op::y(v[k], rr, w[k]);
          m = amax_of(fabsf(round_acc<T>(out[k])), m);
        }
        store4(y + q * kQuad, out);
      }
    } else {
      for (std::int64_t j = threadIdx.x; j < h; j += Threads) {
        const T out = store_acc<T>(Op::y(load_acc(src[j]), rr, load_acc(a.weight[j])));
        y[j] = out;
        m = amax_of(fabsf(load_acc(out)), m);
      }
    }
    __syncthreads();  // tmp and shared_r are reused by the next row
  }
  if (a.amax != nullptr) block_amax_into<Threads>(m, a.amax);
}

template <class T, int Threads>
__global__ void __launch_bounds__(Threads) rms_norm_backward_kernel(const RmsNormBackward<T> a, const bool vec, float* partials) {
  using Op = RmsNormOp<float>;
  using Reduce = cub::BlockReduce<float, Threads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ float shared_c;
  extern __shared__ float4 dw4[];  // [h / 4] (vector path) or [h] floats: this block's dweight partial
  float* dw = reinterpret_cast<float*>(dw4);
  const bool want_dw = partials != nullptr;
  const std::int64_t h = a.h, quads = h / kQuad;
  float m = 0;  // max |dx| as stored, over this thread's elements (read only when a.amax is set)
  if (want_dw)
    for (std::int64_t j = threadIdx.x; j < h; j += Threads) dw[j] = 0.0f;
  __syncthreads();
  for (std::int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const std::int64_t base = r * h;
    const T* v_row = a.v + base;
    const T* dy_row = a.dy + base;
    const float rr = a.rrms[r];
    float dot = 0;
    if (vec) {
      for (std::int64_t q = threadIdx.x; q < quads; q += Threads) {
        float v[kQuad], dy[kQuad], w[kQuad];
        load4(v_row + q * kQuad, v);
        load4(dy_row + q * kQuad, dy);
        load4(a.weight + q * kQuad, w);
#pragma unroll
        for (int k = 0; k < kQuad; ++k) dot += dy[k] * w[k] * v[k];
      }
    } else {
      for (std::int64_t j = threadIdx.x; j < h; j += Threads) dot += load_acc(dy_row[j]) * load_acc(a.weight[j]) * load_acc(v_row[j]);
    }
    dot = Reduce(tmp).Sum(dot);
    if (threadIdx.x == 0) shared_c = Op::coef(dot, rr, h);
    __syncthreads();
    const float c = shared_c;
    T* dx_row = a.dx + base;
    const T* ds_row = a.dsum ? a.dsum + base : nullptr;
    if (vec) {
      for (std::int64_t q = threadIdx.x; q < quads; q += Threads) {
        float v[kQuad], dy[kQuad], w[kQuad], dx[kQuad];
        load4(v_row + q * kQuad, v);
        load4(dy_row + q * kQuad, dy);
        load4(a.weight + q * kQuad, w);
#pragma unroll
        for (int k = 0; k < kQuad; ++k) dx[k] = Op::dx(v[k], dy[k] * w[k], rr, c);
        if (ds_row) {
          float ds[kQuad];
          load4(ds_row + q * kQuad, ds);
#pragma unroll
          for (int k = 0; k < kQuad; ++k) dx[k] += ds[k];
        }
#pragma unroll
        for (int k = 0; k < kQuad; ++k) m = amax_of(fabsf(round_acc<T>(dx[k])), m);
        store4(dx_row + q * kQuad, dx);
        if (want_dw) {
          float4 p = dw4[q];
          p.x += Op::dweight(dy[0], v[0], rr);
          p.y += Op::dweight(dy[1], v[1], rr);
          p.z += Op::dweight(dy[2], v[2], rr);
          p.w += Op::dweight(dy[3], v[3], rr);
          dw4[q] = p;
        }
      }
    } else {
      for (std::int64_t j = threadIdx.x; j < h; j += Threads) {
        const float dy = load_acc(dy_row[j]), v = load_acc(v_row[j]);
        float dx = Op::dx(v, dy * load_acc(a.weight[j]), rr, c);
        if (ds_row) dx += load_acc(ds_row[j]);
        dx_row[j] = store_acc<T>(dx);
        m = amax_of(fabsf(round_acc<T>(dx)), m);
        if (want_dw) dw[j] += Op::dweight(dy, v, rr);
      }
    }
    __syncthreads();  // tmp and shared_c are reused by the next row
  }
  if (want_dw)
    for (std::int64_t j = threadIdx.x; j < h; j += Threads) partials[std::int64_t(blockIdx.x) * h + j] = dw[j];
  if (a.amax != nullptr) block_amax_into<Threads>(m, a.amax);
}

// dweight[j] = sum over blocks b (in order) of partials[b, j].
template <class Int>
__global__ void rms_norm_dweight_kernel(const float* __restrict__ partials, Int blocks, std::int64_t h, float* __restrict__ dweight) {
  const std::int64_t j = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= h) return;
  float s = 0;
  for (Int b = 0; b < blocks; ++b) s += partials[std::int64_t(b) * h + j];
  dweight[j] = s;
}

// Blocks of the backward launch: as many as fit on the device at once (shared memory decides for wide rows),
// at most one per row.
template <class T, int Threads>
cudaError_t rms_norm_backward_blocks(std::int64_t rows, std::int64_t h, bool want_dw, int& blocks, std::size_t& smem) {
  smem = want_dw ? std::size_t(h) * sizeof(float) : 0;
  int dev = 0, optin = 0, sms = 0;
  if (const cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev); e != cudaSuccess) return e;
  check(smem + 1024 <= std::size_t(optin), "rms_norm backward (CUDA): hidden " + std::to_string(h) + " needs " + std::to_string(smem) +
                                               " bytes of shared memory for the dweight partial; this device allows " +
                                               std::to_string(optin) + " per block (use the CPU twin or the unfused RMSNorm)");
  auto kernel = rms_norm_backward_kernel<T, Threads>;
  if (smem > 48 * 1024)
    if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)); e != cudaSuccess)
      return e;
  int per_sm = 0;
  if (const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Threads, smem); e != cudaSuccess) return e;
  if (const cudaError_t e = sm_count(sms); e != cudaSuccess) return e;
  const std::int64_t cap = std::int64_t(sms) * (per_sm > 0 ? per_sm : 1);
  blocks = int(rows < cap ? (rows > 0 ? rows : 1) : cap);
  return cudaSuccess;
}

template <class Fn>
cudaError_t rms_norm_threads(std::int64_t h, Fn&& fn) {
  if (fused_row_threads(h) == 128) return fn.template operator()<128>();
  return fn.template operator()<256>();
}

}  // namespace detail

// All pointers are device pointers. Returns the launch status.
template <FloatingElement T>
cudaError_t rms_norm_forward_cuda(const RmsNormForward<T>& a, cudaStream_t stream = nullptr) {
  validate(a, "rms_norm forward (CUDA)");
  if (a.amax != nullptr)
    if (const cudaError_t e = cudaMemsetAsync(a.amax, 0, sizeof(float), stream); e != cudaSuccess) return e;
  if (a.rows == 0) return cudaSuccess;
  const bool vec = detail::rms_norm_vectorizable<T>(a.h, {a.x, a.residual, a.weight, a.y, a.sum});
  const std::int64_t grid = a.rows < (std::int64_t(1) << 30) ? a.rows : (std::int64_t(1) << 30);
  return detail::rms_norm_threads(a.h, [&]<int Threads>() {
    detail::rms_norm_forward_kernel<T, Threads><<<unsigned(grid), Threads, 0, stream>>>(a, vec);
    return cudaGetLastError();
  });
}

// Floats of device workspace rms_norm_backward_cuda needs (0 without dweight). Depends on the device: query it there.
template <FloatingElement T>
std::int64_t rms_norm_backward_workspace(std::int64_t rows, std::int64_t h, bool want_dweight = true) {
  if (!want_dweight || rows == 0) return 0;
  std::int64_t n = 0;
  SQUEEZE_CUDA_CHECK(detail::rms_norm_threads(h, [&]<int Threads>() {
    int blocks = 0;
    std::size_t smem = 0;
    const cudaError_t e = detail::rms_norm_backward_blocks<T, Threads>(rows, h, true, blocks, smem);
    n = std::int64_t(blocks) * h;
    return e;
  }));
  return n;
}

// workspace: rms_norm_backward_workspace(rows, h) floats (device), or null without dweight. a.dweight is fp32 [h].
template <FloatingElement T>
cudaError_t rms_norm_backward_cuda(const RmsNormBackward<T>& a, float* workspace, cudaStream_t stream = nullptr) {
  validate(a, "rms_norm backward (CUDA)");
  if (a.amax != nullptr)
    if (const cudaError_t e = cudaMemsetAsync(a.amax, 0, sizeof(float), stream); e != cudaSuccess) return e;
  const bool want_dw = a.dweight != nullptr;
  check(!want_dw || workspace != nullptr, "rms_norm backward (CUDA): dweight needs the workspace (rms_norm_backward_workspace floats)");
  if (a.rows == 0) {
    if (want_dw) return cudaMemsetAsync(a.dweight, 0, std::size_t(a.h) * sizeof(float), stream);
    return cudaSuccess;
  }
  const bool vec = detail::rms_norm_vectorizable<T>(a.h, {a.v, a.weight, a.dy, a.dsum, a.dx});
  return detail::rms_norm_threads(a.h, [&]<int Threads>() {
    int blocks = 0;
    std::size_t smem = 0;
    if (const cudaError_t e = detail::rms_norm_backward_blocks<T, Threads>(a.rows, a.h, want_dw, blocks, smem); e != cudaSuccess) return e;
    detail::rms_norm_backward_kernel<T, Threads><<<blocks, Threads, smem, stream>>>(a, vec, want_dw ? workspace : nullptr);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess || !want_dw) return e;
    const int t = 256;
    detail::rms_norm_dweight_kernel<int><<<unsigned((a.h + t - 1) / t), t, 0, stream>>>(workspace, blocks, a.h, a.dweight);
    return cudaGetLastError();
  });
}

}  // namespace squeeze::kernels
