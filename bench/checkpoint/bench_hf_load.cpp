// A Hugging Face LLaMA directory into the LLaMA example's trainer (llama::LlamaRun<S>::from_hf: the model built
// uninitialised in the compute dtype on the device, then each checkpoint tensor streamed into the trainer's shards and
// fp32 masters): seconds (split into building the trainer and streaming the file; the stream's reads overlap its
// writes), the share of the files in the page cache beforehand, GB/s over the checkpoint's bytes, peak host memory
// against the trainer's own state plus one shard file, then one training step (its loss) and a spot check that a
// parameter holds the file's bits.
//   bench_hf_load --hf DIR --out FILE.jsonl [--strategy zero3-offload-bf16-ckpt] [--batch 8] [--seq 2048] [--device cuda]
// The row is one JSON line (commit and date from SQUEEZE_COMMIT / SQUEEZE_DATE). Make DIR with
// tools/make_hf_fixtures.py OUT --llama-7b.
#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include "named_strategy.hpp"
#include "trainer.hpp"

namespace {

using namespace squeeze;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string hf, out, strategy = "zero3-offload-bf16-ckpt", device = "cuda";
  int64_t batch = 8, seq = 2048;
};

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
void reset_host_peak() { std::ofstream("/proc/self/clear_refs") << "5"; }

// Bytes the trainer keeps in host memory (Offload<Host>: masters, moments, the host gradient copies), as it counts them.
template <class T>
double host_state_gb(const T& trainer) {
  const train::MemoryUse m = trainer.memory();
  const plan::Placement p = m.model_state();
  return double(p.host + m.communication.host) / 1e9;
}

// The fraction of a file's pages in the page cache (mincore over a mapping of it): a load from a warm cache and
// one from the drive are different measurements, so each row says which it was.
double cached_fraction(const std::filesystem::path& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  const size_t size = std::filesystem::file_size(file), page = size_t(::sysconf(_SC_PAGESIZE));
  void* map = size ? ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
  ::close(fd);
  if (map == MAP_FAILED) return -1;
  std::vector<unsigned char> resident((size + page - 1) / page);
  const bool ok = ::mincore(map, size, resident.data()) == 0;
  ::munmap(map, size);
  if (!ok) return -1;
  return double(std::count_if(resident.begin(), resident.end(), [](unsigned char r) { return r & 1; })) / double(resident.size());
}

