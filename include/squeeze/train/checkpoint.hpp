#pragma once
// Training checkpoints of a make_trainer trainer, on the storage layer of io/checkpoint_store.hpp:
//
//   squeeze::save_checkpoint(trainer, "/ckpt/run1", {{"batch", b}});  // every rank calls it (a collective)
//   nlohmann::json record = squeeze::load_checkpoint(trainer, "/ckpt/run1");  // the latest one; returns the record
//
// What is stored (docs/checkpoints.md has the layout): per optimizer partition its compute-type parameters, fp32
// masters, Adam moments (fp32, or 8-bit codes + block scales), each rank writing only its own shard (stage 0's
// replicated buffers: rank r writes slice r), so no rank gathers the model; the step counters and the loss scaler;
// every rank's CPU and CUDA generator states; a SHA-256 of the frozen tensors (a LoRA strategy's base: those are
// not written, only checked on load); the caller's record. Loading maps the saved layout onto the trainer's by
// parameter name (io/reshard.hpp), so another world size, stage, bucket size or offload setting loads too; what
// must agree is what the optimizer state is (masters or not, fp32 or 8-bit moments, the compute type, LoRA or full
// weights). 8-bit moments reload only into the same layout at the same world size (their block scales cover 256
// elements each and cannot be cut elsewhere).
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "squeeze/io/checkpoint_store.hpp"
#include "squeeze/io/reshard.hpp"
#include "squeeze/io/sha256.hpp"
#include "squeeze/kernels/adamw8.hpp"
#include "squeeze/policy/strategy_name.hpp"
#include "squeeze/engine/collectives.hpp"
#include "squeeze/engine/io_dtypes.hpp"
#include "squeeze/engine/offload.hpp"

namespace squeeze {

namespace train {
using namespace squeeze::engine;  // the trainer's floor (train/parts/context.hpp says why)
}  // namespace train

struct CheckpointSaveOptions {
  int keep_last = 3;         // checkpoints kept under the root, the newest first (0: all)
  io::FaultHook fault_hook;  // tests: called after every durable step of the save (io/checkpoint_store.hpp)
};

struct CheckpointLoadOptions {
  std::optional<int64_t> step;                // a step directory under the root; empty: the one `latest` names
  io::Verify verify = io::Verify::checksums;  // what open() proves before anything is read
};

namespace train::detail {

using train::io_dtype;

// A contiguous tensor as bytes for the writer: borrowed on the host, staged chunk by chunk from a device.
inline io::TensorView view_of(std::string name, const torch::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), "checkpoint: tensor '", name, "' is not contiguous");
  std::vector<std::int64_t> shape(t.sizes().begin(), t.sizes().end());
  if (t.is_cpu()) return io::TensorView(std::move(name), io_dtype(t.scalar_type()), std::move(shape), t.data_ptr(), t.nbytes());
  const torch::Tensor bytes = t.reshape({-1}).view(torch::kUInt8);  // [nbytes]
  return io::TensorView(std::move(name), io_dtype(t.scalar_type()), std::move(shape), [bytes](std::uint64_t off, std::span<std::byte> out) {
    torch::from_blob(out.data(), {int64_t(out.size())}, torch::kUInt8).copy_(bytes.narrow(0, int64_t(off), int64_t(out.size())));
  });
}

// Reads `into` (contiguous, any device) from a reader callback that fills host bytes; returns the stored dtype.
template <class Read>
io::DType read_into(const torch::Tensor& into, Read&& read) {
  TORCH_CHECK(into.is_contiguous(), "checkpoint: a loaded buffer must be contiguous");
  torch::Tensor host = into.is_cpu() ? into : torch::empty(into.sizes(), into.options().device(torch::kCPU));
  const io::DType stored = read(std::span<std::byte>(static_cast<std::byte*>(host.data_ptr()), host.nbytes()));
  if (!into.is_cpu()) into.copy_(host);
  return stored;
}

