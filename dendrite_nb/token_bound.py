"""The fewest tokens a text can encode to, known from its length alone: text too long for a branch is refused
before it is tokenized (a 5 MB prompt took 28 s to tokenize, only to be refused as too long).

One token stands for at most `longest_chars` characters of text, so a text of N characters encodes to at least
ceil(N / longest_chars) tokens. The vocabulary gives it: its longest token (special tokens included), measured in
the characters the vocabulary writes tokens in, is at least as long as the text any token stands for. A byte-level
BPE vocabulary (GPT-2, Llama 3, Qwen, SmolLM) writes one character per byte, and a character of text is one to
four bytes; a SentencePiece one writes a space as one '▁' and a byte it falls back to as six ('<0x0A>').

The normalizer may shorten the text before that: NFC and NFKC (Qwen's) compose a letter and its marks into one
character, and none stands for more than 4 (Unicode adds no new composites to NFC), so under them the longest
token is counted 4 times over. Other normalizers are taken only when they never shorten text (Prepend, Lowercase,
NFD, NFKD, Replace of a string by one at least as long).

Beyond that, a bound is given only where nothing else maps more text to one token: a `tokenizers` BPE model that
does not fuse a run of unknown characters into one `<unk>` (or falls back to bytes instead), and a pre-tokenizer
that never drops a character. A special token that strips the whitespace beside it (`lstrip` / `rstrip`, as
Phi-3's do) swallows any run of it, so for those tokenizers whitespace is not counted. Any other tokenizer gets
no bound: its text is tokenized, then counted.
"""
from __future__ import annotations

import json
from typing import Any, NamedTuple

# The most characters of text one normalized character stands for, by normalizer (Replace is checked apart: it
# depends on its strings). NFC and NFKC compose at most 4 characters into one (U+1FAF: an omega and 3 marks).
_SHRINK = {"Prepend": 1, "Lowercase": 1, "NFD": 1, "NFKD": 1, "NFC": 4, "NFKC": 4}
# Pre-tokenizers that only split the text or map each character to one or more; with behavior "Removed", Split
# and Punctuation drop what they match.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Punctuation", "Digits", "UnicodeScripts"})
_BYTE_TOKENS = [f"<0x{byte:02X}>" for byte in range(256)]  # SentencePiece's byte fallback


class TokenBound(NamedTuple):
    """What a tokenizer's vocabulary says about the fewest tokens of a text."""
    longest_chars: int      # the most characters of text one token stands for
    skips_whitespace: bool  # a special token may swallow whitespace beside it: only the rest is counted

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to (special tokens the tokenizer adds not counted)."""
        # str.split() cuts at every character the tokenizers library strips (Rust's White_Space) and a few more
        # (U+001C to U+001F), so the count stays a lower bound.
        chars = len("".join(text.split())) if self.skips_whitespace else len(text)
        return -(-chars // self.longest_chars)


def token_bound(tokenizer: Any) -> TokenBound | None:
    """The bound for a transformers tokenizer backed by `tokenizers`, or None where none is known (see above)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    model = backend.model
    if model.fuse_unk and not (model.byte_fallback and all(token in vocab for token in _BYTE_TOKENS)):
        return None
    shrink = _shrink(_state(backend.normalizer))
    if shrink is None or not _drops_nothing(_state(backend.pre_tokenizer)):
        return None
    strips = any(added.lstrip or added.rstrip for added in backend.get_added_tokens_decoder().values())
    return TokenBound(shrink * max(map(len, vocab), default=1), strips)


def _state(component: Any) -> dict[str, Any] | None:
    return None if component is None else json.loads(component.__getstate__())


def _shrink(normalizer: dict[str, Any] | None) -> int | None:
    """The most characters of text one character of the normalizer's output stands for; None: no limit known."""
    if normalizer is None:
        return 1
    kind = normalizer["type"]
    if kind == "Sequence":
        total = 1
        for step in normalizer["normalizers"]:
            shrink = _shrink(step)
            if shrink is None:
                return None
            total *= shrink
        return total
    if kind == "Replace":
        pattern = normalizer["pattern"].get("String")  # a Regex pattern may match any length
        return 1 if pattern is not None and len(normalizer["content"]) >= len(pattern) else None
    return _SHRINK.get(kind)


def _drops_nothing(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer["type"]
    if kind == "Sequence":
        return all(map(_drops_nothing, pre_tokenizer["pretokenizers"]))
    return kind in _KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"
