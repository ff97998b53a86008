"""The chunked pipelines against the plain collective-then-GEMM (or GEMM-then-collective)."""

import dataclasses
import warnings

import pytest
import torch

import tensorpar as tp
from tensorpar.distributed import comm
from tensorpar.planning.communication import LinkModel
from tensorpar.tensor_parallel.overlap import all_gather_matmul, chunk_sizes, matmul_reduce
from tests.harness import run_on_ranks


def test_chunk_sizes_are_even_larger_first_and_capped_at_the_rows():
    assert chunk_sizes(8, 3) == [3, 3, 2]
    assert chunk_sizes(2, 4) == [1, 1]
    assert chunk_sizes(5, 1) == [5]
    assert chunk_sizes(0, 2) == [0]


def _pipelines_body():
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    group = tp.get_tensor_model_parallel_group()
    n, r = comm.group_size(group), comm.group_rank(group)
    torch.manual_seed(0)
    full, rhs, bias = torch.randn(6 * n, 3, 5), torch.randn(5, 7), torch.randn(7)
    partials = [torch.randn(6 * n, 3, 5) for _ in range(n)]
    for chunks in (1, 2, 4, 100):
        out, gathered = all_gather_matmul(full.chunk(n)[r], rhs, group, chunks=chunks, bias=bias,
                                          keep_gathered=True)
        # A batched GEMM over a chunk's rows may sum in another order than one over all rows.
        torch.testing.assert_close(out, torch.nn.functional.linear(full, rhs.t(), bias), rtol=0, atol=1e-5,
                                   msg=lambda m: f"chunks={chunks}: {m}")
        assert torch.equal(gathered, full), chunks  # pure data movement: exact
        for scatter in (False, True):
            expected = comm.all_reduce(partials[r] @ rhs, group)
            if scatter:
                expected = expected.chunk(n)[r]
            got = matmul_reduce(partials[r], rhs, group, chunks=chunks, scatter=scatter, async_op=True).wait()
            torch.testing.assert_close(got, expected, msg=lambda m: f"chunks={chunks} scatter={scatter}: {m}")
    return True


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_pipelines_equal_the_unchunked_computation(world_size):
    assert all(run_on_ranks(_pipelines_body, world_size))



def _gemm_count_body():
    """One (batched) GEMM per chunk, not one per rank and chunk; and the row layer's chunked SP
    weight gradient is one GEMM over all the gathered rows."""
    from tests.op_counter import OpCounter

    tp.initialize_model_parallel(torch.distributed.get_world_size())
    group = tp.get_tensor_model_parallel_group()
    n = comm.group_size(group)
    aten = torch.ops.aten
    gemms = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
             aten.mm.out, aten.addmm.out, aten.bmm.out, aten.baddbmm.out, aten.addmm_.default)
    x, rhs = torch.randn(4, 2, 5), torch.randn(5, 3)
    for run in (lambda: all_gather_matmul(x, rhs, group, chunks=2, bias=torch.randn(3)),
                lambda: matmul_reduce(torch.randn(4 * n, 2, 5), rhs, group, chunks=2, scatter=True)):
        with OpCounter() as counter:
            run()
        assert sum(counter.counts[g] for g in gemms) == 2, counter.counts
    layer = tp.RowParallelLinear(4 * n, 6, input_is_parallel=True, sequence_parallel=True, overlap=2, bias=False)
    y, _ = layer(torch.randn(8, 2, 4, requires_grad=True))
    with OpCounter() as counter:
        y.backward(torch.ones_like(y))
    # dgrad: one per chunk; wgrad: one.
    assert sum(counter.counts[g] for g in gemms) == 3, counter.counts
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_gemm_per_chunk_and_one_for_the_row_wgrad(world_size):
    assert all(run_on_ranks(_gemm_count_body, world_size))


