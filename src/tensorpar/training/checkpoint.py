"""Checkpoints that survive a change of TP and DP size, written atomically and verified on load.

Layout of ``OUT/step_N/``: ``torch.distributed.checkpoint`` (DCP) files holding the model, the
optimizer state and per-rank RNG states; ``config.json`` (the model config), ``meta.json``
(step, schedule, data position, parallel sizes) and ``manifest.json`` (size and SHA-256 of
every other file). ``OUT/latest`` names the newest complete checkpoint.

TP-independent layout: every TP-sharded tensor (a parameter and its optimizer moments) is
saved as a DTensor over the TP group whose global shape is what the TP=1 model holds, so DCP
records each rank's chunk offsets and no rank ever materialises a full tensor. A weight with
``partition_stride`` k (fused Q|K|V, gate|up) is k blocks each split over TP; it is stored
viewed as ``[k, rows/k, ...]``, which makes every rank's strided shard one box of that view
while keeping the TP=1 element order. Loading at another TP size asks DCP for the new boxes.

Atomicity: DCP writes into ``step_N.tmp``; rank 0 adds the JSON files, renames the directory
to ``step_N`` and only then replaces ``latest`` (itself via rename). A save killed at any
point leaves the previous checkpoint and ``latest`` untouched; a failed save removes its
``.tmp`` directory. Loading verifies the manifest first, and reads DCP's metadata with an
unpickler that only admits DCP's own metadata classes, so no code from the file runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .. import comm
from ..random import get_rng_tracker

LATEST = "latest"
MANIFEST = "manifest.json"
CONFIG = "config.json"
META = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message says which and why."""


