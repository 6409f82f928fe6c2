#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine for tests/test_slurm.py: munge, one slurmctld and two
# slurmd daemons (nodes n1, n2), following /work/shared/notes/slurm-local.md.
#
# CI path: a fresh Debian machine running as root installs the packages here with apt-get (17 s cold
# here, 56 s on a slow mirror), so `make test` sets the cluster up by itself. Exit status 77 means "cannot
# run here" (not root, or Slurm missing and no apt-get); the test fixture turns it into a skip with the
# printed reason. A failed install is an error, not a skip.
#
# Everything but munge lives under $GRPO_SLURM_DIR (default /tmp/grpo-slurm): slurm.conf, spool, state,
# pid and log files. Clients and daemons find it through SLURM_CONF=$GRPO_SLURM_DIR/slurm.conf, so an
# /etc/slurm of the machine is neither read nor changed. Ports: slurmctld 16817, slurmd 17001 and 17002.
# Run tests/slurm/stop_cluster.sh to stop it.
set -euo pipefail

DIR=${GRPO_SLURM_DIR:-/tmp/grpo-slurm}
export SLURM_CONF=$DIR/slurm.conf
skip() { echo "cannot start a test Slurm cluster: $*" >&2; exit 77; }

[ "$(id -u)" = 0 ] || skip "not root (the Slurm daemons must run as root)"

# 0. A cluster left running by an earlier run is stopped first.
"$(dirname "$0")/stop_cluster.sh" --keep-munge
mkdir -p "$DIR/ctld" "$DIR/spool/n1" "$DIR/spool/n2" "$DIR/log"

# 1. Packages (bookworm: slurm 22.05, munge 0.5.15). policy-rc.d keeps the postinst scripts from starting
#    the daemons with the stock configuration; a machine's own policy-rc.d is left as it is.
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
    || ! command -v munged >/dev/null; then
    command -v apt-get >/dev/null || skip "Slurm is not installed and there is no apt-get to install it"
    policy=/usr/sbin/policy-rc.d
    added_policy=
    if [ ! -e $policy ]; then
        printf '#!/bin/sh\nexit 101\n' >$policy && chmod +x $policy && added_policy=1
    fi
    echo "installing slurmctld slurmd slurm-client munge with apt-get" >&2
    ok=1
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null; } || ok=
    if [ -n "$added_policy" ]; then rm -f $policy; fi
    [ -n "$ok" ] || { echo "apt-get install slurmctld slurmd slurm-client munge failed" >&2; exit 1; }
fi

# 2. munge (its postinst creates /etc/munge/munge.key). Start it unless it already answers.
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
        chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge && chown munge:munge /run/munge
    runuser -u munge -- munged
    touch "$DIR/munged-started"
fi

# 3. Configuration.
H=$(hostname -s)
cat >"$SLURM_CONF" <<EOF
# Written by tests/slurm/start_cluster.sh: two logical nodes on one host.
ClusterName=grpo-ci
SlurmctldHost=$H
SlurmctldPort=16817
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/ctld
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdSpoolDir=$DIR/spool/%n
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.log
SlurmdParameters=config_overrides
NodeName=n1 NodeHostname=$H NodeAddr=127.0.0.1 Port=17001 CPUs=2 RealMemory=2000 State=UNKNOWN
NodeName=n2 NodeHostname=$H NodeAddr=127.0.0.1 Port=17002 CPUs=2 RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF

# 4. Daemons (they daemonize), then wait until both nodes are idle.
slurmctld
slurmd -N n1
slurmd -N n2
for _ in $(seq 1 100); do
    if [ "$(sinfo -h -o '%D %t' 2>/dev/null)" = "2 idle" ]; then
        echo "SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.2
done
echo "the nodes did not become idle; sinfo says:" >&2
sinfo >&2 || true
tail -n 20 "$DIR/log/slurmctld.log" >&2 || true
exit 1
