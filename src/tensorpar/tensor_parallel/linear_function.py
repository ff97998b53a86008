"""The autograd function behind the tensor-parallel linear layers, and its functional forms.

``y = x W^T + b`` with the layer's TP communication folded into forward and backward (seed
000, section 4): under SP the input is all-gathered forward and re-gathered backward while
dgrad computes; the dgrad all-reduce (or SP reduce-scatter) runs while wgrad computes. Also
here: wgrad into an fp32 ``main_grad`` (gradient accumulation fusion), deferred wgrad, and the
row layer's output reduction folded into the GEMM (``output_reduction``, chunked by
:mod:`tensorpar.tensor_parallel.overlap`). The layers built on it are in :mod:`tensorpar.tensor_parallel.layers`.

Example::

    y = linear_with_grad_accumulation_and_async_allreduce(x, w, None, False, True, False)
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from ..distributed import comm
from .buffers import get_global_memory_buffer
from .overlap import all_gather_matmul, matmul_reduce
from ..parallel_state import resolve_tp_group


def compute_dtype_of(input_: torch.Tensor) -> torch.dtype:
    device_type = input_.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return input_.dtype


def gather_sequence(input_: torch.Tensor, group, *, async_op: bool):
    """All-gather the sequence-sharded input into the shared scratch buffer."""
    if torch.compiler.is_compiling():  # the compiler plans its own memory
        return comm.all_gather(input_, group, dim=0, async_op=async_op)
    shape = list(input_.shape)
    shape[0] *= comm.group_size(group)
    buffer = get_global_memory_buffer().get_tensor(shape, input_.dtype, "tp_input", device=input_.device)
    return comm.all_gather(input_, group, dim=0, async_op=async_op, out=buffer)


def _linear_forward(input_, weight, bias, sequence_parallel, group, overlap_chunks=1, output_reduction=None):
    """``x W^T + b`` at the compute dtype, gathering the sequence first under SP.

    With ``output_reduction`` (``"all_reduce"`` or ``"reduce_scatter"``: the row layer's ``g``)
    the output is reduced over TP too. With ``overlap_chunks > 1`` the SP gather or the output
    reduction is chunked against the GEMM (:mod:`tensorpar.tensor_parallel.overlap`).
    Returns the input and the weight cast to the compute dtype (what backward needs, so the
    weight is cast once per micro-batch, as autocast would) and the output.
    """
    compute_dtype = compute_dtype_of(input_)
    # Under autocast, cast before the SP all-gather: half the bytes on the wire and saved.
    input_ = input_.to(compute_dtype)
    weight = weight.to(compute_dtype)
    bias = None if bias is None else bias.to(compute_dtype)
    with torch.autocast(input_.device.type, enabled=False):
        if output_reduction is not None:
            output = matmul_reduce(input_, weight.t(), group, chunks=overlap_chunks,
                                   scatter=output_reduction == "reduce_scatter")
        elif sequence_parallel and overlap_chunks > 1:
            output, _ = all_gather_matmul(input_, weight.t(), group, chunks=overlap_chunks, bias=bias)
        else:
            total_input = gather_sequence(input_, group, async_op=False) if sequence_parallel else input_
            output = F.linear(total_input, weight, bias)
    return input_, weight, output


def _launch_dgrad_reduction(grad_input: torch.Tensor, *, allreduce_dgrad: bool,
                            sequence_parallel: bool, group):
    """Start the dgrad all-reduce (TP) or reduce-scatter (SP); returns a Handle or None."""
    if sequence_parallel:
        return comm.reduce_scatter(grad_input, group, dim=0, async_op=True)
    if allreduce_dgrad:
        return comm.all_reduce(grad_input, group, async_op=True)
    return None


def _launch_dgrad(grad_output, weight, *, allreduce_dgrad, sequence_parallel, output_reduction,
                  overlap_chunks, group, keep_gathered=False):
    """dgrad ``grad_output @ W`` with its TP communication started.

    Returns ``(handle, gathered)``: ``handle.wait()`` gives the input grad; ``gathered`` is the
    row layer's all-gathered output grad under SP (``keep_gathered``, sequence order), for its wgrad.
    The column's dgrad reduction (all-reduce, or reduce-scatter under SP) is chunked against
    the dgrad GEMM with ``overlap_chunks > 1``; the row layer's SP output-grad all-gather
    (``output_reduction == "reduce_scatter"``) too.
    """
    if output_reduction == "reduce_scatter":
        grad_input, gathered = all_gather_matmul(grad_output, weight, group, chunks=overlap_chunks,
                                                 keep_gathered=keep_gathered)
        return comm.Handle(None, grad_input), gathered
    if overlap_chunks > 1 and (allreduce_dgrad or sequence_parallel):
        return matmul_reduce(grad_output, weight, group, chunks=overlap_chunks, scatter=sequence_parallel,
                             async_op=True), None
    grad_input = grad_output.matmul(weight)
    reduction = _launch_dgrad_reduction(grad_input, allreduce_dgrad=allreduce_dgrad,
                                        sequence_parallel=sequence_parallel, group=group)
    return reduction if reduction is not None else comm.Handle(None, grad_input), None


# (device type, dtype) -> whether ``torch.addmm(main_grad, a, b, out_dtype=fp32, out=main_grad)``
# sums bf16/fp16 products into an fp32 main_grad correctly. The overload exists on CUDA from torch
# 2.8 and accepts an fp32 ``self`` from 2.10; probed once per device type and dtype, not versioned.
_FUSED_ADDMM_SUPPORTED: dict[tuple[str, torch.dtype], bool] = {}


def _probe_fused_addmm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether addmm's ``out_dtype`` overload accumulates ``dtype`` products into fp32."""
    # 1 + 2^-12 is neither a bf16 nor an fp16 number: an implementation that rounds ``self`` to
    # the operands' dtype (or ignores it) gives a different sum.
    main_grad = torch.full((2, 2), 1.0 + 2.0 ** -12, dtype=torch.float32, device=device)
    operand = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        torch.addmm(main_grad, operand, operand, out_dtype=torch.float32, out=main_grad)
    except (TypeError, RuntimeError):  # no overload (torch < 2.8), fp32 self rejected, no kernel
        return False
    return bool(main_grad.eq(3.0 + 2.0 ** -12).all())


def fused_addmm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Probed once per device type and dtype (one tiny GEMM and one host sync), then cached."""
    key = (device.type, dtype)
    supported = _FUSED_ADDMM_SUPPORTED.get(key)
    if supported is None:
        supported = _FUSED_ADDMM_SUPPORTED[key] = _probe_fused_addmm(device, dtype)
    return supported


def _tf32_enabled() -> bool:
    """Whether CUDA's fp32 GEMMs may run at TF32 now; read through torch's new precision API
    where it exists (reading the legacy flag raises once a program has set the new one)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        precision = matmul.fp32_precision
        if precision == "none":  # inherits the generic setting
            precision = torch.backends.fp32_precision
        return precision == "tf32"
    return matmul.allow_tf32


def _warn_if_full_fp32(device: torch.device) -> None:
    """The upcast fallback's GEMM runs at the program's own fp32 precision: the global flags
    are never changed here (another thread's GEMMs would see them). At full fp32 on a GPU it is
    several times slower than at TF32, which is exact for upcast bf16/fp16 operands."""
    if device.type == "cuda" and not _tf32_enabled():
        warnings.warn("gradient_accumulation_fusion: this torch has no fused low-precision addmm into an fp32 "
                      "main_grad, so the wgrad GEMM runs upcast at full fp32; set "
                      "torch.backends.cuda.matmul.fp32_precision = 'tf32' to run it at TF32 (exact for bf16/fp16 "
                      "operands, but it applies to every fp32 GEMM of the program)", stacklevel=2)


def _accumulate_wgrad(main_grad: torch.Tensor, grad_output_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ input`` as one GEMM with accumulation.

    When main_grad (fp32) is wider than the activations, one GEMM accumulates the low-precision
    products into it where the device has that kernel; otherwise the operands are upcast and
    multiplied in fp32 (at TF32 where the program enabled it), the same exact sum either way.
    """
    if main_grad.dtype == grad_output_2d.dtype:
        main_grad.addmm_(grad_output_2d.t(), input_2d)
    elif fused_addmm_supported(main_grad.device, grad_output_2d.dtype):
        torch.addmm(main_grad, grad_output_2d.t(), input_2d, out_dtype=main_grad.dtype, out=main_grad)
    else:
        _warn_if_full_fp32(main_grad.device)
        main_grad.addmm_(grad_output_2d.t().to(main_grad.dtype), input_2d.to(main_grad.dtype))


# The same as one op the compiler does not trace into: the kernel probe reads its result on the
# host (data-dependent under tracing) and addmm's out_dtype overload writes into ``out=``.
@torch.library.custom_op("tensorpar::accumulate_wgrad", mutates_args=("main_grad",))
def _accumulate_wgrad_op(main_grad: torch.Tensor, grad_output_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    _accumulate_wgrad(main_grad, grad_output_2d, input_2d)


@_accumulate_wgrad_op.register_fake
def _accumulate_wgrad_fake(main_grad, grad_output_2d, input_2d) -> None:
    return None


def _accumulate_wgrad_into_main_grad(weight: torch.Tensor, grad_output_2d: torch.Tensor,
                                     input_2d: torch.Tensor) -> None:
    """``weight.main_grad += grad_output^T @ input`` (:func:`_accumulate_wgrad`); compiled, as its op."""
    accumulate = _accumulate_wgrad_op if torch.compiler.is_compiling() else _accumulate_wgrad
    accumulate(weight.main_grad, grad_output_2d, input_2d)


def _weight_grad_placeholder(weight: torch.Tensor):
    """What autograd gets for a weight whose gradient went into ``main_grad``.

    Megatron's protocol: a weight carrying ``grad_added_to_main_grad`` (set up by a DP grad
    reducer) gets a dummy gradient so its post-accumulate hook still fires; zeros when the
    weight is also used elsewhere (``zero_out_wgrad``), since autograd adds the other use's
    gradient to it. In the weight's dtype, so autograd has nothing to cast. Compiled, always
    zeros and no flag (the reducer adds them to ``main_grad``).
    """
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    if torch.compiler.is_compiling():
        # A compiled backward cannot set an attribute (dynamo refuses the side effect).
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


def _flatten(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def compute_weight_grad(weight: torch.Tensor, total_input: torch.Tensor, grad_output: torch.Tensor,
                        *, gradient_accumulation_fusion: bool):
    """wgrad for ``y = x W^T``: into ``main_grad`` when fused, else returned."""
    grad_output_2d, input_2d = _flatten(grad_output), _flatten(total_input)
    if gradient_accumulation_fusion:
        _accumulate_wgrad_into_main_grad(weight, grad_output_2d, input_2d)
        return _weight_grad_placeholder(weight)
    if torch.compiler.is_compiling() and grad_output_2d.dtype == weight.dtype:
        # Inductor folds ``mm + add`` into one addmm. For a weight autograd adds a second gradient to
        # (the tied LM head's, the embedding's) that GEMM would then wait for the other gradient at the
        # end of the backward, not run while the dgrad reduction is in flight. A batch of one is the
        # same GEMM, same bits, which the fold does not match. At a lower compute dtype the cast to
        # the weight's dtype already stands between them (and bf16 bmm is slower than mm on CPU).
        return torch.bmm(grad_output_2d.t()[None], input_2d[None])[0]
    return grad_output_2d.t().matmul(input_2d)


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``y = x W^T + b`` with TP communication folded in (seed 000, section 4).

    Forward: under SP, all-gather the ``[s/TP, b, h]`` input into a scratch buffer and save only
    the un-gathered shard. Backward: re-gather it asynchronously while dgrad computes, launch
    the dgrad all-reduce (or SP reduce-scatter) asynchronously and compute wgrad while it runs.
    """

    @staticmethod
    def forward(ctx, input_, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group,
                overlap_chunks=1, output_reduction=None):
        input_, compute_weight, output = _linear_forward(input_, weight, bias, sequence_parallel, tp_group,
                                                         overlap_chunks, output_reduction)
        ctx.overlap_chunks, ctx.output_reduction = overlap_chunks, output_reduction
        ctx.save_for_backward(input_, weight, compute_weight)
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.grad_output_buffer = grad_output_buffer
        ctx.wgrad_deferral_limit = wgrad_deferral_limit
        ctx.tp_group = tp_group
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight, compute_weight = ctx.saved_tensors
        group = ctx.tp_group
        buffer = ctx.grad_output_buffer
        defer_wgrad = buffer is not None and (ctx.wgrad_deferral_limit == 0
                                              or len(buffer) < ctx.wgrad_deferral_limit)
        wgrad_needed = ctx.needs_input_grad[1] and not defer_wgrad
        gather = None
        if ctx.sequence_parallel and wgrad_needed:
            gather = gather_sequence(input_, group, async_op=True)  # overlaps the dgrad GEMM
        reduction, gathered_grad = _launch_dgrad(
            grad_output, compute_weight, allreduce_dgrad=ctx.allreduce_dgrad,
            sequence_parallel=ctx.sequence_parallel, output_reduction=ctx.output_reduction,
            overlap_chunks=ctx.overlap_chunks, group=group, keep_gathered=wgrad_needed)
        total_input = gather.wait() if gather is not None else input_
        grad_weight = None
        if defer_wgrad:
            buffer.append(grad_output)
        elif wgrad_needed:
            # Runs while the dgrad reduction is in flight: the overlap this function exists for.
            # The row layer's chunked SP backward gathered the output grad in sequence order: one
            # GEMM over all its rows, as unchunked.
            grad_weight = compute_weight_grad(weight, total_input,
                                              grad_output if gathered_grad is None else gathered_grad,
                                              gradient_accumulation_fusion=ctx.gradient_accumulation_fusion)
        grad_bias = _flatten(grad_output).sum(dim=0) if ctx.use_bias else None
        grad_input = reduction.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None, None


class LinearWithFrozenWeight(torch.autograd.Function):
    """``y = x W^T + b`` for a weight that needs no gradient: no wgrad, input not saved.

    Keeps the TP communication of the trainable version (SP all-gather forward, dgrad
    all-reduce or reduce-scatter backward), synchronously since there is no wgrad to overlap.
    """

    @staticmethod
    def forward(ctx, input_, weight, bias, allreduce_dgrad, sequence_parallel, tp_group,
                overlap_chunks=1, output_reduction=None):
        _, compute_weight, output = _linear_forward(input_, weight, bias, sequence_parallel, tp_group,
                                                    overlap_chunks, output_reduction)
        ctx.save_for_backward(compute_weight)
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = allreduce_dgrad, sequence_parallel, tp_group
        ctx.overlap_chunks, ctx.output_reduction = overlap_chunks, output_reduction
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (compute_weight,) = ctx.saved_tensors
        reduction, _ = _launch_dgrad(grad_output, compute_weight, allreduce_dgrad=ctx.allreduce_dgrad,
                                     sequence_parallel=ctx.sequence_parallel, output_reduction=ctx.output_reduction,
                                     overlap_chunks=ctx.overlap_chunks, group=ctx.tp_group)
        grad_input = reduction.wait()
        grad_bias = _flatten(grad_output).sum(dim=0) if ctx.use_bias and ctx.needs_input_grad[2] else None
        return grad_input, None, grad_bias, None, None, None, None, None

def linear_with_grad_accumulation_and_async_allreduce(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
        grad_output_buffer=None, wgrad_deferral_limit=0, async_grad_allreduce=None, tp_group=None, *,
        overlap_chunks=1, output_reduction=None):
    """Functional form of :class:`LinearWithGradAccumulationAndAsyncCommunication`, in
    megatron-core 0.16.1's positional order (``async_grad_allreduce``: deprecated there, ignored;
    a process group in its place, tensorpar 0.2's order, is taken as ``tp_group`` with a warning).

    ``input``: ``[s, b, h]`` (``[s/TP, b, h]`` with ``sequence_parallel``). With
    ``gradient_accumulation_fusion`` the weight must carry an fp32 ``main_grad``. With a
    ``grad_output_buffer`` list, wgrad is deferred: the backward stores ``grad_output`` there
    (for the first ``wgrad_deferral_limit`` calls; 0 means always) for a later
    :meth:`ColumnParallelLinear.compute_deferred_wgrads`. ``output_reduction``
    (``"all_reduce"`` / ``"reduce_scatter"``) sums the output over TP inside, as the row
    layer's ``g``; ``overlap_chunks > 1`` chunks every collective against its GEMM.
    """
    if isinstance(async_grad_allreduce, torch.distributed.ProcessGroup):
        warnings.warn("linear_with_grad_accumulation_and_async_allreduce(..., wgrad_deferral_limit, tp_group) is "
                      "deprecated: the ninth positional argument is async_grad_allreduce (megatron-core 0.16.1's "
                      "order); pass tp_group=", DeprecationWarning, stacklevel=2)
        async_grad_allreduce, tp_group = None, async_grad_allreduce
    _warn_async_grad_allreduce(async_grad_allreduce)
    if gradient_accumulation_fusion and not hasattr(weight, "main_grad"):
        raise ValueError("gradient_accumulation_fusion=True needs weight.main_grad (an fp32 gradient "
                         "buffer of the weight's shape), which is not set on this weight")
    if allreduce_dgrad and sequence_parallel:
        raise ValueError("allreduce_dgrad and sequence_parallel are exclusive: under SP the dgrad is "
                         "reduce-scattered")
    group = resolve_tp_group(tp_group)
    overlap_chunks, output_reduction = _check_overlap(overlap_chunks, output_reduction, bias, allreduce_dgrad,
                                                      sequence_parallel, group)
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad and comm.group_size(group) > 1,
        sequence_parallel, grad_output_buffer, wgrad_deferral_limit, group, overlap_chunks, output_reduction)


