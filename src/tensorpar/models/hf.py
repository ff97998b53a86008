"""Hugging Face ``transformers`` models in and out: GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral and
Qwen3-MoE.

:func:`from_hf` builds this rank's shard of a :class:`~tensorpar.models.gpt.GPT` from a
``transformers`` model object or a local directory (``config.json`` and safetensors files).
From a directory each rank reads only the bytes of its own shard (safetensors slices), so its
peak memory is one shard, not the model, once :mod:`~tensorpar.models.hf_files` has checked
the directory (config.json read as JSON, the safetensors headers against it); a NaN or
infinite value is refused as it is read. :func:`to_hf` gathers the weights into the
``transformers`` model on rank 0.

How weights map: along its TP partition dimension, every GPT parameter is a sequence of row
ranges of Hugging Face tensors (:class:`Piece`, in the GPT's orientation: GPT-2's ``Conv1D``
weights are transposed). A rank reads the ranges its shard covers; export cuts the gathered
tensors at the same boundaries. The fused QKV weight is ``p + 2`` blocks of K/V-group heads
(see :class:`~tensorpar.models.gpt.Attention`): block ``j`` takes every group's ``j``-th query
head from ``q_proj``. The vocabulary is padded with zero rows on import and cut on export.
``transformers`` is imported only when needed; Mistral exports as Llama (the same network).
Mixtral's and Qwen3-MoE's experts are whole tensors per expert, not row ranges: each rank reads
its own experts (of its expert-parallel group) from the files' per-expert gate, up and down
tensors, or from a loaded model's fused ``gate_up_proj`` and ``down_proj``, which are
tensorpar's layout.

Example::

    model = from_hf("llama-dir/", sequence_parallel=True)   # this rank's shard
    hf = to_hf(model, "out/")                               # on rank 0; None elsewhere
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from ..distributed import comm
from ..expert_parallel import MoELayer
from .gpt import GPT, GPTConfig
from .hf_files import (INDEX, SafetensorsReader, check_weights, config_from_hf, config_from_hf_dir,
                       expert_file_names, family_of, model_dir, tensor_key)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of Hugging Face tensor ``name`` (``None``: zero rows, the vocab padding)."""

    name: str | None
    start: int
    stop: int
    transposed: bool = False


def _whole(name: str, rows: int, transposed: bool = False) -> list[Piece]:
    return [Piece(name, 0, rows, transposed)]


def _padded_vocab(name: str, config: GPTConfig, padded: int) -> list[Piece]:
    return [Piece(name, 0, config.vocab_size), Piece(None, config.vocab_size, padded)]


