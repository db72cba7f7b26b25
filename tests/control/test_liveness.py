"""The liveness port against real processes: accepted while a process lives (stopped too),
refused once it is gone."""
import signal
import subprocess
import sys
import time

from elaswave.control.liveness import LivenessPort, Prober, probe

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
