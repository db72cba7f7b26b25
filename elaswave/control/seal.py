"""Sealed control records: only a holder of the job's token can write what steers the job.

Whoever reaches the job's store can write to it: a TCPStore has no authentication, and on etcd a
credential is shared by every job of a user. So every control record (``ew/...`` set by a rank,
an agent or the launcher: deaths, alerts, check-ins, decisions, store and port addresses, join
requests and verdicts, the state each member posts) carries an HMAC-SHA256 of its key and value
under the *job's key*, and a reader acts only on records that verify. A record that does not is
read as absent: a forged death, alert, check-in or standby address changes nothing, and a forged
decision in the way of a real one is replaced by it (:meth:`Sealed.compare_set`).

The job's key is ``HMAC(token, nonce)``: the token is ``ELASWAVE_TOKEN`` (never stored), the
nonce a random value the job's first process draws and publishes as ``ew/job``, sealed under the
token alone. A record of one job -- or of an earlier run of the same job, which draws a new
nonce -- does not verify in another started with the same token, and the key names of each
record (a request's number, an alert's number, a rank) make a record of one place worthless in
another. A seal also binds the *generation* of the store the record was written to (how many
times the job's store has moved: :mod:`elaswave.control.failover`), because a moved store numbers
its alerts and requests afresh: alert 3 of the store before a move, copied into the one after
it, does not open there. Nothing in the store can be replayed to effect.

Counters (``add``) cannot carry a seal, so nothing is decided from one: the epoch is read from
sealed decisions (:meth:`elaswave.control.membership.Membership.current_epoch`), alerts, join
requests, verdicts and rank numbers are sealed sequences (:mod:`elaswave.control.sequence`), and
a heartbeat counter only says that a rank moved (a forged beat can delay an eviction by the
heartbeat, never cause one). What is left to an outsider is denial of service (deleting keys,
flooding the store), as with any unauthenticated transport: see docs/control-plane.md.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

from elaswave.errors import ConfigError

PREFIX = "ew/"
"""Where the job's control records live in its store."""
JOB = PREFIX + "job"
"""The job's nonce, sealed under the token alone: from it and the token, every process of the job
derives the job's key."""
GENERATION = PREFIX + "store/generation"
"""How many times the job's store has moved, set on each new store once it is ready. Sealed for
its own generation (:func:`store_generation`): a process that connects to a moved store learns
from it which generation its seals carry."""
TAG = b"\n#hmac-sha256:"
REPLACE_TRIES = 8
"""How often a claim replaces a forged record in its way before giving up (a writer racing it)."""


class Forged(RuntimeError):
    """A control record that does not carry the job's seal: written by someone without the token."""


class TokenMismatch(ConfigError):
    """This process's ELASWAVE_TOKEN is not the job's (or the job has none)."""


def _mac(key: bytes, name: str, value: bytes, generation: int) -> bytes:
    where = name.encode() if not generation else f"{generation}\0{name}".encode()
    return hmac.new(key, where + b"\0" + value, hashlib.sha256).hexdigest().encode()


def seal(key: bytes, name: str, value, generation: int = 0) -> bytes:
    """``value`` with its seal for ``name`` on a store of ``generation`` (0: where the job began)."""
    value = value.encode() if isinstance(value, str) else bytes(value)
    return value + TAG + _mac(key, name, value, generation)


def opened(key: bytes, name: str, raw: bytes, generation: int = 0) -> bytes | None:
    """The value of a record sealed under ``key`` at ``name`` on a store of ``generation``; None if it is not."""
    value, tag, mac = bytes(raw).rpartition(TAG)
    return value if tag and hmac.compare_digest(mac, _mac(key, name, value, generation)) else None


def open_job(store, token: str | None, found: bool = False, wait: bool = False) -> "Sealed":
    """``store`` sealed with the job's key (with none for a job without a token: nothing is
    sealed). ``found``: the job exists already (a joiner) or is being started by another process
    (``wait`` for it: an agent of another host): its record is read, never made. Else the first
    process to get here draws the nonce, and every other one reads it."""
    if not token:
        return Sealed(store, None)
    by_token = token.encode()
    if found:
        if not wait and not store.check([JOB]):
            raise TokenMismatch("the job at this store was started without ELASWAVE_TOKEN (or is not an elaswave "
                                "job): it admits no process from outside")
        raw = store.get(JOB)
    else:
        raw = store.compare_set(JOB, "", seal(by_token, JOB, secrets.token_hex(16)))
    nonce = opened(by_token, JOB, raw)
    if nonce is None:
        raise TokenMismatch("ELASWAVE_TOKEN differs from the job's: the job's record in its store is not sealed "
                            "with this token")
    job = Sealed(store, hmac.new(by_token, b"elaswave-job/" + nonce, hashlib.sha256).digest(), bytes(raw))
    generation = store_generation(job)
    if generation and hasattr(store, "adopt"):  # a store the job moved to before this process came
        store.adopt(generation)
    return job


