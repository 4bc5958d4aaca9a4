#pragma once
// NcclComm: one process per GPU, NCCL collectives on device buffers, bootstrapped from the torchrun
// environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) through our TcpStore, so
// `torchrun --nproc_per_node=8 ./train` works, across nodes too; on one machine without Python,
// `tools/squeeze-launch --nproc 8 -- ./train` sets the same variables.
//
// Hangs become errors:
//  - the communicator is created non-blocking (ncclConfig_t::blocking = 0) and initialisation is
//    polled with a deadline;
//  - every collective records a CUDA event; a watchdog thread polls the oldest pending events and
//    ncclCommGetAsyncError. A collective not finished within `timeout`, or an asynchronous NCCL error,
//    makes the watchdog call ncclCommAbort (which unblocks the GPU work) and mark the communicator
//    failed; the next call on it, or synchronize(), throws squeeze::Error. Each rank runs its own
//    watchdog, so a collective that some rank never joins fails on every rank that did.
//
// Compiled only where CUDA and NCCL are available: define SQUEEZE_WITH_NCCL=1 and link NCCL::nccl and
// CUDA::cudart (nvcc TUs get the CUDA runtime automatically).
#if !(defined(SQUEEZE_WITH_NCCL) && SQUEEZE_WITH_NCCL && __has_include(<nccl.h>))
#error "squeeze/comm/nccl.hpp needs NCCL: define SQUEEZE_WITH_NCCL=1 and link NCCL::nccl and CUDA::cudart"
#endif

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>

#include "squeeze/comm/communicator.hpp"
#include "squeeze/comm/env.hpp"
#include "squeeze/comm/store.hpp"

namespace squeeze::comm {

struct NcclOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};      // per collective (watchdog)
  std::chrono::milliseconds init_timeout{std::chrono::minutes(5)};  // store rendezvous + comm init
  int device = -1;                                                  // -1: LOCAL_RANK (or 0)
};

namespace detail {
inline ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::f16:
      return ncclFloat16;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f64:
      return ncclFloat64;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
  }
  throw Error("NcclComm: unsupported dtype");
}
inline ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclAvg;
    case ReduceOp::max:
      return ncclMax;
  }
  throw Error("NcclComm: unsupported reduce op");
}
}  // namespace detail

class NcclComm final : public Communicator {
 public:
  // Joins the group described by the environment. Rank 0 creates the NCCL unique id and publishes it
  // in the TcpStore it hosts at MASTER_ADDR:MASTER_PORT; the others read it.
  static std::shared_ptr<NcclComm> from_env(NcclOptions opt = {}) {
    const DistEnv env = DistEnv::from_environment();
    if (opt.device < 0) opt.device = env.local_rank;
    SQUEEZE_CUDA_CHECK(cudaSetDevice(opt.device));
    TcpStore store(env.master_addr, env.master_port, env.rank == 0, opt.init_timeout);
    ncclUniqueId id{};
    const std::string key = "squeeze/nccl/unique_id";
    if (env.rank == 0) {
      SQUEEZE_NCCL_CHECK(ncclGetUniqueId(&id));
      store.set(key, std::string_view(reinterpret_cast<const char*>(&id), sizeof id));
    } else {
      const std::string v = store.get(key);
      check(v.size() == sizeof id, "NcclComm: the unique id in the store has the wrong size");
      std::memcpy(&id, v.data(), sizeof id);
    }
    auto comm = std::make_shared<NcclComm>(env.rank, env.world, id, opt);
    // Rank 0 hosts the store: keep it alive until everyone has read the id and initialised.
    store.barrier("nccl_init", env.world);
    return comm;
  }

