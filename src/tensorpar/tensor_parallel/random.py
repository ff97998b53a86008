"""TP-aware random streams, TP-aware dropout and activation recompute (Megatron's ``checkpoint``
and ``CheckpointWithoutOutput``), on any device.

Two streams feed dropout under tensor parallelism:

* the *default* stream (the device's default generator) is seeded identically on every TP rank,
  so dropout on an activation every rank holds whole gives every rank the same mask;
* the *model-parallel* stream, entered with ``get_rng_tracker().fork()``, is seeded differently
  on each TP rank, so dropout on an activation split across ranks (the attention probabilities
  of each rank's heads) draws independent masks for the different slices, as TP=1 would.

Megatron's tracker swaps CUDA generator states only, so it fails on CPU; this one swaps the
default generator of whatever device the stream was created for.

Example::

    tp.model_parallel_manual_seed(1234)
    y = tp.random.dropout(x, 0.1)                  # replicated x: same mask on every TP rank
    with tp.get_rng_tracker().fork():
        h = torch.nn.functional.dropout(h_local, 0.1)   # TP-sharded h: a different mask per rank
"""

from __future__ import annotations

import contextlib

import torch

from ..distributed import comm
from ..parallel_state import (
    default_device, get_expert_model_parallel_rank, get_expert_tensor_parallel_rank, model_parallel_is_initialized,
    resolve_tp_group)
from .keep_masks import block_keep_mask, traced_block_keep_mask, traced_keep_mask

MODEL_PARALLEL_RNG = "model-parallel-rng"
DATA_PARALLEL_RNG = "data-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"
# Offset of the model-parallel seeds from the default seed, so the two never coincide.
_MODEL_PARALLEL_SEED_OFFSET = 2718


def _get_generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_generator_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


