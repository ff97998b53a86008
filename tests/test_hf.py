"""Random GPT-2, Llama, Mistral, Qwen2 and Qwen3 models through from_hf at TP 1, 2 and 4, and back; Mixtral and
Qwen3-MoE at TP x EP.

Each TP world also builds the TP=1 model in every rank (a group of that rank alone).
"""

import re

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar.models import GPT, from_hf, to_hf
from tests.harness import run_on_ranks
from tests.test_gpt import _single_rank_group

transformers = pytest.importorskip("transformers")

VOCAB = 101  # not divisible by any TP size
LOGIT_TOL = 1e-5
LLAMA_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
                   rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0, pad_token_id=0)
FAMILIES = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **LLAMA_SHAPE, rope_theta=5e5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        **LLAMA_SHAPE, sliding_window=24, rope_theta=1e4)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **LLAMA_SHAPE, tie_word_embeddings=True)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**LLAMA_SHAPE, head_dim=16)),
}

def hf_model(family: str):
    """A random model, the same on every rank; norm weights moved off 1 so their mapping shows."""
    torch.manual_seed(0)
    model = FAMILIES[family]()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name:
                param.add_(0.2 * torch.randn_like(param))
    return model.eval()


def full_logits(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    """The TP model's logits over the real vocabulary (gathered over its TP group)."""
    local = model(tokens).contiguous()
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(model.tp_group))]
    dist.all_gather(gathered, local, group=model.tp_group)
    return torch.cat(gathered, dim=-1)[..., :VOCAB]


def _parity_body(directory):
    tp.initialize_model_parallel(dist.get_world_size())
    group, single = tp.get_tensor_model_parallel_group(), _single_rank_group()
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)  # HF shifts inside
    for family in FAMILIES:
        hf = hf_model(family)
        path = f"{directory}/{family}"
        if dist.get_rank() == 0:
            hf.save_pretrained(path)
        dist.barrier()
        with torch.no_grad():
            expected = hf(tokens, labels=tokens)
        models = {"tp1": from_hf(hf, tp_group=single),
                  "dir": from_hf(path, tp_group=group),
                  "sp": from_hf(hf, tp_group=group, sequence_parallel=True)}
        assert models["sp"].parallel.sequence_parallel == (dist.get_world_size() > 1)
        for key, model in models.items():
            model.eval()
            with torch.no_grad():
                error = (full_logits(model, tokens) - expected.logits).abs().max().item()
                assert error <= LOGIT_TOL, (family, key, error)
                torch.testing.assert_close(model(tokens, labels), expected.loss, rtol=1e-5, atol=1e-6)
        # The directory (safetensors slices) and the object give the same shards, bit for bit.
        for (name, a), (_, b) in zip(models["dir"].named_parameters(), models["sp"].named_parameters()):
            assert torch.equal(a, b), (family, name)
        # Back to transformers: every tensor exactly the original, at any TP size.
        for model in (models["tp1"], models["dir"]):
            exported = to_hf(model)
            if dist.get_rank(model.tp_group) != 0:
                assert exported is None
                continue
            assert type(exported).__name__ == ("LlamaForCausalLM" if family == "mistral" else type(hf).__name__)
            theirs = exported.state_dict()
            assert theirs.keys() == hf.state_dict().keys()
            for name, tensor in hf.state_dict().items():
                assert torch.equal(theirs[name], tensor), (family, name)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.slow
def test_families_match_transformers_and_round_trip(world_size, tmp_path):
    assert run_on_ranks(_parity_body, world_size, str(tmp_path)) == [True] * world_size


