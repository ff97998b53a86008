"""Generation for :meth:`GPT.generate`: the prefill, the decode step and sampling.

The prompts run through the model's ``forward`` once (the prefill), filling a static
:class:`~tensorpar.models.kv_cache.KVCache`. Each further token then goes through
:class:`Decoder`, which calls the model's weights directly: plain GEMMs, the cache written in
place and SDPA over its prefix, the left-padding mask a view of one tensor built once, and at
TP > 1 exactly one all-reduce per sub-layer (the embedding's, each attention's and MLP's)
plus the all-gather of the logits. No input checks, no autograd functions, no mask rebuilt.
With ``cuda_graph=True`` the step keeps the same shapes every token (SDPA over the whole cache
with a mask) and, on CUDA, is captured once in a CUDA graph and replayed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed import comm
from ..expert_parallel import MoELayer
from ..tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from .cuda_graph import CUDAGraphed

# New tokens from which the decode step copies the weights on CPU: the copy costs about 5
# steps and saves ~30% of each (see Decoder).
_COPY_FROM = 16


@torch.no_grad()
def generate(model, tokens: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, eos_token_id=None, use_cache: bool = True,
             attention_mask: torch.Tensor | None = None, cuda_graph: bool = False) -> torch.Tensor:
    """Append up to ``max_new_tokens`` tokens to ``tokens`` (``[b, s]``); the same on every TP rank.

    A prefill of the prompts, then one token per step: each rank caches the keys and values
    of its own heads (``use_cache=False`` recomputes the whole sequence every step). Prompts
    of different lengths are left-padded, with ``attention_mask`` (``[b, s]``, 0 at the
    padding) as in ``transformers``. Sampling draws from the default stream, the same on
    every TP rank: ``temperature=0`` is greedy, else ``top_k`` and ``top_p`` (nucleus) cut
    the distribution. A sequence that produced ``eos_token_id`` (an id or a list of ids)
    repeats it, and generation stops once every sequence did. Past ``max_seq_len`` the
    context slides, and is recomputed each step (every position moves). Call
    ``model.eval()`` first. ``cuda_graph``: decode with a step of fixed shapes (attention over
    the whole cache, masked), captured in a CUDA graph at TP=1 on CUDA; elsewhere the same step
    runs eagerly (the same tokens as without it).

    Example::

        out = model.generate(prompt, 20, temperature=0.8, top_k=40)
        out = model.generate(left_padded, 20, temperature=0, attention_mask=mask)
        out = generate(model, prompt, 20, temperature=0, cuda_graph=True)
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if attention_mask is not None and attention_mask.shape != tokens.shape:
        raise ValueError(f"attention_mask of shape {list(attention_mask.shape)} must match tokens of shape "
                         f"{list(tokens.shape)}")
    if cuda_graph and (not use_cache or model.config.tp_invariant):
        raise ValueError(f"cuda_graph=True decodes with the KV cache's decode step: it needs use_cache=True "
                         f"(got {use_cache}) and a model without tp_invariant (got {model.config.tp_invariant})")
    batch, prompt = tokens.shape
    # Preallocated: the generated tokens are written in place, and every generated one is real.
    out = tokens.new_empty(batch, prompt + max_new_tokens)
    out[:, :prompt] = tokens
    is_real = torch.ones(out.shape, dtype=torch.bool, device=tokens.device)
    if attention_mask is not None:
        is_real[:, :prompt] = attention_mask.bool()
    eos = None if eos_token_id is None else torch.tensor(eos_token_id, device=tokens.device).reshape(-1)
    finished = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    parallel, window = model.parallel, model.config.max_seq_len
    cache = decoder = None
    if parallel.sequence_parallel:
        window -= window % parallel.size
    if use_cache:
        # Under SP each prefill runs a multiple of TP positions: room for that padding at the end.
        slack = parallel.size - 1 if parallel.sequence_parallel else 0
        cache = model.new_kv_cache(batch, min(prompt + max_new_tokens, window) + slack)
        if not model.config.tp_invariant:  # bit-identical at every TP size: the model's own forward
            copy = tokens.device.type == "cpu" and max_new_tokens >= _COPY_FROM
            graph = cuda_graph and tokens.device.type == "cuda" and parallel.size == 1
            decoder = Decoder(model, cache, is_real, prompt=prompt, copy_weights=copy, fixed_shapes=cuda_graph,
                              cuda_graph=graph)
    length = prompt
    for _ in range(max_new_tokens):
        if cache is not None and length <= window:
            if decoder is not None and cache.length == length - 1:
                logits = decoder.step(out[:, length - 1])
            else:
                logits = last_logits(model, out[:, cache.length:length], is_real[:, :length], cache)
        else:
            cache = None
            start = max(0, length - window)
            logits = last_logits(model, out[:, start:length], is_real[:, start:length], None)
        next_token = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        if eos is not None:
            next_token = torch.where(finished, eos[0], next_token)
            finished |= torch.isin(next_token, eos)
        out[:, length] = next_token
        length += 1
        if eos is not None and bool(finished.all()):
            break
    return out[:, :length]


