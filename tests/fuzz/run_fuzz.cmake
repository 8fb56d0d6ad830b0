# Runs the config fuzzer: first every regression input once (tests/fuzz/regressions), then
# SECONDS of fuzzing from a seed corpus of the shipped configs, with per-input time and memory
# limits. Fails on any crash, leak, timeout or out-of-memory.
# cmake -DFUZZER=... -DSOURCE_DIR=... -DWORK_DIR=... -DSECONDS=45 -P run_fuzz.cmake
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR}/corpus ${WORK_DIR}/seeds)
file(GLOB seeds ${SOURCE_DIR}/configs/*.yaml ${SOURCE_DIR}/bench/step/*.yaml
     ${SOURCE_DIR}/tests/fuzz/seeds/*)
file(COPY ${seeds} DESTINATION ${WORK_DIR}/seeds)
file(GLOB regressions ${SOURCE_DIR}/tests/fuzz/regressions/*)
set(limits -timeout=10 -rss_limit_mb=1024 -malloc_limit_mb=512)
if(regressions)
  execute_process(COMMAND ${FUZZER} ${limits} ${regressions} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "fuzz_config: a regression input fails (exit ${rc})")
  endif()
endif()
execute_process(COMMAND ${FUZZER} ${limits} -max_total_time=${SECONDS} -print_final_stats=1
                        -dict=${SOURCE_DIR}/tests/fuzz/config.dict
                        -artifact_prefix=${WORK_DIR}/
                        ${WORK_DIR}/corpus ${WORK_DIR}/seeds
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  file(GLOB found ${WORK_DIR}/crash-* ${WORK_DIR}/leak-* ${WORK_DIR}/timeout-* ${WORK_DIR}/oom-*)
  message(FATAL_ERROR "fuzz_config: the fuzzer failed (exit ${rc}); inputs: ${found}")
endif()
