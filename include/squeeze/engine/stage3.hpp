#pragma once
// ZeRO stage 3's gather runtime: layers whose parameters live as 1/N shards are all-gathered just before they run
// in forward and again for backward, then freed (the layers: nn/layers.hpp).
//
//   Stage3Group     one gather unit: a layer, or a block of layers gathered together (TrainerOptions::gather_unit);
//                   its members' parameters in one flat layout, its shard [S] and its gradient shard.
//   Shardable       what a layer implements for a stage-3 trainer to shard it (nn::Linear, nn::Embedding).
//   Stage3Runtime   the gathers: all_gather into a transient [padded] buffer, release after use, and prefetch of
//       the next units in execution order (the order the first pass of each kind used them, see Prefetch).
//       Gradients: each member adds its parameters' gradients into the unit's full gradient buffer; when the
//       unit's gradient is complete it is reduce-scattered (average) once, added into the gradient shard and freed.
//
// A block as one unit (FSDP's wrapping of a transformer block) makes one collective of a block's 7 linears: one
// all-gather in forward, one in backward and one reduce-scatter, and larger messages, at the cost of holding a
// block's parameters (and in backward its gradients) gathered instead of one layer's.
//
// Lifetimes. Forward: a unit is freed once each of its members has run (a member that did not run keeps it until
// the pass ends), unless it keeps its parameters for backward (keep_last_gathered: the last units of the forward,
// whose backward comes first). Backward: gathered by the first member that needs it (a checkpointed block's
// recompute, or a backward), held until the unit's gradient is reduced.
//
// Streamed units (Offload<Host, Streamed>, Stage3Group::on_host): the shard lives in pinned host memory; a gather copies
// it to the device on a copy stream (then all-gathers it over ranks), and each pass's reduced gradient goes to the
// trainer's grad_handover (which streams it to the host) instead of a device gradient shard. Prefetch then hides the
// copies behind the compute exactly as it hides the collectives.
//
// One rank with blocking collectives (LocalComm, the CPU): the shard is the whole unit, so it is used in place: no
// gathered copy, and members add their gradients straight into the gradient shard when it has the compute dtype.
// (NCCL at world size 1 still takes the side-stream path, which is how one GPU tests it.)
//
// Threads as ranks: CPU backward runs on the calling thread, so LocalComm's thread-ranks work. libtorch
// runs all CUDA backward work of a process on one worker thread per device, so thread-ranks sharing one
// GPU would block each other inside backward: on GPUs use one process per device (NcclComm), or
// LocalComm at world size 1.
//
// Prefetch: prefetch_depth units ahead, issued right after the current unit's gather, in the order the first pass of
// each kind used the units (backward's is not forward's reversed: an embedding's backward needs no weights, and a
// checkpointed segment recomputes its blocks in forward order). A unit whose Offload<Host> update is still on the
// host is not prefetched: the host would wait for it before the current unit's compute is even queued. On CUDA with a device communicator
// (NcclComm) the gathers and the gradient reduce-scatters run on a side stream (engine/streams.hpp): the side stream waits for the compute
// issued so far, the collective is enqueued without a host wait, and the compute stream waits for the gathered buffer only where a member
// uses it -- so the next unit's gather overlaps this unit's compute. Elsewhere (CPU, LocalComm) the same operations run in the same order,
// blocking.
//
// Readiness: a unit's gradient is final for the micro-step when its members' backwards have added as many
// gradients as its members ran with grad enabled (uses counted in the members' forward: a checkpointed segment's
// no-grad first pass does not count, its recompute does). Then it is reduced and grad_done() runs (the trainer's
// hook: Offload<Host> streams the shard to the host there). A unit whose count is not reached when backward ends
// (a member whose output got no gradient) is reduced then, in unit order, by finish_backward(). A unit should lie
// within one checkpointed segment: one that spans two is reduced once per segment (the same sum, more traffic).
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "squeeze/comm/communicator.hpp"
#include "squeeze/engine/collectives.hpp"
#include "squeeze/engine/flat_params.hpp"
#include "squeeze/engine/streams.hpp"
#include "squeeze/error.hpp"

