#pragma once
// Test support for the raw-CUDA tests (nvcc TUs; tests/quant, tests/kernels): skip without a device, and a device buffer that
// uploads from and downloads to a std::vector.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include <cuda_runtime.h>
#include <squeeze/error.hpp>

namespace squeeze::test {

inline bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// T[n] in device memory (at least one element is allocated, so empty buffers still have an address).
template <class T>
struct Dev {
  T* p = nullptr;
  std::size_t n = 0;
  explicit Dev(std::size_t count) : n(count) { SQUEEZE_CUDA_CHECK(cudaMalloc(&p, std::max<std::size_t>(1, n) * sizeof(T))); }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) {
    if (n) SQUEEZE_CUDA_CHECK(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  std::vector<T> get() const {
    std::vector<T> h(n);
    if (n) SQUEEZE_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

}  // namespace squeeze::test

#define REQUIRE_DEVICE() \
  if (!::squeeze::test::have_device()) GTEST_SKIP() << "no CUDA device"
