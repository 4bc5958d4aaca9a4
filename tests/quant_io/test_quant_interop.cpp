// Quantized checkpoints for the real clients, and files the real clients wrote (libtorch, CPU).
//
// QuantInterop.WritesFilesForRealClients (skipped unless $SQUEEZE_INTEROP_DIR is set) writes there what
// tools/check_quant_interop.py hands to transformers, bitsandbytes and its GPTQ reimplementation: llama2-tiny
// (tests/fixtures/hf) quantized three ways, each read back by squeeze and written again dequantized (fp32) beside it,
//   bnb-nf4/     NF4 with DoubleQuant (bitsandbytes' nesting), blocksize 64, quant-state dtype and compute dtype float32,
//                embeddings / norms / lm_head fp32
//   gptq-4bit/   4 bits, group 128, asymmetric; in block0.mlp.down every 5th output row is made non-negative, so its
//                groups get the zero point 0 GPTQ's own grid gives them (v1 stores 0 - 1: a borrow across fields)
//   gptq-3bit/   3 bits, group 128, desc_act with a shuffled g_idx in every mlp.down (act-order)
//   <case>-dequantized/           squeeze's reading of <case>/, dequantized: a dense fp32 LLaMA directory
//   squeeze_quant_logits.safetensors   input_ids [2, 11] (the fixture's) and <case>_logits [2, 11, 288] of the
//                                      dequantized model by nn::Llama, with <case>_reference_logits of the fp32
//                                      weights that were quantized.
// Here: the read-back layers equal the written ones (dequantized bit for bit), and the quantized model's logits
// stay near the unquantized ones: rel = max |diff| / max |ref| <= 0.4, measured 0.14 (NF4), 0.11 (GPTQ 4 bits),
// 0.27 (GPTQ 3 bits) on this random 2-layer model; a misread code or zero point would not stay near.
//
// QuantInterop.ReadsFilesFromRealClients reads bnb_nf4.safetensors that check_quant_interop.py wrote with
// bitsandbytes ($SQUEEZE_INTEROP_READ_DIR, else tests/fixtures/quant/bnb when present): per weight `w` the
// Linear4bit keys (w.weight, w.weight.absmax, ..., w.weight.quant_state.bitsandbytes__nf4), bitsandbytes'
// dequantize_4bit (w.dequantized, fp32) and the weights it quantized (w.original). squeeze's reader must give
// bitsandbytes' values bit for bit; squeeze's quantizer (io::bnb_nf4_quantize) is compared code by code.
#include <gtest/gtest.h>
#include <unistd.h>
#include <torch/torch.h>

#include <squeeze/io/hf_bnb.hpp>
#include <squeeze/io/hf_gptq.hpp>
#include <squeeze/io/posix_file.hpp>
#include <squeeze/nn/hf_llama.hpp>
#include <squeeze/nn/hf_quantized.hpp>
#include <squeeze/nn/lora.hpp>
#include <squeeze/policy/strategy.hpp>
#include <squeeze/quant/rtn.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace squeeze;
namespace fs = std::filesystem;

const bool one_thread = (torch::set_num_threads(1), true);
const fs::path kFixture = fs::path(SQUEEZE_HF_FIXTURES) / "llama2-tiny";
const fs::path kQuantFixtures = SQUEEZE_QUANT_FIXTURES;

using Weights = std::map<std::string, std::vector<float>>;  // squeeze parameter names -> values

double rel_err(const torch::Tensor& got, const torch::Tensor& ref) {
  const torch::Tensor r = ref.to(torch::kFloat64);
  return (got.to(torch::kFloat64) - r).abs().max().item<double>() / r.abs().max().item<double>();
}

torch::Tensor tensor_of(const io::SafetensorsFile& f, const std::string& name) {
  const auto& info = f.info(name);
  torch::Tensor t = torch::empty(info.shape, info.dtype == io::DType::I64 ? torch::kLong : torch::kFloat32);
  const auto b = f.bytes(name);
  std::memcpy(t.data_ptr(), b.data(), b.size());
  return t;
}

Weights read_weights(const fs::path& dir, const io::LlamaConfig& c) {
  const auto ck = io::SafetensorsCheckpoint::open(dir);
  Weights w;
  for (const auto& e : io::hf_checkpoint_tensors(c))
    if (!e.hf.empty()) w[e.squeeze] = ck.read_float(e.hf);
  return w;
}