def _interleave_body():
    """Two row-layer stages interleaved over batch halves equal the plain sequence of them."""
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n = tp.get_tensor_model_parallel_world_size()
    for sp in (False, True) if n > 1 else (False,):
        tp.model_parallel_manual_seed(0)
        layers = [tp.RowParallelLinear(8 * n, 4, input_is_parallel=True, sequence_parallel=sp) for _ in range(2)]
        lift = torch.randn(4, 8)  # a stage's own compute: widen the residual to the row input
        x = torch.randn(2 if sp else 2 * n, 4, 4, requires_grad=True)

        def widen(h):
            return (tp.gather_from_sequence_parallel_region(h) if sp else h) @ lift

        def run(forward):
            x.grad = None
            for layer in layers:
                layer.weight.grad = layer.bias.grad = None
            out = forward()
            out.backward(torch.ones_like(out))
            return [out.detach(), x.grad, *(p.grad for layer in layers for p in layer.parameters())]

        def plain():
            h = x
            for layer in layers:
                h = h + layer(widen(h))[0]
            return h

        stages = [(lambda h, layer=layer: layer.start(widen(h)), lambda h, reduced: h + reduced[0])
                  for layer in layers]
        for got, expected in zip(run(lambda: tp.interleave(x, stages, parts=2)), run(plain)):
            torch.testing.assert_close(got, expected, msg=lambda m: f"sp={sp}: {m}")
    return True


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_interleaved_halves_equal_the_plain_block(world_size):
    assert all(run_on_ranks(_interleave_body, world_size))


