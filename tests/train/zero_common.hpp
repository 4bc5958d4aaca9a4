#pragma once
// Shared by test_zero (CPU), test_zero_cuda (GPU), test_zero_nccl (one process per GPU) and test_step_graph: models, data, a
// multi-rank training run, comparisons.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <c10/core/DeviceGuard.h>
#if defined(SQUEEZE_TORCH_CUDA)
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#endif

#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <squeeze/comm/local.hpp>
#include <squeeze/engine/flat_params.hpp>
#include <squeeze/nn/layers.hpp>
#include <squeeze/nn/llama.hpp>
#include <squeeze/train/trainer.hpp>
#include <squeeze/optim/adamw.hpp>

namespace zero_test {

using namespace squeeze;
using squeeze::comm::LocalComm;
using squeeze::comm::run_ranks;
namespace F = torch::nn::functional;

// For the mains of the CPU tests that compare runs bit for bit: one intra-op thread (the ranks are threads already)
// and MKL's conditional numerical reproducibility. Without the latter MKL may take a different code path for
// differently aligned buffers, so two trainings that should agree bit for bit differ by an ulp:
// Zero/WorldParam.MlpFloatAccumulate4/world2 (Stage1 against Stage0) failed 3 of 60 runs with torch 2.15 on 2 cores,
// 0 of 180 with MKL_CBWR=COMPATIBLE. Call first in main, before anything reaches MKL (it reads the variable once).
inline void reproducible_cpu_math() {
  setenv("MKL_CBWR", "COMPATIBLE", /*overwrite=*/0);
  at::set_num_threads(1);
}

struct Hyper {  // the AdamW hyper-parameters (optim::AdamW has the same fields)
  float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.1f;
};

// The ZeRO tests' trainer: their models keep a few plain parameters on the root module (kept whole under Stage 3:
// replicate "*") and their float64 reference decays every parameter as torch::optim::AdamW does.
// One way to train: make_trainer with those options spelled out.
template <StrategyType S, class M, class O>
auto zero_trainer(M& model, O hyper, comm::CommPtr comm, train::TrainerOptions opt = {}) {
  opt.replicate.push_back("*");
  opt.decay_norms_biases_embeddings = true;
  opt.gradient_buffers = squeeze::train::GradientBuffers::kept;  // the accounting tests read the stage 0/1 gradient buffers after training
  return make_trainer<S>(model, hyper, std::move(comm), std::move(opt));
}

// ---- models ------------------------------------------------------------------------------------------
// Sizes that do not divide by 2, 3 or 4; `gain` is a plain parameter (not shardable): stage 3 keeps it whole.
struct MLPImpl : torch::nn::Module {
  nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
  torch::Tensor gain;
  MLPImpl() {
    fc1 = register_module("fc1", nn::Linear(7, 19));
    fc2 = register_module("fc2", nn::Linear(19, 19));
    fc3 = register_module("fc3", nn::Linear(19, 5));
    gain = register_parameter("gain", torch::ones({19}) + 0.1 * torch::randn({19}));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // x: [B, 7] -> [B, 5]
    auto h = torch::tanh(fc1(x));
    h = torch::tanh(fc2(h)) * gain;
    return fc3(h);
  }
  torch::Tensor loss(const torch::Tensor& x, const torch::Tensor& y) { return F::mse_loss(forward(x), y); }
};
TORCH_MODULE(MLP);

// Two LLaMA-like blocks: RMSNorm -> causal attention (q, k, v, o) -> residual -> RMSNorm -> SwiGLU, embedding
// and untied head; parameters exactly as plan::ModelShape counts them (no biases).
struct TinyLlamaImpl : torch::nn::Module {
  plan::ModelShape shape;
  nn::Embedding embed{nullptr};
  nn::Linear head{nullptr};
  std::vector<nn::Linear> q, k, v, o, gate, up, down;
  std::vector<torch::Tensor> attn_norm, mlp_norm;
  torch::Tensor final_norm;
  explicit TinyLlamaImpl(plan::ModelShape s) : shape(s) {
    const int64_t h = s.hidden, kv = s.kv_dim();
    embed = register_module("embed", nn::Embedding(s.vocab, h));
    for (int64_t l = 0; l < s.layers; ++l) {
      const std::string p = "layer" + std::to_string(l) + "_";
      attn_norm.push_back(register_parameter(p + "attn_norm", torch::ones({h})));
      q.push_back(register_module(p + "q", nn::Linear(torch::nn::LinearOptions(h, h).bias(false))));
      k.push_back(register_module(p + "k", nn::Linear(torch::nn::LinearOptions(h, kv).bias(false))));
      v.push_back(register_module(p + "v", nn::Linear(torch::nn::LinearOptions(h, kv).bias(false))));
      o.push_back(register_module(p + "o", nn::Linear(torch::nn::LinearOptions(h, h).bias(false))));
      mlp_norm.push_back(register_parameter(p + "mlp_norm", torch::ones({h})));
      gate.push_back(register_module(p + "gate", nn::Linear(torch::nn::LinearOptions(h, s.ffn).bias(false))));
      up.push_back(register_module(p + "up", nn::Linear(torch::nn::LinearOptions(h, s.ffn).bias(false))));
      down.push_back(register_module(p + "down", nn::Linear(torch::nn::LinearOptions(s.ffn, h).bias(false))));
    }
    final_norm = register_parameter("final_norm", torch::ones({h}));
    head = register_module("head", nn::Linear(torch::nn::LinearOptions(h, s.vocab).bias(false)));
  }
  static torch::Tensor rms(const torch::Tensor& x, const torch::Tensor& g) {
    const auto xf = x.to(torch::kFloat32);
    return (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + 1e-5)).to(x.scalar_type()) * g;
  }
  torch::Tensor loss(const torch::Tensor& tokens) {  // tokens: [B, T+1] int64
    const int64_t B = tokens.size(0), T = tokens.size(1) - 1, H = shape.heads, Hkv = shape.kv_heads, D = shape.head_dim();
    auto x = embed(tokens.narrow(1, 0, T));  // [B, T, h]
    const auto mask = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(tokens.device())).triu(1);
    for (int64_t l = 0; l < shape.layers; ++l) {
      auto a = rms(x, attn_norm[l]);
      auto qh = q[l](a).view({B, T, H, D}).transpose(1, 2);  // [B, H, T, D]
      auto kh = k[l](a).view({B, T, Hkv, D}).transpose(1, 2).repeat_interleave(H / Hkv, 1);
      auto vh = v[l](a).view({B, T, Hkv, D}).transpose(1, 2).repeat_interleave(H / Hkv, 1);
      auto s = torch::matmul(qh, kh.transpose(-1, -2)) / std::sqrt(double(D));
      auto p = torch::softmax(s.masked_fill(mask, -1e9).to(torch::kFloat32), -1).to(x.scalar_type());
      x = x + o[l](torch::matmul(p, vh).transpose(1, 2).reshape({B, T, H * D}));
      auto m = rms(x, mlp_norm[l]);
      x = x + down[l](F::silu(gate[l](m)) * up[l](m));
    }
    auto logits = head(rms(x, final_norm)).to(torch::kFloat32);  // [B, T, V]
    return F::cross_entropy(logits.reshape({B * T, shape.vocab}), tokens.narrow(1, 1, T).reshape({B * T}));
  }
};
TORCH_MODULE(TinyLlama);

