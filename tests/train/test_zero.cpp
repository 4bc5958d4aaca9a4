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
#include "zero_common.hpp"

#include <future>
#include <set>

#include <squeeze/nn/llama.hpp>

namespace {

using namespace zero_test;

// ---- the parity matrix ------------------------------------------------------------------------------
template <class C, int A>
void parity_matrix(Model kind, int world) {
  using Base = Strategy<Sharded<Stage0>, Accumulate<A>, Precision<C, float>>;
  const auto dtype = squeeze::torch_dtype<C>();
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
    if constexpr (std::is_same_v<C, float>)
      expect_close(s2.params, base.params, 1e-6, 0.0, "Stage2 vs Stage0, " + tag);
    else
      expect_update_close(s2.params, base.params, kind, 0.2, "Stage2 vs Stage0, " + tag);
  }
  // Every variant reports the same loss trajectory on rank 0 as the baseline (bitwise where params are).
  for (std::size_t i = 0; i < base.log.size(); ++i) EXPECT_EQ(s1.log[i].loss, base.log[i].loss) << tag;

  // Against unsharded single-process training in float64 on the same global batches.
  const auto ref = reference_float64(kind, world, windows, A);
  if constexpr (std::is_same_v<C, float>)
    expect_close(base.params, ref, 2e-5, 0.0, "Stage0 vs float64 single process, " + tag);
  else
    expect_update_close(base.params, ref, kind, 0.25, "Stage0 vs float64 single process, " + tag);
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

// ---- stage 3: prefetch and the persistence threshold ---------------------------------------------------
TEST(Stage3, PrefetchAndPersistenceKeepResultsBitwise) {
  using S0 = Strategy<Sharded<Stage0>, Precision<bf16, float>>;
  using S3 = Strategy<Sharded<Stage3>, Precision<bf16, float>>;
  for (int world : {2, 3}) {
    const auto base = train<S0>(Model::llama, world, 4);
    train::TrainerOptions no_prefetch;
    no_prefetch.prefetch_depth = 0;
    train::TrainerOptions persistent;
    persistent.persistence_threshold = 300;  // k, v (128 each) and q, o (256 each) stay whole; the rest is sharded
    expect_bitwise(train<S3>(Model::llama, world, 4).params, base.params, "Stage3 prefetch");
    expect_bitwise(train<S3>(Model::llama, world, 4, no_prefetch).params, base.params, "Stage3 without prefetch");
    expect_bitwise(train<S3>(Model::llama, world, 4, persistent).params, base.params, "Stage3 with persistent layers");
  }
}

// ---- stage 3: gather units, prefetch depth, parameters kept for backward --------------------------------
// The test LLaMA's layers are children of the model itself, so the model is the one module holding several: as
// one gather unit it is gathered once in forward and once in backward, its gradient reduce-scattered once.
template <class S>
train::MemoryUse memory_use(int world, train::TrainerOptions opt);

train::TrainerOptions units(bool whole_model, int prefetch_depth = 1, int keep_last = 0) {
  train::TrainerOptions o;
  o.gather_unit = [whole_model](const std::string& name, const torch::nn::Module&) { return whole_model && name.empty(); };
  o.prefetch_depth = prefetch_depth;
  o.keep_last_gathered = keep_last;
  return o;
}

TEST(Stage3, GatherUnitsKeepResultsBitwise) {
  using S0 = Strategy<Sharded<Stage0>, Precision<bf16, float>>;
  using S3 = Strategy<Sharded<Stage3>, Precision<bf16, float>>;
  using S3O = Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>>;
  using S2A = Strategy<Sharded<Stage2>, Accumulate<4>>;
  using S3A = Strategy<Sharded<Stage3>, Accumulate<4>>;
  for (int world : {1, 2, 3}) {  // one rank: the shards are used in place
    const auto base = train<S0>(Model::llama, world, 4);
    const auto base_a = train<S2A>(Model::llama, world, 2);
    for (const bool whole : {false, true})
      for (const auto [depth, keep] : {std::pair{0, 0}, std::pair{1, 0}, std::pair{2, 3}, std::pair{1, 100}}) {
        const std::string what = std::string(whole ? "the model as one unit" : "every layer alone") + ", prefetch " +
                                 std::to_string(depth) + ", kept " + std::to_string(keep) + ", world " + std::to_string(world);
        expect_bitwise(train<S3>(Model::llama, world, 4, units(whole, depth, keep)).params, base.params, "Stage3, " + what);
        expect_bitwise(train<S3O>(Model::llama, world, 4, units(whole, depth, keep)).params, base.params, "Stage3+Offload, " + what);
        expect_bitwise(train<S3A>(Model::llama, world, 2, units(whole, depth, keep)).params, base_a.params,
                       "Stage3 acc 4 vs Stage2, " + what);
      }
  }
}

// A communicator that counts the collectives its trainer issues (forwarding to a LocalComm rank).
class CountingComm final : public comm::Communicator {
 public:
  explicit CountingComm(comm::CommPtr inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string_view backend() const override { return inner_->backend(); }
  void all_gather(const void* a, void* b, std::size_t n, comm::DType t, comm::Stream s) override {
    ++gathers, inner_->all_gather(a, b, n, t, s);
  }
  void reduce_scatter(const void* a, void* b, std::size_t n, comm::DType t, comm::ReduceOp op, comm::Stream s) override {
    ++reductions, inner_->reduce_scatter(a, b, n, t, op, s);
  }
  void all_reduce(const void* a, void* b, std::size_t n, comm::DType t, comm::ReduceOp op, comm::Stream s) override {
    inner_->all_reduce(a, b, n, t, op, s);
  }
  void broadcast(const void* a, void* b, std::size_t n, comm::DType t, int root, comm::Stream s) override {
    inner_->broadcast(a, b, n, t, root, s);
  }
  void barrier() override { inner_->barrier(); }
  void synchronize(comm::Stream s) override { inner_->synchronize(s); }
  bool host_buffers() const override { return inner_->host_buffers(); }
  bool device_buffers() const override { return inner_->device_buffers(); }
  int gathers = 0, reductions = 0;

 private:
  comm::CommPtr inner_;
};

// Collectives of one training step (the third: the forward order is recorded by then) at world 2, and the
// checkpoint partitions the units make.
struct StepCollectives {
  int gathers = 0, reductions = 0;
  std::vector<std::string> keys;
};
StepCollectives collectives_of_a_step(const train::TrainerOptions& opt) {
  using S3 = Strategy<Sharded<Stage3>>;
  const Data data = make_data(Model::llama, 2, 3, 2);
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < 2; ++r) models.push_back(make_model(Model::llama, torch::kFloat32));
  StepCollectives out;
  run_ranks(2, [&](std::shared_ptr<LocalComm> local) {
    const int r = local->rank();
    auto counting = std::make_shared<CountingComm>(local);
    auto trainer = zero_trainer<S3>(models[r], Hyper{}, counting, opt);
    for (int s = 0; s < 3; ++s) {
      const int g0 = counting->gathers, r0 = counting->reductions;
      trainer.step([&] { return model_loss(Model::llama, *models[r], data.x[s][r], data.y[s][r]); });
      if (r == 0 && s == 2) out.gathers = counting->gathers - g0, out.reductions = counting->reductions - r0;
    }
    if (r == 0)
      for (const auto& p : trainer.partition_buffers()) out.keys.push_back(p.key);
  });
  return out;
}

TEST(Stage3, AGatherUnitIsOneCollectiveAPass) {
  const int64_t layers = kLlamaShape.layers * 7 + 2;  // 7 linears a block, the embedding, the head
  // Each layer alone: a gather in forward and one in backward (none for the embedding, whose backward needs no
  // weights: backward prefetches in the order the first backward used the units), a reduce-scatter each; and for
  // the bucket of whole-kept norms a reduce-scatter and the gather of its updated values.
  const auto alone = collectives_of_a_step(units(false));
  EXPECT_EQ(alone.gathers, (2 * layers - 1) + 1);
  EXPECT_EQ(alone.reductions, layers + 1);
  EXPECT_EQ(alone.keys.size(), std::size_t(layers + 1));
  // The head, last in forward, kept gathered for its backward: one gather fewer.
  EXPECT_EQ(collectives_of_a_step(units(false, 1, 1)).gathers, (2 * layers - 2) + 1);
  EXPECT_EQ(collectives_of_a_step(units(false, 0, 0)).gathers, alone.gathers) << "without prefetch, the same gathers";
  // The model as one unit: one gather a pass, one reduce-scatter (and the bucket's two).
  const auto whole = collectives_of_a_step(units(true));
  EXPECT_EQ(whole.gathers, 2 + 1);
  EXPECT_EQ(whole.reductions, 1 + 1);
  EXPECT_EQ(whole.keys, (std::vector<std::string>{"bucket0", "model"}));
  EXPECT_EQ(collectives_of_a_step(units(true, 1, 1)).gathers, 1 + 1) << "kept from forward to backward";
}

// One rank with blocking collectives: a unit's shard is the whole unit, so nothing is gathered into a copy and the
// gradients are added into the gradient shard itself: the communication peak (the norms' bucket alone) is the same
// whether the whole model is one unit or every layer is. Two ranks gather: the whole model held at once is more.
TEST(Stage3, OneRankUsesTheShardsInPlace) {
  using S3 = Strategy<Sharded<Stage3>, Precision<bf16, float>>;
  EXPECT_EQ(memory_use<S3>(1, units(true)).communication.device, memory_use<S3>(1, units(false)).communication.device);
  const int64_t whole = memory_use<S3>(2, units(true)).communication.device, alone = memory_use<S3>(2, units(false)).communication.device;
  const int64_t model_bytes = kLlamaShape.params() * 2;
  EXPECT_GT(whole, alone);
  EXPECT_GE(whole, model_bytes) << "the whole model gathered in bf16";
}

// A prefetch never waits for an Offload<Host> update still on the host: the unit is left for its own gather, so the
// host queues the current unit's compute first. Two units on one rank (in place); the second pass prefetches.
TEST(Stage3, PrefetchSkipsAUnitWhoseUpdateHasNotLanded) {
  train::SideStream side(torch::kCPU);
  train::Stage3Runtime rt(LocalComm::single(), /*prefetch_depth=*/1, /*keep_last_gathered=*/0, torch::kCPU, side);
  train::Stage3Group a, b;
  int waits_a = 0, waits_b = 0;
  bool b_landed = false;
  for (auto* g : {&a, &b}) g->shard = torch::zeros({4}), g->runtime = &rt, rt.add_group(*g);
  a.before_gather = [&] { ++waits_a; };
  b.before_gather = [&] { ++waits_b; };
  b.update_landed = [&] { return b_landed; };
  auto forward = [&] {
    rt.set_phase(train::Stage3Runtime::Phase::forward);
    rt.acquire(a);
    const bool prefetched = b.gathered.defined();
    rt.release(a);
    rt.acquire(b);
    rt.release(b);
    rt.set_phase(train::Stage3Runtime::Phase::idle);
    return prefetched;
  };
  EXPECT_FALSE(forward()) << "the first pass records the order: nothing to prefetch yet";
  EXPECT_EQ(waits_b, 1);
  EXPECT_FALSE(forward()) << "b's update is still on the host: not prefetched";
  EXPECT_EQ(waits_b, 2) << "b waited for once, at its own gather";
  b_landed = true;
  EXPECT_TRUE(forward()) << "b's update has landed: prefetched with a's gather";
  EXPECT_EQ(waits_b, 3);
  EXPECT_EQ(waits_a, 3);
}

TEST(Stage3, BadPrefetchOptionsAreRefused) {
  using S3 = Strategy<Sharded<Stage3>>;
  auto model = make_model(Model::llama, torch::kFloat32);
  train::TrainerOptions o;
  o.prefetch_depth = -1;
  EXPECT_THROW(
      {
        try {
          zero_trainer<S3>(model, Hyper{}, LocalComm::single(), o);
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("prefetch_depth must be >= 0"), std::string::npos) << e.what();
          throw;
        }
      },
      c10::Error);
}

