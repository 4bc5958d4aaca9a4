// The quantized base in host memory (Offload<Host, Streamed> on an NF4 base): each block's packed bytes in one unit of
// host memory (engine::FrozenUnits), brought to the device ahead of use. On the CPU the copies run in program order;
// streaming moves bytes and never changes them, so training is bitwise the resident base's.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <squeeze/engine/frozen_units.hpp>
#include <squeeze/nn/layerwise.hpp>
#include <squeeze/nn/lora.hpp>

#include "zero_common.hpp"

using namespace zero_test;
using engine::FrozenUnits;

namespace {

using QLoRA = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<4, 8, all_linears>, Precision<bf16, float>, Checkpointed>;
using Streamed =
    Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<4, 8, all_linears>, Precision<bf16, float>, Checkpointed, Offload<Host, Streamed>>;

// Units of tensors of several dtypes and sizes that divide nothing; the values tell unit and tensor apart.
std::vector<std::vector<torch::Tensor>> make_units(int n) {
  std::vector<std::vector<torch::Tensor>> units;
  for (int u = 0; u < n; ++u)
    units.push_back({torch::full({13 + u}, float(u), torch::kFloat32), torch::full({3, 7}, 100 + u, torch::kUInt8),
                     torch::empty({0}, torch::kFloat32), torch::full({5}, 0.5f * float(u), torch::kBFloat16)});
  return units;
}

void expect_unit_values(const std::vector<torch::Tensor>& t, int u, const std::string& when) {
  EXPECT_TRUE(torch::equal(t[0], torch::full({13 + u}, float(u), torch::kFloat32))) << when << ", unit " << u;
  EXPECT_TRUE(torch::equal(t[1], torch::full({3, 7}, 100 + u, torch::kUInt8))) << when << ", unit " << u;
  EXPECT_EQ(t[2].numel(), 0) << when;
  EXPECT_TRUE(torch::equal(t[3], torch::full({5}, 0.5f * float(u), torch::kBFloat16))) << when << ", unit " << u;
}

// Forward visits the units in order, backward in reverse: the first pass fetches only its first unit late (the
// neighbour in the direction of travel is guessed; the turn at the last unit is learned), the second none.
TEST(FrozenUnits, PrefetchLearnsTheForwardAndBackwardOrder) {
  FrozenUnits home(torch::kCPU, /*prefetch_depth=*/1);
  auto units = make_units(4);
  for (int u = 0; u < 4; ++u) EXPECT_EQ(home.add_unit("block" + std::to_string(u), units[std::size_t(u)]), u);
  const std::vector<int> pass = {0, 1, 2, 3, 3, 2, 1, 0};
  for (int round = 0; round < 2; ++round) {
    home.reset_counters();
    for (int u : pass) {
      home.acquire(u);
      expect_unit_values(units[std::size_t(u)], u, "round " + std::to_string(round));
    }
    const engine::FrozenUnitStats s = home.stats();
    EXPECT_EQ(s.fetched_late, round == 0 ? 1 : 0) << "round " << round;
    EXPECT_EQ(s.acquired, round == 0 ? 7 : 6) << "round " << round;  // the second round starts where the first ended
    EXPECT_EQ(s.prefetched + s.fetched_late, s.acquired);
    EXPECT_EQ(s.device_bytes, 2 * home.unit_bytes(3)) << "1 + prefetch_depth slots of the largest unit";
  }
  EXPECT_EQ(home.stats().units, 4);
}

// A unit's tensors are re-pointed in place: a module's registered buffer (the same tensor) follows them; release()
// leaves every tensor on its host view with its values; a unit that does not exist is an error naming it.
TEST(FrozenUnits, ModuleBuffersFollowAndReleaseKeepsTheValues) {
  torch::nn::Module m;
  torch::Tensor codes = m.register_buffer("codes", torch::arange(0, 37, torch::kInt32).to(torch::kUInt8));
  torch::Tensor scale = m.register_buffer("scale", torch::randn({9}));
  const torch::Tensor codes0 = codes.clone(), scale0 = scale.clone();
  FrozenUnits home(torch::kCPU, 0);
  home.add_unit("only", {codes, scale});
  EXPECT_EQ(home.stats().host_bytes, FrozenUnits::bytes_of({codes0, scale0}));
  EXPECT_EQ(FrozenUnits::bytes_of({codes0, scale0}), 256 + 36);
  home.acquire(0);
  EXPECT_EQ(m.named_buffers()["codes"].data_ptr(), codes.data_ptr());
  EXPECT_TRUE(torch::equal(m.named_buffers()["codes"], codes0));
  EXPECT_TRUE(torch::equal(m.named_buffers()["scale"], scale0));
  home.release();
  EXPECT_TRUE(torch::equal(codes, codes0));
  EXPECT_TRUE(torch::equal(scale, scale0));
  EXPECT_EQ(home.stats().device_bytes, 0);
  try {
    home.acquire(3);
    FAIL() << "acquired a unit that does not exist";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unit 3 of 1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(FrozenUnits(torch::kCPU, -1), c10::Error);
}

// Memory that cannot be had for a GPU (here: on a machine without one) is an error naming what failed: the pinned host
// buffer of the first unit (a libtorch without CUDA pins nothing) or the device slots; nothing hangs, and the tensors
// keep their values.
TEST(FrozenUnits, MemoryThatCannotBeAllocatedIsAnErrorNotAHang) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is here: its memory can be allocated";
  FrozenUnits home(torch::Device(torch::kCUDA), 1);
  EXPECT_EQ(home.device(), torch::Device(torch::kCUDA, 0)) << "a GPU without an index is GPU 0, as the layers' inputs name it";
  auto units = make_units(2);
  try {
    for (int u = 0; u < 2; ++u) home.add_unit("blocks." + std::to_string(u), units[std::size_t(u)]);
    home.acquire(0);
    FAIL() << "memory for a missing GPU was allocated";
  } catch (const squeeze::Error& e) {
    const std::string what = e.what();
    EXPECT_TRUE(what.find("pinned host memory for frozen unit 'blocks.0'") != std::string::npos ||
                what.find("device slots") != std::string::npos)
        << what;
  }
  expect_unit_values(units[0], 0, "after the failure");
  expect_unit_values(units[1], 1, "after the failure");
  EXPECT_EQ(home.stats().device_bytes, 0);
}

// Deeper prefetch holds more slots, fetches nothing late after the first pass, and values stay right.
TEST(FrozenUnits, DeeperPrefetchHoldsMoreSlots) {
  for (int depth : {0, 2, 5}) {
    FrozenUnits home(torch::kCPU, depth);
    auto units = make_units(5);
    for (int u = 0; u < 5; ++u) home.add_unit("b" + std::to_string(u), units[std::size_t(u)]);
    for (int round = 0; round < 2; ++round) {
      home.reset_counters();
      for (int u : {0, 1, 2, 3, 4, 3, 2, 1, 0}) {
        home.acquire(u);
        expect_unit_values(units[std::size_t(u)], u, "depth " + std::to_string(depth));
      }
      if (round == 1) EXPECT_EQ(home.stats().fetched_late, depth == 0 ? 8 : 0) << "depth " << depth;
    }
    EXPECT_EQ(home.stats().device_bytes, std::min(1 + depth, 5) * home.unit_bytes(4)) << "depth " << depth;
  }
}

// Through the trainer: a QLoRA model whose NF4 blocks live in host memory trains bitwise as the resident one
// (the adapters after three steps), with and without tiled MLPs.
TEST(FrozenUnits, StreamedBaseTrainsAsTheResidentBase) {
  train::TrainerOptions o;
  for (int64_t tile : {int64_t(0), int64_t(5)}) {
    const Params resident = train_checkpointed_llama<QLoRA>(1, 3, o, tile);
    const Params streamed = train_checkpointed_llama<Streamed>(1, 3, o, tile);
    ASSERT_EQ(resident.size(), streamed.size());
    ASSERT_FALSE(resident.empty());
    for (const auto& [name, t] : resident) EXPECT_TRUE(torch::equal(streamed.at(name), t)) << name << ", tile " << tile;
  }
}

// The trainer reports the base's blocks: host bytes in MemoryUse, the copies in the step's transfer counters.
TEST(FrozenUnits, TrainerCountsTheBlocksInHostMemoryAndTheirCopies) {
  nn::LlamaConfig cfg;
  cfg.vocab = 29, cfg.hidden = 16, cfg.layers = 3, cfg.heads = 4, cfg.kv_heads = 2, cfg.ffn = 24;
  torch::manual_seed(5);
  nn::Llama model(cfg);
  model->checkpoint_every = 1;
  auto t = zero_trainer<Streamed>(model, Hyper{}, LocalComm::create(1).front(), train::TrainerOptions{});
  const torch::Tensor ids = torch::randint(0, cfg.vocab, {2, 9}, torch::kInt64);
  const auto home = nn::frozen_home(*model);
  ASSERT_NE(home, nullptr);
  EXPECT_EQ(home->size(), 3);
  const train::StepResult r = t.step([&] { return model->loss(ids.narrow(1, 0, 8), ids.narrow(1, 1, 8)); });
  ASSERT_TRUE(r.boundary);
  EXPECT_GT(r.transfers.h2d_bytes, 0);
  const train::MemoryUse m = t.memory();
  EXPECT_EQ(m.parameters.host, home->stats().host_bytes);
  EXPECT_GE(m.parameters.host, nn::frozen_base_bytes(*model));
  EXPECT_GE(m.parameters.device, home->stats().device_bytes);
  EXPECT_EQ(home->stats().device_bytes, 2 * home->unit_bytes(0)) << "the block in use and one prefetched";
}

// Built block by block, each block's packed bytes go to host memory as soon as it is packed: the model equals the
// one packed whole and then streamed, and make_trainer adopts its units as they are.
TEST(FrozenUnits, LayerwiseBuildHomesEachBlockAsItIsPacked) {
  nn::LlamaConfig cfg;
  cfg.vocab = 29, cfg.hidden = 16, cfg.layers = 3, cfg.heads = 4, cfg.kv_heads = 2, cfg.ffn = 24;
  nn::LayerwiseOptions lo;
  lo.seed = 11;
  std::vector<int64_t> progress;
  lo.progress = [&](const nn::LayerwiseProgress& p) { progress.push_back(p.blocks); };
  nn::Llama built = nn::build_quantized_llama<Streamed>(cfg, lo);
  const auto home = nn::frozen_home(*built);
  ASSERT_NE(home, nullptr);
  EXPECT_EQ(home->size(), 3);
  EXPECT_EQ(progress, (std::vector<int64_t>{1, 2, 3}));
  nn::Llama whole = nn::build_quantized_llama<QLoRA>(cfg, lo);
  const torch::Tensor ids = torch::randint(0, cfg.vocab, {2, 9}, torch::kInt64);
  torch::NoGradGuard ng;
  EXPECT_TRUE(torch::equal(built->forward(ids), whole->forward(ids)));
  EXPECT_EQ(home->stats().units, 3);
}

// The planner: the packed blocks on the host, 1 + prefetch_depth blocks of them on the device.
TEST(FrozenUnits, PlannerPutsTheBlocksOnTheHost) {
  const plan::ModelShape m = *plan::find_preset("llama-7b");
  plan::TrainShape t;
  t.micro_batch = 1, t.seq = 2048;
  const plan::MemoryPlan resident = plan::plan_memory<QLoRA>(m, t, 1), streamed = plan::plan_memory<Streamed>(m, t, 1);
  const int64_t block = (resident.parameters.device - streamed.parameters.device) / (m.layers - 2);
  EXPECT_EQ(streamed.parameters.host, m.layers * block);
  EXPECT_EQ(streamed.parameters.device + streamed.parameters.host, resident.parameters.device + 2 * block);
  t.prefetch_depth = 3;
  EXPECT_EQ(plan::plan_memory<Streamed>(m, t, 1).parameters.device, streamed.parameters.device + 2 * block);
}

}  // namespace
