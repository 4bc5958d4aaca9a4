// Quantize a LLaMA with RTN and GPTQ and report validation perplexity before (dense) and after (quantized): a model
// trained by the LLaMA example (llama_train) on the King James Bible, or a Hugging Face LLaMA on token shards.
//
//   llama_gptq --preset tiny --checkpoint kjv-checkpoints --bits 4,3 --group 128,channel --out results/tiny
//   llama_gptq --preset tiny --train-steps 600 --bits 4,3 --group 128,channel --save packed/
//   llama_gptq --load-quantized packed/gptq-w4-g128          (evaluate a saved packed checkpoint)
//   llama_gptq --hf llama-7b-hf --data shards --bits 4 --group 128 --act-order --device cuda --export-hf llama-7b-gptq
//   llama_gptq --load-quantized packed/gptq-w4-g128 --export-hf gptq-hf   (the packed format -> Hugging Face layout)
//
// Calibration windows come from the training split, perplexity from the whole validation split in consecutive
// windows: bytes of the text (examples/llama/data.hpp: the same split llama_train uses), or with --data the train_*
// and val_* token shards in the model's vocabulary. The quantized model's perplexity is computed with
// nn::QuantizedLinear layers in the forward, built from the packed weights.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "data.hpp"
#include "llama_gptq.hpp"
#include "trainer.hpp"
#include "squeeze/io/posix_file.hpp"

using namespace squeeze;
namespace lg = squeeze::llama_gptq;

namespace {

struct Options {
  std::string preset = "tiny", device = "cpu", dtype = "auto", calib_dtype = "auto", checkpoint, corpus, save, load_quantized, out, strategy = "fp32", train_save;
  std::string hf, data, export_hf;
  std::vector<int> bits{4, 3};
  std::vector<std::string> groups{"128", "channel"}, methods{"rtn", "gptq"};
  int64_t train_steps = 0, train_batch = 16, seq = 128, calib_tokens = 32768, calib_batch = 16, eval_tokens = 0, eval_batch = 16, threads = 0;
  double lr = 3e-3, percdamp = 0.01, val_fraction = 0.05;
  bool act_order = false, sym = false, kl = false, quiet = false, force = false;
  bool preset_given = false, bits_given = false, groups_given = false, methods_given = false;
  uint64_t seed = 1337;
  std::string command;
};

// Wall time of each phase, for timing a large run (printed at the end; a JSON line with --out).
struct Phases {
  std::vector<std::pair<std::string, double>> seconds;  // in the order they first ran
  void add(const std::string& phase, double s) {
    for (auto& [name, v] : seconds)
      if (name == phase) {
        v += s;
        return;
      }
    seconds.emplace_back(phase, s);
  }
  template <class F>
  decltype(auto) time(const std::string& phase, F&& f) {  // runs f(), its wall time added to `phase`
    const auto t0 = std::chrono::steady_clock::now();
    struct Add {
      Phases& p;
      const std::string& name;
      std::chrono::steady_clock::time_point t0;
      ~Add() { p.add(name, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()); }
    } add{*this, phase, t0};
    return f();
  }
};

// ---- progress -----------------------------------------------------------------------------------------
// On a terminal every update overwrites one status line; in a log, layer lines are kept and evaluation
// batches are printed at every quarter.
class Progress {
 public:
  explicit Progress(bool quiet) : quiet_(quiet), tty_(isatty(fileno(stderr))) {}
  void status(const std::string& s, bool keep_in_log = true) {
    if (quiet_) return;
    if (tty_) std::cerr << "\r\033[K" << s << std::flush;
    else if (keep_in_log) std::cerr << s << "\n";
  }
  void message(const std::string& s) { std::cerr << (tty_ && !quiet_ ? "\r\033[K" : "") << s << "\n"; }
  lg::ProgressFn layers() {
    return [this](const std::string& s) { status(s); };
  }
  lg::ProgressFn eval(size_t batches) {
    return [this, batches, n = size_t(0)](const std::string& s) mutable {
      ++n;
      status(s, n == batches || (batches >= 4 && n % (batches / 4) == 0));
    };
  }

