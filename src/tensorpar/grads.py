"""Gradient bookkeeping after backward that TP layers need from the training loop."""

from __future__ import annotations

import torch
from torch import nn

from . import comm
from .initialization import param_is_not_tensor_parallel_duplicate
from .parallel_state import resolve_tp_group


def _grad_of(param: nn.Parameter) -> torch.Tensor | None:
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def allreduce_sequence_parallel_grads(module: nn.Module, *, tp_group=None) -> None:
    """Sum over TP the gradients of parameters marked ``sequence_parallel``.

    Under SP each rank sees 1/TP of the tokens, so the gradient of a parameter replicated over
    TP (LayerNorm weights, the row-parallel bias) is partial until summed. One all-reduce of a
    flat buffer covers all of them. Uses ``main_grad`` where a parameter has one.
    """
    group = resolve_tp_group(tp_group)
    grads = [g for p in module.parameters()
             if getattr(p, "sequence_parallel", False) and (g := _grad_of(p)) is not None]
    if not grads or comm.group_size(group) == 1:
        return
    for dtype in sorted({g.dtype for g in grads}, key=str):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        comm.all_reduce(flat, group)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


class _Bucket:
    """A contiguous fp32 gradient buffer shared by consecutive parameters."""

    def __init__(self, params: list[nn.Parameter], buffer: torch.Tensor) -> None:
        self.params, self.buffer = params, buffer
        self.ready: set[int] = set()
        self.handle = None


class DataParallelGradReducer:
    """Gives every parameter an fp32 ``main_grad`` and averages them over DP during backward.

    ``main_grad`` views live in contiguous buckets of about ``bucket_bytes``, filled in reverse
    parameter order (the order backward produces them). A post-accumulate-grad hook moves each
    ``.grad`` into ``main_grad`` (or, for layers with ``gradient_accumulation_fusion``, which
    wrote ``main_grad`` themselves, just drops their placeholder, Megatron's
    ``grad_added_to_main_grad`` protocol); when the last parameter of a bucket arrives, the
    bucket's all-reduce is launched asynchronously, while backward continues. Only the last
    micro-batch of a gradient-accumulation step reduces (``sync=False`` for the others).

    One optimizer step::

        reducer.zero_grad()
        for k, batch in enumerate(micro_batches):
            reducer.sync = k == len(micro_batches) - 1
            loss(batch).backward()
        reducer.finish()          # waits for the buckets; param.grad is now main_grad
        optimizer.step()
    """

    def __init__(self, params, *, dp_group, bucket_bytes: int = 25 * 2**20) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = dp_group
        self.dp_size = comm.group_size(dp_group)
        self.sync = True
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        pending: list[nn.Parameter] = []
        for param in reversed(self.params):
            pending.append(param)
            if sum(p.numel() for p in pending) * 4 >= bucket_bytes:
                self._add_bucket(pending)
                pending = []
        if pending:
            self._add_bucket(pending)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
        bucket = _Bucket(list(params), buffer)
        offset = 0
        for p in params:
            p.main_grad = buffer[offset:offset + p.numel()].view(p.shape)
            p.grad_added_to_main_grad = False
            offset += p.numel()
            self._bucket_of[id(p)] = bucket
        self.buckets.append(bucket)

    def _on_grad(self, param: nn.Parameter) -> None:
        if param.grad is not None and not param.grad_added_to_main_grad:
            param.main_grad.add_(param.grad)
        param.grad = None
        param.grad_added_to_main_grad = False
        if not self.sync:
            return
        bucket = self._bucket_of[id(param)]
        if bucket.handle is not None:
            raise RuntimeError("a parameter's gradient arrived after its bucket was reduced: "
                               "call backward once per micro-batch and finish() before the next")
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if self.dp_size > 1:
            bucket.buffer.div_(self.dp_size)
        bucket.handle = comm.all_reduce(bucket.buffer, self.group, async_op=True)

    def finish(self) -> None:
        """Wait for every bucket (launching those with unused parameters); set ``.grad``."""
        for bucket in self.buckets:
            if bucket.handle is None:
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.handle = None
            bucket.ready.clear()
        for p in self.params:
            p.grad = p.main_grad

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()
        for p in self.params:
            p.grad = None

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def get_grad_norm(params, *, tp_group=None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient (fp32 scalar), identical on every TP rank.

    Each parameter is counted once: TP shards by every rank, replicated parameters by TP
    rank 0 only, and the squares are summed over TP. Uses ``main_grad`` where present.
    """
    group = resolve_tp_group(tp_group)
    grads = [g for p in params
             if (g := _grad_of(p)) is not None and param_is_not_tensor_parallel_duplicate(p, group)]
    device = grads[0].device if grads else None
    square = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        square += g.detach().float().pow(2).sum()
    comm.all_reduce(square, group)
    return square.sqrt()


def clip_grad_norm_(params, max_norm: float, *, tp_group=None) -> torch.Tensor:
    """Scale gradients so the TP-aware total norm is at most ``max_norm``; returns the norm."""
    params = list(params)
    norm = get_grad_norm(params, tp_group=tp_group)
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for p in params:
            g = _grad_of(p)
            if g is not None:
                g.mul_(scale)
    return norm
