"""Where a job's control store is, and how every process of the job reaches it.

Two backends, torchrun's names (``--rdzv-backend``):

- ``c10d`` (the default): torch's TCPStore, hosted by ``elaswave run`` (node 0's agent on several
  hosts), at ``HOST:PORT``.
- ``etcd``: a run's prefix in an etcd cluster, at ``etcd://H:P[,H:P...]/elaswave/<job id>/<run>/``.
  No process of the job holds it; a majority of the etcd members decides
  (:mod:`elaswave.control.etcd`).

Each run of a job id gets its own prefix: node 0's agent opens run ``n + 1`` of the id (a counter
in etcd) and points ``current`` at it; the other agents take the current run unless it is closed
(node 0 closes it when the training is over), so a rerun never meets a finished run's keys.
"""
from __future__ import annotations

import http.client
import os
import time

import torch.distributed as dist

from elaswave.comm.backend import connect_store
from elaswave.control.etcd import Credentials, EtcdStore, Tls, parse_endpoints
from elaswave.control.link import StoreLink
from elaswave.errors import ConfigError

SCHEME = "etcd://"
USER_ENV, PASSWORD_ENV = "ELASWAVE_ETCD_USER", "ELASWAVE_ETCD_PASSWORD"
CACERT_ENV, CERT_ENV, KEY_ENV = "ELASWAVE_ETCD_CACERT", "ELASWAVE_ETCD_CERT", "ELASWAVE_ETCD_KEY"
PLAIN_PASSWORD_ENV = "ELASWAVE_ETCD_PLAIN_PASSWORD"
"""Set to 1 to send the etcd password over plain HTTP anyway (a network nobody else can read)."""
CONF_KEYS = {"cacert": CACERT_ENV, "cert": CERT_ENV, "key": KEY_ENV, "user": USER_ENV,
             "plain_password": PLAIN_PASSWORD_ENV}
"""``--rdzv-conf`` keys (torchrun's etcd rendezvous names the TLS files the same way; etcdctl's
``--cacert``, ``--cert``, ``--key``, ``--user``) and the variables they set for the job's processes."""


def credentials() -> Credentials | None:
    """The etcd user the job's processes act as (inherited by its workers through the environment).
    A password never crosses the network in clear: without TLS (``cacert``) it is refused unless
    ``ELASWAVE_ETCD_PLAIN_PASSWORD=1`` says to send it anyway."""
    user = os.environ.get(USER_ENV)
    if not user:
        return None
    password = os.environ.get(PASSWORD_ENV, "")
    if password and tls() is None and os.environ.get(PLAIN_PASSWORD_ENV) != "1":
        raise ConfigError(f"{PASSWORD_ENV} would go to etcd over plain HTTP, readable on the network: give the "
                          f"members' CA (--rdzv-conf cacert=PATH, or {CACERT_ENV}) so it goes over HTTPS -- better, "
                          f"a client certificate (cert=, key=) instead of a password -- or set "
                          f"{PLAIN_PASSWORD_ENV}=1 to send it in clear anyway")
    return Credentials(user, password)


def apply_conf(text: str) -> None:
    """``--rdzv-conf KEY=VALUE[,KEY=VALUE...]``: the etcd TLS files and user, set in this process's
    environment so that its workers inherit them (as the ``ELASWAVE_ETCD_*`` variables would be).
    ``password_file=PATH`` reads the password from a file (never from the command line, which
    every user of the host can read)."""
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, eq, value = part.partition("=")
        if key == "password_file" and eq:
            try:
                os.environ[PASSWORD_ENV] = open(value).read().strip()
            except OSError as exc:
                raise ConfigError(f"--rdzv-conf password_file={value!r} is invalid: {exc.strerror}") from None
            except UnicodeDecodeError:
                raise ConfigError(f"--rdzv-conf password_file={value!r} is invalid: not text (UTF-8)") from None
        elif key in CONF_KEYS and eq and value:
            os.environ[CONF_KEYS[key]] = value
        else:
            raise ConfigError(f"--rdzv-conf {part!r} is invalid: use KEY=VALUE with KEY one of "
                              f"{', '.join([*CONF_KEYS, 'password_file'])}")


def role_commands(job_id: str, user: str) -> list[str]:
    """The ``etcdctl`` commands (for an operator with etcd's root) that give ``user`` what a job
    needs and nothing more: read and write under ``/elaswave/<job_id>/``, where every key, lease and
    watch of the job lives. A lease attached to the job's keys can be revoked only by a user who
    may write them, so no other user of the cluster can make a rank look dead. The job signs in with
    the password over TLS (etcd's HTTP gateway, which elaswave speaks, takes no certificate's CN as
    a user): ``--rdzv-conf cacert=...,user=USER,password_file=...``."""
    role, prefix = f"elaswave-{job_id}", f"/elaswave/{job_id}/"
    return [f"etcdctl role add {role}",
            f"etcdctl role grant-permission {role} --prefix=true readwrite {prefix}",
            f'etcdctl user add {user} --new-user-password="$ELASWAVE_ETCD_PASSWORD"',
            f"etcdctl user grant-role {user} {role}"]


