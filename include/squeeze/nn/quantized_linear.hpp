#pragma once
// Frozen GPTQ linear layer: y = x W^T + b with W held packed (2/3/4/8 bits, GPTQ v1 layout).
//
// Kernel choice (forward), by device, width and batch rows M = x.numel() / in:
//   CPU                         dequantize (CPU twin) once, cached, then float matmul
//   CUDA, 3/4/8 bits, M <= max_fused_rows()   fused tensor-core GEMM on weights repacked at load into the kernel's
//                               tiles (kernels/quant/gemm.cuh quant_gemm_cuda: at 4 bits on sm_90 (sm_90a builds)
//                               the Hopper kernel, otherwise the mma.sync one)
//   CUDA, other widths (2 bits, or a g_idx the tiles cannot serve), M <= 8   GPTQ-layout GEMV (kernels/.../dequant.cuh)
//   CUDA, otherwise             dequantize to x's dtype, cuBLAS matmul
// max_fused_rows() by default (set_max_fused_rows overrides), from the measured crossover of the fused GEMM against
// dequantize + cuBLAS bf16 on the four LLaMA-7B / 70B shapes (bench_dequant's batch sweep; measured: docs/results.md,
// GPTQ dequantize): the Hopper kernel (4 bits) up to 1024 rows, the mma.sync kernel at 3 and 4 bits up to 64, at
// 8 bits up to 32. (The limit was once 256 rows for every kernel, set when dequantize was several times slower than
// its tiled form.)
// CUDA paths need this header compiled by nvcc (a .cu translation unit); activations fp16 or bf16.
// Kernels run on libtorch's current stream. One layer must not run concurrently on two streams
// (the GEMM's split-K counters are per layer).
//
// Backward (LoRA on a frozen GPTQ base, nn/lora.hpp): the weights are frozen buffers and get no gradient;
// the input gradient dX = dY W dequantizes W again (CPU: the cached float copy; CUDA: a transient [out, in]
// copy in dY's dtype, freed on return), so only the packed bytes stay alive between forward and backward.
// module.to(dtype) moves nothing but the bias to another type: the packed buffers keep their storage types.
#include <torch/torch.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

#include "squeeze/kernels/quant/dequant.cuh"
#if defined(__CUDACC__)
#include "squeeze/kernels/quant/gemm.cuh"
#endif

#include "squeeze/quant/tiles.hpp"
#include "squeeze/quant/pack.hpp"

namespace squeeze::nn {

namespace detail {
// module.to(...) for frozen packed layers (QuantizedLinear, LoRALinear, Nf4Linear): every tensor follows a
// device move, but a dtype conversion reaches only dense bases ("weight", "bias"): packed buffers keep their
// storage types and adapters their (master) type. Children get the same call (their own `to` decides).
// Buffers named with `stay_prefix` stay where they are (an NF4 base in host memory under Offload<Host, Streamed>).
inline void to_keep_types(torch::nn::Module& m, std::optional<torch::Device> device, std::optional<torch::Dtype> dtype, bool non_blocking,
                          std::string_view stay_prefix = {}) {
  auto move = [&](torch::Tensor& t, bool convert) {
    const torch::Device d = device.value_or(t.device());
    const torch::Dtype ty = convert && dtype && t.is_floating_point() ? *dtype : t.scalar_type();
    t.set_data(t.to(d, ty, non_blocking));
  };
  for (auto& p : m.named_parameters(/*recurse=*/false)) move(p.value(), false);
  for (auto& b : m.named_buffers(/*recurse=*/false))
    if (stay_prefix.empty() || !b.key().starts_with(stay_prefix)) move(b.value(), b.key() == "weight" || b.key() == "bias");
  for (auto& c : m.children()) {
    if (device && dtype)
      c->to(*device, *dtype, non_blocking);
    else if (device)
      c->to(*device, non_blocking);
    else if (dtype)
      c->to(*dtype, non_blocking);
  }
}

// x [..., in] -> x W^T + b through a frozen QuantizedLinear; backward gives dX = dY W only. The layer travels
// as a pointer (like lora.hpp's Nf4MatmulFn): the module must outlive its backward.
template <class Layer>
struct QuantizedMatmulFn : torch::autograd::Function<QuantizedMatmulFn<Layer>> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t layer_ptr) {
    ctx->saved_data["layer"] = layer_ptr;
    return reinterpret_cast<Layer*>(layer_ptr)->forward_frozen(x);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list g) {
    auto* layer = reinterpret_cast<Layer*>(ctx->saved_data["layer"].toInt());
    return {layer->input_grad(g[0]), torch::Tensor()};
  }
};
}  // namespace detail

