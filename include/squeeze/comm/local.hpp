#pragma once
// LocalComm: N ranks as threads of one process, over host memory (and device memory of one GPU, staged
// through the host, when compiled with CUDA). Same semantics as NcclComm; used by every CPU test.
//
// Determinism: a reduction reads the ranks' buffers in rank order 0..N-1 and accumulates in float
// (double for f64, int64 for integers), rounding once to the element type. So sum/avg of float is
// ((x0 + x1) + x2) + ..., the same bits on every run and on every rank; half/bf16 are rounded once
// (NCCL's ring rounds after each hop, so NCCL and LocalComm agree only within a rounding per rank).
// avg divides the float sum by N (integers: truncating division).
//
// Failure: every collective waits at most `timeout` for the other ranks; a rank that times out marks
// the group aborted and every rank's next (or current) collective throws squeeze::Error, like
// NcclComm's watchdog. Ranks that call different collectives (op, dtype or count differ) all throw.
// World size 1 is a fast path: nothing when send == recv (memory untouched), else one copy.
// Device memory is recognised only when this header is compiled by nvcc or with SQUEEZE_WITH_CUDA_RUNTIME=1
// (device_buffers() says which); otherwise pass host buffers only.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "squeeze/comm/communicator.hpp"

#if defined(__CUDACC__) || defined(SQUEEZE_WITH_CUDA_RUNTIME)
#include <cuda_runtime_api.h>
#define SQUEEZE_LOCAL_COMM_CUDA 1
#endif

namespace squeeze::comm {

namespace detail {

// Reduce `n_inputs` buffers (each `count` elements of t) in input order into out.
inline void reduce_host(const void* const* inputs, int n_inputs, std::size_t offset, std::size_t count, DType t, ReduceOp op, void* out) {
  auto run = [&]<class T, class Acc>(T*, Acc*, auto load, auto store) {
    T* o = static_cast<T*>(out);
    for (std::size_t i = 0; i < count; ++i) {
      Acc acc = load(static_cast<const T*>(inputs[0])[offset + i]);
      for (int r = 1; r < n_inputs; ++r) {
        const Acc x = load(static_cast<const T*>(inputs[r])[offset + i]);
        if (op == ReduceOp::max)
          acc = (x > acc || x != x) ? x : acc;  // NaN propagates
        else
          acc = acc + x;
      }
      if (op == ReduceOp::avg) acc = acc / Acc(n_inputs);
      o[i] = store(acc);
    }
  };
  auto id = [](auto x) { return x; };
  switch (t) {
    case DType::f32:
      run((float*)nullptr, (float*)nullptr, id, id);
      break;
    case DType::f64:
      run((double*)nullptr, (double*)nullptr, id, id);
      break;
    case DType::f16:
      run((half*)nullptr, (float*)nullptr, [](half x) { return to_float(x); }, [](float x) { return from_float<half>(x); });
      break;
    case DType::bf16:
      run((bf16*)nullptr, (float*)nullptr, [](bf16 x) { return to_float(x); }, [](float x) { return from_float<bf16>(x); });
      break;
    case DType::i32:
      run((std::int32_t*)nullptr, (std::int64_t*)nullptr, [](std::int32_t x) { return std::int64_t(x); },
          [](std::int64_t x) { return std::int32_t(x); });
      break;
    case DType::i64:
      run((std::int64_t*)nullptr, (std::int64_t*)nullptr, id, id);
      break;
    case DType::u8:
      run((std::uint8_t*)nullptr, (std::int64_t*)nullptr, [](std::uint8_t x) { return std::int64_t(x); },
          [](std::int64_t x) { return std::uint8_t(x); });
      break;
  }
}

#if SQUEEZE_LOCAL_COMM_CUDA
inline bool is_device_pointer(const void* p) {
  if (!p) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // unregistered host memory on old runtimes: clear the sticky error
    return false;
  }
  return a.type == cudaMemoryTypeDevice;
}
#endif

}  // namespace detail

