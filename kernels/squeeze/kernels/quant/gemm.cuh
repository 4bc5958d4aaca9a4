#pragma once
// The library's quantized GEMM: y [M, N] = x [M, K] (fp16 / bf16) * W^T with W in tiles (3, 4 or 8 bits; layout.hpp,
// built at load by quant/tiles.hpp). What QuantizedLinear calls.
//
// Layers, each including only those below it (docs/kernels/quant-gemm.md):
//   gemm.cuh            this entry: the kernel family for a shape and device, its workspace, what it chose in words
//   gemm/mma_sync.cuh   the mma.sync family (any sm_80+ GPU, 3 / 4 / 8 bits)
//   gemm/sm90.cuh       the sm90 family (wgmma or mma.sync consumers in a TMA ring; sm_90a builds, 4 bits)
//   gemm/ptx.cuh        the PTX wrappers both use;  gemm/decode.cuh  codes -> fragment registers (device)
//   gemm/launch_plan.hpp       host plans, the K-split cost model and the configuration each family takes (plain C++)
//   gemm/config.hpp     the configurations as named knobs (plain C++)
//   gemm/cpu.hpp        the CPU twin;  gemm/decode.hpp  the magic-number decode;  gemm/layout.hpp  the tiles
#if !defined(__CUDACC__)
#error \
    "gemm.cuh is a CUDA header: compile this translation unit with nvcc (the host plans: gemm/launch_plan.hpp, the CPU twin: gemm/cpu.hpp)"
#endif

#include <cstdint>
#include <string>

#include "squeeze/kernels/quant/gemm/mma_sync.cuh"
#include "squeeze/kernels/quant/gemm/launch_plan.hpp"
#include "squeeze/kernels/quant/gemm/sm90.cuh"

namespace squeeze::kernels::quant {

// The sm90 family for the 4-bit shapes it takes when this build and device have wgmma (at every batch size: as fast or
// faster than the mma.sync family from M = 1 on; measured: docs/results.md, 4-bit GEMM); the mma.sync family for
// everything else.
inline bool quant_gemm_uses_sm90(const QGemmShape& s) { return qgemm_sm90_reason(s).empty() && qgemm_sm90_supported(); }
// Workspace sizes for quant_gemm_cuda (pointers left null): partial fp32 (any contents) and counters int32 (zero
// before the first call; the kernels leave them zero).
inline QGemmWorkspace quant_gemm_workspace_size(const QGemmShape& s, int sm_count) {
  return quant_gemm_uses_sm90(s) ? qgemm_sm90_workspace_size(s, sm_count) : qgemm_workspace_size(s, sm_count);
}
// The kernel, configuration and plan quant_gemm_cuda takes for this shape, in words (error messages, benchmarks).
inline std::string quant_gemm_describe(const QGemmShape& s, int sm_count) {
  if (quant_gemm_uses_sm90(s)) return "sm90 " + qgemm_sm90_cfg_name(s) + " " + describe(qgemm_sm90_plan(s, sm_count));
  return "mma.sync " + qgemm_cfg_name(s) + " " + describe(qgemm_plan(s, sm_count));
}
// y [M, N] = x [M, K] * W^T (3-, 4- or 8-bit tiles) on `stream` with the kernel quant_gemm_uses_sm90 picks.
// cudaErrorInvalidValue for a shape neither family takes or a workspace smaller than quant_gemm_workspace_size.
template <class T>
cudaError_t quant_gemm_cuda(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y,
                            const QGemmShape& s, const QGemmWorkspace& ws, int sm_count, cudaStream_t stream) {
  if (quant_gemm_uses_sm90(s)) return qgemm_sm90_cuda<T>(x, tiles, scales, zeros, y, s, ws, sm_count, stream);
  return qgemm_cuda<T>(x, tiles, scales, zeros, y, s, ws, sm_count, stream);
}

}  // namespace squeeze::kernels::quant
