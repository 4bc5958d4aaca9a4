#pragma once
// A list of tensors for one-launch ("multi-tensor") kernels, plain C++ so CPU twins share it.
//
// Work is cut into chunks of kChunkElems elements; chunk c belongs to the tensor i with
// chunk_prefix[i] <= c < chunk_prefix[i + 1]. A CUDA block takes one chunk at a time, so a list of
// 64 tensors or one flat buffer is one launch either way, and tensors that don't fill a chunk end in a
// short chunk. Each kernel defines its own Entry (pointers + `std::int64_t n`).
//
//   entries:      [count]      Entry, in device memory for CUDA launchers, host memory for CPU twins
//   chunk_prefix: [count + 1]  first chunk of each tensor; chunk_prefix[count] = total chunks
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include <string>

#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"

namespace squeeze::kernels {

// isfinite for host and device code (CUDA's device overload vs std::isfinite on the host).
SQUEEZE_HD bool is_finite(float x) {
#if defined(__CUDA_ARCH__)
  return isfinite(x);
#else
  return std::isfinite(x);
#endif
}

// Elements per chunk (a block's unit of work): 8 passes of 256 threads x 8 elements. Small enough that
// the last wave of blocks is short (1 Gi elements = 65536 chunks), large enough to amortise the lookup.
inline constexpr std::int64_t kChunkElems = std::int64_t(1) << 14;

inline constexpr std::int64_t chunks_of(std::int64_t n) { return (n + kChunkElems - 1) / kChunkElems; }

// Non-owning view of a tensor list, passed by value to kernels.
template <class Entry>
struct TensorTable {
  const Entry* entries = nullptr;
  const std::int64_t* chunk_prefix = nullptr;
  int count = 0;
  std::int64_t chunks = 0;
};

// chunk_prefix for a list (host side): [count + 1] values. Throws on negative sizes.
template <class Entry>
std::vector<std::int64_t> chunk_prefix_of(std::span<const Entry> entries) {
  std::vector<std::int64_t> prefix(entries.size() + 1, 0);
  for (std::size_t i = 0; i < entries.size(); ++i) {
    check(entries[i].n >= 0, "tensor list: entry " + std::to_string(i) + " has a negative element count");
    prefix[i + 1] = prefix[i] + chunks_of(entries[i].n);
  }
  return prefix;
}

// ---- the vector path's tile layout (shared by every streaming kernel; plain arithmetic so CPU tests can
// check that it covers each element exactly once) -----------------------------------------------------
// A block pass covers a tile of threads * 4 * Q elements. Thread t owns Q quads of 4 consecutive elements;
// quad q starts at base + (q * threads + t) * 4, so each warp-wide load of quad q is one contiguous span
// (512 bytes of float, 256 of bf16). Elements past the last whole tile of a chunk take the scalar path:
// thread t handles vector_end + t, + threads, ...
inline constexpr int kQuad = 4;

SQUEEZE_HD std::int64_t tile_elems(int threads, int quads) { return std::int64_t(threads) * kQuad * quads; }

SQUEEZE_HD std::int64_t quad_start(std::int64_t base, int t, int q, int threads) { return base + (std::int64_t(q) * threads + t) * kQuad; }

// End of the whole tiles in [begin, end).
SQUEEZE_HD std::int64_t vector_end(std::int64_t begin, std::int64_t end, std::int64_t tile) { return begin + (end - begin) / tile * tile; }

// Index i of the tensor that owns chunk c (binary search; empty tensors own no chunk).
template <class Entry>
SQUEEZE_HD int tensor_of_chunk(const TensorTable<Entry>& t, std::int64_t c) {
  int lo = 0, hi = t.count - 1;  // answer: the largest i with chunk_prefix[i] <= c
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.chunk_prefix[mid] <= c)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

}  // namespace squeeze::kernels
