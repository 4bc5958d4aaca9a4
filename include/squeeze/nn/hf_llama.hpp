#pragma once
// Hugging Face LlamaForCausalLM directories into nn::Llama and out again, and PEFT LoRA adapters both ways.
//
//   load_hf_llama(dir, options)        config.json -> nn::LlamaConfig, an nn::Llama in the chosen dtype / device,
//                                      its weights streamed from model.safetensors or the shards of
//                                      model.safetensors.index.json one tensor at a time
//   load_hf_weights(model, dir)        the same weights into an existing model (its config must be the file's)
//   load_hf_weights(trainer, model, dir)  into a trainer at any ZeRO stage: each rank writes only its shards and
//                                      masters (Trainer::load_parameter), for models that do not fit whole
//   save_hf_llama(model, dir, options) config.json + safetensors shards + index under Hugging Face names, with
//                                      LoRA folded in and quantized bases dequantised
//   save_hf_llama(config, source, ...) the same, the tensors coming one at a time from a callback (a trainer that
//                                      gathers one layer at a time never holds the model whole)
//   save_peft_adapters / load_peft_adapters   adapter_model.safetensors + adapter_config.json as PEFT writes them
//
// Names, shapes and the tied embedding follow io/hf_names.hpp's table; config.json follows io/hf_config.hpp
// (which refuses what squeeze does not implement, by key). Errors are c10::Error (TORCH_CHECK), as elsewhere in
// nn; they name the tensor, key or file that was wrong.
//
// Host memory while loading: load_hf_llama builds the model uninitialised straight in its dtype on its device
// (ParamInit); each checkpoint tensor is then read into one of two host buffers of the largest tensor's size (the
// next one is read while the current one is written) and copied into its parameter. The model is never held twice, and into a trainer
// never whole on one rank. HfLoadOptions::progress / the progress argument report each tensor as it lands.
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "squeeze/io/hf_config.hpp"
#include "squeeze/io/hf_names.hpp"
#include "squeeze/io/json_file.hpp"
#include "squeeze/engine/io_dtypes.hpp"
#include "squeeze/io/safetensors_sharded.hpp"
#include "squeeze/nn/llama.hpp"
#include "squeeze/nn/lora.hpp"

