"""The job's control store on etcd: torch's ``Store`` calls, each one a Raft-committed request.

``elaswave run --rdzv-backend etcd --rdzv-endpoint H:P[,H:P...]`` (torchrun's words) keeps the
control plane -- epochs, check-ins, decisions, alerts, joins, the rank counter, and the process
groups' rendezvous -- in an etcd cluster instead of a TCPStore held by one process. What that buys:

- A *majority* commits. A side of a partition that cannot reach more than half of the etcd
  members cannot write, nor read (reads are linearizable): every call fails with
  ``DistNetworkError``, the rank's :class:`~elaswave.control.link.StoreLink` gives up after its
  grace, and the rank saves its part and stops (:mod:`elaswave.runtime.rescue`). It cannot agree
  a membership of its own, so a partition never makes two runs.
- ``compare_set`` is one transaction conditioned on the key's value (or its absence): of two
  proposers of the next epoch exactly one wins, whichever member each reached. ``add`` is a
  compare-and-swap on the key's revision, so a counter never counts twice.
- No process of the job holds the store: losing or freezing any of them costs no control plane.

The client speaks etcd's documented v3 JSON gateway over one persistent HTTP connection per store
object (``clone`` opens another), HTTPS with a CA and a client certificate where the cluster asks
for them (:class:`Tls`), with the standard library only: the Python gRPC clients are
unmaintained (``etcd3``'s last release is from 2020 and pins an old protobuf), and the gateway is
part of every etcd server. Every request has a deadline; a member that refuses, stalls or answers
"no leader" sends the next request to the next endpoint. ``wait`` follows etcd's watch stream
rather than polling.

Keys live under a prefix per job and run, so jobs (and reruns of one job) share a cluster apart.
"""
from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import ssl
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from elaswave.errors import ConfigError

REQUEST_TIMEOUT_S = 2.0
"""The longest one request may take before the member is taken as unable to serve (etcd itself
gives up on a proposal after about 7 s without a leader; a healthy cluster answers in ms)."""

RETRY_PAUSE_S = 0.05
"""The least time a round of every member takes before it fails: with no route to the members
(a host cut off) each answers ENETUNREACH in microseconds, and the callers' retries (the links',
the watch stream's) made a tight loop -- measured, a cut-off host's two ranks took 60-70 % of a
core each, and on a shared machine the other side's recovery waited for them."""

_UNAVAILABLE_CODES = (4, 14)
"""gRPC's DeadlineExceeded and Unavailable: this member cannot serve now; another may."""
_UNAVAILABLE = ("no leader", "request timed out", "leader changed", "not capable", "too many requests",
                "unhealthy cluster")
_AUTH = ("authentication", "auth token", "permission denied", "user name is empty", "invalid password")


_LEADER_CHANGE_S: dict[tuple, float] = {}
""":meth:`EtcdStore.leader_change_s` per cluster (its endpoints), asked once per process."""
DEFAULT_LEAST_TTL_S = 2
"""The least lease TTL etcd grants at its default 1 s election timeout."""


class EtcdAuthError(ConfigError):
    """etcd refused the job's credentials (or the cluster wants credentials the job has none of)."""


