// Offload<Host, Streamed>: stage-3 units live in host memory and are copied to the device for each use; each pass's
// gradient goes to the host as it is reduced. CPU, LocalComm with 1..3 thread-ranks. Label: stream.
//
// Tolerances: bitwise against Offload<Host> with resident parameters throughout. The two run the same arithmetic
// in the same order: the same gathers (a copy instead of a view), the same reduce-scatters, accumulation adds the
// same micro-batch gradients in the same dtype in the same order (on the host instead of the device), and the same
// CPU AdamW; what differs is only where the tensors live.
#include "zero_common.hpp"

#include <bit>
#include <cmath>
#include <squeeze/kernels/adamw.hpp>
#include <squeeze/kernels/adamw8.hpp>
#include <squeeze/nn/llama.hpp>
#include <squeeze/plan/memory.hpp>

namespace {

using namespace zero_test;

template <class C, int A>
using Resident = Strategy<Sharded<Stage3>, Offload<Host>, Accumulate<A>, Precision<C, float>>;
template <class C, int A>
using Streamed3 = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Accumulate<A>, Precision<C, float>>;

template <class C, int A>
void expect_streamed_equals_resident(Model kind, int world, train::TrainerOptions opt, const std::string& what) {
  const auto resident = train<Resident<C, A>>(kind, world, 4, opt);
  const auto streamed = train<Streamed3<C, A>>(kind, world, 4, opt);
  expect_trained(resident.params, kind, squeeze::torch_dtype<C>());
  expect_bitwise(streamed.params, resident.params, what);
  ASSERT_EQ(streamed.log.size(), resident.log.size());
  for (std::size_t i = 0; i < resident.log.size(); ++i) {
    EXPECT_EQ(streamed.log[i].loss, resident.log[i].loss) << what << " step " << i;
    EXPECT_EQ(streamed.log[i].grad_norm, resident.log[i].grad_norm) << what << " step " << i;
  }
}

struct WorldParam : ::testing::TestWithParam<int> {};

// Eager updates (no clipping: each unit updated as its gradient lands) and deferred ones (clipping: after the global
// norm), one micro-batch and four (accumulated on the host, fp32 with bf16 compute).
TEST_P(WorldParam, StreamedEqualsResidentBitwise) {
  const int world = GetParam();
  train::TrainerOptions clip;
  clip.max_grad_norm = 0.5f;
  expect_streamed_equals_resident<float, 1>(Model::mlp, world, {}, "mlp float, eager, world " + std::to_string(world));
  expect_streamed_equals_resident<float, 1>(Model::llama, world, clip, "llama float, clipped, world " + std::to_string(world));
  expect_streamed_equals_resident<bf16, 4>(Model::llama, world, {}, "llama bf16 accumulate 4, world " + std::to_string(world));
  expect_streamed_equals_resident<bf16, 4>(Model::mlp, world, clip, "mlp bf16 accumulate 4 clipped, world " + std::to_string(world));
}
INSTANTIATE_TEST_SUITE_P(Stream, WorldParam, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// The worker overlapping backward and the same jobs in program order give the same bits.
TEST(Stream, OverlappedEqualsInOrder) {
  for (int world : {1, 2}) {
    train::TrainerOptions in_order;
    in_order.overlap_offload = false;
    const auto a = train<Streamed3<bf16, 4>>(Model::llama, world, 4);
    const auto b = train<Streamed3<bf16, 4>>(Model::llama, world, 4, in_order);
    expect_bitwise(a.params, b.params, "overlapped vs in order, world " + std::to_string(world));
    EXPECT_TRUE(a.updated_during_backward) << "no clipping: each unit updated as its gradient landed";
    EXPECT_FALSE(b.updated_during_backward);
  }
}

// nn::Llama with a block as one gather unit and every block checkpointed: the recompute gathers the block again
// inside backward and its gradient is final only after the recompute's backward.
TEST(Stream, CheckpointedLlamaBitwise) {
  for (int world : {1, 2}) {
    train::TrainerOptions clip;
    clip.max_grad_norm = 0.3f;
    for (const train::TrainerOptions& o : {train::TrainerOptions{}, clip})
      expect_bitwise(train_checkpointed_llama<Streamed3<bf16, 1>>(world, 3, o), train_checkpointed_llama<Resident<bf16, 1>>(world, 3, o),
                     "checkpointed llama, world " + std::to_string(world));
  }
}

// Each use copies the unit from the host once: forward gathers it, backward gathers it again (a checkpointed block's
// recompute and its backward share one gather), every micro-batch; each micro-batch's gradient comes down once.
// Nothing of a unit stays on the device between steps; the host buffers hold exactly one shard each.
TEST(Stream, EachUseCopiesTheUnitOnceAndNothingStaysOnTheDevice) {
  constexpr int A = 3;
  using S = Streamed3<bf16, A>;
  auto model = make_model(Model::llama, torch::kBFloat16);
  auto trainer = zero_trainer<S>(model, Hyper{}, LocalComm::single());
  const Data data = make_data(Model::llama, 1, 2 * A, 6);
  const train::MemoryUse m = trainer.memory();
  const int64_t unit_elements = m.parameters.host / 2;  // bf16 shards
  ASSERT_GT(unit_elements, 0);
  // Against the same model with resident parameters: the units' shards and gradient shards left the device; the
  // host holds one more fp32 copy of the units' gradients (a micro-batch's landing beside the sum), nothing else.
  auto resident_model = make_model(Model::llama, torch::kBFloat16);
  const train::MemoryUse res = zero_trainer<Resident<bf16, A>>(resident_model, Hyper{}, LocalComm::single()).memory();
  EXPECT_EQ(m.gradients.host - res.gradients.host, unit_elements * 4);
  const int64_t kept_grad_bytes = res.gradients.host - unit_elements * 4;  // the norms' bucket
  EXPECT_EQ(m.master_weights.host, res.master_weights.host);
  EXPECT_EQ(m.optimizer_state.host, res.optimizer_state.host);
  EXPECT_EQ(res.parameters.device - m.parameters.device, unit_elements * 2);
  EXPECT_EQ(res.gradients.device - m.gradients.device, unit_elements * 4);
  EXPECT_EQ(m.parameters.device + m.parameters.host, res.parameters.device);
  // The embedding's backward reads no weights: it is copied for its forward only.
  const int64_t embedding = (kLlamaShape.vocab * kLlamaShape.hidden + 127) / 128 * 128;  // its shard, aligned to 256 bytes

  for (int s = 0; s < 2 * A; ++s) {
    auto r = trainer.step([&] { return model_loss(Model::llama, *model, data.x[s][0], data.y[s][0]); });
    if (!r.boundary) continue;
    EXPECT_EQ(r.transfers.h2d_bytes, A * (2 * unit_elements - embedding) * 2) << "window " << s / A << ": two gathers a micro-batch";
    EXPECT_EQ(r.transfers.d2h_bytes, A * unit_elements * 4 + kept_grad_bytes)
        << "window " << s / A << ": the units' gradients once a micro-batch (fp32), the kept-whole ones once a window";
  }
}

// The host state is counted before anything is allocated, and a model it would not fit is refused with the figures
// and what to change; the module is left as it was.
TEST(Stream, RefusedBeforeAllocatingWhenHostMemoryIsShort) {
  using S = Streamed3<bf16, 1>;
  auto model = make_model(Model::llama, torch::kBFloat16);
  std::map<std::string, torch::Tensor> before;
  for (auto& p : model->named_parameters()) before[p.key()] = p.value().detach().clone();
  train::TrainerOptions o;
  o.available_host_bytes = 1000;
  try {
    auto t = zero_trainer<S>(model, Hyper{}, LocalComm::single(), o);
    FAIL() << "a trainer needing more host memory than allowed was built";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    for (const char* want : {"Offload<Host, Streamed>", "of host memory on this rank", "parameters 2 B", "short", "QuantizedState<8>",
                             "TrainerOptions::available_host_bytes"})
      EXPECT_NE(msg.find(want), std::string::npos) << "missing '" << want << "' in: " << msg;
  }
  for (auto& p : model->named_parameters()) EXPECT_TRUE(torch::equal(p.value(), before.at(p.key()))) << p.key() << " was changed";
  // With room, the same model trains.
  o.available_host_bytes = int64_t(1) << 30;
  auto t = zero_trainer<S>(model, Hyper{}, LocalComm::single(), o);
  const Data data = make_data(Model::llama, 1, 1, 6);
  EXPECT_TRUE(t.step([&] { return model_loss(Model::llama, *model, data.x[0][0], data.y[0][0]); }).applied);
}

// TrainerOptions::planned_step: a step the planner puts beyond the device's memory is refused before the module is
// adopted (its values untouched), with the plan's parts, the shortfall and what to change; within it the trainer builds.
TEST(Stream, RefusedBeforeAdoptingWhenTheStepIsPlannedBeyondTheDevice) {
  using S = Strategy<Sharded<Stage3>, Precision<bf16, float>, Checkpointed>;
  nn::LlamaConfig cfg;
  cfg.vocab = 29, cfg.hidden = 16, cfg.layers = 3, cfg.heads = 4, cfg.kv_heads = 2, cfg.ffn = 24;
  torch::manual_seed(5);
  nn::Llama model(cfg);
  std::map<std::string, torch::Tensor> before;
  for (auto& p : model->named_parameters()) before[p.key()] = p.value().detach().clone();
  train::TrainerOptions o;
  o.planned_step = train::TrainerOptions::PlannedStep{cfg.shape(), plan::TrainShape{.micro_batch = 64, .seq = 512}};
  const int64_t need = plan::plan_memory<S>(cfg.shape(), o.planned_step->train, 1).peak().device;
  o.available_device_bytes = need - 1;
  try {
    auto t = zero_trainer<S>(model, Hyper{}, LocalComm::single(), o);
    FAIL() << "a step planned beyond the device was built";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    for (const char* want : {"plans", "micro-batches of 64 x 512 tokens", "activations", "short", "Offload<Host, Streamed>",
                             "TrainerOptions::available_device_bytes"})
      EXPECT_NE(msg.find(want), std::string::npos) << "missing '" << want << "' in: " << msg;
  }
  for (auto& p : model->named_parameters()) EXPECT_TRUE(torch::equal(p.value(), before.at(p.key()))) << p.key() << " was changed";
  o.available_device_bytes = need;
  auto t = zero_trainer<S>(model, Hyper{}, LocalComm::single(), o);
  const torch::Tensor ids = torch::randint(0, cfg.vocab, {2, 9});
  EXPECT_TRUE(t.step([&] { return model->loss(ids.narrow(1, 0, 8), ids.narrow(1, 1, 8)); }).applied);
}

// A copy that fails becomes squeeze::Error naming the unit, at once, and the runtime goes on serving other units.
TEST(Stream, CopyFailureIsAnErrorNamingTheUnit) {
  train::SideStream side(torch::kCPU);
  train::Stage3Runtime rt(LocalComm::single(), 1, 0, torch::kCPU, side);
  train::NamedTensors params{{"w", torch::zeros({5})}};
  train::Stage3Group good, bad;
  for (auto* g : {&good, &bad}) {
    g->layout = train::FlatParams(params, 1, 1, /*materialize=*/false);
    g->on_host = true;
    g->runtime = &rt;
    rt.add_group(*g);
  }
  good.name = "blocks.0", bad.name = "blocks.1";
  good.shard = torch::arange(5, torch::kFloat32);
  bad.shard = torch::zeros({3});  // injected fault: the host buffer is not the unit's size
  rt.set_phase(train::Stage3Runtime::Phase::forward);
  try {
    rt.acquire(bad);
    FAIL() << "a failed copy returned";
  } catch (const squeeze::Error& e) {
    EXPECT_NE(std::string(e.what()).find("copying unit 'blocks.1'"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(torch::equal(rt.acquire(good), torch::arange(5, torch::kFloat32)));
  EXPECT_EQ(rt.stream_stats().gathers, 2);
}

// Gradient parts of a streamed partition add up on the host in the order they came, the sum of squares is of the
// sum, and a window with no part gives zeros (not the last window's gradient).
TEST(Stream, GradientPartsAddUpOnTheHost) {
  for (bool threaded : {false, true}) {
    train::OffloadPipeline pipe(torch::kCPU, threaded);
    train::Partition p;
    p.streamed = true;
    p.host_grad = torch::zeros({1000});
    torch::manual_seed(3);
    std::vector<torch::Tensor> parts{torch::randn({1000}), torch::randn({1000}), torch::randn({1000})};
    for (auto& g : parts) pipe.gradient_part(p, g.clone());
    pipe.gradient_ready(p);
    pipe.wait(p);
    const torch::Tensor want = (parts[0] + parts[1]) + parts[2];
    EXPECT_TRUE(torch::equal(p.host_grad, want));
    EXPECT_EQ(p.sumsq, train::chunked_sum_squares(want));
    EXPECT_EQ(pipe.gradient_sum_squares(p), p.sumsq);
    EXPECT_EQ(pipe.stats().d2h_bytes, 3 * 1000 * 4);
    pipe.gradient_ready(p);  // a window in which the unit got no gradient
    pipe.wait(p);
    EXPECT_EQ(p.host_grad.abs().sum().item<float>(), 0.0f);
    EXPECT_EQ(p.sumsq, 0.0);
  }
}

// Stochastic rounding: only the two bf16 neighbours come out, the nearer more often in proportion, and the mean of
// many roundings is the exact value (an unbiased estimate: the standard error of 2^16 draws is under 1% of the gap).
TEST(Stream, StochasticRoundingIsUnbiased) {
  for (float w : {1.00390625f + 0.3f * 0.0078125f, -3.14159f, 1e-20f, 65504.5f, -0.000123f}) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(w) & 0xffff0000u;  // the magnitude truncated, and the next one up
    const float lo = std::bit_cast<float>(u), hi = std::bit_cast<float>(u + 0x10000u);
    constexpr int kDraws = 1 << 16;
    double sum = 0;
    for (int i = 0; i < kDraws; ++i) {
      const float r = to_float(kernels::round_stochastic(w, kernels::rounding_bits(77, std::uint64_t(i))));
      ASSERT_TRUE(r == lo || r == hi) << w << " rounded to " << r;
      sum += r;
    }
    const double mean = sum / kDraws, gap = std::abs(double(hi) - double(lo));
    EXPECT_NEAR(mean, double(w), 0.01 * gap) << w;
  }
  EXPECT_TRUE(std::isnan(to_float(kernels::round_stochastic(NAN, 123))));
  EXPECT_EQ(to_float(kernels::round_stochastic(INFINITY, 0xffff)), INFINITY);
}

// The AdamW update of bf16 weights that are their own master: the mean over many rounding streams is the fp32
// update, which round-to-nearest would lose (lr 1e-4 moves weights near 1 by a tenth of bf16's spacing there).
TEST(Stream, OwnMasterAdamWKeepsSmallUpdatesOnAverage) {
  constexpr int64_t n = 4099;  // not a multiple of the 8-bit state's 256-element blocks
  torch::manual_seed(5);
  const torch::Tensor w0 = (1 + 0.01 * torch::rand({n})).to(torch::kBFloat16), g = torch::randn({n}).to(torch::kBFloat16);
  const kernels::AdamWCoeffs c = kernels::adamw_coeffs(1e-4f, 0.9f, 0.999f, 1e-8f, 0.0f, 1);
  // fp32 reference: one step from the same start
  torch::Tensor master = w0.to(torch::kFloat32), m = torch::zeros({n}), v = torch::zeros({n});
  kernels::adamw_cpu(kernels::AdamWTensor<float, bf16>{master.data_ptr<float>(), nullptr, reinterpret_cast<const bf16*>(g.data_ptr()),
                                                       m.data_ptr<float>(), v.data_ptr<float>(), n},
                     c);
  const torch::Tensor exact = master.to(torch::kFloat64);
  // ... and with 8-bit moments (an fp32 master beside the bf16 weights: the update 8-bit moments give, unrounded)
  torch::Tensor master8 = w0.to(torch::kFloat32), w_ref = w0.clone(), cm = torch::zeros({n}, torch::kUInt8),
                cv = torch::zeros({n}, torch::kUInt8);
  torch::Tensor am0 = torch::zeros({kernels::state_blocks(n)}), av0 = torch::zeros({kernels::state_blocks(n)});
  kernels::adamw8_cpu(kernels::AdamW8Tensor<bf16, bf16>{reinterpret_cast<bf16*>(w_ref.data_ptr()), master8.data_ptr<float>(),
                                                        reinterpret_cast<const bf16*>(g.data_ptr()), cm.data_ptr<std::uint8_t>(),
                                                        am0.data_ptr<float>(), cv.data_ptr<std::uint8_t>(), av0.data_ptr<float>(), n},
                      c);
  const torch::Tensor exact8 = master8.to(torch::kFloat64);
  torch::Tensor mean = torch::zeros({n}, torch::kFloat64), mean8 = torch::zeros({n}, torch::kFloat64);
  constexpr int kStreams = 400;
  for (int k = 0; k < kStreams; ++k) {
    torch::Tensor w = w0.clone(), m1 = torch::zeros({n}), v1 = torch::zeros({n});
    kernels::adamw_cpu(
        kernels::AdamWTensor<bf16, bf16>{reinterpret_cast<bf16*>(w.data_ptr()), nullptr, reinterpret_cast<const bf16*>(g.data_ptr()),
                                         m1.data_ptr<float>(), v1.data_ptr<float>(), n, std::uint64_t(k) << 20},
        c);
    mean += w.to(torch::kFloat64);
    torch::Tensor w8 = w0.clone(), codes_m = torch::zeros({n}, torch::kUInt8), codes_v = torch::zeros({n}, torch::kUInt8);
    torch::Tensor am = torch::zeros({kernels::state_blocks(n)}), av = torch::zeros({kernels::state_blocks(n)});
    kernels::adamw8_cpu(
        kernels::AdamW8Tensor<bf16, bf16>{reinterpret_cast<bf16*>(w8.data_ptr()), nullptr, reinterpret_cast<const bf16*>(g.data_ptr()),
                                          codes_m.data_ptr<std::uint8_t>(), am.data_ptr<float>(), codes_v.data_ptr<std::uint8_t>(),
                                          av.data_ptr<float>(), n, std::uint64_t(k) << 20},
        c);
    mean8 += w8.to(torch::kFloat64);
  }
  mean /= kStreams, mean8 /= kStreams;
  const torch::Tensor step = exact - w0.to(torch::kFloat64);  // about lr in magnitude, far below bf16's spacing
  const double step_size = step.abs().mean().item<double>();  // what round-to-nearest loses: it keeps w0
  EXPECT_GT(step_size, 5e-5);
  for (const auto& [got, exact, what] : {std::tuple{mean, exact, "fp32 moments"}, std::tuple{mean8, exact8, "8-bit moments"}}) {
    // Along each step's direction the mean lands on the exact update: bias under 5% of the step (its standard error
    // over 400 x 4099 draws is ~1%); each element's mean is nearer the exact value than round-to-nearest's.
    const double bias = ((got - exact) * step.sign()).mean().item<double>();
    EXPECT_LT(std::abs(bias), 0.05 * step_size) << what;
    EXPECT_LT((got - exact).abs().mean().item<double>(), 0.5 * step_size) << what;
  }
  // A master pointer is still needed for fp16, and for bf16 on the GPU launcher (checked there).
  torch::Tensor h = w0.to(torch::kFloat16);
  EXPECT_THROW(kernels::adamw_cpu(kernels::AdamWTensor<half, bf16>{reinterpret_cast<half*>(h.data_ptr()), nullptr,
                                                                   reinterpret_cast<const bf16*>(g.data_ptr()), m.data_ptr<float>(),
                                                                   v.data_ptr<float>(), n},
                                  c),
               squeeze::Error);
}

// Precision<bf16, bf16> + 8-bit moments, streamed: the compact host state of 6 bytes a parameter (bf16 weights that
// are their own master, 8-bit moments, the bf16 gradient copy) trains, and follows the fp32-master run closely.
TEST(Stream, CompactHostStateTrainsInSixBytesAParameter) {
  using Compact = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, bf16>, QuantizedState<8>>;
  using Exact = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, float>, QuantizedState<8>>;
  Hyper h;
  h.lr = 3e-3f;
  const auto compact = train<Compact>(Model::llama, 1, 20, {}, h);
  const auto exact = train<Exact>(Model::llama, 1, 20, {}, h);
  expect_trained(compact.params, Model::llama, torch::kBFloat16);
  // Random tokens: nothing to learn beyond their frequencies, so the check is the trajectory against the fp32 masters'.
  double worst = 0;
  for (std::size_t i = 0; i < exact.log.size(); ++i) {
    const double rel = std::abs(compact.log[i].loss - exact.log[i].loss) / exact.log[i].loss;
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 0.02) << "step " << i;
  }
  std::cout << "[ loss gap ] compact vs fp32 masters, 20 steps: " << worst << "\n";  // measured value, for the log
  const train::MemoryUse& m = compact.memory;
  EXPECT_EQ(m.master_weights.host, 0);
  const int64_t elements = (m.parameters.host) / 2 + m.parameters.device / 2;  // bf16 shards + kept-whole
  const int64_t host_state = m.parameters.host + m.optimizer_state.host + m.gradients.host;
  EXPECT_LE(double(host_state), 6.1 * double(elements)) << "bytes a parameter on the host";
  EXPECT_EQ(strategy_name<Compact>(), "Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, bf16>, QuantizedState<8>>");
}

// The planner's columns: the parameters and gradients leave the device; three of the largest unit stay in flight.
TEST(Stream, PlannerMovesParametersToTheHost) {
  const plan::ModelShape m{/*vocab=*/32000, /*hidden=*/4096, /*layers=*/32, /*heads=*/32, /*kv_heads=*/32, /*ffn=*/11008};
  const plan::TrainShape t{.micro_batch = 8, .seq = 2048};
  using R = Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed>;
  using St = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, float>, Checkpointed>;
  const auto r = plan::plan_memory<R>(m, t, 1), s = plan::plan_memory<St>(m, t, 1);
  EXPECT_EQ(s.parameters.host, r.parameters.device);
  EXPECT_EQ(s.parameters.device, 0);
  EXPECT_EQ(s.gradients.device, 0);
  EXPECT_EQ(s.gradients.host, r.gradients.host);
  EXPECT_EQ(s.communication.device, 3 * m.largest_gather_params() * 2);
  EXPECT_EQ(s.activations.device, r.activations.device);
  EXPECT_LT(s.peak().device, 16'000'000'000) << "LLaMA-7B at B=8, T=2048 planned under 16 GB";
  using Acc = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Accumulate<4>, Precision<bf16, float>, Checkpointed>;
  EXPECT_EQ(plan::plan_memory<Acc>(m, t, 1).gradients.host, 2 * m.params() * 4) << "fp32 sum and one landing copy";
  EXPECT_EQ(strategy_name<St>(), "Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, float>, Checkpointed>");
}

}  // namespace

int main(int argc, char** argv) {
  zero_test::reproducible_cpu_math();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
