"""A Hugging Face model directory read as checked data, before anything is built.

Nothing in the directory is imported or run and nothing is fetched: a name that is not a
local directory is refused, and ``config.json`` is plain JSON whose fields are checked (type,
range) as they map to a :class:`~tensorpar.models.gpt.GPTConfig` of one of the four supported
model types. A safetensors file's header (8 bytes of length, then JSON) is read and checked
against the file's size; every tensor the config reads must be there, at its full shape and in
a float dtype (:func:`check_weights`), before a byte of weights is read. Which file holds a
tensor: the one ``model.safetensors.index.json`` names (every file and tensor it names must
exist); without an index, the one ``*.safetensors`` file holding it (a tensor in two files is
refused, naming both).

Example::

    config = config_from_hf_dir("my-llama")   # config.json only: a GPTConfig, nothing built
    config = check_hf_dir("my-llama")         # and the safetensors headers agree with it
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import torch

from .gpt import GPTConfig

INDEX = "model.safetensors.index.json"
JSON_LIMIT = 64 * 2**20      # bytes of config.json or an index: far above any real one
HEADER_LIMIT = 100 * 2**20   # safetensors' own bound on a header
FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
REQUIRED = object()
GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")


def _finite(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


# kind -> (accepts, what it must be)
KINDS = {
    "count": (lambda v: type(v) is int and v > 0, "a positive integer"),
    "positive": (lambda v: _finite(v) and v > 0, "a positive number"),
    "probability": (lambda v: _finite(v) and 0 <= v < 1, "a number in [0, 1)"),
    "flag": (lambda v: type(v) is bool, "true or false"),
    "name": (lambda v: type(v) is str, "a string"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
    "layers": (lambda v: isinstance(v, list) and all(type(i) is int and i >= 0 for i in v), "a list of layer numbers"),
}


class Fields:
    """A config's fields, each checked as it is read; errors name the file, the field and its value."""

    def __init__(self, data: dict, *, source: str) -> None:
        self.data, self.source = data, source

    def get(self, name: str, kind: str, default=REQUIRED):
        """Field ``name``, which must be of ``kind`` (see ``KINDS``); absent or null: ``default``."""
        value = self.data.get(name)
        if value is None and default is not REQUIRED:
            return default
        if name not in self.data:
            raise ValueError(f"{self.source}: has no field {name!r}")
        accepts, what = KINDS[kind]
        if not accepts(value):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise ValueError(f"{self.source}: {name} must be {what}, got {shown}")
        return value


def model_dir(path) -> Path:
    """``path`` if it is a local directory with a ``config.json``; refused otherwise (nothing is downloaded)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"{path}: no such local directory (models are read from local directories only, "
                         f"never downloaded: fetch it first, e.g. hf download {path} --local-dir DIR)")
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory}: not a Hugging Face model directory (no config.json)")
    return directory


def _read_json(path: Path):
    size = path.stat().st_size
    if size > JSON_LIMIT:
        raise ValueError(f"{path}: {size:,} bytes is too large for a JSON description of a model")
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def read_config(directory: Path) -> dict:
    """``config.json`` of ``directory`` as a dict (parsed as JSON, nothing else)."""
    data = _read_json(directory / "config.json")
    if not isinstance(data, dict):
        raise ValueError(f"{directory / 'config.json'}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where a tensor is stored, and its dtype (safetensors' name, e.g. ``BF16``) and shape."""

    file: str
    dtype: str
    shape: tuple[int, ...]


def _valid_entry(entry, data_bytes: int) -> bool:
    if not isinstance(entry, dict) or type(entry.get("dtype")) is not str:
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    return (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes)


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from a safetensors file's header, checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if size < 8 or length > min(HEADER_LIMIT, size - 8):
            raise ValueError(f"{path}: not a safetensors file (header length {length:,} in a {size:,}-byte file)")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: not a safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not _valid_entry(entry, size - 8 - length):
            raise ValueError(f"{path}: the header's entry for {name!r} is not a tensor inside the file")
        dtype, shape, (start, stop) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if dtype in FLOAT_DTYPES and stop - start != math.prod(shape) * FLOAT_DTYPES[dtype]:
            raise ValueError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) has {stop - start:,} bytes, "
                             f"not {math.prod(shape) * FLOAT_DTYPES[dtype]:,}")
        tensors[name] = (dtype, shape)
    return tensors


