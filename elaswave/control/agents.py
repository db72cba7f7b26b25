"""Per-host agents of one job: where each host's ranks sit, and the settings every agent must share.

With ``elaswave run --nnodes N --node-rank K --rdzv-endpoint HOST:PORT`` (torchrun's flag names)
one agent runs per host. The agent of node 0 hosts the job's TCPStore at the endpoint; the others
connect to it. Each starts its host's workers under ranks ``K * nproc_per_node + i`` and watches
only those: a worker's death is reported and costs one rank, never the host's other workers (the
thing torchrun's agent cannot do: it tears the whole host down).

Before any worker starts, an agent that does not host the store checks in: it claims its node
rank (two agents with one rank would start two processes per rank) and compares its settings
with node 0's -- job id, node count, workers per host, the whole job config but the address its
ranks bind to (``parallel.bind_address``: each host's own). The token is never stored: an agent
with another token cannot open the job's record (:mod:`elaswave.control.seal`), and the settings
are sealed. A difference refuses the agent naming the value.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass

from elaswave.control.etcd import parse_endpoints
from elaswave.control import sequence
from elaswave.control.membership import PREFIX
from elaswave.control.seal import sealed
from elaswave.errors import ConfigError

NODES_ENV = "ELASWAVE_NNODES"
"""Set in each worker an agent starts: the job's number of hosts."""
NODE_RANK_ENV = "ELASWAVE_NODE_RANK"
"""Set in each worker an agent starts: its host's node rank."""
SETTINGS = PREFIX + "agents/settings"
FINISHED = PREFIX + "agents/finished"


def host_name(node_rank: int | None = None) -> str:
    """This process's host, as the job names its hosts (``ew/host/<rank>``): its agent's node rank
    (``elaswave run --node-rank``, passed to workers as ELASWAVE_NODE_RANK; torchrun's GROUP_RANK),
    else the machine's name. Refusals prove deaths only between ranks of one host."""
    node = node_rank if node_rank is not None else os.environ.get(NODE_RANK_ENV) or os.environ.get("GROUP_RANK")
    if node is None:
        return socket.gethostname()
    slurm = os.environ.get("SLURMD_NODENAME")  # the name an operator knows the host by
    return f"node {node}" + (f" ({slurm})" if slurm else "")


class AgentRefused(ConfigError):
    """This agent's settings disagree with the job's, or its node rank is taken; says which."""


BACKENDS = ("c10d", "etcd")
"""Where the job's control store is (torchrun's --rdzv-backend names): see elaswave.control.rendezvous."""


@dataclass(frozen=True)
class Node:
    """This host's place in the job, in torchrun's terms. The default is the whole job on one host."""

    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int | None = None
    """Workers on each host; None: the job's ranks divided evenly over the hosts."""
    rdzv_endpoint: str | None = None
    """c10d: HOST:PORT of the job's store, which node 0's agent hosts; None on one host (any free
    port). etcd: the cluster's members, HOST:PORT[,HOST:PORT...]."""
    rdzv_id: str = "elaswave"
    rdzv_backend: str = "c10d"
    """c10d: torch's TCPStore, held by node 0's agent; etcd: an etcd cluster (a majority decides)."""
    spare_nodes: int = 0
    """Hosts that start no founding rank (the last ``spare_nodes`` node ranks): their workers, warm,
    ask in as spares, and the job admits them only while it is below its size (a host was lost)."""
    signpost: str | None = None
    """HOST:PORT where this agent tells joiners where the job's store is now (under Slurm, the
    store's port on its own node: :mod:`elaswave.control.signpost`); None: nowhere."""

    @property
    def is_multi_host(self) -> bool:
        return self.nnodes > 1 or (self.rdzv_endpoint is not None and self.rdzv_backend == "c10d")

    @property
    def training_nodes(self) -> int:
        return self.nnodes - self.spare_nodes

    @property
    def is_spare(self) -> bool:
        return self.node_rank >= self.training_nodes

    def workers(self, world_size: int) -> int:
        """Workers on each host: a spare host stands by with as many as a training host runs."""
        return self.nproc_per_node if self.nproc_per_node is not None else world_size // max(1, self.training_nodes)

    def founding_ranks(self, world_size: int) -> range:
        n = self.workers(world_size)
        return range(0) if self.is_spare else range(self.node_rank * n, (self.node_rank + 1) * n)

    def endpoint(self) -> tuple[str, int]:
        host, port = self.rdzv_endpoint.rsplit(":", 1)
        return host.strip("[]"), int(port)

    def validate(self, world_size: int, token: str | None) -> None:
        """One-line errors for a node that cannot take part; run before anything starts."""
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes={self.nnodes} is invalid: a job needs at least 1 host")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank={self.node_rank} is invalid: with --nnodes={self.nnodes} it is "
                              f"0..{self.nnodes - 1}")
        if self.rdzv_backend not in BACKENDS:
            raise ConfigError(f"--rdzv-backend={self.rdzv_backend!r} is invalid: use one of {', '.join(BACKENDS)}")
        if self.rdzv_backend == "etcd":
            if not self.rdzv_endpoint:
                raise ConfigError("--rdzv-backend=etcd needs --rdzv-endpoint=HOST:PORT[,HOST:PORT...]: the etcd "
                                  "cluster's members")
            parse_endpoints(self.rdzv_endpoint)
        elif self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(f"--nnodes={self.nnodes} needs --rdzv-endpoint=HOST:PORT: where node 0's agent "
                              f"hosts the job's store")
        elif self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--rdzv-endpoint={self.rdzv_endpoint!r} is invalid: use HOST:PORT with a port "
                                  f"in 1..65535")
        if not 0 <= self.spare_nodes < self.nnodes:
            raise ConfigError(f"--spare-nodes={self.spare_nodes} is invalid with --nnodes={self.nnodes}: use "
                              f"0..{self.nnodes - 1} (at least one host trains)")
        nodes, spare = self.training_nodes, f" less --spare-nodes={self.spare_nodes}" if self.spare_nodes else ""
        if self.nproc_per_node is None and world_size % nodes:
            raise ConfigError(f"--nnodes={self.nnodes}{spare} is invalid: the job's {world_size} ranks do not divide "
                              f"evenly over {nodes} hosts; give --nproc-per-node")
        if self.nproc_per_node is not None and (self.nproc_per_node < 1 or self.nproc_per_node * nodes != world_size):
            raise ConfigError(f"--nnodes={self.nnodes}{spare} x --nproc-per-node={self.nproc_per_node} = "
                              f"{nodes * (self.nproc_per_node or 0)} ranks is invalid: parallel.dp x "
                              f"parallel.pp x parallel.tp needs {world_size}")
        if self.nnodes > 1 and not token:
            raise ConfigError("ELASWAVE_TOKEN is not set: with --nnodes > 1 every host's agent needs the same "
                              "secret, so that only this job's replacements join it")


