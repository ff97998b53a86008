"""Checkpoints that survive a change of TP and DP size, written atomically and verified on load.

Layout of ``OUT/step_N/``: ``torch.distributed.checkpoint`` (DCP) files holding the model, the
optimizer state and every rank's RNG states (all tensors); ``config.json`` (the model config),
``meta.json`` (step, schedule, data position, parallel sizes, the RNG entries each rank saved)
and ``manifest.json`` (size and SHA-256 of every other file). ``OUT/latest`` names the newest
complete checkpoint.

TP-independent layout: every TP-sharded tensor (a parameter and its optimizer moments) is
saved as a DTensor over the TP group whose global shape is what the TP=1 model holds, so DCP
records each rank's chunk offsets and no rank ever materialises a full tensor. A weight with
``partition_stride`` k (fused Q|K|V, gate|up) is k blocks each split over TP; it is stored
viewed as ``[k, rows/k, ...]``, which makes every rank's strided shard one box of that view
while keeping the TP=1 element order. Loading at another TP size asks DCP for the new boxes.
A parameter of an uneven layout (``partition_rows``: heads, K/V heads or FFN rows TP does not
divide) is stored whole in the same global shape, gathered at save and sharded after load.
The vocabulary's padding depends on TP (a multiple of lcm(make_vocab_size_divisible_by, TP)):
loading at a TP size that pads it otherwise reads the saved rows whole and keeps the real ones.

Atomicity: DCP writes into ``step_N.tmp``; rank 0 adds the JSON files, renames the directory
to ``step_N`` and only then replaces ``latest`` (itself via rename). A save killed at any
point leaves the previous checkpoint and ``latest`` untouched; a save that fails removes its
``.tmp`` directory and says why. :func:`remove_old` keeps only a run's newest checkpoints
(``--keep-last``), removing nothing the run did not write and never the one ``latest`` names.

Trust: nothing read from a checkpoint is executed. Before a byte of tensor data is read, every
rank checks that the files on disk are exactly those of the manifest (no symlinks, no paths
outside the directory), the ranks hash their shares of the files against it
(:mod:`.checkpoint_files`), and every rank validates DCP's whole ``.metadata`` (read by an
unpickler that admits only DCP's metadata classes) against the exact state dict expected, every
rank's RNG entries included: key set, tensor kind, dtype and global shape (:mod:`.dcp_metadata`).
DCP's pickled "bytes" entries are refused outright. The state dict itself is built by
:mod:`.checkpoint_state`.

Example::

    path = save("run", 100, model=model, optimizer=opt, config=cfg, meta=meta, tp_group=tp_group)
    ckpt, config, meta = checkpoint_files.open_checkpoint("run")   # through ``latest``, verified
    load(ckpt, model=model, optimizer=opt, tp_group=tp_group, restore_rng=True)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ..distributed import comm
from ..data_parallel.fsdp import scatter_dp_shard
from .checkpoint_files import latest_step_dir, read_json, read_manifest
from .checkpoint_format import (CONFIG, LATEST, MANIFEST, META, CheckpointError, agree, config_fingerprint,
                                describe, on_rank0, sha256)
from .checkpoint_state import build_state_dict, init_adam_state, param_targets, rng_spec, set_rng_state, unstore
from .checkpoint_layout import layout_problem, shard_dims
from .dcp_metadata import expected_entries, mismatch, read_metadata, storage_problem
from .rundir import check_dir, write_file


def _write_json(path: Path, data: dict) -> None:
    write_file(path, json.dumps(data, indent=1, sort_keys=True).encode())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- saving -------------------------------------------------------------------------------

def _prepare_tmp(tmp: Path, final: Path) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    check_dir(tmp)
    check_dir(final)
    if tmp.exists():  # left by a save that was killed
        shutil.rmtree(tmp)
    tmp.mkdir()


def _finalize(tmp: Path, final: Path, config: dict, meta: dict, write_extra) -> None:
    if write_extra is not None:
        write_extra(tmp)
    _write_json(tmp / CONFIG, config)
    _write_json(tmp / META, meta)
    files = {p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(tmp.rglob("*")) if p.is_file()}
    _write_json(tmp / MANIFEST, {"format": "tensorpar-checkpoint", "files": files})
    _fsync_dir(tmp)
    # Everything that needs disk space is written before the first rename.
    pointer = final.parent / (LATEST + ".tmp")
    write_file(pointer, f"{final.name}\n".encode())
    if final.exists():  # the same step saved again (after a resume): replace it
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    os.replace(pointer, final.parent / LATEST)
    _fsync_dir(final.parent)


def _stored_bytes(state: dict) -> int:
    """The tensor bytes a save of ``state`` writes, all ranks together: each entry once (DCP
    writes a replicated entry once; a DTensor's ``numel`` is its global size), and every rank's
    own RNG states."""
    ranks = dist.get_world_size()
    return sum(value.numel() * value.element_size() * (ranks if key.startswith("rng.") else 1)
               for key, value in state.items())


def _refuse(problem: str | None) -> None:
    if problem is not None:
        raise CheckpointError(problem)


def _no_space(out: Path, need: int) -> str | None:
    """Why a save of ``need`` tensor bytes cannot fit in ``out``'s file system, or None."""
    free = shutil.disk_usage(out).free
    if free >= need:
        return None
    return f"No space left on device: its tensors need {need:,} bytes, the file system of {out} has {free:,} free"


def _discard(tmp: Path) -> None:
    """Remove what a failed save wrote: its ``.tmp`` directory and the ``latest.tmp`` pointer."""
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp.parent / (LATEST + ".tmp")).unlink(missing_ok=True)


