#pragma once
// The strategy table: LLaMA training at TinyLlama-1.1B geometry (B=8, T=2048 by default) under each strategy
// compiled into the LLaMA example, beside a plain-libtorch peer (the same model, float weights, bf16 autocast,
// torch AdamW) measured in the same run. Every row starts from the same weights (seed 1) and trains on the
// same batches of the same corpus (the KJV when Debian's bible-kjv is installed, --corpus FILE, or the
// example's built-in text), then evaluates the same validation windows. With --hf DIR every row starts from that
// Hugging Face LLaMA directory instead (a trained base, e.g. llama_train --export-hf): the rows then fine-tune it and
// the perplexity column compares them (from random weights a few steps leave it near the vocabulary size). Per row:
//   peak_gb       the CUDA caching allocator's peak of allocated bytes, reset before the row is built (so it
//                 covers construction and every step) and read after the last training step
//   planned_gb    the planner's peak for the strategy and geometry (plan_for<S>(...).peak(): no measurement
//                 goes into it); for a quantized base built block by block, the build's planned peak where it is
//                 higher (nn::layerwise_memory; also as planned_build_gb); plan_ratio = peak_gb / planned_gb
//   time_ms, iters_per_s, tokens_per_s   over the timed steps (after --warmup untimed ones)
//   val_ppl       validation perplexity (per token = per byte) after warmup + steps optimizer steps
//   tokens_per_s_per_gpu, mfu   tokens/s of one GPU, and model FLOPs utilisation: flops_per_token x
//                 tokens_per_s_per_gpu / 989 TFLOP/s (the dense bf16 peak of an H100 SXM or an H200, whatever the row's precision), with
//                 flops_per_token = 6·N + 12·L·T·d: N the parameters that enter a matmul (all but the token-embedding
//                 table, a lookup; the head is untied), L layers, T = --seq, d = hidden size; 6·N is forward +
//                 backward of the weight matmuls, 12·L·T·d the attention products QKᵀ and AV (not halved for
//                 causality), as torchtitan and PaLM count. Recomputation (checkpointing) is not model FLOPs.
// A row that runs out of memory is recorded as such and the table goes on (at world size 1; see below).
//
// Several GPUs: launched torchrun-style (one process per GPU; WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT), each rank trains on cuda:LOCAL_RANK with an NcclComm (NCCL watchdog timeout --comm-timeout).
// --batch is per GPU: rank r trains on rows [r·B, (r+1)·B) of the B·world windows drawn from (--seed, step), so
// the global batch does not depend on how it is split. Every rank evaluates the same validation windows (stage 3
// gathers are collectives). peak_gb is the largest over the ranks, time_ms the slowest rank's, final_loss the
// mean; planned_gb is plan_for<S>(config, B, T, world); tokens_per_s counts every GPU. Every strategy trains
// data-parallel (make_trainer); the plain-libtorch peer is skipped at world > 1.
// A row that fails on some rank ends the run at world > 1 (the others may be inside a collective it will never
// join; they stop when the launcher sees this rank exit, or at their watchdog timeout): run one row per launch.
// torchrun shares its own TCP store on MASTER_PORT with its workers, and rank 0 here hosts another one there:
// launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (then MASTER_PORT is a free port).
//
//   bench_table --out table.jsonl [--csv table.csv] [--preset tinyllama-1.1b] [--batch 8] [--seq 2048]
//               [--rows fp32,bf16,bf16-ckpt:1,...]     (NAME:B runs that row with batch B)
//   bench_table --out ft.jsonl --hf BASE_DIR --lr 3e-4 --corpus nt.txt --seq 256 --batch 32     (fine-tuning a base)
//   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 NCCL_NVLS_ENABLE=0 python3 -m torch.distributed.run --standalone
//       --nproc_per_node 2 --no-python bench_table --rows zero3-bf16 --out scale.jsonl     (B = 8 per GPU)
//
// The strategy rows' loss runs over chunks of --loss-chunk tokens (nn::LlamaImpl::loss_chunk_tokens; the planner
// is given the same); the peer's is unchunked. Each block's MLP runs over tiles of --mlp-tile tokens
// (nn::LlamaImpl::mlp_tile_tokens; "auto", the default: plan::pick_mlp_tile's for the GPU's memory, untiled where the
// step fits without; the planner is given the same and the row's JSON says it as mlp_tile).
//
// JSON lines: bench "table", case, strategy, world, batch (per GPU), seq, loss_chunk, peak_gb, reserved_gb, planned_gb, planned_build_gb,
// plan_ratio, build_s, time_ms, iters_per_s, tokens_per_s, tokens_per_s_per_gpu, flops_per_token, mfu, val_loss, val_ppl,
// final_loss, losses (rank 0's training loss per step, warm-up included), host_{wait,sumsq,update}_ms
// (Offload<Host> rows: the CPU pipeline's time per step), gradient_buffers (stages 0-1: when the full gradient buffer
// existed, the planner's choice for the shape: plan::GradientBuffers), ratio_vs_peer (tokens/s over the
// peer's: > 1 is faster), mem_ratio_vs_peer (peer's peak over ours: > 1 is smaller), claimed_* (the widely
// shared LLaMA-7B figures, at that geometry), oom / error, device, date, commit (SQUEEZE_DEVICE /
// SQUEEZE_DATE / SQUEEZE_COMMIT). The CSV has one line per row; bench/table/chart.py draws the PNG from it.
//
// On a CUDA libtorch build (SQUEEZE_TORCH_CUDA) this file is compiled by nvcc, so the qlora row's NF4 layers
// run their CUDA kernels (nn/lora.hpp); elsewhere it is a host translation unit (CPU smoke runs). World size > 1
// needs NCCL (SQUEEZE_WITH_NCCL, set by CMake where CUDA and NCCL are found).
// This header: the table's options, rows and step loop; each strategy row is run by run_strategy_part (table_rows.hpp),
// compiled for a share of the example's strategies in each of SQUEEZE_TABLE_PARTS translation units.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>

