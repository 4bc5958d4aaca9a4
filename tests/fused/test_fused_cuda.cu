// The fused LLaMA ops' CUDA kernels (nvcc TU: nn/fused_ops.hpp dispatches CUDA tensors to rms_norm.cuh, rope.cuh,
// swiglu.cuh) against their CPU twins on the same inputs; label cuda, skips without a device or a CUDA libtorch.
// Shapes: odd widths (scalar path), multiples of 4 (vector path), a misaligned view (scalar path), LLaMA widths
// (4096, 8192) and one wide row (20000 floats: the backward's dweight partial needs opted-in shared memory).
// Tolerances, rel = max |cuda - cpu| / max |cpu|: float32 2e-5 (reduction order), float16 2e-3 and bfloat16 1.6e-2
// (the two sides may round an element to neighbouring values: 2 ulp).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include <squeeze/nn/fused_ops.hpp>
#include <squeeze/nn/llama.hpp>

namespace {

namespace nn = squeeze::nn;

#define REQUIRE_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device (or libtorch without CUDA)"

double rel(const torch::Tensor& got, const torch::Tensor& ref) {
  const torch::Tensor r = ref.cpu().to(torch::kFloat64);
  return (got.cpu().to(torch::kFloat64) - r).abs().max().item<double>() / std::max(r.abs().max().item<double>(), 1e-300);
}
struct DtypeTol {
  torch::ScalarType dt;
  double tol;
};
const std::vector<DtypeTol> kDtypes = {{torch::kFloat32, 2e-5}, {torch::kFloat16, 2e-3}, {torch::kBFloat16, 1.6e-2}};
std::string name(torch::ScalarType dt) { return c10::toString(dt); }

// A contiguous [rows, h] copy of t on `device`, starting one element into its buffer when misaligned.
torch::Tensor place(const torch::Tensor& t, torch::Device device, bool misaligned = false) {
  if (!misaligned) return t.to(device).contiguous();
  torch::Tensor buf = torch::empty({t.numel() + 1}, t.options().device(device));
  torch::Tensor v = buf.narrow(0, 1, t.numel()).view(t.sizes());
  v.copy_(t);
  return v;
}

// Runs f on leaves placed on `device` (requires_grad), backpropagates `seed` into its outputs, returns outputs then grads.
using Op = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;
std::vector<torch::Tensor> run(const Op& f, const std::vector<torch::Tensor>& inputs, torch::Device device, bool misaligned = false) {
  std::vector<torch::Tensor> leaves;
  for (const auto& t : inputs) leaves.push_back(place(t, device, misaligned).detach().requires_grad_(true));
  const std::vector<torch::Tensor> outs = f(leaves);
  std::vector<torch::Tensor> seeds;
  torch::manual_seed(99);
  for (const auto& o : outs) seeds.push_back(torch::randn(o.sizes(), torch::kFloat64).to(o.options()));
  torch::autograd::backward(outs, seeds);
  std::vector<torch::Tensor> result;
  for (const auto& o : outs) result.push_back(o.detach().cpu());
  for (const auto& l : leaves) result.push_back(l.grad().cpu());
  return result;
}

void expect_cuda_matches_cpu(const Op& f, const std::vector<torch::Tensor>& inputs, double tol, const std::string& what) {
  const auto cpu = run(f, inputs, torch::kCPU);
  for (const bool misaligned : {false, true}) {
    const auto gpu = run(f, inputs, torch::kCUDA, misaligned);
    ASSERT_EQ(gpu.size(), cpu.size());
    for (std::size_t i = 0; i < cpu.size(); ++i)
      EXPECT_LT(rel(gpu[i], cpu[i]), tol) << what << (misaligned ? " misaligned" : "") << ": tensor " << i;
  }
}

const std::vector<std::pair<int64_t, int64_t>> kShapes = {{13, 97}, {13, 96}, {1000, 128}, {64, 4096}, {7, 8192}};

TEST(FusedCuda, RmsNormMatchesCpuTwin) {
  REQUIRE_CUDA();
  for (const auto& [dt, tol] : kDtypes)
    for (const auto& [rows, h] : kShapes) {
      torch::manual_seed(1);
      expect_cuda_matches_cpu([](const auto& in) { return std::vector<torch::Tensor>{nn::fused_rms_norm(in[0], in[1], 1e-5)}; },
                              {torch::randn({rows, h}).to(dt), torch::randn({h}).to(dt)}, tol,
                              "rms_norm " + name(dt) + " " + std::to_string(rows) + "x" + std::to_string(h));
    }
  torch::manual_seed(2);  // wide rows: the dweight partial in opted-in shared memory
  expect_cuda_matches_cpu([](const auto& in) { return std::vector<torch::Tensor>{nn::fused_rms_norm(in[0], in[1], 1e-5)}; },
                          {torch::randn({5, 20000}), torch::randn({20000})}, 2e-5, "rms_norm 5x20000");
}

TEST(FusedCuda, AddRmsNormMatchesCpuTwin) {
  REQUIRE_CUDA();
  for (const auto& [dt, tol] : kDtypes)
    for (const auto& [rows, h] : kShapes) {
      torch::manual_seed(3);
      expect_cuda_matches_cpu(
          [](const auto& in) {
            const auto [s, y] = nn::fused_add_rms_norm(in[0], in[1], in[2], 1e-5);
            return std::vector<torch::Tensor>{s, y};
          },
          {torch::randn({rows, h}).to(dt), torch::randn({rows, h}).to(dt), torch::randn({h}).to(dt)}, tol,
          "add_rms_norm " + name(dt) + " " + std::to_string(rows) + "x" + std::to_string(h));
    }
}

TEST(FusedCuda, RopeMatchesCpuTwin) {
  REQUIRE_CUDA();
  for (const auto& [dt, tol] : kDtypes)
    // Four pairs a thread (half a head a multiple of 4: D 8, 64, 128) and one (D 12, 18, and the shifted copy).
    for (const auto& [B, T, H, D] :
         std::vector<std::array<int64_t, 4>>{{2, 13, 3, 18}, {2, 128, 32, 128}, {1, 7, 5, 64}, {3, 5, 2, 8}, {1, 9, 3, 12}})
      for (const bool shifted : {false, true}) {
        const auto [cos, sin] = nn::rope_tables(T, D, 10000.0, torch::kCPU);
        torch::manual_seed(4);
        const auto f = [&, D = D](const std::vector<torch::Tensor>& in) {
          const torch::Tensor c = cos.to(in[0].device()), s = sin.to(in[0].device());
          torch::Tensor x = in[0] * 1;
          if (shifted) {  // rotated one element past an aligned address
            torch::Tensor buf = torch::empty({x.numel() + 1}, x.options().requires_grad(false));
            x = buf.narrow(0, 1, x.numel()).view(x.sizes()).copy_(x);
          }
          return std::vector<torch::Tensor>{nn::fused_rope_(x, c, s, D)};
        };
        expect_cuda_matches_cpu(f, {torch::randn({B, T, H * D}).to(dt)}, tol,
                                "rope " + name(dt) + " D " + std::to_string(D) + (shifted ? " shifted" : ""));
      }
}

TEST(FusedCuda, SwigluMatchesCpuTwin) {
  REQUIRE_CUDA();
  for (const auto& [dt, tol] : kDtypes)
    for (const auto& [rows, h] : kShapes) {
      torch::manual_seed(5);
      expect_cuda_matches_cpu([](const auto& in) { return std::vector<torch::Tensor>{nn::fused_swiglu(in[0], in[1])}; },
                              {(torch::randn({rows, h}) * 3).to(dt), torch::randn({rows, h}).to(dt)}, tol,
                              "swiglu " + name(dt) + " " + std::to_string(rows) + "x" + std::to_string(h));
    }
}

TEST(FusedCuda, KernelsMatchTheTorchOpsPath) {
  REQUIRE_CUDA();
  for (const auto& [dt, tol] : kDtypes) {
    torch::manual_seed(6);
    const torch::Tensor x = torch::randn({64, 4096}).to(dt).cuda(), w = torch::randn({4096}).to(dt).cuda();
    const torch::Tensor kernel = nn::fused_rms_norm(x, w, 1e-5);
    const nn::ForceTorchOps torch_ops;
    EXPECT_LT(rel(kernel, nn::fused_rms_norm(x, w, 1e-5)), tol) << name(dt);
  }
}

TEST(FusedCuda, LlamaFusedMatchesUnfused) {
  REQUIRE_CUDA();
  for (const auto& [dt, tol] : std::vector<DtypeTol>{{torch::kFloat32, 1e-4}, {torch::kBFloat16, 4e-2}}) {
    std::vector<torch::Tensor> out[2];
    for (const bool fused : {false, true}) {
      nn::LlamaConfig c;
      c.vocab = 256, c.hidden = 256, c.layers = 2, c.heads = 4, c.kv_heads = 2, c.ffn = 688, c.fused_kernels = fused;
      torch::manual_seed(7);
      nn::Llama model(c);
      model->to(torch::kCUDA, dt);
      const torch::Tensor ids = torch::randint(256, {2, 64}, torch::kLong).cuda();
      const torch::Tensor logits = model->forward(ids);
      torch::nn::functional::cross_entropy(logits.flatten(0, 1).to(torch::kFloat32), ids.flatten()).backward();
      out[fused].push_back(logits.detach());
      for (const auto& p : model->parameters()) out[fused].push_back(p.grad());
    }
    for (std::size_t i = 0; i < out[0].size(); ++i)
      EXPECT_LT(rel(out[1][i], out[0][i]), i == 0 ? tol : 4 * tol) << name(dt) << " tensor " << i;
  }
}

TEST(FusedCuda, RejectsMixedDevices) {
  REQUIRE_CUDA();
  const torch::Tensor x = torch::randn({4, 8}).cuda(), w = torch::randn({8});
  try {
    (void)nn::fused_rms_norm(x, w);
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("move it with .to(x.device())"), std::string::npos) << e.what();
  }
}

}  // namespace
