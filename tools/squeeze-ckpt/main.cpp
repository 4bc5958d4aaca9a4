// squeeze-ckpt: inspect, verify, consolidate and reshard training checkpoints without a GPU or libtorch.
//
//   squeeze-ckpt info DIR [--step N]                          what a checkpoint holds
//   squeeze-ckpt verify DIR [--step N]                        sizes, SHA-256 and headers of every rank file
//   squeeze-ckpt consolidate DIR OUT.safetensors [--dtype bf16] [--step N]
//                                                             the trained weights in one file (fp32 masters where kept)
//   squeeze-ckpt consolidate DIR OUT_DIR --hf-config MODEL_DIR [--dtype bf16]
//                                                             ... as a Hugging Face LLaMA directory: Hugging Face names,
//                                                             MODEL_DIR's config.json (the model the run started from)
//   squeeze-ckpt reshard DIR OUT_DIR --world M [--step N]     the same checkpoint for M ranks
//
// DIR is a checkpoint root (the directory holding `latest`) or one step directory. Everything streams: no tensor
// and no shard is held whole except one target shard of one buffer while resharding.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <squeeze/io/checkpoint_store.hpp>
#include <squeeze/io/hf_config.hpp>
#include <squeeze/io/hf_names.hpp>
#include <squeeze/io/reshard.hpp>

namespace io = squeeze::io;
namespace fs = std::filesystem;

