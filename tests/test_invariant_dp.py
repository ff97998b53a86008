"""TP-invariant mode at any DP size (issue 30): with the global batch and micro-batch size fixed,
``tensorpar train --tp-invariant`` at (TP, DP) = (1, 2), (2, 2), (1, 4) trains the bits of (1, 1),
and a run resumed at another DP size continues them."""

from __future__ import annotations

import pytest
import torch

from tensorpar.distributed.tree_reduce import HalvingTree, subtree_sizes, tree_sum
from tests.harness import run_on_ranks
from tests.test_invariant import _weights_body

# 4 micro-batches of 2 per step: grad accumulation 4, 2 and 1 at DP 1, 2 and 4. Clipping at 0.1
# clips every step; evaluation after step 3 runs 3 micro-batches (uneven over 2 or 4 DP ranks).
RUN = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--steps", "4", "--micro-batch", "2",
       "--global-batch", "8", "--warmup", "2", "--lr", "1e-2", "--clip-grad", "0.1", "--eval-every", "2",
       "--eval-iters", "3", "--no-progress", "--seed", "7", "--tp-invariant", "--dropout", "0.1"]
LLAMA = ["--norm", "rmsnorm", "--activation", "swiglu", "--position-embedding", "rope", "--kv-heads", "2"]


def _run_body(argv):
    from tensorpar.cli.training_cli import parse_train_args
    from tensorpar.training.loop import train

    result = train(parse_train_args(argv))
    return result.losses, result.val_losses, result.checkpoint


def _train(tp_size: int, dp_size: int, out, *extra):
    return run_on_ranks(_run_body, tp_size * dp_size, RUN + ["--tp", str(tp_size), "--out", str(out), *extra],
                        timeout=300)[0]


def _differing_weights(ckpt, reference) -> list[str]:
    weights = run_on_ranks(_weights_body, 1, str(ckpt))[0]
    assert weights.keys() == reference.keys()
    return [name for name in weights if not torch.equal(weights[name], reference[name])]


