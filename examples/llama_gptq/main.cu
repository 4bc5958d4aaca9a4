// nvcc build of llama_gptq (libtorch with CUDA): nn::QuantizedLinear's CUDA kernels are compiled in.
#include "main.cpp"
