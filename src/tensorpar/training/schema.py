"""The JSON files a user hands ``tensorpar`` checked against their schemas before any rank starts:
a checkpoint's ``config.json`` and ``meta.json``, a token file's sidecar.

A schema maps each field to a :class:`Rule` (or a tuple of alternatives, or a nested schema);
:func:`check_fields` raises :class:`SchemaError` naming the file, the field and its value.
Nothing read is looked up by name (dtypes come from allow-lists) or executed.

Example::

    check_fields(Path("x.json"), {"step": -5}, {"step": integer(0)})
    # SchemaError: x.json: field 'step' is -5; expected an integer >= 0
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from ..models.config import GPTConfig


class SchemaError(ValueError):
    """A JSON file that does not match its schema; the message names the file and field."""


class Rule(NamedTuple):
    """A JSON value's test and what it expects, for the message."""

    test: Callable[[object], bool]
    what: str


def integer(low: int | None = None, high: int | None = None) -> Rule:
    bound = "" if low is None else f" >= {low}" if high is None else f" in [{low}, {high}]"
    return Rule(lambda v: type(v) is int and (low is None or v >= low) and (high is None or v <= high),
                f"an integer{bound}")


def number(low: float, *, above: bool = False) -> Rule:
    return Rule(lambda v: type(v) in (int, float) and math.isfinite(v) and (v > low if above else v >= low),
                f"a finite number {'>' if above else '>='} {low:g}")


def choice(*values) -> Rule:
    return Rule(lambda v: isinstance(v, str) and v in values, f"one of {list(values)}")


TEXT = Rule(lambda v: isinstance(v, str), "a string")
FLAG = Rule(lambda v: type(v) is bool, "true or false")
NULL = Rule(lambda v: v is None, "null")


def check_fields(path: Path, data: object, schema: dict, *, exact: bool = False, optional=(),
                 prefix: str = "") -> None:
    """Every field of ``schema`` present in ``data`` (those in ``optional`` may be absent) and as
    its rule says (a nested field of ``optional`` as ``"outer.inner"``). Fields the schema does not
    name are refused if ``exact``, else left to their readers."""
    where = f"field {prefix.rstrip('.')!r}" if prefix else "the file"
    if not isinstance(data, dict):
        raise SchemaError(f"{path}: {where} is a JSON {_json_kind(data)}, expected an object")
    unknown = sorted(set(data) - set(schema)) if exact else []
    if unknown:
        raise SchemaError(f"{path}: field {prefix + unknown[0]!r} is not one of {sorted(schema)}")
    for name, rule in schema.items():
        field = prefix + name
        if name not in data:
            if name in optional:
                continue
            raise SchemaError(f"{path}: field {field!r} is missing")
        if isinstance(rule, dict):
            inner = {o.removeprefix(f"{name}.") for o in optional if o.startswith(f"{name}.")}
            check_fields(path, data[name], rule, exact=exact, optional=inner, prefix=f"{field}.")
            continue
        rules = (rule,) if isinstance(rule, Rule) else rule
        if not any(r.test(data[name]) for r in rules):
            raise SchemaError(f"{path}: field {field!r} is {data[name]!r}; expected "
                              + " or ".join(r.what for r in rules))


def _json_kind(value: object) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


# --- a checkpoint's meta.json and config.json ---------------------------------------------

_RNG_NAME = re.compile(r"^(cpu|cuda|tracker\.[\w.-]+)$")
RNG_SPEC = Rule(lambda v: isinstance(v, dict) and 0 < len(v) <= 16 and all(
    isinstance(k, str) and _RNG_NAME.match(k) and isinstance(x, list) and len(x) <= 4
    and all(type(n) is int and n >= 0 for n in x) for k, x in v.items()),
    "an object of at most 16 RNG names (cpu, cuda, tracker.NAME) and their shapes")
