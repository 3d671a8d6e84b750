# The installed tree: `cmake --install` into a fresh prefix, then a consumer outside the source
# tree finds it with find_package(Keel), compiles every public header alone and runs an engine.
# Not in sanitizer builds: the consumer would need the sanitizer runtime loaded before libkeel.
if(NOT KEEL_SANITIZE)
  add_test(NAME install.consumer
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/install_consumer.sh ${CMAKE_BINARY_DIR})
  set_tests_properties(install.consumer PROPERTIES TIMEOUT 300 PROCESSORS 2)
endif()

# The Python wheel: `pip wheel .` (libkeel, the extension and the command built once, about 2
# minutes on 2 cores, seconds on a rerun: its CMake build stays in wheel-build), installed into
# a fresh virtual environment and used from outside the source tree. Built with the Python the
# package is built for (scripts/dev: .venv), which has the build tools and torch.
if(KEEL_WITH_PYTHON AND NOT KEEL_SANITIZE)
  add_test(NAME install.pip_wheel
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/pip_wheel.sh ${Python_EXECUTABLE}
                   ${CMAKE_CURRENT_BINARY_DIR}/install/wheel-build ${PROJECT_VERSION})
  set_tests_properties(install.pip_wheel PROPERTIES
      TIMEOUT 1800 PROCESSORS 2 SKIP_RETURN_CODE 77)
endif()
