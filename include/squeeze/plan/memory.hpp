#pragma once
// Constexpr memory planner: bytes per GPU and per host for one data-parallel rank, by category, and the
// device peak of a training step. The formulas, and why, are in README.md, section "Memory model"; in short
// (Ψ parameters, N ranks, p_c/p_m bytes of the compute/master type, Ψ_t trainable parameters):
//   parameters   Ψ·p_c (quantized linears: packed bits + scales; LoRA adapters in p_m), /N at stage 3
//   gradients    Ψ_t·p_c, /N from stage 2; fp32 when accumulating mixed-precision micro-batches
//   master       Ψ_t·p_m when it differs from the compute copy, /N from stage 1
//   optimizer    Adam m and v: Ψ_t·8 (or 8-bit blockwise: Ψ_t·2 + block scales), /N from stage 1
//   activations  what squeeze::nn::Llama keeps for backward, plus the loss's transient, see activation_bytes()
//   communication gather/reduce buckets: one block (stage 1-2), 2 + prefetch_depth (stage 3: current, prefetched, grads)
// Offload<Host> moves master + optimizer state (and a gradient shard in the gradient's type) to host memory;
// Offload<Host, Streamed> the stage-3 parameter shards and gradients too, leaving on the device the units in flight:
// the one running, the ones prefetched and the gradient being reduced (2 + prefetch_depth of the largest gather unit).
// peak(): a training step's device high-water mark: the start of backward (everything saved, the loss's
// gradients being formed) or the optimizer step (every gradient materialised, no activations; freed gradients
// beside the flat buffer they are collected into), whichever is larger. At stages 0-1, when the gradient buffer
// exists (TrainShape::gradient_buffers) decides which gradients count at each moment.
#include <algorithm>
#include <bit>
#include <cstdint>

#include "squeeze/policy/strategy.hpp"
#include "squeeze/plan/model_shape.hpp"

