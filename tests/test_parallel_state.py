"""Process groups: layout, getters, errors, and collectives that time out instead of hanging."""

import contextlib
import itertools
import os
import time
import unittest.mock
import warnings

import pytest
import torch

import tensorpar as tp
from tests.harness import run_in_fresh_world, run_on_ranks


def _groups_body():
    tp.initialize_model_parallel(2)
    rank = torch.distributed.get_rank()
    return (tp.get_tensor_model_parallel_rank(), tp.get_tensor_model_parallel_world_size(),
            tp.get_data_parallel_rank(), tp.get_data_parallel_world_size(),
            tp.get_tensor_model_parallel_src_rank(), rank)


def test_tp_groups_are_consecutive_ranks_and_dp_is_the_rest():
    assert run_on_ranks(_groups_body, 4) == [(0, 2, 0, 2, 0, 0), (1, 2, 0, 2, 0, 1),
                                             (0, 2, 1, 2, 2, 2), (1, 2, 1, 2, 2, 3)]


def _megatron_globals_body():
    from tensorpar import parallel_state as ps

    before = (ps._TENSOR_MODEL_PARALLEL_GROUP, ps._DATA_PARALLEL_GROUP_WITH_CP_AG, ps._PIPELINE_GLOBAL_RANKS)
    tp.initialize_model_parallel(2)
    held = (ps._TENSOR_MODEL_PARALLEL_GROUP is tp.get_tensor_model_parallel_group(),
            ps._DATA_PARALLEL_GROUP is tp.get_data_parallel_group(),
            ps._EXPERT_MODEL_PARALLEL_GROUP is ps.get_expert_model_parallel_group(),
            ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS, ps._DATA_PARALLEL_GLOBAL_RANKS, ps._DATA_PARALLEL_GROUP_WITH_CP_AG)
    tp.destroy_model_parallel()
    return before, held, ps._MODEL_PARALLEL_GROUP


def test_megatrons_module_globals_read_this_ranks_groups_and_none_outside_them():
    results = run_on_ranks(_megatron_globals_body, 4)
    none = (None, None, None)
    assert results == [(none, (True, True, True, [0, 1], [0, 2], None), None),
                       (none, (True, True, True, [0, 1], [1, 3], None), None),
                       (none, (True, True, True, [2, 3], [0, 2], None), None),
                       (none, (True, True, True, [2, 3], [1, 3], None), None)]


def _world_not_divisible_body():
    with pytest.raises(ValueError, match=r"world size 2 is not divisible by tensor_model_parallel_size 4"):
        tp.initialize_model_parallel(4)
    return True


def test_world_size_not_divisible_by_tp():
    assert all(run_on_ranks(_world_not_divisible_body, 2))


def test_getter_before_initialize_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"initialize_model_parallel"):
        tp.get_tensor_model_parallel_group()
    assert not tp.model_parallel_is_initialized()


def test_tp_group_getter_takes_megatrons_check_initialized():
    assert tp.get_tensor_model_parallel_group(check_initialized=False) is None
    with pytest.raises(RuntimeError, match=r"initialize_model_parallel"):
        tp.get_tensor_model_parallel_group(check_initialized=True)


def _reinitialize_body():
    tp.initialize_model_parallel(2)
    with pytest.raises(RuntimeError, match="already initialized"):
        tp.initialize_model_parallel(2)
    tp.destroy_model_parallel()
    assert not tp.model_parallel_is_initialized()
    tp.initialize_model_parallel(1)
    return tp.get_tensor_model_parallel_world_size(), tp.get_data_parallel_world_size()


def test_destroy_then_reinitialize_with_another_tp_size():
    assert run_on_ranks(_reinitialize_body, 2) == [(1, 2), (1, 2)]


def _crashed_peer_body():
    tp.initialize_model_parallel(2, timeout=3)
    layer = tp.RowParallelLinear(8, 8, input_is_parallel=True)
    if torch.distributed.get_rank() == 1:
        return "skipped the collective"
    start = time.monotonic()
    try:
        layer(torch.randn(2, 1, 4))
    except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError/DistBackendError
        return f"raised after {time.monotonic() - start:.1f}s: {type(exc).__name__}"
    return "returned"


