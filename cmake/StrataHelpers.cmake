# Build flags shared by every strata target (never exported: BUILD_INTERFACE only).
add_library(strata_build_flags INTERFACE)
target_compile_features(strata_build_flags INTERFACE cxx_std_20)
target_compile_options(strata_build_flags INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-missing-field-initializers>)
if(STRATA_SANITIZE)
  target_compile_options(strata_build_flags INTERFACE
    $<$<COMPILE_LANGUAGE:CXX,C>:-fsanitize=${STRATA_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all>)
  target_link_options(strata_build_flags INTERFACE -fsanitize=${STRATA_SANITIZE})
endif()

set_property(GLOBAL PROPERTY STRATA_LAYERS "")

# strata_add_layer(NAME SOURCES a.cpp b.cpp [DEPS strata_core ...] [PRIVATE_DEPS ...])
# Creates static library strata_<NAME> (alias strata::<NAME>), exported and installed with the
# package; strata::strata links all layers.
function(strata_add_layer name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  set(tgt strata_${name})
  add_library(${tgt} STATIC ${ARG_SOURCES})
  add_library(strata::${name} ALIAS ${tgt})
  set_target_properties(${tgt} PROPERTIES POSITION_INDEPENDENT_CODE ON EXPORT_NAME ${name}
                                          OUTPUT_NAME strata_${name})
  target_include_directories(${tgt}
    PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
           $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/include>
           $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
    PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_compile_features(${tgt} PUBLIC cxx_std_20)
  target_link_libraries(${tgt} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS}
                        $<BUILD_INTERFACE:strata_build_flags>)
  set_property(GLOBAL APPEND PROPERTY STRATA_LAYERS ${tgt})
endfunction()

# strata_add_test(NAME SOURCES ... [DEPS ...] [LABELS ...] [TIMEOUT s] [COST c])
# A GoogleTest executable registered with CTest. Exit code 77 = SKIPPED (hardware missing).
# COST: about its seconds, for a long test: CTest starts the costliest tests first when it has no
# timings of its own (a fresh clone, CI), so that a long test does not start last and run alone.
function(strata_add_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT;COST" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest strata_test_main strata_build_flags)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
  target_precompile_headers(${name} REUSE_FROM strata_test_main)  # GoogleTest (tests/CMakeLists)
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fpch-preprocess>)
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  add_test(NAME ${name} COMMAND ${name})
  # One CPU of CTest's "cpus" resource (tests/CMakeLists.txt), which the binary pins itself to
  # (tests/test_main.cpp); a test that starts processes of its own unsets it.
  set_tests_properties(${name} PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT ${ARG_TIMEOUT}
                       LABELS "${ARG_LABELS}" RESOURCE_GROUPS "cpus:1"
                       ENVIRONMENT "STRATA_SOURCE_DIR=${PROJECT_SOURCE_DIR};STRATA_BINARY_DIR=${PROJECT_BINARY_DIR}")
  if(ARG_COST)
    set_tests_properties(${name} PROPERTIES COST ${ARG_COST})
  endif()
endfunction()

# strata_add_mpi_tests(NAME): test NAME (a strata_add_test binary) again under mpirun with 2 and 4
# processes, as NAME_np2 and NAME_np4; nothing without MPI.
function(strata_add_mpi_tests name)
  if(NOT (STRATA_HAVE_MPI AND MPIEXEC_EXECUTABLE))
    return()
  endif()
  foreach(np 2 4)
    add_test(NAME ${name}_np${np}
             COMMAND ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe ${MPIEXEC_NUMPROC_FLAG} ${np}
                     $<TARGET_FILE:${name}>)
    set_tests_properties(${name}_np${np} PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 300
                         LABELS "no_sanitizer;mpi" PROCESSORS ${np})
  endforeach()
endfunction()

# strata_add_subdirectories(): add_subdirectory() for every folder here with a CMakeLists.txt (the
# tests' and the benchmarks' per-layer folders).
function(strata_add_subdirectories)
  file(GLOB _dirs LIST_DIRECTORIES true ${CMAKE_CURRENT_SOURCE_DIR}/*)
  foreach(dir ${_dirs})
    if(IS_DIRECTORY ${dir} AND EXISTS ${dir}/CMakeLists.txt)
      add_subdirectory(${dir})
    endif()
  endforeach()
endfunction()
