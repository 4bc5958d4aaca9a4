#pragma once
// A linear's three GEMMs in FP8 (Precision<fp8, bf16, float>; docs/architecture.md, "FP8 GEMMs"):
//   forward   y  = x W^T     x e4m3, W e4m3
//   backward  dX = dY W      dY e5m2 (gradients need the range), W e4m3
//             dW = dY^T x    dY e5m2, x e4m3
// Each operand gets one tensor-wise scale from the values at hand ("current scaling"): the power of two that brings its
// largest magnitude closest below the format's largest finite value (448 for e4m3, 57344 for e5m2), then a cast with
// round-to-nearest-even; an all-zero operand keeps scale 1. at::_scaled_mm multiplies with fp32
// accumulation and divides by both scales (cuBLASLt on Hopper and Ada; a reference kernel on the CPU, which the CPU
// tests use). cuBLASLt wants the inner and output dimensions in multiples of 16: operands are zero-padded there.
// Saved for backward: xᵀ in e4m3 with its scale, one byte a value; W is quantized again in backward (nothing dense
// kept). Linears that read one tensor (q, k and v; gate and up) share its FP8 copy: the last input's copy is reused
// while that same tensor, unmodified, comes in again (Fp8InputCache), so it is cast and kept once.
// Where a cast runs (each path gives the same bytes and scale):
//   CUDA tensors, nvcc TU        two kernels (kernels/fp8_cast.cuh: amax, then the scaled cast writing the values and / or
//                                their transpose); to_fp8_twin is their math on the CPU, the reference they are tested against
// The amax pass is skipped for what a fused RMSNorm or SwiGLU kernel stored, forward or backward (in nn::Llama the inputs
// of q, k, v, gate, up and down, the output gradients of o, gate and up): the kernel wrote it (nn/fused_ops.hpp,
// produced_amax()).
//   otherwise                    torch ops, the transpose a copy of the values (ForceTorchOps takes this path on CUDA too)
#include <c10/util/intrusive_ptr.h>
#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "squeeze/kernels/fp8_cast.hpp"
#include "squeeze/nn/fused_ops.hpp"
#if defined(__CUDACC__)
#include "squeeze/kernels/fp8_cast.cuh"
#endif