namespace squeeze::engine {

class Stage3Runtime;

// One gather unit's state (owned by the trainer, pointed to by its member layers).
struct Stage3Group {
  std::string name;          // the unit: a layer's module name, or its block's
  FlatParams layout;         // the members' parameters, member by member; no flat buffer of its own
  torch::Tensor shard;       // [S] compute dtype; leaf that requires grad (see nn/layers.hpp)
  torch::Tensor grad_shard;  // [S] accumulation dtype: reduced gradients of this step's micro-batches
  torch::Tensor gathered;    // [padded] while gathered, else undefined
  torch::Tensor full_grad;   // [padded] backward: the members' gradients added so far, until reduced
  Event gathered_ready;      // side-stream gather still in flight (CUDA)
  Stage3Runtime* runtime = nullptr;
  int members = 1;                      // layers in the unit
  int uses = 0, added = 0;              // this micro-step: members' grad-enabled forwards, members' gradients added
  int released = 0;                     // forward: members done with the gathered buffer since it was gathered
  bool keep_for_backward = false;       // not freed after forward (TrainerOptions::keep_last_gathered)
  std::function<void()> before_gather;  // trainer: wait until this shard's update has landed
  std::function<bool()> update_landed;  // trainer: whether it has, without waiting (unset: always)
  std::function<void()> grad_done;      // trainer: the gradient shard is final for this micro-step
  // Streamed (Offload<Host, Streamed>): shard is pinned host memory, grad_shard undefined; each reduction hands the
  // pass's reduced gradient [S] (a transient device tensor) over with whether the unit's gradient is complete.
  bool on_host = false;
  std::function<void(const torch::Tensor&, bool)> grad_handover;
  bool finished() const { return uses > 0 && added == uses; }
};

// What streaming host units cost since the last reset. The GPU times come from timed events, summed once both ends
// have completed (a step's figures may arrive with the next step's).
struct StreamStats {
  int64_t h2d_bytes = 0;  // parameters copied to the device by gathers of host units
  double h2d_copy_s = 0;  // the copy stream's time on those copies
  double wait_s = 0;      // the compute stream's time blocked waiting for them
  int64_t gathers = 0;
};

// A sharded layer's place in its gather unit: the unit and the index of the layer's first layout entry. The typed
// handle a layer's autograd Functions take as an argument and keep for backward (save / saved), in one place.
struct UnitMember {
  Stage3Group* group = nullptr;
  std::size_t first = 0;
  const FlatEntry& entry(std::size_t i) const { return group->layout.entries()[first + i]; }
  inline void save(torch::autograd::AutogradContext* ctx) const;
  static inline UnitMember saved(torch::autograd::AutogradContext* ctx);
};
namespace detail {
struct SavedUnitMember : torch::CustomClassHolder {  // what saved_data holds: an IValue capsule
  explicit SavedUnitMember(UnitMember m) : member(m) {}
  UnitMember member;
};
}  // namespace detail
void UnitMember::save(torch::autograd::AutogradContext* ctx) const {
  ctx->saved_data["unit_member"] = c10::IValue::make_capsule(c10::make_intrusive<detail::SavedUnitMember>(*this));
}
UnitMember UnitMember::saved(torch::autograd::AutogradContext* ctx) {
  return static_cast<const detail::SavedUnitMember*>(ctx->saved_data.at("unit_member").toCapsule().get())->member;
}

// Interface of modules that a stage-3 trainer can shard.
class Shardable {
 public:
  virtual ~Shardable() = default;
  // (name, parameter) in flat order.
  virtual std::vector<std::pair<std::string, torch::Tensor>> shardable_parameters() = 0;
  // The unit the layer's parameters now live in, and the index of its first parameter among the unit's layout
  // entries (null: a plain layer again).
  virtual void attach(Stage3Group* group, std::size_t first_entry) = 0;
  virtual Stage3Group* group() const = 0;
};

// A module whose sharded layers a stage-3 trainer gathers together, one collective for all of them (a transformer
// block: nn::Llama's blocks are). TrainerOptions::gather_unit chooses units without changing the module's type.
class GatherUnit {
 public:
  virtual ~GatherUnit() = default;
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
  // asynchronous_collectives(device, comm). prefetch_depth: units gathered ahead (0: none). keep_last_gathered:
  // the last units of the forward order stay gathered from their forward to their backward.
  Stage3Runtime(comm::CommPtr comm, int prefetch_depth, int keep_last_gathered, torch::Device device, SideStream& side)
      : comm_(std::move(comm)),
        prefetch_depth_(prefetch_depth),
        keep_last_(keep_last_gathered),
        device_(device),
        side_(side),
        copy_(device) {
    TORCH_CHECK(prefetch_depth >= 0, "Stage3: prefetch_depth must be >= 0, got ", prefetch_depth);
    TORCH_CHECK(keep_last_gathered >= 0, "Stage3: keep_last_gathered must be >= 0, got ", keep_last_gathered);
  }

