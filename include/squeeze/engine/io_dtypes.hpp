#pragma once
// The one map between torch's ScalarType and safetensors' DType, for the headers that write or read files with
// libtorch tensors (train/checkpoint.hpp, nn/hf_llama.hpp). Apart from torch_types.hpp so that the trainer does not
// need the JSON library io/safetensors.hpp uses.
#include <torch/torch.h>

#include <string>

#include "squeeze/io/safetensors.hpp"

namespace squeeze::engine {

// torch's ScalarType <-> safetensors' DType (checkpoints, Hugging Face files).
inline io::DType io_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32:
      return io::DType::F32;
    case torch::kBFloat16:
      return io::DType::BF16;
    case torch::kFloat16:
      return io::DType::F16;
    case torch::kFloat64:
      return io::DType::F64;
    case torch::kUInt8:
      return io::DType::U8;
    case torch::kInt8:
      return io::DType::I8;
    case torch::kInt32:
      return io::DType::I32;
    case torch::kInt64:
      return io::DType::I64;
    case torch::kBool:
      return io::DType::BOOL;
    default:
      TORCH_CHECK(false, "no safetensors dtype for ", t);
  }
}
inline torch::ScalarType scalar_type(io::DType d) {
  switch (d) {
    case io::DType::F32:
      return torch::kFloat32;
    case io::DType::BF16:
      return torch::kBFloat16;
    case io::DType::F16:
      return torch::kFloat16;
    case io::DType::F64:
      return torch::kFloat64;
    case io::DType::U8:
      return torch::kUInt8;
    case io::DType::I8:
      return torch::kInt8;
    case io::DType::I32:
      return torch::kInt32;
    case io::DType::I64:
      return torch::kInt64;
    case io::DType::BOOL:
      return torch::kBool;
    default:
      TORCH_CHECK(false, "safetensors dtype ", std::string(io::dtype_name(d)), " has no torch type here");
  }
}

}  // namespace squeeze::engine
