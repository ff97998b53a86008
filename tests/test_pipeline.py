"""Pipeline parallelism against PP=1: for every torch schedule, the loss, every gradient of every
stage and the reported loss equal the PP=1 model's gradient accumulation over the same
micro-batches, at TP 1 and 2, with and without SP, uneven stages and tied embeddings."""

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar import pipeline_parallel as pipeline
from tensorpar.planning import pipeline as pipeline_model
from tensorpar.planning.communication import CommConfig
from tensorpar.errors import UsageError
from tensorpar.data_parallel.fsdp import gather_dp_shards
from tensorpar.models import GPT, GPTConfig
from tests.harness import run_on_ranks
from tests.test_fsdp import _min_unit_mib

TINY = dict(vocab_size=61, max_seq_len=16, num_layers=4, num_heads=2, hidden_size=32, make_vocab_size_divisible_by=8)
LLAMA = dict(norm="rmsnorm", activation="swiglu", position_embedding="rope", bias=False, tie_word_embeddings=False)
GPT2 = dict(activation="gelu_tanh")  # learned positions, LayerNorm with biases, tied embeddings
SEQ, ROWS_PER_MICROBATCH = 8, 2
# PP=1 and PP=N add the same numbers, except where the schedule's order of summation differs
# (the tied embedding's two copies, summed at the end): fp32 rounding, relative to the tensor.
RTOL = 1e-6

_GROUPS: dict = {}


def _groups(tp_size: int, pp_size: int) -> dict:
    """This rank's TP, PP, DP and embedding groups in Megatron's rank order (TP fastest, then DP,
    then PP); every rank creates every group, in the same order."""
    key = (dist.get_world_size(), tp_size, pp_size)
    if key not in _GROUPS:
        world, rank = dist.get_world_size(), dist.get_rank()
        dp_size = world // (tp_size * pp_size)
        ranks = torch.arange(world).reshape(pp_size, dp_size, tp_size)
        mine = {}
        for name, lists in (("tp", ranks.reshape(-1, tp_size)),
                            ("pp", ranks.permute(1, 2, 0).reshape(-1, pp_size)),
                            ("dp", ranks.permute(0, 2, 1).reshape(-1, dp_size))):
            for members in lists.tolist():
                group = dist.new_group(members)
                if rank in members:
                    mine[name] = group
        for members in ranks.permute(1, 2, 0).reshape(-1, pp_size).tolist():
            ends = sorted({members[0], members[-1]})
            group = dist.new_group(ends)
            if rank in ends:
                mine["embedding"] = group
        _GROUPS[key] = mine
    return _GROUPS[key]


