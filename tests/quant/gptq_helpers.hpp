#pragma once
// Shared by the GPTQ tests (test_gptq.cpp on the CPU, test_gptq_torch_cuda.cu on the GPU): correlated calibration inputs,
// a layer's output error in float64, and the weights RTN and a packed layer stand for.
#include <torch/torch.h>

#include <squeeze/quant/pack.hpp>
#include <squeeze/quant/rtn.hpp>

namespace squeeze::test {

// Correlated calibration inputs X [n, in] (float64): X = Z A, A = I + low-rank mixing, plus per-feature scales spanning 10x.
inline torch::Tensor correlated_inputs(std::int64_t n, std::int64_t in, int seed) {
  torch::manual_seed(seed);
  auto Z = torch::randn({n, in}, torch::kFloat64);
  auto U = torch::randn({in, 8}, torch::kFloat64);
  auto A = torch::eye(in, torch::kFloat64) + U.matmul(U.t()) * 0.3;
  auto s = torch::logspace(0, 1, in, 10.0, torch::kFloat64);
  return Z.matmul(A) * s;
}
// || X W^T - X Wq^T || in float64 on the CPU (W, Wq on any device)
inline double output_error(const torch::Tensor& X, const torch::Tensor& W, const torch::Tensor& Wq) {
  const auto w = W.to(torch::kCPU, torch::kFloat64), q = Wq.to(torch::kCPU, torch::kFloat64);
  return (X.matmul(w.t()) - X.matmul(q.t())).norm().item<double>();
}
// The float weights a packed layer stands for, [out, in].
inline torch::Tensor packed_dequant(const quant::PackedLinear& p) {
  const auto d = quant::dequantize(p);
  return torch::from_blob(const_cast<float*>(d.data()), {p.out, p.in}, torch::kFloat32).clone();
}
// W quantized by the torch-free RTN, as floats.
inline torch::Tensor rtn_dequant(const torch::Tensor& W, int bits, int group, bool sym) {
  auto w = W.to(torch::kCPU, torch::kFloat32).contiguous();
  return packed_dequant(quant::rtn_quantize({w.data_ptr<float>(), std::size_t(w.numel())}, w.size(0), w.size(1),
                                            {.bits = bits, .group_size = group, .sym = sym}));
}

}  // namespace squeeze::test
