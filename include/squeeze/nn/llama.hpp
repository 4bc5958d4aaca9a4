#pragma once
// A LLaMA decoder in libtorch C++: token embedding -> N x [RMSNorm -> grouped-query attention with RoPE
// (fused causal scaled-dot-product attention) -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm
// -> LM head (its own weight, or the embedding's under tie_embeddings). Shapes: B batch, T tokens, h hidden,
// H query heads, Hkv key/value heads, D head_dim (h / H unless the config sets it, as Hugging Face configs may).
//
// The model runs in whatever dtype its parameters have (float, bf16, half): a mixed-precision strategy
// converts the module to its compute type and keeps float master weights elsewhere. Norm statistics, RoPE
// angles and the loss are computed in float (float64 for a float64 model) whatever the parameter dtype.
// Linears and the embedding are Linear / Embedding: plain Linear / Embedding until a stage-3
// trainer shards them; checkpointed segments then hand the shards (the real leaves) to the checkpoint.
// Block projections are called by name (forward_linear), so apply_lora can swap in LoRA / NF4 layers.
// The loss runs the head + fp32 cross-entropy over chunks of loss_chunk_tokens tokens, each recomputed in
// backward (checkpoint_chunked_sum), so one chunk's logits exist at a time; see LlamaImpl::loss.
// LlamaConfig::fused_kernels (default on) runs RMSNorm, residual add + RMSNorm, RoPE (in place on the q / k
// projections) and SwiGLU through the fused autograd functions of fused_ops.hpp (CUDA kernels in nvcc TUs, the
// CPU twins on the CPU); off, the same math in plain torch ops (the reference the fused path is tested against).
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "squeeze/plan/rope.hpp"
#include "squeeze/nn/fused_linear_cross_entropy.hpp"
#include "squeeze/nn/fused_ops.hpp"
#include "squeeze/plan/memory.hpp"
#include "squeeze/plan/model_shape.hpp"
#include "squeeze/nn/activation_checkpoint.hpp"
#include "squeeze/nn/lora.hpp"
#include "squeeze/nn/layers.hpp"

namespace squeeze::nn {

struct LlamaConfig {
  std::string name = "custom";
  int64_t vocab = 256;
  int64_t hidden = 128;
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t ffn = 352;
  double rope_theta = 10000.0;
  plan::RopeScaling rope_scaling;  // default: none, the frequencies are rope_theta's alone
  double norm_eps = 1e-5;
  // 0: hidden / heads. Hugging Face configs may set head_dim apart from it (Llama 3 style tiny models).
  int64_t explicit_head_dim = 0;
  // The LM head reads the embedding's weight: one parameter (embed.weight), no head module.
  bool tie_embeddings = false;
  // RMSNorm, add + RMSNorm, RoPE and SwiGLU through fused_ops.hpp; false: unfused torch ops (for comparison).
  bool fused_kernels = true;

  int64_t head_dim() const { return explicit_head_dim != 0 ? explicit_head_dim : hidden / heads; }

  // The planner's view of the same geometry.
  plan::ModelShape shape() const { return {vocab, hidden, layers, heads, kv_heads, ffn, tie_embeddings, explicit_head_dim}; }

  void validate() const {
    for (const auto& [field, value] : {std::pair<const char*, int64_t>{"vocab", vocab},
                                       {"hidden", hidden},
                                       {"layers", layers},
                                       {"heads", heads},
                                       {"kv_heads", kv_heads},
                                       {"ffn", ffn}})
      TORCH_CHECK(value > 0, "LlamaConfig '", name, "': every size must be positive, ", field, " is ", value);
    TORCH_CHECK(explicit_head_dim >= 0, "LlamaConfig '", name, "': explicit_head_dim must be 0 (hidden / heads) or positive, got ",
                explicit_head_dim);
    TORCH_CHECK(explicit_head_dim != 0 || hidden % heads == 0, "LlamaConfig '", name, "': hidden (", hidden,
                ") must be a multiple of heads (", heads, ") unless explicit_head_dim is set");
    TORCH_CHECK(heads % kv_heads == 0, "LlamaConfig '", name, "': heads (", heads, ") must be a multiple of kv_heads (", kv_heads, ")");
    TORCH_CHECK(head_dim() % 2 == 0, "LlamaConfig '", name, "': head_dim (", head_dim(), ") must be even for RoPE");
  }

