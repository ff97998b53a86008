"""TP-invariant mode under pipeline parallelism (issues 28 and 30): ``tensorpar train --tp-invariant
--pp N`` trains the bits of the TP 1 x PP 1 run (same global batch, micro-batch size and seed) for
the schedules that keep the guarantee, and refuses the others in one line."""

from __future__ import annotations

import pytest
import torch

from tensorpar.cli.main import main
from tests.harness import run_on_ranks
from tests.test_invariant import _weights_body
from tests.test_invariant_dp import _run_body

# A tied-embedding GPT-2-style model of 4 layers (interleaved 1F1B at PP 2 holds 2 stages per
# rank, PP 4 one layer each), 6 micro-batches of 1 per step (a tree of halves, then chains of 3:
# the order of the micro-batches shows, as looped BFS's reversed backward would), hidden dropout,
# clipping at 0.1 on every step, evaluation of 3 micro-batches after steps 2 and 3.
RUN = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--steps", "3", "--micro-batch", "1",
       "--global-batch", "6", "--warmup", "1", "--lr", "1e-2", "--clip-grad", "0.1", "--eval-every", "2",
       "--eval-iters", "3", "--no-progress", "--seed", "7", "--tp-invariant", "--dropout", "0.1"]

# (TP, PP, DP, schedule, flags): every schedule that keeps the bits at PP 2 (GPipe with recompute:
# the shape inference's dummy backward of a recomputed block stays out of the gradients), 1F1B at
# PP 4, and PP 2 with TP 2 + SP and with DP 2.
LAYOUTS = [(1, 2, 1, "1f1b", ()), (1, 2, 1, "gpipe", ("--recompute",)), (1, 2, 1, "interleaved-1f1b", ()),
           (1, 2, 1, "looped-bfs", ()), (1, 4, 1, "1f1b", ()), (2, 2, 1, "1f1b", ()),
           (1, 2, 2, "interleaved-1f1b", ())]


def _train(tp_size: int, pp_size: int, dp_size: int, schedule: str, out, *extra):
    argv = RUN + ["--tp", str(tp_size), "--pp", str(pp_size), "--pp-schedule", schedule, "--out", str(out), *extra]
    if tp_size > 1:
        argv.append("--sp")
    return run_on_ranks(_run_body, tp_size * pp_size * dp_size, argv, timeout=300)


