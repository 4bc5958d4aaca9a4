// The ZeRO trainer on CUDA tensors (label cuda; skips without a device): LocalComm with 2 ranks as threads
// over one GPU, and NcclComm at world size 1, against the Stage0 baseline on the same GPU.
// Device buffers take the trainer's torch-op AdamW path (this TU is host-compiled), so the comparison is
// with tolerances, not bitwise: float 1e-5 abs, bf16 by the update error (<= 0.2, see test_zero.cpp).
#include <torch/cuda.h>

#include "zero_common.hpp"
#if defined(SQUEEZE_WITH_NCCL) && SQUEEZE_WITH_NCCL
#include <squeeze/comm/nccl.hpp>
#endif
#if defined(SQUEEZE_TORCH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
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
    if (f32)
      expect_close(got.params, ref.params, 1e-5, 0.0, what);
    else
      expect_update_close(got.params, ref.params, Model::mlp, 0.2, what);
  };
  const auto base = train<Strategy<Sharded<Stage0>, Accumulate<A>, Precision<C, float>>>(Model::mlp, world, 10, {}, {}, dev);
  expect_trained(base.params, Model::mlp, squeeze::torch_dtype<C>());
  const std::string tag = " world " + std::to_string(world) + " " + std::string(dtype_name<C>()) + " acc " + std::to_string(A);
  close(train<Strategy<Sharded<Stage1>, Accumulate<A>, Precision<C, float>>>(Model::mlp, world, 10, {}, {}, dev), base, "GPU Stage1" + tag);
  close(train<Strategy<Sharded<Stage2>, Offload<Host>, Accumulate<A>, Precision<C, float>>>(Model::mlp, world, 10, {}, {}, dev), base,
        "GPU Stage2+Offload" + tag);
  // Stage 3 collects inside backward; libtorch runs every CUDA backward of a process on one worker thread
  // per device, so thread-ranks sharing one GPU would wait on each other there: stage 3 on LocalComm over
  // one GPU runs at world size 1 only (NcclComm, one process per GPU, has no such limit).
  if (world == 1) {
    close(train<Strategy<Sharded<Stage3>, Accumulate<A>, Precision<C, float>>>(Model::mlp, world, 10, {}, {}, dev), base,
          "GPU Stage3" + tag);
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

// Offload<Host> on the GPU: the overlapped pipeline (d2h/h2d side streams, CPU worker) against the same jobs
// in program order, bitwise; eager (no clipping) and deferred (clipping); stage 2 in small buckets and stage 3.
template <class S>
void gpu_offload_bitwise(const std::string& what, comm::CommPtr single = nullptr) {
  const torch::Device dev(torch::kCUDA, 0);
  for (float clip : {0.0f, 0.05f}) {
    train::TrainerOptions overlapped, in_order;
    overlapped.bucket_bytes = in_order.bucket_bytes = 512;
    overlapped.max_grad_norm = in_order.max_grad_norm = clip;
    in_order.overlap_offload = false;
    const auto a = train<S>(Model::llama, 1, 6, overlapped, {}, dev, single);
    const auto b = train<S>(Model::llama, 1, 6, in_order, {}, dev);
    const std::string tag = what + (clip > 0 ? " clipped" : " eager");
    expect_bitwise(a.params, b.params, tag);
    EXPECT_EQ(a.updated_during_backward, clip == 0) << tag;
    for (std::size_t i = 0; i < a.log.size(); ++i) EXPECT_EQ(a.log[i].grad_norm, b.log[i].grad_norm) << tag;
    expect_trained(a.params, Model::llama, squeeze::torch_dtype<typename S::compute_type>());
  }
}

TEST(ZeroCuda, OffloadOverlapBitwise) {
  REQUIRE_CUDA();
  gpu_offload_bitwise<Strategy<Sharded<Stage2>, Offload<Host>, Precision<bf16, float>>>("GPU Stage2+Offload bf16");
  gpu_offload_bitwise<Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>>>("GPU Stage3+Offload bf16");
  gpu_offload_bitwise<Strategy<Sharded<Stage3>, Offload<Host>, Accumulate<4>, Precision<bf16, float>>>("GPU Stage3+Offload bf16 acc 4");
  gpu_offload_bitwise<Strategy<Sharded<Stage2>, Offload<Host>, Accumulate<4>>>("GPU Stage2+Offload float acc 4");
}

// Offload<Host, Streamed> on the GPU: host units copied in on the copy stream, each pass's gradient copied out at once,
// the CPU AdamW writing the host shard in place, against resident parameters (the same gradients, sums and CPU AdamW:
// bitwise), eager and clipped; accumulated on the host (eager: its norm is summed on the host, so clipping would
// differ from the device's sum by rounding); overlapped against in order.
TEST(ZeroCuda, StreamedEqualsResidentBitwise) {
  REQUIRE_CUDA();
  const torch::Device dev(torch::kCUDA, 0);
  using R = Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>>;
  using St = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, float>>;
  using RA = Strategy<Sharded<Stage3>, Offload<Host>, Accumulate<4>, Precision<bf16, float>>;
  using StA = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Accumulate<4>, Precision<bf16, float>>;
  for (float clip : {0.0f, 0.05f}) {
    train::TrainerOptions o;
    o.max_grad_norm = clip;
    const auto a = train<St>(Model::llama, 1, 6, o, {}, dev), b = train<R>(Model::llama, 1, 6, o, {}, dev);
    expect_bitwise(a.params, b.params, clip > 0 ? "GPU streamed vs resident, clipped" : "GPU streamed vs resident, eager");
    for (std::size_t i = 0; i < a.log.size(); ++i) EXPECT_EQ(a.log[i].grad_norm, b.log[i].grad_norm);
    EXPECT_GT(a.log.back().transfers.h2d_bytes, 0);
    EXPECT_GT(a.log.back().transfers.d2h_bytes, 0);
  }
  expect_bitwise(train<StA>(Model::llama, 1, 3, {}, {}, dev).params, train<RA>(Model::llama, 1, 3, {}, {}, dev).params,
                 "GPU streamed vs resident, accumulate 4");
  gpu_offload_bitwise<St>("GPU Stage3+Streamed bf16");
  gpu_offload_bitwise<StA>("GPU Stage3+Streamed bf16 acc 4");
}

// The compact host state on a GPU: the streamed units' bf16 shards are their own master, and the kept-whole layers
// (RMSNorm gains, on the device) are updated in a host bf16 copy and uploaded. One step from the same bf16 start
// lands each weight on a bf16 neighbour of the fp32-master run's (stochastic against nearest rounding of the same
// fp32 update: at most one bf16 spacing, 2^-7 of the value); over several steps the losses stay together.
TEST(ZeroCuda, CompactStreamedStateTrainsOnTheGpu) {
  REQUIRE_CUDA();
  const torch::Device dev(torch::kCUDA, 0);
  using Compact = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, bf16>, QuantizedState<8>>;
  using Exact = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, float>, QuantizedState<8>>;
  Hyper h;
  h.lr = 3e-3f;
  const auto one = train<Compact>(Model::llama, 1, 1, {}, h, dev), one_exact = train<Exact>(Model::llama, 1, 1, {}, h, dev);
  auto init = make_model(Model::llama, torch::kBFloat16);
  bool norm_moved = false;
  for (auto& item : init->named_parameters()) {
    const auto got = one.params.at(item.key()).to(torch::kFloat64), ref = one_exact.params.at(item.key()).to(torch::kFloat64);
    const auto excess = ((got - ref).abs() - ref.abs() * std::ldexp(1.0, -7) - 1e-30).max().item<double>();
    EXPECT_LE(excess, 0.0) << item.key() << ": more than one bf16 spacing from the fp32-master step";
    if (item.key().find("norm") != std::string::npos)
      norm_moved |= !torch::equal(one.params.at(item.key()), item.value().to(torch::kFloat32));
  }
  EXPECT_TRUE(norm_moved) << "the kept-whole layers on the device did not train";
  const auto compact = train<Compact>(Model::llama, 1, 8, {}, h, dev), exact = train<Exact>(Model::llama, 1, 8, {}, h, dev);
  expect_trained(compact.params, Model::llama, torch::kBFloat16);
  for (std::size_t i = 0; i < exact.log.size(); ++i)
    EXPECT_LT(std::abs(compact.log[i].loss - exact.log[i].loss) / exact.log[i].loss, 0.02) << "step " << i;
  // The kept-whole layers' host copies, 2 bytes an element: as many bytes as those layers hold on the device.
  EXPECT_GT(compact.memory.master_weights.host, 0);
  EXPECT_LE(compact.memory.master_weights.host, compact.memory.parameters.device);
}

// CheckpointOffload<Host> on a GPU: the block inputs go to pinned host memory on the copy-out stream and come back on
// the copy-in stream ahead of each recomputation; the training is bitwise that of plain checkpointing, for any number
// kept and prefetched, resident or streamed parameters; the inputs' device memory goes once copied.
TEST(ZeroCuda, OffloadedCheckpointsEqualPlainCheckpointingBitwise) {
  REQUIRE_CUDA();
  const torch::Device dev(torch::kCUDA, 0);
  nn::LlamaConfig cfg;
  cfg.vocab = 301, cfg.hidden = 96, cfg.layers = 5, cfg.heads = 4, cfg.kv_heads = 2, cfg.ffn = 200;
  torch::manual_seed(17);
  const torch::Tensor ids = torch::randint(0, cfg.vocab, {3, 4, 58}, torch::kInt64);
  auto run = [&]<class S>(S*, int keep) {
    torch::manual_seed(5);
    nn::Llama model(cfg);
    model->to(dev, torch::kBFloat16);
    train::TrainerOptions o;
    o.checkpoint_prefetch = keep;
    auto t = zero_trainer<S>(model, Hyper{}, LocalComm::single(), o);
    train::TransferCounters moved;
    for (int s = 0; s < 3; ++s) {
      const torch::Tensor x = ids[s].to(dev);
      const auto r = t.step([&] { return model->loss(x.narrow(1, 0, 57), x.narrow(1, 1, 57)); });
      moved = r.transfers;
    }
    Params out;
    for (auto& [n, v] : t.full_parameters()) out[n] = v.to(torch::kCPU, torch::kFloat32);
    return std::pair{out, moved};
  };
  using Plain = Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed>;
  using Off = Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed, CheckpointOffload<Host>>;
  using StPlain = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, float>, Checkpointed>;
  using StOff = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, float>, Checkpointed, CheckpointOffload<Host>>;
  const auto plain = run((Plain*)nullptr, 1);
  const int64_t inputs = 5 * 4 * 57 * 96 * 2;  // five block inputs of 4 x 57 tokens x 96, bf16
  for (int keep : {0, 1, 2}) {
    const auto off = run((Off*)nullptr, keep);
    expect_bitwise(off.first, plain.first, "offloaded checkpoints, keep " + std::to_string(keep));
    EXPECT_EQ(off.second.d2h_bytes - plain.second.d2h_bytes, inputs) << "keep " << keep;
  }
  expect_bitwise(run((StOff*)nullptr, 1).first, run((StPlain*)nullptr, 1).first, "offloaded checkpoints, streamed parameters");
  // 8 bits: encoded on the GPU, the payload on the host or kept on the device, the same training.
  using Host8 = Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed, CheckpointOffload<Host, Int8>>;
  using Device8 = Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed, CheckpointOffload<Device, Int8>>;
  const auto host8 = run((Host8*)nullptr, 1);
  expect_bitwise(host8.first, run((Device8*)nullptr, 1).first, "8-bit checkpoints, host or device");
  EXPECT_EQ(host8.second.d2h_bytes - plain.second.d2h_bytes, 5 * engine::ActivationStore::encoded_bytes(4 * 57 * 96));
}

#if defined(SQUEEZE_TORCH_CUDA)
// A streamed model built on the host (as llama_train and bench_table build one) is converted there and cut into pinned
// shards: the device never holds it. The same training as the model moved to the GPU first, bitwise.
TEST(ZeroCuda, StreamedModelBuiltOnTheHostNeverReachesTheDevice) {
  REQUIRE_CUDA();
  const torch::Device dev(torch::kCUDA, 0);
  using St = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, float>>;
  const plan::ModelShape shape{/*vocab=*/1000, /*hidden=*/256, /*layers=*/2, /*heads=*/4, /*kv_heads=*/2, /*ffn=*/512};
  const Data data = make_data(Model::llama, 1, 4, 6);  // tokens below kLlamaShape.vocab: within this vocabulary too
  auto run = [&](bool on_host) {
    torch::manual_seed(1234);
    std::shared_ptr<torch::nn::Module> model = TinyLlama(shape).ptr();
    if (!on_host) model->to(dev);
    train::TrainerOptions o;
    o.device = dev;
    torch::cuda::synchronize();
    const int64_t before = int64_t(c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current);
    c10::cuda::CUDACachingAllocator::resetPeakStats(0);
    auto t = zero_trainer<St>(model, Hyper{}, LocalComm::single(), o);
    const int64_t built = int64_t(c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak) - before;
    if (on_host) EXPECT_LT(built, shape.params() * 2 / 8) << "the device held the model while the trainer was built";
    for (int s = 0; s < 4; ++s) t.step([&] { return model_loss(Model::llama, *model, data.x[s][0].to(dev), data.y[s][0]); });
    Params out;
    for (auto& [n, v] : t.full_parameters()) out[n] = v.to(torch::kCPU, torch::kFloat32);
    return out;
  };
  expect_bitwise(run(true), run(false), "streamed, built on the host vs on the GPU");
}
#endif

// The offload pipeline's norm pass runs on the device (train::sum_squares_tensor on the d2h stream): against a float64
// host sum across chunk borders, deterministic; and the offloaded and device-resident trainers report the same
// first-step norm bitwise (one function for both; after that their AdamW paths differ).
TEST(ZeroCuda, DeviceSumOfSquaresMatchesFloat64) {
  REQUIRE_CUDA();
  torch::manual_seed(8);
  for (int64_t n : {int64_t(1), int64_t(4097), train::kSumSquaresChunk + 13}) {
    for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
      const auto t = (torch::randn({n}) * 3).to(dtype);
      const double ref = t.to(torch::kFloat64).square().sum().item<double>();
      const auto d = t.to(torch::kCUDA);
      const torch::Tensor got = train::sum_squares_tensor(d);
      EXPECT_TRUE(got.is_cuda());
      EXPECT_NEAR(got.item<double>(), ref, 1e-13 * ref) << n << " " << dtype;
      EXPECT_EQ(got.item<double>(), train::sum_squares_tensor(d).item<double>()) << "deterministic";
    }
  }
  const torch::Device dev(torch::kCUDA, 0);
  train::TrainerOptions clip;
  clip.max_grad_norm = 0.05f;  // deferred offload: the norm decides the update
  using S2 = Strategy<Sharded<Stage2>, Precision<bf16, float>>;
  using S2O = Strategy<Sharded<Stage2>, Offload<Host>, Precision<bf16, float>>;
  const auto plain = train<S2>(Model::llama, 1, 2, clip, {}, dev), off = train<S2O>(Model::llama, 1, 2, clip, {}, dev);
  ASSERT_FALSE(plain.log.empty());
  EXPECT_EQ(off.log[0].grad_norm, plain.log[0].grad_norm) << "offloaded vs device-resident norm";
  EXPECT_GT(off.log[0].grad_norm, 0.0f);
}

