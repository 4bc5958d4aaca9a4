#pragma once
// Dynamic loss scaling (fp16 training): non-finite check + unscale, and the scale update.
// Plain C++; the CUDA launchers are in loss_scale.cuh and apply the same functions.
//
// Update rule (PyTorch GradScaler by default, DeepSpeed's options on top):
//   overflow (found_inf != 0):
//     the step is skipped by the optimizer; growth_tracker = 0;
//     if hysteresis_left > 1: --hysteresis_left, scale unchanged        (DeepSpeed "hysteresis"/delayed_shift)
//     else if scale <= min_scale: scale stays; error flag if raise_at_min_scale (DeepSpeed raises here)
//     else scale = max(scale * backoff_factor, min_scale)
//   clean step:
//     if consecutive_hysteresis: hysteresis_left = hysteresis
//     if ++growth_tracker == growth_interval: scale *= growth_factor (if finite), growth_tracker = 0,
//                                              hysteresis_left = hysteresis
// Defaults: init 2^16, x2 after 2000 clean steps, x0.5 on overflow, hysteresis 1 (no delay), no minimum:
// exactly GradScaler. The state (scale, 1/scale, counters, found_inf, error) is one struct that lives in
// device memory for the GPU scaler, so kernels read &state.inv_scale and write &state.found_inf directly.
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"
#include "squeeze/kernels/cpu_parallel.hpp"
#include "squeeze/kernels/tensor_list.hpp"

