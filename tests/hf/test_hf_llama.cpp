// Hugging Face LlamaForCausalLM directories into nn::Llama and out again, and PEFT adapters (libtorch, CPU).
//
// Logits are compared with transformers 5.17's on the fixtures' input_ids (tests/fixtures/hf, written by
// tools/make_hf_fixtures.py), in the norm rel = max |ours - ref| / max |ref| over the [2, 11, 288] logits:
//   fp32 model vs logits_fp32 (the saved directory loaded by from_pretrained in fp32): rel <= 1e-5. Measured:
//     llama2-tiny 2.7e-7, llama3-tiny 1.8e-7.
//   bf16 model vs logits_bf16: rel <= kBf16Tolerance = 1.5e-2, and <= 2x transformers' own bf16-vs-fp32 distance.
//     Measured: llama2-tiny 7.3e-3 (transformers' own 7.6e-3), llama3-tiny 6.0e-3 (its own 4.6e-3). Both sides
//     round every matmul output and activation to bf16 (unit roundoff 2^-9) but in different orders
//     (transformers' eager attention vs scaled_dot_product_attention, other GEMM blockings), so the bound is set by
//     bf16's rounding, whose scale is transformers' own bf16 error, not by the loader.
// "Bit-exact" means torch::equal (same dtype, same bits).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <squeeze/comm/local.hpp>
#include <squeeze/nn/hf_llama.hpp>
#include <squeeze/optim/adamw.hpp>
#include <squeeze/train/trainer.hpp>
#include <squeeze/policy/strategy.hpp>

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "../io/io_test_util.hpp"

namespace {

using namespace squeeze;
namespace fs = std::filesystem;
using io_test::TempDir;

const bool one_thread = (torch::set_num_threads(1), true);  // tiny models; spinning OpenMP threads cost more than they give
const fs::path kFixtures = SQUEEZE_HF_FIXTURES;

// bf16 logits vs transformers' bf16 logits (see the top of the file): about 2x the largest distance measured.
constexpr double kBf16Tolerance = 1.5e-2;

// Errors of the nn layer are c10::Error (TORCH_CHECK).
void expect_torch_error(const std::function<void()>& f, std::initializer_list<std::string> needles) {
  io_test::expect_error<c10::Error>(f, needles);
}

double rel_err(const torch::Tensor& got, const torch::Tensor& ref) {
  const torch::Tensor r = ref.to(torch::kFloat64);
  return (got.to(torch::kFloat64) - r).abs().max().item<double>() / r.abs().max().item<double>();
}

struct Expected {
  torch::Tensor ids;         // [2, 11] int64
  torch::Tensor fp32, bf16;  // [2, 11, 288] float
};
Expected expected(const std::string& model) {
  const auto f = io::SafetensorsFile::open(kFixtures / model / "expected.safetensors");
  const auto tensor = [&](const std::string& name, io::DType d) {
    const auto& info = f.info(name);
    EXPECT_EQ(info.dtype, d) << name;
    torch::Tensor t = torch::empty(info.shape, d == io::DType::I64 ? torch::kLong : torch::kFloat32);
    const auto b = f.bytes(name);
    std::memcpy(t.data_ptr(), b.data(), b.size());
    return t;
  };
  return {tensor("input_ids", io::DType::I64), tensor("logits_fp32", io::DType::F32), tensor("logits_bf16", io::DType::F32)};
}

torch::Tensor logits_of(nn::Llama& m, const torch::Tensor& ids) {
  torch::NoGradGuard ng;
  m->eval();
  return m->forward(ids).to(torch::kFloat32);  // [B, T, vocab]
}

// Geometry nothing divides nicely: q has heads * head_dim = 60 outputs for hidden 40, one KV head, llama3 RoPE.
nn::LlamaConfig odd_config(bool tied) {
  nn::LlamaConfig c;
  c.name = "odd";
  c.vocab = 291, c.hidden = 40, c.layers = 3, c.heads = 5, c.kv_heads = 1, c.ffn = 97;
  c.explicit_head_dim = 12;
  c.rope_theta = 50000.0;
  c.rope_scaling = {plan::RopeType::Llama3, 4.0, 1.0, 4.0, 32};
  c.norm_eps = 1e-6;
  c.tie_embeddings = tied;
  return c;
}
nn::Llama random_model(const nn::LlamaConfig& c, uint64_t seed) {
  torch::manual_seed(seed);
  nn::Llama m(c);
  torch::NoGradGuard ng;
  for (auto& p : m->named_parameters())
    if (p.key().ends_with("norm.weight")) p.value().uniform_(0.5, 1.5);  // not all ones, so a skipped norm shows
  return m;
}
torch::Tensor random_ids(int64_t vocab, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randint(vocab, {2, 13}, torch::kLong);
}

void expect_same_parameters(nn::Llama& a, nn::Llama& b) {
  const auto pa = a->named_parameters(), pb = b->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& p : pa) {
    const torch::Tensor* q = pb.find(p.key());
    ASSERT_NE(q, nullptr) << p.key();
    EXPECT_TRUE(torch::equal(p.value(), *q)) << p.key();
  }
}

nlohmann::json read_json(const fs::path& file) {
  std::ifstream in(file);
  return nlohmann::json::parse(in);
}
void write_json(const fs::path& file, const nlohmann::json& j) { std::ofstream(file) << j.dump(2); }

// A copy of a fixture's config.json and its tensors as one model.safetensors, edited by `edit`
// (name -> (dtype, shape, bytes)).
using TensorMap = std::map<std::string, std::tuple<io::DType, std::vector<int64_t>, std::vector<std::byte>>>;
void write_edited_checkpoint(const std::string& model, const fs::path& dir, const std::function<void(TensorMap&)>& edit) {
  fs::copy_file(kFixtures / model / "config.json", dir / "config.json", fs::copy_options::overwrite_existing);
  const auto ck = io::SafetensorsCheckpoint::open(kFixtures / model);
  TensorMap t;
  for (const auto& [name, info] : ck.tensors()) t[name] = {info.dtype, info.shape, ck.read_bytes(name)};
  edit(t);
  std::map<std::string, io::TensorRef> refs;
  for (const auto& [name, v] : t) refs[name] = {std::get<0>(v), std::get<1>(v), std::get<2>(v)};
  io::save_safetensors(dir / "model.safetensors", refs, {{"format", "pt"}});
}

