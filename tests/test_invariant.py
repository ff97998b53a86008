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

import tensorpar as tp
from tensorpar import invariant
from tensorpar.models import GPT, GPTConfig
from tests.harness import run_on_ranks

GPT2 = GPTConfig(vocab_size=96, max_seq_len=16, num_layers=2, num_heads=4, hidden_size=64, dropout=0.1,
                 attention_dropout=0.0, tp_invariant=True)
LLAMA = GPTConfig(vocab_size=96, max_seq_len=16, num_layers=2, num_heads=8, num_query_groups=4, hidden_size=64,
                  norm="rmsnorm", activation="swiglu", position_embedding="rope", bias=False,
                  tie_word_embeddings=False, dropout=0.1, attention_dropout=0.0, tp_invariant=True)
LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]
STEPS = 3

_GROUPS: dict[int, object] = {}


def _group(size: int):
    """The group of ranks ``0..size-1`` (every rank creates every group, once)."""
    if not _GROUPS:
        for n in (1, 2, 4):
            _GROUPS[n] = dist.new_group(list(range(n)))
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
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    reducer = invariant.DataParallelGradReducer(model.parameters(), dp_group=dist.new_group([dist.get_rank()]))
    losses = []
    for step in range(first_step, first_step + steps):
        reducer.zero_grad()
        tokens, labels = _batch(step, config)
        loss = model(tokens, labels)
        loss.backward()
        reducer.finish()
        invariant.allreduce_sequence_parallel_grads(model, tp_group=group)
        invariant.clip_grad_norm_(list(model.parameters()), 0.5, tp_group=group)
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


def _invariance_body(config: GPTConfig):
    results = {}
    for size, sp in LAYOUTS:
        group = _group(size)  # every rank takes part in creating it
        if dist.get_rank() >= size:
            continue
        losses, model, _ = _train(dataclasses.replace(config, sequence_parallel=sp), group, STEPS)
        results[(size, sp)] = (losses, model.full_state_dict())
    dist.barrier()
    if dist.get_rank() != 0:
        return {}
    reference = results[(1, False)]
    return {layout: _mismatch(reference, *results[layout]) for layout in LAYOUTS[1:]}


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama-gqa"])
def test_training_is_bit_identical_at_every_tp_size(config):
    report = run_on_ranks(_invariance_body, 4, config, timeout=300)[0]
    assert report == {layout: None for layout in LAYOUTS[1:]}
