#pragma once
// Post-training weight quantization of the LLaMA example's model (include/squeeze/nn/llama.hpp): RTN and
// GPTQ of the seven linears of every block (q, k, v, o, gate, up, down; the embedding, the norms and the LM
// head stay dense, as in the GPTQ paper), perplexity with the packed weights, and packed checkpoints.
//
//   quantize(model, spec, calibration)  RTN: each weight on its own. GPTQ: block by block; the block's input
//       on the calibration windows is kept, each true-sequential step ([q k v], [o], [gate up], [down]) runs
//       the block to collect its layers' Hessians (nn::HessianCapture through CaptureLinear; each forward stops
//       once those layers have seen their input), solves them with nn::gptq_quantize and writes the dequantized
//       result back, so later steps and blocks see the outputs of the quantized layers. The forwards run in the
//       calibration's dtype (bf16 on CUDA by default), the solver on the float weights. Each layer also reports
//       its output error on the calibration inputs, tr(D H D^T) / tr(W H W^T) with D = W_hat - W, for GPTQ and
//       for RTN on the same Hessian; the result holds the seconds of each phase (forwards, solves, packing, errors).
//   use_packed(model, layers)  swaps every block linear for an nn::QuantizedLinear built from its packed
//       form: the perplexity is computed with the packed weights actually used in the forward (CPU: the
//       layer's dequantized weights in float; CUDA, from an nvcc translation unit: its GEMM/GEMV kernels).
//   save_packed / load_packed  the AutoGPTQ v1 layout (io::save_quantized: model.safetensors +
//       quantize_config.json) plus the dense tensors in float and a config.json with the geometry (and the
//       model's Hugging Face config, so a model that came from one converts back to its own).
//   hf_gptq_model / export_hf_gptq  the quantized model in the Hugging Face GPTQ layout (io/hf_gptq.hpp), written
//       to a temporary directory, read back and compared, then renamed into place.
//   shard_windows  calibration and validation windows from llm.c-style token shards (io/token_shards.hpp).
#include <squeeze/io/hf_gptq.hpp>
#include <squeeze/io/posix_file.hpp>
#include <squeeze/io/token_shards.hpp>
#include <squeeze/nn/gptq.hpp>
#include <squeeze/nn/hf_llama.hpp>
#include <squeeze/nn/llama.hpp>
#include <squeeze/nn/lora.hpp>
#include <squeeze/nn/quantized_linear.hpp>
#include <squeeze/nn/rtn.hpp>
#include <squeeze/io/gptq_file.hpp>
#include <squeeze/quant/rtn.hpp>

#include <unistd.h>

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace squeeze::llama_gptq {

using nn::Llama;
using nn::LlamaConfig;

// ---- the layers --------------------------------------------------------------------------------------
// Child paths inside a block, in true-sequential steps (layers of one step share their input).
inline const std::vector<std::vector<std::string>>& block_steps() {
  static const std::vector<std::vector<std::string>> steps = {{"attn.q", "attn.k", "attn.v"}, {"attn.o"}, {"mlp.gate", "mlp.up"}, {"mlp.down"}};
  return steps;
}
inline std::vector<std::string> block_linears() {
  std::vector<std::string> out;
  for (const auto& s : block_steps()) out.insert(out.end(), s.begin(), s.end());
  return out;
}
// "block3.mlp.down": the name of the layer in checkpoints (its weight is "block3.mlp.down.weight").
inline std::string layer_name(int64_t block, const std::string& path) { return "block" + std::to_string(block) + "." + path; }

// The module that holds a block linear as a child, and the child's name ("attn.q" -> (attn, "q")).
inline std::pair<torch::nn::Module*, std::string> parent_of(Llama& model, int64_t block, const std::string& path) {
  const auto dot = path.find('.');
  const std::string sub = path.substr(0, dot), child = path.substr(dot + 1);
  auto& b = model->blocks.at(size_t(block));
  torch::nn::Module* parent = sub == "attn" ? static_cast<torch::nn::Module*>(b->attn.get()) : static_cast<torch::nn::Module*>(b->mlp.get());
  return {parent, child};
}

// The dense weight [out, in] of a block linear as it is now (ShardedLinear, Linear or CaptureLinear).
torch::Tensor dense_weight(Llama& model, int64_t block, const std::string& path);

// A block linear that is being replaced stays reachable through its block's typed member (attn->q, ...): it lets go
// of its weight, so replaced weights are neither kept alive nor moved between devices for nothing.
inline void release_replaced_weight(torch::nn::Module* parent, const std::string& child) {
  if (auto old = std::dynamic_pointer_cast<nn::LinearImpl>(parent->named_children()[child])) {
    torch::NoGradGuard ng;
    old->weight.set_data(torch::empty({0}, old->weight.options()));
  }
}

// A dense linear that feeds its inputs to the active nn::HessianCapture (nn::observe), for calibration. It holds
// `weight` itself, not a copy (quantize() writes the dequantized weights into it).
class CaptureLinearImpl : public torch::nn::Module, public nn::LinearForward {
 public:
  explicit CaptureLinearImpl(const torch::Tensor& weight /*[out, in]*/) {
    // Built 1 x 1 and then given the weight (its options keep saying 1 x 1): built at full size, torch::nn::Linear
    // would first draw a random weight of that size on the host (about half a minute of one core for a 7B model).
    linear = register_module("linear", torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false)));
    torch::NoGradGuard ng;
    linear->weight.set_data(weight.detach());
  }
  torch::Tensor forward_linear(const torch::Tensor& x) override { return nn::observe(linear, x); }
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(CaptureLinear);

