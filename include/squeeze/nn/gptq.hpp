#pragma once
// GPTQ (Frantar et al., 2022) on libtorch tensors: runs on the CPU, and on the GPU for CUDA tensors where this header
// is compiled by nvcc (else CUDA tensors are refused with a clear error).
//
//   Hessian     H = 2/N * sum_n x_n x_n^T over calibration inputs x_n [in] of one linear layer
//   damping     H += percdamp * mean(diag H) * I; when the Cholesky factorisation fails the fraction is
//               raised x10 and retried (max_damp_retries times), then a clear error
//   dead inputs diag(H) == 0 -> H_ii = 1, W[:, i] = 0 (the input never fires; its weight is irrelevant)
//   act-order   columns processed by descending diag(H); g_idx records each input's group
//   solve       Hinv = upper Cholesky factor of H^-1; columns quantized in blocks of block_size, the
//               error of each column spread over the rest of its block at once and over later blocks
//               lazily with one matmul per block (the paper's "lazy batch" update). A block's column loop is
//               kernels/quant/gptq_solve.cuh: a CUDA kernel and its bit-identical CPU twin
// The grid math is quant::find_grid / quant::quantize_code (fp16-rounded scales, zero >= 1 for asymmetric
// grids; find_row_grid applies find_grid to whole rows), so the codes pack into the v1 checkpoint format without loss.
//
// True-sequential capture: observe(linear, x) is a one-line hook a model calls in front of each of its
// linear layers (it returns linear(x)); while a HessianCapture is alive it adds x to that layer's
// Hessian. gptq_sequential quantizes groups of layers step by step, re-running the caller's forward
// closure before each step so later layers see the outputs of already-quantized earlier ones. A capture made with
// stop_when_complete ends each forward (nn::CaptureComplete) as soon as all its layers have seen their input.
// GptqResult::pack() builds the v1 bit streams on the result's device (nn/rtn.hpp pack_linear).
#include <torch/torch.h>
#include <torch/version.h>
#if defined(__CUDACC__)
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#endif

#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "squeeze/kernels/quant/gptq_solve.cuh"

#include "squeeze/policy/quantization.hpp"
#include "squeeze/quant/pack.hpp"
#include "squeeze/quant/rtn.hpp"
#include "squeeze/nn/rtn.hpp"

namespace squeeze::nn {

struct GptqOptions {
  int bits = 4;
  int group_size = 128;  // 0: one group per output channel
  bool sym = true;
  bool act_order = false;      // "desc_act"
  bool static_groups = false;  // with act_order: groups fixed from the unquantized weights in natural order
  double percdamp = 0.01;      // damping as a fraction of mean(diag H)
  int max_damp_retries = 4;    // each retry multiplies the fraction by 10
  int block_size = 128;
  bool progress = false;  // one line per layer on stderr (gptq_sequential)
};

// Options from a policy: gptq_options<Quantized<4, GPTQ, Group<128>, ActOrder>>() -> bits 4, group 128,
// act-order (runtime knobs such as percdamp stay in the struct).
template <WeightQuantizationPolicy Q>
requires std::is_same_v<typename Q::method, GPTQ> GptqOptions gptq_options() {
  GptqOptions o;
  o.bits = Q::bits;
  o.group_size = Q::group;
  o.act_order = Q::act_order;
  return o;
}

struct GptqResult {
  torch::Tensor codes;        // uint8 [out, in]
  torch::Tensor scales;       // float [groups, out] (fp16-representable)
  torch::Tensor zeros;        // uint8 [groups, out] (true zero points, >= 1)
  torch::Tensor g_idx;        // int32 [in]
  torch::Tensor dequantized;  // float [out, in]: W_hat
  double damp_fraction = 0;   // the fraction that factorised
  int damp_retries = 0;
  double loss = 0;  // sum over columns of (w - w_hat)^2 / (2 [H^-1]_jj^2), the paper's objective
  int bits = 4, group_size = 0;

