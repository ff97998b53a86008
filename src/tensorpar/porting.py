"""Megatron's ``config=`` for the layer constructors: the fields tensorpar reads from it.

megatron-core passes a ``ModelParallelConfig`` (or a ``TransformerConfig``) to every layer. A
layer here reads the fields below from any object that has them and ignores the rest; each
field fills the keyword of the same meaning. A keyword passed with a value other than its
default must agree with the config.

Example::

    fc = tp.ColumnParallelLinear(h, 4 * h, config=transformer_config, init_method=init)
"""

from __future__ import annotations

import torch

# keyword -> (the config's attribute, the keyword's default)
_FIELDS = {
    "params_dtype": ("params_dtype", torch.float32),
    "sequence_parallel": ("sequence_parallel", False),
    "gradient_accumulation_fusion": ("gradient_accumulation_fusion", False),
    "perform_initialization": ("perform_initialization", True),
    "deterministic": ("deterministic_mode", False),
}


def resolve_config(config, layer: str, **given) -> dict:
    """``given`` (a layer's keywords, among ``_FIELDS`` and ``device``) with ``config``'s fields filled in.

    ``config.use_cpu_initialization=True`` places the parameters on the CPU (``device``), as
    Megatron does; the model is moved to its device afterwards.
    """
    if config is None:
        return given
    resolved = dict(given)
    for keyword, value in given.items():
        if keyword == "device":
            if getattr(config, "use_cpu_initialization", False):
                if value is not None and torch.device(value).type != "cpu":
                    raise ValueError(f"{layer}: device={value!r} contradicts config.use_cpu_initialization=True")
                resolved["device"] = torch.device("cpu")
            continue
        attribute, default = _FIELDS[keyword]
        if not hasattr(config, attribute):
            continue
        from_config = getattr(config, attribute)
        if value != default and value != from_config:
            raise ValueError(f"{layer}: {keyword}={value!r} contradicts config.{attribute}={from_config!r}")
        resolved[keyword] = from_config
    return resolved
