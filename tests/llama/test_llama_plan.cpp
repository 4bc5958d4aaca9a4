// The planner against whole training runs on the CPU: the most bytes the CPU allocator had out during three
// optimizer steps, counted from before the model was built, beside plan_for<S>(...).peak() for the same strategy
// and shapes (on the CPU the planner's "device" is this memory; nothing is offloaded). The steps, not the
// construction: a LoRA strategy's dense float model is the user's, on the host, while a GPU trainer packs it, and
// the table's rows peak in training. The rows the strategy table measures on the GPU, at a geometry where
// parameters, optimizer state and activations all count.
#include <gtest/gtest.h>

#include <cstdio>
#include <optional>

#include "memory_meter.hpp"
#include "trainer.hpp"

namespace {

using namespace squeeze;
using squeeze::llama::LlamaRun;

nn::LlamaConfig plan_config() {
  nn::LlamaConfig c;  // GQA, a vocabulary the byte tokens fill, sizes that do not divide evenly
  c.name = "plan-test";
  c.vocab = 256, c.hidden = 160, c.layers = 4, c.heads = 4, c.kv_heads = 2, c.ffn = 424;
  return c;
}

struct Measured {
  int64_t peak = 0, planned = 0;
};

// gradient_buffers unset: the example's choice, the planner's lower peak (plan::best_gradient_buffers).
template <StrategyType S>
Measured measure(int64_t batch, int64_t seq, int64_t loss_chunk, bool fused = true,
                 std::optional<plan::GradientBuffers> gradient_buffers = {}, int64_t mlp_tile = 0) {
  nn::LlamaConfig c = plan_config();
  c.fused_kernels = fused;
  llama::TrainOptions o;
  o.loss_chunk_tokens = loss_chunk;
  o.gradient_buffers = gradient_buffers;
  o.mlp_tile_tokens = mlp_tile;
  torch::manual_seed(21);
  const torch::Tensor x = torch::randint(0, c.vocab, {batch, seq}, torch::kLong),
                      y = torch::randint(0, c.vocab, {batch, seq}, torch::kLong);
  squeeze::test::MemoryMeter meter;  // after the batch: the planner does not count the input tokens
  LlamaRun<S> trainer(c, o, torch::kCPU);
  squeeze::test::CountingCpuAllocator::reset_peak();
  for (int step = 0; step < 3; ++step) trainer.step(x, y);
  return {meter.peak_bytes(), int64_t(llama::plan_for<S>(c, batch, seq, 1, loss_chunk, gradient_buffers, mlp_tile).peak().device)};
}

// Bytes libtorch's CPU bf16 matmul [m, k] x [k, n] holds beyond its output while it runs (2.15 keeps an fp32 copy of
// the output; 0 where it does not): host scratch the device's GEMM has no counterpart of.
int64_t cpu_bf16_matmul_scratch(int64_t m, int64_t k, int64_t n) {
  const torch::Tensor a = torch::randn({m, k}).to(torch::kBFloat16), b = torch::randn({k, n}).to(torch::kBFloat16);
  squeeze::test::MemoryMeter meter;
  const torch::Tensor c = torch::matmul(a, b);
  return meter.peak_bytes() - int64_t(c.nbytes());
}

// The table's rows that train on one device without offload: within 10% of the plan, the fidelity issue's bound
// (bf16-accum4-ckpt at 125m was 18% off on the GPU); all are within 8% here, so that is the bound asserted. The
// q/v-adapter rows were 10.4-11.2% over until the planner counted the gradient of silu(gate)·up that a frozen
// down projection never saved (plan/memory.hpp's recomputed segment); bf16-ckpt at B=4, where the parameters
// dominate as at LLaMA-7B (12.6% over there on the GPU), 12.2% over until it counted the freed gradients beside the
// flat buffer they are collected into (MemoryPlan::gradient_collect). qlora-all (adapters on all seven linears) peaks
// inside the last block's down-projection backward, dY [576, 160] x W [160, 424], where libtorch 2.15's CPU matmul
// holds an fp32 copy of its [576, 424] output (8.3% over the plan with it, 5.8% under without): that scratch is
// measured and left out. bf16-ckpt (7.8% over) peaks in the same backward with the same scratch (3.3% without).
TEST(LlamaPlanPeak, TrainingRunsPeakWithinEightPercentOfThePlan) {
  const int64_t B = 8, T = 72;
  using QLoRA = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed>;
  std::vector<std::pair<const char*, Measured>> rows;
  rows.emplace_back("fp32", measure<Strategy<>>(B, T, 0));
  rows.emplace_back("bf16", measure<Strategy<Precision<bf16, float>>>(B, T, 0));
  rows.emplace_back("bf16-ckpt", measure<Strategy<Precision<bf16, float>, Checkpointed>>(B, T, 0));
  rows.emplace_back("bf16-ckpt B=4", measure<Strategy<Precision<bf16, float>, Checkpointed>>(B / 2, T, 0));  // peaks in the update
  rows.emplace_back("bf16-ckpt unfused", measure<Strategy<Precision<bf16, float>, Checkpointed>>(B, T, 0, false));
  rows.emplace_back("bf16-ckpt chunked", measure<Strategy<Precision<bf16, float>, Checkpointed>>(B, T, 96));
  rows.emplace_back("bf16-accum4-ckpt", measure<Strategy<Precision<bf16, float>, Accumulate<4>, Checkpointed>>(B, T, 0));
  rows.emplace_back("zero3-bf16-ckpt", measure<Strategy<Sharded<Stage3>, Precision<bf16, float>, Checkpointed>>(B, T, 0));
  rows.emplace_back("lora", measure<Strategy<LoRA<8, 16>, Precision<bf16, float>, Checkpointed>>(B, T, 0));
  rows.emplace_back("qlora", measure<QLoRA>(B, T, 0));
  rows.emplace_back("qlora B=16", measure<QLoRA>(2 * B, T, 0));
  rows.emplace_back("qlora unfused", measure<QLoRA>(B, T, 0, false));
  rows.emplace_back("qlora no ckpt", measure<Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>>>(B, T, 0));
  // MLPs in tiles of 100 of the 576 tokens (the last of 76)
  rows.emplace_back("bf16-ckpt tiled", measure<Strategy<Precision<bf16, float>, Checkpointed>>(B, T, 0, true, {}, 100));
  rows.emplace_back("qlora tiled", measure<QLoRA>(B, T, 0, true, {}, 100));
  rows.emplace_back(
      "qlora-all",
      measure<Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16, all_linears>, Precision<bf16, float>, Checkpointed>>(B, T, 0));
  const int64_t scratch = cpu_bf16_matmul_scratch(B * T, plan_config().hidden, plan_config().ffn);
  std::printf("[ measured ] CPU bf16 matmul scratch of [%lld, %lld]: %lld bytes\n", (long long)(B * T), (long long)plan_config().ffn,
              (long long)scratch);
  rows.back().second.peak -= scratch;
  for (const auto& [name, m] : rows) {
    std::printf("[ measured ] %-18s peak %9lld bytes, planned %9lld (peak / plan %.3f)\n", name, (long long)m.peak, (long long)m.planned,
                double(m.peak) / double(m.planned));
    EXPECT_NEAR(double(m.peak) / double(m.planned), 1.0, 0.08) << name;
  }
}

// Stages 0-1 where the parameters dominate (bf16-ckpt at B=1, as at LLaMA-7B): the example attaches the gradient
// buffer at backward's start (the planner's choice), one gradient lower than collecting it after backward; where
// activations dominate (bf16 at B=8) it collects after backward. Measured and planned alike.
TEST(LlamaPlanPeak, GradientBufferAtBackwardWhereParametersDominate) {
  using Bf16Ckpt = Strategy<Precision<bf16, float>, Checkpointed>;
  using Bf16 = Strategy<Precision<bf16, float>>;
  const int64_t T = 72;
  const nn::LlamaConfig c = plan_config();
  const plan::TrainShape small{1, T, plan::GradientBuffers::kept, 0}, large{8, T, plan::GradientBuffers::kept, 0};
  EXPECT_EQ(plan::best_gradient_buffers<Bf16Ckpt>(c.shape(), small, 1), plan::GradientBuffers::at_backward);
  EXPECT_EQ(plan::best_gradient_buffers<Bf16>(c.shape(), large, 1), plan::GradientBuffers::after_backward);
  const Measured after = measure<Bf16Ckpt>(1, T, 0, true, plan::GradientBuffers::after_backward);
  const Measured at = measure<Bf16Ckpt>(1, T, 0, true, plan::GradientBuffers::at_backward);
  const Measured chosen = measure<Bf16Ckpt>(1, T, 0);
  const int64_t one_gradient = c.shape().params() * 2;  // bf16
  std::printf(
      "[ measured ] bf16-ckpt B=1: after_backward peak %lld (plan %lld), at_backward %lld (plan %lld), chosen %lld; one gradient %lld\n",
      (long long)after.peak, (long long)after.planned, (long long)at.peak, (long long)at.planned, (long long)chosen.peak,
      (long long)one_gradient);
  EXPECT_NEAR(double(after.peak) / double(after.planned), 1.0, 0.08);
  EXPECT_NEAR(double(at.peak) / double(at.planned), 1.0, 0.08);
  EXPECT_EQ(chosen.planned, at.planned);
  EXPECT_LT(double(at.peak), double(after.peak) - 0.5 * double(one_gradient)) << "one gradient less, minus the activations";
  EXPECT_LT(at.planned, after.planned);
}

}  // namespace