// The tensors a trainer does not train (a LoRA strategy's frozen base; any module buffer), by name.
inline std::vector<std::pair<std::string, torch::Tensor>> frozen_tensors(torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : m.named_parameters())
    if (!p.value().requires_grad() && p.value().numel() > 0) out.emplace_back(p.key(), p.value());
  for (const auto& b : m.named_buffers())
    if (b.value().numel() > 0) out.emplace_back(b.key(), b.value());
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

// SHA-256 over (name, dtype, shape, bytes) of every frozen tensor, streamed in 64 MiB pieces from any device.
inline nlohmann::json frozen_digest(torch::nn::Module& m) {
  io::Sha256 h;
  int64_t bytes = 0, count = 0;
  auto add_text = [&](const std::string& s) { h.update(std::as_bytes(std::span<const char>(s.data(), s.size() + 1))); };
  for (const auto& [name, t] : frozen_tensors(m)) {
    std::string head = name + " " + std::string(c10::toString(t.scalar_type())) + " [";
    for (auto d : t.sizes()) head += std::to_string(d) + ",";
    add_text(head + "]");
    const torch::Tensor flat = t.detach().contiguous().reshape({-1}).view(torch::kUInt8);  // [nbytes]
    constexpr int64_t kPiece = int64_t(64) << 20;
    for (int64_t off = 0; off < flat.numel(); off += kPiece) {
      const torch::Tensor piece = flat.narrow(0, off, std::min(kPiece, flat.numel() - off)).cpu().contiguous();
      h.update(std::span<const std::byte>(static_cast<const std::byte*>(piece.data_ptr()), size_t(piece.numel())));
    }
    bytes += int64_t(t.nbytes());
    ++count;
  }
  return {{"sha256", h.hex()}, {"tensors", count}, {"bytes", bytes}};
}

// What the optimizer state is: a checkpoint loads only where this agrees (everything else may differ).
template <class S>
nlohmann::json state_kind() {
  using C = typename S::compute_type;
  return {{"weights", S::has_lora ? "lora-adapters" : "full"},
          {"compute", std::is_same_v<C, float>  ? "fp32"
                      : std::is_same_v<C, bf16> ? "bf16"
                                                : "fp16"},
          {"masters", S::has_master_copy && !S::has_lora},
          {"moments", S::state_bits == 8 ? "8-bit" : "fp32"}};
}

// The generator states of this process: the CPU's and every visible CUDA device's, as uint8 tensors.
inline std::vector<at::Generator> generators(std::vector<std::string>* names = nullptr) {
  std::vector<at::Generator> out{at::detail::getDefaultCPUGenerator()};
  if (names) names->push_back("rng/cpu");
  for (int d = 0; d < int(torch::cuda::device_count()); ++d) {
    out.push_back(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, c10::DeviceIndex(d))));
    if (names) names->push_back("rng/cuda" + std::to_string(d));
  }
  return out;
}
inline std::vector<std::pair<std::string, torch::Tensor>> rng_states() {
  std::vector<std::string> names;
  std::vector<std::pair<std::string, torch::Tensor>> out;
  auto gens = generators(&names);
  for (size_t i = 0; i < gens.size(); ++i) {
    std::lock_guard<std::mutex> lock(gens[i].mutex());
    out.emplace_back(names[i], gens[i].get_state());
  }
  return out;
}
inline void set_rng_state(const std::string& name, const torch::Tensor& state) {
  std::vector<std::string> names;
  auto gens = generators(&names);
  for (size_t i = 0; i < gens.size(); ++i)
    if (names[i] == name) {  // a device this process does not see is skipped
      std::lock_guard<std::mutex> lock(gens[i].mutex());
      gens[i].set_state(state);
    }
}

inline io::CheckpointReader open_checkpoint(const std::filesystem::path& root, const CheckpointLoadOptions& opt, io::OpenOptions oo) {
  oo.verify = opt.verify;
  io::CheckpointStore store(root);
  return opt.step ? store.open(*opt.step, oo) : store.open_latest(oo);
}

template <class TrainerT>
std::vector<io::FlatLayout> layouts_of(const std::vector<typename TrainerT::PartitionBuffers>& parts) {
  std::vector<io::FlatLayout> out;
  for (const auto& p : parts) {
    out.push_back(io::flat_layout_of(p.key, *p.layout, p.align));
    for (std::size_t k = 0; k < p.groups.size(); ++k) out.back().entries[k].group = p.groups[k];
  }
  return out;
}

