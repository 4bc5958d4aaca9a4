#pragma once
#include "squeeze/plan/memory.hpp"
#include "squeeze/plan/model_shape.hpp"
