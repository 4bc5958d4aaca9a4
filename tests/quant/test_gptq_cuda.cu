// GPTQ's column-loop kernel (kernels/quant/gptq_solve.cuh) against its CPU twin (label cuda; skips without a device):
// bit-identical codes, dequantized weights, errors, found grids and the bad-grid flag, since both apply the same math
// with the same roundings. Torch-free, so it builds in seconds on the GPU machine.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <squeeze/kernels/quant/gptq_solve.cuh>

#include "../cuda_buffer.hpp"

namespace kq = squeeze::kernels::quant;
using squeeze::test::Dev;

namespace {
enum class Grids { Found, PerChannel, Static };

struct Problem {
  std::int64_t rows, cols;
  int block, bits;
  std::int64_t group;  // Found: columns per group; Static: groups the columns are dealt to
  Grids grids;
  bool sym;
  float weight_scale = 0.05f;
};

// equal, or both NaN (a scale past fp16's range makes NaN errors, whose bits differ between CPU and GPU)
bool same(float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); }

std::string describe(const Problem& p) {
  return std::to_string(p.rows) + " x " + std::to_string(p.cols) + ", block " + std::to_string(p.block) + ", " + std::to_string(p.bits) +
         " bits, group " + std::to_string(p.group) + ", grids " + std::to_string(int(p.grids)) + (p.sym ? ", sym" : ", asym");
}

// Runs every block of the problem through the twin and the kernel from the same inputs and compares every output.
// W is not updated between blocks (that is the caller's matmul); blocks run in order, so a block that starts inside a
// group reads the grid the block before found.
void expect_kernel_matches_twin(const Problem& p, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit(0.5f, 1.5f);
  const std::int64_t R = p.rows, C = p.cols;
  std::vector<float> w(R * C), u(C * C, 0.f);
  for (auto& x : w) x = p.weight_scale * normal(rng);
  for (std::int64_t i = 0; i < C; ++i) {  // upper triangular, positive diagonal (U of some H^-1)
    u[i * C + i] = unit(rng);
    for (std::int64_t j = i + 1; j < C; ++j) u[i * C + j] = 0.2f * normal(rng);
  }
  const std::int64_t groups = p.grids == Grids::PerChannel ? 1 : p.grids == Grids::Static ? p.group : (C + p.group - 1) / p.group;
  std::vector<float> scales(groups * R, 0.f), zeros(groups * R, 0.f);
  std::vector<std::int32_t> col_group(C, 0);
  if (p.grids != Grids::Found) {  // given grids: from random ranges around the weights'
    for (std::int64_t k = 0; k < groups * R; ++k) {
      const auto g = kq::find_grid(-2.f * p.weight_scale * unit(rng), 2.f * p.weight_scale * unit(rng), p.bits, p.sym);
      scales[k] = g.scale;
      zeros[k] = float(g.zero);
    }
    if (p.grids == Grids::Static)
      for (auto& g : col_group) g = std::int32_t(rng() % std::uint32_t(groups));
  }
  std::vector<float> codes(R * C, -1.f), w_hat(R * C, -1.f);
  int bad = 0;

  Dev<float> dw(w), du(u), dcodes(codes), dw_hat(w_hat), dscales(scales), dzeros(zeros);
  Dev<std::int32_t> dgroup(col_group);
  Dev<int> dbad(std::vector<int>{0});
  for (std::int64_t first = 0; first < C; first += p.block) {
    const std::int64_t count = std::min<std::int64_t>(p.block, C - first);
    std::vector<float> err(R * count, -1.f);
    Dev<float> derr(err);
    auto block = [&](const float* wp, const float* up, const std::int32_t* gp, float* cp, float* qp, float* ep, float* sp, float* zp,
                     int* bp) {
      kq::GptqBlock b;
      b.u = up;
      b.w = wp;
      b.col_group = p.grids == Grids::Static ? gp : nullptr;
      b.codes = cp;
      b.dequantized = qp;
      b.err = ep;
      b.scales = sp;
      b.zeros = zp;
      b.bad_grid = bp;
      b.rows = R;
      b.cols = b.u_pitch = b.w_pitch = C;
      b.first = first;
      b.count = count;
      b.group = p.group;
      b.bits = p.bits;
      b.sym = p.sym;
      b.find_grids = p.grids == Grids::Found;
      return b;
    };
    const auto hb = block(w.data(), u.data(), col_group.data(), codes.data(), w_hat.data(), err.data(), scales.data(), zeros.data(), &bad);
    ASSERT_STREQ(kq::gptq_block_error(hb), "") << describe(p);
    kq::gptq_block_cpu(hb);
    ASSERT_EQ(kq::gptq_block_cuda(block(dw.p, du.p, dgroup.p, dcodes.p, dw_hat.p, derr.p, dscales.p, dzeros.p, dbad.p)), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got_err = derr.get();
    for (std::int64_t k = 0; k < R * count; ++k)
      ASSERT_PRED2(same, got_err[k], err[k]) << describe(p) << ": err of row " << k / count << ", column " << first + k % count;
  }
  const auto got_codes = dcodes.get(), got_w_hat = dw_hat.get(), got_scales = dscales.get(), got_zeros = dzeros.get();
  for (std::int64_t k = 0; k < R * C; ++k) {
    ASSERT_PRED2(same, got_codes[k], codes[k]) << describe(p) << ": code of W[" << k / C << ", " << k % C << "]";
    ASSERT_PRED2(same, got_w_hat[k], w_hat[k]) << describe(p) << ": W_hat[" << k / C << ", " << k % C << "]";
    ASSERT_GE(codes[k], 0.f);  // every column written
  }
  for (std::int64_t k = 0; k < groups * R; ++k) {
    ASSERT_PRED2(same, got_scales[k], scales[k]) << describe(p) << ": scale of group " << k / R << ", row " << k % R;
    ASSERT_PRED2(same, got_zeros[k], zeros[k]) << describe(p) << ": zero of group " << k / R << ", row " << k % R;
    if (p.grids == Grids::Found) ASSERT_GT(scales[k], 0.f) << "every group's grid found";
  }
  EXPECT_EQ(dbad.get()[0], bad) << describe(p);
  EXPECT_EQ(bad, p.weight_scale > 1e5f ? 1 : 0) << describe(p);
}
}  // namespace

