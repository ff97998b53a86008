"""The pipeline's cost model (:mod:`tensorpar.planning.pipeline`): the bubble against hand values,
the sends of each rank per step, every rank's collectives against CommLedger for every schedule
(``tensorpar comm --pp --measure``), what ``tensorpar comm --pp`` refuses, and the bubble in the
``tensorpar train --pp`` header. The bytes per send against a measured step are also checked in
tests/test_pipeline.py's ledger test."""

import collections
import functools
import json
import traceback

import pytest
import torch

import tensorpar as tp
from tensorpar import pipeline_parallel as pipeline
from tensorpar.planning import pipeline as pipeline_model
from tensorpar.planning.communication import CommConfig, collectives
from tensorpar.pipeline_parallel import SCHEDULES
from tensorpar.cli import main as cli
from tensorpar.cli.comm_axes import compared, unpredicted
from tensorpar.cli.comm_measure import measure_pipeline_on_this_rank, record_key
from tests.harness import run_on_ranks
from tensorpar.training.pipeline_step import pipeline_header

TINY = CommConfig(layer="gpt-step", hidden=64, heads=2, seq_len=16, batch=2, vocab=64, layers=8, tp=1, dtype="fp32")


@pytest.mark.parametrize("schedule, pp, m, v, expected", [
    ("gpipe", 4, 8, None, 3 / 11),
    ("1f1b", 2, 4, None, 1 / 5),
    ("interleaved-1f1b", 4, 8, 2, 3 / 19),       # (P-1)/(V M+P-1)
    ("interleaved-1f1b", 4, 8, 1, 3 / 11),       # one stage per rank: 1F1B's
    ("looped-bfs", 4, 4, 3, 3 / 15),
    ("looped-bfs", 4, 2, 2, 5 / 9),              # M < P: the loop back waits P - M stage-times
    ("interleaved-zb", 2, 4, 2, None),
    ("zbv", 2, 4, None, None),
    ("dualpipev", 2, 4, None, None),
])
def test_bubble_fraction_against_hand_values(schedule, pp, m, v, expected):
    bubble, formula = pipeline_model.bubble_fraction(schedule, pp_size=pp, microbatches=m, virtual_stages=v)
    if expected is None:
        assert bubble is None and formula.startswith("not modelled")
    else:
        assert bubble == pytest.approx(expected, rel=1e-12, abs=0) and "(P-1" in formula


def test_sends_per_rank_per_step_for_single_interleaved_and_v_placements():
    def traffic(schedule, pp, **kw):
        cost = pipeline_model.pipeline_cost(TINY, pp_size=pp, schedule=schedule, microbatches=4, **kw)
        return [(r.stages, r.activation_sends, r.gradient_sends, r.activation_recvs, r.gradient_recvs)
                for r in cost.ranks]

    # An inner stage sends its activations on and its input gradients back: 2 M each way.
    assert traffic("1f1b", 4) == [((0,), 4, 0, 0, 4), ((1,), 4, 4, 4, 4), ((2,), 4, 4, 4, 4), ((3,), 0, 4, 4, 0)]
    assert traffic("interleaved-1f1b", 2, virtual_stages=2) == [((0, 2), 8, 4, 4, 8), ((1, 3), 4, 8, 8, 4)]
    # The V's turn (stage 1 to 2) stays on rank 1: nothing sent there.
    assert traffic("zbv", 2) == [((0, 3), 4, 4, 4, 4), ((1, 2), 4, 4, 4, 4)]


def test_bytes_per_send_with_tp_and_a_padded_sequence_parallel_shard():
    cost = pipeline_model.pipeline_cost(TINY, pp_size=2, microbatches=2)
    assert (cost.send_shape, cost.dtype, cost.bytes_per_send) == ((16, 2, 64), torch.float32, 16 * 2 * 64 * 4)
    sp = CommConfig(**{**vars(TINY), "seq_len": 15, "tp": 2, "sp": True, "dtype": "bf16"})
    cost = pipeline_model.pipeline_cost(sp, pp_size=2, microbatches=2)
    assert (cost.send_shape, cost.bytes_per_send) == ((8, 2, 64), 8 * 2 * 64 * 2)


