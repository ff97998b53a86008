"""Memory estimates on one TP rank: the activations a layer keeps for backward
(:func:`activation_memory`) and everything a GPT needs to train (:func:`gpt_training_memory`).

Pure arithmetic over :class:`tensorpar.comm_model.CommConfig` sizes or a GPT config; nothing is built.
"""

from __future__ import annotations

import dataclasses
import math

from .comm_model import CommConfig


@dataclasses.dataclass(frozen=True)
class Activation:
    """A tensor kept for backward; ``tp_sharded`` ones live inside the TP region."""

    name: str
    numel: int
    element_size: int
    tp_sharded: bool

    def bytes_per_rank(self, *, tp: int, sp: bool) -> float:
        # Under SP the tensors outside the TP region hold only this rank's tokens.
        return self.numel * self.element_size / (tp if self.tp_sharded or sp else 1)


def saved_activations(cfg: CommConfig, *, fused_attention: bool = False) -> list[Activation]:
    """What ``cfg.layer`` keeps for backward (per GPT layer for ``gpt-step``), input first.

    The accounting of Korthikanti et al. 2022, section 4.1: linear and LayerNorm inputs, the
    GELU input, softmax output and its dropout, and 1-byte dropout masks. With recompute only
    the input of the checkpointed unit is kept. Embedding and loss are not modelled (empty).
    ``fused_attention`` (a flash-attention kernel) keeps the attention output and fp32 row
    statistics instead of the ``s x s`` softmax tensors.
    """
    s, b, h, a, e = cfg.seq_len, cfg.batch, cfg.hidden, cfg.heads, cfg.element_size
    sbh, sbf, scores = s * b * h, s * b * cfg.ffn_hidden, b * a * s * s
    mlp = [Activation("mlp fc input", sbh, e, False), Activation("gelu input", sbf, e, True),
           Activation("mlp proj input", sbf, e, True)]
    softmax = ([Activation("attention output", sbh, e, True), Activation("softmax statistics", b * a * s, 4, True)]
               if fused_attention else
               [Activation("softmax output", scores, e, True), Activation("attention dropout mask", scores, 1, True),
                Activation("attention dropout output", scores, e, True)])
    qkv = sbh + 2 * s * b * cfg.kv_heads * (h // a)  # grouped-query attention: fewer K/V heads
    attention = [Activation("qkv input", sbh, e, False), Activation("q, k, v", qkv, e, True), *softmax,
                 Activation("attention proj input", sbh, e, True)]
    layer = [Activation("ln1 input", sbh, e, False), *attention,
             Activation("attention residual dropout mask", sbh, 1, False),
             Activation("ln2 input", sbh, e, False), *mlp,
             Activation("mlp residual dropout mask", sbh, 1, False)]
    kept = {
        "column": [Activation("input", sbh, e, False)],
        "row": [Activation("input", sbh, e, True)],
        "mlp": mlp,
        "attention": attention,
        "embedding": [],
        "loss": [],
        "gpt-layer": layer,
        "gpt-step": layer,
    }[cfg.layer]
    return kept[:1] if cfg.recompute else kept


def activation_memory(cfg: CommConfig) -> float:
    """Activation bytes :func:`saved_activations` keeps on each rank.

    Example (Korthikanti et al.'s ``sbh(10 + 24/t + 5as/(ht))`` bytes at bf16, TP only)::

        activation_memory(CommConfig(layer="gpt-layer", hidden=4096, seq_len=2048, tp=8))
    """
    return sum(a.bytes_per_rank(tp=cfg.tp, sp=cfg.sp) for a in saved_activations(cfg))


def gpt_parameters_per_rank(config, *, tp: int) -> float:
    """Parameters one TP rank holds of a GPT ``config`` (a :class:`~tensorpar.models.GPTConfig` or
    any object with its fields), the padded vocabulary included; nothing is built."""
    block, rest = _block_and_rest(config, tp=tp)
    return config.num_layers * block + rest


def _block_and_rest(config, *, tp: int) -> tuple[float, float]:
    """Parameters of one transformer block and of everything else (embeddings, final norm) on a TP rank."""
    h, f = config.hidden_size, config.ffn_hidden_size
    head_dim = h // config.num_heads
    multiple = math.lcm(config.make_vocab_size_divisible_by, tp)
    vocab = -(-config.vocab_size // multiple) * multiple
    norm = 2 * h if config.norm == "layernorm" and config.bias else h  # weight (and bias)
    qkv = (config.num_heads + 2 * config.num_query_groups) * head_dim
    fc = 2 * f if config.activation == "swiglu" else f
    sharded = h * (qkv + h + fc + f)
    sharded += (qkv if config.qkv_bias else 0) + (fc if config.bias else 0)
    replicated = 2 * norm + (2 * h if config.bias else 0)  # norms, row-layer biases
    embeddings = vocab * h / tp * (1 if config.tie_word_embeddings else 2)
    positions = config.max_seq_len * h if config.position_embedding == "learned" else 0
    return sharded / tp + replicated, embeddings + positions + norm


def gpt_training_memory(config, *, tp: int, dp: int = 1, seq_len: int, micro_batch: int, dtype: str = "fp32",
                        fsdp: bool = False, reshard_after_forward: bool = True) -> dict[str, float]:
    """Bytes one rank holds to train a GPT ``config`` (fields as :class:`~tensorpar.models.GPTConfig`)
    with AdamW: ``parameters``, ``gradients``, ``optimizer``, ``activations``, ``gathered`` and ``total``.

    Activations are one micro-batch's (:func:`saved_activations` per layer with fused attention,
    plus the fp32 softmax of the vocab-parallel loss); with ``fsdp`` parameters, gradients and
    optimizer state are divided over the ``dp`` ranks, and ``gathered`` is what FSDP holds whole
    for a while within a step: the root unit's parameters and gradients throughout, and the
    blocks' parameters two at a time (the running one and the prefetched one), or every block's
    from its forward to its backward without ``reshard_after_forward``, plus one block's
    gradients before their reduce-scatter. An estimate made before anything is built.

    Example::

        gpt_training_memory(GPTConfig.preset("small", vocab_size=50257), tp=2, seq_len=1024, micro_batch=8)
    """
    params = gpt_parameters_per_rank(config, tp=tp) / (dp if fsdp else 1)
    param_bytes = config.params_dtype.itemsize
    grad_bytes = 4 if config.gradient_accumulation_fusion else param_bytes  # fused: fp32 main_grad
    layer = CommConfig(layer="gpt-layer", hidden=config.hidden_size, ffn_hidden=config.ffn_hidden_size,
                       heads=config.num_heads, kv_heads=config.num_query_groups, seq_len=seq_len,
                       batch=micro_batch, tp=1, dtype="bf16" if dtype == "bf16" else "fp32")

    def kept(recompute: bool) -> float:
        saved = saved_activations(dataclasses.replace(layer, recompute=recompute), fused_attention=True)
        return sum(a.bytes_per_rank(tp=tp, sp=config.sequence_parallel) for a in saved)

    activations = config.num_layers * kept(config.recompute) + (kept(False) if config.recompute else 0)
    activations += seq_len * micro_batch * config.vocab_size / tp * 4
    block, rest = _block_and_rest(config, tp=tp)
    whole_blocks = (min(2, config.num_layers) if reshard_after_forward else config.num_layers) if fsdp else 0
    gathered = ((rest + whole_blocks * block) * param_bytes + (rest + block) * grad_bytes) if fsdp else 0
    memory = {"parameters": params * param_bytes, "gradients": params * grad_bytes,
              "optimizer": 2 * params * param_bytes, "activations": activations, "gathered": gathered}
    memory["total"] = sum(memory.values())
    return memory
