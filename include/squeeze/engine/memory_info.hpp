#pragma once
// What memory the machine has, for the refusals made before allocating (the trainer's host state, a model built
// block by block), and one way to print a size.
#include <torch/torch.h>

#include <ATen/DeviceAccelerator.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>

namespace squeeze::engine {

inline std::string gigabytes(int64_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f GB", double(bytes) / 1e9);
  return s;
}

// /proc/meminfo's MemAvailable in bytes; unset where it cannot be read.
inline std::optional<int64_t> host_memory_available() {
  std::ifstream f("/proc/meminfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("MemAvailable:", 0) == 0) return int64_t(std::stoll(line.substr(13))) * 1024;
  return std::nullopt;
}

// A CUDA device's total memory; unset for other devices or where the runtime cannot say.
inline std::optional<int64_t> device_memory_total(torch::Device d) {
  if (!d.is_cuda()) return std::nullopt;
  try {
    return int64_t(at::accelerator::getMemoryInfo(d.has_index() ? d.index() : c10::DeviceIndex(0)).second);
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

}  // namespace squeeze::engine
