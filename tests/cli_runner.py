"""Run ``tensorpar ARGS`` as a new process, forked from a server that has imported tensorpar once
(``harness.forkserver``).

It runs what ``python -m tensorpar ARGS`` runs (``tools.cli.main``) in a process of its own, with
its own working directory, environment, stdout and stderr, and its exit status, without a new
interpreter's imports: on a 2-core machine they take about 5 s of each command. The tests of the
interpreter's entry itself (``python -m tensorpar``, ``--help`` before torch loads, the launcher's
signals and process tree) start a real interpreter instead.

Example::

    done = run_tensorpar(["train", "--steps", "2"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from tests.harness import forkserver


def _command(argv: list[str], cwd: str, env: dict, out_path: str, err_path: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["tensorpar", *argv]
    from tensorpar.tools.cli import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def run_tensorpar(argv: list[str], *, cwd=None, env: dict | None = None, timeout: float = 300,
                  stdout_to: str | None = None) -> subprocess.CompletedProcess:
    """``tensorpar *argv`` in a new process; its output as text, as ``subprocess.run(..., text=True)`` gives it.

    ``stdout_to``: a device to write stdout to instead (a terminal: ``os.ttyname`` of a pty's end),
    whose output the caller reads; the result's stdout is then empty.
    """
    argv = [str(a) for a in argv]
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out_path, err_path):
            open(path, "w").close()
        if stdout_to is not None:
            out_path = stdout_to
        process = forkserver().Process(target=_command, args=(argv, str(cwd or os.getcwd()),
                                                            dict(os.environ if env is None else env),
                                                            out_path, err_path))
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(["tensorpar", *argv], timeout)
        with open(err_path) as err:
            stderr = err.read()
        stdout = "" if stdout_to is not None else open(out_path).read()
        return subprocess.CompletedProcess(["tensorpar", *argv], process.exitcode, stdout, stderr)
