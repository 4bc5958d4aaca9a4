#pragma once
// The LLaMA example's data: a text corpus split by lines into training and validation text, byte-level
// tokens, seeded random training windows and fixed validation windows. Shared by llama_train, bench_table
// and the GPTQ example.
//   Corpus c = load_corpus("", 0.05);           // the KJV (Debian's bible-kjv), or a built-in text
//   auto [x, y] = sample_batch(tokenize(c.train), B, T, seed, step, device);   // [B, T] each
// or token shards (--data DIR, written by squeeze-tokenize or llm.c) in the model's own vocabulary:
//   ShardData d = open_shards(dir, vocab, B, T, seed, rank, world);  auto [x, y] = shard_batch(*d.train, step, device);
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <squeeze/io/token_shards.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace squeeze::llama {

// ---- corpus -------------------------------------------------------------------------------------------
struct Corpus {
  std::string train, val, source;
};

// A few lines of our own so the example runs anywhere; far too little to learn much from.
inline constexpr const char* kBuiltinText =
    "In the beginning was a small model, and the model knew nothing.\n"
    "And the trainer said, Let there be gradients: and there were gradients.\n"
    "And the trainer saw the loss, that it was high; and the trainer divided the batch into micro-batches.\n"
    "And the activations were many, and the memory was full; and the trainer said, Recompute them.\n"
    "And the weights were kept in bfloat16, and the master weights in float, and it was good.\n"
    "And the evening and the morning were the first epoch.\n";

// Verses of the KJV, one per line, from the `bible` program; empty if it is not installed.
inline std::vector<std::string> bible_verses() {
  if (!std::filesystem::exists("/usr/lib/bible.data") && !std::filesystem::exists("/usr/share/bible-kjv/bible.data")) return {};
  FILE* pipe = popen("bible -f 'Genesis 1:1-Revelation 22:21' 2>/dev/null", "r");
  if (pipe == nullptr) return {};
  std::vector<std::string> verses;
  std::string line;
  for (int c; (c = std::fgetc(pipe)) != EOF;) {
    if (c != '\n') { line += char(c); continue; }
    // "Ge1:1 In the beginning ..." -> "In the beginning ..."
    if (const auto space = line.find(' '); space != std::string::npos && line.find(':') < space) verses.push_back(line.substr(space + 1));
    line.clear();
  }
  pclose(pipe);
  return verses;
}

// Splits whole lines: the last `val_fraction` of them (at least one) are validation text.
inline Corpus split_lines(const std::vector<std::string>& lines, double val_fraction, std::string source) {
  Corpus c;
  c.source = std::move(source);
  const size_t n_val = std::max<size_t>(1, size_t(double(lines.size()) * val_fraction));
  for (size_t i = 0; i < lines.size(); ++i) (i + n_val < lines.size() ? c.train : c.val) += lines[i] + "\n";
  return c;
}

// The training text: `corpus_file` if given, else the KJV, else the built-in text (with a note on stderr).
inline Corpus load_corpus(const std::string& corpus_file, double val_fraction) {
  std::vector<std::string> lines;
  if (!corpus_file.empty()) {
    std::ifstream in(corpus_file);
    if (!in) throw std::runtime_error("cannot read --corpus '" + corpus_file + "'");
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    if (lines.size() < 2) throw std::runtime_error("--corpus '" + corpus_file + "' needs at least two lines (train and validation)");
    return split_lines(lines, val_fraction, corpus_file);
  }
  lines = bible_verses();
  if (!lines.empty()) return split_lines(lines, val_fraction, "King James Bible (" + std::to_string(lines.size()) + " verses)");
  std::cerr << "note: the KJV corpus was not found (install it with `apt-get install bible-kjv`, or pass --corpus FILE);\n"
               "      training on a small built-in text instead.\n";
  std::istringstream in(kBuiltinText);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return split_lines(lines, 1.0 / 6, "built-in text");
}

// Bytes as token ids: [n] int64.
inline torch::Tensor tokenize(const std::string& text) {
  return torch::from_blob(const_cast<char*>(text.data()), {int64_t(text.size())}, torch::kUInt8).to(torch::kLong);
}
inline std::string detokenize(const torch::Tensor& ids) {
  std::string s;
  const torch::Tensor c = ids.to(torch::kCPU, torch::kLong).contiguous();
  for (int64_t i = 0; i < c.numel(); ++i) s += char(c.data_ptr<int64_t>()[i]);
  return s;
}

// Random windows of seq+1 tokens: x = window[:-1], y = window[1:], each [B, T]. The generator is seeded
// from (seed, step), so a resumed run sees the same batches as an uninterrupted one.
inline std::pair<torch::Tensor, torch::Tensor> sample_batch(const torch::Tensor& data, int64_t B, int64_t T, uint64_t seed,
                                                     int64_t step, torch::Device device) {
  auto gen = at::detail::createCPUGenerator(seed * 1000003ULL + uint64_t(step));
  const torch::Tensor start = torch::randint(0, data.size(0) - T - 1, {B, 1}, gen, torch::kLong);  // [B, 1]
  const torch::Tensor idx = start + torch::arange(T + 1, torch::kLong);                                 // [B, T+1]
  const torch::Tensor w = data.index_select(0, idx.reshape({-1})).view({B, T + 1});
  return {w.narrow(1, 0, T).to(device), w.narrow(1, 1, T).to(device)};
}

// Evenly spaced validation windows (the same ones every evaluation).
inline std::vector<std::pair<torch::Tensor, torch::Tensor>> val_batches(const torch::Tensor& data, int64_t B, int64_t T, int64_t n,
                                                                 torch::Device device) {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> out;
  const int64_t windows = B * n, span = data.size(0) - T - 1;
  const torch::Tensor start = torch::linspace(0, double(span), windows, torch::kDouble).to(torch::kLong).view({n, B, 1});
  for (int64_t i = 0; i < n; ++i) {
    const torch::Tensor idx = start[i] + torch::arange(T + 1, torch::kLong);  // [B, T+1]
    const torch::Tensor w = data.index_select(0, idx.reshape({-1})).view({B, T + 1});
    out.emplace_back(w.narrow(1, 0, T).to(device), w.narrow(1, 1, T).to(device));
  }
  return out;
}

// ---- token shards ------------------------------------------------------------------------------------------
// The train and val shards of a directory (io::token_shard_files: squeeze-tokenize's train_000000.bin, ... or llm.c's
// names). Training windows are shuffled per epoch by (seed, epoch) and split between the ranks; validation is read in
// order, whole batches on every rank. Every id is checked against the model's vocabulary on open.
struct ShardData {
  std::optional<io::TokenDataset> train, val;
  std::uint64_t train_tokens = 0, val_tokens = 0;
};

// `model` names where the vocabulary comes from, for the error.
inline ShardData open_shards(const std::filesystem::path& dir, int64_t vocab, const std::string& model, int64_t rows, int64_t batch, int64_t T,
                             uint64_t seed, int64_t rank, int64_t world) {
  const std::string src = "--data " + dir.string() + ": ";
  const auto train = io::token_shard_files(dir, "train"), val = io::token_shard_files(dir, "val");
  if (train.empty() || val.empty()) throw std::runtime_error(src + "needs train_*.bin and val_*.bin token shards (squeeze-tokenize writes them)");
  ShardData d;
  try {
    d.train.emplace(train, io::TokenDatasetOptions{.batch = rows, .seq = T, .vocab = vocab, .shuffle = true, .seed = seed, .rank = rank, .world = world});
    d.val.emplace(val, io::TokenDatasetOptions{.batch = batch, .seq = T, .vocab = vocab, .shuffle = false});
  } catch (const Error& e) {
    throw std::runtime_error(src + e.what());
  }
  for (const io::TokenDataset* ds : {&*d.train, &*d.val})
    for (std::size_t s = 0; s < ds->shard_count(); ++s) {
      try {
        ds->shard(s).check_vocab(vocab);  // an id >= vocab: the error names the file, the id and its position
      } catch (const Error& e) {
        throw std::runtime_error(src + e.what() + " of the model (" + model + "): tokenize with the model's own tokenizer");
      }
      (ds == &*d.train ? d.train_tokens : d.val_tokens) += ds->shard(s).size();
    }
  return d;
}

// Batch `step` of a dataset as (x, y) = (window[:-1], window[1:]), each [B, T] int64.
inline std::pair<torch::Tensor, torch::Tensor> shard_batch(const io::TokenDataset& d, uint64_t step, torch::Device device) {
  std::vector<std::int32_t> rows = d.batch(step);
  const int64_t B = d.options().batch, T = d.options().seq;
  const torch::Tensor w = torch::from_blob(rows.data(), {B, T + 1}, torch::kInt).to(torch::kLong);
  return {w.narrow(1, 0, T).to(device), w.narrow(1, 1, T).to(device)};
}

// n evenly spaced validation batches (fewer if the shards hold fewer), the same ones every evaluation.
inline std::vector<std::pair<torch::Tensor, torch::Tensor>> shard_val_batches(const io::TokenDataset& d, int64_t n, torch::Device device) {
  const uint64_t have = d.batches_per_epoch(), take = std::min<uint64_t>(have, uint64_t(n));
  std::vector<std::pair<torch::Tensor, torch::Tensor>> out;
  for (uint64_t i = 0; i < take; ++i) out.push_back(shard_batch(d, i * have / take, device));
  return out;
}

}  // namespace squeeze::llama
