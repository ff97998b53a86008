"""GlobalMemoryBuffer: one reused allocation per (name, dtype, device), on any device."""

import contextlib

import pytest
import torch

import tensorpar as tp
from tensorpar.tensor_parallel.buffers import GlobalMemoryBuffer


def test_buffer_is_reused_and_grows_on_demand():
    buffers = GlobalMemoryBuffer()
    a = buffers.get_tensor([4, 2], torch.float32, "x")
    b = buffers.get_tensor([2, 2], torch.float32, "x")
    assert a.shape == (4, 2) and b.shape == (2, 2)
    assert a.data_ptr() == b.data_ptr()  # same storage: no new allocation
    c = buffers.get_tensor([8, 4], torch.float32, "x")
    assert c.numel() == 32 and c.device.type == "cpu"


def test_buffers_are_keyed_by_name_dtype_and_device():
    buffers = GlobalMemoryBuffer()
    a = buffers.get_tensor([4], torch.float32, "x", device="cpu")
    assert buffers.get_tensor([4], torch.float32, "y").data_ptr() != a.data_ptr()
    assert buffers.get_tensor([4], torch.bfloat16, "x").dtype == torch.bfloat16
    assert buffers.get_tensor([4], torch.float32, "x", device=torch.device("cpu")).data_ptr() == a.data_ptr()


def test_get_tensor_takes_megatrons_fourth_positional_mem_alloc_context():
    buffers, entered = GlobalMemoryBuffer(), []

    @contextlib.contextmanager
    def allocation():
        entered.append(True)
        yield

    a = buffers.get_tensor([4], torch.float32, "x", allocation)  # wraps the one allocation
    buffers.get_tensor([2], torch.float32, "x", allocation)
    assert entered == [True] and a.device == tp.parallel_state.default_device()
    with pytest.warns(DeprecationWarning, match="fourth positional argument is Megatron's mem_alloc_context"):
        assert buffers.get_tensor([4], torch.float32, "x", "cpu").data_ptr() == a.data_ptr()