def _batch(microbatches: int, vocab: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    rows = ROWS_PER_MICROBATCH * microbatches
    tokens = torch.randint(0, vocab, (rows, SEQ), generator=g)
    labels = torch.randint(0, vocab, (rows, SEQ), generator=g)
    labels[0, :3] = -100
    return tokens, labels


def _pp1(config: GPTConfig, tokens, labels, microbatches: int, tp_group):
    """The PP=1 step: gradient accumulation as the training loop does it."""
    tp.model_parallel_manual_seed(1234, tp_group=tp_group)
    model = GPT(config, tp_group=tp_group)
    total = torch.zeros((), dtype=torch.float64)
    for mb_tokens, mb_labels in zip(tokens.chunk(microbatches), labels.chunk(microbatches)):
        loss = model(mb_tokens, mb_labels)
        (loss / microbatches).backward()
        total += loss.detach().double()
    tp.allreduce_sequence_parallel_grads(model, tp_group=tp_group)
    return model, total / microbatches


def _worst_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def _run_case(tp_size, pp_size, schedule, microbatches, overrides, virtual_stages=None, layers_per_stage=None):
    """One PP run against PP=1 on this rank: the largest gradient error relative to its tensor."""
    groups = _groups(tp_size, pp_size)
    config = GPTConfig(**{**TINY, **overrides})
    tokens, labels = _batch(microbatches, config.vocab_size)
    full, expected_loss = _pp1(config, tokens, labels, microbatches, groups["tp"])
    layout = pipeline.stage_layout(config.num_layers, pp_size=pp_size, schedule=schedule,
                                   virtual_stages=virtual_stages, layers_per_stage=layers_per_stage)
    tp.model_parallel_manual_seed(1234, tp_group=groups["tp"])
    stages = pipeline.build_stages(config, layout, pp_group=groups["pp"], tp_group=groups["tp"])
    schedule_ = pipeline.PipelineSchedule(stages, layout, schedule=schedule, microbatches=microbatches,
                                          pp_group=groups["pp"], embedding_group=groups.get("embedding"))
    loss = schedule_.step(tokens, labels)
    case = f"{schedule} TP={tp_size} PP={pp_size} M={microbatches} {overrides}"
    assert abs(loss.item() - expected_loss.item()) <= RTOL * abs(expected_loss.item()), (case, loss, expected_loss)
    reference = dict(full.named_parameters())
    worst, seen = 0.0, set()
    for stage in stages:
        for name, param in stage.named_parameters():
            full_name = pipeline.full_model_name(stage, name)
            seen.add(full_name)
            expected = reference[full_name]
            assert torch.equal(param.detach(), expected.detach()), (case, name, "weights differ from PP=1's")
            error = _worst_error(param.grad, expected.grad)
            assert error <= RTOL, (case, name, error)
            worst = max(worst, error)
    # Every parameter of the PP=1 model is on some stage of the pipeline.
    everywhere = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, sorted(seen))
    assert set().union(*map(set, everywhere)) == set(reference), case
    return worst


def _cases_body(tp_size, pp_size, cases):
    return [_run_case(tp_size, pp_size, **case) for case in cases]


ALL_SCHEDULES = list(pipeline.SCHEDULES)


def test_every_schedule_at_pp2_equals_pp1():
    cases = [dict(schedule=s, microbatches=4, overrides=LLAMA) for s in ALL_SCHEDULES]
    worst = run_on_ranks(_cases_body, 2, 1, 2, cases, timeout=300)
    assert all(e <= RTOL for rank in worst for e in rank)