template <class S>
train::MemoryUse memory_use(int world, train::TrainerOptions opt) {
  const Data data = make_data(Model::llama, world, 2, 2);
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < world; ++r) models.push_back(make_model(Model::llama, torch::kFloat32));
  train::MemoryUse use;
  run_ranks(world, [&](std::shared_ptr<LocalComm> comm) {
    const int r = comm->rank();
    auto trainer = zero_trainer<S>(models[r], Hyper{}, comm, opt);
    for (int s = 0; s < 2; ++s) trainer.step([&] { return model_loss(Model::llama, *models[r], data.x[s][r], data.y[s][r]); });
    if (r == 0) use = trainer.memory();
  });
  return use;
}

TEST(Stage3, PersistentLayersAndPrefetchInTheAccounting) {
  using S3 = Strategy<Sharded<Stage3>>;
  train::TrainerOptions opt;
  opt.align_bytes = 4;
  const auto sharded = memory_use<S3>(2, opt);
  opt.persistence_threshold = 300;
  const auto persistent = memory_use<S3>(2, opt);
  const int64_t h = kLlamaShape.hidden, kv = kLlamaShape.kv_dim(), L = kLlamaShape.layers;
  const int64_t norms = 2 * h * L + h, small = L * (2 * h * h + 2 * h * kv);
  EXPECT_EQ(sharded.persistent_params, norms);
  EXPECT_EQ(persistent.persistent_params, norms + small);
  EXPECT_EQ(persistent.parameters.device - sharded.parameters.device, small * 4 / 2) << "whole instead of half";
  opt.persistence_threshold = 0;
  opt.prefetch_depth = 0;
  const auto no_prefetch = memory_use<S3>(2, opt);
  EXPECT_LT(no_prefetch.communication.device, sharded.communication.device) << "a prefetched layer is held beside the current one";
}

