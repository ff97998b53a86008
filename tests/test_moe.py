"""Mixture of experts: the router, the experts and the layer against plainly written PyTorch,
and expert parallelism (EP 2 and 4, with TP) against the one-rank computation, rank by rank."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tensorpar as tp
from tensorpar.expert_parallel import GroupedExperts, MoELayer, TopKRouter, set_aux_loss_scale, step_expert_balance
from tensorpar import parallel_state
from tensorpar.expert_parallel import experts as experts_module
from tests.harness import run_on_ranks


def _plain_moe(moe: MoELayer, x: torch.Tensor, *, gate_up=None, down=None) -> torch.Tensor:
    """The layer written plainly: Mixtral's routing and a loop of experts over the tokens."""
    router = moe.router
    tokens = x.reshape(-1, x.shape[-1])
    scores = F.linear(tokens, router.weight).float().softmax(-1)
    choice = scores if router.expert_bias is None else scores + router.expert_bias
    chosen = choice.topk(router.topk, dim=-1).indices
    weights = scores.gather(-1, chosen)
    weights = weights / weights.sum(-1, keepdim=True)
    gate_up = moe.experts.gate_up if gate_up is None else gate_up
    down = moe.experts.down if down is None else down
    out = torch.zeros_like(tokens)
    for e in range(len(gate_up)):
        token, slot = (chosen == e).nonzero(as_tuple=True)
        gate, up = F.linear(tokens[token], gate_up[e]).chunk(2, dim=-1)
        out = out.index_add(0, token, F.linear(F.silu(gate) * up, down[e]) * weights[token, slot, None])
    return out.view_as(x)


def _switch_loss(scores, chosen, num_experts, topk):
    counts = torch.zeros_like(scores).scatter_(1, chosen, 1.0).sum(0)
    return num_experts / (topk * len(scores) ** 2) * (scores.sum(0) * counts).sum()


# ------------------------------------------------------------------ one rank


@pytest.mark.parametrize("hidden", [16, 6])   # 6 floats: rows of 24 bytes, the exact loop
def test_grouped_experts_give_the_bits_of_a_loop_also_with_an_empty_expert(hidden):
    torch.manual_seed(0)
    experts = GroupedExperts(3, hidden_size=hidden, ffn_hidden_size=8)
    rows = torch.randn(10, hidden, requires_grad=True)
    counts = torch.tensor([4, 0, 6])
    assert experts_module._grouped_mm_applies(rows, experts.gate_up, experts.down) == (hidden == 16)
    out = experts(rows, counts)
    grad = torch.randn_like(out)
    out.backward(grad)
    grads = [rows.grad, experts.gate_up.grad, experts.down.grad]
    ref_rows = rows.detach().clone().requires_grad_()
    gate_up, down = (experts.gate_up.detach().clone().requires_grad_(), experts.down.detach().clone().requires_grad_())
    ref = []
    for chunk, gu, d in zip(ref_rows.split([4, 0, 6]), gate_up, down):
        gate, up = F.linear(chunk, gu).chunk(2, dim=-1)
        ref.append(F.linear(F.silu(gate) * up, d))
    ref = torch.cat(ref)
    ref.backward(grad)
    assert torch.equal(out, ref)
    for got, want in zip(grads, [ref_rows.grad, gate_up.grad, down.grad]):
        assert torch.equal(got, want)


def test_grouped_experts_take_a_broadcast_gradient_and_no_rows():
    experts = GroupedExperts(2, hidden_size=16, ffn_hidden_size=8)
    experts(torch.randn(5, 16), torch.tensor([2, 3])).sum().backward()    # sum's gradient has stride 0
    empty = torch.zeros(0, 16, requires_grad=True)
    out = experts(empty, torch.tensor([0, 0]))
    out.sum().backward()
    assert out.shape == (0, 16) and empty.grad.shape == (0, 16)


