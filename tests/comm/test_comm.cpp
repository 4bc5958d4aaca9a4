// LocalComm collectives against a float64 reference, on 1..4 ranks (threads), float/half/bf16, sizes
// that do not divide by the world size; failure modes; the TCP store on loopback.
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <thread>
#include <optional>
#include <cmath>
#include <random>
#include <squeeze/comm.hpp>

using namespace squeeze;
using namespace squeeze::comm;

namespace {

template <class T>
T cast(double x) {
  return from_float<T>(float(x));
}
template <>
double cast<double>(double x) {
  return x;
}
template <class T>
double val(T x) {
  return double(to_float(x));
}

// Rank r's random input: normal values, never zeros by construction of the test (seeded per rank).
template <class T>
std::vector<T> random_input(std::size_t n, int rank, int salt = 0) {
  std::mt19937 gen(1234u + 977u * unsigned(rank) + 31u * unsigned(salt));
  std::normal_distribution<float> d(0.5f, 2.0f);
  std::vector<T> v(n);
  for (auto& x : v) x = from_float<T>(d(gen));
  return v;
}

// Tolerance of one value after a float-accumulated reduction of `world` inputs rounded once to T:
// the output rounding (2^-24 / 2^-11 / 2^-8 relative) plus float accumulation (world * 2^-24).
template <class T>
double rel_tol(int world) {
  const double out = std::is_same_v<T, float> ? 0x1p-24 : std::is_same_v<T, half> ? 0x1p-11 : 0x1p-8;
  return out + world * 0x1p-24;
}

template <class T>
void check_close(double want, T got, double scale, int world, const std::string& where) {
  ASSERT_NEAR(val(got), want, rel_tol<T>(world) * scale + 1e-30) << where;
}

struct Case {
  int world;
  std::size_t count;  // per-rank count
};

template <class T>
void test_all_collectives(Case c) {
  const int W = c.world;
  const std::size_t n = c.count;
  std::vector<std::vector<T>> ag(W), rs(W), ar_sum(W), ar_max(W), ar_avg(W), bc(W);
  run_ranks(W, [&](std::shared_ptr<LocalComm> comm) {
    const int r = comm->rank();
    ASSERT_EQ(comm->size(), W);
    const auto in = random_input<T>(n, r);
    const auto big = random_input<T>(n * W, r, 1);
    ag[r].resize(n * W);
    comm->all_gather(in.data(), ag[r].data(), n);
    rs[r].resize(n);
    comm->reduce_scatter(big.data(), rs[r].data(), n, ReduceOp::sum);
    ar_sum[r].resize(n);
    comm->all_reduce(in.data(), ar_sum[r].data(), n, ReduceOp::sum);
    ar_max[r] = in;  // in place
    comm->all_reduce(ar_max[r].data(), ar_max[r].data(), n, ReduceOp::max);
    ar_avg[r].resize(n);
    comm->all_reduce(in.data(), ar_avg[r].data(), n, ReduceOp::avg);
    const int root = W - 1;
    bc[r].assign(n, from_float<T>(0.f));
    comm->broadcast(in.data(), bc[r].data(), n, root);
    comm->barrier();
  });
  std::vector<std::vector<T>> ins(W), bigs(W);
  for (int r = 0; r < W; ++r) ins[r] = random_input<T>(n, r), bigs[r] = random_input<T>(n * W, r, 1);
  for (int r = 0; r < W; ++r) {
    const std::string where = "world " + std::to_string(W) + " rank " + std::to_string(r) + " count " + std::to_string(n);
    for (int q = 0; q < W; ++q)
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(val(ag[r][q * n + i]), val(ins[q][i])) << "all_gather " << where;
    for (std::size_t i = 0; i < n; ++i) {
      double s = 0, sabs = 0, mx = -INFINITY, rss = 0, rsabs = 0;
      for (int q = 0; q < W; ++q) {
        s += val(ins[q][i]);
        sabs += std::abs(val(ins[q][i]));
        mx = std::max(mx, val(ins[q][i]));
        rss += val(bigs[q][r * n + i]);
        rsabs += std::abs(val(bigs[q][r * n + i]));
      }
      check_close<T>(s, ar_sum[r][i], sabs, W, "all_reduce sum " + where);
      check_close<T>(s / W, ar_avg[r][i], sabs / W, W, "all_reduce avg " + where);
      ASSERT_EQ(val(ar_max[r][i]), mx) << "all_reduce max " << where;
      check_close<T>(rss, rs[r][i], rsabs, W, "reduce_scatter " + where);
      ASSERT_EQ(val(bc[r][i]), val(ins[W - 1][i])) << "broadcast " << where;
      // Deterministic order: every rank holds the same bits.
      ASSERT_EQ(std::memcmp(&ar_sum[r][i], &ar_sum[0][i], sizeof(T)), 0) << where;
    }
  }
}

class Collectives : public ::testing::TestWithParam<Case> {};

TEST_P(Collectives, Float) { test_all_collectives<float>(GetParam()); }
TEST_P(Collectives, Half) { test_all_collectives<half>(GetParam()); }
TEST_P(Collectives, BFloat16) { test_all_collectives<bf16>(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Worlds, Collectives,
                         ::testing::Values(Case{1, 13}, Case{2, 1}, Case{2, 1001}, Case{3, 7}, Case{3, 1000}, Case{4, 333}, Case{4, 4096}),
                         [](const auto& info) { return "w" + std::to_string(info.param.world) + "_n" + std::to_string(info.param.count); });

// The sum of floats is reduced in rank order 0..N-1 in float: bitwise equal to that sum.
TEST(LocalComm, FloatSumIsRankOrdered) {
  const int W = 4;
  const std::size_t n = 999;
  std::vector<float> got(n);
  run_ranks(W, [&](std::shared_ptr<LocalComm> c) {
    auto in = random_input<float>(n, c->rank());
    std::vector<float> out(n);
    c->all_reduce(in.data(), out.data(), n, ReduceOp::sum);
    if (c->rank() == 2) got = out;
  });
  for (std::size_t i = 0; i < n; ++i) {
    float s = random_input<float>(n, 0)[i];
    for (int r = 1; r < W; ++r) s += random_input<float>(n, r)[i];
    ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(s)) << i;
  }
}

TEST(LocalComm, InPlaceGatherAndScatterAndIntegers) {
  for (int W : {1, 2, 3, 4}) {
    const std::size_t n = 5;
    run_ranks(W, [&](std::shared_ptr<LocalComm> c) {
      const int r = c->rank();
      // all_gather in place: my block already sits at recv + r*n.
      std::vector<std::int32_t> buf(n * W, -1);
      for (std::size_t i = 0; i < n; ++i) buf[r * n + i] = std::int32_t(100 * r + int(i) + 1);
      c->all_gather(buf.data() + r * n, buf.data(), n);
      for (int q = 0; q < W; ++q)
        for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(buf[q * n + i], 100 * q + int(i) + 1);
      // reduce_scatter in place (recv = send + r*n), integer sum exact.
      std::vector<std::int32_t> rs(n * W);
      for (std::size_t i = 0; i < n * W; ++i) rs[i] = std::int32_t(i + 1) * (r + 1);
      c->reduce_scatter(rs.data(), rs.data() + r * n, n, ReduceOp::sum);
      for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(rs[r * n + i], std::int32_t(r * n + i + 1) * (W * (W + 1) / 2));
    });
  }
}

// A buffer whose length does not divide by the world size: pad to padded_count with zeros,
// reduce-scatter the padded buffer, all-gather the shards, drop the padding.
TEST(LocalComm, PaddingSemantics) {
  const std::size_t total = 1001;
  for (int W : {2, 3, 4}) {
    const std::size_t shard = shard_count(total, W), padded = padded_count(total, W);
    EXPECT_EQ(padded % W, 0u);
    EXPECT_GE(padded, total);
    EXPECT_LT(padded - total, std::size_t(W));
    run_ranks(W, [&](std::shared_ptr<LocalComm> c) {
      auto in = random_input<float>(total, c->rank());
      in.resize(padded, 0.f);
      std::vector<float> mine(shard), whole(padded);
      c->reduce_scatter(in.data(), mine.data(), shard, ReduceOp::avg);
      c->all_gather(mine.data(), whole.data(), shard);
      for (std::size_t i = 0; i < total; ++i) {
        double want = 0, scale = 0;
        for (int q = 0; q < W; ++q) want += random_input<float>(total, q)[i], scale += std::abs(random_input<float>(total, q)[i]);
        EXPECT_NEAR(whole[i], want / W, rel_tol<float>(W) * scale);
      }
      for (std::size_t i = total; i < padded; ++i) EXPECT_EQ(whole[i], 0.f) << "padding stays zero";
    });
  }
}

TEST(LocalComm, MismatchedCollectivesThrowOnEveryRank) {
  std::atomic<int> threw{0};
  run_ranks(3, [&](std::shared_ptr<LocalComm> c) {
    std::vector<float> a(12, 1.f), b(12);
    try {
      if (c->rank() == 1)
        c->all_reduce(a.data(), b.data(), 6, ReduceOp::sum);  // count differs
      else
        c->all_reduce(a.data(), b.data(), 4, ReduceOp::sum);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("disagree"), std::string::npos) << e.what();
      ++threw;
    }
  });
  EXPECT_EQ(threw.load(), 3);
}

