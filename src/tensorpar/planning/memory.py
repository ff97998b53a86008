"""Memory estimates on one rank: the activations a layer keeps for backward
(:func:`activation_memory`, Korthikanti et al.'s accounting), what a block of tensorpar's GPT
keeps (:func:`gpt_layer_activations`, as measured) and everything a GPT needs to train
(:func:`gpt_training_memory`): at any TP and CP size, for the whole model or the pipeline
stages a rank holds (:class:`StageShare`; :func:`tensorpar.pipeline_parallel.pipeline_memory` fills them
in from a schedule).

Pure arithmetic over :class:`tensorpar.planning.communication.CommConfig` sizes or a GPT config; nothing is built.
"""

from __future__ import annotations

import dataclasses
import math

from .communication import CommConfig
from ..data_parallel.fsdp import MIN_UNIT_MIB, least_unit_bytes
from ..data_parallel.fsdp import consecutive_groups


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


def saved_activations(cfg: CommConfig) -> list[Activation]:
    """What ``cfg.layer`` keeps for backward (per GPT layer for ``gpt-step``), input first.

    The accounting of Korthikanti et al. 2022, section 4.1: linear and LayerNorm inputs, the
    GELU input, softmax output and its dropout, and 1-byte dropout masks. With recompute only
    the input of the checkpointed unit is kept. Embedding and loss are not modelled (empty).
    (:func:`gpt_training_memory` counts what tensorpar's GPT itself keeps: :func:`gpt_layer_activations`.)
    """
    s, b, h, a, e = cfg.seq_len, cfg.batch, cfg.hidden, cfg.heads, cfg.element_size
    sbh, sbf, scores = s * b * h, s * b * cfg.ffn_hidden, b * a * s * s
    mlp = [Activation("mlp fc input", sbh, e, False), Activation("gelu input", sbf, e, True),
           Activation("mlp proj input", sbf, e, True)]
    softmax = [Activation("softmax output", scores, e, True), Activation("attention dropout mask", scores, 1, True),
               Activation("attention dropout output", scores, e, True)]
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


def gpt_parameters_per_rank(config, *, tp: int, ep: int = 1) -> float:
    """Parameters one TP rank holds of a GPT ``config`` (a :class:`~tensorpar.models.GPTConfig` or
    any object with its fields), the padded vocabulary included (``ep``: the expert-parallel size
    a model with experts is split over); nothing is built."""
    block, rest = _block_and_rest(config, tp=tp, ep=ep)
    return config.num_layers * block + rest


def _expert_weights(config, *, ep: int) -> float:
    """The routed experts' weights a rank holds, per block (the mean over the blocks): FSDP
    leaves them whole."""
    share, _ = _moe_mlp(config, tp=1, ep=ep)
    return share and share * config.num_moe_experts / ep * 3 * config.hidden_size * config.moe_ffn_hidden_size


def _moe_mlp(config, *, tp: int, ep: int) -> tuple[float, float]:
    """(the share of blocks with experts, the parameters of their MLP on a rank): the router,
    ``E / ep`` whole SwiGLU experts and a TP-split shared expert."""
    experts = getattr(config, "num_moe_experts", None)
    if experts is None:
        return 0.0, 0.0
    h, shared = config.hidden_size, config.moe_shared_expert_intermediate_size or 0
    share = sum(config.is_moe_layer(i) for i in range(config.num_layers)) / config.num_layers
    return share, experts * h + experts / ep * 3 * h * config.moe_ffn_hidden_size + 3 * h * shared / tp


