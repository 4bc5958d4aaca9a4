#pragma once
// A user's model as the README writes one: squeeze::nn::Embedding / Linear, torch's LayerNorm, and the data.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <squeeze/comm/local.hpp>
#include <squeeze/train.hpp>

namespace frontdoor {

namespace sq = squeeze;
using Params = std::map<std::string, torch::Tensor>;

// Sizes that do not divide by 2, 3 or 4.
struct UserLMImpl : torch::nn::Module {
  sq::nn::Embedding embed{nullptr};
  sq::nn::Linear up{nullptr}, down{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  UserLMImpl(int64_t vocab = 37, int64_t dim = 13)
      : embed(register_module("embed", sq::nn::Embedding(vocab, dim))),
        up(register_module("up", sq::nn::Linear(dim, 3 * dim))),
        down(register_module("down", sq::nn::Linear(torch::nn::LinearOptions(3 * dim, vocab).bias(false)))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))) {}
  torch::Tensor forward(const torch::Tensor& tokens) {  // [B, T] -> [B, T, vocab]
    return down(torch::gelu(up(norm(embed(tokens)))));
  }
};
TORCH_MODULE(UserLM);

// Mean next-token loss over the targets that are not -100.
inline torch::Tensor lm_loss(UserLM& m, const torch::Tensor& seq) {  // seq: [B, T + 1]
  const int64_t T = seq.size(1) - 1;
  auto logits = m(seq.narrow(1, 0, T).clamp_min(0));  // [B, T, V]
  return torch::nn::functional::cross_entropy(logits.flatten(0, 1).to(torch::kFloat32), seq.narrow(1, 1, T).flatten());
}

// The message of what f throws ("" when it does not throw).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

inline Params to_params(const std::vector<std::pair<std::string, torch::Tensor>>& full) {
  Params p;
  for (const auto& [n, t] : full) p[n] = t.detach().to(torch::kFloat32).clone();
  return p;
}

inline void expect_close(const Params& a, const Params& b, double atol, double rtol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [n, t] : a) {
    ASSERT_TRUE(b.count(n)) << what << ": missing " << n;
    EXPECT_TRUE(torch::allclose(t, b.at(n), rtol, atol)) << what << ": " << n << " max |diff| " << (t - b.at(n)).abs().max().item<float>();
  }
}

// 16-bit compute: ranks see other batch sizes, so bf16 rounds forward and backward differently, and Adam turns a
// near-zero gradient's flipped sign into a difference of about lr on that element. Per tensor, the relative
// Frobenius error stays small and no element moves further apart than the updates can carry it (max_abs).
inline void expect_close_16bit(const Params& a, const Params& b, double rel, double max_abs, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [n, t] : a) {
    ASSERT_TRUE(b.count(n)) << what << ": missing " << n;
    const double err = (t - b.at(n)).norm().item<double>() / std::max(1e-12, b.at(n).norm().item<double>());
    EXPECT_LT(err, rel) << what << ": " << n;
    EXPECT_LE((t - b.at(n)).abs().max().item<double>(), max_abs) << what << ": " << n;
  }
}

}  // namespace frontdoor