// Offload<Host> state from a GPU lives in host memory; only what the asynchronous copies touch is pinned (of its
// own, train::pinned_empty, not torch's caching host allocator). Under Precision<bf16, float> the rounded
// parameters travel back in the host gradient copy, so the master and the moments are pageable; under float
// compute the master is the upload's source and pinned. A step through the asynchronous copies trains either way.
template <class S>
void expect_offload_state_placement(bool master_pinned) {
  const torch::Device dev(torch::kCUDA, 0);
  auto model = make_model(Model::llama, squeeze::torch_dtype<typename S::compute_type>());
  model->to(dev);
  const Data data = make_data(Model::llama, 1, 1, 2);
  auto t = zero_trainer<S>(model, Hyper{}, LocalComm::single());
  // the llama model's targets come from x itself: y is an undefined tensor, passed on as it is
  const auto r = t.step([&] { return model_loss(Model::llama, *model, data.x[0][0].to(dev), data.y[0][0]); });
  EXPECT_TRUE(r.applied);
  int checked = 0;
  const auto names = decltype(t)::optimizer_state_names();
  const auto state = t.optimizer_state();
  for (std::size_t p = 0; p < state.size(); ++p)
    for (std::size_t i = 0; i < state[p].size(); ++i)
      if (const auto& x = state[p][i]; x.defined()) {
        ASSERT_TRUE(x.is_cpu()) << "partition " << p << " " << names[i] << " is on " << x.device();
        const bool want_pinned = names[i] == "master" && master_pinned;
        EXPECT_EQ(x.is_pinned(), want_pinned) << "partition " << p << " " << names[i] << " (" << x.numel() << " elements)";
        ++checked;
      }
  EXPECT_GT(checked, 0);
}
TEST(ZeroCuda, OffloadPinsOnlyWhatCrossesPCIe) {
  REQUIRE_CUDA();
  expect_offload_state_placement<Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>>>(/*master_pinned=*/false);
  expect_offload_state_placement<Strategy<Sharded<Stage2>, Offload<Host>>>(/*master_pinned=*/true);
}

