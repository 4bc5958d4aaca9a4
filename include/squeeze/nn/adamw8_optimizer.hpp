#pragma once
// 8-bit AdamW state (Quantized<8, Blockwise8>: Adam's m and v as uint8 codes with one fp32 absmax per 256 values,
// kernels/adamw8.hpp) in libtorch, two users:
//  - detail::adamw8_torch_ops, the update in torch ops for device buffers in a host-compiled TU (no kernel launch):
//    nn::Trainer's device partitions and nn::AdamW8's device parameters;
//  - nn::AdamW8, a torch::optim::Optimizer over fp32 parameters (LoraTrainer's adapters under
//    Quantized<8, Blockwise8>): kernels::adamw8_cpu on host parameters, adamw8_torch_ops on device ones. Its options
//    are torch::optim::AdamWOptions (the learning rate is set through param_groups() as for torch::optim::AdamW);
//    save / load write and read each parameter's step, codes and scales.
// State blocks start at each parameter's first element (the planner counts blocks over all trainable values
// together: the same count whenever each adapter's size is a multiple of 256, as a LLaMA's are).
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "squeeze/kernels/adamw.hpp"
#include "squeeze/kernels/adamw8.hpp"

namespace squeeze::nn {
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

// 8-bit state (Quantized<8, Blockwise8>) in torch ops, for device buffers in a host-compiled TU: the maps and
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
  return map.value.index_select(0, codes.to(torch::kInt64)) *
         absmax.repeat_interleave(kernels::kStateBlock).narrow(0, 0, codes.numel());
}
// values [n] fp32 -> codes [n] uint8 and absmax [ceil(n / 256)], written in place.
inline void encode_state(const torch::Tensor& x, torch::Tensor codes, torch::Tensor absmax, const StateMapTensors& map) {
  const int64_t n = x.numel(), blocks = absmax.numel();
  const torch::Tensor padded = torch::constant_pad_nd(x, {0, blocks * kernels::kStateBlock - n}).view({blocks, kernels::kStateBlock});
  const torch::Tensor a = padded.abs().amax(1);                                     // [blocks]
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
inline void adamw8_torch_ops(torch::Tensor w, const torch::Tensor& g32, torch::Tensor m_codes, torch::Tensor m_absmax, torch::Tensor v_codes,
                             torch::Tensor v_absmax, const StateMaps& maps, const kernels::AdamWCoeffs& c) {
  torch::Tensor m = decode_state(m_codes, m_absmax, maps.m), v = decode_state(v_codes, v_absmax, maps.v);
  adamw_torch_ops(w, m, v, g32, c);
  encode_state(m, m_codes, m_absmax, maps.m);
  encode_state(v, v_codes, v_absmax, maps.v);
}

}  // namespace detail

// One parameter's 8-bit moments and its step count (steps taken: bias correction uses it).
struct AdamW8ParamState : torch::optim::OptimizerCloneableParamState<AdamW8ParamState> {
  int64_t step = 0;
  torch::Tensor m, m_absmax, v, v_absmax;  // uint8 [n], fp32 [state_blocks(n)], uint8 [n], fp32 [state_blocks(n)]

  void serialize(torch::serialize::OutputArchive& archive) const override {
    archive.write("step", c10::IValue(step));
    archive.write("m", m);
    archive.write("m_absmax", m_absmax);
    archive.write("v", v);
    archive.write("v_absmax", v_absmax);
  }
  void serialize(torch::serialize::InputArchive& archive) override {
    c10::IValue s;
    archive.read("step", s);
    step = s.toInt();
    archive.read("m", m);
    archive.read("m_absmax", m_absmax);
    archive.read("v", v);
    archive.read("v_absmax", v_absmax);
  }
};