def last_logits(model, new: torch.Tensor, is_real: torch.Tensor, cache) -> torch.Tensor:
    """Full-vocabulary fp32 logits ``[b, vocab]`` after ``new``, the tokens ``cache`` lacks,
    through the model's forward (the prefill, and every step without a cache).

    ``is_real`` (``[b, cached + new]``) is False at the left padding, which no token sees.
    """
    parallel = model.parallel
    past, n = (cache.length if cache is not None else 0), new.shape[1]
    pad = -n % parallel.size if parallel.sequence_parallel else 0
    # Positions count the real tokens only, as transformers does under left padding.
    positions = F.pad((is_real.cumsum(1) - 1).clamp(min=0)[:, past:], (0, pad))
    keys_real = F.pad(is_real, (0, pad))
    slots = torch.arange(past + n + pad, device=new.device)
    queries = slots[past:, None]
    # A token sees the real tokens up to itself, and itself (so a padding row stays finite).
    mask = (queries >= slots) & (keys_real[:, None, :] | (queries == slots))
    local = model(F.pad(new, (0, pad)), position_ids=positions, attn_mask=mask.unsqueeze(1),
                  kv_cache=cache, last_position_only=True)
    local = local[:, min(n - 1, local.shape[1] - 1)]           # the last real token's
    if cache is not None:
        cache.length -= pad  # the SP padding at the end is overwritten by the next step
    logits = gather_from_tensor_model_parallel_region(local.contiguous(), group=model.tp_group)
    return logits[:, :model.config.vocab_size].float()