// `w` as a dense fp32 Hugging Face directory, and its logits on `ids` by nn::Llama.
torch::Tensor save_dense_and_run(const fs::path& dir, const io::LlamaConfig& c, const Weights& w, const torch::Tensor& ids) {
  const auto source = [&](const std::string& name) {
    auto& v = w.at(name);
    std::vector<int64_t> shape;
    for (const auto& e : io::hf_checkpoint_tensors(c))
      if (e.squeeze == name) shape = e.shape;
    return torch::from_blob(const_cast<float*>(v.data()), shape, torch::kFloat32).clone();
  };
  nn::save_hf_llama(nn::from_hf_config(c), source, dir, {.dtype = io::DType::F32, .max_shard_bytes = 0, .source_config = c});
  nn::Llama m = nn::load_hf_llama(dir, {.dtype = torch::kFloat32});
  torch::NoGradGuard ng;
  m->eval();
  return m->forward(ids).to(torch::kFloat32).contiguous();
}

// W [out, in] on GPTQ's asymmetric grid, row i in group g_idx[i]. With `zero0`, a group of non-negative weights gets
// zero point 0 and scale max / maxq, as GPTQ's reference quantizer gives it (quant::find_grid moves it to 1).
quant::PackedLinear quantize_gptq(std::span<const float> w, int64_t out, int64_t in, int bits, int group, const std::vector<int32_t>& g_idx,
                                  bool zero0) {
  const int64_t groups = (in + group - 1) / group;
  const float maxq = float((1 << bits) - 1);
  std::vector<std::uint8_t> q(out * in), zeros(groups * out);
  std::vector<float> scales(groups * out);
  for (int64_t o = 0; o < out; ++o)
    for (int64_t g = 0; g < groups; ++g) {
      float lo = INFINITY, hi = -INFINITY;
      for (int64_t i = 0; i < in; ++i)
        if (g_idx[i] == g) lo = std::min(lo, w[o * in + i]), hi = std::max(hi, w[o * in + i]);
      quant::Grid grid = quant::find_grid(lo, hi, bits, /*sym=*/false);
      if (zero0 && lo >= 0.f && hi > 0.f) grid = {quant::round_to_half(hi / maxq), 0};
      for (int64_t i = 0; i < in; ++i)
        if (g_idx[i] == g) q[o * in + i] = std::uint8_t(quant::quantize_code(w[o * in + i], grid, bits));
      zeros[g * out + o] = std::uint8_t(grid.zero);
      scales[g * out + o] = grid.scale;
    }
  return quant::pack(q, zeros, scales, g_idx, out, in, bits, group);
}

struct Case {
  std::string name;
  torch::Tensor logits, reference;
};

}  // namespace

// The checks both quantized loaders share: `layers` projections of type Layer, logits within 1e-5 of `reference`
// (printed as `what`), and apply_lora<S> adopting q and v with the output unchanged at initialisation.
template <class Layer, class S>
void expect_quantized_llama(nn::Llama& q, int64_t layers, const torch::Tensor& ids, const torch::Tensor& reference,
                            const std::string& what) {
  int count = 0;
  for (const auto& mod : q->modules()) count += std::dynamic_pointer_cast<Layer>(mod) != nullptr;
  EXPECT_EQ(count, 7 * layers) << what;
  torch::NoGradGuard ng;
  q->eval();
  const torch::Tensor logits = q->forward(ids).to(torch::kFloat32);
  const double rel = rel_err(logits, reference);
  std::printf("[ measured ] %s: logits vs the dense model on the same dequantized weights %.3g\n", what.c_str(), rel);
  EXPECT_LE(rel, 1e-5) << what;
  const auto adapted = nn::apply_lora<S>(*q);
  EXPECT_EQ(int64_t(adapted.size()), 2 * layers) << what << ": q and v of every block";
  q->eval();
  EXPECT_TRUE(torch::equal(q->forward(ids).to(torch::kFloat32), logits)) << what << ": B = 0, the adapted model is its base";
}

