# cmake -P script: installs this build into a non-default prefix, then builds and runs a consumer
# of the engine and CpuAdam against it twice — with find_package(strata) (CUDA and MPI packages
# disabled, to show a consumer needs none of their development files) and with
# `pkg-config --cflags --libs strata` alone. Fails (non-zero) on any step.
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
foreach(f include/strata/config.hpp include/strata/engine.hpp include/strata/build_info.hpp
          ${LIBDIR}/cmake/strata/strataConfig.cmake ${LIBDIR}/cmake/strata/strataConfigVersion.cmake
          ${LIBDIR}/pkgconfig/strata.pc ${LIBDIR}/libstrata.so bin/strata)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "install did not produce ${prefix}/${f}")
  endif()
endforeach()
# No static layer, and no CUDA/MPI/NCCL dependency in the exported package.
file(GLOB _static ${prefix}/${LIBDIR}/*.a)
if(_static)
  message(FATAL_ERROR "install put static libraries in the prefix: ${_static}")
endif()
file(GLOB _cmake_files ${prefix}/${LIBDIR}/cmake/strata/*.cmake)
foreach(f ${_cmake_files})
  file(STRINGS ${f} _lines)
  # Comments may name the private dependencies; IMPORTED_LINK_DEPENDENT_LIBRARIES only tells the
  # linker where libstrata.so's own runtime dependencies are (no package is looked for).
  list(FILTER _lines EXCLUDE REGEX "^[ \t]*#|IMPORTED_LINK_DEPENDENT_LIBRARIES")
  string(JOIN "\n" _text ${_lines})
  if(_text MATCHES "CUDA::|MPI::|CUDAToolkit|find_dependency\\(MPI|nccl|yaml-cpp|LIBURING")
    message(FATAL_ERROR "${f} makes consumers find CUDA/MPI/NCCL/yaml-cpp/liburing:\n${_text}")
  endif()
endforeach()
# strata.pc names the prefix it was installed into.
file(READ ${prefix}/${LIBDIR}/pkgconfig/strata.pc _pc)
if(NOT _pc MATCHES "prefix=${prefix}\n")
  message(FATAL_ERROR "strata.pc does not name the install prefix ${prefix}:\n${_pc}")
endif()

step(${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
     -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release
     -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=TRUE -DCMAKE_DISABLE_FIND_PACKAGE_MPI=TRUE)
step(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
step(${WORK_DIR}/build/strata_consumer)
if(NOT step_out MATCHES "consumer ok")
  message(FATAL_ERROR "consumer printed: ${step_out}")
endif()
message(STATUS "find_package consumer: ${step_out}")

# pkg-config alone: compile and link the same program with its flags, run it against the prefix.
set(ENV{PKG_CONFIG_PATH} ${prefix}/${LIBDIR}/pkgconfig)
step(pkg-config --cflags --libs strata)
string(STRIP "${step_out}" _flags)
if(NOT _flags MATCHES "-L${prefix}/${LIBDIR}" OR NOT _flags MATCHES "-lstrata")
  message(FATAL_ERROR "pkg-config strata gave: ${_flags}")
endif()
separate_arguments(_flags UNIX_COMMAND "${_flags}")
step(${CXX} -O1 ${CONSUMER_DIR}/main.cpp ${_flags} -o ${WORK_DIR}/consumer_pc)
set(ENV{LD_LIBRARY_PATH} ${prefix}/${LIBDIR})
step(${WORK_DIR}/consumer_pc)
if(NOT step_out MATCHES "consumer ok")
  message(FATAL_ERROR "pkg-config consumer printed: ${step_out}")
endif()
message(STATUS "pkg-config consumer: ${step_out}")
step(${prefix}/bin/strata --version)
file(REMOVE_RECURSE ${WORK_DIR})
