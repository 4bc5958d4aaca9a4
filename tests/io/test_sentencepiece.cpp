// io::SentencePieceTokenizer against the encodings the Python sentencepiece library wrote for the fixture model
// (tests/fixtures/hf/spm-tiny: BPE, byte fallback, digits split, identity normalisation, as LLaMA's): ids and
// pieces exactly, decode back to the text, and clear errors for a missing file or an id outside the vocabulary.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include <squeeze/io/sentencepiece.hpp>

namespace {

namespace fs = std::filesystem;
const fs::path kSpm = fs::path(SQUEEZE_HF_FIXTURES) / "spm-tiny";

TEST(SentencePiece, EncodesAsTheReferenceLibrary) {
  const squeeze::io::SentencePieceTokenizer tok(kSpm / "tokenizer.model");
  std::ifstream f(kSpm / "encodings.json");
  const auto j = nlohmann::json::parse(f);
  EXPECT_EQ(tok.vocab_size(), j.at("vocab_size").get<int>());
  EXPECT_EQ(tok.bos_id(), j.at("bos_id").get<int>());
  EXPECT_EQ(tok.eos_id(), j.at("eos_id").get<int>());
  EXPECT_EQ(tok.unk_id(), j.at("unk_id").get<int>());
  ASSERT_GE(j.at("encodings").size(), 4u);
  for (const auto& e : j.at("encodings")) {
    const std::string text = e.at("text");
    EXPECT_EQ(tok.encode(text), e.at("ids").get<std::vector<int>>()) << text;
    EXPECT_EQ(tok.pieces(text), e.at("pieces").get<std::vector<std::string>>()) << text;
    EXPECT_EQ(tok.decode(tok.encode(text)), text) << "byte fallback and identity normalisation give the text back";
  }
}

TEST(SentencePiece, ErrorsNameTheProblem) {
  try {
    squeeze::io::SentencePieceTokenizer missing(kSpm / "no-such.model");
    ADD_FAILURE() << "no error";
  } catch (const squeeze::Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not exist"), std::string::npos) << e.what();
  }
  const squeeze::io::SentencePieceTokenizer tok(kSpm / "tokenizer.model");
  try {
    (void)tok.decode({1, tok.vocab_size()});
    ADD_FAILURE() << "no error";
  } catch (const squeeze::Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside the vocabulary"), std::string::npos) << e.what();
  }
}

}  // namespace