ARGV = ["comm", "--layer", "gpt-step", "--tp", "1", "--layers", "4", "--hidden", "64", "--heads", "2",
        "--seq-len", "16", "--vocab", "64", "--pp", "2"]


def test_comm_pp_prints_the_sends_and_the_bubble(capsys):
    assert cli.main([*ARGV, "--microbatches", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("pipeline: ")))
    assert lines[start] == ("pipeline: PP=2, 1f1b, 1 stage(s) per rank, 4 micro-batches per step of 1 x 16 tokens; "
                            "stage 0 (PP rank 0): layers 0-1, stage 1 (PP rank 1): layers 2-3")
    assert lines[start + 1].startswith("per send: one micro-batch's hidden states [16, 1, 64] bf16 = 2.0 KiB")
    assert lines[start + 3].split() == ["rank", "stages", "activation", "sends", "gradient", "sends", "recvs",
                                        "sent/rank", "est.", "time"]
    assert [line.split()[:6] for line in lines[start + 4:start + 6]] == [
        ["0", "0", "4", "0", "4", "8.0"], ["1", "1", "0", "4", "4", "8.0"]]
    assert lines[start + 6] == "bubble: 20.0% of the step, (P-1)/(M+P-1) = 1/5 (stages of equal time)"
    assert cli.main([*ARGV, "--pp-schedule", "interleaved-1f1b", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["pipeline"]
    assert (report["microbatches"], report["stages_per_rank"], report["bubble"]) == (4, 2, pytest.approx(1 / 9))


@pytest.mark.parametrize("extra, message", [
    (["--fsdp"], "--pp 2 with --fsdp is not supported yet"),
    (["--compare-sp"], "--pp 2 with --compare-sp is not supported yet"),
    (["--pp-schedule", "1f1b", "--pp", "4", "--microbatches", "3"], "the 1f1b schedule at PP=4 needs at least PP = 4"),
    (["--pp", "8", "--pp-schedule", "zbv"], "16 pipeline stages (PP=8 x 2 per rank) exceed the 4 layers"),
    (["--layer", "mlp"], "--pp 2 models a GPT step's stages: use --layer gpt-step, not mlp"),
])
def test_comm_pp_refuses_in_one_line(extra, message, capsys):
    assert cli.main([*ARGV, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_each_rank_issues_its_stages_collectives_per_micro_batch_and_the_sums_after():
    cfg = CommConfig(**{**vars(TINY), "tp": 2, "sp": True, "layers": 4})
    cost = pipeline_model.pipeline_cost(cfg, pp_size=2, schedule="1f1b", microbatches=3)
    first, last = (pipeline_model.rank_collectives(cfg, cost, rank) for rank in (0, 1))
    # One micro-batch's TP collectives through the whole model, each on the stage holding its layer.
    whole = [op for op in collectives(cfg) if op.phase != "grads"]
    assert len([op for op in first + last if op.op not in ("send", "recv") and op.phase != "grads"]) == 3 * len(whole)
    for ops, rank in ((first, cost.ranks[0]), (last, cost.ranks[1])):
        assert [op.op for op in ops].count("send") == rank.sends == 3
        assert [op.op for op in ops].count("recv") == rank.recvs == 3
    # After the schedule: the stage's SP grads (2 blocks, the positions on the first, the final norm on
    # the last), the tied embedding over the embedding group, the losses, the norm over TP and PP.
    after = [(op.layer, op.op, op.shape, op.dtype, op.group_size) for op in first if op.phase == "grads"]
    assert after == [("stage 0", "all_reduce", ((2 * 6 + 16) * 64,), torch.float32, 2),
                     ("embedding.word", "all_reduce", (32, 64), torch.float32, 2),
                     ("loss", "broadcast", (3,), torch.float64, 2),
                     ("grad_norm", "all_reduce", (), torch.float32, 2), ("grad_norm", "all_reduce", (), torch.float32, 2)]
    assert [op.shape for op in last if op.phase == "grads"][0] == ((2 * 6 + 2) * 64,)


def _measure_body(cases):
    results = []
    for cfg, cost in cases:
        tp.initialize_model_parallel(cfg.tp, cost.pp_size)
        try:
            results.append(measure_pipeline_on_this_rank(cfg, cost))
        except Exception:  # one case's failure is that case's, not the batch's
            results.append(traceback.format_exc())
        finally:
            tp.destroy_model_parallel()
    return results


SMALL = dict(layer="gpt-step", hidden=16, heads=2, seq_len=8, batch=1, vocab=32, layers=4, dtype="fp32")


def _cases(world_size):
    if world_size == 2:  # TP 1: every schedule's sends, receives and the rest, exactly
        return [(CommConfig(**SMALL, tp=1), pipeline_model.pipeline_cost(CommConfig(**SMALL, tp=1), pp_size=2,
                                                                  schedule=s, microbatches=4)) for s in SCHEDULES]
    cfg = CommConfig(**SMALL, tp=2, sp=True, recompute=True)
    return [(cfg, pipeline_model.pipeline_cost(cfg, pp_size=2, schedule=s, microbatches=4))
            for s in ("1f1b", "gpipe", "interleaved-1f1b", "zbv")]


@functools.lru_cache(maxsize=None)
def _measured(world_size):
    return run_on_ranks(_measure_body, world_size, _cases(world_size))


@pytest.mark.parametrize("world_size, case", [(2, i) for i in range(len(SCHEDULES))]
                         + [pytest.param(4, i, marks=pytest.mark.slow) for i in range(4)],
                         ids=[f"tp1-{s}" for s in SCHEDULES] + [f"tp2-sp-recompute-{s}" for s in
                                                                ("1f1b", "gpipe", "interleaved-1f1b", "zbv")])
def test_model_counts_what_commledger_records_on_every_rank(world_size, case):
    cfg, cost = _cases(world_size)[case]
    extra = collections.Counter()
    for rank, results in enumerate(_measured(world_size)):
        got = results[case]
        assert not isinstance(got, str), got
        predicted = [record_key(op) for op in pipeline_model.rank_collectives(cfg, cost, rank // cfg.tp)]
        if unpredicted(cfg, cost):  # the split backward's TP collectives: more than predicted, left out
            extra += collections.Counter(got) - collections.Counter(predicted)
            got, predicted = ([k for k in keys if compared(cfg, cost, k)] for keys in (got, predicted))
        assert collections.Counter(got) == collections.Counter(predicted), (rank, cost.schedule)
    # The weight pass runs some TP layers' backward again: extra backward TP collectives, nothing else.
    assert bool(extra) == bool(unpredicted(cfg, cost))
    assert all(key[0] == "backward" and key[1] not in ("send", "recv") for key in extra), extra


def test_comm_pp_measure_on_the_command_line_agrees(capsys):
    argv = ["comm", "--layer", "gpt-step", "--tp", "1", "--layers", "2", "--hidden", "16", "--heads", "2",
            "--seq-len", "8", "--vocab", "32", "--dtype", "fp32", "--pp", "2", "--measure"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    # Per rank: 4 micro-batches' sends and receives, the tied embedding's sum, the losses, the norm.
    assert out[-1] == "measured 22 collectives on 2 ranks, predicted 22: all agree"
    assert "each kind of collective counted (the schedule interleaves them)" in out


def test_pipeline_flags_without_pp_are_refused(capsys):
    assert cli.main(["comm", "--layer", "gpt-step", "--microbatches", "4", "--virtual-stages", "2"]) == 2
    assert "--virtual-stages, --microbatches apply with --pp" in capsys.readouterr().err


def test_the_train_header_names_the_predicted_bubble():
    layout = pipeline.stage_layout(4, pp_size=2, schedule="1f1b")
    assert pipeline_header(layout, schedule="1f1b", microbatches=4, virtual_stages=None) == (
        "pipeline 1f1b, stage 0 (PP rank 0): layers 0-1, stage 1 (PP rank 1): layers 2-3, predicted bubble 20%")
    v = pipeline.stage_layout(4, pp_size=2, schedule="zbv")
    assert pipeline_header(v, schedule="zbv", microbatches=4, virtual_stages=None).endswith(
        ", bubble not modelled for zbv")


@pytest.mark.parametrize("schedule, pp, m, v, expected", [
    ("gpipe", 2, 4, None, ({0: 4}, {1: 4})),                                  # every forward first
    ("1f1b", 4, 8, None, ({0: 4}, {1: 3}, {2: 2}, {3: 1})),                   # min(M, P - s): P on stage 0
    ("1f1b", 2, 2, None, ({0: 2}, {1: 1})),
    ("looped-bfs", 2, 4, 2, ({0: 4, 2: 4}, {1: 4, 3: 4})),                    # M on each stage
    ("interleaved-1f1b", 4, 8, 2, ({0: 7, 4: 4}, {1: 5, 5: 4}, {2: 4, 6: 3}, {3: 4, 7: 1})),
    ("interleaved-zb", 2, 4, 2, ({0: 2, 2: 2}, {1: 2, 3: 2})),                # held until the weight pass
    ("zbv", 4, 8, None, ({0: 7, 7: 1}, {1: 6, 6: 2}, {2: 5, 5: 3}, {3: 4, 4: 4})),   # 2P a rank
    ("dualpipev", 2, 4, None, ({0: 4, 3: 1}, {1: 3, 2: 2})),                  # 2P + 1
])
def test_micro_batches_in_flight_per_stage_follow_the_schedules_order(schedule, pp, m, v, expected):
    assert pipeline_model.in_flight(schedule, pp_size=pp, microbatches=m, virtual_stages=v) == expected


def _tiny_gpt(**fields):
    from tensorpar.models import GPTConfig

    return GPTConfig(vocab_size=256, max_seq_len=32, num_layers=8, num_heads=2, hidden_size=32, **fields)


def test_pipeline_memory_counts_each_stage_and_its_micro_batches_in_flight():
    from tensorpar.planning.memory import gpt_training_memory

    sizes = dict(tp=1, seq_len=32, micro_batch=2)

    def ranks(schedule, m, config=None):
        return pipeline_model.pipeline_memory(config or _tiny_gpt(), pp_size=2, schedule=schedule, microbatches=m, **sizes)

    # 1F1B's stage 0 holds PP micro-batches at any M: as many as GPipe's at M = PP; the last stage one.
    first = [ranks(s, m)[0]["activations"] for s, m in (("1f1b", 4), ("1f1b", 8), ("gpipe", 2))]
    assert first[0] == first[1] == first[2]
    gpipe = [ranks("gpipe", m)[0]["activations"] for m in (2, 4, 8)]
    assert gpipe[2] - gpipe[1] == 2 * (gpipe[1] - gpipe[0]) > 0      # linear in the micro-batches held
    assert ranks("1f1b", 8)[1]["in_flight"] == {1: 1}
    # Each stage its own parameters: together the PP=1 model's, plus the last stage's copy of a
    # tied embedding; torch's receive buffers, one per micro-batch (activations in, gradients in).
    whole = gpt_training_memory(_tiny_gpt(), **sizes)["parameters"]
    embedding = _tiny_gpt().padded_vocab_size(1) * 32 * 4
    for tied in (True, False):
        per_rank = ranks("1f1b", 4, _tiny_gpt(tie_word_embeddings=tied))
        full = gpt_training_memory(_tiny_gpt(tie_word_embeddings=tied), **sizes)["parameters"]
        assert sum(r["parameters"] for r in per_rank) == full + (embedding if tied else 0)
        assert [r["buffers"] for r in per_rank] == [4 * 32 * 2 * 32 * 4] * 2
    assert whole == gpt_training_memory(_tiny_gpt(), **sizes)["parameters"]
    # The V schedules hold the first and the last stage on rank 0: one embedding for both.
    v = ranks("zbv", 4)
    assert sum(r["parameters"] for r in v) == whole
