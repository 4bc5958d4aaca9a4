#pragma once
// LLaMA-family geometry and parameter counts. Per block: RMSNorm (attn) -> q,k,v (GQA: k,v have
// kv_heads * head_dim outputs) -> RoPE -> fused attention -> o -> RMSNorm (mlp) -> SwiGLU (gate, up, down).
#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

namespace squeeze::plan {

using i64 = std::int64_t;

struct ModelShape {
  i64 vocab = 32000;
  i64 hidden = 4096;
  i64 layers = 32;
  i64 heads = 32;
  i64 kv_heads = 32;
  i64 ffn = 11008;
  bool tied_embeddings = false;
  // 0: hidden / heads. Hugging Face configs may set head_dim apart from it (q then has heads * head_dim
  // outputs, not hidden).
  i64 explicit_head_dim = 0;

  constexpr i64 head_dim() const { return explicit_head_dim != 0 ? explicit_head_dim : hidden / heads; }
  constexpr i64 q_dim() const { return heads * head_dim(); }
  constexpr i64 kv_dim() const { return kv_heads * head_dim(); }

  // The seven linear layers of a block as (in, out): q, k, v, o, gate, up, down.
  struct Linear {
    i64 in, out;
  };
  constexpr std::array<Linear, 7> block_linears() const {
    return {{{hidden, q_dim()}, {hidden, kv_dim()}, {hidden, kv_dim()}, {q_dim(), hidden}, {hidden, ffn}, {hidden, ffn}, {ffn, hidden}}};
  }
  constexpr i64 block_linear_params() const {
    i64 n = 0;
    for (auto l : block_linears()) n += l.in * l.out;
    return n;
  }
  constexpr i64 block_params() const { return block_linear_params() + 2 * hidden; }  // + two RMSNorm gains
  constexpr i64 embedding_params() const { return vocab * hidden; }
  constexpr i64 head_params() const { return tied_embeddings ? 0 : vocab * hidden; }
  // Weights that stay in high precision under weight quantization: embedding, head, norms.
  constexpr i64 unquantized_params() const { return embedding_params() + head_params() + layers * 2 * hidden + hidden; }
  constexpr i64 params() const { return layers * block_linear_params() + unquantized_params(); }
  // Largest single tensor group moved at once by a stage-3 gather: a block, or the embedding/head.
  constexpr i64 largest_gather_params() const { return block_params() > embedding_params() ? block_params() : embedding_params(); }
};

struct Preset {
  std::string_view name;
  ModelShape shape;
};

// Published geometries (vocab, hidden, layers, heads, kv_heads, ffn). llama-175b is GPT-3's width and depth as a
// LLaMA (SwiGLU at 8/3 of hidden, its vocabulary), for planning a model of that size.
inline constexpr Preset presets[] = {
    {"llama-7b", {32000, 4096, 32, 32, 32, 11008}},  {"llama-13b", {32000, 5120, 40, 40, 40, 13824}},
    {"llama-70b", {32000, 8192, 80, 64, 8, 28672}},  {"llama-175b", {32000, 12288, 96, 96, 96, 32768}},
    {"llama3-8b", {128256, 4096, 32, 32, 8, 14336}}, {"tinyllama-1.1b", {32000, 2048, 22, 32, 4, 5632}},
};

constexpr std::optional<ModelShape> find_preset(std::string_view name) {
  for (const auto& p : presets)
    if (p.name == name) return p.shape;
  return std::nullopt;
}

static_assert(find_preset("llama-7b")->params() == 6'738'415'616, "LLaMA-7B has 6,738,415,616 parameters");
static_assert(find_preset("tinyllama-1.1b")->params() == 1'100'048'384, "TinyLlama-1.1B has 1,100,048,384 parameters");
static_assert(find_preset("llama-13b")->params() == 13'015'864'320, "LLaMA-13B has 13,015,864,320 parameters");
static_assert(find_preset("llama-70b")->params() == 68'976'648'192, "LLaMA-2-70B has 68,976,648,192 parameters");
static_assert(find_preset("llama3-8b")->params() == 8'030'261'248, "Llama-3-8B has 8,030,261,248 parameters");
static_assert(find_preset("llama-175b")->params() > 166'250'000'000 && find_preset("llama-175b")->params() < 183'750'000'000,
              "llama-175b is within 5% of 175 G parameters");

}  // namespace squeeze::plan
