// bench_zero: what Offload<Host> costs and saves on one GPU, and NcclComm against LocalComm at world size 1.
// Trains a LLaMA (default: the tinyllama-1.1b preset, 1.1 B parameters, bf16 compute, fp32 master + Adam
// state) with the ZeRO trainer for a few steps per case and reports peak GPU memory (the caching allocator's
// peak allocated bytes after the warm-up step) and tokens/s, beside the planner's prediction:
//   stage3 bf16                     optimizer state on the GPU, LocalComm            (the peer of every case)
//   stage3 bf16 Offload<Host>       eager: CPU AdamW per layer inside backward (no clipping)
//   stage3 bf16 Offload<Host> clip  deferred: clipping needs the global norm; updates overlap the next forward
//   stage3 bf16 Offload<Host> in order   the same work without overlap (TrainerOptions::overlap_offload = false)
//   stage3 bf16 NcclComm            world 1 through NCCL (side-stream gathers/reductions) instead of LocalComm
//   stage2 bf16 Offload<Host>       gradients in buckets during backward, eager CPU AdamW per bucket
// One GPU; about a minute on an H200 with the defaults.
//   bench_zero --out results.jsonl [--preset tinyllama-1.1b] [--layers N] [--steps 4] [--batch 8] [--seq 1024]
//              [--ckpt N] [--only SUBSTRING] [--smoke]     (--only: the cases whose name contains it, and the peer)
// JSON lines per case: bench "zero", case, time_ms (per optimizer step), tokens_per_s, peak_gpu_bytes,
// planned_gpu_bytes (the planner's peak), actual bytes per category (trainer accounting), peer (the on-GPU
// case), ratio_vs_peer (its time / ours: > 1 faster), memory_ratio_vs_peer (its peak / ours: > 1 smaller),
// device, date, commit.
// --smoke: the "tiny" preset on the CPU for two steps per case (CI: it runs, nothing is measured).
#include <squeeze/comm/local.hpp>
#include <squeeze/nn/llama.hpp>
#include <squeeze/train/trainer.hpp>
#include <squeeze/optim/adamw.hpp>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#if defined(SQUEEZE_TORCH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/cuda.h>
#endif
#if defined(SQUEEZE_WITH_NCCL) && SQUEEZE_WITH_NCCL
#include <squeeze/comm/nccl.hpp>
#endif

using namespace squeeze;

namespace {

struct Args {
  std::string out = "bench_zero.jsonl", preset = "tinyllama-1.1b", only;
  int steps = 4, batch = 8, seq = 1024, layers = 0, ckpt = 0;
  bool smoke = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw Error("bench_zero: " + k + " needs a value");
      return argv[++i];
    };
    if (k == "--out") a.out = next();
    else if (k == "--preset") a.preset = next();
    else if (k == "--steps") a.steps = std::stoi(next());
    else if (k == "--batch") a.batch = std::stoi(next());
    else if (k == "--seq") a.seq = std::stoi(next());
    else if (k == "--layers") a.layers = std::stoi(next());
    else if (k == "--ckpt") a.ckpt = std::stoi(next());
    else if (k == "--only") a.only = next();
    else if (k == "--smoke") a.smoke = true;
    else throw Error("bench_zero: unknown argument " + k + " (see the header of bench_zero.cpp)");
  }
  if (a.smoke) a.preset = "tiny", a.steps = 2, a.batch = 2, a.seq = 32;
  check(a.steps >= 2, "bench_zero: --steps must be >= 2 (the first step is warm-up)");
  check(a.batch >= 1 && a.seq >= 1 && a.layers >= 0 && a.ckpt >= 0, "bench_zero: sizes must be positive");
  return a;
}

std::string env_or(const char* k, const char* fallback) {
  const char* v = std::getenv(k);
  return v && *v ? v : fallback;
}

struct Measured {
  std::string name;
  double ms_per_step = 0, tokens_per_s = 0;
  int64_t peak_bytes = -1, planned_bytes = 0;
  train::MemoryUse actual;
  bool eager = false;
  train::OffloadStats cpu;  // Offload<Host>: the pipeline's host seconds over the timed steps
};

nn::LlamaConfig config_of(const Args& a) {
  auto cfg = nn::LlamaConfig::preset(a.preset);
  if (a.layers > 0) cfg.layers = a.layers;
  return cfg;
}

