#pragma once
// libtorch adapter of squeeze's fused AdamW (torch layer): takes a module's parameters and updates them
// with the kernels of squeeze/kernels/adamw.*, one tensor at a time on the CPU (all cores each) and one
// launch per (param dtype, grad dtype, step) group on CUDA (the latter only when this header is compiled
// by nvcc). float params are updated in place; half/bf16 params get an fp32 master copy kept here.
//
//   auto net = torch::nn::Linear(512, 512);
//   squeeze::optim::TorchAdamW opt(net->parameters(), {.lr = 3e-4f, .weight_decay = 0.1f});
//   loss.backward(); opt.step(); opt.zero_grad();
//
// The math is PyTorch's AdamW (decoupled decay, bias correction, per-parameter step counts), so it is a
// drop-in for torch::optim::AdamW. Gradient clipping and loss scaling belong to the caller here (e.g.
// torch::nn::utils::clip_grad_norm_); make_trainer fuses both. squeeze::Error becomes a TORCH_CHECK failure.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

#include "squeeze/kernels/adamw.hpp"
#include "squeeze/optim/adamw.hpp"

#if defined(__CUDACC__)
#include <c10/cuda/CUDAStream.h>

#include "squeeze/kernels/adamw.cuh"
#endif

namespace squeeze::optim {

class TorchAdamW {
 public:
  explicit TorchAdamW(std::vector<at::Tensor> params, const AdamW& options = {}) : opt_(options) {
    guard([&] { validate(opt_); });
    TORCH_CHECK(opt_.max_grad_norm <= 0,
                "squeeze TorchAdamW: clip gradients before step() (torch::nn::utils::clip_grad_norm_); "
                "max_grad_norm is fused only in make_trainer");
    for (std::size_t i = 0; i < params.size(); ++i) {
      at::Tensor& p = params[i];
      TORCH_CHECK(p.defined(), "squeeze TorchAdamW: parameter ", i, " is undefined");
      const auto st = p.scalar_type();
      TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, "squeeze TorchAdamW: parameter ", i, " has dtype ", st,
                  "; supported: float, half, bfloat16");
      TORCH_CHECK(p.is_contiguous(), "squeeze TorchAdamW: parameter ", i, " is not contiguous (the kernels treat it as a flat buffer)");
      TORCH_CHECK(p.is_cpu() || p.is_cuda(), "squeeze TorchAdamW: parameter ", i, " is on ", p.device(), "; supported: CPU, CUDA");
      Slot s;
      s.param = p;
      const auto f32 = p.options().dtype(at::kFloat);
      s.m = at::zeros(p.sizes(), f32);
      s.v = at::zeros(p.sizes(), f32);
      if (st != at::kFloat) s.master = p.detach().to(at::kFloat).contiguous();
      slots_.push_back(std::move(s));
    }
  }

