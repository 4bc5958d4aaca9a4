#pragma once
// What merely reading a buffer once from DRAM costs at its size: the fastest of a few plain reads of it, each timed as
// time_ms times a kernel (cold L2, median). Any kernel that must read those bytes takes at least this long, so against a
// peer's time it bounds the ratio a kernel can reach. The reads:
//   sweep     16-byte loads in a grid-stride loop, 4 blocks of 512 threads an SM (one load in flight a thread per
//             step);
//   spans U   each block reads a contiguous span, every thread U independent 16-byte loads a step (more bytes in flight
//             a thread, DRAM pages read in order), 2 or 4 blocks of 512 threads an SM;
//   bulk B S  one thread a block queues bulk copies (the TMA engine, as the sm_90 GEMM's producer reads its weight tiles)
//             of S-byte pieces of its span into a ring of shared memory, B blocks an SM (sm_90 and later).
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include <squeeze/kernels/quant/gemm/ptx.cuh>  // mbarrier and bulk-copy helpers

#include "gemm_timing.cuh"

namespace squeeze::bench {

template <int U>
__global__ void read_spans_kernel(const uint4* p, std::size_t n, unsigned* sink) {
  const std::size_t span = (n + gridDim.x - 1) / gridDim.x;
  const std::size_t begin = blockIdx.x * span, end = begin + span < n ? begin + span : n;
  unsigned acc = 0;
  for (std::size_t i = begin + threadIdx.x; i < end; i += std::size_t(U) * blockDim.x) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const std::size_t j = i + std::size_t(u) * blockDim.x;
      v[u] = j < end ? p[j] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9E3779B9u && sink) *sink = acc;  // never true in practice; keeps the loads alive
}

// Thread 0 of each block copies its span piece by piece into a ring of `slots` pieces and waits for each piece before
// its slot takes the next one; bytes and piece are multiples of 16.
inline constexpr int kReadBulkMaxSlots = 16;
__global__ void read_bulk_kernel(const unsigned char* p, std::size_t bytes, unsigned piece, int slots) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ std::uint64_t full[kReadBulkMaxSlots];
  namespace qd = squeeze::kernels::quant::detail;
  if (threadIdx.x != 0) return;
  const std::size_t pieces = (bytes + piece - 1) / piece, per = (pieces + gridDim.x - 1) / gridDim.x;
  const std::size_t first = blockIdx.x * per, last = first + per < pieces ? first + per : pieces;
  if (first >= last) return;
  for (int s = 0; s < slots; ++s) qd::mbar_init(&full[s], 1);
  qd::mbar_init_fence();
  auto queue = [&](std::size_t i) {
    const int s = int((i - first) % slots);
    const std::size_t at = i * piece;
    const unsigned len = bytes - at < piece ? unsigned(bytes - at) : piece;
    qd::mbar_arrive_expect_tx(&full[s], len);
    qd::bulk_copy_g2s(ring + std::size_t(s) * piece, p + at, len, &full[s]);
  };
  for (std::size_t i = first; i < last && i < first + slots; ++i) queue(i);
  for (std::size_t i = first; i < last; ++i) {
    const std::size_t k = i - first;
    qd::mbar_wait(&full[k % slots], unsigned(k / slots) & 1u);
    if (i + slots < last) queue(i + slots);
  }
}

struct ReadBound {
  double ms = 0;                                    // the fastest read
  std::string how;                                  // which one
  std::vector<std::pair<std::string, double>> all;  // every read timed (name, ms)
};

// The read bound of `bytes` (a multiple of 16, 16-byte aligned) at p, on a device of `sm` SMs of compute capability
// `major`.
inline ReadBound read_bound(const void* p, std::size_t bytes, int sm, int major, int reps) {
  ReadBound r;
  auto add = [&](const std::string& name, const std::function<void()>& launch) {
    const double ms = time_ms([&] {
      launch();
      SQUEEZE_CUDA_CHECK(cudaGetLastError());
    }, reps);
    r.all.emplace_back(name, ms);
    if (r.how.empty() || ms < r.ms) {
      r.ms = ms;
      r.how = name;
    }
  };
  const auto* words = static_cast<const uint4*>(p);
  const std::size_t n = bytes / 16;
  add("sweep", [&] { read_sweep_kernel<<<sm * 4, 512>>>(words, n, nullptr); });
  for (const int per_sm : {2, 4}) {
    add("spans4 x" + std::to_string(per_sm), [&] { read_spans_kernel<4><<<sm * per_sm, 512>>>(words, n, nullptr); });
    add("spans8 x" + std::to_string(per_sm), [&] { read_spans_kernel<8><<<sm * per_sm, 512>>>(words, n, nullptr); });
  }
  if (major >= 9) {
    // (blocks an SM, piece bytes, slots): 128 KB of ring an SM in flight, or 192 KB
    const int forms[][3] = {{1, 16384, 8}, {1, 32768, 4}, {1, 16384, 12}, {2, 16384, 4}, {4, 8192, 4}};
    for (const auto& f : forms) {
      const int smem = f[1] * f[2];
      SQUEEZE_CUDA_CHECK(cudaFuncSetAttribute(read_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      add("bulk x" + std::to_string(f[0]) + " " + std::to_string(f[1] / 1024) + "K*" + std::to_string(f[2]), [&] {
        read_bulk_kernel<<<sm * f[0], 32, smem>>>(static_cast<const unsigned char*>(p), bytes, unsigned(f[1]), f[2]);
      });
    }
  }
  return r;
}

// "name ms, name ms, ..." of every read timed
inline std::string describe(const ReadBound& r) {
  std::string s;
  for (const auto& [name, ms] : r.all) s += (s.empty() ? "" : ", ") + name + " " + std::to_string(ms).substr(0, 6);
  return s;
}

}  // namespace squeeze::bench
