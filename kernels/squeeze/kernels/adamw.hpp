#pragma once
// Fused AdamW: the element functor (shared by the CUDA kernel in adamw.cuh) and the CPU launcher.
// Plain C++: this header compiles with any C++20 compiler; the CPU launcher is the real optimizer
// behind Offload<Host> (and the oracle the GPU kernel is tested against).
//
// One pass per element, all fused (Loshchilov & Hutter's decoupled weight decay, PyTorch's AdamW math):
//   g  = grad * inv_scale * clip_coef                     (loss-scale unscale and gradient clipping)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g^2
//   w  = w * (1 - lr * wd) - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   param = round_to<P>(w)                                 (only when P is not float: w is the fp32 master)
// Without a master (bf16 params that are their own master: Precision<bf16, bf16>, CPU launchers only) w is the bf16
// param widened, and the new value is rounded stochastically (round_stochastic: up with the probability of the
// fraction dropped, so the expected rounded value is the exact one and small updates are not lost to rounding).
// If *found_inf != 0 the whole step is skipped: param, master, m and v keep their bits. The flag, the
// inverse loss scale and the clip coefficient are read from memory (device memory for the CUDA launcher,
// host memory here) so the GPU step needs no host synchronisation.
//
// Types: P (param) and G (grad) in {float, half, bf16}; master weights are float; S (Adam moments) is
// float. 8-bit block-wise state has its own tensor type and launchers (adamw8.hpp / adamw8.cuh): they decode
// a block of m and v, run the same adamw_element, and re-encode, so the math has one source.
//
// Bits: the multiply-adds are written as fmaf. nvcc contracts a * b + c into an FMA and g++ without an FMA target
// does not, so the GPU and the CPU twin differed in the last bit (more after the cancellation in the weight
// update, and a 16-bit param then rounded the other way); with explicit FMAs the CUDA kernels and every CPU clone
// compute the same IEEE operations, hence the same bits. beta^t is taken by squaring (plain multiplications) for
// the same reason (::pow may differ by an ulp between glibc and CUDA).
//
// CPU speed: the loop vectorises only when sqrtf need not set errno: build CPU code that runs this with
// -fno-math-errno. The launcher is compiled for x86-64-v4/v3 beside the baseline (SQUEEZE_CPU_CLONES,
// cpu_parallel.hpp): no -march needed for 16-wide FMA code. The baseline clone calls libm's fmaf per
// element (correct, several times slower): CPUs without FMA are pre-2013.
// Bytes per parameter (bf16 param + fp32 master, m, v, bf16 grad): read 2 + 4 + 4 + 4, write 4 + 4 + 4 + 2 = 28,
// so on a many-core host the pass is bound by memory bandwidth, not by the arithmetic (measured: docs/results.md,
// Fused AdamW, the CPU update).
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"
#include "squeeze/kernels/cpu_parallel.hpp"
#include "squeeze/kernels/tensor_list.hpp"

