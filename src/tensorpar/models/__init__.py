"""Models built from tensorpar layers: a GPT with Llama-style options, and HF GPT-2 interop."""

from .gpt import GPT, GPTConfig
from .layout import (
    ParamLayout,
    full_state_dict,
    gather_full_tensor,
    load_full_state_dict,
    parameter_layouts,
    shard_full_tensor,
)

__all__ = ["GPT", "GPTConfig", "ParamLayout", "full_state_dict", "gather_full_tensor", "load_full_state_dict",
           "parameter_layouts", "shard_full_tensor"]