// 8-bit moments across a change of world or layout (load_checkpoint): each target value is decoded from its saved
// code and the absmax of the block it was saved in, then encoded again over the target's blocks. Bit for bit where
// a block keeps its elements; elsewhere a value moves by at most half a code step of its new block.
template <class PB>
void load_8bit_moments_resharded(const io::CheckpointReader& r, const io::ReshardPlan& plan, std::size_t i, const PB& p, int world,
                                 int rank) {
  const io::FlatLayout& tl = plan.to[i];
  const int64_t shard = tl.shard(world);
  const int64_t n = p.whole ? int64_t(world) * shard : shard;  // the target buffer: whole (stage 0) or this rank's shard
  const auto group = [](const io::FlatLayoutEntry& e) { return e.group; };
  const std::vector<Segment> target = state_segments(tl.entries, tl.padded(world), p.whole ? 0 : int64_t(rank) * shard, n, group);
  const int64_t blocks = target.empty() ? 0 : target.back().block + kernels::state_blocks(target.back().len);
  for (const std::string b : {"m", "v"}) {
    const kernels::StateCodeMap& map = b == "m" ? kernels::signed_state_map() : kernels::unsigned_state_map();
    // A saved partition's block scales and block cut per saved rank (whole: rank 0's cover the whole buffer).
    struct Saved {
      std::vector<float> absmax;
      std::vector<Segment> segments;
      int64_t first = 0;  // the saved rank's first element in the buffer the segments cut
    };
    std::map<std::pair<int, int>, Saved> saved;
    auto saved_of = [&](int sp, int sr) -> const Saved& {
      auto it = saved.find({sp, sr});
      if (it != saved.end()) return it->second;
      const io::FlatLayout& fl = plan.from[std::size_t(sp)];
      const int64_t src_shard = fl.shard(plan.from_world);
      const std::string scales = io::shard_tensor_name(fl.key, b + "_absmax");
      const bool whole = plan.from_world > 1 && !r.rank_file(1).contains(scales);
      Saved v;
      v.absmax = r.read_rank_as<float>(whole ? 0 : sr, scales, io::DType::F32);
      v.first = whole ? int64_t(sr) * src_shard : 0;
      v.segments = whole ? state_segments(fl.entries, fl.padded(plan.from_world), 0, fl.padded(plan.from_world), group)
                         : state_segments(fl.entries, fl.padded(plan.from_world), int64_t(sr) * src_shard, src_shard, group);
      return saved.emplace(std::make_pair(sp, sr), std::move(v)).first->second;
    };
    std::vector<float> values(static_cast<std::size_t>(n), 0.0f);  // gaps stay 0
    std::vector<std::uint8_t> codes;
    for (int tr = p.whole ? 0 : rank; tr < (p.whole ? world : rank + 1); ++tr)
      for (const io::CopySegment& c : plan.at(i, tr).segments) {
        if (c.zero_fill()) continue;
        const Saved& sv = saved_of(c.src_partition, c.src_rank);
        codes.resize(std::size_t(c.count));
        r.read_rank_range(c.src_rank, io::shard_tensor_name(plan.from[std::size_t(c.src_partition)].key, b), uint64_t(c.src_offset),
                          std::as_writable_bytes(std::span(codes)));
        float* out = values.data() + (p.whole ? int64_t(tr) * shard : 0) + c.dst_offset;
        std::size_t seg = 0;
        for (int64_t k = 0; k < c.count; ++k) {
          const int64_t e = sv.first + c.src_offset + k;  // the element in the saved rank's segments' coordinates
          while (seg + 1 < sv.segments.size() && e >= sv.segments[seg].begin + sv.segments[seg].len) ++seg;
          const Segment& sg = sv.segments[seg];
          const int64_t block = sg.block + (e - sg.begin) / kernels::kStateBlock;
          TORCH_CHECK(e >= sg.begin && block < int64_t(sv.absmax.size()), "load_checkpoint: 8-bit moment '", b, "' of partition '",
                      plan.from[std::size_t(c.src_partition)].key, "' has no block scale for element ", e, " (a damaged index?)");
          out[k] = map.value[codes[std::size_t(k)]] * sv.absmax[std::size_t(block)];
        }
      }
    std::vector<std::uint8_t> new_codes(static_cast<std::size_t>(n));
    std::vector<float> new_absmax(static_cast<std::size_t>(blocks));
    for (const Segment& sg : target)
      kernels::quantize_blockwise(map, values.data() + sg.begin, sg.len, new_codes.data() + sg.begin, new_absmax.data() + sg.block);
    const auto find = [&](const auto& list, const std::string& name) {
      for (const auto& [k, t] : list)
        if (k == name) return t;
      TORCH_CHECK(false, "load_checkpoint: the trainer has no 8-bit buffer '", name, "'");
      return torch::Tensor();
    };
    const torch::Tensor dst = find(p.elementwise, b), dst_scales = find(p.blockwise, b + "_absmax");
    TORCH_CHECK(dst.numel() == n && dst_scales.numel() == blocks, "load_checkpoint: partition '", tl.key, "': the trainer's 8-bit '", b,
                "' holds ", dst.numel(), " codes and ", dst_scales.numel(), " block scales; its layout cuts ", n, " and ", blocks);
    dst.copy_(torch::from_blob(new_codes.data(), {n}, torch::kUInt8));
    dst_scales.copy_(torch::from_blob(new_absmax.data(), {blocks}, torch::kFloat32));
  }
}

}  // namespace train::detail

