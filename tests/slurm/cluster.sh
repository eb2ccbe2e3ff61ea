#!/usr/bin/env bash
# A throwaway one-node Slurm cluster on this machine, for tests and CI.
#
#   cluster.sh install      apt-get Slurm 22.05, slurmdbd, MariaDB and munge if missing (needs root); fails
#                           within REGISTRY_TIMEOUT seconds when the package registry does not answer
#                           (SLURM_FORCE_INSTALL=1: install even if Slurm is there)
#   cluster.sh start DIR [NODES]
#                           install, then run munged, mariadbd, slurmdbd, slurmctld and slurmd
#                           with all config/state/logs/pids in DIR; waits until the nodes are
#                           idle and prints `export SLURM_CONF=DIR/slurm.conf` on stdout
#   cluster.sh stop DIR     stop the daemons started from DIR, by PID
#   cluster.sh kill-node DIR I
#                           kill node I outright, as a machine dies: SIGKILL its slurmd and every process in its
#                           network namespace (slurmstepd, job steps); slurmctld marks it DOWN after SlurmdTimeout
#   cluster.sh start-node DIR I
#                           start node I's slurmd again and wait until the node takes jobs (idle or allocated)
#
# NODES=1 (default): one node `localhost` on 127.0.0.1. NODES>1 (needs root): nodes node0 .. node<N-1>,
# each a slurmd in its own network namespace with its own address and hostname (netns.sh: bridge
# 10.231.X.1 for slurmctld and the clients, node I at 10.231.X.(I+2)); Debian's Slurm is built without
# multiple-slurmd (two slurmds on one address), so each node gets a network of its own, like a real one.
#
# Client commands (sbatch, srun, squeue, scontrol, sacct) find the cluster through SLURM_CONF;
# eval the line `start` prints. No systemd. Accounting is on and enforced: root's jobs run
# under account `nemo_ckpt` (its default), `other` or `root`; any other account is rejected.
# Requeued jobs start again after ~6 s (cred_expire=5, scheduling every second), not 2 minutes.
# A dead node is DOWN 25-40 s after it dies, not 5 minutes (SlurmdTimeout=20 since its last answer, checked at
# each ping round, which takes MessageTimeout=10 s when a node does not answer); its batch jobs are then
# requeued. It is back in service as soon as its slurmd registers again (ReturnToService=2).
# Ports are picked free at first start, so several clusters can live side by side.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"

PACKAGES=(slurmctld slurmd slurm-client slurmdbd mariadb-server munge)
START_TIMEOUT=${SLURM_START_TIMEOUT:-60}
REGISTRY_TIMEOUT=${SLURM_REGISTRY_TIMEOUT:-45}
NETNS_SH=$(dirname "$(realpath "${BASH_SOURCE[0]}")")/netns.sh

die() { echo "cluster.sh: $*" >&2; exit 1; }

install_slurm() {
    if [[ -z ${SLURM_FORCE_INSTALL:-} ]] && command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null \
        && command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null; then
        return 0
    fi
    [[ $(id -u) -eq 0 ]] || die "Slurm is not installed and installing it needs root"
    command -v apt-get >/dev/null || die "Slurm is not installed and apt-get is missing"
    export DEBIAN_FRONTEND=noninteractive
    timeout "$REGISTRY_TIMEOUT" apt-get -o DPkg::Lock::Timeout=30 -o Acquire::Retries=0 \
        -o Acquire::http::Timeout=10 -o Acquire::https::Timeout=10 update --error-on=any -qq >&2 \
        || die "Slurm is not installed and the package registry did not answer within ${REGISTRY_TIMEOUT}s"
    apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${PACKAGES[@]}" >&2
}

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Four consecutive free ports: slurmctld, slurmd, slurmdbd, mariadbd. Below the kernel's ephemeral range: a port in
# it can be the local end of an outgoing connection (the tests' gloo sockets, in TIME_WAIT too), which a connect
# probe does not see but bind() refuses (mariadbd: "Address already in use").
free_ports() {
    local port ephemeral_start
    read -r ephemeral_start _ < /proc/sys/net/ipv4/ip_local_port_range
    for _ in $(seq 50); do
        port=$((10000 + RANDOM % (ephemeral_start - 10000 - 4)))
        if ! port_in_use "$port" && ! port_in_use $((port + 1)) && ! port_in_use $((port + 2)) \
            && ! port_in_use $((port + 3)); then
            echo "$port"
            return 0
        fi
    done
    die "no four free ports found"
}

pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
    local dir=$1 port=$2 nodes=$3 host cpus mem_mb ctld_addr node_lines partition_nodes x i
    host=$(hostname -s)
    cpus=$(nproc)
    mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    if [[ $nodes -eq 1 ]]; then
        ctld_addr=127.0.0.1
        node_lines="NodeName=localhost NodeHostname=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN"
        partition_nodes=localhost
    else
        x=$(cat "$dir/net")
        ctld_addr=10.231.$x.1
        node_lines=$(for i in $(seq 0 $((nodes - 1))); do
            echo "NodeName=node$i NodeHostname=node$i NodeAddr=10.231.$x.$((i + 2)) CPUs=$cpus RealMemory=$((mem_mb / nodes)) State=UNKNOWN"
        done)
        partition_nodes=node[0-$((nodes - 1))]
    fi
    cat >"$dir/slurm.conf" <<EOF
# Written by tests/slurm/cluster.sh
ClusterName=nemockpt
SlurmctldHost=$host($ctld_addr)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/slurmd.%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((port + 2))
AccountingStoragePass=$dir/munge/munge.socket
AccountingStorageEnforce=associations
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=20
EnforcePartLimits=ALL
MinJobAge=600
KillWait=10
$node_lines
PartitionName=debug Nodes=$partition_nodes Default=YES MaxTime=04:00:00 State=UP
EOF
    cat >"$dir/slurmdbd.conf" <<EOF
# Written by tests/slurm/cluster.sh
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$((port + 2))
SlurmUser=root
PidFile=$dir/slurmdbd.pid
LogFile=$dir/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$((port + 3))
StorageUser=slurm
StoragePass=$(cat "$dir/mysql.pass")
StorageLoc=slurm_acct_db
EOF
    chmod 0600 "$dir/slurmdbd.conf"
}

start_munge() {
    local dir=$1
    pid_alive "$dir/munge/munged.pid" && return 0
    mkdir -p "$dir/munge"
    chmod 0755 "$dir/munge"
    if [[ ! -s $dir/munge/munge.key ]]; then
        dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
        chmod 0400 "$dir/munge/munge.key"
    fi
    munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed" </dev/null >>"$dir/log/munged.log" 2>&1 \
        || die "munged failed: $(tail -n 20 "$dir/log/munged.log")"
}

# MariaDB with its data, socket and pid in DIR/mysql, on 127.0.0.1 only, and a `slurm` user for slurmdbd.
start_mariadb() {
    local dir=$1 port=$2
    pid_alive "$dir/mysql/mariadbd.pid" && return 0
    mkdir -p "$dir/mysql"
    if [[ ! -d $dir/mysql/data/mysql ]]; then
        mariadb-install-db --no-defaults --user=root --datadir="$dir/mysql/data" \
            --auth-root-authentication-method=socket --skip-test-db >>"$dir/log/mariadb.log" 2>&1 \
            || die "mariadb-install-db failed: $(tail -n 20 "$dir/log/mariadb.log")"
    fi
    mariadbd --no-defaults --user=root --datadir="$dir/mysql/data" --socket="$dir/mysql/mysqld.sock" \
        --pid-file="$dir/mysql/mariadbd.pid" --bind-address=127.0.0.1 --port="$port" \
        --log-error="$dir/log/mariadb.log" --skip-log-bin --innodb-buffer-pool-size=32M \
        </dev/null >/dev/null 2>&1 &
    for _ in $(seq $((START_TIMEOUT * 2))); do
        mariadb --no-defaults --socket="$dir/mysql/mysqld.sock" -u root -e "SELECT 1" >/dev/null 2>&1 && break
        sleep 0.5
    done
    mariadb --no-defaults --socket="$dir/mysql/mysqld.sock" -u root -e "
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$(cat "$dir/mysql.pass")';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" 2>>"$dir/log/mariadb.log" \
        || die "MariaDB did not start: $(tail -n 20 "$dir/log/mariadb.log")"
}

