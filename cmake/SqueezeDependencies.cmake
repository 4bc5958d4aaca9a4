# Dependencies of squeeze's own tests, examples and benchmarks (the library itself needs none).
find_package(Threads REQUIRED)
find_package(OpenMP)
find_package(GTest)
find_package(benchmark)
find_package(CLI11 CONFIG QUIET)
find_package(nlohmann_json CONFIG QUIET)
find_package(fmt CONFIG QUIET)

# Machines without these packages (the GPU machine reaches no registry) may carry their sources in
# SQUEEZE_DEPS_DIR: googletest/ (GoogleTest's source tree) and include/{CLI,nlohmann,fmt} (headers).
set(SQUEEZE_DEPS_DIR "${PROJECT_SOURCE_DIR}/.deps" CACHE PATH "carried sources of test/example dependencies")
if(NOT GTest_FOUND AND EXISTS "${SQUEEZE_DEPS_DIR}/googletest/CMakeLists.txt")
  set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
  set(BUILD_GMOCK ON CACHE BOOL "" FORCE)
  add_subdirectory("${SQUEEZE_DEPS_DIR}/googletest" "${PROJECT_BINARY_DIR}/_deps/googletest" EXCLUDE_FROM_ALL)
  add_library(GTest::gtest_main ALIAS gtest_main)
  add_library(GTest::gtest ALIAS gtest)
  set(GTest_FOUND ON)
  message(STATUS "squeeze: GoogleTest from ${SQUEEZE_DEPS_DIR}/googletest")
endif()
if(NOT TARGET CLI11::CLI11 AND EXISTS "${SQUEEZE_DEPS_DIR}/include/CLI")
  add_library(CLI11::CLI11 INTERFACE IMPORTED)
  target_include_directories(CLI11::CLI11 INTERFACE "${SQUEEZE_DEPS_DIR}/include")
endif()
if(NOT TARGET nlohmann_json::nlohmann_json AND EXISTS "${SQUEEZE_DEPS_DIR}/include/nlohmann")
  add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED)
  target_include_directories(nlohmann_json::nlohmann_json INTERFACE "${SQUEEZE_DEPS_DIR}/include")
endif()
if(NOT TARGET fmt::fmt AND EXISTS "${SQUEEZE_DEPS_DIR}/include/fmt")
  add_library(fmt::fmt INTERFACE IMPORTED)
  target_include_directories(fmt::fmt INTERFACE "${SQUEEZE_DEPS_DIR}/include")
  target_compile_definitions(fmt::fmt INTERFACE FMT_HEADER_ONLY=1)
endif()
# Training checkpoints (train/checkpoint.hpp, io/checkpoint_store.hpp) hash with OpenSSL's libcrypto (Debian:
# libssl-dev) and index in JSON.
find_package(OpenSSL COMPONENTS Crypto)
if(TARGET OpenSSL::Crypto AND TARGET nlohmann_json::nlohmann_json)
  add_library(squeeze_checkpoint_deps INTERFACE)
  target_link_libraries(squeeze_checkpoint_deps INTERFACE nlohmann_json::nlohmann_json OpenSSL::Crypto)
endif()
# SentencePiece tokenizer files (io/sentencepiece.hpp; Debian: libsentencepiece-dev): squeeze-tokenize and its tests.
find_path(SQUEEZE_SENTENCEPIECE_INCLUDE sentencepiece_processor.h)
find_library(SQUEEZE_SENTENCEPIECE_LIB sentencepiece)
if(SQUEEZE_SENTENCEPIECE_INCLUDE AND SQUEEZE_SENTENCEPIECE_LIB)
  add_library(squeeze_sentencepiece INTERFACE)
  target_include_directories(squeeze_sentencepiece INTERFACE ${SQUEEZE_SENTENCEPIECE_INCLUDE})
  target_link_libraries(squeeze_sentencepiece INTERFACE ${SQUEEZE_SENTENCEPIECE_LIB})
endif()
if(SQUEEZE_HAS_CUDA)
  find_package(NCCL)
endif()

if(NOT SQUEEZE_TORCH_FOUND)
  message(STATUS "squeeze: torch-based tests and examples are skipped")
endif()

