"""Workers forked from a process that imported torch once, instead of each importing it again.

A new Python process spends about 1.8 s of CPU importing torch and elaswave before it does
anything; a 4-rank job pays that four times at start, and every replacement or spare pays it
again while the job waits for it to join. The launcher (which imported torch for its store)
forks a *fork server* before it starts any thread or opens any socket; the server imports the
worker's modules and, for each worker, forks a child that runs the worker's entry point with its
own environment -- in milliseconds, the same code, a real process of its own.

The child is forked twice, so that it is the launcher's child, not the server's (the launcher is
a child subreaper: ``prctl(PR_SET_CHILD_SUBREAPER)``): the launcher waits on it, reads its exit
status and signals it exactly as it did a ``subprocess.Popen``. Its name (``/proc/PID/comm``,
what ``top`` shows) is ``ew-rank-N``: a forked process's ``/proc/PID/environ`` is its parent's.

Where forking is not safe or not possible -- not Linux, threads already running in the caller
(the Python API inside a program), a CUDA context already made in it, ``ELASWAVE_FORKSERVER=0``
-- workers start as new processes, as before. The server exits when the launcher closes it or
dies (its request pipe ends).
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

DISABLE_ENV = "ELASWAVE_FORKSERVER"
SERVER_NAME = "ew-forkserver"
_PR_SET_NAME, _PR_SET_CHILD_SUBREAPER = 15, 36


def rank_name(rank: int) -> str:
    return f"ew-rank-{rank}"


def _prctl(option: int, arg) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _set_name(name: str) -> None:
    _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


class Forked:
    """A worker forked by the server: ``subprocess.Popen``'s ``pid``, ``returncode``, ``poll``,
    ``wait``, ``send_signal``, ``terminate`` and ``kill``, on a child this process reaps."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost, not its death
                self.returncode = 1
                return self.returncode
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Starter:
    """Starts the launcher's workers: forked by the server when :func:`open_starter` could start
    one, otherwise as new processes (``python -m elaswave.runtime.worker ARGS``)."""

    def __init__(self):
        self._pid = None
        self._requests = self._replies = None

    def start(self, args: list[str], env: dict[str, str], rank: int):
        if self._requests is None:
            return _new_process(args, env)
        try:
            self._requests.write(json.dumps({"args": args, "env": env, "rank": rank}) + "\n")
            self._requests.flush()
            line = self._replies.readline()
        except (OSError, ValueError):
            line = ""
        if not line.strip().isdigit():  # the server is gone: new processes from here on
            self.close()
            return _new_process(args, env)
        return Forked(int(line))

    def close(self) -> None:
        for f in (self._requests, self._replies):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        self._requests = self._replies = None
        if self._pid is not None:
            try:
                os.waitpid(self._pid, 0)  # it exits at the end of its requests
            except ChildProcessError:
                pass
            self._pid = None
            _prctl(_PR_SET_CHILD_SUBREAPER, 0)


def _new_process(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "elaswave.runtime.worker", *args], env=env)


def open_starter() -> Starter:
    """A :class:`Starter`; with a fork server when this process may fork one now (call it before
    any thread, socket or device context exists)."""
    starter = Starter()
    torch = sys.modules.get("torch")
    cuda_up = torch is not None and torch.cuda.is_initialized()  # a forked child cannot use it again
    if (os.environ.get(DISABLE_ENV) == "0" or not sys.platform.startswith("linux") or cuda_up
            or threading.active_count() > 1 or not _prctl(_PR_SET_CHILD_SUBREAPER, 1)):
        return starter
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    sys.stdout.flush()  # (a forked buffer would be written again by every worker)
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(req_w)
        os.close(rep_r)
        code = 1
        try:
            _serve(req_r, rep_w)
            code = 0
        finally:
            os._exit(code)
    os.close(req_r)
    os.close(rep_w)
    starter._pid = pid
    starter._requests, starter._replies = os.fdopen(req_w, "w"), os.fdopen(rep_r, "r")
    return starter


def _serve(req_fd: int, rep_fd: int) -> None:
    """The server: one worker per request line, until the launcher closes the pipe (or dies)."""
    _set_name(SERVER_NAME)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    import elaswave.runtime.worker  # noqa: F401 - imported once here, forked into every worker
    requests = os.fdopen(req_fd, "r")
    for line in requests:
        want = json.loads(line)
        got_r, got_w = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(got_r)
            child = os.fork()
            if child == 0:
                os.close(got_w)
                os.close(rep_fd)
                requests.close()
                _run_worker(want["args"], want["env"], want["rank"])
            os.write(got_w, str(child).encode())
            os._exit(0)
        os.close(got_w)
        with os.fdopen(got_r, "rb") as got:
            child = got.read().decode()
        os.waitpid(middle, 0)  # the worker is the launcher's child from here (a subreaper)
        os.write(rep_fd, f"{child}\n".encode())


def reread_cpp_log_level() -> None:
    """torch's C++ log level (``TORCH_CPP_LOG_LEVEL``) is read once, when torch loads: read it
    again from the worker's own environment (its store waits time out by design, and c10d would
    warn of each). Without the symbol (another torch), the server's level stays."""
    try:
        import torch
        libc10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        getattr(libc10, "_ZN3c1011initLoggingEv")()
    except (OSError, AttributeError):
        pass


def _run_worker(args: list[str], env: dict[str, str], rank: int) -> None:
    code = 1
    try:
        _set_name(rank_name(rank))
        os.environ.clear()
        os.environ.update(env)
        reread_cpp_log_level()
        sys.argv = ["elaswave-worker", *args]
        from elaswave.runtime import worker
        code = worker.main(args)  # (it ends the process itself)
    except BaseException:  # noqa: BLE001 - what a new process would have printed (ELASWAVE_DEBUG=1)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
