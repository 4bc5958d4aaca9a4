// The planner against the ZeRO paper's model-state figures (Adam, 16-bit compute, fp32 master: K = 12)
// and against hand counts of quantized storage and LLaMA activations.
#include <gtest/gtest.h>

#include <squeeze/squeeze.hpp>

using namespace squeeze;
using squeeze::plan::ceil_div;
using squeeze::plan::GradientBuffers;
using squeeze::plan::i64;
using squeeze::plan::ModelShape;
using squeeze::plan::plan_memory;
using squeeze::plan::TrainShape;

namespace {
constexpr ModelShape llama7b = *squeeze::plan::find_preset("llama-7b");
constexpr i64 Psi = llama7b.params();
constexpr TrainShape train{8, 2048};

template <class... Ps>
constexpr i64 model_state(int world) {
  return plan_memory<Strategy<Ps...>>(llama7b, train, world).model_state().device;
}
using Mixed = Precision<half, float>;
}  // namespace

// The planner runs at compile time: these are checked by the compiler.
static_assert(model_state<Mixed>(1) == 16 * Psi, "ZeRO baseline: 2Ψ + 2Ψ + 12Ψ");
static_assert(model_state<Mixed, Sharded<Stage1>>(8) == 4 * Psi + 12 * Psi / 8, "P_os: 4Ψ + 12Ψ/N");
static_assert(model_state<Mixed, Sharded<Stage2>>(8) == 2 * Psi + 14 * Psi / 8, "P_os+g: 2Ψ + 14Ψ/N");
static_assert(model_state<Mixed, Sharded<Stage3>>(8) == 16 * Psi / 8, "P_os+g+p: 16Ψ/N");
static_assert(model_state<>(1) == 16 * Psi, "fp32 Adam: 4Ψ params + 4Ψ grads + 8Ψ moments");

TEST(Plan, ZeroPaperFiguresAtEveryWorldSize) {
  // Ψ chosen divisible by every N below, so the paper's formulas hold exactly (no shard padding).
  constexpr ModelShape m{1024, 512, 4, 8, 8, 1536};
  const i64 psi = m.params();
  for (int n : {1, 2, 4, 8, 16, 64}) {
    ASSERT_EQ(psi % n, 0);
    const auto state = [&]<class S>(S*) { return plan_memory<S>(m, {1, 128}, n).model_state().device; };
    EXPECT_EQ(state((Strategy<Mixed>*)nullptr), 16 * psi) << n;
    EXPECT_EQ(state((Strategy<Mixed, Sharded<Stage1>>*)nullptr), 4 * psi + 12 * psi / n) << n;
    EXPECT_EQ(state((Strategy<Mixed, Sharded<Stage2>>*)nullptr), 2 * psi + 14 * psi / n) << n;
    EXPECT_EQ(state((Strategy<Mixed, Sharded<Stage3>>*)nullptr), 16 * psi / n) << n;
  }
}

TEST(Plan, ShardsArePaddedToEqualSize) {
  // 7 ranks do not divide Ψ: every rank holds ceil(Ψ/7) elements of each sharded state.
  const i64 shard = ceil_div(Psi, 7);
  ASSERT_NE(Psi % 7, 0);
  EXPECT_EQ((model_state<Mixed, Sharded<Stage3>>(7)), 16 * shard);
  EXPECT_EQ((model_state<Mixed, Sharded<Stage1>>(7)), 4 * Psi + 12 * shard);
}

TEST(Plan, OffloadMovesMasterAndMomentsToHost) {
  const auto p = plan_memory<Strategy<Mixed, Sharded<Stage3>, Offload<Host>>>(llama7b, train, 1);
  EXPECT_EQ(p.master_weights.device + p.optimizer_state.device, 0);
  EXPECT_EQ(p.master_weights.host, 4 * Psi);
  EXPECT_EQ(p.optimizer_state.host, 8 * Psi);
  EXPECT_EQ(p.gradients.host, 2 * Psi) << "the gradient shard is streamed down in its own type for the CPU AdamW";
  // Accumulating mixed-precision micro-batches sums into fp32 first: that is what goes down.
  const auto acc = plan_memory<Strategy<Mixed, Sharded<Stage3>, Offload<Host>, Accumulate<4>>>(llama7b, {2, 2048}, 1);
  EXPECT_EQ(acc.gradients.host, 4 * Psi);
  EXPECT_EQ(p.parameters.device + p.gradients.device, 4 * Psi);
}

