// The trainer's parts (include/squeeze/train/parts/) on their own: the table that picks them, the accumulation
// window, the loss scale, the parameter groups, and how the gradient-sync parts cut partitions. The trainer they
// compose is tested end to end in tests/train/test_zero.cpp.
#include <gtest/gtest.h>

#include <squeeze/comm/local.hpp>
#include <squeeze/train.hpp>

#include <cmath>
#include <string>
#include <type_traits>

namespace sq = squeeze;
namespace tr = squeeze::train;
using namespace squeeze;

namespace {

template <class S>
using SyncOf = typename tr::TrainerParts<S>::GradientSync;
template <class S>
using StateOf = typename tr::TrainerParts<S>::OptimizerState;

// The table: one part per Strategy axis.
static_assert(std::is_same_v<SyncOf<Strategy<Sharded<Stage0>>>, tr::ReplicatedGrads<Strategy<Sharded<Stage0>>>>);
static_assert(std::is_same_v<SyncOf<Strategy<Sharded<Stage1>>>, tr::ReplicatedGrads<Strategy<Sharded<Stage1>>>>);
static_assert(std::is_same_v<SyncOf<Strategy<Sharded<Stage2>>>, tr::BucketedGrads<Strategy<Sharded<Stage2>>>>);
static_assert(std::is_same_v<SyncOf<Strategy<Sharded<Stage3>>>, tr::GatherUnits<Strategy<Sharded<Stage3>>>>);
static_assert(std::is_same_v<StateOf<Strategy<Sharded<Stage2>>>, tr::DeviceAdamW<Strategy<Sharded<Stage2>>>>);
static_assert(std::is_same_v<StateOf<Strategy<Sharded<Stage2>, Offload<Host>>>, tr::HostAdamW<Strategy<Sharded<Stage2>, Offload<Host>>>>);
static_assert(tr::GradientSyncPart<tr::GatherUnits<Strategy<Sharded<Stage3>, Offload<Host>>>>);
static_assert(tr::OptimizerStatePart<tr::HostAdamW<Strategy<Sharded<Stage3>, Offload<Host>, QuantizedState<8>>>>);
static_assert(tr::HostAdamW<Strategy<Sharded<Stage1>, Offload<Host>>>::on_host && !tr::DeviceAdamW<Strategy<>>::on_host);

TEST(Parts, WindowWeighsMicroBatchesEquallyAndEndsOnTheLast) {
  auto comm = comm::LocalComm::single();
  tr::AccumulationWindow<3> w;
  for (int window = 0; window < 2; ++window)
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(w.micro(), i);
      const auto mb = w.begin(0, *comm, torch::kCPU);
      EXPECT_DOUBLE_EQ(mb.weight, 1.0 / 3.0);
      EXPECT_EQ(mb.boundary, i == 2);
      w.end(mb.boundary);
    }
  EXPECT_DOUBLE_EQ(w.token_factor(*comm, torch::kCPU), 1.0);
}

TEST(Parts, WindowWeighsTokensAgainstTheFirstMicroBatch) {
  auto comm = comm::LocalComm::single();
  tr::AccumulationWindow<3> w;
  const int64_t tokens[3] = {10, 20, 7};
  for (int i = 0; i < 3; ++i) {
    const auto mb = w.begin(tokens[i], *comm, torch::kCPU);
    EXPECT_DOUBLE_EQ(mb.weight, double(tokens[i]) / 10.0);  // the reference is the first micro-batch's count
    if (i < 2) w.end(mb.boundary);
  }
  // The reduced gradient is the average of weighted sums; the factor turns it into the mean over 37 tokens.
  EXPECT_DOUBLE_EQ(w.token_factor(*comm, torch::kCPU), 10.0 / 37.0);
}

TEST(Parts, WindowRefusesAMicroBatchThatDropsTheTokenCount) {
  auto comm = comm::LocalComm::single();
  tr::AccumulationWindow<2> w;
  w.end(w.begin(5, *comm, torch::kCPU).boundary);
  try {
    (void)w.begin(0, *comm, torch::kCPU);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("passes no token count but the window's first did"), std::string::npos) << e.what();
  }
}

TEST(Parts, LossScaleFollowsThePolicy) {
  const kernels::LossScaleOptions o{.init_scale = 1024.0f, .growth_interval = 2};
  tr::LossScale<Strategy<Precision<bf16, float>>> none(o);
  EXPECT_EQ(none.scale(), 1.0f);
  tr::LossScale<Strategy<Precision<half, float>, StaticLossScale<7>>> fixed(o);
  EXPECT_EQ(fixed.scale(), 128.0f);
  fixed.overflowed();
  EXPECT_EQ(fixed.scale(), 128.0f);  // a static scale never moves
  tr::LossScale<Strategy<Precision<half, float>>> dynamic(o);
  EXPECT_EQ(dynamic.scale(), 1024.0f);
  dynamic.overflowed();
  EXPECT_EQ(dynamic.scale(), 512.0f);
  dynamic.applied();
  dynamic.applied();
  EXPECT_EQ(dynamic.scale(), 1024.0f);  // grows after growth_interval clean steps
  dynamic.restore(64.0f, 1);
  EXPECT_EQ(dynamic.scale(), 64.0f);
  EXPECT_THROW(dynamic.restore(64.0f, -1), c10::Error);
  EXPECT_THROW(dynamic.restore(-1.0f, 0), c10::Error);
}

