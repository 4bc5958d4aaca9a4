// Tensor-core instruction rates on one SM (sm_90a): cycles per m64nNk16 bf16 wgmma with A from registers (RS, what
// the sm90 GEMM issues: the decoded weights are the A operand) or from shared memory (SS), at N = 16 (the 16-row batch
// slices) and N = 128, with 1, 2 or 4 warpgroups per SM issuing them, waiting after every 4 (one 64-k chunk, as the
// GEMM's consumers do) or keeping a group in flight.
// Why: at batch 16 on 8192 x 28672 the GEMM spends 0.060 ms where its copies alone take 0.035 and the kernel without
// its decode 0.043 (bench_qgemm_sm90 --probes), and one more RS wgmma per three (a folded zero point) cost more than
// the decode it removed. If an RS m64n16k16 costs an SM tens of cycles whatever N is, the weights would be better
// the B operand of m64n128k16 / m64n256k16 wgmma from shared memory (x as A): 2048 / 4096 weights per instruction against
// 1024 now.
// H200: A from registers at N = 16 13.2-15.3 cycles per wgmma with two or four warpgroups
// (25.0 with one), from shared memory 20.0; at N = 128 64.0 cycles both ways (2048 FMA per cycle, the dense rate). So
// the GEMM's register-A m64n16k16 stream 77 weights a cycle per SM, and weights as the B operand of m64n128k16 (x's
// rows padded to 64) only 32: not pursued; and the tensor cores' rate does not bound the GEMM at batches up to 16.
// Each block (one per SM) runs ITERS chunks of 4 wgmma per warpgroup on constant operands (the rate does not depend
// on the values), timed by clock64 on the SM; a line per case: cycles per wgmma per SM and FMAs per cycle per SM.
// Usage: bench_wgmma_rate [--out FILE] [--iters N]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <squeeze/error.hpp>
#include <squeeze/kernels/quant/gemm/ptx.cuh>
#include <squeeze/kernels/quant/gemm/sm90.cuh>  // qgemm_sm90_supported

#include "gemm_timing.cuh"

namespace {
namespace kq = squeeze::kernels::quant;
namespace kd = squeeze::kernels::quant::detail;

// m64n16k16, A and B from shared memory (both K-major, 128-byte swizzle), fp32 accumulators d[8].
__device__ __forceinline__ void wgmma_ss_n16(float (&d)[8], std::uint64_t desc_a, std::uint64_t desc_b) {
#if SQUEEZE_SM90_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(desc_a), "l"(desc_b), "n"(1));
#endif
}
// m64n128k16, A and B from shared memory (both K-major, 128-byte swizzle), fp32 accumulators d[64].
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], std::uint64_t desc_a, std::uint64_t desc_b) {
#if SQUEEZE_SM90_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "n"(1));
#endif
}

// smem: A [64][64 k] then B [N][64 k], bf16, 128-byte swizzled K-major atoms (sw128_desc); filled with small values.
// cycles[block] = the block's clock64 span. WAIT_EACH: wgmma_wait<0> after every chunk (the GEMM's consumers) or
// wgmma_wait<1> (one chunk in flight).
template <int N, bool SS, int WGS, bool WAIT_EACH>
__global__ void __launch_bounds__(128 * WGS, 1) wgmma_rate_kernel(int iters, long long* cycles, float* sink) {
#if SQUEEZE_SM90_WGMMA
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + ((1024 - (kd::smem_addr(smem_raw) & 1023)) & 1023);
  constexpr int A_BYTES = 64 * 128, B_BYTES = N * 128;
  for (int i = threadIdx.x; i < (A_BYTES + B_BYTES) / 4; i += blockDim.x)
    reinterpret_cast<std::uint32_t*>(smem)[i] = 0x3C003C00u ^ (std::uint32_t(i % 13) << 3);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const std::uint64_t desc_a = kd::sw128_desc(kd::smem_addr(smem)), desc_b = kd::sw128_desc(kd::smem_addr(smem + A_BYTES));
  const std::uint32_t a[4] = {0x3F803F80u, 0x3F003F00u, 0x3E803E80u, 0x3F803F00u};
  float d[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    kd::wgmma_fence();  // as the GEMM's consumers do before each chunk's wgmma
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if constexpr (SS) {
        if constexpr (N == 16) wgmma_ss_n16(d, desc_a + 2 * ks, desc_b + 2 * ks);
        else wgmma_ss_n128(d, desc_a + 2 * ks, desc_b + 2 * ks);
      } else {
        kd::wgmma_rs<__nv_bfloat16>(d, a, desc_b + 2 * ks);
      }
    }
    kd::wgmma_commit();
    if constexpr (WAIT_EACH) kd::wgmma_wait<0>();
    else kd::wgmma_wait<1>();
  }
  kd::wgmma_wait<0>();
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += d[i];
  if (s == 12345.f) sink[threadIdx.x] = s;  // keeps the accumulators alive
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
#endif
}