// ---- stage 2: gradients reduce-scattered in buckets during backward --------------------------------------
// Bucket sizes from one parameter per bucket to one bucket for everything: the same bits (each element's
// reduction is the same sum in rank order; AdamW is elementwise). Peak gradient bytes measured in the hooks:
// shards + in-flight buckets + the .grad being taken over, below one full gradient once buckets are small.
template <class C, int A>
void buckets_bitwise(Model kind, int world) {
  using S2 = Strategy<Sharded<Stage2>, Accumulate<A>, Precision<C, float>>;
  const std::string tag = std::string(kind == Model::mlp ? "mlp" : "llama") + " world " + std::to_string(world) + " " +
                          std::string(dtype_name<C>()) + " accumulate " + std::to_string(A);
  const auto one_bucket = train<S2>(kind, world, 4);
  for (int64_t bytes : {int64_t(1), int64_t(300), int64_t(2048)}) {
    train::TrainerOptions o;
    o.bucket_bytes = bytes;
    o.align_bytes = 4;  // the default 256-byte alignment would pad these tiny buckets to several times their size
    const auto got = train<S2>(kind, world, 4, o);
    expect_bitwise(got.params, one_bucket.params, "Stage2 bucket_bytes " + std::to_string(bytes) + ", " + tag);
    // What keeping the full local gradient costs: the buffer, plus the fp32 accumulator when mixed + accumulating.
    const int64_t full = got.memory.full_gradient_bytes * (A > 1 && !std::is_same_v<C, float> ? 3 : 1);
    // Below it once there are shards to speak of (world >= 2) and buckets smaller than the model; the tiny
    // MLP's largest weight is half the model, and its .grad plus its bucket copy alone are a full gradient.
    if (bytes <= 300 && world >= 2 && kind == Model::llama) {
      EXPECT_LT(got.memory.peak_gradient_bytes, full) << tag;
      EXPECT_LT(got.memory.communication.device, got.memory.full_gradient_bytes) << tag;
    }
    // Accumulation choice (trainer.hpp): A reduce-scatters per window, each of every bucket's padded bytes.
    EXPECT_GE(got.reduce_scatter_bytes, int64_t(A) * got.memory.full_gradient_bytes) << tag;
    if (bytes == 300)
      std::cout << "[ stage2 ] " << tag << ": peak gradient bytes " << got.memory.peak_gradient_bytes << " (shards "
                << got.memory.gradients.device << ", buckets in flight <= " << got.memory.communication.device
                << ") vs full gradient (+ fp32 accumulator when mixed) " << full << "; reduce-scatter bytes per step "
                << got.reduce_scatter_bytes << " (keeping local gradients to the last"
                << " micro-step: " << got.reduce_scatter_bytes / A << ")\n";
  }
}

TEST(Stage2, BucketsBitwiseAndBelowTheFullGradient) {
  for (int w : {1, 2, 3, 4}) {
    buckets_bitwise<float, 1>(Model::llama, w);
    buckets_bitwise<float, 4>(Model::mlp, w);
    buckets_bitwise<bf16, 1>(Model::mlp, w);
    buckets_bitwise<bf16, 4>(Model::llama, w);
  }
  buckets_bitwise<float, 4>(Model::llama, 3);
  buckets_bitwise<bf16, 1>(Model::llama, 2);
}

// A parameter without a gradient (unused in this forward) is reduced as zeros after backward on every rank.
TEST(Stage2, UnusedParameterDoesNotHang) {
  struct Net : torch::nn::Module {
    nn::Linear a{nullptr}, unused{nullptr};
    Net() {
      a = register_module("a", nn::Linear(5, 3));
      unused = register_module("unused", nn::Linear(3, 3));
    }
  };
  for (int world : {1, 3}) {
    std::vector<std::shared_ptr<Net>> nets;
    torch::manual_seed(7);
    for (int r = 0; r < world; ++r) nets.push_back(std::make_shared<Net>());
    run_ranks(world, [&](std::shared_ptr<LocalComm> comm) {
      auto& net = *nets[comm->rank()];
      train::TrainerOptions o;
      o.bucket_bytes = 16;
      auto t = zero_trainer<Strategy<Sharded<Stage2>>>(nets[comm->rank()], Hyper{}, comm, o);
      const auto before = net.unused->weight.detach().clone();  // rank 0's, after the broadcast
      for (int s = 0; s < 2; ++s) EXPECT_TRUE(t.step([&] { return net.a(torch::randn({4, 5})).square().mean(); }).applied);
      // Zero gradient: AdamW only decays the weight.
      EXPECT_TRUE(torch::allclose(net.unused->weight, before * (1 - 1e-2 * 0.1) * (1 - 1e-2 * 0.1)));
      EXPECT_FALSE(net.a->weight.grad().defined()) << "no full-size .grad is kept";
    });
  }
}

