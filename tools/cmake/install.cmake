# `cmake --install build --prefix P`: headers, libraries, the CLI, a CMake package (find_package(mxscope
# CONFIG) gives mxscope::mxscope and the header-only mxscope::core) and the Python package under
# P/lib/python3/dist-packages (PYTHONPATH=P/lib/python3/dist-packages python3 -c 'import mxscope').
include(CMakePackageConfigHelpers)
set(MXSCOPE_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/mxscope)
set(MXSCOPE_INSTALL_PYTHONDIR lib/python3/dist-packages CACHE STRING
    "Where the Python package goes, relative to the prefix (Debian's layout)")

set_target_properties(mxscope_core PROPERTIES EXPORT_NAME core)
set_target_properties(mxscope PROPERTIES EXPORT_NAME mxscope)
set(mxscope_export_targets mxscope_core mxscope)
if(TARGET mxscope_gpu)
  set_target_properties(mxscope_gpu PROPERTIES EXPORT_NAME gpu)
  list(APPEND mxscope_export_targets mxscope_gpu)
endif()
install(TARGETS ${mxscope_export_targets} EXPORT mxscopeTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS mxscope_c LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS mxscope_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/mxscope DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.hpp" PATTERN "*.h")
install(FILES ${PROJECT_BINARY_DIR}/generated/mxscope/version.hpp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/mxscope)
install(EXPORT mxscopeTargets NAMESPACE mxscope:: DESTINATION ${MXSCOPE_INSTALL_CMAKEDIR})

configure_package_config_file(${PROJECT_SOURCE_DIR}/tools/cmake/mxscopeConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/mxscopeConfig.cmake INSTALL_DESTINATION ${MXSCOPE_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/mxscopeConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/mxscopeConfig.cmake ${PROJECT_BINARY_DIR}/mxscopeConfigVersion.cmake
        DESTINATION ${MXSCOPE_INSTALL_CMAKEDIR})

# The Python package finds libmxscope_c at ../../../libmxscope_c.so from its folder (P/lib), or
# through MXSCOPE_LIBRARY (python/mxscope/_lib.py).
install(DIRECTORY ${PROJECT_SOURCE_DIR}/python/mxscope DESTINATION ${MXSCOPE_INSTALL_PYTHONDIR}
        PATTERN "__pycache__" EXCLUDE PATTERN "*.pyc" EXCLUDE)
