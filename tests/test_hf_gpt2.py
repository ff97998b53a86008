"""A random GPT2LMHeadModel through GPT.from_hf_gpt2 at TP=2, and back."""

import pytest
import torch
import torch.distributed as dist

import tensorpar as tp
from tensorpar.models import GPT
from tests.harness import run_on_ranks

transformers = pytest.importorskip("transformers")

VOCAB = 101  # not divisible by TP


def _hf_model():
    torch.manual_seed(0)  # the same HF weights on every rank
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def _hf_body():
    tp.initialize_model_parallel(dist.get_world_size())
    group = tp.get_tensor_model_parallel_group()
    hf = _hf_model()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(ids, labels=ids)
    # HF shifts the labels inside; we take them as given.
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    for overrides in ({}, {"sequence_parallel": True, "make_vocab_size_divisible_by": 1}):
        model = GPT.from_hf_gpt2(hf, **overrides).eval()
        assert model.config.activation == "gelu_tanh" and model.config.ffn_hidden_size == 128
        with torch.no_grad():
            local = model(ids)
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local.contiguous())
            logits = torch.cat(gathered, dim=-1)
            assert logits.shape[-1] == model.padded_vocab_size
            torch.testing.assert_close(logits[..., :VOCAB], out.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model(ids, labels), out.loss, rtol=1e-5, atol=1e-6)
        # Back to HF: a strict load, every tensor exactly the original.
        state = model.to_hf_gpt2_state_dict()
        assert state.keys() == hf.state_dict().keys()
        fresh = transformers.GPT2LMHeadModel(hf.config)
        fresh.load_state_dict(state, strict=True)
        for name, tensor in hf.state_dict().items():
            assert torch.equal(fresh.state_dict()[name], tensor), name
        assert not model.full_state_dict()["embedding.word.weight"][VOCAB:].any()  # zero padding
    # A trained TP model exports what it learned, and to_hf_gpt2 builds the HF model.
    from tensorpar.models.hf_gpt2 import to_hf_gpt2

    model = GPT.from_hf_gpt2(hf, tp_group=group)
    model(ids, labels).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
        exported = to_hf_gpt2(model).eval()
        ours = model.eval()(ids, labels)
        torch.testing.assert_close(exported(ids, labels=ids).loss, ours, rtol=1e-5, atol=1e-6)
    return True


def test_hf_gpt2_logits_loss_and_round_trip_at_tp2():
    assert run_on_ranks(_hf_body, 2) == [True, True]


def test_non_gpt2_shaped_config_is_refused():
    from tensorpar.models import GPTConfig
    from tensorpar.models.hf_gpt2 import config_from_hf_gpt2, state_dict_to_hf_gpt2

    with pytest.raises(ValueError, match="only a GPT-2-shaped model"):
        state_dict_to_hf_gpt2({}, GPTConfig(vocab_size=8, max_seq_len=4, num_layers=1, num_heads=1,
                                            hidden_size=8, norm="rmsnorm"))
    config = _hf_model().config
    config.activation_function = "relu"
    with pytest.raises(ValueError, match="unsupported GPT-2 activation_function 'relu'"):
        config_from_hf_gpt2(config)