namespace squeeze::nn {

inline constexpr float kE4m3Max = 448.0f;    // largest finite float8_e4m3fn
inline constexpr float kE5m2Max = 57344.0f;  // largest finite float8_e5m2

// An operand in FP8: values [.., K] in `format` and the fp32 [] factor that gives back their magnitude (1 / scale);
// transposed [K, rows]: the values' transpose, where it was asked for.
struct Fp8Operand {
  torch::Tensor values;
  torch::Tensor inverse_scale;
  torch::Tensor transposed;
};

// What to_fp8 writes: the values in x's shape, the transpose of x as a matrix [x.size(-1), rows], or both.
enum class Fp8Layout { values, transposed, both };

namespace fp8_detail {
inline kernels::Fp8Format format_of(torch::ScalarType f) {
  TORCH_CHECK(f == torch::kFloat8_e4m3fn || f == torch::kFloat8_e5m2, "to_fp8: e4m3fn or e5m2, not ", f);
  return f == torch::kFloat8_e4m3fn ? kernels::Fp8Format::e4m3 : kernels::Fp8Format::e5m2;
}

// The scale of kernels::fp8_scale in torch ops: amax = m·2^e (m in [0.5, 1)), top = mt·2^et: 2^(et - e - (m > mt)).
inline torch::Tensor scale_of(const torch::Tensor& amax, torch::ScalarType format) {
  const auto [m, e] = torch::frexp(amax);
  const double mt = 0.875;  // 448 = 0.875·2^9, 57344 = 0.875·2^16
  const int64_t et = format == torch::kFloat8_e4m3fn ? 9 : 16;
  const torch::Tensor k = (et - e.to(torch::kFloat32) - (m > mt).to(torch::kFloat32)).clamp_(-149, 126);
  const torch::Tensor pow2 = torch::exp2(k);
  return torch::where(amax > 0, torch::where(torch::isinf(amax), torch::zeros_like(pow2), pow2), torch::ones_like(pow2));
}

enum class Cast { torch_ops, twin, kernels };

inline Fp8Operand cast(const torch::Tensor& x, torch::ScalarType format, Fp8Layout layout, Cast how) {
  const kernels::Fp8Format f = format_of(format);
  TORCH_CHECK(x.dim() >= 1, "to_fp8: x needs a last dimension, got a scalar");
  const auto st = x.scalar_type();
  TORCH_CHECK(st == torch::kFloat32 || st == torch::kBFloat16 || st == torch::kFloat16, "to_fp8: x has dtype ", st,
              "; pass float32, bfloat16 or float16");
  const torch::Tensor produced = produced_amax().of(x);  // [] max |x| a producing kernel wrote, or undefined
  const torch::Tensor xd = x.detach().contiguous();
  const int64_t cols = xd.size(-1), rows = cols == 0 ? 0 : xd.numel() / cols;
  const bool want_values = layout != Fp8Layout::transposed, want_t = layout != Fp8Layout::values;
  const auto byte = xd.options().dtype(format);
  Fp8Operand o;
  if (how == Cast::torch_ops) {
    const torch::Tensor amax =
        produced.defined() ? produced : torch::linalg_vector_norm(xd, INFINITY).to(torch::kFloat32);  // [] max |x| in one read
    const torch::Tensor scale = scale_of(amax, format);
    o.values = (xd * scale.to(st)).to(format);  // a power-of-two scale: exact, and every |x| <= top (no clamp)
    o.inverse_scale = scale.reciprocal();
    if (want_t) o.transposed = o.values.reshape({rows, cols}).t().contiguous();
    if (!want_values) o.values = torch::Tensor();
    return o;
  }
  TORCH_CHECK(how == Cast::kernels || xd.is_cpu(), "to_fp8_twin: CPU tensors only, got ", xd.device());
  const torch::Tensor amax = produced.defined() ? produced : torch::empty({}, xd.options().dtype(torch::kFloat32));
  o.inverse_scale = torch::empty({}, xd.options().dtype(torch::kFloat32));
  if (want_values) o.values = torch::empty(xd.sizes(), byte);
  if (want_t) o.transposed = torch::empty({cols, rows}, byte);
  fused_detail::dispatch(st, [&]<class T>() {
    if constexpr (std::is_same_v<T, double>) {
      TORCH_CHECK(false, "to_fp8: float64 is not cast");  // refused above; dispatch instantiates it
    } else {
      kernels::Fp8CastArgs<T> a{fused_detail::ptr<const T>(xd),
                                rows,
                                cols,
                                amax.data_ptr<float>(),
                                want_values ? reinterpret_cast<std::uint8_t*>(o.values.data_ptr()) : nullptr,
                                want_t ? reinterpret_cast<std::uint8_t*>(o.transposed.data_ptr()) : nullptr,
                                o.inverse_scale.data_ptr<float>(),
                                f};
      if (how == Cast::twin) {
        fused_detail::guard("to_fp8_twin", [&] {
          if (!produced.defined()) *amax.data_ptr<float>() = kernels::fp8_amax_cpu(a.x, rows * cols);
          kernels::fp8_cast_cpu(a);
        });
        return;
      }
#if defined(__CUDACC__)
      const c10::DeviceGuard device(xd.device());
      const cudaStream_t stream = fused_detail::stream_of(xd);
      fused_detail::guard("to_fp8", [&] {
        if (!produced.defined())
          fused_detail::cuda_ok(kernels::fp8_amax_cuda(a.x, rows * cols, amax.data_ptr<float>(), stream), "to_fp8 (amax)");
        fused_detail::cuda_ok(kernels::fp8_cast_cuda(a, stream), "to_fp8 (cast)");
      });
#else
    TORCH_CHECK(false, "to_fp8: the CUDA kernels need an nvcc translation unit");
#endif
    }
  });
  return o;
}
}  // namespace fp8_detail

// x [..., K] (float32, bfloat16 or float16) in `format` with one power-of-two scale: the largest s with max|x|·s <= the
// format's largest finite value (448 for e4m3, 57344 for e5m2), so scaling is exact and the cast (round-to-nearest-
// even) is the one rounding; the values then fill (max/2, max]. All zeros keep scale 1; a NaN stays NaN.
inline Fp8Operand to_fp8(const torch::Tensor& x, torch::ScalarType format, Fp8Layout layout = Fp8Layout::values) {
  fp8_detail::Cast how = fp8_detail::Cast::torch_ops;
#if defined(__CUDACC__)
  if (x.is_cuda() && !fused_detail::force_torch_ops()) how = fp8_detail::Cast::kernels;
#endif
  return fp8_detail::cast(x, format, layout, how);
}

// The CUDA kernels' math on the CPU, one thread (kernels/fp8_cast.hpp): the reference they are tested against, equal
// to to_fp8 byte for byte. x on the CPU.
inline Fp8Operand to_fp8_twin(const torch::Tensor& x, torch::ScalarType format, Fp8Layout layout = Fp8Layout::values) {
  return fp8_detail::cast(x, format, layout, fp8_detail::Cast::twin);
}

// The FP8 copy of the last input seen, for the next linear that reads the same tensor: a hit needs that tensor alive
// (a weak reference: nothing is kept alive for the cache, and a freed tensor's address is not reused while it is held),
// unmodified (its version counter) and a copy with the layout asked for. One per thread.
struct Fp8InputCache {
  int64_t casts = 0, hits = 0;  // inputs cast, and reused
  Fp8Operand get(const torch::Tensor& x, torch::ScalarType format, Fp8Layout layout) {
    const bool has_layout = layout == Fp8Layout::values       ? copy_.values.defined()
                            : layout == Fp8Layout::transposed ? copy_.transposed.defined()
                                                              : copy_.values.defined() && copy_.transposed.defined();
    if (input_ && !input_->expired() && input_->_unsafe_get_target() == x.unsafeGetTensorImpl() && version_ == x._version() &&
        format_ == format && has_layout) {
      ++hits;
      return copy_;
    }
    ++casts;
    copy_ = to_fp8(x, format, layout);
    input_.emplace(x.getIntrusivePtr());
    version_ = x._version();
    format_ = format;
    return copy_;
  }
  // Drops the held copy when it is `t`'s (a backward done with it: its bytes go as autograd lets them go).
  void forget(const torch::Tensor& t) {
    const auto holds = [&](const torch::Tensor& c) { return c.defined() && t.defined() && c.is_alias_of(t); };
    if (holds(copy_.values) || holds(copy_.transposed)) {
      copy_ = {};
      input_.reset();
    }
  }
  // Drops the held copy and the counters.
  void clear() { *this = Fp8InputCache{}; }

