#pragma once
// Device side of tensor lists (see tensor_list.hpp): an owner that uploads a table once, and the two
// "sources" a one-launch kernel iterates over: one flat tensor passed by value, or a device table.
// Kernels take a Source, loop `for (chunk = blockIdx.x; chunk < src.chunks; chunk += gridDim.x)`,
// and ask src.locate(chunk, local) for the tensor and the chunk's index inside it.
#include <algorithm>
#include <climits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "squeeze/kernels/tensor_list.hpp"
#include "squeeze/kernels/types.cuh"

namespace squeeze::kernels {

// One flat tensor: every chunk is its own.
template <class Entry>
struct FlatSource {
  Entry entry;
  std::int64_t chunks;
  SQUEEZE_DEVICE Entry locate(std::int64_t c, std::int64_t& local) const {
    local = c;
    return entry;
  }
};

// A table in device memory.
template <class Entry>
struct TableSource {
  TensorTable<Entry> table;
  std::int64_t chunks;
  SQUEEZE_DEVICE Entry locate(std::int64_t c, std::int64_t& local) const {
    const int i = tensor_of_chunk(table, c);
    local = c - table.chunk_prefix[i];
    return table.entries[i];
  }
};

// Grid size for a one-chunk-per-block launch: the hardware scheduler balances the tail.
inline unsigned grid_for_chunks(std::int64_t chunks) { return unsigned(std::min<std::int64_t>(chunks, INT_MAX)); }

// Owns a tensor list in device memory: entries and chunk prefix in one cudaMalloc. Upload it once
// (pointers rarely change between steps) and launch with view() every step. Each entry is checked
// on upload with the Entry's validate(entry, name) (null pointers, sizes, missing master weights).
template <class Entry>
class DeviceTensorTable {
 public:
  DeviceTensorTable() = default;
  explicit DeviceTensorTable(std::span<const Entry> entries) { upload(entries); }
  DeviceTensorTable(const DeviceTensorTable&) = delete;
  DeviceTensorTable& operator=(const DeviceTensorTable&) = delete;
  DeviceTensorTable(DeviceTensorTable&& o) noexcept : mem_(std::exchange(o.mem_, nullptr)), view_(std::exchange(o.view_, {})) {}
  DeviceTensorTable& operator=(DeviceTensorTable&& o) noexcept {
    if (this != &o) {
      release();
      mem_ = std::exchange(o.mem_, nullptr);
      view_ = std::exchange(o.view_, {});
    }
    return *this;
  }
  ~DeviceTensorTable() { release(); }

  // Validates and copies `entries` to the device (synchronous: the host span may die afterwards).
  void upload(std::span<const Entry> entries) {
    check(entries.size() <= std::size_t(INT_MAX), "tensor list: more than INT_MAX tensors");
    for (std::size_t i = 0; i < entries.size(); ++i) validate(entries[i], "tensor list entry " + std::to_string(i));
    const std::vector<std::int64_t> prefix = chunk_prefix_of(entries);
    release();
    const std::size_t entry_bytes = (entries.size() * sizeof(Entry) + 255) / 256 * 256;
    const std::size_t bytes = entry_bytes + prefix.size() * sizeof(std::int64_t);
    SQUEEZE_CUDA_CHECK(cudaMalloc(&mem_, bytes));
    auto* base = static_cast<char*>(mem_);
    if (!entries.empty()) SQUEEZE_CUDA_CHECK(cudaMemcpy(base, entries.data(), entries.size() * sizeof(Entry), cudaMemcpyHostToDevice));
    SQUEEZE_CUDA_CHECK(cudaMemcpy(base + entry_bytes, prefix.data(), prefix.size() * sizeof(std::int64_t), cudaMemcpyHostToDevice));
    view_ = TensorTable<Entry>{reinterpret_cast<const Entry*>(base), reinterpret_cast<const std::int64_t*>(base + entry_bytes),
                               int(entries.size()), prefix.back()};
  }

  const TensorTable<Entry>& view() const { return view_; }
  int size() const { return view_.count; }

 private:
  void release() noexcept {
    if (mem_) cudaFree(mem_);
    mem_ = nullptr;
    view_ = {};
  }
  void* mem_ = nullptr;
  TensorTable<Entry> view_{};
};

}  // namespace squeeze::kernels