def store_generation(store: "Sealed") -> int:
    """The generation the store says it is (0: never moved, or no seal verifies it). The record is
    sealed for the generation it names, so a reader that does not know it yet can check it; an old
    store's record copied here names an older generation, which no reader takes for newer."""
    if not store.raw.check([GENERATION]):
        return 0
    raw = store.raw.get(GENERATION)
    if store.key is None:
        return int(raw)
    value = bytes(raw).rpartition(TAG)[0]
    return int(value) if value.isdigit() and opened(store.key, GENERATION, raw, int(value)) is not None else 0


def announce_generation(store: "Sealed", generation: int) -> None:
    """Say on a new store which generation it is (:func:`store_generation`)."""
    store.raw.set(GENERATION, seal(store.key, GENERATION, str(generation), generation) if store.key else str(generation))


class Sealed:
    """A store whose control records are sealed on the way in and verified on the way out; every
    other call (``add``, ``check``, ``wait``, ``clone``, a link's ``move``) goes to ``raw``. With
    ``key`` None (a job without a token) it passes everything through."""

    def __init__(self, raw, key: bytes | None, job_record: bytes | None = None):
        self.raw, self.key = raw, key
        self.job_record = job_record
        """``ew/job`` as the job's first process wrote it: seeded on a store the job moves to."""

    def __getattr__(self, name):
        return getattr(self.raw, name)

    @property
    def generation(self) -> int:
        """The generation of the store ``raw`` reaches now (a link's follows the store's moves)."""
        return getattr(self.raw, "generation", 0)

    def _sealed(self, name: str) -> bool:
        # (Both are sealed otherwise: the job's record under the token, the generation for itself.)
        return self.key is not None and name.startswith(PREFIX) and name not in (JOB, GENERATION)

    def _open(self, name: str, raw: bytes) -> bytes | None:
        return opened(self.key, name, raw, self.generation) if self._sealed(name) else raw

    def _seal(self, name: str, value) -> bytes:
        return seal(self.key, name, value, self.generation)

    def set(self, name: str, value) -> None:
        self.raw.set(name, self._seal(name, value) if self._sealed(name) else value)

    def get(self, name: str) -> bytes:
        value = self._open(name, self.raw.get(name))
        if value is None:
            raise Forged(f"the control record {name!r} is not sealed with the job's token: someone without it wrote it")
        return value

    def multi_get(self, names: list[str]) -> list[bytes]:
        values = [self._open(n, v) for n, v in zip(names, self.raw.multi_get(names))]
        forged = [n for n, v in zip(names, values) if v is None]
        if forged:
            raise Forged(f"the control records {forged} are not sealed with the job's token")
        return values

    def read(self, name: str) -> bytes | None:
        """The record's value, or None when it is absent or forged."""
        return self.genuine([name]).get(name)

    def genuine(self, names: list[str]) -> dict[str, bytes]:
        """Of ``names``, the records present and sealed, with their values (on etcd one request;
        on a TCPStore a check per name and one multi_get)."""
        try:
            found = self.raw.present(names)
        except AttributeError:  # a TCPStore
            present = [n for n in names if self.raw.check([n])]
            found = dict(zip(present, self.raw.multi_get(present) if present else []))
        return {n: v for n, raw in found.items() if (v := self._open(n, raw)) is not None}

    def compare_set(self, name: str, expected, desired) -> bytes:
        """As the store's, for a record that must be claimed once (``expected`` empty): returns
        the value that holds it -- a forged one in its way is replaced, so an outsider cannot
        pre-empt a decision. From a value (a counter's), the raw call."""
        if expected != "" or not self._sealed(name):
            return self.raw.compare_set(name, expected, desired)
        want = self._seal(name, desired)
        held = self.raw.compare_set(name, "", want)
        for _ in range(REPLACE_TRIES):
            value = self._open(name, held)
            if value is not None:
                return value
            held = self.raw.compare_set(name, held, want)
        raise Forged(f"the control record {name!r} is overwritten by someone without the job's token as fast as it "
                     f"is claimed")

    def separate(self) -> "Sealed":
        return Sealed(self.raw.separate(), self.key, self.job_record)

    def fresh(self, within_s: float) -> "Sealed":
        return Sealed(self.raw.fresh(within_s), self.key, self.job_record)


def sealed(store, key: bytes | None = None) -> Sealed:
    """``store`` as a :class:`Sealed` (itself if it is one already)."""
    return store if isinstance(store, Sealed) else Sealed(store, key)