// Writes a checkpoint of `trainer` at its current step under `root` (step-NNNNNN/, then `latest` moves to it):
// every rank calls it at the same point, between optimizer steps (not inside an accumulation window). `record`
// is the caller's small JSON (data position, ...), returned by load_checkpoint. Returns the step directory.
template <class TrainerT>
std::filesystem::path save_checkpoint(TrainerT& trainer, const std::filesystem::path& root,
                                      nlohmann::json record = nlohmann::json::object(), const CheckpointSaveOptions& opt = {}) {
  using S = typename TrainerT::strategy;
  TORCH_CHECK(trainer.micro_step() == 0, "save_checkpoint: the trainer is inside an accumulation window (", trainer.micro_step(), " of ",
              S::accumulation_steps, " micro-batches stepped): save after a step() that returned boundary = true");
  comm::Communicator& c = trainer.communicator();
  const int rank = c.rank(), world = c.size();
  const auto parts = trainer.partition_buffers();
  const auto layouts = train::detail::layouts_of<TrainerT>(parts);

  // The index: layouts, what the state is, the counters, the frozen base's digest, the caller's record.
  const auto& scaler = trainer.loss_scaler();
  io::CheckpointMeta meta{.world_size = world,
                          .stage = S::stage,
                          .strategy = strategy_name<S>(),
                          .partitions = io::flat_layouts_to_json(layouts),
                          .record = {{"state", train::detail::state_kind<S>()},
                                     {"trainer",
                                      {{"steps_applied", trainer.steps_applied()},
                                       {"steps_skipped", trainer.steps_skipped()},
                                       {"loss_scale", double(trainer.scale())},
                                       {"good_steps", int64_t(scaler.state().growth_tracker)},
                                       {"lr", double(trainer.lr())}}},
                                     {"frozen", train::detail::frozen_digest(trainer.module())},
                                     {"user", std::move(record)}}};
  io::CheckpointStore store(root, {.keep_last = opt.keep_last, .fault_hook = opt.fault_hook});
  const int64_t step = trainer.steps_applied();

  // Rank 0 starts the save; the others join it by its token (broadcast as 64 bytes on the trainer's device).
  std::optional<io::CheckpointSave> save;
  std::string token;
  if (rank == 0) save.emplace(store.begin(step, std::move(meta))), token = save->token();
  if (world > 1) {
    const torch::Device dev = parts.front().elementwise.front().second.device();
    torch::Tensor t = torch::zeros({64}, torch::TensorOptions().dtype(torch::kUInt8));
    std::memcpy(t.data_ptr(), token.data(), std::min<size_t>(token.size(), 63));
    t = t.to(dev);
    train::broadcast_inplace(c, t, 0);
    t = t.cpu();
    token = std::string(static_cast<const char*>(t.data_ptr()));
    if (rank != 0) save.emplace(store.join(step, token, world));
  }

  // This rank's file: its slice (stage 0) or shard of every elementwise buffer; block scales whole (rank 0 alone
  // for stage 0's replicated partition); its generator states.
  std::vector<torch::Tensor> keep;  // host copies the views borrow
  std::vector<io::TensorView> views;
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& p = parts[i];
    const int64_t shard = layouts[i].shard(world);
    for (const auto& [name, t] : p.elementwise) {
      const torch::Tensor mine = p.whole ? t.narrow(0, int64_t(rank) * shard, shard) : t;
      TORCH_CHECK(mine.numel() == shard, "save_checkpoint: partition '", p.key, "' buffer '", name, "' holds ", mine.numel(),
                  " elements, its layout's shard ", shard);
      views.push_back(train::detail::view_of(io::shard_tensor_name(p.key, name), mine.contiguous()));
    }
    if (!p.whole || rank == 0)
      for (const auto& [name, t] : p.blockwise) views.push_back(train::detail::view_of(io::shard_tensor_name(p.key, name), t));
  }
  for (auto& [name, t] : train::detail::rng_states()) {
    keep.push_back(t.contiguous());
    views.push_back(train::detail::view_of(name, keep.back()));
  }
  save->write_rank(rank, views);
  c.barrier();
  std::filesystem::path dir = store.step_dir(step);
  if (rank == 0) dir = save->commit();
  c.barrier();
  return dir;
}

