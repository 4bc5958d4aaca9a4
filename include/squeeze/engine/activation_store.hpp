#pragma once
// Checkpointed segment inputs kept in host memory between a pass's forward and its backward
// (CheckpointOffload<Host>; docs/architecture.md, "Offloaded checkpoints").
//
//   forward   stash(x)   x [B, T, h] is copied into pinned host memory of exactly its size on the copy-out stream, after
//                        the compute queued so far (what produced x). The device tensor is held while it is among the
//                        `keep` most recent (backward starts with them: nothing to bring back), then let go: the
//                        allocator reuses it once the copy has read it.
//   backward  fetch(s)   s's values on the device: waited for where a prefetch brought them, copied now otherwise; the
//                        `keep` slots stashed before s start coming back on the copy-in stream, into the compute
//                        stream's pool (as a streamed unit's gather does).
//   end_pass()           what the pass left (a forward without backward, a failed backward) is let go; host buffers
//                        go back to a pool by size and serve the next pass without a new pinned allocation.
// In 8 bits (int8 codes, blockwise absmax over kCheckpointBlock values, one fp32 scale each, packed in one byte
// buffer: encode_int8 / decode_int8) the stored payload is what is copied, kept or prefetched; a fetch decodes it.
// On the device only (to_host false: CheckpointOffload<Device, Int8>) nothing is copied: every payload stays there.
// For a CPU model the same steps run in program order, a host copy each way (what the CPU tests check).
// A copy that fails, or host memory beyond the budget, is a squeeze::Error naming the slot and its bytes.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "squeeze/engine/memory_info.hpp"
#include "squeeze/engine/streams.hpp"
#include "squeeze/error.hpp"

