#pragma once
// Counts the bytes the CPU allocator hands out and gets back, so a test can see how much memory a graph
// keeps alive (and the high-water mark since a meter was made). Installed once (at a high priority) in place of libtorch's default CPU
// allocator. Some CPU kernels use raw_allocate, which needs context == data, so each block carries its size in a header.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <cstdint>

namespace squeeze::test {

class CountingCpuAllocator final : public c10::Allocator {
 public:
  static constexpr size_t kHeader = 64;  // keeps the 64-byte alignment of c10::alloc_cpu

  c10::DataPtr allocate(size_t n) override {
    auto* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    *reinterpret_cast<size_t*>(base) = n;
    const int64_t now = live_ += static_cast<int64_t>(n);
    for (int64_t p = peak_.load(); now > p && !peak_.compare_exchange_weak(p, now);) {}
    void* data = base + kHeader;
    return c10::DataPtr(data, data, &release, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  static int64_t live() { return live_.load(); }
  static int64_t peak() { return peak_.load(); }
  static void reset_peak() { peak_ = live_.load(); }
  static void install() {
    static bool done = [] {
      static CountingCpuAllocator counting;
      c10::SetCPUAllocator(&counting, /*priority=*/100);
      return true;
    }();
    (void)done;
  }

 private:
  static void release(void* data) {
    if (data == nullptr) return;
    char* base = static_cast<char*>(data) - kHeader;
    live_ -= static_cast<int64_t>(*reinterpret_cast<size_t*>(base));
    c10::free_cpu(base);
  }
  static inline std::atomic<int64_t> live_{0};
  static inline std::atomic<int64_t> peak_{0};  // the largest live_ since the last reset_peak()
};

// Bytes allocated on the CPU since construction and still alive, and the most that were alive at once.
class MemoryMeter {
 public:
  MemoryMeter() : start_((CountingCpuAllocator::install(), CountingCpuAllocator::live())) { CountingCpuAllocator::reset_peak(); }
  int64_t live_bytes() const { return CountingCpuAllocator::live() - start_; }
  int64_t peak_bytes() const { return CountingCpuAllocator::peak() - start_; }

 private:
  int64_t start_;
};

}  // namespace squeeze::test