// Loads a checkpoint under `root` into `trainer` (every rank calls it): the one `latest` names, or opt.step.
// Refuses, changing nothing, a checkpoint whose optimizer state is of another kind, whose parameters differ by
// name or shape, or whose frozen base differs from this model's. Returns the record given to save_checkpoint.
template <class TrainerT>
nlohmann::json load_checkpoint(TrainerT& trainer, const std::filesystem::path& root, const CheckpointLoadOptions& opt = {}) {
  using S = typename TrainerT::strategy;
  TORCH_CHECK(trainer.micro_step() == 0, "load_checkpoint: the trainer is inside an accumulation window (", trainer.micro_step(), " of ",
              S::accumulation_steps, " micro-batches stepped): load before stepping, or after a boundary");
  comm::Communicator& c = trainer.communicator();
  const int rank = c.rank(), world = c.size();
  const io::CheckpointReader r = train::detail::open_checkpoint(root, opt, {.world_size = world, .allow_reshard = true});
  const io::CheckpointIndex& idx = r.index();
  const std::string where = "checkpoint " + r.dir().string();
  const nlohmann::json& rec = idx.record;
  TORCH_CHECK(rec.contains("state") && rec.contains("trainer") && rec.contains("frozen"), where,
              ": not a trainer checkpoint (its index has no state/trainer/frozen records)");
  const nlohmann::json mine = train::detail::state_kind<S>();
  const nlohmann::json& saved = rec["state"];
  // The compute type and the masters convert (fp32 weights become masters, masters become fp32 weights, 16-bit
  // weights are rounded from the fp32 values); what is trained and the moments' format must agree.
  TORCH_CHECK(saved.value("weights", std::string()) == mine["weights"].get<std::string>() &&
                  saved.value("moments", std::string()) == mine["moments"].get<std::string>(),
              where, " was written by ", idx.strategy, " (optimizer state ", saved.dump(), "); this trainer (", strategy_name<S>(),
              ") keeps ", mine.dump(), ": load it into a strategy that trains the same weights with the same kind of moments");
  const bool saved_masters = saved.value("masters", false);
  const nlohmann::json frozen = train::detail::frozen_digest(trainer.module());
  TORCH_CHECK(rec["frozen"]["sha256"] == frozen["sha256"], where, ": the frozen tensors (", rec["frozen"]["tensors"].dump(),
              " tensors, a LoRA strategy's base) differ from this model's (", frozen["tensors"].dump(), " tensors, sha256 ",
              frozen["sha256"].get<std::string>().substr(0, 12), "...): build the model the checkpoint was trained on");

  auto parts = trainer.partition_buffers();
  const auto to = train::detail::layouts_of<TrainerT>(parts);
  const auto from = io::flat_layouts_from_json(idx.partitions, where + "/index.json");
  const io::ReshardPlan plan = io::plan_reshard(from, r.world_size(), to, world);  // refuses differing parameters by name
  // Layouts compare without their parameter groups (checkpoints before groups were recorded have none), unless both
  // record them: 8-bit moments need the saved groups to decode at another layout.
  const auto without_groups = [](std::vector<io::FlatLayout> ls) {
    for (auto& l : ls)
      for (auto& e : l.entries) e.group = -1;
    return io::flat_layouts_to_json(ls);
  };
  bool groups_recorded = true;
  for (const auto& l : from)
    for (const auto& e : l.entries) groups_recorded &= e.group >= 0;
  const bool same_layout = r.world_size() == world && without_groups(from) == without_groups(to) &&
                           (!groups_recorded || io::flat_layouts_to_json(from) == io::flat_layouts_to_json(to));
  constexpr bool k8bit = S::state_bits == 8;
  if constexpr (k8bit)
    TORCH_CHECK(
        same_layout || groups_recorded, where, ": its 8-bit Adam moments were saved without their parameter groups, so they reload ",
        "only into the layout they were saved from (world ", r.world_size(), ", the same stage and buckets); this trainer's world is ",
        world, " or its partitions differ. Resume at the saved world size and strategy");
  const bool reencode_8bit = k8bit && !same_layout;  // decode and encode the moments at the new blocks

  // Read everything into the trainer's buffers (nothing was changed before the checks above).
  trainer.sync();
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& p = parts[i];
    const int64_t shard = to[i].shard(world);
    if (reencode_8bit) train::detail::load_8bit_moments_resharded(r, plan, i, p, world, rank);
    for (const auto& [name, t] : p.elementwise) {
      if (reencode_8bit && (name == "m" || name == "v")) continue;
      for (int tr = p.whole ? 0 : rank; tr < (p.whole ? world : rank + 1); ++tr) {
        const torch::Tensor dst = p.whole ? t.narrow(0, int64_t(tr) * shard, shard) : t;
        // Where the values come from: the buffer of that name, except across a change of precision (fp32 weights
        // from masters, masters from fp32 weights).
        const io::DType want = train::detail::io_dtype(t.scalar_type());
        const auto stored_as = [&](const std::string& b) { return r.rank_file(0).info(io::shard_tensor_name(from.front().key, b)).dtype; };
        std::string source = name;
        if (name == "param" && saved_masters && stored_as("param") != want) source = "master";
        if (name == "master" && !saved_masters) source = "param";
        const io::DType stored = stored_as(source);
        TORCH_CHECK(stored == want || name == "param" || (name == "master" && stored == io::DType::F32), where, ": buffer '", source,
                    "' is stored as ", io::dtype_name(stored), ", this trainer's '", name, "' is ", t.scalar_type());
        // The same layout reads each shard as stored, alignment gaps included (an 8-bit code's zero is not byte 0);
        // another one goes parameter by parameter through the plan, gaps zero-filled.
        const std::string n = io::shard_tensor_name(p.key, source);
        const auto read = [&](std::span<std::byte> out) {
          if (!same_layout) return io::read_resharded(r, plan, i, tr, source, out);
          r.expect_tensor(tr, n, stored, {shard});
          r.read_rank_into(tr, n, out);
          return stored;
        };
        if (stored == want) {
          train::detail::read_into(dst, read);
        } else {  // widened exactly, or rounded to nearest even as the trainer rounds its masters
          torch::Tensor host = torch::empty({shard}, torch::TensorOptions().dtype(train::scalar_type(stored)));  // [shard]
          train::detail::read_into(host, read);
          dst.copy_(host);
        }
      }
    }
    for (const auto& [name, t] : p.blockwise) {
      if (reencode_8bit) break;
      const std::string n = io::shard_tensor_name(p.key, name);
      const int src = p.whole ? 0 : rank;
      r.expect_tensor(src, n, io::DType::F32, std::vector<std::int64_t>{t.numel()});
      train::detail::read_into(t, [&](std::span<std::byte> out) { return r.read_rank_into(src, n, out), io::DType::F32; });
    }
  }
  trainer.share_loaded_parameters();
  // Generator states: this rank's, when the checkpoint had this rank.
  if (rank < r.world_size())
    for (const auto& [name, info] : r.rank_file(rank).tensors())
      if (name.starts_with("rng/")) {
        auto bytes = r.read_rank(rank, name);
        torch::Tensor t = torch::empty({int64_t(bytes.size())}, torch::kUInt8);
        std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
        train::detail::set_rng_state(name, t);
      }
  const nlohmann::json& tr = rec["trainer"];
  trainer.restore_counters(tr["steps_applied"].get<int64_t>(), float(tr["loss_scale"].get<double>()), tr["good_steps"].get<int64_t>(),
                           tr["steps_skipped"].get<int64_t>());
  c.barrier();
  return rec.contains("user") ? rec["user"] : nlohmann::json::object();
}