 private:
  bool quiet_, tty_;
};

// ---- results ------------------------------------------------------------------------------------------
struct Row {
  std::string method;  // fp32 / fp16 / bf16 (reference), rtn, gptq
  int bits = 16, group = 0;
  bool act_order = false, sym = false;
  lg::Eval eval;
  double ratio = 1, quantize_s = 0, gptq_error = NAN, rtn_error = NAN, reloaded_ppl = NAN;
  nlohmann::json quantize_phases;  // quantized rows: lg::QuantizeResult's seconds by phase (phases_json)
  int64_t packed_bytes = 0, dense_bytes = 0;
};

class Results {
 public:
  Results(const Options& o, std::string preset, int64_t params, int64_t calib_tokens, std::string eval_dtype)
      : o_(o), preset_(std::move(preset)), params_(params), calib_tokens_(calib_tokens), eval_dtype_(std::move(eval_dtype)) {
    if (o.out.empty()) return;
    std::string stem = o.out;  // OUT.jsonl is accepted too (bench/run_gpu.sh passes --out NAME.jsonl)
    if (stem.ends_with(".jsonl")) stem.resize(stem.size() - 6);
    if (const auto parent = std::filesystem::path(stem).parent_path(); !parent.empty()) std::filesystem::create_directories(parent);
    jsonl_.open(stem + ".jsonl");
    csv_.open(stem + ".csv");
    if (!jsonl_ || !csv_) throw std::runtime_error("--out: cannot write " + stem + ".jsonl / .csv");
    csv_ << "method,bits,group,act_order,sym,ppl,ppl_ratio,val_loss,kl_to_reference,quantize_s,packed_bytes,dense_fp16_bytes,gptq_layer_error,rtn_layer_error,reloaded_ppl\n";
  }

  void add(const Row& r) {
    rows_.push_back(r);
    if (!jsonl_.is_open()) return;
    auto num = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); };
    const char* commit = std::getenv("SQUEEZE_COMMIT");
    const std::string group = r.bits >= 16 ? "" : r.group > 0 ? "-g" + std::to_string(r.group) : "-channel";
    const std::string name = r.bits >= 16 ? r.method : r.method + "-w" + std::to_string(r.bits) + group + (r.act_order ? "-actorder" : "");
    const nlohmann::json j = {{"bench", "llama_gptq"}, {"case", name + " " + preset_}, {"time_ms", r.quantize_s * 1e3},
                              {"preset", preset_}, {"params", params_}, {"device", o_.device},
                              {"dtype", eval_dtype_}, {"eval_weights", r.bits < 16 ? "QuantizedLinear" : "dense"},
                              {"method", r.method}, {"bits", r.bits}, {"group", r.bits < 16 ? (r.group > 0 ? r.group : -1) : 0},
                              {"act_order", r.act_order}, {"sym", r.sym}, {"ppl", num(r.eval.ppl())}, {"ppl_ratio", num(r.ratio)},
                              {"val_loss", num(r.eval.loss)}, {"eval_tokens", r.eval.tokens}, {"calib_tokens", r.bits < 16 ? calib_tokens_ : 0},
                              {"quantize_s", r.quantize_s}, {"packed_bytes", r.packed_bytes}, {"dense_fp16_bytes", r.dense_bytes},
                              {"gptq_layer_error", num(r.gptq_error)}, {"rtn_layer_error", num(r.rtn_error)},
                              {"kl_to_reference", num(r.eval.kl)}, {"reloaded_ppl", num(r.reloaded_ppl)}, {"quantize_phases_s", r.quantize_phases},
                              {"seq", o_.seq}, {"seed", o_.seed},
                              {"commit", commit ? commit : ""}, {"command", o_.command}};
    jsonl_ << j.dump() << "\n" << std::flush;
    char line[512];
    std::snprintf(line, sizeof line, "%s,%d,%d,%d,%d,%.6f,%.6f,%.6f,%.6g,%.3f,%lld,%lld,%.6g,%.6g,%.6f\n", r.method.c_str(), r.bits,
                  r.bits < 16 ? (r.group > 0 ? r.group : -1) : 0, int(r.act_order), int(r.sym), r.eval.ppl(), r.ratio, r.eval.loss, r.eval.kl,
                  r.quantize_s, (long long)r.packed_bytes, (long long)r.dense_bytes, r.gptq_error, r.rtn_error, r.reloaded_ppl);
    csv_ << line << std::flush;
  }

  // The last line: the phases' wall times with the run's headline numbers (what bench/quant/quantize_7b.sh keeps).
  void add_phases(const nlohmann::json& j) {
    if (jsonl_.is_open()) jsonl_ << j.dump() << "\n" << std::flush;
  }

  void print_table() const {
    // layer err: mean over the layers of tr(D H D^T) / tr(W H W^T) on the calibration inputs (GPTQ rows: GPTQ's and RTN's)
    std::printf("\n%-6s %4s %7s %9s %10s %7s %10s %9s %11s %11s %11s\n", "method", "bits", "group", "act-order", "ppl", "ratio",
                "KL", "quant s", "packed MB", "layer err", "rtn err");
    auto opt = [](double v, const char* fmt) {
      char b[32];
      std::snprintf(b, sizeof b, fmt, v);
      return std::isfinite(v) ? std::string(b) : std::string("-");
    };
    for (const auto& r : rows_) {
      const std::string g = r.bits >= 16 ? "-" : r.group > 0 ? std::to_string(r.group) : "channel";
      std::printf("%-6s %4d %7s %9s %10.4f %7s %10s %9.2f %11.3f %11s %11s\n", r.method.c_str(), r.bits, g.c_str(), r.act_order ? "yes" : "-",
                  r.eval.ppl(), opt(r.ratio, "%.4f").c_str(), opt(r.eval.kl, "%.3e").c_str(), r.quantize_s, double(r.packed_bytes) / 1e6,
                  opt(r.gptq_error, "%.3e").c_str(), opt(r.rtn_error, "%.3e").c_str());
    }
  }

 private:
  const Options& o_;
  std::string preset_;
  int64_t params_, calib_tokens_;
  std::string eval_dtype_;
  std::ofstream jsonl_, csv_;
  std::vector<Row> rows_;
};

