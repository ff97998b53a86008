"""Checkpoint safety: tampering and truncation refused, failed and killed saves lose nothing,
metadata cannot run code, generate and export work from a checkpoint."""

import errno
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from tensorpar.training import checkpoint
from tensorpar.training.cli import parse_train_args
from tests.harness import run_on_ranks

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "32", "--micro-batch", "2",
        "--warmup", "1", "--eval-every", "0", "--no-progress", "--tp", "1"]


def _train_body(argv):
    from tensorpar.training.loop import train

    return train(parse_train_args(argv)).losses


def _failing_save_body(argv):
    """Train 4 steps saving every 2, with the disk 'full' while step 4's DCP files are written."""
    from tensorpar.training import loop

    real_save = checkpoint.dcp.save

    def disk_full(state, storage_writer):
        if "step_4" in str(storage_writer.path):
            (storage_writer.path / "__0_0.distcp").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(state, storage_writer=storage_writer)

    checkpoint.dcp.save = disk_full
    try:
        with pytest.raises(checkpoint.CheckpointError, match=r"step 4 .*No space left.*step_2 is intact"):
            loop.train(parse_train_args(argv))
    finally:
        checkpoint.dcp.save = real_save
    return True


@pytest.fixture(scope="module")
def ckpt_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "run"
    run_on_ranks(_train_body, 1, TINY + ["--steps", "2", "--out", str(out)])
    return out


def _open_body(path):
    ckpt, config, meta = checkpoint.open_checkpoint(path)
    return str(ckpt), meta["step"]


def test_tampered_or_truncated_checkpoint_is_refused(ckpt_run, tmp_path):
    for damage, message in (("flip", "fails its SHA-256 check"), ("truncate", "truncated or corrupt")):
        copy = tmp_path / damage
        shutil.copytree(ckpt_run / "step_2", copy)
        data_file = sorted(copy.glob("*.distcp"))[0]
        blob = bytearray(data_file.read_bytes())
        if damage == "flip":
            blob[len(blob) // 2] ^= 0xFF
        else:
            blob = blob[: len(blob) // 2]
        data_file.write_bytes(bytes(blob))
        with pytest.raises(AssertionError, match=message):
            run_on_ranks(_open_body, 1, str(copy))
    assert run_on_ranks(_open_body, 1, str(ckpt_run)) == [(str(ckpt_run / "step_2"), 2)]


def test_checkpoint_metadata_cannot_run_code(tmp_path):
    class Exploit:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        checkpoint.SafeFileSystemReader(tmp_path).read_metadata()


def test_failed_save_removes_its_tmp_dir_and_keeps_the_previous_checkpoint(tmp_path):
    out = tmp_path / "run"
    assert run_on_ranks(_failing_save_body, 1, TINY + ["--steps", "4", "--save-every", "2",
                                                       "--out", str(out)]) == [True]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_")) == ["step_2"]
    assert (out / "latest").read_text().strip() == "step_2"
    assert run_on_ranks(_open_body, 1, str(out))[0][1] == 2


_KILL_IN_SAVE = """
import os, signal, sys
from tensorpar.training import checkpoint
real_save = checkpoint.dcp.save
def save_then_die(state, storage_writer):
    real_save(state, storage_writer=storage_writer)
    if "step_4" in str(storage_writer.path):
        os.kill(os.getpid(), signal.SIGKILL)   # after the data, before the rename and `latest`
checkpoint.dcp.save = save_then_die
from tensorpar.cli import main
sys.exit(main(sys.argv[1:]))
"""


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
    return subprocess.run([sys.executable, "-m", "tensorpar.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)


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


def test_export_to_transformers_gives_the_same_logits(ckpt_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    proc = _cli("export", "--checkpoint", str(ckpt_run), "--to-hf", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
    ours = run_on_ranks(_our_logits_body, 1, str(ckpt_run), tokens)[0]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
