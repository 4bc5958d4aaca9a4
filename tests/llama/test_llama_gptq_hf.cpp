// examples/llama_gptq on Hugging Face LLaMAs: the tiny fixtures transformers wrote (tests/fixtures/hf: llama2-tiny with
// an untied head and default RoPE; llama3-tiny with tied embeddings, head_dim 24 and llama3 RoPE scaling) quantized by
// GPTQ on token shards written here (random ids below the vocabulary), exported in the Hugging Face GPTQ layout and
// read back by nn::load_hf_gptq_llama; the example's packed format converted to that layout; bad requests.
//
// LlamaGptqHf.WritesFilesForTheNumpyCheck (skipped unless $SQUEEZE_GPTQ_HF_DIR is set) writes there what ctest's
// llama_gptq_hf_numpy_gptq hands to tools/check_quant_interop.py (an independent numpy dequantizer of GPTQModel's
// format) and what the llama_gptq.hf.* command-line tests read:
//   shards/              train_000000.bin (1025 tokens), val_000000.bin (513), uint16 ids < 288
//   shards-bad/          the same, with one id of the validation shard = 288 (outside the vocabulary)
//   <case>/              the export: llama2-gptq-w4-g32-actorder, llama3-gptq-w3-g32
//   <case>-dequantized/  the in-memory model, its packed layers dequantized (quant::dequantize): a dense fp32 directory
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <squeeze/nn/hf_quantized.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <unistd.h>

#include "data.hpp"
#include "llama_gptq.hpp"
#include <squeeze/io/posix_file.hpp>

namespace {

const bool one_thread = (torch::set_num_threads(1), true);

namespace fs = std::filesystem;
namespace lg = squeeze::llama_gptq;
namespace io = squeeze::io;
namespace nn = squeeze::nn;
using nn::Llama;

const fs::path kFixtures = SQUEEZE_HF_FIXTURES;
constexpr int64_t kSeq = 32;

struct TempDir {
  fs::path path;
  TempDir() : path(fs::temp_directory_path() / ("llama_gptq_hf_test_" + std::to_string(getpid()) + "_" + std::to_string(counter()++))) {
    fs::create_directories(path);
  }
  ~TempDir() { squeeze::io::try_remove_tree(path); }
  static int& counter() {
    static int n = 0;
    return n;
  }
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}
bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

// train_000000.bin and val_000000.bin of random ids below `vocab` in `dir` (32 and 16 windows of kSeq tokens);
// `bad_id`: the validation shard's id at position 100 set to it.
void write_shards(const fs::path& dir, int64_t vocab, std::optional<int32_t> bad_id = std::nullopt) {
  fs::create_directories(dir);
  std::mt19937 rng(29);
  std::uniform_int_distribution<int32_t> id(0, int32_t(vocab - 1));
  const auto tokens = [&](int64_t n) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (auto& x : t) x = id(rng);
    return t;
  };
  io::write_token_shard(dir / "train_000000.bin", tokens(16 * kSeq * 2 + 1), io::TokenWidth::U16);
  auto val = tokens(8 * kSeq * 2 + 1);
  if (bad_id) val[100] = *bad_id;
  io::write_token_shard(dir / "val_000000.bin", val, io::TokenWidth::U16);
}

// One case: a fixture quantized by GPTQ on the shards' calibration windows, then packed into the model.
struct Quantized {
  Llama model{nullptr};  // QuantizedLinear block projections, dense tensors rounded to fp16 (what the export holds)
  lg::QuantSpec spec;
  lg::QuantizeResult q;
  io::LlamaConfig source;      // the fixture's config.json
  torch::Tensor x;             // [8, kSeq] validation inputs
  torch::Tensor dense_logits;  // the unquantized model's on x
};

