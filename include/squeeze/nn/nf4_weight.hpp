#pragma once
// A frozen [out, in] weight packed as NF4, as torch buffers (layout: kernels/quant/nf4.hpp; DoubleQuant is
// bitsandbytes' nested form), and the matmul that dequantises it in forward and again in backward.
// Under Offload<Host, Streamed> the buffers live in a unit of host memory (engine/frozen_units.hpp) and come to the
// device when the weight is used: dequantize() acquires its unit first.
// CUDA: dequantising on the GPU needs this header in a .cu translation unit (nvcc); elsewhere a clear error.
#include <torch/torch.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "squeeze/engine/frozen_units.hpp"
#include "squeeze/quant/bnb_dynamic_map.hpp"
#include "squeeze/quant/nf4.hpp"
#include "squeeze/kernels/quant/nf4.hpp"
#if defined(__CUDACC__)
#include "squeeze/kernels/quant/nf4.cuh"
#endif

namespace squeeze::nn {

// ---- NF4 weight as torch buffers -------------------------------------------------------------------------------
// Layout: kernels/quant/nf4.hpp (DoubleQuant is bitsandbytes' nested form); the DoubleQuant tensors are empty
// for a plain weight, absmax is empty under DoubleQuant.
struct Nf4Weight {
  torch::Tensor codes;          // uint8 [ceil(out*in/2)]
  torch::Tensor absmax;         // float [blocks]               (plain)
  torch::Tensor absmax_code;    // uint8 [blocks]               (DoubleQuant)
  torch::Tensor nested_absmax;  // float [ceil(blocks/256)]     (DoubleQuant)
  torch::Tensor nested_map;     // float [256]                  (DoubleQuant)
  torch::Tensor absmax_offset;  // float [1]                    (DoubleQuant)
  int64_t out = 0, in = 0;
  int block = 64;
  bool double_quant = false;
  // Offload<Host, Streamed>: the unit of host memory that holds these buffers (null: they stay where they are).
  std::shared_ptr<engine::FrozenUnits> home;
  int home_unit = -1;
  // Dequantisations so far: a pass that needs W makes one (forward, recomputation, backward's input gradient), so the
  // count shows work run twice or dropped, which no numeric result does. Not synchronised: one pass at a time uses W.
  mutable int64_t dequantizations = 0;

  // The buffers, in the order a unit of host memory holds them.
  std::vector<torch::Tensor> buffers() const { return {codes, absmax, absmax_code, nested_absmax, nested_map, absmax_offset}; }
  // On the device where the weight is used: its unit's slot once acquired.
  void acquire() const {
    if (home) home->acquire(home_unit);
  }

  // Packs w [out, in] (float/bf16/half). CPU tensors, and CUDA tensors in a TU not compiled by nvcc, are packed
  // by the CPU twin (buffers go back to w's device); CUDA tensors in an nvcc TU are packed on the GPU.
  static Nf4Weight quantize(const torch::Tensor& w, const quant::Nf4Options& o) {
    TORCH_CHECK(w.dim() == 2, "Nf4Weight: weight must be [out, in], got ", w.sizes());
    TORCH_CHECK(w.numel() > 0, "Nf4Weight: empty weight");
    const auto st = w.scalar_type();
    TORCH_CHECK(st == torch::kFloat32 || st == torch::kBFloat16 || st == torch::kHalf,
                "Nf4Weight: weights must be float, bf16 or half, got ", st);
#if defined(__CUDACC__)
    if (w.is_cuda()) return quantize_cuda(w, o);
#endif
    torch::Tensor wc = w.detach().to(torch::kCPU).contiguous();
    quant::Nf4Packed p;
    try {
      if (st == torch::kFloat32)
        p = quant::nf4_quantize(static_cast<const float*>(wc.data_ptr()), wc.numel(), o);
      else if (st == torch::kBFloat16)
        p = quant::nf4_quantize(static_cast<const bf16*>(wc.data_ptr()), wc.numel(), o);
      else
        p = quant::nf4_quantize(static_cast<const half*>(wc.data_ptr()), wc.numel(), o);
    } catch (const squeeze::Error& e) {
      TORCH_CHECK(false, "Nf4Weight: ", e.what());
    }
    return from_packed(p, w.size(0), w.size(1), w.device());
  }

