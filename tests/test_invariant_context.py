"""TP-invariant mode under context parallelism (issues 29 and 30): ``tensorpar train --tp-invariant
--cp-comm a2a`` at (TP, CP, DP) = (1, 2, 1), (2, 2, 1) with and without SP, (1, 4, 1), (1, 2, 2), and
with ``--fsdp`` over DP x CP, trains the bits of (1, 1, 1);
what it cannot keep bit-identical is refused in one line."""

from __future__ import annotations

import re

import pytest
import torch

from tensorpar.distributed.tree_reduce import balanced_order, sequence_sum, tree_sum
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
LLAMA = ["--norm", "rmsnorm", "--activation", "swiglu", "--position-embedding", "rope"]
# (TP, CP, DP) and flags; DP 2 runs one of the step's 2 micro-batches per DP rank. FSDP shards over
# DP x CP: 2 ranks at 1x2 and 2x2-sp, 4 at 1x2xdp2; HSDP there: shards over CP, replicas over DP.
LAYOUTS = {"1x1": (1, 1, 1), "1x2": (1, 2, 1), "2x2": (2, 2, 1), "2x2-sp": (2, 2, 1, "--sp"), "1x4": (1, 4, 1),
           "1x2xdp2": (1, 2, 2), "1x2-fsdp": (1, 2, 1, "--fsdp"), "2x2-sp-fsdp": (2, 2, 1, "--sp", "--fsdp", "--fsdp-min-unit-mib", "0"),
           "1x2xdp2-fsdp": (1, 2, 2, "--fsdp"), "1x2xdp2-hsdp": (1, 2, 2, "--fsdp", "--dp-replicate", "2")}


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
@pytest.mark.parametrize("model, layouts", [([], list(LAYOUTS)), (LLAMA, ["1x1", "2x2-sp", "1x4"])],
                         ids=["gpt2-gqa", "llama-gqa"])
def test_training_is_bit_identical_at_any_cp_size(tmp_path, model, layouts):
    """(TP, CP, DP) = (1, 2, 1), (2, 2, 1) with and without SP, (1, 4, 1), (1, 2, 2), and GPT-2 with
    FSDP or HSDP over DP x CP (the CP ranks' identical gradients entering FSDP's tree once), against
    (1, 1, 1): training and validation losses == at every step, final weights torch.equal."""
    runs = {}
    for name in layouts:
        tp, cp, dp, *flags = LAYOUTS[name]
        runs[name] = run_on_ranks(_run_body, tp * cp * dp, RUN + model + ["--tp", str(tp), "--cp", str(cp), *flags,
                                                                            "--out", str(tmp_path / name)],
                                  timeout=300)[0]
    losses, val_losses, ckpt = runs["1x1"]
    assert list(losses) == [1, 2, 3] and list(val_losses) == [3]
    assert {layout: run[:2] for layout, run in runs.items()} == {layout: (losses, val_losses) for layout in layouts}
    reference = run_on_ranks(_weights_body, 1, str(ckpt))[0]
    assert {layout: _differing_weights(run[2], reference) for layout, run in runs.items()} == \
        {layout: [] for layout in layouts}


