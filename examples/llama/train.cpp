// Train a LLaMA on the King James Bible, byte by byte, with a memory strategy picked on the command line.
//
//   llama_train --preset tiny --strategy bf16 --steps 200            (CPU, well under a minute)
//   llama_train --preset tinyllama-1.1b --device cuda --strategy bf16-ckpt --batch 8 --seq 2048 --lr 3e-4
//
// Every strategy is a compile-time squeeze::Strategy<...> (see trainer.hpp's for_each_strategy); --strategy
// picks one of those compiled in. The corpus is Debian's bible-kjv-text, printed verse by verse by the
// `bible` program of bible-kjv (`apt-get install bible-kjv`); --corpus FILE trains on any text file instead,
// and without either a small built-in text keeps the example running. --data DIR trains on token shards in the
// model's own vocabulary instead of bytes (squeeze-tokenize writes them with a Hugging Face model's tokenizer).
#include <CLI/CLI.hpp>

#if SQUEEZE_TRAIN_PARTS == 1  // the strategies' loops in this unit (CMakeLists.txt writes a unit per part only for several)
#define SQUEEZE_TRAIN_PART 0
#endif
#include "train_run.hpp"

using namespace squeeze;
using squeeze::llama_train::Options;

namespace {

// "tiny 0.003, 125m 0.001, ...": llama::default_lr of every preset, for --lr's help.
std::string default_lr_list() {
  std::ostringstream out;
  for (const auto& name : nn::LlamaConfig::preset_names()) out << (out.tellp() > 0 ? ", " : "") << name << " " << llama::default_lr(name);
  return out.str();
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Train a LLaMA on the King James Bible (byte-level) or on token shards (--data) with a squeeze memory strategy"};
  app.add_option("--preset", o.preset, "model size")->check(CLI::IsMember(nn::LlamaConfig::preset_names()))->capture_default_str();
  app.add_option("--strategy", o.strategy, "memory strategy compiled into this program")
      ->check(CLI::IsMember(llama::strategy_names()))
      ->capture_default_str();
  app.add_option("--steps", o.steps, "optimizer steps in total (a resumed run continues to this step; 0: evaluate only)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--batch", o.batch, "sequences per optimizer step (split into micro-batches by Accumulate<N>)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seq", o.seq, "tokens (bytes) per sequence")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--lr", o.lr, "peak learning rate (warm-up, then cosine to 10%); default by preset: " + default_lr_list())
      ->check(CLI::PositiveNumber);
  app.add_option("--weight-decay", o.weight_decay, "AdamW weight decay")->capture_default_str();
  app.add_option("--clip", o.clip, "gradient-norm clip (0: off)")->capture_default_str();
  app.add_flag("--fused-loss", o.fused_loss,
               "train through the fused linear + cross-entropy (both gradients in the loss's pass, no recomputed head)");
  app.add_option("--loss-chunk", o.loss_chunk,
                 "tokens per chunk of the LM head + cross-entropy, each recomputed in backward "
                 "(0: all tokens of a micro-batch at once)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 30))
      ->capture_default_str();
  app.add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  auto* corpus = app.add_option("--corpus", o.corpus, "train on this text file instead of the KJV");
  app.add_option("--data", o.data,
                 "train on the token shards in this directory (train_*.bin, val_*.bin: squeeze-tokenize's or llm.c's) "
                 "instead of bytes; ids must be below the model's vocabulary")
      ->check(CLI::ExistingDirectory)
      ->excludes(corpus);
  auto* hf = app.add_option("--hf", o.hf, "start from this Hugging Face LLaMA directory (config.json + safetensors) instead of --preset")
                 ->check(CLI::ExistingDirectory);
  app.add_option("--vocab", o.vocab, "the preset's vocabulary size (default: its own; tiny: 256 bytes), e.g. the tokenizer's for --data")
      ->check(CLI::PositiveNumber)
      ->excludes(hf);
  app.add_option("--export-hf", o.export_hf, "write the trained model here as a Hugging Face LLaMA directory (LoRA merged)");
  app.add_option("--export-peft", o.export_peft, "write a LoRA strategy's adapters here in PEFT's format");
  app.add_option("--result-json", o.result_json,
                 "write the run's outcome here as one JSON object (strategy, steps, tokens, seed, "
                 "validation loss and perplexity, tokens/s, peak memory)");
  app.add_option("--save", o.save, "checkpoint directory: a checkpoint at every evaluation and at the end (the newest three kept)");
  app.add_option("--load", o.load, "resume from the latest checkpoint in this directory (any world size)")->check(CLI::ExistingDirectory);
  app.add_option("--eval-every", o.eval_every, "steps between validation runs (0: only at the end)")->capture_default_str();
  app.add_option("--eval-batches", o.eval_batches, "validation batches per evaluation")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--log-every", o.log_every, "steps between progress lines when not on a terminal (0: ten lines)");
  app.add_option("--sample", o.sample, "bytes of text to sample at the end (0: none; not with --data)")->capture_default_str();
  app.add_option("--threads", o.threads, "CPU threads (0: libtorch's default; 1 is faster on a busy machine)")->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the initial weights and the batches")->capture_default_str();
  bool presets = false;
  app.add_flag("--presets", presets, "print each preset's geometry and default learning rate as a JSON line, and exit");
  CLI11_PARSE(app, argc, argv);
  if (presets) {
    for (const auto& name : nn::LlamaConfig::preset_names()) {
      nlohmann::json line = llama::geometry_of(nn::LlamaConfig::preset(name));
      line["default_lr"] = llama::default_lr(name);
      std::cout << line.dump() << "\n";
    }
    return 0;
  }
  if (app.count("--lr") == 0) o.lr = llama::default_lr(o.preset);

  try {
    int rc = 0;
    const bool found = [&]<int... P>(std::integer_sequence<int, P...>) {
      return (llama_train::run_training_part<P, SQUEEZE_TRAIN_PARTS>(o, rc) || ...);
    }
    (std::make_integer_sequence<int, SQUEEZE_TRAIN_PARTS>{});
    if (!found) llama::with_strategy(o.strategy, []<StrategyType>() {});  // throws, naming the strategies compiled in
    return rc;
  } catch (const c10::Error& e) {
    std::cerr << "\nerror: " << e.what_without_backtrace() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "\nerror: " << e.what() << "\n";
  }
  return 1;
}
