#pragma once
// The PTX the quantized GEMM kernels use, one wrapper each: tensor-core mma.sync / ldmatrix, cp.async, streaming loads,
// mbarriers and bulk copies (sm_90), the TMA, wgmma and its descriptors (sm_90a), clusters, named barriers, register
// reallocation and gpu-scope atomics. Instructions that exist only on newer targets compile to nothing elsewhere, so
// the kernels that use them build (empty) for every architecture.
#if !defined(__CUDACC__)
#error "gemm/ptx.cuh is a CUDA header: compile this translation unit with nvcc"
#endif

#include <cstdint>
#include <type_traits>

#include <cuda.h>  // CUtensorMap (the type only)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "squeeze/dtype.hpp"

// wgmma exists only on the arch-specific target sm_90a (nvcc defines __CUDA_ARCH_FEAT_SM90_ALL there).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SQUEEZE_SM90_WGMMA 1
#else
#define SQUEEZE_SM90_WGMMA 0
#endif

namespace squeeze::kernels::quant::detail {

// ---- tensor cores (sm_80+), shared memory, cp.async, streaming loads -----------------------------------------------
// Not volatile: a pure register operation, so the compiler may interleave it with loads and decode.
template <class T>
__device__ __forceinline__ void mma16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  if constexpr (std::is_same_v<T, bf16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&a)[4], const void* smem_row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr));
}

// 16-byte global -> shared copy; src_bytes < 16 zero-fills the rest (0: all zeros, src not read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// 16-byte streaming load of weights: read once, so no L1 allocation; the L2 fetches 256 B around it
// (a warp's 512 B tile rows are contiguous).
__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 lds128(const void* p) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ std::uint32_t ldg_stream32(const std::uint32_t* p) {
  std::uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

// ---- mbarriers and bulk copies into a shared-memory ring (sm_90) -------------------------------------------------
// A "full" barrier per slot completes when the producer's arrive (with the expected byte count) and the
// copy's bytes have both landed; an "empty" barrier per slot completes when every consumer warp released
// it. Phases alternate, so a waiter names the parity of the completion it waits for.
__device__ __forceinline__ unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(std::uint64_t* bar, unsigned count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}
// Makes initialised barriers visible to the other threads and to the async proxy (the copy engine).
__device__ __forceinline__ void mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(std::uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}
// Spins until the barrier's phase with this parity has completed (acquire: the copied bytes are visible).
__device__ __forceinline__ void mbar_wait(std::uint64_t* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned addr = smem_addr(bar);
  unsigned done = 0;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(addr), "r"(parity)
                 : "memory");
  } while (!done);
#endif
}
// bytes (multiple of 16, both addresses 16-byte aligned) global -> shared, completing on bar's tx count.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, std::uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(bytes), "r"(smem_addr(bar))
               : "memory");
#endif
}
__device__ __forceinline__ std::uint32_t lds32(const void* p) {
  std::uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(smem_addr(p)));
  return v;
}