TEST(LocalComm, MissingRankTimesOutOnEveryWaitingRank) {
  std::atomic<int> threw{0};
  const auto t0 = std::chrono::steady_clock::now();
  run_ranks(
      3,
      [&](std::shared_ptr<LocalComm> c) {
        if (c->rank() == 2) return;  // never joins
        std::vector<float> a(4, 1.f);
        try {
          c->all_reduce(a.data(), a.data(), 4, ReduceOp::sum);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("aborted"), std::string::npos) << e.what();
          ++threw;
        }
      },
      std::chrono::milliseconds(200));
  EXPECT_EQ(threw.load(), 2);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST(LocalComm, ThrowingRankAbortsTheOthers) {
  EXPECT_THROW(run_ranks(2,
                         [&](std::shared_ptr<LocalComm> c) {
                           if (c->rank() == 0) throw Error("rank 0 fails before the collective");
                           float x = 1.f;
                           c->all_reduce(&x, &x, 1, ReduceOp::sum);  // must not hang
                         }),
               Error);
}

TEST(LocalComm, BadArguments) {
  auto c = LocalComm::create(2);
  EXPECT_THROW(c[0]->broadcast(nullptr, nullptr, 0, DType::f32, 5), Error);
  EXPECT_THROW(LocalComm::create(0), Error);
}

