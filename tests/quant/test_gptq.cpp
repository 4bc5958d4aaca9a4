// GPTQ solver (libtorch, CPU here): error below RTN on correlated inputs, grid identical to the torch-free
// RTN, packed result == dequantized result, damping retries, dead inputs, act-order / static groups,
// true-sequential capture. Float64 references where numbers are compared. RTN and packing on tensors
// (nn/rtn.hpp) bit for bit against the torch-free quant::rtn_quantize and quant::pack.
#include <gtest/gtest.h>

#include <cstring>
#include <sstream>
#include <tuple>

#include <squeeze/nn/gptq.hpp>
#include <squeeze/nn/quantized_linear.hpp>
#include <squeeze/nn/rtn.hpp>
#include <squeeze/quant/rtn.hpp>

#include "gptq_helpers.hpp"

using namespace squeeze;
using squeeze::nn::GptqOptions;

using squeeze::test::correlated_inputs;
using squeeze::test::output_error;
using squeeze::test::packed_dequant;
using squeeze::test::rtn_dequant;

struct GptqCase {
  int bits, group;
  bool act_order, sym;
};
class GptqBeatsRtn : public ::testing::TestWithParam<GptqCase> {};

TEST_P(GptqBeatsRtn, OutputErrorBelowRtnOnCorrelatedInputs) {
  const auto c = GetParam();
  const std::int64_t out = 48, in = 136;  // in not a multiple of the group or the block
  for (int seed : {0, 1, 2}) {
    auto X = correlated_inputs(1024, in, seed);
    auto W = torch::randn({out, in}, torch::kFloat32);
    nn::Hessian h(in, torch::kCPU);
    h.add(X.to(torch::kFloat32));
    GptqOptions o;
    o.bits = c.bits;
    o.group_size = c.group;
    o.act_order = c.act_order;
    o.sym = c.sym;
    o.block_size = 32;  // several lazy blocks
    const auto r = nn::gptq_quantize(W, h.matrix(), o);
    const double eg = output_error(X, W, r.dequantized), er = output_error(X, W, rtn_dequant(W, c.bits, c.group, c.sym));
    EXPECT_LT(eg, 0.9 * er) << "seed " << seed << " gptq " << eg << " rtn " << er;
    // the packed form is exactly the dequantized result the solver reports
    EXPECT_TRUE(torch::equal(packed_dequant(r.pack()), r.dequantized)) << "seed " << seed;
  }
}
INSTANTIATE_TEST_SUITE_P(Widths, GptqBeatsRtn,
                         ::testing::Values(GptqCase{4, 32, false, true}, GptqCase{4, 0, false, false}, GptqCase{3, 32, true, false},
                                           GptqCase{3, 0, true, true}, GptqCase{2, 32, false, false}, GptqCase{8, 64, true, true}));

TEST(Gptq, OptionsFromPolicy) {
  const auto o = nn::gptq_options<Quantized<3, GPTQ, Group<64>, ActOrder>>();
  EXPECT_EQ(o.bits, 3);
  EXPECT_EQ(o.group_size, 64);
  EXPECT_TRUE(o.act_order);
  const auto pc = nn::gptq_options<Quantized<4, GPTQ, PerChannel>>();
  EXPECT_EQ(pc.group_size, 0);
  EXPECT_FALSE(pc.act_order);
}

TEST(Gptq, DiagonalHessianReproducesTorchFreeRtnExactly) {
  torch::manual_seed(5);
  auto W = torch::randn({20, 70}) * 0.1;
  for (bool sym : {false, true})
    for (int group : {0, 32}) {
      GptqOptions o;
      o.bits = 4;
      o.group_size = group;
      o.sym = sym;
      const auto r = nn::gptq_quantize(W, torch::eye(70) * 3.0, o);
      EXPECT_TRUE(torch::equal(r.dequantized, rtn_dequant(W, 4, group, sym))) << sym << " " << group;
    }
}

