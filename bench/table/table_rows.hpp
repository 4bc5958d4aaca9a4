#pragma once
// The strategy rows of the table, a share of them per translation unit: a part file defines SQUEEZE_TABLE_PART and
// includes this header (bench/table/CMakeLists.txt writes one per part), which instantiates run_strategy_part for it.
#include "table.hpp"

namespace squeeze::table {

using squeeze::llama::LlamaRun;

template <int Part, int Parts>
bool run_strategy_part(const RowSpec& spec, const Options& o, const nn::LlamaConfig& config, const Data& data, const Dist& d,
                       const torch::Device& device, const llama::TrainOptions& row_options, Row& row) {
  bool found = false;
  llama::for_each_strategy<Part, Parts>([&]<StrategyType S>(std::string_view name) {
    if (found || name != spec.name) return;
    found = true;
    row.strategy = strategy_name<S>();
    llama::TrainOptions topt = row_options;
    topt.mlp_tile_tokens = mlp_tile_for<S>(o, config, spec.batch, d.world, device, topt.loss_chunk_tokens);
    row.mlp_tile = topt.mlp_tile_tokens;
    topt.planned_batch = spec.batch, topt.planned_seq = o.seq;  // a step planned beyond the GPU is refused before it is built
    if constexpr (S::quantized_weights && S::has_lora) {        // built block by block: progress, and refused before allocating
      topt.layerwise.train = llama::train_shape<S>(config, spec.batch, o.seq, d.world, topt.loss_chunk_tokens, {}, topt.mlp_tile_tokens);
      topt.layerwise.progress = llama::build_progress(o.hf.empty() ? o.preset : o.hf, d.root());
    }
    const plan::MemoryPlan p = llama::plan_for<S>(config, spec.batch, o.seq, d.world, topt.loss_chunk_tokens, {}, topt.mlp_tile_tokens);
    row.planned_gb = double(p.peak().device) / 1e9;
    row.planned_host_gb = double(p.peak().host) / 1e9;
    if constexpr (S::quantized_weights && S::has_lora) {
      // peak_gb covers the build too: where the block-by-block build's own peak (a float block and the float
      // embedding and head beside the packed blocks) is above the step's, that is the row's planned peak
      if (device.is_cuda()) {
        nn::LayerwiseOptions lo = topt.layerwise;
        lo.device = device;
        const nn::LayerwiseMemory build = nn::layerwise_memory<S>(config, lo, !o.hf.empty());
        if (build.device_bytes > build.planned_step_bytes) {
          row.planned_build_gb = double(build.device_bytes) / 1e9;
          row.planned_gb = std::max(*row.planned_gb, *row.planned_build_gb);
        }
      }
    }
    llama::reset_peak_memory(device);
    std::ofstream("/proc/self/clear_refs") << "5";  // the host's high-water mark starts from here
    row.host_before_gb = llama::device_memory(torch::kCPU).current_gb;
    torch::manual_seed(1);
    std::optional<LlamaRun<S>> trainer;
    const auto built = std::chrono::steady_clock::now();
    if (o.hf.empty())
      trainer.emplace(config, topt, device, d.comm);  // d.comm null at world 1: one-rank LocalComm
    else
      trainer.emplace(LlamaRun<S>::from_hf(o.hf, topt, device, d.comm));
    row.build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - built).count();
    int64_t step_index = 0;
    const auto train_step = [&](const torch::Tensor& x, const torch::Tensor& y) {
      trainer->set_lr(lr_at(o, step_index++));
      const llama::BatchResult r = trainer->step(x, y);
      row.skipped += r.applied ? 0 : 1;
      row.transfers.h2d_bytes += r.transfers.h2d_bytes;
      row.transfers.d2h_bytes += r.transfers.d2h_bytes;
      row.transfers.h2d_copy_s += r.transfers.h2d_copy_s;
      row.transfers.copy_wait_s += r.transfers.copy_wait_s;
      if constexpr (S::stage <= 1) row.gradient_buffers = plan::to_string(trainer->trainer().options().gradient_buffers);
      return r.loss_value;
    };
    const auto sync = [&] { trainer->sync(); };
    run_steps(
        o, spec.batch, data, d, device, row, train_step, sync,
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
    profile_row(o, spec.batch, data, d, device, row, train_step, sync);
    if (d.world > 1) reduce_over_ranks(d, device, row);
  });
  return found;
}

#if defined(SQUEEZE_TABLE_PART)
template bool run_strategy_part<SQUEEZE_TABLE_PART, SQUEEZE_TABLE_PARTS>(const RowSpec&, const Options&, const nn::LlamaConfig&,
                                                                         const Data&, const Dist&, const torch::Device&,
                                                                         const llama::TrainOptions&, Row&);
#endif

}  // namespace squeeze::table
