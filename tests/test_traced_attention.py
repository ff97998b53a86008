"""The written-out attention that compiled dropout uses gives SDPA's result."""

import pytest
import torch
import torch.nn.functional as F

from tensorpar.models.traced_attention import written_out_attention


@pytest.mark.parametrize("kv_heads,mask_kind", [(4, None), (2, None), (2, "bool"), (4, "additive"), (2, "none")])
def test_written_out_attention_matches_sdpa(kv_heads, mask_kind):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = torch.randn(2, 2, kv_heads, 7, 8, generator=g).unbind(1)
    mask = None  # "none": no mask and not causal (a decode step's query sees every key)
    if mask_kind in ("bool", "additive"):  # 5 queries after 2 cached keys: bottom-right causal
        mask = torch.ones(5, 7, dtype=torch.bool).tril(2)
        if mask_kind == "additive":
            mask = torch.zeros(5, 7).masked_fill(~mask, float("-inf"))
    elif mask_kind is None:
        k, v = k[:, :, :5], v[:, :, :5]
    causal = mask_kind is None
    gqa = kv_heads != q.shape[1]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    got = written_out_attention(q, k, v, mask=mask, causal=causal, gqa=gqa, drop=lambda probs: probs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
