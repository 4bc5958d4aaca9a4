# Dependencies of squeeze's own tests, examples and benchmarks (the library itself needs none).
find_package(Threads REQUIRED)
find_package(OpenMP)
find_package(GTest)
find_package(benchmark)
find_package(CLI11 CONFIG)
find_package(nlohmann_json CONFIG)
find_package(fmt CONFIG)
if(SQUEEZE_HAS_CUDA)
  find_package(NCCL)
endif()

# libtorch: PyPI's `torch` wheel ships its CMake config; find it without importing torch (a wheel
# installed with --no-deps cannot be imported, yet its C++ libraries link and run for CPU work).
if(NOT Torch_DIR AND NOT CMAKE_PREFIX_PATH MATCHES "torch")
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    execute_process(COMMAND ${Python3_EXECUTABLE} -c
      "import importlib.util as u; s=u.find_spec('torch'); print(s.submodule_search_locations[0] if s else '')"
      OUTPUT_VARIABLE _torch_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_torch_dir AND EXISTS "${_torch_dir}/share/cmake/Torch")
      set(Torch_DIR "${_torch_dir}/share/cmake/Torch")
    endif()
  endif()
endif()
find_package(Torch QUIET)
if(Torch_FOUND)
  # One target for everything of ours that includes libtorch. CPU work needs only torch_cpu + c10;
  # SQUEEZE_TORCH_CUDA=ON links libtorch's CUDA side too (the GPU machine).
  add_library(squeeze_torch INTERFACE)
  if(SQUEEZE_TORCH_CUDA)
    target_link_libraries(squeeze_torch INTERFACE ${TORCH_LIBRARIES})
  else()
    target_link_libraries(squeeze_torch INTERFACE torch_cpu c10)
    target_include_directories(squeeze_torch INTERFACE ${TORCH_INCLUDE_DIRS})
  endif()
  target_compile_definitions(squeeze_torch INTERFACE SQUEEZE_WITH_TORCH=1)
  message(STATUS "squeeze: libtorch ${Torch_VERSION} (CUDA side linked: ${SQUEEZE_TORCH_CUDA})")
else()
  message(STATUS "squeeze: libtorch not found; torch-based tests and examples are skipped")
endif()

# Compile-time cache: pays for the torch-including translation units.
find_program(CCACHE_PROGRAM ccache)
if(CCACHE_PROGRAM AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_CXX_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
endif()
