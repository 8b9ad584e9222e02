"""One choice's text as it streams: token ids in, text deltas out, cut at a stop string.

A token can end inside a UTF-8 character, so text is held back while it ends in a replacement character. A stop
string ends the text where it starts (OpenAI's rule: the stop string is not returned), so while streaming the last
len(stop) - 1 characters are held back until no stop string can still begin there. End-of-turn tokens are not
text.
"""
from __future__ import annotations

from typing import Callable, Sequence


class TextStream:
    def __init__(self, detokenize: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        """detokenize: token ids -> text without end-of-turn tokens (Engine.decode(..., skip_end_tokens=True))."""
        self._detokenize = detokenize
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.tokens: list[int] = []
        self.emitted = ""        # the text sent so far
        self.stopped = False     # a stop string was found: the text is complete

    def push(self, token: int) -> str:
        """Add one token; the text that is now safe to send (maybe empty)."""
        self.tokens.append(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """The choice ended: whatever was held back and is not a stop string."""
        return self._advance(final=True)

    @property
    def text(self) -> str:
        """The whole text so far, cut at a stop string."""
        return self._cut(self._detokenize(self.tokens))[0]

    def _cut(self, text: str) -> tuple[str, bool]:
        cuts = [text.find(stop) for stop in self._stop]
        cuts = [cut for cut in cuts if cut >= 0]
        return (text[:min(cuts)], True) if cuts else (text, False)

    def _advance(self, final: bool) -> str:
        if self.stopped:
            return ""
        text, self.stopped = self._cut(self._detokenize(self.tokens))
        if not (final or self.stopped):
            if text.endswith("\ufffd"):   # a character still split across tokens
                text = text.rstrip("\ufffd")
            text = text[:len(text) - self._hold] if self._hold else text
        if not text.startswith(self.emitted) or len(text) <= len(self.emitted):
            return ""   # a later token re-read earlier bytes differently: send nothing rather than contradict
        delta, self.emitted = text[len(self.emitted):], text
        return delta
