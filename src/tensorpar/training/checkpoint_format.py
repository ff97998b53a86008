"""What every checkpoint module shares: the names of a checkpoint's files, :class:`CheckpointError`
and how all ranks come to the same verdict on one, the plain-path rule, the files' hash.

A checkpoint is ``OUT/step_N/`` (DCP's files, :data:`CONFIG`, :data:`META`, :data:`MANIFEST`,
optionally the run's :data:`TOKENIZER`); ``OUT/latest`` names the newest complete one.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path, PurePosixPath

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import UsageError

LATEST = "latest"
MANIFEST = "manifest.json"
CONFIG = "config.json"
META = "meta.json"
DCP_METADATA = ".metadata"
TOKENIZER = "tokenizer"  # the run's Hugging Face tokenizer, copied into each checkpoint
STEP_DIR = re.compile(r"^step_(\d+)$")
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message says which and why."""


class CheckpointRefused(CheckpointError):
    """A checkpoint whose files are refused on load (corrupt, crafted, or of another model): bad
    input, so the command exits 2 like for any other."""

    exit_code = 2


def on_rank0(fn) -> object:
    """Run ``fn`` on global rank 0 and raise its error (if any) on every rank."""
    outcome = [None, None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            outcome[1] = describe(exc)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise CheckpointError(outcome[1])
    return outcome[0]


def agree(error: BaseException | None) -> None:
    """Every rank's verdict combined: raise the first rank's error on every rank, if any; a
    :class:`CheckpointError` (a refusal of the files) as :class:`CheckpointRefused`."""
    verdict = None if error is None else (describe(error), isinstance(error, CheckpointError))
    verdicts = [verdict]
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, verdict)
    for verdict in verdicts:
        if verdict is not None:
            message, refused = verdict
            raise (CheckpointRefused if refused else CheckpointError)(message)


def describe(exc: BaseException) -> str:
    """One line for ``exc``; for DCP's CheckpointException, the first failing rank's own error."""
    if isinstance(exc, CheckpointException):
        rank, (cause, _) = min(exc.failures.items())
        return f"rank {rank}: {describe(cause)}"
    if isinstance(exc, (CheckpointError, UsageError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def sha256(path: Path) -> str:
    """The SHA-256 of a file, as the manifest records it (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def config_fingerprint(config: dict) -> str:
    """The SHA-256 of a checkpoint's ``config.json`` contents (keys sorted), which ``meta.json``
    records as ``config_sha256``."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def check_relative(ckpt: Path, name: object, where: str) -> str:
    """``name`` if it is a plain relative path inside the checkpoint, else refused."""
    plain = (isinstance(name, str) and name and "\\" not in name and "\0" not in name
             and not PurePosixPath(name).is_absolute() and PurePosixPath(name).as_posix() == name
             and all(part not in ("", ".", "..") for part in name.split("/")))
    if not plain:
        raise CheckpointError(f"checkpoint {ckpt}: {where} names the path {name!r}; only plain paths "
                              "inside the checkpoint are allowed (no absolute paths, no '..')")
    return name