def parse_endpoints(text: str, flag: str = "--rdzv-endpoint") -> tuple[tuple[str, int], ...]:
    """``H:P[,H:P...]`` -> ((host, port), ...), with a one-line error naming the bad part."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        host, _, port = part.removeprefix("http://").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{flag}={text!r} is invalid: {part!r} is not HOST:PORT with a port in 1..65535 "
                              "(several etcd members: HOST:PORT,HOST:PORT,...)")
        out.append((host.strip("[]"), int(port)))
    return tuple(out)


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str


@dataclass(frozen=True)
class Tls:
    """HTTPS to the etcd members (etcdctl's ``--cacert``, ``--cert``, ``--key``): the CA that signed
    their certificates, and this job's client certificate and key where the cluster requires
    one (``--client-cert-auth``)."""

    cacert: str
    cert: str | None = None
    key: str | None = None

    def context(self) -> ssl.SSLContext:
        for what, path in (("ELASWAVE_ETCD_CACERT", self.cacert), ("ELASWAVE_ETCD_CERT", self.cert),
                           ("ELASWAVE_ETCD_KEY", self.key)):
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{what}={path!r} is invalid: no such file (a PEM file)")
        if (self.cert is None) != (self.key is None):
            raise ConfigError("ELASWAVE_ETCD_CERT and ELASWAVE_ETCD_KEY go together: the client certificate and its key")
        try:
            context = ssl.create_default_context(cafile=self.cacert)
            if self.cert is not None:
                context.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"the etcd TLS files ({self.cacert}, {self.cert}, {self.key}) do not load: {exc}") from None
        return context


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` on an etcd cluster (the calls elaswave and gloo's rendezvous
    make: set, get, add, compare_set, check, wait, multi_get, delete_key, num_keys, clone)."""

    def __init__(self, endpoints: tuple[tuple[str, int], ...], prefix: str, timeout_s: float,
                 credentials: Credentials | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 tls: Tls | None = None):
        super().__init__()
        self.endpoints, self.prefix, self.credentials = tuple(endpoints), prefix, credentials
        self.tls = tls
        self._tls_context = tls.context() if tls is not None else None
        self._timeout = timedelta(seconds=timeout_s)
        self.request_timeout_s = request_timeout_s
        self._at = 0  # the endpoint in use; moves on when a member cannot serve
        self._conn: http.client.HTTPConnection | None = None
        self._token: str | None = None
        self._lock = threading.Lock()
        self._clones: list[EtcdStore] = []

    @property
    def description(self) -> str:
        """What a message calls this store."""
        return "etcd (" + ",".join(f"{h}:{p}" for h, p in self.endpoints) + ")"

    # -- torch's Store interface ------------------------------------------------------------------
    def clone(self) -> "EtcdStore":
        twin = EtcdStore(self.endpoints, self.prefix, self._timeout.total_seconds(), self.credentials,
                         self.request_timeout_s, self.tls)
        # A Python store handed to C++ (a PrefixStore, a gloo group) works only while its Python
        # object lives: pybind11 finds the overrides through it. Callers often keep only the C++ side.
        self._clones.append(twin)
        return twin

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def set(self, key: str, value) -> None:
        self._call("/v3/kv/put", {"key": self._key(key), "value": _b64(value)})

    def get(self, key: str) -> bytes:
        while True:  # one request when the key is there (the usual case); else wait for it
            kvs = self._call("/v3/kv/range", {"key": self._key(key)}).get("kvs") or []
            if kvs:
                return _unb64(kvs[0].get("value", ""))
            self.wait([key])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        while True:
            found = self._ranges(keys)
            if len(found) == len(set(keys)):
                return [found[k] for k in keys]
            self.wait(keys)

    def present(self, keys: list[str]) -> dict[str, bytes]:
        """Those of ``keys`` that exist, with their values, in one request (a TCPStore needs a
        ``check`` per key and a ``multi_get``: :class:`~elaswave.control.seal.Sealed` uses this
        where the store has it)."""
        return self._ranges(keys)

    def check(self, keys: list[str]) -> bool:
        found = self._ranges(keys)
        return all(k in found for k in keys)

    def add(self, key: str, amount: int) -> int:
        k = self._key(key)
        while True:
            kvs = self._call("/v3/kv/range", {"key": k}).get("kvs") or []
            if kvs and amount == 0:
                return int(_unb64(kvs[0].get("value", "")) or b"0")
            if kvs:
                value = int(_unb64(kvs[0].get("value", "")) or b"0") + amount
                compare = {"key": k, "target": "MOD", "mod_revision": kvs[0]["mod_revision"], "result": "EQUAL"}
            else:
                value, compare = amount, {"key": k, "target": "CREATE", "create_revision": "0", "result": "EQUAL"}
            out = self._call("/v3/kv/txn", {"compare": [compare],
                                            "success": [{"request_put": {"key": k, "value": _b64(str(value))}}]})
            if out.get("succeeded"):
                return value

    def compare_set(self, key: str, expected, desired) -> bytes:
        """As TCPStore's: set ``desired`` if the value is ``expected`` (``""``: if the key is
        absent); returns the value the key holds afterwards (``expected`` if absent and not set)."""
        k = self._key(key)
        expected_b = expected.encode() if isinstance(expected, str) else bytes(expected)
        desired_b = desired.encode() if isinstance(desired, str) else bytes(desired)
        compare = ({"key": k, "target": "CREATE", "create_revision": "0", "result": "EQUAL"} if not expected_b else
                   {"key": k, "target": "VALUE", "value": _b64(expected_b), "result": "EQUAL"})
        out = self._call("/v3/kv/txn", {"compare": [compare],
                                        "success": [{"request_put": {"key": k, "value": _b64(desired_b)}}],
                                        "failure": [{"request_range": {"key": k}}]})
        if out.get("succeeded"):
            return desired_b
        kvs = out["responses"][0]["response_range"].get("kvs") or []
        return _unb64(kvs[0].get("value", "")) if kvs else expected_b

    def delete_key(self, key: str) -> bool:
        return int(self._call("/v3/kv/deleterange", {"key": self._key(key)}).get("deleted", 0)) > 0

    def num_keys(self) -> int:
        start = self.prefix.encode()
        return int(self._call("/v3/kv/range", {"key": _b64(start), "range_end": _b64(_prefix_end(start)),
                                               "count_only": True}).get("count", 0))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Until every key exists, following etcd's watch stream; ``DistStoreError`` after the
        timeout (as TCPStore's wait: the caller's "not yet")."""
        deadline = time.monotonic() + (timeout or self._timeout).total_seconds()
        while True:
            found, revision = self._ranges(keys, with_revision=True)
            missing = [k for k in keys if k not in found]
            if not missing:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"wait timeout after {(timeout or self._timeout).total_seconds():g} s "
                                          f"for keys {missing} in etcd")
            self._watch_for(missing[0], revision + 1, left)

    # -- leases and followed prefixes: liveness on etcd (elaswave.control.leases) -------------------
    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (its ID, the TTL granted -- etcd raises one below its minimum, ~1.5x the
        election timeout)."""
        out = self._call("/v3/lease/grant", {"TTL": str(int(ttl_s))})
        return int(out["ID"]), int(out["TTL"])

    def put_leased(self, key: str, value, lease: int | None) -> None:
        """``set`` bound to ``lease``: etcd deletes the key when the lease expires (None: unbound)."""
        body = {"key": self._key(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = str(lease)
        self._call("/v3/kv/put", body)

    def keep_alive(self, lease: int, timeout_s: float | None = None) -> int:
        """Renew ``lease``; the TTL it has again, 0 when it had expired already. ``timeout_s``: how
        long one member may take before the next is asked (a frozen member must not outlast the lease)."""
        out = self._call("/v3/lease/keepalive", {"ID": str(lease)}, timeout_s)
        return int(out.get("result", {}).get("TTL", 0))

    def lease_left(self, lease: int) -> int:
        """Whole seconds ``lease`` has left (0: under one); -1 once it expired (or was revoked)."""
        out = self._call("/v3/lease/timetolive", {"ID": str(lease)})
        # The gateway leaves out fields at their zero value: a live lease with under a second left
        # comes without "TTL" (measured), an expired one with "TTL": "-1".
        return int(out.get("TTL", 0 if "grantedTTL" in out else -1))

    def revoke(self, lease: int) -> None:
        self._call("/v3/lease/revoke", {"ID": str(lease)})

    def leader_change_s(self) -> float:
        """How long this cluster may serve nothing while it replaces a lost leader: a follower
        waits one to two election timeouts before it stands, and a split vote costs another. etcd
        says its election timeout only through the least lease TTL it grants (ceil(1.5 x the
        timeout)): asked once per cluster with a 1 s lease (revoked at once); three of those cover
        two elections. The measured case: a refusing cut left the leader on the minority side, and
        the majority's ranks, given the 2 s heartbeat timeout, took the election for a lost store
        and stopped (1 run in 20)."""
        cached = _LEADER_CHANGE_S.get(self.endpoints)
        if cached is None:
            try:
                lease, least_ttl = self.grant(1)
            except dist.DistNetworkError:  # in an election now: etcd's default timeout, asked again later
                return 3.0 * DEFAULT_LEAST_TTL_S
            with contextlib.suppress(Exception):  # unrevoked, it expires in a second or two anyway
                self.revoke(lease)
            cached = _LEADER_CHANGE_S[self.endpoints] = 3.0 * least_ttl
        return cached

    def follow(self, prefix: str, on_event, halt: threading.Event) -> threading.Thread:
        """A daemon thread calling ``on_event(kind, key, value, prev)`` for every change under
        ``prefix`` from now on (``kind`` PUT or DELETE; ``key`` without the job's prefix; ``prev``
        the etcd record before the change, with its ``lease``), until ``halt`` is set. One watch
        stream; one that breaks or stays quiet for ``request_timeout_s`` (a frozen member sends
        nothing either) is resumed on the next member from the revision after the last event
        seen: nothing is missed, nothing is seen twice."""
        resume = [self._prefix_revision(prefix)]

        def run() -> None:
            at = self._at
            while not halt.is_set():
                host, port = self.endpoints[at]
                began = time.monotonic()
                try:
                    self._stream(host, port, prefix, resume, on_event, halt)
                except (OSError, http.client.HTTPException, json.JSONDecodeError, ValueError):
                    at = (at + 1) % len(self.endpoints)
                    halt.wait(max(0.0, began + RETRY_PAUSE_S / len(self.endpoints) - time.monotonic()))
        thread = threading.Thread(target=run, name=f"etcd-follow-{prefix}", daemon=True)
        thread.start()
        return thread

    def _prefix_revision(self, prefix: str) -> int:
        start = (self.prefix + prefix).encode()
        out = self._call("/v3/kv/range", {"key": _b64(start), "range_end": _b64(_prefix_end(start)), "count_only": True})
        return int(out["header"]["revision"]) + 1

    def _stream(self, host: str, port: int, prefix: str, resume: list[int], on_event, halt: threading.Event) -> None:
        """One watch stream from revision ``resume[0]``, which it moves past each event handled."""
        key = (self.prefix + prefix).encode()
        # A timeout leaves http.client's chunked reader in an undefined state: the stream ends there.
        conn = self._connection(host, port, self.request_timeout_s)
        try:
            with self._lock:
                headers = self._headers()
            conn.request("POST", "/v3/watch", json.dumps({"create_request": {
                "key": _b64(key), "range_end": _b64(_prefix_end(key)), "start_revision": str(resume[0]),
                "prev_kv": True}}), headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise OSError(f"watch refused: {resp.status}")
            while not halt.is_set():
                line = resp.readline()
                if not line:
                    raise OSError("the member closed the watch stream")
                doc = json.loads(line)
                result = doc.get("result", {})
                if result.get("canceled") or "error" in doc:
                    raise OSError(f"the watch ended: {line[:200]!r}")
                since = resume[0]  # (one revision's events, a transaction's, come in one response)
                for event in result.get("events", []):
                    kv = event.get("kv", {})
                    revision = int(kv.get("mod_revision", 0))
                    if revision < since:
                        continue
                    name = _unb64(kv.get("key", "")).decode()[len(self.prefix):]
                    on_event(event.get("type", "PUT"), name, _unb64(kv["value"]) if "value" in kv else None,
                             event.get("prev_kv"))
                    resume[0] = max(resume[0], revision + 1)
        finally:
            conn.close()

    # -- etcd ---------------------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return _b64(self.prefix + key)

    def _ranges(self, keys: list[str], with_revision: bool = False):
        """The values of those of ``keys`` that exist, read in one transaction (one revision)."""
        out = self._call("/v3/kv/txn", {"success": [{"request_range": {"key": self._key(k)}} for k in keys]})
        found = {}
        for k, resp in zip(keys, out.get("responses", [])):
            kvs = resp.get("response_range", {}).get("kvs") or []
            if kvs:
                found[k] = _unb64(kvs[0].get("value", ""))
        return (found, int(out["header"]["revision"])) if with_revision else found

    def _watch_for(self, key: str, from_revision: int, within_s: float) -> None:
        """Return when ``key`` is put at or after ``from_revision``, or after ``within_s``."""
        host, port = self.endpoints[self._at]
        conn = self._connection(host, port, max(0.01, within_s))
        try:
            body = {"create_request": {"key": self._key(key), "start_revision": str(from_revision)}}
            with self._lock:
                headers = self._headers()
            conn.request("POST", "/v3/watch", json.dumps(body), headers)
            resp = conn.getresponse()
            deadline = time.monotonic() + within_s
            while time.monotonic() < deadline:
                conn.sock.settimeout(max(0.01, deadline - time.monotonic()))
                line = resp.readline()
                if not line:
                    return  # the member closed the stream: look again
                result = json.loads(line).get("result", {})
                if any(e.get("type", "PUT") == "PUT" for e in result.get("events", [])):
                    return
        except (OSError, http.client.HTTPException, json.JSONDecodeError):
            return  # a timeout or a broken stream: the caller reads again, and fails there if it must
        finally:
            conn.close()

    def _connection(self, host: str, port: int, timeout_s: float) -> http.client.HTTPConnection:
        if self._tls_context is None:
            return http.client.HTTPConnection(host, port, timeout=timeout_s)
        return http.client.HTTPSConnection(host, port, timeout=timeout_s, context=self._tls_context)

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.credentials is not None:
            headers["Authorization"] = self._token or self._authenticate()
        return headers

    def _authenticate(self) -> str:
        out = self._post("/v3/auth/authenticate", {"name": self.credentials.user,
                                                    "password": self.credentials.password}, auth=False)
        self._token = out["token"]
        return self._token

    def _call(self, path: str, body: dict, timeout_s: float | None = None) -> dict:
        with self._lock:
            try:
                return self._post(path, body, timeout_s=timeout_s)
            except EtcdAuthError:
                if self.credentials is None or self._token is None:
                    raise
                self._token = None  # an expired token: once more with a new one
                return self._post(path, body, timeout_s=timeout_s)

    def _post(self, path: str, body: dict, auth: bool = True, timeout_s: float | None = None) -> dict:
        """One request, to each endpoint in turn until one serves it; ``DistNetworkError`` when
        none does (no quorum reachable from here)."""
        errors, began = [], time.monotonic()
        shut_out = 0  # new connections a member accepted, then closed or failed in TLS: a TLS mismatch
        for _ in range(len(self.endpoints)):
            host, port = self.endpoints[self._at]
            fresh = self._conn is None
            try:
                if self._conn is None:
                    self._conn = self._connection(host, port, self.request_timeout_s)
                # This request's deadline (a lease renewal's is shorter than the others').
                self._conn.timeout = timeout_s or self.request_timeout_s
                if self._conn.sock is not None:
                    self._conn.sock.settimeout(self._conn.timeout)
                headers = self._headers() if auth else {"Content-Type": "application/json"}
                self._conn.request("POST", path, json.dumps(body), headers)
                resp = self._conn.getresponse()
                raw = resp.read()
                if resp.status == 400 and b"CommonName" in raw:
                    raise EtcdAuthError(f"etcd at {host}:{port} refuses a client certificate on its HTTP gateway once "
                                        "auth is on: give the job a user and password over TLS (--rdzv-conf "
                                        "cacert=...,user=...,password_file=...) and no cert/key")
                out = json.loads(raw or b"{}")
                if resp.status == 200:
                    return out
                message = str(out.get("error") or out.get("message") or out)
                if any(word in message for word in _AUTH):
                    raise EtcdAuthError(f"etcd at {host}:{port} refused the job's credentials ({message}); set "
                                        "ELASWAVE_ETCD_USER and ELASWAVE_ETCD_PASSWORD to a user with read-write "
                                        f"access to {self.prefix!r}")
                if out.get("code") not in _UNAVAILABLE_CODES and not any(w in message for w in _UNAVAILABLE):
                    raise RuntimeError(f"etcd at {host}:{port} refused {path}: {message}")
            except ssl.SSLCertVerificationError as exc:
                raise EtcdAuthError(f"etcd at {host}:{port}: its certificate does not verify against "
                                    f"ELASWAVE_ETCD_CACERT={self.tls.cacert!r} ({exc.verify_message})") from None
            except (ssl.SSLError, http.client.RemoteDisconnected, ConnectionResetError) as exc:
                shut_out += fresh
                message = f"{type(exc).__name__}: {exc}"
            except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
                message = f"{type(exc).__name__}: {exc}"
            errors.append(f"{host}:{port}: {message.splitlines()[0] if message else '?'}")
            self._drop()
            self._at = (self._at + 1) % len(self.endpoints)
        if shut_out == len(self.endpoints):
            raise EtcdAuthError(
                f"every etcd member ({self.description}) closed new connections without an answer: "
                + ("it serves HTTPS? set ELASWAVE_ETCD_CACERT to its CA (and ELASWAVE_ETCD_CERT, ELASWAVE_ETCD_KEY "
                   "to the job's client certificate)" if self.tls is None else
                   "it refused the TLS client certificate (ELASWAVE_ETCD_CERT, ELASWAVE_ETCD_KEY: one signed by the "
                   "CA it trusts?)"))
        time.sleep(max(0.0, began + RETRY_PAUSE_S - time.monotonic()))
        raise dist.DistNetworkError("no etcd member served the request (" + "; ".join(errors) + ")")

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn, self._token = None, None


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end for a prefix)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)