TEST(Plan, Gptq4BitWeightsWithGroupScales) {
  // Hand count of the AutoGPTQ layout for q_proj of LLaMA-7B (4096 x 4096, group 128):
  // qweight 4096*4/32 x 4096 int32, qzeros 32 x 4096*4/32 int32, scales 32 x 4096 fp16, g_idx 4096 int32.
  constexpr i64 q_proj = 512 * 4096 * 4 + 32 * 512 * 4 + 32 * 4096 * 2 + 4096 * 4;
  static_assert(plan::quantized_matrix_bytes<Quantized<4, GPTQ, Group<128>>>(4096, 4096) == q_proj);
  // 3 bits straddle words: 4096*3/32 = 384 rows of qweight.
  static_assert(plan::quantized_matrix_bytes<Quantized<3, GPTQ, Group<128>>>(4096, 4096) ==
                384 * 4096 * 4 + 32 * 384 * 4 + 32 * 4096 * 2 + 4096 * 4);
  using G4 = Strategy<Quantized<4, GPTQ, Group<128>>, Inference, Precision<half, half>>;
  const auto p = plan_memory<G4>(llama7b, train, 1);
  i64 linears = 0;
  for (auto l : llama7b.block_linears()) linears += plan::quantized_matrix_bytes<Quantized<4, GPTQ, Group<128>>>(l.in, l.out);
  EXPECT_EQ(p.parameters.device, 32 * linears + 2 * llama7b.unquantized_params());
  EXPECT_EQ(p.gradients.device + p.optimizer_state.device + p.master_weights.device, 0);
  // ~4.25 bits per quantized weight: 3.9 GB against 13.5 GB in fp16.
  EXPECT_LT(double(p.parameters.device) / double(2 * Psi), 0.30);
  EXPECT_GT(double(p.parameters.device) / double(2 * Psi), 0.27);
}

TEST(Plan, Nf4DoubleQuantAndLoRA) {
  using NF = Quantized<4, NF4>;
  using NFdq = Quantized<4, NF4, DoubleQuant>;
  const i64 n = 4096 * 4096;
  EXPECT_EQ(plan::quantized_matrix_bytes<NF>(4096, 4096), n / 2 + n / 64 * 4);
  // codes, a nested code per block, an fp32 nested absmax per 256 blocks, the offset, the 256-entry map
  EXPECT_EQ(plan::quantized_matrix_bytes<NFdq>(4096, 4096), n / 2 + n / 64 + ceil_div(n / 64, 256) * 4 + 4 + 256 * 4);
  using QLoRA = Strategy<NFdq, LoRA<8, 16>, Precision<bf16, float>>;
  const auto p = plan_memory<QLoRA>(llama7b, train, 1);
  const i64 lora = 32 * (8 * (4096 + 4096) * 2);  // q and v: r·(in + out) each, 32 blocks
  EXPECT_EQ(p.trainable_params, lora);
  EXPECT_EQ(p.optimizer_state.device, 8 * lora);
  // The adapters are trained in fp32 (their own master, as nn::LoraTrainer keeps them): no copy, fp32 grads.
  EXPECT_EQ(p.master_weights.device, 0);
  EXPECT_EQ(p.gradients.device, 4 * lora);
  i64 nf4 = 0;
  for (auto l : llama7b.block_linears()) nf4 += 32 * plan::quantized_matrix_bytes<NFdq>(l.in, l.out);
  EXPECT_EQ(p.parameters.device, nf4 + 2 * llama7b.unquantized_params() + 4 * lora);
}

