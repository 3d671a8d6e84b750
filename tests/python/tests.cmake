# The keel Python package (pytest): one ctest per test file, run by the Python the package was
# built for (scripts/dev: .venv's, with torch and pytest from scripts/requirements-dev.txt), with
# PYTHONPATH at the build tree's package. The multi-rank files start 4 processes joined by
# torch.distributed (gloo) on loopback. The torchtitan integration's files run in the torchtitan
# environment (KEEL_TORCHTITAN_PYTHON) when it exists, and skip in any other.
if(KEEL_WITH_PYTHON AND NOT KEEL_SANITIZE)
  file(GLOB _python_tests CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/test_*.py)
  foreach(_file ${_python_tests})
    get_filename_component(_name ${_file} NAME_WE)
    set(_python ${Python_EXECUTABLE})
    if(_name MATCHES "^test_torchtitan" AND EXISTS "${KEEL_TORCHTITAN_PYTHON}")
      set(_python ${KEEL_TORCHTITAN_PYTHON})
    endif()
    add_test(NAME python.${_name}
             COMMAND ${_python} -m pytest -q -p no:cacheprovider ${_file}
             WORKING_DIRECTORY ${CMAKE_CURRENT_LIST_DIR})
    set_tests_properties(python.${_name} PROPERTIES
        ENVIRONMENT "PYTHONPATH=${CMAKE_BINARY_DIR}/python:${CMAKE_CURRENT_LIST_DIR};KEEL_BUILD_DIR=${CMAKE_BINARY_DIR};KEEL_SHARED_TRACES=${KEEL_SHARED_TRACES};KEEL_BINARY=$<TARGET_FILE:keel>"
        TIMEOUT 300 PROCESSORS 2)
  endforeach()
endif()