  void add_group(Stage3Group& g) { groups_.push_back(&g); }

  enum class Phase { forward, backward, idle };
  void set_phase(Phase p) {
    if (p == Phase::forward)
      for (auto* g : groups_) g->uses = g->added = g->released = 0;
    if (phase_ == Phase::backward && p != Phase::backward && !backward_.order.empty()) backward_.final = true;
    phase_ = p;
    if ((p == Phase::backward || p == Phase::idle) && !forward_.order.empty() && !forward_.final) {
      forward_.final = true;
      const auto& o = forward_.order;
      for (std::size_t i = 0; i < o.size(); ++i) o[i]->keep_for_backward = i + std::size_t(keep_last_) >= o.size();
    }
    if (p == Phase::idle) {  // the timed copies and waits of the pass, summed as they complete
      harvest(copies_, stats_.h2d_copy_s);
      harvest(waits_, stats_.wait_s);
    }
    if (p == Phase::idle && side_.active()) {
      // The compute stream waits for the side stream's reductions; a failed or timed-out collective throws here.
      wait_current(device_, side_.record());
      comm_->synchronize(side_.handle());
    }
  }
  Phase phase() const { return phase_; }
  // The forward order recorded on the first pass: whether it is final, its length, and a unit's place in it.
  bool forward_order_final() const { return forward_.final; }
  std::size_t forward_order_size() const { return forward_.order.size(); }
  std::optional<std::size_t> forward_position(const Stage3Group& g) const {
    const auto it = forward_.index.find(&g);
    return it == forward_.index.end() ? std::nullopt : std::optional<std::size_t>(it->second);
  }

  // The unit's full flat parameters [padded] (gathering them unless already gathered), then prefetches the units
  // that come next in this pass.
  torch::Tensor acquire(Stage3Group& g) {
    PassOrder* pass = phase_ == Phase::forward ? &forward_ : phase_ == Phase::backward ? &backward_ : nullptr;
    if (pass && !pass->final && !pass->index.count(&g)) {
      pass->index[&g] = pass->order.size();
      pass->order.push_back(&g);
    }
    if (!g.gathered.defined()) gather(g);
    torch::Tensor full = g.gathered;
    if (!g.gathered_ready.empty()) {  // side-stream gather: the compute stream waits here, not the host
      if (g.on_host) {                // timed: how long the compute stream waits for the copy
        Event before = record_current(device_, true);
        wait_current(device_, g.gathered_ready);
        waits_.push_back({std::move(before), record_current(device_, true)});
      } else {
        wait_current(device_, g.gathered_ready);
      }
      record_use_current(full);
      g.gathered_ready = Event();
    }
    if (pass && pass->final) {
      auto it = pass->index.find(&g);
      if (it != pass->index.end()) {
        for (std::size_t next = it->second + 1; next <= it->second + std::size_t(prefetch_depth_) && next < pass->order.size(); ++next) {
          Stage3Group& n = *pass->order[next];
          // Not a unit whose backward is done (a checkpoint recompute may run ahead of the order), nor one whose
          // offloaded update is still on the host: waiting for it here would hold back this unit's compute too.
          if (!n.gathered.defined() && !(phase_ == Phase::backward && n.finished()) && (!n.update_landed || n.update_landed())) gather(n);
        }
      }
    }
    return full;
  }
  // A member is done with the gathered parameters for now (see Lifetimes in the header).
  void release(Stage3Group& g) {
    if (!g.gathered.defined() || phase_ == Phase::backward) return;  // backward: freed once the gradient is reduced
    if (phase_ == Phase::forward && g.keep_for_backward && forward_.final) return;
    if (++g.released >= g.members) free_gathered(g);
  }
  // Frees whatever a pass left gathered (a prefetch the graph did not use, a unit kept for a backward that did not
  // come).
  void release_all() {
    for (auto* g : groups_) free_gathered(*g);
  }