Quantized quantize_fixture(const std::string& fixture, const fs::path& shard_dir, int bits, bool act_order) {
  Quantized r;
  r.source = io::load_llama_config(kFixtures / fixture);
  const auto shards = squeeze::llama::open_shards(shard_dir, r.source.vocab_size, fixture, 1, 1, kSeq, 7, 0, 1);
  const auto calib = lg::make_calibration(lg::shard_windows(*shards.train, 0, 16, torch::kCPU).first, 8, torch::kCPU);
  r.x = lg::shard_windows(*shards.val, 0, 8, torch::kCPU).first;
  r.model = nn::load_hf_llama(kFixtures / fixture, {.dtype = torch::kFloat32});
  r.model->eval();
  {
    torch::NoGradGuard ng;
    r.dense_logits = r.model->forward(r.x);
  }
  r.spec.method = lg::Method::GPTQ, r.spec.bits = bits, r.spec.group_size = 32, r.spec.act_order = act_order;
  r.q = lg::quantize(r.model, r.spec, calib);
  lg::round_dense_to_half(r.model);
  lg::use_packed(r.model, r.q.layers);
  return r;
}

torch::Tensor logits_of(Llama& m, const torch::Tensor& x) {
  torch::NoGradGuard ng;
  m->eval();
  return m->forward(x).to(torch::kFloat64);
}
double rel_err(const torch::Tensor& got, const torch::Tensor& ref) {
  return ((got.to(torch::kFloat64) - ref.to(torch::kFloat64)).abs().max() / ref.to(torch::kFloat64).abs().max()).item<double>();
}
int64_t quantized_linears(Llama& m) {
  int64_t n = 0;
  for (const auto& mod : m->modules()) n += std::dynamic_pointer_cast<nn::QuantizedLinearImpl>(mod) != nullptr;
  return n;
}
// Entries of `dir` whose names say they were left half-done (the export's temporary and displaced directories).
int64_t leftovers(const fs::path& dir) {
  int64_t n = 0;
  for (const auto& e : fs::directory_iterator(dir))
    n += has(e.path().filename().string(), ".tmp-") || has(e.path().filename().string(), ".old-");
  return n;
}

// The packed layers equal, field by field (scales compared as fp16 bits).
void expect_same_layers(const std::map<std::string, squeeze::quant::PackedLinear>& got,
                        const std::map<std::string, squeeze::quant::PackedLinear>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, p] : want) {
    ASSERT_TRUE(got.count(name)) << what << ": no " << name;
    const auto& g = got.at(name);
    EXPECT_EQ(g.qweight, p.qweight) << what << " " << name;
    EXPECT_EQ(g.qzeros, p.qzeros) << what << " " << name;
    EXPECT_EQ(g.g_idx, p.g_idx) << what << " " << name;
    ASSERT_EQ(g.scales.size(), p.scales.size()) << what << " " << name;
    EXPECT_EQ(std::memcmp(g.scales.data(), p.scales.data(), p.scales.size() * sizeof(squeeze::half)), 0) << what << " " << name;
  }
}

}  // namespace

// GPTQ of each fixture on shard windows, exported in the Hugging Face layout: nn::load_hf_gptq_llama reads it into a
// model of QuantizedLinear projections whose fp32 logits equal the in-memory quantized model's (rel <= 1e-6; both
// multiply by the same dequantized weights and hold the same fp16 dense tensors: measured 0 on the CPU). The config
// keeps the fixture's network (tied embeddings, head_dim, RoPE scaling) and what nn::LlamaConfig does not hold
// (max_position_embeddings), the quantization_config says what was asked, and nothing half-written is left beside it.
TEST(LlamaGptqHf, ExportReadsBackToTheInMemoryQuantizedModel) {
  struct Case {
    std::string fixture;
    int bits;
    bool act_order;
  };
  for (const Case& k : {Case{"llama2-tiny", 4, true}, Case{"llama3-tiny", 3, false}}) {
    TempDir dir;
    write_shards(dir.path / "shards", 288);
    Quantized r = quantize_fixture(k.fixture, dir.path / "shards", k.bits, k.act_order);
    EXPECT_EQ(int64_t(r.q.reports.size()), 7 * r.source.num_hidden_layers) << k.fixture;
    const fs::path out = dir.path / "export";
    lg::export_hf_gptq(out, lg::hf_gptq_model(r.model, r.q.layers, r.spec, r.source), false, lg::hf_side_files(kFixtures / k.fixture));
    EXPECT_EQ(leftovers(dir.path), 0) << k.fixture;
    EXPECT_TRUE(fs::exists(out / "generation_config.json")) << k.fixture << ": the source's side files come along";

    Llama back = nn::load_hf_gptq_llama(out);
    EXPECT_EQ(quantized_linears(back), 7 * r.source.num_hidden_layers) << k.fixture;
    const torch::Tensor want = logits_of(r.model, r.x), got = logits_of(back, r.x);
    const double rel = rel_err(got, want);
    std::printf("[ measured ] %s %s: reloaded export's logits vs the in-memory quantized model's: %.3g; quantized vs dense: %.3g\n",
                k.fixture.c_str(), r.spec.tag().c_str(), rel, rel_err(want, r.dense_logits));
    EXPECT_LE(rel, 1e-6) << k.fixture;
    EXPECT_GT(rel_err(want, r.dense_logits), 1e-3) << k.fixture << ": the quantized model is not the dense one";

    const io::HfGptqModel file = io::load_hf_gptq(out);
    expect_same_layers(file.layers, r.q.layers, k.fixture);
    EXPECT_EQ(nn::network_difference(nn::from_hf_config(file.config), r.model->config), "") << k.fixture;
    EXPECT_EQ(file.config.max_position_embeddings, r.source.max_position_embeddings) << k.fixture;
    EXPECT_EQ(file.quant.bits, k.bits);
    EXPECT_EQ(file.quant.group_size, 32);
    EXPECT_EQ(file.quant.desc_act, k.act_order);
    EXPECT_FALSE(file.quant.sym);
  }
}

