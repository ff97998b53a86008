"""Inputs that were accepted silently, hung, or refused with a raw error: each is now one line
naming the file and field (or flag), exit 2, before any rank starts where that can be known then.

The checkpoints are made once on the harness's persistent worlds; the cases run the real command
(in this process where no rank starts, as a subprocess with 2 ranks where the refusal is a rank's).
"""

import hashlib
import json
import os
import pickle
import pty
import re
import shutil
import time
import tomllib

import pytest
import torch

from tensorpar.cli.main import main
from tensorpar.cli.training_cli import parse_train_args
from tensorpar.training.checkpoint_format import sha256
from tensorpar.training.dcp_metadata import read_metadata
from tensorpar.training.data import write_token_file
from tests.cli_runner import run_tensorpar
from tests.harness import run_on_ranks
from tests.test_training_checkpoint import _drop

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "32", "--micro-batch", "2",
        "--warmup", "1", "--eval-every", "0", "--no-progress"]


def _train_body(argv):
    from tensorpar.training.loop import train

    return train(parse_train_args(argv)).checkpoint


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A text file and a token file; a TP 1 run on each, a TP 1 x DP 2 run and one under FSDP."""
    root = tmp_path_factory.mktemp("inputs")
    text = root / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 400)
    write_token_file(root / "tokens.bin", torch.arange(20_000) % 300, vocab_size=300)
    common = TINY + ["--tp", "1", "--steps", "1", "--data", str(text)]
    run_on_ranks(_train_body, 1, common + ["--out", str(root / "run")])
    run_on_ranks(_train_body, 1, TINY + ["--tp", "1", "--steps", "1", "--data", str(root / "tokens.bin"),
                                         "--out", str(root / "tokens")])
    run_on_ranks(_train_body, 2, common + ["--out", str(root / "dp2")])
    run_on_ranks(_train_body, 2, common + ["--fsdp", "--out", str(root / "fsdp")])
    return root


def _copy(runs, tmp_path, name="run"):
    shutil.copytree(runs / name, tmp_path / name)
    return tmp_path / name, tmp_path / name / "step_1"


def config_fingerprint(config):
    """What meta.json's config_sha256 records: the SHA-256 of the config, keys sorted."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def _rewrite_manifest(step_dir):
    """What an attacker who edits files also does: a manifest that matches them."""
    files = {p.relative_to(step_dir).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name != "manifest.json"}
    (step_dir / "manifest.json").write_text(json.dumps({"format": "tensorpar-checkpoint", "files": files}))


def _edit_json(step_dir, name, edit, *, fingerprint=False):
    """``edit`` ``name`` (a dict, or returns the new contents); ``fingerprint``: meta's config
    fingerprint recomputed too (a consistent forgery)."""
    data = json.loads((step_dir / name).read_text())
    data = edit(data) or data
    (step_dir / name).write_text(data if isinstance(data, str) else json.dumps(data))
    if fingerprint:
        meta = json.loads((step_dir / "meta.json").read_text())
        meta["config_sha256"] = config_fingerprint(json.loads((step_dir / "config.json").read_text()))
        (step_dir / "meta.json").write_text(json.dumps(meta))
    _rewrite_manifest(step_dir)


def _craft(step_dir, edit):
    """Rewrite DCP's metadata (and the manifest to match) with ``edit(metadata)``."""
    metadata = read_metadata(step_dir, listed=set(json.loads((step_dir / "manifest.json").read_text())["files"]))
    edit(metadata)
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite_manifest(step_dir)


def _fails(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.removesuffix("\n").split(": error: ", 1)[1]


def _cli(*argv, timeout=300):
    return run_tensorpar(argv, timeout=timeout)


def _one_line_exit_2(proc):
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0].split(": error: ", 1)[1]


# --- 6: silently accepted -----------------------------------------------------------------------

def _swap_storage(key):
    """The storage entries of the first two chunks of ``key`` swapped: each chunk still a valid box,
    the tensor still tiled, but each rank's rows read from the other's file."""
    def edit(metadata):
        first, second = (i for i in metadata.storage_data if i.fqn == key)
        data = metadata.storage_data
        data[first], data[second] = data[second], data[first]
    return edit


