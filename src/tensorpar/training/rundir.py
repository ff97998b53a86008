"""One run per output directory: an OS file lock for the run's lifetime, and no silent reuse.

``tensorpar train --out DIR`` takes an exclusive ``flock`` on ``DIR/.tensorpar.lock`` (rank 0
holds it; the kernel releases it when the process dies, ``kill -9`` included). A second run
into a locked directory is refused at once, naming the PID that holds it. A directory that
already holds a run (checkpoints, ``latest``, metrics) is refused unless the new run continues
it (``--resume``) or starts over (``--overwrite``): the old run's files are then moved aside
into ``DIR/.previous-run-N`` and removed only once the new run's first checkpoint is written.

Example::

    lock = claim("run", resume=False, overwrite=False)   # RunDirError if locked or in use
    try:
        ...                                               # train, save checkpoints
    finally:
        lock.release()
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from ..errors import UsageError

LOCK = ".tensorpar.lock"
SET_ASIDE = ".previous-run-"
# Names that mark a directory as holding a run (besides ``step_*``).
_RUN_FILES = ("latest", "metrics.jsonl", "loss.png")


class RunDirError(UsageError):
    """The output directory cannot be used by this run; the message says why and what to do."""


class RunLock:
    """An exclusive, non-blocking ``flock`` on ``out/.tensorpar.lock`` holding this PID."""

    def __init__(self, out: str | os.PathLike) -> None:
        self.out = Path(out)
        self.set_aside: Path | None = None  # where claim(overwrite=True) moved the old run
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.out.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(f"--out {self.out} is in use by another tensorpar run (PID {holder}); "
                              "wait for it to finish or choose another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        # The file stays: unlinking it would let two runs lock two different files.
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def run_entries(out: str | os.PathLike) -> list[str]:
    """The names in ``out`` that belong to a run (sorted); empty for a fresh directory."""
    out = Path(out)
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir()
                  if p.name in _RUN_FILES or p.name.startswith(("step_", SET_ASIDE)))


def _check_entries(out: str | os.PathLike, *, resume: bool, overwrite: bool) -> None:
    if resume and overwrite:
        raise RunDirError("--resume continues a run and --overwrite starts over: give one of them")
    entries = run_entries(out)
    if entries and not (resume or overwrite):
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise RunDirError(f"--out {out} already holds a run ({shown}); continue it with --resume {out} "
                          "or start over with --overwrite")


def check(out: str | os.PathLike, *, resume: bool, overwrite: bool) -> None:
    """Refuse ``out`` if another run holds it, or if it holds a run and neither flag says what to do."""
    RunLock(out).acquire().release()
    _check_entries(out, resume=resume, overwrite=overwrite)


def claim(out: str | os.PathLike, *, resume: bool, overwrite: bool) -> RunLock:
    """Lock ``out`` for this run and check it may be used; with ``overwrite``, set the old run aside."""
    lock = RunLock(out).acquire()
    try:
        _check_entries(out, resume=resume, overwrite=overwrite)
        if overwrite:
            lock.set_aside = _set_aside(Path(out))
    except BaseException:
        lock.release()
        raise
    return lock


def _set_aside(out: Path) -> Path | None:
    """Move the current run's files (not earlier set-aside runs) into ``out/.previous-run-N``."""
    entries = [name for name in run_entries(out) if not name.startswith(SET_ASIDE)]
    if not entries:
        return None
    taken = {p.name for p in out.iterdir()}
    aside = out / next(f"{SET_ASIDE}{n}" for n in range(len(taken) + 1) if f"{SET_ASIDE}{n}" not in taken)
    aside.mkdir()
    for name in entries:
        os.rename(out / name, aside / name)
    return aside


def remove_set_aside(out: str | os.PathLike) -> None:
    """Delete the runs an ``--overwrite`` set aside (call once the new run's checkpoint is written)."""
    for path in Path(out).glob(SET_ASIDE + "*"):
        shutil.rmtree(path)
