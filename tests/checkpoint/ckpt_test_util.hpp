#pragma once
// Shared helpers of the checkpoint tests: scratch roots and small deterministic checkpoints.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <squeeze/io/checkpoint_store.hpp>

namespace ckpt_test {
namespace fs = std::filesystem;
using namespace squeeze;
using namespace squeeze::io;

// A fresh directory, removed at the end of the test.
struct TempRoot {
  fs::path path;
  explicit TempRoot(const std::string& name) {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() / ("squeeze_ckpt_" + name + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    squeeze::io::remove_tree(path);
    fs::create_directories(path);
  }
  ~TempRoot() { squeeze::io::try_remove_tree(path); }
  fs::path operator/(const std::string& s) const { return path / s; }
};

// Rank r's tensors at `step`: "w" F32 [5 + r] and "ids" I64 [3], values depending on (step, rank).
inline std::vector<float> weights(std::int64_t step, int rank) {
  std::vector<float> w(std::size_t(5 + rank));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = float(step) * 100.f + float(rank) * 10.f + float(i) * 0.25f;
  return w;
}
inline std::vector<std::int64_t> ids(std::int64_t step, int rank) { return {step, rank, step * 7 + rank}; }

inline CheckpointMeta meta(int world, std::int64_t step) {
  CheckpointMeta m;
  m.world_size = world;
  m.stage = 2;
  m.strategy = "zero2-bf16";
  m.partitions = nlohmann::json::array({{{"key", "p0"}}});
  m.record = {{"data_position", step * 64}, {"note", "test"}};
  return m;
}

inline void write_rank(CheckpointSave& save, std::int64_t step, int rank) {
  const auto w = weights(step, rank);
  const auto i = ids(step, rank);
  save.write_rank(rank, {tensor_view("w", DType::F32, {std::int64_t(w.size())}, w), tensor_view("ids", DType::I64, {3}, i)});
}

inline fs::path save(const CheckpointStore& store, std::int64_t step, int world) {
  CheckpointSave s = store.begin(step, meta(world, step));
  for (int r = 0; r < world; ++r) write_rank(s, step, r);
  return s.commit();
}

// Every rank's tensors and the record are those of `step`.
inline void expect_checkpoint(const CheckpointReader& r, std::int64_t step, int world) {
  EXPECT_EQ(r.step(), step);
  ASSERT_EQ(r.world_size(), world);
  EXPECT_EQ(r.index().record["data_position"], step * 64);
  for (int k = 0; k < world; ++k) {
    EXPECT_EQ(r.read_rank_as<float>(k, "w", DType::F32), weights(step, k));
    EXPECT_EQ(r.read_rank_as<std::int64_t>(k, "ids", DType::I64), ids(step, k));
  }
}

// The message of the squeeze::Error `f` throws (fails the test when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const squeeze::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a squeeze::Error";
  return {};
}
#define EXPECT_HAS(msg, needle) EXPECT_NE(std::string(msg).find(needle), std::string::npos) << "message: " << (msg)

// Names in the root that are temporaries of an interrupted save.
inline std::vector<std::string> leftovers(const fs::path& root) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    if (n.find(".tmp") != std::string::npos || n.find(".old-") != std::string::npos) out.push_back(n);
  }
  return out;
}

inline void flip_byte(const fs::path& p, std::uint64_t offset) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(offset));
  char c = 0;
  f.read(&c, 1);
  c = char(c ^ 0x20);
  f.seekp(std::streamoff(offset));
  f.write(&c, 1);
}

}  // namespace ckpt_test
