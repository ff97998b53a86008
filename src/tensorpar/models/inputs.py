"""What a GPT does to its input before the embedding: the checks of the token ids and labels,
and the padding that lets sequence parallelism split any sequence length evenly.

Example::

    check_input(config, tokens, labels, sp_size=2, padding_allowed=True)
    tokens, labels, position_ids = pad_sequence(tokens, labels, position_ids, pad=1, max_seq_len=256)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import check_index_range
from .config import GPTConfig


def check_input(config: GPTConfig, tokens: torch.Tensor, labels: torch.Tensor | None, *, sp_size: int,
                padding_allowed: bool) -> None:
    """Raise ``ValueError`` naming what is wrong with ``tokens``/``labels`` (``[b, s]`` each);
    ``sp_size``: the TP size under sequence parallelism, else 1."""
    if tokens.dim() != 2 or tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer tensor [batch, seq], got {tokens.dtype} "
                         f"of shape {list(tokens.shape)}")
    seq_len = tokens.shape[1]
    if seq_len > config.max_seq_len:
        raise ValueError(f"sequence length {seq_len} is longer than max_seq_len {config.max_seq_len}")
    if seq_len % sp_size != 0 and not padding_allowed:
        raise ValueError(f"sequence length {seq_len} is not divisible by the tensor-parallel size "
                         f"{sp_size}, as sequence parallelism with an attention mask or a KV cache needs")
    check_index_range(tokens, config.vocab_size, "token id", f"outside the vocabulary [0, {config.vocab_size})")
    if labels is not None and labels.shape != tokens.shape:
        raise ValueError(f"labels of shape {list(labels.shape)} must match tokens of shape {list(tokens.shape)}")


def pad_sequence(tokens: torch.Tensor, labels: torch.Tensor | None, position_ids: torch.Tensor | None, *,
                 pad: int, max_seq_len: int):
    """``tokens``, ``labels`` and ``position_ids`` with ``pad`` positions appended.

    SP splits the sequence evenly: padded at the end, which no real position sees (causal), with
    labels ignored, so loss and gradients are the unpadded sequence's.
    """
    if position_ids is None:
        position_ids = torch.arange(tokens.shape[1] + pad, device=tokens.device).clamp(max=max_seq_len - 1)
    else:
        position_ids = F.pad(position_ids, (0, pad))
    labels = None if labels is None else F.pad(labels, (0, pad), value=-100)
    return F.pad(tokens, (0, pad)), labels, position_ids