// Stage 2 on the GPU: buckets as small as one parameter give the bits of one bucket; LocalComm world 2 over
// one GPU reduces after backward (thread-ranks cannot meet inside the device's backward thread).
TEST(ZeroCuda, Stage2BucketsBitwise) {
  REQUIRE_CUDA();
  const torch::Device dev(torch::kCUDA, 0);
  using S2 = Strategy<Sharded<Stage2>, Accumulate<4>, Precision<bf16, float>>;
  for (int world : {1, 2}) {
    train::TrainerOptions small;
    small.bucket_bytes = 1;
    expect_bitwise(train<S2>(Model::llama, world, 4, small, {}, dev).params, train<S2>(Model::llama, world, 4, {}, {}, dev).params,
                   "GPU Stage2 buckets world " + std::to_string(world));
  }
}

#if defined(SQUEEZE_TORCH_CUDA)
// With TrainerOptions::read_loss off, a micro-batch that ends no window syncs the host not at all and an optimizer
// step once (the gradient norm's overflow and clipping decision: this TU is host-compiled; where nvcc compiles the trainer
// the decision stays on the device, test_device_adamw_cuda); reading the loss adds one per micro-batch.
template <class S>
void expect_syncs(bool read_loss, const std::string& what) {
  const torch::Device dev(torch::kCUDA, 0);
  auto m = make_model(Model::mlp, torch::kFloat32);
  m->to(dev);
  train::TrainerOptions o;
  o.read_loss = read_loss;
  o.replicate = {"*"};  // the MLP's own gain vector stays whole under stage 3 (its Linears are sharded)
  auto trainer = make_trainer<S>(m, AdamW{.lr = 1e-3f, .max_grad_norm = 1.0f}, comm::LocalComm::single(), o);
  const Data data = make_data(Model::mlp, 1, 4, 8);
  std::vector<torch::Tensor> x, y;  // on the device before the steps: a blocking upload is a sync of its own
  for (int s = 0; s < 4; ++s) x.push_back(data.x[s][0].to(dev)), y.push_back(data.y[s][0].to(dev));
  const auto micro = [&](int s) { return trainer.step([&] { return model_loss(Model::mlp, *m, x[s], y[s]); }); };
  micro(0), micro(1);  // a first window: allocations, lazy initialisation
  torch::cuda::synchronize();
  train::StepResult inside, boundary;
  const int inside_syncs = count_host_syncs([&] { inside = micro(2); });
  const int boundary_syncs = count_host_syncs([&] { boundary = micro(3); });
  EXPECT_FALSE(inside.boundary);
  EXPECT_TRUE(boundary.boundary && boundary.applied) << what;
  EXPECT_EQ(inside_syncs, read_loss ? 1 : 0) << what;
  EXPECT_EQ(boundary_syncs, read_loss ? 2 : 1) << what;
  EXPECT_EQ(std::isnan(inside.loss), !read_loss) << what;
  EXPECT_TRUE(inside.loss_value.defined() && inside.loss_value.is_cuda()) << what;
  EXPECT_GT(inside.loss_value.item<float>(), 0.0f) << what;
}

