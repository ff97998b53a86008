"""Training data: text read compactly, token files and their sidecars checked before any rank starts."""

import hashlib
import json

import pytest
import torch

from tensorpar.cli.main import main
from tensorpar.training import data
from tensorpar.training.data import EOT, load_corpus, write_token_file


def _train_error(capsys, *argv):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.removeprefix("tensorpar train: error: ").removesuffix("\n")


def test_text_is_read_block_by_block_into_byte_tokens_with_eot_after_each_document(tmp_path):
    texts = [b"first file\n" * 7, b"", "second: \u00e9\u4e2d\n".encode() * 5, b"x"]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_bytes(text)
    files = sorted(tmp_path.iterdir())
    expected = [t for text in texts if text for t in [*text, EOT]]
    for block in (3, 16, 1 << 20):  # documents spanning blocks, and one block for all
        tokens, utf8 = data._files_to_tokens(files, "test", block=block)
        assert tokens.dtype == torch.int16 and tokens.tolist() == expected
        assert utf8  # a character split between two blocks is still UTF-8
    assert load_corpus(tmp_path).tokens.tolist() == expected
    assert load_corpus(tmp_path).source == f"--data {tmp_path}"


def test_a_file_that_is_not_utf8_is_trained_on_its_bytes_and_the_source_says_so(tmp_path):
    """Issue 26: binary --data trained silently, as if it were text."""
    (tmp_path / "a.txt").write_text("plain text\n")
    (tmp_path / "b.bin.txt").write_bytes(b"\x7fELF\x02\x01\xff\xfe\x00" * 10 + "\u00e9".encode()[:1])
    corpus = load_corpus(tmp_path)
    assert corpus.tokens.tolist()[:11] == list(b"plain text\n")
    assert corpus.source == f"--data {tmp_path} (not UTF-8 text: trained on its bytes)"
    (tmp_path / "b.bin.txt").write_bytes("\u00e9".encode()[:1])  # cut inside a character, at the end
    assert load_corpus(tmp_path).source.endswith("(not UTF-8 text: trained on its bytes)")


def test_token_file_sidecar_records_count_and_hash(tmp_path):
    path = tmp_path / "tokens.bin"
    write_token_file(path, torch.arange(1000) % 700, vocab_size=700)
    sidecar = json.loads((tmp_path / "tokens.bin.json").read_text())
    assert sidecar == {"format": "tensorpar-tokens", "dtype": "uint16", "count": 1000,
                       "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "vocab_size": 700}
    write_token_file(path, torch.arange(10), vocab_size=10, tokenizer="/tok")
    assert json.loads((tmp_path / "tokens.bin.json").read_text())["tokenizer"] == "/tok"


def _sidecar_cases():
    """(name, edit(sidecar dict, token file) -> new sidecar text or None to remove it, message)."""
    def field(name, value):
        return lambda meta, _: json.dumps({**meta, name: value})

    def flipped(meta, path):
        blob = bytearray(path.read_bytes())
        blob[10] ^= 1
        path.write_bytes(bytes(blob))
        return json.dumps(meta)

    return [
        ("missing", lambda meta, _: None,
         "--data {bin}: a token file needs its sidecar {bin}.json (tensorpar prepare writes both); a text file "
         "needs another name than .bin"),
        ("list", lambda meta, _: json.dumps([meta]), "{bin}.json: the file is a JSON list, expected an object"),
        ("not-json", lambda meta, _: "{format", "{bin}.json: unreadable token-file sidecar (Expecting"),
        ("format", field("format", "tensorpar-token"),
         "{bin}.json: field 'format' is 'tensorpar-token'; expected one of ['tensorpar-tokens']"),
        ("no-count", lambda meta, _: json.dumps({k: v for k, v in meta.items() if k != "count"}),
         "{bin}.json: field 'count' is missing"),
        ("dtype-lies", field("dtype", "int32"),
         "--data {bin}: size 2000 bytes is not the 1,000 int32 tokens (4000 bytes) that field 'count' of "
         "{bin}.json records"),
        ("dtype-too-small", field("dtype", "uint8"), "{bin}.json: field 'vocab_size' is 700, more than uint8 token "
                                                     "ids hold (256)"),
        ("tokenizer-dict", field("tokenizer", {"path": "x"}),
         "{bin}.json: field 'tokenizer' is {{'path': 'x'}}; expected a string"),
        ("vocab-float", field("vocab_size", 3e7), "{bin}.json: field 'vocab_size' is 30000000.0; expected an integer"),
        ("vocab-beyond-dtype", field("vocab_size", 30_000_000),
         "{bin}.json: field 'vocab_size' is 30000000, more than uint16 token ids hold (65536)"),
        ("extra-field", field("eval", "__import__('os')"),
         "{bin}.json: field 'eval' is not one of ['count', 'dtype', 'format', 'sha256', 'tokenizer', 'vocab_size']"),
        ("hash", flipped, "--data {bin}: its SHA-256 is not the one {bin}.json records (the data changed"),
    ]


@pytest.mark.parametrize("name, edit, message", _sidecar_cases(), ids=[c[0] for c in _sidecar_cases()])
def test_bad_token_files_are_refused_before_launch_naming_file_and_field(capsys, tmp_path, name, edit, message):
    path = tmp_path / "tokens.bin"
    write_token_file(path, torch.arange(1000) % 700, vocab_size=700)
    sidecar = tmp_path / "tokens.bin.json"
    text = edit(json.loads(sidecar.read_text()), path)
    if text is None:
        sidecar.unlink()
    else:
        sidecar.write_text(text)
    assert _train_error(capsys, "--data", str(path)).startswith(message.format(bin=path))


def test_prepare_writes_a_token_file_that_trains_without_a_complaint(capsys, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello tokens\n" * 50)
    out = tmp_path / "notes.bin"
    assert main(["prepare", str(text), "--out", str(out)]) == 0
    count, vocab_size, _ = data.inspect_data(out)
    assert (count, vocab_size) == (len("hello tokens\n") * 50 + 1, 257)
    assert json.loads((tmp_path / "notes.bin.json").read_text())["count"] == count