  // The v1 packed layout: the bit streams built on the result's device (pack_linear), the packed words copied to the host.
  quant::PackedLinear pack() const { return pack_linear(codes, zeros, scales, g_idx, bits, group_size); }
};

// ---- the grid on rows of a tensor (mirror of quant::find_grid) ------------------------------------------
struct RowGrid {
  torch::Tensor scale, zero;  // float [rows]
};

// quant::find_grid on each row's [min, max] (the min / max on x's device, the grid on the CPU: exactly the rule the
// column loop and RTN use, on any device).
inline RowGrid find_row_grid(const torch::Tensor& x /*[rows, n]*/, int bits, bool sym) {
  const auto lo = std::get<0>(x.min(1)).to(torch::kCPU, torch::kFloat32).contiguous();
  const auto hi = std::get<0>(x.max(1)).to(torch::kCPU, torch::kFloat32).contiguous();
  const std::int64_t rows = lo.size(0);
  auto scale = torch::empty({rows}, torch::kFloat32), zero = torch::empty({rows}, torch::kFloat32);
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto g = quant::find_grid(lo.data_ptr<float>()[r], hi.data_ptr<float>()[r], bits, sym);
    TORCH_CHECK(kernels::quant::grid_fits_half(g), "GPTQ: weight range too large for an fp16 scale (or weights are not finite)");
    scale.data_ptr<float>()[r] = g.scale;
    zero.data_ptr<float>()[r] = float(g.zero);
  }
  return {scale.to(x.device()), zero.to(x.device())};
}

// ---- Hessian accumulation -------------------------------------------------------------------------------
class Hessian {
 public:
  Hessian() = default;
  Hessian(std::int64_t columns, torch::Device device)
      : H_(torch::zeros({columns, columns}, torch::TensorOptions().dtype(torch::kFloat32).device(device))) {}

  // x [..., columns]: every leading index is one sample. Running average keeps H = 2/N sum x x^T.
  // fp16 / bf16 inputs on the GPU are multiplied as they are, with fp32 products and sums (libtorch >= 2.8's mm with an
  // fp32 out_dtype: tensor cores, the same values as converting to fp32 first), several times faster than fp32 GEMMs
  // on a LLaMA-7B layer's Hessians (docs/results.md, "GPTQ quantize").
  void add(const torch::Tensor& x) {
    TORCH_CHECK(H_.defined(), "Hessian: not initialised");
    TORCH_CHECK(x.size(-1) == H_.size(0), "Hessian: input has ", x.size(-1), " features, layer has ", H_.size(0));
    auto x2 = x.detach().reshape({-1, H_.size(0)}).to(H_.device());
    const std::int64_t n = x2.size(0);
    if (n == 0) return;
    const double beta = double(samples_) / double(samples_ + n), alpha = 2.0 / double(samples_ + n);
    samples_ += n;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
    if (x2.is_cuda() && (x2.scalar_type() == torch::kBFloat16 || x2.scalar_type() == torch::kHalf)) {
      H_.mul_(beta).add_(at::mm(x2.t(), x2, torch::kFloat32), alpha);
      return;
    }
#endif
    x2 = x2.to(torch::kFloat32);
    H_.addmm_(x2.t(), x2, beta, alpha);
  }
  const torch::Tensor& matrix() const { return H_; }
  std::int64_t samples() const { return samples_; }

 private:
  torch::Tensor H_;  // [columns, columns] float32
  std::int64_t samples_ = 0;
};

namespace detail {
// Upper Cholesky factor of (H + damp*I)^-1, raising damp on failure. Returns {U, fraction, retries}.
inline std::tuple<torch::Tensor, double, int> damped_inverse_cholesky(const torch::Tensor& H, const GptqOptions& opt) {
  const double mean_diag = H.diagonal().mean().item<double>();
  TORCH_CHECK(std::isfinite(mean_diag) && mean_diag > 0, "GPTQ: Hessian diagonal mean is ", mean_diag,
              "; a Hessian from calibration data is positive semi-definite - check the calibration inputs");
  double frac = opt.percdamp;
  for (int attempt = 0; attempt <= opt.max_damp_retries; ++attempt) {
    auto Hd = H.clone();
    Hd.diagonal().add_(frac * mean_diag);
    auto [L, info] = torch::linalg_cholesky_ex(Hd);
    if (info.item<int>() == 0) {
      auto Hinv = torch::cholesky_inverse(L);
      auto [U, info2] = torch::linalg_cholesky_ex(Hinv, /*upper=*/true);
      if (info2.item<int>() == 0 && U.isfinite().all().item<bool>()) return {U, frac, attempt};
    }
    frac = frac > 0 ? frac * 10 : 1e-6;
  }
  TORCH_CHECK(false, "GPTQ: Cholesky factorisation of the damped Hessian failed for damping fractions ", opt.percdamp, " .. ", frac / 10,
              " of mean(diag H) = ", mean_diag, " (", opt.max_damp_retries,
              " retries). The Hessian is not positive definite even when damped: use more (or non-degenerate) "
              "calibration data, or raise percdamp / max_damp_retries");
  return {};
}
}  // namespace detail

