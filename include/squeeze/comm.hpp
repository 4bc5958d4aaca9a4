#pragma once
// Communicators: the concept and the backends (NcclComm only with SQUEEZE_WITH_NCCL=1).
#include "comm/communicator.hpp"
#include "comm/env.hpp"
#include "comm/from_env.hpp"
#include "comm/local.hpp"
#include "comm/store.hpp"
