// CheckpointStore: round trips (threads, processes, streamed sources), keep-last-K, replacing and
// leftovers, and every way a checkpoint on disk can be wrong.
#include <sys/wait.h>

#include <cstring>
#include <iterator>
#include <thread>

#include "ckpt_test_util.hpp"

using namespace ckpt_test;

namespace {

TEST(CheckpointStore, RoundTripWithIndex) {
  TempRoot root("roundtrip");
  CheckpointStore store(root.path);
  EXPECT_FALSE(store.latest_step().has_value());
  const fs::path dir = save(store, 123, 3);
  EXPECT_EQ(dir, root / "step-000123");
  EXPECT_TRUE(fs::exists(root / "step-000123" / "rank-00002-of-00003.safetensors"));
  EXPECT_EQ(store.latest_step(), 123);
  EXPECT_EQ(store.steps(), std::vector<std::int64_t>{123});

  const CheckpointReader r = store.open_latest({.world_size = 3, .strategy = "zero2-bf16", .stage = 2});
  expect_checkpoint(r, 123, 3);
  const CheckpointIndex& idx = r.index();
  EXPECT_EQ(idx.format_version, kCheckpointFormatVersion);
  EXPECT_EQ(idx.stage, 2);
  EXPECT_EQ(idx.strategy, "zero2-bf16");
  EXPECT_EQ(idx.partitions, meta(3, 123).partitions);
  ASSERT_EQ(idx.files.size(), 3u);
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(idx.files[k].bytes, fs::file_size(r.rank_path(k)));
    EXPECT_EQ(idx.files[k].sha256, sha256_file(r.rank_path(k)));
    EXPECT_EQ(idx.files[k].tensors.at("w").shape, std::vector<std::int64_t>{5 + k});
  }
  // The rank files are plain safetensors: the strict in-memory reader accepts them too.
  const auto sf = SafetensorsFile::open(r.rank_path(1));
  EXPECT_EQ(sf.read<float>("w", DType::F32), weights(123, 1));
  EXPECT_EQ(sf.metadata().at("rank"), "1");
  // Nothing but the checkpoint and `latest` is left in the root; nothing but the files in the step.
  EXPECT_TRUE(leftovers(root.path).empty());
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"index.json", "rank-00000-of-00003.safetensors", "rank-00001-of-00003.safetensors",
                                          "rank-00002-of-00003.safetensors"}));
  EXPECT_EQ(detail::read_text_file(root / "latest"), "step-000123\n");
}

TEST(CheckpointStore, ExpectTensorNamesFileAndFault) {
  TempRoot root("expect");
  CheckpointStore store(root.path);
  save(store, 1, 2);
  const CheckpointReader r = store.open_latest();
  EXPECT_EQ(r.expect_tensor(1, "w", DType::F32, {6}).end - r.expect_tensor(1, "w", DType::F32, {6}).begin, 24u);
  auto e = error_of([&] { r.expect_tensor(1, "w", DType::BF16, {6}); });
  EXPECT_HAS(e, "rank-00001-of-00002.safetensors");
  EXPECT_HAS(e, "is F32 [6], expected BF16 [6]");
  e = error_of([&] { r.expect_tensor(0, "w", DType::F32, {6}); });
  EXPECT_HAS(e, "is F32 [5], expected F32 [6]");
  e = error_of([&] { r.read_rank(0, "layers.0.m"); });
  EXPECT_HAS(e, "rank-00000-of-00002.safetensors");
  EXPECT_HAS(e, "tensor 'layers.0.m' is missing");
  e = error_of([&] { r.read_rank(2, "w"); });
  EXPECT_HAS(e, "rank 2 is outside its world of 2");
  std::vector<std::byte> small(3);
  e = error_of([&] { r.read_rank_into(0, "w", small); });
  EXPECT_HAS(e, "has 20 bytes; the destination has 3");
  std::vector<float> part(2);
  r.read_rank_range(0, "w", 8, std::as_writable_bytes(std::span(part)));
  EXPECT_EQ(part, (std::vector<float>{weights(1, 0)[2], weights(1, 0)[3]}));
}

