#pragma once
// The one table between Hugging Face LlamaForCausalLM tensor names and squeeze's nn::Llama parameter names
// (torch-free), with each tensor's shape for a config, and the RoPE row order of q/k.
//
//   Hugging Face                                   squeeze (nn::Llama named_parameters)   shape
//   model.embed_tokens.weight                      embed.weight                           [vocab, hidden]
//   model.layers.{i}.input_layernorm.weight        block{i}.attn_norm.weight              [hidden]
//   model.layers.{i}.self_attn.q_proj.weight       block{i}.attn.q.weight                 [heads * head_dim, hidden]
//   model.layers.{i}.self_attn.k_proj.weight       block{i}.attn.k.weight                 [kv_heads * head_dim, hidden]
//   model.layers.{i}.self_attn.v_proj.weight       block{i}.attn.v.weight                 [kv_heads * head_dim, hidden]
//   model.layers.{i}.self_attn.o_proj.weight       block{i}.attn.o.weight                 [hidden, heads * head_dim]
//   model.layers.{i}.post_attention_layernorm.weight  block{i}.mlp_norm.weight            [hidden]
//   model.layers.{i}.mlp.gate_proj.weight          block{i}.mlp.gate.weight               [intermediate, hidden]
//   model.layers.{i}.mlp.up_proj.weight            block{i}.mlp.up.weight                 [intermediate, hidden]
//   model.layers.{i}.mlp.down_proj.weight          block{i}.mlp.down.weight               [hidden, intermediate]
//   model.norm.weight                              norm.weight                            [hidden]
//   lm_head.weight                                 head.weight                            [vocab, hidden]
// Both store linear weights as [out, in], so no tensor is transposed.
//
// Tied embeddings (tie_word_embeddings): the checkpoint has no lm_head.weight; model.embed_tokens.weight
// fills both embed.weight and head.weight (nn::Llama's head is its own parameter), and head.weight has no
// Hugging Face name of its own: an exporter writing a tied config must check head == embed (or write an
// untied config with lm_head.weight), since training updates the two separately.
//
// RoPE layout: Hugging Face rotates the pairs (x_j, x_{j + D/2}) of each head ("rotate half"; its
// conversion script permuted Meta's original interleaved pairs (x_{2m}, x_{2m+1}) into that order).
// nn::Llama's apply_rope rotates (x_j, x_{j + D/2}) too, so q/k rows load unchanged: the permutation
// between the two layouts is the identity here. rope_row_permutation gives it for the other cases
// (Meta's original consolidated checkpoints are interleaved).
#include <algorithm>
#include <charconv>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "squeeze/error.hpp"
#include "squeeze/io/hf_config.hpp"