def _on_rank0(fn) -> object:
    """Run ``fn`` on global rank 0 and raise its error (if any) on every rank."""
    outcome = [None, None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            outcome[1] = f"{exc}" if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise CheckpointError(outcome[1])
    return outcome[0]


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- the TP-independent state dict ------------------------------------------------------

def _sharded(tensor: torch.Tensor, param: torch.Tensor, mesh: DeviceMesh | None):
    """``tensor`` (shaped like ``param``'s shard) as DCP should store it."""
    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    dim, stride = param.partition_dim % tensor.dim(), param.partition_stride
    tp = 1 if mesh is None else mesh.size()
    shape = list(tensor.shape)
    if stride == 1:
        local, shard_dim = tensor, dim
        global_shape = shape[:dim] + [shape[dim] * tp] + shape[dim + 1:]
    else:
        local = tensor.view(shape[:dim] + [stride, shape[dim] // stride] + shape[dim + 1:])
        shard_dim = dim + 1
        global_shape = shape[:dim] + [stride, shape[dim] * tp // stride] + shape[dim + 1:]
    if mesh is None:
        return local
    global_stride, running = [], 1
    for size in reversed(global_shape):
        global_stride.insert(0, running)
        running *= size
    return DTensor.from_local(local, mesh, [Shard(shard_dim)], run_check=False,
                              shape=torch.Size(global_shape), stride=tuple(global_stride))


def _tp_mesh(tp_group) -> DeviceMesh | None:
    if comm.group_size(tp_group) == 1:
        return None
    device_type = "cuda" if dist.get_backend(tp_group) == "nccl" else "cpu"
    return DeviceMesh.from_group(tp_group, device_type)


def _init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create zero Adam state for parameters that have none, so DCP can load into it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                for key in _ADAM_MOMENTS:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _rng_state() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    for name, state in get_rng_tracker().get_states().items():
        states[f"tracker.{name}"] = state
    return states


def _set_rng_state(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states.pop("cpu"))
    if "cuda" in states:
        torch.cuda.set_rng_state(states.pop("cuda"))
    get_rng_tracker().set_states({k.removeprefix("tracker."): v for k, v in states.items()})


def build_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                     tp_group, with_rng: bool) -> dict:
    """The flat DCP state dict: ``model.*``, ``optim.*`` and (optionally) this rank's ``rng.*``."""
    mesh = _tp_mesh(tp_group)
    state = {}
    for name, p in model.named_parameters():
        state[f"model.{name}"] = _sharded(p.data, p, mesh)
        if optimizer is not None:
            moments = optimizer.state[p]
            state[f"optim.{name}.step"] = moments["step"]
            for key in _ADAM_MOMENTS:
                state[f"optim.{name}.{key}"] = _sharded(moments[key], p, mesh)
    if with_rng:
        for key, value in _rng_state().items():
            state[f"rng.rank{dist.get_rank()}.{key}"] = value
    return state


# --- saving -------------------------------------------------------------------------------

def _prepare_tmp(tmp: Path) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():  # left by a save that was killed
        shutil.rmtree(tmp)
    tmp.mkdir()


def _finalize(tmp: Path, final: Path, config: dict, meta: dict) -> None:
    _write_json(tmp / CONFIG, config)
    _write_json(tmp / META, meta)
    files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(tmp.rglob("*")) if p.is_file()}
    _write_json(tmp / MANIFEST, {"format": "tensorpar-checkpoint", "files": files})
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again (after a resume): replace it
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    pointer = final.parent / (LATEST + ".tmp")
    with open(pointer, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, final.parent / LATEST)
    _fsync_dir(final.parent)


def save(out: str | os.PathLike, step: int, *, model, optimizer, config: dict, meta: dict,
         tp_group) -> Path:
    """Write ``out/step_{step}`` on every rank collectively; returns its path."""
    out = Path(out)
    final, tmp = out / f"step_{step}", out / f"step_{step}.tmp"
    _on_rank0(lambda: _prepare_tmp(tmp))
    state = build_state_dict(model, optimizer, tp_group=tp_group, with_rng=True)
    try:
        dcp.save(state, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True))
        _on_rank0(lambda: _finalize(tmp, final, config, meta))
    except Exception as exc:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_step_dir(out)
        kept = f"; the previous checkpoint {previous} is intact" if previous else ""
        raise CheckpointError(f"saving checkpoint step {step} to {out} failed: {exc}{kept}") from exc
    return final


# --- loading ------------------------------------------------------------------------------

def latest_step_dir(out: Path) -> Path | None:
    pointer = Path(out) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    return Path(out) / name if _STEP_DIR.match(name) else None


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory from ``path``: a ``step_N`` directory, or an output directory."""
    path = Path(path)
    if (path / MANIFEST).is_file() or _STEP_DIR.match(path.name):
        return path
    if not path.exists():
        raise CheckpointError(f"checkpoint {path}: no such directory")
    latest = latest_step_dir(path)
    if latest is None:
        raise CheckpointError(f"checkpoint {path}: no {LATEST} pointer naming a step_N directory, "
                              "and not a step_N checkpoint directory itself")
    return latest


def verify(ckpt: Path) -> None:
    """Check every file against the manifest; raise :class:`CheckpointError` naming the first bad one."""
    manifest_path = ckpt / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {ckpt}: {MANIFEST} is missing (incomplete or not a "
                              "tensorpar checkpoint)")
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {ckpt}: {MANIFEST} is corrupt ({exc})") from exc
    for name, expected in sorted(files.items()):
        path = ckpt / name
        if ".." in Path(name).parts or not path.is_file():
            raise CheckpointError(f"checkpoint {ckpt}: file {name} listed in the manifest is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"checkpoint {ckpt}: {name} is {size} bytes, the manifest says "
                                  f"{expected['bytes']} (truncated or corrupt)")
        if _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"checkpoint {ckpt}: {name} fails its SHA-256 check (corrupt or modified)")


def read_json(ckpt: Path) -> tuple[dict, dict]:
    """(config, meta) of a verified checkpoint."""
    return json.loads((ckpt / CONFIG).read_text()), json.loads((ckpt / META).read_text())


def open_checkpoint(path: str | os.PathLike) -> tuple[Path, dict, dict]:
    """Resolve and verify ``path`` (on rank 0, the verdict shared); returns (dir, config, meta)."""
    ckpt = resolve(path)
    _on_rank0(lambda: verify(ckpt))
    config, meta = read_json(ckpt)
    return ckpt, config, meta


_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes and torch dtypes only: nothing else can be called."""

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a "
                                     "checkpoint never contains; refusing to load it")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_shapes(ckpt: Path, state: dict) -> None:
    stored = SafeFileSystemReader(ckpt).read_metadata().state_dict_metadata
    missing = sorted(k for k in state if k not in stored)
    if missing:
        raise CheckpointError(f"checkpoint {ckpt} lacks {len(missing)} entries this model needs, "
                              f"e.g. {missing[:3]}")
    wrong = [f"{k}: checkpoint {list(stored[k].size)}, model {list(v.shape)}"
             for k, v in state.items() if list(stored[k].size) != list(v.shape)]
    if wrong:
        raise CheckpointError(f"checkpoint {ckpt} has tensors of other shapes: " + "; ".join(wrong[:4]))


def load(ckpt: Path, *, model, optimizer, tp_group, restore_rng: bool) -> None:
    """Load a verified checkpoint into ``model``/``optimizer`` (any TP/DP size), collectively.

    ``restore_rng`` (only meaningful at the saving run's sizes) also restores this rank's RNG.
    """
    if optimizer is not None:
        _init_adam_state(optimizer)
    state = build_state_dict(model, optimizer, tp_group=tp_group, with_rng=restore_rng)
    _on_rank0(lambda: _check_shapes(ckpt, state))
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(ckpt))
    except Exception as exc:
        raise CheckpointError(f"loading checkpoint {ckpt} failed: {exc}") from exc
    if restore_rng:
        prefix = f"rng.rank{dist.get_rank()}."
        _set_rng_state({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})