inline torch::Tensor dense_weight(Llama& model, int64_t block, const std::string& path) {
  auto [parent, child] = parent_of(model, block, path);
  const auto m = parent->named_children()[child];
  if (auto l = std::dynamic_pointer_cast<nn::LinearImpl>(m)) {
    TORCH_CHECK(!l->has_bias(), "llama_gptq: ", layer_name(block, path), " has a bias; the LLaMA block linears have none");
    return l->weight;
  }
  if (auto l = std::dynamic_pointer_cast<CaptureLinearImpl>(m)) return l->linear->weight;
  TORCH_CHECK(false, "llama_gptq: ", layer_name(block, path), " is already packed (use a fresh copy of the dense model)");
  return {};
}

// ---- what to do ----------------------------------------------------------------------------------------
enum class Method { RTN, GPTQ };
inline const char* method_name(Method m) { return m == Method::RTN ? "rtn" : "gptq"; }

struct QuantSpec {
  Method method = Method::GPTQ;
  int bits = 4;
  int group_size = 128;     // 0: one group per output channel (-1 in files and on the command line)
  bool sym = false;         // asymmetric min-max grid, as in the GPTQ paper's experiments
  bool act_order = false;   // GPTQ only
  double percdamp = 0.01;   // GPTQ only
  std::string tag() const {
    return std::string(method_name(method)) + "-w" + std::to_string(bits) + "-" + (group_size > 0 ? "g" + std::to_string(group_size) : "channel") +
           (act_order && method == Method::GPTQ ? "-actorder" : "");
  }
  void validate() const {
    TORCH_CHECK(quant::supported_bits(bits), "unsupported bit width ", bits, ": GPTQ/RTN checkpoints hold 2, 3, 4 or 8 bits");
    TORCH_CHECK(group_size >= 0, "group size must be positive, or -1 / 'channel' for one group per output channel; got ", group_size);
    TORCH_CHECK(percdamp >= 0, "percdamp must be >= 0");
  }
};

struct LayerReport {
  std::string name;
  int64_t out = 0, in = 0;
  double error = NAN;      // tr(D H D^T) / tr(W H W^T) of the chosen method (NaN for RTN without calibration)
  double rtn_error = NAN;  // the same for RTN on the same Hessian (GPTQ runs only)
  double seconds = 0;  // this layer's solve, packing and errors (the forwards are QuantizeResult::calibration_s)
  double damp = 0;
};

struct QuantizeResult {
  std::map<std::string, quant::PackedLinear> layers;
  std::vector<LayerReport> reports;  // in quantization order
  double seconds = 0;                // wall time of the whole quantization (calibration forwards included)
  // Where the time went, summed over blocks and layers. Each phase waits for its device work before its clock stops,
  // so GPU time is counted in the phase that queued it.
  double calibration_s = 0;  // GPTQ: the calibration forwards, their Hessian accumulation included
  double solve_s = 0;        // nn::gptq_quantize (RTN: nn::rtn_quantize), the dequantized weights written back
  double pack_s = 0;         // the v1 bit streams and their copy to the host
  double error_s = 0;        // GPTQ: RTN on the same weights and both output errors
  std::string phase_summary() const {
    char b[200];
    std::snprintf(b, sizeof b, "%.1f s: calibration forwards %.1f s, solve %.1f s, pack %.1f s, rtn + errors %.1f s", seconds,
                  calibration_s, solve_s, pack_s, error_s);
    return b;
  }
  int64_t packed_bytes() const {     // qweight + qzeros + fp16 scales + g_idx (+ bias) of the quantized linears
    int64_t b = 0;
    for (const auto& [_, p] : layers)
      b += int64_t(p.qweight.size() * 4 + p.qzeros.size() * 4 + p.scales.size() * 2 + p.g_idx.size() * 4 + p.bias.size() * 2);
    return b;
  }
  int64_t dense_fp16_bytes() const {  // the same layers in fp16
    int64_t b = 0;
    for (const auto& [_, p] : layers) b += p.in * p.out * 2;
    return b;
  }
};

// Progress lines: one call per event; `\r`-updated on a terminal, every line otherwise.
using ProgressFn = std::function<void(const std::string&)>;

// ---- calibration ---------------------------------------------------------------------------------------
// Calibration windows [n, T] int64, split into chunks of at most `chunk` sequences for the forwards.
struct Calibration {
  std::vector<torch::Tensor> ids;  // each [b, T] int64 on the model's device
  // The calibration forwards' dtype: the block's weights are cast to it for each forward (the solver keeps the float
  // weights) and the activations between blocks are kept in it; the Hessians accumulate in fp32 either way.
  torch::ScalarType dtype = torch::kFloat32;
  int64_t tokens() const {
    int64_t n = 0;
    for (const auto& t : ids) n += t.numel();
    return n;
  }
};

