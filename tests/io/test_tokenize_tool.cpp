// squeeze-tokenize run as a program on the spm-tiny fixture's tokenizer.model: the shards it writes, read back with
// TokenDataset, hold BOS + SentencePieceTokenizer's ids + EOS of every document, split into training and validation
// as documented, in uint16 or uint32; bad inputs fail with a message naming the problem and leave no shards behind.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include <squeeze/io/sentencepiece.hpp>
#include <squeeze/io/token_shards.hpp>

#include "io_test_util.hpp"

namespace {

namespace fs = std::filesystem;
namespace io = squeeze::io;
const fs::path kFixtures = SQUEEZE_FIXTURES;
const fs::path kSpm = kFixtures / "hf" / "spm-tiny";
const fs::path kGenesis = kFixtures / "text" / "genesis-1-3.txt";

struct ToolRun {
  int rc;
  std::string output;  // stdout and stderr
};
ToolRun tokenize(const std::string& args) {
  const std::string cmd = std::string(SQUEEZE_TOKENIZE_TOOL) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ToolRun r{-1, ""};
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) r.output.append(buf, n);
  const int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}
std::string q(const fs::path& p) { return "'" + p.string() + "'"; }

std::vector<std::string> lines_of(const fs::path& p) {
  std::ifstream in(p);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) out.push_back(l);
  return out;
}
std::vector<std::int32_t> document(const io::SentencePieceTokenizer& tok, const std::string& text) {
  std::vector<std::int32_t> ids{tok.bos_id()};
  for (int id : tok.encode(text)) ids.push_back(id);
  ids.push_back(tok.eos_id());
  return ids;
}
// Every token of a split, in order, through TokenDataset's shards.
std::vector<std::int32_t> read_split(const fs::path& dir, const std::string& split, std::size_t* shards = nullptr,
                                     io::TokenWidth* width = nullptr) {
  const io::TokenDataset d(io::token_shard_files(dir, split), {.batch = 1, .seq = 8, .vocab = 512, .shuffle = false});
  std::vector<std::int32_t> all;
  for (std::size_t s = 0; s < d.shard_count(); ++s) {
    std::vector<std::int32_t> t(d.shard(s).size());
    d.shard(s).copy(0, t, 512);
    all.insert(all.end(), t.begin(), t.end());
    if (width) *width = d.shard(s).width();
  }
  if (shards) *shards = d.shard_count();
  // the first window TokenDataset serves is the first 9 tokens of the first shard
  const auto b = d.batch(0);
  EXPECT_EQ(std::vector<std::int32_t>(b.begin(), b.end()), std::vector<std::int32_t>(all.begin(), all.begin() + 9));
  return all;
}

TEST(TokenizeTool, LinesIntoShardsReadBackAsTheTokenizerEncodes) {
  io_test::TempDir dir("tokenize_lines");
  const io::SentencePieceTokenizer tok(kSpm / "tokenizer.model");
  const ToolRun r =
      tokenize("--model " + q(kSpm) + " --out " + q(dir.path) + " --split line --val-tokens 300 --shard-tokens 1000 " + q(kGenesis));
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("uint16 ids, vocabulary 512"), std::string::npos) << r.output;

  // Expected: one document per line; validation = the fewest last documents holding >= 300 tokens.
  std::vector<std::vector<std::int32_t>> docs;
  for (const auto& l : lines_of(kGenesis)) docs.push_back(document(tok, l));
  std::size_t first_val = docs.size(), val_tokens = 0;
  while (val_tokens < 300) val_tokens += docs[--first_val].size();
  std::vector<std::int32_t> want_train, want_val;
  for (std::size_t i = 0; i < docs.size(); ++i) {
    auto& want = i < first_val ? want_train : want_val;
    want.insert(want.end(), docs[i].begin(), docs[i].end());
  }

  std::size_t shards = 0;
  io::TokenWidth width = io::TokenWidth::U32;
  EXPECT_EQ(read_split(dir.path, "train", &shards, &width), want_train);
  EXPECT_EQ(width, io::TokenWidth::U16);
  EXPECT_EQ(shards, (want_train.size() + 999) / 1000) << "shards of 1000 tokens, the last one shorter";
  EXPECT_GE(want_train.size(), 2000u);
  EXPECT_EQ(read_split(dir.path, "val"), want_val);
  EXPECT_EQ(io::TokenShard::open(dir.path / "train_000000.bin").size(), 1000u);
  EXPECT_FALSE(fs::exists(dir.path / ".squeeze-tokenize.tmp"));
  EXPECT_EQ(tok.decode(std::vector<int>(want_val.begin() + 1, want_val.begin() + int(docs[first_val].size()) - 1)),
            lines_of(kGenesis)[first_val]);
}