// State shared by the ranks of one local group.
class LocalGroup {
 public:
  explicit LocalGroup(int n, std::chrono::milliseconds timeout) : n_(n), timeout_(timeout), posts_(std::size_t(n)) {
    check(n >= 1, "LocalGroup: world size must be >= 1");
  }
  int size() const { return n_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  struct Post {
    const void* send = nullptr;  // host view of this rank's input
    std::size_t count = 0;
    DType dtype = DType::f32;
    int kind = 0;  // which collective
    ReduceOp op = ReduceOp::sum;
    int root = 0;
  };

  // Every rank arrives before any leaves; throws on timeout or after another rank aborted.
  void arrive_and_wait(int rank, std::string_view what) {
    std::unique_lock lk(m_);
    throw_if_aborted(rank, what);
    const std::uint64_t gen = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lk, timeout_, [&] { return generation_ != gen || aborted_; })) {
      aborted_ = true;
      reason_ = "LocalComm: rank " + std::to_string(rank) + " waited " + std::to_string(timeout_.count()) + " ms in " + std::string(what) +
                " for the other ranks (a rank failed or called a different collective)";
      cv_.notify_all();
    }
    throw_if_aborted(rank, what);
  }
  void abort(std::string reason) {
    std::lock_guard lk(m_);
    if (!aborted_) reason_ = std::move(reason);
    aborted_ = true;
    cv_.notify_all();
  }
  bool aborted() const {
    std::lock_guard lk(m_);
    return aborted_;
  }
  Post& post(int rank) { return posts_[std::size_t(rank)]; }

 private:
  void throw_if_aborted(int rank, std::string_view what) const {
    if (aborted_) throw Error("LocalComm rank " + std::to_string(rank) + " in " + std::string(what) + ": group aborted: " + reason_);
  }
  int n_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string reason_;
  std::vector<Post> posts_;
};

class LocalComm final : public Communicator {
 public:
  LocalComm(std::shared_ptr<LocalGroup> group, int rank) : group_(std::move(group)), rank_(rank) {
    check(rank_ >= 0 && rank_ < group_->size(), "LocalComm: rank out of range");
  }

  // One communicator per rank of a fresh group; hand comms[r] to the thread that plays rank r.
  static std::vector<std::shared_ptr<LocalComm>> create(int world, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    auto g = std::make_shared<LocalGroup>(world, timeout);
    std::vector<std::shared_ptr<LocalComm>> out;
    for (int r = 0; r < world; ++r) out.push_back(std::make_shared<LocalComm>(g, r));
    return out;
  }
  static std::shared_ptr<LocalComm> single() { return create(1).front(); }

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::string_view backend() const override { return "local"; }
  LocalGroup& group() { return *group_; }
  using Communicator::all_gather, Communicator::reduce_scatter, Communicator::all_reduce, Communicator::broadcast;

  void all_gather(const void* send, void* recv, std::size_t count, DType t, Stream s = nullptr) override {
    const std::size_t b = count * dtype_size(t);
    run(kAllGather, send, b, recv, b * std::size_t(size()), count, t, ReduceOp::sum, 0, s, [&](std::byte* out) {
      for (int r = 0; r < size(); ++r) std::memcpy(out + std::size_t(r) * b, group_->post(r).send, b);
    });
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, Stream s = nullptr) override {
    const std::size_t b = count * dtype_size(t);
    run(kReduceScatter, send, b * std::size_t(size()), recv, b, count, t, op, 0, s,
        [&](std::byte* out) { reduce_posts(std::size_t(rank_) * count, count, t, op, out); });
  }
  void all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, Stream s = nullptr) override {
    const std::size_t b = count * dtype_size(t);
    run(kAllReduce, send, b, recv, b, count, t, op, 0, s, [&](std::byte* out) { reduce_posts(0, count, t, op, out); });
  }
  void broadcast(const void* send, void* recv, std::size_t count, DType t, int root, Stream s = nullptr) override {
    check(root >= 0 && root < size(), "LocalComm::broadcast: root " + std::to_string(root) + " is not a rank");
    const std::size_t b = count * dtype_size(t);
    run(kBroadcast, rank_ == root ? send : nullptr, rank_ == root ? b : 0, recv, b, count, t, ReduceOp::sum, root, s,
        [&](std::byte* out) { std::memcpy(out, group_->post(root).send, b); });
  }
#if SQUEEZE_LOCAL_COMM_CUDA
  bool device_buffers() const override { return true; }
