#!/bin/sh
# What the tests need beyond Python: etcd (3-member clusters for --rdzv-backend etcd), etcdctl (the
# least-privilege role `elaswave etcd-role` prints, run as printed), nftables (a firewall's
# REJECT and one-way cuts between network-namespace hosts) and Slurm with munge (a controller and
# slurmd nodes that run examples/slurm/train.sbatch: tests/helpers/slurm.py), from Debian's
# packages, as root.
# Nothing to do for a tool already on PATH.
set -eu
cd "$(dirname "$0")"
sh ./install_etcd.sh
missing=""
command -v etcdctl >/dev/null 2>&1 || missing="$missing etcd-client"
command -v nft >/dev/null 2>&1 || missing="$missing nftables"
command -v slurmctld >/dev/null 2>&1 || missing="$missing slurmctld"
command -v slurmd >/dev/null 2>&1 || missing="$missing slurmd"
command -v sbatch >/dev/null 2>&1 || missing="$missing slurm-client"
command -v munged >/dev/null 2>&1 || missing="$missing munge"
if [ -z "$missing" ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_test_tools: install$missing (Debian/Ubuntu: apt-get install$missing) to run the tests that" \
         "need them, or they are skipped" >&2
    exit 0
fi
apt-get update -qq
# shellcheck disable=SC2086
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
for tool in etcdctl nft slurmctld slurmd sbatch munged; do command -v $tool >/dev/null || exit 1; done
