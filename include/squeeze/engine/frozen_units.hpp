#pragma once
// Frozen tensors kept in pinned host memory and brought to the device a unit at a time: a quantized base's packed
// blocks under Offload<Host, Streamed> (docs/architecture.md, "The quantized base in host memory").
//
//   add_unit(name, tensors)  the tensors' bytes go into one host buffer of the unit (pinned for a GPU; each tensor at a
//                            256-byte offset), and each tensor is re-pointed there with set_data, so the module's
//                            registered buffers and every copy of the tensor follow it. Returns the unit's index.
//   acquire(u)               u's tensors on the device, in one of 1 + prefetch_depth slots (each the largest unit's
//                            bytes): copied on the copy stream unless a prefetch already did, and the compute stream
//                            waits for that copy. Then the units expected next are copied ahead into slots not in
//                            use. What comes next is learned from the order of acquisitions: the pair (previous unit,
//                            this unit) names its successor, so forward (u-1, u -> u+1) and backward (u+1, u -> u-1)
//                            are told apart; a pair not seen yet guesses the neighbour in the direction of travel.
//   release()                every unit back to its host views and the slots freed (to save, move or drop the model).
// A slot is reused only after the compute queued so far (all uses of the unit it held) is done with it. On a CPU
// device the same steps run in program order with host copies (what the CPU tests check). A failing copy is a
// squeeze::Error naming the unit.
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "squeeze/engine/memory_info.hpp"
#include "squeeze/engine/streams.hpp"
#include "squeeze/error.hpp"

namespace squeeze::engine {

struct FrozenUnitStats {
  int64_t units = 0;
  int64_t host_bytes = 0;    // the units' host buffers
  int64_t device_bytes = 0;  // the slots
  int64_t h2d_bytes = 0;     // copied to the device
  int64_t acquired = 0;      // acquisitions that changed the unit in use
  int64_t prefetched = 0;    // ... found their unit brought ahead
  int64_t fetched_late = 0;  // ... copied it at the acquisition
};

class FrozenUnits {
 public:
  static constexpr int64_t kAlign = 256;

  // A GPU named without an index is GPU 0 (as the trainer takes it): the layers compare devices with their inputs'.
  FrozenUnits(torch::Device device, int prefetch_depth)
      : device_(device.is_cuda() && !device.has_index() ? torch::Device(device.type(), 0) : device),
        depth_(prefetch_depth),
        copy_(device_) {
    TORCH_CHECK(prefetch_depth >= 0, "Offload<Host, Streamed>: the prefetch depth of the frozen base must be >= 0, got ", prefetch_depth);
  }
  FrozenUnits(const FrozenUnits&) = delete;
  FrozenUnits& operator=(const FrozenUnits&) = delete;

  torch::Device device() const { return device_; }
  int64_t size() const { return int64_t(units_.size()); }
  const std::string& name(int unit) const { return units_.at(std::size_t(unit)).name; }
  int64_t unit_bytes(int unit) const { return int64_t(units_.at(std::size_t(unit)).host.nbytes()); }

  // Bytes a unit of these tensors takes: each at a kAlign offset.
  static int64_t bytes_of(const std::vector<torch::Tensor>& tensors) {
    int64_t b = 0;
    for (const auto& t : tensors) b = align(b) + int64_t(t.nbytes());
    return b;
  }

  int add_unit(std::string name, std::vector<torch::Tensor> tensors) {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(slots_.empty(), "FrozenUnits: add every unit before the first acquire (unit '", name, "')");
    Unit u;
    u.name = std::move(name);
    const int64_t bytes = std::max<int64_t>(bytes_of(tensors), 1);
    try {
      u.host = device_.is_cuda() ? pinned_empty(bytes, torch::kUInt8) : torch::empty({bytes}, torch::kUInt8);
    } catch (const std::exception& e) {
      throw Error("Offload<Host, Streamed>: " + gigabytes(bytes) + " of pinned host memory for frozen unit '" + u.name +
                  "' could not be allocated (" + e.what() + "); " + gigabytes(stats_.host_bytes) + " are held by the " +
                  std::to_string(units_.size()) + " units before it");
    }
    int64_t off = 0;
    for (auto& t : tensors) {
      TORCH_CHECK(t.defined(), "FrozenUnits: an undefined tensor in unit '", u.name, "'");
      off = align(off);
      Member m{t, off, t.sizes().vec(), t.scalar_type()};
      if (t.numel() > 0) u.host.narrow(0, off, int64_t(t.nbytes())).copy_(t.detach().contiguous().view({-1}).view(torch::kUInt8));
      off += int64_t(t.nbytes());
      u.members.push_back(std::move(m));
    }
    units_.push_back(std::move(u));
    bind(units_.back(), units_.back().host);
    largest_ = std::max(largest_, bytes);
    stats_.host_bytes += bytes;
    ++stats_.units;
    return int(units_.size() - 1);
  }

  // u's tensors on the device, in use until another unit is acquired; then the units expected next come ahead.
  void acquire(int unit) {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(unit >= 0 && unit < int(units_.size()), "FrozenUnits: unit ", unit, " of ", units_.size());
    if (slots_.empty()) make_slots();
    if (unit != cur_) {
      if (cur_ >= 0) {
        if (prev_ != kNone) next_[{prev_, cur_}] = unit;
        prev_ = cur_;
      }
      cur_ = unit;
      ++stats_.acquired;
      Unit& u = units_[std::size_t(unit)];
      if (u.slot < 0) {
        ++stats_.fetched_late;
        bring(unit, {unit});
      } else {
        ++stats_.prefetched;
      }
      slots_[std::size_t(u.slot)].last_use = ++clock_;
      prefetch();
    }
    wait_current(device_, slots_[std::size_t(units_[std::size_t(unit)].slot)].ready);
  }

