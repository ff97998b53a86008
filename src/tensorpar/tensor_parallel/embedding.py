"""Vocab-parallel embedding: each TP rank holds a contiguous slice of the vocabulary.

Rank ``r`` of ``TP`` owns rows ``[r*V/TP, (r+1)*V/TP)`` of the ``[V, H]`` table. A rank looks up
the ids it owns, writes zeros for the rest, and one all-reduce over TP sums the partial
outputs into the full embedding (or one reduce-scatter leaves each rank its sequence slice
for sequence parallelism).

Example::

    emb = tp.VocabParallelEmbedding(50304, 768)          # weight [50304 // TP, 768]
    h = emb(ids)                                         # ids [b, s] -> h [b, s, 768]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import comm
from ..errors import check_index_range
from .initialization import (
    init_method_normal,
    init_weight_shard,
    set_tensor_model_parallel_attributes,
)
from .mappings import reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region
from ..parallel_state import default_device, resolve_tp_group
from ..porting import resolve_config

# Caps the one-hot block of the deterministic backward at 64 Mi elements (tokens x local vocab).
_ONE_HOT_BLOCK_ELEMENTS = 1 << 26


class _DeterministicEmbedding(torch.autograd.Function):
    """``F.embedding`` whose weight gradient is summed in a fixed order."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        rows, hidden = ctx.weight_shape
        ids = ids.reshape(-1)
        grad_output = grad_output.reshape(-1, hidden)
        # Scatter-adding rows (F.embedding's backward on GPU) lets atomics add the tokens of a
        # frequent id in any order; a GEMM against a one-hot block sums them in a fixed order,
        # so the gradient is bitwise reproducible run to run.
        compute_dtype = torch.promote_types(grad_output.dtype, torch.float32)
        grad_weight = grad_output.new_zeros((rows, hidden), dtype=compute_dtype)
        vocab = torch.arange(rows, device=ids.device)
        block = max(1, _ONE_HOT_BLOCK_ELEMENTS // max(1, rows))
        for start in range(0, ids.numel(), block):
            one_hot = (ids[start:start + block, None] == vocab).to(compute_dtype)
            grad_weight.addmm_(one_hot.t(), grad_output[start:start + block].to(compute_dtype))
        return None, grad_weight.to(ctx.weight_dtype)


class VocabParallelEmbedding(nn.Module):
    """Embedding table sharded over TP along the vocabulary (dim 0 of the weight).

    Input ids are ``[b, s]``; the output is ``[b, s, h]``, replicated on every TP rank. With
    ``reduce_scatter_embeddings=True`` it is ``[s/TP, b, h]`` instead: sequence first and
    split over TP, ready for sequence-parallel layers. ``num_embeddings`` must be divisible by
    the TP size (pad the vocabulary). ``deterministic=True`` makes the weight gradient bitwise
    reproducible on GPU at the cost of a GEMM in backward. Megatron's ``config=`` fills
    ``params_dtype``, ``deterministic`` (its ``deterministic_mode``), ``perform_initialization``
    and, with ``use_cpu_initialization``, ``device`` (:mod:`tensorpar.porting`).

    Collectives per call (``TP > 1``): forward one all-reduce (sum) of the ``[b, s, h]`` output
    in ``params_dtype`` and backward none; with ``reduce_scatter_embeddings`` forward one
    reduce-scatter of the ``[s, b, h]`` output and backward one all-gather of ``[s, b, h]``.

    Example::

        emb = VocabParallelEmbedding(1024, 64)
        out = emb(torch.randint(0, 1024, (2, 16)))     # [2, 16, 64]
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method=None,
                 reduce_scatter_embeddings: bool = False, params_dtype: torch.dtype = torch.float32,
                 device=None, tp_group=None, deterministic: bool = False,
                 perform_initialization: bool = True, config=None) -> None:
        super().__init__()
        settings = resolve_config(config, "VocabParallelEmbedding", params_dtype=params_dtype, device=device,
                                  deterministic=deterministic, perform_initialization=perform_initialization)
        params_dtype, device, deterministic, perform_initialization = (
            settings[k] for k in ("params_dtype", "device", "deterministic", "perform_initialization"))
        self.tp_group = resolve_tp_group(tp_group)
        tp_size, tp_rank = comm.group_size(self.tp_group), comm.group_rank(self.tp_group)
        if num_embeddings % tp_size != 0:
            raise ValueError(f"num_embeddings ({num_embeddings}) is not divisible by the "
                             f"tensor-parallel size ({tp_size}); pad the vocabulary")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.deterministic = deterministic
        self.num_embeddings_per_partition = num_embeddings // tp_size
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(
            self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype,
            device=device if device is not None else default_device()))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)
        if perform_initialization:
            init_weight_shard(self.weight, init_method or init_method_normal(0.02),
                              partition_dim=0, stride=1, tp_group=self.tp_group)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self._check_ids(input_ids)
        tp_size = comm.group_size(self.tp_group)
        if tp_size > 1:
            outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
            local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        else:
            local_ids = input_ids
        if self.deterministic:
            output = _DeterministicEmbedding.apply(local_ids, self.weight)
        else:
            output = F.embedding(local_ids, self.weight)
        if tp_size > 1:
            # In place: the lookup's output is ours, and its backward does not read it.
            output.masked_fill_(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            output = output.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output, self.tp_group)
        return reduce_from_tensor_model_parallel_region(output, self.tp_group, inplace=True)

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(f"token ids must be an integer tensor, got {input_ids.dtype}")
        if self.reduce_scatter_embeddings and input_ids.dim() != 2:
            raise ValueError("reduce_scatter_embeddings expects token ids of shape [b, s], got "
                             f"{list(input_ids.shape)}")
        # Out-of-range ids would silently read zeros (every rank masks them).
        check_index_range(input_ids, self.num_embeddings, "token id",
                          f"out of range for an embedding with num_embeddings={self.num_embeddings} "
                          f"(valid ids: 0..{self.num_embeddings - 1})")

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"per_partition={self.num_embeddings_per_partition}, "
                f"reduce_scatter_embeddings={self.reduce_scatter_embeddings}, "
                f"deterministic={self.deterministic}")
