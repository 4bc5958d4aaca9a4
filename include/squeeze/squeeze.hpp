#pragma once
// Umbrella header for the torch-free layers: element types, errors, policies, planner, communicators.
// Kernels live under <squeeze/kernels/...>; the libtorch layer has its own umbrella, <squeeze/train.hpp>.
#include "squeeze/comm.hpp"
#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"
#include "squeeze/plan.hpp"
#include "squeeze/policy.hpp"
