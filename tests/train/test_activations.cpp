// Offloaded checkpoints (CheckpointOffload<Host>): the checkpointed segment inputs wait for backward in host memory
// (engine::ActivationStore). On the CPU the copies run in program order; the GPU tests (test_zero_cuda) run them on
// their streams. Offloading is exact: it moves values, it never changes them; 8-bit checkpoints round them, and tiled
// MLPs sum the weights' gradients over the rows in another order.
#include <gtest/gtest.h>

#include <squeeze/engine/activation_store.hpp>
#include <squeeze/nn/llama.hpp>

#include "zero_common.hpp"

using namespace zero_test;
using engine::ActivationStore;

namespace {

using Plain = Strategy<Precision<bf16, float>, Checkpointed>;
using Offloaded = Strategy<Precision<bf16, float>, Checkpointed, CheckpointOffload<Host>>;

// The store hands back each tensor exactly, in its shape and dtype, whatever its size (none of them a multiple of
// anything) and layout (a transposed view is kept as its values).
TEST(Activations, StoreGivesBackExactlyWhatItKept) {
  ActivationStore store(torch::kCPU, 1);
  torch::manual_seed(3);
  const std::vector<torch::Tensor> xs = {torch::randn({3, 7, 5}), torch::randn({1, 13}).to(torch::kBFloat16), torch::randn({11, 3}).t(),
                                         torch::randn({2, 9, 17}).to(torch::kHalf)};
  std::vector<ActivationStore::SlotPtr> slots;
  for (const auto& x : xs) slots.push_back(store.stash(x));
  for (int i = int(xs.size()) - 1; i >= 0; --i) {
    const torch::Tensor back = store.fetch(slots[std::size_t(i)]);
    EXPECT_EQ(back.sizes(), xs[std::size_t(i)].sizes()) << "slot " << i;
    EXPECT_EQ(back.scalar_type(), xs[std::size_t(i)].scalar_type()) << "slot " << i;
    EXPECT_TRUE(torch::equal(back, xs[std::size_t(i)])) << "slot " << i;
  }
  store.end_pass();
}

// Backward fetches in reverse; each fetch brings back the `keep` slots before it, and the forward's last `keep` were
// never let go. keep 0 copies every slot back at its fetch.
TEST(Activations, BackwardFetchesPrefetchTheSlotsBeforeIt) {
  for (int keep : {0, 1, 2, 7}) {
    ActivationStore store(torch::kCPU, keep);
    std::vector<ActivationStore::SlotPtr> slots;
    for (int i = 0; i < 5; ++i) slots.push_back(store.stash(torch::full({4, 3}, float(i))));
    EXPECT_EQ(store.stats().device_peak_bytes, std::min(keep + 1, 5) * 48) << "keep " << keep;
    for (int i = 4; i >= 0; --i) EXPECT_TRUE(torch::equal(store.fetch(slots[std::size_t(i)]), torch::full({4, 3}, float(i))));
    const engine::ActivationStats s = store.stats();
    const int kept = std::min(keep, 5);
    EXPECT_EQ(s.kept_on_device, kept) << "keep " << keep;
    EXPECT_EQ(s.prefetched, keep == 0 ? 0 : 5 - kept) << "keep " << keep;
    EXPECT_EQ(s.fetched_late, keep == 0 ? 5 : 0) << "keep " << keep;
    EXPECT_EQ(s.h2d_bytes, (5 - kept) * 48) << "keep " << keep;
    EXPECT_EQ(s.d2h_bytes, 5 * 48);
    store.end_pass();
  }
}

// Host buffers of exactly each input's bytes; the next pass takes the same buffers back from the pool.
TEST(Activations, HostBuffersAreSizedExactlyAndReusedByTheNextPass) {
  ActivationStore store(torch::kCPU, 1);
  const int64_t bytes = (3 * 7 * 5 + 1 * 13) * 4 + 2 * 9 * 17 * 2;
  for (int pass = 0; pass < 3; ++pass) {
    auto a = store.stash(torch::randn({3, 7, 5})), b = store.stash(torch::randn({1, 13})),
         c = store.stash(torch::randn({2, 9, 17}).to(torch::kBFloat16));
    EXPECT_EQ(store.stats().host_bytes, bytes) << "pass " << pass;
    store.fetch(c), store.fetch(b), store.fetch(a);
    store.end_pass();
    EXPECT_EQ(store.stats().host_bytes, bytes) << "pass " << pass << ": pooled, not grown";
  }
}

// A copy that fails (here: a host buffer of 4 PiB for a broadcast view, beyond any address space, within a budget that
// allows it) is a
// squeeze::Error naming the input and its bytes, and the store goes on serving what it holds.
TEST(Activations, ACopyThatFailsIsAClearError) {
  ActivationStore store(torch::kCPU, 1, /*host_budget_bytes=*/int64_t(1) << 60);
  const auto kept = store.stash(torch::arange(6.0f));
  try {
    store.stash(torch::zeros({1}).expand({int64_t(1) << 50}));
    FAIL() << "a 4 PiB host buffer was allocated";
  } catch (const squeeze::Error& e) {
    EXPECT_NE(std::string(e.what()).find("copying checkpoint input 1 (4503599.63 GB)"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(torch::equal(store.fetch(kept), torch::arange(6.0f)));
  store.end_pass();
}

// A pass whose inputs need more host memory than allowed fails at the stash that would exceed it, naming the bytes;
// the step throws before any update, so the weights stay as they were.
TEST(Activations, AHostBudgetTooSmallIsAClearErrorAndTheWeightsStay) {
  nn::LlamaConfig cfg;
  cfg.vocab = 29, cfg.hidden = 16, cfg.layers = 3, cfg.heads = 4, cfg.kv_heads = 2, cfg.ffn = 24;
  torch::manual_seed(5);
  nn::Llama model(cfg);
  train::TrainerOptions o;
  o.activation_host_bytes = 1100;  // two of the three 512-byte inputs (2 x 8 tokens x 16 x bf16)
  auto t = zero_trainer<Offloaded>(model, Hyper{}, LocalComm::single(), o);
  Params before;
  for (auto& [name, value] : t.full_parameters()) before[name] = value.clone();
  const torch::Tensor ids = torch::randint(0, cfg.vocab, {2, 9});
  try {
    t.step([&] { return model->loss(ids.narrow(1, 0, 8), ids.narrow(1, 1, 8)); });
    FAIL() << "the step kept more host memory than its budget";
  } catch (const squeeze::Error& e) {
    EXPECT_NE(std::string(e.what()).find("CheckpointOffload<Host>: checkpoint input 2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("TrainerOptions::activation_host_bytes"), std::string::npos) << e.what();
  }
  for (auto& [name, value] : t.full_parameters()) EXPECT_TRUE(torch::equal(value, before.at(name))) << name;
}

// Gradients through checkpoint_sequential with the inputs in a store equal plain checkpointing bit for bit (float,
// sizes that divide nothing), and a second backward through the same graph is refused, not silently wrong.
TEST(Activations, GradientsEqualPlainCheckpointingAndASecondBackwardIsRefused) {
  torch::manual_seed(11);
  const auto w1 = torch::randn({7, 7}, torch::requires_grad()), w2 = torch::randn({7, 7}, torch::requires_grad());
  const auto x0 = torch::randn({5, 3, 7});
  auto layer = [&](int64_t i, const torch::Tensor& h) { return torch::tanh(h.matmul(i % 2 ? w2 : w1)) + h; };
  auto params = [&](int64_t i) { return std::vector<torch::Tensor>{i % 2 ? w2 : w1}; };
  auto grads = [&](ActivationStore* store) {
    w1.mutable_grad() = torch::Tensor(), w2.mutable_grad() = torch::Tensor();
    const torch::Tensor x = x0.clone().requires_grad_(true);
    nn::CheckpointOffloadScope scope(store);
    nn::checkpoint_sequential(5, 1, x, layer, params).pow(2).sum().backward();
    return std::vector<torch::Tensor>{x.grad(), w1.grad().clone(), w2.grad().clone()};
  };
  ActivationStore store(torch::kCPU, 1);
  const auto plain = grads(nullptr), offloaded = grads(&store);
  for (std::size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], offloaded[i])) << "gradient " << i;
  EXPECT_EQ(store.stats().stashed, 5);
  store.end_pass();

  const torch::Tensor x = x0.clone().requires_grad_(true);
  torch::Tensor y;
  {
    nn::CheckpointOffloadScope scope(&store);
    y = nn::checkpoint_sequential(3, 1, x, layer, params).sum();
  }
  y.backward({}, /*retain_graph=*/true);
  try {
    y.backward();
    FAIL() << "a second backward through offloaded checkpoints ran";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("fetched twice"), std::string::npos) << e.what();
  }
  store.end_pass();
}

// 8-bit checkpoints: each value within half a code step (absmax / 254) of its block's scale, plus the rounding to its
// dtype; zeros stay zeros; the payload is 256 codes and one fp32 scale per block, for sizes that divide nothing.
TEST(Activations, Int8CheckpointsAreWithinHalfACodeStep) {
  torch::manual_seed(21);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (int64_t n : {int64_t(1), int64_t(255), int64_t(257), int64_t(1000), int64_t(70001)}) {
      torch::Tensor x = (torch::randn({n}) * torch::exp(torch::randn({n}) * 2)).to(dtype);
      x.narrow(0, 0, std::min<int64_t>(n, 300)).zero_();  // a zero block (and a zero head of the next)
      const torch::Tensor payload = engine::encode_int8(x.view({1, n}));
      EXPECT_EQ(payload.numel(), ActivationStore::encoded_bytes(n));
      const torch::Tensor back = engine::decode_int8(payload, {1, n}, dtype).view({n}).to(torch::kFloat64);
      const int64_t nb = (n + 255) / 256;
      const torch::Tensor xf = torch::constant_pad_nd(x.to(torch::kFloat64), {0, nb * 256 - n}).view({nb, 256});
      const torch::Tensor bound = (xf.abs().amax(1, true) / 254).expand({nb, 256}).reshape({-1}).narrow(0, 0, n);
      const double ulp = dtype == torch::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -23);
      const torch::Tensor excess = (back - x.to(torch::kFloat64)).abs() - bound * (1 + 1e-6) - back.abs() * ulp;
      EXPECT_LE(excess.max().item<double>(), 0.0) << "n " << n << " " << dtype;
      EXPECT_TRUE(torch::equal(back.narrow(0, 0, std::min<int64_t>(n, 300)), torch::zeros({std::min<int64_t>(n, 300)}, torch::kFloat64)));
    }
  }
}

// 8-bit checkpoints are encoded and decoded in runs of blocks (bounded temporaries): any run length gives the same bytes
// and values, including a last run and a last block that are partial.
TEST(Activations, Int8RunsGiveTheSameBytesAsOneRun) {
  torch::manual_seed(23);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const torch::Tensor x = (torch::randn({3, 1001}) * 3).to(dtype);  // 3003 values: 12 blocks, the last of 187
    const torch::Tensor whole = engine::encode_int8(x, 1 << 20);
    for (int64_t run : {int64_t(1), int64_t(5), int64_t(12)}) {
      EXPECT_TRUE(torch::equal(engine::encode_int8(x, run), whole)) << "run of " << run << " blocks, " << dtype;
      EXPECT_TRUE(torch::equal(engine::decode_int8(whole, {3, 1001}, dtype, run), engine::decode_int8(whole, {3, 1001}, dtype, 1 << 20)))
          << "run of " << run << " blocks, " << dtype;
    }
  }
}

