#pragma once
// Strategy<Ps...>: an order-independent set of policies, at most one per family, with defaults filled:
//   Sharded<Stage0>, Offload<Device>, Accumulate<1>, Precision<float, float>, no quantization, no LoRA,
//   NoCheckpoint, loss scaling from Precision, Train, Eager.
// Contradictions fail to compile with a static_assert that says what to write instead.
#include <type_traits>

#include "squeeze/policy/accumulation.hpp"
#include "squeeze/policy/recompute.hpp"
#include "squeeze/policy/family.hpp"
#include "squeeze/policy/graph.hpp"
#include "squeeze/policy/lora.hpp"
#include "squeeze/policy/loss_scale.hpp"
#include "squeeze/policy/mode.hpp"
#include "squeeze/policy/offload.hpp"
#include "squeeze/policy/precision.hpp"
#include "squeeze/policy/quantization.hpp"
#include "squeeze/policy/sharding.hpp"

namespace squeeze {

struct NoWeightQuantization {
  using family = weight_quantization_family;
  using method = void;
  static constexpr int bits = 0;  // 0: weights stored in the compute type
  static constexpr int group = 0;
  static constexpr bool double_quant = false;
  static constexpr bool act_order = false;
  static constexpr bool frozen_weights = false;
};
struct NoStateQuantization {
  using family = state_quantization_family;
  static constexpr int bits = 32;  // Adam moments in float
  static constexpr int group = 0;
};
struct NoLoRA {
  using family = lora_family;
  static constexpr int rank = 0;
  static constexpr int alpha = 0;
  static constexpr unsigned targets = 0;
  static constexpr float scaling = 0.0f;
};

namespace detail {
struct not_a_policy {};
template <class P>
struct family_of {
  using type = not_a_policy;
};
template <Policy P>
struct family_of<P> {
  using type = typename P::family;
};
template <class P>
using family_of_t = typename family_of<P>::type;

template <class Family, class... Ps>
inline constexpr int count_family = (int(std::is_same_v<family_of_t<Ps>, Family>) + ... + 0);

template <class Family, class Default, class... Ps>
struct pick {
  using type = Default;
};
template <class Family, class Default, class P, class... Ps>
struct pick<Family, Default, P, Ps...> {
  using type = std::conditional_t<std::is_same_v<family_of_t<P>, Family>, P, typename pick<Family, Default, Ps...>::type>;
};
template <class Family, class Default, class... Ps>
using pick_t = typename pick<Family, Default, Ps...>::type;
}  // namespace detail

template <class... Ps>
struct Strategy {
  static_assert((Policy<Ps> && ...),
                "every Strategy argument must be a squeeze policy: Sharded<StageN>, Offload<Host>, Accumulate<N>, Precision<C, M>, "
                "Quantized<B, Method>, LoRA<R, A>, Checkpointed, CheckpointEvery<N>, CheckpointOffload<Host>, DynamicLossScale, Inference, "
                "Graphed");
  static_assert(detail::count_family<sharding_family, Ps...> <= 1, "Strategy has two Sharded<...> policies: keep one");
  static_assert(detail::count_family<offload_family, Ps...> <= 1, "Strategy has two Offload<...> policies: keep one");
  static_assert(detail::count_family<accumulation_family, Ps...> <= 1,
                "Strategy has two Accumulate<N> policies: keep one (the counts do not multiply)");
  static_assert(detail::count_family<precision_family, Ps...> <= 1,
                "Strategy has two Precision<...> policies: keep one, e.g. Precision<bf16, float>");
  static_assert(detail::count_family<weight_quantization_family, Ps...> <= 1, "Strategy has two weight Quantized<...> policies: keep one");
  static_assert(detail::count_family<state_quantization_family, Ps...> <= 1, "Strategy has two QuantizedState<8> policies: keep one");
  static_assert(detail::count_family<lora_family, Ps...> <= 1, "Strategy has two LoRA<...> policies: keep one");
  static_assert(detail::count_family<checkpoint_family, Ps...> <= 1,
                "Strategy has two checkpoint policies: keep one of Checkpointed or CheckpointEvery<N>");
  static_assert(detail::count_family<checkpoint_offload_family, Ps...> <= 1, "Strategy has two CheckpointOffload<...> policies: keep one");
  static_assert(detail::count_family<loss_scale_family, Ps...> <= 1, "Strategy has two loss-scale policies: keep one");
  static_assert(detail::count_family<mode_family, Ps...> <= 1, "Strategy has both Train and Inference: keep one");
  static_assert(detail::count_family<graph_family, Ps...> <= 1, "Strategy has both Eager and Graphed: keep one");