// A GPTQ directory in the Hugging Face layout (4-bit g128, zero points of 0 included, act-order at 3 bits) loads
// into nn::Llama with every block projection an nn::QuantizedLinear: its fp32 logits are the dense model's on the
// dequantized weights (rel <= 1e-5; measured 0 on the CPU, whose path multiplies by the dequantized weights), and
// apply_lora adopts those layers as the frozen bases of a gptq4-lora model whose output at initialisation is the base's.
TEST(QuantInterop, GptqDirectoryLoadsIntoAQuantizedLlama) {
  const io::LlamaConfig c = io::load_llama_config(kFixture);
  const Weights fp32 = read_weights(kFixture, c);
  const auto expected = io::SafetensorsFile::open(kFixture / "expected.safetensors");
  const torch::Tensor ids = tensor_of(expected, "input_ids").contiguous();  // [2, 11]
  const fs::path tmp = fs::temp_directory_path() / ("squeeze-gptq-load-" + std::to_string(::getpid()));
  squeeze::io::remove_tree(tmp);
  for (const int bits : {4, 3}) {
    io::HfGptqModel m{.config = c, .quant = {.bits = bits, .group_size = 128, .desc_act = bits == 3, .sym = false}};
    std::mt19937 rng(7 + bits);
    for (const auto& e : io::hf_checkpoint_tensors(c)) {
      if (!io::is_quantized_kind(e.kind)) {
        m.dense[e.squeeze] = fp32.at(e.squeeze);
        continue;
      }
      auto g_idx = quant::default_g_idx(e.shape[1], 128);
      if (bits == 3 && e.kind == io::ParamKind::Down) std::shuffle(g_idx.begin(), g_idx.end(), rng);
      m.layers[io::module_of(e.squeeze)] = quantize_gptq(fp32.at(e.squeeze), e.shape[0], e.shape[1], bits, 128, g_idx, bits == 4);
    }
    const fs::path dir = tmp / ("gptq-" + std::to_string(bits));
    io::save_hf_gptq(dir, m);
    const io::HfGptqModel back = io::load_hf_gptq(dir);
    Weights deq = back.dense;  // dense tensors as the file holds them (fp16)
    for (const auto& [name, layer] : back.layers) deq[name + ".weight"] = quant::dequantize(layer);
    const torch::Tensor reference = save_dense_and_run(tmp / ("dense-" + std::to_string(bits)), c, deq, ids);

    nn::Llama q = nn::load_hf_gptq_llama(dir);
    expect_quantized_llama<nn::QuantizedLinearImpl, Strategy<Quantized<4, RTN, Group<128>>, LoRA<4, 8>>>(
        q, c.num_hidden_layers, ids, reference, "gptq " + std::to_string(bits) + "-bit directory as QuantizedLinear layers");
  }
  squeeze::io::remove_tree(tmp);
}

// A bitsandbytes NF4 directory (nested statistics, as transformers writes load_in_4bit with double quant) loads into
// nn::Llama with every block projection an nn::Nf4Linear over bitsandbytes' codes and decoded block scales: its fp32
// logits are the dense model's on bitsandbytes' dequantization (rel <= 1e-5), and apply_lora adopts those layers as
// the frozen bases of a QLoRA model whose output at initialisation is the base's.
TEST(QuantInterop, BnbDirectoryLoadsIntoAnNf4Llama) {
  const io::LlamaConfig c = io::load_llama_config(kFixture);
  const Weights fp32 = read_weights(kFixture, c);
  const auto expected = io::SafetensorsFile::open(kFixture / "expected.safetensors");
  const torch::Tensor ids = tensor_of(expected, "input_ids").contiguous();  // [2, 11]
  const fs::path tmp = fs::temp_directory_path() / ("squeeze-bnb-load-" + std::to_string(::getpid()));
  squeeze::io::remove_tree(tmp);
  for (const bool nested : {true, false}) {
    io::HfBnbModel m{.config = c, .bnb = {.double_quant = nested, .compute_dtype = "float32"}};
    for (const auto& e : io::hf_checkpoint_tensors(c)) {
      if (io::is_quantized_kind(e.kind))
        m.layers[io::module_of(e.squeeze)] = io::bnb_nf4_quantize(fp32.at(e.squeeze), e.shape, nested, 64, "float32");
      else
        m.dense[e.squeeze] = fp32.at(e.squeeze);
    }
    const fs::path dir = tmp / (nested ? "nested" : "plain");
    io::save_hf_bnb(dir, m);
    const io::HfBnbModel back = io::load_hf_bnb(dir);
    Weights deq = back.dense;
    for (const auto& [name, layer] : back.layers) deq[name + ".weight"] = io::bnb_nf4_dequantize(layer);
    const torch::Tensor reference = save_dense_and_run(tmp / (nested ? "dense-nested" : "dense-plain"), c, deq, ids);

    nn::Llama q = nn::load_hf_bnb_llama(dir);
    expect_quantized_llama<nn::Nf4LinearImpl, Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<4, 8>>>(
        q, c.num_hidden_layers, ids, reference,
        std::string("bitsandbytes NF4 directory (") + (nested ? "nested" : "plain") + ") as Nf4Linear layers");
  }
  squeeze::io::remove_tree(tmp);
}

