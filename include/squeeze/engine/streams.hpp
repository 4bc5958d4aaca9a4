#pragma once
// Side streams and events for overlapping transfers and collectives with compute (torch layer).
//
// Real only in CUDA builds of the torch layer: compile with SQUEEZE_TORCH_CUDA=1 and link c10_cuda (the
// GPU machine's build does). Everywhere else -- and for CPU tensors in a CUDA build -- a SideStream is
// inert: run() calls the function on the current stream, events are empty and waits do nothing, so
// the same code runs in program order on the calling thread (which is what the CPU tests check).
//
//   SideStream s(device);                  // a pool stream of device's GPU (inert for the CPU)
//   s.wait(record_current(device));        // s waits for everything enqueued so far on the current stream
//   s.run([&] { dst.copy_(src, true); });  // enqueued on s
//   Event done = s.record();               // ... and the current stream, or a host thread, waits for it:
//   wait_current(device, done);  done.synchronize();
//   s.record_use(t);                       // t (allocated on one stream) is also used on s: tell the allocator
#include <torch/torch.h>

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "squeeze/error.hpp"
#if defined(__CUDACC__)
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#endif

#if defined(SQUEEZE_TORCH_CUDA) && SQUEEZE_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#define SQUEEZE_NN_STREAMS 1
#endif

namespace squeeze::engine {

#if SQUEEZE_NN_STREAMS

// A CUDA event (timing disabled), shared by copies; empty = already complete.
class Event {
 public:
  Event() = default;
  // timed: the event can be one end of elapsed_s (a copy's or a wait's duration on the GPU).
  static Event record_on(cudaStream_t s, c10::DeviceIndex dev, bool timed = false) {
    c10::cuda::CUDAGuard g(dev);
    Event e;
    cudaEvent_t ev = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, timed ? cudaEventDefault : cudaEventDisableTiming));
    e.ev_ = std::shared_ptr<CUevent_st>(ev, [](cudaEvent_t x) { (void)cudaEventDestroy(x); });
    C10_CUDA_CHECK(cudaEventRecord(ev, s));
    return e;
  }
  bool empty() const { return ev_ == nullptr; }
  void synchronize() const {  // host waits
    if (ev_) C10_CUDA_CHECK(cudaEventSynchronize(ev_.get()));
  }
  bool query() const {  // complete, without waiting
    if (!ev_) return true;
    const cudaError_t e = cudaEventQuery(ev_.get());
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: clear it so the next check does not report it
      return false;
    }
    C10_CUDA_CHECK(e);
    return true;
  }
  void block(cudaStream_t s) const {  // stream s waits
    if (ev_) C10_CUDA_CHECK(cudaStreamWaitEvent(s, ev_.get(), 0));
  }
  // Seconds from `from` to `to` on the GPU, both timed and complete (query() true).
  static double elapsed_s(const Event& from, const Event& to) {
    if (!from.ev_ || !to.ev_) return 0;
    float ms = 0;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, from.ev_.get(), to.ev_.get()));
    return double(ms) / 1e3;
  }

 private:
  std::shared_ptr<CUevent_st> ev_;
};

class SideStream {
 public:
  SideStream() = default;
  explicit SideStream(torch::Device d) {
    if (d.is_cuda()) stream_ = std::make_unique<c10::cuda::CUDAStream>(c10::cuda::getStreamFromPool(false, d.index()));
  }
  bool active() const { return stream_ != nullptr; }
  void* handle() const { return stream_ ? static_cast<void*>(stream_->stream()) : nullptr; }
  template <class F>
  decltype(auto) run(F&& f) {
    if (!stream_) return f();
    c10::cuda::CUDAStreamGuard g(*stream_);
    return f();
  }
  Event record(bool timed = false) const { return stream_ ? Event::record_on(stream_->stream(), stream_->device_index(), timed) : Event(); }
  void wait(const Event& e) const {
    if (stream_) e.block(stream_->stream());
  }
  // The caching allocator must not reuse t's memory before the work queued on this stream is done.
  void record_use(const torch::Tensor& t) const {
    if (stream_ && t.defined() && t.is_cuda()) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *stream_);
  }

 private:
  std::unique_ptr<c10::cuda::CUDAStream> stream_;
};

