# `keel demo` as MPI processes over UCX, for the end-to-end scripts: source this file.
#   keel_can_run_mpi KEEL            true when mpirun is installed and KEEL has ucx and mpi
#   keel_mpi_demo SECONDS KEEL ARGS  runs `KEEL demo --comm mpi --transport ucx ARGS` as 4 local
#                                    processes over shared memory, at most SECONDS long; stdout
#                                    and stderr go where the caller redirects them
# Under the sanitizer build Open MPI and UCX keep allocations until exit, so LeakSanitizer
# reports only Keel's own (the suppressions of the migration tests).

keel_can_run_mpi() {
  command -v mpirun >/dev/null 2>&1 && "$1" version | grep -q "ucx=on mpi=on"
}

keel_mpi_demo() {
  local seconds="$1" keel="$2"
  shift 2
  local source_dir
  source_dir="${KEEL_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 UCX_TLS=sm \
    LSAN_OPTIONS="suppressions=$source_dir/tests/migration/lsan.supp:print_suppressions=0:fast_unwind_on_malloc=0" \
    OMPI_MCA_mca_base_component_disable_dlclose=1 \
    timeout "$seconds" mpirun -np 4 --oversubscribe --mca btl self,vader --mca pml ob1 \
    --mca oob_tcp_if_include lo -x UCX_TLS -x LSAN_OPTIONS -x ASAN_OPTIONS \
    -x OMPI_MCA_mca_base_component_disable_dlclose "$keel" demo --comm mpi --transport ucx "$@"
}
