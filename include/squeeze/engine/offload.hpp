#pragma once
// Offload<Host> pipeline: gradient shards stream device -> host as they become final during backward,
// a worker thread runs the CPU AdamW on each partition, updated parameters stream host -> device, so the
// transfers and the optimizer overlap the backward pass (and, at stage 3, the next forward).
//
// A Partition is what one rank updates: a stage-2 gradient bucket's shard, a stage-3 layer's shard, or the
// stage-1 shard. Per partition and optimizer step:
//
//   gradient_ready(p)   (backward thread, when p's reduced gradient for the window is final)
//       CUDA: the d2h stream waits for the current stream, sums p.grad's squares on the device (float64,
//             sum_squares_tensor) into a pinned double, copies p.grad -> p.host_grad (pinned), zeroes p.grad
//       worker: waits for the copy and reads p.sumsq from it (CPU model: copies, then chunked_sum_squares of
//               host_grad: fixed chunking, the same bits whatever the thread count), then the job's `then`
//               (eager update)
//   update(p, fn)       (trainer, after the global norm is known; or `then` above)
//       worker: fn(p) (the CPU AdamW on p.master, p.m, p.v (+ block scales) with p.host_grad), then
//       CUDA: the h2d stream waits for the compute work queued before the job, copies the new parameters to
//             p.param: from host_grad when fn staged them there in param's dtype (p.staged), else p.master
//   wait(p) / wait_all()  the host waits for the jobs, the current stream for their copies
//
//   gradient_part(p, g)  (Offload<Host, Streamed>: backward, each time a streamed unit's gradient of one pass is reduced)
//       g [n] is a transient device tensor: the window's first part is copied into p.host_grad (its sum of squares
//       with it), later ones (accumulation) into p.host_stage (host_stage_for) and added by the worker;
//       gradient_ready then only finishes the sum, and the update leaves the new parameters in p.param, host memory
//       (nothing is uploaded: Partition::written).
//
// With threaded = false every job runs inline at once (the non-overlapped reference path); the arithmetic
// is the same function either way, so both paths give the same bits (tests/train/test_zero.cpp checks it).
// One worker. Of the queued jobs whose input has landed on the host (a gradient job: its copy is done; an update:
// at once) it takes the one of the lowest Partition::priority (ties: submission order); when none has landed, the
// earliest submitted, which is the first to land (the copies run in submission order on one stream). A
// partition's own jobs never run out of order. The trainer ranks partitions in the order the next forward needs
// them: backward hands gradients over last layer first and the CPU updates each as it lands; the backlog it has not
// updated when backward ends is worked off first layer first, so the next forward starts as soon as its first layer
// has landed instead of after the whole backlog (wait(p) waits for p's own jobs only). Taking the lowest priority
// among jobs still in flight instead would hold the worker on the layer backward hands over last (the host queues
// backward's jobs long before the GPU reaches them), idle for all of backward.
#include <torch/torch.h>

#include "squeeze/kernels/adamw.hpp"
#include "squeeze/kernels/adamw8.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "squeeze/dtype.hpp"
#include "squeeze/kernels/cpu_parallel.hpp"
#include "squeeze/kernels/grad_norm.hpp"
#if defined(__CUDACC__)
#include "squeeze/kernels/grad_norm.cuh"
#endif
#include "squeeze/engine/streams.hpp"