// ---- Offload<Host>: overlapped pipeline == the same work in program order ---------------------------------
// Eager (no clipping, no loss scale: updates inside backward) and deferred (clipping: updates after the norm,
// stage 3's overlapping the next forward), stages 2 and 3, small buckets, float/bf16, accumulation 1 and 4.
template <class C, int A>
void offload_overlap_bitwise(int world) {
  using S2 = Strategy<Sharded<Stage2>, Offload<Host>, Accumulate<A>, Precision<C, float>>;
  using S3 = Strategy<Sharded<Stage3>, Offload<Host>, Accumulate<A>, Precision<C, float>>;
  const std::string tag = "world " + std::to_string(world) + " " + std::string(dtype_name<C>()) + " accumulate " + std::to_string(A);
  for (float clip : {0.0f, 0.05f}) {
    train::TrainerOptions overlapped, in_order;
    overlapped.bucket_bytes = in_order.bucket_bytes = 200;
    overlapped.max_grad_norm = in_order.max_grad_norm = clip;
    in_order.overlap_offload = false;
    const std::string what = tag + (clip > 0 ? " clipped (deferred)" : " (eager)");
    const auto a2 = train<S2>(Model::llama, world, 4, overlapped), b2 = train<S2>(Model::llama, world, 4, in_order);
    expect_bitwise(a2.params, b2.params, "Stage2+Offload overlapped vs in order, " + what);
    EXPECT_EQ(a2.updated_during_backward, clip == 0) << what;
    EXPECT_FALSE(b2.updated_during_backward);
    const auto a3 = train<S3>(Model::llama, world, 4, overlapped), b3 = train<S3>(Model::llama, world, 4, in_order);
    expect_bitwise(a3.params, b3.params, "Stage3+Offload overlapped vs in order, " + what);
    EXPECT_EQ(a3.updated_during_backward, clip == 0) << what;
    for (std::size_t i = 0; i < a3.log.size(); ++i) {
      EXPECT_EQ(a3.log[i].grad_norm, b3.log[i].grad_norm) << what;
      EXPECT_EQ(a3.log[i].loss, b3.log[i].loss) << what;
    }
    if (clip == 0) expect_bitwise(a3.params, a2.params, "Stage3 vs Stage2 with Offload, " + what);
  }
}

TEST(Offload, OverlappedEqualsInOrder) {
  for (int w : {1, 2, 3, 4}) {
    offload_overlap_bitwise<float, 1>(w);
    offload_overlap_bitwise<bf16, 4>(w);
  }
  offload_overlap_bitwise<bf16, 1>(2);
  offload_overlap_bitwise<float, 4>(3);
}

// The LLaMA of nn/llama.hpp with activation checkpointing: layers run again inside backward, so a layer's
// gradient is final only after its recompute's backward (readiness counts grad-enabled uses). Stage 3 +
// Offload (eager and deferred) and Stage 2 in small buckets against Stage 0, bitwise (accumulation 1).
TEST(Offload, CheckpointedLlamaBitwise) {
  using S0 = Strategy<Sharded<Stage0>, Precision<bf16, float>>;
  using S2 = Strategy<Sharded<Stage2>, Precision<bf16, float>>;
  using S3O = Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>>;
  train::TrainerOptions small;
  small.bucket_bytes = 100;
  const Params base = train_checkpointed_llama<S0>(2, 3, {});
  expect_bitwise(train_checkpointed_llama<S2>(2, 3, small), base, "checkpointed Stage2 buckets");
  expect_bitwise(train_checkpointed_llama<S3O>(2, 3, small), base, "checkpointed Stage3+Offload eager");
  small.overlap_offload = false;
  expect_bitwise(train_checkpointed_llama<S3O>(2, 3, small), base, "checkpointed Stage3+Offload in order");
}

// ---- flat parameters ----------------------------------------------------------------------------------
TEST(FlatParams, ViewsPaddingAndGrads) {
  auto m = make_model(Model::mlp, torch::kFloat32);
  std::vector<std::pair<std::string, torch::Tensor>> ps;
  Params before;
  for (auto& item : m->named_parameters()) ps.emplace_back(item.key(), item.value()), before[item.key()] = item.value().detach().clone();
  train::FlatParams flat(ps, /*world=*/3, /*align=*/16);
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
  EXPECT_THROW(train::FlatParams({{"a", a}, {"b", b}}, 2), c10::Error);
  EXPECT_THROW(train::FlatParams({{"a", a}}, 0), c10::Error);
}

