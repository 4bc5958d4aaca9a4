#pragma once
// llama_train's run: its options, progress and sampling, the exports, and the training loop (run_training<S>, one
// instantiation per strategy). train.cpp holds the command line; the strategies' loops are compiled in
// SQUEEZE_TRAIN_PARTS translation units (CMakeLists.txt writes one per part), as bench_table's rows are, so a machine
// with many cores compiles them in parallel.
#include <ATen/CPUGeneratorImpl.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>

#include <squeeze/comm/env.hpp>
#include <squeeze/comm/from_env.hpp>

#include <squeeze/nn/hf_llama.hpp>

#include "data.hpp"
#include "trainer.hpp"

namespace squeeze::llama_train {

using squeeze::llama::Corpus;
using squeeze::llama::detokenize;
using squeeze::llama::LlamaRun;
using squeeze::llama::load_corpus;
using squeeze::llama::open_shards;
using squeeze::llama::sample_batch;
using squeeze::llama::shard_batch;
using squeeze::llama::shard_val_batches;
using squeeze::llama::tokenize;
using squeeze::llama::val_batches;

struct Options {
  std::string preset = "tiny", strategy = "fp32", device = "cpu", corpus, data, save, load, hf, export_hf, export_peft, result_json;
  int64_t vocab = 0, steps = 200, batch = 16, seq = 128, eval_every = 100, eval_batches = 8, log_every = 0, sample = 160, threads = 0;
  int64_t loss_chunk = llama::TrainOptions{}.loss_chunk_tokens;
  bool fused_loss = false;
  double lr = 3e-3, weight_decay = 0.1, clip = 1.0, val_fraction = 0.05;
  uint64_t seed = 1337;
};

// Learning rate: linear warm-up over the first 5% of steps, cosine decay to 10% at the end.
inline double lr_at(int64_t step, int64_t steps, double lr) {
  const int64_t warmup = std::max<int64_t>(1, steps / 20);
  if (step < warmup) return lr * double(step + 1) / double(warmup);
  const double t = double(step - warmup) / double(std::max<int64_t>(1, steps - warmup));
  return lr * (0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * std::min(1.0, t))));
}

// ---- progress -----------------------------------------------------------------------------------------
class Progress {
 public:
  Progress(int64_t first, int64_t last, int64_t log_every) : first_(first), last_(last), tty_(isatty(fileno(stderr))) {
    every_ = log_every > 0 ? log_every : std::max<int64_t>(1, (last - first) / 10);
  }
  void update(int64_t step, const llama::BatchResult& r, double tokens_per_s, const llama::DeviceMemory& m) {
    const double frac = double(step + 1 - first_) / double(std::max<int64_t>(1, last_ - first_));
    char line[256];
    const int width = 24, filled = int(frac * width);
    std::snprintf(line, sizeof line, "step %6lld/%lld [%s%s] loss %.4f | %7.0f tok/s | mem %.2f GB%s", (long long)(step + 1),
                  (long long)last_, std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(), r.loss, tokens_per_s,
                  m.current_gb, r.applied ? "" : " | overflow: step skipped");
    if (tty_)
      std::cerr << "\r" << line << std::flush;
    else if ((step + 1 - first_) % every_ == 0 || step + 1 == last_)
      std::cerr << line << "\n";
  }
  void message(const std::string& s) { std::cerr << (tty_ ? "\r\033[K" : "") << s << "\n"; }
  void done() {
    if (tty_) std::cerr << "\n";
  }

 private:
  int64_t first_, last_, every_;
  bool tty_;
};

