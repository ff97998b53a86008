"""``tensorpar train/generate/export`` from the command line: every bad input is one line, up front.

Each case gives the exact message; none starts a process (the checkpoints they refer to are made
once, on the harness's persistent one-rank world).
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from tensorpar.cli.main import main
from tensorpar.cli.launch import free_port
from tensorpar.cli.training_cli import parse_train_args
from tensorpar.training.data import DataError, load_corpus, write_token_file
from tests.cli_runner import run_tensorpar
from tests.harness import run_on_ranks

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "32", "--micro-batch", "2",
        "--eval-every", "0", "--no-progress"]


def _train_body(argv):
    from tensorpar.training.loop import train

    return train(parse_train_args(argv)).checkpoint


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A text file, a token file, and runs on each: GPT-2-shaped on text; on tokens, one with RMSNorm and
    GELU, which no transformers class expresses."""
    root = tmp_path_factory.mktemp("cli")
    text = root / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 400)
    tokens = root / "tokens.bin"
    write_token_file(tokens, torch.arange(20_000) % 300, vocab_size=300)
    common = TINY + ["--tp", "1", "--steps", "2", "--warmup", "1"]
    run_on_ranks(_train_body, 1, common + ["--data", str(text), "--out", str(root / "run")])
    run_on_ranks(_train_body, 1, common + ["--data", str(tokens), "--norm", "rmsnorm", "--out", str(root / "odd")])
    return root


def _fails(capsys, argv, code=2):
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.removesuffix("\n")


def _train_error(capsys, *argv):
    return _fails(capsys, ["train", *argv]).removeprefix("tensorpar train: error: ")


@pytest.mark.parametrize("argv, message", [
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),
    (["--lr", "inf"], "argument --lr: must be a finite number > 0, got inf"),
    (["--lr", "fast"], "argument --lr: expected a number > 0, got 'fast'"),
    (["--dropout", "2"], "argument --dropout: must be a finite number in [0, 1), got 2"),
    (["--steps", "0"], "argument --steps: must be an integer in (0, 1000000000000], got 0"),   # issue 26: not "finite number"
    (["--nproc", "3", "--tp", "2"], "--tp 2 does not divide --nproc 3"),
    (["--nproc", "1", "--tp", "2"], "--tp 2 needs at least 2 processes; --nproc is 1"),   # issue 26
    (["--nproc", "2", "--tp", "4"], "--tp 4 needs at least 4 processes; --nproc is 2"),
    (["--hidden", "66", "--heads", "4"],
     "the hidden size 66 (--hidden) is not divisible by the 4 attention heads (--heads)"),
    (["--nproc", "4", "--tp", "4", "--heads", "2", "--hidden", "48"],
     "the model's 2 attention heads are fewer than --tp 4: every rank needs a query head"),
    (["--heads", "6", "--kv-heads", "4", "--hidden", "48"],
     "the 6 attention heads (--heads) are not a multiple of the 4 key/value heads (--kv-heads)"),
    (["--rope-theta", "0"], "argument --rope-theta: must be a finite number > 0, got 0"),
    (["--overlap", "some"], "argument --overlap: expected off, auto or a positive number of chunks, got 'some'"),
    (["--interleave", "0"], "argument --interleave: must be an integer > 0, got 0"),
    (["--vocab", "10"], "--vocab 10 is smaller than the data's vocabulary (257 token ids)"),
    (["--min-lr", "1", "--lr", "0.1"], "--min-lr 1 is above --lr 0.1"),
    (["--nproc", "3", "--tp", "1", "--global-batch", "16"],
     "--global-batch 16 cannot be split evenly over 3 data-parallel ranks: choose --nproc/--tp so that the DP "
     "size divides 16"),
    (["--global-batch", "32", "--micro-batch", "5"],
     "--global-batch 32 over 1 data-parallel ranks is 32 sequences per rank, not a multiple of --micro-batch 5: "
     "choose a --micro-batch dividing 32"),
    (["--global-batch", "32", "--grad-accum", "3"],
     "--grad-accum 3 x --micro-batch 16 x 1 data-parallel ranks is 48 sequences per step, not --global-batch 32: "
     "leave --grad-accum out to adapt it"),
    (["--interleave", "2", "--micro-batch", "1"],   # issue 16 item 11: one part overlaps nothing
     "--interleave 2 splits each micro-batch into 2 parts, but --micro-batch is 1: choose a --micro-batch of at "
     "least 2"),
    (["--interleave", "4", "--global-batch", "2"],
     "--interleave 4 splits each micro-batch into 4 parts, but --micro-batch is 2: choose a --micro-batch of at "
     "least 4"),
    (["--model", "huge"], "--model 'huge' is not a preset; choose from ['tiny', 'small', 'medium', 'large', 'xl', "
                          "'llama-tiny', 'moe-tiny']"),
])
def test_bad_numbers_and_shapes(capsys, argv, message):
    assert _train_error(capsys, *argv) == message


