// The ZeRO trainer on CUDA tensors (label cuda; skips without a device): LocalComm with 2 ranks as threads
// over one GPU, and NcclComm at world size 1, against the Stage0 baseline on the same GPU.
// Device buffers take the trainer's torch-op AdamW path (this TU is host-compiled), so the comparison is
// with tolerances, not bitwise: float 1e-5 abs, bf16 by the update error (<= 0.2, see test_zero.cpp).
#include <torch/cuda.h>

#include "zero_common.hpp"
#if defined(SQUEEZE_WITH_NCCL) && SQUEEZE_WITH_NCCL
#include <squeeze/comm/nccl.hpp>
#endif

namespace {

using namespace zero_test;

#define REQUIRE_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs a CUDA device and libtorch with CUDA"

template <class C, int A>
void gpu_parity(int world) {
  const torch::Device dev(torch::kCUDA, 0);
  const bool f32 = std::is_same_v<C, float>;
  auto close = [&](const RunResult& got, const RunResult& ref, const std::string& what) {
    if (f32) expect_close(got.params, ref.params, 1e-5, 0.0, what);
    else expect_update_close(got.params, ref.params, Model::mlp, 0.2, what);
  };
  const auto base = train<Strategy<Sharded<Stage0>, Accumulate<A>, Precision<C, float>>>(Model::mlp, world, 10, {}, {}, dev);
  expect_trained(base.params, Model::mlp, nn::detail::scalar_type_of<C>());
  const std::string tag = " world " + std::to_string(world) + " " + std::string(dtype_name<C>()) + " acc " + std::to_string(A);
  close(train<Strategy<Sharded<Stage1>, Accumulate<A>, Precision<C, float>>>(Model::mlp, world, 10, {}, {}, dev), base, "GPU Stage1" + tag);
  close(train<Strategy<Sharded<Stage2>, Offload<Host>, Accumulate<A>, Precision<C, float>>>(Model::mlp, world, 10, {}, {}, dev), base,
        "GPU Stage2+Offload" + tag);
  // Stage 3 collects inside backward; libtorch runs every CUDA backward of a process on one worker thread
  // per device, so thread-ranks sharing one GPU would wait on each other there: stage 3 on LocalComm over
  // one GPU runs at world size 1 only (NcclComm, one process per GPU, has no such limit).
  if (world == 1) {
    close(train<Strategy<Sharded<Stage3>, Accumulate<A>, Precision<C, float>>>(Model::mlp, world, 10, {}, {}, dev), base, "GPU Stage3" + tag);
    close(train<Strategy<Sharded<Stage3>, Offload<Host>, Accumulate<A>, Precision<C, float>>>(Model::mlp, world, 10, {}, {}, dev), base,
          "GPU Stage3+Offload" + tag);
  }
  // The CPU run of the same strategy agrees too (device kernels vs CPU twins).
  close(train<Strategy<Sharded<Stage0>, Accumulate<A>, Precision<C, float>>>(Model::mlp, world, 10), base, "CPU vs GPU Stage0" + tag);
}

TEST(ZeroCuda, LocalCommOneGpuFloat) {
  REQUIRE_CUDA();
  for (int w : {1, 2}) gpu_parity<float, 1>(w), gpu_parity<float, 4>(w);
}
TEST(ZeroCuda, LocalCommOneGpuBf16) {
  REQUIRE_CUDA();
  for (int w : {1, 2}) gpu_parity<bf16, 1>(w), gpu_parity<bf16, 4>(w);
}

TEST(ZeroCuda, LlamaStage3OffloadOnGpu) {
  REQUIRE_CUDA();
  const torch::Device dev(torch::kCUDA, 0);
  using S0 = Strategy<Sharded<Stage0>, Precision<bf16, float>>;
  using S3 = Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>>;
  const auto base = train<S0>(Model::llama, 1, 6, {}, {}, dev);
  expect_update_close(train<S3>(Model::llama, 1, 6, {}, {}, dev).params, base.params, Model::llama, 0.2, "GPU llama Stage3+Offload");
}

#if defined(SQUEEZE_WITH_NCCL) && SQUEEZE_WITH_NCCL
TEST(ZeroCuda, NcclWorldOne) {
  REQUIRE_CUDA();
  const torch::Device dev(torch::kCUDA, 0);
  ncclUniqueId id;
  SQUEEZE_NCCL_CHECK(ncclGetUniqueId(&id));
  comm::NcclOptions o;
  o.device = 0;
  auto nccl = std::make_shared<comm::NcclComm>(0, 1, id, o);
  using S0 = Strategy<Sharded<Stage0>, Precision<bf16, float>>;
  using S3 = Strategy<Sharded<Stage3>, Precision<bf16, float>>;
  const auto base = train<S0>(Model::mlp, 1, 10, {}, {}, dev);
  expect_update_close(train<S3>(Model::mlp, 1, 10, {}, {}, dev, nccl).params, base.params, Model::mlp, 0.2, "NCCL Stage3");
  using S2 = Strategy<Sharded<Stage2>, Accumulate<4>>;
  expect_close(train<S2>(Model::mlp, 1, 10, {}, {}, dev, nccl).params,
               train<Strategy<Sharded<Stage0>, Accumulate<4>>>(Model::mlp, 1, 10, {}, {}, dev).params, 1e-5, 0.0, "NCCL Stage2");
}
#endif

}  // namespace