  using sharding = detail::pick_t<sharding_family, Sharded<Stage0>, Ps...>;
  using offload = detail::pick_t<offload_family, Offload<Device>, Ps...>;
  using accumulation = detail::pick_t<accumulation_family, Accumulate<1>, Ps...>;
  using precision = detail::pick_t<precision_family, Precision<float, float>, Ps...>;
  using weight_quantization = detail::pick_t<weight_quantization_family, NoWeightQuantization, Ps...>;
  using state_quantization = detail::pick_t<state_quantization_family, NoStateQuantization, Ps...>;
  using lora = detail::pick_t<lora_family, NoLoRA, Ps...>;
  using checkpoint = detail::pick_t<checkpoint_family, NoCheckpoint, Ps...>;
  using checkpoint_offload = detail::pick_t<checkpoint_offload_family, CheckpointOffload<Device>, Ps...>;
  using mode = detail::pick_t<mode_family, Train, Ps...>;
  using graph = detail::pick_t<graph_family, Eager, Ps...>;
  using loss_scale =
      detail::pick_t<loss_scale_family, std::conditional_t<precision::needs_loss_scaling, DynamicLossScale, NoLossScale>, Ps...>;

  // ---- traits -------------------------------------------------------------------------------------
  static constexpr int stage = sharding::stage;
  static constexpr int weight_bits = weight_quantization::bits;  // 0: not quantized
  static constexpr bool quantized_weights = weight_bits != 0;
  // Offload<Host, Streamed> on a frozen quantized base: the packed blocks live in host memory and come to the device a
  // block at a time; the adapters and their (small) state stay on the device.
  static constexpr bool stream_frozen_base = offload::params_on_host && quantized_weights;
  // Offload<Host>: the optimizer state (and the fp32 masters) in host memory.
  static constexpr bool offload_to_host = offload::to_host && !stream_frozen_base;
  static constexpr bool stream_params = offload::params_on_host && !quantized_weights;  // trained stage-3 units streamed
  static constexpr int accumulation_steps = accumulation::steps;
  using compute_type = typename precision::compute_type;
  using master_type = typename precision::master_type;
  static constexpr bool has_master_copy = precision::has_master_copy;
  static constexpr bool fp8_gemms = precision::fp8_gemms;  // Precision<fp8, bf16, float>: the block linears' GEMMs in FP8
  // Precision<bf16, bf16> trained: the bf16 weights are their own master, updated with stochastic rounding.
  static constexpr bool stochastic_rounding = mode::training && !precision::has_master_copy && std::is_same_v<compute_type, bf16>;
  static constexpr bool loss_scaling = loss_scale::enabled;
  static constexpr bool dynamic_loss_scaling = loss_scale::dynamic;
  static constexpr bool training = mode::training;
  static constexpr int state_bits = state_quantization::bits;  // 32 or 8
  static constexpr bool has_lora = lora::rank > 0;
  static constexpr int lora_rank = lora::rank;
  static constexpr int checkpoint_every = checkpoint::every;                // 0: no checkpointing
  static constexpr bool checkpoints_on_host = checkpoint_offload::to_host;  // CheckpointOffload<Host>
  static constexpr int checkpoint_bits = checkpoint_offload::bits;          // CheckpointOffload<..., Int8>: 8
  // Base weights get gradients and optimizer state unless frozen by LoRA or by a frozen quantization.
  static constexpr bool graphed = graph::graphed;  // Graphed: forward and backward replayed from a CUDA graph
  static constexpr bool base_trainable = training && !has_lora && !weight_quantization::frozen_weights;

  // The same strategy spelled in one fixed order: Strategy<A, B>::canonical == Strategy<B, A>::canonical.
  using canonical = Strategy<sharding, offload, accumulation, precision, weight_quantization, state_quantization, lora, checkpoint,
                             checkpoint_offload, mode, loss_scale, graph>;