TEST(Gptq, StaticGroupsWithActOrderKeepNaturalGroups) {
  const std::int64_t out = 16, in = 96;
  auto X = correlated_inputs(512, in, 3);
  auto W = torch::randn({out, in});
  nn::Hessian h(in, torch::kCPU);
  h.add(X);
  GptqOptions o;
  o.group_size = 32;
  o.act_order = true;
  o.static_groups = true;
  const auto r = nn::gptq_quantize(W, h.matrix(), o);
  auto g = r.g_idx.to(torch::kInt64);
  EXPECT_TRUE(torch::equal(g, torch::floor_divide(torch::arange(in, torch::kInt64), 32)));
  EXPECT_TRUE(torch::equal(packed_dequant(r.pack()), r.dequantized));
  EXPECT_LT(output_error(X, W, r.dequantized), output_error(X, W, rtn_dequant(W, 4, 32, true)));
  // act-order without static groups: g_idx is a permutation of equal-size groups
  o.static_groups = false;
  const auto r2 = nn::gptq_quantize(W, h.matrix(), o);
  EXPECT_TRUE(torch::equal(torch::bincount(r2.g_idx.to(torch::kInt64)), torch::full({3}, 32, torch::kInt64)));
  EXPECT_FALSE(torch::equal(r2.g_idx.to(torch::kInt64), torch::floor_divide(torch::arange(in, torch::kInt64), 32)));  // really permuted
  EXPECT_TRUE(torch::equal(packed_dequant(r2.pack()), r2.dequantized));
}

TEST(Gptq, SingularHessianTakesDampingRetryPath) {
  // H = all-ones (rank 1): with a damping fraction below float32's resolution the factorisation fails,
  // the solver raises the fraction x10 until it succeeds.
  auto W = torch::randn({8, 16});
  GptqOptions o;
  o.percdamp = 1e-9;
  o.max_damp_retries = 8;
  o.group_size = 0;
  const auto r = nn::gptq_quantize(W, torch::ones({16, 16}), o);
  EXPECT_GE(r.damp_retries, 1);
  EXPECT_GT(r.damp_fraction, 1e-9);
  EXPECT_TRUE(r.dequantized.isfinite().all().item<bool>());
  // The default damping handles a rank-deficient data Hessian (fewer samples than inputs) at once.
  nn::Hessian h(64, torch::kCPU);
  h.add(torch::randn({8, 64}));
  const auto r2 = nn::gptq_quantize(torch::randn({8, 64}), h.matrix(), GptqOptions{});
  EXPECT_EQ(r2.damp_retries, 0);
  EXPECT_TRUE(r2.dequantized.isfinite().all().item<bool>());
}

TEST(Gptq, ImpossibleHessianErrorsClearly) {
  auto H = torch::eye(4);
  H.index_put_({0, 1}, 1e6);
  H.index_put_({1, 0}, 1e6);  // strongly indefinite: no damping in reach makes it positive definite
  GptqOptions o;
  o.group_size = 0;
  try {
    nn::gptq_quantize(torch::randn({3, 4}), H, o);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Cholesky factorisation of the damped Hessian failed"), std::string::npos) << e.what();
  }
  auto Hn = torch::eye(4);
  Hn.index_put_({2, 2}, NAN);
  EXPECT_THROW(nn::gptq_quantize(torch::randn({3, 4}), Hn, o), c10::Error);
  EXPECT_THROW(nn::gptq_quantize(torch::randn({3, 5}), torch::eye(4), o), c10::Error);  // shape mismatch
  o.bits = 5;
  EXPECT_THROW(nn::gptq_quantize(torch::randn({3, 4}), torch::eye(4), o), c10::Error);
}

// A scale past fp16's range (weights ~1e6) is refused, whether the column loop finds the grid (groups) or it is set
// before the loop (per channel, static groups); block sizes past the column loop's 256 are refused up front.
TEST(Gptq, WeightsPastHalfRangeAndWideBlocksErrorClearly) {
  const auto W = torch::randn({8, 64}) * 1e6;
  for (const auto& [group, static_groups] : {std::pair{32, false}, std::pair{0, false}, std::pair{32, true}}) {
    GptqOptions o;
    o.group_size = group;
    o.static_groups = static_groups;
    o.act_order = static_groups;
    o.sym = false;
    try {
      nn::gptq_quantize(W, torch::eye(64), o);
      ADD_FAILURE() << "expected an error, group " << group << (static_groups ? " static" : "");
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("too large for an fp16 scale"), std::string::npos) << e.what();
    }
  }
  GptqOptions o;
  o.block_size = 257;
  try {
    nn::gptq_quantize(torch::randn({8, 64}), torch::eye(64), o);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("block_size must be in 1..256"), std::string::npos) << e.what();
  }
}

