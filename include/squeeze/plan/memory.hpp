#pragma once
// Constexpr memory planner: bytes per GPU and per host for one data-parallel rank, by category.
// The formulas, and why, are in README.md, section "Memory model"; in short (Ψ parameters, N ranks, p_c/p_m bytes of
// the compute/master type, Ψ_t trainable parameters):
//   parameters   Ψ·p_c (quantized linears: packed bits + scales), /N at stage 3
//   gradients    Ψ_t·p_c, /N from stage 2; fp32 when accumulating mixed-precision micro-batches
//   master       Ψ_t·p_m when it differs from the compute copy, /N from stage 1
//   optimizer    Adam m and v: Ψ_t·8 (or 8-bit blockwise: Ψ_t·2 + block scales), /N from stage 1
//   activations  LLaMA block with fused attention, see activation_bytes()
//   communication gather/reduce buckets: one block (stage 1-2), three (stage 3: current, prefetch, grads)
// Offload<Host> moves master + optimizer state (and an fp32 gradient shard) to host memory.
#include <bit>
#include <cstdint>

#include "../policy/strategy.hpp"
#include "model_shape.hpp"

namespace squeeze::plan {

struct TrainShape {
  i64 micro_batch = 1;  // sequences per micro-batch on one rank
  i64 seq = 2048;       // tokens per sequence
};

struct Placement {
  i64 device = 0;
  i64 host = 0;
  constexpr Placement& operator+=(Placement o) { device += o.device; host += o.host; return *this; }
  constexpr bool operator==(const Placement&) const = default;
};

struct MemoryPlan {
  Placement parameters, gradients, master_weights, optimizer_state, activations, communication;
  i64 total_params = 0;      // Ψ
  i64 trainable_params = 0;  // Ψ_t
  constexpr Placement model_state() const {
    Placement p = parameters;
    p += gradients; p += master_weights; p += optimizer_state;
    return p;
  }
  constexpr Placement total() const {
    Placement p = model_state();
    p += activations; p += communication;
    return p;
  }
};

constexpr i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }

// Bytes of one frozen quantized weight matrix [in, out] (AutoGPTQ-style layout for GPTQ/RTN:
// qweight bits/8 per value, fp16 scale + packed zero per group and column, int32 g_idx per input row;
// NF4: 4 bits per value + one absmax per block, fp32, or 8-bit with double quantization).
template <class Q>
constexpr i64 quantized_matrix_bytes(i64 in, i64 out) {
  const i64 n = in * out;
  if constexpr (std::is_same_v<typename Q::method, NF4>) {
    const i64 blocks = ceil_div(n, Q::group);
    if constexpr (Q::double_quant) return n / 2 + blocks + ceil_div(blocks, 256) * 4 + 4;
    else return n / 2 + blocks * 4;
  } else {
    const i64 group = Q::group == 0 ? in : Q::group;
    const i64 groups = ceil_div(in, group);
    const i64 qweight = ceil_div(in * Q::bits, 32) * out * 4;
    const i64 qzeros = groups * ceil_div(out * Q::bits, 32) * 4;
    const i64 scales = groups * out * 2;
    const i64 g_idx = in * 4;
    return qweight + qzeros + scales + g_idx;
  }
}

// Adapter parameters of LoRA<r> over one block: r·(in + out) per targeted linear.
template <class L>
constexpr i64 lora_block_params(const ModelShape& m) {
  i64 n = 0;
  const auto lin = m.block_linears();
  for (int i = 0; i < 7; ++i)
    if (L::targets & (1u << i)) n += L::rank * (lin[i].in + lin[i].out);
  return n;
}