// Rows that are not a whole number of warps a thread block (37, 8 a block), blocks cut by cols (300 = 128 + 128 + 44),
// every width, grids found at group starts (32 a group: four a block; 48: blocks that start inside a group; 200: groups
// that run past their block, read from W), per channel and static (a random group a column), both grid kinds; blocks of
// 200 and 256 columns (eight a lane).
TEST(GptqCuda, ColumnLoopKernelIsBitIdenticalToCpuTwin) {
  REQUIRE_DEVICE();
  unsigned seed = 1;
  for (int bits : {2, 3, 4, 8})
    for (bool sym : {true, false}) {
      expect_kernel_matches_twin({37, 300, 128, bits, 32, Grids::Found, sym}, seed++);
      expect_kernel_matches_twin({37, 300, 128, bits, 48, Grids::Found, sym}, seed++);
      expect_kernel_matches_twin({37, 300, 128, bits, 200, Grids::Found, sym}, seed++);
      expect_kernel_matches_twin({37, 300, 128, bits, 0, Grids::PerChannel, sym}, seed++);
      expect_kernel_matches_twin({37, 300, 128, bits, 5, Grids::Static, sym}, seed++);
    }
  expect_kernel_matches_twin({9, 520, 200, 4, 64, Grids::Found, false}, seed++);
  expect_kernel_matches_twin({70, 256, 256, 3, 128, Grids::Found, true}, seed++);
  expect_kernel_matches_twin({1, 31, 128, 4, 16, Grids::Found, false}, seed++);
}

// Weights past fp16's range give a scale above 65504: both set the flag (the caller's error), neither stops.
TEST(GptqCuda, ColumnLoopFlagsScalesPastHalfRange) {
  REQUIRE_DEVICE();
  Problem p{16, 140, 128, 4, 32, Grids::Found, false};
  p.weight_scale = 1e6f;
  expect_kernel_matches_twin(p, 99);
}

TEST(GptqCuda, ColumnLoopRefusesBadBlocks) {
  REQUIRE_DEVICE();
  Dev<float> f(64 * 64);
  Dev<int> flag(1);
  kq::GptqBlock b;
  b.u = b.w = b.codes = b.dequantized = b.err = b.scales = b.zeros = f.p;
  b.bad_grid = flag.p;
  b.rows = 8;
  b.cols = b.u_pitch = b.w_pitch = 64;
  b.count = 64;
  b.group = 32;
  b.find_grids = true;
  EXPECT_STREQ(kq::gptq_block_error(b), "");
  auto refused = [&](auto change, const char* what) {
    kq::GptqBlock c = b;
    change(c);
    EXPECT_STRNE(kq::gptq_block_error(c), "") << what;
    EXPECT_EQ(kq::gptq_block_cuda(c), cudaErrorInvalidValue) << what;
  };
  refused([](kq::GptqBlock& c) { c.bits = 5; }, "5 bits");
  refused([](kq::GptqBlock& c) { c.count = 0; }, "no columns");
  refused([](kq::GptqBlock& c) { c.first = 1; }, "past cols");
  refused([](kq::GptqBlock& c) { c.cols = c.u_pitch = c.w_pitch = 300, c.count = kq::kGptqMaxBlock + 1; }, "block too wide");
  refused([](kq::GptqBlock& c) { c.group = 0; }, "group 0 with found grids");
  refused([](kq::GptqBlock& c) { c.w_pitch = 10; }, "pitch below cols");
  refused([](kq::GptqBlock& c) { c.err = nullptr; }, "null buffer");
}
