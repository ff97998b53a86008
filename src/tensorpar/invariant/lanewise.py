"""Elementwise functions whose every element takes the same kernel path, wherever it sits.

PyTorch's CPU elementwise kernels run each row (a contiguous tensor: all of it at once) in steps
of two SIMD vectors and what is left over in a scalar loop, which can round differently (SiLU on
AVX-512: 115,218 of 2,000,000 random inputs in the last bit); GELU runs contiguous tensors through
oneDNN and strided ones through ATen's own loop, which differ too. A TP rank's last columns of an
activation take the scalar tail at some TP sizes and not at others (SwiGLU over 48 features per
rank at TP 4 on AVX-512: 16 of them scalar, none at TP 1's 192), so the TP-invariant mode runs
its MLP's activation through :func:`lanewise`.

With more than one intra-op thread each thread's piece of the flat range ends in a tail loop of
its own, and where the pieces are cut depends on the tensor's size and on the kernel (GELU's
grain differs from SiLU's): ``lanewise(F.silu, x)`` at TP 1 against TP 4's columns differed in 1
element at 3 threads. So the function and its gradient run on one thread, the same path at every
thread count.

Example::

    hidden = lanewise(F.silu, gate) * up     # the same bits for a column at every TP size
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

# Whole steps at every vector width PyTorch builds for: two AVX-512 vectors of bf16 (or fp16)
# are 64 elements; AVX-512 fp32 steps 32, AVX2 16 or 32.
VECTOR_STEP = 64


class _Unpad(torch.autograd.Function):
    """``y[..., :width]``, whose gradient comes back contiguous and padded as ``y`` (zeros beyond
    ``width``): the function's backward then runs on whole steps too, in the contiguous path."""

    @staticmethod
    def forward(ctx, y, width):
        ctx.padded_width = y.shape[-1]
        return y.narrow(-1, 0, width)

    @staticmethod
    def backward(ctx, grad):
        if grad.shape[-1] == ctx.padded_width and grad.is_contiguous():
            return grad, None
        padded = grad.new_zeros(*grad.shape[:-1], ctx.padded_width)
        padded.narrow(-1, 0, grad.shape[-1]).copy_(grad)
        return padded, None


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


class _Serial(torch.autograd.Function):
    """``fn(x)``, forward and backward on one intra-op thread."""

    @staticmethod
    def forward(ctx, x, fn):
        with _one_thread(), torch.enable_grad():
            leaf = x.detach().requires_grad_(x.requires_grad)
            y = fn(leaf)
        ctx.leaf, ctx.y = leaf, y
        return y.detach()

    @staticmethod
    def backward(ctx, grad):
        with _one_thread():
            (grad_x,) = torch.autograd.grad(ctx.y, ctx.leaf, grad)
        ctx.leaf = ctx.y = None
        return grad_x, None


def lanewise(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``, computed on CPU on one thread, on a contiguous copy of
    ``x`` whose rows are padded with zeros to whole steps, so every element (and its gradient)
    takes the kernel's vector path (compiled, the graph's kernels thread as they do); elsewhere
    ``fn(x)``. No copy when ``x`` is contiguous and its rows are whole steps:
    ``lanewise(torch.Tensor.exp_, x)`` then works in place."""
    if x.device.type != "cpu":
        return fn(x)
    width = x.shape[-1]
    padded = F.pad(x, (0, -width % VECTOR_STEP)) if width % VECTOR_STEP else x.contiguous()
    if torch.compiler.is_compiling():
        return _Unpad.apply(fn(padded), width)
    if padded.requires_grad and torch.is_grad_enabled():
        return _Unpad.apply(_Serial.apply(padded, fn), width)
    with _one_thread():
        return _Unpad.apply(fn(padded), width)
