"""Run a test body on N gloo ranks, keeping each world alive for the whole session.

``run_on_ranks(fn, world_size, *args)`` calls the module-level function ``fn(*args)`` on every
rank of a persistent world of ``world_size`` processes (default process group already
initialized, one thread each) and returns the list of per-rank results. A rank's exception
becomes the test failure with that rank's traceback; a body that does not finish within
``timeout`` seconds fails the test and the world is replaced, so nothing hangs CI.

``run_in_fresh_world`` does the same in a throwaway world, for bodies that break their process
group on purpose (timeouts, crashed peers). Between bodies a rank tears down the model-parallel
state and resets what a body may leave set (:func:`_reset_rank_state`).

Ranks are forked from one server process that imported torch and tensorpar once
(:func:`forkserver`; ``tests/cli_runner.py`` starts its commands from the same server), so a new
world starts in a fraction of a second instead of each rank importing torch anew.

Timeouts: a body gets ``TENSORPAR_TEST_TIMEOUT`` seconds (120) and a collective
``TENSORPAR_COLLECTIVE_TIMEOUT`` (30), each multiplied by the load factor: the machine's load
average per core when the last world started, from 1 to ``MAX_LOAD_FACTOR``, or
``TENSORPAR_TEST_LOAD_FACTOR`` when set. So a loaded machine gives slow passes, not timeouts.
The ranks ignore SIGINT: a Ctrl-C reaches pytest alone, which ends every world and stops. A rank
whose pytest process is gone without ending it (killed, or interrupted again while it closed its
worlds) exits within a second (:func:`_exit_with_owner`), so no rank outlives the suite.

A world whose ranks hold more than ``MAX_TRANSPORT_THREADS`` gloo transport threads is replaced
after the body that left them: torch keeps some destroyed groups alive (those an FSDP or DTensor
body used), each with a thread that wakes many times a second, and dozens of them in every idle
world of a session took whole cores from the tests that ran (the full suite: 1,692 s, 1,134 s without them).
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback

DEFAULT_TIMEOUT = float(os.environ.get("TENSORPAR_TEST_TIMEOUT", "120"))
COLLECTIVE_TIMEOUT_S = float(os.environ.get("TENSORPAR_COLLECTIVE_TIMEOUT", "30"))
MAX_LOAD_FACTOR = 10.0
STARTUP_TIMEOUT_S = 600.0
MAX_TRANSPORT_THREADS = 4
# What the server imports before it forks: the harness, what a tensorpar command loads before its
# ranks start, the plotting a run's rank 0 loads at its first evaluation (2 s of every process
# that plots, otherwise; a missing optional package is skipped), pytest, which each rank imports
# with the first test module whose body it runs (0.2 s of CPU per rank otherwise), transformers, the
# compiler modules a rank that compiles a graph loads (1.9 s of CPU in each otherwise), and last
# what freezes all of it out of the ranks' garbage collections.
PRELOAD = ["tests.harness", "tensorpar.cli.main", "tensorpar.cli.training_cli", "tensorpar.training.loop",
           "tensorpar.models.hf", "matplotlib.figure", "matplotlib.backends.backend_agg", "PIL.PngImagePlugin",
           "pytest", "tests.hf_preload", "torch._functorch.aot_autograd", "torch._inductor.compile_fx",
           "torch._inductor.pattern_matcher", "torch.distributed.tensor.experimental",
           "tests.freeze_preloaded"]
_load_factor = float(os.environ.get("TENSORPAR_TEST_LOAD_FACTOR", "1"))


def forkserver():
    """The multiprocessing context whose processes fork from the server that preloaded ``PRELOAD``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _measured_load_factor(load_average: float, cores: int) -> float:
    if "TENSORPAR_TEST_LOAD_FACTOR" in os.environ:
        return float(os.environ["TENSORPAR_TEST_LOAD_FACTOR"])
    return min(MAX_LOAD_FACTOR, max(1.0, load_average / max(1, cores)))


