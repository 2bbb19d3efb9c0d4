#!/bin/bash
# A throwaway Slurm cluster on this machine, to run the real Slurm routes of the harness where no cluster is
# (CI, a laptop): slurmctld plus one slurmd per "node" (localhost and this host's own name, both on loopback),
# each node with GPU GRES backed by placeholder files, so `--gpus-per-node` requests are scheduled as on a GPU
# cluster while the points themselves run with backend=cpu. Everything lives in one directory; nothing under
# /etc is written. Needs root (munge and slurmd run as root) and Debian's slurm-wlm + munge (`--install`).
#
#   slurm/local_cluster.sh start [--install] [DIR]   # default DIR: /tmp/llmem-slurm; waits until nodes are idle
#   eval "$(slurm/local_cluster.sh env [DIR])"       # SLURM_CONF for sinfo/sbatch/srun/submitit
#   slurm/local_cluster.sh stop [DIR]
#
# Ports (override with LLMEM_SLURM_PORT): slurmctld on $port, slurmd i on $port+1+i.
set -euo pipefail

GPUS_PER_NODE=4
PORT="${LLMEM_SLURM_PORT:-16817}"

usage() { echo "usage: local_cluster.sh start [--install] [DIR] | env [DIR] | stop [DIR]" >&2; exit 2; }

# This host's name (when it resolves) and localhost: two nodes make the multi-node route (srun torchrun
# --nnodes 2, c10d rendezvous on the first node's name) testable on one machine. The order matters: slurm
# 22.05 rejects a config whose *first* node is "localhost" next to the real host name ("Duplicated
# NodeHostName"), and accepts it second.
node_names() {
    local names="" host
    host="$(hostname -s 2>/dev/null || true)"
    if [[ -n "$host" && "$host" != "localhost" ]] && getent hosts "$host" >/dev/null; then
        names="$host "
    fi
    echo "${names}localhost"
}

write_config() {
    local dir="$1" nodes cpus mem_mb i=0 node
    nodes="$(node_names)"
    cpus="$(nproc)"
    mem_mb=$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) / $(wc -w <<<"$nodes") ))
    mkdir -p "$dir/state" "$dir/gpu"
    for ((g = 0; g < GPUS_PER_NODE; g++)); do : >"$dir/gpu/nvidia$g"; done
    cat >"$dir/slurm.conf" <<EOF
# Written by slurm/local_cluster.sh: a throwaway test cluster.
ClusterName=llmem-local
SlurmctldHost=localhost
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
EOF
    : >"$dir/gres.conf"
    echo "AutoDetect=off" >>"$dir/gres.conf"
    for node in $nodes; do
        echo "NodeName=$node NodeAddr=127.0.0.1 Port=$((PORT + 1 + i)) CPUs=$cpus RealMemory=$mem_mb" \
            "Gres=gpu:$GPUS_PER_NODE State=UNKNOWN" >>"$dir/slurm.conf"
        echo "NodeName=$node Name=gpu File=$dir/gpu/nvidia[0-$((GPUS_PER_NODE - 1))]" >>"$dir/gres.conf"
        i=$((i + 1))
    done
    echo "PartitionName=debug Nodes=${nodes// /,} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" \
        >>"$dir/slurm.conf"
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi  # a munged already answers
    [[ -s /etc/munge/munge.key ]] || { mkdir -p /etc/munge; dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; }
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chmod 0400 /etc/munge/munge.key
    munged --force
}

wait_idle() {
    local want="$1" idle
    for _ in $(seq 60); do
        idle="$(sinfo -h -N -o '%T' 2>/dev/null | grep -c '^idle' || true)"
        [[ "$idle" -ge "$want" ]] && return 0
        sleep 0.5
    done
    echo "local_cluster: nodes did not become idle; logs in $DIR" >&2
    sinfo -N >&2 || true
    return 1
}

start() {
    if [[ "$(id -u)" != 0 ]]; then echo "local_cluster: needs root (munged, slurmd)" >&2; exit 1; fi
    if [[ "$INSTALL" == 1 ]] && ! command -v slurmctld >/dev/null; then
        timeout 300 apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq slurm-wlm munge >/dev/null
    fi
    for tool in slurmctld slurmd munged sinfo; do
        command -v "$tool" >/dev/null || { echo "local_cluster: $tool not found (apt-get install slurm-wlm munge, or --install)" >&2; exit 1; }
    done
    stop_daemons 2>/dev/null || true
    rm -rf "$DIR"
    write_config "$DIR"
    export SLURM_CONF="$DIR/slurm.conf"
    start_munge
    slurmctld -c -f "$SLURM_CONF"
    for node in $(node_names); do slurmd -f "$SLURM_CONF" -N "$node"; done
    wait_idle "$(wc -w <<<"$(node_names)")"
    echo "local_cluster: $(sinfo -h -N -o '%N' | paste -sd, -) idle ($GPUS_PER_NODE placeholder GPUs each); SLURM_CONF=$SLURM_CONF" >&2
}

stop_daemons() {
    local pid_file pids=()
    for pid_file in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid"; do
        [[ -f "$pid_file" ]] && pids+=("$(cat "$pid_file")")
    done
    [[ ${#pids[@]} -gt 0 ]] || return 0
    kill "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 40); do  # the ports must be free before a restart binds them again
        local alive=0 pid
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [[ $alive == 0 ]] && return 0
        sleep 0.25
    done
    kill -9 "${pids[@]}" 2>/dev/null || true
}

cmd="${1:-}"; shift || true
INSTALL=0
if [[ "${1:-}" == "--install" ]]; then INSTALL=1; shift; fi
DIR="${1:-/tmp/llmem-slurm}"
case "$cmd" in
    start) start ;;
    env) echo "export SLURM_CONF=$DIR/slurm.conf" ;;
    stop) stop_daemons ;;
    *) usage ;;
esac
