"""The job's control store as an agent (``elaswave run``) opens it: hosted here -- one host, or
node 0 of several, listening on its address alone -- or reached at the endpoint: node 0's
TCPStore, or the run's prefix in an etcd cluster (:mod:`elaswave.control.rendezvous`)."""
from __future__ import annotations

import time

import torch.distributed as dist

from elaswave.control import addresses, rendezvous
from elaswave.control.agents import AgentRefused, Node
from elaswave.control.link import StoreLink, client, serve

REACH_ATTEMPT_S = 5.0
"""The longest one attempt to reach node 0's store waits for its connect (and as long for its ping)."""


def open_store(node: Node, host: str, timeout_s: float, grace_s: float) -> tuple[dist.TCPStore | StoreLink, str]:
    """The job's store: hosted here (one host, or node 0 of several) or reached at the endpoint
    (through a link that outlives a dropped connection, for ``grace_s``). Returns it and the address
    the workers connect to."""
    if node.rdzv_backend == "etcd":
        store = rendezvous.open_etcd_run(node.rdzv_endpoint, node.rdzv_id, node.node_rank, timeout_s)
        return rendezvous.link(store, timeout_s, grace_s), rendezvous.etcd_address(store)
    # The store listens at its address alone (one host: loopback), never on every interface.
    if node.rdzv_endpoint is None:
        store = serve(host, 0, timeout_s)
        return store, f"{host}:{store.port}"
    ep_host, port = node.endpoint()
    if node.node_rank == 0:
        loopback = addresses.resolves_to_loopback(ep_host)
        if node.nnodes > 1 and loopback and ep_host != loopback and ep_host != "localhost":
            # The store listens where the endpoint names, alone: a host name that is loopback here
            # (Debian's own, 127.0.1.1) would take it where no other host reaches.
            raise AgentRefused(f"--rdzv-endpoint={node.rdzv_endpoint}: {ep_host!r} is {loopback} (loopback) on node 0, "
                               "where the job's store listens, and no other host could reach it: give node 0's "
                               "address on the network the hosts share (or 127.0.0.1 when every agent runs here)")
        try:
            store = serve(ep_host, port, timeout_s)
        except (RuntimeError, OSError) as exc:
            raise AgentRefused(f"--rdzv-endpoint={node.rdzv_endpoint}: node 0 cannot host the job's store there "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
        return store, node.rdzv_endpoint
    store = _reach_store(node, ep_host, port, timeout_s)
    return StoreLink(store, node.rdzv_endpoint, timeout_s, grace_s), \
        node.rdzv_endpoint


def _reach_store(node: Node, host: str, port: int, timeout_s: float) -> dist.Store:
    """Node 0's TCPStore, waited for up to ``timeout_s`` (agents start in any order), in attempts
    of a few seconds. An etcd member there (an agent on the other backend) is said at once: asked
    before the first attempt, since a TCPStore client that meets an HTTP server prints c10d's retry
    warnings with their stack frames, and after each failed one (the member may start later)."""
    deadline = time.monotonic() + timeout_s
    # A TCPStore never answers the HTTP request: this first probe costs its 0.25 s on c10d.
    _refuse_etcd_member(node, host, port, within_s=0.25)
    while True:
        left = deadline - time.monotonic()
        try:
            # client() gives the first ping as long again as the connect: both within what is left.
            return client(host, port, max(0.25, min(REACH_ATTEMPT_S, left / 2)), timeout_s)
        except (RuntimeError, OSError) as exc:  # torch raises DistStoreError (a RuntimeError) on a timeout
            _refuse_etcd_member(node, host, port, within_s=1.0)
            if time.monotonic() >= deadline - 0.5:
                raise AgentRefused(f"--rdzv-endpoint={node.rdzv_endpoint}: no job's store answered within "
                                   f"parallel.timeout_s={timeout_s:g} s ({type(exc).__name__}); is node 0's agent "
                                   "running there?") from None


def _refuse_etcd_member(node: Node, host: str, port: int, within_s: float) -> None:
    if rendezvous.is_etcd_member(host, port, within_s):
        raise AgentRefused(f"--rdzv-endpoint={node.rdzv_endpoint} is an etcd member, not a TCPStore: node 0's "
                           "agent runs --rdzv-backend etcd; give every agent the same --rdzv-backend and "
                           "--rdzv-endpoint")
