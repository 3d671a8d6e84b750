# The C API as C: c_api_compile_check.c includes keel/keel.h, is compiled as C99 with -pedantic and
# warnings as errors, links against keel_engine and runs as a test (its checks exit non-zero).
enable_language(C)
add_executable(keel_c_api_compile_check ${CMAKE_CURRENT_LIST_DIR}/c_api_compile_check.c)
set_target_properties(keel_c_api_compile_check PROPERTIES
                      C_STANDARD 99 C_STANDARD_REQUIRED ON C_EXTENSIONS OFF
                      RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
target_compile_options(keel_c_api_compile_check PRIVATE -std=c99 -Wall -Wextra -Werror -pedantic)
target_link_libraries(keel_c_api_compile_check PRIVATE keel_engine)
add_test(NAME engine.c_api_compile_check COMMAND keel_c_api_compile_check)

# The engine across 4 Open MPI processes with the UCX transport (tests/engine/engine_mpi_main.cc),
# over shared memory and over TCP on loopback, for the static and the keel policy, and the keel
# policy again with every slot buffer in guarded device memory (staged through host memory).
find_program(KEEL_MPIRUN mpirun)
if(KEEL_WITH_MPI AND KEEL_WITH_UCX AND KEEL_MPIRUN)
  add_executable(keel_engine_mpi ${CMAKE_CURRENT_LIST_DIR}/engine_mpi_main.cc)
  target_link_libraries(keel_engine_mpi PRIVATE keel_engine MPI::MPI_CXX keel_warnings)
  target_include_directories(keel_engine_mpi PRIVATE ${CMAKE_SOURCE_DIR})
  set_target_properties(keel_engine_mpi PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
  set(_engine_lsan "LSAN_OPTIONS=suppressions=${CMAKE_SOURCE_DIR}/tests/migration/lsan.supp:print_suppressions=0:fast_unwind_on_malloc=0;OMPI_MCA_mca_base_component_disable_dlclose=1")
  foreach(_tls sm tcp)
    if(_tls STREQUAL "sm")
      set(_env "UCX_TLS=sm")
      set(_x -x UCX_TLS)
    else()
      set(_env "UCX_TLS=tcp;UCX_NET_DEVICES=lo")
      set(_x -x UCX_TLS -x UCX_NET_DEVICES)
    endif()
    foreach(_run static:host keel:host keel:guarded)
      string(REPLACE ":" ";" _run ${_run})
      list(GET _run 0 _policy)
      list(GET _run 1 _memory)
      set(_name engine.mpirun_${_policy}_ucx_${_tls})
      if(_memory STREQUAL "guarded")
        set(_name ${_name}_guarded_device)
      endif()
      add_test(NAME ${_name}
               COMMAND ${KEEL_MPIRUN} -np 4 --oversubscribe --mca btl self,vader --mca pml ob1
                       --mca oob_tcp_if_include lo --mca btl_tcp_if_include lo ${_x}
                       -x LSAN_OPTIONS -x ASAN_OPTIONS $<TARGET_FILE:keel_engine_mpi> ${_policy} 24
                       ${_memory})
      set_tests_properties(${_name} PROPERTIES
          ENVIRONMENT "${_env};${_engine_lsan};OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
          TIMEOUT 180 PROCESSORS 2)
    endforeach()
  endforeach()
  # Sharded experts, MP pairs that route their shares (Parm's de-duplicated dispatch), both
  # together, and transients in the slots placements leave empty, across processes over UCX
  # shared memory.
  foreach(_variant sharded:--sharded mp2:--mp-group:2 sharded_mp2:--sharded:--mp-group:2
                   spare_slots:--spare-slots)
    string(REPLACE ":" ";" _variant "${_variant}")
    list(POP_FRONT _variant _suffix)
    add_test(NAME engine.mpirun_keel_ucx_sm_${_suffix}
             COMMAND ${KEEL_MPIRUN} -np 4 --oversubscribe --mca btl self,vader --mca pml ob1
                     --mca oob_tcp_if_include lo --mca btl_tcp_if_include lo -x UCX_TLS
                     -x LSAN_OPTIONS -x ASAN_OPTIONS $<TARGET_FILE:keel_engine_mpi> keel 24 host
                     ${_variant})
    set_tests_properties(engine.mpirun_keel_ucx_sm_${_suffix} PROPERTIES
        ENVIRONMENT "UCX_TLS=sm;${_engine_lsan};OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
        TIMEOUT 180 PROCESSORS 2)
  endforeach()
  # Four hosts in network namespaces (MPI on a management network, UCX on a data network whose
  # link to host 1 is cut for 3 s mid-training); needs root, skips otherwise.
  add_test(NAME engine.netns_data_link_cut
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/netns_engine.sh $<TARGET_FILE:keel_engine_mpi>)
  set_tests_properties(engine.netns_data_link_cut PROPERTIES
      ENVIRONMENT "${_engine_lsan}" SKIP_RETURN_CODE 77 TIMEOUT 180 PROCESSORS 2)
endif()
