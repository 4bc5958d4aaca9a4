// The Hugging Face <-> nn::Llama name table both ways, tied embeddings, the checkpoint check (missing /
// unexpected / wrong shape, named), and the RoPE row order.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <squeeze/io/hf_names.hpp>

#include "io_test_util.hpp"

using namespace squeeze;
using io_test::expect_error;

namespace {

// A small LLaMA-3-style geometry: GQA and head_dim != hidden / heads.
io::LlamaConfig small(bool tied) {
  io::LlamaConfig c;
  c.vocab_size = 100, c.hidden_size = 32, c.intermediate_size = 88, c.num_hidden_layers = 2;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 16, c.tie_word_embeddings = tied;
  return c;
}

std::map<std::string, std::vector<std::int64_t>> complete(const io::LlamaConfig& c) {
  std::map<std::string, std::vector<std::int64_t>> m;
  for (const auto& e : io::hf_checkpoint_tensors(c)) m[e.hf] = e.shape;
  return m;
}

}  // namespace

TEST(HfNames, TableCoversLlamaBothWays) {
  const auto c = small(false);
  const auto t = io::hf_checkpoint_tensors(c);
  ASSERT_EQ(t.size(), 1u + 9u * 2u + 2u);
  EXPECT_EQ(t.front().hf, "model.embed_tokens.weight");
  EXPECT_EQ(t.back().hf, "lm_head.weight");
  std::set<std::string> hf, sq;
  for (const auto& e : t) {
    EXPECT_TRUE(hf.insert(e.hf).second) << e.hf;
    EXPECT_TRUE(sq.insert(e.squeeze).second) << e.squeeze;
    EXPECT_EQ(io::squeeze_name(e.hf, c), e.squeeze);
    EXPECT_EQ(io::hf_name(e.squeeze, c), e.hf);
  }
  // nn::Llama's parameter names (registered as embed, block{i}.{attn_norm, attn.{q,k,v,o}, mlp_norm,
  // mlp.{gate,up,down}}, norm, head in nn/llama.hpp)
  const std::set<std::string> want = {"embed.weight",
                                      "norm.weight",
                                      "head.weight",
                                      "block0.attn_norm.weight",
                                      "block0.attn.q.weight",
                                      "block0.attn.k.weight",
                                      "block0.attn.v.weight",
                                      "block0.attn.o.weight",
                                      "block0.mlp_norm.weight",
                                      "block0.mlp.gate.weight",
                                      "block0.mlp.up.weight",
                                      "block0.mlp.down.weight",
                                      "block1.attn_norm.weight",
                                      "block1.attn.q.weight",
                                      "block1.attn.k.weight",
                                      "block1.attn.v.weight",
                                      "block1.attn.o.weight",
                                      "block1.mlp_norm.weight",
                                      "block1.mlp.gate.weight",
                                      "block1.mlp.up.weight",
                                      "block1.mlp.down.weight"};
  EXPECT_EQ(sq, want);

  EXPECT_EQ(io::squeeze_name("model.layers.1.self_attn.k_proj.weight", c), "block1.attn.k.weight");
  EXPECT_EQ(io::squeeze_name("model.layers.0.post_attention_layernorm.weight", c), "block0.mlp_norm.weight");
  EXPECT_EQ(io::squeeze_name("model.layers.0.input_layernorm.weight", c), "block0.attn_norm.weight");
  EXPECT_EQ(io::hf_name("block1.mlp.down.weight", c), "model.layers.1.mlp.down_proj.weight");
  EXPECT_EQ(io::hf_name("head.weight", c), "lm_head.weight");
}

TEST(HfNames, ShapesFollowTheConfig) {
  const auto c = small(false);
  std::map<std::string, std::vector<std::int64_t>> s;
  for (const auto& e : io::hf_checkpoint_tensors(c)) s[e.hf] = e.shape;
  using V = std::vector<std::int64_t>;
  EXPECT_EQ(s["model.embed_tokens.weight"], (V{100, 32}));
  EXPECT_EQ(s["model.layers.0.self_attn.q_proj.weight"], (V{64, 32}));  // heads * head_dim = 4 * 16 != hidden
  EXPECT_EQ(s["model.layers.0.self_attn.k_proj.weight"], (V{32, 32}));  // kv_heads * head_dim
  EXPECT_EQ(s["model.layers.0.self_attn.v_proj.weight"], (V{32, 32}));
  EXPECT_EQ(s["model.layers.0.self_attn.o_proj.weight"], (V{32, 64}));
  EXPECT_EQ(s["model.layers.1.mlp.gate_proj.weight"], (V{88, 32}));
  EXPECT_EQ(s["model.layers.1.mlp.up_proj.weight"], (V{88, 32}));
  EXPECT_EQ(s["model.layers.1.mlp.down_proj.weight"], (V{32, 88}));
  EXPECT_EQ(s["model.layers.1.input_layernorm.weight"], (V{32}));
  EXPECT_EQ(s["model.norm.weight"], (V{32}));
  EXPECT_EQ(s["lm_head.weight"], (V{100, 32}));
}

