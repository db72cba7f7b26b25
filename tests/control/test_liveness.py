"""The liveness port against real processes: accepted while a process lives (stopped too),
refused once it is gone -- proof only from this machine's own kernel."""
import signal
import socket
import subprocess
import sys
import time

import pytest

from elaswave.comm.backend import listen_address
from elaswave.control import failover
from elaswave.control.addresses import is_own_address
from elaswave.control.liveness import LivenessPort, Prober, probe
from tests.helpers import netns

SERVE = """
import sys, time
from elaswave.control.liveness import LivenessPort
port = LivenessPort("127.0.0.1")
print(port.address, flush=True)
time.sleep(60)
"""


def _serve():
    proc = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_live_port_answers_and_a_closed_one_refuses():
    port = LivenessPort("127.0.0.1")
    # More probes than the backlog holds: a live port is never taken for a dead one (on a loaded
    # box a probe may time out while the drain thread waits for the GIL: "unknown", not "dead").
    assert False not in {probe(port.address) for _ in range(300)}
    time.sleep(0.5)
    assert probe(port.address) is True
    port.close()
    assert probe(port.address) is False


def test_a_stopped_process_answers_and_a_killed_one_refuses():
    proc, address = _serve()
    try:
        assert probe(address) is True
        proc.send_signal(signal.SIGSTOP)
        assert probe(address) is True  # a hang proves nothing: the heartbeat finds it
        proc.kill()
        proc.wait(timeout=10)
        assert probe(address) is False
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_refusal_from_a_port_never_reached_proves_nothing():
    # A firewall that rejects (or a sandbox, as here: 192.0.2.1 is a documentation address) refuses
    # a live rank's port too: only a port this prober has reached before can be proven dead.
    prober = Prober()
    prober._addresses[7] = "192.0.2.1:9"
    began = time.monotonic()
    assert prober.is_gone(7, None) is False
    assert time.monotonic() - began < 1.0
    port = LivenessPort("127.0.0.1")
    prober._addresses[8] = port.address
    prober.learn([8], None)
    port.close()
    assert prober.is_gone(8, None) is True


def test_a_refusal_proves_a_death_only_from_this_machines_own_kernel():
    """A closed port on loopback (or on an address of this machine) is refused by this kernel:
    proof. The same closed port on another host (a network namespace, its own kernel) is refused
    too -- exactly as a firewall's REJECT in front of a live rank would be -- and proves nothing."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    closed = socket.socket()
    closed.bind(("0.0.0.0", 0))
    port = closed.getsockname()[1]
    closed.close()
    with netns.OtherHost() as host:
        assert is_own_address("127.0.0.1") and is_own_address(host.here_peer_ip)
        assert not is_own_address(host.peer_ip)
        assert probe(f"127.0.0.1:{port}") is False and probe(f"{host.here_peer_ip}:{port}") is False
        # Nothing listens in the namespace either: its kernel resets the connect, which is no proof here.
        began = time.monotonic()
        assert probe(f"{host.peer_ip}:{port}") is None
        assert time.monotonic() - began < 0.5  # answered at once: a refusal, read as silence
        assert failover.reach(f"{host.peer_ip}:{port}") == "silent"
        assert failover.reach(f"127.0.0.1:{port}") == "refused"
        # Where a standby of this host listens for a job whose store is over there: this host's
        # address on that route (not the host name's, which may be loopback here).
        assert listen_address(None, f"{host.store_ip}:{port}") == host.here_store_ip
        assert listen_address(None, f"etcd://{host.peer_ip}:2379,{host.store_ip}:2379/p/") == host.here_peer_ip
        assert listen_address("127.0.0.1", f"{host.store_ip}:{port}") == "127.0.0.1"