TEST(Plan, LlamaActivationsByHand) {
  // What squeeze::nn::Llama with the unfused ops keeps per token and block (16-bit compute, p_c = 2), tensor by tensor:
  //   2 RMSNorms: fp32 input (4h bytes) + fp32 reciprocal RMS (4) + pre-gain value (h) + output (h)
  //   q (h), k and v after RoPE (kv each: flash attention reads the shared GQA heads), attention output
  //   (h), log-sum-exp (fp32 per head); SwiGLU: gate, silu(gate), up, silu(gate)·up (4 ffn)
  constexpr ModelShape m{1000, 64, 3, 4, 2, 160};
  const TrainShape t{2, 16, GradientBuffers::kept, plan::kDefaultLossChunkTokens, /*fused_kernels=*/false};
  const i64 tokens = 32, kv = 2 * 16;
  const i64 norm = 4 * 64 + 4 + (64 + 64) * 2;
  const i64 block = tokens * (2 * norm + (64 + 2 * kv + 64 + 4 * 160) * 2 + 4 * 4);
  // Head: the final norm, and the loss at the start of backward: the fp32 log-softmax kept for backward,
  // the fp32 gradient arriving from nll_loss and the fp32 gradient log_softmax's backward writes (3·V·4).
  const i64 final_norm = tokens * norm;
  const i64 loss = tokens * 3 * 1000 * 4;
  EXPECT_EQ(plan::activation_bytes(m, t, 2, 0, true), 3 * block + final_norm + loss);
  // Checkpointing keeps each segment's input; a segment is recomputed after the loss's transient is gone.
  ASSERT_GT(loss, 2 * block + tokens * (64 + 2 * 160) * 2);
  EXPECT_EQ(plan::activation_bytes(m, t, 2, 1, true), 3 * tokens * 64 * 2 + final_norm + loss);
  EXPECT_EQ(plan::activation_bytes(m, t, 2, 2, true), 2 * tokens * 64 * 2 + final_norm + loss);
  // A segment larger than the loss's transient is the checkpointed peak.
  constexpr ModelShape small_vocab{16, 64, 3, 4, 2, 160};
  const i64 small_loss = tokens * 3 * 16 * 4;
  ASSERT_LT(small_loss, block);
  // Its backward also holds the gradient arriving at it (h) and, in the MLP's backward, two [ffn] gradients more.
  const i64 segment_backward = tokens * (64 + 2 * 160) * 2;
  EXPECT_EQ(plan::activation_bytes(small_vocab, t, 2, 3, true), 1 * tokens * 64 * 2 + final_norm + 3 * block + segment_backward);
  // fp32 compute: the memory-efficient kernel reads K/V repeated to every query head (h each, not kv), and
  // the norms' fp32 input is the input itself (still 4h bytes).
  const i64 norm32 = 4 * 64 + 4 + (64 + 64) * 4;
  const i64 block32 = tokens * (2 * norm32 + (64 + 2 * 64 + 64 + 4 * 160) * 4 + 4 * 4);
  // At fp32 and 32 tokens the head's product backward (the logits' fp32 gradient, the head's new weight gradient
  // and the hidden states' gradient) outweighs the log-softmax moment.
  const i64 product32 = (tokens * 1000 + tokens * 64) * 4 + 1000 * 64 * 4;
  ASSERT_GT(product32, loss);
  EXPECT_EQ(plan::activation_bytes(m, t, 4, 0, true), 3 * block32 + tokens * norm32 + product32);
  // Accumulation with the same tokens per step: each micro-batch holds 1/4 of the activations' tokens
  // (with the loss unchunked: a chunked loss's transient does not grow with the tokens, see ChunkedLossByHand).
  using A4 = Strategy<Accumulate<4>>;
  const auto big = plan_memory<Strategy<>>(llama7b, {8, 2048, GradientBuffers::kept, 0}, 1);
  const auto small = plan_memory<A4>(llama7b, {2, 2048, GradientBuffers::kept, 0}, 1);
  EXPECT_EQ(small.activations.device * 4, big.activations.device);
}