TEST(CheckpointStore, RanksWriteFromThreads) {
  TempRoot root("threads");
  CheckpointStore store(root.path);
  CheckpointSave s = store.begin(7, meta(4, 7));
  std::vector<std::thread> ts;
  for (int r = 0; r < 4; ++r) ts.emplace_back([&, r] { write_rank(s, 7, r); });
  for (auto& t : ts) t.join();
  s.commit();
  const CheckpointReader rd = store.open_latest({.world_size = 4});
  expect_checkpoint(rd, 7, 4);
  // Each thread reads (and verifies on first use) its own rank.
  const CheckpointReader lazy = store.open_latest({.verify = Verify::checksums_on_use});
  std::vector<std::thread> readers;
  std::atomic<int> ok{0};
  for (int r = 0; r < 4; ++r) readers.emplace_back([&, r] { ok += lazy.read_rank_as<float>(r, "w", DType::F32) == weights(7, r); });
  for (auto& t : readers) t.join();
  EXPECT_EQ(ok.load(), 4);
}

// One process per rank: the coordinator begins, hands its token to the others, they join and write,
// the caller's barrier (here: waitpid), then the coordinator commits.
TEST(CheckpointStore, RanksWriteFromProcesses) {
  TempRoot root("procs");
  CheckpointStore store(root.path);
  CheckpointSave s = store.begin(9, meta(3, 9));
  const std::string token = s.token();
  std::vector<pid_t> kids;
  for (int r = 1; r < 3; ++r) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int code = 0;
      try {
        CheckpointSave mine = CheckpointStore(root.path).join(9, token, 3);
        write_rank(mine, 9, r);
        try {
          mine.commit();
          code = 2;  // a participant must not be able to commit
        } catch (const squeeze::Error&) {}
      } catch (...) {
        code = 1;
      }
      ::_exit(code);
    }
    kids.push_back(pid);
  }
  write_rank(s, 9, 0);
  for (pid_t k : kids) {
    int st = 0;
    ASSERT_EQ(::waitpid(k, &st, 0), k);
    ASSERT_TRUE(WIFEXITED(st));
    EXPECT_EQ(WEXITSTATUS(st), 0);
  }
  s.commit();
  expect_checkpoint(store.open_latest({.world_size = 3}), 9, 3);
  EXPECT_HAS(error_of([&] { store.join(9, "no-such-token", 3); }), "no save of step 9 with token no-such-token");
  EXPECT_HAS(error_of([&] { store.join(9, "../x", 3); }), "is not a save token");
}

TEST(CheckpointStore, CommitRefusesIncompleteSaves) {
  TempRoot root("incomplete");
  CheckpointStore store(root.path);
  save(store, 1, 2);
  CheckpointSave s = store.begin(2, meta(3, 2));
  write_rank(s, 2, 1);
  auto e = error_of([&] { s.commit(); });
  EXPECT_HAS(e, "rank(s) 0, 2 have not written their files");
  EXPECT_HAS(error_of([&] { write_rank(s, 2, 1); }), "rank 1 is written twice");
  EXPECT_HAS(error_of([&] { write_rank(s, 2, 3); }), "rank 3 is outside the world of 3");
  write_rank(s, 2, 0);
  write_rank(s, 2, 2);
  EXPECT_EQ(store.latest_step(), 1);  // nothing moved before commit
  s.commit();
  EXPECT_EQ(store.latest_step(), 2);
  EXPECT_HAS(error_of([&] { s.commit(); }), "already committed");
  CheckpointSave dropped = store.begin(3, meta(1, 3));
  write_rank(dropped, 3, 0);
  dropped.abandon();
  EXPECT_TRUE(leftovers(root.path).empty());
  EXPECT_HAS(error_of([&] { dropped.commit(); }), "already committed or abandoned");
  EXPECT_EQ(store.latest_step(), 2);
  EXPECT_HAS(error_of([&] { store.begin(3, CheckpointMeta{}); }), "must name the Strategy");
}

