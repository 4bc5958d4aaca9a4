// ZeRO-1/2/3 (+ Offload<Host>) against plain data parallel (Stage0) and against unsharded single-process
// training in float64; overflow skipping; global-norm clipping; stage-3 bytes vs the planner.
// CPU only, LocalComm with 1..4 ranks as threads. Label: zero.
//
// Tolerances (why):
//   bitwise   where the reduction order is the same (see nn/trainer.hpp): accumulation 1, every stage
//             vs Stage0; accumulation 4, Stage1 vs Stage0 and Stage3 vs Stage2; offload vs none; the
//             loss trajectory of Stage1 vs Stage0.
//   float     Stage2/3 vs Stage0 with accumulation 4 (sums over ranks and micro-steps associate
//             differently): 1e-6 abs (a few float ulps of the gradient, times lr = 1e-2, over 10 steps).
//             vs float64 single process: 2e-5 abs (float vs double gradients, 10 Adam steps of lr 1e-2).
//   bf16      compared by the training update (see expect_update_close): ||got - ref|| / ||ref - init||
//             per tensor <= 0.2 for Stage2/3 vs Stage0 with accumulation 4 (bf16 reduce-scatter per
//             micro-step vs fp32 sums) and <= 0.25 vs float64 single process (measured 0.01-0.16: bf16
//             spacing near 1.0 is 2^-7 while 10 steps move a weight by <= 0.1, so rounding alone is up
//             to ~8% of an update; a wrong gradient scale or sign gives >= 1).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <squeeze/comm/local.hpp>
#include <squeeze/nn/flat_params.hpp>
#include <squeeze/nn/sharded.hpp>
#include <squeeze/nn/trainer.hpp>

using namespace squeeze;
using squeeze::comm::LocalComm;
using squeeze::comm::run_ranks;
namespace F = torch::nn::functional;