# slurmdbd, then the cluster, its accounts and root's association (slurmctld needs them to run jobs).
start_slurmdbd() {
    local dir=$1
    pid_alive "$dir/slurmdbd.pid" && return 0
    slurmdbd </dev/null >>"$dir/log/slurmdbd.log" 2>&1 || die "slurmdbd failed: $(tail -n 20 "$dir/log/slurmdbd.log")"
    for _ in $(seq $((START_TIMEOUT * 2))); do
        sacctmgr --noheader --parsable2 show cluster >/dev/null 2>&1 && break
        sleep 0.5
    done
    sacctmgr -i add cluster nemockpt >/dev/null 2>&1 || true
    sacctmgr -i add account nemo_ckpt,other cluster=nemockpt >/dev/null 2>&1 || true
    sacctmgr -i add user root account=nemo_ckpt,other defaultaccount=nemo_ckpt cluster=nemockpt >/dev/null 2>&1 || true
    [[ $(sacctmgr --noheader --parsable2 show user root format=defaultaccount 2>/dev/null) == nemo_ckpt ]] || die "slurmdbd accounts not set up: $(tail -n 20 "$dir/log/slurmdbd.log")"
}

node_names() {
    local nodes=$1
    if [[ $nodes -eq 1 ]]; then echo localhost; else seq -f "node%g" 0 $((nodes - 1)); fi
}

wait_idle() {
    local dir=$1 nodes=$2 state="" log
    for _ in $(seq "$START_TIMEOUT"); do
        state=$(sinfo --noheader --Node --format=%t 2>/dev/null | sort -u | tr '\n' ' ' || true)
        [[ $state == "idle " && $(sinfo --noheader --Node --format=%N | wc -l) -eq $nodes ]] && return 0
        sleep 1
    done
    echo "cluster.sh: nodes not idle after ${START_TIMEOUT}s (states: '${state}')" >&2
    for log in slurmctld $(node_names "$nodes" | sed 's/^/slurmd./') slurmdbd mariadb munged; do
        echo "--- $dir/log/$log.log (tail)" >&2
        tail -n 20 "$dir/log/$log.log" >&2 2>/dev/null || true
    done
    exit 1
}

slurmds_alive() {
    local dir=$1 nodes=$2 node
    for node in $(node_names "$nodes"); do pid_alive "$dir/slurmd.$node.pid" || return 1; done
}

start_slurmd() {
    local dir=$1 nodes=$2 i
    if [[ $nodes -eq 1 ]]; then
        slurmd -N localhost -f "$SLURM_CONF" </dev/null >>"$dir/log/slurmd.localhost.log" 2>&1 \
            || die "slurmd failed: $(tail -n 20 "$dir/log/slurmd.localhost.log")"
        return 0
    fi
    for i in $(seq 0 $((nodes - 1))); do start_node_slurmd "$dir" "$i"; done
}

start_node_slurmd() {
    local dir=$1 i=$2
    bash "$NETNS_SH" exec "$dir" "$i" slurmd -N "node$i" -f "$SLURM_CONF" </dev/null \
        >>"$dir/log/slurmd.node$i.log" 2>&1 || die "slurmd node$i failed: $(tail -n 20 "$dir/log/slurmd.node$i.log")"
}

# Node I's namespace (multi-node clusters only).
node_netns() {
    local dir=$1 i=$2
    [[ -s $dir/net && -s $dir/slurm.conf ]] && grep -q "^NodeName=node$i " "$dir/slurm.conf" \
        || die "no node$i in a multi-node cluster in $dir"
    echo "nckpt$(cat "$dir/net")n$i"
}