const plan::ModelShape kLlamaShape{/*vocab=*/37, /*hidden=*/16, /*layers=*/2, /*heads=*/4, /*kv_heads=*/2, /*ffn=*/24};

enum class Model { mlp, llama };

// Micro-batch data: data[step][rank]; every rank sees different rows.
struct Data {
  std::vector<std::vector<torch::Tensor>> x, y;
};
Data make_data(Model kind, int world, int micro_steps, int64_t rows) {
  torch::manual_seed(4321);
  Data d;
  for (int s = 0; s < micro_steps; ++s) {
    d.x.emplace_back();
    d.y.emplace_back();
    for (int r = 0; r < world; ++r) {
      if (kind == Model::mlp) {
        d.x.back().push_back(torch::randn({rows, 7}));
        d.y.back().push_back(torch::randn({rows, 5}));
      } else {
        d.x.back().push_back(torch::randint(0, kLlamaShape.vocab, {rows, 7}, torch::kInt64));
        d.y.back().push_back(torch::Tensor());
      }
    }
  }
  return d;
}

std::shared_ptr<torch::nn::Module> make_model(Model kind, torch::ScalarType dtype) {
  torch::manual_seed(1234);
  std::shared_ptr<torch::nn::Module> m;
  if (kind == Model::mlp)
    m = MLP().ptr();
  else
    m = TinyLlama(kLlamaShape).ptr();
  m->to(dtype);
  return m;
}
torch::Tensor model_loss(Model kind, torch::nn::Module& m, const torch::Tensor& x, const torch::Tensor& y) {
  if (kind == Model::mlp)
    return static_cast<MLPImpl&>(m).loss(x.to(m.parameters()[0].scalar_type()), y.to(m.parameters()[0].scalar_type()));
  return static_cast<TinyLlamaImpl&>(m).loss(x);
}

using Params = std::map<std::string, torch::Tensor>;

