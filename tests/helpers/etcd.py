"""A real etcd cluster for the tests: ``n`` members on loopback (or each in a network namespace),
started and stopped here, every process killed on exit.

The ``etcd`` binary comes from Debian's ``etcd-server`` package, which ``scripts/install_etcd.sh``
installs (CI and the README's test command run it). Where it is missing the etcd tests skip, naming
that command; CI fails instead (``CI`` set), so a missing install cannot pass as green.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ETCD = shutil.which("etcd")


def require_etcd() -> str:
    if ETCD is None:
        if os.environ.get("CI"):
            raise AssertionError("etcd is not installed: .ci/run runs scripts/install_etcd.sh first")
        pytest.skip("etcd is not installed (sh scripts/install_etcd.sh)")
    return ETCD


def _free_ports(n: int, host: str) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class EtcdCluster:
    """``with EtcdCluster(3) as etcd:`` -- ``etcd.endpoints`` is ``H:P,H:P,H:P`` for the job;
    ``kill(i)``, ``stop(i)``/``cont(i)`` act on member ``i``'s real process."""

    def __init__(self, n: int = 3, hosts: list[str] | None = None, prefixes: list[list[str]] | None = None,
                 data_root: str | None = None, tls: tuple[Path, Path, Path] | None = None,
                 client_cert_auth: bool = True):
        """``hosts``: each member's address (default loopback); ``prefixes``: what runs each member
        (``ip netns exec NAME``: in a host namespace); ``tls``: (CA, server certificate, its key):
        clients speak HTTPS and -- with ``client_cert_auth`` -- must show a certificate the CA
        signed (``--client-cert-auth``; etcd's HTTP gateway then refuses every request once auth is
        on, so a cluster with users runs without it)."""
        require_etcd()
        self.tls, self.client_cert_auth = tls, client_cert_auth
        self.n = n
        self.hosts = hosts or ["127.0.0.1"] * n
        self.prefixes = prefixes or [[] for _ in range(n)]
        # Free on this namespace's loopback; a new namespace has none in use.
        flat = _free_ports(2 * n, "127.0.0.1")
        ports = [flat[2 * i:2 * i + 2] for i in range(n)]
        self.client_ports = [p[0] for p in ports]
        self.peer_ports = [p[1] for p in ports]
        # tmpfs where there is one: etcd fsyncs every commit, and a loaded disk would time the tests.
        base = data_root or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self._dir = Path(tempfile.mkdtemp(prefix="elaswave-etcd-", dir=base))
        self.procs: list[subprocess.Popen | None] = [None] * n

    @property
    def endpoints(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in zip(self.hosts, self.client_ports))

    def endpoint(self, i: int) -> tuple[str, int]:
        return self.hosts[i], self.client_ports[i]

    def __enter__(self) -> "EtcdCluster":
        cluster = ",".join(f"m{i}=http://{h}:{p}" for i, (h, p) in enumerate(zip(self.hosts, self.peer_ports)))
        for i in range(self.n):
            self._start(i, cluster)
        try:
            self.wait_healthy(30)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self, i: int, cluster: str) -> None:
        h, cp, pp = self.hosts[i], self.client_ports[i], self.peer_ports[i]
        scheme = "https" if self.tls else "http"
        cmd = [*self.prefixes[i], ETCD, "--name", f"m{i}", "--data-dir", str(self._dir / f"m{i}"),
               "--listen-client-urls", f"{scheme}://{h}:{cp}", "--advertise-client-urls", f"{scheme}://{h}:{cp}",
               "--listen-peer-urls", f"http://{h}:{pp}", "--initial-advertise-peer-urls", f"http://{h}:{pp}",
               "--initial-cluster", cluster, "--initial-cluster-state", "new",
               "--initial-cluster-token", self._dir.name,
               # Faster elections than the WAN defaults: a lost leader is replaced within ~1 s.
               "--heartbeat-interval", "100", "--election-timeout", "1000"]
        if self.tls:
            ca, cert, key = self.tls
            cmd += ["--cert-file", str(cert), "--key-file", str(key)]
            # (etcd asks every client for a certificate once it is given a CA to check them against.)
            cmd += ["--trusted-ca-file", str(ca), "--client-cert-auth"] if self.client_cert_auth else []
        log = open(self._dir / f"m{i}.log", "wb")
        self.procs[i] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout_s: float, members: list[int] | None = None) -> None:
        """Until a write through each of ``members`` (default all) commits."""
        deadline = time.monotonic() + timeout_s
        for i in members if members is not None else range(self.n):
            while True:
                try:
                    conn = self._connection(i, 2)
                    conn.request("POST", "/v3/kv/put", json.dumps({"key": "aGVhbHRo", "value": "MQ=="}))
                    if conn.getresponse().status == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"etcd member {i} not healthy within {timeout_s}s: "
                                         f"{(self._dir / f'm{i}.log').read_text()[-2000:]}")
                time.sleep(0.1)

    def leader(self) -> int:
        """Which member leads now (asked of each live one)."""
        for i in range(self.n):
            if self.procs[i].poll() is not None:
                continue
            conn = self._connection(i, 5)
            conn.request("POST", "/v3/maintenance/status", "{}")
            status = json.loads(conn.getresponse().read())
            if status["header"]["member_id"] == status.get("leader"):
                return i
        raise AssertionError("no member leads")

    def _connection(self, i: int, timeout_s: float) -> http.client.HTTPConnection:
        return (http.client.HTTPSConnection(*self.endpoint(i), timeout=timeout_s, context=self._client_tls())
                if self.tls else http.client.HTTPConnection(*self.endpoint(i), timeout=timeout_s))

    def _client_tls(self) -> ssl.SSLContext:
        ca, cert, key = self.tls
        context = ssl.create_default_context(cafile=str(ca))
        context.load_cert_chain(str(cert), str(key))  # the server's pair also serves as a client's
        return context

    def kill(self, i: int) -> None:
        self._signal(i, signal.SIGKILL)
        self.procs[i].wait(timeout=10)

    def stop(self, i: int) -> None:
        self._signal(i, signal.SIGSTOP)

    def cont(self, i: int) -> None:
        self._signal(i, signal.SIGCONT)

    def _signal(self, i: int, sig: int) -> None:
        try:
            os.killpg(self.procs[i].pid, sig)
        except ProcessLookupError:
            pass

    def __exit__(self, *exc) -> None:
        for i, proc in enumerate(self.procs):
            if proc is None:
                continue
            self._signal(i, signal.SIGCONT)
            self._signal(i, signal.SIGKILL)
            proc.wait(timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)