// bf16 on CUDA (tensor-core GEMMs and the flash attention kernel, which fp32 forwards do without), float on the CPU.
inline torch::ScalarType default_calibration_dtype(torch::Device device) { return device.is_cuda() ? torch::kBFloat16 : torch::kFloat32; }

inline Calibration make_calibration(const torch::Tensor& windows /*[n, T]*/, int64_t chunk, torch::Device device,
                                    std::optional<torch::ScalarType> dtype = std::nullopt) {
  TORCH_CHECK(windows.dim() == 2 && windows.size(0) > 0, "calibration windows must be [n, T] with n > 0");
  TORCH_CHECK(chunk > 0, "calibration chunk must be at least one window, got ", chunk);
  Calibration c;
  c.dtype = dtype.value_or(default_calibration_dtype(device));
  TORCH_CHECK(c.dtype == torch::kFloat32 || c.dtype == torch::kBFloat16, "calibration dtype must be float or bf16, got ", c.dtype);
  for (int64_t i = 0; i < windows.size(0); i += chunk) c.ids.push_back(windows.narrow(0, i, std::min(chunk, windows.size(0) - i)).to(device));
  return c;
}

namespace detail {
// tr(D H D^T) / tr(W H W^T) with D = W_hat - W for each W_hat: the layer's output error on the calibration inputs,
// relative to its output (fp64 on H's device; tr(W H W^T) once for all of them).
inline std::vector<double> relative_output_errors(const torch::Tensor& W, const std::vector<torch::Tensor>& quantized, const torch::Tensor& H) {
  const auto w = W.to(torch::kFloat64), h = H.to(torch::kFloat64);
  const double den = (w.matmul(h) * w).sum().item<double>();
  std::vector<double> errors;
  for (const auto& What : quantized) {
    const auto d = What.to(torch::kFloat64) - w;
    const double num = (d.matmul(h) * d).sum().item<double>();
    errors.push_back(den > 0 ? num / den : num);
  }
  return errors;
}

// Waits for the work queued on `device`, so that a phase's clock holds its own GPU time.
inline void synchronize(torch::Device device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}
}  // namespace detail

// Runs f() with the parameters of `module` converted to `dtype`, the originals restored afterwards (also when f throws).
// The model: the dense reference evaluated in the evaluation dtype without building a second model (for 7B: no second
// copy of its weights, and no minute of host-side construction). A block: its calibration forwards in bf16 while the
// solver reads and writes the float weights.
template <class F>
decltype(auto) with_parameters_in(torch::nn::Module& module, torch::ScalarType dtype, F&& f) {
  struct Restore {
    std::vector<torch::Tensor> params, kept;
    ~Restore() {
      torch::NoGradGuard ng;
      for (size_t i = 0; i < kept.size(); ++i) params[i].set_data(kept[i]);
    }
  } restore;
  {
    torch::NoGradGuard ng;
    for (auto& p : module.parameters()) {
      if (p.scalar_type() == dtype) continue;
      restore.params.push_back(p);
      restore.kept.push_back(p.data());
      p.set_data(p.to(dtype));
    }
  }
  return f();
}
template <class F>
decltype(auto) with_parameters_in(Llama& model, torch::ScalarType dtype, F&& f) {
  return with_parameters_in(*model, dtype, std::forward<F>(f));
}