// ---- configs -------------------------------------------------------------------------------------------------------
TEST(HfConfigMap, DefaultGeometryStaysImplicitAndTheMapRoundTrips) {
  const io::LlamaConfig l2 = io::load_llama_config(kFixtures / "llama2-tiny");
  const nn::LlamaConfig c2 = nn::from_hf_config(l2);
  EXPECT_EQ(c2.explicit_head_dim, 0);  // head_dim 16 == 64 / 4: the same config a squeeze preset would be
  EXPECT_FALSE(c2.tie_embeddings);
  EXPECT_EQ(c2.rope_scaling.type, plan::RopeType::Default);
  EXPECT_EQ(c2.norm_eps, 1e-5);

  const io::LlamaConfig l3 = io::load_llama_config(kFixtures / "llama3-tiny");
  const nn::LlamaConfig c3 = nn::from_hf_config(l3);
  EXPECT_EQ(c3.explicit_head_dim, 24);
  EXPECT_EQ(c3.head_dim(), 24);
  EXPECT_TRUE(c3.tie_embeddings);
  EXPECT_EQ(c3.rope_scaling.type, plan::RopeType::Llama3);
  EXPECT_EQ(c3.rope_scaling.original_max_position_embeddings, 16);
  EXPECT_EQ(c3.shape().params(), 160576);  // the index's total_parameters: the planner counts head_dim and the tie

  for (const auto& l : {l2, l3}) {
    const io::LlamaConfig back = nn::to_hf_config(nn::from_hf_config(l), *l.dtype, l);
    EXPECT_EQ(back, l);  // geometry, RoPE, eps, tie, dtype, max_position_embeddings, token ids
  }
  nn::LlamaConfig other = c3;
  other.rope_scaling.factor = 2.0;
  EXPECT_EQ(nn::network_difference(c3, other), "rope_scaling: the llama3 parameters differ");
  expect_torch_error([&] { nn::to_hf_config(other, io::DType::F32, l2); }, {"another network", "layers: 3 vs 2"});
}

TEST(HfConfigMap, RopeTablesFollowTheConfig) {
  const int64_t T = 19;
  nn::LlamaConfig plain;
  const auto [c0, s0] = nn::rope_tables(T, plain, torch::kCPU);
  const auto [c1, s1] = nn::rope_tables(T, plain.head_dim(), plain.rope_theta, torch::kCPU);
  EXPECT_TRUE(torch::equal(c0, c1) && torch::equal(s0, s1));  // unscaled RoPE: the same bits as before

  const nn::LlamaConfig c = odd_config(false);
  const auto [cos, sin] = nn::rope_tables(T, c, torch::kCPU);  // [T, 12]
  ASSERT_EQ(cos.sizes(), torch::IntArrayRef({T, 12}));
  const auto f = plan::rope_inv_freq(c.head_dim(), c.rope_theta, c.rope_scaling);
  for (int64_t t : {1, 7, 18})
    for (int64_t i = 0; i < 6; ++i) {
      const double angle = double(t) * double(float(f[size_t(i)]));
      EXPECT_NEAR(cos[t][i].item<double>(), std::cos(angle), 1e-6) << t << " " << i;
      EXPECT_NEAR(sin[t][i + 6].item<double>(), std::sin(angle), 1e-6) << t << " " << i;
    }
  EXPECT_LT(f.back(), std::pow(c.rope_theta, -10.0 / 12.0) / 3.9);  // the low frequencies really are scaled (factor 4)
}

// ---- loading the fixtures --------------------------------------------------------------------------------------
TEST(HfLoad, FixtureLogitsMatchTransformersInFp32) {
  const Expected e2 = expected("llama2-tiny");
  nn::Llama l2 = nn::load_hf_llama(kFixtures / "llama2-tiny", {.dtype = torch::kFloat32});
  const double rel2 = rel_err(logits_of(l2, e2.ids), e2.fp32);
  std::printf("[ measured ] llama2-tiny fp32: max|diff| / max|ref| = %.3g\n", rel2);
  EXPECT_LE(rel2, 1e-5);

  // llama3-tiny: bf16 weights widened to fp32, scaled RoPE, GQA, head_dim 24, tied embeddings.
  const Expected e3 = expected("llama3-tiny");
  nn::Llama l3 = nn::load_hf_llama(kFixtures / "llama3-tiny", {.dtype = torch::kFloat32});
  const double rel3 = rel_err(logits_of(l3, e3.ids), e3.fp32);
  std::printf("[ measured ] llama3-tiny fp32: max|diff| / max|ref| = %.3g\n", rel3);
  EXPECT_LE(rel3, 1e-5);
}

TEST(HfLoad, FixtureLogitsMatchTransformersInBf16) {
  for (const std::string name : {"llama2-tiny", "llama3-tiny"}) {
    const Expected e = expected(name);
    nn::Llama m = nn::load_hf_llama(kFixtures / name, {.dtype = torch::kBFloat16});
    const double rel = rel_err(logits_of(m, e.ids), e.bf16);
    const double hf_own = rel_err(e.bf16, e.fp32);  // transformers' bf16 logits vs its fp32 ones
    std::printf("[ measured ] %s bf16: max|diff| / max|ref| = %.3g (transformers bf16 vs fp32: %.3g)\n", name.c_str(), rel, hf_own);
    EXPECT_LE(rel, kBf16Tolerance) << name;
    EXPECT_LE(rel, 2.0 * hf_own) << name;  // no further from transformers' bf16 than bf16 is from fp32, within 2x
  }
}

TEST(HfLoad, LoadsInTheFilesDtypeOnTheDeviceByDefault) {
  nn::Llama l2 = nn::load_hf_llama(kFixtures / "llama2-tiny");
  nn::Llama l3 = nn::load_hf_llama(kFixtures / "llama3-tiny");
  for (const auto& p : l2->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat32);
  for (const auto& p : l3->parameters()) {
    EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(p.device().is_cpu());
  }
  // bf16 file loaded as bf16: the same bits the file holds.
  const auto ck = io::SafetensorsCheckpoint::open(kFixtures / "llama3-tiny");
  const auto bytes = ck.read_bytes("model.layers.2.mlp.down_proj.weight");
  const torch::Tensor w = l3->blocks[2]->mlp->down->weight.contiguous();
  ASSERT_EQ(size_t(w.nbytes()), bytes.size());
  EXPECT_EQ(std::memcmp(w.data_ptr(), bytes.data(), bytes.size()), 0);
}