TEST(Parts, ParameterGroupsKeepDecayOffNormsBiasesAndEmbeddings) {
  const tr::NamedTensors params = {{"embed.weight", torch::zeros({4, 3})},
                                   {"norm.weight", torch::zeros({3})},
                                   {"proj.weight", torch::zeros({5, 3})},
                                   {"proj.bias", torch::zeros({5})},
                                   {"head.weight", torch::zeros({4, 3})}};
  tr::TrainerOptions opt;
  opt.param_groups = {{.match = [](const std::string& n) { return n.starts_with("head."); }, .lr_scale = 0.5f, .weight_decay = 0.2f}};
  const tr::ParamGroups g(opt, params, {"embed.weight"});
  EXPECT_EQ(g.group_of.at("embed.weight"), 1);
  EXPECT_EQ(g.group_of.at("norm.weight"), 1);
  EXPECT_EQ(g.group_of.at("proj.weight"), 0);
  EXPECT_EQ(g.group_of.at("proj.bias"), 1);
  EXPECT_EQ(g.group_of.at("head.weight"), 2);  // the user's group wins over the default rule
  const AdamW adamw{.lr = 1e-3f, .weight_decay = 0.1f};
  const auto cs = g.coeffs(adamw, 1);
  ASSERT_EQ(cs.size(), 3u);
  EXPECT_EQ(cs[0].weight_decay, 0.1f);
  EXPECT_EQ(cs[1].weight_decay, 0.0f);  // no decay
  EXPECT_EQ(cs[2].weight_decay, 0.2f);
  EXPECT_FLOAT_EQ(cs[2].lr, 0.5f * 1e-3f);

  opt.param_groups = {{.match = [](const std::string&) { return true; }, .lr_scale = -1.0f}};
  EXPECT_THROW(tr::ParamGroups(opt, params, {}), c10::Error);
}

// Stage 2's buckets: about bucket_bytes each, filled from the last parameter backwards, each keeping module order.
TEST(Parts, BucketsFillFromTheLastParameter) {
  using S = Strategy<Sharded<Stage2>>;
  tr::TrainContext ctx;
  ctx.comm = comm::LocalComm::single();
  ctx.opt.bucket_bytes = 800;
  ctx.opt.align_bytes = 4;
  tr::NamedTensors params;
  for (const char* n : {"a", "b", "c"}) params.emplace_back(n, torch::randn({100}).requires_grad_());
  ctx.groups = tr::ParamGroups(ctx.opt, params, {});
  ctx.collectives = std::make_unique<engine::SideStream>();
  ctx.grads.comm = ctx.comm;
  ctx.grads.collectives = ctx.collectives.get();
  tr::DeviceAdamW<S> state(ctx);
  torch::nn::Module unused;
  tr::BucketedGrads<S> sync(ctx, state, unused, params);
  const auto views = sync.views();
  ASSERT_EQ(views.size(), 2u);
  EXPECT_EQ(views[0].key, "bucket0");
  ASSERT_EQ(views[0].layout->entries().size(), 2u);
  EXPECT_EQ(views[0].layout->entries()[0].name, "b");
  EXPECT_EQ(views[0].layout->entries()[1].name, "c");
  EXPECT_EQ(views[1].layout->entries()[0].name, "a");
  for (const auto& v : views) {
    EXPECT_FALSE(v.whole);
    EXPECT_FALSE(v.sharded);
    EXPECT_EQ(v.state->m.numel(), v.layout->padded());  // one rank: the shard is the whole bucket
  }
  // The parameters are views of the buckets: an update of the partition is the module's.
  sync.partitions()[1]->param.fill_(2.0f);
  EXPECT_TRUE(torch::equal(params[0].second.detach(), torch::full({100}, 2.0f)));
}

// Stage 3's units: one partition per gather unit (whole-kept parameters first), its layers' tensors emptied.
struct TwoLayerBlockImpl : torch::nn::Module, engine::GatherUnit {
  nn::Linear a{nullptr}, b{nullptr};
  TwoLayerBlockImpl() : a(register_module("a", nn::Linear(6, 5))), b(register_module("b", nn::Linear(5, 6))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::relu(a(x))); }
};
TORCH_MODULE(TwoLayerBlock);
struct UnitsModelImpl : torch::nn::Module {
  TwoLayerBlock first{nullptr}, second{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  UnitsModelImpl()
      : first(register_module("first", TwoLayerBlock())),
        second(register_module("second", TwoLayerBlock())),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({6})))) {}
  torch::Tensor forward(const torch::Tensor& x) { return norm(second(first(x))); }
};
TORCH_MODULE(UnitsModel);

TEST(Parts, GatherUnitsHoldOnePartitionPerBlock) {
  torch::manual_seed(0);
  UnitsModel model;
  auto trainer = make_trainer<Strategy<Sharded<Stage3>>>(model, AdamW{.lr = 1e-2f}, comm::LocalComm::single(), {.replicate = {"norm"}});
  const auto parts = trainer.partition_buffers();
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0].key, "bucket0");  // the norm, kept whole
  EXPECT_EQ(parts[1].key, "first");
  EXPECT_EQ(parts[2].key, "second");
  EXPECT_EQ(parts[1].layout->entries().size(), 4u);  // a.weight, a.bias, b.weight, b.bias
  EXPECT_EQ(model->first->a->weight.numel(), 0);     // the shard holds the values
  const auto x = torch::randn({3, 6});
  const auto before = trainer.gather_parameter("first.a.weight");
  const auto r = trainer.step([&] { return model->forward(x).square().mean(); });
  EXPECT_TRUE(r.applied);
  EXPECT_FALSE(torch::equal(before, trainer.gather_parameter("first.a.weight")));
}

}  // namespace