def _block_and_rest(config, *, tp: int, ep: int = 1) -> tuple[float, float]:
    """Parameters of one transformer block (the mean block, where some have experts) and of
    everything else (embeddings, final norm) on a TP rank."""
    h, f = config.hidden_size, config.ffn_hidden_size
    head_dim = getattr(config, "head_dim", h // config.num_heads)
    multiple = math.lcm(config.make_vocab_size_divisible_by, tp)
    vocab = -(-config.vocab_size // multiple) * multiple
    norm = 2 * h if config.norm == "layernorm" and config.bias else h  # weight (and bias)
    qkv = (config.num_heads + 2 * config.num_query_groups) * head_dim
    fc = 2 * f if config.activation == "swiglu" else f
    moe_share, moe_mlp = _moe_mlp(config, tp=tp, ep=ep)
    dense_mlp = h * (fc + f) + (fc if config.bias else 0)
    sharded = h * (qkv + config.num_heads * head_dim) + (qkv if config.qkv_bias else 0) + (1 - moe_share) * dense_mlp
    replicated = 2 * norm + (2 * h if config.bias else 0)  # norms, row-layer biases
    replicated += 2 * head_dim if getattr(config, "qk_layernorm", False) else 0  # Qwen3's per-head norms
    embeddings = vocab * h / tp * (1 if config.tie_word_embeddings else 2)
    positions = config.max_seq_len * h if config.position_embedding == "learned" else 0
    return sharded / tp + replicated + moe_share * moe_mlp, embeddings + positions + norm


@dataclasses.dataclass(frozen=True)
class StageShare:
    """A pipeline stage as the rank holding it counts it: ``layers`` blocks, the embedding if
    ``first``, the final norm and LM head if ``last``; ``in_flight`` micro-batches' activations at
    the rank's peak; ``microbatches``: the step's count, for torch's receive buffers (one per
    micro-batch, kept between steps: activations into every stage but the first, their
    gradients into every stage but the last). ``tied_here``: the head uses the embedding's
    parameter on this rank (the V schedules' first and last stage): one copy, not two."""

    layers: int
    first: bool = True
    last: bool = True
    in_flight: int = 1
    microbatches: int = 1
    tied_here: bool = False


def local_tokens(seq_len: int, *, tp: int, cp: int, sp: bool) -> int:
    """Tokens of one sequence a CP rank's TP group holds: its two CP chunks (padded, as
    :class:`tensorpar.context_parallel.SequenceChunks` pads them); under SP each TP rank holds 1/TP of
    them outside the TP region (the GPT pads a sequence SP does not split evenly)."""
    multiple = tp if sp and tp > 1 else 1
    if cp > 1:
        return 2 * -(-seq_len // (2 * cp * multiple)) * multiple
    return -(-seq_len // multiple) * multiple


def gpt_layer_activations(config, *, tp: int, cp: int = 1, seq_len: int, micro_batch: int,
                          dtype: str = "fp32") -> list[Activation]:
    """What one block of tensorpar's GPT ``config`` keeps for backward per micro-batch, as measured
    (saved-tensor hooks on CPU): ``numel`` of the whole TP group's tokens of this CP rank.

    Each norm's input and output (RMSNorm also ``x * rstd``); the QKV output, whose K/V (and Q
    without RoPE) views attention keeps; RoPE's rotated Q and K; the softmax statistics; the
    attention output, which is the projection's input where the kernel writes it in Q's layout
    (plain MHA without RoPE at CP = 1); the MLP's ``fc`` output and activation (SwiGLU: ``silu(gate)``
    and the product); 1-byte dropout masks when ``dropout > 0``. With ``attention_dropout > 0``
    attention runs SDPA's math path, which keeps copies of Q, K, V and three ``s x s`` tensors. Under CP each rank holds
    ``2 x ceil(s / 2CP)`` tokens of every sequence; ``a2a`` keeps Q, K, V again in its head split
    (and no RoPE outputs), ``p2p`` keeps its merged output in fp32.
    """
    e = 2 if dtype == "bf16" else 4
    sp = config.sequence_parallel and tp > 1
    s = local_tokens(seq_len, tp=tp, cp=cp, sp=sp)
    tokens, h, d = s * micro_batch, config.hidden_size, config.head_dim
    heads, groups = config.num_heads, config.num_query_groups
    comm = config.context_parallel_comm if cp > 1 else None
    rms, swiglu, rope = config.norm == "rmsnorm", config.activation == "swiglu", config.position_embedding == "rope"

    def hidden(name, width=h, size=e, sharded=False):
        return Activation(name, tokens * width, size, sharded)

    def norm(name):
        return [hidden(f"{name} input"), *([hidden(f"{name} x * rstd")] if rms else []), hidden(f"{name} output")]

    qkv = (heads + 2 * groups) * d
    q_is_view = not rope and heads == groups and heads % tp == 0 and groups % tp == 0
    attention = [hidden("q, k, v (heads split)" if comm == "a2a" else "q, k, v", qkv, sharded=True)]
    if config.attention_dropout > 0 and comm is None:
        # SDPA's math path (the fused kernels draw no dropout here): its own copies of Q, K, V
        # (the first item), and the s x s probabilities, dropout mask and dropped probabilities.
        scores = micro_batch * heads * s * s
        attention += [Activation(name, scores, e, True) for name in ("softmax output", "attention dropout mask",
                                                                    "attention dropout output")]
        attention.append(hidden("attention proj input", sharded=True))
    else:
        if rope and comm != "a2a":
            attention.append(hidden("rotated q, k", (heads + groups) * d, sharded=True))
        attention += [Activation("softmax statistics", micro_batch * heads * s, 4, True),
                      hidden("attention output", size=4 if comm == "p2p" else e, sharded=True)]
        if comm is not None or not q_is_view:
            attention.append(hidden("attention proj input", sharded=True))
    f = config.ffn_hidden_size
    mlp = [hidden("mlp fc output", 2 * f if swiglu else f, sharded=True),
           *([hidden("silu(gate)", f, sharded=True)] if swiglu else []), hidden("mlp proj input", f, sharded=True)]
    masks = [hidden(f"{site} residual dropout mask", size=1) for site in ("attention", "mlp")] if config.dropout > 0 else []
    return [*norm("ln1"), *attention, *norm("ln2"), *mlp, *masks]


def _bytes(items: list[Activation], *, tp: int, sp: bool) -> float:
    return sum(a.bytes_per_rank(tp=tp, sp=sp) for a in items)


def _transient(config, *, tp: int, cp: int, seq_len: int, micro_batch: int, dtype: str, last: bool,
               loss_saved: float, mlp_saved: float) -> float:
    """The most a backward allocates at once above the saved activations, less what it has
    freed by then: the loss's logits gradient (fp32; under bf16 also the fp32 logits and the
    bf16 result) while everything is saved; one FFN-wide gradient in the last block's MLP, the
    loss's ``loss_saved`` (final norm, logits) freed; under CP the attention's own, the last
    block's ``mlp_saved`` (second norm, MLP) freed too: the ring's fp32 scores of one query
    tile of a (query chunk, key chunk) pair, three at a time, and its K/V buffers; Ulysses' all-to-all buffers."""
    e = 2 if dtype == "bf16" else 4
    sp = config.sequence_parallel and tp > 1
    tokens = local_tokens(seq_len, tp=tp, cp=cp, sp=sp) * micro_batch
    whole = tokens  # inside the TP region every TP rank holds every token
    kv = whole * 2 * config.num_query_groups * config.head_dim / tp
    freed = loss_saved if last else 0
    parts = [whole * config.ffn_hidden_size / tp * e - freed]
    if last:
        parts.append(whole * config.padded_vocab_size(tp) / tp * (4 if e == 4 else 10))
    if cp > 1 and config.context_parallel_comm == "p2p":
        from ..context_parallel.blockwise import query_rows  # torch: not for the command's --help

        chunk = whole // micro_batch // 2
        # Backward: the K/V in hand, the next ones arriving, their gradient (fp32), the one sent
        # before it and its arriving successor, and dQ (fp32).
        buffers = (5 * kv + whole * config.num_heads * config.head_dim / tp) * 4
        tile = query_rows(chunk, chunk) * chunk
        parts.append(3 * micro_batch * config.num_heads / tp * tile * 4 + buffers - freed - mlp_saved)
    elif cp > 1:
        parts.append(3 * (whole * config.num_heads * config.head_dim / tp + kv) * e - freed - mlp_saved)
    return max(0, *parts)


def _stage_parameters(config, *, tp: int, stage: StageShare, ep: int = 1) -> tuple[float, float]:
    """(parameters of one block, of the rest: the embedding on the first stage, the final norm
    and LM head on the last) one TP rank holds of ``stage``."""
    block, _ = _block_and_rest(config, tp=tp, ep=ep)
    h = config.hidden_size
    word = config.padded_vocab_size(tp) * h / tp
    norm = 2 * h if config.norm == "layernorm" and config.bias else h
    positions = config.max_seq_len * h if config.position_embedding == "learned" else 0
    first = word + positions if stage.first else 0
    last = norm + (0 if stage.tied_here else word) if stage.last else 0
    return block, first + last


def gpt_training_memory(config, *, tp: int, dp: int = 1, seq_len: int, micro_batch: int, dtype: str = "fp32",
                        fsdp: bool = False, reshard_after_forward: bool = True, min_unit_mib: float = MIN_UNIT_MIB,
                        cp: int = 1, stages: tuple[StageShare, ...] | None = None, ep: int = 1) -> dict[str, float]:
    """Bytes one rank holds to train a GPT ``config`` (fields as :class:`~tensorpar.models.GPTConfig`)
    with AdamW: ``parameters``, ``gradients``, ``optimizer``, ``activations``, ``gathered``,
    ``buffers`` and ``total``.

    ``stages``: what this rank holds of a pipeline (:class:`StageShare` each; the schedule's
    layout and micro-batches in flight come from :func:`tensorpar.pipeline_parallel.pipeline_memory`);
    default the whole model, one micro-batch at a time. Activations: per micro-batch in flight,
    each block's :func:`gpt_layer_activations` (with recompute only each block's input, plus one
    block recomputed in backward), the last stage's final norm and saved logits, the hidden state
    a stage hands on (torch keeps each output until its backward) less the one it received (its
    receive buffer, counted in ``buffers``); plus the largest transient of a backward
    (:func:`_transient`). ``ep``: each rank holds ``1 / ep`` of the experts (their activations are
    counted as the dense MLP's). ``cp``: context parallelism divides every per-token activation (the
    ranks hold ``2 x ceil(s / 2CP)`` tokens) and not the parameters; with ``fsdp`` parameters,
    gradients and optimizer state are divided over the ``dp x cp`` ranks, and ``gathered`` is
    what FSDP holds whole for a while within a step (its units as :func:`tensorpar.fully_shard`
    groups the blocks with ``min_unit_mib``): the root unit's parameters and gradients
    throughout, and the other units' parameters two at a time (the running one and the
    prefetched one), or every unit's from its forward to its backward without
    ``reshard_after_forward``, plus one unit's gradients before their reduce-scatter; under PP
    every stage's units stay gathered for the step and hold their unreduced gradients. An estimate
    made before anything is built; ``benchmarks/stage_memory.py`` measures it.

    Example::

        gpt_training_memory(GPTConfig.preset("small", vocab_size=50257), tp=2, seq_len=1024, micro_batch=8)
    """
    stages = stages or (StageShare(config.num_layers),)
    pipelined = len(stages) > 1 or not (stages[0].first and stages[0].last)
    layers = sum(stage.layers for stage in stages)
    block, rest_one = _block_and_rest(config, tp=tp, ep=ep)
    rest = sum(_stage_parameters(config, tp=tp, stage=stage, ep=ep)[1] for stage in stages) if pipelined else rest_one
    shards = dp * cp if fsdp else 1
    whole = layers * _expert_weights(config, ep=ep) if fsdp else 0  # FSDP leaves the experts to EP
    params = (layers * block + rest - whole) / shards + whole
    param_bytes = config.params_dtype.itemsize
    grad_bytes = 4 if config.gradient_accumulation_fusion else param_bytes  # fused: fp32 main_grad
    sp = config.sequence_parallel and tp > 1
    e = 2 if dtype == "bf16" else 4
    tokens = local_tokens(seq_len, tp=tp, cp=cp, sp=sp) * micro_batch / (tp if sp else 1)  # outside the TP region
    hidden_state = tokens * config.hidden_size * param_bytes  # between blocks: the residual stream's dtype
    every = gpt_layer_activations(config, tp=tp, cp=cp, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype)
    block_bytes = _bytes(every[:1] if config.recompute else every, tp=tp, sp=sp)
    logits = tokens * (tp if sp else 1) * config.padded_vocab_size(tp) / tp * e
    final_norm = (3 if config.norm == "rmsnorm" else 2) * tokens * config.hidden_size * e

    def per_microbatch(stage: StageShare) -> float:
        handed_on = 0 if stage.last else hidden_state
        received = 0 if stage.first else hidden_state
        return stage.layers * block_bytes + (final_norm + logits if stage.last else 0) + handed_on - received

    activations = sum(stage.in_flight * per_microbatch(stage) for stage in stages)
    mlp_saved = 0 if config.recompute else _bytes(every[[a.name for a in every].index("ln2 input"):], tp=tp, sp=sp)
    activations += max(_transient(config, tp=tp, cp=cp, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype,
                                  last=stage.last, loss_saved=final_norm + logits, mlp_saved=mlp_saved)
                       for stage in stages)
    if config.recompute:
        activations += _bytes(every, tp=tp, sp=sp)  # the block recomputed in backward
    buffers = sum(stage.microbatches * ((not stage.first) + (not stage.last)) for stage in stages) * hidden_state
    if fsdp and pipelined:
        gathered = (rest + layers * block) * (param_bytes + grad_bytes)
    elif fsdp:
        least = least_unit_bytes(config, min_unit_mib)
        groups, in_root = consecutive_groups([block * param_bytes] * layers, at_least=least)
        unit = len(groups[0]) * block if groups else 0  # the blocks are alike, so are the units
        root = rest + len(in_root) * block
        held = min(2, len(groups)) if reshard_after_forward else len(groups)
        gathered = (root + held * unit) * param_bytes + (root + unit) * grad_bytes
    else:
        gathered = 0
    memory = {"parameters": params * param_bytes, "gradients": params * grad_bytes,
              "optimizer": 2 * params * param_bytes, "activations": activations, "gathered": gathered,
              "buffers": buffers}
    memory["total"] = sum(memory.values())
    return memory