# Compile-time cache: pays for the torch-including translation units. Every unit's compile time goes to
# compile_times.log in the build tree (setup.sh prints the slowest); -DSQUEEZE_TIME_COMPILES=OFF leaves it out.
option(SQUEEZE_TIME_COMPILES "Log each translation unit's compile time to <build>/compile_times.log" ON)
find_program(CCACHE_PROGRAM ccache)
if(NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(_squeeze_launcher "")
  find_program(BASH_PROGRAM bash)
  if(SQUEEZE_TIME_COMPILES AND BASH_PROGRAM)
    list(APPEND _squeeze_launcher ${BASH_PROGRAM} ${PROJECT_SOURCE_DIR}/cmake/time_compile.sh ${PROJECT_BINARY_DIR}/compile_times.log)
  endif()
  if(CCACHE_PROGRAM)
    list(APPEND _squeeze_launcher ${CCACHE_PROGRAM})
  endif()
  if(_squeeze_launcher)
    set(CMAKE_CXX_COMPILER_LAUNCHER ${_squeeze_launcher})
    set(CMAKE_CUDA_COMPILER_LAUNCHER ${_squeeze_launcher})
  endif()
endif()

# squeeze_unit_parts(<sources var> <macro> <header> <parts var> <doc>): the cache variable <parts var> (8 translation units
# on a GPU machine's libtorch build, whose cores compile them in parallel; 1 elsewhere, where each unit would parse
# libtorch's headers again), and one small generated unit per part that defines <macro> as its part and includes <header>
# (which instantiates that part's share of a compile-time table, e.g. the strategies), appended to <sources var>. Nothing
# is generated for one part: the main unit instantiates them all.
function(squeeze_unit_parts sources_var macro header parts_var doc)
  if(SQUEEZE_TORCH_CUDA)
    set(_default 8)
  else()
    set(_default 1)
  endif()
  set(${parts_var} ${_default} CACHE STRING "${doc}")
  set(_sources ${${sources_var}})
  if(${parts_var} GREATER 1)
    math(EXPR _last "${${parts_var}} - 1")
    foreach(part RANGE 0 ${_last})
      string(MAKE_C_IDENTIFIER "${header}" _stem)
      set(_f ${CMAKE_CURRENT_BINARY_DIR}/${_stem}_part${part}.cpp)
      file(CONFIGURE OUTPUT ${_f} CONTENT "#define ${macro} ${part}\n#include \"${header}\"\n")
      list(APPEND _sources ${_f})
    endforeach()
  endif()
  set(${sources_var} ${_sources} PARENT_SCOPE)
endfunction()

# Host flags for a torch translation unit that nvcc compiles (CUDA libtorch builds: bench_table, llama_train,
# llama_gptq). g++'s -fno-math-errno and OpenMP reach the host compiler only through -Xcompiler
# (OpenMP::OpenMP_CXX's flags apply to CXX sources alone); the CPU AdamW of Offload<Host> needs both to
# vectorise and to use every core. 3189: libtorch's headers use `module` as a name, which nvcc remarks on.
function(squeeze_torch_nvcc_tu target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-fno-math-errno -diag-suppress=3189>)
  if(TARGET OpenMP::OpenMP_CXX)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-fopenmp>)
    target_link_libraries(${target} PRIVATE OpenMP::OpenMP_CXX)
  endif()
  # The CUDA runtime libtorch uses (shared), not nvcc's default static copy: two runtimes keep two current
  # devices per thread, and squeeze code (NcclComm, the offload worker's events) would then work on device 0
  # while libtorch works on cuda:LOCAL_RANK (world > 1, ranks other than 0).
  set_target_properties(${target} PROPERTIES CUDA_RUNTIME_LIBRARY Shared)
endfunction()

# A precompiled <torch/torch.h> shared by the torch-including C++ programs (g++ only): parsing libtorch's headers is
# ~12 s of each such translation unit's compile. Applied where a target's sources are all host C++ (an nvcc TU keeps
# its own path); g++ falls back to the text header where the flags differ (-Winvalid-pch says so).
# -DSQUEEZE_TORCH_PCH=OFF leaves it out.
option(SQUEEZE_TORCH_PCH "Share one precompiled <torch/torch.h> among the torch C++ programs (g++)" ON)
function(squeeze_use_torch_pch target)
  if(NOT SQUEEZE_TORCH_PCH OR NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU" OR NOT TARGET squeeze_torch)
    return()
  endif()
  # OpenMP defines _OPENMP, which libtorch's headers read: such a target could not use a PCH built without it.
  get_target_property(_libraries ${target} LINK_LIBRARIES)
  if("OpenMP::OpenMP_CXX" IN_LIST _libraries)
    return()
  endif()
  get_target_property(_sources ${target} SOURCES)
  foreach(_source IN LISTS _sources)
    get_source_file_property(_language ${_source} LANGUAGE)
    if(_source MATCHES "\\.cu$" OR _language STREQUAL "CUDA")
      return()
    endif()
  endforeach()
  if(NOT TARGET squeeze_torch_pch)
    add_library(squeeze_torch_pch STATIC ${PROJECT_SOURCE_DIR}/cmake/torch_pch.cpp)
    target_link_libraries(squeeze_torch_pch PRIVATE squeeze_torch)
    target_precompile_headers(squeeze_torch_pch PRIVATE <torch/torch.h>)
  endif()
  target_precompile_headers(${target} REUSE_FROM squeeze_torch_pch)
endfunction()