namespace squeeze::plan {

// Tokens per chunk of squeeze::nn::Llama's loss (LlamaImpl::loss_chunk_tokens and TrainShape::loss_chunk_tokens
// both default to this). The LM head + fp32 cross-entropy run over chunks of this many tokens, each recomputed
// in backward, so one chunk's logits exist at a time: 12·chunk·V bytes at their peak (fp32 log-softmax + two
// fp32 gradients) instead of 12·B·T·V (TinyLlama, B=8, T=2048: 1.6 GB instead of 6.3 GB). 4096 rows keep the
// head's GEMMs (4096 x V x h) large enough to run at full tensor-core rate; smaller chunks save little more
// memory while the chunk's bookkeeping (the head's gradient sum, the hidden states' gradients) stays. The cost is
// one extra head forward (2·tokens·V·h FLOPs, ~2% of a 1.1B step) whenever there is more than one chunk.
inline constexpr i64 kDefaultLossChunkTokens = 4096;

// Stages 0-1: when the full gradient buffer (one flat buffer in the gradient type, what the update reads) exists
// (train::TrainerOptions::gradient_buffers; stages 2-3 keep their gradient shards).
enum class GradientBuffers {
  kept,  // allocated once and attached as the parameters' .grad, kept between steps
  // From the end of backward to the update: backward leaves one gradient per parameter, made as activations are
  // freed (as torch's zero_grad(set_to_none)), and they move into the buffer, both existing for that moment.
  after_backward,
  // From the start of a window's first backward to the update, attached as .grad so backward adds into it: no
  // second copy, but it exists beside every activation backward starts with. The lower peak where those activations
  // are fewer bytes than one gradient (best_gradient_buffers). With an fp32 accumulator, the same as after_backward.
  at_backward,
};

// What a timing does: at_backward with an fp32 accumulator is after_backward (each micro-batch's gradients are added
// into the accumulator after its backward; attaching the compute-type buffer would only add one).
constexpr GradientBuffers effective_gradient_buffers(GradientBuffers g, bool fp32_accumulator) {
  return g == GradientBuffers::at_backward && fp32_accumulator ? GradientBuffers::after_backward : g;
}

constexpr const char* to_string(GradientBuffers g) {
  return g == GradientBuffers::kept ? "kept" : g == GradientBuffers::after_backward ? "after_backward" : "at_backward";
}

struct TrainShape {
  i64 micro_batch = 1;                                       // sequences per micro-batch on one rank
  i64 seq = 2048;                                            // tokens per sequence
  GradientBuffers gradient_buffers = GradientBuffers::kept;  // stages 0-1
  // The model's loss chunk (LlamaImpl::loss_chunk_tokens): <= 0 or >= micro_batch·seq is the unchunked loss.
  i64 loss_chunk_tokens = kDefaultLossChunkTokens;
  // The model runs the fused RMSNorm / RoPE / SwiGLU (LlamaConfig::fused_kernels, its default).
  bool fused_kernels = true;
  // CheckpointOffload<Host>: segment inputs held on the device besides the one in use (TrainerOptions::checkpoint_prefetch).
  i64 checkpoint_prefetch = 1;
  // Stage 3: gather units gathered ahead of the one running (TrainerOptions::prefetch_depth), each one more unit held;
  // a streamed quantized base: its blocks copied ahead, each one more block's packed bytes on the device.
  i64 prefetch_depth = 1;
  // Tokens per tile of each block's MLP and its norm (nn::LlamaImpl::mlp_tile_tokens); <= 0 or >= micro_batch·seq: untiled.
  i64 mlp_tile_tokens = 0;
};

struct Placement {
  i64 device = 0;
  i64 host = 0;
  constexpr Placement& operator+=(Placement o) {
    device += o.device;
    host += o.host;
    return *this;
  }
  constexpr bool operator==(const Placement&) const = default;
};

struct MemoryPlan {
  Placement parameters, gradients, master_weights, optimizer_state, activations, communication;
  i64 total_params = 0;      // Ψ
  i64 trainable_params = 0;  // Ψ_t
  // Device gradient bytes that do not exist at the start of backward (GradientBuffers::after_backward): they are
  // created by backward, summed into an accumulator or read by the optimizer, then freed.
  i64 transient_gradients = 0;
  // Device bytes beside the model state when backward ends: the per-parameter gradients backward left moving into
  // the flat buffer the update reads (after_backward at stages 0-1 without an fp32 accumulator: both exist at once).
  i64 gradient_collect = 0;
  constexpr Placement model_state() const {
    Placement p = parameters;
    p += gradients;
    p += master_weights;
    p += optimizer_state;
    return p;
  }
  // Every category at once: an upper bound of the peak.
  constexpr Placement total() const {
    Placement p = model_state();
    p += activations;
    p += communication;
    return p;
  }
  // The device high-water mark of one step: the start of backward (all activations, the gradients kept
  // between steps) or the optimizer step (all gradients, no activations; freed gradients while they are
  // collected into their flat buffer). Host: everything, it is persistent.
  constexpr Placement peak() const {
    const i64 backward_start = total().device - transient_gradients;
    const i64 optimizer_step = model_state().device + communication.device + gradient_collect;
    return {backward_start > optimizer_step ? backward_start : optimizer_step, total().host};
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
    // DoubleQuant (bitsandbytes' nested form): a code per block, an fp32 absmax per 256 blocks, the offset, the 256-entry map
    if constexpr (Q::double_quant)
      return n / 2 + blocks + ceil_div(blocks, 256) * 4 + 4 + 256 * 4;
    else
      return n / 2 + blocks * 4;
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

// Activation bytes on one rank at the start of backward (training), or the working set (inference), for
// squeeze::nn::Llama on a GPU (fused attention: flash for 16-bit compute, memory-efficient for fp32). Per block
// and token, what autograd keeps (p_c: compute bytes):
//   each RMSNorm   fused (TrainShape::fused_kernels, the default): its input (h·p_c) and reciprocal RMS (4 bytes);
//                  unfused: its input in fp32 (the statistics are computed in float: a copy for 16-bit compute,
//                  the input itself for fp32) = 4h bytes, the reciprocal RMS and the normalised value before the
//                  gain (h·p_c, kept by the gain's product); both: the output (h·p_c, kept by the projections)
//   attention      q, k and v after RoPE (h + 2·kv; fp32 repeats K/V to all heads: h + 2h) and the output
//                  (h, also the o projection's input), one fp32 log-sum-exp per head; no T×T scores
//   SwiGLU         fused: gate, up (silu recomputed in backward) and silu(gate)·up (3·ffn); unfused: gate,
//                  silu(gate), up and the product (4·ffn)
//   LoRA           r per adapted projection (x·A^T, kept for B's gradient)
// -> unfused 8h + 4·2 bytes + (6h + 2kv' + 4ffn + lora)·p_c + heads·4; fused 4·2 bytes + (6h + 2kv' + 3ffn + lora)·p_c
// + heads·4 (the saving measured: docs/results.md, The fused LLaMA kernels and FSDP2).
// With a frozen base (LoRA) a product whose weight needs no gradient keeps nothing for it: the norms keep
// no pre-gain value, a norm's output is kept only when an adapted projection reads it (never the final
// norm's: the head is frozen), silu(gate)·up only when down is adapted, and block 0's first norm nothing
// (the frozen embedding's output needs no gradient).
// Head: the final norm (as above) and the loss, see loss_bytes(). Checkpointing every n blocks keeps each
// segment's input (h·p_c) instead; one segment's blocks are recomputed at a time, after the loss's transient is
// gone: inputs + final norm + max(loss, segment). A recomputed segment's backward holds, beside its blocks' saved
// values, the gradient arriving at it (h·p_c per token) and, in the last block's MLP backward, the gradients of
// silu(gate) and up beside the product's (2·ffn·p_c more than the saved values that are already freed; 3·ffn·p_c
// under a frozen down projection, which saved no product to free).
//
// Tiled (TrainShape::mlp_tile_tokens = c < the tokens), a block keeps of its MLP and norm only the tiles' input rows
// (h·p_c a token, the norm's input, shared with the residual stream) and none of the norm's statistics, gate, up,
// product or MLP adapters' values. The recomputed segment's backward then holds, beside the arriving gradient, the
// largest of: one tile's recomputed MLP and its gradients (c tokens of the above) with the input gradients of the
// tiles done so far (autograd keeps them until the last arrives); those joined (three [tokens, h] tensors); the
// attention's backward (dq, dk, dv and the attention output's gradient, (2h + 2kv)·p_c a token).
//
// The loss over c tokens at a time (n tokens in all; c = n unchunked): the logits cast to fp32 and the fp32
// log-softmax kept for backward; the first backward node holds it beside the fp32 gradients it reads and writes:
// 12·c·V bytes (more than the forward's bf16 logits + fp32 copy + log-softmax), or later, while the head's
// product backpropagates, the logits' gradient in the compute type, the head's new weight gradient and the
// chunk's hidden-state gradient (c·V + V·h + c·h)·p_c, whichever is larger. Chunked (c < n), the head's
// weight gradient summed over the chunks done so far (V·h·p_c, when the head trains) and the hidden states'
// gradients of those chunks ((n - c)·h·p_c; the last, partial, chunk runs first) are alive beside it.
constexpr i64 loss_bytes(const ModelShape& m, i64 tokens, i64 p_c, i64 chunk_tokens, bool head_trains) {
  const bool chunked = chunk_tokens > 0 && chunk_tokens < tokens;
  const i64 c = chunked ? chunk_tokens : tokens;
  const i64 head_grad = head_trains ? m.vocab * m.hidden * p_c : 0;
  const i64 softmax = 12 * c * m.vocab;
  const i64 product = (c * m.vocab + c * m.hidden) * p_c + head_grad;
  const i64 chunk = softmax > product ? softmax : product;
  return chunked ? chunk + head_grad + (tokens - c) * m.hidden * p_c : chunk;
}

// `trained_linears`: which of a block's seven linears (bit i as in ModelShape::block_linears()) train or carry
// adapters: squeeze::all_linears for full training, the LoRA targets when the base is frozen.
//
// FP8 GEMMs (fp8: Precision<fp8, bf16, float>, full training): each block linear keeps its input as an FP8 copy (one byte
// a value) in place of the compute-type tensor, one copy for the linears reading one tensor: q, k and v share one of
// the attention norm's output, o keeps one of the attention's output (which the attention keeps too), gate and up share
// one of the MLP norm's, down keeps one of the product. While a
// linear runs, its operands' FP8 copies and their transposes (nn/fp8_linear.hpp) are alive: at most, in the backward of
// the largest, dY and dY^T, x^T, W and W^T in FP8 and one scaled compute-type temporary.
constexpr i64 fp8_gemm_transient(const ModelShape& m, i64 tokens, i64 p_c) {
  i64 most = 0;
  for (auto l : m.block_linears()) {
    const i64 x = tokens * l.in, g = tokens * l.out, w = l.in * l.out;
    most = std::max(most, 2 * g + x + 2 * w + p_c * std::max({x, g, w}));
  }
  return most;
}
constexpr i64 activation_bytes(const ModelShape& m, const TrainShape& t, i64 p_c, int checkpoint_every, bool training,
                               i64 lora_rank_targets = 0, unsigned trained_linears = all_linears, bool fp8 = false) {
  const i64 tokens = t.micro_batch * t.seq;
  const i64 h = m.hidden;
  if (!training) return tokens * (2 * h + 2 * m.kv_dim() + 3 * m.ffn) * p_c + tokens * m.vocab * p_c;
  // The base is frozen under LoRA (norm gains, embedding and head too), also with adapters on every linear.
  const bool frozen = lora_rank_targets > 0 || trained_linears != all_linears;
  const auto trains = [trained_linears](unsigned mask) { return (trained_linears & mask) != 0; };
  const i64 kv = p_c >= 4 ? h : m.kv_dim();  // fp32 attention reads K/V repeated to every head
  const bool fused = t.fused_kernels;
  const i64 norm_fp32 = fused ? h * p_c + 4 : 4 * h + 4;     // the norm's input (unfused: in fp32) + reciprocal RMS
  const i64 pre_gain = frozen || fused ? 0 : h;              // normalised value kept by the unfused gain's product
  const i64 swiglu_inputs = fused ? 2 * m.ffn : 3 * m.ffn;   // gate, up (+ silu(gate) unfused)
  const i64 attn_norm = frozen && !trains(0x7u) ? 0 : h;     // kept by q, k, v
  const i64 mlp_norm = frozen && !trains(0x30u) ? 0 : h;     // kept by gate, up
  const i64 product = frozen && !trains(0x40u) ? 0 : m.ffn;  // silu(gate)·up, kept by down
  const i64 tile = t.mlp_tile_tokens > 0 && t.mlp_tile_tokens < tokens ? t.mlp_tile_tokens : 0;
  // The adapters' r values a token, split between the attention's and the MLP's linears (LoRA: trained_linears are its targets).
  const int adapted = std::popcount(trained_linears);
  const i64 lora_mlp = frozen && adapted > 0 ? lora_rank_targets * std::popcount(trained_linears & 0x70u) / adapted : 0;
  const bool fp8_copies = fp8 && !frozen;
  const i64 mlp_saved = norm_fp32 + (pre_gain + mlp_norm + swiglu_inputs + product + lora_mlp) * p_c +  // a token, untiled
                        (fp8_copies ? h + m.ffn - (mlp_norm + product) * p_c : 0);
  const i64 attention_saved = norm_fp32 + (pre_gain + attn_norm + 2 * h + 2 * kv + lora_rank_targets - lora_mlp) * p_c + m.heads * 4 +
                              (fp8_copies ? h + h - attn_norm * p_c : 0);
  const i64 fp8_transient = fp8 ? fp8_gemm_transient(m, tile > 0 ? std::min(tokens, tile) : tokens, p_c) : 0;
  const i64 block = tokens * (attention_saved + (tile > 0 ? h * p_c : mlp_saved));
  // A frozen head keeps nothing of the final norm's output; a frozen embedding gives block 0 an input that
  // needs no gradient, so its first norm keeps nothing.
  const i64 first_norm = frozen ? tokens * norm_fp32 : 0;
  // Chunked, each chunk's checkpoint keeps its rows of the final norm's output, also for a frozen head.
  const bool chunked = t.loss_chunk_tokens > 0 && t.loss_chunk_tokens < tokens;
  const i64 final_norm = tokens * (norm_fp32 + (pre_gain + (frozen && !chunked ? 0 : h)) * p_c);
  const i64 loss = loss_bytes(m, tokens, p_c, t.loss_chunk_tokens, !frozen);
  if (checkpoint_every == 0) return m.layers * block - first_norm + final_norm + std::max(loss, fp8_transient);
  // A frozen down projection kept no silu(gate)·up, so none is freed when its gradient arrives: one ffn more.
  const i64 mlp_backward = (h + 2 * m.ffn + (product == 0 ? m.ffn : 0)) * p_c;  // a token
  const i64 blocks_in_segment = (checkpoint_every < m.layers ? checkpoint_every : m.layers) * block;
  const i64 row = tokens * h * p_c;  // one [tokens, h] tensor
  const i64 tiled_mlp = row + (tokens - tile) * h * p_c + tile * (mlp_saved + mlp_backward);
  const i64 tiled_rest = std::max(3 * row, row + tokens * (2 * h + 2 * kv) * p_c);
  const i64 segment = blocks_in_segment + (tile == 0 ? tokens * mlp_backward : std::max(tiled_mlp, tiled_rest)) + fp8_transient;
  return ceil_div(m.layers, checkpoint_every) * tokens * h * p_c + final_norm + (loss > segment ? loss : segment);
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
    i64 block_packed = 0;  // one block's packed linears
    for (auto lin : m.block_linears()) block_packed += quantized_matrix_bytes<WQ>(lin.in, lin.out);
    i64 weights = m.unquantized_params() * p_c;
    weights += lora_params * p_m;  // adapters are trained in the master type (no separate master copy)
    if constexpr (S::stream_frozen_base) {
      // The packed blocks in host memory; on the device, the block in use and the ones prefetched (engine::FrozenUnits).
      plan.parameters.host = m.layers * block_packed;
      plan.parameters.device = weights + std::min<i64>(m.layers, 1 + std::max<i64>(0, t.prefetch_depth)) * block_packed;
    } else {
      weights += m.layers * block_packed;
      plan.parameters.device = S::stage >= 3 ? shard(weights) : weights;
    }
  } else {
    const i64 elements = m.params();  // shards are counted in elements, then bytes
    (S::stream_params ? plan.parameters.host : plan.parameters.device) =
        (S::stage >= 3 ? shard(elements) : elements) * p_c + lora_params * p_m;
  }

  if (trainable > 0) {
    // Gradients in the compute type (LoRA adapters: their own, master, type); accumulating mixed-precision
    // micro-batches sums into fp32. LoRA adapters are their own fp32 master: no copy, no accumulator.
    const i64 p_g = S::has_lora ? p_m : p_c;
    const bool master_copy = S::has_master_copy && !S::has_lora;
    const bool fp32_accumulator = S::accumulation_steps > 1 && master_copy;
    if constexpr (S::stream_params) {
      // Each pass's gradient goes to the host as it is reduced (the units in flight: communication below).
    } else if constexpr (S::stage >= 2) {
      plan.gradients.device = shard(trainable) * (fp32_accumulator ? 4 : p_g);
    } else {
      plan.gradients.device = trainable * p_g + (fp32_accumulator ? trainable * 4 : 0);
      const bool after_backward = effective_gradient_buffers(t.gradient_buffers, fp32_accumulator) == GradientBuffers::after_backward;
      // Made by backward: all of them, except what accumulates across micro-batches (the fp32 accumulator, or the
      // gradients themselves when there is no master copy). Attached at backward's start, they count there.
      if (after_backward && !(S::accumulation_steps > 1 && !fp32_accumulator)) plan.transient_gradients = trainable * p_g;
      // Collected at the window's end into a flat buffer allocated beside them (train::FlatParams::collect_grads);
      // an fp32 accumulator takes each micro-batch's instead and is counted above.
      if (after_backward && !fp32_accumulator) plan.gradient_collect = trainable * p_g;
    }
    const i64 owned = S::stage >= 1 ? shard(trainable) : trainable;  // optimizer-state shard
    const i64 master = master_copy ? owned * p_m : 0;
    const i64 state = S::state_bits == 32 ? owned * 8 : owned * 2 + 2 * ceil_div(owned, S::state_quantization::group) * 4;
    if constexpr (S::offload_to_host) {
      // The host update needs an fp32 copy, except of bf16 weights that are their own master (stochastic rounding).
      plan.master_weights.host = S::has_master_copy ? master : S::stochastic_rounding ? 0 : owned * 4;
      plan.optimizer_state.host = state;
      plan.gradients.host = owned * (fp32_accumulator ? 4 : p_g);  // the gradient shard streamed down for the CPU AdamW
      // Streamed and accumulating: a later micro-batch's part lands beside the sum before it is added.
      if (S::stream_params && S::accumulation_steps > 1) plan.gradients.host += owned * (fp32_accumulator ? 4 : p_g);
    } else {
      plan.master_weights.device = master;
      plan.optimizer_state.device = state;
    }
  }

  const i64 lora_act = S::has_lora ? S::lora_rank * std::popcount(L::targets) : 0;
  const unsigned trained = S::base_trainable ? all_linears : (S::has_lora ? unsigned(L::targets) : 0u);
  plan.activations.device = activation_bytes(m, t, p_c, S::checkpoint_every, S::training, lora_act, trained, S::fp8_gemms);
  // CheckpointOffload<Host>: every segment input has a host copy; the device holds the last checkpoint_prefetch of the
  // forward and, in backward, the one recomputing and as many prefetched. Int8: each stored as 8-bit codes + an fp32
  // scale per 256 values (on the device too, where kept there).
  if constexpr (S::checkpoint_offload::stores) {
    const i64 segments = ceil_div(m.layers, S::checkpoint_every);
    const i64 values = t.micro_batch * t.seq * m.hidden, input = values * p_c;
    const i64 stored = S::checkpoint_bits == 8 ? ceil_div(values, 256) * (256 + 4) : input;
    const i64 held = !S::checkpoints_on_host ? segments : t.checkpoint_prefetch + 1 < segments ? t.checkpoint_prefetch + 1 : segments;
    plan.activations.device -= segments * input - held * stored;
    if (S::checkpoints_on_host) plan.activations.host = segments * stored;
  }
  // A quantized base is read through one dequantized linear at a time where many rows multiply it (nn/quantized_linear.hpp,
  // nn/lora.hpp): the largest block linear's in·out values in the compute type, beside the activations.
  if constexpr (S::quantized_weights && S::training) {
    i64 largest = 0;
    for (auto lin : m.block_linears()) largest = std::max(largest, lin.in * lin.out);
    plan.activations.device += largest * p_c;
  }
  // Stage 3 with a chunked loss: the head's weight is gathered once and held from its forward until the last
  // chunk's backward (nn::Linear::full_weight), at any world size.
  if constexpr (S::stage >= 3 && S::training) {
    const i64 tokens = t.micro_batch * t.seq;
    if (S::base_trainable && t.loss_chunk_tokens > 0 && t.loss_chunk_tokens < tokens) plan.activations.device += m.vocab * m.hidden * p_c;
  }

  if (N > 1 || S::stream_params) {
    const i64 bucket = m.largest_gather_params() * p_c;
    if constexpr (S::stage >= 3)
      plan.communication.device = (2 + std::max<i64>(0, t.prefetch_depth)) * bucket;  // gathered, prefetched, grads to reduce
    else if constexpr (S::stage >= 1)
      plan.communication.device = S::training ? bucket : 0;
  }
  return plan;
}

// The MLP tile for a device of `device_bytes`: 0 (untiled) where the untiled step's planned peak fits it; else the
// largest of tokens/2, tokens/4, ... (rounded up to 256 tokens, down to 256) whose planned peak fits, or the
// smallest tried where none does (the caller's memory check then says by how much it is short). Tiling costs one
// more forward of each MLP, so it is chosen only where it is needed.
template <StrategyType S>
constexpr i64 pick_mlp_tile(const ModelShape& m, TrainShape t, int world, i64 device_bytes) {
  const i64 tokens = t.micro_batch * t.seq;
  t.mlp_tile_tokens = 0;
  if (plan_memory<S>(m, t, world).peak().device <= device_bytes) return 0;
  i64 tile = 0;
  for (i64 parts = 2; parts <= tokens; parts *= 2) {
    const i64 c = ceil_div(ceil_div(tokens, parts), 256) * 256;
    if (c >= tokens) continue;
    if (tile != 0 && c == tile) break;  // 256 tokens reached
    tile = c;
    t.mlp_tile_tokens = c;
    if (plan_memory<S>(m, t, world).peak().device <= device_bytes) return c;
  }
  return tile;
}

// Stages 0-1: the gradient buffer timing with the lower planned peak for these shapes (after_backward on a tie, and at
// stages 2-3, where it changes nothing; kept under Graphed, which the trainer always uses): at_backward where the
// activations backward starts with are fewer bytes than one gradient, e.g. a large model with checkpointing at a small
// batch, or accumulation without an fp32 accumulator.
template <StrategyType S>
constexpr GradientBuffers best_gradient_buffers(const ModelShape& m, TrainShape t, int world) {
  if constexpr (S::graphed) return GradientBuffers::kept;  // the trainer keeps them: its CUDA graph adds into fixed buffers
  t.gradient_buffers = GradientBuffers::after_backward;
  const i64 after = plan_memory<S>(m, t, world).peak().device;
  t.gradient_buffers = GradientBuffers::at_backward;
  const i64 at = plan_memory<S>(m, t, world).peak().device;
  return at < after ? GradientBuffers::at_backward : GradientBuffers::after_backward;
}

}  // namespace squeeze::plan
