#pragma once
// The one map between squeeze's element types, torch's ScalarType and the communicator's DType.
#include <torch/torch.h>

#include <type_traits>

#include "squeeze/comm/communicator.hpp"
#include "squeeze/dtype.hpp"

namespace squeeze {

// float, bf16, half -> torch's ScalarType.
template <class T>
constexpr torch::ScalarType torch_dtype() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, half>,
                "torch_dtype<T>: T must be float, squeeze::bf16 or squeeze::half");
  if constexpr (std::is_same_v<T, float>)
    return torch::kFloat32;
  else if constexpr (std::is_same_v<T, bf16>)
    return torch::kBFloat16;
  else
    return torch::kHalf;
}

namespace engine {

inline comm::DType comm_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32:
      return comm::DType::f32;
    case torch::kFloat16:
      return comm::DType::f16;
    case torch::kBFloat16:
      return comm::DType::bf16;
    case torch::kFloat64:
      return comm::DType::f64;
    case torch::kInt32:
      return comm::DType::i32;
    case torch::kInt64:
      return comm::DType::i64;
    case torch::kUInt8:
      return comm::DType::u8;
    default:
      TORCH_CHECK(false, "squeeze comm: unsupported dtype ", t);
  }
}

}  // namespace engine
}  // namespace squeeze