// The example's packed format (--save) of a Hugging Face model converts (--load-quantized DIR --export-hf OUT) to a
// Hugging Face directory that equals its source: the same packed tensors, the network of the model it came from
// (llama3-tiny's tied embeddings, head_dim 24 and llama3 RoPE, kept in the packed config.json's hf_config), and the
// same logits as the packed model (dense tensors rounded to fp16, as the layout stores them). A packed directory
// written before hf_config existed (llama2-tiny's network fits the old fields) still loads and converts.
TEST(LlamaGptqHf, PackedDirectoryConvertsToAnEqualHuggingFaceDirectory) {
  for (const std::string fixture : {"llama3-tiny", "llama2-tiny"}) {
    TempDir dir;
    write_shards(dir.path / "shards", 288);
    Quantized r = quantize_fixture(fixture, dir.path / "shards", 4, true);
    lg::save_packed(dir.path / "packed", r.model, r.q.layers, r.spec, r.source);
    if (fixture == "llama2-tiny") {  // the old format: no hf_config
      auto j = nlohmann::json::parse(std::ifstream(dir.path / "packed" / "config.json"));
      ASSERT_TRUE(j.contains("hf_config"));
      j.erase("hf_config");
      std::ofstream(dir.path / "packed" / "config.json") << j.dump(2);
    }
    auto loaded = lg::load_packed(dir.path / "packed", torch::kCPU, torch::kFloat32);
    EXPECT_EQ(loaded.hf_config.has_value(), fixture == "llama3-tiny");
    EXPECT_EQ(nn::network_difference(loaded.model->config, r.model->config), "") << fixture;
    lg::round_dense_to_half(loaded.model);
    const fs::path out = dir.path / "export";
    lg::export_hf_gptq(out, lg::hf_gptq_model(loaded.model, loaded.layers, loaded.spec, loaded.hf_config), false);

    const io::HfGptqModel file = io::load_hf_gptq(out);
    expect_same_layers(file.layers, r.q.layers, fixture);
    EXPECT_EQ(nn::network_difference(nn::from_hf_config(file.config), r.model->config), "") << fixture;
    EXPECT_EQ(file.quant.bits, 4);
    EXPECT_TRUE(file.quant.desc_act);
    Llama back = nn::load_hf_gptq_llama(out);
    const double rel = rel_err(logits_of(back, r.x), logits_of(loaded.model, r.x));
    std::printf("[ measured ] %s: converted export's logits vs the packed model's: %.3g\n", fixture.c_str(), rel);
    EXPECT_LE(rel, 1e-6) << fixture;
    EXPECT_LE(rel_err(logits_of(loaded.model, r.x), logits_of(r.model, r.x)), 1e-6) << fixture << ": the packed model is the quantized one";
  }
}

