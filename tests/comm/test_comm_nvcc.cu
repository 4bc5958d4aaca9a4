// The communicators compiled by nvcc (as a user's .cu trainer would include them): LocalComm then also
// recognises device pointers. On host buffers it must behave exactly as the g++ build; runs without a GPU.
#include <gtest/gtest.h>

#include <squeeze/comm.hpp>
#include <squeeze/comm/nccl.hpp>

using namespace squeeze;
using namespace squeeze::comm;

TEST(CommNvcc, HostCollectivesWithDeviceDetectionCompiledIn) {
  static_assert(CommunicatorLike<NcclComm> && CommunicatorLike<LocalComm>);
  for (int W : {1, 3}) {
    run_ranks(W, [&](std::shared_ptr<LocalComm> c) {
      std::vector<bf16> in(5), out(5 * W), red(5);
      for (int i = 0; i < 5; ++i) in[i] = from_float<bf16>(float(c->rank() * 10 + i) + 0.5f);
      c->all_gather(in.data(), out.data(), 5);
      c->all_reduce(in.data(), red.data(), 5, ReduceOp::max);
      for (int q = 0; q < W; ++q)
        for (int i = 0; i < 5; ++i) EXPECT_EQ(to_float(out[q * 5 + i]), float(q * 10 + i) + 0.5f);
      for (int i = 0; i < 5; ++i) EXPECT_EQ(to_float(red[i]), float((W - 1) * 10 + i) + 0.5f);
    });
  }
}