TEST(HfLoad, TiedEmbeddingsAreOneParameter) {
  nn::Llama m = nn::load_hf_llama(kFixtures / "llama3-tiny", {.dtype = torch::kFloat32});
  const auto params = m->named_parameters();
  EXPECT_EQ(params.find("head.weight"), nullptr);
  EXPECT_TRUE(m->head.is_empty());
  int64_t n = 0;
  for (const auto& p : m->parameters()) n += p.numel();
  EXPECT_EQ(n, m->config.shape().params());  // counted once
  EXPECT_EQ(n, 160576);                      // transformers' count (the index's total_parameters)

  // The head reads the embedding: a token that is never input still gets a gradient, through the head alone.
  const torch::Tensor ids = torch::tensor({{5, 9, 11, 5}}, torch::kLong);
  m->train();
  m->zero_grad();
  m->loss(ids, torch::tensor({{9, 11, 5, 200}}, torch::kLong)).backward();
  const torch::Tensor g = m->embed->weight.grad();  // [vocab, hidden]
  ASSERT_TRUE(g.defined());
  EXPECT_GT(g[17].abs().sum().item<double>(), 0.0);  // token 17: only the softmax over the head touches it

  // The chunked loss reads the same weight through head_weight().
  torch::NoGradGuard ng;
  const torch::Tensor t = torch::tensor({{9, 11, 5, 200}}, torch::kLong);
  m->loss_chunk_tokens = 0;
  const double whole = m->loss(ids, t).item<double>();
  m->loss_chunk_tokens = 3;
  EXPECT_NEAR(m->loss(ids, t).item<double>(), whole, 1e-6);
}

// ---- streaming -----------------------------------------------------------------------------------------------------
// The progress callback sees every tensor once, in order, its bytes adding up to the checkpoint's.
TEST(HfLoad, ProgressCountsEveryTensorAndByte) {
  const auto ck = io::SafetensorsCheckpoint::open(kFixtures / "llama2-tiny");
  std::vector<nn::HfLoadProgress> seen;
  nn::Llama m = nn::load_hf_llama(kFixtures / "llama2-tiny",
                                  {.dtype = torch::kFloat32, .progress = [&](const nn::HfLoadProgress& p) { seen.push_back(p); }});
  ASSERT_EQ(seen.size(), ck.tensors().size());
  for (std::size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].tensors, i + 1);
    EXPECT_EQ(seen[i].tensors_total, seen.size());
    EXPECT_EQ(seen[i].bytes_total, ck.total_bytes());
    if (i > 0) EXPECT_GT(seen[i].bytes, seen[i - 1].bytes);
  }
  EXPECT_EQ(seen.back().bytes, ck.total_bytes());
  EXPECT_GE(seen.back().seconds, 0.0);
  nn::Llama plain = nn::load_hf_llama(kFixtures / "llama2-tiny", {.dtype = torch::kFloat32});
  expect_same_parameters(m, plain);
}

// A tensor above the 64 MB piece size is read by concurrent preads of its pieces: the bytes are the file's, and a
// file cut inside the tensor is an error naming it.
TEST(HfLoad, LargeTensorsReadInPiecesAreTheFilesBytes) {
  const TempDir tmp("hf_pieces");
  torch::manual_seed(7);
  const torch::Tensor big = torch::randn({4099, 4103}, torch::kFloat32);  // 67.3 MB: two pieces, the second shorter
  const std::span<const std::byte> bytes(static_cast<const std::byte*>(big.data_ptr()), big.nbytes());
  io::save_safetensors(tmp.path / "model.safetensors", {{"w", {io::DType::F32, {4099, 4103}, bytes}}});
  const io::NameEntry e{"w", "w", io::ParamKind::Down, -1, {4099, 4103}};
  {
    const nn::detail::HfWeights w{io::SafetensorsCheckpoint::open(tmp.path), {e}};
    EXPECT_TRUE(torch::equal(nn::detail::read_hf_tensor(w, e), big));
  }
  const auto file = tmp.path / "model.safetensors";
  const nn::detail::HfWeights w{io::SafetensorsCheckpoint::open(tmp.path), {e}};
  fs::resize_file(file, fs::file_size(file) - 1000);  // truncated after it was opened
  expect_torch_error([&] { (void)nn::detail::read_hf_tensor(w, e); }, {"'w'", "truncated"});
}

// ---- refusals ------------------------------------------------------------------------------------------------------
TEST(HfLoad, RefusalsNameTheKeyOrTensor) {
  TempDir d("hf_refuse");
  {  // a config with attention biases
    const fs::path dir = d.path / "bias";
    fs::create_directories(dir);
    fs::copy(kFixtures / "llama2-tiny", dir, fs::copy_options::recursive);
    auto j = read_json(dir / "config.json");
    j["attention_bias"] = true;
    write_json(dir / "config.json", j);
    expect_torch_error([&] { nn::load_hf_llama(dir); }, {"'attention_bias'", "config.json"});
  }
  {  // a missing tensor
    const fs::path dir = d.path / "missing";
    fs::create_directories(dir);
    write_edited_checkpoint("llama2-tiny", dir, [](TensorMap& t) { t.erase("model.layers.1.mlp.up_proj.weight"); });
    expect_torch_error([&] { nn::load_hf_llama(dir); }, {"missing tensors 'model.layers.1.mlp.up_proj.weight'", dir.string()});
  }
  {  // a wrong shape, and an unexpected tensor
    const fs::path dir = d.path / "shape";
    fs::create_directories(dir);
    write_edited_checkpoint("llama2-tiny", dir, [](TensorMap& t) {
      auto& k = t.at("model.layers.0.self_attn.k_proj.weight");
      std::get<1>(k) = {32, 128};  // [64, 64] in truth; same byte count
      const auto& norm = t.at("model.norm.weight");
      t["model.layers.0.self_attn.q_proj.bias"] = norm;
    });
    expect_torch_error([&] { nn::load_hf_llama(dir); },
                       {"model.layers.0.self_attn.k_proj.weight in model.safetensors: [32, 128] in the checkpoint, [64, 64] expected",
                        "unexpected tensors 'model.layers.0.self_attn.q_proj.bias' in model.safetensors"});
    // Into an existing model: refused before any parameter changes.
    nn::Llama m = random_model(nn::from_hf_config(io::load_llama_config(dir)), 3);
    const torch::Tensor before = m->embed->weight.clone();
    expect_torch_error([&] { nn::load_hf_weights(*m, dir); }, {"model.layers.0.self_attn.k_proj.weight"});
    EXPECT_TRUE(torch::equal(before, m->embed->weight));
  }
  {  // a model whose network differs from config.json's
    nn::LlamaConfig c = nn::from_hf_config(io::load_llama_config(kFixtures / "llama2-tiny"));
    c.norm_eps = 1e-6;
    nn::Llama m(c);
    expect_torch_error([&] { nn::load_hf_weights(*m, kFixtures / "llama2-tiny"); }, {"another network", "norm_eps"});
  }
  {  // a model whose projections LoRA already backs holds no dense weight to fill
    nn::Llama m(nn::from_hf_config(io::load_llama_config(kFixtures / "llama2-tiny")));
    nn::apply_lora<Strategy<LoRA<4, 8>>>(*m);
    expect_torch_error([&] { nn::load_hf_weights(*m, kFixtures / "llama2-tiny"); }, {"'block0.attn.q.weight'", "apply_lora"});
  }
}

