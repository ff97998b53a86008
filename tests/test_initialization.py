"""TP-invariant initialisation: shards of every TP size concatenate to the TP=1 weight."""

import pytest
import torch

import tensorpar as tp
from tensorpar.tensor_parallel import initialization
from tests.harness import run_on_ranks


def _full_weight(out_size, in_size, stride, partition_dim, seed):
    torch.manual_seed(seed)
    shape = (out_size, in_size) if partition_dim == 0 else (in_size, out_size)
    weight = torch.empty(shape)
    initialization.init_weight_shard(weight, tp.init_method_normal(0.02), partition_dim=partition_dim,
                                     stride=stride)
    return weight


def _shards_body(cases):
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    out = []
    for out_size, in_size, stride, seed in cases:
        torch.manual_seed(seed)
        column = tp.ColumnParallelLinear(in_size, out_size, stride=stride, bias=False)
        torch.manual_seed(seed)
        row = tp.RowParallelLinear(out_size, in_size, stride=stride, bias=False)
        # One draw of the default stream per weight, on every rank alike.
        after = torch.rand(1)
        out.append((column.weight.detach(), row.weight.detach(), after))
    return out


def _reassemble(shards, stride, dim):
    """Undo the strided split: block k of the full weight is the k-th piece of every shard."""
    pieces = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([p[k] for k in range(stride) for p in pieces], dim=dim)


CASES = [(24, 8, 1, 0), (24, 8, 2, 1), (24, 8, 3, 2)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shards_concatenate_to_the_tp1_weight(world_size):
    per_rank = run_on_ranks(_shards_body, world_size, CASES)
    for i, (out_size, in_size, stride, seed) in enumerate(CASES):
        full = _full_weight(out_size, in_size, stride, 0, seed)
        column = _reassemble([r[i][0] for r in per_rank], stride, 0)
        row = _reassemble([r[i][1] for r in per_rank], stride, 1)
        torch.testing.assert_close(column, full, rtol=0, atol=0)
        # The row layer's full weight is [in_size, out_size] split on dim 1.
        torch.testing.assert_close(row, _full_weight(out_size, in_size, stride, 1, seed), rtol=0, atol=0)
        assert len({float(r[i][2]) for r in per_rank}) == 1  # default stream still in step


def test_slabs_cover_weights_larger_than_one_slab(monkeypatch):
    """Slabs of 2 rows (10 elements // 4 per row): every shard spans several, and cuts some."""
    monkeypatch.setattr(initialization, "SLAB_ELEMENTS", 10)
    full = _full_weight(12, 4, 3, 0, 7)
    # Build the four TP=4 shards in one process: only the group's size and rank matter.
    monkeypatch.setattr(initialization.comm, "group_size", lambda g: g.size)
    monkeypatch.setattr(initialization.comm, "group_rank", lambda g: g.rank)
    shards = []
    for rank in range(4):
        torch.manual_seed(7)
        shard = torch.empty(3, 4)
        initialization.init_weight_shard(shard, tp.init_method_normal(0.02), partition_dim=0, stride=3,
                                         tp_group=_FakeGroup(4, rank))
        shards.append(shard)
    torch.testing.assert_close(_reassemble(shards, 3, 0), full, rtol=0, atol=0)
    assert full.std() > 0


class _FakeGroup:
    def __init__(self, size, rank):
        self.size, self.rank = size, rank


def test_init_method_statistics():
    torch.manual_seed(0)
    w = torch.empty(256, 256)
    initialization.init_weight_shard(w, tp.init_method_normal(0.02), partition_dim=0)
    assert abs(w.std().item() - 0.02) < 0.001
    assert abs(w.mean().item()) < 0.001


def test_parameter_attributes_and_duplicates():
    p = torch.nn.Parameter(torch.zeros(2))
    initialization.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (False, -1, 1)
    tp.set_tensor_model_parallel_attributes(p, is_parallel=True, dim=1, stride=2)
    assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (True, 1, 2)
    assert tp.param_is_not_tensor_parallel_duplicate(p)


def test_copy_keeps_the_optimizer_tags():
    source, destination = torch.empty(4, 4), torch.empty(4, 4)
    source.is_qkv, source.qkv_split_shapes, source.expert_tp = True, [256, 64, 64], True
    tp.copy_tensor_model_parallel_attributes(destination, source)
    assert (destination.is_qkv, destination.qkv_split_shapes, destination.expert_tp) == (True, [256, 64, 64], True)


class _RankOnly:
    def __init__(self, rank):
        self._rank = rank

    def rank(self):
        return self._rank


def test_an_expert_parameter_is_a_duplicate_by_its_expert_tp_rank():
    dense, expert = torch.empty(1), torch.empty(1)
    expert.allreduce = False
    tp_rank_1, expert_tp_rank_0 = _RankOnly(1), _RankOnly(0)
    assert not tp.param_is_not_tensor_parallel_duplicate(dense, tp_rank_1, expert_tp_group=expert_tp_rank_0)
    assert tp.param_is_not_tensor_parallel_duplicate(expert, tp_rank_1, expert_tp_group=expert_tp_rank_0)
    assert not tp.param_is_not_tensor_parallel_duplicate(expert, tp_rank_1)


def _deferred_init_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    torch.manual_seed(3)
    before = torch.random.get_rng_state()
    layer = tp.ColumnParallelLinear(8, 16, perform_initialization=False, device="meta")
    assert layer.weight.is_meta and torch.equal(torch.random.get_rng_state(), before)
    return tuple(layer.weight.shape)


def test_perform_initialization_false_skips_init_for_meta_or_deferred_weights():
    assert run_on_ranks(_deferred_init_body, 2) == [(8, 8), (8, 8)]


def _cuda_generators():
    """CUDA's generator states, or (CUDA not started) the seeds queued for them."""
    if torch.cuda.is_initialized():
        return [state.tolist() for state in torch.cuda.get_rng_state_all()]
    return list(torch.cuda._lazy_seed_tracker.get_calls())


def _accelerator_seeds_body():
    from tensorpar.models import GPT, GPTConfig

    tp.initialize_model_parallel(torch.distributed.get_world_size())
    torch.manual_seed(3)
    seeded = _cuda_generators()
    GPT(GPTConfig(vocab_size=64, max_seq_len=8, num_layers=2, num_heads=2, hidden_size=16))
    return any(seeded) and _cuda_generators() == seeded


def test_building_a_model_leaves_the_accelerator_generators_as_seeded():
    """Every part and slab seeds the CPU stream it restores, and that stream alone: the seed
    the user gave CUDA is the one it starts with (``torch.manual_seed`` per slab replaced it,
    and formatted a stack per accelerator backend each time, half of a small model's build)."""
    assert run_on_ranks(_accelerator_seeds_body, 2) == [True, True]