  // A packed NF4 tensor (quant::Nf4Packed: squeeze's quantizer, or a bitsandbytes file through io::to_nf4_packed) as
  // the weight [out, in] on `device`.
  static Nf4Weight from_packed(const quant::Nf4Packed& p, int64_t out, int64_t in, torch::Device device) {
    TORCH_CHECK(out > 0 && in > 0 && p.n == out * in, "Nf4Weight: the packed tensor holds ", p.n, " values, [", out, ", ", in, "] needs ",
                out * in);
    Nf4Weight r;
    r.out = out;
    r.in = in;
    r.block = p.block;
    r.double_quant = p.double_quant;
    auto from = [&](const auto& v, torch::ScalarType t) {
      if (v.empty()) return torch::empty({0}, torch::TensorOptions().dtype(t).device(device));
      return torch::from_blob(const_cast<void*>(static_cast<const void*>(v.data())), {int64_t(v.size())}, torch::TensorOptions().dtype(t))
          .clone()
          .to(device);
    };
    r.codes = from(p.codes, torch::kUInt8);
    r.absmax = from(p.absmax, torch::kFloat32);
    r.absmax_code = from(p.absmax_code, torch::kUInt8);
    r.nested_absmax = from(p.nested_absmax, torch::kFloat32);
    r.nested_map = from(p.nested_map, torch::kFloat32);
    r.absmax_offset = from(p.double_quant ? std::vector<float>{p.absmax_offset} : std::vector<float>{}, torch::kFloat32);
    return r;
  }

#if defined(__CUDACC__)
  static Nf4Weight quantize_cuda(const torch::Tensor& w, const quant::Nf4Options& o) {
    namespace kq = kernels::quant;
    const torch::Tensor wc = w.detach().contiguous();
    TORCH_CHECK(torch::isfinite(wc).all().item<bool>(), "Nf4Weight: the weight holds inf or NaN values");
    Nf4Weight r;
    r.out = w.size(0);
    r.in = w.size(1);
    r.block = o.block;
    r.double_quant = o.double_quant;
    const int64_t n = wc.numel();
    try {
      kq::nf4_validate(n, o.block, "Nf4Weight");
    } catch (const squeeze::Error& e) {
      TORCH_CHECK(false, e.what());
    }
    const int64_t blocks = kq::nf4_blocks(n, o.block);
    const auto on = [&](torch::ScalarType t) { return torch::TensorOptions().dtype(t).device(w.device()); };
    r.codes = torch::empty({kq::nf4_code_bytes(n)}, on(torch::kUInt8));
    const bool dq = o.double_quant;
    const torch::Tensor absmax = torch::empty({blocks}, on(torch::kFloat32));
    r.absmax_code = torch::empty({dq ? blocks : 0}, on(torch::kUInt8));
    r.nested_absmax = torch::empty({dq ? kq::nf4_dq_groups(blocks) : 0}, on(torch::kFloat32));
    r.nested_map = dq ? torch::from_blob(const_cast<float*>(quant::bnb_dynamic_map().data()), {256}, torch::kFloat32).to(w.device())
                      : torch::empty({0}, on(torch::kFloat32));
    r.absmax_offset = torch::empty({dq ? 1 : 0}, on(torch::kFloat32));
    const kq::Nf4DeviceBuffers bufs{.codes = static_cast<std::uint8_t*>(r.codes.data_ptr()),
                                    .absmax = static_cast<float*>(absmax.data_ptr()),
                                    .absmax_code = dq ? static_cast<std::uint8_t*>(r.absmax_code.data_ptr()) : nullptr,
                                    .nested_absmax = dq ? static_cast<float*>(r.nested_absmax.data_ptr()) : nullptr,
                                    .nested_map = dq ? static_cast<const float*>(r.nested_map.data_ptr()) : nullptr,
                                    .absmax_offset = dq ? static_cast<float*>(r.absmax_offset.data_ptr()) : nullptr};
    const c10::DeviceGuard guard(w.device());
    const cudaStream_t stream =
        static_cast<cudaStream_t>(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(w.device()).native_handle());
    const auto st = w.scalar_type();
    cudaError_t e = cudaSuccess;
    if (st == torch::kFloat32)
      e = kq::nf4_quantize_cuda(static_cast<const float*>(wc.data_ptr()), n, o.block, dq, bufs, stream);
    else if (st == torch::kBFloat16)
      e = kq::nf4_quantize_cuda(static_cast<const bf16*>(wc.data_ptr()), n, o.block, dq, bufs, stream);
    else
      e = kq::nf4_quantize_cuda(static_cast<const half*>(wc.data_ptr()), n, o.block, dq, bufs, stream);
    TORCH_CHECK(e == cudaSuccess, "Nf4Weight: NF4 quantise kernels failed: ", cudaGetErrorString(e));
    r.absmax = dq ? torch::empty({0}, on(torch::kFloat32)) : absmax;
    return r;
  }
#endif

  int64_t bytes() const {
    return codes.numel() + absmax.numel() * 4 + absmax_code.numel() +
           (nested_absmax.numel() + nested_map.numel() + absmax_offset.numel()) * 4;
  }
  torch::Device device() const { return home ? home->device() : codes.device(); }  // where it is used

