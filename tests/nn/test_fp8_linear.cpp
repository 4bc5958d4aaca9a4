// FP8 GEMMs (Precision<fp8, bf16, float>, nn/fp8_linear.hpp) on the CPU: the operands' scaling and rounding, the three
// GEMMs against an fp32 reference within the formats' error, on sizes that divide nothing; a short training run against
// bf16. The CUDA path (cuBLASLt through at::_scaled_mm) runs the same functions on the GPU machine.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <bit>
#include <cmath>
#include <map>
#include <squeeze/comm/local.hpp>
#include <squeeze/nn/fp8_linear.hpp>
#include <squeeze/nn/llama.hpp>
#include <squeeze/optim/adamw.hpp>
#include <squeeze/plan/memory.hpp>
#include <squeeze/train/trainer.hpp>

using namespace squeeze;

namespace {

constexpr double kE4m3Step = 1.0 / 16;  // half the spacing of a 3-bit mantissa, relative
constexpr double kE5m2Step = 1.0 / 8;   // 2-bit mantissa

torch::Tensor dequantized(const nn::Fp8Operand& o) { return o.values.to(torch::kFloat64) * o.inverse_scale.to(torch::kFloat64); }

// Each value comes back within half a step of its format (relative), or half the smallest subnormal step (absolute).
void expect_rounded(const torch::Tensor& x, torch::ScalarType format, const std::string& what) {
  const nn::Fp8Operand o = nn::to_fp8(x, format);
  ASSERT_EQ(o.values.scalar_type(), format);
  ASSERT_EQ(o.values.sizes(), x.sizes());
  const double rel = format == torch::kFloat8_e4m3fn ? kE4m3Step : kE5m2Step;
  const double tiny = (format == torch::kFloat8_e4m3fn ? std::ldexp(1.0, -10) : std::ldexp(1.0, -17)) * o.inverse_scale.item<double>();
  const torch::Tensor xd = x.to(torch::kFloat64), err = (dequantized(o) - xd).abs();
  EXPECT_TRUE((err <= xd.abs() * rel + tiny).all().item<bool>()) << what << ": worst error " << err.max().item<double>();
}

TEST(Fp8, OperandsRoundWithinTheirFormatsStep) {
  torch::manual_seed(1);
  expect_rounded(torch::randn({37, 53}), torch::kFloat8_e4m3fn, "e4m3, float");
  expect_rounded(torch::randn({13, 7, 3}).to(torch::kBFloat16), torch::kFloat8_e4m3fn, "e4m3, bf16");
  expect_rounded(torch::randn({41, 29}) * 1e-3, torch::kFloat8_e5m2, "e5m2, small gradients");
}

// The scale is a power of two that puts amax in (max/2, max]: the largest magnitude keeps the format's whole range.
TEST(Fp8, ScaleIsAPowerOfTwoThatFillsTheRange) {
  torch::manual_seed(2);
  for (auto [format, top] : {std::pair{torch::kFloat8_e4m3fn, 448.0}, std::pair{torch::kFloat8_e5m2, 57344.0}}) {
    for (double magnitude : {1e-20, 3e-3, 1.0, 7e4, 1e30}) {
      const torch::Tensor x = torch::randn({19, 23}) * magnitude;
      const nn::Fp8Operand o = nn::to_fp8(x, format);
      const double inv = o.inverse_scale.item<double>(), scale = 1.0 / inv;
      EXPECT_EQ(std::exp2(std::round(std::log2(scale))), scale) << "magnitude " << magnitude;
      const double amax = x.abs().max().item<double>();
      EXPECT_LE(amax * scale, top) << "magnitude " << magnitude;
      EXPECT_GT(amax * scale, top / 2) << "magnitude " << magnitude;
      EXPECT_TRUE(torch::isfinite(o.values.to(torch::kFloat32)).all().item<bool>()) << "magnitude " << magnitude;
    }
  }
}

// Overflow and underflow: values far beyond e4m3's 448 or far below its smallest subnormal come back, scaled, within
// the format's step; all zeros keep scale 1; a NaN is not hidden.
TEST(Fp8, OverflowUnderflowZeroAndNaN) {
  expect_rounded(torch::tensor({3e6f, -1e6f, 12.f, 0.f}), torch::kFloat8_e4m3fn, "beyond 448");
  expect_rounded(torch::tensor({1e-12f, -4e-13f, 2e-14f}), torch::kFloat8_e4m3fn, "below the subnormals");
  const nn::Fp8Operand zero = nn::to_fp8(torch::zeros({5, 3}), torch::kFloat8_e4m3fn);
  EXPECT_EQ(zero.inverse_scale.item<float>(), 1.0f);
  EXPECT_TRUE(torch::equal(zero.values.to(torch::kFloat32), torch::zeros({5, 3})));
  const nn::Fp8Operand nan = nn::to_fp8(torch::tensor({1.f, NAN, 2.f}), torch::kFloat8_e4m3fn);
  EXPECT_FALSE(torch::isfinite(dequantized(nan)).all().item<bool>());
}

// The GEMM of FP8 operands equals the float64 product of their dequantized values (fp32 accumulation of products exact
// in fp32), and the fp32 product of the inputs within the formats' error.
TEST(Fp8, GemmMatchesTheReferenceOnSizesThatDivideNothing) {
  torch::manual_seed(3);
  for (auto [m, n, k] : {std::tuple{37, 29, 53}, std::tuple{1, 3, 5}, std::tuple{67, 17, 130}}) {
    const torch::Tensor a = torch::randn({m, k}), b = torch::randn({n, k});
    const nn::Fp8Operand a8 = nn::to_fp8(a, torch::kFloat8_e4m3fn), b8 = nn::to_fp8(b, torch::kFloat8_e5m2);
    const torch::Tensor y = nn::fp8_mm(a8, b8, torch::kFloat32);
    ASSERT_EQ(y.sizes(), torch::IntArrayRef({m, n}));
    const torch::Tensor exact = torch::matmul(dequantized(a8), dequantized(b8).t());
    EXPECT_LE((y.to(torch::kFloat64) - exact).abs().max().item<double>(), 1e-5 * (exact.abs().max().item<double>() + 1))
        << m << "x" << n << "x" << k;
    const torch::Tensor ref = torch::matmul(a.to(torch::kFloat64), b.to(torch::kFloat64).t());
    const torch::Tensor bound = torch::matmul(a.to(torch::kFloat64).abs(), b.to(torch::kFloat64).abs().t()) * (kE4m3Step + kE5m2Step) * 1.1;
    EXPECT_TRUE(((y.to(torch::kFloat64) - ref).abs() <= bound + 1e-6).all().item<bool>()) << m << "x" << n << "x" << k;
  }
}

// On a GPU (cuBLASLt, the operands zero-padded to multiples of 16): the same products as the CPU's reference kernel,
// within the GPU's summation: Hopper's FP8 tensor cores keep fewer bits of the running sum than fp32 (on an H100, a
// 3x130x70 product of randn operands differed by 1.5e-4 of its largest value), so the bound is 2^-11 of the sum of
// the products' magnitudes, element by element. Skipped without a CUDA device.
TEST(Fp8, GemmOnTheGpuMatchesTheCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(8);
  for (auto [m, n, k] : {std::tuple{37, 29, 53}, std::tuple{64, 48, 32}, std::tuple{3, 130, 70}}) {
    const nn::Fp8Operand a = nn::to_fp8(torch::randn({m, k}), torch::kFloat8_e5m2),
                         b = nn::to_fp8(torch::randn({n, k}), torch::kFloat8_e4m3fn);
    const torch::Tensor cpu = nn::fp8_mm(a, b, torch::kFloat32);
    const nn::Fp8Operand ag{a.values.cuda(), a.inverse_scale.cuda()}, bg{b.values.cuda(), b.inverse_scale.cuda()};
    const torch::Tensor gpu = nn::fp8_mm(ag, bg, torch::kFloat32).cpu();
    ASSERT_EQ(gpu.sizes(), cpu.sizes());
    const torch::Tensor magnitude = torch::matmul(dequantized(a).abs(), dequantized(b).abs().t());
    EXPECT_TRUE(((gpu - cpu).abs() <= magnitude * std::ldexp(1.0f, -11) + 1e-6f).all().item<bool>()) << m << "x" << n << "x" << k;
  }
}

// y = x W^T + b, dX and dW through FP8 against fp32 autograd: relative errors of a few percent (e4m3 forward, e5m2
// gradients), on a batch of [3, 11, 45] inputs and a [23, 45] weight.
TEST(Fp8, LinearForwardAndBackwardAgainstFp32) {
  torch::manual_seed(4);
  const torch::Tensor x0 = torch::randn({3, 11, 45}), w0 = torch::randn({23, 45}) * 0.1, b0 = torch::randn({23}),
                      g = torch::randn({3, 11, 23});
  const torch::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  const torch::Tensor y = nn::fp8_linear(x, w, b0);
  y.backward(g);
  const torch::Tensor xr = x0.clone().requires_grad_(true), wr = w0.clone().requires_grad_(true);
  torch::nn::functional::linear(xr, wr, b0).backward(g);
  const torch::Tensor yr = torch::nn::functional::linear(x0, w0, b0);
  const auto rel = [](const torch::Tensor& a, const torch::Tensor& b) { return ((a - b).norm() / b.norm()).item<double>(); };
  EXPECT_LT(rel(y.detach(), yr), 0.05);
  EXPECT_LT(rel(x.grad(), xr.grad()), 0.10);
  EXPECT_LT(rel(w.grad(), wr.grad()), 0.10);
  EXPECT_EQ(x.grad().sizes(), x0.sizes());
  EXPECT_EQ(w.grad().scalar_type(), torch::kFloat32);
}

// A frozen weight: forward keeps no x^T (only the values are cast), dX equals the trained weight's dX bit for bit, and
// no weight gradient appears.
TEST(Fp8, FrozenWeightKeepsNoTransposeAndStillGivesTheInputGradient) {
  torch::manual_seed(13);
  const torch::Tensor x0 = torch::randn({5, 37}), w0 = torch::randn({19, 37}) * 0.1, g = torch::randn({5, 19});
  nn::fp8_input_cache().clear();
  nn::Fp8Saved saved;
  (void)nn::fp8_linear_forward(x0, w0, /*keep_x_t=*/false, saved);
  EXPECT_FALSE(saved.x_t.defined()) << "a frozen weight needs no x^T";
  const torch::Tensor x = x0.clone().requires_grad_(true), xt = x0.clone().requires_grad_(true);
  const torch::Tensor w = w0.clone().requires_grad_(true);
  nn::fp8_linear(x, w0).backward(g);  // w0 frozen
  nn::fp8_linear(xt, w).backward(g);
  EXPECT_TRUE(torch::equal(x.grad(), xt.grad()));
  EXPECT_FALSE(w0.grad().defined());
  EXPECT_TRUE(w.grad().defined());
  nn::fp8_input_cache().clear();
}

// A squeeze::nn::Linear switched to FP8 computes fp8_linear; the switch is refused for a layer without its own weight.
TEST(Fp8, LinearLayerRunsFp8WhenSwitched) {
  torch::manual_seed(5);
  nn::Linear l(torch::nn::LinearOptions(45, 23).bias(true));
  const torch::Tensor x = torch::randn({7, 45});
  const torch::Tensor dense = l->forward(x);
  l->set_fp8_gemms(true);
  EXPECT_TRUE(torch::equal(l->forward(x), nn::fp8_linear(x, l->weight, l->bias)));
  EXPECT_FALSE(torch::equal(l->forward(x), dense)) << "FP8 rounds";
}

using Bf16 = Strategy<Precision<bf16, float>, Checkpointed>;
using Fp8 = Strategy<Precision<fp8, bf16, float>, Checkpointed>;

// Two blocks of 7 linears each, checkpointed, drawn from `seed`.
nn::Llama small_llama(uint64_t seed) {
  nn::LlamaConfig c;
  c.vocab = 61, c.hidden = 48, c.layers = 2, c.heads = 4, c.kv_heads = 2, c.ffn = 88;
  torch::manual_seed(seed);
  nn::Llama model(c);
  model->checkpoint_every = 1;
  return model;
}

template <class S>
std::vector<float> train_losses(int steps, int64_t* fp8_layers = nullptr) {
  nn::Llama model = small_llama(6);
  const nn::LlamaConfig& c = model->config;
  auto t = make_trainer<S>(model, squeeze::AdamW{.lr = 3e-3f}, comm::LocalComm::single());
  if (fp8_layers)
    for (const auto& m : model->modules())
      *fp8_layers += dynamic_cast<nn::LinearImpl*>(m.get()) && dynamic_cast<nn::LinearImpl*>(m.get())->fp8_gemms();
  torch::manual_seed(7);
  const torch::Tensor ids = torch::randint(0, c.vocab, {4, 33}, torch::kInt64);  // one batch, learned by heart
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) losses.push_back(t.step([&] { return model->loss(ids.narrow(1, 0, 32), ids.narrow(1, 1, 32)); }).loss);
  return losses;
}