TEST(CheckpointStore, StreamedSourcesInSmallChunks) {
  TempRoot root("stream");
  CheckpointStore store(root.path, {.chunk_bytes = 64});
  // A producer that hands out a 1000-element tensor in chunks, as a device-to-host staging copy would.
  std::vector<std::uint16_t> big(1000);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = std::uint16_t(i * 31 + 7);
  std::vector<std::uint64_t> asked;
  TensorView streamed("big", DType::BF16, {10, 100}, [&](std::uint64_t off, std::span<std::byte> out) {
    asked.push_back(off);
    std::memcpy(out.data(), reinterpret_cast<const std::byte*>(big.data()) + off, out.size());
  });
  std::vector<float> empty;
  CheckpointSave s = store.begin(1, meta(1, 1));
  const WrittenFile wf = s.write_rank(0, {streamed, tensor_view("empty", DType::F32, {0, 4}, empty)});
  s.commit();
  EXPECT_EQ(asked.size(), (2000u + 63) / 64);
  EXPECT_EQ(wf.sha256, sha256_file(store.step_dir(1) / "rank-00000-of-00001.safetensors"));
  const CheckpointReader r = store.open_latest();
  EXPECT_EQ(r.read_rank_as<std::uint16_t>(0, "big", DType::BF16), big);
  EXPECT_EQ(r.expect_tensor(0, "empty", DType::F32, {0, 4}).begin, r.expect_tensor(0, "empty", DType::F32, {0, 4}).end);
}

