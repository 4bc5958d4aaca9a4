#pragma once
// Training steps under libtorch's Kineto profiler, reduced to what bench/profile_table.py reads: each kernel's name,
// launches and time on the device, the time the device was busy at all (the union of those intervals, streams
// overlapping) and the host clock's time. bench_common.profile_steps reduces a Python peer's steps to the same record,
// so both sides are classified (GEMM, attention, elementwise, copy, communication) by one script.
#include <kineto/ActivityType.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace squeeze::bench {

struct KernelTotal {
  int64_t count = 0;
  double ms = 0;
};

struct StepProfile {
  int64_t steps = 0;
  double wall_ms = 0;  // the host clock over all profiled steps, each ending synchronised
  double busy_ms = 0;  // the device running anything: the union of the recorded intervals
  std::map<std::string, KernelTotal> kernels;

  // {"steps", "wall_ms", "busy_ms", "kernels": [[name, launches, ms], ...] longest first}: per step it is / steps.
  nlohmann::json to_json() const {
    std::vector<std::pair<std::string, KernelTotal>> by_time(kernels.begin(), kernels.end());
    std::sort(by_time.begin(), by_time.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
    nlohmann::json k = nlohmann::json::array();
    for (const auto& [name, t] : by_time) k.push_back({name, t.count, t.ms});
    return {{"steps", steps}, {"wall_ms", wall_ms}, {"busy_ms", busy_ms}, {"kernels", std::move(k)}};
  }
};

// Milliseconds covered by the union of [start, end) intervals (nanoseconds).
inline double union_ms(std::vector<std::pair<uint64_t, uint64_t>> spans) {
  std::sort(spans.begin(), spans.end());
  uint64_t covered = 0, open_start = 0, open_end = 0;
  bool open = false;
  for (const auto& [s, e] : spans) {
    if (open && s <= open_end) {
      open_end = std::max(open_end, e);
      continue;
    }
    if (open) covered += open_end - open_start;
    open_start = s, open_end = e, open = true;
  }
  if (open) covered += open_end - open_start;
  return double(covered) / 1e6;
}

// A device event that is work: a kernel, a copy or a set (not an annotation or a synchronisation spanning them).
inline bool is_device_work(uint8_t activity) {
  using libkineto::ActivityType;
  return activity == uint8_t(ActivityType::CONCURRENT_KERNEL) || activity == uint8_t(ActivityType::GPU_MEMCPY) ||
         activity == uint8_t(ActivityType::GPU_MEMSET);
}

// Runs step(i) for i in [0, steps) under the profiler (step ends synchronised with the device). On a CUDA device the
// record holds the device's kernels, copies and sets; on the CPU, libtorch's operators (nested ones each counted).
template <class Step>
StepProfile profile_steps(int64_t steps, const torch::Device& device, Step&& step) {
  namespace prof = torch::profiler::impl;
  namespace autograd_prof = torch::autograd::profiler;
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
  const std::set<prof::ActivityType> activities{device.is_cuda() ? prof::ActivityType::CUDA : prof::ActivityType::CPU};
  autograd_prof::prepareProfiler(config, activities);
  autograd_prof::enableProfiler(config, activities);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    for (int64_t i = 0; i < steps; ++i) step(i);
  } catch (...) {
    autograd_prof::disableProfiler();  // the profiler off before the error leaves (a later row may profile again)
    throw;
  }
  StepProfile p;
  p.wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  p.steps = steps;
  const std::unique_ptr<autograd_prof::ProfilerResult> result = autograd_prof::disableProfiler();
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (const autograd_prof::KinetoEvent& e : result->events()) {
    if (e.deviceType() != device.type() || e.endNs() <= e.startNs()) continue;
    if (device.is_cuda() && !is_device_work(e.activityType())) continue;  // e.g. an annotation spanning kernels
    KernelTotal& t = p.kernels[e.name()];
    t.count += 1;
    t.ms += double(e.durationNs()) / 1e6;
    spans.emplace_back(e.startNs(), e.endNs());
  }
  p.busy_ms = union_ms(std::move(spans));
  return p;
}

}  // namespace squeeze::bench