// A layer of no outputs or no inputs is named as such, not refused by the column loop's bounds check.
TEST(Gptq, EmptyWeightErrorsClearly) {
  for (const auto& [rows, cols] : {std::pair{0, 64}, std::pair{8, 0}}) {
    try {
      nn::gptq_quantize(torch::randn({rows, cols}), torch::eye(cols), GptqOptions{});
      ADD_FAILURE() << "expected an error for [" << rows << ", " << cols << "]";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("is empty"), std::string::npos) << e.what();
    }
  }
}

TEST(Gptq, DeadInputsGetZeroWeight) {
  auto X = correlated_inputs(256, 40, 9).to(torch::kFloat32);
  X.index_put_({torch::indexing::Slice(), 5}, 0.0);
  X.index_put_({torch::indexing::Slice(), 17}, 0.0);
  nn::Hessian h(40, torch::kCPU);
  h.add(X);
  GptqOptions o;
  o.group_size = 16;
  o.act_order = true;
  const auto r = nn::gptq_quantize(torch::randn({6, 40}), h.matrix(), o);
  EXPECT_TRUE(r.dequantized.isfinite().all().item<bool>());
  EXPECT_EQ(r.dequantized.select(1, 5).abs().max().item<float>(), 0.f);
  EXPECT_EQ(r.dequantized.select(1, 17).abs().max().item<float>(), 0.f);
}

TEST(Gptq, HessianIsTwiceMeanOuterProductAcrossBatches) {
  auto X = torch::randn({3, 50, 12}, torch::kFloat64);
  nn::Hessian h(12, torch::kCPU);
  h.add(X.index({0}));
  h.add(X.index({torch::indexing::Slice(1, 3)}));  // [2, 50, 12]: leading dims are samples
  auto X2 = X.reshape({-1, 12});
  auto ref = X2.t().matmul(X2) * (2.0 / 150.0);
  EXPECT_EQ(h.samples(), 150);
  EXPECT_TRUE(torch::allclose(h.matrix().to(torch::kFloat64), ref, 1e-5, 1e-5));  // float32 accumulation
}

namespace {
struct MlpImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  MlpImpl() {
    a = register_module("a", torch::nn::Linear(24, 40));
    b = register_module("b", torch::nn::Linear(24, 40));
    c = register_module("c", torch::nn::Linear(40, 16));
  }
  torch::Tensor forward(const torch::Tensor& x) { return nn::observe(c, torch::relu(nn::observe(a, x)) * nn::observe(b, x)); }
};
TORCH_MODULE(Mlp);
}  // namespace

TEST(Gptq, TrueSequentialCaptureQuantizesLayerByLayer) {
  torch::manual_seed(11);
  Mlp m;
  auto X = correlated_inputs(512, 24, 4).to(torch::kFloat32);
  torch::Tensor ref;
  {
    torch::NoGradGuard ng;
    ref = m->forward(X).to(torch::kFloat64);
  }
  auto Wc = m->c->weight.detach().clone();
  // RTN of the same layers (same grid options) as the baseline
  Mlp rtn;
  {
    torch::NoGradGuard ng;
    for (auto [dst, src] : {std::pair{rtn->a, m->a}, std::pair{rtn->b, m->b}, std::pair{rtn->c, m->c}}) {
      dst->weight.copy_(rtn_dequant(src->weight.detach(), 4, 8, true));
      dst->bias.copy_(src->bias);
    }
  }
  int forwards = 0;
  GptqOptions o;
  o.group_size = 8;
  const auto packed = nn::gptq_sequential(
      {{{"a", m->a}, {"b", m->b}}, {{"c", m->c}}},
      [&] {
        ++forwards;
        m->forward(X);
      },
      o);
  EXPECT_EQ(forwards, 2);
  ASSERT_EQ(packed.size(), 3u);
  // the live weights are the dequantized packed ones (so later steps calibrated on quantized outputs)
  for (auto& [name, lin] : std::vector<nn::NamedLinear>{{"a", m->a}, {"b", m->b}, {"c", m->c}}) {
    EXPECT_TRUE(torch::equal(packed_dequant(packed.at(name)), lin->weight.detach())) << name;
    EXPECT_EQ(std::int64_t(packed.at(name).bias.size()), lin->weight.size(0));
  }
  EXPECT_FALSE(torch::equal(Wc, m->c->weight.detach()));
  torch::NoGradGuard ng;
  const double rel = (m->forward(X).to(torch::kFloat64) - ref).norm().item<double>() / ref.norm().item<double>();
  const double rel_rtn = (rtn->forward(X).to(torch::kFloat64) - ref).norm().item<double>() / ref.norm().item<double>();
  EXPECT_LT(rel, rel_rtn) << "gptq " << rel << " rtn " << rel_rtn;
  // a layer the forward never routes through observe() is an error, not a silent identity
  torch::nn::Linear stray(24, 4);
  EXPECT_THROW(nn::gptq_sequential(
                   {{{"stray", stray}}}, [&] { m->forward(X); }, o),
               c10::Error);
}

