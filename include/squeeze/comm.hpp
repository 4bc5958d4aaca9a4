#pragma once
// Communicators: the concept and the backends (NcclComm only with SQUEEZE_WITH_NCCL=1).
#include "squeeze/comm/communicator.hpp"
#include "squeeze/comm/env.hpp"
#include "squeeze/comm/from_env.hpp"
#include "squeeze/comm/local.hpp"
#include "squeeze/comm/store.hpp"