// Gradients through 8-bit checkpoints: close to plain checkpointing's (the recomputation starts from values within
// half a code step), not equal to them, and the same whether the payload waits on the host or on the device.
TEST(Activations, Int8CheckpointGradientsAreCloseToExact) {
  torch::manual_seed(13);
  const auto w1 = torch::randn({24, 24}, torch::requires_grad()) * 0.2, w2 = torch::randn({24, 24}, torch::requires_grad()) * 0.2;
  const auto x0 = torch::randn({3, 37, 24});
  auto layer = [&](int64_t i, const torch::Tensor& h) { return torch::tanh(h.matmul(i % 2 ? w2 : w1)) + h; };
  auto params = [&](int64_t i) { return std::vector<torch::Tensor>{i % 2 ? w2 : w1}; };
  auto grads = [&](ActivationStore* store) {
    const torch::Tensor x = x0.clone().requires_grad_(true);
    nn::CheckpointOffloadScope scope(store);
    const auto g = torch::autograd::grad({nn::checkpoint_sequential(6, 1, x, layer, params).pow(2).sum()}, {x});
    if (store) store->end_pass();
    return g[0];
  };
  ActivationStore host(torch::kCPU, 1, 0, /*int8=*/true, /*to_host=*/true), device(torch::kCPU, 1, 0, true, false);
  const torch::Tensor exact = grads(nullptr), on_host = grads(&host), on_device = grads(&device);
  EXPECT_TRUE(torch::equal(on_host, on_device));
  EXPECT_FALSE(torch::equal(on_host, exact));
  const double rel = ((on_host - exact).norm() / exact.norm()).item<double>();
  EXPECT_LT(rel, 0.02);
  std::cout << "[ gradient error ] 8-bit checkpoints, 6 layers: " << rel << "\n";  // measured value, for the log
  EXPECT_EQ(host.stats().d2h_bytes, 6 * ActivationStore::encoded_bytes(3 * 37 * 24));
  EXPECT_EQ(device.stats().d2h_bytes, 0);
}