// ---- loading into a trainer ------------------------------------------------------------------------------------------
// The model a loader into a trainer starts from: the file's network, uninitialised, in the compute dtype.
nn::Llama empty_model(const fs::path& dir, torch::ScalarType dtype) {
  return nn::Llama(nn::from_hf_config(io::load_llama_config(dir)), nn::ParamInit{torch::TensorOptions().dtype(dtype), false});
}

TEST(HfLoad, ParamInitBuildsInTheDtypeWithoutDrawing) {
  const nn::LlamaConfig c = odd_config(false);
  nn::Llama m(c, nn::ParamInit{torch::TensorOptions().dtype(torch::kBFloat16), /*random=*/false});
  for (const auto& p : m->named_parameters()) EXPECT_EQ(p.value().scalar_type(), torch::kBFloat16) << p.key();
  EXPECT_TRUE(torch::equal(m->norm->weight, torch::ones({c.hidden}, torch::kBFloat16)));  // norms start at one either way
  // The default draws what it always drew: the same seed, the same float weights as a model built without options.
  torch::manual_seed(9);
  nn::Llama a(c);
  torch::manual_seed(9);
  nn::Llama b(c, nn::ParamInit{});
  expect_same_parameters(a, b);
}

// For each optimizer partition of this rank, its fp32 master against `ref` (name -> float value) over the part it owns.
template <class T>
void expect_masters(T& trainer, const std::map<std::string, torch::Tensor>& ref, const std::string& what) {
  const auto layouts = trainer.partition_layouts();
  const auto state = trainer.optimizer_state();
  ASSERT_EQ(layouts.size(), state.size());
  for (std::size_t i = 0; i < state.size(); ++i) {
    const torch::Tensor& master = state[i][0];
    ASSERT_TRUE(master.defined()) << what;
    const int64_t begin = layouts[i].second, end = begin + master.numel();
    for (const auto& e : layouts[i].first->entries()) {
      const int64_t lo = std::max(begin, e.offset), hi = std::min(end, e.offset + e.numel);
      if (lo >= hi) continue;
      const torch::Tensor want = ref.at(e.name).reshape({-1}).narrow(0, lo - e.offset, hi - lo);
      EXPECT_TRUE(torch::equal(master.narrow(0, lo - begin, hi - lo).cpu(), want)) << e.name << " " << what;
    }
  }
}

// Streaming into a trainer (each rank its shards and masters) trains exactly like building the trainer on the model
// loaded whole in float: after a step every parameter has the same bits.
template <class S>
void expect_streamed_load_matches(const std::string& fixture, int world) {
  const fs::path dir = kFixtures / fixture;
  const std::string what = fixture + " world " + std::to_string(world);
  nn::Llama whole_f32 = nn::load_hf_llama(dir, {.dtype = torch::kFloat32});
  std::map<std::string, torch::Tensor> file_values;  // the file's values in float: what the masters must hold
  for (const auto& p : whole_f32->named_parameters()) file_values[p.key()] = p.value().detach().clone();
  const nn::LlamaConfig c = whole_f32->config;
  std::vector<nn::Llama> streamed, whole;
  for (int r = 0; r < world; ++r) {
    streamed.push_back(empty_model(dir, torch::kBFloat16));
    whole.push_back(nn::load_hf_llama(dir, {.dtype = torch::kFloat32}));
  }
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> got(world), want(world), loaded(world);
  comm::run_ranks(world, [&](std::shared_ptr<comm::LocalComm> comm) {
    const int r = comm->rank();
    torch::manual_seed(17 + r);
    const torch::Tensor ids = torch::randint(c.vocab, {2, 9}, torch::kLong);  // [B, T + 1], per rank
    const auto step = [&](auto& trainer, nn::Llama& m) { trainer.step([&] { return m->loss(ids.narrow(1, 0, 8), ids.narrow(1, 1, 8)); }); };
    {
      auto trainer = make_trainer<S>(streamed[r], AdamW{.lr = 1e-2f}, comm);
      nn::load_hf_weights(trainer, *streamed[r], dir);
      loaded[r] = trainer.full_parameters();
      expect_masters(trainer, file_values, what);
      step(trainer, streamed[r]);
      got[r] = trainer.full_parameters();
    }
    auto trainer = make_trainer<S>(whole[r], AdamW{.lr = 1e-2f}, comm);
    step(trainer, whole[r]);
    want[r] = trainer.full_parameters();
  });
  for (const auto& [name, value] : loaded[0])  // before the step: the file's values rounded to bf16
    EXPECT_TRUE(torch::equal(value, file_values.at(name).to(torch::kBFloat16))) << name << " " << what;
  ASSERT_EQ(got[0].size(), want[0].size());
  for (std::size_t i = 0; i < got[0].size(); ++i) {
    EXPECT_EQ(got[0][i].first, want[0][i].first);
    EXPECT_TRUE(torch::equal(got[0][i].second, want[0][i].second)) << got[0][i].first << " " << what;
  }
}

TEST(HfLoad, IntoAStage3TrainerShardByShard) {
  using S = Strategy<Sharded<Stage3>, Precision<bf16, float>>;
  for (const std::string fixture : {"llama2-tiny", "llama3-tiny"})  // an fp32 file and a bf16 one (tied, head_dim 24)
    for (const int world : {1, 2, 3}) expect_streamed_load_matches<S>(fixture, world);
}