def _indexed(directory: Path) -> dict[str, TensorInfo]:
    index = directory / INDEX
    data = _read_json(index)
    names = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(names, dict) or not all(isinstance(f, str) for f in names.values()):
        raise ValueError(f"{index}: no weight_map object of tensor names to file names")
    headers, tensors = {}, {}
    for name, file in names.items():
        if file not in headers:
            if Path(file).name != file or not (directory / file).is_file():
                raise ValueError(f"{index}: names {file!r} as the file of tensor {name!r}, and {directory} "
                                 "has no such file")
            headers[file] = read_header(directory / file)
        if name not in headers[file]:
            raise ValueError(f"{index}: names {file} as the file of tensor {name!r}, which it does not hold")
        tensors[name] = TensorInfo(file, *headers[file][name])
    return tensors


def weight_map(directory: Path) -> dict[str, TensorInfo]:
    """Every tensor of ``directory``'s safetensors files, with the one file to read it from."""
    if (directory / INDEX).is_file():
        return _indexed(directory)
    files = sorted(p.name for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        raise ValueError(f"{directory}: no *.safetensors files (pickled .bin weights are never read: "
                         "loading them can execute code)")
    tensors = {}
    for file in files:
        for name, (dtype, shape) in read_header(directory / file).items():
            if name in tensors:
                raise ValueError(f"{directory}: tensor {name!r} is in both {tensors[name].file} and {file}, and "
                                 f"no {INDEX} says which to read: remove the stale file")
            tensors[name] = TensorInfo(file, dtype, shape)
    return tensors


class SafetensorsReader:
    """Tensors of a directory's safetensors files, each from the file :func:`weight_map` names;
    a read loads only the bytes of its slice."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.source, self.tensors = str(directory), weight_map(directory)
        handles = {file: safe_open(str(directory / file), framework="pt")
                   for file in sorted({info.file for info in self.tensors.values()})}
        self._handles = {name: handles[info.file] for name, info in self.tensors.items()}

    def names(self):
        return self.tensors.keys()

    def where(self, key: str) -> str:
        return str(Path(self.source) / self.tensors[key].file)

    def shape(self, key: str) -> list[int]:
        return list(self.tensors[key].shape)

    def read(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        index = [slice(None)] * len(self.tensors[key].shape)
        index[dim] = slice(start, stop)
        return self._handles[key].get_slice(key)[tuple(index)]


# ----------------------------------------------------- configs, and the weights they read

# What Mixtral's experts are: softmax over every expert, the top k renormalised, nothing else.
_MIXTRAL_ROUTER = dict(moe_layer_freq=1, moe_first_dense_layers=0, moe_shared_expert_intermediate_size=None,
                       moe_router_score_function="softmax", moe_router_pre_softmax=False, moe_router_num_groups=None,
                       moe_router_topk_scaling_factor=None, moe_router_enable_expert_bias=False)


def family_of(config: GPTConfig) -> str:
    """``gpt2``, ``llama``, ``qwen3`` (Llama's with per-head Q/K norms), ``mixtral`` (Llama's with
    experts) or ``qwen3_moe`` (Qwen3's with experts): the Hugging Face layout a GPT's weights map to."""
    if config.num_moe_experts is not None:
        dense = family_of(dataclasses.replace(config, num_moe_experts=None))
        name = "Qwen3-MoE" if dense == "qwen3" else "Mixtral"
        router = {k: v for k, v in _MIXTRAL_ROUTER.items() if not (dense == "qwen3" and k == "moe_router_pre_softmax")}
        unlike = [f"{k}={getattr(config, k)!r}" for k, v in router.items() if getattr(config, k) != v]
        if unlike or dense not in ("llama", "qwen3") or config.qkv_bias:
            raise ValueError(f"a GPT with experts maps to {name} only with its layers, an MoE MLP in every "
                             f"block and its router; this one has {', '.join(unlike) or 'other layers'}")
        return "qwen3_moe" if dense == "qwen3" else "mixtral"
    if config.qk_layernorm:
        if family_of(dataclasses.replace(config, qk_layernorm=False)) != "llama" or config.qkv_bias:
            raise ValueError("per-head Q/K norms (qk_layernorm) map to Qwen3 only with Llama's layers and no QKV biases")
        return "qwen3"
    if (config.norm, config.position_embedding, config.bias, config.qkv_bias) == ("layernorm", "learned", True, True) \
            and config.activation != "swiglu" and config.num_query_groups == config.num_heads:
        return "gpt2"
    if (config.norm, config.activation, config.position_embedding, config.bias) == ("rmsnorm", "swiglu", "rope", False):
        return "llama"
    raise ValueError("no transformers family has this GPT's shape: GPT-2 needs layernorm, learned positions, "
                     "biases, GELU and no grouped-query attention; Llama/Qwen2 need rmsnorm, swiglu, rope and "
                     f"no biases besides QKV; got norm={config.norm!r}, activation={config.activation!r}, "
                     f"position_embedding={config.position_embedding!r}, bias={config.bias}, "
                     f"qkv_bias={config.qkv_bias}, num_query_groups={config.num_query_groups}")


def _rope(fields: Fields) -> tuple[float, dict | None]:
    """(rope_theta, Llama 3 rope_scaling or None) from transformers 5's ``rope_parameters``
    or the older ``rope_theta`` / ``rope_scaling``."""
    params = fields.get("rope_parameters", "object", None)
    scaling = fields.get("rope_scaling", "object", None)
    if params is None:
        params = {"rope_theta": fields.get("rope_theta", "positive", 10000.0), **(scaling or {})}
    elif scaling is not None:
        # Both: transformers 5 reads rope_parameters; a rope_scaling that says otherwise is refused, not dropped.
        kind = params.get("rope_type", params.get("type", "default"))
        given = {**params, "type": kind, "rope_type": kind}
        differs = sorted(key for key, value in scaling.items() if given.get(key) != value)
        if differs:
            key = differs[0]
            raise ValueError(f"{fields.source}: rope_scaling's {key} is {scaling[key]!r}, but rope_parameters' is "
                             f"{given.get(key)!r}: give the scaling once, in rope_parameters")
    rope = Fields(params, source=f"{fields.source}: rope_parameters")
    rope_type = rope.get("rope_type", "name", None) or rope.get("type", "name", "default")
    theta = float(rope.get("rope_theta", "positive", 10000.0))
    if rope.get("partial_rotary_factor", "positive", 1.0) != 1.0:
        raise ValueError(f"{fields.source}: partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        return theta, {"rope_type": "llama3", **{key: rope.get(key, "positive") for key in (
            "factor", "low_freq_factor", "high_freq_factor")},
            "original_max_position_embeddings": rope.get("original_max_position_embeddings", "count")}
    raise ValueError(f"{fields.source}: unsupported rope_type {rope_type!r}; supported: 'default', 'llama3'")


def _gpt2_fields(fields: Fields) -> dict:
    name = fields.get("activation_function", "name", "gelu_new")
    activation = GPT2_ACTIVATIONS.get(name)
    if activation is None:
        raise ValueError(f"{fields.source}: unsupported GPT-2 activation_function {name!r}; "
                         f"supported: {sorted(GPT2_ACTIVATIONS)}")
    if not fields.get("scale_attn_weights", "flag", True) \
            or fields.get("scale_attn_by_inverse_layer_idx", "flag", False):
        raise ValueError(f"{fields.source}: only GPT-2's standard 1/sqrt(head_dim) attention scaling is supported "
                         "(scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False)")
    return dict(vocab_size=fields.get("vocab_size", "count"), max_seq_len=fields.get("n_positions", "count"),
                num_layers=fields.get("n_layer", "count"), num_heads=fields.get("n_head", "count"),
                hidden_size=fields.get("n_embd", "count"), ffn_hidden_size=fields.get("n_inner", "count", None),
                activation=activation, dropout=fields.get("resid_pdrop", "probability", 0.1),
                attention_dropout=fields.get("attn_pdrop", "probability", 0.1),
                layernorm_epsilon=float(fields.get("layer_norm_epsilon", "positive", 1e-5)),
                init_std=float(fields.get("initializer_range", "positive", 0.02)),
                tie_word_embeddings=fields.get("tie_word_embeddings", "flag", True))


def _llama_fields(fields: Fields, model_type: str) -> dict:
    heads, hidden = fields.get("num_attention_heads", "count"), fields.get("hidden_size", "count")
    act = fields.get("hidden_act", "name", "silu")
    if act != "silu":
        raise ValueError(f"{fields.source}: unsupported hidden_act {act!r}; the Llama family uses 'silu'")
    head_dim = fields.get("head_dim", "count", None)
    qwen3 = model_type in ("qwen3", "qwen3_moe")
    if head_dim not in (None, hidden // heads) and not qwen3:
        raise ValueError(f"{fields.source}: head_dim {head_dim} differs from hidden_size / num_attention_heads "
                         f"= {hidden // heads}")
    if fields.get("attention_bias", "flag", False) or fields.get("mlp_bias", "flag", False):
        raise ValueError(f"{fields.source}: Llama's attention_bias (which includes o_proj) and mlp_bias are "
                         "not supported")
    theta, scaling = _rope(fields)
    max_seq_len = fields.get("max_position_embeddings", "count")
    sliding = fields.get("sliding_window", "count", None)
    if sliding and (model_type == "mistral" or fields.get("use_sliding_window", "flag", False)):
        # Within the window, sliding-window attention is full causal attention.
        max_seq_len = min(max_seq_len, sliding)
    return dict(vocab_size=fields.get("vocab_size", "count"), max_seq_len=max_seq_len,
                num_layers=fields.get("num_hidden_layers", "count"), num_heads=heads, hidden_size=hidden,
                ffn_hidden_size=fields.get("intermediate_size", "count"),
                num_query_groups=fields.get("num_key_value_heads", "count", heads),
                norm="rmsnorm", activation="swiglu", position_embedding="rope", rope_theta=theta,
                rope_scaling=scaling, bias=False, qkv_bias=model_type == "qwen2",
                kv_channels=head_dim if head_dim not in (None, hidden // heads) else None, qk_layernorm=qwen3,
                attention_dropout=fields.get("attention_dropout", "probability", 0.0),
                layernorm_epsilon=float(fields.get("rms_norm_eps", "positive", 1e-6)),
                init_std=float(fields.get("initializer_range", "positive", 0.02)),
                tie_word_embeddings=fields.get("tie_word_embeddings", "flag", False))


def _qwen3_moe_fields(fields: Fields) -> dict:
    values = _llama_fields(fields, "qwen3_moe")
    step, dense = fields.get("decoder_sparse_step", "count", 1), fields.get("mlp_only_layers", "layers", [])
    if step != 1 or dense:
        raise ValueError(f"{fields.source}: only Qwen3-MoE models with experts in every layer are supported "
                         f"(decoder_sparse_step 1, no mlp_only_layers); got {step} and {dense}")
    # The hub's files say num_experts; transformers 5 writes num_local_experts.
    experts = fields.get("num_experts", "count", None) or fields.get("num_local_experts", "count")
    return {**values, "num_moe_experts": experts,
            "moe_router_topk": fields.get("num_experts_per_tok", "count"),
            "moe_ffn_hidden_size": fields.get("moe_intermediate_size", "count"),
            "moe_router_pre_softmax": not fields.get("norm_topk_prob", "flag", False),
            "moe_aux_loss_coeff": float(fields.get("router_aux_loss_coef", "probability", 0.0))}


def _mixtral_fields(fields: Fields) -> dict:
    values = _llama_fields(fields, "mixtral")
    return {**values, "num_moe_experts": fields.get("num_local_experts", "count"),
            "moe_router_topk": fields.get("num_experts_per_tok", "count"),
            "moe_ffn_hidden_size": values["ffn_hidden_size"],
            "moe_aux_loss_coeff": float(fields.get("router_aux_loss_coef", "probability", 0.0))}


def config_from_hf(hf_config, **overrides) -> GPTConfig:
    """The :class:`GPTConfig` of a ``transformers`` config, or of a ``config.json``'s contents
    (a dict); ``overrides``: any GPTConfig field. Builds nothing, runs nothing.

    Example::

        config_from_hf(json.loads(Path("my-llama/config.json").read_text()), sequence_parallel=True)
    """
    if isinstance(hf_config, dict):
        return _config(Fields(hf_config, source="config.json"), overrides)
    return _config(Fields(hf_config.to_dict(), source=type(hf_config).__name__), overrides)


def config_from_hf_dir(path, **overrides) -> GPTConfig:
    """The :class:`GPTConfig` of a local Hugging Face model directory, from its ``config.json``
    read as JSON, every field used checked (type, range). Reads no weights, builds nothing."""
    directory = model_dir(path)
    return _config(Fields(read_config(directory), source=str(directory / "config.json")), overrides)


def _config(fields: Fields, overrides: dict) -> GPTConfig:
    model_type = fields.get("model_type", "name")
    if model_type == "gpt2":
        values = _gpt2_fields(fields)
    elif model_type == "mixtral":
        values = _mixtral_fields(fields)
    elif model_type == "qwen3_moe":
        values = _qwen3_moe_fields(fields)
    elif model_type in LLAMA_FAMILY:
        values = _llama_fields(fields, model_type)
    else:
        raise ValueError(f"{fields.source}: unsupported model_type {model_type!r}; supported: gpt2, "
                         f"{', '.join(LLAMA_FAMILY)} (a model directory's own code is never run)")
    quantization = fields.get("quantization_config", "object", None)
    if quantization is not None:
        raise ValueError(f"{fields.source}: quantized weights (quantization_config, quant_method "
                         f"{quantization.get('quant_method')!r}) are not supported: load the unquantized model")
    try:
        return GPTConfig(**{**values, **overrides})
    except ValueError as exc:
        raise ValueError(f"{fields.source}: {exc}") from None


# The layer number in a Hugging Face tensor name: transformer.h.3.*, model.layers.3.* (or h.3.*).
_LAYER = re.compile(r"(?:^|\.)(?:h|layers)\.(\d+)\.")


def _hf_shapes(config: GPTConfig):
    """(name, shape) of every Hugging Face tensor a model of ``config`` reads, each size paired
    with the config.json field it comes from. Layer by layer: a config of a million layers meets
    its first missing tensor without listing the rest."""
    h, f = ("hidden_size", config.hidden_size), ("intermediate_size", config.ffn_hidden_size)
    v = ("vocab_size", config.vocab_size)
    if family_of(config) == "gpt2":
        h, f = ("n_embd", config.hidden_size), ("n_inner", config.ffn_hidden_size)
        three = ("3 x n_embd", 3 * config.hidden_size)
        positions = ("n_positions", config.max_seq_len)
        yield from (("transformer.wte.weight", (v, h)), ("transformer.wpe.weight", (positions, h)),
                    ("transformer.ln_f.weight", (h,)), ("transformer.ln_f.bias", (h,)))
        if not config.tie_word_embeddings:
            yield "lm_head.weight", (v, h)
        for i in range(config.num_layers):
            t = f"transformer.h.{i}."
            yield from ((t + "attn.c_attn.weight", (h, three)), (t + "attn.c_attn.bias", (three,)),
                        (t + "attn.c_proj.weight", (h, h)), (t + "attn.c_proj.bias", (h,)),
                        (t + "mlp.c_fc.weight", (h, f)), (t + "mlp.c_fc.bias", (f,)),
                        (t + "mlp.c_proj.weight", (f, h)), (t + "mlp.c_proj.bias", (h,)),
                        *((f"{t}{ln}.{p}", (h,)) for ln in ("ln_1", "ln_2") for p in ("weight", "bias")))
        return
    q = ("num_attention_heads x head_dim", config.num_heads * config.head_dim)
    kv = ("num_key_value_heads x head_dim", config.num_query_groups * config.head_dim)
    yield from (("model.embed_tokens.weight", (v, h)), ("model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (v, h)
    experts = ("num_experts" if config.qk_layernorm else "num_local_experts", config.num_moe_experts)
    for i in range(config.num_layers):
        t, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        yield from ((a + "q_proj.weight", (q, h)), (a + "k_proj.weight", (kv, h)), (a + "v_proj.weight", (kv, h)),
                    (a + "o_proj.weight", (h, q)),
                    (t + "input_layernorm.weight", (h,)), (t + "post_attention_layernorm.weight", (h,)))
        if config.qkv_bias:
            yield from ((a + "q_proj.bias", (q,)), (a + "k_proj.bias", (kv,)), (a + "v_proj.bias", (kv,)))
        if config.qk_layernorm:
            d = ("head_dim", config.head_dim)
            yield from ((a + "q_norm.weight", (d,)), (a + "k_norm.weight", (d,)))
        if config.num_moe_experts is None:
            yield from ((t + "mlp.gate_proj.weight", (f, h)), (t + "mlp.up_proj.weight", (f, h)),
                        (t + "mlp.down_proj.weight", (h, f)))
            continue
        # The files' names: transformers fuses the experts once loaded.
        m, fe = t + ("mlp." if config.qk_layernorm else "block_sparse_moe."), \
            ("moe_intermediate_size" if config.qk_layernorm else "intermediate_size", config.moe_ffn_hidden_size)
        yield m + "gate.weight", (experts, h)
        for e in range(config.num_moe_experts):
            gate, up, down = expert_file_names(config, i, e)
            yield from ((gate, (fe, h)), (down, (h, fe)), (up, (fe, h)))


def expert_file_names(config: GPTConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """The files' (gate, up, down) tensors of one expert: Mixtral's ``w1``, ``w3``, ``w2``, or
    Qwen3-MoE's ``gate_proj``, ``up_proj``, ``down_proj``."""
    if config.qk_layernorm:
        m = f"model.layers.{layer}.mlp.experts.{expert}."
        return m + "gate_proj.weight", m + "up_proj.weight", m + "down_proj.weight"
    m = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
    return m + "w1.weight", m + "w3.weight", m + "w2.weight"


def tensor_key(names, name: str) -> str | None:
    # Older GPT-2 files (the hub's "gpt2") name the transformer's tensors without its prefix;
    # Mixtral's files name its router as transformers did before it fused the experts.
    candidates = (name, name.removeprefix("transformer."), name.replace(".mlp.gate.", ".block_sparse_moe.gate."))
    return next((key for key in candidates if key in names), None)


def check_weights(tensors: dict[str, TensorInfo], config: GPTConfig, *, source: str) -> None:
    """Refuse safetensors files that disagree with ``config``: a tensor it reads that is missing,
    of another shape or not floating point (float8, quantized), or a layer beyond its own.
    Headers only: no tensor data is read."""
    layers = "n_layer" if family_of(config) == "gpt2" else "num_hidden_layers"
    for name, dims in _hf_shapes(config):
        key = tensor_key(tensors, name)
        if key is None:
            layer = _LAYER.search(name)
            why = f"layer {layer[1]} of config.json's {layers} {config.num_layers}" if layer else "config.json's model"
            raise ValueError(f"{source}: no safetensors file holds tensor {name!r}, which {why} needs")
        info, expected = tensors[key], [size for _, size in dims]
        if list(info.shape) != expected:
            sizes = ", ".join(f"{field} {size}" for field, size in dict(dims).items())
            raise ValueError(f"{source}/{info.file}: tensor {key!r} has shape {list(info.shape)}; config.json "
                             f"gives {expected} ({sizes})")
        if info.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{source}/{info.file}: tensor {key!r} is {info.dtype}: only F16, BF16, F32 and F64 "
                             "weights are read (float8 or quantized weights would lose their scales)")
    for key, info in tensors.items():
        layer = _LAYER.search(key)
        if layer and int(layer[1]) >= config.num_layers:
            raise ValueError(f"{source}/{info.file}: holds tensor {key!r} of layer {layer[1]}, beyond config.json's "
                             f"{layers} {config.num_layers}")


def check_hf_dir(path) -> GPTConfig:
    """The :class:`GPTConfig` of a local Hugging Face model directory, once its safetensors
    headers (and index) agree with it: see :func:`check_weights`. Reads ``config.json`` and the
    headers only, builds nothing, needs neither ``transformers`` nor ``safetensors``."""
    config = config_from_hf_dir(path)
    check_weights(weight_map(Path(path)), config, source=str(path))
    return config
