"""A checkpoint directory on disk: found (``latest``), its files checked against the manifest
(no symlinks, no paths outside it, sizes and SHA-256 hashed by every rank's share), its JSON
read against the schema.

Example::

    ckpt, config, meta = open_checkpoint("run")          # resolved through ``latest``, verified
"""

from __future__ import annotations

import json
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint_format import (CONFIG, DCP_METADATA, LATEST, MANIFEST, META, STEP_DIR, TOKENIZER, CheckpointError,
                                CheckpointRefused, agree, check_relative, config_fingerprint, sha256)
from .dcp_metadata import read_metadata
from .schema import SchemaError, check_config, check_meta

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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
    if not STEP_DIR.match(name) or step_dir.is_symlink() or not step_dir.is_dir():
        raise CheckpointError(f"{pointer} names {name!r}, which is not a step_N directory beside it")
    return step_dir


def resume_hint(out: str | os.PathLike | None) -> str:
    """Where a stopped run can continue from, e.g. ``the last checkpoint is run/step_200 (continue
    with --resume run)``, or ``no checkpoint was written``."""
    try:
        last = latest_step_dir(out) if out is not None else None
    except CheckpointError:
        last = None
    if last is None:
        return "no checkpoint was written"
    return f"the last checkpoint is {last} (continue with --resume {out})"


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory from ``path``: a ``step_N`` directory, or an output directory."""
    path = Path(path)
    if (path / MANIFEST).is_file() or STEP_DIR.match(path.name):
        return path
    if not path.exists():
        raise CheckpointError(f"checkpoint {path}: no such directory")
    latest = latest_step_dir(path)
    if latest is None and not (path / LATEST).exists() and (path / "metrics.jsonl").exists():
        raise CheckpointError(f"checkpoint {path}: the run there stopped before its first checkpoint, so there is "
                              "nothing to resume: run the command again without --resume to start it over")
    if latest is None:
        raise CheckpointError(f"checkpoint {path}: no {LATEST} pointer naming a step_N directory, "
                              "and not a step_N checkpoint directory itself")
    return latest


def read_manifest(ckpt: Path) -> dict[str, dict]:
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
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {ckpt}: {MANIFEST} is corrupt ({exc})") from None
    for name in files:
        check_relative(ckpt, name, MANIFEST)
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
    if sha256(path) != expected["sha256"]:
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
    files = read_manifest(ckpt)
    share = _share(files, rank, world)
    threads = max(1, min(len(share), torch.get_num_threads(), 8))
    with ThreadPoolExecutor(threads) as pool:
        for error in pool.map(lambda name: _check_file(ckpt, name, files[name]), share):
            if error is not None:
                raise CheckpointError(error)
    read_metadata(ckpt, listed=set(files))


def read_json(ckpt: Path) -> tuple[dict, dict]:
    """(config, meta) of a checkpoint, each checked against its schema (:mod:`.schema`: types,
    ranges, the parallel sizes bounded), config against the fingerprint meta records, and refused
    (:class:`CheckpointRefused`) naming the file and field; meta's ``tokenizer``, if the checkpoint
    holds it, as an absolute path."""
    contents = []
    for name in (CONFIG, META):
        try:
            contents.append(json.loads((ckpt / name).read_text()))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointRefused(f"{ckpt / name}: not JSON ({exc})") from None
        except RecursionError:
            raise CheckpointRefused(f"{ckpt / name}: nested deeper than any file tensorpar writes") from None
    config, meta = contents
    if isinstance(meta, dict) and "ranks" not in meta and "rng" not in meta:
        raise CheckpointRefused(f"checkpoint {ckpt} was written by tensorpar 0.1, which stored RNG states as "
                                "pickled entries; this version loads only checkpoints written by tensorpar 0.2 "
                                "or later")
    step = STEP_DIR.match(ckpt.name)
    try:
        check_config(ckpt / CONFIG, config)
        check_meta(ckpt / META, meta, step=int(step.group(1)) if step else None)
    except SchemaError as exc:
        raise CheckpointRefused(str(exc)) from None
    # Edited heads or K/V groups can keep every tensor's shape: only the fingerprint tells.
    if "config_sha256" in meta and meta["config_sha256"] != config_fingerprint(config):
        raise CheckpointRefused(f"{ckpt / CONFIG}: does not match field 'config_sha256' of {ckpt / META} (the "
                                "config was edited after the save); refusing to load it")
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
        error = exc
    agree(error)
    config, meta = read_json(ckpt)
    return ckpt, config, meta
