#pragma once
// Multithreading for the CPU twins of squeeze's kernels (plain C++; no CUDA needed).
// parallel_ranges(n, fn) splits [0, n) into one contiguous range per thread and calls fn(begin, end)
// on each; fn's inner loop carries `#pragma omp simd` so, under OpenMP, the pair is the CPU form of
// `parallel for simd`. Without OpenMP (-fopenmp absent) it uses std::thread. Small n runs inline:
// forking threads costs more than it saves below ~64 Ki elements.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

// The CPU launchers' hot loops (AdamW, 8-bit AdamW block passes) are compiled for x86-64-v4 (AVX-512), x86-64-v3
// (AVX2 + FMA + F16C) and the baseline; the loader picks one at run time from the CPU's features, so a build
// without -march still runs 8/16-wide with FMA, well ahead of the baseline SSE2 loop. The AdamW math writes its
// multiply-adds as fmaf (adamw.hpp), so every clone gives the same bits (the baseline calls libm's fmaf).
// GCC >= 12 knows the x86-64-vN levels; older GCC and clang get an AVX-512F clone (which has FMA) and the baseline.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define SQUEEZE_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SQUEEZE_CPU_CLONES __attribute__((target_clones("avx512f", "default")))
#else
#define SQUEEZE_CPU_CLONES
#endif

namespace squeeze::kernels::cpu {

inline constexpr std::int64_t kSerialBelow = 1 << 16;  // elements; below this one thread does it all
inline constexpr std::int64_t kRangeAlign = 64;        // range borders at multiples of 64 elements (cache lines)

// Threads the CPU twins use: OpenMP's max threads (OMP_NUM_THREADS) or hardware_concurrency().
inline int max_threads() {
#if defined(_OPENMP)
  return std::max(1, omp_get_max_threads());
#else
  return std::max(1u, std::thread::hardware_concurrency());
#endif
}

// The [begin, end) range thread `t` of `threads` owns: contiguous, borders aligned to kRangeAlign.
inline void thread_range(std::int64_t n, int t, int threads, std::int64_t& begin, std::int64_t& end) {
  const std::int64_t blocks = (n + kRangeAlign - 1) / kRangeAlign;
  const std::int64_t per = blocks / threads, extra = blocks % threads;
  const std::int64_t b0 = t * per + std::min<std::int64_t>(t, extra);
  const std::int64_t b1 = b0 + per + (t < extra ? 1 : 0);
  begin = std::min(n, b0 * kRangeAlign);
  end = std::min(n, b1 * kRangeAlign);
}

// Number of ranges parallel_ranges will use for n elements (1 below kSerialBelow).
inline int ranges_for(std::int64_t n) {
  if (n < kSerialBelow) return 1;
  return int(std::min<std::int64_t>(max_threads(), (n + kRangeAlign - 1) / kRangeAlign));
}

// Calls fn(t, begin, end) for t in [0, ranges_for(n)) covering [0, n) exactly once, concurrently.
template <class Fn>
void parallel_ranges(std::int64_t n, Fn&& fn) {
  if (n <= 0) return;
  const int threads = ranges_for(n);
  if (threads == 1) {
    fn(0, std::int64_t(0), n);
    return;
  }
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    std::int64_t b = 0, e = 0;
    thread_range(n, t, omp_get_num_threads(), b, e);
    if (b < e) fn(t, b, e);
  }
#else
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t)
    pool.emplace_back([&, t] {
      std::int64_t b = 0, e = 0;
      thread_range(n, t, threads, b, e);
      if (b < e) fn(t, b, e);
    });
  std::int64_t b = 0, e = 0;
  thread_range(n, 0, threads, b, e);
  if (b < e) fn(0, b, e);
  for (auto& th : pool) th.join();
#endif
}

// Elementwise work whose result does not depend on which thread does which part (AdamW): [0, n) in pieces of
// `piece` elements handed out dynamically, fn(begin, end) per piece, each walked in order. A thread slowed by
// others on the cores (the offload pipeline's backward and copy threads, another process) leaves its share to
// the rest instead of holding the whole team at the end, as parallel_ranges' fixed split would.
inline constexpr std::int64_t kPiece = std::int64_t(1) << 16;  // elements: ~1.8 MB of AdamW traffic a piece

template <class Fn>
void parallel_pieces(std::int64_t n, std::int64_t piece, Fn&& fn) {
  if (n <= 0) return;
  const std::int64_t pieces = (n + piece - 1) / piece;
  const int threads = int(std::min<std::int64_t>(max_threads(), pieces));  // one piece (n <= piece): inline
  if (threads <= 1) {
    fn(std::int64_t(0), n);
    return;
  }
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (std::int64_t k = 0; k < pieces; ++k) fn(k * piece, std::min(n, (k + 1) * piece));
#else
  std::atomic<std::int64_t> next{0};
  auto work = [&] {
    for (std::int64_t k = next.fetch_add(1); k < pieces; k = next.fetch_add(1)) fn(k * piece, std::min(n, (k + 1) * piece));
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
#endif
}

// Threads for `rows` rows of `per_row` elements: 1 below kSerialBelow elements in all, else up to max_threads().
inline int row_threads(std::int64_t rows, std::int64_t per_row) {
  if (rows <= 1 || rows * per_row < kSerialBelow) return 1;
  return int(std::min<std::int64_t>(max_threads(), rows));
}

// Calls fn(t, r0, r1) for t in [0, row_threads(rows, per_row)), contiguous row ranges covering [0, rows) once.
template <class Fn>
void parallel_rows(std::int64_t rows, std::int64_t per_row, Fn&& fn) {
  if (rows <= 0) return;
  const int threads = row_threads(rows, per_row);
  auto range = [&](int t) {
    const std::int64_t per = rows / threads, extra = rows % threads;
    const std::int64_t r0 = t * per + std::min<std::int64_t>(t, extra);
    fn(t, r0, r0 + per + (t < extra ? 1 : 0));
  };
  if (threads == 1) return range(0);
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int t = 0; t < threads; ++t) range(t);
#else
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(range, t);
  range(0);
  for (auto& th : pool) th.join();
#endif
}

}  // namespace squeeze::kernels::cpu