// Through the trainer: the seven linears of each block run FP8, the head does not, and 30 steps learn a batch as bf16 does
// (the loss falls by more than half in both, and ends within 10% of bf16's).
TEST(Fp8, TrainsLikeBf16) {
  int64_t fp8_layers = 0;
  const std::vector<float> f = train_losses<Fp8>(30, &fp8_layers), b = train_losses<Bf16>(30);
  EXPECT_EQ(fp8_layers, 2 * 7);
  EXPECT_LT(f.back(), 0.5 * f.front());
  EXPECT_LT(b.back(), 0.5 * b.front());
  EXPECT_NEAR(f.back(), b.back(), 0.1 * b.back())
      << "fp8 " << f.front() << " -> " << f.back() << ", bf16 " << b.front() << " -> " << b.back();
}

// Stage 3 runs the same FP8 GEMMs on each block linear's gathered weight and adds their dW to the unit's gradient buffer:
// over 1 and 2 ranks (each on its own token rows, accumulation 1: one reduction order), the parameters after 3 steps
// equal stage 0's bit for bit, and stage 3 with Offload<Host> equals stage 3.
template <class S>
std::map<std::string, torch::Tensor> train_ranks(int world, int steps) {
  std::vector<nn::Llama> models;
  for (int r = 0; r < world; ++r) models.push_back(small_llama(12));
  const nn::LlamaConfig& c = models[0]->config;
  torch::manual_seed(11);
  std::vector<torch::Tensor> ids;
  for (int i = 0; i < steps * world; ++i) ids.push_back(torch::randint(0, c.vocab, {2, 13}, torch::kInt64));
  std::map<std::string, torch::Tensor> out;
  comm::run_ranks(world, [&](std::shared_ptr<comm::LocalComm> comm) {
    const int r = comm->rank();
    train::TrainerOptions o;
    o.replicate = {"*"};
    auto t = make_trainer<S>(models[r], squeeze::AdamW{.lr = 3e-3f}, comm, o);
    int64_t fp8_layers = 0;
    for (const auto& m : models[r]->modules())
      if (auto* l = dynamic_cast<nn::LinearImpl*>(m.get())) fp8_layers += l->fp8_gemms();
    EXPECT_EQ(fp8_layers, 2 * 7);
    for (int s = 0; s < steps; ++s) {
      const torch::Tensor& x = ids[s * world + r];
      t.step([&] { return models[r]->loss(x.narrow(1, 0, 12), x.narrow(1, 1, 12)); });
    }
    auto full = t.full_parameters();
    if (r == 0)
      for (auto& [n, v] : full) out[n] = v.to(torch::kFloat32);
  });
  return out;
}

