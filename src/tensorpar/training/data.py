"""Training data: the embedded corpus, a byte-level tokenizer, token files and batch sampling.

With no ``--data`` the corpus is the running Python's own standard library source (every
top-level ``*.py`` file, in sorted order): real text that exists on every machine with Python,
so nothing is downloaded. ``--data`` takes a text file, a directory of text files, or a
pre-tokenized token file (raw little-endian integers plus a ``<file>.json`` sidecar, see
:func:`write_token_file`), which is memory-mapped so it may be larger than memory. Text costs
every rank 2 bytes per byte (int16 tokens); for large corpora ``tensorpar prepare`` writes a
token file once.

Batches are a pure function of ``(seed, step)``: the sampler draws the offsets of the whole
global batch from a generator seeded with both, and each DP rank takes its slice. TP ranks of
one group therefore see the same batch without any communication, and the data position to
checkpoint is just the step.

Example::

    corpus = load_corpus(None)
    train, val = corpus.split(val_fraction=0.05, seq_len=128)
    sampler = BatchSampler(train, seq_len=128, micro_batch=8, grad_accum=1,
                           dp_rank=0, dp_size=1, seed=0)
    for tokens, labels in sampler.micro_batches(step=0): ...
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import mmap
import os
import re
import sysconfig
from pathlib import Path

import torch

from ..errors import UsageError
from .schema import Rule, SchemaError, TEXT, check_fields, choice, integer

EOT = 256
BYTE_VOCAB_SIZE = 257
TOKEN_FILE_FORMAT = "tensorpar-tokens"
VAL_FRACTION = 0.05  # of a run's data held out for evaluation
_TOKEN_DTYPES = {"uint8": torch.uint8, "uint16": torch.uint16, "int32": torch.int32}
# The largest vocabulary each dtype holds, smallest dtype first.
_TOKEN_LIMITS = {"uint8": 1 << 8, "uint16": 1 << 16, "int32": (1 << 31) - 1}
SIDECAR_SCHEMA = {"format": choice(TOKEN_FILE_FORMAT), "dtype": choice(*_TOKEN_DTYPES), "count": integer(1),
                  "sha256": Rule(lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None,
                                 "64 lowercase hex digits"),
                  "vocab_size": integer(2, _TOKEN_LIMITS["int32"]), "tokenizer": TEXT}


class DataError(UsageError):
    """A data path or file that cannot be used; the message names it."""


def encode(text: str | bytes) -> torch.Tensor:
    """Byte-level tokens of ``text`` (UTF-8 bytes are the token ids), as int64."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    if not data:  # frombuffer refuses an empty buffer
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def decode(tokens) -> str:
    """Text of byte-level tokens; EOT and malformed UTF-8 become replacement characters."""
    ids = [int(t) for t in tokens]
    return bytes(i if i < 256 else 0xFF for i in ids).decode("utf-8", errors="replace")


