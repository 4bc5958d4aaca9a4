# libtorch for squeeze's torch layer, shared by squeeze's own build and the installed squeezeConfig.cmake.
# Included at directory scope (find_package(Torch) may enable CUDA, which a function cannot do). Sets
#   SQUEEZE_TORCH_FOUND   libtorch found
#   SQUEEZE_TORCH_CUDA    ON when libtorch's CUDA side is linked, OFF for torch_cpu + c10 alone; the cache
#                         entry of that name is the request: AUTO (default), ON or OFF
# and defines squeeze_torch_usage(<target>): the link libraries, include directories and definitions a
# translation unit including squeeze's torch headers needs, as INTERFACE requirements of <target>.

set(SQUEEZE_TORCH_CUDA AUTO CACHE STRING
    "Link libtorch's CUDA side: AUTO (when it and the NVIDIA runtime it needs link and load here), ON or OFF")
set_property(CACHE SQUEEZE_TORCH_CUDA PROPERTY STRINGS AUTO ON OFF)

# Caffe2's cuda.cmake (inside TorchConfig) appends -gencode flags for its own arch list to
# CMAKE_CUDA_FLAGS (compute_50 and others nvcc 13 rejects) and clears CMAKE_CUDA_ARCHITECTURES:
# keep the including project's CUDA settings. A project that set no architectures (-DSQUEEZE_ENABLE_CUDA=OFF on a
# machine with nvcc: libtorch enables CUDA itself) keeps libtorch's OFF, not an empty value, on which every later
# CUDA try_compile (FindOpenMP's probe) fails with "CUDA_ARCHITECTURES is empty".
set(_squeeze_cuda_flags "${CMAKE_CUDA_FLAGS}")
set(_squeeze_cuda_archs_defined OFF)
if(DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(_squeeze_cuda_archs_defined ON)
  set(_squeeze_cuda_archs "${CMAKE_CUDA_ARCHITECTURES}")
endif()

# Where the user pointed CMake (Torch_DIR, CMAKE_PREFIX_PATH, Torch_ROOT) comes first.
find_package(Torch CONFIG QUIET)
if(NOT Torch_FOUND)
  # The torch wheel ships libtorch's CMake config inside the Python package: ask the python3 on PATH
  # where the package is without importing it (a wheel installed with --no-deps cannot be imported, yet
  # its C++ libraries link and run for CPU work).
  set(_squeeze_torch_hints "")
  if(Python3_EXECUTABLE)
    set(_squeeze_python "${Python3_EXECUTABLE}")
  else()
    find_program(_squeeze_python NAMES python3 python)
  endif()
  if(_squeeze_python)
    execute_process(COMMAND "${_squeeze_python}" -c
      "import importlib.util as u; s=u.find_spec('torch'); print(s.submodule_search_locations[0] if s else '')"
      OUTPUT_VARIABLE _squeeze_torch_pkg OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_squeeze_torch_pkg AND EXISTS "${_squeeze_torch_pkg}/share/cmake/Torch")
      list(APPEND _squeeze_torch_hints "${_squeeze_torch_pkg}/share/cmake/Torch")
    endif()
  endif()
  # The installed config also remembers the libtorch squeeze was built against.
  if(SQUEEZE_BUILT_WITH_TORCH_DIR AND EXISTS "${SQUEEZE_BUILT_WITH_TORCH_DIR}")
    list(APPEND _squeeze_torch_hints "${SQUEEZE_BUILT_WITH_TORCH_DIR}")
  endif()
  if(_squeeze_torch_hints)
    find_package(Torch CONFIG QUIET HINTS ${_squeeze_torch_hints})
  endif()
endif()

set(CMAKE_CUDA_FLAGS "${_squeeze_cuda_flags}")
if(_squeeze_cuda_archs_defined)
  set(CMAKE_CUDA_ARCHITECTURES "${_squeeze_cuda_archs}")
endif()

set(SQUEEZE_TORCH_FOUND OFF)
string(TOUPPER "${SQUEEZE_TORCH_CUDA}" _squeeze_torch_request)
set(SQUEEZE_TORCH_CUDA OFF)
if(Torch_FOUND)
  set(SQUEEZE_TORCH_FOUND ON)
  set(_squeeze_torch_why "")
  if(NOT _squeeze_torch_request)
    set(_squeeze_torch_why "SQUEEZE_TORCH_CUDA=${_squeeze_torch_request}")
  else()  # ON or AUTO
    if(NOT TARGET torch_cuda)
      set(_squeeze_torch_why "this libtorch has no CUDA side")
    elseif(_squeeze_torch_request STREQUAL "AUTO")
      # The torch wheel installed without its NVIDIA runtime wheels still carries libtorch_cuda, so the
      # target exists and ${TORCH_LIBRARIES} fails to link or to load: build and start a program linked
      # against it, once per libtorch.
      if(NOT "$CACHE{_SQUEEZE_TORCH_CUDA_PROBE_DIR}" STREQUAL "${Torch_DIR}")
        set(_squeeze_probe_dir "${CMAKE_BINARY_DIR}/CMakeFiles/squeeze_torch_cuda_probe")
        file(WRITE "${_squeeze_probe_dir}/probe.cpp" "int main() { return 0; }\n")
        # try_compile re-creates the imported targets it links, but not Caffe2's stand-in for protobuf
        # (an ALIAS of a plain INTERFACE library) which torch_cpu names: declare it there, empty.
        file(WRITE "${_squeeze_probe_dir}/stubs.cmake"
             "if(NOT TARGET protobuf::libprotobuf)\n  add_library(protobuf::libprotobuf INTERFACE IMPORTED)\nendif()\n")
        set(_squeeze_try_type "${CMAKE_TRY_COMPILE_TARGET_TYPE}")
        set(CMAKE_TRY_COMPILE_TARGET_TYPE EXECUTABLE)
        if(CMAKE_CROSSCOMPILING)
          try_compile(_squeeze_probe_ok SOURCES "${_squeeze_probe_dir}/probe.cpp" NO_CACHE
                      CMAKE_FLAGS "-DCMAKE_PROJECT_INCLUDE=${_squeeze_probe_dir}/stubs.cmake"
                      LINK_LIBRARIES ${TORCH_LIBRARIES} OUTPUT_VARIABLE _squeeze_probe_log)
        else()
          try_run(_squeeze_probe_run _squeeze_probe_ok SOURCES "${_squeeze_probe_dir}/probe.cpp" NO_CACHE
                  CMAKE_FLAGS "-DCMAKE_PROJECT_INCLUDE=${_squeeze_probe_dir}/stubs.cmake"
                  LINK_LIBRARIES ${TORCH_LIBRARIES} COMPILE_OUTPUT_VARIABLE _squeeze_probe_log
                  RUN_OUTPUT_VARIABLE _squeeze_probe_out)
          if(_squeeze_probe_ok AND NOT _squeeze_probe_run EQUAL 0)
            set(_squeeze_probe_ok OFF)
            set(_squeeze_probe_log "${_squeeze_probe_out}")
          endif()
        endif()
        set(CMAKE_TRY_COMPILE_TARGET_TYPE "${_squeeze_try_type}")
        if(_squeeze_probe_ok)
          set(_squeeze_probe_result ON)
        else()
          # What the linker or the loader reported first names the missing NVIDIA library.
          string(REGEX MATCH "[^ \n:(]+, needed by [^ \n]+, not found|[^ \n:]+: cannot open shared object file"
                 _squeeze_probe_result "${_squeeze_probe_log}")
          if(NOT _squeeze_probe_result)
            set(_squeeze_probe_result "a program linked against it does not build or start")
          endif()
        endif()
        set(_SQUEEZE_TORCH_CUDA_PROBE "${_squeeze_probe_result}" CACHE INTERNAL "ON, or why libtorch's CUDA side does not link or load")
        set(_SQUEEZE_TORCH_CUDA_PROBE_DIR "${Torch_DIR}" CACHE INTERNAL "the libtorch _SQUEEZE_TORCH_CUDA_PROBE is about")
      endif()
      set(_squeeze_probe_result "$CACHE{_SQUEEZE_TORCH_CUDA_PROBE}")
      if(_squeeze_probe_result STREQUAL "ON")
        set(SQUEEZE_TORCH_CUDA ON)
      else()
        string(CONCAT _squeeze_torch_why "its CUDA side does not link or load here (${_squeeze_probe_result}; "
               "probed once per libtorch: -U_SQUEEZE_TORCH_CUDA_PROBE_DIR probes again, -DSQUEEZE_TORCH_CUDA=ON forces it)")
      endif()
    else()
      set(SQUEEZE_TORCH_CUDA ON)  # asked for explicitly: linked as is
    endif()
    if(_squeeze_torch_request STREQUAL "ON" AND NOT SQUEEZE_TORCH_CUDA)
      message(FATAL_ERROR "squeeze: SQUEEZE_TORCH_CUDA=ON, but ${_squeeze_torch_why} (libtorch at ${Torch_DIR})")
    endif()
  endif()

  # The requirements, kept for squeeze_torch_usage(). CPU work needs only torch_cpu and c10; the CUDA
  # side brings the whole of ${TORCH_LIBRARIES}, and SQUEEZE_TORCH_CUDA=1 turns on squeeze's real side
  # streams, events and allocator statistics (c10_cuda).
  if(SQUEEZE_TORCH_CUDA)
    set(SQUEEZE_TORCH_LIBRARIES ${TORCH_LIBRARIES})
    set(SQUEEZE_TORCH_DEFINITIONS SQUEEZE_WITH_TORCH=1 SQUEEZE_TORCH_CUDA=1)
    set(_squeeze_torch_side "the CUDA side")
  else()
    set(SQUEEZE_TORCH_LIBRARIES torch_cpu c10)
    set(SQUEEZE_TORCH_DEFINITIONS SQUEEZE_WITH_TORCH=1)
    set(_squeeze_torch_side "CPU libraries only")
    if(_squeeze_torch_why)
      string(APPEND _squeeze_torch_side ": ${_squeeze_torch_why}")
    endif()
  endif()
  set(SQUEEZE_TORCH_INCLUDE_DIRS ${TORCH_INCLUDE_DIRS})
  # torch_cpu does not carry libtorch's required flags (the C++ ABI); the torch target does.
  separate_arguments(SQUEEZE_TORCH_OPTIONS UNIX_COMMAND "${TORCH_CXX_FLAGS}")
  if(NOT squeeze_FIND_QUIETLY)
    message(STATUS "squeeze: libtorch ${Torch_VERSION} at ${Torch_DIR}; squeeze::torch links ${_squeeze_torch_side}")
  endif()
else()
  string(CONCAT SQUEEZE_TORCH_NOT_FOUND_MESSAGE
      "libtorch not found, so squeeze::torch is not defined. Point CMake at it with "
      "-DTorch_DIR=<libtorch>/share/cmake/Torch (or add <libtorch> to CMAKE_PREFIX_PATH), or install the "
      "torch wheel for the python3 on PATH (python3 -m pip install torch).")
endif()

function(squeeze_torch_usage target)
  target_link_libraries(${target} INTERFACE ${SQUEEZE_TORCH_LIBRARIES})
  target_include_directories(${target} INTERFACE ${SQUEEZE_TORCH_INCLUDE_DIRS})
  target_compile_definitions(${target} INTERFACE ${SQUEEZE_TORCH_DEFINITIONS})
  if(SQUEEZE_TORCH_OPTIONS)
    target_compile_options(${target} INTERFACE ${SQUEEZE_TORCH_OPTIONS})
  endif()
endfunction()