  // ---- contradictions -----------------------------------------------------------------------------
  static_assert(!(training && weight_quantization::frozen_weights && !has_lora),
                "GPTQ/RTN/NF4-quantized base weights are frozen and cannot be trained: add LoRA<8, 16> to train adapters on them, "
                "or add Inference to only run the model");
  static_assert(!(offload_to_host && stage == 0),
                "Offload<Host> moves the sharded optimizer state to host memory: add Sharded<Stage1>, Sharded<Stage2> or Sharded<Stage3> "
                "(on one GPU any stage works)");
  static_assert(!(stream_params && stage != 3),
                "Offload<Host, Streamed> streams stage-3 gather units from host memory: add Sharded<Stage3> (on one GPU too), or write "
                "Offload<Host> to keep the parameters on the device");
  static_assert(!(stream_params && has_lora),
                "Offload<Host, Streamed> streams trained parameters or a frozen quantized base; a dense LoRA base is not streamed: "
                "quantize it (Quantized<4, NF4, DoubleQuant>) or write Offload<Host> (adapters' state in host memory)");
  static_assert(!(stream_frozen_base && !std::is_same_v<typename weight_quantization::method, NF4>),
                "Offload<Host, Streamed> streams an NF4 base from host memory; a GPTQ-format base stays on the device: write "
                "Quantized<4, NF4, DoubleQuant>, or remove Offload<Host, Streamed>");
  static_assert(!(stream_frozen_base && stage != 0),
                "Offload<Host, Streamed> on a quantized base streams its blocks to one GPU. The adapters and their state stay "
                "there: remove Sharded<...>");
  static_assert(!(training && !precision::has_master_copy && std::is_same_v<compute_type, half>),
                "fp16 weights cannot be their own master (updates vanish below fp16's resolution): write Precision<half, float>");
  static_assert(!(stochastic_rounding && !(stream_params && !has_lora)),
                "Precision<bf16, bf16> trains bf16 weights as their own master, rounded stochastically by the host AdamW in place on "
                "streamed parameters: add Sharded<Stage3> and Offload<Host, Streamed>, or keep an fp32 master with Precision<bf16, float>");
  static_assert(!(fp8_gemms && (quantized_weights || has_lora)),
                "Precision<fp8, bf16, float> multiplies trained bf16 weights in FP8; a frozen or quantized base keeps its own GEMMs: "
                "write Precision<bf16, float> with LoRA or Quantized<...>");
  static_assert(!(loss_scale::enabled && !precision::needs_loss_scaling),
                "loss scaling protects fp16 gradients from underflow; float and bf16 have float's exponent range: remove the loss-scale "
                "policy, or compute in fp16 with Precision<half, float>");
  static_assert(training || accumulation_steps == 1, "Inference computes no gradients to accumulate: remove Accumulate<N>");
  static_assert(training || checkpoint_every == 0, "Inference keeps no activations for backward: remove Checkpointed");
  static_assert(!(checkpoint_offload::stores && checkpoint_every == 0),
                "CheckpointOffload<...> stores the checkpointed segment inputs (in host memory, or in 8 bits): add Checkpointed (or "
                "CheckpointEvery<N>), which decides what is kept");
  static_assert(training || !has_lora, "Inference trains no adapters: remove LoRA<...> (merge trained adapters into the weights first)");
  static_assert(training || !offload_to_host, "Inference has no optimizer state to offload: remove Offload<Host>");
  static_assert(training || (stage == 0 || stage == 3),
                "Inference has no optimizer state or gradients to shard: use Sharded<Stage3> to shard the weights, or remove Sharded<...>");
  static_assert(training || state_bits == 32, "Inference has no optimizer state: remove QuantizedState<8>");
  static_assert(!(has_lora && !training), "LoRA adapters are trained: remove Inference");
  // A CUDA graph replays kernels only: whatever the host does inside forward or backward happens once, at the capture.
  static_assert(!(graphed && !training), "Graphed captures a training step's forward and backward: remove Graphed to run Inference");
  static_assert(!(graphed && stage >= 2),
                "Graphed replays forward and backward as one CUDA graph, but stages 2-3 hand gradients over (and gather weights) from "
                "the host inside backward: write Sharded<Stage0> or Sharded<Stage1>, or remove Graphed");
  static_assert(!(graphed && offload::to_host),
                "Graphed replays forward and backward as one CUDA graph, but Offload<Host> moves blocks and gradients under the "
                "host's control inside them: remove Offload<Host>, or remove Graphed");
  static_assert(!(graphed && checkpoint_offload::stores),
                "Graphed replays forward and backward as one CUDA graph, but CheckpointOffload<...> keeps the checkpoints through "
                "the host's bookkeeping: remove CheckpointOffload<...> (Checkpointed alone composes), or remove Graphed");
  static_assert(!(graphed && dynamic_loss_scaling),
                "Graphed fixes the loss scale at the capture, and DynamicLossScale changes it: compute in bf16 (Precision<bf16, "
                "float>), or write StaticLossScale<K>");
};

template <class T>
inline constexpr bool is_strategy_v = false;
template <class... Ps>
inline constexpr bool is_strategy_v<Strategy<Ps...>> = true;
template <class S>
concept StrategyType = is_strategy_v<S>;

// Two strategies are the same when they hold the same policies in any order.
template <StrategyType A, StrategyType B>
inline constexpr bool same_strategy_v = std::is_same_v<typename A::canonical, typename B::canonical>;

}  // namespace squeeze