def test_softmax_router_is_mixtrals_and_its_aux_and_z_losses_are_the_formulas():
    torch.manual_seed(0)
    router = TopKRouter(16, 6, topk=2, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    tokens = torch.randn(20, 16)
    weights, chosen = router(tokens)
    logits = F.linear(tokens, router.weight)
    scores = logits.softmax(-1)
    ref_weights, ref_chosen = scores.topk(2, dim=-1)
    assert torch.equal(chosen, ref_chosen)
    torch.testing.assert_close(weights, ref_weights / ref_weights.sum(-1, keepdim=True))
    aux = 0.1 * _switch_loss(scores, chosen, 6, 2) + 0.01 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(router.aux_loss_sum.float(), aux)
    assert router.tokens_per_expert.sum() == 40


def test_sequence_aux_loss_averages_the_loss_of_each_sequence():
    torch.manual_seed(0)
    router = TopKRouter(8, 4, topk=1, load_balancing_type="seq_aux_loss", aux_loss_coeff=1.0)
    tokens = torch.randn(12, 8)                                     # [s=4, b=3] flattened
    sequence = torch.arange(12) % 3
    _, chosen = router(tokens, sequence, 3)
    scores = F.linear(tokens, router.weight).softmax(-1)
    ref = sum(_switch_loss(scores[sequence == j], chosen[sequence == j], 4, 1) for j in range(3)) / 3
    torch.testing.assert_close(router.aux_loss_sum.float(), ref)


def test_sigmoid_grouped_router_is_deepseek_v3s():
    torch.manual_seed(0)
    router = TopKRouter(16, 8, topk=2, score_function="sigmoid", num_groups=4, group_topk=2,
                        scaling_factor=2.5, enable_expert_bias=True)
    router.expert_bias.copy_(torch.linspace(-0.1, 0.1, 8))
    tokens = torch.randn(30, 16)
    weights, chosen = router(tokens)
    scores = F.linear(tokens, router.weight).sigmoid()
    biased = scores + router.expert_bias
    group_scores = biased.view(30, 4, 2).sum(-1)                    # two experts per group: both count
    keep = torch.zeros(30, 4, dtype=torch.bool).scatter_(1, group_scores.topk(2, dim=-1).indices, True)
    ref_chosen = biased.masked_fill(~keep.repeat_interleave(2, dim=1), float("-inf")).topk(2, dim=-1).indices
    assert torch.equal(chosen, ref_chosen)
    ref = scores.gather(-1, ref_chosen)
    torch.testing.assert_close(weights, 2.5 * ref / ref.sum(-1, keepdim=True))


def test_expert_bias_moves_towards_balance_once_per_step_and_recompute_counts_once():
    router = TopKRouter(4, 4, topk=1, enable_expert_bias=True, bias_update_rate=0.5)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0, 0] = 1.0                                   # every token with x0 > 0 picks expert 0
    tokens = torch.tensor([[1.0, 0, 0, 0]] * 3, requires_grad=True)
    weights, _ = torch.utils.checkpoint.checkpoint(router, tokens, use_reentrant=False)
    weights.sum().backward()                                        # the recompute inside backward
    assert router.tokens_per_expert.tolist() == [3, 0, 0, 0]
    loads = step_expert_balance(router)
    assert loads[0].tolist() == [3, 0, 0, 0]
    assert router.expert_bias.tolist() == [-0.5, 0.5, 0.5, 0.5]
    assert router.tokens_per_expert.sum() == 0