// ---- wgmma (sm_90a) -------------------------------------------------------------------------------------------------
// wgmma ordering: fence before wgmma reads registers written by ordinary instructions; commit closes a group;
// wait<N> returns when at most N groups are in flight (N = 0: every wgmma of this warpgroup finished).
__device__ __forceinline__ void wgmma_fence() {
#if SQUEEZE_SM90_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if SQUEEZE_SM90_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if SQUEEZE_SM90_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Pins a register at this point of the program: after wgmma_wait, so the compiler neither reads an accumulator
// early nor hands an A register an in-flight wgmma still reads to another value (the register stays live, so
// reserved, from its definition to the pin).
__device__ __forceinline__ void pin(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void pin(std::uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
// After a wgmma_wait: the A registers of a finished chunk (live until here, so not reused while it ran).
template <int WM>
__device__ __forceinline__ void pin_a(std::uint32_t (&a)[4][WM][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int t = 0; t < WM; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) pin(a[ks][t][i]);
}
// After a wgmma_wait<0>: every A register and accumulator of the finished wgmma.
template <int WM, int NACC>
__device__ __forceinline__ void pin_operands(std::uint32_t (&a)[4][WM][4], float (&acc)[WM][NACC]) {
  pin_a(a);
#pragma unroll
  for (int t = 0; t < WM; ++t)
#pragma unroll
    for (int i = 0; i < NACC; ++i) pin(acc[t][i]);
}

// ---- gpu-scope counters (K-split reductions) ------------------------------------------------------------------------
// A K-split tile's counter in global memory. The block's partials are ordered before its arrival by a block barrier and
// one thread's release (PTX's memory model: the barrier, then release cumulativity), and the other blocks' partials
// before its reads by that thread's acquire and the next block barrier, so no thread fences on its own (a fence.sc
// in every thread slowed the global-memory reductions).
__device__ __forceinline__ int atom_add_acq_rel_gpu(int* p, int v) {
  int old;
  asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// ---- clusters, named barriers, register reallocation, proxies (sm_90a) ----------------------------------------------
// Every thread of every block of the cluster (release / acquire: shared-memory writes before it are seen by the
// cluster's reads after it).
__device__ __forceinline__ void cluster_sync() {
#if SQUEEZE_SM90_WGMMA
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// The address of the same shared-memory byte in block `rank` of the cluster, and a 16-byte load from it.
__device__ __forceinline__ unsigned map_cluster(unsigned saddr, int rank) {
  unsigned out = saddr;
#if SQUEEZE_SM90_WGMMA
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(saddr), "r"(rank));
#endif
  return out;
}
__device__ __forceinline__ float4 ld_cluster_f4(unsigned caddr) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if SQUEEZE_SM90_WGMMA
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(caddr) : "memory");
#endif
  return v;
}
// Named barrier 1 over the consumer threads only (the producer has left by then).
__device__ __forceinline__ void consumer_bar_sync(int count) { asm volatile("bar.sync 1, %0;\n" ::"r"(count) : "memory"); }
// The register budget of this warp's warpgroup from here on (every warp of the warpgroup executes it).
template <int N>
__device__ __forceinline__ void set_max_regs_dec() {
#if SQUEEZE_SM90_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void set_max_regs_inc() {
#if SQUEEZE_SM90_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
// cp.async writes shared memory through the generic proxy, wgmma reads it through the async proxy.
__device__ __forceinline__ void fence_proxy_async() {
#if SQUEEZE_SM90_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// ---- the TMA and wgmma operands (sm_90a) --------------------------------------------------------------------------
// A 2-D tile of x ([64 k] x [rows] at (k0, m0), 128-byte swizzled as the descriptor expects, zero past the
// tensor's edges) into shared memory by the tensor-memory accelerator, completing on bar's tx count.
__device__ __forceinline__ void tma_load_x(void* dst, const CUtensorMap& map, int k0, int m0, std::uint64_t* bar) {
#if SQUEEZE_SM90_WGMMA
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
                   smem_addr(dst)),
               "l"(reinterpret_cast<std::uint64_t>(&map)), "r"(k0), "r"(m0), "r"(smem_addr(bar))
               : "memory");
#endif
}

// Shared-memory matrix descriptor of a K-major operand with 128-byte swizzle: start address / 16 (bits 0-13),
// leading byte offset 16 B (unused by this layout; bits 16-29), stride byte offset 1024 B between 8-row atoms
// (bits 32-45), layout 1 = 128B swizzle (bits 62-63). Base offset 0: the atoms are 1024-byte aligned.
__device__ __forceinline__ std::uint64_t sw128_desc(std::uint32_t saddr) {
  return std::uint64_t((saddr & 0x3FFFF) >> 4) | (std::uint64_t(16 >> 4) << 16) | (std::uint64_t(1024 >> 4) << 32) |
         (std::uint64_t(1) << 62);
}

// The wgmma wrappers below: one asm text per shape, with the element type (bf16 / f16) spliced in by a local macro.
// m64n16k16, A from registers, B from shared memory (K-major, tnspB 0), fp32 accumulators d[8].
template <class T>
__device__ __forceinline__ void wgmma_rs(float (&d)[8], const std::uint32_t (&a)[4], std::uint64_t desc_b) {
#if SQUEEZE_SM90_WGMMA
#define SQUEEZE_WGMMA_RS_N16(TY)                                                                                                   \
  asm volatile(                                                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"                                                                                 \
      "wgmma.mma_async.sync.aligned.m64n16k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])                             \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1))
  if constexpr (std::is_same_v<T, bf16>)
    SQUEEZE_WGMMA_RS_N16("bf16");
  else
    SQUEEZE_WGMMA_RS_N16("f16");
#undef SQUEEZE_WGMMA_RS_N16
#endif
}

// m64n32k16, A from registers, B from shared memory (K-major, tnspB 0), fp32 accumulators d[16].
template <class T>
__device__ __forceinline__ void wgmma_rs(float (&d)[16], const std::uint32_t (&a)[4], std::uint64_t desc_b) {
#if SQUEEZE_SM90_WGMMA
#define SQUEEZE_WGMMA_RS_N32(TY)                                                                                                \
  asm volatile(                                                                                                                 \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                                                                              \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY                                                                   \
      " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"                      \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), \
        "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])                                            \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1))
  if constexpr (std::is_same_v<T, bf16>)
    SQUEEZE_WGMMA_RS_N32("bf16");
  else
    SQUEEZE_WGMMA_RS_N32("f16");
#undef SQUEEZE_WGMMA_RS_N32
#endif
}

// m64n64k16, A from registers, B from shared memory (K-major, tnspB 0), fp32 accumulators d[32].
template <class T>
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const std::uint32_t (&a)[4], std::uint64_t desc_b) {
#if SQUEEZE_SM90_WGMMA
#define SQUEEZE_WGMMA_RS_N64(TY)                                                                                                          \
  asm volatile(                                                                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                                                        \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY                                                                             \
      " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "        \
      "{%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"                                                                                          \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]),           \
        "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), \
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
        "+f"(d[30]), "+f"(d[31])                                                                                                          \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1))
  if constexpr (std::is_same_v<T, bf16>)
    SQUEEZE_WGMMA_RS_N64("bf16");
  else
    SQUEEZE_WGMMA_RS_N64("f16");
#undef SQUEEZE_WGMMA_RS_N64
#endif
}

// m64n128k16, A from registers, B from shared memory (K-major, tnspB 0), fp32 accumulators d[64].
template <class T>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const std::uint32_t (&a)[4], std::uint64_t desc_b) {
#if SQUEEZE_SM90_WGMMA
#define SQUEEZE_WGMMA_RS_N128(TY)                                                                                                         \
  asm volatile(                                                                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                                                        \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY                                                                            \
      " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%" \
      "34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "         \
      "{%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"                                                                                          \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]),           \
        "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), \
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), \
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
        "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                                                \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1))
  if constexpr (std::is_same_v<T, bf16>)
    SQUEEZE_WGMMA_RS_N128("bf16");
  else
    SQUEEZE_WGMMA_RS_N128("f16");
#undef SQUEEZE_WGMMA_RS_N128
#endif
}

}  // namespace squeeze::kernels::quant::detail
