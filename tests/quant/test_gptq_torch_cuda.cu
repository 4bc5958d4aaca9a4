// nn::gptq_quantize on CUDA tensors (gptq.hpp compiled by nvcc: the column-loop kernel, cuSOLVER, cuBLAS) against the same
// call on CPU tensors (the CPU twin, LAPACK): the factorisations round differently, so the two solves agree closely but
// not bit for bit; each result must pack without loss and beat RTN. RTN and the v1 packing on CUDA tensors (nn/rtn.hpp)
// against the torch-free quant::rtn_quantize / quant::pack, bit for bit, whole and a piece of rows at a time (rtn_pack).
// Skips where libtorch sees no GPU.
#include <gtest/gtest.h>

#include <cstring>

#include <squeeze/nn/gptq.hpp>
#include <squeeze/nn/rtn.hpp>
#include <squeeze/quant/pack.hpp>
#include <squeeze/quant/rtn.hpp>

#include "gptq_helpers.hpp"

using namespace squeeze;

using squeeze::test::correlated_inputs;
using squeeze::test::output_error;
using squeeze::test::packed_dequant;
using squeeze::test::rtn_dequant;

// 300 inputs (blocks of 128 + 128 + 44; 96 with act-order's sort), 50 outputs: grouped (32, and 100, whose groups cross
// blocks), per channel, act-order, static groups, 3 and 4 bits.
TEST(GptqCuda, QuantizeOnGpuAgreesWithCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "libtorch sees no CUDA device";
  const std::int64_t out = 50, in = 300;
  const auto X = correlated_inputs(2048, in, 7);
  nn::Hessian h(in, torch::kCPU);
  h.add(X.to(torch::kFloat32));
  torch::manual_seed(8);
  const auto W = torch::randn({out, in}) * 0.05;
  struct Case {
    int bits, group;
    bool act_order, static_groups, sym;
  };
  for (const Case c : {Case{4, 32, false, false, true}, Case{3, 100, false, false, false}, Case{4, 0, true, false, false},
                       Case{4, 32, true, false, true}, Case{3, 64, true, true, false}}) {
    nn::GptqOptions o;
    o.bits = c.bits;
    o.group_size = c.group;
    o.act_order = c.act_order;
    o.static_groups = c.static_groups;
    o.sym = c.sym;
    const std::string what = std::to_string(c.bits) + " bits, group " + std::to_string(c.group) + (c.act_order ? ", act-order" : "") +
                             (c.static_groups ? ", static" : "") + (c.sym ? ", sym" : ", asym");
    const auto cpu = nn::gptq_quantize(W, h.matrix(), o);
    const auto gpu = nn::gptq_quantize(W.cuda(), h.matrix().cuda(), o);
    ASSERT_TRUE(gpu.dequantized.is_cuda()) << what;
    EXPECT_NEAR(gpu.loss, cpu.loss, 0.02 * cpu.loss) << what;
    const double same_codes = gpu.codes.cpu().eq(cpu.codes).to(torch::kFloat64).mean().item<double>();
    EXPECT_GT(same_codes, 0.95) << what;
    EXPECT_TRUE(torch::equal(gpu.g_idx.cpu(), cpu.g_idx)) << what;
    EXPECT_TRUE(torch::equal(packed_dequant(gpu.pack()), gpu.dequantized.cpu())) << what << ": the grids pack without loss";
    EXPECT_LT(output_error(X, W, gpu.dequantized), output_error(X, W, rtn_dequant(W, c.bits, c.group, c.sym))) << what;
  }
}