namespace squeeze::engine {

// One optimizer partition: what this rank updates.
// A run of a partition's elements whose parameters share one parameter group (learning rate, weight decay).
struct Segment {
  int64_t begin = 0, len = 0;  // elements [begin, begin + len) of the partition
  int group = 0;               // index into the trainer's group settings
  int64_t block = 0;           // 8-bit state: the segment's first absmax block (blocks start at each segment)
};
using GroupCoeffs = std::vector<kernels::AdamWCoeffs>;  // one set of AdamW coefficients per group

// The segments of elements [begin, begin + n) of a flat buffer of `padded` elements whose entries (in offset order,
// each with .offset and a group from group_of(entry)) share a group: each entry's range runs to the next entry's
// offset, so alignment gaps (zeros, which no update changes) join it; neighbours of one group merge. 8-bit state
// starts a block at each segment. The trainer cuts its partitions so; a checkpoint's reshard recomputes the cut of
// any rank at any world from the layout and the groups the index records.
template <class Entries, class GroupOf>
std::vector<Segment> state_segments(const Entries& es, int64_t padded, int64_t begin, int64_t n, GroupOf&& group_of) {
  const int64_t end = begin + n;
  std::vector<Segment> out;
  for (std::size_t i = 0; i < es.size(); ++i) {
    const int64_t lo = std::max(begin, i == 0 ? int64_t(0) : int64_t(es[i].offset));
    const int64_t hi = std::min(end, i + 1 < es.size() ? int64_t(es[i + 1].offset) : padded);
    if (lo >= hi) continue;
    const int g = group_of(es[i]);
    if (!out.empty() && out.back().group == g)
      out.back().len += hi - lo;
    else
      out.push_back({lo - begin, hi - lo, g});
  }
  for (std::size_t i = 1; i < out.size(); ++i) out[i].block = out[i - 1].block + kernels::state_blocks(out[i - 1].len);
  return out;
}

struct Partition {
  torch::Tensor param;               // [n] compute dtype, written by AdamW (flat-buffer slice or stage-3 shard)
  torch::Tensor grad;                // [n] reduced gradient (stage 0: the full buffer itself)
  torch::Tensor master;              // [n] fp32 master (mixed precision, or on the host under offload); bf16 for a
                                     // compact state's device layer (its host copy)
  torch::Tensor m, v;                // [n] Adam moments: fp32, or uint8 codes with 8-bit state (QuantizedState<8>)
  torch::Tensor m_absmax, v_absmax;  // [ceil(n / 256)] fp32 block scales of m and v (8-bit state only)
  torch::Tensor host_grad;           // [n] host copy of grad in grad's dtype (offload; pinned for a CUDA model)
  torch::Tensor host_sumsq;          // [1] float64, pinned: the device's sum of squares of grad (offload of a CUDA model)
  std::vector<Segment> segments;     // cover [0, n) in order
  std::uint64_t rounding_index = 0;  // stochastic rounding (no master): element 0's index in the update's random stream
  int64_t priority = 0;              // the worker's order among queued jobs, lowest first (see the header)
  bool waited_by_gather = false;     // stage 3: the next gather waits for the update (others: the step does)
  // The update wrote the new parameters, rounded to param's dtype, over host_grad (possible when grad and
  // param share a 16-bit dtype): the upload then moves 2 bytes per parameter instead of the fp32 master's 4.
  bool staged = false;
  bool written = false;  // the update wrote p.param itself (host parameters): nothing to copy back
  // Streamed (Offload<Host, Streamed>): param is host memory, grad undefined; gradients arrive by gradient_part.
  bool streamed = false;
  int parts = 0;             // gradient parts handed over this window
  bool device_sum = false;   // this window's sum of squares came from the device with its only part
  torch::Tensor host_stage;  // [n] pinned: a later part on its way to be added into host_grad (accumulation)
  // Offload pipeline state (written by the worker, read after wait()).
  double sumsq = 0;            // sum of squares of host_grad (scaled gradient), this window
  bool submitted = false;      // gradient_ready was called this window
  std::uint64_t last_job = 0;  // the id of the last job submitted for this partition
  std::uint64_t done_job = 0;  // the id of the last job of this partition that finished
  Event d2h_done, h2d_done;
};

// A streamed partition's landing buffer for later gradient parts: host_grad's size and dtype, pinned for a GPU model.
inline torch::Tensor host_stage_for(const Partition& p, torch::Device device) {
  return device.is_cuda() ? pinned_empty(p.host_grad.numel(), p.host_grad.scalar_type()) : torch::empty_like(p.host_grad);
}

// Exchanges the memory behind two host tensors of the same byte size; every tensor sharing either storage follows.
// A streamed unit's new parameters, rounded into its gradient copy beside the gradient just read (no read of a
// separate destination), become its shard without a copy, and the old shard's memory takes the next gradient.
inline void swap_storage(const torch::Tensor& a, const torch::Tensor& b) {
  c10::StorageImpl* x = a.storage().unsafeGetStorageImpl();
  c10::StorageImpl* y = b.storage().unsafeGetStorageImpl();
  TORCH_CHECK(x != y && x->nbytes() == y->nbytes() && x->device() == y->device(), "swap_storage: storages of ", x->nbytes(), " and ",
              y->nbytes(), " bytes on ", x->device(), " and ", y->device(), " cannot trade places");
  at::DataPtr dx = x->set_data_ptr(at::DataPtr(nullptr, x->device()));
  at::DataPtr dy = y->set_data_ptr(std::move(dx));
  x->set_data_ptr(std::move(dy));
}

// Sum of squares in double, deterministic: fixed 4 Ki-element chunks, each summed in order, chunk sums
// added in order; chunks are spread over the cores.
inline double chunked_sum_squares(const torch::Tensor& t) {
  TORCH_CHECK(t.is_cpu() && t.is_contiguous(), "chunked_sum_squares: needs a contiguous host tensor");
  const int64_t n = t.numel();
  if (n == 0) return 0.0;
  constexpr int64_t kChunk = int64_t(1) << 12;  // 4 Ki: partitions from 4 Mi elements up use every core
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> part(std::size_t(chunks), 0.0);
  auto run = [&]<class T>(const T* p) {
    kernels::cpu::parallel_ranges(chunks * kernels::cpu::kRangeAlign, [&](int, int64_t b, int64_t e) {
      for (int64_t c = b / kernels::cpu::kRangeAlign; c < e / kernels::cpu::kRangeAlign; ++c) {
        double acc = 0;
        const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
        for (int64_t i = lo; i < hi; ++i) acc = kernels::NormOp<kernels::NormType::L2>::element(acc, to_float(p[i]));
        part[std::size_t(c)] = acc;
      }
    });
  };
  switch (t.scalar_type()) {
    case torch::kFloat32:
      run(t.data_ptr<float>());
      break;
    case torch::kBFloat16:
      run(reinterpret_cast<const bf16*>(t.data_ptr()));
      break;
    case torch::kFloat16:
      run(reinterpret_cast<const half*>(t.data_ptr()));
      break;
    default:
      TORCH_CHECK(false, "chunked_sum_squares: unsupported dtype ", t.scalar_type());
  }
  double total = 0;
  for (double x : part) total += x;
  return total;
}

// Sum of squares of t (any device, float/half/bf16) in float64, where t lives, in torch ops: a 0-dim float64
// tensor on t's device, no host synchronisation. Per chunk of `chunk` elements, linalg_vector_norm in float64
// (t cast to float64 one chunk at a time, so the temporaries stay at 8 * chunk bytes); the chunk norms are
// squared and summed in order. Deterministic (torch's reductions use a fixed order for a given size and device)
// and within float64 rounding of the exact sum: each chunk sum carries ~n_chunk * 2^-53 relative error, the
// sqrt and square 2 ulps more; all terms are non-negative, so relative errors do not grow through the sum.
// inf/NaN propagate (an overflow check). On the GPU a bf16 gradient costs ~18 bytes of device traffic per element
// (read 2, write and read 8), a small fraction of the same sum's time on the host's cores.
// Where this header is compiled by nvcc, a CUDA tensor's sum is the gradient-norm kernels' instead
// (kernels/grad_norm.cuh: one read of t, a double per thread, fixed grid and order; `chunk` unused): the trainer's
// device-resident and offloaded partitions both sum through here, so they still agree bit for bit.
inline constexpr int64_t kSumSquaresChunk = int64_t(1) << 24;
#if defined(__CUDACC__)
namespace detail {
// The sum of squares of x [n] into w[kNormMaxBlocks], the partials going in w[0, kNormMaxBlocks). (A function, not a
// generic lambda: nvcc's launch stubs cannot name a kernel instantiated from one.)
template <class G>
cudaError_t sum_squares_cuda(const G* x, int64_t n, double* w, cudaStream_t stream) {
  return kernels::grad_norm_cuda<G>(kernels::Buffer<const G>{x, n}, kernels::NormType::L2, 0.0f, nullptr,
                                    {.reduced = w + kernels::kNormMaxBlocks}, w, stream);
}
}  // namespace detail
#endif
inline torch::Tensor sum_squares_tensor(const torch::Tensor& t, int64_t chunk = kSumSquaresChunk) {
  TORCH_CHECK(chunk >= 1, "sum_squares_tensor: chunk must be >= 1, got ", chunk);
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kFloat16,
              "sum_squares_tensor: unsupported dtype ", t.scalar_type());
  torch::NoGradGuard ng;
  const torch::Tensor f = t.reshape({-1});
  const int64_t n = f.numel();
  const auto f64 = f.options().dtype(torch::kFloat64);
  if (n == 0) return torch::zeros({}, f64);
#if defined(__CUDACC__)
  if (f.is_cuda()) {
    const torch::Tensor c = f.contiguous();
    torch::Tensor out = torch::empty({kernels::kNormMaxBlocks + 1}, f64);  // the per-block partials, then the sum
    double* w = out.data_ptr<double>();
    launch_on_current_stream(c, "sum_squares_tensor (CUDA)", [&](cudaStream_t stream) {
      return c.scalar_type() == torch::kFloat32    ? detail::sum_squares_cuda(c.data_ptr<float>(), n, w, stream)
             : c.scalar_type() == torch::kBFloat16 ? detail::sum_squares_cuda(reinterpret_cast<const bf16*>(c.data_ptr()), n, w, stream)
                                                   : detail::sum_squares_cuda(reinterpret_cast<const half*>(c.data_ptr()), n, w, stream);
    });
    return out[kernels::kNormMaxBlocks];
  }
#endif
  const int64_t chunks = (n + chunk - 1) / chunk;
  torch::Tensor norms = torch::empty({chunks}, f64);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t o = c * chunk;
    norms[c].copy_(torch::linalg_vector_norm(f.narrow(0, o, std::min(chunk, n - o)), 2, std::nullopt, false, torch::kFloat64));
  }
  return norms.square_().sum();
}

