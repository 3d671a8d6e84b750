#!/usr/bin/env bash
# The engine across 4 "hosts" on one machine: network namespaces, each with two links to two
# bridges in a fifth namespace: a data network (10.77.<n>.1-4, UCX, which moves the experts) and
# a management network (10.78.<n>.1-4, MPI and its launcher, which also has a leg there, .100).
# mpirun starts one rank of keel_engine_mpi in each host (its rsh agent is `ip netns exec`, not
# ssh). The ranks train the toy model; from step 6 on, host 1's data link goes down for 3 s and
# comes back, while MPI keeps the steps going. The program then checks, on every rank: an epoch
# aborted and a later one committed; epochs switched at the same steps everywhere; every row
# went where its owner expected; every copy and home equals the engine-free reference, i.e. the
# fault-free run, bit for bit.
#
# Open MPI's daemons (orted, one per host here) did not always start, and mpirun then waited for
# them forever: the hosts shared one temporary folder (see the agent below), and ORTE maps a
# shared copy of the hwloc topology at an address it guesses free, which under address-space
# randomisation sometimes fails (a segfault in hwloc_shmem_topology_write; `rtc_hwloc_vmhole
# none` turns that sharing off). The daemons now stay attached, with a start-up timeout, so that
# one that fails fails the launch, and a run whose ranks have not reached step 6 in 45 s, or
# finished 90 s after the link came back, fails with its log: ctest's timeout would kill the
# script before its cleanup and leave the namespaces behind.
# $1: keel_engine_mpi. Exit 77 (skip) without root, namespaces or mpirun.
set -uo pipefail
name=netns_engine
program=${1:?usage: netns_engine.sh KEEL_ENGINE_MPI}
skip() { echo "$name: skipped: $*" >&2; exit 77; }
source "$(dirname "$0")/../common/netns.sh"
[ "$(id -u)" -eq 0 ] || skip "needs root to create network namespaces"
command -v ip >/dev/null || skip "no ip(8) (iproute2)"
command -v mpirun >/dev/null || skip "no mpirun"
prefix=keelmpi$$
netns_switch "$prefix" || skip "cannot create a network namespace"
# Only the launcher's leg (10.78.<subnet>.100) lives in this namespace, where a killed run may
# have left its own behind.
subnet=$(netns_free_subnet 78) || { echo "$name: FAILED: no free subnet" >&2; exit 1; }
work=$(mktemp -d "${TMPDIR:-/tmp}/keel-netns-engine-XXXXXX")
launcher=
cleanup() {
  [ -n "$launcher" ] && kill -9 "$launcher" 2>/dev/null
  netns_kill "$prefix" 4
  ip link del "r${prefix}" 2>/dev/null
  netns_remove "$prefix" 4
  rm -rf "$work"
}
trap cleanup EXIT

netns_hosts "$prefix" 4 lo && netns_network "$prefix" 4 data d 77 "$subnet" eth0 &&
  netns_network "$prefix" 4 mgmt m 78 "$subnet" mgmt0 ||
  { echo "$name: FAILED: cannot build the hosts' networks" >&2; exit 1; }
set -e
ip link add "r${prefix}" type veth peer name launcher netns "${prefix}sw"
ip -n "${prefix}sw" link set launcher master mgmt up
ip addr add "10.78.$subnet.100/24" dev "r${prefix}"
ip link set "r${prefix}" up
set +e

# mpirun's "ssh": host 10.78.S.N runs the command in namespace h(N-1), with a temporary folder of
# its own, as a host of its own would have: the hosts share one file system and one host name,
# and Open MPI's daemons, each making its session folder under TMPDIR/ompi.<host>.<uid>, race to
# create the same folders otherwise, and the loser fails to start.
cat >"$work/agent.sh" <<AGENT
#!/bin/sh
host=\$((\${1##*.} - 1)); shift
mkdir -p "$work/tmp\$host"
exec env TMPDIR="$work/tmp\$host" ip netns exec "${prefix}h\$host" /bin/sh -c "\$*"
AGENT
chmod +x "$work/agent.sh"
net="10.78.$subnet.0/24"
hosts="10.78.$subnet.1,10.78.$subnet.2,10.78.$subnet.3,10.78.$subnet.4"
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  mpirun -np 4 -H "$hosts" --mca plm_rsh_agent "$work/agent.sh" --mca plm_rsh_no_tree_spawn 1 \
  --leave-session-attached --mca orte_startup_timeout 20 --mca rtc_hwloc_vmhole none \
  --mca routed direct --mca oob_tcp_if_include "$net" --mca btl self,tcp \
  --mca btl_tcp_if_include "$net" --mca pml ob1 -x UCX_TLS=tcp -x UCX_NET_DEVICES=eth0 \
  -x LSAN_OPTIONS -x ASAN_OPTIONS \
  "$program" keel 40 host --deadline 2 --step-seconds 0.1 --marks "$work" \
  --expect-abort >"$work/run.log" 2>&1 &
launcher=$!
show_log() { grep -v "UCX  WARN\|UCX  ERROR" "$work/run.log" | tail -n "$1"; }
started=$SECONDS
while [ $((SECONDS - started)) -lt 45 ] && [ ! -e "$work/step.6" ]; do
  kill -0 "$launcher" 2>/dev/null || break
  sleep 0.05
done
if [ ! -e "$work/step.6" ]; then
  echo "$name: FAILED: the ranks never reached step 6" >&2
  show_log 40
  exit 1
fi

ip -n "${prefix}sw" link set "d${prefix}h1" down
echo "$name: host 1's data link cut after step 6"
sleep 3
ip -n "${prefix}sw" link set "d${prefix}h1" up
echo "$name: host 1's data link restored"
restored=$SECONDS
while [ $((SECONDS - restored)) -lt 90 ]; do
  kill -0 "$launcher" 2>/dev/null || break
  sleep 0.05
done
if kill -0 "$launcher" 2>/dev/null; then
  echo "$name: FAILED: the run had not finished 90 s after the link came back" >&2
  show_log 40
  exit 1
fi
wait "$launcher"
status=$?
launcher=
show_log 12
[ "$status" -eq 0 ] && echo "$name: ok" || echo "$name: FAILED (mpirun exit $status)" >&2
exit "$status"
