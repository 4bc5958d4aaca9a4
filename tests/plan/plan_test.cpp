// The planner against the ZeRO paper's model-state figures (Adam, 16-bit compute, fp32 master: K = 12)
// and against hand counts of quantized storage and LLaMA activations.
#include <gtest/gtest.h>

#include <squeeze/squeeze.hpp>

using namespace squeeze;
using squeeze::plan::ceil_div;
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
  EXPECT_EQ(p.gradients.host, 4 * Psi) << "an fp32 gradient shard is streamed down for the CPU AdamW";
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
  EXPECT_EQ(plan::quantized_matrix_bytes<NFdq>(4096, 4096), n / 2 + n / 64 + ceil_div(n / 64, 256) * 4 + 4);
  using QLoRA = Strategy<NFdq, LoRA<8, 16>, Precision<bf16, float>>;
  const auto p = plan_memory<QLoRA>(llama7b, train, 1);
  const i64 lora = 32 * (8 * (4096 + 4096) * 2);  // q and v: r·(in + out) each, 32 blocks
  EXPECT_EQ(p.trainable_params, lora);
  EXPECT_EQ(p.optimizer_state.device, 8 * lora);
  EXPECT_EQ(p.master_weights.device, 4 * lora);
  EXPECT_EQ(p.gradients.device, 2 * lora);
}

TEST(Plan, LlamaActivationsByHand) {
  // One block saves 6h + 2kv + 3ffn values per token in the compute type, plus fp32 (2 + heads).
  constexpr ModelShape m{1000, 64, 3, 4, 2, 160};
  const TrainShape t{2, 16};
  const i64 tokens = 32, kv = 2 * 16;
  const i64 block = tokens * ((6 * 64 + 2 * kv + 3 * 160) * 2 + (2 + 4) * 4);
  const i64 head = tokens * (2 * 64 * 2 + 4 + 1000 * (2 + 4));
  EXPECT_EQ(plan::activation_bytes(m, t, 2, 0, true), 3 * block + head);
  // Checkpointing keeps each block's input and recomputes one block at a time.
  EXPECT_EQ(plan::activation_bytes(m, t, 2, 1, true), 3 * tokens * 64 * 2 + block + head);
  EXPECT_EQ(plan::activation_bytes(m, t, 2, 2, true), 2 * tokens * 64 * 2 + 2 * block + head);
  // Accumulation with the same tokens per step: each micro-batch holds 1/4 of the activations' tokens.
  using A4 = Strategy<Accumulate<4>>;
  const auto big = plan_memory<Strategy<>>(llama7b, {8, 2048}, 1);
  const auto small = plan_memory<A4>(llama7b, {2, 2048}, 1);
  EXPECT_EQ(small.activations.device * 4, big.activations.device);
}

TEST(Plan, CommunicationBuffersOnlyWhenSharded) {
  EXPECT_EQ((plan_memory<Strategy<Mixed, Sharded<Stage3>>>(llama7b, train, 1).communication.device), 0);
  const i64 block = llama7b.block_params() * 2;
  EXPECT_EQ((plan_memory<Strategy<Mixed, Sharded<Stage3>>>(llama7b, train, 8).communication.device), 3 * block);
  EXPECT_EQ((plan_memory<Strategy<Mixed, Sharded<Stage2>>>(llama7b, train, 8).communication.device), block);
  EXPECT_EQ((plan_memory<Strategy<Mixed>>(llama7b, train, 8).communication.device), 0);
}

TEST(Plan, MixedPrecisionAccumulationSumsInFp32) {
  // Accumulating fp16 micro-batch gradients: fp16 grads plus an fp32 accumulator (stage 0).
  const auto p = plan_memory<Strategy<Mixed, Accumulate<4>>>(llama7b, {2, 2048}, 1);
  EXPECT_EQ(p.gradients.device, 2 * Psi + 4 * Psi);
  const auto z2 = plan_memory<Strategy<Mixed, Accumulate<4>, Sharded<Stage2>>>(llama7b, {2, 2048}, 4);
  EXPECT_EQ(z2.gradients.device, 4 * ceil_div(Psi, 4));
}