namespace {

struct Hyper {  // the AdamW hyper-parameters (optim::AdamW has the same fields)
  float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.1f;
};

// ---- models ------------------------------------------------------------------------------------------
// Sizes that do not divide by 2, 3 or 4; `gain` is a plain parameter (not shardable): stage 3 keeps it whole.
struct MLPImpl : torch::nn::Module {
  nn::ShardedLinear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
  torch::Tensor gain;
  MLPImpl() {
    fc1 = register_module("fc1", nn::ShardedLinear(7, 19));
    fc2 = register_module("fc2", nn::ShardedLinear(19, 19));
    fc3 = register_module("fc3", nn::ShardedLinear(19, 5));
    gain = register_parameter("gain", torch::ones({19}) + 0.1 * torch::randn({19}));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // x: [B, 7] -> [B, 5]
    auto h = torch::tanh(fc1(x));
    h = torch::tanh(fc2(h)) * gain;
    return fc3(h);
  }
  torch::Tensor loss(const torch::Tensor& x, const torch::Tensor& y) { return F::mse_loss(forward(x), y); }
};
TORCH_MODULE(MLP);

// Two LLaMA-like blocks: RMSNorm -> causal attention (q, k, v, o) -> residual -> RMSNorm -> SwiGLU, embedding
// and untied head; parameters exactly as plan::ModelShape counts them (no biases).
struct TinyLlamaImpl : torch::nn::Module {
  plan::ModelShape shape;
  nn::ShardedEmbedding embed{nullptr};
  nn::ShardedLinear head{nullptr};
  std::vector<nn::ShardedLinear> q, k, v, o, gate, up, down;
  std::vector<torch::Tensor> attn_norm, mlp_norm;
  torch::Tensor final_norm;
  explicit TinyLlamaImpl(plan::ModelShape s) : shape(s) {
    const int64_t h = s.hidden, kv = s.kv_dim();
    embed = register_module("embed", nn::ShardedEmbedding(s.vocab, h));
    for (int64_t l = 0; l < s.layers; ++l) {
      const std::string p = "layer" + std::to_string(l) + "_";
      attn_norm.push_back(register_parameter(p + "attn_norm", torch::ones({h})));
      q.push_back(register_module(p + "q", nn::ShardedLinear(h, h, false)));
      k.push_back(register_module(p + "k", nn::ShardedLinear(h, kv, false)));
      v.push_back(register_module(p + "v", nn::ShardedLinear(h, kv, false)));
      o.push_back(register_module(p + "o", nn::ShardedLinear(h, h, false)));
      mlp_norm.push_back(register_parameter(p + "mlp_norm", torch::ones({h})));
      gate.push_back(register_module(p + "gate", nn::ShardedLinear(h, s.ffn, false)));
      up.push_back(register_module(p + "up", nn::ShardedLinear(h, s.ffn, false)));
      down.push_back(register_module(p + "down", nn::ShardedLinear(s.ffn, h, false)));
    }
    final_norm = register_parameter("final_norm", torch::ones({h}));
    head = register_module("head", nn::ShardedLinear(h, s.vocab, false));
  }
  static torch::Tensor rms(const torch::Tensor& x, const torch::Tensor& g) {
    const auto xf = x.to(torch::kFloat32);
    return (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + 1e-5)).to(x.scalar_type()) * g;
  }
  torch::Tensor loss(const torch::Tensor& tokens) {  // tokens: [B, T+1] int64
    const int64_t B = tokens.size(0), T = tokens.size(1) - 1, H = shape.heads, Hkv = shape.kv_heads, D = shape.head_dim();
    auto x = embed(tokens.narrow(1, 0, T));  // [B, T, h]
    const auto mask = torch::ones({T, T}, torch::kBool).triu(1);
    for (int64_t l = 0; l < shape.layers; ++l) {
      auto a = rms(x, attn_norm[l]);
      auto qh = q[l](a).view({B, T, H, D}).transpose(1, 2);  // [B, H, T, D]
      auto kh = k[l](a).view({B, T, Hkv, D}).transpose(1, 2).repeat_interleave(H / Hkv, 1);
      auto vh = v[l](a).view({B, T, Hkv, D}).transpose(1, 2).repeat_interleave(H / Hkv, 1);
      auto s = torch::matmul(qh, kh.transpose(-1, -2)) / std::sqrt(double(D));
      auto p = torch::softmax(s.masked_fill(mask, -1e9).to(torch::kFloat32), -1).to(x.scalar_type());
      x = x + o[l](torch::matmul(p, vh).transpose(1, 2).reshape({B, T, H * D}));
      auto m = rms(x, mlp_norm[l]);
      x = x + down[l](F::silu(gate[l](m)) * up[l](m));
    }
    auto logits = head(rms(x, final_norm)).to(torch::kFloat32);  // [B, T, V]
    return F::cross_entropy(logits.reshape({B * T, shape.vocab}), tokens.narrow(1, 1, T).reshape({B * T}));
  }
};
TORCH_MODULE(TinyLlama);

const plan::ModelShape kLlamaShape{/*vocab=*/37, /*hidden=*/16, /*layers=*/2, /*heads=*/4, /*kv_heads=*/2, /*ffn=*/24};

enum class Model { mlp, llama };

// Micro-batch data: data[step][rank]; every rank sees different rows.
struct Data {
  std::vector<std::vector<torch::Tensor>> x, y;
};
Data make_data(Model kind, int world, int micro_steps, int64_t rows) {
  torch::manual_seed(4321);
  Data d;
  for (int s = 0; s < micro_steps; ++s) {
    d.x.emplace_back();
    d.y.emplace_back();
    for (int r = 0; r < world; ++r) {
      if (kind == Model::mlp) {
        d.x.back().push_back(torch::randn({rows, 7}));
        d.y.back().push_back(torch::randn({rows, 5}));
      } else {
        d.x.back().push_back(torch::randint(0, kLlamaShape.vocab, {rows, 7}, torch::kInt64));
        d.y.back().push_back(torch::Tensor());
      }
    }
  }
  return d;
}