  // Every unit back on its host views; the slots go (a later acquire makes them again).
  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    if (copy_.active()) record_current(device_).synchronize();
    for (auto& u : units_) {
      if (u.slot >= 0) bind(u, u.host);
      u.slot = -1;
    }
    slots_.clear();
    stats_.device_bytes = 0;
    cur_ = prev_ = kNone;
  }

  FrozenUnitStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }
  void reset_counters() {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.h2d_bytes = stats_.acquired = stats_.prefetched = stats_.fetched_late = 0;
  }

 private:
  static constexpr int kNone = -1;
  static int64_t align(int64_t b) { return (b + kAlign - 1) / kAlign * kAlign; }

  struct Member {
    torch::Tensor tensor;  // the module's own tensor, re-pointed by bind
    int64_t offset;
    std::vector<int64_t> sizes;
    torch::ScalarType dtype;
  };
  struct Unit {
    std::string name;
    torch::Tensor host;  // uint8 [bytes]
    std::vector<Member> members;
    int slot = -1;
  };
  struct Slot {
    torch::Tensor buffer;  // uint8 [largest unit] on the device
    int unit = kNone;
    Event ready;  // the unit's copy into it is complete
    uint64_t last_use = 0;
  };

  // Points each member at its bytes in `buffer` (the unit's host buffer, or a slot).
  static void bind(Unit& u, const torch::Tensor& buffer) {
    for (auto& m : u.members) {
      const int64_t n = int64_t(c10::elementSize(m.dtype)) * c10::multiply_integers(m.sizes);
      torch::Tensor view =
          n == 0 ? torch::empty(m.sizes, buffer.options().dtype(m.dtype)) : buffer.narrow(0, m.offset, n).view(m.dtype).view(m.sizes);
      m.tensor.set_data(view);
    }
  }

  void make_slots() {
    const int n = std::min<int>(1 + depth_, int(units_.size()));
    for (int i = 0; i < n; ++i) {
      Slot s;
      try {
        s.buffer = torch::empty({largest_}, torch::TensorOptions().dtype(torch::kUInt8).device(device_));
      } catch (const std::exception& e) {
        slots_.clear();
        throw Error("Offload<Host, Streamed>: " + std::to_string(n) + " device slots of " + gigabytes(largest_) +
                    " for the frozen base could not be allocated on " + device_.str() + " (" + e.what() + ")");
      }
      slots_.push_back(std::move(s));
    }
    stats_.device_bytes = int64_t(slots_.size()) * largest_;
  }

  // Copies unit `u` into a slot none of `keep` holds (a free one, else the least recently used).
  void bring(int unit, const std::vector<int>& keep) {
    int best = kNone;
    for (int i = 0; i < int(slots_.size()); ++i) {
      const Slot& s = slots_[std::size_t(i)];
      if (s.unit == kNone) {
        best = i;
        break;
      }
      if (s.unit == cur_ || std::find(keep.begin(), keep.end(), s.unit) != keep.end()) continue;
      if (best == kNone || s.last_use < slots_[std::size_t(best)].last_use) best = i;
    }
    TORCH_CHECK(best != kNone, "FrozenUnits: no free slot for unit '", units_[std::size_t(unit)].name, "'");
    Slot& s = slots_[std::size_t(best)];
    if (s.unit != kNone) {
      Unit& old = units_[std::size_t(s.unit)];
      bind(old, old.host);
      old.slot = -1;
    }
    Unit& u = units_[std::size_t(unit)];
    const int64_t bytes = int64_t(u.host.nbytes());
    try {
      torch::Tensor dst = s.buffer.narrow(0, 0, bytes);
      if (copy_.active()) {
        copy_.wait(record_current(device_));  // every use of the unit the slot held is queued before this
        copy_.run([&] { dst.copy_(u.host, /*non_blocking=*/true); });
        s.ready = copy_.record();
      } else {
        dst.copy_(u.host);
      }
    } catch (const std::exception& e) {
      throw Error("Offload<Host, Streamed>: copying frozen unit '" + u.name + "' (" + gigabytes(bytes) + ") from host memory to " +
                  device_.str() + " failed: " + e.what());
    }
    s.unit = unit;
    s.last_use = ++clock_;
    u.slot = best;
    bind(u, s.buffer);
    stats_.h2d_bytes += bytes;
  }

  // The unit expected after (a, b): learned, else b's neighbour in the direction a -> b (forward from none).
  int predict(int a, int b) const {
    if (auto it = next_.find({a, b}); it != next_.end()) return it->second;
    const int n = int(units_.size());
    const int guess = (a == kNone || a < b) ? b + 1 : b - 1;
    return guess >= 0 && guess < n ? guess : kNone;
  }
  void prefetch() {
    std::vector<int> window{cur_};
    int a = prev_, b = cur_;
    for (int k = 0; k < depth_; ++k) {
      const int c = predict(a, b);
      if (c == kNone || std::find(window.begin(), window.end(), c) != window.end()) break;
      window.push_back(c);
      if (units_[std::size_t(c)].slot < 0) bring(c, window);
      a = b;
      b = c;
    }
  }

  torch::Device device_;
  int depth_;
  SideStream copy_;
  std::vector<Unit> units_;
  std::vector<Slot> slots_;
  std::map<std::pair<int, int>, int> next_;
  int prev_ = kNone, cur_ = kNone;
  uint64_t clock_ = 0;
  int64_t largest_ = 0;
  FrozenUnitStats stats_;
  mutable std::mutex mu_;
};

}  // namespace squeeze::engine
