#pragma once
// Umbrella header for the libtorch layer: make_trainer and its options, squeeze's layers (nn::Linear, nn::Embedding,
// nn::Blocks, nn::checkpoint), LoRA / QLoRA, quantized linears and GPTQ, the LLaMA model. Needs libtorch.
#include "squeeze/nn/activation_checkpoint.hpp"
#include "squeeze/nn/gptq.hpp"
#include "squeeze/nn/layers.hpp"
#include "squeeze/nn/llama.hpp"
#include "squeeze/nn/lora.hpp"
#include "squeeze/nn/quantized_linear.hpp"
#include "squeeze/optim/adamw.hpp"
#include "squeeze/squeeze.hpp"
#include "squeeze/train/trainer.hpp"
