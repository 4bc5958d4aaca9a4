#pragma once
// GPTQ's column loop over one block of columns (the lazy-batch solve of nn::gptq_quantize), torch-free: a CPU twin and
// a CUDA kernel with bit-identical results.
//
// Inside a block every row of W is independent: column i (processing order) is quantized on its row's grid, and the
// scaled error err = (w - w_hat) / d_i (d_i = U[i, i], U the upper Cholesky factor of H^-1) is taken off the block's
// later columns, w_j -= err * U[i, j]. The caller spreads the block's errors over the later blocks (one matmul).
// Grids: with find_grids (grouped, not static) a group's grid is found when the loop reaches the group's first column,
// from the row's current values of the group's columns (those past the block as the earlier blocks left them) and
// written to scales / zeros; else every column's grid is read from scales / zeros (static groups, per channel).
// The math is grid.hpp's find_grid / quantize_code / dequantize_code, the division an IEEE one, and the update a rounded
// product then a rounded difference (no fused multiply-add), so the kernel reproduces the twin bit for bit.
//
// Why a kernel: the loop is sequential over columns, and as libtorch ops per column (quantize, error, outer-product
// update: ~12 launches each) it was bound by launch overhead on the GPU. The kernel runs a block of 128 columns of all
// rows in one launch: a warp per row, lane l holding columns l, l + 32, ... in registers; U's row i is read by every
// warp of a thread block at once (L1); an order of magnitude faster than the column loop as libtorch ops (measured:
// docs/results.md, GPTQ quantize).
#include <cmath>
#include <cstdint>

#include "squeeze/kernels/quant/grid.hpp"

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#endif

namespace squeeze::kernels::quant {

inline constexpr int kGptqMaxBlock = 256;  // columns a block may have (8 a lane in the kernel)

// One block: columns [first, first + count) of a [rows, cols] problem. Pointers are host memory for the twin and device
// memory for the kernel; matrices are row-major with the given pitches (elements).
struct GptqBlock {
  const float* u = nullptr;                 // U [cols, cols] (pitch u_pitch): the Cholesky factor of H^-1
  const float* w = nullptr;                 // W [rows, cols] (pitch w_pitch): the weights as earlier blocks left them
  const std::int32_t* col_group = nullptr;  // [cols]: the group of each column's given grid; nullptr = group 0
  float* codes = nullptr;                   // [rows, cols] (pitch w_pitch): the block's columns are written
  float* dequantized = nullptr;             // [rows, cols] (pitch w_pitch)
  float* err = nullptr;                     // [rows, count]: err of the block's columns
  float* scales = nullptr;                  // [groups, rows]: read (given grids) or written (found grids)
  float* zeros = nullptr;                   // [groups, rows], as floats
  int* bad_grid = nullptr;                  // set to 1 when a found scale is not finite or above fp16's 65504
  std::int64_t rows = 0, cols = 0, u_pitch = 0, w_pitch = 0;
  std::int64_t first = 0, count = 0;
  std::int64_t group = 0;  // columns per group when find_grids
  int bits = 4;
  bool sym = true;
  bool find_grids = false;
};

// Why a block is refused ("" when it is fine).
inline const char* gptq_block_error(const GptqBlock& b) {
  if (!b.u || !b.w || !b.codes || !b.dequantized || !b.err || !b.scales || !b.zeros || !b.bad_grid) return "a buffer is null";
  if (b.bits != 2 && b.bits != 3 && b.bits != 4 && b.bits != 8) return "bits must be 2, 3, 4 or 8";
  if (b.rows < 1 || b.cols < 1 || b.u_pitch < b.cols || b.w_pitch < b.cols) return "rows / cols / pitches out of range";
  if (b.count < 1 || b.count > kGptqMaxBlock || b.first < 0 || b.first + b.count > b.cols) return "the block's columns are out of range";
  if (b.find_grids && b.group < 1) return "find_grids needs a group size >= 1";
  if (b.rows > std::int64_t(INT32_MAX) * 8) return "too many rows";
  return "";
}

// w - e * h with the product rounded first (the twin and the kernel alike).
SQUEEZE_HD float minus_product(float w, float e, float h) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(w, __fmul_rn(e, h));
#else
  const float p = e * h;
  return w - p;
#endif
}

SQUEEZE_HD bool grid_fits_half(const Grid& g) { return g.scale <= 65504.f && g.scale == g.scale; }

// ---- CPU twin --------------------------------------------------------------------------------------------------
inline void gptq_block_cpu(const GptqBlock& b) {
  const int count = int(b.count);
#if defined(_OPENMP)
#pragma omp parallel for schedule(static)
#endif
  for (std::int64_t r = 0; r < b.rows; ++r) {
    float v[kGptqMaxBlock];
    const float* const wrow = b.w + r * b.w_pitch;
    for (int j = 0; j < count; ++j) v[j] = wrow[b.first + j];
    Grid grid{1.f, 0};
    std::int64_t grid_group = -1;
    for (int i = 0; i < count; ++i) {
      const std::int64_t col = b.first + i;
      if (b.find_grids && col % b.group == 0) {
        const std::int64_t end = std::min(b.cols, col + b.group);
        float lo = INFINITY, hi = -INFINITY;
        for (std::int64_t c = col; c < end; ++c) {
          const float x = c < b.first + count ? v[c - b.first] : wrow[c];
          lo = fminf(lo, x);
          hi = fmaxf(hi, x);
        }
        grid = find_grid(lo, hi, b.bits, b.sym);
        grid_group = col / b.group;
        b.scales[grid_group * b.rows + r] = grid.scale;
        b.zeros[grid_group * b.rows + r] = float(grid.zero);
        if (!grid_fits_half(grid)) *b.bad_grid = 1;
      } else {
        const std::int64_t g = b.find_grids ? col / b.group : b.col_group ? b.col_group[col] : 0;
        if (g != grid_group) {
          grid = {b.scales[g * b.rows + r], std::uint32_t(b.zeros[g * b.rows + r])};
          grid_group = g;
        }
      }
      const float w = v[i];
      const std::uint32_t code = quantize_code(w, grid, b.bits);
      const float w_hat = dequantize_code(code, grid);
      const float* const urow = b.u + col * b.u_pitch + b.first;
      const float e = (w - w_hat) / urow[i];
      b.codes[r * b.w_pitch + col] = float(code);
      b.dequantized[r * b.w_pitch + col] = w_hat;
      b.err[r * b.count + i] = e;
      for (int j = i + 1; j < count; ++j) v[j] = minus_product(v[j], e, urow[j]);
    }
  }
}

