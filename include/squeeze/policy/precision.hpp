#pragma once
// Mixed precision: forward/backward in Compute, optimizer update on Master weights.
// Precision<half, float> needs dynamic loss scaling (fp16 underflows small gradients);
// bf16 has float's exponent range and needs none.
#include <concepts>
#include <initializer_list>
#include <type_traits>

#include "squeeze/dtype.hpp"
#include "squeeze/policy/family.hpp"

namespace squeeze {

// The linears' GEMMs in FP8 (Hopper-class tensor cores): Precision<fp8, bf16, float> computes each block linear's
// forward and backward GEMMs on e4m3 inputs (gradients e5m2) with tensor-wise scales taken from the values at hand
// ("current scaling"), storing everything else in bf16 with fp32 masters (nn/fp8_linear.hpp).
struct fp8 {};

// FP8 tensor cores start at compute capability 8.9 (Ada; Hopper is 9.0). nvcc lists a translation unit's targets in
// __CUDA_ARCH_LIST__ (e.g. 800,900): a unit that targets none of 8.9 and above cannot run FP8 GEMMs.
constexpr bool any_fp8_target(std::initializer_list<int> archs) {
  for (int a : archs)
    if (a >= 890) return true;
  return false;
}

template <class Compute, class Master = float, class Third = void>
struct Precision {
  static_assert(FloatingElement<Compute>,
                "Precision's compute type must be float, squeeze::half or squeeze::bf16: write e.g. Precision<bf16, float>");
  static_assert(FloatingElement<Master>,
                "Precision's master type must be float, squeeze::half or squeeze::bf16: write e.g. Precision<half, float>");
  static_assert(sizeof(Master) >= sizeof(Compute),
                "master weights must be at least as precise as the compute copy: write Precision<half, float> or Precision<bf16, float>");
  static_assert(!(std::is_same_v<Compute, half> && std::is_same_v<Master, bf16>)&&!(std::is_same_v<Compute, bf16> &&
                                                                                    std::is_same_v<Master, half>),
                "half and bf16 do not hold each other's values: keep master weights in float, e.g. Precision<half, float>");
  using family = precision_family;
  using compute_type = Compute;
  using master_type = Master;
  // A separate master copy exists only when it differs from the compute copy.
  static constexpr bool has_master_copy = !std::is_same_v<Compute, Master>;
  static constexpr bool needs_loss_scaling = std::is_same_v<Compute, half>;
  static constexpr bool fp8_gemms = false;
  static_assert(std::is_void_v<Third>, "Precision takes a third type only after fp8: write Precision<fp8, bf16, float>");
};

// Precision<fp8, Compute, Master>: Precision<Compute, Master> whose block linears multiply in FP8.
template <class Compute, class Master>
struct Precision<fp8, Compute, Master> : Precision<Compute, Master> {
  static_assert(std::is_same_v<Compute, bf16> && std::is_same_v<Master, float>,
                "FP8 GEMMs keep bf16 activations and fp32 masters: write Precision<fp8, bf16, float>");
  static constexpr bool fp8_gemms = true;
#if defined(__CUDA_ARCH_LIST__)  // an nvcc TU; a host compiler's is checked when the GEMM runs (nn::fp8_mm)
  static_assert(
      any_fp8_target({__CUDA_ARCH_LIST__}),
      "Precision<fp8, bf16, float> multiplies on FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper), and this "
      "nvcc translation unit targets none: build for sm_89 or sm_90 (CMAKE_CUDA_ARCHITECTURES 90), or write Precision<bf16, float>");
#endif
};
template <class Compute>
struct Precision<fp8, Compute, void> {
  static_assert(sizeof(Compute) == 0, "FP8 GEMMs need a storage and a master type: write Precision<fp8, bf16, float>");
};

template <class P>
concept PrecisionPolicy = PolicyOf<P, precision_family> && requires {
  typename P::compute_type;
  typename P::master_type;
  { P::fp8_gemms } -> std::convertible_to<bool>;
};
static_assert(PrecisionPolicy<Precision<bf16, float>>);

}  // namespace squeeze
