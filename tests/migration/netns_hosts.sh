#!/usr/bin/env bash
# Multi-host on one machine: 4 network namespaces ("hosts", 10.77.<n>.1-4) joined by veth pairs
# to a bridge in a fifth, with a rank of keel_migration_multiprocess --scenario linkcut in each,
# talking UCX over TCP on its own address only (the ranks meet through files in a shared folder;
# no ssh, no loopback between hosts). While epoch 4 runs, host 1's link is cut (its bridge port
# goes down) for 3 s, then restored. Every rank must:
#   - end every epoch the same way as every other rank (commit or abort),
#   - abort the epochs the cut hits within the deadline (2 s), the agreement's two graces
#     (0.4 s each) and a second of slack, the cut-off rank too (its reconnects to hosts it cannot
#     reach must not block: the UCX transport connects without blocking),
#   - commit the epochs after the link returns (the last 3 at least), and
#   - end with its slots byte-exact for the last placement: the fault-free run's, since each
#     epoch's target does not depend on what came before.
# After an aborted epoch the ranks start the next one only once the link is back: UCX 1.13
# aborts a process whose TCP connection breaks while it is being wired up (wireup_ep.c:241), and
# a new epoch's reconnect to the cut-off host can hit that while the link comes and goes.
# $1: the keel_migration_multiprocess program. Exit 77 (skip) where namespaces cannot be made.
set -uo pipefail
name=netns_hosts
program=${1:?usage: netns_hosts.sh KEEL_MIGRATION_MULTIPROCESS}
skip() { echo "$name: skipped: $*" >&2; exit 77; }
fail() { echo "$name: FAILED: $*" >&2; status=1; }
source "$(dirname "$0")/../common/netns.sh"

[ "$(id -u)" -eq 0 ] || skip "needs root to create network namespaces"
command -v ip >/dev/null || skip "no ip(8) (iproute2)"
prefix=keel$$
subnet=$(( $$ % 200 + 20 ))  # 10.77.<subnet>.0/24, one per run
netns_switch "$prefix" || skip "cannot create a network namespace"
work=$(mktemp -d "${TMPDIR:-/tmp}/keel-netns-XXXXXX")
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null; done
  netns_remove "$prefix" 4
  rm -rf "$work"
}
trap cleanup EXIT

netns_hosts "$prefix" 4 && netns_network "$prefix" 4 br0 p 77 "$subnet" eth0 ||
  { echo "$name: FAILED: cannot build the hosts' network" >&2; exit 1; }

status=0
epochs=14
for h in 0 1 2 3; do
  ip netns exec "${prefix}h$h" env UCX_TLS=tcp UCX_NET_DEVICES=eth0 \
    "$program" --bootstrap dir --dir "$work" --rank "$h" --size 4 --scenario linkcut \
    --plans "$epochs" --deadline 2 >"$work/rank$h.log" 2>&1 &
  pids+=($!)
done
for _ in $(seq 600); do [ -e "$work/started.4" ] && break; sleep 0.05; done
[ -e "$work/started.4" ] || fail "epoch 4 never started"
sleep 0.1
ip -n "${prefix}sw" link set "p${prefix}h1" down
echo "$name: host 1's link cut during epoch 4"
sleep 3
ip -n "${prefix}sw" link set "p${prefix}h1" up
touch "$work/restored"
echo "$name: host 1's link restored"

for h in 0 1 2 3; do
  if ! wait "${pids[$h]}"; then
    fail "rank $h exited with an error:"
    grep -v "UCX  WARN" "$work/rank$h.log" | grep -v "^ *[0-9]* *[/[]" | tail -n 8 >&2
  fi
done
pids=()
for h in 0 1 2 3; do
  [ -s "$work/outcomes.$h" ] || { fail "rank $h wrote no outcomes"; continue; }
  cut -d' ' -f1,2 "$work/outcomes.$h" >"$work/decided.$h"
  if ! cmp -s "$work/decided.0" "$work/decided.$h"; then
    fail "rank $h ended epochs differently from rank 0:"
    paste "$work/decided.0" "$work/decided.$h" >&2
  fi
done
lines=$(wc -l <"$work/decided.0")
aborts=$(grep -c abort "$work/decided.0")
[ "$lines" -eq "$epochs" ] || fail "rank 0 ran $lines epochs of $epochs"
[ "$aborts" -ge 1 ] || fail "no epoch aborted: the cut did not hit a transfer"
echo "$name: epochs per rank (epoch outcome seconds):"
for h in 0 1 2 3; do echo "rank $h: $(cut -d' ' -f1-3 "$work/outcomes.$h" | tr '\n' ' ')"; done
if [ "$status" -eq 0 ]; then
  echo "$name: ok: $aborts epoch(s) aborted on every rank while the link was down, the rest" \
    "committed everywhere, slots byte-exact"
fi
exit "$status"