TEST(ZeroCuda, AStepSyncsTheHostOncePerOptimizerStep) {
  REQUIRE_CUDA();
  for (const bool read_loss : {false, true}) {
    const std::string tag = read_loss ? " reading the loss" : "";
    expect_syncs<Strategy<Accumulate<2>, Precision<bf16, float>>>(read_loss, "stage 0" + tag);
    expect_syncs<Strategy<Sharded<Stage2>, Accumulate<2>, Precision<bf16, float>>>(read_loss, "stage 2" + tag);
    expect_syncs<Strategy<Sharded<Stage3>, Accumulate<2>, Precision<bf16, float>>>(read_loss, "stage 3" + tag);
  }
}
#endif

#if defined(SQUEEZE_WITH_NCCL) && SQUEEZE_WITH_NCCL
std::shared_ptr<comm::NcclComm> nccl_world_one() {
  ncclUniqueId id;
  SQUEEZE_NCCL_CHECK(ncclGetUniqueId(&id));
  comm::NcclOptions o;
  o.device = 0;
  return std::make_shared<comm::NcclComm>(0, 1, id, o);
}

// NcclComm takes the asynchronous path of stage 3 (gathers and reduce-scatters on a side stream, the compute
// stream waiting on events) and of stage 2's buckets (reduce-scattered on the same side stream during backward,
// small buckets so that many are in flight); at world size 1 NCCL's collectives are copies, so the bits equal the
// blocking LocalComm path. With Offload<Host> the transfers go through the pipeline's streams as well.
TEST(ZeroCuda, NcclSideStreamStage2Bitwise) {
  REQUIRE_CUDA();
  const torch::Device dev(torch::kCUDA, 0);
  auto nccl = nccl_world_one();
  train::TrainerOptions small;
  small.bucket_bytes = 512;
  using S2 = Strategy<Sharded<Stage2>, Precision<bf16, float>>;
  using S2A = Strategy<Sharded<Stage2>, Accumulate<4>, Precision<bf16, float>>;
  expect_bitwise(train<S2>(Model::llama, 1, 6, small, {}, dev, nccl).params, train<S2>(Model::llama, 1, 6, small, {}, dev).params,
                 "NCCL side-stream Stage2 vs LocalComm");
  expect_bitwise(train<S2A>(Model::llama, 1, 3, small, {}, dev, nccl).params, train<S2A>(Model::llama, 1, 3, small, {}, dev).params,
                 "NCCL side-stream Stage2 acc 4 vs LocalComm");
  gpu_offload_bitwise<Strategy<Sharded<Stage2>, Offload<Host>, Precision<bf16, float>>>("NCCL Stage2+Offload bf16", nccl);
}

TEST(ZeroCuda, NcclSideStreamStage3Bitwise) {
  REQUIRE_CUDA();
  const torch::Device dev(torch::kCUDA, 0);
  auto nccl = nccl_world_one();
  using S3 = Strategy<Sharded<Stage3>, Precision<bf16, float>>;
  using S3A = Strategy<Sharded<Stage3>, Accumulate<4>, Precision<bf16, float>>;
  expect_bitwise(train<S3>(Model::llama, 1, 6, {}, {}, dev, nccl).params, train<S3>(Model::llama, 1, 6, {}, {}, dev).params,
                 "NCCL side-stream Stage3 vs LocalComm");
  expect_bitwise(train<S3A>(Model::llama, 1, 3, {}, {}, dev, nccl).params, train<S3A>(Model::llama, 1, 3, {}, {}, dev).params,
                 "NCCL side-stream Stage3 acc 4 vs LocalComm");
  gpu_offload_bitwise<Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>>>("NCCL Stage3+Offload bf16", nccl);
  // Streamed units over NCCL: the side stream copies each unit in and all-gathers it, and hands its gradient over.
  gpu_offload_bitwise<Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, float>>>("NCCL Stage3+Streamed bf16", nccl);
}

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
