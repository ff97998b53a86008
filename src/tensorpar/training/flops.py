"""How much arithmetic a training step is, and how much a device could do: the two halves of
MFU (model FLOPs utilization).

:func:`flops_per_token` is the PaLM / Megatron count of one token's forward and backward
pass: ``6 N`` for the ``N`` weights of its matrix multiplications (2 FLOPs per weight in the
forward pass, 4 in the backward pass: input and weight gradients) plus ``12 L h s`` for
attention's two products ``Q K^T`` and ``A V`` over a sequence of ``s`` (no discount for the
causal mask, as is customary). ``N`` counts the layers' projections and the LM head (a product
with the unpadded vocabulary), not the embedding lookups; recomputation is not counted (MFU
counts the model's work, not the work a schedule adds).

:func:`peak_flops_per_s` is the dense bf16 tensor-core peak of the CUDA devices in
:data:`BF16_PEAKS` (NVIDIA's data sheets, halved where they quote 2:4 sparsity); for any other
device or dtype no peak is known and the run logs no MFU.

Example::

    flops_per_token(GPTConfig.preset("small", vocab_size=50257), seq_len=1024)  # 854,438,400
    peak_flops_per_s("NVIDIA H100 80GB HBM3", dtype="bf16")                      # (9.89e14, "...")
"""

from __future__ import annotations

# (what the device's name contains, dense bf16 FLOP/s); the first match wins, so a variant
# comes before the family name it contains.
BF16_PEAKS = (
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),   # SXM
    ("H200 NVL", 835e12),
    ("H200", 989e12),   # SXM
    ("A100", 312e12),   # SXM and PCIe alike
)


def matmul_weights(config) -> int:
    """``N``: the weights one token is multiplied with (the layers' projections and the LM head)."""
    h, f = config.hidden_size, config.ffn_hidden_size
    heads = config.num_heads * config.head_dim  # h, unless the head dimension is set apart (Qwen3)
    qkv = h * (heads + 2 * config.num_query_groups * config.head_dim)
    mlp = (3 if config.activation == "swiglu" else 2) * h * f  # SwiGLU: gate, up and down
    return config.num_layers * (qkv + h * heads + mlp) + h * config.vocab_size


def flops_per_token(config, *, seq_len: int) -> int:
    """FLOPs of one token's forward and backward pass at sequence length ``seq_len``."""
    attention = 12 * config.num_layers * config.num_heads * config.head_dim * seq_len
    return 6 * matmul_weights(config) + attention


def peak_flops_per_s(device_name: str | None, *, dtype: str) -> tuple[float | None, str]:
    """(peak FLOP/s or None, where it comes from or why there is none) for one device.

    ``device_name`` is ``torch.cuda.get_device_name()``, or None for a CPU."""
    if device_name is None:
        return None, "no peak is known for a CPU: MFU is not logged"
    if dtype != "bf16":
        return None, f"no {dtype} peak is known for {device_name} (only bf16 peaks are): MFU is not logged"
    for part, peak in BF16_PEAKS:
        if part in device_name:
            return peak, f"the dense bf16 peak of an {part}"
    return None, f"no bf16 peak is known for {device_name}: MFU is not logged"
