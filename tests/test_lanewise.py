"""``lanewise``: an elementwise function's value and gradient for an element do not depend on
the width of the row it sits in, on the row's strides or on the incoming gradient's layout (on
CPU the scalar tail loop, and GELU's oneDNN path for contiguous tensors, round differently)."""

import functools

import pytest
import torch
import torch.nn.functional as F

from tensorpar.invariant.lanewise import VECTOR_STEP, lanewise

FUNCTIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
             "exp": torch.exp}
# Row widths of a TP rank's shard of 192 columns, whole vector steps or not.
WIDTHS = (8, 24, 40, 48, 56, 64, 96, 100, 128, 192)


def _columns(t: torch.Tensor, width: int, contiguous: bool) -> torch.Tensor:
    """The first ``width`` columns of ``t``'s two halves side by side, then the first half's (a
    SwiGLU gate as a column layer gives it: a strided view), or a contiguous copy of them."""
    both = torch.cat([t[:, :width], t[:, 192:192 + width]], dim=1)[:, :width]
    return both.contiguous() if contiguous else both


def _value_and_grad(fn, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().requires_grad_()
    y = lanewise(fn, x)
    y.backward(grad)
    return y.detach(), x.grad


@pytest.fixture
def one_thread():
    """One thread, as each rank runs: a parallel split would add a tail loop per chunk."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_every_element_gets_the_bits_it_has_in_the_widest_row(name, dtype, one_thread):
    fn, generator = FUNCTIONS[name], torch.Generator().manual_seed(0)
    h, g = (torch.randn(48, 384, generator=generator).to(dtype) for _ in range(2))
    whole = _value_and_grad(fn, _columns(h, 192, False), _columns(g, 192, False))
    different = [(width, contiguous, grad_contiguous)
                 for width in WIDTHS for contiguous in (False, True) for grad_contiguous in (False, True)
                 if any(not torch.equal(got, expected[:, :width]) for got, expected in zip(
                     _value_and_grad(fn, _columns(h, width, contiguous), _columns(g, width, grad_contiguous)), whole))]
    assert different == []


def test_whole_steps_of_a_contiguous_tensor_are_computed_in_place_without_a_copy():
    x = torch.randn(3, VECTOR_STEP)
    assert lanewise(torch.Tensor.exp_, x).data_ptr() == x.data_ptr()
    narrow = torch.randn(3, VECTOR_STEP + 1)
    out = lanewise(torch.Tensor.exp_, narrow)
    assert out.shape == narrow.shape and out.data_ptr() != narrow.data_ptr()


@pytest.mark.parametrize("threads", [3, 7])
@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_tanh"])
def test_tp_shards_get_tp1s_bits_at_any_thread_count(name, threads):
    """Past ATen's grain, with several intra-op threads every thread's piece of a tensor ended in a
    tail loop of its own, cut elsewhere at every TP size (SiLU: 1 element of TP 4's columns at 3
    threads). TP 1, 2 and 4's column shards, forward and backward, get the bits of TP 1 at one thread."""
    previous = torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 11008, generator=generator)
    grad = torch.randn(64, 11008, generator=generator)
    torch.set_num_threads(1)
    try:
        expected = _value_and_grad(FUNCTIONS[name], x, grad)
        torch.set_num_threads(threads)
        for tp_size in (1, 2, 4):
            shards = [_value_and_grad(FUNCTIONS[name], part, part_grad)
                      for part, part_grad in zip(x.chunk(tp_size, -1), grad.chunk(tp_size, -1))]
            value, x_grad = (torch.cat(parts, -1) for parts in zip(*shards))
            assert torch.equal(value, expected[0]), (tp_size, (value != expected[0]).sum().item())
            assert torch.equal(x_grad, expected[1]), (tp_size, (x_grad != expected[1]).sum().item())
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(previous)
