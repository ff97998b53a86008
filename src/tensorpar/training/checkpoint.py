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
``.tmp`` directory and says why.

Trust: nothing read from a checkpoint is executed. Before a byte of tensor data is read, every
rank checks that the files on disk are exactly those of the manifest (no symlinks, no paths
outside the directory), the ranks hash their shares of the files against it, and every rank
validates DCP's whole ``.metadata`` (read by an unpickler that admits only DCP's metadata
classes) against the exact state dict expected, every rank's RNG entries included: key set,
tensor kind, dtype and global shape. DCP's pickled "bytes" entries are refused outright.

Example::

    path = save("run", 100, model=model, optimizer=opt, config=cfg, meta=meta, tp_group=tp_group)
    ckpt, config, meta = open_checkpoint("run")          # resolved through ``latest``, verified
    load(ckpt, model=model, optimizer=opt, tp_group=tp_group, restore_rng=True)
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .. import comm
from ..errors import UsageError
from ..fsdp import full_box, gather_dp_shards, reshard, scatter_dp_shard, tp_dp_mesh
from ..models.layout import gather_full_tensor, shard_full_tensor
from ..random import get_rng_tracker
from .rundir import check_dir, write_file
from .schema import SchemaError, check_config, check_meta

LATEST = "latest"
MANIFEST = "manifest.json"
CONFIG = "config.json"
META = "meta.json"
DCP_METADATA = ".metadata"
TOKENIZER = "tokenizer"  # the run's Hugging Face tokenizer, copied into each checkpoint
_STEP_DIR = re.compile(r"^step_(\d+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
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
            outcome[1] = _describe(exc)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise CheckpointError(outcome[1])
    return outcome[0]


def _agree(error: str | None) -> None:
    """Every rank's verdict combined: raise the first rank's error on every rank, if any."""
    verdicts = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, error)
    for verdict in verdicts:
        if verdict is not None:
            raise CheckpointError(verdict)