// The trained weights of a checkpoint (fp32 masters where it has them, else the compute-type parameters) copied into
// `model`'s parameters of the same names, converted to their dtype: for evaluation, quantization or export without a
// trainer. One partition is read at a time. Every trainable parameter of the model must be in the checkpoint; what
// the checkpoint does not hold (a LoRA strategy's frozen base) is left as it is. Returns the caller's record.
inline nlohmann::json load_checkpoint_weights(torch::nn::Module& model, const std::filesystem::path& root,
                                              const CheckpointLoadOptions& opt = {}) {
  const io::CheckpointReader r = train::detail::open_checkpoint(root, opt, {.allow_reshard = true});
  const io::CheckpointIndex& idx = r.index();
  const std::string where = "checkpoint " + r.dir().string();
  TORCH_CHECK(idx.record.contains("state"), where, ": not a trainer checkpoint (its index has no state record)");
  const bool masters = idx.record["state"].value("masters", false);
  const auto layouts = io::flat_layouts_from_json(idx.partitions, where + "/index.json");
  const io::ReshardPlan whole = io::plan_reshard(layouts, r.world_size(), layouts, 1);  // each partition's whole buffer
  std::map<std::string, torch::Tensor> params;
  for (const auto& p : model.named_parameters()) params.emplace(p.key(), p.value());
  std::set<std::string> loaded;
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < layouts.size(); ++i) {
    const std::string buffer = masters ? "master" : "param";
    const io::DType dt = io::detail::check_shard_tensors(r, layouts, buffer);
    torch::Tensor flat = torch::empty({layouts[i].padded(1)}, torch::TensorOptions().dtype(train::scalar_type(dt)));  // [padded]
    io::read_resharded(r, whole, i, 0, buffer, std::span<std::byte>(static_cast<std::byte*>(flat.data_ptr()), flat.nbytes()));
    for (const auto& e : layouts[i].entries) {
      const auto it = params.find(e.name);
      TORCH_CHECK(it != params.end(), where, " holds parameter '", e.name, "', which this model does not have");
      TORCH_CHECK(it->second.sizes() == c10::IntArrayRef(e.shape), where, ": parameter '", e.name, "' is ", c10::IntArrayRef(e.shape),
                  " there, ", it->second.sizes(), " in this model");
      it->second.copy_(flat.narrow(0, e.offset, e.numel).view(e.shape));
      loaded.insert(e.name);
    }
  }
  for (const auto& [name, p] : params)
    TORCH_CHECK(!p.requires_grad() || loaded.count(name), where, " has no values for the model's trainable parameter '", name, "'");
  return idx.record.contains("user") ? idx.record["user"] : nlohmann::json::object();
}

}  // namespace squeeze
