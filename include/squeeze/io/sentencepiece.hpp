#pragma once
// SentencePiece tokenizer files (the tokenizer.model of LLaMA-1/2, TinyLlama, Mistral) through the SentencePiece
// library (Debian: libsentencepiece-dev; link `sentencepiece`). Ids are the model's vocabulary numbers, so they
// index a Hugging Face model's embedding directly; no BOS/EOS is added (the caller decides).
#include <sentencepiece_processor.h>

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "squeeze/error.hpp"

namespace squeeze::io {

class SentencePieceTokenizer {
 public:
  explicit SentencePieceTokenizer(const std::filesystem::path& model) : source_(model.string()) {
    check(std::filesystem::is_regular_file(model), "SentencePiece model " + source_ + " does not exist");
    const auto status = sp_.Load(source_);
    check(status.ok(), "SentencePiece model " + source_ + " could not be read: " + status.ToString());
  }

  std::vector<int> encode(std::string_view text) const {
    std::vector<int> ids;
    const auto status = sp_.Encode(text, &ids);
    check(status.ok(), "SentencePiece " + source_ + ": encoding failed: " + status.ToString());
    return ids;
  }
  std::vector<std::string> pieces(std::string_view text) const {
    std::vector<std::string> out;
    const auto status = sp_.Encode(text, &out);
    check(status.ok(), "SentencePiece " + source_ + ": encoding failed: " + status.ToString());
    return out;
  }
  std::string decode(const std::vector<int>& ids) const {
    for (int id : ids)
      check(id >= 0 && id < vocab_size(),
            "SentencePiece " + source_ + ": id " + std::to_string(id) + " is outside the vocabulary of " + std::to_string(vocab_size()));
    std::string text;
    const auto status = sp_.Decode(ids, &text);
    check(status.ok(), "SentencePiece " + source_ + ": decoding failed: " + status.ToString());
    return text;
  }

  int vocab_size() const { return sp_.GetPieceSize(); }
  int bos_id() const { return sp_.bos_id(); }
  int eos_id() const { return sp_.eos_id(); }
  int unk_id() const { return sp_.unk_id(); }

 private:
  std::string source_;
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace squeeze::io
