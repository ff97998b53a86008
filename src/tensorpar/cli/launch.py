"""Start a job on N local processes through torch's elastic launcher (what ``torchrun`` uses).

Every process gets torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), so
``torch.distributed.init_process_group()`` and :func:`tensorpar.initialize_model_parallel`
find their world without arguments. Used by ``tensorpar train/generate/export --nproc N``,
``tensorpar comm --measure`` and ``tensorpar bench``.

Example::

    results = launch_local(my_entry, config, nproc=2)     # {0: ..., 1: ...}
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import gc
import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from ..errors import UsageError, debug_enabled
from .errors import exit_code, one_line
from .terminal import keep_os_bytes


PEER_FAILURE_GRACE_S = 2.0
# How long a rank whose entry returned waits for the launcher to take its result and let it go
# before leaving by itself (a launcher stopping on a signal never does: :func:`_elastic_entry`).
RELEASE_GRACE_S = 10.0
START_METHOD_ENV = "TENSORPAR_START_METHOD"
START_METHODS = ("fork", "forkserver", "spawn")
# What torch elastic sets in each rank (besides its TORCHELASTIC_* variables).
_ELASTIC_VARIABLES = {"LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                      "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


class LaunchError(RuntimeError):
    """A rank of a local launch failed: its own one-line message and rank.

    ``exit_code`` is the rank's (2: bad input, 1: anything else); ``traceback`` is the rank's
    traceback, when it recorded one.
    """

    def __init__(self, message: str, *, rank: int, exit_code: int = 1, traceback: str | None = None):
        super().__init__(f"{message} (rank {rank})")
        self.rank, self.exit_code, self.traceback = rank, exit_code, traceback


class OneLineErrorHandler(ErrorHandler):
    """torch elastic's error file, with :func:`.errors.one_line` as the message.

    A rank records the exception it dies of in the file ``TORCHELASTIC_ERROR_FILE`` names (set by
    ``torchrun`` and by :func:`launch_local`) through torch's ``record`` with this handler; the
    launcher reads it back, so the command the user ran prints the line. ``message`` is a string
    (a layout torch's launchers read), so ``torchrun``'s failure summary shows that line rather
    than a traceback. Under ``tensorpar``: ``time`` (sub-second; an exception's ``failed_at``
    where it has one) orders failures of ranks that died within the same second, ``exit_code`` is :func:`.errors.exit_code`,
    ``traceback`` is for ``--debug``.
    """

    def initialize(self) -> None:
        # torch's enables faulthandler and warns where stderr is no file (a captured stream).
        with contextlib.suppress(Exception):
            faulthandler.enable(all_threads=True)

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        now = getattr(e, "failed_at", None) or time.time()
        data = {"message": one_line(e), "timestamp": int(now),
                "tensorpar": {"time": now, "exit_code": exit_code(e),
                              "traceback": "".join(traceback.format_exception(e))}}
        try:
            with open(path, "w") as f:
                json.dump(data, f)
        except OSError:
            pass  # the message still reaches stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_threads() -> None:
    """This process's intra-op threads: ``OMP_NUM_THREADS`` if set, else its share of the CPUs it
    may run on (its affinity mask, not the machine's count), shared evenly among this node's
    processes (``LOCAL_WORLD_SIZE``)."""
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
        return
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, allowed // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def start_method() -> str:
    """How :func:`launch_local` starts its ranks: ``TENSORPAR_START_METHOD`` if set, else
    ``forkserver`` where the platform has it (a fresh single-threaded server imports torch and the
    entry's module once, and each rank is forked from it: no rank inherits a launcher's threads
    or a CUDA context) and ``spawn`` elsewhere. ``fork`` is an explicit opt-in only.
    """
    chosen = os.environ.get(START_METHOD_ENV)
    if chosen is not None:
        if chosen not in START_METHODS:
            raise UsageError(f"{START_METHOD_ENV} must be one of {', '.join(START_METHODS)}, got {chosen!r}")
        return chosen
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def one_process_main(argv, *, description: str, add_arguments, run, report) -> dict:
    """A one-process benchmark's ``main``: its flags (``add_arguments``) parsed from ``argv``,
    ``run(args)`` on one launched rank, ``report(result)`` printed; returns the result."""
    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser)
    result = launch_local(run, parser.parse_args(argv), nproc=1)[0]
    print(report(result), flush=True)
    return result


def launch_local(entry, *args, nproc: int) -> dict[int, object]:
    """Run ``entry(*args)`` on ``nproc`` local processes; returns ``{rank: entry's result}``.

    ``entry`` and ``args`` must be picklable (a module-level function). With one process the
    entry runs here, in this process, and its exceptions propagate unchanged. With more, the
    first rank to raise ends the others (SIGTERM, within a second) and its exception becomes a
    :class:`LaunchError` carrying its message, read from torch elastic's error files.
    """
    if torch.cuda.is_available():
        # Inherited by every rank, so it is set before any of them initialises CUDA: with one
        # hardware queue the async dgrad communication is queued ahead of the wgrad GEMM.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if nproc == 1:
        # The rank joins this store as a client (torch elastic's agent store), not one of its own.
        store, port = loopback_store(world_size=1)
        with _environment(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True"):
            set_threads()
            result = {0: entry(*args)}
        del store
        return result
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    method = start_method()
    if method == "forkserver":
        # The server imports these once, every rank it forks has them already; started before the
        # launch's own temporary folder, which would otherwise hold its socket until removed.
        multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", entry.__module__])
        _start_forkserver_deaf_to_sigterm()
    user_tempdir = tempfile.gettempdir()
    with _launch_files() as files, _quiet_launcher(), _frozen_heap(method == "fork"):
        rendezvous_handler_registry.register(LOOPBACK_RENDEZVOUS, _loopback_rendezvous)
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                              rdzv_backend=LOOPBACK_RENDEZVOUS, rdzv_endpoint="", max_restarts=0,
                              monitor_interval=0.2, start_method=method,
                              logs_specs=DefaultLogsSpecs(log_dir=files))
        try:
            return elastic_launch(config, _elastic_entry)(user_tempdir, dict(os.environ), entry, *args)
        except ChildFailedError as exc:
            raise _first_failure(exc) from None


LOOPBACK_RENDEZVOUS = "tensorpar-loopback"


def loopback_store(*, world_size: int, timeout: datetime.timedelta = datetime.timedelta(minutes=10)):
    """``(store, port)``: a ``TCPStore`` server listening on 127.0.0.1 only (handed a bound
    socket: on its own a ``TCPStore`` listens on every interface)."""
    from torch.distributed import TCPStore

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    return TCPStore("127.0.0.1", port, world_size, True, timeout, multi_tenant=True,
                    master_listen_fd=listener.detach()), port


def _loopback_rendezvous(params):
    """The rendezvous of a local launch: torch elastic's static one of one node, whose store
    (the ranks' too: ``MASTER_ADDR``/``MASTER_PORT``) is a :func:`loopback_store`."""
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class LoopbackRendezvous(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return LOOPBACK_RENDEZVOUS

        def next_rendezvous(self):
            if self._store is None:
                self._store, self.master_port = loopback_store(world_size=self.world_size, timeout=self.timeout)
            return super().next_rendezvous()

    return LoopbackRendezvous("127.0.0.1", 0, 0, 1, params.run_id, 600)


def _start_forkserver_deaf_to_sigterm() -> None:
    """Start the server the ranks fork from, ignoring SIGTERM (inherited across its exec). A job
    stopped as a whole (``kill -- -PGID``, Slurm) sends SIGTERM to the server too; dead, it could
    no longer report its ranks' exits, so the launcher would take saving ranks for gone. The
    server ends with the launcher; each rank takes SIGTERM again (:func:`_elastic_entry`)."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _launch_files():
    """A directory for the launch's files (torch elastic's per-rank folders and error files, the
    ranks' PID notes), removed with its contents when the launch ends. Left to themselves, torch
    elastic keeps a ``torchelastic_*`` folder and, for each rank it ends, torch.multiprocessing an
    error pickle in the system's temporary directory, after every run. torch.multiprocessing
    names its error files in this process's temporary directory, so that is the folder during
    the launch; each rank sets its own back (:func:`_elastic_entry`)."""
    with tempfile.TemporaryDirectory(prefix="tensorpar-launch-", ignore_cleanup_errors=True) as path:
        saved, tempfile.tempdir = tempfile.tempdir, path
        try:
            yield path
        finally:
            tempfile.tempdir = saved


@contextlib.contextmanager
def _frozen_heap(forking: bool):
    """While forked ranks start: this process's objects out of the garbage collector's reach in
    them (``gc.freeze``). A child's collector would otherwise walk every object it inherited,
    including ones another thread of this process (the launcher's store and monitor) was
    changing at the fork: a forked rank crashed with SIGSEGV in its first collection."""
    if not forking:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _environment(**variables: str):
    """Set environment variables for the block; afterwards this process is no rank of a world."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _quiet_launcher():
    """Silence the launcher's own logging (it repeats each failure with tracebacks) unless debugging."""
    if debug_enabled():
        yield
        return
    # Each of torch elastic's module loggers has its own level (utils/logging.py), which a parent's
    # level does not override: every one is silenced, not only the package's.
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    names = [name for name in list(logging.Logger.manager.loggerDict) if name.startswith(prefixes)]
    loggers = [logging.getLogger(name) for name in {*prefixes, *names}]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _read_error_file(path: Path) -> dict | None:
    """An error file written by :class:`OneLineErrorHandler`, if ``path`` is one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("tensorpar"), dict):
        return None
    return data


def _first_failure(exc) -> LaunchError:
    """The rank that failed first, with its own message.

    torch reports the first rank it saw exit. When that rank recorded an exception, a peer may
    have recorded one earlier (its exit made this one's collectives fail): the error files'
    times decide. A rank that recorded nothing (killed by a signal) is reported as such.
    """
    rank, failure = exc.get_first_failure()
    path = Path(failure.error_file)
    if _read_error_file(path) is None:
        if failure.exitcode < 0:
            return LaunchError(f"killed by signal {failure.signal_name()}", rank=rank)
        return LaunchError(f"exited with code {failure.exitcode} without an error message", rank=rank,
                           exit_code=failure.exitcode or 1)
    # One node: each local rank's error file is <attempt dir>/<local rank>/error.json.
    recorded = [(float(data["tensorpar"].get("time", 0)), int(other.parent.name), data)
                for other in path.parent.parent.glob("*/error.json") if other.parent.name.isdigit()
                for data in [_read_error_file(other)] if data is not None]
    _, rank, data = min(recorded, key=lambda entry: entry[:2])
    info = data["tensorpar"]
    return LaunchError(str(data["message"]), rank=rank, exit_code=int(info.get("exit_code", 1)),
                       traceback=info.get("traceback"))


class PeerStopped(RuntimeError):
    """A collective timed out because a peer's process is stopped (SIGSTOP), not busy or gone."""


def _pid_file() -> Path | None:
    """Where this rank notes its rank and PID: beside its elastic error file, one folder per local rank."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    return Path(error_file).with_name("rank_pid") if error_file else None


def _stopped_peers() -> dict[int, int]:
    """{rank: pid} of this node's other ranks whose process is stopped (state T in Linux's /proc)."""
    own = _pid_file()
    stopped = {}
    for note in own.parent.parent.glob("*/rank_pid") if own else ():
        try:
            rank, pid = (int(word) for word in note.read_text().split())
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(") ")[2].split()[0]
        except (OSError, ValueError, IndexError):
            continue  # not written yet, gone, or no /proc
        if pid != os.getpid() and state == "T":
            stopped[rank] = pid
    return stopped


def _run_rank(entry, *args):
    """``entry(*args)``; a collective timeout caused by a stopped peer is reported as that.

    The stopped peer is then continued, so that it meets the failure and exits: the launcher
    could not end it (a stopped process ignores SIGTERM until continued).
    """
    keep_os_bytes(sys.stdout, sys.stderr)
    try:
        return entry(*args)
    except Exception as exc:
        stopped = _stopped_peers() if "timed out" in str(exc).lower() else {}
        if not stopped:
            raise
        ranks = ", ".join(f"rank {rank} (pid {pid})" for rank, pid in sorted(stopped.items()))
        failure = PeerStopped(f"{ranks} stopped responding: its process was stopped (SIGSTOP); a collective "
                              "timed out waiting for it")
        # Dated now: the continued peer fails at once (this rank's timeout closed its connection)
        # and may record its error before this one is written.
        failure.failed_at = time.time()
        for pid in stopped.values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        raise failure from exc


def _interrupt_once(signum, frame) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher forwards the same Ctrl-C again
    raise KeyboardInterrupt


def _leave(code: int) -> None:
    """Exit at once, without a traceback on the console (torch's own wrapper would print one):
    finalizing torch and gloo objects takes seconds under load, and the launcher only ends the
    other ranks once this process is gone."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _elastic_entry(user_tempdir: str, environment: dict[str, str], entry, *args):
    """One rank of :func:`launch_local`. A Ctrl-C (SIGINT reaches every process of the terminal's
    group) exits 130 without a word: the launcher, which got it too, says it once.

    ``user_tempdir`` is the temporary directory the rank's code sees: a forked rank would inherit
    the launch's own folder, removed at its end (with, say, inductor's compile cache in it).
    ``environment`` is the launcher's at the launch: a rank forked from a server started earlier
    has the server's, to which torch elastic adds only its own variables."""
    own = {name: value for name, value in os.environ.items()
           if name in _ELASTIC_VARIABLES or name.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update({**environment, **own})
    tempfile.tempdir = user_tempdir
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the forkserver's SIG_IGN, inherited
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        result = _recorded_entry(entry, *args)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _leave(130)
    # torch's wrapper now queues the result and waits until the launcher has every rank's. A
    # launcher sent SIGTERM with its ranks (Slurm, ``kill -- -PGID``) is closing instead: it
    # waits 30 s for ranks that are saving their checkpoint and then waiting on it, then kills
    # them. A result queued in time is read even after its rank is gone.
    release = threading.Timer(RELEASE_GRACE_S, _leave, (0,))
    release.daemon = True
    release.start()
    return result


def _recorded_entry(entry, *args):
    from torch.distributed.elastic.multiprocessing.errors import record

    set_threads()
    note = _pid_file()
    if note is not None:
        with contextlib.suppress(OSError):
            note.write_text(f"{os.environ['RANK']} {os.getpid()}")
    try:
        return record(_run_rank, error_handler=OneLineErrorHandler())(entry, *args)
    except Exception as exc:  # noqa: BLE001 - recorded above, for the launcher to report
        if _lost_a_peer(exc):
            # Most likely a peer died first without recording anything (a signal, the OOM
            # killer): give the launcher time to see that death, the cause, before this one.
            time.sleep(PEER_FAILURE_GRACE_S)
        _leave(exit_code(exc))


def _lost_a_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank went away."""
    if isinstance(exc, torch.distributed.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("Connection reset", "Connection closed", "Broken pipe", "gloo", "NCCL",
                                      "shared-memory collective"))