// stop_when_complete: each forward ends (nn::CaptureComplete) once a and b have seen their input, before c runs; the
// Hessians are those of full forwards, pass after pass.
TEST(Gptq, CaptureStopsTheForwardOnceItsLayersHaveSeenTheirInput) {
  torch::manual_seed(12);
  Mlp m;
  const auto X = torch::randn({3, 64, 24});
  torch::NoGradGuard ng;
  const std::vector<nn::NamedLinear> step = {{"a", m->a}, {"b", m->b}};
  std::vector<torch::Tensor> full;
  {
    nn::HessianCapture capture(step);
    for (int i = 0; i < 3; ++i) m->forward(X[i]);
    full = {capture.at("a").matrix().clone(), capture.at("b").matrix().clone()};
  }
  nn::HessianCapture capture(step, /*stop_when_complete=*/true);
  int stopped = 0;
  for (int i = 0; i < 3; ++i) {
    try {
      m->forward(X[i]);
    } catch (const nn::CaptureComplete&) {
      ++stopped;
    }
  }
  EXPECT_EQ(stopped, 3);
  EXPECT_EQ(capture.at("a").samples(), 3 * 64);
  EXPECT_TRUE(torch::equal(capture.at("a").matrix(), full[0]));
  EXPECT_TRUE(torch::equal(capture.at("b").matrix(), full[1]));
}

// ---- QuantizedLinear (CPU path: dequantize twin + matmul) ----------------------------------------------------
// The fused GEMM's batch-row limit: by kernel unless set (3 / 4 bits on the mma.sync kernel 64, 8 bits 32; a host
// translation unit never sees the Hopper kernel, whose 1024 test_lora_cuda checks); 0 restores it, negative is refused.
TEST(QuantizedLinear, MaxFusedRowsDefaultsByKernelAndCanBeSet) {
  for (const auto& [bits, rows] : {std::pair{3, 64}, std::pair{4, 64}, std::pair{8, 32}}) {
    const torch::Tensor w = torch::randn({32, 64});
    nn::QuantizedLinear q(quant::rtn_quantize({w.data_ptr<float>(), std::size_t(w.numel())}, 32, 64, {.bits = bits, .group_size = 32}));
    EXPECT_EQ(q->max_fused_rows(), rows) << bits;
    q->set_max_fused_rows(300);
    EXPECT_EQ(q->max_fused_rows(), 300);
    q->set_max_fused_rows(0);
    EXPECT_EQ(q->max_fused_rows(), rows);
    try {
      q->set_max_fused_rows(-1);
      ADD_FAILURE() << "a negative limit was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("max_fused_rows must be >= 0"), std::string::npos) << e.what();
    }
    EXPECT_EQ(q->max_fused_rows(), rows);  // the refused value changed nothing
  }
}

