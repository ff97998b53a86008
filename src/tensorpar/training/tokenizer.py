"""Hugging Face tokenizers for training data, prompts and exports (needs ``transformers``).

A run tokenized by a Hugging Face tokenizer saves it into each checkpoint; ``generate``
encodes prompts and decodes text with it, and ``export`` saves it beside the model, so
``transformers.pipeline("text-generation", model=EXPORTED)`` works as is. ``--bpe-vocab N``
trains a byte-level BPE on the data with ``tokenizers`` and saves it as such a directory.
A byte-token run has no tokenizer of its own: its export carries :func:`byte_tokenizer`.

Example::

    tokenizer = load_tokenizer("llama-dir/")
    tokens = tokenize_files([Path("book.txt")], tokenizer)     # documents end with EOS
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..errors import UsageError
from .os_text import utf8_named

END_OF_TEXT = "<|endoftext|>"


def has_tokenizer(directory) -> bool:
    """Whether ``directory`` holds Hugging Face tokenizer files."""
    return any((Path(directory) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))


def load_tokenizer(directory, *, flag: str = "--tokenizer"):
    """The ``transformers`` tokenizer saved in ``directory`` (never code from it)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError(f"{flag} needs transformers: pip install 'tensorpar[hf]'") from None
    if not has_tokenizer(directory):
        raise UsageError(f"{flag} {directory}: no tokenizer.json or tokenizer_config.json there")
    try:
        with utf8_named(directory) as named:
            return AutoTokenizer.from_pretrained(str(named), trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag} {directory}: cannot load the tokenizer ({exc})") from None
    except RecursionError:
        raise UsageError(f"{flag} {directory}: cannot load the tokenizer (its JSON is nested deeper than any "
                         "tokenizer's)") from None
    except Exception as exc:  # noqa: BLE001 - the files are input: the Rust parser raises plain Exception
        raise UsageError(f"{flag} {directory}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from None



def resolve_tokenizer(args, meta: dict | None) -> None:
    """``args.tokenizer``: ``--tokenizer``, else that of the run ``meta`` describes (resumed or
    ``--init-from``), else the ``--init-from-hf`` directory's when it has one (as an absolute
    path), else None (byte tokens for text)."""
    if args.tokenizer is None and meta is not None and meta.get("tokenizer") not in (None, "bytes"):
        args.tokenizer = meta["tokenizer"]
    if args.tokenizer is None and args.init_from_hf is not None and has_tokenizer(args.init_from_hf):
        args.tokenizer = args.init_from_hf
    if args.tokenizer is not None:
        args.tokenizer = str(Path(args.tokenizer).resolve())


def tokenize_files(files: list[Path], tokenizer) -> torch.Tensor:
    """Every file's tokens (no special tokens added), each document followed by EOS if the
    tokenizer has one, as one int32 tensor (only one document's ids are a Python list at a time)."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    documents = [torch.zeros(0, dtype=torch.int32)]
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text:
            documents.append(torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"] + eos,
                                          dtype=torch.int32))
    return torch.cat(documents)


def train_byte_level_bpe(files: list[Path], vocab_size: int, directory: Path):
    """A byte-level BPE of ``vocab_size`` tokens trained on ``files``, saved in ``directory``."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise UsageError("--bpe-vocab needs tokenizers and transformers: pip install 'tensorpar[hf]'") from None
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with contextlib.ExitStack() as named:
        bpe.train([str(named.enter_context(utf8_named(f))) for f in files], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT,
                                        unk_token=END_OF_TEXT)
    save_tokenizer(tokenizer, directory)
    return tokenizer


def save_tokenizer(tokenizer, directory) -> None:
    """``tokenizer.save_pretrained(directory)``, whatever bytes name ``directory``."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    with utf8_named(directory) as named:
        tokenizer.save_pretrained(str(named))


def _byte_chars() -> dict[int, str]:
    """The character ``tokenizers``' ByteLevel step writes for each byte: printable Latin-1 as
    itself, every other byte as the next character from U+0100 on (GPT-2's choice)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)}
    others = iter(range(256, 512))
    return {byte: chr(byte if byte in printable else next(others)) for byte in range(256)}


def byte_tokenizer(*, max_length: int):
    """A ``transformers`` tokenizer of byte tokens: id ``b`` is the byte ``b`` (text is its UTF-8
    bytes), id 256 ``<|endoftext|>`` is EOS. It encodes and decodes as :func:`.data.encode` and
    :func:`.data.decode` do (malformed UTF-8 becomes U+FFFD), without merges, without adding any
    special token, and a literal ``<|endoftext|>`` in a text stays bytes.

    Example: ``byte_tokenizer(max_length=128).save_pretrained("out")``
    """
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise UsageError("exporting a byte-token run needs tokenizers and transformers: "
                         "pip install 'tensorpar[hf]'") from None
    # ByteLevel maps each byte to one character of _byte_chars; the vocabulary maps it back to
    # the byte, and its decoder joins the bytes and decodes them as UTF-8, lossily.
    tokens = Tokenizer(models.BPE(vocab={char: byte for byte, char in _byte_chars().items()}, merges=[]))
    tokens.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokens.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokens, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT,
                                   clean_up_tokenization_spaces=False, split_special_tokens=True,
                                   model_max_length=max_length)