@pytest.mark.slow
def test_swapped_fsdp_chunks_are_refused_by_both_ranks_exit_2(runs, tmp_path):
    run, step = _copy(runs, tmp_path, "fsdp")
    _craft(step, _swap_storage("model.blocks.0.mlp.proj.weight"))
    proc = _cli("train", "--nproc", "2", "--tp", "1", "--fsdp", "--resume", str(run), "--steps", "2")
    assert re.fullmatch(r".*checkpoint .*step_1 stores the chunk of model\.blocks\.0\.mlp\.proj\.weight at offsets "
                        r"\[\d+, 0\] in __\d_0\.distcp, which saving rank \d \(TP 1 x DP 2\) does not hold; "
                        r"refusing to load it \(rank \d\)", _one_line_exit_2(proc))


@pytest.mark.parametrize("field, value, message", [
    ("settings", [1, 2], "field 'settings' is a JSON list, expected an object"),
    ("settings.seq_len", -5, "field 'settings.seq_len' is -5; expected an integer >= 1 or null"),
    ("settings.seed", "x", "field 'settings.seed' is 'x'; expected an integer in [0, 4294967295]"),
    ("settings.dropout", 1.5, "field 'settings.dropout' is 1.5; expected a number in [0, 1)"),
    ("settings.overlap", "fast", "field 'settings.overlap' is 'fast'; expected one of ['off', 'auto'] or an "
                                 "integer >= 1"),
])
def test_settings_are_checked_against_their_schema(capsys, runs, tmp_path, field, value, message):
    run, step = _copy(runs, tmp_path)

    def edit(meta):
        if "." in field:
            meta["settings"][field.split(".")[1]] = value
        else:
            meta[field] = value
    _edit_json(step, "meta.json", edit)
    assert _fails(capsys, ["train", "--resume", str(run), "--steps", "2"]) == \
        f"--resume: {step / 'meta.json'}: {message}"


def test_settings_data_must_be_the_recorded_data(capsys, runs, tmp_path):
    run, step = _copy(runs, tmp_path)
    other = tmp_path / "other.txt"
    other.write_text("secret\n" * 1000)
    _edit_json(step, "meta.json", lambda meta: meta["settings"].update(data=str(other)))
    assert _fails(capsys, ["train", "--resume", str(run), "--steps", "2"]) == (
        f"the resumed run's meta.json: field 'settings.data' is '{other}', not the data its field 'data.source' "
        f"records ('{runs / 'text.txt'}'); pass --data to name the data")
    gone = tmp_path / "gone" / "text.txt"
    _edit_json(step, "meta.json", lambda meta: meta["settings"].update(data=str(gone)) or meta["data"].update(
        source=str(gone)))
    assert _fails(capsys, ["train", "--resume", str(run), "--steps", "2"]) == (
        f"the resumed run's meta.json: field 'settings.data' is '{gone}', which no longer exists; pass --data to "
        "name the data")


def test_a_config_edited_with_unchanged_shapes_is_refused(capsys, runs, tmp_path):
    run, step = _copy(runs, tmp_path)
    # 2 heads of 16 instead of 4 of 8: every tensor keeps its shape.
    _edit_json(step, "config.json", lambda config: config.update(num_heads=2, num_query_groups=2))
    for argv in (["train", "--resume", str(run), "--steps", "2"], ["generate", "--checkpoint", str(run)]):
        assert _fails(capsys, argv).endswith(
            f"{step / 'config.json'}: does not match field 'config_sha256' of {step / 'meta.json'} (the config was "
            "edited after the save); refusing to load it")


def test_a_token_file_whose_sidecar_misstates_its_dtype_is_refused(capsys, tmp_path):
    ids = tmp_path / "ids.bin"
    write_token_file(ids, torch.arange(70_000, 80_000), vocab_size=80_000)  # int32 ids
    sidecar = json.loads(ids.with_suffix(".bin.json").read_text())
    # Read as uint16, the ids are below 65536: count and hash agree, the vocabulary holds them.
    sidecar.update(dtype="uint16", count=2 * sidecar["count"], vocab_size=65536, tokenizer="bytes")
    ids.with_suffix(".bin.json").write_text(json.dumps(sidecar))
    assert _fails(capsys, ["train", "--data", str(ids), "--nproc", "1"]) == (
        f"{ids}.json: field 'vocab_size' is 65536, but its tokenizer 'bytes' has 257 token ids; rewrite it with "
        "tensorpar prepare")


