"""The job's control store moves to a survivor when the process holding it dies.

The store lives in one process (``elaswave run``, or node 0's agent). Each worker also hosts a
*standby*: an empty TCPStore server started with the rank, its address in the store
(``ew/standby/<rank>``), which every member reads at the start of each epoch. When the store's
process dies and every member lives, each rank's links give up within the heartbeat timeout, and
the step's loss exchange counts the ranks that gave up (:mod:`elaswave.runtime.step`): once it is
all of them, all move at the end of that same step to the standby of the epoch's first member
(:func:`successor`, the same answer on every rank). That rank seeds what the protocol needs from
then on -- the epoch and its members, the job's config, the rank counter -- every rank registers
its ports there again, and a barrier over the world group (which never used the store after it
was built) ends the move. No member changed and no state moved: the next step trains, and the run
is bit-identical to one without the loss.

The per-host agents follow: each keeps the members' standby addresses (:class:`Directory`), and
when its link gives up it connects to the first that says it is the job's store now
(``ew/store/generation`` newer than the one it knew).

Members dead with the store (node 0's whole host, or, after a move, the member whose process holds
the store): the survivors' recovery finds the store gone and each moves to the first member whose
standby *answers* (:func:`move` with a prober), then agrees there without the dead
(:meth:`elaswave.runtime.context.Context.relocate_store`). Without any standby that answers, the
ranks save their state and stop, and a rerun resumes with no step lost (:mod:`elaswave.runtime.rescue`).

What this does not cover: a store process that is frozen (SIGSTOP) rather than dead. A TCPStore
client's calls that expect a reply (add, check, get, multi_get, compare_set, wait) to one had not
returned 8 s after their 1 s timeout (torch 2.13), so a link blocked in a call never gives up (a new
connection's attempt is bounded: :func:`elaswave.control.link.client`).
"""
from __future__ import annotations

import json
import socket
import threading
import time
from typing import Callable, Sequence

import torch.distributed as dist

from elaswave.control import addresses, agents, rank_numbers
from elaswave.control.link import StoreLink, StoreLost, check_listening, client, serve
from elaswave.control.membership import EPOCH_FLOOR, PREFIX, Membership, NoMajority, has_majority
from elaswave.control.seal import JOB, Sealed, announce_generation, sealed, store_generation

STANDBY = PREFIX + "standby/"
FOLLOWS = PREFIX + "agents/follows/"
CONNECT_S = 0.25
"""The longest one connection attempt to a standby may take."""
OWN_HOST_CONNECT_S = 2.0
"""... to a standby at this machine's own address: its kernel completes a connect to a live
listener however starved the listening process is, so a slow one there is a loaded machine, not a
lost rank -- and a live standby passed over as silent would make a second store beside the one the
other survivors move to."""


class Standby:
    """This rank's standby store (idle until the job's store moves here), and the members'
    standby addresses, learnt while the store is up."""

    def __init__(self, bind: str | None, timeout_s: float):
        host = bind or socket.gethostname()
        self.server = serve(host, 0, timeout_s)  # on that address alone, never every interface
        self.addr = f"{host}:{self.server.port}"
        self.known: dict[int, str] = {}
        self.ranks = 0
        """How many rank numbers the job had handed out when this rank last looked (a store that
        moves here hands out none of them again)."""

    def register(self, store, rank: int) -> None:
        store.set(f"{STANDBY}{rank}", self.addr)
        self.known[rank] = self.addr

    def learn(self, store, ranks: Sequence[int]) -> None:
        """The standby addresses of ``ranks`` this rank does not know yet, and the rank numbers handed out."""
        self.known.update(_standbys(store, [r for r in ranks if r not in self.known]))
        self.ranks = rank_numbers.count(store, self.ranks)


def successor(members: Sequence[int], known: dict[int, str],
               answers: Callable[[str], bool] | None = None) -> tuple[int, str]:
    """Where the store moves: the standby of the first member (in rank order) whose address is
    known -- and, with ``answers``, whose standby answers (members died with the store). Every
    member computes the same answer from the same epoch."""
    for rank in sorted(members):
        if rank in known and (answers is None or answers(known[rank])):
            return rank, known[rank]
    raise StoreLost(f"the control store is gone and no standby store of members {list(members)} "
                    f"{'answers' if answers else 'is known'}")


def answers(addr: str) -> bool:
    """Whether a standby store listens at ``addr`` (a dead rank's refuses, a dead host's is silent)."""
    return reach(addr) == "answers"