// ---- overflow: inf in one rank's shard -------------------------------------------------------------------
template <class S>
void overflow_skips_everywhere(int world) {
  const Data data = make_data(Model::mlp, world, 3, 6);
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < world; ++r) models.push_back(make_model(Model::mlp, squeeze::torch_dtype<typename S::compute_type>()));
  train::TrainerOptions opt;
  opt.loss_scale = kernels::LossScaleOptions{.init_scale = 1024.0f};  // 2^16 overflows this model's fp16 gradients on the first step
  opt.align_bytes = 2;                                                // element-aligned, so `gain` spreads over several ranks' shards
  std::atomic<int> skipped{0};
  run_ranks(world, [&](std::shared_ptr<LocalComm> comm) {
    const int r = comm->rank();
    auto& model = static_cast<MLPImpl&>(*models[r]);
    auto trainer = zero_trainer<S>(models[r], Hyper{}, comm, opt);
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
// Eager Offload<Host> (bf16, no clipping: updates inside backward): an inf gradient in one layer leaves that
// layer's and every later-processed partition's master and moments untouched (nothing non-finite is applied;
// partitions updated before it keep their update, see nn/trainer.hpp), the step reports applied = false, and
// training goes on.
TEST(Overflow, EagerOffloadNeverAppliesANonFiniteGradient) {
  using S = Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>>;
  const int world = 2;
  const Data data = make_data(Model::mlp, world, 3, 6);
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < world; ++r) models.push_back(make_model(Model::mlp, torch::kBFloat16));
  std::vector<int> fc1_updated(std::size_t(world), 0);  // int, not bool: written from several threads
  run_ranks(world, [&](std::shared_ptr<LocalComm> comm) {
    const int r = comm->rank();
    auto& model = static_cast<MLPImpl&>(*models[r]);
    auto trainer = zero_trainer<S>(models[r], Hyper{}, comm);
    auto loss = [&](int s) { return model.loss(data.x[s][r].to(torch::kBFloat16), data.y[s][r].to(torch::kBFloat16)); };
    ASSERT_TRUE(trainer.step([&] { return loss(0); }).applied);
    std::vector<torch::Tensor> state_before;
    for (auto& part : trainer.optimizer_state())
      for (auto& t : part) state_before.push_back(t.clone());
    auto x = data.x[1][r].to(torch::kBFloat16);
    if (r == 1) x[0][0] = std::numeric_limits<float>::infinity();  // NaN loss: every gradient non-finite
    const auto res = trainer.step([&] { return model.loss(x, data.y[1][r].to(torch::kBFloat16)); });
    EXPECT_TRUE(trainer.updated_during_backward()) << "eager mode";
    EXPECT_TRUE(res.boundary);
    EXPECT_FALSE(res.applied);
    EXPECT_FALSE(std::isfinite(res.grad_norm));
    // The inf sits in column 0 of x, so only fc1's weight gradient is non-finite (tanh' of inf is 0 elsewhere),
    // and after the reduce-scatter only in one rank's shard. fc1 is the last layer backward reaches: partitions
    // finished before it (fc3, fc2) keep their update. Partition order: the bucket holding `gain`, fc1, fc2, fc3.
    const auto state = trainer.optimizer_state();
    ASSERT_EQ(state.size(), 4u);
    std::size_t i = 0;
    for (std::size_t part = 0; part < state.size(); ++part)
      for (auto& t : state[part]) {
        EXPECT_TRUE(torch::isfinite(t).all().item<bool>()) << "no inf/NaN reaches the optimizer state";
        if (part == 1 && !torch::equal(t, state_before[i])) fc1_updated[std::size_t(r)] = 1;
        ++i;
      }
    for (auto& [name, t] : trainer.full_parameters()) EXPECT_TRUE(torch::isfinite(t).all().item<bool>()) << name;
    EXPECT_TRUE(trainer.step([&] { return loss(2); }).applied) << "a clean step applies again";
  });
  // The NaN column lands in one rank's shard of fc1: that rank left fc1 untouched (the other updated its finite part).
  EXPECT_FALSE(fc1_updated[0] && fc1_updated[1]) << "the rank holding the non-finite gradient did not update fc1";
}

TEST(Overflow, InfInOneShardSkipsOnAllRanksStage3Offload) {
  for (int w : {2, 3, 4}) overflow_skips_everywhere<Strategy<Sharded<Stage3>, Offload<Host>, Precision<half, float>>>(w);
}

// ---- clipping by the global norm ---------------------------------------------------------------------------
template <class S>
void clipping_uses_global_norm(int world) {
  Hyper h;
  h.eps = 1e-2f;  // Adam's step is scale-invariant up to eps: a large eps makes clipping visible in the update
  train::TrainerOptions opt;
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

// squeeze::AdamW (the optimizer's own options) carries max_grad_norm and the loss-scale options.
TEST(Clipping, FromSqueezeAdamWOptions) {
  const Hyper h{.eps = 1e-2f};
  const auto via_trainer_options = train<Strategy<Sharded<Stage2>>>(Model::mlp, 3, 3, train::TrainerOptions{.max_grad_norm = 0.05f}, h);
  const Data data = make_data(Model::mlp, 3, 3, 6);
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < 3; ++r) models.push_back(make_model(Model::mlp, torch::kFloat32));
  Params got;
  run_ranks(3, [&](std::shared_ptr<LocalComm> comm) {
    const int r = comm->rank();
    const squeeze::AdamW adamw{
        .lr = h.lr, .beta1 = h.beta1, .beta2 = h.beta2, .eps = h.eps, .weight_decay = h.weight_decay, .max_grad_norm = 0.05f};
    auto trainer = zero_trainer<Strategy<Sharded<Stage2>>>(models[r], adamw, comm);
    for (int s = 0; s < 3; ++s) trainer.step([&] { return model_loss(Model::mlp, *models[r], data.x[s][r], data.y[s][r]); });
    auto full = trainer.full_parameters();
    if (r == 0)
      for (auto& [n, t] : full) got[n] = t;
    // Setting it twice is an error.
    EXPECT_THROW((zero_trainer<Strategy<Sharded<Stage2>>>(models[r], adamw, LocalComm::single(), {.max_grad_norm = 1.0f})), c10::Error);
  });
  expect_bitwise(got, via_trainer_options.params, "max_grad_norm from squeeze::AdamW");
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
train::MemoryReport memory_of(int world, train::TrainerOptions opt) {
  const Data data = make_data(Model::llama, world, 1, 2);
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < world; ++r) models.push_back(make_model(Model::llama, squeeze::torch_dtype<typename S::compute_type>()));
  train::MemoryReport rep;
  run_ranks(world, [&](std::shared_ptr<LocalComm> comm) {
    const int r = comm->rank();
    auto trainer = zero_trainer<S>(models[r], Hyper{}, comm, opt);
    trainer.step([&] { return model_loss(Model::llama, *models[r], data.x[0][r], data.y[0][r]); });
    if (r == 0) rep = trainer.memory_report(kLlamaShape, {1, 6});
  });
  return rep;
}

TEST(Memory, Stage3MatchesThePlanner) {
  // Element alignment and a world size that divides every layer: the planner's Ψ/N is exact per layer.
  train::TrainerOptions opt;
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
    // Gradients: shard(Ψ)·2 as planned (the whole-kept gains reduce-scatter into shards too, in buckets).
    EXPECT_EQ(a.gradients.device, p.gradients.device);
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
  // The host gradient copy travels in the gradient's dtype (bf16 here: half the PCIe bytes of fp32), as planned.
  EXPECT_EQ(rep.actual.gradients.host, rep.predicted.gradients.host);
  EXPECT_EQ(rep.actual.master_weights.device + rep.actual.optimizer_state.device, 0);
}

TEST(Memory, Stage1And2ShardStateAsPlanned) {
  train::TrainerOptions opt;
  opt.align_bytes = 1;
  const auto r1 = memory_of<Strategy<Sharded<Stage1>, Precision<bf16, float>>>(4, opt);
  EXPECT_EQ(r1.actual.parameters.device, r1.predicted.parameters.device);
  EXPECT_EQ(r1.actual.master_weights.device, r1.predicted.master_weights.device);
  EXPECT_EQ(r1.actual.optimizer_state.device, r1.predicted.optimizer_state.device);
  // Stage 1 keeps the full gradient (planned) and reduce-scatters in place into its own slice.
  EXPECT_EQ(r1.actual.gradients.device, r1.predicted.gradients.device);
  // Stage 2: the reduced shard as planned (gradients stream through buckets during backward), and the
  // in-flight buckets within the planner's communication budget (one block's parameters).
  opt.bucket_bytes = 512;  // several buckets: the in-flight ones stay below the full gradient
  const auto r2 = memory_of<Strategy<Sharded<Stage2>, Precision<bf16, float>>>(4, opt);
  EXPECT_EQ(r2.actual.gradients.device, r2.predicted.gradients.device);
  EXPECT_GT(r2.actual.communication.device, 0);
  EXPECT_LT(r2.actual.peak_gradient_bytes, r2.actual.full_gradient_bytes);
  EXPECT_EQ(r2.actual.optimizer_state.device, r2.predicted.optimizer_state.device);
}

// ---- the offload pipeline's gradient norm pass against float64 ------------------------------------------
// chunked_sum_squares: fixed chunks, so the bits do not depend on the thread count; within float64 rounding
// (n * 2^-52 relative) of torch's float64 sum, for sizes around the chunk and parallel thresholds.
TEST(Offload, ChunkedSumOfSquaresMatchesFloat64) {
  torch::manual_seed(3);
  for (int64_t n : {int64_t(1), int64_t(4095), int64_t(4097), int64_t(70001), int64_t(4 << 20) + 13}) {
    for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
      const auto t = (torch::randn({n}) * 3).to(dtype);
      const double ref = t.to(torch::kFloat64).square().sum().item<double>();
      const double got = train::chunked_sum_squares(t);
      EXPECT_NEAR(got, ref, 1e-13 * ref + 1e-300) << n << " " << dtype;
      EXPECT_EQ(got, train::chunked_sum_squares(t)) << "deterministic";
    }
  }
  auto bad = torch::randn({100000});
  bad[77777] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(std::isfinite(train::chunked_sum_squares(bad))) << "inf is seen";
  bad[77777] = std::nanf("");
  EXPECT_TRUE(std::isnan(train::chunked_sum_squares(bad))) << "NaN is seen";
  EXPECT_THROW(train::chunked_sum_squares(torch::ones({4}, torch::kInt32)), c10::Error);
}

