# Runs one fuzzer: first every regression input once (tests/fuzz/regressions for fuzz_config,
# tests/fuzz/regressions_<what> for fuzz_<what>), then RUNS inputs generated with libFuzzer seed
# SEED (at most SECONDS when SECONDS > 0) from a seed corpus (the SEEDS globs, '|'-separated,
# relative to SOURCE_DIR), with per-input time and memory limits.
# Fails on any crash, leak, timeout or out-of-memory.
# cmake -DFUZZER=... -DNAME=fuzz_config -DSOURCE_DIR=... -DWORK_DIR=... -DRUNS=2000 -DSEED=1 \
#       [-DSECONDS=60] -DSEEDS=... \
#       [-DDICT=file] -P run_fuzz.cmake
if(NOT NAME)
  set(NAME fuzz_config)
endif()
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR}/corpus ${WORK_DIR}/seeds)
string(REPLACE "|" ";" globs "${SEEDS}")
set(seeds)
foreach(g ${globs})
  file(GLOB found ${SOURCE_DIR}/${g})
  list(APPEND seeds ${found})
endforeach()
if(seeds)
  file(COPY ${seeds} DESTINATION ${WORK_DIR}/seeds)
endif()
string(REPLACE "fuzz_" "" what ${NAME})
if(what STREQUAL "config")
  file(GLOB regressions ${SOURCE_DIR}/tests/fuzz/regressions/*)
else()
  file(GLOB regressions ${SOURCE_DIR}/tests/fuzz/regressions_${what}/*)
endif()
set(limits -timeout=10 -rss_limit_mb=1024 -malloc_limit_mb=512)
if(regressions)
  execute_process(COMMAND ${FUZZER} ${limits} ${regressions} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NAME}: a regression input fails (exit ${rc})")
  endif()
endif()
set(dict)
if(DICT)
  set(dict -dict=${DICT})
endif()
if(NOT DEFINED RUNS)
  set(RUNS 2000)
endif()
if(NOT DEFINED SEED)
  set(SEED 1)
endif()
set(budget -runs=${RUNS} -seed=${SEED})
if(SECONDS GREATER 0)
  list(APPEND budget -max_total_time=${SECONDS})
endif()
execute_process(COMMAND ${FUZZER} ${limits} ${budget} -print_final_stats=1 ${dict}
                        -artifact_prefix=${WORK_DIR}/
                        ${WORK_DIR}/corpus ${WORK_DIR}/seeds
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  file(GLOB found ${WORK_DIR}/crash-* ${WORK_DIR}/leak-* ${WORK_DIR}/timeout-* ${WORK_DIR}/oom-*)
  message(FATAL_ERROR "${NAME}: the fuzzer failed (exit ${rc}); inputs: ${found}")
endif()
