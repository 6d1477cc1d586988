"""GGUF tokenizers against llama.cpp's own test vectors.

llama-cpp-python's sdist (PyPI) vendors llama.cpp's vocab-only GGUFs with the
texts (`.inp`) and the token ids llama.cpp produces for them (`.out`); they are
fetched once with pip into the tokenloom cache.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tokenloom.loader import hub
from tokenloom.loader.gguf import GGUFFile

SDIST = "llama-cpp-python==0.3.36"
VOCABS = ["gpt-2", "llama-bpe", "qwen2", "llama-spm"]  # byte-level BPE x3 (pre-tokenizers differ), SentencePiece
SEPARATOR = "\n__ggml_vocab_test__\n"


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    target = hub.cache_dir() / "test-data" / "llama-cpp-vocabs"
    wanted = [f"ggml-vocab-{v}.gguf{ext}" for v in VOCABS for ext in ("", ".inp", ".out")]
    if all((target / w).is_file() for w in wanted):
        return target
    download = hub.cache_dir() / "downloads"
    sdists = sorted(download.glob("llama_cpp_python-0.3.36.tar.gz"))
    if not sdists:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--disable-pip-version-check",
                "-q",
                "-d",
                str(download),
                SDIST,
            ],
            check=True,
        )
        sdists = sorted(download.glob("llama_cpp_python-0.3.36.tar.gz"))
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdists[0]) as tar:
        for member in tar:
            name = Path(member.name).name
            if member.isfile() and "/vendor/llama.cpp/models/" in member.name and name in wanted:
                (target / name).write_bytes(tar.extractfile(member).read())
    return target


@pytest.fixture(scope="session")
def vocab_tokenizer(vocab_dir):
    """vocab name -> Tokenizer, built once (gguf's reader takes ~10 s on the 128k-token vocabs)."""
    built = {}

    def get(vocab: str):
        if vocab not in built:
            built[vocab] = GGUFFile(vocab_dir / f"ggml-vocab-{vocab}.gguf").tokenizer()
        return built[vocab]

    return get


def _cases(vocab_dir: Path, vocab: str) -> list[tuple[str, list[int]]]:
    base = vocab_dir / f"ggml-vocab-{vocab}.gguf"
    texts = Path(f"{base}.inp").read_text(encoding="utf-8").split(SEPARATOR)
    ids = Path(f"{base}.out").read_text(encoding="utf-8").split("\n")
    assert len(texts) == len(ids) > 40
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, ids)]


@pytest.mark.parametrize("vocab", VOCABS)
def test_encode_matches_llama_cpp(vocab_dir, vocab_tokenizer, vocab):
    tokenizer = vocab_tokenizer(vocab)
    cases = _cases(vocab_dir, vocab)
    mismatches = [
        (text, tokenizer.encode(text, add_special_tokens=False), ids)
        for text, ids in cases
        if tokenizer.encode(text, add_special_tokens=False) != ids
    ]
    assert not mismatches, f"{len(mismatches)}/{len(cases)} differ, first: {mismatches[0]!r}"


@pytest.mark.parametrize("vocab", ["gpt-2", "llama-bpe", "qwen2"])
def test_byte_level_decode_round_trips(vocab_dir, vocab_tokenizer, vocab):
    tokenizer = vocab_tokenizer(vocab)
    for text, ids in _cases(vocab_dir, vocab):
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_sentencepiece_adds_bos_and_decodes(vocab_tokenizer):
    tokenizer = vocab_tokenizer("llama-spm")
    ids = tokenizer.encode("Hello world")
    assert ids[0] == 1 and tokenizer.id_to_token(ids[0]) == "<s>"  # Llama 2 adds BOS by default
    assert tokenizer.decode(ids) == "Hello world"
    assert tokenizer.decode(tokenizer.encode("  two spaces\n\tand a tab")) == "  two spaces\n\tand a tab"
