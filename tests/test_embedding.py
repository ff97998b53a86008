"""VocabParallelEmbedding against F.embedding on the full table, at TP = 1, 2, 4."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import tensorpar as tp
from tensorpar.tensor_parallel import embedding as embedding_module
from tensorpar.tensor_parallel.initialization import init_method_normal, init_weight_shard
from tests.harness import run_on_ranks

WORLD_SIZES = [1, 2, 4]
VOCAB, HIDDEN, BATCH, SEQ = 16, 6, 2, 8


def _full_weight(seed, dtype=torch.float32):
    """The TP=1 table that every TP size must reproduce shard by shard."""
    weight = torch.empty(VOCAB, HIDDEN, dtype=dtype)
    torch.manual_seed(seed)
    init_weight_shard(weight, init_method_normal(0.02), partition_dim=0)
    return weight


def _layer(seed, **kwargs):
    torch.manual_seed(seed)
    return tp.VocabParallelEmbedding(VOCAB, HIDDEN, **kwargs)


def _reference(full_weight, ids, grad_out):
    weight = full_weight.clone().requires_grad_(True)
    out = F.embedding(ids, weight)
    out.backward(grad_out)
    return out.detach(), weight.grad


def _embedding_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    ids[0, :3] = 5  # a frequent id: its weight-grad row sums several tokens
    ids[1, -1] = VOCAB - 1
    grad_out = torch.randn(BATCH, SEQ, HIDDEN)
    full = _full_weight(seed=7)
    ref_out, ref_grad = _reference(full, ids, grad_out)
    rows = slice(r * VOCAB // n, (r + 1) * VOCAB // n)

    layer = _layer(7)
    w = layer.weight
    assert w.shape == (VOCAB // n, HIDDEN)
    assert (w.tensor_model_parallel, w.partition_dim, w.partition_stride) == (True, 0, 1)
    assert (layer.vocab_start_index, layer.vocab_end_index) == (rows.start, rows.stop)
    torch.testing.assert_close(w.detach(), full[rows])  # TP-invariant init

    out = layer(ids)
    out.backward(grad_out)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(w.grad, ref_grad[rows])

    # Deterministic backward, with blocks small enough that the one-hot GEMM runs in pieces.
    saved_block = embedding_module._ONE_HOT_BLOCK_ELEMENTS
    for block in (saved_block, 3 * (VOCAB // n)):
        embedding_module._ONE_HOT_BLOCK_ELEMENTS = block
        try:
            det = _layer(7, deterministic=True)
            det_out = det(ids)
            det_out.backward(grad_out)
        finally:
            embedding_module._ONE_HOT_BLOCK_ELEMENTS = saved_block
        torch.testing.assert_close(det_out, out)
        torch.testing.assert_close(det.weight.grad, w.grad)

    # Straight into the sequence-parallel layout: [b, s] -> [s/TP, b, h].
    seq = slice(r * SEQ // n, (r + 1) * SEQ // n)
    for deterministic in (False, True):
        rs = _layer(7, reduce_scatter_embeddings=True, deterministic=deterministic)
        rs_out = rs(ids)
        assert rs_out.shape == (SEQ // n, BATCH, HIDDEN)
        torch.testing.assert_close(rs_out, ref_out.transpose(0, 1)[seq])
        rs_out.backward(grad_out.transpose(0, 1)[seq])
        torch.testing.assert_close(rs.weight.grad, ref_grad[rows])

    # bf16 table: only zeros are added to the owned row, so the lookup is exact.
    bf16 = _layer(7, params_dtype=torch.bfloat16)
    assert bf16.weight.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.weight.detach(), _full_weight(7, torch.bfloat16)[rows])
    bf16_out = bf16(ids)
    assert bf16_out.dtype == torch.bfloat16
    torch.testing.assert_close(bf16_out, F.embedding(ids, _full_weight(7, torch.bfloat16)))

    # An explicit group and a non-default init_method.
    torch.manual_seed(3)
    explicit = tp.VocabParallelEmbedding(VOCAB, HIDDEN, tp_group=tp.get_tensor_model_parallel_group(),
                                         init_method=torch.nn.init.ones_)
    torch.testing.assert_close(explicit(ids), torch.ones(BATCH, SEQ, HIDDEN))
    # perform_initialization=False leaves the weight alone and draws nothing from the generator.
    state = torch.get_rng_state()
    bare = tp.VocabParallelEmbedding(VOCAB, HIDDEN, perform_initialization=False)
    assert bare.weight.shape == (VOCAB // n, HIDDEN) and torch.equal(torch.get_rng_state(), state)
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_embedding_matches_full_table(world_size):
    assert run_on_ranks(_embedding_body, world_size) == [True] * world_size


def _errors_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n = tp.get_tensor_model_parallel_world_size()
    layer = tp.VocabParallelEmbedding(VOCAB, HIDDEN)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for bad in (-1, VOCAB, VOCAB + 5):
        ids[1, 2] = bad
        with pytest.raises(ValueError, match=rf"token id {bad} is out of range .*num_embeddings={VOCAB}"):
            layer(ids)
    with pytest.raises(TypeError, match="integer"):
        layer(torch.zeros(BATCH, SEQ))
    if n > 1:
        with pytest.raises(ValueError, match=rf"num_embeddings \({VOCAB + 1}\) .* size \({n}\)"):
            tp.VocabParallelEmbedding(VOCAB + 1, HIDDEN)
    return True


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_bad_ids_and_sizes_raise(world_size):
    assert run_on_ranks(_errors_body, world_size) == [True] * world_size


def _ledger_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    records = {}
    for reduce_scatter in (False, True):
        layer = tp.VocabParallelEmbedding(VOCAB, HIDDEN, reduce_scatter_embeddings=reduce_scatter)
        with tp.CommLedger() as ledger:
            with ledger.phase("forward"):
                out = layer(ids)
            with ledger.phase("backward"):
                out.sum().backward()
        records[reduce_scatter] = [(rec.op, rec.phase, rec.reduce_op, rec.shape, rec.dtype, rec.bytes)
                                   for rec in ledger.records]
    return records


def test_embedding_collectives_at_tp2():
    records, _ = run_on_ranks(_ledger_body, 2)
    nbytes = BATCH * SEQ * HIDDEN * 4
    assert records[False] == [("all_reduce", "forward", "sum", (BATCH, SEQ, HIDDEN), torch.float32, nbytes)]
    assert records[True] == [
        ("reduce_scatter", "forward", "sum", (SEQ, BATCH, HIDDEN), torch.float32, nbytes),
        ("all_gather", "backward", None, (SEQ, BATCH, HIDDEN), torch.float32, nbytes),
    ]


def _megatron_config_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n, r = tp.get_tensor_model_parallel_world_size(), tp.get_tensor_model_parallel_rank()
    # A ModelParallelConfig's fields, plus one tensorpar does not read.
    config = SimpleNamespace(params_dtype=torch.float64, deterministic_mode=True, perform_initialization=True,
                             use_cpu_initialization=True, sequence_parallel=True)
    torch.manual_seed(7)
    layer = tp.VocabParallelEmbedding(VOCAB, HIDDEN, init_method=init_method_normal(0.02),
                                      reduce_scatter_embeddings=False, config=config, tp_group=None)
    assert layer.deterministic and layer.weight.dtype == torch.float64 and layer.weight.device.type == "cpu"
    assert torch.equal(layer.weight, _full_weight(7, torch.float64).chunk(n, 0)[r])
    with pytest.raises(ValueError, match=r"VocabParallelEmbedding: deterministic=True contradicts "
                                         r"config.deterministic_mode=False"):
        tp.VocabParallelEmbedding(VOCAB, HIDDEN, config=SimpleNamespace(deterministic_mode=False), deterministic=True)
    return True


def test_embedding_takes_megatron_config():
    assert run_on_ranks(_megatron_config_body, 2) == [True, True]


def test_embedding_before_initialize_is_a_clear_error():
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        tp.VocabParallelEmbedding(VOCAB, HIDDEN)


def _hot_path_body(read_back: bool):
    """Items 8 and 9: no host sync off CPU (asynchronous range check), and the lookup's own
    output is masked and summed in place: no other [b, s, h] tensor is made."""
    import unittest.mock

    from tests.op_counter import OpCounter

    tp.initialize_model_parallel(torch.distributed.get_world_size())
    layer = _layer(0)
    ids = torch.randint(0, layer.num_embeddings, (2, 5))
    with unittest.mock.patch("tensorpar.errors._reads_back", lambda t: read_back):
        with OpCounter(big=ids.numel() * layer.embedding_dim) as ops:
            out = layer(ids)
        with pytest.raises((ValueError, RuntimeError), match="token id .*out of range for an embedding"):
            layer(torch.full((2, 5), layer.num_embeddings))
    full = _full_weight(0)
    torch.testing.assert_close(out, full[ids])
    return ops.host_syncs, ops.fresh_big_results


def test_embedding_forward_sums_its_lookup_in_place_and_does_not_sync_off_cpu():
    assert run_on_ranks(_hot_path_body, 2, False) == [(0, 1)] * 2
    assert run_on_ranks(_hot_path_body, 2, True) == [(2, 1)] * 2
