#pragma once
#include "policy/strategy.hpp"
