#pragma once
// The fused LLaMA kernels as libtorch autograd functions (math: kernels/rms_norm.hpp, rope.hpp, swiglu.hpp):
//   fused_rms_norm(x, weight, eps)               -> y                 saves x and r [rows] (fp32)
//   fused_add_rms_norm(x, residual, weight, eps) -> {x + residual, y} saves the sum and r
//   fused_rope_(x, cos, sin[, head_dim])         -> x rotated in place (backward: the inverse rotation)
//   fused_rope(x, cos, sin[, head_dim])          -> the same into a new tensor
//   fused_swiglu(g, u)                           -> silu(g) * u       saves g and u; silu recomputed in backward
// x, residual, weight, g, u: float32, bfloat16 or float16 (float64 too: the CPU twins and torch ops take it),
// contiguous, one dtype and one device per call; statistics and math in fp32 (float64 for float64).
// Where each call runs:
//   CPU tensors                   the CPU twins (OpenMP / kernels/cpu_parallel.hpp)
//   CUDA tensors, nvcc TU         the CUDA kernels (rms_norm.cuh, rope.cuh, swiglu.cuh) on the current stream
//   CUDA tensors, host TU         the same math in torch ops inside the same autograd function (same saved
//                                 tensors, same outputs up to rounding); float64 on CUDA too
// ForceTorchOps (a scope guard) takes the torch-ops path everywhere (tests compare it with the kernels).
// Once an FP8 linear exists (fp8_amax_from_producers()), the RMSNorm and SwiGLU kernels (CPU twins and CUDA) also write
// the max |.| of what they store (forward: y, h; backward: dx; dg and du), and the FP8 cast of that tensor takes it from
// produced_amax() instead of a pass of its own (nn/fp8_linear.hpp): in nn::Llama the inputs of q, k, v, gate, up and
// down, and the output gradients of o, gate and up.
#include <torch/torch.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/variable.h>

#include <array>
#include <atomic>
#include <optional>
#include <string>
#include <utility>

#include "squeeze/kernels/rms_norm.hpp"
#include "squeeze/kernels/rope.hpp"
#include "squeeze/kernels/swiglu.hpp"
#if defined(__CUDACC__)
#include "squeeze/kernels/rms_norm.cuh"
#include "squeeze/kernels/rope.cuh"
#include "squeeze/kernels/swiglu.cuh"
#endif

namespace squeeze::nn {

namespace fused_detail {
inline bool& force_torch_ops() {
  static thread_local bool on = false;
  return on;
}
}  // namespace fused_detail

// While alive, the fused functions of this thread compute with torch ops instead of the kernels.
class ForceTorchOps {
 public:
  ForceTorchOps() : previous_(fused_detail::force_torch_ops()) { fused_detail::force_torch_ops() = true; }
  ~ForceTorchOps() { fused_detail::force_torch_ops() = previous_; }
  ForceTorchOps(const ForceTorchOps&) = delete;
  ForceTorchOps& operator=(const ForceTorchOps&) = delete;

 private:
  bool previous_;
};

// On from the first FP8 linear of the process (nn::Linear::set_fp8_gemms): the producing kernels then write amax.
inline std::atomic<bool>& fp8_amax_from_producers() {
  static std::atomic<bool> on{false};
  return on;
}

// The last two outputs whose amax a producing kernel wrote on this thread (two: SwiGLU's backward writes dg and du), for
// the next FP8 cast of one of those same tensors: a hit needs its storage alive (a weak reference), the same data
// (pointer, element count, dtype; a view of all of it counts) and no write since (its version counter).
struct ProducedAmax {
  int64_t noted = 0, used = 0;  // outputs noted, and casts that took their amax
  void note(const torch::Tensor& y, torch::Tensor amax) {
    Note& n = notes_[std::size_t(noted++ % 2)];
    n.storage.emplace(y.storage().getWeakStorageImpl());
    n.data = y.data_ptr();
    n.numel = y.numel();
    n.dtype = y.scalar_type();
    n.version = y._version();
    n.amax = std::move(amax);
  }
  // [] fp32 max |x| on x's device, or undefined when x is not a noted output, unmodified.
  torch::Tensor of(const torch::Tensor& x) {
    for (const Note& n : notes_)
      if (n.holds(x)) {
        ++used;
        return n.amax;
      }
    return {};
  }
  void clear() { *this = ProducedAmax{}; }