TEST(Plan, FusedKernelsActivationsByHand) {
  // The fused RMSNorm keeps its input (h) and fp32 reciprocal RMS (4), the output (h) is kept by the projections;
  // the fused SwiGLU keeps gate and up (silu recomputed) and the product (3 ffn). Attention as unfused.
  constexpr ModelShape m{1000, 64, 3, 4, 2, 160};
  const TrainShape fused{2, 16};
  static_assert(TrainShape{}.fused_kernels, "the planner's default is the model's: fused kernels on");
  const TrainShape unfused{2, 16, GradientBuffers::kept, plan::kDefaultLossChunkTokens, false};
  const i64 tokens = 32, kv = 2 * 16;
  const i64 norm = 64 * 2 + 4 + 64 * 2;
  const i64 block = tokens * (2 * norm + (64 + 2 * kv + 64 + 3 * 160) * 2 + 4 * 4);
  const i64 loss = tokens * 3 * 1000 * 4;
  EXPECT_EQ(plan::activation_bytes(m, fused, 2, 0, true), 3 * block + tokens * norm + loss);
  // Per token and block the fused ops keep 8h bytes fewer (two fp32 norm inputs against two 16-bit ones, two
  // pre-gain values) and one ffn value fewer; the final norm 4h bytes fewer. TinyLlama-1.1B at B=8, T=2048 in bf16
  // keeps 10.0 GB less (the H200's measured peaks: bf16 48.85 planned unfused against 38.81 measured fused).
  EXPECT_EQ(plan::activation_bytes(m, unfused, 2, 0, true) - plan::activation_bytes(m, fused, 2, 0, true),
            3 * tokens * (8 * 64 + 160 * 2) + tokens * 4 * 64);
  constexpr ModelShape tiny = *squeeze::plan::find_preset("tinyllama-1.1b");
  const i64 saved = plan::activation_bytes(tiny, {8, 2048, GradientBuffers::kept, 4096, false}, 2, 0, true) -
                    plan::activation_bytes(tiny, {8, 2048, GradientBuffers::kept, 4096, true}, 2, 0, true);
  EXPECT_NEAR(double(saved), 10.0e9, 0.1e9);
}