TEST(Fp8, Stage3GathersTheWeightAndTrainsAsStage0Bitwise) {
  using Z0 = Strategy<Sharded<Stage0>, Precision<fp8, bf16, float>, Checkpointed>;
  using Z3 = Strategy<Sharded<Stage3>, Precision<fp8, bf16, float>, Checkpointed>;
  using Z3Offload = Strategy<Sharded<Stage3>, Offload<Host>, Precision<fp8, bf16, float>, Checkpointed>;
  for (int world : {1, 2}) {
    const auto z0 = train_ranks<Z0>(world, 3), z3 = train_ranks<Z3>(world, 3), z3o = train_ranks<Z3Offload>(world, 3);
    const auto init = train_ranks<Z0>(world, 0);
    ASSERT_EQ(z3.size(), z0.size());
    bool moved = false;
    for (const auto& [name, v] : z0) {
      ASSERT_TRUE(z3.count(name) && z3o.count(name)) << name;
      EXPECT_TRUE(torch::equal(z3.at(name), v)) << "stage 3 vs stage 0, world " << world << ": " << name;
      EXPECT_TRUE(torch::equal(z3o.at(name), v)) << "stage 3 + offload vs stage 0, world " << world << ": " << name;
      moved |= !torch::equal(init.at(name), v);
    }
    EXPECT_TRUE(moved) << "the steps trained nothing";
  }
}

