#!/bin/sh
# etcd for the control plane's consensus backend (--rdzv-backend etcd) and its tests: Debian's
# etcd-server package (etcd 3.4), as root. Nothing to do where an etcd binary is already on PATH.
set -eu
if command -v etcd >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_etcd: no etcd on PATH; install etcd >= 3.4 (Debian/Ubuntu: apt-get install etcd-server, or" \
         "a release binary from etcd's project) and run this again" >&2
    exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null
# The package enables a system service on the default ports; the job and the tests start their own.
command -v systemctl >/dev/null 2>&1 && systemctl disable --now etcd >/dev/null 2>&1 || true
command -v etcd >/dev/null
