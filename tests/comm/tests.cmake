# The MPI communicator across 4 processes on loopback under mpirun (communicator_mpi_main.cc):
# every collective, and a rank that never arrives. Needs MPI and mpirun.
find_program(KEEL_MPIRUN mpirun)
if(NOT (KEEL_WITH_MPI AND KEEL_MPIRUN))
  return()
endif()
# Open MPI keeps a few allocations until exit; LeakSanitizer reports only Keel's own. Keeping MCA
# plugins loaded lets LeakSanitizer name their frames.
set(_comm_lsan "LSAN_OPTIONS=suppressions=${CMAKE_SOURCE_DIR}/tests/migration/lsan.supp:print_suppressions=0:fast_unwind_on_malloc=0;OMPI_MCA_mca_base_component_disable_dlclose=1")
add_executable(keel_communicator_mpi ${CMAKE_CURRENT_LIST_DIR}/communicator_mpi_main.cc)
target_link_libraries(keel_communicator_mpi PRIVATE keel_comm MPI::MPI_CXX keel_warnings)
set_target_properties(keel_communicator_mpi PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
foreach(_scenario collectives timeout)
  add_test(NAME comm.communicator_mpi_${_scenario}
           COMMAND ${KEEL_MPIRUN} -np 4 --oversubscribe --mca btl self,vader --mca pml ob1
                   --mca oob_tcp_if_include lo --mca btl_tcp_if_include lo -x LSAN_OPTIONS
                   -x ASAN_OPTIONS $<TARGET_FILE:keel_communicator_mpi> --scenario ${_scenario})
  set_tests_properties(comm.communicator_mpi_${_scenario} PROPERTIES
      ENVIRONMENT "${_comm_lsan};OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
      TIMEOUT 120 PROCESSORS 2)
endforeach()
