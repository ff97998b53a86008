"""The shape and options of a GPT: :class:`GPTConfig` and its named presets."""

from __future__ import annotations

import dataclasses
import math

import torch

_CHOICES = {"norm": ("layernorm", "rmsnorm"), "activation": ("gelu", "gelu_tanh", "swiglu"),
            "position_embedding": ("learned", "rope"), "context_parallel_comm": ("a2a", "p2p"),
            "moe_router_score_function": ("softmax", "sigmoid"),
            "moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "none")}

# Llama 3's rope scaling parameters (besides rope_type).
LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

_PRESETS = {
    "tiny": dict(vocab_size=256, max_seq_len=256, num_layers=4, num_heads=4, hidden_size=128),
    "small": dict(vocab_size=50257, max_seq_len=1024, num_layers=12, num_heads=12, hidden_size=768),
    "medium": dict(vocab_size=50257, max_seq_len=1024, num_layers=24, num_heads=16, hidden_size=1024),
    "large": dict(vocab_size=50257, max_seq_len=1024, num_layers=36, num_heads=20, hidden_size=1280),
    "xl": dict(vocab_size=50257, max_seq_len=1024, num_layers=48, num_heads=25, hidden_size=1600),
    "llama-tiny": dict(vocab_size=256, max_seq_len=256, num_layers=4, num_heads=4, hidden_size=128,
                       norm="rmsnorm", activation="swiglu", position_embedding="rope", bias=False,
                       tie_word_embeddings=False),
    "moe-tiny": dict(vocab_size=256, max_seq_len=256, num_layers=4, num_heads=4, hidden_size=128,
                     norm="rmsnorm", activation="swiglu", position_embedding="rope", bias=False,
                     tie_word_embeddings=False, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128,
                     moe_aux_loss_coeff=1e-2),
}


@dataclasses.dataclass
class GPTConfig:
    """Shape and options of a :class:`GPT`.

    ``ffn_hidden_size`` defaults to ``4 * hidden_size`` (for SwiGLU too: the fused gate/up
    layer is then ``2 * ffn_hidden_size`` wide). ``attention_dropout`` defaults to ``dropout``.
    ``make_vocab_size_divisible_by``: see :meth:`padded_vocab_size`. ``gelu_tanh`` is GPT-2's
    ``gelu_new``. ``distribute_saved_activations`` (recompute without SP only) keeps 1/TP of
    each block's saved input. ``overlap`` (``"off"`` or a number of chunks) is every TP
    linear's: its collectives chunked against its GEMMs (:mod:`tensorpar.tensor_parallel.overlap`).
    ``interleave`` > 1 splits each block's micro-batch into that many parts and interleaves
    them (Domino), so one part's row-layer reductions travel while another part computes.

    Every size works at every TP size with at least one query head per rank: heads, K/V heads
    (also fewer than TP: replicated), FFN and vocabulary need not divide by TP.

    Llama-family options: ``num_query_groups`` is the number of K/V heads (grouped-query
    attention; default ``num_heads``); ``qkv_bias`` defaults to ``bias`` (Qwen2 has biases on
    Q, K and V only); ``rope_scaling`` is Llama 3's ``{"rope_type": "llama3", "factor",
    "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``;
    ``layernorm_epsilon`` is RMSNorm's epsilon too. ``kv_channels`` (Megatron's name) is the
    head dimension when it is not ``hidden_size / num_heads`` (Qwen3's); ``qk_layernorm``
    normalises each query and key head (RMSNorm over the head dimension) before the rotary, as
    Qwen3 does.

    ``invariant_blocks`` (``tp_invariant`` only): the fixed blocks every TP-split dimension is
    cut into, which every TP size of the run must divide: 8 serves TP 1, 2, 4 and 8; 24 also
    TP 3 and 6 (the GEMMs then come in 24 pieces). Runs compared bit for bit use one count.

    Mixture of experts (Megatron's names; :mod:`tensorpar.expert_parallel`): ``num_moe_experts``
    SwiGLU experts of width ``moe_ffn_hidden_size`` (default ``ffn_hidden_size``), each token
    sent to ``moe_router_topk`` of them, in every ``moe_layer_freq``-th block after the first
    ``moe_first_dense_layers`` (DeepSeek-V3's dense first blocks); a shared expert of width
    ``moe_shared_expert_intermediate_size`` sees every token. The ``moe_router_*``,
    ``moe_aux_loss_coeff`` and ``moe_z_loss_coeff`` fields are :class:`TopKRouter`'s options.

    ``context_parallel_comm`` is how attention reaches the other context-parallel ranks' tokens
    when the GPT is built with a ``cp_group``: ``"p2p"`` (ring) or ``"a2a"`` (Ulysses); see
    :mod:`tensorpar.context_parallel`.

    Example::

        GPTConfig(vocab_size=50257, max_seq_len=1024, num_layers=12, num_heads=12, hidden_size=768)
        GPTConfig.preset("small", sequence_parallel=True)
        GPTConfig(vocab_size=32000, max_seq_len=4096, num_layers=32, num_heads=32, hidden_size=4096,
                  ffn_hidden_size=14336, num_query_groups=8, norm="rmsnorm", activation="swiglu",
                  position_embedding="rope", rope_theta=5e5, bias=False, tie_word_embeddings=False)
    """

    vocab_size: int
    max_seq_len: int
    num_layers: int
    num_heads: int
    hidden_size: int
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
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
    rope_scaling: dict | None = None
    bias: bool = True
    qkv_bias: bool | None = None
    tie_word_embeddings: bool = True
    layernorm_epsilon: float = 1e-5
    init_std: float = 0.02
    gradient_accumulation_fusion: bool = False
    params_dtype: torch.dtype = torch.float32
    overlap: int | str = "off"
    interleave: int = 1
    tp_invariant: bool = False
    invariant_blocks: int = 8
    context_parallel_comm: str = "p2p"
    kv_channels: int | None = None
    qk_layernorm: bool = False
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int = 1
    moe_first_dense_layers: int = 0
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3

    PRESETS = tuple(_PRESETS)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "num_layers", "num_heads", "hidden_size",
                     "make_vocab_size_divisible_by", "invariant_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.kv_channels is None:
            if self.hidden_size % self.num_heads != 0:
                raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads})")
        elif isinstance(self.kv_channels, bool) or not isinstance(self.kv_channels, int) or self.kv_channels < 1:
            raise ValueError(f"GPTConfig.kv_channels must be a positive int (or None: hidden_size / num_heads), "
                             f"got {self.kv_channels!r}")
        if self.position_embedding == "rope" and self.head_dim % 2 != 0:
            raise ValueError(f"rotary positions need an even head dimension, got {self.head_dim}")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_heads
        if not isinstance(self.num_query_groups, int) or self.num_query_groups < 1 \
                or self.num_heads % self.num_query_groups:
            raise ValueError(f"GPTConfig.num_query_groups must be a positive divisor of num_heads "
                             f"({self.num_heads}), got {self.num_query_groups!r}")
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        if self.rope_scaling is not None:
            keys = {"rope_type", *LLAMA3_SCALING}
            if self.rope_scaling.get("rope_type") != "llama3" or set(self.rope_scaling) != keys:
                raise ValueError(f"GPTConfig.rope_scaling must be None or a dict with keys {sorted(keys)} "
                                 f"and rope_type 'llama3', got {self.rope_scaling!r}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.attention_dropout is None:
            self.attention_dropout = self.dropout
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"GPTConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if isinstance(self.interleave, bool) or not isinstance(self.interleave, int) or self.interleave < 1:
            raise ValueError(f"GPTConfig.interleave must be a positive int (1: off), got {self.interleave!r}")
        if self.tp_invariant:
            unsupported = {"overlap": self.overlap != "off", "interleave": self.interleave > 1,
                           "gradient_accumulation_fusion": self.gradient_accumulation_fusion,
                           "qk_layernorm": self.qk_layernorm}
            named = [f"{k}={getattr(self, k)!r}" for k, bad in unsupported.items() if bad]
            if named:
                raise ValueError(f"GPTConfig.tp_invariant=True does not support {', '.join(named)}")
        if self.num_moe_experts is not None:
            self._check_experts()
        if self.distribute_saved_activations and (self.sequence_parallel or not self.recompute):
            raise ValueError("distribute_saved_activations needs recompute=True and sequence_parallel=False "
                             "(under SP the saved block inputs are already split over TP)")

    def _check_experts(self) -> None:
        for name in ("num_moe_experts", "moe_router_topk", "moe_layer_freq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(f"GPTConfig.moe_router_topk ({self.moe_router_topk}) is more than "
                             f"num_moe_experts ({self.num_moe_experts})")
        if not 0 <= self.moe_first_dense_layers <= self.num_layers:
            raise ValueError(f"GPTConfig.moe_first_dense_layers must be in [0, num_layers={self.num_layers}], "
                             f"got {self.moe_first_dense_layers}")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        # Megatron's rule: a model with experts has gated experts; its dense layers share the activation.
        unsupported = {"activation": self.activation != "swiglu", "interleave": self.interleave > 1}
        named = [f"{k}={getattr(self, k)!r}" for k, bad in unsupported.items() if bad]
        if named:
            raise ValueError(f"GPTConfig with num_moe_experts does not support {', '.join(named)} "
                             "(the experts are SwiGLU MLPs)")

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether block ``layer_number`` (from 0) has routed experts: every ``moe_layer_freq``-th
        block after the first ``moe_first_dense_layers`` dense ones."""
        return (self.num_moe_experts is not None and layer_number >= self.moe_first_dense_layers
                and (layer_number - self.moe_first_dense_layers) % self.moe_layer_freq == 0)

    def router_options(self) -> dict:
        """The router's options (:class:`tensorpar.expert_parallel.TopKRouter`) of this config."""
        return dict(score_function=self.moe_router_score_function, pre_softmax=self.moe_router_pre_softmax,
                    num_groups=self.moe_router_num_groups, group_topk=self.moe_router_group_topk,
                    scaling_factor=self.moe_router_topk_scaling_factor,
                    load_balancing_type=self.moe_router_load_balancing_type, aux_loss_coeff=self.moe_aux_loss_coeff,
                    z_loss_coeff=self.moe_z_loss_coeff, enable_expert_bias=self.moe_router_enable_expert_bias,
                    bias_update_rate=self.moe_router_bias_update_rate)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_heads

    @property
    def queries_per_group(self) -> int:
        """Query heads sharing one K/V head (1 without grouped-query attention)."""
        return self.num_heads // self.num_query_groups

    def padded_vocab_size(self, tp_size: int) -> int:
        """``vocab_size`` rounded up to a multiple of lcm(make_vocab_size_divisible_by, TP) (and of
        ``invariant_blocks`` under ``tp_invariant``).

        The same for every TP size dividing ``make_vocab_size_divisible_by`` (or the invariant
        blocks), so checkpoints move between such TP sizes unchanged.
        """
        blocks = self.invariant_blocks if self.tp_invariant else 1
        multiple = math.lcm(self.make_vocab_size_divisible_by, tp_size, blocks)
        return -(-self.vocab_size // multiple) * multiple

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """A named size: ``tiny``, ``llama-tiny``, ``moe-tiny`` (8 experts, 2 per token; byte vocab),
        ``small``/``medium``/``large``/``xl``
        (GPT-2's 124M/350M/774M/1.5B shapes)."""
        if name not in _PRESETS:
            raise ValueError(f"unknown GPTConfig preset {name!r}; choose from {list(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})

