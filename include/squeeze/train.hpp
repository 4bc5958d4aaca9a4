#pragma once
// Umbrella header for the libtorch layer: make_trainer and its options, squeeze's layers (nn::Linear, nn::Embedding,
// nn::Blocks, nn::checkpoint), LoRA / QLoRA, quantized linears and GPTQ, the LLaMA model. Needs libtorch.
#include "nn/activation_checkpoint.hpp"
#include "nn/gptq.hpp"
#include "nn/layers.hpp"
#include "nn/llama.hpp"
#include "nn/lora.hpp"
#include "nn/quantized_linear.hpp"
#include "optim/adamw.hpp"
#include "squeeze.hpp"
#include "train/trainer.hpp"
