// The LLaMA model (RMSNorm, RoPE, grouped-query causal attention against float64 references), its presets
// against the planner's, and the strategy trainer: every compiled strategy lowers the loss on CPU, parities
// with the fp32 baseline, fp16 overflow handling, checkpoint round trips and bad checkpoints.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <thread>
#include <unistd.h>

#include "memory_meter.hpp"
#include "trainer.hpp"
#include "squeeze/io/posix_file.hpp"

namespace {

// Tiny models gain nothing from more threads, and OpenMP threads that spin on a busy CI machine lose a lot.
const bool one_thread = (torch::set_num_threads(1), true);

using squeeze::nn::LlamaConfig;
using namespace squeeze::llama;

LlamaConfig small_config() {
  LlamaConfig c;  // small enough for a CPU test, with GQA (4 query heads over 2 key/value heads)
  c.name = "test";
  c.vocab = 256, c.hidden = 32, c.layers = 3, c.heads = 4, c.kv_heads = 2, c.ffn = 88;
  return c;
}

// ---- presets --------------------------------------------------------------------------------------------
TEST(LlamaConfig, PresetsMatchThePlanner) {
  for (const char* name : {"tinyllama-1.1b", "llama-7b", "llama-13b", "llama3-8b", "llama-70b", "llama-175b"}) {
    const auto shape = LlamaConfig::preset(name).shape();
    const auto want = *squeeze::plan::find_preset(name);
    EXPECT_EQ(shape.vocab, want.vocab) << name;
    EXPECT_EQ(shape.hidden, want.hidden) << name;
    EXPECT_EQ(shape.layers, want.layers) << name;
    EXPECT_EQ(shape.heads, want.heads) << name;
    EXPECT_EQ(shape.kv_heads, want.kv_heads) << name;
    EXPECT_EQ(shape.ffn, want.ffn) << name;
    EXPECT_EQ(shape.params(), want.params()) << name;
  }
  EXPECT_NEAR(double(LlamaConfig::preset("125m").shape().params()), 134e6, 2e6);
}

TEST(LlamaConfig, ModuleParameterCountIsThePlannersCount) {
  for (const auto& c : {LlamaConfig::preset("tiny"), small_config()}) {
    squeeze::nn::Llama model(c);
    int64_t n = 0;
    for (const auto& p : model->parameters()) n += p.numel();
    EXPECT_EQ(n, c.shape().params()) << c.name;
  }
}

TEST(LlamaConfig, RejectsUnknownPresetAndBadGeometry) {
  try {
    LlamaConfig::preset("llama-9b");
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown LLaMA preset 'llama-9b'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("tinyllama-1.1b"), std::string::npos);
  }
  LlamaConfig c = small_config();
  c.kv_heads = 3;
  EXPECT_THROW(squeeze::nn::Llama{c}, c10::Error);
  c = small_config();
  EXPECT_THROW(squeeze::nn::Llama(c)->forward(torch::zeros({2, 3}, torch::kInt)), c10::Error);  // ids must be int64
}

// ---- components against float64 references ----------------------------------------------------------------
TEST(LlamaModel, RMSNormMatchesReference) {
  torch::manual_seed(1);
  squeeze::nn::RMSNorm norm(37, 1e-5);
  norm->to(torch::kFloat64);
  {
    torch::NoGradGuard g;
    norm->weight.uniform_(0.5, 1.5);
  }
  const torch::Tensor x = torch::randn({3, 5, 37}, torch::kFloat64) * 3;
  const torch::Tensor ref = x / (x.pow(2).mean(-1, true) + 1e-5).sqrt() * norm->weight;
  // The norm computes its statistics in float (as in mixed precision): float's precision is the bound.
  EXPECT_LE((norm(x) - ref).abs().max().item<double>(), 1e-5);
}

TEST(LlamaModel, RopeIsARotationThatDependsOnRelativePosition) {
  torch::manual_seed(2);
  const int64_t T = 12, D = 16;
  const auto [cos, sin] = squeeze::nn::rope_tables(T + 5, D, 10000.0, torch::kCPU);
  const torch::Tensor q = torch::randn({1, 1, 1, D}, torch::kFloat64), k = torch::randn({1, 1, 1, D}, torch::kFloat64);
  const auto at = [&, &cos = cos, &sin = sin](const torch::Tensor& v, int64_t pos) {
    return squeeze::nn::apply_rope(v, cos[pos].to(torch::kFloat64), sin[pos].to(torch::kFloat64));
  };
  // Norm preserved.
  EXPECT_NEAR(at(q, 7).norm().item<double>(), q.norm().item<double>(), 1e-6);
  // Position 0 is the identity.
  EXPECT_LE((at(q, 0) - q).abs().max().item<double>(), 1e-12);
  // <rope(q, m), rope(k, n)> depends on m - n only.
  const double a = (at(q, 9) * at(k, 4)).sum().item<double>();
  const double b = (at(q, 5) * at(k, 0)).sum().item<double>();
  const double c = (at(q, 16) * at(k, 11)).sum().item<double>();
  EXPECT_NEAR(a, b, 1e-5);
  EXPECT_NEAR(a, c, 1e-5);
  EXPECT_GT(std::abs(a - (at(q, 9) * at(k, 3)).sum().item<double>()), 1e-4);  // and it does depend on it
}

TEST(LlamaModel, AttentionMatchesExplicitCausalSoftmax) {
  torch::manual_seed(3);
  const LlamaConfig c = small_config();
  squeeze::nn::Attention attn(c);
  attn->to(torch::kFloat64);
  const int64_t B = 2, T = 9, H = c.heads, Hkv = c.kv_heads, D = c.head_dim();
  const torch::Tensor x = torch::randn({B, T, c.hidden}, torch::kFloat64);
  const auto [cos32, sin32] = squeeze::nn::rope_tables(T, D, c.rope_theta, torch::kCPU);
  const torch::Tensor cos = cos32.to(torch::kFloat64), sin = sin32.to(torch::kFloat64);
  const torch::Tensor got = attn->forward(x, cos, sin);  // [B, T, h]

  // Reference: explicit scores, mask, softmax; key/value head j serves query heads j*H/Hkv .. (j+1)*H/Hkv-1.
  torch::Tensor q = torch::matmul(x, attn->q->weight.t()).view({B, T, H, D}).transpose(1, 2);
  torch::Tensor k = torch::matmul(x, attn->k->weight.t()).view({B, T, Hkv, D}).transpose(1, 2);
  torch::Tensor v = torch::matmul(x, attn->v->weight.t()).view({B, T, Hkv, D}).transpose(1, 2);
  q = squeeze::nn::apply_rope(q, cos, sin);
  k = squeeze::nn::apply_rope(k, cos, sin);
  const torch::Tensor group = torch::arange(H, torch::kLong).div(H / Hkv, "floor");
  k = k.index_select(1, group), v = v.index_select(1, group);                           // [B, H, T, D]
  torch::Tensor scores = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(double(D));  // [B, H, T, T]
  const torch::Tensor future = torch::ones({T, T}, torch::kBool).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  const torch::Tensor ctx = torch::matmul(torch::softmax(scores, -1), v).transpose(1, 2).reshape({B, T, H * D});
  const torch::Tensor ref = torch::matmul(ctx, attn->o->weight.t());
  EXPECT_LE((got - ref).abs().max().item<double>(), 1e-10);
}

