#pragma once
// ZeRO stage 3's gather runtime: layers whose parameters live as 1/N shards are all-gathered just before the
// layer's forward and again before its backward, then freed (the layers: nn/layers.hpp).
//
//   Stage3Group     one sharded layer: its parameters' flat layout, its shard [S] and its gradient shard.
//   Shardable       what a layer implements for a stage-3 trainer to shard it (nn::Linear, nn::Embedding).
//   Stage3Runtime   the gathers: all_gather into a transient [padded] buffer, release after use, and
//       prefetch of the next layer in execution order (forward order recorded on the first pass,
//       backward = its reverse). Gradients: the layer's full gradient is reduce-scattered (average) in
//       its backward and added into the group's gradient shard, then freed.
//
// Threads as ranks: CPU backward runs on the calling thread, so LocalComm's thread-ranks work. libtorch
// runs all CUDA backward work of a process on one worker thread per device, so thread-ranks sharing one
// GPU would block each other inside backward: on GPUs use one process per device (NcclComm), or
// LocalComm at world size 1.
//
// Prefetch: one layer ahead (forward order in forward, its reverse in backward), issued right after the
// current layer's gather. On CUDA with a device communicator (NcclComm) the gathers and the
// gradient reduce-scatters run on a side stream (train/streams.hpp): the side stream waits for the compute
// issued so far, the collective is enqueued without a host wait, and the compute stream waits for the
// gathered buffer only where the layer uses it -- so the next layer's gather overlaps this layer's compute.
// Elsewhere (CPU, LocalComm) the same operations run in the same order, blocking.
//
// Readiness: a layer's gradient is final for the micro-step when it has been reduced as many times as
// the layer ran with grad enabled (uses counted in the module's forward: a checkpointed segment's no-grad
// first pass does not count, its recompute does; a layer used twice reduces twice). Then grad_done() runs
// (the trainer's hook: Offload<Host> streams the shard to the host there).
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "../comm/communicator.hpp"
#include "collectives.hpp"
#include "flat_params.hpp"
#include "streams.hpp"

namespace squeeze::train {

class Stage3Runtime;

// One sharded layer's state (owned by the Stage3Runtime, pointed to by the module).
struct Stage3Group {
  std::string name;
  FlatParams layout;          // entries + sizes; no flat buffer of its own
  torch::Tensor shard;        // [S] compute dtype; leaf that requires grad (see above)
  torch::Tensor grad_shard;   // [S] accumulation dtype: reduced gradients of this step's micro-batches
  torch::Tensor gathered;     // [padded] while gathered (forward/backward of this layer), else undefined
  Event gathered_ready;       // side-stream gather still in flight (CUDA)
  Stage3Runtime* runtime = nullptr;
  int uses = 0, reduced = 0;  // this micro-step: grad-enabled forwards, gradient reductions
  std::function<void()> before_gather;  // trainer: wait until this shard's update has landed
  std::function<void()> grad_done;      // trainer: the gradient shard is final for this micro-step
  bool finished() const { return uses > 0 && reduced == uses; }
};

// Interface of modules that a stage-3 trainer can shard.
class Shardable {
 public:
  virtual ~Shardable() = default;
  // (name, parameter) in flat order.
  virtual std::vector<std::pair<std::string, torch::Tensor>> shardable_parameters() = 0;
  virtual void attach(Stage3Group* group) = 0;
  virtual Stage3Group* group() const = 0;
};

// A layer whose parameters stay whole on every rank under Stage 3 by design (a norm: a few thousand values), so a
// stage-3 trainer accepts it without TrainerOptions::replicate.
class KeptWhole {
 public:
  virtual ~KeptWhole() = default;
};

class Stage3Runtime {
 public:
  // side: the collectives' stream, shared with the trainer's buckets; inert (blocking collectives) unless
  // asynchronous_collectives(device, comm).
  Stage3Runtime(comm::CommPtr comm, bool prefetch, torch::Device device, SideStream& side)
      : comm_(std::move(comm)), prefetch_(prefetch), device_(device), side_(side) {}

  void add_group(Stage3Group& g) { groups_.push_back(&g); }

  enum class Phase { forward, backward, idle };
  void set_phase(Phase p) {
    if (p == Phase::forward)
      for (auto* g : groups_) g->uses = g->reduced = 0;
    phase_ = p;
    if (p == Phase::backward || p == Phase::idle) {
      if (!order_.empty()) order_final_ = true;
    }
    if (p == Phase::idle && side_.active()) {
      // The compute stream waits for the side stream's reductions; a failed or timed-out collective throws here.
      wait_current(device_, side_.record());
      comm_->synchronize(side_.handle());
    }
  }
  Phase phase() const { return phase_; }
  // The forward order recorded on the first pass: whether it is final, its length, and a layer's place in it.
  bool forward_order_final() const { return order_final_; }
  std::size_t forward_order_size() const { return order_.size(); }
  std::optional<std::size_t> forward_position(const Stage3Group& g) const {
    const auto it = index_.find(&g);
    return it == index_.end() ? std::nullopt : std::optional<std::size_t>(it->second);
  }

