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

from tensorpar.cli import main
from tensorpar.training.cli import parse_train_args
from tensorpar.training.data import DataError, load_corpus, write_token_file
from tests.harness import free_port, run_on_ranks

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
    (["--steps", "0"], "argument --steps: must be a finite number > 0, got 0"),
    (["--nproc", "3", "--tp", "2"], "--tp 2 does not divide --nproc 3"),
    (["--hidden", "66", "--heads", "4"],
     "the hidden size 66 (--hidden) is not divisible by the 4 attention heads (--heads)"),
    (["--nproc", "4", "--tp", "4", "--heads", "6", "--hidden", "48"],
     "the model's 6 attention heads are not divisible by --tp 4"),
    (["--nproc", "4", "--tp", "4", "--ffn-hidden", "130"], "the model's FFN width 130 is not divisible by --tp 4"),
    (["--overlap", "some"], "argument --overlap: expected off, auto or a positive number of chunks, got 'some'"),
    (["--interleave", "0"], "argument --interleave: must be a finite number > 0, got 0"),
    (["--sp", "--seq-len", "33"], "--seq-len 33 is not divisible by --tp 2, as sequence parallelism (--sp) needs"),
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
    (["--model", "huge"], "--model 'huge' is not a preset; choose from ['tiny', 'small', 'medium', 'large', 'xl', "
                          "'llama-tiny']"),
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
    from tensorpar.training.loop import settle_run

    args = parse_train_args(argv)
    meta = {"step": 2, "schedule": schedule} if schedule else None
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
    path = tmp_path / "tokens.bin"
    write_token_file(path, torch.arange(1000) % 700, vocab_size=700)
    (tmp_path / "tokens.bin.json").write_text('{"format": "tensorpar-tokens", "dtype": "uint16", "vocab_size": 500}')
    assert _train_error(capsys, "--data", str(path)) == \
        f"--data {path}: holds token id 699, outside its vocab_size 500 (from {path}.json)"
    with open(path, "ab") as f:
        f.write(b"\0")
    assert _train_error(capsys, "--data", str(path)) == f"--data {path}: size 2001 bytes is not a multiple of uint16 (2 bytes)"


def test_a_missing_path_is_refused_before_the_slow_imports(tmp_path):
    """Checked before torch.distributed.checkpoint (about a second) or transformers (seconds) is imported."""
    nope = str(tmp_path / "nope")
    code = f"""if True:
        import sys
        from tensorpar.cli import main
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


def test_generate_checks(capsys, files, tmp_path):
    def error(*argv):
        return _fails(capsys, ["generate", *argv]).removeprefix("tensorpar generate: error: ")

    assert error("--checkpoint", str(tmp_path / "nope")) == \
        f"--checkpoint {tmp_path / 'nope'}: no such file or directory"
    assert error("--checkpoint", str(files / "run"), "--prompt", "") == \
        "--prompt is empty: give at least one token to continue"
    assert error("--checkpoint", str(files / "run"), "--nproc", "8", "--tp", "8") == \
        "the model's 4 attention heads are not divisible by --tp 8"
    assert error("--checkpoint", str(files / "odd"), "--prompt", "def f") == (
        "--prompt 'def f': this checkpoint was trained on a token file, so the prompt is token ids separated by "
        "spaces (e.g. --prompt \"464 2068\"); 'def' is not one")
    assert error("--checkpoint", str(files / "odd"), "--prompt", "5 300") == \
        "--prompt: token id 300 is outside the model's vocabulary of 300"


@pytest.mark.parametrize("argv, fits, world", [([], True, (1, 1)), ([], False, (2, 2)),
                                                ([], None, (1, 1)), (["--nproc", "2"], True, (2, 2))])
def test_generate_of_a_small_checkpoint_runs_in_this_process(files, monkeypatch, capsys, argv, fits, world):
    import tensorpar.training.cli as training_cli

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


def test_export_writes_eos_inside_the_vocabulary(files, tmp_path):
    import json

    assert run_on_ranks(_export_body, 1, str(files / "run"), str(tmp_path / "hf")) == [0]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == 257 and config["bos_token_id"] == config["eos_token_id"] == 256


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
     "tensorpar train: error: argument --seed: must be a finite number in [0, 4294967296), got "
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
    with pytest.raises(DataError, match="dtype 'float16'"):
        load_corpus(path)


def test_two_torchrun_nodes_on_localhost_train_together(tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
              "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
              "-m", "tensorpar.cli", "train", "--tp", "2", "--steps", "3", *TINY, "--out", str(tmp_path / "run")]
    nodes = [subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "TP=2 DP=1" in "".join(outputs)
    assert (tmp_path / "run" / "latest").read_text().strip() == "step_3"


def test_an_exception_inside_a_rank_reaches_the_user_as_one_line(tmp_path):
    """Two real ranks; the loss diverges inside them (nothing a preflight can see)."""
    done = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--nproc", "2", "--lr", "1e30", "--steps", "5",
                           "--warmup", "1", "--log-every", "100", *TINY, "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr + done.stdout
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and re.fullmatch(
        r"tensorpar train: error: the loss became nan at step \d \(learning rate 1e\+30\): try a lower --lr "
        r"\(rank [01]\)", errors[0]), done.stderr


def test_under_torchrun_each_rank_prints_its_message_once(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "tensorpar", "train", "--tp", "4", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("tensorpar train: error:")]
    assert ours == ["tensorpar train: error: --tp 4 does not divide the torchrun world size 2"] * 2, done.stderr
    # torchrun's own failure summary shows the line too; no traceback passes through tensorpar's code.
    assert "traceback : --tp 4 does not divide the torchrun world size 2" in done.stderr
    assert not re.search(r'File "[^"]*tensorpar[/\\]', done.stderr), done.stderr