namespace squeeze::io {

enum class ParamKind { Embedding, AttnNorm, Q, K, V, O, MlpNorm, Gate, Up, Down, FinalNorm, Head };

struct NamePattern {
  std::string_view hf;       // "{i}" stands for the layer index
  std::string_view squeeze;  // likewise
  ParamKind kind;
};

// The table, in the order LlamaForCausalLM's state dict lists a layer.
inline constexpr NamePattern kLlamaNames[] = {
    {"model.embed_tokens.weight", "embed.weight", ParamKind::Embedding},
    {"model.layers.{i}.self_attn.q_proj.weight", "block{i}.attn.q.weight", ParamKind::Q},
    {"model.layers.{i}.self_attn.k_proj.weight", "block{i}.attn.k.weight", ParamKind::K},
    {"model.layers.{i}.self_attn.v_proj.weight", "block{i}.attn.v.weight", ParamKind::V},
    {"model.layers.{i}.self_attn.o_proj.weight", "block{i}.attn.o.weight", ParamKind::O},
    {"model.layers.{i}.mlp.gate_proj.weight", "block{i}.mlp.gate.weight", ParamKind::Gate},
    {"model.layers.{i}.mlp.up_proj.weight", "block{i}.mlp.up.weight", ParamKind::Up},
    {"model.layers.{i}.mlp.down_proj.weight", "block{i}.mlp.down.weight", ParamKind::Down},
    {"model.layers.{i}.input_layernorm.weight", "block{i}.attn_norm.weight", ParamKind::AttnNorm},
    {"model.layers.{i}.post_attention_layernorm.weight", "block{i}.mlp_norm.weight", ParamKind::MlpNorm},
    {"model.norm.weight", "norm.weight", ParamKind::FinalNorm},
    {"lm_head.weight", "head.weight", ParamKind::Head},
};

inline bool is_layer_kind(ParamKind k) { return k != ParamKind::Embedding && k != ParamKind::FinalNorm && k != ParamKind::Head; }

// The [out, in] (or [n]) shape both sides store for a tensor of kind k.
inline std::vector<std::int64_t> param_shape(ParamKind k, const LlamaConfig& c) {
  const std::int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  switch (k) {
    case ParamKind::Embedding:
    case ParamKind::Head:
      return {c.vocab_size, c.hidden_size};
    case ParamKind::AttnNorm:
    case ParamKind::MlpNorm:
    case ParamKind::FinalNorm:
      return {c.hidden_size};
    case ParamKind::Q:
      return {q, c.hidden_size};
    case ParamKind::K:
    case ParamKind::V:
      return {kv, c.hidden_size};
    case ParamKind::O:
      return {c.hidden_size, q};
    case ParamKind::Gate:
    case ParamKind::Up:
      return {c.intermediate_size, c.hidden_size};
    case ParamKind::Down:
      return {c.hidden_size, c.intermediate_size};
  }
  return {};
}

struct NameEntry {
  std::string hf;  // empty: none (head.weight under tied embeddings)
  std::string squeeze;
  ParamKind kind;
  std::int64_t layer = -1;  // -1 outside the blocks
  std::vector<std::int64_t> shape;
};

namespace detail {
inline std::string fill_layer(std::string_view pattern, std::int64_t layer) {
  std::string s(pattern);
  if (const auto p = s.find("{i}"); p != std::string::npos) s.replace(p, 3, std::to_string(layer));
  return s;
}
// Matches `name` against `pattern`; the layer index (or -1) when it fits. Indices are plain decimals
// without leading zeros ("layers.01" is no LLaMA name).
inline std::optional<std::int64_t> match_layer(std::string_view pattern, std::string_view name) {
  const auto p = pattern.find("{i}");
  if (p == std::string_view::npos) return pattern == name ? std::optional<std::int64_t>(-1) : std::nullopt;
  const auto head = pattern.substr(0, p), tail = pattern.substr(p + 3);
  if (name.size() <= head.size() + tail.size() || !name.starts_with(head) || !name.ends_with(tail)) return std::nullopt;
  const auto digits = name.substr(head.size(), name.size() - head.size() - tail.size());
  if (digits.size() > 1 && digits[0] == '0') return std::nullopt;
  std::int64_t v = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (ec != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return v;
}
// The entry for a name on one side (hf: true for Hugging Face names), or nullopt if no pattern fits.
inline std::optional<NameEntry> lookup(std::string_view name, bool hf, const LlamaConfig& c) {
  for (const auto& p : kLlamaNames) {
    const auto layer = match_layer(hf ? p.hf : p.squeeze, name);
    if (!layer) continue;
    check(*layer < c.num_hidden_layers, std::string(hf ? "Hugging Face tensor '" : "squeeze parameter '") + std::string(name) +
                                            "': layer " + std::to_string(*layer) + " does not exist (the config has " +
                                            std::to_string(c.num_hidden_layers) + " layers)");
    return NameEntry{fill_layer(p.hf, *layer), fill_layer(p.squeeze, *layer), p.kind, *layer, param_shape(p.kind, c)};
  }
  return std::nullopt;
}
}  // namespace detail

// Every tensor a LlamaForCausalLM checkpoint of config `c` holds, in state-dict order (no lm_head.weight when
// tied), with squeeze's name and the shape.
inline std::vector<NameEntry> hf_checkpoint_tensors(const LlamaConfig& c) {
  std::vector<NameEntry> out;
  auto add = [&](const NamePattern& p, std::int64_t layer) {
    out.push_back({detail::fill_layer(p.hf, layer), detail::fill_layer(p.squeeze, layer), p.kind, layer, param_shape(p.kind, c)});
  };
  add(kLlamaNames[0], -1);
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i)
    for (const auto& p : kLlamaNames)
      if (is_layer_kind(p.kind)) add(p, i);
  for (const auto& p : kLlamaNames)
    if (p.kind == ParamKind::FinalNorm || (p.kind == ParamKind::Head && !c.tie_word_embeddings)) add(p, -1);
  return out;
}

// Every nn::Llama parameter, in that order, with its Hugging Face source (head.weight under tied embeddings:
// hf = "model.embed_tokens.weight", the tensor it is filled from).
inline std::vector<NameEntry> squeeze_parameters(const LlamaConfig& c) {
  auto out = hf_checkpoint_tensors(c);
  if (c.tie_word_embeddings)
    out.push_back({"model.embed_tokens.weight", "head.weight", ParamKind::Head, -1, param_shape(ParamKind::Head, c)});
  return out;
}

// squeeze's parameters a Hugging Face tensor loads into: one, or two for the tied embedding. Throws for a
// name outside the table (or lm_head.weight under tied embeddings).
inline std::vector<std::string> squeeze_names_for(std::string_view hf_name, const LlamaConfig& c) {
  const auto e = detail::lookup(hf_name, /*hf=*/true, c);
  check(e.has_value(), "Hugging Face tensor '" + std::string(hf_name) + "' is not part of a LLaMA checkpoint squeeze loads");
  if (e->kind == ParamKind::Head)
    check(!c.tie_word_embeddings,
          "Hugging Face tensor 'lm_head.weight' is present but the config ties the embeddings (tie_word_embeddings)");
  if (e->kind == ParamKind::Embedding && c.tie_word_embeddings) return {e->squeeze, "head.weight"};
  return {e->squeeze};
}
// The one squeeze name of a Hugging Face tensor (the embedding's own under tied embeddings).
inline std::string squeeze_name(std::string_view hf_name, const LlamaConfig& c) { return squeeze_names_for(hf_name, c).front(); }

// The Hugging Face name a squeeze parameter is exported under; nullopt for head.weight when the
// embeddings are tied (it is not written). Throws for a name outside the table.
inline std::optional<std::string> hf_name(std::string_view squeeze_name, const LlamaConfig& c) {
  const auto e = detail::lookup(squeeze_name, /*hf=*/false, c);
  check(e.has_value(), "squeeze parameter '" + std::string(squeeze_name) + "' has no Hugging Face name (not an nn::Llama parameter)");
  if (e->kind == ParamKind::Head && c.tie_word_embeddings) return std::nullopt;
  return e->hf;
}

// ---- checking a checkpoint's tensor list against the config ---------------------------------------------------
struct NameCheck {
  std::vector<std::string> missing;          // in the table for this config, absent from the checkpoint
  std::vector<std::string> unexpected;       // in the checkpoint, not in the table for this config
  std::vector<std::string> wrong_shape;      // "name: [a, b] in the checkpoint, [c, d] expected"
  std::vector<std::string> ignored;          // rotary_emb.inv_freq buffers older exports carry (recomputed, not weights)
  std::map<std::string, std::string> files;  // checkpoint tensor -> the file holding it, where the caller said
  bool ok() const { return missing.empty() && unexpected.empty() && wrong_shape.empty(); }

