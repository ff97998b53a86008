"""One run per output directory: an OS file lock for the run's lifetime, and no silent reuse.

``tensorpar train --out DIR`` takes an exclusive ``flock`` on ``DIR/.tensorpar.lock`` (rank 0
holds it; the kernel releases it when the process dies, ``kill -9`` included). A second run
into a locked directory is refused at once, naming the PID that holds it. A directory that
already holds a run (checkpoints, ``latest``, metrics) is refused unless the new run continues
it (``--resume``) or starts over (``--overwrite``): the old run's files are then moved aside
into ``DIR/.previous-run-N`` and removed only once the new run's first checkpoint is written.
Resuming from a checkpoint older than ones already in ``DIR`` is refused unless ``--overwrite``
says to set the newer ones aside the same way.

Files tensorpar writes in ``DIR`` are opened without following symlinks, and a link or other
non-regular entry under one of their names is refused before the run starts. On a file system
without ``flock`` (Lustre's default mounts) the lock falls back to ``lockf``, else a warning.

Example::

    lock = claim("run", resume=False, overwrite=False)   # RunDirError if locked or in use
    try:
        ...                                               # train, save checkpoints
    finally:
        lock.release()
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import stat
import sys
from pathlib import Path

from ..errors import UsageError

LOCK = ".tensorpar.lock"
SET_ASIDE = ".previous-run-"
# Names that mark a directory as holding a run (besides ``step_*``).
_RUN_FILES = ("latest", "metrics.jsonl", "loss.png")
# Every other name tensorpar writes in ``out``: directories, then files (``step_*`` are directories).
_WRITTEN_DIRS = ("tensorboard",)
_WRITTEN_FILES = (LOCK, "latest.tmp", ".metrics.jsonl.tmp", ".loss.png.tmp", "config.toml", ".config.toml.tmp")
_STEP = re.compile(r"^step_(\d+)$")
# errno values of a file system that has no (flock) locks.
_NO_LOCKS = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK}


class RunDirError(UsageError):
    """The output directory cannot be used by this run; the message says why and what to do."""


def _refuse_link(path: Path, *, directory: bool = False) -> None:
    kind = "directory" if directory else "regular file"
    if os.path.islink(path):
        raise RunDirError(f"{path} is a symlink; tensorpar never writes through links in a run directory: "
                          "remove it")
    raise RunDirError(f"{path} is not a {kind}; tensorpar writes its own {kind} there: remove it")


def open_regular(path: str | os.PathLike, flags: int) -> int:
    """``os.open(path, flags)`` that refuses (:class:`RunDirError`) a symlink or any non-regular file.

    Example: ``fd = open_regular(out / "metrics.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)``
    """
    try:
        # O_NONBLOCK: a planted FIFO must be refused, not block the open.
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            _refuse_link(Path(path))
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        _refuse_link(Path(path))
    return fd


def check_dir(path: str | os.PathLike) -> None:
    """Refuse ``path`` if it exists as anything but a real directory (a symlink to one included)."""
    if os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
        _refuse_link(Path(path), directory=True)


def check_written_names(out: str | os.PathLike) -> None:
    """Refuse a symlink or wrong kind of entry under any name tensorpar writes in ``out``."""
    out = Path(out)
    if not out.is_dir():
        return
    for entry in out.iterdir():
        name = entry.name
        if name in _WRITTEN_DIRS or _STEP.match(name.removesuffix(".tmp").removesuffix(".old")):
            check_dir(entry)
        elif name in _RUN_FILES + _WRITTEN_FILES and (os.path.islink(entry) or not entry.is_file()):
            _refuse_link(entry)


def _warn(message: str) -> None:
    print(f"tensorpar: {message}", file=sys.stderr, flush=True)


class RunLock:
    """An exclusive, non-blocking ``flock`` on ``out/.tensorpar.lock`` holding this PID."""

    def __init__(self, out: str | os.PathLike) -> None:
        self.out = Path(out)
        self.set_aside: Path | None = None  # where claim(overwrite=True) moved the old run
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.out.mkdir(parents=True, exist_ok=True)
        fd = open_regular(self.out / LOCK, os.O_RDWR | os.O_CREAT)
        if not self._lock(fd):
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(f"--out {self.out} is in use by another tensorpar run (PID {holder}); "
                              "wait for it to finish or choose another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def _lock(self, fd: int) -> bool:
        """Lock ``fd``: False if another process holds it; True, after a warning, if nothing can lock it."""
        reasons = []
        for name in ("flock", "lockf"):
            try:
                getattr(fcntl, name)(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except (BlockingIOError, PermissionError):  # lockf says EACCES or EAGAIN
                return False
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    raise
                reasons.append(f"{name}: {exc.strerror}")
        _warn(f"--out {self.out}: the file system cannot lock {LOCK} ({'; '.join(reasons)}); continuing "
              "unlocked: make sure no other run uses this --out at the same time")
        return True

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


def interrupted_start(out: str | os.PathLike) -> bool:
    """Whether ``out`` holds a run stopped before its first checkpoint: its files, but no
    ``latest`` and no ``step_N`` (nothing to resume; a new run takes it over)."""
    entries = [name for name in run_entries(out) if not name.startswith(SET_ASIDE)]
    return bool(entries) and not any(name == "latest" or name.startswith("step_") for name in entries)


def _newer_steps(out: Path, resume_from: Path | None) -> list[str]:
    """The ``step_N`` entries of ``out`` past the checkpoint resumed from, oldest first."""
    match = _STEP.match(resume_from.name) if resume_from is not None else None
    if match is None or not out.is_dir():
        return []
    steps = [(int(m[1]), p.name) for p in out.iterdir() if (m := _STEP.match(p.name))]
    return [name for step, name in sorted(steps) if step > int(match[1])]


def _check_entries(out: str | os.PathLike, *, resume: bool, overwrite: bool, resume_from: Path | None) -> None:
    check_written_names(out)
    entries = run_entries(out)
    if resume_from is not None and entries and Path(out).resolve() != resume_from.resolve().parent:
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise RunDirError(f"--out {out} holds another run ({shown}) than --resume {resume_from} continues: give "
                          f"--out {resume_from.parent} to continue there, or an --out that holds no run")
    newer = _newer_steps(Path(out), resume_from)
    if resume and overwrite and not newer:
        raise RunDirError(f"--resume continues a run and --overwrite starts over: give one of them (with "
                          f"--resume, --overwrite only sets aside checkpoints newer than the resumed one, and "
                          f"--out {out} holds none)")
    if newer and not overwrite:
        shown = ", ".join(newer[:3]) + (", ..." if len(newer) > 3 else "")
        raise RunDirError(f"--out {out} holds checkpoints newer than --resume {resume_from} ({shown}), which "
                          "this run would replace: pass --overwrite to set them aside (removed once this run's "
                          "first checkpoint is written), or choose another --out")
    if entries and not (resume or overwrite or interrupted_start(out)):
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise RunDirError(f"--out {out} already holds a run ({shown}); continue it with --resume {out} "
                          "or start over with --overwrite")


def check(out: str | os.PathLike, *, resume: bool, overwrite: bool, resume_from: Path | None = None) -> None:
    """Refuse ``out`` if another run holds it, if it holds a run and neither flag says what to do,
    or if it holds checkpoints newer than ``resume_from`` (the step directory resumed) without ``overwrite``."""
    RunLock(out).acquire().release()
    _check_entries(out, resume=resume, overwrite=overwrite, resume_from=resume_from)


def claim(out: str | os.PathLike, *, resume: bool, overwrite: bool, resume_from: Path | None = None) -> RunLock:
    """Lock ``out`` for this run and check it may be used (see :func:`check`); with ``overwrite``, or
    over an :func:`interrupted_start`, set the old run aside (with ``resume``: the checkpoints newer
    than ``resume_from``, and ``latest``)."""
    lock = RunLock(out).acquire()
    out = Path(out)
    try:
        _check_entries(out, resume=resume, overwrite=overwrite, resume_from=resume_from)
        if overwrite and resume:
            lock.set_aside = _set_aside(out, _newer_steps(out, resume_from))
            if (out / resume_from.name).resolve() == resume_from.resolve():
                write_file(out / "latest.tmp", f"{resume_from.name}\n".encode())
                os.replace(out / "latest.tmp", out / "latest")
            elif os.path.lexists(out / "latest"):
                os.rename(out / "latest", lock.set_aside / "latest")
        elif overwrite or (not resume and interrupted_start(out)):
            lock.set_aside = _set_aside(out, [n for n in run_entries(out) if not n.startswith(SET_ASIDE)])
    except BaseException:
        lock.release()
        raise
    return lock


def _set_aside(out: Path, entries: list[str]) -> Path | None:
    """Move ``entries`` of ``out`` (the current run's files) into ``out/.previous-run-N``."""
    if not entries:
        return None
    taken = {p.name for p in out.iterdir()}
    aside = out / next(f"{SET_ASIDE}{n}" for n in range(len(taken) + 1) if f"{SET_ASIDE}{n}" not in taken)
    aside.mkdir()
    for name in entries:
        os.rename(out / name, aside / name)
    return aside


def write_file(path: str | os.PathLike, data: bytes) -> None:
    """Write ``path`` whole and fsync it, never through a symlink (see :func:`open_regular`)."""
    with os.fdopen(open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` by a whole new file: written beside it as ``.NAME.tmp``, then renamed over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    write_file(tmp, data)
    os.replace(tmp, path)


def remove_set_aside(out: str | os.PathLike) -> None:
    """Delete the runs an ``--overwrite`` set aside (call once the new run's checkpoint is written)."""
    for path in Path(out).glob(SET_ASIDE + "*"):
        shutil.rmtree(path)