template <class S>
Measured run_case(const Args& a, torch::Device dev, const std::string& name, comm::CommPtr comm, train::TrainerOptions opt = {},
                  float clip = 0) {
  Measured m;
  m.name = name;
  const auto cfg = config_of(a);
  torch::manual_seed(0);
  nn::Llama model(cfg);
  model->to(dev, torch::kBFloat16);
  model->checkpoint_every = a.ckpt;
  auto trainer = make_trainer<S>(model, squeeze::AdamW{.lr = 1e-4f, .weight_decay = 0.1f, .max_grad_norm = clip}, comm, opt);
  const auto ids = torch::randint(0, cfg.vocab, {a.batch, a.seq + 1}, torch::TensorOptions().dtype(torch::kLong).device(dev));
  const auto x = ids.narrow(1, 0, a.seq), y = ids.narrow(1, 1, a.seq);
  auto sync = [&] {
    trainer.sync();
#if defined(SQUEEZE_TORCH_CUDA)
    if (dev.is_cuda()) torch::cuda::synchronize();
#endif
  };
  trainer.step([&] { return model->loss(x, y); });  // warm-up: allocations, cuBLAS handles, pinned buffers
  sync();
#if defined(SQUEEZE_TORCH_CUDA)
  if (dev.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(dev.index());
#endif
  trainer.reset_offload_stats();
  const auto t0 = std::chrono::steady_clock::now();
  for (int s = 1; s < a.steps; ++s) {
    auto r = trainer.step([&] { return model->loss(x, y); });
    check(std::isfinite(r.loss), "bench_zero: the loss is not finite");
  }
  sync();
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  m.ms_per_step = 1e3 * sec / (a.steps - 1);
  m.tokens_per_s = double(a.batch) * a.seq * (a.steps - 1) / sec;
#if defined(SQUEEZE_TORCH_CUDA)
  if (dev.is_cuda()) m.peak_bytes = c10::cuda::CUDACachingAllocator::getDeviceStats(dev.index()).allocated_bytes[0].peak;
#endif
  const auto rep = trainer.memory_report(cfg.shape(), {a.batch, a.seq});
  m.planned_bytes = rep.predicted.peak().device;
  m.actual = rep.actual;
  m.eager = trainer.updated_during_backward();
  m.cpu = trainer.offload_stats();
  const double per = 1e3 / (a.steps - 1);
  std::cout << "-- " << name << ": " << m.ms_per_step << " ms/step, " << m.tokens_per_s << " tokens/s, peak "
            << m.peak_bytes / 1e9 << " GB (planned " << m.planned_bytes / 1e9 << " GB)"
            << (S::offload_to_host ? (m.eager ? ", updated inside backward" : ", updated after backward") : "") << "\n";
  if (S::offload_to_host)
    std::cout << "   host pipeline per step: waiting for gradient copies " << m.cpu.transfer_wait_s * per << " ms, sums of squares "
              << m.cpu.sum_squares_s * per << " ms, CPU AdamW + upload " << m.cpu.update_s * per << " ms (" << m.cpu.jobs / (a.steps - 1)
              << " partitions)\n";
  std::cout
            << rep.table() << std::flush;
  return m;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  torch::Device dev = torch::kCPU;
#if defined(SQUEEZE_TORCH_CUDA)
  if (!a.smoke && torch::cuda::is_available()) dev = torch::Device(torch::kCUDA, 0);
#endif
  if (!a.smoke && dev.is_cpu()) {
    std::cout << "bench_zero: no CUDA device (or libtorch without CUDA); run with --smoke for a CPU check\n";
    return 0;
  }
  const auto cfg = config_of(a);
  std::cout << "bench_zero: " << a.preset << " (" << cfg.layers << " layers, " << double(cfg.shape().params()) / 1e9
            << " B parameters), batch " << a.batch << " x seq " << a.seq << ", " << a.steps - 1 << " timed steps per case\n";
  using OnGpu = Strategy<Sharded<Stage3>, Precision<bf16, float>>;
  using Off3 = Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>>;
  using Off2 = Strategy<Sharded<Stage2>, Offload<Host>, Precision<bf16, float>>;
  auto want = [&](const std::string& n) { return a.only.empty() || n.find(a.only) != std::string::npos; };
  auto local = [] { return comm::LocalComm::single(); };
  train::TrainerOptions in_order;
  in_order.overlap_offload = false;

  std::vector<Measured> results;
  const Measured peer = run_case<OnGpu>(a, dev, "stage3 bf16", local());  // always: every ratio is against it
  results.push_back(peer);
  const std::string eager = "stage3 bf16 Offload<Host>", clipped = eager + " clip 1.0", ordered = eager + " in order";
  if (want(eager)) results.push_back(run_case<Off3>(a, dev, eager, local()));
  if (want(clipped)) results.push_back(run_case<Off3>(a, dev, clipped, local(), {}, 1.0f));
  if (want(ordered)) results.push_back(run_case<Off3>(a, dev, ordered, local(), in_order));
#if defined(SQUEEZE_WITH_NCCL) && SQUEEZE_WITH_NCCL
  if (dev.is_cuda() && want("stage3 bf16 NcclComm")) {
    ncclUniqueId id;
    SQUEEZE_NCCL_CHECK(ncclGetUniqueId(&id));
    comm::NcclOptions o;
    o.device = dev.index();
    results.push_back(run_case<OnGpu>(a, dev, "stage3 bf16 NcclComm", std::make_shared<comm::NcclComm>(0, 1, id, o)));
  }
#endif
  if (want("stage2 bf16 Offload<Host>")) results.push_back(run_case<Off2>(a, dev, "stage2 bf16 Offload<Host>", local()));
  if (a.smoke) return 0;

  std::ofstream out(a.out, std::ios::app);
  std::printf("\n%-40s %10s %12s %10s %10s %9s %9s %10s\n", "case", "ms/step", "tokens/s", "peak GB", "plan GB", "speed", "memory",
              "CPU ms");
  for (const auto& m : results) {
    const bool is_peer = &m == &results.front();
    const auto& u = m.actual;
    char buf[2048];
    std::snprintf(buf, sizeof buf,
                  "{\"bench\":\"zero\",\"case\":\"%s %s b%d s%d\",\"time_ms\":%.3f,\"tokens_per_s\":%.1f,"
                  "\"peak_gpu_bytes\":%lld,\"planned_gpu_bytes\":%lld,\"updated_inside_backward\":%s,"
                  "\"actual\":{\"parameters\":[%lld,%lld],\"gradients\":[%lld,%lld],\"master_weights\":[%lld,%lld],"
                  "\"optimizer_state\":[%lld,%lld],\"communication\":[%lld,%lld],\"peak_gradient_bytes\":%lld},"
                  "\"host_ms_per_step\":{\"transfer_wait\":%.1f,\"sum_squares\":%.1f,\"adamw_upload\":%.1f},"
                  "\"peer\":\"%s\",\"ratio_vs_peer\":%.4f,\"memory_ratio_vs_peer\":%.4f,\"roofline_fraction\":null,"
                  "\"device\":\"%s\",\"date\":\"%s\",\"commit\":\"%s\"}",
                  a.preset.c_str(), m.name.c_str(), a.batch, a.seq, m.ms_per_step, m.tokens_per_s, (long long)m.peak_bytes,
                  (long long)m.planned_bytes, m.eager ? "true" : "false", (long long)u.parameters.device,
                  (long long)u.parameters.host, (long long)u.gradients.device, (long long)u.gradients.host,
                  (long long)u.master_weights.device, (long long)u.master_weights.host, (long long)u.optimizer_state.device,
                  (long long)u.optimizer_state.host, (long long)u.communication.device, (long long)u.communication.host,
                  (long long)u.peak_gradient_bytes, m.cpu.transfer_wait_s * 1e3 / (a.steps - 1),
                  m.cpu.sum_squares_s * 1e3 / (a.steps - 1), m.cpu.update_s * 1e3 / (a.steps - 1), is_peer ? "itself" : peer.name.c_str(), peer.ms_per_step / m.ms_per_step,
                  double(peer.peak_bytes) / double(m.peak_bytes), env_or("SQUEEZE_DEVICE", "unknown").c_str(),
                  env_or("SQUEEZE_DATE", "").c_str(), env_or("SQUEEZE_COMMIT", "unknown").c_str());
    out << buf << "\n";
    std::printf("%-40s %10.1f %12.0f %10.2f %10.2f %8.2fx %8.2fx %10.1f\n", m.name.c_str(), m.ms_per_step, m.tokens_per_s,
                m.peak_bytes / 1e9, m.planned_bytes / 1e9, peer.ms_per_step / m.ms_per_step,
                double(peer.peak_bytes) / double(m.peak_bytes),
                (m.cpu.sum_squares_s + m.cpu.update_s) * 1e3 / (a.steps - 1));
  }
  std::printf("(speed, memory: the peer's time / ours and its peak / ours; > 1 = faster / smaller; CPU ms: the offload\n"
              " pipeline's sums of squares + AdamW per step, on the worker thread beside the GPU)\n");
  return 0;
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 1;
}