// The grid is the same IEEE float ops on the GPU (divisions by tensors, round half to even, fp16 rounding of the
// scales), so the dequantized weights and the packed words are those of the CPU, exactly; 37 x 300 does not fill the
// groups, and rows 1-7 reach the grid's edge cases (all >= 0, all <= 0, zero, constant, fp16-subnormal scales, wide).
TEST(GptqCuda, RtnAndPackingOnGpuEqualTorchFreeCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "libtorch sees no CUDA device";
  torch::manual_seed(21);
  auto W = torch::randn({37, 300}) * 0.05;
  W[1] = W[1].abs();
  W[2] = -W[2].abs();
  W[3].zero_();
  W[4].fill_(0.25);
  W[5] *= 1e-5;
  W[6] *= 1e-7;
  W[7] = torch::randn({300}) * 100;
  for (int group : {128, 7, 0})
    for (int bits : {2, 3, 4, 8})
      for (bool sym : {false, true}) {
        const std::string what = "group " + std::to_string(group) + ", " + std::to_string(bits) + " bits" + (sym ? ", sym" : ", asym");
        const quant::PackedLinear want = quant::rtn_quantize({W.data_ptr<float>(), std::size_t(W.numel())}, W.size(0), W.size(1),
                                                             {.bits = bits, .group_size = group, .sym = sym});
        const nn::RtnResult gpu = nn::rtn_quantize(W.cuda(), bits, group, sym);
        ASSERT_TRUE(gpu.dequantized.is_cuda()) << what;
        EXPECT_TRUE(torch::equal(gpu.dequantized.cpu(), packed_dequant(want))) << what;
        const quant::PackedLinear got = gpu.pack();  // the bit streams built on the GPU
        EXPECT_EQ(got.qweight, want.qweight) << what;
        EXPECT_EQ(got.qzeros, want.qzeros) << what;
        EXPECT_EQ(got.g_idx, want.g_idx) << what;
        ASSERT_EQ(got.scales.size(), want.scales.size()) << what;
        EXPECT_EQ(std::memcmp(got.scales.data(), want.scales.data(), want.scales.size() * sizeof(half)), 0) << what;
      }
}

// What quantize_rtn does with a weight on a GPU: rtn_pack there, a piece of rows at a time (32 here, so 101 rows make four
// pieces, the last short), bf16 weights as the layer-by-layer build places them: the torch-free CPU path's bits.
TEST(GptqCuda, RtnPackedByPiecesOnGpuEqualsTorchFreeCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "libtorch sees no CUDA device";
  torch::manual_seed(22);
  const auto W = (torch::randn({101, 300}) * 0.05).to(torch::kBFloat16);
  for (int bits : {3, 4})
    for (int group : {128, 0}) {
      const auto w = W.to(torch::kFloat32).contiguous();
      const quant::PackedLinear want =
          quant::rtn_quantize({w.data_ptr<float>(), std::size_t(w.numel())}, w.size(0), w.size(1), {.bits = bits, .group_size = group});
      const quant::PackedLinear got = nn::rtn_pack(W.cuda(), {.bits = bits, .group_size = group}, 32);
      const std::string what = std::to_string(bits) + " bits, group " + std::to_string(group);
      EXPECT_EQ(got.qweight, want.qweight) << what;
      EXPECT_EQ(got.qzeros, want.qzeros) << what;
      EXPECT_EQ(got.g_idx, want.g_idx) << what;
      ASSERT_EQ(got.scales.size(), want.scales.size()) << what;
      EXPECT_EQ(std::memcmp(got.scales.data(), want.scales.data(), want.scales.size() * sizeof(half)), 0) << what;
    }
}

TEST(GptqCuda, WeightsPastHalfRangeErrorClearlyOnGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "libtorch sees no CUDA device";
  auto W = torch::randn({8, 64}) * 1e6;
  nn::GptqOptions o;
  o.group_size = 32;
  o.sym = false;
  try {
    nn::gptq_quantize(W.cuda(), torch::eye(64).cuda(), o);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("too large for an fp16 scale"), std::string::npos) << e.what();
  }
}

// The Hessian from bf16 / fp16 inputs on the GPU (multiplied as they are, fp32 sums) against 2/N X^T X in float64 from
// the same values, over several additions (the running average), 300 features (not a tile multiple).
TEST(GptqCuda, HessianFromHalfInputsOnGpuMatchesFloat64) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "libtorch sees no CUDA device";
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    torch::manual_seed(3);
    const auto X = (torch::randn({3, 700, 300}) * 2.0).to(dtype);
    nn::Hessian h(300, torch::Device(torch::kCUDA));
    for (int b = 0; b < 3; ++b) h.add(X.index({b}).cuda());
    const auto X64 = X.reshape({-1, 300}).to(torch::kFloat64);
    const auto ref = X64.t().matmul(X64) * (2.0 / 2100.0);
    const double err = (h.matrix().cpu().to(torch::kFloat64) - ref).abs().max().item<double>();
    EXPECT_EQ(h.samples(), 2100);
    EXPECT_LT(err, 1e-5 * ref.abs().max().item<double>()) << dtype;  // fp32 sums of exact products
  }
}