@pytest.mark.parametrize("shared", [False, True])
def test_moe_layer_equals_the_plain_layer_outputs_and_every_gradient(shared):
    torch.manual_seed(0)
    shared_mlp = torch.nn.Linear(16, 16) if shared else None
    moe = MoELayer(16, num_experts=4, ffn_hidden_size=8, topk=2, shared_experts=shared_mlp)
    x = torch.randn(5, 3, 16, requires_grad=True)
    out = moe(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    got = [x.grad] + [p.grad for p in moe.parameters()]
    x_ref = x.detach().clone().requires_grad_()
    for p in moe.parameters():
        p.grad = None
    ref = _plain_moe(moe, x_ref) + (shared_mlp(x_ref) if shared else 0)
    ref.backward(grad)
    torch.testing.assert_close(out, ref)
    for g, want in zip(got, [x_ref.grad] + [p.grad for p in moe.parameters()]):
        torch.testing.assert_close(g, want)


# ------------------------------------------------------------------ expert parallelism


def _sequence_lengths(dp_size: int) -> list[int]:
    return [6, 0, 4, 2][:dp_size]     # data rank 1's micro-batch is empty: its ranks route nothing


def _moe(seed: int, load_balancing: str, **groups) -> MoELayer:
    torch.manual_seed(seed)
    moe = MoELayer(16, num_experts=4, ffn_hidden_size=8, topk=2, load_balancing_type=load_balancing,
                   aux_loss_coeff=0.1, z_loss_coeff=0.01, enable_expert_bias=True, **groups)
    moe.router.expert_bias[0] = -10.0  # expert 0 receives no token
    return moe


def _moe_layout_body(tp_size: int, ep_size: int, sequence_parallel: bool, load_balancing: str):
    tp.initialize_model_parallel(tp_size, expert_model_parallel_size=ep_size, expert_tensor_parallel_size=1)
    tp_group, ep_group = tp.get_tensor_model_parallel_group(), parallel_state.get_expert_model_parallel_group()
    tp_rank, dp_rank, dp_size = (tp.get_tensor_model_parallel_rank(), tp.get_data_parallel_rank(),
                                 tp.get_data_parallel_world_size())
    moe = _moe(1, load_balancing, ep_group=ep_group, tp_group=tp_group, sequence_parallel=sequence_parallel)
    reference = _moe(1, load_balancing)
    inputs = []
    for d, s in enumerate(_sequence_lengths(dp_size)):
        torch.manual_seed(100 + d)
        inputs.append((torch.randn(s, 2, 16), torch.randn(s, 2, 16)))
    x, grad = inputs[dp_rank]
    if sequence_parallel:
        x, grad = x.chunk(tp_size)[tp_rank], grad.chunk(tp_size)[tp_rank]
    x = x.clone().requires_grad_()
    out = moe(x)
    (out * grad).sum().backward()
    ref_x = [xd.clone().requires_grad_() for xd, _ in inputs]
    ref_out = [reference(xd) for xd in ref_x]
    sum((o * g).sum() for o, (_, g) in zip(ref_out, inputs)).backward()
    want_out, want_x_grad = ref_out[dp_rank], ref_x[dp_rank].grad
    if sequence_parallel:
        want_out, want_x_grad = want_out.chunk(tp_size)[tp_rank], want_x_grad.chunk(tp_size)[tp_rank]
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(x.grad, want_x_grad)
    router_grad = moe.router.weight.grad.clone()
    dist.all_reduce(router_grad)                           # every rank routed its own tokens
    torch.testing.assert_close(router_grad, reference.router.weight.grad)
    local = slice(moe.experts.first_expert, moe.experts.first_expert + moe.experts.num_local_experts)
    for name in ("gate_up", "down"):
        got = getattr(moe.experts, name).grad.clone()
        dist.all_reduce(got, group=parallel_state.get_expert_data_parallel_group())
        torch.testing.assert_close(got, getattr(reference.experts, name).grad[local])
    data_groups = [tp_group] if tp_size > 1 else []
    loads = step_expert_balance(moe, groups=data_groups + [tp.get_data_parallel_group()])
    assert torch.equal(loads[0], reference.router.tokens_per_expert) and loads[0][0] == 0
    return float(loads[0].sum())


@pytest.mark.parametrize("ep_size", [2, 4])
def test_expert_parallel_over_data_ranks_equals_one_rank(ep_size):
    totals = run_on_ranks(_moe_layout_body, 4, 1, ep_size, False, "aux_loss")
    assert totals == [2.0 * 2 * (6 + 0 + 4 + 2)] * 4


def test_expert_parallel_size_one_on_two_data_ranks():
    run_on_ranks(_moe_layout_body, 2, 1, 1, False, "seq_aux_loss")


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("ep_size", [1, 2])
def test_expert_parallel_with_tensor_parallel_two_equals_one_rank(sequence_parallel, ep_size):
    run_on_ranks(_moe_layout_body, 2, 2, ep_size, sequence_parallel, "seq_aux_loss")


@pytest.mark.parametrize("ep_size", [2, 4])
def test_expert_parallel_folded_over_tensor_and_data_ranks(ep_size):
    run_on_ranks(_moe_layout_body, 4, 2, ep_size, True, "aux_loss")


# ------------------------------------------------------------------ a GPT with experts


_GPT_MOE = dict(vocab_size=64, max_seq_len=16, num_layers=2, num_heads=4, hidden_size=32, norm="rmsnorm",
                activation="swiglu", position_embedding="rope", bias=False, tie_word_embeddings=False,
                make_vocab_size_divisible_by=8, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


def _gpt_moe_body(tp_size: int, cp_size: int, ep_size: int, overrides: dict):
    from tensorpar.models.gpt import GPT
    from tensorpar.models.config import GPTConfig
    from tensorpar.models.layout import gather_full_tensor
    from tensorpar.data_parallel.grads import DataParallelGradReducer, get_grad_norm
    tp.initialize_model_parallel(tp_size, context_parallel_size=cp_size, expert_model_parallel_size=ep_size,
                                 expert_tensor_parallel_size=1)
    single = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    cp_group = parallel_state.get_context_parallel_group() if cp_size > 1 else None
    dp_rank, dp_size = tp.get_data_parallel_rank(), tp.get_data_parallel_world_size()
    config = GPTConfig(**{**_GPT_MOE, **overrides})
    tp.model_parallel_manual_seed(7, tp_group=single)
    reference = GPT(GPTConfig(**{**_GPT_MOE, **overrides, "sequence_parallel": False}), tp_group=single,
                    ep_group=single)
    tp.model_parallel_manual_seed(7, tp_group=tp.get_tensor_model_parallel_group())
    model = GPT(config, cp_group=cp_group)
    data = []
    for d in range(dp_size):
        g = torch.Generator().manual_seed(50 + d)
        data.append((torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)))
    # The training loop's reduction: dense grads over DP x CP (the loss times CP), experts over expert DP.
    reducer = DataParallelGradReducer(model.parameters(), dp_group=tp.get_data_parallel_group(with_context_parallel=True),
                                      expert_dp_group=parallel_state.get_expert_data_parallel_group())
    reducer.zero_grad()
    loss = model(*data[dp_rank])
    set_aux_loss_scale(cp_size)
    (loss * cp_size).backward()
    reducer.finish()
    tp.allreduce_sequence_parallel_grads(model)
    norm = get_grad_norm(model.parameters(), ep_group=parallel_state.get_expert_model_parallel_group())
    ref_losses = [reference(*batch) for batch in data]
    set_aux_loss_scale(1 / dp_size)                        # the balance losses, as the main loss is scaled
    (sum(ref_losses) / dp_size).backward()
    set_aux_loss_scale(1.0)
    torch.testing.assert_close(loss, ref_losses[dp_rank], rtol=1e-5, atol=1e-6)
    ref_grads = dict(reference.named_parameters())
    checked = 0
    for lay in model.parameter_layouts():
        grad, want = lay.param.grad, ref_grads[lay.name].grad
        if getattr(lay.param, "expert_parallel", False):
            experts = model.get_submodule(lay.name.rpartition(".")[0])
            want = want[experts.first_expert:experts.first_expert + experts.num_local_experts]
            checked += 1
        elif lay.tensor_model_parallel:
            grad = gather_full_tensor(grad, partition_dim=lay.partition_dim, stride=lay.partition_stride,
                                      partition_rows=lay.partition_rows)
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6, msg=lay.name)
    torch.testing.assert_close(norm, get_grad_norm(reference.parameters(), tp_group=single), rtol=1e-5, atol=1e-6)
    assert checked == 2 * config.num_layers
    return float(loss)