std::shared_ptr<torch::nn::Module> make_model(Model kind, torch::ScalarType dtype) {
  torch::manual_seed(1234);
  std::shared_ptr<torch::nn::Module> m;
  if (kind == Model::mlp) m = MLP().ptr();
  else m = TinyLlama(kLlamaShape).ptr();
  m->to(dtype);
  return m;
}
torch::Tensor model_loss(Model kind, torch::nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
  if (kind == Model::mlp) return static_cast<MLPImpl&>(m).loss(x.to(m.parameters()[0].scalar_type()), y.to(m.parameters()[0].scalar_type()));
  return static_cast<TinyLlamaImpl&>(m).loss(x);
}

using Params = std::map<std::string, torch::Tensor>;

struct RunResult {
  Params params;                    // rank 0's full parameters after training, float
  std::vector<nn::StepResult> log;  // rank 0's boundary results
};

// Trains `windows` optimizer steps of Strategy S on `world` ranks.
template <class S>
RunResult train(Model kind, int world, int windows, nn::TrainerOptions opt = {}, Hyper hyper = {}) {
  constexpr int A = S::accumulation_steps;
  const auto dtype = nn::detail::scalar_type_of<typename S::compute_type>();
  const Data data = make_data(kind, world, windows * A, 6);
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < world; ++r) models.push_back(make_model(kind, dtype));
  RunResult out;
  run_ranks(world, [&](std::shared_ptr<LocalComm> comm) {
    const int r = comm->rank();
    auto trainer = make_trainer<S>(models[r], hyper, comm, opt);
    for (int s = 0; s < windows * A; ++s) {
      auto res = trainer.step([&] { return model_loss(kind, *models[r], data.x[s][r], data.y[s][r]); });
      EXPECT_EQ(res.boundary, (s + 1) % A == 0);
      if (r == 0 && res.boundary) out.log.push_back(res);
    }
    auto full = trainer.full_parameters();
    if (r == 0)
      for (auto& [n, t] : full) out.params[n] = t.to(torch::kFloat32);
  });
  return out;
}

void expect_bitwise(const Params& a, const Params& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (auto& [n, t] : a) {
    ASSERT_TRUE(b.count(n)) << what << ": missing " << n;
    ASSERT_TRUE(torch::equal(t, b.at(n))) << what << ": " << n << " differs, max |diff| "
                                          << (t - b.at(n)).abs().max().item<float>();
  }
}
void expect_close(const Params& a, const Params& b, double atol, double rtol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (auto& [n, t] : a) {
    ASSERT_TRUE(b.count(n)) << what << ": missing " << n;
    const auto ref = b.at(n).to(torch::kFloat64), got = t.to(torch::kFloat64);
    const auto excess = ((got - ref).abs() - (atol + rtol * ref.abs())).max().item<double>();
    EXPECT_LE(excess, 0.0) << what << ": " << n << " max |diff| " << (got - ref).abs().max().item<double>();
  }
}
// bf16: Adam turns tiny gradient differences on near-zero gradients into whole lr-sized steps, and the
// bf16 copies round to neighbouring values, so elementwise bounds are loose; compare the training
// updates instead: ||(got - init) - (ref - init)|| <= rel * ||ref - init|| per tensor.
void expect_update_close(const Params& got, const Params& ref, Model kind, double rel, const std::string& what) {
  auto m = make_model(kind, torch::kFloat32);
  double worst = 0;
  for (auto& item : m->named_parameters()) {
    const auto init = item.value().detach().to(torch::kFloat64);
    const auto g = got.at(item.key()).to(torch::kFloat64), r = ref.at(item.key()).to(torch::kFloat64);
    const double err = (g - r).norm().item<double>() / (r - init).norm().item<double>();
    worst = std::max(worst, err);
    EXPECT_LE(err, rel) << what << ": " << item.key();
  }
  std::cout << "[ update error ] " << what << ": " << worst << "\n";  // measured value, for the log
}

