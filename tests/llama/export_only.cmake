# cmake -DPROGRAM=<llama_train> -DHF=<Hugging Face LLaMA dir> -DOUT=<scratch dir> -P export_only.cmake
# `llama_train --hf DIR --steps 0 --export-hf OUT` with no --corpus: a conversion, which must neither read a corpus
# (the KJV may be missing, the built-in text is shorter than the default --seq 128) nor evaluate, and must write OUT.
file(REMOVE_RECURSE ${OUT})
execute_process(COMMAND ${PROGRAM} --threads 1 --hf ${HF} --steps 0 --export-hf ${OUT}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message(STATUS "llama_train:\n${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "llama_train --steps 0 --export-hf failed (exit ${rc})")
endif()
if("${out}${err}" MATCHES "corpus: |validation perplexity|sample: ")
  message(FATAL_ERROR "llama_train --steps 0 --export-hf read a corpus or evaluated; an export-only run needs no data")
endif()
file(GLOB weights ${OUT}/*.safetensors)
if(NOT EXISTS ${OUT}/config.json OR NOT weights)
  message(FATAL_ERROR "llama_train --steps 0 --export-hf wrote no config.json and safetensors into ${OUT}")
endif()
message(STATUS "exported without data: ${weights}")
