"""The invariant mode's gradients under a pipeline: each micro-batch's gradient taken apart as
the schedule's backward makes it and handed on in micro-batch order, whatever order the
schedule runs the backwards in. An expert's gradients of its other sources' micro-batches
(``other_source_grads``, :func:`tensorpar.data_parallel.grads.take_source_grads`) travel with its own.

torch's ``PipelineStage`` lets autograd add every micro-batch's gradient into ``.grad``. Here
a hook on each parameter takes the gradient of the micro-batch whose backward runs (the id
:class:`~.torch_stage.TorchStage` records, the schedule's own, never the arrival order) out of
``.grad`` and passes micro-batch ``k`` to ``sink(param, grad)`` once ``0 .. k-1`` have been:
a ``DataParallelGradReducer(micro_batches=)``'s ``add_grad`` sums them in the tree of PP=1
(:class:`~tensorpar.distributed.tree_reduce.HalvingTree`); without a sink they are added into ``.grad`` in
that order, as PP=1's autograd adds them. A tied embedding's two copies (first and last stage)
keep their micro-batches' gradients until :meth:`finish`, which gathers them over the embedding
group and hands on, per micro-batch, the sum of the two: what PP=1's autograd accumulates from
the weight's two uses before its hook sees it (one add, the same bits in either order).

Example::

    grads = MicroBatchGrads(torch_stages, microbatches=4, tied=[weight], embedding_group=group)
    grads.sink = reducer.add_grad
    ...                   # the schedule's step
    grads.finish()        # the tied copies' sums, and every micro-batch accounted for
"""

from __future__ import annotations

import torch

from ..distributed import comm
from .torch_stage import TorchStage


class MicroBatchGrads:
    """Takes each micro-batch's gradient of every parameter of ``stages`` apart (see above);
    ``tied``: this rank's copies of a tied embedding, summed with the other copy's per micro-batch."""

    def __init__(self, stages: list[TorchStage], *, microbatches: int, tied=(), embedding_group=None) -> None:
        self.microbatches, self.embedding_group = microbatches, embedding_group
        self.sink = None
        self._owner: dict[int, TorchStage] = {}
        self._params: list[torch.nn.Parameter] = []
        for stage in stages:
            for param in stage.submod.parameters():
                if id(param) not in self._owner and param.requires_grad:
                    self._owner[id(param)] = stage
                    self._params.append(param)
        self._tied = {id(param) for param in tied}
        self._hooks = [param.register_post_accumulate_grad_hook(self._on_grad) for param in self._params]
        self._reset()

    def _reset(self) -> None:
        self._next = {id(p): 0 for p in self._params}       # the micro-batch each parameter hands on next
        self._waiting = {id(p): {} for p in self._params}   # micro-batch -> gradient, not yet handed on
        self._other_sources = {id(p): {} for p in self._params}  # micro-batch -> an expert's other sources' grads
        self._sums: dict[int, torch.Tensor] = {}            # without a sink: the sum so far

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        stage = self._owner[id(param)]
        grad, param.grad = param.grad, None
        if stage.inferring:  # the shape inference's dummy backward: no micro-batch's
            return
        self._waiting[id(param)][stage.microbatch] = grad
        self._other_sources[id(param)][stage.microbatch] = getattr(param, "other_source_grads", None)
        param.other_source_grads = None
        if id(param) not in self._tied:
            self._hand_on(param)

    def _hand_on(self, param: torch.nn.Parameter) -> None:
        waiting = self._waiting[id(param)]
        while self._next[id(param)] in waiting:
            grad = waiting.pop(self._next[id(param)])
            others = self._other_sources[id(param)].pop(self._next[id(param)], None)
            self._next[id(param)] += 1
            if self.sink is not None:
                param.other_source_grads = others  # what the sink takes with grad (take_source_grads)
                self.sink(param, grad)
            else:
                total = self._sums.get(id(param))
                self._sums[id(param)] = grad if total is None else total.add_(grad)

    def finish(self) -> None:
        """After the schedule: hand on the tied copies' sums; without a sink, set ``.grad``.

        Every parameter with a gradient must have had one from each micro-batch."""
        for param in self._params:
            if id(param) in self._tied:
                self._sum_tied(param)
        short = [(p.shape, self._next[id(p)]) for p in self._params if self._next[id(p)] not in (0, self.microbatches)]
        if short:
            raise RuntimeError(f"pipeline invariant mode: a parameter of shape {list(short[0][0])} had the "
                               f"gradients of {short[0][1]} of the {self.microbatches} micro-batches")
        for param in self._params:
            if id(param) in self._sums:
                param.grad = self._sums[id(param)]
        self._reset()

    def _sum_tied(self, param: torch.nn.Parameter) -> None:
        waiting = self._waiting[id(param)]
        if sorted(waiting) != list(range(self.microbatches)):
            raise RuntimeError(f"pipeline invariant mode: the tied embedding had the gradients of micro-batches "
                               f"{sorted(waiting)}, not 0..{self.microbatches - 1}")
        mine = torch.stack([waiting[k] for k in range(self.microbatches)])
        both = comm.all_gather(mine, self.embedding_group)  # [2 M, ...]: the first stage's and the last's
        m = self.microbatches
        self._waiting[id(param)] = {k: both[k] + both[m + k] for k in range(m)}
        self._hand_on(param)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
