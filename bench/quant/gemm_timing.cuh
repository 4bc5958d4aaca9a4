#pragma once
// Helpers shared by the quantized-GEMM benchmarks (bench_quant_gemm, bench_qgemm_sm90, bench_dequant, bench_wgmma_rate):
// the device they run on, device arrays, cold-L2 median GPU time of a launch and the copy bandwidth (the roofline),
// command-line lists, and a watchdog that ends a run whose kernel hangs. No libtorch.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include <squeeze/error.hpp>

namespace squeeze::bench {

// The first CUDA device's properties into prop; false, with the program named on stderr, when there is none.
inline bool first_device(const char* program, cudaDeviceProp& prop) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::fprintf(stderr, "%s: no CUDA device\n", program);
    return false;
  }
  SQUEEZE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  return true;
}

__global__ void spin_kernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// L2 flush buffer (256 MiB, larger than any Hopper L2), swept before every timed launch so each launch reads its
// weights from DRAM, as a real model whose layers do not fit in L2 does. Two ways to sweep it:
//   clean (default): a read pass, so L2 is left holding clean lines, as after a previous layer's weight reads;
//   dirty: a memset, so L2 is left holding ~50 MB of dirty lines that the timed kernel's reads must first write
//          back to DRAM; it adds the same write-back to ours and to the peer, which weighs most on the smaller,
//          faster operation.
inline void* g_flush = nullptr;
constexpr std::size_t kFlushBytes = 256ull << 20;
enum class L2Flush { Clean, Dirty };
inline L2Flush g_l2_flush = L2Flush::Clean;
inline const char* l2_flush_name() { return g_l2_flush == L2Flush::Clean ? "clean" : "dirty"; }
// From a command-line value, "clean" or "dirty"; anything else is named on stderr and returns false.
inline bool set_l2_flush(const char* program, const std::string& mode) {
  if (mode == "clean") g_l2_flush = L2Flush::Clean;
  else if (mode == "dirty") g_l2_flush = L2Flush::Dirty;
  else {
    std::fprintf(stderr, "%s: --l2-flush: expected clean or dirty, got '%s'\n", program, mode.c_str());
    return false;
  }
  return true;
}

// Reads every 16 bytes of the buffer; the store under an impossible condition keeps the loads alive.
__global__ void read_sweep_kernel(const uint4* p, std::size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u && sink) *sink = acc;
}

inline void flush_l2(int rep) {
  if (g_l2_flush == L2Flush::Dirty) {
    SQUEEZE_CUDA_CHECK(cudaMemsetAsync(g_flush, rep & 0xff, kFlushBytes, nullptr));
  } else {
    read_sweep_kernel<<<1024, 512>>>(static_cast<const uint4*>(g_flush), kFlushBytes / 16, nullptr);
    SQUEEZE_CUDA_CHECK(cudaGetLastError());
  }
}

// Median GPU time (ms) of fn over reps, cold L2, launched in groups queued behind a spin kernel.
inline double time_ms(const std::function<void()>& fn, int reps) {
  if (!g_flush) {
    SQUEEZE_CUDA_CHECK(cudaMalloc(&g_flush, kFlushBytes));
    SQUEEZE_CUDA_CHECK(cudaMemset(g_flush, 0x5a, kFlushBytes));
  }
  for (int i = 0; i < 3; ++i) fn();  // warm-up
  SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) SQUEEZE_CUDA_CHECK(cudaEventCreate(&e));
  constexpr int kGroup = 10;
  for (int r0 = 0; r0 < reps; r0 += kGroup) {
    spin_kernel<<<1, 1>>>(2'000'000);  // ~1 ms: the CPU queues the group meanwhile
    for (int r = r0; r < std::min(reps, r0 + kGroup); ++r) {
      flush_l2(r);
      SQUEEZE_CUDA_CHECK(cudaEventRecord(ev[2 * r], nullptr));
      fn();
      SQUEEZE_CUDA_CHECK(cudaEventRecord(ev[2 * r + 1], nullptr));
    }
  }
  SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> t(reps);
  for (int r = 0; r < reps; ++r) SQUEEZE_CUDA_CHECK(cudaEventElapsedTime(&t[r], ev[2 * r], ev[2 * r + 1]));
  for (auto& e : ev) cudaEventDestroy(e);
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  return t[reps / 2];
}