  // Throws one error listing (up to 8 of) each kind of problem.
  void require_ok(std::string_view source) const {
    if (ok()) return;
    auto list = [this](const std::vector<std::string>& v) {
      std::string s;
      for (std::size_t i = 0; i < v.size() && i < 8; ++i) {
        const auto f = files.find(v[i]);
        s += (i ? ", '" : "'") + v[i] + "'" + (f == files.end() ? "" : " in " + f->second);
      }
      if (v.size() > 8) s += " and " + std::to_string(v.size() - 8) + " more";
      return s;
    };
    std::string what = "checkpoint " + std::string(source) + " does not match its config:";
    if (!missing.empty()) what += " missing tensors " + list(missing) + ";";
    if (!unexpected.empty()) what += " unexpected tensors " + list(unexpected) + ";";
    if (!wrong_shape.empty()) what += " wrong shapes " + list(wrong_shape) + ";";
    what.pop_back();
    throw Error(what);
  }
};

inline std::string shape_string(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// `found`: the checkpoint's tensor names and shapes (e.g. from SafetensorsCheckpoint::tensors()); `files`,
// optionally, the file of each, which errors then name.
inline NameCheck check_hf_tensors(const std::map<std::string, std::vector<std::int64_t>>& found, const LlamaConfig& c,
                                  std::map<std::string, std::string> files = {}) {
  NameCheck r;
  r.files = std::move(files);
  std::map<std::string, const NameEntry*> want;
  const auto table = hf_checkpoint_tensors(c);
  for (const auto& e : table) want[e.hf] = &e;
  for (const auto& [name, shape] : found) {
    const auto it = want.find(name);
    if (it == want.end()) {
      if (detail::match_layer("model.layers.{i}.self_attn.rotary_emb.inv_freq", name))
        r.ignored.push_back(name);
      else
        r.unexpected.push_back(name);
      continue;
    }
    if (shape == it->second->shape) continue;
    const auto f = r.files.find(name);
    r.wrong_shape.push_back(name + (f == r.files.end() ? "" : " in " + f->second) + ": " + shape_string(shape) + " in the checkpoint, " +
                            shape_string(it->second->shape) + " expected");
  }
  for (const auto& e : table)
    if (!found.count(e.hf)) r.missing.push_back(e.hf);
  return r;
}

// ---- RoPE row order ---------------------------------------------------------------------------------------------
enum class RopeLayout {
  RotateHalf,   // pairs (x_j, x_{j + D/2}): Hugging Face checkpoints, nn::Llama
  Interleaved,  // pairs (x_{2m}, x_{2m+1}): Meta's original checkpoints
};
inline constexpr RopeLayout kHfRopeLayout = RopeLayout::RotateHalf;
inline constexpr RopeLayout kSqueezeRopeLayout = RopeLayout::RotateHalf;

// perm such that row r of a q/k weight in layout `to` is row perm[r] of the same weight in layout `from`
// ([heads * head_dim] rows; each head's block is reordered on its own). Identity when from == to.
inline std::vector<std::int64_t> rope_row_permutation(std::int64_t heads, std::int64_t head_dim, RopeLayout from, RopeLayout to) {
  check(heads > 0 && head_dim > 0 && head_dim % 2 == 0, "rope_row_permutation: heads must be positive and head_dim positive and even");
  const std::int64_t half = head_dim / 2;
  std::vector<std::int64_t> perm(std::size_t(heads * head_dim));
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t j = 0; j < head_dim; ++j) {
      std::int64_t src = j;
      if (from == RopeLayout::Interleaved && to == RopeLayout::RotateHalf) src = j < half ? 2 * j : 2 * (j - half) + 1;
      if (from == RopeLayout::RotateHalf && to == RopeLayout::Interleaved) src = j % 2 == 0 ? j / 2 : j / 2 + half;
      perm[std::size_t(h * head_dim + j)] = h * head_dim + src;
    }
  return perm;
}

// out row r = in row perm[r], for a row-major [rows, cols] matrix.
template <class T>
std::vector<T> permute_rows(std::span<const T> in, std::int64_t rows, std::int64_t cols, std::span<const std::int64_t> perm) {
  check(rows >= 0 && cols >= 0 && in.size() == std::size_t(rows * cols) && perm.size() == std::size_t(rows),
        "permute_rows: the matrix is not [rows, cols] or the permutation is not [rows]");
  std::vector<T> out(in.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    check(perm[r] >= 0 && perm[r] < rows, "permute_rows: row index out of range");
    std::copy_n(in.begin() + perm[r] * cols, cols, out.begin() + r * cols);
  }
  return out;
}

}  // namespace squeeze::io