 private:
  struct Note {
    std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;
    void* data = nullptr;
    int64_t numel = 0, version = -1;
    torch::ScalarType dtype = torch::kFloat32;
    torch::Tensor amax;
    bool holds(const torch::Tensor& x) const {
      return amax.defined() && storage && !storage->expired() && x.has_storage() &&
             x.storage().unsafeGetStorageImpl() == storage->_unsafe_get_target() && x.data_ptr() == data && x.numel() == numel &&
             x.scalar_type() == dtype && x._version() == version && x.is_contiguous();
    }
  };
  std::array<Note, 2> notes_;
};
inline ProducedAmax& produced_amax() {
  thread_local ProducedAmax notes;
  return notes;
}

namespace fused_detail {

// A [] fp32 tensor on `like`'s device for a producing kernel's amax, when FP8 casts may read it (undefined otherwise).
inline torch::Tensor amax_slot(const torch::Tensor& like) {
  if (!fp8_amax_from_producers().load(std::memory_order_relaxed) || like.scalar_type() == torch::kFloat64) return {};
  return torch::empty({}, like.options().dtype(torch::kFloat32));
}

enum class Path { Cpu, Cuda, Torch };
inline Path path_for(const torch::Tensor& x) {
  if (force_torch_ops()) return Path::Torch;
  if (x.is_cpu()) return Path::Cpu;
#if defined(__CUDACC__)
  if (x.is_cuda() && x.scalar_type() != torch::kFloat64) return Path::Cuda;
#endif
  return Path::Torch;
}

inline torch::ScalarType acc_type(const torch::Tensor& x) { return x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32; }

// fn.template operator()<T>() for the storage type of st.
template <class Fn>
decltype(auto) dispatch(torch::ScalarType st, Fn&& fn) {
  switch (st) {
    case torch::kFloat32:
      return fn.template operator()<float>();
    case torch::kBFloat16:
      return fn.template operator()<bf16>();
    case torch::kFloat16:
      return fn.template operator()<half>();
    case torch::kFloat64:
      return fn.template operator()<double>();
    default:
      TORCH_CHECK(false, "unreachable dtype ", st);
  }
}

template <class T>
T* ptr(const torch::Tensor& t) {
  return t.defined() ? reinterpret_cast<T*>(t.data_ptr()) : nullptr;
}

// squeeze::Error from a kernel launcher becomes a c10::Error (TORCH_CHECK) naming the op.
template <class Fn>
void guard(const char* op, Fn&& fn) {
  try {
    fn();
  } catch (const squeeze::Error& e) {
    TORCH_CHECK(false, op, ": ", e.what());
  }
}

#if defined(__CUDACC__)
inline cudaStream_t stream_of(const torch::Tensor& t) {
  return static_cast<cudaStream_t>(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device()).native_handle());
}
inline void cuda_ok(cudaError_t e, const char* op) {
  TORCH_CHECK(e == cudaSuccess, op, ": CUDA error ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}
#endif

// The checks every fused op makes on a floating-point operand.
inline void check_operand(const char* op, const char* name, const torch::Tensor& t, const torch::Tensor& like,
                          const char* like_name = "x") {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  const auto st = t.scalar_type();
  TORCH_CHECK(st == torch::kFloat32 || st == torch::kBFloat16 || st == torch::kFloat16 || st == torch::kFloat64, op, ": ", name,
              " has dtype ", st, "; pass float32, bfloat16 or float16 (float64 for references)");
  TORCH_CHECK(st == like.scalar_type(), op, ": ", name, " has dtype ", st, " but ", like_name, " has ", like.scalar_type(),
              "; convert it with .to(", like_name, ".scalar_type())");
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " is on ", t.device(), " but ", like_name, " is on ", like.device(),
              "; move it with .to(", like_name, ".device())");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " is not contiguous (sizes ", t.sizes(), ", strides ", t.strides(), "); pass ", name,
              ".contiguous()");
}

// ---- RMSNorm ------------------------------------------------------------------------------------------
struct RmsForward {
  torch::Tensor y, sum, rrms;  // sum undefined without a residual; rrms [rows] fp32 (fp64 for fp64)
};

inline RmsForward rms_norm_forward(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight, double eps) {
  const int64_t h = x.size(-1), rows = x.numel() / h;
  RmsForward out;
  out.rrms = torch::empty({rows}, x.options().dtype(acc_type(x)));
  const Path path = path_for(x);
  if (path == Path::Torch) {
    const torch::Tensor v = residual.defined() ? x + residual : x;  // rounded to x's dtype, as the kernels do
    const torch::Tensor vf = v.to(acc_type(x));
    const torch::Tensor r = torch::rsqrt(vf.pow(2).mean(-1, /*keepdim=*/true) + eps);
    out.y = (vf * r * weight.to(acc_type(x))).to(x.scalar_type());
    out.rrms.copy_(r.reshape({rows}));
    if (residual.defined()) out.sum = v;
    return out;
  }
  out.y = torch::empty_like(x);
  if (residual.defined()) out.sum = torch::empty_like(x);
  const torch::Tensor amax = amax_slot(x);
  dispatch(x.scalar_type(), [&]<class T>() {
    const kernels::RmsNormForward<T> a{ptr<const T>(x),
                                       ptr<const T>(residual),
                                       ptr<const T>(weight),
                                       ptr<T>(out.y),
                                       ptr<T>(out.sum),
                                       ptr<kernels::acc_t<T>>(out.rrms),
                                       rows,
                                       h,
                                       eps,
                                       ptr<float>(amax)};
    if (path == Path::Cpu) {
      guard("fused_rms_norm", [&] { kernels::rms_norm_forward_cpu(a); });
      return;
    }
#if defined(__CUDACC__)
    if constexpr (FloatingElement<T>) {
      const c10::DeviceGuard device(x.device());
      guard("fused_rms_norm", [&] { cuda_ok(kernels::rms_norm_forward_cuda(a, stream_of(x)), "fused_rms_norm"); });
    }
#endif
  });
  if (amax.defined()) produced_amax().note(out.y, amax);
  return out;
}

// dx (with dsum added when defined) and, when want_dw, dweight in weight's dtype.
inline std::pair<torch::Tensor, torch::Tensor> rms_norm_backward(const torch::Tensor& v, const torch::Tensor& weight,
                                                                 const torch::Tensor& rrms, torch::Tensor dy, torch::Tensor dsum,
                                                                 bool want_dw) {
  const int64_t h = v.size(-1), rows = v.numel() / h;
  if (!dy.defined()) dy = torch::zeros_like(v);
  dy = dy.contiguous();
  if (dsum.defined()) dsum = dsum.contiguous();
  const Path path = path_for(v);
  const auto acc = acc_type(v);
  if (path == Path::Torch) {
    const torch::Tensor vf = v.to(acc), dyf = dy.to(acc), r = rrms.view({rows, 1});
    const torch::Tensor v2 = vf.reshape({rows, h}), dy2 = dyf.reshape({rows, h});
    const torch::Tensor g = dy2 * weight.to(acc);
    const torch::Tensor c = (g * v2).sum(-1, true) * r.pow(3) / double(h);
    torch::Tensor dx = r * g - c * v2;
    if (dsum.defined()) dx = dx + dsum.reshape({rows, h}).to(acc);
    torch::Tensor dw = want_dw ? (dy2 * v2 * r).sum(0).to(weight.scalar_type()) : torch::Tensor();
    return {dx.to(v.scalar_type()).view(v.sizes()), dw};
  }
  torch::Tensor dx = torch::empty_like(v);
  torch::Tensor dw = want_dw ? torch::empty({h}, v.options().dtype(acc)) : torch::Tensor();
  const torch::Tensor amax = amax_slot(v);
  dispatch(v.scalar_type(), [&]<class T>() {
    const kernels::RmsNormBackward<T> a{ptr<const T>(v),
                                        ptr<const T>(weight),
                                        ptr<const kernels::acc_t<T>>(rrms),
                                        ptr<const T>(dy),
                                        ptr<const T>(dsum),
                                        ptr<T>(dx),
                                        ptr<kernels::acc_t<T>>(dw),
                                        rows,
                                        h,
                                        ptr<float>(amax)};
    if (path == Path::Cpu) {
      guard("fused_rms_norm backward", [&] { kernels::rms_norm_backward_cpu(a); });
      return;
    }
#if defined(__CUDACC__)
    if constexpr (FloatingElement<T>) {
      const c10::DeviceGuard device(v.device());
      guard("fused_rms_norm backward", [&] {
        const int64_t ws = kernels::rms_norm_backward_workspace<T>(rows, h, want_dw);
        const torch::Tensor workspace = torch::empty({std::max<int64_t>(ws, 1)}, v.options().dtype(torch::kFloat32));
        cuda_ok(kernels::rms_norm_backward_cuda(a, want_dw ? workspace.data_ptr<float>() : nullptr, stream_of(v)),
                "fused_rms_norm backward");
      });
    }
#endif
  });
  if (amax.defined()) produced_amax().note(dx, amax);
  if (want_dw) dw = dw.to(weight.scalar_type());
  return {dx, dw};
}

inline void check_rms_norm(const char* op, const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_operand(op, "x", x, x);
  check_operand(op, "weight", weight, x);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": x must be [..., hidden] with hidden > 0, got ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), op, ": weight must be [hidden] = [", x.size(-1), "] (x's last dim), got ",
              weight.sizes());
  TORCH_CHECK(eps >= 0, op, ": eps must be >= 0, got ", eps);
}

class RmsNormFn : public torch::autograd::Function<RmsNormFn> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight, double eps) {
    RmsForward f = rms_norm_forward(x, torch::Tensor(), weight, eps);
    ctx->save_for_backward({x, weight, f.rrms});
    return f.y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    const auto s = ctx->get_saved_variables();
    auto [dx, dw] = rms_norm_backward(s[0], s[1], s[2], grad[0], torch::Tensor(), ctx->needs_input_grad(1));
    return {dx, dw, torch::Tensor()};
  }
};

