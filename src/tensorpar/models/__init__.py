"""Models built from tensorpar layers: a GPT with Llama-family options, and Hugging Face interop."""

from .config import GPTConfig
from .gpt import GPT
from .kv_cache import KVCache
from .hf import from_hf, hf_state_dict, to_hf
from .layout import (
    ParamLayout,
    full_state_dict,
    gather_full_tensor,
    load_full_state_dict,
    parameter_layouts,
    shard_full_tensor,
)

__all__ = ["GPT", "GPTConfig", "KVCache", "ParamLayout", "from_hf", "full_state_dict", "gather_full_tensor",
           "hf_state_dict", "load_full_state_dict", "parameter_layouts", "shard_full_tensor", "to_hf"]