namespace squeeze::kernels {

template <class S>
inline constexpr bool supported_state_v = std::is_same_v<S, float>;

// Host-side constants of one AdamW step (t = step, counted from 1).
struct AdamWCoeffs {
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  float step_size = 0;              // lr / (1 - beta1^t): bias correction of m folded into the step
  float inv_sqrt_bc2 = 0;           // 1 / sqrt(1 - beta2^t): bias correction of v
  std::uint64_t rounding_seed = 0;  // stochastic rounding: this step's stream (adamw_coeffs derives it from t)
};

// Stochastic rounding of bf16 params without a master. 16 random bits per element from a counter-based hash of
// (the step's seed, the element's index in its stream): the same bits whatever the thread split or the clone.
SQUEEZE_HD std::uint32_t rounding_bits(std::uint64_t seed, std::uint64_t index) {
  std::uint64_t z = seed ^ (index * 0x9e3779b97f4a7c15ull);  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return std::uint32_t(z ^ (z >> 31));
}
// w to bf16, rounding the magnitude up with probability (dropped fraction) / 2^16: E[result] = w for finite w that
// do not overflow. NaN and infinities round as from_float does (an infinity keeps its bits). Selects, no branch: the
// CPU loops vectorise.
SQUEEZE_HD bf16 round_stochastic(float w, std::uint32_t random) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(w);
  const bool special = (u & 0x7f800000u) == 0x7f800000u;
  const bf16 rounded = std::bit_cast<bf16>(std::uint16_t((u + (special ? 0u : random & 0xffffu)) >> 16));
  return (u & 0x7fffffffu) > 0x7f800000u ? from_float<bf16>(w) : rounded;
}
// out[j] = round_stochastic(w[j]) for j < len, element j's bits from (seed, index + j). Inlined into each caller's
// target (the AVX-512 blocks' included), where it vectorises.
[[gnu::always_inline]] inline void round_stochastic_run(const float* w, bf16* out, int len, std::uint64_t seed, std::uint64_t index) {
  for (int j = 0; j < len; ++j) out[j] = round_stochastic(w[j], rounding_bits(seed, index + std::uint64_t(j)));
}
// Optimizer step t's stream: distinct for every step, the same on every rank and in every run.
SQUEEZE_HD std::uint64_t rounding_seed_of_step(std::int64_t step) {
  return rounding_bits(0x5eed5eedull, std::uint64_t(step)) * 0x100000001ull + std::uint64_t(step);
}

// b^t (t >= 0) by squaring: at most 2 log2(t) correctly rounded multiplications, the same bits on host and
// device. Relative error <= 2t * 2^-53 (each squaring doubles it), so 1 - b^t is off by <= 2 t b^t 2^-53:
// ~1e-12 at most for b <= 0.9999, far below the float step size's rounding.
SQUEEZE_HD double adamw_power(double b, std::int64_t t) {
  double r = 1.0;
  for (; t > 0; t >>= 1, b *= b)
    if (t & 1) r *= b;
  return r;
}

// Bias-correction scalars in double (1 - beta^t cancels badly in float for small t).
SQUEEZE_HD void adamw_bias_correction(float lr, float beta1, float beta2, std::int64_t t, float& step_size, float& inv_sqrt_bc2) {
  const double bc1 = 1.0 - adamw_power(double(beta1), t);
  const double bc2 = 1.0 - adamw_power(double(beta2), t);
  step_size = float(double(lr) / bc1);
  inv_sqrt_bc2 = float(1.0 / ::sqrt(bc2));
}

// Validates the hyper-parameters and precomputes the step constants. Throws squeeze::Error naming the bad value.
inline AdamWCoeffs adamw_coeffs(float lr, float beta1, float beta2, float eps, float weight_decay, std::int64_t step) {
  check(std::isfinite(lr) && lr >= 0, "AdamW: lr must be finite and >= 0, got " + std::to_string(lr));
  check(beta1 >= 0 && beta1 < 1, "AdamW: beta1 must be in [0, 1), got " + std::to_string(beta1));
  check(beta2 >= 0 && beta2 < 1, "AdamW: beta2 must be in [0, 1), got " + std::to_string(beta2));
  check(std::isfinite(eps) && eps > 0, "AdamW: eps must be finite and > 0, got " + std::to_string(eps));
  check(std::isfinite(weight_decay) && weight_decay >= 0,
        "AdamW: weight_decay must be finite and >= 0, got " + std::to_string(weight_decay));
  check(step >= 1, "AdamW: step counts from 1 (the first update is step 1), got " + std::to_string(step));
  AdamWCoeffs c{lr, beta1, beta2, eps, weight_decay, 0, 0, rounding_seed_of_step(step)};
  adamw_bias_correction(lr, beta1, beta2, step, c.step_size, c.inv_sqrt_bc2);
  return c;
}

// Per-launch values read from memory (null = absent). Device pointers for CUDA, host pointers for CPU.
struct AdamWDynamic {
  const float* inv_scale = nullptr;    // 1 / loss scale; grads are multiplied by it
  const float* found_inf = nullptr;    // != 0: skip this step entirely
  const float* clip_coef = nullptr;    // min(1, max_norm / ||g||); grads are multiplied by it
  const std::int64_t* step = nullptr;  // steps applied so far: bias correction uses t = *step + 1 (skipped
                                       // steps don't count, with no host sync); null: AdamWCoeffs' step
};