// sum_squares_tensor: the device norm pass of Offload<Host> (and of device-resident partitions), run here on host
// tensors (the same torch ops). Within float64 rounding (n * 2^-52 relative, plus the sqrt and square of each
// chunk's norm) of the float64 sum, chunk borders crossed, deterministic, inf/NaN seen, empty = 0.
TEST(Offload, DeviceSumOfSquaresMatchesFloat64) {
  torch::manual_seed(4);
  for (int64_t chunk : {int64_t(1000), train::kSumSquaresChunk}) {
    for (int64_t n : {int64_t(1), int64_t(999), int64_t(1000), int64_t(1001), int64_t(70001)}) {
      for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
        const auto t = (torch::randn({n}) * 3).to(dtype);
        const double ref = t.to(torch::kFloat64).square().sum().item<double>();
        const torch::Tensor got = train::sum_squares_tensor(t, chunk);
        EXPECT_EQ(got.scalar_type(), torch::kFloat64);
        EXPECT_EQ(got.dim(), 0);
        EXPECT_NEAR(got.item<double>(), ref, 1e-13 * ref + 1e-300) << n << " " << dtype << " chunk " << chunk;
        EXPECT_EQ(got.item<double>(), train::sum_squares_tensor(t, chunk).item<double>()) << "deterministic";
      }
    }
  }
  // A 2-d tensor is summed whole.
  const auto m = torch::randn({37, 29});
  EXPECT_NEAR(train::sum_squares_tensor(m, 100).item<double>(), m.to(torch::kFloat64).square().sum().item<double>(), 1e-13 * 2000);
  EXPECT_EQ(train::sum_squares_tensor(torch::empty({0})).item<double>(), 0.0);
  auto bad = torch::randn({5000});
  bad[3333] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(train::sum_squares_tensor(bad, 1000).item<double>())) << "inf is seen";
  bad[3333] = std::nanf("");
  EXPECT_TRUE(std::isnan(train::sum_squares_tensor(bad, 1000).item<double>())) << "NaN is seen";
  EXPECT_THROW(train::sum_squares_tensor(torch::ones({4}, torch::kInt32)), c10::Error);
  EXPECT_THROW(train::sum_squares_tensor(torch::ones({4}), 0), c10::Error);
}

// ---- the offload worker's order: lowest Partition::priority first, a partition's own jobs in order -------------
std::unique_ptr<train::Partition> worker_partition(int64_t priority) {
  auto p = std::make_unique<train::Partition>();
  p->priority = priority;
  p->param = torch::zeros({4});
  p->master = torch::ones({4});
  p->host_grad = torch::zeros({4});
  return p;
}
// A job the worker records by name in `order` when it runs it, after `open` is ready when given.
struct WorkerLog {
  std::mutex m;
  std::vector<std::string> order;
  train::OffloadPipeline::Fn record(std::string what, std::shared_future<void> open = {}) {
    return [this, what, open](train::Partition&) {
      if (open.valid()) open.wait();
      std::lock_guard lk(m);
      order.push_back(what);
    };
  }
  std::vector<std::string> seen() {
    std::lock_guard lk(m);
    return order;
  }
};

// A gate job holds the worker while jobs queue: a blocking job of priority 9, then jobs of priorities 3, 0, 0. The
// worker takes 0, 0 (in submission order), 3, then the blocker; wait(p) returns once p's own jobs are done, with
// the blocker still queued or running (a count of finished jobs in submission order could not say so).
TEST(Offload, WorkerTakesTheLowestPriorityFirst) {
  train::OffloadPipeline pipe(torch::kCPU, /*threaded=*/true);
  auto gate = worker_partition(-1), blocker = worker_partition(9), late = worker_partition(3), early = worker_partition(0);
  std::promise<void> open_gate, open_blocker;
  WorkerLog log;
  pipe.update(*gate, log.record("gate", open_gate.get_future().share()));
  pipe.update(*blocker, log.record("blocker", open_blocker.get_future().share()));
  pipe.update(*late, log.record("late"));
  pipe.update(*early, log.record("early 1"));
  pipe.update(*early, log.record("early 2"));
  open_gate.set_value();
  auto waited = std::async(std::launch::async, [&] { pipe.wait(*late); });
  const bool returned = waited.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  EXPECT_TRUE(returned) << "wait(p) waited for a job of another partition";
  EXPECT_EQ(log.seen(), (std::vector<std::string>{"gate", "early 1", "early 2", "late"}));
  EXPECT_TRUE(pipe.finished(*late));
  EXPECT_FALSE(pipe.finished(*blocker)) << "its job is held";
  open_blocker.set_value();
  pipe.wait_all();
  EXPECT_TRUE(pipe.finished(*blocker));
  EXPECT_EQ(log.seen(), (std::vector<std::string>{"gate", "early 1", "early 2", "late", "blocker"}));
  EXPECT_TRUE(torch::equal(late->param, late->master)) << "the job's write-back ran";
}