#include <squeeze/comm/env.hpp>
#include <squeeze/policy/strategy_name.hpp>
#if defined(SQUEEZE_WITH_NCCL) && SQUEEZE_WITH_NCCL
#include <squeeze/comm/nccl.hpp>
#endif
#if defined(SQUEEZE_TORCH_CUDA)
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "../step_profile.hpp"
#include "data.hpp"
#include "trainer.hpp"

namespace squeeze::table {

constexpr const char* kPeer = "libtorch-autocast-bf16";

// NVIDIA's H100 SXM and H200 datasheets: 1,979 TFLOP/s of bf16 tensor-core math with 2:4 sparsity, so 989 TFLOP/s
// dense on either. MFU is measured against it for every row (fp32 rows too), as is usual.
constexpr double kHopperDenseBf16Flops = 989e12;

struct Options {
  std::string out, csv, preset = "tinyllama-1.1b", device = "cuda", rows, corpus;
  std::string hf;  // a Hugging Face LLaMA directory every row starts from (its config replaces the preset)
  int64_t batch = 8, seq = 2048, steps = 3, warmup = 2, layers = 0, eval_seqs = 8, threads = 0, lr_warmup = 0;
  int64_t profile_steps = 0;  // steps under the profiler after everything measured (a row's "profile": where the time goes)
  int64_t loss_chunk = llama::TrainOptions{}.loss_chunk_tokens;  // the strategy rows' (the peer never chunks)
  bool fused_loss = false;                                       // the strategy rows' loss fused (nn::fused_linear_cross_entropy)
  bool deferred_loss = false;        // the timed steps' losses read after the clock stops: no loss read-back syncs a step
  std::string mlp_tile = "auto";     // tokens per MLP tile, or the planner's choice
  bool gather_layers_alone = false;  // stage-3 rows: every linear its own gather unit
  double lr = 3e-4, clip = 1.0, loss_scale = 1024, comm_timeout_s = 600;
  double gpu_gb = 0;  // > 0: the GPU acts as one of this many GB (allocator capped, "auto" tiles planned for it)
  uint64_t seed = 1337;
};

// The GPU memory the rows may use: the device's, or --gpu-gb's where that is less (a figure for an 80 GB card measured
// on a larger one); unset off CUDA.
inline std::optional<int64_t> usable_gpu_bytes(const Options& o, const torch::Device& device) {
  const std::optional<int64_t> total = engine::device_memory_total(device);
  if (!total || o.gpu_gb <= 0) return total;
  return std::min<int64_t>(*total, int64_t(o.gpu_gb * 1e9));
}

// --gpu-gb: libtorch's caching allocator refuses what goes past it, as the smaller card would (an out-of-memory row).
inline void cap_gpu_memory(const Options& o, const torch::Device& device) {
  const std::optional<int64_t> total = engine::device_memory_total(device);
  if (!total || o.gpu_gb <= 0 || o.gpu_gb * 1e9 >= double(*total)) return;  // usable_gpu_bytes is the whole device
#if defined(SQUEEZE_TORCH_CUDA)
  (void)torch::empty({1}, torch::TensorOptions().device(device));  // the allocator exists from the device's first allocation
  c10::cuda::CUDACachingAllocator::setMemoryFraction(o.gpu_gb * 1e9 / double(*total), device.has_index() ? device.index() : 0);
#endif
}

// The MLP tile of strategy S's rows (--mlp-tile): a number of tokens as given, or under "auto" plan::pick_mlp_tile's for
// this rank's usable_gpu_bytes (untiled on the CPU, or where the step fits untiled).
template <StrategyType S>
int64_t mlp_tile_for(const Options& o, const nn::LlamaConfig& config, int64_t batch, int world, const torch::Device& device,
                     int64_t loss_chunk) {
  if (o.mlp_tile != "auto") return std::stoll(o.mlp_tile);
  const std::optional<int64_t> total = usable_gpu_bytes(o, device);
  if (!total) return 0;
  return plan::pick_mlp_tile<S>(config.shape(), llama::train_shape<S>(config, batch, o.seq, world, loss_chunk, {}), world, *total);
}

// This process's place in the run: one process per GPU, from the torchrun-style environment.
struct Dist {
  int rank = 0, world = 1, local_rank = 0;
  comm::CommPtr comm;  // NcclComm at world > 1; null at world 1 (each trainer keeps its own one-rank LocalComm)
  bool root() const { return rank == 0; }
};

inline Dist from_env() {
  const comm::DistEnv env = comm::DistEnv::from_environment();  // checks every variable
  return {env.rank, env.world, env.local_rank, nullptr};
}

// World > 1: joins the other ranks (NcclComm::from_env: rank 0 hosts the store at MASTER_ADDR:MASTER_PORT).
inline void connect(Dist& d, const Options& o) {
  if (d.world == 1) return;
  check(o.device == "cuda", "WORLD_SIZE=" + std::to_string(d.world) + " trains one rank per GPU: --device cuda");
#if defined(SQUEEZE_WITH_NCCL) && SQUEEZE_WITH_NCCL
  comm::NcclOptions no;
  no.timeout = std::chrono::milliseconds(int64_t(o.comm_timeout_s * 1e3));  // a collective some rank never joins
  no.device = d.local_rank;
  d.comm = comm::NcclComm::from_env(no);
#if defined(SQUEEZE_TORCH_CUDA)
  c10::cuda::set_device(c10::DeviceIndex(d.local_rank));  // libtorch's current device (streams, allocator)
#endif
#else
  throw Error("WORLD_SIZE=" + std::to_string(d.world) + " needs bench_table built with CUDA and NCCL (SQUEEZE_WITH_NCCL)");
#endif
}

// Model FLOPs per trained token: 6·N + 12·L·T·d (see the header).
inline double flops_per_token(const nn::LlamaConfig& c, int64_t seq) {
  const plan::ModelShape s = c.shape();
  const double matmul_params = double(s.params() - s.embedding_params());
  return 6.0 * matmul_params + 12.0 * double(c.layers) * double(seq) * double(c.hidden);
}

// One row to run: a strategy name (or the peer) and the batch it runs with.
struct RowSpec {
  std::string name;
  int64_t batch;
};

struct Row {
  RowSpec spec;
  std::string strategy;  // the Strategy spelled out
  std::optional<double> time_ms, peak_gb, reserved_gb, planned_gb, planned_host_gb, final_loss, val_loss;
  std::optional<double> planned_build_gb;  // rows built block by block: the build's planned device peak, where above the step's
  std::vector<double> losses;              // this rank's training loss of every step (warm-up included), in order
  // Offload<Host> rows: the CPU pipeline's time per timed step (it runs beside the GPU; when its sum nears
  // time_ms the CPU bounds the step): waiting for gradient copies, sums of squares, AdamW + upload queueing.
  std::optional<double> host_wait_ms, host_sumsq_ms, host_update_ms;
  // Offload<Host>: the trainer's transfer counters summed over the timed steps (train::TransferCounters), and the
  // process's resident host memory when the row began and at its peak (VmHWM, reset at the row's start).
  train::TransferCounters transfers;
  std::optional<double> host_before_gb, host_peak_gb;
  int64_t skipped = 0;                        // optimizer steps skipped for non-finite gradients (fp16 loss scaling)
  std::string gradient_buffers;               // stages 0-1: when the trainer's full gradient buffer existed (plan::GradientBuffers)
  int64_t mlp_tile = 0;                       // tokens per MLP tile the row trained with (0: untiled)
  std::optional<double> build_s;              // seconds to build the trainer (the model, quantized block by block where it is)
  std::optional<bench::StepProfile> profile;  // --profile-steps: the kernels of those steps (bench/step_profile.hpp)
  std::string profile_error;                  // why they could not be profiled (the row's measurements stand)
  bool oom = false;
  std::string error;
};

// The widely shared LLaMA-7B, B=8, T=2048 figures (peak GB, it/s, perplexity), by the row they describe.
struct Claim {
  double gb, its, ppl;
};
inline const std::map<std::string, Claim> kClaims = {{"fp32", {72.3, 1.8, 3.21}},
                                                     {"zero3-offload", {21.5, 1.5, 3.23}},
                                                     {"accum4", {18.9, 0.9, 3.25}},
                                                     {"fp16", {38.2, 2.4, 3.28}},
                                                     {"zero3-offload-fp16", {16.1, 1.2, 3.26}}};

inline std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

inline void synchronize(const torch::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize();
}

// After each row: what the row freed goes back to the system, so the next row starts from the same state. Device:
// the CUDA caching allocator's blocks. Host: torch's pinned-memory cache (Offload<Host> state is cudaHostAlloc'd
// by train::pinned_empty and freed with its trainer, but other pinned tensors go through the cache, which keeps
// freed blocks for reuse by the same power-of-two size class only) and glibc's free heap pages.
inline void release_cached_memory(const torch::Device& d) {
#if defined(SQUEEZE_TORCH_CUDA)
  if (d.is_cuda()) {
    llama::cuda_allocator_ready(d);
    torch::cuda::synchronize();  // copies from pinned blocks have finished: the cache can free them now
    c10::cuda::CUDACachingAllocator::emptyCache();
    at::getHostAllocator(at::kCUDA)->empty_cache();
  }
#endif
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
  (void)d;
}

// The corpus as tokens; text shorter than a window (the built-in fallback) is repeated until it is not.
struct Data {
  torch::Tensor train, val;  // [n] int64 each
  std::string source;
};
inline Data load_data(const Options& o) {
  const llama::Corpus c = llama::load_corpus(o.corpus, 0.05);
  const auto tile = [&](std::string text) {
    const std::string unit = text;
    while (int64_t(text.size()) < 2 * (o.seq + 1)) text += unit;
    return llama::tokenize(text);
  };
  return {tile(c.train), tile(c.val), c.source};
}

// Training batch `step` of this rank, [B, T] each: rows [rank·B, (rank+1)·B) of the B·world windows drawn from
// (seed, step). At world 1 these are the B windows sample_batch draws.
inline std::pair<torch::Tensor, torch::Tensor> rank_batch(const Options& o, const Data& data, int64_t batch, int64_t step, const Dist& d,
                                                          const torch::Device& device) {
  const auto [x, y] = llama::sample_batch(data.train, batch * d.world, o.seq, o.seed, step, torch::kCPU);  // [B·world, T]
  return {x.narrow(0, d.rank * batch, batch).to(device), y.narrow(0, d.rank * batch, batch).to(device)};
}

// Trains warmup + steps optimizer steps on the shared batches (timing the last `steps`), records the peak,
// then the validation loss. step(x, y) -> training loss ([] on the device; read back after each step, or under
// --deferred-loss after the timed steps); sync() waits for work step() left running;
// timed(begin) is called with true before and false after the timed steps; eval(batches) -> mean
// validation loss.
template <class Step, class Sync, class Timed, class Eval>
void run_steps(const Options& o, int64_t batch, const Data& data, const Dist& d, const torch::Device& device, Row& row, Step&& step,
               Sync&& sync, Timed&& timed_mark, Eval&& eval) {
  double loss = 0;
  for (int64_t i = 0; i < o.warmup; ++i) {
    const auto [x, y] = rank_batch(o, data, batch, i, d, device);
    loss = step(x, y).template item<double>();
    row.losses.push_back(loss);
  }
  std::vector<std::pair<torch::Tensor, torch::Tensor>> timed;
  for (int64_t i = o.warmup; i < o.warmup + o.steps; ++i) timed.push_back(rank_batch(o, data, batch, i, d, device));
  sync();
  synchronize(device);
  if (d.comm) d.comm->barrier();  // every rank starts the clock together
  timed_mark(true);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<torch::Tensor> losses;
  for (const auto& [x, y] : timed) {
    losses.push_back(step(x, y));
    if (!o.deferred_loss) (void)losses.back().template item<double>();  // the loss read-back synchronises each step
  }
  sync();  // an offloaded update may still be running on the CPU
  synchronize(device);
  timed_mark(false);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const torch::Tensor& l : losses) row.losses.push_back(loss = l.template item<double>());
  row.time_ms = 1e3 * s / double(o.steps);
  row.final_loss = loss;
  const auto m = llama::device_memory(device);
  row.peak_gb = m.peak_gb;
  row.reserved_gb = m.reserved_peak_gb;
  timed.clear();
  // Validation: the same windows for every row, in batches of 4 sequences (none under --eval-seqs 0).
  if (o.eval_seqs == 0) return;
  const int64_t per = std::min<int64_t>(4, o.eval_seqs);
  row.val_loss = eval(llama::val_batches(data.val, per, o.seq, std::max<int64_t>(1, o.eval_seqs / per), device));
}

