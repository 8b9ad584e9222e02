"""The tokenizer of a GGUF file, built by transformers from the file's metadata and cached.

transformers rebuilds a GGUF's tokenizer (vocabulary, merges, special tokens, chat template) from the
metadata, which takes seconds for a real vocabulary (about 8 s for SmolLM2's 49,152 tokens on a small
machine). The result is a function of the metadata bytes and of the transformers and tokenizers versions
alone, so it is saved once under a SHA-256 of those and read back next time (about 0.5 s). The cache lives
in $DENDRITE_NB_CACHE or ~/.cache/dendrite_nb, under gguf-tokenizers/; deleting it is always safe, and a
cache that cannot be written or read only costs the rebuild.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from importlib.metadata import version

from ..errors import CheckpointError
from ..paths import default_cache_dir

CACHE_FOLDER = "gguf-tokenizers"
# Bump when what is saved changes, so that older entries are ignored.
_CACHE_FORMAT = "1"


def cache_root() -> Path:
    return default_cache_dir() / CACHE_FOLDER


def cache_key(metadata: bytes | memoryview) -> str:
    """SHA-256 of the file's metadata bytes and of the code that turns them into a tokenizer."""
    digest = hashlib.sha256(metadata)
    # Versions read from the installed metadata: importing transformers here would add ~1 s to `import dendrite_nb`.
    digest.update(f"|{_CACHE_FORMAT}|{version('transformers')}|{version('tokenizers')}".encode())
    return digest.hexdigest()


def gguf_tokenizer(path: Path, metadata: bytes | memoryview, num_tokens: int) -> Any:
    """The tokenizer that the GGUF file at `path` describes. `metadata` is the file's bytes before its tensor
    table (the header and every key), which decide the tokenizer; `num_tokens` is the length of its token list.

    A fresh conversion is saved and read back like a cached one, so that both loads give the same object:
    transformers' own class for the family (Qwen2Tokenizer, ...) would rebuild the normalizer and pre-tokenizer
    on a reload, where the generic class keeps the tokenizer.json it is given.
    """
    entry = cache_root() / cache_key(metadata)
    cached = _read(entry)
    if cached is not None:
        return cached
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"cannot build a tokenizer from the metadata of {str(path)!r} ({error}); the file "
                              f"needs tokenizer.ggml.* keys of a tokenizer transformers can read (gpt2 BPE or "
                              f"llama sentencepiece).") from error
    with _staging(entry) as staging:
        tokenizer.save_pretrained(str(staging))
        _drop_invented_tokens(staging / "tokenizer.json", num_tokens)
        tokenizer = _read(staging)
        if tokenizer is None:
            raise CheckpointError(f"the tokenizer transformers built from {str(path)!r} cannot be read back.")
        with contextlib.suppress(OSError):  # another process put the same entry in place first
            os.replace(staging, entry)
    return tokenizer


def _read(folder: Path) -> Any | None:
    if not (folder / "tokenizer.json").is_file():
        return None
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError, TypeError):  # damaged by hand or by a full disk: rebuilt
        shutil.rmtree(folder, ignore_errors=True)
        return None


def _drop_invented_tokens(tokenizer_json: Path, num_tokens: int) -> None:
    """transformers' byte-level builder adds GPT-2's <|endoftext|> to a vocabulary without it (Llama 3's), past
    the model's embedding rows, where a prompt that spells it would index out of range. Only the file's
    tokens stay."""
    state = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    kept = [token for token in state.get("added_tokens", []) if token["id"] < num_tokens]
    if len(kept) != len(state.get("added_tokens", [])):
        state["added_tokens"] = kept
        tokenizer_json.write_text(json.dumps(state, ensure_ascii=False), encoding="utf-8")


@contextlib.contextmanager
def _staging(entry: Path) -> Iterator[Path]:
    """A folder beside the cache entry, renamed into place once complete, so that a crash or a concurrent
    writer never leaves a half-written entry that a later load would trust; a temporary folder elsewhere when
    the cache cannot be written (a read-only home: loading still works, only slower next time)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name[:16]}-", dir=entry.parent))
    except OSError:
        staging = Path(tempfile.mkdtemp(prefix="dendrite-gguf-tokenizer-"))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