TEST(LlamaModel, FutureTokensDoNotChangeEarlierLogits) {
  torch::manual_seed(4);
  squeeze::nn::Llama model(small_config());
  model->to(torch::kFloat64);
  model->eval();
  torch::NoGradGuard g;
  const int64_t T = 13, cut = 6;
  const torch::Tensor a = torch::randint(0, 256, {2, T}, torch::kLong);
  torch::Tensor b = a.clone();
  b.narrow(1, cut, T - cut).random_(0, 256);
  ASSERT_FALSE(torch::equal(a, b));
  const torch::Tensor la = model(a), lb = model(b);  // [2, T, V]
  EXPECT_LE((la.narrow(1, 0, cut) - lb.narrow(1, 0, cut)).abs().max().item<double>(), 1e-12);
  EXPECT_GT((la.narrow(1, cut, T - cut) - lb.narrow(1, cut, T - cut)).abs().max().item<double>(), 1e-6);
}

TEST(LlamaModel, CheckpointedModelHasTheSameGradients) {
  torch::manual_seed(5);
  squeeze::nn::Llama model(small_config());
  model->to(torch::kFloat64);
  const torch::Tensor x = torch::randint(0, 256, {2, 10}, torch::kLong), y = torch::randint(0, 256, {2, 10}, torch::kLong);
  const auto grads = [&](int64_t every) {
    model->zero_grad();
    model->checkpoint_every = every;
    model->loss(x, y).backward();
    std::vector<torch::Tensor> g;
    for (auto& p : model->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  const auto plain = grads(0);
  for (int64_t every : {1, 2, 3}) {
    const auto ck = grads(every);
    for (size_t i = 0; i < plain.size(); ++i) EXPECT_LE((plain[i] - ck[i]).abs().max().item<double>(), 1e-12) << every << " " << i;
  }
}

// ---- the chunked loss (head + cross-entropy over token chunks, each recomputed in backward) -------------------
// The loss and every parameter's gradient (as float64) with the given loss chunk and checkpointing.
std::pair<double, std::vector<torch::Tensor>> loss_and_grads(squeeze::nn::Llama& model, const torch::Tensor& x, const torch::Tensor& y,
                                                             int64_t chunk, int64_t every) {
  for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
  model->loss_chunk_tokens = chunk;
  model->checkpoint_every = every;
  const torch::Tensor loss = model->loss(x, y);
  loss.backward();
  std::vector<torch::Tensor> g;
  for (auto& p : model->parameters()) {
    EXPECT_TRUE(p.grad().defined());
    g.push_back(p.grad().to(torch::kFloat64));
  }
  return {loss.item<double>(), g};
}

double rel_diff(const torch::Tensor& a, const torch::Tensor& b) { return ((a - b).norm() / b.norm()).item<double>(); }

TEST(LlamaLoss, ChunkedLossAndGradientsMatchUnchunked) {
  // B·T = 2·37 = 74 tokens in chunks of 16 (four, then a partial one of 10), with and without checkpointing.
  // Reference: the unchunked loss of a float64 copy of the same weights. Tolerances, relative (gradients: per
  // tensor, by norm): float64 1e-12 (summation order only); fp32 1e-5; bf16 against float64 3e-2 (the model
  // computes in bf16, chunked or not), and bf16 chunked against bf16 unchunked 1e-2 (other GEMM blocking, the
  // head's gradient summed over the chunks in bf16). Seen here: fp32 4e-7 / 1e-7, bf16 1.2e-2 / 3.5e-3.
  const torch::Tensor x = torch::randint(0, 256, {2, 37}, torch::kLong), y = torch::randint(0, 256, {2, 37}, torch::kLong);
  const auto build = [](torch::Dtype dtype) {
    torch::manual_seed(21);  // the same initial weights for every copy
    squeeze::nn::Llama m(small_config());
    m->to(dtype);
    m->train();
    return m;
  };
  squeeze::nn::Llama ref = build(torch::kFloat64);
  const auto [ref_loss, ref_grads] = loss_and_grads(ref, x, y, 0, 0);
  struct Case {
    torch::Dtype dtype;
    double vs_ref, vs_unchunked;
  };
  for (const Case c : {Case{torch::kFloat64, 1e-12, 1e-12}, Case{torch::kFloat32, 1e-5, 1e-5}, Case{torch::kBFloat16, 3e-2, 1e-2}}) {
    squeeze::nn::Llama model = build(c.dtype);
    double worst_ref = 0, worst_pair = 0;
    for (int64_t every : {0, 1, 2}) {
      SCOPED_TRACE(std::string("dtype ") + c10::toString(c.dtype) + ", checkpoint every " + std::to_string(every));
      const auto [loss, grads] = loss_and_grads(model, x, y, 16, every);
      const auto [whole_loss, whole_grads] = loss_and_grads(model, x, y, 0, every);
      EXPECT_NEAR(loss, ref_loss, c.vs_ref * std::abs(ref_loss));
      EXPECT_NEAR(loss, whole_loss, c.vs_unchunked * std::abs(whole_loss));
      ASSERT_EQ(grads.size(), ref_grads.size());
      for (size_t i = 0; i < grads.size(); ++i) {
        EXPECT_LE(rel_diff(grads[i], ref_grads[i]), c.vs_ref) << "parameter " << i;
        EXPECT_LE(rel_diff(grads[i], whole_grads[i]), c.vs_unchunked) << "parameter " << i;
        worst_ref = std::max(worst_ref, rel_diff(grads[i], ref_grads[i]));
        worst_pair = std::max(worst_pair, rel_diff(grads[i], whole_grads[i]));
      }
    }
    std::cout << c10::toString(c.dtype) << ": largest gradient difference, chunked vs float64 reference " << worst_ref << ", vs unchunked "
              << worst_pair << "\n";
  }
}

TEST(LlamaLoss, EvaluationChunksWithoutRecomputing) {
  // Eval mode under no-grad: the chunks just run (no autograd graph); the value is the unchunked one. Eval mode
  // with grad: chunks without checkpoints, gradients still exact (float64).
  torch::manual_seed(22);
  squeeze::nn::Llama model(small_config());
  model->to(torch::kFloat64);
  model->eval();
  const torch::Tensor x = torch::randint(0, 256, {3, 29}, torch::kLong), y = torch::randint(0, 256, {3, 29}, torch::kLong);
  double whole = 0, chunked = 0;
  {
    torch::NoGradGuard no_grad;
    model->loss_chunk_tokens = 0;
    whole = model->loss(x, y).item<double>();
    model->loss_chunk_tokens = 10;
    const torch::Tensor l = model->loss(x, y);
    EXPECT_FALSE(l.requires_grad());
    chunked = l.item<double>();
  }
  EXPECT_NEAR(chunked, whole, 1e-12 * std::abs(whole));
  const auto [l0, g0] = loss_and_grads(model, x, y, 0, 0);
  const auto [l1, g1] = loss_and_grads(model, x, y, 10, 0);
  EXPECT_NEAR(l1, l0, 1e-12 * std::abs(l0));
  for (size_t i = 0; i < g0.size(); ++i) EXPECT_LE(rel_diff(g1[i], g0[i]), 1e-12) << "parameter " << i;
}

TEST(LlamaLoss, RejectsABadChunkSize) {
  squeeze::nn::Llama model(small_config());
  const torch::Tensor x = torch::randint(0, 256, {2, 8}, torch::kLong);
  model->loss_chunk_tokens = -1;
  try {
    model->loss(x, x);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("loss_chunk_tokens must be >= 0"), std::string::npos) << e.what();
  }
  model->loss_chunk_tokens = 4;
  EXPECT_THROW(model->loss(x, x.narrow(1, 0, 7)), c10::Error) << "targets of another shape";
}

// ---- the planner against what autograd really keeps --------------------------------------------------------
// fp32 on the CPU takes the same path as fp32 on a GPU (K/V repeated to every head; a fused attention that
// keeps one log-sum-exp per head), so the bytes alive after forward are the planner's activations minus the
// loss's backward transient (2 of its 3·V·4 bytes per token: the gradients backward has not made yet).
TEST(LlamaPlanner, ActivationsAreWhatAutogradKeeps) {
  for (const bool fused : {false, true}) {
    LlamaConfig c = small_config();
    c.hidden = 64, c.heads = 4, c.kv_heads = 2, c.ffn = 160, c.layers = 3;
    c.fused_kernels = fused;  // the planner's TrainShape::fused_kernels says which ops the model runs
    const int64_t B = 4, T = 64;
    torch::manual_seed(15);
    squeeze::nn::Llama model(c);
    model->train();
    const torch::Tensor x = torch::randint(0, c.vocab, {B, T}, torch::kLong), y = torch::randint(0, c.vocab, {B, T}, torch::kLong);
    squeeze::plan::TrainShape shape{B, T};
    shape.fused_kernels = fused;
    for (int64_t every : {0, 1, 3}) {
      model->checkpoint_every = every;
      squeeze::test::MemoryMeter meter;
      torch::Tensor loss = model->loss(x, y);
      const int64_t held = meter.live_bytes();  // the graph's saved tensors (+ the scalar loss)
      const int64_t tokens = B * T, logsoftmax = tokens * c.vocab * 4;
      // Checkpointed: the segments' inputs, the final norm and the log-softmax (the planner adds the larger of
      // the loss's transient and one recomputed segment, neither of which exists yet). fp32: the norm keeps its
      // input and reciprocal RMS, its output, and unfused the value before the gain.
      const int64_t final_norm = tokens * (4 * c.hidden + 4 + (fused ? 1 : 2) * c.hidden * 4);
      const int64_t planned = every == 0 ? squeeze::plan::activation_bytes(c.shape(), shape, 4, 0, true) - 2 * logsoftmax
                                         : (c.layers + every - 1) / every * tokens * c.hidden * 4 + final_norm + logsoftmax;
      // Slack: RoPE's cos/sin tables ([T, D] each, kept by the products), per-checkpoint RNG state (~5 kB).
      EXPECT_NEAR(double(held), double(planned), 0.02 * double(planned) + 16384.0) << "checkpoint every " << every << " fused " << fused;
      std::cout << "fused " << fused << " every " << every << ": held " << held << " bytes, planned " << planned << "\n";
      loss.backward();
      model->zero_grad();
    }
  }
}

// LoRA on q and v over a frozen dense base (fp32, so the same attention path as above): what the planner's
// frozen-base terms say is kept.
TEST(LlamaPlanner, FrozenBaseActivationsAreWhatAutogradKeeps) {
  using S = squeeze::Strategy<squeeze::LoRA<8, 16>>;
  for (const bool fused : {false, true}) {
    LlamaConfig c = small_config();
    c.hidden = 64, c.heads = 4, c.kv_heads = 2, c.ffn = 160, c.layers = 3;
    c.fused_kernels = fused;
    const int64_t B = 4, T = 64;
    torch::manual_seed(16);
    squeeze::nn::Llama model(c);
    squeeze::nn::apply_lora<S>(*model);
    model->train();
    const torch::Tensor x = torch::randint(0, c.vocab, {B, T}, torch::kLong), y = torch::randint(0, c.vocab, {B, T}, torch::kLong);
    squeeze::test::MemoryMeter meter;
    torch::Tensor loss = model->loss(x, y);
    const int64_t held = meter.live_bytes();
    squeeze::plan::TrainShape shape{B, T};
    shape.fused_kernels = fused;
    const auto plan = squeeze::plan::plan_memory<S>(c.shape(), shape, 1);
    const int64_t planned = plan.activations.device - 2 * B * T * c.vocab * 4;
    EXPECT_NEAR(double(held), double(planned), 0.02 * double(planned) + 16384.0) << "fused " << fused;
    EXPECT_LT(planned, squeeze::plan::activation_bytes(c.shape(), shape, 4, 0, true) - 2 * B * T * c.vocab * 4)
        << "a frozen base keeps less than full training";
    std::cout << "fused " << fused << " frozen base: held " << held << " bytes, planned " << planned << "\n";
    loss.backward();
  }
}

// The high-water mark of forward + backward (fp32, CPU: the GPU's fp32 attention path) against the planner's
// activations, chunked (64-token chunks of 256 tokens) and not, with and without checkpointing. Parameter gradients
// are created during backward (set to none first); the only one alive at the loss's peak, the head's, is in the
// planner's loss term.
TEST(LlamaPlanner, ChunkedLossPeakIsThePlanners) {
  LlamaConfig c = small_config();
  c.hidden = 64, c.heads = 4, c.kv_heads = 2, c.ffn = 160, c.layers = 3;
  c.fused_kernels = false;  // the unfused model (TrainShape::fused_kernels below); the first test covers both
  const int64_t B = 4, T = 64;
  torch::manual_seed(17);
  squeeze::nn::Llama model(c);
  model->train();
  const torch::Tensor x = torch::randint(0, c.vocab, {B, T}, torch::kLong), y = torch::randint(0, c.vocab, {B, T}, torch::kLong);
  std::map<std::pair<int64_t, int64_t>, int64_t> peaks;
  for (int64_t every : {0, 1}) {
    for (int64_t chunk : {int64_t(0), int64_t(64)}) {
      for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
      model->checkpoint_every = every;
      model->loss_chunk_tokens = chunk;
      squeeze::test::MemoryMeter meter;
      torch::Tensor loss = model->loss(x, y);
      const int64_t held = meter.live_bytes();
      loss.backward();
      const int64_t peak = meter.peak_bytes();
      const squeeze::plan::TrainShape shape{B, T, squeeze::plan::GradientBuffers::after_backward, chunk, false};
      const int64_t planned = squeeze::plan::activation_bytes(c.shape(), shape, 4, every, true);
      const int64_t loss_term = squeeze::plan::loss_bytes(c.shape(), B * T, 4, chunk, true);
      std::cout << "every " << every << " chunk " << chunk << ": held " << held << " peak " << peak << " planned " << planned
                << " (loss term " << loss_term << ")\n";
      // Above the plan by at most the parameter gradients made before the peak (activation_bytes leaves them to the
      // planner's gradients): the head's, and with checkpointing the recomputed block's own.
      const int64_t head_grad = c.vocab * c.hidden * 4, block_grads = c.shape().block_params() * 4;
      EXPECT_GE(double(peak), 0.98 * double(planned)) << "every " << every << " chunk " << chunk;
      EXPECT_LE(double(peak), 1.02 * double(planned) + double(head_grad + (every > 0 ? block_grads : 0)) + 16384.0)
          << "every " << every << " chunk " << chunk;
      if (chunk > 0) {  // nothing of the logits is kept after forward
        const int64_t tokens = B * T, final_norm = tokens * (4 * c.hidden + 4 + 2 * c.hidden * 4);
        const int64_t kept = every == 0 ? planned - loss_term : (c.layers + every - 1) / every * tokens * c.hidden * 4 + final_norm;
        // Slack: RoPE's tables, and each checkpoint's RNG state (~5 kB; 4 loss chunks here, and the segments).
        EXPECT_NEAR(double(held), double(kept), 0.02 * double(kept) + 16384.0 + 8192.0 * 4) << "every " << every;
      }
      peaks[{every, chunk}] = peak;
    }
  }
  EXPECT_LT((peaks[{0, 64}]), (peaks[{0, 0}])) << "chunking lowers the peak";
}

// ---- training ----------------------------------------------------------------------------------------------
// A repetitive byte stream: a small model learns it within a few dozen steps.
torch::Tensor training_bytes() {
  std::string text;
  const char* lines[] = {"And God said, Let there be light: and there was light.\n", "And God saw the light, that it was good.\n",
                         "And the evening and the morning were the first day.\n"};
  for (int i = 0; i < 40; ++i) text += lines[i % 3];
  return torch::from_blob(text.data(), {int64_t(text.size())}, torch::kUInt8).to(torch::kLong);
}

std::pair<torch::Tensor, torch::Tensor> batch(const torch::Tensor& data, int64_t B, int64_t T, int64_t step) {
  auto gen = at::detail::createCPUGenerator(uint64_t(1000 + step));
  const torch::Tensor start = torch::randint(0, data.size(0) - T - 1, {B, 1}, gen, torch::kLong);
  const torch::Tensor w = data.index_select(0, (start + torch::arange(T + 1, torch::kLong)).reshape({-1})).view({B, T + 1});
  return {w.narrow(1, 0, T), w.narrow(1, 1, T)};
}

TrainOptions fast_options() {
  TrainOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.0;
  return o;
}

TEST(LlamaTrain, EveryStrategyLowersTheLoss) {
  const torch::Tensor data = training_bytes();
  for_each_strategy([&]<squeeze::StrategyType S>(std::string_view name) {
    SCOPED_TRACE(std::string(name));
    torch::manual_seed(6);
    TrainOptions o = fast_options();
    if constexpr (S::has_lora) o.lr = 5e-2;  // adapters only: a higher rate, as is usual for LoRA
    LlamaRun<S> trainer(small_config(), o, torch::kCPU);
    std::vector<double> losses;
    for (int64_t step = 0; step < 30; ++step) {
      const auto [x, y] = batch(data, 8, 32, step);
      BatchResult r = trainer.step(x, y);
      // fp16's dynamic loss scale starts high and backs off when the scaled gradients overflow: that step is skipped
      // and its batch tried again, as llama_train does (some initialisations overflow early here, some do not).
      for (int retry = 0; S::loss_scaling && !r.applied && retry < 3; ++retry) r = trainer.step(x, y);
      EXPECT_TRUE(r.applied) << "step " << step;
      EXPECT_TRUE(std::isfinite(r.loss));
      losses.push_back(r.loss);
    }
    const double first = (losses[0] + losses[1]) / 2, last = (losses[28] + losses[29]) / 2;
    EXPECT_NEAR(first, std::log(256.0), 0.3);  // untrained: about uniform over bytes
    // LoRA trains small adapters on a frozen random base (embedding and head included): it learns less.
    EXPECT_LT(last, first - (S::has_lora ? 0.1 : 1.5)) << "loss " << first << " -> " << last;
    EXPECT_EQ(trainer.step_count(), 30);
    std::cout << name << ": loss " << first << " -> " << last << "\n";
  });
}

// Parameters after `steps` steps, as float.
template <squeeze::StrategyType S>
std::vector<torch::Tensor> weights_after(int steps, std::vector<double>* losses = nullptr) {
  const torch::Tensor data = training_bytes();
  torch::manual_seed(7);
  LlamaRun<S> trainer(small_config(), fast_options(), torch::kCPU);
  for (int step = 0; step < steps; ++step) {
    const auto [x, y] = batch(data, 8, 32, step);
    const double loss = trainer.step(x, y).loss;
    if (losses) losses->push_back(loss);
  }
  std::vector<torch::Tensor> w;
  for (auto& p : trainer.model()->parameters()) w.push_back(p.detach().to(torch::kFloat32).clone());
  return w;
}

double max_rel_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, ((a[i] - b[i]).norm() / b[i].norm()).item<double>());
  return d;
}

