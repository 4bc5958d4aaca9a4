// bench_zero: what Offload<Host> costs and saves on one GPU. Trains a LLaMA (default tinyllama-1.1b,
// bf16 compute, fp32 master + Adam state) for a few steps with the ZeRO trainer at world size 1, with the
// optimizer state on the GPU and in pinned host memory (CPU AdamW), and reports peak GPU memory (the
// caching allocator's peak allocated bytes) and tokens/s, beside the planner's prediction.
//   bench_zero --out results.jsonl [--preset tinyllama-1.1b] [--steps 6] [--batch 4] [--seq 512] [--smoke]
// JSON lines per case: bench, case, time_ms (per optimizer step), tokens_per_s, peak_gpu_bytes,
// planned_gpu_bytes, peer (the no-offload case), ratio_vs_peer (its time / ours: > 1 faster),
// memory_ratio_vs_peer (its peak / ours: > 1 smaller), device, date, commit.
// --smoke: the "tiny" preset on the CPU for two steps (CI: it runs, nothing is measured).
#include <squeeze/comm/local.hpp>
#include <squeeze/nn/llama.hpp>
#include <squeeze/nn/trainer.hpp>
#include <squeeze/optim/adamw.hpp>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

#if defined(SQUEEZE_TORCH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/cuda.h>
#endif

using namespace squeeze;

namespace {

struct Args {
  std::string out = "bench_zero.jsonl", preset = "tinyllama-1.1b";
  int steps = 6, batch = 4, seq = 512;
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
    else if (k == "--smoke") a.smoke = true;
    else throw Error("bench_zero: unknown argument " + k + " (see the header of bench_zero.cpp)");
  }
  if (a.smoke) a.preset = "tiny", a.steps = 2, a.batch = 2, a.seq = 32;
  check(a.steps >= 2, "bench_zero: --steps must be >= 2 (the first step is warm-up)");
  return a;
}

std::string env_or(const char* k, const char* fallback) {
  const char* v = std::getenv(k);
  return v && *v ? v : fallback;
}

struct Measured {
  double ms_per_step = 0, tokens_per_s = 0;
  int64_t peak_bytes = -1, planned_bytes = 0;
};

template <class S>
Measured run_case(const Args& a, torch::Device dev) {
  auto cfg = nn::LlamaConfig::preset(a.preset);
  torch::manual_seed(0);
  nn::Llama model(cfg);
  model->to(dev, torch::kBFloat16);
  auto trainer = make_trainer<S>(model, squeeze::AdamW{.lr = 1e-4f, .weight_decay = 0.1f}, comm::LocalComm::single());
  const auto ids = torch::randint(0, cfg.vocab, {a.batch, a.seq + 1}, torch::TensorOptions().dtype(torch::kLong).device(dev));
  const auto x = ids.narrow(1, 0, a.seq), y = ids.narrow(1, 1, a.seq);
  auto sync = [&] {
#if defined(SQUEEZE_TORCH_CUDA)
    if (dev.is_cuda()) torch::cuda::synchronize();
#endif
  };
  trainer.step([&] { return model->loss(x, y); });  // warm-up: allocations, cuBLAS handles
  sync();
#if defined(SQUEEZE_TORCH_CUDA)
  if (dev.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(dev.index());
#endif
  const auto t0 = std::chrono::steady_clock::now();
  for (int s = 1; s < a.steps; ++s) {
    auto r = trainer.step([&] { return model->loss(x, y); });
    check(std::isfinite(r.loss), "bench_zero: the loss is not finite");
  }
  sync();
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Measured m;
  m.ms_per_step = 1e3 * sec / (a.steps - 1);
  m.tokens_per_s = double(a.batch) * a.seq * (a.steps - 1) / sec;
#if defined(SQUEEZE_TORCH_CUDA)
  if (dev.is_cuda()) m.peak_bytes = c10::cuda::CUDACachingAllocator::getDeviceStats(dev.index()).allocated_bytes[0].peak;
#endif
  const auto rep = trainer.memory_report(cfg.shape(), {a.batch, a.seq});
  m.planned_bytes = rep.predicted.total().device;
  std::cout << a.preset << (S::offload_to_host ? " offload" : " on-GPU ") << ": " << m.ms_per_step << " ms/step, "
            << m.tokens_per_s << " tokens/s, peak " << m.peak_bytes / 1e9 << " GB (planned " << m.planned_bytes / 1e9
            << " GB)\n"
            << rep.table();
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
  using OnGpu = Strategy<Sharded<Stage1>, Precision<bf16, float>>;
  using Offloaded = Strategy<Sharded<Stage1>, Offload<Host>, Precision<bf16, float>>;
  const Measured peer = run_case<OnGpu>(a, dev);
  const Measured off = run_case<Offloaded>(a, dev);
  if (a.smoke) return 0;
  std::ofstream out(a.out, std::ios::app);
  auto line = [&](const std::string& name, const Measured& m, bool is_offload) {
    char buf[1024];
    std::snprintf(buf, sizeof buf,
                  "{\"bench\":\"zero_offload\",\"case\":\"%s %s b%d s%d\",\"time_ms\":%.3f,\"tokens_per_s\":%.1f,"
                  "\"peak_gpu_bytes\":%lld,\"planned_gpu_bytes\":%lld,\"peer\":\"%s\",\"ratio_vs_peer\":%.4f,"
                  "\"memory_ratio_vs_peer\":%.4f,\"roofline_fraction\":null,\"device\":\"%s\",\"date\":\"%s\",\"commit\":\"%s\"}",
                  a.preset.c_str(), name.c_str(), a.batch, a.seq, m.ms_per_step, m.tokens_per_s, (long long)m.peak_bytes,
                  (long long)m.planned_bytes, is_offload ? "stage1 bf16 optimizer on GPU" : "itself",
                  peer.ms_per_step / m.ms_per_step, double(peer.peak_bytes) / double(m.peak_bytes),
                  env_or("SQUEEZE_DEVICE", "unknown").c_str(), env_or("SQUEEZE_DATE", "").c_str(),
                  env_or("SQUEEZE_COMMIT", "unknown").c_str());
    out << buf << "\n";
  };
  line("stage1 bf16 optimizer on GPU", peer, false);
  line("stage1 bf16 Offload<Host>", off, true);
  return 0;
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 1;
}
