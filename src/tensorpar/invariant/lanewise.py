"""Elementwise functions whose every element takes the same kernel path, wherever it sits.

PyTorch's CPU elementwise kernels run each row (a contiguous tensor: all of it at once) in steps
of two SIMD vectors and what is left over in a scalar loop, which can round differently (SiLU on
AVX-512: 115,218 of 2,000,000 random inputs in the last bit); GELU runs contiguous tensors through
oneDNN and strided ones through ATen's own loop, which differ too. A TP rank's last columns of an
activation take the scalar tail at some TP sizes and not at others (SwiGLU over 48 features per
rank at TP 4 on AVX-512: 16 of them scalar, none at TP 1's 192), so the TP-invariant mode runs
its MLP's activation through :func:`lanewise`.

Example::

    hidden = lanewise(F.silu, gate) * up     # the same bits for a column at every TP size
"""

from __future__ import annotations

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


def lanewise(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``, computed on CPU on a contiguous copy of ``x`` whose
    rows are padded with zeros to whole steps, so every element (and its gradient) takes the
    kernel's vector path; elsewhere ``fn(x)``. No copy when ``x`` is contiguous and its rows are
    whole steps: ``lanewise(torch.Tensor.exp_, x)`` then works in place."""
    if x.device.type != "cpu":
        return fn(x)
    width = x.shape[-1]
    padded = F.pad(x, (0, -width % VECTOR_STEP)) if width % VECTOR_STEP else x.contiguous()
    return _Unpad.apply(fn(padded), width)