@pytest.mark.parametrize("argv, schedule, min_lr", [
    (["--lr", "3e-5"], {}, 3e-6),                                           # the README's fine-tune line
    ([], {}, 3e-4),
    (["--min-lr", "0"], {}, 0.0),
    ([], {"lr": 1e-3, "min_lr": 5e-5, "warmup": 3}, 5e-5),                  # a resume keeps its floor
    (["--lr", "1e-2"], {"lr": 1e-3, "min_lr": 5e-5, "warmup": 3}, 1e-3),    # unless --lr is new
])
def test_min_lr_follows_lr(argv, schedule, min_lr):
    from tensorpar.training.schedule import settle_run
    from tensorpar.training.resume import continue_settings

    args = parse_train_args(argv)
    meta = {"step": 2, "schedule": schedule} if schedule else None
    continue_settings(args, meta)  # as the command settles a run: its settings, then its schedule
    settle_run(args, meta=meta, dp_size=1)
    assert args.min_lr == pytest.approx(min_lr, rel=1e-12, abs=0)


def test_data_too_short_missing_or_empty(capsys, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("x" * 99)
    assert _train_error(capsys, "--data", str(short), "--seq-len", "64") == (
        f"--data {short}: 100 tokens are too few for --seq-len 64 with a validation split (need at least 132)")
    assert _train_error(capsys, "--seq-len", "100000000").endswith(
        "tokens are too few for --seq-len 100,000,000 with a validation split (need at least 200,000,004)")
    assert _train_error(capsys, "--data", str(tmp_path / "nope")) == f"--data {tmp_path / 'nope'}: no such file or directory"
    (tmp_path / "empty.txt").write_text("")
    assert _train_error(capsys, "--data", str(tmp_path / "empty.txt")) == \
        f"--data {tmp_path / 'empty.txt'}: no text found (empty files)"
    (tmp_path / "dir").mkdir()
    assert _train_error(capsys, "--data", str(tmp_path / "dir")) == f"--data {tmp_path / 'dir'}: the directory contains no files"


def test_token_file_ids_beyond_its_vocab_or_odd_size(capsys, tmp_path):
    import json

    path = tmp_path / "tokens.bin"
    write_token_file(path, torch.arange(1000) % 700, vocab_size=700)
    sidecar = json.loads((tmp_path / "tokens.bin.json").read_text())
    (tmp_path / "tokens.bin.json").write_text(json.dumps({**sidecar, "vocab_size": 500}))
    assert _train_error(capsys, "--data", str(path)) == \
        f"--data {path}: holds token id 699, outside its vocab_size 500 (from {path}.json)"
    with open(path, "ab") as f:
        f.write(b"\0")
    assert _train_error(capsys, "--data", str(path)) == (
        f"--data {path}: size 2001 bytes is not the 1,000 uint16 tokens (2000 bytes) that field 'count' of "
        f"{path}.json records")


_MORE_THAN = r"\), more than [\d,.]+ [GTP]iB (per rank \(.* of host memory available to 2 local ranks\)|of each CUDA device): " \
             r"choose a smaller model or batch, or a larger --tp$"


def test_a_model_beyond_memory_is_refused_before_launch_with_the_estimate(capsys):
    assert re.match(r"^the model \(10,000,000 layers, hidden 128, vocabulary 257\) needs an estimated 110\.0 TiB per "
                    r"rank at --tp 2 \(parameters 3\.6 TiB, gradients 3\.6 TiB, AdamW state 7\.2 TiB, activations "
                    r"95\.5 TiB for --micro-batch 16 x --seq-len 128" + _MORE_THAN,
                    _train_error(capsys, "--layers", "10000000"))
    assert re.match(r"^the model \(4 layers, hidden 1,000,000,000,000, vocabulary 257\) needs an estimated "
                    r"333,066,907\.7 PiB per rank at --tp 2 \(parameters" + r".*" + _MORE_THAN,
                    _train_error(capsys, "--hidden", "1000000000000"))


def test_a_resumed_checkpoint_config_beyond_memory_is_refused(capsys, files, tmp_path):
    import json
    import shutil

    from tensorpar.training.checkpoint_format import config_fingerprint, sha256

    run = tmp_path / "run"
    shutil.copytree(files / "run", run)
    step = run / "step_2"
    config = json.loads((step / "config.json").read_text())
    (step / "config.json").write_text(json.dumps({**config, "num_layers": 10_000_000}))
    meta = json.loads((step / "meta.json").read_text())  # a consistent forgery: the fingerprint too
    meta["config_sha256"] = config_fingerprint(json.loads((step / "config.json").read_text()))
    (step / "meta.json").write_text(json.dumps(meta))
    manifest = json.loads((step / "manifest.json").read_text())
    for name in ("config.json", "meta.json"):
        manifest["files"][name] = {"bytes": (step / name).stat().st_size, "sha256": sha256(step / name)}
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert re.match(r"^the model \(10,000,000 layers, hidden 32, vocabulary 257\) needs an estimated [\d.]+ TiB per "
                    r"rank at --tp 2 \(parameters" + ".*" + _MORE_THAN,
                    _train_error(capsys, "--resume", str(run), "--steps", "4"))


def test_memory_check_compares_with_what_each_rank_has(capsys, monkeypatch, tmp_path):
    from tensorpar.training import memory

    monkeypatch.setattr(memory, "memory_per_rank", lambda local_ranks: (2**20 * local_ranks, f"{local_ranks} MiB"))
    assert _train_error(capsys, "--nproc", "1", "--tp", "1", "--steps", "1", "--out", str(tmp_path / "run")) == (
        "the model (4 layers, hidden 128, vocabulary 257) needs an estimated 0.1 GiB per rank at --tp 1 (parameters "
        "0.0 GiB, gradients 0.0 GiB, AdamW state 0.0 GiB, activations 0.1 GiB for --micro-batch 16 x --seq-len 128), "
        "more than 1 MiB: choose a smaller model or batch, or a larger --tp")
    monkeypatch.setattr(memory, "memory_per_rank", lambda local_ranks: (8 * 2**30, "8 GiB per rank"))
    tokens = tmp_path / "tokens.bin"  # a sidecar's vocabulary of 3e7 is 15 GB of embedding per rank at TP 2
    write_token_file(tokens, torch.arange(1000), vocab_size=30_000_000)
    assert _train_error(capsys, "--data", str(tokens)).startswith(
        "the model (4 layers, hidden 128, vocabulary 30,000,000) needs an estimated 257.5 GiB per rank at --tp 2 "
        "(parameters 7.2 GiB")


def test_the_memory_estimate_divides_by_dp_under_fsdp(capsys, monkeypatch):
    from tensorpar.errors import UsageError
    from tensorpar.training import memory

    asked = []

    def estimate(config, **settings):
        asked.append(settings["fsdp"])
        raise UsageError("estimated")

    monkeypatch.setattr(memory, "check_memory", estimate)
    for flags in ([], ["--fsdp"]):
        assert _train_error(capsys, "--nproc", "4", "--tp", "2", *flags) == "estimated"
    assert asked == [False, True]


@pytest.mark.slow
def test_a_missing_path_is_refused_before_the_slow_imports(tmp_path):
    """Checked before torch.distributed.checkpoint (about a second) or transformers (seconds) is imported."""
    nope = str(tmp_path / "nope")
    code = f"""if True:
        import sys
        from tensorpar.cli.main import main
        for argv in (["train", "--data", {nope!r}], ["train", "--resume", {nope!r}],
                     ["train", "--tokenizer", {nope!r}], ["generate", "--checkpoint", {nope!r}],
                     ["export", "--checkpoint", {nope!r}, "--to-hf", {nope!r}], ["prepare", {nope!r}, "--out", "x"]):
            assert main(argv) == 2
        print(sorted({{"torch.distributed.checkpoint", "transformers"}} & set(sys.modules)))
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == "[]\n", done
    assert done.stderr.splitlines() == [
        f"tensorpar {command}: error: --{flag} {nope}: no such file or directory"
        for command, flag in [("train", "data"), ("train", "resume"), ("train", "tokenizer"),
                              ("generate", "checkpoint"), ("export", "checkpoint"), ("prepare", "data")]]


def test_unwritable_out(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    assert _train_error(capsys, "--out", str(tmp_path / "file" / "run")) == \
        f"--out {tmp_path / 'file' / 'run'} is not a writable directory (Not a directory)"


def test_resume_checks(capsys, files, tmp_path):
    run = files / "run"
    assert _train_error(capsys, "--resume", str(run), "--steps", "2") == (
        "--steps 2 is the run's total, and the checkpoint is already at step 2: pass --steps above 2 to train further")
    assert _train_error(capsys, "--resume", str(run), "--hidden", "64") == (
        "the checkpoint's model config differs from the one requested: hidden_size: checkpoint 32, requested 64")
    assert _train_error(capsys, "--resume", str(run), "--model", "small") == (
        "the checkpoint's model config differs from the one requested: ffn_hidden_size: checkpoint 128, requested "
        "3072; hidden_size: checkpoint 32, requested 768; num_heads: checkpoint 4, requested 12; num_layers: "
        "checkpoint 2, requested 12; num_query_groups: checkpoint 4, requested 12")
    assert _train_error(capsys, "--resume", str(tmp_path / "nope")) == \
        f"--resume {tmp_path / 'nope'}: no such file or directory"
    assert _train_error(capsys, "--resume", str(tmp_path)) == (
        f"--resume: checkpoint {tmp_path}: no latest pointer naming a step_N directory, and not a step_N "
        "checkpoint directory itself")


def test_an_out_that_names_nothing_or_is_a_link_and_a_rope_theta_of_learned_positions_are_refused(capsys, tmp_path):
    """Issue 62 item 14: each trained silently before (into ./tensorpar-run, through the link,
    with the flag ignored)."""
    assert _train_error(capsys, "--out", "") == "--out '' names no directory (default: tensorpar-run)"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    assert _train_error(capsys, "--out", str(tmp_path / "link")) == (
        f"--out '{tmp_path / 'link'}' is a symbolic link: give the directory it points to (default: tensorpar-run)")
    assert not any((tmp_path / "elsewhere").iterdir())
    assert _train_error(capsys, "--rope-theta", "500000") == (
        "--rope-theta 500000.0 is the base of rotary positions, and this model's are learned: add "
        "--position-embedding rope, or drop --rope-theta")


def test_generate_checks(capsys, files, tmp_path):
    def error(*argv):
        return _fails(capsys, ["generate", *argv]).removeprefix("tensorpar generate: error: ")

    assert error("--checkpoint", str(tmp_path / "nope")) == \
        f"--checkpoint {tmp_path / 'nope'}: no such file or directory"
    assert error("--checkpoint", str(files / "run"), "--prompt", "") == \
        "--prompt is empty: give at least one token to continue"
    assert error("--checkpoint", str(files / "run"), "--nproc", "8", "--tp", "8") == \
        "the model's 4 attention heads are fewer than --tp 8: every rank needs a query head"
    assert error("--checkpoint", str(files / "odd"), "--prompt", "def f") == (
        "--prompt 'def f': this checkpoint was trained on a token file, so the prompt is token ids separated by "
        "spaces (e.g. --prompt \"464 2068\"); 'def' is not one")
    assert error("--checkpoint", str(files / "odd"), "--prompt", "5 300") == \
        "--prompt: token id 300 is outside the model's vocabulary of 300"
    # Issue 62 items 11 and 14: bytes that are no UTF-8 text (as the shell passes $'\\xff\\xfe'), and a
    # tokenizer with more tokens than the model has.
    assert error("--checkpoint", str(files / "run"), "--prompt", "\udcff\udcfe") == \
        "--prompt '\\udcff\\udcfe' is not UTF-8 text"
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)} | {"[UNK]": 300}, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=big, unk_token="[UNK]").save_pretrained(tmp_path / "big")
    assert error("--checkpoint", str(files / "run"), "--tokenizer", str(tmp_path / "big")) == (
        f"--tokenizer {tmp_path / 'big'}: its 301 tokens are more than the model's vocabulary of 257: it is "
        "not the tokenizer the model was trained with")


@pytest.mark.parametrize("argv, fits, world", [([], True, (1, 1)), ([], False, (2, 2)),
                                                ([], None, (1, 1)), (["--nproc", "2"], True, (2, 2))])
def test_generate_of_a_small_checkpoint_runs_in_this_process(files, monkeypatch, capsys, argv, fits, world):
    import tensorpar.cli.training_cli as training_cli

    started = []
    monkeypatch.setattr(training_cli, "_run_in_world", lambda entry, args, nproc: started.append(
        (nproc, args.tp)) or {0: "text"})
    if fits is not None:
        monkeypatch.setattr(training_cli, "_fits_one_device", lambda ckpt: fits)
    assert main(["generate", "--checkpoint", str(files / "run"), *argv]) == 0
    assert started == [world] and capsys.readouterr().out == "text\n"


def test_export_checks(capsys, files, tmp_path):
    def error(*argv):
        return _fails(capsys, ["export", *argv]).removeprefix("tensorpar export: error: ")

    with pytest.MonkeyPatch.context() as without:  # an environment without the optional extra
        without.setitem(sys.modules, "transformers", None)
        assert error("--checkpoint", str(files / "run"), "--to-hf", str(tmp_path / "out")) == (
            "export --to-hf needs transformers and safetensors (transformers is not installed): "
            "pip install 'tensorpar[hf]'")

    assert error("--checkpoint", str(files / "odd"), "--to-hf", str(tmp_path / "out")) == (
        f"--checkpoint {files / 'odd'} cannot be exported: no transformers family has this GPT's shape: GPT-2 "
        "needs layernorm, learned positions, biases, GELU and no grouped-query attention; Llama/Qwen2 need "
        "rmsnorm, swiglu, rope and no biases besides QKV; got norm='rmsnorm', activation='gelu', "
        "position_embedding='learned', bias=True, qkv_bias=True, num_query_groups=4")
    (tmp_path / "file").write_text("x")
    assert error("--checkpoint", str(files / "run"), "--to-hf", str(tmp_path / "file")) == \
        f"--to-hf {tmp_path / 'file'} is an existing file, not a directory"
    assert error("--checkpoint", str(files / "run"), "--to-hf", str(tmp_path / "file" / "out")) == \
        f"--to-hf {tmp_path / 'file' / 'out'} is not a writable directory (Not a directory)"
    assert error("--checkpoint", str(files / "run"), "--to-hf", str(tmp_path)) == (
        f"--to-hf {tmp_path} is a directory that is not empty; pass --overwrite to write config.json and "
        "model.safetensors into it")


def _export_body(checkpoint, out):
    return main(["export", "--checkpoint", checkpoint, "--to-hf", out])


def test_export_writes_eos_inside_the_vocabulary_and_files_the_umask_allows(files, tmp_path):
    import json
    import stat

    assert run_on_ranks(_export_body, 1, str(files / "run"), str(tmp_path / "hf")) == [0]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == 257 and config["bos_token_id"] == config["eos_token_id"] == 256
    umask = os.umask(0)
    os.umask(umask)
    for name in ("config.json", "model.safetensors"):  # safetensors alone would write 0600
        assert stat.S_IMODE((tmp_path / "hf" / name).stat().st_mode) == 0o666 & ~umask, name


@pytest.mark.parametrize("argv, message", [
    (["train", "--bogus"], "tensorpar train: error: unrecognized arguments: --bogus; see tensorpar train --help"),
    (["train", "--bf16"], "tensorpar train: error: unrecognized arguments: --bf16 (did you mean --dtype bf16?); "
                          "see tensorpar train --help"),
    (["train", "--seqlen", "64"], "tensorpar train: error: unrecognized arguments: --seqlen 64 (did you mean "
                                  "--seq-len?); see tensorpar train --help"),
    (["comm", "--layer", "mlp", "--sequence-parallel"], "tensorpar comm: error: unrecognized arguments: "
                                                        "--sequence-parallel; see tensorpar comm --help"),
    (["export", "--checkpoint", "x", "--to-hf", "y", "--timeout=0.5", "extra"],
     "tensorpar export: error: argument --timeout: must be a finite number in [1, 604800), got 0.5"),
    (["generate", "--checkpoint", "x", "--seed", "1e23"],
     "tensorpar generate: error: argument --seed: expected an integer in [0, 4294967296), got '1e23'"),
    (["train", "--seed", "100000000000000000000000"],
     "tensorpar train: error: argument --seed: must be an integer in [0, 4294967296), got "
     "100000000000000000000000"),
    (["train", "--timeout", "1e300"], "tensorpar train: error: argument --timeout: must be a finite number in "
                                      "[1, 604800), got 1e300"),
    (["train", "--timeout", "1e-9"], "tensorpar train: error: argument --timeout: must be a finite number in "
                                     "[1, 604800), got 1e-9"),
])
def test_unknown_flags_and_out_of_range_values_are_one_line(capsys, argv, message):
    assert _fails(capsys, argv) == message


def test_token_file_sidecar_is_validated(tmp_path):
    path = tmp_path / "tokens.bin"
    write_token_file(path, torch.arange(1000) % 700, vocab_size=700)
    corpus = load_corpus(path)
    assert corpus.vocab_size == 700 and corpus.tokens.dtype == torch.uint16
    assert torch.equal(corpus.tokens[:5].long(), torch.arange(5))
    (tmp_path / "tokens.bin.json").write_text('{"format": "tensorpar-tokens", "dtype": "float16", "vocab_size": 9}')
    with pytest.raises(DataError, match="field 'dtype' is 'float16'"):
        load_corpus(path)


@pytest.mark.slow
def test_two_torchrun_nodes_on_localhost_train_together(tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
              "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
              "-m", "tensorpar", "train", "--tp", "2", "--steps", "3", *TINY, "--out", str(tmp_path / "run")]
    nodes = [subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "TP=2 DP=1" in "".join(outputs)
    assert (tmp_path / "run" / "latest").read_text().strip() == "step_3"


@pytest.mark.slow
def test_an_exception_inside_a_rank_reaches_the_user_as_one_line(tmp_path):
    """Two real ranks; the loss diverges inside them (nothing a preflight can see)."""
    done = run_tensorpar(["train", "--nproc", "2", "--lr", "1e30", "--steps", "5", "--warmup", "1", "--log-every",
                          "100", *TINY, "--out", str(tmp_path / "run")])
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr + done.stdout
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and re.fullmatch(
        r"tensorpar train: error: the loss became nan at step \d \(learning rate 1e\+30\): try a lower --lr "
        r"\(rank [01]\)", errors[0]), done.stderr


@pytest.mark.slow
def test_under_torchrun_each_rank_prints_its_message_once(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "tensorpar", "train", "--tp", "4", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("tensorpar train: error:")]
    # Each rank prints it at most once; torchrun stops a rank still starting when its peer has failed.
    line = "tensorpar train: error: --tp 4 needs at least 4 processes; the torchrun world size is 2"
    assert ours in ([line], [line, line]), done.stderr
    # torchrun's own failure summary shows the line too; no traceback passes through tensorpar's code.
    assert "traceback : --tp 4 needs at least 4 processes; the torchrun world size is 2" in done.stderr
    assert not re.search(r'File "[^"]*tensorpar[/\\]', done.stderr), done.stderr


# ------------------------------------------------------------------ --init-from-hf, --init-from

def _main_body(argv):
    """``tensorpar ARGV`` in a rank: (exit status, what it printed on stderr)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random Llama over the byte vocabulary, saved with safetensors."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("hf") / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(directory)
    return directory


def test_init_from_hf_reads_local_directories_as_data(capsys, files, hf_dir, tmp_path, monkeypatch):
    import builtins
    import json
    import shutil

    assert _train_error(capsys, "--init-from-hf", "org/name") == (
        "--init-from-hf: org/name: no such local directory (models are read from local directories only, never "
        "downloaded: fetch it first, e.g. hf download org/name --local-dir DIR)")
    evil, marker = tmp_path / "evil", tmp_path / "ran"
    shutil.copytree(hf_dir, evil)
    (evil / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "evil.Config"}}))
    (evil / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.setattr(builtins, "input", lambda *args: "y")  # as if the user said yes
    assert _train_error(capsys, "--init-from-hf", str(evil)) == (
        f"--init-from-hf: {evil / 'config.json'}: unsupported model_type 'evil'; supported: gpt2, llama, mistral, "
        "qwen2, qwen3, mixtral, qwen3_moe (a model directory's own code is never run)")
    assert not marker.exists()
    config = json.loads((hf_dir / "config.json").read_text())
    shutil.rmtree(evil)
    shutil.copytree(hf_dir, evil)
    (evil / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    assert _train_error(capsys, "--init-from-hf", str(evil)) == (
        f"--init-from-hf: {evil / 'model.safetensors'}: tensor 'model.layers.0.mlp.gate_proj.weight' has shape "
        "[48, 32]; config.json gives [40, 32] (intermediate_size 40, hidden_size 32)")
    for run in (files / "run", files / "run" / "step_2"):
        assert _train_error(capsys, "--init-from-hf", str(run)) == (
            f"--init-from-hf {run} is a tensorpar run, not a Hugging Face model: use --resume {run} to continue it, "
            f"or --init-from {run} for its weights only")


def test_nan_weights_are_named(hf_dir, tmp_path):
    """Headers cannot tell: the rank that reads the values names the tensor, in one line, exit 2."""
    import shutil

    from safetensors.torch import load_file, save_file

    damaged = tmp_path / "damaged"
    shutil.copytree(hf_dir, damaged)
    state = load_file(damaged / "model.safetensors")
    state["model.layers.0.input_layernorm.weight"][3] = float("inf")
    save_file(state, damaged / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n" * 100)
    [(code, err)] = run_on_ranks(_main_body, 1, ["train", "--init-from-hf", str(damaged), *TINY[6:], "--tp", "1",
                                                 "--steps", "1", "--data", str(tmp_path / "text.txt"),
                                                 "--out", str(tmp_path / "run")])
    assert (code, err) == (2, f"tensorpar train: error: --init-from-hf: {damaged / 'model.safetensors'}: tensor "
                              "'model.layers.0.input_layernorm.weight' holds NaN or infinite values (in rows 0:32 of "
                              "dim 0): the weights are damaged\n")


def test_init_from_checks(capsys, files, tmp_path):
    run = files / "run"
    assert _train_error(capsys, "--init-from", str(run), "--resume", str(run)) == (
        "--resume and --init-from both say where the run starts: give one of them (--resume continues a run; "
        "--init-from and --init-from-hf start a new one from weights)")
    assert _train_error(capsys, "--init-from", str(tmp_path / "nope")) == \
        f"--init-from: checkpoint {tmp_path / 'nope'}: no such directory"
    assert _train_error(capsys, "--init-from", str(run), "--hidden", "64") == (
        f"--init-from {run}'s model config differs from the one requested: hidden_size: checkpoint 32, requested 64")


def _init_from_body(argv, run):
    from tensorpar import parallel_state as ps
    from tensorpar.training.inference import load_model
    from tensorpar.training.loop import train

    result = train(parse_train_args(argv))
    ps.initialize_model_parallel(2)
    group = ps.get_tensor_model_parallel_group()
    (ours, meta), (theirs, _) = load_model(result.checkpoint, tp_group=group), load_model(run, tp_group=group)
    moved = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    return result.checkpoint, meta["step"], meta["schedule"]["lr"], moved


def test_init_from_takes_the_weights_at_another_tp_size_and_starts_afresh(files, tmp_path):
    """The TP=1 run's weights at TP=2; a fresh optimizer and schedule from step 0 (one step at
    lr 1e-9 moves no weight by more than ~1e-9, while any re-initialized weight would differ)."""
    argv = [*TINY, "--init-from", str(files / "run"), "--tp", "2", "--steps", "1", "--lr", "1e-9", "--min-lr", "0",
            "--warmup", "0", "--data", str(files / "text.txt"), "--out", str(tmp_path / "tuned")]
    results = run_on_ranks(_init_from_body, 2, argv, str(files / "run"))
    for checkpoint, step, lr, moved in results:
        assert checkpoint == str(tmp_path / "tuned" / "step_1") and step == 1 and lr == 1e-9
        assert moved < 1e-6, moved


def test_data_that_is_not_utf8_is_trained_on_its_bytes_and_the_header_says_so(tmp_path):
    """Issue 26: a binary --data trained as if it were text, without a word."""
    data = tmp_path / "blob.dat"
    data.write_bytes(bytes(range(256)) * 40)
    done = run_tensorpar(["train", *TINY, "--nproc", "1", "--tp", "1", "--steps", "1", "--warmup", "0", "--data",
                          str(data), "--out", str(tmp_path / "run")])
    assert done.returncode == 0, done.stderr
    header = next(line for line in done.stdout.splitlines() if "tokens/step, data:" in line)
    assert header.endswith(f"data: --data {data} (not UTF-8 text: trained on its bytes)"), header
