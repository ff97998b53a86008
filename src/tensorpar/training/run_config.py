"""The settings of one training run: each ``tensorpar train`` flag as a typed field, and what
resolving them adds.

The command line and ``--config`` give the flags (their defaults and checks live with the
parser, ``tensorpar.cli.training_cli``); :meth:`RunConfig.from_flags` takes them once. Where a
run resolves what was left unset (a resumed run's recorded settings, the tokenizer, the
schedule, the batch), it fills in these fields; the rest of the run reads them. The run
directory's ``config.toml`` and ``--print-config`` are its serialisation
(``tensorpar.cli.config_file.dumps``). A field set that the class does not declare raises, so a
misspelt setting cannot pass unseen.

Example::

    run = parse_train_args(["--steps", "20", "--tp", "1"])     # a RunConfig
    run.steps, run.lr                                          # 20, None (the schedule resolves it)
    train(run)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class RunConfig:
    # The world of processes and its layout (None: resolved from the world size).
    nproc: int | None
    tp: int | None
    timeout: float
    pp: int
    pp_schedule: str
    virtual_stages: int | None
    cp: int
    cp_comm: str
    ep: int
    fsdp: bool | None
    dp_replicate: int | None
    fsdp_min_unit_mib: float
    # Where the run starts and what it writes.
    steps: int
    out: str | None
    resume: str | None
    overwrite: bool
    init_from: str | None
    init_from_hf: str | None
    save_every: int | None
    keep_last: int | None
    eval_every: int | None
    eval_iters: int | None
    log_every: int | None
    no_progress: bool
    tensorboard: bool | None
    wandb: bool | None
    # The data and the batch.
    data: str | None
    tokenizer: str | None
    seed: int | None
    seq_len: int | None
    micro_batch: int | None
    global_batch: int | None
    grad_accum: int | None
    # The model (None: the preset's, or the checkpoint's).
    model: str | None
    layers: int | None
    hidden: int | None
    heads: int | None
    kv_heads: int | None
    ffn_hidden: int | None
    rope_theta: float | None
    vocab: int | None
    norm: str | None
    activation: str | None
    position_embedding: str | None
    dropout: float | None
    attention_dropout: float | None
    num_experts: int | None
    moe_router_topk: int | None
    moe_ffn_hidden: int | None
    moe_shared_ffn_hidden: int | None
    moe_first_dense_layers: int | None
    moe_aux_loss_coeff: float | None
    moe_expert_bias: bool | None
    # How it computes.
    sp: bool | None
    recompute: bool | None
    overlap: int | str | None
    interleave: int | None
    compile: bool
    tp_invariant: bool | None
    invariant_blocks: int | None
    grad_fusion: bool | None
    dtype: str | None
    # The optimizer and its schedule.
    lr: float | None
    min_lr: float | None
    warmup: int | None
    lr_decay_steps: int | None
    weight_decay: float | None
    clip_grad: float | None
    # What resolving adds.
    given_settings: list[str] | None = None  # what the header shows (None, a library call: every setting)
    run_config: str | None = None  # config.toml's text, as the command resolved it
    micro_batch_chosen: bool = False  # the micro-batch the PP schedule needed, not the one given
    data_from_checkpoint: bool = False  # --data left out: a resumed run's recorded data

    @classmethod
    def from_flags(cls, flags) -> RunConfig:
        """The run's settings from a parsed ``train`` command line (``argparse.Namespace``). A flag
        with no field here is a ``TypeError``: a flag added to the parser needs its field."""
        return cls(**{name: value for name, value in vars(flags).items() if name not in _THE_COMMANDS})

    def settings(self) -> dict[str, object]:
        """{flag name with dashes: value} of the run's settings, what resolving added left out."""
        return {field.name.replace("_", "-"): getattr(self, field.name) for field in dataclasses.fields(self)
                if field.name not in _RESOLVED}


_RESOLVED = frozenset({"given_settings", "run_config", "micro_batch_chosen", "data_from_checkpoint"})
# The command's own entries of a parsed command line: how it runs, not what.
_THE_COMMANDS = frozenset({"command", "func", "config", "print_config", "debug"})