class QuantizedLinearImpl : public torch::nn::Module {
 public:
  enum class Path { CpuDequant, TensorCoreGemm, Gemv, DequantMatmul };

  // fused_tiles = false skips the tensor-core GEMM's tile copy of the weights (about as many bytes again as
  // qweight, see bytes()): forward then takes the GEMV up to 8 rows and dequantize + cuBLAS above. Training
  // runs far more rows than max_fused_rows per forward, so it never reads the tiles (apply_lora leaves them out).
  explicit QuantizedLinearImpl(const quant::PackedLinear& p, bool fused_tiles = true)
      : bits_(p.bits), group_size_(p.group_size), in_(p.in), out_(p.out) {
    p.validate();
    auto i32 = [](const std::vector<std::int32_t>& v, std::vector<std::int64_t> shape) {
      return torch::from_blob(const_cast<std::int32_t*>(v.data()), shape, torch::kInt32).clone();
    };
    auto f16 = [](const std::vector<half>& v, std::vector<std::int64_t> shape) {
      return torch::from_blob(const_cast<half*>(v.data()), shape, torch::kHalf).clone();
    };
    qweight_ = register_buffer("qweight", i32(p.qweight, {p.qweight_rows(), p.out}));
    qzeros_ = register_buffer("qzeros", i32(p.qzeros, {p.groups(), p.qzeros_cols()}));
    scales_ = register_buffer("scales", f16(p.scales, {p.groups(), p.out}));
    g_idx_ = register_buffer("g_idx", i32(p.g_idx, {p.in}));
    if (!p.bias.empty()) bias_ = register_buffer("bias", f16(p.bias, {p.out}));
    // the tensor-core GEMM's layout, when this layer can use it
    if (fused_tiles && (p.bits == 3 || p.bits == 4 || p.bits == 8) && (p.group_size == 0 || p.group_size % 16 == 0)) {
      try {
        const auto t = quant::to_tiles(p);
        Npad_ = t.Npad;
        Kpad_ = t.Kpad;
        tile_group_ = t.group;
        tiles_ = register_buffer(
            "tiles", torch::from_blob(const_cast<std::uint32_t*>(t.tiles.data()), {std::int64_t(t.tiles.size())}, torch::kInt32).clone());
        tile_scales_ = register_buffer("tile_scales", f16(t.scales, {std::int64_t(t.scales.size())}));
        tile_zeros_ = register_buffer(
            "tile_zeros",
            torch::from_blob(const_cast<std::uint8_t*>(t.zeros.data()), {std::int64_t(t.zeros.size())}, torch::kUInt8).clone());
        if (!t.perm.empty()) perm_ = register_buffer("perm", i32(t.perm, {p.in}).to(torch::kInt64));
      } catch (const squeeze::Error&) {
        tiles_ = torch::Tensor();  // g_idx the kernel cannot serve: other paths handle it
      }
    }
  }