TEST(QuantInterop, WritesFilesForRealClients) {
  const char* env = std::getenv("SQUEEZE_INTEROP_DIR");
  if (!env) GTEST_SKIP() << "set SQUEEZE_INTEROP_DIR to write the files tools/check_quant_interop.py checks";
  const fs::path out = env;
  fs::create_directories(out);
  const io::LlamaConfig c = io::load_llama_config(kFixture);
  const Weights fp32 = read_weights(kFixture, c);
  const auto expected = io::SafetensorsFile::open(kFixture / "expected.safetensors");
  const torch::Tensor ids = tensor_of(expected, "input_ids").contiguous();  // [2, 11]
  const auto table = io::hf_checkpoint_tensors(c);
  std::vector<Case> cases;

  {  // bitsandbytes NF4 + DoubleQuant
    io::HfBnbModel m{.config = c, .bnb = {.double_quant = true, .compute_dtype = "float32"}};
    for (const auto& e : table) {
      if (io::is_quantized_kind(e.kind))
        m.layers[io::module_of(e.squeeze)] = io::bnb_nf4_quantize(fp32.at(e.squeeze), e.shape, /*nested=*/true, 64, "float32");
      else
        m.dense[e.squeeze] = fp32.at(e.squeeze);
    }
    io::save_hf_bnb(out / "bnb-nf4", m);
    const io::HfBnbModel back = io::load_hf_bnb(out / "bnb-nf4");
    Weights deq = back.dense;
    for (const auto& [name, layer] : back.layers) {
      deq[name + ".weight"] = io::bnb_nf4_dequantize(layer);
      EXPECT_EQ(deq[name + ".weight"], io::bnb_nf4_dequantize(m.layers.at(name))) << name;
    }
    EXPECT_EQ(back.dense, m.dense);
    cases.push_back({"bnb_nf4", save_dense_and_run(out / "bnb-nf4-dequantized", c, deq, ids),
                     save_dense_and_run(out / "bnb-nf4-reference", c, fp32, ids)});
  }

  for (const int bits : {4, 3}) {  // GPTQ, the v1 checkpoint format
    const bool act_order = bits == 3;
    io::HfGptqModel m{.config = c, .quant = {.bits = bits, .group_size = 128, .desc_act = act_order, .sym = false}};
    Weights ref = fp32;
    std::mt19937 rng(33 + bits);
    for (const auto& e : table) {
      if (!io::is_quantized_kind(e.kind)) {
        auto& v = m.dense[e.squeeze] = fp32.at(e.squeeze);
        for (auto& x : v) x = to_float(from_float<half>(x));  // the file holds them in fp16
        ref[e.squeeze] = v;
        continue;
      }
      const int64_t rows = e.shape[0], cols = e.shape[1];
      auto& w = ref[e.squeeze];
      const bool zero0 = bits == 4 && e.squeeze == "block0.mlp.down.weight";
      if (zero0)
        for (int64_t o = 0; o < rows; o += 5)
          for (int64_t i = 0; i < cols; ++i) w[o * cols + i] = std::fabs(w[o * cols + i]);
      auto g_idx = quant::default_g_idx(cols, 128);
      if (act_order && e.kind == io::ParamKind::Down) std::shuffle(g_idx.begin(), g_idx.end(), rng);
      m.layers[io::module_of(e.squeeze)] = quantize_gptq(w, rows, cols, bits, 128, g_idx, zero0);
    }
    const auto& down = m.layers.at("block0.mlp.down");
    if (bits == 4) EXPECT_EQ(down.zero(0, 0), 0u);  // the borrow case is in the file
    const std::string dir = "gptq-" + std::to_string(bits) + "bit";
    io::save_hf_gptq(out / dir, m);
    const io::HfGptqModel back = io::load_hf_gptq(out / dir);
    Weights deq = back.dense;
    for (const auto& [name, layer] : back.layers) {
      deq[name + ".weight"] = quant::dequantize(layer);
      EXPECT_EQ(deq[name + ".weight"], quant::dequantize(m.layers.at(name))) << dir << " " << name;
    }
    cases.push_back({"gptq_" + std::to_string(bits) + "bit", save_dense_and_run(out / (dir + "-dequantized"), c, deq, ids),
                     save_dense_and_run(out / (dir + "-reference"), c, ref, ids)});
  }

  std::map<std::string, io::TensorRef> file;
  const auto ref = [](const torch::Tensor& t, io::DType d) {
    return io::TensorRef{d, std::vector<int64_t>(t.sizes().begin(), t.sizes().end()),
                         std::span<const std::byte>(static_cast<const std::byte*>(t.data_ptr()), t.nbytes())};
  };
  file.emplace("input_ids", ref(ids, io::DType::I64));
  for (const auto& k : cases) {
    const double rel = rel_err(k.logits, k.reference);
    std::printf("[ measured ] %s: logits vs the unquantized weights' max|diff| / max|ref| = %.3g\n", k.name.c_str(), rel);
    EXPECT_LE(rel, 0.4) << k.name;  // quantization error; measured 0.14 (NF4), 0.11 (4 bits), 0.27 (3 bits)
    file.emplace(k.name + "_logits", ref(k.logits, io::DType::F32));
    file.emplace(k.name + "_reference_logits", ref(k.reference, io::DType::F32));
  }
  io::save_safetensors(out / "squeeze_quant_logits.safetensors", file);
}

