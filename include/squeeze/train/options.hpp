#pragma once
// What make_trainer takes besides the model and AdamW's knobs (TrainerOptions, ParamGroup), and what it reports:
// StepResult per micro-batch, MemoryUse / MemoryReport (bytes held against the planner's prediction).
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "squeeze/plan/memory.hpp"
#include "squeeze/kernels/loss_scale.hpp"

namespace squeeze::train {

using plan::GradientBuffers;

// Anything with AdamW's five hyper-parameters (optim::AdamW, or an aggregate of your own).
template <class O>
concept AdamWHyperparameters = requires(const O& o) {
  float(o.lr);
  float(o.beta1);
  float(o.beta2);
  float(o.eps);
  float(o.weight_decay);
};

// A set of parameters with its own learning rate and weight decay (TrainerOptions::param_groups).
struct ParamGroup {
  std::function<bool(const std::string& name)> match;  // by the parameter's full name, e.g. "blocks.0.attn.q.weight"
  float lr_scale = 1.0f;                               // this group's lr = AdamW's lr * lr_scale
  float weight_decay = -1.0f;                          // < 0: AdamW's weight_decay
};

// Clipping and loss scaling come from the AdamW options when they carry them (squeeze::AdamW has
// max_grad_norm and loss_scale); set them here only for an options type without them. Setting both is an error.
struct TrainerOptions {
  float max_grad_norm = 0;  // clip the global L2 norm to this; <= 0: no clipping
  // Plain libtorch layers (not squeeze::nn::Linear / Embedding) that the Strategy would have to shard (Stage 3)
  // or quantize (Quantized<...>) are refused, listed by name; the module names here (an exact dotted name, or its
  // last component: "norm" matches "norm" and "blocks.3.norm"; "*" matches all) are accepted and kept whole on every
  // rank (frozen under LoRA), counted in memory(). Meant for small layers such as norms.
  std::vector<std::string> replicate{};
  // Where the model trains. A model built on the host (in float) is converted to the compute type on its way there,
  // so the device never holds the float copy (its values stay on the host for the masters). Empty: where it is.
  std::optional<torch::Device> device{};
  // Stages 0-1: when the full gradient buffer exists (plan::GradientBuffers). after_backward: from the end of
  // backward to the update (as torch's zero_grad(set_to_none)), so forward's activations and the gradients never
  // peak together, but one gradient more exists while backward's per-parameter gradients move into it.
  // at_backward: from the start of each window's first backward, the lower peak where the activations are fewer
  // bytes than one gradient (plan::best_gradient_buffers says which for nn::Llama). kept: between steps too.
  // memory() counts the buffer only while it exists. Trainer::set_gradient_buffers changes it between windows.
  // Graphed always keeps it (its CUDA graph adds into fixed buffers), whatever is set here.
  GradientBuffers gradient_buffers = GradientBuffers::after_backward;
  // Parameter groups, first match wins. Parameters that match none: AdamW's lr and weight decay, except that norms,
  // biases (every parameter of one dimension) and embeddings get no weight decay unless decay_norms_biases_embeddings.
  std::vector<ParamGroup> param_groups{};
  bool decay_norms_biases_embeddings = false;
  std::optional<kernels::LossScaleOptions> loss_scale{};  // used when the Strategy scales the loss (half compute)
  int64_t persistence_threshold = 0;                      // stage 3: sharded layers with fewer parameters stay whole
  int64_t align_bytes = 256;                              // every tensor and every shard of a flat buffer starts aligned
  // Stage 3: gather units gathered ahead of the one running (forward order in forward, its reverse in backward;
  // CUDA + NCCL: on a side stream, overlapping compute). 0: none; each one more holds one more unit's parameters.
  int prefetch_depth = 1;
  // Stage 3: the last units of the forward order keep their parameters gathered from their forward to their backward,
  // which comes right after (FSDP's reshard_after_forward off for them): no second gather, their size held meanwhile.
  int keep_last_gathered = 0;
  // Stage 3: which modules are gather units, whose sharded layers are gathered as one (engine/stage3.hpp): a block's
  // parameters in one flat buffer, one all-gather in forward, one in backward, one reduce-scatter. A layer joins its
  // outermost unit; a layer in none is a unit alone. Unset: modules deriving from squeeze::train::GatherUnit
  // (nn::Llama's blocks) and the blocks of an nn::Blocks. [](const std::string&, const torch::nn::Module&)
  // { return false; } gathers every layer alone.
  std::function<bool(const std::string& name, const torch::nn::Module& module)> gather_unit{};
  int64_t bucket_bytes = int64_t(32) << 20;  // stage 2 (and stage 3's whole-kept parameters): gradient bucket size
  bool overlap_offload = true;               // Offload<Host>: transfers + CPU AdamW beside backward (see above)
  // Offload<Host>: what the trainer compares this rank's host state (and Offload<Host, Streamed>'s parameters) with,
  // refusing before it allocates one that would not fit. Unset: /proc/meminfo's MemAvailable when it is built.
  std::optional<int64_t> available_host_bytes{};
  // The training step this trainer is built for, as the planner sees it. When set, construction refuses, before it
  // moves or allocates anything, a step whose planned device peak (plan::plan_memory<S>(model, train, world)) exceeds
  // available_device_bytes, or unset the total memory of TrainerOptions::device (a CUDA device; elsewhere nothing is
  // compared), saying by how much and what to change.
  struct PlannedStep {
    plan::ModelShape model;
    plan::TrainShape train;
  };
  std::optional<PlannedStep> planned_step{};
  std::optional<int64_t> available_device_bytes{};
  // CheckpointOffload<Host>: the most recent checkpointed segment inputs kept on the device through the forward (backward
  // starts with them), and how many a backward's fetch brings back ahead of their recomputation. Each one more holds one
  // more segment input on the device.
  int checkpoint_prefetch = 1;
  // CheckpointOffload<Host>: the most host bytes one pass's checkpointed inputs may take; a pass that needs more fails
  // with what it needed. 0: the host's MemAvailable at the pass's start.
  int64_t activation_host_bytes = 0;
  // Each micro-batch's loss read back into StepResult::loss (one host sync per micro-batch). false: loss is NaN and
  // StepResult::loss_value holds it on the device, to read only when logging; where the optimizer state is on a GPU
  // and updated by the CUDA kernels (the trainer compiled by nvcc, no loss scaling) the optimizer step decides on the
  // device too: the gradient norm stays there (StepResult::grad_norm_value), a step whose gradients are not finite is
  // skipped there, and on one rank the step syncs the host not at all (across ranks the norm's all-reduce still waits
  // for its stream; steps_applied() and steps_skipped() sync once when read).
  // Elsewhere a CUDA step syncs once per optimizer step, for the norm's overflow and clipping decision.
  bool read_loss = true;
  // 16-bit compute with fp32 masters, for a module handed over already in the compute type: the float values a
  // parameter was rounded from (by its full name, as in full_parameters()), e.g. a float checkpoint. Not needed
  // for a float module: the trainer converts it and seeds the masters from its float values itself. Null: the
  // masters start from the 16-bit parameters. Called once per parameter while the trainer is built; every rank
  // must return the same values; each must round to the parameter it is given for (checked).
  std::function<torch::Tensor(const std::string& name)> master_init{};
};

// What crossed PCIe for an optimizer step and what it cost (Offload<Host>; zeros otherwise): which of the copies,
// the host update or the GPU bounds a step. GPU times are summed as their events complete, so a step's copies
// may be counted with the next step's.
struct TransferCounters {
  int64_t h2d_bytes = 0;     // to the device: streamed parameters' gathers, uploaded new parameters, offloaded checkpoints
  int64_t d2h_bytes = 0;     // to the host: gradients, offloaded checkpoints
  double h2d_copy_s = 0;     // the GPU's time on streamed parameters' copies (Offload<Host, Params>)
  double copy_wait_s = 0;    // the compute stream's time blocked waiting for those copies
  double host_update_s = 0;  // the worker's CPU AdamW and sums of squares
  double host_wait_s = 0;    // the worker's time waiting for gradient copies to land
  TransferCounters operator-(const TransferCounters& o) const {
    return {h2d_bytes - o.h2d_bytes,     d2h_bytes - o.d2h_bytes,         h2d_copy_s - o.h2d_copy_s,
            copy_wait_s - o.copy_wait_s, host_update_s - o.host_update_s, host_wait_s - o.host_wait_s};
  }
};

struct StepResult {
  float loss = 0;                   // this micro-batch's loss (unscaled); NaN under TrainerOptions::read_loss = false
  torch::Tensor loss_value;         // [] float32, where the model runs: the same loss, detached, never read by the trainer
  bool applied = false;             // the optimizer updated the parameters on this call (where the device decides: issued)
  bool boundary = false;            // this call ended an accumulation window (applied or skipped)
  int64_t step = 0;                 // optimizer steps applied so far, this call's included (likewise: issued)
  float scale = 1;                  // the loss scale used for this micro-batch
  float grad_norm = std::nanf("");  // global L2 norm of the unscaled gradient (boundary only; NaN where the device decides)
  torch::Tensor grad_norm_value;    // where the device decides (TrainerOptions::read_loss): the same norm there, [] float32
  TransferCounters transfers;       // since the previous boundary (boundary only)
};

// Bytes this rank holds per category; "device" is where the compute parameters live (the CPU in CPU
// runs), "host" what Offload<Host> moved to host memory.
struct MemoryUse {
  plan::Placement parameters, gradients, master_weights, optimizer_state, communication;
  int64_t persistent_params = 0;  // stage 3: elements kept whole on every rank (not sharded)
  // Stage 2/3: the most gradient bytes alive at once on the device during backward, measured at every
  // gradient hook: the reduced shards + in-flight bucket buffers + the parameter .grad being taken over.
  // (Stage 0/1: the full gradient buffers.) Compare with full_gradient_bytes, what one full gradient takes.
  int64_t peak_gradient_bytes = 0;
  int64_t full_gradient_bytes = 0;
  // CheckpointOffload<Host>: host memory holding the checkpointed segment inputs of a pass (pooled between passes).
  int64_t checkpoint_host_bytes = 0;
  plan::Placement model_state() const {
    plan::Placement p = parameters;
    p += gradients;
    p += master_weights;
    p += optimizer_state;
    return p;
  }
};

struct MemoryReport {
  MemoryUse actual;
  plan::MemoryPlan predicted;
  // A table: category, actual device/host bytes, predicted device/host bytes.
  std::string table() const {
    std::ostringstream s;
    auto row = [&](const char* name, plan::Placement a, plan::Placement p) {
      s << name << "  actual device " << a.device << " host " << a.host << "  |  planned device " << p.device << " host " << p.host << "\n";
    };
    row("parameters     ", actual.parameters, predicted.parameters);
    row("gradients      ", actual.gradients, predicted.gradients);
    row("master_weights ", actual.master_weights, predicted.master_weights);
    row("optimizer_state", actual.optimizer_state, predicted.optimizer_state);
    row("communication  ", actual.communication, predicted.communication);
    s << "peak gradients   measured device " << actual.peak_gradient_bytes << "  |  one full gradient " << actual.full_gradient_bytes
      << "\n";
    return s.str();
  }
};

}  // namespace squeeze::train