def test_interleave_warns_when_the_batch_has_fewer_rows_than_parts():
    """Issue 16 item 11: Domino at micro-batch 1 ran as one part, silently overlapping nothing."""

    class Done:
        def __init__(self, value):
            self.value = value

        def wait(self):
            return (self.value,)

    stages = [(lambda h: Done(2 * h), lambda h, reduced: h + reduced[0])]
    x = torch.randn(3, 1, 4)
    with pytest.warns(UserWarning, match=r"^interleave: 1 rows along dim 1 make 1 part\(s\), not the 2 asked for "
                                         r"\(1 part overlaps nothing\): interleaving needs at least 2 sequences"):
        assert torch.equal(tp.interleave(x, stages, parts=2), 3 * x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(tp.interleave(torch.cat([x, x], dim=1), stages, parts=2), 3 * torch.cat([x, x], dim=1))


def test_link_model_chunks_only_where_overlap_pays():
    # A GEMM and a collective of 1 ms each, 10 us latency.
    flops, sent = 1e9, 1e8
    gpu_like = LinkModel(latency_s=1e-5, bytes_per_s=1e11, flops_per_s=1e12, overlap=1.0)
    assert gpu_like.best_chunks(flops, sent, rows=64) == 8
    assert gpu_like.exposed_comm_time(flops, sent, 8) < gpu_like.exposed_comm_time(flops, sent, 1) / 4
    assert gpu_like.best_chunks(flops, sent, rows=2) == 2  # no more chunks than rows
    # Nothing hides (compute and communication share the cores): every chunk only adds latency.
    assert dataclasses.replace(gpu_like, overlap=0.0).best_chunks(flops, sent, rows=64) == 1
    # Latency-bound: a 1 us GEMM and a 10 us collective gain nothing from splitting.
    assert gpu_like.best_chunks(1e6, 1e3, rows=64) == 1


def _sent(counter) -> int:
    """Collectives sent: the c10d ops ``counter`` saw."""
    return sum(count for op, count in counter.counts.items() if op.namespace == "c10d")


def _auto_body():
    """overlap="auto": refused before tp.calibrate_overlap; the calibration's collectives are
    issued through comm (a ledger sees every one), on the backend's device, sized from the
    layers' shapes; afterwards a forward issues only its own collectives, the same decision on
    every rank and the same result as overlap off."""
    from tests.op_counter import OpCounter
    from tests.strict_device import strict_collective_device

    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n = tp.get_tensor_model_parallel_world_size()
    records, outputs = [], []
    tokens = 64 * 4
    for overlap in ("off", "auto"):
        tp.model_parallel_manual_seed(0)
        fc1 = tp.ColumnParallelLinear(64, 256, sequence_parallel=n > 1, overlap=overlap)
        fc2 = tp.RowParallelLinear(256, 64, input_is_parallel=True, sequence_parallel=n > 1, overlap=overlap)
        torch.manual_seed(1)
        x = torch.randn(64, 4, 64).chunk(n)[tp.get_tensor_model_parallel_rank()].clone().requires_grad_()
        if overlap == "auto" and n > 1:
            with pytest.raises(RuntimeError, match=r"tp.calibrate_overlap\(model, tokens=...\)"):
                fc1(x)
            with tp.CommLedger() as ledger, OpCounter() as counter, \
                    strict_collective_device(tp.get_tensor_model_parallel_group()):
                links = tp.calibrate_overlap(torch.nn.ModuleList([fc1, fc2]), tokens=tokens)
            assert len(links) == 1 and fc1.overlap_link is fc2.overlap_link is links[0]
            assert 0 < ledger.count() == _sent(counter)
            # Sized as fc1's own collective: [tokens, 64].
            assert max(r.bytes for r in ledger.records) == tokens * 64 * 4
        with tp.CommLedger() as ledger, OpCounter() as counter:
            y, _ = fc2(torch.nn.functional.gelu(fc1(x)[0]))
            y.sum().backward()
        assert ledger.count() == _sent(counter)  # nothing issued behind the ledger's back
        records.append([(r.op, r.shape) for r in ledger.records])
        outputs.append([y.detach(), x.grad, fc1.weight.grad, fc2.weight.grad])
    for got, expected in zip(*outputs):
        torch.testing.assert_close(got, expected)
    return records[1]


@pytest.mark.parametrize("world_size", [1, 2])
def test_auto_overlap_is_calibrated_explicitly_and_decides_alike_on_every_rank(world_size):
    records = run_on_ranks(_auto_body, world_size)
    assert all(r == records[0] for r in records)


class _Lazy:
    """An async collective that happens only when waited for: what a slow link looks like."""

    def __init__(self, finish, result):
        self._finish, self._result = finish, result

    def wait(self):
        if self._finish is not None:
            self._finish()
            self._finish = None
        return self._result


def _lazy_collectives(real):
    """Async versions of the ``real`` collectives whose output is NaN until ``wait()``: reading
    one early, or never waiting, shows up as NaN or a wrong result."""
    def all_gather(tensor, group, *, dim=0, async_op=False, out=None):
        if not async_op:
            return real["all_gather"](tensor, group, dim=dim, out=out)
        sent, out = tensor.clone(), out if out is not None else tensor.new_empty(
            [tensor.shape[0] * comm.group_size(group), *tensor.shape[1:]])
        out.fill_(float("nan"))
        return _Lazy(lambda: real["all_gather"](sent, group, out=out), out)

    def all_reduce(tensor, group, *, op="sum", async_op=False):
        if not async_op:
            return real["all_reduce"](tensor, group, op=op)
        sent = tensor.clone()
        tensor.fill_(float("nan"))
        return _Lazy(lambda: real["all_reduce"](tensor.copy_(sent), group, op=op), tensor)

    def reduce_scatter(tensor, group, *, dim=0, async_op=False, op="sum", out=None):
        if not async_op:
            return real["reduce_scatter"](tensor, group, dim=dim, op=op, out=out)
        sent = tensor.clone()
        out = out if out is not None else tensor.new_empty([tensor.shape[0] // comm.group_size(group),
                                                            *tensor.shape[1:]])
        out.fill_(float("nan"))
        return _Lazy(lambda: real["reduce_scatter"](sent, group, op=op, out=out), out)

    return dict(all_gather=all_gather, all_reduce=all_reduce, reduce_scatter=reduce_scatter)


def _stream_order_body():
    """Every chunked pipeline and the interleaved block wait for each collective before reading
    its result, and leave nothing in flight: checked with collectives that complete only on wait."""
    tp.initialize_model_parallel(torch.distributed.get_world_size())
    n = tp.get_tensor_model_parallel_world_size()

    def step(sp, overlap, interleaved):
        tp.model_parallel_manual_seed(0)
        fc1 = tp.ColumnParallelLinear(16, 32, sequence_parallel=sp, overlap=overlap)
        fc2 = tp.RowParallelLinear(32, 16, input_is_parallel=True, sequence_parallel=sp, overlap=overlap)
        torch.manual_seed(1)
        x = torch.randn(8 * n, 4, 16).chunk(n)[tp.get_tensor_model_parallel_rank()] if sp else torch.randn(8, 4, 16)
        x = x.clone().requires_grad_()
        stage = (lambda h: fc2.start(torch.nn.functional.gelu(fc1(h)[0])), lambda h, reduced: h + reduced[0])
        y = tp.interleave(x, [stage], parts=2) if interleaved else x + fc2(torch.nn.functional.gelu(fc1(x)[0]))[0]
        y.sum().backward()
        return [y.detach(), x.grad, fc1.weight.grad, fc2.weight.grad]

    real = {name: getattr(comm, name) for name in ("all_gather", "all_reduce", "reduce_scatter")}
    for sp in (False, True):
        expected = step(sp, "off", False)
        for overlap, interleaved in ((3, False), ("off", True)):
            for name, fake in _lazy_collectives(real).items():
                setattr(comm, name, fake)
            try:
                got = step(sp, overlap, interleaved)
            finally:
                for name, fn in real.items():
                    setattr(comm, name, fn)
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, msg=lambda m: f"sp={sp} overlap={overlap} interleaved={interleaved}: {m}")
    return True


