# What `cmake --install` puts under the prefix: libstrata.so (every layer, its dependencies
# private; exported as strata::strata), the public headers, the CLI, the CMake package and the
# pkg-config file. The static layers stay in the build tree.
include(CMakePackageConfigHelpers)
install(TARGETS strata_shared EXPORT strataTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS strata_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/strata ${PROJECT_BINARY_DIR}/include/strata
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT strataTargets NAMESPACE strata:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/strata)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/strataConfig.cmake.in
  ${PROJECT_BINARY_DIR}/strataConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/strata)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/strataConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/strataConfig.cmake ${PROJECT_BINARY_DIR}/strataConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/strata)

# pkg-config: the prefix is the one `cmake --install [--prefix P]` installs into, so the file is
# written at install time (from the configured template, %STRATA_PREFIX% replaced).
set(_pc_private "")
foreach(_dep ${STRATA_SHARED_PRIVATE_DEPS})
  string(APPEND _pc_private " ${_dep}")
endforeach()
set(STRATA_PC_PRIVATE_NOTE "${_pc_private}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/strata.pc.in ${PROJECT_BINARY_DIR}/strata.pc.template @ONLY)
install(CODE "
  file(READ \"${PROJECT_BINARY_DIR}/strata.pc.template\" _pc)
  string(REPLACE \"%STRATA_PREFIX%\" \"\${CMAKE_INSTALL_PREFIX}\" _pc \"\${_pc}\")
  file(WRITE \"${PROJECT_BINARY_DIR}/pkgconfig/strata.pc\" \"\${_pc}\")
")
install(FILES ${PROJECT_BINARY_DIR}/pkgconfig/strata.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