 private:
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> input_;
  int64_t version_ = -1;
  torch::ScalarType format_ = torch::kFloat8_e4m3fn;
  Fp8Operand copy_;
};
inline Fp8InputCache& fp8_input_cache() {
  thread_local Fp8InputCache cache;
  return cache;
}

namespace detail {
inline int64_t round_up_16(int64_t n) { return (n + 15) / 16 * 16; }
inline torch::Tensor pad_columns(const torch::Tensor& t, int64_t cols) {  // [r, c] -> [r, cols], zeros on the right
  if (t.size(1) == cols) return t;
  torch::Tensor out = torch::zeros({t.size(0), cols}, t.options());
  out.narrow(1, 0, t.size(1)).copy_(t);
  return out;
}
}  // namespace detail

// a [M, K] and b [N, K] in FP8 -> a b^T [M, N] in `out` (fp32 accumulation).
inline torch::Tensor fp8_mm(const Fp8Operand& a, const Fp8Operand& b, torch::ScalarType out) {
  TORCH_CHECK(a.values.dim() == 2 && b.values.dim() == 2 && a.values.size(1) == b.values.size(1), "fp8_mm: [M, K] x [N, K] expected, got ",
              a.values.sizes(), " and ", b.values.sizes());
  const int64_t n = b.values.size(0), k = a.values.size(1);
  if (!a.values.is_cuda()) return at::_scaled_mm(a.values, b.values.t(), a.inverse_scale, b.inverse_scale, {}, {}, out);
  const int64_t kp = detail::round_up_16(k), np = detail::round_up_16(n);
  const torch::Tensor ap = detail::pad_columns(a.values.contiguous(), kp);  // [M, Kp] row-major
  torch::Tensor bp = detail::pad_columns(b.values.contiguous(), kp);        // [N, Kp]
  if (np != n) bp = torch::cat({bp, torch::zeros({np - n, kp}, bp.options())});
  torch::Tensor y;
  try {
    y = at::_scaled_mm(ap, bp.t(), a.inverse_scale, b.inverse_scale, {}, {}, out);  // bp.t(): column-major
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "fp8_mm: the FP8 GEMM [", a.values.size(0), ", ", k, "] x [", k, ", ", n, "] failed on ", a.values.device(),
                " (FP8 tensor cores need compute capability 8.9 or newer: Ada, Hopper): ", e.what_without_backtrace());
  }
  return np == n ? y : y.narrow(1, 0, n).contiguous();
}

