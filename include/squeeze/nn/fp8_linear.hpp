#pragma once
// A linear's three GEMMs in FP8 (Precision<fp8, bf16, float>; docs/architecture.md, "FP8 GEMMs"):
//   forward   y  = x W^T     x e4m3, W e4m3
//   backward  dX = dY W      dY e5m2 (gradients need the range), W e4m3
//             dW = dY^T x    dY e5m2, x e4m3
// Each operand gets one tensor-wise scale from the values at hand ("current scaling"): the power of two that brings its
// largest magnitude closest below the format's largest finite value (448 for e4m3, 57344 for e5m2), then a cast with
// round-to-nearest-even, saturating; an all-zero operand keeps scale 1. at::_scaled_mm multiplies with fp32
// accumulation and divides by both scales (cuBLASLt on Hopper and Ada; a reference kernel on the CPU, which the CPU
// tests use). cuBLASLt wants the inner and output dimensions in multiples of 16: operands are zero-padded there.
// Saved for backward: x in e4m3 with its scale, one byte a value; W is quantized again in backward (nothing dense kept).
// Linears that read one tensor (q, k and v; gate and up) share its FP8 copy: the last input's copy is reused while that
// same tensor, unmodified, comes in again (Fp8InputCache), so it is cast and kept once.
#include <c10/util/intrusive_ptr.h>
#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace squeeze::nn {

inline constexpr float kE4m3Max = 448.0f;    // largest finite float8_e4m3fn
inline constexpr float kE5m2Max = 57344.0f;  // largest finite float8_e5m2

// An operand in FP8: values [..] in `format` and the fp32 [] factor that gives back their magnitude (amax / max).
struct Fp8Operand {
  torch::Tensor values;
  torch::Tensor inverse_scale;
};

// The scale is a power of two (the largest with amax · scale <= max), so scaling is exact in the operand's own dtype
// and the one rounding is the cast's; values then fill (max/2, max]. Transient: one scaled copy in x's dtype.
inline Fp8Operand to_fp8(const torch::Tensor& x, torch::ScalarType format) {
  TORCH_CHECK(format == torch::kFloat8_e4m3fn || format == torch::kFloat8_e5m2, "to_fp8: e4m3fn or e5m2, not ", format);
  const float top = format == torch::kFloat8_e4m3fn ? kE4m3Max : kE5m2Max;
  const torch::Tensor xd = x.detach();
  // [] max |x| in one read (a NaN or inf input gives NaN values: nothing hides it)
  const torch::Tensor amax = torch::linalg_vector_norm(xd, INFINITY).to(torch::kFloat32);
  const torch::Tensor scale =
      torch::where(amax > 0, torch::exp2(torch::floor(torch::log2(top / amax))), torch::ones_like(amax)).clamp_(0, 1e38);
  // A power-of-two scale is exact and brings every |x| to <= top: the cast needs no clamp.
  return {(xd * scale.to(xd.scalar_type())).to(format), scale.reciprocal()};
}

// The FP8 copy of the last input seen, for the next linear that reads the same tensor: a hit needs that tensor alive
// (a weak reference: nothing is kept alive for the cache, and a freed tensor's address is not reused while it is held)
// and unmodified (its version counter). One per thread.
struct Fp8InputCache {
  int64_t casts = 0, hits = 0;  // inputs cast, and reused
  Fp8Operand get(const torch::Tensor& x, torch::ScalarType format) {
    if (input_ && !input_->expired() && input_->_unsafe_get_target() == x.unsafeGetTensorImpl() && version_ == x._version() &&
        format_ == format) {
      ++hits;
      return copy_;
    }
    ++casts;
    copy_ = to_fp8(x, format);
    input_.emplace(x.getIntrusivePtr());
    version_ = x._version();
    format_ = format;
    return copy_;
  }
  // Drops the held copy when it is `values` (a backward done with it: its bytes go as autograd lets them go).
  void forget(const torch::Tensor& values) {
    if (copy_.values.defined() && copy_.values.is_alias_of(values)) {
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

namespace detail {
// x [..., in], w [out, in] -> x w^T [..., out] through FP8 GEMMs, in x's dtype.
struct Fp8LinearFn : torch::autograd::Function<Fp8LinearFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w) {
    const int64_t in = w.size(1), out = w.size(0);
    Fp8Operand x8 = fp8_input_cache().get(x, torch::kFloat8_e4m3fn);  // x's shape
    x8.values = x8.values.reshape({-1, in});                          // [M, in]
    const Fp8Operand w8 = to_fp8(w, torch::kFloat8_e4m3fn);           // [out, in]
    ctx->save_for_backward({x8.values, x8.inverse_scale, w});
    ctx->saved_data["dtype"] = int64_t(x.scalar_type());
    std::vector<int64_t> sizes = x.sizes().vec();
    ctx->saved_data["x_sizes"] = sizes;
    sizes.back() = out;
    return fp8_mm(x8, w8, x.scalar_type()).view(sizes);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list g) {
    const auto saved = ctx->get_saved_variables();
    const Fp8Operand x8{saved[0], saved[1]};
    const torch::Tensor& w = saved[2];
    fp8_input_cache().forget(x8.values);
    const auto dtype = torch::ScalarType(ctx->saved_data["dtype"].toInt());
    const std::vector<int64_t> x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    const Fp8Operand g8 = to_fp8(g[0].reshape({-1, w.size(0)}), torch::kFloat8_e5m2);  // [M, out]
    const Fp8Operand w8 = to_fp8(w, torch::kFloat8_e4m3fn);
    // dX = dY W: b is W^T [in, out]; dW = dY^T x: a is dY^T [out, M], b is x^T [in, M]
    const torch::Tensor dx = fp8_mm(g8, {w8.values.t().contiguous(), w8.inverse_scale}, dtype).view(x_sizes);
    const torch::Tensor dw =
        fp8_mm({g8.values.t().contiguous(), g8.inverse_scale}, {x8.values.t().contiguous(), x8.inverse_scale}, w.scalar_type());
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
