#pragma once
// Gradient synchronisation for stage 3 (docs/architecture.md): the adopted layers live in gather units (a block's
// layers in one flat layout and one shard: nn::Llama's blocks, the blocks of an nn::Blocks, or what
// TrainerOptions::gather_unit names; other layers alone). The Stage-3 runtime (engine/stage3.hpp) gathers a unit for
// its forward and again for its backward; each member adds its gradients into the unit's buffer, which is
// reduce-scattered (average) once into the unit's gradient shard. Parameters kept whole (layers below
// persistence_threshold, plain layers listed in replicate) go through BucketedGrads. Where a unit's shard lives
// between uses is the Home part's (train/parts/param_home.hpp: the device, or host memory it streams from).
#include <torch/torch.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "squeeze/nn/layers.hpp"
#include "squeeze/engine/stage3.hpp"
#include "squeeze/train/parts/bucketed_grads.hpp"
#include "squeeze/train/parts/gradient_sync.hpp"
#include "squeeze/train/parts/param_home.hpp"

namespace squeeze::train {

template <StrategyType S, class Home = ParamHomeOf<S>>
class GatherUnits {
  static_assert(S::stage == 3, "GatherUnits synchronises stage 3: write ReplicatedGrads (stages 0-1) or BucketedGrads (stage 2)");
  static_assert(!Home::on_host || S::offload_to_host, "units streamed from host memory are updated there: write Offload<Host, Streamed>");

 public:
  static constexpr bool hands_over_in_backward = true;  // each unit's shard is final when its reduce-scatter is

  template <class State>
  GatherUnits(TrainContext& ctx, State& state, torch::nn::Module& module, const NamedTensors& trainable)
      : ctx_(ctx),
        home_(ctx),
        runtime_(
            std::make_unique<Stage3Runtime>(ctx.comm, ctx.opt.prefetch_depth, ctx.opt.keep_last_gathered, ctx.device, *ctx.collectives)) {
    // Sharded layers by gather unit, units in the order of their first layer, layers in module order.
    const std::vector<std::string> units = gather_unit_names(module);
    std::vector<std::pair<std::string, std::vector<std::pair<std::string, Shardable*>>>> by_unit;
    for (auto& item : module.named_modules()) {
      auto* s = dynamic_cast<Shardable*>(item.value().get());
      if (s == nullptr) continue;
      int64_t n = 0;
      bool frozen = false;
      for (auto& [name, p] : s->shardable_parameters()) p.requires_grad() ? void(n += p.numel()) : void(frozen = true);
      if (n == 0 || n < ctx.opt.persistence_threshold) {  // small: stays whole (replicated), on the device
        torch::NoGradGuard ng;
        for (auto& [name, p] : s->shardable_parameters())
          if (p.device() != ctx.device) p.set_data(p.to(ctx.device));
        continue;
      }
      TORCH_CHECK(!frozen, "Stage3: layer '", item.key(), "' mixes frozen and trainable parameters");
      const std::string unit = unit_of(units, item.key());
      auto it = std::find_if(by_unit.begin(), by_unit.end(), [&](const auto& u) { return u.first == unit; });
      if (it == by_unit.end()) it = by_unit.insert(by_unit.end(), {unit, {}});
      it->second.emplace_back(item.key(), s);
    }
    std::unordered_set<const void*> sharded;  // TensorImpls now owned by units
    for (auto& [unit, layers] : by_unit) add_unit(state, unit, layers, sharded);
    NamedTensors whole;
    for (auto& p : trainable)
      if (!sharded.count(p.second.unsafeGetTensorImpl())) whole.push_back(p);
    buckets_ = std::make_unique<BucketedGrads<S>>(ctx, state, module, std::move(whole));
  }
  GatherUnits(const GatherUnits&) = delete;
  GatherUnits& operator=(const GatherUnits&) = delete;
  // The layers are detached: their emptied weights then fail loudly in forward instead of reading freed shards
  // (Trainer::restore_module first, to keep training or evaluating the module alone).
  ~GatherUnits() {
    for (Shardable* s : attached_) s->attach(nullptr, 0);
  }