PER_HOST = ("bind_address",)
"""``parallel`` keys that name this host, not the job: each agent has its own."""


def _settings(node: Node, world_size: int, config: dict) -> dict:
    config = {**config, "parallel": {k: v for k, v in config.get("parallel", {}).items() if k not in PER_HOST}}
    return {"job id (--rdzv-id)": node.rdzv_id, "--nnodes": node.nnodes, "--spare-nodes": node.spare_nodes,
            "--nproc-per-node": node.workers(world_size), "config": config}


def _flat(doc: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def publish(store, node: Node, world_size: int, config: dict) -> None:
    """Node 0: the settings every other agent must match."""
    store.set(SETTINGS, json.dumps(_settings(node, world_size, config)))


def check_in(store, node: Node, world_size: int, config: dict) -> None:
    """Any other node: claim the node rank and match node 0's settings (``store`` waits for them
    within its own timeout)."""
    theirs = _flat(json.loads(store.get(SETTINGS)))
    ours = _flat(json.loads(json.dumps(_settings(node, world_size, config))))  # tuples read back as lists
    for key in sorted(ours.keys() | theirs.keys()):
        if ours.get(key) != theirs.get(key):
            shown = f"is {ours.get(key, '(unset)')!r} here and {theirs.get(key, '(unset)')!r} on node 0"
            raise AgentRefused(f"{key.removeprefix('config.')} {shown}: every agent of a job must be started "
                               f"with the same settings")
    mine = sequence.unique(f"node {node.node_rank}")  # a claim, sealed: no count says it is taken
    if bytes(store.compare_set(f"{PREFIX}agents/node/{node.node_rank}", "", mine)) != mine.encode():
        raise AgentRefused(f"--node-rank={node.node_rank} is taken: another agent of this job has it")


def finished(store, node_rank: int) -> None:
    """An agent whose workers are done says so: node 0 keeps the store up until every agent has
    (and, after the store moved, the member holding it: :mod:`~elaswave.control.failover`)."""
    store.set(f"{FINISHED}/{node_rank}", "1")


def has_finished(store, node_rank: int) -> bool:
    return sealed(store).read(f"{FINISHED}/{node_rank}") is not None


def wait_for_others(store, node: Node, grace_s: float) -> int:
    """Node 0, at the end: wait up to ``grace_s`` for the other agents; returns how many did not
    say they finished (a host lost whole never will)."""
    deadline = time.monotonic() + grace_s
    while True:
        missing = [n for n in range(1, node.nnodes) if not has_finished(store, n)]
        if not missing or time.monotonic() > deadline:
            return len(missing)
        time.sleep(0.05)