// Through the trainer: every strategy trains bitwise as with the inputs on the device (whole model, stage 2 with
// accumulation, stage 3 at two ranks, streamed parameters), and any number kept and prefetched.
TEST(Activations, OffloadedCheckpointsTrainBitwiseAsPlainCheckpointing) {
  train::TrainerOptions o;
  expect_bitwise(train_checkpointed_llama<Offloaded>(1, 3, o), train_checkpointed_llama<Plain>(1, 3, o), "whole model");
  using Z2 = Strategy<Sharded<Stage2>, Accumulate<2>, Precision<bf16, float>, Checkpointed>;
  using Z2Off = Strategy<Sharded<Stage2>, Accumulate<2>, Precision<bf16, float>, Checkpointed, CheckpointOffload<Host>>;
  expect_bitwise(train_checkpointed_llama<Z2Off>(1, 4, o), train_checkpointed_llama<Z2>(1, 4, o), "stage 2, accumulate 2");
  using Z3 = Strategy<Sharded<Stage3>, Precision<bf16, float>, Checkpointed>;
  using Z3Off = Strategy<Sharded<Stage3>, Precision<bf16, float>, Checkpointed, CheckpointOffload<Host>>;
  expect_bitwise(train_checkpointed_llama<Z3Off>(2, 3, o), train_checkpointed_llama<Z3>(2, 3, o), "stage 3, two ranks");
  using St = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, float>, Checkpointed>;
  using StOff = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, float>, Checkpointed, CheckpointOffload<Host>>;
  expect_bitwise(train_checkpointed_llama<StOff>(1, 3, o), train_checkpointed_llama<St>(1, 3, o), "streamed parameters");
  // 8 bits: the host and device payloads train alike, for any prefetch depth, and unlike the exact values.
  using Host8 = Strategy<Precision<bf16, float>, Checkpointed, CheckpointOffload<Host, Int8>>;
  using Device8 = Strategy<Precision<bf16, float>, Checkpointed, CheckpointOffload<Device, Int8>>;
  const Params device8 = train_checkpointed_llama<Device8>(1, 2, o), plain2 = train_checkpointed_llama<Plain>(1, 2, o);
  bool differs = false;
  for (auto& [name, value] : device8) differs |= !torch::equal(value, plain2.at(name));
  EXPECT_TRUE(differs) << "8-bit checkpoints changed nothing";
  for (int keep : {0, 2}) {
    o.checkpoint_prefetch = keep;
    expect_bitwise(train_checkpointed_llama<Offloaded>(1, 2, o), train_checkpointed_llama<Plain>(1, 2, o),
                   "checkpoint_prefetch " + std::to_string(keep));
    expect_bitwise(train_checkpointed_llama<Host8>(1, 2, o), device8, "8-bit, checkpoint_prefetch " + std::to_string(keep));
  }
}