def tls() -> Tls | None:
    """HTTPS to etcd, when ``ELASWAVE_ETCD_CACERT`` is set (inherited by the workers, as the credentials)."""
    cacert = os.environ.get(CACERT_ENV)
    if not cacert:
        if os.environ.get(CERT_ENV) or os.environ.get(KEY_ENV):
            raise ConfigError(f"{CERT_ENV} and {KEY_ENV} need {CACERT_ENV}: the CA that signed the etcd members' "
                              "certificates")
        return None
    return Tls(cacert, os.environ.get(CERT_ENV) or None, os.environ.get(KEY_ENV) or None)


def is_etcd(addr: str) -> bool:
    return addr.startswith(SCHEME)


def etcd_address(store: EtcdStore) -> str:
    return SCHEME + ",".join(f"{h}:{p}" for h, p in store.endpoints) + store.prefix


def etcd_store(addr: str, timeout_s: float) -> EtcdStore:
    """The store an ``etcd://`` address names."""
    endpoints, slash, prefix = addr[len(SCHEME):].partition("/")
    if not slash:
        raise ConfigError(f"--store={addr!r} is invalid: an etcd store is etcd://HOST:PORT[,...]/PREFIX/, "
                          "as `elaswave run` prints it")
    return EtcdStore(parse_endpoints(endpoints, "--store"), "/" + prefix, timeout_s, credentials(), tls=tls())


def link(store: EtcdStore, timeout_s: float, grace_s: float) -> StoreLink:
    """A link to a job's etcd store whose grace (the heartbeat timeout) outlasts the cluster's
    replacing a lost leader: an election is not a lost store."""
    return StoreLink(store, None, timeout_s, max(grace_s, store.leader_change_s()))


def connect(addr: str, timeout_s: float, grace_s: float) -> StoreLink:
    """A link to the job's store at ``addr`` (either backend), as a worker or joiner holds it."""
    if is_etcd(addr):
        store = etcd_store(addr, timeout_s)
        store.check(["config"])  # reach a majority now: a bad address is one line, not a hang later
        return link(store, timeout_s, grace_s)
    return StoreLink(connect_store(addr, timeout_s), addr, timeout_s, grace_s)


def open_etcd_run(endpoints: str, job_id: str, node_rank: int, timeout_s: float) -> EtcdStore:
    """The store of this run of ``job_id``: node 0 opens a new run, the other agents wait (within
    ``timeout_s``) for an open one. Raises ConfigError with one line when etcd cannot serve."""
    job = EtcdStore(parse_endpoints(endpoints), f"/elaswave/{job_id}/", timeout_s, credentials(), tls=tls())
    try:
        if node_rank == 0:
            run = job.add("runs", 1)
            job.set("current", str(run))
        else:
            run = _open_run(job, timeout_s)
    except dist.DistNetworkError as exc:
        if any(_is_tcpstore(h, p) for h, p in job.endpoints):
            raise ConfigError(f"--rdzv-endpoint={endpoints!r} is a TCPStore, not etcd: node 0's agent runs "
                              "--rdzv-backend c10d; give every agent the same --rdzv-backend") from None
        raise ConfigError(f"--rdzv-endpoint={endpoints!r}: no majority of the etcd cluster answered ({exc})") from None
    return EtcdStore(job.endpoints, f"{job.prefix}{run}/", timeout_s, job.credentials, tls=job.tls)


def is_etcd_member(host: str, port: int, within_s: float = 1.0) -> bool:
    """Whether an etcd member answers at ``host:port`` (its ``/version``; a member serving HTTPS
    answers a plain request with an error that names itself too): agents that disagree on the
    backend are then one line, not a timeout."""
    conn = http.client.HTTPConnection(host, port, timeout=within_s)
    try:
        conn.request("GET", "/version")
        body = conn.getresponse().read(4096)
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
    return b"etcdserver" in body or b"HTTPS server" in body


def _is_tcpstore(host: str, port: int, within_s: float = 1.0) -> bool:
    """Whether a TCPStore answers at ``host:port`` (asked only after etcd's requests got nothing there)."""
    try:
        connect_store(f"{host}:{port}", within_s)
    except Exception:  # noqa: BLE001 - refused, timed out, or not a store: not a TCPStore
        return False
    return True


def _open_run(job: EtcdStore, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        if job.check(["current"]):
            run = int(job.get("current"))
            if not job.check([f"{run}/closed"]):
                return run
        if time.monotonic() > deadline:
            raise ConfigError(f"no open run of job {job.prefix!r} in etcd within parallel.timeout_s={timeout_s:g} s; "
                              "is node 0's agent running with the same --rdzv-id?")
        time.sleep(0.2)


def close_etcd_run(store: EtcdStore) -> None:
    """Node 0, when the training is over: agents started later do not join this run."""
    store.set("closed", str(time.time()))
