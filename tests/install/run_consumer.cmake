# cmake -P script: install, build the consumer, run it. Fails (non-zero) on any step.
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "step failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(step_out "${out}" PARENT_SCOPE)
endfunction()

step(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
foreach(f include/strata/config.hpp include/strata/build_info.hpp lib/cmake/strata/strataConfig.cmake
          lib/cmake/strata/strataConfigVersion.cmake lib/pkgconfig/strata.pc bin/strata)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "install did not produce ${prefix}/${f}")
  endif()
endforeach()

step(${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
     -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
step(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
step(${WORK_DIR}/build/strata_consumer)
if(NOT step_out MATCHES "consumer ok")
  message(FATAL_ERROR "consumer printed: ${step_out}")
endif()
message(STATUS "find_package consumer: ${step_out}")

# pkg-config: flags resolve and point into the prefix.
set(ENV{PKG_CONFIG_PATH} ${prefix}/lib/pkgconfig)
step(pkg-config --cflags --libs strata)
if(NOT step_out MATCHES "-lstrata_core")
  message(FATAL_ERROR "pkg-config strata gave: ${step_out}")
endif()
step(${prefix}/bin/strata --version)
file(REMOVE_RECURSE ${WORK_DIR})
