#pragma once
// What the CUDA benchmarks share (torch-free host code, for g++ or nvcc): the median of a sample, CUDA-event timing of
// work on a stream, and the device-to-device copy bandwidth that is their roofline.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "squeeze/error.hpp"

namespace squeeze::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? -1 : v[v.size() / 2];
}

struct Events {
  cudaEvent_t a{}, b{};
  Events() {
    SQUEEZE_CUDA_CHECK(cudaEventCreate(&a));
    SQUEEZE_CUDA_CHECK(cudaEventCreate(&b));
  }
  ~Events() { cudaEventDestroy(a), cudaEventDestroy(b); }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  // Milliseconds of f's work on `stream`.
  template <class F>
  double time(F&& f, cudaStream_t stream = nullptr) {
    SQUEEZE_CUDA_CHECK(cudaEventRecord(a, stream));
    f();
    SQUEEZE_CUDA_CHECK(cudaEventRecord(b, stream));
    SQUEEZE_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    SQUEEZE_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms;
  }
};

// Device-to-device cudaMemcpy bandwidth of `bytes` (read + write bytes per second, GB/s): median of 10 copies after 2.
inline double copy_GBps(std::int64_t bytes, cudaStream_t stream = nullptr) {
  void *src = nullptr, *dst = nullptr;
  SQUEEZE_CUDA_CHECK(cudaMalloc(&src, size_t(bytes)));
  SQUEEZE_CUDA_CHECK(cudaMalloc(&dst, size_t(bytes)));
  SQUEEZE_CUDA_CHECK(cudaMemset(src, 1, size_t(bytes)));
  Events ev;
  std::vector<double> ms;
  for (int i = 0; i < 12; ++i) {
    const double t = ev.time([&] { SQUEEZE_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDeviceToDevice, stream)); }, stream);
    if (i >= 2) ms.push_back(t);
  }
  cudaFree(src), cudaFree(dst);
  return 2.0 * double(bytes) / (median(ms) * 1e-3) / 1e9;
}

}  // namespace squeeze::bench