// The planner: FP8 keeps one-byte copies of the linears' inputs and its GEMMs' transient operands; its strategy name says fp8.
// The kernels' encoder (kernels/fp8_cast.hpp, shared by the CUDA kernels and the CPU twin) against torch's own cast,
// byte for byte: every bf16 value (finite, inf, NaN; through float), and float values at the formats' ties,
// subnormals and overflow edges. Beyond 464, which rounds past e4m3fn's largest finite value, libtorch releases
// differ (2.11's cast gives NaN, 2.15's saturates to 448): there ours saturates, and torch's is either.
TEST(Fp8, EncoderEqualsTorchsCastByteForByte) {
  std::vector<float> v;
  for (uint32_t b = 0; b < 65536; ++b) v.push_back(std::bit_cast<float>(b << 16));
  for (float base : {448.f, 464.f, 470.f, 480.f, 57344.f, 61440.f, 61441.f, 65536.f, 0.f})
    for (float nudge : {-1.f, 0.f, 1.f}) v.push_back(std::nextafter(base, base + nudge * INFINITY));
  torch::manual_seed(10);
  const torch::Tensor r = torch::randn({20000}) * torch::exp2(torch::randint(-24, 18, {20000}).to(torch::kFloat32));
  for (int64_t i = 0; i < r.numel(); ++i) v.push_back(r[i].item<float>());
  for (int k = -20; k <= -5; ++k)  // the subnormal steps and the ties between them
    for (int j = 0; j < 16; ++j) v.push_back(std::ldexp(float(j) + 0.5f, k)), v.push_back(-std::ldexp(float(j), k));
  const torch::Tensor x = torch::from_blob(v.data(), {int64_t(v.size())}, torch::kFloat32);
  for (auto [format, f] :
       {std::pair{torch::kFloat8_e4m3fn, kernels::Fp8Format::e4m3}, std::pair{torch::kFloat8_e5m2, kernels::Fp8Format::e5m2}}) {
    const torch::Tensor bytes = x.to(format).view(torch::kUInt8);
    const uint8_t* want = bytes.data_ptr<uint8_t>();
    int64_t wrong = 0;
    for (size_t i = 0; i < v.size(); ++i) {
      const uint8_t ours = kernels::fp8_encode(v[i], f);
      if (f == kernels::Fp8Format::e4m3 && std::fabs(v[i]) > 464.f) {
        const uint8_t sign = std::signbit(v[i]) ? 0x80 : 0;
        EXPECT_EQ(ours, sign | 0x7E) << v[i] << " saturates";
        EXPECT_TRUE(want[i] == (sign | 0x7E) || (want[i] & 0x7F) == 0x7F) << v[i] << ": torch's " << int(want[i]);
        continue;
      }
      if (ours != want[i] && wrong++ < 5)
        ADD_FAILURE() << (f == kernels::Fp8Format::e4m3 ? "e4m3 " : "e5m2 ") << v[i] << ": " << int(kernels::fp8_encode(v[i], f))
                      << " vs torch's " << int(want[i]);
    }
    EXPECT_EQ(wrong, 0);
  }
}

