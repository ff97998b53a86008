"""Run ``tensorpar ARGS`` (or ``python -c CODE``) as a new process, forked from a server that has
imported torch and tensorpar once (``harness.forkserver``).

It runs what ``python -m tensorpar ARGS`` runs (``tools.cli.main``) in a process of its own, with
its own working directory, environment, stdout and stderr, and its exit status, without a new
interpreter's imports: on a 2-core machine they take about 5 s of each command.
``run_python_code`` does the same for the code of a ``python -c`` line. The tests of the
interpreter's entry itself (``python -m tensorpar``, ``--help`` before torch loads, the launcher's
signals and process tree) start a real interpreter instead; ``fault_env`` is the environment in
which such an interpreter injects a fault (``tests/faults``).

Example::

    done = run_tensorpar(["train", "--steps", "2"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from tests.harness import forkserver

FAULTS = Path(__file__).parent / "faults"


def fault_env(fault: str, **extra: str) -> dict:
    """This process's environment with ``TENSORPAR_FAULT=fault`` and ``tests/faults`` first on
    PYTHONPATH (its ``sitecustomize`` injects the fault in every process started with it), plus ``extra``."""
    return dict(os.environ, TENSORPAR_FAULT=fault, **extra,
                PYTHONPATH=os.pathsep.join([str(FAULTS), os.environ.get("PYTHONPATH", "")]))


def _in_process(run, cwd: str, env: dict, out_path: str, err_path: str) -> None:
    """Become the new process: its directory, environment and output files, then ``run()``'s exit status."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY)
        os.dup2(target, fd)
        os.close(target)
    try:
        code = run()
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback on stderr, status 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _tensorpar(argv: list[str]) -> int:
    sys.argv = ["tensorpar", *argv]
    from tensorpar.cli.main import main

    return main(argv)


def _python_code(code: str) -> None:
    sys.argv = ["-c"]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})


def _forked(name: list[str], run, *, cwd, env: dict | None, timeout: float,
            stdout_to: str | None = None) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out_path, err_path):
            open(path, "w").close()
        if stdout_to is not None:
            out_path = stdout_to
        process = forkserver().Process(target=_in_process, args=(run, str(cwd or os.getcwd()),
                                                                 dict(os.environ if env is None else env),
                                                                 out_path, err_path))
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(name, timeout)
        # As Python reads a path that is not UTF-8: its bytes kept as surrogate escapes.
        with open(err_path, errors="surrogateescape") as err:
            stderr = err.read()
        stdout = "" if stdout_to is not None else open(out_path, errors="surrogateescape").read()
        return subprocess.CompletedProcess(name, process.exitcode, stdout, stderr)


def run_tensorpar(argv: list[str], *, cwd=None, env: dict | None = None, timeout: float = 300,
                  stdout_to: str | None = None) -> subprocess.CompletedProcess:
    """``tensorpar *argv`` in a new process; its output as text, as ``subprocess.run(..., text=True)`` gives it.

    ``stdout_to``: a device to write stdout to instead (a terminal: ``os.ttyname`` of a pty's end),
    whose output the caller reads; the result's stdout is then empty.
    """
    argv = [str(a) for a in argv]
    return _forked(["tensorpar", *argv], functools.partial(_tensorpar, argv), cwd=cwd, env=env, timeout=timeout,
                   stdout_to=stdout_to)


def run_python_code(code: str, *, cwd=None, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -c code`` in a new process; its output as text, as :func:`run_tensorpar` gives it."""
    return _forked(["python", "-c", code], functools.partial(_python_code, code), cwd=cwd, env=env, timeout=timeout)