def _transport_threads() -> int:
    """This process's gloo transport threads (one per live gloo device); 0 where /proc is absent."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == "gloo_tcp_loop"
        except OSError:
            pass  # a thread that ended meanwhile
    return count


def _reset_rank_state() -> None:
    """What a body may leave set in its rank, back to what the next body expects: torch's default
    dtype and device, grad mode, deterministic algorithms and one intra-op thread; tensorpar's
    active ledgers, global memory buffer, RNG tracker and the MoE balance losses' scale; compiled
    graphs (dynamo's caches)."""
    import sys

    import torch

    from tensorpar.distributed import comm_ledger
    from tensorpar.expert_parallel import set_aux_loss_scale
    from tensorpar.tensor_parallel.buffers import get_global_memory_buffer
    from tensorpar.tensor_parallel.random import get_rng_tracker

    torch.set_default_dtype(torch.float32)
    torch.set_default_device(None)
    torch.set_grad_enabled(True)
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(1)
    comm_ledger._ACTIVE_LEDGERS.clear()
    get_global_memory_buffer().clear()
    get_rng_tracker().reset()
    set_aux_loss_scale(1.0)
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


def _exit_with_owner(owner_pid: int) -> None:
    """Watch from a daemon thread for the process that started this rank, and end the rank once it
    is gone: a rank busy in a body (a hung collective, a long sleep) would otherwise outlive it."""
    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(owner_pid, 0)
            except ProcessLookupError:
                os._exit(1)

    threading.Thread(target=watch, name="owner-watch", daemon=True).start()


def _worker(rank: int, world_size: int, port: int, owner_pid: int, tasks, results) -> None:
    import datetime

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _exit_with_owner(owner_pid)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    import tensorpar

    results.put((rank, "started", None, 0))
    pg_timeout = tasks.get()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    while True:
        task = tasks.get()
        if task is None:
            break
        module_name, fn_name, args = task
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
            outcome = (rank, True, fn(*args))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            outcome = (rank, False, traceback.format_exc())
        # Tear down before reporting, so the next body never meets a peer still cleaning up.
        if tensorpar.model_parallel_is_initialized():
            tensorpar.destroy_model_parallel()
        _reset_rank_state()
        results.put((*outcome, _transport_threads()))
    dist.destroy_process_group()


class World:
    """``world_size`` forked ranks; ``pg_timeout`` is scaled by the machine's load when they start."""

    def __init__(self, world_size: int, pg_timeout: float = COLLECTIVE_TIMEOUT_S) -> None:
        global _load_factor
        ctx = forkserver()
        self.world_size = world_size
        self.stale = False
        self.results = ctx.Queue()
        self.task_queues = [ctx.Queue() for _ in range(world_size)]
        from tensorpar.cli.launch import free_port  # here: a process that starts no world never imports torch

        port = free_port()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, world_size, port, os.getpid(), self.task_queues[r], self.results))
                      for r in range(world_size)]
        try:
            for p in self.procs:
                p.start()
            for _ in range(world_size):
                self.results.get(timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        _load_factor = _measured_load_factor(os.getloadavg()[0], os.cpu_count() or 1)
        for q in self.task_queues:
            q.put(pg_timeout * _load_factor)

    def run(self, fn, args, timeout: float) -> list:
        timeout *= _load_factor
        try:
            return self._run(fn, args, timeout)
        except KeyboardInterrupt:
            self.close(grace=0.0)  # the ranks are mid-task: a user who pressed Ctrl-C waits for nothing
            raise

    def _run(self, fn, args, timeout: float) -> list:
        for q in self.task_queues:
            q.put((fn.__module__, fn.__name__, args))
        outcomes: dict[int, tuple[bool, object]] = {}
        failure_seen = False
        while len(outcomes) < self.world_size:
            # Once a rank has failed, the others are likely stuck in a collective with it.
            wait = 15.0 * _load_factor if failure_seen else timeout
            try:
                rank, ok, value, threads = self.results.get(timeout=wait)
            except queue.Empty:
                self.close()
                missing = sorted(set(range(self.world_size)) - set(outcomes))
                errors = _format_failures(outcomes)
                raise AssertionError(f"{fn.__name__} on {self.world_size} ranks: ranks {missing} did not "
                                     f"finish within {wait:.0f}s (hung collective?)\n{errors}")
            outcomes[rank] = (ok, value)
            self.stale |= threads > MAX_TRANSPORT_THREADS
            failure_seen |= not ok
        if failure_seen:
            # Surviving ranks may have left collectives half-done: never reuse this world.
            self.close()
            raise AssertionError(f"{fn.__name__} failed on {self.world_size} ranks:\n"
                                 + _format_failures(outcomes))
        return [outcomes[r][1] for r in range(self.world_size)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, grace: float = 5.0) -> None:
        """Ask each rank to finish, wait up to ``grace`` seconds, then kill those still running."""
        for q, p in zip(self.task_queues, self.procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []


def _format_failures(outcomes) -> str:
    return "\n".join(f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok)


_WORLDS: dict[int, World] = {}


def run_on_ranks(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT) -> list:
    world = _WORLDS.get(world_size)
    if world is None or not world.alive():
        world = _WORLDS[world_size] = World(world_size)
    try:
        return world.run(fn, args, timeout)
    except (AssertionError, KeyboardInterrupt):
        _WORLDS.pop(world_size, None)
        raise
    finally:
        if world.stale:
            world.close()
            _WORLDS.pop(world_size, None)


def run_in_fresh_world(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT,
                       pg_timeout: float = COLLECTIVE_TIMEOUT_S) -> list:
    world = World(world_size, pg_timeout=pg_timeout)
    try:
        return world.run(fn, args, timeout)
    finally:
        world.close()


@atexit.register
def _close_worlds() -> None:
    for world in _WORLDS.values():
        world.close()
    _WORLDS.clear()