#if defined(__CUDACC__)
namespace detail {
constexpr int kGptqWarps = 8;  // rows a thread block (one warp each)

template <int LANE_COLS>
__global__ void __launch_bounds__(32 * kGptqWarps) gptq_block_kernel(const GptqBlock b) {
  const int lane = threadIdx.x & 31;
  const std::int64_t r = std::int64_t(blockIdx.x) * kGptqWarps + (threadIdx.x >> 5);
  if (r >= b.rows) return;  // whole warps
  const int count = int(b.count);
  const float* const wrow = b.w + r * b.w_pitch;
  // lane l holds the block's columns l + 32 t: the current weight, then its code, w_hat and err once quantized
  float v[LANE_COLS], code_out[LANE_COLS], w_hat_out[LANE_COLS], err_out[LANE_COLS];
#pragma unroll
  for (int t = 0; t < LANE_COLS; ++t) {
    const int j = lane + 32 * t;
    v[t] = j < count ? wrow[b.first + j] : 0.f;
    code_out[t] = w_hat_out[t] = err_out[t] = 0.f;
  }
  Grid grid{1.f, 0};
  std::int64_t grid_group = -1;
  for (int i = 0; i < count; ++i) {
    const std::int64_t col = b.first + i;
    if (b.find_grids && col % b.group == 0) {
      const std::int64_t end = min(b.cols, col + b.group);
      float lo = INFINITY, hi = -INFINITY;
#pragma unroll
      for (int t = 0; t < LANE_COLS; ++t) {
        const int j = lane + 32 * t;
        if (j >= i && j < count && b.first + j < end) {
          lo = fminf(lo, v[t]);
          hi = fmaxf(hi, v[t]);
        }
      }
      for (std::int64_t c = b.first + count + lane; c < end; c += 32) {
        const float x = wrow[c];
        lo = fminf(lo, x);
        hi = fmaxf(hi, x);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
      }
      grid = find_grid(lo, hi, b.bits, b.sym);
      grid_group = col / b.group;
      if (lane == 0) {
        b.scales[grid_group * b.rows + r] = grid.scale;
        b.zeros[grid_group * b.rows + r] = float(grid.zero);
        if (!grid_fits_half(grid)) atomicExch(b.bad_grid, 1);
      }
    } else {
      const std::int64_t g = b.find_grids ? col / b.group : b.col_group ? b.col_group[col] : 0;
      if (g != grid_group) {
        grid = {b.scales[g * b.rows + r], std::uint32_t(b.zeros[g * b.rows + r])};
        grid_group = g;
      }
    }
    // column i from its lane (t is the same for the whole warp: no local-memory indexing)
    const int owner = i & 31, ti = i >> 5;
    float mine = 0.f;
#pragma unroll
    for (int t = 0; t < LANE_COLS; ++t)
      if (t == ti) mine = v[t];
    const float w = __shfl_sync(0xffffffffu, mine, owner);
    const std::uint32_t code = quantize_code(w, grid, b.bits);
    const float w_hat = dequantize_code(code, grid);
    const float* const urow = b.u + col * b.u_pitch + b.first;
    const float e = __fdiv_rn(w - w_hat, urow[i]);
#pragma unroll
    for (int t = 0; t < LANE_COLS; ++t) {
      const int j = lane + 32 * t;
      if (j == i) {
        code_out[t] = float(code);
        w_hat_out[t] = w_hat;
        err_out[t] = e;
      } else if (j > i && j < count) {
        v[t] = minus_product(v[t], e, urow[j]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < LANE_COLS; ++t) {
    const int j = lane + 32 * t;
    if (j < count) {
      b.codes[r * b.w_pitch + b.first + j] = code_out[t];
      b.dequantized[r * b.w_pitch + b.first + j] = w_hat_out[t];
      b.err[r * b.count + j] = err_out[t];
    }
  }
}
}  // namespace detail

// Runs the block on `stream` (asynchronous; a found scale out of fp16's range sets *bad_grid).
inline cudaError_t gptq_block_cuda(const GptqBlock& b, cudaStream_t stream = nullptr) {
  if (*gptq_block_error(b)) return cudaErrorInvalidValue;
  const dim3 grid(unsigned((b.rows + detail::kGptqWarps - 1) / detail::kGptqWarps)), block(32 * detail::kGptqWarps);
  if (b.count <= 128)
    detail::gptq_block_kernel<4><<<grid, block, 0, stream>>>(b);
  else
    detail::gptq_block_kernel<8><<<grid, block, 0, stream>>>(b);
  return cudaGetLastError();
}
#endif

}  // namespace squeeze::kernels::quant