# The world sizes a checkpoint may name: the loader expects every saving rank's RNG entries, so a
# crafted "ranks" must not make it build a billion of them.
MAX_RANKS = 1 << 16
META_SCHEMA = {
    "step": integer(0), "tokens_seen": integer(0), "steps": integer(1),
    "global_batch": integer(1), "micro_batch": integer(1),
    "schedule": {"lr": number(0, above=True), "min_lr": number(0), "warmup": integer(0),
                 "decay_steps": integer(1)},
    "data": {"position": integer(0), "seed": integer(), "source": TEXT, "tokens": integer(1),
             "sha256": Rule(lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None,
                            "64 lowercase hex digits")},
    "world": {"tp": integer(1, MAX_RANKS), "dp": integer(1, MAX_RANKS), "pp": integer(1, MAX_RANKS),
              "cp": integer(1, MAX_RANKS), "dp_replicate": integer(1, MAX_RANKS), "ep": integer(1, MAX_RANKS)},
    "dtype": choice("fp32", "bf16"), "tokenizer": (TEXT, NULL), "ranks": integer(1, MAX_RANKS),
    "rng": RNG_SPEC, "config_sha256": Rule(lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v)
                                            is not None, "64 lowercase hex digits"),
}
_PROBABILITY = Rule(lambda v: type(v) in (int, float) and 0 <= v < 1, "a number in [0, 1)")
# What a 0.3+ run records of its settings (resume.RUN_SETTINGS), each as the train flag takes it;
# every one optional, since a version may record fewer.
SETTINGS_SCHEMA = {
    "data": (TEXT, NULL), "seq_len": (integer(1), NULL), "seed": integer(0, 2**32 - 1),
    "dtype": choice("fp32", "bf16"), "dropout": _PROBABILITY, "attention_dropout": (_PROBABILITY, NULL),
    "sp": FLAG, "recompute": FLAG, "grad_fusion": FLAG, "tp_invariant": FLAG, "invariant_blocks": integer(1),
    "tensorboard": FLAG,
    "fsdp": FLAG, "dp_replicate": integer(1, MAX_RANKS),
    "overlap": (choice("off", "auto"), integer(1)), "interleave": integer(1),
    "weight_decay": number(0), "clip_grad": number(0), "eval_every": integer(0), "eval_iters": integer(1),
    "log_every": integer(1), "save_every": (integer(0), NULL), "keep_last": integer(0), "wandb": FLAG,
}
# The parameter dtypes a config may name: never looked up on torch by name.
PARAMS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# GPTConfig's field types as JSON values; its str fields are checked by GPTConfig's own choices.
_SCALING = Rule(lambda v: isinstance(v, dict) and all(
    isinstance(x, str) or type(x) in (int, float) and math.isfinite(x) for x in v.values()),
    "an object of strings and numbers")
_CONFIG_RULES = {int: integer(1), float: number(0), bool: FLAG, str: TEXT, dict: _SCALING,
                 type(None): NULL, torch.dtype: choice(*PARAMS_DTYPES)}


def check_meta(path: Path, meta: object, *, step: int | None = None) -> None:
    """Refuse a ``meta.json`` (of the directory ``step_{step}``) unlike what a save writes."""
    # world.pp, world.cp, world.ep: only a pipeline-, context- or expert-parallel run records them
    check_fields(path, meta, META_SCHEMA, optional={"settings", "config_sha256", "world.pp", "world.cp", "world.ep", "data.tokens",
                                                    "data.sha256",
                                                                "world.dp_replicate"})
    if "settings" in meta:
        check_fields(path, meta["settings"], SETTINGS_SCHEMA, optional=set(SETTINGS_SCHEMA), prefix="settings.")
    world = meta["world"]
    pp, cp = world.get("pp", 1), world.get("cp", 1)
    if meta["ranks"] != world["tp"] * cp * world["dp"] * pp:
        raise SchemaError(f"{path}: field 'ranks' is {meta['ranks']}, but field 'world' is TP {world['tp']} x "
                          + (f"CP {cp} x " if cp > 1 else "") + f"DP {world['dp']}" + (f" x PP {pp}" if pp > 1 else ""))
    if step is not None and meta["step"] != step:
        raise SchemaError(f"{path}: field 'step' is {meta['step']}, but the directory is step_{step}")


def check_config(path: Path, config: object) -> None:
    """Refuse a ``config.json`` that does not describe a :class:`GPTConfig`, naming the field."""
    hints = typing.get_type_hints(GPTConfig)
    fields = dataclasses.fields(GPTConfig)
    schema = {f.name: tuple(_CONFIG_RULES[t] for t in typing.get_args(hints[f.name]) or (hints[f.name],))
              for f in fields}
    schema["moe_first_dense_layers"] = integer(0)  # the one count that may be 0
    optional = {f.name for f in fields if f.default is not dataclasses.MISSING}
    check_fields(path, config, schema, exact=True, optional=optional)
    try:
        GPTConfig(**{**config, "params_dtype": PARAMS_DTYPES[config.get("params_dtype", "float32")]})
    except (ValueError, TypeError) as exc:
        raise SchemaError(f"{path}: {exc}") from None
