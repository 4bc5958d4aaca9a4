// save_checkpoint / load_checkpoint through make_trainer on a user's model (LocalComm threads): resuming is bit for
// bit the uninterrupted run (losses, weights, optimizer state) for stages 0-3 +- offload +- 8-bit state +- mixed
// precision +- accumulation and LoRA / QLoRA; another world size and stage load the same values; refusals change
// nothing; generator states come back.
#include <filesystem>
#include <cstdio>
#include <fstream>
#include <tuple>

#include <squeeze/nn/hf_llama.hpp>
#include <squeeze/train/checkpoint.hpp>

#include "frontdoor_model.hpp"
#include <squeeze/io/posix_file.hpp>

namespace frontdoor {
namespace {

namespace fs = std::filesystem;
using sq::Accumulate;
using sq::bf16;
using sq::half;
using sq::Precision;
using sq::Sharded;

constexpr int kRows = 12;
constexpr int kWindows = 4;

struct TempDir {
  fs::path path;
  TempDir() {
    static int n = 0;
    path = fs::temp_directory_path() / ("squeeze-trainer-ckpt-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
    squeeze::io::remove_tree(path);
    fs::create_directories(path);
  }
  ~TempDir() { squeeze::io::remove_tree(path); }
};

struct TrainRun {
  std::vector<float> losses;                      // rank 0's micro-batch losses
  Params params;                                  // full parameters at the end (rank 0)
  std::vector<std::vector<torch::Tensor>> state;  // rank 0's optimizer state at the end
};

sq::TrainerOptions options_for(bool lora) { return lora ? sq::TrainerOptions{} : sq::TrainerOptions{.replicate = {"norm"}}; }

// Windows [first, last) of a fixed data stream at `world`; loads from `load` first and saves into `save` at the end
// when given. Every run builds the models from seed 0, as a resumed job would.
template <class S>
TrainRun train(int world, int first, int last, const fs::path* load, const fs::path* save, uint64_t model_seed = 0,
               const sq::TrainerOptions* options = nullptr) {
  constexpr int A = S::accumulation_steps;
  torch::manual_seed(1);
  const auto data = torch::randint(37, {kWindows * A, kRows, 9});  // [micro-steps, rows, T + 1]
  TrainRun out;
  std::vector<UserLM> models;
  for (int r = 0; r < world; ++r) torch::manual_seed(model_seed), models.emplace_back();
  sq::comm::run_ranks(world, [&](std::shared_ptr<sq::comm::LocalComm> comm) {
    UserLM& model = models[std::size_t(comm->rank())];
    auto trainer =
        sq::make_trainer<S>(model, sq::AdamW{.lr = 1e-2f, .weight_decay = 0.1f}, comm, options ? *options : options_for(S::has_lora));
    if (load) sq::load_checkpoint(trainer, *load);
    const int r = comm->rank(), per = kRows / world;
    for (int s = first * A; s < last * A; ++s) {
      const auto rows = data[s].narrow(0, r * per, per);
      auto res = trainer.step([&] { return lm_loss(model, rows); });
      if (r == 0) out.losses.push_back(res.loss);
    }
    if (save) sq::save_checkpoint(trainer, *save, {{"window", last}});
    auto full = to_params(trainer.full_parameters());
    auto state = trainer.optimizer_state();
    if (r == 0) {
      out.params = full;
      for (auto& p : state) {
        out.state.emplace_back();
        for (auto& t : p) out.state.back().push_back(t.defined() ? t.detach().cpu().clone() : torch::Tensor());
      }
    }
  });
  return out;
}

void expect_bitwise(const Params& a, const Params& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [n, t] : a) {
    ASSERT_TRUE(b.count(n)) << what << ": missing " << n;
    EXPECT_TRUE(torch::equal(t, b.at(n))) << what << ": " << n << " max |diff| " << (t - b.at(n)).abs().max().item<float>();
  }
}

template <class S>
struct Resume : ::testing::Test {};

using Targets = std::integral_constant<unsigned, sq::LoraTargets::up | sq::LoraTargets::down>;
using Strategies =
    ::testing::Types<sq::Strategy<>, sq::Strategy<Precision<bf16, float>, Accumulate<2>>,
                     sq::Strategy<Sharded<sq::Stage1>, Precision<bf16, float>>, sq::Strategy<Sharded<sq::Stage2>, Precision<half, float>>,
                     sq::Strategy<Sharded<sq::Stage3>, Precision<bf16, float>, Accumulate<2>>,
                     sq::Strategy<Sharded<sq::Stage3>, sq::Offload<sq::Host>, Precision<bf16, float>>,
                     sq::Strategy<Sharded<sq::Stage3>, sq::Offload<sq::Host, sq::Streamed>, Precision<bf16, float>>,
                     sq::Strategy<Sharded<sq::Stage3>, sq::Offload<sq::Host, sq::Streamed>, Precision<bf16, float>, Accumulate<2>>,
                     sq::Strategy<Precision<bf16, float>, sq::QuantizedState<8>>,
                     sq::Strategy<Sharded<sq::Stage1>, sq::Offload<sq::Host>, Precision<bf16, float>, sq::QuantizedState<8>>,
                     sq::Strategy<sq::LoRA<4, 8, Targets::value>, Accumulate<2>>,
                     sq::Strategy<sq::Quantized<4, sq::NF4, sq::DoubleQuant>, sq::LoRA<4, 8, Targets::value>, Sharded<sq::Stage1>>>;
TYPED_TEST_SUITE(Resume, Strategies);

TYPED_TEST(Resume, ContinuesBitForBitAtWorld2) {
  using S = TypeParam;
  const TrainRun whole = train<S>(2, 0, kWindows, nullptr, nullptr);
  TempDir dir;
  const TrainRun first = train<S>(2, 0, 2, nullptr, &dir.path);
  const TrainRun rest = train<S>(2, 2, kWindows, &dir.path, nullptr);
  // the losses of the resumed windows, the weights and the optimizer state: bit for bit
  const std::vector<float> tail(whole.losses.begin() + std::ptrdiff_t(first.losses.size()), whole.losses.end());
  EXPECT_EQ(rest.losses, tail);
  expect_bitwise(rest.params, whole.params, "resumed weights");
  ASSERT_EQ(rest.state.size(), whole.state.size());
  for (size_t p = 0; p < whole.state.size(); ++p)
    for (size_t j = 0; j < whole.state[p].size(); ++j)
      if (whole.state[p][j].defined())
        EXPECT_TRUE(torch::equal(rest.state[p][j], whole.state[p][j])) << "partition " << p << " buffer " << j;
  // the layout on disk: one file per rank, an index, `latest`
  EXPECT_TRUE(fs::exists(dir.path / "latest"));
  EXPECT_TRUE(fs::exists(dir.path / "step-000002" / "rank-00000-of-00002.safetensors"));
  EXPECT_TRUE(fs::exists(dir.path / "step-000002" / "rank-00001-of-00002.safetensors"));
}

// Saved at world 2, stage 1; loaded at worlds 1, 3, 4 under stages 0 and 3 (uneven shards): the same values, then
// training continues within the float reduction-order tolerance of the world-2 continuation.
TEST(TrainerCheckpoint, ReshardsAcrossWorldsAndStages) {
  using Saved = sq::Strategy<Sharded<sq::Stage1>>;
  TempDir dir;
  const TrainRun saved = train<Saved>(2, 0, 2, nullptr, &dir.path);
  const TrainRun cont = train<Saved>(2, 2, 3, &dir.path, nullptr);
  for (int world : {1, 3, 4}) {
    const std::string what = "world " + std::to_string(world);
    const TrainRun loaded3 = train<sq::Strategy<Sharded<sq::Stage3>>>(world, 2, 2, &dir.path, nullptr);
    expect_bitwise(loaded3.params, saved.params, what + ", stage 3: loaded weights");
    const TrainRun loaded0 = train<sq::Strategy<>>(world, 2, 2, &dir.path, nullptr);
    expect_bitwise(loaded0.params, saved.params, what + ", stage 0: loaded weights");
    expect_close(train<sq::Strategy<Sharded<sq::Stage3>>>(world, 2, 3, &dir.path, nullptr).params, cont.params, 1e-5, 1e-4,
                 what + ", stage 3: one more window");
  }
}

// Stage 3's gather units change what a partition is (a layer, or a block of layers in one flat buffer): a checkpoint
// saved with each layer alone loads into a trainer that gathers the whole model as one unit, and back, at the same
// and at another world size; the weights load bit for bit and the next window is bit for bit the one the saving
// layout trains (the units change which collectives run, not the arithmetic).
TEST(TrainerCheckpoint, LoadsAcrossStage3GatherUnits) {
  using S3 = sq::Strategy<Sharded<sq::Stage3>, Precision<bf16, float>>;
  sq::TrainerOptions alone = options_for(false), whole = options_for(false);
  alone.gather_unit = [](const std::string&, const torch::nn::Module&) { return false; };
  whole.gather_unit = [](const std::string& name, const torch::nn::Module&) { return name.empty(); };
  for (const auto& [from, to, what] :
       {std::tuple{&alone, &whole, "layers alone -> one unit"}, std::tuple{&whole, &alone, "one unit -> layers alone"}}) {
    TempDir dir;
    const TrainRun saved = train<S3>(2, 0, 2, nullptr, &dir.path, 0, from);
    const TrainRun cont = train<S3>(2, 2, 3, &dir.path, nullptr, 0, from);
    for (int world : {2, 3}) {
      const std::string at = std::string(what) + ", world " + std::to_string(world);
      expect_bitwise(train<S3>(world, 2, 2, &dir.path, nullptr, 0, to).params, saved.params, at + ": loaded weights");
      if (world == 2) {
        const TrainRun next = train<S3>(world, 2, 3, &dir.path, nullptr, 0, to);
        expect_bitwise(next.params, cont.params, at + ": one more window");
        EXPECT_EQ(next.losses, cont.losses) << at;
      }
    }
  }
}

// 8-bit moments at another world size or stage: decoded at the blocks they were saved in and encoded again at the
// trainer's (each value moves by at most half a code step of its new block). The weights load bit for bit; one more
// window then stays within the 8-bit moments' requantization of the world-2 continuation (lr 1e-2: a 1% change of
// a moment moves an update by about 1e-4).
TEST(TrainerCheckpoint, EightBitMomentsReshardAcrossWorldsAndStages) {
  using Saved = sq::Strategy<Sharded<sq::Stage1>, sq::QuantizedState<8>>;
  TempDir dir;
  const TrainRun saved = train<Saved>(2, 0, 2, nullptr, &dir.path);
  const TrainRun cont = train<Saved>(2, 2, 3, &dir.path, nullptr);
  for (int world : {1, 3}) {
    const std::string what = "8-bit, world " + std::to_string(world);
    using Z3 = sq::Strategy<Sharded<sq::Stage3>, sq::QuantizedState<8>>;
    using Z0 = sq::Strategy<sq::QuantizedState<8>>;
    expect_bitwise(train<Z3>(world, 2, 2, &dir.path, nullptr).params, saved.params, what + ", stage 3: loaded weights");
    expect_bitwise(train<Z0>(world, 2, 2, &dir.path, nullptr).params, saved.params, what + ", stage 0: loaded weights");
    expect_close(train<Z3>(world, 2, 3, &dir.path, nullptr).params, cont.params, 5e-4, 1e-3, what + ", stage 3: one more window");
    expect_close(train<Z0>(world, 2, 3, &dir.path, nullptr).params, cont.params, 5e-4, 1e-3, what + ", stage 0: one more window");
  }
  // The same world and layout still reads the codes as stored: bit for bit (the Resume tests), here through a stage-1
  // trainer at world 2 again.
  expect_bitwise(train<Saved>(2, 2, 3, &dir.path, nullptr).params, cont.params, "8-bit, the saved layout");
}

// Across precisions: bf16 weights with fp32 masters load as fp32 weights (the masters), fp32 weights load as bf16
// weights rounded from them (and as the masters); then training goes on.
TEST(TrainerCheckpoint, ConvertsBetweenBf16WithMastersAndFp32) {
  using Bf16 = sq::Strategy<Sharded<sq::Stage1>, Precision<bf16, float>>;
  using Fp32 = sq::Strategy<>;
  TempDir a, b;
  const TrainRun bf = train<Bf16>(2, 0, 2, nullptr, &a.path);
  const TrainRun as_fp32 = train<Fp32>(1, 2, 2, &a.path, nullptr);
  for (const auto& [n, t] : as_fp32.params)
    EXPECT_TRUE(torch::equal(t.to(torch::kBFloat16).to(torch::kFloat32), bf.params.at(n))) << n << ": the fp32 weight is the master";
  EXPECT_EQ(train<Fp32>(1, 2, 3, &a.path, nullptr).losses.size(), 1u);

  const TrainRun fp = train<Fp32>(1, 0, 2, nullptr, &b.path);
  const TrainRun as_bf16 = train<sq::Strategy<Sharded<sq::Stage3>, Precision<bf16, float>>>(3, 2, 2, &b.path, nullptr);
  for (const auto& [n, t] : as_bf16.params)
    EXPECT_TRUE(torch::equal(t, fp.params.at(n).to(torch::kBFloat16).to(torch::kFloat32))) << n << ": bf16 rounded from fp32";
}

TEST(TrainerCheckpoint, RefusalsNameTheProblemAndChangeNothing) {
  using Fp32 = sq::Strategy<Sharded<sq::Stage1>>;
  using Adam8 = sq::Strategy<Sharded<sq::Stage1>, sq::QuantizedState<8>>;
  TempDir dir, dir8;
  train<Fp32>(2, 0, 1, nullptr, &dir.path);
  train<Adam8>(2, 0, 1, nullptr, &dir8.path);
  sq::comm::run_ranks(1, [&](std::shared_ptr<sq::comm::LocalComm> comm) {
    torch::manual_seed(0);
    UserLM model;
    auto t8 = sq::make_trainer<Adam8>(model, sq::AdamW{.lr = 1e-2f}, comm, options_for(false));
    const Params before = to_params(t8.full_parameters());
    // another kind of optimizer state
    std::string e = error_of([&] { sq::load_checkpoint(t8, dir.path); });
    EXPECT_NE(e.find("the same kind of moments"), std::string::npos) << e;
    // 8-bit moments at another world size from an index without parameter groups (as older checkpoints wrote it)
    {
      const fs::path index = dir8.path / "step-000001" / "index.json";
      nlohmann::json j = nlohmann::json::parse(std::ifstream(index));
      for (auto& part : j["partitions"])
        for (auto& entry : part["entries"]) entry.erase("group");
      std::ofstream(index) << j.dump(2);
    }
    e = error_of([&] { sq::load_checkpoint(t8, dir8.path); });
    EXPECT_NE(e.find("saved without their parameter groups"), std::string::npos) << e;
    expect_bitwise(to_params(t8.full_parameters()), before, "after refused loads");
    // nothing to resume from
    TempDir empty;
    e = error_of([&] { sq::load_checkpoint(t8, empty.path); });
    EXPECT_NE(e.find("no checkpoint to resume from"), std::string::npos) << e;
  });
  // a model with other parameters: the parameter is named
  sq::comm::run_ranks(1, [&](std::shared_ptr<sq::comm::LocalComm> comm) {
    torch::manual_seed(0);
    UserLM other(37, 11);
    auto t = sq::make_trainer<Fp32>(other, sq::AdamW{.lr = 1e-2f}, comm, options_for(false));
    const std::string e = error_of([&] { sq::load_checkpoint(t, dir.path); });
    EXPECT_NE(e.find("parameter 'down.weight' is [37, 39] in the checkpoint and [37, 33]"), std::string::npos) << e;
  });
  // a corrupted rank file: the checksum catches it
  {
    std::fstream f(dir.path / "step-000001" / "rank-00001-of-00002.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x5a');
  }
  sq::comm::run_ranks(2, [&](std::shared_ptr<sq::comm::LocalComm> comm) {
    torch::manual_seed(0);
    UserLM model;
    auto t = sq::make_trainer<Fp32>(model, sq::AdamW{.lr = 1e-2f}, comm, options_for(false));
    const std::string e = error_of([&] { sq::load_checkpoint(t, dir.path); });
    EXPECT_NE(e.find("checksum mismatch"), std::string::npos) << e;
  });
}

TEST(TrainerCheckpoint, SavingInsideAnAccumulationWindowIsRefused) {
  using S = sq::Strategy<Precision<bf16, float>, Accumulate<3>>;
  TempDir dir;
  torch::manual_seed(0);
  UserLM model;
  auto t = sq::make_trainer<S>(model, sq::AdamW{.lr = 1e-2f}, sq::comm::LocalComm::single(), options_for(false));
  const auto rows = torch::randint(37, {4, 9});
  t.step([&] { return lm_loss(model, rows); });
  const std::string e = error_of([&] { sq::save_checkpoint(t, dir.path); });
  EXPECT_NE(e.find("inside an accumulation window (1 of 3"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(dir.path / "latest"));
}

TEST(TrainerCheckpoint, FrozenBaseMustBeTheOneTrainedOn) {
  using LoRA = sq::Strategy<sq::LoRA<4, 8, Targets::value>>;
  TempDir dir;
  train<LoRA>(1, 0, 1, nullptr, &dir.path);
  const std::string e = error_of([&] { train<LoRA>(1, 1, 2, &dir.path, nullptr, /*model_seed=*/3); });
  EXPECT_NE(e.find("frozen tensors"), std::string::npos) << e;
}

TEST(TrainerCheckpoint, RecordKeepLastAndGeneratorStatesComeBack) {
  using S = sq::Strategy<Precision<bf16, float>>;
  TempDir dir;
  torch::manual_seed(0);
  UserLM model;
  auto t = sq::make_trainer<S>(model, sq::AdamW{.lr = 1e-2f}, sq::comm::LocalComm::single(), options_for(false));
  const auto rows = torch::randint(37, {4, 9});
  for (int s = 0; s < 4; ++s) {
    t.step([&] { return lm_loss(model, rows); });
    sq::save_checkpoint(t, dir.path, {{"batch", s}}, {.keep_last = 2});
  }
  EXPECT_FALSE(fs::exists(dir.path / "step-000002"));
  EXPECT_TRUE(fs::exists(dir.path / "step-000003"));
  EXPECT_TRUE(fs::exists(dir.path / "step-000004"));
  torch::manual_seed(77);
  sq::save_checkpoint(t, dir.path, {{"batch", 9}});  // step 4 again: replaces the checkpoint `latest` names
  const torch::Tensor drawn = torch::rand({5});
  const nlohmann::json record = sq::load_checkpoint(t, dir.path);
  EXPECT_EQ(record.at("batch"), 9);
  EXPECT_TRUE(torch::equal(torch::rand({5}), drawn)) << "the CPU generator state was not restored";
  EXPECT_EQ(t.steps_applied(), 4);
  EXPECT_EQ(sq::load_checkpoint(t, dir.path, {.step = 3}).at("batch"), 2);
  EXPECT_EQ(t.steps_applied(), 3);
}

#ifdef SQUEEZE_CKPT_TOOL
std::string run_tool(const std::string& args, int* rc) {
  const std::string cmd = std::string(SQUEEZE_CKPT_TOOL) + " " + args + " 2>&1";
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  char buf[4096];
  while (p && std::fgets(buf, sizeof buf, p)) out += buf;
  *rc = p ? ::pclose(p) : -1;
  return out;
}

// squeeze-ckpt on a stage-3 checkpoint of world 2: info names it, verify passes (and fails on a corrupt file),
// consolidate writes the trained weights under their names, reshard writes a world-3 checkpoint that a world-3
// trainer loads to the same values.
TEST(TrainerCheckpoint, CommandLineToolInfoVerifyConsolidateReshard) {
  using S = sq::Strategy<Sharded<sq::Stage3>, Precision<bf16, float>>;
  TempDir dir, out;
  const TrainRun saved = train<S>(2, 0, 2, nullptr, &dir.path);
  int rc = 0;
  std::string text = run_tool("info " + dir.path.string(), &rc);
  EXPECT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("Strategy<Sharded<Stage3>, Precision<bf16, float>>"), std::string::npos) << text;
  EXPECT_NE(text.find("world size  2"), std::string::npos) << text;
  text = run_tool("verify " + dir.path.string(), &rc);
  EXPECT_EQ(rc, 0) << text;
  const fs::path weights = out.path / "weights.safetensors";
  text = run_tool("consolidate " + dir.path.string() + " " + weights.string(), &rc);
  ASSERT_EQ(rc, 0) << text;
  const auto f = sq::io::SafetensorsReader::open(weights);
  for (const auto& [name, t] : saved.params) {
    ASSERT_TRUE(f.contains(name)) << name;
    const auto values = f.read_bytes(name);  // fp32 masters
    const torch::Tensor got = torch::from_blob(const_cast<std::byte*>(values.data()), {int64_t(values.size() / 4)}, torch::kFloat32);
    EXPECT_TRUE(torch::equal(got.to(torch::kBFloat16).to(torch::kFloat32), t.reshape({-1}))) << name << ": the master rounds to the weight";
  }
  text = run_tool("reshard " + dir.path.string() + " " + (out.path / "w3").string() + " --world 3", &rc);
  ASSERT_EQ(rc, 0) << text;
  const fs::path w3 = out.path / "w3";
  expect_bitwise(train<S>(3, 2, 2, &w3, nullptr).params, saved.params, "resharded by the tool to world 3");
  {
    std::fstream fcorrupt(dir.path / "step-000002" / "rank-00000-of-00002.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    fcorrupt.seekp(-2, std::ios::end);
    fcorrupt.put('\x11');
  }
  text = run_tool("verify " + dir.path.string(), &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(text.find("checksum mismatch"), std::string::npos) << text;
}

// consolidate --hf-config: a stage-3 checkpoint of a fine-tuned Hugging Face model (llama3-tiny: GQA, tied
// embeddings, llama3 RoPE scaling) becomes a directory load_hf_llama reads, with the fp32 masters that round to
// the trained bf16 weights; a config of another model is refused, naming what does not fit.
TEST(TrainerCheckpoint, ConsolidateIntoAHuggingFaceDirectory) {
  using S = sq::Strategy<Sharded<sq::Stage3>, Precision<bf16, float>>;
  const fs::path source = fs::path(SQUEEZE_HF_FIXTURES) / "llama3-tiny";
  TempDir dir, out;
  Params trained;
  std::vector<sq::nn::Llama> models;
  for (int r = 0; r < 2; ++r) models.push_back(sq::nn::load_hf_llama(source, {.dtype = torch::kFloat32}));
  sq::comm::run_ranks(2, [&](std::shared_ptr<sq::comm::LocalComm> comm) {
    sq::nn::Llama& m = models[std::size_t(comm->rank())];
    auto trainer = sq::make_trainer<S>(m, sq::AdamW{.lr = 1e-2f}, comm);
    torch::manual_seed(3 + comm->rank());
    const torch::Tensor ids = torch::randint(m->config.vocab, {2, 7}, torch::kLong);  // [B, T + 1]
    trainer.step([&] { return m->loss(ids.narrow(1, 0, 6), ids.narrow(1, 1, 6)); });
    auto full = trainer.full_parameters();
    sq::save_checkpoint(trainer, dir.path);
    if (comm->rank() == 0) trained = Params(full.begin(), full.end());
  });
  int rc = 0;
  const fs::path hf = out.path / "hf";
  std::string text = run_tool("consolidate " + dir.path.string() + " " + hf.string() + " --hf-config " + source.string(), &rc);
  ASSERT_EQ(rc, 0) << text;
  const sq::nn::Llama back = sq::nn::load_hf_llama(hf);
  EXPECT_EQ(sq::io::load_llama_config(hf).dtype, sq::io::DType::F32);
  EXPECT_TRUE(back->config.tie_embeddings);
  const auto loaded = back->named_parameters();
  ASSERT_EQ(loaded.size(), trained.size());
  for (const auto& [name, t] : trained) {
    const torch::Tensor* q = loaded.find(name);
    ASSERT_NE(q, nullptr) << name;
    EXPECT_TRUE(torch::equal(q->to(torch::kBFloat16), t)) << name << ": the master rounds to the trained weight";
  }
  text = run_tool("consolidate " + dir.path.string() + " " + (out.path / "wrong").string() + " --hf-config " +
                      (fs::path(SQUEEZE_HF_FIXTURES) / "llama2-tiny").string(),
                  &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(text.find("is not of that model"), std::string::npos) << text;
  EXPECT_NE(text.find("layer 2 does not exist"), std::string::npos) << text;
  EXPECT_FALSE(fs::exists(out.path / "wrong" / "model.safetensors"));
}
#endif

}  // namespace
}  // namespace frontdoor