// The kernels' scale (exact, from the exponents) against its torch-ops twin, over magnitudes from subnormal to huge,
// the powers of two at the formats' edges, 0, inf and NaN.
TEST(Fp8, KernelScaleEqualsTheTorchOpsScale) {
  std::vector<float> amax = {0.f, INFINITY, NAN, 1e-45f, 1e-40f, 1e-38f, 448.f, 57344.f, 3.4e38f};
  for (int k = -140; k <= 127; k += 3)
    for (float m : {1.f, 1.75f, 1.7500001f, 1.9999999f}) amax.push_back(std::ldexp(m, k));
  const torch::Tensor a = torch::tensor(amax);
  for (auto [format, f] :
       {std::pair{torch::kFloat8_e4m3fn, kernels::Fp8Format::e4m3}, std::pair{torch::kFloat8_e5m2, kernels::Fp8Format::e5m2}})
    for (size_t i = 0; i < amax.size(); ++i) {
      const float want = nn::fp8_detail::scale_of(a[int64_t(i)], format).item<float>(), got = kernels::fp8_scale(amax[i], f);
      EXPECT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want)) << "amax " << amax[i] << ": " << got << " vs " << want;
      if (amax[i] > 0 && std::isfinite(amax[i]) && got < std::ldexp(1.f, 126))
        EXPECT_LE(double(amax[i]) * got, kernels::fp8_max(f)) << amax[i];
    }
}

