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

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .. import invariant
from ..invariant import dropout as invariant_dropout
from ..context_parallel import attention_dropout
from ..expert_parallel import MoELayer
from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ..tensor_parallel.embedding import VocabParallelEmbedding
from ..tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from ..tensor_parallel.initialization import (
    PartSeeds, init_method_normal, init_weight_shard, scaled_init_method_normal,
    set_defaults_if_not_set_tensor_model_parallel_attributes)
from ..tensor_parallel.overlap import interleave
from ..parallel_state import resolve_tp_group
from ..tensor_parallel.random import checkpoint, sharded_dropout
from . import context_split, generation, layout
from .config import GPTConfig
from .inputs import check_input, pad_sequence
from .kv_cache import KVCache
from .parts import Placement, norm
from .rotary import RotaryTables, apply_rotary
from .traced_attention import written_out_attention


class Embedding(nn.Module):
    """Token embedding (vocab-parallel) plus learned positions, then dropout.

    Output ``[s, b, h]``, or ``[s/TP, b, h]`` (this rank's tokens) under SP.
    """

    def __init__(self, config: GPTConfig, parallel: Placement) -> None:
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

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, key=None, rows=None) -> torch.Tensor:
        # g inside: all-reduce of the partial lookups, or reduce-scatter to [s/TP, b, h] under SP.
        x = self.word(tokens)
        if not self.parallel.sequence_parallel:
            x = x.transpose(0, 1).contiguous()
        if self.position is not None:
            positions = self.position[position_ids]                # [s, h] or [b, s, h]
            positions = positions.unsqueeze(1) if positions.dim() == 2 else positions.transpose(0, 1)
            if self.parallel.sequence_parallel:
                positions = positions.chunk(self.parallel.size, dim=0)[self.parallel.rank]
            x = x + positions
        return invariant_dropout.dropout(x, self.config.dropout, key=key, site=("embedding",), training=self.training,
                                         sequence_parallel=self.parallel.sequence_parallel,
                                         tp_group=self.parallel.group, blocks=self.config.invariant_blocks, **(rows or {}))