def linear_with_frozen_weight(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                              sequence_parallel, tp_group=None, grad_output_buffer=None, wgrad_deferral_limit=None,
                              async_grad_allreduce=None, *, overlap_chunks=1, output_reduction=None):
    """Functional form of :class:`LinearWithFrozenWeight`, in megatron-core 0.16.1's positional order.

    ``gradient_accumulation_fusion`` is accepted for ported calls and ignored (there is no
    wgrad); a frozen weight has nothing to defer, so ``grad_output_buffer`` must be None.
    ``async_grad_allreduce`` is deprecated in Megatron and ignored.
    """
    _warn_async_grad_allreduce(async_grad_allreduce)
    if grad_output_buffer is not None or wgrad_deferral_limit:
        raise ValueError("linear_with_frozen_weight: a frozen weight has no wgrad to defer; pass "
                         f"grad_output_buffer=None (got {type(grad_output_buffer).__name__}) and no "
                         f"wgrad_deferral_limit (got {wgrad_deferral_limit!r})")
    group = resolve_tp_group(tp_group)
    overlap_chunks, output_reduction = _check_overlap(overlap_chunks, output_reduction, bias, allreduce_dgrad,
                                                      sequence_parallel, group)
    return LinearWithFrozenWeight.apply(input, weight, bias, allreduce_dgrad and comm.group_size(group) > 1,
                                        sequence_parallel, group, overlap_chunks, output_reduction)