def test_collective_a_peer_never_joins_raises_within_timeout():
    result = run_in_fresh_world(_crashed_peer_body, 2, timeout=60)
    assert result[1] == "skipped the collective"
    assert result[0].startswith("raised after"), result[0]
    assert float(result[0].split()[2][:-2]) < 20, result[0]


def _fake_cuda(devices: int, current: int = 0):
    """torch.cuda as a machine with ``devices`` GPUs would answer (the suite has none)."""
    calls = []
    patches = [unittest.mock.patch.object(torch.cuda, "device_count", lambda: devices),
               unittest.mock.patch.object(torch.cuda, "current_device", lambda: current),
               unittest.mock.patch.object(torch.cuda, "set_device", calls.append)]
    return patches, calls


def _select(devices, rank, *, local_rank=None, current=0):
    patches, calls = _fake_cuda(devices, current)
    env = {} if local_rank is None else {"LOCAL_RANK": str(local_rank)}
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(unittest.mock.patch.dict(os.environ, env))
        if local_rank is None:
            os.environ.pop("LOCAL_RANK", None)
        device = tp.parallel_state.select_cuda_device(rank)
    return device, calls


def test_nccl_device_comes_from_local_rank_else_rank_modulo_devices():
    """Item 5: the rank's GPU, never everyone on cuda:0."""
    assert _select(8, 13, local_rank=5) == (torch.device("cuda", 5), [5])
    assert _select(4, 6) == (torch.device("cuda", 2), [2])
    assert _select(4, 6, local_rank=2, current=2) == (torch.device("cuda", 2), [2])
    with pytest.raises(RuntimeError, match=r"torch.cuda.set_device chose cuda:3 but LOCAL_RANK=1 selects cuda:1"):
        _select(4, 1, local_rank=1, current=3)
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=4 selects cuda:4, but only 2 CUDA devices are visible"):
        _select(2, 4, local_rank=4)


def test_a_process_that_sees_one_gpu_uses_it_whatever_its_local_rank():
    """Issue 16 item 5: ``srun --gpus-per-task=1`` gives each task its own CUDA_VISIBLE_DEVICES."""
    for local_rank in (None, 0, 3):
        assert _select(1, 7, local_rank=local_rank) == (torch.device("cuda", 0), [0])