namespace squeeze::nn {

namespace detail {
// io reports squeeze::Error; nn reports c10::Error (TORCH_CHECK) like the rest of the torch layer.
template <class F>
decltype(auto) torch_errors(F&& f) {
  try {
    return f();
  } catch (const squeeze::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

inline std::span<const std::byte> bytes_of(const torch::Tensor& t) {  // t: CPU, contiguous
  return {static_cast<const std::byte*>(t.data_ptr()), t.nbytes()};
}
inline std::span<std::byte> writable_bytes_of(torch::Tensor& t) {  // t: CPU, contiguous
  return {static_cast<std::byte*>(t.data_ptr()), t.nbytes()};
}
}  // namespace detail

// ---- dtypes ---------------------------------------------------------------------------------------------------
// The floating-point dtypes Hugging Face LLaMA weights come in (float, bf16, half), through the one dtype map.
inline torch::ScalarType torch_dtype_of(io::DType d) {
  TORCH_CHECK(d == io::DType::F32 || d == io::DType::BF16 || d == io::DType::F16 || d == io::DType::F64, "dtype ",
              std::string(io::dtype_name(d)), " is not a floating-point weight dtype");
  return engine::scalar_type(d);
}
inline io::DType io_dtype_of(torch::ScalarType t) {
  TORCH_CHECK(t == torch::kFloat32 || t == torch::kBFloat16 || t == torch::kHalf, "dtype ", t,
              " is not a Hugging Face checkpoint dtype (float, bf16 or half)");
  return engine::io_dtype(t);
}

// ---- configs ----------------------------------------------------------------------------------------------------
// config.json's network as nn::LlamaConfig. head_dim stays implicit when it is hidden / heads, so such a model
// is the same config a squeeze preset of its geometry would be.
inline LlamaConfig from_hf_config(const io::LlamaConfig& h, std::string name = "hf") {
  LlamaConfig c;
  c.name = std::move(name);
  c.vocab = h.vocab_size, c.hidden = h.hidden_size, c.layers = h.num_hidden_layers, c.heads = h.num_attention_heads;
  c.kv_heads = h.num_key_value_heads, c.ffn = h.intermediate_size;
  c.explicit_head_dim = h.hidden_size % h.num_attention_heads == 0 && h.head_dim == h.hidden_size / h.num_attention_heads ? 0 : h.head_dim;
  c.rope_theta = h.rope_theta, c.rope_scaling = h.rope_scaling, c.norm_eps = h.rms_norm_eps;
  c.tie_embeddings = h.tie_word_embeddings;
  return c;
}

// The first field in which two configs' networks differ, as "field: a vs b"; empty when they compute the same.
inline std::string network_difference(const LlamaConfig& a, const LlamaConfig& b) {
  const auto num = [](double v) {  // the shortest text that reads back as v
    char buf[32];
    return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
  };
  const std::vector<std::tuple<const char*, std::string, std::string>> fields = {
      {"vocab", std::to_string(a.vocab), std::to_string(b.vocab)},
      {"hidden", std::to_string(a.hidden), std::to_string(b.hidden)},
      {"layers", std::to_string(a.layers), std::to_string(b.layers)},
      {"heads", std::to_string(a.heads), std::to_string(b.heads)},
      {"kv_heads", std::to_string(a.kv_heads), std::to_string(b.kv_heads)},
      {"ffn", std::to_string(a.ffn), std::to_string(b.ffn)},
      {"head_dim", std::to_string(a.head_dim()), std::to_string(b.head_dim())},
      {"tie_embeddings", a.tie_embeddings ? "true" : "false", b.tie_embeddings ? "true" : "false"},
      {"norm_eps", num(a.norm_eps), num(b.norm_eps)},
      {"rope_theta", num(a.rope_theta), num(b.rope_theta)},
      {"rope_scaling", std::string(plan::rope_type_name(a.rope_scaling.type)), std::string(plan::rope_type_name(b.rope_scaling.type))},
  };
  for (const auto& [field, x, y] : fields)
    if (x != y) return std::string(field) + ": " + x + " vs " + y;
  if (!(a.rope_scaling == b.rope_scaling))
    return "rope_scaling: the " + std::string(plan::rope_type_name(a.rope_scaling.type)) + " parameters differ";
  return "";
}

// nn::LlamaConfig as config.json's io::LlamaConfig, weights in `dtype`. nn::LlamaConfig holds neither
// max_position_embeddings nor special token ids: they come from `source` (the config the model was loaded
// from, whose network must be c's), or transformers' defaults without one.
inline io::LlamaConfig to_hf_config(const LlamaConfig& c, io::DType dtype, const std::optional<io::LlamaConfig>& source = std::nullopt) {
  io::LlamaConfig h;
  if (source) {
    const std::string diff = network_difference(c, from_hf_config(*source));
    TORCH_CHECK(diff.empty(), "to_hf_config: the source config describes another network than the model's (", diff, ")");
    h = *source;
    h.model_type = "llama";  // written as the LLaMA it is (a Mistral without sliding window)
    h.ignored_keys.clear();
  }
  h.vocab_size = c.vocab, h.hidden_size = c.hidden, h.num_hidden_layers = c.layers, h.num_attention_heads = c.heads;
  h.num_key_value_heads = c.kv_heads, h.intermediate_size = c.ffn, h.head_dim = c.head_dim();
  h.rms_norm_eps = c.norm_eps, h.rope_theta = c.rope_theta, h.rope_scaling = c.rope_scaling;
  h.tie_word_embeddings = c.tie_embeddings;
  h.dtype = dtype;
  detail::torch_errors([&] { h.validate("to_hf_config(" + c.name + ")"); });
  return h;
}

// ---- loading ----------------------------------------------------------------------------------------------------
// Where a load stands, after each tensor: for progress lines and for seeing where the time goes.
struct HfLoadProgress {
  std::size_t tensors = 0, tensors_total = 0;
  std::uint64_t bytes = 0, bytes_total = 0;  // checkpoint bytes read so far, of all
  double seconds = 0;                        // since the first read began
  double read_s = 0;                         // reading the files (on a thread of its own, overlapping the writes)
  double write_s = 0;                        // converting and copying into the parameters, shards and masters
};
using HfProgressFn = std::function<void(const HfLoadProgress&)>;

struct HfLoadOptions {
  std::optional<torch::ScalarType> dtype;  // kFloat32, kBFloat16 or kHalf; default: config.json's (float when it names none)
  torch::Device device = torch::kCPU;
  io::ConfigOptions config;  // allow_unknown_keys
  HfProgressFn progress;     // called after each tensor
};

namespace detail {
// A checkpoint directory checked against the network it must hold: config.json (when present) describes the same
// network, every tensor is there with its shape and a floating-point dtype, nothing unexpected. Nothing is read yet.
struct HfWeights {
  io::SafetensorsCheckpoint ckpt;
  std::vector<io::NameEntry> entries;  // in checkpoint order
};
inline HfWeights open_hf_weights(const LlamaConfig& c, const std::filesystem::path& dir, const io::ConfigOptions& config_options) {
  const io::LlamaConfig expect = to_hf_config(c, io::DType::F32);  // the names and shapes to find
  if (std::filesystem::exists(dir / "config.json")) {
    const io::LlamaConfig file = torch_errors([&] { return io::load_llama_config(dir, config_options); });
    const std::string diff = network_difference(c, from_hf_config(file));
    TORCH_CHECK(diff.empty(), "load_hf_weights: ", (dir / "config.json").string(), " describes another network than the model's (", diff,
                ", the model's value first)");
  }
  HfWeights w{torch_errors([&] { return io::SafetensorsCheckpoint::open(dir); }), io::hf_checkpoint_tensors(expect)};
  std::map<std::string, std::vector<std::int64_t>> found;
  std::map<std::string, std::string> files;
  for (const auto& [name, t] : w.ckpt.tensors()) found[name] = t.shape, files[name] = t.file;
  torch_errors([&] { io::check_hf_tensors(found, expect, files).require_ok(dir.string()); });
  for (const io::NameEntry& e : w.entries) {
    const io::CheckpointTensor& info = w.ckpt.info(e.hf);
    TORCH_CHECK(io::is_float_dtype(info.dtype), "load_hf_weights: tensor '", e.hf, "' in ", info.file, " has dtype ",
                std::string(io::dtype_name(info.dtype)), ", not a floating-point dtype");
  }
  return w;
}
// Entry e's bytes into `into` (a host tensor of its shape and dtype). A large tensor is read in up to 8 concurrent
// pieces of at least 16 MB: one pread copies out of the page cache on one core, far below what memory or a drive gives.
inline void read_hf_tensor(const HfWeights& w, const io::NameEntry& e, torch::Tensor& into) {
  const std::span<std::byte> bytes = writable_bytes_of(into);
  constexpr std::size_t kPiece = std::size_t(16) << 20;
  const std::size_t pieces = std::clamp<std::size_t>(bytes.size() / kPiece, 1, 8);
  const std::size_t step = (bytes.size() + pieces - 1) / pieces;
  const auto read_piece = [&](std::size_t off) { w.ckpt.read_bytes(e.hf, bytes.subspan(off, std::min(step, bytes.size() - off)), off); };
  std::vector<std::future<void>> rest;
  for (std::size_t off = step; off < bytes.size(); off += step) rest.push_back(std::async(std::launch::async, read_piece, off));
  torch_errors([&] {
    if (!bytes.empty()) read_piece(0);
    for (auto& f : rest) f.get();  // rethrows a piece's error
  });
}
inline torch::Tensor read_hf_tensor(const HfWeights& w, const io::NameEntry& e) {
  torch::Tensor t = torch::empty(e.shape, torch::TensorOptions().dtype(torch_dtype_of(w.ckpt.info(e.hf).dtype)));
  read_hf_tensor(w, e, t);
  return t;
}

// Reads the tensors in checkpoint order and hands each to sink; the next tensor is read on another thread while
// sink writes the current one. Two host buffers of the largest tensor's size take turns (reused, so their pages are
// faulted in once, not once per tensor); the tensor sink sees is valid until it returns. progress (if set) is
// called after each tensor.
inline void stream_hf_weights(const HfWeights& w, const std::function<void(const io::NameEntry&, const torch::Tensor&)>& sink,
                              const HfProgressFn& progress = {}) {
  using Clock = std::chrono::steady_clock;
  const auto since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  torch::NoGradGuard no_grad;
  HfLoadProgress p;
  p.tensors_total = w.entries.size();
  std::uint64_t largest = 0;
  for (const io::NameEntry& e : w.entries) p.bytes_total += w.ckpt.info(e.hf).bytes, largest = std::max(largest, w.ckpt.info(e.hf).bytes);
  std::array<torch::Tensor, 2> buffers;  // [largest] bytes each
  for (auto& b : buffers) b = torch::empty({std::int64_t(largest)}, torch::kUInt8);
  const auto view = [&](std::size_t i) {  // tensor i in its buffer
    const io::NameEntry& e = w.entries[i];
    const io::CheckpointTensor& info = w.ckpt.info(e.hf);
    return buffers[i % 2].narrow(0, 0, std::int64_t(info.bytes)).view(torch_dtype_of(info.dtype)).view(e.shape);
  };
  const auto t0 = Clock::now();
  const auto read = [&](std::size_t i) {
    const auto tr = Clock::now();
    torch::Tensor t = view(i);
    read_hf_tensor(w, w.entries[i], t);
    return std::pair{t, since(tr)};
  };
  std::future<std::pair<torch::Tensor, double>> next;
  if (!w.entries.empty()) next = std::async(std::launch::async, read, std::size_t(0));
  for (std::size_t i = 0; i < w.entries.size(); ++i) {
    auto [buf, read_s] = next.get();
    if (i + 1 < w.entries.size()) next = std::async(std::launch::async, read, i + 1);  // the other buffer
    const auto tw = Clock::now();
    sink(w.entries[i], buf);
    p.write_s += since(tw);
    p.read_s += read_s;
    p.tensors = i + 1;
    p.bytes += std::uint64_t(buf.nbytes());
    p.seconds = since(t0);
    if (progress) progress(p);
  }
}

// The module's dense parameter for entry e, checked before anything is written.
inline torch::Tensor* dense_target(torch::OrderedDict<std::string, torch::Tensor>& params, const io::NameEntry& e) {
  torch::Tensor* p = params.find(e.squeeze);
  TORCH_CHECK(p != nullptr, "load_hf_weights: the model has no parameter '", e.squeeze, "' for '", e.hf, "' (not an nn::Llama?)");
  TORCH_CHECK(p->sizes().vec() == e.shape, "load_hf_weights: parameter '", e.squeeze, "' is ", p->sizes(), ", '", e.hf, "' is ",
              io::shape_string(e.shape),
              ": a LoRA-backed, quantized or stage-3-sharded layer holds no dense weight; load "
              "before apply_lora, or into the trainer (load_hf_weights(trainer, model, dir))");
  return p;
}
}  // namespace detail

// Streams the checkpoint in `dir` into `model`'s parameters, converting to their dtype and device. The model
// must be a plain nn::Llama (before apply_lora or a stage-3 trainer empties its weights); when `dir` holds a
// config.json, its network must be the model's. Everything is checked before the first parameter changes.
inline void load_hf_weights(LlamaImpl& model, const std::filesystem::path& dir, const io::ConfigOptions& config_options = {},
                            const HfProgressFn& progress = {}) {
  const detail::HfWeights w = detail::open_hf_weights(model.config, dir, config_options);
  auto params = model.named_parameters();
  std::map<std::string, torch::Tensor*> target;
  for (const io::NameEntry& e : w.entries) target[e.squeeze] = detail::dense_target(params, e);
  detail::stream_hf_weights(
      w, [&](const io::NameEntry& e, const torch::Tensor& t) { target.at(e.squeeze)->copy_(t); }, progress);
}

// The same into a trainer built on `model` (any Strategy, any ZeRO stage): its trainable parameters through
// trainer.load_parameter (under stage 3 each rank fills only its shards; the fp32 masters take the file's values),
// the others into the module. Build the model with ParamInit{options, /*random=*/false} to skip drawing weights
// that are overwritten here; host memory then holds the trainer's state and one checkpoint tensor at a time.
// Every rank reads the checkpoint (not a collective). Tensors a LoRA or quantized base replaced are refused.
template <class TrainerT>
requires requires(TrainerT& t, const std::string& n, const torch::Tensor& v) {
  t.load_parameter(n, v);
  { t.has_parameter(n) } -> std::convertible_to<bool>;
}
inline void load_hf_weights(TrainerT& trainer, LlamaImpl& model, const std::filesystem::path& dir,
                            const io::ConfigOptions& config_options = {}, const HfProgressFn& progress = {}) {
  const detail::HfWeights w = detail::open_hf_weights(model.config, dir, config_options);
  auto params = model.named_parameters();
  std::map<std::string, torch::Tensor*> target;  // module parameters the trainer does not hold
  for (const io::NameEntry& e : w.entries)
    if (!trainer.has_parameter(e.squeeze)) target[e.squeeze] = detail::dense_target(params, e);
  detail::stream_hf_weights(
      w,
      [&](const io::NameEntry& e, const torch::Tensor& t) {
        if (auto it = target.find(e.squeeze); it != target.end())
          it->second->copy_(t);
        else
          trainer.load_parameter(e.squeeze, t);
      },
      progress);
}

// An nn::Llama built from `dir`'s config.json and filled with its weights.
inline Llama load_hf_llama(const std::filesystem::path& dir, const HfLoadOptions& o = {}) {
  const io::LlamaConfig hf = detail::torch_errors([&] { return io::load_llama_config(dir, o.config); });
  const torch::ScalarType dtype = o.dtype.value_or(torch_dtype_of(hf.dtype.value_or(io::DType::F32)));
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kHalf,
              "load_hf_llama: dtype must be float, bf16 or half, got ", dtype);
  Llama model(from_hf_config(hf, dir.string()), ParamInit{torch::TensorOptions().dtype(dtype).device(o.device), /*random=*/false});
  load_hf_weights(*model, dir, o.config, o.progress);
  return model;
}

// ---- export -------------------------------------------------------------------------------------------------------
struct HfSaveOptions {
  std::optional<io::DType> dtype;                 // F32, BF16 or F16; default: the model's (the callback overload: F32)
  std::uint64_t max_shard_bytes = 5'000'000'000;  // per file, header included (transformers 4's default "5GB"); 0: one file
  std::optional<io::LlamaConfig> source_config;   // what nn::LlamaConfig does not hold (see to_hf_config)
};

// The squeeze parameter `name` (e.g. "block3.attn.q.weight") as a dense tensor of its full shape, in any float
// dtype on any device. Called once per tensor, in checkpoint order.
using HfTensorSource = std::function<torch::Tensor(const std::string& name)>;

// Writes config.json, the safetensors shards (model-0000k-of-0000n.safetensors, or model.safetensors) and the
// index, each tensor converted to the export dtype as it arrives and dropped once written. Until the end only
// *.tmp files exist; a failure (a source error, a wrong shape) leaves the directory as it was.
inline void save_hf_llama(const LlamaConfig& c, const HfTensorSource& source, const std::filesystem::path& dir,
                          const HfSaveOptions& o = {}) {
  const io::DType dtype = o.dtype.value_or(io::DType::F32);
  TORCH_CHECK(dtype == io::DType::F32 || dtype == io::DType::BF16 || dtype == io::DType::F16,
              "save_hf_llama: export dtype must be F32, BF16 or F16, got ", std::string(io::dtype_name(dtype)));
  const io::LlamaConfig h = to_hf_config(c, dtype, o.source_config);
  const std::vector<io::NameEntry> table = io::hf_checkpoint_tensors(h);
  std::vector<io::TensorSpec> specs;
  for (const auto& e : table) specs.push_back({e.hf, dtype, e.shape});
  io::ShardedSafetensorsWriter writer = detail::torch_errors([&] { return io::ShardedSafetensorsWriter(dir, specs, o.max_shard_bytes); });
  torch::NoGradGuard no_grad;
  for (const auto& e : table) {
    const torch::Tensor t = source(e.squeeze);
    TORCH_CHECK(t.defined() && t.sizes().vec() == e.shape, "save_hf_llama: the source gave ",
                t.defined() ? t.sizes() : torch::IntArrayRef{}, " for '", e.squeeze, "' ('", e.hf, "'), ", io::shape_string(e.shape),
                " expected");
    TORCH_CHECK(t.is_floating_point(), "save_hf_llama: the source gave '", e.squeeze, "' as ", t.scalar_type(),
                ", not a floating-point tensor");
    const torch::Tensor out = t.detach().to(torch::kCPU, torch_dtype_of(dtype)).contiguous();  // [shape] in the export dtype
    detail::torch_errors([&] { writer.write(e.hf, detail::bytes_of(out)); });
  }
  detail::torch_errors([&] {
    writer.finish();
    io::save_llama_config(dir, h);
  });
}

// The dense value of the model's parameter `name`: the parameter, or for a backed Linear its merged / dequantised
// weight (lora.hpp: dense_weight). Refused for stage-3-sharded layers, whose weight lives in shards.
inline torch::Tensor dense_parameter(LlamaImpl& model, const std::string& name) {
  constexpr std::string_view suffix = ".weight";
  TORCH_CHECK(name.ends_with(suffix), "dense_parameter: '", name, "' is not a weight");
  const std::string path = name.substr(0, name.size() - suffix.size());
  const auto modules = model.named_modules();
  const auto* m = modules.find(path);
  TORCH_CHECK(m != nullptr, "dense_parameter: the model has no module '", path, "'");
  const auto* sh = dynamic_cast<const Shardable*>(m->get());
  TORCH_CHECK(sh == nullptr || sh->group() == nullptr, "dense_parameter: '", path, "' is sharded by a stage-3 trainer; export through ",
              "save_hf_llama's callback overload, gathering one layer at a time");
  if (auto* lin = dynamic_cast<LinearImpl*>(m->get()); lin && lin->backed()) {
    const torch::Tensor w = dense_weight(*lin->backing());
    TORCH_CHECK(w.defined(), "dense_parameter: '", path, "' has a backing (", lin->backing()->name(),
                ") with no dense form; merge or dequantise it before export");
    return w;
  }
  const torch::Tensor* p = (*m)->named_parameters(/*recurse=*/false).find("weight");
  TORCH_CHECK(p != nullptr, "dense_parameter: module '", path, "' has no weight");
  return *p;
}

// The model as a Hugging Face directory: LoRA adapters folded in (W + alpha/r B A) and NF4 / GPTQ bases
// dequantised, in the model's dtype unless options say otherwise.
inline void save_hf_llama(LlamaImpl& model, const std::filesystem::path& dir, HfSaveOptions o = {}) {
  if (!o.dtype) o.dtype = io_dtype_of(model.embed->weight.scalar_type());
  save_hf_llama(
      model.config, [&model](const std::string& name) { return dense_parameter(model, name); }, dir, o);
}

// A trainer's model as a Hugging Face directory, at any ZeRO stage: trainable weights come from
// trainer.gather_parameter, so stage 3 holds one layer gathered at a time. A collective under stage 3: every rank
// calls it; rank `writer_rank` writes. LoRA strategies export their model (adapters merged, base dequantised).
// The export dtype defaults to the compute dtype of the trained weights.
template <class TrainerT>
void save_hf_llama(TrainerT& trainer, const LlamaConfig& c, const std::filesystem::path& dir, HfSaveOptions o = {}) {
  const int rank = trainer.communicator().rank();
  if constexpr (TrainerT::strategy::has_lora) {
    auto* model = dynamic_cast<LlamaImpl*>(&trainer.module());
    TORCH_CHECK(model != nullptr, "save_hf_llama: the trainer's module is not an nn::Llama");
    if (rank == 0) save_hf_llama(*model, dir, std::move(o));
  } else {
    if (!o.dtype) {
      const std::string first = io::hf_checkpoint_tensors(to_hf_config(c, io::DType::F32, o.source_config)).front().squeeze;
      o.dtype = io_dtype_of(trainer.gather_parameter(first).scalar_type());
    }
    const io::DType dtype = *o.dtype;
    if (rank == 0) {
      save_hf_llama(
          c, [&](const std::string& name) { return trainer.gather_parameter(name); }, dir, o);
    } else {
      for (const auto& e : io::hf_checkpoint_tensors(to_hf_config(c, dtype, o.source_config))) (void)trainer.gather_parameter(e.squeeze);
    }
    trainer.release_gathered();
  }
}

// ---- PEFT adapters ----------------------------------------------------------------------------------------------
inline constexpr std::string_view kPeftConfigFile = "adapter_config.json";
inline constexpr std::string_view kPeftWeightsFile = "adapter_model.safetensors";

struct PeftSaveOptions {
  std::string base_model_name_or_path;  // written as is (empty: null); PEFT loads the base from it by default
  double lora_dropout = 0.0;            // recorded for PEFT's training; squeeze's LoRA has no dropout
};

// What an adapter_config.json says (load_peft_adapters) or what save_peft_adapters wrote.
struct PeftAdapters {
  int64_t r = 0;
  double lora_alpha = 0;
  double lora_dropout = 0;
  std::vector<std::string> target_modules;  // Hugging Face module names, sorted: q_proj, v_proj, ...
  std::string base_model_name_or_path;
};

// One adapted projection of an nn::Llama: squeeze's path, PEFT's key prefix and the layer.
struct PeftLayer {
  std::string path;    // "block0.attn.q"
  std::string key;     // "base_model.model.model.layers.0.self_attn.q_proj"
  std::string module;  // "q_proj"
  LoRALinearImpl* lora;
};

// Every LoRA-backed Linear of the model, in module order.
inline std::vector<PeftLayer> peft_layers(LlamaImpl& model) {
  const io::LlamaConfig h = to_hf_config(model.config, io::DType::F32);
  std::vector<PeftLayer> out;
  for (const auto& item : model.named_modules()) {
    auto* lin = dynamic_cast<LinearImpl*>(item.value().get());
    if (!lin || !lin->backed()) continue;
    auto* lora = dynamic_cast<LoRALinearImpl*>(lin->backing().get());
    if (!lora) continue;
    const auto hf = detail::torch_errors([&] { return io::hf_name(item.key() + ".weight", h); });
    TORCH_CHECK(hf.has_value(), "peft_layers: '", item.key(), "' has no Hugging Face name");
    const std::string key = "base_model.model." + hf->substr(0, hf->size() - std::string_view(".weight").size());
    out.push_back({item.key(), key, key.substr(key.rfind('.') + 1), lora});
  }
  return out;
}

namespace detail {
// The r, alpha and target modules every adapter of the model shares (PEFT's config holds one of each).
inline PeftAdapters peft_geometry(const std::vector<PeftLayer>& layers, int64_t model_layers) {
  TORCH_CHECK(!layers.empty(), "PEFT adapters: the model has no LoRA adapters (apply_lora first)");
  PeftAdapters a;
  a.r = layers[0].lora->rank(), a.lora_alpha = layers[0].lora->alpha();
  std::map<std::string, int64_t> per_module;
  for (const auto& l : layers) {
    TORCH_CHECK(l.lora->rank() == a.r && l.lora->alpha() == a.lora_alpha, "PEFT adapters: '", l.path, "' has r ", l.lora->rank(),
                " and alpha ", l.lora->alpha(), ", '", layers[0].path, "' r ", a.r, " and alpha ", a.lora_alpha,
                "; adapter_config.json holds one of each");
    ++per_module[l.module];
  }
  for (const auto& [m, n] : per_module) {
    TORCH_CHECK(n == model_layers, "PEFT adapters: ", m, " is adapted in ", n, " of ", model_layers,
                " layers; PEFT's target_modules adapts it in every layer");
    a.target_modules.push_back(m);
  }
  return a;
}

inline nlohmann::json read_json(const std::filesystem::path& file) {
  std::ifstream in(file);
  TORCH_CHECK(bool(in), "cannot open ", file.string());
  std::stringstream ss;
  ss << in.rdbuf();
  auto j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(!j.is_discarded() && j.is_object(), file.string(), ": not a JSON object");
  return j;
}
}  // namespace detail

// Writes <dir>/adapter_model.safetensors (lora_A [r, in] and lora_B [out, r] of every adapted projection, in the
// adapters' dtype, under PEFT's names base_model.model.model.layers.{i}.<module>.lora_{A,B}.weight) and
// <dir>/adapter_config.json (peft_type LORA, task_type CAUSAL_LM, bias "none").
inline PeftAdapters save_peft_adapters(LlamaImpl& model, const std::filesystem::path& dir, const PeftSaveOptions& o = {}) {
  const std::vector<PeftLayer> layers = peft_layers(model);
  PeftAdapters a = detail::peft_geometry(layers, model.config.layers);
  a.lora_dropout = o.lora_dropout;
  a.base_model_name_or_path = o.base_model_name_or_path;
  TORCH_CHECK(o.lora_dropout >= 0 && o.lora_dropout < 1, "save_peft_adapters: lora_dropout must be in [0, 1), got ", o.lora_dropout);

  std::vector<torch::Tensor> keep;  // host copies the TensorRefs point into
  std::map<std::string, io::TensorRef> tensors;
  const auto add = [&](const std::string& key, const torch::Tensor& t) {
    keep.push_back(t.detach().to(torch::kCPU).contiguous());
    tensors[key] = {io_dtype_of(keep.back().scalar_type()), keep.back().sizes().vec(), detail::bytes_of(keep.back())};
  };
  for (const auto& l : layers) {
    add(l.key + ".lora_A.weight", l.lora->lora_A);  // [r, in]
    add(l.key + ".lora_B.weight", l.lora->lora_B);  // [out, r]
  }
  nlohmann::json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = a.base_model_name_or_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.base_model_name_or_path);
  j["r"] = a.r;
  // PEFT writes alpha as given: an integer stays one, a fraction a float.
  j["lora_alpha"] = a.lora_alpha == std::floor(a.lora_alpha) && std::abs(a.lora_alpha) < 1e15 ? nlohmann::json(int64_t(a.lora_alpha))
                                                                                              : nlohmann::json(a.lora_alpha);
  j["lora_dropout"] = a.lora_dropout;
  j["target_modules"] = a.target_modules;
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["layers_to_transform"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["modules_to_save"] = nullptr;
  j["rank_pattern"] = nlohmann::json::object();
  j["alpha_pattern"] = nlohmann::json::object();
  j["revision"] = nullptr;
  j["use_rslora"] = false;
  j["use_dora"] = false;
  detail::torch_errors([&] {
    std::filesystem::create_directories(dir);
    io::save_safetensors(dir / kPeftWeightsFile, tensors, {{"format", "pt"}});
    io::save_json(dir / kPeftConfigFile, j, "save_peft_adapters");
  });
  return a;
}

// Reads <dir>/adapter_config.json and adapter_model.safetensors into the model's LoRA layers (apply_lora first,
// with the same targets and rank). Each layer takes the file's lora_alpha (any positive number). Refused, by key:
// another peft_type or task_type, bias other than "none", use_dora / use_rslora / fan_in_fan_out / lora_bias,
// rank_pattern / alpha_pattern / layers_to_transform / layer_replication / modules_to_save, target_modules as a
// regular expression, an r or targets that differ from the model's, missing, unexpected or mis-shaped tensors.
// Other keys (PEFT's bookkeeping, e.g. init_lora_weights, revision) do not change the adapted function and are ignored.
inline PeftAdapters load_peft_adapters(LlamaImpl& model, const std::filesystem::path& dir) {
  const auto cfg_file = dir / kPeftConfigFile, weights_file = dir / kPeftWeightsFile;
  const nlohmann::json j = detail::read_json(cfg_file);
  const std::string src = cfg_file.string();
  const auto str = [&](const char* k) -> std::optional<std::string> {
    if (!j.contains(k) || j[k].is_null()) return std::nullopt;
    TORCH_CHECK(j[k].is_string(), src, ": '", k, "' must be a string, got ", j[k].dump());
    return j[k].get<std::string>();
  };
  const auto refuse_set = [&](const char* k, const char* why) {
    if (!j.contains(k)) return;
    const auto& v = j[k];
    const bool set = !(v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_object() && v.empty()) || (v.is_array() && v.empty()));
    TORCH_CHECK(!set, src, ": '", k, "': ", v.dump(), " is not supported (", why, ")");
  };
  PeftAdapters a;
  TORCH_CHECK(str("peft_type") == "LORA", src, ": 'peft_type' must be \"LORA\", got ", j.value("peft_type", nlohmann::json()).dump());
  if (const auto t = str("task_type"))
    TORCH_CHECK(*t == "CAUSAL_LM", src, ": 'task_type' '", *t, "' is not supported (a causal LM's adapters are)");
  if (const auto b = str("bias"))
    TORCH_CHECK(*b == "none", src, ": 'bias' '", *b, "' is not supported (squeeze's adapters train no biases)");
  refuse_set("use_dora", "DoRA's magnitude vector is not implemented");
  refuse_set("use_rslora", "rank-stabilised scaling alpha / sqrt(r) is not implemented");
  refuse_set("fan_in_fan_out", "LLaMA's linears store [out, in]");
  refuse_set("lora_bias", "squeeze's adapters have no bias");
  refuse_set("rank_pattern", "one r for every layer");
  refuse_set("alpha_pattern", "one alpha for every layer");
  refuse_set("layers_to_transform", "adapters in every layer");
  refuse_set("layer_replication", "no replicated layers");
  refuse_set("modules_to_save", "only LoRA's A and B are imported");
  TORCH_CHECK(j.contains("r") && j["r"].is_number_integer() && j["r"].get<int64_t>() > 0, src, ": 'r' must be a positive integer, got ",
              j.value("r", nlohmann::json()).dump());
  a.r = j["r"].get<int64_t>();
  TORCH_CHECK(j.contains("lora_alpha") && j["lora_alpha"].is_number() && j["lora_alpha"].get<double>() > 0, src,
              ": 'lora_alpha' must be a positive number, got ", j.value("lora_alpha", nlohmann::json()).dump());
  a.lora_alpha = j["lora_alpha"].get<double>();
  if (j.contains("lora_dropout") && !j["lora_dropout"].is_null()) {
    TORCH_CHECK(j["lora_dropout"].is_number(), src, ": 'lora_dropout' must be a number, got ", j["lora_dropout"].dump());
    a.lora_dropout = j["lora_dropout"].get<double>();
  }
  a.base_model_name_or_path = str("base_model_name_or_path").value_or("");
  TORCH_CHECK(j.contains("target_modules") && j["target_modules"].is_array(), src, ": 'target_modules' must be a list of module names",
              j.contains("target_modules") && j["target_modules"].is_string() ? " (a regular expression is not supported)" : "", ", got ",
              j.value("target_modules", nlohmann::json()).dump());
  std::set<std::string> targets;
  for (const auto& t : j["target_modules"]) {
    TORCH_CHECK(t.is_string(), src, ": 'target_modules' entries must be strings, got ", t.dump());
    targets.insert(t.get<std::string>());
  }
  a.target_modules.assign(targets.begin(), targets.end());