namespace squeeze::engine {

inline constexpr int64_t kCheckpointBlock = 256;  // values under one absmax in 8-bit checkpoints

// x [...] -> one uint8 buffer [nb·256 + 4·nb]: int8 codes round(x · 127 / absmax) of nb = ceil(n / 256) blocks (the
// last zero-padded), then the blocks' absmax as fp32. Torch ops, on x's device, over runs of kInt8RunBlocks blocks, so
// the float temporaries stay a few hundred MB for any input (a long context's input is GBs). |decode - x| <= absmax /
// 254 per block (then rounded to x's dtype).
inline constexpr int64_t kInt8RunBlocks = int64_t(1) << 16;  // 16M values a run
inline torch::Tensor encode_int8(const torch::Tensor& x, int64_t run_blocks = kInt8RunBlocks) {
  const torch::Tensor flat = x.detach().reshape({-1});
  const int64_t n = flat.numel(), nb = (n + kCheckpointBlock - 1) / kCheckpointBlock;
  torch::Tensor payload = torch::empty({nb * (kCheckpointBlock + 4)}, flat.options().dtype(torch::kUInt8));
  torch::Tensor codes = payload.narrow(0, 0, nb * kCheckpointBlock).view(torch::kInt8).view({nb, kCheckpointBlock});
  torch::Tensor scales = payload.narrow(0, nb * kCheckpointBlock, nb * 4).view(torch::kFloat32);  // [nb]
  for (int64_t b0 = 0; b0 < nb; b0 += run_blocks) {
    const int64_t runs = std::min(run_blocks, nb - b0), v0 = b0 * kCheckpointBlock, values = std::min(runs * kCheckpointBlock, n - v0);
    const torch::Tensor run = torch::constant_pad_nd(flat.narrow(0, v0, values).to(torch::kFloat32), {0, runs * kCheckpointBlock - values})
                                  .view({runs, kCheckpointBlock});  // [runs, 256]
    const torch::Tensor absmax = run.abs().amax(1);                 // [runs]
    const torch::Tensor inv = torch::where(absmax > 0, 127.0f / absmax, torch::zeros_like(absmax));
    codes.narrow(0, b0, runs).copy_((run * inv.unsqueeze(1)).round_());
    scales.narrow(0, b0, runs).copy_(absmax);
  }
  return payload;
}
// The inverse: n values of `dtype` in `sizes`, on the payload's device (by runs, as encode_int8).
inline torch::Tensor decode_int8(const torch::Tensor& payload, const std::vector<int64_t>& sizes, torch::ScalarType dtype,
                                 int64_t run_blocks = kInt8RunBlocks) {
  int64_t n = 1;
  for (int64_t d : sizes) n *= d;
  const int64_t nb = (n + kCheckpointBlock - 1) / kCheckpointBlock;
  const torch::Tensor codes = payload.narrow(0, 0, nb * kCheckpointBlock).view(torch::kInt8).view({nb, kCheckpointBlock});
  const torch::Tensor absmax = payload.narrow(0, nb * kCheckpointBlock, nb * 4).view(torch::kFloat32);
  torch::Tensor out = torch::empty({n}, payload.options().dtype(dtype));
  for (int64_t b0 = 0; b0 < nb; b0 += run_blocks) {
    const int64_t runs = std::min(run_blocks, nb - b0), v0 = b0 * kCheckpointBlock, values = std::min(runs * kCheckpointBlock, n - v0);
    const torch::Tensor run = codes.narrow(0, b0, runs).to(torch::kFloat32) * (absmax.narrow(0, b0, runs) / 127.0f).unsqueeze(1);
    out.narrow(0, v0, values).copy_(run.reshape({-1}).narrow(0, 0, values));
  }
  return out.view(sizes);
}

struct ActivationStats {
  int64_t d2h_bytes = 0;          // copied to the host
  int64_t h2d_bytes = 0;          // copied back
  int64_t host_bytes = 0;         // pinned (or host) buffers held, pooled ones included
  int64_t stashed = 0;            // slots stashed
  int64_t kept_on_device = 0;     // fetched without a copy back (among the last `keep` of the forward)
  int64_t prefetched = 0;         // fetched after a prefetch
  int64_t fetched_late = 0;       // fetched by a copy issued at the fetch (nothing had prefetched it)
  int64_t device_peak_bytes = 0;  // the most bytes of stashed inputs held on the device at once
};

class ActivationStore {
 public:
  struct Slot {
    int64_t index = 0;
    std::vector<int64_t> sizes;
    torch::ScalarType dtype = torch::kFloat32;
    torch::Tensor host;     // [numel] the host copy of the payload (the values, or their 8-bit encoding)
    torch::Tensor device;   // the payload on the device while kept or prefetched
    Event copied_out;       // the host copy is complete
    Event copied_in;        // the prefetched device copy is complete
    bool returned = false;  // brought back from the host copy
    bool fetched = false;
  };
  using SlotPtr = std::shared_ptr<Slot>;

  // keep: the most recent stashed inputs held on the device, and how many slots a fetch prefetches (>= 0).
  // host_budget_bytes: the most host bytes the pass's copies may hold (0: the host's available memory at the
  // pass's first stash). int8: stored in 8 bits. to_host false: kept on the device (8 bits only).
  ActivationStore(torch::Device device, int keep, int64_t host_budget_bytes = 0, bool int8 = false, bool to_host = true)
      : device_(device), keep_(keep), budget_(host_budget_bytes), int8_(int8), to_host_(to_host), out_(device), in_(device) {
    TORCH_CHECK(to_host || int8, "ActivationStore: inputs kept on the device as they are need no store (plain checkpointing)");
    TORCH_CHECK(keep >= 0, "CheckpointOffload<Host>: the number of inputs kept on the device must be >= 0, got ", keep);
    TORCH_CHECK(host_budget_bytes >= 0, "CheckpointOffload<Host>: the host budget must be >= 0 bytes, got ", host_budget_bytes);
  }
  ActivationStore(const ActivationStore&) = delete;
  ActivationStore& operator=(const ActivationStore&) = delete;