struct Row {
  std::string name;
  double cycles_per_wgmma = 0, fma_per_cycle = 0;
};

template <int N, bool SS, int WGS, bool WAIT_EACH>
Row run(int sms, int iters) {
  constexpr int smem = 64 * 128 + N * 128 + 1024;
  auto kernel = wgmma_rate_kernel<N, SS, WGS, WAIT_EACH>;
  SQUEEZE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  long long* cycles = nullptr;
  float* sink = nullptr;
  SQUEEZE_CUDA_CHECK(cudaMalloc(&cycles, sizeof(long long) * sms));
  SQUEEZE_CUDA_CHECK(cudaMalloc(&sink, sizeof(float) * 512));
  kernel<<<sms, 128 * WGS, smem>>>(iters / 8, cycles, sink);  // warm-up
  kernel<<<sms, 128 * WGS, smem>>>(iters, cycles, sink);
  SQUEEZE_CUDA_CHECK(cudaGetLastError());
  SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<long long> host(sms);
  SQUEEZE_CUDA_CHECK(cudaMemcpy(host.data(), cycles, sizeof(long long) * sms, cudaMemcpyDeviceToHost));
  cudaFree(cycles);
  cudaFree(sink);
  double mean = 0;
  for (long long c : host) mean += double(c) / sms;
  Row r;
  r.name = std::string(SS ? "ss" : "rs") + "_n" + std::to_string(N) + "_wg" + std::to_string(WGS) + (WAIT_EACH ? "_wait0" : "_wait1");
  const double wgmma_per_sm = double(WGS) * iters * 4;
  r.cycles_per_wgmma = mean / wgmma_per_sm;
  r.fma_per_cycle = 64.0 * N * 16 / r.cycles_per_wgmma;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path;
  int iters = 4096;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--iters" && i + 1 < argc) iters = std::max(8, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: %s [--out FILE] [--iters N]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop{};
  if (!squeeze::bench::first_device("bench_wgmma_rate", prop)) return 1;
  if (!kq::qgemm_sm90_supported()) {
    std::fprintf(stderr, "bench_wgmma_rate: no sm_90a device code (build with CMAKE_CUDA_ARCHITECTURES=90a on an sm_90 GPU)\n");
    return 1;
  }
  const int sms = prop.multiProcessorCount;
  std::vector<Row> rows = {
      run<16, false, 1, true>(sms, iters),   run<16, false, 2, true>(sms, iters),   run<16, false, 4, true>(sms, iters),
      run<16, false, 2, false>(sms, iters),  run<16, true, 1, true>(sms, iters),    run<16, true, 2, true>(sms, iters),
      run<16, true, 4, true>(sms, iters),    run<16, true, 2, false>(sms, iters),   run<128, false, 1, true>(sms, iters),
      run<128, false, 2, true>(sms, iters),  run<128, false, 2, false>(sms, iters), run<128, true, 1, true>(sms, iters),
      run<128, true, 2, true>(sms, iters),   run<128, true, 2, false>(sms, iters),
  };
  std::ofstream out;
  if (!out_path.empty()) out.open(out_path);
  const char* commit = std::getenv("SQUEEZE_COMMIT");
  std::printf("%s, %d SMs: m64nNk16 bf16 wgmma, one block per SM, %d chunks of 4 per warpgroup\n", prop.name, sms, iters);
  std::printf("%-20s %16s %14s\n", "case", "cycles/wgmma/SM", "FMA/cycle/SM");
  for (const Row& r : rows) {
    std::printf("%-20s %16.1f %14.0f\n", r.name.c_str(), r.cycles_per_wgmma, r.fma_per_cycle);
    if (out)
      out << "{\"bench\": \"wgmma_rate\", \"case\": \"" << r.name << "\", \"cycles_per_wgmma_per_sm\": " << r.cycles_per_wgmma
          << ", \"fma_per_cycle_per_sm\": " << r.fma_per_cycle << ", \"device\": \"" << prop.name << "\", \"commit\": \""
          << (commit ? commit : "unknown") << "\"}\n";
  }
  return 0;
}