  // Whole-kept (bucketed) partitions first, then the units in registration order.
  std::vector<Partition*> partitions() {
    std::vector<Partition*> p = buckets_->partitions();
    for (auto& u : units_) p.push_back(&u.own);
    return p;
  }
  std::vector<PartitionView> views() {
    std::vector<PartitionView> v = buckets_->views();
    for (auto& u : units_)
      v.push_back({u.group->name, &u.group->layout, int64_t(ctx_.rank) * u.group->layout.shard(), false, true, &u.own});
    return v;
  }
  // Offload<Host>: the whole-kept partitions first (the step waits for them), then the units in the forward order the
  // runtime recorded (until it has, in the order the units were registered).
  void rank_partitions() {
    const int64_t first = buckets_->rank_partitions(0);
    const int64_t seen = int64_t(runtime_->forward_order_size());
    for (std::size_t i = 0; i < units_.size(); ++i) {
      const auto pos = runtime_->forward_position(*units_[i].group);
      units_[i].own.priority = first + (pos ? int64_t(*pos) : seen + int64_t(i));
    }
  }
  bool ranked_by_forward() const { return units_.empty() || runtime_->forward_order_final(); }

  void begin_micro_step(bool boundary) { buckets_->begin_micro_step(boundary); }
  void begin_forward() { runtime_->set_phase(Stage3Runtime::Phase::forward); }
  void begin_backward() { runtime_->set_phase(Stage3Runtime::Phase::backward); }  // the forward order is known from here on
  // Units partly added (a member's output got no gradient) are reduced; what the pass left gathered is freed.
  void end_backward() {
    runtime_->finish_backward();
    runtime_->release_all();
    runtime_->set_phase(Stage3Runtime::Phase::idle);
  }
  // The closure or backward threw: free what was gathered (the window's gradients are kept; the other ranks fail
  // their next collective by timeout, as a lost rank would make them).
  void abort_pass() {
    runtime_->release_all();
    try {
      runtime_->set_phase(Stage3Runtime::Phase::idle);
    } catch (...) {}
  }
  void after_backward(bool boundary) { buckets_->after_backward(boundary); }

  template <class State>
  double sum_squares(State& state) {
    return partition_sum_squares(ctx_, partitions(), state);
  }
  torch::Tensor device_sum_squares() { return train::device_sum_squares(ctx_, partitions()); }
  // Nothing to gather for the units (the next forward does); the whole-kept buckets all-gather.
  void gather_updated() { buckets_->gather_updated(); }
  void zero_window(bool gradients_zeroed) {
    buckets_->zero_window(gradients_zeroed);
    if (!gradients_zeroed)
      for (auto& u : units_) u.own.grad.zero_();
  }

  void add_memory(MemoryUse& m, bool state_on_host) const {
    buckets_->add_bucket_memory(m, state_on_host, /*kept_whole=*/true);
    for (auto& u : units_) {
      home_.add_memory(m, *u.group);
      add_partition_memory(m, u.own, true, state_on_host);
      if (u.own.host_stage.defined()) m.gradients.host += int64_t(u.own.host_stage.nbytes());
      m.full_gradient_bytes += u.group->layout.numel() * u.group->layout.element_size();
    }
    buckets_->finish_memory(m);
    m.communication.device = std::max(m.communication.device, runtime_->peak_bytes());
  }
  int64_t reduce_scatter_bytes() const { return buckets_->reduce_scatter_bytes(); }
  void gradient_buffers_changed(GradientBuffers) {}
  int64_t shard_bytes() const {
    int64_t n = buckets_->shard_bytes();
    for (auto& u : units_)
      if (u.own.grad.defined()) n += int64_t(u.own.grad.nbytes());
    return n;
  }
  // Streamed units (HostParams): bytes copied in and the GPU's time on and waiting for the copies.
  StreamStats stream_stats() { return runtime_->stream_stats(); }
  void reset_stream_stats() { runtime_->reset_stream_stats(); }

  // Gathers every unit back into its module's own parameters and detaches its layers (a collective).
  void restore_module() {
    for (auto& u : units_) {
      auto full = torch::empty({u.group->layout.padded()}, u.group->shard.options().device(ctx_.device).requires_grad(false));
      gather_into(*ctx_.comm, u.group->shard.detach().to(ctx_.device), full);
      torch::NoGradGuard ng;
      for (auto& e : u.group->layout.entries()) e.param.set_data(FlatParams::view(full, e).clone());
    }
    for (Shardable* s : attached_) s->attach(nullptr, 0);
    attached_.clear();
  }