// Guards against vacuous parity: training moved the parameters.
void expect_trained(const Params& p, Model kind, torch::ScalarType dtype) {
  auto m = make_model(kind, dtype);
  double moved = 0;
  for (auto& item : m->named_parameters()) moved = std::max(moved, (p.at(item.key()) - item.value().to(torch::kFloat32)).abs().max().item<double>());
  EXPECT_GT(moved, 1e-2) << "parameters did not move";
}

// ---- unsharded float64 reference: one process, the global batch, torch::optim::AdamW ---------------------
Params reference_float64(Model kind, int world, int windows, int A, float max_norm = 0, Hyper h = {},
                         std::vector<float>* norms = nullptr) {
  const Data data = make_data(kind, world, windows * A, 6);
  auto m = make_model(kind, torch::kFloat32);
  m->to(torch::kFloat64);
  torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(h.lr).betas({h.beta1, h.beta2}).eps(h.eps).weight_decay(h.weight_decay));
  for (int w = 0; w < windows; ++w) {
    opt.zero_grad();
    for (int a = 0; a < A; ++a) {
      const int s = w * A + a;
      torch::Tensor loss = torch::zeros({}, torch::kFloat64);
      for (int r = 0; r < world; ++r) {  // mean over ranks of each rank's mean loss = the global mean
        auto x = kind == Model::mlp ? data.x[s][r].to(torch::kFloat64) : data.x[s][r];
        auto y = kind == Model::mlp ? data.y[s][r].to(torch::kFloat64) : data.y[s][r];
        loss = loss + model_loss(kind, *m, x, y);
      }
      (loss / (world * A)).backward();
    }
    const double n = torch::nn::utils::clip_grad_norm_(m->parameters(), max_norm > 0 ? max_norm : 1e30);
    if (norms) norms->push_back(float(n));
    opt.step();
  }
  Params out;
  for (auto& item : m->named_parameters()) out[item.key()] = item.value().detach().to(torch::kFloat32);
  return out;
}

// ---- the parity matrix ------------------------------------------------------------------------------
template <class C, int A>
void parity_matrix(Model kind, int world) {
  using Base = Strategy<Sharded<Stage0>, Accumulate<A>, Precision<C, float>>;
  const auto dtype = nn::detail::scalar_type_of<C>();
  const int windows = 10;
  const std::string tag = std::string(kind == Model::mlp ? "mlp" : "llama") + " world " + std::to_string(world) + " " +
                          std::string(dtype_name<C>()) + " accumulate " + std::to_string(A);
  const auto base = train<Base>(kind, world, windows);
  expect_trained(base.params, kind, dtype);

  const auto s1 = train<Strategy<Sharded<Stage1>, Accumulate<A>, Precision<C, float>>>(kind, world, windows);
  const auto s1o = train<Strategy<Sharded<Stage1>, Offload<Host>, Accumulate<A>, Precision<C, float>>>(kind, world, windows);
  const auto s2 = train<Strategy<Sharded<Stage2>, Accumulate<A>, Precision<C, float>>>(kind, world, windows);
  const auto s2o = train<Strategy<Sharded<Stage2>, Offload<Host>, Accumulate<A>, Precision<C, float>>>(kind, world, windows);
  const auto s3 = train<Strategy<Sharded<Stage3>, Accumulate<A>, Precision<C, float>>>(kind, world, windows);
  const auto s3o = train<Strategy<Sharded<Stage3>, Offload<Host>, Accumulate<A>, Precision<C, float>>>(kind, world, windows);

  expect_bitwise(s1.params, base.params, "Stage1 vs Stage0, " + tag);
  expect_bitwise(s1o.params, s1.params, "Stage1+Offload vs Stage1, " + tag);
  expect_bitwise(s2o.params, s2.params, "Stage2+Offload vs Stage2, " + tag);
  expect_bitwise(s3.params, s2.params, "Stage3 vs Stage2, " + tag);
  expect_bitwise(s3o.params, s3.params, "Stage3+Offload vs Stage3, " + tag);
  if constexpr (A == 1) {
    expect_bitwise(s2.params, base.params, "Stage2 vs Stage0, " + tag);
  } else {
    if constexpr (std::is_same_v<C, float>) expect_close(s2.params, base.params, 1e-6, 0.0, "Stage2 vs Stage0, " + tag);
    else expect_update_close(s2.params, base.params, kind, 0.2, "Stage2 vs Stage0, " + tag);
  }
  // Every variant reports the same loss trajectory on rank 0 as the baseline (bitwise where params are).
  for (std::size_t i = 0; i < base.log.size(); ++i) EXPECT_EQ(s1.log[i].loss, base.log[i].loss) << tag;

  // Against unsharded single-process training in float64 on the same global batches.
  const auto ref = reference_float64(kind, world, windows, A);
  if constexpr (std::is_same_v<C, float>) expect_close(base.params, ref, 2e-5, 0.0, "Stage0 vs float64 single process, " + tag);
  else expect_update_close(base.params, ref, kind, 0.25, "Stage0 vs float64 single process, " + tag);
}

