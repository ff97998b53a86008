"""tp.fully_shard (FSDP2 over the DP group) composed with TP, against plain DP at TP 2 x DP 2."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import tensorpar as tp
from tensorpar.distributed import comm
from tensorpar.data_parallel.fsdp import MIN_UNIT_MIB, bytes_per_rank, consecutive_groups, describe, gather_dp_shards
from tensorpar.data_parallel.grads import DataParallelGradReducer, allreduce_sequence_parallel_grads, clip_grad_norm_
from tensorpar.models import GPT, GPTConfig
from tensorpar.models.layout import gather_full_tensor
from tests.harness import run_on_ranks
from tests.test_training_checkpoint import checkpoint_meta

BASE = dict(vocab_size=40, max_seq_len=8, num_layers=2, num_heads=2, hidden_size=16, dropout=0.0)


def _build(config, seed=3):
    tp.model_parallel_manual_seed(seed)
    torch.manual_seed(seed)
    return GPT(config)


_full = gather_dp_shards


def _unsharded_norm(model) -> torch.Tensor:
    """The norm of the TP=1 gradient, from every parameter's gradient gathered over DP and TP."""
    tp_group = tp.get_tensor_model_parallel_group()
    squares = []
    for p in model.parameters():
        grad = _full(p.grad)
        if getattr(p, "tensor_model_parallel", False):
            grad = gather_full_tensor(grad, partition_dim=p.partition_dim, stride=p.partition_stride,
                                      tp_group=tp_group)
        squares.append(grad.double().square().sum())
    return torch.stack(squares).sum().sqrt()