  // One AdamW step on every parameter that has a gradient (others are skipped, as in torch::optim).
  void step() {
    c10::NoGradGuard no_grad;
    // Check every gradient before touching any parameter: a bad one fails the step with nothing changed.
    std::vector<std::size_t> todo;
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      const at::Tensor& g = s.param.grad();
      if (!g.defined()) continue;
      TORCH_CHECK(!g.is_sparse(), "squeeze TorchAdamW: parameter ", i, " has a sparse gradient (not supported)");
      TORCH_CHECK(g.device() == s.param.device(), "squeeze TorchAdamW: parameter ", i, " is on ", s.param.device(), " but its gradient on ",
                  g.device());
      TORCH_CHECK(g.numel() == s.param.numel(), "squeeze TorchAdamW: parameter ", i, " has ", s.param.numel(), " elements, its gradient ",
                  g.numel());
      const auto gt = g.scalar_type();
      TORCH_CHECK(gt == at::kFloat || gt == at::kHalf || gt == at::kBFloat16, "squeeze TorchAdamW: gradient ", i, " has dtype ", gt,
                  "; supported: float, half, bfloat16");
#if !defined(__CUDACC__)
      TORCH_CHECK(s.param.is_cpu(),
                  "squeeze TorchAdamW: CUDA parameters need the CUDA kernels: include squeeze/optim/torch_adamw.hpp "
                  "from a .cu file compiled by nvcc");
#endif
      todo.push_back(i);
    }
    std::map<std::tuple<at::ScalarType, at::ScalarType, std::int64_t>, std::vector<std::size_t>> cuda_groups;
    for (std::size_t i : todo) {
      Slot& s = slots_[i];
      ++s.step;
      s.grad = s.param.grad().contiguous();
      if (s.param.is_cpu())
        dispatch(s.param.scalar_type(), s.grad.scalar_type(), [&]<class P, class G>() { cpu_update<P, G>(s); });
      else
        cuda_groups[{s.param.scalar_type(), s.grad.scalar_type(), s.step}].push_back(i);
    }
#if defined(__CUDACC__)
    for (auto& [key, idx] : cuda_groups)
      dispatch(std::get<0>(key), std::get<1>(key), [&]<class P, class G>() { cuda_update<P, G>(idx, std::get<2>(key)); });
#endif
    for (auto& s : slots_) s.grad = at::Tensor();
  }

  void zero_grad(bool set_to_none = true) {
    for (auto& s : slots_) {
      at::Tensor& g = s.param.mutable_grad();
      if (!g.defined()) continue;
      if (set_to_none)
        g = at::Tensor();
      else
        g.zero_();
    }
  }

  void set_lr(float lr) {
    guard([&] { (void)kernels::adamw_coeffs(lr, opt_.beta1, opt_.beta2, opt_.eps, opt_.weight_decay, 1); });
    opt_.lr = lr;
  }
  const AdamW& options() const { return opt_; }
  std::size_t size() const { return slots_.size(); }
  // fp32 weights of parameter i: its master copy, or the parameter itself when it is float.
  at::Tensor master(std::size_t i) const { return slots_.at(i).master.defined() ? slots_.at(i).master : slots_.at(i).param; }
  at::Tensor exp_avg(std::size_t i) const { return slots_.at(i).m; }
  at::Tensor exp_avg_sq(std::size_t i) const { return slots_.at(i).v; }
  std::int64_t step_count(std::size_t i) const { return slots_.at(i).step; }

 private:
  struct Slot {
    at::Tensor param, master, m, v, grad;
    std::int64_t step = 0;
  };

  template <class F>
  static void guard(F&& f) {
    try {
      f();
    } catch (const squeeze::Error& e) {
      TORCH_CHECK(false, e.what());
    }
  }

  // The one switch from at::ScalarType to the kernels' element types.
  template <class F>
  static void dispatch(at::ScalarType p, at::ScalarType g, F&& f) {
    auto with_g = [&]<class P>() {
      switch (g) {
        case at::kFloat:
          return f.template operator()<P, float>();
        case at::kHalf:
          return f.template operator()<P, half>();
        case at::kBFloat16:
          return f.template operator()<P, bf16>();
        default:
          TORCH_CHECK(false, "squeeze TorchAdamW: unsupported gradient dtype ", g);
      }
    };
    switch (p) {
      case at::kFloat:
        return with_g.template operator()<float>();
      case at::kHalf:
        return with_g.template operator()<half>();
      case at::kBFloat16:
        return with_g.template operator()<bf16>();
      default:
        TORCH_CHECK(false, "squeeze TorchAdamW: unsupported parameter dtype ", p);
    }
  }

  template <class P, class G>
  kernels::AdamWTensor<P, G> tensor(Slot& s) {
    return {reinterpret_cast<P*>(s.param.data_ptr()),
            s.master.defined() ? s.master.data_ptr<float>() : nullptr,
            reinterpret_cast<const G*>(s.grad.data_ptr()),
            s.m.data_ptr<float>(),
            s.v.data_ptr<float>(),
            s.param.numel()};
  }
  kernels::AdamWCoeffs coeffs(std::int64_t step) const {
    return kernels::adamw_coeffs(opt_.lr, opt_.beta1, opt_.beta2, opt_.eps, opt_.weight_decay, step);
  }

  template <class P, class G>
  void cpu_update(Slot& s) {
    guard([&] { kernels::adamw_cpu(tensor<P, G>(s), coeffs(s.step)); });
  }

#if defined(__CUDACC__)
  // One launch for every parameter of this (P, G, step) group; the table is rebuilt each step because
  // gradients may be reallocated between steps (zero_grad(set_to_none)).
  template <class P, class G>
  void cuda_update(const std::vector<std::size_t>& idx, std::int64_t step) {
    guard([&] {
      std::vector<kernels::AdamWTensor<P, G>> list;
      for (std::size_t i : idx) list.push_back(tensor<P, G>(slots_[i]));
      const auto stream = c10::cuda::getCurrentCUDAStream(slots_[idx.front()].param.device().index()).stream();
      if (list.size() == 1) {
        SQUEEZE_CUDA_CHECK(kernels::adamw_cuda(list.front(), coeffs(step), {}, stream));
      } else {
        const kernels::DeviceTensorTable<kernels::AdamWTensor<P, G>> table(list);  // synchronous copy of a small table
        SQUEEZE_CUDA_CHECK(kernels::adamw_cuda(table.view(), coeffs(step), {}, stream));
        SQUEEZE_CUDA_CHECK(cudaStreamSynchronize(stream));  // before the table is freed
      }
    });
  }
#endif

  AdamW opt_;
  std::vector<Slot> slots_;
};

}  // namespace squeeze::optim
