"""Pipeline parallelism on ``torch.distributed.pipelining``: a GPT cut into stages and run by one
of torch's schedules, with the loss, every gradient and the reported loss of PP=1's gradient
accumulation over the same micro-batches.

Example::

    from tensorpar import pipeline

    layout = pipeline.stage_layout(config.num_layers, pp_size=2, schedule="1f1b")
    stages = pipeline.build_stages(config, layout, pp_group=pp_group, tp_group=tp_group)
    schedule = pipeline.PipelineSchedule(stages, layout, schedule="1f1b", microbatches=4, pp_group=pp_group)
    loss = schedule.step(tokens, labels)
    pipeline.bubble_fraction("1f1b", pp_size=2, microbatches=4)   # (0.2, '(P-1)/(M+P-1) = 1/5')
"""

from .cost import (PipelineCost, RankTraffic, bubble_fraction, in_flight, pipeline_cost, pipeline_memory,
                   rank_collectives)
from .microbatch_grads import MicroBatchGrads
from .plan import (SCHEDULES, ScheduleSpec, StageLayout, check_invariant, check_microbatches, stage_layout,
                   stages_per_rank)
from .schedule import PipelineSchedule
from .stages import build_stages, full_model_name, fully_shard_stages
from .tied_grads import ShardedTiedGrads
from .torch_stage import TorchStage, require_torch_pipelining

__all__ = ["SCHEDULES", "MicroBatchGrads", "PipelineCost", "PipelineSchedule", "RankTraffic", "ScheduleSpec",
           "ShardedTiedGrads",
           "StageLayout", "TorchStage", "bubble_fraction", "build_stages", "check_invariant", "check_microbatches",
           "full_model_name", "fully_shard_stages", "in_flight", "pipeline_cost", "pipeline_memory", "rank_collectives",
           "require_torch_pipelining", "stage_layout", "stages_per_rank"]