def _greedy_body():
    tp.initialize_model_parallel(dist.get_world_size())
    group, single = tp.get_tensor_model_parallel_group(), _single_rank_group()
    prompt = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # a 6- and a 3-token prompt, left-padded
    prompt = prompt.masked_fill(mask == 0, 0)
    for family in FAMILIES:
        hf = hf_model(family)
        expected = hf.generate(prompt, attention_mask=mask, max_new_tokens=10, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
        for model in (from_hf(hf, tp_group=single), from_hf(hf, tp_group=group),
                      from_hf(hf, tp_group=group, sequence_parallel=True)):
            out = model.eval().generate(prompt, 10, temperature=0, attention_mask=mask)
            assert torch.equal(out, expected), (family, out, expected)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.slow
def test_greedy_generation_equals_transformers(world_size):
    assert run_on_ranks(_greedy_body, world_size) == [True] * world_size


def _trained_export_body(directory):
    tp.initialize_model_parallel(dist.get_world_size())
    hf = hf_model("llama")
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    model = from_hf(hf, sequence_parallel=True)
    model(tokens, tokens).backward()
    tp.allreduce_sequence_parallel_grads(model)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
        ours = full_logits(model.eval(), tokens)
    exported = to_hf(model, directory)
    dist.barrier()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        assert (reloaded(tokens).logits - ours).abs().max().item() <= LOGIT_TOL
        if exported is not None:
            assert torch.equal(exported(tokens).logits, reloaded(tokens).logits)
    return True


def test_trained_model_exports_what_it_learned(tmp_path):
    assert run_on_ranks(_trained_export_body, 2, str(tmp_path / "out")) == [True, True]


def _uneven_qwen2_body():
    """Issue 17's model: 6 heads over 2 K/V heads, intermediate 200, vocab 101, at TP 3 and 4
    (uneven heads, replicated K/V heads, uneven FFN), with and without SP at a sequence of 30
    (padded under SP at TP 4): transformers' logits and greedy tokens, and back exactly."""
    tp.initialize_model_parallel(dist.get_world_size())
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=200, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)).eval()
    tokens = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        greedy = hf.generate(tokens[:, :7], max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    for sp in (False, True):
        model = from_hf(hf, sequence_parallel=sp).eval()
        with torch.no_grad():
            error = (full_logits(model, tokens) - expected).abs().max().item()
        assert error <= 1e-4, (sp, error)
        assert torch.equal(model.generate(tokens[:, :7], 8, temperature=0), greedy), sp
        exported = to_hf(model)
        if dist.get_rank() == 0:
            for name, tensor in hf.state_dict().items():
                assert torch.equal(exported.state_dict()[name], tensor), name
    return True


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.slow
def test_uneven_qwen2_matches_transformers_at_tp_3_and_4(world_size):
    assert run_on_ranks(_uneven_qwen2_body, world_size) == [True] * world_size


def test_gpt_neither_imports_nor_is_patched_by_its_conversions():
    import tensorpar.models.gpt as gpt_module

    assert not hasattr(GPT, "from_hf_gpt2") and not hasattr(GPT, "to_hf_gpt2_state_dict")  # removed in 0.4
    assert not any(getattr(value, "__name__", "").startswith("tensorpar.models.hf")
                   or getattr(value, "__module__", "") == "tensorpar.models.hf" for value in vars(gpt_module).values())
    assert all(getattr(value, "__module__", gpt_module.__name__) != "tensorpar.models.hf" for value in vars(GPT).values())


MOE_FAMILIES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **{**LLAMA_SHAPE, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
        router_aux_loss_coef=0.02)),
    # Qwen3's head dimension (16) apart from hidden / heads (8), its per-head Q/K norms, top-k unnormalised.
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **LLAMA_SHAPE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.02)),
}


def _moe_body(directory, family, tp_size, ep_size):
    """A random Mixtral or Qwen3-MoE (its files: each expert's own tensors; loaded: fused) at this TP x EP."""
    tp.initialize_model_parallel(tp_size, expert_model_parallel_size=ep_size, expert_tensor_parallel_size=1)
    group = tp.get_tensor_model_parallel_group()
    torch.manual_seed(0)
    hf = MOE_FAMILIES[family]().eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:  # off 1, so their mapping shows
                param.add_(0.2 * torch.randn_like(param))
    if dist.get_rank() == 0:
        hf.save_pretrained(directory)
    dist.barrier()
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
    models = {"dir": from_hf(directory, tp_group=group), "object": from_hf(hf, tp_group=group)}
    for key, model in models.items():
        assert model.config.num_moe_experts == 4 and model.config.moe_aux_loss_coeff == 0.02
        assert model.config.qk_layernorm == (family == "qwen3_moe")
        assert model.blocks[0].mlp.experts.num_local_experts == 4 // ep_size
        with torch.no_grad():
            error = (full_logits(model.eval(), tokens) - expected).abs().max().item()
        assert error <= LOGIT_TOL, (key, error)
    for (name, a), (_, b) in zip(models["dir"].named_parameters(), models["object"].named_parameters()):
        assert torch.equal(a, b), name
    exported = to_hf(models["dir"])
    if dist.get_rank(group) == 0:
        assert type(exported).__name__ == type(hf).__name__
        theirs = exported.state_dict()
        assert theirs.keys() == hf.state_dict().keys()
        assert all(torch.equal(theirs[name], tensor) for name, tensor in hf.state_dict().items())
    return True


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
@pytest.mark.parametrize("tp_size, ep_size", [(1, 1), (1, 2), (2, 2)])
def test_moe_families_match_transformers_and_round_trip_at_any_tp_and_ep(family, tp_size, ep_size, tmp_path):
    world = max(tp_size, ep_size)
    assert run_on_ranks(_moe_body, world, str(tmp_path / family), family, tp_size, ep_size) == [True] * world