def test_results_are_read_only_after_their_collective_completes():
    assert all(run_on_ranks(_stream_order_body, 2))


# 6 query heads on 2 K/V heads, an FFN of 100: TP 3 and 4 split neither evenly (QKV rows and
# FFN columns differ between ranks, K/V heads are replicated).
UNEVEN = dict(vocab_size=64, max_seq_len=16, num_layers=2, num_heads=6, num_query_groups=2, hidden_size=48,
              ffn_hidden_size=100, make_vocab_size_divisible_by=8)


def _auto_layers(model):
    return [m for m in model.modules() if isinstance(m, (tp.ColumnParallelLinear, tp.RowParallelLinear))
            and m.overlap == "auto"]


def _splitting_link(layers, *, tokens: int, rows: int, n: int):
    """A link model on which some uneven layer's best chunk count (``rows``: its input's, the
    sequence or its SP shard) differs between its ranks' own shards (what deciding by this rank's GEMM would do): a search over GEMM speeds, alike on every rank."""
    for flops_per_s in (10.0 ** (k / 8) for k in range(8, 120)):
        link = LinkModel(latency_s=1e-6, bytes_per_s=1e9, flops_per_s=flops_per_s, overlap=1.0)
        for layer in (layer for layer in layers if layer.partition_sizes is not None):
            column = isinstance(layer, tp.ColumnParallelLinear)
            # The collective's width is the GEMM's unsplit dimension.
            width = layer.input_size if column else layer.output_size
            op = ("all_gather" if column else "reduce_scatter") if layer.sequence_parallel else "all_reduce"
            sent = comm.bytes_sent_per_rank(op, tokens * width * 4, n)
            if len({link.best_chunks(2 * tokens * size * width, sent, rows) for size in layer.partition_sizes}) > 1:
                return link
    return None


def _uneven_auto_body(sequence_parallel):
    from tensorpar.models import GPT, GPTConfig

    tp.initialize_model_parallel(torch.distributed.get_world_size())
    group, n = tp.get_tensor_model_parallel_group(), tp.get_tensor_model_parallel_world_size()
    generator = torch.Generator().manual_seed(3)
    batch = torch.randint(0, UNEVEN["vocab_size"], (2, UNEVEN["max_seq_len"] + 1), generator=generator)
    tokens, labels = batch[:, :-1], batch[:, 1:]
    rows = UNEVEN["max_seq_len"]
    runs, links = {}, None
    for overlap in ("off", "auto"):
        tp.model_parallel_manual_seed(5)
        model = GPT(GPTConfig(**UNEVEN, overlap=overlap, sequence_parallel=sequence_parallel), tp_group=group)
        if overlap == "auto":
            layers = _auto_layers(model)
            assert any(layer.partition_sizes is not None for layer in layers)  # the layout is uneven
            with tp.CommLedger() as ledger:
                measured = tp.calibrate_overlap(model, tokens=tokens.numel())
            # Every rank measured the same shapes, so holds the same link models.
            links = ([(r.op, r.shape) for r in ledger.records], [dataclasses.astuple(m) for m in measured])
            link = _splitting_link(layers, tokens=tokens.numel(), rows=-(-rows // n) if sequence_parallel else rows, n=n)
            assert link is not None  # a link on which deciding by this rank's shard would split the ranks
            for layer in layers:
                layer.overlap_link = link
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        with tp.CommLedger() as ledger:
            for _ in range(2):
                optimizer.zero_grad()
                loss = model(tokens, labels)
                loss.backward()
                tp.allreduce_sequence_parallel_grads(model)
                optimizer.step()
                losses.append(loss.item())
        runs[overlap] = (losses, [(r.op, r.shape) for r in ledger.records])
    return runs, links


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_auto_overlap_of_an_uneven_layout_decides_alike_on_every_rank(world_size, sequence_parallel):
    """Issue 25, item 1: with uneven heads, K/V heads and FFN, every rank measures and chooses
    its chunk counts from rank-independent sizes: the same collectives on every rank, the same
    training as overlap off (to rounding), on a link where this rank's own shard would split them."""
    results = run_on_ranks(_uneven_auto_body, world_size, sequence_parallel, timeout=120)
    (runs, links), others = results[0], results[1:]
    for other_runs, other_links in others:
        assert other_links == links
        assert other_runs["auto"][1] == runs["auto"][1]
    assert len(runs["auto"][1]) > len(runs["off"][1])  # the chunked pipelines ran
    for rank_runs, _ in results:
        assert rank_runs["auto"][0] == pytest.approx(rank_runs["off"][0], rel=1e-5)