TEST(QuantInterop, ReadsFilesFromRealClients) {
  const char* env = std::getenv("SQUEEZE_INTEROP_READ_DIR");
  const fs::path dir = env ? fs::path(env) : kQuantFixtures / "bnb";
  if (!fs::exists(dir / "bnb_nf4.safetensors"))
    GTEST_SKIP() << "no " << (dir / "bnb_nf4.safetensors") << ": tools/check_quant_interop.py writes it with bitsandbytes";
  const auto ck = io::SafetensorsCheckpoint::open_file(dir / "bnb_nf4.safetensors");
  const std::string key = std::string(".weight.") + io::kBnbNf4StateKey;
  int weights = 0;
  for (const auto& [name, _] : ck.tensors()) {
    if (!name.ends_with(key)) continue;
    const std::string module = name.substr(0, name.size() - key.size());
    ++weights;
    const io::BnbNf4Weight b = io::read_bnb_nf4(ck, module);
    const auto got = io::bnb_nf4_dequantize(b), want = ck.read_float(module + ".dequantized");
    ASSERT_EQ(got.size(), want.size()) << module;
    int64_t differ = 0;
    for (size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i];
    EXPECT_EQ(differ, 0) << module << ": values that differ from bitsandbytes' dequantize_4bit";

    if (!ck.contains(module + ".original")) continue;
    const auto mine =
        io::bnb_nf4_quantize(ck.read_float(module + ".original"), b.info.shape, b.info.nested, b.info.blocksize, b.info.dtype);
    int64_t codes = 0;
    for (int64_t i = 0; i < b.numel(); ++i)
      codes += kernels::quant::nf4_code_at(mine.codes.data(), i) != kernels::quant::nf4_code_at(b.codes.data(), i);
    std::printf("[ measured ] %s (%s): squeeze's codes differ from bitsandbytes' at %lld of %lld values\n", module.c_str(),
                b.info.nested ? "nested" : "plain", (long long)codes, (long long)b.numel());
    EXPECT_EQ(codes, 0) << module;  // w * (1 / absmax) against bitsandbytes' thresholds, as its kernel does
    if (!b.info.nested) {
      EXPECT_EQ(mine.absmax, b.absmax) << module;
      continue;
    }
    // DoubleQuant: squeeze's dynamic map is the one bitsandbytes computed and stored, entry for entry
    EXPECT_EQ(b.nested_quant_map, std::vector<float>(quant::bnb_dynamic_map().begin(), quant::bnb_dynamic_map().end())) << module;
    // the offset is a float32 mean (torch's summation order, ours in float64), the rest follows from it
    std::printf("[ measured ] %s: offset %.9g (bitsandbytes %.9g)\n", module.c_str(), mine.info.nested_offset, b.info.nested_offset);
    EXPECT_NEAR(mine.info.nested_offset, b.info.nested_offset, 2e-7 * std::fabs(b.info.nested_offset)) << module;
    if (mine.info.nested_offset == b.info.nested_offset) {
      EXPECT_EQ(mine.absmax_codes, b.absmax_codes) << module;
      EXPECT_EQ(mine.nested_absmax, b.nested_absmax) << module;
    }
  }
  EXPECT_GT(weights, 0) << "no bitsandbytes weights in " << ck.tensors().size() << " tensors";
}