def _gpt2_pieces(config: GPTConfig, padded_vocab: int) -> dict[str, list[Piece]]:
    h, f = config.hidden_size, config.ffn_hidden_size
    pieces = {"embedding.word.weight": _padded_vocab("transformer.wte.weight", config, padded_vocab),
              "embedding.position": _whole("transformer.wpe.weight", config.max_seq_len),
              "final_norm.weight": _whole("transformer.ln_f.weight", h),
              "final_norm.bias": _whole("transformer.ln_f.bias", h)}
    if not config.tie_word_embeddings:
        pieces["lm_head.weight"] = _padded_vocab("lm_head.weight", config, padded_vocab)
    for i in range(config.num_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        # c_attn's output columns are Q|K|V, heads contiguous in each: the QKV layout at p = 1.
        pieces |= {ours + "attention.qkv.weight": _whole(theirs + "attn.c_attn.weight", 3 * h, True),
                   ours + "attention.qkv.bias": _whole(theirs + "attn.c_attn.bias", 3 * h),
                   ours + "attention.proj.weight": _whole(theirs + "attn.c_proj.weight", h, True),
                   ours + "attention.proj.bias": _whole(theirs + "attn.c_proj.bias", h),
                   ours + "mlp.fc.weight": _whole(theirs + "mlp.c_fc.weight", f, True),
                   ours + "mlp.fc.bias": _whole(theirs + "mlp.c_fc.bias", f),
                   ours + "mlp.proj.weight": _whole(theirs + "mlp.c_proj.weight", f, True),
                   ours + "mlp.proj.bias": _whole(theirs + "mlp.c_proj.bias", h)}
        for norm, ln in (("norm1", "ln_1"), ("norm2", "ln_2")):
            pieces |= {f"{ours}{norm}.{p}": _whole(f"{theirs}{ln}.{p}", h) for p in ("weight", "bias")}
    return pieces


def _llama_pieces(config: GPTConfig, padded_vocab: int) -> dict[str, list[Piece]]:
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.head_dim
    groups, p = config.num_query_groups, config.queries_per_group
    pieces = {"embedding.word.weight": _padded_vocab("model.embed_tokens.weight", config, padded_vocab),
              "final_norm.weight": _whole("model.norm.weight", h)}
    if not config.tie_word_embeddings:
        pieces["lm_head.weight"] = _padded_vocab("lm_head.weight", config, padded_vocab)
    for i in range(config.num_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        attn = theirs + "self_attn."
        for param in ("weight", "bias") if config.qkv_bias else ("weight",):
            # Hugging Face numbers query heads group by group: head g*p + j is query j of group g.
            queries = [Piece(f"{attn}q_proj.{param}", (g * p + j) * d, (g * p + j + 1) * d)
                       for j in range(p) for g in range(groups)]
            pieces[f"{ours}attention.qkv.{param}"] = (queries + _whole(f"{attn}k_proj.{param}", groups * d)
                                                      + _whole(f"{attn}v_proj.{param}", groups * d))
        pieces |= {ours + "attention.proj.weight": _whole(attn + "o_proj.weight", config.num_heads * d),
                   ours + "norm1.weight": _whole(theirs + "input_layernorm.weight", h),
                   ours + "norm2.weight": _whole(theirs + "post_attention_layernorm.weight", h)}
        if config.qk_layernorm:
            pieces |= {ours + f"attention.{n}.weight": _whole(f"{attn}{n}.weight", d) for n in ("q_norm", "k_norm")}
        if config.num_moe_experts is not None:  # the experts: _load_experts and hf_state_dict
            pieces[ours + "mlp.router.weight"] = _whole(theirs + "mlp.gate.weight", config.num_moe_experts)
        else:
            pieces |= {ours + "mlp.fc.weight": (_whole(theirs + "mlp.gate_proj.weight", f)
                                                + _whole(theirs + "mlp.up_proj.weight", f)),
                       ours + "mlp.proj.weight": _whole(theirs + "mlp.down_proj.weight", f)}
    return pieces


def hf_pieces(config: GPTConfig, padded_vocab: int) -> dict[str, list[Piece]]:
    """Every GPT parameter name -> its :class:`Piece` list along the TP partition dimension."""
    return (_gpt2_pieces if family_of(config) == "gpt2" else _llama_pieces)(config, padded_vocab)


# --------------------------------------------------------------------------------- configs

def hf_config_of(config: GPTConfig):
    """The ``transformers`` config of a GPT: GPT-2, Qwen2 (QKV biases), Llama, Qwen3 (per-head Q/K
    norms), Mixtral or Qwen3-MoE (with experts)."""
    import transformers


    if family_of(config) == "gpt2":
        return transformers.GPT2Config(
            vocab_size=config.vocab_size, n_positions=config.max_seq_len, n_embd=config.hidden_size,
            n_layer=config.num_layers, n_head=config.num_heads, n_inner=config.ffn_hidden_size,
            activation_function="gelu_new" if config.activation == "gelu_tanh" else "gelu",
            resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=config.attention_dropout,
            layer_norm_epsilon=config.layernorm_epsilon, initializer_range=config.init_std,
            tie_word_embeddings=config.tie_word_embeddings, bos_token_id=None, eos_token_id=None)
    fields = dict(vocab_size=config.vocab_size, max_position_embeddings=config.max_seq_len,
                  num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
                  num_key_value_heads=config.num_query_groups, hidden_size=config.hidden_size,
                  intermediate_size=config.ffn_hidden_size, hidden_act="silu",
                  rms_norm_eps=config.layernorm_epsilon, rope_theta=config.rope_theta,
                  rope_scaling=config.rope_scaling, attention_dropout=config.attention_dropout,
                  initializer_range=config.init_std, tie_word_embeddings=config.tie_word_embeddings,
                  bos_token_id=None, eos_token_id=None)
    family = family_of(config)
    if family == "mixtral":
        return transformers.MixtralConfig(**{**fields, "intermediate_size": config.moe_ffn_hidden_size},
                                          num_local_experts=config.num_moe_experts,
                                          num_experts_per_tok=config.moe_router_topk,
                                          router_aux_loss_coef=config.moe_aux_loss_coeff, sliding_window=None)
    if family == "qwen3":
        return transformers.Qwen3Config(**fields, head_dim=config.head_dim)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**fields, head_dim=config.head_dim, num_experts=config.num_moe_experts,
                                           num_experts_per_tok=config.moe_router_topk,
                                           moe_intermediate_size=config.moe_ffn_hidden_size,
                                           norm_topk_prob=not config.moe_router_pre_softmax,
                                           router_aux_loss_coef=config.moe_aux_loss_coeff, decoder_sparse_step=1,
                                           mlp_only_layers=[])
    if config.qkv_bias:
        if config.rope_scaling is not None:
            raise ValueError("Qwen2 (QKV biases) with Llama 3 rope scaling has no transformers class")
        return transformers.Qwen2Config(**fields)
    return transformers.LlamaConfig(**fields)


# --------------------------------------------------------------------------------- reading

class _StateDictReader:
    """Tensors of an in-memory state dict."""

    def __init__(self, state: dict[str, torch.Tensor], source: str) -> None:
        self.state, self.source = state, source

    def names(self):
        return self.state.keys()

    def where(self, key: str) -> str:
        return self.source

    def shape(self, key: str) -> list[int]:
        return list(self.state[key].shape)

    def read(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.state[key].narrow(dim, start, stop - start)


def _read_rows(reader, piece: Piece, start: int, stop: int, dim: int, like: list[int]) -> torch.Tensor | None:
    """Rows ``[start, stop)`` of ``piece`` (piece coordinates) along ``dim``, GPT orientation;
    ``None`` for padding rows. Refused unless finite."""
    if piece.name is None:
        return None
    shape = list(like)
    shape[dim] = stop - start
    key = tensor_key(reader.names(), piece.name)
    if key is None:
        raise ValueError(f"{reader.source}: tensor {piece.name!r} is missing")
    theirs = reader.shape(key)
    hf_dim = len(theirs) - 1 - dim if piece.transposed else dim
    expected = shape[::-1] if piece.transposed else shape
    first, last = piece.start + start, piece.start + stop
    rows = reader.read(key, hf_dim, first, last)
    if list(rows.shape) != expected:
        raise ValueError(f"{reader.source}: tensor {piece.name!r} of shape {theirs} does not fit this "
                         f"model (expected {expected} at rows {first}:{last})")
    if not torch.isfinite(rows).all():
        raise ValueError(f"{reader.where(key)}: tensor {key!r} holds NaN or infinite values (in rows "
                         f"{first}:{last} of dim {hf_dim}): the weights are damaged")
    return rows.t() if piece.transposed else rows


def _copy_shard(reader, pieces: list[Piece], layout, ranges: list[tuple[int, int]], dim: int) -> None:
    """Fill ``layout.param`` with the rows ``ranges`` (along ``dim``) of its full tensor, read
    piece by piece straight into the parameter: no full-size or shard-size temporary."""
    full_shape = list(layout.full_shape)
    if sum(p.stop - p.start for p in pieces) != full_shape[dim]:
        raise ValueError(f"{layout.name}: the Hugging Face tensors give {sum(p.stop - p.start for p in pieces)} "
                         f"rows along dim {dim}, the model has {full_shape[dim]}")
    filled = 0
    for start, stop in ranges:  # in the order the shard holds them
        offset = 0
        for piece in pieces:
            length = piece.stop - piece.start
            lo, hi = max(start, offset), min(stop, offset + length)
            if lo < hi:
                rows = _read_rows(reader, piece, lo - offset, hi - offset, dim, full_shape)
                target = layout.param.narrow(dim, filled, hi - lo)
                if rows is None:
                    target.zero_()
                else:
                    target.copy_(rows)
                filled += hi - lo
            offset += length


@torch.no_grad()
def _load_shards(model: GPT, reader) -> None:
    """Copy this rank's shard of every parameter from ``reader``'s Hugging Face tensors."""
    pieces = hf_pieces(model.config, model.padded_vocab_size)
    n, rank = comm.group_size(model.tp_group), comm.group_rank(model.tp_group)
    for layout in model.parameter_layouts():
        if getattr(layout.param, "expert_parallel", False):
            continue
        dim = layout.partition_dim % len(layout.full_shape) if layout.tensor_model_parallel else 0
        ranges = layout.ranges(rank, n) if layout.tensor_model_parallel else [(0, layout.full_shape[dim])]
        _copy_shard(reader, pieces[layout.name], layout, ranges, dim)
    _load_experts(model, reader)


def _moe_blocks(model: GPT):
    """(layer number, MoE layer) of every block with experts."""
    return [(i, block.mlp) for i, block in zip(model.layers, model.blocks) if isinstance(block.mlp, MoELayer)]


def _load_experts(model: GPT, reader) -> None:
    """Each MoE block's experts of this rank: rows of a loaded model's fused tensors, or each
    expert's gate, up and down tensors from the files (:func:`expert_file_names`)."""
    h, names = model.config.hidden_size, set(reader.names())
    for i, moe in _moe_blocks(model):
        experts = moe.experts
        first, n, f, total = experts.first_expert, experts.num_local_experts, experts.ffn_hidden_size, experts.num_experts
        fused = f"model.layers.{i}.mlp.experts."
        if fused + "gate_up_proj" in names:
            for ours, theirs, shape in (("gate_up", "gate_up_proj", [total, 2 * f, h]),
                                        ("down", "down_proj", [total, h, f])):
                rows = _read_rows(reader, Piece(fused + theirs, 0, total), first, first + n, 0, shape)
                getattr(experts, ours).copy_(rows)
            continue
        for j, e in enumerate(range(first, first + n)):
            gate, up, down = expert_file_names(model.config, i, e)
            for target, name, rows in ((experts.gate_up[j, :f], gate, f), (experts.gate_up[j, f:], up, f),
                                       (experts.down[j], down, h)):
                target.copy_(_read_rows(reader, Piece(name, 0, rows), 0, rows, 0, list(target.shape)))


def from_hf(model_or_dir, *, tp_group=None, device=None, **config_overrides) -> GPT:
    """This rank's shard of a Hugging Face GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral or Qwen3-MoE model.

    ``model_or_dir``: a ``transformers`` model object, or a local directory with
    ``config.json`` and safetensors weights (each rank reads only its shard's bytes; nothing in
    the directory is run, nothing is downloaded). ``config_overrides``: GPTConfig fields such
    as ``sequence_parallel=True``.

    Example::

        model = from_hf(transformers.LlamaForCausalLM(config), tp_group=group)
        model = from_hf("path/to/qwen2", sequence_parallel=True)
    """
    if isinstance(model_or_dir, (str, os.PathLike)):
        config = config_from_hf_dir(model_or_dir, **config_overrides)
    else:
        config = config_from_hf(model_or_dir.config, **config_overrides)
    reader = _reader(model_or_dir, config)  # checked before the model is built
    model = GPT(config, tp_group=tp_group, device=device)
    _load_shards(model, reader)
    return model


def _reader(model_or_dir, config: GPTConfig):
    if not isinstance(model_or_dir, (str, os.PathLike)):
        return _StateDictReader(model_or_dir.state_dict(), type(model_or_dir).__name__)
    reader = SafetensorsReader(model_dir(model_or_dir))
    check_weights(reader.tensors, config, source=reader.source)
    return reader


def load_weights(model: GPT, model_or_dir) -> None:
    """Overwrite ``model``'s shards with a Hugging Face model's weights (an object or a directory)."""
    _load_shards(model, _reader(model_or_dir, model.config))


# --------------------------------------------------------------------------------- writing

def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The full model as a Hugging Face state dict (collective: gathers every shard, on every rank)."""
    full = model.full_state_dict()
    pieces = hf_pieces(model.config, model.padded_vocab_size)
    parts: dict[str, list[tuple[int, torch.Tensor, bool, int]]] = {}
    for layout in model.parameter_layouts():
        if getattr(layout.param, "expert_parallel", False):
            continue
        dim = layout.partition_dim % len(layout.full_shape) if layout.tensor_model_parallel else 0
        offset = 0
        for piece in pieces[layout.name]:
            rows = full[layout.name].narrow(dim, offset, piece.stop - piece.start)
            offset += piece.stop - piece.start
            if piece.name is not None:
                parts.setdefault(piece.name, []).append((piece.start, rows, piece.transposed, dim))
    state = {}
    for name, rows in parts.items():
        rows.sort(key=lambda part: part[0])
        transposed, dim = rows[0][2], rows[0][3]
        tensor = torch.cat([r for _, r, _, _ in rows], dim=dim)
        state[name] = (tensor.t() if transposed else tensor).contiguous()
    if model.config.tie_word_embeddings:
        state["lm_head.weight"] = state[pieces["embedding.word.weight"][0].name]
    for i, moe in _moe_blocks(model):  # transformers' fused experts, which are tensorpar's layout
        for ours, theirs in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
            state[f"model.layers.{i}.mlp.experts.{theirs}"] = _every_expert(getattr(moe.experts, ours), moe.ep_group)
    return state


def _every_expert(local: torch.Tensor, ep_group) -> torch.Tensor:
    """The whole ``[experts, ...]`` tensor from each EP rank's experts."""
    if ep_group is None or comm.group_size(ep_group) == 1:
        return local.detach().clone()
    return comm.all_gather(local.detach().contiguous(), ep_group, dim=0)


def save_pretrained(hf_model, path) -> None:
    """``hf_model.save_pretrained(path)``, its safetensors files given the mode the umask gives
    any new file (safetensors writes them 0600, unreadable to the rest of a team)."""
    hf_model.save_pretrained(path)
    directory = Path(path)
    index = directory / INDEX
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    umask = os.umask(0)  # setting the umask is the only way to read it
    os.umask(umask)
    for name in files:
        os.chmod(directory / name, 0o666 & ~umask)


def to_hf(model: GPT, path=None):
    """The ``transformers`` model holding ``model``'s weights, on TP rank 0 (``None`` elsewhere).

    Collective over the model's TP group. With ``path``, rank 0 also saves it there
    (``save_pretrained``, safetensors).

    Example::

        hf = to_hf(model, "exported/")
        if hf is not None:
            print(hf.generate(ids, max_new_tokens=5))
    """
    import transformers

    state = hf_state_dict(model)
    if comm.group_rank(model.tp_group) != 0:
        return None
    hf_config = hf_config_of(model.config)
    classes = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
               "qwen2": transformers.Qwen2ForCausalLM, "mixtral": transformers.MixtralForCausalLM,
               "qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM}
    hf_model = classes[hf_config.model_type](hf_config)
    hf_model.load_state_dict(state, strict=True)
    # transformers' generate stops at max_length; past the model's positions a learned table has no row.
    hf_model.generation_config.max_length = model.config.max_seq_len
    if path is not None:
        save_pretrained(hf_model, path)
    return hf_model