// Quantizes the block linears of `model` (dense, float, left with the dequantized weights in place: a
// CaptureLinear per layer). GPTQ needs `calib`; RTN ignores it. RTN, the GPTQ solves, the output errors and the bit
// packing run on the model's device; only the packed words come to the host.
inline QuantizeResult quantize(Llama& model, const QuantSpec& spec, const Calibration& calib, const ProgressFn& progress = {}) {
  spec.validate();
  TORCH_CHECK(spec.method == Method::RTN || !calib.ids.empty(), "GPTQ needs calibration data (--calib-tokens > 0)");
  TORCH_CHECK(calib.dtype == torch::kFloat32 || calib.dtype == torch::kBFloat16, "calibration dtype must be float or bf16, got ", calib.dtype);
  torch::NoGradGuard ng;
  model->eval();
  using Clock = std::chrono::steady_clock;
  const auto t_start = Clock::now();
  const auto seconds_since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  const int64_t L = model->config.layers;
  const auto device = model->parameters().front().device();
  QuantizeResult res;
  const std::string tag = spec.tag();
  char line[320];
  // The clock of one phase, stopped once the device has done what the phase queued.
  const auto add_phase = [&](double& phase, Clock::time_point t0) {
    detail::synchronize(device);
    const double s = seconds_since(t0);
    phase += s;
    return s;
  };

  // Every block linear becomes a CaptureLinear holding its weight (forward_linear reaches it by name).
  std::map<std::string, CaptureLinear> layers;
  for (int64_t b = 0; b < L; ++b)
    for (const auto& path : block_linears()) {
      auto [parent, child] = parent_of(model, b, path);
      CaptureLinear cl(dense_weight(model, b, path).to(torch::kFloat32));
      release_replaced_weight(parent, child);
      parent->replace_module(child, cl);
      layers.emplace(layer_name(b, path), cl);
    }

  if (spec.method == Method::RTN) {
    for (int64_t b = 0; b < L; ++b)
      for (const auto& path : block_linears()) {
        const std::string name = layer_name(b, path);
        auto& w = layers.at(name)->linear->weight;
        auto t0 = Clock::now();
        const nn::RtnResult r = nn::rtn_quantize(w, spec.bits, spec.group_size, spec.sym);
        w.copy_(r.dequantized);
        double seconds = add_phase(res.solve_s, t0);
        t0 = Clock::now();
        auto p = r.pack();
        seconds += add_phase(res.pack_s, t0);
        res.reports.push_back({name, p.out, p.in, NAN, NAN, seconds, 0});
        res.layers.emplace(name, std::move(p));
        if (progress) {
          std::snprintf(line, sizeof line, "[%s] block %lld/%lld  %-18s %5lldx%-5lld", tag.c_str(), (long long)(b + 1), (long long)L,
                        name.c_str(), (long long)res.reports.back().out, (long long)res.reports.back().in);
          progress(line);
        }
      }
    res.seconds = seconds_since(t_start);
    if (progress) progress("[" + tag + "] quantized in " + res.phase_summary());
    return res;
  }

  nn::GptqOptions opt;
  opt.bits = spec.bits;
  opt.group_size = spec.group_size;
  opt.sym = spec.sym;
  opt.act_order = spec.act_order;
  opt.percdamp = spec.percdamp;

  // The input of block 0 on every calibration chunk, then block by block: [b, T, h] each, in the calibration dtype.
  const int64_t T = calib.ids.front().size(1);
  const auto [cos, sin] = nn::rope_tables(T, model->config, device);  // the config's RoPE, scaled where it says so
  std::vector<torch::Tensor> x;
  {
    const auto t0 = Clock::now();
    for (const auto& ids : calib.ids) x.push_back(model->embed(ids).to(calib.dtype));
    add_phase(res.calibration_s, t0);
  }

  const int64_t total = L * int64_t(block_linears().size());
  for (int64_t b = 0; b < L; ++b) {
    auto& block = model->blocks[size_t(b)];
    for (const auto& step : block_steps()) {
      std::vector<nn::NamedLinear> named;
      for (const auto& path : step) named.emplace_back(layer_name(b, path), layers.at(layer_name(b, path))->linear);
      {
        // Each forward ends once this step's layers have seen their input (nn::CaptureComplete); they see the outputs
        // of the quantized layers before them.
        nn::HessianCapture capture(named, /*stop_when_complete=*/true);
        const auto t0 = Clock::now();
        with_parameters_in(*block, calib.dtype, [&] {
          for (const auto& xi : x) {
            try {
              (void)block->forward(xi, cos, sin);
            } catch (const nn::CaptureComplete&) {
            }
          }
        });
        add_phase(res.calibration_s, t0);
        for (const auto& [name, lin] : named) {
          const auto& h = capture.at(name);
          TORCH_CHECK(h.samples() > 0, "llama_gptq: ", name, " saw no calibration input");
          auto t = Clock::now();
          const torch::Tensor W = lin->weight.detach().clone();  // [out, in] float
          const nn::GptqResult r = nn::gptq_quantize(W, h.matrix(), opt);
          lin->weight.copy_(r.dequantized);
          LayerReport rep{name, W.size(0), W.size(1), 0, 0, 0, r.damp_fraction};
          rep.seconds = add_phase(res.solve_s, t);
          t = Clock::now();
          auto p = r.pack();
          rep.seconds += add_phase(res.pack_s, t);
          t = Clock::now();
          const nn::RtnResult rtn = nn::rtn_quantize(W, spec.bits, spec.group_size, spec.sym);
          const std::vector<double> errors = detail::relative_output_errors(W, {r.dequantized, rtn.dequantized}, h.matrix());
          rep.error = errors[0], rep.rtn_error = errors[1];
          rep.seconds += add_phase(res.error_s, t);
          res.reports.push_back(rep);
          res.layers.emplace(name, std::move(p));
          if (progress) {
            std::snprintf(line, sizeof line, "[%s] layer %3zu/%lld  %-18s %5lldx%-5lld  output error %.3e (rtn %.3e)  %.2fs", tag.c_str(),
                          res.reports.size(), (long long)total, name.c_str(), (long long)rep.out, (long long)rep.in, rep.error,
                          rep.rtn_error, rep.seconds);
            progress(line);
          }
        }
      }
    }
    // the next block's input, through this quantized block
    const auto t0 = Clock::now();
    with_parameters_in(*block, calib.dtype, [&] {
      for (auto& xi : x) xi = block->forward(xi, cos, sin);
    });
    add_phase(res.calibration_s, t0);
  }
  res.seconds = seconds_since(t_start);
  if (progress) progress("[" + tag + "] quantized in " + res.phase_summary());
  return res;
}

