"""DCP's ``.metadata``, read without running anything and checked before a byte of tensor data.

The file is a pickle: it is read by an unpickler that admits only DCP's metadata classes and
torch dtypes, then its structure is checked (tensor entries only, chunks that tile their tensors
exactly, data files the manifest lists) and its entries compared with the exact ones expected:
key set, dtype and global shape, every saving rank's RNG entries included.

Example::

    metadata = read_metadata(ckpt, listed=set(read_manifest(ckpt)))
    problem = mismatch(metadata.state_dict_metadata, expected_entries(state, meta)) or storage_problem(metadata)
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata)

from .checkpoint_format import ADAM_MOMENTS, DCP_METADATA, MANIFEST, META, CheckpointError, check_relative


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
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if not (isinstance(index, MetadataIndex) and index.fqn in metadata.state_dict_metadata
                and isinstance(info, _StorageInfo) and type(info.offset) is int and info.offset >= 0
                and type(info.length) is int and info.length >= 0 and not info.transform_descriptors):
            refuse(f"has a malformed storage entry {index!r}")
        name = check_relative(ckpt, info.relative_path, DCP_METADATA)
        if name not in listed:
            refuse(f"refers to {name}, which {MANIFEST} does not list")
        if name not in sizes:
            sizes[name] = (ckpt / name).stat().st_size
        if info.offset + info.length > sizes[name]:
            refuse(f"stores {index.fqn} at bytes {info.offset:,}-{info.offset + info.length:,} of {name}, beyond "
                   f"its {sizes[name]:,} bytes")
    return metadata


def storage_problem(metadata: Metadata) -> str | None:
    """Why a chunk of a tensor has no storage entry, or one too short to hold its data, or None
    (checked after :func:`mismatch`, so that a wrong dtype or shape is named as such)."""
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        for chunk in entry.chunks:
            info = metadata.storage_data.get(MetadataIndex(key, torch.Size(chunk.offsets)))
            if info is None:
                return f"has no storage entry for the chunk of {key} at offsets {list(chunk.offsets)}"
            need = torch.Size(chunk.sizes).numel() * entry.properties.dtype.itemsize
            if info.length < need:
                return (f"stores the chunk of {key} at offsets {list(chunk.offsets)} in {info.length:,} bytes, "
                        f"fewer than its {need:,} bytes of data")
    return None

def _spec(value: torch.Tensor) -> tuple[torch.dtype, list[int]]:
    return value.dtype, list(value.shape)  # a DTensor's shape is its global shape


def expected_entries(state: dict, meta: dict) -> dict[str, tuple[torch.dtype, list[int]]]:
    """Every entry the checkpoint must hold (the ``model.*`` entries of ``state`` say which):
    model, its buffers, optimizer and every saving rank's RNG states."""
    expected = {}
    for key, value in state.items():
        if key.startswith("buffer."):
            expected[key] = _spec(value)
        if not key.startswith("model."):
            continue
        name = key.removeprefix("model.")
        expected[key] = _spec(value)
        expected[f"optim.{name}.step"] = (torch.float32, [])
        for moment in ADAM_MOMENTS:
            expected[f"optim.{name}.{moment}"] = _spec(value)
    for rank in range(meta["ranks"]):  # meta.json was checked against its schema
        for name, shape in meta["rng"].items():
            expected[f"rng.rank{rank}.{name}"] = (torch.uint8, list(shape))
    return expected


_RNG_RANK = re.compile(r"^rng\.rank(\d+)\.")
_BLOCK = re.compile(r"^model\.blocks\.(\d+)\.")
_WORD_EMBEDDING = "model.embedding.word.weight"


def size_problem(stored: dict, config) -> str | None:
    """What of ``config``'s sizes (layers, hidden, vocabulary) DCP's entries do not hold: checked
    before the model is built, which a config.json edited to 100,000 layers would otherwise make
    take minutes and gigabytes first (the entries say 2)."""
    blocks = {int(m.group(1)) for m in map(_BLOCK.match, stored) if m}
    if blocks != set(range(config.num_layers)):
        return f"config.json says {config.num_layers:,} layers, but the checkpoint's tensors hold {len(blocks):,}"
    word = stored.get(_WORD_EMBEDDING)
    if word is not None and (len(word.size) != 2 or word.size[1] != config.hidden_size
                             or word.size[0] < config.vocab_size):
        return (f"config.json says hidden {config.hidden_size:,} and vocabulary {config.vocab_size:,}, but the "
                f"checkpoint stores {_WORD_EMBEDDING} with shape {list(word.size)}")
    return None


def _saving_ranks(keys) -> set[int]:
    return {int(m.group(1)) for m in map(_RNG_RANK.match, keys) if m}


def mismatch(stored: dict, expected: dict) -> str | None:
    """The first difference between DCP's entries and the expected ones, named by key."""
    saved, recorded = _saving_ranks(stored), _saving_ranks(expected)
    if saved != recorded:  # meta.json's "ranks" says whose RNG entries the checkpoint holds
        return (f"holds the RNG states of {len(saved):,} saving ranks, but {META}'s field 'ranks' is "
                f"{len(recorded):,}")
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