// ---- the float model ----------------------------------------------------------------------------------
// llama_train's learning-rate schedule (examples/llama/train.cpp lr_at; to move into data.hpp and be shared):
// linear warm-up over the first 5% of steps, cosine decay to 10% at the end.
double lr_at(int64_t step, int64_t steps, double lr) {
  const int64_t warmup = std::max<int64_t>(1, steps / 20);
  if (step < warmup) return lr * double(step + 1) / double(warmup);
  const double t = double(step - warmup) / double(std::max<int64_t>(1, steps - warmup));
  return lr * (0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * std::min(1.0, t))));
}

// Trains with llama_train's trainer and schedule (no evaluation), then writes a checkpoint like llama_train --save.
template <StrategyType S>
void train_and_save(const Options& o, const torch::Tensor& train_ids, torch::Device device, const std::string& path, Progress& bar) {
  torch::manual_seed(o.seed);
  llama::TrainOptions topt;
  topt.lr = o.lr;
  llama::LlamaRun<S> trainer(nn::LlamaConfig::preset(o.preset), topt, device);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t step = trainer.step_count(); step < o.train_steps; step = trainer.step_count()) {
    const auto [x, y] = llama::sample_batch(train_ids, o.train_batch, o.seq, o.seed, step, device);
    trainer.set_lr(lr_at(step, o.train_steps, o.lr));
    const auto r = trainer.step(x, y);
    if (!r.applied && r.scale <= 1.0) throw std::runtime_error("gradients are not finite even at loss scale 1: lower --lr");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    char line[200];
    std::snprintf(line, sizeof line, "[train %s] step %lld/%lld loss %.4f  %.0f tok/s", o.strategy.c_str(), (long long)trainer.step_count(),
                  (long long)o.train_steps, r.loss, double(trainer.step_count() * o.train_batch * o.seq) / s);
    bar.status(line, trainer.step_count() % std::max<int64_t>(1, o.train_steps / 10) == 0);
  }
  trainer.save(path);
  bar.message("trained " + std::to_string(o.train_steps) + " steps (" + o.strategy + "), checkpoint " + path);
}

// The float weights of a llama_train checkpoint (any strategy that trains full weights; geometry checked against --preset).
nn::Llama load_float(const Options& o, const std::string& path, torch::Device device) {
  return llama::load_weights(path, nn::LlamaConfig::preset(o.preset), device);
}

nn::Llama copy_model(nn::Llama& src, torch::Device device, torch::ScalarType dtype) {
  nn::Llama m(src->config, nn::ParamInit{torch::TensorOptions().dtype(dtype).device(device), /*random=*/false});  // every parameter copied next
  torch::NoGradGuard ng;
  auto dst = m->parameters();
  const auto from = src->parameters();
  for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(from[i]);
  m->eval();
  return m;
}

// ---- command-line values --------------------------------------------------------------------------------
int parse_group(const std::string& s) {
  if (s == "channel" || s == "per-channel" || s == "-1") return 0;
  try {
    size_t used = 0;
    const int g = std::stoi(s, &used);
    if (used == s.size() && g > 0) return g;
  } catch (const std::exception&) {
  }
  throw std::runtime_error("--group '" + s + "': a positive group size (e.g. 128), or -1 / 'channel' for one group per output channel");
}

torch::ScalarType eval_dtype(const Options& o) {
  if (o.dtype == "fp32") return torch::kFloat32;
  if (o.dtype == "fp16") return torch::kHalf;
  if (o.dtype == "bf16") return torch::kBFloat16;
  return o.device == "cuda" ? torch::kHalf : torch::kFloat32;  // auto: the CUDA kernels take fp16/bf16 activations
}
std::string dtype_name(torch::ScalarType t) { return t == torch::kFloat32 ? "fp32" : t == torch::kHalf ? "fp16" : "bf16"; }

// --calib-dtype: the calibration forwards' dtype (auto: lg::default_calibration_dtype, bf16 on cuda and float on cpu).
torch::ScalarType calibration_dtype(const Options& o, torch::Device device) {
  if (o.calib_dtype == "float" || o.calib_dtype == "fp32") return torch::kFloat32;
  if (o.calib_dtype == "bf16") return torch::kBFloat16;
  return lg::default_calibration_dtype(device);
}

// A quantization's seconds by phase (the JSON lines' quantize_phases_s).
nlohmann::json phases_json(const lg::QuantizeResult& q) {
  return {{"calibration_forwards", q.calibration_s}, {"solve", q.solve_s}, {"pack", q.pack_s}, {"rtn_and_errors", q.error_s}};
}