// Jobs whose input is still in flight (a gradient copy the GPU has not reached: the host queues backward's jobs
// long before) do not hold the worker while an earlier one has landed: behind a gate, a landed job of priority 5
// and one of priority 0 still in flight run landed first; with nothing landed, the earliest submitted runs first
// (inputs land in submission order), not the lowest priority, which would wait for the last copy of backward.
TEST(Offload, WorkerTakesLandedJobsBeforeOnesInFlight) {
  train::OffloadPipeline pipe(torch::kCPU, /*threaded=*/true);
  const train::OffloadPipeline::Landed landed = [] { return true; }, in_flight = [] { return false; };
  // The order the worker runs a job of priority 5 and then one of priority 0 (or a second job of the first's
  // partition), queued behind a gate in that order. An unset Landed: an update, whose input is there from the start.
  auto order = [&](const train::OffloadPipeline::Landed& first_input, const train::OffloadPipeline::Landed& second_input,
                   bool one_partition = false) {
    auto gate = worker_partition(-1), first = worker_partition(5), second = worker_partition(0);
    std::promise<void> open_gate;
    WorkerLog log;
    pipe.update(*gate, log.record("gate", open_gate.get_future().share()));
    pipe.update(*first, log.record("first"), first_input);
    pipe.update(one_partition ? *first : *second, log.record("second"), second_input);
    open_gate.set_value();
    pipe.wait_all();
    return log.seen();
  };
  EXPECT_EQ(order(landed, in_flight), (std::vector<std::string>{"gate", "first", "second"})) << "the landed one first";
  EXPECT_EQ(order(in_flight, in_flight), (std::vector<std::string>{"gate", "first", "second"})) << "the earliest submitted";
  EXPECT_EQ(order(landed, landed), (std::vector<std::string>{"gate", "second", "first"})) << "landed alike: priority";
  EXPECT_EQ(order(in_flight, {}, true), (std::vector<std::string>{"gate", "first", "second"})) << "a partition's jobs in order";
}

// ---- a moved trainer keeps working (examples/llama holds one in a std::optional) ----------------------------
// Hooks, stage-3 callbacks and the offload worker point to heap state, not into the Trainer object.
template <class S>
void moved_trainer_bitwise(int world) {
  const auto ref = train<S>(Model::llama, world, 3);
  const Data data = make_data(Model::llama, world, 3, 6);
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < world; ++r) models.push_back(make_model(Model::llama, squeeze::torch_dtype<typename S::compute_type>()));
  Params got;
  run_ranks(world, [&](std::shared_ptr<LocalComm> comm) {
    const int r = comm->rank();
    std::optional<train::Trainer<S, Hyper>> holder;
    holder.emplace(zero_trainer<S>(models[r], Hyper{}, comm));  // a move
    auto moved = std::move(*holder);                            // and another
    holder.reset();                                             // the moved-from one is destroyed first
    for (int s = 0; s < 3; ++s) moved.step([&] { return model_loss(Model::llama, *models[r], data.x[s][r], data.y[s][r]); });
    auto full = moved.full_parameters();
    if (r == 0)
      for (auto& [n, t] : full) got[n] = t.to(torch::kFloat32);
  });
  expect_bitwise(got, ref.params, "moved trainer");
}

TEST(Trainer, MovedTrainerKeepsTraining) {
  moved_trainer_bitwise<Strategy<Sharded<Stage2>, Offload<Host>, Precision<bf16, float>>>(2);
  moved_trainer_bitwise<Strategy<Sharded<Stage3>, Offload<Host>, Accumulate<1>>>(3);
  moved_trainer_bitwise<Strategy<Sharded<Stage1>, Precision<bf16, float>>>(2);
}

// set_lr: the next steps use the new rate (lr 0: no update and no decay), on the device path and through the
// Offload<Host> pipeline; a bad rate is an error naming lr and leaves the old rate.
template <class S>
void set_lr_applies(const char* what) {
  struct Net : torch::nn::Module {
    nn::Linear a{nullptr};
    Net() { a = register_module("a", nn::Linear(5, 3)); }
  };
  torch::manual_seed(3);
  auto net = std::make_shared<Net>();
  auto t = zero_trainer<S>(net, Hyper{}, LocalComm::single());
  auto loss = [&] { return net->a(torch::randn({4, 5})).square().mean(); };
  auto weights = [&] {  // every parameter, gathered (stage 3 keeps only shards between steps)
    t.sync();
    std::vector<torch::Tensor> w;
    for (const auto& [name, p] : t.full_parameters()) w.push_back(p.detach().flatten().clone());
    return torch::cat(w);
  };
  t.set_lr(0.f);
  EXPECT_EQ(t.lr(), 0.f);
  const torch::Tensor w0 = weights();
  ASSERT_TRUE(t.step(loss).applied);
  EXPECT_TRUE(torch::equal(weights(), w0)) << what << ": lr 0, no update and no decay";
  t.set_lr(1e-2f);
  ASSERT_TRUE(t.step(loss).applied);
  EXPECT_FALSE(torch::equal(weights(), w0)) << what;
  try {
    t.set_lr(-1.f);
    ADD_FAILURE() << what << ": a negative lr was accepted";
  } catch (const squeeze::Error& e) {
    EXPECT_NE(std::string(e.what()).find("lr"), std::string::npos) << e.what();
  }
  EXPECT_EQ(t.lr(), 1e-2f) << what << ": a rejected rate leaves the old one";
}
TEST(Trainer, SetLrAppliesToTheNextStepsAndRejectsBadRates) {
  set_lr_applies<Strategy<Sharded<Stage1>>>("stage 1");
  set_lr_applies<Strategy<Sharded<Stage3>, Offload<Host>>>("stage 3 + Offload<Host>");
}

