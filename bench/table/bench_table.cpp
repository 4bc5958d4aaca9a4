// bench_table's entry: the options, the peer row, each strategy row through run_strategy_part (one part a
// translation unit), the table and its files. What the table measures: table.hpp.
#include "table.hpp"
#if SQUEEZE_TABLE_PARTS == 1  // the rows in this unit (CMakeLists.txt writes a unit per part only for several)
#define SQUEEZE_TABLE_PART 0
#include "table_rows.hpp"
#endif

namespace squeeze::table {
namespace {

using json = nlohmann::json;

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
    torch::optim::AdamW opt(
        model->parameters(),
        torch::optim::AdamWOptions(topt.lr).betas({topt.beta1, topt.beta2}).eps(topt.eps).weight_decay(topt.weight_decay));
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
          return loss.detach();
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

// The CUDA libraries' host memory taken at their first use (kernel images of cuBLAS and the attention), before any row:
// otherwise the first row of a process counts it as its own and the rows after it do not. Returns the VmRSS it added.
double warm_cuda_libraries(const torch::Device& device) {
  if (!device.is_cuda()) return 0;
  const double before = llama::device_memory(torch::kCPU).current_gb;
  for (const auto dtype : {torch::kBFloat16, torch::kFloat32}) {
    const auto opt = torch::TensorOptions().device(device).dtype(dtype);
    const torch::Tensor a = torch::randn({256, 256}, opt).requires_grad_(true),
                        q = torch::randn({1, 4, 128, 64}, opt).requires_grad_(true);  // [B, heads, T, head dim]
    const torch::Tensor y = at::scaled_dot_product_attention(q, q, q, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
    (torch::matmul(a, a).sum() + y.sum()).backward();
  }
  torch::cuda::synchronize();
  return llama::device_memory(torch::kCPU).current_gb - before;
}

// The strategy row called spec.name, from whichever part compiled it.
Row run_strategy(const RowSpec& spec, const Options& o, const nn::LlamaConfig& config, const Data& data, const Dist& d,
                 const torch::Device& device, const llama::TrainOptions& row_options) {
  Row row{spec, ""};
  guarded(row, device, [&] {
    const bool found = [&]<int... P>(std::integer_sequence<int, P...>) {
      return (run_strategy_part<P, SQUEEZE_TABLE_PARTS>(spec, o, config, data, d, device, row_options, row) || ...);
    }
    (std::make_integer_sequence<int, SQUEEZE_TABLE_PARTS>{});
    if (!found) llama::with_strategy(spec.name, []<StrategyType>() {});  // throws, naming the strategies compiled in
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
    if (colon == std::string::npos)
      out.push_back({item, batch});
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

int table_main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "squeeze strategy table: memory, speed and perplexity of LLaMA training per strategy, beside plain libtorch and the planner"};
  app.add_option("--out", o.out, "append JSON lines here")->required();
  app.add_option("--csv", o.csv, "write the table as CSV here (default: --out with .csv)");
  app.add_option("--preset", o.preset, "model geometry")->check(CLI::IsMember(nn::LlamaConfig::preset_names()))->capture_default_str();
  auto* layers_opt = app.add_option("--layers", o.layers, "override the preset's layer count (smaller runs)");
  app.add_option("--batch", o.batch, "sequences per optimizer step (rows NAME:B override it)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seq", o.seq, "tokens per sequence")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--steps", o.steps, "timed optimizer steps per row")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed steps first (the allocator and cuBLAS settle)")->capture_default_str();
  app.add_option("--eval-seqs", o.eval_seqs,
                 "validation sequences of --seq tokens (0: no validation, e.g. for a context longer than "
                 "the validation text)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  auto* lr_opt = app.add_option("--lr", o.lr, "AdamW learning rate (default: the preset's, llama::default_lr)");
  app.add_option("--lr-warmup", o.lr_warmup, "optimizer steps of linear learning-rate warm-up (0: constant --lr)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--clip", o.clip, "global gradient-norm clip (0: off; Offload<Host> then updates inside backward)")->capture_default_str();
  app.add_option("--loss-scale", o.loss_scale,
                 "initial dynamic loss scale of the fp16 rows (PyTorch's GradScaler starts at 65536; "
                 "from there a short run spends its first steps skipping overflows)")
      ->capture_default_str();
  app.add_flag("--fused-loss", o.fused_loss, "the strategy rows train through the fused linear + cross-entropy");
  app.add_flag("--deferred-loss", o.deferred_loss,
               "read the timed steps' losses after the clock stops (TrainerOptions::read_loss off): no loss read-back syncs "
               "a step, and where the trainer decides on the device no step syncs at all");
  app.add_flag("--gather-layers-alone", o.gather_layers_alone,
               "stage-3 rows gather each linear alone instead of each block "
               "(TrainerOptions::gather_unit; the planner assumes blocks)");
  app.add_option("--loss-chunk", o.loss_chunk,
                 "tokens per chunk of the strategy rows' LM head + cross-entropy, each recomputed in "
                 "backward (0: the whole micro-batch at once, as the peer)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 30))
      ->capture_default_str();
  app.add_option("--mlp-tile", o.mlp_tile,
                 "tokens per tile of each block's MLP and its norm, each recomputed in backward (0: untiled; "
                 "auto: the planner's choice for the GPU, untiled where the step fits)")
      ->check([](const std::string& v) {
        if (v == "auto") return std::string();
        try {
          std::size_t used = 0;
          const long long n = std::stoll(v, &used);
          if (used == v.size() && n >= 0) return std::string();
        } catch (const std::exception&) {}
        return "--mlp-tile takes a number of tokens (0: untiled) or auto, got '" + v + "'";
      })
      ->capture_default_str();
  app.add_option("--gpu-gb", o.gpu_gb,
                 "act as a GPU of this many GB (1e9 bytes): libtorch's allocator is capped there and auto MLP tiles "
                 "are planned for it (0: the GPU's own memory)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--profile-steps", o.profile_steps,
                 "after each strategy row's measurements, this many more steps under the profiler: the row's line gains "
                 "\"profile\", its kernels by name (bench/profile_table.py sorts them by kind)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the training batches")->capture_default_str();
  app.add_option("--corpus", o.corpus, "train on this text file (default: the KJV if installed, else the built-in text)");
  app.add_option("--threads", o.threads, "CPU threads of libtorch (0: its default)")->capture_default_str();
  app.add_option("--device", o.device, "cuda (the table) or cpu (a smoke test)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--comm-timeout", o.comm_timeout_s,
                 "world > 1: seconds a collective may wait for the other ranks before NCCL's "
                 "watchdog aborts it (a failed rank then cannot hang the others)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  const std::string default_rows =
      std::string(kPeer) +
      ",fp32,zero3-offload,accum4,fp16,bf16,zero3-offload-fp16,zero3-offload-fp16-accum4,ckpt,bf16-ckpt,qlora,gptq4-lora";
  app.add_option("--rows", o.rows,
                 "comma-separated rows: " + std::string(kPeer) + " and strategy names, NAME:B for batch B (default: " + default_rows + ")");
  app.add_option("--hf", o.hf,
                 "every row starts from this Hugging Face LLaMA directory (a trained base, e.g. llama_train "
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
  topt.read_loss = !o.deferred_loss;
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
  cap_gpu_memory(o, device);

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
                o.hf.empty() ? o.preset.c_str() : ("from " + o.hf).c_str(), (long long)config.layers, (long long)o.seq, (long long)o.warmup,
                (long long)o.steps, dist.world, dev_name.c_str(), data.source.c_str());
    std::printf("%-27s %3s %8s %8s %6s %7s %9s %9s %6s %8s %7s %7s  %s\n", "case", "B", "peak GB", "plan GB", "/plan", "it/s", "tok/s",
                "tok/s/GPU", "MFU", "val ppl", "x peer", "mem x", claims_apply ? "claimed GB it/s ppl | note" : "note");
  }

  const double runtime_host_gb = warm_cuda_libraries(device);
  std::optional<Row> peer;
  for (const auto& spec : rows) {
    const Row row =
        spec.name == kPeer ? run_peer(spec, o, config, data, dist, device, topt) : run_strategy(spec, o, config, data, dist, device, topt);
    if (!dist.root()) {
      if (row.error.empty()) continue;
      std::fprintf(stderr, "bench_table rank %d of %d: row '%s' failed: %s\n", dist.rank, dist.world, spec.name.c_str(), row.error.c_str());
      std::fflush(stderr);
      std::_Exit(1);  // see below
    }
    if (spec.name == kPeer && row.time_ms) peer = row;
    const double tokens_per_step = double(spec.batch * o.seq);  // per GPU

    json j = {{"bench", "table"},
              {"case", spec.name},
              {"strategy", row.strategy},
              {"preset", o.preset},
              {"layers", config.layers},
              {"world", dist.world},
              {"batch", spec.batch},
              {"seq", o.seq},
              {"steps", o.steps},
              {"warmup", o.warmup},
              {"clip", o.clip},
              {"lr", o.lr},
              {"lr_warmup", o.lr_warmup},
              {"corpus", data.source},
              {"device", dev_name},
              {"date", env_or("SQUEEZE_DATE", "")},
              {"commit", env_or("SQUEEZE_COMMIT", "")},
              {"oom", row.oom},
              {"flops_per_token", model_flops},
              {"loss_chunk", spec.name == kPeer ? int64_t(0) : o.loss_chunk},
              {"fused_loss", spec.name != kPeer && o.fused_loss},
              {"deferred_loss", o.deferred_loss},
              {"mlp_tile", spec.name == kPeer ? int64_t(0) : row.mlp_tile},
              {"gather_layers_alone", spec.name != kPeer && o.gather_layers_alone},
              {"gpu_gb", o.gpu_gb}};
    if (spec.name == kPeer || peer) j["peer"] = kPeer;  // the row it is, or the one its ratios are against
    if (!row.gradient_buffers.empty()) j["gradient_buffers"] = row.gradient_buffers;
    if (!o.hf.empty()) j["hf"] = o.hf;  // every row fine-tunes this model: losses[0] is its loss on the first batch
    // Keys are left out (not null) when unknown: consumers read missing numbers as 0.
    std::optional<double> tps, tps_gpu, mfu, ratio, mem_ratio, plan_ratio, ppl;
    if (row.time_ms) {
      tps_gpu = tokens_per_step / (*row.time_ms / 1e3);
      tps = *tps_gpu * dist.world;
      mfu = model_flops * *tps_gpu / kHopperDenseBf16Flops;
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
      if (row.profile) j["profile"] = row.profile->to_json();
      if (!row.profile_error.empty()) j["profile_error"] = row.profile_error;
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
        j["runtime_host_gb"] = runtime_host_gb;  // in host_before_gb: what the CUDA libraries took before the first row
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
      if (row.planned_build_gb) j["planned_build_gb"] = *row.planned_build_gb;
      j["planned_host_gb"] = *row.planned_host_gb;
      if (row.host_peak_gb && *row.planned_host_gb > 0)
        j["host_plan_ratio"] = (*row.host_peak_gb - *row.host_before_gb) / *row.planned_host_gb;
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
        << fmt(tps_gpu, "%.0f") << "," << fmt(mfu, "%.4f") << "," << fmt(ppl, "%.3f") << "," << fmt(ratio, "%.3f") << ","
        << fmt(mem_ratio, "%.3f") << "," << (claim ? fmt(claim->gb, "%.1f") : "") << "," << (claim ? fmt(claim->its, "%.1f") : "") << ","
        << (claim ? fmt(claim->ppl, "%.2f") : "") << "," << (row.oom ? 1 : 0) << ",\"" << error << "\"\n"
        << std::flush;

    std::string note = row.error;
    if (row.skipped > 0) note = std::to_string(row.skipped) + " step(s) skipped (fp16 overflow)" + (note.empty() ? "" : "; " + note);
    if (row.host_update_ms)
      note = "host ms/step: copies " + fmt(row.host_wait_ms, "%.0f") + " sumsq " + fmt(row.host_sumsq_ms, "%.0f") + " adamw " +
             fmt(row.host_update_ms, "%.0f") + (note.empty() ? "" : "; " + note);
    if (claim)
      note = fmt(claim->gb, "%.1f") + " " + fmt(claim->its, "%.1f") + " " + fmt(claim->ppl, "%.2f") + (note.empty() ? "" : " | " + note);
    std::printf("%-27s %3lld %8s %8s %6s %7s %9s %9s %6s %8s %7s %7s  %s\n", spec.name.c_str(), (long long)spec.batch,
                fmt(row.peak_gb, "%.2f").c_str(), fmt(row.planned_gb, "%.2f").c_str(), fmt(plan_ratio, "%.3f").c_str(),
                fmt(row.time_ms ? std::optional<double>(1e3 / *row.time_ms) : std::nullopt, "%.3f").c_str(), fmt(tps, "%.0f").c_str(),
                fmt(tps_gpu, "%.0f").c_str(), fmt(mfu, "%.3f").c_str(), fmt(ppl, "%.2f").c_str(), fmt(ratio, "%.3f").c_str(),
                fmt(mem_ratio, "%.3f").c_str(), note.c_str());
    std::fflush(stdout);
    if (dist.world > 1 && !row.error.empty()) {
      // Another rank may be inside a collective this one will never join: end the run, without destructors that
      // would wait on the communicator. The other ranks stop when the launcher sees this exit, or at --comm-timeout.
      std::fprintf(stderr,
                   "bench_table rank 0 of %d: row '%s' failed (%s); at world > 1 that ends the run (one row per launch "
                   "keeps the others)\n",
                   dist.world, spec.name.c_str(), row.error.c_str());
      std::fflush(stderr);
      std::_Exit(1);
    }
  }
  if (!dist.root()) return 0;
  std::printf(
      "peak: CUDA caching allocator, allocated bytes (the largest over the GPUs); plan: squeeze::plan peak() for the same\n"
      "strategy, shapes and world (no measurement goes into it); /plan = measured / planned; tok/s: all GPUs; MFU: %.4g model\n"
      "FLOPs/token (6N + 12 L T d) x tok/s/GPU over %.0f TFLOP/s (H100 SXM / H200 dense bf16); x peer: tokens/s over the peer's; mem x: "
      "peer's\n"
      "peak over ours.\n",
      model_flops, kHopperDenseBf16Flops / 1e12);
  if (o.preset == "tinyllama-1.1b" && config.layers == 22 && o.seq == 2048)
    std::printf(
        "reference (PyTorch + transformers, this GPU type, TinyLlama-1.1B B=8 T=2048): bf16 autocast 60.8 GB 48.7k tok/s;\n"
        "  + checkpointing 24.1 GB 35.2k tok/s; accumulation 4x2 31.2 GB 38.4k tok/s\n");
  std::printf(
      "widely shared claims, LLaMA-7B B=8 T=2048 (80 GB A100): baseline 72.3 GB 1.8 it/s ppl 3.21; ZeRO-3 21.5 GB 1.5 it/s 3.23;\n"
      "  accumulation(4) 18.9 GB 0.9 it/s 3.25; FP16 38.2 GB 2.4 it/s 3.28; ZeRO-3+FP16 16.1 GB 1.2 it/s 3.26\n"
      "  (fp32 Adam alone keeps 16 bytes/parameter = 107.8 GB at 7B: see README, 'The widely shared LLaMA-7B figures')\n"
      "LLaMA-7B reference (PyTorch, this GPU type): bf16 autocast + checkpointing B=1 109.1 GB 5.9k tok/s;\n"
      "  pure bf16 + checkpointing B=8 58.6 GB 9.0k tok/s\n");
  std::printf("wrote %s and %s (chart: python3 bench/table/chart.py %s)\n", o.out.c_str(), o.csv.c_str(), o.csv.c_str());
  return 0;
}

}  // namespace squeeze::table

int main(int argc, char** argv) { return squeeze::table::table_main(argc, argv); }
