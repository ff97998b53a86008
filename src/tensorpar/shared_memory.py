"""What a gloo group's ranks exchange, sent through memory they share when they share a host.

gloo carries a tensor between two processes of one host over a loopback TCP socket: the kernel
copies it twice and wakes a gloo thread at either end. Through shared memory a rank copies its
tensor once into its own slot of a segment every rank of the group maps, then raises a counter;
a peer that sees the counter raised copies what it needs out of the slot, then raises a counter
of its own to say the slot may be written again (benchmarks/gloo_collectives.py: a 512 KiB
all-reduce between 2 ranks running GEMMs took 0.55 ms, against 1.06 as gloo's all-to-all and
3.65 as gloo's own all-reduce).

:mod:`tensorpar.gloo_transport` sends its exchanges this way where :func:`channel` gives the group
one: on Linux x86-64 (whose stores reach other cores in the order they were made, which the
counters rely on), when every rank of the group maps the segment its rank 0 made (ranks of
another host, or of a container with its own ``/dev/shm``, cannot), and unless
``TENSORPAR_SHARED_MEMORY=0``. A wait polls the peers' counters with the core yielded, sleeps
once a peer is far behind, and raises when a peer's process has ended or the group's timeout
has passed.

Example::

    received = torch.empty_like(t)
    channel(group).start(t, [None, received] if group.rank() == 0 else [received, None]).wait()
"""

from __future__ import annotations

import contextlib
import datetime
import mmap
import os
import platform
import secrets
import sys
import time
import weakref

import torch
import torch.distributed as dist

__all__ = ["ENV", "SLOT_BYTES", "Channel", "channel"]

ENV = "TENSORPAR_SHARED_MEMORY"
SLOT_BYTES = 4 << 20  # per rank; what is larger goes through it a slot at a time
SPIN_SECONDS = 0.02  # then a wait sleeps between polls
_NAP_SECONDS = 2e-4
_LIVENESS_SECONDS = 1.0
_WORDS = 8  # int64 words per rank in the header: a cache line each, so a rank's raise disturbs no other's
_PUBLISHED, _RELEASED, _PID = 0, 1, 2
_DIRECTORY = "/dev/shm"

_yield_core = getattr(os, "sched_yield", lambda: time.sleep(0))
_channels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Channel:
    """One shared segment for the ranks of a group: a slot of ``SLOT_BYTES`` per rank, after a
    header of counters. Operations run in the order a rank starts them, the same on every rank
    (as a group's collectives must); starting one finishes the one before."""

    def __init__(self, memory: mmap.mmap, rank: int, size: int, timeout: datetime.timedelta):
        self._memory = memory
        self._words = memoryview(memory).cast("q")
        header = size * _WORDS * 8
        self._slots = torch.frombuffer(memory, dtype=torch.uint8, offset=header, count=size * SLOT_BYTES)
        self._slots = self._slots.view(size, SLOT_BYTES)
        self._rank, self._peers = rank, [p for p in range(size) if p != rank]
        self._timeout = timeout.total_seconds()
        self._sequence = 0
        self._pending: tuple[int, list, int, int] | None = None
        self._broken: str | None = None

    def start(self, send: torch.Tensor, into: list[torch.Tensor | None], *, block: int = 0) -> dist.Work:
        """``send`` copied into this rank's slot (it may change once this returns); the work's
        ``wait()`` copies into ``into[p]`` (contiguous), for every peer ``p``, part ``block`` of what
        ``p`` sent (its parts the size of ``into[p]``). ``into[rank]`` is not written. What is
        larger than a slot goes through it a slot at a time before this returns."""
        sent = _bytes(send.contiguous())
        targets = [None if target is None else _bytes(target) for target in into]
        for offset in range(0, max(len(sent), 1), SLOT_BYTES):
            self._finish_pending()  # the operation before, or this one's previous slot
            self._sequence += 1
            with _profiled("tensorpar::shared_memory_send"):
                self._await(_RELEASED, self._sequence - 1)  # the peers have read what this slot held
                chunk = sent[offset:offset + SLOT_BYTES]
                self._slots[self._rank, :len(chunk)].copy_(chunk)
                self._words[self._rank * _WORDS + _PUBLISHED] = self._sequence
            self._pending = (self._sequence, targets, block, offset)
        return _Read(self, self._sequence)

    def finished(self, sequence: int) -> bool:
        return self._pending is None or self._pending[0] > sequence

    def _finish_pending(self) -> None:
        """What the peers last published read (their parts of it), and this rank's reading of it
        announced."""
        if self._pending is None:
            return
        sequence, targets, block, offset = self._pending
        with _profiled("tensorpar::shared_memory_receive"):
            self._await(_PUBLISHED, sequence)
            for peer in self._peers:
                target = targets[peer]
                part = len(target)
                # Of the bytes of the peer's part, those its slot holds now.
                low, high = max(block * part, offset), min((block + 1) * part, offset + SLOT_BYTES)
                if low < high:
                    target[low - block * part:high - block * part].copy_(self._slots[peer, low - offset:high - offset])
        self._words[self._rank * _WORDS + _RELEASED] = sequence
        self._pending = None

    def _await(self, field: int, value: int) -> None:
        """Until every peer's counter ``field`` is at least ``value``."""
        for peer in self._peers:
            if self._words[peer * _WORDS + field] < value:
                self._await_peer(peer, peer * _WORDS + field, value)

    def _await_peer(self, peer: int, word: int, value: int) -> None:
        if self._broken:
            raise RuntimeError(self._broken)
        began = time.monotonic()
        checked = began
        while self._words[word] < value:
            now = time.monotonic()
            if now - began < SPIN_SECONDS:
                _yield_core()
                continue
            time.sleep(_NAP_SECONDS)
            if now - checked > _LIVENESS_SECONDS:
                checked = now
                pid = self._words[peer * _WORDS + _PID]
                if not _alive(pid):
                    self._broken = f"shared-memory collective: group rank {peer} (process {pid}) has ended"
                elif now - began > self._timeout:
                    self._broken = (f"shared-memory collective: timed out after the group's timeout "
                                    f"({self._timeout:.0f} s) waiting for group rank {peer}")
                if self._broken:
                    raise RuntimeError(self._broken)