  // Batch rows up to which the fused GEMM is used; above it, dequantize + cuBLAS. 0 restores the default, which
  // depends on the kernel that serves this layer (see the threshold note at the top).
  void set_max_fused_rows(std::int64_t rows) {
    TORCH_CHECK(rows >= 0, "QuantizedLinear: max_fused_rows must be >= 0 (0: the default for the kernel), got ", rows);
    max_fused_rows_ = rows;
  }
  std::int64_t max_fused_rows() const {
    if (max_fused_rows_ > 0) return max_fused_rows_;
#if defined(__CUDACC__)
    if (tiles_.defined() && kernels::quant::quant_gemm_uses_sm90({1, out_, in_, Kpad_, Npad_, tile_group_, bits_})) return kFusedRowsHopper;
#endif
    return bits_ == 8 ? kFusedRowsMma8 : kFusedRowsMma;
  }
  static constexpr std::int64_t kFusedRowsHopper = 1024, kFusedRowsMma = 64, kFusedRowsMma8 = 32;

  std::int64_t in_features() const { return in_; }
  std::int64_t out_features() const { return out_; }
  int bits() const { return bits_; }

  Path path_for(const torch::Tensor& x) const {
    const std::int64_t M = x.numel() / in_;
    if (!x.is_cuda()) return Path::CpuDequant;
    if (tiles_.defined() && M <= max_fused_rows()) return Path::TensorCoreGemm;
    if (M <= 8) return Path::Gemv;
    return Path::DequantMatmul;
  }

  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override {
    detail::to_keep_types(*this, device, dtype, non_blocking);
  }
  void to(torch::Dtype dtype, bool non_blocking = false) override { detail::to_keep_types(*this, std::nullopt, dtype, non_blocking); }
  void to(torch::Device device, bool non_blocking = false) override { detail::to_keep_types(*this, device, std::nullopt, non_blocking); }