// Replaces every block linear by an nn::QuantizedLinear of its packed form (on the model's device). Convert
// the model to its evaluation dtype first: the packed buffers keep their own types. The layers are built on libtorch's
// intra-op threads (each builds the fused GEMM's tiles on the host: 0.16 s for a 7B MLP layer on one core, so tens of
// seconds for the whole 7B model on one), then moved to the device and registered in order.
inline void use_packed(Llama& model, const std::map<std::string, quant::PackedLinear>& layers) {
  const auto device = model->parameters().front().device();
  std::vector<std::pair<int64_t, std::string>> places;  // (block, path) of each layer, in order
  std::vector<const quant::PackedLinear*> packed;
  for (int64_t b = 0; b < model->config.layers; ++b)
    for (const auto& path : block_linears()) {
      const std::string name = layer_name(b, path);
      const auto it = layers.find(name);
      TORCH_CHECK(it != layers.end(), "packed weights: no layer '", name, "'");
      places.emplace_back(b, path);
      packed.push_back(&it->second);
    }
  std::vector<nn::QuantizedLinear> built(packed.size(), nn::QuantizedLinear(nullptr));
  at::parallel_for(0, int64_t(packed.size()), 1, [&](int64_t first, int64_t last) {  // a worker's error is rethrown here
    for (int64_t i = first; i < last; ++i) built[size_t(i)] = nn::QuantizedLinear(*packed[size_t(i)]);
  });
  for (size_t i = 0; i < built.size(); ++i) {
    auto [parent, child] = parent_of(model, places[i].first, places[i].second);
    // registered as it is, so nn::apply_lora adopts it as a LoRA base (forward_linear calls it directly)
    built[i]->to(device);
    release_replaced_weight(parent, child);
    parent->replace_module(child, built[i]);
  }
}

// ---- evaluation ----------------------------------------------------------------------------------------
struct Eval {
  double loss = NAN;  // mean next-token cross-entropy (nats per byte)
  double kl = NAN;    // with a reference model: mean KL(reference || model) of the next-token distributions
  double ppl() const { return std::exp(loss); }
  int64_t tokens = 0;
  double seconds = 0;
};

// Validation loss of `model` on (x, y) batches; with `reference` (e.g. the dense model) also how far its
// predictions moved: a low-noise measure of quantization damage where the loss change is tiny.
inline Eval evaluate(Llama& model, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches, const ProgressFn& progress = {},
                     const std::string& what = "eval", Llama* reference = nullptr) {
  TORCH_CHECK(!batches.empty(), "evaluation: no validation batches");
  torch::NoGradGuard ng;
  model->eval();
  if (reference) (*reference)->eval();
  const auto t0 = std::chrono::steady_clock::now();
  Eval e;
  double sum = 0, kl = 0;
  for (size_t i = 0; i < batches.size(); ++i) {
    const auto& [x, y] = batches[i];
    const torch::Tensor logp = torch::log_softmax(model->forward(x).to(torch::kFloat32), -1);  // [B, T, V]
    sum += torch::nll_loss(logp.reshape({-1, logp.size(-1)}), y.reshape({-1})).item<double>();
    if (reference) {
      const torch::Tensor ref = torch::log_softmax((*reference)->forward(x).to(torch::kFloat32), -1);  // [B, T, V]
      kl += (ref.exp() * (ref - logp)).sum(-1).mean().item<double>();
    }
    e.tokens += y.numel();
    if (progress) {
      char line[160];
      const int width = 24, filled = int(double(i + 1) / double(batches.size()) * width);
      std::snprintf(line, sizeof line, "[%s] batch %zu/%zu [%s%s] loss %.4f", what.c_str(), i + 1, batches.size(), std::string(filled, '#').c_str(),
                    std::string(width - filled, '.').c_str(), sum / double(i + 1));
      progress(line);
    }
  }
  e.loss = sum / double(batches.size());
  if (reference) e.kl = kl / double(batches.size());
  e.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return e;
}

// ---- packed checkpoints --------------------------------------------------------------------------------
inline constexpr const char* kConfigFormat = "squeeze-llama-gptq-1";

// What quantize_config.json says about a spec (the packed format and the Hugging Face layout alike).
inline io::QuantizeConfig quantize_config(const QuantSpec& spec) {
  spec.validate();
  io::QuantizeConfig qc;
  qc.bits = spec.bits;
  qc.group_size = spec.group_size;
  qc.sym = spec.sym;
  qc.desc_act = spec.method == Method::GPTQ && spec.act_order;
  qc.damp_percent = spec.percdamp;
  qc.true_sequential = true;
  return qc;
}

// The dense (unquantized) tensors: embedding, norms, head.
inline bool is_dense_tensor(const std::string& name) {
  return name == "embed.weight" || name == "head.weight" || name.ends_with("norm.weight");
}