def test_an_nccl_group_started_by_tensorpar_is_bound_to_the_rank_s_gpu():
    """Found on the H200: without ``device_id`` every ``barrier()`` warned that it guessed the device."""
    from tensorpar.distributed import process_groups

    patches, calls = _fake_cuda(4)
    started = []
    env = {"RANK": "6", "WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "LOCAL_RANK": "2"}
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(unittest.mock.patch.dict(os.environ, env))
        stack.enter_context(unittest.mock.patch.object(process_groups.dist, "init_process_group",
                                                       lambda **kwargs: started.append(kwargs)))
        process_groups.init_default_group("nccl", None)
        process_groups.init_default_group("gloo", None)
    assert started == [{"backend": "nccl", "device_id": torch.device("cuda", 2)}, {"backend": "gloo"}]
    assert calls == [2]


def _user_created_nccl_group_body(max_connections):
    # The process group exists already (the user called init_process_group, as after torchrun);
    # it claims to be NCCL while torch.cuda answers as a machine with 2 GPUs.
    patches, calls = _fake_cuda(2)
    env = {} if max_connections is None else {"CUDA_DEVICE_MAX_CONNECTIONS": max_connections}
    with contextlib.ExitStack() as stack, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(unittest.mock.patch.dict(os.environ, env))
        if max_connections is None:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        stack.enter_context(unittest.mock.patch.object(tp.parallel_state.dist, "get_backend", lambda *a: "nccl"))
        tp.initialize_model_parallel(2)
        device = tp.parallel_state.default_device()
    warned = any("CUDA_DEVICE_MAX_CONNECTIONS" in str(w.message) for w in caught)
    return calls, device, warned


def test_initialize_selects_the_gpu_for_a_user_created_nccl_group_and_warns_about_connections():
    """Items 5 and 6."""
    results = run_on_ranks(_user_created_nccl_group_body, 2, None)
    assert results == [([r], torch.device("cuda", r), True) for r in range(2)]
    results = run_on_ranks(_user_created_nccl_group_body, 2, "1")
    assert [warned for _, _, warned in results] == [False, False]


# Megatron's layout, checked against a brute-force computation of the same definition: a rank is
# a point of the grid of `order`'s axes (first axis fastest); a group over some axes is the
# ranks agreeing on every other axis; groups are listed by the other axes' coordinates and
# members by the group's own, the last axis most significant.

AXES = ("tp", "cp", "ep", "dp", "pp")
LAYOUTS_8 = [dict(tp=2, pp=2, dp=2, cp=1, ep=1), dict(tp=2, pp=1, dp=2, cp=2, ep=1), dict(tp=1, pp=2, dp=2, cp=1, ep=2),
             dict(tp=8, pp=1, dp=1, cp=1, ep=1), dict(tp=1, pp=8, dp=1, cp=1, ep=1), dict(tp=1, pp=1, dp=4, cp=1, ep=2)]


def _brute_force_groups(sizes: dict, order: str, token: str) -> list[list[int]]:
    axes = order.split("-") + [a for a in AXES if a not in order.split("-")]
    inside = token.split("-")
    coords = itertools.product(*(range(sizes[a]) for a in reversed(axes)))  # last axis slowest
    points = [dict(zip(reversed(axes), c)) for c in coords]                 # index = global rank
    groups = {}
    for rank, point in enumerate(points):
        key = tuple(point[a] for a in reversed(axes) if a not in inside)
        groups.setdefault(key, []).append((tuple(point[a] for a in reversed(axes) if a in inside), rank))
    return [[r for _, r in sorted(members)] for _, members in sorted(groups.items())]


def _tokens():
    return ["-".join(c) for n in range(1, 6) for c in itertools.combinations(AXES, n)]


def test_rank_generator_matches_the_definition_for_every_order_and_token_at_8_ranks():
    checked = 0
    for layout in LAYOUTS_8:
        for order in ("-".join(p) for p in itertools.permutations(AXES)):
            gen = tp.RankGenerator(order=order, **layout)
            for token in _tokens():
                assert gen.get_ranks(token) == _brute_force_groups(layout, order, token), (layout, order, token)
                checked += 1
    assert checked == len(LAYOUTS_8) * 120 * 31


def test_rank_generator_examples_appends_missing_axes_and_offsets():
    gen = tp.RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp-pp")
    assert gen.order == "tp-dp-pp-ep-cp"
    assert gen.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gen.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.get_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert gen.get_ranks("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    shifted = tp.RankGenerator(tp=2, ep=1, dp=1, pp=1, cp=1, order="tp", rank_offset=4)
    assert shifted.get_ranks("tp") == [[4, 5]]
    assert tp.parallel_state.generate_masked_orthogonal_rank_groups(8, [2, 2, 2], [True, False, True]) == \
        [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_rank_generator_rejects_what_cannot_lay_out():
    with pytest.raises(RuntimeError, match="the pp size is 2 but order 'tp-dp' does not name pp"):
        tp.RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp")
    with pytest.raises(RuntimeError, match="ep=2 and cp=2 are both above 1"):
        tp.RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    with pytest.raises(RuntimeError, match="bad: \\['xp'\\]"):
        tp.RankGenerator(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp-xp")
    with pytest.raises(RuntimeError, match="a repeated axis"):
        tp.RankGenerator(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp-tp")


def test_hierarchical_groups_split_innermost_first():
    from tensorpar.distributed.rank_generator import hierarchical_rank_groups

    assert hierarchical_rank_groups(list(range(8)), [2, 4]) == [[[0, 1], [2, 3], [4, 5], [6, 7]],
                                                                 [[0, 2, 4, 6], [1, 3, 5, 7]]]
    assert hierarchical_rank_groups([10, 11, 12, 13], [2, 2]) == [[[10, 11], [12, 13]], [[10, 12], [11, 13]]]


def _members(group):
    return torch.distributed.get_process_group_ranks(group)


def _summed(group) -> int:
    """The ranks of ``group`` summed over ``group`` itself: proves it is a working communicator."""
    x = torch.tensor([float(torch.distributed.get_rank())])
    torch.distributed.all_reduce(x, group=group)
    return int(x.item())


def _layout_body(order, tp_size, pp_size, cp_size, ep_size, etp_size):
    ps = tp.parallel_state
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tp.initialize_model_parallel(tp_size, pp_size, context_parallel_size=cp_size,
                                 expert_model_parallel_size=ep_size, expert_tensor_parallel_size=etp_size, order=order)
    dp = world // (tp_size * pp_size * cp_size)
    edp = world // (etp_size * ep_size * pp_size)
    dense = dict(tp=tp_size, pp=pp_size, dp=dp, cp=cp_size, ep=1)
    expert = dict(tp=etp_size, pp=pp_size, dp=edp, cp=1, ep=ep_size)

    def mine(sizes, token):
        return next(g for g in _brute_force_groups(sizes, order, token) if rank in g)

    expected = {
        "tp": (ps.get_tensor_model_parallel_group(), mine(dense, "tp")),
        "pp": (ps.get_pipeline_model_parallel_group(), mine(dense, "pp")),
        "dp": (ps.get_data_parallel_group(), mine(dense, "dp")),
        "dp_cp": (ps.get_data_parallel_group(with_context_parallel=True), mine(dense, "cp-dp")),
        "cp": (ps.get_context_parallel_group(), mine(dense, "cp")),
        "mp": (ps.get_model_parallel_group(), mine(dense, "tp-pp")),
        "tp_dp": (ps.get_tensor_and_data_parallel_group(), mine(dense, "tp-dp")),
        "tp_dp_cp": (ps.get_tensor_and_data_parallel_group(with_context_parallel=True), mine(dense, "tp-cp-dp")),
        "tp_cp": (ps.get_tensor_and_context_parallel_group(), mine(dense, "tp-cp")),
        "ep": (ps.get_expert_model_parallel_group(), mine(expert, "ep")),
        "etp": (ps.get_expert_tensor_parallel_group(), mine(expert, "tp")),
        "tp_ep": (ps.get_expert_tensor_and_model_parallel_group(), mine(expert, "tp-ep")),
        "tp_ep_pp": (ps.get_expert_tensor_model_pipeline_parallel_group(), mine(expert, "tp-ep-pp")),
        "edp": (ps.get_expert_data_parallel_group(), mine(expert, "dp")),
        "dp_gloo": (ps.get_data_parallel_group_gloo(), mine(dense, "dp")),
    }
    for kind, (group, ranks) in expected.items():
        assert _members(group) == ranks, (kind, _members(group), ranks)
    for kind in ("tp", "pp", "dp_cp", "ep"):
        assert _summed(expected[kind][0]) == sum(expected[kind][1]), kind
    pipeline = expected["pp"][1]
    embedding = [pipeline[0], pipeline[-1]] if len(pipeline) > 1 else pipeline
    # As Megatron: only the members hold an (position) embedding group.
    if rank in embedding:
        assert _members(ps.get_embedding_group()) == embedding
    else:
        assert ps.get_embedding_group(check_initialized=False) is None
    if rank == pipeline[0]:
        assert _members(ps.get_position_embedding_group()) == pipeline[:1]
    else:
        assert ps.get_position_embedding_group(check_initialized=False) is None
    assert ps.is_rank_in_embedding_group() == (rank in embedding)
    assert ps.is_rank_in_position_embedding_group() == (rank == pipeline[0])
    # Ranks, sizes and source ranks agree with the groups.
    stage = pipeline.index(rank)
    assert (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()) == (stage, pp_size)
    assert ps.get_pipeline_model_parallel_first_rank() == pipeline[0]
    assert ps.get_pipeline_model_parallel_last_rank() == pipeline[-1]
    assert ps.get_pipeline_model_parallel_next_rank() == pipeline[(stage + 1) % pp_size]
    assert ps.get_pipeline_model_parallel_prev_rank() == pipeline[(stage - 1) % pp_size]
    assert ps.is_pipeline_first_stage() == (stage == 0) and ps.is_pipeline_last_stage() == (stage == pp_size - 1)
    assert ps.get_tensor_model_parallel_rank() == expected["tp"][1].index(rank)
    assert ps.get_tensor_model_parallel_src_rank() == expected["tp"][1][0]
    assert ps.get_data_parallel_src_rank() == expected["dp"][1][0]
    assert ps.get_data_parallel_src_rank(with_context_parallel=True) == expected["dp_cp"][1][0]
    assert ps.get_model_parallel_src_rank() == expected["mp"][1][0]
    assert ps.get_expert_model_parallel_src_rank() == expected["ep"][1][0]
    assert ps.get_data_parallel_world_size(with_context_parallel=True) == dp * cp_size
    assert ps.get_data_parallel_rank(with_context_parallel=True) == expected["dp_cp"][1].index(rank)
    assert ps.get_context_parallel_global_ranks() == expected["cp"][1]
    assert (ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()) == \
        (expected["cp"][1].index(rank), cp_size)
    assert ps.get_expert_data_parallel_world_size() == edp
    assert ps.get_expert_tensor_parallel_world_size() == etp_size
    assert ps.get_expert_model_parallel_rank() == expected["ep"][1].index(rank)
    assert ps.get_all_ranks() == "_".join(str(c) for c in (
        expected["tp"][1].index(rank), expected["dp"][1].index(rank), expected["cp"][1].index(rank), stage,
        expected["ep"][1].index(rank)))
    # One communicator per distinct rank list.
    distinct = {tuple(r) for _, r in expected.values()} | {tuple(embedding), tuple(pipeline[:1])}
    assert len(ps.created_groups()) <= len(distinct)
    return True


# (tp, pp, cp, ep, etp) per order: a dense and an expert/context layout each, and PP with CP;
# Megatron refuses a PP > 1 layout whose expert DP differs from the dense DP unless the order ends in pp.
ORDER_LAYOUTS = {
    "tp-cp-ep-dp-pp": [(2, 2, 1, 1, 2), (2, 1, 2, 1, 2), (1, 2, 1, 2, 1), (2, 4, 1, 1, 1), (2, 2, 2, 1, 2),
                       (1, 2, 2, 1, 1)],
    "tp-cp-pp-ep-dp": [(2, 2, 1, 1, 2), (2, 1, 2, 1, 2), (1, 2, 2, 1, 2)],
    "tp-ep-dp-pp": [(2, 2, 1, 1, 2), (1, 1, 1, 4, 2)],
    "tp-pp-ep-dp": [(2, 2, 1, 1, 2), (1, 1, 1, 4, 2)],
}


def _all_layouts_body():
    for order, layouts in ORDER_LAYOUTS.items():
        for layout in layouts:
            _layout_body(order, *layout)
            tp.destroy_model_parallel()
    return True


@pytest.mark.slow  # starting 8 ranks is most of it
def test_every_order_gives_each_group_megatrons_members_at_8_ranks():
    assert run_on_ranks(_all_layouts_body, 8) == [True] * 8


def _stages_body():
    ps = tp.parallel_state
    tp.initialize_model_parallel(1, 4, virtual_pipeline_model_parallel_size=2)
    stage = ps.get_pipeline_model_parallel_rank()
    assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
    assert ps.get_virtual_pipeline_model_parallel_rank() == 0
    with pytest.raises(ValueError, match="pass vp_stage="):
        ps.is_pipeline_first_stage(ignore_virtual=False)
    first = [ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v) for v in range(2)]
    last = [ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v) for v in range(2)]
    embedding = [ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=v) for v in range(2)]
    ignoring = (ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(), ps.is_rank_in_embedding_group())
    return stage, first, last, embedding, ignoring


def test_pipeline_stage_predicates_follow_megatrons_virtual_stage_rules():
    assert run_on_ranks(_stages_body, 4) == [
        (0, [True, False], [False, False], [True, False], (True, False, True)),
        (1, [False, False], [False, False], [False, False], (False, False, False)),
        (2, [False, False], [False, False], [False, False], (False, False, False)),
        (3, [False, False], [False, True], [False, True], (False, True, True)),
    ]


def _overrides_body():
    ps = tp.parallel_state
    tp.initialize_model_parallel(2)
    for name, value in [("tensor_model_parallel_world_size", 7), ("tensor_model_parallel_rank", 5),
                        ("pipeline_model_parallel_world_size", 3), ("pipeline_model_parallel_rank", 2),
                        ("expert_model_parallel_world_size", 6), ("expert_model_parallel_rank", 4),
                        ("expert_tensor_parallel_world_size", 9), ("expert_tensor_parallel_rank", 8)]:
        getattr(ps, f"set_{name}")(value)
        assert getattr(ps, f"get_{name}")() == value, name
        getattr(ps, f"set_{name}")(None)
    ps.set_data_parallel_rank(3)
    assert ps.get_data_parallel_rank() == 3
    ps.set_virtual_pipeline_model_parallel_world_size(4)
    with pytest.warns(DeprecationWarning):
        ps.set_virtual_pipeline_model_parallel_rank(1)
    assert (ps.get_virtual_pipeline_model_parallel_world_size(), ps.get_virtual_pipeline_model_parallel_rank()) == (4, 1)
    tp.destroy_model_parallel()
    # Destroy forgets overrides; without groups the "fake" initialisation still answers.
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    ps.set_tensor_model_parallel_world_size(4)
    ps.set_tensor_model_parallel_rank(1)
    assert (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()) == (4, 1)
    assert (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()) == (4, 1)
    tp.destroy_model_parallel()
    return True


def test_set_overrides_answer_until_reset_and_destroy_clears_them():
    assert run_on_ranks(_overrides_body, 2) == [True, True]


def _layout_errors_body():
    ps = tp.parallel_state
    cases = [(dict(pipeline_model_parallel_size=3), "world size 4 is not divisible by tensor_model_parallel_size 1 x "
                                                    "pipeline_model_parallel_size 3"),
             (dict(virtual_pipeline_model_parallel_size=2), "needs pipeline_model_parallel_size > 1"),
             (dict(expert_model_parallel_size=3), "expert_model_parallel_size 3"),
             (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_tensor_parallel_size=1,
                   order="tp-cp-pp-ep-dp"), "does not end in pp"),
             (dict(context_parallel_size=2, hierarchical_context_parallel_sizes=[4]), "must multiply to"),
             (dict(order="tp-xx"), "bad: \\['xx'\\]")]
    for kwargs, message in cases:
        with pytest.raises(ps.ParallelLayoutError, match=message):
            tp.initialize_model_parallel(**kwargs)
        assert not tp.model_parallel_is_initialized()
    with pytest.raises(ValueError, match="positive ints, got context_parallel_size=0"):
        tp.initialize_model_parallel(context_parallel_size=0)
    with pytest.raises(ValueError, match="not supported by tensorpar: use_sharp=True"):
        tp.initialize_model_parallel(use_sharp=True)
    assert issubclass(ps.ParallelLayoutError, ValueError) and issubclass(ps.ParallelLayoutError, RuntimeError)
    return True


def test_impossible_layouts_are_one_clear_error_before_any_group():
    assert run_on_ranks(_layout_errors_body, 4) == [True] * 4


def _extras_body():
    ps = tp.parallel_state
    tp.initialize_model_parallel(1, 1, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2],
                                 create_all_gather_group=True, num_distributed_optimizer_instances=2,
                                 hybrid_context_parallel=True)
    rank = torch.distributed.get_rank()
    levels = [_members(g) for g in ps.get_hierarchical_context_parallel_groups()]
    ag, regular = ps.get_data_parallel_group(True, independent_all_gather=True), ps.get_data_parallel_group(True)
    assert ps.has_separate_all_gather_group() and ag is not regular and _members(ag) == _members(regular)
    assert _summed(ag) == 6
    partial = _members(ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True))
    hybrid = _members(ps.get_hybrid_data_context_parallel_groups(group_size=2))
    with pytest.raises(ValueError, match="needs with_context_parallel=True"):
        ps.get_data_parallel_group(partial_data_parallel=True)
    tp.destroy_model_parallel()
    assert not ps.has_separate_all_gather_group() and ps.get_context_parallel_group(check_initialized=False) is None
    return rank, levels, partial, hybrid


