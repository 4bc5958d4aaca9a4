// squeeze-tokenize: text files to llm.c-format token shards with a model's SentencePiece tokenizer (torch-free;
// installed beside the library).
//
//   squeeze-tokenize --model DIR --out OUT FILE...   [--split file|paragraph|line] [--val-fraction F | --val-tokens N]
//                    [--shard-tokens N] [--vocab N] [--no-bos] [--no-eos] [--force]
//
// DIR is a Hugging Face model directory holding tokenizer.model (or that file itself). Every document (a file, a
// blank-line-separated paragraph or a line) becomes BOS, its ids, EOS, as LLaMA pre-training concatenates them. The
// last documents of the input, kept whole, are the validation split: those starting in the last --val-fraction of
// the input's bytes, or the fewest holding --val-tokens tokens. Shards: OUT/train_000000.bin, ... and
// OUT/val_000000.bin, ... of --shard-tokens tokens each (the last one shorter), uint16 ids when the model's vocabulary
// fits, else uint32. Everything is written into OUT/.squeeze-tokenize.tmp and moved into place at the end, so OUT never
// holds a partial set; existing shards there are refused unless --force (which replaces them all).
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <squeeze/io/posix_file.hpp>
#include <squeeze/io/sentencepiece.hpp>
#include <squeeze/io/token_shards.hpp>

namespace io = squeeze::io;
namespace fs = std::filesystem;
using squeeze::check;

namespace {

struct Options {
  std::string model, out, split = "file";
  std::vector<std::string> inputs;
  double val_fraction = 0.05;
  std::uint64_t val_tokens = 0, shard_tokens = 100'000'000;
  std::int64_t vocab = 0;
  bool bos = true, eos = true, force = false;
};

// The SentencePiece file of a model directory (or the file itself); other tokenizer formats are named and refused.
fs::path tokenizer_file(const fs::path& model) {
  if (!fs::is_directory(model)) {
    check(fs::is_regular_file(model), "--model " + model.string() + " does not exist");
    return model;
  }
  if (fs::is_regular_file(model / "tokenizer.model")) return model / "tokenizer.model";
  check(!fs::exists(model / "tokenizer.json"),
        "--model " + model.string() + " has only tokenizer.json, which is not supported: squeeze reads SentencePiece "
        "tokenizers (tokenizer.model: LLaMA-1/2, TinyLlama, Mistral), not the byte-level BPE of tokenizer.json (LLaMA 3, GPT-2): "
        "write its shards with tools/tokenize_hf.py");
  throw squeeze::Error("--model " + model.string() + " has no tokenizer.model");
}

// The model's vocabulary: --vocab, else config.json's vocab_size when the directory has one, else the tokenizer's.
std::int64_t model_vocab(const Options& o, const io::SentencePieceTokenizer& tok) {
  if (o.vocab > 0) return o.vocab;
  const fs::path config = fs::path(o.model) / "config.json";
  if (fs::is_directory(o.model) && fs::is_regular_file(config)) {
    std::ifstream f(config);
    const auto j = nlohmann::json::parse(f, nullptr, false);
    check(!j.is_discarded() && j.contains("vocab_size") && j["vocab_size"].is_number_integer(),
          config.string() + ": not JSON with an integer vocab_size");
    return j["vocab_size"].get<std::int64_t>();
  }
  return tok.vocab_size();
}

// train_000000.bin, train_000001.bin, ... of at most `per_shard` tokens each.
class ShardSeries {
 public:
  ShardSeries(fs::path dir, std::string split, io::TokenWidth width, std::uint64_t per_shard)
      : dir_(std::move(dir)), split_(std::move(split)), width_(width), per_shard_(per_shard) {}

  void append(std::span<const int> ids) {
    while (!ids.empty()) {
      if (!cur_) {
        char name[64];
        std::snprintf(name, sizeof name, "%s_%06zu.bin", split_.c_str(), files_.size());
        files_.push_back(name);
        cur_ = std::make_unique<io::TokenShardWriter>(dir_ / name, width_);
      }
      const std::size_t n = std::size_t(std::min<std::uint64_t>(ids.size(), per_shard_ - cur_->count()));
      cur_->append(ids.first(n));
      ids = ids.subspan(n);
      tokens_ += n;
      if (cur_->count() == per_shard_) finish();
    }
  }
  void finish() {
    if (cur_) cur_->close();
    cur_.reset();
  }
  std::uint64_t tokens() const { return tokens_; }
  const std::vector<std::string>& files() const { return files_; }