class AddRmsNormFn : public torch::autograd::Function<AddRmsNormFn> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                                const torch::Tensor& residual, const torch::Tensor& weight, double eps) {
    RmsForward f = rms_norm_forward(x, residual, weight, eps);
    ctx->save_for_backward({f.sum, weight, f.rrms});
    return {f.sum, f.y};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    const auto s = ctx->get_saved_variables();
    auto [dx, dw] = rms_norm_backward(s[0], s[1], s[2], grad[1], grad[0], ctx->needs_input_grad(2));
    return {dx, dx, dw, torch::Tensor()};  // d(x + residual) / dx = d / dresidual = 1
  }
};

// ---- RoPE ---------------------------------------------------------------------------------------------
// x [B, T, W] with W = heads * head_dim; cos / sin [>= T, head_dim or head_dim / 2] in x's accumulation type.
inline void rope_apply(const torch::Tensor& out, const torch::Tensor& in, const torch::Tensor& cos, const torch::Tensor& sin,
                       int64_t head_dim, bool inverse) {
  const int64_t B = out.size(0), T = out.size(1), W = out.numel() / (B * T > 0 ? B * T : 1), heads = W / head_dim, half = head_dim / 2;
  const Path path = path_for(out);
  if (path == Path::Torch) {
    const auto acc = acc_type(out);
    const torch::Tensor c = cos.narrow(0, 0, T).narrow(1, 0, half).to(acc).view({1, T, 1, half});
    const torch::Tensor sn = sin.narrow(0, 0, T).narrow(1, 0, half).to(acc).view({1, T, 1, half}) * (inverse ? -1.0 : 1.0);
    const torch::Tensor src = in.view({B, T, heads, head_dim}).to(acc);
    const torch::Tensor a = src.narrow(-1, 0, half), b = src.narrow(-1, half, half);
    const torch::Tensor o = out.view({B, T, heads, head_dim});
    const torch::Tensor na = a * c - b * sn, nb = b * c + a * sn;  // both before either half is written (src may alias out)
    o.narrow(-1, 0, half).copy_(na);
    o.narrow(-1, half, half).copy_(nb);
    return;
  }
  dispatch(out.scalar_type(), [&]<class T_>() {
    using A = kernels::acc_t<T_>;
    const kernels::RopeArgs<T_> a{ptr<T_>(out),
                                  in.is_same(out) ? nullptr : ptr<const T_>(in),
                                  ptr<const A>(cos),
                                  ptr<const A>(sin),
                                  B * T,
                                  T,
                                  heads,
                                  head_dim,
                                  cos.size(1),
                                  inverse};
    if (path == Path::Cpu) {
      guard("fused_rope_", [&] { kernels::rope_cpu(a); });
      return;
    }
#if defined(__CUDACC__)
    if constexpr (FloatingElement<T_>) {
      const c10::DeviceGuard device(out.device());
      guard("fused_rope_", [&] { cuda_ok(kernels::rope_cuda(a, stream_of(out)), "fused_rope_"); });
    }
#endif
  });
}

