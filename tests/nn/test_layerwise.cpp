// nn::build_quantized_llama (nn/layerwise.hpp): a quantized LLaMA built block by block is the whole float model
// quantized, bit for bit on the CPU (NF4 + DoubleQuant, RTN at 4 and 3 bits, from a seed or a Hugging Face
// directory); make_trainer adopts it as it is; the host never holds more than the packed model and one float block;
// what does not fit is refused before anything is allocated; progress comes once per block.
#include <gtest/gtest.h>

#include <squeeze/comm/local.hpp>
#include <squeeze/nn/hf_llama.hpp>
#include <squeeze/nn/layerwise.hpp>
#include <squeeze/optim/adamw.hpp>
#include <squeeze/train/trainer.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include "llama/memory_meter.hpp"

namespace {

using namespace squeeze;
namespace fs = std::filesystem;
using nn::LayerwiseOptions;
using nn::Llama;
using nn::LlamaConfig;

const fs::path kFixtures = SQUEEZE_HF_FIXTURES;

using QLoraAll = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<16, 32, all_linears>, Precision<bf16, float>, Checkpointed>;
using QLora = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>>;
using Rtn4 = Strategy<Quantized<4, RTN, Group<128>>, LoRA<8, 16>, Precision<bf16, float>>;
using Rtn3 = Strategy<Quantized<3, RTN, PerChannel>, LoRA<4, 8, all_linears>>;
using Gptq4 = Strategy<Quantized<4, GPTQ, Group<128>>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed>;

LlamaConfig small_config(int64_t layers = 4) {
  LlamaConfig c;  // GQA (4 query heads over 2 key/value heads); every linear's input a multiple of RTN's group
  c.name = "layerwise-test";
  c.vocab = 256, c.hidden = 128, c.layers = layers, c.heads = 4, c.kv_heads = 2, c.ffn = 256;
  return c;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// Every parameter and buffer of a and b: the same names, dtypes, devices, trainability and bits.
void expect_same_state(torch::nn::Module& a, torch::nn::Module& b) {
  const auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.keys(), pb.keys());
  for (const auto& p : pa) {
    const torch::Tensor& q = pb[p.key()];
    EXPECT_EQ(p.value().scalar_type(), q.scalar_type()) << p.key();
    EXPECT_EQ(p.value().requires_grad(), q.requires_grad()) << p.key();
    EXPECT_TRUE(p.value().sizes() == q.sizes() && torch::equal(p.value(), q)) << p.key();
  }
  const auto ba = a.named_buffers(), bb = b.named_buffers();
  ASSERT_EQ(ba.keys(), bb.keys());
  int64_t buffers = 0;
  for (const auto& t : ba) {
    const torch::Tensor& q = bb[t.key()];
    EXPECT_EQ(t.value().scalar_type(), q.scalar_type()) << t.key();
    EXPECT_TRUE(t.value().sizes() == q.sizes() && torch::equal(t.value(), q)) << t.key();
    buffers += t.value().numel();
  }
  EXPECT_GT(buffers, 0) << "nothing was packed";
}

// The reference: the whole float model, then apply_lora<S> as make_trainer runs it (dense bases in S's compute type).
template <class S>
Llama whole_then_quantized(const LlamaConfig& c, uint64_t seed) {
  Llama whole(c, nn::ParamInit{torch::TensorOptions().dtype(torch::kFloat32), true, seed});
  nn::apply_lora<S>(*whole, {torch::Device(torch::kCPU), torch_dtype<typename S::compute_type>()});
  return whole;
}

// Enough of every kind of memory that only the check under test can refuse.
LayerwiseOptions roomy() {
  LayerwiseOptions o;
  o.available_host_bytes = int64_t(1) << 50;
  o.available_device_bytes = int64_t(1) << 50;
  return o;
}

// ---- the same model ------------------------------------------------------------------------------------------------

TEST(Layerwise, Nf4DoubleQuantEqualsTheWholeModelQuantized) {
  const LlamaConfig c = small_config();
  LayerwiseOptions o = roomy();
  o.seed = 11;
  Llama built = nn::build_quantized_llama<QLoraAll>(c, o);
  Llama whole = whole_then_quantized<QLoraAll>(c, 11);
  expect_same_state(*built, *whole);
  EXPECT_EQ(nn::lora_parameters(*built).size(), size_t(2 * 7 * c.layers));
  // and it computes the same
  const torch::Tensor ids = torch::randint(0, c.vocab, {2, 16}, torch::kLong);
  torch::NoGradGuard ng;
  EXPECT_TRUE(torch::equal(built->forward(ids), whole->forward(ids)));
}

TEST(Layerwise, RtnAtFourAndThreeBitsEqualsTheWholeModelQuantized) {
  const LlamaConfig c = small_config();
  {
    SCOPED_TRACE("RTN 4-bit, group 128, bf16");
    LayerwiseOptions o = roomy();
    o.seed = 12;
    Llama built = nn::build_quantized_llama<Rtn4>(c, o);
    Llama whole = whole_then_quantized<Rtn4>(c, 12);
    expect_same_state(*built, *whole);
  }
  {
    SCOPED_TRACE("RTN 3-bit, per channel, float");
    LayerwiseOptions o = roomy();
    o.seed = 13;
    Llama built = nn::build_quantized_llama<Rtn3>(c, o);
    Llama whole = whole_then_quantized<Rtn3>(c, 13);
    expect_same_state(*built, *whole);
  }
  {
    SCOPED_TRACE("GPTQ layout, filled by round-to-nearest as apply_lora fills it");
    LayerwiseOptions o = roomy();
    o.seed = 14;
    Llama built = nn::build_quantized_llama<Gptq4>(c, o);
    Llama whole = whole_then_quantized<Gptq4>(c, 14);
    expect_same_state(*built, *whole);
  }
}

// Without a seed both draw theirs from torch's global generator: torch::manual_seed decides the model, as before.
TEST(Layerwise, TheGlobalSeedDecidesBothAlike) {
  const LlamaConfig c = small_config(2);
  torch::manual_seed(5);
  Llama built = nn::build_quantized_llama<QLora>(c, roomy());
  torch::manual_seed(5);
  Llama whole(c);
  nn::apply_lora<QLora>(*whole, {torch::Device(torch::kCPU), torch::kBFloat16});
  expect_same_state(*built, *whole);
  // A block's values come from its own stream: the same seed gives the same block 1 in a deeper model.
  Llama deeper(small_config(3), nn::ParamInit{torch::TensorOptions(), true, 9});
  Llama shallow(small_config(2), nn::ParamInit{torch::TensorOptions(), true, 9});
  EXPECT_TRUE(torch::equal(deeper->blocks[1]->mlp->up->weight, shallow->blocks[1]->mlp->up->weight));
  EXPECT_FALSE(torch::equal(deeper->blocks[0]->mlp->up->weight, deeper->blocks[1]->mlp->up->weight));
  EXPECT_TRUE(torch::equal(deeper->embed->weight, shallow->embed->weight));
}

TEST(Layerwise, FromAHuggingFaceDirectoryEqualsTheLoadedModelQuantized) {
  for (const char* model : {"llama2-tiny", "llama3-tiny"}) {  // four shards; bf16 with a tied head and its own head_dim
    SCOPED_TRACE(model);
    const fs::path dir = kFixtures / model;
    Llama built = nn::build_quantized_llama<QLoraAll>(dir, roomy());
    Llama whole = nn::load_hf_llama(dir, {.dtype = torch::kFloat32});
    nn::apply_lora<QLoraAll>(*whole, {torch::Device(torch::kCPU), torch::kBFloat16});
    expect_same_state(*built, *whole);
    EXPECT_EQ(built->config.tie_embeddings, whole->config.tie_embeddings);
  }
}

// make_trainer takes the built model as it is (its apply_lora keeps the adapters): the same trainer, the same step.
TEST(Layerwise, MakeTrainerAdoptsTheBuiltModel) {
  const LlamaConfig c = small_config(3);
  LayerwiseOptions o = roomy();
  o.seed = 21;
  Llama built = nn::build_quantized_llama<QLoraAll>(c, o);
  Llama whole(c, nn::ParamInit{torch::TensorOptions(), true, 21});
  const squeeze::AdamW adamw{.lr = 1e-2f, .weight_decay = 0.0f};
  auto a = make_trainer<QLoraAll>(built, adamw, comm::LocalComm::single(), {.device = torch::Device(torch::kCPU)});
  auto b = make_trainer<QLoraAll>(whole, adamw, comm::LocalComm::single(), {.device = torch::Device(torch::kCPU)});
  EXPECT_EQ(a.memory().parameters.device, b.memory().parameters.device);
  expect_same_state(*built, *whole);
  torch::manual_seed(3);
  const torch::Tensor ids = torch::randint(0, c.vocab, {2, 16}, torch::kLong), targets = torch::randint(0, c.vocab, {2, 16}, torch::kLong);
  for (int step = 0; step < 2; ++step) {
    const auto ra = a.step([&] { return built->loss(ids, targets); });
    const auto rb = b.step([&] { return whole->loss(ids, targets); });
    EXPECT_EQ(ra.loss, rb.loss) << "step " << step;
  }
  expect_same_state(*built, *whole);  // the adapters trained alike
  EXPECT_GT(built->blocks[0]->attn->q->backing()->named_parameters()["lora_B"].abs().max().item<float>(), 0.0f);
}

// ---- GPTQ, calibrated block by block ------------------------------------------------------------------------------

// The packed GPTQ-layout base behind a block linear: a target's adapter base, or the frozen layer itself.
nn::QuantizedLinear packed_base(nn::LinearImpl& l) {
  const auto back = l.backing();
  if (auto a = std::dynamic_pointer_cast<nn::LoRALinearImpl>(back)) return a->gptq_base();
  return nn::QuantizedLinear(std::dynamic_pointer_cast<nn::QuantizedLinearImpl>(back));
}

void expect_same_buffers(torch::nn::Module& a, torch::nn::Module& b, bool same, const std::string& what) {
  const auto ba = a.named_buffers(), bb = b.named_buffers();
  ASSERT_EQ(ba.keys(), bb.keys()) << what;
  bool all = true;
  for (const auto& t : ba) all = all && t.value().sizes() == bb[t.key()].sizes() && torch::equal(t.value(), bb[t.key()]);
  EXPECT_EQ(all, same) << what;
}

// Each block's GPTQ runs on the Hessians of its inputs as the quantized blocks before it compute them: block 0's and
// block 1's q and k are exactly gptq_quantize on the Hessian of their attention norm's output, and block 1's differ
// from what the float block 0 would have given. Every layer differs from round-to-nearest, and the model's
// logits on the calibration tokens are closer to the float model's than RTN's are.
TEST(Layerwise, GptqCalibratesEachBlockOnTheQuantizedBlocksBefore) {
  const LlamaConfig c = small_config(3);
  torch::manual_seed(2);
  const torch::Tensor ids = torch::randint(0, c.vocab, {4, 32}, torch::kLong);
  LayerwiseOptions o = roomy();
  o.seed = 51;
  o.calibration = ids;
  o.gptq.sym = false;
  Llama built = nn::build_quantized_llama<Gptq4>(c, o);
  o.calibration = torch::Tensor();
  Llama rtn = nn::build_quantized_llama<Gptq4>(c, o);
  Llama whole(c, nn::ParamInit{torch::TensorOptions(), true, 51});

  torch::NoGradGuard ng;
  nn::GptqOptions g = o.gptq;
  g.bits = 4, g.group_size = 128;
  const auto expected = [&](const torch::Tensor& input, const torch::Tensor& weight) {  // input [N, T, in], weight float [out, in]
    nn::Hessian h(input.size(-1), torch::kCPU);
    h.add(input);
    return nn::QuantizedLinear(nn::gptq_quantize(weight.to(torch::kBFloat16).to(torch::kFloat32), h.matrix(), g).pack(),
                               /*fused_tiles=*/false);
  };
  const auto [cos, sin] = nn::rope_tables(ids.size(1), c, torch::kCPU);
  const torch::Tensor x0 = whole->embed(ids);                              // block 0's input
  const torch::Tensor x1 = built->blocks[0]->forward(x0, cos, sin);        // block 1's, from the quantized block 0
  const torch::Tensor x1_float = whole->blocks[0]->forward(x0, cos, sin);  // ... and from the float one
  for (int b : {0, 1}) {
    const torch::Tensor in = whole->blocks[b]->attn_norm(b == 0 ? x0 : x1);
    for (const char* name : {"q", "k"}) {
      auto& w = whole->blocks[b]->attn->named_children()[name]->as<nn::Linear>()->weight;
      auto& l = *built->blocks[b]->attn->named_children()[name]->as<nn::Linear>();
      nn::QuantizedLinear want = expected(in, w);
      expect_same_buffers(*packed_base(l), *want, true, "block " + std::to_string(b) + " " + name);
    }
  }
  nn::QuantizedLinear from_float = expected(whole->blocks[1]->attn_norm(x1_float), whole->blocks[1]->attn->q->weight);
  expect_same_buffers(*packed_base(*built->blocks[1]->attn->q), *from_float, false, "block 1 q from the float block 0");
  for (int b = 0; b < c.layers; ++b)
    for (const auto& item : built->blocks[b]->named_modules())
      if (auto* l = dynamic_cast<nn::LinearImpl*>(item.value().get()); l && l->backed()) {
        auto* r = dynamic_cast<nn::LinearImpl*>(rtn->blocks[b]->named_modules()[item.key()].get());
        expect_same_buffers(*packed_base(*l), *packed_base(*r), false, "block " + std::to_string(b) + " " + item.key() + " against RTN");
      }
  const torch::Tensor ref = whole->forward(ids);
  const double gptq_error = (built->forward(ids) - ref).square().mean().item<double>();
  const double rtn_error = (rtn->forward(ids) - ref).square().mean().item<double>();
  std::cout << "logits' mean squared error on the calibration tokens: GPTQ " << gptq_error << ", RTN " << rtn_error << "\n";
  EXPECT_LT(gptq_error, rtn_error);
}

TEST(Layerwise, CalibrationIsRefusedWhereItCannotBeUsed) {
  const LlamaConfig c = small_config(2);
  LayerwiseOptions o = roomy();
  o.calibration = torch::randint(0, c.vocab, {2, 8}, torch::kLong);
  EXPECT_NE(error_of([&] { nn::build_quantized_llama<QLora>(c, o); }).find("calibrates GPTQ, but the strategy quantizes by NF4"),
            std::string::npos);
  o.calibration = torch::full({2, 8}, c.vocab, torch::kLong);
  EXPECT_NE(error_of([&] { nn::build_quantized_llama<Gptq4>(c, o); }).find("must lie in [0, 256)"), std::string::npos);
  o.calibration = torch::zeros({16}, torch::kLong);
  EXPECT_NE(error_of([&] { nn::build_quantized_llama<Gptq4>(c, o); }).find("token ids [sequences, tokens] in int64"), std::string::npos);
}

// ---- memory --------------------------------------------------------------------------------------------------------

// Host memory while building, as the CPU allocator sees it: never more than the packed model, the dense rest and one
// float block (layerwise_memory's host figure), far below the float model, which the whole path holds.
TEST(Layerwise, HostMemoryStaysUnderThePackedModelAndOneFloatBlock) {
  LlamaConfig c = small_config(8);
  c.hidden = 256, c.ffn = 512, c.heads = 8, c.kv_heads = 4;
  const int64_t float_model = c.shape().params() * 4;
  const nn::LayerwiseMemory need = nn::layerwise_memory<QLoraAll>(c);
  ASSERT_LT(need.host_bytes * 2, float_model) << "the geometry must make the difference visible";
  int64_t built_peak = 0, whole_peak = 0, most_at_a_block = 0;
  {
    const squeeze::test::MemoryMeter meter;
    LayerwiseOptions o = roomy();
    o.seed = 31;
    o.progress = [&](const nn::LayerwiseProgress&) { most_at_a_block = std::max(most_at_a_block, meter.live_bytes()); };
    Llama built = nn::build_quantized_llama<QLoraAll>(c, o);
    built_peak = meter.peak_bytes();
    EXPECT_LE(meter.live_bytes(), need.packed_bytes + need.dense_rest_bytes) << "after the build: the packed model and the dense rest";
  }
  {
    const squeeze::test::MemoryMeter meter;
    Llama whole = whole_then_quantized<QLoraAll>(c, 31);
    whole_peak = meter.peak_bytes();
  }
  std::cout << "host peak: block by block " << built_peak << " B (planned " << need.host_bytes << " B), whole then quantized " << whole_peak
            << " B, float model " << float_model << " B\n";
  EXPECT_LE(built_peak, need.host_bytes);
  EXPECT_LE(most_at_a_block, need.packed_bytes + need.dense_rest_bytes + need.float_block_bytes);
  EXPECT_GE(whole_peak, float_model) << "the whole path holds the float model (else this test shows nothing)";
  EXPECT_LT(built_peak * 2, whole_peak);
}

TEST(Layerwise, RefusesWhatDoesNotFitBeforeAllocating) {
  const LlamaConfig c = small_config(4);
  const nn::LayerwiseMemory need = nn::layerwise_memory<QLoraAll>(c);
  {
    const squeeze::test::MemoryMeter meter;
    LayerwiseOptions o;
    o.available_host_bytes = need.host_bytes - 1;
    const std::string e = error_of([&] { nn::build_quantized_llama<QLoraAll>(c, o); });
    for (const std::string& want :
         {std::string("needs ") + nn::detail::gigabytes(need.host_bytes) + " of host memory", std::string("one float block"),
          std::string("LayerwiseOptions::available_host_bytes"), std::string("fewer bits"), std::string("onto a GPU")})
      EXPECT_NE(e.find(want), std::string::npos) << "missing '" << want << "' in: " << e;
    EXPECT_LT(meter.peak_bytes(), 4096) << "refused before the model was allocated";
  }
  {
    // A GPU too small for the training step the planner counts (nothing touches CUDA: the check comes first).
    LayerwiseOptions o = roomy();
    o.device = torch::Device(torch::kCUDA, 0);
    o.train = plan::TrainShape{.micro_batch = 8, .seq = 512};
    const nn::LayerwiseMemory on_gpu = nn::layerwise_memory<QLoraAll>(c, o);
    EXPECT_GT(on_gpu.planned_step_bytes, on_gpu.packed_bytes + on_gpu.dense_rest_bytes) << "activations count";
    EXPECT_EQ(on_gpu.device_bytes, on_gpu.planned_step_bytes);
    o.available_device_bytes = on_gpu.device_bytes - 1;
    const std::string e = error_of([&] { nn::build_quantized_llama<QLoraAll>(c, o); });
    for (const std::string& want : {std::string("needs ") + nn::detail::gigabytes(on_gpu.device_bytes) + " on cuda:0",
                                    std::string("plan_memory's peak of a training step of micro-batch 8 x seq 512"),
                                    std::string("smaller micro-batch"), std::string("fewer bits")})
      EXPECT_NE(e.find(want), std::string::npos) << "missing '" << want << "' in: " << e;
  }
  {
    // At 3 bits there are no fewer bits to offer: the advice starts with the next remedy.
    using Rtn3 = Strategy<Quantized<3, RTN, Group<128>>, LoRA<16, 32, all_linears>, Precision<bf16, float>, Checkpointed>;
    LayerwiseOptions o;
    o.available_host_bytes = nn::layerwise_memory<Rtn3>(c).host_bytes - 1;
    const std::string e = error_of([&] { nn::build_quantized_llama<Rtn3>(c, o); });
    EXPECT_EQ(e.find("fewer bits"), std::string::npos) << e;
    EXPECT_NE(e.find("is available (LayerwiseOptions::available_host_bytes): build onto a GPU (LayerwiseOptions::device), "
                     "or choose a smaller model"),
              std::string::npos)
        << e;
  }
}

// The planner's figures for the big presets: LLaMA-2-70B in NF4 builds onto one 80 GB GPU with a few GB of host
// memory; a 175B model needs fewer bits than 4 for it.
TEST(Layerwise, BigPresetsAgainstOneGpu) {
  LayerwiseOptions o = roomy();
  o.device = torch::Device(torch::kCUDA, 0);
  const nn::LayerwiseMemory l70 = nn::layerwise_memory<QLoraAll>(LlamaConfig::preset("llama-70b"), o);
  EXPECT_LT(l70.device_bytes, int64_t(45e9));
  EXPECT_GT(l70.device_bytes, int64_t(30e9));
  EXPECT_LT(l70.host_bytes, int64_t(4e9)) << "one float block, not the 276 GB float model";
  const LlamaConfig big = LlamaConfig::preset("llama-175b");
  EXPECT_NEAR(double(big.shape().params()), 175e9, 0.05 * 175e9);
  o.available_device_bytes = int64_t(80e9);
  EXPECT_NE(error_of([&] { nn::build_quantized_llama<QLoraAll>(big, o); }).find("fewer bits"), std::string::npos);
  using Rtn3Bf16 = Strategy<Quantized<3, RTN, Group<128>>, LoRA<16, 32, all_linears>, Precision<bf16, float>, Checkpointed>;
  // Drawn on the GPU, one float block (7.3 GB) more is there than drawn on the host.
  const int64_t drawn_on_gpu = nn::layerwise_memory<Rtn3Bf16>(big, o).device_bytes;
  o.draw_on_device = false;
  const int64_t drawn_on_host = nn::layerwise_memory<Rtn3Bf16>(big, o).device_bytes;
  EXPECT_LT(drawn_on_host, int64_t(80e9));
  EXPECT_EQ(drawn_on_gpu - drawn_on_host, big.shape().block_params() * 4);
  if (drawn_on_gpu > *o.available_device_bytes) {  // refused before anything is allocated, naming the way out
    o.draw_on_device = true;
    const std::string e = error_of([&] { nn::build_quantized_llama<Rtn3Bf16>(big, o); });
    EXPECT_NE(e.find("draw on the host (LayerwiseOptions::draw_on_device = false)"), std::string::npos) << e;
  }
}

// ---- progress and bad configs ------------------------------------------------------------------------------------

TEST(Layerwise, ProgressOncePerBlockWithAnEstimate) {
  const LlamaConfig c = small_config(5);
  std::vector<nn::LayerwiseProgress> seen;
  LayerwiseOptions o = roomy();
  o.seed = 41;
  o.progress = [&](const nn::LayerwiseProgress& p) { seen.push_back(p); };
  Llama built = nn::build_quantized_llama<Rtn4>(c, o);
  ASSERT_EQ(seen.size(), size_t(c.layers));
  for (size_t i = 0; i < seen.size(); ++i) {
    const nn::LayerwiseProgress& p = seen[i];
    EXPECT_EQ(p.blocks, int64_t(i + 1));
    EXPECT_EQ(p.blocks_total, c.layers);
    EXPECT_GT(p.seconds, 0.0);
    if (i > 0) {
      EXPECT_GE(p.seconds, seen[i - 1].seconds);
      EXPECT_GT(p.packed_bytes, seen[i - 1].packed_bytes);
    }
    if (p.blocks < p.blocks_total) {
      EXPECT_GT(p.seconds_left, 0.0) << "block " << p.blocks;
      // the mean time per block so far, times the blocks left: no more than the time so far scaled up
      EXPECT_LE(p.seconds_left, p.seconds / double(p.blocks) * double(p.blocks_total - p.blocks) * 1.0001) << "block " << p.blocks;
    }
  }
  EXPECT_EQ(seen.back().seconds_left, 0.0);
  EXPECT_EQ(seen.back().packed_bytes, nn::frozen_base_bytes(*built));
}

// Offload<Host, Streamed>: the packed blocks count on the host, not the device (one block in flight there), and a host
// too small for them is refused before anything is allocated, naming the streamed blocks and the way back.
TEST(Layerwise, StreamedBlocksAreCountedOnTheHostAndRefusedBeforeAllocating) {
  using Streamed =
      Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<16, 32, all_linears>, Precision<bf16, float>, Checkpointed, Offload<Host, Streamed>>;
  const LlamaConfig c = small_config(4);
  LayerwiseOptions gpu = roomy();
  gpu.device = torch::Device(torch::kCUDA, 0);
  const nn::LayerwiseMemory resident = nn::layerwise_memory<QLoraAll>(c, gpu), streamed = nn::layerwise_memory<Streamed>(c, gpu);
  EXPECT_EQ(streamed.packed_bytes, resident.packed_bytes);
  EXPECT_GT(streamed.host_bytes, resident.host_bytes);  // + the packed blocks, moved there one by one
  EXPECT_LT(streamed.device_bytes, resident.device_bytes);
  const squeeze::test::MemoryMeter meter;
  gpu.available_host_bytes = streamed.host_bytes - 1;  // nothing touches CUDA: the host check comes first
  const std::string e = error_of([&] { nn::build_quantized_llama<Streamed>(c, gpu); });
  for (const std::string& want : {std::string("needs ") + nn::detail::gigabytes(streamed.host_bytes) + " of host memory",
                                  std::string("streamed from pinned host memory"), std::string("remove Offload<Host, Streamed>")})
    EXPECT_NE(e.find(want), std::string::npos) << "missing '" << want << "' in: " << e;
  EXPECT_LT(meter.peak_bytes(), 4096) << "refused before the model was allocated";
}

TEST(Layerwise, BadConfigsAreRefusedNamingTheValue) {
  LlamaConfig c = small_config();
  c.layers = 0;
  std::string e = error_of([&] { nn::build_quantized_llama<QLora>(c, roomy()); });
  EXPECT_NE(e.find("layers is 0"), std::string::npos) << e;
  c = small_config();
  c.hidden = 100, c.heads = 3;
  e = error_of([&] { nn::build_quantized_llama<QLora>(c, roomy()); });
  EXPECT_NE(e.find("hidden (100) must be a multiple of heads (3)"), std::string::npos) << e;
  c = small_config();
  c.kv_heads = 3;
  e = error_of([&] { nn::build_quantized_llama<QLora>(c, roomy()); });
  EXPECT_NE(e.find("heads (4) must be a multiple of kv_heads (3)"), std::string::npos) << e;
  e = error_of([&] { nn::build_quantized_llama<QLora>(kFixtures / "no-such-model", roomy()); });
  EXPECT_NE(e.find("no-such-model"), std::string::npos) << e;
}

}  // namespace
