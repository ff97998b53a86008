"""The library's public names, which ``import tensorpar`` makes its attributes on first use.

Example::

    import tensorpar as tp
    tp.ColumnParallelLinear          # loads this module (and torch) once
"""

from .tensor_parallel.buffers import GlobalMemoryBuffer, get_global_memory_buffer
from .distributed.comm import CommLedger, CommRecord
from .tensor_parallel.random import CheckpointWithoutOutput
from .planning.communication import calibrate_overlap
from .tensor_parallel.data import broadcast_data
from .tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from .tensor_parallel.embedding import VocabParallelEmbedding
from .data_parallel.fsdp import fully_shard
from .data_parallel.grads import (
    DataParallelGradReducer, MasterWeights, allreduce_sequence_parallel_grads, clip_grad_norm_, get_grad_norm)
from .tensor_parallel.initialization import (
    copy_tensor_model_parallel_attributes, init_method_normal, param_is_not_tensor_parallel_duplicate,
    scaled_init_method_normal, set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes)
from .tensor_parallel.layers import (
    ColumnParallelLinear, LinearWithFrozenWeight, LinearWithGradAccumulationAndAsyncCommunication, RowParallelLinear,
    linear_with_frozen_weight, linear_with_grad_accumulation_and_async_allreduce)
from .tensor_parallel.mappings import (
    all_gather_last_dim_from_tensor_parallel_region, all_to_all, all_to_all_hp2sp, all_to_all_sp2hp,
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region, scatter_to_tensor_model_parallel_region,
    start_reduction_from_tensor_model_parallel_region)
from .tensor_parallel.overlap import all_gather_matmul, interleave, matmul_reduce
from .parallel_state import (
    RankGenerator,
    destroy_model_parallel,
    get_context_parallel_group,
    get_context_parallel_rank,
    get_context_parallel_world_size,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_pipeline_model_parallel_group,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
    initialize_model_parallel,
    is_pipeline_first_stage,
    is_pipeline_last_stage,
    model_parallel_is_initialized,
)
from .tensor_parallel import random  # tp.random.dropout, tp.random.sharded_dropout
from .tensor_parallel.random import (
    CudaRNGStatesTracker, RNGStatesTracker, checkpoint, convert_cuda_rng_state, get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name, get_expert_parallel_rng_tracker_name, get_rng_tracker,
    is_graph_safe_cuda_rng_tracker, model_parallel_cuda_manual_seed, model_parallel_manual_seed)
from .tensor_parallel.utils import (
    VocabUtility, gather_split_1d_tensor, split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks)
from .models import GPT, GPTConfig
