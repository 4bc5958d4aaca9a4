#pragma once
// AdamW on the trainer's device partitions. Where the translation unit is compiled by nvcc, the CUDA kernels
// (adamw_device_update, adamw8_device_update: kernels/adamw.cuh and adamw8.cuh, bitwise the CPU twins): one pass of
// 28 bytes an element (bf16 param, fp32 master and moments) where torch ops make about a dozen passes. Elsewhere
// torch ops, the same math as kernels/adamw.hpp; 8-bit state (QuantizedState<8>: Adam's m and v as uint8 codes with
// one fp32 absmax per 256 values) with the same maps and nearest-code rule as kernels::adamw8_cpu.
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>

#include "squeeze/kernels/adamw.hpp"
#include "squeeze/kernels/adamw8.hpp"
#include "squeeze/engine/streams.hpp"

#if defined(__CUDACC__)
#include "squeeze/kernels/adamw.cuh"
#include "squeeze/kernels/adamw8.cuh"
#endif

namespace squeeze::engine {
namespace detail {

// Device work on a whole partition goes in chunks of this many elements, so its fp32/fp64 temporaries stay
// small (a 1 B-parameter stage-1 partition would otherwise need ~13 bytes per parameter of them).
inline constexpr int64_t kDeviceChunk = int64_t(1) << 24;

// One AdamW update in torch ops, for tensors our kernels cannot reach from a host-compiled TU (device buffers)
// or that need no kernel (the LLaMA example's local trainer): w, m, v fp32, g32 the fp32 gradient already
// multiplied by clip / loss scale. Same math as kernels::adamw_element.
inline void adamw_torch_ops(torch::Tensor& w, torch::Tensor& m, torch::Tensor& v, const torch::Tensor& g32, const kernels::AdamWCoeffs& c) {
  m.mul_(c.beta1).add_(g32, 1.0f - c.beta1);
  v.mul_(c.beta2).addcmul_(g32, g32, 1.0f - c.beta2);
  const torch::Tensor denom = v.sqrt().mul_(c.inv_sqrt_bc2).add_(c.eps);
  w.mul_(1.0f - c.lr * c.weight_decay).addcdiv_(m, denom, -c.step_size);
}

// 8-bit state (QuantizedState<8>) in torch ops, for device buffers in a host-compiled TU: the maps and
// the nearest-code rule of kernels/adamw8.hpp (torch::bucketize over the 255 midpoints counts those below x,
// which is nearest_code), block scales of kernels::kStateBlock elements.
struct StateMapTensors {
  torch::Tensor value, mid;  // [256], [255] fp32
};
inline StateMapTensors state_map_tensors(const kernels::StateCodeMap& map, torch::Device device) {
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  return {torch::from_blob(const_cast<float*>(map.value), {kernels::kStateCodes}, f32).to(device),
          torch::from_blob(const_cast<float*>(map.mid), {kernels::kStateCodes - 1}, f32).to(device)};
}
// codes [n] uint8, absmax [ceil(n / 256)] -> values [n] fp32
inline torch::Tensor decode_state(const torch::Tensor& codes, const torch::Tensor& absmax, const StateMapTensors& map) {
  return map.value.index_select(0, codes.to(torch::kInt64)) * absmax.repeat_interleave(kernels::kStateBlock).narrow(0, 0, codes.numel());
}
// values [n] fp32 -> codes [n] uint8 and absmax [ceil(n / 256)], written in place.
inline void encode_state(const torch::Tensor& x, torch::Tensor codes, torch::Tensor absmax, const StateMapTensors& map) {
  const int64_t n = x.numel(), blocks = absmax.numel();
  const torch::Tensor padded = torch::constant_pad_nd(x, {0, blocks * kernels::kStateBlock - n}).view({blocks, kernels::kStateBlock});
  const torch::Tensor a = padded.abs().amax(1);                                         // [blocks]
  const torch::Tensor inv = torch::where(a > 0, a.reciprocal(), torch::zeros_like(a));  // as kernels::inverse_absmax
  codes.copy_(torch::bucketize((padded * inv.unsqueeze(1)).view({-1}).narrow(0, 0, n), map.mid));
  absmax.copy_(a);
}

// The signed (m) and unsigned (v) maps on one device.
struct StateMaps {
  StateMapTensors m, v;
};
inline StateMaps state_maps(torch::Device device) {
  return {state_map_tensors(kernels::signed_state_map(), device), state_map_tensors(kernels::unsigned_state_map(), device)};
}
// One 8-bit AdamW update in torch ops: w [n] fp32 (updated in place), g32 [n] the fp32 gradient (clip and loss scale
// applied), m / v codes [n] uint8 with their absmax [state_blocks(n)] (blocks from element 0), decoded and re-encoded in
// place. The same maps and nearest-code rule as kernels::adamw8_cpu (Adam8Trainer.TorchOpsStatePathMatchesTheKernels).
inline void adamw8_torch_ops(torch::Tensor w, const torch::Tensor& g32, torch::Tensor m_codes, torch::Tensor m_absmax,
                             torch::Tensor v_codes, torch::Tensor v_absmax, const StateMaps& maps, const kernels::AdamWCoeffs& c) {
  torch::Tensor m = decode_state(m_codes, m_absmax, maps.m), v = decode_state(v_codes, v_absmax, maps.v);
  adamw_torch_ops(w, m, v, g32, c);
  encode_state(m, m_codes, m_absmax, maps.m);
  encode_state(v, v_codes, v_absmax, maps.v);
}

#if defined(__CUDACC__)
// One AdamW update of device buffers with fp32 moments by the CUDA kernel, on the device's current stream: param [n]
// (P) with its fp32 master [n] (undefined for float P), grad [n] (G), m and v [n] fp32; d's values are device pointers.
template <class P, class G>
inline void adamw_device_update(const torch::Tensor& param, const torch::Tensor& master, const torch::Tensor& grad, const torch::Tensor& m,
                                const torch::Tensor& v, const kernels::AdamWDynamic& d, const kernels::AdamWCoeffs& c) {
  const kernels::AdamWTensor<P, G> t{reinterpret_cast<P*>(param.data_ptr()),
                                     master.defined() ? master.data_ptr<float>() : nullptr,
                                     reinterpret_cast<const G*>(grad.data_ptr()),
                                     m.data_ptr<float>(),
                                     v.data_ptr<float>(),
                                     param.numel()};
  engine::launch_on_current_stream(param, "AdamW (CUDA)", [&](cudaStream_t s) { return kernels::adamw_cuda(t, c, d, s); });
}

// One 8-bit AdamW update of device buffers by the CUDA kernel, on the device's current stream: param [n] (P) with its
// fp32 master [n] (undefined for float P), grad [n] (G), m / v codes [n] with their absmax [state_blocks(n)] (blocks
// from element 0); d's values are device pointers.
template <class P, class G>
inline void adamw8_device_update(const torch::Tensor& param, const torch::Tensor& master, const torch::Tensor& grad,
                                 const torch::Tensor& m_codes, const torch::Tensor& m_absmax, const torch::Tensor& v_codes,
                                 const torch::Tensor& v_absmax, const kernels::AdamWDynamic& d, const kernels::AdamWCoeffs& c) {
  const kernels::AdamW8Tensor<P, G> t{reinterpret_cast<P*>(param.data_ptr()),
                                      master.defined() ? master.data_ptr<float>() : nullptr,
                                      reinterpret_cast<const G*>(grad.data_ptr()),
                                      m_codes.data_ptr<std::uint8_t>(),
                                      m_absmax.data_ptr<float>(),
                                      v_codes.data_ptr<std::uint8_t>(),
                                      v_absmax.data_ptr<float>(),
                                      param.numel()};
  engine::launch_on_current_stream(param, "8-bit AdamW (CUDA)", [&](cudaStream_t s) { return kernels::adamw8_cuda(t, c, d, s); });
}
#endif

}  // namespace detail
}  // namespace squeeze::engine