// The CPU twin of the kernels and the torch-ops path (CPU tensors' to_fp8) give the same bytes, scale and transpose,
// on sizes that don't divide the kernels' 64-wide tiles, in float, bf16 and half.
TEST(Fp8, CpuTwinEqualsTheTorchOpsPath) {
  torch::manual_seed(11);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16})
    for (auto sizes : {std::vector<int64_t>{37, 130}, std::vector<int64_t>{3, 11, 45}, std::vector<int64_t>{1, 65}}) {
      const torch::Tensor x = (torch::randn(sizes) * 3).to(dtype);
      for (auto format : {torch::kFloat8_e4m3fn, torch::kFloat8_e5m2}) {
        const nn::Fp8Operand twin = nn::to_fp8_twin(x, format, nn::Fp8Layout::both), ops = nn::to_fp8(x, format, nn::Fp8Layout::both);
        EXPECT_TRUE(torch::equal(twin.values.view(torch::kUInt8), ops.values.view(torch::kUInt8))) << dtype << " " << format;
        EXPECT_TRUE(torch::equal(twin.transposed.view(torch::kUInt8), ops.transposed.view(torch::kUInt8))) << dtype << " " << format;
        EXPECT_EQ(twin.inverse_scale.item<float>(), ops.inverse_scale.item<float>());
        EXPECT_EQ(twin.transposed.sizes(), torch::IntArrayRef({sizes.back(), x.numel() / sizes.back()}));
        const nn::Fp8Operand only_t = nn::to_fp8_twin(x, format, nn::Fp8Layout::transposed);
        EXPECT_FALSE(only_t.values.defined());
        EXPECT_TRUE(torch::equal(only_t.transposed.view(torch::kUInt8), twin.transposed.view(torch::kUInt8)));
      }
    }
}

// Linears reading one tensor (q, k, v; gate, up) cast it once and share its FP8 copy; a modified or another tensor
// (also one at a freed tensor's address) is cast again; gradients equal those of separately cast inputs.
TEST(Fp8, LinearsReadingOneTensorShareItsCopy) {
  torch::manual_seed(9);
  nn::Fp8InputCache& cache = nn::fp8_input_cache();
  cache.clear();
  const torch::Tensor w1 = torch::randn({23, 45}) * 0.1, w2 = torch::randn({17, 45}) * 0.1;
  const torch::Tensor x0 = torch::randn({3, 11, 45});
  torch::Tensor x = x0.clone().requires_grad_(true);
  const torch::Tensor y1 = nn::fp8_linear(x, w1), y2 = nn::fp8_linear(x, w2);
  EXPECT_EQ(cache.casts, 1);
  EXPECT_EQ(cache.hits, 1);
  (y1.sum() + (y2 * 2).sum()).backward();
  torch::Tensor xa = x0.clone().requires_grad_(true), xb = x0.clone().requires_grad_(true);
  const torch::Tensor z1 = nn::fp8_linear(xa, w1), z2 = nn::fp8_linear(xb, w2);
  EXPECT_EQ(cache.casts, 3) << "separate tensors, separate casts";
  (z1.sum() + (z2 * 2).sum()).backward();
  EXPECT_TRUE(torch::equal(y1, z1));
  EXPECT_TRUE(torch::equal(y2, z2));
  EXPECT_TRUE(torch::equal(x.grad(), xa.grad() + xb.grad()));
  {
    torch::NoGradGuard no_grad;
    torch::Tensor v = x0.clone();
    (void)nn::fp8_linear(v, w1);
    v.mul_(3);  // modified in place: its version moves on
    const torch::Tensor after = nn::fp8_linear(v, w1);
    EXPECT_EQ(cache.casts, 5);
    EXPECT_TRUE(torch::equal(after, nn::fp8_linear(v.clone(), w1)));
    for (int i = 0; i < 3; ++i) (void)nn::fp8_linear(x0.clone() * double(i + 1), w1);  // each a new tensor, maybe at one address
    EXPECT_EQ(cache.casts, 9);
    EXPECT_EQ(cache.hits, 1);
  }
  cache.clear();
}