// GPTQ calibrates each block on the inputs the model's own forward gives it, RoPE scaling included (llama3-tiny's
// llama3 RoPE): block1.attn.q quantized by lg::quantize equals nn::gptq_quantize on the Hessian captured through the
// whole model's forward, with block 0 holding quantize's dequantized weights, bit for bit.
TEST(LlamaGptqHf, CalibratesOnTheModelsOwnForward) {
  TempDir dir;
  write_shards(dir.path / "shards", 288);
  const fs::path fixture = kFixtures / "llama3-tiny";
  const auto shards = squeeze::llama::open_shards(dir.path / "shards", 288, "llama3-tiny", 1, 1, kSeq, 7, 0, 1);
  const auto calib = lg::make_calibration(lg::shard_windows(*shards.train, 0, 16, torch::kCPU).first, 8, torch::kCPU);
  lg::QuantSpec spec;
  spec.bits = 4, spec.group_size = 32, spec.act_order = true;
  Llama m = nn::load_hf_llama(fixture, {.dtype = torch::kFloat32});
  ASSERT_NE(m->config.rope_scaling.type, squeeze::plan::RopeType::Default) << "the case needs a scaled RoPE";
  const auto q = lg::quantize(m, spec, calib);

  Llama ref = nn::load_hf_llama(fixture, {.dtype = torch::kFloat32});
  ref->eval();
  torch::NoGradGuard ng;
  for (const auto& path : lg::block_linears()) {
    const auto& p = q.layers.at(lg::layer_name(0, path));
    const std::vector<float> w = squeeze::quant::dequantize(p);
    lg::dense_weight(ref, 0, path).copy_(torch::from_blob(const_cast<float*>(w.data()), {p.out, p.in}, torch::kFloat32));
  }
  const torch::Tensor W = lg::dense_weight(ref, 1, "attn.q").clone();
  auto [parent, child] = lg::parent_of(ref, 1, "attn.q");
  lg::CaptureLinear capture(W.clone());
  parent->replace_module(child, capture);
  squeeze::nn::GptqOptions opt;
  opt.bits = spec.bits, opt.group_size = spec.group_size, opt.sym = spec.sym, opt.act_order = spec.act_order, opt.percdamp = spec.percdamp;
  squeeze::nn::HessianCapture hessians({{"block1.attn.q", capture->linear}});
  for (const auto& ids : calib.ids) (void)ref->forward(ids);
  const squeeze::quant::PackedLinear want = squeeze::nn::gptq_quantize(W, hessians.at("block1.attn.q").matrix(), opt).pack();
  expect_same_layers({{"block1.attn.q", q.layers.at("block1.attn.q")}}, {{"block1.attn.q", want}}, "block1.attn.q");
}

