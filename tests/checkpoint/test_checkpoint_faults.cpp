// Saves interrupted at every durable step, by an exception (unwinding) and by SIGKILL in a child process
// (no unwinding, temporaries left behind): the previous checkpoint stays whole, `latest` names a whole
// checkpoint, every directory under a final name verifies, and the next save cleans up and succeeds.
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>

#include "ckpt_test_util.hpp"

using namespace ckpt_test;

namespace {

constexpr int kWorld = 2;

// Steps 1 and 2 saved whole; the interrupted save is step 3, which would prune step 1 (keep 2).
void prepare(const fs::path& root) {
  CheckpointStore store(root, {.keep_last = 2});
  save(store, 1, kWorld);
  save(store, 2, kWorld);
}

std::vector<std::string> save_points() {
  TempRoot root("points");
  prepare(root.path);
  std::vector<std::string> points;
  CheckpointStore store(root.path, {.keep_last = 2, .fault_hook = [&](std::string_view p) { points.emplace_back(p); }});
  save(store, 3, kWorld);
  return points;
}

std::ptrdiff_t position(const std::vector<std::string>& v, const std::string& s) {
  const auto it = std::find(v.begin(), v.end(), s);
  EXPECT_NE(it, v.end()) << s;
  return it - v.begin();
}

// The store after an interrupted save of step 3 at point i.
void expect_consistent(const fs::path& root, bool latest_moved, const std::string& point) {
  SCOPED_TRACE("interrupted after " + point);
  CheckpointStore store(root, {.keep_last = 2});
  const auto latest = store.latest_step();
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(*latest, latest_moved ? 3 : 2);
  expect_checkpoint(store.open_latest({.world_size = kWorld}), *latest, kWorld);
  const auto steps = store.steps();
  EXPECT_TRUE(std::find(steps.begin(), steps.end(), 2) != steps.end()) << "the previous checkpoint is gone";
  for (std::int64_t st : steps) expect_checkpoint(store.open(st), st, kWorld);  // no half directory under a final name
  // The next save removes every leftover and prunes as usual.
  save(store, 4, kWorld);
  EXPECT_TRUE(leftovers(root).empty()) << leftovers(root).front();
  EXPECT_EQ(store.latest_step(), 4);
  EXPECT_EQ(store.steps().size(), 2u);
  expect_checkpoint(store.open_latest(), 4, kWorld);
}

TEST(CheckpointFaults, SavePointsInOrder) {
  const auto p = save_points();
  EXPECT_GE(p.size(), 20u);
  const std::vector<std::string> order = {"leftovers:removed",
                                          "staging:created",
                                          "rank-00000-of-00002.safetensors:written",
                                          "rank-00000-of-00002.safetensors:fsynced",
                                          "rank-00000-of-00002.safetensors:renamed",
                                          "rank-00000-of-00002.json:renamed",
                                          "rank-00001-of-00002.safetensors:renamed",
                                          "rank-00001-of-00002.json:renamed",
                                          "index.json:written",
                                          "index.json:fsynced",
                                          "index.json:renamed",
                                          "staging:fsynced",
                                          "step-000003:renamed",
                                          "root:fsynced",
                                          "latest:written",
                                          "latest:fsynced",
                                          "latest:renamed",
                                          "root:fsynced-latest",
                                          "step-000001:pruned",
                                          "root:fsynced-prune"};
  std::ptrdiff_t last = -1;
  for (const auto& s : order) {
    const auto at = position(p, s);
    EXPECT_GT(at, last) << s;
    last = at;
  }
  EXPECT_TRUE(p.back().ends_with(":removed")) << p.back();
}

struct InjectedFault {
  std::string point;
};

TEST(CheckpointFaults, ExceptionAtEveryPoint) {
  const auto points = save_points();
  const auto moved_at = position(points, "latest:renamed");
  for (std::size_t i = 0; i < points.size(); ++i) {
    TempRoot root("throw");
    prepare(root.path);
    std::size_t calls = 0;
    CheckpointStore store(root.path, {.keep_last = 2, .fault_hook = [&](std::string_view p) {
                                        if (calls++ == i) throw InjectedFault{std::string(p)};
                                      }});
    try {
      save(store, 3, kWorld);
      ADD_FAILURE() << "no fault at point " << i;
    } catch (const InjectedFault& f) {
      EXPECT_EQ(f.point, points[i]);
    }
    expect_consistent(root.path, std::ptrdiff_t(i) >= moved_at, points[i]);
  }
}

// The child saves step 3 and kills itself with SIGKILL at point i (or inside a tensor's stream).
void run_killed_child(const fs::path& root, std::size_t kill_at, bool mid_tensor) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    try {
      std::size_t calls = 0;
      CheckpointStore store(root, {.keep_last = 2, .chunk_bytes = 64, .fault_hook = [&](std::string_view) {
                                     if (!mid_tensor && calls++ == kill_at) ::raise(SIGKILL);
                                   }});
      CheckpointSave s = store.begin(3, meta(kWorld, 3));
      for (int r = 0; r < kWorld; ++r) {
        const auto w = weights(3, r);
        const auto i = ids(3, r);
        std::vector<float> big(256, float(r));
        std::size_t chunks = 0;
        TensorView streamed("big", DType::F32, {256}, [&](std::uint64_t off, std::span<std::byte> out) {
          if (mid_tensor && r == int(kill_at) && chunks++ == 3) ::raise(SIGKILL);
          std::memcpy(out.data(), reinterpret_cast<const std::byte*>(big.data()) + off, out.size());
        });
        s.write_rank(r, {tensor_view("w", DType::F32, {std::int64_t(w.size())}, w), tensor_view("ids", DType::I64, {3}, i), streamed});
      }
      s.commit();
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);
  }
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(st)) << "the child was not killed (exit status " << (WIFEXITED(st) ? WEXITSTATUS(st) : -1) << ")";
  EXPECT_EQ(WTERMSIG(st), SIGKILL);
}

TEST(CheckpointFaults, SigkillAtEveryPoint) {
  const auto points = save_points();
  const auto moved_at = position(points, "latest:renamed");
  for (std::size_t i = 0; i < points.size(); ++i) {
    TempRoot root("kill");
    prepare(root.path);
    run_killed_child(root.path, i, false);
    expect_consistent(root.path, std::ptrdiff_t(i) >= moved_at, points[i]);
  }
}

TEST(CheckpointFaults, SigkillWhileStreamingATensor) {
  for (std::size_t rank = 0; rank < std::size_t(kWorld); ++rank) {
    TempRoot root("killstream");
    prepare(root.path);
    run_killed_child(root.path, rank, true);
    EXPECT_FALSE(leftovers(root.path).empty());  // the staging directory with a partial .tmp file
    expect_consistent(root.path, false, "chunk 3 of rank " + std::to_string(rank) + "'s streamed tensor");
  }
}

}  // namespace
