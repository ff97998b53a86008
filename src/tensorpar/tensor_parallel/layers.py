"""The tensor-parallel linear layers: ``ColumnParallelLinear`` and ``RowParallelLinear``.

``ColumnParallelLinear`` holds ``W`` split by output rows (``[out/TP, in]``): its input is
replicated (or sequence-sharded under SP) and its output is sharded on the last dim.
``RowParallelLinear`` holds ``W`` split by input columns (``[out, in/TP]``): its input is
sharded on the last dim and its partial outputs are summed over TP (the paper's ``g``). A
column layer followed by a row layer communicates once forward and once backward: the
autograd function that carries it is in :mod:`tensorpar.tensor_parallel.linear_function` (its names are
importable from here too), the region mappings f and g in :mod:`tensorpar.tensor_parallel.mappings`.

Example (an MLP block)::

    fc1 = tp.ColumnParallelLinear(h, 4 * h)
    fc2 = tp.RowParallelLinear(4 * h, h, input_is_parallel=True)
    y, _ = fc2(F.gelu(fc1(x)[0]))        # x, y: [s, b, h], replicated over TP
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..distributed import comm
from .embedding import VocabParallelEmbedding  # (Megatron's layers module holds it; ported imports find it here)
from .initialization import (
    copy_tensor_model_parallel_attributes,
    init_method_normal,
    init_weight_shard,
    param_is_not_tensor_parallel_duplicate,
    partition_layout,
    replica_rows,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from .linear_function import (
    LinearWithFrozenWeight,
    LinearWithGradAccumulationAndAsyncCommunication,
    compute_dtype_of,
    compute_weight_grad,
    fused_addmm_supported,
    gather_sequence,
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    start_reduction_from_tensor_model_parallel_region,
    sum_grad_over_replicas,
)
from ..parallel_state import default_device, resolve_tp_group
from ..porting import resolve_config

__all__ = [
    "ColumnParallelLinear",
    "LinearWithFrozenWeight",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "compute_weight_grad",
    "copy_tensor_model_parallel_attributes",
    "fused_addmm_supported",
    "linear_with_frozen_weight",
    "linear_with_grad_accumulation_and_async_allreduce",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]


def _check_input(input_: torch.Tensor, weight: torch.Tensor, name: str) -> None:
    if input_.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: input feature size {input_.shape[-1]} does not match the weight's "
                         f"input size {weight.shape[1]} (input shape {list(input_.shape)})")
    if input_.dtype != weight.dtype and not torch.is_autocast_enabled(input_.device.type):
        raise ValueError(f"{name}: input dtype {input_.dtype} differs from weight dtype {weight.dtype}; "
                         "cast one of them or run under torch.autocast")


def _resolve_overlap(overlap, name: str) -> int | str:
    """``overlap``: ``"off"``, ``"auto"`` or a number of chunks (1 is off)."""
    if overlap == "off":
        return 1
    if overlap == "auto":
        return overlap
    if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 1:
        raise ValueError(f"{name}: overlap must be 'off', 'auto' or a positive number of chunks, got {overlap!r}")
    return overlap


def _resolve_sequence_parallel(sequence_parallel: bool, tp_size: int, name: str) -> bool:
    if sequence_parallel and tp_size == 1:
        warnings.warn(f"{name}: sequence_parallel=True with one tensor-parallel rank has nothing to "
                      "split; turning it off", stacklevel=3)
        return False
    return sequence_parallel

class _ParallelLinear(nn.Module):
    """Shared construction of the column and row layers: sharded weight, optional bias."""

    def __init__(self, input_size, output_size, *, partition_dim, bias, bias_is_parallel, init_method,
                 stride, skip_bias_add, sequence_parallel, gradient_accumulation_fusion, is_expert,
                 params_dtype, device, tp_group, perform_initialization, config, keep_master_weight_for_test,
                 skip_weight_param_allocation=False, partition_sizes=None, partition_rows=None):
        super().__init__()
        name = type(self).__name__
        settings = resolve_config(config, name, params_dtype=params_dtype, sequence_parallel=sequence_parallel,
                                  gradient_accumulation_fusion=gradient_accumulation_fusion,
                                  perform_initialization=perform_initialization, device=device)
        params_dtype, device, sequence_parallel, gradient_accumulation_fusion, perform_initialization = (
            settings[k] for k in ("params_dtype", "device", "sequence_parallel", "gradient_accumulation_fusion",
                                  "perform_initialization"))
        for arg, value in (("input_size", input_size), ("output_size", output_size), ("stride", stride)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")
        self.tp_group = resolve_tp_group(tp_group)
        self.tp_size = comm.group_size(self.tp_group)
        self.input_size, self.output_size = input_size, output_size
        split_size = output_size if partition_dim == 0 else input_size
        split_name = "output_size" if partition_dim == 0 else "input_size"
        rows = partition_layout(name, split_name, split_size, stride, self.tp_size, partition_sizes, partition_rows)
        # None: the equal split. Else every rank's rows of the full partition dimension.
        self.partition_rows = rows
        self.partition_sizes = None if rows is None else [sum(b - a for a, b in ranges) for ranges in rows]
        rank = comm.group_rank(self.tp_group)
        local_size = split_size // self.tp_size if rows is None else self.partition_sizes[rank]
        self._replicas = None
        if rows is not None:
            local_rows, shared_rows, num_shared, self._duplicate_rows = replica_rows(rows, rank)
            if num_shared:
                if gradient_accumulation_fusion:
                    raise ValueError(f"{name}: rows held by several ranks (partition_rows) cannot be combined with "
                                     "gradient_accumulation_fusion")
                self._replicas = dict(local_rows=local_rows, shared_rows=shared_rows, num_shared=num_shared)
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = _resolve_sequence_parallel(sequence_parallel, self.tp_size, name)
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.is_expert = is_expert
        device = default_device() if device is None else torch.device(device)
        shape = [local_size, input_size] if partition_dim == 0 else [output_size, local_size]
        self.weight_shape = tuple(shape)
        # The largest rank's shard: what every rank decides by, so that all decide alike (uneven layouts).
        largest = split_size // self.tp_size if rows is None else max(self.partition_sizes)
        self.largest_weight_shape = (largest, input_size) if partition_dim == 0 else (output_size, largest)
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)  # forward(input_, weight=) brings it
        else:
            self.weight = nn.Parameter(torch.empty(shape, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=partition_dim, stride=stride)
            self._set_partition_attributes(self.weight)
            # Megatron's marker for the DP grad reduction: expert weights are reduced elsewhere.
            self.weight.allreduce = not is_expert
            init_method = init_method or init_method_normal(0.02)
            if perform_initialization and keep_master_weight_for_test:
                # Megatron's test hook: the TP=1 weight this shard is cut from. The CPU generator
                # is restored after it, so the shard below draws the same seed.
                self.master_weight = torch.empty([output_size, input_size], dtype=params_dtype, device=device)
                with torch.random.fork_rng(devices=[]):
                    init_weight_shard(self.master_weight, init_method, partition_dim=partition_dim, stride=stride)
            if perform_initialization:
                init_weight_shard(self.weight, init_method, partition_dim=partition_dim, stride=stride,
                                  tp_group=self.tp_group, full_rows=split_size,
                                  rows=None if rows is None else rows[rank])
        if bias:
            bias_size = shape[0]
            self.bias = nn.Parameter(torch.zeros(bias_size, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, is_parallel=bias_is_parallel, dim=0, stride=stride)
            if bias_is_parallel:
                self._set_partition_attributes(self.bias)
            self.bias.allreduce = not is_expert
        else:
            self.register_parameter("bias", None)

    def _set_partition_attributes(self, param: nn.Parameter) -> None:
        """Uneven layouts: every rank's rows (for checkpoints) and the rows another rank holds
        too (counted once by the gradient norm)."""
        if self.partition_rows is not None:
            param.partition_rows = self.partition_rows
            if self._replicas is not None:
                param.tp_duplicate_rows = self._duplicate_rows

    def _summed_over_replicas(self, param):
        """``param`` whose gradient rows held by several ranks are summed over their holders."""
        if self._replicas is None or param is None:
            return param
        return sum_grad_over_replicas(param, self.tp_group, **self._replicas)

    def _linear(self, input_, weight, bias, *, allreduce_dgrad, sequence_parallel, grad_output_buffer=None,
                wgrad_deferral_limit=0, overlap_chunks=1, output_reduction=None):
        _check_input(input_, weight, type(self).__name__)
        overlap = dict(overlap_chunks=overlap_chunks, output_reduction=output_reduction)
        if not weight.requires_grad:
            return linear_with_frozen_weight(input_, weight, bias, False, allreduce_dgrad, sequence_parallel,
                                             tp_group=self.tp_group, **overlap)
        return linear_with_grad_accumulation_and_async_allreduce(
            input_, weight, bias, self.gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
            grad_output_buffer, wgrad_deferral_limit, tp_group=self.tp_group, **overlap)

    def _chunks(self, input_, *, op: str, rows: int, tokens: int, comm_width: int) -> int:
        """This forward's chunk count: the fixed ``overlap``, or the one ``"auto"`` predicts fastest
        for a collective ``op`` of ``[tokens, comm_width]`` against the largest rank's GEMM, on the
        link model :func:`tensorpar.calibrate_overlap` measured. Every argument is the same on every
        rank (never this rank's shard, which differs in an uneven layout): every rank issues the
        same collectives."""
        if self.overlap != "auto":
            return self.overlap
        if self.tp_size == 1:
            return 1
        if self.overlap_link is None:
            raise RuntimeError(f"{type(self).__name__}: overlap='auto' needs a link model: call "
                               "tp.calibrate_overlap(model, tokens=...) on every rank before the first forward")
        nbytes = tokens * comm_width * compute_dtype_of(input_).itemsize
        gemm_flops = 2 * tokens * self.largest_weight_shape[0] * self.largest_weight_shape[1]
        return self.overlap_link.best_chunks(gemm_flops, comm.bytes_sent_per_rank(op, nbytes, self.tp_size), rows)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, tp_size={self.tp_size}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class ColumnParallelLinear(_ParallelLinear):
    """``Y = X A + b`` with ``A`` split by columns (PyTorch weight ``[out/TP, in]``).

    Input ``[s, b, in]`` replicated over TP (``[s/TP, b, in]`` under ``sequence_parallel``);
    output ``[s, b, out/TP]``, or ``[s, b, out]`` with ``gather_output``. Returns
    ``(output, bias)`` where ``bias`` is not None only with ``skip_bias_add``.

    ``forward(input_, weight=)`` uses a weight owned elsewhere, e.g. an LM head tied to the
    vocab-parallel embedding. ``disable_grad_reduce`` leaves the input gradient partial (the
    caller reduces it; SP's reduce-scatter still runs); ``is_expert`` issues no TP communication
    at all (the MoE token dispatcher owns it). ``skip_weight_param_allocation`` allocates no
    weight: every forward passes one (an LM head tied to the embedding). ``defer_wgrad_compute`` keeps inputs and output grads so that
    :meth:`compute_deferred_wgrads` can run the wgrad GEMMs later (after the rest of backward).
    ``overlap`` (``"off"``, a number of chunks, or ``"auto"``: chosen per forward from the link
    model of :func:`tensorpar.calibrate_overlap`) splits the SP input all-gather and the dgrad
    reduction into chunks, each in flight while the next chunk's GEMM runs (:mod:`tensorpar.tensor_parallel.overlap`).

    Megatron's arguments: ``config=`` fills ``params_dtype``, ``sequence_parallel``,
    ``gradient_accumulation_fusion``, ``perform_initialization`` and, with
    ``use_cpu_initialization``, ``device`` (:mod:`tensorpar.porting`);
    ``keep_master_weight_for_test`` keeps the TP=1 weight as ``master_weight``;
    ``embedding_activation_buffer`` and ``grad_output_buffer`` are the lists
    ``defer_wgrad_compute`` fills; ``tp_comm_buffer_name`` is unused (as in Megatron without
    Transformer Engine).

    ``partition_sizes`` (one per rank, default the equal split, else as even as possible) gives
    ranks unequal shares of the output rows (of each of the ``stride`` blocks); ``partition_rows``
    lists each rank's ``[start, stop)`` rows of the full weight instead (``stride`` then only
    names the blocks), and may overlap: a row several ranks hold is replicated and its gradient
    summed over exactly those ranks.

    Example::

        qkv = tp.ColumnParallelLinear(h, 3 * h, stride=3)   # heads split across TP ranks
        fc = tp.ColumnParallelLinear(h, 200, partition_sizes=[72, 64, 64])   # at TP=3
        out, _ = qkv(x)                                      # [s, b, 3h/TP]
    """

    def __init__(self, input_size, output_size, *, bias=True, gather_output=False, init_method=None,
                 stride=1, skip_bias_add=False, sequence_parallel=False, gradient_accumulation_fusion=False,
                 allreduce_dgrad=True, is_expert=False, disable_grad_reduce=False,
                 skip_weight_param_allocation=False, params_dtype=torch.float32, device=None, tp_group=None,
                 perform_initialization=True,
                 defer_wgrad_compute=False, wgrad_deferral_limit=0, overlap="off", config=None,
                 keep_master_weight_for_test=False, embedding_activation_buffer=None, grad_output_buffer=None,
                 tp_comm_buffer_name=None, partition_sizes=None, partition_rows=None):
        super().__init__(input_size, output_size, partition_dim=0, bias=bias, bias_is_parallel=True,
                         partition_sizes=partition_sizes, partition_rows=partition_rows,
                         init_method=init_method, stride=stride, skip_bias_add=skip_bias_add,
                         sequence_parallel=sequence_parallel,
                         gradient_accumulation_fusion=gradient_accumulation_fusion, is_expert=is_expert,
                         params_dtype=params_dtype, device=device, tp_group=tp_group,
                         perform_initialization=perform_initialization, config=config,
                         keep_master_weight_for_test=keep_master_weight_for_test,
                         skip_weight_param_allocation=skip_weight_param_allocation)
        if gather_output and self.sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with "
                             "sequence_parallel=True")
        self.gather_output = gather_output
        self.disable_grad_reduce = disable_grad_reduce
        # The token dispatcher owns expert communication; nothing to do with one rank either.
        self.explicit_expert_comm = is_expert and self.tp_size > 1
        self.allreduce_dgrad = (allreduce_dgrad and self.tp_size > 1 and not self.sequence_parallel
                                and not disable_grad_reduce and not self.explicit_expert_comm)
        if (defer_wgrad_compute or gather_output) and self._replicas is not None:
            raise ValueError("ColumnParallelLinear: rows held by several ranks (partition_rows) cannot be combined "
                             "with defer_wgrad_compute or gather_output")
        self.defer_wgrad_compute = defer_wgrad_compute
        self.wgrad_deferral_limit = wgrad_deferral_limit
        self.overlap = _resolve_overlap(overlap, "ColumnParallelLinear")
        self.overlap_link = None  # set by tensorpar.calibrate_overlap
        # Megatron's caller-owned lists (embedding_activation_buffer, grad_output_buffer) are used as given.
        self.activation_buffer: list[torch.Tensor] = [] if embedding_activation_buffer is None \
            else embedding_activation_buffer
        self.grad_output_buffer: list[torch.Tensor] = [] if grad_output_buffer is None else grad_output_buffer
        self._deferred_weight: torch.Tensor | None = None

    def forward(self, input_, weight=None, runtime_gather_output=None):
        """``(output, bias_or_None)``; ``runtime_gather_output`` overrides ``gather_output`` for this call."""
        if weight is None:
            if self.weight is None:
                raise ValueError("ColumnParallelLinear: built with skip_weight_param_allocation=True, so "
                                 "forward needs the weight: call it as layer(input_, weight=w)")
            weight = self._summed_over_replicas(self.weight)
        elif tuple(weight.shape) != self.weight_shape:
            raise ValueError(f"ColumnParallelLinear: the weight passed to forward has shape {list(weight.shape)}, "
                             f"expected {list(self.weight_shape)}")
        bias = self._summed_over_replicas(self.bias) if not self.skip_bias_add else None
        sequence_parallel = self.sequence_parallel and not self.explicit_expert_comm
        if self.allreduce_dgrad or sequence_parallel or self.explicit_expert_comm or self.disable_grad_reduce:
            input_parallel = input_  # the autograd function (or nobody) reduces dgrad
        else:
            # f; the layer's input gradient is a fresh GEMM output: all-reduce it in place.
            input_parallel = copy_to_tensor_model_parallel_region(input_, group=self.tp_group, inplace_grad=True)
        grad_output_buffer = None
        if self.defer_wgrad_compute and weight.requires_grad and torch.is_grad_enabled():
            if self.wgrad_deferral_limit == 0 or len(self.activation_buffer) < self.wgrad_deferral_limit:
                self.activation_buffer.append(input_parallel.detach())
                weight.deferred_wgrad_pending = True  # a DP reducer's bucket waits for it
            grad_output_buffer = self.grad_output_buffer
        chunks = 1
        if sequence_parallel or self.allreduce_dgrad:
            rows, in_ = input_.shape[0], input_.shape[-1]
            tokens = input_.numel() // in_ * (self.tp_size if sequence_parallel else 1)
            chunks = self._chunks(input_, op="all_gather" if sequence_parallel else "all_reduce", rows=rows,
                                  tokens=tokens, comm_width=in_)
        output_parallel = self._linear(input_parallel, weight, bias, allreduce_dgrad=self.allreduce_dgrad,
                                       sequence_parallel=sequence_parallel,
                                       grad_output_buffer=grad_output_buffer,
                                       wgrad_deferral_limit=self.wgrad_deferral_limit,
                                       overlap_chunks=chunks)
        deferred_weight = weight if grad_output_buffer is not None else None
        if deferred_weight is not self._deferred_weight:  # no module mutation to trace otherwise
            self._deferred_weight = deferred_weight
        if self.gather_output if runtime_gather_output is None else runtime_gather_output:
            output = gather_from_tensor_model_parallel_region(output_parallel, group=self.tp_group,
                                                              sizes=self.partition_sizes)
        else:
            output = output_parallel
        return output, (self.bias if self.skip_bias_add else None)

    def compute_deferred_wgrads(self) -> None:
        """Run the wgrad GEMMs deferred by ``defer_wgrad_compute`` and empty the buffers.

        Accumulates into ``weight.main_grad`` where the weight has one (gradient accumulation
        fusion, or a :class:`~tensorpar.DataParallelGradReducer`), else into ``weight.grad``.
        Under SP each stored input shard is all-gathered again first. Call it after backward and
        before the reducer's ``finish()``: once the weight's DP reduction has started, adding to
        ``main_grad`` would be lost, so it is an error.
        """
        if len(self.activation_buffer) != len(self.grad_output_buffer):
            raise RuntimeError(f"compute_deferred_wgrads: {len(self.activation_buffer)} stored inputs but "
                               f"{len(self.grad_output_buffer)} stored output grads; call it after backward")
        weight = self._deferred_weight if self._deferred_weight is not None else self.weight
        if self.grad_output_buffer and getattr(weight, "main_grad_reduced", False):
            raise RuntimeError(f"compute_deferred_wgrads: the DP reduction of the weight's main_grad has already "
                               f"started (DataParallelGradReducer.finish(), or its bucket filled during backward), "
                               f"so {len(self.grad_output_buffer)} deferred gradient(s) would be lost: call it "
                               "after backward and before finish()")
        sequence_parallel = self.sequence_parallel and not self.explicit_expert_comm
        for input_, grad_output in zip(self.activation_buffer, self.grad_output_buffer):
            input_ = input_.to(grad_output.dtype)
            total_input = gather_sequence(input_, self.tp_group, async_op=False) if sequence_parallel else input_
            grad = compute_weight_grad(weight, total_input, grad_output,
                                       gradient_accumulation_fusion=self.gradient_accumulation_fusion)
            if self.gradient_accumulation_fusion:
                continue
            if hasattr(weight, "main_grad"):
                # A DP reducer's hook only sees gradients autograd delivers; this one it never sees.
                weight.main_grad.add_(grad)
            else:
                grad = grad.to(weight.dtype)
                weight.grad = grad if weight.grad is None else weight.grad + grad
        self.activation_buffer.clear()
        self.grad_output_buffer.clear()
        weight.deferred_wgrad_pending = False


class RowParallelLinear(_ParallelLinear):
    """``Y = X A + b`` with ``A`` split by rows (PyTorch weight ``[out, in/TP]``).

    Input ``[s, b, in/TP]`` with ``input_is_parallel`` (else ``[s, b, in]``, scattered here);
    the partial outputs are all-reduced over TP (``g``), or reduce-scattered to ``[s/TP, b, out]``
    under ``sequence_parallel``. The bias is added once, after the reduction; under SP its
    gradient is partial per rank, so it is marked ``sequence_parallel`` (see
    :func:`tensorpar.allreduce_sequence_parallel_grads`).
    ``overlap`` (as for :class:`ColumnParallelLinear`) chunks the exit reduction against the GEMM
    and, under SP, the backward all-gather of the output grad against the dgrad GEMM;
    :meth:`start` leaves the exit reduction in flight for interleaving (Domino). Megatron's
    ``config=``, ``keep_master_weight_for_test``, ``tp_comm_buffer_name`` and ``partition_sizes``
    (of the input columns) as for :class:`ColumnParallelLinear`.

    Example::

        proj = tp.RowParallelLinear(4 * h, h, input_is_parallel=True)
        y, _ = proj(hidden_parallel)                       # [s, b, h], summed over TP
    """

    def __init__(self, input_size, output_size, *, bias=True, input_is_parallel=False, init_method=None,
                 stride=1, skip_bias_add=False, sequence_parallel=False, gradient_accumulation_fusion=False,
                 is_expert=False, params_dtype=torch.float32, device=None, tp_group=None,
                 perform_initialization=True, overlap="off", config=None, keep_master_weight_for_test=False,
                 tp_comm_buffer_name=None, partition_sizes=None):
        super().__init__(input_size, output_size, partition_dim=1, bias=bias, bias_is_parallel=False,
                         partition_sizes=partition_sizes,
                         init_method=init_method, stride=stride, skip_bias_add=skip_bias_add,
                         sequence_parallel=sequence_parallel,
                         gradient_accumulation_fusion=gradient_accumulation_fusion, is_expert=is_expert,
                         params_dtype=params_dtype, device=device, tp_group=tp_group,
                         perform_initialization=perform_initialization, config=config,
                         keep_master_weight_for_test=keep_master_weight_for_test)
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.input_is_parallel = input_is_parallel
        self.explicit_expert_comm = is_expert and self.tp_size > 1
        self.overlap = _resolve_overlap(overlap, "RowParallelLinear")
        self.overlap_link = None  # set by tensorpar.calibrate_overlap
        if self.bias is not None and self.sequence_parallel:
            self.bias.sequence_parallel = True

    def _partial_output(self, input_, **overlap):
        """This rank's partial ``X_i A_i`` (reduced inside with ``output_reduction``)."""
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group,
                                                                     sizes=self.partition_sizes)
        return self._linear(input_parallel, self.weight, None, allreduce_dgrad=False, sequence_parallel=False,
                            **overlap)

    def forward(self, input_):
        chunks = 1
        if self.tp_size > 1 and not self.explicit_expert_comm:
            tokens = input_.numel() // input_.shape[-1]
            chunks = self._chunks(input_, op="reduce_scatter" if self.sequence_parallel else "all_reduce",
                                  rows=input_.shape[0] // (self.tp_size if self.sequence_parallel else 1),
                                  tokens=tokens, comm_width=self.output_size)
        if chunks > 1:
            # g (or the SP reduce-scatter) inside, chunk by chunk against the GEMM.
            return self._add_bias(self._partial_output(
                input_, overlap_chunks=chunks,
                output_reduction="reduce_scatter" if self.sequence_parallel else "all_reduce"))
        output_parallel = self._partial_output(input_)
        if self.explicit_expert_comm:
            output = output_parallel
        elif self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        else:
            # g, summing in place: the partial output is this layer's own fresh tensor.
            output = reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group, inplace=True)
        return self._add_bias(output)

    def start(self, input_):
        """Forward with the exit reduction launched but not awaited; ``.wait()`` on the result
        gives what :meth:`forward` returns. For interleaving other work (Domino-style, see
        :func:`tensorpar.interleave`) while this layer's ``g`` is in flight.

        Example::

            pending = proj.start(hidden_a)
            y_b, _ = proj(hidden_b)              # computes while hidden_a's sum travels
            y_a, _ = pending.wait()
        """
        output_parallel = self._partial_output(input_)
        if self.explicit_expert_comm:
            return comm.Handle(None, output_parallel, self._add_bias)
        return start_reduction_from_tensor_model_parallel_region(
            output_parallel, self.tp_group, sequence_parallel=self.sequence_parallel, then=self._add_bias)

    def _add_bias(self, output):
        """Once, after the reduction; or handed back with ``skip_bias_add``."""
        if self.skip_bias_add:
            return output, self.bias
        if self.bias is not None:
            output = output + self.bias
        return output, None