TEST(QuantizedLinear, CpuForwardMatchesFloat64DequantMatmul) {
  // tolerance: float32 matmul over `in` terms, 1e-5 relative to sum |x||w| (+ bias exactly in fp16)
  for (int bits : {3, 4, 8}) {
    auto X = correlated_inputs(64, 72, bits).to(torch::kFloat32);
    nn::Hessian h(72, torch::kCPU);
    h.add(X);
    GptqOptions o;
    o.bits = bits;
    o.group_size = 32;
    o.act_order = bits != 8;
    auto W = torch::randn({30, 72});
    auto p = nn::gptq_quantize(W, h.matrix(), o).pack();
    p.bias.resize(30);
    for (int k = 0; k < 30; ++k) p.bias[k] = from_float<half>(0.1f * float(k));
    nn::QuantizedLinear q(p);
    auto x = torch::randn({2, 5, 72});
    auto y = q->forward(x);
    EXPECT_EQ(y.sizes(), (std::vector<std::int64_t>{2, 5, 30}));
    EXPECT_EQ(q->path_for(x), nn::QuantizedLinearImpl::Path::CpuDequant);
    auto Wd = packed_dequant(p).to(torch::kFloat64);
    auto b = torch::arange(30, torch::kFloat64) * 0.1;
    auto ref = x.to(torch::kFloat64).matmul(Wd.t()) + b.to(torch::kHalf).to(torch::kFloat64);
    auto mag = x.to(torch::kFloat64).abs().matmul(Wd.abs().t());
    EXPECT_TRUE(((y.to(torch::kFloat64) - ref).abs() <= mag * 1e-5 + 1e-6).all().item<bool>()) << bits;
    // bf16 input comes back as bf16
    EXPECT_EQ(q->forward(x.to(torch::kBFloat16)).scalar_type(), torch::kBFloat16);
    EXPECT_THROW(q->forward(torch::randn({3, 71})), c10::Error);
  }
}

// A state dict loaded into a QuantizedLinear (torch::save / torch::load, or buffers written in place) replaces what the
// module derived from its old buffers: the CPU forward then uses the new weights (it cached the dequantized old ones),
// and the act-order hint follows the new g_idx.
TEST(QuantizedLinear, LoadedStateDictReplacesCachedWeightsAndActOrderHint) {
  auto X = correlated_inputs(64, 96, 4).to(torch::kFloat32);
  nn::Hessian h(96, torch::kCPU);
  h.add(X);
  GptqOptions o;
  o.group_size = 32;
  o.act_order = true;
  const auto p_act = nn::gptq_quantize(torch::randn({24, 96}), h.matrix(), o).pack();
  o.act_order = false;
  const auto p_in_order = nn::gptq_quantize(torch::randn({24, 96}), h.matrix(), o).pack();
  nn::QuantizedLinear a(p_act, /*fused_tiles=*/false), b(p_in_order, /*fused_tiles=*/false);
  const auto x = torch::randn({3, 96});
  const auto y_a = a->forward(x), y_b = b->forward(x);
  ASSERT_FALSE(torch::allclose(y_a, y_b));
  EXPECT_TRUE(a->act_order());
  EXPECT_FALSE(b->act_order());
  std::stringstream file;
  torch::save(b, file);
  torch::load(a, file);
  EXPECT_TRUE(torch::equal(a->forward(x), y_b)) << "a's forward after loading b's state";
  EXPECT_FALSE(a->act_order());
  // buffers written in place (copy_) count as well
  nn::QuantizedLinear c(p_act, /*fused_tiles=*/false);
  EXPECT_TRUE(torch::equal(c->forward(x), y_a));
  {
    torch::NoGradGuard ng;
    for (auto& item : c->named_buffers()) item.value().copy_(b->named_buffers()[item.key()]);
  }
  EXPECT_TRUE(torch::equal(c->forward(x), y_b));
  EXPECT_FALSE(c->act_order());
}

// A weight given as a strided view (here the transpose of [in, out] storage, as GPT-2's Conv1D keeps it) is quantized as
// its row-major copy would be: the column loop reads rows at a fixed pitch.
TEST(Gptq, StridedWeightIsQuantizedAsItsContiguousCopy) {
  auto X = correlated_inputs(256, 70, 11).to(torch::kFloat32);
  nn::Hessian h(70, torch::kCPU);
  h.add(X);
  torch::manual_seed(12);
  const auto W = torch::randn({70, 20}).t();  // [20, 70], column-major
  ASSERT_FALSE(W.is_contiguous());
  GptqOptions o;
  o.group_size = 32;
  const auto strided = nn::gptq_quantize(W, h.matrix(), o), dense = nn::gptq_quantize(W.contiguous(), h.matrix(), o);
  EXPECT_TRUE(torch::equal(strided.dequantized, dense.dequantized));
  EXPECT_TRUE(torch::equal(strided.codes, dense.codes));
}