struct WorldParam : ::testing::TestWithParam<int> {};

TEST_P(WorldParam, MlpFloatAccumulate1) { parity_matrix<float, 1>(Model::mlp, GetParam()); }
TEST_P(WorldParam, MlpFloatAccumulate4) { parity_matrix<float, 4>(Model::mlp, GetParam()); }
TEST_P(WorldParam, MlpBf16Accumulate1) { parity_matrix<bf16, 1>(Model::mlp, GetParam()); }
TEST_P(WorldParam, MlpBf16Accumulate4) { parity_matrix<bf16, 4>(Model::mlp, GetParam()); }
TEST_P(WorldParam, LlamaFloatAccumulate1) { parity_matrix<float, 1>(Model::llama, GetParam()); }
TEST_P(WorldParam, LlamaBf16Accumulate4) { parity_matrix<bf16, 4>(Model::llama, GetParam()); }

INSTANTIATE_TEST_SUITE_P(Zero, WorldParam, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// ---- flat parameters ----------------------------------------------------------------------------------
TEST(FlatParams, ViewsPaddingAndGrads) {
  auto m = make_model(Model::mlp, torch::kFloat32);
  std::vector<std::pair<std::string, torch::Tensor>> ps;
  Params before;
  for (auto& item : m->named_parameters()) ps.emplace_back(item.key(), item.value()), before[item.key()] = item.value().detach().clone();
  nn::FlatParams flat(ps, /*world=*/3, /*align=*/16);
  EXPECT_EQ(flat.padded() % (3 * 16), 0);
  EXPECT_EQ(flat.shard() * 3, flat.padded());
  int64_t numel = 0;
  for (auto& e : flat.entries()) {
    EXPECT_EQ(e.offset % 16, 0) << e.name;
    EXPECT_TRUE(torch::equal(e.param, before[e.name])) << "values kept: " << e.name;
    EXPECT_EQ(e.param.data_ptr<float>(), flat.flat().data_ptr<float>() + e.offset) << "a view: " << e.name;
    numel += e.numel;
  }
  EXPECT_EQ(numel, flat.numel());
  flat.attach_grads();
  auto x = torch::randn({4, 7}), y = torch::randn({4, 5});
  static_cast<MLPImpl&>(*m).loss(x, y).backward();
  double in_views = 0;
  for (auto& e : flat.entries()) {
    EXPECT_EQ(e.param.grad().data_ptr<float>(), flat.grad().data_ptr<float>() + e.offset) << "grad is a view: " << e.name;
    in_views += e.param.grad().abs().sum().item<double>();
  }
  EXPECT_GT(in_views, 0);
  auto gaps = torch::ones({flat.padded()}, torch::kBool);
  for (auto& e : flat.entries()) gaps.narrow(0, e.offset, e.numel).fill_(false);
  EXPECT_GT(gaps.sum().item<int64_t>(), 0);
  EXPECT_EQ(flat.grad().masked_select(gaps).abs().max().item<float>(), 0.f) << "padding and gaps stay zero";
  EXPECT_EQ(flat.flat().masked_select(gaps).abs().max().item<float>(), 0.f);
  // A bad group is a clear error.
  auto a = torch::zeros({3}), b = torch::zeros({3}, torch::kFloat64);
  EXPECT_THROW(nn::FlatParams({{"a", a}, {"b", b}}, 2), c10::Error);
  EXPECT_THROW(nn::FlatParams({{"a", a}}, 0), c10::Error);
}

// ---- overflow: inf in one rank's shard -------------------------------------------------------------------
template <class S>
void overflow_skips_everywhere(int world) {
  const Data data = make_data(Model::mlp, world, 3, 6);
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < world; ++r) models.push_back(make_model(Model::mlp, nn::detail::scalar_type_of<typename S::compute_type>()));
  nn::TrainerOptions opt;
  opt.loss_scale.init_scale = 1024.0f;  // 2^16 overflows this model's fp16 gradients on the first step
  opt.align_bytes = 2;  // element-aligned, so `gain` spreads over several ranks' shards
  std::atomic<int> skipped{0};
  run_ranks(world, [&](std::shared_ptr<LocalComm> comm) {
    const int r = comm->rank();
    auto& model = static_cast<MLPImpl&>(*models[r]);
    auto trainer = make_trainer<S>(models[r], Hyper{}, comm, opt);
    auto res0 = trainer.step([&] { return model.loss(data.x[0][r].to(torch::kHalf), data.y[0][r].to(torch::kHalf)); });
    ASSERT_TRUE(res0.applied);
    const float scale_before = trainer.scale();
    auto params_before = trainer.full_parameters();
    std::vector<std::vector<torch::Tensor>> state_before;
    for (auto& part : trainer.optimizer_state()) {
      state_before.emplace_back();
      for (auto& t : part) state_before.back().push_back(t.defined() ? t.clone() : t);
    }
    // Rank 1 (or 0 alone) poisons one element of its local gradient of `gain`: after the reduction it
    // sits in exactly one rank's shard.
    const int poisoner = world > 1 ? 1 : 0;
    std::optional<unsigned> hook;
    if (r == poisoner)
      hook = model.gain.register_hook([](torch::Tensor g) {
        auto h = g.clone();
        h[11] = std::numeric_limits<float>::infinity();
        return h;
      });
    auto res1 = trainer.step([&] { return model.loss(data.x[1][r].to(torch::kHalf), data.y[1][r].to(torch::kHalf)); });
    if (hook) model.gain.remove_hook(*hook);
    EXPECT_TRUE(res1.boundary);
    EXPECT_FALSE(res1.applied) << "rank " << r;
    EXPECT_FALSE(std::isfinite(res1.grad_norm));
    EXPECT_EQ(trainer.scale(), scale_before * 0.5f) << "the dynamic scale backs off";
    EXPECT_EQ(trainer.steps_applied(), 1);
    if (!res1.applied) ++skipped;
    auto params_after = trainer.full_parameters();
    for (std::size_t i = 0; i < params_after.size(); ++i)
      EXPECT_TRUE(torch::equal(params_after[i].second, params_before[i].second)) << "unchanged: " << params_after[i].first;
    auto state_after = trainer.optimizer_state();
    for (std::size_t p = 0; p < state_after.size(); ++p)
      for (std::size_t k = 0; k < state_after[p].size(); ++k)
        if (state_after[p][k].defined()) EXPECT_TRUE(torch::equal(state_after[p][k], state_before[p][k])) << "optimizer state unchanged";
    // The next clean step applies again at the reduced scale.
    auto res2 = trainer.step([&] { return model.loss(data.x[2][r].to(torch::kHalf), data.y[2][r].to(torch::kHalf)); });
    EXPECT_TRUE(res2.applied);
    EXPECT_EQ(res2.scale, scale_before * 0.5f);
  });
  EXPECT_EQ(skipped.load(), world);
}