TEST(LlamaTrain, StrategiesMatchTheFloatBaseline) {
  using namespace squeeze;
  std::vector<double> l0, l1, l2, l3;
  const auto base = weights_after<Strategy<>>(4, &l0);
  // Checkpointing recomputes the same float ops: identical.
  EXPECT_EQ(max_rel_diff(weights_after<Strategy<Checkpointed>>(4, &l1), base), 0.0);
  // Accumulation sums 4 micro-batch gradients in another order: float rounding only.
  EXPECT_LT(max_rel_diff(weights_after<Strategy<Accumulate<4>>>(4, &l2), base), 1e-4);
  // bf16 compute: same start; the losses follow the float run within bf16 rounding of the model's outputs.
  // (Weights are not compared: AdamW's first steps move every weight by about +-lr whatever the gradient's
  // size, so bf16 rounding that flips the sign of a tiny gradient moves that weight by 2 lr.)
  weights_after<Strategy<Precision<bf16, float>>>(4, &l3);
  EXPECT_EQ(l1, l0);
  for (size_t i = 0; i < l0.size(); ++i) {
    EXPECT_NEAR(l2[i], l0[i], 1e-4) << "step " << i;
    EXPECT_NEAR(l3[i], l0[i], 3e-2) << "step " << i;
  }
  EXPECT_GT(std::abs(l3[0] - l0[0]), 0.0) << "the bf16 run did not compute in bf16";
}