// ---- sampling -----------------------------------------------------------------------------------------
inline std::string sample_text(nn::Llama& model, const std::string& prompt, int64_t n, int64_t max_context, torch::Device device,
                               uint64_t seed) {
  torch::NoGradGuard no_grad;
  model->eval();
  auto gen = at::detail::createCPUGenerator(seed);
  torch::Tensor ids = tokenize(prompt).view({1, -1}).to(device);  // [1, t]
  for (int64_t i = 0; i < n; ++i) {
    const torch::Tensor ctx = ids.size(1) > max_context ? ids.narrow(1, ids.size(1) - max_context, max_context) : ids;
    const torch::Tensor logits = model->forward(ctx).select(1, ctx.size(1) - 1).to(torch::kCPU, torch::kFloat32);  // [1, V]
    const torch::Tensor probs = torch::softmax(logits.narrow(1, 0, 256) / 0.8, -1);                                // bytes only
    const torch::Tensor next = torch::multinomial(probs, 1, false, gen);                                           // [1, 1]
    ids = torch::cat({ids, next.to(device)}, 1);
  }
  model->train();
  return detokenize(ids[0]);
}

// --export-hf DIR: the trained model as a Hugging Face LLaMA directory (LoRA merged into its base); --export-peft DIR:
// a LoRA strategy's adapters in PEFT's format. Gathering the weights is a collective; rank 0 writes.
template <StrategyType S>
void export_results(const Options& o, LlamaRun<S>& trainer, const nn::LlamaConfig& config, int rank) {
  if (!o.export_hf.empty()) {
    std::optional<io::LlamaConfig> source;
    if (!o.hf.empty()) source = io::load_llama_config(o.hf);
    nn::save_hf_llama(trainer.trainer(), config, o.export_hf, {.source_config = source});  // stage 3: one layer gathered at a time
    if (rank == 0) std::cerr << "exported the model to " << o.export_hf << " (Hugging Face LlamaForCausalLM)\n";
  }
  if (!o.export_peft.empty()) {
    if constexpr (!S::has_lora) {
      throw std::runtime_error("--export-peft: strategy " + o.strategy + " trains full weights, not LoRA adapters (use --export-hf)");
    } else if (rank == 0) {
      nn::save_peft_adapters(*trainer.model(), o.export_peft, {.base_model_name_or_path = o.hf});
      std::cerr << "exported the adapters to " << o.export_peft << " (PEFT)\n";
    }
  }
}

// --hf: a line on stderr about every 5 seconds while the checkpoint streams in, and one when it is all in.
inline nn::HfProgressFn load_progress(const std::string& dir, bool print) {
  if (!print) return {};
  auto throttle = std::make_shared<llama::ProgressThrottle>();
  return [dir, throttle](const nn::HfLoadProgress& p) {
    const bool done = p.tensors == p.tensors_total;
    if (!throttle->due(p.seconds, done)) return;
    std::fprintf(stderr, "loading %s: %zu/%zu tensors, %.2f of %.2f GB in %.1f s (%.2f GB/s)%s\n", dir.c_str(), p.tensors, p.tensors_total,
                 double(p.bytes) / 1e9, double(p.bytes_total) / 1e9, p.seconds, double(p.bytes) / 1e9 / std::max(p.seconds, 1e-9),
                 done ? "" : " ...");
  };
}

// --result-json FILE: the run's outcome as one JSON object, for drivers such as bench/fidelity/fidelity.py that
// compare strategies over seeds. Written to FILE.tmp and renamed, so a reader never sees half a file.
inline void write_result(const std::string& path, const nlohmann::json& result) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << result.dump() << "\n";
    if (!out) throw std::runtime_error("--result-json: cannot write " + tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw std::runtime_error("--result-json: cannot rename " + tmp + " to " + path + ": " + ec.message());
}

// A number for JSON: NaN and infinities (e.g. no training step ran) become null, which JSON can hold.
inline nlohmann::json finite_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