// The fused RMSNorm (alone and after a residual add) and SwiGLU write the amax of what they store (forward: y, h;
// backward: dx, dg and du), and the FP8 cast of that tensor takes it (no pass of its own): bytes and scale equal a cast
// that reads the amax itself, in every dtype, on sizes the CPU twins split over threads and sizes they don't; a NaN wins;
// a modified output, or another tensor, is not taken.
TEST(Fp8, NormAndSwigluWriteTheAmaxTheirCastsTake) {
  nn::fp8_amax_from_producers() = true;
  nn::ProducedAmax& notes = nn::produced_amax();
  torch::manual_seed(21);
  const auto expect_taken = [&](const torch::Tensor& y, const std::string& what) {
    const int64_t used = notes.used;
    const nn::Fp8Operand fused = nn::to_fp8(y, torch::kFloat8_e4m3fn, nn::Fp8Layout::both);
    EXPECT_EQ(notes.used, used + 1) << what << ": the cast took the producer's amax";
    const nn::Fp8Operand own = nn::to_fp8(y.clone(), torch::kFloat8_e4m3fn, nn::Fp8Layout::both);
    EXPECT_EQ(notes.used, used + 1) << what << ": a copy is another tensor";
    EXPECT_TRUE(torch::equal(fused.values.view(torch::kUInt8), own.values.view(torch::kUInt8))) << what;
    EXPECT_TRUE(torch::equal(fused.transposed.view(torch::kUInt8), own.transposed.view(torch::kUInt8))) << what;
    EXPECT_EQ(fused.inverse_scale.item<float>(), own.inverse_scale.item<float>()) << what;
  };
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16})
    for (auto sizes : {std::vector<int64_t>{7, 45}, std::vector<int64_t>{3, 101, 257}}) {  // 77,871 elements: several threads
      const auto what = ::testing::Message() << dtype << " " << torch::IntArrayRef(sizes);
      const torch::Tensor x = (torch::randn(sizes) * 3).to(dtype), r = torch::randn(sizes).to(dtype);
      const torch::Tensor w = (torch::rand({sizes.back()}) + 0.5).to(dtype);
      const torch::Tensor y = nn::fused_rms_norm(x, w);
      ASSERT_TRUE(notes.of(y).defined()) << what;
      EXPECT_EQ(notes.of(y).item<float>(), y.abs().max().to(torch::kFloat32).item<float>()) << what;
      expect_taken(y, "rms_norm " + what.GetString());
      expect_taken(y.view({-1, sizes.back()}), "rms_norm, a view of all of it " + what.GetString());
      const auto [sum, y2] = nn::fused_add_rms_norm(x, r, w);
      expect_taken(y2, "add + rms_norm " + what.GetString());
      const torch::Tensor h = nn::fused_swiglu(x, r);
      EXPECT_EQ(notes.of(h).item<float>(), h.abs().max().to(torch::kFloat32).item<float>()) << what;
      expect_taken(h, "swiglu " + what.GetString());
      h.mul_(2);  // modified in place: its version moves on
      EXPECT_FALSE(notes.of(h).defined()) << what;
      EXPECT_FALSE(notes.of(y).defined()) << what << ": only the last two outputs are noted";
    }
  // Backward: the norm's dx (with and without the residual sum's own gradient), SwiGLU's dg and du.
  for (auto dtype : {torch::kFloat32, torch::kBFloat16})
    for (auto sizes : {std::vector<int64_t>{7, 45}, std::vector<int64_t>{3, 101, 257}}) {
      const auto what = ::testing::Message() << dtype << " " << torch::IntArrayRef(sizes);
      const torch::Tensor x = (torch::randn(sizes) * 3).to(dtype), r = torch::randn(sizes).to(dtype), dy = torch::randn(sizes).to(dtype);
      const torch::Tensor w = (torch::rand({sizes.back()}) + 0.5).to(dtype);
      const int64_t rows = x.numel() / sizes.back();
      for (bool with_sum : {false, true}) {
        const nn::fused_detail::RmsForward f = nn::fused_detail::rms_norm_forward(x, r, w, 1e-5);
        const torch::Tensor dx =
            nn::fused_detail::rms_norm_backward(f.sum, w, f.rrms.view({rows}), dy, with_sum ? r : torch::Tensor(), true).first;
        EXPECT_EQ(notes.of(dx).item<float>(), dx.abs().max().to(torch::kFloat32).item<float>()) << what;
        expect_taken(dx, "rms_norm backward " + what.GetString());
      }
      const auto [dg, du] = nn::fused_detail::swiglu_backward(x, r, dy);
      EXPECT_EQ(notes.of(dg).item<float>(), dg.abs().max().to(torch::kFloat32).item<float>()) << what;
      EXPECT_EQ(notes.of(du).item<float>(), du.abs().max().to(torch::kFloat32).item<float>()) << what;
      expect_taken(dg, "swiglu backward, dg " + what.GetString());
      expect_taken(du, "swiglu backward, du " + what.GetString());
    }
  torch::Tensor x = torch::randn({5, 300});
  x[2][7] = NAN;
  const torch::Tensor h = nn::fused_swiglu(x, torch::ones_like(x));
  EXPECT_TRUE(std::isnan(notes.of(h).item<float>())) << "a NaN wins";
  notes.clear();
}