TEST(LlamaTrain, Fp16OverflowSkipsTheStepAndHalvesTheScale) {
  using S = squeeze::Strategy<squeeze::Precision<squeeze::half, float>>;
  static_assert(S::dynamic_loss_scaling);
  TrainOptions o = fast_options();
  o.initial_scale = std::ldexp(1.0, 40);  // the scaled gradients overflow fp16
  torch::manual_seed(8);
  LlamaRun<S> trainer(small_config(), o, torch::kCPU);
  const auto before = trainer.model()->parameters()[1].clone();
  const auto [x, y] = batch(training_bytes(), 4, 16, 0);
  const BatchResult r = trainer.step(x, y);
  EXPECT_FALSE(r.applied);
  EXPECT_EQ(trainer.loss_scale(), std::ldexp(1.0, 39));
  EXPECT_EQ(trainer.step_count(), 0);
  EXPECT_TRUE(torch::equal(before, trainer.model()->parameters()[1])) << "a skipped step changed the weights";
  // The scale comes down until steps apply.
  int tries = 0;
  while (!trainer.step(x, y).applied && ++tries < 40) {}
  EXPECT_LT(tries, 40);
  EXPECT_EQ(trainer.step_count(), 1);
}

TEST(LlamaTrain, RejectsABatchThatDoesNotSplitIntoMicroBatches) {
  LlamaRun<squeeze::Strategy<squeeze::Accumulate<4>>> trainer(small_config(), fast_options(), torch::kCPU);
  const auto [x, y] = batch(training_bytes(), 6, 8, 0);
  EXPECT_THROW(trainer.step(x, y), c10::Error);
}

