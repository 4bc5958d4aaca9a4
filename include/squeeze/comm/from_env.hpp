#pragma once
// comm::from_env(): the communicator the launcher asked for.
//   WORLD_SIZE unset or 1 -> LocalComm of one rank (every collective a copy or nothing)
//   WORLD_SIZE > 1        -> NcclComm over the torchrun environment (needs SQUEEZE_WITH_NCCL=1)
#include <cstdlib>
#include <string>

#include "squeeze/comm/communicator.hpp"
#include "squeeze/comm/env.hpp"
#include "squeeze/comm/local.hpp"
#if defined(SQUEEZE_WITH_NCCL) && SQUEEZE_WITH_NCCL
#include "squeeze/comm/nccl.hpp"
#endif

namespace squeeze::comm {

inline CommPtr from_env() {
  const DistEnv env = DistEnv::from_environment();  // validates every variable
  const int world = env.world;
  if (world == 1) return LocalComm::single();
#if defined(SQUEEZE_WITH_NCCL) && SQUEEZE_WITH_NCCL
  return NcclComm::from_env();
#else
  throw Error("WORLD_SIZE=" + std::to_string(world) +
              " needs the NCCL backend: build with CUDA and NCCL and define SQUEEZE_WITH_NCCL=1 (link NCCL::nccl)");
#endif
}

}  // namespace squeeze::comm