TEST(Concept, BackendsSatisfyIt) {
  static_assert(CommunicatorLike<LocalComm>);
  static_assert(padded_count(10, 4) == 12 && shard_count(10, 4) == 3 && padded_count(8, 4) == 8);
  auto one = from_env();  // WORLD_SIZE unset here -> one local rank
  EXPECT_EQ(one->size(), 1);
  float a[3] = {1.5f, -2.f, 3.f}, b[3] = {};
  one->all_reduce(a, b, 3, ReduceOp::avg);
  EXPECT_EQ(b[1], -2.f);
}

// ---- torchrun environment ----------------------------------------------------------------------------
struct EnvGuard {  // sets variables for one test, restores them after
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  void set(const char* k, const char* v) {
    const char* old = std::getenv(k);
    saved.emplace_back(k, old ? std::optional<std::string>(old) : std::nullopt);
    if (v)
      setenv(k, v, 1);
    else
      unsetenv(k);
  }
  ~EnvGuard() {
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
      if (it->second)
        setenv(it->first.c_str(), it->second->c_str(), 1);
      else
        unsetenv(it->first.c_str());
    }
  }
};

TEST(DistEnv, ParsesTorchrunVariables) {
  EnvGuard g;
  g.set("RANK", "3"), g.set("WORLD_SIZE", "8"), g.set("LOCAL_RANK", "1"), g.set("MASTER_ADDR", "node0"), g.set("MASTER_PORT", "29501");
  const auto e = DistEnv::from_environment();
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "node0");
  EXPECT_EQ(e.master_port, 29501);
}

TEST(DistEnv, BadVariablesAreClearErrors) {
  auto expect_error = [](const char* k, const char* v, const char* mention) {
    EnvGuard g;
    g.set("RANK", "0"), g.set("WORLD_SIZE", "2"), g.set("MASTER_PORT", "29500");
    g.set(k, v);
    try {
      (void)DistEnv::from_environment();
      ADD_FAILURE() << k << "=" << v << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(mention), std::string::npos) << e.what();
    }
  };
  expect_error("RANK", "2", "RANK=2");
  expect_error("RANK", "x", "RANK");
  expect_error("WORLD_SIZE", "0", "WORLD_SIZE");
  expect_error("MASTER_PORT", "70000", "MASTER_PORT");
}

TEST(FromEnv, WorldOneIsLocalAndLargerNeedsNccl) {
  {
    EnvGuard g;
    g.set("WORLD_SIZE", "1"), g.set("RANK", "0");
    EXPECT_EQ(from_env()->backend(), "local");
  }
  EnvGuard g;
  g.set("WORLD_SIZE", "2"), g.set("RANK", "0");
  try {
    (void)from_env();  // this binary is built without SQUEEZE_WITH_NCCL
    ADD_FAILURE() << "WORLD_SIZE=2 without NCCL accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("NCCL"), std::string::npos) << e.what();
  }
}

