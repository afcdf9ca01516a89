# cmake -DINIT=<canzona/__init__.py> -DVERSION=<project version> -P ...
# The Python package's one version (canzona.__version__, which pyproject.toml
# reads) is the CMake project's.
file(STRINGS ${INIT} lines REGEX "^__version__ = ")
if(NOT lines MATCHES "^__version__ = \"([^\"]+)\"$")
  message(FATAL_ERROR "${INIT}: no __version__ = \"...\" line")
endif()
if(NOT CMAKE_MATCH_1 STREQUAL VERSION)
  message(FATAL_ERROR "canzona.__version__ is ${CMAKE_MATCH_1}, the project is "
                      "${VERSION}: change client/python/canzona/__init__.py")
endif()
message(STATUS "canzona.__version__ ${CMAKE_MATCH_1} == project ${VERSION}")