class Attention(nn.Module):
    """Causal self-attention with this rank's query heads and the K/V heads they read.

    The fused QKV weight is ``p + 2`` equal blocks of ``num_query_groups`` heads each, ``p`` the
    query heads per group: block ``j`` holds every group's ``j``-th query head, then come K and
    V. When TP divides both head counts, ``stride=p+2`` gives each rank the rows of its own
    groups in every block (``p = 1``, no grouped-query attention, is plain Q|K|V). Otherwise the
    query heads are split as evenly as possible in contiguous runs and each rank holds the K/V
    heads its queries read (:func:`layout.attention_layout`): a K/V head several ranks read is
    replicated on each, its gradient summed over them by the QKV layer. Each rank attends with
    its own heads only. TP-invariant grouped-query attention: every rank holds and computes every
    K/V head, as TP = 1 does (:func:`invariant.kv_for_query_heads` sums their grads).
    """

    def __init__(self, config: GPTConfig, parallel: Placement, layer_number: int) -> None:
        super().__init__()
        self.config, self.layer_number, self.context = config, layer_number, parallel.context
        n, p, d, groups = parallel.size, config.queries_per_group, config.head_dim, config.num_query_groups
        self.shared_kv = config.tp_invariant and p > 1
        self.even = config.num_heads % n == 0 and groups % n == 0 and not self.shared_kv
        qkv_layout, proj_layout = dict(stride=p + 2), {}
        if self.even:
            self.local_heads, self.local_groups = config.num_heads // n, groups // n
            self.first_head = parallel.rank * self.local_heads
        else:
            heads = layout.attention_layout(config.num_heads, groups, d, n, all_kv=self.shared_kv)
            (first, stop), _ = heads[parallel.rank]
            self.local_heads, self.first_head = stop - first, first
            self.local_groups = groups if self.shared_kv else (stop - 1) // p + 1 - first // p
            # stride still names the p + 2 blocks (checkpoints store them alike at every TP size).
            qkv_layout["partition_rows"] = [rows for _, rows in heads]
            # Local query head i reads local K/V head group_of_head[i] (shared K/V: one each, kv_read's).
            group_of_head = torch.tensor([h // p - first // p for h in range(first, stop)])
            uniform = self.shared_kv or group_of_head.equal(torch.arange(self.local_groups).repeat_interleave(
                self.local_heads // self.local_groups))
            self.register_buffer("group_of_head", None if uniform else group_of_head.to(parallel.device),
                                 persistent=False)
            if self.shared_kv:  # (the query heads split evenly: the invariant mode's own check)
                qkv_layout.update(shared_rows=2 * groups * d, shared_stride=2)
            else:
                proj_layout = dict(partition_sizes=[(b - a) * d for (a, b), _ in heads])
        self.qkv = parallel.column(config.hidden_size, (p + 2) * groups * d, bias=config.qkv_bias,
                                   init_method=init_method_normal(config.init_std), **qkv_layout,
                                   **parallel.linear_kwargs(config))
        self.proj = parallel.row(config.num_heads * d, config.hidden_size, bias=config.bias,
                                 input_is_parallel=True,
                                 init_method=scaled_init_method_normal(config.init_std, config.num_layers),
                                 **proj_layout, **parallel.linear_kwargs(config))
        self.q_norm = self.k_norm = None
        if config.qk_layernorm:
            if not self.even:
                raise ValueError(f"qk_layernorm needs the query and K/V heads split evenly over TP: "
                                 f"{config.num_heads} and {config.num_query_groups} over {n}")
            # Replicated over TP; each rank normalises its own heads (the grads are summed in backward).
            self.q_norm, self.k_norm = (nn.RMSNorm(d, eps=config.layernorm_epsilon, device=parallel.device,
                                                   dtype=config.params_dtype) for _ in range(2))

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                mask: torch.Tensor | None = None, kv_cache: KVCache | None = None, key=None,
                seq_len: int | None = None) -> torch.Tensor:
        # g (or the SP reduce-scatter) happens inside the row layer.
        return self.proj(self._heads(x, cos, sin, mask, kv_cache, key, seq_len))[0]

    def start(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None):
        """:meth:`forward` with ``g`` left in flight: ``.wait()`` gives ``(output, None)``."""
        return self.proj.start(self._heads(x, cos, sin))

    def _heads(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
               mask: torch.Tensor | None = None, kv_cache: KVCache | None = None, key=None,
               seq_len: int | None = None) -> torch.Tensor:
        """Attention of this rank's heads, before the output projection (``seq_len``: the
        sequence's real length, where the one attended is padded or CP-split)."""
        # f (or the SP all-gather) happens inside the column layer.
        q, k, v = self.split_heads(self.qkv(x)[0], cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.append(self.layer_number, k, v)         # every position so far
        k, v = self.kv_read(k, v)
        s, keys = q.shape[2], k.shape[2]
        if mask is None and keys > s:
            # SDPA's is_causal aligns the causal mask top-left; after cached keys, query i is
            # position keys - s + i and sees every key up to it (bottom-right alignment).
            mask = torch.ones(s, keys, dtype=torch.bool, device=q.device).tril(keys - s)
        if self.context is not None:  # (no mask nor cache: CP runs training and evaluation only)
            return self.context.attend(self, q, k, v, key=key, seq_len=seq_len)
        return self.attend(q, k, v, mask, causal=mask is None, key=key, seq_len=seq_len)

    def split_heads(self, qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None):
        """``q`` ``[b, heads/TP, s, d]``, ``k`` and ``v`` ``[b, groups/TP, s, d]`` from the QKV
        layer's output ``[s, b, (p+2) groups/TP d]``, ``q`` and ``k`` rotated if ``cos`` is given."""
        s, b = qkv.shape[:2]
        p, g, d = self.config.queries_per_group, self.local_groups, self.config.head_dim
        if self.even:
            qkv = qkv.view(s, b, p + 2, g, d)
            # [b, heads/TP, s, d] with the query heads of one group adjacent (Hugging Face's order).
            q = qkv[:, :, :p].permute(1, 3, 2, 0, 4).reshape(b, g * p, s, d)
            k, v = qkv[:, :, p].permute(1, 2, 0, 3), qkv[:, :, p + 1].permute(1, 2, 0, 3)
        else:
            # This rank's query heads in order, then its K heads, then its V heads.
            q, k, v = (t.unflatten(-1, (-1, d)).permute(1, 2, 0, 3)
                       for t in qkv.split([self.local_heads * d, g * d, g * d], dim=-1))
        if self.q_norm is not None:
            q, k = self._normalized(q, self.q_norm), self._normalized(k, self.k_norm)
        if cos is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def _normalized(self, heads: torch.Tensor, norm: nn.RMSNorm) -> torch.Tensor:
        weight = copy_to_tensor_model_parallel_region(norm.weight, self.qkv.tp_group)
        return F.rms_norm(heads, norm.normalized_shape, weight, norm.eps)

    def kv_read(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``, ``v`` as :meth:`attend` takes them: as they are, or (TP-invariant grouped-query
        attention) one K/V head per query head of this rank, their grads summed in TP = 1's order
        before the rotary's backward."""
        if not self.shared_kv:
            return k, v
        return invariant.kv_for_query_heads(k, v, first_head=self.first_head, local_heads=self.local_heads,
                                            queries_per_group=self.config.queries_per_group, group=self.qkv.tp_group)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
               causal: bool, key=None, seq_len: int | None = None) -> torch.Tensor:
        """Attention of this rank's heads over ``k``, ``v`` (``mask``: True = attend; ``causal``:
        top-left aligned), ``[s, b, heads/TP d]``: SDPA, or with attention dropout written out,
        its masks by global head and position (:mod:`tensorpar.context_parallel.attention_dropout`, the
        masks a CP rank draws again; ``seq_len``: the real length of a padded sequence), with a
        ``key`` per global head (TP-invariant training, :func:`tensorpar.invariant.dropout.drop_heads`),
        and under ``torch.compile`` off CPU this rank's slice of one mask (:func:`sharded_dropout`)."""
        if self.config.tp_invariant:  # strides that vary with the heads per rank can change a batched
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # GEMM's sums (head_dim 8, AMD EPYC)
        gqa = q.shape[1] != k.shape[1]
        if not self.even and self.group_of_head is not None:
            # Query heads reading their K/V heads unevenly: SDPA's enable_gqa needs equal runs.
            k, v, gqa = k.index_select(1, self.group_of_head), v.index_select(1, self.group_of_head), False
        dropout_p = self.config.attention_dropout if self.training else 0.0
        drop = None  # where SDPA cannot draw the masks: attention written out
        if dropout_p > 0 and key is not None:  # TP-invariant masks, by global head
            drop = functools.partial(invariant_dropout.drop_heads, p=dropout_p, key=key, layer=self.layer_number,
                                     first_head=self.first_head)
        elif dropout_p > 0 and torch.compiler.is_compiling() and q.device.type != "cpu":
            # Off CPU the compiler's own generator is fast, and an opaque op would keep a graph
            # from being captured whole: each rank keeps its heads' slice of one mask drawn in it.
            drop = functools.partial(sharded_dropout, p=dropout_p, dim=1, start=self.first_head,
                                     full_size=self.config.num_heads)
        elif dropout_p > 0:  # each global head's mask by position: independent over heads, any TP or CP size
            (b, heads, s, _), cached = q.shape, k.shape[2] - q.shape[2]   # queries after any cached keys
            keep = attention_dropout.keep_mask(attention_dropout.draw_base(), dropout_p, batch=b,
                                               heads=range(self.first_head, self.first_head + heads),
                                               rows=[(cached, s)], seq_len=cached + (seq_len or s),
                                               keys=k.shape[2], device=q.device)
            drop = functools.partial(attention_dropout.apply, keep=keep, p=dropout_p)
        if drop is not None:
            out = written_out_attention(q, k, v, mask=mask, causal=causal, gqa=gqa, drop=drop)
        else:  # enable_gqa: query head i reads K/V head i // p, with no copy.
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
        b, _, s, _ = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)            # [s, b, heads/TP d]


class MLP(nn.Module):
    """``fc`` column (``ffn/TP`` of the hidden units here), activation, ``proj`` row; ``width``:
    the hidden units (default ``ffn_hidden_size``)."""

    def __init__(self, config: GPTConfig, parallel: Placement, width: int | None = None) -> None:
        super().__init__()
        self.swiglu, self.elementwise = config.activation == "swiglu", parallel.elementwise
        self.gelu = functools.partial(F.gelu, approximate="tanh" if config.activation == "gelu_tanh" else "none")
        ffn_hidden_size = width or config.ffn_hidden_size
        width = 2 * ffn_hidden_size if self.swiglu else ffn_hidden_size
        # stride=2 for SwiGLU: the full weight is gate|up, each split across ranks.
        self.fc = parallel.column(config.hidden_size, width, bias=config.bias, stride=2 if self.swiglu else 1,
                                  init_method=init_method_normal(config.init_std),
                                  **parallel.linear_kwargs(config))
        self.proj = parallel.row(ffn_hidden_size, config.hidden_size, bias=config.bias,
                                 input_is_parallel=True,
                                 init_method=scaled_init_method_normal(config.init_std, config.num_layers),
                                 **parallel.linear_kwargs(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self._hidden(x))[0]                        # g inside

    def start(self, x: torch.Tensor):
        """:meth:`forward` with ``g`` left in flight: ``.wait()`` gives ``(output, None)``."""
        return self.proj.start(self._hidden(x))

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.activate(self.fc(x)[0])                         # f inside; [s, b, ffn/TP]

    def activate(self, hidden: torch.Tensor) -> torch.Tensor:
        """The activation of the ``fc`` layer's output (SwiGLU: of its gate and up halves)."""
        if self.swiglu:
            gate, up = hidden.chunk(2, dim=-1)
            return self.elementwise(F.silu, gate) * up
        return self.elementwise(self.gelu, hidden)


def experts(config: GPTConfig, parallel: Placement) -> MoELayer:
    """A block's routed experts over ``parallel.ep_group`` (and its shared expert, TP-split as the
    MLP); the invariant mode's :class:`tensorpar.invariant.MoELayer` under ``tp_invariant``."""
    shared = config.moe_shared_expert_intermediate_size
    layer, invariant_options = MoELayer, {}
    if config.tp_invariant:
        layer, invariant_options = invariant.MoELayer, dict(blocks=config.invariant_blocks,
                                                            exchange_group=parallel.expert_exchange_group)
    return layer(config.hidden_size, num_experts=config.num_moe_experts, ffn_hidden_size=config.moe_ffn_hidden_size,
                 topk=config.moe_router_topk, ep_group=parallel.ep_group, tp_group=parallel.group,
                 cp_group=parallel.cp_group, sequence_parallel=parallel.sequence_parallel,
                 shared_experts=MLP(config, parallel, shared) if shared else None,
                 init_method=init_method_normal(config.init_std),
                 output_init_method=scaled_init_method_normal(config.init_std, config.num_layers),
                 params_dtype=config.params_dtype, device=parallel.device, **config.router_options(),
                 **invariant_options)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``."""

    def __init__(self, config: GPTConfig, parallel: Placement, layer_number: int) -> None:
        super().__init__()
        self.config, self.parallel = config, parallel
        self.norm1 = norm(config, parallel)
        self.attention = Attention(config, parallel, layer_number)
        self.norm2 = norm(config, parallel)
        self.mlp = experts(config, parallel) if config.is_moe_layer(layer_number) else MLP(config, parallel)

    def _dropout(self, x: torch.Tensor, key=None, site: str = "", rows=None) -> torch.Tensor:
        # x is replicated (or SP-split): a TP-size-independent mask (default stream or keyed);
        # rows: the SP padding, or the CP chunks' places in the sequence.
        return invariant_dropout.dropout(x, self.config.dropout, key=key, site=(self.attention.layer_number, site),
                                         training=self.training, sequence_parallel=self.parallel.sequence_parallel,
                                         tp_group=self.parallel.group, blocks=self.config.invariant_blocks, **(rows or {}))

    def forward(self, x, cos=None, sin=None, mask=None, kv_cache=None, key=None, rows=None):
        # Per-sequence masks, positions and caches (generation) are not split: no interleaving.
        if self.config.interleave > 1 and mask is None and kv_cache is None and (cos is None or cos.dim() == 2):
            # Domino: while one part's attention (MLP) output is summed over TP, the next part computes.
            def residual(h, reduced):
                return h + self._dropout(reduced[0], rows=rows)
            return interleave(x, [(lambda h: self.attention.start(self.norm1(h), cos, sin), residual),
                                  (lambda h: self.mlp.start(self.norm2(h)), residual)],
                              parts=self.config.interleave)
        attended = self.attention(self.norm1(x), cos, sin, mask, kv_cache, key, (rows or {}).get("valid_rows"))
        x = x + self._dropout(attended, key, "attention", rows)
        return x + self._dropout(self.mlp(self.norm2(x)), key, "mlp", rows)


class GPT(nn.Module):
    """Decoder-only transformer, tensor-parallel over ``tp_group`` (default: the TP group).

    ``model(tokens, labels)`` (``[b, s]`` each, ``-100`` = ignore) returns the mean loss over
    the labelled tokens, identical on every TP rank; ``model(tokens)`` returns this rank's
    vocab slice of the logits, ``[b, s, padded_vocab / TP]`` (columns ``>= vocab_size`` are
    padding). Call ``tp.allreduce_sequence_parallel_grads(model)`` after backward under SP.

    A pipeline stage (:mod:`tensorpar.pipeline_parallel`) holds the blocks ``layers`` only, the embedding
    if ``pre_process`` (else its input is the previous stage's output) and the final norm and
    head if ``post_process`` (else it returns its blocks' output), with the whole model's weights.
    Over ``cp_group`` too, a stage's input and output are this CP rank's chunks of the sequence.
    With ``config.num_moe_experts`` the MoE blocks' experts are sharded over ``ep_group`` (default:
    the initialized expert-parallel group); see :mod:`tensorpar.expert_parallel`.

    Example::

        model = GPT(GPTConfig.preset("tiny", sequence_parallel=True))
        model(tokens, labels).backward()
    """

    def __init__(self, config: GPTConfig, *, tp_group=None, cp_group=None, ep_group=None, device=None,
                 layers: range | None = None, pre_process: bool = True, post_process: bool = True) -> None:
        super().__init__()
        self.config = config
        self.tp_group = resolve_tp_group(tp_group)
        parallel = Placement(config, self.tp_group, device, cp_group, ep_group)
        self.parallel = parallel
        if config.num_heads < parallel.size:
            raise ValueError(f"num_heads ({config.num_heads}) is smaller than the tensor-parallel size "
                             f"({parallel.size}): every rank needs a query head")
        if config.tp_invariant:
            invariant.check_gpt_sizes(config, tp_size=parallel.size)
        self.padded_vocab_size = config.padded_vocab_size(parallel.size)
        self.layers, self.pre_process, self.post_process = layers or range(config.num_layers), pre_process, post_process
        parts = PartSeeds()  # part 0 the embedding, 1 + i block i, num_layers + 1 the head
        self.embedding = parts.build(0, Embedding, config, parallel) if pre_process else None
        self.blocks = nn.ModuleList(parts.build(1 + i, Block, config, parallel, i) for i in self.layers)
        self.final_norm = norm(config, parallel) if post_process else None
        # Tied: the head allocates no weight; forward hands it the embedding's. A last stage without
        # the embedding holds its own copy, drawn as part 0 (both are init_weight_shard's dim-0 rows).
        tied = config.tie_word_embeddings
        self.lm_head = parts.build(
            0 if tied else config.num_layers + 1, parallel.column, config.hidden_size, self.padded_vocab_size,
            bias=False, skip_weight_param_allocation=tied and pre_process, init_method=init_method_normal(config.init_std),
            **parallel.linear_kwargs(config)) if post_process else None
        if tied and pre_process and post_process and config.gradient_accumulation_fusion:
            # The fused head writes main_grad and hands autograd zeros, to which the embedding's
            # gradient is added: the DP reducer adds that .grad to main_grad too.
            self.embedding.word.weight.zero_out_wgrad = True
        # Rows past the vocabulary are padding whose size depends on TP (checkpoints re-pad them).
        for part in (self.embedding.word if pre_process else None, self.lm_head):
            if part is not None and part.weight is not None:
                part.weight.unpadded_rows = config.vocab_size
        # Generation under SP pads up to TP - 1 positions past the window.
        self._rotary_tables = RotaryTables(config, length=config.max_seq_len + self.parallel.size) \
            if config.position_embedding == "rope" else None
        # TP-invariant dropout masks: keyed by the seed the model was built with and the forward's index.
        self.dropout_masks = invariant_dropout.MaskCounter(seed=torch.initial_seed()) if config.tp_invariant else None
        for param in self.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
            param.tp_invariant = config.tp_invariant  # what tensorpar's gradient helpers read

    # ---------------------------------------------------------------- forward

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, last_position_only: bool = False,
                sequence_length: int | None = None) -> torch.Tensor:
        """Loss, or this rank's logits; ``position_ids`` (``[b, s]``, default ``0..s-1``),
        ``attn_mask`` (boolean ``[b, 1, s, keys]``, True = attend; default causal), ``kv_cache``
        and ``last_position_only`` (the logits of the last position alone, except under SP,
        whose sequence is split) serve generation (see :meth:`generate`). A pipeline stage without
        the embedding takes the previous stage's output ``[s(/TP), b, h]`` (of the padded sequence);
        under CP, this rank's chunks of a sequence of ``sequence_length`` tokens."""
        rows = {}  # dropout's placement of this rank's rows: CP chunks, SP padding
        if self.pre_process:
            check_input(self.config, tokens, labels, sp_size=self.parallel.size if self.parallel.sequence_parallel else 1,
                        padding_allowed=attn_mask is None and kv_cache is None)
            rows = context_split.dropout_rows(self.parallel.context, tokens.shape[1])
            whole = tokens, position_ids
            tokens, labels, position_ids = context_split.shard(self, tokens, labels, position_ids, attn_mask, kv_cache)
        elif self.parallel.context is not None:  # a later pipeline stage: the chunks' places in the sequence
            rows, position_ids = context_split.stage_rows(self.parallel.context, tokens, sequence_length)
        seq_len = tokens.shape[1] if self.pre_process else tokens.shape[0] * (
            self.parallel.size if self.parallel.sequence_parallel else 1)
        pad = -seq_len % self.parallel.size if self.parallel.sequence_parallel else 0
        if pad:
            tokens, labels, position_ids = pad_sequence(tokens, labels, position_ids, pad=pad,
                                                        max_seq_len=self.config.max_seq_len)
        rotary = (None, None)
        if self.config.position_embedding == "rope":
            cos, sin = self._rotary(position_ids, seq_len + pad, tokens.device)
            # Per-sequence positions broadcast over the heads.
            rotary = (cos.unsqueeze(1), sin.unsqueeze(1)) if cos.dim() == 3 else (cos, sin)
        if position_ids is None:
            position_ids = torch.arange(seq_len + pad, device=tokens.device)
        key = self.dropout_masks.next_key() if self.dropout_masks is not None and self.training else None
        if pad:  # dropout masks the SP padding apart from the real tokens
            rows = {"valid_rows": seq_len}
        x = context_split.embed(self, tokens, position_ids, key, rows, whole=whole) if self.pre_process \
            else tokens  # [s(/TP), b, h]
        for block in self.blocks:
            if self.config.recompute and torch.is_grad_enabled():
                x = checkpoint(block, self.config.distribute_saved_activations, x, *rotary, attn_mask, None, key,
                               rows, tp_group=self.tp_group)
            else:
                x = block(x, *rotary, attn_mask, kv_cache, key, rows)
        if kv_cache is not None:
            kv_cache.length += seq_len + pad
        if not self.post_process:
            return x
        if last_position_only and not self.parallel.sequence_parallel:
            x = x[-1:]
        x = self.final_norm(x)
        # The LM head: a column layer over the vocab with the embedding's weight (when tied);
        # f (or the SP all-gather) inside. Logits stay split over the vocab: never gathered.
        tied = self.config.tie_word_embeddings and self.pre_process
        logits, _ = self.lm_head(x, weight=self.embedding.word.weight if tied else None)
        if labels is None:
            return logits.transpose(0, 1)[:, :seq_len]              # [b, s, V_pad/TP]
        return self.loss(logits, labels)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of ``logits`` (``[s, b, V_pad/TP]``) over the labelled tokens of
        ``labels`` (``[b, s]``, ``-100`` = ignore); the same on every TP rank."""
        labels = labels.t()
        cross_entropy = functools.partial(invariant.vocab_parallel_cross_entropy, blocks=self.config.invariant_blocks) \
            if self.config.tp_invariant else vocab_parallel_cross_entropy
        losses = cross_entropy(logits, labels, tp_group=self.tp_group, vocab_size=self.config.vocab_size)
        return context_split.mean_loss(losses, labels, self.parallel.context,
                                       invariant_blocks=self.config.invariant_blocks if self.config.tp_invariant else None)

    def _rotary(self, position_ids: torch.Tensor | None, seq_len: int, device: torch.device):
        """``cos``/``sin`` at the positions, in the compute dtype (the autocast dtype when on: q
        and k are not promoted to fp32)."""
        dtype = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
                 else next(self.parameters()).dtype)
        return self._rotary_tables.at(position_ids, seq_len, device, dtype)

    def new_kv_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty :class:`KVCache` for ``batch`` sequences of up to ``capacity`` positions."""
        weight = self.embedding.word.weight
        shape = (batch, self.blocks[0].attention.local_groups, capacity, self.config.head_dim)
        return KVCache(num_layers=self.config.num_layers, shape=shape, dtype=weight.dtype, device=weight.device)

    def generate(self, tokens: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id=None,
                 use_cache: bool = True, attention_mask: torch.Tensor | None = None,
                 cuda_graph: bool = False) -> torch.Tensor:
        """Append up to ``max_new_tokens`` tokens to ``tokens`` (``[b, s]``), the same on every TP rank
        (:func:`tensorpar.models.generation.generate`). ``temperature=0``: greedy. ``cuda_graph``: the
        decode step replayed from a CUDA graph (CUDA, TP=1). Call ``eval()`` first.

        Example::

            out = model.generate(prompt, 20, temperature=0.8, top_k=40)
            out = model.generate(left_padded, 20, temperature=0, attention_mask=mask)
        """
        return generation.generate(self, tokens, max_new_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, eos_token_id=eos_token_id, use_cache=use_cache,
                                   attention_mask=attention_mask, cuda_graph=cuda_graph)

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
