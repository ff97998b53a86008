"""Hugging Face ``GPT2LMHeadModel`` <-> :class:`~tensorpar.models.gpt.GPT` (full state dicts).

Conversion is between the HF state dict and the GPT's *full* (TP=1) state dict; sharding onto
ranks is :meth:`GPT.load_full_state_dict`'s job, so the same code serves every TP size. HF's
``Conv1D`` stores weights ``[in, out]`` (transposed here). ``c_attn``'s output columns are
``Q|K|V`` with heads contiguous inside each, which is exactly the layout the stride-3 QKV layer
splits per head. The vocabulary is padded with zero rows on import and cut on export.
``transformers`` is needed only by :func:`to_hf_gpt2`, and imported there.

Example::

    hf = transformers.GPT2LMHeadModel.from_pretrained("gpt2")
    model = GPT.from_hf_gpt2(hf, sequence_parallel=True)     # this rank's shard
    hf.load_state_dict(model.to_hf_gpt2_state_dict())
"""

from __future__ import annotations

import torch

from .gpt import GPTConfig

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}

# (our name, HF name, HF stores it as a Conv1D weight [in, out])
_BLOCK_NAMES = [
    ("norm1.weight", "ln_1.weight", False), ("norm1.bias", "ln_1.bias", False),
    ("attention.qkv.weight", "attn.c_attn.weight", True), ("attention.qkv.bias", "attn.c_attn.bias", False),
    ("attention.proj.weight", "attn.c_proj.weight", True), ("attention.proj.bias", "attn.c_proj.bias", False),
    ("norm2.weight", "ln_2.weight", False), ("norm2.bias", "ln_2.bias", False),
    ("mlp.fc.weight", "mlp.c_fc.weight", True), ("mlp.fc.bias", "mlp.c_fc.bias", False),
    ("mlp.proj.weight", "mlp.c_proj.weight", True), ("mlp.proj.bias", "mlp.c_proj.bias", False),
]


def _name_map(config: GPTConfig) -> list[tuple[str, str, bool]]:
    """Every parameter except the vocab-sized ones, which need padding."""
    names = [("embedding.position", "transformer.wpe.weight", False),
             ("final_norm.weight", "transformer.ln_f.weight", False),
             ("final_norm.bias", "transformer.ln_f.bias", False)]
    for i in range(config.num_layers):
        names += [(f"blocks.{i}.{ours}", f"transformer.h.{i}.{theirs}", conv) for ours, theirs, conv in _BLOCK_NAMES]
    return names


def config_from_hf_gpt2(hf_config, **overrides) -> GPTConfig:
    """The :class:`GPTConfig` of a ``transformers.GPT2Config`` (``overrides``: any GPTConfig field)."""
    activation = _ACTIVATIONS.get(hf_config.activation_function)
    if activation is None:
        raise ValueError(f"unsupported GPT-2 activation_function {hf_config.activation_function!r}; "
                         f"supported: {sorted(_ACTIVATIONS)}")
    if not getattr(hf_config, "scale_attn_weights", True) or getattr(hf_config, "scale_attn_by_inverse_layer_idx", False):
        raise ValueError("only GPT-2's standard 1/sqrt(head_dim) attention scaling is supported "
                         "(scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False)")
    fields = dict(vocab_size=hf_config.vocab_size, max_seq_len=hf_config.n_positions,
                  num_layers=hf_config.n_layer, num_heads=hf_config.n_head, hidden_size=hf_config.n_embd,
                  ffn_hidden_size=hf_config.n_inner, activation=activation,
                  dropout=hf_config.resid_pdrop, attention_dropout=hf_config.attn_pdrop,
                  layernorm_epsilon=hf_config.layer_norm_epsilon, init_std=hf_config.initializer_range,
                  tie_word_embeddings=getattr(hf_config, "tie_word_embeddings", True))
    return GPTConfig(**{**fields, **overrides})


def _check_gpt2_shaped(config: GPTConfig) -> None:
    if (config.norm, config.position_embedding, config.bias) != ("layernorm", "learned", True) \
            or config.activation == "swiglu":
        raise ValueError("only a GPT-2-shaped model (layernorm, learned positions, biases, GELU) maps to "
                         f"GPT2LMHeadModel; got norm={config.norm!r}, position_embedding="
                         f"{config.position_embedding!r}, bias={config.bias}, activation={config.activation!r}")


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])])


def state_dict_from_hf_gpt2(hf_state: dict[str, torch.Tensor], config: GPTConfig,
                            padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """A GPT full state dict from a ``GPT2LMHeadModel`` state dict."""
    _check_gpt2_shaped(config)
    full = {ours: hf_state[theirs].t() if conv else hf_state[theirs] for ours, theirs, conv in _name_map(config)}
    full["embedding.word.weight"] = _pad_rows(hf_state["transformer.wte.weight"], padded_vocab_size)
    if not config.tie_word_embeddings:
        full["lm_head.weight"] = _pad_rows(hf_state["lm_head.weight"], padded_vocab_size)
    return full


def state_dict_to_hf_gpt2(full: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A ``GPT2LMHeadModel`` state dict (strict-loadable) from a GPT full state dict."""
    _check_gpt2_shaped(config)
    hf = {theirs: (full[ours].t() if conv else full[ours]).contiguous() for ours, theirs, conv in _name_map(config)}
    vocab = config.vocab_size
    hf["transformer.wte.weight"] = full["embedding.word.weight"][:vocab].contiguous()
    head = "embedding.word.weight" if config.tie_word_embeddings else "lm_head.weight"
    hf["lm_head.weight"] = full[head][:vocab].contiguous()
    return hf


def to_hf_gpt2(model):
    """A ``transformers.GPT2LMHeadModel`` holding ``model``'s full weights (collective).

    Example::

        to_hf_gpt2(model).save_pretrained("out/")      # on rank 0
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = model.config
    hf_config = GPT2Config(vocab_size=config.vocab_size, n_positions=config.max_seq_len, n_embd=config.hidden_size,
                           n_layer=config.num_layers, n_head=config.num_heads, n_inner=config.ffn_hidden_size,
                           activation_function="gelu_new" if config.activation == "gelu_tanh" else "gelu",
                           resid_pdrop=config.dropout, embd_pdrop=config.dropout,
                           attn_pdrop=config.attention_dropout, layer_norm_epsilon=config.layernorm_epsilon,
                           initializer_range=config.init_std, tie_word_embeddings=config.tie_word_embeddings)
    hf_model = GPT2LMHeadModel(hf_config)
    hf_model.load_state_dict(model.to_hf_gpt2_state_dict())
    return hf_model
