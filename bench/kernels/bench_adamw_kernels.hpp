#pragma once
// The CUDA half of bench_adamw: squeeze's AdamW launches behind a plain interface, so the torch side
// (bench_adamw.cpp, built by the host compiler) and the nvcc side (bench_adamw_kernels.cu) share no headers
// but this one.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "squeeze/kernels/adamw.hpp"

namespace squeeze::bench {

// One AdamW configuration over device buffers, ready to launch every step.
class AdamWLauncher {
 public:
  virtual ~AdamWLauncher() = default;
  // d: device pointers (inv_scale, found_inf, clip_coef, step) or all null.
  virtual cudaError_t run(const kernels::AdamWCoeffs& c, const kernels::AdamWDynamic& d, cudaStream_t stream) = 0;
};

// Buffers of n elements each, updated as one flat buffer (tensors == 1) or as `tensors` equal slices in
// one multi-tensor launch (the last slice takes the remainder).
std::unique_ptr<AdamWLauncher> make_fp32_adamw(float* param, const float* grad, float* m, float* v, std::int64_t n, int tensors);
std::unique_ptr<AdamWLauncher> make_bf16_mixed_adamw(bf16* param, float* master, const bf16* grad, float* m, float* v, std::int64_t n,
                                                     int tensors);
// The same with 8-bit state (kernels/adamw8.cuh): m, v uint8 codes [n], absmax [ceil(n / 256)] each; slices
// are whole 256-element blocks (the last takes the remainder). variant: one of adamw8_variants(), the kernel shape
// (adamw8_shapes.cuh's Shapes' names; adamw8_default_variant() is the one the library launches).
std::vector<std::string> adamw8_variants();
std::string adamw8_default_variant();
std::unique_ptr<AdamWLauncher> make_bf16_mixed_adamw8(const std::string& variant, bf16* param, float* master, const bf16* grad,
                                                      std::uint8_t* m, float* m_absmax, std::uint8_t* v, float* v_absmax, std::int64_t n,
                                                      int tensors);

}  // namespace squeeze::bench