class RNGStatesTracker:
    """Named random streams, each swapped in for its device's default generator by ``fork``.

    Megatron's ``CudaRNGStatesTracker`` on any device: ``add``, ``fork`` (nested forks of the
    same stream continue it), ``get_states``/``set_states``, ``reset``. ``use_cudagraphable_rng``
    is refused (a CUDA graph cannot capture a generator swap).
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False) -> None:
        if use_cudagraphable_rng:
            raise ValueError("RNGStatesTracker(use_cudagraphable_rng=True): tensorpar's tracker swaps generator "
                             "states, which a CUDA graph cannot capture")
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def reset(self) -> None:
        """Forget every stream."""
        self._states: dict[str, torch.Tensor] = {}
        self._devices: dict[str, torch.device] = {}
        self._seeds: set[int] = set()
        # The stream each device's generator is running now (None: its own default stream).
        self._running: dict[torch.device, str] = {}

    @property
    def states_(self) -> dict[str, torch.Tensor]:
        """The streams' states (Megatron's attribute)."""
        return self._states

    def is_initialized(self) -> bool:
        return bool(self._states)

    def add(self, name: str, seed: int, *, device: torch.device | str | None = None) -> None:
        """Create stream ``name`` seeded with ``seed`` for ``device`` (default: the backend's)."""
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        device = torch.device(device) if device is not None else default_device()
        self._seeds.add(seed)
        self._devices[name] = device
        self._states[name] = torch.Generator(device=device).manual_seed(seed).get_state()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's current state."""
        return {name: state.clone() if torch.is_tensor(state) else state for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace every stream by ``states`` (from :meth:`get_states`); a new name's stream is
        for the backend's device."""
        self._devices = {name: self._devices.get(name, default_device()) for name in states}
        self._states = {name: state.clone() if torch.is_tensor(state) else state for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw from stream ``name`` inside the block; the default stream is left untouched."""
        if name not in self._states:
            raise RuntimeError(f"RNG stream {name!r} does not exist; call "
                               "tensorpar.model_parallel_manual_seed(seed) first")
        device = self._devices[name]
        outer = self._running.get(device)
        outside = _get_generator_state(device)
        if outer is not None:  # forked from another stream: it continues from here afterwards
            self._states[outer] = outside
        _set_generator_state(self._states[name], device)
        self._running[device] = name
        try:
            yield
        finally:
            self._states[name] = _get_generator_state(device)
            _set_generator_state(self._states[outer] if outer is not None else outside, device)
            if outer is None:
                self._running.pop(device, None)
            else:
                self._running[device] = outer


CudaRNGStatesTracker = RNGStatesTracker

_RNG_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (Megatron's ``get_cuda_rng_tracker``)."""
    return _RNG_TRACKER


def _refuse_graph_trackers(where: str, inference_rng_tracker: bool, use_cudagraphable_rng: bool) -> None:
    if inference_rng_tracker or use_cudagraphable_rng:
        raise ValueError(f"{where}: inference_rng_tracker={inference_rng_tracker} and "
                         f"use_cudagraphable_rng={use_cudagraphable_rng}: tensorpar has only the training "
                         "tracker (it swaps generator states, which a CUDA graph cannot capture)")


def get_cuda_rng_tracker(use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                         use_cudagraphable_rng: bool = False) -> RNGStatesTracker:
    """:func:`get_rng_tracker` under Megatron's name and arguments.

    ``use_te_rng_tracker`` is ignored (Megatron falls back to its own tracker without
    Transformer Engine too); an inference or CUDA-graph-safe tracker does not exist here.
    """
    _refuse_graph_trackers("get_cuda_rng_tracker", inference_rng_tracker, use_cudagraphable_rng)
    return _RNG_TRACKER


def get_data_parallel_rng_tracker_name() -> str:
    return DATA_PARALLEL_RNG


def get_expert_parallel_rng_tracker_name() -> str:
    return EXPERT_PARALLEL_RNG


def is_graph_safe_cuda_rng_tracker(cuda_rng_tracker) -> bool:
    """False for tensorpar's tracker (it swaps generator states)."""
    return bool(getattr(cuda_rng_tracker, "use_cudagraphable_rng", False))


def convert_cuda_rng_state(state, to_graphable: bool = False):
    """A generator's state tensor (from a ``torch.Generator``, or the tensor itself);
    ``to_graphable=True`` is refused (no CUDA-graph-safe tracker here)."""
    if to_graphable:
        raise ValueError("convert_cuda_rng_state(to_graphable=True): tensorpar has no CUDA-graph-safe RNG tracker")
    if isinstance(state, torch.Generator):
        return state.get_state()
    if torch.is_tensor(state):
        return state
    raise TypeError(f"convert_cuda_rng_state: a state tensor or a torch.Generator, got {type(state).__name__}")


def model_parallel_manual_seed(seed: int, *, tp_group=None, device=None, tp_rank=None, ep_rank=None,
                               etp_rank=None) -> None:
    """Seed the default stream with ``seed`` and the tracker's streams per rank, as Megatron.

    Call it on every rank with the same ``seed``, after ``initialize_model_parallel`` (or with
    an explicit ``tp_group``). Every default generator (CPU and accelerators) gets ``seed``,
    identical on all TP ranks; the tracker gets ``data-parallel-rng`` (``seed``),
    ``model-parallel-rng`` (``seed + 2718 + tp_rank``) and ``expert-parallel-rng``
    (``seed + 1024 + 100 * ep_rank + etp_rank``), on ``device`` (default: the backend's device,
    e.g. the rank's GPU under NCCL; pass ``device="cuda"`` for CUDA tensors over gloo).
    """
    if tp_group is None and tp_rank is None and not model_parallel_is_initialized():
        raise RuntimeError("model_parallel_manual_seed seeds the model-parallel stream per TP rank: call "
                           "tensorpar.initialize_model_parallel(...) first, or pass tp_group=")
    if tp_rank is None:
        tp_rank = comm.group_rank(resolve_tp_group(tp_group))
    expert = model_parallel_is_initialized() and tp_group is None
    ep_rank = ep_rank if ep_rank is not None else (get_expert_model_parallel_rank() if expert else 0)
    etp_rank = etp_rank if etp_rank is not None else ((get_expert_tensor_parallel_rank() or 0) if expert else 0)
    torch.manual_seed(seed)
    _RNG_TRACKER.reset()
    _RNG_TRACKER.add(DATA_PARALLEL_RNG, seed, device=device)
    _RNG_TRACKER.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank, device=device)
    _RNG_TRACKER.add(EXPERT_PARALLEL_RNG, seed + 1024 + 100 * ep_rank + etp_rank, device=device)


def model_parallel_cuda_manual_seed(seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                                    use_cudagraphable_rng: bool = False, tp_rank=None, ep_rank=None,
                                    etp_rank=None, force_reset_rng: bool = False) -> None:
    """Megatron's signature for :func:`model_parallel_manual_seed` (every generator is reseeded,
    the CPU's too). ``te_rng_tracker`` is ignored, as Megatron without Transformer Engine does;
    the tracker is always reset, so ``force_reset_rng`` changes nothing."""
    _refuse_graph_trackers("model_parallel_cuda_manual_seed", inference_rng_tracker, use_cudagraphable_rng)
    model_parallel_manual_seed(seed, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank)


def dropout(input_: torch.Tensor, p: float, *, training: bool = True, sequence_parallel: bool = False,
            tp_group=None, valid_rows: int | None = None, row_starts: tuple[int, ...] | None = None) -> torch.Tensor:
    """Dropout whose mask does not depend on the TP size, seeded from the default stream.

    For an activation every TP rank holds whole, or (``sequence_parallel=True``) one split
    along dim 0 across the TP group. The mask is drawn in blocks of whole dim-0 rows (about
    ``keep_masks.DROPOUT_BLOCK_ELEMENTS`` each, placed on the full tensor), block ``k`` from a
    generator seeded by one draw of the default stream and ``k``: under SP a rank draws only the
    blocks its rows fall in and keeps a mask of its rows only, and every row gets the mask TP=1
    gives it. The default stream advances by one draw on every rank alike. Under
    ``torch.compile`` the graph draws that seed (:func:`tensorpar.tensor_parallel.keep_masks.traced_block_keep_mask`).

    ``valid_rows``: the rows of the full tensor that are real (its TP=1 length) when the rest
    is padding (SP pads the sequence to a multiple of TP): each block is drawn at its TP=1
    extent, so its values do not depend on the padding (a device generator may map values to
    positions by the size drawn), and the padding rows are zeroed.

    ``row_starts``: the full tensor is ``len(row_starts)`` equal runs of rows of a longer
    sequence, run ``i`` from its row ``row_starts[i]`` on (a context-parallel rank's chunks):
    each row gets the mask of its row in that sequence, so the CP layout does not change it;
    ``valid_rows`` (that sequence's real rows) is then required.

    Example::

        h = dropout(h, 0.1, sequence_parallel=True)      # h: [s/TP, b, h]
        h = dropout(h, 0.1, sequence_parallel=True, valid_rows=1023)   # 1023 tokens padded to 1024
        h = dropout(h, 0.1, valid_rows=13, row_starts=(4, 8))          # rows 4-7 and 8-11 of 13 (+3 padding)
    """
    if not training or p == 0.0:
        return input_
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    rows = input_.shape[0] if input_.dim() else 1
    first_row, full_rows = 0, rows
    if sequence_parallel:
        group = resolve_tp_group(tp_group)
        first_row, full_rows = comm.group_rank(group) * rows, comm.group_size(group) * rows
    segments = row_segments(first_row, rows, full_rows, row_starts)
    # With row_starts valid_rows is required, and may end past this rank's last row.
    most = full_rows if row_starts is None else float("inf")
    if valid_rows is not None or row_starts is not None:
        if isinstance(valid_rows, bool) or not isinstance(valid_rows, int) or not 0 < valid_rows <= most:
            raise ValueError(f"dropout: valid_rows must be an int in [1, {most}] (the full sequence's rows), "
                             f"got {valid_rows!r}")
        full_rows = valid_rows
    draw = traced_block_keep_mask if torch.compiler.is_compiling() else block_keep_mask
    keep = draw(input_.shape, 1.0 - p, input_.device, segments, full_rows)
    return input_ * keep / (1.0 - p)


def row_segments(first_row: int, rows: int, full_rows: int, row_starts) -> list[tuple[int, int]]:
    """``(first row in the sequence, rows)`` of each contiguous run of this rank's rows ``[first_row,
    first_row + rows)`` of the full tensor, in order (:func:`dropout`'s ``row_starts``). Example:
    ``row_segments(0, 4, 4, (2, 12))`` is ``[(2, 2), (12, 2)]``, a CP rank's chunks 1 and 6 of 8."""
    if row_starts is None:
        return [(first_row, rows)]
    if not row_starts or full_rows % len(row_starts):
        raise ValueError(f"dropout: row_starts {row_starts!r} must cut the full tensor's {full_rows} rows in "
                         "equal runs")
    run = full_rows // len(row_starts)
    segments = []
    for i, start in enumerate(row_starts):
        lo, hi = max(first_row, i * run), min(first_row + rows, (i + 1) * run)
        if lo < hi:
            segments.append((start + lo - i * run, hi - lo))
    return segments


def sharded_dropout(input_: torch.Tensor, p: float, *, dim: int, start: int, full_size: int,
                    training: bool = True) -> torch.Tensor:
    """Dropout of a TP rank's slice ``[start, start + input_.shape[dim])`` of a ``full_size`` dim.

    The slices on different ranks (e.g. the attention probabilities of each rank's heads) get
    independent masks. Eager: drawn from the rank's model-parallel stream (``fork``). Traced by
    ``torch.compile``, where swapping generator states breaks the graph: this rank's slice of a
    mask drawn for the whole ``full_size`` from the default stream, which every rank advances
    alike.

    Example::

        probs = sharded_dropout(probs, 0.1, dim=1, start=rank * local_heads, full_size=heads)
    """
    if not training or p == 0.0:
        return input_
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if torch.compiler.is_compiling():
        keep = traced_keep_mask(input_.shape, 1.0 - p, input_.device, dim=dim, start=start, full=full_size)
        return input_ * keep / (1.0 - p)
    with get_rng_tracker().fork():
        return torch.nn.functional.dropout(input_, p)


def _device_states(devices) -> dict[torch.device, torch.Tensor]:
    return {device: _get_generator_state(device) for device in devices}


def _restore_device_states(states: dict[torch.device, torch.Tensor]) -> None:
    for device, state in states.items():
        _set_generator_state(state, device)


class CheckpointFunction(torch.autograd.Function):
    """Run ``function`` without keeping activations; recompute it in backward.

    The CPU and device generator states and the tracker's streams are saved before the
    forward and swapped back in for the recompute, so dropout draws the same masks twice.
    """

    @staticmethod
    def forward(ctx, function, distribute_saved_activations, group, *args):
        ctx.function = function
        tensor_devices = {a.device for a in args if torch.is_tensor(a) and a.device.type != "cpu"}
        ctx.rng_states = _device_states({torch.device("cpu"), *tensor_devices})
        ctx.tracker_states = _RNG_TRACKER.get_states()
        # The recompute runs in backward, outside the caller's autocast: replay it exactly.
        ctx.autocast = {d.type: (torch.is_autocast_enabled(d.type), torch.get_autocast_dtype(d.type))
                        for d in ctx.rng_states}
        with torch.no_grad():
            outputs = function(*args)
        ctx.input_requires_grad = [torch.is_tensor(a) and a.requires_grad for a in args]
        ctx.first_shape = None
        if distribute_saved_activations and torch.is_tensor(args[0]):
            # As Megatron: the caller's tensor itself shrinks to this rank's 1/TP of its flattened
            # data until backward all-gathers it back, so the whole activation is freed. A view
            # cannot change its data: only a copy of its shard is saved then.
            first, n = args[0], comm.group_size(group)
            comm.check_divisible(first.numel(), n, "checkpointed input element count")
            ctx.first_shape, ctx.group, ctx.first_shrunk = first.shape, group, first._base is None
            shard = first.detach().reshape(-1)
            shard = shard.chunk(n)[comm.group_rank(group)].clone() if n > 1 else shard
            if ctx.first_shrunk:
                first.data = shard
            args = (first if ctx.first_shrunk else shard,) + args[1:]
        ctx.tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.non_tensor_args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        args = list(ctx.non_tensor_args)
        for i, saved in zip(ctx.tensor_positions, ctx.saved_tensors):
            args[i] = saved
        if ctx.first_shape is not None:
            whole = comm.all_gather(args[0].detach(), ctx.group).view(ctx.first_shape)
            if ctx.first_shrunk:
                args[0].data = whole
            args[0] = whole
        inputs = [a.detach().requires_grad_(rg) if torch.is_tensor(a) else a
                  for a, rg in zip(args, ctx.input_requires_grad)]

        current = _device_states(ctx.rng_states)
        current_tracker = _RNG_TRACKER.get_states()
        _restore_device_states(ctx.rng_states)
        _RNG_TRACKER.set_states(ctx.tracker_states)
        try:
            with torch.enable_grad(), contextlib.ExitStack() as autocasts:
                for device_type, (enabled, dtype) in ctx.autocast.items():
                    autocasts.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
                outputs = ctx.function(*inputs)
        finally:
            _restore_device_states(current)
            _RNG_TRACKER.set_states(current_tracker)

        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(a.grad if torch.is_tensor(a) and rg else None
                      for a, rg in zip(inputs, ctx.input_requires_grad))
        return (None, None, None) + grads


def _keep_collective_results():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    functional = torch.ops._c10d_functional
    collectives = {functional.all_reduce.default, functional.all_gather_into_tensor.default,
                   functional.reduce_scatter_tensor.default, functional.all_to_all_single.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in collectives else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint(function, distribute_saved_activations: bool, *args, tp_group=None):
    """``function(*args)``, keeping only its inputs and recomputing it during backward.

    ``distribute_saved_activations=True`` stores only this TP rank's 1/TP of the first input
    (useful when it is replicated across TP, i.e. without sequence parallelism). As in Megatron,
    the first input itself (unless it is a view) holds only that 1-D shard from the forward until
    the backward gathers it back: do not read it in between, and do not pass a tensor that
    another autograd op saved (an activation's output).

    Example::

        hidden = tp.checkpoint(block, False, hidden)
    """
    if torch.compiler.is_compiling():
        # Traced, torch's own checkpoint is one region the compiler recomputes in backward (it
        # replays the RNG too). Collective results are kept rather than communicated again, so
        # backward issues no forward collective; the saved input is kept whole, not distributed.
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                                 context_fn=_keep_collective_results)
    group = None
    if distribute_saved_activations:
        group = resolve_tp_group(tp_group)
    return CheckpointFunction.apply(function, distribute_saved_activations, group, *args)


class _RecomputedOutput(torch.autograd.Function):
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

    :func:`checkpoint` frees the activations inside a function; its output is still kept by
    whatever consumes it (``y = x * gelu(x)`` saves ``gelu(x)``). This frees that output too: its
    storage is released once the consumers have saved it, and refilled by recomputing the
    function when the gradient of ``hook_tensor`` (a tensor computed from the consumers) arrives,
    before the consumers' backward reads it. The RNG streams are replayed. ``fp8`` must be falsy
    (FP8 needs Transformer Engine).

    Example::

        ckpt = tp.CheckpointWithoutOutput()
        h = ckpt.checkpoint(torch.nn.functional.gelu, x)
        y = h * x
        ckpt.discard_output_and_register_recompute(y)   # h's memory is free until y's backward
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
        outputs = _RecomputedOutput.apply(run_function, self, *args)
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
