#!/bin/sh
# What the tests need beyond Python: etcd (3-member clusters for --rdzv-backend etcd) and nftables
# (a firewall's REJECT and one-way cuts between network-namespace hosts), from Debian's packages,
# as root. Nothing to do for a tool already on PATH.
set -eu
cd "$(dirname "$0")"
sh ./install_etcd.sh
if command -v nft >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_test_tools: no nft on PATH; install nftables (Debian/Ubuntu: apt-get install nftables)" \
         "to run the firewall partition tests, or they are skipped" >&2
    exit 0
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null
command -v nft >/dev/null