// Everything an element needs, resolved once per thread at the start of a launch.
struct AdamWScalars {
  bool skip;
  float gmul;  // inv_scale * clip_coef
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float decay;  // 1 - lr * weight_decay
  float step_size, inv_sqrt_bc2;
  std::uint64_t rounding_seed;
};

SQUEEZE_HD AdamWScalars adamw_scalars(const AdamWCoeffs& c, const AdamWDynamic& d) {
  AdamWScalars s;
  s.skip = d.found_inf != nullptr && *d.found_inf != 0.0f;
  s.gmul = (d.inv_scale ? *d.inv_scale : 1.0f) * (d.clip_coef ? *d.clip_coef : 1.0f);
  s.beta1 = c.beta1;
  s.one_minus_beta1 = 1.0f - c.beta1;
  s.beta2 = c.beta2;
  s.one_minus_beta2 = 1.0f - c.beta2;
  s.eps = c.eps;
  s.decay = fmaf(-c.lr, c.weight_decay, 1.0f);  // explicit: nvcc would contract it (see the header)
  s.step_size = c.step_size;
  s.inv_sqrt_bc2 = c.inv_sqrt_bc2;
  s.rounding_seed = c.rounding_seed;
  if (d.step != nullptr) adamw_bias_correction(c.lr, c.beta1, c.beta2, *d.step + 1, s.step_size, s.inv_sqrt_bc2);
  return s;
}

// The element functor: one AdamW update of weight w (fp32), moments m, v, with raw gradient g.
// Every multiply-add is an explicit fmaf (same bits on GPU and CPU, see the header); nothing else can contract.
SQUEEZE_HD void adamw_element(float& w, float& m, float& v, float g, const AdamWScalars& s) {
  g *= s.gmul;
  m = fmaf(s.beta1, m, s.one_minus_beta1 * g);
  v = fmaf(s.beta2, v, s.one_minus_beta2 * (g * g));
  const float denom = fmaf(sqrtf(v), s.inv_sqrt_bc2, s.eps);
  w = fmaf(w, s.decay, -(s.step_size * (m / denom)));
}

// After a launch: count the step as applied unless it was skipped (keeps AdamWDynamic::step exact).
SQUEEZE_HD void adamw_commit_step(std::int64_t* step, const float* found_inf) {
  if (!(found_inf != nullptr && *found_inf != 0.0f)) ++*step;
}

// One tensor's buffers, all [n]. For float params master is null (the param is its own master);
// otherwise master holds the fp32 weights and param receives their rounded copy.
template <class P, class G, class S = float>
struct AdamWTensor {
  P* param = nullptr;
  float* master = nullptr;
  const G* grad = nullptr;
  S* exp_avg = nullptr;     // m
  S* exp_avg_sq = nullptr;  // v
  std::int64_t n = 0;
  std::uint64_t rounding_index = 0;  // no master: element 0's index in its stochastic-rounding stream
};

// The checks every AdamW tensor shares, whatever its state: the count, the weights and the gradient.
// Returns false for an empty tensor (nothing more to check).
// own_master: bf16 params may come without a master (the CPU launchers round them stochastically).
template <class P, class G>
bool validate_weights(std::int64_t n, const P* param, const float* master, const G* grad, const std::string& what,
                      bool own_master = false) {
  static_assert(FloatingElement<P> && FloatingElement<G>, "AdamW: param and grad types must be float, squeeze::half or squeeze::bf16");
  check(n >= 0, what + ": negative element count " + std::to_string(n));
  if (n == 0) return false;
  check(param != nullptr, what + ": param pointer is null");
  check(grad != nullptr, what + ": grad pointer is null");
  if constexpr (std::is_same_v<P, float>) {
    check(master == nullptr || master == static_cast<const void*>(param),
          what + ": float params are their own master weights; pass master = nullptr");
  } else {
    check(master != nullptr || (own_master && std::is_same_v<P, bf16>),
          what + ": " + std::string(dtype_name<P>()) + " params need fp32 master weights; the master pointer is null" +
              (std::is_same_v<P, bf16> ? " (bf16 params as their own master, stochastically rounded, only on the CPU)" : ""));
  }
  return true;
}