  static LlamaConfig from_shape(std::string name, const plan::ModelShape& s) {
    LlamaConfig c;
    c.name = std::move(name);
    c.vocab = s.vocab, c.hidden = s.hidden, c.layers = s.layers, c.heads = s.heads, c.kv_heads = s.kv_heads, c.ffn = s.ffn;
    return c;
  }

  static std::vector<std::string> preset_names() {
    return {"tiny", "125m", "tinyllama-1.1b", "llama-7b", "llama-13b", "llama3-8b", "llama-70b", "llama-175b"};
  }

  // tiny: byte-level vocabulary, trains on a laptop CPU in seconds (CI and the README's first command).
  // 125m: GPT-2-small-sized LLaMA. The others: the planner's geometries (plan::presets), with this config's RoPE theta
  // and norm epsilon (a Hugging Face directory brings its own: from_hf_config).
  static LlamaConfig preset(std::string_view name) {
    if (name == "tiny") return from_shape("tiny", {256, 128, 4, 4, 2, 352});
    if (name == "125m") return from_shape("125m", {32000, 768, 12, 12, 12, 2048});
    if (const auto s = plan::find_preset(name)) return from_shape(std::string(name), *s);
    std::string known;
    for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
    TORCH_CHECK(false, "unknown LLaMA preset '", std::string(name), "': choose one of ", known);
  }
};

// y = x / rms(x) * g, statistics in float. fused: fused_rms_norm when x has the weight's dtype (not under autocast,
// where activations and weights differ) and is contiguous.
struct RMSNormImpl : torch::nn::Module, engine::KeptWhole {
  torch::Tensor weight;  // [h]
  double eps;
  bool fused;
  RMSNormImpl(int64_t hidden, double eps_, bool fused_ = false, const ParamInit& init = {}) : eps(eps_), fused(fused_) {
    weight = register_parameter("weight", torch::ones({hidden}, init.options));
  }
  bool can_fuse(const torch::Tensor& x) const { return fused && x.scalar_type() == weight.scalar_type() && x.is_contiguous(); }
  torch::Tensor forward(const torch::Tensor& x) {  // x: [..., h]
    if (can_fuse(x)) return fused_rms_norm(x, weight, eps);
    const torch::Tensor xf = x.to(torch::kFloat32);
    const torch::Tensor y = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return y.to(weight.scalar_type()) * weight;
  }
};
TORCH_MODULE(RMSNorm);

// Rotary position embedding tables for T positions from the D/2 inverse frequencies inv_freq [D/2] (float):
// cos and sin, each [T, D] (the frequencies twice, matching the rotate-half layout), in float.
inline std::pair<torch::Tensor, torch::Tensor> rope_tables(int64_t T, const torch::Tensor& inv_freq) {
  const torch::Tensor angles = torch::outer(torch::arange(T, inv_freq.options()), inv_freq);  // [T, D/2]
  const torch::Tensor both = torch::cat({angles, angles}, -1);                                // [T, D]
  return {both.cos(), both.sin()};
}
// Unscaled RoPE: theta^(-2i/D), computed in float as squeeze always has (so default-RoPE models keep their bits).
inline std::pair<torch::Tensor, torch::Tensor> rope_tables(int64_t T, int64_t D, double theta, torch::Device device) {
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  return rope_tables(T, torch::pow(theta, -torch::arange(0, D, 2, f32) / double(D)));  // inv_freq [D/2]
}
// A config's tables: unscaled as above, or linear / llama3 scaling by plan::rope_inv_freq (double, rounded to float).
inline std::pair<torch::Tensor, torch::Tensor> rope_tables(int64_t T, const LlamaConfig& c, torch::Device device) {
  if (c.rope_scaling.type == plan::RopeType::Default) return rope_tables(T, c.head_dim(), c.rope_theta, device);
  const std::vector<double> f = plan::rope_inv_freq(c.head_dim(), c.rope_theta, c.rope_scaling);
  const torch::Tensor inv_freq = torch::tensor(f, torch::kFloat64).to(device, torch::kFloat32);  // [D/2]
  return rope_tables(T, inv_freq);
}

// x: [B, heads, T, D]; rotates each pair (x_i, x_{i+D/2}) by its position's angle.
inline torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const torch::Tensor rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos.to(x.scalar_type()) + rotated * sin.to(x.scalar_type());
}