// ---- RTN and packing on tensors (nn/rtn.hpp) against the torch-free quant::rtn_quantize / quant::pack ----------
namespace {
// Rows that reach every branch of the grid: mixed signs, all >= 0 (the asymmetric zero of 0 moved to 1), all <= 0,
// all zero, constant, and ranges tiny enough for fp16-subnormal scales.
torch::Tensor grid_edge_rows(std::int64_t out, std::int64_t in, int seed) {
  torch::manual_seed(seed);
  auto W = torch::randn({out, in}) * 0.05;
  W[1] = W[1].abs();
  W[2] = -W[2].abs();
  W[3].zero_();
  W[4].fill_(0.25);
  W[5] *= 1e-5;
  W[6] *= 1e-7;
  W[7] = torch::randn({in}) * 100;
  return W;
}

void expect_same_packed(const quant::PackedLinear& a, const quant::PackedLinear& b, const std::string& what) {
  EXPECT_EQ(a.bits, b.bits) << what;
  EXPECT_EQ(a.group_size, b.group_size) << what;
  EXPECT_EQ(a.in, b.in) << what;
  EXPECT_EQ(a.out, b.out) << what;
  EXPECT_EQ(a.qweight, b.qweight) << what;
  EXPECT_EQ(a.qzeros, b.qzeros) << what;
  EXPECT_EQ(a.g_idx, b.g_idx) << what;
  ASSERT_EQ(a.scales.size(), b.scales.size()) << what;
  EXPECT_EQ(std::memcmp(a.scales.data(), b.scales.data(), a.scales.size() * sizeof(half)), 0) << what << ": scales";
}
}  // namespace

// Bit for bit: the grid is the same sequence of IEEE float operations, so no tolerance is needed.
TEST(RtnOnTensors, DequantizedAndPackedEqualTorchFreeRtn) {
  for (auto [out, in] : {std::pair<std::int64_t, std::int64_t>{37, 300}, {8, 128}, {9, 1}, {16, 77}})
    for (int group : {128, 32, 7, 0})
      for (int bits : {2, 3, 4, 8})
        for (bool sym : {false, true}) {
          const auto W = grid_edge_rows(out, in, int(out * 1000 + in + bits));
          const std::string what = std::to_string(out) + "x" + std::to_string(in) + " group " + std::to_string(group) + " bits " +
                                   std::to_string(bits) + (sym ? " sym" : " asym");
          const nn::RtnResult r = nn::rtn_quantize(W, bits, group, sym);
          const auto w = W.contiguous();
          const quant::PackedLinear want =
              quant::rtn_quantize({w.data_ptr<float>(), std::size_t(w.numel())}, out, in, {.bits = bits, .group_size = group, .sym = sym});
          ASSERT_TRUE(torch::equal(r.dequantized, packed_dequant(want))) << what;
          expect_same_packed(r.pack(), want, what);
          expect_same_packed(nn::detail::pack_linear_by_tensor_ops(r.codes, r.zeros, r.scales, r.g_idx, bits, group), want,
                             what + " (GPU path)");
        }
}

// llama_gptq flushes float denormals (setFlushDenormal): the fp16-subnormal scales of tiny groups are normal floats, and
// torch's float -> half conversion must still give them as the torch-free one does.
TEST(RtnOnTensors, TinyGroupsEqualTorchFreeRtnWithDenormalsFlushed) {
  if (!at::globalContext().setFlushDenormal(true)) GTEST_SKIP() << "this CPU cannot flush denormals";
  const auto W = grid_edge_rows(16, 300, 3) * 1e-3;  // scales down to fp16's subnormals
  for (int bits : {2, 4, 8})
    for (bool sym : {false, true}) {
      const auto r = nn::rtn_quantize(W, bits, 128, sym);
      EXPECT_TRUE(torch::equal(r.dequantized, rtn_dequant(W, bits, 128, sym))) << bits << (sym ? " sym" : " asym");
    }
  at::globalContext().setFlushDenormal(false);
}

