#pragma once
// What every part of a trainer reads (docs/architecture.md, "The trainer's parts"): the communicator, where the model
// trains, its dtypes, the options, the parameter groups, and the state gradient hooks reach during backward. The
// Trainer builds one on the heap before its parts, so hooks, callbacks and the offload worker can point into it.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "squeeze/comm/communicator.hpp"
#include "squeeze/policy/strategy.hpp"
#include "squeeze/engine/buckets.hpp"
#include "squeeze/engine/collectives.hpp"
#include "squeeze/engine/offload.hpp"
#include "squeeze/train/options.hpp"
#include "squeeze/engine/streams.hpp"
#include "squeeze/kernels/adamw.hpp"

namespace squeeze::train {

// The engine below the trainer (flat parameters, buckets, gather units, offload, streams, collectives): its
// names are the trainer's vocabulary, and squeeze::train::X keeps naming them for code written against it.
using namespace squeeze::engine;

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// The types a Strategy trains in, as every part reads them.
template <StrategyType S>
struct TrainTypes {
  using Compute = typename S::compute_type;
  // LoRA trains adapters kept in the master type (fp32), cast to the activations' dtype in forward: they are their
  // own masters. Full training keeps parameters in the compute type (with fp32 masters when that is 16-bit).
  using Param = std::conditional_t<S::has_lora, typename S::master_type, Compute>;
  // Precision<bf16, bf16>: the bf16 parameters are their own master, rounded stochastically (no fp32 copy).
  static constexpr bool kStochastic = S::stochastic_rounding;
  static constexpr bool kMaster = !std::is_same_v<Param, float> && !kStochastic;
  // Mixed-precision micro-batches are summed in fp32 (the planner counts the same).
  static constexpr bool kFp32Accum = S::accumulation_steps > 1 && kMaster;
  // 8-bit Adam moments (QuantizedState<8>): uint8 codes + one fp32 absmax per kernels::kStateBlock elements.
  static constexpr bool k8bit = S::state_bits == 8;
};

// Parameter groups (TrainerOptions::param_groups; by default no decay on norms, biases and embeddings): which group
// each trainable parameter is in, and each group's AdamW coefficients.
struct ParamGroups {
  struct Setting {
    float lr_scale, weight_decay;  // weight_decay < 0: AdamW's
  };
  std::vector<Setting> settings;
  std::unordered_map<std::string, int> group_of;

  // embeddings: the full names of the embedding tables' weights.
  ParamGroups(const TrainerOptions& opt, const NamedTensors& trainable, const std::unordered_set<std::string>& embeddings) {
    settings = {{1.0f, -1.0f}, {1.0f, 0.0f}};  // 0: AdamW's settings, 1: no decay (norms, biases, embeddings)
    for (const ParamGroup& g : opt.param_groups) {
      TORCH_CHECK(bool(g.match), "make_trainer: a parameter group has no match function");
      TORCH_CHECK(g.lr_scale >= 0 && std::isfinite(g.lr_scale), "make_trainer: a parameter group's lr_scale must be >= 0, got ",
                  g.lr_scale);
      settings.push_back({g.lr_scale, g.weight_decay});
    }
    for (const auto& [name, p] : trainable) {
      int gi = -1;
      for (std::size_t i = 0; i < opt.param_groups.size() && gi < 0; ++i)
        if (opt.param_groups[i].match(name)) gi = int(i) + 2;
      if (gi < 0) gi = !opt.decay_norms_biases_embeddings && (p.dim() <= 1 || embeddings.count(name)) ? 1 : 0;
      group_of[name] = gi;
    }
  }
  ParamGroups() = default;

  // One set of AdamW coefficients per group (index: Segment::group) for optimizer step `step` (1-based).
  template <class O>
  GroupCoeffs coeffs(const O& adamw, int64_t step) const {
    GroupCoeffs cs;
    for (const Setting& g : settings)
      cs.push_back(kernels::adamw_coeffs(adamw.lr * g.lr_scale, adamw.beta1, adamw.beta2, adamw.eps,
                                         g.weight_decay < 0 ? adamw.weight_decay : g.weight_decay, step));
    return cs;
  }
};

struct TrainContext {
  comm::CommPtr comm;
  int rank = 0, world = 1;
  torch::Device device{torch::kCPU};
  torch::ScalarType compute_dtype = torch::kFloat32;  // the trainable parameters' dtype
  torch::ScalarType grad_dtype = torch::kFloat32;     // the reduced gradients' (fp32 with mixed-precision accumulation)
  TrainerOptions opt;
  ParamGroups groups;
  std::unique_ptr<SideStream> collectives;  // stage 3's gathers and the buckets' reductions (active with NCCL)
  engine::detail::GradState grads;          // what gradient hooks and stage-3 callbacks reach during backward
  OffloadPipeline* offload = nullptr;       // Offload<Host>: the host update's pipeline

  // Every tensor and every shard of a flat buffer starts on this many elements.
  int64_t align_elems() const { return std::max<int64_t>(1, opt.align_bytes / int64_t(c10::elementSize(compute_dtype))); }
  void broadcast(torch::Tensor& t) const { broadcast_inplace(*comm, t, 0); }
  // The segments of a partition (elements [begin, begin + n) of layout's flat buffer) that share a group: each
  // entry's range runs to the next entry's offset, so alignment gaps (zeros, which no update changes) join it.
  std::vector<Segment> segments(const FlatParams& layout, int64_t begin, int64_t n) const {
    return state_segments(layout.entries(), layout.padded(), begin, n, [this](const FlatEntry& e) { return groups.group_of.at(e.name); });
  }
};

// One optimizer partition as the trainer's checkpoint and load paths see it, whatever part holds it.
struct PartitionView {
  std::string key;           // "replicated", "bucket<i>" or the stage-3 unit's name: unique within the trainer
  const FlatParams* layout;  // parameter names, shapes and offsets of the flat buffer the partition cuts
  int64_t begin = 0;         // the partition's first element in that buffer (this rank's shard; 0 for stage 0)
  bool whole = false;        // stage 0: every rank holds the whole padded layout
  bool sharded = false;      // stage 3: the module's tensors are emptied; the partition's param holds the values
  Partition* state = nullptr;
};

}  // namespace squeeze::train
