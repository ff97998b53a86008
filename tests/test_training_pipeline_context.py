"""``tensorpar train --pp N --cp M``: pipeline stages whose attention runs over the CP group train
the PP 1 x CP 1 run (issues 28-30).

One module fixture of tiny runs on the harness's persistent worlds, all on one global batch of 2
micro-batches, with a sequence length (10) that 2 x CP does not divide (each CP rank's chunks are
padded, and so is what passes between the stages): PP 1 x CP 1; PP 2 x CP 2 in p2p with 1F1B
(checkpointing at step 2) and in a2a with interleaved 1F1B (2 stages per rank); the p2p run
resumed at PP 1 x CP 1. TP 2 x CP 2 x PP 2 with SP (8 ranks), hidden dropout and the invariant
mode's bits are tests of their own.
"""

import json

import pytest

from tests.harness import run_on_ranks
from tests.test_invariant import _weights_body
from tests.test_invariant_dp import _differing_weights, _run_body
from tests.test_training_context import _train_body
from tests.test_training_pipeline import _assert_close

# 4 layers: interleaved 1F1B at PP 2 holds 2 stages per rank. Clipping at 0.5 clips.
TINY = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq-len", "10", "--steps", "4", "--warmup", "1",
        "--lr", "1e-2", "--no-progress", "--seed", "7", "--global-batch", "4", "--micro-batch", "2",
        "--clip-grad", "0.5", "--eval-every", "2", "--eval-iters", "3", "--log-every", "1"]
PP2XCP2 = ["--tp", "1", "--pp", "2", "--cp", "2"]


def _train(world, out, *flags):
    return run_on_ranks(_train_body, world, TINY + ["--out", str(out), *flags], timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp_cp")
    cases = {"pp1": (1, ["--tp", "1"]),
             "p2p-1f1b": (4, [*PP2XCP2, "--save-every", "2"]),
             "a2a-interleaved": (4, [*PP2XCP2, "--cp-comm", "a2a", "--pp-schedule", "interleaved-1f1b"]),
             "resumed": (1, ["--tp", "1", "--resume", str(root / "p2p-1f1b" / "step_2")])}
    return root, {name: _train(world, root / name, *flags) for name, (world, flags) in cases.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["p2p-1f1b", "a2a-interleaved"])
def test_pp2_x_cp2_trains_the_pp1_x_cp1_run_on_every_rank(runs, name):
    """Training and validation losses within fp32 rounding (1e-6 relative) of PP 1 x CP 1's."""
    _, results = runs
    (losses, val, _), = results["pp1"]
    assert list(losses) == [1, 2, 3, 4] and list(val) == [2, 4] and losses[4] < losses[1]
    for rank_losses, rank_val, _ in results[name]:
        _assert_close(rank_losses, losses)
        _assert_close(rank_val, val)


@pytest.mark.slow
def test_the_header_meta_and_a_resume_at_pp1_x_cp1_name_the_layout(runs):
    """The header names TP, CP (how, and the chunks), DP, PP and the stages; the checkpoint's world
    all four; resumed at PP 1 x CP 1 it continues the uninterrupted losses, naming both changes."""
    root, results = runs
    out = results["p2p-1f1b"][0][2]
    assert ("TP=1 CP=2 (p2p: K/V ring; each sequence in 4 chunks of 3 tokens, padded to 12, CP rank i holding "
            "chunks i and 3-i) DP=1 PP=2,") in out
    assert "pipeline 1f1b, stage 0 (PP rank 0): layers 0-1, stage 1 (PP rank 1): layers 2-3" in out
    meta = json.loads((root / "p2p-1f1b" / "step_4" / "meta.json").read_text())
    assert meta["world"] == {"tp": 1, "dp": 1, "pp": 2, "cp": 2} and meta["ranks"] == 4
    (losses, _, out), = results["resumed"]
    assert list(losses) == [3, 4]
    _assert_close(losses, results["pp1"][0][0])
    assert "at step 2 of 4: TP 1->1, CP 2->1, DP 1->1, PP 2->1;" in out


@pytest.mark.slow
def test_tp2_x_cp2_x_pp2_with_sp_trains_the_pp1_x_cp1_run(runs, tmp_path):
    """8 ranks: SP inside each stage, the CP split on top (chunks of 4 tokens: 10 padded to 16)."""
    _, results = runs
    (losses, val, _), = results["pp1"]
    for rank_losses, rank_val, _ in _train(8, tmp_path, "--tp", "2", "--pp", "2", "--cp", "2", "--sp"):
        _assert_close(rank_losses, losses)
        _assert_close(rank_val, val)


@pytest.mark.slow
def test_hidden_dropout_at_pp2_x_cp2_draws_the_masks_of_pp2_x_cp1(tmp_path):
    """A Llama-style model (rotary positions in every stage) with hidden dropout: PP draws the masks
    in the schedule's order, so the reference is PP 2 x CP 1; CP 2 gives each token of every stage,
    the later one's padded chunks too, its global position's mask and rotation."""
    llama = ["--norm", "rmsnorm", "--activation", "swiglu", "--position-embedding", "rope", "--dropout", "0.1",
             "--attention-dropout", "0", "--pp", "2", "--tp", "1"]
    (losses, val, _), _ = _train(2, tmp_path / "cp1", *llama)
    for rank_losses, rank_val, _ in _train(4, tmp_path / "cp2", *llama, "--cp", "2"):
        _assert_close(rank_losses, losses)
        _assert_close(rank_val, val)


# The invariant mode's run: a tied-embedding GPT-2 (the embedding group sums the two copies per
# micro-batch), hidden dropout (masks keyed by global position), 16 tokens (2 x CP x the 8 fixed
# sequence blocks' multiple: no padding), clipping on every step. The Llama-style model has 2 KV
# heads for 4 query heads: at TP 2 x CP 2 each rank attends with one query head.
INVARIANT = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--steps", "3", "--micro-batch", "1",
             "--global-batch", "2", "--warmup", "1", "--lr", "1e-2", "--clip-grad", "0.1", "--eval-every", "3",
             "--eval-iters", "2", "--no-progress", "--seed", "3", "--tp-invariant", "--dropout", "0.1",
             "--attention-dropout", "0", "--cp-comm", "a2a"]