TEST(Plan, ChunkedLossByHand) {
  // nn::Llama's loss over chunks of c tokens (B·T = 2·37 = 74 tokens, c = 16: four chunks of 16 and one of 10).
  constexpr ModelShape m{1000, 64, 3, 4, 2, 160};
  const i64 tokens = 74, V = 1000, h = 64;
  const TrainShape whole{2, 37, GradientBuffers::kept, 0}, chunked{2, 37, GradientBuffers::kept, 16};
  const i64 unchunked_loss = 12 * tokens * V;  // fp32 log-softmax + the two fp32 gradients of its backward
  EXPECT_EQ(plan::loss_bytes(m, tokens, 2, 0, true), unchunked_loss);
  // One chunk's: the same 12·c·V; beside it the head's weight gradient summed over the chunks done (V·h·p_c) and
  // the hidden states' gradients of those chunks ((n - c)·h·p_c).
  const i64 chunk_loss = 12 * 16 * V + V * h * 2 + (tokens - 16) * h * 2;
  ASSERT_GT(12 * 16 * V, (16 * V + 16 * h) * 2 + V * h * 2) << "the log-softmax moment is this chunk's larger one";
  EXPECT_EQ(plan::loss_bytes(m, tokens, 2, 16, true), chunk_loss);
  EXPECT_EQ(plan::activation_bytes(m, chunked, 2, 0, true) - plan::activation_bytes(m, whole, 2, 0, true), chunk_loss - unchunked_loss);
  EXPECT_EQ(plan::activation_bytes(m, chunked, 2, 1, true) - plan::activation_bytes(m, whole, 2, 1, true), chunk_loss - unchunked_loss)
      << "checkpointed: the chunked loss is still larger than one block";
  // A one-token chunk: the head's product backward (logits' gradient, new weight gradient, hidden gradient) is larger.
  EXPECT_EQ(plan::loss_bytes(m, tokens, 2, 1, true), (V + h) * 2 + V * h * 2 + V * h * 2 + (tokens - 1) * h * 2);
  // A chunk of all the tokens or more is the unchunked loss; so is a chunk <= 0.
  for (i64 c : {i64(74), i64(75), i64(4096), i64(0), i64(-3)}) EXPECT_EQ(plan::loss_bytes(m, tokens, 2, c, true), unchunked_loss) << c;
  // A frozen head (LoRA): no weight gradient; the chunks' checkpoints keep the final norm's output (h·p_c per token).
  const unsigned qv = 0x1u | 0x4u;
  const i64 frozen_chunk = 12 * 16 * V + (tokens - 16) * h * 2;
  EXPECT_EQ(plan::activation_bytes(m, chunked, 2, 0, true, 16, qv) - plan::activation_bytes(m, whole, 2, 0, true, 16, qv),
            frozen_chunk - unchunked_loss + tokens * h * 2);
  // Stage 3: the head's gathered weight is held across the chunks.
  using Z3 = Strategy<Sharded<Stage3>, Precision<bf16, float>>;
  EXPECT_EQ(plan_memory<Z3>(m, chunked, 2).activations.device, plan::activation_bytes(m, chunked, 2, 0, true) + V * h * 2);
  EXPECT_EQ(plan_memory<Z3>(m, whole, 2).activations.device, plan::activation_bytes(m, whole, 2, 0, true));
  // The default, TinyLlama-1.1B at B=8, T=2048 (16,384 tokens): the loss's transient goes from 6.3 GB to under 1.8 GB.
  static_assert(TrainShape{}.loss_chunk_tokens == plan::kDefaultLossChunkTokens);
  constexpr ModelShape tiny = *squeeze::plan::find_preset("tinyllama-1.1b");
  EXPECT_EQ(plan::loss_bytes(tiny, 16384, 2, 0, true), 6'291'456'000);
  EXPECT_EQ(plan::loss_bytes(tiny, 16384, 2, plan::kDefaultLossChunkTokens, true),
            12 * 4096 * i64(32000) + 32000 * 2048 * 2 + (16384 - 4096) * 2048 * 2);
  EXPECT_LT(plan::loss_bytes(tiny, 16384, 2, plan::kDefaultLossChunkTokens, true), i64(1'800'000'000));
}

TEST(Plan, FrozenBaseKeepsLessForBackward) {
  // LoRA on q and v over a frozen base: a norm's gain needs no gradient (no pre-gain value), the MLP norm's
  // output feeds only frozen gate/up (not kept), silu(gate)·up feeds a frozen down (not kept); the adapters
  // keep x·A^T (r values) each.
  constexpr ModelShape m{1000, 64, 3, 4, 2, 160};
  const TrainShape t{2, 16, GradientBuffers::kept, plan::kDefaultLossChunkTokens, /*fused_kernels=*/false};
  const i64 tokens = 32, kv = 2 * 16, r = 8;
  const unsigned qv = 0x1u | 0x4u;
  const i64 norm = 4 * 64 + 4;
  const i64 block = tokens * (2 * norm + (64 /* attn norm out */ + 64 + 2 * kv + 64 + 3 * 160 + 2 * r) * 2 + 4 * 4);
  // The frozen head keeps nothing of the final norm's output; block 0's first norm reads the frozen
  // embedding's output, which needs no gradient: it keeps nothing.
  const i64 final_norm = tokens * norm;
  EXPECT_EQ(plan::activation_bytes(m, t, 2, 0, true, 2 * r, qv), 3 * block - tokens * norm + final_norm + tokens * 3 * 1000 * 4);
  // The same through plan_memory: QLoRA's activations are below full training's.
  using QLoRA = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>>;
  using Full = Strategy<Precision<bf16, float>>;
  EXPECT_LT((plan_memory<QLoRA>(llama7b, train, 1).activations.device), (plan_memory<Full>(llama7b, train, 1).activations.device));
}

TEST(Plan, LoRAOnEveryLinearStillFreezesTheBase) {
  // Adapters on all seven linears: every norm output and silu(gate)·up is kept (they feed adapters), but the base
  // stays frozen: no pre-gain value, nothing of the frozen head's input, block 0's first norm keeps nothing.
  constexpr ModelShape m{1000, 64, 3, 4, 2, 160};
  const TrainShape t{2, 16, GradientBuffers::kept, plan::kDefaultLossChunkTokens, /*fused_kernels=*/false};
  const i64 tokens = 32, kv = 2 * 16, r = 8;
  const i64 norm = 4 * 64 + 4;
  const i64 block = tokens * (2 * norm + (64 + 64 + 2 * 64 + 2 * kv + 3 * 160 + 160 + 7 * r) * 2 + 4 * 4);
  const i64 final_norm = tokens * norm;
  EXPECT_EQ(plan::activation_bytes(m, t, 2, 0, true, 7 * r, all_linears), 3 * block - tokens * norm + final_norm + tokens * 3 * 1000 * 4);
  using QLoRAAll = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16, all_linears>, Precision<bf16, float>>;
  using QLoRA = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>>;
  const auto all = plan_memory<QLoRAAll>(llama7b, train, 1);
  i64 lora = 0;
  for (auto l : llama7b.block_linears()) lora += 32 * 8 * (l.in + l.out);
  EXPECT_EQ(all.trainable_params, lora);
  EXPECT_GT(all.activations.device, (plan_memory<QLoRA>(llama7b, train, 1).activations.device));
  EXPECT_LT(all.activations.device, (plan_memory<Strategy<Precision<bf16, float>>>(llama7b, train, 1).activations.device));
}

TEST(Plan, PeakIsBackwardStartOrOptimizerStep) {
  using Bf16 = Strategy<Precision<bf16, float>>;
  const auto kept = plan_memory<Bf16>(llama7b, {1, 2048}, 1);
  EXPECT_EQ(kept.transient_gradients, 0);
  // With the gradients kept, the activations come on top of the whole model state.
  EXPECT_EQ(kept.peak().device, kept.total().device);
  // Freed between steps: none exist at the start of backward; the optimizer step has all of them.
  using Bf16Ckpt = Strategy<Precision<bf16, float>, Checkpointed>;
  const auto freed = plan_memory<Bf16Ckpt>(llama7b, {1, 2048, GradientBuffers::after_backward}, 1);
  EXPECT_EQ(freed.transient_gradients, 2 * Psi);
  EXPECT_EQ(freed.model_state().device, 16 * Psi) << "the categories do not change, only what is live when";
  ASSERT_GT(freed.activations.device, 0);
  ASSERT_LT(freed.activations.device, Psi);  // checkpointed B=1: far fewer activation bytes than gradient bytes
  EXPECT_EQ(freed.gradient_collect, 2 * Psi);
  EXPECT_EQ(freed.peak().device, 18 * Psi) << "the optimizer step is the peak: the freed gradients beside the flat buffer they move into";
  const auto big = plan_memory<Bf16>(llama7b, {8, 2048, GradientBuffers::after_backward}, 1);
  ASSERT_GT(big.activations.device, 2 * Psi);
  EXPECT_EQ(big.peak().device, 14 * Psi + big.activations.device) << "the start of backward is the peak";
  // Accumulating: the fp32 accumulator lives through the micro-batches; the bf16 gradients come and go.
  const auto acc = plan_memory<Strategy<Precision<bf16, float>, Accumulate<4>>>(llama7b, {2, 2048, GradientBuffers::after_backward}, 1);
  EXPECT_EQ(acc.transient_gradients, 2 * Psi);
  EXPECT_EQ(acc.peak().device, 18 * Psi + acc.activations.device);
  EXPECT_EQ(acc.gradient_collect, 0) << "each micro-batch's gradients go into the fp32 accumulator, counted as kept";
  // fp32 accumulation sums into the gradients themselves: nothing is transient, but they too are collected.
  EXPECT_EQ((plan_memory<Strategy<Accumulate<4>>>(llama7b, {2, 2048, GradientBuffers::after_backward}, 1).transient_gradients), 0);
  EXPECT_EQ((plan_memory<Strategy<Accumulate<4>>>(llama7b, {2, 2048, GradientBuffers::after_backward}, 1).gradient_collect), 4 * Psi);
  EXPECT_EQ(kept.gradient_collect, 0) << "gradients kept between steps are the flat buffer's views";
  // Attached at the start of backward: nothing transient, nothing collected; the buffer sits beside the activations,
  // so the checkpointed B=1 step peaks at the model state plus its activations, under the collecting one.
  const auto at = plan_memory<Bf16Ckpt>(llama7b, {1, 2048, GradientBuffers::at_backward}, 1);
  EXPECT_EQ(at.transient_gradients, 0);
  EXPECT_EQ(at.gradient_collect, 0);
  EXPECT_EQ(at.peak().device, 16 * Psi + at.activations.device);
  EXPECT_LT(at.peak().device, freed.peak().device);
  EXPECT_EQ(plan::best_gradient_buffers<Bf16Ckpt>(llama7b, {1, 2048}, 1), GradientBuffers::at_backward);
  EXPECT_EQ(plan::best_gradient_buffers<Bf16Ckpt>(llama7b, {8, 2048}, 1), GradientBuffers::at_backward)
      << "activations < 2 bytes a parameter";
  EXPECT_EQ(plan::best_gradient_buffers<Bf16>(llama7b, {8, 2048}, 1), GradientBuffers::after_backward) << "activations dominate";
  // With an fp32 accumulator each micro-batch's gradients go into it after backward whichever timing is asked.
  const auto acc_at = plan_memory<Strategy<Precision<bf16, float>, Accumulate<4>>>(llama7b, {2, 2048, GradientBuffers::at_backward}, 1);
  EXPECT_EQ(acc_at.peak().device, acc.peak().device);
  EXPECT_EQ(acc_at.transient_gradients, acc.transient_gradients);
  // Sharded trainers keep flat gradient buffers: the flag does not apply.
  EXPECT_EQ(
      (plan_memory<Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>>>(llama7b, {8, 2048, GradientBuffers::after_backward}, 1)
           .transient_gradients),
      0);
  EXPECT_EQ(
      (plan_memory<Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>>>(llama7b, {8, 2048, GradientBuffers::after_backward}, 1)
           .gradient_collect),
      0);
  // Host memory is persistent.
  const auto off = plan_memory<Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>>>(llama7b, train, 1);
  EXPECT_EQ(off.peak().host, 14 * Psi) << "fp32 master and moments, bf16 gradient shard";
}

TEST(Plan, CommunicationBuffersOnlyWhenSharded) {
  EXPECT_EQ((plan_memory<Strategy<Mixed, Sharded<Stage3>>>(llama7b, train, 1).communication.device), 0);
  const i64 block = llama7b.block_params() * 2;
  EXPECT_EQ((plan_memory<Strategy<Mixed, Sharded<Stage3>>>(llama7b, train, 8).communication.device), 3 * block);
  EXPECT_EQ((plan_memory<Strategy<Mixed, Sharded<Stage2>>>(llama7b, train, 8).communication.device), block);
  EXPECT_EQ((plan_memory<Strategy<Mixed>>(llama7b, train, 8).communication.device), 0);
  // Each unit prefetched beyond the first holds one more block; none prefetched, two (the running one and the reduction).
  TrainShape deeper = train, none = train;
  deeper.prefetch_depth = 3, none.prefetch_depth = 0;
  EXPECT_EQ((plan_memory<Strategy<Mixed, Sharded<Stage3>>>(llama7b, deeper, 8).communication.device), 5 * block);
  EXPECT_EQ((plan_memory<Strategy<Mixed, Sharded<Stage3>>>(llama7b, none, 8).communication.device), 2 * block);
}

TEST(Plan, MixedPrecisionAccumulationSumsInFp32) {
  // Accumulating fp16 micro-batch gradients: fp16 grads plus an fp32 accumulator (stage 0).
  const auto p = plan_memory<Strategy<Mixed, Accumulate<4>>>(llama7b, {2, 2048}, 1);
  EXPECT_EQ(p.gradients.device, 2 * Psi + 4 * Psi);
  const auto z2 = plan_memory<Strategy<Mixed, Accumulate<4>, Sharded<Stage2>>>(llama7b, {2, 2048}, 4);
  EXPECT_EQ(z2.gradients.device, 4 * ceil_div(Psi, 4));
}
