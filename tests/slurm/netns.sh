#!/usr/bin/env bash
# Private network for a multi-node Slurm cluster on one machine: one network namespace per compute node,
# joined by a bridge, on a test-only subnet 10.231.X.0/24 that nothing outside this machine sees.
#
#   netns.sh up DIR NODES   create NODES namespaces and the bridge; write DIR/net (X), DIR/hosts
#                           (node0 .. nodeN-1 and their addresses) and print X
#   netns.sh down DIR       delete the namespaces and the bridge named in DIR/net
#   netns.sh exec DIR I CMD...
#                           run CMD as compute node I: in its network namespace, with its own
#                           hostname (nodeI, a UTS namespace) and DIR/hosts as /etc/hosts (a mount
#                           namespace); what CMD starts (slurmd, job steps) stays there
#
# Addresses: the bridge (slurmctld, clients) is 10.231.X.1, node I is 10.231.X.(I+2). Names carry X so
# several clusters can live side by side: bridge `nckpt<X>`, namespaces `nckpt<X>n<I>`, host ends of the
# veth pairs `nckpt<X>v<I>`; inside every namespace the node's end is `eth0` (`GLOO_SOCKET_IFNAME=eth0`).
# Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN).
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"

die() { echo "netns.sh: $*" >&2; exit 1; }

# A subnet index X in 1..254 that no interface and no namespace of this machine uses.
free_subnet() {
    local used x
    used=$(ip -o -4 addr show; ip netns list)
    for _ in $(seq 100); do
        x=$((1 + RANDOM % 254))
        grep -q -e "10\.231\.$x\." -e "nckpt${x}n" <<<"$used" || ip link show "nckpt$x" >/dev/null 2>&1 \
            || { echo "$x"; return 0; }
    done
    die "no free subnet 10.231.X.0/24 found"
}

up() {
    local dir=$1 nodes=$2 x i
    [[ $(id -u) -eq 0 ]] || die "network namespaces need root"
    command -v ip >/dev/null && command -v unshare >/dev/null && command -v nsenter >/dev/null \
        || die "needs iproute2 (ip) and util-linux (unshare, nsenter)"
    [[ -s $dir/net ]] && down "$dir"
    x=$(free_subnet)
    echo "$x" >"$dir/net"
    {
        echo "127.0.0.1 localhost"
        for i in $(seq 0 $((nodes - 1))); do echo "10.231.$x.$((i + 2)) node$i"; done
    } >"$dir/hosts"
    ip link add "nckpt$x" type bridge
    ip addr add "10.231.$x.1/24" dev "nckpt$x"
    ip link set "nckpt$x" up
    for i in $(seq 0 $((nodes - 1))); do
        ip netns add "nckpt${x}n$i"
        ip link add "nckpt${x}v$i" type veth peer name eth0 netns "nckpt${x}n$i"
        ip link set "nckpt${x}v$i" master "nckpt$x"
        ip link set "nckpt${x}v$i" up
        ip -n "nckpt${x}n$i" link set lo up
        ip -n "nckpt${x}n$i" addr add "10.231.$x.$((i + 2))/24" dev eth0
        ip -n "nckpt${x}n$i" link set eth0 up
    done
    echo "$x"
}

down() {
    local dir=$1 x ns link
    [[ -s $dir/net ]] || return 0
    x=$(cat "$dir/net")
    for link in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E "^nckpt${x}v[0-9]+$" || true); do
        ip link del "$link" 2>/dev/null || true
    done
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^nckpt${x}n[0-9]+$" || true); do
        ip netns del "$ns"  # deletes the node's veth end, and so the pair
    done
    ip link del "nckpt$x" 2>/dev/null || true
    rm -f "$dir/net"
}

exec_on_node() {
    local dir=$1 i=$2 x
    shift 2
    x=$(cat "$dir/net")
    # shellcheck disable=SC2016
    # nsenter rather than `ip netns exec`, which remounts /sys and so hides /sys/fs/cgroup from slurmd
    exec nsenter --net="/run/netns/nckpt${x}n$i" unshare --uts --mount --propagation private \
        sh -c 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' sh "$dir/hosts" "node$i" "$@"
}

case "${1:-}" in
    up) [[ $# -eq 3 ]] || die "usage: netns.sh up DIR NODES"; up "$(realpath -m "$2")" "$3" ;;
    down) [[ $# -eq 2 ]] || die "usage: netns.sh down DIR"; down "$(realpath -m "$2")" ;;
    exec) [[ $# -ge 4 ]] || die "usage: netns.sh exec DIR I CMD..."; exec_on_node "$(realpath -m "$2")" "${@:3}" ;;
    *) die "usage: netns.sh up DIR NODES | down DIR | exec DIR I CMD..." ;;
esac