def test_int32_ids_declared_uint16_are_refused(capsys, tmp_path):
    """With the count doubled and no tokenizer named, every id is in the vocabulary: the run
    trained on id, 0, id, 0, ..."""
    ids = tmp_path / "ids.bin"
    write_token_file(ids, torch.arange(1, 1001) * 37 % 65_000 + 1, vocab_size=70_000)  # int32 ids
    sidecar = json.loads(ids.with_suffix(".bin.json").read_text())
    sidecar.update(dtype="uint16", count=2 * sidecar["count"], vocab_size=65536)
    ids.with_suffix(".bin.json").write_text(json.dumps(sidecar))
    assert _fails(capsys, ["train", "--data", str(ids), "--nproc", "1"]) == (
        f"--data {ids}: every second token id is 0, as ids twice as wide as the uint16 {ids}.json declares read; "
        "rewrite it with tensorpar prepare")


@pytest.mark.parametrize("scaling, message", [
    ({"type": "yarn", "factor": 4.0}, "rope_scaling's factor is 4.0, but rope_parameters' is None: give the scaling "
                                      "once, in rope_parameters"),
    ({"rope_type": "llama3", "factor": -8.0}, "rope_scaling's factor is -8.0, but rope_parameters' is None: give the "
                                             "scaling once, in rope_parameters"),
    ([8.0], "rope_scaling must be a JSON object, got [8.0]"),
])
def test_hf_rope_scaling_beside_rope_parameters_is_never_dropped(tmp_path, scaling, message):
    from tensorpar.models.hf_files import config_from_hf_dir

    directory = tmp_path / "llama"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_scaling": scaling}))
    with pytest.raises(ValueError) as caught:
        config_from_hf_dir(directory)
    assert str(caught.value) == f"{directory / 'config.json'}: {message}"


# --- 7: hangs -----------------------------------------------------------------------------------

def test_comm_refuses_absurd_layer_counts_at_once(capsys):
    started = time.perf_counter()
    assert _fails(capsys, ["comm", "--layer", "gpt-step", "--layers", "1000000000000", "--tp", "7"]) == (
        "layers must be at most 10,000 (far more than any model has), got 1,000,000,000,000")
    assert time.perf_counter() - started < 5


def test_generate_refuses_a_checkpoint_model_beyond_memory_before_building_it(capsys, runs, tmp_path):
    run, step = _copy(runs, tmp_path)
    _edit_json(step, "config.json", lambda config: config.update(num_layers=100_000, hidden_size=4096,
                                                                 ffn_hidden_size=16384), fingerprint=True)
    started = time.perf_counter()
    message = _fails(capsys, ["generate", "--checkpoint", str(run), "--nproc", "1"])
    assert re.fullmatch(r"the checkpoint's model \(100,000 layers, hidden 4,096, vocabulary 257\) needs an estimated "
                        r"[\d.,]+ [TP]iB per rank at --tp 1 \(weights [\d.,]+ [TP]iB, KV cache .* for 204 tokens, rotary "
                        r"tables 0\.0 GiB\), more than .*: use a larger --tp or fewer --max-new-tokens", message)
    assert time.perf_counter() - started < 10


# --- 8: raw errors ------------------------------------------------------------------------------

def test_deeply_nested_json_is_one_line(capsys, runs, tmp_path):
    run, step = _copy(runs, tmp_path)
    _edit_json(step, "meta.json", lambda _: "[" * 100_000 + "]" * 100_000)
    assert _fails(capsys, ["train", "--resume", str(run), "--steps", "2"]) == (
        f"--resume: {step / 'meta.json'}: nested deeper than any file tensorpar writes")


def test_nested_tokenizer_json_is_one_line(capsys, runs, tmp_path):
    pytest.importorskip("transformers")
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("[" * 100_000 + "]" * 100_000)
    message = _fails(capsys, ["generate", "--checkpoint", str(runs / "run"), "--tokenizer", str(tokenizer)])
    assert message.startswith(f"--tokenizer {tokenizer}: cannot load the tokenizer ("), message


