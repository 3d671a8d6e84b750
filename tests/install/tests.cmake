# The installed tree: `cmake --install` into a fresh prefix, then a consumer outside the source
# tree finds it with find_package(Keel), compiles every public header alone and runs an engine.
# Not in sanitizer builds: the consumer would need the sanitizer runtime loaded before libkeel.
if(NOT KEEL_SANITIZE)
  add_test(NAME install.consumer
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/install_consumer.sh ${CMAKE_BINARY_DIR})
  set_tests_properties(install.consumer PROPERTIES TIMEOUT 300 PROCESSORS 2)
endif()
