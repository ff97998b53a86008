"""What a resume continues: the run's settings, and the line that says how the run goes on.

A resumed run keeps every setting it ran with (:data:`RUN_SETTINGS`: data, sequence length,
seed, dtype, logging, evaluation, ...) unless the command line gives another value; the train
flags default to None so that a value given can be told from one left out. The header names
the step, the TP/DP (and CP, PP) sizes before and after, the data, the schedule and every
value changed.

Example::

    continue_settings(args, meta)            # fills what the user left out
    header, note = resume_header(args, meta, ckpt=ckpt, tp=2, dp=1, data="--data corpus.bin")
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from .schedule import schedule_note

# flag -> a new run's value (``save_every`` None: at every evaluation, whatever ``eval_every`` is)
RUN_SETTINGS = {"data": None, "seq_len": None, "seed": 1234, "dtype": "fp32", "dropout": 0.0,
                "attention_dropout": None, "sp": False,
                "recompute": False, "grad_fusion": False, "overlap": "off", "interleave": 1, "tp_invariant": False,
                "invariant_blocks": 8, "fsdp": False, "dp_replicate": 1,
                "weight_decay": 0.1, "clip_grad": 1.0, "eval_every": 100, "eval_iters": 10, "log_every": 10,
                "save_every": None, "keep_last": 3, "tensorboard": False, "wandb": False}


def _saved_settings(meta: dict | None) -> dict:
    """The resumed run's settings (what a tensorpar 0.2 checkpoint recorded of them)."""
    if meta is None:
        return {}
    if "settings" in meta:
        return meta["settings"]
    source = meta.get("data", {}).get("source")
    return {"data": None if source == "embedded" else source, "seed": meta.get("data", {}).get("seed"),
            "dtype": meta.get("dtype")}


def _check_recorded_data(meta: dict) -> None:
    """Refuse ``settings.data`` unless it is the data ``data.source`` records (that path made
    absolute, or the embedded corpus) and still exists."""
    data, source = meta["settings"].get("data"), meta["data"]["source"]
    where = "the resumed run's meta.json: field 'settings.data'"
    if (data is None) != (source == "embedded") or data is not None and (
            Path(data).name != Path(source).name and data_path(source) != data):
        raise UsageError(f"{where} is {data!r}, not the data its field 'data.source' records ({source!r}); "
                         "pass --data to name the data")
    if data is not None and not Path(data).exists():
        raise UsageError(f"{where} is {data!r}, which no longer exists; pass --data to name the data")


def continue_settings(args, meta: dict | None) -> None:
    """Fill each of :data:`RUN_SETTINGS` not given with the resumed run's (``meta``), else a new run's."""
    saved = _saved_settings(meta)
    if args.data is None and meta is not None and "settings" in meta:
        _check_recorded_data(meta)
        args.data_from_checkpoint = meta["settings"].get("data") is not None
    for name, default in RUN_SETTINGS.items():
        if getattr(args, name) is None:
            setting = saved.get(name)
            setattr(args, name, default if setting is None else setting)


def check_resumed_data(args, meta: dict, data: dict) -> None:
    """Refuse to train on data a checkpoint alone named (no ``--data``) unless its token ids are the
    ones the run recorded (count and SHA-256): a crafted ``meta.json`` cannot point a resume at
    another file. A checkpoint from before 0.5 recorded no hash: its path, checked as before."""
    recorded = meta.get("data", {})
    if not getattr(args, "data_from_checkpoint", False) or "sha256" not in recorded:
        return
    tokens, digest = data["tokens"], data["sha256"]  # this run's data, as its checkpoints will record it
    if (tokens, digest) != (recorded.get("tokens"), recorded["sha256"]):
        raise UsageError(f"the resumed run's meta.json names the data {args.data}, whose {tokens:,} token ids "
                         f"(SHA-256 {digest[:12]}...) are not the {recorded.get('tokens', 0):,} the run trained on "
                         f"(SHA-256 {recorded['sha256'][:12]}...): pass --data to name the data")


def data_path(data: str | None) -> str | None:
    """``--data`` as recorded: absolute, so that a resume from another directory finds it."""
    return None if data is None else str(Path(data).resolve())


def _show(value) -> str:
    if value is None:  # only --data's: the embedded corpus
        return "embedded"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def setting_changes(args, meta: dict) -> list[str]:
    """``--flag before -> after`` for each setting, schedule and batch value that differs from the resumed run's."""
    schedule = meta.get("schedule", {})
    saved = {**_saved_settings(meta), "lr": schedule.get("lr"), "min_lr": schedule.get("min_lr"),
             "warmup": schedule.get("warmup"), "lr_decay_steps": schedule.get("decay_steps"),
             "global_batch": meta.get("global_batch"), "micro_batch": meta.get("micro_batch")}
    changes = []
    for name, before in saved.items():
        now = data_path(args.data) if name == "data" else getattr(args, name)
        if (before is not None or name == "data") and now != before:  # None: not recorded (0.2), or embedded data
            changes.append(f"--{name.replace('_', '-')} {_show(before)} -> {_show(now)}")
    return changes


def resume_header(args, meta: dict, *, ckpt, tp: int, dp: int, data: str, cp: int = 1,
                  pp: int = 1) -> tuple[str, str | None]:
    """Rank 0's line on resume (where the run continues, on what, what changed; CP and PP when
    either run has them) and the schedule's note (:func:`~.schedule.schedule_note`), if it has one."""
    start, world = meta["step"], meta["world"]
    changes = setting_changes(args, meta)
    saved_cp, saved_pp = world.get("cp", 1), world.get("pp", 1)
    context = f", CP {saved_cp}->{cp}" if max(saved_cp, cp) > 1 else ""
    pipeline = f", PP {saved_pp}->{pp}" if max(saved_pp, pp) > 1 else ""
    header = (f"resuming {ckpt} at step {start} of {args.steps}: TP {world['tp']}->{tp}{context}, "
              f"DP {world['dp']}->{dp}{pipeline}; "
              f"data: {data} from step {start}; schedule lr {args.lr:g}, warmup {args.warmup}, cosine to "
              f"{args.min_lr:g} at step {args.lr_decay_steps}; "
              + (f"changed: {', '.join(changes)}" if changes else "no setting changed"))
    return header, schedule_note(args, start=start)