TEST(TokenizeTool, FilesAsDocumentsValidationByFractionAndWideIds) {
  io_test::TempDir dir("tokenize_files");
  const io::SentencePieceTokenizer tok(kSpm / "tokenizer.model");
  const std::string a = "In the beginning God created the heaven and the earth.\nAnd the earth was without form, and void.\n\n";
  const std::string b = "And God said, Let there be light: ünïcode.\n";
  std::ofstream(dir.path / "a.txt") << a;
  std::ofstream(dir.path / "b.txt") << b;
  // b starts at byte |a| >= 0.4 of the input: validation. --vocab over 65536: uint32 ids. No EOS.
  const ToolRun r = tokenize("--model " + q(kSpm / "tokenizer.model") + " --out " + q(dir.path / "shards") +
                             " --val-fraction 0.4 --vocab 70000 --no-eos " + q(dir.path / "a.txt") + " " + q(dir.path / "b.txt"));
  ASSERT_EQ(r.rc, 0) << r.output;
  auto want = [&](const std::string& text) {
    std::vector<std::int32_t> ids{tok.bos_id()};
    for (int id : tok.encode(text)) ids.push_back(id);
    return ids;
  };
  io::TokenWidth width = io::TokenWidth::U16;
  EXPECT_EQ(read_split(dir.path / "shards", "train", nullptr, &width), want(a)) << "a whole file, newlines and all";
  EXPECT_EQ(width, io::TokenWidth::U32);
  EXPECT_EQ(read_split(dir.path / "shards", "val"), want(b));
}

TEST(TokenizeTool, BadInputsAreNamedAndLeaveNoShards) {
  io_test::TempDir dir("tokenize_bad");
  const std::string model = "--model " + q(kSpm) + " --split line ";
  const std::string out = " --out " + q(dir.path / "out") + " ";
  auto expect_failure = [](const ToolRun& r, std::initializer_list<std::string> needles) {
    EXPECT_NE(r.rc, 0) << r.output;
    for (const auto& n : needles) EXPECT_NE(r.output.find(n), std::string::npos) << "'" << n << "' not in: " << r.output;
  };
  expect_failure(tokenize(model + out + q(kGenesis) + " " + q(dir.path / "missing.txt")), {"missing.txt", "does not exist"});
  EXPECT_FALSE(fs::exists(dir.path / "out")) << "inputs are checked before anything is written";

  // The tokenizer's 512 ids do not fit a 300-token vocabulary (as config.json's vocab_size would say).
  expect_failure(tokenize(model + out + "--vocab 300 " + q(kGenesis)), {"512 ids", "vocabulary of 300"});
  fs::create_directories(dir.path / "hf");
  std::ofstream(dir.path / "hf" / "config.json") << R"({"vocab_size": 288})";
  fs::copy_file(kSpm / "tokenizer.model", dir.path / "hf" / "tokenizer.model");
  expect_failure(tokenize("--model " + q(dir.path / "hf") + out + q(kGenesis)), {"vocabulary of 288", "config.json"});
  // A tokenizer.json-only model (LLaMA 3) is not supported, and says so.
  fs::remove(dir.path / "hf" / "tokenizer.model");
  std::ofstream(dir.path / "hf" / "tokenizer.json") << "{}";
  expect_failure(tokenize("--model " + q(dir.path / "hf") + out + q(kGenesis)),
                 {"tokenizer.json", "not supported", "SentencePiece", "tools/tokenize_hf.py"});
  expect_failure(tokenize("--model " + q(dir.path / "nowhere") + out + q(kGenesis)), {"nowhere", "does not exist"});
  // One file as one document cannot be split into training and validation.
  expect_failure(tokenize("--model " + q(kSpm) + out + q(kGenesis)), {"validation would be empty", "--split"});
  for (const auto& p : fs::directory_iterator(dir.path / "out")) ADD_FAILURE() << "left behind: " << p.path();

  // Existing shards are refused without --force; --force replaces the whole set (the stale third shard goes too).
  ASSERT_EQ(tokenize(model + out + "--shard-tokens 1000 " + q(kGenesis)).rc, 0);
  ASSERT_TRUE(fs::exists(dir.path / "out" / "train_000002.bin"));
  expect_failure(tokenize(model + out + q(kGenesis)), {"already holds token shards", "train_000000.bin", "--force"});
  EXPECT_EQ(io::TokenShard::open(dir.path / "out" / "train_000000.bin").size(), 1000u) << "untouched";
  const ToolRun forced = tokenize(model + out + "--force " + q(kGenesis));
  ASSERT_EQ(forced.rc, 0) << forced.output;
  EXPECT_EQ(io::token_shard_files(dir.path / "out", "train").size(), 1u);
  EXPECT_FALSE(fs::exists(dir.path / "out" / "train_000002.bin"));
  EXPECT_FALSE(fs::exists(dir.path / "out" / ".squeeze-tokenize.tmp"));
}

}  // namespace