// An event on the current stream of d (empty for the CPU).
inline Event record_current(torch::Device d, bool timed = false) {
  if (!d.is_cuda()) return {};
  return Event::record_on(c10::cuda::getCurrentCUDAStream(d.index()).stream(), d.index(), timed);
}
// The current stream of d waits for e.
inline void wait_current(torch::Device d, const Event& e) {
  if (d.is_cuda()) e.block(c10::cuda::getCurrentCUDAStream(d.index()).stream());
}
// Makes d the current device of this thread (worker threads start on device 0).
inline void set_device(torch::Device d) {
  if (d.is_cuda()) c10::cuda::set_device(d.index());
}
// [n] host memory pinned for asynchronous copies, exactly n elements (cudaHostAlloc; cudaFreeHost when the last
// tensor sharing it goes). Not torch's caching host allocator: that rounds every request up to a power of two (a
// LLaMA-7B layer's fp32 shard takes about a third more than Offload<Host> plans) and keeps freed
// blocks cached for later requests of the same size class only, so a second trainer in the process (another
// state layout) allocates beside the first one's cached blocks until the host runs out.
inline torch::Tensor pinned_empty(int64_t n, torch::ScalarType dtype) {
  TORCH_CHECK(n >= 0, "pinned_empty: negative size ", n);
  void* p = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&p, std::max<size_t>(1, size_t(n) * c10::elementSize(dtype)), cudaHostAllocDefault));
  return torch::from_blob(
      p, {n}, [](void* q) { (void)cudaFreeHost(q); }, torch::TensorOptions().dtype(dtype));
}

// t (allocated on a side stream) is used on the current stream too.
inline void record_use_current(const torch::Tensor& t) {
  if (t.defined() && t.is_cuda())
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), c10::cuda::getCurrentCUDAStream(t.device().index()));
}

#else  // no CUDA in the torch layer: everything in program order

class Event {
 public:
  bool empty() const { return true; }
  void synchronize() const {}
  bool query() const { return true; }
  static double elapsed_s(const Event&, const Event&) { return 0; }
};
class SideStream {
 public:
  SideStream() = default;
  explicit SideStream(torch::Device) {}
  bool active() const { return false; }
  void* handle() const { return nullptr; }
  template <class F>
  decltype(auto) run(F&& f) {
    return f();
  }
  Event record(bool = false) const { return {}; }
  void wait(const Event&) const {}
  void record_use(const torch::Tensor&) const {}
};
// Pinned through torch where the torch layer has no CUDA of its own (only reached with a CUDA device).
inline torch::Tensor pinned_empty(int64_t n, torch::ScalarType dtype) {
  return torch::empty({n}, torch::TensorOptions().dtype(dtype).pinned_memory(true));
}
inline Event record_current(torch::Device, bool = false) { return {}; }
inline void wait_current(torch::Device, const Event&) {}
inline void set_device(torch::Device) {}
inline void record_use_current(const torch::Tensor&) {}

#endif

// [n] zeroed host memory for state only the CPU touches (the offloaded moments, a master that is not uploaded): a
// private anonymous mapping, which the kernel hands out zero-filled page by page on first touch, so nothing is
// written when the trainer is built, with transparent huge pages asked for (MADV_HUGEPAGE: a 2 MB fault where 4 KB
// ones would take most of the first touch's time; a hint the kernel may ignore). Unmapped when the last tensor
// sharing it goes. Host bytes are resident only once touched: the first optimizer step touches them all.
inline torch::Tensor host_zeros(int64_t n, torch::ScalarType dtype) {
  TORCH_CHECK(n >= 0, "host_zeros: negative size ", n);
  const size_t bytes = std::max<size_t>(1, size_t(n) * c10::elementSize(dtype));
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "host_zeros: cannot map ", bytes, " bytes of host memory for optimizer state: ", std::strerror(errno));
  constexpr size_t kHugePage = size_t(2) << 20;
  if (bytes >= kHugePage) (void)::madvise(p, bytes, MADV_HUGEPAGE);
  return torch::from_blob(
      p, {n}, [bytes](void* q) { (void)::munmap(q, bytes); }, torch::TensorOptions().dtype(dtype));
}

#if defined(__CUDACC__)
// Runs launch(stream) for a kernel launcher of kernels/ (it returns cudaError_t) on the current stream of `on`'s
// device, that device current, and turns a refused argument or a failed launch into an error naming `what`.
template <class Launch>
inline void launch_on_current_stream(const torch::Tensor& on, const char* what, Launch&& launch) {
  const c10::DeviceGuard device(on.device());
  const auto stream =
      static_cast<cudaStream_t>(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(on.device()).native_handle());
  cudaError_t e = cudaSuccess;
  try {
    e = launch(stream);
  } catch (const squeeze::Error& err) {
    TORCH_CHECK(false, what, ": ", err.what());
  }
  TORCH_CHECK(e == cudaSuccess, what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}
#endif

}  // namespace squeeze::engine
