"""Megatron's ``CheckpointWithoutOutput``: recompute a function and free its output until then.

``checkpoint`` (in :mod:`tensorpar.tensor_parallel.random`) frees the activations inside a function; its
output is still kept by whatever consumes it (``y = x * gelu(x)`` saves ``gelu(x)``). This
frees that output too: its storage is released once the consumers have saved it, and refilled
by recomputing the function when the gradient of ``hook_tensor`` (a tensor computed from the
consumers) arrives, before the consumers' backward reads it. The RNG streams are replayed.

Example::

    ckpt = tp.CheckpointWithoutOutput()
    h = ckpt.checkpoint(torch.nn.functional.gelu, x)
    y = h * x
    ckpt.discard_output_and_register_recompute(y)   # h's memory is free until y's backward
"""

from __future__ import annotations

import torch

from .random import _device_states, _restore_device_states, get_rng_tracker

__all__ = ["CheckpointWithoutOutput"]


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, owner, *args):
        with torch.no_grad():
            outputs = function(*args)
        ctx.tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))
        ctx.outputs = ctx.inputs = None
        owner.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if ctx.outputs is None:
            raise RuntimeError("CheckpointWithoutOutput: backward reached the checkpoint before its recompute; "
                               "call discard_output_and_register_recompute(hook_tensor) with a hook_tensor "
                               "computed from the output")
        pairs = [(o, g) for o, g in zip(ctx.outputs, grad_outputs)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(a.grad if torch.is_tensor(a) else None for a in ctx.inputs)
        ctx.outputs = ctx.inputs = None
        return (None, None) + grads


class CheckpointWithoutOutput:
    """Checkpoint ``run_function`` and release its output until the backward needs it.

    ``fp8`` must be falsy (FP8 needs Transformer Engine).
    """

    def __init__(self, fp8=False) -> None:
        if fp8:
            raise ValueError(f"CheckpointWithoutOutput(fp8={fp8!r}): FP8 recompute needs Transformer Engine, "
                             "which tensorpar does not use")
        self.fp8 = False
        self.run_function = None
        self.ctx = None
        self.outputs = None
        self._rng = None
        self._storage_sizes = None

    def checkpoint(self, run_function, *args):
        """``run_function(*args)`` without keeping its activations."""
        self.run_function = run_function
        devices = {a.device for a in args if torch.is_tensor(a) and a.device.type != "cpu"}
        self._rng = (_device_states({torch.device("cpu"), *devices}), get_rng_tracker().get_states())
        outputs = _Function.apply(run_function, self, *args)
        self.outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' memory (their shapes stay) and recompute them when ``hook_tensor``'s
        gradient is computed."""
        self._storage_sizes = [o.untyped_storage().size() for o in self.outputs]
        for output in self.outputs:
            output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad) -> None:
        if self.ctx is None:
            return
        ctx, tracker = self.ctx, get_rng_tracker()
        args = list(ctx.args)
        for i, saved in zip(ctx.tensor_positions, ctx.saved_tensors):
            args[i] = saved.detach().requires_grad_(saved.requires_grad)
        current = (_device_states(self._rng[0]), tracker.get_states())
        _restore_device_states(self._rng[0])
        tracker.set_states(self._rng[1])
        try:
            with torch.enable_grad():
                outputs = self.run_function(*args)
        finally:
            _restore_device_states(current[0])
            tracker.set_states(current[1])
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        with torch.no_grad():
            # Refill the storage the consumers saved without touching its version counter.
            for output, again, size in zip(self.outputs, outputs, self._storage_sizes):
                output.untyped_storage().resize_(size)
                output.untyped_storage().copy_(again.contiguous().untyped_storage())
        ctx.outputs, ctx.inputs = outputs, args
        self.ctx = self.outputs = self.run_function = self._rng = None
