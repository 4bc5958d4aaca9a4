#pragma once
// AdamW's runtime knobs, the options make_trainer takes (squeeze::AdamW{.lr = 3e-4f, .weight_decay = 0.1f}). The
// update itself runs in the trainer (train/trainer.hpp) on the kernels of squeeze/kernels/adamw.hpp.
#include "squeeze/error.hpp"
#include "squeeze/kernels/adamw.hpp"
#include "squeeze/kernels/grad_norm.hpp"
#include "squeeze/kernels/loss_scale.hpp"

namespace squeeze {

// AdamW's runtime knobs (an aggregate: AdamW{.lr = 3e-4f, .weight_decay = 0.1f}). Defaults are PyTorch's.
struct AdamW {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;
  float max_grad_norm = 0.0f;                 // > 0: clip the global L2 gradient norm to this
  kernels::LossScaleOptions loss_scale = {};  // used when the Strategy scales the loss
};

inline void validate(const AdamW& o) {
  (void)kernels::adamw_coeffs(o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, 1);  // throws naming the bad knob
  kernels::check_max_norm(o.max_grad_norm);
  kernels::validate(o.loss_scale);
}

}  // namespace squeeze