def test_hierarchical_cp_all_gather_partial_and_hybrid_groups():
    results = run_on_ranks(_extras_body, 4)
    pairs, strided = [[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [levels for _, levels, _, _ in results] == [[p, s] for p, s in zip(pairs, strided)]
    assert [partial for _, _, partial, _ in results] == pairs
    assert [hybrid for _, _, _, hybrid in results] == pairs


def _group_count_body():
    """Megatron's ~20 group kinds collapse to few communicators, and destroy frees them."""
    tp.initialize_model_parallel(2, 4)
    made = len(tp.parallel_state.created_groups())
    tp.destroy_model_parallel()
    return made, len(tp.parallel_state.created_groups())


def test_coinciding_groups_share_one_communicator():
    # TP=2, PP=4 at 8 ranks: distinct lists per rank are TP {r, r^1}, PP, the singleton
    # (DP, CP, EP, ...), the embedding pair and the first stage; model parallel is the world.
    counts = run_on_ranks(_group_count_body, 8)
    assert all(after == 0 for _, after in counts)
    assert all(made <= 5 for made, _ in counts), counts


def _process_group_collection_body():
    import torch.distributed as dist

    from tensorpar import parallel_state as ps
    from tensorpar.process_groups_config import FIELDS, ProcessGroupCollection

    tp.initialize_model_parallel(2, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    every = ProcessGroupCollection.use_mpu_process_groups()
    assert every.tp is ps.get_tensor_model_parallel_group() and every.pp is ps.get_pipeline_model_parallel_group()
    assert every.dp_cp is ps.get_data_parallel_group(with_context_parallel=True)
    assert every.ep is ps.get_expert_model_parallel_group() and every.expt_dp is ps.get_expert_data_parallel_group()
    assert every.dp_cp_ag is None and every.expt_dp_ag is None and every.gtp_remat is None
    some = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "dp"])
    assert some.tp.size() == 2 and some.dp.size() == 2 and some.pp is None and some.ep is None
    assert repr(some) == "ProcessGroupCollection(tp(2), dp(2))"
    some.dp_cp_ag = every.dp_cp
    assert some.dp_cp_ag is every.dp_cp and len(FIELDS) == 27
    with pytest.raises(ValueError, match=r"Invalid process groups requested: \['tensor'\]"):
        ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tensor"])
    with pytest.raises(ValueError, match="Unknown attribute: tensor"):
        ProcessGroupCollection(tensor=every.tp)
    with pytest.raises(AttributeError):
        every.tensor  # noqa: B018
    return dist.get_process_group_ranks(every.tp)


def test_process_group_collection_holds_megatrons_fields_from_the_initialized_groups():
    """megatron-core's ``process_groups_config.ProcessGroupCollection`` (0.19's tests import it)."""
    assert run_on_ranks(_process_group_collection_body, 4) == [[0, 1], [0, 1], [2, 3], [2, 3]]


def _all_gather_groups_body():
    import torch.distributed as dist

    from tensorpar import parallel_state as ps

    with pytest.raises(RuntimeError, match=r"create_all_gather_groups\(\) needs initialize_model_parallel\(\) first"):
        ps.create_all_gather_groups()
    tp.initialize_model_parallel(1, context_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1)
    dense, none = ps.create_all_gather_groups()
    dense_again, experts = ps.create_all_gather_groups(for_expert_parallelism=True)
    usual = ps.get_data_parallel_group(with_context_parallel=True)
    assert none is None and dense is not usual and dense_again is not dense
    assert dist.get_process_group_ranks(dense) == dist.get_process_group_ranks(usual)
    assert dist.get_process_group_ranks(experts) == dist.get_process_group_ranks(ps.get_expert_data_parallel_group())
    dist.all_reduce(torch.ones(1), group=experts)  # a working communicator
    return dist.get_process_group_ranks(experts)


def test_create_all_gather_groups_makes_communicators_of_their_own_over_dp_cp_and_expert_dp():
    """megatron-core 0.19's ``parallel_state.create_all_gather_groups``."""
    assert run_in_fresh_world(_all_gather_groups_body, 4) == [[0, 2], [1, 3], [0, 2], [1, 3]]