TEST(RtnOnTensors, PackLinearEqualsTorchFreePackOnRandomCodes) {
  torch::manual_seed(11);
  for (auto [out, in, group] :
       {std::tuple<std::int64_t, std::int64_t, int>{37, 300, 128}, {1, 1, 0}, {33, 257, 32}, {5, 64, 0}, {13, 100, 7}, {101, 65, 32}})
    for (int bits : {2, 3, 4, 8}) {
      const std::int64_t groups = group > 0 ? (in + group - 1) / group : 1, maxq = (1 << bits) - 1;
      const auto q = torch::randint(0, maxq + 1, {out, in}, torch::kUInt8);
      const auto z = torch::randint(0, maxq + 1, {groups, out}, torch::kUInt8);  // zero 0 included: v1 wraps it to maxq
      const auto s = torch::rand({groups, out}) * 2 + 1e-3;                      // not fp16 values: both round them
      const auto g = torch::randint(0, groups, {in}, torch::kInt32);             // act-order's g_idx: any group per input
      const quant::PackedLinear want = quant::pack(
          {q.data_ptr<std::uint8_t>(), std::size_t(q.numel())}, {z.data_ptr<std::uint8_t>(), std::size_t(z.numel())},
          {s.data_ptr<float>(), std::size_t(s.numel())}, {g.data_ptr<std::int32_t>(), std::size_t(g.numel())}, out, in, bits, group);
      const std::string what =
          std::to_string(out) + "x" + std::to_string(in) + " group " + std::to_string(group) + " bits " + std::to_string(bits);
      expect_same_packed(nn::pack_linear(q, z, s, g, bits, group), want, what);
      // the path CUDA tensors take, here on the CPU
      expect_same_packed(nn::detail::pack_linear_by_tensor_ops(q, z, s, g, bits, group), want, what + " (GPU path)");
      // and as a GPU packs a large layer (GptqResult::pack): pieces of 32 rows, the last one short, joined on the host
      expect_same_packed(nn::detail::pack_linear_in_pieces(q, z, s, g, bits, group, 32), want, what + " (GPU path, pieces of 32 rows)");
    }
  try {
    const auto q = torch::zeros({64, 8}, torch::kUInt8), z = torch::ones({1, 64}, torch::kUInt8), s = torch::ones({1, 64});
    nn::detail::pack_linear_in_pieces(q, z, s, torch::zeros({8}, torch::kInt32), 4, 0, 48);
    ADD_FAILURE() << "pieces of 48 rows accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rows a piece must be a positive multiple of 32, got 48"), std::string::npos) << e.what();
  }
}