class RopeFn : public torch::autograd::Function<RopeFn> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                               int64_t head_dim, bool in_place) {
    torch::Tensor out = in_place ? x : torch::empty_like(x);
    rope_apply(out, x, cos, sin, head_dim, /*inverse=*/false);
    if (in_place) ctx->mark_dirty({x});
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["head_dim"] = head_dim;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    const auto s = ctx->get_saved_variables();
    const torch::Tensor dy = grad[0].contiguous();
    torch::Tensor dx = torch::empty_like(dy);
    rope_apply(dx, dy, s[0], s[1], ctx->saved_data["head_dim"].toInt(), /*inverse=*/true);
    return {dx, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// ---- SwiGLU -------------------------------------------------------------------------------------------
inline torch::Tensor swiglu_forward(const torch::Tensor& g, const torch::Tensor& u) {
  const Path path = path_for(g);
  if (path == Path::Torch) {
    const torch::Tensor gf = g.to(acc_type(g));
    return (gf * torch::sigmoid(gf) * u.to(acc_type(g))).to(g.scalar_type());
  }
  torch::Tensor h = torch::empty_like(g);
  const torch::Tensor amax = amax_slot(g);
  dispatch(g.scalar_type(), [&]<class T>() {
    const kernels::SwigluArgs<T> a{ptr<const T>(g), ptr<const T>(u), ptr<T>(h), nullptr, nullptr, nullptr, g.numel(), ptr<float>(amax)};
    if (path == Path::Cpu) {
      guard("fused_swiglu", [&] { kernels::swiglu_forward_cpu(a); });
      return;
    }
#if defined(__CUDACC__)
    if constexpr (FloatingElement<T>) {
      const c10::DeviceGuard device(g.device());
      guard("fused_swiglu", [&] { cuda_ok(kernels::swiglu_forward_cuda(a, stream_of(g)), "fused_swiglu"); });
    }
#endif
  });
  if (amax.defined()) produced_amax().note(h, amax);
  return h;
}

inline std::pair<torch::Tensor, torch::Tensor> swiglu_backward(const torch::Tensor& g, const torch::Tensor& u, torch::Tensor dh) {
  dh = dh.contiguous();
  const Path path = path_for(g);
  if (path == Path::Torch) {
    const auto acc = acc_type(g);
    const torch::Tensor gf = g.to(acc), uf = u.to(acc), dhf = dh.to(acc), s = torch::sigmoid(gf);
    return {(dhf * uf * s * (1 + gf * (1 - s))).to(g.scalar_type()), (dhf * gf * s).to(g.scalar_type())};
  }
  torch::Tensor dg = torch::empty_like(g), du = torch::empty_like(u);
  const torch::Tensor amax_dg = amax_slot(g), amax_du = amax_slot(g);
  dispatch(g.scalar_type(), [&]<class T>() {
    const kernels::SwigluArgs<T> a{.g = ptr<const T>(g),
                                   .u = ptr<const T>(u),
                                   .dh = ptr<const T>(dh),
                                   .dg = ptr<T>(dg),
                                   .du = ptr<T>(du),
                                   .n = g.numel(),
                                   .amax_dg = ptr<float>(amax_dg),
                                   .amax_du = ptr<float>(amax_du)};
    if (path == Path::Cpu) {
      guard("fused_swiglu backward", [&] { kernels::swiglu_backward_cpu(a); });
      return;
    }
#if defined(__CUDACC__)
    if constexpr (FloatingElement<T>) {
      const c10::DeviceGuard device(g.device());
      guard("fused_swiglu backward", [&] { cuda_ok(kernels::swiglu_backward_cuda(a, stream_of(g)), "fused_swiglu backward"); });
    }
#endif
  });
  if (amax_dg.defined()) produced_amax().note(dg, amax_dg), produced_amax().note(du, amax_du);
  return {dg, du};
}

class SwigluFn : public torch::autograd::Function<SwigluFn> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& g, const torch::Tensor& u) {
    ctx->save_for_backward({g, u});
    return swiglu_forward(g, u);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    const auto s = ctx->get_saved_variables();
    if (!grad[0].defined()) return {torch::Tensor(), torch::Tensor()};
    auto [dg, du] = swiglu_backward(s[0], s[1], grad[0]);
    return {dg, du};
  }
};

}  // namespace fused_detail