// ---- the training loop, one instantiation per strategy --------------------------------------------------
template <StrategyType S>
int run_training(const Options& o) {
  // Several processes (squeeze-launch / torchrun: one per GPU): rank r trains on rows [r B/N, (r+1) B/N) of each
  // --batch and runs on cuda:LOCAL_RANK; alone, world size 1.
  const comm::DistEnv env = comm::DistEnv::from_environment();
  const torch::Device device =
      o.device == "cuda" ? torch::Device(torch::kCUDA, c10::DeviceIndex(env.local_rank)) : torch::Device(torch::kCPU);
  if (device.is_cuda() && !torch::cuda::is_available())
    throw std::runtime_error(
        "--device cuda: this libtorch has no CUDA device available (build with -DSQUEEZE_TORCH_CUDA=ON on a GPU machine)");
  torch::manual_seed(o.seed);
  // AdamW's second moments of tiny gradients become denormal floats, which x86 CPUs compute at a fraction
  // of the speed: flush them to zero (a no-op for the GPU).
  at::globalContext().setFlushDenormal(true);
  if (o.threads > 0) torch::set_num_threads(int(o.threads));

  // --hf: a Hugging Face LLaMA directory is the starting point (its geometry, RoPE and weights).
  const bool pretrained = !o.hf.empty();
  nn::LlamaConfig config = pretrained ? nn::from_hf_config(io::load_llama_config(o.hf), o.hf) : nn::LlamaConfig::preset(o.preset);
  if (o.vocab > 0) config.vocab = o.vocab;
  const std::string model_name = pretrained ? "--hf " + o.hf : "--preset " + o.preset;

  if (o.batch % (int64_t(env.world) * S::accumulation_steps) != 0)
    throw std::runtime_error("--batch " + std::to_string(o.batch) + " must split into " + std::to_string(env.world) + " rank(s) x " +
                             std::to_string(S::accumulation_steps) + " micro-batches");
  // The data: bytes of a text (ids 0-255), or --data's token shards, whose ids must be < the model's vocabulary.
  // A run that trains no step, names no data and exports (e.g. --hf DIR --steps 0 --export-hf OUT, a conversion)
  // reads no data and evaluates nothing: the KJV may be missing, and the built-in text is shorter than --seq.
  const bool export_only = o.steps == 0 && o.data.empty() && o.corpus.empty() && (!o.export_hf.empty() || !o.export_peft.empty());
  Corpus corpus;
  torch::Tensor train_ids, val_ids;  // [n] each, the byte path
  llama::ShardData shards;
  const int64_t rows = o.batch / env.world;  // this rank's rows of every batch
  if (export_only) {
    corpus.source = "none";  // --result-json's "corpus"
  } else if (o.data.empty()) {
    if (config.vocab < 256)
      throw std::runtime_error(model_name + ": its vocabulary (" + std::to_string(config.vocab) +
                               ") is smaller than the 256 byte ids this example feeds");
    corpus = load_corpus(o.corpus, o.val_fraction);
    train_ids = tokenize(corpus.train), val_ids = tokenize(corpus.val);
    if (train_ids.size(0) <= o.seq + 1 || val_ids.size(0) <= o.seq + 1)
      throw std::runtime_error("--seq " + std::to_string(o.seq) + " is longer than the corpus' training or validation text");
  } else {
    shards = open_shards(o.data, config.vocab, model_name, rows, o.batch, o.seq, o.seed, env.rank, env.world);
  }
  llama::TrainOptions topt;
  topt.lr = o.lr, topt.weight_decay = o.weight_decay, topt.clip = o.clip, topt.loss_chunk_tokens = o.loss_chunk;
  topt.fused_loss = o.fused_loss;
  // The trainer refuses a step planned beyond the device before it moves anything there (quantized strategies: the
  // block-by-block build refuses it before building).
  topt.planned_batch = rows, topt.planned_seq = o.seq;
  if constexpr (S::quantized_weights && S::has_lora) {
    // Built block by block; refused before anything is allocated when this rank's training step would not fit.
    topt.layerwise.train = llama::train_shape<S>(config, rows, o.seq, env.world, o.loss_chunk, {});
    topt.layerwise.progress = llama::build_progress(pretrained ? o.hf : o.preset, env.rank == 0);
    if (env.rank == 0) {
      nn::LayerwiseOptions lo = topt.layerwise;
      lo.device = device;
      const nn::LayerwiseMemory m = nn::layerwise_memory<S>(config, lo, pretrained);
      std::fprintf(stderr,
                   "building %s block by block: packed blocks and adapters %.2f GB, one float block %.2f GB; needs %.2f GB of host "
                   "memory",
                   (pretrained ? o.hf : o.preset).c_str(), double(m.packed_bytes) / 1e9, double(m.float_block_bytes) / 1e9,
                   double(m.host_bytes) / 1e9);
      if (device.is_cuda())
        std::fprintf(stderr, " and %.2f GB on the device (the training step's peak included)", double(m.device_bytes) / 1e9);
      std::fprintf(stderr, "\n");
    }
  }
  LlamaRun<S> trainer = pretrained ? LlamaRun<S>::from_hf(o.hf, topt, device, comm::from_env(), load_progress(o.hf, env.rank == 0))
                                   : LlamaRun<S>(config, topt, device, comm::from_env());
  if (!o.load.empty()) {
    trainer.load(o.load);
    std::cerr << "resumed from " << o.load << " at step " << trainer.step_count() << "\n";
  }
  const double planned_gb = double(llama::plan_for<S>(config, o.batch, o.seq, 1, o.loss_chunk).peak().device) / 1e9;
  const int64_t n_params = config.shape().params();  // the module's own tensors are emptied once stage 3 shards them
  std::cerr << "model " << (pretrained ? o.hf : o.preset) << " (" << n_params / 1e6 << "M parameters, vocabulary " << config.vocab
            << "), strategy " << o.strategy << ", device " << device << ", peak lr " << o.lr << "\n";
  if (export_only)
    std::cerr << "no data: --steps 0 with an export and no --corpus / --data, so nothing is evaluated\n";
  else if (o.data.empty())
    std::cerr << "corpus: " << corpus.source << ": " << train_ids.size(0) << " training bytes, " << val_ids.size(0)
              << " validation bytes\n";
  else
    std::cerr << "data: " << o.data << ": " << shards.train_tokens << " training tokens in " << shards.train->shard_count() << " shard(s), "
              << shards.val_tokens << " validation tokens in " << shards.val->shard_count() << " shard(s)\n";
  std::cerr << "planner: " << planned_gb << " GB peak on the device for batch " << o.batch << " x " << o.seq;
  if constexpr (S::stage <= 1)  // the example's choice, which the planner assumed (docs/memory-model.md)
    std::cerr << ", gradient buffer "
              << plan::to_string(llama::train_shape<S>(config, o.batch, o.seq, 1, o.loss_chunk, {}).gradient_buffers);
  std::cerr << "\n";

  const auto val = export_only      ? std::vector<std::pair<torch::Tensor, torch::Tensor>>{}
                   : o.data.empty() ? val_batches(val_ids, o.batch, o.seq, o.eval_batches, device)
                                    : shard_val_batches(*shards.val, o.eval_batches, device);
  const auto report_val = [&](Progress& bar) {
    const double loss = trainer.evaluate(val);
    char s[128];
    std::snprintf(s, sizeof s, "step %lld: validation loss %.4f, perplexity %.3f", (long long)trainer.step_count(), loss, std::exp(loss));
    bar.message(s);
    return loss;
  };
  const auto save = [&](Progress& bar) {
    if (o.save.empty()) return;
    trainer.save(o.save);
    bar.message("saved " + o.save + " at step " + std::to_string(trainer.step_count()));
  };

  Progress bar(trainer.step_count(), o.steps, o.log_every);
  llama::reset_peak_memory(device);
  double first_loss = NAN, last_loss = NAN, tokens = 0, seconds = 0;
  int64_t skipped = 0;  // fp16 steps skipped on overflow (their batch is tried again, so the tokens trained stay equal)
  const int64_t first_step = trainer.step_count();  // its time (allocator warm-up) is left out of tokens/s
  for (int64_t step = trainer.step_count(); step < o.steps; step = trainer.step_count()) {
    torch::Tensor x, y;
    if (o.data.empty()) {
      const auto [bx, by] = sample_batch(train_ids, o.batch, o.seq, o.seed, step, device);
      x = bx.narrow(0, env.rank * rows, rows), y = by.narrow(0, env.rank * rows, rows);
    } else {
      std::tie(x, y) = shard_batch(*shards.train, uint64_t(step), device);  // this rank's windows of the step
    }
    trainer.set_lr(lr_at(step, o.steps, o.lr));
    const auto t0 = std::chrono::steady_clock::now();
    const llama::BatchResult r = trainer.step(x, y);  // the loss read-back synchronises the device
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!r.applied && trainer.step_count() == step) {
      // A skipped fp16 step (overflow) does not count; give up if the scale collapses.
      bar.update(step, r, 0, llama::device_memory(device));
      ++skipped;
      if (r.scale <= 1.0) throw std::runtime_error("gradients are not finite even at loss scale 1: lower --lr");
      continue;
    }
    if (std::isnan(first_loss)) {
      first_loss = r.loss;
      if constexpr (S::offload_to_host && !S::loss_scaling)
        if (!trainer.trainer().updated_during_backward() && o.clip > 0)
          bar.message(
              "Offload<Host>: the host AdamW starts after backward, when the clipping norm is known; --clip 0 lets it start "
              "during backward, partition by partition");
    }
    last_loss = r.loss;
    if (step > first_step || o.steps - first_step == 1) {
      tokens += double(o.batch * o.seq);
      seconds += dt;
    }
    bar.update(step, r, double(o.batch * o.seq) / dt, llama::device_memory(device));
    if (o.eval_every > 0 && trainer.step_count() % o.eval_every == 0 && trainer.step_count() < o.steps) {
      report_val(bar);
      save(bar);
    }
  }
  bar.done();
  const double val_loss = export_only ? NAN : report_val(bar);
  save(bar);
  const auto mem = llama::device_memory(device);
  if (!export_only)
    std::printf("strategy %s: train loss %.4f -> %.4f, validation perplexity %.3f, %.0f tokens/s, peak memory %.2f GB (planner %.2f GB)\n",
                o.strategy.c_str(), first_loss, last_loss, std::exp(val_loss), seconds > 0 ? tokens / seconds : 0.0, mem.peak_gb,
                planned_gb);
  if (o.sample > 0 && o.data.empty() && !export_only)
    std::printf("sample: %s\n", sample_text(trainer.model(), "And God said", o.sample, o.seq, device, o.seed).c_str());
  export_results(o, trainer, config, env.rank);
  if (!o.result_json.empty() && env.rank == 0) {
    int64_t val_tokens = 0;
    for (const auto& b : val) val_tokens += b.second.numel();
    const int64_t steps = trainer.step_count();
    write_result(o.result_json, {{"strategy", o.strategy},
                                 {"lora", S::has_lora},
                                 {"preset", pretrained ? std::string() : o.preset},
                                 {"hf", o.hf},
                                 {"corpus", o.data.empty() ? corpus.source : o.data},
                                 {"device", o.device},
                                 {"seed", o.seed},
                                 {"steps", steps},
                                 {"batch", o.batch},
                                 {"seq", o.seq},
                                 {"tokens", steps * o.batch * o.seq},
                                 {"resumed_from", first_step},
                                 {"skipped_steps", skipped},
                                 {"lr", o.lr},
                                 {"val_tokens", val_tokens},
                                 {"val_loss", finite_or_null(val_loss)},
                                 {"val_ppl", finite_or_null(std::exp(val_loss))},
                                 {"train_loss", finite_or_null(last_loss)},
                                 {"tokens_per_s", seconds > 0 ? tokens / seconds : 0.0},
                                 {"peak_gb", mem.peak_gb},
                                 {"planned_gb", planned_gb}});
  }
  return 0;
}

// The strategy called o.strategy, if part Part of Parts compiled it: its run's exit code in rc. Defined in the units
// that define SQUEEZE_TRAIN_PART (one a part), declared elsewhere.
template <int Part, int Parts>
bool run_training_part(const Options& o, int& rc);

#if defined(SQUEEZE_TRAIN_PART)
template <int Part, int Parts>
bool run_training_part(const Options& o, int& rc) {
  bool found = false;
  llama::for_each_strategy<Part, Parts>([&]<StrategyType S>(std::string_view name) {
    if (found || name != o.strategy) return;
    found = true;
    rc = run_training<S>(o);
  });
  return found;
}

template bool run_training_part<SQUEEZE_TRAIN_PART, SQUEEZE_TRAIN_PARTS>(const Options&, int&);
#endif

}  // namespace squeeze::llama_train
