"""``tensorpar train --fsdp`` with the pipeline and context axes: the losses, validation losses
and grad norms of plain DP, and checkpoints that move between FSDP x PP and PP 1 without FSDP.

One module fixture trains the tiny runs on the harness's persistent worlds, all on the same
global batch (2 DP ranks x 2 micro-batches of 2) and clipping at 0.5, which clips: a grad norm
that counted an element twice, or a gradient FSDP averaged over the wrong ranks, changes the
losses from step 2 on.
"""

import contextlib
import io
import json

import pytest

from tensorpar.cli.main import main
from tests.harness import run_on_ranks
from tests.test_training_pipeline import _train_body

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--steps", "4", "--warmup", "1",
        "--lr", "1e-2", "--no-progress", "--seed", "7", "--global-batch", "8", "--micro-batch", "2",
        "--clip-grad", "0.5", "--eval-every", "2", "--eval-iters", "2", "--save-every", "2", "--log-every", "1"]
# fp32 rounding: FSDP divides by DP before its reduce-scatter's sum, the plain reducer too, in other chunks.
RTOL = 1e-6


def _train(world, root, name, *flags):
    return run_on_ranks(_train_body, world, TINY + ["--out", str(root / name), *flags], timeout=300)


def _logged_train_body(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = _train_body(argv)
    return (*result, out.getvalue())


def _grad_norms(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["grad_norm"] for row in rows if "loss" in row]


def _assert_same_run(results, expected, steps=(1, 2, 3, 4)):
    expected_losses, expected_val = expected
    for losses, val in results:  # every rank logs the run's loss
        assert list(losses) == list(steps)
        assert losses == pytest.approx({s: expected_losses[s] for s in steps}, rel=RTOL, abs=0)
        assert val == pytest.approx({s: expected_val[s] for s in val}, rel=RTOL, abs=0) and val


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_axes")
    out = {"root": root, "dp": _train(2, root, "dp", "--tp", "1")[0]}
    out["pp2_fsdp"] = _train(4, root, "pp2_fsdp", "--tp", "1", "--pp", "2", "--fsdp")
    return out


@pytest.mark.slow
def test_fsdp_by_pp2_trains_the_plain_dp_run(runs):
    """TP 1 x PP 2 x DP 2 with each stage sharded over DP: plain DP's losses, evaluations and grad norms."""
    _assert_same_run(runs["pp2_fsdp"], runs["dp"])
    assert _grad_norms(runs["root"] / "pp2_fsdp") == pytest.approx(_grad_norms(runs["root"] / "dp"), rel=RTOL)


@pytest.mark.slow
def test_a_pp2_fsdp_checkpoint_resumes_at_pp1_without_fsdp_and_the_reverse(runs, tmp_path):
    root = runs["root"]
    from_fsdp = _train(2, tmp_path, "pp1", "--tp", "1", "--no-fsdp", "--resume", str(root / "pp2_fsdp" / "step_2"))
    _assert_same_run(from_fsdp, runs["dp"], steps=(3, 4))
    to_fsdp = _train(4, tmp_path, "pp2_fsdp", "--tp", "1", "--pp", "2", "--fsdp", "--resume", str(root / "dp" / "step_2"))
    _assert_same_run(to_fsdp, runs["dp"], steps=(3, 4))


@pytest.mark.slow
def test_fsdp_by_cp2_trains_the_cp2_run_without_fsdp(tmp_path):
    """CP 2 x DP 2, FSDP over the DP x CP group of 4: CP 2's losses with plain DP."""
    plain = _train(4, tmp_path, "cp2", "--tp", "1", "--cp", "2")
    sharded = _train(4, tmp_path, "cp2_fsdp", "--tp", "1", "--cp", "2", "--fsdp")
    _assert_same_run(sharded, plain[0])
    assert _grad_norms(tmp_path / "cp2_fsdp") == pytest.approx(_grad_norms(tmp_path / "cp2"), rel=RTOL)


@pytest.mark.slow
def test_fsdp_by_pp2_by_tp2_with_sp_on_8_ranks_trains_the_plain_dp_run(runs, tmp_path):
    _assert_same_run(_train(8, tmp_path, "tp2pp2", "--tp", "2", "--pp", "2", "--sp", "--fsdp"), runs["dp"])
    # Each stage's shards are saved as boxes on its own (TP, DP) mesh: plain DP continues from them.
    resumed = _train(2, tmp_path, "dp", "--tp", "1", "--no-fsdp", "--resume", str(tmp_path / "tp2pp2" / "step_2"))
    _assert_same_run(resumed, runs["dp"], steps=(3, 4))


def test_fsdp_with_a_v_schedule_and_tied_embeddings_is_refused_in_one_line(capsys, tmp_path):
    assert main(["train", "--nproc", "2", "--pp", "2", "--pp-schedule", "zbv", "--grad-accum", "4", "--fsdp",
                 "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--pp 2 cannot combine with --fsdp with --pp-schedule zbv and tied " \
                                     "embeddings" in err, err


@pytest.mark.slow
def test_hsdp_2x2_trains_the_plain_dp_run_and_its_checkpoint_resumes_without_fsdp(runs, tmp_path):
    """TP 1 x DP 4 as 2 replicas of 2 shards: plain DP's run, grad norms counted once, the mesh in
    the header; its checkpoint continues at DP 2 without FSDP (``--no-fsdp``: FSDP is a resumed setting)."""
    root = runs["root"]
    results = run_on_ranks(_logged_train_body, 4, TINY + ["--out", str(tmp_path / "hsdp"), "--tp", "1", "--fsdp",
                                                           "--dp-replicate", "2"], timeout=300)
    for losses, _, _ in results:  # its validation batches are DP 4's, not DP 2's
        assert losses == pytest.approx(runs["dp"][0], rel=RTOL, abs=0)
    assert _grad_norms(tmp_path / "hsdp") == pytest.approx(_grad_norms(root / "dp"), rel=RTOL)
    assert ("HSDP on a 2 x 2 mesh: dim 0 (dp_replicate) replicates over ranks [0, 2], dim 1 (dp_shard) shards "
            "each TP shard 1/2 over ranks [0, 1]") in results[0][2]
    assert json.loads((tmp_path / "hsdp" / "step_2" / "meta.json").read_text())["settings"]["dp_replicate"] == 2
    resumed = run_on_ranks(_logged_train_body, 2, TINY + ["--out", str(tmp_path / "dp"), "--tp", "1", "--no-fsdp", "--resume",
                                                          str(tmp_path / "hsdp" / "step_2")], timeout=300)
    _assert_same_run([r[:2] for r in resumed], runs["dp"], steps=(3, 4))
    assert "changed: --fsdp on -> off" in resumed[0][2] and "FSDP" not in resumed[0][2]


@pytest.mark.parametrize("flags, message", [
    (["--dp-replicate", "2", "--nproc", "2"], "--dp-replicate 2 applies with --fsdp"),
    (["--fsdp", "--dp-replicate", "3", "--nproc", "4", "--tp", "1"], "--dp-replicate 3 does not divide the DP size 4"),
])
def test_a_bad_dp_replicate_is_refused_in_one_line(capsys, flags, message):
    assert main(["train", *flags, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