ETCDCTL = shutil.which("etcdctl")


def etcdctl(etcd: "EtcdCluster", *commands: str, user: str | None = None, env: dict | None = None) -> None:
    """Run each of ``commands`` (shell lines, as an operator types them) with etcdctl pointed at
    ``etcd`` -- over TLS with the members' own certificate when the cluster has one, as ``user``
    (``name:password``) once auth is on."""
    if ETCDCTL is None:
        if os.environ.get("CI"):
            raise AssertionError("etcdctl is not installed: .ci/run runs scripts/install_test_tools.sh first")
        pytest.skip("etcdctl is not installed (sh scripts/install_test_tools.sh)")
    scheme = "https" if etcd.tls else "http"
    env = dict(os.environ, ETCDCTL_API="3", **(env or {}),
               ETCDCTL_ENDPOINTS=",".join(f"{scheme}://{h}:{p}" for h, p in zip(etcd.hosts, etcd.client_ports)))
    if etcd.tls:
        ca, cert, key = etcd.tls
        # (etcdctl 3.4 connects over TLS only when it shows a certificate, asked for or not.)
        env.update(ETCDCTL_CACERT=str(ca), ETCDCTL_CERT=str(cert), ETCDCTL_KEY=str(key))
    if user:
        env["ETCDCTL_USER"] = user
    for line in commands:
        done = subprocess.run(["sh", "-c", line.replace("etcdctl ", "etcdctl --command-timeout=10s ", 1)], env=env,
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise AssertionError(f"{line}: {done.stderr.strip()}")


def enable_auth(etcd: "EtcdCluster", root_password: str) -> str:
    """A root user, then auth on: returns ``root:password`` for :func:`etcdctl`'s ``user``."""
    etcdctl(etcd, "etcdctl role add root", f"etcdctl user add root --new-user-password={root_password}",
            "etcdctl user grant-role root root", "etcdctl auth enable")
    return f"root:{root_password}"
