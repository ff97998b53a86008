"""TP-invariant mode (tensorpar.invariant): the same bits at TP = 1, 2, 4, with and without SP.

Bit equality across TP sizes is asserted here because the mode makes every GEMM's shape and
every sum's order independent of the TP size, and all runs compared share one machine and
its kernels (see the README). Against the default mode it is compared to rounding only.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tensorpar as tp
from tensorpar.data_parallel import grads
from tensorpar import invariant
from tensorpar.invariant import dropout as invariant_dropout
from tensorpar.models import GPT, GPTConfig
from tensorpar.training.loop import adamw
from tests.harness import run_on_ranks

# Hidden and attention dropout on: their masks are drawn by global position, not by rank. An FFN
# of 200 is no whole number of SIMD steps at any TP size (200 to 25 per rank): the activation's
# last columns need ``lanewise``.
GPT2 = GPTConfig(vocab_size=96, max_seq_len=16, num_layers=2, num_heads=4, hidden_size=64, ffn_hidden_size=200,
                 dropout=0.1, attention_dropout=0.2, tp_invariant=True)
LLAMA = GPTConfig(vocab_size=96, max_seq_len=16, num_layers=2, num_heads=8, num_query_groups=4, hidden_size=64,
                  ffn_hidden_size=200, norm="rmsnorm", activation="swiglu", position_embedding="rope", bias=False,
                  tie_word_embeddings=False, dropout=0.1, attention_dropout=0.2, tp_invariant=True)
# 4 heads, 2 K/V heads: at TP 4 each K/V head's two query heads are on two ranks.
REPLICATED_KV = dataclasses.replace(LLAMA, num_heads=4, num_query_groups=2)
# (TP size, SP, recompute): recompute draws the masks again, the same ones.
LAYOUTS = [(1, False, False), (2, False, False), (2, True, False), (4, False, False), (4, True, False),
           (2, True, True), (4, False, True)]
STEPS = 3

_GROUPS: dict = {}


def _group(size: int):
    """The group of ranks ``0..size-1`` (every rank creates every group, once, in one order)."""
    if not _GROUPS:
        for n in (1, 2, 3, 4, 6, 8):
            if n <= dist.get_world_size():
                _GROUPS[n] = dist.new_group(list(range(n)))
        for rank in range(dist.get_world_size()):
            _GROUPS["dp", rank] = dist.new_group([rank])
    return _GROUPS[size]


def _batch(step: int, config: GPTConfig):
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, config.vocab_size, (2, config.max_seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _train(config: GPTConfig, group, steps, *, model=None, optimizer=None, first_step=0):
    """Train ``steps`` AdamW steps as the training loop does; returns (losses, model, optimizer)."""
    if model is None:
        tp.model_parallel_manual_seed(1234, tp_group=group)
        model = GPT(config, tp_group=group, device="cpu")
        optimizer = adamw(model.parameters(), device=torch.device("cpu"), tp_invariant=True, lr=1e-2,
                          betas=(0.9, 0.95), weight_decay=0.1)
    reducer = grads.DataParallelGradReducer(model.parameters(), dp_group=_GROUPS["dp", dist.get_rank()])
    losses = []
    for step in range(first_step, first_step + steps):
        reducer.zero_grad()
        tokens, labels = _batch(step, config)
        loss = model(tokens, labels)
        loss.backward()
        reducer.finish()
        grads.allreduce_sequence_parallel_grads(model, tp_group=group)
        grads.clip_grad_norm_(list(model.parameters()), 0.5, tp_group=group)
        optimizer.step()
        losses.append(loss.item())
    reducer.remove_hooks()
    return losses, model, optimizer


def _mismatch(reference, losses, weights) -> str | None:
    ref_losses, ref_weights = reference
    if losses != ref_losses:
        return f"losses {losses} != TP=1's {ref_losses}"
    for name, value in weights.items():
        if not torch.equal(value, ref_weights[name]):
            diff = (value - ref_weights[name]).abs().max().item()
            return f"{name} differs from TP=1's by up to {diff:g}"
    return None


def _reports(config: GPTConfig, layouts):
    """On rank 0: (each layout's mismatch with ``layouts[0]``'s run or None, that run); else None."""
    results = {}
    for size, sp, recompute in layouts:
        group = _group(size)  # every rank takes part in creating it
        if dist.get_rank() >= size:
            continue
        losses, model, _ = _train(dataclasses.replace(config, sequence_parallel=sp, recompute=recompute), group, STEPS)
        results[(size, sp, recompute)] = (losses, model.full_state_dict())
    dist.barrier()
    if dist.get_rank() != 0:
        return None
    reference = results[layouts[0]]
    return {layout: _mismatch(reference, *results[layout]) for layout in layouts[1:]}, reference


def _invariance_body(config: GPTConfig, layouts=LAYOUTS, more=None):
    """:func:`_reports`, then (rank 0) the dropout-free runs of both modes at TP=1 and ``more``'s
    ``(config, layouts)`` reports, in the same processes."""
    reports = _reports(config, layouts)
    more_report = more and _reports(*more)
    if reports is None:
        return None
    report, reference = reports
    # The default mode sums in other orders and draws other dropout masks: without dropout,
    # the same training to rounding only.
    no_dropout = dataclasses.replace(config, dropout=0.0, attention_dropout=0.0)
    invariant_run, default_run = ((losses, model.full_state_dict()) for losses, model, _ in
                                  (_train(dataclasses.replace(no_dropout, tp_invariant=mode), _group(1), STEPS)
                                   for mode in (True, False)))
    return report, reference, invariant_run, default_run, more_report and more_report[0]


@pytest.mark.parametrize("config, more", [
    (GPT2, None),
    # and replicated K/V heads at TP 4, with and without SP and with recompute (issue 30)
    pytest.param(LLAMA, (REPLICATED_KV, [(1, False, False), (2, True, False), (4, False, False), (4, True, False),
                                          (4, False, True)]), marks=pytest.mark.slow)], ids=["gpt2", "llama-gqa"])
def test_training_is_bit_identical_at_every_tp_size(config, more):
    report, (dropout_losses, _), (losses, _), (default_losses, _), more_report = \
        run_on_ranks(_invariance_body, 4, config, LAYOUTS, more, timeout=300)[0]
    assert report == {layout: None for layout in LAYOUTS[1:]}
    assert more_report == (more and {layout: None for layout in more[1][1:]})
    assert all(a != b for a, b in zip(dropout_losses, losses))  # the masks drop
    assert losses == pytest.approx(default_losses, rel=1e-5)
    # Not the weights after AdamW: its step of a near-zero gradient is the sign of that gradient's
    # rounding, which the two modes round differently (one element off by 1.2e-4 after 3 steps).


@pytest.mark.slow
def test_training_is_bit_identical_at_tp_8():
    # 8 heads, and every TP-split size a multiple of 8 blocks: one block per rank.
    config = dataclasses.replace(GPT2, num_heads=8, num_query_groups=8)
    layouts = [(1, False, False), (8, False, False), (8, True, False), (8, True, True)]
    report = run_on_ranks(_invariance_body, 8, config, layouts, timeout=600)[0][0]
    assert report == {layout: None for layout in layouts[1:]}


@pytest.mark.parametrize("change, named", [
    (dict(overlap=2), "overlap=2"), (dict(interleave=2), "interleave=2"),
    (dict(gradient_accumulation_fusion=True), "gradient_accumulation_fusion=True")])
def test_unsupported_combinations_are_refused_by_name(change, named):
    with pytest.raises(ValueError, match=f"tp_invariant=True does not support {named}"):
        dataclasses.replace(GPT2, **change)


def test_sizes_the_fixed_blocks_do_not_divide_are_named():
    invariant.check_gpt_sizes(GPT2, tp_size=4, seq_len=16)
    with pytest.raises(ValueError, match="tensor-parallel size 3 does not divide the 8 fixed blocks"):
        invariant.check_gpt_sizes(GPT2, tp_size=3)
    invariant.check_gpt_sizes(REPLICATED_KV, tp_size=4)
    invariant.check_gpt_sizes(dataclasses.replace(GPT2, num_heads=8, num_query_groups=2), tp_size=4)
    for heads in (2, 6):  # uneven query heads
        with pytest.raises(ValueError, match=f"num_heads {heads} at the tensor-parallel size 4: tp_invariant needs "
                                             "the query heads divisible by TP"):
            invariant.check_gpt_sizes(dataclasses.replace(GPT2, num_heads=heads, num_query_groups=heads,
                                                          hidden_size=96 if heads == 6 else 64), tp_size=4)
    narrow = dataclasses.replace(GPT2, hidden_size=36, ffn_hidden_size=68, num_heads=4)
    with pytest.raises(ValueError, match="hidden_size 36, num_query_groups x head_dim 36, ffn_hidden_size 68 not "
                                         "divisible by the 8 fixed blocks of tp_invariant; the sequence length 12 "
                                         "not divisible by the 8 fixed sequence blocks"):
        invariant.check_gpt_sizes(narrow, tp_size=2, seq_len=12)


@pytest.mark.parametrize("flags, message", [
    (["--seq-len", "12"], "--tp-invariant: the sequence length 12 not divisible by the 8 fixed sequence blocks"),
    (["--fsdp"], "--fsdp with --tp-invariant shards over DP / --dp-replicate = 1 / 1 = 1 rank")])
def test_train_refuses_an_unsupported_tp_invariant_run_before_launch(capsys, flags, message):
    from tensorpar.cli.main import main

    assert main(["train", "--tp", "2", "--tp-invariant", "--layers", "1", "--hidden", "32", "--heads", "4",
                 "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# An FFN of 200: its bias shards (200 to 50) are no whole number of SIMD steps, where fused AdamW's
# tail loop would update the last elements with other bits than TP 1's (AVX-512).
TRAIN = ["--layers", "2", "--hidden", "32", "--ffn-hidden", "200", "--heads", "4", "--seq-len", "16", "--steps", "6",
         "--micro-batch", "2", "--grad-accum", "2", "--warmup", "2", "--lr", "1e-2", "--eval-every", "0",
         "--no-progress", "--seed", "7", "--tp-invariant", "--dropout", "0.1"]


def _train_body(argv):
    from tensorpar.cli.training_cli import parse_train_args
    from tensorpar.training.loop import train

    result = train(parse_train_args(argv))
    return result.losses, result.checkpoint


def _weights_body(ckpt):
    from tensorpar.training import checkpoint, checkpoint_files
    from tensorpar.training.model_config import config_from_json

    tp.initialize_model_parallel(1)
    path, config, _ = checkpoint_files.open_checkpoint(ckpt)
    model = GPT(config_from_json(config), device="cpu")
    checkpoint.load(path, model=model, optimizer=None, tp_group=tp.get_tensor_model_parallel_group(),
                    restore_rng=False)
    return model.full_state_dict()



def _train_on_threads_body(argv, threads):
    import os
    import unittest.mock

    with unittest.mock.patch.dict(os.environ, {"OMP_NUM_THREADS": str(threads)}):
        result = _train_body(argv)
    assert torch.get_num_threads() == threads
    torch.set_num_threads(1)
    return result


def test_train_at_tp_1_2_and_4_on_3_threads_a_rank_gives_the_same_bits(tmp_path):
    """The promise holds at any intra-op thread count, the same on every rank (OMP_NUM_THREADS=3,
    which the invariant mode keeps at every layout): a SwiGLU FFN whose activation is past ATen's
    grain at every TP size, so 3 threads cut it into pieces (where, depends on the TP size)."""
    argv = TRAIN + ["--ffn-hidden", "4096", "--activation", "swiglu", "--steps", "3", "--dropout", "0"]

    def train(world):
        out = tmp_path / f"tp{world}"
        losses, ckpt = run_on_ranks(_train_on_threads_body, world, argv + ["--tp", str(world), "--out", str(out)],
                                    3, timeout=300)[0]
        return losses, run_on_ranks(_weights_body, 1, str(ckpt))[0]

    reference, reference_weights = train(1)
    for world in (2, 4):
        losses, weights = train(world)
        assert losses == reference, (world, losses, reference)
        assert [name for name in weights if not torch.equal(weights[name], reference_weights[name])] == [], world

@pytest.mark.slow
def test_train_and_a_resume_at_another_tp_size_are_bit_identical(tmp_path):
    """--tp-invariant with hidden and attention dropout: TP=1 for 6 steps; TP=2 +SP saved at step 3
    and resumed at TP=4: the same losses (==) at every step and the same final weights (torch.equal)."""
    def train(world, out, *extra):
        return run_on_ranks(_train_body, world, TRAIN + ["--tp", str(world), "--out", str(out), *extra],
                            timeout=300)[0]

    a, a_ckpt = train(1, tmp_path / "a")
    b, _ = train(2, tmp_path / "b", "--sp", "--save-every", "3")
    resumed, resumed_ckpt = train(4, tmp_path / "c", "--resume", str(tmp_path / "b" / "step_3"))
    assert list(a) == [1, 2, 3, 4, 5, 6] and list(resumed) == [4, 5, 6]
    assert b == a
    assert {step: a[step] for step in resumed} == resumed
    reference, weights = (run_on_ranks(_weights_body, 1, str(c))[0] for c in (a_ckpt, resumed_ckpt))
    assert weights.keys() == reference.keys()
    assert [name for name in weights if not torch.equal(weights[name], reference[name])] == []


@pytest.mark.slow
def test_dp_reduction_keeps_tp_sizes_bit_identical_at_dp4(tmp_path):
    """At DP=4 (a tree over the DP ranks too), bf16 autocast and recompute, TP=2 +SP equals TP=1:
    losses ==, weights torch.equal."""
    runs = {tp_size: run_on_ranks(_train_body, 4 * tp_size, TRAIN + ["--tp", str(tp_size), "--steps", "3",
                                                                     "--dtype", "bf16", "--recompute",
                                                                     "--out", str(tmp_path / str(tp_size)),
                                                                     *(["--sp"] if tp_size > 1 else [])],
                                  timeout=300)[0]
            for tp_size in (1, 2)}
    assert runs[1][0] == runs[2][0]
    reference, weights = (run_on_ranks(_weights_body, 1, str(runs[n][1]))[0] for n in (1, 2))
    assert [name for name in weights if not torch.equal(weights[name], reference[name])] == []


def _layers_body():
    """ColumnLinear (stride 3, SP) -> RowLinear (SP) against the unsharded F.linear pair, at TP 1, 2, 4."""
    errors = {}
    for size in (1, 2, 4):
        group = _group(size)
        if dist.get_rank() >= size:
            continue
        rank, sp = dist.get_rank(), size > 1
        torch.manual_seed(0)
        x = torch.randn(16, 2, 32, requires_grad=True)
        w1, b1 = (torch.randn(3 * 64, 32) / 6).requires_grad_(), torch.randn(3 * 64, requires_grad=True)
        w2, b2 = (torch.randn(32, 3 * 64) / 14).requires_grad_(), torch.randn(32, requires_grad=True)
        grad = torch.randn(16, 2, 32)
        y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
        y.backward(grad)
        column = invariant.ColumnLinear(32, 3 * 64, stride=3, sequence_parallel=sp, tp_group=group, device="cpu")
        row = invariant.RowLinear(3 * 64, 32, input_is_parallel=True, sequence_parallel=sp, tp_group=group,
                                  device="cpu")

        def column_shard(t):  # this rank's part of each of the 3 stride pieces
            return torch.cat([piece.chunk(size)[rank] for piece in t.chunk(3)])

        with torch.no_grad():
            column.weight.copy_(column_shard(w1))
            column.bias.copy_(column_shard(b1))
            row.weight.copy_(column_shard(w2.t()).t())   # the column layer's features, in its order
            row.bias.copy_(b2)
        shard = (lambda t: t.chunk(size)[rank]) if sp else (lambda t: t)
        x_local = shard(x.detach()).requires_grad_()
        y_local, _ = row(F.gelu(column(x_local)[0]))
        y_local.backward(shard(grad))
        pairs = {"output": (y_local, shard(y)), "input grad": (x_local.grad, shard(x.grad)),
                 "column weight grad": (column.weight.grad, column_shard(w1.grad)),
                 "column bias grad": (column.bias.grad, column_shard(b1.grad)),
                 "row weight grad": (row.weight.grad, column_shard(w2.grad.t()).t()),
                 "row bias grad": (row.bias.grad, b2.grad)}
        errors[size] = {name: (a - b).abs().max().item() for name, (a, b) in pairs.items()}
    return errors


def test_invariant_layers_match_the_unsharded_computation():
    for errors in run_on_ranks(_layers_body, 4):
        for size, per_name in errors.items():
            assert all(error < 1e-5 for error in per_name.values()), (size, per_name)


def test_dropout_masks_drop_at_rate_p_and_depend_on_position_not_rank():
    """The keyed masks drop within 5 binomial sigmas of p and scale the rest by 1/(1-p); they differ
    per head, block, site and forward, and a shard's heads get the whole tensor's masks."""
    counter = invariant_dropout.MaskCounter(seed=1234)
    p, key, next_key = 0.3, counter.next_key(), counter.next_key()
    hidden = invariant_dropout.dropout(torch.ones(16, 4, 32), p, key=key, site=(0, "mlp"))
    ones = torch.ones(4, 8, 16, 16)                                 # [b, heads, s, keys]

    def heads(key, first_head=0, count=8):
        return invariant_dropout.drop_heads(ones[:, :count], p, key=key, layer=0, first_head=first_head)

    attended = heads(key)
    for dropped in (hidden, attended):
        n, kept = dropped.numel(), dropped != 0
        assert abs(n - int(kept.sum()) - n * p) < 5 * (n * p * (1 - p)) ** 0.5, (int(kept.sum()), n)
        assert torch.equal(dropped[kept], torch.full_like(dropped[kept], 1 / (1 - p)))
    assert not torch.equal(attended[:, 0], attended[:, 1])                        # per head
    assert not torch.equal(hidden[:2], hidden[2:4])                               # per sequence block
    assert not torch.equal(hidden, invariant_dropout.dropout(torch.ones(16, 4, 32), p, key=key, site=(1, "mlp")))
    assert not torch.equal(attended, heads(next_key))                             # per forward
    assert torch.equal(heads(key, first_head=4, count=4), attended[:, 4:8])       # a TP=2 rank's heads
    with pytest.raises(ValueError, match="the sequence length 12 is not divisible by the 8 fixed blocks"):
        invariant_dropout.dropout(torch.ones(12, 1, 4), p, key=key, site=(0, "mlp"))


def _compiled_dropout_body():
    import torch._dynamo

    torch._dynamo.reset()
    group = dist.group.WORLD
    tp.model_parallel_manual_seed(1234, tp_group=group)
    # Dynamo's guards decide a recompile, whatever the backend: aot_eager spares inductor's code
    # generation (31 s of this test's 34 on two cores; test_compile runs a step through inductor).
    model = torch.compile(GPT(dataclasses.replace(GPT2, num_layers=1), tp_group=group, device="cpu"),
                          backend="aot_eager")
    tokens, labels = _batch(0, GPT2)
    with torch.no_grad():
        losses = [model(tokens, labels).item()]
        with torch._dynamo.config.patch(error_on_recompile=True):
            losses += [model(tokens, labels).item() for _ in range(2)]
    return losses


@pytest.mark.slow
def test_compiled_invariant_dropout_draws_new_masks_without_recompiling():
    """Each forward's key is a graph input, not a constant the graph guards on."""
    losses = run_on_ranks(_compiled_dropout_body, 1, timeout=600)[0]
    assert len(set(losses)) == 3  # the same batch and weights: only the masks differ