// y = x / rms(x) * weight over the last dim. x [..., h], weight [h].
inline torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps = 1e-5) {
  fused_detail::check_rms_norm("fused_rms_norm", x, weight, eps);
  return fused_detail::RmsNormFn::apply(x, weight, eps);
}

// {s, rms_norm(s) * weight} with s = x + residual (rounded to x's dtype): the residual stream and the next norm's output.
inline std::pair<torch::Tensor, torch::Tensor> fused_add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                                                  const torch::Tensor& weight, double eps = 1e-5) {
  fused_detail::check_rms_norm("fused_add_rms_norm", x, weight, eps);
  fused_detail::check_operand("fused_add_rms_norm", "residual", residual, x);
  TORCH_CHECK(residual.sizes() == x.sizes(), "fused_add_rms_norm: residual ", residual.sizes(), " must have x's shape ", x.sizes());
  auto out = fused_detail::AddRmsNormFn::apply(x, residual, weight, eps);
  return {out[0], out[1]};
}

// True when autograd lets x be modified in place: not a leaf that requires grad, and not a view it forbids writing to
// (one made by a custom autograd function, in no-grad mode, or by a multi-output op).
inline bool can_modify_in_place(const torch::Tensor& x) {
  if (x.is_leaf() && x.requires_grad()) return false;
  const auto* view = torch::autograd::impl::get_view_autograd_meta(x);
  return view == nullptr || view->get_creation_meta() == torch::autograd::CreationMeta::DEFAULT;
}

