"""Signals during training: SIGTERM stops every rank after the same step (with a checkpoint),
SIGINT stops this one at once.

Example::

    with Signals() as signals:
        ...
        if stop_requested(signals, control_group()):   # collective: any rank's SIGTERM
            break
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist



class Signals:
    """SIGTERM asks to stop after the current step, with a checkpoint; SIGINT stops at once
    (a ``KeyboardInterrupt``, once: later SIGINTs are ignored, also after the block).

    Handlers are installed only in the main thread (Python's rule) and restored on exit, but for
    SIGINT's once it has interrupted.
    """

    def __init__(self) -> None:
        self.term = self.interrupted = False
        self._previous = {}

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_term),
                              signal.SIGINT: signal.signal(signal.SIGINT, self._on_int)}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            # Interrupted, the process is on its way out: a Ctrl-C forwarded by a launcher, or
            # pressed again, must not raise a second KeyboardInterrupt in the middle of the exit.
            if not (signum == signal.SIGINT and self.interrupted):
                signal.signal(signum, handler)

    def _on_term(self, signum, frame) -> None:
        self.term = True

    def _on_int(self, signum, frame) -> None:
        if not self.interrupted:  # a launcher forwarding the same Ctrl-C must not interrupt the exit
            self.interrupted = True
            raise KeyboardInterrupt


def control_group():
    """The world as a CPU (gloo) group of its own, so agreeing on a flag never waits for the device
    and never queues behind the training's collectives."""
    return dist.new_group(backend="gloo")


def stop_requested(signals: Signals, group) -> bool:
    """Whether any rank got SIGTERM (agreed over ``group``): all ranks then stop after the same step."""
    flag = torch.tensor([1 if signals.term else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
