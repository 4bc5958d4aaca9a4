#pragma once
// Umbrella header: the torch-free layers (policies, planner, errors, element types).
// Kernels live under <squeeze/kernels/...>, torch modules under <squeeze/nn/...>.
#include "dtype.hpp"
#include "error.hpp"
#include "plan.hpp"
#include "policy.hpp"