#endif
  void barrier() override {
    if (size() == 1) return;
    group_->arrive_and_wait(rank_, "barrier");
  }
  void synchronize(Stream = nullptr) override {
    if (group_->aborted()) group_->arrive_and_wait(rank_, "synchronize");  // throws with the reason
  }

 private:
  enum Kind { kAllGather = 1, kReduceScatter, kAllReduce, kBroadcast };
  static constexpr std::string_view kind_name(int k) {
    return k == kAllGather ? "all_gather" : k == kReduceScatter ? "reduce_scatter" : k == kAllReduce ? "all_reduce" : "broadcast";
  }

  void reduce_posts(std::size_t offset, std::size_t count, DType t, ReduceOp op, std::byte* out) {
    std::vector<const void*> in(static_cast<std::size_t>(size()));
    for (int r = 0; r < size(); ++r) in[std::size_t(r)] = group_->post(r).send;
    detail::reduce_host(in.data(), size(), offset, count, t, op, out);
  }

  // Post this rank's input, wait for all, compute this rank's output privately, wait again (nobody
  // still reads an input that an in-place output would overwrite), then write the output.
  template <class Compute>
  void run(int kind, const void* send, std::size_t send_bytes, void* recv, std::size_t recv_bytes, std::size_t count, DType t, ReduceOp op,
           int root, Stream s, Compute&& compute) {
    check(count == 0 || recv != nullptr, std::string("LocalComm::") + std::string(kind_name(kind)) + ": recv is null");
    check(send_bytes == 0 || send != nullptr, std::string("LocalComm::") + std::string(kind_name(kind)) + ": send is null");
    const auto name = kind_name(kind);
    if (size() == 1 && (send == recv || recv_bytes == 0)) return;  // world 1 in place: nothing to do, no memory touched
#if SQUEEZE_LOCAL_COMM_CUDA
    const bool dev_in = detail::is_device_pointer(send), dev_out = detail::is_device_pointer(recv);
    std::vector<std::byte> host_in;
    if (dev_in && send_bytes) {
      host_in.resize(send_bytes);
      SQUEEZE_CUDA_CHECK(cudaMemcpyAsync(host_in.data(), send, send_bytes, cudaMemcpyDeviceToHost, cudaStream_t(s)));
      SQUEEZE_CUDA_CHECK(cudaStreamSynchronize(cudaStream_t(s)));
      send = host_in.data();
    }
#else
    (void)s;
    constexpr bool dev_out = false;
#endif
    std::vector<std::byte> out(recv_bytes);
    if (size() == 1) {
      // Fast path: the result is the input (avg over one rank is the identity too).
      if (send_bytes) std::memcpy(out.data(), send, recv_bytes);
    } else {
      auto& p = group_->post(rank_);
      p = {send, count, t, kind, op, root};
      group_->arrive_and_wait(rank_, name);
      // Every rank compares every rank's call with rank 0's, so a mismatch throws on all ranks alike.
      const auto& p0 = group_->post(0);
      for (int q = 1; q < size(); ++q) {
        const auto& pq = group_->post(q);
        if (pq.count != p0.count || pq.dtype != p0.dtype || pq.kind != p0.kind || pq.op != p0.op || pq.root != p0.root)
          throw Error("LocalComm rank " + std::to_string(rank_) + ": ranks disagree on the collective: rank 0 called " +
                      std::string(kind_name(p0.kind)) + "(count " + std::to_string(p0.count) + ", " + std::string(dtype_name(p0.dtype)) +
                      ") and rank " + std::to_string(q) + " " + std::string(kind_name(pq.kind)) + "(count " + std::to_string(pq.count) +
                      ", " + std::string(dtype_name(pq.dtype)) + ")");
      }
      compute(out.data());
      group_->arrive_and_wait(rank_, name);
    }
#if SQUEEZE_LOCAL_COMM_CUDA
    if (dev_out) {
      SQUEEZE_CUDA_CHECK(cudaMemcpyAsync(recv, out.data(), recv_bytes, cudaMemcpyHostToDevice, cudaStream_t(s)));
      SQUEEZE_CUDA_CHECK(cudaStreamSynchronize(cudaStream_t(s)));
      return;
    }
#endif
    if (!dev_out && recv_bytes) std::memcpy(recv, out.data(), recv_bytes);
  }

  std::shared_ptr<LocalGroup> group_;
  int rank_;
};

// Runs fn(comm) on `world` threads, one per rank, and rethrows the first exception (after every
// thread ended; a rank that throws aborts the group so the others do not wait for it).
inline void run_ranks(int world, const std::function<void(std::shared_ptr<LocalComm>)>& fn,
                      std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  auto comms = LocalComm::create(world, timeout);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(comms[std::size_t(r)]);
      } catch (const std::exception& e) {
        errors[std::size_t(r)] = std::current_exception();
        comms[std::size_t(r)]->group().abort("rank " + std::to_string(r) + " threw: " + e.what());
      } catch (...) {
        errors[std::size_t(r)] = std::current_exception();
        comms[std::size_t(r)]->group().abort("rank " + std::to_string(r) + " threw");
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace squeeze::comm
