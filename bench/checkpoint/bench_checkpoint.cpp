// Save and load of a training checkpoint through save_checkpoint / load_checkpoint (train/checkpoint.hpp) on the
// LLaMA example's trainer: train --steps steps, save (seconds, bytes on disk, extra device and host memory), take one
// more step (its loss), load the checkpoint back, take the same step again: its loss must be the same bits.
//   bench_checkpoint --out FILE.jsonl --dir CKPT_ROOT [--preset tinyllama-1.1b] [--strategy zero3-offload-bf16-ckpt]
//                    [--batch 8] [--seq 2048] [--steps 2] [--bound-gb 4] [--device cuda]
// Beside the save's GB/s it measures the two rates a save streams against on this machine (write + fsync, SHA-256).
// The row is one JSON line (commit and date from SQUEEZE_COMMIT / SQUEEZE_DATE).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include "named_strategy.hpp"
#include "trainer.hpp"
#include "squeeze/io/posix_file.hpp"

namespace {

using namespace squeeze;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string out, dir, preset = "tinyllama-1.1b", strategy = "zero3-offload-bf16-ckpt", device = "cuda";
  int64_t batch = 8, seq = 2048, steps = 2;
  double bound_gb = 4;
};

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Peak resident host memory since the last reset_host_peak() (VmHWM), in bytes.
double host_peak_gb() { return llama::device_memory(torch::kCPU).peak_gb; }
void reset_host_peak() { std::ofstream("/proc/self/clear_refs") << "5"; }

// The bounds a save streams against, measured on this machine in the same run: one stream of buffered writes
// ending in fsync (the checkpoint's file system), and SHA-256 over host memory (OpenSSL, one thread).
struct Bounds {
  double write_GBps = 0, sha256_GBps = 0;
};
Bounds measure_bounds(const std::filesystem::path& dir, uint64_t bytes) {
  constexpr size_t kChunk = size_t(8) << 20;
  std::vector<std::byte> buf(kChunk);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = std::byte((i * 2654435761u) >> 13);
  std::filesystem::create_directories(dir);
  const auto path = dir / "write-bound.bin";
  auto t0 = Clock::now();
  {
    io::PosixFile f = io::PosixFile::create(path);
    for (uint64_t at = 0; at < bytes; at += kChunk) f.write_all(buf);
    f.sync();
  }
  Bounds b;
  b.write_GBps = double(bytes) / 1e9 / seconds_since(t0);
  std::filesystem::remove(path);
  io::Sha256 h;
  t0 = Clock::now();
  for (uint64_t at = 0; at < bytes; at += kChunk) h.update(buf);
  (void)h.hex();
  b.sha256_GBps = double(bytes) / 1e9 / seconds_since(t0);
  return b;
}

uint64_t bytes_under(const std::filesystem::path& p) {
  uint64_t n = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(p))
    if (e.is_regular_file()) n += e.file_size();
  return n;
}

template <StrategyType S>
nlohmann::json run(const Options& o) {
  const torch::Device device(o.device);
  const nn::LlamaConfig config = nn::LlamaConfig::preset(o.preset);
  llama::TrainOptions topt;
  topt.clip = 0;  // as the table's 7B rows: the eager offload pipeline
  topt.lr = 1e-5;
  torch::manual_seed(1);
  llama::LlamaRun<S> t(config, topt, device, nullptr);
  const auto tokens = torch::randint(config.vocab, {o.batch, o.seq + 1}, torch::TensorOptions().dtype(torch::kLong)).to(device);
  const torch::Tensor x = tokens.narrow(1, 0, o.seq), y = tokens.narrow(1, 1, o.seq);  // [B, T]
  for (int64_t s = 0; s < o.steps; ++s) t.step(x, y);
  t.sync();
  squeeze::io::remove_tree(o.dir);

  const Bounds bound = measure_bounds(o.dir + ".bound", uint64_t(o.bound_gb * 1e9));
  squeeze::io::remove_tree(o.dir + ".bound");

  const double dev_before = llama::device_memory(device).current_gb;
  llama::reset_peak_memory(device);
  reset_host_peak();
  const double host_before = llama::device_memory(torch::kCPU).current_gb;
  auto t0 = Clock::now();
  t.save(o.dir);
  const double save_s = seconds_since(t0);
  const double save_dev_extra = llama::device_memory(device).peak_gb - dev_before, save_host_extra = host_peak_gb() - host_before;
  const uint64_t bytes = bytes_under(o.dir);

  const double next = t.step(x, y).loss;  // the uninterrupted run's next step
  t.sync();
  const double dev_before_load = llama::device_memory(device).current_gb;
  llama::reset_peak_memory(device);
  reset_host_peak();
  const double host_before_load = llama::device_memory(torch::kCPU).current_gb;
  t0 = Clock::now();
  t.load(o.dir);
  const double load_s = seconds_since(t0);
  const double load_dev_extra = llama::device_memory(device).peak_gb - dev_before_load, load_host_extra = host_peak_gb() - host_before_load;
  const double resumed = t.step(x, y).loss;

  const char* commit = std::getenv("SQUEEZE_COMMIT");
  const char* date = std::getenv("SQUEEZE_DATE");
  return {{"bench", "checkpoint"}, {"case", o.strategy + "/" + o.preset}, {"strategy", strategy_name<S>()}, {"batch", o.batch},
          {"seq", o.seq}, {"steps", o.steps}, {"checkpoint_gb", double(bytes) / 1e9}, {"save_s", save_s}, {"load_s", load_s},
          {"save_GBps", double(bytes) / 1e9 / save_s}, {"load_GBps", double(bytes) / 1e9 / load_s},
          {"write_bound_GBps", bound.write_GBps}, {"sha256_GBps", bound.sha256_GBps},
          {"save_vs_bound", double(bytes) / 1e9 / save_s / std::min(bound.write_GBps, bound.sha256_GBps)},
          {"save_extra_device_gb", save_dev_extra}, {"load_extra_device_gb", load_dev_extra},
          {"save_extra_host_gb", save_host_extra}, {"load_extra_host_gb", load_host_extra},
          {"layer_fp32_gb", double(config.shape().params() / config.layers) * 4 / 1e9},
          {"next_loss", next}, {"resumed_loss", resumed}, {"resume_bitwise", next == resumed},
          {"commit", commit ? commit : "unknown"}, {"date", date ? date : ""}};
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"squeeze checkpoint save/load: time, bytes, extra memory, and the step after resuming"};
  app.add_option("--out", o.out, "append the JSON line here")->required();
  app.add_option("--dir", o.dir, "checkpoint root to write (removed first)")->required();
  app.add_option("--preset", o.preset)->check(CLI::IsMember(nn::LlamaConfig::preset_names()))->capture_default_str();
  app.add_option("--strategy", o.strategy, bench::kBenchStrategies)->capture_default_str();
  app.add_option("--batch", o.batch)->capture_default_str();
  app.add_option("--seq", o.seq)->capture_default_str();
  app.add_option("--steps", o.steps, "optimizer steps before the save")->capture_default_str();
  app.add_option("--bound-gb", o.bound_gb, "GB written and hashed to measure the save's bounds")->capture_default_str();
  app.add_option("--device", o.device)->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  return bench::append_named_strategy_row("bench_checkpoint", o.strategy, o.out, [&]<class S>() { return run<S>(o); });
}
