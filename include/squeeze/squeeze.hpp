#pragma once
// Umbrella header for the torch-free layers: element types, errors, policies, planner, communicators.
// Kernels live under <squeeze/kernels/...>; the libtorch layer has its own umbrella, <squeeze/train.hpp>.
#include "comm.hpp"
#include "dtype.hpp"
#include "error.hpp"
#include "plan.hpp"
#include "policy.hpp"
