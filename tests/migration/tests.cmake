# Multi-process tests of migration, 4 processes on loopback under mpirun.
# - Migration over UCX, with UCX_TLS=sm and with UCX_TLS=tcp on lo. Random plans run under
#   mpirun; fault injection (a killed rank, a stalled rank) runs under the program's own
#   launcher, since mpirun tears the whole job down when a rank dies. Skipped (not built) without
#   UCX; the mpirun tests also need MPI and mpirun.

# Open MPI and UCX keep a few allocations until exit; LeakSanitizer reports only Keel's own.
# Keeping MCA plugins loaded lets LeakSanitizer name their frames.
set(_mig_lsan "LSAN_OPTIONS=suppressions=${CMAKE_CURRENT_LIST_DIR}/lsan.supp:print_suppressions=0:fast_unwind_on_malloc=0;OMPI_MCA_mca_base_component_disable_dlclose=1")
find_program(KEEL_MPIRUN mpirun)

if(NOT KEEL_WITH_UCX)
  return()
endif()

add_executable(keel_migration_multiprocess ${CMAKE_CURRENT_LIST_DIR}/migration_multiprocess.cc)
target_link_libraries(keel_migration_multiprocess PRIVATE keel_migration keel_warnings)
set_target_properties(keel_migration_multiprocess PROPERTIES
                      RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
if(KEEL_WITH_MPI)
  target_compile_definitions(keel_migration_multiprocess PRIVATE KEEL_TEST_WITH_MPI)
  target_link_libraries(keel_migration_multiprocess PRIVATE MPI::MPI_CXX)
endif()

set(_mig_sm "UCX_TLS=sm")
set(_mig_tcp "UCX_TLS=tcp;UCX_NET_DEVICES=lo")

if(KEEL_WITH_MPI AND KEEL_MPIRUN)
  foreach(_tls sm tcp)
    set(_env ${_mig_${_tls}})
    # Every -x forwards one variable to the ranks; traffic stays on loopback.
    set(_x)
    foreach(_kv ${_env})
      string(REGEX REPLACE "=.*" "" _k "${_kv}")
      list(APPEND _x -x ${_k})
    endforeach()
    add_test(NAME migration.mpirun_random_plans_${_tls}
             COMMAND ${KEEL_MPIRUN} -np 4 --oversubscribe --mca btl self,vader --mca pml ob1
                     --mca oob_tcp_if_include lo --mca btl_tcp_if_include lo ${_x} -x LSAN_OPTIONS
                     -x ASAN_OPTIONS $<TARGET_FILE:keel_migration_multiprocess>
                     --scenario random --plans 100)
    set_tests_properties(migration.mpirun_random_plans_${_tls} PROPERTIES
        ENVIRONMENT "${_env};${_mig_lsan};OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
        TIMEOUT 180 PROCESSORS 2)
  endforeach()
  # Progress driven by the migrator's thread alone (migration.ucx_progress_thread: false).
  add_test(NAME migration.mpirun_random_plans_sm_no_progress_thread
           COMMAND ${KEEL_MPIRUN} -np 4 --oversubscribe --mca btl self,vader --mca pml ob1
                   --mca oob_tcp_if_include lo --mca btl_tcp_if_include lo -x UCX_TLS
                   -x LSAN_OPTIONS -x ASAN_OPTIONS $<TARGET_FILE:keel_migration_multiprocess>
                   --scenario random --plans 100 --progress-thread off)
  set_tests_properties(migration.mpirun_random_plans_sm_no_progress_thread PROPERTIES
      ENVIRONMENT "${_mig_sm};${_mig_lsan};OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
      TIMEOUT 180 PROCESSORS 2)
  # Experts in (fake) device memory, sent through page-locked staging over UCX.
  add_test(NAME migration.mpirun_random_plans_sm_device_staged
           COMMAND ${KEEL_MPIRUN} -np 4 --oversubscribe --mca btl self,vader --mca pml ob1
                   --mca oob_tcp_if_include lo --mca btl_tcp_if_include lo -x UCX_TLS
                   -x LSAN_OPTIONS -x ASAN_OPTIONS $<TARGET_FILE:keel_migration_multiprocess>
                   --scenario random --plans 50 --device fake)
  set_tests_properties(migration.mpirun_random_plans_sm_device_staged PROPERTIES
      ENVIRONMENT "${_mig_sm};${_mig_lsan};OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
      TIMEOUT 180 PROCESSORS 2)
endif()

# Consensus commit: a rank killed at each phase of an epoch's end (--phase) leaves every survivor
# with the same outcome. Victims: rank 0 (the first coordinator), rank 1 (the second) and rank 2.
set(_agree_runs transfers-done:0 transfers-done:2 mid-verdict:0 mid-verdict:2 votes-in:0
                votes-in:1 votes-in:2 mid-agreement:0 mid-agreement:1 decided:0 decided:2)
foreach(_tls sm tcp)
  foreach(_run ${_agree_runs})
    string(REPLACE ":" ";" _run ${_run})
    list(GET _run 0 _phase)
    list(GET _run 1 _victim)
    set(_name migration.agree_${_phase}_rank${_victim}_${_tls})
    add_test(NAME ${_name}
             COMMAND $<TARGET_FILE:keel_migration_multiprocess> --launch 4 --scenario agree
                     --phase ${_phase} --victim ${_victim} --deadline 2)
    set_tests_properties(${_name} PROPERTIES
        ENVIRONMENT "${_mig_${_tls}};${_mig_lsan}" TIMEOUT 120 PROCESSORS 2)
  endforeach()
endforeach()

# A send its receiver gave up on (the late-sender scenario): rank 2 aborts an epoch before rank 3
# sends to it, and the two must then commit two more epochs over the same connection.
foreach(_tls sm tcp)
  add_test(NAME migration.late_sender_${_tls}
           COMMAND $<TARGET_FILE:keel_migration_multiprocess> --launch 4 --scenario late-sender
                   --deadline 2)
  set_tests_properties(migration.late_sender_${_tls} PROPERTIES
      ENVIRONMENT "${_mig_${_tls}};${_mig_lsan}" TIMEOUT 120 PROCESSORS 2)
endforeach()

# Four hosts in network namespaces joined by veth pairs, a link cut mid-migration and restored
# (needs root; skips otherwise).
add_test(NAME migration.netns_link_cut
         COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/netns_hosts.sh
                 $<TARGET_FILE:keel_migration_multiprocess>)
set_tests_properties(migration.netns_link_cut PROPERTIES
    ENVIRONMENT "${_mig_lsan}" SKIP_RETURN_CODE 77 TIMEOUT 120 PROCESSORS 2)

foreach(_tls sm tcp)
  foreach(_scenario killed stalled)
    add_test(NAME migration.fault_${_scenario}_peer_${_tls}
             COMMAND $<TARGET_FILE:keel_migration_multiprocess> --launch 4
                     --scenario ${_scenario} --deadline 2)
    set_tests_properties(migration.fault_${_scenario}_peer_${_tls} PROPERTIES
        ENVIRONMENT "${_mig_${_tls}};${_mig_lsan}" TIMEOUT 120 PROCESSORS 2)
  endforeach()
endforeach()