// What a linear's FP8 backward keeps from its forward: x^T [in, M] in e4m3 and its inverse scale (x^T undefined when the
// weight is frozen: dW is not asked for).
struct Fp8Saved {
  torch::Tensor x_t, x_inverse_scale;
};

// y = x W^T through the FP8 GEMM, in x's dtype. x [..., in], w [out, in] -> y [..., out]; `saved` gets what backward
// reads (x^T when `keep_x_t`, the weight trains).
inline torch::Tensor fp8_linear_forward(const torch::Tensor& x, const torch::Tensor& w, bool keep_x_t, Fp8Saved& saved) {
  const int64_t in = w.size(1), out = w.size(0);
  // dW = dY^T x reads x^T: cast with the values when W trains.
  const Fp8Operand x8 = fp8_input_cache().get(x, torch::kFloat8_e4m3fn, keep_x_t ? Fp8Layout::both : Fp8Layout::values);
  const Fp8Operand w8 = to_fp8(w, torch::kFloat8_e4m3fn);  // [out, in]
  saved = {x8.transposed, x8.inverse_scale};
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out;
  return fp8_mm({x8.values.reshape({-1, in}), x8.inverse_scale}, w8, x.scalar_type()).view(sizes);  // [M, in] x [out, in]
}

// The input's and the weight's gradients from dY [..., out] (each only where asked): dX [x_sizes] in `dtype`,
// dW [out, in] in w's dtype. Lets the cache forget x^T: its bytes go once autograd drops them.
inline std::pair<torch::Tensor, torch::Tensor> fp8_linear_backward(const torch::Tensor& dy, const torch::Tensor& w, const Fp8Saved& saved,
                                                                   bool want_dx, bool want_dw, torch::IntArrayRef x_sizes,
                                                                   torch::ScalarType dtype) {
  fp8_input_cache().forget(saved.x_t);
  // dY [M, out] in e5m2: its values for dX, its transpose [out, M] for dW
  const Fp8Operand g8 = to_fp8(dy.reshape({-1, w.size(0)}), torch::kFloat8_e5m2,
                               want_dx && want_dw ? Fp8Layout::both
                               : want_dw          ? Fp8Layout::transposed
                                                  : Fp8Layout::values);
  torch::Tensor dx, dw;
  if (want_dx) {  // dX = dY W: b is W^T [in, out]
    const Fp8Operand w8 = to_fp8(w, torch::kFloat8_e4m3fn, Fp8Layout::transposed);
    dx = fp8_mm({g8.values, g8.inverse_scale}, {w8.transposed, w8.inverse_scale}, dtype).view(x_sizes);
  }
  if (want_dw) {  // dW = dY^T x: a is dY^T [out, M], b is x^T [in, M]
    TORCH_CHECK(saved.x_t.defined(), "fp8_linear: the weight's gradient is needed, but it did not require one in forward");
    dw = fp8_mm({g8.transposed, g8.inverse_scale}, {saved.x_t, saved.x_inverse_scale}, w.scalar_type());
  }
  return {dx, dw};
}

namespace detail {
// x [..., in], w [out, in] -> x w^T [..., out] through FP8 GEMMs, in x's dtype.
struct Fp8LinearFn : torch::autograd::Function<Fp8LinearFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w) {
    Fp8Saved saved;
    torch::Tensor y = fp8_linear_forward(x, w, w.requires_grad(), saved);
    ctx->save_for_backward({saved.x_t, saved.x_inverse_scale, w});
    ctx->saved_data["dtype"] = int64_t(x.scalar_type());
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    return y;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list g) {
    const auto v = ctx->get_saved_variables();  // x^T [in, M], its inverse scale, W [out, in]
    auto [dx, dw] = fp8_linear_backward(g[0], v[2], {v[0], v[1]}, ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                        ctx->saved_data["x_sizes"].toIntVector(), torch::ScalarType(ctx->saved_data["dtype"].toInt()));
    return {dx, dw};
  }
};
}  // namespace detail

// y = x W^T + b with the GEMMs in FP8 (b added in x's dtype).
inline torch::Tensor fp8_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {}) {
  TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1), "fp8_linear: x [..., ", weight.size(1), "] expected, got ",
              x.sizes());
  const torch::Tensor y = detail::Fp8LinearFn::apply(x, weight);
  return bias.defined() ? y + bias.to(y.scalar_type()) : y;
}

}  // namespace squeeze::nn