namespace {

io::CheckpointReader open(const std::string& dir, std::optional<long long> step, io::Verify verify) {
  const io::OpenOptions oo{.allow_reshard = true, .verify = verify};
  if (fs::exists(fs::path(dir) / "index.json")) return io::CheckpointReader::open(dir, oo);
  io::CheckpointStore store(dir);
  return step ? store.open(*step, oo) : store.open_latest(oo);
}

std::vector<io::FlatLayout> layouts_of(const io::CheckpointReader& r) {
  return io::flat_layouts_from_json(r.index().partitions, (r.dir() / "index.json").string());
}

int info(const io::CheckpointReader& r) {
  const io::CheckpointIndex& idx = r.index();
  const auto layouts = layouts_of(r);
  long long params = 0, elements = 0;
  for (const auto& l : layouts)
    for (const auto& e : l.entries) ++params, elements += e.numel;
  std::uint64_t bytes = 0;
  for (const auto& f : idx.files) bytes += f.bytes;
  std::printf("checkpoint  %s\nstep        %lld\nworld size  %d\nstage       %d\nstrategy    %s\n", r.dir().c_str(), (long long)idx.step,
              idx.world_size, idx.stage, idx.strategy.c_str());
  std::printf("parameters  %lld tensors, %lld elements, in %zu partitions\nfiles       %zu, %.3f MB\n", params, elements, layouts.size(),
              idx.files.size(), double(bytes) / 1e6);
  for (const char* key : {"state", "trainer", "frozen", "user"})
    if (idx.record.contains(key)) std::printf("%-11s %s\n", key, idx.record[key].dump().c_str());
  return 0;
}

int verify(const io::CheckpointReader& r) {
  for (const auto& f : r.index().files) std::printf("ok  %s  %llu bytes  sha256 %s\n", f.name.c_str(), (unsigned long long)f.bytes, f.sha256.c_str());
  std::printf("checkpoint %s verified: %zu files\n", r.dir().c_str(), r.index().files.size());
  return 0;
}

std::optional<io::DType> dtype_named(const std::string& s) {
  if (s.empty()) return std::nullopt;
  if (s == "fp32" || s == "F32") return io::DType::F32;
  if (s == "bf16" || s == "BF16") return io::DType::BF16;
  if (s == "fp16" || s == "F16") return io::DType::F16;
  throw squeeze::Error("--dtype must be fp32, bf16 or fp16, got '" + s + "'");
}

// One safetensors file of the weights; with `hf_config` (a Hugging Face model directory) a directory that
// LlamaForCausalLM.from_pretrained loads: the weights under Hugging Face names as OUT/model.safetensors, after
// checking that they are exactly the tensors that config's model has, and its config.json with the written dtype.
int consolidate(const io::CheckpointReader& r, const std::string& out, const std::string& dtype, const std::string& hf_config) {
  const bool masters = r.index().record.contains("state") && r.index().record["state"].value("masters", false);
  io::ConsolidateOptions o{.buffer = masters ? "master" : "param", .dtype = dtype_named(dtype)};
  o.metadata = {{"format", "pt"}, {"squeeze_strategy", r.index().strategy}, {"squeeze_step", std::to_string(r.index().step)}};
  const auto layouts = layouts_of(r);
  fs::path file = out;
  std::optional<io::LlamaConfig> config;
  if (!hf_config.empty()) {
    config = io::load_llama_config(hf_config);
    std::map<std::string, std::vector<std::int64_t>> found;  // Hugging Face name -> shape, as this checkpoint would write it
    std::vector<std::string> unnamed;
    try {
      for (const auto& l : layouts)
        for (const auto& e : l.entries) {
          if (const auto n = io::hf_name(e.name, *config)) found[*n] = e.shape;
          else unnamed.push_back(e.name);
        }
    } catch (const squeeze::Error& e) {
      throw squeeze::Error("consolidate --hf-config " + hf_config + ": this checkpoint is not of that model: " + e.what());
    }
    if (!unnamed.empty())
      throw squeeze::Error("consolidate --hf-config: parameter '" + unnamed.front() + "' (and " + std::to_string(unnamed.size() - 1) +
                           " more) has no Hugging Face name for the LLaMA of " + hf_config + " (is this checkpoint of that model?)");
    io::check_hf_tensors(found, *config).require_ok(r.dir().string() + " against " + (fs::path(hf_config) / "config.json").string());
    o.rename = [&](const std::string& name) { return *io::hf_name(name, *config); };
    fs::create_directories(out);
    file = fs::path(out) / "model.safetensors";
  }
  const io::WrittenFile f = io::consolidate(r, layouts, file, o);
  if (config) {
    config->dtype = r.rank_file(0).info(io::shard_tensor_name(layouts.front().key, o.buffer)).dtype;
    if (o.dtype) config->dtype = *o.dtype;
    io::save_llama_config(out, *config);
  }
  std::printf("wrote %s: %llu bytes (the %s buffer%s), sha256 %s\n", file.c_str(), (unsigned long long)f.bytes, o.buffer.c_str(),
              config ? ", Hugging Face names, config.json beside it" : "", f.sha256.c_str());
  return 0;
}

int reshard(const io::CheckpointReader& r, const std::string& out, int world) {
  const io::CheckpointIndex& idx = r.index();
  const auto layouts = layouts_of(r);
  const io::ReshardPlan plan = io::plan_reshard(layouts, r.world_size(), layouts, world);
  // Elementwise buffers present on every rank of every partition; 8-bit block scales cannot be cut elsewhere.
  std::vector<std::string> buffers;
  for (const auto& [name, info] : r.rank_file(0).tensors()) {
    const auto slash = name.rfind('/');
    if (slash == std::string::npos || name.starts_with("rng/")) continue;
    const std::string b = name.substr(slash + 1);
    if (b.ends_with("_absmax"))
      throw squeeze::Error("reshard: " + r.dir().string() + " keeps 8-bit Adam moments ('" + name +
                           "'): their block scales cover 256 elements of one partition and cannot be cut at other shard boundaries");
    if (std::find(buffers.begin(), buffers.end(), b) == buffers.end() && name == io::shard_tensor_name(layouts.front().key, b)) buffers.push_back(b);
  }
  io::CheckpointMeta meta{.world_size = world, .stage = idx.stage, .strategy = idx.strategy, .partitions = io::flat_layouts_to_json(layouts),
                          .record = idx.record};
  io::CheckpointStore store(out);
  io::CheckpointSave save = store.begin(idx.step, std::move(meta));
  for (int rank = 0; rank < world; ++rank) {
    std::vector<io::TensorView> views;
    for (std::size_t p = 0; p < layouts.size(); ++p)
      for (const std::string& b : buffers) {
        const io::DType dt = r.rank_file(0).info(io::shard_tensor_name(layouts[p].key, b)).dtype;
        const std::int64_t n = layouts[p].shard(world);
        // The target shard is read once, when the writer asks for its first chunk, and freed after its last.
        auto shard = std::make_shared<std::vector<std::byte>>();
        views.emplace_back(io::shard_tensor_name(layouts[p].key, b), dt, std::vector<std::int64_t>{n},
                           [&r, &plan, p, rank, b, shard](std::uint64_t off, std::span<std::byte> o) {
                             if (off == 0) {
                               shard->resize(std::size_t(plan.at(p, rank).elements) * io::dtype_size(r.rank_file(0).info(io::shard_tensor_name(plan.from[p].key, b)).dtype));
                               io::read_resharded(r, plan, p, rank, b, *shard);
                             }
                             std::copy_n(shard->data() + off, o.size(), o.data());
                             if (off + o.size() == shard->size()) std::vector<std::byte>().swap(*shard);
                           });
      }
    save.write_rank(rank, views);
  }
  const fs::path dir = save.commit();
  std::printf("wrote %s: world %d (from %d), %zu buffers per partition; generator states are not carried over\n", dir.c_str(), world,
              r.world_size(), buffers.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"squeeze-ckpt: inspect, verify, consolidate and reshard squeeze training checkpoints"};
  app.require_subcommand(1);
  std::string dir, out, dtype, hf_config;
  std::optional<long long> step;
  int world = 0;
  auto add_common = [&](CLI::App* c) {
    c->add_option("dir", dir, "checkpoint root (holding `latest`) or a step directory")->required();
    c->add_option("--step", step, "a step under the root (default: the one `latest` names)");
  };
  CLI::App* info_cmd = app.add_subcommand("info", "what a checkpoint holds");
  add_common(info_cmd);
  CLI::App* verify_cmd = app.add_subcommand("verify", "check every rank file's size, SHA-256 and header");
  add_common(verify_cmd);
  CLI::App* cons = app.add_subcommand("consolidate", "the trained weights in one safetensors file");
  add_common(cons);
  cons->add_option("out", out, "the safetensors file to write (with --hf-config: the directory)")->required();
  cons->add_option("--hf-config", hf_config, "the Hugging Face model directory the run started from: write its layout")->check(CLI::ExistingDirectory);
  cons->add_option("--dtype", dtype, "fp32, bf16 or fp16 (default: as stored)");
  CLI::App* resh = app.add_subcommand("reshard", "the same checkpoint for another number of ranks");
  add_common(resh);
  resh->add_option("out", out, "checkpoint root to write into")->required();
  resh->add_option("--world", world, "ranks of the new checkpoint")->required()->check(CLI::Range(1, io::kMaxCheckpointWorld));
  CLI11_PARSE(app, argc, argv);
  try {
    if (*info_cmd) return info(open(dir, step, io::Verify::sizes));
    if (*verify_cmd) return verify(open(dir, step, io::Verify::checksums));
    if (*cons) return consolidate(open(dir, step, io::Verify::checksums), out, dtype, hf_config);
    if (*resh) return reshard(open(dir, step, io::Verify::checksums), out, world);
  } catch (const std::exception& e) {
    std::cerr << "squeeze-ckpt: " << e.what() << "\n";
    return 1;
  }
  return 2;
}