TEST(HfLoad, IntoEveryStageAndHostOffload) {
  expect_streamed_load_matches<Strategy<Precision<bf16, float>>>("llama2-tiny", 2);
  expect_streamed_load_matches<Strategy<Sharded<Stage1>, Precision<bf16, float>>>("llama2-tiny", 2);
  expect_streamed_load_matches<Strategy<Sharded<Stage2>, Precision<bf16, float>>>("llama3-tiny", 3);
  expect_streamed_load_matches<Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed>>("llama2-tiny", 2);
}

TEST(HfLoad, IntoATrainerRefusalsNameTheParameter) {
  using S = Strategy<Sharded<Stage3>, Precision<bf16, float>>;
  const fs::path dir = kFixtures / "llama2-tiny";
  nn::Llama m = empty_model(dir, torch::kBFloat16);
  auto trainer = make_trainer<S>(m, AdamW{.lr = 1e-2f}, comm::LocalComm::single());
  expect_torch_error(
      [&] {
        trainer.load_parameter("block0.attn.qq.weight", torch::zeros({64, 64}));
      },
      {"'block0.attn.qq.weight'", "not a trainable parameter"});
  expect_torch_error(
      [&] {
        trainer.load_parameter("block0.attn.k.weight", torch::zeros({64, 65}));
      },
      {"'block0.attn.k.weight'", "[64, 65]"});
  expect_torch_error(
      [&] {
        trainer.load_parameter("block0.attn.k.weight", torch::zeros({64, 64}, torch::kLong));
      },
      {"'block0.attn.k.weight'", "floating-point"});
  expect_torch_error([&] { trainer.gather_parameter("block9.mlp.up.weight"); }, {"'block9.mlp.up.weight'", "not a trainable parameter"});
  // A checkpoint of another network: refused before anything is written.
  nn::load_hf_weights(trainer, *m, dir);
  const torch::Tensor before = trainer.gather_parameter("block0.attn.k.weight");
  expect_torch_error([&] { nn::load_hf_weights(trainer, *m, kFixtures / "llama3-tiny"); }, {"another network"});
  EXPECT_TRUE(torch::equal(before, trainer.gather_parameter("block0.attn.k.weight")));
  // LoRA's frozen base is not the trainer's: it must be in the model before make_trainer replaces it.
  nn::Llama lora_model = empty_model(dir, torch::kFloat32);
  auto lora = make_trainer<Strategy<LoRA<4, 8>>>(lora_model, AdamW{.lr = 1e-2f}, comm::LocalComm::single());
  expect_torch_error([&] { nn::load_hf_weights(lora, *lora_model, dir); }, {"'block0.attn.q.weight'", "apply_lora"});
}

// ---- export ---------------------------------------------------------------------------------------------------------
TEST(HfExport, RoundTripIsBitExact) {
  TempDir d("hf_roundtrip");
  for (const bool tied : {false, true}) {
    nn::Llama m = random_model(odd_config(tied), 10 + tied);
    const fs::path f32 = d.path / ("f32_" + std::to_string(tied)), b16 = d.path / ("bf16_" + std::to_string(tied));
    nn::save_hf_llama(*m, f32, {.max_shard_bytes = 40000});  // several shards
    nn::Llama back = nn::load_hf_llama(f32);
    EXPECT_EQ(nn::network_difference(m->config, back->config), "");
    expect_same_parameters(m, back);
    const torch::Tensor ids = random_ids(m->config.vocab, 4);
    EXPECT_TRUE(torch::equal(logits_of(m, ids), logits_of(back, ids)));

    // bf16: the export rounds once; loading gives those bits back.
    m->to(torch::kBFloat16);
    nn::save_hf_llama(*m, b16);  // the model's dtype
    EXPECT_EQ(read_json(b16 / "config.json")["torch_dtype"], "bfloat16");
    nn::Llama back16 = nn::load_hf_llama(b16);
    expect_same_parameters(m, back16);
  }
  // half, from a float model
  nn::Llama m = random_model(odd_config(false), 12);
  nn::save_hf_llama(*m, d.path / "f16", {.dtype = io::DType::F16});
  nn::Llama back = nn::load_hf_llama(d.path / "f16");
  m->to(torch::kHalf);
  expect_same_parameters(m, back);
}

TEST(HfExport, ShardedIndexIsConsistent) {
  TempDir d("hf_index");
  nn::Llama m = random_model(odd_config(false), 20);
  const uint64_t max_bytes = 30000;
  nn::save_hf_llama(*m, d.path, {.max_shard_bytes = max_bytes});
  const auto idx = read_json(d.path / "model.safetensors.index.json");
  const auto table = io::hf_checkpoint_tensors(nn::to_hf_config(m->config, io::DType::F32));
  std::set<std::string> names, files;
  for (const auto& [name, file] : idx["weight_map"].items()) names.insert(name), files.insert(file.get<std::string>());
  std::set<std::string> want;
  uint64_t total = 0;
  for (const auto& e : table) {
    want.insert(e.hf);
    uint64_t n = 4;
    for (auto s : e.shape) n *= uint64_t(s);
    total += n;
  }
  EXPECT_EQ(names, want);
  EXPECT_EQ(idx["metadata"]["total_size"].get<uint64_t>(), total);
  ASSERT_GT(files.size(), 2u);
  int k = 1;
  for (const auto& f : files) {  // model-00001-of-0000N.safetensors, ..., each within the limit unless one tensor alone
    char want_name[64];
    std::snprintf(want_name, sizeof want_name, "model-%05d-of-%05zu.safetensors", k++, files.size());
    EXPECT_EQ(f, want_name);
    const auto r = io::SafetensorsReader::open(d.path / f);
    if (r.tensors().size() > 1) EXPECT_LE(fs::file_size(d.path / f), max_bytes) << f;
    for (const auto& [name, _] : r.tensors()) EXPECT_EQ(idx["weight_map"][name], f) << name;
  }
  EXPECT_FALSE(fs::exists(d.path / "model.safetensors"));
  const auto ck = io::SafetensorsCheckpoint::open(d.path);  // checks every header against the index
  EXPECT_EQ(ck.total_bytes(), total);
  for (const auto& entry : fs::directory_iterator(d.path)) EXPECT_FALSE(entry.path().string().ends_with(".tmp"));
}

