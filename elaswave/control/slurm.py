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
import subprocess
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
    def endpoint(self) -> str:
        return f"{first_host(self.nodelist)}:{PORT_BASE + int(self.job_id) % PORT_SPAN}"

    @property
    def rdzv_id(self) -> str:
        return f"slurm-{self.job_id}"


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


def job_endpoint(job_id: str) -> str:
    """The store of the elaswave job running as Slurm job ``job_id`` (its first node's agent holds
    it, unless it moved: then the joiner is told there is nobody there)."""
    if not job_id.isdigit():
        raise ConfigError(f"--slurm-job={job_id!r} is invalid: use the job's number, as sbatch printed it")
    _need_scontrol(f"finds Slurm job {job_id}'s nodes")
    done = subprocess.run(["scontrol", "--oneliner", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    fields = dict(f.split("=", 1) for f in done.stdout.split() if "=" in f)
    if done.returncode != 0 or "NodeList" not in fields:
        raise ConfigError(f"--slurm-job={job_id}: Slurm does not know it ({done.stderr.strip() or 'no such job'})")
    if fields.get("JobState") != "RUNNING":
        raise ConfigError(f"--slurm-job={job_id}: the job is {fields.get('JobState')}, not RUNNING: there is no "
                          "training to join")
    return f"{first_host(fields['NodeList'])}:{PORT_BASE + int(job_id) % PORT_SPAN}"


def _need_scontrol(what: str) -> None:
    if shutil.which("scontrol") is None:
        raise ConfigError(f"Slurm's scontrol is not on PATH (it {what}); give --rdzv-endpoint or --store HOST:PORT, "
                          "the first node's address, instead")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list, as ``scontrol show hostnames`` expands it (a list
    without a range, ``a,b``, needs no expanding)."""
    if "[" not in nodelist:
        return nodelist.split(",")[0]
    _need_scontrol(f"expands the node list {nodelist!r}")
    done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    names = done.stdout.split()
    if done.returncode != 0 or not names:
        raise ConfigError(f"scontrol show hostnames {nodelist!r} failed ({done.stderr.strip() or 'no host'}): give "
                          "--rdzv-endpoint=HOST:PORT (the first node's address) instead")
    return names[0]