  // x [..., in] -> [..., out] in x's dtype; differentiable with respect to x (see Backward above).
  torch::Tensor forward(const torch::Tensor& x) {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_, "QuantizedLinear: input has ", x.dim() ? x.size(-1) : 0, " features, layer expects ",
                in_);
    TORCH_CHECK(x.is_floating_point(), "QuantizedLinear: floating-point input required, got ", x.scalar_type());
    return detail::QuantizedMatmulFn<QuantizedLinearImpl>::apply(x, reinterpret_cast<int64_t>(this));
  }

  // The forward kernels alone (no autograd): what forward runs.
  torch::Tensor forward_frozen(const torch::Tensor& x) {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_, "QuantizedLinear: input has ", x.dim() ? x.size(-1) : 0, " features, layer expects ",
                in_);
    TORCH_CHECK(x.device() == qweight_.device(), "QuantizedLinear: input on ", x.device(), " but the layer on ", qweight_.device(),
                "; move one of them");
    auto shape = x.sizes().vec();
    shape.back() = out_;
    auto x2 = x.reshape({-1, in_});
    torch::Tensor y;
    switch (path_for(x)) {
      case Path::CpuDequant: {
        TORCH_CHECK(x.is_floating_point(), "QuantizedLinear: floating-point input required, got ", x.scalar_type());
        y = torch::matmul(x2.to(torch::kFloat32), dequantized_cpu().t());
        break;
      }
      default:
        y = forward_cuda(x2);
        break;
    }
    if (bias_.defined()) y = y + bias_.to(y.scalar_type());
    return y.to(x.scalar_type()).reshape(shape);
  }

  // dX [..., in] = dY [..., out] W: CPU in float (as the forward), CUDA in dY's dtype on a transient W.
  torch::Tensor input_grad(const torch::Tensor& g) {
    TORCH_CHECK(g.dim() >= 1 && g.size(-1) == out_, "QuantizedLinear: output gradient has ", g.dim() ? g.size(-1) : 0,
                " features, layer has ", out_);
    auto shape = g.sizes().vec();
    shape.back() = in_;
    const torch::Tensor g2 = g.reshape({-1, out_});
    torch::Tensor dx =
        g.is_cuda() ? torch::matmul(g2, dequantize(g.scalar_type())) : torch::matmul(g2.to(torch::kFloat32), dequantized_cpu());
    return dx.to(g.scalar_type()).reshape(shape);
  }

  // W [out, in] in `dtype` on the layer's device. CPU: from the cached float copy; CUDA: a fresh tensor from
  // the dequantize kernel (nvcc translation units only).
  torch::Tensor dequantize(torch::ScalarType dtype) {
    if (qweight_.device().is_cpu()) return dequantized_cpu().to(dtype);
#if defined(__CUDACC__)
    TORCH_CHECK(qweight_.is_cuda(), "QuantizedLinear: buffers on ", qweight_.device(), "; CPU or CUDA expected");
    const c10::DeviceGuard guard(qweight_.device());
    const cudaStream_t stream =
        static_cast<cudaStream_t>(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(qweight_.device()).native_handle());
    torch::Tensor w = torch::empty({out_, in_}, qweight_.options().dtype(dtype));
    const kernels::quant::GptqView v{static_cast<const std::int32_t*>(qweight_.data_ptr()),
                                     static_cast<const std::int32_t*>(qzeros_.data_ptr()),
                                     static_cast<const half*>(scales_.data_ptr()),
                                     static_cast<const std::int32_t*>(g_idx_.data_ptr()),
                                     in_,
                                     out_,
                                     bits_,
                                     act_order(),
                                     scales_.size(0)};
    cudaError_t e = cudaSuccess;
    switch (dtype) {
      case torch::kFloat32:
        e = kernels::quant::dequantize_cuda<float>(v, static_cast<float*>(w.data_ptr()), stream);
        break;
      case torch::kBFloat16:
        e = kernels::quant::dequantize_cuda<bf16>(v, static_cast<bf16*>(w.data_ptr()), stream);
        break;
      case torch::kHalf:
        e = kernels::quant::dequantize_cuda<half>(v, static_cast<half*>(w.data_ptr()), stream);
        break;
      default:
        TORCH_CHECK(false, "QuantizedLinear: dequantizes to float, bf16 or half, not ", dtype);
    }
    TORCH_CHECK(e == cudaSuccess, "QuantizedLinear: dequantize failed: ", cudaGetErrorString(e));
    return w;
#else
    TORCH_CHECK(false, "QuantizedLinear: buffers on ", qweight_.device(),
                ", but this translation unit was not compiled by nvcc; include "
                "squeeze/nn/quantized_linear.hpp from a .cu file to dequantize on the GPU");
    return {};
#endif
  }

  // A dense torch::nn::Linear (float weights and bias), for export.
  torch::nn::Linear dense() {
    torch::NoGradGuard ng;
    torch::nn::Linear lin(torch::nn::LinearOptions(in_, out_).bias(bias_.defined()));
    lin->weight.set_data(dequantize(torch::kFloat32).clone());
    if (bias_.defined()) lin->bias.set_data(bias_.to(torch::kFloat32).clone());
    return lin;
  }

  int group_size() const { return group_size_; }
  bool fused_tiles() const { return tiles_.defined(); }
  const torch::Tensor& bias() const { return bias_; }
  torch::Device device() const { return qweight_.device(); }
  // Bytes of the GPTQ layout: qweight + qzeros + scales + g_idx (what a packed checkpoint holds and what
  // plan::quantized_matrix_bytes counts; the bias is not counted, LLaMA's linears have none).
  std::int64_t packed_bytes() const { return qweight_.numel() * 4 + qzeros_.numel() * 4 + scales_.numel() * 2 + g_idx_.numel() * 4; }
  // Every buffer this layer keeps resident: the GPTQ layout, the bias and the tensor-core GEMM's tile copy
  // (built at construction for 3/4/8 bits unless fused_tiles = false): tiles Kpad * Npad * bits / 8 bytes
  // (K padded to 64, N to 16), fp16 scales + uint8 zeros per group and padded column, int64 perm [in] under act-order.
  std::int64_t bytes() const {
    std::int64_t b = packed_bytes();
    for (const torch::Tensor* t : {&bias_, &tiles_, &tile_scales_, &tile_zeros_, &perm_})
      if (t->defined()) b += t->numel() * std::int64_t(t->element_size());
    return b;
  }

  // W [out, in] in float on the CPU (cached while the packed buffers stay as they are: the weights are frozen, but a
  // state dict loaded into the module rewrites them).
  const torch::Tensor& dequantized_cpu() {
    refresh_derived();
    if (!w_cpu_.defined()) {
      w_cpu_ = torch::empty({out_, in_}, torch::kFloat32);
      auto qw = qweight_.to(torch::kCPU).contiguous(), qz = qzeros_.to(torch::kCPU).contiguous(), gi = g_idx_.to(torch::kCPU).contiguous();
      auto sc = scales_.to(torch::kCPU).contiguous();
      kernels::quant::dequantize_cpu(view(qw, qz, sc, gi), w_cpu_.data_ptr<float>());
    }
    return w_cpu_;
  }

  // g_idx out of order (act-order): dequantize then takes a kernel for scattered groups (GptqView::act_order, a speed
  // hint); follows g_idx when a state dict is loaded.
  bool act_order() {
    refresh_derived();
    return act_order_;
  }

 private:
  kernels::quant::GptqView view(const torch::Tensor& qw, const torch::Tensor& qz, const torch::Tensor& sc, const torch::Tensor& gi) const {
    return {qw.data_ptr<std::int32_t>(),
            qz.data_ptr<std::int32_t>(),
            reinterpret_cast<const half*>(sc.data_ptr<at::Half>()),
            gi.data_ptr<std::int32_t>(),
            in_,
            out_,
            bits_};
  }

  torch::Tensor forward_cuda(const torch::Tensor& x2) {
#if defined(__CUDACC__)
    const auto st = x2.scalar_type();
    TORCH_CHECK(st == torch::kHalf || st == torch::kBFloat16, "QuantizedLinear: CUDA kernels take fp16 or bf16 activations, got ", st);
    return st == torch::kHalf ? forward_cuda_as<half>(x2) : forward_cuda_as<bf16>(x2);
#else
    TORCH_CHECK(false,
                "QuantizedLinear: CUDA input, but this translation unit was not compiled by nvcc; include "
                "squeeze/nn/quantized_linear.hpp from a .cu file to use the CUDA kernels");
    return {};
#endif
  }

