"""Analytic communication model: every TP collective of a layer or a GPT training step.

Seed 002's arithmetic, generalised. For a layer kind and sizes, :func:`collectives` lists each
collective tensorpar issues, in issue order, with the phase it belongs to (``forward``,
``backward``, ``recompute`` for a checkpointed layer's re-run forward, ``grads`` for the
training loop's post-backward all-reduces), the full tensor's shape and bytes (as
:class:`tensorpar.CommRecord` counts them) and the bytes each rank sends under a ring
algorithm. :func:`summarize` adds time estimates from a link model and the FLOPs of the
step (:mod:`tensorpar.planning.memory` estimates the memory). :class:`LinkModel` is the
overlap cost model: the chunk count ``overlap="auto"`` picks.

Pure arithmetic, except :func:`calibrate_overlap`, which measures a link model on the TP group.

Example (seed 002: one column layer, H=4096, S=2048, B=1, bf16, TP=2)::

    cfg = CommConfig(layer="column", hidden=4096, seq_len=2048, batch=1, tp=2,
                     dtype="bf16", gather_output=True)
    [(op.phase, op.op, op.bytes) for op in collectives(cfg)]
    # [('forward', 'all_gather', 16777216), ('backward', 'all_reduce', 16777216)]
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from ..distributed.comm import bytes_sent_per_rank
from ..tensor_parallel.initialization import balanced_sizes
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.overlap import chunk_sizes, measure_link
from ..parallel_state import default_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LAYERS = ("column", "row", "mlp", "attention", "embedding", "loss", "gpt-layer", "gpt-step")
PHASES = ("forward", "recompute", "backward", "grads")
# ``CommOp.what`` of SP's extra all-gather: the column layer saved only its input shard.
WGRAD_REGATHER = "input re-gather for wgrad"

CHUNK_CHOICES = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """What ``overlap="auto"`` decides with: a collective costs ``latency_s`` plus the bytes a
    rank sends over ``bytes_per_s``; a GEMM runs at ``flops_per_s``; ``overlap`` is the share
    of the shorter of a GEMM and a concurrent collective that is actually hidden (near 1 where
    communication has its own engine, as NCCL on a GPU; lower where it takes CPU time from the
    GEMM, as gloo on a busy CPU)."""

    latency_s: float
    bytes_per_s: float
    flops_per_s: float
    overlap: float

    def pipeline_time(self, flops: float, bytes_sent: float, chunks: int) -> float:
        """Seconds for a GEMM of ``flops`` and its collective sending ``bytes_sent``, in ``chunks``."""
        gemm = flops / self.flops_per_s / chunks
        link = self.latency_s + bytes_sent / chunks / self.bytes_per_s
        return gemm + link + (chunks - 1) * (gemm + link - self.overlap * min(gemm, link))

    def exposed_comm_time(self, flops: float, bytes_sent: float, chunks: int) -> float:
        """The part of :meth:`pipeline_time` the GEMM alone would not take."""
        return self.pipeline_time(flops, bytes_sent, chunks) - flops / self.flops_per_s

    def best_chunks(self, flops: float, bytes_sent: float, rows: int) -> int:
        """The chunk count (of :data:`CHUNK_CHOICES`, at most ``rows``) with the shortest pipeline;
        the fewest chunks among equals."""
        options = [k for k in CHUNK_CHOICES if k <= max(rows, 1)]
        return min(options, key=lambda k: (self.pipeline_time(flops, bytes_sent, k), k))


MAX_LAYERS = 10_000


@dataclasses.dataclass(frozen=True)
class CommConfig:
    """Sizes and modes of what is modelled; validated on construction.

    ``column`` and ``row`` alone map ``hidden -> hidden`` (so seed 002's example is
    ``--hidden 4096``), split as evenly as possible where TP does not divide it; the MLP is
    ``hidden -> ffn_hidden -> hidden`` (``ffn_hidden`` defaults to ``4 * hidden``).
    ``vocab`` is the (padded) vocabulary of the embedding, loss and LM head.
    """

    layer: str
    hidden: int = 4096
    ffn_hidden: int | None = None
    heads: int = 32
    kv_heads: int | None = None
    seq_len: int = 2048
    batch: int = 1
    vocab: int = 50304
    layers: int = 24
    tp: int = 2
    dtype: str = "bf16"
    sp: bool = False
    recompute: bool = False
    gather_output: bool = False
    input_is_parallel: bool = True
    overlap_chunks: int | str = 1

    def __post_init__(self) -> None:
        if self.ffn_hidden is None and isinstance(self.hidden, int):
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.layer not in LAYERS:
            raise ValueError(f"unknown layer kind {self.layer!r}; choose one of {', '.join(LAYERS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        for name in ("hidden", "ffn_hidden", "heads", "kv_heads", "seq_len", "batch", "vocab", "layers", "tp",
                     *(("overlap_chunks",) if self.overlap_chunks != "auto" else ())):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.layers > MAX_LAYERS:  # the step lists every layer's collectives
            raise ValueError(f"layers must be at most {MAX_LAYERS:,} (far more than any model has), got {self.layers:,}")
        for name, divisor, what in self._divisibility():
            value = getattr(self, name)
            if value % divisor != 0:
                raise ValueError(f"{name} ({value}) is not divisible by {what} ({divisor})")
        if self.gather_output and (self.layer != "column" or self.sp):
            raise ValueError("gather_output applies to --layer column without sequence parallelism")
        if not self.input_is_parallel and (self.layer != "row" or self.sp):
            raise ValueError("input_is_parallel=False applies to --layer row without sequence parallelism")
        if self.recompute and self.layer in ("embedding", "loss"):
            raise ValueError(f"recompute does not apply to --layer {self.layer}")

    def _divisibility(self) -> list[tuple[str, int, str]]:
        """(size, divisor, divisor's name) the layer kind needs. The linear layers and the GPT's
        pieces split hidden, heads, FFN and vocab unevenly; a lone layer's sequence splits evenly
        under SP (the GPT pads it)."""
        tp = "the tensor-parallel size"
        attention = [("hidden", self.heads, "heads"), ("heads", self.kv_heads, "kv_heads")]
        vocab = [("vocab", self.tp, tp)]
        needs = {"attention": attention, "gpt-layer": attention, "gpt-step": attention, "embedding": vocab,
                 "loss": vocab}.get(self.layer, [])
        return needs + ([("seq_len", self.tp, tp)] if self.sp and self.layer != "gpt-step" else [])

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()


@dataclasses.dataclass(frozen=True)
class CommOp:
    """One predicted collective; ``bytes`` is the full tensor's size, like ``CommRecord``."""

    layer: str
    phase: str
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tp: int
    what: str
    reduce_op: str | None = None

    @property
    def bytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def group_size(self) -> int:
        """The ranks of the group it runs over (TP's; see :class:`GroupOp`)."""
        return self.tp

    @property
    def bytes_sent_per_rank(self) -> float:
        return bytes_sent_per_rank(self.op, self.bytes, self.group_size)

    def time_s(self, *, bandwidth_gbps: float, latency_us: float) -> float:
        """Ring estimate: one latency plus the bytes this rank sends over the link."""
        return latency_us * 1e-6 + self.bytes_sent_per_rank / (bandwidth_gbps * 1e9)


@dataclasses.dataclass(frozen=True)
class GroupOp(CommOp):
    """A collective over a group other than TP: ``group`` names it (``cp``, ``dp x cp``, ``pp``,
    ``embedding``), ``size`` is its ranks (``tp`` stays the step's TP size)."""

    group: str = "tp"
    size: int = 1

    @property
    def group_size(self) -> int:
        return self.size


@dataclasses.dataclass(frozen=True)
class _Comm:
    """The collectives of one piece: forward ops, and backward ops in the order issued."""

    forward: tuple[CommOp, ...] = ()
    backward: tuple[CommOp, ...] = ()


def _chain(*parts: _Comm) -> _Comm:
    """Pieces applied one after another: backward runs them in reverse."""
    return _Comm(forward=tuple(op for p in parts for op in p.forward),
                 backward=tuple(op for p in reversed(parts) for op in p.backward))


def _checkpointed(part: _Comm) -> _Comm:
    """Activation recompute: the forward's collectives run again just before the backward."""
    again = tuple(dataclasses.replace(op, phase="recompute") for op in part.forward)
    return _Comm(forward=part.forward, backward=again + part.backward)


class _Builder:
    """Makes the ops of each TP layer for one config; methods mirror tensorpar's layers."""

    def __init__(self, cfg: CommConfig, link: LinkModel | None) -> None:
        self.cfg, self.link = cfg, link
        # The GPT pads a sequence SP does not split evenly (a lone layer's must split evenly).
        self.s, self.b = cfg.seq_len + (-cfg.seq_len % cfg.tp if cfg.sp else 0), cfg.batch
        self.plan: list[dict] = []  # per chunkable collective: the chunks and predicted exposed time

    def op(self, layer, phase, op, shape, what, *, dtype=None, reduce_op="sum") -> CommOp:
        return CommOp(layer, phase, op, tuple(shape), dtype or self.cfg.torch_dtype, self.cfg.tp, what,
                      None if op == "all_gather" else reduce_op)

    def chunked(self, layer, phase, op, width, what, in_, out) -> tuple[CommOp, ...]:
        """A ``[s, b, width]`` collective against the ``in_ -> out`` layer's GEMM, split along the
        sequence as ``tensorpar.tensor_parallel.overlap`` splits it: an all-reduce's rows, or each rank's
        sequence slice under SP; ``overlap_chunks="auto"`` chooses as the layers do."""
        k, n = self.cfg.overlap_chunks, self.cfg.tp
        whole = self.op(layer, phase, op, (self.s, self.b, width), what)
        available = self.s if op == "all_reduce" else self.s // n
        if self.link is not None:
            flops = 2 * self.s * self.b * in_ * out / n
            k = min(self.link.best_chunks(flops, whole.bytes_sent_per_rank, available) if k == "auto" else k,
                    max(available, 1))
            self.plan.append(dict(layer=layer, phase=phase, op=op, chunks=k,
                                  exposed_s=self.link.exposed_comm_time(flops, whole.bytes_sent_per_rank, k),
                                  unchunked_exposed_s=self.link.exposed_comm_time(flops, whole.bytes_sent_per_rank, 1)))
        if k == 1:
            return (whole,)
        rows = chunk_sizes(self.s, k) if op == "all_reduce" else [n * c for c in chunk_sizes(available, k)]
        return tuple(self.op(layer, phase, op, (r, self.b, width), f"{what} (chunk {i + 1}/{len(rows)})")
                     for i, r in enumerate(rows))

    def column(self, name: str, in_: int, out: int) -> _Comm:
        """Input replicated: dgrad all-reduce. SP: gather the input forward, and in backward
        re-gather it for wgrad (only the shard was saved) before reduce-scattering dgrad.
        With overlap chunks, the input gather and the dgrad reduction are chunked."""
        x = (self.s, self.b, in_)
        if self.cfg.sp:
            return _Comm(forward=self.chunked(name, "forward", "all_gather", in_, "sequence gather of input", in_, out),
                         backward=(self.op(name, "backward", "all_gather", x, WGRAD_REGATHER),
                                   *self.chunked(name, "backward", "reduce_scatter", in_, "dgrad", in_, out)))
        forward = ()
        if self.cfg.gather_output:
            forward = (self.op(name, "forward", "all_gather", (self.s, self.b, _gathered(out, self.cfg.tp)),
                               "output gather"),)
        return _Comm(forward=forward, backward=self.chunked(name, "backward", "all_reduce", in_, "dgrad", in_, out))

    def row(self, name: str, in_: int, out: int, *, input_is_parallel: bool = True) -> _Comm:
        """Exit all-reduce (SP: reduce-scatter, whose backward all-gathers the output grad);
        an unsplit input is scattered, so its grad is all-gathered on the last dim.
        With overlap chunks, the exit and the output-grad gather are chunked."""
        if self.cfg.sp:
            exit_ = _Comm(forward=self.chunked(name, "forward", "reduce_scatter", out, "exit", in_, out),
                          backward=self.chunked(name, "backward", "all_gather", out, "output-grad gather", in_, out))
        else:
            exit_ = _Comm(forward=self.chunked(name, "forward", "all_reduce", out, "exit", in_, out))
        if input_is_parallel:
            return exit_
        gathered = (self.s, self.b, _gathered(in_, self.cfg.tp))
        scatter = _Comm(backward=(self.op(name, "backward", "all_gather", gathered, "input-grad gather"),))
        return _chain(scatter, exit_)

    def mlp(self, prefix: str) -> _Comm:
        h, f = self.cfg.hidden, self.cfg.ffn_hidden
        return _chain(self.column(f"{prefix}fc", h, f), self.row(f"{prefix}proj", f, h))

    def attention(self, prefix: str) -> _Comm:
        # Core attention runs on this rank's heads: no communication between the two linears.
        # Grouped-query attention: the QKV weight has the query heads and 2 x kv_heads more.
        h, d, kv = self.cfg.hidden, self.cfg.hidden // self.cfg.heads, self.cfg.kv_heads
        qkv = self.column(f"{prefix}qkv", h, h + 2 * kv * d)
        rows = 2 * d * _shared_kv_heads(self.cfg.heads, kv, self.cfg.tp)
        if rows:
            # K/V heads read by several ranks' queries are replicated on each: after the QKV
            # layer's backward, its bias grad (the GPT's QKV has one) and weight grad are summed
            # over the ranks, one all-reduce of every shared row each.
            name = f"{prefix}qkv"
            qkv = _chain(_Comm(backward=(self.op(name, "backward", "all_reduce", (rows,), "replicated K/V bias grad"),
                                         self.op(name, "backward", "all_reduce", (rows, h),
                                                 "replicated K/V weight grad"))), qkv)
        return _chain(qkv, self.row(f"{prefix}proj", h, h))

    def embedding(self, name: str) -> _Comm:
        """Partial lookups summed over TP: all-reduce of ``[b, s, h]``; under SP a
        reduce-scatter of the transposed ``[s, b, h]``, whose backward all-gathers."""
        h = self.cfg.hidden
        if self.cfg.sp:
            y = (self.s, self.b, h)
            return _Comm(forward=(self.op(name, "forward", "reduce_scatter", y, "exit"),),
                         backward=(self.op(name, "backward", "all_gather", y, "output-grad gather"),))
        return _Comm(forward=(self.op(name, "forward", "all_reduce", (self.b, self.s, h), "exit"),))

    def loss(self, name: str, tokens: tuple[int, ...]) -> _Comm:
        """Vocab-parallel cross-entropy over a ``tokens``-shaped target: an fp32 max, then the
        sum-exp and target logit stacked into one fp32 sum; backward is local."""
        fp32 = torch.float32
        return _Comm(forward=(
            self.op(name, "forward", "all_reduce", tokens, "max logit", dtype=fp32, reduce_op="max"),
            self.op(name, "forward", "all_reduce", (2, *tokens), "sum exp + target logit", dtype=fp32)))

    def gpt_layer(self, prefix: str) -> _Comm:
        # LayerNorm, dropout and the residual adds communicate nothing (local tokens under SP).
        return _chain(self.attention(f"{prefix}attention."), self.mlp(f"{prefix}mlp."))

    def gpt_step(self) -> tuple[_Comm, tuple[CommOp, ...]]:
        """tensorpar's GPT: embedding, blocks, final norm, tied LM head (a column layer over the
        vocab), loss on the ``[s, b]`` labels; then what ``tensorpar train`` does after backward
        (under SP the SP-parameter grad all-reduce, then the grad-norm all-reduce)."""
        h = self.cfg.hidden
        blocks = [self.gpt_layer(f"blocks.{i}.") for i in range(self.cfg.layers)]
        if self.cfg.recompute:  # each block is checkpointed; the head and loss are not
            blocks = [_checkpointed(block) for block in blocks]
        step = _chain(self.embedding("embedding.word"), *blocks, self.column("lm_head", h, self.cfg.vocab),
                      self.loss("loss", (self.s, self.b)))
        grads = ()
        if self.cfg.sp:
            # One flat all-reduce per grad dtype (parameters are in --dtype) of everything marked
            # sequence_parallel: per block both LayerNorms' weight and bias and both row biases,
            # the final LayerNorm, and the learned position table (each rank adds its own
            # tokens' positions; the table is taken to be --seq-len long).
            numel = self.cfg.layers * 6 * h + 2 * h + self.cfg.seq_len * h
            grads = (self.op("sp_grads", "grads", "all_reduce", (numel,), "sequence-parallel param grads"),)
        # The training loop's gradient norm (for clipping and logging): squares summed over TP.
        grads += (self.op("grad_norm", "grads", "all_reduce", (), "grad norm", dtype=torch.float32),)
        return step, grads


def _gathered(width: int, tp: int) -> int:
    """The last dim of an all-gather of ``width`` split over ``tp`` ranks as evenly as possible:
    unequal shards travel padded to the largest."""
    return tp * -(-width // tp)


def _shared_kv_heads(heads: int, kv_heads: int, tp: int) -> int:
    """How many K/V heads the query heads of more than one rank read, as the GPT splits them:
    query heads in contiguous runs as even as possible (none when TP divides both counts)."""
    if heads % tp == 0 and kv_heads % tp == 0:
        return 0
    per_group, readers, first = heads // kv_heads, [0] * kv_heads, 0
    for size in balanced_sizes(heads, tp):
        for group in range(first // per_group, (first + size - 1) // per_group + 1) if size else ():
            readers[group] += 1
        first += size
    return sum(r > 1 for r in readers)


def collectives(cfg: CommConfig, *, link: LinkModel | None = None) -> list[CommOp]:
    """Every collective of ``cfg.layer``'s forward and backward, in the order issued.

    ``link`` decides ``overlap_chunks="auto"`` (as the layers' calibrated model does).

    Example::

        ops = collectives(CommConfig(layer="mlp", hidden=1024, tp=4))
        [op.op for op in ops]      # ['all_reduce', 'all_reduce']: exit forward, dgrad backward
    """
    return _build(cfg, link)[0]


def overlap_plan(cfg: CommConfig, link: LinkModel) -> list[dict]:
    """Per collective that the layers can chunk against a GEMM: its layer, phase and op, the
    chunks used (``cfg.overlap_chunks``, or what ``"auto"`` picks on ``link``), and the exposed
    communication predicted with them and unchunked (seconds beyond the GEMM's own time)."""
    return _build(cfg, link)[1]


def _build(cfg: CommConfig, link: LinkModel | None) -> tuple[list[CommOp], list[dict]]:
    if cfg.overlap_chunks == "auto" and link is None:
        raise ValueError("overlap_chunks='auto' needs a link model to decide with")
    if cfg.tp == 1:
        return [], []
    build = _Builder(cfg, link)
    grads: tuple[CommOp, ...] = ()
    h = cfg.hidden
    if cfg.layer == "gpt-step":
        comm, grads = build.gpt_step()
    else:
        comm = {
            "column": lambda: build.column("column", h, h),
            "row": lambda: build.row("row", h, h, input_is_parallel=cfg.input_is_parallel),
            "mlp": lambda: build.mlp("mlp."),
            "attention": lambda: build.attention("attention."),
            "embedding": lambda: build.embedding("embedding"),
            "loss": lambda: build.loss("loss", (cfg.seq_len, cfg.batch)),
            "gpt-layer": lambda: build.gpt_layer(""),
        }[cfg.layer]()
        if cfg.recompute:
            comm = _checkpointed(comm)
    return [*comm.forward, *comm.backward, *grads], build.plan


def forward_flops_per_rank(cfg: CommConfig) -> float:
    """Matmul FLOPs of one forward pass on one rank (elementwise work is ignored).

    Causal masking is not subtracted from attention's ``QK^T`` and ``AV``, as is customary.
    """
    tokens, h, f, n = cfg.seq_len * cfg.batch, cfg.hidden, cfg.ffn_hidden, cfg.tp
    mlp = 2 * tokens * 2 * h * f / n
    qkv = h + 2 * cfg.kv_heads * (h // cfg.heads)  # grouped-query attention: fewer K/V heads
    attention = 2 * tokens * (qkv * h + h * h) / n + 2 * 2 * cfg.batch * cfg.seq_len ** 2 * h / n
    return {"column": 2 * tokens * h * h / n, "row": 2 * tokens * h * h / n, "mlp": mlp, "attention": attention,
            "embedding": 0.0, "loss": 0.0, "gpt-layer": attention + mlp,
            "gpt-step": cfg.layers * (attention + mlp) + 2 * tokens * h * cfg.vocab / n}[cfg.layer]


def step_flops_per_rank(cfg: CommConfig) -> float:
    """Forward + backward (dgrad and wgrad, each as costly as the forward), plus the
    recomputed forward of checkpointed layers."""
    forward = forward_flops_per_rank(cfg)
    if cfg.recompute:
        recomputed = forward
        if cfg.layer == "gpt-step":  # the LM head is not checkpointed
            recomputed -= 2 * cfg.seq_len * cfg.batch * cfg.hidden * cfg.vocab / cfg.tp
        return 3 * forward + recomputed
    return 3 * forward


def summarize(cfg: CommConfig, ops: list[CommOp], *, bandwidth_gbps: float, latency_us: float,
              tflops: float) -> dict:
    """Totals of ``ops`` (overall and per phase), the estimated time, and its share of compute.

    ``comm_share_of_compute`` is communication time over the step's matmul time at ``tflops``
    per rank, counting every collective as exposed (none hidden behind compute): an upper
    bound. It is None when the layer does no matmul (embedding, loss).
    """
    link = {"bandwidth_gbps": bandwidth_gbps, "latency_us": latency_us}

    def total(selected):
        return {"count": len(selected), "bytes": sum(op.bytes for op in selected),
                "bytes_sent_per_rank": sum(op.bytes_sent_per_rank for op in selected),
                "time_s": sum(op.time_s(**link) for op in selected)}

    totals = total(ops)
    totals["by_phase"] = {phase: total([op for op in ops if op.phase == phase])
                          for phase in PHASES if any(op.phase == phase for op in ops)}
    flops = step_flops_per_rank(cfg)
    compute_s = flops / (tflops * 1e12)
    totals.update(flops_per_rank=flops, compute_time_s=compute_s,
                  comm_share_of_compute=totals["time_s"] / compute_s if flops else None)
    return totals


def calibrate_overlap(model: torch.nn.Module, *, tokens: int) -> list[LinkModel]:
    """Measure the link model of every ``overlap="auto"`` TP linear in ``model``: collective.

    Call it on every rank after building the model, before its first forward (such a layer at
    TP > 1 refuses to run without it). ``tokens``: a forward's GEMM rows (sequence x micro-batch).
    Layers sharing a TP group, device and compute dtype (autocast's, under autocast) share one
    measurement with the largest one's shapes, and pick their chunk count per forward from it.
    Shapes are the largest rank's shard (``largest_weight_shape``), never this rank's: in an
    uneven layout every rank still measures, and so decides, alike.
    A ``CommLedger`` sees its collectives. Returns the link models measured.

    Example::

        model = models.GPT(config)                       # config.overlap == "auto"
        tp.calibrate_overlap(model, tokens=seq_len * micro_batch)
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"calibrate_overlap: tokens must be a positive int, got {tokens!r}")
    by_key: dict[tuple, list] = {}
    for layer in model.modules():
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) and layer.overlap == "auto" \
                and layer.tp_size > 1:
            weight = layer.weight if layer.weight is not None else torch.empty(0, device=default_device())
            autocast = torch.is_autocast_enabled(weight.device.type)
            dtype = torch.get_autocast_dtype(weight.device.type) if autocast else weight.dtype
            key = (tuple(dist.get_process_group_ranks(layer.tp_group)), weight.device, dtype)
            by_key.setdefault(key, []).append(layer)
    links = []
    for (_, device, dtype), layers in by_key.items():
        largest = max(layers, key=lambda layer: math.prod(layer.largest_weight_shape))
        out_features, in_features = largest.largest_weight_shape
        # The collective a layer chunks: its input's width (column), its output's (row).
        width = largest.input_size if isinstance(largest, ColumnParallelLinear) else largest.output_size
        link = LinkModel(**measure_link(largest.tp_group, device=device, dtype=dtype, rows=tokens,
                                        gemm=(in_features, out_features), comm_elements=tokens * width))
        for layer in layers:
            layer.overlap_link = link
        links.append(link)
    return links