class _Read(dist.Work):
    """The rest of an operation :meth:`Channel.start` began: reading what the peers sent."""

    def __init__(self, owner: Channel, sequence: int):
        super().__init__()
        self._owner, self._sequence = owner, sequence

    def is_completed(self) -> bool:
        return self._owner.finished(self._sequence)

    def wait(self, timeout=None) -> bool:
        if not self._owner.finished(self._sequence):
            self._owner._finish_pending()
        return True


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous ``tensor``'s memory as a flat tensor of bytes."""
    return tensor.view(-1).view(torch.uint8)


def _profiled(name: str):
    """A range named ``name`` in a profile, when a profiler records (a range costs 5 us otherwise)."""
    recording = getattr(torch.autograd.profiler, "_is_profiler_enabled", True)
    return torch.profiler.record_function(name) if recording else contextlib.nullcontext()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an ended one not yet reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _supported() -> bool:
    return (os.environ.get(ENV, "1") != "0" and sys.platform == "linux"
            and platform.machine() in ("x86_64", "AMD64") and os.path.isdir(_DIRECTORY))


def channel(group) -> Channel | None:
    """``group``'s channel, made the first time it is asked for (a collective over ``group``:
    every rank asks at the same point of its collectives), or None where its ranks cannot share
    memory (see the module's docstring) or it is on another backend than gloo."""
    group = dist.group.WORLD if group is None else group
    if group in _channels:
        return _channels[group]
    made = _open(group) if dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1 else None
    _channels[group] = made
    return made


def _timeout(group) -> datetime.timedelta:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


def _open(group) -> Channel | None:
    """The segment made by group rank 0 and mapped by every rank, or None (on every rank) if any
    rank cannot map it."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nbytes = size * (_WORDS * 8 + SLOT_BYTES)
    token = torch.tensor([secrets.randbits(62), int(_supported())], device="cpu")
    created = rank == 0 and bool(token[1]) and _create(_path(int(token[0])), nbytes)
    try:
        if rank == 0:
            token[1] = int(created)
        dist.broadcast(token, group_src=0, group=group)
        path = _path(int(token[0]))
        memory = _map(path, nbytes) if token[1] and _supported() else None
        agreed = torch.tensor([int(memory is not None)], device="cpu")
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    finally:
        if created:  # every rank that could map it has, or a peer failed: the memory lives while mapped
            os.unlink(_path(int(token[0])))
    if not agreed[0]:
        if memory is not None:
            memory.close()
        return None
    made = Channel(memory, rank, size, _timeout(group))
    made._words[rank * _WORDS + _PID] = os.getpid()
    dist.barrier(group=group)  # every rank's process id is written
    return made


def _path(token: int) -> str:
    return os.path.join(_DIRECTORY, f"tensorpar-{token:016x}")


def _create(path: str, nbytes: int) -> bool:
    """A file of ``nbytes`` at ``path``, its memory reserved (a segment beyond ``/dev/shm``'s size
    would fail only when touched, with SIGBUS): whether it could be made."""
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(descriptor, 0, nbytes)
        return True
    except OSError:
        os.unlink(path)
        return False
    finally:
        os.close(descriptor)


def _map(path: str, nbytes: int) -> mmap.mmap | None:
    try:
        descriptor = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(descriptor).st_size != nbytes:
            return None
        return mmap.mmap(descriptor, nbytes)
    except OSError:
        return None
    finally:
        os.close(descriptor)
