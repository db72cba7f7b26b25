"""The tests' CLI runs forked from one process that imported elaswave and torch once.

``python -m elaswave.cli ...`` spends ~1.8 s of CPU importing before it reads its arguments; the
default run starts it hundreds of times (each reference, each refused input, each one-host job).
This server, started once per test session (``spawn._run`` talks to it), forks a child per
command: its own session (``setsid``, as ``start_new_session`` gave), its own environment,
working directory and argv, stdout and stderr into files, then ``elaswave.cli.main`` -- the code
``python -m elaswave.cli`` runs, in a real process that the test can signal and kill.

Protocol (one command at a time), JSON lines on stdin: ``{"argv", "env", "cwd", "out", "err"}``;
replies on stdout: ``{"pid": PID}`` at once, then ``{"code": EXIT_CODE}`` when it has exited.
Jobs whose command runs elsewhere (another network namespace) still start as new processes.
"""
from __future__ import annotations

import json
import os
import sys


def _child(want: dict) -> None:
    code = 1
    try:
        os.setsid()
        os.chdir(want["cwd"])
        for fd, path in ((1, want["out"]), (2, want["err"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdout = sys.__stdout__  # (the server writes its own prints to stderr)
        os.environ.clear()
        os.environ.update(want["env"])
        from elaswave.forkserver import reread_cpp_log_level
        reread_cpp_log_level()
        sys.argv = ["elaswave", *want["argv"]]
        from elaswave import cli
        try:
            code = cli.main(want["argv"])
        except SystemExit as exc:  # what the interpreter would make of it
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as an uncaught exception would end the process
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)


def main() -> None:
    import elaswave.cli  # noqa: F401 - once, here: every command forks from this
    import elaswave.launch  # noqa: F401
    import elaswave.runtime.worker  # noqa: F401
    replies = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the protocol's stream
    for line in sys.stdin:
        want = json.loads(line)
        sys.stderr.flush()
        replies.flush()
        pid = os.fork()
        if pid == 0:
            _child(want)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