namespace squeeze::kernels {

struct LossScaleOptions {
  float init_scale = 65536.0f;  // 2^16
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int growth_interval = 2000;           // clean steps before the scale grows
  int hysteresis = 1;                   // overflows tolerated before backing off (1: back off at once)
  bool consecutive_hysteresis = false;  // refill hysteresis after every clean step (else only when the scale grows)
  float min_scale = 0.0f;               // the scale never backs off below this (0: no minimum)
  bool raise_at_min_scale = false;      // an overflow while the scale sits at min_scale is an error
};

// Throws squeeze::Error naming the bad option.
inline void validate(const LossScaleOptions& o) {
  check(std::isfinite(o.init_scale) && o.init_scale > 0,
        "loss scale: init_scale must be finite and > 0, got " + std::to_string(o.init_scale));
  check(o.growth_factor > 1, "loss scale: growth_factor must be > 1, got " + std::to_string(o.growth_factor));
  check(o.backoff_factor > 0 && o.backoff_factor < 1,
        "loss scale: backoff_factor must be in (0, 1), got " + std::to_string(o.backoff_factor));
  check(o.growth_interval >= 1, "loss scale: growth_interval must be >= 1, got " + std::to_string(o.growth_interval));
  check(o.hysteresis >= 1, "loss scale: hysteresis must be >= 1, got " + std::to_string(o.hysteresis));
  check(o.min_scale >= 0 && o.min_scale <= o.init_scale,
        "loss scale: min_scale must be in [0, init_scale], got " + std::to_string(o.min_scale));
}

// The scaler's whole state: 24 bytes, one allocation on the device for the GPU scaler.
struct LossScaleState {
  float scale = 0;                   // multiply the loss by this before backward
  float inv_scale = 0;               // 1 / scale: the optimizer/unscale multiply gradients by this
  float found_inf = 0;               // set (to 1) by the non-finite check this step; consumed by the update
  std::int32_t growth_tracker = 0;   // clean steps since the last growth or overflow
  std::int32_t hysteresis_left = 0;  // overflows still tolerated before backing off
  std::int32_t error = 0;            // 1: overflow while the scale sat at min_scale with raise_at_min_scale
};

inline LossScaleState loss_scale_init(const LossScaleOptions& o) {
  validate(o);
  return LossScaleState{o.init_scale, 1.0f / o.init_scale, 0.0f, 0, o.hysteresis, 0};
}

// One scale update from state.found_inf; resets found_inf for the next step. The CPU scaler and the GPU
// update kernel both call this.
SQUEEZE_HD void loss_scale_update(LossScaleState& st, const LossScaleOptions& o) {
  const bool overflow = st.found_inf != 0.0f;
  st.found_inf = 0.0f;
  if (overflow) {
    st.growth_tracker = 0;
    if (st.hysteresis_left > 1) {
      --st.hysteresis_left;
    } else if (st.scale <= o.min_scale) {
      if (o.raise_at_min_scale) st.error = 1;
    } else {
      const float next = st.scale * o.backoff_factor;
      st.scale = next > o.min_scale ? next : o.min_scale;
    }
  } else {
    if (o.consecutive_hysteresis) st.hysteresis_left = o.hysteresis;
    if (++st.growth_tracker == o.growth_interval) {
      const float grown = st.scale * o.growth_factor;
      if (is_finite(grown)) st.scale = grown;
      st.growth_tracker = 0;
      st.hysteresis_left = o.hysteresis;
    }
  }
  st.inv_scale = 1.0f / st.scale;
}

// The non-finite check + unscale element functor: returns g * inv_scale and raises `bad` when the raw
// gradient is inf or NaN (checked before scaling so an overflow is seen even if inv_scale is tiny).
SQUEEZE_HD float unscale_element(float g, float inv_scale, bool& bad) {
  bad = bad || !is_finite(g);
  return g * inv_scale;
}

// A plain buffer view: the Entry of one-input kernels (check+unscale, norms). T may be const.
template <class T>
struct Buffer {
  T* data = nullptr;
  std::int64_t n = 0;
};

template <class T>
void validate(const Buffer<T>& b, const std::string& what = "buffer") {
  static_assert(FloatingElement<std::remove_const_t<T>>, "gradient buffers hold float, squeeze::half or squeeze::bf16");
  check(b.n >= 0, what + ": negative element count " + std::to_string(b.n));
  check(b.n == 0 || b.data != nullptr, what + ": data pointer is null");
}

// ---- CPU twins ------------------------------------------------------------------------------------------

// Multiplies every gradient by inv_scale in place and sets *found_inf = 1 if any was inf/NaN (it is
// never cleared here: several calls, or ranks, accumulate into one flag). Host pointers.
template <class G>
void check_and_unscale_cpu(std::span<const Buffer<G>> grads, float* found_inf, float inv_scale) {
  check(found_inf != nullptr, "check_and_unscale: found_inf pointer is null");
  check(std::isfinite(inv_scale), "check_and_unscale: inv_scale must be finite, got " + std::to_string(inv_scale));
  for (std::size_t i = 0; i < grads.size(); ++i) validate(grads[i], "check_and_unscale: gradient " + std::to_string(i));
  bool any = false;
  for (const auto& b : grads) {
    std::vector<char> bad_per_range(std::size_t(cpu::ranges_for(b.n)), 0);
    cpu::parallel_ranges(b.n, [&](int t, std::int64_t begin, std::int64_t end) {
      G* __restrict__ p = b.data;
      bool bad = false;
#pragma omp simd reduction(|| : bad)
      for (std::int64_t k = begin; k < end; ++k) {
        bool e = false;
        p[k] = from_float<G>(unscale_element(to_float(p[k]), inv_scale, e));
        bad = bad || e;
      }
      bad_per_range[std::size_t(t)] = bad;
    });
    for (char c : bad_per_range) any = any || c;
  }
  if (any) *found_inf = 1.0f;
}

// Host-side scaler: state in host memory, same update as the GPU kernel. update() throws squeeze::Error
// when an overflow hits the minimum scale with raise_at_min_scale.
class LossScaler {
 public:
  explicit LossScaler(const LossScaleOptions& o = {}) : opt_(o), st_(loss_scale_init(o)) {}
  float scale() const { return st_.scale; }
  float inv_scale() const { return st_.inv_scale; }
  // Where the non-finite checks write (host memory) this step.
  float* found_inf() { return &st_.found_inf; }
  const float* inv_scale_ptr() const { return &st_.inv_scale; }
  const LossScaleState& state() const { return st_; }
  const LossScaleOptions& options() const { return opt_; }
  // Resuming from a checkpoint: the scale and the clean steps since the last change (hysteresis starts afresh).
  void restore(float scale, std::int32_t growth_tracker) {
    check(std::isfinite(scale) && scale > 0.0f && scale >= opt_.min_scale,
          "loss scale: cannot restore a scale of " + std::to_string(scale) + " (it must be finite, > 0 and >= min_scale " +
              std::to_string(opt_.min_scale) + ")");
    check(growth_tracker >= 0, "loss scale: cannot restore a negative growth tracker (" + std::to_string(growth_tracker) + ")");
    st_ = LossScaleState{scale, 1.0f / scale, 0.0f, growth_tracker, opt_.hysteresis, 0};
  }
  // Applies the update; returns true when this step was clean (the optimizer applied it).
  bool update() {
    const bool clean = st_.found_inf == 0.0f;
    loss_scale_update(st_, opt_);
    check(st_.error == 0, "loss scale: gradients overflowed while the loss scale sat at its minimum (" + std::to_string(opt_.min_scale) +
                              "); the run is diverging: lower the learning rate or check the data");
    return clean;
  }

 private:
  LossScaleOptions opt_;
  LossScaleState st_;
};

}  // namespace squeeze::kernels
