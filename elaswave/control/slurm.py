"""A job's hosts from Slurm: ``srun`` one task per node, each task one ``elaswave run`` agent.

Inside a job step Slurm says everything ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint`` and
``--rdzv-id`` would: the step's node count (``SLURM_STEP_NUM_NODES``), this node's index in it
(``SLURM_NODEID``), the step's nodes (``SLURM_STEP_NODELIST``, whose first node's agent hosts the
store, at a port derived from the job id) and the job id (``SLURM_JOB_ID``). A flag given on the
command line wins over what Slurm says. The node list is expanded by Slurm's own ``scontrol show
hostnames``: its syntax (``n[1-3,7],gpu-[01-04]``) is Slurm's to define.

What keeps the job alive when a node dies is Slurm's side: ``sbatch --no-kill`` keeps the
allocation, ``srun --no-kill --kill-on-bad-exit=0`` keeps the step's other tasks running
(``examples/slurm/train.sbatch``). The agents do the rest, as on any hosts.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Mapping

from elaswave.errors import ConfigError

PORT_BASE, PORT_SPAN = 20000, 20000
"""The store's port: ``PORT_BASE + job id % PORT_SPAN`` -- the same on every node without asking,
and two jobs sharing a node take different ports unless their ids are PORT_SPAN apart."""

NEEDED = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NODEID", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS",
          "SLURM_STEP_NODELIST")


@dataclass(frozen=True)
class SlurmStep:
    """This task's place in its Slurm job step."""

    job_id: str
    nnodes: int
    node_rank: int
    nodelist: str
    """The step's nodes, in Slurm's syntax: the first one's agent hosts the job's store."""
    node_name: str

    @property
    def port(self) -> int:
        return store_port(self.job_id)

    @property
    def endpoint(self) -> str:
        return f"{first_host(self.nodelist)}:{self.port}"

    @property
    def signpost(self) -> str | None:
        """Where this node's agent says where the store is now (:mod:`signpost`): node 0's agent
        holds the store itself there."""
        return None if self.node_rank == 0 else f"{self.node_name or socket.gethostname()}:{self.port}"

    @property
    def rdzv_id(self) -> str:
        return f"slurm-{self.job_id}"


def store_port(job_id: str) -> int:
    return PORT_BASE + int(job_id) % PORT_SPAN