  SlotPtr stash(const torch::Tensor& x) {
    TORCH_CHECK(x.defined(), "CheckpointOffload: an undefined checkpoint input");
    auto s = std::make_shared<Slot>();
    s->index = int64_t(slots_.size());
    s->sizes = x.sizes().vec();
    s->dtype = x.scalar_type();
    if (!to_host_) {  // 8 bits on the device: nothing to copy
      s->device = encode_int8(x);
      stats_.device_peak_bytes = std::max(stats_.device_peak_bytes, on_device_bytes_ += int64_t(s->device.nbytes()));
      ++stats_.stashed;
      slots_.push_back(s);
      return s;
    }
    const int64_t bytes = int8_ ? int64_t(encoded_bytes(x.numel())) : int64_t(x.nbytes());
    // MemAvailable already excludes the pooled buffers, which this pass reuses first: they count as available.
    if (slots_.empty() && budget_ == 0) pass_budget_ = host_memory_available().value_or(INT64_MAX - pooled_bytes_) + pooled_bytes_;
    if (slots_.empty() && budget_ > 0) pass_budget_ = budget_;
    if (pass_host_bytes_ + bytes > pass_budget_)
      throw Error("CheckpointOffload<Host>: checkpoint input " + std::to_string(s->index) + " (" + gigabytes(bytes) +
                  ") would bring this pass's host copies to " + gigabytes(pass_host_bytes_ + bytes) + ", beyond the " +
                  gigabytes(pass_budget_) + " allowed: shorten the sequence or the batch, or raise TrainerOptions::activation_host_bytes");
    try {
      const torch::Tensor src = int8_ ? encode_int8(x) : x.detach().contiguous().view({-1});
      s->host = take_host(src.numel(), src.scalar_type());
      if (out_.active()) {
        out_.wait(record_current(device_));  // x's producer is queued on the compute stream
        out_.record_use(src);
        out_.run([&] { s->host.copy_(src, /*non_blocking=*/true); });
        s->copied_out = out_.record();
      } else {
        s->host.copy_(src);
      }
      s->device = src;
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error("CheckpointOffload<Host>: copying checkpoint input " + std::to_string(s->index) + " (" + gigabytes(bytes) + ") from " +
                  x.device().str() + " to host memory failed: " + e.what());
    }
    pass_host_bytes_ += bytes;
    stats_.d2h_bytes += bytes;
    ++stats_.stashed;
    slots_.push_back(s);
    on_device_bytes_ += bytes;
    stats_.device_peak_bytes = std::max(stats_.device_peak_bytes, on_device_bytes_);
    // Only the most recent `keep` stay on the device; the older one's memory returns to the pool once copied.
    if (int64_t(slots_.size()) > keep_) release_device(*slots_[slots_.size() - 1 - std::size_t(keep_)]);
    return s;
  }

  // s's values on the device, in its shape; then the `keep` slots before it are brought back ahead of their use.
  torch::Tensor fetch(const SlotPtr& s) {
    TORCH_CHECK(s != nullptr, "CheckpointOffload: fetching an empty slot");
    if (s->fetched)
      throw Error("CheckpointOffload: checkpoint input " + std::to_string(s->index) +
                  " was fetched twice: a second backward through one graph (retain_graph) is not supported with offloaded checkpoints");
    torch::Tensor out;
    if (!to_host_) {
      ++stats_.kept_on_device;
      out = s->device;
    } else if (s->device.defined()) {
      (s->returned ? stats_.prefetched : stats_.kept_on_device) += 1;
      wait_current(device_, s->copied_in);
      out = s->device;
    } else {
      ++stats_.fetched_late;
      bring_back(*s);
      wait_current(device_, s->copied_in);
      out = s->device;
    }
    s->fetched = true;
    for (int64_t k = s->index - 1; to_host_ && k >= 0 && k >= s->index - keep_; --k) {
      Slot& p = *slots_[std::size_t(k)];
      if (!p.fetched && !p.device.defined()) bring_back(p);
    }
    release_device(*s);
    give_back(*s);
    return int8_ ? decode_int8(out, s->sizes, s->dtype) : out.view(s->sizes);
  }
  // Bytes of the 8-bit payload of n values.
  static int64_t encoded_bytes(int64_t n) {
    const int64_t nb = (n + kCheckpointBlock - 1) / kCheckpointBlock;
    return nb * kCheckpointBlock + nb * 4;
  }

