# Runs COMMAND with ARGS and fails unless it exits with EXPECTED_EXIT and prints a message (one
# matching EXPECTED_ERROR, where given).
execute_process(COMMAND ${COMMAND} ${ARGS} RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT code EQUAL EXPECTED_EXIT)
  message(FATAL_ERROR "exit code ${code}, expected ${EXPECTED_EXIT}\nstdout: ${out}\nstderr: ${err}")
endif()
if(err STREQUAL "")
  message(FATAL_ERROR "no error message on stderr")
endif()
if(DEFINED EXPECTED_ERROR AND NOT err MATCHES "${EXPECTED_ERROR}")
  message(FATAL_ERROR "stderr does not match '${EXPECTED_ERROR}': ${err}")
endif()
message(STATUS "exit ${code}: ${err}")