class Decoder:
    """One new token per sequence through ``model``, after a prefill filled ``cache``.

    ``is_real`` (``[b, prompt + new]``) is False at the prompts' left padding: cache slot ``i``
    holds token ``i``, so the keys a step may see are ``is_real[:, :length]`` as it stands.
    Every rank runs the same step on its own heads and columns (also under SP: one token has
    no sequence to split). With ``copy_weights`` the step multiplies by ``[in, out]`` copies of
    the weights, made at its first call: on CPU, MKL's GEMMs of a few rows run ~1.5x faster
    against them than against the ``[out, in]`` weights transposed, at the cost of one more
    copy of the weights in memory while generating, and of the copy (about 5 decode steps).

    With ``fixed_shapes`` every step has the same shapes and reads the position from a device
    tensor: it writes the cache at that position and attends over the whole cache with a mask
    (the slots past the prefill zeroed once, so the masked ones are finite). That is what a CUDA
    graph needs; ``cuda_graph`` (CUDA, TP=1) then captures :meth:`forward` at the first step
    and replays it. At TP > 1 the collectives go through :mod:`tensorpar.distributed.comm`, whose ledger
    records each call on the host: a replay would not.
    """

    def __init__(self, model, cache, is_real: torch.Tensor, *, prompt: int, copy_weights: bool = False,
                 fixed_shapes: bool = False, cuda_graph: bool = False) -> None:
        if cuda_graph and not (fixed_shapes and is_real.device.type == "cuda" and model.parallel.size == 1):
            raise ValueError(f"cuda_graph=True needs fixed_shapes=True, CUDA and TP=1; got fixed_shapes="
                             f"{fixed_shapes} on {is_real.device} at TP={model.parallel.size}")
        self.model, self.cache, self.is_real, self.copy_weights = model, cache, is_real, copy_weights
        self.group, self.tp_size = model.tp_group, model.parallel.size
        self.masked = not bool(is_real[:, :prompt].all())
        # Token i's position is i minus the padding before it (transformers' under left padding).
        self.position_offset = is_real[:, :prompt].sum(1) - prompt
        self.vocab_range = (model.embedding.word.vocab_start_index, model.embedding.word.vocab_end_index)
        self.rotary = None
        if model.config.position_embedding == "rope":
            self.rotary = model._rotary(None, model.config.max_seq_len + self.tp_size, is_real.device)
        self.layers = self.head = self.position = None
        if fixed_shapes:
            capacity = cache.capacity
            self.position = torch.zeros(1, dtype=torch.long, device=is_real.device)   # the slot being written
            self.slots = torch.arange(capacity, device=is_real.device)
            self.real_slots = F.pad(is_real, (0, max(0, capacity - is_real.shape[1])), value=True)[:, :capacity]
        self._run = CUDAGraphed(self.forward) if cuda_graph else self.forward

    def _prepare(self) -> None:
        model = self.model
        weight = model.embedding.word.weight

        def right(layer, w=None):  # (the weight as the right operand, bias)
            w = layer.weight if w is None else w
            return (w.t().contiguous() if self.copy_weights else w.t()), layer.bias

        def mlp(block):  # an MoE block's experts run as the layer itself: fc, out None
            if isinstance(block.mlp, MoELayer):
                return (block.norm2, None, None, block.mlp, None, None)
            return (block.norm2, *right(block.mlp.fc), block.mlp, *right(block.mlp.proj))

        self.layers = [(block.norm1, *right(block.attention.qkv), block.attention, *right(block.attention.proj),
                        *mlp(block)) for block in model.blocks]
        self.head = right(model.lm_head, weight if model.config.tie_word_embeddings else None)[0]
        if self.position is not None:
            for buffer in self.cache.keys + self.cache.values:
                buffer[:, :, self.cache.length:].zero_()

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """The fp32 logits ``[b, vocab]`` after ``token`` (``[b]``), which the cache lacks
        (under ``cuda_graph``, a buffer the next step overwrites)."""
        if self.layers is None:
            self._prepare()
        length = self.cache.length
        if length >= self.cache.capacity:
            raise ValueError(f"KV cache of {self.cache.capacity} positions is full")
        if self.position is not None:
            self.position.fill_(length)
        logits = self._run(token)
        self.cache.length = length + 1
        return logits

    def forward(self, token: torch.Tensor) -> torch.Tensor:
        """:meth:`step` without its bookkeeping: writes the cache at ``cache.length`` (with
        ``fixed_shapes``: at ``position``) and leaves ``cache.length`` as it was."""
        fixed, length = self.position is not None, self.cache.length
        positions = self.position_offset + (self.position if fixed else length)
        x = self._embed(token, positions)                           # [b, h]
        cos = sin = None
        if self.rotary is not None:
            cos, sin = (table[positions][:, None, None] for table in self.rotary)   # [b, 1, 1, d]
        if fixed:
            mask = (self.real_slots & (self.slots <= self.position))[:, None, None]
        else:
            mask = self.is_real[:, None, None, :length + 1] if self.masked else None
        for layer, (norm1, qkv, qkv_bias, attention, proj, proj_bias, norm2, fc, fc_bias, mlp, out, out_bias) \
                in enumerate(self.layers):
            q, k, v = attention.split_heads(_column(norm1(x), qkv, qkv_bias)[None], cos, sin)
            if fixed:
                k, v = self.cache.write_at(layer, self.position, k, v)
            else:
                k, v = self.cache.write(layer, length, k, v)
            x = x + self._row(attention.attend(q, *attention.kv_read(k, v), mask, causal=False)[0], proj, proj_bias)
            if fc is None:
                x = x + mlp(norm2(x)[None])[0]
            else:
                x = x + self._row(mlp.activate(_column(norm2(x), fc, fc_bias)), out, out_bias)
        logits = gather_from_tensor_model_parallel_region(self.model.final_norm(x) @ self.head, group=self.group)
        return logits[:, :self.model.config.vocab_size].float()

    def _embed(self, token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The embedding of ``token`` at ``positions``, ``[b, h]``: the vocab-parallel lookup's
        one all-reduce."""
        word = self.model.embedding.word.weight
        if self.tp_size > 1:
            first, stop = self.vocab_range
            outside = (token < first) | (token >= stop)
            x = F.embedding((token - first).masked_fill(outside, 0), word).masked_fill_(outside[:, None], 0.0)
            comm.all_reduce(x, self.group)
        else:
            x = F.embedding(token, word)
        learned = self.model.embedding.position
        return x if learned is None else x + learned[positions]

    def _row(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A row-parallel layer: this rank's partial GEMM, one all-reduce, then the bias."""
        y = x @ weight
        if self.tp_size > 1:
            comm.all_reduce(y, self.group)
        return y if bias is None else y + bias


def _column(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x @ weight if bias is None else torch.addmm(bias, x, weight)


def sample(logits: torch.Tensor, *, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """One token id per row of ``logits`` (``[b, vocab]``), drawn from the default stream
    (``temperature=0``: the argmax)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Keep the most likely tokens until they cover top_p (the first always stays).
        ordered = ordered.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, float("-inf"))
        logits = logits.scatter(-1, order, ordered)
    return torch.multinomial(logits.softmax(dim=-1), 1)[:, 0]