def save(out: str | os.PathLike, step: int, *, model, optimizer, config: dict, meta: dict,
         tp_group, write_extra=None, ep_group=None) -> Path:
    """Write ``out/step_{step}`` on every rank collectively; returns its path. ``write_extra(dir)``,
    if given, adds files to the checkpoint directory on rank 0 (covered by the manifest).

    On failure (any rank, any error, DCP's own included) every rank raises
    :class:`CheckpointError` naming the cause, and nothing of this save is left on disk.
    """
    out = Path(out)
    final, tmp = out / f"step_{step}", out / f"step_{step}.tmp"
    on_rank0(lambda: _prepare_tmp(tmp, final))
    state, _, _ = build_state_dict(model, optimizer, tp_group=tp_group, with_rng=True, ep_group=ep_group)
    meta = {**meta, "ranks": dist.get_world_size(), "rng": rng_spec(), "config_sha256": config_fingerprint(config)}
    need = _stored_bytes(state)
    try:
        on_rank0(lambda: _refuse(_no_space(out, need)))
        dcp.save(state, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True))
        on_rank0(lambda: _finalize(tmp, final, config, meta, write_extra))
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        cause = describe(exc)
        # A write cut short by a full disk can surface as an error of torch's file format: the
        # space is judged before rank 0 removes what was written.
        full = _no_space(out, need) if "No space left on device" not in cause else None
        if full is not None:
            cause = f"{full} ({cause})"
        if dist.get_rank() == 0:
            _discard(tmp)
        try:
            previous = latest_step_dir(out)
        except CheckpointError:
            previous = None
        kept = f"; the previous checkpoint {previous} is intact" if previous else ""
        raise CheckpointError(f"saving checkpoint step {step} to {out} failed: {cause}{kept}") from exc
    return final


