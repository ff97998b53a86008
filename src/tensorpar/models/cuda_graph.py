"""A function of fixed-shape CUDA tensors, captured once in a CUDA graph and replayed.

Generation's decode step with ``fixed_shapes`` (:class:`tensorpar.models.generation.Decoder`)
reads everything that changes per token from device tensors written in place (the token, the
position, the KV cache), so one capture serves every later token: a replay launches all of the
step's kernels at once, without the Python and launch overhead of each (the cost that dominates
decoding a small model on a GPU).
"""

from __future__ import annotations

import torch


class CUDAGraphed:
    """``fn(x)`` captured in a CUDA graph at the first call, replayed at each later one.

    ``fn`` must take and return CUDA tensors of the same shapes every call, read nothing else
    that changes between calls except device tensors updated in place, and never synchronise
    with the host. The first call runs ``fn`` ``warmup`` times on a side stream (cuBLAS and
    allocator set-up may not happen during a capture), so running it twice with the same input
    must be harmless. Later calls copy ``x`` into the captured input and replay; the output is
    the captured one, overwritten by the next call.

    Example::

        step = CUDAGraphed(lambda token: decoder.forward(token))
        logits = step(token)
    """

    def __init__(self, fn, *, warmup: int = 2) -> None:
        self.fn, self.warmup = fn, warmup
        self.graph = self.input = self.output = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            self._capture(x)
        self.input.copy_(x)
        self.graph.replay()
        return self.output

    def _capture(self, x: torch.Tensor) -> None:
        if x.device.type != "cuda":
            raise ValueError(f"a CUDA graph needs CUDA tensors, got one on {x.device}")
        self.input = x.clone()
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.fn(self.input)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.output = self.fn(self.input)
        self.graph = graph
