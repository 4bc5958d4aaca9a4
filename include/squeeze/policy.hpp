#pragma once
#include "squeeze/policy/strategy.hpp"
