#pragma once
// Umbrella header for the libtorch layer: the ZeRO trainer and sharded modules, activation
// checkpointing, the optimizer adapter, quantized linears and GPTQ. Needs libtorch on the include path.
#include "nn/activation_checkpoint.hpp"
#include "nn/gptq.hpp"
#include "nn/quantized_linear.hpp"
#include "train/trainer.hpp"
#include "optim/torch_adamw.hpp"
#include "squeeze.hpp"
