// The nvcc half of bench_adamw (see bench_adamw_kernels.hpp).
#include <string>
#include <tuple>
#include <vector>

#include "bench_adamw_kernels.hpp"
#include "squeeze/kernels/adamw.cuh"
#include "squeeze/kernels/adamw8.cuh"
#include "adamw8_shapes.cuh"

namespace squeeze::bench {
namespace {

template <class P, class G>
class Launcher final : public AdamWLauncher {
 public:
  Launcher(P* param, float* master, const G* grad, float* m, float* v, std::int64_t n, int tensors) {
    check(tensors >= 1 && n >= tensors, "bench: need 1 <= tensors <= n");
    const std::int64_t per = n / tensors;
    for (int i = 0; i < tensors; ++i) {
      const std::int64_t off = i * per, len = i + 1 == tensors ? n - off : per;
      list_.push_back({param + off, master ? master + off : nullptr, grad + off, m + off, v + off, len});
    }
    if (tensors > 1) table_.upload(list_);
  }
  cudaError_t run(const kernels::AdamWCoeffs& c, const kernels::AdamWDynamic& d, cudaStream_t stream) override {
    if (list_.size() == 1) return kernels::adamw_cuda(list_[0], c, d, stream);
    return kernels::adamw_cuda(table_.view(), c, d, stream);
  }

 private:
  std::vector<kernels::AdamWTensor<P, G>> list_;
  kernels::DeviceTensorTable<kernels::AdamWTensor<P, G>> table_;
};

template <class Policy, class P, class G>
class Launcher8 final : public AdamWLauncher {
 public:
  Launcher8(P* param, float* master, const G* grad, std::uint8_t* m, float* ma, std::uint8_t* v, float* va, std::int64_t n, int tensors) {
    check(tensors >= 1 && n >= tensors * kernels::kStateBlock, "bench: need 1 <= tensors and 256 elements per tensor");
    const std::int64_t per = n / tensors / kernels::kStateBlock * kernels::kStateBlock;
    for (int i = 0; i < tensors; ++i) {
      const std::int64_t off = i * per, len = i + 1 == tensors ? n - off : per, b = off / kernels::kStateBlock;
      list_.push_back({param + off, master + off, grad + off, m + off, ma + b, v + off, va + b, len});
    }
    if (tensors > 1) table_.upload(list_);
  }
  cudaError_t run(const kernels::AdamWCoeffs& c, const kernels::AdamWDynamic& d, cudaStream_t stream) override {
    if (list_.size() == 1) return kernels::adamw8_cuda<Policy>(list_[0], c, d, stream);
    return kernels::adamw8_cuda<Policy>(table_.view(), c, d, stream);
  }

 private:
  std::vector<kernels::AdamW8Tensor<P, G>> list_;
  kernels::DeviceTensorTable<kernels::AdamW8Tensor<P, G>> table_;
};

}  // namespace

std::vector<std::string> adamw8_variants() {
  return []<class... Policies>(std::tuple<Policies...>*) { return std::vector<std::string>{Policies::name...}; }(
      static_cast<squeeze::bench::adamw8::Shapes*>(nullptr));
}
std::string adamw8_default_variant() { return kernels::AdamW8DefaultPolicy<bf16, bf16>::name; }

std::unique_ptr<AdamWLauncher> make_bf16_mixed_adamw8(const std::string& variant, bf16* param, float* master, const bf16* grad,
                                                      std::uint8_t* m, float* m_absmax, std::uint8_t* v, float* v_absmax, std::int64_t n,
                                                      int tensors) {
  std::unique_ptr<AdamWLauncher> out;
  [&]<class... Policies>(std::tuple<Policies...>*) {
    ((variant == Policies::name ? (void)(out = std::make_unique<Launcher8<Policies, bf16, bf16>>(param, master, grad, m, m_absmax, v,
                                                                                                 v_absmax, n, tensors))
                                : void()),
     ...);
  }(static_cast<squeeze::bench::adamw8::Shapes*>(nullptr));
  check(out != nullptr, "bench: unknown AdamW8 variant " + variant);
  return out;
}

std::unique_ptr<AdamWLauncher> make_fp32_adamw(float* param, const float* grad, float* m, float* v, std::int64_t n, int tensors) {
  return std::make_unique<Launcher<float, float>>(param, nullptr, grad, m, v, n, tensors);
}
std::unique_ptr<AdamWLauncher> make_bf16_mixed_adamw(bf16* param, float* master, const bf16* grad, float* m, float* v, std::int64_t n,
                                                     int tensors) {
  return std::make_unique<Launcher<bf16, bf16>>(param, master, grad, m, v, n, tensors);
}

}  // namespace squeeze::bench
