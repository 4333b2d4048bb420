"""Incremental detokenization with stop strings.

Text is released only when it is final: an incomplete UTF-8 sequence (decoded as U+FFFD)
and any tail that could still grow into a stop string are held back, so a client never sees
text that a later token retracts.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


# Tokens decoded together ahead of the new ones, so that merges across the boundary
# (byte-level BPE, sentencepiece's leading spaces) decode the same as in the full text.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """``context``: the tokens before the first one added (the prompt), as vLLM primes its
    detokenizer: a sentencepiece decoder strips the leading space of a text's first word, so
    "▁Paris" after a prompt reads " Paris", not "Paris"."""

    def __init__(
        self,
        decoder: Decoder,
        stop: list[str],
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        context: Sequence[int] = (),
    ) -> None:
        self._decoder = decoder
        self._skip_special = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop  # the text ends after the stop string, not before
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._partials = [_StopPrefix(s) for s in self._stop]
        self._searched = 0  # chars of self.text already searched for stop strings
        self._fed = 0  # chars of self.text fed to self._partials
        self._tokens: list[int] = list(context[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the context window
        self._read_offset = len(self._tokens)  # tokens whose text is already in self.text (or context)
        self.text = ""  # decoded so far (may include held-back tail)
        self._released = 0  # chars of self.text handed out
        self._stops_from = 0  # stop strings are searched from here on (min_tokens)
        self.stopped_by: str | None = None  # the stop string the text was cut at

    def add(self, token_id: int, stops: bool = True) -> tuple[str, bool]:
        """Add a token; returns (newly released text, hit_stop_string). After a hit the
        text ends just before the stop string (after it with ``include_stop``) and nothing more
        should be added.
        ``stops=False`` (before min_tokens): no stop string counts in the text so far."""
        self._tokens.append(token_id)
        if not self._absorb(final=False):
            return "", False  # mid UTF-8 sequence: wait for the next byte
        if not stops:
            self._stops_from = len(self.text)
            return self._release(len(self.text)), False
        return self._scan(final=False)

    def flush(self) -> tuple[str, bool]:
        """The request finished for another reason: release everything held back, including
        an incomplete character (as U+FFFD), still cutting at a stop string; returns (the text,
        hit_stop_string), since a stop string in the held-back text is then why it ends."""
        self._absorb(final=True)
        return self._scan(final=True)

    def _absorb(self, final: bool) -> bool:
        """Decode the tokens not yet in ``self.text``; False if they end mid-character."""
        if self._read_offset == len(self._tokens):
            return True
        prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset :])
        if full.endswith("\ufffd") and not final:
            return False
        self.text += full[len(prefix) :]
        self._prefix_offset = max(0, len(self._tokens) - _CONTEXT_TOKENS)
        self._read_offset = len(self._tokens)
        return True

    def _scan(self, final: bool) -> tuple[str, bool]:
        if not self._stop:
            return self._release(len(self.text)), False
        # Text searched before holds no stop string: only one ending in the new text can be there.
        start = max(self._stops_from, self._searched - self._max_stop + 1)
        self._searched = len(self.text)
        hits = [(i, -len(s)) for i, s in ((self.text.find(s, start), s) for s in self._stop) if i >= 0]
        if hits:
            at, minus_length = min(hits)  # the first stop string; of two there, the longer
            self.stopped_by = self.text[at : at - minus_length]
            self.text = self.text[: at - minus_length if self._include_stop else at]
            return self._release(len(self.text)), True
        hold = 0 if final else self._partial_stop_suffix()
        return self._release(len(self.text) - hold), False

    def _release(self, upto: int) -> str:
        if upto <= self._released:
            return ""
        chunk = self.text[self._released : upto]
        self._released = upto
        return chunk

    def _partial_stop_suffix(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        new, self._fed = self.text[self._fed :], len(self.text)
        for partial in self._partials:
            partial.feed(new)
        return max(partial.length for partial in self._partials)

    def _decode(self, tokens: list[int]) -> str:
        if not tokens:
            return ""
        return self._decoder.decode(tokens, skip_special_tokens=self._skip_special)


class _StopPrefix:
    """How long a tail of the text fed so far is a proper prefix of ``stop`` (Knuth-Morris-Pratt):
    time linear in the text fed, where trying every prefix on each token was quadratic in the
    stop string's length."""

    def __init__(self, stop: str) -> None:
        self._stop = stop
        self._borders = _borders(stop)
        self.length = 0

    def feed(self, text: str) -> None:
        stop, borders, k = self._stop, self._borders, self.length
        if len(text) >= len(stop):  # the tail that can match lies in the new text's last chars
            text, k = text[1 - len(stop) :], 0
        for char in text:
            while k and char != stop[k]:
                k = borders[k - 1]
            if char == stop[k]:
                k += 1
            if k == len(stop):  # the whole stop string (before min_tokens): its longest proper prefix
                k = borders[k - 1]
        self.length = k


@functools.lru_cache(maxsize=64)  # the n choices of a request share their stop strings
def _borders(stop: str) -> tuple[int, ...]:
    """KMP's failure function: per i, the longest proper prefix of stop[: i + 1] that ends it."""
    borders = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = borders[k - 1]
        if stop[i] == stop[k]:
            k += 1
        borders[i] = k
    return tuple(borders)