def test_sizes_beyond_memory_are_refused_before_allocating(capsys, runs, tmp_path, monkeypatch):
    from tensorpar.training import memory

    monkeypatch.setattr(memory, "host_available_memory", lambda: 16 * 2**30)
    run, step = _copy(runs, tmp_path)
    _edit_json(step, "config.json", lambda config: config.update(hidden_size=4_000_000_000, num_heads=4,
                                                                 ffn_hidden_size=4), fingerprint=True)
    assert re.match(r"the checkpoint's model \(2 layers, hidden 4,000,000,000, vocabulary 257\) needs an estimated",
                    _fails(capsys, ["generate", "--checkpoint", str(run), "--nproc", "1"]))
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(40 * 2**30)  # sparse: nothing is written
    assert re.fullmatch(rf"--data {big}: its tokens need 80\.0 GiB in every rank, more than the 16\.0 GiB of host memory each "
                        r"of 1 local ranks has: write a token file once with tensorpar prepare \(memory-mapped, read "
                        r"as needed\)", _fails(capsys, ["train", "--data", str(big), "--nproc", "1"]))


def test_hf_positions_beyond_memory_are_refused_before_allocating(capsys, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    import transformers

    directory = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=64)).save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 10**12}))
    capsys.readouterr()  # save_pretrained's progress bar
    assert re.match(r"the model \(1 layers, hidden 32, vocabulary 300, 1,000,000,000,000 positions\) needs an "
                    r"estimated [\d.,]+ TiB per rank at --tp 1 \(rotary tables [\d.,]+ TiB, parameters",
                    _fails(capsys, ["train", "--init-from-hf", str(directory), "--nproc", "1"]))


@pytest.mark.parametrize("argv, message", [
    (["prepare", "DATA", "--out", "OUT", "--bpe-vocab", "100000000000"],
     "argument --bpe-vocab: must be an integer in [257, 16777216), got 100000000000"),
    (["generate", "--checkpoint", "CKPT", "--max-new-tokens", "100000000000000000000"],
     "argument --max-new-tokens: must be an integer in (0, 1048576), got 100000000000000000000"),
    (["generate", "--checkpoint", "TOKENS", "--prompt", "1 " + "9" * 5000],
     "--prompt: token id " + "9" * 27 + "... is outside the model's vocabulary of 300"),
    (["generate", "--checkpoint", "TOKENS", "--prompt", "1 99999999999999999999999"],
     "--prompt: token id 99999999999999999999999 is outside the model's vocabulary of 300"),
])
def test_out_of_range_numbers_are_one_line(capsys, runs, tmp_path, argv, message):
    (tmp_path / "data.txt").write_text("x" * 1000)
    places = {"DATA": str(tmp_path / "data.txt"), "OUT": str(tmp_path / "out.bin"), "CKPT": str(runs / "run"),
              "TOKENS": str(runs / "tokens")}
    assert _fails(capsys, [places.get(a, a) for a in argv]) == message


def _reshape(key):
    def edit(metadata):
        entry = metadata.state_dict_metadata[key]
        entry.size = entry.chunks[0].sizes = torch.Size([8])
    return edit


def _shorten(key):
    def edit(metadata):
        for index in [i for i in metadata.storage_data if i.fqn == key]:
            metadata.storage_data[index].length = 10
    return edit


@pytest.mark.slow
@pytest.mark.parametrize("case, edit, message", [
    ("entry", _drop("rng.rank1.cpu"), r"checkpoint .*step_1 lacks the entry rng\.rank1\.cpu"),
    ("shape", _reshape("rng.rank1.cpu"), r"checkpoint .*step_1 stores rng\.rank1\.cpu with shape \[8\], expected"),
    ("storage", _shorten("model.embedding.word.weight"), r"step_1 stores the chunk of model\.embedding\.word"
                                                         r"\.weight at offsets \[0, 0\] in 10 bytes, fewer than"),
])
@pytest.mark.slow
def test_checkpoint_mismatches_exit_2_from_both_ranks(runs, tmp_path, case, edit, message):
    run, step = _copy(runs, tmp_path, "dp2")
    _craft(step, edit)
    proc = _cli("train", "--nproc", "2", "--tp", "1", "--resume", str(run), "--steps", "2")
    assert re.search(message, _one_line_exit_2(proc)), proc.stderr


@pytest.mark.slow
def test_a_crafted_rank_count_is_named_as_such(runs, tmp_path):
    run, step = _copy(runs, tmp_path, "dp2")
    _edit_json(step, "meta.json", lambda meta: meta.update(ranks=65536, world={"tp": 1, "dp": 65536}))
    proc = _cli("train", "--nproc", "2", "--tp", "1", "--resume", str(run), "--steps", "2")
    assert re.fullmatch(r"checkpoint .*step_1 holds the RNG states of 2 saving ranks, but meta\.json's field 'ranks' "
                        r"is 65,536; refusing to load it \(rank \d\)", _one_line_exit_2(proc))