// Quantizes W [out, in] given its Hessian H [in, in]. Works on W's device; W is not modified.
inline GptqResult gptq_quantize(const torch::Tensor& weight, const torch::Tensor& hessian, const GptqOptions& opt) {
  using torch::indexing::Slice;
  TORCH_CHECK(quant::supported_bits(opt.bits), "GPTQ: bits must be 2, 3, 4 or 8, got ", opt.bits);
  TORCH_CHECK(opt.group_size >= 0, "GPTQ: group_size must be >= 0 (0 = per channel)");
  TORCH_CHECK(opt.block_size > 0 && opt.block_size <= kernels::quant::kGptqMaxBlock, "GPTQ: block_size must be in 1..",
              kernels::quant::kGptqMaxBlock, ", got ", opt.block_size);
  TORCH_CHECK(opt.percdamp >= 0, "GPTQ: percdamp must be >= 0");
  TORCH_CHECK(weight.dim() == 2, "GPTQ: weight must be [out, in]");
  const std::int64_t rows = weight.size(0), cols = weight.size(1);
  TORCH_CHECK(rows > 0 && cols > 0, "GPTQ: weight ", weight.sizes(), " is empty (a layer needs at least one output and one input)");
  TORCH_CHECK(hessian.dim() == 2 && hessian.size(0) == cols && hessian.size(1) == cols, "GPTQ: Hessian must be [in, in] = [", cols, ", ",
              cols, "], got ", hessian.sizes());
  auto W = weight.detach().to(torch::kFloat32).clone(at::MemoryFormat::Contiguous);  // [rows, cols], row-major (the column loop's pitch)
  auto H = hessian.detach().to(W.device(), torch::kFloat32).clone();                 // [cols, cols]
  TORCH_CHECK(W.isfinite().all().item<bool>(), "GPTQ: weight contains NaN or inf");
  TORCH_CHECK(H.isfinite().all().item<bool>(), "GPTQ: Hessian contains NaN or inf (check the calibration activations)");

  const auto dead = H.diagonal() == 0;  // inputs that never fired
  H.diagonal().masked_fill_(dead, 1.0);
  W.index_put_({Slice(), dead}, 0.0);

  const std::int64_t gs = opt.group_size > 0 ? opt.group_size : cols;
  const std::int64_t groups = (cols + gs - 1) / gs;
  const bool grouped = opt.group_size > 0;

  // static groups: grids fixed up front from the weights in natural column order
  std::vector<RowGrid> static_grids;
  if (grouped && opt.static_groups)
    for (std::int64_t g = 0; g < groups; ++g)
      static_grids.push_back(find_row_grid(W.index({Slice(), Slice(g * gs, std::min(cols, (g + 1) * gs))}), opt.bits, opt.sym));

  torch::Tensor perm;
  if (opt.act_order) {
    perm = torch::argsort(H.diagonal(), /*stable=*/true, /*dim=*/0, /*descending=*/true);
    W = W.index_select(1, perm);
    H = H.index_select(0, perm).index_select(1, perm);
  }

  auto [Hinv, frac, retries] = detail::damped_inverse_cholesky(H, opt);
  H = torch::Tensor();  // free

  Hinv = Hinv.contiguous();
  auto fopts = W.options();
  auto Q = torch::zeros_like(W);      // dequantized, permuted order
  auto codes = torch::zeros_like(W);  // codes as floats, permuted order
  auto scales = torch::zeros({groups, rows}, fopts);
  auto zeros = torch::zeros({groups, rows}, fopts);
  auto perm_cpu = opt.act_order ? perm.to(torch::kCPU, torch::kInt64).contiguous() : torch::Tensor();
  auto perm_at = [&](std::int64_t c) { return opt.act_order ? perm_cpu.data_ptr<std::int64_t>()[c] : c; };
  auto loss = torch::zeros({rows}, fopts);

  // Grids known before the loop: per channel, one a row from the whole (dead-zeroed) weight; static groups, fixed
  // from the weights in natural order, column c (processing order) on group perm[c] / gs. Grouped otherwise, the
  // column loop finds each group's grid at its first column.
  torch::Tensor col_group;  // int32 [cols] on W's device (static groups only)
  if (!grouped) {
    const RowGrid grid = find_row_grid(W, opt.bits, opt.sym);
    scales[0].copy_(grid.scale);
    zeros[0].copy_(grid.zero);
  } else if (opt.static_groups) {
    for (std::int64_t g = 0; g < groups; ++g) {
      scales[g].copy_(static_grids[g].scale);
      zeros[g].copy_(static_grids[g].zero);
    }
    auto cg = torch::empty({cols}, torch::kInt32);
    for (std::int64_t c = 0; c < cols; ++c) cg.data_ptr<std::int32_t>()[c] = std::int32_t(perm_at(c) / gs);
    col_group = cg.to(W.device());
  }
  auto bad_grid = torch::zeros({1}, fopts.dtype(torch::kInt32));
  // The column loop of a block: the kernel of kernels/quant/gptq_solve.cuh on CUDA tensors (nvcc translation units),
  // its CPU twin on CPU tensors.
  auto column_loop = [&](kernels::quant::GptqBlock& b) {
    const char* const why = kernels::quant::gptq_block_error(b);
    TORCH_CHECK(*why == 0, "GPTQ: column block refused: ", why);
    if (W.is_cpu()) return kernels::quant::gptq_block_cpu(b);
#if defined(__CUDACC__)
    TORCH_CHECK(W.is_cuda(), "GPTQ: tensors on ", W.device(), "; CPU or CUDA expected");
    const c10::DeviceGuard guard(W.device());
    const cudaStream_t stream =
        static_cast<cudaStream_t>(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(W.device()).native_handle());
    const cudaError_t e = kernels::quant::gptq_block_cuda(b, stream);
    TORCH_CHECK(e == cudaSuccess, "GPTQ: column-loop kernel failed: ", cudaGetErrorString(e));
#else
    TORCH_CHECK(false, "GPTQ: tensors on ", W.device(),
                ", but this translation unit was not compiled by nvcc; include "
                "squeeze/nn/gptq.hpp from a .cu file to quantize on the GPU (or quantize CPU tensors)");
#endif
  };
  for (std::int64_t i1 = 0; i1 < cols; i1 += opt.block_size) {
    const std::int64_t i2 = std::min(cols, i1 + opt.block_size), count = i2 - i1;
    auto Err1 = torch::empty({rows, count}, fopts);  // (w - q) / d of the block's columns
    kernels::quant::GptqBlock b;
    b.u = Hinv.data_ptr<float>();
    b.w = W.data_ptr<float>();
    b.col_group = col_group.defined() ? col_group.data_ptr<std::int32_t>() : nullptr;
    b.codes = codes.data_ptr<float>();
    b.dequantized = Q.data_ptr<float>();
    b.err = Err1.data_ptr<float>();
    b.scales = scales.data_ptr<float>();
    b.zeros = zeros.data_ptr<float>();
    b.bad_grid = bad_grid.data_ptr<std::int32_t>();
    b.rows = rows;
    b.cols = b.u_pitch = b.w_pitch = cols;
    b.first = i1;
    b.count = count;
    b.group = gs;
    b.bits = opt.bits;
    b.sym = opt.sym;
    b.find_grids = grouped && !opt.static_groups;
    column_loop(b);
    loss.add_(Err1.square().sum(1), 0.5);  // (w - q)^2 / (2 d^2) summed over the block's columns
    if (i2 < cols) W.index({Slice(), Slice(i2, cols)}).sub_(Err1.matmul(Hinv.index({Slice(i1, i2), Slice(i2, cols)})));
  }
  TORCH_CHECK(bad_grid.item<int>() == 0, "GPTQ: weight range too large for an fp16 scale (or weights are not finite)");

  GptqResult r;
  r.bits = opt.bits;
  r.group_size = opt.group_size;
  r.damp_fraction = frac;
  r.damp_retries = retries;
  r.loss = loss.sum().item<double>();
  auto g_idx = torch::empty({cols}, torch::kInt32);
  {
    auto gp = g_idx.data_ptr<std::int32_t>();
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::int64_t orig = perm_at(c);
      // static groups keep natural-order groups; otherwise the group follows the processing order
      gp[orig] = std::int32_t(!grouped ? 0 : opt.static_groups ? orig / gs : c / gs);
    }
  }
  if (opt.act_order) {
    auto inv = torch::argsort(perm);
    Q = Q.index_select(1, inv);
    codes = codes.index_select(1, inv);
  }
  r.codes = codes.to(torch::kUInt8);
  r.scales = scales;
  r.zeros = zeros.to(torch::kUInt8);
  r.g_idx = g_idx.to(W.device());
  r.dequantized = Q;
  return r;
}