struct RunResult {
  Params params;                         // rank 0's (single: this rank's) full parameters after training, float
  std::vector<train::StepResult> log;    // rank 0's boundary results
  train::MemoryUse memory;               // rank 0's accounting after training
  int64_t reduce_scatter_bytes = 0;      // rank 0: bytes into gradient reduce-scatters in the last window
  bool updated_during_backward = false;  // rank 0, Offload<Host>: the last step updated inside backward
};

// Trains `windows` optimizer steps of Strategy S on `world` ranks.
// device: where the model and data live (thread-ranks make it their current device). single: run this
// process's rank on that communicator (e.g. NcclComm; its size must be `world`) instead of world LocalComm
// threads; every process then sees data[step][its rank], the rows the LocalComm run at `world` gives that
// rank, and RunResult holds this rank's results.
template <class S>
RunResult train(Model kind, int world, int windows, train::TrainerOptions opt = {}, Hyper hyper = {}, torch::Device device = torch::kCPU,
                comm::CommPtr single = nullptr) {
  constexpr int A = S::accumulation_steps;
  const auto dtype = squeeze::torch_dtype<typename S::compute_type>();
  const Data data = make_data(kind, world, windows * A, 6);
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  for (int r = 0; r < world; ++r) models.push_back(make_model(kind, dtype)), models.back()->to(device);
  RunResult out;
  auto body = [&](comm::CommPtr comm) {
    // LocalComm's copies run on the thread's current device (its stream 0): make that the model's GPU.
    const c10::OptionalDeviceGuard guard(device.is_cuda() ? std::optional<c10::Device>(device) : std::nullopt);
    const int r = comm->rank();
    const bool mine = single != nullptr || r == 0;  // the rank whose results this process returns
    auto trainer = zero_trainer<S>(models[r], hyper, comm, opt);
    for (int s = 0; s < windows * A; ++s) {
      // The batch's tensors through step(batch, closure): Graphed copies them into the buffers its graph reads.
      train::StepInputs batch{data.x[s][r].to(device)};
      if (data.y[s][r].defined()) batch.push_back(data.y[s][r].to(device));
      auto res = trainer.step(
          batch, [&](const train::StepInputs& in) { return model_loss(kind, *models[r], in[0], in.size() > 1 ? in[1] : torch::Tensor()); });
      EXPECT_EQ(res.boundary, (s + 1) % A == 0);
      if (mine && res.boundary) out.log.push_back(res);
    }
    auto full = trainer.full_parameters();
    if (mine) {
      for (auto& [n, t] : full) out.params[n] = t.to(torch::kCPU, torch::kFloat32);
      out.memory = trainer.memory();
      out.reduce_scatter_bytes = trainer.reduce_scatter_bytes();
      out.updated_during_backward = trainer.updated_during_backward();
    }
  };
  if (single) {
    EXPECT_EQ(world, single->size());
    body(single);
  } else {
    run_ranks(world, [&](std::shared_ptr<LocalComm> c) { body(c); });
  }
  return out;
}

void expect_bitwise(const Params& a, const Params& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (auto& [n, t] : a) {
    ASSERT_TRUE(b.count(n)) << what << ": missing " << n;
    ASSERT_TRUE(torch::equal(t, b.at(n))) << what << ": " << n << " differs, max |diff| " << (t - b.at(n)).abs().max().item<float>();
  }
}
void expect_close(const Params& a, const Params& b, double atol, double rtol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (auto& [n, t] : a) {
    ASSERT_TRUE(b.count(n)) << what << ": missing " << n;
    const auto ref = b.at(n).to(torch::kFloat64), got = t.to(torch::kFloat64);
    const auto excess = ((got - ref).abs() - (atol + rtol * ref.abs())).max().item<double>();
    EXPECT_LE(excess, 0.0) << what << ": " << n << " max |diff| " << (got - ref).abs().max().item<double>();
  }
}
// bf16: Adam turns tiny gradient differences on near-zero gradients into whole lr-sized steps, and the
// bf16 copies round to neighbouring values, so elementwise bounds are loose; compare the training
// updates instead: ||(got - init) - (ref - init)|| <= rel * ||ref - init|| per tensor.
void expect_update_close(const Params& got, const Params& ref, Model kind, double rel, const std::string& what) {
  auto m = make_model(kind, torch::kFloat32);
  double worst = 0;
  for (auto& item : m->named_parameters()) {
    const auto init = item.value().detach().to(torch::kFloat64);
    const auto g = got.at(item.key()).to(torch::kFloat64), r = ref.at(item.key()).to(torch::kFloat64);
    const double err = (g - r).norm().item<double>() / (r - init).norm().item<double>();
    worst = std::max(worst, err);
    EXPECT_LE(err, rel) << what << ": " << item.key();
  }
  std::cout << "[ update error ] " << what << ": " << worst << "\n";  // measured value, for the log
}