struct AttentionImpl : torch::nn::Module {
  int64_t heads, kv_heads, head_dim;
  bool fused;  // RoPE in place on the q / k projections (fused_rope_) before the head transpose
  Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
  explicit AttentionImpl(const LlamaConfig& c, const ParamInit& init = {})
      : heads(c.heads), kv_heads(c.kv_heads), head_dim(c.head_dim()), fused(c.fused_kernels) {
    const auto lin = [&](int64_t in, int64_t out) { return Linear(torch::nn::LinearOptions(in, out).bias(false), init); };
    q = register_module("q", lin(c.hidden, heads * head_dim));
    k = register_module("k", lin(c.hidden, kv_heads * head_dim));
    v = register_module("v", lin(c.hidden, kv_heads * head_dim));
    o = register_module("o", lin(heads * head_dim, c.hidden));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {  // x: [B, T, h]
    const int64_t B = x.size(0), T = x.size(1);
    torch::Tensor qh, kh;
    if (fused) {  // rotated in the projections' [B, T, H * D] layout: in place unless autograd forbids it (QuantizedLinear's view)
      const auto rope = [&](const torch::Tensor& p) {
        const torch::Tensor c = p.contiguous();
        return can_modify_in_place(c) ? fused_rope_(c, cos, sin, head_dim) : fused_rope(c, cos, sin, head_dim);
      };
      qh = rope(forward_linear(*this, "q", x)).view({B, T, heads, head_dim}).transpose(1, 2);     // [B, H, T, D]
      kh = rope(forward_linear(*this, "k", x)).view({B, T, kv_heads, head_dim}).transpose(1, 2);  // [B, Hkv, T, D]
    } else {
      qh = apply_rope(forward_linear(*this, "q", x).view({B, T, heads, head_dim}).transpose(1, 2), cos, sin);     // [B, H, T, D]
      kh = apply_rope(forward_linear(*this, "k", x).view({B, T, kv_heads, head_dim}).transpose(1, 2), cos, sin);  // [B, Hkv, T, D]
    }
    torch::Tensor vh = forward_linear(*this, "v", x).view({B, T, kv_heads, head_dim}).transpose(1, 2);  // [B, Hkv, T, D]
    // Grouped-query attention: the fused flash kernel reads shared K/V heads directly (enable_gqa) for
    // half/bf16 on CUDA; other backends (float, CPU) take K/V repeated to H heads, which they all accept.
    const bool fused_gqa = qh.is_cuda() && qh.scalar_type() != torch::kFloat32;
    if (kv_heads != heads && !fused_gqa) {
      kh = kh.repeat_interleave(heads / kv_heads, 1);  // [B, H, T, D]
      vh = vh.repeat_interleave(heads / kv_heads, 1);  // [B, H, T, D]
    }
    const torch::Tensor attn = at::scaled_dot_product_attention(qh, kh, vh, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                                /*is_causal=*/true, /*scale=*/std::nullopt,
                                                                /*enable_gqa=*/kv_heads != heads && fused_gqa);  // [B, H, T, D]
    return forward_linear(*this, "o", attn.transpose(1, 2).reshape({B, T, heads * head_dim}));                   // [B, T, h]
  }
};
TORCH_MODULE(Attention);

// SwiGLU: down(silu(gate(x)) * up(x)); fused: silu(g) * u by fused_swiglu (saves g and u only).
struct MlpImpl : torch::nn::Module {
  Linear gate{nullptr}, up{nullptr}, down{nullptr};
  bool fused;
  explicit MlpImpl(const LlamaConfig& c, const ParamInit& init = {}) : fused(c.fused_kernels) {
    const auto lin = [&](int64_t in, int64_t out) { return Linear(torch::nn::LinearOptions(in, out).bias(false), init); };
    gate = register_module("gate", lin(c.hidden, c.ffn));
    up = register_module("up", lin(c.hidden, c.ffn));
    down = register_module("down", lin(c.ffn, c.hidden));
  }
  torch::Tensor forward(const torch::Tensor& x) {                                                  // [B, T, h] -> [B, T, h]
    const torch::Tensor g = forward_linear(*this, "gate", x), u = forward_linear(*this, "up", x);  // [B, T, ffn]
    if (fused && g.scalar_type() == u.scalar_type() && g.is_contiguous() && u.is_contiguous())
      return forward_linear(*this, "down", fused_swiglu(g, u));
    return forward_linear(*this, "down", torch::silu(g) * u);
  }
};
TORCH_MODULE(Mlp);

struct BlockImpl : torch::nn::Module, engine::GatherUnit {  // one stage-3 gather per block
  RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  Attention attn{nullptr};
  Mlp mlp{nullptr};
  explicit BlockImpl(const LlamaConfig& c, const ParamInit& init = {}) {
    attn_norm = register_module("attn_norm", RMSNorm(c.hidden, c.norm_eps, c.fused_kernels, init));
    attn = register_module("attn", Attention(c, init));
    mlp_norm = register_module("mlp_norm", RMSNorm(c.hidden, c.norm_eps, c.fused_kernels, init));
    mlp = register_module("mlp", Mlp(c, init));
  }
  // mlp_tile_tokens > 0 (fewer than the B·T tokens): the MLP and its norm run over tiles of that many tokens, each
  // checkpointed (checkpoint_tiled), so one tile's gate, up and product exist at a time instead of all T's.
  // output_unused: the block is recomputed in backward and nothing reads its output's value (checkpoint_sequential's
  // last_recomputed): the tiles wait for their own backward instead of running the MLP now.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t mlp_tile_tokens = 0,
                        bool output_unused = false) {  // [B, T, h]
    const torch::Tensor a = attn(attn_norm(x), cos, sin);
    if (mlp_tile_tokens > 0 && mlp_tile_tokens < x.size(0) * x.size(1)) {
      const torch::Tensor h = x + a;  // [B, T, h]
      std::vector<torch::Tensor> params = trainable_leaves(*mlp_norm);
      for (torch::Tensor& p : trainable_leaves(*mlp)) params.push_back(std::move(p));
      const torch::Tensor y = checkpoint_tiled(
          mlp_tile_tokens, h.reshape({-1, h.size(-1)}), params,
          [norm = mlp_norm, mlp = mlp](const torch::Tensor& rows) mutable { return mlp(norm(rows)); }, output_unused);
      return h + y.view(h.sizes());
    }
    if (mlp_norm->can_fuse(x) && a.scalar_type() == x.scalar_type() && a.is_contiguous()) {  // the residual add inside the norm
      const auto [h, n] = fused_add_rms_norm(x, a, mlp_norm->weight, mlp_norm->eps);
      return h + mlp(n);
    }
    const torch::Tensor h = x + a;
    return h + mlp(mlp_norm(h));
  }
};
TORCH_MODULE(Block);