// The calibration windows and the validation batches: bytes of a text (the KJV or --corpus), or --data's token shards.
struct Data {
  torch::Tensor train_bytes;    // [n] the text's training split (what --train-steps trains on); undefined with --data
  torch::Tensor calib_windows;  // [n, T] int64 on the CPU
  std::vector<std::pair<torch::Tensor, torch::Tensor>> val;  // (x, y) [B, T] each, on the device
  std::string description;
};

// `vocab`: the model's; `model`: where it comes from (for the error when a shard's ids do not fit it).
Data load_data(const Options& o, int64_t vocab, const std::string& model, torch::Device device) {
  Data d;
  const int64_t wanted_calib = std::max<int64_t>(1, o.calib_tokens / o.seq);
  const auto eval_windows = [&](int64_t have) {  // the whole validation split, or --eval-tokens of it
    return o.eval_tokens > 0 ? std::min(have, std::max<int64_t>(1, o.eval_tokens / o.seq)) : have;
  };
  char line[400];
  if (o.data.empty()) {
    if (vocab < 256)
      throw std::runtime_error(model + ": its vocabulary (" + std::to_string(vocab) + ") is smaller than the 256 byte ids of a text; give --data");
    const llama::Corpus corpus = llama::load_corpus(o.corpus, o.val_fraction);
    d.train_bytes = llama::tokenize(corpus.train);
    const torch::Tensor val_ids = llama::tokenize(corpus.val);  // [n]
    if (d.train_bytes.size(0) <= o.seq + 1 || val_ids.size(0) <= o.seq + 1)
      throw std::runtime_error("--seq " + std::to_string(o.seq) + " is longer than the corpus' training or validation text");
    const int64_t windows = eval_windows((val_ids.size(0) - 1) / o.seq), batch = std::min(o.eval_batch, windows);
    d.val = llama::val_batches(val_ids, batch, o.seq, windows / batch, device);
    d.calib_windows = llama::sample_batch(d.train_bytes, wanted_calib, o.seq, o.seed + 1, 0, torch::kCPU).first;  // a seed of their own
    std::snprintf(line, sizeof line, "corpus: %s: %lld training bytes, validation %lld of %lld bytes (%zu batches of %lld x %lld)",
                  corpus.source.c_str(), (long long)d.train_bytes.size(0), (long long)(int64_t(d.val.size()) * batch * o.seq),
                  (long long)val_ids.size(0), d.val.size(), (long long)batch, (long long)o.seq);
    d.description = line;
    return d;
  }
  // Batch-1 datasets: calibration takes the first windows of the seeded shuffle, validation the files' order.
  const llama::ShardData shards = llama::open_shards(o.data, vocab, model, 1, 1, o.seq, o.seed + 1, 0, 1);
  const int64_t calib = std::min<int64_t>(wanted_calib, int64_t(shards.train->batches_per_epoch()));
  d.calib_windows = lg::shard_windows(*shards.train, 0, calib, torch::kCPU).first;
  const int64_t windows = eval_windows(int64_t(shards.val->batches_per_epoch())), batch = std::min(o.eval_batch, windows);
  for (int64_t b = 0; b + batch <= windows; b += batch) {
    auto [x, y] = lg::shard_windows(*shards.val, b, batch, device);
    d.val.emplace_back(std::move(x), std::move(y));
  }
  std::snprintf(line, sizeof line, "data: %s: %llu training tokens in %zu shard(s) (calibration: %lld windows%s), validation %lld of %llu tokens "
                "in %zu shard(s) (%zu batches of %lld x %lld)", o.data.c_str(), (unsigned long long)shards.train_tokens, shards.train->shard_count(),
                (long long)calib, calib < wanted_calib ? ", all the shards hold" : "", (long long)(int64_t(d.val.size()) * batch * o.seq),
                (unsigned long long)shards.val_tokens, shards.val->shard_count(), d.val.size(), (long long)batch, (long long)o.seq);
  d.description = line;
  return d;
}

double since(std::chrono::steady_clock::time_point t0) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }

int run(Options& o) {
  const auto t_start = std::chrono::steady_clock::now();
  Phases phases;
  // Everything about the request is checked before any work.
  if (!o.export_hf.empty() && o.load_quantized.empty()) {  // one model to export: GPTQ 4-bit g128 unless asked otherwise
    if (!o.bits_given) o.bits = {4};
    if (!o.groups_given) o.groups = {"128"};
    if (!o.methods_given) o.methods = {"gptq"};
  }
  std::vector<int> groups;
  for (const auto& g : o.groups) groups.push_back(parse_group(g));
  for (int b : o.bits)
    if (!quant::supported_bits(b)) throw std::runtime_error("--bits " + std::to_string(b) + " is not supported: GPTQ/RTN checkpoints hold 2, 3, 4 or 8 bits");
  std::vector<lg::Method> methods;
  for (const auto& m : o.methods) methods.push_back(m == "rtn" ? lg::Method::RTN : lg::Method::GPTQ);
  const int sources = int(!o.checkpoint.empty()) + int(o.train_steps > 0) + int(!o.load_quantized.empty()) + int(!o.hf.empty());
  if (sources != 1)
    throw std::runtime_error("give exactly one of --checkpoint FILE (from llama_train --save), --train-steps N (train one first), --hf DIR "
                             "(a Hugging Face LLaMA) or --load-quantized DIR");
  if (!o.checkpoint.empty() && !std::filesystem::exists(o.checkpoint))
    throw std::runtime_error("--checkpoint '" + o.checkpoint + "' does not exist (write one with llama_train --save FILE, or use --train-steps N)");
  if (!o.load_quantized.empty() && (o.bits_given || o.groups_given || o.methods_given || o.act_order || o.sym))
    throw std::runtime_error("--load-quantized " + o.load_quantized + ": its method, bits, group, act-order and grid come from its "
                             "quantize_config.json; leave out --bits, --group, --methods, --act-order and --sym");
  if (o.train_steps > 0 && !o.data.empty())
    throw std::runtime_error("--train-steps trains on the bytes of a text, not on --data's shards: train with llama_train --data, then --checkpoint");
  if (!o.export_hf.empty()) {
    if (o.load_quantized.empty()) lg::check_single_export(o.bits, groups, methods);
    lg::check_export_target(o.export_hf, o.force);
  }
  const torch::Device device(o.device == "cuda" ? torch::kCUDA : torch::kCPU);
  if (device.is_cuda() && !torch::cuda::is_available())
    throw std::runtime_error("--device cuda: this libtorch has no CUDA device available (build with -DSQUEEZE_TORCH_CUDA=ON on a GPU machine)");
  const auto dtype = eval_dtype(o);
  at::globalContext().setFlushDenormal(true);
  if (o.threads > 0) torch::set_num_threads(int(o.threads));
  Progress bar(o.quiet);
  const auto finish = [&](Results& results, nlohmann::json headline) {  // the phases, on stderr and as the last JSON line
    phases.add("total", since(t_start));
    std::string line = "phases:";
    nlohmann::json seconds = nlohmann::json::object();
    for (const auto& [name, s] : phases.seconds) {
      char b[64];
      std::snprintf(b, sizeof b, " %s %.1f s", name.c_str(), s);
      line += b;
      seconds[name] = s;
    }
    bar.message(line);
    if (o.out.empty()) return;
    const char* commit = std::getenv("SQUEEZE_COMMIT");
    headline["bench"] = "llama_gptq";
    headline["phases_s"] = seconds;
    headline["time_ms"] = seconds["total"].get<double>() * 1e3;
    headline["device"] = o.device, headline["dtype"] = dtype_name(dtype), headline["seq"] = o.seq;
    headline["commit"] = commit ? commit : "", headline["command"] = o.command;
    results.add_phases(headline);
    std::printf("%s\n", headline.dump().c_str());
  };
  const auto num = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); };

  // A saved packed checkpoint: evaluate it (and with --export-hf write it in the Hugging Face layout), then stop.
  if (!o.load_quantized.empty()) {
    auto loaded = phases.time("load", [&] { return lg::load_packed(o.load_quantized, device, dtype); });
    const auto& c = loaded.model->config;
    if (o.preset_given) {
      const auto want = nn::LlamaConfig::preset(o.preset);
      if (want.hidden != c.hidden || want.layers != c.layers || want.heads != c.heads || want.kv_heads != c.kv_heads || want.ffn != c.ffn ||
          want.vocab != c.vocab)
        throw std::runtime_error("--load-quantized '" + o.load_quantized + "' holds preset '" + c.name + "', not --preset " + o.preset);
    }
    const Data data = phases.time("data", [&] { return load_data(o, c.vocab, "--load-quantized " + o.load_quantized, device); });
    bar.message(data.description);
    int64_t params = 0;
    for (const auto& p : loaded.model->parameters()) params += p.numel();
    Results results(o, c.name, params, 0, dtype_name(dtype));
    if (!o.export_hf.empty()) {
      lg::round_dense_to_half(loaded.model);  // evaluate what the export holds
      phases.time("export", [&] {
        lg::export_hf_gptq(o.export_hf, lg::hf_gptq_model(loaded.model, loaded.layers, loaded.spec, loaded.hf_config), o.force);
      });
      bar.message("exported " + o.load_quantized + " to " + o.export_hf + " (Hugging Face GPTQ layout; read back: the same tensors)");
    }
    Row r;
    r.method = lg::method_name(loaded.spec.method), r.bits = loaded.spec.bits, r.group = loaded.spec.group_size;
    r.act_order = loaded.spec.act_order, r.sym = loaded.spec.sym;
    r.eval = phases.time("eval", [&] { return lg::evaluate(loaded.model, data.val, bar.eval(data.val.size()), loaded.spec.tag()); });
    int64_t packed = 0, dense = 0;
    for (const auto& [_, p] : loaded.layers) {
      packed += int64_t(p.qweight.size() * 4 + p.qzeros.size() * 4 + p.scales.size() * 2 + p.g_idx.size() * 4 + p.bias.size() * 2);
      dense += p.in * p.out * 2;
    }
    r.packed_bytes = packed, r.dense_bytes = dense, r.ratio = NAN;
    results.add(r);
    bar.message("");
    results.print_table();
    finish(results, {{"case", "phases " + loaded.spec.tag() + " " + c.name}, {"model", o.load_quantized}, {"method", r.method}, {"bits", r.bits},
                     {"group", r.group > 0 ? r.group : -1}, {"act_order", r.act_order}, {"ppl_quantized", num(r.eval.ppl())},
                     {"eval_tokens", r.eval.tokens}, {"export_hf", o.export_hf}});
    return 0;
  }

  // The model's vocabulary before the model: the data is checked before a long load.
  std::optional<io::LlamaConfig> hf_config;  // --hf: what the export's config.json keeps of the source
  if (!o.hf.empty()) hf_config = io::load_llama_config(o.hf);
  const int64_t vocab = hf_config ? hf_config->vocab_size : nn::LlamaConfig::preset(o.preset).vocab;
  const std::string model_name = hf_config ? o.hf : o.preset;
  const Data data = phases.time("data", [&] { return load_data(o, vocab, hf_config ? "--hf " + o.hf : "--preset " + o.preset, device); });
  bar.message(data.description);

  // The float model: a Hugging Face directory, a llama_train checkpoint, or one trained here first with the same trainer.
  std::string ckpt = o.checkpoint;
  if (o.train_steps > 0) {
    ckpt = o.train_save.empty() ? (std::filesystem::temp_directory_path() / ("llama_gptq-" + std::to_string(getpid()) + "-checkpoints")).string() : o.train_save;
    if (const auto parent = std::filesystem::path(ckpt).parent_path(); !parent.empty()) std::filesystem::create_directories(parent);
    phases.time("train", [&] {
      llama::with_strategy(o.strategy, [&]<StrategyType S>() {
        // the strategies that train full weights (a LoRA checkpoint holds adapters only)
        if constexpr (!S::has_lora) train_and_save<S>(o, data.train_bytes, device, ckpt, bar);
        else throw std::runtime_error("--strategy " + o.strategy + ": LoRA trains adapters, not the weights GPTQ quantizes; pick a full-weight strategy");
      });
    });
  }
  nn::Llama dense = phases.time("load", [&] {
    return hf_config ? nn::load_hf_llama(o.hf, {.dtype = torch::kFloat32, .device = device}) : load_float(o, ckpt, device);
  });
  if (o.train_steps > 0 && o.train_save.empty()) squeeze::io::remove_tree(ckpt);  // the trainer's checkpoint is a directory
  int64_t params = 0;
  for (const auto& p : dense->parameters()) params += p.numel();

  const auto calib = lg::make_calibration(data.calib_windows, o.calib_batch, device, calibration_dtype(o, device));
  Results results(o, model_name, params, calib.tokens(), dtype_name(dtype));
  bar.message("model " + model_name + " (" + std::to_string(params) + " parameters) from " +
              (hf_config ? "its Hugging Face directory" : o.checkpoint.empty() ? "training" : o.checkpoint) + "; calibration " +
              std::to_string(calib.tokens()) + " tokens (forwards in " + dtype_name(calib.dtype) + "); evaluation in " + dtype_name(dtype) +
              " on " + o.device);

  Row ref;
  ref.method = dtype_name(dtype);
  ref.bits = dtype == torch::kFloat32 ? 32 : 16;
  // --kl compares every configuration's predictions with the reference's: it keeps a copy in the evaluation dtype.
  // Otherwise the dense model itself is evaluated, its parameters converted for the while.
  std::optional<nn::Llama> ref_model;
  ref.eval = phases.time("reference", [&] {
    if (o.kl) {
      ref_model = copy_model(dense, device, dtype);
      return lg::evaluate(*ref_model, data.val, bar.eval(data.val.size()), "reference " + ref.method);
    }
    return lg::with_parameters_in(dense, dtype, [&] { return lg::evaluate(dense, data.val, bar.eval(data.val.size()), "reference " + ref.method); });
  });
  results.add(ref);
  bar.message("reference (" + ref.method + "): validation perplexity " + std::to_string(ref.eval.ppl()));

  const size_t configurations = groups.size() * o.bits.size() * methods.size();
  size_t configuration = 0;
  Row last;
  lg::QuantizeResult quantize_phases;  // the phase seconds summed over the configurations (only the seconds are kept)
  for (int group : groups)
    for (int bits : o.bits)
      for (lg::Method method : methods) {
        lg::QuantSpec spec;
        spec.method = method, spec.bits = bits, spec.group_size = group, spec.sym = o.sym, spec.act_order = o.act_order, spec.percdamp = o.percdamp;
        // quantization works on float weights; the last configuration quantizes the dense model itself (no copy)
        auto m = ++configuration == configurations ? dense : copy_model(dense, device, torch::kFloat32);
        const lg::QuantizeResult q = lg::quantize(m, spec, calib, bar.layers());
        phases.add("quantize", q.seconds);
        quantize_phases.seconds += q.seconds, quantize_phases.calibration_s += q.calibration_s, quantize_phases.solve_s += q.solve_s;
        quantize_phases.pack_s += q.pack_s, quantize_phases.error_s += q.error_s;
        Row r;
        r.method = lg::method_name(method), r.bits = bits, r.group = group, r.sym = o.sym, r.act_order = o.act_order && method == lg::Method::GPTQ;
        r.quantize_s = q.seconds, r.packed_bytes = q.packed_bytes(), r.dense_bytes = q.dense_fp16_bytes(), r.quantize_phases = phases_json(q);
        if (method == lg::Method::GPTQ) {  // mean relative output error over the layers, GPTQ vs RTN on the same inputs
          double g = 0, rt = 0;
          for (const auto& l : q.reports) g += l.error, rt += l.rtn_error;
          r.gptq_error = g / double(q.reports.size()), r.rtn_error = rt / double(q.reports.size());
        }
        if (!o.export_hf.empty()) lg::round_dense_to_half(m);  // everything below (saved, evaluated) is what the export holds
        if (!o.save.empty())
          phases.time("save", [&] { lg::save_packed(std::filesystem::path(o.save) / spec.tag(), m, q.layers, spec, hf_config); });  // dense tensors still float
        phases.time("use_packed", [&] {  // QuantizedLinear layers from the packed ones (the fused GEMM's tiles built on the host)
          m->to(device, dtype);
          lg::use_packed(m, q.layers);
        });
        if (!o.export_hf.empty()) {
          phases.time("export", [&] {
            lg::export_hf_gptq(o.export_hf, lg::hf_gptq_model(m, q.layers, spec, hf_config), o.force,
                               hf_config ? lg::hf_side_files(o.hf) : std::vector<std::filesystem::path>{});
          });
          bar.message("exported " + spec.tag() + " to " + o.export_hf + " (Hugging Face GPTQ layout; read back: the same tensors)");
        }
        r.eval = phases.time("eval", [&] {
          return lg::evaluate(m, data.val, bar.eval(data.val.size()), spec.tag(), o.kl ? &*ref_model : nullptr);
        });
        r.ratio = r.eval.ppl() / ref.eval.ppl();
        if (!o.save.empty()) {  // the saved checkpoint, read back, must give the same perplexity
          const auto dir = std::filesystem::path(o.save) / spec.tag();
          phases.time("save", [&] {
            auto loaded = lg::load_packed(dir, device, dtype);
            r.reloaded_ppl = lg::evaluate(loaded.model, data.val, bar.eval(data.val.size()), "reloaded " + spec.tag()).ppl();
          });
          if (std::abs(r.reloaded_ppl - r.eval.ppl()) > 1e-9 * r.eval.ppl())
            throw std::runtime_error("saved checkpoint " + dir.string() + " evaluates to perplexity " + std::to_string(r.reloaded_ppl) +
                                     ", not " + std::to_string(r.eval.ppl()));
          bar.message("saved " + dir.string() + " (read back: same perplexity)");
        }
        results.add(r);
        last = r;
        char line[512];
        std::snprintf(line, sizeof line, "%s: validation perplexity %.4f (%.3fx %s), quantized in %s, %.2f MB packed", spec.tag().c_str(),
                      r.eval.ppl(), r.ratio, ref.method.c_str(), q.phase_summary().c_str(), double(r.packed_bytes) / 1e6);
        bar.message(line);
      }
  results.print_table();
  finish(results, {{"case", "phases " + std::string(configurations == 1 ? lg::method_name(methods[0]) : "all") + " " + model_name},
                   {"model", model_name}, {"params", params}, {"configurations", configurations}, {"method", last.method}, {"bits", last.bits},
                   {"group", last.group > 0 ? last.group : -1}, {"act_order", last.act_order}, {"calib_tokens", calib.tokens()},
                   {"eval_tokens", ref.eval.tokens}, {"ppl_reference", num(ref.eval.ppl())}, {"ppl_quantized", num(last.eval.ppl())},
                   {"ppl_ratio", num(last.ratio)}, {"packed_bytes", last.packed_bytes}, {"export_hf", o.export_hf},
                   {"calib_dtype", dtype_name(calib.dtype)}, {"quantize_phases_s", phases_json(quantize_phases)}});
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 0; i < argc; ++i) o.command += (i ? " " : "") + std::string(argv[i]);
  CLI::App app{"Quantize a LLaMA (the LLaMA example's, or a Hugging Face one) with RTN and GPTQ; report validation perplexity before and after"};
  auto* preset = app.add_option("--preset", o.preset, "model size (must match the checkpoint)")
                     ->check(CLI::IsMember(nn::LlamaConfig::preset_names()))->capture_default_str();
  app.add_option("--hf", o.hf, "quantize this Hugging Face LLaMA directory (config.json + safetensors) instead of --preset / --checkpoint")
      ->check(CLI::ExistingDirectory)->excludes(preset);
  app.add_option("--checkpoint", o.checkpoint, "a checkpoint written by llama_train --save");
  app.add_option("--train-steps", o.train_steps, "train this many steps first (llama_train's trainer) instead of --checkpoint")->check(CLI::NonNegativeNumber);
  app.add_option("--strategy", o.strategy, "llama_train strategy for --train-steps")->check(CLI::IsMember(llama::strategy_names()))->capture_default_str();
  app.add_option("--train-batch", o.train_batch, "sequences per training step")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--lr", o.lr, "peak learning rate for --train-steps")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--train-save", o.train_save, "keep the trained float checkpoint here");
  app.add_option("--load-quantized", o.load_quantized, "evaluate a packed checkpoint written by --save (a directory); with --export-hf, convert it");
  app.add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--dtype", o.dtype, "evaluation dtype: auto (fp32 on cpu, fp16 on cuda), fp32, fp16, bf16")
      ->check(CLI::IsMember({"auto", "fp32", "fp16", "bf16"}))->capture_default_str();
  app.add_option("--bits", o.bits, "bit widths, e.g. 4,3 (2, 3, 4, 8)")->delimiter(',')->capture_default_str();
  app.add_option("--group", o.groups, "group sizes, e.g. 128,channel (-1 or 'channel': one group per output channel)")->delimiter(',')->capture_default_str();
  app.add_option("--methods", o.methods, "rtn, gptq or both")->delimiter(',')->check(CLI::IsMember({"rtn", "gptq"}))->capture_default_str();
  app.add_flag("--act-order", o.act_order, "GPTQ: quantize columns by decreasing Hessian diagonal (desc_act)");
  app.add_flag("--sym", o.sym, "symmetric grid (default: asymmetric min-max, as in the GPTQ paper)");
  app.add_option("--percdamp", o.percdamp, "GPTQ damping as a fraction of mean(diag H)")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--calib-tokens", o.calib_tokens, "calibration tokens from the training split (windows of --seq)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--calib-dtype", o.calib_dtype, "dtype of the calibration forwards: float or bf16 (auto: bf16 on cuda, float on cpu; the "
                                                 "solver works on the float weights and the Hessians accumulate in fp32 either way)")
      ->check(CLI::IsMember({"auto", "float", "fp32", "bf16"}))->capture_default_str();
  app.add_option("--calib-batch", o.calib_batch, "calibration sequences per forward")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seq", o.seq, "tokens (bytes) per window: training, calibration and evaluation")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--eval-tokens", o.eval_tokens, "validation tokens to evaluate (0: the whole validation split)")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--eval-batch", o.eval_batch, "validation sequences per forward")->check(CLI::PositiveNumber)->capture_default_str();
  auto* corpus = app.add_option("--corpus", o.corpus, "a text file instead of the KJV");
  app.add_option("--data", o.data, "calibrate on the train_*.bin token shards in this directory and evaluate on its val_*.bin ones "
                                   "(squeeze-tokenize's or llm.c's) instead of bytes; ids must be below the model's vocabulary")
      ->check(CLI::ExistingDirectory)->excludes(corpus);
  app.add_option("--out", o.out, "write results to OUT.jsonl and OUT.csv (one line per method; a last JSON line with the phase times)");
  app.add_option("--save", o.save, "write each packed model to SAVE/<method>-w<bits>-<group>/ and check it reads back to the same perplexity");
  app.add_option("--export-hf", o.export_hf, "write the quantized model here in the Hugging Face GPTQ layout (one method, bit width and group: "
                                             "default gptq, 4, 128); with --load-quantized, that model");
  app.add_flag("--force", o.force, "let --export-hf replace a non-empty directory (removed once the new export is complete)");
  app.add_option("--threads", o.threads, "CPU threads (0: libtorch's default)")->capture_default_str();
  app.add_option("--seed", o.seed, "seed of training batches and calibration windows")->capture_default_str();
  app.add_flag("--kl", o.kl, "also report KL(reference || quantized) of the next-token distributions (a second forward per batch)");
  app.add_flag("--quiet", o.quiet, "no progress lines");
  CLI11_PARSE(app, argc, argv);
  o.preset_given = app.count("--preset") > 0;
  o.bits_given = app.count("--bits") > 0, o.groups_given = app.count("--group") > 0, o.methods_given = app.count("--methods") > 0;

  try {
    return run(o);
  } catch (const c10::Error& e) {
    std::cerr << "\nerror: " << e.what_without_backtrace() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "\nerror: " << e.what() << "\n";
  }
  return 1;
}
