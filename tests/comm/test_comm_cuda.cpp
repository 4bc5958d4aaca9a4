// GPU side of the communicators (label cuda; skips without a device): LocalComm over device buffers of
// one GPU, NcclComm at world size 1, and with two or more GPUs NcclComm across threads plus the
// watchdog turning a collective that one rank never joins into an error on the rank that waits.
#include <gtest/gtest.h>
#include <cuda_runtime_api.h>

#include <random>
#include <squeeze/comm.hpp>
#include <squeeze/comm/nccl.hpp>

using namespace squeeze;
using namespace squeeze::comm;

namespace {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}
#define REQUIRE_GPUS(k) \
  if (device_count() < (k)) GTEST_SKIP() << "needs " << (k) << " CUDA device(s)"

std::vector<float> random_floats(std::size_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

struct DeviceBuffer {
  float* p = nullptr;
  std::size_t n = 0;
  explicit DeviceBuffer(std::size_t n_) : n(n_) { SQUEEZE_CUDA_CHECK(cudaMalloc(&p, n * sizeof(float))); }
  DeviceBuffer(const std::vector<float>& h) : DeviceBuffer(h.size()) {
    SQUEEZE_CUDA_CHECK(cudaMemcpy(p, h.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  }
  ~DeviceBuffer() { cudaFree(p); }
  std::vector<float> host() const {
    std::vector<float> h(n);
    SQUEEZE_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
  }
};

// Runs the four collectives on device buffers and checks them against float64 on the host.
void check_collectives(Communicator& c, int device) {
  SQUEEZE_CUDA_CHECK(cudaSetDevice(device));
  const int W = c.size(), r = c.rank();
  const std::size_t n = 1001;
  std::vector<std::vector<float>> ins(W), bigs(W);
  for (int q = 0; q < W; ++q) ins[q] = random_floats(n, 10 + q), bigs[q] = random_floats(n * W, 100 + q);
  DeviceBuffer in(ins[r]), big(bigs[r]), gathered(n * W), scattered(n), reduced(n), bc(n);
  c.all_gather(in.p, gathered.p, n, DType::f32);
  c.reduce_scatter(big.p, scattered.p, n, DType::f32, ReduceOp::sum);
  c.all_reduce(in.p, reduced.p, n, DType::f32, ReduceOp::avg);
  c.broadcast(in.p, bc.p, n, DType::f32, 0);
  c.synchronize();
  const auto g = gathered.host(), s = scattered.host(), a = reduced.host(), b = bc.host();
  for (int q = 0; q < W; ++q)
    for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(g[q * n + i], ins[q][i]);
  for (std::size_t i = 0; i < n; ++i) {
    double ss = 0, aa = 0, scale = 0;
    for (int q = 0; q < W; ++q) ss += bigs[q][r * n + i], aa += ins[q][i], scale += std::abs(ins[q][i]) + std::abs(bigs[q][r * n + i]);
    ASSERT_NEAR(s[i], ss, 4 * W * 0x1p-24 * scale + 1e-7);
    ASSERT_NEAR(a[i], aa / W, 4 * W * 0x1p-24 * scale + 1e-7);
    ASSERT_EQ(b[i], ins[0][i]);
  }
  c.barrier();
}

TEST(LocalCommCuda, DeviceBuffersOnOneGpu) {
  REQUIRE_GPUS(1);
  for (int W : {1, 2, 3}) run_ranks(W, [&](std::shared_ptr<LocalComm> c) { check_collectives(*c, 0); });
}

TEST(NcclComm, WorldSizeOne) {
  REQUIRE_GPUS(1);
  ncclUniqueId id;
  SQUEEZE_NCCL_CHECK(ncclGetUniqueId(&id));
  NcclOptions opt;
  opt.device = 0;
  NcclComm c(0, 1, id, opt);
  check_collectives(c, 0);
}

// The torchrun path at world size 1: TcpStore rendezvous (port 0: any free port) + unique id + init.
TEST(NcclComm, FromEnvWorldOne) {
  REQUIRE_GPUS(1);
  setenv("RANK", "0", 1), setenv("WORLD_SIZE", "1", 1), setenv("LOCAL_RANK", "0", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1), setenv("MASTER_PORT", "0", 1);
  auto c = NcclComm::from_env();
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->backend(), "nccl");
  check_collectives(*c, 0);
  auto any = from_env();  // WORLD_SIZE=1: the no-op local communicator
  EXPECT_EQ(any->backend(), "local");
  unsetenv("WORLD_SIZE"), unsetenv("RANK"), unsetenv("LOCAL_RANK"), unsetenv("MASTER_ADDR"), unsetenv("MASTER_PORT");
}

TEST(NcclComm, TwoGpusInThreadsAndWatchdog) {
  REQUIRE_GPUS(2);
  ncclUniqueId id;
  SQUEEZE_NCCL_CHECK(ncclGetUniqueId(&id));
  std::vector<std::thread> ts;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      try {
        NcclOptions opt;
        opt.device = r;
        opt.timeout = std::chrono::seconds(3);
        NcclComm c(r, 2, id, opt);
        check_collectives(c, r);
        // Rank 1 skips this all-reduce: rank 0's watchdog must abort and throw, not hang.
        if (r == 0) {
          DeviceBuffer x(std::vector<float>(4, 1.f));
          c.all_reduce(x.p, x.p, 4, DType::f32, ReduceOp::sum);
          EXPECT_THROW(c.synchronize(), Error);
          EXPECT_THROW(c.barrier(), Error);  // stays failed
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

}  // namespace
