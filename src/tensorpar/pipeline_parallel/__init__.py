"""Pipeline parallelism on ``torch.distributed.pipelining``: a GPT cut into stages and run by one
of torch's schedules, with the loss, every gradient and the reported loss of PP=1's gradient
accumulation over the same micro-batches.

Example::

    from tensorpar import pipeline_parallel as pipeline

    layout = pipeline.stage_layout(config.num_layers, pp_size=2, schedule="1f1b")
    stages = pipeline.build_stages(config, layout, pp_group=pp_group, tp_group=tp_group)
    schedule = pipeline.PipelineSchedule(stages, layout, schedule="1f1b", microbatches=4, pp_group=pp_group)
    loss = schedule.step(tokens, labels)
"""

from .microbatch_grads import MicroBatchGrads
from .plan import (SCHEDULES, ScheduleSpec, StageLayout, check_invariant, check_microbatches, stage_layout,
                   stages_per_rank)
from .schedule import PipelineSchedule
from .stages import build_stages, full_model_name, fully_shard_stages
from .tied_grads import ShardedTiedGrads
from .torch_stage import TorchStage, require_torch_pipelining

__all__ = ["SCHEDULES", "MicroBatchGrads", "PipelineSchedule", "ScheduleSpec", "ShardedTiedGrads", "StageLayout",
           "TorchStage", "build_stages", "check_invariant", "check_microbatches", "full_model_name",
           "fully_shard_stages", "require_torch_pipelining", "stage_layout", "stages_per_rank"]
