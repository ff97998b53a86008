"""A GPT cut into pipeline stages: this rank's stages only, with the whole model's weights.

Stage ``s`` is a :class:`~tensorpar.models.GPT` holding the blocks ``layout.layers[s]``, the
embedding on the first stage and the final norm, LM head and vocab-parallel loss on the last.
Each part of the GPT is initialised from its own seed (one draw of the default stream for the
whole model), so with the same ``torch.manual_seed`` a stage's block ``i`` is the PP=1 model's
block ``i``, at every TP size. With tied embeddings (GPT-2) the last stage holds a copy of the
embedding's weight as its head weight, initialised alike, marked ``shared`` (Megatron's mark:
the grad norm counts it once); the schedule sums the two gradients. Every parameter carries
its ``pipeline_stage``. Where the first and the
last stage are on one rank (the V schedules) the head uses the embedding's parameter itself.

Example::

    torch.manual_seed(1234)
    layout = stage_layout(config.num_layers, pp_size=2, schedule="1f1b")
    stages = build_stages(config, layout, pp_group=pp_group, tp_group=tp_group)
    fully_shard_stages(stages, dp_group=dp_group)   # optional: FSDP2 over DP, each stage its own root
"""

from __future__ import annotations

import torch

from ..distributed import comm
from ..errors import UsageError
from ..data_parallel.fsdp import MIN_UNIT_MIB, fully_shard
from ..models import GPT, GPTConfig
from .plan import StageLayout

_UNSUPPORTED = {"gradient_accumulation_fusion": "gradient-accumulation fusion"}


def build_stages(config: GPTConfig, layout: StageLayout, *, pp_group, tp_group=None, cp_group=None,
                 device=None) -> list[GPT]:
    """The GPT stages this rank of ``pp_group`` runs, in stage order (seed every rank alike first);
    over ``cp_group`` each runs this CP rank's chunks of every sequence."""
    named = [what for name, what in _UNSUPPORTED.items() if getattr(config, name)]
    if named:
        raise UsageError(f"pipeline parallelism does not support {' or '.join(named)} yet")
    if comm.group_size(pp_group) != layout.pp_size:
        raise UsageError(f"the stage layout is for PP={layout.pp_size}, the PP group has "
                         f"{comm.group_size(pp_group)} ranks")
    state = torch.get_rng_state()
    stages = []
    for s in layout.stages_of(comm.group_rank(pp_group)):
        # Every stage draws the model's one seed from the same state, as the PP=1 GPT does.
        torch.set_rng_state(state)
        stages.append(GPT(config, tp_group=tp_group, cp_group=cp_group, device=device, layers=layout.layers[s],
                          pre_process=s == 0, post_process=s == layout.num_stages - 1))
    for s, stage in zip(layout.stages_of(comm.group_rank(pp_group)), stages):
        for param in stage.parameters():
            param.pipeline_stage = s  # the invariant mode's grad norm adds in PP=1's parameter order
    if config.tie_word_embeddings and layout.num_stages > 1 and stages[-1].post_process:
        head = stages[-1].lm_head
        if stages[0].pre_process:
            head.weight = stages[0].embedding.word.weight
        else:
            head.weight.shared = True
    return stages


def full_model_name(stage: GPT, name: str) -> str:
    """The PP=1 GPT's name of ``stage``'s parameter ``name``: the stage numbers its blocks from 0,
    and its tied head weight is the embedding's.

    Example::

        full_model_name(stage, "blocks.0.mlp.fc.weight")   # "blocks.4.mlp.fc.weight" if stage.layers is [4, 5, 6, 7]
    """
    if name.startswith("blocks."):
        local, rest = name[len("blocks."):].split(".", 1)
        return f"blocks.{stage.layers[int(local)]}.{rest}"
    if name == "lm_head.weight" and stage.config.tie_word_embeddings:
        return "embedding.word.weight"
    return name


def fully_shard_stages(stages: list[GPT], *, dp_group=None, mp_policy=None,
                       min_unit_mib: float = MIN_UNIT_MIB) -> list[GPT]:
    """Shard each of this rank's stages over ``dp_group`` (default: the DP group) with
    :func:`tensorpar.fully_shard`: its blocks in units of ``min_unit_mib``, the stage the root.
    Call it before :class:`~tensorpar.pipeline_parallel.PipelineSchedule`; torch's stages then hold every
    backward's gradients unreduced and reduce-scatter them once, after the step's last micro-batch.

    Each unit stays gathered from its first forward to the step's end (torchtitan's choice
    under PP too): resharding after each forward would gather it again for every micro-batch.

    Example::

        stages = fully_shard_stages(build_stages(config, layout, pp_group=pp_group), dp_group=dp_group)
    """
    if len(stages) > 1 and stages[-1].post_process and stages[0].pre_process \
            and stages[-1].lm_head.weight is stages[0].embedding.word.weight:
        raise UsageError("FSDP cannot shard the tied embedding that the first and the last stage share on one "
                         "rank (the V schedules zbv and dualpipev): untie the embeddings or choose another schedule")
    for stage in stages:
        fully_shard(stage, dp_group=dp_group, min_unit_mib=min_unit_mib, reshard_after_forward=False,
                    mp_policy=mp_policy)
    return stages