// The planner moves all but the held segment inputs off the device and counts every one on the host; the trainer's
// memory() and transfer counters report what the store held and copied, the same bytes.
TEST(Activations, PlannerAndTrainerCountTheHostCopies) {
  nn::LlamaConfig cfg;
  cfg.vocab = 29, cfg.hidden = 16, cfg.layers = 3, cfg.heads = 4, cfg.kv_heads = 2, cfg.ffn = 24;
  plan::TrainShape shape;
  shape.micro_batch = 2, shape.seq = 8;
  const auto plain = plan::plan_memory<Plain>(cfg.shape(), shape, 1), off = plan::plan_memory<Offloaded>(cfg.shape(), shape, 1);
  const int64_t input = 2 * 8 * 16 * 2;  // one segment input: tokens x hidden x bf16
  EXPECT_EQ(off.activations.host, 3 * input);
  EXPECT_EQ(plain.activations.device - off.activations.device, (3 - 2) * input);  // the one in use and one prefetched stay
  const plan::ModelShape b7{32000, 4096, 32, 32, 32, 11008};
  shape.micro_batch = 8, shape.seq = 2048;
  const auto p7 = plan::plan_memory<Offloaded>(b7, shape, 1), q7 = plan::plan_memory<Plain>(b7, shape, 1);
  EXPECT_EQ(q7.activations.device - p7.activations.device, 30 * int64_t(8 * 2048) * 4096 * 2);  // 8.05 GB at 7B, B=8

  torch::manual_seed(5);
  nn::Llama model(cfg);
  auto t = zero_trainer<Offloaded>(model, Hyper{}, LocalComm::single(), {});
  const torch::Tensor ids = torch::randint(0, cfg.vocab, {2, 9});
  const auto r = t.step([&] { return model->loss(ids.narrow(1, 0, 8), ids.narrow(1, 1, 8)); });
  EXPECT_EQ(t.memory().checkpoint_host_bytes, off.activations.host);
  EXPECT_EQ(r.transfers.d2h_bytes, 3 * input);
  EXPECT_EQ(r.transfers.h2d_bytes, 2 * input);  // the last input stayed on the device
  EXPECT_EQ(strategy_name<Offloaded>(), "Strategy<Precision<bf16, float>, Checkpointed, CheckpointOffload<Host>>");
  // 8 bits: 256 codes + 4 bytes of scale per 256 values on the host, or kept so on the device.
  shape.micro_batch = 8, shape.seq = 2048;
  using Host8 = Strategy<Precision<bf16, float>, Checkpointed, CheckpointOffload<Host, Int8>>;
  using Device8 = Strategy<Precision<bf16, float>, Checkpointed, CheckpointOffload<Device, Int8>>;
  const int64_t values = int64_t(8 * 2048) * 4096, stored = values / 256 * 260;
  EXPECT_EQ(plan::plan_memory<Host8>(b7, shape, 1).activations.host, 32 * stored);
  EXPECT_EQ(q7.activations.device - plan::plan_memory<Host8>(b7, shape, 1).activations.device, 32 * values * 2 - 2 * stored);
  EXPECT_EQ(q7.activations.device - plan::plan_memory<Device8>(b7, shape, 1).activations.device, 32 * (values * 2 - stored));
  EXPECT_EQ(strategy_name<Device8>(), "Strategy<Precision<bf16, float>, Checkpointed, CheckpointOffload<Device, Int8>>");
}