kill_node() {
    local dir ns pids=()
    dir=$(realpath -m "$1")
    ns=$(node_netns "$dir" "$2")
    # slurmd first, so it forks no new slurmstepd; then whatever runs in the namespace, until nothing does.
    pid_alive "$dir/slurmd.node$2.pid" && { kill -KILL "$(cat "$dir/slurmd.node$2.pid")" || true; }
    rm -f "$dir/slurmd.node$2.pid"
    for _ in $(seq 100); do
        mapfile -t pids < <(ip netns pids "$ns")
        [[ ${#pids[@]} -eq 0 ]] && { echo "killed node$2"; return 0; }
        kill -KILL "${pids[@]}" 2>/dev/null || true
        sleep 0.1
    done
    die "node$2: processes still running in $ns: ${pids[*]}"
}

start_node() {
    local dir state="" ns
    dir=$(realpath -m "$1")
    ns=$(node_netns "$dir" "$2")
    export SLURM_CONF=$dir/slurm.conf
    pid_alive "$dir/slurmd.node$2.pid" || start_node_slurmd "$dir" "$2"
    for _ in $(seq "$START_TIMEOUT"); do
        state=$(sinfo --noheader --nodes="node$2" --format=%t 2>/dev/null || true)
        [[ $state =~ ^(idle|mix|alloc)$ ]] && { echo "node$2 is up ($state)"; return 0; }
        sleep 1
    done
    die "node$2 ($ns) not up after ${START_TIMEOUT}s (state '$state'): $(tail -n 20 "$dir/log/slurmd.node$2.log")"
}

start() {
    local dir port nodes=$2
    dir=$(realpath -m "$1")
    [[ $nodes =~ ^[1-9][0-9]?$ ]] || die "NODES must be 1 to 99, got '$nodes'"
    install_slurm
    mkdir -p "$dir"/{state,spool,log}
    export SLURM_CONF=$dir/slurm.conf SLURM_DBD_CONF=$dir/slurmdbd.conf
    if ! pid_alive "$dir/slurmctld.pid" || ! slurmds_alive "$dir" "$nodes"; then
        stop "$dir" >/dev/null
        [[ -s $dir/mysql.pass ]] || (umask 077 && head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$dir/mysql.pass")
        port=$(free_ports)
        [[ $nodes -eq 1 ]] || bash "$NETNS_SH" up "$dir" "$nodes" >/dev/null
        write_conf "$dir" "$port" "$nodes"
        start_munge "$dir"
        start_mariadb "$dir" $((port + 3))
        start_slurmdbd "$dir"
        # -i: ignore job/node state left in DIR by an earlier run.
        slurmctld -i -f "$SLURM_CONF" </dev/null >>"$dir/log/slurmctld.log" 2>&1 \
            || die "slurmctld failed: $(tail -n 20 "$dir/log/slurmctld.log")"
        start_slurmd "$dir" "$nodes"
    fi
    wait_idle "$dir" "$nodes"
    echo "export SLURM_CONF=$SLURM_CONF"
}

stop_pidfile() {
    local pidfile=$1 pid
    pid_alive "$pidfile" || { rm -f "$pidfile"; return 0; }
    pid=$(cat "$pidfile")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; return 0; }
        sleep 0.2
    done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

stop() {
    local dir pidfile
    dir=$(realpath -m "$1")
    if pid_alive "$dir/slurmctld.pid"; then
        # Cancel leftover jobs so no job step outlives slurmd.
        SLURM_CONF=$dir/slurm.conf timeout 10 scancel --full --partition=debug 2>/dev/null || true
        for _ in $(seq 20); do
            [[ -z $(SLURM_CONF=$dir/slurm.conf squeue --noheader --states=RUNNING,COMPLETING 2>/dev/null) ]] && break
            sleep 0.5
        done
    fi
    for pidfile in "$dir"/slurmd.*.pid; do
        [[ -e $pidfile ]] && stop_pidfile "$pidfile" &
    done
    stop_pidfile "$dir/slurmctld.pid" &
    wait
    # Each takes about 2 s to exit; the cluster's state is discarded, so nothing orders them any more.
    stop_pidfile "$dir/slurmdbd.pid" &
    stop_pidfile "$dir/mysql/mariadbd.pid" &
    stop_pidfile "$dir/munge/munged.pid" &
    wait
    bash "$NETNS_SH" down "$dir"
    echo "stopped Slurm in $dir"
}

case "${1:-}" in
    install) install_slurm ;;
    start) [[ $# -eq 2 || $# -eq 3 ]] || die "usage: cluster.sh start DIR [NODES]"; start "$2" "${3:-1}" ;;
    stop) [[ $# -eq 2 ]] || die "usage: cluster.sh stop DIR"; stop "$2" ;;
    kill-node) [[ $# -eq 3 ]] || die "usage: cluster.sh kill-node DIR I"; kill_node "$2" "$3" ;;
    start-node) [[ $# -eq 3 ]] || die "usage: cluster.sh start-node DIR I"; start_node "$2" "$3" ;;
    *) die "usage: cluster.sh install | start DIR [NODES] | stop DIR | kill-node DIR I | start-node DIR I" ;;
esac
