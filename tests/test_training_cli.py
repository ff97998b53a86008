"""``tensorpar train`` from the command line: bad input rejected up front, and a two-node launch."""

import os
import subprocess
import sys

import pytest

from tensorpar.cli import main
from tensorpar.training.data import DataError, load_corpus
from tests.harness import free_port

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "32", "--micro-batch", "2",
        "--eval-every", "0", "--no-progress"]


@pytest.fixture
def bad_input(tmp_path, capsys):
    def run(*argv):
        assert main(["train", *argv]) == 2
        return capsys.readouterr().err
    return run


def test_tp_that_does_not_divide_nproc(bad_input):
    assert "--tp 2 does not divide --nproc 3" in bad_input("--nproc", "3", "--tp", "2")


def test_heads_not_divisible_by_tp(bad_input, tmp_path):
    err = bad_input("--nproc", "4", "--tp", "4", "--heads", "6", "--hidden", "48", "--out", str(tmp_path))
    assert "6 attention heads are not divisible by --tp 4" in err


def test_missing_or_empty_data(bad_input, tmp_path):
    assert f"--data {tmp_path / 'nope'}: no such file" in bad_input("--data", str(tmp_path / "nope"))
    (tmp_path / "empty.txt").write_text("")
    assert "the file is empty" in bad_input("--data", str(tmp_path / "empty.txt"))
    (tmp_path / "dir").mkdir()
    assert "contains no non-empty files" in bad_input("--data", str(tmp_path / "dir"))


def test_unwritable_out(bad_input, tmp_path):
    (tmp_path / "file").write_text("x")
    assert f"--out {tmp_path / 'file' / 'run'} is not a writable directory" in \
        bad_input("--out", str(tmp_path / "file" / "run"))


def test_resume_from_a_directory_without_checkpoint(bad_input, tmp_path):
    assert f"--resume {tmp_path}" in bad_input("--resume", str(tmp_path))


def test_unknown_flag_and_preset(bad_input, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--bogus"])
    assert exc.value.code == 2 and "--bogus" in capsys.readouterr().err
    assert "--model 'huge' is not a preset" in bad_input("--model", "huge")


def test_token_file_sidecar_is_validated(tmp_path):
    from tensorpar.training.data import write_token_file
    import torch

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
