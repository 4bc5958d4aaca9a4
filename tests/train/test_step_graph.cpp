// Graphed (train/parts/step_graph.hpp): forward and backward replayed from a CUDA graph. On the CPU every micro-batch
// runs eagerly under the same rules (fixed shapes, a fixed loss weight, kept gradient buffers), so training equals
// Eager bit for bit; on a GPU (label cuda, built with SQUEEZE_TORCH_CUDA) the replayed steps equal the eager ones within
// float rounding (1e-5 absolute on float parameters after 8 steps; the same kernels, launched from the graph), and a
// capture that cannot be made is a clear error.
#include <torch/cuda.h>

#include <squeeze/policy/strategy_name.hpp>

#include "zero_common.hpp"

namespace {

using namespace zero_test;
namespace tr = squeeze::train;

using GraphedF32 = Strategy<Graphed>;
using GraphedBf16 = Strategy<Precision<bf16, float>, Graphed>;

static_assert(std::is_same_v<tr::TrainerParts<GraphedF32>::StepLaunch, tr::StepGraph>);
static_assert(std::is_same_v<tr::TrainerParts<Strategy<>>::StepLaunch, tr::EagerStep>);
static_assert(std::is_same_v<Strategy<Graphed, Sharded<Stage1>>::canonical, Strategy<Sharded<Stage1>, Graphed>::canonical>);

template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

auto mlp_trainer(torch::Device device = torch::kCPU) {
  auto model = std::dynamic_pointer_cast<MLPImpl>(make_model(Model::mlp, torch::kFloat32));
  model->to(device);
  return std::make_pair(model, zero_trainer<GraphedF32>(model, Hyper{}, LocalComm::single()));
}

TEST(StepGraph, StrategyNameSaysGraphed) {
  using QLoRAGraphed = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed, Graphed>;
  EXPECT_EQ(strategy_name<QLoRAGraphed>(),
            "Strategy<Precision<bf16, float>, Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Checkpointed, Graphed>");
}

TEST(StepGraph, TrainsAsEagerBitForBitOnTheCpu) {
  for (Model kind : {Model::mlp, Model::llama}) {
    const std::string what = kind == Model::mlp ? "mlp" : "llama";
    expect_bitwise(train<GraphedF32>(kind, 1, 6).params, train<Strategy<>>(kind, 1, 6).params, "Graphed float " + what);
    expect_bitwise(train<GraphedBf16>(kind, 1, 6).params, train<Strategy<Precision<bf16, float>>>(kind, 1, 6).params,
                   "Graphed bf16 " + what);
  }
  // Stage 1 communicates after backward, outside the graph: two ranks agree with Eager too.
  expect_bitwise(train<Strategy<Sharded<Stage1>, Graphed>>(Model::mlp, 2, 4).params,
                 train<Strategy<Sharded<Stage1>>>(Model::mlp, 2, 4).params, "Graphed Stage1 world 2");
}

TEST(StepGraph, RefusesABatchOfAnotherShapeNamingBoth) {
  auto [model, trainer] = mlp_trainer();
  auto loss = [&](const tr::StepInputs& in) { return model->loss(in[0], in[1]); };
  trainer.step({torch::randn({6, 7}), torch::randn({6, 5})}, loss);
  const std::string e = error_of([&] { trainer.step({torch::randn({5, 7}), torch::randn({5, 5})}, loss); });
  EXPECT_NE(e.find("input 0 is [5, 7]"), std::string::npos) << e;
  EXPECT_NE(e.find("hold [6, 7]"), std::string::npos) << e;
  EXPECT_NE(e.find("a CUDA graph replays fixed shapes"), std::string::npos) << e;
  EXPECT_NE(e.find("remove Graphed"), std::string::npos) << e;
  // A dtype change is another shape of the same input.
  const std::string d = error_of([&] { trainer.step({torch::randn({6, 7}, torch::kFloat64), torch::randn({6, 5})}, loss); });
  EXPECT_NE(d.find("input 0 is [6, 7] Double"), std::string::npos) << d;
  // The failed calls left the trainer usable: the right shape trains on.
  EXPECT_NO_THROW(trainer.step({torch::randn({6, 7}), torch::randn({6, 5})}, loss));
  EXPECT_EQ(trainer.steps_applied(), 2);
}

TEST(StepGraph, RefusesAnotherNumberOfInputs) {
  auto [model, trainer] = mlp_trainer();
  auto loss = [&](const tr::StepInputs& in) { return model->loss(in[0], in[1]); };
  trainer.step({torch::randn({4, 7}), torch::randn({4, 5})}, loss);
  const std::string e = error_of([&] { trainer.step({torch::randn({4, 7})}, loss); });
  EXPECT_NE(e.find("1 inputs, but the first micro-batch had 2"), std::string::npos) << e;
  const std::string none = error_of([&] {
    auto [m2, t2] = mlp_trainer();
    t2.step({}, [&](const tr::StepInputs&) { return m2->loss(torch::randn({4, 7}), torch::randn({4, 5})); });
  });
  EXPECT_NE(none.find("the batch has no tensors"), std::string::npos) << none;
  // A refused first batch makes no buffers: the next call is a first one.
  auto [m3, t3] = mlp_trainer();
  const std::string undefined = error_of([&] {
    t3.step({torch::randn({4, 7}), torch::Tensor()}, [&](const tr::StepInputs& in) { return m3->loss(in[0], in[1]); });
  });
  EXPECT_NE(undefined.find("input 1 of the batch is undefined"), std::string::npos) << undefined;
  EXPECT_NO_THROW(t3.step({torch::randn({3, 7}), torch::randn({3, 5})}, [&](const tr::StepInputs& in) { return m3->loss(in[0], in[1]); }));
}

TEST(StepGraph, KeepsTheGradientBuffersAndRefusesOthers) {
  auto model = std::dynamic_pointer_cast<MLPImpl>(make_model(Model::mlp, torch::kFloat32));
  tr::TrainerOptions opt;
  opt.gradient_buffers = tr::GradientBuffers::after_backward;  // what a graph cannot add into: kept instead
  auto trainer = make_trainer<GraphedF32>(model, Hyper{}, LocalComm::single(), opt);
  trainer.step({torch::randn({4, 7}), torch::randn({4, 5})}, [&](const tr::StepInputs& in) { return model->loss(in[0], in[1]); });
  EXPECT_GT(trainer.memory().gradients.device + trainer.memory().gradients.host, 0) << "the gradient buffer is kept between steps";
  const std::string e = error_of([&] { trainer.set_gradient_buffers(tr::GradientBuffers::at_backward); });
  EXPECT_NE(e.find("Graphed keeps the gradient buffers"), std::string::npos) << e;
  EXPECT_NO_THROW(trainer.set_gradient_buffers(tr::GradientBuffers::kept));
}

TEST(StepGraph, ThePlannerKeepsGradientBuffersUnderGraphed) {
  const plan::ModelShape m{/*vocab=*/32000, /*hidden=*/2048, /*layers=*/22, /*heads=*/32, /*kv_heads=*/4, /*ffn=*/5632};
  plan::TrainShape t;
  t.micro_batch = 2;
  t.seq = 512;
  EXPECT_EQ(plan::best_gradient_buffers<GraphedBf16>(m, t, 1), plan::GradientBuffers::kept);
}

// ---- on a GPU ---------------------------------------------------------------------------------------------
#if SQUEEZE_NN_STREAMS
constexpr bool kGraphsBuilt = true;
#else
constexpr bool kGraphsBuilt = false;  // engine/streams.hpp without SQUEEZE_TORCH_CUDA: CUDA tensors run eagerly
#endif
#define REQUIRE_GRAPHS()                             \
  if (!kGraphsBuilt || !torch::cuda::is_available()) \
  GTEST_SKIP() << "needs a CUDA device and a build with SQUEEZE_TORCH_CUDA (libtorch's CUDA side)"

TEST(StepGraphCuda, ReplaysTheEagerStepsAfterTheWarmUp) {
  REQUIRE_GRAPHS();
  const torch::Device dev(torch::kCUDA, 0);
  for (Model kind : {Model::mlp, Model::llama}) {
    const std::string what = kind == Model::mlp ? "mlp" : "llama";
    const RunResult graphed = train<GraphedF32>(kind, 1, 8, {}, {}, dev);
    const RunResult eager = train<Strategy<>>(kind, 1, 8, {}, {}, dev);
    expect_close(graphed.params, eager.params, 1e-5, 0.0, "Graphed float on the GPU " + what);
    ASSERT_EQ(graphed.log.size(), eager.log.size());
    for (std::size_t i = 0; i < graphed.log.size(); ++i) EXPECT_NEAR(graphed.log[i].loss, eager.log[i].loss, 1e-5) << what << " step " << i;
    expect_update_close(train<GraphedBf16>(kind, 1, 8, {}, {}, dev).params,
                        train<Strategy<Precision<bf16, float>>>(kind, 1, 8, {}, {}, dev).params, kind, 0.2,
                        "Graphed bf16 on the GPU " + what);
  }
}

TEST(StepGraphCuda, CapturesAfterTheWarmUpAndReplaysFromThen) {
  REQUIRE_GRAPHS();
  auto [model, trainer] = mlp_trainer(torch::Device(torch::kCUDA, 0));
  const auto opts = torch::TensorOptions().device(torch::kCUDA);
  auto loss = [&](const tr::StepInputs& in) { return model->loss(in[0], in[1]); };
  for (int i = 0; i < tr::StepGraph::kGraphWarmup; ++i) {
    trainer.step({torch::randn({6, 7}, opts), torch::randn({6, 5}, opts)}, loss);
    EXPECT_FALSE(trainer.graph_captured());
  }
  // A replay reads the batch of its call: its loss is that batch's under the weights before the update.
  const auto r = trainer.step({torch::randn({6, 7}, opts), torch::randn({6, 5}, opts)}, loss);
  EXPECT_TRUE(trainer.graph_captured());
  EXPECT_EQ(trainer.eager_micro_batches(), tr::StepGraph::kGraphWarmup);
  const auto x = torch::randn({6, 7}, opts), y = torch::randn({6, 5}, opts);
  const float expected = [&] {
    torch::NoGradGuard g;
    return model->loss(x, y).item<float>();
  }();
  const auto replayed = trainer.step({x, y}, loss);
  EXPECT_NEAR(replayed.loss, expected, 1e-5 * std::max(1.0f, std::abs(expected))) << "the replay computed another batch's loss";
  EXPECT_NE(replayed.loss, r.loss);
  const std::string e = error_of([&] { trainer.step({torch::randn({7, 7}, opts), torch::randn({7, 5}, opts)}, loss); });
  EXPECT_NE(e.find("a CUDA graph replays fixed shapes"), std::string::npos) << e;
}

TEST(StepGraphCuda, ACaptureThatWaitsForTheDeviceIsAClearError) {
  REQUIRE_GRAPHS();
  auto [model, trainer] = mlp_trainer(torch::Device(torch::kCUDA, 0));
  const auto opts = torch::TensorOptions().device(torch::kCUDA);
  float seen = 0;
  auto loss = [&](const tr::StepInputs& in) {
    torch::Tensor l = model->loss(in[0], in[1]);
    seen = l.item<float>();  // a read-back: allowed eagerly, impossible inside a capture
    return l;
  };
  for (int i = 0; i < tr::StepGraph::kGraphWarmup; ++i) trainer.step({torch::randn({6, 7}, opts), torch::randn({6, 5}, opts)}, loss);
  const std::string e = error_of([&] { trainer.step({torch::randn({6, 7}, opts), torch::randn({6, 5}, opts)}, loss); });
  EXPECT_NE(e.find("capturing forward and backward into a CUDA graph failed"), std::string::npos) << e;
  EXPECT_NE(e.find("remove Graphed"), std::string::npos) << e;
  // The device is still usable after the failed capture.
  EXPECT_NO_THROW((void)(torch::ones({3}, opts) * 2).sum().item<float>());
  (void)seen;
}

}  // namespace

int main(int argc, char** argv) {
  zero_test::reproducible_cpu_math();  // bitwise comparisons between runs
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