TEST(HfExport, FixtureExportKeepsTheFilesBytesAndConfig) {
  TempDir d("hf_fixture_export");
  for (const std::string name : {"llama2-tiny", "llama3-tiny"}) {
    const io::LlamaConfig cfg = io::load_llama_config(kFixtures / name);
    nn::Llama m = nn::load_hf_llama(kFixtures / name);  // the file's dtype
    const fs::path out = d.path / name;
    nn::save_hf_llama(*m, out, {.source_config = cfg});
    EXPECT_EQ(io::load_llama_config(out), cfg) << name;  // token ids and max_position_embeddings kept
    const auto a = io::SafetensorsCheckpoint::open(kFixtures / name), b = io::SafetensorsCheckpoint::open(out);
    EXPECT_EQ(a.names(), b.names()) << name;
    for (const auto& t : a.names()) {
      EXPECT_EQ(a.info(t).dtype, b.info(t).dtype) << t;
      EXPECT_EQ(a.read_bytes(t), b.read_bytes(t)) << name << " " << t;
    }
  }
}

TEST(HfExport, TensorsComeOneAtATimeFromTheSource) {
  TempDir d("hf_source");
  nn::Llama m = random_model(odd_config(true), 30);
  const auto params = m->named_parameters();
  std::vector<std::string> asked;
  nn::save_hf_llama(m->config,
                    [&](const std::string& name) {
                      asked.push_back(name);
                      return *params.find(name);
                    },
                    d.path / "ok", {.max_shard_bytes = 50000});
  std::vector<std::string> order;
  for (const auto& e : io::hf_checkpoint_tensors(nn::to_hf_config(m->config, io::DType::F32))) order.push_back(e.squeeze);
  EXPECT_EQ(asked, order);  // checkpoint order, each once, no head under tied embeddings
  nn::Llama back = nn::load_hf_llama(d.path / "ok");
  expect_same_parameters(m, back);

  // A wrong shape from the source: an error naming the parameter, and no checkpoint written.
  const fs::path bad = d.path / "bad";
  expect_torch_error(
      [&] {
        nn::save_hf_llama(m->config,
                          [&](const std::string& name) {
                            return name == "block1.mlp.up.weight" ? torch::zeros({97, 41}) : *params.find(name);
                          },
                          bad, {.max_shard_bytes = 50000});
      },
      {"'block1.mlp.up.weight'", "model.layers.1.mlp.up_proj.weight", "[97, 41]", "[97, 40] expected"});
  if (fs::exists(bad))
    for (const auto& entry : fs::directory_iterator(bad)) ADD_FAILURE() << "left behind: " << entry.path();
}

// A stage-3 trainer exports without gathering the model: gather_parameter brings one layer at a time (a
// collective), rank 0 writes, and the file holds the trained bf16 weights bit for bit, at world 1, 2 and 3.
TEST(HfExport, FromAStage3TrainerOneLayerAtATime) {
  using S = Strategy<Sharded<Stage3>, Precision<bf16, float>>;
  TempDir d("hf_stage3");
  for (const bool tied : {false, true})
    for (int world : {1, 2, 3}) {
      const nn::LlamaConfig c = odd_config(tied);
      std::vector<nn::Llama> models;
      for (int r = 0; r < world; ++r) models.push_back(random_model(c, 21));
      const fs::path dir = d.path / ("w" + std::to_string(world) + "_" + std::to_string(tied));
      std::vector<std::pair<std::string, torch::Tensor>> trained;
      comm::run_ranks(world, [&](std::shared_ptr<comm::LocalComm> comm) {
        nn::Llama& m = models[std::size_t(comm->rank())];
        auto trainer = make_trainer<S>(m, AdamW{.lr = 1e-2f}, comm);
        torch::manual_seed(5 + comm->rank());
        const torch::Tensor ids = torch::randint(c.vocab, {2, 9}, torch::kLong);  // [B, T + 1], per rank
        trainer.step([&] { return m->loss(ids.narrow(1, 0, 8), ids.narrow(1, 1, 8)); });
        auto full = trainer.full_parameters();  // the reference: every layer gathered at once
        nn::save_hf_llama(trainer, c, dir);
        if (comm->rank() == 0) trained = std::move(full);
      });
      EXPECT_EQ(read_json(dir / "config.json")["torch_dtype"], "bfloat16");
      const nn::Llama back = nn::load_hf_llama(dir);
      const auto loaded = back->named_parameters();
      ASSERT_EQ(loaded.size(), trained.size()) << "world " << world;
      for (const auto& [name, value] : trained) {
        const torch::Tensor* q = loaded.find(name);
        ASSERT_NE(q, nullptr) << name;
        EXPECT_TRUE(torch::equal(*q, value)) << name << " world " << world << " tied " << tied;
      }
    }
}

TEST(HfExport, LoraIsMergedAndQuantizedBasesDequantised) {
  TempDir d("hf_lora_export");
  const torch::Tensor ids = random_ids(291, 5);
  {  // dense base
    nn::Llama m = random_model(odd_config(false), 40);
    const auto layers = nn::apply_lora<Strategy<LoRA<4, 6, LoraTargets::q | LoraTargets::v | LoraTargets::down>>>(*m);
    {
      torch::NoGradGuard ng;
      for (const auto& l : layers) l.layer->lora_B.normal_(0.0, 0.05);
    }
    const torch::Tensor want = logits_of(m, ids);
    nn::save_hf_llama(*m, d.path / "dense");
    nn::Llama back = nn::load_hf_llama(d.path / "dense");
    EXPECT_TRUE(torch::equal(back->blocks[1]->attn->q->weight, layers[3].layer->merged_weight()));  // layers: q, v, down per block
    EXPECT_LE(rel_err(logits_of(back, ids), want), 1e-5);
  }
  {  // QLoRA: NF4 bases under adapters (q, v) and without (k, o, gate, up, down)
    nn::Llama m = random_model(odd_config(true), 41);
    const auto layers = nn::apply_lora<Strategy<Quantized<4, NF4>, LoRA<4, 8>>>(*m);
    {
      torch::NoGradGuard ng;
      for (const auto& l : layers) l.layer->lora_B.normal_(0.0, 0.05);
    }
    const torch::Tensor want = logits_of(m, ids);
    nn::save_hf_llama(*m, d.path / "nf4");
    nn::Llama back = nn::load_hf_llama(d.path / "nf4");
    EXPECT_TRUE(torch::equal(back->blocks[0]->attn->q->weight, layers[0].layer->merged_weight()));
    const auto* k = dynamic_cast<nn::Nf4LinearImpl*>(m->blocks[0]->attn->k->backing().get());
    ASSERT_NE(k, nullptr);
    EXPECT_TRUE(torch::equal(back->blocks[0]->attn->k->weight, k->nf4_weight().dequantize(torch::kFloat32)));
    EXPECT_LE(rel_err(logits_of(back, ids), want), 1e-5);
  }
}

