"""TP-invariant mode under context parallelism (issues 29 and 30): ``tensorpar train --tp-invariant
--cp-comm a2a`` at (TP, CP) = (1, 2), (2, 2), (1, 4) trains the bits of (1, 1); what it cannot
keep bit-identical is refused in one line."""

from __future__ import annotations

import pytest
import torch

from tensorpar.tree_reduce import balanced_order, sequence_sum, tree_sum
from tests.harness import run_on_ranks
from tests.test_invariant import _weights_body
from tests.test_invariant_dp import _differing_weights, _run_body

# GPT-2-style (learned positions, LayerNorm, biases) with 2 KV heads for 4 query heads: at CP 4 and
# at TP 2 x CP 2 each rank has one query head and a KV head replicated over two ranks. 2
# micro-batches per step (each one's grads summed over CP in backward), clipping on every step.
RUN = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--seq-len", "16", "--steps", "3",
       "--micro-batch", "2", "--global-batch", "4", "--warmup", "1", "--lr", "1e-2", "--clip-grad", "0.1",
       "--eval-every", "3", "--eval-iters", "1", "--no-progress", "--seed", "3", "--tp-invariant",
       "--cp-comm", "a2a"]


def test_each_cp_ranks_blocks_are_a_subtree_of_the_cp1_tree():
    """CP rank i's blocks (chunks i and 2CP-1-i), summed in balanced order, then added pairwise in
    rank order: the CP 1 bits at CP 2 and 4; the natural order's tree is not that."""
    blocks = [torch.randn(16, generator=torch.Generator().manual_seed(i)) * 10.0 ** (i % 4) for i in range(8)]
    assert balanced_order(8) == [0, 7, 1, 6, 2, 5, 3, 4]
    whole = sequence_sum(b.clone() for b in blocks)
    for cp in (2, 4):
        chunk = 8 // (2 * cp)
        ranks = [[b.clone() for b in blocks[r * chunk:(r + 1) * chunk] + blocks[8 - (r + 1) * chunk:8 - r * chunk]]
                 for r in range(cp)]
        assert torch.equal(tree_sum([sequence_sum(mine) for mine in ranks]), whole)
    assert not torch.equal(tree_sum([b.clone() for b in blocks]), whole)  # the blocks are ones whose order shows


@pytest.mark.slow
def test_training_is_bit_identical_at_any_cp_size(tmp_path):
    """(TP, CP) = (1, 2), (2, 2), (1, 4) against (1, 1): training and validation losses == at every
    step, final weights torch.equal."""
    layouts = [(1, 1), (1, 2), (2, 2), (1, 4)]
    runs = {(tp, cp): run_on_ranks(_run_body, tp * cp, RUN + ["--tp", str(tp), "--cp", str(cp),
                                                               "--out", str(tmp_path / f"{tp}x{cp}")],
                                   timeout=300)[0] for tp, cp in layouts}
    losses, val_losses, ckpt = runs[1, 1]
    assert list(losses) == [1, 2, 3] and list(val_losses) == [3]
    assert {layout: run[:2] for layout, run in runs.items()} == {layout: (losses, val_losses) for layout in layouts}
    reference = run_on_ranks(_weights_body, 1, str(ckpt))[0]
    assert {layout: _differing_weights(run[2], reference) for layout, run in runs.items()} == \
        {layout: [] for layout in layouts}


@pytest.mark.parametrize("flags, named", [
    (["--cp", "2"], "p2p attention (the ring adds the partial attention of each rank's keys in an order that "
                    "depends on the CP size: use a2a)"),
    (["--cp", "2", "--cp-comm", "a2a", "--tp", "2", "--sp"], "sequence parallelism (not yet)"),
], ids=["p2p", "sp"])
def test_train_refuses_what_cp_cannot_keep_bit_identical(capsys, flags, named):
    from tensorpar.tools.cli import main

    assert main(["train", "--nproc", "4", "--tp-invariant", "--layers", "1", "--hidden", "32", "--heads", "4",
                 "--seq-len", "16", "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert f"--tp-invariant with --cp 2 cannot give the CP 1 bits with {named}" in err
    assert "Traceback" not in err