def reach(addr: str) -> str:
    """``answers``; ``refused`` (this machine's own kernel says nobody listens: the rank is proven
    dead); or ``silent`` (a dead host, one cut off, or a refusal from another machine -- a
    firewall's REJECT in front of a live one: it proves nothing)."""
    host, port = addr.rsplit(":", 1)
    own = addresses.is_own_host(host)
    try:
        check_listening(host, int(port), OWN_HOST_CONNECT_S if own else CONNECT_S)
        return "answers"
    except ConnectionRefusedError:
        return "refused" if own else "silent"
    except OSError:
        return "silent"


def epoch_now(link: StoreLink, within_s: float) -> tuple[int, tuple[int, ...] | None] | None:
    """(the store's epoch, its members or None while undecided), asked over a new connection to
    where ``link`` says the store is; None when it does not answer within about ``2 x within_s``
    (gone, frozen, cut off). A rank whose own link gave up asks this before acting on it: paused
    past the grace (SIGSTOP, a frozen VM), it finds the store answering, in an epoch without it."""
    got: dict = {}

    def ask() -> None:
        try:
            membership = Membership(sealed(link).fresh(within_s), -1)
            epoch = membership.current_epoch()
            got["now"] = epoch, membership.members_of(epoch)
        except Exception:  # noqa: BLE001 - refused, timed out, unknown: it does not answer
            pass
    asking = threading.Thread(target=ask, daemon=True, name="elaswave-epoch-now")
    asking.start()
    asking.join(2 * within_s)
    return got.get("now")


def check_majority(members: Sequence[int], known: dict[int, str]) -> None:
    """Before electing a successor store on several hosts: the members whose standby answers must
    be more than half of those not proven dead (a refused standby proves its rank dead). A side
    cut off from the rest is no majority and must not make a store of its own: NoMajority."""
    seen = {r: reach(known[r]) if r in known else "silent" for r in members}
    side = [r for r, how in seen.items() if how == "answers"]
    refused = [r for r, how in seen.items() if how == "refused"]
    if not has_majority(side, members, refused, holds_store=False):
        raise NoMajority(f"the control store is gone and only ranks {side} of members {list(members)} answer "
                         f"({refused or 'none'} proven dead): not a majority, so this side does not elect a store")


def move(link: StoreLink, standby: Standby, rank: int, epoch: int, members: Sequence[int], config: dict,
         liveness=None, prober=None, requires_majority: bool = False) -> tuple[int, str]:
    """This rank's part of a move, after the last step of ``epoch``: every link goes to the
    successor's standby; the successor seeds it; each rank registers its ports, and the ports it
    knows of the others (``prober``'s, so that a member that died with the store is proven dead by
    its refusal). Two ways in:

    - at a step boundary that every member reached with the store lost: the caller ends the move
      with a barrier over the world group, then :func:`announce`;
    - from a recovery that found the store gone (members died with it, so the successor is the
      first whose standby answers): the recovery that follows agrees on the next epoch there.

    Returns (the successor's rank, its address). ``requires_majority`` (several hosts): from a
    recovery, only a side with a majority of the members elects a store (:func:`check_majority`)."""
    if requires_majority and prober is not None:
        check_majority(members, standby.known)
    leader, addr = successor(members, standby.known, answers if prober is not None else None)
    link.move(addr, link.generation + 1)  # records are sealed for the new store's generation from here on
    # From a recovery every survivor seeds (the same values; the successor may still be stuck in
    # a collective with the dead, until its watcher follows the store here).
    if rank == leader or prober is not None:
        # A rank number handed out before the move must not come again; the epoch goes on from here.
        rank_numbers.set_floor(link, max(max(standby.known) + 1, standby.ranks))
        link.compare_set(EPOCH_FLOOR, "", str(epoch))
        link.set(PREFIX + "config", json.dumps(config))
        if getattr(link, "job_record", None):  # a joiner that comes after the move checks its token here
            link.compare_set(JOB, "", link.job_record)
        link.compare_set(f"{PREFIX}ep/{epoch}/members", "", json.dumps(list(members)))
    standby.register(link, rank)
    if liveness is not None:
        liveness.register(link, rank)
    if prober is not None:
        prober.post_known(link)
    return leader, addr


def announce(link: StoreLink) -> None:
    """The new store is ready for the agents and ranks that follow (after the barrier, on the
    successor; from a recovery, on every survivor, with the same value)."""
    announce_generation(sealed(link), link.generation)