// Where the pipeline's host time went (seconds, summed over jobs since the last reset): waiting for device ->
// host copies, summing squares, and the optimizer (AdamW + queueing the upload). In threaded mode this runs
// beside the GPU; its sum per step against the step time says whether the CPU bounds the step.
struct OffloadStats {
  double transfer_wait_s = 0, sum_squares_s = 0, update_s = 0;
  std::int64_t jobs = 0;
  std::int64_t d2h_bytes = 0, h2d_bytes = 0;  // gradients copied to the host, new parameters copied back
};

class OffloadPipeline {
 public:
  using Fn = std::function<void(Partition&)>;
  using Landed = std::function<bool()>;  // a job's input is on the host (unset: from the start)

  OffloadPipeline(torch::Device device, bool threaded) : device_(device), threaded_(threaded), d2h_(device), h2d_(device) {
    if (threaded_) worker_ = std::thread([this] { loop(); });
  }
  OffloadPipeline(const OffloadPipeline&) = delete;
  OffloadPipeline& operator=(const OffloadPipeline&) = delete;
  ~OffloadPipeline() {
    if (!worker_.joinable()) return;
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  bool threaded() const { return threaded_; }

  // Offload<Host, Streamed>: one pass's reduced gradient g [n] of streamed partition p (see the header), queued behind the
  // compute issued so far on the current stream.
  void gradient_part(Partition& p, const torch::Tensor& g) {
    TORCH_CHECK(p.streamed, "OffloadPipeline::gradient_part: the partition is not streamed");
    const bool first = p.parts++ == 0;
    wait(p);  // first: the previous window's update has read host_grad; later: the previous part left host_stage
    if (!first && !p.host_stage.defined()) p.host_stage = host_stage_for(p, device_);  // a unit reduced twice in one pass
    const torch::Tensor& into = first ? p.host_grad : p.host_stage;
    TORCH_CHECK(g.numel() == into.numel(), "OffloadPipeline::gradient_part: a gradient of ", g.numel(), " elements for a partition of ",
                into.numel());
    torch::Tensor kept;  // the device gradient, where the job copies it itself (no copy stream)
    if (d2h_.active()) {
      d2h_.wait(record_current(device_));
      d2h_.run([&] {
        const torch::Tensor src = g.scalar_type() == into.scalar_type() ? g : g.to(into.scalar_type());
        if (first) p.host_sumsq.copy_(sum_squares_tensor(src).reshape({1}), /*non_blocking=*/true);
        into.copy_(src, /*non_blocking=*/true);
      });
      d2h_.record_use(g);
      p.d2h_done = d2h_.record();
    } else {
      kept = g;
    }
    {
      std::lock_guard lk(m_);
      stats_.d2h_bytes += int64_t(into.nbytes());
    }
    submit(
        p,
        [this, first, kept](Partition& q) {
          const auto t0 = clock::now();
          if (d2h_.active()) {
            q.d2h_done.synchronize();
          } else {
            (first ? q.host_grad : q.host_stage).copy_(kept);
          }
          const auto t1 = clock::now();
          if (!first) q.host_grad.add_(q.host_stage);
          account(t1 - t0, clock::duration::zero(), clock::now() - t1);
        },
        [done = p.d2h_done] { return done.query(); });
  }

  // p's gradient for this window is final (called where it became final, e.g. inside backward).
  void gradient_ready(Partition& p, Fn then = {}) {
    if (p.streamed) {
      streamed_gradient_ready(p, std::move(then));
      return;
    }
    wait(p);  // the previous window's update of p has read host_grad
    p.submitted = true;
    {
      std::lock_guard lk(m_);
      stats_.d2h_bytes += int64_t(p.host_grad.nbytes());
    }
    Event after;
    if (d2h_.active()) {
      after = record_current(device_);
      d2h_.wait(after);
      d2h_.run([&] {
        // The norm pass on the device (far faster) instead of the worker's cores: the pinned scalar arrives
        // with the gradient copy, so the worker only reads it.
        // (Fusing it into the CPU AdamW would still cost a host pass when the update waits for the norm.)
        p.host_sumsq.copy_(sum_squares_tensor(p.grad).reshape({1}), /*non_blocking=*/true);
        p.host_grad.copy_(p.grad, /*non_blocking=*/true);
        p.grad.zero_();
      });
      d2h_.record_use(p.grad);
      p.d2h_done = d2h_.record();
    }
    submit(
        p,
        [this, after, then = std::move(then)](Partition& q) {
          const auto t0 = clock::now();
          q.h2d_done.synchronize();  // the last upload of q.master has been read before AdamW rewrites it
          if (d2h_.active()) {
            q.d2h_done.synchronize();
          } else {
            q.host_grad.copy_(q.grad);
            q.grad.zero_();
          }
          sum_and_update(q, d2h_.active(), then, after, t0);
        },
        [done = p.d2h_done] { return done.query(); });
  }

  // Queues fn(p) (the CPU AdamW) after p's gradient job, then streams p.master back into p.param. `landed`, when
  // given, says whether what fn waits for has arrived, for the worker's order only (fn still waits for it itself);
  // inputs are taken to land in submission order.
  void update(Partition& p, Fn fn, Landed landed = {}) {
    Event after = record_current(device_);
    submit(
        p,
        [this, after, fn = std::move(fn)](Partition& q) {
          const auto t0 = clock::now();
          q.h2d_done.synchronize();
          const auto t1 = clock::now();
          fn(q);
          write_back(q, after);
          account(t1 - t0, clock::duration::zero(), clock::now() - t1);
        },
        std::move(landed));
  }

  // The sum of squares of p's gradient for this window (gradient_ready's copy). With the device's sum it waits
  // for that copy alone, not for the job that may update p after it.
  double gradient_sum_squares(Partition& p) {
    if (d2h_.active() && (!p.streamed || p.device_sum)) {
      p.d2h_done.synchronize();
      return p.host_sumsq.data_ptr<double>()[0];
    }
    wait(p);
    return p.sumsq;
  }

  // Whether p's jobs have all run (a failed one counts: wait(p) then reports it), without waiting.
  bool finished(const Partition& p) {
    std::lock_guard lk(m_);
    return p.done_job >= p.last_job || error_;
  }

  // The host waits for p's jobs; the current stream for its copies.
  void wait(Partition& p) {
    std::unique_lock lk(m_);
    done_cv_.wait(lk, [&] { return p.done_job >= p.last_job || error_; });
    rethrow(lk);
    lk.unlock();
    wait_current(device_, p.d2h_done);
    wait_current(device_, p.h2d_done);
  }
  void wait_all() {
    std::unique_lock lk(m_);
    done_cv_.wait(lk, [&] { return done_ >= issued_ || error_; });
    rethrow(lk);
    lk.unlock();
    wait_current(device_, d2h_.record());
    wait_current(device_, h2d_.record());
  }

  OffloadStats stats() {
    std::lock_guard lk(m_);
    return stats_;
  }
  void reset_stats() {
    std::lock_guard lk(m_);
    stats_ = {};
  }

 private:
  using clock = std::chrono::steady_clock;
  void account(clock::duration wait, clock::duration norm, clock::duration update) {
    std::lock_guard lk(m_);
    stats_.transfer_wait_s += std::chrono::duration<double>(wait).count();
    stats_.sum_squares_s += std::chrono::duration<double>(norm).count();
    stats_.update_s += std::chrono::duration<double>(update).count();
    ++stats_.jobs;
  }

  struct Job {
    Partition* p;
    Fn fn;
    std::uint64_t id;
    std::uint64_t previous;  // the id of the partition's job before this one (0: none)
    Landed landed;
  };

  // A streamed partition's window is complete: its parts are in host_grad (none: zeros); the worker takes the sum of
  // squares (the device's, when one part came) and runs `then`.
  void streamed_gradient_ready(Partition& p, Fn then) {
    const bool none = p.parts == 0;
    p.device_sum = d2h_.active() && p.parts == 1;
    p.parts = 0;
    p.submitted = true;
    const Event after = record_current(device_);
    submit(
        p,
        [this, none, device_sum = p.device_sum, after, then = std::move(then)](Partition& q) {
          const auto t0 = clock::now();
          if (none) q.host_grad.zero_();
          if (device_sum) q.d2h_done.synchronize();
          sum_and_update(q, device_sum, then, after, t0);
        },
        [done = p.d2h_done] { return done.query(); });
  }

  // The end of a gradient job, its copy landed (waited for since t0): the sum of squares (the device's, copied with
  // the gradient, or summed here), then the eager update `then` and its upload.
  void sum_and_update(Partition& q, bool device_sum, const Fn& then, const Event& after, clock::time_point t0) {
    const auto t1 = clock::now();
    q.sumsq = device_sum ? q.host_sumsq.data_ptr<double>()[0] : chunked_sum_squares(q.host_grad);
    const auto t2 = clock::now();
    if (then) {
      then(q);
      write_back(q, after);
    }
    account(t1 - t0, t2 - t1, clock::now() - t2);
  }

  void write_back(Partition& q, const Event& after) {
    const bool staged = std::exchange(q.staged, false);
    if (std::exchange(q.written, false)) return;  // host parameters, updated in place
    if (h2d_.active() && q.param.is_cuda()) {
      {
        std::lock_guard lk(m_);
        stats_.h2d_bytes += int64_t(q.param.nbytes());
      }
      h2d_.wait(after);  // kernels queued before the job may still read q.param
      h2d_.run([&] {
        if (staged) {  // already in param's dtype: one straight copy
          q.param.copy_(q.host_grad, /*non_blocking=*/true);
          return;
        }
        // In chunks: the fp32 -> compute-dtype conversion happens on the device through a temporary of one chunk.
        constexpr int64_t kChunk = int64_t(1) << 24;
        const int64_t n = q.param.numel();
        for (int64_t off = 0; off < n; off += kChunk) {
          const int64_t len = std::min(kChunk, n - off);
          q.param.narrow(0, off, len).copy_(q.master.narrow(0, off, len), /*non_blocking=*/true);
        }
      });
      q.h2d_done = h2d_.record();
    } else {
      q.param.copy_(staged ? q.host_grad : q.master);
    }
  }

  void submit(Partition& p, Fn fn, Landed landed = {}) {
    std::unique_lock lk(m_);
    rethrow(lk);
    const std::uint64_t previous = std::exchange(p.last_job, ++issued_);
    if (!threaded_) {
      lk.unlock();
      fn(p);
      lk.lock();
      done_ = issued_;
      p.done_job = p.last_job;
      return;
    }
    queue_.push_back({&p, std::move(fn), p.last_job, previous, std::move(landed)});
    lk.unlock();
    cv_.notify_one();
  }

  void loop() {
    set_device(device_);
    std::unique_lock lk(m_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      const auto next = pick();
      Job j = std::move(*next);
      queue_.erase(next);
      lk.unlock();
      std::exception_ptr err;
      try {
        j.fn(*j.p);
      } catch (...) {
        err = std::current_exception();
      }
      lk.lock();
      if (err && !error_) error_ = err;
      j.p->done_job = j.id;
      ++done_;
      done_cv_.notify_all();
    }
  }

  // The next job (the header's rule), queue_ in submission order (a few hundred jobs a step: a scan is enough).
  // Only a partition's next job may run: the one whose predecessor has finished. Inputs land in submission order,
  // so after the first one still in flight no later one is asked.
  std::vector<Job>::iterator pick() {
    auto best = queue_.end();
    bool in_flight = false;
    for (auto it = queue_.begin(); it != queue_.end(); ++it) {
      if (it->previous > it->p->done_job) continue;  // its partition's earlier job is still queued
      bool landed = true;
      if (it->landed) landed = !in_flight && it->landed();
      in_flight = in_flight || !landed;
      if (landed && (best == queue_.end() || it->p->priority < best->p->priority)) best = it;
    }
    return best != queue_.end() ? best : queue_.begin();
  }

  void rethrow(std::unique_lock<std::mutex>&) {
    if (error_) std::rethrow_exception(error_);
  }

  torch::Device device_;
  bool threaded_;
  SideStream d2h_, h2d_;
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  std::vector<Job> queue_;
  std::uint64_t issued_ = 0, done_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  OffloadStats stats_;
  std::thread worker_;
};

}  // namespace squeeze::engine
