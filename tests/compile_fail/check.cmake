# cmake -DCXX=<compiler> -DINCLUDE=<dir> [-DKERNELS=<dir>] -DSOURCE=<file> -DCASE=<name> -DEXPECT=<regex> -P check.cmake
# (INCLUDE: the library's include/; KERNELS: the kernels' root, kernels/)
# Passes when the case fails to compile AND the compiler's output contains EXPECT (the static_assert
# message that tells the user what to write instead); CASE=valid must compile.
list(APPEND INCLUDE ${KERNELS})
list(TRANSFORM INCLUDE PREPEND "-I")
execute_process(COMMAND ${CXX} -std=c++20 -fsyntax-only ${INCLUDE} -DCASE_${CASE} ${SOURCE}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(CASE STREQUAL "valid")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the valid composition did not compile:\n${err}")
  endif()
  return()
endif()
if(rc EQUAL 0)
  message(FATAL_ERROR "case ${CASE} compiled, but it must be rejected")
endif()
string(REGEX MATCH "${EXPECT}" found "${out}${err}")
if(NOT found)
  message(FATAL_ERROR "case ${CASE} failed for another reason than expected (wanted /${EXPECT}/):\n${err}")
endif()
message(STATUS "case ${CASE}: rejected with the expected message")