def _describe(exc: BaseException) -> str:
    """One line for ``exc``; for DCP's CheckpointException, the first failing rank's own error."""
    if isinstance(exc, CheckpointException):
        rank, (cause, _) = min(exc.failures.items())
        return f"rank {rank}: {_describe(cause)}"
    if isinstance(exc, (CheckpointError, UsageError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _write_json(path: Path, data: dict) -> None:
    write_file(path, json.dumps(data, indent=1, sort_keys=True).encode())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
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


def _stored(tensor: torch.Tensor, param: torch.Tensor, mesh: DeviceMesh | None, tp_group):
    """``tensor`` as DCP should store it: :func:`_sharded`, or for an uneven layout
    (``partition_rows``, which no DTensor placement describes) the full tensor, gathered, in
    the same global shape, so a checkpoint moves between even and uneven TP sizes."""
    rows = getattr(param, "partition_rows", None)
    if rows is None or mesh is None:
        return _sharded(tensor, param, mesh)
    full = gather_full_tensor(tensor, partition_dim=param.partition_dim, stride=param.partition_stride,
                              tp_group=tp_group, partition_rows=rows)
    dim, stride, shape = param.partition_dim % full.dim(), param.partition_stride, list(full.shape)
    return full if stride == 1 else full.view(shape[:dim] + [stride, shape[dim] // stride] + shape[dim + 1:])


@torch.no_grad()
def _unstore(state: dict, model: torch.nn.Module, optimizer, tp_group) -> None:
    """Copy the loaded full tensors of uneven layouts into this rank's shards."""
    for name, p in model.named_parameters():
        rows = getattr(p, "partition_rows", None)
        if rows is None or comm.group_size(tp_group) == 1:
            continue
        targets = {f"model.{name}": p.data}
        if optimizer is not None:
            targets.update({f"optim.{name}.{key}": optimizer.state[p][key] for key in _ADAM_MOMENTS})
        for key, target in targets.items():
            dim = p.partition_dim % target.dim()
            full_shape = list(target.shape)
            full_shape[dim] = max(b for ranges in rows for _, b in ranges)
            target.copy_(shard_full_tensor(state[key].reshape(full_shape), partition_dim=dim,
                                           tp_group=tp_group, partition_rows=rows))


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


def _rng_spec() -> dict[str, list[int]]:
    """This rank's RNG entries and their shapes, as ``meta.json`` records them."""
    return {name: list(state.shape) for name, state in _rng_state().items()}


def build_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                     tp_group, with_rng: bool) -> dict:
    """The flat DCP state dict: ``model.*``, ``optim.*`` and (optionally) this rank's ``rng.*``."""
    return _state_dict(model, optimizer, tp_group=tp_group, with_rng=with_rng)[0]


@torch.no_grad()
def _state_dict(model, optimizer, *, tp_group, with_rng: bool) -> tuple[dict, list]:
    """:func:`build_state_dict`, and the (FSDP shard, gathered copy) pairs a load copies back.

    Under :func:`tensorpar.fully_shard` each FSDP shard is saved as its box of the TP=1
    tensor on the (TP, DP) mesh, so the files are the same with and without FSDP; a strided
    weight's DP shard is no such box: it is gathered over DP to its TP shard first (and copied
    back after a load), which a save or load holds on every rank for a moment.
    """
    mesh = _tp_mesh(tp_group)
    # FSDP keeps the root unit gathered after a forward with no backward (an evaluation): its
    # registered parameters are then the gathered copies, not the shards the optimizer steps.
    reshard(model)
    fsdp_mesh = tp_dp_mesh(tp_group) if any(isinstance(p, DTensor) for p in model.parameters()) else None
    state, gathered = {}, []

    def entry(tensor, param):
        if isinstance(tensor, DTensor) and (box := full_box(tensor, param, fsdp_mesh)) is not None:
            return box
        whole = gather_dp_shards(tensor)
        if whole is not tensor:
            gathered.append((tensor, whole))
        return _stored(whole, param, mesh, tp_group)

    for name, p in model.named_parameters():
        state[f"model.{name}"] = entry(p.data, p)
        if optimizer is not None:
            moments = optimizer.state[p]
            state[f"optim.{name}.step"] = moments["step"]
            for key in _ADAM_MOMENTS:
                state[f"optim.{name}.{key}"] = entry(moments[key], p)
    if with_rng:
        for key, value in _rng_state().items():
            state[f"rng.rank{dist.get_rank()}.{key}"] = value
    return state, gathered


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
    files = {p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
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


def _discard(tmp: Path) -> None:
    """Remove what a failed save wrote: its ``.tmp`` directory and the ``latest.tmp`` pointer."""
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp.parent / (LATEST + ".tmp")).unlink(missing_ok=True)


def save(out: str | os.PathLike, step: int, *, model, optimizer, config: dict, meta: dict,
         tp_group, write_extra=None) -> Path:
    """Write ``out/step_{step}`` on every rank collectively; returns its path. ``write_extra(dir)``,
    if given, adds files to the checkpoint directory on rank 0 (covered by the manifest).

    On failure (any rank, any error, DCP's own included) every rank raises
    :class:`CheckpointError` naming the cause, and nothing of this save is left on disk.
    """
    out = Path(out)
    final, tmp = out / f"step_{step}", out / f"step_{step}.tmp"
    _on_rank0(lambda: _prepare_tmp(tmp, final))
    state = build_state_dict(model, optimizer, tp_group=tp_group, with_rng=True)
    meta = {**meta, "ranks": dist.get_world_size(), "rng": _rng_spec()}
    try:
        dcp.save(state, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True))
        _on_rank0(lambda: _finalize(tmp, final, config, meta, write_extra))
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        if dist.get_rank() == 0:
            _discard(tmp)
        try:
            previous = latest_step_dir(out)
        except CheckpointError:
            previous = None
        kept = f"; the previous checkpoint {previous} is intact" if previous else ""
        raise CheckpointError(f"saving checkpoint step {step} to {out} failed: "
                              f"{_describe(exc)}{kept}") from exc
    return final


# --- finding and verifying ---------------------------------------------------------------

def latest_step_dir(out: str | os.PathLike) -> Path | None:
    """The directory ``out/latest`` names; None without a pointer; refused if it names anything
    but a ``step_N`` directory beside it."""
    pointer = Path(out) / LATEST
    if not os.path.lexists(pointer):
        return None
    if pointer.is_symlink() or not pointer.is_file():
        raise CheckpointError(f"{pointer} is not a plain file (a symlink or a directory); refusing it")
    name = pointer.read_text(errors="replace")[:256].strip()
    step_dir = Path(out) / name
    if not _STEP_DIR.match(name) or step_dir.is_symlink() or not step_dir.is_dir():
        raise CheckpointError(f"{pointer} names {name!r}, which is not a step_N directory beside it")
    return step_dir


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


def _check_relative(ckpt: Path, name: object, where: str) -> str:
    """``name`` if it is a plain relative path inside the checkpoint, else refused."""
    plain = (isinstance(name, str) and name and "\\" not in name and "\0" not in name
             and not PurePosixPath(name).is_absolute() and PurePosixPath(name).as_posix() == name
             and all(part not in ("", ".", "..") for part in name.split("/")))
    if not plain:
        raise CheckpointError(f"checkpoint {ckpt}: {where} names the path {name!r}; only plain paths "
                              "inside the checkpoint are allowed (no absolute paths, no '..')")
    return name


def _manifest(ckpt: Path) -> dict[str, dict]:
    """The manifest's files, checked against what is on disk (names, types; not contents)."""
    if ckpt.is_symlink():
        raise CheckpointError(f"checkpoint {ckpt} is a symlink; refusing it")
    manifest_path = ckpt / MANIFEST
    if manifest_path.is_symlink() or not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {ckpt}: {MANIFEST} is missing (incomplete or not a "
                              "tensorpar checkpoint)")
    try:
        files = json.loads(manifest_path.read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
        for entry in files.values():
            if not (isinstance(entry["bytes"], int) and entry["bytes"] >= 0
                    and isinstance(entry["sha256"], str) and _SHA256.match(entry["sha256"])):
                raise TypeError(f"entry {entry!r} lacks an integer 'bytes' and a hex 'sha256'")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {ckpt}: {MANIFEST} is corrupt ({exc})") from exc
    for name in files:
        _check_relative(ckpt, name, MANIFEST)
    on_disk = set()
    for root, dirs, names in os.walk(ckpt):
        for entry in dirs + names:
            path = Path(root) / entry
            relative = path.relative_to(ckpt).as_posix()
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                raise CheckpointError(f"checkpoint {ckpt}: {relative} is a symlink; a checkpoint holds "
                                      "regular files only")
            if stat.S_ISREG(mode):
                on_disk.add(relative)
            elif not stat.S_ISDIR(mode):
                raise CheckpointError(f"checkpoint {ckpt}: {relative} is not a regular file")
    on_disk.discard(MANIFEST)
    unlisted = sorted(on_disk - set(files))
    if unlisted:
        raise CheckpointError(f"checkpoint {ckpt}: {unlisted[0]} is not listed in {MANIFEST} "
                              "(added or modified after the save); refusing to load it")
    missing = sorted(set(files) - on_disk)
    if missing:
        raise CheckpointError(f"checkpoint {ckpt}: file {missing[0]} listed in the manifest is missing")
    for name in (CONFIG, META, DCP_METADATA):
        if name not in files:
            raise CheckpointError(f"checkpoint {ckpt}: {name} is missing (incomplete or not a "
                                  "tensorpar checkpoint)")
    return files


def _check_file(ckpt: Path, name: str, expected: dict) -> str | None:
    path = ckpt / name
    size = path.stat().st_size
    if size != expected["bytes"]:
        return (f"checkpoint {ckpt}: {name} is {size} bytes, the manifest says {expected['bytes']} "
                "(truncated or corrupt)")
    if _sha256(path) != expected["sha256"]:
        return f"checkpoint {ckpt}: {name} fails its SHA-256 check (corrupt or modified)"
    return None


def _share(files: dict[str, dict], rank: int, world: int) -> list[str]:
    """This rank's files to hash: the largest first, each to the least-loaded rank."""
    loads, mine = [0] * world, []
    for name in sorted(files, key=lambda n: (-files[n]["bytes"], n)):
        owner = loads.index(min(loads))
        loads[owner] += files[name]["bytes"] + 1
        if owner == rank:
            mine.append(name)
    return mine


def verify(ckpt: Path, *, rank: int = 0, world: int = 1) -> None:
    """Check the checkpoint's files against its manifest; raise :class:`CheckpointError` naming
    the first bad one. With ``world`` > 1, only this ``rank``'s share is hashed (the listing and
    DCP's references are checked by every rank)."""
    ckpt = Path(ckpt)
    files = _manifest(ckpt)
    share = _share(files, rank, world)
    threads = max(1, min(len(share), torch.get_num_threads(), 8))
    with ThreadPoolExecutor(threads) as pool:
        for error in pool.map(lambda name: _check_file(ckpt, name, files[name]), share):
            if error is not None:
                raise CheckpointError(error)
    read_metadata(ckpt, listed=set(files))


def read_json(ckpt: Path) -> tuple[dict, dict]:
    """(config, meta) of a checkpoint, each checked against its schema (:mod:`.schema`: types,
    ranges, the parallel sizes bounded) and refused naming the file and field; meta's
    ``tokenizer``, if the checkpoint holds it, as an absolute path."""
    contents = []
    for name in (CONFIG, META):
        try:
            contents.append(json.loads((ckpt / name).read_text()))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{ckpt / name}: not JSON ({exc})") from None
    config, meta = contents
    if isinstance(meta, dict) and "ranks" not in meta and "rng" not in meta:
        raise CheckpointError(f"checkpoint {ckpt} was written by tensorpar 0.1, which stored RNG states as "
                              "pickled entries; this version loads only checkpoints written by tensorpar 0.2 "
                              "or later")
    step = _STEP_DIR.match(ckpt.name)
    try:
        check_config(ckpt / CONFIG, config)
        check_meta(ckpt / META, meta, step=int(step.group(1)) if step else None)
    except SchemaError as exc:
        raise CheckpointError(str(exc)) from None
    if meta.get("tokenizer") == TOKENIZER and (ckpt / TOKENIZER).is_dir():
        meta["tokenizer"] = str((ckpt / TOKENIZER).resolve())
    return config, meta


def open_checkpoint(path: str | os.PathLike) -> tuple[Path, dict, dict]:
    """Resolve and verify ``path``, every rank hashing its share of the files and all agreeing
    on the verdict; returns (dir, config, meta). Collective when a world is initialized."""
    ckpt = resolve(path)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    try:
        verify(ckpt, rank=rank, world=world)
        error = None
    except (CheckpointError, OSError) as exc:
        error = _describe(exc)
    _agree(error)
    config, meta = read_json(ckpt)
    return ckpt, config, meta


# --- DCP's metadata, read without running anything -----------------------------------------

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes and torch dtypes only: nothing else can be called."""

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a "
                                     "checkpoint never contains; refusing to load it")


def _is_ints(value, *, length: int | None = None) -> bool:
    return (isinstance(value, (tuple, list, torch.Size)) and (length is None or len(value) == length)
            and all(type(v) is int and v >= 0 for v in value))


def _tiling_problem(entry: TensorStorageMetadata) -> str | None:
    """Why ``entry``'s chunks (each inside the tensor) do not tile it exactly, or None.

    Disjoint chunks whose sizes sum to the tensor's cover it. The sweep runs along the dimension
    with the most distinct offsets (the sharded one), so a TP checkpoint costs O(n log n).
    """
    covered = sum(torch.Size(chunk.sizes).numel() for chunk in entry.chunks)
    total = torch.Size(entry.size).numel()
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks if all(c.sizes)]
    if boxes and entry.size:
        ndim = len(entry.size)
        dim = max(range(ndim), key=lambda d: len({offsets[d] for offsets, _ in boxes}))
        boxes.sort(key=lambda box: box[0][dim])
        open_boxes: list[tuple[tuple, tuple]] = []
        for offsets, sizes in boxes:
            open_boxes = [(o, s) for o, s in open_boxes if o[dim] + s[dim] > offsets[dim]]
            for o, s in open_boxes:
                if all(o[d] < offsets[d] + sizes[d] and offsets[d] < o[d] + s[d] for d in range(ndim)):
                    return f"overlap (at offsets {list(o)} and {list(offsets)})"
            open_boxes.append((offsets, sizes))
    if covered != total:
        return f"cover {covered} of its {total} elements"
    return None


def read_metadata(ckpt: Path, *, listed: set[str]) -> Metadata:
    """DCP's ``.metadata`` of ``ckpt`` through :class:`_MetadataUnpickler`, its structure checked:
    only tensor or bytes entries, chunks that tile their tensors exactly (inside, disjoint,
    covering), and data files that are plain paths listed in the manifest (``listed``)."""
    try:
        with open(ckpt / DCP_METADATA, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, ImportError,
            IndexError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {ckpt}: {DCP_METADATA} is refused: {exc}") from exc

    def refuse(why: str):
        raise CheckpointError(f"checkpoint {ckpt}: {DCP_METADATA} {why}; refusing to load it")

    if not (isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)
            and isinstance(metadata.storage_data, dict)
            and (metadata.storage_meta is None or isinstance(metadata.storage_meta, StorageMeta))):
        refuse("is not DCP metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            refuse(f"has a non-string key {key!r}")
        if isinstance(entry, TensorStorageMetadata):
            if not (isinstance(entry.properties, TensorProperties)
                    and isinstance(entry.properties.dtype, torch.dtype) and _is_ints(entry.size)
                    and isinstance(entry.chunks, list)):
                refuse(f"describes {key} malformed")
            for chunk in entry.chunks:
                if not (isinstance(chunk, ChunkStorageMetadata)
                        and _is_ints(chunk.offsets, length=len(entry.size))
                        and _is_ints(chunk.sizes, length=len(entry.size))
                        and all(o + n <= s for o, n, s in zip(chunk.offsets, chunk.sizes, entry.size))):
                    refuse(f"has a chunk of {key} outside its shape {list(entry.size)}")
            problem = _tiling_problem(entry)
            if problem is not None:
                refuse(f"has chunks of {key} that {problem}")
    for index, info in metadata.storage_data.items():
        if not (isinstance(index, MetadataIndex) and index.fqn in metadata.state_dict_metadata
                and isinstance(info, _StorageInfo) and type(info.offset) is int and info.offset >= 0
                and type(info.length) is int and info.length >= 0 and not info.transform_descriptors):
            refuse(f"has a malformed storage entry {index!r}")
        name = _check_relative(ckpt, info.relative_path, DCP_METADATA)
        if name not in listed:
            refuse(f"refers to {name}, which {MANIFEST} does not list")
    return metadata


# --- loading ------------------------------------------------------------------------------

def _spec(value: torch.Tensor) -> tuple[torch.dtype, list[int]]:
    return value.dtype, list(value.shape)  # a DTensor's shape is its global shape


def _expected_entries(state: dict, meta: dict) -> dict[str, tuple[torch.dtype, list[int]]]:
    """Every entry the checkpoint must hold (the ``model.*`` entries of ``state`` say which):
    model, optimizer and every saving rank's RNG states."""
    expected = {}
    for key, value in state.items():
        if not key.startswith("model."):
            continue
        name = key.removeprefix("model.")
        expected[key] = _spec(value)
        expected[f"optim.{name}.step"] = (torch.float32, [])
        for moment in _ADAM_MOMENTS:
            expected[f"optim.{name}.{moment}"] = _spec(value)
    for rank in range(meta["ranks"]):  # meta.json was checked against its schema
        for name, shape in meta["rng"].items():
            expected[f"rng.rank{rank}.{name}"] = (torch.uint8, list(shape))
    return expected


def _mismatch(stored: dict, expected: dict) -> str | None:
    """The first difference between DCP's entries and the expected ones, named by key."""
    for key in sorted(expected):
        if key not in stored:
            return f"lacks the entry {key} (a {len(stored)}-entry checkpoint of another model?)"
    for key in sorted(stored):
        entry = stored[key]
        if key not in expected:
            return f"has an entry {key} that this model's state does not have"
        if not isinstance(entry, TensorStorageMetadata):
            return f"stores {key} as {type(entry).__name__}, not as a tensor (a checkpoint holds tensors only)"
        dtype, shape = expected[key]
        if entry.properties.dtype != dtype:
            return f"stores {key} as {entry.properties.dtype}, expected {dtype}"
        if list(entry.size) != shape:
            return f"stores {key} with shape {list(entry.size)}, expected {shape}"
    return None


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
        targets = {f"model.{name}": p.data}
        if optimizer is not None:
            targets.update({f"optim.{name}.{key}": optimizer.state[p][key] for key in _ADAM_MOMENTS})
        for key, target in targets.items():
            entry, (dtype, shape) = stored.get(key), expected[key]
            if not isinstance(entry, TensorStorageMetadata):
                continue
            size = list(entry.size)
            # Anything but other padding of the same real rows is left for _mismatch to name.
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


def load(ckpt: Path, *, model, optimizer, tp_group, restore_rng: bool) -> None:
    """Load a verified checkpoint into ``model``/``optimizer`` (any TP/DP size), collectively.

    Every rank first validates the whole DCP metadata against the exact state dict expected
    (every saving rank's entries included); only then does DCP read tensor data.
    ``restore_rng`` (only meaningful at the saving run's sizes) also restores this rank's RNG.
    """
    if optimizer is not None:
        _init_adam_state(optimizer)
    state, gathered = _state_dict(model, optimizer, tp_group=tp_group, with_rng=restore_rng)
    metadata, error, repadded = None, None, []
    try:
        meta = read_json(ckpt)[1]
        expected = _expected_entries(state, meta)
        if restore_rng and meta["rng"] != _rng_spec():
            raise CheckpointError(f"checkpoint {ckpt}: its RNG states {sorted(meta['rng'])} are not "
                                  f"this process's {sorted(_rng_spec())}")
        metadata = read_metadata(ckpt, listed=set(_manifest(ckpt)))
        repadded = _other_padding(state, expected, metadata.state_dict_metadata, model, optimizer)
        problem = _mismatch(metadata.state_dict_metadata, expected)
        if problem is not None:
            raise CheckpointError(f"checkpoint {ckpt} {problem}; refusing to load it")
    except (CheckpointError, OSError, ValueError) as exc:
        error = _describe(exc)
    _agree(error)
    try:
        dcp.load(state, storage_reader=_ValidatedReader(ckpt, metadata), planner=_TensorsOnlyPlanner())
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"loading checkpoint {ckpt} failed: {_describe(exc)}") from exc
    _unstore(state, model, optimizer, tp_group)
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
        _set_rng_state({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})