// `source`: the Hugging Face config the model came from (what nn::LlamaConfig does not hold: positions, token ids),
// kept in config.json's "hf_config" with the rest of the network (tied embeddings, head_dim, RoPE scaling).
inline void save_packed(const std::filesystem::path& dir, Llama& model, const std::map<std::string, quant::PackedLinear>& layers,
                        const QuantSpec& spec, const std::optional<io::LlamaConfig>& source = std::nullopt) {
  const io::QuantizeConfig qc = quantize_config(spec);
  std::vector<std::pair<std::string, torch::Tensor>> keep;  // owns the float copies while they are written
  std::map<std::string, io::TensorRef> extra;
  for (const auto& p : model->named_parameters()) {
    if (!is_dense_tensor(p.key())) continue;
    keep.emplace_back(p.key(), p.value().detach().to(torch::kCPU, torch::kFloat32).contiguous());
    const auto& t = keep.back().second;
    extra[p.key()] = io::tensor_ref<float>(io::DType::F32, t.sizes().vec(), {t.data_ptr<float>(), size_t(t.numel())});
  }
  io::save_quantized(dir, layers, qc, extra);
  const LlamaConfig& c = model->config;
  const nlohmann::json j = {{"format", kConfigFormat}, {"preset", c.name},        {"method", method_name(spec.method)},
                            {"vocab", c.vocab},        {"hidden", c.hidden},      {"layers", c.layers},
                            {"heads", c.heads},        {"kv_heads", c.kv_heads},  {"ffn", c.ffn},
                            {"rope_theta", c.rope_theta}, {"norm_eps", c.norm_eps},
                            {"hf_config", io::llama_config_json(nn::to_hf_config(c, io::DType::F32, source))}};
  const auto path = dir / "config.json", tmp = dir / "config.json.tmp";
  {
    std::ofstream f(tmp);
    TORCH_CHECK(bool(f), "cannot write ", tmp.string());
    f << j.dump(2) << "\n";
    f.flush();
    TORCH_CHECK(bool(f), "write to ", tmp.string(), " failed");
  }
  std::filesystem::rename(tmp, path);
}

struct LoadedModel {
  Llama model{nullptr};
  QuantSpec spec;
  std::map<std::string, quant::PackedLinear> layers;
  std::optional<io::LlamaConfig> hf_config;  // config.json's "hf_config" (directories written before it: none)
};

// Reads a directory written by save_packed; the model is on `device` in `dtype` with QuantizedLinear layers.
inline LoadedModel load_packed(const std::filesystem::path& dir, torch::Device device, torch::ScalarType dtype) {
  TORCH_CHECK(std::filesystem::is_directory(dir), "quantized model file '", dir.string(), "' is not a directory");
  std::ifstream f(dir / "config.json");
  TORCH_CHECK(bool(f), "quantized model file '", dir.string(), "' has no config.json (written by llama_gptq --save)");
  const auto j = nlohmann::json::parse(f, nullptr, false);
  TORCH_CHECK(!j.is_discarded() && j.is_object() && j.value("format", "") == kConfigFormat, "'", (dir / "config.json").string(),
              "' is not a llama_gptq model config (format tag missing or of another version)");
  LlamaConfig c;
  try {
    c.name = j.at("preset").get<std::string>();
    c.vocab = j.at("vocab").get<int64_t>(), c.hidden = j.at("hidden").get<int64_t>(), c.layers = j.at("layers").get<int64_t>();
    c.heads = j.at("heads").get<int64_t>(), c.kv_heads = j.at("kv_heads").get<int64_t>(), c.ffn = j.at("ffn").get<int64_t>();
    c.rope_theta = j.at("rope_theta").get<double>(), c.norm_eps = j.at("norm_eps").get<double>();
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "'", (dir / "config.json").string(), "': ", e.what());
  }
  // The Hugging Face config holds the whole network (tied embeddings, head_dim, RoPE scaling); the fields above,
  // written for readers that predate it, must say the same.
  std::optional<io::LlamaConfig> hf_config;
  if (j.contains("hf_config")) {
    const std::string src = (dir / "config.json").string() + " hf_config";
    hf_config = nn::detail::torch_errors([&] { return io::llama_config_from_json(j["hf_config"], src); });
    const LlamaConfig h = nn::from_hf_config(*hf_config, c.name);
    const std::vector<std::tuple<const char*, int64_t, int64_t>> fields = {{"vocab", c.vocab, h.vocab},       {"hidden", c.hidden, h.hidden},
                                                                           {"layers", c.layers, h.layers},    {"heads", c.heads, h.heads},
                                                                           {"kv_heads", c.kv_heads, h.kv_heads}, {"ffn", c.ffn, h.ffn}};
    for (const auto& [field, mine, theirs] : fields)
      TORCH_CHECK(mine == theirs, "'", (dir / "config.json").string(), "': ", field, " is ", mine, " but its hf_config says ", theirs);
    c = h;
  }
  c.validate();

  io::QuantizedModelFile ck = io::load_quantized(dir);  // checks every layer's tensors against quantize_config.json
  LoadedModel out;
  out.spec.method = j.value("method", "gptq") == "rtn" ? Method::RTN : Method::GPTQ;
  out.spec.bits = ck.config.bits;
  out.spec.group_size = ck.config.group_size;
  out.spec.sym = ck.config.sym;
  out.spec.act_order = ck.config.desc_act;
  out.spec.percdamp = ck.config.damp_percent;

  // Uninitialised in the evaluation dtype on the device: the dense tensors are read below, the block linears replaced.
  Llama model(c, nn::ParamInit{torch::TensorOptions().dtype(dtype).device(device), /*random=*/false});
  torch::NoGradGuard ng;
  for (auto& p : model->named_parameters()) {
    if (!is_dense_tensor(p.key())) continue;
    TORCH_CHECK(ck.file.contains(p.key()), "quantized model file '", dir.string(), "' has no tensor '", p.key(), "'");
    const auto& info = ck.file.info(p.key());
    TORCH_CHECK(info.shape == p.value().sizes().vec(), "quantized model file '", dir.string(), "': ", p.key(), " is ",
                c10::IntArrayRef(info.shape), ", the model (config.json) expects ", p.value().sizes());
    const auto v = ck.file.read<float>(p.key(), io::DType::F32);
    p.value().copy_(torch::from_blob(const_cast<float*>(v.data()), p.value().sizes(), torch::kFloat32));
  }
  for (int64_t b = 0; b < c.layers; ++b)
    for (const auto& path : block_linears()) {
      const std::string name = layer_name(b, path);
      const auto it = ck.layers.find(name);
      TORCH_CHECK(it != ck.layers.end(), "quantized model file '", dir.string(), "' has no packed layer '", name, "'");
      const auto want = dense_weight(model, b, path).sizes();
      TORCH_CHECK(it->second.out == want[0] && it->second.in == want[1], "quantized model file '", dir.string(), "': ", name, " is ",
                  it->second.out, "x", it->second.in, ", the model (config.json) expects ", want);
    }
  TORCH_CHECK(int64_t(ck.layers.size()) == c.layers * int64_t(block_linears().size()), "quantized model file '", dir.string(), "' holds ",
              ck.layers.size(), " packed layers, the model has ", c.layers * int64_t(block_linears().size()));
  use_packed(model, ck.layers);
  out.model = model;
  out.layers = std::move(ck.layers);
  out.hf_config = std::move(hf_config);
  return out;
}