// A model's random initialisation, part by part: the embedding (part 0), block i (part i + 1) and the head (part
// layers + 1) each draw from their own generator, seeded from the model's seed and the part's index, so one block
// can be drawn without drawing the blocks before it (nn/layerwise.hpp builds a model block by block with the values
// the whole model gets). GPT-2/LLaMA-style: N(0, 0.02), the two residual projections (attn.o, mlp.down) scaled by
// 1/sqrt(2 layers), norm gains one.
inline uint64_t llama_part_seed(uint64_t model_seed, int64_t part) {
  uint64_t z = model_seed + 0x9E3779B97F4A7C15ull * uint64_t(part + 1);  // splitmix64: nearby parts get unrelated seeds
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// Draws the parameters of `part` (named `prefix` in the model) in named_parameters order from the part's generator.
inline void draw_llama_part(torch::nn::Module& part, const std::string& prefix, int64_t part_index, int64_t layers, uint64_t model_seed) {
  torch::NoGradGuard no_grad;
  const double residual_std = 0.02 / std::sqrt(2.0 * double(layers));
  std::optional<at::Generator> gen;
  for (auto& p : part.named_parameters()) {
    torch::Tensor& t = p.value();
    if (t.numel() == 0) continue;  // a released (backed or sharded) weight
    const std::string n = prefix + "." + p.key();
    if (n.ends_with("norm.weight")) {
      t.fill_(1.0);
      continue;
    }
    if (!gen) gen = seeded_generator(t.device(), llama_part_seed(model_seed, part_index));
    t.normal_(0.0, n.ends_with("attn.o.weight") || n.ends_with("mlp.down.weight") ? residual_std : 0.02, gen);
  }
}

// Called with each top-level part of an nn::Llama ("embed", "block0", ..., "norm", "head") right after it is built
// and, under ParamInit::random, drawn, before the next part exists: nn/layerwise.hpp packs each block here.
using LlamaPartBuilt = std::function<void(const std::string& name, torch::nn::Module& part)>;

struct LlamaImpl : torch::nn::Module, Recomputable {
  LlamaConfig config;
  Embedding embed{nullptr};
  std::vector<Block> blocks;
  RMSNorm norm{nullptr};
  Linear head{nullptr};          // null under tie_embeddings: the head is embed's weight
  int64_t checkpoint_every = 0;  // 0: keep all activations; N: checkpoint segments of N blocks (training only)
  void set_recompute(int every) override { checkpoint_every = every; }  // a Checkpointed trainer's switch
  // Tokens per chunk of the loss (see loss()); 0: all at once. The default (and why) is the planner's, whose
  // TrainShape::loss_chunk_tokens must match it for plan_memory to predict this model's peak.
  int64_t loss_chunk_tokens = plan::kDefaultLossChunkTokens;
  // Tokens per tile of each block's MLP (BlockImpl::forward); 0: untiled. For long sequences, where one block's MLP
  // intermediates (3·ffn values a token) would outgrow the rest of its working set: plan::pick_mlp_tile chooses it.
  int64_t mlp_tile_tokens = 0;
  // Training through fused_linear_cross_entropy (the head's and the hidden states' gradients in the loss's own
  // pass, chunks of loss_chunk_tokens rows, no recomputed head). Off: the checkpointed chunked loss below.
  bool fused_loss = false;

  // init: where the parameters live (default float on the CPU) and whether they are drawn (part by part, see
  // draw_llama_part: from init.seed, or without one from a seed drawn from torch's global CPU generator, so
  // torch::manual_seed decides the model) or left uninitialised for weights loaded next (ParamInit{options, false}: a
  // 7B model straight in bf16 on its GPU). built (if set) sees each part as soon as it exists.
  explicit LlamaImpl(LlamaConfig c, const ParamInit& init = {}, const LlamaPartBuilt& built = {}) : config(std::move(c)) {
    config.validate();
    const ParamInit alloc{init.options, /*random=*/false};  // drawn here, one part at a time
    const uint64_t seed = init.random ? init.seed.value_or(seed_from_global_generator()) : 0;
    const auto done = [&](const std::string& name, torch::nn::Module& part, int64_t index) {
      if (init.random) draw_llama_part(part, name, index, config.layers, seed);
      if (built) built(name, part);
    };
    embed = register_module("embed", Embedding(torch::nn::EmbeddingOptions(config.vocab, config.hidden), alloc));
    done("embed", *embed, 0);
    for (int64_t i = 0; i < config.layers; ++i) {
      const std::string name = "block" + std::to_string(i);
      blocks.push_back(register_module(name, Block(config, alloc)));
      done(name, *blocks.back(), i + 1);
    }
    norm = register_module("norm", RMSNorm(config.hidden, config.norm_eps, config.fused_kernels, alloc));
    done("norm", *norm, config.layers + 1);
    if (!config.tie_embeddings) {
      head = register_module("head", Linear(torch::nn::LinearOptions(config.hidden, config.vocab).bias(false), alloc));
      done("head", *head, config.layers + 1);
    }
  }

  // Draws every parameter again from `seed`, as the constructor does (the same values as LlamaImpl(config,
  // ParamInit{.seed = seed}) while the model is still plain).
  void reset_parameters(uint64_t seed) {
    draw_llama_part(*embed, "embed", 0, config.layers, seed);
    for (int64_t i = 0; i < config.layers; ++i) draw_llama_part(*blocks[i], "block" + std::to_string(i), i + 1, config.layers, seed);
    draw_llama_part(*norm, "norm", config.layers + 1, config.layers, seed);
    if (head) draw_llama_part(*head, "head", config.layers + 1, config.layers, seed);
  }

  // ids: [B, T] int64 -> logits [B, T, vocab] in the parameter dtype.
  torch::Tensor forward(const torch::Tensor& ids) { return logits(hidden(ids)); }

  // x: [..., h] -> logits [..., vocab]: the head, or under tie_embeddings x E^T with E the embedding [vocab, h].
  torch::Tensor logits(const torch::Tensor& x) {
    return config.tie_embeddings ? torch::nn::functional::linear(x, embed->full_weight()) : head(x);
  }
  // The head's weight [vocab, h] as one tensor (Linear::full_weight; the embedding's under tie_embeddings).
  torch::Tensor head_weight() { return config.tie_embeddings ? embed->full_weight() : head->full_weight(); }

  // ids: [B, T] int64 -> the final norm's output [B, T, h], what the head reads.
  torch::Tensor hidden(const torch::Tensor& ids) {
    TORCH_CHECK(ids.dim() == 2, "Llama::forward: token ids must be [batch, seq], got ", ids.sizes());
    TORCH_CHECK(ids.scalar_type() == torch::kLong, "Llama::forward: token ids must be int64, got ", ids.scalar_type());
    const int64_t T = ids.size(1);
    const auto [cos, sin] = rope_tables(T, config, ids.device());  // [T, D] each
    torch::Tensor x = embed(ids);                                  // [B, T, h]
    const int64_t tile = mlp_tile_tokens;
    const auto layer = [this, cos, sin, tile](int64_t i, const torch::Tensor& h) { return blocks[i]->forward(h, cos, sin, tile); };
    const auto last_recomputed = [this, cos, sin, tile](int64_t i, const torch::Tensor& h) {
      return blocks[i]->forward(h, cos, sin, tile, /*output_unused=*/true);
    };
    const auto layer_params = [this](int64_t i) { return trainable_leaves(*blocks[i]); };
    const int64_t every = is_training() ? checkpoint_every : 0;
    x = checkpoint_sequential(config.layers, every, x, layer, layer_params, last_recomputed);  // [B, T, h]
    return norm(x);                                                                            // [B, T, h]
  }

  // Mean next-token cross-entropy in float. ids, targets: [B, T].
  // With more than loss_chunk_tokens tokens, the head and the cross-entropy run over chunks of that many tokens
  // (the final norm runs once, on all of them): the sum of each chunk's losses, divided by the token count at
  // the end. Training, each chunk is checkpointed: its logits [chunk, V] (and their fp32 copy and gradients) are
  // recomputed in its backward and freed before the next chunk's, and the head's weight is read through
  // head_weight(), so a stage-3 head is gathered once and its gradient, summed over the chunks by autograd,
  // reduce-scattered once. Evaluation (eval mode or no grad) runs the chunks one by one, recomputing nothing.
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& targets) {
    TORCH_CHECK(loss_chunk_tokens >= 0, "Llama::loss: loss_chunk_tokens must be >= 0 (0: the whole batch at once), got ",
                loss_chunk_tokens);
    TORCH_CHECK(targets.sizes() == ids.sizes(), "Llama::loss: targets ", targets.sizes(), " must have the shape of the token ids ",
                ids.sizes());
    const torch::Tensor x = hidden(ids).reshape({-1, config.hidden});  // [N, h], N = B·T
    const torch::Tensor t = targets.reshape({-1});                     // [N]
    if (fused_loss && torch::GradMode::is_enabled())
      return fused_linear_cross_entropy(x, head_weight(), t, loss_chunk_tokens > 0 ? loss_chunk_tokens : x.size(0), kIgnoreIndex);
    if (loss_chunk_tokens == 0 || x.size(0) <= loss_chunk_tokens)
      return torch::nn::functional::cross_entropy(float_logits(logits(x)), t);   // logits [N, V] at once
    const torch::Tensor w = head_weight();                                       // [V, h]
    const BlockFn chunk_loss = [](const std::vector<torch::Tensor>& in) {        // in: rows [c, h], targets [c], weight [V, h]
      const torch::Tensor logits = torch::nn::functional::linear(in[0], in[2]);  // [c, V]
      return torch::nn::functional::cross_entropy(float_logits(logits), in[1],
                                                  torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
    };
    const torch::Tensor sum = checkpoint_chunked_sum(loss_chunk_tokens, {x, t}, {w}, chunk_loss, /*recompute=*/is_training());
    return sum / t.ne(kIgnoreIndex).sum();  // the mean over the targets cross_entropy does not ignore, as unchunked
  }

  // cross_entropy's default ignore_index: such targets count neither in the sum nor in the mean.
  static constexpr int64_t kIgnoreIndex = -100;
  // The loss is computed in fp32 from 16-bit or fp32 logits, and in float64 for a float64 model (test references).
  static torch::Tensor float_logits(const torch::Tensor& logits) {
    return logits.scalar_type() == torch::kFloat64 ? logits : logits.to(torch::kFloat32);
  }
};
TORCH_MODULE(Llama);

}  // namespace squeeze::nn