TEST(Overflow, InfInOneShardSkipsOnAllRanksStage1) {
  for (int w : {1, 2, 3, 4}) overflow_skips_everywhere<Strategy<Sharded<Stage1>, Precision<half, float>>>(w);
}
TEST(Overflow, InfInOneShardSkipsOnAllRanksStage2) {
  for (int w : {2, 3, 4}) overflow_skips_everywhere<Strategy<Sharded<Stage2>, Precision<half, float>>>(w);
}
TEST(Overflow, InfInOneShardSkipsOnAllRanksStage3Offload) {
  for (int w : {2, 3, 4}) overflow_skips_everywhere<Strategy<Sharded<Stage3>, Offload<Host>, Precision<half, float>>>(w);
}

// ---- clipping by the global norm ---------------------------------------------------------------------------
template <class S>
void clipping_uses_global_norm(int world) {
  Hyper h;
  h.eps = 1e-2f;  // Adam's step is scale-invariant up to eps: a large eps makes clipping visible in the update
  nn::TrainerOptions opt;
  opt.max_grad_norm = 0.05f;
  std::vector<float> ref_norms;
  const auto ref = reference_float64(Model::mlp, world, 3, 1, opt.max_grad_norm, h, &ref_norms);
  const auto got = train<S>(Model::mlp, world, 3, opt, h);
  const auto unclipped = train<S>(Model::mlp, world, 3, {}, h);
  ASSERT_EQ(got.log.size(), ref_norms.size());
  for (std::size_t i = 0; i < ref_norms.size(); ++i) {
    EXPECT_GT(got.log[i].grad_norm, opt.max_grad_norm) << "clipping triggers";
    EXPECT_NEAR(got.log[i].grad_norm, ref_norms[i], 1e-5 * ref_norms[i]) << "the global norm, step " << i;
  }
  expect_close(got.params, ref, 2e-5, 0.0, "clipped vs float64 reference");
  // The comparison has teeth: without clipping the parameters end elsewhere.
  double diff = 0;
  for (auto& [n, t] : got.params) diff = std::max(diff, (t - unclipped.params.at(n)).abs().max().template item<double>());
  EXPECT_GT(diff, 1e-3);
}