// --profile-steps: that many more steps under the profiler, after the row's peaks and timings are read (the profiler's
// buffers and its overhead stay out of them), on the batches after the timed ones.
template <class Step, class Sync>
void profile_row(const Options& o, int64_t batch, const Data& data, const Dist& d, const torch::Device& device, Row& row, Step&& step,
                 Sync&& sync) {
  if (o.profile_steps <= 0) return;
  const int64_t first = o.warmup + o.steps;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int64_t i = 0; i < o.profile_steps; ++i) batches.push_back(rank_batch(o, data, batch, first + i, d, device));
  sync();
  synchronize(device);
  const train::TransferCounters transfers = row.transfers;  // the row's counters are the timed steps'
  const int64_t skipped = row.skipped;
  try {
    row.profile = bench::profile_steps(o.profile_steps, device, [&](int64_t i) {
      const torch::Tensor loss = step(batches[i].first, batches[i].second);
      if (!o.deferred_loss) (void)loss.template item<double>();  // the loss read-back synchronises the step
      sync();
      synchronize(device);
    });
  } catch (const std::exception& e) {  // e.g. no profiler in this libtorch: the row keeps what it measured
    row.profile_error = e.what();
  }
  row.transfers = transfers, row.skipped = skipped;
}

// World > 1: the slowest rank's step time (collectives keep the ranks in step anyway), the largest per-GPU peaks,
// the mean training loss (each rank's is over its own sequences). Validation loss is the same on every rank.
inline void reduce_over_ranks(const Dist& d, const torch::Device& device, Row& row) {
  synchronize(device);  // nothing of the row's own streams still running beside the collectives below
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64).device(device);
  torch::Tensor mx = torch::tensor({*row.time_ms, *row.peak_gb, *row.reserved_gb}, torch::kFloat64).to(f64);  // [3]
  torch::Tensor sum = torch::tensor({*row.final_loss}, torch::kFloat64).to(f64);                              // [1]
  d.comm->all_reduce(mx.data_ptr<double>(), mx.data_ptr<double>(), 3, comm::ReduceOp::max);
  d.comm->all_reduce(sum.data_ptr<double>(), sum.data_ptr<double>(), 1, comm::ReduceOp::sum);
  d.comm->synchronize();
  mx = mx.cpu(), sum = sum.cpu();
  row.time_ms = mx[0].item<double>(), row.peak_gb = mx[1].item<double>(), row.reserved_gb = mx[2].item<double>();
  row.final_loss = sum[0].item<double>() / d.world;
}

