#pragma once
#include "plan/memory.hpp"
#include "plan/model_shape.hpp"