// ---- true-sequential capture ----------------------------------------------------------------------------
class HessianCapture;
namespace detail {
inline thread_local HessianCapture* active_capture = nullptr;
}

// Thrown by observe() out of a forward once every layer of a HessianCapture made with stop_when_complete has seen
// its input in this pass: the rest of the forward would only compute what the captured Hessians do not need (the
// [q k v] step of a LLaMA block needs its attention norm and nothing after). The caller catches it around the forward.
struct CaptureComplete : std::exception {
  const char* what() const noexcept override {
    return "HessianCapture: every captured layer has seen its input (catch squeeze::nn::CaptureComplete around the forward)";
  }
};

// While alive (one per thread), observe() feeds the inputs of the given layers into their Hessians.
class HessianCapture {
 public:
  explicit HessianCapture(const std::vector<std::pair<std::string, torch::nn::Linear>>& layers, bool stop_when_complete = false)
      : stop_when_complete_(stop_when_complete) {
    TORCH_CHECK(detail::active_capture == nullptr, "HessianCapture: one capture at a time per thread");
    for (const auto& [name, lin] : layers) {
      const auto& w = lin->weight;
      index_[lin.get()] = hessians_.size();
      hessians_.emplace_back(name, Hessian(w.size(1), w.device()));
    }
    seen_.assign(hessians_.size(), false);
    detail::active_capture = this;
  }
  ~HessianCapture() { detail::active_capture = nullptr; }
  HessianCapture(const HessianCapture&) = delete;
  HessianCapture& operator=(const HessianCapture&) = delete;