 private:
  fs::path dir_;
  std::string split_;
  io::TokenWidth width_;
  std::uint64_t per_shard_, tokens_ = 0;
  std::unique_ptr<io::TokenShardWriter> cur_;
  std::vector<std::string> files_;
};

// Calls `doc(text, offset)` for every non-empty document, `offset` being its first byte in the concatenated input.
void for_each_document(const std::vector<std::string>& inputs, const std::string& split,
                       const std::function<void(const std::string&, std::uint64_t)>& doc) {
  std::uint64_t base = 0;
  for (const std::string& path : inputs) {
    std::ifstream in(path, std::ios::binary);
    check(bool(in), "cannot read " + path);
    if (split == "file") {
      const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
      if (!text.empty()) doc(text, base);
    } else {
      std::string para;
      std::uint64_t pos = base, start = base;
      for (std::string line; std::getline(in, line); pos += line.size() + 1) {
        if (split == "line") {
          if (!line.empty()) doc(line, pos);
        } else if (line.empty()) {
          if (!para.empty()) doc(para, start);
          para.clear();
        } else {
          if (para.empty()) start = pos;
          else para += '\n';
          para += line;
        }
      }
      if (!para.empty()) doc(para, start);
    }
    check(!in.bad(), "reading " + path + " failed");
    base += fs::file_size(path);
  }
}

int tokenize(const Options& o) {
  for (const std::string& p : o.inputs) check(fs::is_regular_file(p), "input " + p + " does not exist or is not a file");
  const io::SentencePieceTokenizer tok(tokenizer_file(o.model));
  const std::int64_t vocab = model_vocab(o, tok);
  check(tok.vocab_size() <= vocab, "the tokenizer's " + std::to_string(tok.vocab_size()) + " ids do not fit the model's vocabulary of " +
                                       std::to_string(vocab) + " (--vocab or config.json): ids up to " +
                                       std::to_string(tok.vocab_size() - 1) + " would index past its embedding");
  check(!o.bos || tok.bos_id() >= 0, "the tokenizer defines no BOS piece: pass --no-bos");
  check(!o.eos || tok.eos_id() >= 0, "the tokenizer defines no EOS piece: pass --no-eos");
  const io::TokenWidth width = io::token_width_for(vocab);

  const fs::path out(o.out), stage = out / ".squeeze-tokenize.tmp";
  fs::create_directories(out);
  std::vector<fs::path> old = io::token_shard_files(out, "train");
  for (const auto& p : io::token_shard_files(out, "val")) old.push_back(p);
  if (!old.empty() && !o.force)
    throw squeeze::Error(out.string() + " already holds token shards (" + old.front().filename().string() + (old.size() > 1 ? ", ..." : "") +
                         "): pass --force to replace them");
  squeeze::io::remove_tree(stage);
  fs::create_directory(stage);
  struct Cleanup {
    fs::path dir;
    ~Cleanup() {
      squeeze::io::try_remove_tree(dir);
    }
  } cleanup{stage};

  std::uint64_t total_bytes = 0, docs = 0, val_docs = 0;
  for (const std::string& p : o.inputs) total_bytes += fs::file_size(p);
  const std::uint64_t val_from = o.val_tokens > 0 ? total_bytes : std::uint64_t(double(total_bytes) * (1 - o.val_fraction));
  ShardSeries train(stage, "train", width, o.shard_tokens), val(stage, "val", width, o.shard_tokens);
  std::deque<std::vector<int>> tail;  // --val-tokens: the latest documents, the fewest holding that many tokens
  std::uint64_t tail_tokens = 0;
  const auto t0 = std::chrono::steady_clock::now();
  auto last_report = t0;
  for_each_document(o.inputs, o.split, [&](const std::string& text, std::uint64_t offset) {
    std::vector<int> ids;
    if (o.bos) ids.push_back(tok.bos_id());
    const std::vector<int> body = tok.encode(text);
    ids.insert(ids.end(), body.begin(), body.end());
    if (o.eos) ids.push_back(tok.eos_id());
    ++docs;
    if (o.val_tokens == 0) {
      (offset >= val_from ? val : train).append(ids);
      val_docs += offset >= val_from;
    } else {
      tail_tokens += ids.size();
      tail.push_back(std::move(ids));
      for (; tail_tokens - tail.front().size() >= o.val_tokens; tail.pop_front()) {
        tail_tokens -= tail.front().size();
        train.append(tail.front());
      }
    }
    const auto now = std::chrono::steady_clock::now();
    if (now - last_report >= std::chrono::seconds(2)) {
      last_report = now;
      const double mb = double(offset + text.size()) / 1e6, s = std::chrono::duration<double>(now - t0).count();
      std::fprintf(stderr, "%.1f of %.1f MB (%.0f%%), %llu documents, %llu tokens, %.2f MB/s\n", mb, double(total_bytes) / 1e6,
                   100 * mb * 1e6 / double(total_bytes), (unsigned long long)docs,
                   (unsigned long long)(train.tokens() + val.tokens() + tail_tokens), mb / s);
    }
  });
  for (; !tail.empty(); tail.pop_front(), ++val_docs) val.append(tail.front());
  train.finish();
  val.finish();
  check(docs > 0, "the input holds no text");
  char percent[32];
  std::snprintf(percent, sizeof percent, "%g%%", 100 * o.val_fraction);
  check(val.tokens() > 0, std::string("no document starts in the last ") + percent +
                              " of the input, so validation would be empty: use more or smaller documents (--split), or --val-tokens");
  check(train.tokens() > 0, "all " + std::to_string(docs) + " document(s) went to validation, so training would be empty: " +
                                "use more or smaller documents (--split line), or a smaller --val-fraction / --val-tokens");

  // Into place: the new shards (replacing same-named old ones), then the old shards the new set does not have.
  std::vector<fs::path> written;
  for (const auto* s : {&train, &val})
    for (const std::string& f : s->files()) {
      fs::rename(stage / f, out / f);
      written.push_back(out / f);
    }
  for (const auto& p : old)
    if (std::find(written.begin(), written.end(), p) == written.end()) fs::remove(p);
  std::printf("wrote %s: %zu training shard(s) of %llu tokens, %zu validation shard(s) of %llu tokens (%llu of %llu documents), "
              "%s ids, vocabulary %lld, %.2f s\n",
              out.c_str(), train.files().size(), (unsigned long long)train.tokens(), val.files().size(), (unsigned long long)val.tokens(),
              (unsigned long long)val_docs, (unsigned long long)docs, width == io::TokenWidth::U16 ? "uint16" : "uint32", (long long)vocab,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"squeeze-tokenize: text files to llm.c-format token shards (train_*.bin, val_*.bin) with a model's SentencePiece tokenizer"};
  app.add_option("files", o.inputs, "text files, read in this order")->required();
  app.add_option("--model", o.model, "Hugging Face model directory holding tokenizer.model, or a tokenizer.model file")->required();
  app.add_option("--out", o.out, "directory for the shards (created if missing)")->required();
  app.add_option("--split", o.split, "what one document is: a whole file, a blank-line-separated paragraph, or a line")
      ->check(CLI::IsMember({"file", "paragraph", "line"}))
      ->capture_default_str();
  auto* frac = app.add_option("--val-fraction", o.val_fraction, "validation: the documents starting in this last fraction of the input bytes")
                   ->check(CLI::Range(1e-9, 1.0 - 1e-9))
                   ->capture_default_str();
  app.add_option("--val-tokens", o.val_tokens, "validation instead: the fewest last documents holding at least this many tokens")
      ->check(CLI::PositiveNumber)
      ->excludes(frac);
  app.add_option("--shard-tokens", o.shard_tokens, "tokens per shard file")
      ->check(CLI::Range(std::uint64_t(1), io::kTokenShardMaxTokens))
      ->capture_default_str();
  app.add_option("--vocab", o.vocab, "the model's vocabulary size (default: config.json's vocab_size, else the tokenizer's)")
      ->check(CLI::PositiveNumber);
  app.add_flag("!--no-bos", o.bos, "no BOS before each document");
  app.add_flag("!--no-eos", o.eos, "no EOS after each document");
  app.add_flag("--force", o.force, "replace the shards already in --out");
  CLI11_PARSE(app, argc, argv);
  try {
    return tokenize(o);
  } catch (const std::exception& e) {
    std::cerr << "squeeze-tokenize: " << e.what() << "\n";
    return 1;
  }
}
