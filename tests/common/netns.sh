# Network namespaces as hosts on one machine, for the multi-host tests (sourced, bash). A switch
# namespace <prefix>sw holds one bridge per network; host h (namespace <prefix>h<h>) joins a
# network through a veth pair: its device inside the host, <letter><prefix>h<h> on the bridge,
# the port a test takes down to cut the host's link. Every function returns non-zero on failure.

# netns_switch PREFIX: the switch namespace; fails where namespaces cannot be made.
netns_switch() {
  ip netns add "$1sw" 2>/dev/null
}

# netns_hosts PREFIX COUNT [lo]: COUNT host namespaces; with "lo", their loopback up too. Without
# it a host has no loopback, so its processes can reach others only over the networks below
# (UCX then cannot fall back to a loopback address).
netns_hosts() {
  local h
  for ((h = 0; h < $2; ++h)); do
    ip netns add "$1h$h" || return 1
    if [ "${3:-}" = lo ]; then ip -n "$1h$h" link set lo up || return 1; fi
  done
}

# netns_network PREFIX COUNT BRIDGE LETTER NET SUBNET DEVICE: a bridge in the switch and a link to
# it from every host, where host h is 10.NET.SUBNET.(h+1)/24 on DEVICE.
netns_network() {
  local prefix=$1 count=$2 bridge=$3 letter=$4 net=$5 subnet=$6 device=$7 h port
  ip -n "${prefix}sw" link add "$bridge" type bridge &&
    ip -n "${prefix}sw" link set "$bridge" up || return 1
  for ((h = 0; h < count; ++h)); do
    port="${letter}${prefix}h$h"
    ip link add "$port" type veth peer name "$device" netns "${prefix}h$h" &&
      ip link set "$port" netns "${prefix}sw" &&
      ip -n "${prefix}sw" link set "$port" master "$bridge" up &&
      ip -n "${prefix}h$h" addr add "10.$net.$subnet.$((h + 1))/24" dev "$device" &&
      ip -n "${prefix}h$h" link set "$device" up || return 1
  done
}

# netns_remove PREFIX COUNT: every host and the switch; their links go with them.
netns_remove() {
  local h
  for ((h = 0; h < $2; ++h)); do ip netns del "$1h$h" 2>/dev/null; done
  ip netns del "$1sw" 2>/dev/null
}

# netns_kill PREFIX COUNT: kills every process left in the hosts (a launcher's daemons and ranks
# outlive it when it is killed), so that the namespaces can go.
netns_kill() {
  local h pid
  for ((h = 0; h < $2; ++h)); do
    for pid in $(ip netns pids "$1h$h" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
  done
}

# netns_free_subnet NET...: a SUBNET in [20, 220) that no address of this namespace uses in any of
# the 10.NET.SUBNET.0/24 networks, starting from one picked by the caller's pid; a test that was
# killed may have left its links behind.
netns_free_subnet() {
  local subnet=$(($$ % 200 + 20)) tries net used
  for ((tries = 0; tries < 200; ++tries)); do
    used=
    for net in "$@"; do
      ip -o addr show | grep -q " 10\.$net\.$subnet\." && used=1
    done
    [ -z "$used" ] && { echo "$subnet"; return 0; }
    subnet=$(((subnet - 20 + 1) % 200 + 20))
  done
  return 1
}