// AdamW (decoupled weight decay, bias-corrected, as torch::optim::AdamW) over fp32 parameters with 8-bit moments.
class AdamW8 : public torch::optim::Optimizer {
 public:
  explicit AdamW8(const std::vector<torch::optim::OptimizerParamGroup>& groups, torch::optim::AdamWOptions defaults = {})
      : Optimizer(groups, std::make_unique<torch::optim::AdamWOptions>(defaults)) {
    TORCH_CHECK(!defaults.amsgrad(), "AdamW8: amsgrad is not supported (the 8-bit state keeps m and v only)");
    for (const auto& g : param_groups_)
      for (const auto& p : g.params())
        TORCH_CHECK(p.scalar_type() == torch::kFloat32, "AdamW8: a parameter is ", p.scalar_type(),
                    "; the 8-bit state updates fp32 parameters (LoRA adapters are fp32)");
    // the coefficients' checks (lr, betas, eps, weight decay) now, not at the first step
    (void)coeffs(defaults, 1);
  }
  explicit AdamW8(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults = {})
      : AdamW8(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))}, defaults) {}

  torch::Tensor step(LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure != nullptr) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    for (auto& group : param_groups_) {
      const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
      TORCH_CHECK(!o.amsgrad(), "AdamW8: amsgrad is not supported (the 8-bit state keeps m and v only)");
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        TORCH_CHECK(p.scalar_type() == torch::kFloat32 && p.is_contiguous(), "AdamW8: parameters must stay contiguous fp32");
        AdamW8ParamState& st = state_for(p);
        const kernels::AdamWCoeffs c = coeffs(o, ++st.step);
        const int64_t n = p.numel();
        if (p.is_cpu()) {
          const torch::Tensor g = p.grad().to(torch::kFloat32).contiguous();
          kernels::adamw8_cpu(kernels::AdamW8Tensor<float, float>{p.data_ptr<float>(), nullptr, g.data_ptr<float>(), st.m.data_ptr<std::uint8_t>(),
                                                                  st.m_absmax.data_ptr<float>(), st.v.data_ptr<std::uint8_t>(),
                                                                  st.v_absmax.data_ptr<float>(), n},
                              c);
          p.unsafeGetTensorImpl()->bump_version();  // written through its pointer: as an in-place op would, for autograd's checks
        } else {
          if (!maps_.m.value.defined() || maps_.m.value.device() != p.device()) maps_ = detail::state_maps(p.device());
          const torch::Tensor w = p.view({-1}), g = p.grad().reshape({-1});
          // chunks of whole state blocks (kDeviceChunk is a multiple of 256): the same bits as one piece
          for (int64_t off = 0; off < n; off += detail::kDeviceChunk) {
            const int64_t len = std::min(detail::kDeviceChunk, n - off), b0 = off / kernels::kStateBlock, blocks = kernels::state_blocks(len);
            detail::adamw8_torch_ops(w.narrow(0, off, len), g.narrow(0, off, len).to(torch::kFloat32), st.m.narrow(0, off, len),
                                     st.m_absmax.narrow(0, b0, blocks), st.v.narrow(0, off, len), st.v_absmax.narrow(0, b0, blocks), maps_, c);
          }
        }
      }
    }
    return loss;
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<AdamW8ParamState, torch::optim::AdamWOptions>(archive, *this);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::serialize<AdamW8ParamState, torch::optim::AdamWOptions>(archive, *this);
    for (auto& g : param_groups_)
      for (auto& p : g.params())
        if (state_.count(p.unsafeGetTensorImpl())) (void)state_for(p);  // checked and moved to the parameter's device now
  }

  // Bytes of 8-bit state held (codes and scales), for the memory report.
  int64_t state_bytes() const {
    int64_t bytes = 0;
    for (const auto& [key, s] : state_) {
      const auto& st = static_cast<const AdamW8ParamState&>(*s);
      bytes += int64_t(st.m.nbytes() + st.m_absmax.nbytes() + st.v.nbytes() + st.v_absmax.nbytes());
    }
    return bytes;
  }

 private:
  static kernels::AdamWCoeffs coeffs(const torch::optim::AdamWOptions& o, int64_t step) {
    return kernels::adamw_coeffs(float(o.lr()), float(std::get<0>(o.betas())), float(std::get<1>(o.betas())), float(o.eps()),
                                 float(o.weight_decay()), step);
  }
  // p's state: created (zero moments) on its first step; a loaded one checked against p and moved to p's device.
  AdamW8ParamState& state_for(const torch::Tensor& p) {
    const int64_t n = p.numel(), blocks = kernels::state_blocks(n);
    auto it = state_.find(p.unsafeGetTensorImpl());
    if (it == state_.end()) {
      auto s = std::make_unique<AdamW8ParamState>();
      const auto u8 = torch::TensorOptions().dtype(torch::kUInt8).device(p.device());
      const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(p.device());
      s->m = torch::zeros({n}, u8), s->v = torch::zeros({n}, u8);
      s->m_absmax = torch::zeros({blocks}, f32), s->v_absmax = torch::zeros({blocks}, f32);
      it = state_.emplace(p.unsafeGetTensorImpl(), std::move(s)).first;
    }
    auto& st = static_cast<AdamW8ParamState&>(*it->second);
    const auto shaped = [&](const torch::Tensor& t, int64_t size, torch::ScalarType type) {
      return t.defined() && t.dim() == 1 && t.numel() == size && t.scalar_type() == type;
    };
    TORCH_CHECK(shaped(st.m, n, torch::kUInt8) && shaped(st.v, n, torch::kUInt8) && shaped(st.m_absmax, blocks, torch::kFloat32) &&
                    shaped(st.v_absmax, blocks, torch::kFloat32) && st.step >= 0,
                "AdamW8: the state of a parameter of ", n, " values is not ", n, " uint8 codes and ", blocks,
                " fp32 scales per moment (a state dict of another model or optimizer?)");
    if (st.m.device() != p.device()) {
      st.m = st.m.to(p.device()), st.v = st.v.to(p.device());
      st.m_absmax = st.m_absmax.to(p.device()), st.v_absmax = st.v_absmax.to(p.device());
    }
    return st;
  }

  detail::StateMaps maps_;
};

}  // namespace squeeze::nn