@pytest.mark.parametrize("cp, flags, named", [
    (2, [], "p2p attention (the ring adds the partial attention of each rank's keys in an order that depends on "
            "the CP size: use a2a)"),
    (3, ["--cp-comm", "a2a"], "CP size 3 (the 8 fixed sequence blocks make 2 x CP whole chunks at CP 1, 2 and 4 "
                              "only)"),
], ids=["p2p", "cp3"])
def test_train_refuses_what_cp_cannot_keep_bit_identical(capsys, cp, flags, named):
    from tensorpar.cli.main import main

    assert main(["train", "--nproc", str(cp), "--cp", str(cp), "--tp-invariant", "--layers", "1", "--hidden", "32",
                 "--heads", "4", "--seq-len", "16", "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert f"--tp-invariant with --cp {cp} cannot give the CP 1 bits with {named}" in err
    assert "Traceback" not in err


def test_train_takes_fsdp_over_dp_x_cp_and_refuses_one_shard(capsys):
    """``--fsdp --tp-invariant --cp 2`` is a run (``--print-config``: checked, nothing launched);
    HSDP with every replica one rank of DP x CP is refused, naming DP x CP."""
    from tensorpar.cli.main import main

    run = ["train", "--nproc", "2", "--cp", "2", "--cp-comm", "a2a", "--tp-invariant", "--fsdp", "--layers", "1",
           "--hidden", "32", "--heads", "4", "--seq-len", "16", "--steps", "1"]
    assert main([*run, "--print-config"]) == 0
    assert "fsdp = true" in capsys.readouterr().out
    assert main([*run, "--dp-replicate", "2"]) == 2
    err = capsys.readouterr().err
    assert "--fsdp with --tp-invariant shards over DP x CP / --dp-replicate = 2 / 2 = 1 rank" in err
    assert "Traceback" not in err


def test_sharded_grad_sync_takes_a_cp_group_that_is_an_aligned_run_of_the_mesh():
    """CP rank 0's sums are the DP tree's leaves only if the CP ranks are consecutive in the FSDP
    mesh (in its order, the tree's), starting at a multiple of CP; and only in the mode's tree."""
    from tensorpar.data_parallel.fsdp import ShardedGradSync, _check_cp_inner

    _check_cp_inner([0, 1, 2, 3], [2, 3])
    for cp_ranks in ([0, 2], [1, 2], [4, 5]):
        with pytest.raises(ValueError, match=re.escape(f"cp_group= ranks {cp_ranks} are not one aligned run of the "
                                                       "FSDP mesh's ranks [0, 1, 2, 3]: shard over the DP x CP group")):
            _check_cp_inner([0, 1, 2, 3], cp_ranks)
    with pytest.raises(ValueError, match="cp_group= applies with micro_batches="):
        ShardedGradSync(torch.nn.Linear(2, 2), cp_group=object())


def test_the_library_names_what_cp_cannot_keep_bit_identical():
    from tensorpar.models import GPTConfig
    from tensorpar.models.context_split import invariant_refusals

    config = GPTConfig(vocab_size=96, max_seq_len=16, num_layers=1, num_heads=12, num_query_groups=2, hidden_size=96,
                       tp_invariant=True, context_parallel_comm="a2a")
    # Grouped K/V heads go to the CP ranks once per query head: any split of a group's 6 query heads.
    assert invariant_refusals(config, tp_size=1, cp_size=4, sequence_parallel=False) == []
    assert invariant_refusals(config, tp_size=4, cp_size=4, sequence_parallel=True) == [
        "sequence parallelism at TP 4 x CP 4 (more ranks than the 8 fixed sequence blocks)"]


def _p2p_refusal_body():
    import torch.distributed as dist

    from tensorpar.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=96, max_seq_len=16, num_layers=1, num_heads=4, hidden_size=32, tp_invariant=True)
    try:
        GPT(config, tp_group=dist.new_group([dist.get_rank()]), cp_group=dist.new_group([0, 1]), device="cpu")
    except ValueError as error:
        return str(error)


def test_a_gpt_refuses_p2p_in_the_invariant_mode_in_one_line():
    assert run_on_ranks(_p2p_refusal_body, 2)[0] == (
        "tp_invariant under context parallelism does not support p2p attention (the ring adds the partial attention "
        "of each rank's keys in an order that depends on the CP size: use a2a)")


def _dropout_body(comm_type):
    import torch.distributed as dist

    import tensorpar as tp
    from tensorpar.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=96, max_seq_len=16, num_layers=2, num_heads=4, num_query_groups=2, hidden_size=32,
                       tp_invariant=True, dropout=0.1, attention_dropout=0.0, context_parallel_comm=comm_type)
    one, world = dist.new_group([dist.get_rank()]), dist.new_group([0, 1])
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for cp_group in (None, world):  # CP 1 on each rank, then CP 2: the same seed, the same masks' keys
        tp.model_parallel_manual_seed(11, tp_group=one)
        model = GPT(config, tp_group=one, cp_group=cp_group, device="cpu")
        for _ in range(2):  # two forwards: the second draws the next key's masks
            model.zero_grad()
            loss = model(tokens, tokens.roll(-1, dims=1))
            loss.backward()
        results.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    (loss1, grads1), (loss2, grads2) = results
    return bool(loss1 == loss2), [name for name in grads1 if not torch.equal(grads1[name], grads2[name])]


@pytest.mark.slow
def test_hidden_dropout_under_cp_draws_the_cp1_masks_bit_for_bit():
    """A GPT with hidden dropout at CP 2 (a2a): the loss == CP 1's and every parameter's grad
    (complete on each CP rank after backward) torch.equal to it, at the second forward."""
    assert run_on_ranks(_dropout_body, 2, "a2a") == [(True, [])] * 2