 private:
  struct Unit {
    std::unique_ptr<Stage3Group> group;  // the layers point to it
    Partition own;
  };

  // The modules TrainerOptions::gather_unit names, or by default those deriving from GatherUnit and the blocks of an
  // nn::Blocks.
  std::vector<std::string> gather_unit_names(const torch::nn::Module& module) const {
    std::vector<std::string> units;
    for (const auto& item : module.named_modules()) {
      const torch::nn::Module& m = *item.value();
      if (ctx_.opt.gather_unit ? ctx_.opt.gather_unit(item.key(), m) : dynamic_cast<const GatherUnit*>(&m) != nullptr)
        units.push_back(item.key());
      if (!ctx_.opt.gather_unit && dynamic_cast<const nn::BlocksImpl*>(&m) != nullptr)
        for (const auto& c : m.named_children()) units.push_back(item.key().empty() ? c.key() : item.key() + "." + c.key());
    }
    return units;
  }
  // The outermost unit holding layer `name`, or the layer itself.
  static std::string unit_of(const std::vector<std::string>& units, const std::string& name) {
    const std::string* best = nullptr;
    for (const auto& u : units)
      if ((u.empty() || name == u || (name.size() > u.size() && name.starts_with(u) && name[u.size()] == '.')) &&
          (best == nullptr || u.size() < best->size()))
        best = &u;
    return best ? *best : name;
  }

  // One gather unit: its layers' trainable parameters in one flat layout, sharded; each layer attached to it.
  template <class State>
  void add_unit(State& state, const std::string& name, const std::vector<std::pair<std::string, Shardable*>>& layers,
                std::unordered_set<const void*>& sharded) {
    NamedTensors params;
    std::vector<std::size_t> first;  // each layer's first entry
    for (const auto& [layer, s] : layers) {
      first.push_back(params.size());
      for (auto& [pname, p] : s->shardable_parameters()) params.emplace_back(layer + "." + pname, p);
    }
    Unit& u = units_.emplace_back();
    u.group = std::make_unique<Stage3Group>();
    Stage3Group& g = *u.group;
    g.name = name.empty() ? "model" : name;
    g.members = int(layers.size());
    g.layout = FlatParams(params, ctx_.world, ctx_.align_elems(), /*materialize=*/false);
    auto full = torch::zeros({g.layout.padded()}, params.front().second.options().requires_grad(false));
    {
      torch::NoGradGuard ng;
      for (auto& e : g.layout.entries()) FlatParams::view(full, e).copy_(e.param.detach());
    }
    if (ctx_.world > 1 && full.device() != ctx_.device) {  // a streamed model built on the host: broadcast through the device
      torch::Tensor on_device = full.to(ctx_.device);
      ctx_.broadcast(on_device);
      full = on_device.to(full.device());
    } else {
      ctx_.broadcast(full);
    }
    const torch::Tensor mine = g.layout.shard_of(full, ctx_.rank);
    g.shard = home_.place(mine).requires_grad_(true);
    g.grad_shard = home_.gradient_shard(mine);
    full = torch::Tensor();
    g.runtime = runtime_.get();
    {
      torch::NoGradGuard ng;  // the module's own tensors give their memory up: the shard holds the values
      for (auto& e : g.layout.entries()) {
        sharded.insert(e.param.unsafeGetTensorImpl());
        e.param.set_data(torch::empty({0}, e.param.options()));
      }
    }
    state.own(u.own, g.shard.detach(), g.grad_shard, g.layout, int64_t(ctx_.rank) * g.layout.shard());
    u.own.waited_by_gather = true;
    home_.connect(g, u.own);
    runtime_->add_group(g);
    for (std::size_t i = 0; i < layers.size(); ++i) {
      layers[i].second->attach(&g, first[i]);
      attached_.push_back(layers[i].second);
    }
  }

  TrainContext& ctx_;
  Home home_;
  std::unique_ptr<Stage3Runtime> runtime_;
  std::deque<Unit> units_;  // a deque: a unit's Partition stays where hooks and jobs point while units are added
  std::unique_ptr<BucketedGrads<S>> buckets_;
  std::vector<Shardable*> attached_;
};

}  // namespace squeeze::train