def test_uneven_stages_tied_embeddings_and_recompute_at_pp2_equal_pp1():
    cases = [dict(schedule="1f1b", microbatches=3, overrides=dict(LLAMA, num_layers=5)),
             dict(schedule="gpipe", microbatches=2, overrides=dict(GPT2, num_layers=5, recompute=True)),
             dict(schedule="1f1b", microbatches=2, overrides=dict(GPT2, num_layers=5), layers_per_stage=[1, 4]),
             dict(schedule="interleaved-1f1b", microbatches=4, overrides=dict(GPT2, num_layers=5)),
             dict(schedule="zbv", microbatches=4, overrides=dict(GPT2, recompute=True)),
             dict(schedule="dualpipev", microbatches=4, overrides=GPT2)]
    run_on_ranks(_cases_body, 2, 1, 2, cases, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_by_pp2_equals_pp1(sequence_parallel):
    sp = dict(sequence_parallel=sequence_parallel)
    cases = [dict(schedule="1f1b", microbatches=2, overrides=dict(LLAMA, num_layers=5, **sp)),
             dict(schedule="interleaved-1f1b", microbatches=4, overrides=dict(GPT2, **sp)),
             dict(schedule="zbv", microbatches=2, overrides=dict(GPT2, **sp))]
    run_on_ranks(_cases_body, 4, 2, 2, cases, timeout=300)


@pytest.mark.slow
def test_1f1b_and_interleaved_at_pp4_equal_pp1():
    cases = [dict(schedule="1f1b", microbatches=4, overrides=dict(GPT2, num_layers=6)),
             dict(schedule="interleaved-1f1b", microbatches=4, overrides=dict(LLAMA, num_layers=8))]
    run_on_ranks(_cases_body, 4, 1, 4, cases, timeout=300)


def _shape_inference_body():
    """The first step's shape inference (a dummy micro-batch forward and backward) leaves every
    main_grad as it was without copying it: a recomputed block's backward reaches none, and no
    tensor the size of the largest main_grad is made meanwhile."""
    import unittest.mock

    from tensorpar.pipeline_parallel.torch_stage import TorchStage
    from tests.op_counter import OpCounter

    groups = _groups(1, 2)
    config = GPTConfig(**{**TINY, **GPT2, "recompute": True})
    layout = pipeline.stage_layout(config.num_layers, pp_size=2, schedule="1f1b")
    tp.model_parallel_manual_seed(1234, tp_group=groups["tp"])
    stages = pipeline.build_stages(config, layout, pp_group=groups["pp"], tp_group=groups["tp"])
    params = [p for stage in stages for p in stage.parameters()]
    reducer = tp.DataParallelGradReducer(params, dp_group=groups["dp"])
    reducer.zero_grad()
    reducer.sync = False  # the micro-batches' gradients only accumulate (DP 1)
    largest = max(p.numel() for p in params)
    seen, inference = [], TorchStage._backward_metadata_inference

    def watched(stage, *args, **kwargs):
        before = [p.main_grad.clone() for p in stage.submod.parameters()]
        with OpCounter(big=largest) as ops:
            result = inference(stage, *args, **kwargs)
        after = [p.main_grad for p in stage.submod.parameters()]
        seen.append((ops.fresh_big_results, all(torch.equal(a, b) for a, b in zip(before, after))))
        return result

    schedule = pipeline.PipelineSchedule(stages, layout, schedule="1f1b", microbatches=2, pp_group=groups["pp"],
                                         embedding_group=groups.get("embedding"))
    tokens, labels = _batch(2, config.vocab_size)
    with unittest.mock.patch.object(TorchStage, "_backward_metadata_inference", watched):
        schedule.step(tokens, labels)
    return seen


def test_the_first_steps_shape_inference_keeps_out_of_main_grad_without_copying_it():
    assert run_on_ranks(_shape_inference_body, 2) == [[(0, True)]] * 2


def _fsdp_body(tp_invariant: bool, units: str):
    """TP 1 x PP 2 x DP 2 with each stage sharded over DP, the same batch on both DP ranks: FSDP's
    average over DP is the PP=1 gradient, shard by shard, the tied embedding's copies summed (also
    for an invariant model stepped without its ShardedGradSync: FSDP's own reduction)."""
    groups = _groups(1, 2)
    config = GPTConfig(**{**TINY, **GPT2}, tp_invariant=tp_invariant)
    tokens, labels = _batch(2, config.vocab_size)
    full, expected_loss = _pp1(config, tokens, labels, 2, groups["tp"])
    layout = pipeline.stage_layout(config.num_layers, pp_size=2, schedule="1f1b")
    tp.model_parallel_manual_seed(1234, tp_group=groups["tp"])
    stages = pipeline.build_stages(config, layout, pp_group=groups["pp"], tp_group=groups["tp"])
    pipeline.fully_shard_stages(stages, dp_group=groups["dp"], min_unit_mib=_min_unit_mib(stages[0], units))
    schedule = pipeline.PipelineSchedule(stages, layout, schedule="1f1b", microbatches=2, pp_group=groups["pp"],
                                         embedding_group=groups["embedding"])
    loss = schedule.step(tokens, labels)
    reference = dict(full.named_parameters())
    names = {param: pipeline.full_model_name(stage, name)
             for stage in stages for name, param in stage.named_parameters()}
    errors = {name: _worst_error(gather_dp_shards(param.grad, dp_group=groups["dp"]), reference[name].grad)
              for param, name in names.items()}
    v_stages = pipeline.build_stages(config, pipeline.stage_layout(config.num_layers, pp_size=2, schedule="zbv"),
                                     pp_group=groups["pp"], tp_group=groups["tp"])
    if v_stages[0].pre_process:  # PP rank 0 holds the first and the last stage, and their tied embedding
        with pytest.raises(UsageError, match="FSDP cannot shard the tied embedding that the first and the last"):
            pipeline.fully_shard_stages(v_stages, dp_group=groups["dp"])
    return loss.item(), expected_loss.item(), errors


@pytest.mark.slow
@pytest.mark.parametrize("tp_invariant, units", [(False, "default"), (False, "pairs"), (True, "per block")])
def test_each_stage_fully_sharded_over_dp_gives_every_pp1_gradient(tp_invariant, units):
    for loss, expected, errors in run_on_ranks(_fsdp_body, 4, tp_invariant, units, timeout=300):
        assert abs(loss - expected) <= RTOL * abs(expected), (loss, expected)
        assert errors and all(error <= RTOL for error in errors.values()), errors


def _context_body():
    """PP 2 x CP 2 on Megatron's groups: each CP rank's gradients are its tokens' share, which summed
    over CP are PP=1 CP=1's; the loss is the whole sequence's; what passes between the stages is
    each CP rank's chunks (7 tokens padded to 8: 4 per rank, not 7)."""
    ps = tp.parallel_state
    tp.initialize_model_parallel(1, 2, context_parallel_size=2)
    tp_group, pp_group, cp_group = (ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
                                    ps.get_context_parallel_group())
    errors, sent = {}, set()
    for schedule, comm_type, overrides in (("1f1b", "p2p", LLAMA), ("interleaved-1f1b", "a2a", GPT2)):
        config = GPTConfig(**{**TINY, **overrides, "context_parallel_comm": comm_type})
        tokens, labels = (t[:, :-1] for t in _batch(2, config.vocab_size))
        full, expected_loss = _pp1(config, tokens, labels, 2, tp_group)
        layout = pipeline.stage_layout(config.num_layers, pp_size=2, schedule=schedule)
        tp.model_parallel_manual_seed(1234, tp_group=tp_group)
        stages = pipeline.build_stages(config, layout, pp_group=pp_group, tp_group=tp_group, cp_group=cp_group)
        schedule_ = pipeline.PipelineSchedule(stages, layout, schedule=schedule, microbatches=2, pp_group=pp_group,
                                              embedding_group=ps.get_embedding_group(check_initialized=False))
        with pytest.raises(UsageError, match="needs the tokens or labels on every rank"):
            schedule_.step()
        with tp.CommLedger() as ledger:
            loss = schedule_.step(tokens, labels)
        assert abs(loss.item() - expected_loss.item()) <= RTOL * abs(expected_loss.item()), (schedule, loss)
        sent |= {r.shape for r in ledger.records if r.op in ("send", "recv")}
        reference = dict(full.named_parameters())
        for stage in stages:
            for name, param in stage.named_parameters():
                grad = param.grad.clone()
                dist.all_reduce(grad, group=cp_group)
                errors[schedule, name] = _worst_error(grad, reference[pipeline.full_model_name(stage, name)].grad)
    return errors, sent


def test_pp2_by_cp2_gives_every_pp1_gradient_and_sends_each_cp_ranks_chunks():
    for errors, sent in run_on_ranks(_context_body, 4, timeout=300):
        assert errors and all(error <= RTOL for error in errors.values()), errors
        assert sent == {(4, ROWS_PER_MICROBATCH, TINY["hidden_size"])}


def _ledger_body():
    groups = _groups(1, 2)
    config = GPTConfig(**{**TINY, **LLAMA})
    layout = pipeline.stage_layout(config.num_layers, pp_size=2, schedule="1f1b")
    tp.model_parallel_manual_seed(1234, tp_group=groups["tp"])
    stages = pipeline.build_stages(config, layout, pp_group=groups["pp"], tp_group=groups["tp"])
    with pytest.raises(UsageError, match="needs at least PP = 2 micro-batches, got 1"):
        pipeline.PipelineSchedule(stages, layout, schedule="1f1b", microbatches=1, pp_group=groups["pp"])
    schedule = pipeline.PipelineSchedule(stages, layout, schedule="1f1b", microbatches=3, pp_group=groups["pp"])
    tokens, labels = _batch(3, config.vocab_size)
    schedule.step(tokens, labels)  # the first step also exchanges the shapes (not tensors)
    with tp.CommLedger() as ledger:
        schedule.step(tokens, labels)
    return [(r.op, r.shape, r.dtype, r.bytes) for r in ledger.records if r.op in ("send", "recv")]


def test_the_ledger_records_every_activation_and_gradient_between_stages():
    first, last = run_on_ranks(_ledger_body, 2)
    activation = ((SEQ, ROWS_PER_MICROBATCH, TINY["hidden_size"]), torch.float32, SEQ * ROWS_PER_MICROBATCH * 32 * 4)
    # Stage 0 sends each micro-batch's activations and receives their gradients; stage 1 the reverse.
    assert sorted(first) == sorted([("send", *activation)] * 3 + [("recv", *activation)] * 3)
    assert sorted(last) == sorted(first)
    # The cost model (tensorpar comm --pp) predicts these sends: shape, dtype, bytes and counts.
    cfg = CommConfig(layer="gpt-step", hidden=TINY["hidden_size"], heads=2, seq_len=SEQ, batch=ROWS_PER_MICROBATCH,
                     layers=TINY["num_layers"], tp=1, dtype="fp32")
    cost = pipeline_model.pipeline_cost(cfg, pp_size=2, schedule="1f1b", microbatches=3)
    assert (cost.send_shape, cost.dtype, cost.bytes_per_send) == activation
    for records, rank in zip((first, last), cost.ranks):
        assert [op for op, *_ in records].count("send") == rank.sends == 3
        assert [op for op, *_ in records].count("recv") == rank.recvs == 3


def test_too_few_microbatches_are_refused_in_one_line_naming_the_requirement():
    for schedule, microbatches, pp_size, needs in (("1f1b", 3, 4, "at least PP = 4"),
                                                   ("dualpipev", 3, 2, "at least 2 x PP = 4"),
                                                   ("interleaved-1f1b", 5, 2, "multiple of its rounds"),
                                                   ("interleaved-zb", 7, 2, "multiple of its rounds")):
        with pytest.raises(UsageError, match=needs) as refused:
            pipeline.check_microbatches(schedule, microbatches=microbatches, pp_size=pp_size)
        assert "\n" not in str(refused.value) and str(microbatches) in str(refused.value)
    for schedule in ALL_SCHEDULES:
        pipeline.check_microbatches(schedule, microbatches=4, pp_size=2)


def test_stage_layouts_uneven_overridden_virtual_and_v_shaped():
    assert pipeline.stage_layout(5, pp_size=2, schedule="1f1b").layers == (range(0, 3), range(3, 5))
    assert [len(r) for r in pipeline.stage_layout(6, pp_size=4, schedule="gpipe").layers] == [2, 2, 1, 1]
    assert pipeline.stage_layout(5, pp_size=2, schedule="1f1b", layers_per_stage=[1, 4]).layers == (
        range(0, 1), range(1, 5))
    looped = pipeline.stage_layout(8, pp_size=2, schedule="interleaved-1f1b", virtual_stages=3,
                                   layers_per_stage=[1, 1, 1, 1, 2, 2])
    assert [looped.stages_of(r) for r in range(2)] == [(0, 2, 4), (1, 3, 5)]
    v = pipeline.stage_layout(8, pp_size=4, schedule="zbv")
    assert [v.stages_of(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    for kwargs, message in ((dict(num_layers=3, pp_size=2, schedule="interleaved-1f1b"), "exceed the 3 layers"),
                            (dict(num_layers=4, pp_size=2, schedule="1f1b", virtual_stages=2), "multi-stage"),
                            (dict(num_layers=4, pp_size=2, schedule="zbv", virtual_stages=3), "exactly 2"),
                            (dict(num_layers=4, pp_size=2, schedule="1f1b", layers_per_stage=[4, 0]), "positive"),
                            (dict(num_layers=4, pp_size=2, schedule="Zero"), "unknown pipeline schedule")):
        with pytest.raises(UsageError, match=message):
            pipeline.stage_layout(**kwargs)