// Bad requests fail with messages that say what was wrong, and a refused or failed export leaves the target as it was.
TEST(LlamaGptqHf, BadRequestsGiveClearErrorsAndLeaveNothingHalfWritten) {
  using M = lg::Method;
  EXPECT_TRUE(has(error_of([] { lg::check_single_export({4, 3}, {128}, {M::GPTQ}); }), "--bits asks for 2 bit widths"));
  EXPECT_TRUE(has(error_of([] { lg::check_single_export({4}, {128, 0}, {M::GPTQ}); }), "--group asks for 2 group sizes"));
  EXPECT_TRUE(has(error_of([] { lg::check_single_export({4}, {128}, {M::RTN, M::GPTQ}); }), "--methods asks for 2 methods"));
  EXPECT_EQ(error_of([] { lg::check_single_export({4}, {128}, {M::GPTQ}); }), "(no error)");

  TempDir dir;
  const fs::path out = dir.path / "out";
  EXPECT_EQ(error_of([&] { lg::check_export_target(out, false); }), "(no error)") << "absent";
  fs::create_directories(out);
  EXPECT_EQ(error_of([&] { lg::check_export_target(out, false); }), "(no error)") << "empty";
  std::ofstream(out / "keep.txt") << "an earlier export";
  const std::string e = error_of([&] { lg::check_export_target(out, false); });
  EXPECT_TRUE(has(e, out.string()) && has(e, "exists and is not empty; pass --force")) << e;
  EXPECT_EQ(error_of([&] { lg::check_export_target(out, true); }), "(no error)");
  std::ofstream(dir.path / "file") << "x";
  EXPECT_TRUE(has(error_of([&] { lg::check_export_target(dir.path / "file", true); }), "exists and is not a directory"));

  write_shards(dir.path / "shards", 288);
  Quantized r = quantize_fixture("llama2-tiny", dir.path / "shards", 4, false);
  const io::HfGptqModel m = lg::hf_gptq_model(r.model, r.q.layers, r.spec, r.source);
  // refused: out is not empty and there is no --force
  EXPECT_TRUE(has(error_of([&] { lg::export_hf_gptq(out, m, false); }), "pass --force"));
  EXPECT_TRUE(fs::exists(out / "keep.txt") && !fs::exists(out / "config.json"));
  // failed while writing (a layer missing): out as it was, no temporary directory left, also under --force
  io::HfGptqModel broken = m;
  broken.layers.erase("block1.mlp.down");
  const std::string w = error_of([&] { lg::export_hf_gptq(out, broken, true); });
  EXPECT_TRUE(has(w, "block1.mlp.down")) << w;
  EXPECT_TRUE(fs::exists(out / "keep.txt") && !fs::exists(out / "config.json"));
  EXPECT_EQ(leftovers(dir.path), 0);
  EXPECT_TRUE(has(error_of([&] { lg::export_hf_gptq(dir.path / "new", broken, false); }), "block1.mlp.down"));
  EXPECT_FALSE(fs::exists(dir.path / "new"));
  // --force replaces a non-empty out once the new export is whole
  lg::export_hf_gptq(out, m, true);
  EXPECT_FALSE(fs::exists(out / "keep.txt"));
  EXPECT_TRUE(fs::exists(out / "config.json") && fs::exists(out / "quantize_config.json"));
  EXPECT_EQ(leftovers(dir.path), 0);

  // a shard id outside the model's vocabulary: the error names the file, the id and the vocabulary
  write_shards(dir.path / "bad", 288, 288);
  const std::string v =
      error_of([&] { (void)squeeze::llama::open_shards(dir.path / "bad", 288, "--hf llama2-tiny", 1, 1, kSeq, 7, 0, 1); });
  EXPECT_TRUE(has(v, (dir.path / "bad" / "val_000000.bin").string()) && has(v, "token 288") && has(v, "outside the vocabulary of 288"))
      << v;
}

TEST(LlamaGptqHf, WritesFilesForTheNumpyCheck) {
  const char* env = std::getenv("SQUEEZE_GPTQ_HF_DIR");
  if (!env) GTEST_SKIP() << "set SQUEEZE_GPTQ_HF_DIR to write the files ctest's llama_gptq_hf_numpy_gptq and llama_gptq.hf.* read";
  const fs::path root = env;
  write_shards(root / "shards", 288);
  write_shards(root / "shards-bad", 288, 288);
  struct Case {
    std::string name, fixture;
    int bits;
    bool act_order;
  };
  for (const Case& k : {Case{"llama2-gptq-w4-g32-actorder", "llama2-tiny", 4, true}, Case{"llama3-gptq-w3-g32", "llama3-tiny", 3, false}}) {
    Quantized r = quantize_fixture(k.fixture, root / "shards", k.bits, k.act_order);
    squeeze::io::remove_tree(root / k.name);
    lg::export_hf_gptq(root / k.name, lg::hf_gptq_model(r.model, r.q.layers, r.spec, r.source), false);
    // the in-memory model's weights as squeeze dequantizes them, and its dense tensors
    const nn::LlamaConfig& c = r.model->config;
    const auto source = [&](const std::string& name) -> torch::Tensor {
      const std::string module = name.substr(0, name.size() - 7);  // "block0.attn.q.weight" -> "block0.attn.q"
      if (const auto it = r.q.layers.find(module); it != r.q.layers.end()) {
        const std::vector<float> w = squeeze::quant::dequantize(it->second);
        return torch::from_blob(const_cast<float*>(w.data()), {it->second.out, it->second.in}, torch::kFloat32).clone();
      }
      return r.model->named_parameters()[name].detach().to(torch::kFloat32).clone();
    };
    squeeze::io::remove_tree(root / (k.name + "-dequantized"));
    nn::save_hf_llama(c, source, root / (k.name + "-dequantized"),
                      {.dtype = io::DType::F32, .max_shard_bytes = 0, .source_config = r.source});
    std::printf("wrote %s and %s-dequantized\n", (root / k.name).c_str(), k.name.c_str());
  }
}