#if defined(__CUDACC__)
  // Every tensor below has an explicit torch::Tensor type: nothing depends on T but the pointer casts,
  // so no `.template` is needed on member calls (stricter front ends reject them otherwise).
  template <class T>
  torch::Tensor forward_cuda_as(const torch::Tensor& x2) {
    namespace kq = kernels::quant;
    const cudaStream_t stream =
        static_cast<cudaStream_t>(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(x2.device()).native_handle());
    const std::int64_t M = x2.size(0);
    torch::Tensor y = torch::empty({M, out_}, x2.options());
    T* yp = static_cast<T*>(y.data_ptr());
    const kq::GptqView v{static_cast<const std::int32_t*>(qweight_.data_ptr()),
                         static_cast<const std::int32_t*>(qzeros_.data_ptr()),
                         static_cast<const half*>(scales_.data_ptr()),
                         static_cast<const std::int32_t*>(g_idx_.data_ptr()),
                         in_,
                         out_,
                         bits_,
                         act_order(),
                         scales_.size(0)};
    cudaError_t e = cudaSuccess;
    switch (path_for(x2)) {
      case Path::TensorCoreGemm: {
        torch::Tensor xg = (perm_.defined() ? x2.index_select(1, perm_) : x2).contiguous();
        int sm = 0;
        cudaDeviceGetAttribute(&sm, cudaDevAttrMultiProcessorCount, x2.device().index());
        const kq::QGemmShape s{M, out_, in_, Kpad_, Npad_, tile_group_, bits_};
        const kq::QGemmWorkspace need = kq::quant_gemm_workspace_size(s, sm);
        // split-K counters: scratch that the kernel leaves zero, kept per layer and grown on demand
        if (!counters_.defined() || counters_.device() != x2.device() || counters_.numel() < need.counter_elems)
          counters_ = torch::zeros({std::max<std::int64_t>(need.counter_elems, 1)}, x2.options().dtype(torch::kInt32));
        torch::Tensor partial = torch::empty({std::max<std::int64_t>(need.partial_elems, 1)}, x2.options().dtype(torch::kFloat32));
        const kq::QGemmWorkspace ws{static_cast<float*>(partial.data_ptr()), need.partial_elems, static_cast<int*>(counters_.data_ptr()),
                                    counters_.numel()};
        e = kq::quant_gemm_cuda<T>(static_cast<const T*>(xg.data_ptr()), static_cast<const std::uint32_t*>(tiles_.data_ptr()),
                                   static_cast<const half*>(tile_scales_.data_ptr()),
                                   static_cast<const std::uint8_t*>(tile_zeros_.data_ptr()), yp, s, ws, sm, stream);
        TORCH_CHECK(e == cudaSuccess, "QuantizedLinear: quantized GEMM (", bits_, " bits, M ", M, ", N ", out_, ", K ", in_, "; ",
                    kq::quant_gemm_describe(s, sm), ") failed: ", cudaGetErrorString(e));
        return y;
      }
      case Path::Gemv: {
        torch::Tensor xc = x2.contiguous();
        torch::Tensor acc = torch::empty({M, out_}, x2.options().dtype(torch::kFloat32));
        e = kq::gemv_cuda<T>(v, static_cast<const T*>(xc.data_ptr()), yp, int(M), static_cast<float*>(acc.data_ptr()), stream);
        TORCH_CHECK(e == cudaSuccess, "QuantizedLinear: GEMV failed: ", cudaGetErrorString(e));
        return y;
      }
      default: {
        torch::Tensor w = torch::empty({out_, in_}, x2.options());
        e = kq::dequantize_cuda<T>(v, static_cast<T*>(w.data_ptr()), stream);
        TORCH_CHECK(e == cudaSuccess, "QuantizedLinear: dequantize failed: ", cudaGetErrorString(e));
        return torch::matmul(x2, w.t());
      }
    }
  }