// ---- TcpStore ---------------------------------------------------------------------------------------
TEST(TcpStore, SetGetWaitAddBarrier) {
  TcpStore server("127.0.0.1", 0, /*is_server=*/true, std::chrono::seconds(10));
  const auto port = server.port();
  ASSERT_NE(port, 0);
  server.set("a", std::string("hello\0world", 11));
  EXPECT_EQ(server.get("a"), std::string("hello\0world", 11));
  EXPECT_FALSE(server.check_key("missing"));

  const int W = 4;
  std::vector<std::thread> ts;
  std::vector<std::string> got(W);
  std::atomic<int> after_barrier{0};
  for (int r = 0; r < W; ++r)
    ts.emplace_back([&, r] {
      TcpStore c("localhost", port, false, std::chrono::seconds(10));
      c.add("counter", r + 1);
      if (r == 3) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        c.set("late", "value from rank 3");
      }
      got[r] = c.get("late");  // waits until rank 3 set it
      c.barrier("b", W);
      ++after_barrier;
    });
  for (auto& t : ts) t.join();
  for (auto& g : got) EXPECT_EQ(g, "value from rank 3");
  EXPECT_EQ(after_barrier.load(), W);
  EXPECT_EQ(server.add("counter", 0), 1 + 2 + 3 + 4);
}

// The rank hosting the server destroys its store right after a barrier (as NcclComm::from_env does): every
// other rank must still get its reply. Seen on two H200s before the host waited for departures: "TcpStore:
// connection closed receiving key 'barrier/nccl_init/done'" on rank 1. Repeated to make the race likely.
TEST(TcpStore, BarrierHostLeavesAfterEveryRank) {
  const int W = 4;
  for (int round = 0; round < 30; ++round) {
    std::promise<std::uint16_t> port_promise;
    std::shared_future<std::uint16_t> port = port_promise.get_future().share();
    std::atomic<int> errors{0};
    std::vector<std::thread> ts;
    ts.emplace_back([&] {
      try {
        TcpStore host("127.0.0.1", 0, true, std::chrono::seconds(10));
        port_promise.set_value(host.port());
        host.barrier("init", W);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "host: " << e.what();
        ++errors;
      }  // the server goes away here
    });
    for (int r = 1; r < W; ++r)
      ts.emplace_back([&] {
        try {
          TcpStore c("127.0.0.1", port.get(), false, std::chrono::seconds(10));
          c.barrier("init", W);
        } catch (const std::exception& e) {
          ADD_FAILURE() << "client: " << e.what();
          ++errors;
        }
      });
    for (auto& t : ts) t.join();
    ASSERT_EQ(errors.load(), 0) << "round " << round;
  }
}

// A hostile or broken client (garbage, absurd lengths, a half message then silence) is dropped or
// ignored; the server keeps serving everyone else.
TEST(TcpStore, HostileClientsDoNotStopTheServer) {
  TcpStore s("127.0.0.1", 0, true, std::chrono::seconds(5));
  auto raw_client = [&](const std::string& bytes) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(s.port());
    ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), ssize_t(bytes.size()));
    return fd;
  };
  const int bad_op = raw_client(std::string("X\1\0\0\0k\0\0\0\0", 10));  // unknown op
  const int huge = raw_client(std::string("S\xff\xff\xff\x7f", 5));      // 2 GiB key length
  const int half = raw_client(std::string("S\5\0\0\0ab", 7));            // half a request, then silence
  s.set("still", "alive");
  EXPECT_EQ(s.get("still"), "alive");
  TcpStore other("127.0.0.1", s.port(), false, std::chrono::seconds(5));
  EXPECT_EQ(other.get("still"), "alive");
  EXPECT_EQ(other.add("n", 5), 5);
  for (int fd : {bad_op, huge, half}) ::close(fd);
}

TEST(TcpStore, GetTimesOutWithAClearError) {
  TcpStore s("127.0.0.1", 0, true, std::chrono::seconds(5));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    (void)s.get("never", std::chrono::milliseconds(150));
    FAIL() << "expected a timeout";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'never'"), std::string::npos) << e.what();
  }
  const auto dt = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(dt, std::chrono::milliseconds(150));
  EXPECT_LT(dt, std::chrono::seconds(3));
}

TEST(TcpStore, ConnectTimesOutWhenNoServer) {
  std::uint16_t port;
  {
    TcpStoreServer probe(0);
    port = probe.port();
  }  // a port nobody listens on any more
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(TcpStore("127.0.0.1", port, false, std::chrono::milliseconds(300)), Error);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
}

}  // namespace