  // The unit's full gradient buffer [padded] for this micro-step, zeros when the first member asks: each member's
  // backward adds its parameters' gradients into its entries, then calls added().
  torch::Tensor gradient_buffer(Stage3Group& g, const torch::TensorOptions& options) {
    if (g.full_grad.defined()) return g.full_grad;
    if (in_place(g) && g.grad_shard.scalar_type() == options.dtype().toScalarType()) {
      g.full_grad = g.grad_shard;  // one rank: the gradient shard is the unit's whole gradient
    } else {
      g.full_grad = torch::zeros({g.layout.padded()}, options.device(device_).requires_grad(false));
      track(g.full_grad.nbytes());
    }
    return g.full_grad;
  }
  // One member's gradient is in the buffer; once the unit's is complete: reduce-scatter, grad_done(), free.
  void added(Stage3Group& g) {
    ++g.added;
    if (!g.finished()) return;
    reduce(g);
    if (phase_ == Phase::backward) free_gathered(g);
  }
  // After backward: units whose gradients are partly added (a member's output got no gradient) are reduced now,
  // in unit order (the same on every rank).
  void finish_backward() {
    for (auto* g : groups_)
      if (g->full_grad.defined()) reduce(*g);
  }

  comm::Communicator& comm() { return *comm_; }
  int64_t peak_bytes() const { return peak_bytes_; }  // largest sum of live gathered + gradient buffers
  void reset_peak() { peak_bytes_ = live_bytes_; }
  // Streamed units: the counters, with the GPU times of every copy and wait that has completed.
  StreamStats stream_stats() {
    harvest(copies_, stats_.h2d_copy_s);
    harvest(waits_, stats_.wait_s);
    return stats_;
  }
  void reset_stream_stats() {
    stream_stats();
    stats_ = {};
  }