template <class P, class G, class S>
void validate(const AdamWTensor<P, G, S>& t, const std::string& what = "AdamW tensor", bool own_master = false) {
  static_assert(supported_state_v<S>,
                "AdamW: optimizer state S must be float; for 8-bit state use AdamW8Tensor with adamw8_cpu / adamw8_cuda (adamw8.hpp)");
  if (!validate_weights(t.n, t.param, t.master, t.grad, what, own_master)) return;
  check(t.exp_avg != nullptr && t.exp_avg_sq != nullptr, what + ": exp_avg / exp_avg_sq (m, v) pointer is null");
}

// Element i of a tensor: load, update, store. The CPU loop and the GPU's unaligned/tail path.
template <class P, class G, class S>
SQUEEZE_HD void adamw_at(const AdamWTensor<P, G, S>& t, std::int64_t i, const AdamWScalars& s) {
  if constexpr (std::is_same_v<P, bf16>) {
    if (t.master == nullptr) {  // its own master: widened, updated, rounded stochastically
      float w = to_float(t.param[i]), m = t.exp_avg[i], v = t.exp_avg_sq[i];
      adamw_element(w, m, v, to_float(t.grad[i]), s);
      t.exp_avg[i] = m;
      t.exp_avg_sq[i] = v;
      t.param[i] = round_stochastic(w, rounding_bits(s.rounding_seed, t.rounding_index + std::uint64_t(i)));
      return;
    }
  }
  float* w_ptr;
  if constexpr (std::is_same_v<P, float>)
    w_ptr = t.param;
  else
    w_ptr = t.master;
  float w = w_ptr[i], m = t.exp_avg[i], v = t.exp_avg_sq[i];
  adamw_element(w, m, v, to_float(t.grad[i]), s);
  w_ptr[i] = w;
  t.exp_avg[i] = m;
  t.exp_avg_sq[i] = v;
  if constexpr (!std::is_same_v<P, float>) t.param[i] = from_float<P>(w);
}

// ---- CPU launcher ---------------------------------------------------------------------------------------
namespace cpu {

// Multiversioned (SQUEEZE_CPU_CLONES): the x86-64-v4 clone runs 16 lanes with FMA (bf16 widened by shifts,
// rounded back with integer ops), v3 8 lanes; all clones give the same bits.
template <class P, class G, class S>
SQUEEZE_CPU_CLONES void adamw_range(const AdamWTensor<P, G, S>& t, std::int64_t begin, std::int64_t end, const AdamWScalars& s) {
  const AdamWTensor<P, G, S> local = t;  // by value: lets the compiler keep the pointers in registers
#pragma omp simd
  for (std::int64_t i = begin; i < end; ++i) adamw_at(local, i, s);
}

}  // namespace cpu

// AdamW over a list of host tensors, all cores (OpenMP or std::thread). Dynamic values are host pointers.
template <class P, class G, class S>
void adamw_cpu(std::span<const AdamWTensor<P, G, S>> tensors, const AdamWCoeffs& c, const AdamWDynamic& d = {}) {
  for (std::size_t i = 0; i < tensors.size(); ++i) validate(tensors[i], "AdamW (CPU) tensor " + std::to_string(i), /*own_master=*/true);
  const AdamWScalars s = adamw_scalars(c, d);
  if (s.skip) return;
  for (const auto& t : tensors)  // elementwise: pieces handed out dynamically (cpu_parallel.hpp), any split gives the same bits
    cpu::parallel_pieces(t.n, cpu::kPiece, [&](std::int64_t b, std::int64_t e) { cpu::adamw_range(t, b, e, s); });
}

template <class P, class G, class S>
void adamw_cpu(const AdamWTensor<P, G, S>& t, const AdamWCoeffs& c, const AdamWDynamic& d = {}) {
  adamw_cpu(std::span<const AdamWTensor<P, G, S>>(&t, 1), c, d);
}

}  // namespace squeeze::kernels
