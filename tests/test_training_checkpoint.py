"""Checkpoint safety: tampering and truncation refused, failed and killed saves lose nothing,
metadata cannot run code, generate and export work from a checkpoint."""

import errno
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from tensorpar.training import checkpoint, checkpoint_files
from tensorpar.training.checkpoint_format import CheckpointError, sha256
from tensorpar.cli.training_cli import parse_train_args
from tensorpar.training.dcp_metadata import read_metadata
from tests.cli_runner import run_tensorpar
from tests.harness import run_on_ranks

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "32", "--micro-batch", "2",
        "--warmup", "1", "--eval-every", "0", "--no-progress", "--tp", "1"]


def _train_body(argv):
    from tensorpar.training.loop import train

    return train(parse_train_args(argv)).losses


def _failing_save_body(argv, as_format_error=False):
    """Train 4 steps saving every 2, rank 1's disk 'full' while it writes step 4's DCP file.
    ``as_format_error``: the write fails as torch's zip writer reports a short write, with the
    file system's free space (as ``shutil.disk_usage`` sees it) gone."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from tensorpar.training import loop

    real_write, real_usage = FileSystemWriter.write_data, shutil.disk_usage

    def disk_full(self, plan, planner):
        if "step_4" in str(self.path) and dist.get_rank() == 1:
            partial = Path(self.path) / "__1_0.distcp"
            partial.write_bytes(b"partial")
            if as_format_error:
                shutil.disk_usage = lambda path: real_usage(path)._replace(free=0)
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
            raise OSError(errno.ENOSPC, "No space left on device", str(partial))
        return real_write(self, plan, planner)

    FileSystemWriter.write_data = disk_full
    try:
        loop.train(parse_train_args(argv))
    except CheckpointError as exc:
        return str(exc)
    finally:
        FileSystemWriter.write_data, shutil.disk_usage = real_write, real_usage
    return None


@pytest.fixture(scope="module")
def ckpt_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "run"
    run_on_ranks(_train_body, 1, TINY + ["--steps", "2", "--out", str(out)])
    return out


def _open_body(path):
    ckpt, config, meta = checkpoint_files.open_checkpoint(path)
    return str(ckpt), meta["step"]


def _copy(ckpt_run, tmp_path, name="copy"):
    copy = tmp_path / name
    shutil.copytree(ckpt_run / "step_2", copy)
    return copy


def _rewrite_manifest(step_dir):
    """What an attacker who edits files also does: a manifest that matches them."""
    files = {p.relative_to(step_dir).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name != "manifest.json"}
    (step_dir / "manifest.json").write_text(json.dumps({"format": "tensorpar-checkpoint", "files": files}))


def _edit_manifest(step_dir, edit):
    manifest = json.loads((step_dir / "manifest.json").read_text())
    edit(manifest["files"])
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def _flip(path):
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))


def _shard(step_dir):
    return sorted(step_dir.glob("*.distcp"))[0]


def _damage_cases():
    """(name, damage(step_dir, outside_dir), the refusal's message) for every kind of bad file."""
    def truncate(d, _):
        shard = _shard(d)
        shard.write_bytes(shard.read_bytes()[:100])

    def missing(d, _):
        _shard(d).unlink()

    def unlisted_and_edited(d, _):  # a shard dropped from the manifest, then edited
        _edit_manifest(d, lambda files: files.pop(_shard(d).name))
        _flip(_shard(d))

    def added_file(d, _):
        (d / "extra.distcp").write_bytes(b"x")

    def symlinked_shard(d, outside):
        shard = _shard(d)
        (outside / shard.name).write_bytes(shard.read_bytes())
        shard.unlink()
        shard.symlink_to(outside / shard.name)

    def symlinked_dir(d, outside):
        (d / "sub").symlink_to(outside, target_is_directory=True)

    def absolute_path(d, _):
        _edit_manifest(d, lambda files: files.update({"/etc/hostname": {"bytes": 1, "sha256": "0" * 64}}))

    def dotdot_path(d, _):
        _edit_manifest(d, lambda files: files.update({"../step_2/config.json": {"bytes": 1, "sha256": "0" * 64}}))

    def unreferenced_manifest_gap(d, _):  # the data file DCP reads is gone from manifest and disk
        name = _shard(d).name
        _edit_manifest(d, lambda files: files.pop(name))
        _shard(d).unlink()

    def metadata_outside(d, _):
        metadata = read_metadata(d, listed=set(json.loads((d / "manifest.json").read_text())["files"]))
        for info in metadata.storage_data.values():
            info.relative_path = "/etc/hostname"
        (d / ".metadata").write_bytes(pickle.dumps(metadata))
        _rewrite_manifest(d)

    def chunks(*rows):  # the embedding's one chunk replaced by chunks at these row offsets
        def edit(metadata):
            entry = metadata.state_dict_metadata["model.embedding.word.weight"]
            height, width = entry.size
            entry.chunks = [ChunkStorageMetadata(torch.Size([row, 0]), torch.Size([height // 2, width]))
                            for row in rows]
        return lambda d, _: _craft(d, edit)

    return [
        ("flip", lambda d, _: _flip(_shard(d)), r"__0_0\.distcp fails its SHA-256 check"),
        ("truncate", truncate, r"__0_0\.distcp is 100 bytes, the manifest says \d+ \(truncated"),
        ("missing", missing, r"file __0_0\.distcp listed in the manifest is missing"),
        ("unlisted", unlisted_and_edited, r"__0_0\.distcp is not listed in manifest\.json"),
        ("added", added_file, r"extra\.distcp is not listed in manifest\.json"),
        ("symlink", symlinked_shard, r"__0_0\.distcp is a symlink"),
        ("symlinked-dir", symlinked_dir, r"sub is a symlink"),
        ("absolute", absolute_path, r"manifest\.json names the path '/etc/hostname'; only plain paths"),
        ("dotdot", dotdot_path, r"manifest\.json names the path '\.\./step_2/config\.json'"),
        ("referenced-unlisted", unreferenced_manifest_gap,
         r"\.metadata refers to __0_0\.distcp, which manifest\.json does not list"),
        ("metadata-absolute", metadata_outside, r"\.metadata names the path '/etc/hostname'"),
        # Both halves at offset 0: sizes still sum to the tensor, but half of it would keep its init.
        ("chunks-overlap", chunks(0, 0), r"\.metadata has chunks of model\.embedding\.word\.weight that overlap "
                                         r"\(at offsets \[0, 0\] and \[0, 0\]\); refusing to load it"),
        ("chunks-gap", chunks(0), r"chunks of model\.embedding\.word\.weight that cover 6144 of its 12288 elements"),
    ]


@pytest.mark.parametrize("name, damage, message", _damage_cases(), ids=[c[0] for c in _damage_cases()])
def test_damaged_checkpoint_is_refused_naming_the_file(ckpt_run, tmp_path, name, damage, message):
    copy = _copy(ckpt_run, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    damage(copy, outside)
    with pytest.raises(CheckpointError, match=message):
        checkpoint_files.verify(copy)


def test_every_rank_hashes_a_share_and_all_refuse_together(ckpt_run, tmp_path):
    files = json.loads((ckpt_run / "step_2" / "manifest.json").read_text())["files"]
    shares = [checkpoint_files._share(files, rank, 2) for rank in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(files) and shares[0] and shares[1]
    assert not set(shares[0]) & set(shares[1])
    copy = _copy(ckpt_run, tmp_path)
    _flip(_shard(copy))  # hashed by one rank only; both must refuse
    refusals = run_on_ranks(_open_or_refuse_body, 2, str(copy))
    assert refusals == [f"checkpoint {copy}: __0_0.distcp fails its SHA-256 check (corrupt or modified)"] * 2


def _open_or_refuse_body(path):
    try:
        checkpoint_files.open_checkpoint(path)
    except CheckpointError as exc:
        return str(exc)
    return None


def test_intact_checkpoint_opens(ckpt_run):
    assert run_on_ranks(_open_body, 1, str(ckpt_run)) == [(str(ckpt_run / "step_2"), 2)]


@pytest.mark.parametrize("pointer, message", [
    ("../elsewhere/step_2", r"latest names '\.\./elsewhere/step_2', which is not a step_N directory beside it"),
    ("step_9", r"latest names 'step_9', which is not a step_N directory beside it"),
    ("/etc", r"latest names '/etc', which is not a step_N directory beside it"),
])
def test_latest_must_name_a_sibling_step_dir(ckpt_run, tmp_path, pointer, message):
    out = tmp_path / "run"
    shutil.copytree(ckpt_run, out)
    (out / "latest").write_text(pointer + "\n")
    with pytest.raises(CheckpointError, match=message):
        checkpoint_files.resolve(out)


def test_symlinked_latest_or_step_dir_is_refused(ckpt_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(ckpt_run, out)
    (out / "latest").unlink()
    (out / "latest").symlink_to(ckpt_run / "latest")
    with pytest.raises(CheckpointError, match=r"latest is not a plain file"):
        checkpoint_files.resolve(out)
    (out / "latest").unlink()
    (out / "latest").write_text("step_3\n")
    (out / "step_3").symlink_to(ckpt_run / "step_2", target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"names 'step_3', which is not a step_N directory"):
        checkpoint_files.resolve(out)
    with pytest.raises(CheckpointError, match=r"step_3 is a symlink"):
        checkpoint_files.verify(out / "step_3")


class _Payload:
    """Unpickling this creates ``marker``: proof that code from the file ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_code_in_metadata_is_never_run(ckpt_run, tmp_path):
    copy = _copy(ckpt_run, tmp_path)
    marker = tmp_path / "pwned"
    (copy / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _rewrite_manifest(copy)
    with pytest.raises(CheckpointError, match=r"\.metadata is refused: checkpoint metadata refers "
                                              r"to posix\.mkdir, which a checkpoint never contains"):
        checkpoint_files.verify(copy)
    assert run_on_ranks(_open_or_refuse_body, 1, str(copy))[0].endswith("refusing to load it")
    assert not marker.exists()


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    """A checkpoint saved by two ranks (TP 1 x DP 2): RNG entries of rank 0 and rank 1."""
    out = tmp_path_factory.mktemp("dp2") / "run"
    run_on_ranks(_train_body, 2, TINY + ["--steps", "1", "--out", str(out)])
    return out


def _resume_refusal_body(argv):
    from tensorpar.training.loop import train

    try:
        train(parse_train_args(argv))
    except CheckpointError as exc:
        return str(exc)
    return None


def _craft(step_dir, edit):
    """Rewrite DCP's metadata (and the manifest to match) with ``edit(metadata)``."""
    listed = set(json.loads((step_dir / "manifest.json").read_text())["files"])
    metadata = read_metadata(step_dir, listed=listed)
    edit(metadata)
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite_manifest(step_dir)


def _bytes_entry(step_dir, key, marker):
    """``key`` turned into a DCP bytes entry whose data is a pickle creating ``marker``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    payload = pickle.dumps(_Payload(marker))
    (step_dir / "__1_1.distcp").write_bytes(payload)

    def edit(metadata):
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
        for index in [i for i in metadata.storage_data if i.fqn == key]:
            del metadata.storage_data[index]
        metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__1_1.distcp", 0, len(payload))
    return edit


def _retype(key, dtype=None, shape=None):
    def edit(metadata):
        entry = metadata.state_dict_metadata[key]
        if dtype is not None:
            entry.properties.dtype = dtype
        if shape is not None:
            entry.size = torch.Size(shape)
            entry.chunks[0].sizes = torch.Size(shape)
    return edit


def _drop(key):
    def edit(metadata):
        del metadata.state_dict_metadata[key]
        for index in [i for i in metadata.storage_data if i.fqn == key]:
            del metadata.storage_data[index]
    return edit


@pytest.mark.parametrize("case", ["rank1-rng-bytes", "rank0-rng-bytes", "model-bytes", "dtype", "shape",
                                  "missing-key"])
def test_crafted_entries_of_every_rank_are_refused_before_any_data_is_read(dp2_run, tmp_path, case):
    copy = tmp_path / "run"
    shutil.copytree(dp2_run, copy)
    step_dir, marker = copy / "step_1", tmp_path / "pwned"
    edit, message = {
        "rank1-rng-bytes": (_bytes_entry(step_dir, "rng.rank1.cpu", marker),
                            "stores rng.rank1.cpu as BytesStorageMetadata, not as a tensor"),
        "rank0-rng-bytes": (_bytes_entry(step_dir, "rng.rank0.tracker.model-parallel-rng", marker),
                            "stores rng.rank0.tracker.model-parallel-rng as BytesStorageMetadata"),
        "model-bytes": (_bytes_entry(step_dir, "model.embedding.word.weight", marker),
                        "stores model.embedding.word.weight as BytesStorageMetadata"),
        "dtype": (_retype("rng.rank1.cpu", dtype=torch.float64),
                  "stores rng.rank1.cpu as torch.float64, expected torch.uint8"),
        "shape": (_retype("rng.rank1.cpu", shape=[8]), r"stores rng.rank1.cpu with shape \[8\], expected \[5056\]"),
        "missing-key": (_drop("rng.rank1.cpu"), "lacks the entry rng.rank1.cpu"),
    }[case]
    _craft(step_dir, edit)
    argv = TINY + ["--steps", "2", "--out", str(copy), "--resume", str(copy)]
    refusals = run_on_ranks(_resume_refusal_body, 2, argv)
    for refusal in refusals:  # every rank refuses, also the one whose own keys are intact
        assert refusal is not None and re.search(message, refusal), refusals
        assert refusal.endswith("refusing to load it")
    assert not marker.exists()
    assert (copy / "latest").read_text().strip() == "step_1"  # nothing lost


def test_a_checkpoint_of_tensorpar_0_1_is_refused_naming_the_version(dp2_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(dp2_run, copy)
    meta_path = copy / "step_1" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["ranks"], meta["rng"]  # what tensorpar 0.1 wrote
    meta_path.write_text(json.dumps(meta))
    _rewrite_manifest(copy / "step_1")
    argv = TINY + ["--steps", "2", "--out", str(copy), "--resume", str(copy)]
    for refusal in run_on_ranks(_resume_refusal_body, 2, argv):
        assert refusal.endswith("was written by tensorpar 0.1, which stored RNG states as pickled entries; "
                                "this version loads only checkpoints written by tensorpar 0.2 or later"), refusal


def _set(name, field, value):
    def edit(data):
        *parents, last = field.split(".")
        for parent in parents:
            data = data[parent]
        data[last] = value
    return name, edit


@pytest.mark.parametrize("name, edit, message", [
    (*_set("meta.json", "step", -5), "field 'step' is -5; expected an integer >= 0"),
    (*_set("meta.json", "step", 3), "field 'step' is 3, but the directory is step_2"),
    (*_set("meta.json", "ranks", 1_000_000_000), "field 'ranks' is 1000000000; expected an integer in [1, 65536]"),
    (*_set("meta.json", "ranks", 2), "field 'ranks' is 2, but field 'world' is TP 1 x DP 1"),
    (*_set("meta.json", "schedule.lr", "fast"), "field 'schedule.lr' is 'fast'; expected a finite number > 0"),
    (*_set("meta.json", "world", [1, 1]), "field 'world' is a JSON list, expected an object"),
    (*_set("meta.json", "dtype", "fp8"), "field 'dtype' is 'fp8'; expected one of ['fp32', 'bf16']"),
    (*_set("config.json", "params_dtype", "load"),
     "field 'params_dtype' is 'load'; expected one of ['float32', 'bfloat16', 'float16']"),
    (*_set("config.json", "num_layers", "4"), "field 'num_layers' is '4'; expected an integer >= 1"),
    (*_set("config.json", "num_heads", 5), "hidden_size (32) is not divisible by num_heads (5)"),
    (*_set("config.json", "rope_scaling", {"factor": [8]}),
     "field 'rope_scaling' is {'factor': [8]}; expected an object of strings and numbers or null"),
    (*_set("config.json", "shell", "rm -rf"), "field 'shell' is not one of ["),
])
def test_config_and_meta_are_checked_before_launch_naming_file_and_field(ckpt_run, tmp_path, capsys, name,
                                                                       edit, message):
    from tensorpar.cli.main import main

    run = tmp_path / "run"
    shutil.copytree(ckpt_run, run)
    path = run / "step_2" / name
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    _rewrite_manifest(run / "step_2")
    assert main(["train", "--resume", str(run), "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tensorpar train: error: --resume: {path}: {message}") and err.count("\n") == 1, err


_FORBIDDEN_LOADS = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("marshal", "loads"),
                    ("torch", "load"), ("dill", "load"), ("dill", "loads")}


def test_package_never_unpickles_with_plain_pickle_or_torch_load():
    """No plain unpickling anywhere in tensorpar: only the restricted metadata unpickler."""
    import ast

    import tensorpar

    offenders = []
    for path in Path(tensorpar.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "weights_only" and not (
                    isinstance(node.value, ast.Constant) and node.value.value is True):
                offenders.append(f"{path.name}:{node.value.lineno} weights_only not True")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(
                    node.func.value, ast.Name) and (node.func.value.id, node.func.attr) in _FORBIDDEN_LOADS:
                safe = node.func.attr == "load" and node.func.value.id == "torch" and any(
                    k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in node.keywords)
                if not safe:
                    offenders.append(f"{path.name}:{node.lineno} {node.func.value.id}.{node.func.attr}")
    assert offenders == []


def test_failed_save_says_why_removes_its_files_and_keeps_the_previous_checkpoint(tmp_path):
    out = tmp_path / "run"
    argv = TINY + ["--steps", "4", "--save-every", "2", "--out", str(out)]
    errors = run_on_ranks(_failing_save_body, 2, argv)
    expected = (f"saving checkpoint step 4 to {out} failed: rank 1: OSError: [Errno 28] No space left on "
                f"device: '{out}/step_4.tmp/__1_0.distcp'; the previous checkpoint {out}/step_2 is intact")
    assert errors == [expected, expected]
    assert sorted(p.name for p in out.iterdir()) == [".tensorpar.lock", "latest", "metrics.jsonl", "step_2"]
    assert (out / "latest").read_text().strip() == "step_2"
    assert run_on_ranks(_open_body, 1, str(out))[0][1] == 2


def test_a_save_cut_short_by_a_full_disk_says_so_whatever_the_writer_reports(tmp_path):
    out = tmp_path / "run"
    errors = run_on_ranks(_failing_save_body, 2, TINY + ["--steps", "4", "--save-every", "2", "--out", str(out)],
                          True)
    assert re.match(rf"saving checkpoint step 4 to {re.escape(str(out))} failed: No space left on device: its "
                    rf"tensors need [\d,]+ bytes, the file system of {re.escape(str(out))} has 0 free \(rank 1: "
                    r"RuntimeError: \[enforce fail at inline_container.cc:672\] \. unexpected pos 704 vs 598\); "
                    "the previous checkpoint", errors[1]), errors
    assert sorted(p.name for p in out.iterdir()) == [".tensorpar.lock", "latest", "metrics.jsonl", "step_2"]


_KILL_IN_SAVE = """
import os, signal, sys
from tensorpar.training import checkpoint
real_save = checkpoint.dcp.save
def save_then_die(state, storage_writer):
    real_save(state, storage_writer=storage_writer)
    if "step_4" in str(storage_writer.path):
        os.kill(os.getpid(), signal.SIGKILL)   # after the data, before the rename and `latest`
checkpoint.dcp.save = save_then_die
from tensorpar.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_killed_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--nproc", "1", *TINY, "--steps", "4", "--save-every", "2", "--out", str(out)]
    proc = subprocess.run([sys.executable, "-c", _KILL_IN_SAVE, *argv], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -9, proc.stderr
    assert (out / "step_4.tmp").is_dir() and not (out / "step_4").exists()
    assert (out / "latest").read_text().strip() == "step_2"
    # Resuming picks step 2 and the next save replaces the stale tmp directory.
    losses = run_on_ranks(_train_body, 1, TINY + ["--steps", "4", "--save-every", "2", "--out", str(out),
                                                  "--resume", str(out)])[0]
    assert list(losses) == [3, 4]
    assert not (out / "step_4.tmp").exists() and (out / "latest").read_text().strip() == "step_4"


def _cli(*argv, timeout=300):
    return run_tensorpar(argv, timeout=timeout)


@pytest.mark.slow
def test_generate_at_tp2_continues_the_prompt(ckpt_run):
    proc = _cli("generate", "--checkpoint", str(ckpt_run), "--nproc", "2", "--tp", "2",
                "--prompt", "import os", "--max-new-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout.strip().splitlines()[-1]
    assert text.startswith("import os") and len(text) > len("import os")


def _our_logits_body(path, tokens):
    import tensorpar as tp
    from tensorpar.training.inference import load_model

    tp.initialize_model_parallel(1)
    model, _ = load_model(path, tp_group=tp.get_tensor_model_parallel_group())
    with torch.no_grad():
        return model(tokens)[..., :model.config.vocab_size]


def test_export_to_transformers_gives_the_same_logits_and_stops_generating_at_its_context(ckpt_run, tmp_path):
    """transformers' default text-generation call ran past the model's positions (IndexError):
    the export writes its context length as the generation's max_length, and says so."""
    transformers = pytest.importorskip("transformers")
    proc = _cli("export", "--checkpoint", str(ckpt_run), "--to-hf", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    said = (f"wrote a transformers model to {tmp_path / 'hf'}: step 2, a context of {config['n_positions']} tokens "
            "(its generation stops there: max_length)\n")
    assert said in proc.stdout, proc.stdout
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["max_length"] == config["n_positions"]
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    generated = transformers.pipeline("text-generation", model=str(tmp_path / "hf"))("def ")[0]["generated_text"]
    assert generated.startswith("def ")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
    ours = run_on_ranks(_our_logits_body, 1, str(ckpt_run), tokens)[0]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["step_4.tmp", "step_4"])
def test_a_save_never_writes_through_a_planted_step_directory_link(tmp_path, name):
    from tensorpar.training.rundir import RunDirError

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("kept\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(victim)
    with pytest.raises(RunDirError, match=rf"^{out / name} is a symlink; tensorpar never writes through links"):
        checkpoint._prepare_tmp(out / "step_4.tmp", out / "step_4")
    assert [p.name for p in victim.iterdir()] == ["precious"]


def checkpoint_meta(*, step: int, tp: int, dp: int) -> dict:
    """The meta.json fields a training run saves (a checkpoint's meta is checked against them)."""
    return {"step": step, "tokens_seen": 0, "steps": step, "global_batch": dp, "micro_batch": 1,
            "schedule": {"lr": 1e-2, "min_lr": 0.0, "warmup": 0, "decay_steps": step},
            "data": {"position": step, "seed": 0, "source": "embedded"}, "world": {"tp": tp, "dp": dp},
            "dtype": "fp32", "tokenizer": None}


def _uneven_reshard_body(out, phase, tp_size, vocab_multiple):
    """Phase "save": one Adam step at ``tp_size``, a checkpoint, a second step: its full
    weights. Phase "load": a fresh model at ``tp_size`` loads the checkpoint, takes the same
    second step: the same full weights (6 heads over 2 K/V heads, FFN 50: uneven at TP 3 and 4;
    with a vocab multiple of 128 the vocabulary pads to 384 rows at TP 3, 128 at TP 2 and 4)."""
    import torch.distributed as dist

    import tensorpar as tp
    from tensorpar.models import GPT, GPTConfig
    from tensorpar.training.model_config import config_to_json

    config = GPTConfig(vocab_size=101, max_seq_len=16, num_layers=1, num_heads=6, num_query_groups=2,
                       hidden_size=24, ffn_hidden_size=50, make_vocab_size_divisible_by=vocab_multiple, norm="rmsnorm",
                       activation="swiglu", position_embedding="rope", bias=False, qkv_bias=True,
                       tie_word_embeddings=False)
    tp.initialize_model_parallel(tp_size)
    group = tp.get_tensor_model_parallel_group()
    tp.model_parallel_manual_seed(3 if phase == "save" else 4)
    model = GPT(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)
    tokens = torch.arange(24).reshape(2, 12) % 101

    def step():
        optimizer.zero_grad()
        model(tokens, tokens.roll(-1, 1)).backward()
        optimizer.step()

    if phase == "save":
        step()
        checkpoint.save(out, 1, model=model, optimizer=optimizer, config=config_to_json(config),
                        meta=checkpoint_meta(step=1, tp=tp_size, dp=dist.get_world_size() // tp_size), tp_group=group)
    else:
        ckpt, _, _ = checkpoint_files.open_checkpoint(out)
        checkpoint.load(ckpt, model=model, optimizer=optimizer, tp_group=group, restore_rng=False)
    step()
    return {name: t.float()[:101] for name, t in model.full_state_dict().items()}  # the real vocabulary's rows


@pytest.mark.parametrize("tp_save, tp_load, vocab_multiple", [(4, 2, 8), (2, 4, 8), (4, 3, 128), (3, 4, 128)])
def test_uneven_layouts_reshard_between_tp_sizes(tmp_path, tp_save, tp_load, vocab_multiple):
    expected = run_on_ranks(_uneven_reshard_body, 4 if tp_save != 3 else 3, str(tmp_path), "save", tp_save,
                            vocab_multiple)[0]
    loaded = run_on_ranks(_uneven_reshard_body, 4 if tp_load != 3 else 3, str(tmp_path), "load", tp_load,
                          vocab_multiple)[0]
    for name, value in expected.items():
        torch.testing.assert_close(loaded[name], value, rtol=1e-5, atol=1e-6, msg=name)