// checkpoint_tiled: the tiles' outputs are the one call's (row by row, float64), the gradients equal it within the
// reduction order of the weights' sums over rows, for a tile that divides nothing; without grad mode it recomputes
// nothing; a tile of 0 or of all rows is the one call.
TEST(Activations, TiledRowsEqualOneCallWithinReductionOrder) {
  torch::manual_seed(31);
  const auto opt = torch::TensorOptions().dtype(torch::kFloat64);
  const auto w1 = torch::randn({11, 29}, opt).requires_grad_(true), w2 = torch::randn({29, 11}, opt).requires_grad_(true);
  const auto x0 = torch::randn({37, 11}, opt);
  int calls = 0;
  const std::function<torch::Tensor(const torch::Tensor&)> mlp = [&](const torch::Tensor& r) {  // r: [rows, 11]
    ++calls;
    return torch::silu(r.matmul(w1)).matmul(w2);
  };
  auto run = [&](int64_t tile) {
    w1.mutable_grad() = torch::Tensor(), w2.mutable_grad() = torch::Tensor();
    const torch::Tensor x = x0.clone().requires_grad_(true);
    const torch::Tensor y = nn::checkpoint_tiled(tile, x, {w1, w2}, mlp);
    (y * y.detach().cos()).sum().backward();
    return std::vector<torch::Tensor>{y.detach(), x.grad(), w1.grad().clone(), w2.grad().clone()};
  };
  const auto one = run(0);
  calls = 0;
  const auto tiled = run(8);  // 5 tiles, the last of 5 rows
  EXPECT_EQ(calls, 10) << "each tile runs once forward and once in its backward";
  EXPECT_TRUE(torch::allclose(tiled[0], one[0], 0, 1e-14)) << "outputs";
  EXPECT_TRUE(torch::allclose(tiled[1], one[1], 1e-13, 1e-12)) << "input gradient";
  for (int i : {2, 3}) EXPECT_TRUE(torch::allclose(tiled[i], one[i], 1e-12, 1e-11)) << "weight gradient " << i;
  for (int64_t tile : {int64_t(37), int64_t(100)}) {
    const auto same = run(tile);
    for (std::size_t i = 0; i < same.size(); ++i) EXPECT_TRUE(torch::equal(same[i], one[i])) << "tile " << tile << ", " << i;
  }
  calls = 0;
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::allclose(nn::checkpoint_tiled(8, x0, {w1, w2}, mlp), one[0], 0, 1e-14));
  }
  EXPECT_EQ(calls, 5);
  EXPECT_THROW(nn::checkpoint_tiled(8, torch::Tensor(), {}, mlp), c10::Error);
}

