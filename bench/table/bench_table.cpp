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
//                 goes into it); plan_ratio = peak_gb / planned_gb
//   time_ms, iters_per_s, tokens_per_s   over the timed steps (after --warmup untimed ones)
//   val_ppl       validation perplexity (per token = per byte) after warmup + steps optimizer steps
//   tokens_per_s_per_gpu, mfu   tokens/s of one GPU, and model FLOPs utilisation: flops_per_token x
//                 tokens_per_s_per_gpu / 989 TFLOP/s (the H200's dense bf16 peak, whatever the row's precision), with
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
// JSON lines: bench "table", case, strategy, world, batch (per GPU), seq, loss_chunk, peak_gb, reserved_gb, planned_gb,
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
#include <c10/cuda/CUDAFunctions.h>
#endif
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "data.hpp"
#include "trainer.hpp"

using namespace squeeze;
using squeeze::llama::LlamaRun;
using json = nlohmann::json;

namespace {

constexpr const char* kPeer = "libtorch-autocast-bf16";

// NVIDIA's H200 SXM datasheet: 1,979 TFLOP/s of bf16 tensor-core math with 2:4 sparsity, so 989 TFLOP/s dense.
// MFU is measured against it for every row (fp32 rows too), as is usual.
constexpr double kH200DenseBf16Flops = 989e12;

struct Options {
  std::string out, csv, preset = "tinyllama-1.1b", device = "cuda", rows, corpus;
  std::string hf;  // a Hugging Face LLaMA directory every row starts from (its config replaces the preset)
  int64_t batch = 8, seq = 2048, steps = 3, warmup = 2, layers = 0, eval_seqs = 8, threads = 0, lr_warmup = 0;
  int64_t loss_chunk = llama::TrainOptions{}.loss_chunk_tokens;  // the strategy rows' (the peer never chunks)
  bool fused_loss = false;                                         // the strategy rows' loss fused (nn::fused_linear_cross_entropy)
  std::string mlp_tile = "auto";                                   // tokens per MLP tile, or the planner's choice
  bool gather_layers_alone = false;                                // stage-3 rows: every linear its own gather unit
  double lr = 3e-4, clip = 1.0, loss_scale = 1024, comm_timeout_s = 600;
  uint64_t seed = 1337;
};

// The MLP tile of strategy S's rows (--mlp-tile): a number of tokens as given, or under "auto" plan::pick_mlp_tile's for
// this rank's GPU (untiled on the CPU, or where the step fits untiled).
template <StrategyType S>
int64_t mlp_tile_for(const Options& o, const nn::LlamaConfig& config, int64_t batch, int world, const torch::Device& device,
                     int64_t loss_chunk) {
  if (o.mlp_tile != "auto") return std::stoll(o.mlp_tile);
  const std::optional<int64_t> total = engine::device_memory_total(device);
  if (!total) return 0;
  return plan::pick_mlp_tile<S>(config.shape(), llama::train_shape<S>(config, batch, o.seq, world, loss_chunk, {}), world, *total);
}

// This process's place in the run: one process per GPU, from the torchrun-style environment.
struct Dist {
  int rank = 0, world = 1, local_rank = 0;
  comm::CommPtr comm;  // NcclComm at world > 1; null at world 1 (each trainer keeps its own one-rank LocalComm)
  bool root() const { return rank == 0; }
};

Dist from_env() {
  const comm::DistEnv env = comm::DistEnv::from_environment();  // checks every variable
  return {env.rank, env.world, env.local_rank, nullptr};
}

// World > 1: joins the other ranks (NcclComm::from_env: rank 0 hosts the store at MASTER_ADDR:MASTER_PORT).
void connect(Dist& d, const Options& o) {
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
double flops_per_token(const nn::LlamaConfig& c, int64_t seq) {
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
  std::vector<double> losses;  // this rank's training loss of every step (warm-up included), in order
  // Offload<Host> rows: the CPU pipeline's time per timed step (it runs beside the GPU; when its sum nears
  // time_ms the CPU bounds the step): waiting for gradient copies, sums of squares, AdamW + upload queueing.
  std::optional<double> host_wait_ms, host_sumsq_ms, host_update_ms;
  // Offload<Host>: the trainer's transfer counters summed over the timed steps (train::TransferCounters), and the
  // process's resident host memory when the row began and at its peak (VmHWM, reset at the row's start).
  train::TransferCounters transfers;
  std::optional<double> host_before_gb, host_peak_gb;
  int64_t skipped = 0;  // optimizer steps skipped for non-finite gradients (fp16 loss scaling)
  std::string gradient_buffers;  // stages 0-1: when the trainer's full gradient buffer existed (plan::GradientBuffers)
  int64_t mlp_tile = 0;          // tokens per MLP tile the row trained with (0: untiled)
  std::optional<double> build_s;  // seconds to build the trainer (the model, quantized block by block where it is)
  bool oom = false;
  std::string error;
};

// The widely shared LLaMA-7B, B=8, T=2048 figures (peak GB, it/s, perplexity), by the row they describe.
struct Claim {
  double gb, its, ppl;
};
const std::map<std::string, Claim> kClaims = {{"fp32", {72.3, 1.8, 3.21}},
                                              {"zero3-offload", {21.5, 1.5, 3.23}},
                                              {"accum4", {18.9, 0.9, 3.25}},
                                              {"fp16", {38.2, 2.4, 3.28}},
                                              {"zero3-offload-fp16", {16.1, 1.2, 3.26}}};

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

void synchronize(const torch::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize();
}

// After each row: what the row freed goes back to the system, so the next row starts from the same state. Device:
// the CUDA caching allocator's blocks. Host: torch's pinned-memory cache (Offload<Host> state is cudaHostAlloc'd
// by train::pinned_empty and freed with its trainer, but other pinned tensors go through the cache, which keeps
// freed blocks for reuse by the same power-of-two size class only) and glibc's free heap pages.
void release_cached_memory(const torch::Device& d) {
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
Data load_data(const Options& o) {
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
std::pair<torch::Tensor, torch::Tensor> rank_batch(const Options& o, const Data& data, int64_t batch, int64_t step, const Dist& d,
                                                   const torch::Device& device) {
  const auto [x, y] = llama::sample_batch(data.train, batch * d.world, o.seq, o.seed, step, torch::kCPU);  // [B·world, T]
  return {x.narrow(0, d.rank * batch, batch).to(device), y.narrow(0, d.rank * batch, batch).to(device)};
}

// Trains warmup + steps optimizer steps on the shared batches (timing the last `steps`), records the peak,
// then the validation loss. step(x, y) -> training loss; sync() waits for work step() left running;
// timed(begin) is called with true before and false after the timed steps; eval(batches) -> mean
// validation loss.
template <class Step, class Sync, class Timed, class Eval>
void run_steps(const Options& o, int64_t batch, const Data& data, const Dist& d, const torch::Device& device, Row& row, Step&& step,
               Sync&& sync, Timed&& timed_mark, Eval&& eval) {
  double loss = 0;
  for (int64_t i = 0; i < o.warmup; ++i) {
    const auto [x, y] = rank_batch(o, data, batch, i, d, device);
    loss = step(x, y);
    row.losses.push_back(loss);
  }
  std::vector<std::pair<torch::Tensor, torch::Tensor>> timed;
  for (int64_t i = o.warmup; i < o.warmup + o.steps; ++i) timed.push_back(rank_batch(o, data, batch, i, d, device));
  sync();
  synchronize(device);
  if (d.comm) d.comm->barrier();  // every rank starts the clock together
  timed_mark(true);
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& [x, y] : timed) row.losses.push_back(loss = step(x, y));  // the loss read-back synchronises each step
  sync();  // an offloaded update may still be running on the CPU
  synchronize(device);
  timed_mark(false);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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

// World > 1: the slowest rank's step time (collectives keep the ranks in step anyway), the largest per-GPU peaks,
// the mean training loss (each rank's is over its own sequences). Validation loss is the same on every rank.
void reduce_over_ranks(const Dist& d, const torch::Device& device, Row& row) {
  synchronize(device);  // nothing of the row's own streams still running beside the collectives below
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64).device(device);
  torch::Tensor mx = torch::tensor({*row.time_ms, *row.peak_gb, *row.reserved_gb}, torch::kFloat64).to(f64);  // [3]
  torch::Tensor sum = torch::tensor({*row.final_loss}, torch::kFloat64).to(f64);                                // [1]
  d.comm->all_reduce(mx.data_ptr<double>(), mx.data_ptr<double>(), 3, comm::ReduceOp::max);
  d.comm->all_reduce(sum.data_ptr<double>(), sum.data_ptr<double>(), 1, comm::ReduceOp::sum);
  d.comm->synchronize();
  mx = mx.cpu(), sum = sum.cpu();
  row.time_ms = mx[0].item<double>(), row.peak_gb = mx[1].item<double>(), row.reserved_gb = mx[2].item<double>();
  row.final_loss = sum[0].item<double>() / d.world;
}

// Learning rate of optimizer step i (from 0): linear warm-up over the first --lr-warmup steps, then --lr.
// Every row follows the same schedule, so rows still see the same updates.
double lr_at(const Options& o, int64_t i) { return i < o.lr_warmup ? o.lr * double(i + 1) / double(o.lr_warmup) : o.lr; }

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

// The peer: float weights and torch AdamW, forward under bf16 autocast, backward and update outside it; the loss
// unchunked (logits of the whole batch at once), as plain libtorch computes it.
Row run_peer(const RowSpec& spec, const Options& o, const nn::LlamaConfig& config, const Data& data, const Dist& d,
             const torch::Device& device, const llama::TrainOptions& topt) {
  Row row{spec, "float weights + torch::optim::AdamW, bf16 autocast"};
  guarded(row, device, [&] {
    llama::reset_peak_memory(device);
    torch::manual_seed(1);
    nn::Llama model = o.hf.empty() ? nn::Llama(config) : nn::load_hf_llama(o.hf, {.dtype = torch::kFloat32});
    model->loss_chunk_tokens = 0;  // plain libtorch: the logits of the whole batch at once
    model->to(device);
    model->train();
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(topt.lr)
                                                     .betas({topt.beta1, topt.beta2})
                                                     .eps(topt.eps)
                                                     .weight_decay(topt.weight_decay));
    const auto type = device.type();
    const auto autocast_loss = [&](const torch::Tensor& x, const torch::Tensor& y) {
      at::autocast::set_autocast_dtype(type, torch::kBFloat16);
      at::autocast::set_autocast_enabled(type, true);
      torch::Tensor loss;
      try {
        loss = model->loss(x, y);
      } catch (...) {
        at::autocast::set_autocast_enabled(type, false);
        at::autocast::clear_cache();
        throw;
      }
      at::autocast::set_autocast_enabled(type, false);
      at::autocast::clear_cache();
      return loss;
    };
    run_steps(
        o, spec.batch, data, d, device, row,
        [&, i = int64_t(0)](const torch::Tensor& x, const torch::Tensor& y) mutable {
          for (auto& group : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr_at(o, i));
          ++i;
          const torch::Tensor loss = autocast_loss(x, y);
          loss.backward();
          if (topt.clip > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), topt.clip);
          opt.step();
          opt.zero_grad();
          return loss.item<double>();
        },
        [] {}, [](bool) {},
        [&](const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches) {
          torch::NoGradGuard no_grad;
          double sum = 0;
          for (const auto& [x, y] : batches) sum += autocast_loss(x, y).item<double>();
          return sum / double(batches.size());
        });
  });
  return row;
}

Row run_strategy(const RowSpec& spec, const Options& o, const nn::LlamaConfig& config, const Data& data, const Dist& d,
                 const torch::Device& device, const llama::TrainOptions& row_options) {
  Row row{spec, ""};
  guarded(row, device, [&] {
    llama::with_strategy(spec.name, [&]<StrategyType S>() {
      row.strategy = strategy_name<S>();
      llama::TrainOptions topt = row_options;
      topt.mlp_tile_tokens = mlp_tile_for<S>(o, config, spec.batch, d.world, device, topt.loss_chunk_tokens);
      row.mlp_tile = topt.mlp_tile_tokens;
      topt.planned_batch = spec.batch, topt.planned_seq = o.seq;  // a step planned beyond the GPU is refused before it is built
      if constexpr (S::quantized_weights && S::has_lora) {  // built block by block: progress, and refused before allocating
        topt.layerwise.train = llama::train_shape<S>(config, spec.batch, o.seq, d.world, topt.loss_chunk_tokens, {}, topt.mlp_tile_tokens);
        topt.layerwise.progress = llama::build_progress(o.hf.empty() ? o.preset : o.hf, d.root());
      }
      const plan::MemoryPlan p = llama::plan_for<S>(config, spec.batch, o.seq, d.world, topt.loss_chunk_tokens, {}, topt.mlp_tile_tokens);
      row.planned_gb = double(p.peak().device) / 1e9;
      row.planned_host_gb = double(p.peak().host) / 1e9;
      llama::reset_peak_memory(device);
      std::ofstream("/proc/self/clear_refs") << "5";  // the host's high-water mark starts from here
      row.host_before_gb = llama::device_memory(torch::kCPU).current_gb;
      torch::manual_seed(1);
      std::optional<LlamaRun<S>> trainer;
      const auto built = std::chrono::steady_clock::now();
      if (o.hf.empty()) trainer.emplace(config, topt, device, d.comm);  // d.comm null at world 1: one-rank LocalComm
      else trainer.emplace(LlamaRun<S>::from_hf(o.hf, topt, device, d.comm));
      row.build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - built).count();
      run_steps(
          o, spec.batch, data, d, device, row,
          [&, i = int64_t(0)](const torch::Tensor& x, const torch::Tensor& y) mutable {
            trainer->set_lr(lr_at(o, i++));
            const llama::BatchResult r = trainer->step(x, y);
            row.skipped += r.applied ? 0 : 1;
            row.transfers.h2d_bytes += r.transfers.h2d_bytes;
            row.transfers.d2h_bytes += r.transfers.d2h_bytes;
            row.transfers.h2d_copy_s += r.transfers.h2d_copy_s;
            row.transfers.copy_wait_s += r.transfers.copy_wait_s;
            if constexpr (S::stage <= 1) row.gradient_buffers = plan::to_string(trainer->trainer().options().gradient_buffers);
            return r.loss;
          },
          [&] { trainer->sync(); },
          [&](bool begin) {
            if constexpr (S::offload_to_host) {
              if (begin) {
                row.transfers = {};
                return trainer->reset_offload_stats();
              }
              const train::OffloadStats st = trainer->offload_stats();
              const double per_step_ms = 1e3 / double(o.steps);
              row.host_wait_ms = st.transfer_wait_s * per_step_ms;
              row.host_sumsq_ms = st.sum_squares_s * per_step_ms;
              row.host_update_ms = st.update_s * per_step_ms;
            }
          },
          [&](const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches) { return trainer->evaluate(batches); });
      row.host_peak_gb = llama::device_memory(torch::kCPU).peak_gb;
      if (d.world > 1) reduce_over_ranks(d, device, row);
    });
  });
  return row;
}