def _batch(step: int, micro: int, dp_rank: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dp_rank)
    tokens = torch.randint(0, BASE["vocab_size"], (2, 8), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def test_consecutive_blocks_make_a_unit_once_they_hold_the_least_size():
    assert consecutive_groups([3, 3, 3, 3, 3], at_least=5) == ([[0, 1], [2, 3]], [4])
    assert consecutive_groups([6, 1, 1, 5], at_least=6) == ([[0], [1, 2, 3]], [])
    assert consecutive_groups([3, 3], at_least=0) == ([[0], [1]], [])
    assert consecutive_groups([3, 3], at_least=7) == ([], [0, 1])


def _min_unit_mib(model, units: str) -> float:
    """``fully_shard``'s ``min_unit_mib`` for ``units``: "per block", "default" (BASE's blocks in
    the root) or "pairs" (units of two blocks, the blocks after the last pair in the root)."""
    block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    return {"per block": 0, "default": MIN_UNIT_MIB, "pairs": 1.5 * block / 2**20}[units]


def _fsdp_units(model) -> list[list[str]]:
    """The names of the blocks in each FSDP unit but the root."""
    units = {}
    for i, block in enumerate(model.blocks):
        if isinstance(block, FSDPModule):
            units.setdefault(id(torch.distributed.fsdp.fully_shard.state(block)), []).append(f"blocks.{i}")
    return list(units.values())


def _versus_plain_dp_body(overrides: dict, accumulate: int, reshard: bool, units: str):
    tp.initialize_model_parallel(2)
    dp_rank, dp_group = tp.get_data_parallel_rank(), tp.get_data_parallel_group()
    config = GPTConfig(**{**BASE, **overrides})
    plain, sharded = _build(config), _build(config)
    tp.fully_shard(sharded, reshard_after_forward=reshard, min_unit_mib=_min_unit_mib(sharded, units))
    per_block = [[f"blocks.{i}"] for i in range(config.num_layers)]
    expected = per_block if config.recompute else {
        "per block": per_block, "default": [],
        "pairs": [[f"blocks.{i}", f"blocks.{i + 1}"] for i in range(0, config.num_layers - 1, 2)]}[units]
    assert _fsdp_units(sharded) == expected
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    reducer = DataParallelGradReducer(plain.parameters(), dp_group=dp_group)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_sharded = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    for step in range(3):
        reducer.zero_grad()
        opt_sharded.zero_grad()
        for k in range(accumulate):
            tokens, labels = _batch(step, k, dp_rank)
            last = k == accumulate - 1
            reducer.sync = last
            sharded.set_requires_gradient_sync(last)
            loss_plain = plain(tokens, labels) / accumulate
            loss_sharded = sharded(tokens, labels) / accumulate
            torch.testing.assert_close(loss_sharded, loss_plain, rtol=1e-5, atol=1e-5)
            loss_plain.backward()
            loss_sharded.backward()
        reducer.finish()
        allreduce_sequence_parallel_grads(plain)
        allreduce_sequence_parallel_grads(sharded)
        expected_norm = _unsharded_norm(sharded)
        # A small max_norm, so clipping scales every gradient.
        norm_plain = clip_grad_norm_(plain.parameters(), 0.05)
        norm_sharded = clip_grad_norm_(sharded.parameters(), 0.05, dp_group=dp_group)
        torch.testing.assert_close(norm_sharded.double(), expected_norm, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norm_sharded, norm_plain, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(sharded.named_parameters(), plain.parameters()):
            torch.testing.assert_close(_full(p.grad), q.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        opt_plain.step()
        opt_sharded.step()
    for (name, p), q in zip(sharded.named_parameters(), plain.parameters()):
        torch.testing.assert_close(_full(p.data), q.data, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    return True


@pytest.mark.parametrize("overrides, accumulate, reshard, units", [
    ({}, 1, True, "per block"),
    ({"sequence_parallel": True}, 1, True, "default"),
    ({"sequence_parallel": True, "num_layers": 5}, 2, True, "pairs"),
    # Blocks that recompute are one unit each whatever min_unit_mib asks.
    ({"sequence_parallel": True, "recompute": True}, 2, True, "default"),
    ({"tie_word_embeddings": False, "norm": "rmsnorm", "activation": "swiglu", "position_embedding": "rope",
      "bias": False, "num_layers": 3}, 2, False, "pairs"),
], ids=["plain", "sp", "sp-pairs-accumulate", "sp-recompute-accumulate", "untied-llama-zero2-pairs"])
def test_fsdp_matches_plain_data_parallel(overrides, accumulate, reshard, units):
    assert run_on_ranks(_versus_plain_dp_body, 4, overrides, accumulate, reshard, units) == [True] * 4


def _hsdp_body():
    """HSDP 2 x 2 at TP 1, a unit of two blocks and the root: plain DP's losses, grads, norms and weights."""
    from tensorpar.data_parallel.fsdp import shard_group

    tp.initialize_model_parallel(1)
    dp_rank, dp_group = tp.get_data_parallel_rank(), tp.get_data_parallel_group()
    config = GPTConfig(**{**BASE, "num_layers": 3})
    plain, hybrid = _build(config), _build(config)
    tp.fully_shard(hybrid, dp_replicate=2, min_unit_mib=_min_unit_mib(hybrid, "pairs"))
    assert _fsdp_units(hybrid) == [["blocks.0", "blocks.1"]]  # and block 2 in the root
    word = hybrid.embedding.word.weight
    assert word.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert word.device_mesh.mesh.tolist() == [[0, 1], [2, 3]] and word.placements[0].is_replicate()
    group = shard_group(word)
    assert comm.group_size(group) == 2 and word.to_local().shape[0] == -(-word.shape[0] // 2)
    me = dist.get_rank()
    assert describe(hybrid) == (f"HSDP on a 2 x 2 mesh: dim 0 (dp_replicate) replicates over ranks {[me % 2, me % 2 + 2]}, "
                                f"dim 1 (dp_shard) shards each TP shard 1/2 over ranks {[me - me % 2, me - me % 2 + 1]}, "
                                "in 2 units")
    with pytest.raises(ValueError, match="HSDP shards split over 2 ranks, not dp_group's 4"):
        word.grad = word.detach().clone()
        clip_grad_norm_(hybrid.parameters(), 1.0, dp_group=dp_group)
    word.grad = None
    reducer = DataParallelGradReducer(plain.parameters(), dp_group=dp_group)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_hybrid = torch.optim.AdamW(hybrid.parameters(), lr=1e-2)
    close = dict(rtol=1e-6, atol=1e-8)
    for step in range(3):
        reducer.zero_grad()
        opt_hybrid.zero_grad()
        for k in range(2):
            tokens, labels = _batch(step, k, dp_rank)
            reducer.sync = k == 1
            hybrid.set_requires_gradient_sync(k == 1)
            loss_plain, loss_hybrid = plain(tokens, labels) / 2, hybrid(tokens, labels) / 2
            torch.testing.assert_close(loss_hybrid, loss_plain, **close)
            loss_plain.backward()
            loss_hybrid.backward()
        reducer.finish()
        norm_plain = clip_grad_norm_(plain.parameters(), 0.05)
        norm_hybrid = clip_grad_norm_(hybrid.parameters(), 0.05, dp_group=group)
        torch.testing.assert_close(norm_hybrid, norm_plain, **close)
        for (name, p), q in zip(hybrid.named_parameters(), plain.parameters()):
            torch.testing.assert_close(_full(p.grad), q.grad, **close, msg=lambda m: f"{name}: {m}")
        opt_plain.step()
        opt_hybrid.step()
    # AdamW's steps of 1e-2 turn fp32 noise in a small gradient into differences far above its 1e-6 relative.
    for (name, p), q in zip(hybrid.named_parameters(), plain.parameters()):
        torch.testing.assert_close(_full(p.data), q.data, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match="dp_replicate=3 does not divide the DP size 4"):
        tp.fully_shard(_build(config), dp_replicate=3)
    return True


def test_hsdp_2x2_matches_plain_data_parallel():
    assert run_on_ranks(_hsdp_body, 4) == [True] * 4


def _layout_body():
    tp.initialize_model_parallel(2)
    model = tp.fully_shard(_build(GPTConfig(**BASE, sequence_parallel=True)), min_unit_mib=0)
    dp = tp.get_data_parallel_world_size()
    word = model.embedding.word.weight
    # The TP shard is sharded once more over DP along dim 0: [V/TP, h] -> [V/(TP*DP), h] here.
    assert word.to_local().shape[0] == word.shape[0] // dp and word.shape[0] == model.padded_vocab_size // 2
    assert word.tensor_model_parallel and word.partition_dim == 0
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(p.sequence_parallel for p in norms)
    # The tied weight lives in the root unit (the LM head owns no parameter).
    assert not isinstance(model.embedding, FSDPModule) and not isinstance(model.lm_head, FSDPModule)
    assert all(isinstance(block, FSDPModule) for block in model.blocks) and isinstance(model, FSDPModule)
    assert describe(model).startswith("FSDP shards each TP shard 1/2 over ranks") and describe(model).endswith(
        ", in 3 units")  # the run header's
    root_only = tp.fully_shard(_build(GPTConfig(**BASE)))
    assert describe(root_only).endswith(", in 1 unit")
    return True


def test_tp_attributes_survive_sharding_and_the_tied_weight_stays_in_the_root():
    assert run_on_ranks(_layout_body, 4) == [True] * 4


def _refusal_body():
    tp.initialize_model_parallel(1)
    cases = {
        "gradient_accumulation_fusion=True": lambda: _build(GPTConfig(**BASE, gradient_accumulation_fusion=True)),
        "torch.bfloat16": lambda: _build(GPTConfig(**BASE, params_dtype=torch.bfloat16)),
        "main_grad": lambda: _with_reducer(_build(GPTConfig(**BASE))),
    }
    messages = {}
    for needle, make in cases.items():
        with pytest.raises(ValueError, match=needle.replace("(", r"\(")) as info:
            tp.fully_shard(make())
        messages[needle] = str(info.value)
    model = _build(GPTConfig(**BASE))
    with pytest.raises(ValueError, match="tied embedding"):
        tp.fully_shard(model, units=[model.embedding, *model.blocks])
    with pytest.raises(ValueError, match="units= is required"):
        tp.fully_shard(torch.nn.Linear(2, 2))
    for bad in (-1, float("nan"), float("inf"), "25", True):
        with pytest.raises(ValueError, match=f"min_unit_mib must be a number of MiB >= 0, got {bad!r}"):
            tp.fully_shard(_build(GPTConfig(**BASE)), min_unit_mib=bad)
    uneven = tp.ColumnParallelLinear(4, 6, partition_rows=[[(0, 6)]])  # loads write into the TP shard
    with pytest.raises(ValueError, match="has an uneven TP layout"):
        tp.fully_shard(torch.nn.Sequential(uneven), units=[uneven])
    assert all("\n" not in m for m in messages.values())
    return True


def _with_reducer(model):
    DataParallelGradReducer(model.parameters(), dp_group=tp.get_data_parallel_group())
    return model


def test_what_cannot_combine_with_fsdp_is_refused_in_one_line():
    assert run_on_ranks(_refusal_body, 1) == [True]


def _memory_body():
    tp.initialize_model_parallel(2)
    config = GPTConfig(**BASE)
    plain, sharded = _build(config), tp.fully_shard(_build(config))
    DataParallelGradReducer(plain.parameters(), dp_group=tp.get_data_parallel_group())
    ratios = {k: v / bytes_per_rank(plain)[k] for k, v in bytes_per_rank(sharded).items()}
    # Measured: AdamW's state after one step, as allocated.
    optimizer = torch.optim.AdamW(sharded.parameters())
    tokens, labels = _batch(0, 0, tp.get_data_parallel_rank())
    sharded(tokens, labels).backward()
    optimizer.step()
    state = sum(v.to_local().numel() * 4 for s in optimizer.state.values() for v in s.values() if v.dim())
    assert state == bytes_per_rank(sharded)["optimizer state"]
    return ratios


def test_parameters_gradients_and_optimizer_state_are_about_half_at_dp2():
    for ratios in run_on_ranks(_memory_body, 4):
        assert set(ratios) == {"parameters", "gradients", "optimizer state"}
        assert all(0.45 <= r <= 0.55 for r in ratios.values()), ratios


# --- tensorpar train --fsdp: equal to plain DP, and checkpoints that resume in either layout ----

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "32", "--steps", "6", "--warmup", "2",
        "--lr", "1e-2", "--eval-every", "0", "--no-progress", "--seed", "7", "--global-batch", "4"]


def _train_body(argv):
    from tensorpar.cli.training_cli import parse_train_args
    from tensorpar.training.loop import train

    return train(parse_train_args(argv)).losses


def _train(world, tp_size, out, *extra):
    return run_on_ranks(_train_body, world, TINY + ["--tp", str(tp_size), "--out", str(out), *extra])[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_runs")
    # Evaluations in between: a forward that no backward follows must leave FSDP's state intact.
    plain = _train(4, 2, root / "plain", "--sp", "--save-every", "3", "--eval-every", "2", "--eval-iters", "1")
    # A unit per block, resumed below with the default's units (the blocks in the root).
    fsdp = _train(4, 2, root / "fsdp", "--sp", "--fsdp", "--fsdp-min-unit-mib", "0", "--save-every", "3",
                  "--eval-every", "2", "--eval-iters", "1")
    resumed = {
        # FSDP checkpoint -> no FSDP at TP1 x DP1, and -> FSDP at TP1 x DP4.
        "fsdp->tp1": _train(1, 1, root / "r1", "--no-fsdp", "--resume", str(root / "fsdp" / "step_3")),
        "fsdp->fsdp-tp1-dp4": _train(4, 1, root / "r2", "--fsdp", "--resume", str(root / "fsdp" / "step_3")),
        # Plain checkpoint -> FSDP at the same sizes.
        "plain->fsdp": _train(4, 2, root / "r3", "--fsdp", "--resume", str(root / "plain" / "step_3")),
    }
    return plain, fsdp, resumed


@pytest.mark.slow
def test_train_fsdp_matches_plain_data_parallel(runs):
    plain, fsdp, _ = runs
    assert list(fsdp) == list(plain) == [1, 2, 3, 4, 5, 6]
    for step in plain:
        assert fsdp[step] == pytest.approx(plain[step], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp->tp1", "fsdp->fsdp-tp1-dp4", "plain->fsdp"])
def test_checkpoints_resume_with_or_without_fsdp_at_other_sizes(runs, name):
    plain, _, resumed = runs
    assert list(resumed[name]) == [4, 5, 6]
    for step, loss in resumed[name].items():
        assert loss == pytest.approx(plain[step], rel=2e-5)


def test_fsdp_with_grad_fusion_and_a_unit_size_without_fsdp_are_usage_errors(capsys):
    from tensorpar.cli import fsdp_flags
    from tensorpar.cli.main import main

    assert main(["train", "--fsdp", "--grad-fusion", "--nproc", "1", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--fsdp cannot combine with gradient-accumulation fusion" in err, err
    assert fsdp_flags.MIN_UNIT_MIB == MIN_UNIT_MIB
    assert main(["train", "--fsdp-min-unit-mib", "0", "--nproc", "1", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--fsdp-min-unit-mib 0 applies with --fsdp" in err, err


def _ledger_body(reshard: bool, units: str):
    tp.initialize_model_parallel(2)
    dp = tp.get_data_parallel_world_size()
    model = _build(GPTConfig(**{**BASE, "num_layers": 5}))
    tp.fully_shard(model, reshard_after_forward=reshard, min_unit_mib=_min_unit_mib(model, units))
    tokens, labels = _batch(0, 0, tp.get_data_parallel_rank())
    with tp.CommLedger() as ledger:
        with ledger.phase("forward"):
            loss = model(tokens, labels)
        with ledger.phase("backward"):
            loss.backward()
    count = {"per block": 5, "default": 0, "pairs": 2}[units] + 1  # and the root
    # Each unit's parameters travel as one flat buffer of dim-0 shards padded to equal size.
    padded = sum(-(-p.shape[0] // dp) * math.prod(p.shape[1:]) for p in model.parameters()) * dp * 4
    assert ledger.count("all_gather", phase="forward") == count
    assert ledger.total_bytes("all_gather", phase="forward") == padded
    # Resharded units are gathered again for backward; the root never is.
    assert ledger.count("all_gather", phase="backward") == (count - 1 if reshard else 0)
    assert ledger.count("reduce_scatter", phase="backward") == count
    assert ledger.total_bytes("reduce_scatter", phase="backward") == padded
    return True


@pytest.mark.parametrize("units", ["per block", "default", "pairs"])
@pytest.mark.parametrize("reshard", [True, False])
def test_comm_ledger_records_fsdp_all_gathers_and_reduce_scatters(reshard, units):
    assert run_on_ranks(_ledger_body, 4, reshard, units) == [True] * 4


def _bf16_body():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    tp.initialize_model_parallel(2)
    config = GPTConfig(**BASE, sequence_parallel=True)
    plain = _build(config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    sharded = tp.fully_shard(_build(config), mp_policy=policy)
    tokens, labels = _batch(0, 0, tp.get_data_parallel_rank())
    loss_plain, loss_sharded = plain(tokens, labels), sharded(tokens, labels)
    assert loss_sharded.dtype == torch.float32  # the vocab-parallel cross entropy is fp32
    loss_sharded.backward()
    allreduce_sequence_parallel_grads(sharded)
    # bf16 compute, but the sharded parameters (the masters) and their gradients stay fp32.
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in sharded.parameters())
    torch.testing.assert_close(loss_sharded, loss_plain, rtol=2e-2, atol=2e-2)
    return True


def test_bf16_compute_keeps_fp32_masters_and_fp32_gradients():
    assert run_on_ranks(_bf16_body, 4) == [True] * 4


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = tp.ColumnParallelLinear(8, 32)
        self.fc2 = tp.RowParallelLinear(32, 8, input_is_parallel=True)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)[0]))[0]


def _units_body():
    tp.initialize_model_parallel(2)
    dp_rank, dp_group = tp.get_data_parallel_rank(), tp.get_data_parallel_group()
    models = []
    for _ in range(2):
        tp.model_parallel_manual_seed(5)
        models.append(_MLP())
    plain, sharded = models[0], tp.fully_shard(models[1], units=[models[1].fc1, models[1].fc2])
    reducer = DataParallelGradReducer(plain.parameters(), dp_group=dp_group)
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(dp_rank))
    reducer.zero_grad()
    plain(x).square().mean().backward()
    reducer.finish()
    sharded(x).square().mean().backward()
    for p, q in zip(sharded.parameters(), plain.parameters()):
        torch.testing.assert_close(_full(p.grad), q.grad, rtol=1e-5, atol=1e-6)
    return True


def test_units_shard_any_model_built_from_tp_layers():
    assert run_on_ranks(_units_body, 4) == [True] * 4


def _checkpoint_body(out: str):
    from tensorpar.training import checkpoint, checkpoint_files, checkpoint_state
    from tensorpar.training.model_config import config_to_json

    tp.initialize_model_parallel(2)
    tp_group = tp.get_tensor_model_parallel_group()
    # 9 positions: dim-0 FSDP shards of unequal size (5 + 4) on DP 2.
    config = GPTConfig(**{**BASE, "max_seq_len": 9, "tie_word_embeddings": False})
    tokens, labels = _batch(0, 0, tp.get_data_parallel_rank())
    tokens, labels = torch.cat([tokens, tokens[:, :1]], 1), torch.cat([labels, labels[:, :1]], 1)
    models = {"fsdp": tp.fully_shard(_build(config)), "plain": _build(config), "fsdp2": tp.fully_shard(_build(config))}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-2) for name, m in models.items()}
    models["fsdp"](tokens, labels).backward()
    optimizers["fsdp"].step()
    checkpoint.save(out, 1, model=models["fsdp"], optimizer=optimizers["fsdp"], config=config_to_json(config),
                    meta=checkpoint_meta(step=1, tp=2, dp=2), tp_group=tp_group)
    ckpt = checkpoint_files.open_checkpoint(out)[0]
    # Only the strided weights (fused Q|K|V) are gathered over DP; every other shard is saved as it is.
    gathered = checkpoint_state.build_state_dict(models["fsdp"], None, tp_group=tp_group, with_rng=False)[1]
    strided = [p for p in models["fsdp"].parameters() if getattr(p, "partition_stride", 1) != 1]
    assert len(gathered) == len(strided) > 0
    for name in ("plain", "fsdp2"):
        checkpoint.load(ckpt, model=models[name], optimizer=optimizers[name], tp_group=tp_group, restore_rng=False)
        for (key, p), q in zip(models["fsdp"].named_parameters(), models[name].parameters()):
            torch.testing.assert_close(_full(q.data), _full(p.data), rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
            for moment in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(_full(optimizers[name].state[q][moment]),
                                           _full(optimizers["fsdp"].state[p][moment]), rtol=0, atol=0)
    return True


def test_an_fsdp_checkpoint_with_uneven_shards_loads_with_and_without_fsdp(tmp_path):
    assert run_on_ranks(_checkpoint_body, 4, str(tmp_path / "run")) == [True] * 4