template <StrategyType S>
nlohmann::json run(const Options& o) {
  const torch::Device device(o.device);
  const io::SafetensorsCheckpoint ckpt = io::SafetensorsCheckpoint::open(o.hf);
  uint64_t checkpoint_bytes = 0, largest_shard = 0;
  double cached_bytes = 0;
  for (const auto& f : ckpt.files()) {
    const uint64_t n = std::filesystem::file_size(std::filesystem::path(o.hf) / f);
    checkpoint_bytes += n, largest_shard = std::max(largest_shard, n);
    cached_bytes += std::max(0.0, cached_fraction(std::filesystem::path(o.hf) / f)) * double(n);
  }
  llama::TrainOptions topt;
  topt.clip = 0;  // as the table's 7B rows: the eager offload pipeline
  topt.lr = 1e-5;

  reset_host_peak();
  const double host_before = llama::device_memory(torch::kCPU).current_gb;
  llama::reset_peak_memory(device);
  const auto t0 = Clock::now();
  nn::HfLoadProgress streamed;  // the last report: where the streaming part of the time went
  double last_line = 0;
  const auto progress = [&](const nn::HfLoadProgress& p) {
    streamed = p;
    if (p.seconds - last_line < 5 && p.tensors != p.tensors_total) return;
    last_line = p.seconds;
    std::fprintf(stderr, "bench_hf_load: %zu/%zu tensors, %.2f GB in %.1f s (read %.1f s, write %.1f s)\n", p.tensors, p.tensors_total,
                 double(p.bytes) / 1e9, p.seconds, p.read_s, p.write_s);
  };
  llama::LlamaRun<S> t = llama::LlamaRun<S>::from_hf(o.hf, topt, device, nullptr, progress);
  t.sync();
  const double load_s = seconds_since(t0);
  const double host_peak = llama::device_memory(torch::kCPU).peak_gb;
  const double device_peak = llama::device_memory(device).peak_gb;
  const double state_gb = host_state_gb(t.trainer());

  // The file's bits in the trainer: the first block's down projection, gathered, against the tensor read directly.
  const std::string hf_name = "model.layers.0.mlp.down_proj.weight";
  const io::CheckpointTensor& info = ckpt.info(hf_name);
  torch::Tensor file = torch::empty(info.shape, torch::TensorOptions().dtype(nn::torch_dtype_of(info.dtype)));
  ckpt.read_bytes(hf_name, {reinterpret_cast<std::byte*>(file.data_ptr()), size_t(file.nbytes())});
  const torch::Tensor held = t.trainer().gather_parameter("block0.mlp.down.weight").cpu();
  t.trainer().release_gathered();
  const bool bits_match = torch::equal(held, file.to(held.scalar_type()));

  const nn::LlamaConfig& config = t.model()->config;
  torch::manual_seed(1);
  const auto tokens = torch::randint(config.vocab, {o.batch, o.seq + 1}, torch::TensorOptions().dtype(torch::kLong)).to(device);
  const torch::Tensor x = tokens.narrow(1, 0, o.seq), y = tokens.narrow(1, 1, o.seq);  // [B, T]
  const auto ts = Clock::now();
  const double loss = t.step(x, y).loss;
  t.sync();
  const double step_s = seconds_since(ts);
  // The offloaded moments are resident only once the first update has touched them (train::host_zeros): the
  // peak after that step is the one the budget is held to.
  const double host_peak_step = llama::device_memory(torch::kCPU).peak_gb;

  // Target: host peak within the trainer's own state + one shard file (+ the process before loading).
  const double host_budget = host_before + state_gb + double(largest_shard) / 1e9;
  const char* commit = std::getenv("SQUEEZE_COMMIT");
  const char* date = std::getenv("SQUEEZE_DATE");
  return {{"bench", "hf_load"}, {"case", o.strategy + "/" + std::filesystem::path(o.hf).filename().string()},
          {"strategy", strategy_name<S>()}, {"params", config.shape().params()}, {"checkpoint_gb", double(checkpoint_bytes) / 1e9},
          {"largest_shard_gb", double(largest_shard) / 1e9}, {"page_cached_before", cached_bytes / double(checkpoint_bytes)}, {"load_s", load_s}, {"load_GBps", double(checkpoint_bytes) / 1e9 / load_s},
          {"build_s", load_s - streamed.seconds}, {"stream_s", streamed.seconds}, {"read_s", streamed.read_s}, {"write_s", streamed.write_s},
          {"host_before_gb", host_before}, {"host_peak_gb", host_peak}, {"host_peak_after_step_gb", host_peak_step}, {"host_state_gb", state_gb},
          {"host_budget_gb", host_budget}, {"host_within_budget", std::max(host_peak, host_peak_step) <= host_budget}, {"device_peak_gb", device_peak}, {"target_s", 30.0},
          {"within_target_s", load_s <= 30.0}, {"bits_match_file", bits_match}, {"first_step_loss", loss}, {"first_step_s", step_s},
          {"batch", o.batch}, {"seq", o.seq}, {"commit", commit ? commit : "unknown"}, {"date", date ? date : ""}};
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"squeeze: a Hugging Face LLaMA into a trainer (time, host peak, first step)"};
  app.add_option("--hf", o.hf, "Hugging Face LLaMA directory (config.json + safetensors)")->required()->check(CLI::ExistingDirectory);
  app.add_option("--out", o.out, "append the JSON line here")->required();
  app.add_option("--strategy", o.strategy, bench::kBenchStrategies)->capture_default_str();
  app.add_option("--batch", o.batch, "sequences of the step after loading")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seq", o.seq)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--device", o.device)->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  return bench::append_named_strategy_row("bench_hf_load", o.strategy, o.out, [&]<class S>() { return run<S>(o); });
}