// Writing, hashing and producing overlap chunk by chunk; the digest must still see the bytes in file order.
TEST(CheckpointStore, PipelinedDigestsAreTheFileOrderDigests) {
  TempRoot root("digest");
  const auto abc = root.path / "abc";
  { std::ofstream(abc, std::ios::binary) << "abc"; }
  for (std::size_t chunk : {1, 2, 3, 4096})  // FIPS 180-2's "abc" vector, read one byte to the whole file at a time
    EXPECT_EQ(sha256_file(abc, chunk), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad") << chunk;

  std::vector<std::uint8_t> a(1237), b(515);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = std::uint8_t(i * 7 + 1);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = std::uint8_t(i * 13 + 5);
  TensorView filled("b", DType::U8, {515},
                    [&](std::uint64_t off, std::span<std::byte> out) { std::memcpy(out.data(), b.data() + off, out.size()); });
  const auto path = root.path / "two.safetensors";
  const WrittenFile wf =
      write_safetensors_durably(path, std::vector<TensorView>{tensor_view("a", DType::U8, {1237}, a), filled}, {}, {.chunk_bytes = 24});
  std::ifstream in(path, std::ios::binary);
  const std::string whole((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(wf.bytes, whole.size());
  EXPECT_EQ(wf.sha256, sha256_hex(std::as_bytes(std::span(whole.data(), whole.size()))));
  EXPECT_EQ(sha256_file(path, 40), wf.sha256);
  EXPECT_EQ(whole.substr(whole.size() - 515), std::string(reinterpret_cast<const char*>(b.data()), 515));
}

// A source failing in the middle of the stream leaves neither the file nor its temporary.
TEST(CheckpointStore, FailingSourceLeavesNothing) {
  TempRoot root("failing");
  std::vector<std::uint8_t> a(300, 1);
  TensorView failing("f", DType::U8, {300}, [](std::uint64_t off, std::span<std::byte> out) {
    if (off >= 64) throw Error("device copy failed");
    std::memset(out.data(), 2, out.size());
  });
  const auto path = root.path / "f.safetensors";
  EXPECT_THROW(
      write_safetensors_durably(path, std::vector<TensorView>{tensor_view("a", DType::U8, {300}, a), failing}, {}, {.chunk_bytes = 32}),
      Error);
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path.string() + ".tmp"));
}

TEST(CheckpointStore, KeepLastK) {
  TempRoot root("keep");
  CheckpointStore store(root.path, {.keep_last = 3});
  for (int step = 1; step <= 5; ++step) save(store, step * 10, 2);
  EXPECT_EQ(store.steps(), (std::vector<std::int64_t>{30, 40, 50}));
  EXPECT_EQ(store.latest_step(), 50);
  for (auto st : store.steps()) expect_checkpoint(store.open(st), st, 2);
  EXPECT_TRUE(leftovers(root.path).empty());

  TempRoot all("keepall");
  CheckpointStore every(all.path);
  for (int step = 1; step <= 4; ++step) save(every, step, 1);
  EXPECT_EQ(every.steps().size(), 4u);

  TempRoot one("keepone");
  CheckpointStore last_only(one.path, {.keep_last = 1});
  for (int step = 1; step <= 3; ++step) save(last_only, step, 2);
  EXPECT_EQ(last_only.steps(), std::vector<std::int64_t>{3});
  expect_checkpoint(last_only.open_latest(), 3, 2);
}

// Going back to an older checkpoint and saving from there: `latest` follows the new save, pruning
// counts only steps at or below it and never touches newer directories.
TEST(CheckpointStore, SavingAnOlderStepKeepsNewerDirectories) {
  TempRoot root("rewind");
  CheckpointStore store(root.path, {.keep_last = 2});
  for (int step = 1; step <= 4; ++step) save(store, step, 1);
  EXPECT_EQ(store.steps(), (std::vector<std::int64_t>{3, 4}));
  save(store, 2, 1);
  EXPECT_EQ(store.latest_step(), 2);
  EXPECT_EQ(store.steps(), (std::vector<std::int64_t>{2, 3, 4}));
  // Saving step 3 again replaces the directory of the abandoned line.
  CheckpointSave s = store.begin(3, meta(1, 3));
  const std::vector<float> w = {42.f};
  s.write_rank(0, {tensor_view("w", DType::F32, {1}, w)});
  s.commit();
  EXPECT_EQ(store.latest_step(), 3);
  EXPECT_EQ(store.open(3).read_rank_as<float>(0, "w", DType::F32), w);
  EXPECT_EQ(store.steps(), (std::vector<std::int64_t>{2, 3, 4}));
  EXPECT_TRUE(leftovers(root.path).empty());
}

// Saving the step `latest` already names swaps the directories atomically.
TEST(CheckpointStore, ResavingTheLatestStep) {
  TempRoot root("resave");
  CheckpointStore store(root.path, {.keep_last = 2});
  save(store, 5, 2);
  CheckpointMeta m = meta(2, 5);
  m.record = {{"data_position", 5 * 64}, {"again", true}};
  CheckpointSave s = store.begin(5, m);
  for (int r = 0; r < 2; ++r) write_rank(s, 5, r);
  s.commit();
  const CheckpointReader rd = store.open_latest();
  expect_checkpoint(rd, 5, 2);
  EXPECT_EQ(rd.index().record["again"], true);
  EXPECT_EQ(store.steps(), std::vector<std::int64_t>{5});
  EXPECT_TRUE(leftovers(root.path).empty());
}

TEST(CheckpointStore, LeftoversAreIgnoredThenRemoved) {
  TempRoot root("leftovers");
  CheckpointStore store(root.path);
  save(store, 1, 1);
  fs::create_directories(root / "step-000002.tmp-999-deadbeef");
  std::ofstream(root / "step-000002.tmp-999-deadbeef" / "rank-00000-of-00001.safetensors") << "partial";
  fs::create_directories(root / "step-000001.old-999-deadbeef");
  std::ofstream(root / "latest.tmp-999-deadbeef") << "step-000002\n";
  EXPECT_EQ(store.steps(), std::vector<std::int64_t>{1});
  expect_checkpoint(store.open_latest(), 1, 1);
  EXPECT_EQ(leftovers(root.path).size(), 3u);
  save(store, 2, 1);
  EXPECT_TRUE(leftovers(root.path).empty());
  expect_checkpoint(store.open_latest(), 2, 1);
}

// ---- what is wrong on disk --------------------------------------------------------------------------

TEST(CheckpointVerify, FlippedByteIsAChecksumError) {
  TempRoot root("flip");
  CheckpointStore store(root.path);
  save(store, 4, 2);
  const fs::path f = store.step_dir(4) / "rank-00001-of-00002.safetensors";
  flip_byte(f, fs::file_size(f) - 3);  // inside the data
  auto e = error_of([&] { store.open_latest(); });
  EXPECT_HAS(e, f.string());
  EXPECT_HAS(e, "checksum mismatch");
  // Checked on first use: rank 0 reads fine, rank 1 fails when read.
  const CheckpointReader lazy = store.open_latest({.verify = Verify::checksums_on_use});
  EXPECT_EQ(lazy.read_rank_as<float>(0, "w", DType::F32), weights(4, 0));
  EXPECT_HAS(error_of([&] { lazy.read_rank(1, "w"); }), "checksum mismatch");
  EXPECT_HAS(error_of([&] { lazy.verify_checksum(1); }), "rank-00001-of-00002.safetensors");
  // A flipped header byte is caught by the checksum before the header is parsed.
  flip_byte(f, fs::file_size(f) - 3);
  expect_checkpoint(store.open_latest(), 4, 2);
  flip_byte(f, 12);
  EXPECT_HAS(error_of([&] { store.open_latest(); }), "checksum mismatch");
}

TEST(CheckpointVerify, TruncatedFileIsASizeError) {
  TempRoot root("trunc");
  CheckpointStore store(root.path);
  save(store, 4, 2);
  const fs::path f = store.step_dir(4) / "rank-00000-of-00002.safetensors";
  const auto size = fs::file_size(f);
  fs::resize_file(f, size - 5);
  for (Verify v : {Verify::sizes, Verify::checksums_on_use, Verify::checksums}) {
    auto e = error_of([&] { store.open_latest({.verify = v}); });
    EXPECT_HAS(e, f.string());
    EXPECT_HAS(e, "size mismatch: index.json records " + std::to_string(size) + " bytes, the file has " + std::to_string(size - 5) +
                      " (truncated)");
  }
}

// A truncated file whose index was rewritten to match it (sizes and checksums agree): the header
// validation still names the file and the fault.
TEST(CheckpointVerify, TruncatedHeaderWithAMatchingIndex) {
  TempRoot root("trunchdr");
  CheckpointStore store(root.path);
  save(store, 4, 2);
  const fs::path dir = store.step_dir(4);
  const fs::path f = dir / "rank-00001-of-00002.safetensors";
  auto rewrite_index = [&] {
    auto j = detail::read_json_file(dir / "index.json");
    j["files"][1]["bytes"] = fs::file_size(f);
    j["files"][1]["sha256"] = sha256_file(f);
    std::ofstream(dir / "index.json") << j.dump();
  };
  fs::resize_file(f, 30);  // inside the JSON header
  rewrite_index();
  auto e = error_of([&] { store.open_latest(); });
  EXPECT_HAS(e, f.string());
  EXPECT_HAS(e, "truncated header");
  fs::resize_file(f, 5);
  rewrite_index();
  e = error_of([&] { store.open_latest(); });
  EXPECT_HAS(e, "truncated header: the file has 5 bytes");
}

TEST(CheckpointVerify, MissingRankFile) {
  TempRoot root("missing");
  CheckpointStore store(root.path);
  save(store, 4, 3);
  const fs::path f = store.step_dir(4) / "rank-00002-of-00003.safetensors";
  fs::remove(f);
  auto e = error_of([&] { store.open_latest({.verify = Verify::sizes}); });
  EXPECT_HAS(e, f.string());
  EXPECT_HAS(e, "missing (index.json lists it");
}

TEST(CheckpointVerify, WrongWorldStrategyOrStage) {
  TempRoot root("world");
  CheckpointStore store(root.path);
  save(store, 4, 2);
  auto e = error_of([&] { store.open_latest({.world_size = 3}); });
  EXPECT_HAS(e, "was written by 2 ranks; this run has 3");
  EXPECT_HAS(e, "step-000004");
  expect_checkpoint(store.open_latest({.world_size = 3, .allow_reshard = true}), 4, 2);
  e = error_of([&] { store.open_latest({.strategy = "zero3-offload-bf16"}); });
  EXPECT_HAS(e, "was written by strategy 'zero2-bf16'; this run's strategy is 'zero3-offload-bf16'");
  e = error_of([&] { store.open_latest({.stage = 3}); });
  EXPECT_HAS(e, "written at ZeRO stage 2; this run is stage 3");
}

TEST(CheckpointVerify, IndexProblems) {
  TempRoot root("index");
  CheckpointStore store(root.path);
  save(store, 4, 2);
  const fs::path ip = store.step_dir(4) / "index.json";
  const auto good = detail::read_json_file(ip);
  auto with = [&](auto edit) {
    auto j = good;
    edit(j);
    std::ofstream(ip) << j.dump();
    return error_of([&] { store.open_latest(); });
  };
  EXPECT_HAS(with([](auto& j) { j["format_version"] = 99; }), "format_version 99 is newer than this library reads (1)");
  EXPECT_HAS(with([](auto& j) { j["format"] = "other"; }), "format is 'other'");
  EXPECT_HAS(with([](auto& j) { j["world_size"] = 3; }), "lists 2 files for world size 3");
  EXPECT_HAS(with([](auto& j) { j["step"] = 5; }), "records step 5 but sits in step-000004");
  EXPECT_HAS(with([](auto& j) { j["files"][0]["file"] = "../../etc/passwd"; }), "expected 'rank-00000-of-00002.safetensors'");
  EXPECT_HAS(with([](auto& j) { j["files"][1]["sha256"] = "xyz"; }), "'sha256' must be 64 lowercase hex digits");
  EXPECT_HAS(with([](auto& j) { j.erase("strategy"); }), "'strategy' is missing");
  EXPECT_HAS(with([](auto& j) { j["files"][1]["tensors"]["w"]["shape"] = {7}; }), "index/shard mismatch: tensor 'w' differs");
  EXPECT_HAS(with([](auto& j) { j["files"][1]["tensors"].erase("ids"); }), "tensor 'ids' is in the file but not in index.json");
  std::ofstream(ip) << "{\"format\": ";
  EXPECT_HAS(error_of([&] { store.open_latest(); }), "index.json: not valid JSON");
  fs::remove(ip);
  EXPECT_HAS(error_of([&] { store.open_latest(); }), "index.json is missing");
}

// Rank files swapped between ranks, with an index rewritten to match their sizes and hashes.
TEST(CheckpointVerify, RankFileOfAnotherRank) {
  TempRoot root("swap");
  CheckpointStore store(root.path);
  save(store, 4, 2);
  const fs::path dir = store.step_dir(4);
  auto j = detail::read_json_file(dir / "index.json");
  fs::rename(dir / "rank-00000-of-00002.safetensors", dir / "x");
  fs::rename(dir / "rank-00001-of-00002.safetensors", dir / "rank-00000-of-00002.safetensors");
  fs::rename(dir / "x", dir / "rank-00001-of-00002.safetensors");
  std::swap(j["files"][0]["bytes"], j["files"][1]["bytes"]);
  std::swap(j["files"][0]["sha256"], j["files"][1]["sha256"]);
  std::ofstream(dir / "index.json") << j.dump();
  auto e = error_of([&] { store.open_latest(); });
  EXPECT_HAS(e, "rank-00000-of-00002.safetensors: index/shard mismatch: the file says rank 1 of 2 at step 4");
}

TEST(CheckpointVerify, LatestPointerProblems) {
  TempRoot root("latest");
  CheckpointStore store(root.path);
  EXPECT_HAS(error_of([&] { store.open_latest(); }), "no checkpoint to resume from ('latest' is missing)");
  save(store, 1, 1);
  save(store, 2, 1);
  std::ofstream(root / "latest") << "step-000999\n";
  auto e = error_of([&] { store.open_latest(); });
  EXPECT_HAS(e, "'latest' names step-000999, which does not exist");
  EXPECT_HAS(e, "step-000001, step-000002");
  std::ofstream(root / "latest") << "../elsewhere\n";
  EXPECT_HAS(error_of([&] { store.open_latest(); }), "not a step directory name");
  EXPECT_HAS(error_of([&] { store.open(77); }), "step-000077 does not exist");
}

TEST(SafetensorsReader, StrictAboutTheDataSection) {
  TempRoot root("strict");
  auto write_raw = [&](const std::string& name, const std::string& header, std::size_t data) {
    std::string b(8, '\0');
    for (int i = 0; i < 8; ++i) b[i] = char((header.size() >> (8 * i)) & 0xff);
    b += header;
    b.append(data, '\x01');
    std::ofstream(root / name, std::ios::binary) << b;
    return root / name;
  };
  const std::string t = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})";
  EXPECT_EQ(SafetensorsReader::open(write_raw("ok", t, 4)).read_bytes("a").size(), 4u);
  EXPECT_HAS(error_of([&] { SafetensorsReader::open(write_raw("trailing", t, 6)); }), "cover 4 bytes of a 6-byte data section");
  EXPECT_HAS(error_of([&] { SafetensorsReader::open(write_raw("short", t, 3)); }), "past the data section");
  EXPECT_HAS(error_of([&] { SafetensorsReader::open(write_raw("gap", R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})", 4)); }),
             "not contiguous");
  EXPECT_HAS(error_of([&] { SafetensorsReader::open(write_raw("space", " " + t, 4)); }), "does not start with '{'");
  EXPECT_HAS(error_of([&] { SafetensorsReader::open(write_raw("dtype", R"({"a":{"dtype":"Q4","shape":[4],"data_offsets":[0,4]}})", 4)); }),
             "unknown dtype 'Q4'");
  EXPECT_HAS(error_of([&] { SafetensorsReader::open(write_raw("count", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4)); }),
             "holds 4 bytes but dtype F32");
}

// remove_tree, which the store prunes and cleans up with (in place of std::filesystem::remove_all; posix_file.hpp says why).
TEST(RemoveTree, RemovesEverythingBelowAndFollowsNoLink) {
  TempRoot root("remove_tree");
  const fs::path outside = root / "outside.txt", tree = root / "tree";
  std::ofstream(outside) << "kept";
  fs::create_directories(tree / "a" / "b");
  std::ofstream(tree / "top.bin") << "x";
  std::ofstream(tree / "a" / "b" / "deep.bin") << "y";
  fs::create_symlink(outside, tree / "a" / "link");
  fs::create_directory_symlink(root.path, tree / "dirlink");
  EXPECT_EQ(remove_tree(tree), 7u);  // 2 files, 2 links, a, a/b and tree itself
  EXPECT_FALSE(fs::exists(tree));
  EXPECT_TRUE(fs::exists(outside)) << "a link's target is never removed";
  EXPECT_EQ(remove_tree(tree), 0u) << "a missing path is nothing to remove";
  EXPECT_EQ(remove_tree(outside), 1u) << "a plain file is removed too";
}

TEST(RemoveTree, ErrorNamesThePath) {
  TempRoot root("remove_tree_error");
  std::ofstream(root / "file") << "x";
  try {
    remove_tree(root / "file" / "child");  // a path through a file: ENOTDIR
    FAIL() << "expected an error";
  } catch (const squeeze::Error& e) {
    EXPECT_NE(std::string(e.what()).find("file/child"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(try_remove_tree(root / "file" / "child"));
  EXPECT_TRUE(fs::exists(root / "file"));
}

}  // namespace