def _warn_async_grad_allreduce(async_grad_allreduce) -> None:
    if async_grad_allreduce is not None:
        warnings.warn("async_grad_allreduce is deprecated (as in Megatron) and ignored; allreduce_dgrad "
                      "decides the dgrad all-reduce", DeprecationWarning, stacklevel=3)


_OUTPUT_REDUCTIONS = (None, "all_reduce", "reduce_scatter")


def _check_overlap(overlap_chunks, output_reduction, bias, allreduce_dgrad, sequence_parallel, group):
    """Validated ``(overlap_chunks, output_reduction)``; one rank has nothing to reduce or chunk."""
    if isinstance(overlap_chunks, bool) or not isinstance(overlap_chunks, int) or overlap_chunks < 1:
        raise ValueError(f"overlap_chunks must be a positive int, got {overlap_chunks!r}")
    if output_reduction not in _OUTPUT_REDUCTIONS:
        raise ValueError(f"output_reduction must be one of {_OUTPUT_REDUCTIONS}, got {output_reduction!r}")
    if output_reduction is not None and (bias is not None or allreduce_dgrad or sequence_parallel):
        raise ValueError("output_reduction (the row layer's g) takes no bias (it would be summed TP times), "
                         "allreduce_dgrad or sequence_parallel")
    if comm.group_size(group) == 1:
        return 1, None
    return overlap_chunks, output_reduction