def hold_for_agents(link: StoreLink, nnodes: int, own_node: int, within_s: float) -> None:
    """On the member holding the moved store, at the end: wait (bounded) until the agents of the
    other hosts that followed the store here say they finished (its own host's agent waits for
    this process to exit first; node 0's, which held the store before, is gone)."""
    deadline = time.monotonic() + within_s
    try:
        while time.monotonic() < deadline:
            others = [n for n in range(nnodes) if n != own_node and sealed(link).read(f"{FOLLOWS}{n}") is not None]
            if all(agents.has_finished(link, n) for n in others):
                return
            time.sleep(0.05)
    except StoreLost:
        pass


def followed(link: StoreLink, node_rank: int) -> None:
    """An agent that followed the store says so: the member holding it waits for it at the end."""
    link.set(f"{FOLLOWS}{node_rank}", "1")


EAGER_S = 10.0
"""How long after the ranks or their standbys last grew an agent's directory looks every 0.05 s."""


class Directory:
    """An agent's view of the members' standby stores, refreshed while the job's store is up,
    to follow the store when it moves."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.at = every_s, 0.0
        self.known: dict[int, str] = {}
        self.generation = 0
        self.ranks = 0
        self.clients: dict[str, dist.Store] = {}
        self.why_not = ""
        """Why the last :meth:`follow` found nowhere to go (said in the agent's message)."""
        self.grew_at = time.monotonic()

    def refresh(self, store) -> None:
        # Until every rank's standby is known, look often: a store lost just after the ranks
        # registered would leave this agent nothing to follow. For a while after the last change
        # only: a rank that died before registering never will.
        eager = (not self.ranks or len(self.known) < self.ranks) and time.monotonic() - self.grew_at < EAGER_S
        if time.monotonic() - self.at < (min(self.every_s, 0.05) if eager else self.every_s):
            return
        self.at = time.monotonic()
        before = (self.ranks, len(self.known))
        self.ranks = rank_numbers.count(store, self.ranks)
        self.known.update(_standbys(store, [r for r in range(self.ranks) if r not in self.known]))
        self.generation = _generation(store)
        if (self.ranks, len(self.known)) != before:
            self.grew_at = time.monotonic()

    def follow(self, link: StoreLink, within_s: float, timeout_s: float,
               pointless: Callable[[], bool] = lambda: False) -> str | None:
        """Move ``link`` to the standby that became the job's store (newer generation than the one
        known); None if none did within ``within_s``, or once ``pointless()`` (e.g. every worker of
        the host has exited: a side that saved and stopped has nothing to follow for)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and not pointless():
            moved = follow_once(link, self.known, self.generation, timeout_s, self.clients)
            if moved is not None:
                addr, self.generation = moved
                return addr
            time.sleep(0.05)
        self.why_not = ("every worker of this host had exited" if pointless() else
                        f"no rank's standby store was known (of {self.ranks} ranks)" if not self.known else
                        f"none of the standbys of ranks {sorted(self.known)} became the job's store (after "
                        f"generation {self.generation}) within {within_s:g} s")
        return None


def follow_once(link: StoreLink, known: dict[int, str], generation: int, timeout_s: float,
                clients: dict[str, dist.Store]) -> tuple[str, int] | None:
    """One look, in rank order, for a standby that became the job's store (its generation newer
    than ``generation``); moves ``link`` there and returns (its address, its generation).
    ``clients``: kept between looks, one per standby (now and then a TCPStore connection stalls
    for 5 s: a new one each look would meet that often)."""
    for _, addr in sorted(known.items()):
        try:
            client = clients.get(addr) or clients.setdefault(addr, Sealed(_client(addr, timeout_s), sealed(link).key))
            newer = _generation(client)
        except (OSError, RuntimeError):  # refused (a dead rank's) or not answering: the next one
            clients.pop(addr, None)
            continue
        if newer > generation:
            link.move(addr, newer)
            return addr, newer
    return None


def _client(addr: str, timeout_s: float) -> dist.Store:
    host, port = addr.rsplit(":", 1)
    check_listening(host, int(port), CONNECT_S)  # a refused one is cheap and quiet
    return client(host, int(port), CONNECT_S, timeout_s)


def _generation(store) -> int:
    return store_generation(sealed(store))


def _standbys(store, ranks: Sequence[int]) -> dict[int, str]:
    """The standby addresses ``ranks`` registered (a forged one is not theirs: it is left out)."""
    keys = {f"{STANDBY}{r}": r for r in ranks}
    return {keys[k]: v.decode() for k, v in sealed(store).genuine(list(keys)).items()}