TEST(HfNames, TiedEmbeddings) {
  const auto c = small(true);
  const auto t = io::hf_checkpoint_tensors(c);
  EXPECT_EQ(t.size(), 1u + 9u * 2u + 1u);
  for (const auto& e : t) EXPECT_NE(e.hf, "lm_head.weight");
  EXPECT_EQ(io::squeeze_names_for("model.embed_tokens.weight", c), (std::vector<std::string>{"embed.weight", "head.weight"}));
  EXPECT_EQ(io::squeeze_name("model.embed_tokens.weight", c), "embed.weight");
  EXPECT_EQ(io::hf_name("head.weight", c), std::nullopt);  // not exported under a tied config
  EXPECT_EQ(io::hf_name("embed.weight", c), "model.embed_tokens.weight");
  expect_error([&] { io::squeeze_names_for("lm_head.weight", c); }, {"'lm_head.weight'", "tie_word_embeddings"});
  // every nn::Llama parameter has a source; head.weight's is the embedding
  const auto p = io::squeeze_parameters(c);
  EXPECT_EQ(p.size(), t.size() + 1);
  EXPECT_EQ(p.back().squeeze, "head.weight");
  EXPECT_EQ(p.back().hf, "model.embed_tokens.weight");
  EXPECT_EQ(p.back().shape, (std::vector<std::int64_t>{100, 32}));
  // untied: a checkpoint must have lm_head; tied: it must not
  auto m = complete(small(false));
  EXPECT_TRUE(io::check_hf_tensors(m, small(false)).ok());
  const auto r = io::check_hf_tensors(m, c);
  EXPECT_EQ(r.unexpected, std::vector<std::string>{"lm_head.weight"});
  m.erase("lm_head.weight");
  EXPECT_TRUE(io::check_hf_tensors(m, c).ok());
  EXPECT_EQ(io::check_hf_tensors(m, small(false)).missing, std::vector<std::string>{"lm_head.weight"});
}

TEST(HfNames, NamesOutsideTheTableAreRefused) {
  const auto c = small(false);
  expect_error([&] { io::squeeze_name("model.layers.2.mlp.up_proj.weight", c); },
               {"'model.layers.2.mlp.up_proj.weight'", "layer 2", "2 layers"});
  expect_error([&] { io::squeeze_name("model.layers.0.self_attn.q_proj.bias", c); },
               {"'model.layers.0.self_attn.q_proj.bias'", "not part"});
  expect_error([&] { io::squeeze_name("model.layers.01.mlp.up_proj.weight", c); }, {"layers.01"});
  expect_error([&] { io::squeeze_name("model.layers..mlp.up_proj.weight", c); }, {"not part"});
  expect_error([&] { io::squeeze_name("layers.0.mlp.up_proj.weight", c); }, {"not part"});  // a LlamaModel (no "model." prefix)
  expect_error([&] { io::hf_name("block0.attn.qkv.weight", c); }, {"'block0.attn.qkv.weight'", "no Hugging Face name"});
  expect_error([&] { io::hf_name("block7.attn.q.weight", c); }, {"layer 7"});
}

TEST(HfNames, CheckpointCheckNamesEveryProblem) {
  const auto c = small(false);
  auto m = complete(c);
  EXPECT_TRUE(io::check_hf_tensors(m, c).ok());
  m.erase("model.layers.1.mlp.up_proj.weight");
  m["model.layers.0.self_attn.q_proj.bias"] = {64};
  m["model.layers.0.self_attn.k_proj.weight"] = {64, 32};
  m["model.layers.0.self_attn.rotary_emb.inv_freq"] = {8};  // older exports carry it: not a weight
  const auto r = io::check_hf_tensors(m, c);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.missing, std::vector<std::string>{"model.layers.1.mlp.up_proj.weight"});
  EXPECT_EQ(r.unexpected, std::vector<std::string>{"model.layers.0.self_attn.q_proj.bias"});
  ASSERT_EQ(r.wrong_shape.size(), 1u);
  EXPECT_EQ(r.wrong_shape[0], "model.layers.0.self_attn.k_proj.weight: [64, 32] in the checkpoint, [32, 32] expected");
  EXPECT_EQ(r.ignored, std::vector<std::string>{"model.layers.0.self_attn.rotary_emb.inv_freq"});
  expect_error([&] { r.require_ok("/models/x"); }, {"/models/x", "missing tensors 'model.layers.1.mlp.up_proj.weight'",
                                                    "unexpected tensors 'model.layers.0.self_attn.q_proj.bias'",
                                                    "wrong shapes 'model.layers.0.self_attn.k_proj.weight: [64, 32]"});
  // a long list is cut, with the count of the rest
  const auto none = io::check_hf_tensors({}, c);
  EXPECT_EQ(none.missing.size(), 21u);
  expect_error([&] { none.require_ok("empty"); }, {"and 13 more"});
}