def test_unsupported_configs_are_clear_errors(tmp_path):
    from tensorpar.models.hf import config_from_hf, hf_config_of

    config = hf_model("gpt2").config
    config.activation_function = "relu"
    with pytest.raises(ValueError, match="unsupported GPT-2 activation_function 'relu'"):
        config_from_hf(config)
    with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
        config_from_hf(transformers.BertConfig())
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        config_from_hf(transformers.LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    from tensorpar.models import GPTConfig

    with pytest.raises(ValueError, match="no transformers family has this GPT's shape"):
        hf_config_of(GPTConfig(vocab_size=8, max_seq_len=4, num_layers=1, num_heads=1, hidden_size=8,
                               norm="rmsnorm"))
    with pytest.raises(ValueError, match=r"maps to Mixtral only .* this one has moe_first_dense_layers=1, "
                                         r"moe_shared_expert_intermediate_size=8"):
        hf_config_of(GPTConfig.preset("moe-tiny", moe_first_dense_layers=1, moe_shared_expert_intermediate_size=8))
    (tmp_path / "config.json").write_text(hf_model("llama").config.to_json_string())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        from_hf(tmp_path)



# ------------------------------------------------------------------ directories handed to us

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The random GPT-2 and Llama of hf_model, saved once: {family: directory}."""
    root = tmp_path_factory.mktemp("saved")
    for family in ("gpt2", "llama"):
        hf_model(family).save_pretrained(root / family)
    return root


def _copy(saved, family, tmp_path, **changes):
    """A copy of the saved ``family`` directory with config.json fields changed (None: removed)."""
    import json
    import shutil

    directory = tmp_path / family
    shutil.copytree(saved / family, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_model_directory_is_read_as_data_never_run(tmp_path, monkeypatch):
    """An unknown model_type with an auto_map: transformers would offer to run the directory's
    code (answered yes here); tensorpar names the model_type and runs nothing."""
    import builtins
    import json

    from safetensors.torch import save_file

    marker = tmp_path / "ran"
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.Evil"}}))
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    monkeypatch.setattr(builtins, "input", lambda *args: "y")
    with pytest.raises(ValueError) as caught:
        from_hf(tmp_path)
    assert str(caught.value) == (f"{tmp_path / 'config.json'}: unsupported model_type 'evil'; supported: gpt2, llama, "
                                 "mistral, qwen2, qwen3, mixtral, qwen3_moe (a model directory's own code is never run)")
    assert not marker.exists()
    with pytest.raises(ValueError, match=r"^org/name: no such local directory \(models are read from local "
                                         r"directories only, never downloaded: fetch it first"):
        from_hf("org/name")


@pytest.mark.parametrize("family, changes, message", [
    ("gpt2", {"n_layer": 1e6}, "n_layer must be a positive integer, got 1000000.0"),
    ("gpt2", {"n_embd": "32"}, "n_embd must be a positive integer, got '32'"),
    ("gpt2", {"n_head": None}, "has no field 'n_head'"),
    ("gpt2", {"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon must be a positive number, got nan"),
    ("gpt2", {"resid_pdrop": 1.5}, r"resid_pdrop must be a number in \[0, 1\), got 1.5"),
    ("llama", {"num_hidden_layers": True}, "num_hidden_layers must be a positive integer, got True"),
    ("llama", {"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false, got 'no'"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": "8"}},
     "rope_parameters: factor must be a positive number, got '8'"),
    ("llama", {"quantization_config": {"quant_method": "fp8"}},
     r"quantized weights \(quantization_config, quant_method 'fp8'\) are not supported"),
])
def test_config_json_fields_are_checked(saved, tmp_path, family, changes, message):
    directory = _copy(saved, family, tmp_path, **changes)
    with pytest.raises(ValueError, match=f"^{re.escape(str(directory / 'config.json'))}: {message}"):
        from_hf(directory)


def test_config_json_must_be_a_json_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json: expected a JSON object, got list"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{'model_type': 'gpt2'}")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        from_hf(tmp_path)


def test_absurd_sizes_fail_at_the_first_missing_tensor_building_nothing(saved, tmp_path):
    from tensorpar.models.hf_files import config_from_hf_dir

    directory = _copy(saved, "llama", tmp_path, num_hidden_layers=1_000_000, vocab_size=10**9)
    assert config_from_hf_dir(directory).num_layers == 1_000_000  # a config only: nothing built
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.embed_tokens.weight' has shape "
                                         r"\[101, 64\]; config.json gives \[1000000000, 64\] \(vocab_size "
                                         r"1000000000, hidden_size 64\)$"):
        from_hf(directory)
    directory = _copy(saved, "gpt2", tmp_path / "more", n_layer=1_000_000)
    with pytest.raises(ValueError, match=r"no safetensors file holds tensor 'transformer.h.2.attn.c_attn.weight', "
                                         r"which layer 2 of config.json's n_layer 1000000 needs$"):
        from_hf(directory)


def test_weights_that_disagree_with_config_json_are_refused(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = _copy(saved, "llama", tmp_path, intermediate_size=80)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape "
                                         r"\[96, 64\]; config.json gives \[80, 64\] \(intermediate_size 80, "
                                         r"hidden_size 64\)$"):
        from_hf(directory)
    directory = _copy(saved, "llama", tmp_path / "fewer", num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"holds tensor 'model.layers.1.[a-z_.]+' of layer 1, beyond config.json's "
                                         r"num_hidden_layers 1$"):
        from_hf(directory)
    directory = _copy(saved, "llama", tmp_path / "fp8")
    state = load_file(directory / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.0.self_attn.q_proj.weight"].to(
        torch.float8_e4m3fn)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.self_attn.q_proj.weight' is F8_E4M3: only F16, "
                                         r"BF16, F32 and F64 weights are read"):
        from_hf(directory)


def test_a_safetensors_header_is_checked_against_its_file(saved, tmp_path):
    directory = _copy(saved, "llama", tmp_path)
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[:len(data) // 2])  # a truncated download
    with pytest.raises(ValueError, match=r"model.safetensors: the header's entry for '[a-z0-9_.]+' is not a tensor "
                                         r"inside the file$"):
        from_hf(directory)
    (directory / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"model.safetensors: not a safetensors file \(header length "
                                         r"18,446,744,073,709,551,615 in a 64-byte file\)$"):
        from_hf(directory)


def _stale_copy(saved, tmp_path):
    """The saved Llama beside a stale file holding its embedding (all 7.0)."""
    from safetensors.torch import save_file

    directory = _copy(saved, "llama", tmp_path)
    save_file({"model.embed_tokens.weight": torch.full((VOCAB, 64), 7.0)}, directory / "zz-old.safetensors")
    return directory


def test_a_tensor_in_two_files_is_read_from_the_one_the_index_names(saved, tmp_path):
    import json

    from tensorpar.models.hf_files import INDEX, weight_map

    directory = _stale_copy(saved, tmp_path)
    with pytest.raises(ValueError, match=r"tensor 'model.embed_tokens.weight' is in both model.safetensors and "
                                         r"zz-old.safetensors, and no model.safetensors.index.json says which to "
                                         r"read: remove the stale file$"):
        from_hf(directory)
    names = {name: "model.safetensors" for name in weight_map(saved / "llama")}
    (directory / INDEX).write_text(json.dumps({"weight_map": {**names, "lm_head.weight": "gone.safetensors"}}))
    with pytest.raises(ValueError, match=r"names 'gone.safetensors' as the file of tensor 'lm_head.weight', and .* "
                                         r"has no such file$"):
        from_hf(directory)
    (directory / INDEX).write_text(json.dumps({"weight_map": {**names, "model.extra": "zz-old.safetensors"}}))
    with pytest.raises(ValueError, match=r"names zz-old.safetensors as the file of tensor 'model.extra', which it "
                                         r"does not hold$"):
        from_hf(directory)
    (directory / INDEX).write_text(json.dumps({"weight_map": names}))
    assert run_on_ranks(_indexed_and_nan_body, 2, str(directory), str(_nan_copy(saved, tmp_path / "nan"))) == [True] * 2


def _nan_copy(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = _copy(saved, "llama", tmp_path)
    state = load_file(directory / "model.safetensors")
    state["model.norm.weight"][5] = float("nan")
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _indexed_and_nan_body(indexed, damaged):
    tp.initialize_model_parallel(dist.get_world_size())
    for a, b in zip(from_hf(indexed).parameters(), from_hf(hf_model("llama")).parameters()):
        assert torch.equal(a, b)  # the index's file, not the stale one
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.norm.weight' holds NaN or infinite "
                                         r"values \(in rows 0:64 of dim 0\): the weights are damaged$"):
        from_hf(damaged)
    return True