// Large enough that quant::rtn_quantize and quant::pack split the rows over threads (333 rows do not divide among
// them): the same bits as the tensor path, and the first failing row's error whichever thread met it first.
TEST(RtnOnTensors, RowsSplitOverThreadsEqualTheTensorPath) {
  const std::int64_t out = 333, in = 517;
  for (int bits : {3, 4}) {
    const auto W = grid_edge_rows(out, in, 40 + bits);
    const auto w = W.contiguous();
    const quant::PackedLinear got =
        quant::rtn_quantize({w.data_ptr<float>(), std::size_t(w.numel())}, out, in, {.bits = bits, .group_size = 128});
    expect_same_packed(nn::rtn_quantize(W, bits, 128, false).pack(), got, std::to_string(bits) + " bits");
  }
  const auto error_of = [](torch::Tensor W) {
    W = W.contiguous();
    try {
      quant::rtn_quantize({W.data_ptr<float>(), std::size_t(W.numel())}, W.size(0), W.size(1), {});
    } catch (const squeeze::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  auto W = torch::randn({out, in});
  W[300][400] = NAN;
  W[200].mul_(1e30);
  EXPECT_NE(error_of(W).find("too large for an fp16 scale"), std::string::npos);  // row 200 before row 300
  W[100][5] = INFINITY;
  EXPECT_NE(error_of(W).find("not finite"), std::string::npos);
}

// A device packs a large layer a piece of rows at a time (nn::rtn_pack, as quantize_rtn does on a GPU): the pieces joined
// on the host are the whole layer's bits, whatever the piece (32 or 64 rows; the last one short), the bit width and the
// group; the join refuses pieces that cannot make one layer.
TEST(RtnOnTensors, PackedByPiecesOfRowsEqualsTheWholeLayer) {
  for (auto [out, in] : {std::pair<std::int64_t, std::int64_t>{101, 300}, {64, 77}, {33, 129}})
    for (int group : {128, 32, 0})
      for (int bits : {2, 3, 4, 8})
        for (std::int64_t rows : {32, 64}) {
          const auto W = grid_edge_rows(out, in, int(out + in + bits + rows));
          const auto w = W.contiguous();
          const quant::PackedLinear want =
              quant::rtn_quantize({w.data_ptr<float>(), std::size_t(w.numel())}, out, in, {.bits = bits, .group_size = group});
          const std::string what = std::to_string(out) + "x" + std::to_string(in) + " group " + std::to_string(group) + " bits " +
                                   std::to_string(bits) + " rows " + std::to_string(rows);
          expect_same_packed(nn::rtn_pack(W, {.bits = bits, .group_size = group}, rows), want, what);
        }
  const auto W = torch::randn({70, 64});
  const quant::PackedLinear a = nn::rtn_quantize(W.narrow(0, 0, 30), 4, 32, false).pack(),
                            b = nn::rtn_quantize(W.narrow(0, 30, 32), 4, 32, false).pack(),
                            c = nn::rtn_quantize(W.narrow(0, 62, 8), 3, 32, false).pack();
  const auto error_of = [](std::vector<quant::PackedLinear> pieces) {
    try {
      quant::concat_outputs(pieces);
    } catch (const squeeze::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of({a, b}).find("piece 0 has 30 outputs, not a multiple of 32"), std::string::npos) << error_of({a, b});
  EXPECT_NE(error_of({b, c}).find("piece 1 differs in bits"), std::string::npos) << error_of({b, c});
  EXPECT_NE(error_of({}).find("no pieces"), std::string::npos);
  try {
    nn::rtn_pack(W, {}, 48);
    ADD_FAILURE() << "rows 48 accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 32"), std::string::npos) << e.what();
  }
}

TEST(RtnOnTensors, BadInputsErrorClearly) {
  const auto message = [](auto&& f) {
    try {
      f();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  auto W = torch::randn({4, 16});
  W[1][3] = NAN;
  EXPECT_NE(message([&] { nn::rtn_quantize(W, 4, 8, false); }).find("rtn: weight is not finite"), std::string::npos);
  EXPECT_NE(message([&] {
              nn::rtn_quantize(torch::randn({4, 16}) * 1e30, 4, 8, false);
            }).find("too large for an fp16 scale"),
            std::string::npos);
  EXPECT_NE(message([&] { nn::rtn_quantize(torch::randn({4, 16}), 5, 8, false); }).find("bits must be 2, 3, 4 or 8"), std::string::npos);
  const auto codes = torch::full({2, 8}, 16, torch::kUInt8), zeros = torch::ones({1, 2}, torch::kUInt8), scales = torch::ones({1, 2});
  const auto g_idx = torch::zeros({8}, torch::kInt32);
  for (auto pack : {&nn::pack_linear, &nn::detail::pack_linear_by_tensor_ops}) {
    EXPECT_NE(message([&] { pack(codes, zeros, scales, g_idx, 4, 0); }).find("a code is outside [0, 15] for 4 bits"), std::string::npos);
    EXPECT_NE(message([&] { pack(codes.clamp_max(15), zeros * 16, scales, g_idx, 4, 0); }).find("a zero point is outside [0, 15]"),
              std::string::npos);
    EXPECT_NE(message([&] { pack(codes.clamp_max(15), zeros, scales, torch::zeros({7}, torch::kInt32), 4, 0); }).find("g_idx must be [in]"),
              std::string::npos);
    EXPECT_NE(message([&] { pack(codes.to(torch::kInt32), zeros, scales, g_idx, 4, 0); }).find("codes and zero points must be uint8"),
              std::string::npos);
  }
}