  NcclComm(int rank, int world, const ncclUniqueId& id, NcclOptions opt) : rank_(rank), world_(world), opt_(opt) {
    if (opt_.device < 0) opt_.device = 0;
    SQUEEZE_CUDA_CHECK(cudaSetDevice(opt_.device));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    SQUEEZE_NCCL_CHECK(ncclCommInitRankConfig(&comm_, world, id, rank, &config));
    wait_ready("ncclCommInitRankConfig", opt_.init_timeout);
    SQUEEZE_CUDA_CHECK(cudaMalloc(&scratch_, sizeof(float)));
    watchdog_ = std::thread([this] { watch(); });
  }
  // Never hangs and never throws: collectives still pending get until the watchdog's timeout to finish (the
  // watchdog keeps running meanwhile and aborts them when it passes); then a healthy communicator is
  // finalized and destroyed (a finalize that does not complete within the timeout is aborted), a failed one
  // was aborted already. The scratch buffer is freed last: cudaFree waits for the whole device, so freeing
  // it while a collective that no peer joins still spins would block forever.
  ~NcclComm() override {
    const auto drain_deadline = std::chrono::steady_clock::now() + opt_.timeout + std::chrono::seconds(1);
    while (!failed_ && watchdog_.joinable() && std::chrono::steady_clock::now() < drain_deadline) {
      {
        std::lock_guard lk(m_);
        if (pending_.empty()) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    stop_ = true;
    if (watchdog_.joinable()) watchdog_.join();
    if (comm_) {
      std::lock_guard lk(nccl_m_);
      if (!failed_) {
        // Flush, then free; on any error abort instead (nothing may escape a destructor).
        ncclResult_t st = ncclCommFinalize(comm_);
        const auto deadline = std::chrono::steady_clock::now() + opt_.timeout;
        while (st == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
          ncclCommGetAsyncError(comm_, &st);
        }
        if (st == ncclSuccess)
          ncclCommDestroy(comm_);
        else if (!aborted_.exchange(true))
          ncclCommAbort(comm_);
      } else if (!aborted_.exchange(true)) {
        ncclCommAbort(comm_);
      }
    }
    {
      std::lock_guard lk(m_);
      for (auto& p : pending_) cudaEventDestroy(p.event);
      pending_.clear();
    }
    if (scratch_) cudaFree(scratch_);
  }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return world_; }
  std::string_view backend() const override { return "nccl"; }
  int device() const { return opt_.device; }
  bool host_buffers() const override { return false; }
  bool device_buffers() const override { return true; }
  using Communicator::all_gather, Communicator::reduce_scatter, Communicator::all_reduce, Communicator::broadcast;

  void all_gather(const void* send, void* recv, std::size_t count, DType t, Stream s = nullptr) override {
    enqueue("all_gather", s, [&] { return ncclAllGather(send, recv, count, detail::nccl_type(t), comm_, cudaStream_t(s)); });
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, Stream s = nullptr) override {
    enqueue("reduce_scatter", s,
            [&] { return ncclReduceScatter(send, recv, count, detail::nccl_type(t), detail::nccl_op(op), comm_, cudaStream_t(s)); });
  }
  void all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, Stream s = nullptr) override {
    enqueue("all_reduce", s,
            [&] { return ncclAllReduce(send, recv, count, detail::nccl_type(t), detail::nccl_op(op), comm_, cudaStream_t(s)); });
  }
  void broadcast(const void* send, void* recv, std::size_t count, DType t, int root, Stream s = nullptr) override {
    check(root >= 0 && root < world_, "NcclComm::broadcast: root " + std::to_string(root) + " is not a rank");
    enqueue("broadcast", s, [&] { return ncclBroadcast(send, recv, count, detail::nccl_type(t), root, comm_, cudaStream_t(s)); });
  }
  void barrier() override {
    all_reduce(scratch_, scratch_, 1, DType::f32, ReduceOp::sum, nullptr);
    synchronize(nullptr);
  }
  // Polls (never blocks in CUDA) so the watchdog's abort surfaces here as an exception.
  void synchronize(Stream s = nullptr) override {
    const auto deadline = std::chrono::steady_clock::now() + opt_.timeout + std::chrono::seconds(5);
    for (;;) {
      throw_if_failed("synchronize");
      const cudaError_t st = cudaStreamQuery(cudaStream_t(s));
      if (st == cudaSuccess) break;
      if (st != cudaErrorNotReady) SQUEEZE_CUDA_CHECK(st);
      if (std::chrono::steady_clock::now() > deadline) fail("synchronize: the stream did not drain within the timeout");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    throw_if_failed("synchronize");
  }

 private:
  struct Pending {
    cudaEvent_t event;
    std::chrono::steady_clock::time_point start;
    const char* what;
  };

  template <class Call>
  void enqueue(const char* what, Stream s, Call&& call) {
    throw_if_failed(what);
    SQUEEZE_CUDA_CHECK(cudaSetDevice(opt_.device));
    ncclResult_t r;
    {
      std::lock_guard lk(nccl_m_);  // the watchdog may abort (free) comm_ at any time: never call into a freed one
      if (aborted_) {
        throw_if_failed(what);
        throw Error(std::string("NcclComm::") + what + ": the communicator was aborted");
      }
      r = call();
    }
    if (r != ncclSuccess && r != ncclInProgress) fail(std::string(what) + " returned " + ncclGetErrorString(r));
    if (r == ncclInProgress) wait_ready(what, opt_.timeout);  // non-blocking comm: the enqueue itself may pend
    cudaEvent_t ev;
    SQUEEZE_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    SQUEEZE_CUDA_CHECK(cudaEventRecord(ev, cudaStream_t(s)));
    std::lock_guard lk(m_);
    pending_.push_back({ev, std::chrono::steady_clock::now(), what});
  }

  // Polls ncclCommGetAsyncError until the communicator is no longer in progress.
  void wait_ready(const char* what, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    ncclResult_t st = ncclInProgress;
    for (;;) {
      {
        std::lock_guard lk(nccl_m_);
        if (aborted_) break;
        SQUEEZE_NCCL_CHECK(ncclCommGetAsyncError(comm_, &st));
      }
      if (st == ncclSuccess) return;
      if (st != ncclInProgress) fail(std::string(what) + ": " + ncclGetErrorString(st));
      if (std::chrono::steady_clock::now() > deadline)
        fail(std::string(what) + " did not complete within " + std::to_string(timeout.count()) + " ms");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    throw_if_failed(what);  // aborted by the watchdog meanwhile
    fail(std::string(what) + ": the communicator was aborted");
  }

  [[noreturn]] void fail(const std::string& why) {
    mark_failed(why);
    throw_if_failed("");
    throw Error(why);  // unreachable
  }
  // Records the first failure, then aborts the communicator once (ncclCommAbort also stops its kernels, so
  // a stream waiting on a collective that a peer never joins drains). The abort holds nccl_m_: no other
  // thread is inside an NCCL call on comm_ while it is freed, and none enters one afterwards.
  void mark_failed(const std::string& why) {
    {
      std::lock_guard lk(m_);
      if (failed_) return;
      reason_ = "NcclComm rank " + std::to_string(rank_) + ": " + why + "; the communicator was aborted";
      failed_ = true;
    }
    std::lock_guard lk(nccl_m_);
    if (!aborted_.exchange(true)) ncclCommAbort(comm_);
  }
  void throw_if_failed(const char* what) {
    if (failed_) {
      std::lock_guard lk(m_);
      throw Error(reason_ + (what && *what ? std::string(" (seen in ") + what + ")" : std::string()));
    }
  }

  void watch() {
    cudaSetDevice(opt_.device);
    while (!stop_ && !failed_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      ncclResult_t st = ncclSuccess, got = ncclSuccess;
      {
        std::lock_guard lk(nccl_m_);
        if (aborted_) break;  // another thread failed the communicator (and freed comm_)
        got = ncclCommGetAsyncError(comm_, &st);
      }
      if (got == ncclSuccess && st != ncclSuccess && st != ncclInProgress) {
        mark_failed(std::string("asynchronous NCCL error: ") + ncclGetErrorString(st));
        break;
      }
      std::unique_lock lk(m_);
      while (!pending_.empty()) {
        auto& p = pending_.front();
        const cudaError_t q = cudaEventQuery(p.event);
        if (q == cudaSuccess) {
          cudaEventDestroy(p.event);
          pending_.pop_front();
          continue;
        }
        if (q != cudaErrorNotReady || std::chrono::steady_clock::now() - p.start > opt_.timeout) {
          const std::string why =
              std::string(p.what) + (q != cudaErrorNotReady ? std::string(" failed: ") + cudaGetErrorString(q)
                                                            : " did not finish within " + std::to_string(opt_.timeout.count()) + " ms");
          lk.unlock();
          mark_failed(why);
          lk.lock();
        }
        break;
      }
    }
  }

  int rank_, world_;
  NcclOptions opt_;
  ncclComm_t comm_ = nullptr;
  void* scratch_ = nullptr;
  std::mutex m_;       // pending_, reason_
  std::mutex nccl_m_;  // every NCCL call on comm_ after construction (see mark_failed)
  std::deque<Pending> pending_;
  std::atomic<bool> stop_{false}, failed_{false}, aborted_{false};
  std::string reason_;
  std::thread watchdog_;
};

}  // namespace squeeze::comm
