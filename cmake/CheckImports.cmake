# cmake -DPROGRAMS="a;b" -P CheckImports.cmake: fails if a program imports std::filesystem::remove_all (any overload).
# libtorch's wheels export their own statically linked copy (pytorch/pytorch#133437), a program linked with libtorch
# binds to it, and the copy in the 2.11 CUDA wheel crashed pruning checkpoints: squeeze removes trees with
# io::remove_tree (glibc's nftw) instead.
find_program(NM nm REQUIRED)
set(bad "")
foreach(program IN LISTS PROGRAMS)
  execute_process(COMMAND ${NM} -D --undefined-only ${program} OUTPUT_VARIABLE imports RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "nm could not read ${program}")
  endif()
  if(imports MATCHES "_ZNSt10filesystem10remove_all")
    list(APPEND bad ${program})
  endif()
endforeach()
if(bad)
  message(FATAL_ERROR "these programs import std::filesystem::remove_all; use squeeze::io::remove_tree: ${bad}")
endif()
list(LENGTH PROGRAMS n)
message(STATUS "${n} programs import no std::filesystem::remove_all")