@dataclasses.dataclass
class Corpus:
    """A 1-D token tensor (possibly memory-mapped), its vocabulary and where it came from."""

    tokens: torch.Tensor
    vocab_size: int
    tokenizer: str | None
    source: str

    def digest(self) -> str:
        """The SHA-256 of the token ids as stored (what a checkpoint records of the data it trained on)."""
        digest = hashlib.sha256()
        flat = self.tokens.reshape(-1)
        for start in range(0, flat.numel(), 1 << 24):
            digest.update(flat[start:start + (1 << 24)].contiguous().numpy().tobytes())
        return digest.hexdigest()

    def split(self, *, val_fraction: float, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(train, validation): the last ``val_fraction`` of the tokens is held out."""
        n_train = train_token_count(self.tokens.numel(), val_fraction=val_fraction, seq_len=seq_len,
                                    source=self.source)
        return self.tokens[:n_train], self.tokens[n_train:]


def train_token_count(total: int, *, val_fraction: float, seq_len: int, source: str) -> int:
    """Tokens left for training once the last ``val_fraction`` (at least one sample) is held out."""
    n_val = max(int(total * val_fraction), seq_len + 2)
    if total - n_val < seq_len + 2:
        raise DataError(f"{source}: {total:,} tokens are too few for --seq-len {seq_len:,} with a "
                        f"validation split (need at least {max(2 * (seq_len + 2), n_val + seq_len + 2):,})")
    return total - n_val


def stdlib_files() -> list[Path]:
    """The embedded corpus: this Python's top-level standard library modules, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def _files_to_tokens(files: list[Path], source: str, block: int = 1 << 24) -> tuple[torch.Tensor, bool]:
    """(byte tokens of ``files``, each document followed by EOT; whether every file is UTF-8 text),
    read block by block straight into one int16 tensor: 2 bytes per byte of text, and no copy of
    the text held besides."""
    sizes = [path.stat().st_size for path in files]
    tokens = torch.full((sum(size + 1 for size in sizes if size),), EOT, dtype=torch.int16)
    buffer, end, utf8 = bytearray(min(block, max(sizes, default=0)) or 1), 0, True
    for path, size in zip(files, sizes):
        start, decoder = end, codecs.getincrementaldecoder("utf-8")()
        with open(path, "rb") as f:  # a file that grew since it was sized is read up to that size
            while end - start < size and (n := f.readinto(memoryview(buffer)[:size - (end - start)])):
                tokens[end:end + n].copy_(torch.frombuffer(buffer, dtype=torch.uint8, count=n))
                end += n
                utf8 = utf8 and _decodes(decoder, memoryview(buffer)[:n])
        utf8 = utf8 and _decodes(decoder, b"", final=True)
        end += end > start  # EOT (already in place) after a document
    if not end:
        raise DataError(f"{source}: no text found (empty files)")
    return tokens[:end], utf8


def _decodes(decoder, data, *, final: bool = False) -> bool:
    try:
        decoder.decode(data, final=final)
        return True
    except UnicodeDecodeError:
        return False


def _read_sidecar(path: Path) -> dict:
    """The token file ``path``'s sidecar ``<path>.json``, checked against :data:`SIDECAR_SCHEMA`
    and the file's size (not its hash: :func:`inspect_data` checks that)."""
    sidecar = Path(f"{path}.json")
    try:
        meta = json.loads(sidecar.read_text())
        check_fields(sidecar, meta, SIDECAR_SCHEMA, exact=True, optional={"tokenizer"})
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise DataError(f"{sidecar}: unreadable token-file sidecar ({exc}); rewrite it with tensorpar "
                        "prepare") from None
    except SchemaError as exc:
        raise DataError(f"{exc}; rewrite it with tensorpar prepare") from None
    limit = _TOKEN_LIMITS[meta["dtype"]]
    if meta["vocab_size"] > limit:
        raise DataError(f"{sidecar}: field 'vocab_size' is {meta['vocab_size']}, more than {meta['dtype']} "
                        f"token ids hold ({limit})")
    itemsize = _TOKEN_DTYPES[meta["dtype"]].itemsize
    nbytes = path.stat().st_size
    if nbytes != meta["count"] * itemsize:
        raise DataError(f"--data {path}: size {nbytes} bytes is not the {meta['count']:,} {meta['dtype']} tokens "
                        f"({meta['count'] * itemsize} bytes) that field 'count' of {sidecar} records")
    return meta


def _mapped(path: Path, *, count: int, dtype: torch.dtype, writable: bool) -> torch.Tensor:
    """``count`` values of ``dtype`` mapped from ``path``: pages load lazily; writes reach the file only
    when ``writable`` (else they stay copy-on-write). Unlike ``torch.from_file``, whatever bytes name
    the file (it takes UTF-8 names only)."""
    if count == 0:  # mmap refuses an empty mapping
        return torch.empty(0, dtype=dtype)
    with open(path, "r+b" if writable else "rb") as f:
        mapping = mmap.mmap(f.fileno(), count * dtype.itemsize,
                            access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
    return torch.frombuffer(mapping, dtype=dtype, count=count)


def _load_token_file(path: Path, meta: dict) -> Corpus:
    tokens = _mapped(path, count=meta["count"], dtype=_TOKEN_DTYPES[meta["dtype"]], writable=False)
    return Corpus(tokens, meta["vocab_size"], meta.get("tokenizer"), str(path))


def load_corpus(path: str | os.PathLike | None, *, tokenizer: str | None = None) -> Corpus:
    """The embedded corpus (``None``), a text file, a directory of text files, or a token file.

    Text is byte tokens, or the tokens of the Hugging Face ``tokenizer`` directory if given.
    """
    files, source = _resolve(path)
    if isinstance(files, Corpus):
        return files
    if tokenizer is None:
        tokens, utf8 = _files_to_tokens(files, source)
        # Byte tokens take any file; the header says so where it is not the text it looks like.
        return Corpus(tokens, BYTE_VOCAB_SIZE, "bytes", source if utf8 else f"{source} (not UTF-8 text: "
                      "trained on its bytes)")
    from .tokenizer import load_tokenizer, tokenize_files

    hf_tokenizer = load_tokenizer(tokenizer)
    tokens = tokenize_files(files, hf_tokenizer)
    if not tokens.numel():
        raise DataError(f"{source}: no text found (empty files)")
    return Corpus(tokens, len(hf_tokenizer), tokenizer, source)


def _resolve(path: str | os.PathLike | None) -> tuple[list[Path] | Corpus, str]:
    """(text files, source) of ``--data`` (``None``: the embedded corpus), or (a token file's
    memory-mapped :class:`Corpus`, source)."""
    if path is None:
        files = stdlib_files()
        return files, f"Python {sysconfig.get_python_version()} standard library ({len(files)} files)"
    path = Path(path)
    if path.is_file() and os.path.lexists(f"{path}.json"):
        corpus = _load_token_file(path, _read_sidecar(path))
        return corpus, corpus.source
    if path.is_file() and path.suffix == ".bin":
        raise DataError(f"--data {path}: a token file needs its sidecar {path}.json (tensorpar prepare writes "
                        "both); a text file needs another name than .bin")
    return _text_files(path), f"--data {path}"


def _text_files(path: Path) -> list[Path]:
    """The files of a text ``--data`` path: itself, or a directory's files (hidden ones skipped)."""
    if not path.exists():
        raise DataError(f"--data {path}: no such file or directory")
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise DataError(f"--data {path}: the directory contains no files")
    return files


def inspect_data(path: str | os.PathLike | None, *, tokenizer: str | None = None,
                 local_ranks: int = 1) -> tuple[int, int, str]:
    """(token count, vocabulary size, source) of ``--data``, checked, without tokenizing text.

    What :func:`load_corpus` would give, cheaply enough to run before any process starts: text
    is sized from the files' lengths (an upper bound with a ``tokenizer``, whose vocabulary is
    read) and refused if the ``local_ranks`` processes cannot each hold its tokens; a token
    file's sidecar is checked (its tokenizer's vocabulary too), and its data against the
    sidecar's hash and vocabulary (one pass over the file).
    """
    files, source = _resolve(path)
    if isinstance(files, Corpus):
        meta = _read_sidecar(Path(files.source))
        _check_sidecar_tokenizer(Path(f"{files.source}.json"), meta)
        _check_token_file(files, meta)
        return files.tokens.numel(), files.vocab_size, files.source
    sizes = [size for size in (f.stat().st_size for f in files) if size]
    if not sizes:
        raise DataError(f"{source}: no text found (empty files)")
    vocab_size = BYTE_VOCAB_SIZE
    if tokenizer is not None:
        from .tokenizer import load_tokenizer

        vocab_size = len(load_tokenizer(tokenizer))
    tokens = sum(sizes) + len(sizes)  # one EOT after each document
    _check_text_fits(tokens * (2 if tokenizer is None else 4), source=source, local_ranks=local_ranks)
    return tokens, vocab_size, source


def _check_text_fits(need: int, *, source: str, local_ranks: int) -> None:
    """Refuse text whose tokens (``need`` bytes, held by every rank) exceed each rank's host memory."""
    from .memory import _gib, host_available_memory

    have = host_available_memory() // local_ranks
    if need > have:
        raise DataError(f"{source}: its tokens need {_gib(need)} in every rank, more than the {_gib(have)} of host "
                        f"memory each of {local_ranks} local ranks has: write a token file once with tensorpar "
                        "prepare (memory-mapped, read as needed)")


def _check_sidecar_tokenizer(sidecar: Path, meta: dict) -> None:
    """The tokenizer a sidecar names must have its vocabulary: byte tokens 257, a Hugging Face
    directory (where it still is) its own size. A dtype misstated with the count and hash to
    match (uint32 ids read as uint16) is caught here, or by ids beyond the vocabulary."""
    name = meta.get("tokenizer")
    if name is None or name != "bytes" and not Path(name).is_dir():
        return
    if name == "bytes":
        vocab_size = BYTE_VOCAB_SIZE
    else:
        from .tokenizer import load_tokenizer

        vocab_size = len(load_tokenizer(name, flag=f"{sidecar}: field 'tokenizer'"))
    if meta["vocab_size"] != vocab_size:
        raise DataError(f"{sidecar}: field 'vocab_size' is {meta['vocab_size']}, but its tokenizer {name!r} has "
                        f"{vocab_size} token ids; rewrite it with tensorpar prepare")


def _scan(path: Path, dtype: torch.dtype, block: int = 1 << 24) -> tuple[str, int, int, bool]:
    """(SHA-256, smallest id, largest id, whether every second id is 0) of the token file
    ``path``, read once block by block (of an even count of ids)."""
    digest, low, high, odd_zero = hashlib.sha256(), None, None, True
    buffer = bytearray(block - block % (2 * dtype.itemsize))
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            digest.update(memoryview(buffer)[:n])
            ids = torch.frombuffer(buffer, dtype=dtype, count=n // dtype.itemsize).to(torch.int64)  # no uint16 max
            low = min(int(ids.min()), low if low is not None else int(ids.min()))
            high = max(int(ids.max()), high if high is not None else int(ids.max()))
            odd_zero = odd_zero and not bool(ids[1::2].any())
    return digest.hexdigest(), low, high, odd_zero


def _check_token_file(corpus: Corpus, meta: dict) -> None:
    sidecar = f"{corpus.source}.json"
    digest, low, high, odd_zero = _scan(Path(corpus.source), corpus.tokens.dtype)
    if digest != meta["sha256"]:
        raise DataError(f"--data {corpus.source}: its SHA-256 is not the one {sidecar} records (the data changed "
                        "after tensorpar prepare wrote it)")
    if low < 0:
        raise DataError(f"--data {corpus.source}: holds negative token ids (e.g. {low})")
    if high >= corpus.vocab_size:
        raise DataError(f"--data {corpus.source}: holds token id {high}, outside its vocab_size "
                        f"{corpus.vocab_size} (from {sidecar})")
    if odd_zero and high > 0 and len(corpus.tokens) > 2:
        # Wider ids read at a narrower dtype: each id, then its high bytes (zero).
        raise DataError(f"--data {corpus.source}: every second token id is 0, as ids twice as wide as the "
                        f"{meta['dtype']} {sidecar} declares read; rewrite it with tensorpar prepare")


def write_token_file(path: str | os.PathLike, tokens: torch.Tensor, *, vocab_size: int,
                     tokenizer: str | None = None) -> None:
    """Write ``tokens`` as a memory-mappable token file plus its ``.json`` sidecar (the schema
    :data:`SIDECAR_SCHEMA`: format, dtype, count, SHA-256 of the file, vocab_size, tokenizer)."""
    dtype_name = next(name for name, limit in _TOKEN_LIMITS.items() if vocab_size <= limit)
    path = Path(path)
    data = tokens.reshape(-1)
    with open(path, "wb") as f:
        f.truncate(data.numel() * _TOKEN_DTYPES[dtype_name].itemsize)
    _mapped(path, count=data.numel(), dtype=_TOKEN_DTYPES[dtype_name], writable=True).copy_(data)
    meta = {"format": TOKEN_FILE_FORMAT, "dtype": dtype_name, "count": data.numel(),
            "sha256": _scan(path, _TOKEN_DTYPES[dtype_name])[0], "vocab_size": vocab_size}
    if tokenizer is not None:
        meta["tokenizer"] = tokenizer
    Path(f"{path}.json").write_text(json.dumps(meta))


def prepare(data: str | os.PathLike, out: str | os.PathLike, *, tokenizer: str | None = None,
            bpe_vocab: int | None = None) -> Corpus:
    """Tokenize the text ``data`` into the token file ``out`` (what ``--data`` reads).

    Byte tokens by default; or the Hugging Face ``tokenizer`` directory's; or, with
    ``bpe_vocab``, a byte-level BPE trained on ``data`` and saved as ``<out>.tokenizer/``.
    """
    files = _text_files(Path(data))
    if bpe_vocab is not None:
        from .tokenizer import train_byte_level_bpe

        tokenizer = str(Path(f"{out}.tokenizer").resolve())
        train_byte_level_bpe(files, bpe_vocab, Path(tokenizer))
    corpus = load_corpus(data, tokenizer=tokenizer)
    write_token_file(out, corpus.tokens, vocab_size=corpus.vocab_size, tokenizer=corpus.tokenizer)
    return corpus


def _generator(seed: int, stream: int, step: int) -> torch.Generator:
    # Mix the three into one 63-bit seed; distinct (stream, step) pairs give unrelated draws.
    mixed = (seed * 1_000_003 + stream) * 0x9E3779B97F4A7C15 + step
    return torch.Generator().manual_seed(mixed % (1 << 63))


def sample_windows(tokens: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) ``[len(offsets), seq_len]`` int64: windows and the same shifted by one."""
    rows = torch.stack([tokens[o:o + seq_len + 1].to(torch.int64) for o in offsets.tolist()])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


@dataclasses.dataclass
class BatchSampler:
    """This DP rank's micro-batches of each global batch, a pure function of (seed, step).

    The global batch of a step is ``grad_accum x dp_size x micro_batch`` windows; micro-batch
    ``k`` of DP rank ``r`` is row ``k``, columns ``r*micro_batch ...`` of that grid, so any
    (DP size, micro-batch) with the same product sees the same windows in each accumulation step.
    With ``rank_contiguous`` (the TP-invariant mode) it is micro-batch ``r*grad_accum + k`` of the
    step's ``grad_accum x dp_size`` instead: micro-batch ``j`` holds the same windows at any DP
    size, and a rank's micro-batches are consecutive (a subtree of the gradient sum).
    """

    tokens: torch.Tensor
    seq_len: int
    micro_batch: int
    grad_accum: int
    dp_rank: int
    dp_size: int
    seed: int
    stream: int = 0
    rank_contiguous: bool = False

    def offsets(self, step: int) -> torch.Tensor:
        """Offsets of the whole global batch, ``[grad_accum, dp_size, micro_batch]``."""
        high = self.tokens.numel() - self.seq_len - 1
        count = self.grad_accum * self.dp_size * self.micro_batch
        drawn = torch.randint(0, high, (count,), generator=_generator(self.seed, self.stream, step))
        if self.rank_contiguous:
            return drawn.view(self.dp_size, self.grad_accum, self.micro_batch).transpose(0, 1)
        return drawn.view(self.grad_accum, self.dp_size, self.micro_batch)

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mine = self.offsets(step)[:, self.dp_rank]
        return [sample_windows(self.tokens, row, self.seq_len) for row in mine]