// ---- ZeRO strategies on two LocalComm ranks ------------------------------------------------------------------
// Runs fn(rank, comm) on `world` threads; rethrows the first failure.
template <class F>
void run_ranks(int world, F&& fn) {
  auto comms = squeeze::comm::LocalComm::create(world);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(world);
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r, comms[r]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// Per-rank losses of `steps` steps (each rank its own batches) and the final validation loss per rank.
template <squeeze::StrategyType S>
std::pair<std::vector<std::vector<double>>, std::vector<double>> train_two_ranks(int steps, int64_t checkpoint_every) {
  const torch::Tensor data = training_bytes();
  std::vector<squeeze::nn::Llama> models;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(13);  // the same start on both ranks (rank 0's is broadcast anyway)
    models.emplace_back(small_config());
  }
  std::vector<std::vector<double>> losses(2);
  std::vector<double> val(2);
  const auto vb = batch(data, 4, 16, 999);
  run_ranks(2, [&](int r, std::shared_ptr<squeeze::comm::LocalComm> comm) {
    LlamaRun<S> t(models[r], fast_options(), torch::kCPU, comm);
    t.model()->checkpoint_every = checkpoint_every;
    if constexpr (S::stage == 3) {  // the layers really are sharded: their own weights emptied, a shard per rank
      auto& q = t.model()->blocks[0]->attn->q;
      EXPECT_NE(q->group(), nullptr);
      EXPECT_EQ(q->weight.numel(), 0);
    }
    for (int s = 0; s < steps; ++s) {
      const auto [x, y] = batch(data, 8, 16, 100 * r + s);
      losses[r].push_back(t.step(x, y).loss);
    }
    val[r] = t.evaluate({vb});
  });
  return {losses, val};
}

TEST(LlamaZero, ShardedStrategiesTrainOnTwoRanks) {
  for_each_strategy([&]<squeeze::StrategyType S>(std::string_view name) {
    if constexpr (S::stage > 0) {
      SCOPED_TRACE(std::string(name));
      const auto [losses, val] = train_two_ranks<S>(25, S::checkpoint_every);
      for (int r = 0; r < 2; ++r) {
        const double first = losses[r][0], last = (losses[r][23] + losses[r][24]) / 2;
        EXPECT_LT(last, first - 1.5) << "rank " << r << ": " << first << " -> " << last;
      }
      EXPECT_EQ(val[0], val[1]) << "the ranks' models differ after training";
      EXPECT_LT(val[0], std::log(256.0) - 1.5);
    }
  });
}