def test_halving_tree_sums_each_dp_ranks_piece_as_a_subtree():
    """Summed whole, or as 2 or 4 pieces finished pairwise in rank order: the same bits; other
    orders of the same fp32 parts are not."""
    parts = [torch.randn(64, generator=torch.Generator().manual_seed(i)) * 10.0 ** (i % 5) for i in range(12)]
    assert subtree_sizes(12) == [1, 2, 4] and subtree_sizes(7) == [1]

    def tree(pieces):  # each piece's tree on its own, then pairwise across the pieces
        sums = []
        for piece in pieces:
            streamed = HalvingTree(leaves=len(piece))
            sums.append([streamed.add(p.clone()) for p in piece][-1])
        return tree_sum(sums)

    whole = tree([parts])
    for ranks in (2, 4):
        assert torch.equal(tree([parts[r * 12 // ranks:(r + 1) * 12 // ranks] for r in range(ranks)]), whole)
    chained = sum(parts[1:], parts[0].clone())
    assert not torch.equal(chained, whole)  # the parts are ones whose order shows
    halves = tree_sum([sum(parts[i + 1:i + 3], parts[i].clone()) for i in (0, 3, 6, 9)])
    assert torch.equal(halves, whole)       # halves of halves, then chains of 3
    single = HalvingTree(leaves=1)
    assert torch.equal(single.add(parts[0].clone()), parts[0])
    with pytest.raises(RuntimeError, match="more than its 1 parts"):
        single.add(parts[1])


@pytest.mark.slow
@pytest.mark.parametrize("model", [[], LLAMA], ids=["gpt2", "llama-gqa"])
def test_training_is_bit_identical_at_any_dp_size(tmp_path, model):
    """(TP, DP) = (1, 2), (2, 2), (1, 4) against (1, 1): training and validation losses == at every
    step, final weights torch.equal, with hidden dropout and clipping. GPT-2 at (2, 2) and (1, 4)
    with --fsdp (a unit per block at (2, 2), both blocks one unit at (1, 4): 0.08 MiB holds two
    0.048 MiB blocks) and at 1 x 4 as HSDP 2 x 2 (the tree's sum in place of FSDP's reduce-scatter);
    its (2, 2) FSDP run, saved after step 2, resumes at 1 x 4 and at 4 x 1 with --no-fsdp on the
    same bits. The Llama-style model (2 K/V heads, whole on every TP rank) at (2, 2) with and
    without --fsdp and at 1 x 4 as HSDP 2 x 2."""
    layouts = {"1x1": (1, 1), "2x2": (2, 2), "2x2 fsdp": (2, 2, "--fsdp"),
               "hsdp 2x2": (1, 4, "--fsdp", "--dp-replicate", "2")} if model else {
        "1x1": (1, 1), "1x2": (1, 2), "2x2 fsdp": (2, 2, "--fsdp", "--fsdp-min-unit-mib", "0", "--save-every", "2"),
        "1x4 fsdp": (1, 4, "--fsdp", "--fsdp-min-unit-mib", "0.08"),
        "hsdp 2x2": (1, 4, "--fsdp", "--dp-replicate", "2")}
    runs = {name: _train(tp_size, dp_size, tmp_path / name.replace(" ", "-"), *model, *extra)
            for name, (tp_size, dp_size, *extra) in layouts.items()}
    losses, val_losses, ckpt = runs["1x1"]
    assert list(losses) == [1, 2, 3, 4] and list(val_losses) == [2, 4]
    assert {name: run[:2] for name, run in runs.items()} == {name: (losses, val_losses) for name in layouts}
    reference = run_on_ranks(_weights_body, 1, str(ckpt))[0]
    assert {name: _differing_weights(run[2], reference) for name, run in runs.items()} == {name: [] for name in layouts}
    for tp_size, dp_size in [] if model else [(1, 4), (4, 1)]:
        resumed, _, resumed_ckpt = _train(tp_size, dp_size, tmp_path / f"resumed{tp_size}x{dp_size}", "--no-fsdp",
                                          "--resume", str(tmp_path / "2x2-fsdp" / "step_2"))
        assert resumed == {step: losses[step] for step in (3, 4)}, (tp_size, dp_size)
        assert _differing_weights(resumed_ckpt, reference) == [], (tp_size, dp_size)


@pytest.mark.slow
def test_a_resume_at_another_dp_size_is_bit_identical(tmp_path):
    """Saved at DP 2 after step 2, resumed at DP 4 (TP 1) and at TP 2 x DP 1: the uninterrupted
    DP 1 run's losses (==) and final weights (torch.equal): data and dropout masks continue by
    global micro-batch."""
    losses, _, ckpt = _train(1, 1, tmp_path / "a")
    _train(1, 2, tmp_path / "b", "--save-every", "2")
    reference = run_on_ranks(_weights_body, 1, str(ckpt))[0]
    for tp_size, dp_size in ((1, 4), (2, 1)):
        resumed, _, resumed_ckpt = _train(tp_size, dp_size, tmp_path / f"c{tp_size}x{dp_size}",
                                          "--resume", str(tmp_path / "b" / "step_2"))
        assert resumed == {step: losses[step] for step in (3, 4)}
        assert _differing_weights(resumed_ckpt, reference) == []


def test_train_refuses_a_dp_size_whose_ranks_cannot_sum_subtrees(capsys):
    from tensorpar.cli.main import main

    assert main(["train", "--nproc", "3", "--global-batch", "6", "--micro-batch", "1", "--tp-invariant",
                 "--layers", "1", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert ("--tp-invariant: 3 data-parallel ranks cannot each sum a subtree of the 6 micro-batches per step "
            "(--global-batch 6 / --micro-batch 1; halves, then chains of 3): use a DP size of 1, 2") in err
    assert "Traceback" not in err



def _reducer_refusals_body():
    from tensorpar.data_parallel.grads import DataParallelGradReducer, mark_tp_invariant

    plain, weight = torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.ones(8))
    try:
        DataParallelGradReducer([plain], dp_group=None, micro_batches=2)
    except ValueError as exc:
        refused = str(exc)
    mark_tp_invariant([weight])
    reducer = DataParallelGradReducer([weight], dp_group=None, micro_batches=2)
    (weight * 2.0).sum().backward()  # one micro-batch of the two the tree sums
    try:
        reducer.finish()
    except RuntimeError as exc:
        return refused, str(exc)
    finally:
        reducer.remove_hooks()


def test_the_micro_batch_tree_refuses_a_plain_model_and_a_short_step():
    refused, short = run_on_ranks(_reducer_refusals_body, 1)[0]
    assert refused == ("DataParallelGradReducer: micro_batches= sums in the invariant mode's tree; the model is "
                       "not tp_invariant")
    assert short == "DataParallelGradReducer: finish() after 1 of the micro_batches=2 backwards its tree sums"



def _fsdp_grads_body():
    import tensorpar as tp
    from tensorpar.models import GPT, GPTConfig

    tp.initialize_model_parallel(1)
    config = GPTConfig(vocab_size=40, max_seq_len=16, num_layers=1, num_heads=4, hidden_size=32, dropout=0.0,
                       tp_invariant=True)
    models = []
    for shard in (False, True):
        torch.manual_seed(3)
        models.append(tp.fully_shard(GPT(config)) if shard else GPT(config))
    tokens = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(5))
    for model in models:
        model(tokens, torch.roll(tokens, -1, dims=1)).backward()
    plain, sharded = models
    return [name for (name, p), q in zip(sharded.named_parameters(), plain.parameters())
            if not torch.equal(p.grad.full_tensor(), q.grad)]


def test_fsdp_gradients_are_the_unsharded_models_bits():
    """FSDP's unsharded parameters carry no ``partition_stride``: the fused Q|K|V layer still
    groups its GEMMs by its stride of 3 (by 1, norm1's gradient differed by an ulp)."""
    assert run_on_ranks(_fsdp_grads_body, 1)[0] == []