// Learning rate of optimizer step i (from 0): linear warm-up over the first --lr-warmup steps, then --lr.
// Every row follows the same schedule, so rows still see the same updates.
inline double lr_at(const Options& o, int64_t i) { return i < o.lr_warmup ? o.lr * double(i + 1) / double(o.lr_warmup) : o.lr; }

// Catches what a row can throw: out of memory is a result, anything else an error; both keep the table going.
template <class F>
void guarded(Row& row, const torch::Device& device, F&& f) {
  try {
    f();
  } catch (const c10::OutOfMemoryError& e) {
    row.oom = true;
    row.error = "out of memory";
  } catch (const c10::Error& e) {
    row.error = e.what_without_backtrace();
    row.oom = row.error.find("out of memory") != std::string::npos;  // rethrown across the autograd engine
  } catch (const std::exception& e) {
    row.error = e.what();
  }
  if (!row.error.empty()) row.error = row.error.substr(0, row.error.find('\n'));
  release_cached_memory(device);
}

// Runs spec's row when its strategy is one of this part's rows of llama::StrategyTable (position Part modulo Parts;
// table_rows.hpp, one translation unit a part); false when it is another part's.
template <int Part, int Parts>
bool run_strategy_part(const RowSpec& spec, const Options& o, const nn::LlamaConfig& config, const Data& data, const Dist& d,
                       const torch::Device& device, const llama::TrainOptions& row_options, Row& row);

}  // namespace squeeze::table