TEST(LlamaZero, CheckpointingComposesWithStage3Gathers) {
  // Stage 3 on two ranks: checkpointed segments recompute through the shard gathers and must give the same
  // training run as keeping the activations.
  using S = squeeze::Strategy<squeeze::Sharded<squeeze::Stage3>>;
  const auto plain = train_two_ranks<S>(4, 0);
  for (int64_t every : {1, 2}) {
    const auto ck = train_two_ranks<S>(4, every);
    for (int r = 0; r < 2; ++r)
      for (size_t i = 0; i < plain.first[r].size(); ++i)
        EXPECT_NEAR(ck.first[r][i], plain.first[r][i], 1e-6) << "every " << every << " rank " << r << " step " << i;
    EXPECT_NEAR(ck.second[0], plain.second[0], 1e-6);
  }
}

// Stage 3 on two LocalComm ranks: with the loss in chunks (128 tokens per rank in chunks of 48: 48, 48, 32) the
// head is gathered once per pass and its gradient, summed over the chunks, reduce-scattered once (its group sees
// one use and one reduction per micro-step, so the trainer's gradient-ready hook fires once); the trained weights
// follow the unchunked run. fp32 throughout: tolerance 1e-5 relative per tensor (summation order only).
// Offload<Host> with clip 0 updates each layer inside backward when its gradient is ready: a premature or repeated
// ready signal for the head would update it from a partial gradient.
template <squeeze::StrategyType S>
std::vector<torch::Tensor> stage3_weights(int steps, int64_t chunk, int64_t every, double clip, std::vector<double>* losses) {
  const torch::Tensor data = training_bytes();
  std::vector<squeeze::nn::Llama> models;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(13);
    models.emplace_back(small_config());
  }
  std::vector<std::vector<torch::Tensor>> weights(2);
  std::vector<std::vector<double>> rank_losses(2);
  run_ranks(2, [&](int r, std::shared_ptr<squeeze::comm::LocalComm> comm) {
    TrainOptions o = fast_options();
    o.clip = clip;
    o.loss_chunk_tokens = chunk;
    LlamaRun<S> t(models[r], o, torch::kCPU, comm);
    t.model()->checkpoint_every = every;
    EXPECT_EQ(t.model()->loss_chunk_tokens, chunk);
    squeeze::train::Stage3Group* head = t.model()->head->group();
    EXPECT_NE(head, nullptr);
    for (int s = 0; s < steps; ++s) {
      const auto [x, y] = batch(data, 8, 16, 100 * r + s);
      rank_losses[r].push_back(t.step(x, y).loss);
      if (head) {
        EXPECT_EQ(head->uses, 1) << "step " << s;
        EXPECT_EQ(head->added, 1) << "step " << s;
      }
    }
    for (auto& [name, w] : t.full_parameters()) weights[r].push_back(w.to(torch::kFloat32));
  });
  if (losses) *losses = rank_losses[0];
  for (size_t i = 0; i < weights[0].size(); ++i) EXPECT_TRUE(torch::equal(weights[0][i], weights[1][i])) << "ranks differ at " << i;
  return weights[0];
}

TEST(LlamaZero, ChunkedLossComposesWithStage3) {
  using Z3 = squeeze::Strategy<squeeze::Sharded<squeeze::Stage3>>;
  using Z3Offload = squeeze::Strategy<squeeze::Sharded<squeeze::Stage3>, squeeze::Offload<squeeze::Host>>;
  const auto check = [](const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want, const std::vector<double>& lg,
                        const std::vector<double>& lw) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_LE(rel_diff(got[i], want[i]), 1e-5) << "parameter " << i;
    for (size_t s = 0; s < lg.size(); ++s) EXPECT_NEAR(lg[s], lw[s], 1e-5 * std::abs(lw[s])) << "step " << s;
  };
  std::vector<double> l0, l1;
  for (int64_t every : {0, 1}) {
    SCOPED_TRACE("checkpoint every " + std::to_string(every));
    const auto plain = stage3_weights<Z3>(3, 0, every, 1.0, &l0);
    check(stage3_weights<Z3>(3, 48, every, 1.0, &l1), plain, l1, l0);
  }
  SCOPED_TRACE("Offload<Host>, eager updates (clip 0)");
  const auto plain = stage3_weights<Z3Offload>(3, 0, 0, 0.0, &l0);
  check(stage3_weights<Z3Offload>(3, 48, 0, 0.0, &l1), plain, l1, l0);
}

// bf16 compute with fp32 masters: the sharded trainer's masters start from the float initialisation, as the
// local trainer's do. At lr 1e-5 an update moves a weight of the init's size (std 0.02) by far less than half a bf16
// step (~4e-5), so a master taken from the bf16 rounding would keep nearly every weight where it was, while one
// from the float values crosses a rounding boundary wherever the init sat within 1e-5 of one. After 4 steps the two
// trainers' bf16 weights agree (compared: the count of elements that differ, allowed 1% of those that moved, as a
// different summation order of a gradient can move an element sitting on a boundary; measured here: 0 of 23,531
// moved, and 11,474 with masters from the bf16 values) and their losses agree to 1e-3 relative.
TEST(LlamaZero, Bf16MastersStartFromTheFloatInitialisation) {
  using Local = squeeze::Strategy<squeeze::Precision<squeeze::bf16, float>>;
  using Z3 =
      squeeze::Strategy<squeeze::Sharded<squeeze::Stage3>, squeeze::Offload<squeeze::Host>, squeeze::Precision<squeeze::bf16, float>>;
  const torch::Tensor data = training_bytes();
  TrainOptions o = fast_options();
  o.lr = 1e-5, o.clip = 0;
  torch::manual_seed(21);
  LlamaRun<Local> local(small_config(), o, torch::kCPU);
  torch::manual_seed(21);
  LlamaRun<Z3> zero(small_config(), o, torch::kCPU);
  torch::manual_seed(21);
  const squeeze::nn::Llama init(small_config());
  for (int s = 0; s < 4; ++s) {
    const auto [x, y] = batch(data, 4, 16, s);
    const double a = local.step(x, y).loss, b = zero.step(x, y).loss;
    EXPECT_NEAR(b, a, 1e-3 * a) << "step " << s;
  }
  zero.sync();
  const auto mine = local.model()->named_parameters();
  int64_t differ = 0, moved = 0, total = 0;
  for (const auto& [name, w] : zero.full_parameters()) {
    const torch::Tensor l = mine[name].detach(), start = init->named_parameters()[name].detach().to(torch::kBFloat16);
    differ += (w != l).sum().item<int64_t>();
    moved += (l != start).sum().item<int64_t>();
    total += l.numel();
  }
  EXPECT_GT(moved, total / 100) << "the local trainer's bf16 weights moved (else this test shows nothing)";
  EXPECT_LT(differ, moved / 100) << differ << " of " << total << " weights differ; the local trainer moved " << moved;
}