#endif

  // What is derived from the packed buffers (the CPU copy of W, the act-order hint) is recomputed when one of them was
  // written in place (its version counter: copy_, set_) or replaced (its data pointer: a loaded state dict, to()).
  void refresh_derived() {
    std::array<std::int64_t, 8> state{};
    const torch::Tensor* bufs[4] = {&qweight_, &qzeros_, &scales_, &g_idx_};
    for (int i = 0; i < 4; ++i) {
      state[2 * i] = bufs[i]->is_inference() ? 0 : std::int64_t(bufs[i]->_version());  // inference tensors keep no count
      state[2 * i + 1] = std::int64_t(reinterpret_cast<std::uintptr_t>(bufs[i]->data_ptr()));
    }
    if (state == buffers_state_) return;
    buffers_state_ = state;
    w_cpu_ = torch::Tensor();
    const auto g = g_idx_.to(torch::kCPU).contiguous();
    act_order_ = !std::is_sorted(g.data_ptr<std::int32_t>(), g.data_ptr<std::int32_t>() + g.numel());
  }

  int bits_, group_size_;
  std::int64_t in_, out_;
  bool act_order_ = false;                       // see act_order()
  std::array<std::int64_t, 8> buffers_state_{};  // see refresh_derived()
  std::int64_t Npad_ = 0, Kpad_ = 0, tile_group_ = 0;
  std::int64_t max_fused_rows_ = 0;  // 0: max_fused_rows() by kernel (the threshold note at the top)
  torch::Tensor qweight_, qzeros_, scales_, g_idx_, bias_;
  torch::Tensor tiles_, tile_scales_, tile_zeros_, perm_, counters_;
  torch::Tensor w_cpu_;
};
TORCH_MODULE(QuantizedLinear);

}  // namespace squeeze::nn