  void add(const torch::nn::Module* m, const torch::Tensor& x) {
    const auto it = index_.find(m);
    if (it == index_.end()) return;
    hessians_[it->second].second.add(x);
    if (!stop_when_complete_) return;
    if (!seen_[it->second]) {
      seen_[it->second] = true;
      ++seen_count_;
    }
    if (seen_count_ == seen_.size()) {  // this pass is done: the next forward starts a new one
      seen_.assign(seen_.size(), false);
      seen_count_ = 0;
      throw CaptureComplete{};
    }
  }
  Hessian& at(const std::string& name) {
    for (auto& [n, h] : hessians_)
      if (n == name) return h;
    TORCH_CHECK(false, "HessianCapture: no layer named ", name);
    return hessians_.front().second;
  }

 private:
  std::unordered_map<const torch::nn::Module*, std::size_t> index_;
  std::vector<std::pair<std::string, Hessian>> hessians_;
  bool stop_when_complete_ = false;
  std::vector<bool> seen_;  // stop_when_complete: the layers observed in this pass
  std::size_t seen_count_ = 0;
};

// The hook a model calls in front of a linear layer: records x when that layer is being captured.
inline void observe_input(const torch::nn::Module* layer, const torch::Tensor& x) {
  if (detail::active_capture) detail::active_capture->add(layer, x);
}
inline torch::Tensor observe(torch::nn::Linear& layer, const torch::Tensor& x) {
  observe_input(layer.get(), x);
  return layer(x);
}

using NamedLinear = std::pair<std::string, torch::nn::Linear>;

// Quantizes `steps` in order (layers of one step share their inputs, e.g. q/k/v). Before each step it
// runs `forward` (the calibration pass, which must route each layer through observe()), then replaces
// each layer's weight by its dequantized GPTQ result so later steps calibrate on quantized outputs.
inline std::map<std::string, quant::PackedLinear> gptq_sequential(const std::vector<std::vector<NamedLinear>>& steps,
                                                                  const std::function<void()>& forward, const GptqOptions& opt) {
  std::map<std::string, quant::PackedLinear> out;
  std::size_t total = 0, done = 0;
  for (const auto& s : steps) total += s.size();
  for (const auto& step : steps) {
    HessianCapture cap(step);
    {
      torch::NoGradGuard ng;
      forward();
    }
    for (const auto& [name, lin] : step) {
      const auto t0 = std::chrono::steady_clock::now();
      auto& h = cap.at(name);
      TORCH_CHECK(h.samples() > 0, "gptq_sequential: layer ", name,
                  " saw no calibration input; route it through squeeze::nn::observe() in the model's forward");
      auto r = gptq_quantize(lin->weight, h.matrix(), opt);
      {
        torch::NoGradGuard ng;
        lin->weight.copy_(r.dequantized.to(lin->weight.dtype()));
      }
      auto p = r.pack();
      if (lin->bias.defined()) {
        auto b = lin->bias.detach().to(torch::kCPU, torch::kFloat32).contiguous();
        p.bias.resize(b.numel());
        for (std::int64_t k = 0; k < b.numel(); ++k) p.bias[k] = from_float<half>(b.data_ptr<float>()[k]);
      }
      out[name] = std::move(p);
      ++done;
      if (opt.progress) {
        const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::fprintf(stderr, "[gptq %zu/%zu] %-40s %lldx%lld  samples %lld  damp %.3g  loss %.4g  %.2fs\n", done, total, name.c_str(),
                     (long long)lin->weight.size(0), (long long)lin->weight.size(1), (long long)h.samples(), r.damp_fraction, r.loss, sec);
      }
    }
  }
  return out;
}

}  // namespace squeeze::nn
