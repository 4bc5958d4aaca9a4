// The translation unit that builds the precompiled <torch/torch.h> the torch C++ programs share
// (squeeze_use_torch_pch in cmake/SqueezeDependencies.cmake); it defines nothing.
