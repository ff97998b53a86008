"""A GPT built only from tensorpar layers, readable top to bottom.

One block, at TP ranks with heads and MLP columns split across them::

    x ──LN──f──[QKV column, heads/TP]──causal attention──[proj row]──g──dropout──(+x)
      ──LN──f──[fc column, ffn/TP]──GELU──[proj row]──g──dropout──(+x)

``f`` (identity forward, all-reduce backward) and ``g`` (all-reduce forward, identity backward)
are the paper's conjugate operators. With sequence parallelism the activations between the
blocks are ``[s/TP, b, h]``: ``f`` becomes an all-gather of the sequence and ``g`` a
reduce-scatter, and LayerNorm, dropout and the residual adds run on each rank's tokens only.

Collectives of one block at TP > 1 (the ``CommLedger`` test asserts them):

* no SP: forward 2 all-reduces of ``[s, b, h]`` (the two ``g``); backward 2 all-reduces of
  ``[s, b, h]`` (the two ``f``: the input grads of the QKV and fc columns).
* SP: forward all-gather, reduce-scatter, all-gather, reduce-scatter (``[s, b, h]`` each: QKV
  input, attention output, fc input, MLP output); backward, in order, for the MLP then the
  attention: all-gather of the row output's grad, all-gather of the column's input again for
  its wgrad, reduce-scatter of the column's input grad. 4 all-gathers + 2 reduce-scatters.

The whole model adds the embedding (forward all-reduce, or reduce-scatter under SP) and the
LM head (backward all-reduce of its input grad, or all-gather forward + all-gather and
reduce-scatter backward under SP) and the cross-entropy's two all-reduces.

Seed every rank alike before building (``tp.model_parallel_manual_seed(seed)``): weights are
TP-invariant, so the model at any TP size is the TP=1 model, sharded.

Example::

    tp.initialize_model_parallel(2)
    tp.model_parallel_manual_seed(1234)
    model = GPT(GPTConfig.preset("tiny", vocab_size=256))
    loss = model(tokens, labels)           # tokens, labels: [b, s]; same loss on every TP rank
    loss.backward()
    tp.allreduce_sequence_parallel_grads(model)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..cross_entropy import vocab_parallel_cross_entropy
from ..embedding import VocabParallelEmbedding
from ..initialization import (
    init_method_normal,
    init_weight_shard,
    scaled_init_method_normal,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
)
from ..linear import ColumnParallelLinear, RowParallelLinear
from ..mappings import gather_from_tensor_model_parallel_region
from ..parallel_state import default_device, resolve_tp_group
from ..random import checkpoint, dropout, get_rng_tracker
from . import layout

_CHOICES = {"norm": ("layernorm", "rmsnorm"), "activation": ("gelu", "gelu_tanh", "swiglu"),
            "position_embedding": ("learned", "rope")}

_PRESETS = {
    "tiny": dict(vocab_size=256, max_seq_len=256, num_layers=4, num_heads=4, hidden_size=128),
    "small": dict(vocab_size=50257, max_seq_len=1024, num_layers=12, num_heads=12, hidden_size=768),
    "medium": dict(vocab_size=50257, max_seq_len=1024, num_layers=24, num_heads=16, hidden_size=1024),
    "large": dict(vocab_size=50257, max_seq_len=1024, num_layers=36, num_heads=20, hidden_size=1280),
    "xl": dict(vocab_size=50257, max_seq_len=1024, num_layers=48, num_heads=25, hidden_size=1600),
    "llama-tiny": dict(vocab_size=256, max_seq_len=256, num_layers=4, num_heads=4, hidden_size=128,
                       norm="rmsnorm", activation="swiglu", position_embedding="rope", bias=False,
                       tie_word_embeddings=False),
}


@dataclasses.dataclass
class GPTConfig:
    """Shape and options of a :class:`GPT`.

    ``ffn_hidden_size`` defaults to ``4 * hidden_size`` (for SwiGLU too: the fused gate/up
    layer is then ``2 * ffn_hidden_size`` wide). ``attention_dropout`` defaults to ``dropout``.
    ``make_vocab_size_divisible_by``: see :meth:`padded_vocab_size`. ``gelu_tanh`` is GPT-2's
    ``gelu_new``. ``distribute_saved_activations`` (recompute without SP only) keeps 1/TP of
    each block's saved input. ``overlap`` (``"off"`` or a number of chunks) is every TP
    linear's: its collectives chunked against its GEMMs (:mod:`tensorpar.overlap`).

    Example::

        GPTConfig(vocab_size=50257, max_seq_len=1024, num_layers=12, num_heads=12, hidden_size=768)
        GPTConfig.preset("small", sequence_parallel=True)
    """

    vocab_size: int
    max_seq_len: int
    num_layers: int
    num_heads: int
    hidden_size: int
    ffn_hidden_size: int | None = None
    dropout: float = 0.0
    attention_dropout: float | None = None
    sequence_parallel: bool = False
    recompute: bool = False
    distribute_saved_activations: bool = False
    make_vocab_size_divisible_by: int = 128
    norm: str = "layernorm"
    activation: str = "gelu"
    position_embedding: str = "learned"
    rope_theta: float = 10000.0
    bias: bool = True
    tie_word_embeddings: bool = True
    layernorm_epsilon: float = 1e-5
    init_std: float = 0.02
    gradient_accumulation_fusion: bool = False
    params_dtype: torch.dtype = torch.float32
    overlap: int | str = "off"

    PRESETS = tuple(_PRESETS)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "num_layers", "num_heads", "hidden_size",
                     "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads})")
        if self.position_embedding == "rope" and self.head_dim % 2 != 0:
            raise ValueError(f"rotary positions need an even head dimension, got {self.head_dim}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.attention_dropout is None:
            self.attention_dropout = self.dropout
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"GPTConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.distribute_saved_activations and (self.sequence_parallel or not self.recompute):
            raise ValueError("distribute_saved_activations needs recompute=True and sequence_parallel=False "
                             "(under SP the saved block inputs are already split over TP)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def padded_vocab_size(self, tp_size: int) -> int:
        """``vocab_size`` rounded up to a multiple of lcm(make_vocab_size_divisible_by, TP).

        The same for every TP size dividing ``make_vocab_size_divisible_by``, so checkpoints
        move between such TP sizes unchanged.
        """
        multiple = math.lcm(self.make_vocab_size_divisible_by, tp_size)
        return -(-self.vocab_size // multiple) * multiple

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """A named size: ``tiny``, ``llama-tiny`` (byte vocab), ``small``/``medium``/``large``/``xl``
        (GPT-2's 124M/350M/774M/1.5B shapes)."""
        if name not in _PRESETS:
            raise ValueError(f"unknown GPTConfig preset {name!r}; choose from {list(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})


def _norm(config: GPTConfig, device, sequence_parallel: bool) -> nn.Module:
    kwargs = dict(eps=config.layernorm_epsilon, device=device, dtype=config.params_dtype)
    if config.norm == "rmsnorm":
        norm = nn.RMSNorm(config.hidden_size, **kwargs)
    else:
        norm = nn.LayerNorm(config.hidden_size, bias=config.bias, **kwargs)
    # Under SP each rank normalises its own tokens: the weight grads are partial sums over TP.
    for param in norm.parameters():
        param.sequence_parallel = sequence_parallel
    return norm


def rotary_tables(seq_len: int, head_dim: int, theta: float, *, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of the rotary angles, ``[seq_len, head_dim]`` each."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[..., s, head_dim]``) by position, pairing dim ``i`` with ``i + head_dim/2``."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class _Parallel:
    """What every submodule needs to know about its TP placement."""

    def __init__(self, config: GPTConfig, tp_group, device) -> None:
        self.group = tp_group
        self.size = comm.group_size(tp_group)
        self.rank = comm.group_rank(tp_group)
        # One rank has no sequence to split.
        self.sequence_parallel = config.sequence_parallel and self.size > 1
        self.device = device

    def linear_kwargs(self, config: GPTConfig) -> dict:
        return dict(sequence_parallel=self.sequence_parallel,
                    gradient_accumulation_fusion=config.gradient_accumulation_fusion,
                    params_dtype=config.params_dtype, device=self.device, tp_group=self.group,
                    overlap=config.overlap)


class Embedding(nn.Module):
    """Token embedding (vocab-parallel) plus learned positions, then dropout.

    Output ``[s, b, h]``, or ``[s/TP, b, h]`` (this rank's tokens) under SP.
    """

    def __init__(self, config: GPTConfig, parallel: _Parallel) -> None:
        super().__init__()
        self.config, self.parallel = config, parallel
        init = init_method_normal(config.init_std)
        self.word = VocabParallelEmbedding(
            config.padded_vocab_size(parallel.size), config.hidden_size, init_method=init,
            reduce_scatter_embeddings=parallel.sequence_parallel, params_dtype=config.params_dtype,
            device=parallel.device, tp_group=parallel.group)
        if config.position_embedding == "learned":
            self.position = nn.Parameter(torch.empty(config.max_seq_len, config.hidden_size,
                                                     dtype=config.params_dtype, device=parallel.device))
            init_weight_shard(self.position, init, partition_dim=0)
            # Under SP a rank adds the positions of its own tokens only: a partial grad.
            self.position.sequence_parallel = parallel.sequence_parallel
        else:
            self.register_parameter("position", None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_len = tokens.shape[1]
        # g inside: all-reduce of the partial lookups, or reduce-scatter to [s/TP, b, h] under SP.
        x = self.word(tokens)
        if not self.parallel.sequence_parallel:
            x = x.transpose(0, 1).contiguous()
        if self.position is not None:
            positions = self.position[:seq_len]
            if self.parallel.sequence_parallel:
                positions = positions.chunk(self.parallel.size, dim=0)[self.parallel.rank]
            x = x + positions.unsqueeze(1)
        return dropout(x, self.config.dropout, training=self.training,
                       sequence_parallel=self.parallel.sequence_parallel, tp_group=self.parallel.group)


class Attention(nn.Module):
    """Causal self-attention with this rank's ``num_heads / TP`` heads."""

    def __init__(self, config: GPTConfig, parallel: _Parallel) -> None:
        super().__init__()
        self.config = config
        self.local_heads = config.num_heads // parallel.size
        h = config.hidden_size
        # stride=3: the full weight is Q|K|V and each rank holds its heads' rows of all three.
        self.qkv = ColumnParallelLinear(h, 3 * h, bias=config.bias, stride=3,
                                        init_method=init_method_normal(config.init_std),
                                        **parallel.linear_kwargs(config))
        self.proj = RowParallelLinear(h, h, bias=config.bias, input_is_parallel=True,
                                      init_method=scaled_init_method_normal(config.init_std, config.num_layers),
                                      **parallel.linear_kwargs(config))

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        # f (or the SP all-gather) happens inside the column layer.
        qkv, _ = self.qkv(x)                                        # [s, b, 3h/TP]
        s, b = qkv.shape[:2]
        q, k, v = (t.reshape(s, b, self.local_heads, self.config.head_dim).permute(1, 2, 0, 3)
                   for t in qkv.chunk(3, dim=-1))                   # [b, heads/TP, s, d]
        if cos is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        p = self.config.attention_dropout if self.training else 0.0
        # The probabilities of different heads live on different ranks: their dropout masks
        # must be independent, so they come from the per-rank model-parallel stream.
        with get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)             # [s, b, h/TP]
        # g (or the SP reduce-scatter) happens inside the row layer.
        return self.proj(out)[0]


class MLP(nn.Module):
    """``fc`` column (``ffn/TP`` of the hidden units here), activation, ``proj`` row."""

    def __init__(self, config: GPTConfig, parallel: _Parallel) -> None:
        super().__init__()
        self.swiglu = config.activation == "swiglu"
        self.activation = config.activation
        width = 2 * config.ffn_hidden_size if self.swiglu else config.ffn_hidden_size
        # stride=2 for SwiGLU: the full weight is gate|up, each split across ranks.
        self.fc = ColumnParallelLinear(config.hidden_size, width, bias=config.bias, stride=2 if self.swiglu else 1,
                                       init_method=init_method_normal(config.init_std),
                                       **parallel.linear_kwargs(config))
        self.proj = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, bias=config.bias,
                                      input_is_parallel=True,
                                      init_method=scaled_init_method_normal(config.init_std, config.num_layers),
                                      **parallel.linear_kwargs(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.fc(x)                                      # f inside; [s, b, ffn/TP]
        if self.swiglu:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(hidden, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.proj(hidden)[0]                                 # g inside


class Block(nn.Module):
    """Pre-norm transformer block: ``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``."""

    def __init__(self, config: GPTConfig, parallel: _Parallel) -> None:
        super().__init__()
        self.config, self.parallel = config, parallel
        self.norm1 = _norm(config, parallel.device, parallel.sequence_parallel)
        self.attention = Attention(config, parallel)
        self.norm2 = _norm(config, parallel.device, parallel.sequence_parallel)
        self.mlp = MLP(config, parallel)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        # x is replicated (or SP-split): the TP-size-independent default-stream mask.
        return dropout(x, self.config.dropout, training=self.training,
                       sequence_parallel=self.parallel.sequence_parallel, tp_group=self.parallel.group)

    def forward(self, x, cos=None, sin=None):
        x = x + self._dropout(self.attention(self.norm1(x), cos, sin))
        return x + self._dropout(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    """Decoder-only transformer, tensor-parallel over ``tp_group`` (default: the TP group).

    ``model(tokens, labels)`` (``[b, s]`` each, ``-100`` = ignore) returns the mean loss over
    the labelled tokens, identical on every TP rank; ``model(tokens)`` returns this rank's
    vocab slice of the logits, ``[b, s, padded_vocab / TP]`` (columns ``>= vocab_size`` are
    padding). Call ``tp.allreduce_sequence_parallel_grads(model)`` after backward under SP.

    Example::

        model = GPT(GPTConfig.preset("tiny", sequence_parallel=True))
        model(tokens, labels).backward()
    """

    def __init__(self, config: GPTConfig, *, tp_group=None, device=None) -> None:
        super().__init__()
        self.config = config
        self.tp_group = resolve_tp_group(tp_group)
        parallel = _Parallel(config, self.tp_group, torch.device(device) if device is not None else default_device())
        self.parallel = parallel
        if config.num_heads % parallel.size != 0:
            raise ValueError(f"num_heads ({config.num_heads}) is not divisible by the tensor-parallel size "
                             f"({parallel.size})")
        if config.ffn_hidden_size % parallel.size != 0:
            raise ValueError(f"ffn_hidden_size ({config.ffn_hidden_size}) is not divisible by the "
                             f"tensor-parallel size ({parallel.size})")
        self.padded_vocab_size = config.padded_vocab_size(parallel.size)
        self.embedding = Embedding(config, parallel)
        self.blocks = nn.ModuleList(Block(config, parallel) for _ in range(config.num_layers))
        self.final_norm = _norm(config, parallel.device, parallel.sequence_parallel)
        tied = config.tie_word_embeddings
        self.lm_head = ColumnParallelLinear(
            config.hidden_size, self.padded_vocab_size, bias=False,
            init_method=init_method_normal(config.init_std), perform_initialization=not tied,
            **{**parallel.linear_kwargs(config),
               # A tied weight also gets the embedding's grad in .grad: keep the head's there too.
               "gradient_accumulation_fusion": config.gradient_accumulation_fusion and not tied})
        if tied:
            # One Parameter, registered in both modules (listed once by parameters()).
            self.lm_head.weight = self.embedding.word.weight
        for param in self.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)

    # ---------------------------------------------------------------- forward

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        self._check_input(tokens, labels)
        rotary = (None, None)
        if self.config.position_embedding == "rope":
            rotary = rotary_tables(tokens.shape[1], self.config.head_dim, self.config.rope_theta,
                                   device=tokens.device, dtype=self.embedding.word.weight.dtype)
        x = self.embedding(tokens)                                  # [s(/TP), b, h]
        for block in self.blocks:
            if self.config.recompute and torch.is_grad_enabled():
                x = checkpoint(block, self.config.distribute_saved_activations, x, *rotary,
                               tp_group=self.tp_group)
            else:
                x = block(x, *rotary)
        x = self.final_norm(x)
        # The LM head: a column layer over the vocab with the embedding's weight (when tied);
        # f (or the SP all-gather) inside. Logits stay split over the vocab: never gathered.
        logits, _ = self.lm_head(x, weight=self.embedding.word.weight if self.config.tie_word_embeddings else None)
        if labels is None:
            return logits.transpose(0, 1)                           # [b, s, V_pad/TP]
        labels = labels.t()
        losses = vocab_parallel_cross_entropy(logits, labels, tp_group=self.tp_group,
                                              vocab_size=self.config.vocab_size)
        return losses.sum() / (labels != -100).sum()

    def _check_input(self, tokens: torch.Tensor, labels: torch.Tensor | None) -> None:
        if tokens.dim() != 2 or tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be an integer tensor [batch, seq], got {tokens.dtype} "
                             f"of shape {list(tokens.shape)}")
        seq_len = tokens.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq_len} is longer than max_seq_len {self.config.max_seq_len}")
        if self.parallel.sequence_parallel and seq_len % self.parallel.size != 0:
            raise ValueError(f"sequence length {seq_len} is not divisible by the tensor-parallel size "
                             f"{self.parallel.size} (needed by sequence parallelism)")
        if tokens.numel():
            low, high = (int(v) for v in tokens.aminmax())
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(f"token id {low if low < 0 else high} is outside the vocabulary "
                                 f"[0, {self.config.vocab_size})")
        if labels is not None and labels.shape != tokens.shape:
            raise ValueError(f"labels of shape {list(labels.shape)} must match tokens of shape {list(tokens.shape)}")

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``tokens`` (``[b, s]``); same on every TP rank.

        Samples from the gathered last-position logits with the default stream, which is the
        same on every TP rank. ``temperature=0`` is greedy. Call ``model.eval()`` first.

        Example::

            out = model.generate(prompt, 20, temperature=0.8, top_k=40)
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        for _ in range(max_new_tokens):
            context, pad = tokens[:, -self.config.max_seq_len:], 0
            if self.parallel.sequence_parallel:
                # Pad the end to a multiple of TP (causal attention keeps the padding out of the
                # position read), cropping first so the padded context fits max_seq_len.
                n = self.parallel.size
                context = context[:, -(self.config.max_seq_len // n * n):]
                pad = -context.shape[1] % n
            local = self(F.pad(context, (0, pad)))[:, context.shape[1] - 1]   # [b, V_pad/TP]
            logits = gather_from_tensor_model_parallel_region(local.contiguous(), group=self.tp_group)
            logits = logits[:, :self.config.vocab_size].float()
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_token = torch.multinomial(logits.softmax(dim=-1), 1)
            tokens = torch.cat([tokens, next_token.to(tokens.dtype)], dim=1)
        return tokens

    # ------------------------------------------------- parameters and checkpoints

    def parameter_layouts(self) -> list[layout.ParamLayout]:
        """Every parameter with its TP layout (name, shard, partition dim and stride, full shape).

        The embedding (and tied LM head) weight's full shape is ``[padded_vocab, h]``: the
        padding rows are part of the weight (never looked up; zero grads with a tied head).
        """
        return layout.parameter_layouts(self, tp_group=self.tp_group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters gathered to their TP=1 shapes, on every rank (collective)."""
        return layout.full_state_dict(self, tp_group=self.tp_group)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load TP=1-shaped parameters (as :meth:`full_state_dict` gives) into this rank's shards."""
        layout.load_full_state_dict(self, state, tp_group=self.tp_group)

    @classmethod
    def from_hf_gpt2(cls, hf_model, *, tp_group=None, device=None, **overrides) -> "GPT":
        """This rank's shard of a ``transformers`` ``GPT2LMHeadModel`` (``overrides``: GPTConfig fields)."""
        from .hf_gpt2 import config_from_hf_gpt2, state_dict_from_hf_gpt2

        config = config_from_hf_gpt2(hf_model.config, **overrides)
        model = cls(config, tp_group=tp_group, device=device)
        model.load_full_state_dict(state_dict_from_hf_gpt2(hf_model.state_dict(), config,
                                                           model.padded_vocab_size))
        return model

    def to_hf_gpt2_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model as a ``GPT2LMHeadModel`` state dict (collective; on every rank)."""
        from .hf_gpt2 import state_dict_to_hf_gpt2

        return state_dict_to_hf_gpt2(self.full_state_dict(), self.config)