// ---- PEFT adapters ----------------------------------------------------------------------------------------------------
using PeftStrategy = Strategy<LoRA<4, 6>>;  // q and v, r 4, alpha 6

// A random model with random adapters (A and B both, so an import that kept its own A would show).
nn::Llama adapted_model(uint64_t seed) {
  nn::Llama m = random_model(odd_config(false), 50);  // the same base every time
  const auto layers = nn::apply_lora<PeftStrategy>(*m);
  torch::manual_seed(seed);
  torch::NoGradGuard ng;
  for (const auto& l : layers) {
    l.layer->lora_A.normal_(0.0, 0.2);
    l.layer->lora_B.normal_(0.0, 0.05);
  }
  return m;
}

TEST(Peft, ExportWritesPeftsNamesAndConfig) {
  TempDir d("peft_export");
  nn::Llama m = adapted_model(1);
  const auto info = nn::save_peft_adapters(*m, d.path, {.base_model_name_or_path = "org/odd-llama", .lora_dropout = 0.05});
  EXPECT_EQ(info.target_modules, (std::vector<std::string>{"q_proj", "v_proj"}));

  const auto f = io::SafetensorsReader::open(d.path / "adapter_model.safetensors");
  std::set<std::string> want;
  for (int i = 0; i < 3; ++i)
    for (const std::string mod : {"q_proj", "v_proj"}) {
      const std::string key = "base_model.model.model.layers." + std::to_string(i) + ".self_attn." + mod;
      want.insert(key + ".lora_A.weight");
      want.insert(key + ".lora_B.weight");
      EXPECT_EQ(f.info(key + ".lora_A.weight").shape, (std::vector<int64_t>{4, 40}));                         // [r, in]
      EXPECT_EQ(f.info(key + ".lora_B.weight").shape, (std::vector<int64_t>{mod == "q_proj" ? 60 : 12, 4}));  // [out, r]
      EXPECT_EQ(f.info(key + ".lora_A.weight").dtype, io::DType::F32);
    }
  std::set<std::string> got;
  for (const auto& [name, _] : f.tensors()) got.insert(name);
  EXPECT_EQ(got, want);
  EXPECT_EQ(f.metadata().at("format"), "pt");

  const auto j = read_json(d.path / "adapter_config.json");
  EXPECT_EQ(j["peft_type"], "LORA");
  EXPECT_EQ(j["task_type"], "CAUSAL_LM");
  EXPECT_EQ(j["r"], 4);
  EXPECT_TRUE(j["lora_alpha"].is_number_integer());
  EXPECT_EQ(j["lora_alpha"], 6);
  EXPECT_EQ(j["lora_dropout"], 0.05);
  EXPECT_EQ(j["bias"], "none");
  EXPECT_EQ(j["target_modules"], (nlohmann::json{"q_proj", "v_proj"}));
  EXPECT_EQ(j["base_model_name_or_path"], "org/odd-llama");
}

TEST(Peft, ImportRoundTripIsExact) {
  TempDir d("peft_roundtrip");
  nn::Llama src = adapted_model(2);
  nn::save_peft_adapters(*src, d.path, {.base_model_name_or_path = "org/odd-llama"});
  nn::Llama dst = adapted_model(3);  // same base, other adapters
  const auto info = nn::load_peft_adapters(*dst, d.path);
  EXPECT_EQ(info.r, 4);
  EXPECT_EQ(info.lora_alpha, 6.0);
  EXPECT_EQ(info.base_model_name_or_path, "org/odd-llama");
  expect_same_parameters(src, dst);  // every lora_A / lora_B, bit for bit
  const torch::Tensor ids = random_ids(291, 6);
  EXPECT_TRUE(torch::equal(logits_of(src, ids), logits_of(dst, ids)));
}

TEST(Peft, NonIntegerAlphaIsKept) {
  TempDir d("peft_alpha");
  nn::Llama src = adapted_model(4);
  nn::save_peft_adapters(*src, d.path);
  auto j = read_json(d.path / "adapter_config.json");
  j["lora_alpha"] = 7.5;
  write_json(d.path / "adapter_config.json", j);
  nn::Llama dst = adapted_model(5);
  EXPECT_EQ(nn::load_peft_adapters(*dst, d.path).lora_alpha, 7.5);
  for (const auto& l : nn::peft_layers(*dst)) EXPECT_EQ(l.lora->scaling(), 7.5 / 4.0) << l.path;
  const fs::path again = d.path / "again";
  nn::save_peft_adapters(*dst, again);
  EXPECT_EQ(read_json(again / "adapter_config.json")["lora_alpha"], 7.5);
}