# --- 9: terminal safety -------------------------------------------------------------------------

@pytest.mark.slow
def test_control_characters_reach_a_terminal_escaped_and_a_pipe_as_they_are(runs):
    prompt = "x = 1\x1b[2J\x1b]0;owned\x07"
    argv = ["generate", "--checkpoint", str(runs / "run"), "--nproc", "1",
            "--prompt", prompt, "--max-new-tokens", "4", "--temperature", "0"]
    main_fd, terminal = pty.openpty()
    try:
        proc = run_tensorpar(argv, stdout_to=os.ttyname(terminal))
        os.close(terminal)
        shown = b""
        while chunk := _read(main_fd):
            shown += chunk
    finally:
        os.close(main_fd)
    assert proc.returncode == 0, proc.stderr
    assert b"\x1b" not in shown and b"\x07" not in shown
    assert shown.decode(errors="replace").startswith(r"x = 1\x1b[2J\x1b]0;owned\x07"), shown
    piped = run_tensorpar(argv)
    assert piped.returncode == 0 and piped.stdout.startswith(prompt), piped.stderr


def _read(fd):
    try:
        return os.read(fd, 4096)
    except OSError:  # the terminal's other end closed
        return b""


@pytest.mark.parametrize("flag, value, most", [
    ("--steps", "9223372036854775808", "1000000000000"), ("--grad-accum", "100000000000000000000000000", "2147483648"),
    ("--global-batch", "2147483649", "2147483648"), ("--micro-batch", "4294967296", "2147483648"),
    ("--eval-iters", "100000000000000000000000000", "2147483648"), ("--warmup", "10000000000000", "1000000000000")])
def test_counts_past_what_a_run_can_take_are_one_line_before_launch(capsys, tmp_path, flag, value, most):
    """--steps 2^63 failed after launch (OverflowError, a run folder left behind); --grad-accum 1e26
    ended in a line several KB long holding a C++ frame; --eval-iters 1e26 evaluated forever."""
    kind = "(0" if flag != "--warmup" else "[0"
    assert _fails(capsys, ["train", flag, value, "--out", str(tmp_path / "out")]) == \
        f"argument {flag}: must be an integer in {kind}, {most}], got {value}"
    assert not (tmp_path / "out").exists()


def test_more_validation_batches_than_the_split_holds_are_capped_and_said(tmp_path):
    argv = TINY + ["--steps", "2", "--eval-every", "2", "--eval-iters", "1000000", "--out", str(tmp_path / "run")]
    done = run_tensorpar(["train", "--nproc", "1", *argv])
    assert done.returncode == 0, done.stderr
    note = re.search(r"--eval-iters 1000000: the validation split holds (\d+) batches of 2 x 32 tokens a DP rank; "
                     r"each evaluation runs (\d+)", done.stdout + done.stderr)
    assert note and note[1] == note[2] and int(note[1]) < 1000000, done.stdout


def test_a_crafted_checkpoint_cannot_point_a_resume_at_another_file(capsys, runs, tmp_path):
    """meta.json's settings.data and data.source set to another file of the run's basename (the
    manifest rehashed) trained on it, exit 0. The checkpoint records the token ids' count and
    SHA-256: a resume without --data trains only on the data whose ids match."""
    run, step = _copy(runs, tmp_path)
    meta = json.loads((step / "meta.json").read_text())
    assert meta["data"]["tokens"] > 0 and re.fullmatch(r"[0-9a-f]{64}", meta["data"]["sha256"])
    private = tmp_path / "elsewhere" / "text.txt"
    private.parent.mkdir()
    private.write_text("a private file of the same name\n" * 300)

    def point_elsewhere(meta):
        meta["settings"]["data"] = meta["data"]["source"] = str(private)

    _edit_json(step, "meta.json", point_elsewhere)
    refused = run_tensorpar(["train", "--resume", str(run), "--steps", "2", "--nproc", "1"])
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    message = refused.stderr.removesuffix("\n").split(": error: ", 1)[1]
    assert message.startswith(f"the resumed run's meta.json names the data {private}, whose ") and \
        message.endswith(f"are not the {meta['data']['tokens']:,} the run trained on (SHA-256 "
                         f"{meta['data']['sha256'][:12]}...): pass --data to name the data"), message
    assert not (run / "step_2").exists()
    # The data it names on the command line, it trains on; the recorded data it resumes on as before.
    assert main(["train", "--resume", str(run), "--steps", "2", "--nproc", "1", "--data", str(private)]) == 0
    run, _ = _copy(runs, tmp_path / "again")
    assert main(["train", "--resume", str(run), "--steps", "2", "--nproc", "1"]) == 0


