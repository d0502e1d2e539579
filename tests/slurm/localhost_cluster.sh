#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for the SLURM tests: Debian's slurm-wlm (slurmctld + slurmd),
# munge for authentication, and slurmdbd over MariaDB for accounting (submitit reads job states with sacct).
# Run as root; idempotent: what is installed and running is left as it is. Prints nothing on success but the
# partition's name; on failure, one line saying which daemon did not start and where its log is.
#   bash tests/slurm/localhost_cluster.sh          install what is missing (apt-get) and start the daemons
#   bash tests/slurm/localhost_cluster.sh stop     stop them
set -euo pipefail
state=/var/lib/lapheads-slurm
conf=/etc/slurm
partition=lapheads
fail() { echo "localhost_cluster: $1" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "needs root (it installs packages and starts daemons)"

if [ "${1:-}" = stop ]; then
  for daemon in slurmd slurmctld slurmdbd; do pkill -x "$daemon" 2>/dev/null || true; done
  exit 0
fi

packages=""
for pair in slurmctld:slurmctld slurmd:slurmd slurmdbd:slurmdbd munged:munge mariadbd:mariadb-server sbatch:slurm-client; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${pair%%:*}" ] || packages="$packages ${pair#*:}"
done
if [ -n "$packages" ]; then
  command -v apt-get >/dev/null || fail "missing$packages and no apt-get to install them"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $packages >/dev/null 2>&1 || \
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $packages >/dev/null 2>&1; } || \
    fail "apt-get could not install$packages"
fi

mkdir -p "$state"/{ctld,d,logs} /run/munge /run/mysqld "$conf"
host=$(hostname -s)
cpus=$(nproc)
memory=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))

# munge: the key Debian generated at install, the daemon as its own user
chown munge:munge /run/munge
if ! pgrep -x munged >/dev/null; then
  runuser -u munge -- /usr/sbin/munged || fail "munged did not start (see /var/log/munge/munged.log)"
fi

# MariaDB + slurmdbd: accounting, so sacct answers
chown mysql:mysql /run/mysqld
if ! pgrep -x mariadbd >/dev/null; then
  (mysqld_safe --user=mysql >/dev/null 2>&1 &)
  for _ in $(seq 60); do mysqladmin ping >/dev/null 2>&1 && break; sleep 0.5; done
  mysqladmin ping >/dev/null 2>&1 || fail "MariaDB did not start (see /var/log/mysql/error.log)"
fi
mysql -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'lapheads'; \
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"

cat > "$conf/slurmdbd.conf" <<CONF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=lapheads
StorageLoc=slurm_acct_db
LogFile=$state/logs/slurmdbd.log
PidFile=$state/slurmdbd.pid
CONF
chmod 600 "$conf/slurmdbd.conf"

cat > "$conf/slurm.conf" <<CONF
ClusterName=lapheads
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
# pre-emption reaches the job as the signal its sbatch asked for (submitit: USR2), as on production clusters
SlurmctldParameters=preempt_send_user_signal
MinJobAge=600
KillWait=30
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/logs/slurmctld.log
SlurmdLogFile=$state/logs/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=$partition Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF

if ! pgrep -x slurmdbd >/dev/null; then
  /usr/sbin/slurmdbd || fail "slurmdbd did not start (see $state/logs/slurmdbd.log)"
  for _ in $(seq 60); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.5; done
fi
sacctmgr -i -Q add cluster lapheads >/dev/null 2>&1 || true
if ! pgrep -x slurmctld >/dev/null; then
  /usr/sbin/slurmctld || fail "slurmctld did not start (see $state/logs/slurmctld.log)"
fi
if ! pgrep -x slurmd >/dev/null; then
  /usr/sbin/slurmd || fail "slurmd did not start (see $state/logs/slurmd.log)"
fi
for _ in $(seq 60); do
  sinfo -h -o %T 2>/dev/null | grep -qE "^(idle|mixed|allocated)" && { echo "$partition"; exit 0; }
  scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
  sleep 0.5
done
fail "the node did not come up (see $state/logs/slurmd.log and $state/logs/slurmctld.log)"