@pytest.mark.parametrize("tp_size,cp_size,ep_size,overrides", [
    (1, 1, 2, {}),
    (1, 1, 4, {"moe_shared_expert_intermediate_size": 24, "moe_router_load_balancing_type": "seq_aux_loss"}),
    (2, 1, 2, {"sequence_parallel": True}),
    (2, 1, 4, {"recompute": True}),
    (1, 2, 2, {"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"}),
], ids=["ep2", "ep4-shared-seq-aux", "tp2-sp-ep2", "tp2-ep4-recompute", "cp2-ep2-sigmoid"])
def test_gpt_with_experts_trains_as_one_rank(tp_size, cp_size, ep_size, overrides):
    world = 2 if tp_size * cp_size * ep_size == 2 else 4
    run_on_ranks(_gpt_moe_body, world, tp_size, cp_size, ep_size, overrides)


@pytest.mark.slow
def test_gpt_with_experts_at_tp2_sp_x_cp2_x_dp2_with_ep4_trains_as_one_rank():
    run_on_ranks(_gpt_moe_body, 8, 2, 2, 4, {"sequence_parallel": True, "moe_router_enable_expert_bias": True})


def _parameters_body(tp_size: int, ep_size: int, overrides: dict):
    from tensorpar.models.config import GPTConfig
    from tensorpar.models.gpt import GPT
    from tensorpar.planning.memory import gpt_parameters_per_rank

    tp.initialize_model_parallel(tp_size, expert_model_parallel_size=ep_size, expert_tensor_parallel_size=1)
    config = GPTConfig(**{**_GPT_MOE, **overrides})
    held = sum(p.numel() for p in GPT(config).parameters())
    assert gpt_parameters_per_rank(config, tp=tp_size, ep=ep_size) == held, overrides
    return held