// Training through the trainer takes the producers' amax for the block linears' inputs, and ends bit for bit where the
// casts reading their own amax end.
TEST(Fp8, ProducersAmaxTrainsBitwiseAsTheCastsOwn) {
  const auto run = [](bool from_producers) {
    nn::Llama model = small_llama(16);
    const nn::LlamaConfig& c = model->config;
    auto t = make_trainer<Fp8>(model, squeeze::AdamW{.lr = 3e-3f}, comm::LocalComm::single());
    nn::fp8_amax_from_producers() = from_producers;  // make_trainer turned it on
    nn::produced_amax().clear();
    torch::manual_seed(17);
    const torch::Tensor ids = torch::randint(0, c.vocab, {3, 21}, torch::kInt64);
    for (int s = 0; s < 3; ++s) t.step([&] { return model->loss(ids.narrow(1, 0, 20), ids.narrow(1, 1, 20)); });
    std::pair<int64_t, std::map<std::string, torch::Tensor>> out{nn::produced_amax().used, {}};
    for (auto& [n, v] : t.full_parameters()) out.second[n] = v.to(torch::kFloat32);
    nn::fp8_amax_from_producers() = true;
    return out;
  };
  const auto [used, taken] = run(true);
  const auto [unused, own] = run(false);
  // Each block, each step: in forward and again in its recomputation, q, k, v read the first norm, gate and up the second,
  // down the SwiGLU (3 casts, the cache serving k, v and up); in backward, o's output gradient is the second norm's dx,
  // gate's and up's are SwiGLU's dg and du (down's is the residual stream's, a sum autograd forms: its own pass).
  EXPECT_EQ(used, 3 * 2 * (3 * 2 + 3));
  EXPECT_EQ(unused, 0);
  ASSERT_EQ(taken.size(), own.size());
  for (const auto& [n, v] : taken) EXPECT_TRUE(torch::equal(v, own.at(n))) << n;
}

TEST(Fp8, PlannerCountsTheCopiesAndTheStrategyIsNamed) {
  const plan::ModelShape m = *plan::find_preset("tinyllama-1.1b");
  plan::TrainShape t;
  t.micro_batch = 8, t.seq = 2048;
  using NoCkpt = Strategy<Precision<fp8, bf16, float>>;
  const plan::MemoryPlan f = plan::plan_memory<NoCkpt>(m, t, 1), b = plan::plan_memory<Strategy<Precision<bf16, float>>>(m, t, 1);
  EXPECT_EQ(f.parameters.device, b.parameters.device);
  const int64_t tokens = 8 * 2048, h = m.hidden;
  const int64_t per_block = tokens * ((h + h - 2 * h) + (h + m.ffn - 2 * (h + m.ffn)));  // one FP8 copy per tensor read
  EXPECT_EQ(f.activations.device - b.activations.device,
            m.layers * per_block +
                std::max<int64_t>(0, plan::fp8_gemm_transient(m, tokens, 2) - plan::loss_bytes(m, tokens, 2, t.loss_chunk_tokens, true)));
  EXPECT_EQ(strategy_name<Fp8>(), "Strategy<Precision<fp8, bf16, float>, Checkpointed>");
}

}  // namespace