// Whether a row trains data-parallel over several GPUs here: the ZeRO strategies (Sharded<StageN>).
// Every strategy trains data-parallel through make_trainer; the plain-libtorch peer runs at world 1 only.
bool data_parallel(const std::string& name) { return name != kPeer; }

std::vector<RowSpec> parse_rows(const std::string& s, int64_t batch) {
  std::vector<RowSpec> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    if (item.empty()) continue;
    const auto colon = item.find(':');
    if (colon == std::string::npos) out.push_back({item, batch});
    else {
      const std::string b = item.substr(colon + 1);
      const bool digits = !b.empty() && b.size() < 10 && std::all_of(b.begin(), b.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
      out.push_back({item.substr(0, colon), digits ? std::stoll(b) : int64_t(0)});  // 0: reported as a bad batch below
    }
  }
  return out;
}

std::string fmt(const std::optional<double>& v, const char* f) {
  if (!v) return "-";
  char b[64];
  std::snprintf(b, sizeof b, f, *v);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"squeeze strategy table: memory, speed and perplexity of LLaMA training per strategy, beside plain libtorch and the planner"};
  app.add_option("--out", o.out, "append JSON lines here")->required();
  app.add_option("--csv", o.csv, "write the table as CSV here (default: --out with .csv)");
  app.add_option("--preset", o.preset, "model geometry")->check(CLI::IsMember(nn::LlamaConfig::preset_names()))->capture_default_str();
  auto* layers_opt = app.add_option("--layers", o.layers, "override the preset's layer count (smaller runs)");
  app.add_option("--batch", o.batch, "sequences per optimizer step (rows NAME:B override it)")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seq", o.seq, "tokens per sequence")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--steps", o.steps, "timed optimizer steps per row")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed steps first (the allocator and cuBLAS settle)")->capture_default_str();
  app.add_option("--eval-seqs", o.eval_seqs, "validation sequences of --seq tokens (0: no validation, e.g. for a context longer than "
                                             "the validation text)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  auto* lr_opt = app.add_option("--lr", o.lr, "AdamW learning rate (default: the preset's, llama::default_lr)");
  app.add_option("--lr-warmup", o.lr_warmup, "optimizer steps of linear learning-rate warm-up (0: constant --lr)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--clip", o.clip, "global gradient-norm clip (0: off; Offload<Host> then updates inside backward)")->capture_default_str();
  app.add_option("--loss-scale", o.loss_scale, "initial dynamic loss scale of the fp16 rows (PyTorch's GradScaler starts at 65536; "
                                                "from there a short run spends its first steps skipping overflows)")->capture_default_str();
  app.add_flag("--fused-loss", o.fused_loss, "the strategy rows train through the fused linear + cross-entropy");
  app.add_flag("--gather-layers-alone", o.gather_layers_alone, "stage-3 rows gather each linear alone instead of each block "
               "(TrainerOptions::gather_unit; the planner assumes blocks)");
  app.add_option("--loss-chunk", o.loss_chunk, "tokens per chunk of the strategy rows' LM head + cross-entropy, each recomputed in "
                                               "backward (0: the whole micro-batch at once, as the peer)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 30))
      ->capture_default_str();
  app.add_option("--mlp-tile", o.mlp_tile, "tokens per tile of each block's MLP and its norm, each recomputed in backward (0: untiled; "
                                           "auto: the planner's choice for the GPU, untiled where the step fits)")
      ->check([](const std::string& v) {
        if (v == "auto") return std::string();
        try {
          std::size_t used = 0;
          const long long n = std::stoll(v, &used);
          if (used == v.size() && n >= 0) return std::string();
        } catch (const std::exception&) {
        }
        return "--mlp-tile takes a number of tokens (0: untiled) or auto, got '" + v + "'";
      })
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the training batches")->capture_default_str();
  app.add_option("--corpus", o.corpus, "train on this text file (default: the KJV if installed, else the built-in text)");
  app.add_option("--threads", o.threads, "CPU threads of libtorch (0: its default)")->capture_default_str();
  app.add_option("--device", o.device, "cuda (the table) or cpu (a smoke test)")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--comm-timeout", o.comm_timeout_s, "world > 1: seconds a collective may wait for the other ranks before NCCL's "
                                                     "watchdog aborts it (a failed rank then cannot hang the others)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  const std::string default_rows = std::string(kPeer) +
                                   ",fp32,zero3-offload,accum4,fp16,bf16,zero3-offload-fp16,zero3-offload-fp16-accum4,ckpt,bf16-ckpt,qlora,gptq4-lora";
  app.add_option("--rows", o.rows, "comma-separated rows: " + std::string(kPeer) + " and strategy names, NAME:B for batch B (default: " +
                                       default_rows + ")");
  app.add_option("--hf", o.hf, "every row starts from this Hugging Face LLaMA directory (a trained base, e.g. llama_train "
                               "--export-hf): its config.json replaces --preset, and the perplexity column measures fine-tuning it")
      ->check(CLI::ExistingDirectory)
      ->excludes(layers_opt)
      ->needs(lr_opt);  // no preset rate applies to someone else's model
  CLI11_PARSE(app, argc, argv);
  if (o.rows.empty()) o.rows = default_rows;
  if (!o.hf.empty() && app.count("--preset") > 0) {
    std::cerr << "bench_table: --hf " << o.hf << " gives the model's geometry; leave out --preset " << o.preset << "\n";
    return 1;
  }
  // The preset's rate (llama::default_lr) unless --lr is given; at 7B warmed up over 5 steps unless --lr-warmup is.
  if (app.count("--lr") == 0) {
    o.lr = llama::default_lr(o.preset);
    if (o.preset == "llama-7b" && app.count("--lr-warmup") == 0) o.lr_warmup = 5;
  }
  if (o.csv.empty()) o.csv = (o.out.size() > 6 && o.out.ends_with(".jsonl") ? o.out.substr(0, o.out.size() - 6) : o.out) + ".csv";

  if (o.device == "cuda" && !torch::cuda::is_available()) {
    std::cerr << "bench_table: no CUDA device (this libtorch sees none); run it on the GPU machine or pass --device cpu\n";
    return 1;
  }
  Dist dist;
  try {
    dist = from_env();
  } catch (const std::exception& e) {
    std::cerr << "bench_table: " << e.what() << "\n";
    return 1;
  }
  if (o.threads > 0) torch::set_num_threads(int(o.threads));
  at::globalContext().setFlushDenormal(true);  // as llama_train: denormal AdamW moments are slow on x86 CPUs
  nn::LlamaConfig config;
  if (o.hf.empty()) {
    config = nn::LlamaConfig::preset(o.preset);
    if (o.layers > 0) config.layers = o.layers;
  } else {
    try {
      config = nn::from_hf_config(io::load_llama_config(o.hf), o.hf);
    } catch (const std::exception& e) {
      std::cerr << "bench_table: --hf " << o.hf << ": " << e.what() << "\n";
      return 1;
    }
    o.preset = "hf";  // the JSON's "hf" key names the directory
  }
  llama::TrainOptions topt;
  topt.lr = o.lr;
  topt.clip = o.clip;
  topt.initial_scale = o.loss_scale;
  topt.loss_chunk_tokens = o.loss_chunk;
  topt.fused_loss = o.fused_loss;
  topt.gather_layers_alone = o.gather_layers_alone;

  const auto known = llama::strategy_names();
  std::vector<RowSpec> rows;
  for (const auto& r : parse_rows(o.rows, o.batch)) {
    if (r.name != kPeer && std::find(known.begin(), known.end(), r.name) == known.end()) {
      std::cerr << "bench_table: unknown row '" << r.name << "'\n";
      return 1;
    }
    if (r.batch <= 0) {
      std::cerr << "bench_table: row '" << r.name << "': the batch after ':' must be a positive integer\n";
      return 1;
    }
    if (dist.world > 1 && !data_parallel(r.name)) {  // decided from the arguments alone, so every rank skips alike
      if (dist.root())
        std::printf("bench_table: row '%s' skipped at world %d: the plain-libtorch peer runs at world 1\n", r.name.c_str(), dist.world);
      continue;
    }
    rows.push_back(r);
  }
  if (rows.empty()) {
    std::cerr << "bench_table: no row to run at world " << dist.world << "\n";
    return 1;
  }
  try {
    connect(dist, o);
  } catch (const std::exception& e) {
    std::cerr << "bench_table rank " << dist.rank << ": " << e.what() << "\n";
    return 1;
  }
  // One GPU per rank at world > 1 (cuda:LOCAL_RANK); the default device otherwise, as always.
  const torch::Device device = dist.world > 1 ? torch::Device(torch::kCUDA, c10::DeviceIndex(dist.local_rank))
                                              : torch::Device(o.device == "cuda" ? torch::kCUDA : torch::kCPU);

  // Rank 0 writes the files and the table; the other ranks train beside it.
  std::ofstream out, csv;
  if (dist.root()) {
    out.open(o.out, std::ios::app), csv.open(o.csv);
    if (!out || !csv) {
      std::cerr << "bench_table: cannot write " << (!out ? o.out : o.csv) << "\n";
      return 1;  // the other ranks stop at their first collective's timeout, or when the launcher sees this exit
    }
    csv << "case,strategy,preset,layers,world,batch,seq,peak_gb,planned_gb,plan_ratio,iters_per_s,tokens_per_s,tokens_per_s_per_gpu,mfu,"
           "val_ppl,ratio_vs_peer,mem_ratio_vs_peer,claimed_gb,claimed_its,claimed_ppl,oom,error\n";
  }
  const Data data = load_data(o);
  const std::string dev_name = env_or("SQUEEZE_DEVICE", device.is_cuda() ? "cuda" : "cpu");
  const bool claims_apply = o.preset == "llama-7b" && o.seq == 2048 && config.layers == 32;
  const double model_flops = flops_per_token(config, o.seq);
  if (dist.root()) {
    std::printf("LLaMA %s (%lld layers), T=%lld, %lld warm-up + %lld timed steps per row on %d x %s (B per GPU); corpus: %s\n",
                o.hf.empty() ? o.preset.c_str() : ("from " + o.hf).c_str(), (long long)config.layers, (long long)o.seq, (long long)o.warmup, (long long)o.steps, dist.world,
                dev_name.c_str(), data.source.c_str());
    std::printf("%-27s %3s %8s %8s %6s %7s %9s %9s %6s %8s %7s %7s  %s\n", "case", "B", "peak GB", "plan GB", "/plan", "it/s", "tok/s",
                "tok/s/GPU", "MFU", "val ppl", "x peer", "mem x", claims_apply ? "claimed GB it/s ppl | note" : "note");
  }

  std::optional<Row> peer;
  for (const auto& spec : rows) {
    const Row row = spec.name == kPeer ? run_peer(spec, o, config, data, dist, device, topt)
                                       : run_strategy(spec, o, config, data, dist, device, topt);
    if (!dist.root()) {
      if (row.error.empty()) continue;
      std::fprintf(stderr, "bench_table rank %d of %d: row '%s' failed: %s\n", dist.rank, dist.world, spec.name.c_str(), row.error.c_str());
      std::fflush(stderr);
      std::_Exit(1);  // see below
    }
    if (spec.name == kPeer && row.time_ms) peer = row;
    const double tokens_per_step = double(spec.batch * o.seq);  // per GPU

    json j = {{"bench", "table"}, {"case", spec.name}, {"strategy", row.strategy}, {"peer", kPeer}, {"preset", o.preset},
              {"layers", config.layers}, {"world", dist.world}, {"batch", spec.batch}, {"seq", o.seq}, {"steps", o.steps}, {"warmup", o.warmup},
              {"clip", o.clip}, {"lr", o.lr}, {"lr_warmup", o.lr_warmup}, {"corpus", data.source}, {"device", dev_name},
              {"date", env_or("SQUEEZE_DATE", "")}, {"commit", env_or("SQUEEZE_COMMIT", "")}, {"oom", row.oom},
              {"flops_per_token", model_flops}, {"loss_chunk", spec.name == kPeer ? int64_t(0) : o.loss_chunk},
              {"fused_loss", spec.name != kPeer && o.fused_loss}, {"mlp_tile", spec.name == kPeer ? int64_t(0) : row.mlp_tile},
              {"gather_layers_alone", spec.name != kPeer && o.gather_layers_alone}};
    if (!row.gradient_buffers.empty()) j["gradient_buffers"] = row.gradient_buffers;
    if (!o.hf.empty()) j["hf"] = o.hf;  // every row fine-tunes this model: losses[0] is its loss on the first batch
    // Keys are left out (not null) when unknown: consumers read missing numbers as 0.
    std::optional<double> tps, tps_gpu, mfu, ratio, mem_ratio, plan_ratio, ppl;
    if (row.time_ms) {
      tps_gpu = tokens_per_step / (*row.time_ms / 1e3);
      tps = *tps_gpu * dist.world;
      mfu = model_flops * *tps_gpu / kH200DenseBf16Flops;
      j["time_ms"] = *row.time_ms;
      j["iters_per_s"] = 1e3 / *row.time_ms;
      j["tokens_per_s"] = *tps;
      j["tokens_per_s_per_gpu"] = *tps_gpu;
      j["mfu"] = *mfu;
      j["peak_gb"] = *row.peak_gb;
      j["reserved_gb"] = *row.reserved_gb;
      j["final_loss"] = *row.final_loss;
      j["losses"] = row.losses;  // rank 0's loss per step: the first is the loss of the initial weights
      j["skipped_steps"] = row.skipped;
      if (row.build_s) j["build_s"] = *row.build_s;
      if (row.host_update_ms) {
        j["host_wait_ms"] = *row.host_wait_ms;
        j["host_sumsq_ms"] = *row.host_sumsq_ms;
        j["host_update_ms"] = *row.host_update_ms;
        // Per timed step: bytes each way, the GPU's time on streamed copies and blocked waiting for them.
        const double steps = double(o.steps);
        j["h2d_gb"] = double(row.transfers.h2d_bytes) / 1e9 / steps;
        j["d2h_gb"] = double(row.transfers.d2h_bytes) / 1e9 / steps;
        j["h2d_copy_ms"] = 1e3 * row.transfers.h2d_copy_s / steps;
        j["copy_wait_ms"] = 1e3 * row.transfers.copy_wait_s / steps;
      }
      if (row.host_peak_gb) {
        j["host_before_gb"] = *row.host_before_gb;
        j["host_peak_gb"] = *row.host_peak_gb;
      }
      if (row.val_loss) {
        ppl = std::exp(*row.val_loss);
        j["val_loss"] = *row.val_loss;
        j["val_ppl"] = *ppl;
      }
      if (peer) {
        ratio = *tps / (double(peer->spec.batch * o.seq) / (*peer->time_ms / 1e3));
        mem_ratio = *peer->peak_gb / std::max(1e-9, *row.peak_gb);
        j["ratio_vs_peer"] = *ratio;
        j["mem_ratio_vs_peer"] = *mem_ratio;
      }
    }
    if (row.planned_gb) {
      j["planned_gb"] = *row.planned_gb;
      j["planned_host_gb"] = *row.planned_host_gb;
      if (row.host_peak_gb && *row.planned_host_gb > 0) j["host_plan_ratio"] = (*row.host_peak_gb - *row.host_before_gb) / *row.planned_host_gb;
      if (row.peak_gb) {
        plan_ratio = *row.peak_gb / *row.planned_gb;
        j["plan_ratio"] = *plan_ratio;
        j["plan_error"] = *plan_ratio - 1;
      }
    }
    std::optional<Claim> claim;
    if (claims_apply && spec.batch == 8 && kClaims.count(spec.name)) {
      claim = kClaims.at(spec.name);
      j["claimed_gb"] = claim->gb, j["claimed_its"] = claim->its, j["claimed_ppl"] = claim->ppl;
    }
    if (!row.error.empty()) j["error"] = row.error;
    out << j.dump() << "\n" << std::flush;

    std::string error = row.error;
    std::replace(error.begin(), error.end(), ',', ';');
    csv << spec.name << ",\"" << row.strategy << "\"," << o.preset << "," << config.layers << "," << dist.world << "," << spec.batch << ","
        << o.seq << "," << fmt(row.peak_gb, "%.3f") << "," << fmt(row.planned_gb, "%.3f") << "," << fmt(plan_ratio, "%.3f") << ","
        << fmt(row.time_ms ? std::optional<double>(1e3 / *row.time_ms) : std::nullopt, "%.4f") << "," << fmt(tps, "%.0f") << ","
        << fmt(tps_gpu, "%.0f") << "," << fmt(mfu, "%.4f") << "," << fmt(ppl, "%.3f") << "," << fmt(ratio, "%.3f") << "," << fmt(mem_ratio, "%.3f") << ","
        << (claim ? fmt(claim->gb, "%.1f") : "") << "," << (claim ? fmt(claim->its, "%.1f") : "") << ","
        << (claim ? fmt(claim->ppl, "%.2f") : "") << "," << (row.oom ? 1 : 0) << ",\"" << error << "\"\n"
        << std::flush;

    std::string note = row.error;
    if (row.skipped > 0) note = std::to_string(row.skipped) + " step(s) skipped (fp16 overflow)" + (note.empty() ? "" : "; " + note);
    if (row.host_update_ms)
      note = "host ms/step: copies " + fmt(row.host_wait_ms, "%.0f") + " sumsq " + fmt(row.host_sumsq_ms, "%.0f") + " adamw " +
             fmt(row.host_update_ms, "%.0f") + (note.empty() ? "" : "; " + note);
    if (claim) note = fmt(claim->gb, "%.1f") + " " + fmt(claim->its, "%.1f") + " " + fmt(claim->ppl, "%.2f") + (note.empty() ? "" : " | " + note);
    std::printf("%-27s %3lld %8s %8s %6s %7s %9s %9s %6s %8s %7s %7s  %s\n", spec.name.c_str(), (long long)spec.batch,
                fmt(row.peak_gb, "%.2f").c_str(), fmt(row.planned_gb, "%.2f").c_str(), fmt(plan_ratio, "%.3f").c_str(),
                fmt(row.time_ms ? std::optional<double>(1e3 / *row.time_ms) : std::nullopt, "%.3f").c_str(), fmt(tps, "%.0f").c_str(),
                fmt(tps_gpu, "%.0f").c_str(), fmt(mfu, "%.3f").c_str(), fmt(ppl, "%.2f").c_str(), fmt(ratio, "%.3f").c_str(),
                fmt(mem_ratio, "%.3f").c_str(), note.c_str());
    std::fflush(stdout);
    if (dist.world > 1 && !row.error.empty()) {
      // Another rank may be inside a collective this one will never join: end the run, without destructors that
      // would wait on the communicator. The other ranks stop when the launcher sees this exit, or at --comm-timeout.
      std::fprintf(stderr, "bench_table rank 0 of %d: row '%s' failed (%s); at world > 1 that ends the run (one row per launch "
                           "keeps the others)\n", dist.world, spec.name.c_str(), row.error.c_str());
      std::fflush(stderr);
      std::_Exit(1);
    }
  }
  if (!dist.root()) return 0;
  std::printf("peak: CUDA caching allocator, allocated bytes (the largest over the GPUs); plan: squeeze::plan peak() for the same\n"
              "strategy, shapes and world (no measurement goes into it); /plan = measured / planned; tok/s: all GPUs; MFU: %.4g model\n"
              "FLOPs/token (6N + 12 L T d) x tok/s/GPU over %.0f TFLOP/s (H200 dense bf16); x peer: tokens/s over the peer's; mem x: peer's\n"
              "peak over ours.\n", model_flops, kH200DenseBf16Flops / 1e12);
  if (o.preset == "tinyllama-1.1b" && config.layers == 22 && o.seq == 2048)
    std::printf("reference (PyTorch + transformers, this GPU type, TinyLlama-1.1B B=8 T=2048): bf16 autocast 60.8 GB 48.7k tok/s;\n"
                "  + checkpointing 24.1 GB 35.2k tok/s; accumulation 4x2 31.2 GB 38.4k tok/s\n");
  std::printf("widely shared claims, LLaMA-7B B=8 T=2048 (80 GB A100): baseline 72.3 GB 1.8 it/s ppl 3.21; ZeRO-3 21.5 GB 1.5 it/s 3.23;\n"
              "  accumulation(4) 18.9 GB 0.9 it/s 3.25; FP16 38.2 GB 2.4 it/s 3.28; ZeRO-3+FP16 16.1 GB 1.2 it/s 3.26\n"
              "  (fp32 Adam alone keeps 16 bytes/parameter = 107.8 GB at 7B: see README, 'The widely shared LLaMA-7B figures')\n"
              "LLaMA-7B reference (PyTorch, this GPU type): bf16 autocast + checkpointing B=1 109.1 GB 5.9k tok/s;\n"
              "  pure bf16 + checkpointing B=8 58.6 GB 9.0k tok/s\n");
  std::printf("wrote %s and %s (chart: python3 bench/table/chart.py %s)\n", o.out.c_str(), o.csv.c_str(), o.csv.c_str());
  return 0;
}