def in_step(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is a task of a Slurm job step (started by ``srun``)."""
    return "SLURM_STEP_ID" in env and "SLURM_JOB_ID" in env


def step(env: Mapping[str, str] = os.environ) -> SlurmStep:
    """This task's place, from the step's environment; one line naming what is missing or wrong."""
    missing = [name for name in NEEDED if not env.get(name)]
    if missing:
        raise ConfigError(f"--launcher slurm needs the environment of a Slurm job step; {', '.join(missing)} "
                          "missing: run `elaswave run` under srun, one task per node (srun --ntasks-per-node=1)")
    try:
        nnodes, tasks, node_rank = (int(env[k]) for k in ("SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS", "SLURM_NODEID"))
        int(env["SLURM_JOB_ID"])
    except ValueError:
        raise ConfigError(f"the Slurm step's SLURM_JOB_ID={env['SLURM_JOB_ID']!r}, SLURM_STEP_NUM_NODES="
                          f"{env['SLURM_STEP_NUM_NODES']!r}, SLURM_STEP_NUM_TASKS={env['SLURM_STEP_NUM_TASKS']!r} and "
                          f"SLURM_NODEID={env['SLURM_NODEID']!r} must be integers") from None
    if tasks != nnodes:
        raise ConfigError(f"srun started {tasks} tasks on {nnodes} nodes: elaswave runs one agent per node, which "
                          "starts the node's workers itself; use srun --ntasks-per-node=1")
    return SlurmStep(env["SLURM_JOB_ID"], nnodes, node_rank, env["SLURM_STEP_NODELIST"], env.get("SLURMD_NODENAME", ""))


def fill_host_flags(args, cfg) -> None:
    """Fill ``elaswave run``'s host flags that were not given from the Slurm step this agent runs
    in (``--launcher``); ``args`` is the parsed command line, ``cfg`` the job's config."""
    use = args.launcher == "slurm" or (args.launcher == "auto" and in_step()
                                       and os.environ.get("SLURM_STEP_NUM_NODES", "1") != "1")
    here = step() if use else None
    args.slurm_step, args.signpost = here, None
    if here is not None:
        wrong = [f"{flag}={given}" for flag, given, says in (("--nnodes", args.nnodes, here.nnodes),
                                                                ("--node-rank", args.node_rank, here.node_rank))
                 if given is not None and given != says]
        if wrong:
            raise ConfigError(f"{' and '.join(wrong)} disagree with the Slurm step (node {here.node_rank} of "
                              f"{here.nnodes}); leave them out, or use --launcher none")
        training = here.nnodes - args.spare_nodes
        if args.nproc_per_node is None and 0 < training and cfg.world_size % training:
            spares = f" less --spare-nodes={args.spare_nodes}" if args.spare_nodes else ""
            raise ConfigError(f"the Slurm step's {here.nnodes} nodes{spares} cannot share the job's {cfg.world_size} "
                              "ranks (parallel.dp x parallel.pp x parallel.tp) evenly: allocate a node count that "
                              "divides it, or give --nproc-per-node")
        args.rdzv_endpoint = args.rdzv_endpoint or (here.endpoint if args.rdzv_backend == "c10d" else None)
        args.rdzv_id = args.rdzv_id or here.rdzv_id
        args.signpost = here.signpost if args.rdzv_backend == "c10d" else None
    args.nnodes = args.nnodes if args.nnodes is not None else (here.nnodes if here else 1)
    args.node_rank = args.node_rank if args.node_rank is not None else (here.node_rank if here else 0)
    if args.log:  # before the first line: every line of this host's goes there
        log_to(args.log, args.node_rank)
    if here is not None:
        print(f"elaswave: Slurm job {here.job_id}: node {here.node_rank} of {here.nnodes}"
              f"{f' ({here.node_name})' if here.node_name else ''}, the job's store at {args.rdzv_endpoint}", flush=True)
    args.rdzv_id = args.rdzv_id or "elaswave"
    if args.spare_nodes and not cfg.elastic.enabled:
        raise ConfigError(f"--spare-nodes={args.spare_nodes} is invalid with elastic.enabled=false: spare hosts "
                          "join only an elastic job; set elastic.enabled=true or leave --spare-nodes out")
    if args.metrics_out:  # each host's agent its own file on a shared file system
        args.metrics_out = args.metrics_out.replace("%n", str(args.node_rank))


def log_to(pattern: str, node_rank: int, env: Mapping[str, str] = os.environ) -> str:
    """This agent's output, and its workers' (they inherit the descriptors), appended to the file
    ``pattern`` names (``%n`` the node rank, ``%N`` the Slurm node, ``%j`` the Slurm job) instead of
    srun's pipe: every task's output otherwise goes through srun on the first node, and when that
    node died a survivor's next line could end it (measured: 1 run in 8 under load, the agents on
    the other nodes gone 2 s after the first node's loss, with no word). Returns the path."""
    path = (pattern.replace("%n", str(node_rank)).replace("%N", env.get("SLURMD_NODENAME") or socket.gethostname())
            .replace("%j", env.get("SLURM_JOB_ID", "")))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        raise ConfigError(f"--log={pattern!r}: cannot write {path} ({exc.strerror})") from None
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path


def job_endpoint(job_id: str, within_s: float = 30.0) -> str:
    """The store of the elaswave job running as Slurm job ``job_id``: at its first node, or, after
    that node's loss moved it, where the other nodes' agents say it is now (:mod:`signpost`)."""
    from elaswave.control import signpost

    fields = _job(job_id, f"--slurm-job={job_id!r} is invalid: use the job's number, as sbatch printed it")
    if fields.get("JobState") != "RUNNING":
        raise ConfigError(f"--slurm-job={job_id}: the job is {fields.get('JobState')}, not RUNNING: there is no "
                          "training to join")
    hosts = hostnames(fields["NodeList"])
    found = signpost.find_store(hosts, store_port(job_id), within_s)
    if found is None:
        raise ConfigError(f"--slurm-job={job_id}: no host of the job ({', '.join(hosts)}) says where its store is "
                          f"within {within_s:g} s: is the training still running, and are those hosts reachable?")
    return found


def _job(job_id: str, bad: str) -> dict[str, str]:
    """``scontrol show job`` as a dict; one line if Slurm does not know the job."""
    if not job_id.isdigit():
        raise ConfigError(bad)
    _need_scontrol(f"finds Slurm job {job_id}'s nodes")
    done = subprocess.run(["scontrol", "--oneliner", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    fields = dict(f.split("=", 1) for f in done.stdout.split() if "=" in f)
    if done.returncode != 0 or "NodeList" not in fields:
        raise ConfigError(f"--slurm-job={job_id}: Slurm does not know it ({done.stderr.strip() or 'no such job'})")
    return fields


def end_if_batch_host_lost(job_id: str, node_name: str, grace_s: float) -> str | None:
    """After the training finished, on an agent that followed a moved store: a job whose batch host
    was lost (the node running the batch script; Slurm took it out of the allocation) would stay
    RUNNING for good -- its batch script never ends (measured: Slurm 22.05 here, 200 s after the training). The first node left
    ends it with ``scancel`` after ``grace_s`` (the other agents finish meanwhile); Slurm records
    it CANCELLED. Returns what was done, for the log (None: nothing to do here)."""
    try:
        fields = _job(job_id, "")
        nodes = hostnames(fields["NodeList"]) if fields.get("JobState") == "RUNNING" else []
    except (ConfigError, OSError, subprocess.SubprocessError):
        return None
    batch = fields.get("BatchHost", "")
    if not nodes or not batch or batch in nodes or nodes[0] != node_name:
        return None
    time.sleep(grace_s)
    # scancel signals every task of the job, this agent's own too: it is done, and exits 0.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        done = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"could not end Slurm job {job_id}, whose batch host {batch} was lost: {exc}"
    if done.returncode != 0:
        return f"could not end Slurm job {job_id}, whose batch host {batch} was lost: {done.stderr.strip()}"
    return (f"Slurm job {job_id}'s batch host {batch} was lost, so its batch script will never end: the training "
            f"finished, and this agent ended the job with scancel (Slurm records it CANCELLED)")


def _need_scontrol(what: str) -> None:
    if shutil.which("scontrol") is None:
        raise ConfigError(f"Slurm's scontrol is not on PATH (it {what}); give --rdzv-endpoint or --store HOST:PORT, "
                          "the first node's address, instead")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list."""
    return hostnames(nodelist)[0]


def hostnames(nodelist: str) -> list[str]:
    """A Slurm node list's hosts, as ``scontrol show hostnames`` expands it (a list without a range,
    ``a,b``, needs no expanding)."""
    if "[" not in nodelist:
        return nodelist.split(",")
    _need_scontrol(f"expands the node list {nodelist!r}")
    done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    names = done.stdout.split()
    if done.returncode != 0 or not names:
        raise ConfigError(f"scontrol show hostnames {nodelist!r} failed ({done.stderr.strip() or 'no host'}): give "
                          "--rdzv-endpoint=HOST:PORT (the first node's address) instead")
    return names