namespace fused_detail {
inline torch::Tensor rope(const char* op, torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t head_dim,
                          bool in_place) {
  check_operand(op, "x", x, x);
  TORCH_CHECK(x.dim() == 3 || x.dim() == 4, op, ": x must be [B, T, H, D] or [B, T, H * D] (with head_dim), got ", x.sizes());
  if (x.dim() == 4) {
    TORCH_CHECK(head_dim == 0 || head_dim == x.size(3), op, ": head_dim ", head_dim, " differs from x's last dim ", x.size(3));
    head_dim = x.size(3);
  }
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, op, ": head_dim must be positive and even, got ", head_dim,
              (x.dim() == 3 ? " (pass head_dim for a [B, T, H * D] x)" : ""));
  TORCH_CHECK(x.size(-1) * (x.dim() == 4 ? x.size(2) : 1) % head_dim == 0, op, ": x's width is not a multiple of head_dim ", head_dim);
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->defined() && t->dim() == 2 && t->is_floating_point(), op,
                ": cos and sin must be 2-D floating tables [T, D] or [T, D / 2]");
    TORCH_CHECK(t->size(0) >= x.size(1) && (t->size(1) == head_dim || t->size(1) == head_dim / 2), op,
                ": cos / sin must be [>= ", x.size(1), ", ", head_dim, " or ", head_dim / 2, "], got ", t->sizes());
    TORCH_CHECK(t->device() == x.device(), op, ": cos / sin are on ", t->device(), " but x is on ", x.device(),
                "; move them with .to(x.device())");
  }
  TORCH_CHECK(cos.sizes() == sin.sizes(), op, ": cos ", cos.sizes(), " and sin ", sin.sizes(), " differ in shape");
  const auto acc = acc_type(x);
  return RopeFn::apply(x, cos.to(acc).contiguous(), sin.to(acc).contiguous(), head_dim, in_place);
}
}  // namespace fused_detail

// Rotates x in place and returns it. x: [B, T, H, D], or [B, T, H * D] with head_dim = D; contiguous, not a leaf
// that requires grad, not a view made by a custom autograd function (torch forbids modifying those in place: use
// fused_rope). cos, sin: [>= T, D] (nn::rope_tables) or [>= T, D / 2], floating point (converted to fp32, float64
// for a float64 x). Row b * T + t is position t.
inline torch::Tensor fused_rope_(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t head_dim = 0) {
  return fused_detail::rope("fused_rope_", std::move(x), cos, sin, head_dim, /*in_place=*/true);
}
// The same rotation into a new tensor (x unchanged).
inline torch::Tensor fused_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t head_dim = 0) {
  return fused_detail::rope("fused_rope", x, cos, sin, head_dim, /*in_place=*/false);
}

// silu(g) * u, elementwise. g, u: one shape.
inline torch::Tensor fused_swiglu(const torch::Tensor& g, const torch::Tensor& u) {
  fused_detail::check_operand("fused_swiglu", "g", g, g, "g");
  fused_detail::check_operand("fused_swiglu", "u", u, g, "g");
  TORCH_CHECK(g.sizes() == u.sizes(), "fused_swiglu: g ", g.sizes(), " and u ", u.sizes(), " must have one shape");
  return fused_detail::SwigluFn::apply(g, u);
}

}  // namespace squeeze::nn
