#!/usr/bin/env bash
# Stop the cluster tests/slurm/start_cluster.sh started: the two slurmd daemons, then slurmctld (its
# slurmscriptd child exits with it), then munged if the start script started it (unless --keep-munge).
# Only the pids in $GRPO_SLURM_DIR's pid files are signalled.
set -uo pipefail

DIR=${GRPO_SLURM_DIR:-/tmp/grpo-slurm}

stop_pid_file() {
    local file=$1 pid
    [ -s "$file" ] || return 0
    pid=$(cat "$file")
    if kill "$pid" 2>/dev/null; then
        for _ in $(seq 1 50); do
            case "$(ps -o stat= -p "$pid" 2>/dev/null)" in "" | Z*) break ;; esac # gone, or a zombie
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

stop_pid_file "$DIR/slurmd-n1.pid"
stop_pid_file "$DIR/slurmd-n2.pid"
stop_pid_file "$DIR/slurmctld.pid"
if [ "${1:-}" != --keep-munge ] && [ -f "$DIR/munged-started" ]; then
    stop_pid_file /run/munge/munged.pid
    rm -f "$DIR/munged-started"
fi
exit 0