  // W [out, in] in `dtype` on the buffers' device.
  torch::Tensor dequantize(torch::ScalarType dtype) const {
    acquire();
    ++dequantizations;
    TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && absmax.scalar_type() == torch::kFloat32 &&
                    absmax_code.scalar_type() == torch::kUInt8 && nested_absmax.scalar_type() == torch::kFloat32 &&
                    nested_map.scalar_type() == torch::kFloat32 && absmax_offset.scalar_type() == torch::kFloat32,
                "Nf4Weight: packed buffers changed type (codes ", codes.scalar_type(), "); move NF4 layers between devices only");
    TORCH_CHECK(!double_quant || (nested_map.numel() == 256 && absmax_offset.numel() == 1),
                "Nf4Weight: DoubleQuant needs a 256-entry nested map and one offset, got ", nested_map.numel(), " and ",
                absmax_offset.numel());
    TORCH_CHECK(codes.numel() == (out * in + 1) / 2, "Nf4Weight: codes hold ", codes.numel(), " bytes, [", out, ", ", in, "] needs ",
                (out * in + 1) / 2);
    torch::Tensor w = torch::empty({out, in}, torch::TensorOptions().dtype(dtype).device(device()));
    kernels::quant::Nf4View v{.codes = static_cast<const std::uint8_t*>(codes.data_ptr()), .n = out * in, .block = block};
    if (double_quant) {
      v.absmax_code = static_cast<const std::uint8_t*>(absmax_code.data_ptr());
      v.nested_absmax = static_cast<const float*>(nested_absmax.data_ptr());
      v.nested_map = static_cast<const float*>(nested_map.data_ptr());
      v.absmax_offset = static_cast<const float*>(absmax_offset.data_ptr());
      v.double_quant = true;
    } else {
      v.absmax = static_cast<const float*>(absmax.data_ptr());
    }
    if (device().is_cpu()) {
      switch (dtype) {
        case torch::kFloat32:
          kernels::quant::nf4_dequantize_cpu(v, static_cast<float*>(w.data_ptr()));
          break;
        case torch::kBFloat16:
          kernels::quant::nf4_dequantize_cpu(v, static_cast<bf16*>(w.data_ptr()));
          break;
        case torch::kHalf:
          kernels::quant::nf4_dequantize_cpu(v, static_cast<half*>(w.data_ptr()));
          break;
        default:
          TORCH_CHECK(false, "Nf4Weight: dequantises to float, bf16 or half, not ", dtype);
      }
      return w;
    }
#if defined(__CUDACC__)
    TORCH_CHECK(device().is_cuda(), "Nf4Weight: buffers on ", device(), "; CPU or CUDA expected");
    const c10::DeviceGuard guard(device());  // launch on the buffers' GPU, not the current one
    const cudaStream_t stream =
        static_cast<cudaStream_t>(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device()).native_handle());
    cudaError_t e = cudaSuccess;
    switch (dtype) {
      case torch::kFloat32:
        e = kernels::quant::nf4_dequantize_cuda(v, static_cast<float*>(w.data_ptr()), stream);
        break;
      case torch::kBFloat16:
        e = kernels::quant::nf4_dequantize_cuda(v, static_cast<bf16*>(w.data_ptr()), stream);
        break;
      case torch::kHalf:
        e = kernels::quant::nf4_dequantize_cuda(v, static_cast<half*>(w.data_ptr()), stream);
        break;
      default:
        TORCH_CHECK(false, "Nf4Weight: dequantises to float, bf16 or half, not ", dtype);
    }
    TORCH_CHECK(e == cudaSuccess, "Nf4Weight: NF4 dequantise kernel failed: ", cudaGetErrorString(e));
    return w;
#else
    TORCH_CHECK(false, "Nf4Weight: buffers on ", device(),
                ", but this translation unit was not compiled by nvcc; include "
                "squeeze/nn/lora.hpp from a .cu file to dequantise NF4 on the GPU");
    return {};
#endif
  }
};

namespace detail {
// x [..., in] -> x W^T with W dequantised in forward and again in backward (nothing dense is saved).
// The weight travels as a pointer (like ShardedLinearFn's group): the module must outlive its backward.
struct Nf4MatmulFn : torch::autograd::Function<Nf4MatmulFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t weight_ptr) {
    const auto* w = reinterpret_cast<const Nf4Weight*>(weight_ptr);
    ctx->saved_data["w"] = weight_ptr;
    const torch::Tensor wd = w->dequantize(x.scalar_type());  // [out, in], freed on return
    return torch::matmul(x, wd.t());
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list g) {
    const auto* w = reinterpret_cast<const Nf4Weight*>(ctx->saved_data["w"].toInt());
    const torch::Tensor wd = w->dequantize(g[0].scalar_type());
    return {torch::matmul(g[0], wd), torch::Tensor()};
  }
};

}  // namespace detail

}  // namespace squeeze::nn
