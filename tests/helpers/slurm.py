"""A real Slurm cluster on one machine: a controller and one ``slurmd`` per node, each node a host of
its own (a network namespace, :mod:`tests.helpers.netns`, with its own host name).

Debian's ``slurmctld``, ``slurmd`` and ``munge`` (``scripts/install_test_tools.sh``), configured by
the cluster itself in its folder: its own munge key and socket (one ``munged`` serves every node
through it: the namespaces share the file system), its own ports, ``proctrack/linuxproc`` and
``task/none`` so that no cgroup is needed, and no accounting database (``scontrol show job``
answers for a finished job for ``MinJobAge`` seconds; ``sacct`` would need ``slurmdbd``). Each node's
name resolves to its address inside every node (``/etc/netns/NAME/hosts``, which ``ip netns exec``
mounts over ``/etc/hosts``), so ``srun`` on one node and ``slurmstepd`` on another find each other
as on a cluster. Needs root; :func:`unavailable` says why not otherwise.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.helpers import netns
from tests.helpers.spawn import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel")


def unavailable() -> str | None:
    """Why no cluster can be made here (None: it can). Under CI (``CI`` set) Slurm is required, as
    etcd is: ``.ci/run`` installs it, and a skip would hide the tests."""
    reason = netns.unavailable() or shutil.which("unshare") is None and "util-linux's `unshare` is not installed"
    if reason:
        return reason
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        if os.environ.get("CI"):
            raise AssertionError(f"{missing} not installed: .ci/run runs scripts/install_test_tools.sh first")
        return f"Slurm is not installed ({', '.join(missing)} missing; sh scripts/install_test_tools.sh)"
    return None


class SlurmCluster:
    """``nodes`` compute nodes named ``n1``..``nN`` and a controller ``ctl``; ``with`` starts and
    waits for them, and on leaving stops every job, daemon and namespace it made."""

    def __init__(self, folder: Path, nodes: int = 3, slurmd_timeout_s: int = 10):
        self.folder, self.num_nodes, self.slurmd_timeout_s = Path(folder), nodes, slurmd_timeout_s
        self.hosts: list[netns.OtherHost] = []
        self.daemons: list[subprocess.Popen] = []
        self.names = [f"n{k + 1}" for k in range(nodes)]

    # -- start and stop -----------------------------------------------------------------------
    def __enter__(self) -> "SlurmCluster":
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        netns.forward()
        for k in range(self.num_nodes):
            host = netns.OtherHost(k + 1).__enter__()
            self.hosts.append(host)
        self.ctl_ip = self.hosts[0].here_peer_ip
        self.addresses = {name: h.peer_ip for name, h in zip(self.names, self.hosts)}
        lines = [f"{self.ctl_ip} ctl", *(f"{ip} {name}" for name, ip in self.addresses.items()), "127.0.0.1 localhost"]
        for h in self.hosts:
            os.makedirs(f"/etc/netns/{h.name}", exist_ok=True)
            Path(f"/etc/netns/{h.name}/hosts").write_text("\n".join(lines) + "\n")
        for sub in ("state", "log", "munge", *(f"spool/{name}" for name in self.names)):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        munge = self.folder / "munge"
        munge.chmod(0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.munge_socket = munge / "socket"
        self._daemon(["munged", "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                      f"--pid-file={munge / 'pid'}", f"--log-file={munge / 'log'}", f"--seed-file={munge / 'seed'}"],
                     "munged")
        self._wait(lambda: self.munge_socket.exists(), 10, "munged's socket")
        self.conf = self.folder / "slurm.conf"
        self.conf.write_text(self._conf(free_port(), free_port()))
        # slurmd loads a cgroup plugin whatever tracks the processes; the v1 hierarchy where this
        # machine has it, named, since its detection looks for a tmpfs there.
        (self.folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n"
                                                 "IgnoreSystemd=yes\n")
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._daemon(["unshare", "--uts", "sh", "-c", f"hostname ctl && exec slurmctld -D -f {self.conf}"], "slurmctld")
        for name, h in zip(self.names, self.hosts):
            self._daemon([*h.prefix(), "unshare", "--uts", "sh", "-c", f"hostname {name} && exec slurmd -D -f {self.conf}"],
                         f"slurmd-{name}")
        self._wait(lambda: self.idle_nodes() == set(self.names), 60, "every node idle in sinfo")

    def _conf(self, ctl_port: int, slurmd_port: int) -> str:
        f = self.folder
        nodes = "\n".join(f"NodeName={name} NodeAddr={ip} CPUs=2 State=UNKNOWN" for name, ip in self.addresses.items())
        return f"""ClusterName=elaswave
SlurmctldHost=ctl({self.ctl_ip})
SlurmctldPort={ctl_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={f / 'state'}
SlurmdSpoolDir={f / 'spool'}/%n
SlurmctldPidFile={f / 'slurmctld.pid'}
SlurmdPidFile={f / 'spool'}/slurmd-%n.pid
SlurmctldLogFile={f / 'log' / 'slurmctld.log'}
SlurmdLogFile={f / 'log'}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/linear
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout_s}
SlurmctldTimeout=10
MessageTimeout=5
InactiveLimit=0
KillWait=5
MinJobAge=600
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={f / 'jobcomp.txt'}
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def _daemon(self, cmd: list[str], name: str) -> None:
        log = open(self.folder / "log" / f"{name}.out", "w")
        self.daemons.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                             env=dict(os.environ, SLURM_CONF=str(self.folder / "slurm.conf"))))
        log.close()

    @staticmethod
    def _wait(ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"the Slurm cluster did not come up: no {what} within {timeout_s:g} s")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if getattr(self, "env", None):
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=10)
        for h in self.hosts:  # every process of every node: slurmd, its steps, the job's processes
            _kill_namespace(h.name)
        for proc in self.daemons:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
        for h in self.hosts:
            shutil.rmtree(f"/etc/netns/{h.name}", ignore_errors=True)
            h.__exit__()
        self.hosts = []
        try:
            os.rmdir("/etc/netns")  # made for the nodes' host files, if nothing else uses it
        except OSError:
            pass

    # -- asking the cluster -------------------------------------------------------------------
    def run(self, *cmd: str, timeout_s: float = 20) -> str:
        done = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
        return done.stdout

    def idle_nodes(self) -> set[str]:
        try:
            out = self.run("sinfo", "--noheader", "--Node", "--format=%N %t")
        except (AssertionError, subprocess.TimeoutExpired):
            return set()
        return {name for name, state in (line.split() for line in out.splitlines()) if state == "idle"}

    def sbatch(self, script: Path, *options: str, args: list[str] = ()) -> int:
        """Submit ``script`` with sbatch ``options`` and the script's own ``args``; the job id."""
        out = self.run("sbatch", "--parsable", *options, str(script), *args)
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, NodeList, ...)."""
        out = self.run("scontrol", "--oneliner", "show", "job", str(job_id))
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait_job(self, job_id: int, timeout_s: float) -> dict[str, str]:
        """The job once it left the running states (or as it was at ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if job["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING") or time.monotonic() > deadline:
                return job
            time.sleep(0.5)

    def kill_node(self, name: str) -> None:
        """The node dies at once, as a machine does: it falls silent (both links down), then its
        ``slurmd`` and every process on it are SIGKILLed. Killed one by one on a live link, a process
        that outlived another by a moment could say so -- srun on the first node asked Slurm to
        SIGKILL the step's tasks on every node (1 run in ~5 under load); a machine that dies says nothing."""
        host = self.hosts[self.names.index(name)]
        host.silence()
        _kill_namespace(host.name)


def _kill_namespace(name: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