// ---- checkpoints -------------------------------------------------------------------------------------------
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() / ("squeeze-llama-test-" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() { squeeze::io::try_remove_tree(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

template <squeeze::StrategyType S>
void round_trip(uint64_t other_seed = 123) {
  TempDir dir;
  const torch::Tensor data = training_bytes();
  const std::string ckpt = dir.file("a.pt");
  torch::manual_seed(9);
  LlamaRun<S> a(small_config(), fast_options(), torch::kCPU);
  for (int s = 0; s < 3; ++s) {
    const auto [x, y] = batch(data, 8, 16, s);
    a.step(x, y);
  }
  a.save(ckpt);
  std::vector<double> cont;
  for (int s = 3; s < 6; ++s) {
    const auto [x, y] = batch(data, 8, 16, s);
    cont.push_back(a.step(x, y).loss);
  }

  torch::manual_seed(other_seed);  // a different initialisation, overwritten by the load
  LlamaRun<S> b(small_config(), fast_options(), torch::kCPU);
  b.load(ckpt);
  EXPECT_EQ(b.step_count(), 3);
  EXPECT_EQ(b.loss_scale(), a.loss_scale());
  std::vector<double> resumed;
  for (int s = 3; s < 6; ++s) {
    const auto [x, y] = batch(data, 8, 16, s);
    resumed.push_back(b.step(x, y).loss);
  }
  EXPECT_EQ(resumed, cont) << "a resumed run must continue exactly (weights, AdamW moments and step restored)";
  auto pa = a.model()->parameters(), pb = b.model()->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << i;
}

TEST(LlamaCheckpoint, RoundTripContinuesExactlyFloat) { round_trip<squeeze::Strategy<>>(); }
TEST(LlamaCheckpoint, RoundTripContinuesExactlyBf16) { round_trip<squeeze::Strategy<squeeze::Precision<squeeze::bf16, float>>>(); }
TEST(LlamaCheckpoint, RoundTripContinuesExactlyFp16) { round_trip<squeeze::Strategy<squeeze::Precision<squeeze::half, float>>>(); }
TEST(LlamaCheckpoint, RoundTripContinuesExactlyBf16AccumulateCheckpointed) {
  round_trip<squeeze::Strategy<squeeze::Precision<squeeze::bf16, float>, squeeze::Accumulate<4>, squeeze::Checkpointed>>();
}
using QLoRA = squeeze::Strategy<squeeze::Quantized<4, squeeze::NF4, squeeze::DoubleQuant>, squeeze::LoRA<8, 16>,
                                squeeze::Precision<squeeze::bf16, float>, squeeze::Checkpointed>;

TEST(LlamaCheckpoint, RoundTripContinuesExactlyQLoRA) {
  // fp32 adapters and their AdamW state; the frozen NF4 base is rebuilt from the same seed and checked.
  round_trip<QLoRA>(/*other_seed=*/9);
}

// The same with the adapters' Adam moments as 8-bit codes (nn::AdamW8): its codes, scales and steps come back.
TEST(LlamaCheckpoint, RoundTripContinuesExactlyQLoRAAdam8) {
  round_trip<squeeze::Strategy<squeeze::Quantized<4, squeeze::NF4, squeeze::DoubleQuant>, squeeze::LoRA<8, 16>,
                               squeeze::Precision<squeeze::bf16, float>, squeeze::Checkpointed, squeeze::QuantizedState<8>>>(
      /*other_seed=*/9);
}

TEST(LlamaCheckpoint, QLoRARefusesAnotherBase) {
  TempDir dir;
  torch::manual_seed(9);
  LlamaRun<QLoRA> a(small_config(), fast_options(), torch::kCPU);
  const auto [x, y] = batch(training_bytes(), 8, 16, 0);
  a.step(x, y);
  a.save(dir.file("q.pt"));
  torch::manual_seed(10);  // another base
  LlamaRun<QLoRA> b(small_config(), fast_options(), torch::kCPU);
  const auto before = b.model()->parameters();
  std::vector<torch::Tensor> kept;
  for (const auto& p : before) kept.push_back(p.clone());
  try {
    b.load(dir.file("q.pt"));
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the frozen tensors"), std::string::npos) << e.what();
  }
  for (size_t i = 0; i < kept.size(); ++i)
    EXPECT_TRUE(torch::equal(kept[i], b.model()->parameters()[i])) << "a failed load changed the model";
  EXPECT_EQ(b.step_count(), 0);
}

// The NF4 base's work by count, which no numeric result shows (a pass run twice, or one dropped, gives the same
// numbers): a QLoRA step dequantises each block linear's W once in forward, once more in recomputation when
// checkpointed, and once for its input gradient, except block 0's q, k and v, whose input (the frozen embedding through
// a frozen norm) needs none.
template <squeeze::StrategyType S>
void expect_one_dequantisation_a_pass(int64_t passes) {
  SCOPED_TRACE(passes == 3 ? "checkpointed" : "not checkpointed");
  torch::manual_seed(9);
  LlamaRun<S> run(small_config(), fast_options(), torch::kCPU);
  const auto weights = [](torch::nn::Module& m) { return squeeze::nn::detail::packed_nf4_weights(m); };
  ASSERT_EQ(weights(*run.model()).size(), size_t(7 * small_config().layers)) << "every block linear's base in NF4";
  for (int step = 0; step < 2; ++step) {
    for (auto* w : weights(*run.model())) w->dequantizations = 0;
    const auto [x, y] = batch(training_bytes(), 4, 16, step);
    run.step(x, y);
    for (size_t b = 0; b < run.model()->blocks.size(); ++b) {
      const auto ws = weights(*run.model()->blocks[b]);
      ASSERT_EQ(ws.size(), 7u);
      int64_t total = 0;
      for (const auto* w : ws) {
        EXPECT_GE(w->dequantizations, passes - 1) << "block " << b;
        EXPECT_LE(w->dequantizations, passes) << "block " << b;
        total += w->dequantizations;
      }
      EXPECT_EQ(total, 7 * passes - (b == 0 ? 3 : 0)) << "block " << b << ", step " << step;
    }
  }
}

TEST(LlamaTrain, QLoRADequantisesTheBaseOncePerPass) {
  expect_one_dequantisation_a_pass<QLoRA>(3);
  expect_one_dequantisation_a_pass<squeeze::Strategy<squeeze::Quantized<4, squeeze::NF4, squeeze::DoubleQuant>, squeeze::LoRA<8, 16>,
                                                     squeeze::Precision<squeeze::bf16, float>>>(2);
}

// ZeRO-3 + offload: every rank's file brings back the full weights, its optimizer partitions and the counters
// (train::Trainer::restore_counters), so the resumed run continues exactly.
TEST(LlamaCheckpoint, RoundTripContinuesExactlyZero3Offload) {
  using S = squeeze::Strategy<squeeze::Sharded<squeeze::Stage3>, squeeze::Offload<squeeze::Host>, squeeze::Precision<squeeze::bf16, float>>;
  round_trip<S>();
}

// The same with 8-bit Adam moments: the uint8 codes and their block scales come back; a checkpoint of the
// fp32-state strategy (same shapes) is refused by dtype before anything changes.
TEST(LlamaCheckpoint, RoundTripContinuesExactlyZero3OffloadAdam8) {
  using S8 = squeeze::Strategy<squeeze::Sharded<squeeze::Stage3>, squeeze::Offload<squeeze::Host>, squeeze::Precision<squeeze::bf16, float>,
                               squeeze::QuantizedState<8>>;
  round_trip<S8>();
  using S = squeeze::Strategy<squeeze::Sharded<squeeze::Stage3>, squeeze::Offload<squeeze::Host>, squeeze::Precision<squeeze::bf16, float>>;
  TempDir dir;
  torch::manual_seed(15);
  LlamaRun<S> fp32_state(small_config(), fast_options(), torch::kCPU);
  const auto [x, y] = batch(training_bytes(), 8, 16, 0);
  fp32_state.step(x, y);
  fp32_state.save(dir.file("z3.pt"));
  LlamaRun<S8> adam8(small_config(), fast_options(), torch::kCPU);
  try {
    adam8.load(dir.file("z3.pt"));
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"moments\":\"fp32\""), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("keeps {\"compute\":\"bf16\",\"masters\":true,\"moments\":\"8-bit\""), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(adam8.step_count(), 0);
}

// The same with fp16 compute: the dynamic loss scale and its clean-step count come back too.
TEST(LlamaCheckpoint, RoundTripContinuesExactlyZero2Fp16) {
  using S = squeeze::Strategy<squeeze::Sharded<squeeze::Stage2>, squeeze::Precision<squeeze::half, float>>;
  static_assert(S::dynamic_loss_scaling);
  round_trip<S>();
}

TEST(LlamaCheckpoint, RefusesACheckpointOfAnotherStrategy) {
  TempDir dir;
  torch::manual_seed(14);
  LlamaRun<squeeze::Strategy<>> local(small_config(), fast_options(), torch::kCPU);
  local.save(dir.file("local.pt"));
  LlamaRun<QLoRA> q(small_config(), fast_options(), torch::kCPU);
  try {
    q.load(dir.file("local.pt"));
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("was written by Strategy<> (optimizer state"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("\"weights\":\"lora-adapters\""), std::string::npos) << e.what();
  }
}

// A checkpoint of another precision converts: bf16 weights with fp32 masters resume as fp32 weights (the masters).
TEST(LlamaCheckpoint, LoadsAnotherPrecisionsCheckpoint) {
  TempDir dir;
  torch::manual_seed(10);
  LlamaRun<squeeze::Strategy<squeeze::Precision<squeeze::bf16, float>>> a(small_config(), fast_options(), torch::kCPU);
  const auto [x, y] = batch(training_bytes(), 8, 16, 0);
  a.step(x, y);
  a.save(dir.file("bf16"));
  LlamaRun<squeeze::Strategy<>> b(small_config(), fast_options(), torch::kCPU);
  b.load(dir.file("bf16"));
  EXPECT_EQ(b.step_count(), 1);
  auto pa = a.model()->parameters(), pb = b.model()->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pb[i].to(torch::kBFloat16), pa[i])) << i;
}

TEST(LlamaCheckpoint, BadFilesGiveClearErrorsAndChangeNothing) {
  TempDir dir;
  torch::manual_seed(11);
  LlamaRun<squeeze::Strategy<>> t(small_config(), fast_options(), torch::kCPU);
  const auto before = t.model()->parameters()[0].clone();
  const auto expect_error = [&](const std::string& path, const std::string& words) {
    try {
      t.load(path);
      ADD_FAILURE() << "loading " << path << " did not fail";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
    EXPECT_TRUE(torch::equal(before, t.model()->parameters()[0])) << "a failed load changed the model";
    EXPECT_EQ(t.step_count(), 0);
  };
  expect_error(dir.file("missing"), "no checkpoint to resume from");
  std::filesystem::create_directories(dir.file("garbage/step-000001"));
  std::ofstream(dir.file("garbage/latest")) << "step-000001\n";
  std::ofstream(dir.file("garbage/step-000001/index.json")) << "this is not a checkpoint";
  expect_error(dir.file("garbage"), "not valid JSON");

  // A valid checkpoint whose rank file was cut in the middle.
  t.save(dir.file("cut"));
  const std::string shard = dir.file("cut/step-000000/rank-00000-of-00001.safetensors");
  std::filesystem::resize_file(shard, std::filesystem::file_size(shard) / 2);
  expect_error(dir.file("cut"), "truncated");

  // Another model's checkpoint.
  LlamaConfig other = small_config();
  other.hidden = 48;
  LlamaRun<squeeze::Strategy<>> o(other, fast_options(), torch::kCPU);
  o.save(dir.file("other"));
  expect_error(dir.file("other"), "holds preset");
}

TEST(LlamaCheckpoint, AFailedSaveKeepsTheOldCheckpoint) {
  TempDir dir;
  torch::manual_seed(12);
  LlamaRun<squeeze::Strategy<>> t(small_config(), fast_options(), torch::kCPU);
  const std::string root = dir.file("ckpt");
  t.save(root);
  const auto [x, y] = batch(training_bytes(), 8, 16, 0);
  t.step(x, y);
  // The save of step 1 dies after its index was written, before it was renamed into place.
  EXPECT_THROW(squeeze::save_checkpoint(t.trainer(), root, {},
                                        {.fault_hook =
                                             [](std::string_view point) {
                                               if (point == "index.json:renamed") throw std::runtime_error("killed");
                                             }}),
               std::runtime_error);
  LlamaRun<squeeze::Strategy<>> u(small_config(), fast_options(), torch::kCPU);
  EXPECT_NO_THROW(u.load(root));
  EXPECT_EQ(u.step_count(), 0);
}

}  // namespace