TEST(Peft, RefusalsNameTheKey) {
  TempDir d("peft_refuse");
  nn::Llama src = adapted_model(6);
  nn::save_peft_adapters(*src, d.path / "good");
  const auto variant = [&](const std::string& name, const std::function<void(nlohmann::json&)>& edit_config,
                           const std::function<void(TensorMap&)>& edit_tensors) {
    const fs::path dir = d.path / name;
    fs::create_directories(dir);
    auto j = read_json(d.path / "good" / "adapter_config.json");
    edit_config(j);
    write_json(dir / "adapter_config.json", j);
    const auto f = io::SafetensorsReader::open(d.path / "good" / "adapter_model.safetensors");
    TensorMap t;
    for (const auto& [n, info] : f.tensors()) t[n] = {info.dtype, info.shape, f.read_bytes(n)};
    edit_tensors(t);
    std::map<std::string, io::TensorRef> refs;
    for (const auto& [n, v] : t) refs[n] = {std::get<0>(v), std::get<1>(v), std::get<2>(v)};
    io::save_safetensors(dir / "adapter_model.safetensors", refs);
    return dir;
  };
  const auto same = [](auto&) {};
  const std::string q0 = "base_model.model.model.layers.0.self_attn.q_proj";
  nn::Llama dst = adapted_model(7);
  const torch::Tensor before = dst->blocks[0]->attn->q->backing()->named_parameters()["lora_A"].clone();

  expect_torch_error(
      [&] {
        nn::load_peft_adapters(*dst, variant(
                                         "r", [](auto& j) { j["r"] = 8; }, same));
      },
      {"'r'", "8", "rank 4"});
  expect_torch_error(
      [&] {
        nn::load_peft_adapters(*dst, variant(
                                         "targets",
                                         [](auto& j) {
                                           j["target_modules"] = nlohmann::json::array({"q_proj", "k_proj"});
                                         },
                                         same));
      },
      {"'target_modules'", "[k_proj, q_proj]", "[q_proj, v_proj]"});
  expect_torch_error(
      [&] {
        nn::load_peft_adapters(*dst, variant(
                                         "regex", [](auto& j) { j["target_modules"] = ".*proj"; }, same));
      },
      {"'target_modules'", "regular expression"});
  expect_torch_error(
      [&] {
        nn::load_peft_adapters(*dst, variant(
                                         "dora", [](auto& j) { j["use_dora"] = true; }, same));
      },
      {"'use_dora'"});
  expect_torch_error(
      [&] {
        nn::load_peft_adapters(*dst, variant(
                                         "type", [](auto& j) { j["peft_type"] = "IA3"; }, same));
      },
      {"'peft_type'", "IA3"});
  expect_torch_error(
      [&] {
        nn::load_peft_adapters(*dst, variant(
                                         "bias", [](auto& j) { j["bias"] = "all"; }, same));
      },
      {"'bias'"});
  expect_torch_error(
      [&] {
        nn::load_peft_adapters(*dst, variant(
                                         "missing", [](auto&) {}, [&](TensorMap& t) { t.erase(q0 + ".lora_B.weight"); }));
      },
      {"missing tensor '" + q0 + ".lora_B.weight'", "block0.attn.q"});
  expect_torch_error(
      [&] {
        nn::load_peft_adapters(*dst, variant(
                                         "shape", [](auto&) {},
                                         [&](TensorMap& t) {
                                           std::get<1>(t.at(q0 + ".lora_A.weight")) = {40, 4};
                                         }));
      },
      {"'" + q0 + ".lora_A.weight'", "[40, 4]", "[4, 40]"});
  expect_torch_error(
      [&] {
        nn::load_peft_adapters(
            *dst, variant(
                      "extra", [](auto&) {}, [&](TensorMap& t) { t[q0 + ".lora_magnitude_vector"] = t.at(q0 + ".lora_A.weight"); }));
      },
      {"unexpected tensor '" + q0 + ".lora_magnitude_vector'"});
  EXPECT_TRUE(torch::equal(before, dst->blocks[0]->attn->q->backing()->named_parameters()["lora_A"]));  // nothing imported

  nn::Llama plain = random_model(odd_config(false), 50);
  expect_torch_error([&] { nn::load_peft_adapters(*plain, d.path / "good"); }, {"apply_lora first"});
  expect_torch_error([&] { nn::save_peft_adapters(*plain, d.path / "none"); }, {"apply_lora first"});
}

}  // namespace

// ---- for the real clients ---------------------------------------------------------------------------------------
// What tools/check_hf_interop.py gives transformers and PEFT (on a machine that has them), written to
// $SQUEEZE_INTEROP_DIR when set (else a temporary directory): llama3-tiny with random adapters on q, v and down
// (alpha 6.5 over r 4) exported merged (merged/) and as PEFT adapters over the fixture (peft/), llama2-tiny
// exported in bf16 (llama2-bf16/), and squeeze's logits for each (squeeze_logits.safetensors). Here: squeeze reads
// its own merged export back to the adapted model's logits (fp32, rel <= 1e-5).
TEST(HfInterop, WritesExportsForTransformersAndPeft) {
  const char* env = std::getenv("SQUEEZE_INTEROP_DIR");
  TempDir tmp("interop");
  const fs::path out = env ? fs::path(env) : tmp.path;
  fs::create_directories(out);
  const Expected e3 = expected("llama3-tiny");
  nn::Llama m = nn::load_hf_llama(kFixtures / "llama3-tiny", {.dtype = torch::kFloat32});
  const auto layers = nn::apply_lora<Strategy<LoRA<4, 6, LoraTargets::q | LoraTargets::v | LoraTargets::down>>>(*m);
  torch::manual_seed(21);
  {
    torch::NoGradGuard ng;
    for (auto l : layers) {  // LoRALinear is a holder: a copy refers to the same layer
      l.layer->lora_A.normal_(0.0, 0.3);
      l.layer->lora_B.normal_(0.0, 0.1);
      l.layer->set_alpha(6.5);  // PEFT keeps a non-integer alpha; scale = alpha / r
    }
  }
  const torch::Tensor lora_logits = logits_of(m, e3.ids);  // [2, 11, 288]
  nn::save_hf_llama(*m, out / "merged", {.dtype = io::DType::F32, .max_shard_bytes = 200'000});
  nn::save_peft_adapters(*m, out / "peft", {.base_model_name_or_path = "llama3-tiny"});
  nn::Llama back = nn::load_hf_llama(out / "merged", {.dtype = torch::kFloat32});
  const double rel = rel_err(logits_of(back, e3.ids), lora_logits);
  std::printf("[ measured ] merged export read back: max|diff| / max|ref| = %.3g\n", rel);
  EXPECT_LE(rel, 1e-5);

  const Expected e2 = expected("llama2-tiny");
  nn::Llama l2 = nn::load_hf_llama(kFixtures / "llama2-tiny", {.dtype = torch::kBFloat16});
  nn::save_hf_llama(*l2, out / "llama2-bf16", {.max_shard_bytes = 150'000});
  const torch::Tensor l2_logits = logits_of(l2, e2.ids);
  const torch::Tensor ids3 = e3.ids.contiguous(), ids2 = e2.ids.contiguous(), a = lora_logits.contiguous(), b = l2_logits.contiguous();
  const auto ref = [](const torch::Tensor& t, io::DType d) {
    return io::TensorRef{d, std::vector<int64_t>(t.sizes().begin(), t.sizes().end()),
                         std::span<const std::byte>(static_cast<const std::byte*>(t.data_ptr()), t.nbytes())};
  };
  io::save_safetensors(out / "squeeze_logits.safetensors", {{"llama3_input_ids", ref(ids3, io::DType::I64)},
                                                            {"llama3_lora_logits", ref(a, io::DType::F32)},
                                                            {"llama2_input_ids", ref(ids2, io::DType::I64)},
                                                            {"llama2_bf16_logits", ref(b, io::DType::F32)}});
  EXPECT_TRUE(fs::exists(out / "peft" / "adapter_model.safetensors"));
}