// Activation bytes saved for backward on one rank (training) or the working set (inference).
// Per block and token, with a fused (flash) attention that keeps no T×T scores:
//   RMSNorm input + output (2h), q (h), k and v after RoPE (2·kv), attention output (h),
//   RMSNorm input + output (2h), gate, up and silu(gate)·up (3·ffn)    -> 6h + 2kv + 3ffn values of p_c
//   plus fp32: two RMSNorm reciprocal RMS values and one log-sum-exp per head.
// Head: final norm (2h values) + logits in p_c + fp32 log-softmax for the loss (V·(p_c+4)).
// Checkpointing every N blocks keeps each segment's input (h values) and recomputes one segment.
constexpr i64 activation_bytes(const ModelShape& m, const TrainShape& t, i64 p_c, int checkpoint_every,
                               bool training, i64 lora_rank_targets = 0) {
  const i64 tokens = t.micro_batch * t.seq;
  const i64 block = tokens * ((6 * m.hidden + 2 * m.kv_dim() + 3 * m.ffn + lora_rank_targets) * p_c + (2 + m.heads) * 4);
  const i64 head = tokens * (2 * m.hidden * p_c + 4 + m.vocab * (p_c + 4));
  if (!training) return tokens * (2 * m.hidden + 2 * m.kv_dim() + 3 * m.ffn) * p_c + tokens * m.vocab * p_c;
  if (checkpoint_every == 0) return m.layers * block + head;
  const i64 segment = checkpoint_every < m.layers ? checkpoint_every : m.layers;
  return ceil_div(m.layers, checkpoint_every) * tokens * m.hidden * p_c + segment * block + head;
}

template <StrategyType S>
constexpr MemoryPlan plan_memory(const ModelShape& m, const TrainShape& t, int world) {
  const i64 N = world;
  const auto shard = [N](i64 x) { return ceil_div(x, N); };  // every rank holds an equal, padded shard
  const i64 p_c = sizeof(typename S::compute_type);
  const i64 p_m = sizeof(typename S::master_type);
  using WQ = typename S::weight_quantization;
  using L = typename S::lora;

  MemoryPlan plan;
  plan.total_params = m.params();
  const i64 lora_params = S::has_lora ? m.layers * lora_block_params<L>(m) : 0;
  const i64 trainable = !S::training ? 0 : S::base_trainable ? m.params() : lora_params;
  plan.trainable_params = trainable;

  // Parameters: the compute copy (or packed quantized linears + high-precision rest) and adapters.
  if constexpr (S::quantized_weights) {
    i64 weights = 0;
    for (auto lin : m.block_linears()) weights += m.layers * quantized_matrix_bytes<WQ>(lin.in, lin.out);
    weights += m.unquantized_params() * p_c;
    weights += lora_params * p_c;
    plan.parameters.device = S::stage >= 3 ? shard(weights) : weights;
  } else {
    const i64 elements = m.params() + lora_params;  // shards are counted in elements, then bytes
    plan.parameters.device = (S::stage >= 3 ? shard(elements) : elements) * p_c;
  }

  if (trainable > 0) {
    // Gradients in the compute type; accumulating mixed-precision micro-batches sums into fp32.
    const bool fp32_accumulator = S::accumulation_steps > 1 && S::has_master_copy;
    if constexpr (S::stage >= 2) {
      plan.gradients.device = shard(trainable) * (fp32_accumulator ? 4 : p_c);
    } else {
      plan.gradients.device = trainable * p_c + (fp32_accumulator ? trainable * 4 : 0);
    }
    const i64 owned = S::stage >= 1 ? shard(trainable) : trainable;  // optimizer-state shard
    const i64 master = S::has_master_copy ? owned * p_m : 0;
    const i64 state = S::state_bits == 32 ? owned * 8 : owned * 2 + 2 * ceil_div(owned, S::state_quantization::group) * 4;
    if constexpr (S::offload_to_host) {
      plan.master_weights.host = S::has_master_copy ? master : owned * p_m;  // the host update needs an fp32 copy
      plan.optimizer_state.host = state;
      plan.gradients.host = owned * 4;  // fp32 gradient shard streamed down for the CPU AdamW
    } else {
      plan.master_weights.device = master;
      plan.optimizer_state.device = state;
    }
  }

  const i64 lora_act = S::has_lora ? S::lora_rank * std::popcount(L::targets) : 0;
  plan.activations.device = activation_bytes(m, t, p_c, S::checkpoint_every, S::training, lora_act);

  if (N > 1) {
    const i64 bucket = m.largest_gather_params() * p_c;
    if constexpr (S::stage >= 3) plan.communication.device = 3 * bucket;  // gathered, prefetched, grads to reduce
    else if constexpr (S::stage >= 1) plan.communication.device = S::training ? bucket : 0;
  }
  return plan;
}

}  // namespace squeeze::plan