// ---- the Hugging Face GPTQ layout -------------------------------------------------------------------------
// The quantized model as io::save_hf_gptq takes it: the packed block linears as they are, the dense tensors
// (embedding, norms, head) from `model` as float (the file stores them in fp16), config.json's network from the
// model and the rest (positions, token ids) from `source`, the config the model was loaded from, where there is one.
inline io::HfGptqModel hf_gptq_model(Llama& model, const std::map<std::string, quant::PackedLinear>& layers, const QuantSpec& spec,
                                     const std::optional<io::LlamaConfig>& source = std::nullopt) {
  io::HfGptqModel m;
  m.config = nn::to_hf_config(model->config, io::DType::F16, source);
  m.quant = quantize_config(spec);
  m.layers = layers;
  torch::NoGradGuard ng;
  for (const auto& p : model->named_parameters()) {
    if (!is_dense_tensor(p.key())) continue;
    const torch::Tensor t = p.value().detach().to(torch::kCPU, torch::kFloat32).contiguous();
    m.dense[p.key()] = std::vector<float>(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
  }
  return m;
}

// Rounds the model's dense tensors to fp16 values (in their own dtype), so that the model evaluated is the one the
// Hugging Face layout stores.
inline void round_dense_to_half(Llama& model) {
  torch::NoGradGuard ng;
  for (auto& p : model->named_parameters())
    if (is_dense_tensor(p.key())) p.value().copy_(p.value().to(torch::kHalf));
}

// An export directory must be absent or empty; with `force` a non-empty one is replaced (after the new one is whole).
inline void check_export_target(const std::filesystem::path& out, bool force) {
  namespace fs = std::filesystem;
  TORCH_CHECK(!out.empty(), "--export-hf: no directory given");
  if (!fs::exists(out)) return;
  TORCH_CHECK(fs::is_directory(out), "--export-hf ", out.string(), ": exists and is not a directory");
  TORCH_CHECK(force || fs::is_empty(out), "--export-hf ", out.string(),
              ": the directory exists and is not empty; pass --force to replace it (the old one is removed only once the new "
              "export is complete)");
}

// --export-hf writes one quantized model: one method, one bit width, one group size.
inline void check_single_export(const std::vector<int>& bits, const std::vector<int>& groups, const std::vector<Method>& methods) {
  const auto several = [](size_t n, const char* what, const char* flag) {
    TORCH_CHECK(n == 1, "--export-hf writes one quantized model, but ", flag, " asks for ", n, " ", what, ": give one --bits, one --group ",
                "and one --methods with --export-hf");
  };
  several(bits.size(), "bit widths", "--bits");
  several(groups.size(), "group sizes", "--group");
  several(methods.size(), "methods", "--methods");
}

namespace detail {
// The read-back export against what was written: the packed tensors bit for bit, the dense tensors as their fp16.
inline void check_export_reads_back(const std::filesystem::path& dir, const io::HfGptqModel& written) {
  const io::HfGptqModel back = nn::detail::torch_errors([&] { return io::load_hf_gptq(dir); });
  const std::string src = "--export-hf: the export read back from " + dir.string();
  TORCH_CHECK(back.layers.size() == written.layers.size(), src, " holds ", back.layers.size(), " quantized layers, ",
              written.layers.size(), " were written");
  for (const auto& [name, p] : written.layers) {
    const auto it = back.layers.find(name);
    TORCH_CHECK(it != back.layers.end(), src, " has no layer ", name);
    const quant::PackedLinear& r = it->second;
    const bool scales_equal = r.scales.size() == p.scales.size() &&
                              std::memcmp(r.scales.data(), p.scales.data(), p.scales.size() * sizeof(half)) == 0;
    TORCH_CHECK(r.in == p.in && r.out == p.out && r.bits == p.bits && r.group_size == p.group_size && r.qweight == p.qweight &&
                    r.qzeros == p.qzeros && r.g_idx == p.g_idx && scales_equal,
                src, ": layer ", name, " differs from the one written");
  }
  for (const auto& [name, v] : written.dense) {
    const auto it = back.dense.find(name);
    TORCH_CHECK(it != back.dense.end(), src, " has no dense tensor ", name);
    TORCH_CHECK(io::encode_float(io::DType::F16, it->second) == io::encode_float(io::DType::F16, v), src, ": ", name,
                " differs from the fp16 of the tensor written");
  }
}
}  // namespace detail

// Writes `m` to `out` whole or not at all: into a temporary directory beside it (plus `copy_files` that exist, as
// they are: a source model's tokenizer), read back and compared, then renamed to `out`. An empty `out` is replaced;
// a non-empty one only with `force`, and it is removed only after the new export is in place. On an error the
// temporary directory is removed and `out` is as it was.
inline void export_hf_gptq(const std::filesystem::path& out, const io::HfGptqModel& m, bool force,
                           const std::vector<std::filesystem::path>& copy_files = {}) {
  namespace fs = std::filesystem;
  check_export_target(out, force);
  const fs::path target = fs::absolute(out).lexically_normal();
  const fs::path parent = target.parent_path(), name = target.filename();
  fs::create_directories(parent);
  const std::string token = std::to_string(::getpid());
  const fs::path tmp = parent / (name.string() + ".tmp-" + token), old = parent / (name.string() + ".old-" + token);
  try {
    squeeze::io::remove_tree(tmp);
    nn::detail::torch_errors([&] { io::save_hf_gptq(tmp, m); });
    for (const auto& f : copy_files)
      if (fs::is_regular_file(f)) fs::copy_file(f, tmp / f.filename());
    detail::check_export_reads_back(tmp, m);
    check_export_target(out, force);  // nothing appeared there meanwhile
    if (fs::exists(target) && fs::is_empty(target)) fs::remove(target);
    if (fs::exists(target)) {
      nn::detail::torch_errors([&] {
        io::rename_path(target, old);
        io::rename_path(tmp, target);
      });
    } else {
      nn::detail::torch_errors([&] { io::rename_path(tmp, target); });
    }
    nn::detail::torch_errors([&] { io::fsync_directory(parent); });
  } catch (...) {
    std::error_code ec;
    if (fs::exists(old) && !fs::exists(target)) fs::rename(old, target, ec);  // the swap half done: the old one back
    squeeze::io::try_remove_tree(tmp);
    throw;
  }
  squeeze::io::try_remove_tree(old);
}

// A source model's files an export carries over as they are (what runs the model's text: its tokenizer).
inline std::vector<std::filesystem::path> hf_side_files(const std::filesystem::path& hf_dir) {
  std::vector<std::filesystem::path> out;
  for (const char* f : {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"})
    out.push_back(hf_dir / f);
  return out;
}

// ---- token shards ----------------------------------------------------------------------------------------
// Windows [first, first + n) of a token dataset of batch 1 (io::TokenDataset, in its order: shuffled by its seed, or
// the files' order) as inputs and next-token targets, [n, T] int64 each on `device`.
inline std::pair<torch::Tensor, torch::Tensor> shard_windows(const io::TokenDataset& d, int64_t first, int64_t n, torch::Device device) {
  TORCH_CHECK(d.options().batch == 1, "shard_windows: the dataset must have batch 1, not ", d.options().batch);
  TORCH_CHECK(first >= 0 && n > 0 && uint64_t(first + n) <= d.batches_per_epoch(), "shard_windows: windows [", first, ", ", first + n,
              ") of ", d.batches_per_epoch());
  const int64_t T = d.options().seq;
  torch::Tensor w = torch::empty({n, T + 1}, torch::kInt);
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<std::int32_t> row = nn::detail::torch_errors([&] { return d.batch(uint64_t(first + i)); });  // [T + 1]
    std::memcpy(w[i].data_ptr<std::int32_t>(), row.data(), row.size() * sizeof(std::int32_t));
  }
  w = w.to(torch::kLong);
  return {w.narrow(1, 0, T).contiguous().to(device), w.narrow(1, 1, T).contiguous().to(device)};
}

}  // namespace squeeze::llama_gptq