TEST(RopeLayout, HuggingFaceAndSqueezeAgreeSoLoadingPermutesNothing) {
  EXPECT_EQ(io::kHfRopeLayout, io::kSqueezeRopeLayout);
  const auto p = io::rope_row_permutation(3, 8, io::kHfRopeLayout, io::kSqueezeRopeLayout);
  std::vector<std::int64_t> id(24);
  std::iota(id.begin(), id.end(), 0);
  EXPECT_EQ(p, id);
}

TEST(RopeLayout, InterleavedToRotateHalfAndBack) {
  const auto to_half = io::rope_row_permutation(2, 8, io::RopeLayout::Interleaved, io::RopeLayout::RotateHalf);
  EXPECT_EQ(to_half, (std::vector<std::int64_t>{0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15}));
  const auto to_inter = io::rope_row_permutation(2, 8, io::RopeLayout::RotateHalf, io::RopeLayout::Interleaved);
  EXPECT_EQ(to_inter, (std::vector<std::int64_t>{0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15}));
  for (std::size_t i = 0; i < to_half.size(); ++i) EXPECT_EQ(to_inter[std::size_t(to_half[i])], std::int64_t(i));  // inverses
  expect_error([] { io::rope_row_permutation(2, 7, io::RopeLayout::Interleaved, io::RopeLayout::RotateHalf); }, {"even"});
}

// The permutation is what makes the two RoPE conventions compute the same thing: rotating Meta's interleaved
// pairs of a projection's output equals rotating the rotate-half pairs (nn::Llama's apply_rope: x cos +
// rotate_half(x) sin, the D/2 angles repeated) of the output of the row-permuted weight.
TEST(RopeLayout, PermutedWeightsGiveTheSameRotatedQueries) {
  const std::int64_t heads = 2, D = 8, in = 5, pos = 7;
  std::mt19937 rng(3);
  std::normal_distribution<double> nd;
  std::vector<double> w(std::size_t(heads * D * in)), x(static_cast<std::size_t>(in));
  for (auto& v : w) v = nd(rng);
  for (auto& v : x) v = nd(rng);
  const auto freq = plan::rope_inv_freq(D, 10000.0, {});
  auto project = [&](const std::vector<double>& m) {
    std::vector<double> y(std::size_t(heads * D), 0.0);
    for (std::int64_t r = 0; r < heads * D; ++r)
      for (std::int64_t k = 0; k < in; ++k) y[std::size_t(r)] += m[std::size_t(r * in + k)] * x[std::size_t(k)];
    return y;
  };
  // Meta: pairs (2m, 2m + 1) rotated by pos * freq[m]
  auto y = project(w);
  std::vector<double> meta(y.size());
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t m = 0; m < D / 2; ++m) {
      const double a = double(pos) * freq[std::size_t(m)], c = std::cos(a), s = std::sin(a);
      const double x0 = y[std::size_t(h * D + 2 * m)], x1 = y[std::size_t(h * D + 2 * m + 1)];
      meta[std::size_t(h * D + 2 * m)] = x0 * c - x1 * s;
      meta[std::size_t(h * D + 2 * m + 1)] = x0 * s + x1 * c;
    }
  // rotate-half on the permuted weight's output, written as nn::Llama's apply_rope computes it
  const auto perm = io::rope_row_permutation(heads, D, io::RopeLayout::Interleaved, io::RopeLayout::RotateHalf);
  const auto wp = io::permute_rows<double>(w, heads * D, in, perm);
  const auto z = project(wp);
  std::vector<double> half(z.size());
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t j = 0; j < D; ++j) {
      const double a = double(pos) * freq[std::size_t(j % (D / 2))];
      const double rot = j < D / 2 ? -z[std::size_t(h * D + j + D / 2)] : z[std::size_t(h * D + j - D / 2)];
      half[std::size_t(h * D + j)] = z[std::size_t(h * D + j)] * std::cos(a) + rot * std::sin(a);
    }
  // the same values, in the rotate-half order
  const auto meta_in_half_order = io::permute_rows<double>(meta, heads * D, 1, perm);
  for (std::size_t i = 0; i < half.size(); ++i) EXPECT_NEAR(half[i], meta_in_half_order[i], 1e-12) << i;
}

TEST(RopeLayout, PermuteRowsChecksItsArguments) {
  const std::vector<int> m = {1, 2, 3, 4, 5, 6};
  EXPECT_EQ(io::permute_rows<int>(m, 3, 2, std::vector<std::int64_t>{2, 0, 1}), (std::vector<int>{5, 6, 1, 2, 3, 4}));
  expect_error([&] { io::permute_rows<int>(m, 2, 2, std::vector<std::int64_t>{0, 1}); }, {"permute_rows"});
  expect_error([&] { io::permute_rows<int>(m, 3, 2, std::vector<std::int64_t>{0, 1, 3}); }, {"out of range"});
}
