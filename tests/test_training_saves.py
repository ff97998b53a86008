"""Periodic checkpoints: a save at every evaluation by default, only the newest ``--keep-last``
of the run's own kept (never the one ``latest`` names, nothing else in the directory), and a
resume from them continues the run exactly; a byte-token run's export generates in
``transformers.pipeline`` what ``tensorpar generate`` does."""

import os

import pytest

from tensorpar.training import checkpoint, checkpoint_files
from tensorpar.training.checkpoint_format import MANIFEST
from tensorpar.cli.training_cli import parse_train_args
from tests.cli_runner import run_tensorpar
from tests.harness import run_on_ranks

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "32", "--micro-batch", "2",
        "--warmup", "1", "--eval-iters", "1", "--no-progress", "--seed", "7"]


def _train_body(argv):
    from tensorpar.training.loop import train

    return train(parse_train_args(argv)).losses


def _steps(out):
    return sorted((p.name for p in out.iterdir() if p.name.startswith("step_")), key=lambda n: int(n[5:]))


@pytest.mark.slow
def test_a_run_saves_at_every_evaluation_keeps_the_last_n_and_a_resume_continues_it(tmp_path):
    out = tmp_path / "run"
    argv = TINY + ["--tp", "2", "--eval-every", "2", "--lr-decay-steps", "9", "--out", str(out)]
    full = run_on_ranks(_train_body, 2, argv[:-1] + [str(tmp_path / "full"), "--steps", "9"])[0]
    first = run_on_ranks(_train_body, 2, argv + ["--steps", "7", "--keep-last", "2"])[0]
    # Saved at 2, 4, 6 (the evaluations) and 7 (the end); the last two are kept.
    assert _steps(out) == ["step_6", "step_7"]
    assert (out / "latest").read_text() == "step_7\n"
    for name in _steps(out):
        checkpoint_files.verify(out / name)
    resumed = run_on_ranks(_train_body, 2, argv + ["--steps", "9", "--keep-last", "1", "--resume", str(out)])[0]
    assert list(resumed) == [8, 9]
    assert {**first, **resumed} == full  # bit-identical, not approximately
    assert _steps(out) == ["step_6", "step_7", "step_9"]  # the resumed run removes only its own


@pytest.mark.parametrize("flags, saved", [
    (["--save-every", "0"], ["step_5"]),                            # 0: only at the end
    (["--save-every", "3", "--keep-last", "0"], ["step_3", "step_5"]),  # every 3, all kept
    ([], ["step_2", "step_4", "step_5"]),                           # at every evaluation
])
def test_save_every_defaults_to_the_evaluations_and_0_turns_it_off(tmp_path, flags, saved):
    out = tmp_path / "run"
    run_on_ranks(_train_body, 1, TINY + ["--tp", "1", "--eval-every", "2", "--steps", "5", "--out", str(out), *flags])
    assert _steps(out) == saved and (out / "latest").read_text() == f"{saved[-1]}\n"


def _fake_checkpoint(path, *, complete=True):
    path.mkdir()
    (path / "data").write_text("tensors")
    if complete:
        (path / MANIFEST).write_text("{}")


def test_only_complete_checkpoints_the_run_wrote_are_removed_never_latest_nor_through_a_link(tmp_path):
    out, mine = tmp_path / "run", tmp_path / "users-own"
    out.mkdir()
    for step in (1, 2, 4, 5, 6):
        _fake_checkpoint(out / f"step_{step}")
    _fake_checkpoint(out / "step_3", complete=False)  # not (or no longer) a checkpoint
    _fake_checkpoint(mine)
    os.symlink(mine, out / "step_7")  # a user's link under a step name
    (out / "latest").write_text("step_2\n")  # e.g. an older checkpoint the user pointed it at
    written = ["step_2", "step_3", "step_4", "step_5", "step_7", "step_6"]
    kept = checkpoint.remove_old(out, written, keep=1)
    assert _steps(out) == ["step_1", "step_2", "step_3", "step_6", "step_7"]
    assert kept == ["step_2", "step_6"]  # latest's stays on the list, to go once it is not latest
    assert (mine / "data").read_text() == "tensors" and (out / "step_7").is_symlink()
    assert (out / "step_3" / "data").is_file()
    (out / "latest").write_text("step_6\n")
    assert checkpoint.remove_old(out, kept, keep=1) == ["step_6"]
    assert _steps(out) == ["step_1", "step_3", "step_6", "step_7"]
    assert checkpoint.remove_old(out, ["step_1", "step_6"], keep=0) == ["step_1", "step_6"]  # 0: keep all
    assert not list(out.glob("*.old"))


def _generate_body(ckpt, prompt, tokens):
    import argparse

    from tensorpar.training.inference import generate

    return generate(argparse.Namespace(checkpoint=ckpt, prompt=prompt, tokenizer=None, max_new_tokens=tokens,
                                       temperature=0.0, top_k=40, seed=0, tp=1, timeout=60.0))


@pytest.mark.slow
def test_the_export_of_a_byte_token_run_generates_in_a_transformers_pipeline_what_generate_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    out, hf = tmp_path / "run", tmp_path / "hf"
    run_on_ranks(_train_body, 1, TINY + ["--tp", "1", "--eval-every", "0", "--steps", "30", "--lr", "1e-2",
                                         "--seq-len", "64", "--out", str(out)])
    proc = run_tensorpar(["export", "--checkpoint", str(out), "--to-hf", str(hf)])
    assert proc.returncode == 0, proc.stderr
    assert (hf / "tokenizer.json").is_file()
    pipe = transformers.pipeline("text-generation", model=str(hf))
    for prompt in ("def ", "import os\nclass Tokenizer(", "caf\u00e9 = '\u20ac'"):
        expected = run_on_ranks(_generate_body, 1, str(out), prompt, 20)[0]
        text = pipe(prompt, do_sample=False, max_new_tokens=20)[0]["generated_text"]
        assert len(expected) > len(prompt) and text == expected, (prompt, text, expected)