TEST(Clipping, GlobalNormAcrossShards) {
  for (int w : {1, 3, 4}) {
    clipping_uses_global_norm<Strategy<Sharded<Stage1>>>(w);
    clipping_uses_global_norm<Strategy<Sharded<Stage2>>>(w);
    clipping_uses_global_norm<Strategy<Sharded<Stage3>, Offload<Host>>>(w);
  }
}

// ---- memory: stage-3 bytes per rank vs the planner -----------------------------------------------------
template <class S>
nn::MemoryReport memory_of(int world, nn::TrainerOptions opt) {
  const Data data = make_data(Model::llama, world, 1, 2);
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < world; ++r) models.push_back(make_model(Model::llama, nn::detail::scalar_type_of<typename S::compute_type>()));
  nn::MemoryReport rep;
  run_ranks(world, [&](std::shared_ptr<LocalComm> comm) {
    const int r = comm->rank();
    auto trainer = make_trainer<S>(models[r], Hyper{}, comm, opt);
    trainer.step([&] { return model_loss(Model::llama, *models[r], data.x[0][r], data.y[0][r]); });
    if (r == 0) rep = trainer.memory_report(kLlamaShape, {1, 6});
  });
  return rep;
}

TEST(Memory, Stage3MatchesThePlanner) {
  // Element alignment and a world size that divides every layer: the planner's Ψ/N is exact per layer.
  nn::TrainerOptions opt;
  opt.align_bytes = 1;
  const int64_t persistent = kLlamaShape.layers * 2 * kLlamaShape.hidden + kLlamaShape.hidden;  // RMSNorm gains
  for (int world : {1, 2, 4}) {
    using S = Strategy<Sharded<Stage3>, Precision<bf16, float>>;
    const auto rep = memory_of<S>(world, opt);
    const auto& a = rep.actual;
    const auto& p = rep.predicted;
    SCOPED_TRACE("world " + std::to_string(world) + "\n" + rep.table());
    ASSERT_EQ(p.total_params % world, 0);
    EXPECT_EQ(a.persistent_params, persistent);
    // Sharded: master and Adam state exactly as planned (persistent gains are sharded there too).
    EXPECT_EQ(a.master_weights.device, p.master_weights.device);
    EXPECT_EQ(a.optimizer_state.device, p.optimizer_state.device);
    // Parameters: Ψ/N·2 planned; the whole-kept gains add their other ranks' part.
    EXPECT_EQ(a.parameters.device, p.parameters.device + persistent * 2 * (world - 1) / world);
    // Gradients: shard(Ψ)·2 planned; the gains' full gradient buffer comes on top.
    EXPECT_EQ(a.gradients.device, p.gradients.device + persistent * 2);
    // Communication: at most the planner's three gather buckets.
    if (world > 1) {
      EXPECT_GT(a.communication.device, 0);
      EXPECT_LE(a.communication.device, p.communication.device);
    }
  }
  // Offload<Host>: master and state move to the host, as planned.
  using SO = Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>>;
  const auto rep = memory_of<SO>(2, opt);
  EXPECT_EQ(rep.actual.master_weights.host, rep.predicted.master_weights.host);
  EXPECT_EQ(rep.actual.optimizer_state.host, rep.predicted.optimizer_state.host);
  EXPECT_EQ(rep.actual.gradients.host, rep.predicted.gradients.host);
  EXPECT_EQ(rep.actual.master_weights.device + rep.actual.optimizer_state.device, 0);
}

