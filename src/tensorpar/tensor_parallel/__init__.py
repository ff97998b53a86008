"""Megatron-core's ``tensor_parallel``: the column/row linear pair and the autograd function behind
it (:mod:`.layers`, :mod:`.linear_function`), the region mappings f and g and their sequence-parallel
forms (:mod:`.mappings`), vocab-parallel embedding and cross-entropy, the TP-aware RNG tracker and
recompute (:mod:`.random`), TP attributes and initialisation, ``broadcast_data`` (:mod:`.data`) and
the split helpers (:mod:`.utils`); beside them the dropout masks (:mod:`.keep_masks`), the chunked
overlap of GEMMs with their collectives (:mod:`.overlap`) and the global memory buffer.

Megatron code ports by changing the import only::

    from tensorpar import parallel_state, tensor_parallel     # was: from megatron.core import ...

    fc1 = tensor_parallel.ColumnParallelLinear(h, 4 * h, config=config, init_method=init)
"""

from .cross_entropy import vocab_parallel_cross_entropy
from .data import broadcast_data
from .embedding import VocabParallelEmbedding
from .initialization import (copy_tensor_model_parallel_attributes, param_is_not_tensor_parallel_duplicate,
                             set_defaults_if_not_set_tensor_model_parallel_attributes,
                             set_tensor_model_parallel_attributes)
from .layers import ColumnParallelLinear, RowParallelLinear, linear_with_grad_accumulation_and_async_allreduce
from .mappings import (copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                       gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                       scatter_to_tensor_model_parallel_region)
from .random import (CheckpointWithoutOutput, checkpoint, convert_cuda_rng_state, get_cuda_rng_tracker,
                     get_expert_parallel_rng_tracker_name, is_graph_safe_cuda_rng_tracker,
                     model_parallel_cuda_manual_seed)
from .utils import gather_split_1d_tensor, split_tensor_along_last_dim, split_tensor_into_1d_equal_chunks

# megatron/core/tensor_parallel/__init__.py's __all__ (core 0.16.1 to 0.19).
__all__ = [
    "vocab_parallel_cross_entropy", "broadcast_data", "ColumnParallelLinear", "RowParallelLinear",
    "VocabParallelEmbedding", "set_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes", "copy_tensor_model_parallel_attributes",
    "param_is_not_tensor_parallel_duplicate", "linear_with_grad_accumulation_and_async_allreduce",
    "copy_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "scatter_to_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "checkpoint", "convert_cuda_rng_state", "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed", "get_expert_parallel_rng_tracker_name", "is_graph_safe_cuda_rng_tracker",
    "CheckpointWithoutOutput", "split_tensor_along_last_dim", "split_tensor_into_1d_equal_chunks",
    "gather_split_1d_tensor",
]