@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_config_claiming_more_layers_than_the_checkpoint_holds_is_refused_before_building(runs, tmp_path, command):
    """config.json with num_layers 100,000 and a consistent config_sha256 hung generate and export
    (RSS past 6.5 GB): the model was built before its entries were compared with .metadata (2)."""
    run, step = _copy(runs, tmp_path)
    _edit_json(step, "config.json", lambda config: config.update(num_layers=100_000), fingerprint=True)
    argv = ["generate", "--checkpoint", str(run), "--prompt", "x", "--max-new-tokens", "1"] if command == "generate" \
        else ["export", "--checkpoint", str(run), "--to-hf", str(tmp_path / "hf")]
    done = run_tensorpar(argv)
    assert done.returncode == 2 and done.stderr == (
        f"tensorpar {command}: error: checkpoint {step}: config.json says 100,000 layers, but the checkpoint's "
        "tensors hold 2\n"), done.stderr


# --- 11: paths that are not UTF-8 ---------------------------------------------------------------

def test_paths_that_are_not_utf8_work_end_to_end(tmp_path):
    """--data $'caf\\xe9.txt' --out $'o_caf\\xe9' failed after launch with a raw UnicodeEncodeError
    (exit 1), after rank 0 claimed the directory; --print-config wrote TOML --config could not read."""
    data, out, tokens = (os.fsdecode(name) for name in (b"caf\xe9.txt", b"o_caf\xe9", b"t\xe9.bin"))
    (tmp_path / data).write_text("def add(a, b):\n    return a + b\n" * 400)
    trained = run_tensorpar(["train", *TINY, "--nproc", "1", "--tp", "1", "--steps", "1", "--data", data,
                             "--out", out], cwd=tmp_path)
    assert trained.returncode == 0 and "Error" not in trained.stderr, trained.stderr
    assert f"checkpoint {out}/step_1" in trained.stdout                            # the bytes as the OS gave them
    missing = run_tensorpar(["train", "--data", "x" + data], cwd=tmp_path)
    assert missing.stderr == f"tensorpar train: error: --data x{data}: no such file or directory\n", missing.stderr
    rate = re.search(r"trained 1 steps in \d+s: loss \S+ -> \S+, ([\d,]+) tokens/s", trained.stdout)
    assert rate and int(rate[1].replace(",", "")) > 0, trained.stdout             # one step has a rate too
    kept = (tmp_path / out / "config.toml").read_text()
    assert "# data is not UTF-8, so it is written as its bytes: " in kept and "caf\\xe9.txt" in kept
    assert bytes(tomllib.loads(kept)["data"]) == os.fsencode(data)
    # The run's config.toml is a --config that gives the same settings; --print-config writes it so.
    printed = run_tensorpar(["train", "--config", str(tmp_path / out / "config.toml"), "--print-config"], cwd=tmp_path)
    assert printed.returncode == 0 and tomllib.loads(printed.stdout)["data"] == tomllib.loads(kept)["data"], \
        printed.stderr
    resumed = run_tensorpar(["train", "--resume", out, "--steps", "2", "--nproc", "1"], cwd=tmp_path)
    assert resumed.returncode == 0 and (tmp_path / out / "step_2").is_dir(), resumed.stderr
    # A token file and its BPE tokenizer under such names, a run on them and its export.
    for argv in (["prepare", data, "--out", tokens, "--bpe-vocab", "300"],
                 ["train", *TINY, "--nproc", "1", "--tp", "1", "--steps", "1", "--data", tokens, "--out", out + "2"],
                 ["export", "--checkpoint", out + "2", "--to-hf", out + "_hf"]):
        done = run_tensorpar(argv, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    assert {"tokenizer.json", "model.safetensors"} <= set(os.listdir(tmp_path / (out + "_hf")))

