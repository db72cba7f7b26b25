"""A host of its own on one machine: a Linux network namespace joined to this one by two links.

A job's "hosts" on loopback share one network, so nothing can stand between a rank and its peers
but not its store. Here the other host lives in a network namespace with two veth links to this
one: the *store link* (its agent and workers reach the job's store over it) and the *peer link*
(gloo and the liveness ports bind to its addresses). Taking the peer link down is a partition as a
real fabric has one: packets dropped, no reset, new connects failing -- while the store link still
carries every store call. Needs root and iproute2; :func:`unavailable` says why not otherwise.
A firewall's cut (:meth:`OtherHost.refuse`, :meth:`OtherHost.drop_incoming`) needs nftables too
(``scripts/install_test_tools.sh``): :func:`firewall_unavailable`.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess

# Benchmarking addresses (RFC 2544): never a real network's. Each other host takes the lowest pair
# of 198.18.N.0/24 subnets no interface here holds, so a second process's hosts (a bench beside the
# tests) or a killed one's never share a subnet with ours: two links on one subnet send the replies
# down the wrong one, and every connect across times out.
_LOCK = "/run/elaswave-netns.lock"
_NAME = re.compile(r"ew(\d+)(h\d+)?$")


def _nets_in_use() -> set[int]:
    out = _ip("-o", "-4", "addr", "show").stdout
    return {int(n) for n in re.findall(r"inet 198\.18\.(\d+)\.\d+/", out)}


def _free_nets() -> tuple[str, str]:
    used = _nets_in_use()
    for n in range(0, 254, 2):
        if n not in used and n + 1 not in used:
            return f"198.18.{n}", f"198.18.{n + 1}"
    raise RuntimeError(f"no free pair of 198.18.N.0/24 subnets: {sorted(used)} are in use")


def _sweep_orphans() -> None:
    """Namespaces a killed process of ours left behind (its pid is gone): their links would still
    hold their subnets."""
    listed = _ip("netns", "list").stdout.split()
    for name in listed:
        match = _NAME.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _ip("netns", "del", name)


def _ip(*args: str, netns: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=10)


def unavailable() -> str | None:
    """Why no namespace can be made here (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"ewprobe{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


def firewall_unavailable() -> str | None:
    """Why no firewall cut can be made here (None: it can). Under CI (``CI`` set) nftables is
    required, as etcd is: ``.ci/run`` installs it, and a skip would hide the cut's test."""
    if unavailable() or shutil.which("nft"):
        return unavailable()
    if os.environ.get("CI"):
        raise AssertionError("nftables is not installed: .ci/run runs scripts/install_test_tools.sh first")
    return "nftables' `nft` is not installed (sh scripts/install_test_tools.sh)"


# Rules in the other host's namespace: everything but its own loopback traffic. A reset or an ICMP
# error the input chain makes goes out through the output chain, which must let it pass.
REFUSE = """table inet ewcut {
  chain input { type filter hook input priority 0; policy accept; iifname "lo" accept;
                meta l4proto tcp reject with tcp reset; reject with icmpx admin-prohibited; }
  chain output { type filter hook output priority 0; policy accept; oifname "lo" accept;
                 tcp flags & rst == rst accept; meta l4proto { icmp, ipv6-icmp } accept;
                 meta l4proto tcp reject with tcp reset; reject with icmpx admin-prohibited; }
}
"""
DROP_INCOMING = """table inet ewcut {
  chain input { type filter hook input priority 0; policy accept; iifname "lo" accept; drop; }
}
"""


def forward() -> None:
    """Let this namespace route between the other hosts (needed with two or more of them: host 1
    reaches host 2 through here, as through a switch)."""
    with open("/proc/sys/net/ipv4/ip_forward", "w") as fh:
        fh.write("1")


class OtherHost:
    """The namespace and its two links; ``with`` removes them (a namespace's veth ends go with it)."""

    def __init__(self, index: int = 1):
        """``index``: which other host (1, 2, ...), each with subnets of its own; hosts reach each
        other through this namespace (see :func:`forward`)."""
        tag = f"{os.getpid()}" + ("" if index == 1 else f"h{index}")
        self.name = f"ew{tag}"
        self._links = {"store": (f"ews{tag}", f"ews{tag}x"), "peer": (f"ewp{tag}", f"ewp{tag}x")}

    def __enter__(self) -> "OtherHost":
        self.__exit__()  # what a killed run of this process id left behind
        with open(_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process's host takes its subnets meanwhile
            _sweep_orphans()
            store_net, peer_net = _free_nets()
            self._nets = {"store": store_net, "peer": peer_net}
            self.store_ip, self.peer_ip = f"{store_net}.2", f"{peer_net}.2"
            """This host's addresses over each link."""
            self.here_store_ip, self.here_peer_ip = f"{store_net}.1", f"{peer_net}.1"
            """The addresses of this (the main) namespace's ends."""
            self._make()
        return self

    def _make(self) -> None:
        self._run("netns", "add", self.name)
        try:
            self._run("link", "set", "lo", "up", netns=self.name)
            for kind, net in self._nets.items():
                here, there = self._links[kind]
                self._run("link", "add", here, "type", "veth", "peer", "name", there)
                self._run("link", "set", there, "netns", self.name)
                self._run("addr", "add", f"{net}.1/24", "dev", here)
                self._run("addr", "add", f"{net}.2/24", "dev", there, netns=self.name)
                self._run("link", "set", here, "up")
                self._run("link", "set", there, "up", netns=self.name)
            # The other hosts' subnets through this namespace (its own are nearer: directly linked).
            self._run("route", "add", "198.18.0.0/16", "via", f"{self._nets['peer']}.1", netns=self.name)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc) -> None:
        for here, _ in self._links.values():
            _ip("link", "del", here)
        _ip("netns", "del", self.name)

    def prefix(self) -> list[str]:
        """What to put before a command to run it on this host."""
        return ["ip", "netns", "exec", self.name]

    def cut_peers(self) -> None:
        """The partition: the peer link goes down; the store link stays up."""
        self._run("link", "set", self._links["peer"][1], "down", netns=self.name)

    def silence(self) -> None:
        """The whole host cut off: both links down. Its processes live on and reach only each
        other; from outside, every packet to it is dropped and nothing is refused."""
        for _, there in self._links.values():
            self._run("link", "set", there, "down", netns=self.name)

    def refuse(self) -> None:
        """A firewall that REJECTs between this host and every other, both links: each connect
        either way is refused (a TCP reset), each open connection reset at its next packet. Its
        processes live on and reach each other -- from outside, a live host that refuses exactly
        as a dead process's kernel would."""
        self._nft(REFUSE)

    def drop_incoming(self) -> None:
        """A one-way cut, both links: every packet from another host to this one is dropped, while
        this host's packets still arrive (a request of its may land; no answer comes back)."""
        self._nft(DROP_INCOMING)

    def _nft(self, rules: str) -> None:
        done = subprocess.run([*self.prefix(), "nft", "-f", "-"], input=rules, capture_output=True, text=True,
                              timeout=10)
        if done.returncode != 0:
            raise RuntimeError(f"nft in {self.name}: {done.stderr.strip()}")

    @staticmethod
    def _run(*args: str, netns: str | None = None) -> None:
        done = _ip(*args, netns=netns)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