@pytest.mark.parametrize("tp_size, ep_size", [(1, 2), (2, 2), (2, 1)])
def test_the_memory_model_counts_the_experts_a_rank_holds(tp_size, ep_size):
    for overrides in ({}, {"moe_first_dense_layers": 1, "moe_shared_expert_intermediate_size": 24}):
        run_on_ranks(_parameters_body, 2, tp_size, ep_size, overrides)


def _fsdp_parameters_body():
    from torch.distributed.tensor import DTensor

    from tensorpar.models.config import GPTConfig
    from tensorpar.models.gpt import GPT
    from tensorpar.planning.memory import gpt_training_memory

    tp.initialize_model_parallel(1, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    config = GPTConfig(**_GPT_MOE)
    model = tp.fully_shard(GPT(config))
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    assert all(not isinstance(p, DTensor) for p in model.parameters() if getattr(p, "expert_parallel", False))
    estimate = gpt_training_memory(config, tp=1, dp=2, seq_len=8, micro_batch=1, fsdp=True, ep=2)["parameters"]
    assert estimate == 4 * held
    return held


def test_fsdp_leaves_the_experts_to_ep_and_the_memory_model_counts_them_whole():
    run_on_ranks(_fsdp_parameters_body, 2)


def test_grouped_experts_compute_in_the_autocast_dtype_as_a_linear_layer_does():
    torch.manual_seed(0)
    experts = GroupedExperts(2, hidden_size=16, ffn_hidden_size=8)
    rows, counts = torch.randn(5, 16), torch.tensor([2, 3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(rows, counts)
        loop = []
        for chunk, gate_up, down in zip(rows.split([2, 3]), experts.gate_up, experts.down):
            gate, up = F.linear(chunk, gate_up).chunk(2, dim=-1)
            loop.append(F.linear(F.silu(gate) * up, down))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, torch.cat(loop))


def _dispatch_ledger_body():
    from tensorpar.planning.experts import dispatch_collectives

    tp.initialize_model_parallel(1, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    torch.manual_seed(0)
    moe = MoELayer(8, num_experts=4, ffn_hidden_size=16, topk=1,
                   ep_group=parallel_state.get_expert_model_parallel_group())
    with torch.no_grad():  # token i goes to expert i % 4: balanced routing
        moe.router.weight.copy_(torch.eye(4, 8))
    x = (5 * torch.eye(8)[torch.arange(8) % 4]).view(8, 1, 8).requires_grad_()
    with tp.CommLedger() as ledger:
        with ledger.phase("forward"):
            out = moe(x)
        with ledger.phase("backward"):
            out.backward(torch.ones_like(out))
    measured = [(r.phase, r.op, tuple(r.shape), r.dtype, r.group_size) for r in ledger.records]
    predicted = [(op.phase, op.op, op.shape, op.dtype, op.group_size)
                 for op in dispatch_collectives(tokens=8, hidden=8, topk=1, num_experts=4, ep=2, dtype=torch.float32)]
    assert measured == predicted, measured
    return True


def test_the_communication_model_predicts_the_dispatch_a_run_records():
    assert run_on_ranks(_dispatch_ledger_body, 2) == [True, True]
