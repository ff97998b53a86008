"""``tensorpar train --cp N``: the same run as CP=1, resumable at CP=1, and what it refuses.

One shared sequence of tiny runs (module fixture) on the harness's persistent worlds, all on the
same global batch, with a sequence length (10) that 2 x CP does not divide: CP 1 without and with
dropout (hidden and attention); CP 2 p2p (checkpointing at step 2); CP 2 a2a and TP 2 x CP 2 p2p
with SP, both with dropout; the p2p run resumed at CP 1.
"""

import json

import pytest

from tensorpar.cli.main import main
from tensorpar.cli.training_cli import parse_train_args
from tests.harness import run_on_ranks

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "10", "--steps", "4", "--warmup", "1",
        "--lr", "1e-2", "--micro-batch", "2", "--global-batch", "2", "--eval-every", "4", "--eval-iters", "1",
        "--log-every", "1", "--no-progress", "--seed", "5"]
# Hidden and attention dropout: CP draws each token's mask, and each (head, query, key)'s, as CP=1 does.
DROPOUT = ["--dropout", "0.1"]


def _train_body(argv):
    import contextlib
    import io

    from tensorpar.training.loop import train

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = train(parse_train_args(argv))
    return result.losses, result.val_losses, out.getvalue()


def _grad_norms(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["grad_norm"] for row in rows if "loss" in row]  # not the validation rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    cases = {"cp1": (1, ["--tp", "1"]), "p2p": (2, ["--tp", "1", "--cp", "2", "--save-every", "2"]),
             "cp1 dropout": (1, ["--tp", "1", *DROPOUT]),
             "a2a": (2, ["--tp", "1", "--cp", "2", "--cp-comm", "a2a", *DROPOUT]),
             "tp2cp2": (4, ["--tp", "2", "--cp", "2", "--sp", *DROPOUT]),
             "resumed": (1, ["--tp", "1", "--resume", str(root / "p2p" / "step_2")])}
    return root, {name: run_on_ranks(_train_body, world, TINY + flags + ["--out", str(root / name)])
                  for name, (world, flags) in cases.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name, reference", [("p2p", "cp1"), ("a2a", "cp1 dropout"), ("tp2cp2", "cp1 dropout")])
def test_cp2_trains_the_cp1_run(runs, name, reference):
    """Losses, validation loss and grad norm (each element counted once) equal CP=1's; every rank logs them."""
    root, results = runs
    (losses, val, _), = results[reference]
    assert list(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    for rank_losses, rank_val, _ in results[name]:
        assert rank_losses == results[name][0][0]  # the same loss on every rank
        assert rank_losses == pytest.approx(losses, rel=1e-5) and rank_val == pytest.approx(val, rel=1e-5)
    assert _grad_norms(root / name) == pytest.approx(_grad_norms(root / reference), rel=1e-5)


@pytest.mark.slow
def test_the_header_and_meta_name_the_cp_layout(runs):
    root, results = runs
    assert ("TP=2 CP=2 (p2p: K/V ring; each sequence in 4 chunks of 4 tokens, padded to 16, CP rank i holding "
            "chunks i and 3-i) DP=1") in results["tp2cp2"][0][2]
    assert "TP=1 DP=1," in results["cp1"][0][2]
    meta = json.loads((root / "p2p" / "step_4" / "meta.json").read_text())
    assert meta["world"] == {"tp": 1, "dp": 1, "cp": 2} and meta["ranks"] == 2


@pytest.mark.slow
def test_a_cp2_checkpoint_resumes_at_cp1_on_the_uninterrupted_losses(runs):
    root, results = runs
    (losses, _, out), = results["resumed"]
    assert list(losses) == [3, 4]
    assert losses == pytest.approx({step: results["cp1"][0][0][step] for step in (3, 4)}, rel=1e-5)
    assert f"resuming {root / 'p2p' / 'step_2'} at step 2 of 4: TP 1->1, CP 2->1, DP 1->1;" in out


def _train_error(capsys, *argv):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.removesuffix("\n").removeprefix("tensorpar train: error: ")


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "6", "--tp", "2", "--cp", "2"],
     "--tp 2 x --cp 2 = 4 does not divide --nproc 6: the world is TP x CP x DP"),
    (["--nproc", "2", "--cp", "4"], "--tp 1 x --cp 4 needs at least 4 processes; --nproc is 2"),
    (["--nproc", "4", "--tp", "1", "--cp", "4", "--cp-comm", "a2a", "--heads", "2"],
     "--cp-comm a2a needs at least one query head per TP x CP rank: the model's 2 heads at --tp 1 are 2 per TP "
     "rank, fewer than --cp 4; use --cp-comm p2p, which has no such limit"),
    (["--nproc", "4", "--tp", "2", "--cp", "2", "--cp-comm", "a2a", "--heads", "3"],
     "--cp-comm a2a needs at least one query head per TP x CP rank: the model's 3 heads at --tp 2 are 1 on the "
     "smallest TP rank, fewer than --cp 2; use --cp-comm p2p, which has no such limit"),
    (["--nproc", "2", "--tp", "1", "--cp", "2", "--fsdp", "--compile", "--dropout", "0.1"],
     "--cp 2 does not combine with --compile (not supported under context parallelism); drop them, or train with "
     "--cp 1"),
    (["--nproc", "2", "--tp", "1", "--cp", "2", "--cp-comm", "a2a", "--tp-invariant", "--dropout", "0.1"],
     "--tp-invariant with --cp 2 cannot give the CP 1 bits with attention dropout (its keyed masks are not drawn "
     "per CP rank yet; --attention-dropout 0 keeps the hidden dropout)"),
    (["--nproc", "2", "--tp", "1", "--cp", "2", "--interleave", "2"],
     "--cp 2 does not combine with --interleave 2 (not supported under context parallelism); drop them, or "
     "train with --cp 1"),
])
def test_what_cp_cannot_run_is_refused_in_one_line_before_launch(capsys, tmp_path, argv, message):
    assert _train_error(capsys, *argv, "--layers", "1", "--hidden", "24", "--seq-len", "8",
                        "--out", str(tmp_path / "run")) == message


def test_a_meta_json_names_cp_in_its_world_and_ranks_count_it(tmp_path):
    from tensorpar.training.schema import SchemaError, check_meta
    from tests.test_training_checkpoint import checkpoint_meta

    meta = {**checkpoint_meta(step=1, tp=2, dp=1), "world": {"tp": 2, "cp": 2, "dp": 1},
            "rng": {"cpu": [5056]}, "ranks": 4}
    check_meta(tmp_path / "meta.json", meta)
    with pytest.raises(SchemaError, match=r"field 'ranks' is 2, but field 'world' is TP 2 x CP 2 x DP 1$"):
        check_meta(tmp_path / "meta.json", {**meta, "ranks": 2})
    with pytest.raises(SchemaError, match=r"field 'world.cp' is 0; expected an integer"):
        check_meta(tmp_path / "meta.json", {**meta, "world": {"tp": 2, "cp": 0, "dp": 1}})