LLAMA_GQA = ["--norm", "rmsnorm", "--activation", "swiglu", "--position-embedding", "rope", "--kv-heads", "2"]
TP2XCP2XPP2 = ["--tp", "2", "--pp", "2", "--cp", "2", "--sp"]


@pytest.mark.slow
@pytest.mark.parametrize("model, layouts", [([], [PP2XCP2, TP2XCP2XPP2]), (LLAMA_GQA, [TP2XCP2XPP2])],
                         ids=["gpt2", "llama-gqa"])
def test_the_invariant_mode_at_pp2_x_cp2_is_bit_identical_to_pp1_x_cp1(tmp_path, model, layouts):
    """PP 2 x CP 2 (4 ranks) and TP 2 x CP 2 x PP 2 with SP (8 ranks) against TP 1 x CP 1 x PP 1:
    training and validation losses ==, on every rank, and final weights torch.equal."""
    reference, = run_on_ranks(_run_body, 1, INVARIANT + model + ["--tp", "1", "--out", str(tmp_path / "pp1")],
                              timeout=300)
    assert list(reference[0]) == [1, 2, 3] and list(reference[1]) == [3]
    weights = run_on_ranks(_weights_body, 1, str(reference[2]))[0]
    for k, layout in enumerate(layouts):
        world = 4 if layout is PP2XCP2 else 8
        runs = run_on_ranks(_run_body, world, INVARIANT + model + [*layout, "--out", str(tmp_path / f"run{k}")],
                            timeout=300)
        assert [run[:2] for run in runs] == [reference[:2]] * world, layout
        assert _differing_weights(runs[0][2], weights) == [], layout
