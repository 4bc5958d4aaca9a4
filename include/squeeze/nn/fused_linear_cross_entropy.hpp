#pragma once
// Linear + cross-entropy in one autograd function: mean over the kept targets of -log softmax(x W^T)[target],
// computed over chunks of rows so that only one chunk's logits [c, V] exist at a time, with the gradients of x and
// W produced in the same pass (the idea of Liger-Kernel's fused linear cross-entropy: the logits are never
// materialised for the whole batch and never recomputed). Per chunk: logits = x_c W^T (cuBLAS, the inputs' dtype),
// then in fp32 lse = logsumexp, loss += lse - logit[target], dlogits = (softmax - onehot) / kept; dx_c = dlogits W,
// dW += dlogits^T x_c (fp32 accumulator). Three GEMMs per chunk where a checkpointed chunked loss runs four.
//
//   x [N, h] (any float dtype), weight [V, h] (x's dtype), targets [N] int64 (ignore_index: not counted)
//   -> loss [] fp32 (fp64 for fp64 inputs)
// Backward scales the saved gradients by the incoming one (a loss scale, an accumulation weight). No host sync:
// the count of kept targets stays a device tensor. Memory held between forward and backward: dx [N, h] in x's
// dtype and dW [V, h] in fp32 (what autograd would hold as gradients anyway); transient: one chunk's fp32 logits.
#include <torch/torch.h>

#include <cstdint>

namespace squeeze::nn {

namespace detail {
class FusedLinearCrossEntropy : public torch::autograd::Function<FusedLinearCrossEntropy> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& targets, int64_t chunk, int64_t ignore_index) {
    const bool need_x = x.requires_grad(), need_w = weight.requires_grad();
    const auto acc = x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    const int64_t N = x.size(0);
    const torch::Tensor kept = targets.ne(ignore_index);                                                      // [N] bool
    const torch::Tensor count = kept.sum().to(acc).clamp_min(1);                                              // [] on the device: no sync
    const torch::Tensor inv_count = count.reciprocal();                                                       // []
    torch::Tensor loss = torch::zeros({}, x.options().dtype(acc));                                            // []
    torch::Tensor dx = need_x ? torch::empty_like(x) : torch::Tensor();                                       // [N, h]
    torch::Tensor dw = need_w ? torch::zeros(weight.sizes(), weight.options().dtype(acc)) : torch::Tensor();  // [V, h]
    torch::NoGradGuard no_grad;
    for (int64_t a = 0; a < N; a += chunk) {
      const int64_t c = std::min(chunk, N - a);
      const torch::Tensor xc = x.narrow(0, a, c), tc = targets.narrow(0, a, c), kc = kept.narrow(0, a, c);  // [c, h], [c], [c]
      torch::Tensor z = torch::mm(xc, weight.t()).to(acc);                                                  // [c, V] logits, fp32
      const torch::Tensor lse = torch::logsumexp(z, 1);                                                     // [c]
      const torch::Tensor safe = tc.masked_fill(kc.logical_not(), 0);                                       // [c] ignored rows read class 0
      const torch::Tensor picked = z.gather(1, safe.unsqueeze(1)).squeeze(1);                               // [c]
      loss.add_(((lse - picked) * kc).sum());
      if (!need_x && !need_w) continue;
      // dlogits = (softmax - onehot) * kept / count, in place over z.
      z.sub_(lse.unsqueeze(1)).exp_();
      z.scatter_add_(1, safe.unsqueeze(1), torch::full({c, 1}, -1.0, z.options()));
      z.mul_((kc.to(acc) * inv_count).unsqueeze(1));
      const torch::Tensor g = z.to(x.scalar_type());               // [c, V] in the GEMMs' dtype
      if (need_x) dx.narrow(0, a, c).copy_(torch::mm(g, weight));  // [c, h]
      if (need_w) dw.add_(torch::mm(g.t(), xc));                   // [V, h]
    }
    ctx->save_for_backward({dx, dw});
    ctx->saved_data["weight_dtype"] = int64_t(weight.scalar_type());
    return loss * inv_count;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& go = grad[0];  // []
    torch::Tensor dx = saved[0].defined() ? saved[0] * go.to(saved[0].scalar_type()) : torch::Tensor();
    const auto wt = torch::ScalarType(ctx->saved_data["weight_dtype"].toInt());
    torch::Tensor dw = saved[1].defined() ? (saved[1] * go.to(saved[1].scalar_type())).to(wt) : torch::Tensor();  // [V, h]
    return {dx, dw, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};
}  // namespace detail

// The mean cross-entropy of the logits x weight^T against targets, never holding more than `chunk` rows of logits.
inline torch::Tensor fused_linear_cross_entropy(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& targets,
                                                int64_t chunk = 4096, int64_t ignore_index = -100) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "fused_linear_cross_entropy: x must be [N, h] and weight [V, h], got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(x.size(1) == weight.size(1), "fused_linear_cross_entropy: x has ", x.size(1), " features, weight ", weight.size(1),
              " (weight is [V, h], as a Linear's)");
  TORCH_CHECK(x.is_floating_point() && x.scalar_type() == weight.scalar_type(), "fused_linear_cross_entropy: x and weight must share one ",
              "floating-point dtype, got ", x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == x.size(0) && targets.scalar_type() == torch::kLong,
              "fused_linear_cross_entropy: targets must be [N] int64 with N = ", x.size(0), ", got ", targets.sizes(), " ",
              targets.scalar_type());
  TORCH_CHECK(x.device() == weight.device() && x.device() == targets.device(), "fused_linear_cross_entropy: x, weight and targets must be ",
              "on one device, got ", x.device(), ", ", weight.device(), ", ", targets.device());
  TORCH_CHECK(chunk >= 1, "fused_linear_cross_entropy: chunk must be >= 1 row, got ", chunk);
  return detail::FusedLinearCrossEntropy::apply(x, weight, targets, chunk, ignore_index);
}

}  // namespace squeeze::nn