def _public_helpers_train(config: GPTConfig, group, steps):
    """The README's loop with tensorpar's public helpers only, clipping on: they read the model's
    mode from its parameters. Returns (losses, grad norms, full weights)."""
    tp.model_parallel_manual_seed(1234, tp_group=group)
    model = GPT(config, tp_group=group, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reducer = tp.DataParallelGradReducer(model.parameters(), dp_group=_GROUPS["dp", dist.get_rank()])
    losses, norms = [], []
    for step in range(steps):
        reducer.zero_grad()
        tokens, labels = _batch(step, config)
        loss = model(tokens, labels)
        loss.backward()
        reducer.finish()
        tp.allreduce_sequence_parallel_grads(model, tp_group=group)
        norms.append(tp.clip_grad_norm_(model.parameters(), 0.5, tp_group=group).item())
        optimizer.step()
        losses.append(loss.item())
    reducer.remove_hooks()
    return losses, norms, model.full_state_dict()


def _public_helpers_body(layouts):
    results = {}
    for size, sp in layouts:
        group = _group(size)
        if dist.get_rank() < size:
            results[size, sp] = _public_helpers_train(dataclasses.replace(GPT2, sequence_parallel=sp), group, 2)
    dist.barrier()
    if dist.get_rank() != 0:
        return None
    losses, norms, weights = results[layouts[0]]

    def mismatch(layout):
        layout_losses, layout_norms, layout_weights = results[layout]
        if layout_norms != norms:
            return f"grad norms {layout_norms} != TP=1's {norms}"
        return _mismatch((losses, weights), layout_losses, layout_weights)

    return norms, {layout: mismatch(layout) for layout in layouts[1:]}


def test_public_gradient_helpers_keep_an_invariant_model_bit_identical_to_tp1():
    """Issue 25, item 3: tp.DataParallelGradReducer, tp.allreduce_sequence_parallel_grads and
    tp.clip_grad_norm_ (clipping on) on a tp_invariant model: TP 2 and 4, with and without SP,
    train the same bits as TP 1."""
    layouts = [(1, False), (2, False), (2, True), (4, False), (4, True)]
    norms, report = run_on_ranks(_public_helpers_body, 4, layouts, timeout=300)[0]
    assert all(norm > 0.5 for norm in norms)  # every step clipped
    assert report == {layout: None for layout in layouts[1:]}


def test_generate_continues_a_tp_invariant_checkpoint(tmp_path, capsys):
    """`tensorpar generate` from a `--tp-invariant` run: the prompt's length is not a training
    sequence, so no fixed sequence blocks are asked of it (it said "the sequence length 1 not
    divisible by the 8 fixed blocks" before)."""
    from tensorpar.cli.main import main

    assert main(["train", "--nproc", "1", "--tp", "1", "--tp-invariant", "--layers", "1", "--hidden", "32",
                 "--heads", "4", "--seq-len", "16", "--steps", "1", "--eval-iters", "1", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--nproc", "1", "--prompt", "def ",
                 "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def ") and "error" not in err


def test_train_runs_every_layout_of_an_invariant_run_on_one_thread_count_and_says_so(tmp_path):
    """The launcher shares the cores among a node's ranks (a TP=1 run would get twice a TP=2
    run's threads here), and a CPU GEMM's bits depend on its threads: the invariant mode keeps
    OMP_NUM_THREADS, else 1, at every layout, and the header names it."""
    import os

    from tests.cli_runner import run_tensorpar

    env = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    for world in (1, 2):
        done = run_tensorpar(["train", *TRAIN, "--steps", "1", "--nproc", world, "--tp", world,
                              "--out", tmp_path / str(world)], env=env)
        assert done.returncode == 0, done.stderr
        assert "--tp-invariant on CPU: 1 intra-op thread a rank at every layout" in done.stdout, done.stdout