 private:
  // Reduce-scatters the unit's full gradient (average over ranks) into its gradient shard and frees it.
  void reduce(Stage3Group& g) {
    torch::Tensor full_grad = std::exchange(g.full_grad, torch::Tensor());
    const bool complete = g.finished();
    if (g.on_host) {
      reduce_host_unit(g, full_grad, complete);
      return;
    }
    if (full_grad.is_same(g.grad_shard)) {  // added in place (one rank)
      if (complete && g.grad_done) g.grad_done();
      return;
    }
    reduce_scatter_add(*comm_, side_, device_, full_grad, g.grad_shard, [&] {
      if (complete && g.grad_done) g.grad_done();  // its transfers queue behind the add
    });
    live_bytes_ -= full_grad.nbytes();
  }
  // A streamed unit's gradient: this rank's part of the average over ranks, handed over on the stream that made it.
  void reduce_host_unit(Stage3Group& g, const torch::Tensor& full_grad, bool complete) {
    const int64_t n = g.layout.shard();
    auto hand_over = [&](const torch::Tensor& mine) {
      if (g.grad_handover) g.grad_handover(mine, complete);
    };
    if (comm_->size() == 1) {
      hand_over(full_grad.narrow(0, 0, n));
    } else if (side_.active()) {
      side_.wait(record_current(device_));
      side_.record_use(full_grad);
      side_.run([&] {
        auto mine = torch::empty({n}, full_grad.options());
        comm_->reduce_scatter(full_grad.data_ptr(), mine.data_ptr(), std::size_t(n), comm_dtype(full_grad.scalar_type()),
                              comm::ReduceOp::avg, side_.handle());
        hand_over(mine);
      });
    } else {
      auto mine = torch::empty({n}, full_grad.options());
      reduce_scatter_avg(*comm_, full_grad, mine);
      hand_over(mine);
    }
    live_bytes_ -= full_grad.nbytes();
  }
  void free_gathered(Stage3Group& g) {
    if (g.gathered.defined()) {
      if (!in_place(g)) live_bytes_ -= g.gathered.nbytes();
      g.gathered = torch::Tensor();
      g.gathered_ready = Event();
    }
    g.released = 0;
  }
  bool in_place(const Stage3Group& g) const { return comm_->size() == 1 && !side_.active() && !g.on_host; }
  void gather(Stage3Group& g) {
    if (g.before_gather) g.before_gather();
    g.released = 0;
    if (g.on_host) {
      gather_host_unit(g);
      return;
    }
    if (in_place(g)) {
      g.gathered = g.shard.detach();  // one rank: the shard is the whole unit
      return;
    }
    if (side_.active()) {
      side_.wait(record_current(device_));  // the shard's latest values are queued on the compute stream
      auto full = side_.run([&] { return torch::empty({g.layout.padded()}, g.shard.options().requires_grad(false)); });
      track(full.nbytes());
      comm_->all_gather(g.shard.data_ptr(), full.data_ptr(), std::size_t(g.layout.shard()), comm_dtype(full.scalar_type()), side_.handle());
      g.gathered = full;
      g.gathered_ready = side_.record();
      return;
    }
    auto full = torch::empty({g.layout.padded()}, g.shard.options().requires_grad(false));
    track(full.nbytes());
    gather_into(*comm_, g.shard.detach(), full);
    g.gathered = full;
  }
  // A streamed unit: its host shard copied to the device (the collectives' side stream when it is active, else the
  // copy stream), then all-gathered over ranks; blocking where there are no streams (the CPU).
  void gather_host_unit(Stage3Group& g) {
    const int64_t n = g.layout.shard();
    const auto dev = g.shard.options().device(device_).requires_grad(false);
    const torch::Tensor host = g.shard.detach();
    SideStream& s = side_.active() ? side_ : copy_;
    stats_.h2d_bytes += int64_t(host.nbytes());
    ++stats_.gathers;
    // The buffer comes from the compute stream's pool (the copy stream first waits for the compute queued so far,
    // which may have used the block): the compute stream reuses it afterwards, and no pool of the copy stream's own
    // grows beside it.
    auto copy_in = [&](const torch::Tensor& full) {
      if (comm_->size() == 1) {
        full.narrow(0, 0, n).copy_(host, /*non_blocking=*/true);
      } else {
        auto mine = torch::empty({n}, dev);
        mine.copy_(host, /*non_blocking=*/true);
        if (s.active())
          comm_->all_gather(mine.data_ptr(), full.data_ptr(), std::size_t(n), comm_dtype(full.scalar_type()), s.handle());
        else
          gather_into(*comm_, mine, full);
      }
    };
    try {
      auto full = torch::empty({g.layout.padded()}, dev);
      if (!s.active()) {
        copy_in(full);
        g.gathered = full;
        track(full.nbytes());
        return;
      }
      s.wait(record_current(device_));
      s.record_use(full);
      Event start = s.record(true);
      s.run([&] { copy_in(full); });
      g.gathered = full;
      track(full.nbytes());
      g.gathered_ready = s.record(true);
      copies_.push_back({std::move(start), g.gathered_ready});
    } catch (const std::exception& e) {
      throw Error("Stage3: copying unit '" + g.name + "' (" + std::to_string(host.nbytes()) + " bytes) from host memory to " +
                  device_.str() + " failed: " + e.what());
    }
  }
  static void harvest(std::vector<std::pair<Event, Event>>& pairs, double& total) {
    auto done = std::partition(pairs.begin(), pairs.end(), [](const auto& p) { return !p.second.query(); });
    for (auto it = done; it != pairs.end(); ++it) total += Event::elapsed_s(it->first, it->second);
    pairs.erase(done, pairs.end());
  }
  void track(int64_t bytes) {
    live_bytes_ += bytes;
    peak_bytes_ = std::max(peak_bytes_, live_bytes_);
  }

  comm::CommPtr comm_;
  int prefetch_depth_, keep_last_;
  torch::Device device_;
  SideStream& side_;  // active only for asynchronous device collectives (see the header comment)
  SideStream copy_;   // streamed units' host-to-device copies where side_ is inert
  Phase phase_ = Phase::idle;
  std::vector<Stage3Group*> groups_;
  // Units in the order the first pass of a kind acquired them (final once that pass ended).
  struct PassOrder {
    std::vector<Stage3Group*> order;
    std::unordered_map<const Stage3Group*, std::size_t> index;
    bool final = false;
  };
  PassOrder forward_, backward_;
  int64_t live_bytes_ = 0, peak_bytes_ = 0;
  StreamStats stats_;
  std::vector<std::pair<Event, Event>> copies_, waits_;  // timed (start, end) of streamed copies and of the waits for them
};

}  // namespace squeeze::engine
