"""A run's model config: built from a preset and the shape flags, or taken from a checkpoint or a
Hugging Face directory (every shape flag given must then match it), and checked against TP.

Example::

    config = build_config(args, vocab_size=corpus.vocab_size, saved=None)   # preset + overrides
    check_fits(config, tp=2, seq_len=default_seq_len(args, config))
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..distributed import comm
from .. import invariant
from ..errors import UsageError
from ..models import GPT, GPTConfig
from .checkpoint_format import LATEST, MANIFEST
from .schema import PARAMS_DTYPES

DEFAULT_SEQ_LEN = 128
# GPTConfig fields that only change how the model runs, not its weights: free to differ on resume.
RUNTIME_FIELDS = frozenset({"sequence_parallel", "recompute", "distribute_saved_activations",
                            "gradient_accumulation_fusion", "dropout", "attention_dropout", "params_dtype",
                            "overlap", "interleave", "tp_invariant", "invariant_blocks",
                            "context_parallel_comm"})
# CLI flag -> GPTConfig field, for the model-shape overrides.
MODEL_FLAGS = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads",
               "ffn_hidden": "ffn_hidden_size", "vocab": "vocab_size", "norm": "norm",
               "activation": "activation", "position_embedding": "position_embedding",
               "kv_heads": "num_query_groups", "rope_theta": "rope_theta",
               "num_experts": "num_moe_experts", "moe_router_topk": "moe_router_topk",
               "moe_ffn_hidden": "moe_ffn_hidden_size", "moe_shared_ffn_hidden": "moe_shared_expert_intermediate_size",
               "moe_first_dense_layers": "moe_first_dense_layers", "moe_aux_loss_coeff": "moe_aux_loss_coeff",
               "moe_expert_bias": "moe_router_enable_expert_bias"}


class ConfigMismatch(UsageError):
    """The requested model differs from a checkpoint's; the message names the fields."""


def config_to_json(config: GPTConfig) -> dict:
    data = dataclasses.asdict(config)
    data["params_dtype"] = str(config.params_dtype).removeprefix("torch.")
    return data


def config_from_json(data: dict) -> GPTConfig:
    data = dict(data)
    data["params_dtype"] = PARAMS_DTYPES[data.get("params_dtype", "float32")]
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigMismatch(f"checkpoint config has fields this tensorpar does not know: {unknown}")
    return GPTConfig(**data)


# Preset fields whose GPTConfig default derives from another field: they follow an override of it.
DERIVED_FIELDS = {"ffn_hidden_size": "hidden_size", "num_query_groups": "num_heads", "qkv_bias": "bias"}


def _preset_fields(name: str, overridden) -> dict:
    """A preset's GPTConfig fields, less those derived from a field in ``overridden``."""
    fields = dataclasses.asdict(GPTConfig.preset(name))
    return {k: v for k, v in fields.items() if DERIVED_FIELDS.get(k) not in overridden}


def requested_fields(args) -> dict:
    """Shape fields of GPTConfig the command line asks for explicitly (preset fields included)."""
    explicit = {MODEL_FLAGS[flag]: getattr(args, flag) for flag in MODEL_FLAGS
                if getattr(args, flag, None) is not None}
    fields = {}
    if args.model is not None:
        fields.update(_preset_fields(args.model, explicit))
        fields.pop("vocab_size")
    fields.update(explicit)
    # max_seq_len comes from --seq-len (fresh runs) and may exceed the length trained on.
    return {k: v for k, v in fields.items() if k not in RUNTIME_FIELDS and k != "max_seq_len"}


def build_config(args, *, vocab_size: int, saved: dict | None, origin: str = "the checkpoint") -> GPTConfig:
    """The model config: ``saved`` (the resumed checkpoint's, or the ``--init-from-hf``
    model's, named by ``origin``) if given, else preset + overrides.

    With ``saved``, every explicitly requested shape field must match it.
    """
    requested = requested_fields(args)
    if requested.get("vocab_size", vocab_size) < vocab_size:
        raise ConfigMismatch(f"--vocab {requested['vocab_size']} is smaller than the data's vocabulary "
                             f"({vocab_size} token ids)")
    runtime = dict(sequence_parallel=args.sp, recompute=args.recompute, dropout=args.dropout,
                   attention_dropout=getattr(args, "attention_dropout", None),
                   gradient_accumulation_fusion=args.grad_fusion, overlap=args.overlap, interleave=args.interleave,
                   tp_invariant=args.tp_invariant, invariant_blocks=args.invariant_blocks,
                   context_parallel_comm=getattr(args, "cp_comm", "p2p"))
    if saved is None:
        base = {k: v for k, v in _preset_fields(args.model or "tiny", requested).items()
                if k not in RUNTIME_FIELDS}
        base["max_seq_len"] = args.seq_len or (base["max_seq_len"] if args.model else DEFAULT_SEQ_LEN)
        config = _config(**{**base, "vocab_size": vocab_size, **requested, **runtime})
        if args.rope_theta is not None and config.position_embedding != "rope":
            raise UsageError(f"--rope-theta {args.rope_theta} is the base of rotary positions, and this model's "
                             f"are learned: add --position-embedding rope, or drop --rope-theta")
        return config
    config = config_from_json(saved)
    if vocab_size > config.vocab_size:
        raise ConfigMismatch(f"the data has token ids up to {vocab_size - 1}, beyond {origin}'s "
                             f"vocab_size {config.vocab_size}")
    mismatched = [f"{name}: checkpoint {getattr(config, name)!r}, requested {value!r}"
                  for name, value in sorted(requested.items()) if getattr(config, name) != value]
    if mismatched:
        raise ConfigMismatch(f"{origin}'s model config differs from the one requested: "
                             + "; ".join(mismatched))
    try:
        return dataclasses.replace(config, **runtime)
    except ValueError as exc:
        raise UsageError(f"invalid model: {exc}") from exc