// Guards against vacuous parity: training moved the parameters.
void expect_trained(const Params& p, Model kind, torch::ScalarType dtype) {
  auto m = make_model(kind, dtype);
  double moved = 0;
  for (auto& item : m->named_parameters())
    moved = std::max(moved, (p.at(item.key()) - item.value().to(torch::kFloat32)).abs().max().item<double>());
  EXPECT_GT(moved, 1e-2) << "parameters did not move";
}

// ---- unsharded float64 reference: one process, the global batch, torch::optim::AdamW ---------------------
Params reference_float64(Model kind, int world, int windows, int A, float max_norm = 0, Hyper h = {}, std::vector<float>* norms = nullptr) {
  const Data data = make_data(kind, world, windows * A, 6);
  auto m = make_model(kind, torch::kFloat32);
  m->to(torch::kFloat64);
  torch::optim::AdamW opt(m->parameters(),
                          torch::optim::AdamWOptions(h.lr).betas({h.beta1, h.beta2}).eps(h.eps).weight_decay(h.weight_decay));
  for (int w = 0; w < windows; ++w) {
    opt.zero_grad();
    for (int a = 0; a < A; ++a) {
      const int s = w * A + a;
      torch::Tensor loss = torch::zeros({}, torch::kFloat64);
      for (int r = 0; r < world; ++r) {  // mean over ranks of each rank's mean loss = the global mean
        auto x = kind == Model::mlp ? data.x[s][r].to(torch::kFloat64) : data.x[s][r];
        auto y = kind == Model::mlp ? data.y[s][r].to(torch::kFloat64) : data.y[s][r];
        loss = loss + model_loss(kind, *m, x, y);
      }
      (loss / (world * A)).backward();
    }
    const double n = torch::nn::utils::clip_grad_norm_(m->parameters(), max_norm > 0 ? max_norm : 1e30);
    if (norms) norms->push_back(float(n));
    opt.step();
  }
  Params out;
  for (auto& item : m->named_parameters()) out[item.key()] = item.value().detach().to(torch::kFloat32);
  return out;
}

// nn::Llama (3 blocks, each a gather unit) with every block checkpointed, bf16, trained `steps` steps of S on `world`
// LocalComm ranks, each on its own token rows: rank 0's full parameters after training, float.
// mlp_tile_tokens: each block's MLP over tiles of that many tokens (nn::LlamaImpl::mlp_tile_tokens; 0: untiled).
template <class S>
Params train_checkpointed_llama(int world, int steps, train::TrainerOptions o, int64_t mlp_tile_tokens = 0) {
  nn::LlamaConfig cfg;
  cfg.vocab = 29, cfg.hidden = 16, cfg.layers = 3, cfg.heads = 4, cfg.kv_heads = 2, cfg.ffn = 24;
  torch::manual_seed(99);
  std::vector<torch::Tensor> ids;
  for (int i = 0; i < steps * world; ++i) ids.push_back(torch::randint(0, cfg.vocab, {2, 9}, torch::kInt64));
  std::vector<nn::Llama> models;
  for (int r = 0; r < world; ++r) {
    torch::manual_seed(5);
    models.emplace_back(cfg);
    models.back()->to(torch::kBFloat16);
    models.back()->checkpoint_every = 1;
    models.back()->mlp_tile_tokens = mlp_tile_tokens;
  }
  Params out;
  run_ranks(world, [&](std::shared_ptr<LocalComm> comm) {
    const int r = comm->rank();
    auto t = zero_trainer<S>(models[r], Hyper{}, comm, o);
    for (int s = 0; s < steps; ++s) {
      const auto& x = ids[s * world + r];
      t.step([&] { return models[r]->loss(x.narrow(1, 0, 8), x.narrow(1, 1, 8)); });
    }
    auto full = t.full_parameters();
    if (r == 0)
      for (auto& [n, v] : full) out[n] = v.to(torch::kFloat32);
  });
  return out;
}

#if defined(SQUEEZE_TORCH_CUDA)
// libtorch's synchronizing CUDA calls (item(), blocking copies, stream syncs) while f runs: in sync debug mode
// "warn" each one raises a c10 warning, which this handler counts.
inline int count_host_syncs(const std::function<void()>& f) {
  struct Counter : c10::WarningHandler {
    int n = 0;
    void process(const c10::Warning& w) override {
      if (w.msg().find("synchroniz") != std::string::npos) ++n;
    }
  } counter;
  c10::WarningUtils::WarningHandlerGuard guard(&counter);
  struct DebugMode {
    DebugMode() { c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN); }
    ~DebugMode() { c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED); }
  } mode;
  f();
  return counter.n;
}

#endif

}  // namespace zero_test