  // The layer's full flat parameters [padded] (gathering them unless already prefetched), then
  // prefetches the next layer of this pass.
  torch::Tensor acquire(Stage3Group& g) {
    if (phase_ == Phase::forward && !order_final_) {
      index_[&g] = order_.size();
      order_.push_back(&g);
    }
    if (!g.gathered.defined()) gather(g);
    torch::Tensor full = g.gathered;
    if (!g.gathered_ready.empty()) {  // side-stream gather: the compute stream waits here, not the host
      wait_current(device_, g.gathered_ready);
      record_use_current(full);
      g.gathered_ready = Event();
    }
    if (prefetch_ && order_final_) {
      auto it = index_.find(&g);
      if (it != index_.end()) {
        const std::ptrdiff_t i = std::ptrdiff_t(it->second), next = phase_ == Phase::backward ? i - 1 : i + 1;
        if (next >= 0 && next < std::ptrdiff_t(order_.size())) {
          Stage3Group& n = *order_[std::size_t(next)];
          // Not a layer whose backward is done (a checkpoint recompute may run ahead of the order).
          if (!n.gathered.defined() && !(phase_ == Phase::backward && n.finished())) gather(n);
        }
      }
    }
    return full;
  }
  void release(Stage3Group& g) {
    if (g.gathered.defined()) {
      live_bytes_ -= g.gathered.nbytes();
      g.gathered = torch::Tensor();
    }
  }
  // Frees whatever a pass left gathered (a prefetch the graph did not use).
  void release_all() {
    for (auto* g : order_) release(*g);
  }

  // Reduce-scatters a layer's full gradient [padded] (average over ranks) and adds it into its shard;
  // calls g.grad_done() once the layer's gradient for this micro-step is complete.
  void reduce_grad(Stage3Group& g, const torch::Tensor& full_grad) {
    track(full_grad.nbytes());
    if (side_.active()) {
      side_.wait(record_current(device_));
      side_.record_use(full_grad);
      side_.run([&] {
        auto mine = torch::empty({g.layout.shard()}, full_grad.options());
        comm_->reduce_scatter(full_grad.data_ptr(), mine.data_ptr(), std::size_t(mine.numel()),
                              comm_dtype(full_grad.scalar_type()), comm::ReduceOp::avg, side_.handle());
        g.grad_shard.add_(mine);
        if (++g.reduced == g.uses && g.grad_done) g.grad_done();  // its transfers queue behind the add
      });
    } else {
      auto mine = torch::empty({g.layout.shard()}, full_grad.options());
      reduce_scatter_avg(*comm_, full_grad, mine);
      g.grad_shard.add_(mine);
      if (++g.reduced == g.uses && g.grad_done) g.grad_done();
    }
    live_bytes_ -= full_grad.nbytes();
  }

  comm::Communicator& comm() { return *comm_; }
  int64_t peak_bytes() const { return peak_bytes_; }  // largest sum of live gathered + gradient buffers
  void reset_peak() { peak_bytes_ = live_bytes_; }

 private:
  void gather(Stage3Group& g) {
    if (g.before_gather) g.before_gather();
    if (side_.active()) {
      side_.wait(record_current(device_));  // the shard's latest values are queued on the compute stream
      auto full = side_.run([&] { return torch::empty({g.layout.padded()}, g.shard.options().requires_grad(false)); });
      track(full.nbytes());
      comm_->all_gather(g.shard.data_ptr(), full.data_ptr(), std::size_t(g.layout.shard()),
                        comm_dtype(full.scalar_type()), side_.handle());
      g.gathered = full;
      g.gathered_ready = side_.record();
      return;
    }
    auto full = torch::empty({g.layout.padded()}, g.shard.options().requires_grad(false));
    track(full.nbytes());
    gather_into(*comm_, g.shard.detach(), full);
    g.gathered = full;
  }
  void track(int64_t bytes) {
    live_bytes_ += bytes;
    peak_bytes_ = std::max(peak_bytes_, live_bytes_);
  }

  comm::CommPtr comm_;
  bool prefetch_;
  torch::Device device_;
  SideStream& side_;  // active only for asynchronous device collectives (see the header comment)
  Phase phase_ = Phase::idle;
  std::vector<Stage3Group*> groups_;
  std::vector<Stage3Group*> order_;
  std::unordered_map<const Stage3Group*, std::size_t> index_;
  bool order_final_ = false;
  int64_t live_bytes_ = 0, peak_bytes_ = 0;
};

}  // namespace squeeze::train
