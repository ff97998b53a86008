"""Start a job on N local processes through torch's elastic launcher (what ``torchrun`` uses).

Every process gets torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), so
``torch.distributed.init_process_group()`` and :func:`tensorpar.initialize_model_parallel`
find their world without arguments. Used by ``tensorpar train/generate/export --nproc N``,
``tensorpar comm --measure`` and ``tensorpar bench``.

Example::

    results = launch_local(my_entry, config, nproc=2)     # {0: ..., 1: ...}
"""

from __future__ import annotations

import os
import socket
import uuid

import torch


class LaunchError(RuntimeError):
    """A rank of a local launch failed; the message names the rank and why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_threads() -> None:
    """``OMP_NUM_THREADS`` if set, else the cores shared evenly among this node's processes."""
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def launch_local(entry, *args, nproc: int) -> dict[int, object]:
    """Run ``entry(*args)`` on ``nproc`` local processes; returns ``{rank: entry's result}``.

    ``entry`` and ``args`` must be picklable (a module-level function). With one process the
    entry runs here, in this process.
    """
    if nproc == 1:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        set_threads()
        return {0: entry(*args)}
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                          monitor_interval=0.2)
    try:
        return elastic_launch(config, _elastic_entry)(entry, *args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        message = failure.message if isinstance(failure.message, str) and failure.message \
            else f"exit code {failure.exitcode}"
        raise LaunchError(f"rank {rank} failed: {message}") from None


def _elastic_entry(entry, *args):
    from torch.distributed.elastic.multiprocessing.errors import record

    set_threads()
    return record(entry)(*args)
