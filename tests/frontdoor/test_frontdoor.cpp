// make_trainer on a user's model: sharding, refusals, LoRA / QLoRA over ranks, Checkpointed, parameter groups and
// token weighting. The parity of every stage against unsharded training is in test_frontdoor_parity.cpp.
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "frontdoor_model.hpp"

namespace frontdoor {
namespace {

using sq::bf16;
using sq::Precision;
using sq::Sharded;

int64_t count_params(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// Stage 3 really shards the user's layers: every rank holds about 1/N of the model, and only the norm stays whole.
TEST(FrontDoor, Stage3ShardsTheUserModelAcrossRanks) {
  using S = sq::Strategy<Sharded<sq::Stage3>, Precision<bf16, float>>;
  constexpr int64_t vocab = 1001, dim = 67;  // large enough that the shards' alignment padding is small
  const int64_t total = count_params(*UserLM(vocab, dim).ptr());
  const int64_t norm = 2 * dim;  // LayerNorm weight + bias
  for (int world : {1, 2, 4}) {
    std::vector<sq::MemoryUse> mem(static_cast<std::size_t>(world));
    std::vector<UserLM> models;
    for (int r = 0; r < world; ++r) torch::manual_seed(0), models.emplace_back(vocab, dim);
    sq::comm::run_ranks(world, [&](std::shared_ptr<sq::comm::LocalComm> comm) {
      UserLM& model = models[std::size_t(comm->rank())];
      auto trainer = sq::make_trainer<S>(model, sq::AdamW{}, comm, {.replicate = {"norm"}});
      mem[std::size_t(comm->rank())] = trainer.memory();
    });
    for (const auto& m : mem) {
      EXPECT_EQ(m.persistent_params, norm) << "world " << world;
      const double per_rank = double(m.parameters.device) / 2.0;  // bf16 elements held (shards + whole-kept)
      const double ideal = double(total - norm) / world + norm;
      EXPECT_LT(per_rank, ideal * 1.05 + 4 * 512) << "world " << world;  // padding: each of 4 groups to 128 x world
      EXPECT_GT(per_rank, ideal * 0.95) << "world " << world;
    }
  }
}

// Plain libtorch layers that Stage 3 would have to shard are refused by name and size, unless listed in replicate.
TEST(FrontDoor, PlainTorchLinearUnderStage3IsRefusedWithNameAndSize) {
  struct PlainImpl : torch::nn::Module {
    torch::nn::Linear fc{nullptr};
    PlainImpl() : fc(register_module("fc", torch::nn::Linear(7, 5))) {}
  };
  auto model = std::make_shared<PlainImpl>();
  using S = sq::Strategy<Sharded<sq::Stage3>>;
  const std::string e = error_of([&] { sq::make_trainer<S>(model, sq::AdamW{}, sq::comm::LocalComm::single()); });
  EXPECT_NE(e.find("'fc'"), std::string::npos) << e;
  EXPECT_NE(e.find("40 parameters"), std::string::npos) << e;
  EXPECT_NE(e.find("squeeze::nn::Linear"), std::string::npos) << e;
  // accepted when kept whole on purpose, and then counted as whole-kept
  auto trainer = sq::make_trainer<S>(model, sq::AdamW{}, sq::comm::LocalComm::single(), {.replicate = {"fc"}});
  EXPECT_EQ(trainer.memory().persistent_params, 40);
}

// Bad input names the module or parameter at fault.
TEST(FrontDoor, BadModelsAreRefusedNamingTheModule) {
  using QLoRA = sq::Strategy<sq::Quantized<4, sq::NF4, sq::DoubleQuant>, sq::LoRA<4, 8, sq::LoraTargets::up | sq::LoraTargets::down>,
                             Precision<bf16, float>>;
  {  // a plain torch Linear named like a projection under QLoRA: its base would be packed behind the member's back
    struct MixedImpl : torch::nn::Module {
      sq::nn::Linear up{nullptr};
      torch::nn::Linear gate{nullptr};
      MixedImpl() : up(register_module("up", sq::nn::Linear(8, 8))), gate(register_module("gate", torch::nn::Linear(8, 8))) {}
    };
    auto m = std::make_shared<MixedImpl>();
    const std::string e = error_of([&] { sq::make_trainer<QLoRA>(m, sq::AdamW{}, sq::comm::LocalComm::single()); });
    EXPECT_NE(e.find("'gate'"), std::string::npos) << e;
    EXPECT_NE(e.find("quantizes"), std::string::npos) << e;
  }
  {  // a quantized strategy with nothing to quantize
    struct NoLinearImpl : torch::nn::Module {
      sq::nn::Embedding embed{nullptr};
      NoLinearImpl() : embed(register_module("embed", sq::nn::Embedding(10, 4))) {}
    };
    auto m = std::make_shared<NoLinearImpl>();
    const std::string e = error_of([&] { sq::make_trainer<QLoRA>(m, sq::AdamW{}, sq::comm::LocalComm::single()); });
    EXPECT_NE(e.find("squeeze::nn::Linear"), std::string::npos) << e;
  }
  {  // a model in a dtype the strategy cannot start from
    UserLM m;
    m->to(torch::kFloat64);
    using S = sq::Strategy<Precision<bf16, float>>;
    const std::string e = error_of([&] { sq::make_trainer<S>(m, sq::AdamW{}, sq::comm::LocalComm::single()); });
    EXPECT_NE(e.find("embed.weight"), std::string::npos) << e;
    EXPECT_NE(e.find("Double"), std::string::npos) << e;
  }
  {  // Checkpointed on a model that recomputes nothing: refused at the first step, saying what to write
    UserLM m;
    using S = sq::Strategy<Precision<bf16, float>, sq::Checkpointed>;
    auto trainer = sq::make_trainer<S>(m, sq::AdamW{}, sq::comm::LocalComm::single(), {});
    const auto seq = torch::randint(37, {2, 5});
    const std::string e = error_of([&] { trainer.step([&] { return lm_loss(m, seq); }); });
    EXPECT_NE(e.find("squeeze::nn::Blocks"), std::string::npos) << e;
  }
}

// The trainer converts a float model itself, seeding the fp32 masters from the float values: the same training
// as handing it a bf16 model together with those float values.
TEST(FrontDoor, FloatModelIsConvertedWithMastersFromItsFloatValues) {
  using S = sq::Strategy<Precision<bf16, float>>;
  const auto seq = torch::randint(37, {4, 9});
  auto run = [&](bool pre_converted) {
    torch::manual_seed(0);
    UserLM model;
    sq::TrainerOptions opt;
    Params floats;
    if (pre_converted) {
      for (const auto& p : model->named_parameters()) floats[p.key()] = p.value().detach().clone();
      model->to(torch::kBFloat16);
      opt.master_init = [&](const std::string& n) { return floats.at(n); };
    }
    auto trainer = sq::make_trainer<S>(model, sq::AdamW{.lr = 1e-2f}, sq::comm::LocalComm::single(), opt);
    for (int i = 0; i < 3; ++i) trainer.step([&] { return lm_loss(model, seq); });
    return to_params(trainer.full_parameters());
  };
  const Params a = run(false), b = run(true);
  for (const auto& [n, t] : a) EXPECT_TRUE(torch::equal(t, b.at(n))) << n;
}

// Parameter groups: by default no weight decay on norms, biases and embeddings; per-group lr scale and decay.
TEST(FrontDoor, ParameterGroupsExemptNormsBiasesEmbeddingsFromDecay) {
  using S = sq::Strategy<Sharded<sq::Stage2>>;
  constexpr float lr = 0.1f, wd = 0.5f;
  for (int world : {1, 2}) {
    std::vector<UserLM> models;
    for (int r = 0; r < world; ++r) torch::manual_seed(0), models.emplace_back();
    sq::comm::run_ranks(world, [&](std::shared_ptr<sq::comm::LocalComm> comm) {
      UserLM& model = models[std::size_t(comm->rank())];
      Params before;
      for (const auto& p : model->named_parameters()) before[p.key()] = p.value().detach().clone();
      sq::TrainerOptions opt{.replicate = {"norm"}};
      opt.param_groups.push_back({.match = [](const std::string& n) { return n == "down.weight"; }, .lr_scale = 0.5f});
      auto trainer = sq::make_trainer<S>(model, sq::AdamW{.lr = lr, .weight_decay = wd}, comm, opt);
      const auto seq = torch::randint(37, {2, 5});
      // A zero gradient: Adam's step is 0, so only the decoupled decay w <- w (1 - lr_g wd_g) moves a weight.
      trainer.step([&] { return lm_loss(model, seq) * 0.0; });
      const Params after = to_params(trainer.full_parameters());
      for (const auto& [n, w0] : before) {
        const bool exempt = n == "embed.weight" || n.ends_with("bias") || n.starts_with("norm.");
        const float factor = exempt ? 1.0f : n == "down.weight" ? 1.0f - 0.5f * lr * wd : 1.0f - lr * wd;
        EXPECT_TRUE(torch::allclose(after.at(n), w0 * factor, 1e-6, 1e-7)) << n << " world " << world;
      }
    });
  }
}

// Token-weighted accumulation: micro-batches with different target counts give one big batch's gradient.
TEST(FrontDoor, TokenWeightedAccumulationMatchesOneBigBatch) {
  torch::manual_seed(3);
  auto seq = torch::randint(37, {6, 9});
  // micro-batch i keeps (i + 1) * 2 of its 8 targets: unequal counts, so 1/N weighting would differ
  std::vector<torch::Tensor> micro;
  for (int i = 0; i < 3; ++i) {
    auto s = seq.narrow(0, 2 * i, 2).clone();
    s.narrow(1, 1 + (i + 1) * 2, 8 - (i + 1) * 2).fill_(-100);
    micro.push_back(s);
  }
  const auto whole = torch::cat(micro, 0);
  auto tokens = [](const torch::Tensor& s) { return s.narrow(1, 1, s.size(1) - 1).ne(-100).sum().item<int64_t>(); };
  auto train = [&](auto strategy_tag, bool big, bool weighted, int world) {
    using S = typename decltype(strategy_tag)::type;
    Params out;
    std::vector<UserLM> models;
    for (int r = 0; r < world; ++r) torch::manual_seed(0), models.emplace_back();
    sq::comm::run_ranks(world, [&](std::shared_ptr<sq::comm::LocalComm> comm) {
      UserLM& model = models[std::size_t(comm->rank())];
      auto trainer = sq::make_trainer<S>(model, sq::AdamW{.lr = 1e-2f}, comm, {.replicate = {"norm"}});
      if (big) {
        trainer.step([&] { return lm_loss(model, whole); });
      } else {
        for (int i = comm->rank(); i < 3 * world; i += world) {  // world 1: micro-batches 0, 1, 2; world 3: one each
          const auto& s = micro[std::size_t(i % 3)];
          if (weighted)
            trainer.step([&] { return lm_loss(model, s); }, tokens(s));
          else
            trainer.step([&] { return lm_loss(model, s); });
          if (world > 1) break;
        }
      }
      auto p = to_params(trainer.full_parameters());
      if (comm->rank() == 0) out = p;
    });
    return out;
  };
  struct One {
    using type = sq::Strategy<Sharded<sq::Stage2>>;
  };
  struct Three {
    using type = sq::Strategy<Sharded<sq::Stage2>, sq::Accumulate<3>>;
  };
  const Params ref = train(One{}, true, false, 1);
  expect_close(train(Three{}, false, true, 1), ref, 1e-6, 1e-5, "token-weighted, 3 micro-batches");
  expect_close(train(One{}, false, true, 3), ref, 1e-6, 1e-5, "token-weighted, 3 ranks");
  // the check has teeth: plain 1/N averaging of the same micro-batches is another gradient
  const Params plain = train(Three{}, false, false, 1);
  EXPECT_FALSE(torch::allclose(plain.at("up.weight"), ref.at("up.weight"), 1e-5, 1e-6));
}

// ---- Checkpointed: nn::Blocks and nn::checkpoint ---------------------------------------------------------------

// Live and peak bytes of CPU tensors, to see activation memory. Replaces the CPU allocator; the context is the data
// pointer (as c10's raw allocations require), the size in a header before it.
struct CountingAllocator final : c10::Allocator {
  static constexpr size_t kHeader = 64;  // keeps c10's 64-byte alignment
  std::atomic<int64_t> live{0}, peak{0};
  static void release(void* data) {
    char* raw = static_cast<char*>(data) - kHeader;
    size_t n;
    CountingAllocator* self;
    std::memcpy(&n, raw, sizeof n);
    std::memcpy(&self, raw + 8, sizeof self);
    self->live -= int64_t(n);
    c10::free_cpu(raw);
  }
  c10::DataPtr allocate(size_t n) override {
    char* raw = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    CountingAllocator* self = this;
    std::memcpy(raw, &n, sizeof n);
    std::memcpy(raw + 8, &self, sizeof self);
    void* data = raw + kHeader;
    const int64_t now = live += int64_t(n);
    for (int64_t p = peak.load(); now > p && !peak.compare_exchange_weak(p, now);) {}
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  // The CPU allocator while in scope, then the default again. c10 ignores a setting of lower priority than the last,
  // so each one goes above every earlier one (tests of one process run in turn).
  struct Installed {
    static inline uint8_t priority = 100;
    explicit Installed(c10::Allocator* a) { c10::SetCPUAllocator(a, ++priority); }
    ~Installed() { c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), ++priority); }
  };
};

struct BlockImpl : torch::nn::Module {
  sq::nn::Linear a{nullptr}, b{nullptr};
  std::atomic<int>* forwards;
  BlockImpl(int64_t d, std::atomic<int>* f)
      : a(register_module("a", sq::nn::Linear(d, 4 * d))), b(register_module("b", sq::nn::Linear(4 * d, d))), forwards(f) {}
  torch::Tensor forward(const torch::Tensor& x) {  // [N, d] -> [N, d]
    ++*forwards;
    return x + b(torch::gelu(a(x)));
  }
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Module {
  sq::nn::Blocks blocks{nullptr};
  std::vector<Block> list;  // the same blocks, for the nn::checkpoint(block, x) form
  bool use_calls;
  StackImpl(int64_t d, int n, std::atomic<int>* f, bool calls) : use_calls(calls) {
    if (!calls) blocks = register_module("blocks", sq::nn::Blocks());
    for (int i = 0; i < n; ++i) {
      Block blk(d, f);
      if (calls)
        list.push_back(register_module("block" + std::to_string(i), blk));
      else
        blocks->push_back(blk);
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    if (!use_calls) return blocks(x);
    for (auto& b : list) x = sq::nn::checkpoint(b, x);
    return x;
  }
};
TORCH_MODULE(Stack);

TEST(FrontDoor, CheckpointedOnAPlainModelSameGradientsLessActivationMemory) {
  auto* counting = new CountingAllocator();  // lives as long as the process: tensors it made may outlive the test
  const CountingAllocator::Installed installed(counting);
  const auto x = torch::randn({256, 32});
  for (bool calls : {false, true}) {
    auto run = [&](auto tag, int64_t* activation_peak, int* forwards_per_step) {
      using S = typename decltype(tag)::type;
      std::atomic<int> forwards{0};
      torch::manual_seed(0);
      Stack model(32, 4, &forwards, calls);
      auto trainer = sq::make_trainer<S>(model, sq::AdamW{.lr = 1e-2f}, sq::comm::LocalComm::single(), {});
      for (int i = 0; i < 2; ++i) {
        forwards = 0;
        const int64_t before = counting->live.load();
        counting->peak = before;
        trainer.step([&] { return model(x).pow(2).mean(); });
        *activation_peak = counting->peak.load() - before;
        *forwards_per_step = forwards.load();
      }
      return to_params(trainer.full_parameters());
    };
    struct Plain {
      using type = sq::Strategy<Sharded<sq::Stage1>>;
    };
    struct Ckpt {
      using type = sq::Strategy<Sharded<sq::Stage1>, sq::Checkpointed>;
    };
    int64_t peak_plain = 0, peak_ckpt = 0;
    int fw_plain = 0, fw_ckpt = 0;
    const Params a = run(Plain{}, &peak_plain, &fw_plain), b = run(Ckpt{}, &peak_ckpt, &fw_ckpt);
    for (const auto& [n, t] : a) EXPECT_TRUE(torch::equal(t, b.at(n))) << n << (calls ? " (checkpoint calls)" : " (Blocks)");
    EXPECT_EQ(fw_plain, 4);
    EXPECT_EQ(fw_ckpt, 8);  // each block runs again in backward
    EXPECT_LT(double(peak_ckpt), 0.7 * double(peak_plain)) << "plain " << peak_plain << " B, checkpointed " << peak_ckpt << " B";
  }
}

// ---- Stages 0-1: when the full gradient buffer exists (TrainerOptions::gradient_buffers) ----------------------

// A checkpointed stack at a batch of a few rows: the activations are few bytes beside one gradient, as at LLaMA-7B
// with checkpointing. at_backward then peaks one gradient lower than after_backward, whose per-parameter gradients
// meet the flat buffer they move into at the end of backward; every timing trains the same weights bit for bit,
// also when it changes between steps, with accumulation (in .grad, or in an fp32 accumulator) and over two ranks.
TEST(FrontDoor, GradientBuffersAtBackwardSameWeightsOneGradientLess) {
  using G = sq::train::GradientBuffers;
  auto* counting = new CountingAllocator();  // lives as long as the process: tensors it made may outlive the test
  const CountingAllocator::Installed installed(counting);
  torch::manual_seed(3);
  const auto x = torch::randn({2, 4, 6, 48});  // [ranks, steps, rows, d]: 6 rows a step, sizes that do not divide
  struct Run {
    Params weights;
    int64_t step_peak = 0;        // the most bytes above the live ones before a step, over steps 2-4 (state allocated)
    int64_t gradients_after = 0;  // memory().gradients.device between steps
    int64_t one_gradient = 0;
  };
  // timing(s): the timing for step s (set between steps through set_gradient_buffers from step 1 on).
  auto run = [&](auto tag, int world, const std::function<G(int)>& timing) {
    using S = typename decltype(tag)::type;
    Run out;
    std::vector<Stack> models;
    std::atomic<int> forwards{0};
    for (int r = 0; r < world; ++r) torch::manual_seed(0), models.emplace_back(48, 4, &forwards, false);
    sq::comm::run_ranks(world, [&](std::shared_ptr<sq::comm::LocalComm> comm) {
      Stack& model = models[std::size_t(comm->rank())];
      auto trainer = sq::make_trainer<S>(model, sq::AdamW{.lr = 1e-2f}, comm, {.gradient_buffers = timing(0)});
      for (int s = 0; s < 4; ++s) {
        if (s > 0) trainer.set_gradient_buffers(timing(s));
        const int64_t before = counting->live.load();
        if (world == 1) counting->peak = before;
        const auto xs = x[comm->rank()][s].to(sq::torch_dtype<typename S::compute_type>());
        for (int m = 0; m < S::accumulation_steps; ++m) {
          const int64_t rows = 6 / S::accumulation_steps;
          trainer.step([&] { return model(xs.narrow(0, m * rows, rows)).to(torch::kFloat32).pow(2).mean(); });
        }
        if (world == 1 && s > 0) out.step_peak = std::max(out.step_peak, counting->peak.load() - before);
      }
      auto p = to_params(trainer.full_parameters());
      if (comm->rank() == 0) {
        out.weights = p;
        out.gradients_after = trainer.memory().gradients.device;
        out.one_gradient = trainer.memory().full_gradient_bytes;
      }
    });
    return out;
  };
  auto fixed = [](G g) { return [g](int) { return g; }; };
  struct Fp32 {
    using type = sq::Strategy<sq::Checkpointed>;
  };
  struct Bf16Stage1 {
    using type = sq::Strategy<Sharded<sq::Stage1>, Precision<bf16, float>, sq::Checkpointed>;
  };
  struct Fp32Accum {
    using type = sq::Strategy<sq::Accumulate<2>, sq::Checkpointed>;
  };  // sums in .grad
  struct Bf16Accum {
    using type = sq::Strategy<sq::Accumulate<3>, Precision<bf16, float>, sq::Checkpointed>;
  };  // fp32 accumulator
  auto same = [](const Params& a, const Params& b, const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    for (const auto& [n, t] : a) EXPECT_TRUE(torch::equal(t, b.at(n))) << what << ": " << n;
  };

  const Run after = run(Fp32{}, 1, fixed(G::after_backward)), at = run(Fp32{}, 1, fixed(G::at_backward)),
            kept = run(Fp32{}, 1, fixed(G::kept));
  same(at.weights, after.weights, "fp32, at_backward against after_backward");
  same(kept.weights, after.weights, "fp32, kept against after_backward");
  ASSERT_GT(after.one_gradient, 100000);
  EXPECT_EQ(after.gradients_after, 0) << "freed after the update";
  EXPECT_EQ(at.gradients_after, 0) << "freed after the update";
  // Kept between steps: one gradient, each tensor's start aligned to 256 bytes (4 blocks of 2 weights + 2 biases).
  EXPECT_GE(kept.gradients_after, after.one_gradient);
  EXPECT_LE(kept.gradients_after, after.one_gradient + 16 * 256);
  // after_backward: the per-parameter gradients and the buffer they move into, at once. at_backward: the buffer
  // once, beside what a step with the buffer already allocated (kept) adds; one gradient less here.
  EXPECT_GE(after.step_peak, 2 * after.one_gradient);
  EXPECT_LE(at.step_peak, kept.step_peak + after.one_gradient + 16 * 256);
  EXPECT_LT(at.step_peak, after.step_peak);
  std::printf("[ measured ] step peak above the model: after_backward %lld B, at_backward %lld B, kept %lld B; one gradient %lld B\n",
              (long long)after.step_peak, (long long)at.step_peak, (long long)kept.step_peak, (long long)after.one_gradient);

  // Changing between steps, from and to kept (whose attached views must not be collected into themselves).
  const Run switching = run(Fp32{}, 1, [](int s) {
    return std::array{G::kept, G::after_backward, G::at_backward, G::kept}[std::size_t(s)];
  });
  same(switching.weights, after.weights, "fp32, kept -> after_backward -> at_backward -> kept");

  for (int world : {1, 2}) {
    const std::string w = " at world " + std::to_string(world);
    const Params ref = run(Bf16Stage1{}, world, fixed(G::after_backward)).weights;
    same(run(Bf16Stage1{}, world, fixed(G::at_backward)).weights, ref, "bf16 stage 1, at_backward" + w);
    same(run(Bf16Stage1{}, world, fixed(G::kept)).weights, ref, "bf16 stage 1, kept" + w);
  }
  same(run(Fp32Accum{}, 1, fixed(G::at_backward)).weights, run(Fp32Accum{}, 1, fixed(G::after_backward)).weights,
       "fp32, accumulate 2, at_backward");
  same(run(Bf16Accum{}, 1, fixed(G::at_backward)).weights, run(Bf16Accum{}, 1, fixed(G::after_backward)).weights,
       "bf16, accumulate 3 (fp32 accumulator), at_backward");
}

TEST(FrontDoor, GradientBuffersChangeOnlyBetweenSteps) {
  torch::manual_seed(0);
  UserLM model;
  auto trainer = sq::make_trainer<sq::Strategy<sq::Accumulate<2>>>(model, sq::AdamW{.lr = 1e-2f}, sq::comm::LocalComm::single(), {});
  const auto seq = torch::randint(37, {2, 9});
  trainer.step([&] { return lm_loss(model, seq); });
  const std::string e = error_of([&] { trainer.set_gradient_buffers(sq::train::GradientBuffers::kept); });
  EXPECT_NE(e.find("micro-batch 2 of 2"), std::string::npos) << e;
  EXPECT_NE(e.find("between optimizer steps"), std::string::npos) << e;
  trainer.step([&] { return lm_loss(model, seq); });
  EXPECT_NO_THROW(trainer.set_gradient_buffers(sq::train::GradientBuffers::kept));

  EXPECT_GE(trainer.memory().gradients.device, trainer.memory().full_gradient_bytes);
  EXPECT_LE(trainer.memory().gradients.device, trainer.memory().full_gradient_bytes + 6 * 256);
}

// ---- LoRA / QLoRA through the same front door, data parallel ---------------------------------------------------

template <class S>
Params train_adapters(int world) {
  torch::manual_seed(5);
  const auto data = torch::randint(37, {4, 12, 9});
  Params out;
  std::vector<UserLM> models;  // built before the rank threads: the CPU generator is process-wide
  for (int r = 0; r < world; ++r) torch::manual_seed(0), models.emplace_back();
  sq::comm::run_ranks(world, [&](std::shared_ptr<sq::comm::LocalComm> comm) {
    UserLM& model = models[std::size_t(comm->rank())];
    auto trainer = sq::make_trainer<S>(model, sq::AdamW{.lr = 1e-2f, .weight_decay = 0.0f}, comm, {});
    const int per = 12 / world;
    for (int s = 0; s < 4; ++s) {
      const auto rows = data[s].narrow(0, comm->rank() * per, per);
      trainer.step([&] { return lm_loss(model, rows); });
    }
    // the user's members are the same objects, now backed by adapters over a frozen base
    EXPECT_TRUE(model->up->backed());
    auto p = to_params(trainer.full_parameters());
    if (comm->rank() == 0) out = p;
  });
  return out;
}

TEST(FrontDoor, QloraAtWorld2MatchesWorld1) {
  using Targets = std::integral_constant<unsigned, sq::LoraTargets::up | sq::LoraTargets::down>;
  // float compute: the ranks then differ from one rank only by the order of fp32 sums (1e-5), where bf16 compute's
  // batch-size-dependent rounding can flip a near-zero gradient's sign under Adam (a difference of the order of lr).
  using QLoRA = sq::Strategy<sq::Quantized<4, sq::NF4, sq::DoubleQuant>, sq::LoRA<4, 8, Targets::value>>;
  using QLoRA1 = sq::Strategy<sq::Quantized<4, sq::NF4, sq::DoubleQuant>, sq::LoRA<4, 8, Targets::value>, Sharded<sq::Stage1>>;
  const Params w1 = train_adapters<QLoRA>(1);
  ASSERT_EQ(w1.size(), 4u);  // lora_A and lora_B of up and down: only the adapters train
  for (const auto& [n, t] : w1) EXPECT_NE(n.find("lora"), std::string::npos) << n;
  expect_close(train_adapters<QLoRA>(2), w1, 1e-5, 1e-4, "QLoRA world 2, stage 0");
  expect_close(train_adapters<QLoRA1>(3), w1, 1e-5, 1e-4, "QLoRA world 3, stage 1 (sharded adapter state)");
  // the adapters moved (B starts at zero): the comparison is not between two untrained copies
  EXPECT_GT(w1.at("up.lora.lora_B").abs().max().item<float>(), 1e-4);
}

// QLoRA on a model with a plain torch::nn::Linear head (and LayerNorm), without TrainerOptions::replicate: LoRA freezes
// every parameter and packs only the projections, so the head is kept whole and frozen while the adapters train.
TEST(FrontDoor, QloraKeepsAPlainTorchHeadFrozenWithoutReplicate) {
  struct HeadLMImpl : torch::nn::Module {
    sq::nn::Embedding embed{nullptr};
    sq::nn::Linear up{nullptr}, down{nullptr};
    torch::nn::LayerNorm norm{nullptr};
    torch::nn::Linear head{nullptr};
    HeadLMImpl()
        : embed(register_module("embed", sq::nn::Embedding(37, 16))),
          up(register_module("up", sq::nn::Linear(16, 48))),
          down(register_module("down", sq::nn::Linear(48, 16))),
          norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})))),
          head(register_module("head", torch::nn::Linear(16, 37))) {}
    torch::Tensor forward(const torch::Tensor& tokens) { return head(down(torch::gelu(up(norm(embed(tokens)))))); }
  };
  using QLoRA = sq::Strategy<sq::Quantized<4, sq::NF4, sq::DoubleQuant>, sq::LoRA<4, 8, sq::LoraTargets::up | sq::LoraTargets::down>,
                             Precision<bf16, float>>;
  torch::manual_seed(0);
  auto model = std::make_shared<HeadLMImpl>();
  const torch::Tensor head_before = model->head->weight.detach().clone();
  auto trainer = sq::make_trainer<QLoRA>(model, sq::AdamW{.lr = 1e-2f}, sq::comm::LocalComm::single());
  const auto seq = torch::randint(37, {4, 9});
  for (int i = 0; i < 3; ++i)
    trainer.step([&] {
      const auto logits = model->forward(seq.narrow(1, 0, 8));
      return torch::nn::functional::cross_entropy(logits.flatten(0, 1).to(torch::kFloat32), seq.narrow(1, 1, 8).flatten());
    });
  EXPECT_TRUE(model->up->backed());  // the projections got their NF4 base and adapters
  EXPECT_FALSE(model->head->weight.requires_grad());
  EXPECT_EQ(model->head->weight.sizes(), head_before.sizes());  // whole, in the compute type, never updated
  EXPECT_TRUE(torch::equal(model->head->weight, head_before.to(torch::kBFloat16)));
  const Params trained = to_params(trainer.full_parameters());
  ASSERT_EQ(trained.size(), 4u);  // lora_A and lora_B of up and down
  for (const auto& [n, t] : trained) EXPECT_NE(n.find("lora"), std::string::npos) << n;
  EXPECT_GT(trained.at("up.lora.lora_B").abs().max().item<float>(), 1e-4);
}

TEST(FrontDoor, LoraOnADenseBaseTrainsOnlyTheAdapters) {
  using LoRA = sq::Strategy<sq::LoRA<4, 8, sq::LoraTargets::up | sq::LoraTargets::down>, sq::Accumulate<2>>;
  const Params w1 = train_adapters<LoRA>(1);
  ASSERT_EQ(w1.size(), 4u);
  expect_close(train_adapters<LoRA>(2), w1, 1e-5, 1e-4, "LoRA world 2");
}

}  // namespace
}  // namespace frontdoor
