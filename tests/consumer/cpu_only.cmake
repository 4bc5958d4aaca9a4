# cmake -DSOURCE=<squeeze source> -DWORK=<scratch> [-DGENERATOR=...] [-DCXX=<compiler>] [-DTORCH_DIR=<Torch_DIR>]
#       -P cpu_only.cmake
# README's CPU-only switch, -DSQUEEZE_ENABLE_CUDA=OFF, configures, also on a machine with nvcc (where libtorch's
# CMake enables CUDA by itself and the dependency probes then run a CUDA try_compile). Configure only: the tools
# are on, so cmake/SqueezeDependencies.cmake runs; tests, examples and benchmarks are off to keep it quick.
file(REMOVE_RECURSE ${WORK})
set(cfg -DSQUEEZE_ENABLE_CUDA=OFF -DSQUEEZE_BUILD_TOOLS=ON -DSQUEEZE_BUILD_TESTS=OFF -DSQUEEZE_BUILD_EXAMPLES=OFF
        -DSQUEEZE_BUILD_BENCHMARKS=OFF)
if(GENERATOR)
  list(APPEND cfg -G ${GENERATOR})
endif()
if(CXX)
  list(APPEND cfg -DCMAKE_CXX_COMPILER=${CXX})
endif()
if(TORCH_DIR)
  list(APPEND cfg -DTorch_DIR=${TORCH_DIR})  # the libtorch of the enclosing build
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE} -B ${WORK} ${cfg} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring with -DSQUEEZE_ENABLE_CUDA=OFF failed:\n${out}\n${err}")
endif()
if(NOT out MATCHES "squeeze: CUDA OFF")
  message(FATAL_ERROR "-DSQUEEZE_ENABLE_CUDA=OFF did not give a CPU-only configuration:\n${out}")
endif()
string(REGEX MATCH "squeeze: libtorch[^\n]*" found "${out}")
message(STATUS "configured CPU-only in ${WORK}; ${found}")
file(REMOVE_RECURSE ${WORK})