def remove_old(out: str | os.PathLike, written: list[str], *, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` of ``written`` (this run's step directories, oldest
    first); returns the names still kept. Call on rank 0 after a save.

    Only what this run wrote goes, and only a complete checkpoint (a real directory holding its
    manifest, never through a symlink); the one ``latest`` names stays whatever ``keep`` says.
    ``keep`` 0 keeps all. Each goes by a rename to ``step_N.old`` first, so that a deletion cut
    short never leaves a ``step_N`` that looks like a checkpoint and is not one.

    Example: ``written = remove_old("run", written + ["step_300"], keep=3)``
    """
    if keep <= 0 or len(written) <= keep:
        return written
    out = Path(out)
    latest = latest_step_dir(out)
    remaining = []
    for name in written[:-keep]:
        path = out / name
        if latest is not None and latest.name == name:
            remaining.append(name)  # removable once another is latest
            continue
        if path.is_symlink() or not path.is_dir() or (path / MANIFEST).is_symlink() \
                or not (path / MANIFEST).is_file():
            continue  # replaced by something else since: not this run's to remove
        old = out / f"{name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        shutil.rmtree(old)
    return remaining + written[-keep:]


# --- loading ------------------------------------------------------------------------------

class _ValidatedReader(FileSystemReader):
    """DCP's file reader, handing DCP the metadata already read and validated (never the file)."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner without its bytes path (which unpickles with ``weights_only=False``)."""

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn} is not a tensor; refusing it")


def _other_padding(state: dict, expected: dict, stored: dict, model, optimizer) -> list:
    """Vocabulary rows padded to another size by the saving TP size (parameters marked with
    ``unpadded_rows``, the real vocabulary): each such entry is loaded whole at its stored
    shape, and its real rows are copied into this rank's shard afterwards.

    Returns ``(loaded, target, real rows)`` for each; updates ``state`` and ``expected``.
    """
    repadded = []
    for name, p in model.named_parameters():
        real = getattr(p, "unpadded_rows", None)
        if real is None:
            continue
        for key, target in param_targets(name, p, optimizer).items():
            entry, (dtype, shape) = stored.get(key), expected[key]
            if not isinstance(entry, TensorStorageMetadata):
                continue
            size = list(entry.size)
            # Anything but other padding of the same real rows is left for mismatch to name.
            if size == shape or len(size) != len(shape) or size[1:] != shape[1:] or size[0] < real:
                continue
            if isinstance(target, DTensor):
                raise CheckpointError(f"{key} is padded to {size[0]} rows in the checkpoint and {shape[0]} here "
                                      "(another TP size pads the vocabulary otherwise), which a model under FSDP "
                                      "cannot load: resume without --fsdp, or at the saving TP size")
            expected[key] = (dtype, size)
            state[key] = torch.empty(size, dtype=dtype, device=target.device)
            repadded.append((state[key], target, real))
    return repadded


def _over_pipeline(entries: dict, pp_group) -> dict:
    """``entries`` of every stage of ``pp_group`` (each rank holds its own stages' only)."""
    if pp_group is None or comm.group_size(pp_group) == 1:
        return entries
    every = [None] * comm.group_size(pp_group)
    dist.all_gather_object(every, entries, group=pp_group)
    return {key: value for part in every for key, value in part.items()}


def load(ckpt: Path, *, model, optimizer, tp_group, restore_rng: bool, pp_group=None, ep_group=None) -> None:
    """Load a verified checkpoint into ``model``/``optimizer`` (any TP/DP/PP size), collectively.

    Every rank first validates the whole DCP metadata against the exact state dict expected
    (every saving rank's entries included); only then does DCP read tensor data.
    ``restore_rng`` (only meaningful at the saving run's sizes) also restores this rank's RNG.
    ``model`` holds this rank's pipeline stages under ``pp_group`` (PP=1's names): the entries
    expected are every stage's. Expert weights are sharded over ``ep_group`` (None: each rank
    holds every expert).
    """
    if optimizer is not None:
        init_adam_state(optimizer)
    state, gathered, uneven = build_state_dict(model, optimizer, tp_group=tp_group, with_rng=restore_rng,
                                               ep_group=ep_group)
    own, metadata, error, repadded = {}, None, None, []
    try:
        meta = read_json(ckpt)[1]
        if restore_rng and meta["rng"] != rng_spec():
            raise CheckpointError(f"checkpoint {ckpt}: its RNG states {sorted(meta['rng'])} are not "
                                  f"this process's {sorted(rng_spec())}")
        metadata = read_metadata(ckpt, listed=set(read_manifest(ckpt)))
        own = expected_entries(state, meta)
        repadded = _other_padding(state, own, metadata.state_dict_metadata, model, optimizer)
    except (CheckpointError, OSError, ValueError) as exc:
        error = exc
    # Every rank of the pipeline takes part, also one that failed (it is named by agree below).
    expected, dims = _over_pipeline(own, pp_group), _over_pipeline(shard_dims(model), pp_group)
    try:
        problem = None if error is not None else mismatch(metadata.state_dict_metadata, expected) or \
            layout_problem(metadata.state_dict_metadata, metadata.storage_data, world=meta["world"],
                           shard_dims=dims) or storage_problem(metadata)
        if problem is not None:
            raise CheckpointError(f"checkpoint {ckpt} {problem}; refusing to load it")
    except (CheckpointError, OSError, ValueError) as exc:
        error = exc
    agree(error)
    try:
        dcp.load(state, storage_reader=_ValidatedReader(ckpt, metadata), planner=_TensorsOnlyPlanner())
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"loading checkpoint {ckpt} failed: {describe(exc)}") from exc
    unstore(state, uneven, tp_group)
    rank = comm.group_rank(tp_group)
    with torch.no_grad():
        for loaded, target, real in repadded:
            start = rank * target.shape[0]
            stop = min(start + target.shape[0], real)
            if stop > start:
                target[:stop - start].copy_(loaded[start:stop])
    for shard, whole in gathered:
        scatter_dp_shard(shard, whole)
    if restore_rng:
        prefix = f"rng.rank{dist.get_rank()}."
        set_rng_state({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})