def _differing_weights(ckpt, reference) -> list[str]:
    weights = run_on_ranks(_weights_body, 1, str(ckpt))[0]
    assert weights.keys() == reference.keys()
    return [name for name in weights if not torch.equal(weights[name], reference[name])]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The TP 1 x PP 1 run: its losses, validation losses and final weights."""
    losses, val_losses, ckpt = _train(1, 1, 1, "1f1b", tmp_path_factory.mktemp("pp1"))[0]
    assert list(losses) == [1, 2, 3] and list(val_losses) == [2, 3]
    return losses, val_losses, run_on_ranks(_weights_body, 1, str(ckpt))[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{t}xpp{p}xdp{d}-{s}{''.join(f)}" for t, p, d, s, f in LAYOUTS])
def test_a_pipeline_run_is_bit_identical_to_pp1(reference, tmp_path, layout):
    """Training and validation losses ==, on every rank, and final weights torch.equal."""
    losses, val_losses, weights = reference
    *where, flags = layout
    runs = _train(*where, tmp_path / "run", *flags)
    assert [run[:2] for run in runs] == [(losses, val_losses)] * len(runs)
    assert _differing_weights(runs[0][2], weights) == []


# FSDP over each stage's DP ranks: 1F1B, looped BFS (whose backwards run the micro-batches in
# reverse: each waits in the tree for those before it), and TP 2 + SP; the tied embedding's two
# copies (GPT-2) added per micro-batch before the tree, the untied Llama-style model's reduced apart.
# The blocks in the root (the default on these small models), or a unit per block.
FSDP_LAYOUTS = [(1, 2, 2, "1f1b", ()), (1, 2, 2, "looped-bfs", ("--fsdp-min-unit-mib", "0")), (2, 2, 2, "1f1b", ())]


@pytest.mark.slow
@pytest.mark.parametrize("model, layouts", [([], FSDP_LAYOUTS), (["--model", "llama-tiny"], FSDP_LAYOUTS[1:])],
                         ids=["gpt2-tied", "llama-untied"])
def test_fsdp_pipeline_runs_are_bit_identical_to_pp1_without_fsdp(reference, tmp_path, model, layouts):
    """PP 2 x DP 2 with FSDP and TP 2 + SP x PP 2 x DP 2 with FSDP (8 ranks) against TP 1 x PP 1
    x DP 1 without: losses ==, on every rank, final weights torch.equal."""
    if model:
        (losses, val_losses, ckpt), = _train(1, 1, 1, "1f1b", tmp_path / "pp1", *model)
        weights = run_on_ranks(_weights_body, 1, str(ckpt))[0]
    else:
        losses, val_losses, weights = reference
    for k, (*where, flags) in enumerate(layouts):
        runs = _train(*where, tmp_path / f"fsdp{k}", *model, "--fsdp", *flags)
        assert [run[:2] for run in runs] == [(losses, val_losses)] * len(runs), where
        assert _differing_weights(runs[0][2], weights) == [], where


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_bit_identically_at_another_layout(reference, tmp_path):
    """Saved at TP 2 x PP 2 after step 2, resumed at PP 1 and at PP 4: the uninterrupted run's
    last loss (==) and final weights (torch.equal)."""
    losses, _, weights = reference
    _train(2, 2, 1, "1f1b", tmp_path / "a", "--save-every", "2")
    for pp_size in (1, 4):
        resumed, _, ckpt = _train(1, pp_size, 1, "1f1b", tmp_path / f"pp{pp_size}",
                                  "--resume", str(tmp_path / "a" / "step_2"))[0]
        assert resumed == {3: losses[3]}
        assert _differing_weights(ckpt, weights) == []


def _api_body(schedule: str, microbatches: int):
    """``PipelineSchedule.step`` without a reducer against PP=1's plain ``(loss / M).backward()``
    accumulation: the names of the gradients that differ (torch.equal), and the two losses."""
    from tensorpar import pipeline_parallel as pipeline
    from tensorpar.models import GPTConfig
    from tests.test_pipeline import GPT2, TINY, _batch, _groups, _pp1

    import tensorpar as tp

    groups = _groups(1, 2)
    config = GPTConfig(**TINY, **GPT2, tp_invariant=True, dropout=0.1)
    tokens, labels = _batch(microbatches, config.vocab_size)
    full, expected = _pp1(config, tokens, labels, microbatches, groups["tp"])
    layout = pipeline.stage_layout(config.num_layers, pp_size=2, schedule=schedule)
    tp.model_parallel_manual_seed(1234, tp_group=groups["tp"])
    stages = pipeline.build_stages(config, layout, pp_group=groups["pp"], tp_group=groups["tp"])
    schedule_ = pipeline.PipelineSchedule(stages, layout, schedule=schedule, microbatches=microbatches,
                                          pp_group=groups["pp"], embedding_group=groups["embedding"])
    loss = schedule_.step(tokens, labels)
    reference = dict(full.named_parameters())
    differing = [name for stage in stages for name, param in stage.named_parameters()
                 if not torch.equal(param.grad, reference[pipeline.full_model_name(stage, name)].grad)]
    return differing, loss.item(), expected.item()


@pytest.mark.parametrize("schedule", ["1f1b", "looped-bfs"])
def test_the_schedule_alone_accumulates_the_bits_of_pp1(schedule):
    """3 micro-batches (a chain: their order shows; looped BFS runs the backwards in reverse), a
    tied embedding, dropout: every gradient of every stage torch.equal to PP=1's."""
    for differing, loss, expected in run_on_ranks(_api_body, 2, schedule, 3, timeout=120):
        assert differing == [] and loss == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("schedule", ["interleaved-zb", "zbv", "dualpipev"])
def test_schedules_that_split_the_backward_are_refused_with_tp_invariant(schedule, capsys, tmp_path):
    assert main(["train", "--nproc", "2", "--pp", "2", "--pp-schedule", schedule, "--grad-accum", "4",
                 "--layers", "4", "--tp-invariant", "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert (f"--pp 2 --pp-schedule {schedule}: the {schedule} schedule cannot keep the invariant mode's bits: it "
            "splits each backward into an input pass and a later weight pass that adds to .grad outside autograd, "
            "so no micro-batch's weight gradient can be put in the mode's fixed tree; use gpipe, 1f1b, "
            "interleaved-1f1b, looped-bfs") in err, err