def _config(**fields) -> GPTConfig:
    """A fresh run's GPTConfig; its complaints name the flags."""
    hidden, heads = fields["hidden_size"], fields["num_heads"]
    if hidden % heads:
        raise UsageError(f"the hidden size {hidden} (--hidden) is not divisible by the {heads} attention "
                         "heads (--heads)")
    kv_heads = fields.get("num_query_groups")
    if kv_heads is not None and heads % kv_heads:
        raise UsageError(f"the {heads} attention heads (--heads) are not a multiple of the {kv_heads} key/value "
                         "heads (--kv-heads)")
    try:
        return GPTConfig(**fields)
    except ValueError as exc:
        raise UsageError(f"invalid model: {exc}") from exc

def hf_init_config(directory: str) -> dict:
    """The GPT config (as JSON) of the Hugging Face model directory ``--init-from-hf`` names,
    once its config.json and safetensors headers agree (nothing built, nothing run or fetched)."""
    import importlib.util

    from ..models.hf_files import check_hf_dir

    path = Path(directory)
    if (path / LATEST).is_file() or (path / MANIFEST).is_file():
        raise UsageError(f"--init-from-hf {directory} is a tensorpar run, not a Hugging Face model: use --resume "
                         f"{directory} to continue it, or --init-from {directory} for its weights only")
    if importlib.util.find_spec("safetensors") is None:
        raise UsageError("--init-from-hf needs safetensors: pip install 'tensorpar[hf]'")
    try:
        return config_to_json(check_hf_dir(directory))
    except (OSError, ValueError) as exc:
        raise UsageError(f"--init-from-hf: {exc}") from None

def default_seq_len(args, config: GPTConfig) -> int:
    """``--seq-len``, else the model's max_seq_len (a Hugging Face model's, capped at 128)."""
    if args.seq_len is not None:
        return args.seq_len
    return min(config.max_seq_len, DEFAULT_SEQ_LEN) if args.init_from_hf else config.max_seq_len


def positions_note(args, config: GPTConfig) -> str | None:
    """What a fresh run's ``--seq-len`` beyond its preset's length does to learned positions (a
    table row per position: more parameters), or None."""
    if args.resume or args.init_from or args.init_from_hf or args.model is None or args.seq_len is None \
            or config.position_embedding != "learned":
        return None
    preset = GPTConfig.preset(args.model).max_seq_len
    if args.seq_len <= preset:
        return None
    return (f"--seq-len {args.seq_len}: the {args.model} preset's learned positions grow from {preset:,} to "
            f"{args.seq_len:,} rows ({(args.seq_len - preset) * config.hidden_size:,} parameters more)")


def check_fits(config: GPTConfig, *, tp: int, seq_len: int | None) -> None:
    """What TP needs of the model (a query head per rank), and a training sequence the model's
    positions cover (``seq_len`` None: generation, whose prompts have any length)."""
    if config.num_heads < tp:
        raise UsageError(f"the model's {config.num_heads} attention heads are fewer than --tp {tp}: every rank "
                         "needs a query head")
    if seq_len is not None and seq_len > config.max_seq_len:
        raise UsageError(f"--seq-len {seq_len} is longer than the model's max_seq_len {config.max_seq_len}")
    if config.tp_invariant:
        try:
            invariant.check_gpt_sizes(config, tp_size=tp, seq_len=seq_len)
        except ValueError as exc:
            raise UsageError(f"--tp-invariant: {exc}") from None


def count_parameters(model: GPT) -> int:
    """Parameters of the unpadded TP=1 model: the same number at every TP size."""
    tp = comm.group_size(model.tp_group)
    ep = 1 if model.parallel.ep_group is None else comm.group_size(model.parallel.ep_group)
    total = sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else ep if getattr(p, "expert_parallel", False)
                             else 1) for p in model.parameters())
    padding = model.padded_vocab_size - model.config.vocab_size
    heads = 1 if model.config.tie_word_embeddings else 2  # the embedding, and an untied LM head
    return total - padding * model.config.hidden_size * heads