  const std::vector<PeftLayer> layers = peft_layers(model);
  const PeftAdapters have = detail::peft_geometry(layers, model.config.layers);
  const auto joined = [](const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
    return "[" + s + "]";
  };
  TORCH_CHECK(a.target_modules == have.target_modules, src, ": 'target_modules' ", joined(a.target_modules),
              " but the model has LoRA adapters on ", joined(have.target_modules));
  TORCH_CHECK(a.r == have.r, src, ": 'r' is ", a.r, " but the model's adapters have rank ", have.r);

  const io::SafetensorsReader file = detail::torch_errors([&] { return io::SafetensorsReader::open(weights_file); });
  std::set<std::string> expected;
  for (const auto& l : layers)
    for (const char* ab : {".lora_A.weight", ".lora_B.weight"}) expected.insert(l.key + ab);
  for (const auto& [name, _] : file.tensors())
    TORCH_CHECK(expected.count(name), weights_file.string(), ": unexpected tensor '", name, "' (no LoRA layer of the model has that name)");
  // Every tensor is checked before the first adapter changes.
  std::vector<std::pair<std::string, torch::Tensor*>> todo;  // key -> lora_A [r, in] or lora_B [out, r]
  for (const auto& l : layers)
    for (const bool is_a : {true, false}) {
      const std::string key = l.key + (is_a ? ".lora_A.weight" : ".lora_B.weight");
      torch::Tensor& dst = is_a ? l.lora->lora_A : l.lora->lora_B;
      TORCH_CHECK(file.contains(key), weights_file.string(), ": missing tensor '", key, "' (for ", l.path, ")");
      const io::TensorInfo& info = file.info(key);
      TORCH_CHECK(info.shape == dst.sizes().vec(), weights_file.string(), ": tensor '", key, "' is ", io::shape_string(info.shape), ", ",
                  l.path, (is_a ? "'s lora_A is " : "'s lora_B is "), dst.sizes());
      TORCH_CHECK(io::is_float_dtype(info.dtype), weights_file.string(), ": tensor '", key, "' has dtype ",
                  std::string(io::dtype_name(info.dtype)));
      todo.emplace_back(key, &dst);
    }
  torch::NoGradGuard no_grad;
  for (const auto& [key, dst] : todo) {
    const io::TensorInfo& info = file.info(key);
    torch::Tensor buf = torch::empty(info.shape, torch::TensorOptions().dtype(torch_dtype_of(info.dtype)));
    detail::torch_errors([&] { file.read_bytes(key, detail::writable_bytes_of(buf)); });
    dst->copy_(buf);
  }
  for (const auto& l : layers) l.lora->set_alpha(a.lora_alpha);
  return a;
}

}  // namespace squeeze::nn