  // The pass is over (its backward done, or abandoned): everything it stashed is let go.
  void end_pass() {
    for (auto& s : slots_) {
      release_device(*s);
      give_back(*s);
    }
    slots_.clear();
    pass_host_bytes_ = 0;
    on_device_bytes_ = 0;
  }

  ActivationStats stats() const {
    ActivationStats s = stats_;
    s.host_bytes = pooled_bytes_ + pass_host_bytes_;
    return s;
  }

 private:
  // The host copy goes back to the device on the copy-in stream, into a buffer of the compute stream's pool.
  void bring_back(Slot& s) {
    const int64_t bytes = int64_t(s.host.nbytes());
    try {
      const auto opts = torch::TensorOptions().dtype(s.host.scalar_type()).device(device_);
      if (in_.active()) {
        in_.wait(record_current(device_));  // the compute queued so far may still use the block the buffer reuses
        in_.wait(s.copied_out);
        torch::Tensor buf = torch::empty({s.host.numel()}, opts);
        in_.record_use(buf);
        in_.record_use(s.host);
        in_.run([&] { buf.copy_(s.host, /*non_blocking=*/true); });
        s.copied_in = in_.record();
        s.device = buf;
      } else {
        s.device = s.host.to(opts, /*non_blocking=*/false, /*copy=*/true);
      }
    } catch (const std::exception& e) {
      throw Error("CheckpointOffload<Host>: copying checkpoint input " + std::to_string(s.index) + " (" + gigabytes(bytes) +
                  ") from host memory to " + device_.str() + " failed: " + e.what());
    }
    s.returned = true;
    stats_.h2d_bytes += bytes;
    on_device_bytes_ += bytes;
    stats_.device_peak_bytes = std::max(stats_.device_peak_bytes, on_device_bytes_);
  }
  void release_device(Slot& s) {
    if (!s.device.defined()) return;
    on_device_bytes_ -= int64_t(s.device.nbytes());
    s.device = torch::Tensor();
  }
  // The host buffer returns to the pool once the copy back (if any) has read it.
  void give_back(Slot& s) {
    if (!s.host.defined()) return;
    const int64_t bytes = int64_t(s.host.nbytes());
    const auto key = std::make_pair(bytes, s.host.scalar_type());
    pool_.emplace(key, Pooled{std::move(s.host), s.copied_in});
    s.host = torch::Tensor();
    pooled_bytes_ += bytes;
    pass_host_bytes_ -= bytes;
  }
  // [n] host memory: from the pool where a buffer of exactly these bytes waits (the copy-out stream first waits for
  // its last copy back), else pinned for a GPU model, plain for a CPU one.
  torch::Tensor take_host(int64_t n, torch::ScalarType dtype) {
    const int64_t bytes = n * int64_t(c10::elementSize(dtype));
    auto it = pool_.find(std::make_pair(bytes, dtype));
    if (it != pool_.end()) {
      Pooled p = std::move(it->second);
      pool_.erase(it);
      pooled_bytes_ -= bytes;
      out_.wait(p.read_by);
      if (!out_.active()) p.read_by.synchronize();
      return p.buffer;
    }
    return device_.is_cuda() ? pinned_empty(n, dtype) : torch::empty({n}, torch::TensorOptions().dtype(dtype));
  }

  struct Pooled {
    torch::Tensor buffer;
    Event read_by;  // the last copy that read it
  };

  torch::Device device_;
  int64_t keep_;
  int64_t budget_, pass_budget_ = INT64_MAX;
  bool int8_, to_host_;
  SideStream out_, in_;
  std::vector<SlotPtr> slots_;  // this pass's, in stash order
  std::multimap<std::pair<int64_t, torch::ScalarType>, Pooled> pool_;
  int64_t pooled_bytes_ = 0, pass_host_bytes_ = 0, on_device_bytes_ = 0;
  ActivationStats stats_;
};

}  // namespace squeeze::engine
