# Writes OUT (mxscope/version.hpp) from TEMPLATE with the version VERSION and the commit of the
# source tree SOURCE_DIR as it is now (git rev-parse; "unknown" outside a git checkout), and leaves
# OUT untouched when that gives the same text, so that only a new commit recompiles its users. Run
# at configure time and before every build (the target mxscope_version), so that a build made after
# a new commit reports that commit (`mxscope --version`, summary.json's provenance.git_hash).
#   cmake -DTEMPLATE=... -DOUT=... -DVERSION=... -DSOURCE_DIR=... -P tools/cmake/version.cmake
execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY ${SOURCE_DIR}
                OUTPUT_VARIABLE MXSCOPE_GIT_HASH OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT MXSCOPE_GIT_HASH)
  set(MXSCOPE_GIT_HASH "unknown")
endif()
set(PROJECT_VERSION ${VERSION})
configure_file(${TEMPLATE} ${OUT}.new @ONLY)
file(COPY_FILE ${OUT}.new ${OUT} ONLY_IF_DIFFERENT)
file(REMOVE ${OUT}.new)