// A device array, freed on scope exit.
template <class E>
struct DevBuf {
  E* p = nullptr;
  std::size_t n = 0;
  explicit DevBuf(std::size_t count) : n(count) { SQUEEZE_CUDA_CHECK(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(E))); }
  explicit DevBuf(const std::vector<E>& host) : DevBuf(host.size()) {
    SQUEEZE_CUDA_CHECK(cudaMemcpy(p, host.data(), n * sizeof(E), cudaMemcpyHostToDevice));
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() { cudaFree(p); }
  std::vector<E> get() const {
    std::vector<E> h(n);
    SQUEEZE_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(E), cudaMemcpyDeviceToHost));
    return h;
  }
};

// Bytes read + written per second (GB/s) by a device-to-device copy of 1 GiB, timed as time_ms does: the roofline.
inline double copy_bandwidth_gbs() {
  const std::size_t bytes = 1ull << 30;
  DevBuf<unsigned char> a(bytes), b(bytes);
  const double ms = time_ms([&] { SQUEEZE_CUDA_CHECK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, nullptr)); }, 10);
  return 2.0 * double(bytes) / (ms * 1e6);
}

// The items of a comma-separated command-line list.
inline std::vector<std::string> comma_list(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream list(text);
  for (std::string item; std::getline(list, item, ',');) items.push_back(item);
  return items;
}
// A list item as a positive integer, or 0 when it is not one (the caller names the option).
inline long long positive(const std::string& item) {
  char* end = nullptr;
  const long long v = std::strtoll(item.c_str(), &end, 10);
  return !item.empty() && *end == '\0' && v > 0 ? v : 0;
}
// --shapes: KxN pairs (K a multiple of 8, K and N >= 16) into shapes; the first bad item, or "" when all are good.
inline std::string parse_shapes(const std::string& text, std::vector<std::pair<std::int64_t, std::int64_t>>& shapes) {
  shapes.clear();
  for (const std::string& item : comma_list(text)) {
    long long k = 0, n = 0;
    char sep = 0;
    std::stringstream one(item);
    if (!(one >> k >> sep >> n) || sep != 'x' || k < 16 || n < 16 || k % 8) return item.empty() ? "(empty)" : item;
    shapes.emplace_back(k, n);
  }
  return "";
}

// Watchdog: a configuration that hangs (e.g. a barrier bug) would stop the whole GPU run. Each variant notes its
// name when it starts; if no note comes for the watchdog's seconds, the process prints what hung and exits with
// code 3 (the JSON lines written so far stay).
inline std::mutex g_wd_mu;
inline std::string g_wd_what = "start", g_wd_program = "benchmark";
inline std::chrono::steady_clock::time_point g_wd_since = std::chrono::steady_clock::now();
inline int g_wd_seconds = 150;
inline void watchdog_note(const std::string& what) {
  std::lock_guard<std::mutex> lk(g_wd_mu);
  g_wd_what = what;
  g_wd_since = std::chrono::steady_clock::now();
}
inline void start_watchdog(const std::string& program, int seconds = 150) {
  g_wd_program = program;
  g_wd_seconds = seconds;
  std::thread([] {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::seconds(5));
      std::lock_guard<std::mutex> lk(g_wd_mu);
      if (std::chrono::steady_clock::now() - g_wd_since > std::chrono::seconds(g_wd_seconds)) {
        std::printf("%s: no progress for %d s in '%s': HUNG, exiting (code 3)\n", g_wd_program.c_str(), g_wd_seconds, g_wd_what.c_str());
        std::fflush(stdout);
        std::_Exit(3);
      }
    }
  }).detach();
}

}  // namespace squeeze::bench