// A tiled layer recomputed in backward as its segment's last (checkpoint_sequential's last_recomputed, checkpoint_tiled's
// values_unused): its tiles do not run there, only in their own backward, so each tile runs twice instead of three
// times; the loss and gradients are bit for bit those of recomputing it whole, for one-layer and three-layer segments.
TEST(Activations, TiledLayerLastInItsRecomputedSegmentRunsItsTilesTwice) {
  torch::manual_seed(32);
  const auto w1 = torch::randn({11, 29}).requires_grad_(true), w2 = (torch::randn({29, 11}) * 0.2).requires_grad_(true);
  const auto x0 = torch::randn({37, 11});
  int calls = 0;
  const std::function<torch::Tensor(const torch::Tensor&)> mlp = [&](const torch::Tensor& r) {  // r: [rows, 11]
    ++calls;
    return torch::silu(r.matmul(w1)).matmul(w2);
  };
  const auto layer = [&](bool unused) {
    return [&, unused](int64_t, const torch::Tensor& h) { return h + nn::checkpoint_tiled(8, h, {w1, w2}, mlp, unused); };
  };
  auto run = [&](int64_t every, bool skip) {
    w1.mutable_grad() = torch::Tensor(), w2.mutable_grad() = torch::Tensor();
    const torch::Tensor x = x0.clone().requires_grad_(true);
    calls = 0;
    const torch::Tensor loss = nn::checkpoint_sequential(
                                   3, every, x, layer(false),
                                   [&](int64_t) {
                                     return std::vector<torch::Tensor>{w1, w2};
                                   },
                                   skip ? std::function<torch::Tensor(int64_t, const torch::Tensor&)>(layer(true)) : nullptr)
                                   .pow(2)
                                   .sum();
    loss.backward();
    return std::pair{calls, std::vector<torch::Tensor>{loss.detach(), x.grad(), w1.grad().clone(), w2.grad().clone()}};
  };
  for (int64_t every : {1, 3}) {
    const auto [whole_calls, whole] = run(every, false);
    const auto [skip_calls, skipped] = run(every, true);
    // 3 layers x 5 tiles: forward, the segments' recomputation, each tile's backward; the last layers' recomputation skipped
    EXPECT_EQ(whole_calls, 45) << "every " << every;
    EXPECT_EQ(skip_calls, every == 1 ? 30 : 40) << "every " << every;
    for (std::size_t i = 0; i < whole.size(); ++i) EXPECT_TRUE(torch::equal(skipped[i], whole[i])) << "every " << every << ", " << i;
  }
  // A block that returns another shape when recomputed, or a tile function under values_unused that changes the rows'
  // width, is a clear error in backward, not a wrong gradient.
  const auto backward_error = [](const torch::Tensor& y) {
    try {
      y.sum().backward();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  bool again = false;
  const nn::BlockFn unstable = [&](const std::vector<torch::Tensor>& in) { return (again ? in[0].narrow(0, 0, 3) : in[0]) * w1.sum(); };
  const torch::Tensor x = x0.clone().requires_grad_(true);
  const torch::Tensor y = nn::checkpoint(unstable, {x}, {w1});
  again = true;
  EXPECT_NE(backward_error(y).find("must compute the same function when called twice"), std::string::npos);
  const std::function<torch::Tensor(const torch::Tensor&)> widens = [&](const torch::Tensor& r) { return r.matmul(w1); };
  const std::string widened = backward_error(nn::checkpoint_tiled(8, x, {w1}, widens, /*values_unused=*/true));
  EXPECT_NE(widened.find(", 29] Float, its forward ["), std::string::npos) << widened;
}

// A LLaMA whose MLPs run in tiles: the loss and every parameter's gradient equal the untiled model's within fp32
// reduction order, with and without checkpointed blocks (the tiles recomputed inside the blocks' recomputation), and
// evaluation (no grad) gives the untiled logits.
TEST(Activations, TiledMlpLlamaEqualsUntiled) {
  nn::LlamaConfig cfg;
  cfg.vocab = 31, cfg.hidden = 24, cfg.layers = 3, cfg.heads = 4, cfg.kv_heads = 2, cfg.ffn = 40;
  torch::manual_seed(3);
  const torch::Tensor ids = torch::randint(0, cfg.vocab, {3, 13});  // 3 x 12 = 36 tokens: tiles of 7 divide nothing
  torch::manual_seed(4);
  nn::Llama model(cfg);
  auto grads = [&](int64_t tile, int every) {
    model->mlp_tile_tokens = tile, model->checkpoint_every = every;
    model->zero_grad();
    const torch::Tensor loss = model->loss(ids.narrow(1, 0, 12), ids.narrow(1, 1, 12));
    loss.backward();
    std::map<std::string, torch::Tensor> g{{"loss", loss.detach()}};
    for (auto& p : model->named_parameters()) g[p.key()] = p.value().grad().clone();
    return g;
  };
  for (int every : {0, 1, 2}) {  // 2: segments of blocks 0-1 and 2, block 1's recomputed output read by block 2
    const auto one = grads(0, every), tiled = grads(7, every);
    for (auto& [name, g] : one) {
      EXPECT_TRUE(torch::allclose(tiled.at(name), g, 1e-6, 1e-4))
          << name << " (checkpoint_every " << every << "), max |diff| " << (tiled.at(name) - g).abs().max().item<double>();
    }
  }
  torch::NoGradGuard no_grad;
  model->eval();
  model->mlp_tile_tokens = 0;
  const torch::Tensor untiled = model->forward(ids);
  model->mlp_tile_tokens = 5;
  EXPECT_TRUE(torch::allclose(model->forward(ids), untiled, 1e-6, 1e-5));
}

// Through the trainer: a stage-3 unit whose MLP hands its gradient in tiles is reduced once all of them are in (two
// ranks), and a streamed model, offloaded checkpoints and a QLoRA base train with tiles as without, to within the
// bf16 rounding of the tiles' partial gradients.
TEST(Activations, TiledMlpTrainsAsUntiledUnderEveryStrategy) {
  const auto check = [](const Params& tiled, const Params& untiled, const Params& init, const std::string& what) {
    for (auto& [name, t] : untiled) {
      const double moved = (t - init.at(name)).norm().item<double>(), apart = (tiled.at(name) - t).norm().item<double>();
      // each bf16 value may also land one unit in the last place away (norm gains near 1 move by a few units)
      const double ulps = t.abs().max().item<double>() * std::ldexp(1.0, -7) * std::sqrt(double(t.numel()));
      EXPECT_LE(apart, 0.1 * moved + ulps) << what << ": " << name << " moved " << moved << ", tiled differs by " << apart;
    }
  };
  train::TrainerOptions o;
  using Z3 = Strategy<Sharded<Stage3>, Precision<bf16, float>, Checkpointed>;
  check(train_checkpointed_llama<Z3>(2, 3, o, 5), train_checkpointed_llama<Z3>(2, 3, o), train_checkpointed_llama<Z3>(2, 0, o),
        "stage 3, two ranks");
  using StOff = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, float>, Checkpointed, CheckpointOffload<Host>>;
  check(train_checkpointed_llama<StOff>(1, 3, o, 5), train_checkpointed_llama<StOff>(1, 3, o), train_checkpointed_llama<StOff>(1, 0, o),
        "streamed, offloaded checkpoints");
  using QLoRA = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<4, 8, all_linears>, Precision<bf16, float>, Checkpointed>;
  check(train_checkpointed_llama<QLoRA>(1, 3, o, 5), train_checkpointed_llama<QLoRA>(1, 3, o), train_checkpointed_llama<QLoRA>(1, 0, o),
        "QLoRA");
}

// The planner: tiles keep none of a block's MLP values beyond its input rows, so the long-sequence peak falls; the tile
// it picks is none where the untiled step fits, else the largest that fits.
TEST(Activations, PlannerTilesTheMlpOnlyWhereTheStepNeedsIt) {
  using QLoRA = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<16, 32, all_linears>, Precision<bf16, float>, Checkpointed,
                         CheckpointOffload<Host, Int8>>;
  const plan::ModelShape m = *plan::find_preset("llama3-8b");
  plan::TrainShape t;
  t.micro_batch = 1, t.seq = 400'000;
  const int64_t untiled = plan::plan_memory<QLoRA>(m, t, 1).peak().device;
  t.mlp_tile_tokens = 16'384;
  const int64_t tiled = plan::plan_memory<QLoRA>(m, t, 1).peak().device;
  EXPECT_LT(tiled, untiled - int64_t(20e9)) << "gate, up and product of 400k tokens are 34 GB in bf16";
  std::printf("[ planned ] llama3-8b QLoRA, T=400k: untiled %.1f GB, tiles of 16k tokens %.1f GB\n", untiled / 1e9, tiled / 1e9);
  t.mlp_tile_tokens = 0;
  EXPECT_EQ(plan::pick_mlp_tile<QLoRA>(m, t, 1, untiled), 0);
  const int64_t picked = plan::pick_mlp_tile<QLoRA>(m, t, 1, (untiled + tiled) / 2);
  ASSERT_GT(picked, 0);
  EXPECT_EQ(picked % 256, 0);
  t.mlp_tile_tokens = picked;
  EXPECT_LE(plan::plan_memory<QLoRA>(m, t, 1).peak().device, (untiled + tiled) / 2);
  t.mlp_tile_tokens = 0;
  EXPECT_EQ(plan::pick_mlp_tile<QLoRA>(m, t, 1, 1), 256) << "nothing fits: the smallest tile tried";
}

}  // namespace