// ---- fp32 masters from the float values a 16-bit module was converted from (TrainerOptions::master_init) -----
// Every partition's master equals, element by element, the float value of the parameter it holds (no padding
// element or neighbour shifted), at every stage, with and without Offload<Host>, on 1 and 3 ranks; each
// parameter's values are asked for once per rank.
template <class S>
void masters_from_float(int world) {
  const std::string what =
      std::string("stage ") + std::to_string(S::stage) + (S::offload_to_host ? " + offload" : "") + ", world " + std::to_string(world);
  SCOPED_TRACE(what);
  const auto dtype = squeeze::torch_dtype<typename S::compute_type>();
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  std::vector<std::map<std::string, torch::Tensor>> floats(world);
  for (int r = 0; r < world; ++r) {
    models.push_back(make_model(Model::llama, torch::kFloat32));
    for (const auto& p : models.back()->named_parameters()) floats[r][p.key()] = p.value().detach().clone();
    models.back()->to(dtype);
  }
  run_ranks(world, [&](std::shared_ptr<LocalComm> comm) {
    const int r = comm->rank();
    train::TrainerOptions opt;
    std::set<std::string> asked;
    opt.master_init = [&, r](const std::string& name) {
      EXPECT_TRUE(asked.insert(name).second) << "asked twice for " << name;
      return floats[r].at(name);
    };
    auto t = zero_trainer<S>(models[r], Hyper{}, comm, opt);
    EXPECT_EQ(asked.size(), floats[r].size()) << "every parameter's float values are asked for once";
    // Each partition's master against the float values laid out by the names and offsets of its flat layout.
    const auto state = t.optimizer_state();
    const auto layouts = t.partition_layouts();
    int64_t low_bits = 0;
    ASSERT_EQ(state.size(), layouts.size());
    for (std::size_t k = 0; k < state.size(); ++k) {
      const torch::Tensor& master = state[k][0];
      ASSERT_TRUE(master.defined());
      const auto& [layout, begin] = layouts[k];
      torch::Tensor want = master.clone();
      for (const auto& e : layout->entries()) {
        const int64_t lo = std::max(begin, e.offset), hi = std::min(begin + master.numel(), e.offset + e.numel);
        if (lo < hi) want.narrow(0, lo - begin, hi - lo).copy_(floats[0].at(e.name).flatten().narrow(0, lo - e.offset, hi - lo));
      }
      EXPECT_TRUE(torch::equal(master, want)) << "partition " << k;
      low_bits += (master != master.to(dtype).to(torch::kFloat32)).sum().template item<int64_t>();
    }
    // The float initialisation's low bits are kept (norm weights of 1 are exact; the matrices' values are not).
    EXPECT_GT(low_bits, 0) << "rank " << r;
  });
}

TEST(Trainer, MastersStartFromTheFloatValues) {
  for (int world : {1, 3}) {
    masters_from_float<Strategy<Sharded<Stage0>, Precision<bf16, float>>>(world);
    masters_from_float<Strategy<Sharded<Stage1>, Precision<bf16, float>>>(world);
    masters_from_float<Strategy<Sharded<Stage2>, Offload<Host>, Precision<bf16, float>>>(world);
    masters_from_float<Strategy<Sharded<Stage3>, Precision<bf16, float>>>(world);
    masters_from_float<Strategy<Sharded<Stage3>, Offload<Host>, Precision<half, float>>>(world);
  }
}

TEST(Trainer, MasterInitBadInputIsAClearError) {
  using S = Strategy<Sharded<Stage3>, Precision<bf16, float>>;
  const auto expect_error = [](std::function<torch::Tensor(const std::string&)> init, const std::string& words) {
    auto m = make_model(Model::llama, torch::kFloat32);
    std::map<std::string, torch::Tensor> f;
    for (const auto& p : m->named_parameters()) f[p.key()] = p.value().detach().clone();
    m->to(torch::kBFloat16);
    train::TrainerOptions opt;
    opt.master_init = [&](const std::string& name) { return init ? init(name) : f.at(name); };
    if (!init) {
      EXPECT_NO_THROW((zero_trainer<S>(m, Hyper{}, LocalComm::single(), opt)));
      return;
    }
    try {
      (void)zero_trainer<S>(m, Hyper{}, LocalComm::single(), opt);
      ADD_FAILURE() << "accepted: " << words;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  expect_error(nullptr, "");
  expect_error([](const std::string&) { return torch::Tensor(); }, "returned no tensor");
  expect_error([](const std::string&) { return torch::zeros({3}); }, "has shape");
  auto m0 = make_model(Model::llama, torch::kFloat32);
  std::map<std::string, torch::Tensor> f0;
  for (const auto& p : m0->named_parameters()) f0[p.key()] = p.value().detach().clone();
  expect_error([&](const std::string& n) { return f0.at(n) + 0.5; }, "does not round");
  expect_error([&](const std::string& n) { return f0.at(n).to(torch::kInt32); }, "not floating point");
}

// ---- bad input ----------------------------------------------------------------------------------------
TEST(Trainer, BadInputIsAClearError) {
  auto m = make_model(Model::mlp, torch::kFloat32);
  auto one = LocalComm::single();
  // A dtype the strategy cannot start from (float and its compute type can: the trainer converts float itself).
  auto m64 = make_model(Model::mlp, torch::kFloat64);
  EXPECT_THROW((zero_trainer<Strategy<Sharded<Stage1>, Precision<bf16, float>>>(m64, Hyper{}, one)), c10::Error);
  // Bad hyper-parameters.
  Hyper bad;
  bad.beta1 = 1.5f;
  EXPECT_THROW((zero_trainer<Strategy<Sharded<Stage1>>>(m, bad, one)), squeeze::Error);
  // A closure that returns a non-scalar.
  auto t = zero_trainer<Strategy<Sharded<Stage2>>>(m, Hyper{}, one);
  EXPECT_THROW(t.step([] { return torch::ones({2}, torch::requires_grad()); }), c10::Error);
}

}  // namespace

int main(int argc, char** argv) {
  zero_test::reproducible_cpu_math();  // bitwise comparisons between runs
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