TEST(Memory, Stage1And2ShardStateAsPlanned) {
  nn::TrainerOptions opt;
  opt.align_bytes = 1;
  const auto r1 = memory_of<Strategy<Sharded<Stage1>, Precision<bf16, float>>>(4, opt);
  EXPECT_EQ(r1.actual.parameters.device, r1.predicted.parameters.device);
  EXPECT_EQ(r1.actual.master_weights.device, r1.predicted.master_weights.device);
  EXPECT_EQ(r1.actual.optimizer_state.device, r1.predicted.optimizer_state.device);
  // Stage 1 keeps the full gradient (planned) plus the reduced shard it updates from.
  EXPECT_EQ(r1.actual.gradients.device, r1.predicted.gradients.device + r1.predicted.gradients.device / 4);
}

// ---- bad input ----------------------------------------------------------------------------------------
TEST(Trainer, BadInputIsAClearError) {
  auto m = make_model(Model::mlp, torch::kFloat32);
  auto one = LocalComm::single();
  // Wrong dtype for the strategy.
  EXPECT_THROW((make_trainer<Strategy<Sharded<Stage1>, Precision<bf16, float>>>(m, Hyper{}, one)), c10::Error);
  // Bad hyper-parameters.
  Hyper bad;
  bad.beta1 = 1.5f;
  EXPECT_THROW((make_trainer<Strategy<Sharded<Stage1>>>(m, bad, one)), squeeze::Error);
  // A closure that returns a non-scalar.
  auto t = make_trainer<Strategy<Sharded<Stage2>>>(m, Hyper{}, one);
  EXPECT_THROW(t.step([] { return torch::ones({2}, torch::requires_grad()); }), c10::Error);
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);  // ranks are threads already; also keeps BLAS results identical run to run
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
